#include "core/reshard.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "tests/core/testkit/tensors.h"

namespace th {
namespace {

using test::own;
using test::piece;

// The box of rank `rank` of `size` in an even split of dimension `dim`.
Box split(const Shape& shape, std::size_t dim, std::uint64_t rank, std::uint64_t size) {
  Box box = whole_box(shape);
  box.extent[dim] = shape[dim] / size;
  box.offset[dim] = rank * box.extent[dim];
  return box;
}

// Each element's value is its row-major index in the whole tensor: a run that lands anywhere but
// its place shows.
std::vector<std::uint64_t> values_of(const Shape& shape, const Box& box) {
  std::vector<std::uint64_t> values;
  const std::uint64_t count = element_count(box.extent);
  Shape at(box.offset.size(), 0);
  for (std::uint64_t i = 0; i < count; ++i) {
    std::uint64_t index = 0;
    for (std::size_t d = 0; d < shape.size(); ++d) index = index * shape[d] + box.offset[d] + at[d];
    values.push_back(index);
    for (std::size_t d = at.size(); d-- > 0;) {
      if (++at[d] < box.extent[d]) break;
      at[d] = 0;
    }
  }
  return values;
}

// Carries a plan out over buffers of element indices; each destination must come out as its
// segments' elements of the whole tensors, one after the other.
void expect_exact(const std::vector<LayoutRef>& source, const std::vector<Destination>& destinations,
                  const ReshardPlan& plan) {
  std::vector<std::vector<std::uint64_t>> got(destinations.size());
  std::vector<std::vector<std::uint64_t>> want(destinations.size());
  for (std::size_t i = 0; i < destinations.size(); ++i) {
    for (const Segment& segment : destinations[i].segments) {
      const auto values = values_of(segment.shape, segment.box);
      want[i].insert(want[i].end(), values.begin(), values.end());
    }
    got[i].assign(want[i].size(), ~0ull);
  }
  std::uint64_t landed = 0;
  for (const PieceRead& read : plan.reads) {
    const TensorSpec& held = source[read.shard]->tensors()[read.tensor];
    const auto buffer = values_of(held.shape, held.box);
    Box inside;
    ASSERT_TRUE(intersect(read.needed, held.box, &inside));
    EXPECT_EQ(inside, read.needed) << "the needed box lies in the piece";
    for (const Landing& landing : read.landings) {
      for (const ElementRun& run : landing.runs) {
        ASSERT_LE(run.source_offset + run.count, buffer.size());
        ASSERT_LE(run.destination_offset + run.count, got[landing.destination].size());
        for (std::uint64_t k = 0; k < run.count; ++k) {
          EXPECT_EQ(got[landing.destination][run.destination_offset + k], ~0ull) << "an element lands twice";
          got[landing.destination][run.destination_offset + k] = buffer[run.source_offset + k];
        }
        landed += run.count;
      }
    }
  }
  EXPECT_EQ(got, want);
  EXPECT_EQ(landed, plan.elements_needed);
}

std::vector<LayoutRef> tensor_parallel(const std::map<std::string, std::pair<Shape, std::size_t>>& tensors,
                                       std::uint64_t size) {
  std::vector<LayoutRef> shards;
  for (std::uint64_t rank = 0; rank < size; ++rank) {
    std::vector<TensorSpec> specs;
    for (const auto& [name, placed] : tensors) specs.push_back(piece(name, placed.first, split(placed.first, placed.second, rank, size)));
    shards.push_back(ShardLayout::make(std::move(specs)).value());
  }
  return shards;
}

Destination plain(std::string name, Shape shape, Box box, DType dtype = DType::kBFloat16) {
  return Destination{name, dtype, {Segment{name, std::move(shape), std::move(box)}}};
}

const Shape kColumnShape{64, 32};  // a column-parallel weight: rows split
const Shape kRowShape{32, 64};     // a row-parallel weight: columns split

TEST(Reshard, EightToFourReadsTwoWholePiecesOfEachTensor) {
  const auto source = tensor_parallel({{"up", {kColumnShape, 0}}, {"down", {kRowShape, 1}}}, 8);
  for (std::uint32_t rank = 0; rank < 4; ++rank) {
    const std::vector<Destination> mine = {plain("up", kColumnShape, split(kColumnShape, 0, rank, 4)),
                                           plain("down", kRowShape, split(kRowShape, 1, rank, 4))};
    const auto plan = plan_reshard(source, mine, rank).value();
    expect_exact(source, mine, plan);
    ASSERT_EQ(plan.reads.size(), 4u);  // two pieces of each
    for (const PieceRead& read : plan.reads) {
      EXPECT_TRUE(read.whole);
      EXPECT_TRUE(read.shard == 2 * rank || read.shard == 2 * rank + 1);
    }
    EXPECT_EQ(plan.elements_in_needed_boxes, plan.elements_needed) << "nothing read twice or for nothing";
    // Rows split: each piece is one run. Columns split: one run per row of each piece.
    for (const PieceRead& read : plan.reads) {
      const bool rows = source[read.shard]->tensors()[read.tensor].name == "up";
      EXPECT_EQ(read.landings.at(0).runs.size(), rows ? 1u : kRowShape[0]);
    }
  }
}

TEST(Reshard, TwoToFourNeedsHalfOfOnePiece) {
  const auto source = tensor_parallel({{"up", {kColumnShape, 0}}}, 2);
  const std::vector<Destination> mine = {plain("up", kColumnShape, split(kColumnShape, 0, 1, 4))};
  const auto plan = plan_reshard(source, mine, 1).value();
  expect_exact(source, mine, plan);
  ASSERT_EQ(plan.reads.size(), 1u);
  EXPECT_FALSE(plan.reads[0].whole);
  EXPECT_EQ(plan.reads[0].needed, (Box{{16, 0}, {16, 32}}));
}

TEST(Reshard, FusedQkvAndGateUpUnderTensorParallelism) {
  // The trainer holds q, k, v (and gate, up) as separate tensors, TP=2 by rows; the rollout holds
  // qkv_proj and gate_up_proj, at TP=1 (all of each) and at TP=4 (its rows of each, stacked).
  const Shape q{64, 32}, kv{16, 32}, mlp{96, 32};
  const auto source = tensor_parallel(
      {{"q", {q, 0}}, {"k", {kv, 0}}, {"v", {kv, 0}}, {"gate", {mlp, 0}}, {"up", {mlp, 0}}}, 2);
  for (const std::uint64_t size : {1u, 4u}) {
    for (std::uint64_t rank = 0; rank < size; ++rank) {
      const std::vector<Destination> mine = {
          Destination{"qkv_proj", DType::kBFloat16,
                      {Segment{"q", q, split(q, 0, rank, size)}, Segment{"k", kv, split(kv, 0, rank, size)},
                       Segment{"v", kv, split(kv, 0, rank, size)}}},
          Destination{"gate_up_proj", DType::kBFloat16,
                      {Segment{"gate", mlp, split(mlp, 0, rank, size)}, Segment{"up", mlp, split(mlp, 0, rank, size)}}}};
      const auto plan = plan_reshard(source, mine, static_cast<std::uint32_t>(rank)).value();
      expect_exact(source, mine, plan);
    }
  }
}

TEST(Reshard, ReplicatedPiecesAreSpreadOverTheirHolders) {
  const Shape norm{64};
  std::vector<LayoutRef> source;
  for (int shard = 0; shard < 4; ++shard) source.push_back(ShardLayout::make({piece("norm", norm, whole_box(norm))}).value());
  const std::vector<Destination> mine = {plain("norm", norm, whole_box(norm))};
  for (std::uint32_t spread = 0; spread < 8; ++spread) {
    const auto plan = plan_reshard(source, mine, spread).value();
    ASSERT_EQ(plan.reads.size(), 1u);
    EXPECT_EQ(plan.reads[0].shard, spread % 4);
    expect_exact(source, mine, plan);
  }
}

TEST(Reshard, RandomLayoutsOfAThreeDimensionalTensorLandExactly) {
  // Sources and readers split a [12, 10, 8] tensor into blocks along random dimensions; every plan
  // must put every element in its place.
  const Shape shape{12, 10, 8};
  std::mt19937_64 random(20261204);
  const auto blocks = [&](std::uint64_t* count) {
    std::vector<Box> boxes = {whole_box(shape)};
    for (int cut = 0; cut < 3; ++cut) {
      const std::size_t dim = random() % 3;
      const std::uint64_t parts = (shape[dim] % 2 == 0) ? 2 : 1;
      std::vector<Box> next;
      for (const Box& box : boxes) {
        if (box.extent[dim] % parts != 0) {
          next.push_back(box);
          continue;
        }
        for (std::uint64_t p = 0; p < parts; ++p) {
          Box part = box;
          part.extent[dim] = box.extent[dim] / parts;
          part.offset[dim] = box.offset[dim] + p * part.extent[dim];
          next.push_back(part);
        }
      }
      boxes = next;
    }
    *count = boxes.size();
    return boxes;
  };
  for (int trial = 0; trial < 50; ++trial) {
    std::uint64_t sources = 0;
    std::uint64_t readers = 0;
    const auto source_boxes = blocks(&sources);
    const auto reader_boxes = blocks(&readers);
    std::vector<LayoutRef> source;
    for (const Box& box : source_boxes) source.push_back(ShardLayout::make({piece("t", shape, box)}).value());
    for (std::uint32_t reader = 0; reader < readers; ++reader) {
      const std::vector<Destination> mine = {plain("t", shape, reader_boxes[reader], DType::kFloat32)};
      const auto plan = plan_reshard(source, mine, reader);
      ASSERT_TRUE(plan.ok()) << plan.error().detail;
      expect_exact(source, mine, plan.value());
    }
  }
}

void expect_refused(const Result<ReshardPlan>& plan, const std::string& says) {
  ASSERT_FALSE(plan.ok());
  EXPECT_EQ(plan.error().code, Errc::kLayoutMismatch) << plan.error().detail;
  EXPECT_NE(plan.error().detail.find(says), std::string::npos) << plan.error().detail;
}

TEST(Reshard, WhatCannotBePlannedNamesTheDestinationAndTensor) {
  const auto source = tensor_parallel({{"up", {kColumnShape, 0}}}, 2);
  expect_refused(plan_reshard(source, {plain("gate", kColumnShape, whole_box(kColumnShape))}, 0),
                 "destination 'gate': tensor 'gate' is a piece on no shard of the source");
  expect_refused(plan_reshard(source, {plain("up", {32, 64}, whole_box({32, 64}))}, 0),
                 "destination 'up': tensor 'up': global shape [64, 32] in the source, [32, 64] here");
  expect_refused(plan_reshard(source, {plain("up", kColumnShape, whole_box(kColumnShape), DType::kInt8)}, 0),
                 "tensor 'up': dtype bfloat16 in the source, int8 here");
  expect_refused(plan_reshard(source, {plain("up", kColumnShape, Box{{60, 0}, {8, 32}})}, 0), "lies outside its shape");
  const Destination lopsided{"fused", DType::kBFloat16,
                             {Segment{"up", kColumnShape, Box{{0, 0}, {8, 32}}}, Segment{"up", kColumnShape, Box{{8, 0}, {8, 16}}}}};
  expect_refused(plan_reshard(source, {lopsided}, 0), "differ beyond dimension 0");
  // A source missing a piece (one shard of two) leaves rows nobody holds.
  expect_refused(plan_reshard({source[0]}, {plain("up", kColumnShape, whole_box(kColumnShape))}, 0),
                 "no piece holds part of box [0:64, 0:32]");
  expect_refused(plan_reshard(source, {Destination{"empty", DType::kBFloat16, {}}}, 0), "destination 'empty': it has no segment");
}

TEST(Reshard, FloatsConvertOnLandingOtherDtypesDoNot) {
  EXPECT_TRUE(converts(DType::kBFloat16, DType::kFloat32));
  EXPECT_TRUE(converts(DType::kFloat32, DType::kFloat16));
  EXPECT_TRUE(converts(DType::kInt8, DType::kInt8));
  EXPECT_FALSE(converts(DType::kFloat8E4M3, DType::kBFloat16));
  EXPECT_FALSE(converts(DType::kInt32, DType::kFloat32));
  const auto source = tensor_parallel({{"up", {kColumnShape, 0}}}, 2);
  const std::vector<Destination> mine = {plain("up", kColumnShape, whole_box(kColumnShape), DType::kFloat32)};
  expect_exact(source, mine, plan_reshard(source, mine, 0).value());
}

}  // namespace
}  // namespace th
