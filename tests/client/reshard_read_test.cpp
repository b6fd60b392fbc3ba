// Reading from a source of another layout (client/reshard_read.h), against real data servers: a
// 2-shard source (a column split, a row split, a replicated norm and a column split big enough to
// be a region of its own) read by a TP=1 reader and by each shard of a TP=4 reader, with dtype
// conversion both ways. What a reader must hold is worked out here from the logical tensors and
// the boxes alone (and the source's regions are packed here by hand), not by the code under test.
#include "client/reshard_read.h"

#include <gtest/gtest.h>

#include <array>
#include <atomic>
#include <bit>
#include <cstring>
#include <map>
#include <memory>

#include "client/checksum.h"
#include "core/box.h"

namespace th::client_impl {
namespace {

constexpr GrantSecret kSecret{0x5e5a4d, 0x7e5a4d};
constexpr net::GrantKey kKey{41, 3};

// A logical tensor of the model. Its elements are small integers, which bfloat16 holds exactly,
// so a converted element is the same number in any dtype.
struct Logical {
  std::string name;
  DType dtype;
  Shape shape;
  std::uint64_t seed;
  float at(std::uint64_t flat) const { return static_cast<float>((flat * 31 + seed * 17) % 251) - 125.0f; }
};

void put(DType dtype, float value, std::byte* at) {
  const auto bits = std::bit_cast<std::uint32_t>(value);
  if (dtype == DType::kFloat32) {
    std::memcpy(at, &bits, 4);
  } else {
    ASSERT_EQ(dtype, DType::kBFloat16);
    const auto high = static_cast<std::uint16_t>(bits >> 16);  // exact: the low half is 0
    std::memcpy(at, &high, 2);
  }
}

// The bytes of `box` of `tensor` as `dtype`, row-major over the box.
std::vector<std::byte> bytes_of(const Logical& tensor, DType dtype, const Box& box) {
  const std::size_t rank = box.extent.size();
  std::uint64_t elements = 1;
  for (std::uint64_t extent : box.extent) elements *= extent;
  std::vector<std::byte> bytes(elements * dtype_bytes(dtype));
  std::vector<std::uint64_t> index(rank, 0);  // in the box
  for (std::uint64_t n = 0; n < elements; ++n) {
    std::uint64_t flat = 0;
    for (std::size_t d = 0; d < rank; ++d) flat = flat * tensor.shape[d] + box.offset[d] + index[d];
    put(dtype, tensor.at(flat), bytes.data() + n * dtype_bytes(dtype));
    for (std::size_t d = rank; d-- > 0;) {
      if (++index[d] < box.extent[d]) break;
      index[d] = 0;
    }
  }
  return bytes;
}

TensorSpec piece(const Logical& tensor, DType dtype, const Box& box) {
  std::uint64_t elements = 1;
  for (std::uint64_t extent : box.extent) elements *= extent;
  return TensorSpec{tensor.name, dtype, elements * dtype_bytes(dtype), TensorKind::kPiece, tensor.shape, box};
}

// A shard of the source replica, served as a publisher serves it: the tensors under 2 MiB packed
// in region 0 in layout order, then each bigger one a region of its own.
struct SourceShardServer {
  std::vector<TensorSpec> specs;
  std::vector<std::vector<std::byte>> bytes;  // per tensor; packed ones are copied into `packed`
  std::vector<std::byte> packed;
  std::vector<std::byte*> served_at;  // per tensor: where the server reads it
  std::unique_ptr<net::DataServer> server = std::make_unique<net::DataServer>(net::DataServerConfig{.grant_wait_ms_max = 50});
  SourceShard description;

  void add(const Logical& tensor, const Box& box) {
    specs.push_back(piece(tensor, tensor.dtype, box));
    bytes.push_back(bytes_of(tensor, tensor.dtype, box));
  }
  void serve(bool grant) {
    auto checksums = std::make_shared<Checksums>();
    std::vector<net::ExposedRegion> regions;
    for (const auto& tensor : bytes) {
      if (tensor.size() < (2u << 20)) packed.insert(packed.end(), tensor.begin(), tensor.end());
    }
    if (!packed.empty()) regions.push_back({packed.data(), packed.size()});
    std::uint64_t packed_at = 0;
    for (auto& tensor : bytes) {
      checksums->push_back(checksum(tensor.data(), tensor.size()));
      if (tensor.size() < (2u << 20)) {
        served_at.push_back(packed.data() + packed_at);
        packed_at += tensor.size();
      } else {
        served_at.push_back(tensor.data());
        regions.push_back({tensor.data(), tensor.size()});
      }
    }
    description = SourceShard{server->endpoint().to_string(), ShardLayout::make(specs).value(), checksums};
    std::uint64_t total = 0;
    for (const auto& region : regions) total += region.bytes;
    if (grant) server->grant(kKey, kSecret, regions, std::make_shared<net::Progress>(total));
  }
};

// A reader shard: its registered tensors (filled with a pattern no expected byte has) and its plan.
struct ReaderShard {
  std::map<std::string, std::vector<std::byte>, std::less<>> memory;
  std::map<std::string, Registered, std::less<>> registry;
  Plan plan;
  std::vector<std::byte> packed;

  void add(const Logical& tensor, DType dtype, const Box& box) { add(piece(tensor, dtype, box)); }
  void add(TensorSpec spec) {
    auto& buffer = memory[spec.name];
    buffer.assign(spec.bytes, std::byte{0xEE});
    registry[spec.name] = Registered{buffer.data(), spec, nullptr, false};
  }
  void finish() {
    plan = make_plan(registry);
    packed.assign(plan.packed_bytes, std::byte{0});
  }
};

class ReshardReadTest : public ::testing::Test {
 protected:
  const Logical col_{"a.col", DType::kFloat32, {64, 48}, 1};     // column-parallel in the source
  const Logical row_{"b.row", DType::kBFloat16, {40, 32}, 2};    // row-parallel
  const Logical norm_{"c.norm", DType::kFloat32, {16}, 3};       // replicated
  const Logical big_{"d.big", DType::kFloat32, {1024, 1024}, 4};  // 2 MiB pieces: regions of their own
  const Logical tall_{"f.tall", DType::kFloat32, {1024, 1024}, 6};  // the same, split along rows
  SourceShardServer sources_[2];

  void SetUp() override { serve({true, true}); }
  void serve(std::array<bool, 2> grant) {
    for (std::uint64_t s = 0; s < 2; ++s) {
      SourceShardServer& source = sources_[s];
      source.add(col_, Box{{0, 24 * s}, {64, 24}});
      source.add(row_, Box{{20 * s, 0}, {20, 32}});
      source.add(norm_, Box{{0}, {16}});
      source.add(big_, Box{{0, 512 * s}, {1024, 512}});
      source.add(tall_, Box{{512 * s, 0}, {512, 1024}});
      source.serve(grant[s]);
    }
  }
  StartRead read_for(std::uint32_t shard) const {
    StartRead read;
    read.transfer = kKey.transfer;
    read.epoch = kKey.epoch;
    read.version = 7;
    read.shard = shard;
    read.source.replica = "trainer";
    read.secret = kSecret;
    read.reshard = {sources_[0].description, sources_[1].description};
    return read;
  }
  ReshardOutcome read(ReaderShard& reader, std::uint32_t shard, const StartRead* with = nullptr) {
    reader.finish();
    const StartRead start = with != nullptr ? *with : read_for(shard);
    std::atomic<bool> cancelled{false};
    return read_resharded(start, reader.plan, reader.packed.data(), net::PullOptions{}, cancelled);
  }
  // Every tensor holds its box of the model, the packed buffer (which this shard serves) holds its
  // small ones, and the checksums reported are those of what the tensors hold.
  static void expect_holds(const ReaderShard& reader, const ReshardOutcome& outcome,
                           const std::vector<std::pair<const Logical*, Box>>& expected) {
    ASSERT_FALSE(outcome.failure) << outcome.detail;
    ASSERT_FALSE(outcome.cancelled);
    const auto& tensors = reader.plan.layout->tensors();
    ASSERT_EQ(tensors.size(), expected.size());
    ASSERT_NE(outcome.checksums, nullptr);
    ASSERT_EQ(outcome.checksums->size(), tensors.size());
    for (std::size_t i = 0; i < tensors.size(); ++i) {
      const std::vector<std::byte>& held = reader.memory.at(tensors[i].name);
      EXPECT_TRUE(held == bytes_of(*expected[i].first, tensors[i].dtype, expected[i].second))
          << tensors[i].name << " " << describe_box(expected[i].second);
      EXPECT_EQ((*outcome.checksums)[i], checksum(held.data(), held.size())) << tensors[i].name;
      if (reader.plan.packed_offset[i] != Plan::kNotPacked) {
        EXPECT_EQ(std::memcmp(reader.packed.data() + reader.plan.packed_offset[i], held.data(), held.size()), 0)
            << tensors[i].name;
      }
    }
  }
};

TEST_F(ReshardReadTest, OneShardReaderAssemblesWholeTensorsFromTwoSourceShards) {
  ReaderShard reader;
  reader.add(col_, DType::kFloat32, whole_box(col_.shape));
  reader.add(row_, DType::kFloat32, whole_box(row_.shape));  // bfloat16 at the source
  reader.add(norm_, DType::kFloat32, whole_box(norm_.shape));
  reader.add(big_, DType::kFloat32, whole_box(big_.shape));
  const ReshardOutcome outcome = read(reader, 0);
  expect_holds(reader, outcome,
               {{&col_, whole_box(col_.shape)}, {&row_, whole_box(row_.shape)}, {&norm_, whole_box(norm_.shape)},
                {&big_, whole_box(big_.shape)}});
  EXPECT_EQ(outcome.pieces_read, 7u);  // both pieces of each split tensor, one of the norm
}

TEST_F(ReshardReadTest, EachShardOfAFourShardReaderAssemblesItsBoxes) {
  for (std::uint64_t shard = 0; shard < 4; ++shard) {
    SCOPED_TRACE("reader shard " + std::to_string(shard));
    // The splits cross the source's: a row of a.col comes from both its pieces, a column of
    // b.row from both of its.
    const Box col_box{{16 * shard, 0}, {16, 48}};
    const Box row_box{{0, 8 * shard}, {40, 8}};
    const Box big_box{{256 * shard, 0}, {256, 1024}};  // 1 MiB of float32: packed at this reader
    ReaderShard reader;
    reader.add(col_, DType::kBFloat16, col_box);  // float32 at the source
    reader.add(row_, DType::kFloat32, row_box);   // bfloat16 at the source
    reader.add(norm_, DType::kFloat32, whole_box(norm_.shape));
    reader.add(big_, DType::kFloat32, big_box);
    const ReshardOutcome outcome = read(reader, static_cast<std::uint32_t>(shard));
    expect_holds(reader, outcome, {{&col_, col_box}, {&row_, row_box}, {&norm_, whole_box(norm_.shape)}, {&big_, big_box}});
  }
}

TEST_F(ReshardReadTest, ACorruptedSourceByteIsAChecksumMismatchNamingTheTensor) {
  sources_[1].served_at[1][5] ^= std::byte{0x40};  // b.row's piece on source shard 1
  ReaderShard reader;
  reader.add(row_, DType::kFloat32, whole_box(row_.shape));
  const ReshardOutcome outcome = read(reader, 0);
  ASSERT_EQ(outcome.failure, ReadFailure::kChecksumMismatch) << outcome.detail;
  EXPECT_NE(outcome.detail.find("'b.row'"), std::string::npos) << outcome.detail;
  EXPECT_NE(outcome.detail.find("source shard 1"), std::string::npos) << outcome.detail;
}

// A piece that is one run of its destination (a split along rows, the same dtype) is read straight
// into the registered tensor; one that converts goes through a scratch buffer. Both assemble.
TEST_F(ReshardReadTest, RowSplitPiecesLandInPlaceOrConvertedAlike) {
  ReaderShard same_dtype;
  same_dtype.add(tall_, DType::kFloat32, whole_box(tall_.shape));
  expect_holds(same_dtype, read(same_dtype, 0), {{&tall_, whole_box(tall_.shape)}});
  ReaderShard converted;
  converted.add(tall_, DType::kBFloat16, whole_box(tall_.shape));
  expect_holds(converted, read(converted, 0), {{&tall_, whole_box(tall_.shape)}});
  ReaderShard half;  // rows 256..767: half of each source piece, through the scratch buffer
  const Box middle{{256, 0}, {512, 1024}};
  half.add(tall_, DType::kFloat32, middle);
  expect_holds(half, read(half, 0), {{&tall_, middle}});
}

TEST_F(ReshardReadTest, ACorruptedByteOfAPieceReadInPlaceIsAChecksumMismatchNamingIt) {
  sources_[1].served_at[4][4096] ^= std::byte{0x01};  // f.tall's piece on source shard 1
  ReaderShard reader;
  reader.add(tall_, DType::kFloat32, whole_box(tall_.shape));
  const ReshardOutcome outcome = read(reader, 0);
  ASSERT_EQ(outcome.failure, ReadFailure::kChecksumMismatch) << outcome.detail;
  EXPECT_NE(outcome.detail.find("'f.tall'"), std::string::npos) << outcome.detail;
  EXPECT_NE(outcome.detail.find("source shard 1"), std::string::npos) << outcome.detail;
}

TEST_F(ReshardReadTest, AReaderTensorNoSourceHoldsFailsTheReadNamingIt) {
  const Logical extra{"e.extra", DType::kFloat32, {8}, 5};
  ReaderShard reader;
  reader.add(col_, DType::kFloat32, whole_box(col_.shape));
  reader.add(extra, DType::kFloat32, whole_box(extra.shape));
  const ReshardOutcome outcome = read(reader, 0);
  ASSERT_EQ(outcome.failure, ReadFailure::kSourceRefused) << outcome.detail;
  EXPECT_NE(outcome.detail.find("'e.extra'"), std::string::npos) << outcome.detail;
  EXPECT_EQ(outcome.bytes_read, 0u);  // refused before any byte moved
}

TEST_F(ReshardReadTest, AReaderTensorThatIsNotAPieceFailsTheReadNamingIt) {
  ReaderShard reader;
  reader.add(col_, DType::kFloat32, whole_box(col_.shape));
  reader.add(TensorSpec{"a.bytes", DType::kUInt8, 64, TensorKind::kBytes, {}, {}});
  const ReshardOutcome outcome = read(reader, 0);
  ASSERT_EQ(outcome.failure, ReadFailure::kSourceRefused) << outcome.detail;
  EXPECT_NE(outcome.detail.find("'a.bytes'"), std::string::npos) << outcome.detail;
}

// A one-shard reader of the norm and the big tensor, in float32.
void takes_norm_and_big_whole(ReaderShard& reader, const Logical& norm, const Logical& big) {
  reader.add(norm, DType::kFloat32, whole_box(norm.shape));
  reader.add(big, DType::kFloat32, whole_box(big.shape));
}

TEST_F(ReshardReadTest, AssembledTensorsAreComparedWithTheVersionsChecksumsWhereKnown) {
  ReaderShard first;
  takes_norm_and_big_whole(first, norm_, big_);
  const ReshardOutcome assembled = read(first, 0);
  ASSERT_FALSE(assembled.failure) << assembled.detail;

  StartRead known = read_for(1);
  known.checksums = assembled.checksums;  // another reader of this layout reported them
  ReaderShard second;
  takes_norm_and_big_whole(second, norm_, big_);
  EXPECT_FALSE(read(second, 1, &known).failure);

  auto other = std::make_shared<Checksums>(*assembled.checksums);
  (*other)[1] ^= 1;
  known.checksums = other;
  ReaderShard third;
  takes_norm_and_big_whole(third, norm_, big_);
  const ReshardOutcome outcome = read(third, 1, &known);
  ASSERT_EQ(outcome.failure, ReadFailure::kChecksumMismatch) << outcome.detail;
  EXPECT_NE(outcome.detail.find("'d.big'"), std::string::npos) << outcome.detail;
}

TEST_F(ReshardReadTest, ASourceShardWithoutTheGrantRefusesTheRead) {
  sources_[0] = SourceShardServer{};
  sources_[1] = SourceShardServer{};
  serve({true, false});
  ReaderShard reader;
  reader.add(col_, DType::kFloat32, whole_box(col_.shape));
  const ReshardOutcome outcome = read(reader, 0);
  ASSERT_EQ(outcome.failure, ReadFailure::kSourceRefused) << outcome.detail;
  EXPECT_NE(outcome.detail.find("source shard 1"), std::string::npos) << outcome.detail;
}

TEST_F(ReshardReadTest, ACancelledReadStopsWithoutAVerdict) {
  ReaderShard reader;
  reader.add(col_, DType::kFloat32, whole_box(col_.shape));
  reader.finish();
  std::atomic<bool> cancelled{true};
  const ReshardOutcome outcome = read_resharded(read_for(0), reader.plan, reader.packed.data(), net::PullOptions{}, cancelled);
  EXPECT_TRUE(outcome.cancelled);
  EXPECT_FALSE(outcome.failure);
}

// GPU memory, as far as it can be checked without one: device memory that the CPU can reach, so
// that what is copied "to the device" can be compared.
class HostMemoryGpu final : public Gpu {
 public:
  Result<int> device_of(const std::byte*, std::uint64_t) override { return 0; }
  void to_host(std::span<const Copy> copies) override {
    for (const Copy& copy : copies) std::memcpy(copy.host, copy.device, copy.bytes);
  }
  void to_device(std::span<const Copy> copies) override {
    for (const Copy& copy : copies) std::memcpy(copy.device, copy.host, copy.bytes);
    copies_to_device += copies.size();
  }
  std::uint64_t checksum(const std::byte* device, std::uint64_t bytes) override {
    ++checksums;
    return client_impl::checksum(device, bytes);
  }
  std::shared_ptr<void> pin_host(std::byte*, std::uint64_t) override { return nullptr; }
  void synchronize(int, void*) override {}
  std::shared_ptr<net::StagingProvider> staging(int) override { return nullptr; }
  void flush_remote_writes(int) override {}
  std::optional<std::pair<const std::byte*, std::uint64_t>> allocation_of(const std::byte*) override { return std::nullopt; }
  int dmabuf_fd(const std::byte*, std::uint64_t, std::string&) override { return -1; }

  std::uint64_t copies_to_device = 0;
  std::uint64_t checksums = 0;
};

TEST_F(ReshardReadTest, TensorsOnAGpuAreAssembledOnTheCpuThenCopied) {
  const Box col_box{{16, 0}, {16, 48}};
  const Box big_box{{0, 256}, {1024, 768}};  // 3 MiB: a region of its own, filled row by row
  ReaderShard reader;
  reader.add(col_, DType::kFloat32, col_box);
  reader.add(big_, DType::kFloat32, big_box);
  for (auto& [name, tensor] : reader.registry) tensor.on_device = true;
  reader.finish();
  auto gpu = std::make_shared<HostMemoryGpu>();
  reader.plan.gpu = gpu;
  reader.plan.gpu_device = 0;
  std::atomic<bool> cancelled{false};
  const ReshardOutcome outcome = read_resharded(read_for(1), reader.plan, reader.packed.data(), net::PullOptions{}, cancelled);
  expect_holds(reader, outcome, {{&col_, col_box}, {&big_, big_box}});
  EXPECT_EQ(gpu->checksums, 1u);  // the big one, on its GPU; the small one from the packed buffer
  // The small tensor in one batch; the big one's 1024 rows from each of two pieces, one copy each.
  EXPECT_EQ(gpu->copies_to_device, 1u + 2 * 1024u);
}

// One definition of where tensors sit on the data plane: the registered tensors' plan agrees.
TEST(DataPlaneGeometryTest, PlacesTensorsAsTheRegisteredPlanDoes) {
  std::map<std::string, Registered, std::less<>> registry;
  std::vector<std::vector<std::byte>> memory;
  const std::uint64_t sizes[] = {100, 3u << 20, 0, 2u << 20, (2u << 20) - 1, 7};
  for (std::size_t i = 0; i < std::size(sizes); ++i) {
    memory.emplace_back(sizes[i]);
    const std::string name = "t" + std::to_string(i);
    const TensorSpec spec{name, DType::kUInt8, sizes[i], TensorKind::kBytes, {}, {}};
    registry[name] = Registered{memory.back().data(), spec, nullptr, false};
  }
  const Plan plan = make_plan(registry);
  const DataPlaneGeometry geometry = data_plane_geometry(*plan.layout);
  EXPECT_EQ(geometry.packed_offset, plan.packed_offset);
  EXPECT_EQ(geometry.packed_bytes, plan.packed_bytes);
  EXPECT_EQ(geometry.big, plan.big);
  // Region 0 is the packed buffer, then the big ones in layout order (t1, t3).
  EXPECT_EQ(geometry.place[1].region, 1u);
  EXPECT_EQ(geometry.place[3].region, 2u);
  EXPECT_EQ(geometry.place[4].region, 0u);
  EXPECT_EQ(geometry.place[4].offset_bytes, 100u);
}

}  // namespace
}  // namespace th::client_impl
