// The inputs the hub consumes and the effects it produces. Plain data: the server shell turns wire
// messages into these and effects back into wire messages; the simulator routes them through its
// simulated network; tests build them by hand.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <variant>
#include <vector>

#include "core/result.h"
#include "core/types.h"

namespace th {


// ---- Answers ---------------------------------------------------------------------------------------

enum class CopyKind : std::uint8_t { kPrimary, kOffload };

struct OpenOk {
  std::uint32_t num_shards = 0;
  std::optional<Version> latest;
  std::uint64_t incarnation = 0;  // the replica's (what an open with incarnation_auto was given)
};
struct PublishOk {
  Version version = 0;
};
struct UnpublishOk {};
struct ReplicateOk {
  Version version = 0;
  std::string source_replica;
};
struct UpdateOk {
  UpdateStatus status = UpdateStatus::kNoNewerVersion;
  // The version now held (kUpdated), or the one still held; none: the replica holds nothing
  // (which is not version 0).
  std::optional<Version> version;
  std::string source_replica;
};
struct ListOk {
  std::shared_ptr<const ListSnapshot> snapshot;
};
struct WaitOk {};
struct CloseOk {};

using Outcome = std::variant<Error, OpenOk, PublishOk, UnpublishOk, ReplicateOk, UpdateOk, ListOk,
                             WaitOk, CloseOk>;
// Whether two answers are the same answer (replica consistency): same kind, same error code, same
// versions and sources, same listing. Error details (free text) do not count.
bool same_answer(const Outcome& a, const Outcome& b);

// ---- Requests: numbered per shard, matched across the shards of a replica ---------------------------

enum class OpKind : std::uint8_t {
  kPublish, kUnpublish, kReplicate, kUpdate, kList, kWait, kClose,
};
std::string_view op_name(OpKind kind);


// What identifies "the same operation" for replica transactions: two shards calling with different
// OpKeys at the same sequence number have diverged.
struct OpKey {
  OpKind kind = OpKind::kList;
  Selector selector;        // replicate, update
  Version version = 0;      // publish
  WaitPredicate predicate;  // wait

  friend bool operator==(const OpKey&, const OpKey&) = default;
};

// A copy of a version that a client announces when it re-opens on a (new) server.
struct HeldCopy {
  Version version = 0;
  LayoutRef layout;
  ChecksumsRef checksums;
  std::uint64_t copy = 0;  // an offload copy: the id the server that made it gave it
  // A primary's patch of `version` that the shard keeps and serves (it published it, or applied it
  // in a read): the new server places patch reads from it as the old one did. Null: none.
  PatchRef patch = nullptr;
};

// The last call a shard completed and the answer it got, as the client remembers it for failover
// (see Resume).
struct TxnRecord {
  std::uint64_t seq = 0;
  OpKey op;
  Outcome outcome;
};

// Sent with `open` by a client that was connected to a previous server (failover) or was evicted:
// what it holds, so that the new server is populated at once, and the last transaction it completed,
// so that shards which did not complete it get the same answer here.
struct Resume {
  std::optional<HeldCopy> primary;
  std::vector<HeldCopy> offloads;
  std::optional<TxnRecord> last_txn;

  // A shard that made no call since it opened and holds nothing.
  bool nothing() const { return !primary && offloads.empty() && !last_txn; }
};

struct OpenRequest {
  std::string model;
  std::string replica;
  std::uint64_t incarnation = 0;  // a restarted replica opens with a larger incarnation
  std::uint32_t shard = 0;
  std::uint32_t num_shards = 1;
  std::string datacenter;
  bool spot = false;
  std::string role;           // free label, e.g. "trainer" or "rollout", for wait(kRoleHolds)
  Retention retention;
  std::string data_endpoint;  // opaque to the hub: where peers reach this shard's data server
  std::shared_ptr<const Resume> resume;  // rare and large: shared, so requests stay small
  // The hub chooses the incarnation (`incarnation` above is then ignored): the replica's current one if
  // this shard's slot there is free (its peers of a restart opened first), the next one if the slot
  // is taken (this process restarted before the old one was noticed gone) or the replica closes, 1
  // if there is none. OpenOk tells the choice; re-opens after that name it.
  bool incarnation_auto = false;
};
struct PublishRequest {
  Version version = 0;
  LayoutRef layout;
  ChecksumsRef checksums;
  // The shard's patch of `version` against the version this replica published before (its tensors
  // written through a patch writer, client/patch_writer.h); null: none. The publisher keeps the
  // patch's bytes to serve them. A reader that holds the base reads the patch instead of the
  // version's bytes, and then serves it too (README "Delta versions").
  PatchRef patch = nullptr;
};
struct UnpublishRequest {};
struct ReplicateRequest {
  Selector selector;
  LayoutRef layout;
  TimeMs timeout_ms = 0;  // 0: wait as long as it takes
};
struct UpdateRequest {
  Selector selector;
  LayoutRef layout;
};
struct ListRequest {};
struct WaitRequest {
  WaitPredicate predicate;
  TimeMs timeout_ms = 0;  // 0: wait as long as it takes
};
struct CloseRequest {};

using RequestBody = std::variant<OpenRequest, PublishRequest, UnpublishRequest, ReplicateRequest,
                                 UpdateRequest, ListRequest, WaitRequest, CloseRequest>;

struct Request {
  ClientId client = 0;
  // 0 for a fresh open (the first call after it is 1); a resuming open carries the sequence number
  // of the last call the client completed.
  std::uint64_t seq = 0;
  RequestBody body;
  // The client's open count: every open starts a new session. The hub drops requests and reports of
  // an older session and stamps its own on every effect, so a delayed message from before a re-open
  // is never taken for a current one.
  std::uint64_t session = 0;
};

// ---- Reports: data-plane facts, idempotent, not part of transactions ---------------------------------

// kPatchBaseMismatch: told to read a patch, the shard cannot apply it to what its buffers hold (they
// are not the patch's base as far as it knows, or it cannot apply patches: GPU tensors, no
// memory). Nothing it patched changed; tensors read whole may be partly written, and the read of
// the bytes that follows writes them again. The source is not at fault.
enum class ReadFailure : std::uint8_t { kSourceUnreachable, kChecksumMismatch, kSourceRefused, kPatchBaseMismatch };
std::string_view read_failure_name(ReadFailure failure);  // "source-unreachable", ...

struct Heartbeat {};
struct TransferDone {
  TransferId transfer = 0;
  std::uint32_t epoch = 0;
  // After a read from a source of another layout (StartRead::reshard): the checksums of the
  // tensors as this shard assembled them, which fix its layout's checksums of the version until
  // a copy of that layout completes. Null after a read of the reader's own layout.
  ChecksumsRef checksums = nullptr;
};
struct TransferFailed {
  TransferId transfer = 0;
  std::uint32_t epoch = 0;
  ReadFailure reason = ReadFailure::kSourceUnreachable;
};
struct OffloadDone {
  Version version = 0;
  std::uint64_t copy = 0;  // the offload copy, as Offload named it
};
// The application gave up on call `seq` (a replicate, update or wait still unanswered): the hub
// ends it for the whole replica with kCancelled, as if its deadline had passed. Sent after the
// call's request on the same connection, and again with each retransmission of it; a cancel of a
// call that is answered, unknown or of another kind is ignored.
struct CancelCall {
  std::uint64_t seq = 0;
};
// How far a reader shard's read from this epoch's source has come: `bytes` of its shard arrived from
// that source (not counting a prefix verified under an earlier source). Sent once per shard and
// epoch, early in the read (ShardAgent, kProgressReportDivisor), so that the hub can time a
// replica before its first read ends: the root of a version's first chain may be a slow member
// that everyone behind it waits for (hub_rates.cpp). Not retransmitted: a lost one only means
// the hub learns the rate when the read ends.
struct TransferProgress {
  TransferId transfer = 0;
  std::uint32_t epoch = 0;
  std::uint64_t bytes = 0;
};
using ReportBody = std::variant<Heartbeat, TransferDone, TransferFailed, OffloadDone, CancelCall, TransferProgress>;

struct Report {
  ClientId client = 0;
  ReportBody body;
  std::uint64_t session = 0;  // see Request::session
};

struct ConnectionLost {
  ClientId client = 0;
};
// Drives heartbeat expiry, barrier timeouts and call deadlines.
struct Tick {};

using Input = std::variant<Request, Report, ConnectionLost, Tick>;

// ---- Effects ---------------------------------------------------------------------------------------

struct Reply {
  std::uint64_t seq = 0;
  Outcome outcome;
  // The answer to an open (or its refusal), numbered with the last call the client completed; any
  // other reply answers call `seq`. So a late answer to an open is never taken for a call's.
  bool to_open = false;
  // An open refused because the replica it names is newer (kStaleIncarnation) or went on without
  // this shard (kDivergentCall): that replica's incarnation, so that the shard joins it rather than
  // replace it with an incarnation of its own. 0 otherwise.
  std::uint64_t replica_incarnation = 0;
  // A replicate or update that failed after some shard was told to read: the hub no longer counts
  // the version the replica held (its buffers may have been written), so neither may the shard,
  // even one whose instruction never arrived. False otherwise.
  bool released = false;
};

struct SourceRef {
  std::string replica;
  std::uint64_t incarnation = 0;
  std::string datacenter;
  std::string endpoint;  // the data endpoint of the source's shard with the reader's shard index
  CopyKind kind = CopyKind::kPrimary;
  bool partial = false;  // still receiving: read its progress counter, take the prefix, repeat
};

// A shard of a source replica of another layout than the reader's: where it serves and what it holds.
struct SourceShard {
  std::string endpoint;
  LayoutRef layout;
  ChecksumsRef checksums;
};

// To a reader shard: read your shard of `version` from `source`, verify against `checksums`.
// Into the registered buffers, for call `call`; or, with `offload_copy` set (offload seeding), into
// a new CPU buffer of `layout` that becomes that offload copy once every byte is verified, outside
// any call.
struct StartRead {
  TransferId transfer = 0;
  std::uint32_t epoch = 0;  // bumps each time the hub picks another source for this transfer
  // The reader's call this transfer serves: an instruction that arrives late, during a later call,
  // is stale and must not touch the buffers.
  std::uint64_t call = 0;
  Version version = 0;
  std::uint32_t shard = 0;
  SourceRef source;
  ChecksumsRef checksums;
  std::uint64_t offload_copy = 0;  // 0: into the registered buffers
  LayoutRef layout;                // offload seeding: the layout of the buffer to fill
  GrantSecret secret{};            // what the source asks of this transfer's reads (see ServeRead)
  // A source of another layout (README "Layouts"): every shard of it, in shard order. The reader
  // plans its reads from their layouts (core/reshard.h), reads whole the pieces it needs of
  // them, verifies each against its shard's checksums and reports the checksums of what it
  // assembled (TransferDone::checksums); `checksums` is then its own layout's where they are
  // known (to compare), null where not. Empty: a read of shard `shard` of the reader's layout.
  std::vector<SourceShard> reshard = {};
  // Read the source's patch of `version` against `patch->base`, which the shard's buffers hold,
  // rather than its bytes: per tensor its patch (or the whole tensor where it has none), checked
  // whole before any byte is written (core/patch.h), applied in place and verified against
  // `checksums`. Tensors the shard already verified as `version` are skipped. A shard whose buffers
  // are not the base reports kPatchBaseMismatch; any failure of a patch read is followed by a read
  // of the bytes. Null: read the bytes.
  PatchRef patch = nullptr;
};
// To a source shard: a grant; serve reads of (version, kind) to this transfer and epoch only.
struct ServeRead {
  TransferId transfer = 0;
  std::uint32_t epoch = 0;
  Version version = 0;
  CopyKind kind = CopyKind::kPrimary;
  std::uint32_t shard = 0;
  std::string reader_replica;
  // The grant's capability: the source serves a read only if it presents this secret, which the
  // hub tells this source and this transfer's reader alone (unguessable: 128 bits of a keyed PRF).
  GrantSecret secret{};
  // Serve the shard's patch of `version` (the one it published or applied), not only its bytes.
  bool patch = false;
};
// To a source shard: the grant is withdrawn (finished, reassigned or cancelled).
struct StopServing {
  TransferId transfer = 0;
  std::uint32_t epoch = 0;
};
// To every shard of a replica: copy your buffers of `version` to CPU memory, then report OffloadDone.
// `copy` names the offload copy: a late ReleaseOffload of an earlier copy of the same version never
// frees a later one, and an OffloadDone names what it completes.
struct Offload {
  Version version = 0;
  std::uint64_t copy = 0;
};
// To every shard of a replica: the offload copy of `version` is no longer needed; free it.
struct ReleaseOffload {
  Version version = 0;
  std::uint64_t copy = 0;
};
// To the shard of a whole copy (complete or draining) whose bytes of that shard failed readers'
// checksums twice: the hub reads from it no more. Its tensors changed while they
// were being served (a trainer writing while published, an engine that rewrites its weights in
// place), or the bytes broke on their way twice. `offload_copy`: 0 for the registered buffers,
// else the CPU offload copy it names (as Offload did).
struct CopyCorrupt {
  Version version = 0;
  std::uint64_t offload_copy = 0;
};
// To a shard: your replica was removed; re-open (with a new incarnation) to continue.
struct Evicted {
  Errc reason = Errc::kReplicaEvicted;
  std::string detail;
};

using Message =
    std::variant<Reply, StartRead, ServeRead, StopServing, Offload, ReleaseOffload, CopyCorrupt, Evicted>;

struct Effect {
  ClientId client = 0;
  Message message;
  std::uint64_t session = 0;  // the session of the client this is for (see Request::session)
};
using Effects = std::vector<Effect>;

// Whether the hub can take this open at all (names, endpoint, shard numbers, retention limits,
// announced copies). The hub answers a failing open with this error; libthclient checks before it
// sends anything.
Status validate(const OpenRequest& open);

OpKind op_kind(const RequestBody& body);  // TH_REQUIREs that body is not an OpenRequest
OpKey op_key(const RequestBody& body);    // likewise

}  // namespace th
