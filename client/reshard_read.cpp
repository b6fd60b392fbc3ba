// Reading a version from a source replica of another layout (see reshard_read.h).
#include "client/reshard_read.h"

#include <algorithm>
#include <cstring>
#include <memory>
#include <new>
#include <span>

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

// Carries out one plan into one reader shard's buffers.
class Reshard {
 public:
  Reshard(const StartRead& read, const Plan& plan, std::byte* packed, const ReshardPlan& pieces,
          const net::PullOptions& pull, const std::atomic<bool>& cancelled)
      : read_(read), plan_(plan), packed_(packed), pieces_(pieces), pull_(pull), cancelled_(cancelled) {
    pull_.partial = false;  // a complete source (a partial one answers short: the pull then waits)
    pull_.streams = 1;      // one region per pull
    pull_.ipc = nullptr;    // into host memory
    pull_.on_progress = nullptr;
    pull_.cancelled = [this] { return cancelled_.load(); };
    for (const SourceShard& shard : read.reshard) geometry_.push_back(data_plane_geometry(*shard.layout));
  }

  // The outcome, with what was read on the way whatever it is (the handle's stats count it).
  ReshardOutcome run() {
    ReshardOutcome outcome = run_pieces();
    outcome.bytes_read = bytes_read_;
    outcome.pieces_read = pieces_read_;
    return outcome;
  }

 private:
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
  std::optional<ReshardOutcome> allocate();
  // Reads [0, bytes) of `region` of source shard `shard` into the scratch buffer.
  std::optional<ReshardOutcome> pull(std::uint32_t shard, std::uint32_t region, std::uint64_t bytes);
  // Verifies the piece at `data` and lands what the reader needs of it.
  std::optional<ReshardOutcome> verify_and_land(const PieceRead& piece, const std::byte* data);
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
  std::vector<DataPlaneGeometry> geometry_;  // per source shard
  Buffer scratch_;  // one piece, or one source shard's packed prefix
  Buffer staging_;  // host side of what one piece lands in GPU tensors
  std::shared_ptr<void> staging_pinned_;
  std::uint64_t bytes_read_ = 0;
  std::uint64_t pieces_read_ = 0;
};

ReshardOutcome cancelled_outcome() {
  ReshardOutcome outcome;
  outcome.cancelled = true;
  return outcome;
}

std::optional<ReshardOutcome> Reshard::allocate() {
  std::uint64_t scratch_bytes = 0;
  std::uint64_t staging_bytes = 0;
  std::vector<std::uint64_t> packed_end(read_.reshard.size(), 0);
  for (const PieceRead& piece : pieces_.reads) {
    const TensorSpec& tensor = source_tensor(piece);
    if (packed_at_source(piece)) {
      const std::uint64_t end = geometry_[piece.shard].packed_offset[piece.tensor] + tensor.bytes;
      packed_end[piece.shard] = std::max(packed_end[piece.shard], end);
    } else {
      scratch_bytes = std::max(scratch_bytes, tensor.bytes);
    }
    std::uint64_t landed_on_device = 0;
    for (const Landing& landing : piece.landings) {
      if (!staged(landing.destination)) continue;
      const std::uint32_t element_bytes = dtype_bytes(plan_.layout->tensors()[landing.destination].dtype);
      for (const ElementRun& run : landing.runs) landed_on_device += run.count * element_bytes;
    }
    staging_bytes = std::max(staging_bytes, landed_on_device);
  }
  scratch_bytes = std::max(scratch_bytes, *std::max_element(packed_end.begin(), packed_end.end()));
  if (!scratch_.allocate(scratch_bytes) || !staging_.allocate(staging_bytes)) {
    return failed(ReadFailure::kSourceUnreachable, "no memory for the read's buffers (" + std::to_string(scratch_bytes) +
                                                       " + " + std::to_string(staging_bytes) + " bytes)");
  }
  // Page-locked, a copy to the GPU runs at the link's speed (pageable memory goes through the
  // driver's small bounce buffers).
  if (staging_.size > 0) {
    TH_ASSERT(plan_.gpu != nullptr, "tensors on a GPU come with the GPU's access");
    staging_pinned_ = plan_.gpu->pin_host(staging_.bytes.get(), staging_.size);
  }
  return std::nullopt;
}

std::optional<ReshardOutcome> Reshard::pull(std::uint32_t shard, std::uint32_t region, std::uint64_t bytes) {
  TH_ASSERT(bytes > 0, "a piece has elements");
  TH_ASSERT(bytes <= scratch_.size, "the scratch buffer holds the read's largest need");
  // The regions before it are empty targets (not read); the region is read from its start.
  std::vector<net::LocalRegion> targets(static_cast<std::size_t>(region) + 1);
  targets[region] = {scratch_.bytes.get(), bytes, false};
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
  if (*pulled.error == net::ReadError::kCancelled || cancelled_.load()) {
    return cancelled_outcome();
  }
  return failed(*pulled.error == net::ReadError::kRefused ? ReadFailure::kSourceRefused : ReadFailure::kSourceUnreachable,
                source_name(shard) + ": " + pulled.detail);
}

std::optional<ReshardOutcome> Reshard::verify_and_land(const PieceRead& piece, const std::byte* data) {
  const TensorSpec& source = source_tensor(piece);
  if (checksum(data, source.bytes) != (*read_.reshard[piece.shard].checksums)[piece.tensor]) {
    return failed(ReadFailure::kChecksumMismatch, "tensor '" + source.name + "' " + describe_box(source.box) + " of " +
                                                      source_name(piece.shard) + " does not match its checksum");
  }
  ++pieces_read_;
  const std::uint32_t source_element_bytes = dtype_bytes(source.dtype);
  const std::uint64_t source_elements = source.bytes / source_element_bytes;
  std::uint64_t staged_bytes = 0;
  std::vector<Gpu::Copy> to_device;
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
      TH_ASSERT(staged_bytes + bytes <= staging_.size, "the staging buffer holds what one piece lands");
      std::byte* host = staging_.bytes.get() + staged_bytes;
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
  if (!to_device.empty()) plan_.gpu->to_device(to_device);
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
  if (auto no_memory = allocate()) return *no_memory;
  const auto& reads = pieces_.reads;
  // The plan lists the pieces by source shard, then tensor: a shard's packed pieces come with one
  // read of its packed prefix, then its big pieces one read each.
  for (std::size_t first = 0; first < reads.size();) {
    const std::uint32_t shard = reads[first].shard;
    std::size_t end = first;
    std::uint64_t packed_end = 0;
    for (; end < reads.size() && reads[end].shard == shard; ++end) {
      if (!packed_at_source(reads[end])) continue;
      packed_end = std::max(packed_end, geometry_[shard].packed_offset[reads[end].tensor] + source_tensor(reads[end]).bytes);
    }
    if (packed_end > 0) {
      if (cancelled_.load()) return cancelled_outcome();
      if (auto stopped = pull(shard, 0, packed_end)) return *stopped;
      for (std::size_t at = first; at < end; ++at) {
        if (!packed_at_source(reads[at])) continue;
        const std::byte* data = scratch_.bytes.get() + geometry_[shard].packed_offset[reads[at].tensor];
        if (auto bad = verify_and_land(reads[at], data)) return *bad;
      }
    }
    for (std::size_t at = first; at < end; ++at) {
      if (packed_at_source(reads[at])) continue;
      if (cancelled_.load()) return cancelled_outcome();
      const DataPlaneGeometry::Place& place = geometry_[shard].place[reads[at].tensor];
      TH_ASSERT(place.offset_bytes == 0, "a big tensor is a region of its own");
      if (auto stopped = pull(shard, place.region, source_tensor(reads[at]).bytes)) return *stopped;
      if (auto bad = verify_and_land(reads[at], scratch_.bytes.get())) return *bad;
    }
    first = end;
  }
  if (cancelled_.load()) return cancelled_outcome();
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
                              const std::atomic<bool>& cancelled) {
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
    return Reshard(read, plan, packed, planned.value(), pull, cancelled).run();
  } catch (const net::DeviceCopyError& error) {
    // This host's GPU failed, not the source: the read fails and the hub tries again.
    return failed(ReadFailure::kSourceUnreachable, std::string("copying into GPU memory: ") + error.what());
  }
}

}  // namespace th::client_impl
