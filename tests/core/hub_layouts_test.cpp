// Unit tests of the hub's layouts (core/hub_layouts.cpp, README "Layouts"): replicas of other shard
// counts and boxes read one another's complete copies, each reader shard from every source shard;
// what they cannot read is an error that names the tensor, never a wait.
#include <gtest/gtest.h>

#include "tests/core/testkit/driver.h"
#include "tests/core/testkit/tensors.h"

namespace th::test {
namespace {

ReplicaSpec replica(std::string name, std::uint32_t shards, std::string role = "rollout") {
  ReplicaSpec spec;
  spec.name = std::move(name);
  spec.num_shards = shards;
  spec.role = std::move(role);
  return spec;
}

const Shape kW{64, 64};
const Shape kNorm{64};

// Megatron-style tensor parallelism over `ranks`: "w" split by rows, "norm" replicated.
LayoutRef tensor_parallel(std::uint32_t rank, std::uint32_t ranks, DType dtype = DType::kBFloat16) {
  const std::uint64_t rows = 64 / ranks;
  return ShardLayout::make({piece("norm", kNorm, Box{{0}, {64}}, dtype),
                            piece("w", kW, Box{{rank * rows, 0}, {rows, 64}}, dtype)})
      .value();
}

ChecksumsRef sums(std::uint64_t a, std::uint64_t b) { return std::make_shared<const Checksums>(Checksums{a, b}); }

std::vector<ClientId> publish_tp2(Driver& driver, const std::string& name, Version version) {
  const auto t = driver.open_replica(replica(name, 2, "trainer"));
  driver.call(t[0], PublishRequest{version, tensor_parallel(0, 2), checksums_for(version, 0)});
  driver.call(t[1], PublishRequest{version, tensor_parallel(1, 2), checksums_for(version, 1)});
  EXPECT_TRUE(is<PublishOk>(driver.replies(t)));
  return t;
}

TEST(HubLayouts, AReaderOfOneShardReadsATwoShardCopyFromBothShardsAsOneGrant) {
  Driver driver;
  const auto t = publish_tp2(driver, "t", 1);
  const auto r = driver.open_replica(replica("r", 1));
  driver.call(r[0], ReplicateRequest{Selector::latest(), tensor_parallel(0, 1, DType::kFloat32), 0});
  Inbox& reader = driver.inbox(r[0]);
  ASSERT_EQ(reader.reads.size(), 1u);
  const StartRead read = reader.reads.begin()->second;
  // Every shard of the source, with what it holds and its checksums; nothing of the reader's own
  // layout is known yet.
  ASSERT_EQ(read.reshard.size(), 2u);
  EXPECT_EQ(read.checksums, nullptr);
  for (std::uint32_t shard = 0; shard < 2; ++shard) {
    EXPECT_TRUE(read.reshard[shard].layout->tensors()[1].box == tensor_parallel(shard, 2)->tensors()[1].box);
    EXPECT_EQ(*read.reshard[shard].checksums, *checksums_for(1, shard));
    // Each source shard was granted this transfer, under the secret the reader was told.
    const auto grant = driver.inbox(t[shard]).grants.find({read.transfer, read.epoch});
    ASSERT_NE(grant, driver.inbox(t[shard]).grants.end()) << "source shard " << shard;
    EXPECT_EQ(grant->second.secret, read.secret);
    EXPECT_EQ(grant->second.shard, shard);
  }
  // Done without saying what it assembled: nobody could vouch for the bytes, so it is no answer.
  driver.report(r[0], TransferDone{read.transfer, read.epoch, nullptr});
  EXPECT_FALSE(driver.has_reply(r[0]));
  // (What it assembled: the testkit's checksums of shard 0, which its own readers are checked against.)
  driver.report(r[0], TransferDone{read.transfer, read.epoch, checksums_for(1, 0)});
  const auto done = driver.replies(r);
  ASSERT_TRUE(is<ReplicateOk>(done)) << describe(*done);
  EXPECT_EQ(std::get<ReplicateOk>(*done).source_replica, "t");
  for (const ClientId shard : t) EXPECT_TRUE(driver.inbox(shard).grants.empty()) << "every grant is withdrawn";

  // Another replica of the reader's layout, once the trainer's copy is gone, reads the first
  // reader's copy shard by shard and verifies it against what that reader assembled.
  driver.call_all(t, UnpublishRequest{});
  EXPECT_TRUE(is<UnpublishOk>(driver.replies(t)));
  const auto r2 = driver.open_replica(replica("r2", 1));
  driver.call(r2[0], ReplicateRequest{Selector::latest(), tensor_parallel(0, 1, DType::kFloat32), 0});
  ASSERT_EQ(driver.inbox(r2[0]).reads.size(), 1u);
  const StartRead same = driver.inbox(r2[0]).reads.begin()->second;
  EXPECT_TRUE(same.reshard.empty());
  ASSERT_NE(same.checksums, nullptr);
  EXPECT_EQ(*same.checksums, *checksums_for(1, 0));
  EXPECT_EQ(same.source.replica, "r");
}

TEST(HubLayouts, AFourShardReaderReadsEveryShardOfATwoShardCopy) {
  Driver driver;
  publish_tp2(driver, "t", 1);
  const auto r = driver.open_replica(replica("r", 4));
  for (std::uint32_t shard = 0; shard < 4; ++shard) {
    driver.call(r[shard], ReplicateRequest{Selector::latest(), tensor_parallel(shard, 4), 0});
  }
  for (std::uint32_t shard = 0; shard < 4; ++shard) {
    Inbox& inbox = driver.inbox(r[shard]);
    ASSERT_EQ(inbox.reads.size(), 1u) << "shard " << shard;
    const StartRead& read = inbox.reads.begin()->second;
    EXPECT_EQ(read.reshard.size(), 2u);
    driver.report(r[shard], TransferDone{read.transfer, read.epoch, sums(50, 60 + shard)});
  }
  EXPECT_TRUE(is<ReplicateOk>(driver.replies(r)));
}

TEST(HubLayouts, ATensorNoHolderHasIsAnErrorNamingIt) {
  Driver driver;
  publish_tp2(driver, "t", 1);
  const auto r = driver.open_replica(replica("r", 1));
  LayoutRef wants = ShardLayout::make({piece("norm", kNorm, Box{{0}, {64}}), piece("w", kW, Box{{0, 0}, {64, 64}}),
                                       piece("lm_head", {8, 64}, Box{{0, 0}, {8, 64}})})
                        .value();
  driver.call(r[0], ReplicateRequest{Selector::latest(), wants, 0});
  const auto refused = driver.replies(r);
  ASSERT_TRUE(refused && is_error(*refused, Errc::kLayoutMismatch)) << (refused ? describe(*refused) : "no reply");
  EXPECT_NE(describe(*refused).find("tensor 'lm_head': no shard of the layout of 2 shards"), std::string::npos)
      << describe(*refused);
  EXPECT_TRUE(driver.inbox(r[0]).reads.empty()) << "nothing was read";
}

TEST(HubLayouts, AnotherGlobalShapeIsAnErrorNamingBoth) {
  Driver driver;
  publish_tp2(driver, "t", 1);
  const auto r = driver.open_replica(replica("r", 1));
  LayoutRef transposed =
      ShardLayout::make({piece("norm", kNorm, Box{{0}, {64}}), piece("w", {32, 128}, Box{{0, 0}, {32, 128}})}).value();
  driver.call(r[0], ReplicateRequest{Selector::latest(), transposed, 0});
  const auto refused = driver.replies(r);
  ASSERT_TRUE(refused && is_error(*refused, Errc::kLayoutMismatch)) << (refused ? describe(*refused) : "no reply");
  EXPECT_NE(describe(*refused).find("tensor 'w': shard 0 takes it as bfloat16 [32, 128]"), std::string::npos)
      << describe(*refused);
  EXPECT_NE(describe(*refused).find("holds bfloat16 [64, 64]"), std::string::npos) << describe(*refused);
}

TEST(HubLayouts, AReplicaOfAnotherShardCountWhoseTensorsAreNotPiecesIsRefusedAtOnce) {
  Driver driver;
  publish_tp2(driver, "t", 1);
  const auto r = driver.open_replica(replica("r", 1));
  driver.call(r[0], ReplicateRequest{Selector::latest(), ShardLayout::make({own("w", kW)}).value(), 0});
  const auto refused = driver.replies(r);
  ASSERT_TRUE(refused && is_error(*refused, Errc::kLayoutMismatch)) << (refused ? describe(*refused) : "no reply");
  EXPECT_NE(describe(*refused).find("not all pieces"), std::string::npos) << describe(*refused);
}

TEST(HubLayouts, ACorruptPieceIsReadAgainFromAnotherHolder) {
  Driver driver;
  publish_tp2(driver, "t1", 1);
  publish_tp2(driver, "t2", 1);
  const auto r = driver.open_replica(replica("r", 1));
  driver.call(r[0], ReplicateRequest{Selector::latest(), tensor_parallel(0, 1), 0});
  Inbox& inbox = driver.inbox(r[0]);
  ASSERT_EQ(inbox.reads.size(), 1u);
  const StartRead first = inbox.reads.begin()->second;
  driver.report(r[0], TransferFailed{first.transfer, first.epoch, ReadFailure::kChecksumMismatch});
  const StartRead second = inbox.reads.begin()->second;
  ASSERT_EQ(second.epoch, first.epoch + 1);
  EXPECT_NE(second.source.replica, first.source.replica) << "the copy that failed is not read again";
  EXPECT_EQ(second.reshard.size(), 2u);
  driver.report(r[0], TransferDone{second.transfer, second.epoch, sums(1, 2)});
  EXPECT_TRUE(is<ReplicateOk>(driver.replies(r)));
}

TEST(HubLayouts, WhatAReaderAssembledMustAgreeWithAnotherCopyOfItsLayout) {
  HubSettings settings;
  settings.fanout_max = 4;  // both readers read the trainer's copy at once
  Driver driver(settings);
  publish_tp2(driver, "t", 1);
  const auto r1 = driver.open_replica(replica("r1", 1));
  const auto r2 = driver.open_replica(replica("r2", 1));
  driver.call(r1[0], ReplicateRequest{Selector::latest(), tensor_parallel(0, 1), 0});
  driver.call(r2[0], ReplicateRequest{Selector::latest(), tensor_parallel(0, 1), 0});
  ASSERT_EQ(driver.inbox(r1[0]).reads.size(), 1u);
  ASSERT_EQ(driver.inbox(r2[0]).reads.size(), 1u);
  const StartRead read1 = driver.inbox(r1[0]).reads.begin()->second;
  const StartRead read2 = driver.inbox(r2[0]).reads.begin()->second;
  ASSERT_EQ(read2.reshard.size(), 2u) << "a copy still reading another layout is no pipeline source";
  driver.report(r1[0], TransferDone{read1.transfer, read1.epoch, checksums_for(1, 0)});
  EXPECT_TRUE(is<ReplicateOk>(driver.replies(r1)));
  // r2 says it assembled other bytes than r1 did: it reads again.
  driver.report(r2[0], TransferDone{read2.transfer, read2.epoch, sums(7, 9)});
  // (The hub names no culprit: the reader's own bytes, or the source's, were bad.)
  EXPECT_FALSE(driver.has_reply(r2[0]));
  const StartRead again = driver.inbox(r2[0]).reads.begin()->second;
  EXPECT_GT(again.epoch, read2.epoch);
}

// Issue 10's hang, across layouts (mutant waiting-chain-counts): two chains in one datacenter,
// of two layouts, lose their roots' sources one after the other. A copy of another layout counts
// as a source soon here (the reader would read it once complete), but not when its own chain ends
// in a reader still waiting for a source: here each root's only such copy reads, through its
// chain, from the other root, and if each waited for the other neither would ever be answered.
TEST(HubLayouts, TwoRootsOfOtherLayoutsDoNotWaitForEachOthersWaitingChains) {
  Driver driver;  // pipeline, fan-out 1, smart skipping
  ReplicaSpec trainer = replica("t", 2, "trainer");
  trainer.datacenter = "dc1";
  const auto t = driver.open_replica(trainer);
  for (std::uint32_t shard = 0; shard < 2; ++shard) {
    driver.call(t[shard], PublishRequest{1, sliced_layout_for(shard, 2), sliced_checksums_for(1, shard, 2)});
  }
  ASSERT_TRUE(is<PublishOk>(driver.replies(t)));
  std::map<std::string, std::vector<ClientId>> r;
  auto replicate_from = [&](const std::string& name, std::uint32_t shards, const std::string& source) {
    r[name] = driver.open_replica(replica(name, shards));  // dc0
    for (std::uint32_t shard = 0; shard < shards; ++shard) {
      driver.call(r[name][shard], ReplicateRequest{Selector::latest(), sliced_layout_for(shard, shards), 0});
    }
    for (const ClientId client : r[name]) {
      ASSERT_EQ(driver.inbox(client).reads.size(), 1u) << name;
      EXPECT_EQ(driver.inbox(client).reads.begin()->second.source.replica, source) << name;
    }
  };
  // Complete roots of both layouts here (one shard, and three), each read by a chain of its own.
  replicate_from("s1", 1, "t");
  driver.finish_reads(r["s1"], /*sliced=*/true);
  ASSERT_TRUE(is<ReplicateOk>(driver.replies(r["s1"])));
  replicate_from("s3", 3, "s1");
  driver.finish_reads(r["s3"], /*sliced=*/true);
  ASSERT_TRUE(is<ReplicateOk>(driver.replies(r["s3"])));
  replicate_from("w1", 1, "s1");
  replicate_from("w3", 3, "s3");
  replicate_from("c1", 1, "w1");
  replicate_from("c3", 3, "w3");
  // The roots' sources go, s1 first: w1 waits for s3 (complete, of a layout it reads). Then s3:
  // what is left here is two chains rooted in waiting readers; w3 must read across datacenters.
  // (Their reads from the sources about to go are void: the data plane fails them.)
  for (const ClientId client : r["w1"]) driver.inbox(client).reads.clear();
  driver.lose_connection(r["s1"][0]);
  for (const ClientId client : r["w3"]) driver.inbox(client).reads.clear();
  for (const ClientId client : r["s3"]) driver.lose_connection(client);
  // Every reader finishes: each round, whoever reads from a complete copy reads to the end.
  const std::vector<std::string> readers = {"w1", "w3", "c1", "c3"};
  EXPECT_EQ(driver.finish_chains(r, readers, {"t"}, /*sliced=*/true), std::vector<std::string>{})
      << "readers left waiting for ever";
  const HubActivity activity = driver.hub().activity();
  EXPECT_EQ(activity.transfers_waiting + activity.transfers_active, 0u);
}

}  // namespace
}  // namespace th::test
