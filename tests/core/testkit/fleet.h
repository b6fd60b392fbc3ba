// A fleet of simulated SPMD replicas around one Hub, for model-based property tests.
//
// Every replica has a program (the calls its user code makes, appended by `plan`); each of its
// shards runs the program on its own pace (`step`), as real model-parallel workers do. The data
// plane, offloads, crashes, clock and server failover are actions too. Actions resolve against the
// fleet as it is when they run (an action with nothing to act on does nothing), so every generated
// sequence is valid and RapidCheck can shrink freely.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <ostream>
#include <string>
#include <vector>

#include <rapidcheck.h>
#include <rapidcheck/state.h>

#include "tests/core/testkit/driver.h"
#include "tests/core/testkit/program.h"

namespace th::test {

struct FleetSpec {
  struct ModelSpec {
    std::string name;
    std::uint32_t num_shards = 1;
    // The model's tensors are sliced (testkit/driver.h sliced_layout_for): replicas of other shard
    // counts read its copies across layouts. Otherwise the testkit's own tensors (layout_for).
    bool sliced = false;
  };
  struct ReplicaSpec {
    std::uint32_t model = 0;
    std::string name;
    std::string datacenter;
    bool spot = false;
    bool trainer = false;
    Retention retention;
    std::uint32_t num_shards = 0;  // 0: the model's; another (of a sliced model): another layout
  };
  HubSettings settings;
  std::vector<ModelSpec> models;
  std::vector<ReplicaSpec> replicas;
  bool faults = true;   // crashes, failed reads, failovers
  bool closes = true;   // close and divergent calls (a replica leaving on purpose)
};
std::ostream& operator<<(std::ostream& out, const FleetSpec& spec);
// The shard count of replica `replica`: its own, else its model's.
std::uint32_t shards_of(const FleetSpec& spec, std::uint32_t replica);

// With `layouts`, now and then a model is sliced and its rollouts draw their own shard count (reads
// across layouts); without, every replica has its model's shard count and the testkit's tensors
// (the agents of testkit/cluster.h do not model reads across layouts). A fleet has
// replicas_min..6 replicas (2..6), its first ones the models' trainers.
rc::Gen<FleetSpec> gen_fleet(bool faults, bool closes, bool layouts = true, int replicas_min = 2);

// What every generated fleet shares: short heartbeat and barrier timeouts (a few ticks evict a
// crashed replica), faults and closes as asked. gen_fleet draws the rest.
FleetSpec fleet_base(bool faults, bool closes);
// The fleet with every rollout spot and every trainer keeping the latest version and the one
// before (HubModel.SpotReplicasNeverCountForRetention).
FleetSpec only_spot_rollouts(FleetSpec spec);

struct Action {
  enum class Kind : std::uint8_t {
    kPlan,        // append an op to replica a's program: op b with parameters c, d; if `go`, every
                  // shard of the replica steps right away
    kStep,        // shard b of replica a issues its next op (opening first if needed)
    kStepAll,     // every shard of replica a steps
    kFinishRead,  // the a-th outstanding read completes
    kFailRead,    // the a-th outstanding read fails: b % 3 says why (source unreachable, source
                  // refused, the bytes failed their checksums)
    kOffload,     // the a-th outstanding offload instruction is carried out
    kCrash,       // replica a dies (b: its connection drops at once)
    kTick,        // time passes: a * 100 ms
    kDiverge,     // shard b of replica a calls list instead of its program's next op
    kFailover,    // the server dies; a fresh one takes over and every live shard re-opens
    kBurst,       // every rollout plans update(latest) (a: or replicate) and steps at once: a
                  // step boundary, where readers chain into pipelines
    kCrashSource, // the a-th replica that serves a read dies, its connection dropping: the copies
                  // pipelining from it lose their root mid-transfer (DESIGN.md §5.6); b == 1:
                  // the a-th rollout that serves a read
    kCancel,      // shard b of replica a cancels its call in flight (CancelCall)
  };
  Kind kind = Kind::kTick;
  std::uint32_t a = 0;
  std::uint32_t b = 0;
  std::uint32_t c = 0;
  std::uint32_t d = 0;
  bool go = false;
};
std::ostream& operator<<(std::ostream& out, const Action& action);
std::string_view action_name(Action::Kind kind);  // as operator<< prints it: "finish-read"
// Why a read fails, for a fail-read's `b`: unreachable, refused, checksums failed (b % 3).
ReadFailure read_failure_of(std::uint32_t choice);

rc::Gen<Action> gen_action(const FleetSpec& spec);
// Actions that grow chains: rollouts replicate the latest version, reads finish, sources die, the
// trainer publishes anew now and then.
rc::Gen<Action> gen_chain_action(const FleetSpec& spec);

// Chains of pipelined sources whose roots fail (HubModel.ChainsAcrossDatacentersConverge): one
// model of one shard, pipelines with one reader per source, smart skipping, four datacenters.
// One to three chains grow in dc0 from complete sources there, each one to three readers long
// and read at its end from a datacenter of its own; the trainer's one slot may be taken; then
// sources die in any order, and random actions follow. Such chains need more replicas and a more
// careful order than random programs over gen_fleet's fleets reach (roots that wait for each
// other's chains: the mutant 'waiting-chain-counts'). In half the cases the model is sliced and
// each chain holds a layout of its own (the first two different ones).
struct ChainCase {
  FleetSpec spec;
  std::vector<Action> program;
};
rc::Gen<ChainCase> gen_chain_case();

// Rollouts of uneven speed (HubModel.UnevenReadersConverge): one trainer and three to five
// rollouts of a two-shard model in one datacenter, fan-out 1 or 2; version after version every
// rollout updates at once, and their shards' reads finish at uneven times (time passes between
// finishes), so the hub measures some replicas slow and reorders the next version's chain
// (core/hub_rates.cpp: readers put ahead of slower copies, which read again behind them); random
// actions (crashed sources, failed reads) follow.
rc::Gen<ChainCase> gen_uneven_case();

class Fleet {
 public:
  explicit Fleet(const FleetSpec& spec);
  void apply(const Action& action);
  // Opens every shard of every replica, so that all retention rules hold from the start.
  void open_all();
  // Faults stop; every live shard runs its program to the end; reads and offloads complete; time
  // passes. Then nothing may be left in flight (DESIGN.md §5.6, liveness).
  void heal_and_check_liveness();
  // Without crashes: every version the hub retains and that was ever complete can be read by a new
  // replica (DESIGN.md §5.2, retention).
  void check_retained_versions_readable();

  Driver& driver() { return driver_; }
  const Driver& driver() const { return driver_; }
  const Reference& reference() const { return reference_; }

  // What a run exercised, for RC_CLASSIFY: a property that passes without doing anything proves
  // nothing.
  struct Coverage {
    std::size_t reads_done = 0;
    std::size_t reads_failed = 0;
    std::size_t pipelined_reads = 0;
    std::size_t cross_dc_reads = 0;
    std::size_t offloads = 0;
    std::size_t evictions = 0;
    std::size_t failovers = 0;
    std::size_t unavailable = 0;
    std::size_t cancels = 0;  // CancelCall sent for a call in flight
    std::size_t checksum_failures = 0;  // reads whose bytes failed their checksums
    std::size_t reshard_reads = 0;      // reads of a copy of another layout, done
  };
  const Coverage& coverage() const { return coverage_; }

 private:
  struct ShardRun {
    ClientId client = 0;          // 0: not open
    bool opened = false;          // got OpenOk
    std::uint64_t open_seq = 0;
    std::optional<Resume> resume;  // announced by the open in flight
    std::size_t next_op = 0;      // index into the replica's program
    std::optional<std::uint64_t> pending_seq;
    bool pending_diverged = false;  // the pending call is not the program's next op
    bool wrote_buffers = false;   // the pending call received a StartRead
    bool closed = false;
    std::uint64_t last_seq = 0;
    std::optional<TxnRecord> last_txn;
    std::optional<HeldCopy> held;
    std::map<Version, HeldCopy> offloads;
    // The version whose every byte the buffers hold (published, or read to the end): what a read
    // from this shard can take whole. A source still receiving serves only what it has.
    std::optional<Version> bytes;
  };
  struct ReplicaRun {
    std::uint64_t incarnation = 1;
    bool crashed = false;
    std::vector<PlannedOp> program;
    std::vector<ShardRun> shards;
  };

  void init();
  void plan(std::uint32_t replica, std::uint32_t op, std::uint32_t p1, std::uint32_t p2);
  void step(std::uint32_t replica, std::uint32_t shard, bool diverge = false);
  void open_shard(std::uint32_t replica, std::uint32_t shard);
  void restart(std::uint32_t replica);
  void pump();
  void on_reply(std::uint32_t replica, std::uint32_t shard, const Reply& reply);
  std::vector<std::pair<ClientId, StartRead>> outstanding_reads();
  std::vector<std::pair<ClientId, Version>> outstanding_offloads();
  std::set<ClientId> silent_clients() const;
  // Whether the data plane could finish this read now: its source runs and holds every byte.
  bool can_finish(const StartRead& read) const;
  void failover();
  OpenRequest open_request(std::uint32_t replica, std::uint32_t shard) const;
  // The tensors of the replica's shards and their checksums of a version (testkit/driver.h).
  std::uint32_t sliced_shards(std::uint32_t replica) const;  // 0: not sliced
  LayoutRef layout_of(std::uint32_t replica, std::uint32_t shard) const;
  ChecksumsRef checksums_of(std::uint32_t replica, Version version, std::uint32_t shard) const;

  FleetSpec spec_;
  Driver driver_;
  Reference reference_;
  std::vector<ReplicaRun> runs_;
  std::map<ClientId, std::pair<std::uint32_t, std::uint32_t>> owners_;  // client -> replica, shard
  std::map<std::string, std::set<Version>> completed_;                  // per model, ever complete
  Coverage coverage_;
};

// The adapter between rc::state and Fleet: every command is one Action.
struct FleetCommand : rc::state::Command<FleetSpec, Fleet> {
  Action action;
  explicit FleetCommand(Action generated) : action(generated) {}
  void run(const FleetSpec&, Fleet& fleet) const override { fleet.apply(action); }
  void show(std::ostream& out) const override { out << action; }
};
rc::Gen<std::shared_ptr<const rc::state::Command<FleetSpec, Fleet>>> gen_command(
    const FleetSpec& spec);


}  // namespace th::test
