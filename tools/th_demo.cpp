// th-demo: the reference server's decisions, step by step, on an in-process fleet.
//
// One trainer replica and several rollout replicas (2 shards each; the last rollout lives in another
// datacenter) run the RL loop of paper Figure 4: the trainer publishes a version, every rollout
// calls update(latest), the trainer unpublishes (offloading if its copy is the last of a retained
// version) and trains the next one. The data plane is simulated: a read finishes when the demo says
// so. One rollout crashes in the middle of a transfer, so its pipeline reader is moved to another
// source. Every step checks the hub's invariants; the demo exits non-zero if any rollout that is
// alive does not end on the latest version.
//
// Until th-server exists (issue 4), this is the project's main job.
#include <CLI/CLI.hpp>

#include <cstdio>
#include <functional>
#include <iostream>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "core/hub.h"

namespace th {
namespace {

constexpr std::uint32_t kShards = 2;
constexpr TimeMs kHeartbeatTimeoutMs = 3000;

struct DemoOptions {
  int steps = 4;
  int rollouts = 4;
  bool pipeline = true;
  int crash_step = 2;
};

struct Shard {
  ClientId client = 0;
  std::uint64_t seq = 0;
};

struct Member {
  std::string name;
  std::string datacenter;
  std::vector<Shard> shards;
  bool alive = true;
  std::optional<Version> held;
  // Per step, for the table.
  std::string source;
  bool partial = false;
  std::uint32_t epoch = 0;
  std::string outcome;
  std::string notes;
};

class Demo {
 public:
  explicit Demo(const DemoOptions& options) : options_(options), hub_(settings(options)) {}

  int run() {
    open("trainer", "dc-a", true);
    for (int i = 1; i <= options_.rollouts; ++i) {
      open("rollout-" + std::to_string(i), i == options_.rollouts ? "dc-b" : "dc-a", false);
    }
    std::printf("%-5s %-10s %-5s %-8s %-11s %-8s %-5s %s\n", "step", "replica", "dc", "holds",
                "read from", "source", "epoch", "what happened");
    for (int step = 1; step <= options_.steps; ++step) run_step(step);
    return verdict();
  }

 private:
  static HubSettings settings(const DemoOptions& options) {
    HubSettings settings;
    settings.pipeline = options.pipeline;
    settings.fanout_max = options.pipeline ? 1 : 4;
    settings.heartbeat_timeout_ms = kHeartbeatTimeoutMs;
    return settings;
  }

  void open(const std::string& name, const std::string& datacenter, bool trainer) {
    const std::size_t index = members_.size();
    members_.push_back(Member{name, datacenter, {}, true, {}, {}, false, 0, {}, {}});
    for (std::uint32_t shard = 0; shard < kShards; ++shard) {
      const ClientId client = next_client_++;
      owner_[client] = index;
      members_[index].shards.push_back({client, 0});
      OpenRequest open;
      open.model = "policy";
      open.replica = name;
      open.incarnation = 1;
      open.shard = shard;
      open.num_shards = kShards;
      open.datacenter = datacenter;
      open.role = trainer ? "trainer" : "rollout";
      if (trainer) open.retention.keep_latest = 1;
      open.data_endpoint = "tcp://" + name + ":" + std::to_string(7000 + shard);
      step(Request{client, 0, open});
    }
  }

  Member& trainer() { return members_[0]; }

  void call(Member& member, const std::function<RequestBody(std::uint32_t)>& body) {
    for (std::uint32_t shard = 0; shard < kShards; ++shard) {
      Shard& s = member.shards[shard];
      step(Request{s.client, ++s.seq, body(shard)});
    }
  }

  static LayoutRef layout(std::uint32_t shard) {
    return ShardLayout::make({{"layers." + std::to_string(shard) + ".weight", DType::kBFloat16, 64 << 20},
                              {"layers." + std::to_string(shard) + ".norm", DType::kFloat32, 16384}})
        .value();
  }
  static ChecksumsRef checksums(Version version, std::uint32_t shard) {
    return std::make_shared<const Checksums>(Checksums{version * 101 + shard, version * 103 + shard});
  }

  void run_step(int step_number) {
    const Version version = static_cast<Version>(step_number);
    for (Member& member : members_) {
      member.source.clear();
      member.partial = false;
      member.epoch = 0;
      member.outcome = member.alive ? "" : "down";
      member.notes.clear();
    }
    // The trainer publishes the new weights; every live rollout asks for them.
    call(trainer(), [&](std::uint32_t shard) {
      return PublishRequest{version, layout(shard), checksums(version, shard)};
    });
    for (std::size_t i = 1; i < members_.size(); ++i) {
      if (!members_[i].alive) continue;
      call(members_[i], [&](std::uint32_t shard) {
        return UpdateRequest{Selector::latest(), layout(shard)};
      });
    }
    // The data plane: reads finish and offloads are made until nothing is pending. In the crash
    // step, the first rollout dies while its read is in flight.
    settle(step_number == options_.crash_step);
    // The trainer goes back to training: unpublish (the hub may ask for an offload first).
    call(trainer(), [](std::uint32_t) { return UnpublishRequest{}; });
    settle(false);
    for (const Member& member : members_) {
      std::printf("%-5d %-10s %-5s %-8s %-11s %-8s %-5s %s\n", step_number, member.name.c_str(),
                  member.datacenter.c_str(),
                  member.held ? std::to_string(*member.held).c_str() : "-",
                  member.source.empty() ? "-" : member.source.c_str(),
                  member.source.empty() ? "-" : (member.partial ? "partial" : "complete"),
                  member.epoch == 0 ? "-" : std::to_string(member.epoch).c_str(),
                  (member.notes + member.outcome).c_str());
    }
  }

  void settle(bool crash_one) {
    for (std::size_t round = 0; round < 10'000; ++round) {
      if (crash_one && !reads_.empty() && members_.size() > 2 && members_[1].alive) {
        crash(members_[1]);
        continue;
      }
      if (!reads_.empty()) {
        const auto [client, read] = *reads_.begin();
        reads_.erase(reads_.begin());
        step(Report{client, TransferDone{read.transfer, read.epoch}});
      } else if (!offloads_.empty()) {
        const auto [client, offloaded] = *offloads_.begin();
        offloads_.erase(offloads_.begin());
        step(Report{client, OffloadDone{offloaded}});
      } else {
        return;
      }
    }
  }

  // The rollout stops answering; time passes until the hub evicts it and re-routes its readers.
  void crash(Member& member) {
    member.alive = false;
    member.outcome = "crashed mid-transfer";
    std::set<ClientId> dead;
    for (const Shard& shard : member.shards) dead.insert(shard.client);
    std::erase_if(reads_, [&](const auto& entry) { return dead.contains(entry.first); });
    for (int tick = 0; tick < 5; ++tick) {
      now_ms_ += kHeartbeatTimeoutMs / 2;
      for (const auto& [client, index] : owner_) {
        if (!dead.contains(client) && members_[index].alive) step(Report{client, Heartbeat{}});
      }
      step(Tick{});
    }
  }

  void step(const Input& input) {
    Effects effects;
    hub_.step(input, now_ms_, effects);
    hub_.check_invariants();
    for (const Effect& effect : effects) route(effect);
  }

  void route(const Effect& effect) {
    auto owner = owner_.find(effect.client);
    if (owner == owner_.end()) return;
    Member& member = members_[owner->second];
    if (!member.alive) return;
    if (const auto* read = std::get_if<StartRead>(&effect.message)) {
      reads_.insert_or_assign(effect.client, *read);
      member.source = read->source.replica;
      member.partial = read->source.partial;
      member.epoch = read->epoch;
    } else if (const auto* offload = std::get_if<Offload>(&effect.message)) {
      offloads_[effect.client] = offload->version;
      member.notes = "offloads v" + std::to_string(offload->version) + " (last copy) ";
    } else if (const auto* reply = std::get_if<Reply>(&effect.message)) {
      if (effect.client != member.shards[0].client) return;  // shards agree; report shard 0
      record(member, reply->outcome);
    }
  }

  void record(Member& member, const Outcome& outcome) {
    if (const auto* error = std::get_if<Error>(&outcome)) {
      member.outcome = "error " + std::string(errc_name(error->code)) + ": " + error->detail;
      ++errors_;
    } else if (const auto* published = std::get_if<PublishOk>(&outcome)) {
      member.held = published->version;
      member.outcome = "published v" + std::to_string(published->version);
    } else if (const auto* updated = std::get_if<UpdateOk>(&outcome)) {
      if (updated->status == UpdateStatus::kUpdated) member.held = updated->version;
      member.outcome = std::string(update_status_name(updated->status)) + " to v" +
                       std::to_string(updated->version);
    } else if (std::holds_alternative<UnpublishOk>(outcome)) {
      member.outcome += ", unpublished";
      member.held.reset();
    }
  }

  int verdict() {
    const Version latest = hub_.latest("policy").value_or(0);
    int behind = 0;
    for (std::size_t i = 1; i < members_.size(); ++i) {
      if (members_[i].alive && members_[i].held != latest) ++behind;
    }
    const HubStats& stats = hub_.stats();
    std::printf("\nlatest version %llu; %llu transfers completed (%llu more restarted elsewhere or "
                "cancelled), %llu offloads, %llu evictions\n",
                static_cast<unsigned long long>(latest),
                static_cast<unsigned long long>(stats.transfers_completed),
                static_cast<unsigned long long>(stats.transfers_started - stats.transfers_completed),
                static_cast<unsigned long long>(stats.offloads_started),
                static_cast<unsigned long long>(stats.evictions));
    if (behind > 0 || errors_ > 0) {
      std::printf("FAILED: %d live rollouts are not on version %llu; %d calls failed\n", behind,
                  static_cast<unsigned long long>(latest), errors_);
      return 1;
    }
    std::printf("OK: every live rollout holds version %llu\n", static_cast<unsigned long long>(latest));
    return 0;
  }

  DemoOptions options_;
  Hub hub_;
  std::vector<Member> members_;
  std::map<ClientId, std::size_t> owner_;
  std::map<ClientId, StartRead> reads_;
  std::map<ClientId, Version> offloads_;
  ClientId next_client_ = 1;
  TimeMs now_ms_ = 0;
  int errors_ = 0;
};

}  // namespace
}  // namespace th

int main(int argc, char** argv) {
  th::DemoOptions options;
  CLI::App app{
      "th-demo: the TensorHub reference server's decisions on an in-process fleet.\n"
      "A trainer (2 shards) publishes a new version every step; rollouts update to it, reading\n"
      "from the trainer or, under pipeline replication, from each other while still receiving;\n"
      "the last rollout is in another datacenter. One rollout crashes mid-transfer. Prints one row\n"
      "per step and replica; exits 1 if a live rollout does not end on the latest version."};
  app.add_option("--steps", options.steps, "training steps to run")->check(CLI::Range(1, 1000));
  app.add_option("--rollouts", options.rollouts, "rollout replicas")->check(CLI::Range(1, 64));
  app.add_option("--crash-step", options.crash_step,
                 "step in which the first rollout crashes mid-transfer (0: never)")
      ->check(CLI::Range(0, 1000));
  bool no_pipeline = false;
  app.add_flag("--no-pipeline", no_pipeline,
               "every rollout reads from a complete copy (fan-out 4) instead of chaining");
  CLI11_PARSE(app, argc, argv);
  options.pipeline = !no_pipeline;
  try {
    th::Demo demo(options);
    return demo.run();
  } catch (const std::exception& failure) {
    std::fprintf(stderr, "th-demo: %s\n", failure.what());
    return 2;
  }
}
