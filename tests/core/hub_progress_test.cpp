// Unit tests of timing a read on the way (TransferProgress, core/hub_rates.cpp, issue 34): each
// reader shard reports once, a sixteenth into its read, how far it came, so that the hub finds a
// slow member at the root of a version's first chain before everyone behind it has waited for it
// to the end (bench/run-change "slow": 3.15 x the ideal when only a read's end timed replicas).
// Time is the driver's.
#include <gtest/gtest.h>

#include <initializer_list>
#include <map>
#include <string>

#include "core/agent.h"
#include "tests/core/testkit/driver.h"

namespace th::test {
namespace {

ReplicaSpec replica(std::string name, std::string role) {
  ReplicaSpec spec;
  spec.name = std::move(name);
  spec.num_shards = 2;
  spec.role = std::move(role);
  return spec;
}

const std::uint64_t kShardBytes = layout_for(0)->total_bytes();

struct Chain {
  explicit Chain(HubSettings settings = {}) : driver(settings) {
    t = driver.open_replica(replica("t", "trainer"));
    for (const char* name : {"r0", "r1", "r2"}) rollouts[name] = driver.open_replica(replica(name, "rollout"));
    driver.publish(t, 1);
    // Nobody was ever timed: the readers chain in the order they ask, t -> r0 -> r1 -> r2.
    for (const char* name : {"r0", "r1", "r2"}) {
      for (std::uint32_t shard = 0; shard < 2; ++shard) {
        driver.call(rollouts[name][shard], UpdateRequest{Selector::latest(), layout_for(shard)});
      }
    }
    EXPECT_EQ(sources(), "r0<-t r1<-r0 r2<-r1");
  }
  std::string source_of(const char* name) {
    const auto& reads = driver.inbox(rollouts[name][0]).reads;
    return reads.empty() ? "(none)" : reads.rbegin()->second.source.replica;
  }
  std::string sources(std::initializer_list<const char*> order = {"r0", "r1", "r2"}) {
    std::string out;
    for (const char* name : order) out += (out.empty() ? "" : " ") + std::string(name) + "<-" + source_of(name);
    return out;
  }
  // Every shard of `name` reports `bytes` of its current read (its newest instruction).
  void progress(const char* name, std::uint64_t bytes) {
    for (ClientId shard : rollouts[name]) {
      const auto& reads = driver.inbox(shard).reads;
      ASSERT_FALSE(reads.empty()) << name;
      const StartRead& read = reads.rbegin()->second;
      driver.report(shard, TransferProgress{read.transfer, read.epoch, bytes});
    }
  }
  void finish(std::initializer_list<const char*> order) {
    for (const char* name : order) {
      driver.finish_reads(rollouts[name]);
      EXPECT_TRUE(is<UpdateOk>(driver.replies(rollouts[name]))) << name;
    }
  }
  Driver driver;
  std::vector<ClientId> t;
  std::map<std::string, std::vector<ClientId>> rollouts;
};

TEST(HubProgress, TheReaderBehindASlowRootTakesItsSourceAndTheRootReadsAtTheEnd) {
  Chain chain;
  // 100 ms in, the root has a sixteenth of its shards (alone at the trainer: its own pace), and r1
  // as much (behind it: at least that fast). Nothing compares with the root's rate, so r1 goes
  // ahead of it to be timed; the root reads at the chain's end, where it holds nobody up.
  chain.driver.advance(100);
  chain.progress("r0", progress_report_bytes(kShardBytes));
  EXPECT_EQ(chain.sources(), "r0<-t r1<-r0 r2<-r1");
  chain.progress("r1", progress_report_bytes(kShardBytes));
  EXPECT_EQ(chain.sources({"r1", "r2", "r0"}), "r1<-t r2<-r1 r0<-r2");
  EXPECT_EQ(chain.driver.hub().stats().transfers_displaced, 1u);
  EXPECT_EQ(chain.driver.hub().stats().progress_reports, 4u);
  // r1, alone at the trainer, reads four times as fast: the root is known slow, and r2 stays
  // behind r1 (which is not slower than it).
  chain.driver.advance(25);
  chain.progress("r1", progress_report_bytes(kShardBytes));
  chain.progress("r2", progress_report_bytes(kShardBytes));
  EXPECT_EQ(chain.sources({"r1", "r2", "r0"}), "r1<-t r2<-r1 r0<-r2");
  EXPECT_EQ(chain.driver.hub().stats().transfers_displaced, 1u);
  chain.finish({"r1", "r2", "r0"});
}

TEST(HubProgress, AReaderThatReportedBeforeItsRootPassesItWhenTheRootReports) {
  Chain chain;
  chain.driver.advance(100);
  chain.progress("r1", progress_report_bytes(kShardBytes));
  EXPECT_EQ(chain.sources(), "r0<-t r1<-r0 r2<-r1");  // the root's pace is not known yet
  chain.progress("r0", progress_report_bytes(kShardBytes));
  EXPECT_EQ(chain.sources({"r1", "r2", "r0"}), "r1<-t r2<-r1 r0<-r2");
  chain.finish({"r1", "r2", "r0"});
}

TEST(HubProgress, LateInTheRootsReadNothingMoves) {
  Chain chain;
  // The root's sixteenth in 100 ms: its read takes 1.6 s. r1's report (as far as the root got,
  // late on its way) comes when more than a third of that has passed, past the first eighth,
  // where moving the root costs more than it can save.
  chain.driver.advance(100);
  chain.progress("r0", progress_report_bytes(kShardBytes));
  chain.driver.advance(500);
  chain.progress("r1", kShardBytes * 3 / 8);
  EXPECT_EQ(chain.sources(), "r0<-t r1<-r0 r2<-r1");
  EXPECT_EQ(chain.driver.hub().stats().transfers_displaced, 0u);
  chain.finish({"r0", "r1", "r2"});
}

TEST(HubProgress, AReportRepeatedOrOfAnEarlierEpochCountsOnce) {
  Chain chain;
  chain.driver.advance(100);
  chain.progress("r0", progress_report_bytes(kShardBytes));
  chain.progress("r0", 1);  // repeated: the first one stands (else r0 would look far slower)
  EXPECT_EQ(chain.driver.hub().stats().progress_reports, 2u);
  chain.progress("r1", progress_report_bytes(kShardBytes));
  EXPECT_EQ(chain.sources({"r1", "r2", "r0"}), "r1<-t r2<-r1 r0<-r2");
  // r0 reads again (epoch 2): a report of its first epoch, late, is not this read's.
  for (ClientId shard : chain.rollouts["r0"]) {
    const auto& reads = chain.driver.inbox(shard).reads;
    const StartRead& read = reads.rbegin()->second;
    ASSERT_EQ(read.epoch, 2u);
    chain.driver.report(shard, TransferProgress{read.transfer, 1, kShardBytes / 2});
  }
  EXPECT_EQ(chain.driver.hub().stats().progress_reports, 4u);
  chain.finish({"r1", "r2", "r0"});
}

TEST(HubProgress, AReportOfMoreBytesThanTheShardHasIsNoMeasurement) {
  Chain chain;
  chain.driver.advance(100);
  chain.progress("r0", progress_report_bytes(kShardBytes));
  // Taken as a measurement, r1 would have kept the root's pace (and more) and passed it.
  chain.progress("r1", kShardBytes + 1);
  EXPECT_EQ(chain.sources(), "r0<-t r1<-r0 r2<-r1");
  EXPECT_EQ(chain.driver.hub().stats().transfers_displaced, 0u);
  chain.finish({"r0", "r1", "r2"});
}

TEST(HubProgress, AReaderSlowerThanTheRootOnOneShardStaysBehindIt) {
  Chain chain;
  // r1 kept the root's pace on shard 0 but not on shard 1, where its own NIC is the slower: moved
  // to the chain's end, the root would wait there for r1's shard 1 (and every other member's
  // slowest NIC): one source serves all of a replica's shards.
  chain.driver.advance(100);
  chain.progress("r0", progress_report_bytes(kShardBytes));
  const auto& reads = chain.driver.inbox(chain.rollouts["r1"][0]).reads;
  const StartRead read = reads.rbegin()->second;
  chain.driver.report(chain.rollouts["r1"][0], TransferProgress{read.transfer, read.epoch, progress_report_bytes(kShardBytes)});
  chain.driver.report(chain.rollouts["r1"][1], TransferProgress{read.transfer, read.epoch, progress_report_bytes(kShardBytes) / 2});
  EXPECT_EQ(chain.sources(), "r0<-t r1<-r0 r2<-r1");
  EXPECT_EQ(chain.driver.hub().stats().transfers_displaced, 0u);
  chain.finish({"r0", "r1", "r2"});
}

TEST(HubProgress, ARootMovedToTheEndStaysKnownSlowForTheNextVersion) {
  Chain chain;
  chain.driver.advance(100);
  chain.progress("r0", progress_report_bytes(kShardBytes));
  chain.progress("r1", progress_report_bytes(kShardBytes));
  ASSERT_EQ(chain.sources({"r1", "r2", "r0"}), "r1<-t r2<-r1 r0<-r2");
  chain.driver.advance(25);
  chain.progress("r1", progress_report_bytes(kShardBytes));
  // At the chain's end r0 read behind r2: its sixteenth from there, a little faster than at the
  // trainer (noise), is a lower bound, which must not make r0's measured pace unknown again.
  chain.driver.advance(65);
  chain.progress("r0", progress_report_bytes(kShardBytes));
  chain.finish({"r1", "r2"});
  chain.driver.advance(1000);
  chain.finish({"r0"});
  chain.driver.call_all(chain.t, UnpublishRequest{});
  EXPECT_TRUE(is<UnpublishOk>(chain.driver.replies(chain.t)));
  chain.driver.publish(chain.t, 2);
  // r0 asks first and takes the trainer; r1, known four times as fast, takes its place at once.
  for (std::uint32_t shard = 0; shard < 2; ++shard) {
    chain.driver.call(chain.rollouts["r0"][shard], UpdateRequest{Selector::latest(), layout_for(shard)});
  }
  chain.driver.advance(30);
  for (std::uint32_t shard = 0; shard < 2; ++shard) {
    chain.driver.call(chain.rollouts["r1"][shard], UpdateRequest{Selector::latest(), layout_for(shard)});
  }
  EXPECT_EQ(chain.sources({"r1", "r0"}), "r1<-t r0<-r1");
}

TEST(HubProgress, AReaderTimedInAnEarlierVersionPassesANewSlowRoot) {
  // r0 and r1 were each timed alone at the trainer in version 1 (a shard in 100 ms). A new host,
  // never timed, asks first for version 2 and takes the root; a sixteenth in 400 ms, it is 16
  // times slower, and r0 behind it kept its pace: r0 takes the trainer. (A reader's figures on
  // the way count for passing even when a read's end timed it before.)
  Chain chain;
  Driver& driver = chain.driver;
  chain.finish({"r0", "r1", "r2"});
  chain.rollouts["s"] = driver.open_replica(replica("s", "rollout"));
  driver.call_all(chain.t, UnpublishRequest{});
  EXPECT_TRUE(is<UnpublishOk>(driver.replies(chain.t)));
  driver.publish(chain.t, 2);
  for (const char* name : {"s", "r0", "r1"}) {
    for (std::uint32_t shard = 0; shard < 2; ++shard) {
      driver.call(chain.rollouts[name][shard], UpdateRequest{Selector::latest(), layout_for(shard)});
    }
  }
  ASSERT_EQ(chain.source_of("s"), "t");
  const char* behind = chain.source_of("r0") == "s" ? "r0" : "r1";
  ASSERT_EQ(chain.source_of(behind), "s");
  driver.advance(400);
  for (const char* name : {"s", "r0", "r1"}) chain.progress(name, progress_report_bytes(kShardBytes));
  EXPECT_EQ(chain.source_of(behind), "t");
  EXPECT_NE(chain.source_of("s"), "t");
  EXPECT_EQ(driver.hub().stats().passed_mid_read, 1u);
}

// An attack (helper review of the change): a token holder's progress report is its own word. A
// slow rollout that claims its whole shard a sixteenth in, then again alone at the trainer, was
// taken for exact at many times everyone's pace, and (its read moved, so never timed at its end)
// kept the root of every later chain. The read's end belies the claim: undone, and counted.
TEST(HubProgress, AProgressClaimThatTheReadsEndBeliesIsUndone) {
  Chain chain;
  Driver& driver = chain.driver;
  driver.advance(100);
  chain.progress("r0", progress_report_bytes(kShardBytes));
  chain.progress("r1", kShardBytes);  // a lie: its whole shard
  ASSERT_EQ(chain.sources({"r1", "r2", "r0"}), "r1<-t r2<-r1 r0<-r2");
  driver.advance(25);
  chain.progress("r1", kShardBytes);  // alone at the trainer: "exact", at 66 times r0's pace
  driver.advance(3000);  // r1 really reads slowly: 3 s
  chain.finish({"r1", "r2", "r0"});
  EXPECT_EQ(driver.hub().stats().progress_claims_refuted, 1u);
  driver.call_all(chain.t, UnpublishRequest{});
  EXPECT_TRUE(is<UnpublishOk>(driver.replies(chain.t)));
  driver.publish(chain.t, 2);
  // r0 asks first and takes the trainer; r1 counts as never timed, not as the fleet's fastest,
  // and joins behind it (believed, it took r0's place: r1<-t r0<-r1).
  for (const char* name : {"r0", "r1"}) {
    for (std::uint32_t shard = 0; shard < 2; ++shard) {
      driver.call(chain.rollouts[name][shard], UpdateRequest{Selector::latest(), layout_for(shard)});
    }
    driver.advance(5);
  }
  EXPECT_EQ(chain.sources({"r0", "r1"}), "r0<-t r1<-r0");
}

TEST(HubProgress, WithoutRateAwarenessTheChainKeepsItsOrder) {
  HubSettings settings;
  settings.rate_aware_sources = false;
  Chain chain(settings);
  chain.driver.advance(100);
  chain.progress("r0", progress_report_bytes(kShardBytes));
  chain.progress("r1", progress_report_bytes(kShardBytes));
  EXPECT_EQ(chain.sources(), "r0<-t r1<-r0 r2<-r1");
  EXPECT_EQ(chain.driver.hub().stats().transfers_displaced, 0u);
  chain.finish({"r0", "r1", "r2"});
}

}  // namespace
}  // namespace th::test
