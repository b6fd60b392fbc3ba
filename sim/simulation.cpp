#include "sim/simulation.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <deque>
#include <functional>
#include <iostream>
#include <map>
#include <memory>
#include <optional>
#include <queue>
#include <set>
#include <sstream>
#include <unordered_map>
#include <utility>
#include <vector>

#include "core/agent.h"
#include "sim/layouts.h"
#include "sim/observer.h"
#include "sim/trace.h"

namespace th::sim {

namespace {

// ---- Constants of the simulated world ------------------------------------------------------------

constexpr TimeMs kHubTickMs = 100;
constexpr TimeMs kDataTickMs = 5;       // the data plane moves bytes in steps of this much time
constexpr TimeMs kFaultTickMs = 100;    // faults are drawn this often during the safety phase
constexpr TimeMs kBarrierTimeoutMs = 10'000;
constexpr TimeMs kReadTimeoutMs = 1500;  // a reader notices a dead source after this long
// The hub's grant to the source and its instruction to the reader travel separately: a reader whose
// source has no grant yet asks again for this long before it reports the source as refusing.
constexpr TimeMs kGrantGraceMs = 2000;
constexpr double kThrottledBytesPerMs = 2.0;  // a throttled reader's downloads: 2 KB/s
constexpr std::uint64_t kEventsMax = 200'000'000;  // a run that needs more has a bug
constexpr TimeMs kNeverMs = TimeMs{1} << 60;  // a preempted plan replica's "restart"
constexpr TimeMs kRunRestartJitterMs = 2000;  // a restarting run is back this much after the model ended, at most
constexpr int kRunContentStride = 1000;  // content_model: a run's bytes are another model number's

// ---- The fleet -----------------------------------------------------------------------------------

struct Replica {
  int model = 0;
  std::string name;
  std::string datacenter;
  bool spot = false;
  bool trainer = false;
  std::uint32_t num_shards = 1;
  std::optional<Placement> placement;  // the layouts workload: how it places the model's tensors
  Retention retention;
  std::uint64_t incarnation = 1;
  bool crashed = false;
  std::uint64_t restart_token = 0;  // a scheduled restart is valid while this matches
  std::vector<int> workers;
  Version next_version = 1;         // trainers: what a restarted trainer publishes next
  std::optional<Version> final_target;  // trainers, liveness phase: stop once this is published
  // Trainers: its run started again from version 1 (knob run_restart) and has not published yet;
  // the model ended before it came back, so the first publish of its only trainer may not be
  // refused as stale.
  bool fresh_run = false;
  std::vector<ClientId> dead_clients;   // while crashed: the clients its processes had
  std::uint32_t join_batch = 0;         // plan: a spot replica that joins later (0: from the start)
};

// The program of one simulated worker. Trainers publish, (sometimes wait for their rollouts or
// list,) unpublish and train the next version. Rollouts mostly update, and now and then list, wait
// on every kind of predicate, or drop their copy and replicate again with every kind of selector.
// The application keeps what the answers told it: which version its buffers hold (the checker
// compares the bytes with that, not with the agent's view), and the newest version it heard of.
struct App {
  enum class Next : std::uint8_t { kOpen, kPublish, kQuery, kUnpublish, kUpdate, kReplicate, kDone };
  Next next = Next::kOpen;
  bool in_call = false;
  std::uint64_t call_id = 0;
  TimeMs call_started_ms = 0;
  std::uint64_t seq_before = 0;      // the agent's last answered call when this one started
  std::string call_name;
  OpKind call_kind = OpKind::kList;  // of the call in flight (an open is kList here)
  bool call_writes = false;          // the call in flight may write the buffers (replicate/update)
  std::uint64_t wake_token = 0;
  Version version = 0;               // trainers: the version being published
  // What the answers said the buffers hold (none: nothing); unknown after a call that failed
  // while it may have been writing them, until an answer says again.
  std::optional<Version> told;
  bool told_known = true;
  Version known_latest = 0;          // the newest version any answer named
  Selector replicate_selector;       // rollouts, kReplicate: after dropping their copy
  TimeMs replicate_timeout_ms = 0;
  bool waiting_for_peers = false;    // the collective after the last call has not completed
  std::optional<Version> final_target;  // liveness: a trainer stops once it published this
  // A plan's rollout: the next version is out (update now), and the update time spent on it so far.
  bool plan_version_out = false;
  TimeMs plan_stall_ms = 0;
};

// A number every shard of a replica computes alike at the same place of its program (SPMD), to
// choose the next call from: a mix of the replica, the incarnation its processes started as (not
// the agents' own, which an eviction advances), the program's start and the call number.
std::uint64_t program_choice(int replica, std::uint64_t incarnation, std::uint64_t starts,
                             std::uint64_t seq) {
  std::uint64_t x = static_cast<std::uint64_t>(replica) * 0x9E3779B97F4A7C15ULL ^
                    incarnation * 0xBF58476D1CE4E5B9ULL ^ starts * 0x94D049BB133111EBULL ^ seq;
  x ^= x >> 31;
  x *= 0xD6E8FEB86659FD93ULL;
  x ^= x >> 32;
  return x;
}

struct Worker {
  int replica = 0;
  std::uint32_t shard = 0;
  bool alive = false;
  std::unique_ptr<ShardAgent> agent;
  ClientId client = 0;
  std::uint64_t agent_wake_token = 0;
  TimeMs agent_wake_at = -1;
  std::int64_t skew_ppm = 0;
  TimeMs clock_offset_ms = 0;
  TimeMs local_last_ms = 0;
  // What its buffers hold for each version (its layout: the layouts workload's placements, or the
  // other workloads' two tensors), and their size as modelled for the data plane's timing.
  std::shared_ptr<const ShardContent> content;
  std::uint64_t modelled_bytes = 0;
  // The process's memory: registered buffers, offload copies, data-server grants.
  std::vector<std::uint8_t> buffer;
  std::optional<Version> buffer_version;  // what the first buffer_bytes (modelled) hold
  std::uint64_t buffer_bytes = 0;
  std::map<Version, std::vector<std::uint8_t>> offloads;
  // The newest id the agent's current session heard for each version's offload copy (an Offload,
  // or a seed's StartRead), until the copy of that version is freed: a release naming it must free
  // the copy at once (see check_release_obeyed).
  std::map<Version, std::uint64_t> offload_names;
  std::uint64_t offload_names_session = 0;
  std::map<std::pair<TransferId, std::uint32_t>, ServeRead> grants;
  // Bytes a fault changed (knobs corrupt and tamper), until the buffer is written anew. Corrupt:
  // it may hold bytes that are not its version's, which a fault put there (a bit flipped on the
  // way in, or a tampered source's bytes read in): served on, they fail their readers' checksums,
  // and no reader may ever keep them. Tampered: the fault changed this process's own buffers
  // under a version they held, so its application is not to blame for holding them.
  bool buffer_corrupt = false;
  bool buffer_tampered = false;
  std::set<Version> offloads_corrupt;
  // Delta versions (knob patch): the patch its buffers' version came with (it published or
  // applied it), kept in host memory apart from the buffers, as a real client keeps it.
  struct Patch {
    Version version = 0;
    Version base = 0;
    Checksums base_checksums;  // of the base's tensors: a reader holding other bytes is refused
    std::vector<std::uint64_t> tensor_bytes;  // announced per tensor (0: read whole), real scale
    std::vector<std::pair<std::size_t, std::uint8_t>> changes;  // offset, new byte
  };
  std::optional<Patch> patch;
  // The last read of each transfer that finished, as the data plane ended it: what a TransferDone
  // report of the agent's is about (see check_done_report).
  struct FinishedRead {
    std::uint32_t epoch = 0;
    Version version = 0;
    bool seed = false;
  };
  std::map<TransferId, FinishedRead> finished_reads;
  // A read of the buffers that ended short (failed, cancelled, or replaced by another source):
  // as a real client does (client/data_path.cpp), the next read of the same transfer and version
  // goes on after the prefix that arrived, if it is still the version's.
  struct Resumable {
    TransferId transfer = 0;
    Version version = 0;
    double progress = 0;     // modelled bytes
    std::size_t copied = 0;  // real bytes
  };
  std::optional<Resumable> resumable;
  // The host and its network.
  bool straggler = false;
  bool throttled = false;  // its downloads crawl at kThrottledBytesPerMs while faults are on
  double nic_factor = 1;      // plan: this GPU's share of its NIC rate (nic_jitter)
  std::uint32_t node = 0;     // the machine it runs on (its NIC across datacenters is shared)
  TimeMs clogged_until = 0;
  TimeMs cut_up_until = 0;    // messages to the server are lost
  TimeMs cut_down_until = 0;  // messages from the server are lost
  bool server_lost_pending = false;
  App app;
};

struct Flow {
  int reader = 0;
  int source = 0;
  StartRead read;
  double progress = 0;     // modelled bytes
  std::size_t copied = 0;  // real bytes
  bool remote = false;
  TimeMs started_ms = 0;
  TimeMs fail_at = -1;     // the reader gives up on the source then
  bool granted = false;    // the source had a grant for this read (a missing one is then revoked)
  ReadFailure fail_reason = ReadFailure::kSourceUnreachable;
  double fail_at_progress = -1;  // an injected failure once this much has moved
  // A bit flipped on the way (knob corrupt): the real byte at this offset, this bit (of all the
  // bytes a read across layouts reads).
  std::optional<std::pair<std::size_t, int>> flip;
  double total = 0;        // modelled bytes to move
  bool progress_reported = false;  // ReadProgress fed to the reader's agent (once a flow)
  double resumed_from = 0;         // modelled bytes an earlier read of the transfer left (resume)
  // A read from a source of another layout (StartRead::reshard): its plan, the process serving
  // each source shard (-1: none runs), those that had a grant, and the pieces landed so far.
  std::shared_ptr<const ReshardRead> reshard;
  std::vector<int> sources;
  std::vector<bool> granted_shards;
  std::size_t landed = 0;
};

// ---- Events --------------------------------------------------------------------------------------

enum class EventKind : std::uint8_t {
  kToServer,
  kToWorker,
  kAgentWake,
  kAppWake,
  kDataTick,
  kHubTick,
  kFaultTick,
  kRestart,
  kDivergence,
  kEvictionDue,
  kServerLost,
  kOffloadCopied,
  kHeal,
  kAppCancel,
  kEnd,
};

struct Event {
  Event() = default;
  explicit Event(EventKind kind_, int a_ = 0, std::uint64_t token_ = 0, std::uint32_t server_ = 0)
      : kind(kind_), a(a_), token(token_), server(server_) {}

  EventKind kind = EventKind::kEnd;
  int a = 0;                 // worker, server or replica
  std::uint64_t token = 0;   // staleness check for wakes and restarts; version for offloads
  std::uint32_t server = 0;
  std::variant<std::monostate, Request, Report, ConnectionLost, Effect> message;
};

struct HeapKey {
  TimeMs at;
  std::uint64_t seq;
  std::uint32_t slot;
  friend bool operator>(const HeapKey& a, const HeapKey& b) {
    return a.at != b.at ? a.at > b.at : a.seq > b.seq;
  }
};

class Violation : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// ---- The simulation ------------------------------------------------------------------------------

class Simulation {
 public:
  explicit Simulation(const SimOptions& options)
      : options_(options),
        knobs_(options.knobs),
        rng_(options.seed ^ 0x5DEECE66DULL),
        trace_(!options.trace_path.empty()),
        observer_(knobs_.fanout, knobs_.model_grace_ms),
        plan_(options_.plan ? &*options_.plan : nullptr) {
    HubSettings settings;
    settings.heartbeat_timeout_ms = knobs_.heartbeat_timeout_ms;
    settings.barrier_timeout_ms = kBarrierTimeoutMs;
    settings.pipeline = knobs_.pipeline;
    settings.fanout_max = knobs_.fanout;
    settings.smart_skipping = knobs_.smart_skipping;
    settings.rate_aware_sources = knobs_.rate_aware_sources;
    settings.offload_seeding = knobs_.offload_seeding;
    settings.drain_grace_ms = knobs_.drain_grace_ms;
    settings.model_grace_ms = knobs_.model_grace_ms;
    for (auto& server : servers_) {
      server = std::make_unique<Hub>(settings);
    }
  }

  SimResult run() {
    try {
      if (plan_ != nullptr) {
        TH_ASSERT(plan_->versions >= 1 && plan_->gpus_per_node >= 1 && plan_->check_every >= 1);
        TH_ASSERT(knobs_.models == 1, "a plan is of one model");
        faults_on_ = false;  // a plan measures; it injects nothing (the knobs' faults are unused)
      }
      build_fleet();
      if (plan_ != nullptr) {
        // The bound: every version's cycle, then the liveness phase for the last transfers.
        schedule(static_cast<TimeMs>(plan_->versions) * (plan_->hold_ms + plan_->train_ms) +
                     knobs_.liveness_ms,
                 Event(EventKind::kEnd));
      } else {
        schedule(knobs_.safety_ms, Event(EventKind::kHeal));
        schedule(knobs_.safety_ms + knobs_.liveness_ms, Event(EventKind::kEnd));
        schedule(kFaultTickMs, Event(EventKind::kFaultTick));
      }
      schedule(kHubTickMs, Event(EventKind::kHubTick, 0));
      schedule(kHubTickMs, Event(EventKind::kHubTick, 1));
      if (knobs_.server_crash && plan_ == nullptr) {
        server_crash_at_ = knobs_.safety_ms / 5 + rng_.range(0, knobs_.safety_ms / 2);
      }
      if (knobs_.preemption_storm && plan_ == nullptr) {
        storm_at_ = knobs_.safety_ms / 5 + rng_.range(0, knobs_.safety_ms / 2);
      }
      // (Drawn only where the knob is on: other seeds draw what they drew before it existed.) The
      // run's replicas must be back before the faults heal, which restarts every stopped replica.
      const TimeMs run_stopped_max_ms = run_stopped_ms() + kRunRestartJitterMs;
      if (knobs_.run_restart && plan_ == nullptr && knobs_.safety_ms - knobs_.safety_ms / 5 > run_stopped_max_ms) {
        run_restart_at_ = knobs_.safety_ms / 5 + rng_.range(0, knobs_.safety_ms - knobs_.safety_ms / 5 - run_stopped_max_ms);
      }
      while (!heap_.empty() && !finished_) {
        const HeapKey key = heap_.top();
        heap_.pop();
        Event event = std::move(slab_[key.slot]);
        free_.push_back(key.slot);
        now_ = key.at;
        ++result_.events;
        if (result_.events > kEventsMax) throw Violation("the run does not end (event limit)");
        trace_.mix(static_cast<std::uint64_t>(now_));
        trace_.mix(static_cast<std::uint64_t>(event.kind) << 32 | static_cast<std::uint32_t>(event.a));
        dispatch(event);
      }
    } catch (const Violation& violation) {
      fail(violation.what());
    } catch (const std::exception& failure) {
      fail(std::string("assertion: ") + failure.what());
    }
    result_.virtual_ms = now_;
    for (const auto& server : servers_) {
      result_.models_ended += server->stats().models_forgotten;
      result_.readers_put_ahead += server->stats().transfers_displaced;
      result_.readers_passed_mid_read += server->stats().passed_mid_read;
      result_.slow_sources_passed += server->stats().slow_sources_passed;
    }
    result_.trace_hash = trace_.hash();
    if (plan_ != nullptr) {
      result_.plan.replicas.reserve(replicas_.size());
      for (std::size_t r = 0; r < replicas_.size(); ++r) {
        result_.plan.replicas.push_back(
            {replicas_[r].name, replicas_[r].datacenter, replicas_[r].trainer, replicas_[r].spot});
      }
      result_.plan.gpu_nodes.reserve(workers_.size());
      for (const Worker& worker : workers_) result_.plan.gpu_nodes.push_back(worker.node);
    }
    if (!options_.trace_path.empty()) {
      const Status written = trace_.write(options_.trace_path);
      if (!written.ok() && result_.ok) fail(written.error().detail);
    }
    return result_;
  }

 private:
  // ---- events ----

  void schedule(TimeMs at, Event event) {
    TH_ASSERT(at >= now_, "events are not scheduled in the past");
    std::uint32_t slot;
    if (!free_.empty()) {
      slot = free_.back();
      free_.pop_back();
      slab_[slot] = std::move(event);
    } else {
      slot = static_cast<std::uint32_t>(slab_.size());
      slab_.push_back(std::move(event));
    }
    heap_.push(HeapKey{at, next_seq_++, slot});
  }

  void dispatch(Event& event) {
    switch (event.kind) {
      case EventKind::kToServer: deliver_to_server(event); break;
      case EventKind::kToWorker: deliver_to_worker(event); break;
      case EventKind::kAgentWake:
        if (alive(event.a) && workers_[event.a].agent_wake_token == event.token) {
          workers_[event.a].agent_wake_at = -1;
          agent_step(event.a, AgentTick{});
        }
        break;
      case EventKind::kAppWake:
        if (alive(event.a) && workers_[event.a].app.wake_token == event.token) app_act(event.a);
        break;
      case EventKind::kAppCancel:
        // The application gives up on its call, if it is still the one in flight.
        if (alive(event.a) && workers_[event.a].app.in_call && workers_[event.a].app.call_id == event.token) {
          if (logged(workers_[event.a].client)) {
            std::cerr << now_ << " app c" << workers_[event.a].client << " cancels " << workers_[event.a].app.call_name << "\n";
          }
          agent_step(event.a, UserCancel{event.token});
        }
        break;
      case EventKind::kDataTick: data_tick(); break;
      case EventKind::kHubTick:
        if (servers_alive_[event.a]) {
          hub_step(event.a, Tick{});
          schedule(now_ + kHubTickMs, Event(EventKind::kHubTick, event.a));
        }
        break;
      case EventKind::kFaultTick: fault_tick(); break;
      case EventKind::kRestart:
        if (replicas_[event.a].crashed && replicas_[event.a].restart_token == event.token) {
          restart(event.a);
        }
        break;
      case EventKind::kDivergence:
        if (!replicas_[event.a].crashed) {
          ++result_.divergence_restarts;
          crash(event.a, rng_.range(200, 1000), /*fault=*/false);
        }
        break;
      case EventKind::kEvictionDue:
        if (replicas_[event.a].crashed && replicas_[event.a].restart_token == event.token) {
          check_evicted(event.a);
        }
        break;
      case EventKind::kServerLost:
        workers_[event.a].server_lost_pending = false;
        if (alive(event.a)) agent_step(event.a, ServerLost{event.server});
        break;
      case EventKind::kOffloadCopied: offload_copied(event.a, event.token); break;
      case EventKind::kHeal: heal(); break;
      case EventKind::kEnd:
        check_liveness();
        finished_ = true;
        break;
    }
  }

  // ---- the fleet ----

  void build_fleet() {
    trace_.lane(0, "servers and phases");  // the failover, the healing of faults
    for (std::uint32_t m = 0; m < knobs_.models; ++m) {
      const std::string model = "m" + std::to_string(m);
      models_.push_back(model);
      for (std::uint32_t t = 0; t < knobs_.trainers; ++t) {
        Replica replica;
        replica.model = static_cast<int>(m);
        replica.name = model + "-trainer" + std::to_string(t);
        replica.datacenter = "dc0";
        replica.trainer = true;
        replica.placement = knobs_.trainer_placement;
        if (plan_ != nullptr) replica.final_target = plan_->versions;
        // Trainers keep what rollouts follow: latest-k when they lag by k, else latest or nothing.
        if (knobs_.off_by > 0) {
          replica.retention.keep_latest = knobs_.off_by;
        } else if (plan_ == nullptr && rng_.chance(0.6)) {
          replica.retention.keep_latest = static_cast<std::uint64_t>(rng_.range(0, 1));
        }
        add_replica(std::move(replica));
      }
      for (std::uint32_t r = 0; r < knobs_.rollouts; ++r) {
        Replica replica;
        replica.model = static_cast<int>(m);
        replica.name = model + "-rollout" + std::to_string(r);
        replica.spot = r < knobs_.spot_rollouts;
        if (r < knobs_.rollout_placements.size()) replica.placement = knobs_.rollout_placements[r];
        replica.datacenter =
            r >= knobs_.rollouts - knobs_.remote_rollouts
                ? "dc" + std::to_string(1 + r % knobs_.remote_datacenters)
                : "dc0";
        if (plan_ != nullptr && replica.spot && plan_->spot_join_every > 0) {
          replica.join_batch = 1 + r / std::max<std::uint32_t>(1, plan_->spot_join_batch);
        }
        add_replica(std::move(replica));
      }
    }
  }

  void add_replica(Replica replica) {
    const int index = static_cast<int>(replicas_.size());
    // Machines: a replica's shards fill GPUs in order; a new role or datacenter takes a new machine.
    const std::uint32_t gpus_per_node = plan_ != nullptr ? plan_->gpus_per_node : 1;
    if (!replicas_.empty() && (replicas_.back().trainer != replica.trainer ||
                               replicas_.back().datacenter != replica.datacenter)) {
      gpus_placed_ = (gpus_placed_ + gpus_per_node - 1) / gpus_per_node * gpus_per_node;
    }
    replica_index_.emplace(replica.name, index);
    replica.num_shards = replica.placement ? replica.placement->shards : knobs_.shards;
    // Modelled sizes scale with the real buffers: knobs_.shard_bytes is a shard of the other
    // workloads, and all of the model in bfloat16 in the layouts workload (a TP=8 shard an eighth
    // of it), so that reading whole pieces across layouts stays within the liveness bound.
    const std::uint64_t reference_bytes =
        knobs_.trainer_placement ? model_bytes() : ShardContent::plain(0)->size();
    for (std::uint32_t shard = 0; shard < replica.num_shards; ++shard) {
      Worker worker;
      worker.replica = index;
      worker.shard = shard;
      const std::uint32_t period = change_period();
      worker.content = replica.placement ? ShardContent::placed(*replica.placement, shard, period)
                                         : ShardContent::plain(shard, period);
      worker.modelled_bytes = knobs_.shard_bytes * worker.content->size() / reference_bytes;
      worker.node = gpus_placed_++ / gpus_per_node;
      if (plan_ != nullptr) worker.nic_factor = plan_nic_factor(options_.seed, workers_.size(), plan_->nic_jitter);
      worker.straggler = rng_.chance(knobs_.straggler_fraction);
      // (Drawn only where the knob is on: seeds without throttling draw what they drew before.)
      worker.throttled = knobs_.throttle_fraction > 0 && !replica.trainer && rng_.chance(knobs_.throttle_fraction);
      worker.skew_ppm = knobs_.clock_skew_ppm == 0 ? 0 : rng_.range(-knobs_.clock_skew_ppm, knobs_.clock_skew_ppm);
      worker.clock_offset_ms = rng_.range(0, 100'000);
      replica.workers.push_back(static_cast<int>(workers_.size()));
      const int lane = static_cast<int>(workers_.size()) + 1;
      trace_.lane(lane, replica.name + "/" + std::to_string(shard) + " (" +
                            (replica.trainer ? "trainer" : replica.spot ? "spot rollout" : "rollout") +
                            ", " + replica.datacenter + ")");
      workers_.push_back(std::move(worker));
    }
    nodes_ = std::max(nodes_, (gpus_placed_ + gpus_per_node - 1) / gpus_per_node);
    const bool joins_later = replica.join_batch > 0;
    replicas_.push_back(std::move(replica));
    if (plan_ != nullptr) {
      if (!joins_later) start_replica(index, 0);  // a plan starts everyone together (a burst)
      return;
    }
    start_replica(index, rng_.range(0, 2000));
  }

  void start_replica(int index, TimeMs delay_ms) {
    for (int w : replicas_[index].workers) {
      start_worker(w, delay_ms + (plan_ != nullptr ? 0 : rng_.range(0, 200)));
    }
  }

  // A new process for the worker: a fresh agent (under a new client id) and a fresh program.
  void start_worker(int w, TimeMs delay_ms) {
    Worker& worker = workers_[w];
    const Replica& replica = replicas_[worker.replica];
    AgentConfig config;
    config.client = next_client_++;
    config.servers = 2;
    config.heartbeat_interval_ms = std::max<TimeMs>(250, knobs_.heartbeat_timeout_ms / 4);
    config.retry_initial_ms = 200;
    config.retry_max_ms = 2000;
    worker.agent = std::make_unique<ShardAgent>(config);
    worker.client = config.client;
    clients_[config.client] = w;
    worker.alive = true;
    worker.agent_wake_at = -1;
    worker.buffer.assign(worker.content->size(), 0);
    worker.buffer_version.reset();
    worker.buffer_bytes = 0;
    worker.buffer_corrupt = worker.buffer_tampered = false;
    worker.offloads.clear();
    worker.offloads_corrupt.clear();
    worker.finished_reads.clear();
    worker.resumable.reset();
    worker.grants.clear();
    worker.server_lost_pending = false;
    worker.app = App{};
    if (replica.trainer) worker.app.version = replica.next_version;
    worker.app.final_target = replica.final_target;
    if (!servers_alive_[0]) lose_server(w);  // it starts after the failover: its first try fails
    wake_app(w, delay_ms);
  }

  bool alive(int w) const { return workers_[w].alive; }
  Replica& replica_of(int w) { return replicas_[workers_[w].replica]; }

  // The hub told this shard that readers found its copy corrupt (issue 33, friction 1). Told
  // wrongly, an application would hunt for a writer that is not there: only a replica that held
  // bytes other than the version's (a fault put them there), or whose copy two reads broke on the
  // way out of (bit flips the readers cannot tell from bad bytes at the source), may be told.
  void check_corrupt_notice(int w, const CopyFoundCorrupt& notice) {
    const std::pair<std::string, Version> key{replica_of(w).name, notice.version};
    const auto flipped = flipped_reads_of_.find(key);
    const std::uint64_t flips = flipped == flipped_reads_of_.end() ? 0 : flipped->second;
    if (!held_bad_bytes_.contains(key) && flips < 2) {
      throw Violation("integrity: " + key.first + "/" + std::to_string(workers_[w].shard) +
                      " was told its " + (notice.offload ? "offload copy" : "copy") + " of version " +
                      std::to_string(notice.version) +
                      " failed readers' checksums, but it never held other bytes than the version's and " +
                      std::to_string(flips) + " read(s) of it broke on the way");
    }
    ++result_.corrupt_notices;
  }

  TimeMs local_now(const Worker& worker) const {
    return worker.clock_offset_ms + now_ + now_ * worker.skew_ppm / 1'000'000;
  }
  TimeMs global_at(const Worker& worker, TimeMs local) const {
    // The inverse of local_now, rounded up so that the deadline has passed on arrival.
    const TimeMs relative = local - worker.clock_offset_ms;
    const TimeMs at = (relative * 1'000'000 + (1'000'000 + worker.skew_ppm) - 1) / (1'000'000 + worker.skew_ppm);
    return std::max(at, now_);
  }

  // ---- the agent ----

  void agent_step(int w, const AgentInput& input) {
    Worker& worker = workers_[w];
    TH_ASSERT(worker.alive && worker.agent);
    agent_effects_.clear();
    const TimeMs local = std::max(local_now(worker), worker.local_last_ms);
    worker.local_last_ms = local;
    const auto place_before = place(worker);
    worker.agent->step(input, local, agent_effects_);
    if (place(worker) != place_before) {
      wake_waiting_peers(w);
      // The agent started over on its own (told its replica diverged while no call was in flight):
      // its program is out of step with itself, and its framework restarts the replica.
      if (place_before.first > 0 && place(worker).first > place_before.first) {
        schedule(now_, Event(EventKind::kDivergence, worker.replica));
      }
    }
    // Handling an effect may step the agent again (a completed call starts the next one).
    const AgentEffects effects = std::move(agent_effects_);
    for (const AgentEffect& effect : effects) {
      if (!worker.alive) break;
      handle_agent_effect(w, effect);
    }
    if (worker.alive) schedule_agent_wake(w);
  }

  void schedule_agent_wake(int w) {
    Worker& worker = workers_[w];
    const std::optional<TimeMs> deadline = worker.agent->next_deadline_ms();
    if (!deadline) return;
    const TimeMs at = global_at(worker, *deadline);
    if (worker.agent_wake_at != -1 && worker.agent_wake_at <= at) return;
    worker.agent_wake_at = at;
    schedule(at, Event(EventKind::kAgentWake, w, ++worker.agent_wake_token));
  }

  void handle_agent_effect(int w, const AgentEffect& effect) {
    Worker& worker = workers_[w];
    if (logged(worker.client)) log_memory_effect(worker, effect);
    std::visit(
        [&](const auto& e) {
          using T = std::decay_t<decltype(e)>;
          if constexpr (std::is_same_v<T, SendRequest>) {
            send_to_server(w, e.server, e.request);
          } else if constexpr (std::is_same_v<T, SendReport>) {
            check_report(w, e.report.body);
            send_to_server(w, e.server, e.report);
          } else if constexpr (std::is_same_v<T, BeginRead>) {
            begin_read(w, e.read);
          } else if constexpr (std::is_same_v<T, CancelRead>) {
            if (auto flow = flows_.find({w, e.transfer}); flow != flows_.end()) {
              keep_for_resume(flow->second);
              flows_.erase(flow);
            }
          } else if constexpr (std::is_same_v<T, GrantServe>) {
            worker.grants[{e.grant.transfer, e.grant.epoch}] = e.grant;
          } else if constexpr (std::is_same_v<T, RevokeServe>) {
            worker.grants.erase({e.transfer, e.epoch});
          } else if constexpr (std::is_same_v<T, MakeOffload>) {
            schedule(now_ + rng_.range(20, 200), Event(EventKind::kOffloadCopied, w, e.version));
          } else if constexpr (std::is_same_v<T, FreeOffload>) {
            worker.offloads.erase(e.version);
            worker.offload_names.erase(e.version);
            worker.offloads_corrupt.erase(e.version);
          } else if constexpr (std::is_same_v<T, CopyFoundCorrupt>) {
            check_corrupt_notice(w, e);
          } else {
            static_assert(std::is_same_v<T, CallDone>);
            call_done(w, e);
          }
        },
        effect);
  }

  // ---- the network ----

  template <typename Payload>
  void send_to_server(int w, std::uint32_t server, const Payload& payload) {
    Worker& worker = workers_[w];
    ++result_.messages;
    if (!servers_alive_[server]) {
      lose_server(w);  // connection refused: the transport tells the agent after a while
      return;
    }
    if (faults_on_ && (now_ < worker.cut_up_until || rng_.chance(knobs_.drop))) {
      ++result_.messages_lost;
      return;
    }
    const int copies = faults_on_ && rng_.chance(knobs_.duplicate) ? 2 : 1;
    for (int i = 0; i < copies; ++i) {
      Event event(EventKind::kToServer, static_cast<int>(server), 0, server);
      event.message = payload;
      schedule(now_ + delay(worker), std::move(event));
    }
  }

  void send_to_worker(std::uint32_t server, const Effect& effect) {
    auto found = clients_.find(effect.client);
    if (found == clients_.end()) return;
    const int w = found->second;
    Worker& worker = workers_[w];
    ++result_.messages;
    if (!worker.alive || worker.client != effect.client) return;  // a process that is gone
    if (faults_on_ && (now_ < worker.cut_down_until || rng_.chance(knobs_.drop))) {
      ++result_.messages_lost;
      return;
    }
    const int copies = faults_on_ && rng_.chance(knobs_.duplicate) ? 2 : 1;
    for (int i = 0; i < copies; ++i) {
      Event event(EventKind::kToWorker, w, effect.client, server);
      event.message = effect;
      schedule(now_ + delay(worker), std::move(event));
    }
    // A stale copy: it arrives after the instructions sent since (drawn only where the knob is on,
    // so that seeds without it run as they did before it existed).
    if (faults_on_ && knobs_.stale > 0 && rng_.chance(knobs_.stale)) {
      Event event(EventKind::kToWorker, w, effect.client, server);
      event.message = effect;
      schedule(now_ + delay(worker) + rng_.range(500, 8000), std::move(event));
      ++result_.stale_messages;
    }
  }

  TimeMs delay(const Worker& worker) {
    TimeMs delay = knobs_.delay_min_ms + static_cast<TimeMs>(rng_.below(2 * knobs_.delay_mean_ms + 1));
    if (faults_on_ && worker.clogged_until > now_) delay += worker.clogged_until - now_;
    return delay;
  }

  void lose_server(int w) {
    Worker& worker = workers_[w];
    if (worker.server_lost_pending) return;
    worker.server_lost_pending = true;
    schedule(now_ + rng_.range(200, 2000), Event(EventKind::kServerLost, w, 0, 0));
  }

  void deliver_to_worker(Event& event) {
    const int w = event.a;
    Worker& worker = workers_[w];
    if (!worker.alive || worker.client != event.token) return;
    const Effect& effect = std::get<Effect>(event.message);
    if (const auto* evicted = std::get_if<Evicted>(&effect.message)) {
      trace_.instant(w + 1, std::string("evicted: ") + std::string(errc_name(evicted->reason)),
                     "failure", now_);
    }
    const bool read_by_agent = reads_message(worker, event.server, effect);
    const std::optional<Version> must_free = read_by_agent ? release_due(worker, effect) : std::nullopt;
    agent_step(w, FromHub{event.server, effect});
    if (must_free && worker.offloads.contains(*must_free)) {
      fail("retention: " + replicas_[worker.replica].name + "/" + std::to_string(worker.shard) +
           " keeps its offload copy of v" + std::to_string(*must_free) + " after a release under copy id " +
           std::to_string(std::get<ReleaseOffload>(effect.message).copy) +
           ", the id its server last gave that copy");
    }
    if (read_by_agent) record_offload_name(worker, effect);
  }

  // A shard's offload copy carries the newest id its server gave it this session (ids grow; an
  // older one in a late Offload is stale): a release under that id frees the copy at once. One the
  // shard ignores is memory the server no longer counts, kept until the shard's next report of it
  // is answered, or for ever where that answer renames rather than releases.
  bool reads_message(Worker& worker, std::uint32_t server, const Effect& effect) {
    const ShardAgent& agent = *worker.agent;
    if (server != agent.server() || effect.session != agent.session() ||
        (agent.phase() != AgentPhase::kOpening && agent.phase() != AgentPhase::kOpen)) {
      return false;  // the agent drops it unread
    }
    if (std::exchange(worker.offload_names_session, agent.session()) != agent.session()) {
      worker.offload_names.clear();  // a new session's server names the copies anew
    }
    return true;
  }

  // The version whose offload copy a release must free: one the process holds, named by the
  // release as its server last named it.
  static std::optional<Version> release_due(const Worker& worker, const Effect& effect) {
    const auto* release = std::get_if<ReleaseOffload>(&effect.message);
    if (release == nullptr || !worker.offloads.contains(release->version)) return std::nullopt;
    const auto named = worker.offload_names.find(release->version);
    if (named == worker.offload_names.end() || named->second != release->copy) return std::nullopt;
    return release->version;
  }

  // After the agent's step: a copy freed in it (FreeOffload) is no longer named, the one it names
  // now is.
  static void record_offload_name(Worker& worker, const Effect& effect) {
    auto name = [&](Version version, std::uint64_t copy) {
      std::uint64_t& newest = worker.offload_names[version];
      newest = std::max(newest, copy);
    };
    if (const auto* offload = std::get_if<Offload>(&effect.message)) {
      name(offload->version, offload->copy);
    } else if (const auto* read = std::get_if<StartRead>(&effect.message); read && read->offload_copy != 0) {
      name(read->version, read->offload_copy);
    }
  }

  // ---- the servers ----

  void deliver_to_server(Event& event) {
    const int server = event.a;
    if (!servers_alive_[server]) return;
    std::visit(
        [&](auto& message) {
          using T = std::decay_t<decltype(message)>;
          const bool active = server == (servers_alive_[0] ? 0 : 1);
          if constexpr (std::is_same_v<T, Request>) {
            trace_.mix(message.client * 1000003 + message.seq);
            if (!active) {
            } else if (const auto* open = std::get_if<OpenRequest>(&message.body)) {
              observer_.on_open(message.client, message.seq, message.session, *open);
            } else {
              observer_.on_call(message.client, message.seq, message.body);
            }
            hub_step(server, message);
          } else if constexpr (std::is_same_v<T, Report>) {
            if (active) observer_.on_report(message.client, message.body);
            hub_step(server, message);
          } else if constexpr (std::is_same_v<T, ConnectionLost>) {
            hub_step(server, message);
          }
        },
        event.message);
  }

  // TH_SIM_LOG=<replica>[,<replica>…] prints the hub's traffic with those replicas' clients.
  bool logged(ClientId client) const {
    static const char* names = std::getenv("TH_SIM_LOG");
    if (names == nullptr) return false;
    auto found = clients_.find(client);
    if (found == clients_.end()) return false;
    const std::string& name = replicas_[workers_[found->second].replica].name;
    const std::string list = std::string(",") + names + ",";
    return list.find("," + name + ",") != std::string::npos;
  }

  // What an agent does to its process's memory (TH_SIM_LOG): reads begun and cancelled, offload
  // copies made and freed.
  void log_memory_effect(const Worker& worker, const AgentEffect& effect) const {
    if (const auto* begin = std::get_if<BeginRead>(&effect)) {
      std::cerr << now_ << " c" << worker.client << " begins read t" << begin->read.transfer << "/"
                << begin->read.epoch << " v" << begin->read.version
                << (begin->read.offload_copy != 0 ? " into seed copy " + std::to_string(begin->read.offload_copy) : "")
                << "\n";
    } else if (const auto* cancel = std::get_if<CancelRead>(&effect)) {
      std::cerr << now_ << " c" << worker.client << " cancels read t" << cancel->transfer << "\n";
    } else if (const auto* make = std::get_if<MakeOffload>(&effect)) {
      std::cerr << now_ << " c" << worker.client << " makes an offload copy of v" << make->version << "\n";
    } else if (const auto* free = std::get_if<FreeOffload>(&effect)) {
      std::cerr << now_ << " c" << worker.client << " frees its offload copy of v" << free->version << "\n";
    }
  }

  void log_input(int server, const Input& input) const {
    if (const auto* request = std::get_if<Request>(&input); request && logged(request->client)) {
      std::cerr << now_ << " s" << server << " <- c" << request->client << " #" << request->seq
                << " session " << request->session << " "
                << (std::holds_alternative<OpenRequest>(request->body)
                        ? std::string(std::get<OpenRequest>(request->body).resume ? "open (resume)"
                                                                                  : "open")
                        : std::string(op_name(op_kind(request->body))))
                << "\n";
    } else if (const auto* report = std::get_if<Report>(&input); report && logged(report->client)) {
      if (!std::holds_alternative<Heartbeat>(report->body)) {
        std::cerr << now_ << " s" << server << " <- c" << report->client << " report "
                  << report->body.index();
        if (const auto* done = std::get_if<OffloadDone>(&report->body)) {
          std::cerr << " offload-done v" << done->version << "/" << done->copy;
        } else if (const auto* finished = std::get_if<TransferDone>(&report->body)) {
          std::cerr << " transfer-done t" << finished->transfer << "/" << finished->epoch;
        } else if (const auto* failed = std::get_if<TransferFailed>(&report->body)) {
          std::cerr << " transfer-failed t" << failed->transfer << "/" << failed->epoch;
        } else if (const auto* progress = std::get_if<TransferProgress>(&report->body)) {
          std::cerr << " transfer-progress t" << progress->transfer << "/" << progress->epoch << " " << progress->bytes
                    << " bytes";
        }
        std::cerr << "\n";
      }
    }
  }

  void log_effect(int server, const Effect& effect) const {
    if (!logged(effect.client)) return;
    std::cerr << now_ << " s" << server << " -> c" << effect.client << " session " << effect.session
              << " message " << effect.message.index();
    if (const auto* read = std::get_if<StartRead>(&effect.message)) {
      std::cerr << " start-read t" << read->transfer << "/" << read->epoch << " v" << read->version
                << " from " << read->source.replica << " (" << read->source.datacenter << ")"
                << (read->source.kind == CopyKind::kOffload ? " offload copy" : "")
                << (read->source.partial ? " partial" : "")
                << (read->reshard.empty() ? "" : " across layouts, " + std::to_string(read->reshard.size()) + " shards");
    }
    if (const auto* serve = std::get_if<ServeRead>(&effect.message)) {
      std::cerr << " serve t" << serve->transfer << "/" << serve->epoch << " v" << serve->version
                << (serve->kind == CopyKind::kOffload ? " (offload)" : "");
    }
    if (const auto* stop = std::get_if<StopServing>(&effect.message)) {
      std::cerr << " stop-serving t" << stop->transfer << "/" << stop->epoch;
    }
    if (const auto* offload = std::get_if<Offload>(&effect.message)) {
      std::cerr << " offload v" << offload->version << "/" << offload->copy;
    }
    if (const auto* release = std::get_if<ReleaseOffload>(&effect.message)) {
      std::cerr << " release-offload v" << release->version << "/" << release->copy;
    }
    if (const auto* reply = std::get_if<Reply>(&effect.message)) {
      std::cerr << " reply #" << reply->seq << " outcome " << reply->outcome.index();
      if (const auto* updated = std::get_if<UpdateOk>(&reply->outcome)) {
        std::cerr << " " << update_status_name(updated->status) << " "
                  << (updated->version ? "v" + std::to_string(*updated->version) : "nothing");
      }
      if (const auto* error = std::get_if<Error>(&reply->outcome)) {
        std::cerr << " " << errc_name(error->code) << " (" << error->detail << ")";
      }
    }
    std::cerr << "\n";
  }

  void hub_step(int server, const Input& input) {
    log_input(server, input);
    hub_effects_.clear();
    Hub& hub = *servers_[server];
    hub.step(input, now_, hub_effects_);
    // The hub's own invariants after every step, except a heartbeat's that changed nothing but
    // when the shard was last heard of (no invariant covers that): a third of all steps. Because
    // the check covers the whole state, anything such a step broke is caught at the next step.
    const auto* report = std::get_if<Report>(&input);
    const bool heartbeat_only = report != nullptr && std::holds_alternative<Heartbeat>(report->body) &&
                                hub_effects_.empty();
    if (!heartbeat_only && (plan_ == nullptr || ++hub_checks_skipped_ % plan_->check_every == 0)) {
      hub.check_invariants();
    }
    // (Logged before the observer judges them: a replay shows the step that broke a rule.)
    for (const Effect& effect : hub_effects_) log_effect(server, effect);
    // The observer follows the server that serves: the primary, then the backup after a failover.
    const bool active = server == (servers_alive_[0] ? 0 : 1);
    if (active) {
      observer_.on_effects(hub_effects_);
      for (const std::string& model : models_) observer_.on_latest(model, hub.latest(model), now_);
      if (!observer_.violations().empty()) throw Violation(observer_.violations().front());
    }
    for (const Effect& effect : hub_effects_) {
      trace_.mix(effect.client << 8 | effect.message.index());
      if (const auto* evicted = std::get_if<Evicted>(&effect.message)) {
        if (evicted->reason != Errc::kUnknownClient) ++result_.evictions;
      }
      if (std::holds_alternative<Offload>(effect.message)) ++result_.offloads;
      if (const auto* read = std::get_if<StartRead>(&effect.message);
          read != nullptr && read->offload_copy != 0 &&
          seed_copies_.emplace(server, read->offload_copy).second) {
        ++result_.seeds;
      }
      send_to_worker(static_cast<std::uint32_t>(server), effect);
    }
  }

  void crash_server() {
    servers_alive_[0] = false;
    ++result_.failovers;
    observer_.on_server_reset(/*answers_delivered=*/false);
    trace_.instant(0, "primary server crashed: failover", "failure", now_, /*global=*/true);
    if (options_.verbose) std::cerr << now_ << " ms: the primary server crashed\n";
    for (std::size_t w = 0; w < workers_.size(); ++w) {
      if (workers_[w].alive) lose_server(static_cast<int>(w));
    }
  }

  // ---- the data plane ----

  // A read of the buffers, of the bytes, from one source: what a later read may go on from.
  void keep_for_resume(const Flow& flow) {
    const StartRead& read = flow.read;
    if (read.offload_copy != 0 || flow.reshard || read.patch != nullptr) return;
    workers_[flow.reader].resumable = Worker::Resumable{read.transfer, read.version, flow.progress, flow.copied};
  }

  // Where a new read of the buffers starts: after the prefix an earlier read of the same transfer
  // left, if the buffers still hold that version's bytes there (a fault's bytes stop it, as a
  // tensor that fails its checksum stops a real client's resume).
  std::pair<double, std::size_t> resume_point(int w, const StartRead& read) {
    Worker& reader = workers_[w];
    const std::optional<Worker::Resumable> earlier = std::exchange(reader.resumable, std::nullopt);
    if (!earlier || earlier->transfer != read.transfer || earlier->version != read.version ||
        read.offload_copy != 0 || !read.reshard.empty() || read.patch != nullptr ||
        reader.buffer_version != read.version || reader.buffer_corrupt || earlier->copied > reader.buffer.size()) {
      return {0, 0};
    }
    const int model = content_model(replica_of(w).model);
    for (std::size_t offset = 0; offset < earlier->copied; ++offset) {
      if (reader.buffer[offset] != reader.content->byte(model, read.version, offset)) return {0, 0};
    }
    return {earlier->progress, earlier->copied};
  }

  void begin_read(int w, const StartRead& read) {
    const bool seed = read.offload_copy != 0;
    if (!seed) check_may_write(w, read.version);
    Worker& reader = workers_[w];
    // The read it replaces, if any, ends short here.
    if (auto replaced = flows_.find({w, read.transfer}); replaced != flows_.end()) keep_for_resume(replaced->second);
    const auto [resume_progress, resume_copied] = resume_point(w, read);
    Flow flow;
    flow.reader = w;
    flow.read = read;
    flow.started_ms = now_;
    flow.remote = read.source.datacenter != replica_of(w).datacenter;
    flow.total = static_cast<double>(reader.modelled_bytes);
    if (read.patch != nullptr) {
      // The patches, and the tensors without one whole.
      flow.total = static_cast<double>(reader.modelled_bytes) * static_cast<double>(read.patch->read_bytes(*reader.content->layout())) /
                   static_cast<double>(reader.content->size());
    }
    check_vouched(w, read.version, read.checksums, read.reshard.empty());
    if (read.reshard.empty()) {
      check_same_layout(w, read);
      flow.source = clients_of_replica(read.source.replica, read.source.incarnation, read.shard).value_or(-1);
    } else {
      flow.source = -1;  // every source shard it needs: flow.sources
      begin_reshard(w, flow);
    }
    if (faults_on_ && rng_.chance(knobs_.read_failure)) {
      flow.fail_at_progress = rng_.unit() * flow.total;
    }
    // (Drawn only where the knob is on, so that seeds without it run as they did before it.)
    if (faults_on_ && knobs_.corrupt > 0 && rng_.chance(knobs_.corrupt)) {
      const std::uint64_t bytes = flow.reshard ? flow.reshard->bytes_before(flow.reshard->pieces()) : reader.buffer.size();
      flow.flip = {static_cast<std::size_t>(rng_.below(bytes)), static_cast<int>(rng_.below(8))};
    }
    // Every byte of the destination is written anew from the source before the read completes.
    if (seed) {
      // Offload seeding: into a CPU buffer of its own (created now, freed by FreeOffload).
      reader.offloads.try_emplace(read.version, reader.buffer.size(), std::uint8_t{0});
      reader.offloads_corrupt.erase(read.version);
    } else {
      reader.buffer_version = read.version;  // from here on the buffers hold this version's prefix
      reader.buffer_bytes = static_cast<std::uint64_t>(resume_progress);
      reader.patch.reset();  // freed with the version it came with
      // (A patch read checks at the end that the buffers still hold its base: they are unchanged.)
      if (read.patch == nullptr) reader.buffer_corrupt = reader.buffer_tampered = false;
      flow.progress = flow.resumed_from = resume_progress;
      flow.copied = resume_copied;
    }
    flows_[{w, read.transfer}] = flow;
    if (!data_tick_scheduled_) {
      data_tick_scheduled_ = true;
      schedule(now_ + kDataTickMs, Event(EventKind::kDataTick));
    }
  }

  // The checksums the hub gave a reader are those of the version's bytes in the reader's layout
  // (null only for a read across layouts of one whose copies none completed yet).
  void check_vouched(int w, Version version, const ChecksumsRef& checksums, bool needed) const {
    const Worker& reader = workers_[w];
    if (checksums == nullptr && !needed) return;
    const ShardContent& content = *reader.content;
    if (checksums == nullptr || *checksums != content.checksums(content.bytes(content_model(replicas_[reader.replica].model), version))) {
      throw Violation("integrity: " + replicas_[reader.replica].name + "/" + std::to_string(reader.shard) +
                      " is told to verify version " + std::to_string(version) + " against " +
                      (checksums == nullptr ? "no checksums" : "checksums of other bytes"));
    }
  }

  // A read of the reader's own layout reads shard i of the source into shard i: the source's
  // shard must hold the same tensors the same way.
  void check_same_layout(int w, const StartRead& read) const {
    const Worker& reader = workers_[w];
    auto found = replica_index_.find(read.source.replica);
    if (found == replica_index_.end()) return;
    const Replica& source = replicas_[found->second];
    if (read.shard < source.num_shards &&
        workers_[source.workers[read.shard]].content->layout()->digest() == reader.content->layout()->digest()) {
      return;
    }
    throw Violation("layouts: " + replicas_[reader.replica].name + "/" + std::to_string(reader.shard) + " is sent to read shard " +
                    std::to_string(read.shard) + " of " + source.name + " byte for byte (no reshard list), whose " +
                    (read.shard < source.num_shards ? "tensors differ from its own" : "replica has fewer shards"));
  }

  // The process that serves shard `shard` of this incarnation of the replica, if it still runs.
  std::optional<int> clients_of_replica(const std::string& name, std::uint64_t incarnation,
                                        std::uint32_t shard) const {
    auto found = replica_index_.find(name);
    if (found == replica_index_.end()) return std::nullopt;
    const int w = replicas_[found->second].workers[shard];
    const Worker& worker = workers_[w];
    if (!worker.alive || worker.agent->incarnation() != incarnation) return std::nullopt;
    return w;
  }

  static std::string endpoint_of(const std::string& replica, std::uint32_t shard) {
    return "sim://" + replica + "/" + std::to_string(shard);
  }

  // ---- reads across layouts (sim/layouts.h) ----

  // The hub lists every shard of the source copy, in shard order, with where it serves, how it
  // holds its tensors and the checksums of its bytes: each must be what that shard has.
  void begin_reshard(int w, Flow& flow) {
    const StartRead& read = flow.read;
    const Worker& reader = workers_[w];
    const std::string who = replica_of(w).name + "/" + std::to_string(reader.shard) + " reading v" +
                            std::to_string(read.version) + " across layouts from " + read.source.replica;
    if (read.offload_copy != 0) throw Violation("layouts: " + who + " into a seed copy (a seed reads its own layout)");
    auto found = replica_index_.find(read.source.replica);
    if (found == replica_index_.end()) throw Violation("layouts: " + who + ", which is no replica");
    const Replica& source = replicas_[found->second];
    if (read.reshard.size() != source.num_shards) {
      throw Violation("layouts: " + who + ": the read lists " + std::to_string(read.reshard.size()) +
                      " source shards, the copy has " + std::to_string(source.num_shards));
    }
    for (std::uint32_t shard = 0; shard < source.num_shards; ++shard) {
      const SourceShard& listed = read.reshard[shard];
      const ShardContent& holds = *workers_[source.workers[shard]].content;
      const std::string entry = "the read's source shard " + std::to_string(shard);
      if (listed.endpoint != endpoint_of(source.name, shard)) {
        throw Violation("layouts: " + who + ": " + entry + " is at '" + listed.endpoint + "'");
      }
      if (listed.layout == nullptr || listed.layout->digest() != holds.layout()->digest()) {
        throw Violation("layouts: " + who + ": " + entry + " is described otherwise than it holds its tensors");
      }
      if (listed.checksums == nullptr || *listed.checksums != holds.checksums(holds.bytes(content_model(source.model), read.version))) {
        throw Violation("layouts: " + who + ": " + entry + " comes with checksums that are not version " +
                        std::to_string(read.version) + "'s");
      }
      flow.sources.push_back(clients_of_replica(source.name, read.source.incarnation, shard).value_or(-1));
    }
    auto planned = ReshardRead::plan(read, reader.content->layout());
    if (!planned.ok()) {
      throw Violation("layouts: " + who + ", whose layout cannot fill the reader's: " + planned.error().detail);
    }
    flow.reshard = std::make_shared<const ReshardRead>(std::move(planned.value()));
    flow.granted_shards.assign(source.num_shards, false);
    // Whole pieces move: often more than the reader keeps.
    flow.total = static_cast<double>(reader.modelled_bytes) *
                 static_cast<double>(flow.reshard->bytes_before(flow.reshard->pieces())) /
                 static_cast<double>(reader.content->size());
  }

  // The processes a flow reads from now: its source, or the source shards a read across layouts
  // has still to read from.
  std::vector<int> serving(const Flow& flow) const {
    std::vector<int> processes;
    if (!flow.reshard) {
      if (flow.source >= 0) processes.push_back(flow.source);
      return processes;
    }
    for (std::size_t piece = flow.landed; piece < flow.reshard->pieces(); ++piece) {
      const int process = flow.sources[flow.reshard->shard_of(piece)];
      if (process >= 0 && (processes.empty() || processes.back() != process)) processes.push_back(process);
    }
    return processes;
  }

  void advance_reshard(Flow& flow) {
    const ReshardRead& plan = *flow.reshard;
    const Worker& reader = workers_[flow.reader];
    const StartRead& read = flow.read;
    double rate = download_bandwidth(reader) / downloads_[flow.reader];
    // Each source shard it has still to read from must run, and serve under a grant for this
    // transfer and epoch (a missing one after a grant was seen was revoked).
    for (std::size_t piece = flow.landed; piece < plan.pieces(); ++piece) {
      const std::uint32_t shard = plan.shard_of(piece);
      const int process = flow.sources[shard];
      if (process < 0 || !workers_[process].alive) {
        flow.fail_at = now_ + kReadTimeoutMs;  // the reader waits out a dead source
        return;
      }
      const Worker& source = workers_[process];
      auto grant = source.grants.find({read.transfer, read.epoch});
      if (grant == source.grants.end() || grant->second.version != read.version ||
          grant->second.kind != read.source.kind || grant->second.shard != shard) {
        if (flow.granted_shards[shard] || now_ - flow.started_ms >= kGrantGraceMs) {
          flow.fail_at = now_;
          flow.fail_reason = ReadFailure::kSourceRefused;
        }
        return;
      }
      flow.granted_shards[shard] = true;
      rate = std::min(rate, bandwidth(source) / uploads_[process]);
    }
    if (flow.fail_at_progress >= 0 && flow.progress >= flow.fail_at_progress) {
      flow.fail_at = now_ + rng_.range(0, kReadTimeoutMs);
      return;
    }
    if (flow.remote && knobs_.remote_bytes_per_ms > 0) {
      rate = std::min(rate, static_cast<double>(knobs_.remote_bytes_per_ms) / remote_flows_);
    }
    flow.progress = std::min(flow.total, flow.progress + rate * kDataTickMs);
    const auto all = static_cast<double>(plan.bytes_before(plan.pieces()));
    while (flow.landed < plan.pieces() &&
           (flow.progress >= flow.total ||
            flow.progress >= flow.total * static_cast<double>(plan.bytes_before(flow.landed + 1)) / all)) {
      if (!land_piece(flow)) return;  // that ended the read
      ++flow.landed;
    }
    if (flow.landed < plan.pieces()) return;
    // What it assembled, against what an earlier copy of its layout holds where the hub knows it.
    auto assembled = std::make_shared<const Checksums>(reader.content->checksums(reader.buffer));
    if (read.checksums != nullptr && *read.checksums != *assembled) {
      finish_flow(flow, ReadFailure::kChecksumMismatch);
      return;
    }
    workers_[flow.reader].buffer_bytes = reader.modelled_bytes;
    finish_flow(flow, std::nullopt, std::move(assembled));
  }

  // Reads the next piece of a read across layouts whole from its source shard, verifies it and
  // lands it; false if that ended the read (its bytes failed their checksum, or were refused).
  bool land_piece(Flow& flow) {
    const ReshardRead& plan = *flow.reshard;
    const std::size_t piece = flow.landed;
    const std::uint32_t shard = plan.shard_of(piece);
    const Worker& source = workers_[flow.sources[shard]];
    Worker& reader = workers_[flow.reader];
    const StartRead& read = flow.read;
    const std::string who = replica_of(flow.reader).name + "/" + std::to_string(reader.shard) + " reads v" +
                            std::to_string(read.version) + " across layouts from shard " + std::to_string(shard) +
                            " of " + read.source.replica;
    const std::vector<std::uint8_t>* bytes = &source.buffer;
    bool corrupt = source.buffer_corrupt;
    if (read.source.kind == CopyKind::kOffload) {
      auto offload = source.offloads.find(read.version);
      if (offload == source.offloads.end()) throw Violation("integrity: " + who + ", an offload copy it freed");
      bytes = &offload->second;
      corrupt = source.offloads_corrupt.contains(read.version);
    } else if (source.buffer_version != read.version || source.buffer_bytes < source.modelled_bytes) {
      throw Violation("layouts: " + who + ", whose buffers hold " +
                      (source.buffer_version == read.version ? "part of it" : "another version") +
                      ": only a complete copy serves another layout");
    }
    // Only a fault may have put other bytes there (DESIGN.md §5.1).
    const auto [begin, end] = plan.span(piece);
    const int model = content_model(replica_of(flow.reader).model);
    for (std::uint64_t offset = begin; !corrupt && offset < std::min<std::uint64_t>(end, bytes->size()); ++offset) {
      if ((*bytes)[offset] != source.content->byte(model, read.version, offset)) {
        throw Violation("integrity: " + who + ": a byte that is not the version's (the source's buffers "
                        "changed under a grant to read them)");
      }
    }
    check_may_write(flow.reader, read.version);
    std::optional<std::pair<std::uint64_t, int>> flip;
    if (flow.flip && flow.flip->first >= plan.bytes_before(piece) && flow.flip->first < plan.bytes_before(piece + 1)) {
      flip = {flow.flip->first - plan.bytes_before(piece), flow.flip->second};
      ++flipped_reads_of_[{read.source.replica, read.version}];
    }
    switch (plan.land(piece, *bytes, flip, reader.buffer)) {
      case ReshardRead::Landed::kLanded:
        return true;
      case ReshardRead::Landed::kChecksumMismatch:
        finish_flow(flow, ReadFailure::kChecksumMismatch);
        return false;
      case ReshardRead::Landed::kOutOfBounds:
        finish_flow(flow, ReadFailure::kSourceRefused);
        return false;
    }
    TH_ASSERT(false, "every outcome of a landing is handled");
    return false;
  }

  double bandwidth(const Worker& worker) const {
    const std::uint64_t nic = worker.straggler ? knobs_.nic_bytes_per_ms / 10 : knobs_.nic_bytes_per_ms;
    return static_cast<double>(nic) * worker.nic_factor;
  }

  // What a host can download: a throttled one crawls while faults are on (lifted as they heal, so
  // that the liveness phase converges).
  double download_bandwidth(const Worker& worker) const {
    const double nic = bandwidth(worker);
    return faults_on_ && worker.throttled ? std::min(nic, kThrottledBytesPerMs) : nic;
  }

  void data_tick() {
    if (flows_.empty()) {
      data_tick_scheduled_ = false;
      return;
    }
    // Every flow's share of each NIC it crosses, counted at the start of the tick.
    uploads_.assign(workers_.size(), 0);
    downloads_.assign(workers_.size(), 0);
    remote_up_.assign(nodes_, 0);
    remote_down_.assign(nodes_, 0);
    remote_flows_ = 0;
    tick_keys_.clear();
    for (const auto& [key, flow] : flows_) {
      tick_keys_.push_back(key);
      const std::vector<int> sources = serving(flow);
      for (int source : sources) ++uploads_[source];
      ++downloads_[flow.reader];
      if (!flow.remote) continue;
      ++remote_flows_;
      for (int source : sources) ++remote_up_[workers_[source].node];
      ++remote_down_[workers_[flow.reader].node];
    }
    for (const auto& key : tick_keys_) {
      auto found = flows_.find(key);
      if (found == flows_.end()) continue;
      advance_flow(found->second);
    }
    schedule(now_ + kDataTickMs, Event(EventKind::kDataTick));
  }

  void finish_flow(const Flow& finished, std::optional<ReadFailure> failure, ChecksumsRef assembled = nullptr) {
    const Flow flow = finished;  // `finished` lives in flows_, which the erase below frees
    const int reader = flow.reader;
    const StartRead& read = flow.read;
    flows_.erase({reader, read.transfer});
    if (failure) keep_for_resume(flow);
    if (failure) {
      ++result_.reads_failed;
    } else {
      ++result_.reads;
      if (flow.reshard) ++result_.reads_across;
    }
    workers_[reader].finished_reads[read.transfer] =
        Worker::FinishedRead{read.epoch, read.version, read.offload_copy != 0};
    trace_.span(reader + 1, "read v" + std::to_string(read.version) + " from " + read.source.replica,
                "transfer", flow.started_ms, now_,
                std::string(R"({"source":")") + json_escape(read.source.replica) + R"(","epoch":)" +
                    std::to_string(read.epoch) + R"(,"remote":)" + (flow.remote ? "true" : "false") +
                    R"(,"partial_source":)" + (read.source.partial ? "true" : "false") +
                    R"(,"failed":)" + (failure ? "true" : "false") + "}");
    trace_.mix(read.transfer << 16 | read.epoch << 1 | (failure ? 1 : 0));
    if (plan_ != nullptr && !failure) {
      // What the read moved: a shard, or the whole pieces a read across layouts reads.
      const auto moved = static_cast<std::uint64_t>(std::llround(flow.total));
      (flow.remote ? result_.plan.bytes_cross : result_.plan.bytes_local) += moved;
      if (!flow.remote && read.source.kind == CopyKind::kOffload) result_.plan.bytes_offload_local += moved;
      if (auto source = replica_index_.find(read.source.replica); source != replica_index_.end()) {
        result_.plan.reads.push_back({read.version, static_cast<std::uint32_t>(source->second),
                                      static_cast<std::uint32_t>(workers_[reader].replica), read.shard,
                                      flow.remote,
                                      read.source.kind == CopyKind::kOffload});
      }
    }
    agent_step(reader, ReadFinished{read.transfer, read.epoch, failure, std::move(assembled)});
  }

  void advance_flow(Flow& flow) {
    Worker& reader = workers_[flow.reader];
    if (!reader.alive) {
      flows_.erase({flow.reader, flow.read.transfer});
      return;
    }
    if (flow.fail_at >= 0) {
      if (now_ >= flow.fail_at) finish_flow(flow, flow.fail_reason);
      return;
    }
    if (flow.reshard) return advance_reshard(flow);
    if (flow.source < 0 || !workers_[flow.source].alive) {
      flow.fail_at = now_ + kReadTimeoutMs;  // the reader waits out a dead source
      return;
    }
    Worker& source = workers_[flow.source];
    const StartRead& read = flow.read;
    // The source's data server serves only under a grant for this transfer and epoch.
    auto grant = source.grants.find({read.transfer, read.epoch});
    const bool granted = grant != source.grants.end() && grant->second.version == read.version &&
                         grant->second.kind == read.source.kind && grant->second.patch == (read.patch != nullptr);
    if (!granted) {
      if (flow.granted || now_ - flow.started_ms >= kGrantGraceMs) {
        flow.fail_at = now_;
        flow.fail_reason = ReadFailure::kSourceRefused;
      }
      return;
    }
    flow.granted = true;
    const double total = flow.total;
    if (flow.fail_at_progress >= 0 && flow.progress >= flow.fail_at_progress) {
      flow.fail_at = now_ + rng_.range(0, kReadTimeoutMs);
      return;
    }
    double rate = std::min(bandwidth(source) / uploads_[flow.source],
                           download_bandwidth(reader) / downloads_[flow.reader]);
    if (flow.remote && knobs_.remote_bytes_per_ms > 0) {
      rate = std::min(rate, static_cast<double>(knobs_.remote_bytes_per_ms) / remote_flows_);
    }
    if (flow.remote && plan_ != nullptr && plan_->node_remote_bytes_per_ms > 0) {
      const auto node_rate = static_cast<double>(plan_->node_remote_bytes_per_ms);
      rate = std::min({rate, node_rate / remote_up_[source.node], node_rate / remote_down_[reader.node]});
    }
    if (flow.remote && plan_ != nullptr && plan_->remote_flow_bytes_per_ms > 0) {
      rate = std::min(rate, static_cast<double>(plan_->remote_flow_bytes_per_ms));
    }
    if (flow.source == flow.reader && plan_ != nullptr && plan_->local_copy_bytes_per_ms > 0) {
      rate = static_cast<double>(plan_->local_copy_bytes_per_ms);  // over PCIe, not the NIC
    }
    if (read.patch != nullptr) {
      flow.progress = std::min(total, flow.progress + rate * kDataTickMs);
      if (flow.progress >= total) finish_patch(flow, source);
      return;
    }
    // What the source can give: all of an offload copy; of its buffers, the prefix it holds of the
    // version (a partial source: what it has received so far). A buffer that holds another version
    // gives its bytes too, as a real one-sided read would: the checks below catch that.
    double available = total;
    const std::vector<std::uint8_t>* bytes = &source.buffer;
    bool source_corrupt = source.buffer_corrupt;
    if (read.source.kind == CopyKind::kOffload) {
      auto offload = source.offloads.find(read.version);
      if (offload == source.offloads.end()) {
        throw Violation("integrity: " + read.source.replica + " serves an offload copy of version " +
                        std::to_string(read.version) + " that it freed");
      }
      bytes = &offload->second;
      source_corrupt = source.offloads_corrupt.contains(read.version);
    } else if (source.buffer_version == read.version) {
      available = static_cast<double>(source.buffer_bytes);
    }
    flow.progress = std::min(flow.progress + rate * kDataTickMs, std::max(available, flow.progress));
    const std::size_t size = reader.buffer.size();
    const auto target = static_cast<std::size_t>(flow.progress / total * static_cast<double>(size));
    const int model = content_model(replicas_[reader.replica].model);
    const bool seed = read.offload_copy != 0;
    std::vector<std::uint8_t>* into = &reader.buffer;
    if (seed) {
      auto buffer = reader.offloads.find(read.version);
      if (buffer == reader.offloads.end()) {
        throw Violation("integrity: " + replica_of(flow.reader).name + " reads a seed of version " +
                        std::to_string(read.version) + " into an offload buffer it freed");
      }
      into = &buffer->second;
    }
    bool corrupted = false;
    for (std::size_t offset = flow.copied; offset < std::min(target, size); ++offset) {
      std::uint8_t byte = (*bytes)[offset];
      if (byte != source.content->byte(model, read.version, offset)) {
        // Only a fault may have put it there; any other wrong byte is a buffer that changed under
        // a grant to read it (DESIGN.md §5.1).
        if (!source_corrupt) {
          throw Violation("integrity: " + replica_of(flow.reader).name + " read a byte of " +
                          read.source.replica + "'s buffers that is not version " +
                          std::to_string(read.version) + " (the source's buffers changed under a "
                          "grant to read them)");
        }
        corrupted = true;
      }
      if (flow.flip && flow.flip->first == offset) {
        byte = static_cast<std::uint8_t>(byte ^ (1U << flow.flip->second));
        corrupted = true;
        ++flipped_reads_of_[{read.source.replica, read.version}];
      }
      (*into)[offset] = byte;
    }
    if (corrupted && seed) reader.offloads_corrupt.insert(read.version);
    if (corrupted && !seed) reader.buffer_corrupt = true;
    if (corrupted) held_bad_bytes_.emplace(replica_of(flow.reader).name, read.version);
    if (!seed && flow.copied < std::min(target, size)) check_may_write(flow.reader, read.version);
    flow.copied = std::max(flow.copied, std::min(target, size));
    if (!seed) reader.buffer_bytes = static_cast<std::uint64_t>(flow.progress);
    if (flow.progress < total) {
      report_progress(flow);
      return;
    }
    // Every tensor is checked against the checksums the hub gave with the instruction.
    const bool matches = reader.content->checksums(*into) == *read.checksums;
    finish_flow(flow, matches ? std::nullopt : std::optional(ReadFailure::kChecksumMismatch));
  }

  // As a real data plane does, once a sixteenth of the shard has moved from this source (the hub's
  // unit: its bytes of the reader's layout, in the proportion the flow has moved of its modelled
  // bytes since it began, a resumed prefix not counted).
  void report_progress(Flow& flow) {
    if (flow.progress_reported || flow.read.offload_copy != 0) return;
    const std::uint64_t shard_bytes = workers_[flow.reader].content->layout()->total_bytes();
    const std::uint64_t bytes = progress_bytes(flow, shard_bytes);
    if (shard_bytes == 0 || bytes < progress_report_bytes(shard_bytes)) return;
    flow.progress_reported = true;
    agent_step(flow.reader, ReadProgress{flow.read.transfer, flow.read.epoch, bytes});
  }

  static std::uint64_t progress_bytes(const Flow& flow, std::uint64_t shard_bytes) {
    return static_cast<std::uint64_t>(static_cast<double>(shard_bytes) * (flow.progress - flow.resumed_from) / flow.total);
  }

  // A patch read (StartRead::patch, from a complete copy that has the patch), once its bytes moved
  // at the flow's rate: as a real client does, the reader checks that its buffers hold the patch's
  // base (nothing is written otherwise), applies it, reads the tensors without one whole, and
  // verifies the version's checksums.
  void finish_patch(Flow& flow, const Worker& source) {
    Worker& reader = workers_[flow.reader];
    const StartRead& read = flow.read;
    const std::string who = replica_of(flow.reader).name + "/" + std::to_string(reader.shard);
    // The hub places a patch read only with a holder of that patch, of a complete copy.
    if (!source.patch || source.patch->version != read.version || source.patch->base != read.patch->base ||
        source.buffer_version != read.version) {
      throw Violation("patches: " + who + " is sent to read the patch of version " + std::to_string(read.version) +
                      " against " + std::to_string(read.patch->base) + " from " + read.source.replica +
                      ", which does not have it");
    }
    if (source.patch->tensor_bytes != read.patch->tensor_bytes) {
      throw Violation("patches: " + who + " is told other patch sizes than " + read.source.replica + " announced");
    }
    const Worker::Patch& patch = *source.patch;
    const ShardContent& content = *reader.content;
    const Checksums held = content.checksums(reader.buffer);
    for (std::size_t tensor = 0; tensor < patch.tensor_bytes.size(); ++tensor) {
      if (patch.tensor_bytes[tensor] != 0 && held[tensor] != patch.base_checksums[tensor]) {
        finish_flow(flow, ReadFailure::kPatchBaseMismatch);  // nothing written
        return;
      }
    }
    check_may_write(flow.reader, read.version);
    for (const auto& [offset, byte] : patch.changes) {
      const std::size_t tensor = tensor_at(content, offset);
      if (patch.tensor_bytes[tensor] != 0) reader.buffer[offset] = byte;
    }
    for (std::size_t tensor = 0; tensor < patch.tensor_bytes.size(); ++tensor) {
      if (patch.tensor_bytes[tensor] != 0) continue;
      std::copy(source.buffer.begin() + static_cast<std::ptrdiff_t>(content.offset(tensor)),
                source.buffer.begin() + static_cast<std::ptrdiff_t>(content.offset(tensor + 1)),
                reader.buffer.begin() + static_cast<std::ptrdiff_t>(content.offset(tensor)));
    }
    if (source.buffer_corrupt) reader.buffer_corrupt = true;
    const bool matches = content.checksums(reader.buffer) == *read.checksums;
    if (matches) {
      reader.buffer_bytes = reader.modelled_bytes;
      reader.buffer_corrupt = reader.buffer_tampered = false;
      reader.patch = patch;  // kept, to serve onwards
      ++result_.patch_reads;
    }
    finish_flow(flow, matches ? std::nullopt : std::optional(ReadFailure::kChecksumMismatch));
  }

  static std::size_t tensor_at(const ShardContent& content, std::size_t offset) {
    std::size_t tensor = 0;
    while (content.offset(tensor + 1) <= offset) ++tensor;
    return tensor;
  }

  void offload_copied(int w, Version version) {
    if (!alive(w)) return;
    Worker& worker = workers_[w];
    if (worker.buffer_version != version || worker.buffer_bytes < worker.modelled_bytes) {
      // The buffers moved on while they were copied: the copy holds other bytes. The agent hears
      // of it all the same, as from a real data plane, and must free it: never keep or report it.
      torn_offload_ = version;
      agent_step(w, OffloadFinished{version});
      torn_offload_.reset();
      return;
    }
    worker.offloads[version] = worker.buffer;
    if (worker.buffer_corrupt) {
      worker.offloads_corrupt.insert(version);
    } else {
      worker.offloads_corrupt.erase(version);
    }
    trace_.instant(w + 1, "offloaded v" + std::to_string(version), "offload", now_);
    agent_step(w, OffloadFinished{version});
  }

  // What an agent reports of the data plane must be true of the bytes (DESIGN.md §5.1): a read it
  // reports done holds every byte of the version (a read that failed its checksums is never done),
  // and an offload copy it reports made is a copy of that version's buffers.
  void check_report(int w, const ReportBody& body) {
    const Worker& worker = workers_[w];
    const std::string who = replica_of(w).name + "/" + std::to_string(worker.shard);
    if (const auto* offloaded = std::get_if<OffloadDone>(&body)) {
      if (torn_offload_ == offloaded->version) {
        throw Violation("integrity: " + who + " keeps and reports an offload copy of version " +
                        std::to_string(offloaded->version) + " made while its buffers held another");
      }
      return;
    }
    if (const auto* progress = std::get_if<TransferProgress>(&body)) {
      // Sent as the data plane fed it: of the read in progress, no more than has moved.
      const auto flow = flows_.find({w, progress->transfer});
      if (flow == flows_.end() || flow->second.read.epoch != progress->epoch ||
          progress->bytes > progress_bytes(flow->second, worker.content->layout()->total_bytes())) {
        throw Violation("consistency: " + who + " reports progress of transfer " + std::to_string(progress->transfer) +
                        " epoch " + std::to_string(progress->epoch) + " that its read has not made");
      }
      return;
    }
    const auto* done = std::get_if<TransferDone>(&body);
    if (done == nullptr) return;
    auto finished = worker.finished_reads.find(done->transfer);
    if (finished == worker.finished_reads.end() || finished->second.epoch != done->epoch) return;
    const Worker::FinishedRead& read = finished->second;
    const std::vector<std::uint8_t>* bytes = &worker.buffer;
    if (read.seed) {
      auto offload = worker.offloads.find(read.version);
      if (offload == worker.offloads.end()) return;  // freed since (a late repeat of the report)
      bytes = &offload->second;
    } else if (worker.buffer_version != read.version) {
      return;  // read again since: the report repeats an earlier one
    }
    // The version's bytes in the reader's own layout, whatever layout it read them from.
    const std::vector<std::uint8_t> expected = worker.content->bytes(content_model(replica_of(w).model), read.version);
    if (*bytes != expected) {
      throw Violation("integrity: " + who + " reports done a read of version " +
                      std::to_string(read.version) + (read.seed ? " (an offload seed)" : "") +
                      " whose bytes fail the version's checksums");
    }
    // After a read across layouts it vouches for them: with their checksums, no other.
    if (done->checksums != nullptr && *done->checksums != worker.content->checksums(expected)) {
      throw Violation("integrity: " + who + " reports done a read of version " + std::to_string(read.version) +
                      " across layouts with the checksums of other bytes");
    }
  }

  // ---- the application: trainers and rollouts ----

  void wake_app(int w, TimeMs delay_ms) {
    Worker& worker = workers_[w];
    schedule(now_ + delay_ms, Event(EventKind::kAppWake, w, ++worker.app.wake_token));
  }

  TimeMs jitter(int w, TimeMs low, TimeMs high) {
    const TimeMs base = rng_.range(low, high);
    return workers_[w].straggler ? base * 3 : base;
  }

  void call(int w, RequestBody body, std::string name) {
    Worker& worker = workers_[w];
    App& app = worker.app;
    app.in_call = true;
    app.call_started_ms = now_;
    app.seq_before = worker.agent->last_seq();
    app.call_name = std::move(name);
    app.call_kind = std::holds_alternative<OpenRequest>(body) ? OpKind::kList : op_kind(body);
    app.call_writes = app.call_kind == OpKind::kReplicate || app.call_kind == OpKind::kUpdate;
    ++result_.calls;
    if (logged(worker.client)) {
      std::cerr << now_ << " app c" << worker.client << " calls " << app.call_name << "\n";
    }
    agent_step(w, UserCall{++app.call_id, std::move(body)});
  }

  // The shards of a replica run one program and meet in a collective after every step (as model-
  // parallel workers do): a shard starts its next call once every peer finished the previous one.
  // A shard's place in the program is its agent's count of answered calls, which starts over with
  // the replica (after a divergent call); opens and calls that ended with the replica (eviction)
  // do not count.
  static std::pair<std::uint64_t, std::uint64_t> place(const Worker& worker) {
    return {worker.agent->starts(), worker.agent->last_seq()};
  }

  bool peers_behind(int w) const {
    const Worker& worker = workers_[w];
    for (int peer : replicas_[worker.replica].workers) {
      if (peer != w && workers_[peer].alive && place(workers_[peer]) < place(worker)) return true;
    }
    return false;
  }

  // A peer waiting in the collective for this shard goes on once the shard's place moved.
  void wake_waiting_peers(int w) {
    for (int peer : replicas_[workers_[w].replica].workers) {
      if (peer != w && workers_[peer].alive && workers_[peer].app.waiting_for_peers) {
        wake_app(peer, 0);
      }
    }
  }

  void app_act(int w) {
    Worker& worker = workers_[w];
    App& app = worker.app;
    if (app.in_call) return;
    const Replica& replica = replica_of(w);
    if (app.next != App::Next::kOpen && peers_behind(w)) {
      app.waiting_for_peers = true;
      return;
    }
    app.waiting_for_peers = false;
    // The application uses its weights between calls: they must be what it was told.
    if (app.told_known && app.told) verify_held(w, *app.told, "the last answer (between calls)");
    const int model = replica.model;
    switch (app.next) {
      case App::Next::kOpen: {
        OpenRequest open;
        open.model = models_[model];
        open.replica = replica.name;
        open.incarnation = replica.incarnation;
        open.shard = worker.shard;
        open.num_shards = replica.num_shards;
        open.datacenter = replica.datacenter;
        open.spot = replica.spot;
        open.role = replica.trainer ? "trainer" : "rollout";
        open.retention = replica.retention;
        open.data_endpoint = endpoint_of(replica.name, worker.shard);
        call(w, open, "open");
        return;
      }
      case App::Next::kPublish: {
        // The trainer's buffers hold the version it trained (written when it was mutable; again
        // if a fault changed them since and they are not published).
        const bool tampered = worker.buffer_tampered && !worker.agent->held();
        if (worker.buffer_version != app.version || tampered) write_version(w, app.version);
        PatchRef patch;
        if (worker.patch && worker.patch->version == app.version) {
          patch = std::make_shared<const PatchInfo>(PatchInfo{worker.patch->base, worker.patch->tensor_bytes});
        }
        call(w, PublishRequest{app.version, worker.content->layout(),
                               std::make_shared<const Checksums>(worker.content->checksums(worker.buffer)), patch},
             "publish v" + std::to_string(app.version));
        return;
      }
      case App::Next::kQuery: {
        // A trainer that waits for its rollouts to catch up (paper §4.2), or looks.
        const std::uint64_t choice = program_choice(worker.replica, replica_of(w).incarnation,
                                                    worker.agent->starts(), worker.agent->last_seq() + 1);
        if (choice % 2 == 0) {
          const Version behind = app.version > knobs_.off_by ? app.version - knobs_.off_by : 1;
          call(w, WaitRequest{{WaitPredicate::Kind::kRoleHolds, behind, 1, "rollout"}, 2000},
               "wait rollouts hold v" + std::to_string(behind));
        } else {
          call(w, ListRequest{}, "list");
        }
        return;
      }
      case App::Next::kUnpublish:
        call(w, UnpublishRequest{}, "unpublish");
        return;
      case App::Next::kUpdate:
        if (plan_ != nullptr) return plan_rollout_call(w);
        rollout_call(w);
        return;
      case App::Next::kReplicate:
        call(w, ReplicateRequest{app.replicate_selector, worker.content->layout(),
                                 app.replicate_timeout_ms},
             "replicate " + format_selector(app.replicate_selector));
        if (faults_on_) {
          maybe_cancel(w, program_choice(worker.replica, replica_of(w).incarnation, worker.agent->starts(),
                                         worker.agent->last_seq() + 1));
        }
        return;
      case App::Next::kDone:
        return;
    }
  }

  // The rollout's next call, the same on every shard (see program_choice). With faults healed it
  // only updates, so that every rollout converges on the final version.
  void rollout_call(int w) {
    Worker& worker = workers_[w];
    App& app = worker.app;
    auto update = [&] {
      call(w, UpdateRequest{Selector::latest(knobs_.off_by), worker.content->layout()}, "update");
    };
    if (!faults_on_) return update();
    const std::uint64_t choice = program_choice(worker.replica, replica_of(w).incarnation,
                                                worker.agent->starts(), worker.agent->last_seq() + 1);
    const std::uint64_t dice = choice % 100;
    const std::uint64_t arg = choice / 100;
    const TimeMs timeout_ms = 500 + static_cast<TimeMs>(arg % 6) * 500;
    const Version known = std::max<Version>(app.known_latest, 1);
    maybe_cancel(w, choice);
    if (dice < 55) return update();
    if (dice < 65) return call(w, ListRequest{}, "list");
    if (dice < 72) {
      // Without a timeout now and then: trainers keep publishing, so it returns.
      const TimeMs wait_ms = arg % 3 == 0 ? 0 : timeout_ms;
      return call(w, WaitRequest{{WaitPredicate::Kind::kVersionAtLeast, app.known_latest + 1, 1, ""}, wait_ms},
                  "wait version >= " + std::to_string(app.known_latest + 1));
    }
    if (dice < 78) {
      const auto replicas_min = static_cast<std::uint32_t>(1 + arg % 2);
      return call(w, WaitRequest{{WaitPredicate::Kind::kReplicasHold, known, replicas_min, ""}, timeout_ms},
                  "wait replicas hold v" + std::to_string(known));
    }
    if (dice < 84) {
      const std::string role = arg % 2 == 0 ? "rollout" : "trainer";
      return call(w, WaitRequest{{WaitPredicate::Kind::kRoleHolds, known, 1, role}, timeout_ms},
                  "wait " + role + "s hold v" + std::to_string(known));
    }
    // Drop the copy, then replicate with another kind of selector.
    switch (arg % 5) {
      case 0: app.replicate_selector = Selector::latest(); break;
      case 1: app.replicate_selector = Selector::latest(knobs_.off_by); break;
      case 2: app.replicate_selector = Selector::latest(1 + arg / 5 % 2); break;
      case 3: app.replicate_selector = Selector::absolute(app.known_latest); break;
      default: app.replicate_selector = Selector::absolute(app.known_latest + 1); break;
    }
    // A version that may never come (or be skipped) is waited for with a timeout.
    app.replicate_timeout_ms = arg % 5 == 0 ? 0 : 4000;
    call(w, UnpublishRequest{}, "unpublish (to replicate again)");
  }

  // Now and then shard 0 gives up on the call it is about to make (or just made), after 0 to 3 s:
  // the hub ends it for the whole replica (a list or an unpublish ignores the cancel). Decided by
  // `choice` (the same on every shard), acted on by one shard, as an application's timeout would be.
  void maybe_cancel(int w, std::uint64_t choice) {
    const Worker& worker = workers_[w];
    if (worker.shard != 0 || knobs_.cancel <= 0) return;
    if (static_cast<double>(choice / 7 % 1000) >= knobs_.cancel * 1000) return;
    // The call made now gets the next id (call() numbers it).
    const std::uint64_t call_id = worker.app.in_call ? worker.app.call_id : worker.app.call_id + 1;
    schedule(now_ + static_cast<TimeMs>(choice / 7001 % 3000), Event(EventKind::kAppCancel, w, call_id));
  }

  // A trainer computes a version into its buffers: allowed only while they are not published.
  void write_version(int w, Version version) {
    Worker& worker = workers_[w];
    for (const auto& [key, grant] : worker.grants) {
      if (grant.kind == CopyKind::kPrimary) {
        throw Violation("integrity: " + replica_of(w).name + " writes its buffers while a grant to "
                        "read them is active");
      }
    }
    std::vector<std::uint8_t> written = worker.content->bytes(content_model(replica_of(w).model), version);
    if (knobs_.patch_percent > 0 && worker.buffer_version && *worker.buffer_version < version &&
        worker.buffer_bytes == worker.modelled_bytes) {
      worker.patch = make_patch(w, *worker.buffer_version, version, written);
    } else if (worker.buffer_version != version) {
      worker.patch.reset();
    }
    worker.buffer = std::move(written);
    worker.buffer_version = version;
    worker.buffer_bytes = worker.modelled_bytes;
    worker.buffer_corrupt = worker.buffer_tampered = false;
  }

  // A trainer's patch writer (client/patch_writer.h), as it writes `version` over `base`: the bytes
  // that differ from what the buffers held (a tampered buffer gives a patch no reader can use: its
  // readers' checks catch that), per tensor sized as positions and values, and left out (0) past
  // 40 % of the tensor (kPatchFractionMax).
  Worker::Patch make_patch(int w, Version base, Version version, const std::vector<std::uint8_t>& written) {
    const Worker& worker = workers_[w];
    const ShardContent& content = *worker.content;
    Worker::Patch patch;
    patch.version = version;
    patch.base = base;
    patch.base_checksums = content.checksums(content.bytes(content_model(replica_of(w).model), base));
    const std::size_t tensors = content.layout()->tensors().size();
    for (std::size_t tensor = 0; tensor < tensors; ++tensor) {
      std::uint64_t changed = 0;
      for (std::size_t offset = content.offset(tensor); offset < content.offset(tensor + 1); ++offset) {
        if (worker.buffer[offset] == written[offset]) continue;
        patch.changes.emplace_back(offset, written[offset]);
        ++changed;
      }
      const std::uint64_t bytes = content.offset(tensor + 1) - content.offset(tensor);
      const std::uint64_t patch_bytes = std::max<std::uint64_t>(1, changed * 3 / 2);
      patch.tensor_bytes.push_back(patch_bytes * 10 <= bytes * 4 ? patch_bytes : 0);
    }
    return patch;
  }

  std::uint32_t change_period() const {
    return knobs_.patch_percent == 0 ? 1 : std::max<std::uint32_t>(1, (100 + knobs_.patch_percent / 2) / knobs_.patch_percent);
  }

  // The data plane writes a shard's buffers only for the application's replicate or update in
  // flight: between calls the application uses what it was told the buffers hold.
  void check_may_write(int w, Version version) {
    const App& app = workers_[w].app;
    if (app.in_call && app.call_writes) return;
    throw Violation("integrity: " + replica_of(w).name + "/" + std::to_string(workers_[w].shard) +
                    "'s buffers are rewritten with version " + std::to_string(version) +
                    " while its application " +
                    (app.in_call ? "calls " + app.call_name : std::string("makes no call")) +
                    " and holds " +
                    (!app.told_known ? "?" : app.told ? "v" + std::to_string(*app.told) : "nothing") +
                    " (a stale instruction obeyed)");
  }

  // Every byte a reader keeps is checked (but for bytes a fault changed in this very process's
  // buffers: its readers' checksums answer for those).
  void verify_held(int w, Version version, const char* after) {
    Worker& worker = workers_[w];
    if (worker.buffer_tampered) return;
    const int model = replica_of(w).model;
    const std::vector<std::uint8_t> expected = worker.content->bytes(content_model(model), version);
    if (worker.buffer == expected) return;
    // Which tensor differs, and whose bytes it holds if another version's (a mix of versions).
    const ShardContent& content = *worker.content;
    std::string which;
    for (std::size_t tensor = 0; which.empty() && tensor < content.layout()->tensors().size(); ++tensor) {
      const auto begin = static_cast<std::ptrdiff_t>(content.offset(tensor));
      const auto end = static_cast<std::ptrdiff_t>(content.offset(tensor + 1));
      if (std::equal(worker.buffer.begin() + begin, worker.buffer.begin() + end, expected.begin() + begin)) continue;
      which = " (tensor '" + content.layout()->tensors()[tensor].name + "' differs";
      for (Version other = 1; other <= published_[model] + 1; ++other) {
        const std::vector<std::uint8_t> then = content.bytes(content_model(model), other);
        if (std::equal(worker.buffer.begin() + begin, worker.buffer.begin() + end, then.begin() + begin)) {
          which += ": it holds version " + std::to_string(other) + "'s";
          break;
        }
      }
      which += ")";
    }
    throw Violation("integrity: " + replica_of(w).name + "/" + std::to_string(worker.shard) +
                    " keeps bytes that are not version " + std::to_string(version) +
                    (replica_of(w).placement ? " in its layout (" + describe(*replica_of(w).placement) + ")" : "") +
                    which + " after " + after);
  }

  void call_done(int w, const CallDone& done) {
    Worker& worker = workers_[w];
    App& app = worker.app;
    Replica& replica = replica_of(w);
    TH_ASSERT(app.in_call && done.call_id == app.call_id, "the agent answers the call in flight");
    app.in_call = false;
    if (logged(worker.client)) {
      std::cerr << now_ << " app c" << worker.client << " " << app.call_name << " -> "
                << short_outcome(done.outcome) << " (seq " << app.seq_before << " -> "
                << worker.agent->last_seq() << ")\n";
    }
    const Outcome& outcome = done.outcome;
    trace_.span(w + 1, app.call_name,
                app.call_name == "update" ? "stall" : "call", app.call_started_ms, now_,
                R"({"outcome":")" + json_escape(short_outcome(outcome)) + "\"}");
    trace_.mix(outcome.index());
    check_consistency(w, outcome);
    const auto* error = std::get_if<Error>(&outcome);
    if (error != nullptr && error->code == Errc::kDivergentCall) {
      // The shards' programs got different answers: like an SPMD job whose ranks fell out of step,
      // the framework restarts the whole replica (its other shards may be waiting in a collective).
      app.told_known = false;
      schedule(now_, Event(EventKind::kDivergence, worker.replica));
    }
    if (app.next == App::Next::kOpen) {
      if (error != nullptr) {
        wake_app(w, jitter(w, 200, 1000));
        return;
      }
      app.next = replica.trainer ? App::Next::kPublish : App::Next::kUpdate;
      wake_app(w, 0);
      return;
    }
    if (replica.trainer) {
      trainer_done(w, outcome);
    } else {
      rollout_done(w, outcome);
    }
  }

  // Replica consistency (DESIGN.md §5.3), where it matters: the answers the shards' programs got.
  void check_consistency(int w, const Outcome& outcome) {
    const Worker& worker = workers_[w];
    const Replica& replica = replica_of(w);
    // Only an answer of the hub that completed a numbered call counts; a call can also end with
    // its replica (eviction, a failed re-open), without an answer.
    if (std::holds_alternative<OpenOk>(outcome)) return;
    if (worker.agent->last_seq() != worker.app.seq_before + 1) return;
    // An unpublish ended by an eviction completes without the hub's answer (see the agent).
    if (worker.agent->phase() == AgentPhase::kEvicted) return;
    const auto key = std::tuple{worker.replica, worker.agent->incarnation(), worker.agent->last_seq()};
    auto [found, inserted] = answers_.try_emplace(key, outcome);
    if (!inserted && !same_answer(found->second, outcome)) {
      throw Violation("consistency: shard " + std::to_string(worker.shard) + " of " + replica.name +
                      " got '" + short_outcome(outcome) + "' for call " +
                      std::to_string(std::get<2>(key)) + " where another shard got '" +
                      short_outcome(found->second) + "'");
    }
  }

  void trainer_done(int w, const Outcome& outcome) {
    Worker& worker = workers_[w];
    App& app = worker.app;
    Replica& replica = replica_of(w);
    const auto* error = std::get_if<Error>(&outcome);
    if (app.next == App::Next::kQuery) {
      app.next = App::Next::kUnpublish;  // whatever it found, the trainer goes on
      wake_app(w, jitter(w, 100, 500));
      return;
    }
    if (app.next == App::Next::kPublish) {
      const auto& held = worker.agent->held();
      const bool announced = error != nullptr && error->code == Errc::kAlreadyHolding && held &&
                             held->version == app.version;
      if (error == nullptr || announced) {
        // Published (after a failover the copy may have been announced already).
        ++result_.versions;
        if (plan_ != nullptr && app.version > published_[replica.model]) plan_published(app.version);
        replica.next_version = std::max(replica.next_version, app.version + 1);
        replica.fresh_run = false;
        published_[replica.model] = std::max(published_[replica.model], app.version);
        if (app.final_target && app.version >= *app.final_target) {
          app.next = App::Next::kDone;  // liveness: hold the final version published
          if (plan_ != nullptr) plan_check_finished();
          return;
        }
        // Now and then (while faults are on) a query first; the same on every shard.
        const std::uint64_t choice = program_choice(worker.replica, replica_of(w).incarnation,
                                                    worker.agent->starts(), worker.agent->last_seq());
        app.next = faults_on_ && choice % 4 == 0 ? App::Next::kQuery : App::Next::kUnpublish;
        wake_app(w, plan_ != nullptr ? plan_->hold_ms
                                     : jitter(w, knobs_.colocated ? 1000 : 300, knobs_.colocated ? 4000 : 2000));
      } else if (error->code == Errc::kAlreadyHolding) {
        app.next = App::Next::kUnpublish;  // the hub lists another version of ours: drop it first
        wake_app(w, jitter(w, 200, 1000));
      } else {
        if (error->code == Errc::kStaleVersion && replica.fresh_run) {
          // The model ended before the run came back (run_stopped_ms): its versions are forgotten.
          throw Violation("lifecycle: " + replica.name + "'s run restarted from version 1 once model " +
                          models_[replica.model] + " had no replica for longer than the model grace (" +
                          std::to_string(knobs_.model_grace_ms) + " ms), and its publish v" +
                          std::to_string(app.version) + " was refused: " + error->detail);
        }
        if (error->code == Errc::kStaleVersion) ++app.version;
        wake_app(w, jitter(w, 200, 1000));
      }
      return;
    }
    // Unpublished (or not published at all): the buffers are the trainer's to change again. Any
    // other answer (the replica is closing, say) leaves them as they are: try again.
    const auto* failed = std::get_if<Error>(&outcome);
    if (failed != nullptr && failed->code != Errc::kNotPublished) {
      wake_app(w, jitter(w, 200, 1000));
      return;
    }
    if (plan_ != nullptr) {
      // The trainer's stall for this version: its unpublish waits for reads still draining.
      result_.plan.stalls.push_back({app.version, static_cast<std::uint32_t>(worker.replica),
                                     worker.shard, now_ - app.call_started_ms});
    }
    check_drain_bound(w);
    ++app.version;
    write_version(w, app.version);
    app.next = App::Next::kPublish;
    wake_app(w, plan_ != nullptr ? plan_->train_ms : jitter(w, 300, 2000));
  }

  // A slow or throttled reader holds a trainer's unpublish one drain grace at most (README, "What
  // the hub does": unpublish): past it the hub sends the reader elsewhere. Judged where the control plane
  // itself is sound (no message lost, late, partitioned or clogged, no server failover), which
  // swarm testing leaves in many seeds: otherwise the call's own messages may take longer.
  void check_drain_bound(int w) {
    const bool sound = knobs_.drop == 0 && knobs_.duplicate == 0 && knobs_.stale == 0 && knobs_.clog_per_s == 0 &&
                       knobs_.partition_per_s == 0 && knobs_.crash_per_s == 0 && !knobs_.server_crash;
    if (!sound || plan_ != nullptr) return;
    // Messages both ways, the offload of a last retained copy a drain waits for (a straggler's
    // too), and the tick that fires the deadline. (The drain starts with the first shard's call,
    // and each shard is answered once it is done: a shard calling later waits less.)
    const TimeMs slack_ms = 3000 + 4 * (knobs_.delay_min_ms + knobs_.delay_mean_ms);
    const Worker& worker = workers_[w];
    const TimeMs waited_ms = now_ - worker.app.call_started_ms;
    if (waited_ms > knobs_.drain_grace_ms + slack_ms) {
      throw Violation("liveness: " + replicas_[worker.replica].name + "/" + std::to_string(worker.shard) +
                      "'s unpublish waited " + std::to_string(waited_ms) +
                      " ms for its readers (drain grace " + std::to_string(knobs_.drain_grace_ms) + " ms)");
    }
  }

  // ---- a capacity plan's loop (PlanLoop) ----

  // A version is out for the first time: the spot batches due now join, or all spot rollouts go.
  void plan_published(Version version) {
    if (result_.plan.published_ms.size() <= version) result_.plan.published_ms.resize(version + 1, 0);
    result_.plan.published_ms[version] = now_;
    for (std::size_t r = 0; r < replicas_.size(); ++r) {
      Replica& replica = replicas_[r];
      if (replica.join_batch > 0 && 1 + replica.join_batch * plan_->spot_join_every <= version) {
        replica.join_batch = 0;
        if (plan_->spot_leave_version > 0 && version >= plan_->spot_leave_version) {
          replica.crashed = true;  // its machine went before it came: it never starts
          continue;
        }
        start_replica(static_cast<int>(r), 0);
      }
      if (plan_->spot_leave_version == version && replica.spot && !replica.crashed &&
          replica.join_batch == 0) {
        crash(static_cast<int>(r), kNeverMs, /*fault=*/false);  // preempted: it does not come back
      }
    }
  }

  // Wait for the next version (not stall: generation would wait for the trainer anyway), then
  // update until it arrives.
  void plan_rollout_call(int w) {
    Worker& worker = workers_[w];
    App& app = worker.app;
    const Version held = app.told.value_or(0);
    const Version last = plan_->versions > knobs_.off_by ? plan_->versions - knobs_.off_by : 1;
    if (held >= last) {
      app.next = App::Next::kDone;
      plan_check_finished();
      return;
    }
    if (!app.plan_version_out) {
      call(w, WaitRequest{{WaitPredicate::Kind::kVersionAtLeast, held + 1 + knobs_.off_by, 1, ""}, 0},
           "wait for v" + std::to_string(held + 1 + knobs_.off_by));
      return;
    }
    call(w, UpdateRequest{Selector::latest(knobs_.off_by), worker.content->layout()}, "update");
  }

  void plan_rollout_done(int w, const Outcome& outcome) {
    Worker& worker = workers_[w];
    App& app = worker.app;
    app.next = App::Next::kUpdate;
    if (const auto* error = std::get_if<Error>(&outcome)) {
      // A plan injects no faults: a failed call is a finding, not weather. The likeliest: reads
      // that outlast the drain grace, cut when their trainer unpublished.
      std::uint64_t revoked = 0;
      for (const auto& server : servers_) revoked += server->stats().readers_revoked;
      throw Violation("plan: " + replica_of(w).name + "/" + std::to_string(worker.shard) + "'s " +
                      app.call_name + " failed: " + std::string(errc_name(error->code)) + " (" +
                      error->detail + ")" +
                      (revoked == 0 ? std::string()
                                    : "; " + std::to_string(revoked) + " reads were cut at the drain grace (" +
                                          std::to_string(knobs_.drain_grace_ms / 1000) +
                                          " s after their trainer's unpublish): a read takes longer than that "
                                          "(th-server --drain-grace-ms, th-plan --drain-grace-s)"));
    }
    if (app.call_kind == OpKind::kWait) {
      app.plan_version_out = true;
      wake_app(w, 0);
      return;
    }
    TH_ASSERT(app.call_kind == OpKind::kUpdate, "a plan's rollout only waits and updates");
    const auto& updated = std::get<UpdateOk>(outcome);
    app.plan_stall_ms += now_ - app.call_started_ms;
    told(w, updated.version, "update");
    if (updated.status != UpdateStatus::kUpdated) {
      wake_app(w, plan_->poll_ms);  // "not yet": it generates with what it has, then asks again
      return;
    }
    result_.plan.stalls.push_back({*updated.version, static_cast<std::uint32_t>(worker.replica),
                                   worker.shard, app.plan_stall_ms});
    app.plan_stall_ms = 0;
    app.plan_version_out = false;
    wake_app(w, 0);
  }

  // The plan ends once every trainer published the last version and every rollout that runs (and
  // every one still to join) holds it.
  void plan_check_finished() {
    for (const Replica& replica : replicas_) {
      // A spot batch due after the last version never joins: nothing to wait for.
      if (replica.join_batch > 0 && 1 + replica.join_batch * plan_->spot_join_every <= plan_->versions) return;
      if (replica.crashed || replica.join_batch > 0) continue;
      for (int w : replica.workers) {
        if (workers_[w].alive && workers_[w].app.next != App::Next::kDone) return;
      }
    }
    check_liveness();
    for (int server = 0; server < 2; ++server) {
      if (servers_alive_[server]) servers_[server]->check_invariants();
    }
    finished_ = true;
  }

  void rollout_done(int w, const Outcome& outcome) {
    if (plan_ != nullptr) return plan_rollout_done(w, outcome);
    Worker& worker = workers_[w];
    App& app = worker.app;
    const OpKind kind = app.call_kind;
    app.next = App::Next::kUpdate;  // the program chooses again
    std::visit(
        [&](const auto& answer) {
          using T = std::decay_t<decltype(answer)>;
          if constexpr (std::is_same_v<T, UpdateOk>) {
            // The answer says what the buffers hold now: moved, or still (or nothing).
            told(w, answer.version, answer.status == UpdateStatus::kUpdated ? "update" : "an update that moved nothing");
          } else if constexpr (std::is_same_v<T, ReplicateOk>) {
            told(w, answer.version, "replicate");
          } else if constexpr (std::is_same_v<T, UnpublishOk>) {
            told(w, std::nullopt, "unpublish");
            app.next = App::Next::kReplicate;
          } else if constexpr (std::is_same_v<T, ListOk>) {
            if (answer.snapshot->latest) app.known_latest = std::max(app.known_latest, *answer.snapshot->latest);
          } else if constexpr (std::is_same_v<T, Error>) {
            // A replicate or update that failed may have written part of the buffers: the
            // application no longer knows what they hold, until an answer says again.
            if (app.call_writes) app.told_known = false;
            if (kind == OpKind::kUnpublish && answer.code == Errc::kNotPublished) {
              told(w, std::nullopt, "an unpublish of nothing");
              app.next = App::Next::kReplicate;
            }
          }
        },
        outcome);
    wake_app(w, jitter(w, 100, 1500));
  }

  // An answer told the application what its buffers hold: the bytes must be that version.
  void told(int w, std::optional<Version> version, const char* after) {
    App& app = workers_[w].app;
    app.told = version;
    app.told_known = true;
    if (version) {
      app.known_latest = std::max(app.known_latest, *version);
      verify_held(w, *version, after);
    }
  }

  static std::string short_outcome(const Outcome& outcome) {
    if (const auto* error = std::get_if<Error>(&outcome)) return std::string(errc_name(error->code));
    if (const auto* updated = std::get_if<UpdateOk>(&outcome)) {
      return std::string(update_status_name(updated->status)) + " " +
             (updated->version ? "v" + std::to_string(*updated->version) : "nothing");
    }
    return "ok";
  }

  // ---- faults ----

  void fault_tick() {
    if (!faults_on_) return;
    const double dt = static_cast<double>(kFaultTickMs) / 1000.0;
    if (server_crash_at_ >= 0 && now_ >= server_crash_at_ && servers_alive_[0]) crash_server();
    if (storm_at_ >= 0 && now_ >= storm_at_) {
      storm_at_ = -1;
      storm();
    }
    if (run_restart_at_ >= 0 && now_ >= run_restart_at_) {
      run_restart_at_ = -1;
      restart_run();
    }
    if (rng_.chance(knobs_.crash_per_s * dt)) crash_someone();
    if (knobs_.tamper_per_s > 0 && rng_.chance(knobs_.tamper_per_s * dt)) tamper_someone();
    if (!workers_.empty() && rng_.chance(knobs_.clog_per_s * dt)) {
      Worker& worker = workers_[rng_.below(workers_.size())];
      worker.clogged_until = now_ + knobs_.clog_ms;
    }
    if (rng_.chance(knobs_.partition_per_s * dt)) {
      const Replica& replica = replicas_[rng_.below(replicas_.size())];
      const std::uint64_t mode = rng_.below(3);  // both ways, to the server only, from it only
      for (int w : replica.workers) {
        if (mode != 2) workers_[w].cut_up_until = now_ + knobs_.partition_ms;
        if (mode != 1) workers_[w].cut_down_until = now_ + knobs_.partition_ms;
      }
    }
    schedule(now_ + kFaultTickMs, Event(EventKind::kFaultTick));
  }

  // A bit of a published copy's buffers flips (a trainer that writes its tensors while published,
  // or memory gone bad), preferably one that serves a read now: its readers' checksums must refuse
  // its bytes from now on, until its buffers hold another version.
  void tamper_someone() {
    std::vector<int> published;
    std::vector<int> serving;
    for (std::size_t w = 0; w < workers_.size(); ++w) {
      const Worker& worker = workers_[w];
      if (!worker.alive) continue;
      const std::optional<HeldCopy>& held = worker.agent->held();
      if (!held || worker.buffer_tampered || worker.buffer_version != held->version ||
          worker.buffer_bytes < worker.modelled_bytes) {
        continue;
      }
      published.push_back(static_cast<int>(w));
      if (!worker.grants.empty()) serving.push_back(static_cast<int>(w));
    }
    const std::vector<int>& candidates = !serving.empty() && rng_.chance(0.7) ? serving : published;
    if (candidates.empty()) return;
    const int w = candidates[rng_.below(candidates.size())];
    Worker& worker = workers_[w];
    worker.buffer[rng_.below(worker.buffer.size())] ^= static_cast<std::uint8_t>(1U << rng_.below(8));
    worker.buffer_corrupt = worker.buffer_tampered = true;
    held_bad_bytes_.emplace(replica_of(w).name, *worker.buffer_version);
    trace_.instant(w + 1, "buffers tampered with", "failure", now_);
    if (options_.verbose) {
      std::cerr << now_ << " ms: " << replica_of(w).name << "/" << worker.shard << "'s buffers (v"
                << *worker.buffer_version << ") changed under its readers\n";
    }
  }

  // Prefer a replica in the middle of a transfer, as source or reader.
  void crash_someone() {
    std::vector<int> candidates;
    for (const auto& [key, flow] : flows_) {
      std::vector<int> involved = serving(flow);
      involved.insert(involved.begin(), flow.reader);
      for (int w : involved) {
        if (!replica_of(w).trainer) candidates.push_back(workers_[w].replica);
      }
    }
    if (candidates.empty() || rng_.chance(0.3)) {
      for (std::size_t r = 0; r < replicas_.size(); ++r) {
        if (!replicas_[r].trainer && !replicas_[r].crashed) candidates.push_back(static_cast<int>(r));
      }
    }
    // Trainers crash too (a lost node): mid-publish, mid-unpublish, while serving.
    if (rng_.chance(0.2)) {
      candidates.clear();
      for (std::size_t r = 0; r < replicas_.size(); ++r) {
        if (replicas_[r].trainer && !replicas_[r].crashed) candidates.push_back(static_cast<int>(r));
      }
    }
    if (candidates.empty()) return;
    const int replica = candidates[rng_.below(candidates.size())];
    if (replicas_[replica].crashed) return;
    // Mostly back within seconds; sometimes (a spot instance reclaimed for a while) much later.
    const TimeMs restart_after_ms = rng_.chance(0.2) ? rng_.range(10'000, 30'000) : rng_.range(1000, 6000);
    crash(replica, restart_after_ms);
    if (knobs_.rack_crashes) crash_rack_of(replica, restart_after_ms);
  }

  // The other rollout replicas of `replica`'s datacenter that serve a transfer now go with it.
  void crash_rack_of(int replica, TimeMs restart_after_ms) {
    std::set<int> serving;
    for (const auto& [key, flow] : flows_) {
      for (int source : this->serving(flow)) {
        const int r = workers_[source].replica;
        if (r != replica && !replicas_[r].trainer && !replicas_[r].crashed &&
            replicas_[r].datacenter == replicas_[replica].datacenter) {
          serving.insert(r);
        }
      }
    }
    if (options_.verbose && !serving.empty()) {
      std::cerr << now_ << " ms: " << replicas_[replica].name << "'s rack goes too (" << serving.size() << " replicas)\n";
    }
    for (int r : serving) crash(r, restart_after_ms);
  }

  void storm() {
    std::vector<int> spot;
    for (std::size_t r = 0; r < replicas_.size(); ++r) {
      if (replicas_[r].spot && !replicas_[r].crashed) spot.push_back(static_cast<int>(r));
    }
    if (options_.verbose) std::cerr << now_ << " ms: preemption storm over " << spot.size() << " spot replicas\n";
    for (int replica : spot) {
      if (rng_.chance(0.7)) crash(replica, rng_.range(2000, 10'000));
    }
  }

  // The replica's processes end (a crash, or their framework stopping them) and come back after
  // `restart_after_ms` as a new incarnation.
  void crash(int index, TimeMs restart_after_ms, bool fault = true, const char* why = nullptr) {
    Replica& replica = replicas_[index];
    replica.crashed = true;
    if (fault) ++result_.crashes;
    if (options_.verbose) {
      std::cerr << now_ << " ms: " << replica.name << " "
                << (why != nullptr ? why : fault ? "crashed" : "diverged: its framework restarts it") << "\n";
    }
    const bool reset = rng_.chance(0.5);  // sometimes the server sees the connection drop at once
    for (int w : replica.workers) {
      Worker& worker = workers_[w];
      trace_.instant(w + 1, fault ? "crash" : "restart after divergence", "failure", now_);
      if (reset && worker.alive) {
        Event event(EventKind::kToServer, worker.agent->server() == 0 && servers_alive_[0] ? 0 : 1);
        event.message = ConnectionLost{worker.client};
        schedule(now_ + delay(worker), std::move(event));
      }
      // The restarted process opens above any incarnation this one reached on its own.
      if (worker.agent) replica.incarnation = std::max(replica.incarnation, worker.agent->incarnation());
      if (worker.alive) replica.dead_clients.push_back(worker.client);
      worker.alive = false;
      worker.agent.reset();
      worker.grants.clear();
      worker.offloads.clear();
      worker.offloads_corrupt.clear();
      worker.finished_reads.clear();
      worker.resumable.reset();
      worker.buffer_version.reset();
      worker.buffer_bytes = 0;
      worker.buffer_corrupt = worker.buffer_tampered = false;
      worker.patch.reset();
      std::erase_if(flows_, [&](const auto& entry) { return entry.second.reader == w; });
    }
    schedule(now_ + restart_after_ms, Event(EventKind::kRestart, index, ++replica.restart_token));
    schedule(now_ + eviction_bound_ms(), Event(EventKind::kEvictionDue, index, replica.restart_token));
  }

  // Failed clients are evicted within the heartbeat timeout (DESIGN.md §5.6), counted from the
  // last message of theirs that can still arrive, plus a tick of the hub.
  TimeMs eviction_bound_ms() const {
    const TimeMs last_arrival_ms = knobs_.delay_min_ms + 2 * knobs_.delay_mean_ms + knobs_.clog_ms;
    return last_arrival_ms + knobs_.heartbeat_timeout_ms + 2 * kHubTickMs;
  }

  // How long a restarting run's replicas stay stopped (before kRunRestartJitterMs): until every
  // hub must have ended the model: each process evicted (eviction_bound_ms), then no replica for
  // the model grace, counted by the hub's ticks.
  TimeMs run_stopped_ms() const { return eviction_bound_ms() + knobs_.model_grace_ms + 2 * kHubTickMs; }

  // A run restarts from version 1 in its model's name (knob run_restart): a trainer starting over
  // from step 0, as RL runs do from a checkpoint or from scratch. Every replica of one model stops
  // (its framework ends the job); they come back as a new job once the hub must have ended the
  // model (README, "A model's life"), and the trainers publish version 1 again. The new run's
  // bytes are not the old run's (content_model), so a copy or checksum of the old run handed out
  // in the new one fails the integrity checks.
  void restart_run() {
    const int model = static_cast<int>(rng_.below(knobs_.models));
    const TimeMs stopped_ms = run_stopped_ms() + rng_.range(0, kRunRestartJitterMs);
    ++result_.run_restarts;
    trace_.instant(0, "run of model " + models_[model] + " restarts", "failure", now_, /*global=*/true);
    if (options_.verbose) {
      std::cerr << now_ << " ms: the run of model " << models_[model] << " restarts from version 1; its replicas are back in "
                << stopped_ms << " ms\n";
    }
    // Those crashed already (a restart pending) stay down with the others: crash() schedules anew.
    // A model's only trainer may not be refused version 1 (another trainer of the new run may
    // have published above it first).
    const auto trainers = std::count_if(replicas_.begin(), replicas_.end(), [&](const Replica& replica) {
      return replica.model == model && replica.trainer;
    });
    for (std::size_t r = 0; r < replicas_.size(); ++r) {
      if (replicas_[r].model != model) continue;
      crash(static_cast<int>(r), stopped_ms, /*fault=*/false, "stops: its run restarts");
      if (replicas_[r].trainer) {
        replicas_[r].next_version = 1;
        replicas_[r].fresh_run = trainers == 1;
      }
    }
    ++runs_[model];
    published_[model] = 0;
  }

  // The model number a shard's bytes are derived from: the model's, and its run's (knob
  // run_restart), so that version v of one run is not version v of another.
  int content_model(int model) const {
    const auto run = runs_.find(model);
    return model + (run == runs_.end() ? 0 : static_cast<int>(run->second) * kRunContentStride);
  }

  void check_evicted(int index) {
    const Replica& replica = replicas_[index];
    for (ClientId client : replica.dead_clients) {
      for (int server = 0; server < 2; ++server) {
        if (servers_alive_[server] && servers_[server]->has_client(client)) {
          throw Violation("liveness: server " + std::to_string(server) + " still counts client " +
                          std::to_string(client) + " of " + replica.name +
                          ", which crashed more than the heartbeat timeout (" +
                          std::to_string(knobs_.heartbeat_timeout_ms) + " ms) ago");
        }
      }
    }
  }

  void restart(int index) {
    Replica& replica = replicas_[index];
    replica.crashed = false;
    replica.dead_clients.clear();
    ++replica.incarnation;
    start_replica(index, 0);
  }

  void heal() {
    faults_on_ = false;
    if (options_.verbose) std::cerr << now_ << " ms: faults healed; liveness phase\n";
    trace_.instant(0, "faults healed", "phase", now_, /*global=*/true);
    for (Worker& worker : workers_) {
      worker.clogged_until = worker.cut_up_until = worker.cut_down_until = 0;
    }
    for (auto& [key, flow] : flows_) flow.fail_at_progress = -1;
    for (std::size_t r = 0; r < replicas_.size(); ++r) {
      if (replicas_[r].crashed) restart(static_cast<int>(r));
    }
    // Trainers publish fresh versions, the last of which they keep: every rollout must converge to
    // it (to latest-k when rollouts lag by k: so k + 1 fresh versions, since a version of the fault
    // phase may be lost). The target is the replica's, not each shard's: its shards run one program.
    for (Replica& replica : replicas_) {
      if (!replica.trainer) continue;
      Version newest = 0;
      for (int w : replica.workers) newest = std::max(newest, workers_[w].app.version);
      replica.final_target = newest + 1 + knobs_.off_by;
      for (int w : replica.workers) workers_[w].app.final_target = replica.final_target;
    }
  }

  void check_liveness() {
    std::ostringstream problems;
    const TimeMs bound = knobs_.liveness_ms;
    for (std::size_t w = 0; w < workers_.size(); ++w) {
      const Worker& worker = workers_[w];
      const Replica& replica = replicas_[worker.replica];
      if (!worker.alive) continue;
      const App& app = worker.app;
      const std::string who = replica.name + "/" + std::to_string(worker.shard);
      if (app.in_call && now_ - app.call_started_ms >= bound) {
        const auto& held = worker.agent->held();
        problems << who << "'s " << app.call_name << " has not returned for "
                 << (now_ - app.call_started_ms) << " ms (agent " << agent_phase_name(worker.agent->phase())
                 << " holding " << (held ? "v" + std::to_string(held->version) : "nothing")
                 << ", buffer " << (worker.buffer_version ? "v" + std::to_string(*worker.buffer_version) : "-")
                 << ", " << worker.offloads.size() << " offloads); ";
      }
      if (replica.trainer) {
        if (app.next != App::Next::kDone) problems << who << " never published its final version; ";
        continue;
      }
      const Version final_version = published_[replica.model];
      if (final_version < knobs_.off_by) continue;
      const Version expected = final_version - knobs_.off_by;
      // update(latest-k) never moves a replica back: one that replicated a newer version (the
      // workloads call replicate with every selector) keeps it once the trainers stop.
      if (!app.told_known || !app.told || *app.told < expected || *app.told > final_version) {
        problems << who << " was told it holds "
                 << (!app.told_known ? "?" : app.told ? "v" + std::to_string(*app.told) : "nothing")
                 << ", not v" << expected
                 << (knobs_.off_by > 0 ? "..v" + std::to_string(final_version) : std::string()) << "; ";
      }
    }
    if (!problems.str().empty()) {
      // What the serving hub thinks, to read the failure by.
      const Hub& hub = *servers_[servers_alive_[0] ? 0 : 1];
      const HubActivity activity = hub.activity();
      problems << "hub: " << activity.transfers_gathering << " transfers gathering, "
               << activity.transfers_waiting << " waiting, " << activity.transfers_active
               << " active, " << activity.copies_draining << " copies draining, "
               << activity.copies_offloading << " offloading, " << hub.client_count() << " clients;";
      for (const auto& [key, flow] : flows_) {
        const Worker& reader = workers_[flow.reader];
        problems << " flow " << replicas_[reader.replica].name << "/" << reader.shard << "<-"
                 << flow.read.source.replica << " t" << flow.read.transfer << "/" << flow.read.epoch
                 << " v" << flow.read.version << " " << static_cast<std::uint64_t>(flow.progress)
                 << "B" << (flow.granted ? " granted" : " ungranted");
        if (flow.reshard) problems << " across layouts (" << flow.landed << "/" << flow.reshard->pieces() << " pieces)";
        if (flow.source >= 0) {
          const Worker& source = workers_[flow.source];
          problems << " (source " << (source.alive ? "alive" : "dead") << " buffer v"
                   << (source.buffer_version ? std::to_string(*source.buffer_version) : "-") << " "
                   << source.buffer_bytes << "B)";
        }
        problems << ";";
      }
      for (const std::string& model : models_) {
        const auto snapshot = hub.snapshot(model);
        if (!snapshot) continue;
        problems << " " << model << " latest "
                 << (snapshot->latest ? std::to_string(*snapshot->latest) : "-") << ":";
        for (const auto& replica : snapshot->replicas) {
          problems << " " << replica.name << "#" << replica.incarnation << "=" << replica.state
                   << (replica.version ? "@" + std::to_string(*replica.version) : "");
        }
      }
      throw Violation("liveness: within " + std::to_string(bound) + " ms of healing: " + problems.str());
    }
    check_offload_memory();
  }

  // Settled, the offload copies in a live worker's CPU memory are exactly those the server counts
  // for its replica: one it does not count is memory nobody ever frees (a leak that grows with
  // every version), one it counts that the worker does not hold is a copy retention relies on in
  // vain. Late, repeated and lost instructions (knobs stale, duplicate, drop, partition) are what
  // tend to break this: a shard reports each offload copy it keeps until the server renames or
  // releases it, and the server answers a report of a copy it does not count with its release.
  void check_offload_memory() const {
    const Hub& hub = *servers_[servers_alive_[0] ? 0 : 1];
    for (const Worker& worker : workers_) {
      if (!worker.alive || worker.agent->phase() != AgentPhase::kOpen) continue;
      const Replica& replica = replicas_[worker.replica];
      const auto snapshot = hub.snapshot(models_[replica.model]);
      if (!snapshot) continue;
      const auto listed = std::find_if(snapshot->replicas.begin(), snapshot->replicas.end(), [&](const auto& info) {
        return info.name == replica.name && info.incarnation == worker.agent->incarnation();
      });
      if (listed == snapshot->replicas.end() || listed->state == "resuming") continue;
      std::set<Version> in_memory;
      for (const auto& [version, bytes] : worker.offloads) in_memory.insert(version);
      const std::set<Version> counted(listed->offloads.begin(), listed->offloads.end());
      if (in_memory == counted) continue;
      auto versions = [](const std::set<Version>& set) {
        std::string text;
        for (Version version : set) text += " v" + std::to_string(version);
        return text.empty() ? std::string(" none") : text;
      };
      throw Violation("retention: " + replica.name + "/" + std::to_string(worker.shard) +
                      " holds offload copies of" + versions(in_memory) + " in CPU memory at the end, where the server counts" +
                      versions(counted));
    }
  }

  void fail(std::string what) {
    if (!result_.ok) return;
    result_.ok = false;
    result_.violation = "at " + std::to_string(now_) + " ms: " + std::move(what);
    finished_ = true;
  }

  SimOptions options_;
  Knobs knobs_;
  Rng rng_;
  Trace trace_;
  Observer observer_;
  SimResult result_;
  TimeMs now_ = 0;
  bool finished_ = false;
  bool faults_on_ = true;
  TimeMs server_crash_at_ = -1;
  TimeMs storm_at_ = -1;
  TimeMs run_restart_at_ = -1;
  std::map<int, std::uint32_t> runs_;  // per model, how many times its run restarted (knob run_restart)
  std::unique_ptr<Hub> servers_[2];
  bool servers_alive_[2] = {true, true};
  std::vector<std::string> models_;
  std::vector<Replica> replicas_;
  std::vector<Worker> workers_;
  std::map<ClientId, int> clients_;
  ClientId next_client_ = 1;
  std::map<std::pair<int, TransferId>, Flow> flows_;
  // For check_corrupt_notice, by (replica, version), kept for the whole run (a notice may arrive
  // after the buffers were written anew): copies that held bytes a fault changed, and reads of a
  // copy that a bit flip hit on the way.
  std::set<std::pair<std::string, Version>> held_bad_bytes_;
  std::map<std::pair<std::string, Version>, std::uint64_t> flipped_reads_of_;
  // While an agent hears that an offload copy was made of buffers that had moved on: its version.
  std::optional<Version> torn_offload_;
  bool data_tick_scheduled_ = false;
  std::map<int, Version> published_;  // per model, the newest version a trainer published
  std::map<std::tuple<int, std::uint64_t, std::uint64_t>, Outcome> answers_;  // replica, incarnation, call
  std::priority_queue<HeapKey, std::vector<HeapKey>, std::greater<>> heap_;
  std::vector<Event> slab_;
  std::vector<std::uint32_t> free_;
  std::uint64_t next_seq_ = 0;
  Effects hub_effects_;
  AgentEffects agent_effects_;
  std::set<std::pair<std::size_t, std::uint64_t>> seed_copies_;  // (server, copy) seen seeding
  const PlanLoop* plan_;   // a capacity plan's loop (options_.plan), or none
  std::unordered_map<std::string, int> replica_index_;  // by name
  std::uint64_t hub_checks_skipped_ = 0;
  std::uint32_t gpus_placed_ = 0;  // GPUs (workers) placed on machines so far
  std::uint32_t nodes_ = 0;
  // The data tick's scratch: flows per NIC (workers: up, down; machines: across datacenters).
  std::vector<std::uint32_t> uploads_;
  std::vector<std::uint32_t> downloads_;
  std::vector<std::uint32_t> remote_up_;
  std::vector<std::uint32_t> remote_down_;
  std::uint32_t remote_flows_ = 0;
  std::vector<std::pair<int, TransferId>> tick_keys_;
};

}  // namespace

std::string SimResult::summary() const {
  std::ostringstream out;
  out << (ok ? "ok" : "VIOLATION") << ": " << events << " events, "
      << static_cast<double>(virtual_ms) / 1000.0
      << " s simulated, " << calls << " calls, " << versions << " publishes, " << reads
      << " shard reads (" << reads_failed << " failed"
      << (reads_across > 0 ? ", " + std::to_string(reads_across) + " across layouts" : std::string())
      << (patch_reads > 0 ? ", " + std::to_string(patch_reads) + " patches" : std::string()) << "), "
      << crashes << " crashes, "
      << divergence_restarts << " divergence restarts, "
      << (run_restarts > 0 ? std::to_string(run_restarts) + " run restarts, " : std::string())
      << (models_ended > 0 ? std::to_string(models_ended) + " models ended, " : std::string())
      << (corrupt_notices > 0 ? std::to_string(corrupt_notices) + " corrupt-copy notices, " : std::string())
      << (readers_put_ahead + slow_sources_passed > 0
              ? std::to_string(readers_put_ahead) + " readers put ahead of slower ones (" +
                    std::to_string(readers_passed_mid_read) + " on the way), " +
                    std::to_string(slow_sources_passed) + " slow sources passed, "
              : std::string())
      << evictions
      << " evictions, " << failovers << " failovers, " << offloads << " offloads, " << seeds
      << " seeds, " << messages
      << " messages (" << messages_lost << " lost, " << stale_messages << " again late), trace hash " << std::hex << trace_hash << std::dec;
  return out.str();
}

double plan_nic_factor(std::uint64_t seed, std::uint64_t gpu, double jitter) {
  if (jitter <= 0) return 1;
  std::uint64_t x = seed * 0x9E3779B97F4A7C15ULL ^ (gpu + 1) * 0xBF58476D1CE4E5B9ULL;
  x ^= x >> 31;
  x *= 0xD6E8FEB86659FD93ULL;
  x ^= x >> 32;
  const double unit = static_cast<double>(x >> 11) * 0x1.0p-53;
  return 1 - jitter * unit;
}

SimResult simulate(const SimOptions& options) {
  Simulation simulation(options);
  return simulation.run();
}

}  // namespace th::sim
