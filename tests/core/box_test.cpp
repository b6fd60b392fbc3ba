// Boxes, tilings and copy plans (core/box.h): the geometry a reader of one layout uses to fill its
// pieces from another layout's. The plans are checked against element-by-element copies.
#include "core/box.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <random>
#include <tuple>

namespace th {
namespace {

std::string error_of(const Status& status) { return status ? std::string("ok") : status.error().detail; }

// Each element of a piece holds its global row-major index (8 bytes), so that a copied element
// says where it came from.
std::vector<std::uint64_t> piece_of(const Shape& shape, const Box& box) {
  std::vector<std::uint64_t> values;
  values.reserve(element_count(box.extent));
  Shape at = box.offset;
  const std::uint64_t count = element_count(box.extent);
  for (std::uint64_t i = 0; i < count; ++i) {
    std::uint64_t global = 0;
    for (std::size_t d = 0; d < shape.size(); ++d) global = global * shape[d] + at[d];
    values.push_back(global);
    for (std::size_t d = shape.size(); d-- > 0;) {
      if (++at[d] < box.offset[d] + box.extent[d]) break;
      at[d] = box.offset[d];
    }
  }
  return values;
}

// Fills `target` from `sources` by the plan and compares every element with the expected one.
void expect_plan_fills(const Shape& shape, const Box& target, const std::vector<Box>& sources) {
  const auto plan = plan_copy("t", shape, sizeof(std::uint64_t), target, sources);
  ASSERT_TRUE(plan) << plan.error().detail;
  std::vector<std::vector<std::uint64_t>> buffers;
  for (const Box& source : sources) buffers.push_back(piece_of(shape, source));
  std::vector<std::uint64_t> filled(element_count(target.extent), ~std::uint64_t{0});
  std::uint64_t bytes = 0;
  for (const CopyRun& run : plan.value()) {
    ASSERT_LT(run.source, buffers.size());
    const auto& from = buffers[run.source];
    ASSERT_LE(run.source_offset_bytes + run.bytes, from.size() * sizeof(std::uint64_t));
    ASSERT_LE(run.target_offset_bytes + run.bytes, filled.size() * sizeof(std::uint64_t));
    std::memcpy(reinterpret_cast<char*>(filled.data()) + run.target_offset_bytes,
                reinterpret_cast<const char*>(from.data()) + run.source_offset_bytes, run.bytes);
    bytes += run.bytes;
  }
  EXPECT_EQ(bytes, filled.size() * sizeof(std::uint64_t)) << "every byte once";
  EXPECT_EQ(filled, piece_of(shape, target));
}

TEST(Box, AWholeTensorIsOneRun) {
  const Shape shape{64, 32};
  const auto plan = plan_copy("w", shape, 2, whole_box(shape), {whole_box(shape)});
  ASSERT_TRUE(plan);
  EXPECT_EQ(plan.value(), (std::vector<CopyRun>{{0, 0, 0, 64 * 32 * 2}}));
}

TEST(Box, ARowSplitIsOneRunPerSource) {
  // Megatron row-parallel at TP=2 read by TP=1: each half is one contiguous run.
  const Shape shape{8, 4};
  const std::vector<Box> halves{{{0, 0}, {4, 4}}, {{4, 0}, {4, 4}}};
  const auto plan = plan_copy("w", shape, 2, whole_box(shape), halves);
  ASSERT_TRUE(plan);
  EXPECT_EQ(plan.value(), (std::vector<CopyRun>{{0, 0, 0, 32}, {1, 0, 32, 32}}));
  expect_plan_fills(shape, whole_box(shape), halves);
}

TEST(Box, AColumnSplitIsOneRunPerRowAndSource) {
  // Column-parallel at TP=2 read whole: each source row is a run of half a target row.
  const Shape shape{3, 6};
  const std::vector<Box> halves{{{0, 0}, {3, 3}}, {{0, 3}, {3, 3}}};
  const auto plan = plan_copy("w", shape, 4, whole_box(shape), halves);
  ASSERT_TRUE(plan);
  EXPECT_EQ(plan.value().size(), 6u);
  EXPECT_EQ(plan.value()[1], (CopyRun{0, 12, 24, 12}));  // row 1 of the left half
  expect_plan_fills(shape, whole_box(shape), halves);
}

TEST(Box, AReaderOfAFinerSplitTakesOnlyItsPart) {
  // TP=2 trainer (rows) read by a TP=4 rollout shard 2 (rows 4..5 of 8): one run from source 1.
  const Shape shape{8, 4};
  const std::vector<Box> halves{{{0, 0}, {4, 4}}, {{4, 0}, {4, 4}}};
  const auto plan = plan_copy("w", shape, 2, Box{{4, 0}, {2, 4}}, halves);
  ASSERT_TRUE(plan);
  EXPECT_EQ(plan.value(), (std::vector<CopyRun>{{1, 0, 0, 16}}));
}

TEST(Box, AScalarIsOneElement) {
  const auto plan = plan_copy("step", Shape{}, 4, whole_box(Shape{}), {whole_box(Shape{})});
  ASSERT_TRUE(plan);
  EXPECT_EQ(plan.value(), (std::vector<CopyRun>{{0, 0, 0, 4}}));
}

TEST(Box, RandomTilingsFillRandomBoxesExactly) {
  std::mt19937_64 random(20261204);
  for (int round = 0; round < 400; ++round) {
    const std::size_t rank = 1 + random() % 4;
    Shape shape(rank);
    for (auto& length : shape) length = 1 + random() % 7;
    // A grid tiling: every dimension cut at random points (row, column and mixed splits).
    std::vector<std::vector<std::pair<std::uint64_t, std::uint64_t>>> cuts(rank);
    for (std::size_t d = 0; d < rank; ++d) {
      std::uint64_t begin = 0;
      while (begin < shape[d]) {
        const std::uint64_t length = 1 + random() % (shape[d] - begin);
        cuts[d].emplace_back(begin, length);
        begin += length;
      }
    }
    std::vector<Box> sources;
    std::vector<std::size_t> pick(rank, 0);
    while (true) {
      Box box{Shape(rank), Shape(rank)};
      for (std::size_t d = 0; d < rank; ++d) std::tie(box.offset[d], box.extent[d]) = cuts[d][pick[d]];
      sources.push_back(box);
      std::size_t d = rank;
      while (d-- > 0 && ++pick[d] == cuts[d].size()) pick[d] = 0;
      if (d == static_cast<std::size_t>(-1)) break;
    }
    std::shuffle(sources.begin(), sources.end(), random);
    ASSERT_EQ(error_of(check_tiling("t", shape, sources)), "ok");
    Box target{Shape(rank), Shape(rank)};
    for (std::size_t d = 0; d < rank; ++d) {
      target.offset[d] = random() % shape[d];
      target.extent[d] = 1 + random() % (shape[d] - target.offset[d]);
    }
    SCOPED_TRACE("round " + std::to_string(round));
    expect_plan_fills(shape, target, sources);
  }
}

TEST(Box, BadBoxesAreRefusedNamingTheTensor) {
  const Shape shape{4, 4};
  EXPECT_EQ(error_of(check_box("q", shape, Box{{0, 2}, {4, 3}})),
            "tensor 'q': box [0:4, 2:5] lies outside its shape [4, 4] in dimension 1");
  EXPECT_EQ(error_of(check_box("q", shape, Box{{4, 0}, {1, 4}})),
            "tensor 'q': box [4:5, 0:4] lies outside its shape [4, 4] in dimension 0");
  EXPECT_EQ(error_of(check_box("q", shape, Box{{0, 0}, {0, 4}})),
            "tensor 'q': box [0:0, 0:4] is empty in dimension 0");
  EXPECT_EQ(error_of(check_box("q", shape, Box{{0}, {4}})),
            "tensor 'q': a box of 1 offsets and 1 extents for its shape [4, 4]");
  EXPECT_EQ(error_of(check_box("q", Shape{~std::uint64_t{0}, 2}, whole_box(Shape{~std::uint64_t{0}, 2}))),
            "tensor 'q': its shape [18446744073709551615, 2] has more than 2^64 elements");
  EXPECT_EQ(error_of(check_box("q", Shape(9, 1), whole_box(Shape(9, 1)))),
            "tensor 'q': its shape [1, 1, 1, 1, 1, 1, 1, 1, 1] has more than 8 dimensions");
  // An offset past the shape that would wrap around with its extent.
  EXPECT_NE(error_of(check_box("q", shape, Box{{~std::uint64_t{0}, 0}, {2, 4}})), "ok");
}

TEST(Box, OverlapsAndGapsInALayoutAreRefused) {
  const Shape shape{4, 4};
  EXPECT_EQ(error_of(check_tiling("k", shape, {{{0, 0}, {3, 4}}, {{2, 0}, {2, 4}}})),
            "tensor 'k': boxes [0:3, 0:4] and [2:4, 0:4] overlap in [2:3, 0:4]");
  EXPECT_EQ(error_of(check_tiling("k", shape, {{{0, 0}, {2, 4}}, {{3, 0}, {1, 4}}})),
            "tensor 'k': its pieces hold 12 of the 16 elements of shape [4, 4]: some part is in no piece");
  EXPECT_EQ(error_of(check_tiling("k", shape, {{{0, 0}, {4, 4}}})), "ok");
  const std::vector<Box> too_many(limits::kBoxesPerTensorMax + 1, whole_box(shape));
  const Status refused = check_tiling("k", shape, too_many);
  ASSERT_FALSE(refused);
  EXPECT_EQ(refused.error().code, Errc::kLimitExceeded);
}

TEST(Box, ATargetNoSourceCoversIsAnErrorNotAHang) {
  const Shape shape{8, 4};
  const auto plan = plan_copy("v", shape, 2, whole_box(shape), {Box{{0, 0}, {4, 4}}});
  ASSERT_FALSE(plan);
  EXPECT_EQ(plan.error().code, Errc::kInvalidArgument);
  EXPECT_EQ(plan.error().detail, "tensor 'v': no piece holds part of box [0:8, 0:4] (16 of its 32 elements)");
}

TEST(Box, APlanOfTooManyRunsIsRefused) {
  // A column split so fine that every element is its own run: the source should pack instead.
  const Shape shape{std::uint64_t{1} << 11, std::uint64_t{1} << 10};
  std::vector<Box> columns;
  for (std::uint64_t c = 0; c < 2; ++c) columns.push_back(Box{{0, c * 512}, {shape[0], 512}});
  ASSERT_TRUE(plan_copy("o", shape, 2, whole_box(shape), columns));  // 4,096 runs
  const Shape tall{std::uint64_t{1} << 20, 4};
  std::vector<Box> thin{Box{{0, 0}, {tall[0], 2}}, Box{{0, 2}, {tall[0], 2}}};
  const auto refused = plan_copy("o", tall, 2, whole_box(tall), thin);
  ASSERT_FALSE(refused);
  EXPECT_EQ(refused.error().code, Errc::kLimitExceeded);
}

}  // namespace
}  // namespace th
