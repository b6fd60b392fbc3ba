#include "sim/layouts.h"

#include <algorithm>
#include <array>
#include <cstring>
#include <string>

#include "core/box.h"

namespace th::sim {

namespace {

// ---- The model's logical tensors (the layouts workload) -----------------------------------------

// How tensor parallelism places a tensor: split evenly by rows (dimension 0) or by columns
// (dimension 1), or whole on every shard (as TP ranks hold a norm). Every dimension that splits
// divides by 8 (TP=8, 4, 2, 1); FSDP chunks dimension 0 of each, whatever the split.
enum class Split : std::uint8_t { kRows, kColumns, kReplicated };
struct Logical {
  const char* name;
  Shape shape;
  Split split;
};
const std::vector<Logical>& logical_tensors() {
  static const std::vector<Logical> tensors = {
      {"embed", {16, 8}, Split::kRows},       // vocab-parallel
      {"qkv", {8, 16}, Split::kColumns},      // column-parallel (FSDP: by rows, 8 of them)
      {"norm", {8}, Split::kReplicated},      // every TP shard holds all of it
      {"head", {24, 4}, Split::kRows},        // FSDP over 5: chunks of 5, 5, 5, 5, 4
      {"bias", {16}, Split::kRows},           // one dimension
  };
  return tensors;
}

TensorSpec piece_spec(const std::string& name, const Shape& shape, Box box, DType dtype) {
  TensorSpec spec{name, dtype, element_count(box.extent) * dtype_bytes(dtype)};
  spec.kind = TensorKind::kPiece;
  spec.shape = shape;
  spec.box = std::move(box);
  return spec;
}

// Shard `shard`'s pieces under `placement` (an FSDP shard holds no piece of a tensor whose rows
// ran out before it: torch.chunk's last chunks may be empty).
std::vector<TensorSpec> placed_tensors(const Placement& placement, std::uint32_t shard) {
  TH_ASSERT(placement.shards >= 1 && shard < placement.shards);
  std::vector<TensorSpec> tensors;
  for (const Logical& logical : logical_tensors()) {
    Box box = whole_box(logical.shape);
    const std::uint64_t rows = logical.shape[0];
    if (placement.kind == Placement::Kind::kFsdp) {
      const std::uint64_t chunk = (rows + placement.shards - 1) / placement.shards;
      const std::uint64_t begin = shard * chunk;
      if (begin >= rows) continue;
      box.offset[0] = begin;
      box.extent[0] = std::min(chunk, rows - begin);
    } else if (logical.split != Split::kReplicated) {
      const std::size_t dim = logical.split == Split::kRows ? 0 : 1;
      TH_ASSERT(logical.shape[dim] % placement.shards == 0, "tensor parallelism splits evenly");
      box.extent[dim] = logical.shape[dim] / placement.shards;
      box.offset[dim] = shard * box.extent[dim];
    }
    tensors.push_back(piece_spec(logical.name, logical.shape, std::move(box), placement.dtype));
  }
  TH_ASSERT(!tensors.empty(), "every shard holds a piece of some tensor");
  return tensors;
}

// ---- Element values --------------------------------------------------------------------------------

std::uint64_t mix(std::uint64_t x) {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdULL;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ULL;
  x ^= x >> 33;
  return x;
}

// Which of its values an item (a byte, an element) has in `version`: the version itself, or with a
// change period p > 1 the number of p-version spans since the item's phase, so that the item keeps
// its value through p - 1 versions and changes in the p-th (ShardContent::plain).
std::uint64_t value_epoch(Version version, std::uint32_t change_period, std::uint64_t item) {
  if (change_period <= 1) return version;
  const std::uint64_t phase = mix(item ^ 0x5bd1e995ULL) % change_period;
  return (version + phase) / change_period;
}

// The other workloads' byte at `offset` of shard `shard` of `version` of model `model`.
std::uint8_t plain_content(int model, Version version, std::uint32_t shard, std::size_t offset,
                           std::uint32_t change_period) {
  version = value_epoch(version, change_period, (static_cast<std::uint64_t>(shard) << 40) ^ offset);
  std::uint64_t x = (static_cast<std::uint64_t>(model) << 56) ^ (version * 0x9E3779B97F4A7C15ULL) ^
                    (static_cast<std::uint64_t>(shard) << 40) ^ offset;
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdULL;
  x ^= x >> 33;
  return static_cast<std::uint8_t>(x);
}

std::uint64_t tensor_key(const std::string& name) {
  return fnv(reinterpret_cast<const std::uint8_t*>(name.data()), name.size());
}

// Element `element` (row-major in the whole tensor) of the logical tensor `key` in `version`: a
// finite bfloat16 (an infinity or NaN is made finite: a NaN's payload need not survive a
// conversion, and the expected bytes must not depend on the path they took).
std::uint16_t element_bits(int model, Version version, std::uint64_t key, std::uint64_t element,
                           std::uint32_t change_period) {
  version = value_epoch(version, change_period, key ^ mix(element + 1));
  const std::uint64_t x = mix(key ^ mix(static_cast<std::uint64_t>(model) << 48 ^ version) ^ mix(element + 1));
  auto bits = static_cast<std::uint16_t>(x);
  if ((bits & 0x7F80) == 0x7F80) bits = static_cast<std::uint16_t>(bits ^ 0x0100);
  return bits;
}

// Where element `local` of `box` (row-major in the box) sits in the whole tensor of `shape`.
std::uint64_t global_index(const Shape& shape, const Box& box, std::uint64_t local) {
  std::uint64_t global = 0;
  std::uint64_t stride = 1;
  for (std::size_t d = shape.size(); d-- > 0;) {
    const std::uint64_t index = local % box.extent[d];
    local /= box.extent[d];
    global += (box.offset[d] + index) * stride;
    stride *= shape[d];
  }
  return global;
}

// bfloat16 and float32 only (the dtypes of the layouts workload): bfloat16 widens exactly, and a
// float32 that was a bfloat16 narrows back exactly (round to nearest even, as client/convert.h).
std::uint32_t to_float32_bits(const std::uint8_t* element, DType dtype) {
  if (dtype == DType::kBFloat16) {
    return static_cast<std::uint32_t>(element[0] | element[1] << 8) << 16;
  }
  TH_ASSERT(dtype == DType::kFloat32, "the simulator converts bfloat16 and float32 only");
  return static_cast<std::uint32_t>(element[0]) | static_cast<std::uint32_t>(element[1]) << 8 |
         static_cast<std::uint32_t>(element[2]) << 16 | static_cast<std::uint32_t>(element[3]) << 24;
}

void store_float32_bits(std::uint32_t bits, DType dtype, std::uint8_t* element) {
  if (dtype == DType::kBFloat16) {
    std::uint16_t narrow;
    if ((bits & 0x7F800000U) == 0x7F800000U && (bits & 0x007FFFFFU) != 0) {
      narrow = static_cast<std::uint16_t>(bits >> 16 | 0x0040);  // a NaN stays one
    } else {
      narrow = static_cast<std::uint16_t>((bits + 0x7FFFU + (bits >> 16 & 1U)) >> 16);
    }
    element[0] = static_cast<std::uint8_t>(narrow);
    element[1] = static_cast<std::uint8_t>(narrow >> 8);
    return;
  }
  TH_ASSERT(dtype == DType::kFloat32, "the simulator converts bfloat16 and float32 only");
  for (int i = 0; i < 4; ++i) element[i] = static_cast<std::uint8_t>(bits >> (8 * i));
}

// How a piece of `dtype` stores the bfloat16 `bits`, little-endian: the expected bytes, written
// out apart from the data plane's conversions above, so that a checker shares no code with them.
void encode(std::uint16_t bits, DType dtype, std::uint8_t* element) {
  if (dtype == DType::kBFloat16) {
    element[0] = static_cast<std::uint8_t>(bits);
    element[1] = static_cast<std::uint8_t>(bits >> 8);
    return;
  }
  TH_ASSERT(dtype == DType::kFloat32, "the layouts workload's pieces are bfloat16 or float32");
  element[0] = element[1] = 0;  // a bfloat16 is a float32 whose low 16 bits are zero
  element[2] = static_cast<std::uint8_t>(bits);
  element[3] = static_cast<std::uint8_t>(bits >> 8);
}

std::vector<std::size_t> offsets_of(const ShardLayout& layout) {
  std::vector<std::size_t> offsets;
  std::size_t at = 0;
  for (const TensorSpec& tensor : layout.tensors()) {
    offsets.push_back(at);
    at += tensor.bytes;
  }
  offsets.push_back(at);
  return offsets;
}

}  // namespace

std::uint64_t fnv(const std::uint8_t* bytes, std::size_t size) {
  std::uint64_t hash = 0xcbf29ce484222325ULL;
  for (std::size_t i = 0; i < size; ++i) {
    hash ^= bytes[i];
    hash *= 0x100000001b3ULL;
  }
  return hash;
}

// ---- ShardContent ------------------------------------------------------------------------------------

ShardContent::ShardContent(LayoutRef layout, bool plain, std::uint32_t shard, std::uint32_t change_period)
    : layout_(std::move(layout)), change_period_(change_period), plain_(plain), shard_(shard), offsets_(offsets_of(*layout_)) {
  TH_ASSERT(change_period_ >= 1);
  size_ = offsets_.back();
  if (plain_) return;
  for (const TensorSpec& tensor : layout_->tensors()) {
    TH_ASSERT(tensor.kind == TensorKind::kPiece && tensor.box.extent.size() == tensor.shape.size(),
              "a placed shard's tensors are pieces");
    TH_ASSERT(tensor.dtype == DType::kBFloat16 || tensor.dtype == DType::kFloat32);
    tensor_keys_.push_back(tensor_key(tensor.name));
  }
}

std::shared_ptr<const ShardContent> ShardContent::plain(std::uint32_t shard, std::uint32_t change_period) {
  // Two tensors of 40 and 24 bytes: the real buffer of every other workload's shard.
  LayoutRef layout = ShardLayout::make({{"layer." + std::to_string(shard) + ".weight", DType::kBFloat16, 40},
                                        {"layer." + std::to_string(shard) + ".bias", DType::kFloat32, 24}})
                         .value();
  return std::shared_ptr<const ShardContent>(new ShardContent(std::move(layout), true, shard, change_period));
}

std::shared_ptr<const ShardContent> ShardContent::placed(const Placement& placement, std::uint32_t shard,
                                                        std::uint32_t change_period) {
  return pieces(ShardLayout::make(placed_tensors(placement, shard)).value(), change_period);
}

std::shared_ptr<const ShardContent> ShardContent::pieces(LayoutRef layout, std::uint32_t change_period) {
  return std::shared_ptr<const ShardContent>(new ShardContent(std::move(layout), false, 0, change_period));
}

std::uint8_t ShardContent::byte(int model, Version version, std::size_t offset) const {
  TH_ASSERT(offset < size_);
  if (plain_) return plain_content(model, version, shard_, offset, change_period_);
  const auto tensor = static_cast<std::size_t>(std::upper_bound(offsets_.begin(), offsets_.end(), offset) -
                                               offsets_.begin() - 1);
  const TensorSpec& spec = layout_->tensors()[tensor];
  const std::uint32_t width = dtype_bytes(spec.dtype);
  const std::size_t local = offset - offsets_[tensor];
  const std::uint64_t element = global_index(spec.shape, spec.box, local / width);
  std::array<std::uint8_t, 4> stored{};
  encode(element_bits(model, version, tensor_keys_[tensor], element, change_period_), spec.dtype, stored.data());
  return stored[local % width];
}

std::vector<std::uint8_t> ShardContent::bytes(int model, Version version) const {
  std::vector<std::uint8_t> bytes(size_);
  if (plain_) {
    for (std::size_t offset = 0; offset < size_; ++offset) bytes[offset] = plain_content(model, version, shard_, offset, change_period_);
    return bytes;
  }
  for (std::size_t tensor = 0; tensor < tensor_keys_.size(); ++tensor) {
    const TensorSpec& spec = layout_->tensors()[tensor];
    const std::uint32_t width = dtype_bytes(spec.dtype);
    const std::uint64_t count = element_count(spec.box.extent);
    for (std::uint64_t local = 0; local < count; ++local) {
      const std::uint64_t element = global_index(spec.shape, spec.box, local);
      encode(element_bits(model, version, tensor_keys_[tensor], element, change_period_), spec.dtype,
             bytes.data() + offsets_[tensor] + local * width);
    }
  }
  return bytes;
}

Checksums ShardContent::checksums(const std::vector<std::uint8_t>& buffer) const {
  TH_ASSERT(buffer.size() == size_);
  Checksums checksums;
  for (std::size_t tensor = 0; tensor + 1 < offsets_.size(); ++tensor) {
    checksums.push_back(fnv(buffer.data() + offsets_[tensor], offsets_[tensor + 1] - offsets_[tensor]));
  }
  return checksums;
}

std::size_t model_bytes() {
  std::size_t bytes = 0;
  for (const Logical& logical : logical_tensors()) bytes += element_count(logical.shape) * dtype_bytes(DType::kBFloat16);
  return bytes;
}

// ---- ReshardRead -------------------------------------------------------------------------------------

Result<ReshardRead> ReshardRead::plan(const StartRead& read, const LayoutRef& reader) {
  TH_ASSERT(!read.reshard.empty() && reader != nullptr);
  ReshardRead planned;
  for (const SourceShard& source : read.reshard) {
    if (source.layout == nullptr || source.checksums == nullptr ||
        source.checksums->size() != source.layout->tensors().size()) {
      return make_error(Errc::kInvalidArgument, "a source shard comes without its layout or one checksum per tensor");
    }
    planned.sources_.push_back(source.layout);
    planned.checksums_.push_back(source.checksums);
  }
  planned.reader_ = reader;
  std::vector<Destination> destinations;
  for (const TensorSpec& tensor : reader->tensors()) {
    if (tensor.kind != TensorKind::kPiece) {
      return make_error(Errc::kLayoutMismatch, "tensor '" + tensor.name + "' is not a piece");
    }
    destinations.push_back(Destination{tensor.name, tensor.dtype, {Segment{tensor.name, tensor.shape, tensor.box}}});
  }
  Result<ReshardPlan> plan = plan_reshard(planned.sources_, destinations, read.shard);
  if (!plan.ok()) return plan.error();
  planned.plan_ = std::move(plan.value());
  const std::vector<std::size_t> offsets = offsets_of(*reader);
  planned.reader_offsets_.assign(offsets.begin(), offsets.end());
  std::uint64_t before = 0;
  for (const PieceRead& piece : planned.plan_.reads) {
    TH_ASSERT(piece.shard < planned.sources_.size() && piece.tensor < planned.sources_[piece.shard]->tensors().size());
    if (planned.shards_.empty() || planned.shards_.back() != piece.shard) planned.shards_.push_back(piece.shard);
    planned.before_.push_back(before);
    before += planned.sources_[piece.shard]->tensors()[piece.tensor].bytes;
  }
  planned.before_.push_back(before);
  TH_ASSERT(std::is_sorted(planned.shards_.begin(), planned.shards_.end()), "pieces come by source shard");
  return planned;
}

std::pair<std::uint64_t, std::uint64_t> ReshardRead::span(std::size_t piece) const {
  const PieceRead& read = plan_.reads[piece];
  const auto& tensors = sources_[read.shard]->tensors();
  std::uint64_t offset = 0;
  for (std::uint32_t tensor = 0; tensor < read.tensor; ++tensor) offset += tensors[tensor].bytes;
  return {offset, offset + tensors[read.tensor].bytes};
}

ReshardRead::Landed ReshardRead::land(std::size_t piece, const std::vector<std::uint8_t>& source,
                                      std::optional<std::pair<std::uint64_t, int>> flip,
                                      std::vector<std::uint8_t>& into) const {
  TH_ASSERT(piece < pieces() && into.size() == reader_offsets_.back());
  const PieceRead& read = plan_.reads[piece];
  const auto [begin, end] = span(piece);
  if (end > source.size()) return Landed::kOutOfBounds;
  std::vector<std::uint8_t> bytes(source.begin() + static_cast<std::ptrdiff_t>(begin),
                                  source.begin() + static_cast<std::ptrdiff_t>(end));
  if (flip && flip->first < bytes.size()) bytes[flip->first] ^= static_cast<std::uint8_t>(1U << flip->second);
  // The whole piece against its checksum, before a byte of it lands.
  if (fnv(bytes.data(), bytes.size()) != (*checksums_[read.shard])[read.tensor]) return Landed::kChecksumMismatch;
  const DType from = sources_[read.shard]->tensors()[read.tensor].dtype;
  const std::uint32_t from_width = dtype_bytes(from);
  for (const Landing& landing : read.landings) {
    const DType to = reader_->tensors()[landing.destination].dtype;
    const std::uint32_t to_width = dtype_bytes(to);
    std::uint8_t* base = into.data() + reader_offsets_[landing.destination];
    const std::uint64_t limit = reader_offsets_[landing.destination + 1] - reader_offsets_[landing.destination];
    for (const ElementRun& run : landing.runs) {
      TH_ASSERT((run.source_offset + run.count) * from_width <= bytes.size(), "a run lies within its piece");
      TH_ASSERT((run.destination_offset + run.count) * to_width <= limit, "a run lies within its tensor");
      for (std::uint64_t k = 0; k < run.count; ++k) {
        const std::uint8_t* element = bytes.data() + (run.source_offset + k) * from_width;
        std::uint8_t* target = base + (run.destination_offset + k) * to_width;
        if (from == to) {
          std::memcpy(target, element, from_width);
        } else {
          store_float32_bits(to_float32_bits(element, from), to, target);
        }
      }
    }
  }
  return Landed::kLanded;
}

}  // namespace th::sim
