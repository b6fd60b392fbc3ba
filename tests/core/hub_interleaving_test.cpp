// Deterministic interleaving tests (paper §4.6): one process issues the requests of many clients and
// runs every order of their steps that keeps each client's own order. A client may halt: it stops
// sending anything, heartbeats included, and a dead source completes no read. After the steps, time
// passes and outstanding reads complete until nothing moves. Every step runs Hub::check_invariants
// and the Observer (integrity, retention, consistency, load, topology, monotonicity); each scenario
// states what must hold at the end, and that every order was explored.
#include <gtest/gtest.h>

#include <functional>

#include "tests/core/testkit/driver.h"

namespace th::test {
namespace {

constexpr std::uint32_t kShards = 2;  // every replica of the model has two shards

// One run of one interleaving.
struct Interleaving {
  Driver driver;
  std::set<std::string> halted;  // replicas that stopped
  std::map<std::string, std::vector<ClientId>> shards;

  explicit Interleaving(HubSettings settings) : driver(settings) {}

  std::vector<ClientId> open(const std::string& name, std::string role = "rollout",
                             Retention retention = {}) {
    ReplicaSpec spec;
    spec.name = name;
    spec.num_shards = kShards;
    spec.role = std::move(role);
    spec.retention = std::move(retention);
    return shards[name] = driver.open_replica(spec);
  }

  std::set<ClientId> silent() const {
    std::set<ClientId> clients;
    for (const std::string& name : halted) {
      for (ClientId client : shards.at(name)) clients.insert(client);
    }
    return clients;
  }

  // Completes the client's reads, except those from a halted source (a dead process serves nothing).
  bool finish_reads(ClientId client) {
    bool progress = false;
    auto& reads = driver.inbox(client).reads;
    for (auto it = reads.begin(); it != reads.end();) {
      if (halted.contains(it->second.source.replica) || silent().contains(client)) {
        ++it;
        continue;
      }
      const StartRead read = it->second;
      it = reads.erase(it);
      driver.report(client, TransferDone{read.transfer, read.epoch});
      progress = true;
    }
    return progress;
  }

  // Time passes (halted clients are evicted) and reads complete, until nothing moves.
  void settle() {
    for (int round = 0; round < 100; ++round) {
      bool progress = false;
      for (const auto& [name, clients] : shards) {
        for (ClientId client : clients) progress = finish_reads(client) || progress;
      }
      driver.advance(500, silent());
      if (!progress && round > 40) return;
    }
  }
};

using Step = std::function<void(Interleaving&)>;
using Script = std::vector<Step>;

// Calls `body` with every interleaving of the scripts; returns how many there were.
std::size_t for_each_interleaving(const std::vector<Script>& scripts,
                                  const std::function<void(const std::vector<Step>&)>& body) {
  std::vector<std::size_t> next(scripts.size(), 0);
  std::vector<Step> order;
  std::size_t total_steps = 0;
  for (const Script& script : scripts) total_steps += script.size();
  std::size_t runs = 0;
  std::function<void()> extend = [&] {
    if (order.size() == total_steps) {
      body(order);
      ++runs;
      return;
    }
    for (std::size_t i = 0; i < scripts.size(); ++i) {
      if (next[i] == scripts[i].size()) continue;
      order.push_back(scripts[i][next[i]++]);
      extend();
      --next[i];
      order.pop_back();
    }
  };
  extend();
  return runs;
}

Step call(std::string replica, std::uint32_t shard, RequestBody body) {
  return [=](Interleaving& run) { run.driver.call(run.shards.at(replica)[shard], body); };
}
Step publish(std::string replica, std::uint32_t shard, Version version) {
  return call(std::move(replica), shard,
              PublishRequest{version, layout_for(shard), checksums_for(version, shard)});
}
Step update(std::string replica, std::uint32_t shard) {
  return call(std::move(replica), shard, UpdateRequest{Selector::latest(), layout_for(shard)});
}
Step replicate(std::string replica, std::uint32_t shard, Selector selector) {
  return call(std::move(replica), shard, ReplicateRequest{selector, layout_for(shard), 0});
}
Step unpublish(std::string replica, std::uint32_t shard) {
  return call(std::move(replica), shard, UnpublishRequest{});
}
Step finish(std::string replica, std::uint32_t shard) {
  return [=](Interleaving& run) { run.finish_reads(run.shards.at(replica)[shard]); };
}
Step halt(std::string replica) {
  return [=](Interleaving& run) { run.halted.insert(replica); };
}

// The answer every shard of `replica` got, which must be one and the same.
std::optional<Outcome> answer(Interleaving& run, const std::string& replica) {
  return run.driver.replies(run.shards.at(replica));
}

// Paper Figure 6: the two shards of rollout r call update(latest) while trainer u publishes
// version 2 around their requests. Both shards must get the same version whatever the order.
TEST(HubInterleaving, ShardsAgreeWhileANewVersionAppears) {
  std::set<Version> seen;
  const std::vector<Script> scripts = {
      {publish("u", 0, 2)},
      {publish("u", 1, 2)},
      {update("r", 0), finish("r", 0)},
      {update("r", 1), finish("r", 1)},
  };
  const std::size_t runs = for_each_interleaving(scripts, [&](const std::vector<Step>& order) {
    Interleaving run{HubSettings{}};
    run.driver.publish(run.open("t", "trainer"), 1);
    run.open("u", "trainer");
    run.open("r");
    for (const Step& step : order) step(run);
    run.settle();
    const auto outcome = answer(run, "r");
    ASSERT_TRUE(is<UpdateOk>(outcome)) << (outcome ? describe(*outcome) : "no answer");
    EXPECT_EQ(std::get<UpdateOk>(*outcome).status, UpdateStatus::kUpdated);
    seen.insert(std::get<UpdateOk>(*outcome).version.value());
    EXPECT_TRUE(is<PublishOk>(answer(run, "u")));
  });
  EXPECT_EQ(runs, 180u);  // 6! / (2! 2!)
  EXPECT_EQ(seen, (std::set<Version>{1, 2})) << "both outcomes are reachable";
}

// An unpublish races a replicate. Whatever the order, the reader never reads a buffer after the
// unpublish returned (the Observer checks grants), and both sides get an answer.
TEST(HubInterleaving, UnpublishRacesReplicate) {
  std::map<std::string, std::size_t> seen;
  const std::vector<Script> scripts = {
      {unpublish("t", 0)},
      {unpublish("t", 1)},
      {replicate("r", 0, Selector::absolute(1)), finish("r", 0)},
      {replicate("r", 1, Selector::absolute(1)), finish("r", 1)},
  };
  const std::size_t runs = for_each_interleaving(scripts, [&](const std::vector<Step>& order) {
    Interleaving run{HubSettings{}};
    run.driver.publish(run.open("t", "trainer"), 1);
    run.open("r");
    for (const Step& step : order) step(run);
    run.settle();
    EXPECT_TRUE(is<UnpublishOk>(answer(run, "t")));
    const auto outcome = answer(run, "r");
    ASSERT_TRUE(outcome);
    if (is_error(*outcome, Errc::kVersionUnavailable)) {
      ++seen["unavailable"];
    } else {
      ASSERT_TRUE(std::holds_alternative<ReplicateOk>(*outcome)) << describe(*outcome);
      ++seen["replicated"];
    }
  });
  EXPECT_EQ(runs, 180u);
  EXPECT_EQ(seen.size(), 2u) << "the reader both wins and loses the race in some orders";
}

// A reader shard halts right after its call. The hub evicts the reader; the trainer's unpublish,
// which waited for that reader, completes; the other reader shard is told its replica is gone.
TEST(HubInterleaving, HaltedReaderReleasesItsSource) {
  const std::vector<Script> scripts = {
      {unpublish("t", 0)},
      {unpublish("t", 1)},
      {replicate("r", 0, Selector::latest()), halt("r")},
      {replicate("r", 1, Selector::latest())},
  };
  const std::size_t runs = for_each_interleaving(scripts, [&](const std::vector<Step>& order) {
    Interleaving run{HubSettings{}};
    run.driver.publish(run.open("t", "trainer"), 1);
    run.open("r");
    for (const Step& step : order) step(run);
    run.settle();
    EXPECT_TRUE(is<UnpublishOk>(answer(run, "t")));
    EXPECT_EQ(run.driver.hub().client_count(), kShards) << "only the trainer is left";
    EXPECT_FALSE(run.driver.inbox(run.shards.at("r")[1]).evictions.empty());
  });
  EXPECT_EQ(runs, 60u);  // 5! / 2!
}

// The trainer halts while rollouts replicate from it, with a retention rule on the version. When the
// transfer could not finish first, the readers get "version unavailable" — never a hang — and a
// reader that did finish keeps the version available for the next one.
TEST(HubInterleaving, HaltedLastHolderMakesTheVersionUnavailableNotAHang) {
  std::map<std::string, std::size_t> seen;
  const std::vector<Script> scripts = {
      {halt("t")},
      {replicate("r", 0, Selector::latest()), finish("r", 0)},
      {replicate("r", 1, Selector::latest()), finish("r", 1)},
  };
  const std::size_t runs = for_each_interleaving(scripts, [&](const std::vector<Step>& order) {
    Interleaving run{HubSettings{}};
    Retention keep;
    keep.keep_latest = 0;
    run.driver.publish(run.open("t", "trainer", keep), 1);
    run.open("r");
    for (const Step& step : order) step(run);
    run.settle();
    const auto outcome = answer(run, "r");
    ASSERT_TRUE(outcome) << "the reader must get an answer";
    if (std::holds_alternative<ReplicateOk>(*outcome)) {
      ++seen["replicated"];
      // r holds version 1 now: a newcomer reads it from r.
      run.open("late");
      run.driver.call(run.shards.at("late")[0], ReplicateRequest{Selector::latest(), layout_for(0), 0});
      run.driver.call(run.shards.at("late")[1], ReplicateRequest{Selector::latest(), layout_for(1), 0});
      run.settle();
      EXPECT_TRUE(is<ReplicateOk>(answer(run, "late")));
    } else {
      EXPECT_TRUE(is_error(*outcome, Errc::kVersionUnavailable)) << describe(*outcome);
      ++seen["unavailable"];
    }
  });
  EXPECT_EQ(runs, 30u);  // 5! / (2! 2!)
  EXPECT_EQ(seen.size(), 2u);
}

}  // namespace
}  // namespace th::test
