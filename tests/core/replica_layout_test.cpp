#include "core/replica_layout.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "tests/core/testkit/tensors.h"

namespace th {
namespace {

using test::own;
using test::piece;

LayoutRef layout(std::vector<TensorSpec> tensors) { return ShardLayout::make(std::move(tensors)).value(); }

void expect_refused(const std::vector<LayoutRef>& shards, Errc code, const std::vector<std::string>& says) {
  const Status checked = check_replica_pieces(shards);
  ASSERT_FALSE(checked.ok());
  EXPECT_EQ(checked.error().code, code) << checked.error().detail;
  for (const std::string& part : says) {
    EXPECT_NE(checked.error().detail.find(part), std::string::npos) << "'" << part << "' not in: " << checked.error().detail;
  }
}

TEST(ReplicaPieces, MegatronStyleSplitsTile) {
  // TP=2: a column-parallel weight split by rows, a row-parallel one by columns, a replicated norm
  // held whole by the first shard only, and a shard's own tensor on both (same name is fine there).
  const std::vector<LayoutRef> shards = {
      layout({piece("qkv", {96, 64}, Box{{0, 0}, {48, 64}}), piece("o", {64, 64}, Box{{0, 0}, {64, 32}}),
              piece("norm", {64}, Box{{0}, {64}}), own("rng_state", {4})}),
      layout({piece("qkv", {96, 64}, Box{{48, 0}, {48, 64}}), piece("o", {64, 64}, Box{{0, 32}, {64, 32}}),
              own("rng_state", {4})}),
  };
  EXPECT_TRUE(check_replica_pieces(shards).ok());
}

TEST(ReplicaPieces, ShardsMayHoldTheSameWholeBoxButNotPartOfAnother) {
  const Box whole{{0}, {64}};
  EXPECT_TRUE(check_replica_pieces({layout({piece("norm", {64}, whole)}), layout({piece("norm", {64}, whole)})}).ok());
  expect_refused({layout({piece("norm", {64}, whole)}), layout({piece("norm", {64}, whole)}),
                  layout({piece("norm", {64}, Box{{0}, {32}})})},
                 Errc::kLayoutMismatch, {"tensor 'norm'", "overlap in [0:32]"});
}

TEST(ReplicaPieces, LayoutsWithoutPiecesAreLeftAlone) {
  EXPECT_TRUE(check_replica_pieces({layout({own("w", {4, 4})}), layout({own("w", {4, 4})})}).ok());
  EXPECT_TRUE(check_replica_pieces({layout({{"w", DType::kInt8, 16}})}).ok());
}

TEST(ReplicaPieces, OverlapNamesTheTensorAndTheShards) {
  expect_refused({layout({piece("w", {64, 64}, Box{{0, 0}, {40, 64}})}),
                  layout({piece("w", {64, 64}, Box{{32, 0}, {32, 64}})})},
                 Errc::kLayoutMismatch, {"tensor 'w'", "overlap in [32:40, 0:64]", "shard 0 [0:40, 0:64]", "shard 1 [32:64, 0:64]"});
}

TEST(ReplicaPieces, GapNamesTheTensorAndWhatIsMissing) {
  expect_refused({layout({piece("w", {64, 64}, Box{{0, 0}, {32, 64}})}),
                  layout({piece("w", {64, 64}, Box{{32, 0}, {16, 64}})})},
                 Errc::kLayoutMismatch, {"tensor 'w'", "3072 of the 4096 elements", "shard 1 [32:48, 0:64]"});
  // A tensor no shard but one holds part of is a gap too.
  expect_refused({layout({piece("w", {64}, Box{{0}, {32}})}), layout({own("x", {1})})}, Errc::kLayoutMismatch,
                 {"tensor 'w'", "32 of the 64 elements"});
}

TEST(ReplicaPieces, PiecesOfOneTensorAgreeOnDtypeAndShape) {
  expect_refused({layout({piece("w", {64, 64}, Box{{0, 0}, {32, 64}})}),
                  layout({piece("w", {64, 128}, Box{{32, 0}, {32, 64}})})},
                 Errc::kLayoutMismatch, {"tensor 'w'", "shard 0 holds a piece of bfloat16 [64, 64]", "shard 1 of bfloat16 [64, 128]"});
  expect_refused({layout({piece("w", {64}, Box{{0}, {32}})}),
                  layout({piece("w", {64}, Box{{32}, {32}}, DType::kFloat32)})},
                 Errc::kLayoutMismatch, {"shard 1 of float32 [64]"});
}

TEST(ReplicaPieces, ANameIsAPieceEverywhereOrNowhere) {
  expect_refused({layout({piece("w", {8}, Box{{0}, {8}})}), layout({own("w", {8})})}, Errc::kLayoutMismatch,
                 {"tensor 'w' is a piece of the model's tensor on shard 0 but shard 1's own tensor"});
}

TEST(ReplicaPieces, TooManyPiecesIsALimitNotAnEndlessCheck) {
  // 257 shards are beyond any replica; what matters is a bound on the work, so count pieces.
  std::vector<TensorSpec> many;
  const std::size_t per_shard = limits::kPiecesPerReplicaMax / 2 + 1;
  many.reserve(per_shard);
  for (std::size_t i = 0; i < per_shard && i < limits::kTensorsPerShardMax; ++i) {
    many.push_back(piece("t" + std::to_string(i), {1}, Box{{0}, {1}}));
  }
  const LayoutRef big = layout(std::move(many));
  std::vector<LayoutRef> shards(limits::kPiecesPerReplicaMax / big->tensors().size() + 1, big);
  expect_refused(shards, Errc::kLimitExceeded, {"more than"});
}

}  // namespace
}  // namespace th
