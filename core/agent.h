// The shard agent: the client-side protocol of one shard as a pure state machine.
//
//   agent.step(input, now_ms, effects)
//
// Inputs are the application's calls, messages from the hub, data-plane events (a read or an
// offload copy finished), the transport's "server lost", and clock ticks. Effects are messages to
// the hub, data-plane instructions (read this range, serve that grant, copy to CPU) and the
// completion of the application's call. The production client (libthclient) and the simulator run
// this same code; neither adds protocol logic of its own.
//
// States:
//   kIdle      --open-->                    kOpening
//   kOpening   --OpenOk-->                  kOpen        (answers the application's open)
//   kOpen      --call--> kOpen (one call in flight at a time; answered by the hub's Reply)
//   kOpen      --Evicted / unknown client--> kEvicted    (the call in flight fails)
//   kEvicted   --backoff, or a call-->      kOpening     (resume, then the call if any; the next
//                                                         incarnation if the replica was evicted)
// The agent re-opens on its own: a shard whose program waits in a collective for its peers makes no
// call, and its replica can only re-form if every shard comes back.
//   any open   --server lost-->             kOpening     (next server, resume, then the call again)
//   kOpen      --close answered-->          kClosed
// Resuming (after eviction or failover) announces the copy the shard holds, unless a call that
// writes its buffers was in flight, and the last call it completed with its answer. A replica whose
// shards diverged (kDivergentCall), or could not all re-open after a failover (kBarrierTimeout: one
// of them closed or is gone for good), starts over instead: fresh open, nothing announced. Shards may
// learn of an eviction from different messages (one sees "divergent", another only "unknown
// client"); the hub settles a replica whose shards open both ways by answering the resuming ones
// kDivergentCall, so they start over too.
//
// What the agent guarantees the application: the answer of a call is the hub's answer; after
// unpublish (or close) returns, no grant to read its buffers is active; it serves a grant only for a
// version it holds or is receiving. An unpublish whose replica is evicted meanwhile returns
// UnpublishOk: what it promises holds (nothing may read the buffers), and the copy is forgotten.
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <optional>
#include <set>
#include <variant>
#include <vector>

#include "core/messages.h"
#include "core/types.h"

namespace th {

struct AgentConfig {
  ClientId client = 0;        // the handle id, used with every server
  std::uint32_t servers = 1;  // server addresses: the primary, then backups, in order
  TimeMs heartbeat_interval_ms = 1000;
  TimeMs retry_initial_ms = 250;  // first retransmission of an unanswered request or report
  TimeMs retry_max_ms = 4000;     // the backoff doubles up to this
};
Status validate(const AgentConfig& config);

// ---- Inputs ----------------------------------------------------------------------------------------

// A call of the application. The first must be an OpenRequest (its incarnation is the first one the
// agent uses). At most one call is in flight.
struct UserCall {
  std::uint64_t call_id = 0;
  RequestBody body;
};
struct FromHub {
  std::uint32_t server = 0;
  Effect effect;
};
struct ReadFinished {
  TransferId transfer = 0;
  std::uint32_t epoch = 0;
  std::optional<ReadFailure> failure;  // none: every byte arrived and matched its checksum
  // A read from another layout (StartRead::reshard) that succeeded: the checksums of the tensors
  // as assembled, which the agent reports and keeps as what its buffers hold.
  ChecksumsRef checksums = nullptr;
};
// The read of this transfer and epoch has moved `bytes` of the shard from its source (not
// counting a prefix verified under an earlier source). The data plane feeds it once, when `bytes`
// first reaches progress_report_bytes() of the shard: the agent tells the hub (TransferProgress),
// which may time the replica before the read ends. Ignored for a read that is no longer current.
struct ReadProgress {
  TransferId transfer = 0;
  std::uint32_t epoch = 0;
  std::uint64_t bytes = 0;
};
// How many bytes of a shard of `shard_bytes` a read moves before the data plane feeds ReadProgress:
// a sixteenth, early enough for the hub to reorder a chain (only the first 1/8 of a slow member's
// read is worth moving it for, hub_rates.cpp), late enough that the time to connect is a small part
// of what it times. 0 for an empty shard: nothing to report.
std::uint64_t progress_report_bytes(std::uint64_t shard_bytes);

struct OffloadFinished {
  Version version = 0;
  // The data plane could not make the copy (a GPU copy failed): nothing is reported, and the hub
  // times the offload out; asked again, the agent makes it again.
  bool failed = false;
};
// The transport lost the connection to this server (it crashed, or was declared dead).
struct ServerLost {
  std::uint32_t server = 0;
};
struct AgentTick {};
// The application gives up on call `call_id` (a replicate, update or wait): the hub is asked to end
// it for the whole replica with kCancelled. The call still completes with the hub's answer (which
// may be its result, if that came first). Ignored for another call, or one of another kind.
struct UserCancel {
  std::uint64_t call_id = 0;
};

using AgentInput =
    std::variant<UserCall, FromHub, ReadFinished, ReadProgress, OffloadFinished, ServerLost, AgentTick, UserCancel>;

// ---- Effects ---------------------------------------------------------------------------------------

struct SendRequest {
  std::uint32_t server = 0;
  Request request;
};
struct SendReport {
  std::uint32_t server = 0;
  Report report;
};
// Read shard `read.shard` of `read.version` from `read.source` into the registered buffers; verify
// each tensor against `read.checksums`; then feed ReadFinished. Replaces any read of the same
// transfer. With `read.offload_copy` set (offload seeding), read instead into the offload buffer of
// `read.version`, created for it in CPU memory with `read.layout` if there is none: FreeOffload
// frees it, whole or partial.
struct BeginRead {
  StartRead read;
};
// Stop the read of this transfer; it needs no ReadFinished.
struct CancelRead {
  TransferId transfer = 0;
};
// The data server may serve reads of (version, kind) for this transfer and epoch, and no others.
struct GrantServe {
  ServeRead grant;
};
struct RevokeServe {
  TransferId transfer = 0;
  std::uint32_t epoch = 0;
};
// Copy the registered buffers (holding `version`) to CPU memory, then feed OffloadFinished.
struct MakeOffload {
  Version version = 0;
};
struct FreeOffload {
  Version version = 0;
};
// Readers found this shard's bytes of `version` (its registered buffers, or with `offload` its CPU
// offload copy) failing the checksums they had when published or received, twice: the hub reads
// from them no more. The shell tells the application (log, HandleStats).
struct CopyFoundCorrupt {
  Version version = 0;
  bool offload = false;
};
struct CallDone {
  std::uint64_t call_id = 0;
  Outcome outcome;
};

using AgentEffect = std::variant<SendRequest, SendReport, BeginRead, CancelRead, GrantServe, RevokeServe,
                                 MakeOffload, FreeOffload, CopyFoundCorrupt, CallDone>;
using AgentEffects = std::vector<AgentEffect>;

enum class AgentPhase : std::uint8_t { kIdle, kOpening, kOpen, kEvicted, kClosed };
std::string_view agent_phase_name(AgentPhase phase);

class ShardAgent {
 public:
  explicit ShardAgent(AgentConfig config);

  // `now_ms` is the agent's local clock; it must not decrease.
  void step(const AgentInput& input, TimeMs now_ms, AgentEffects& effects);

  // When the agent next needs a tick (a heartbeat or a retransmission is due); nothing if idle.
  std::optional<TimeMs> next_deadline_ms() const;

  AgentPhase phase() const { return phase_; }
  std::uint32_t server() const { return server_; }
  std::uint64_t session() const { return session_; }
  std::uint64_t incarnation() const { return open_.incarnation; }
  const std::optional<HeldCopy>& held() const { return held_; }
  bool call_in_flight() const { return call_.has_value(); }
  std::uint64_t last_seq() const { return last_seq_; }
  // How many fresh opens (sequence from 0, nothing announced) succeeded: the application's open,
  // and each start-over after a divergent call. The replica's program restarts its collectives
  // with it, so (starts, last_seq) orders the calls the shards completed.
  std::uint64_t starts() const { return starts_; }

 private:
  struct Call {
    std::uint64_t id = 0;
    std::uint64_t seq = 0;
    RequestBody body;
    bool writes = false;        // a StartRead was acted on: the buffers no longer hold `held_`
    TimeMs next_send_ms = 0;
    TimeMs backoff_ms = 0;
    bool cancelled = false;     // the application cancelled it: CancelCall goes with each send
  };
  struct PendingReport {
    ReportBody body;
    TimeMs next_send_ms = 0;
    TimeMs backoff_ms = 0;
  };
  // Offload seeding: a CPU copy read across datacenters outside any call (see StartRead).
  struct Seeding {
    TransferId transfer = 0;
    std::uint32_t epoch = 0;
    std::uint64_t copy = 0;
    LayoutRef layout;
    ChecksumsRef checksums;
    bool done = false;  // every byte arrived and matched: in offloads_ too
    std::optional<ReadFailure> failure;  // the read from the current source failed: no buffer
  };
  struct Reading {
    std::uint32_t epoch = 0;
    Version version = 0;
    ChecksumsRef checksums;  // of the reader's own tensors: from the hub, or assembled (reshard)
    bool done = false;  // every byte arrived and matched (reported to the hub)
    bool reshard = false;  // from a source of another layout: TransferDone carries `checksums`
    PatchRef patch;        // this epoch reads the source's patch (kept once done: HeldCopy::patch)
    bool progress_reported = false;  // this epoch's TransferProgress went out
  };

  void on_call(const UserCall& call);
  void on_cancel(const UserCancel& cancel);
  void send_cancel();
  void on_hub(const FromHub& message);
  void on_reply(const Reply& reply);
  void on_start_read(const StartRead& read);
  static TransferDone done_report(TransferId transfer, const Reading& reading);
  void on_serve(const ServeRead& grant);
  void on_stop_serving(const StopServing& stop);
  void on_offload(const Offload& offload);
  void on_offload_finished(const OffloadFinished& finished);
  void on_release_offload(const ReleaseOffload& release);
  void report_announced_offloads();
  void on_read_finished(const ReadFinished& finished);
  void on_read_progress(const ReadProgress& progress);
  void on_seed_read(const StartRead& read);
  void on_seed_finished(const ReadFinished& finished);
  // Forgets the seed of `version`: a read in progress stops and its buffer is freed; a complete one
  // stays in offloads_ (the caller decides).
  void drop_seed(Version version);
  void drop_seeds_in_progress();
  void on_server_lost(const ServerLost& lost);
  void on_tick();

  void open(bool resume);
  void send_call();
  void finish_call(const Outcome& outcome, bool released = false);
  void became_evicted(const Error& error);
  void reopen();
  void start_over();
  void reset_connection_state();
  // Revokes the grants that match (all, if no predicate).
  void revoke_grants(const std::function<bool(const ServeRead&)>& match = {});
  void cancel_reads();
  void report(ReportBody body);
  void drop_reports(TransferId transfer);      // the failure reports of a transfer
  void send_report(ReportBody body);           // once: no retransmission
  void drop_offload_reports(Version version);  // the OffloadDone reports of a version
  bool reading_call() const;
  void emit(AgentEffect effect) { effects_->push_back(std::move(effect)); }

  AgentConfig config_;
  OpenRequest open_;              // as the application gave it; incarnation advances on eviction
  AgentPhase phase_ = AgentPhase::kIdle;
  std::uint32_t server_ = 0;
  std::uint64_t session_ = 0;
  std::uint64_t last_seq_ = 0;    // the last call the hub answered
  std::uint64_t starts_ = 0;
  // The open in flight begins a run of the replica's program (sequence from 0, nothing announced),
  // until an OpenOk: a failover re-sends it as a resume holding nothing, and it still counts.
  bool start_open_ = false;
  std::optional<TxnRecord> last_txn_;
  std::optional<std::uint64_t> open_call_id_;  // the application's open, until it is answered
  // Fresh opens of the application's open sent again after kDivergentCall (incarnation_auto).
  static constexpr std::uint32_t kAutoOpenRetriesMax = 8;
  std::uint32_t auto_open_retries_ = 0;
  // The replica was evicted: re-open as the next incarnation. Every shard learns this from the same
  // events, so all of them move together; a re-open that merely failed (barrier timeout) tries the
  // same incarnation again. A shard that comes back late, to a replica its peers re-formed without
  // it, is told that replica's incarnation and joins it (rejoin_incarnation_).
  bool next_incarnation_ = false;
  std::uint64_t rejoin_incarnation_ = 0;  // the hub named the incarnation to re-open as (0: none)
  // The replica's shards diverged: nothing it held or did is trusted any more. The next open is a
  // fresh one (sequence 0, nothing announced), like a restart of the replica by its framework.
  bool start_over_ = false;
  std::optional<Call> call_;      // the call in flight (also while re-opening)
  std::optional<HeldCopy> held_;  // the version the registered buffers hold, published
  std::map<Version, HeldCopy> offloads_;     // complete offload copies, by version (HeldCopy::copy)
  // The id this session's server gave each offload copy: it numbers copies in increasing order, so
  // an Offload naming a lower id for the same version is an earlier instruction arriving late.
  std::map<Version, std::uint64_t> named_this_session_;
  std::map<Version, std::uint64_t> offloading_;  // MakeOffload issued: the copy id it will report
  std::map<Version, Seeding> seeds_;             // offload seeds, by version
  // Seed copies released lately, as (version, copy), and releases that came while nothing of the
  // version was held: a StartRead for one, repeated, late or overtaken by its release, must not
  // start it (again).
  static constexpr std::size_t kReleasedSeedsMax = 64;
  std::deque<std::pair<Version, std::uint64_t>> released_seeds_;
  // Grants the hub withdrew lately: a ServeRead repeated or overtaken by its StopServing is stale.
  static constexpr std::size_t kStoppedGrantsMax = 1024;
  std::set<std::pair<TransferId, std::uint32_t>> stopped_;
  std::deque<std::pair<TransferId, std::uint32_t>> stopped_order_;  // oldest first, to forget
  std::map<TransferId, Reading> reads_;
  std::map<std::pair<TransferId, std::uint32_t>, ServeRead> grants_;  // by (transfer, epoch)
  std::vector<PendingReport> reports_;
  std::optional<Request> open_request_;  // the open in flight, retransmitted as it was
  TimeMs reopen_at_ms_ = -1;      // kEvicted: when to re-open on its own
  TimeMs reopen_backoff_ms_ = 0;
  TimeMs open_sent_ms_ = 0;
  TimeMs open_backoff_ms_ = 0;
  TimeMs next_heartbeat_ms_ = 0;
  TimeMs now_ms_ = 0;
  AgentEffects* effects_ = nullptr;
};

}  // namespace th
