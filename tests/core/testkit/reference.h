// An independent reference model of the hub's observable semantics (DESIGN.md §4, §5; hub.h), for
// model-based property tests. It sees every input the hub gets and every effect it produces (see
// Driver::set_watcher), keeps its own deliberately simple account of the world — which versions
// exist, what each replica holds, which transfers read from whom — and checks every answer
// against what the specification says it must be:
//
//   versions     latest is the newest version that exists; latest-k is the k-th newest that exists,
//                or, if no copy of it has its bytes, the newest older one that has
//   drains       a copy still draining one drain grace after it began has no reader reading it
//   lives        a model with no replica present for model_grace_ms ends at the next tick: its
//                versions are forgotten, and an open afterwards is told no latest
//   order        a publish below latest of a version the model does not know is refused (stale);
//                one of a version it knows, or not below latest, is not; none above 2^63-1
//   replicate    resolves its selector like that, answers with that version and with the replica
//                the bytes came from, only once every shard's bytes arrived, and fails with a
//                typed error (not found, unavailable) or after its timeout, never before
//   update       moves if and only if a newer version is there, unless smart skipping says "not
//                yet" (its datacenter's only copies hang off a seeder); says what is still held
//   publish      completes when the last shard publishes, and only then
//   wait         answers as soon as its predicate holds, never before it holds, and at its deadline
//   list         shows latest and what each replica holds
//   eviction     a shard silent for longer than the heartbeat timeout is evicted at the next tick,
//                and no other
//   consistency  the shards of a replica get one answer per call; an error that ends a call for
//                one shard without being the replica's answer (evicted, closed, divergent,
//                unknown client, sequence gap) only where that shard's own situation explains
//                it: never "closed" to a shard whose peers got the answer
//   checksums    a copy whose shard failed a reader's checksums twice without a good read between
//                holds other bytes: no reader is sent to it, and it keeps no version readable
//   layouts      a replica reads a copy of another shard count only across layouts, by pieces of
//                every shard of it, and only from a complete copy; a copy receiving across layouts
//                is nobody's pipeline source; a copy that failed two reads across layouts (without
//                a good read of each shard between) is condemned as under "checksums"
//   load         a source shard serves at most fan-out-limit reads at once to readers of its own
//                datacenter, and at most as many to readers of others
//   offloads     every offload copy the hub releases is one it made (or was told of), once; at
//                the end, every one left is needed (its version retained, no other safe copy)
//   liveness     with faults healed and every read done, nothing the hub owes is left unanswered
//
// It reads nothing of the hub but its settings. Where its account cannot follow the hub exactly
// (just after a server failover, while an update's old copy drains), it says so and judges less,
// never differently: a model that guesses would fail correct hubs.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "core/messages.h"
#include "core/types.h"

namespace th::test {

class StepWatcher {
 public:
  virtual ~StepWatcher() = default;
  virtual void before_step(const Input& input, TimeMs now_ms) = 0;
  virtual void after_step(const Input& input, const Effects& effects, TimeMs now_ms) = 0;
  virtual void on_server_restart() = 0;
};

class Reference : public StepWatcher {
 public:
  explicit Reference(HubSettings settings) : settings_(settings) {}

  void before_step(const Input& input, TimeMs now_ms) override;
  void after_step(const Input& input, const Effects& effects, TimeMs now_ms) override;
  void on_server_restart() override;

  // Faults healed, reads done, time passed: every call the hub has taken is answered, except a
  // wait whose predicate does not hold and which has no timeout.
  void check_quiescent() const;

  // What the model saw, for RC_CLASSIFY.
  struct Seen {
    std::size_t answers_checked = 0;
    std::size_t resolutions = 0;   // replicate/update answers whose version the model predicted
    std::size_t not_yet = 0;
    std::size_t waits_answered = 0;
    std::size_t timeouts = 0;
    std::size_t cancels = 0;  // calls a shard cancelled while they waited
    std::size_t skipped_versions = 0;  // latest-k resolutions across a gap in version numbers
    std::size_t lives_ended = 0;       // models forgotten after their grace
    std::size_t revokes = 0;           // reads of a draining copy revoked at its drain grace
    std::size_t corrupt_notices = 0;   // owners told that readers found their copy corrupt
  };
  const Seen& seen() const { return seen_; }

 private:
  enum class Holding : std::uint8_t { kNone, kPublishing, kReceiving, kComplete, kDraining };
  struct Call {
    RequestBody body;
    OpKey op;
    TimeMs arrived_ms = 0;
    ShardSet arrived;
    ShardSet answered;
    std::optional<Outcome> answer;
    bool seeded = false;            // after a failover: redone for shards behind; not judged
    bool exact = true;              // the model could follow the hub when the call arrived
    // replicate/update: what the model expects
    std::set<Version> allowed;      // versions the selector resolved to while the call waited
    std::optional<Outcome> decided; // update: the answer decided at arrival (unless it moves)
    bool moves = false;             // update: drains and receives
    std::optional<Version> held_before;
    std::optional<std::string> last_source;  // the source of the latest StartRead
    ShardSet done;                  // shards whose TransferDone the hub got
    bool read_started = false;
    bool may_not_found = false;     // a resolution while it waited said "not found"
    bool may_unavailable = false;   // the version had no copy with its bytes while it waited
    bool may_stale = true;          // publish: the hub may answer kStaleVersion (unless arrive() says)
    // A shard that had made it cancelled it (CancelCall) while it was unanswered: the hub owes
    // every shard kCancelled at once (it may still have answered otherwise in that same step).
    bool cancelled = false;
    // Consistency: each shard's call (the hub takes the first shard's as the replica's), whether
    // some shard got the replica's answer, and whether some shard was told the replica closed.
    std::map<std::uint32_t, OpKey> ops;
    bool answered_for_all = false;
    bool closed_out = false;
    // Layouts: the shards whose request carried the testkit's (layout_for), and whether one
    // carried another. Such a call must not be carried out; one whose every shard sent the
    // testkit's must not be refused for its layout.
    ShardSet layout_good;
    bool layout_bad = false;
  };
  struct Replica {
    std::string model;
    std::string name;
    std::uint64_t incarnation = 0;
    std::string datacenter;
    std::string role;
    bool spot = false;
    std::uint32_t num_shards = 0;
    std::map<std::uint32_t, ClientId> bound;  // shards whose open the hub answered OpenOk
    bool closing = false;
    bool resuming = false;          // opened with a resume: until every shard is let in
    bool whole = false;             // every shard let in: until then calls wait
    Holding holding = Holding::kNone;
    Version version = 0;            // of the holding
    bool failed = false;            // a reader reported the primary copy
    // Checksum failures of the primary copy's shards since their last good read, and whether one
    // failed twice (corrupt: other bytes than the version's).
    ShardSet mismatched;
    bool corrupt = false;
    bool drain_unsure = false;      // an update's old copy drains or is gone: unknown which
    std::optional<TimeMs> drain_since_ms;  // its primary copy drains since (unpublish, close)
    std::map<Version, std::uint64_t> offloads;  // complete offload copies (id)
    std::map<Version, std::uint64_t> offloading;
    std::map<Version, ShardSet> offload_reported;  // shards that reported the copy made
    std::set<Version> failed_offloads;             // a reader reported the offload copy
    std::map<Version, ShardSet> offload_mismatched;  // as `mismatched`, of offload copies
    std::set<Version> corrupt_offloads;
    std::map<std::uint64_t, Call> calls;
    std::uint64_t resumed_at = 0;   // calls up to this one may be redone after a failover (seeded)
  };
  struct Client {
    std::string key;                // of its replica
    std::uint32_t shard = 0;
    std::uint64_t session = 0;
    std::uint64_t open_seq = 0;
    bool bound = false;
    std::uint64_t last_seq = 0;
    TimeMs last_seen_ms = 0;
    std::shared_ptr<const Resume> resume;
    std::optional<Request> waiting;  // a call made before every shard of its replica was let in
    OpenRequest open;               // as sent (the replica it names, if the model lost it since)
    std::optional<std::pair<std::uint64_t, Outcome>> last_answer;  // repeated to retransmissions
    // The binding before the last open (a new session): effects of that session are about it.
    std::string previous_key;
    std::uint64_t previous_session = 0;
  };
  struct Transfer {                 // the reader's current read, from StartRead
    TransferId id = 0;
    std::string reader;             // replica key
    std::uint64_t call = 0;
    std::uint32_t epoch = 0;
    std::string source;             // replica key
    std::string source_dc;
    CopyKind kind = CopyKind::kPrimary;
    Version version = 0;
    bool attached = true;           // has a source now
    bool reshard = false;           // reads a copy of another layout (StartRead::reshard)
    ShardSet started;               // reader shards told to read in this epoch
    ShardSet done;
    ShardSet stopped;               // source shards told to stop serving this epoch
  };

  [[noreturn]] void fail(const std::string& what) const;
  Replica* replica_of(ClientId client);
  Replica& replica_for(const Client& client);
  std::string key_of(const OpenRequest& open) const;
  void on_open(const Request& request, const OpenRequest& open, TimeMs now_ms);
  void on_call(const Request& request, TimeMs now_ms);
  void arrive(Replica& replica, Call& call, std::uint32_t shard, TimeMs now_ms);
  void on_report(const Report& report);
  void on_reply(ClientId client, const Reply& reply, TimeMs now_ms);
  void on_open_answer(ClientId client, const Reply& reply, TimeMs now_ms);
  void become_whole(Replica& replica, TimeMs now_ms);
  void check_answer(Replica& replica, std::uint64_t seq, Call& call, const Outcome& outcome,
                    TimeMs now_ms);
  void apply_answer(Replica& replica, std::uint64_t seq, Call& call, const Outcome& outcome);
  bool refresh(Replica& replica, Call& call);
  void on_start_read(ClientId client, const StartRead& read);
  void judge_layouts(const Replica& reader, const Transfer& transfer, const StartRead& read) const;
  void judge_revoke(const Transfer& transfer, const std::set<std::string>& answered_now, TimeMs now_ms);
  // An error that ends call `seq` for shard `shard` without being the replica's answer: fails
  // unless the shard's own situation explains it.
  void judge_exit(const Replica& replica, const Call& call, std::uint32_t shard, const Client& client,
                  std::uint64_t seq, Errc code) const;
  void on_release(Replica& replica, ClientId client, const ReleaseOffload& release, const Input& input);
  // Whether `replica`'s complete offload copy of `version` is still needed: retained, and no other
  // safe copy (a non-spot replica's healthy complete copy, another healthy offload copy).
  bool offload_needed(const Replica& replica, Version version) const;
  // A reader found shard `shard` of a copy failing its checksums: the second time since the
  // shard's last good read, the copy is corrupt.
  static void strike(ShardSet& mismatched, bool& corrupt, std::uint32_t shard);
  // The replica's primary copy is a new one (or reads afresh): nothing a reader found holds.
  static void fresh_copy(Replica& replica);
  void evict(const std::string& key);
  void judge_load() const;
  void end_of_step(const Input& input, const Effects& effects, TimeMs now_ms);

  // The specification, over the model's account.
  struct Resolution {
    enum class Kind : std::uint8_t { kWait, kGo, kNotFound, kUnavailable, kUnsure };
    Kind kind = Kind::kWait;
    Version version = 0;
  };
  Resolution resolve(const std::string& model, const Selector& selector) const;
  std::optional<Version> latest(const std::string& model) const;
  bool has_bytes(const std::string& model, Version version, bool* unsure) const;
  // Whether any replica of `model` holds, publishes, receives or offloads `version` (generous: a
  // version the hub may still have a record of).
  bool held_anywhere(const std::string& model, Version version) const;
  bool smart_skip(const Replica& reader, Version version, bool* unsure) const;
  bool retained(const std::string& model, Version version) const;
  bool offload_may_go(const std::string& model, Version version) const;
  std::optional<bool> predicate_holds(const std::string& model, const WaitPredicate& predicate,
                                      std::optional<Errc>* error) const;
  bool model_unsure(const std::string& model) const;
  static bool present(const Replica& replica) { return !replica.bound.empty() || replica.resuming; }
  std::string key_of(const Replica& replica) const;
  std::string describe_holders(const std::string& model) const;

  HubSettings settings_;
  std::map<ClientId, Client> clients_;
  std::map<std::string, Replica> replicas_;                 // by model/name#incarnation
  std::map<std::string, std::set<Version>> existing_;       // per model
  std::map<std::string, std::set<Version>> heard_;  // per model: announced in a resume (this life)
  std::map<std::pair<std::string, std::uint64_t>, Transfer> transfers_;  // (reader, call)
  std::set<std::string> unsure_models_;  // after a failover, until its replicas are back
  std::map<std::string, TimeMs> idle_since_;  // per model: since when no replica of it is present
  // This step: the replicas the hub evicts (by key, with the reason), and the offload copies it
  // releases (replica key, copy id). Offload copies released on this server, by id: never twice.
  std::map<std::string, Errc> evicted_now_;
  std::set<std::pair<std::string, std::uint64_t>> released_now_;
  // This step's reports: the whole copies whose bytes of a shard became corrupt (failed readers'
  // checksums twice), whose owner's shard is told (CopyCorrupt); `required`: the model is sure it
  // is whole (a draining copy may have gone within the step).
  struct CorruptNews {
    std::string key;
    Version version = 0;
    bool offload = false;
    std::uint32_t shard = 0;
    bool required = false;
  };
  std::vector<CorruptNews> corrupt_now_;
  void judge_corrupt_notices(const Effects& effects);
  std::set<std::uint64_t> released_;
  Seen seen_;
};

}  // namespace th::test
