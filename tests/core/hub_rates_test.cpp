// Unit tests of rate-aware source selection (core/hub_rates.cpp, issue 34): the hub measures how
// fast each replica receives, and a slow member moves to the end of the chain instead of holding
// up the readers behind it. Time is the driver's: a shard's read takes as long as the test waits
// before it reports TransferDone.
#include <gtest/gtest.h>

#include <initializer_list>
#include <string>

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

void start_update(Driver& driver, const std::vector<ClientId>& shards) {
  for (std::uint32_t shard = 0; shard < shards.size(); ++shard) {
    driver.call(shards[shard], UpdateRequest{Selector::latest(), layout_for(shard)});
  }
}

std::string source_of(Driver& driver, const std::vector<ClientId>& shards) {
  const auto& reads = driver.inbox(shards[0]).reads;
  return reads.empty() ? "(none)" : reads.rbegin()->second.source.replica;
}

void finish_shard(Driver& driver, ClientId client) {
  auto reads = driver.inbox(client).reads;
  driver.inbox(client).reads.clear();
  for (const auto& [transfer, read] : reads) driver.report(client, TransferDone{transfer, read.epoch, nullptr});
}

HubSettings with_fanout(std::uint32_t fanout_max) {
  HubSettings settings;
  settings.fanout_max = fanout_max;
  return settings;
}

struct Fleet {
  explicit Fleet(HubSettings settings = {}) : driver(settings) {
    t = driver.open_replica(replica("t", "trainer"));
    for (const char* name : {"r0", "r1", "r2"}) rollouts[name] = driver.open_replica(replica(name, "rollout"));
  }
  // Version 1 through the chain t -> r0 -> r1 -> r2 (the readers arrive in that order): shard 0
  // of every reader arrives after 10 ms, shard 1 after `slow_shard_ms` (r0's own pace: it reads
  // a complete copy alone), the readers behind r0 a millisecond after their source.
  void first_version(TimeMs slow_shard_ms) {
    driver.publish(t, 1);
    for (const char* name : {"r0", "r1", "r2"}) start_update(driver, rollouts[name]);
    EXPECT_EQ(source_of(driver, rollouts["r0"]), "t");
    EXPECT_EQ(source_of(driver, rollouts["r1"]), "r0");
    EXPECT_EQ(source_of(driver, rollouts["r2"]), "r1");
    driver.advance(10);
    for (const char* name : {"r0", "r1", "r2"}) finish_shard(driver, rollouts[name][0]);
    driver.advance(slow_shard_ms - 10);
    for (const char* name : {"r0", "r1", "r2"}) {
      finish_shard(driver, rollouts[name][1]);
      EXPECT_TRUE(is<UpdateOk>(driver.replies(rollouts[name]))) << name;
      driver.advance(1);
    }
  }
  // Version 2: the trainer publishes it, and the rollouts update in the order given.
  void second_version(std::initializer_list<const char*> order) {
    publish(2);
    for (const char* name : order) start_update(driver, rollouts[name]);
  }
  // Version 2: r0 updates, and r1 200 ms later, too late for r0 (a read of about 1000 ms) to give
  // its source away.
  void r1_after_r0_late() {
    publish(2);
    start_update(driver, rollouts["r0"]);
    driver.advance(200);
    start_update(driver, rollouts["r1"]);
  }
  // Each rollout's source, in the order given: "r0<-t r1<-r0 ...".
  std::string sources(std::initializer_list<const char*> order) {
    std::string out;
    for (const char* name : order) out += (out.empty() ? "" : " ") + std::string(name) + "<-" + source_of(driver, rollouts[name]);
    return out;
  }
  // A rollout of datacenter dc1 (the fleet's is dc0), and its read finished.
  std::vector<ClientId> open_far(const char* name) {
    ReplicaSpec spec = replica(name, "rollout");
    spec.datacenter = "dc1";
    return driver.open_replica(spec);
  }
  void finish_far(const std::vector<ClientId>& far) {
    driver.finish_reads(far);
    EXPECT_TRUE(is<UpdateOk>(driver.replies(far)));
  }
  // The trainer unpublishes the version it held and publishes the next.
  void publish(Version version) {
    driver.call_all(t, UnpublishRequest{});
    EXPECT_TRUE(is<UnpublishOk>(driver.replies(t)));
    driver.publish(t, version);
  }
  Driver driver;
  std::vector<ClientId> t;
  std::map<std::string, std::vector<ClientId>> rollouts;
};

TEST(HubRates, ASlowMemberGoesToTheEndOfTheChainTheNextVersion) {
  Fleet fleet;
  fleet.first_version(/*slow_shard_ms=*/1000);  // r0's shard 1 at a hundredth of shard 0's rate
  Driver& driver = fleet.driver;
  fleet.second_version({"r0", "r1", "r2"});
  // r0 came first and took the trainer; r1 and r2 kept r0's pace last time, so each may be
  // faster: each takes r0's source in turn, and r0 reads behind them.
  EXPECT_EQ(fleet.sources({"r1", "r2", "r0"}), "r1<-t r2<-r1 r0<-r2");
  EXPECT_EQ(driver.hub().stats().transfers_displaced, 2u);
  // r0's shards read again (a new epoch) and every read completes.
  for (const char* name : {"r1", "r2", "r0"}) {
    driver.finish_reads(fleet.rollouts[name]);
    EXPECT_TRUE(is<UpdateOk>(driver.replies(fleet.rollouts[name]))) << name;
  }
}

TEST(HubRates, WithoutRateAwarenessTheChainKeepsItsArrivalOrder) {
  HubSettings settings;
  settings.rate_aware_sources = false;
  Fleet fleet(settings);
  fleet.first_version(/*slow_shard_ms=*/1000);
  fleet.second_version({"r0", "r1", "r2"});
  EXPECT_EQ(fleet.sources({"r0", "r1", "r2"}), "r0<-t r1<-r0 r2<-r1");
  EXPECT_EQ(fleet.driver.hub().stats().transfers_displaced, 0u);
}

// The chain's readers finish `ms` after the last step, in chain order, each a millisecond after its
// source (the order given), and every update completes.
void finish_chain(Fleet& fleet, std::initializer_list<const char*> chain, TimeMs ms) {
  fleet.driver.advance(ms);
  for (const char* name : chain) {
    fleet.driver.finish_reads(fleet.rollouts[name]);
    EXPECT_TRUE(is<UpdateOk>(fleet.driver.replies(fleet.rollouts[name]))) << name;
    fleet.driver.advance(1);
  }
}

TEST(HubRates, AFleetThatIsAlikeIsReorderedOnceThenKeepsItsOrder) {
  Fleet fleet;
  // Both shards at the same pace: r0 is measured exactly, r1 and r2 kept its pace. Nothing says
  // whether r0 held them up: they go ahead of it once, to be measured themselves.
  fleet.first_version(/*slow_shard_ms=*/12);
  fleet.second_version({"r0", "r1", "r2"});
  EXPECT_EQ(fleet.sources({"r1", "r2", "r0"}), "r1<-t r2<-r1 r0<-r2");
  EXPECT_EQ(fleet.driver.hub().stats().transfers_displaced, 2u);
  finish_chain(fleet, {"r1", "r2", "r0"}, 12);  // r1 reads the trainer alone, as fast as r0 did
  // Two exact rates alike: from here the chains keep the order the readers come in.
  for (Version version : {3, 4}) {
    fleet.publish(version);
    for (const char* name : {"r0", "r1", "r2"}) start_update(fleet.driver, fleet.rollouts[name]);
    EXPECT_EQ(fleet.sources({"r0", "r1", "r2"}), "r0<-t r1<-r0 r2<-r1") << "version " << version;
    finish_chain(fleet, {"r0", "r1", "r2"}, 12);
  }
  EXPECT_EQ(fleet.driver.hub().stats().transfers_displaced, 2u);
  EXPECT_EQ(fleet.driver.hub().stats().slow_sources_passed, 0u);
}

// At fan-out 2 readers share the trainer, and none of them is measured exactly: the only exact
// rate stays the first version's. It is explored in the second version at most, not again.
TEST(HubRates, AFleetThatIsAlikeIsReorderedOnceAtFanOutTwo) {
  Fleet fleet(with_fanout(2));
  Driver& driver = fleet.driver;
  driver.publish(fleet.t, 1);
  for (const char* name : {"r0", "r1", "r2"}) start_update(driver, fleet.rollouts[name]);
  ASSERT_EQ(fleet.sources({"r0", "r1", "r2"}), "r0<-t r1<-r0 r2<-r1") << "each the least loaded copy";
  finish_chain(fleet, {"r0", "r1", "r2"}, 12);  // r0 reads the trainer alone: exact; r1, r2 lower bounds
  std::uint64_t displaced_in_two = 0;
  for (Version version : {2, 3, 4}) {
    fleet.publish(version);
    for (const char* name : {"r1", "r0", "r2"}) start_update(driver, fleet.rollouts[name]);
    if (version == 2) displaced_in_two = driver.hub().stats().transfers_displaced;
    driver.advance(12);
    for (int round = 0; round < 3; ++round) {  // chains of up to three
      for (const char* name : {"r0", "r1", "r2"}) driver.finish_reads(fleet.rollouts[name]);
      driver.advance(1);
    }
    for (const char* name : {"r0", "r1", "r2"}) {
      EXPECT_TRUE(is<UpdateOk>(driver.replies(fleet.rollouts[name]))) << name << ", version " << version;
    }
  }
  EXPECT_EQ(driver.hub().stats().transfers_displaced, displaced_in_two) << "versions 3 and 4 keep their order";
}

// bench/run-change "slow": the slow member asks first and is the root of the first version's
// chain; every read the hub times goes at its pace. The next version finds it out.
TEST(HubRates, ASlowMemberAtTheRootOfTheOnlyChainIsFoundOutTheNextVersion) {
  Fleet fleet;
  Driver& driver = fleet.driver;
  driver.publish(fleet.t, 1);
  for (const char* name : {"r0", "r1"}) start_update(driver, fleet.rollouts[name]);  // r2 reads nothing
  EXPECT_EQ(fleet.sources({"r0", "r1"}), "r0<-t r1<-r0");
  finish_chain(fleet, {"r0", "r1"}, 1000);
  // r2, never measured, joins where it would have; r1 goes ahead of r0 to be measured.
  fleet.second_version({"r0", "r2", "r1"});
  EXPECT_EQ(fleet.sources({"r1", "r0", "r2"}), "r1<-t r0<-r1 r2<-r0");
  EXPECT_EQ(driver.hub().stats().transfers_displaced, 1u);
  finish_chain(fleet, {"r1"}, 10);
  finish_chain(fleet, {"r0", "r2"}, 989);
  // Known slow now: it goes to the end of the chain whenever it comes first.
  fleet.publish(3);
  for (const char* name : {"r0", "r1", "r2"}) start_update(driver, fleet.rollouts[name]);
  EXPECT_EQ(fleet.sources({"r1", "r2", "r0"}), "r1<-t r2<-r1 r0<-r2");
  EXPECT_EQ(driver.hub().stats().transfers_displaced, 3u);
}

TEST(HubRates, ASlowCopyLateInItsReadKeepsItsSource) {
  Fleet fleet;
  fleet.first_version(/*slow_shard_ms=*/1000);
  Driver& driver = fleet.driver;
  // r0's read takes about 1000 ms at its rate: 200 ms in, past its first eighth, reading again
  // would cost more than it saves the readers behind it.
  fleet.r1_after_r0_late();
  EXPECT_EQ(source_of(driver, fleet.rollouts["r0"]), "t");
  EXPECT_EQ(source_of(driver, fleet.rollouts["r1"]), "r0");
  EXPECT_EQ(driver.hub().stats().transfers_displaced, 0u);
}

// r0 reads version 1 from the trainer alone, its slower shard in 1000 ms; then r1 reads it from
// the trainer alone, its slower shard in `r1_ms`: both are measured exactly, and the trainer is
// known to serve a replica at r1's pace. r2 reads nothing (it is never measured).
void two_reads_alone(Fleet& fleet, TimeMs r1_ms) {
  Driver& driver = fleet.driver;
  driver.publish(fleet.t, 1);
  start_update(driver, fleet.rollouts["r0"]);
  driver.advance(10);
  finish_shard(driver, fleet.rollouts["r0"][0]);
  driver.advance(990);
  finish_shard(driver, fleet.rollouts["r0"][1]);
  EXPECT_TRUE(is<UpdateOk>(driver.replies(fleet.rollouts["r0"])));
  start_update(driver, fleet.rollouts["r1"]);
  EXPECT_EQ(source_of(driver, fleet.rollouts["r1"]), "t");
  driver.advance(r1_ms);
  driver.finish_reads(fleet.rollouts["r1"]);
  EXPECT_TRUE(is<UpdateOk>(driver.replies(fleet.rollouts["r1"])));
}

TEST(HubRates, AFastReaderPassesOverAMuchSlowerCopyForOneThatCanServeIt) {
  Fleet fleet(with_fanout(2));
  two_reads_alone(fleet, /*r1_ms=*/10);
  Driver& driver = fleet.driver;
  fleet.r1_after_r0_late();
  // The least loaded copy is r0 (no reader yet), but it receives at a hundredth of r1's rate,
  // and the trainer served r1 at that rate: r1 shares the trainer instead.
  EXPECT_EQ(source_of(driver, fleet.rollouts["r1"]), "t");
  EXPECT_EQ(source_of(driver, fleet.rollouts["r0"]), "t");
  EXPECT_EQ(driver.hub().stats().slow_sources_passed, 1u);
  EXPECT_EQ(driver.hub().stats().transfers_displaced, 0u);
}

TEST(HubRates, ACopyAsFastAsEveryReadOfTheFleetIsNotPassedOver) {
  Fleet fleet(with_fanout(2));
  // Every reader went at r0's pace, r0 alone at the trainer: r0's NIC or the trainer's was slow,
  // the hub cannot tell which. (That shard 0 took a hundredth of shard 1's time says nothing of a
  // replica's rate, which is its slowest shard's: with NICs of unequal speed nearly every replica
  // has a shard far slower than the fastest shard anywhere.)
  fleet.first_version(/*slow_shard_ms=*/1000);
  Driver& driver = fleet.driver;
  fleet.r1_after_r0_late();
  // Sharing the trainer would halve both reads if the trainer set the pace (th-plan --nic-jitter
  // 0.99 --fanout 2 --seed 5: 128.6 -> 237.4 GPU-s per version when it did): r1 reads behind r0.
  EXPECT_EQ(source_of(driver, fleet.rollouts["r1"]), "r0");
  EXPECT_EQ(driver.hub().stats().slow_sources_passed, 0u);
}

TEST(HubRates, AReaderGoesAheadOfACopyWhoseSlowShardTheSourceServesFasterToOthers) {
  Fleet fleet;  // fan-out 1
  Driver& driver = fleet.driver;
  // Version 1: t -> r0 -> r1, r0's shard 1 slow (r1 kept its pace: a lower bound); then r2 reads
  // the trainer alone, its shard 0 slow. Both timed alone: r0 and r2 receive alike, each at a
  // hundredth of the trainer's pace on the other's slow shard.
  driver.publish(fleet.t, 1);
  start_update(driver, fleet.rollouts["r0"]);
  start_update(driver, fleet.rollouts["r1"]);
  EXPECT_EQ(source_of(driver, fleet.rollouts["r1"]), "r0");
  driver.advance(10);
  for (const char* name : {"r0", "r1"}) finish_shard(driver, fleet.rollouts[name][0]);
  driver.advance(990);
  for (const char* name : {"r0", "r1"}) {
    finish_shard(driver, fleet.rollouts[name][1]);
    EXPECT_TRUE(is<UpdateOk>(driver.replies(fleet.rollouts[name]))) << name;
  }
  start_update(driver, fleet.rollouts["r2"]);
  EXPECT_EQ(source_of(driver, fleet.rollouts["r2"]), "t");
  driver.advance(10);
  finish_shard(driver, fleet.rollouts["r2"][1]);
  driver.advance(990);
  finish_shard(driver, fleet.rollouts["r2"][0]);
  EXPECT_TRUE(is<UpdateOk>(driver.replies(fleet.rollouts["r2"])));
  // Version 2: r0 comes first. No replica read faster than r0, but the trainer served each shard
  // a hundred times faster than r0's slowest: r0's pace is its own, and r1 goes ahead of it to be
  // timed (a reorder costs little if wrong: r0 reads again what it read in its first moments).
  fleet.publish(2);
  start_update(driver, fleet.rollouts["r0"]);
  start_update(driver, fleet.rollouts["r1"]);
  EXPECT_EQ(fleet.sources({"r1", "r0"}), "r1<-t r0<-r1");
  EXPECT_EQ(driver.hub().stats().transfers_displaced, 1u);
}

TEST(HubRates, AFastReplicaOfAnotherDatacenterMakesNoCopyHereLookSlow) {
  Fleet fleet(with_fanout(2));
  Driver& driver = fleet.driver;
  const std::vector<ClientId> far = fleet.open_far("far");
  const std::vector<ClientId> far2 = fleet.open_far("far2");
  fleet.first_version(/*slow_shard_ms=*/1000);  // every reader here at r0's pace
  // far seeds dc1 (across datacenters: not timed); far2 then reads far, complete, alone, in 10 ms:
  // a hundred times r0's rate, but from another source than any here.
  start_update(driver, far);
  fleet.finish_far(far);
  start_update(driver, far2);
  EXPECT_EQ(source_of(driver, far2), "far");
  driver.advance(10);
  fleet.finish_far(far2);
  fleet.r1_after_r0_late();
  // Nothing here read faster than r0: r1 reads behind it rather than share the trainer (th-plan
  // with 2 remote rollouts and 2 joining, 6 rollouts, --fanout 2 --nic-jitter 0.99 --seed 15:
  // 107 -> 210 GPU-s per version when a remote replica's rate made r0 look slow).
  EXPECT_EQ(source_of(driver, fleet.rollouts["r1"]), "r0");
  EXPECT_EQ(driver.hub().stats().slow_sources_passed, 0u);
}

TEST(HubRates, AReaderWhoseSourceAlsoFedASeedAcrossIsNotTakenForSlow) {
  Fleet fleet;
  Driver& driver = fleet.driver;
  const std::vector<ClientId> far = fleet.open_far("far");
  // Version 1: r0 reads the trainer alone; far seeds dc1 from r0 and r1 reads behind r0, both
  // sharing r0's upload, so r1 takes twice r0's time though it could keep r0's pace.
  driver.publish(fleet.t, 1);
  start_update(driver, fleet.rollouts["r0"]);
  start_update(driver, far);
  start_update(driver, fleet.rollouts["r1"]);
  EXPECT_EQ(fleet.sources({"r0", "r1"}), "r0<-t r1<-r0");
  EXPECT_EQ(source_of(driver, far), "r0");
  finish_chain(fleet, {"r0"}, 100);
  driver.advance(99);
  fleet.finish_far(far);
  finish_chain(fleet, {"r1"}, 0);
  // Version 2: r1 asks first. Its read went at half r0's rate, behind a source that received
  // faster, but that source served far as well: nothing says r1 set the pace, and r0 reads
  // behind it rather than take its source (a rollout known slow goes to the end of the chain).
  fleet.publish(2);
  start_update(driver, fleet.rollouts["r1"]);
  start_update(driver, fleet.rollouts["r0"]);
  EXPECT_EQ(fleet.sources({"r1", "r0"}), "r1<-t r0<-r1");
  EXPECT_EQ(driver.hub().stats().transfers_displaced, 0u);
}

TEST(HubRates, ASlowReaderBehindASourceThatFeedsASeedIsStillFoundOut) {
  Fleet fleet;
  Driver& driver = fleet.driver;
  const std::vector<ClientId> far = fleet.open_far("far");
  // Version 1: r0 and r2 read the trainer alone, 100 ms each: two exact rates.
  driver.publish(fleet.t, 1);
  for (const char* name : {"r0", "r2"}) {
    start_update(driver, fleet.rollouts[name]);
    finish_chain(fleet, {name}, 100);
  }
  // Versions 2 and 3 ask alike: r0, far (which seeds dc1), r1, r2.
  const auto ask = [&](Version version) {
    fleet.publish(version);
    start_update(driver, fleet.rollouts["r0"]);
    start_update(driver, far);
    start_update(driver, fleet.rollouts["r1"]);
    start_update(driver, fleet.rollouts["r2"]);
  };
  // Version 2: far seeds from r0, r1 reads behind r0 and r2 behind r1. r1 takes 1000 ms: a tenth
  // of r0's rate, five times under its half share of r0.
  ask(2);
  EXPECT_EQ(fleet.sources({"r0", "r1", "r2"}), "r0<-t r1<-r0 r2<-r1");
  EXPECT_EQ(source_of(driver, far), "r0");
  finish_chain(fleet, {"r0"}, 100);
  fleet.finish_far(far);
  finish_chain(fleet, {"r1", "r2"}, 899);
  // Version 3: r1 was slower than any share of r0 explains: it is known slow, and r2 takes its
  // source.
  ask(3);
  EXPECT_EQ(fleet.sources({"r0", "r2", "r1"}), "r0<-t r2<-r0 r1<-r2");
  EXPECT_EQ(driver.hub().stats().transfers_displaced, 1u);
}

// Version 2 after two_reads_alone: r0 and r1 update, in that order.
void two_exact_rates(Fleet& fleet, TimeMs r1_ms) {
  two_reads_alone(fleet, r1_ms);
  fleet.publish(2);
  start_update(fleet.driver, fleet.rollouts["r0"]);
  start_update(fleet.driver, fleet.rollouts["r1"]);
}

TEST(HubRates, OfTwoReplicasMeasuredExactlyTheFasterGoesAheadByAQuarterOrMore) {
  Fleet ahead;
  two_exact_rates(ahead, /*r1_ms=*/600);  // 1.67 x r0's rate
  EXPECT_EQ(source_of(ahead.driver, ahead.rollouts["r1"]), "t");
  EXPECT_EQ(source_of(ahead.driver, ahead.rollouts["r0"]), "r1");
  EXPECT_EQ(ahead.driver.hub().stats().transfers_displaced, 1u);
  Fleet alike;
  two_exact_rates(alike, /*r1_ms=*/900);  // 1.11 x: not worth r0's reading again
  EXPECT_EQ(source_of(alike.driver, alike.rollouts["r0"]), "t");
  EXPECT_EQ(source_of(alike.driver, alike.rollouts["r1"]), "r0");
  EXPECT_EQ(alike.driver.hub().stats().transfers_displaced, 0u);
}

TEST(HubRates, ACopyBehindAMuchSlowerOneIsPassedOverToo) {
  Fleet fleet(with_fanout(2));
  Driver& driver = fleet.driver;
  two_reads_alone(fleet, /*r1_ms=*/10);  // r0 at a hundredth of r1's rate; r2 never measured
  fleet.publish(2);
  start_update(driver, fleet.rollouts["r0"]);
  driver.advance(200);  // too late for r0 to give its source away
  start_update(driver, fleet.rollouts["r2"]);
  EXPECT_EQ(source_of(driver, fleet.rollouts["r2"]), "r0") << "r2 is not known to be faster than r0";
  start_update(driver, fleet.rollouts["r1"]);
  // r2 is the least loaded copy and is not known slow, but its bytes come through r0.
  EXPECT_EQ(source_of(driver, fleet.rollouts["r1"]), "t");
  EXPECT_EQ(driver.hub().stats().slow_sources_passed, 1u);
}

TEST(HubRates, OnlyAReadThatSetItsOwnPaceMakesAReplicaKnownSlow) {
  Fleet fleet;
  fleet.first_version(/*slow_shard_ms=*/1000);
  Driver& driver = fleet.driver;
  // Version 2 in the order the rates give: r1, r2, then r0 (see the first test). r1 reads the
  // trainer alone at the fast pace; r2 keeps r1's pace (a lower bound only); r0 is slow again.
  fleet.publish(2);
  for (const char* name : {"r0", "r1", "r2"}) start_update(driver, fleet.rollouts[name]);
  driver.advance(10);
  for (const char* name : {"r1", "r2"}) {
    driver.finish_reads(fleet.rollouts[name]);
    EXPECT_TRUE(is<UpdateOk>(driver.replies(fleet.rollouts[name]))) << name;
  }
  driver.advance(990);
  driver.finish_reads(fleet.rollouts["r0"]);
  EXPECT_TRUE(is<UpdateOk>(driver.replies(fleet.rollouts["r0"])));
  // Version 3, r2 first: it is not known slow (it only kept pace), so r1 reads behind it, and r0
  // (known slow) goes behind r1 without displacing anyone known fast.
  fleet.publish(3);
  for (const char* name : {"r2", "r1", "r0"}) start_update(driver, fleet.rollouts[name]);
  EXPECT_EQ(source_of(driver, fleet.rollouts["r2"]), "t");
  EXPECT_EQ(source_of(driver, fleet.rollouts["r1"]), "r2");
  EXPECT_EQ(source_of(driver, fleet.rollouts["r0"]), "r1");
  EXPECT_EQ(driver.hub().stats().transfers_displaced, 2u) << "only version 2's";
}

TEST(HubRates, AReaderThatFailedItsOwnReaderTakesNoSlowCopysPlace) {
  Fleet fleet;
  fleet.first_version(/*slow_shard_ms=*/1000);  // r0 known slow; r1 and r2 kept its pace
  Driver& driver = fleet.driver;
  fleet.publish(2);
  for (const char* name : {"r2", "r1", "r0"}) start_update(driver, fleet.rollouts[name]);
  ASSERT_EQ(fleet.sources({"r2", "r1", "r0"}), "r2<-t r1<-r2 r0<-r1");
  // r0 cannot reach r1: r1 is a copy its reader failed, and r0 waits for another source. It gets
  // the trainer when r2 has read all of it.
  const auto [transfer, read] = *driver.inbox(fleet.rollouts["r0"][0]).reads.rbegin();
  driver.report(fleet.rollouts["r0"][0], TransferFailed{transfer, read.epoch, ReadFailure::kSourceUnreachable});
  driver.finish_reads(fleet.rollouts["r2"]);
  ASSERT_TRUE(is<UpdateOk>(driver.replies(fleet.rollouts["r2"])));
  ASSERT_EQ(fleet.sources({"r0"}), "r0<-t");
  // r1's source dies, and r1 looks again: r0, early in its read, is the only copy that can serve.
  // r1 may well be faster than r0, but a copy that its own reader could not reach is no one's
  // source: r1 reads behind r0.
  for (ClientId client : fleet.rollouts["r2"]) driver.lose_connection(client);
  EXPECT_EQ(fleet.sources({"r0", "r1"}), "r0<-t r1<-r0");
  EXPECT_EQ(driver.hub().stats().transfers_displaced, 0u);
  for (const char* name : {"r0", "r1"}) {
    driver.finish_reads(fleet.rollouts[name]);
    EXPECT_TRUE(is<UpdateOk>(driver.replies(fleet.rollouts[name]))) << name;
  }
}

// Delta versions (core/hub_patches.cpp): a reader that can read the patch waits for a holder whose
// slot a patch read holds, as that is short; but not for one held by a patch reader known to go at
// under half its rate (an attack's find: a slow rollout held a fast one up for its whole patch
// read, where the bytes took milliseconds). The fast reader goes ahead of the slow one and reads
// the patch from the trainer; the slow one reads the bytes behind it.
TEST(HubRates, AFastReaderDoesNotWaitForASlowPatchReader) {
  Fleet fleet;
  two_reads_alone(fleet, /*r1_ms=*/10);  // r0 at a hundredth of r1's rate
  Driver& driver = fleet.driver;
  driver.call_all(fleet.t, UnpublishRequest{});
  EXPECT_TRUE(is<UnpublishOk>(driver.replies(fleet.t)));
  for (std::uint32_t shard = 0; shard < fleet.t.size(); ++shard) {
    PatchInfo patch{1, {}};
    const LayoutRef layout = layout_for(shard);
    for (const TensorSpec& tensor : layout->tensors()) patch.tensor_bytes.push_back(tensor.bytes / 20);
    driver.call(fleet.t[shard], PublishRequest{2, layout_for(shard), checksums_for(2, shard),
                                               std::make_shared<const PatchInfo>(std::move(patch))});
  }
  EXPECT_TRUE(is<PublishOk>(driver.replies(fleet.t)));
  // The patch of each reader's newest read (false: none, or no read).
  auto reads_patch = [&](const char* name) {
    const auto& reads = driver.inbox(fleet.rollouts[name][0]).reads;
    return !reads.empty() && reads.rbegin()->second.patch != nullptr;
  };
  start_update(driver, fleet.rollouts["r0"]);
  EXPECT_EQ(fleet.sources({"r0"}), "r0<-t");
  EXPECT_TRUE(reads_patch("r0")) << "r0 holds version 1 whole: it reads the patch";
  driver.advance(1);
  start_update(driver, fleet.rollouts["r1"]);
  EXPECT_EQ(fleet.sources({"r1", "r0"}), "r1<-t r0<-r1") << "r1 did not wait for r0's slow patch read";
  EXPECT_TRUE(reads_patch("r1")) << "r1 reads the patch";
  EXPECT_FALSE(reads_patch("r0")) << "r0 reads the bytes behind r1, which does not have the patch yet";
  for (const char* name : {"r1", "r0"}) {
    driver.finish_reads(fleet.rollouts[name]);
    EXPECT_TRUE(is<UpdateOk>(driver.replies(fleet.rollouts[name]))) << name;
  }
}

}  // namespace
}  // namespace th::test
