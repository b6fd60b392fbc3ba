// A test driver for the Hub: one process plays every client (paper §4.6). It assigns sequence
// numbers, routes effects into per-client inboxes, checks the hub's invariants after every step and
// feeds every effect to an Observer that checks DESIGN.md §5 from the outside.
#pragma once

#include <cstdint>
#include <deque>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "core/hub.h"
#include "sim/observer.h"
#include "tests/core/testkit/program.h"
#include "tests/core/testkit/reference.h"

namespace th::test {

using sim::Observer;

// Deterministic tensors: shard s of every version has two tensors, "layer.<s>.weight" (the shard's
// own, of shape [bytes / 2] bfloat16) and "bias" (a piece of the model's tensor of float32 [16],
// which every shard holds whole); checksums depend on the version, so that a mix-up of versions is
// visible. A fault makes the layout one the hub must refuse (README "Layouts"): kBadBox holds
// only half of "bias" (a gap on a publisher, another box for a reader); kTransposed gives the
// weight the shape [2, bytes / 4] (as many bytes, another shape).
LayoutRef layout_for(std::uint32_t shard, std::uint64_t bytes = 4096, LayoutFault fault = LayoutFault::kNone);
ChecksumsRef checksums_for(Version version, std::uint32_t shard);

// The tensors of a model sliced like a tensor-parallel one (README "Layouts"): every tensor is a
// piece of the model's, "weight" (bfloat16 [12, 128]) split by rows among the replica's shards and
// "bias" (float32 [16]) held whole by each, so that replicas of any shard count from 1 to
// kSlicedShardsMax read each other's copies, across layouts. The checksums depend on the shard
// count too: the same version assembled in another layout has other bytes per shard.
inline constexpr std::uint32_t kSlicedShardsMax = 4;
LayoutRef sliced_layout_for(std::uint32_t shard, std::uint32_t num_shards, LayoutFault fault = LayoutFault::kNone);
ChecksumsRef sliced_checksums_for(Version version, std::uint32_t shard, std::uint32_t num_shards);

struct Inbox {
  std::deque<Reply> replies;
  std::map<TransferId, StartRead> reads;  // the latest instruction per transfer
  std::map<std::pair<TransferId, std::uint32_t>, ServeRead> grants;
  std::vector<Version> offloads;          // offload instructions not yet answered
  std::map<Version, std::uint64_t> offload_copies;  // the copy id of the latest one per version
  std::vector<Version> releases;
  std::vector<CopyCorrupt> corrupt_notices;  // readers found this shard's copy corrupt
  std::vector<Evicted> evictions;
  std::uint64_t session = 0;  // of the last effect routed here
  std::uint32_t num_shards = 0;  // of the replica, as its open said
};

struct ReplicaSpec {
  std::string model = "m";
  std::string name;
  std::uint32_t num_shards = 1;
  std::string datacenter = "dc0";
  bool spot = false;
  std::string role = "rollout";
  Retention retention;
  std::uint64_t incarnation = 1;
};

class Driver {
 public:
  explicit Driver(HubSettings settings = {});
  Hub& hub() { return *hub_; }
  const Hub& hub() const { return *hub_; }
  // Server failover: a fresh hub with the same settings replaces the old one. Inboxes and sequence
  // numbers of the old clients are dropped; clients re-open under new ids.
  void restart_server();
  Observer& observer() { return observer_; }
  // Sees every step's input and effects (the reference model); not owned.
  void set_watcher(StepWatcher* watcher) { watcher_ = watcher; }
  TimeMs now_ms() const { return now_ms_; }

  // Raw steps.
  void step(const Input& input);
  ClientId new_client() { return next_client_++; }
  void open(ClientId client, const OpenRequest& request, std::uint64_t seq = 0);
  std::uint64_t call(ClientId client, RequestBody body);  // returns the seq used
  void report(ClientId client, ReportBody body);
  void lose_connection(ClientId client);
  // Advances the clock; every client not in `silent` heartbeats first.
  void advance(TimeMs ms, const std::set<ClientId>& silent = {});

  Inbox& inbox(ClientId client) { return inboxes_[client]; }
  const Inbox& inbox_of(ClientId client) const {
    static const Inbox kEmpty;
    const auto found = inboxes_.find(client);
    return found == inboxes_.end() ? kEmpty : found->second;
  }
  bool has_reply(ClientId client) { return !inboxes_[client].replies.empty(); }
  std::optional<Reply> take_reply(ClientId client);
  std::uint64_t next_seq(ClientId client) { return seqs_[client]; }
  void set_next_seq(ClientId client, std::uint64_t seq) { seqs_[client] = seq; }

  // Conveniences for tests that run whole replicas. They EXPECT success and fail the test otherwise.
  OpenRequest open_request(const ReplicaSpec& spec, std::uint32_t shard) const;
  std::vector<ClientId> open_replica(const ReplicaSpec& spec);
  void publish(const std::vector<ClientId>& shards, Version version);
  // Reports every outstanding read of these clients as done (the data plane "finished"); with
  // `sliced`, a read across layouts reports the checksums of the sliced tensors it assembled.
  void finish_reads(const std::vector<ClientId>& shards, bool sliced = false);
  // Answers every outstanding offload instruction of these clients.
  void finish_offloads(const std::vector<ClientId>& shards);
  // Liveness of chains of readers (replicas by name, each waiting for a replicate): round after
  // round, every reader whose shards all read from a complete copy (starting with `complete`)
  // finishes its reads, and each answered one is complete from then on. Returns the readers left
  // unanswered after `rounds` rounds; every answer must be ReplicateOk.
  std::vector<std::string> finish_chains(const std::map<std::string, std::vector<ClientId>>& replicas,
                                         const std::vector<std::string>& readers, std::set<std::string> complete,
                                         bool sliced = false, int rounds = 20);
  // Sends `body` from every shard, in order.
  void call_all(const std::vector<ClientId>& shards, const RequestBody& body);
  // Takes one reply from every shard; all must be equal (replica consistency) and are returned once.
  std::optional<Outcome> replies(const std::vector<ClientId>& shards);

 private:
  void route(const Effects& effects);

  HubSettings settings_;
  std::unique_ptr<Hub> hub_;
  Observer observer_;
  TimeMs now_ms_ = 0;
  ClientId next_client_ = 1;
  std::map<ClientId, Inbox> inboxes_;
  std::map<ClientId, std::uint64_t> seqs_;
  std::set<std::string> model_names_;  // models whose `latest` the observer follows
  StepWatcher* watcher_ = nullptr;
};

// TH_TRACE=1 prints every input and effect of the tests' hubs (to stderr).
bool tracing();
std::string describe_input(const Input& input);
std::string describe_effect(const Effect& effect);

// Readable one-line description of an outcome, for failure messages.
std::string describe(const Outcome& outcome);
bool is_error(const Outcome& outcome, Errc code);
template <typename T>
bool is(const std::optional<Outcome>& outcome) {
  return outcome && std::holds_alternative<T>(*outcome);
}

}  // namespace th::test
