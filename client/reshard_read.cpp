// Reading a version from a source replica of another layout (see reshard_read.h).
#include "client/reshard_read.h"

#include <algorithm>
#include <cstring>
#include <exception>
#include <memory>
#include <mutex>
#include <new>
#include <span>
#include <system_error>
#include <thread>

#include "client/convert.h"
#include "core/assert.h"
#include "core/limits.h"
#include "core/reshard.h"

namespace th::client_impl {

DataPlaneGeometry data_plane_geometry(const ShardLayout& layout) {
  DataPlaneGeometry geometry;
  const auto& tensors = layout.tensors();
  geometry.place.resize(tensors.size());
  for (std::size_t index = 0; index < tensors.size(); ++index) {
    if (tensors[index].bytes < kPackedTensorBytesMax) {
      geometry.place[index] = {0, geometry.packed_bytes};
      geometry.packed_offset.push_back(geometry.packed_bytes);
      geometry.packed_bytes += tensors[index].bytes;
    } else {
      geometry.packed_offset.push_back(Plan::kNotPacked);
      geometry.big.push_back(index);
    }
  }
  // The packed buffer is a region only if it has a byte (regions_of): the big ones follow it.
  const std::uint32_t first_big = geometry.packed_bytes > 0 ? 1 : 0;
  for (std::size_t k = 0; k < geometry.big.size(); ++k) {
    geometry.place[geometry.big[k]] = {first_big + static_cast<std::uint32_t>(k), 0};
  }
  TH_ASSERT(geometry.packed_offset.size() == tensors.size());
  return geometry;
}

namespace {

ReshardOutcome failed(ReadFailure failure, std::string detail) {
  ReshardOutcome outcome;
  outcome.failure = failure;
  outcome.detail = std::move(detail);
  return outcome;
}

std::string kind_name(TensorKind kind) { return kind == TensorKind::kLocal ? "a shard's own tensor of a shape" : "bytes"; }

// The hub's description of the source, checked as any peer's message is before it is used: a
// wrong one fails the read (the hub picks another source), it does not stop the process.
std::optional<std::string> invalid_source(const std::vector<SourceShard>& shards) {
  if (shards.size() > limits::kShardsMax) {
    return "the source has " + std::to_string(shards.size()) + " shards, more than " + std::to_string(limits::kShardsMax);
  }
  for (std::size_t shard = 0; shard < shards.size(); ++shard) {
    const SourceShard& source = shards[shard];
    const std::string which = "source shard " + std::to_string(shard) + " (" + source.endpoint + ")";
    if (source.layout == nullptr) return which + " comes without its layout";
    const auto& tensors = source.layout->tensors();
    if (source.checksums == nullptr || source.checksums->size() != tensors.size()) {
      return which + " comes without a checksum for each of its " + std::to_string(tensors.size()) + " tensors";
    }
    for (const TensorSpec& tensor : tensors) {
      if (tensor.kind != TensorKind::kPiece) continue;
      // (A piece's bytes are its box's elements: register refuses anything else.)
      if (element_count(tensor.box.extent) * dtype_bytes(tensor.dtype) != tensor.bytes) {
        return which + ": piece '" + tensor.name + "' of " + std::to_string(tensor.bytes) + " bytes is not its box " +
               describe_box(tensor.box);
      }
    }
  }
  return std::nullopt;
}

// One destination per tensor of the reader, in layout order: destination i is tensor i.
std::optional<std::string> destinations_of(const ShardLayout& layout, std::vector<Destination>& destinations) {
  for (const TensorSpec& tensor : layout.tensors()) {
    if (tensor.kind != TensorKind::kPiece) {
      return "tensor '" + tensor.name + "' is registered as " + kind_name(tensor.kind) +
             ", not as a piece of the model's tensor: it cannot be read from a source of another layout";
    }
    destinations.push_back(Destination{tensor.name, tensor.dtype, {Segment{tensor.name, tensor.shape, tensor.box}}});
  }
  return std::nullopt;
}

// A buffer that is allocated once, for the read's largest need, and never zero-filled.
struct Buffer {
  std::unique_ptr<std::byte[]> bytes;
  std::uint64_t size = 0;
  bool allocate(std::uint64_t wanted) {
    if (wanted == 0) return true;
    bytes.reset(new (std::nothrow) std::byte[wanted]);
    size = bytes != nullptr ? wanted : 0;
    return bytes != nullptr;
  }
};

// At most this many pieces of one read are in flight, each on its own connection and with its own
// scratch buffer: a piece's bytes cross the network while others are verified and landed, and
// the source's shards serve side by side (measured: bench/run-reshard, bench/README.md).
constexpr std::size_t kReshardPullsInFlightMax = 4;
// The scratch and staging buffers of the pieces in flight together stay under this, unless one
// piece alone needs more (then one is in flight).
constexpr std::uint64_t kReshardScratchBytesMax = 1ull << 30;

// What one pull brings: a source shard's packed prefix (and the packed pieces in it), or one big
// piece (a region of its own).
struct Unit {
  std::uint32_t shard = 0;
  std::uint32_t region = 0;
  std::uint64_t bytes = 0;            // read from the region's start
  std::vector<std::size_t> reads;     // indices into the plan's reads
  // Where the bytes land straight from the network, or null: through a lane's scratch buffer.
  std::byte* direct = nullptr;
};

// Carries out one plan into one reader shard's buffers.
class Reshard {
 public:
  Reshard(const StartRead& read, const Plan& plan, std::byte* packed, const ReshardPlan& pieces,
          const net::PullOptions& pull, const std::atomic<bool>& cancelled, bool in_place)
      : read_(read), plan_(plan), packed_(packed), pieces_(pieces), pull_(pull), cancelled_(cancelled),
        in_place_(in_place) {
    pull_.partial = false;  // a complete source (a partial one answers short: the pull then waits)
    pull_.streams = 1;      // one region per pull
    pull_.ipc = nullptr;    // into host memory
    pull_.on_progress = nullptr;
    // A piece that failed stops the others' pulls too.
    pull_.cancelled = [this] { return cancelled_.load() || stopping_.load(); };
    for (const SourceShard& shard : read.reshard) geometry_.push_back(data_plane_geometry(*shard.layout));
  }

  // The outcome, with what was read on the way whatever it is (the handle's stats count it).
  ReshardOutcome run() {
    ReshardOutcome outcome = run_pieces();
    outcome.bytes_read = bytes_read_.load();
    outcome.pieces_read = pieces_read_.load();
    return outcome;
  }

 private:
  // The buffers of one piece in flight.
  struct Lane {
    Buffer scratch;  // one piece, or one source shard's packed prefix
    Buffer staging;  // host side of what one piece lands in GPU tensors
    std::shared_ptr<void> staging_pinned;
  };

  ReshardOutcome run_pieces();
  const TensorSpec& source_tensor(const PieceRead& piece) const {
    return read_.reshard[piece.shard].layout->tensors()[piece.tensor];
  }
  bool packed_at_source(const PieceRead& piece) const {
    return geometry_[piece.shard].packed_offset[piece.tensor] != Plan::kNotPacked;
  }
  bool staged(std::uint32_t tensor) const {
    return plan_.packed_offset[tensor] == Plan::kNotPacked && plan_.device_tensor(tensor);
  }
  std::string source_name(std::uint32_t shard) const {
    return "source shard " + std::to_string(shard) + " (" + read_.reshard[shard].endpoint + ")";
  }
  void make_units();
  // Where a piece lands as it arrives, if it is one run of its destination's elements, of the same
  // dtype, in host memory (an outer-dimension split): no scratch buffer, no copy. Else null.
  std::byte* direct_target(const PieceRead& piece) const;
  std::optional<ReshardOutcome> allocate(std::size_t lanes);
  // Pulls one unit into the lane's scratch buffer, verifies its pieces and lands them.
  std::optional<ReshardOutcome> run_unit(const Unit& unit, Lane& lane);
  // Reads [0, bytes) of `region` of source shard `shard` into `target`.
  std::optional<ReshardOutcome> pull(std::uint32_t shard, std::uint32_t region, std::uint64_t bytes, std::byte* target);
  // Checks the piece at `data` against its source shard's checksum.
  std::optional<ReshardOutcome> verify(const PieceRead& piece, const std::byte* data);
  // Lands what the reader needs of the verified piece at `data`.
  void land(const PieceRead& piece, const std::byte* data, Lane& lane);
  // The packed tensors, landed in the packed buffer, into the registered ones (where the
  // application sees them), as a same-layout read scatters them.
  void scatter_packed();
  ChecksumsRef assembled_checksums() const;

  const StartRead& read_;
  const Plan& plan_;
  std::byte* const packed_;
  const ReshardPlan& pieces_;
  net::PullOptions pull_;
  const std::atomic<bool>& cancelled_;
  const bool in_place_;
  std::atomic<bool> stopping_{false};
  std::vector<DataPlaneGeometry> geometry_;  // per source shard
  std::vector<Unit> units_;
  std::vector<Lane> lanes_;
  std::mutex gpu_mutex_;  // one lane at a time copies into the GPU
  std::atomic<std::uint64_t> bytes_read_{0};
  std::atomic<std::uint64_t> pieces_read_{0};
};

ReshardOutcome cancelled_outcome() {
  ReshardOutcome outcome;
  outcome.cancelled = true;
  return outcome;
}

// The plan lists the pieces by source shard, then tensor: a shard's packed pieces come with one
// read of its packed prefix, then its big pieces one read each.
void Reshard::make_units() {
  const auto& reads = pieces_.reads;
  for (std::size_t first = 0; first < reads.size();) {
    const std::uint32_t shard = reads[first].shard;
    Unit packed{shard, 0, 0, {}};
    std::size_t end = first;
    for (; end < reads.size() && reads[end].shard == shard; ++end) {
      if (!packed_at_source(reads[end])) continue;
      packed.bytes = std::max(packed.bytes, geometry_[shard].packed_offset[reads[end].tensor] + source_tensor(reads[end]).bytes);
      packed.reads.push_back(end);
    }
    if (!packed.reads.empty()) units_.push_back(std::move(packed));
    for (std::size_t at = first; at < end; ++at) {
      if (packed_at_source(reads[at])) continue;
      const DataPlaneGeometry::Place& place = geometry_[shard].place[reads[at].tensor];
      TH_ASSERT(place.offset_bytes == 0, "a big tensor is a region of its own");
      units_.push_back(Unit{shard, place.region, source_tensor(reads[at]).bytes, {at}, direct_target(reads[at])});
    }
    first = end;
  }
}

std::byte* Reshard::direct_target(const PieceRead& piece) const {
  if (!in_place_ || piece.landings.size() != 1 || piece.landings.front().runs.size() != 1) return nullptr;
  const std::uint32_t index = piece.landings.front().destination;
  const ElementRun& run = piece.landings.front().runs.front();
  const TensorSpec& source = source_tensor(piece);
  const TensorSpec& destination = plan_.layout->tensors()[index];
  if (destination.dtype != source.dtype || run.source_offset != 0 ||
      run.count * dtype_bytes(source.dtype) != source.bytes || plan_.packed_offset[index] != Plan::kNotPacked ||
      plan_.device_tensor(index)) {
    return nullptr;
  }
  TH_ASSERT((run.destination_offset + run.count) * dtype_bytes(destination.dtype) <= destination.bytes,
            "a run lies in its destination", destination.name);
  return plan_.tensor_data[index] + run.destination_offset * dtype_bytes(destination.dtype);
}

std::optional<ReshardOutcome> Reshard::allocate(std::size_t lanes_max) {
  std::uint64_t scratch_bytes = 0;
  std::uint64_t staging_bytes = 0;
  for (const Unit& unit : units_) {
    if (unit.direct == nullptr) scratch_bytes = std::max(scratch_bytes, unit.bytes);
    for (const std::size_t at : unit.reads) {
      std::uint64_t landed_on_device = 0;
      for (const Landing& landing : pieces_.reads[at].landings) {
        if (!staged(landing.destination)) continue;
        const std::uint32_t element_bytes = dtype_bytes(plan_.layout->tensors()[landing.destination].dtype);
        for (const ElementRun& run : landing.runs) landed_on_device += run.count * element_bytes;
      }
      staging_bytes = std::max(staging_bytes, landed_on_device);
    }
  }
  const std::uint64_t lane_bytes = std::max<std::uint64_t>(1, scratch_bytes + staging_bytes);
  const std::size_t lanes =
      std::clamp<std::size_t>(static_cast<std::size_t>(kReshardScratchBytesMax / lane_bytes), 1, lanes_max);
  // Each pull paces itself: the read's cap is shared among the pieces in flight.
  if (pull_.rate_bytes_per_s > 0) pull_.rate_bytes_per_s = std::max<std::uint64_t>(1, pull_.rate_bytes_per_s / lanes);
  lanes_.resize(lanes);
  for (Lane& lane : lanes_) {
    if (!lane.scratch.allocate(scratch_bytes) || !lane.staging.allocate(staging_bytes)) {
      return failed(ReadFailure::kSourceUnreachable, "no memory for the read's buffers (" + std::to_string(lanes) +
                                                         " x " + std::to_string(scratch_bytes) + " + " +
                                                         std::to_string(staging_bytes) + " bytes)");
    }
    // Page-locked, a copy to the GPU runs at the link's speed (pageable memory goes through the
    // driver's small bounce buffers).
    if (lane.staging.size > 0) {
      TH_ASSERT(plan_.gpu != nullptr, "tensors on a GPU come with the GPU's access");
      lane.staging_pinned = plan_.gpu->pin_host(lane.staging.bytes.get(), lane.staging.size);
    }
  }
  return std::nullopt;
}

std::optional<ReshardOutcome> Reshard::pull(std::uint32_t shard, std::uint32_t region, std::uint64_t bytes,
                                            std::byte* target) {
  TH_ASSERT(bytes > 0, "a piece has elements");
  // The regions before it are empty targets (not read); the region is read from its start.
  std::vector<net::LocalRegion> targets(static_cast<std::size_t>(region) + 1);
  targets[region] = {target, bytes, false};
  net::PullOutcome pulled;
  try {
    pulled = net::pull(net::parse_endpoint(read_.reshard[shard].endpoint), {read_.transfer, read_.epoch}, read_.secret,
                       targets, pull_);
  } catch (const net::SocketError& bad_endpoint) {
    pulled = net::PullOutcome{0, net::ReadError::kUnreachable, bad_endpoint.what()};
  }
  bytes_read_ += pulled.bytes;
  if (pulled.ok()) {
    TH_ASSERT(pulled.bytes == bytes, "a pull that succeeded filled its target");
    return std::nullopt;
  }
  if (*pulled.error == net::ReadError::kCancelled || cancelled_.load() || stopping_.load()) {
    return cancelled_outcome();
  }
  return failed(*pulled.error == net::ReadError::kRefused ? ReadFailure::kSourceRefused : ReadFailure::kSourceUnreachable,
                source_name(shard) + ": " + pulled.detail);
}

std::optional<ReshardOutcome> Reshard::verify(const PieceRead& piece, const std::byte* data) {
  const TensorSpec& source = source_tensor(piece);
  if (checksum(data, source.bytes) != (*read_.reshard[piece.shard].checksums)[piece.tensor]) {
    return failed(ReadFailure::kChecksumMismatch, "tensor '" + source.name + "' " + describe_box(source.box) + " of " +
                                                      source_name(piece.shard) + " does not match its checksum");
  }
  ++pieces_read_;
  return std::nullopt;
}

void Reshard::land(const PieceRead& piece, const std::byte* data, Lane& lane) {
  const TensorSpec& source = source_tensor(piece);
  const std::uint32_t source_element_bytes = dtype_bytes(source.dtype);
  const std::uint64_t source_elements = source.bytes / source_element_bytes;
  std::uint64_t staged_bytes = 0;
  std::vector<Gpu::Copy> to_device;
  // Lanes land different pieces: each writes its own elements of the destinations (the plan
  // covers every destination element once), so they need no lock but the GPU's.
  for (const Landing& landing : piece.landings) {
    const std::uint32_t index = landing.destination;
    TH_ASSERT(index < plan_.tensor_data.size(), "destination i is tensor i");
    const TensorSpec& destination = plan_.layout->tensors()[index];
    const std::uint32_t element_bytes = dtype_bytes(destination.dtype);
    const std::uint64_t elements = destination.bytes / element_bytes;
    const bool packed = plan_.packed_offset[index] != Plan::kNotPacked;
    const bool on_device = staged(index);
    std::byte* base = packed ? packed_ + plan_.packed_offset[index] : plan_.tensor_data[index];
    for (const ElementRun& run : landing.runs) {
      TH_ASSERT(run.count > 0 && run.source_offset + run.count <= source_elements, "a run lies in its piece",
                source.name);
      TH_ASSERT(run.destination_offset + run.count <= elements, "a run lies in its destination", destination.name);
      const std::byte* from = data + run.source_offset * source_element_bytes;
      const std::uint64_t bytes = run.count * element_bytes;
      if (!on_device) {
        convert_elements(source.dtype, from, destination.dtype, base + run.destination_offset * element_bytes, run.count);
        continue;
      }
      // Converted on the CPU, then copied in one batch per piece (one wait for a column split's
      // thousands of rows); runs that continue each other on both sides go as one copy.
      TH_ASSERT(staged_bytes + bytes <= lane.staging.size, "the staging buffer holds what one piece lands");
      std::byte* host = lane.staging.bytes.get() + staged_bytes;
      convert_elements(source.dtype, from, destination.dtype, host, run.count);
      std::byte* device = base + run.destination_offset * element_bytes;
      if (!to_device.empty() && to_device.back().device + to_device.back().bytes == device &&
          to_device.back().host + to_device.back().bytes == host) {
        to_device.back().bytes += bytes;
      } else {
        to_device.push_back({device, host, bytes});
      }
      staged_bytes += bytes;
    }
  }
  if (!to_device.empty()) {
    const std::lock_guard<std::mutex> lock(gpu_mutex_);
    plan_.gpu->to_device(to_device);
  }
}

std::optional<ReshardOutcome> Reshard::run_unit(const Unit& unit, Lane& lane) {
  if (cancelled_.load()) return cancelled_outcome();
  if (unit.direct != nullptr) {
    // (Bytes that fail their checksum stay in the destination: the read fails, and the buffers
    // hold no version until a read succeeds.)
    if (auto stopped = pull(unit.shard, unit.region, unit.bytes, unit.direct)) return stopped;
    return verify(pieces_.reads[unit.reads.front()], unit.direct);
  }
  TH_ASSERT(unit.bytes <= lane.scratch.size, "the scratch buffer holds the read's largest need");
  if (auto stopped = pull(unit.shard, unit.region, unit.bytes, lane.scratch.bytes.get())) return stopped;
  const bool packed = unit.region == 0 && packed_at_source(pieces_.reads[unit.reads.front()]);
  for (const std::size_t at : unit.reads) {
    const PieceRead& piece = pieces_.reads[at];
    const std::byte* data = lane.scratch.bytes.get() + (packed ? geometry_[unit.shard].packed_offset[piece.tensor] : 0);
    if (auto bad = verify(piece, data)) return bad;
    land(piece, data, lane);
  }
  return std::nullopt;
}

void Reshard::scatter_packed() {
  const auto& tensors = plan_.layout->tensors();
  std::vector<Gpu::Copy> to_device;
  for (std::size_t index = 0; index < tensors.size(); ++index) {
    if (plan_.packed_offset[index] == Plan::kNotPacked) continue;
    std::byte* landed = packed_ + plan_.packed_offset[index];
    if (plan_.device_tensor(index)) {
      to_device.push_back({plan_.tensor_data[index], landed, tensors[index].bytes});
    } else if (plan_.tensor_data[index] != landed) {  // (a seed copy keeps them where they landed)
      std::memcpy(plan_.tensor_data[index], landed, tensors[index].bytes);
    }
  }
  if (!to_device.empty()) plan_.gpu->to_device(to_device);
}

// As publish computes them (client/handle.cpp): a packed tensor from the packed buffer, a big
// GPU tensor on its GPU, any other where it is.
ChecksumsRef Reshard::assembled_checksums() const {
  const auto& tensors = plan_.layout->tensors();
  auto checksums = std::make_shared<Checksums>(tensors.size());
  for (std::size_t index = 0; index < tensors.size(); ++index) {
    const std::uint64_t bytes = tensors[index].bytes;
    if (plan_.packed_offset[index] != Plan::kNotPacked) {
      (*checksums)[index] = checksum(packed_ + plan_.packed_offset[index], bytes);
    } else if (plan_.device_tensor(index)) {
      (*checksums)[index] = plan_.gpu->checksum(plan_.tensor_data[index], bytes);
    } else {
      (*checksums)[index] = checksum(plan_.tensor_data[index], bytes);
    }
  }
  return checksums;
}

ReshardOutcome Reshard::run_pieces() {
  make_units();
  if (auto no_memory = allocate(std::clamp<std::size_t>(units_.size(), 1, kReshardPullsInFlightMax))) return *no_memory;
  // Each lane takes the next unit until none is left or one failed. The first failure is the
  // outcome (the others' pulls then end as cancelled); an exception (a bug, or the GPU's
  // DeviceCopyError) is carried to this thread.
  std::atomic<std::size_t> next{0};
  std::mutex outcome_mutex;
  std::optional<ReshardOutcome> stopped;
  std::exception_ptr thrown;
  auto work = [&](Lane& lane) {
    try {
      while (!stopping_.load()) {
        const std::size_t unit = next.fetch_add(1);
        if (unit >= units_.size()) return;
        if (auto outcome = run_unit(units_[unit], lane)) {
          const std::lock_guard<std::mutex> lock(outcome_mutex);
          if (!stopped || (stopped->cancelled && !outcome->cancelled)) stopped = std::move(outcome);
          stopping_ = true;
          return;
        }
      }
    } catch (...) {
      const std::lock_guard<std::mutex> lock(outcome_mutex);
      if (!thrown) thrown = std::current_exception();
      stopping_ = true;
    }
  };
  {
    std::vector<std::jthread> helpers;
    for (std::size_t lane = 1; lane < lanes_.size(); ++lane) {
      try {
        helpers.emplace_back([&, lane] { work(lanes_[lane]); });
      } catch (const std::system_error&) {
        break;  // no thread to be had: the lanes running take the rest
      }
    }
    work(lanes_[0]);
  }  // (the helpers join here)
  if (thrown) std::rethrow_exception(thrown);
  if (cancelled_.load()) return cancelled_outcome();
  if (stopped) return *stopped;
  scatter_packed();
  ReshardOutcome assembled;
  assembled.checksums = assembled_checksums();
  if (read_.checksums != nullptr) {
    // The version's checksums for this layout, from an earlier reader of it: a different
    // assembly is a bug somewhere or bad bytes that matched their piece's checksum.
    const auto& tensors = plan_.layout->tensors();
    if (read_.checksums->size() != tensors.size()) {
      return failed(ReadFailure::kChecksumMismatch, "the version's checksums name " + std::to_string(read_.checksums->size()) +
                                                        " tensors, this shard has " + std::to_string(tensors.size()));
    }
    for (std::size_t index = 0; index < tensors.size(); ++index) {
      if ((*assembled.checksums)[index] != (*read_.checksums)[index]) {
        return failed(ReadFailure::kChecksumMismatch,
                      "tensor '" + tensors[index].name + "' as assembled does not match the version's checksum");
      }
    }
  }
  return assembled;
}

}  // namespace

ReshardOutcome read_resharded(const StartRead& read, const Plan& plan, std::byte* packed, const net::PullOptions& pull,
                              const std::atomic<bool>& cancelled, bool in_place) {
  TH_REQUIRE(!read.reshard.empty(), "a read from another layout names the source's shards");
  TH_REQUIRE(plan.layout != nullptr, "a read has a layout");
  TH_REQUIRE(packed != nullptr || plan.packed_bytes == 0, "the packed buffer of", plan.packed_bytes, "bytes");
  if (auto invalid = invalid_source(read.reshard)) return failed(ReadFailure::kSourceRefused, *invalid);
  std::vector<Destination> destinations;
  if (auto refused = destinations_of(*plan.layout, destinations)) return failed(ReadFailure::kSourceRefused, *refused);
  std::vector<LayoutRef> source;
  for (const SourceShard& shard : read.reshard) source.push_back(shard.layout);
  // The reader's shard index spreads replicated pieces over the source's shards.
  Result<ReshardPlan> planned = plan_reshard(source, destinations, read.shard);
  if (!planned.ok()) return failed(ReadFailure::kSourceRefused, planned.error().detail);
  try {
    return Reshard(read, plan, packed, planned.value(), pull, cancelled, in_place).run();
  } catch (const net::DeviceCopyError& error) {
    // This host's GPU failed, not the source: the read fails and the hub tries again.
    return failed(ReadFailure::kSourceUnreachable, std::string("copying into GPU memory: ") + error.what());
  }
}

}  // namespace th::client_impl
