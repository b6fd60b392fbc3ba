// The hub's internal state. Not part of the public API: hub.h is. Declared in a header of its own so
// that hub*.cpp and the invariant checker (invariants.cpp) share it.
//
// Ownership: Hub owns Models (unique_ptr); a Model owns its Replicas, Copies, Transfers and
// VersionRecords. Every other pointer below is non-owning and is cleared before its target dies.
//
// A copy is one replica's holding of one version (its GPU buffers: kPrimary; or a CPU copy made to
// honour retention: kOffload). Its states and transitions:
//
//   primary, published:   kPublishing --all shards published--> kComplete
//   primary, received:    kGathering --all shards called--> kWaiting <--source lost--> kActive
//                         kActive --all shards done--> kComplete
//   offload:              kOffloading --all shards reported OffloadDone--> kComplete
//   offload seed:         kWaiting <--source lost--> kActive --all shards done--> kComplete
//                         (read across datacenters into CPU memory, outside any call; serves
//                          only once complete)
//   any kComplete:        --unpublish/update/close/release--> kDraining --readers == 0--> removed
//                         (a draining primary of the last safe holder of a retained version first
//                          makes an offload copy, then is removed)
//   any state:            --replica evicted--> removed; its readers get another source
//
// Sources are kComplete copies and, under pipeline replication, kActive ones. A transfer fills one
// reader copy from one source copy at a time; `epoch` counts the sources it has had.
#pragma once

#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "core/messages.h"
#include "core/types.h"

namespace th::detail {

using DcId = std::uint32_t;
using CopyId = std::uint64_t;
using LayoutId = std::uint32_t;
inline constexpr LayoutId kNoLayout = ~LayoutId{0};

struct Model;
struct ModelLayout;
struct Replica;
struct Transfer;
struct VersionRecord;

enum class CopyState : std::uint8_t {
  kPublishing,
  kGathering,
  kWaiting,
  kActive,
  kComplete,
  kOffloading,
  kDraining,
};
std::string_view copy_state_name(CopyState state);

// Why a copy drains, and so what happens once its last reader is gone.
enum class DrainPurpose : std::uint8_t {
  kUnpublish,  // answer the unpublish transaction (after an offload if retention needs one)
  kUpdate,     // then receive the update's target version
  kClose,      // then finish the close transaction
  kRelease,    // an offload copy no longer needed: tell its owner to free it
};

// Order of preference among sources: least loaded, then complete before partial, then oldest.
// For a reader of the copy's own datacenter the load is the readers here: sharing the trainer
// that feeds a chain slows every copy on the chain, sharing a chain's end with the seed it feeds
// across slows that one seed, held back by TCP across anyway (counted by every reader, the two
// ranked alike, and a rollout that joined mid-broadcast shared the trainer and halved the whole
// chain's pace: th-plan --fanout 2 --spot 2 --remote 2). For a reader across, every reader: its
// read loads the same NIC (ordered by readers across only, the seeder took the trainer from the
// chain's root: bench/run-plan-policy, jitter 0, 2 remote, 5.08 -> 7.00 GPU-s per version). The copy id makes every key unique, so the order
// never depends on a pointer value.
struct SourceKey {
  std::uint32_t readers = 0;
  std::uint8_t partial = 0;
  CopyId id = 0;
  friend auto operator<=>(const SourceKey&, const SourceKey&) = default;
};

// What one copy adds to its version's counters and indexes. Computed from the copy alone (see
// Hub::contribution) and remembered in the copy, so that removing the contribution again is exact.
struct Contribution {
  bool eligible = false;        // in by_dc[dc].eligible under `key`: a slot for readers here
  bool eligible_across = false; // in by_dc[dc].eligible_across under `key_across`: a slot for readers elsewhere
  SourceKey key;                // for readers here: by the readers here
  SourceKey key_across;         // for readers elsewhere: by every reader
  bool servable = false;        // kComplete or kActive, not failed
  bool complete = false;        // kComplete, not failed (primary or offload)
  bool complete_primary = false;
  bool safe_primary = false;    // complete, not failed, primary of a non-spot replica
  bool safe_offload = false;    // complete, not failed, offload
  bool root = false;            // holds, or will hold without reading another copy, every byte
  bool seeding = false;         // kActive, not failed, receiving from another datacenter
  bool crossing = false;        // kActive, receiving from another datacenter (failed or not)
  LayoutId layout = kNoLayout;  // of the copy's replica, where known (a root counts under it)

  friend bool operator==(const Contribution&, const Contribution&) = default;
};

// What readers found of a copy's bytes (see Copy::failed, mismatched, corrupt).
struct CopyHealth {
  bool failed = false;
  ShardSet mismatched;
  bool corrupt = false;
};

struct Copy {
  CopyId id = 0;
  Replica* owner = nullptr;
  VersionRecord* record = nullptr;
  CopyKind kind = CopyKind::kPrimary;
  CopyState state = CopyState::kPublishing;
  ShardSet ready;                  // shards whose bytes are in place
  std::uint32_t readers = 0;       // transfers whose current source is this copy
  // Of those, the ones reading from another datacenter. The fan-out limit counts them apart from
  // the readers here (Hub::has_slot): a seeder's slow read across datacenters must not take the
  // slot the readers of the copy's own datacenter need (issue 34).
  std::uint32_t readers_across = 0;
  std::uint64_t readers_joined = 0;  // transfers that ever took this copy as their source
  std::vector<TransferId> reading;   // the transfers counted in `readers` (fan-out bounds it)
  Transfer* incoming = nullptr;    // kGathering, kWaiting, kActive
  bool failed = false;             // a reader could not read it; never chosen again
  // Shards whose bytes failed a reader's checksums since their last good read. A second failure
  // of such a shard makes the copy `corrupt`: its bytes are not the version's (a buffer written
  // while published, memory gone bad), not a reader's or a link's passing trouble, and it is
  // not even a last resort any more. A copy still receiving sheds both when it reads afresh.
  ShardSet mismatched;
  bool corrupt = false;
  CopyHealth health() const { return {failed, mismatched, corrupt}; }
  DrainPurpose drain_purpose = DrainPurpose::kUnpublish;
  // While draining: when its readers are revoked (0: not pending; Model::drain_deadlines).
  TimeMs drain_deadline_ms = 0;
  CopyId awaiting_offload = 0;     // a draining primary waits for this offload copy to complete
  // An offload copy made by offload seeding (read from another datacenter, not copied from the
  // owner's buffers): kept while its owner may still consume it (see Hub::reconcile_offloads).
  bool seed = false;
  // While kPublishing: what each shard published, committed to the model/version on completion.
  std::vector<LayoutRef> pending_layouts;
  std::vector<ChecksumsRef> pending_checksums;
  std::vector<PatchRef> pending_patches;
  // Per shard, the patch of the version against an earlier one that this copy serves (it published
  // or applied it; README "Delta versions"); empty: none. Only a complete primary copy has one.
  std::vector<PatchRef> patch;
  // Of `readers`, those reading its patch (short reads: a reader that can read the patch waits
  // for such a holder's slot, not for one that a read of the bytes holds).
  std::uint32_t patch_readers = 0;
  // A reader found that the patch did not make the version. A second one drops the patch: one
  // reader whose buffers were written behind the server's back must not cost everyone theirs.
  bool patch_suspect = false;
  Contribution counted;            // what this copy currently adds to record/model counters
  std::size_t index_in_record = 0;  // position in record->copies, for O(1) removal
};

struct DcSources {
  // Copies here that could take a reader now: one of this datacenter (`eligible`), one of another
  // (`eligible_across`). They differ only in which side of the fan-out limit is full.
  std::set<std::pair<SourceKey, Copy*>> eligible;
  std::set<std::pair<SourceKey, Copy*>> eligible_across;
  std::uint32_t servable = 0;
  std::uint32_t complete = 0;
  std::uint32_t seeding = 0;
  // Copies here that read across datacenters: while there is none, no copy here can be behind a
  // seeder (the first crossing on any chain of sources from here is a copy here).
  std::uint32_t crossing = 0;
};

struct VersionRecord {
  Version version = 0;
  bool ever_complete = false;               // some copy completed: the version "exists"
  // Per layout, per shard: fixed by the first complete copy of that layout (a copy read from
  // another layout reports what it assembled).
  std::map<LayoutId, std::vector<ChecksumsRef>> checksums;
  std::vector<Copy*> copies;                // unordered: counted and listed, never chosen from
  std::map<DcId, DcSources> by_dc;
  std::uint32_t safe_primaries = 0;
  std::uint32_t safe_offloads = 0;
  std::uint32_t complete_primaries = 0;
  std::uint32_t roots = 0;  // copies with `root`: while none is left, the version is unavailable
  // Roots by their layout (kNoLayout: a copy still publishing, of a layout not yet known): while
  // none a reader can read from is left, the version is unavailable to it.
  std::map<LayoutId, std::uint32_t> roots_by_layout;
  std::deque<Transfer*> waiting;            // transfers waiting for a source, in arrival order
  bool dirty = false;                       // sources changed since `waiting` was last retried
  // The replica whose close took the last copy a rule retained (Hub::on_close); empty if none.
  std::string left_with;
};

struct Transfer {
  TransferId id = 0;
  Copy* reader = nullptr;
  Copy* source = nullptr;        // null while waiting
  std::uint32_t epoch = 0;
  std::uint32_t failures = 0;
  ShardSet started;              // shards told to read from `source` in this epoch
  bool cross_dc = false;
  bool queued = false;           // in reader->record->waiting
  std::uint64_t txn_seq = 0;     // the reader's transaction that completes with this transfer
  std::string last_source;       // name of the replica the data came from, for the reply
  // The source is of another layout: every reader shard reads from all its shards, which serve
  // until the transfer leaves it (README "Layouts").
  bool reshard = false;
  // A seed's transfer (no call retransmits its instructions): when each shard may next be told
  // again (see Hub::resend_seed_reads).
  std::vector<TimeMs> resend_at_ms;
  // What the read's rate says of the reader (hub_rates.cpp): when this epoch's source was given,
  // how many other readers it then served (here and across: they share its upload) and whether it
  // held every byte, and the slowest rate of the shards that finished under it, in bytes per ms
  // (0: none yet).
  TimeMs assigned_ms = 0;
  TimeMs first_assigned_ms = 0;  // when its first source was given (displacements count from it)
  std::uint32_t source_readers_at_assign = 0;
  bool source_was_complete = false;
  std::uint64_t source_readers_joined = 0;  // the source's readers_joined once this one joined
  double slowest_bytes_per_ms = 0;
  // This epoch's shards that reported their progress (TransferProgress: once each), and the rate
  // each showed, in bytes per ms, by shard (empty, or 0 for a shard: none timed).
  ShardSet progress_heard;
  std::vector<double> progress_bytes_per_ms;
  // A shard's read ended sooner than its progress report allowed (Hub::check_progress_claim):
  // what the reports set of the replica's rate is undone at the read's end. For the transfer.
  bool progress_refuted = false;
  // Times a faster reader took this transfer's source from it (at most limits::kDisplacementsPerTransferMax).
  std::uint32_t displacements = 0;
  // Delta versions (hub_patches.cpp): the version the reader's buffers hold whole and healthy,
  // whose patch it may read instead of the bytes; none once a read of the bytes began or a patch
  // read failed. `patch`: this epoch reads the source's patch (epochs 1..patch_epochs did), and
  // `patched` the shards that completed under one.
  std::optional<Version> patch_base;
  bool patch = false;
  std::uint32_t patch_epochs = 0;
  ShardSet patched;
  std::vector<PatchRef> patch_read;  // the last patch source's patches, which the reader keeps
};

// The fastest of the reads of the newest version measured: rates change, and the newest
// version's reads say what is.
struct NewestFastest {
  Version version = 0;
  double bytes_per_ms = 0;  // 0: none measured
  void record(Version read_version, double read_bytes_per_ms) {
    if (read_version > version) {
      version = read_version;
      bytes_per_ms = read_bytes_per_ms;
    } else if (read_version == version && read_bytes_per_ms > bytes_per_ms) {
      bytes_per_ms = read_bytes_per_ms;
    }
  }
};

// How fast a replica receives, as the hub measured its reads (hub_rates.cpp, issue 34): the rate
// of its slowest shard over the last read that said something about it. `exact`: the replica set
// that pace itself (its source was complete and served it alone, or went clearly faster); else a
// lower bound (it read behind a slower source, or shared one). Readers do not pipeline behind a
// copy whose owner is known to receive at well under their own rate (Hub::slower).
struct ReceiveRate {
  double bytes_per_ms = 0;  // 0: never measured
  bool exact = false;
  // The last read measured, whatever it said: a reader behind this replica compares with it.
  Version last_version = 0;
  double last_bytes_per_ms = 0;
  // Timed only on the way (TransferProgress) since the last read that ended: the next progress
  // report may set it again, and a read's end does.
  bool provisional = false;
};

// Where a transaction of a replica stands.
enum class TxnStage : std::uint8_t {
  kNew,
  kPublishing,    // publish: shards are publishing into the primary copy
  kUnresolved,    // replicate: the version does not exist yet
  kDrainingOld,   // update: the held version drains before the new one is received
  kReceiving,     // replicate/update: a transfer fills the primary copy
  kDraining,      // unpublish: waiting for readers (and maybe an offload)
  kWaiting,       // wait: predicate not yet true
  kClosing,       // close: waiting for copies to drain
};

struct Txn {
  std::uint64_t seq = 0;
  OpKey op;
  ShardSet expected;  // shards that take part (all, except in a transaction seeded by failover)
  ShardSet arrived;
  ShardSet replied;
  TxnStage stage = TxnStage::kNew;
  bool seeded = false;
  std::optional<Outcome> seeded_outcome;  // failover: what the shards that completed it were told
  std::optional<Outcome> result;       // once set, every expected shard gets exactly this
  std::optional<Version> target;       // replicate/update: the version settled on
  std::optional<Version> previous;     // update: the version held before, until data moves
  // update: what readers found of the copy of `previous`. Restored after a failed update, it holds
  // the same bytes as before, so it keeps that: the copy is the same buffers whether its drain
  // finished (restore_previous) or not (undrain).
  CopyHealth previous_health;
  bool released = false;               // failed after a shard was told to read (Reply::released)
  std::vector<LayoutRef> layouts;      // replicate/update: each shard's registered layout
  TimeMs deadline_ms = 0;              // 0: none
  std::uint64_t ticket = 0;            // position in Model::unresolved / Model::waits
};

struct ShardSlot {
  std::optional<ClientId> client;
  std::uint64_t session = 0;           // of the open that bound `client`
  std::uint64_t last_seq = 0;
  std::uint64_t open_seq = 0;
  std::optional<Reply> last_reply;     // re-sent if the same request arrives again
  TimeMs last_seen_ms = 0;
  Retention retention;
  std::string endpoint;
  std::shared_ptr<const Resume> resume;
  // A call made before every shard of the replica opened: taken once they all have.
  std::optional<Request> waiting_call;
};

enum class ReplicaPhase : std::uint8_t {
  kLive,
  kResuming,  // re-opened after a failover: waits until every shard has re-opened
  kClosing,
};

struct Replica {
  Model* model = nullptr;
  std::string name;
  std::uint64_t incarnation = 0;
  std::uint32_t num_shards = 0;
  // Set once the replica's shards have all described their tensors (a publish or a read began),
  // or its resume said what it holds; the same for the rest of its incarnation.
  ModelLayout* layout = nullptr;
  DcId dc = 0;
  std::string datacenter;
  bool spot = false;
  std::string role;
  ReplicaPhase phase = ReplicaPhase::kLive;
  // Every shard has opened (at once, or in a failover barrier). Until then no call is taken: a
  // shard could otherwise be answered before a peer's open, on a server that knows less than
  // the one that peer's resume comes from (paper §4.5, "waits for all shards to switch").
  bool whole = false;
  // kResuming: when the barrier gives up; kLive and not whole: when calls stop waiting for the
  // shards that have not opened (0 while no call waits).
  TimeMs barrier_deadline_ms = 0;
  std::vector<ShardSlot> shards;
  std::uint32_t bound_shards = 0;
  ShardSet deferred_opens;  // ahead of a failover: their OpenOk waits until the others caught up
  Copy* primary = nullptr;
  std::vector<Copy*> offloads;
  // Offload seeding: the version whose last seed here failed (its sources failed it until the
  // transfer gave up): the next update of it reads the ordinary way, rather than seed again and
  // answer "not yet" for ever.
  std::optional<Version> seed_failed;
  std::map<std::uint64_t, Txn> txns;
  ReceiveRate receive_rate;
  // What receive_rate was before a read's progress reports changed it (hub_rates.cpp): that
  // read's end, if timed, supersedes them.
  std::optional<ReceiveRate> rate_before_progress;
};

struct TxnRef {
  Replica* replica = nullptr;
  std::uint64_t seq = 0;
};

// One layout of a model: how the shards of the replicas that have it hold its tensors (README
// "Layouts"). Replicas of one layout read from one another shard by shard, pipelined; a replica
// reads a copy of another layout only once that copy is complete, each reader shard from every
// shard of it (StartRead::reshard), and only if every tensor of both is a piece of the model's.
// Taken by the first replica that committed it, refined by those after (ShardLayout::refine).
struct ModelLayout {
  LayoutId id = 0;
  std::vector<LayoutRef> shards;
  bool pieces_only = false;  // every tensor of every shard is a piece (TensorKind::kPiece)
  std::uint64_t description_bytes = 0;  // of its shards' layouts (ShardLayout::description_bytes)
  // For each other layout: why replicas of this one cannot read copies of it (nullopt: they can).
  // Set for both directions when a layout is made; refining never changes a piece's description.
  std::map<LayoutId, std::optional<std::string>> reads_from;
};

struct Model {
  std::string name;
  std::vector<std::unique_ptr<ModelLayout>> layouts;  // by LayoutId; at most kLayoutsPerModelMax
  std::uint64_t description_bytes = 0;  // of its layouts: at most settings.model_description_bytes_max
  std::optional<Version> latest;
  std::map<Version, VersionRecord> versions;
  std::map<std::string, std::unique_ptr<Replica>> replicas;
  std::map<CopyId, std::unique_ptr<Copy>> copies;
  std::map<TransferId, std::unique_ptr<Transfer>> transfers;
  std::set<CopyId> offload_copies;
  // The union of the retention rules of every open shard.
  std::multiset<std::uint64_t> keep_latest;
  std::map<Version, std::uint32_t> pinned;
  // Blocked transactions, by ticket (arrival order), and call deadlines.
  std::map<std::uint64_t, TxnRef> unresolved;
  std::map<std::uint64_t, TxnRef> waits;
  std::multimap<TimeMs, TxnRef> deadlines;
  std::set<Version> versions_with_waiters;
  std::vector<Version> forgettable;  // records whose last copy went before the version completed
  bool dirty = false;  // latest, replicas or retention changed: re-evaluate blocked calls
  // Since when the model has had no replica (none: it has some). At settings.model_grace_ms past
  // it, the model ends (Hub::forget_idle_models).
  std::optional<TimeMs> idle_since_ms;
  // Draining copies whose readers are revoked at the deadline (settings.drain_grace_ms after the
  // drain began), in deadline order; exactly the copies with drain_deadline_ms != 0.
  std::set<std::pair<TimeMs, CopyId>> drain_deadlines;
  // The fastest read of the newest version measured (hub_rates.cpp): against it, a replica
  // measured exactly is slow or not. Of any shard, for putting a reader ahead of a slow copy
  // (cheap if wrong: the reader is then timed alone); of any replica of a datacenter, by its
  // slowest shard as a replica's rate is, for passing over a slow copy there for a busier source
  // (costly if wrong). At most one entry per datacenter (limits::kDatacentersMax).
  NewestFastest fastest_shard_read;
  std::map<DcId, NewestFastest> fastest_replica_read_by_dc;
  // The exact receive rates of its replicas, one per replica that has one (hub_rates.cpp): the
  // fastest says what a replica here can do, whichever version showed it (the newest version's
  // reads may all have gone behind a slow member); with one only, nothing to compare it with.
  std::multiset<double> exact_rates_bytes_per_ms;
  // Whether two of its replicas have had exact rates at once: from then on the hub compares
  // (Hub::unexplored), even if one leaves or a noisy read turns an exact rate into a lower bound.
  bool exact_rates_compared = false;
};

struct Binding {
  Replica* replica = nullptr;
  std::uint32_t shard = 0;
};

}  // namespace th::detail
