#include "tests/core/testkit/cluster.h"

#include <algorithm>
#include <cstdio>
#include <iostream>
#include <sstream>

#include "tests/core/testkit/driver.h"

namespace th::test {

namespace {

constexpr TimeMs kSliceMs = 100;
constexpr int kHealRoundsMax = 600;
constexpr std::size_t kDeliveriesMax = 200'000;  // per deliver-all: a loop that never settles is a bug
constexpr std::size_t kInFlightMax = 4096;       // beyond this the test itself is broken
constexpr std::uint64_t kIdBaseStep = 1ULL << 40;

AgentConfig agent_config(ClientId client) {
  AgentConfig config;
  config.client = client;
  config.servers = 2;
  config.heartbeat_interval_ms = 250;
  config.retry_initial_ms = 200;
  config.retry_max_ms = 800;
  return config;
}

}  // namespace

std::string_view action_name(ClusterAction::Kind kind) {
  static constexpr const char* kNames[] = {"plan",      "step",      "step-all", "deliver",
                                           "deliver-all", "drop",    "duplicate", "finish-read",
                                           "fail-read", "offload",   "crash",    "tick",
                                           "failover",  "burst",     "crash-source",
                                           "replay",    "cancel",    "tamper"};
  const auto index = static_cast<std::size_t>(kind);
  return index < std::size(kNames) ? kNames[index] : std::string_view{};
}

std::ostream& operator<<(std::ostream& out, const ClusterAction& action) {
  out << action_name(action.kind) << "(" << action.a << "," << action.b;
  if (action.kind == ClusterAction::Kind::kPlan) out << "=" << op_name(static_cast<OpKind>(action.b % 7));
  out << "," << action.c << "," << action.d << (action.go ? ",go" : "") << ")";
  return out;
}

rc::Gen<ClusterAction> gen_cluster_action(const FleetSpec& spec, bool lossy) {
  const std::size_t faults = spec.faults ? 1 : 0;
  const std::size_t closes = spec.closes ? 1 : 0;
  const std::size_t loss = lossy ? 1 : 0;
  const auto replicas = static_cast<std::uint32_t>(spec.replicas.size());
  return rc::gen::exec([=, spec = spec] {
    ClusterAction action;
    action.kind = *rc::gen::weightedElement<ClusterAction::Kind>({
        {20, ClusterAction::Kind::kPlan},
        {10, ClusterAction::Kind::kStep},
        {12, ClusterAction::Kind::kStepAll},
        {8 * loss, ClusterAction::Kind::kDeliver},
        {10 * loss, ClusterAction::Kind::kDeliverAll},
        {3 * loss, ClusterAction::Kind::kDrop},
        {3 * loss, ClusterAction::Kind::kDuplicate},
        {16, ClusterAction::Kind::kFinishRead},
        {2 * faults, ClusterAction::Kind::kFailRead},
        {6, ClusterAction::Kind::kOffload},
        {2 * faults, ClusterAction::Kind::kCrash},
        {5, ClusterAction::Kind::kTick},
        {1 * faults, ClusterAction::Kind::kFailover},
        {4, ClusterAction::Kind::kBurst},
        {2 * faults, ClusterAction::Kind::kCrashSource},
        {4 * loss, ClusterAction::Kind::kReplay},
        {3, ClusterAction::Kind::kCancel},
        {1 * faults, ClusterAction::Kind::kTamper},
    });
    action.a = *rc::gen::inRange<std::uint32_t>(0, replicas);
    const std::uint32_t shards = spec.models[spec.replicas[action.a].model].num_shards;
    switch (action.kind) {
      case ClusterAction::Kind::kPlan:
        if (spec.replicas[action.a].trainer) {
          action.b = *rc::gen::weightedElement<std::uint32_t>(
              {{9, 0}, {7, 1}, {1, 2}, {1, 3}, {1, 4}, {2, 5}, {1 * closes, 6}});
        } else {
          action.b = *rc::gen::weightedElement<std::uint32_t>(
              {{1, 0}, {2, 1}, {5, 2}, {9, 3}, {1, 4}, {1, 5}, {1 * closes, 6}});
        }
        // Now and then a shard registers a layout the hub must refuse (program.h plan_op).
        if ((action.b == 0 || action.b == 2 || action.b == 3) &&
            *rc::gen::weightedElement<bool>({{15, false}, {1, true}})) {
          action.b += 7 * (1 + 2 * *rc::gen::inRange<std::uint32_t>(0, shards) + *rc::gen::inRange<std::uint32_t>(0, 2));
        }
        action.c = *rc::gen::weightedElement<std::uint32_t>({{2, 0}, {5, 1}, {1, 2}, {1, 3}});
        action.d = *rc::gen::inRange<std::uint32_t>(0, 4);
        action.go = *rc::gen::weightedElement<bool>({{3, true}, {1, false}});
        break;
      case ClusterAction::Kind::kStep:
      case ClusterAction::Kind::kCancel:
        action.b = *rc::gen::inRange<std::uint32_t>(0, shards);
        break;
      case ClusterAction::Kind::kFailRead:
        action.b = *rc::gen::inRange<std::uint32_t>(0, 3);
        [[fallthrough]];
      case ClusterAction::Kind::kDeliver:
      case ClusterAction::Kind::kDrop:
      case ClusterAction::Kind::kDuplicate:
      case ClusterAction::Kind::kFinishRead:
      case ClusterAction::Kind::kOffload:
      case ClusterAction::Kind::kTamper:
        action.a = *rc::gen::inRange<std::uint32_t>(0, 16);
        break;
      case ClusterAction::Kind::kCrash:
        action.b = *rc::gen::inRange<std::uint32_t>(0, 2);
        break;
      case ClusterAction::Kind::kCrashSource:
        action.a = *rc::gen::inRange<std::uint32_t>(0, 4);
        break;
      case ClusterAction::Kind::kReplay:
        action.a = *rc::gen::inRange<std::uint32_t>(0, 32);
        action.b = *rc::gen::inRange<std::uint32_t>(0, 2);  // 1: an order about an offload copy
        break;
      case ClusterAction::Kind::kTick:
        action.a = *rc::gen::inRange<std::uint32_t>(1, 16);
        break;
      default:
        break;
    }
    return action;
  });
}

rc::Gen<std::shared_ptr<const rc::state::Command<FleetSpec, Cluster>>> gen_cluster_command(
    const FleetSpec& spec, bool lossy) {
  return rc::gen::map(gen_cluster_action(spec, lossy), [](ClusterAction action) {
    return std::shared_ptr<const rc::state::Command<FleetSpec, Cluster>>(
        std::make_shared<ClusterCommand>(action));
  });
}

Cluster::Cluster(const FleetSpec& spec, bool lossy)
    : spec_(spec), lossy_(lossy), observer_(spec.settings.fanout_max, spec.settings.model_grace_ms), reference_(spec.settings) {
  for (std::uint32_t server = 0; server < 2; ++server) {
    HubSettings settings = spec_.settings;
    settings.id_base = (id_base_ += kIdBaseStep);
    hubs_[server] = std::make_unique<Hub>(settings);
  }
  runs_.resize(spec_.replicas.size());
  for (std::uint32_t r = 0; r < runs_.size(); ++r) {
    const std::uint32_t shards = spec_.models[spec_.replicas[r].model].num_shards;
    for (std::uint32_t shard = 0; shard < shards; ++shard) {
      runs_[r].workers.push_back(static_cast<int>(workers_.size()));
      Worker worker;
      worker.replica = static_cast<int>(r);
      worker.shard = shard;
      workers_.push_back(std::move(worker));
    }
  }
}

void Cluster::fail(const std::string& what) const { throw AssertionFailure("cluster: " + what); }

// ==== Actions ======================================================================================

void Cluster::apply(const ClusterAction& action) {
  switch (action.kind) {
    case ClusterAction::Kind::kPlan:
      plan(action.a, action.b, action.c, action.d);
      if (action.go) {
        for (std::uint32_t shard = 0; shard < runs_[action.a].workers.size(); ++shard) step(action.a, shard);
      }
      break;
    case ClusterAction::Kind::kStep:
      step(action.a, action.b);
      break;
    case ClusterAction::Kind::kStepAll:
      for (std::uint32_t shard = 0; shard < runs_[action.a].workers.size(); ++shard) step(action.a, shard);
      break;
    case ClusterAction::Kind::kDeliver:
      if (!network_.empty()) {
        const std::size_t index = action.a % network_.size();
        coverage_.reordered += index != 0;
        deliver(index);
      }
      break;
    case ClusterAction::Kind::kDeliverAll:
      deliver_all(kDeliveriesMax);
      break;
    case ClusterAction::Kind::kDrop:
      if (!network_.empty()) {
        network_.erase(network_.begin() + static_cast<std::ptrdiff_t>(action.a % network_.size()));
        ++coverage_.lost;
      }
      break;
    case ClusterAction::Kind::kReplay: {
      const std::deque<Packet>& window =
          action.b == 1 && !delivered_copy_orders_.empty() ? delivered_copy_orders_ : delivered_;
      if (!window.empty()) {
        Packet copy = window[window.size() - 1 - action.a % window.size()];
        copy.id = next_packet_++;
        network_.push_back(std::move(copy));
        ++coverage_.replayed;
      }
      break;
    }
    case ClusterAction::Kind::kDuplicate:
      if (!network_.empty()) {
        Packet copy = network_[action.a % network_.size()];
        copy.id = next_packet_++;
        network_.push_back(std::move(copy));
        ++coverage_.duplicated;
      }
      break;
    case ClusterAction::Kind::kFinishRead:
      finish_read(action.a, std::nullopt);
      break;
    case ClusterAction::Kind::kFailRead:
      finish_read(action.a, read_failure_of(action.b));
      break;
    case ClusterAction::Kind::kTamper:
      tamper(action.a);
      break;
    case ClusterAction::Kind::kOffload:
      make_offload(action.a);
      break;
    case ClusterAction::Kind::kCrash:
      crash(action.a, action.b == 1);
      break;
    case ClusterAction::Kind::kTick:
      tick(static_cast<TimeMs>(action.a) * kSliceMs);
      break;
    case ClusterAction::Kind::kFailover:
      failover();
      break;
    case ClusterAction::Kind::kCancel: {
      if (runs_[action.a].crashed || action.b >= runs_[action.a].workers.size()) break;
      const int w = runs_[action.a].workers[action.b];
      Worker& worker = workers_[w];
      if (!worker.alive || !worker.agent || !worker.in_call || worker.opening) break;
      ++coverage_.cancels;
      agent_step(w, UserCancel{worker.call_id});
      break;
    }
    case ClusterAction::Kind::kCrashSource: {
      std::vector<std::uint32_t> sources;
      for (std::uint32_t replica = 0; replica < runs_.size(); ++replica) {
        if (runs_[replica].crashed) continue;
        for (int w : runs_[replica].workers) {
          if (workers_[w].alive && !workers_[w].grants.empty()) {
            sources.push_back(replica);
            break;
          }
        }
      }
      if (!sources.empty()) crash(sources[action.a % sources.size()], /*connection_lost=*/true);
      break;
    }
    case ClusterAction::Kind::kBurst:
      for (std::uint32_t replica = 0; replica < runs_.size(); ++replica) {
        if (spec_.replicas[replica].trainer) continue;
        plan(replica, action.a % 2 == 0 ? 3 : 2, /*latest*/ 0, 0);
        for (std::uint32_t shard = 0; shard < runs_[replica].workers.size(); ++shard) step(replica, shard);
      }
      break;
  }
  if (!lossy_) deliver_all(kDeliveriesMax);
  if (network_.size() > kInFlightMax) fail("the network holds " + std::to_string(network_.size()) + " messages");
  restart_finished();
}

// A replica whose shards diverged (an agent started over: its program is out of step with itself)
// or all closed comes back as a new incarnation, as its framework would restart it.
void Cluster::restart_finished() {
  for (std::uint32_t r = 0; r < runs_.size(); ++r) {
    ReplicaRun& run = runs_[r];
    if (run.crashed) continue;
    bool diverged = false;
    bool all_closed = true;
    for (int w : run.workers) {
      const Worker& worker = workers_[w];
      if (!worker.alive) {
        all_closed = false;
        continue;
      }
      diverged = diverged || worker.agent->starts() > 1;
      all_closed = all_closed && worker.agent->phase() == AgentPhase::kClosed;
    }
    if (diverged || all_closed) {
      crash(r, /*connection_lost=*/false);
      run.program.clear();  // the restarted replica runs a new program (planned from now on)
    }
  }
}

void Cluster::plan(std::uint32_t replica, std::uint32_t op, std::uint32_t p1, std::uint32_t p2) {
  ReplicaRun& run = runs_[replica];
  if (run.program.size() >= 16) return;  // bounded, like the fleet's backlog
  const std::string& model = spec_.models[spec_.replicas[replica].model].name;
  const Version latest = hubs_[active_]->latest(model).value_or(0);
  run.program.push_back(plan_op(op, p1, p2, latest));
}

std::pair<std::uint64_t, std::uint64_t> Cluster::place(int w) const {
  const Worker& worker = workers_[w];
  return {worker.agent->starts(), worker.agent->last_seq()};
}

// SPMD: a shard makes its next call only once every live peer has opened and completed as many
// calls as it has. Opening is part of the program: a peer whose open failed (and opens again) is
// behind, as a rank still in its framework's init is. A shard that ran ahead of a peer that never
// got in would complete calls in a replica that the peer's process does not take itself to be
// part of (property-regressions.txt: lossy-open-refused-then-bound).
bool Cluster::peers_behind(int w) const {
  for (int peer : runs_[workers_[w].replica].workers) {
    if (peer == w || !workers_[peer].alive) continue;
    if (!workers_[peer].opened || place(peer) < place(w)) return true;
  }
  return false;
}

void Cluster::start_replica(std::uint32_t replica) {
  ReplicaRun& run = runs_[replica];
  run.crashed = false;
  for (int w : run.workers) {
    Worker& worker = workers_[w];
    const std::uint32_t shard = worker.shard;
    worker = Worker{};
    worker.replica = static_cast<int>(replica);
    worker.shard = shard;
    worker.client = next_client_++;
    worker.agent = std::make_unique<ShardAgent>(agent_config(worker.client));
    worker.alive = true;
    clients_[worker.client] = w;
  }
}

void Cluster::step(std::uint32_t replica, std::uint32_t shard) {
  ReplicaRun& run = runs_[replica];
  if (run.crashed || !workers_[run.workers[0]].agent) {
    if (run.crashed) ++run.incarnation;
    start_replica(replica);
  }
  const int w = run.workers[shard];
  Worker& worker = workers_[w];
  if (!worker.alive || worker.in_call) return;
  const FleetSpec::ReplicaSpec& spec = spec_.replicas[replica];
  if (!worker.opened) {
    OpenRequest open;
    open.model = spec_.models[spec.model].name;
    open.replica = spec.name;
    open.incarnation = run.incarnation;
    open.shard = shard;
    open.num_shards = static_cast<std::uint32_t>(run.workers.size());
    open.datacenter = spec.datacenter;
    open.spot = spec.spot;
    open.role = spec.trainer ? "trainer" : "rollout";
    open.retention = spec.retention;
    open.data_endpoint = "test://" + spec.name + "/" + std::to_string(shard);
    worker.in_call = true;
    worker.opening = true;
    agent_step(w, UserCall{++worker.call_id, open});
    return;
  }
  if (worker.agent->phase() == AgentPhase::kClosed || peers_behind(w)) return;
  const std::uint64_t next = worker.agent->last_seq();  // the program is indexed by call number
  if (next >= run.program.size()) return;
  PlannedOp op = run.program[next];
  RequestBody body = body_for(op, shard);
  if (op.kind == OpKind::kPublish) {
    // A trainer writes the version into its buffers, which it may do only while they hold no
    // published version: it was told so, or (after a call that failed) the client library says
    // so. Otherwise it publishes what it has, and the hub refuses.
    if (worker.told_known ? !worker.told : !worker.agent->held()) {
      for (const auto& [key, grant] : worker.grants) {
        if (grant.kind == CopyKind::kPrimary) {
          fail(spec.name + "/" + std::to_string(shard) + " writes its buffers while a grant to read "
               "them stands");
        }
      }
      worker.content = op.version;
      worker.tampered = false;
      worker.complete = true;
    }
  }
  worker.in_call = true;
  worker.opening = false;
  worker.call_kind = op.kind;
  worker.call_writes = op.kind == OpKind::kReplicate || op.kind == OpKind::kUpdate;
  worker.seq_before = worker.agent->last_seq();
  agent_step(w, UserCall{++worker.call_id, std::move(body)});
}

void Cluster::crash(std::uint32_t replica, bool connection_lost) {
  ReplicaRun& run = runs_[replica];
  if (run.crashed) return;
  run.crashed = true;
  run.program.clear();  // a restarted process starts its program anew
  for (int w : run.workers) {
    Worker& worker = workers_[w];
    if (!worker.alive) continue;
    if (connection_lost) hub_step(active_, ConnectionLost{worker.client});
    worker.alive = false;
    worker.agent.reset();
    worker.reads.clear();
    worker.grants.clear();
    worker.making.clear();
    worker.offload_copies.clear();
    worker.tampered_offloads.clear();
    worker.failed_reads.clear();
    worker.tampered = false;
    worker.in_call = false;
  }
}

void Cluster::failover() {
  ++coverage_.failovers;
  hub_alive_[active_] = false;
  const std::uint32_t dead = active_;
  active_ = 1 - active_;
  if (!hub_alive_[active_]) {  // both died in turn: a fresh server takes the place
    HubSettings settings = spec_.settings;
    settings.id_base = (id_base_ += kIdBaseStep);
    hubs_[active_] = std::make_unique<Hub>(settings);
    hub_alive_[active_] = true;
  }
  observer_.on_server_reset(/*answers_delivered=*/false);
  reference_.on_server_restart();
  std::erase_if(network_, [&](const Packet& packet) { return packet.to_hub && packet.server == dead; });
  for (std::size_t w = 0; w < workers_.size(); ++w) {
    if (workers_[w].alive) agent_step(static_cast<int>(w), ServerLost{dead});
  }
}

void Cluster::tick(TimeMs ms) {
  for (TimeMs passed = 0; passed < ms; passed += kSliceMs) {
    now_ms_ += kSliceMs;
    for (std::size_t w = 0; w < workers_.size(); ++w) {
      if (workers_[w].alive) agent_step(static_cast<int>(w), AgentTick{});
    }
    for (std::uint32_t server = 0; server < 2; ++server) {
      if (hub_alive_[server]) hub_step(server, Tick{});
    }
    if (!lossy_) deliver_all(kDeliveriesMax);
  }
}

// ==== The network ==================================================================================

void Cluster::deliver(std::size_t index) {
  const Packet packet = std::move(network_[index]);
  network_.erase(network_.begin() + static_cast<std::ptrdiff_t>(index));
  if (packet.to_hub) {
    std::visit(
        [&](const auto& message) {
          using T = std::decay_t<decltype(message)>;
          if constexpr (std::is_same_v<T, Request>) {
            hub_step(packet.server, message);
          } else if constexpr (std::is_same_v<T, Report>) {
            hub_step(packet.server, message);
          }
        },
        packet.message);
    return;
  }
  auto client = clients_.find(packet.client);
  if (client == clients_.end()) return;
  Worker& worker = workers_[client->second];
  if (!worker.alive || worker.client != packet.client) return;  // a process that is gone
  const Effect& effect = std::get<Effect>(packet.message);
  // Instructions, not answers, are worth replaying: an agent tells a late answer by its number.
  if (!std::holds_alternative<Reply>(effect.message)) {
    const bool copy_order = std::holds_alternative<Offload>(effect.message) ||
                            std::holds_alternative<ReleaseOffload>(effect.message);
    std::deque<Packet>& window = copy_order ? delivered_copy_orders_ : delivered_;
    window.push_back(packet);
    if (window.size() > kReplayWindow) window.pop_front();
  }
  if (packet.server == worker.agent->server() && effect.session == worker.agent->session()) {
    if (const auto* stop = std::get_if<StopServing>(&effect.message)) {
      worker.withdrawn.insert({stop->transfer, stop->epoch});
    } else if (const auto* release = std::get_if<ReleaseOffload>(&effect.message)) {
      worker.released[release->version] = {release->copy, effect.session};
    }
  }
  agent_step(client->second, FromHub{packet.server, effect});
}

void Cluster::deliver_all(std::size_t max) {
  for (std::size_t delivered = 0; !network_.empty(); ++delivered) {
    if (delivered >= max) fail("messages keep coming: " + std::to_string(max) + " delivered");
    deliver(0);
  }
}

void Cluster::hub_step(std::uint32_t server, const Input& input) {
  if (!hub_alive_[server]) return;
  const bool active = server == active_;
  if (active) {
    if (const auto* request = std::get_if<Request>(&input)) {
      if (const auto* open = std::get_if<OpenRequest>(&request->body)) {
        observer_.on_open(request->client, request->seq, request->session, *open);
      } else {
        observer_.on_call(request->client, request->seq, request->body);
      }
    } else if (const auto* report = std::get_if<Report>(&input)) {
      observer_.on_report(report->client, report->body);
    }
    reference_.before_step(input, now_ms_);
  }
  Effects effects;
  Hub& hub = *hubs_[server];
  const bool heartbeat = std::holds_alternative<Report>(input) &&
                         std::holds_alternative<Heartbeat>(std::get<Report>(input).body);
  if (tracing() && !heartbeat && !std::holds_alternative<Tick>(input)) {
    std::cerr << now_ms_ << " s" << server << " " << describe_input(input) << "\n";
  }
  hub.step(input, now_ms_, effects);
  if (tracing()) {
    for (const Effect& effect : effects) std::cerr << describe_effect(effect) << "\n";
  }
  hub.check_invariants();
  if (active) {
    reference_.after_step(input, effects, now_ms_);
    observer_.on_effects(effects);
    for (const auto& model : spec_.models) observer_.on_latest(model.name, hub.latest(model.name), now_ms_);
    if (!observer_.violations().empty()) fail("observer: " + observer_.violations().front());
  }
  for (Effect& effect : effects) {
    if (const auto* evicted = std::get_if<Evicted>(&effect.message)) {
      ++coverage_.evictions;
      // Heartbeats reach the server at once here: only a dead process can be silent. (With a
      // lossy network an open that waits in the failover barrier may miss its retransmissions.)
      // The silent shard is the one the detail names ("shard N of replica …").
      auto client = clients_.find(effect.client);
      std::uint32_t silent = 0;
      const bool for_silence = evicted->detail.find("sent no heartbeat") != std::string::npos &&
                               std::sscanf(evicted->detail.c_str(), "shard %u", &silent) == 1;
      // (A shard whose agent's open was refused is not live there: its last retransmission may
      // have crossed the refusal and bound it again.)
      const auto live = [&](const Worker& worker) {
        return worker.alive && worker.client == effect.client && worker.shard == silent &&
               (worker.agent->phase() == AgentPhase::kOpen || worker.agent->phase() == AgentPhase::kOpening);
      };
      // Silence that began while the network was still lossy (a heartbeat lost just before
      // healing) may end in an eviction after it: only silence wholly after healing is a bug.
      const std::size_t silent_for = evicted->detail.find("sent no heartbeat for ");
      long long silent_ms = 0;
      // (A detail it cannot read counts as silence after healing: the check stays on.)
      const bool silent_known =
          silent_for != std::string::npos &&
          std::sscanf(evicted->detail.c_str() + silent_for, "sent no heartbeat for %lld ms", &silent_ms) == 1;
      const bool silent_since_healing = healed_at_ms_ < 0 || !silent_known || now_ms_ - silent_ms >= healed_at_ms_;
      if (!lossy_ && active && for_silence && silent_since_healing && client != clients_.end() &&
          live(workers_[client->second])) {
        fail("a live shard whose heartbeats reach the server was evicted: " + evicted->detail);
      }
    }
    auto client = clients_.find(effect.client);
    if (client == clients_.end()) continue;
    Packet packet;
    packet.id = next_packet_++;
    packet.to_hub = false;
    packet.server = server;
    packet.worker = client->second;
    packet.client = effect.client;
    packet.message = std::move(effect);
    network_.push_back(std::move(packet));
  }
}

// ==== The agents and their applications ============================================================

void Cluster::agent_step(int w, const AgentInput& input) {
  Worker& worker = workers_[w];
  if (!worker.alive) return;
  AgentEffects effects;
  worker.agent->step(input, now_ms_, effects);
  std::vector<std::uint32_t> lost;
  for (const AgentEffect& effect : effects) {
    if (!worker.alive) break;
    if (const auto* send = std::get_if<SendRequest>(&effect); send != nullptr && !hub_alive_[send->server]) {
      lost.push_back(send->server);  // connection refused: the transport tells the agent
      continue;
    }
    on_agent_effect(w, effect);
  }
  for (std::uint32_t server : lost) {
    if (worker.alive && worker.agent->server() == server) agent_step(w, ServerLost{server});
  }
}

void Cluster::on_agent_effect(int w, const AgentEffect& effect) {
  Worker& worker = workers_[w];
  const std::string who = spec_.replicas[worker.replica].name + "/" + std::to_string(worker.shard);
  std::visit(
      [&](const auto& e) {
        using T = std::decay_t<decltype(e)>;
        if constexpr (std::is_same_v<T, SendRequest>) {
          Packet packet;
          packet.id = next_packet_++;
          packet.server = e.server;
          packet.worker = w;
          packet.client = worker.client;
          packet.message = e.request;
          network_.push_back(std::move(packet));
        } else if constexpr (std::is_same_v<T, SendReport>) {
          if (const auto* offloaded = std::get_if<OffloadDone>(&e.report.body)) {
            // Only a copy of the version itself: one of buffers that moved on while it was made
            // holds other bytes.
            if (!worker.offload_copies.contains(offloaded->version)) {
              fail(who + " reports an offload copy of version " + std::to_string(offloaded->version) +
                   " it does not have");
            }
            // The session whose server named the copy so: a resumed shard reports a copy its open
            // announced under the previous server's id until the new server renames or releases it.
            auto [named, first] = worker.offload_ids.try_emplace(offloaded->version,
                                                                 Worker::Named{offloaded->copy, worker.agent->session()});
            if (!first && named->second.copy != offloaded->copy) {
              named->second = {offloaded->copy, worker.agent->session()};
            }
          }
          if (const auto* done = std::get_if<TransferDone>(&e.report.body)) {
            auto failed = worker.failed_reads.find(done->transfer);
            if (failed != worker.failed_reads.end() && failed->second == done->epoch) {
              fail(who + " reports done its read of transfer " + std::to_string(done->transfer) + " (epoch " +
                   std::to_string(done->epoch) + "), which failed" + " (bytes that failed their checksums taken as done?)");
            }
          }
          if (std::holds_alternative<Heartbeat>(e.report.body)) {
            hub_step(e.server, e.report);  // heartbeats do not queue behind the test's choices
            return;
          }
          Packet packet;
          packet.id = next_packet_++;
          packet.server = e.server;
          packet.worker = w;
          packet.client = worker.client;
          packet.message = e.report;
          network_.push_back(std::move(packet));
        } else if constexpr (std::is_same_v<T, BeginRead>) {
          if (!worker.in_call || !worker.call_writes) {
            fail(who + "'s buffers are rewritten with version " + std::to_string(e.read.version) +
                 " while its application makes no replicate or update call (a stale instruction)");
          }
          // A grant to read what the buffers held before must be gone; one to read the version
          // being received (pipeline replication) may stand: a new source writes the same bytes.
          for (const auto& [key, grant] : worker.grants) {
            if (grant.kind == CopyKind::kPrimary && grant.version != e.read.version) {
              fail(who + "'s buffers are rewritten with version " + std::to_string(e.read.version) +
                   " while a grant to read version " + std::to_string(grant.version) +
                   " from them (transfer " + std::to_string(key.first) + ") stands");
            }
          }
          worker.reads[e.read.transfer] = e.read;
          worker.failed_reads.erase(e.read.transfer);
          worker.tampered = false;  // every byte is written anew
          worker.content = e.read.version;
          worker.complete = false;
        } else if constexpr (std::is_same_v<T, CancelRead>) {
          worker.reads.erase(e.transfer);
        } else if constexpr (std::is_same_v<T, GrantServe>) {
          if (worker.withdrawn.contains({e.grant.transfer, e.grant.epoch})) {
            fail(who + " serves transfer " + std::to_string(e.grant.transfer) + " (epoch " +
                 std::to_string(e.grant.epoch) + ") after the hub withdrew it (a stale grant)");
          }
          if (e.grant.kind == CopyKind::kPrimary && worker.content != e.grant.version) {
            fail(who + " grants reads of version " + std::to_string(e.grant.version) +
                 " from buffers that hold " + (worker.content ? std::to_string(*worker.content) : "nothing"));
          }
          if (e.grant.kind == CopyKind::kOffload && !worker.offload_copies.contains(e.grant.version)) {
            fail(who + " grants reads of an offload copy of version " + std::to_string(e.grant.version) +
                 " it does not have");
          }
          worker.grants[{e.grant.transfer, e.grant.epoch}] = e.grant;
        } else if constexpr (std::is_same_v<T, RevokeServe>) {
          worker.grants.erase({e.transfer, e.epoch});
        } else if constexpr (std::is_same_v<T, MakeOffload>) {
          worker.making.push_back(e.version);
        } else if constexpr (std::is_same_v<T, FreeOffload>) {
          // A kept copy goes only when the hub releases that very copy, or when the shard leaves
          // or starts over (closed or evicted: every copy goes). A server of a later session than
          // the one the shard last reported the copy to knows it by a number of its own (it
          // adopted the copy the open announced; its renaming Offload may not have arrived): its
          // release of the version is a release of that copy.
          const AgentPhase phase = worker.agent->phase();
          auto id = worker.offload_ids.find(e.version);
          auto released = worker.released.find(e.version);
          const bool that_copy_released =
              id != worker.offload_ids.end() && released != worker.released.end() &&
              (released->second.copy == id->second.copy || released->second.session > id->second.session);
          if (worker.offload_copies.contains(e.version) && phase == AgentPhase::kOpen &&
              id != worker.offload_ids.end() && !that_copy_released) {
            fail(who + " frees its offload copy of version " + std::to_string(e.version) +
                 " (copy " + std::to_string(id->second.copy) + ") that the hub did not release");
          }
          for (const auto& [key, grant] : worker.grants) {
            if (grant.kind == CopyKind::kOffload && grant.version == e.version) {
              fail(who + " frees its offload copy of version " + std::to_string(e.version) +
                   " while a grant to read it stands");
            }
          }
          worker.offload_copies.erase(e.version);
          worker.tampered_offloads.erase(e.version);
          // The next copy of this version is another buffer: unnamed until the agent reports it
          // (one made for a late instruction may be freed unreported, when its release is late too).
          worker.offload_ids.erase(e.version);
        } else if constexpr (std::is_same_v<T, CopyFoundCorrupt>) {
          ++coverage_.corrupt_notices;  // whom the hub tells, the reference model judges (after_step)
        } else {
          static_assert(std::is_same_v<T, CallDone>);
          on_call_done(w, e);
        }
      },
      effect);
}

void Cluster::verify_told(int w, const char* when) const {
  const Worker& worker = workers_[w];
  if (!worker.told_known || !worker.told) return;
  if (worker.content != worker.told || !worker.complete) {
    fail(spec_.replicas[worker.replica].name + "/" + std::to_string(worker.shard) + " was told it holds " +
         "version " + std::to_string(*worker.told) + " (" + when + ") but its buffers hold " +
         (worker.content ? std::to_string(*worker.content) : "nothing") +
         (worker.complete ? "" : " (in part)"));
  }
}

void Cluster::on_call_done(int w, const CallDone& done) {
  Worker& worker = workers_[w];
  worker.in_call = false;
  ++coverage_.answers;
  const Outcome& outcome = done.outcome;
  if (worker.opening) {
    worker.opening = false;
    worker.opened = std::holds_alternative<OpenOk>(outcome);
    return;
  }
  // Replica consistency, as the applications see it: every answer that completed call n, errors
  // included (a call that ends with its replica, evicted or divergent, does not complete: the
  // agent re-opens and the program makes it again).
  const bool answered = worker.agent->last_seq() == worker.seq_before + 1 &&
                        worker.agent->phase() == AgentPhase::kOpen;
  if (answered) {
    const auto key = std::tuple{worker.replica, runs_[worker.replica].incarnation,
                                worker.agent->starts(), worker.agent->last_seq()};
    auto [found, inserted] = answers_.try_emplace(key, outcome);
    if (!inserted && !same_answer(found->second, outcome)) {
      fail("shard " + std::to_string(worker.shard) + " of " + spec_.replicas[worker.replica].name +
           " got another answer to call " + std::to_string(worker.agent->last_seq()) +
           " than its peers (" + describe(outcome) + " vs " + describe(found->second) + ")");
    }
  }
  // What the application now believes its buffers hold.
  std::visit(
      [&](const auto& answer) {
        using T = std::decay_t<decltype(answer)>;
        if constexpr (std::is_same_v<T, PublishOk> || std::is_same_v<T, ReplicateOk>) {
          worker.told = answer.version;
          worker.told_known = true;
          verify_told(w, "the answer");
        } else if constexpr (std::is_same_v<T, UpdateOk>) {
          worker.told = answer.version;
          worker.told_known = true;
          verify_told(w, "the answer");
        } else if constexpr (std::is_same_v<T, UnpublishOk> || std::is_same_v<T, CloseOk>) {
          worker.told.reset();
          worker.told_known = true;
        } else if constexpr (std::is_same_v<T, Error>) {
          if (worker.call_writes) worker.told_known = false;
          if (worker.call_kind == OpKind::kUnpublish && answer.code == Errc::kNotPublished) {
            worker.told.reset();
            worker.told_known = true;
          }
          if (answer.code == Errc::kDivergentCall) worker.told_known = false;
        }
      },
      outcome);
}

// ==== The data plane ===============================================================================

std::optional<int> Cluster::source_of(const StartRead& read) const {
  for (std::uint32_t r = 0; r < runs_.size(); ++r) {
    if (spec_.replicas[r].name != read.source.replica) continue;
    if (read.shard >= runs_[r].workers.size()) return std::nullopt;
    const int w = runs_[r].workers[read.shard];
    const Worker& worker = workers_[w];
    if (!worker.alive || worker.agent->incarnation() != read.source.incarnation) return std::nullopt;
    return w;
  }
  return std::nullopt;
}

std::vector<std::pair<int, TransferId>> Cluster::reads_in_progress() const {
  std::vector<std::pair<int, TransferId>> reads;
  for (std::size_t w = 0; w < workers_.size(); ++w) {
    if (!workers_[w].alive) continue;
    for (const auto& [transfer, read] : workers_[w].reads) reads.emplace_back(static_cast<int>(w), transfer);
  }
  return reads;
}

void Cluster::finish_read(std::size_t index, std::optional<ReadFailure> fail_it) {
  // The reads whose outcome is decided now: a read from a source still receiving the version can
  // only take what is there and wait for the rest.
  struct Decided {
    int reader;
    TransferId transfer;
    std::optional<ReadFailure> failure;
  };
  std::vector<Decided> decided;
  for (const auto& [w, transfer] : reads_in_progress()) {
    const StartRead& read = workers_[w].reads.at(transfer);
    if (fail_it) {
      decided.push_back({w, transfer, *fail_it});
      continue;
    }
    const std::optional<int> source = source_of(read);
    if (!source) {
      decided.push_back({w, transfer, ReadFailure::kSourceUnreachable});
      continue;
    }
    const Worker& from = workers_[*source];
    auto grant = from.grants.find({read.transfer, read.epoch});
    if (grant == from.grants.end() || grant->second.version != read.version ||
        grant->second.kind != read.source.kind) {
      decided.push_back({w, transfer, ReadFailure::kSourceRefused});
      continue;
    }
    if (read.source.kind == CopyKind::kPrimary && from.content == read.version && !from.complete) {
      continue;  // pipelined: the source is still receiving
    }
    // The data plane checks every byte against the version's checksums.
    const bool tampered = read.source.kind == CopyKind::kPrimary ? from.tampered
                                                                 : from.tampered_offloads.contains(read.version);
    decided.push_back({w, transfer, tampered ? std::optional(ReadFailure::kChecksumMismatch) : std::nullopt});
  }
  if (decided.empty()) return;
  const Decided chosen = decided[index % decided.size()];
  Worker& reader = workers_[chosen.reader];
  const StartRead read = reader.reads.at(chosen.transfer);
  reader.reads.erase(chosen.transfer);
  if (chosen.failure) {
    ++coverage_.reads_failed;
    if (*chosen.failure == ReadFailure::kChecksumMismatch) {
      ++coverage_.checksum_failures;
      // Whatever arrived is not the version: never to be reported done, or kept.
      if (read.offload_copy == 0) reader.complete = false;
    }
    reader.failed_reads[read.transfer] = read.epoch;
    agent_step(chosen.reader, ReadFinished{read.transfer, read.epoch, chosen.failure});
    return;
  }
  // Integrity: the source serves under a grant, so its bytes must be the version.
  const Worker& from = workers_[*source_of(read)];
  const bool bytes = read.source.kind == CopyKind::kOffload ? from.offload_copies.contains(read.version)
                                                            : from.content == read.version && from.complete;
  if (!bytes) {
    fail(spec_.replicas[reader.replica].name + "/" + std::to_string(reader.shard) + " read version " +
         std::to_string(read.version) + " from " + read.source.replica + ", whose " +
         (read.source.kind == CopyKind::kOffload ? "offload copy is gone" : "buffers hold another version") +
         " under a grant to read them");
  }
  ++coverage_.reads_done;
  coverage_.pipelined_reads += read.source.partial;
  reader.content = read.version;
  reader.complete = true;
  agent_step(chosen.reader, ReadFinished{read.transfer, read.epoch, std::nullopt});
}

void Cluster::tamper(std::size_t index) {
  std::vector<int> serving;
  for (std::size_t w = 0; w < workers_.size(); ++w) {
    const Worker& worker = workers_[w];
    const bool primary_grant = std::any_of(worker.grants.begin(), worker.grants.end(), [](const auto& entry) {
      return entry.second.kind == CopyKind::kPrimary;
    });
    if (worker.alive && worker.complete && !worker.tampered && primary_grant) serving.push_back(static_cast<int>(w));
  }
  if (serving.empty()) return;
  workers_[serving[index % serving.size()]].tampered = true;
}

void Cluster::make_offload(std::size_t index) {
  std::vector<std::pair<int, std::size_t>> making;
  for (std::size_t w = 0; w < workers_.size(); ++w) {
    if (!workers_[w].alive) continue;
    for (std::size_t i = 0; i < workers_[w].making.size(); ++i) making.emplace_back(static_cast<int>(w), i);
  }
  if (making.empty()) return;
  const auto [w, i] = making[index % making.size()];
  Worker& worker = workers_[w];
  const Version version = worker.making[i];
  worker.making.erase(worker.making.begin() + static_cast<std::ptrdiff_t>(i));
  // The copy is of whatever the buffers hold; the agent keeps it only if that is the version.
  if (worker.content == version && worker.complete) {
    worker.offload_copies.insert(version);
    if (worker.tampered) worker.tampered_offloads.insert(version);  // a copy of the changed bytes
    ++coverage_.offloads;
  }
  agent_step(w, OffloadFinished{version});
}

// ==== Healing ======================================================================================

void Cluster::heal_and_check_liveness() {
  if (lossy_) healed_at_ms_ = now_ms_;
  lossy_ = false;
  deliver_all(kDeliveriesMax);
  constexpr int kQuietRoundsMin = (kCallTimeoutMaxMs + 4 * 1000) / 300 + 1;
  int quiet = 0;
  for (int round = 0; round < kHealRoundsMax && quiet <= kQuietRoundsMin; ++round) {
    const std::uint64_t answers = coverage_.answers;
    const std::size_t reads = coverage_.reads_done + coverage_.reads_failed;
    for (std::uint32_t r = 0; r < runs_.size(); ++r) {
      if (runs_[r].crashed) continue;
      for (std::uint32_t shard = 0; shard < runs_[r].workers.size(); ++shard) {
        step(r, shard);
        deliver_all(kDeliveriesMax);
        restart_finished();
      }
    }
    for (int i = 0; i < 64 && !reads_in_progress().empty(); ++i) {
      finish_read(0, std::nullopt);
      deliver_all(kDeliveriesMax);
    }
    for (int i = 0; i < 64; ++i) {
      bool any = false;
      for (const Worker& worker : workers_) any = any || (worker.alive && !worker.making.empty());
      if (!any) break;
      make_offload(0);
      deliver_all(kDeliveriesMax);
    }
    tick(3 * kSliceMs);
    const bool progress = coverage_.answers != answers ||
                          coverage_.reads_done + coverage_.reads_failed != reads;
    quiet = progress ? 0 : quiet + 1;
  }
  reference_.check_quiescent();
  for (std::size_t w = 0; w < workers_.size(); ++w) {
    const Worker& worker = workers_[w];
    if (!worker.alive || !worker.in_call) continue;
    const ReplicaRun& run = runs_[worker.replica];
    const std::uint64_t next = worker.agent->last_seq();
    const bool may_block = !worker.opening && next < run.program.size() &&
                           (run.program[next].kind == OpKind::kWait ||
                            run.program[next].kind == OpKind::kReplicate) &&
                           run.program[next].timeout_ms == 0;
    if (!may_block) {
      fail("liveness: " + spec_.replicas[worker.replica].name + "/" + std::to_string(worker.shard) +
           "'s " + (worker.opening ? std::string("open") : std::string(op_name(worker.call_kind))) +
           " has not returned after healing (agent " + std::string(agent_phase_name(worker.agent->phase())) +
           ")");
    }
  }
  check_offload_memory();
}

// Healed, every offload copy a live shard keeps in CPU memory is one the server counts for its
// replica, and the other way round: a copy the server does not count is memory nobody ever gives
// back; one it counts that the shard does not have is a copy retention relies on in vain.
void Cluster::check_offload_memory() const {
  for (const Worker& worker : workers_) {
    if (!worker.alive || worker.agent->phase() != AgentPhase::kOpen) continue;
    const FleetSpec::ReplicaSpec& spec = spec_.replicas[worker.replica];
    const std::optional<ListSnapshot> snapshot = hubs_[active_]->snapshot(spec_.models[spec.model].name);
    if (!snapshot) continue;
    const auto listed = std::find_if(snapshot->replicas.begin(), snapshot->replicas.end(), [&](const auto& info) {
      return info.name == spec.name && info.incarnation == worker.agent->incarnation();
    });
    if (listed == snapshot->replicas.end() || listed->state == "resuming") continue;
    const std::set<Version> counted(listed->offloads.begin(), listed->offloads.end());
    if (counted != worker.offload_copies) {
      auto text = [](const std::set<Version>& versions) {
        std::string out;
        for (Version version : versions) out += " v" + std::to_string(version);
        return out.empty() ? std::string(" none") : out;
      };
      fail(spec.name + "/" + std::to_string(worker.shard) + " keeps offload copies of" +
           text(worker.offload_copies) + " after healing, where the server counts" + text(counted));
    }
  }
}

}  // namespace th::test
