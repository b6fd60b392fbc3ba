// A cluster for agent-level model-based property tests: the same fleets and programs as Fleet
// (fleet.h), but every shard runs a real ShardAgent, and every message between agents and hubs
// crosses a network the test drives: it delivers messages in any order, loses and duplicates them.
// The data plane moves abstract bytes (which version a shard's buffers hold, and whether all of
// it), a primary server may die and a fresh backup take over, replicas crash.
//
// Checked after every action, besides the hub's own invariants, the Observer (DESIGN.md §5) and
// the reference model (reference.h):
//   - what each application sees: the shards of a replica get one answer per call; the bytes of a
//     shard are the version its application was told it holds; the buffers change only during the
//     application's replicate or update (a stale instruction obeyed shows here);
//   - what a source serves: a read completes only under the source's grant, from buffers that hold
//     the version (a grant left standing while the buffers change shows here);
//   - that no live replica whose heartbeats reach the server is evicted for silence;
//   - at the end, with the network healed: every call returns.
#pragma once

#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <variant>
#include <vector>

#include <rapidcheck.h>
#include <rapidcheck/state.h>

#include "core/agent.h"
#include "core/hub.h"
#include "sim/observer.h"
#include "tests/core/testkit/fleet.h"
#include "tests/core/testkit/program.h"
#include "tests/core/testkit/reference.h"

namespace th::test {

struct ClusterAction {
  enum class Kind : std::uint8_t {
    kPlan,        // append op b (parameters c, d) to replica a's program; `go`: every shard steps
    kStep,        // shard b of replica a makes its next call (opening first)
    kStepAll,
    kDeliver,     // the a-th message in flight arrives (any order: messages overtake each other)
    kDeliverAll,  // every message in flight arrives, in order
    kDrop,        // the a-th message in flight is lost
    kDuplicate,   // the a-th message in flight arrives twice (later)
    kFinishRead,  // the a-th read in progress completes (or fails, if its source cannot serve)
    kFailRead,    // the a-th read in progress fails, b % 3 says why (see read_failure_of)
    kOffload,     // the a-th offload copy being made is made
    kCrash,       // replica a's processes die (b: the server sees their connections drop)
    kTick,        // a * 100 ms pass
    kFailover,    // the active server dies; clients fail over to a fresh one
    kBurst,       // every rollout plans update(latest) (a: or replicate) and steps: a step boundary
    kCrashSource, // the a-th replica that serves a read dies, its connections dropping
    kReplay,      // the a-th of the last instructions the hub sent arrives again, late (stale); b == 1:
                  // the a-th of the last orders about offload copies
    kCancel,      // the application of shard b of replica a cancels its call in flight
    kTamper,      // the a-th shard that serves a read has its buffers changed under the version
                  // they hold: every read of them fails its checksums until they hold another
  };
  Kind kind = Kind::kTick;
  std::uint32_t a = 0;
  std::uint32_t b = 0;
  std::uint32_t c = 0;
  std::uint32_t d = 0;
  bool go = false;
};
std::ostream& operator<<(std::ostream& out, const ClusterAction& action);
std::string_view action_name(ClusterAction::Kind kind);  // as operator<< prints it: "deliver-all"

// `lossy`: the network loses, duplicates and reorders messages; otherwise it delivers everything,
// in order, after every action.
rc::Gen<ClusterAction> gen_cluster_action(const FleetSpec& spec, bool lossy);

class Cluster {
 public:
  Cluster(const FleetSpec& spec, bool lossy);

  void apply(const ClusterAction& action);
  // The network heals and delivers everything; every live shard runs its program to the end;
  // reads and offloads complete; time passes. Then every call must have returned.
  void heal_and_check_liveness();

  struct Coverage {
    std::size_t reads_done = 0;
    std::size_t pipelined_reads = 0;
    std::size_t reads_failed = 0;
    std::size_t offloads = 0;
    std::size_t failovers = 0;
    std::size_t evictions = 0;
    std::size_t lost = 0;
    std::size_t duplicated = 0;
    std::size_t replayed = 0;
    std::size_t reordered = 0;
    std::size_t answers = 0;
    std::size_t cancels = 0;  // the application cancelled a call in flight
    std::size_t checksum_failures = 0;  // reads whose bytes failed their checksums
    std::size_t corrupt_notices = 0;    // shards told readers found their copy corrupt
  };
  const Coverage& coverage() const { return coverage_; }
  const Reference& reference() const { return reference_; }

 private:
  struct Packet {
    std::uint64_t id = 0;
    bool to_hub = true;
    std::uint32_t server = 0;
    int worker = -1;  // to_hub: the sender; else the receiver
    ClientId client = 0;
    std::variant<Request, Report, Effect> message;
  };
  struct Worker {
    int replica = 0;
    std::uint32_t shard = 0;
    bool alive = false;
    std::unique_ptr<ShardAgent> agent;
    ClientId client = 0;
    // The process's memory.
    std::optional<Version> content;  // the version the buffers hold (part of it if !complete)
    bool complete = false;
    std::set<Version> offload_copies;
    std::map<std::pair<TransferId, std::uint32_t>, ServeRead> grants;  // the data server's
    std::map<TransferId, StartRead> reads;                             // reads in progress
    std::vector<Version> making;                                       // offload copies asked for
    // What the hub told it, as delivered: grants withdrawn, offload copies named and released.
    std::set<std::pair<TransferId, std::uint32_t>> withdrawn;
    // A copy's id as some session's server knows it: (id, the agent's session then).
    struct Named {
      std::uint64_t copy = 0;
      std::uint64_t session = 0;
    };
    std::map<Version, Named> offload_ids;  // the copy it last reported, per version
    std::map<Version, Named> released;     // the last ReleaseOffload, per version
    // The bytes: the buffers changed under the version they hold (kTamper); the reads whose bytes
    // failed their checksums (transfer -> epoch), which the agent must never report done.
    bool tampered = false;
    std::set<Version> tampered_offloads;  // offload copies made of tampered buffers
    std::map<TransferId, std::uint32_t> failed_reads;
    // The application.
    bool opened = false;
    bool in_call = false;
    std::uint64_t call_id = 0;
    OpKind call_kind = OpKind::kList;
    bool call_writes = false;
    bool opening = false;
    std::uint64_t seq_before = 0;
    std::optional<Version> told;
    bool told_known = true;
  };
  struct ReplicaRun {
    std::uint64_t incarnation = 1;
    bool crashed = false;
    std::vector<PlannedOp> program;
    std::vector<int> workers;
  };

  void plan(std::uint32_t replica, std::uint32_t op, std::uint32_t p1, std::uint32_t p2);
  void restart_finished();
  void step(std::uint32_t replica, std::uint32_t shard);
  void start_replica(std::uint32_t replica);
  void crash(std::uint32_t replica, bool connection_lost);
  void failover();
  void tick(TimeMs ms);
  void deliver(std::size_t index);
  void deliver_all(std::size_t max);
  void hub_step(std::uint32_t server, const Input& input);
  void agent_step(int worker, const AgentInput& input);
  void on_agent_effect(int worker, const AgentEffect& effect);
  void on_call_done(int worker, const CallDone& done);
  // `failure`: the read fails, for this reason, whatever the source could give.
  void finish_read(std::size_t index, std::optional<ReadFailure> failure);
  void tamper(std::size_t index);
  void make_offload(std::size_t index);
  std::vector<std::pair<int, TransferId>> reads_in_progress() const;
  std::optional<int> source_of(const StartRead& read) const;
  std::pair<std::uint64_t, std::uint64_t> place(int worker) const;
  bool peers_behind(int worker) const;
  void verify_told(int worker, const char* when) const;
  void check_offload_memory() const;
  [[noreturn]] void fail(const std::string& what) const;

  FleetSpec spec_;
  bool lossy_;
  std::unique_ptr<Hub> hubs_[2];
  bool hub_alive_[2] = {true, true};
  std::uint32_t active_ = 0;
  std::uint64_t id_base_ = 0;
  TimeMs now_ms_ = 0;
  TimeMs healed_at_ms_ = -1;  // when a lossy network became reliable (-1: it never was lossy)
  std::vector<ReplicaRun> runs_;
  std::vector<Worker> workers_;
  std::map<ClientId, int> clients_;
  ClientId next_client_ = 1;
  std::vector<Packet> network_;
  // The last instructions delivered to agents, for late copies of them (kReplay); a bounded window.
  static constexpr std::size_t kReplayWindow = 32;
  std::deque<Packet> delivered_;
  // Orders about offload copies are rare among instructions yet the ones whose late copy can rename
  // or free the wrong copy: a window of their own, replayed as often as all the rest.
  std::deque<Packet> delivered_copy_orders_;
  std::uint64_t next_packet_ = 1;
  sim::Observer observer_;
  Reference reference_;
  // Replica consistency at the application: the first answer per (replica, start, call number).
  std::map<std::tuple<int, std::uint64_t, std::uint64_t, std::uint64_t>, Outcome> answers_;
  Coverage coverage_;
};

struct ClusterCommand : rc::state::Command<FleetSpec, Cluster> {
  ClusterAction action;
  explicit ClusterCommand(ClusterAction generated) : action(generated) {}
  void run(const FleetSpec&, Cluster& cluster) const override { cluster.apply(action); }
  void show(std::ostream& out) const override { out << action; }
};
rc::Gen<std::shared_ptr<const rc::state::Command<FleetSpec, Cluster>>> gen_cluster_command(
    const FleetSpec& spec, bool lossy);

}  // namespace th::test
