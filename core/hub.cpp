#include "core/hub.h"

#include <algorithm>
#include <limits>
#include <tuple>
#include <utility>

namespace th {

using detail::Binding;
using detail::Contribution;
using detail::Copy;
using detail::Replica;
using detail::CopyId;
using detail::CopyState;
using detail::DcId;
using detail::DcSources;
using detail::DrainPurpose;
using detail::ReplicaPhase;
using detail::ShardSlot;
using detail::SourceKey;
using detail::TxnRef;
using detail::TxnStage;

namespace {

// settle() runs deferred work until none is left; each round retires at least one item, so this
// bound is only reached by a bug that keeps producing work.
constexpr std::size_t kSettleRoundsMax = 10'000'000;

ShardSet first_shards(std::uint32_t count) {
  TH_ASSERT(count <= limits::kShardsMax, count);
  ShardSet set;
  for (std::uint32_t i = 0; i < count; ++i) set.set(i);
  return set;
}

template <typename F>
void for_each_shard(const ShardSet& set, std::uint32_t count, F&& f) {
  for (std::uint32_t shard = 0; shard < count; ++shard) {
    if (set.test(shard)) f(shard);
  }
}


void add_count(std::uint32_t& counter, bool present, int sign) {
  if (!present) return;
  if (sign > 0) {
    ++counter;
  } else {
    TH_ASSERT(counter > 0, "counter would go negative");
    --counter;
  }
}

std::string describe_outcome(const Outcome& outcome) {
  if (const auto* error = std::get_if<Error>(&outcome)) return std::string(errc_name(error->code));
  return "another answer";
}

std::string describe(const Replica& replica) {
  return "replica '" + replica.name + "' (incarnation " + std::to_string(replica.incarnation) + ")";
}

}  // namespace

namespace detail {

std::string_view copy_state_name(CopyState state) {
  switch (state) {
    case CopyState::kPublishing: return "publishing";
    case CopyState::kGathering: return "gathering";
    case CopyState::kWaiting: return "waiting";
    case CopyState::kActive: return "receiving";
    case CopyState::kComplete: return "complete";
    case CopyState::kOffloading: return "offloading";
    case CopyState::kDraining: return "draining";
  }
  return "unknown-state";
}

}  // namespace detail

struct Hub::Resolution {
  enum class Kind : std::uint8_t { kWait, kGo, kError };
  Kind kind = Kind::kWait;
  Version version = 0;
  Error error;
};

enum class Hub::Pick : std::uint8_t { kFound, kWait, kUnavailable };

struct Hub::SourceChoice {
  Pick pick = Pick::kWait;
  Copy* copy = nullptr;
};

// ==== Construction and the step function ==========================================================

Hub::Hub(HubSettings settings) : settings_(settings) {
  const Status valid = validate(settings_);
  TH_REQUIRE(valid.ok(), valid.ok() ? "" : valid.error().detail);
}

#ifdef TH_CANARY
Hub::Hub(HubSettings settings, CanaryBugs bugs) : Hub(settings) { bugs_ = bugs; }
#endif

Hub::~Hub() = default;

void Hub::step(const Input& input, TimeMs now_ms, Effects& effects) {
  TH_REQUIRE(now_ms >= now_ms_, "time went backwards:", now_ms, "<", now_ms_);
  TH_REQUIRE(effects_ == nullptr, "step() is not reentrant");
  now_ms_ = now_ms;
  effects_ = &effects;
  struct Reset {
    Effects*& target;
    ~Reset() { target = nullptr; }
  } reset{effects_};

  std::visit(
      [this](const auto& in) {
        using T = std::decay_t<decltype(in)>;
        if constexpr (std::is_same_v<T, Request>) {
          on_request(in);
        } else if constexpr (std::is_same_v<T, Report>) {
          on_report(in);
        } else if constexpr (std::is_same_v<T, ConnectionLost>) {
          const Binding* found = clients_.find(in.client);
          if (found == nullptr) return;
          Replica& replica = *found->replica;
          evict(replica, Errc::kReplicaEvicted,
                "the connection of shard " + std::to_string(found->shard) + " of " +
                    describe(replica) + " was lost");
        } else {
          static_assert(std::is_same_v<T, Tick>);
          on_tick();
        }
      },
      input);
  settle();
}

// ==== Requests =====================================================================================

void Hub::on_request(const Request& request) {
  ++stats_.requests;
  if (const auto* open = std::get_if<OpenRequest>(&request.body)) {
    on_open(request.client, request.seq, request.session, *open);
    return;
  }
  const Binding* found = clients_.find(request.client);
  if (found == nullptr) {
    emit(request.client, request.session, Reply{request.seq, make_error(Errc::kUnknownClient,
                                                       "no open handle with this id; open first")});
    return;
  }
  Replica& replica = *found->replica;
  const std::uint32_t shard = found->shard;
  TH_ASSERT(shard < replica.num_shards);
  ShardSlot& slot = replica.shards[shard];
  TH_ASSERT(slot.client == request.client, "the client map and the shard agree");
  if (request.session != slot.session) return;  // from before the client's last open: stale
  slot.last_seen_ms = now_ms_;

  if (request.seq <= slot.last_seq) {
    // A retransmission. Answer again if the call is answered; if it is still in progress, the
    // client may have missed an instruction (messages get lost): send what it should be doing.
    if (slot.last_reply && slot.last_reply->seq == request.seq) {
      emit_to(slot, *slot.last_reply);
    } else if (request.seq == slot.last_seq) {
      resend_instructions(replica, shard);
    }
    return;
  }
  if (request.seq != slot.last_seq + 1) {
    emit_to(slot, Reply{request.seq, make_error(Errc::kSequenceGap,
                                                       "expected call " +
                                                           std::to_string(slot.last_seq + 1))});
    return;
  }
  if (replica.phase == ReplicaPhase::kResuming) {
    emit_to(slot, Reply{request.seq, make_error(Errc::kInvalidArgument,
                                                       "the replica is still re-opening")});
    return;
  }
  slot.last_seq = request.seq;
  const OpKey op = op_key(request.body);
  if (replica.phase == ReplicaPhase::kClosing && op.kind != OpKind::kClose) {
    // A call its peers already completed before one of them closed keeps its answer (replica
    // consistency); only calls that were still undecided are refused.
    const auto decided = replica.txns.find(request.seq);
    if (decided == replica.txns.end() || !decided->second.result) {
      send_reply(replica, shard, request.seq,
                 make_error(Errc::kReplicaClosed, describe(replica) + " is closing"));
      return;
    }
  }
  Txn* txn = txn_for(replica, shard, request.seq, op);
  if (txn == nullptr) return;  // the replica diverged and is gone
  arrive(replica, *txn, shard, request.body);
}

Hub::Txn* Hub::txn_for(Replica& replica, std::uint32_t shard, std::uint64_t seq, const OpKey& op) {
  auto existing = replica.txns.find(seq);
  if (existing != replica.txns.end()) {
    Txn& txn = existing->second;
    if (txn.op == op && txn.expected.test(shard) && !txn.arrived.test(shard)) return &txn;
    const std::string detail = "shard " + std::to_string(shard) + " of " + describe(replica) +
                               " called " + std::string(op_name(op.kind)) + " as call " +
                               std::to_string(seq) + ", where another shard called " +
                               std::string(op_name(txn.op.kind)) + " with other arguments";
    send_reply(replica, shard, seq, make_error(Errc::kDivergentCall, detail));
    evict(replica, Errc::kDivergentCall, detail);
    return nullptr;
  }
  if (!replica.txns.empty() && seq - replica.txns.begin()->first >= limits::kTxnWindowMax) {
    const std::string detail = "shard " + std::to_string(shard) + " of " + describe(replica) +
                               " ran " + std::to_string(limits::kTxnWindowMax) +
                               " calls ahead of another shard";
    send_reply(replica, shard, seq, make_error(Errc::kDivergentCall, detail));
    evict(replica, Errc::kDivergentCall, detail);
    return nullptr;
  }
  Txn& txn = replica.txns[seq];
  txn.seq = seq;
  txn.op = op;
  txn.expected = first_shards(replica.num_shards);
  return &txn;
}

void Hub::arrive(Replica& replica, Txn& txn, std::uint32_t shard, const RequestBody& body) {
  txn.arrived.set(shard);
  if (txn.result) {
    Outcome outcome = *txn.result;
    if (bugs().per_shard_resolve && txn.op.kind == OpKind::kList) {
      outcome = ListOk{make_snapshot(*replica.model)};
    }
    if (bugs().per_shard_resolve && txn.op.kind == OpKind::kUpdate) {
      const auto* stored = std::get_if<UpdateOk>(&outcome);
      const Resolution now = resolve(*replica.model, txn.op.selector);
      if (stored != nullptr && stored->status != UpdateStatus::kUpdated &&
          now.kind == Resolution::Kind::kGo && now.version > stored->version) {
        outcome = UpdateOk{UpdateStatus::kNotYet, stored->version, {}};
      }
    }
    send_reply(replica, shard, txn.seq, outcome);
    txn.replied.set(shard);
    const bool closed = txn.op.kind == OpKind::kClose && std::holds_alternative<CloseOk>(outcome);
    collect_txn(replica, txn.seq);
    if (closed) {
      // The close is over for this shard: it leaves. The last one to leave removes the replica.
      unbind(replica, shard);
      if (replica.bound_shards == 0) remove_replica(replica);
    }
    return;
  }
  std::visit(
      [&](const auto& request) {
        using T = std::decay_t<decltype(request)>;
        if constexpr (std::is_same_v<T, PublishRequest>) {
          on_publish(replica, txn, shard, request);
        } else if constexpr (std::is_same_v<T, UnpublishRequest>) {
          if (txn.stage == TxnStage::kNew) on_unpublish(replica, txn);
        } else if constexpr (std::is_same_v<T, ReplicateRequest>) {
          on_replicate(replica, txn, shard, request);
        } else if constexpr (std::is_same_v<T, UpdateRequest>) {
          on_update(replica, txn, shard, request);
        } else if constexpr (std::is_same_v<T, ListRequest>) {
          finish(replica, txn, ListOk{make_snapshot(*replica.model)});
        } else if constexpr (std::is_same_v<T, WaitRequest>) {
          if (txn.stage == TxnStage::kNew) on_wait(replica, txn, request);
        } else if constexpr (std::is_same_v<T, CloseRequest>) {
          if (txn.stage == TxnStage::kNew) on_close(replica, txn);
        } else {
          static_assert(std::is_same_v<T, OpenRequest>);
          TH_ASSERT(false, "open is handled before transactions");
        }
      },
      body);
}

void Hub::send_reply(Replica& replica, std::uint32_t shard, std::uint64_t seq, const Outcome& outcome) {
  TH_ASSERT(shard < replica.num_shards);
  ShardSlot& slot = replica.shards[shard];
  TH_ASSERT(!slot.last_reply || slot.last_reply->seq <= seq, "replies go forward in sequence");
  Reply reply{seq, outcome};
  emit_to(slot, reply);
  slot.last_reply = std::move(reply);
}

void Hub::finish(Replica& replica, Txn& txn, Outcome outcome) {
  TH_ASSERT(!txn.result, "a transaction has exactly one result; call", txn.seq);
  Model& model = *replica.model;
  if (txn.ticket != 0) {
    model.unresolved.erase(txn.ticket);
    model.waits.erase(txn.ticket);
    txn.ticket = 0;
  }
  const bool closed = txn.op.kind == OpKind::kClose && std::holds_alternative<CloseOk>(outcome);
  if (txn.seeded && txn.seeded_outcome && !same_answer(outcome, *txn.seeded_outcome)) {
    // The shards behind a failover cannot get the answer the others got: no shard may be told
    // anything else, and the replica goes (see caught_up).
    outcome = make_error(Errc::kDivergentCall,
                         "after the failover, call " + std::to_string(txn.seq) +
                             " could not give these shards the answer the others got (" +
                             describe_outcome(outcome) + "); re-open the replica");
  }
  txn.result = std::move(outcome);
  if (txn.seeded && txn.seeded_outcome) caught_up(replica, txn);
  const ShardSet pending = txn.arrived & ~txn.replied;
  for_each_shard(pending, replica.num_shards, [&](std::uint32_t shard) {
    send_reply(replica, shard, txn.seq, *txn.result);
    txn.replied.set(shard);
  });
  TH_ASSERT(txn.replied == txn.arrived, "every shard that called has its answer");
  const std::uint64_t seq = txn.seq;
  collect_txn(replica, seq);
  if (closed) {
    for_each_shard(pending, replica.num_shards, [&](std::uint32_t shard) { unbind(replica, shard); });
    if (replica.bound_shards == 0) remove_replica(replica);
  }
}

void Hub::collect_txn(Replica& replica, std::uint64_t seq) {
  auto found = replica.txns.find(seq);
  TH_ASSERT(found != replica.txns.end(), "no transaction", seq);
  if ((found->second.replied & found->second.expected) == found->second.expected) {
    replica.txns.erase(found);
  }
}

void Hub::abort_txn(Replica& replica, Txn& txn, const Error& error) {
  switch (txn.stage) {
    case TxnStage::kPublishing:
      if (replica.primary != nullptr && replica.primary->state == CopyState::kPublishing) {
        remove_copy(*replica.primary);
      }
      break;
    case TxnStage::kReceiving:
      if (replica.primary != nullptr && replica.primary->incoming != nullptr) {
        fail_transfer(*replica.primary->incoming, error);
        return;
      }
      break;
    case TxnStage::kDrainingOld:
      undrain(replica);
      break;
    default:
      break;  // tickets are dropped by finish(); other draining copies keep draining
  }
  finish(replica, txn, error);
}

// An update that fails while its held copy drains keeps that copy: nothing was written yet.
void Hub::undrain(Replica& replica) {
  Copy* copy = replica.primary;
  if (copy == nullptr || copy->state != CopyState::kDraining ||
      copy->drain_purpose != DrainPurpose::kUpdate) {
    return;
  }
  if (copy->awaiting_offload != 0) {
    auto offload = replica.model->copies.find(copy->awaiting_offload);
    TH_ASSERT(offload != replica.model->copies.end());
    emit_to_replica(replica, ReleaseOffload{copy->record->version});  // the copy in progress is moot
    remove_copy(*offload->second);
    copy->awaiting_offload = 0;
  }
  set_state(*copy, CopyState::kComplete);
}

// An update that fails after its held copy drained but before any shard was told to read: the
// buffers still hold the previous version, so the replica holds it again.
void Hub::restore_previous(Replica& replica, Version version) {
  Model& model = *replica.model;
  TH_ASSERT(replica.primary == nullptr);
  VersionRecord& record = record_for(model, version);
  for (std::uint32_t shard = 0; shard < replica.num_shards; ++shard) {
    if (!record.checksums[shard] || !model.layouts[shard]) return;  // cannot vouch for the bytes
  }
  Copy& copy = create_copy(replica, record, CopyKind::kPrimary, CopyState::kComplete);
  copy.ready = first_shards(replica.num_shards);
  replica.primary = &copy;
  on_copy_complete(copy);
}

bool Hub::record_layout(Replica& replica, Txn& txn, std::uint32_t shard, const LayoutRef& layout) {
  const Model& model = *replica.model;
  TH_ASSERT(shard < replica.num_shards);
  TH_ASSERT(txn.op.kind == OpKind::kReplicate || txn.op.kind == OpKind::kUpdate);
  if (!layout) {
    abort_txn(replica, txn, make_error(Errc::kInvalidArgument, "register tensors first"));
    return false;
  }
  if (txn.layouts.empty()) txn.layouts.resize(replica.num_shards);
  txn.layouts[shard] = layout;
  if (const LayoutRef& known = model.layouts[shard]) {
    if (auto why = known->mismatch(*layout)) {
      abort_txn(replica, txn, make_error(Errc::kLayoutMismatch,
                                         "shard " + std::to_string(shard) + ": " + *why));
      return false;
    }
  }
  return true;
}

// ---- publish ---------------------------------------------------------------------------------------

Status Hub::check_shard(const Model& model, const VersionRecord& record, std::uint32_t shard,
                        const LayoutRef& layout, const ChecksumsRef& checksums) const {
  if (!layout || !checksums) {
    return make_error(Errc::kInvalidArgument, "publish needs registered tensors and checksums");
  }
  if (checksums->size() != layout->tensors().size()) {
    return make_error(Errc::kInvalidArgument,
                      "shard " + std::to_string(shard) + " sent " +
                          std::to_string(checksums->size()) + " checksums for " +
                          std::to_string(layout->tensors().size()) + " tensors");
  }
  if (const LayoutRef& known = model.layouts[shard]) {
    if (auto why = known->mismatch(*layout)) {
      return make_error(Errc::kLayoutMismatch, "shard " + std::to_string(shard) + ": " + *why);
    }
  }
  if (const ChecksumsRef& known = record.checksums[shard]) {
    if (*known != *checksums) {
      std::size_t tensor = 0;
      while ((*known)[tensor] == (*checksums)[tensor]) ++tensor;
      return make_error(Errc::kChecksumConflict,
                        "version " + std::to_string(record.version) + " shard " +
                            std::to_string(shard) + " tensor '" + layout->tensors()[tensor].name +
                            "' differs from what an earlier publisher announced");
    }
  }
  return Unit{};
}

Status Hub::commit_shard(Model& model, VersionRecord& record, std::uint32_t shard,
                         const LayoutRef& layout, const ChecksumsRef& checksums) {
  Status checked = check_shard(model, record, shard, layout, checksums);
  if (!checked) return checked;
  if (!model.layouts[shard]) model.layouts[shard] = layout;
  if (!record.checksums[shard]) record.checksums[shard] = checksums;
  return Unit{};
}

void Hub::on_publish(Replica& replica, Txn& txn, std::uint32_t shard, const PublishRequest& request) {
  Model& model = *replica.model;
  const Version version = request.version;
  if (txn.stage == TxnStage::kNew) {
    const bool resumed_publish = txn.seeded && replica.primary != nullptr &&
                                 replica.primary->state == CopyState::kPublishing &&
                                 replica.primary->record->version == version;
    if (replica.primary != nullptr && !resumed_publish) {
      finish(replica, txn, make_error(Errc::kAlreadyHolding,
                                      describe(replica) + " holds version " +
                                          std::to_string(replica.primary->record->version) +
                                          "; unpublish it first"));
      return;
    }
    // The model remembers versions down to kForgottenVersionsWindow below latest; an older one is
    // stale. (A slow data-parallel trainer may still publish a version just below latest.)
    if (model.latest && version + limits::kForgottenVersionsWindow < *model.latest &&
        !model.versions.contains(version)) {
      finish(replica, txn, make_error(Errc::kStaleVersion,
                                      "version " + std::to_string(version) + " is more than " +
                                          std::to_string(limits::kForgottenVersionsWindow) +
                                          " versions older than latest " +
                                          std::to_string(*model.latest)));
      return;
    }
    if (replica.primary == nullptr) {
      Copy& copy = create_copy(replica, record_for(model, version), CopyKind::kPrimary,
                               CopyState::kPublishing);
      replica.primary = &copy;
    }
    replica.primary->pending_layouts.resize(replica.num_shards);
    replica.primary->pending_checksums.resize(replica.num_shards);
    txn.stage = TxnStage::kPublishing;
  }
  TH_ASSERT(txn.stage == TxnStage::kPublishing, "publish in stage", static_cast<int>(txn.stage));
  Copy& copy = *replica.primary;
  TH_ASSERT(copy.state == CopyState::kPublishing);
  TH_ASSERT(copy.record->version == version, "divergent versions pass the op check");
  VersionRecord& record = *copy.record;

  if (Status checked = check_shard(model, record, shard, request.layout, request.checksums); !checked) {
    abort_txn(replica, txn, checked.error());
    return;
  }
  copy.pending_layouts[shard] = request.layout;
  copy.pending_checksums[shard] = request.checksums;
  copy.ready.set(shard);
  if (copy.ready.count() < replica.num_shards) return;

  // Every shard published. Another copy of this version may have completed meanwhile, so check all
  // shards again before committing any.
  for (std::uint32_t s = 0; s < replica.num_shards; ++s) {
    if (!copy.pending_layouts[s]) continue;  // announced before a failover, already committed
    Status checked = check_shard(model, record, s, copy.pending_layouts[s], copy.pending_checksums[s]);
    if (!checked) {
      abort_txn(replica, txn, checked.error());
      return;
    }
  }
  for (std::uint32_t s = 0; s < replica.num_shards; ++s) {
    if (!copy.pending_layouts[s]) continue;
    const Status committed =
        commit_shard(model, record, s, copy.pending_layouts[s], copy.pending_checksums[s]);
    TH_ASSERT(committed.ok(), "checked shards commit");
  }
  copy.pending_layouts.clear();
  copy.pending_checksums.clear();
  set_state(copy, CopyState::kComplete);
  on_copy_complete(copy);
  finish(replica, txn, txn.seeded_outcome.value_or(PublishOk{version}));
}

// ---- unpublish -------------------------------------------------------------------------------------

void Hub::on_unpublish(Replica& replica, Txn& txn) {
  Copy* copy = replica.primary;
  if (copy == nullptr || copy->state != CopyState::kComplete) {
    finish(replica, txn,
           make_error(Errc::kNotPublished,
                      describe(replica) + (copy == nullptr ? " holds no version"
                                                           : " holds a version that is " +
                                                                 std::string(copy_state_name(
                                                                     copy->state)))));
    return;
  }
  txn.stage = TxnStage::kDraining;
  start_drain(*copy, DrainPurpose::kUnpublish);
  if (bugs().early_unpublish_ack) finish(replica, txn, UnpublishOk{});
}

// ---- replicate and update --------------------------------------------------------------------------

Hub::Resolution Hub::resolve(const Model& model, const Selector& selector) const {
  Resolution resolution;
  if (!model.latest) return resolution;  // nothing published yet: wait
  const Version latest = *model.latest;
  Version target = selector.value;
  if (selector.kind == Selector::Kind::kLatest) {
    if (selector.value > latest) {
      resolution.kind = Resolution::Kind::kError;
      resolution.error = make_error(Errc::kVersionNotFound,
                                    format_selector(selector) + " is below version 0 (latest is " +
                                        std::to_string(latest) + ")");
      return resolution;
    }
    target = latest - selector.value;
  } else if (selector.value > latest) {
    return resolution;  // not published yet: wait
  }
  auto found = model.versions.find(target);
  if (found == model.versions.end() ||
      (!found->second.ever_complete && found->second.potential == 0)) {
    resolution.kind = Resolution::Kind::kError;
    resolution.error = make_error(Errc::kVersionNotFound,
                                  "version " + std::to_string(target) + " was never published here");
    return resolution;
  }
  if (found->second.potential == 0) {
    resolution.kind = Resolution::Kind::kError;
    resolution.error = make_error(Errc::kVersionUnavailable,
                                  "no copy of version " + std::to_string(target) + " is left");
    return resolution;
  }
  resolution.kind = Resolution::Kind::kGo;
  resolution.version = target;
  return resolution;
}

bool Hub::continue_receive(Replica& replica, Txn& txn, std::uint32_t shard, const LayoutRef& layout) {
  if (!record_layout(replica, txn, shard, layout)) return true;
  if (txn.stage != TxnStage::kNew) {  // a later shard of a call already under way
    maybe_start_transfer(replica, txn);
    return true;
  }
  if (txn.seeded && txn.target) {  // settled before a failover: receive what the others got
    begin_receive(replica, txn, *txn.target);
    return true;
  }
  return false;
}

void Hub::on_replicate(Replica& replica, Txn& txn, std::uint32_t shard,
                       const ReplicateRequest& request) {
  if (continue_receive(replica, txn, shard, request.layout)) return;
  if (replica.primary != nullptr) {
    finish(replica, txn, make_error(Errc::kAlreadyHolding,
                                    describe(replica) + " holds version " +
                                        std::to_string(replica.primary->record->version) +
                                        "; unpublish it or call update"));
    return;
  }
  if (request.timeout_ms < 0 || request.timeout_ms > limits::kDeadlineMsMax) {
    finish(replica, txn, make_error(Errc::kInvalidArgument, "timeout must be in [0, 1 day] ms"));
    return;
  }
  if (request.timeout_ms > 0) {
    txn.deadline_ms = now_ms_ + request.timeout_ms;
    replica.model->deadlines.emplace(txn.deadline_ms, TxnRef{&replica, txn.seq});
  }
  txn.stage = TxnStage::kUnresolved;
  try_resolve(replica, txn);
}

void Hub::try_resolve(Replica& replica, Txn& txn) {
  TH_ASSERT(txn.stage == TxnStage::kUnresolved);
  Model& model = *replica.model;
  const Resolution resolution = resolve(model, txn.op.selector);
  switch (resolution.kind) {
    case Resolution::Kind::kWait:
      if (txn.ticket == 0) {
        txn.ticket = next_ticket_++;
        model.unresolved.emplace(txn.ticket, TxnRef{&replica, txn.seq});
      }
      return;
    case Resolution::Kind::kError:
      finish(replica, txn, resolution.error);
      return;
    case Resolution::Kind::kGo:
      if (txn.ticket != 0) {
        model.unresolved.erase(txn.ticket);
        txn.ticket = 0;
      }
      begin_receive(replica, txn, resolution.version);
      return;
  }
}

void Hub::on_update(Replica& replica, Txn& txn, std::uint32_t shard, const UpdateRequest& request) {
  if (continue_receive(replica, txn, shard, request.layout)) return;
  Model& model = *replica.model;
  Copy* held = replica.primary;
  if (held != nullptr && held->state != CopyState::kComplete) {
    finish(replica, txn, make_error(Errc::kAlreadyHolding,
                                    describe(replica) + " holds a version that is " +
                                        std::string(copy_state_name(held->state))));
    return;
  }
  const Version held_version = held != nullptr ? held->record->version : 0;
  const Resolution resolution = resolve(model, txn.op.selector);
  if (resolution.kind == Resolution::Kind::kError) {
    finish(replica, txn, resolution.error);
    return;
  }
  if (resolution.kind == Resolution::Kind::kWait ||
      (held != nullptr && resolution.version <= held_version)) {
    finish(replica, txn, UpdateOk{UpdateStatus::kNoNewerVersion, held_version, {}});
    return;
  }
  const VersionRecord& record = model.versions.at(resolution.version);
  if (settings_.smart_skipping && smart_skip(record, replica.dc)) {
    finish(replica, txn, UpdateOk{UpdateStatus::kNotYet, held_version, {}});
    return;
  }
  txn.target = resolution.version;
  if (held != nullptr) {
    txn.previous = held_version;
    txn.stage = TxnStage::kDrainingOld;
    start_drain(*held, DrainPurpose::kUpdate);
    return;
  }
  begin_receive(replica, txn, resolution.version);
}

bool Hub::smart_skip(const VersionRecord& record, DcId dc) const {
  auto found = record.by_dc.find(dc);
  return found != record.by_dc.end() && found->second.complete == 0 && found->second.seeding > 0;
}

void Hub::begin_receive(Replica& replica, Txn& txn, Version version) {
  Model& model = *replica.model;
  txn.target = version;
  txn.stage = TxnStage::kReceiving;
  VersionRecord& record = record_for(model, version);
  Copy* copy = replica.primary;
  if (copy != nullptr) {
    // A failover left some shards holding this version already (see complete_barrier).
    TH_ASSERT(txn.seeded, "receiving into a replica that holds a copy");
    TH_ASSERT(copy->state == CopyState::kGathering && copy->record == &record);
  } else {
    copy = &create_copy(replica, record, CopyKind::kPrimary, CopyState::kGathering);
    replica.primary = copy;
  }
  auto transfer = std::make_unique<Transfer>();
  transfer->id = next_transfer_id_++;
  transfer->reader = copy;
  transfer->txn_seq = txn.seq;
  copy->incoming = transfer.get();
  model.transfers.emplace(transfer->id, std::move(transfer));
  TH_ASSERT(replica.primary == copy && copy->incoming != nullptr);
  maybe_start_transfer(replica, txn);
}

void Hub::maybe_start_transfer(Replica& replica, Txn& txn) {
  if (txn.stage != TxnStage::kReceiving) return;
  TH_ASSERT(replica.primary != nullptr && replica.primary->incoming != nullptr,
            "a receiving transaction has a reader copy and its transfer");
  Copy& copy = *replica.primary;
  if (copy.state != CopyState::kGathering) return;
  // The source is chosen once every shard has called: a shard still busy with its old weights must
  // not hold a source's fan-out slot.
  if ((txn.arrived & txn.expected) != txn.expected) return;
  const Model& model = *replica.model;
  for (std::uint32_t shard = 0; shard < replica.num_shards; ++shard) {
    if (!txn.expected.test(shard) || !model.layouts[shard]) continue;
    TH_ASSERT(txn.layouts[shard] != nullptr, "an arrived shard recorded its layout");
    if (auto why = model.layouts[shard]->mismatch(*txn.layouts[shard])) {
      abort_txn(replica, txn, make_error(Errc::kLayoutMismatch,
                                         "shard " + std::to_string(shard) + ": " + *why));
      return;
    }
  }
  set_state(copy, CopyState::kWaiting);
  try_assign(*copy.incoming);
}

void Hub::try_assign(Transfer& transfer) {
  TH_ASSERT(transfer.source == nullptr);
  TH_ASSERT(transfer.reader->state == CopyState::kWaiting);
  const SourceChoice choice = select_source(transfer);
  switch (choice.pick) {
    case Pick::kFound:
      dequeue_waiting(transfer);
      assign(transfer, *choice.copy);
      TH_ASSERT(transfer.source == choice.copy && transfer.reader->state == CopyState::kActive);
      return;
    case Pick::kWait:
      enqueue_waiting(transfer);
      TH_ASSERT(transfer.queued);
      return;
    case Pick::kUnavailable:
      fail_transfer(transfer, make_error(Errc::kVersionUnavailable,
                                         "no copy of version " +
                                             std::to_string(transfer.reader->record->version) +
                                             " is left to read from"));
      return;
  }
}

namespace {

// Whether `candidate` receives its bytes, directly or through other partial copies, from `reader`.
bool is_downstream(const Copy& candidate, const Copy& reader, std::size_t copies_max) {
  const Copy* at = &candidate;
  for (std::size_t hops = 0; hops <= copies_max; ++hops) {
    if (at == &reader) return true;
    if (at->incoming == nullptr || at->incoming->source == nullptr) return false;
    at = at->incoming->source;
  }
  TH_ASSERT(false, "the source chain has a cycle");
}

// Whether the bytes reaching `reader` from `candidate` would leave a datacenter and come back:
// `candidate`'s chain of sources passes through a datacenter in `downstream_dcs` (the reader's
// and its downstream copies'), other than the one datacenter a local source shares with the
// reader. Such a chain makes two seeders of one datacenter (DESIGN.md §5.5), and the one further
// down serves nothing its peers could not read locally.
bool makes_detour(const Copy& candidate, DcId reader_dc, const std::vector<DcId>& downstream_dcs,
                  std::size_t copies_max) {
  const bool local = candidate.owner->dc == reader_dc;
  const Copy* at = &candidate;
  for (std::size_t hops = 0; hops <= copies_max; ++hops) {
    const DcId dc = at->owner->dc;
    if (!(local && dc == reader_dc) &&
        std::find(downstream_dcs.begin(), downstream_dcs.end(), dc) != downstream_dcs.end()) {
      return true;
    }
    if (at->incoming == nullptr || at->incoming->source == nullptr) return false;
    at = at->incoming->source;
  }
  TH_ASSERT(false, "the source chain has a cycle");
}

}  // namespace

Hub::SourceChoice Hub::select_source(const Transfer& transfer) const {
  const Copy& reader = *transfer.reader;
  const VersionRecord& record = *reader.record;
  const Model& model = *reader.owner->model;
  const DcId dc = reader.owner->dc;
  // A reader that already serves others (a pipeline source whose own source was lost) must not
  // pick a copy that reads from it.
  const bool has_downstream = reader.readers > 0;
  // With copies in several datacenters, no source may route the bytes out of one and back.
  const bool several_dcs = record.by_dc.size() > 1;
  std::vector<DcId> downstream_dcs;
  if (several_dcs) {
    downstream_dcs.push_back(dc);
    for (const Copy* copy : record.copies) {
      if (has_downstream && copy != &reader && is_downstream(*copy, reader, model.copies.size()) &&
          std::find(downstream_dcs.begin(), downstream_dcs.end(), copy->owner->dc) ==
              downstream_dcs.end()) {
        downstream_dcs.push_back(copy->owner->dc);
      }
    }
  }
  auto usable = [&](const Copy* candidate) {
    return candidate != &reader &&
           (!has_downstream || !is_downstream(*candidate, reader, model.copies.size())) &&
           (!several_dcs || !makes_detour(*candidate, dc, downstream_dcs, model.copies.size()));
  };
  auto count_downstream = [&](auto predicate) {
    std::uint32_t count = 0;
    if (!has_downstream) return count;
    for (const Copy* copy : record.copies) {
      if (copy != &reader && predicate(*copy) && is_downstream(*copy, reader, model.copies.size())) {
        ++count;
      }
    }
    return count;
  };
  const bool prefer_remote = bugs().prefer_remote;

  const auto local = record.by_dc.find(dc);
  if (!prefer_remote && local != record.by_dc.end()) {
    for (const auto& [key, copy] : local->second.eligible) {
      if (usable(copy)) return {Pick::kFound, copy};
    }
  }
  // Copies here that serve or will serve soon: wait for them rather than seed across datacenters a
  // second time.
  std::uint32_t servable_here = local != record.by_dc.end() ? local->second.servable : 0;
  servable_here -= count_downstream([&](const Copy& copy) {
    return copy.counted.servable && copy.owner->dc == dc;
  });
  if (!prefer_remote && servable_here > 0) return {Pick::kWait, nullptr};

  Copy* best = nullptr;
  SourceKey best_key;
  for (const auto& [other_dc, sources] : record.by_dc) {
    if (other_dc == dc && !prefer_remote) continue;
    for (const auto& [key, copy] : sources.eligible) {
      if (!usable(copy)) continue;
      if (best == nullptr || key < best_key) {
        best = copy;
        best_key = key;
      }
      break;
    }
  }
  if (best != nullptr) return {Pick::kFound, best};

  // Nothing healthy can serve now: rather than call the version unavailable, try a complete copy
  // that a reader reported (it may have been the reader's trouble), ours first, least loaded first.
  if (servable_here == 0) {
    Copy* suspect = nullptr;
    for (Copy* copy : record.copies) {
      if (!copy->failed || copy->state != CopyState::kComplete || !usable(copy) ||
          copy->readers >= settings_.fanout_max) {
        continue;
      }
      auto rank = [&](const Copy* c) {
        return std::tuple{c->owner->dc != dc, c->readers, c->id};
      };
      if (suspect == nullptr || rank(copy) < rank(suspect)) suspect = copy;
    }
    if (suspect != nullptr) return {Pick::kFound, suspect};
  }

  const std::uint32_t potential =
      record.potential - count_downstream([](const Copy& copy) { return copy.counted.potential; });
  return {potential > 0 ? Pick::kWait : Pick::kUnavailable, nullptr};
}

void Hub::assign(Transfer& transfer, Copy& source) {
  Copy& reader = *transfer.reader;
  Replica& owner = *reader.owner;
  const bool canary_load = bugs().ignore_fanout;
  const bool canary_topology = bugs().prefer_remote;
  TH_ASSERT(source.state == CopyState::kComplete ||
                (settings_.pipeline && source.state == CopyState::kActive),
            "source state", copy_state_name(source.state));
  TH_ASSERT(!source.failed || source.state == CopyState::kComplete, "a suspect is a last resort");
  TH_ASSERT(canary_load || source.readers < settings_.fanout_max, "fan-out limit");
  TH_ASSERT(source.record == reader.record);
  transfer.cross_dc = source.owner->dc != owner.dc;
  if (transfer.cross_dc && !canary_topology) {
    const auto local = reader.record->by_dc.find(owner.dc);
    TH_ASSERT(local == reader.record->by_dc.end() || local->second.eligible.empty() ||
                  reader.readers > 0,
              "a remote source was chosen while a local one could serve");
  }
  transfer.source = &source;
  ++transfer.epoch;
  transfer.last_source = source.owner->name;
  set_readers(source, source.readers + 1);
  set_state(reader, CopyState::kActive);
  ++stats_.transfers_started;

  for (std::uint32_t shard = 0; shard < owner.num_shards; ++shard) {
    if (reader.ready.test(shard)) continue;
    transfer.started.set(shard);
    emit_to(source.owner->shards[shard], ServeRead{transfer.id, transfer.epoch, reader.record->version,
                                                  source.kind, shard, owner.name});
    emit_start_read(transfer, shard);
  }
}

void Hub::resend_instructions(const Replica& replica, std::uint32_t shard) {
  if (const Copy* copy = replica.primary; copy != nullptr && copy->incoming != nullptr) {
    const Transfer& transfer = *copy->incoming;
    if (transfer.source != nullptr && transfer.started.test(shard)) {
      emit_to(transfer.source->owner->shards[shard],
              ServeRead{transfer.id, transfer.epoch, copy->record->version, transfer.source->kind,
                        shard, replica.name});
      emit_start_read(transfer, shard);
    }
  }
  for (const Copy* offload : replica.offloads) {
    if (offload->state == CopyState::kOffloading && !offload->ready.test(shard)) {
      emit_to(replica.shards[shard], Offload{offload->record->version});
    }
  }
}

void Hub::emit_start_read(const Transfer& transfer, std::uint32_t shard) {
  const Copy& reader = *transfer.reader;
  const Copy& source = *transfer.source;
  const VersionRecord& record = *reader.record;
  TH_ASSERT(transfer.started.test(shard));
  TH_ASSERT(record.checksums[shard] != nullptr, "a source's version has checksums");
  emit_to(reader.owner->shards[shard],
          StartRead{transfer.id, transfer.epoch, record.version, shard,
                 SourceRef{source.owner->name, source.owner->incarnation, source.owner->datacenter,
                           source.owner->shards[shard].endpoint, source.kind,
                           source.state != CopyState::kComplete},
                 record.checksums[shard]});
}

void Hub::detach_source(Transfer& transfer) {
  Copy* source = transfer.source;
  if (source == nullptr) return;
  Model& model = *source->owner->model;
  for_each_shard(transfer.started, source->owner->num_shards, [&](std::uint32_t shard) {
    emit_to(source->owner->shards[shard], StopServing{transfer.id, transfer.epoch});
  });
  transfer.started.reset();
  transfer.source = nullptr;
  TH_ASSERT(source->readers > 0, "a source counts the transfer that leaves it");
  set_readers(*source, source->readers - 1);
  if (source->state == CopyState::kDraining && source->readers == 0) {
    drained_.emplace_back(&model, source->id);
  }
}

void Hub::reassign(Transfer& transfer) {
  Model& model = *transfer.reader->owner->model;
  detach_source(transfer);
  set_state(*transfer.reader, CopyState::kWaiting);
  ++transfer.failures;
  orphans_.emplace_back(&model, transfer.id);  // settle() picks another source, or gives up
}

void Hub::complete_transfer(Transfer& transfer) {
  Copy& reader = *transfer.reader;
  Replica& replica = *reader.owner;
  TH_ASSERT(reader.ready.count() == replica.num_shards, "every shard has its bytes");
  TH_ASSERT(reader.incoming == &transfer);
  Model& model = *replica.model;
  detach_source(transfer);
  dequeue_waiting(transfer);
  const std::string source_name = transfer.last_source;
  const std::uint64_t seq = transfer.txn_seq;
  reader.incoming = nullptr;
  model.transfers.erase(transfer.id);
  ++stats_.transfers_completed;
  set_state(reader, CopyState::kComplete);
  on_copy_complete(reader);
  auto found = replica.txns.find(seq);
  if (found == replica.txns.end() || found->second.result) return;
  const Version version = reader.record->version;
  if (found->second.seeded_outcome) {
    finish(replica, found->second, *found->second.seeded_outcome);
  } else if (found->second.op.kind == OpKind::kUpdate) {
    finish(replica, found->second, UpdateOk{UpdateStatus::kUpdated, version, source_name});
  } else {
    finish(replica, found->second, ReplicateOk{version, source_name});
  }
}

void Hub::fail_transfer(Transfer& transfer, const Error& error) {
  Replica& replica = *transfer.reader->owner;
  const std::uint64_t seq = transfer.txn_seq;
  const bool written = transfer.epoch > 0;  // some shard was told to read: its buffers changed
  remove_copy(*transfer.reader);            // also ends the transfer
  auto found = replica.txns.find(seq);
  if (found == replica.txns.end() || found->second.result) return;
  if (!written && found->second.previous) restore_previous(replica, *found->second.previous);
  finish(replica, found->second, error);
}

void Hub::enqueue_waiting(Transfer& transfer) {
  TH_ASSERT(transfer.source == nullptr, "only a transfer without a source waits for one");
  if (transfer.queued) return;
  VersionRecord& record = *transfer.reader->record;
  record.waiting.push_back(&transfer);
  transfer.queued = true;
  transfer.reader->owner->model->versions_with_waiters.insert(record.version);
}

void Hub::dequeue_waiting(Transfer& transfer) {
  if (!transfer.queued) return;
  VersionRecord& record = *transfer.reader->record;
  auto found = std::find(record.waiting.begin(), record.waiting.end(), &transfer);
  TH_ASSERT(found != record.waiting.end(), "a queued transfer is in its queue");
  record.waiting.erase(found);
  transfer.queued = false;
  if (record.waiting.empty()) {
    transfer.reader->owner->model->versions_with_waiters.erase(record.version);
  }
}

// ---- data-plane reports ----------------------------------------------------------------------------

void Hub::on_report(const Report& report) {
  ++stats_.reports;
  const Binding* found = clients_.find(report.client);
  if (found == nullptr) {
    // The hub does not know this client (evicted, or this is a new server): tell it to re-open.
    emit(report.client, report.session,
         Evicted{Errc::kUnknownClient, "no open handle with this id; re-open"});
    return;
  }
  Replica& replica = *found->replica;
  const std::uint32_t shard = found->shard;
  if (report.session != replica.shards[shard].session) return;  // from before its last open
  replica.shards[shard].last_seen_ms = now_ms_;
  std::visit(
      [&](const auto& body) {
        using T = std::decay_t<decltype(body)>;
        if constexpr (std::is_same_v<T, TransferDone>) {
          on_transfer_done(replica, shard, body);
        } else if constexpr (std::is_same_v<T, TransferFailed>) {
          on_transfer_failed(replica, shard, body);
        } else if constexpr (std::is_same_v<T, OffloadDone>) {
          on_offload_done(replica, shard, body);
        } else {
          static_assert(std::is_same_v<T, Heartbeat>);
        }
      },
      report.body);
}

void Hub::on_transfer_done(Replica& replica, std::uint32_t shard, const TransferDone& done) {
  Model& model = *replica.model;
  auto found = model.transfers.find(done.transfer);
  if (found == model.transfers.end()) return;  // finished or cancelled already: a late duplicate
  Transfer& transfer = *found->second;
  Copy& reader = *transfer.reader;
  TH_ASSERT(shard < replica.num_shards);
  if (reader.owner != &replica || reader.ready.test(shard)) return;
  if (done.epoch == 0 || done.epoch > transfer.epoch) return;
  if (done.epoch == transfer.epoch && !transfer.started.test(shard)) return;
  // The client verified every tensor against the published checksums, so bytes read from an earlier
  // source count too. Either way the shard no longer reads from the current one.
  if (transfer.started.test(shard)) {
    TH_ASSERT(transfer.source != nullptr, "started shards read from a source");
    emit_to(transfer.source->owner->shards[shard], StopServing{transfer.id, transfer.epoch});
    transfer.started.reset(shard);
  }
  reader.ready.set(shard);
  if (reader.ready.count() == replica.num_shards) complete_transfer(transfer);
}

void Hub::on_transfer_failed(Replica& replica, std::uint32_t shard, const TransferFailed& failed) {
  Model& model = *replica.model;
  auto found = model.transfers.find(failed.transfer);
  if (found == model.transfers.end()) return;
  Transfer& transfer = *found->second;
  if (transfer.reader->owner != &replica || transfer.reader->ready.test(shard)) return;
  if (transfer.source == nullptr || !transfer.started.test(shard)) return;
  if (failed.epoch < transfer.epoch) {
    // About a source the hub already replaced; the shard may have missed where to read now.
    emit_start_read(transfer, shard);
    return;
  }
  if (failed.epoch != transfer.epoch) return;
  ++stats_.source_failures;
  set_failed(*transfer.source);
  reassign(transfer);
}

void Hub::on_offload_done(Replica& replica, std::uint32_t shard, const OffloadDone& done) {
  Copy* offload = nullptr;
  for (Copy* copy : replica.offloads) {
    if (copy->record->version == done.version && copy->state == CopyState::kOffloading) {
      offload = copy;
    }
  }
  if (offload == nullptr) return;  // a duplicate, or the offload was cancelled
  offload->ready.set(shard);
  if (offload->ready.count() < replica.num_shards) return;
  set_state(*offload, CopyState::kComplete);
  on_copy_complete(*offload);
  Copy* primary = replica.primary;
  if (primary != nullptr && primary->awaiting_offload == offload->id) {
    primary->awaiting_offload = 0;
    const DrainPurpose purpose = primary->drain_purpose;
    remove_copy(*primary);
    after_primary_drained(replica, purpose);
  }
}

// ---- list and wait ---------------------------------------------------------------------------------

bool Hub::evaluate_wait(const Model& model, const WaitPredicate& predicate, Error* error) const {
  switch (predicate.kind) {
    case WaitPredicate::Kind::kVersionAtLeast:
      return model.latest && *model.latest >= predicate.version;
    case WaitPredicate::Kind::kReplicasHold: {
      auto found = model.versions.find(predicate.version);
      if (found != model.versions.end()) {
        if (found->second.complete_primaries >= predicate.replicas_min) return true;
        if (found->second.ever_complete && found->second.potential == 0) {
          *error = make_error(Errc::kVersionUnavailable,
                              "no copy of version " + std::to_string(predicate.version) + " is left");
        }
        return false;
      }
      if (model.latest && predicate.version < *model.latest) {
        *error = make_error(Errc::kVersionNotFound,
                            "version " + std::to_string(predicate.version) + " is not known here");
      }
      return false;
    }
    case WaitPredicate::Kind::kRoleHolds:
      for (const auto& [name, replica] : model.replicas) {
        if (replica->role != predicate.role || replica->phase == ReplicaPhase::kClosing) continue;
        const Copy* copy = replica->primary;
        if (copy == nullptr || copy->state != CopyState::kComplete ||
            copy->record->version < predicate.version) {
          return false;
        }
      }
      return true;
  }
  return false;
}

void Hub::on_wait(Replica& replica, Txn& txn, const WaitRequest& request) {
  Model& model = *replica.model;
  const WaitPredicate& predicate = request.predicate;
  if (request.timeout_ms < 0 || request.timeout_ms > limits::kDeadlineMsMax ||
      predicate.replicas_min == 0 || !valid_name(predicate.role, true)) {
    finish(replica, txn, make_error(Errc::kInvalidArgument,
                                    "wait needs a timeout in [0, 1 day] ms, replicas_min >= 1 "
                                    "and a role of at most 256 bytes"));
    return;
  }
  Error error{Errc::kInvalidArgument, {}};
  if (evaluate_wait(model, predicate, &error)) {
    finish(replica, txn, WaitOk{});
    return;
  }
  if (!error.detail.empty()) {
    finish(replica, txn, error);
    return;
  }
  txn.stage = TxnStage::kWaiting;
  txn.ticket = next_ticket_++;
  model.waits.emplace(txn.ticket, TxnRef{&replica, txn.seq});
  if (request.timeout_ms > 0) {
    txn.deadline_ms = now_ms_ + request.timeout_ms;
    model.deadlines.emplace(txn.deadline_ms, TxnRef{&replica, txn.seq});
  }
}

std::shared_ptr<const ListSnapshot> Hub::make_snapshot(const Model& model) const {
  auto snapshot = std::make_shared<ListSnapshot>();
  snapshot->model = model.name;
  snapshot->latest = model.latest;
  for (const auto& [version, record] : model.versions) {
    if (record.copies.empty() && !record.ever_complete) continue;
    ListSnapshot::VersionInfo info;
    info.version = version;
    info.retained = is_retained(model, version);
    for (const Copy* copy : record.copies) {
      if (copy->state == CopyState::kComplete) {
        ++info.complete;
        if (copy->kind == CopyKind::kOffload) info.offloaded = true;
      } else if (copy->state != CopyState::kDraining) {
        ++info.partial;
      }
    }
    snapshot->versions.push_back(info);
  }
  for (const auto& [name, replica] : model.replicas) {
    ListSnapshot::ReplicaInfo info;
    info.name = name;
    info.incarnation = replica->incarnation;
    info.datacenter = replica->datacenter;
    info.spot = replica->spot;
    info.role = replica->role;
    info.num_shards = replica->num_shards;
    info.state = replica->phase == ReplicaPhase::kResuming  ? "resuming"
                 : replica->phase == ReplicaPhase::kClosing ? "closing"
                 : replica->primary == nullptr              ? "empty"
                                                 : std::string(copy_state_name(replica->primary->state));
    if (replica->primary != nullptr) {
      info.version = replica->primary->record->version;
      info.serving += replica->primary->readers;
    }
    for (const Copy* offload : replica->offloads) {
      info.offloads.push_back(offload->record->version);
      info.serving += offload->readers;
    }
    snapshot->replicas.push_back(std::move(info));
  }
  return snapshot;
}

// ---- close -----------------------------------------------------------------------------------------

void Hub::on_close(Replica& replica, Txn& txn) {
  replica.phase = ReplicaPhase::kClosing;
  txn.stage = TxnStage::kClosing;
  // Other calls of this replica can no longer complete.
  std::vector<std::uint64_t> others;
  for (const auto& [seq, other] : replica.txns) {
    if (seq != txn.seq && !other.result) others.push_back(seq);
  }
  for (std::uint64_t seq : others) {
    auto found = replica.txns.find(seq);
    if (found != replica.txns.end() && !found->second.result) {
      abort_txn(replica, found->second, make_error(Errc::kReplicaClosed, describe(replica) + " closed"));
    }
  }
  std::vector<Copy*> copies = replica.offloads;
  if (replica.primary != nullptr) copies.push_back(replica.primary);
  for (Copy* copy : copies) {
    switch (copy->state) {
      case CopyState::kComplete:
        start_drain(*copy, DrainPurpose::kClose);
        break;
      case CopyState::kDraining:
        copy->drain_purpose = DrainPurpose::kClose;
        copy->awaiting_offload = 0;
        if (copy->readers == 0) drained_.emplace_back(replica.model, copy->id);
        break;
      default:
        remove_copy(*copy);  // not yet a source, or an offload that will not be needed
        break;
    }
  }
  if (replica.primary == nullptr && replica.offloads.empty()) finish(replica, txn, CloseOk{});
}

// ==== Copies =======================================================================================

Hub::Copy& Hub::create_copy(Replica& owner, VersionRecord& record, CopyKind kind, CopyState state) {
  Model& model = *owner.model;
  auto copy = std::make_unique<Copy>();
  copy->id = next_copy_id_++;
  copy->owner = &owner;
  copy->record = &record;
  copy->kind = kind;
  copy->state = state;
  Copy& ref = *copy;
  TH_ASSERT(record.copies.size() < model.replicas.size() * (limits::kOffloadsPerReplicaMax + 1),
            "at most one primary and the offloads of each replica hold a version");
  model.copies.emplace(ref.id, std::move(copy));
  ref.index_in_record = record.copies.size();
  record.copies.push_back(&ref);
  ref.counted = contribution(ref);
  apply(ref, ref.counted, +1);
  return ref;
}

void Hub::remove_copy(Copy& copy) {
  Replica& owner = *copy.owner;
  Model& model = *owner.model;
  VersionRecord& record = *copy.record;
  // Stop being a reader.
  if (Transfer* incoming = copy.incoming) {
    detach_source(*incoming);
    dequeue_waiting(*incoming);
    copy.incoming = nullptr;
    model.transfers.erase(incoming->id);
  }
  // Stop being a source: every reader of this copy looks for another one.
  if (copy.readers > 0) {
    std::vector<Transfer*> readers;
    for (const auto& [id, transfer] : model.transfers) {
      if (transfer->source == &copy) readers.push_back(transfer.get());
    }
    for (Transfer* transfer : readers) reassign(*transfer);
  }
  TH_ASSERT(copy.readers == 0, "a removed copy has no readers");
  apply(copy, copy.counted, -1);
  // Swap-and-pop: thousands of replicas may hold one version.
  TH_ASSERT(record.copies[copy.index_in_record] == &copy);
  record.copies[copy.index_in_record] = record.copies.back();
  record.copies[copy.index_in_record]->index_in_record = copy.index_in_record;
  record.copies.pop_back();
  record.dirty = true;
  if (record.copies.empty() && !record.ever_complete) model.forgettable.push_back(record.version);
  if (bugs().latest_regress && record.copies.empty() && model.latest == record.version) {
    model.latest.reset();
    for (const auto& [version, other] : model.versions) {
      if (!other.copies.empty() && other.ever_complete) model.latest = version;
    }
  }
  if (owner.primary == &copy) owner.primary = nullptr;
  std::erase(owner.offloads, &copy);
  model.offload_copies.erase(copy.id);
  mark_dirty(model);
  model.copies.erase(copy.id);
}

Contribution Hub::contribution(const Copy& copy) const {
  Contribution c;
  const bool usable = !copy.failed;
  const bool complete = copy.state == CopyState::kComplete;
  const bool active = copy.state == CopyState::kActive;
  c.complete = usable && complete;
  c.complete_primary = c.complete && copy.kind == CopyKind::kPrimary;
  c.safe_primary = c.complete_primary && !copy.owner->spot;
  c.safe_offload = c.complete && copy.kind == CopyKind::kOffload;
  c.servable = usable && (complete || active);
  // A seeder a reader reported as failed no longer counts: another may seed (DESIGN.md §5.5).
  c.seeding = usable && active && copy.incoming != nullptr && copy.incoming->cross_dc;
  // A draining primary of a non-spot replica may still turn into an offload copy.
  const bool may_offload = copy.state == CopyState::kDraining && copy.kind == CopyKind::kPrimary &&
                           !copy.owner->spot && copy.drain_purpose != DrainPurpose::kClose;
  // A copy a reader reported is only suspected: it still counts until its replica is evicted.
  c.potential = complete || active || copy.state == CopyState::kPublishing ||
                copy.state == CopyState::kOffloading || may_offload;
  const bool fits = copy.readers < settings_.fanout_max || bugs().ignore_fanout;
  c.eligible = fits && usable && (complete || (active && settings_.pipeline));
  c.key = SourceKey{copy.readers, static_cast<std::uint8_t>(active ? 1 : 0), copy.id};
  return c;
}

void Hub::apply(Copy& copy, const Contribution& c, int sign) {
  VersionRecord& record = *copy.record;
  DcSources& sources = record.by_dc[copy.owner->dc];
  if (c.eligible) {
    if (sign > 0) {
      const bool inserted = sources.eligible.emplace(c.key, &copy).second;
      TH_ASSERT(inserted);
    } else {
      const std::size_t erased = sources.eligible.erase({c.key, &copy});
      TH_ASSERT(erased == 1);
    }
  }
  add_count(sources.servable, c.servable, sign);
  add_count(sources.complete, c.complete, sign);
  add_count(sources.seeding, c.seeding, sign);
  add_count(record.safe_primaries, c.safe_primary, sign);
  add_count(record.safe_offloads, c.safe_offload, sign);
  add_count(record.complete_primaries, c.complete_primary, sign);
  add_count(record.potential, c.potential, sign);
}

void Hub::reindex(Copy& copy) {
  apply(copy, copy.counted, -1);
  copy.counted = contribution(copy);
  apply(copy, copy.counted, +1);
  VersionRecord& record = *copy.record;
  record.dirty = true;
  if (!record.waiting.empty()) mark_dirty(*copy.owner->model);
}

void Hub::set_state(Copy& copy, CopyState state) {
  copy.state = state;
  reindex(copy);
}

void Hub::set_readers(Copy& copy, std::uint32_t readers) {
  copy.readers = readers;
  reindex(copy);
}

void Hub::set_failed(Copy& copy) {
  copy.failed = true;
  reindex(copy);
}

void Hub::on_copy_complete(Copy& copy) {
  Model& model = *copy.owner->model;
  VersionRecord& record = *copy.record;
  TH_ASSERT(copy.state == CopyState::kComplete);
  TH_ASSERT(copy.ready.count() == copy.owner->num_shards);
  record.ever_complete = true;
  if (!model.latest || record.version > *model.latest) {
    TH_ASSERT(!model.latest || record.version > *model.latest, "latest only moves forward");
    model.latest = record.version;
  }
  mark_dirty(model);
}

void Hub::start_drain(Copy& copy, DrainPurpose purpose) {
  TH_ASSERT(copy.state == CopyState::kComplete, "only complete copies drain");
  copy.drain_purpose = purpose;
  set_state(copy, CopyState::kDraining);
  if (copy.readers == 0) drained_.emplace_back(copy.owner->model, copy.id);
}

bool Hub::needs_offload(const Copy& copy) const {
  if (bugs().skip_offload) return false;
  const VersionRecord& record = *copy.record;
  return copy.kind == CopyKind::kPrimary && !copy.owner->spot &&
         is_retained(*copy.owner->model, record.version) &&
         record.safe_primaries + record.safe_offloads == 0;
}

void Hub::on_drained(Copy& copy) {
  TH_ASSERT(copy.state == CopyState::kDraining && copy.readers == 0);
  TH_ASSERT(copy.awaiting_offload == 0);
  Replica& owner = *copy.owner;
  const DrainPurpose purpose = copy.drain_purpose;
  switch (purpose) {
    case DrainPurpose::kRelease:
      emit_to_replica(owner, ReleaseOffload{copy.record->version});
      remove_copy(copy);
      return;
    case DrainPurpose::kClose:
      remove_copy(copy);
      if (owner.primary == nullptr && owner.offloads.empty()) {
        for (auto& [seq, txn] : owner.txns) {
          if (txn.stage == TxnStage::kClosing && !txn.result) {
            finish(owner, txn, CloseOk{});
            return;
          }
        }
      }
      return;
    case DrainPurpose::kUnpublish:
    case DrainPurpose::kUpdate:
      if (needs_offload(copy)) {
        // The last safe copy of a retained version: the owner copies it to CPU memory before its
        // buffers may change, and the unpublish completes once that offload copy exists. If the
        // owner still has an offload copy of this version that is only draining to be released,
        // that copy is kept instead: a replica never holds two offload copies of one version, so
        // ReleaseOffload{version} always names exactly one.
        if (Copy* releasing = releasing_offload(owner, copy.record->version)) {
          set_state(*releasing, CopyState::kComplete);
        } else {
          Copy& offload = start_offload(owner, *copy.record);
          copy.awaiting_offload = offload.id;
          return;
        }
      }
      remove_copy(copy);
      after_primary_drained(owner, purpose);
      return;
  }
}

void Hub::after_primary_drained(Replica& replica, DrainPurpose purpose) {
  const TxnStage stage = purpose == DrainPurpose::kUpdate ? TxnStage::kDrainingOld : TxnStage::kDraining;
  for (auto& [seq, txn] : replica.txns) {
    if (txn.stage != stage || txn.result) continue;
    if (purpose == DrainPurpose::kUpdate) {
      begin_receive(replica, txn, *txn.target);
    } else {
      finish(replica, txn, UnpublishOk{});
    }
    return;
  }
}

Hub::Copy* Hub::releasing_offload(const Replica& replica, Version version) const {
  for (Copy* offload : replica.offloads) {
    if (offload->record->version == version && offload->state == CopyState::kDraining &&
        offload->drain_purpose == DrainPurpose::kRelease) {
      return offload;
    }
  }
  return nullptr;
}

Hub::Copy& Hub::start_offload(Replica& replica, VersionRecord& record) {
  TH_ASSERT(replica.offloads.size() < limits::kOffloadsPerReplicaMax, "offloads per replica");
  TH_ASSERT(!replica.spot, "a spot replica's copy never counts, so it never offloads");
  Copy& offload = create_copy(replica, record, CopyKind::kOffload, CopyState::kOffloading);
  replica.offloads.push_back(&offload);
  replica.model->offload_copies.insert(offload.id);
  ++stats_.offloads_started;
  emit_to_replica(replica, Offload{record.version});
  return offload;
}

void Hub::reconcile_offloads(Model& model) {
  const std::vector<CopyId> ids(model.offload_copies.begin(), model.offload_copies.end());
  for (CopyId id : ids) {
    auto found = model.copies.find(id);
    if (found == model.copies.end()) continue;
    Copy& offload = *found->second;
    if (offload.state != CopyState::kComplete) continue;
    const VersionRecord& record = *offload.record;
    // Released once another non-spot replica holds the version completely, once a second offload
    // copy exists, or once the version leaves retention.
    if (record.safe_primaries > 0 || record.safe_offloads > 1 ||
        !is_retained(model, record.version)) {
      start_drain(offload, DrainPurpose::kRelease);
    }
  }
}

// ==== Replicas, retention, failover ===============================================================

void Hub::on_open(ClientId client, std::uint64_t seq, std::uint64_t open_session,
                  const OpenRequest& open) {
  auto reject = [&](Errc code, std::string detail, std::uint64_t replica_incarnation = 0) {
    emit(client, open_session, Reply{seq, make_error(code, std::move(detail)), replica_incarnation});
  };
  if (const Binding* bound = clients_.find(client)) {
    const ShardSlot& slot = bound->replica->shards[bound->shard];
    const bool retransmitted = open_session == slot.session && seq == slot.open_seq;
    if (retransmitted) {
      // Answer it again if the answer exists; a resuming open may still wait in its barrier, and
      // its retransmissions are its heartbeats meanwhile.
      bound->replica->shards[bound->shard].last_seen_ms = now_ms_;
      if (slot.last_reply && slot.last_reply->seq == seq) emit_to(slot, *slot.last_reply);
      return;
    }
    if (open_session <= slot.session) {
      reject(Errc::kAlreadyOpen, "this handle id is already open");
      return;
    }
    // A newer session: the client lost its view of the replica (it thinks it was evicted, or its
    // messages crossed). Like a restart, that ends the replica it was part of.
    Replica& stale = *bound->replica;
    evict(stale, Errc::kReplicaEvicted,
          "shard " + std::to_string(bound->shard) + " of " + describe(stale) + " opened again");
  }
  if (Status valid = validate(open); !valid.ok()) {
    reject(valid.error().code, valid.error().detail);
    return;
  }

  auto model_found = models_.find(open.model);
  if (model_found == models_.end()) {
    if (models_.size() >= limits::kModelsMax) {
      reject(Errc::kLimitExceeded, "this server already hosts 64 models");
      return;
    }
    auto model = std::make_unique<Model>();
    model->name = open.model;
    model->num_shards = open.num_shards;
    model->layouts.resize(open.num_shards);
    model_found = models_.emplace(open.model, std::move(model)).first;
  }
  Model& model = *model_found->second;
  if (model.num_shards != open.num_shards) {
    reject(Errc::kOpenMismatch, "model '" + model.name + "' has " +
                                    std::to_string(model.num_shards) + " shards per replica");
    return;
  }
  if (!datacenters_.contains(open.datacenter) && datacenters_.size() >= limits::kDatacentersMax) {
    reject(Errc::kLimitExceeded, "more than 256 datacenters");
    return;
  }

  Replica* replica = nullptr;
  if (auto found = model.replicas.find(open.replica); found != model.replicas.end()) {
    replica = found->second.get();
    if (open.incarnation < replica->incarnation) {
      reject(Errc::kStaleIncarnation,
             describe(*replica) + " is newer than incarnation " + std::to_string(open.incarnation),
             replica->incarnation);
      return;
    }
    if (open.incarnation > replica->incarnation) {
      evict(*replica, Errc::kReplicaEvicted,
            describe(*replica) + " was replaced by incarnation " + std::to_string(open.incarnation));
      replica = nullptr;
    } else {
      if (replica->datacenter != open.datacenter || replica->spot != open.spot ||
          replica->role != open.role) {
        reject(Errc::kOpenMismatch, describe(*replica) +
                                        " was opened with another datacenter, spot flag or role");
        return;
      }
      if (replica->phase == ReplicaPhase::kClosing) {
        reject(Errc::kReplicaClosed, describe(*replica) + " is closing");
        return;
      }
      if (replica->shards[open.shard].client) {
        reject(Errc::kShardAlreadyOpen, "shard " + std::to_string(open.shard) + " of " +
                                            describe(*replica) + " is already open");
        return;
      }
      if (replica->phase == ReplicaPhase::kLive && open.resume != nullptr) {
        // The replica's other shards started afresh: this shard's history no longer applies.
        reject(Errc::kDivergentCall,
               "the other shards of " + describe(*replica) + " started over; open fresh",
               replica->incarnation);
        return;
      }
      // A fresh open joining a resuming replica resumes with nothing, at call 0: the barrier then
      // decides whether the shards can go on together.
    }
  }
  if (replica == nullptr) {
    if (model.replicas.size() >= limits::kReplicasPerModelMax) {
      reject(Errc::kLimitExceeded, "model '" + model.name + "' already has 16384 replicas");
      return;
    }
    auto created = std::make_unique<Replica>();
    created->model = &model;
    created->name = open.replica;
    created->incarnation = open.incarnation;
    created->num_shards = open.num_shards;
    created->dc = intern_dc(open.datacenter);
    created->datacenter = open.datacenter;
    created->spot = open.spot;
    created->role = open.role;
    created->shards.resize(open.num_shards);
    if (open.resume) {
      created->phase = ReplicaPhase::kResuming;
      created->barrier_deadline_ms = now_ms_ + settings_.barrier_timeout_ms;
      expiry_due_by(created->barrier_deadline_ms);
    }
    replica = created.get();
    model.replicas.emplace(open.replica, std::move(created));
  }

  ShardSlot& slot = replica->shards[open.shard];
  slot.client = client;
  slot.session = open_session;
  slot.last_seq = seq;
  slot.open_seq = seq;
  slot.last_reply.reset();
  slot.last_seen_ms = now_ms_;
  expiry_due_by(now_ms_ + settings_.heartbeat_timeout_ms + 1);
  slot.retention = open.retention;
  slot.endpoint = open.data_endpoint;
  slot.resume = open.resume;
  ++replica->bound_shards;
  TH_ASSERT(replica->bound_shards <= replica->num_shards);
  clients_.insert(client, Binding{replica, open.shard});
  add_retention(model, slot.retention, +1);

  if (replica->phase == ReplicaPhase::kResuming) {
    if (!slot.resume) slot.resume = std::make_shared<const Resume>();
    if (replica->bound_shards == replica->num_shards) complete_barrier(*replica);
    return;
  }
  send_reply(*replica, open.shard, seq, OpenOk{replica->num_shards, model.latest});
}

void Hub::unbind(Replica& replica, std::uint32_t shard) {
  ShardSlot& slot = replica.shards[shard];
  if (!slot.client) return;
  clients_.erase(*slot.client);
  slot.client.reset();
  TH_ASSERT(replica.bound_shards > 0);
  --replica.bound_shards;
  add_retention(*replica.model, slot.retention, -1);
}

void Hub::add_retention(Model& model, const Retention& retention, int sign) {
  if (retention.keep_latest) {
    if (sign > 0) {
      model.keep_latest.insert(*retention.keep_latest);
    } else {
      auto found = model.keep_latest.find(*retention.keep_latest);
      TH_ASSERT(found != model.keep_latest.end(), "a counted rule is present");
      model.keep_latest.erase(found);
    }
  }
  for (Version version : retention.pinned) {
    if (sign > 0) {
      ++model.pinned[version];
    } else {
      auto found = model.pinned.find(version);
      TH_ASSERT(found != model.pinned.end() && found->second > 0, "a counted pin is present");
      if (--found->second == 0) model.pinned.erase(found);
    }
  }
  mark_dirty(model);
}

bool Hub::is_retained(const Model& model, Version version) const {
  if (model.pinned.contains(version)) return true;
  if (!model.latest || model.keep_latest.empty()) return false;
  const std::uint64_t keep = *model.keep_latest.rbegin();
  return version <= *model.latest && version + keep >= *model.latest;
}

void Hub::evict(Replica& replica, Errc reason, const std::string& detail) {
  ++stats_.evictions;
  const Error error = make_error(reason, detail);
  for (auto& [seq, txn] : replica.txns) {
    if (txn.result) continue;
    for_each_shard(txn.arrived & ~txn.replied, replica.num_shards,
                   [&](std::uint32_t shard) { send_reply(replica, shard, seq, error); });
  }
  if (replica.phase == ReplicaPhase::kResuming) {
    // Shards waiting in the barrier have an open call outstanding: answer it.
    for (std::uint32_t shard = 0; shard < replica.num_shards; ++shard) {
      if (replica.shards[shard].client) send_reply(replica, shard, replica.shards[shard].open_seq, error);
    }
  }
  emit_to_replica(replica, Evicted{reason, detail});
  remove_replica(replica);
}

void Hub::remove_replica(Replica& replica) {
  Model& model = *replica.model;
  for (const auto& [seq, txn] : replica.txns) {
    if (txn.ticket == 0) continue;
    model.unresolved.erase(txn.ticket);
    model.waits.erase(txn.ticket);
  }
  std::erase_if(model.deadlines, [&](const auto& entry) { return entry.second.replica == &replica; });
  std::vector<Copy*> copies = replica.offloads;
  if (replica.primary != nullptr) copies.push_back(replica.primary);
  for (Copy* copy : copies) remove_copy(*copy);
  TH_ASSERT(replica.primary == nullptr && replica.offloads.empty());
  for (std::uint32_t shard = 0; shard < replica.num_shards; ++shard) unbind(replica, shard);
  TH_ASSERT(replica.bound_shards == 0);
  mark_dirty(model);
  model.replicas.erase(replica.name);  // destroys `replica`
}

void Hub::fail_barrier(Replica& replica, const Error& error) {
  for (std::uint32_t shard = 0; shard < replica.num_shards; ++shard) {
    if (replica.shards[shard].client) send_reply(replica, shard, replica.shards[shard].open_seq, error);
  }
  remove_replica(replica);
}

void Hub::complete_barrier(Replica& replica) {
  TH_ASSERT(replica.phase == ReplicaPhase::kResuming);
  TH_ASSERT(replica.bound_shards == replica.num_shards);
  std::uint64_t low = replica.shards[0].open_seq;
  std::uint64_t high = low;
  for (const ShardSlot& slot : replica.shards) {
    low = std::min(low, slot.open_seq);
    high = std::max(high, slot.open_seq);
  }
  if (high - low > 1) {
    fail_barrier(replica, make_error(Errc::kDivergentCall,
                                     "shards of " + describe(replica) + " resumed at calls " +
                                         std::to_string(low) + " and " + std::to_string(high)));
    return;
  }
  Txn* seeded = nullptr;
  if (high != low) {
    // A failover in the middle of call `high`: some shards completed it on the old server, the
    // others will call it again here. They must get the answer the first ones got.
    std::optional<TxnRecord> record;
    for (const ShardSlot& slot : replica.shards) {
      if (slot.open_seq != high) continue;
      const std::optional<TxnRecord>& last =
          slot.resume ? slot.resume->last_txn : std::optional<TxnRecord>{};
      const bool agrees = last && last->seq == high &&
                          (!record || (record->op == last->op &&
                                       same_answer(record->outcome, last->outcome)));
      if (!agrees) {
        fail_barrier(replica, make_error(Errc::kDivergentCall,
                                         "shards of " + describe(replica) +
                                             " disagree about the outcome of call " +
                                             std::to_string(high)));
        return;
      }
      record = last;
    }
    Txn& txn = replica.txns[high];
    txn.seq = high;
    txn.op = record->op;
    txn.seeded = true;
    for (std::uint32_t shard = 0; shard < replica.num_shards; ++shard) {
      if (replica.shards[shard].open_seq == low) txn.expected.set(shard);
    }
    // Answers that need nothing of this server are given as they were. A replicate, an update that
    // moved or a publish still has to happen here for the remaining shards, with the same answer.
    const Outcome& outcome = record->outcome;
    const auto* updated = std::get_if<UpdateOk>(&outcome);
    if (const auto* replicated = std::get_if<ReplicateOk>(&outcome)) {
      txn.target = replicated->version;
      txn.seeded_outcome = outcome;
    } else if (updated != nullptr && updated->status == UpdateStatus::kUpdated) {
      txn.target = updated->version;
      txn.seeded_outcome = outcome;
    } else if (std::holds_alternative<PublishOk>(outcome) ||
               std::holds_alternative<CloseOk>(outcome)) {
      txn.seeded_outcome = outcome;
    } else {
      txn.result = outcome;
    }
    seeded = &txn;
  }
  if (!announce(replica, seeded)) return;
  replica.phase = ReplicaPhase::kLive;
  // Shards that are ahead wait for the others to redo the call they missed, if it has work left to
  // do here (a receive or a publish): until then the replica is not whole, and a new call of theirs
  // would be answered about a replica that is not what the others will see.
  const bool catching_up = seeded != nullptr && seeded->seeded_outcome.has_value();
  for (std::uint32_t shard = 0; shard < replica.num_shards; ++shard) {
    if (catching_up && replica.shards[shard].open_seq == high) {
      replica.deferred_opens.set(shard);
      continue;
    }
    send_reply(replica, shard, replica.shards[shard].open_seq,
               OpenOk{replica.num_shards, replica.model->latest});
  }
  mark_dirty(*replica.model);
}

// The shards behind a failover finished the call they missed. With the answer the others got, the
// replica is whole again; with another (the data is gone), its shards cannot agree any more and the
// replica is evicted, to be re-opened by its framework (paper §4.5).
void Hub::caught_up(Replica& replica, const Txn& txn) {
  TH_ASSERT(txn.seeded && txn.seeded_outcome.has_value() && txn.result.has_value());
  if (same_answer(*txn.result, *txn.seeded_outcome)) {
    for_each_shard(replica.deferred_opens, replica.num_shards, [&](std::uint32_t shard) {
      send_reply(replica, shard, replica.shards[shard].open_seq,
                 OpenOk{replica.num_shards, replica.model->latest});
    });
    replica.deferred_opens.reset();
    return;
  }
  diverged_.emplace_back(replica.model, replica.name, replica.incarnation, txn.seq);
}

bool Hub::announce(Replica& replica, Txn* seeded) {
  Model& model = *replica.model;
  const std::uint32_t shards = replica.num_shards;
  // The primary: every shard that holds something must hold the same version.
  std::optional<Version> version;
  ShardSet holders;
  for (std::uint32_t shard = 0; shard < shards; ++shard) {
    const auto& resume = replica.shards[shard].resume;
    if (!resume || !resume->primary) continue;
    if (version && *version != resume->primary->version) {
      fail_barrier(replica, make_error(Errc::kDivergentCall,
                                       "shards of " + describe(replica) + " hold versions " +
                                           std::to_string(*version) + " and " +
                                           std::to_string(resume->primary->version)));
      return false;
    }
    version = resume->primary->version;
    holders.set(shard);
  }
  const bool unpublished = seeded != nullptr && seeded->op.kind == OpKind::kUnpublish &&
                           seeded->result && std::holds_alternative<UnpublishOk>(*seeded->result);
  if (version && !unpublished) {
    const bool full = holders.count() == shards;
    CopyState state = CopyState::kComplete;
    if (!full) {
      if (seeded != nullptr && seeded->op.kind == OpKind::kPublish && seeded->seeded_outcome &&
          seeded->op.version == *version) {
        state = CopyState::kPublishing;
      } else if (seeded != nullptr && seeded->target == version) {
        state = CopyState::kGathering;
      } else {
        fail_barrier(replica, make_error(Errc::kDivergentCall,
                                         "only some shards of " + describe(replica) +
                                             " hold version " + std::to_string(*version)));
        return false;
      }
    }
    VersionRecord& record = record_for(model, *version);
    for (std::uint32_t shard = 0; shard < shards; ++shard) {
      if (!holders.test(shard)) continue;
      const HeldCopy& held = *replica.shards[shard].resume->primary;
      if (Status checked = check_shard(model, record, shard, held.layout, held.checksums); !checked) {
        fail_barrier(replica, checked.error());
        return false;
      }
    }
    for (std::uint32_t shard = 0; shard < shards; ++shard) {
      if (!holders.test(shard)) continue;
      const HeldCopy& held = *replica.shards[shard].resume->primary;
      const Status committed = commit_shard(model, record, shard, held.layout, held.checksums);
      TH_ASSERT(committed.ok());
    }
    Copy& copy = create_copy(replica, record, CopyKind::kPrimary, state);
    copy.ready = holders;
    if (state == CopyState::kPublishing) {
      copy.pending_layouts.resize(shards);
      copy.pending_checksums.resize(shards);
    }
    replica.primary = &copy;
    if (full) on_copy_complete(copy);
  }
  // Offload copies: only one that every shard still holds is of any use.
  std::map<Version, ShardSet> offloads;
  for (std::uint32_t shard = 0; shard < shards; ++shard) {
    const auto& resume = replica.shards[shard].resume;
    if (!resume) continue;
    for (const HeldCopy& held : resume->offloads) offloads[held.version].set(shard);
  }
  for (const auto& [offload_version, offload_holders] : offloads) {
    bool usable = offload_holders.count() == shards;
    VersionRecord& record = record_for(model, offload_version);
    for (std::uint32_t shard = 0; usable && shard < shards; ++shard) {
      for (const HeldCopy& held : replica.shards[shard].resume->offloads) {
        if (held.version != offload_version) continue;
        usable = usable && check_shard(model, record, shard, held.layout, held.checksums).ok();
      }
    }
    if (!usable || replica.offloads.size() >= limits::kOffloadsPerReplicaMax) {
      for_each_shard(offload_holders, shards, [&](std::uint32_t shard) {
        emit_to(replica.shards[shard], ReleaseOffload{offload_version});
      });
      continue;
    }
    for (std::uint32_t shard = 0; shard < shards; ++shard) {
      for (const HeldCopy& held : replica.shards[shard].resume->offloads) {
        if (held.version != offload_version) continue;
        const Status committed = commit_shard(model, record, shard, held.layout, held.checksums);
        TH_ASSERT(committed.ok());
      }
    }
    Copy& offload = create_copy(replica, record, CopyKind::kOffload, CopyState::kComplete);
    offload.ready = offload_holders;
    replica.offloads.push_back(&offload);
    model.offload_copies.insert(offload.id);
    on_copy_complete(offload);
  }
  for (ShardSlot& slot : replica.shards) slot.resume.reset();
  return true;
}

// ==== Clock ========================================================================================

void Hub::on_tick() {
  struct Expired {
    Model* model;
    std::string replica;
    std::uint64_t incarnation;
    bool barrier;
    std::string detail;
  };
  std::vector<Expired> expired;
  const bool scan = now_ms_ >= expiry_scan_due_ms_;
  TimeMs next_due_ms = std::numeric_limits<TimeMs>::max();
  for (auto& [model_name, model] : models_) {
    if (!scan) break;
    for (auto& [name, replica] : model->replicas) {
      // Deadlines count for the next scan even once passed: an evicted replica may linger (closing,
      // draining) with its shards bound, and must be looked at again on the next tick as before.
      if (replica->phase == ReplicaPhase::kResuming) {
        next_due_ms = std::min(next_due_ms, replica->barrier_deadline_ms);
        if (now_ms_ >= replica->barrier_deadline_ms) {
          expired.push_back({model.get(), name, replica->incarnation, true,
                             "not every shard of " + describe(*replica) + " re-opened within " +
                                 std::to_string(settings_.barrier_timeout_ms) + " ms"});
          continue;
        }
      }
      for (std::uint32_t shard = 0; shard < replica->num_shards && !bugs().no_heartbeat_expiry;
           ++shard) {
        const ShardSlot& slot = replica->shards[shard];
        if (!slot.client) continue;
        const TimeMs deadline_ms = slot.last_seen_ms + settings_.heartbeat_timeout_ms + 1;
        next_due_ms = std::min(next_due_ms, deadline_ms);
        if (now_ms_ < deadline_ms) continue;
        expired.push_back({model.get(), name, replica->incarnation, false,
                           "shard " + std::to_string(shard) + " of " + describe(*replica) +
                               " sent no heartbeat for " +
                               std::to_string(now_ms_ - slot.last_seen_ms) + " ms"});
        break;
      }
    }
  }
  if (scan) expiry_scan_due_ms_ = next_due_ms;
  for (const Expired& entry : expired) {
    auto found = entry.model->replicas.find(entry.replica);
    if (found == entry.model->replicas.end() || found->second->incarnation != entry.incarnation) {
      continue;
    }
    if (entry.barrier) {
      fail_barrier(*found->second, make_error(Errc::kBarrierTimeout, entry.detail));
    } else {
      evict(*found->second, Errc::kReplicaEvicted, entry.detail);
    }
  }
  // Call deadlines.
  for (auto& [model_name, model] : models_) {
    while (!model->deadlines.empty() && model->deadlines.begin()->first <= now_ms_) {
      const TxnRef ref = model->deadlines.begin()->second;
      model->deadlines.erase(model->deadlines.begin());
      auto found = ref.replica->txns.find(ref.seq);
      if (found == ref.replica->txns.end() || found->second.result) continue;
      abort_txn(*ref.replica, found->second,
                make_error(Errc::kTimeout, std::string(op_name(found->second.op.kind)) +
                                               " did not complete before its timeout"));
    }
  }
}

// ==== Deferred work ================================================================================

void Hub::settle() {
  for (std::size_t round = 0;; ++round) {
    TH_ASSERT(round < kSettleRoundsMax, "settle() does not converge");
    if (!orphans_.empty()) {
      const auto [model, id] = orphans_.front();
      orphans_.pop_front();
      auto found = model->transfers.find(id);
      if (found == model->transfers.end() || found->second->source != nullptr ||
          found->second->reader->state != CopyState::kWaiting) {
        continue;
      }
      Transfer& transfer = *found->second;
      if (transfer.failures > limits::kSourceFailuresPerTransferMax) {
        fail_transfer(transfer, make_error(Errc::kVersionUnavailable,
                                           "gave up after " + std::to_string(transfer.failures) +
                                               " failed sources"));
      } else {
        try_assign(transfer);
      }
      continue;
    }
    if (!diverged_.empty()) {
      const auto [model, name, incarnation, seq] = diverged_.front();
      diverged_.pop_front();
      auto found = model->replicas.find(name);
      if (found != model->replicas.end() && found->second->incarnation == incarnation) {
        Replica& replica = *found->second;
        // The shards waiting to be let in get the error as the answer to their open.
        const Error error = make_error(Errc::kDivergentCall,
                                       "after the failover, call " + std::to_string(seq) +
                                           " could not give the shards behind the answer the others "
                                           "got; re-open the replica");
        for_each_shard(replica.deferred_opens, replica.num_shards, [&](std::uint32_t shard) {
          send_reply(replica, shard, replica.shards[shard].open_seq, error);
        });
        evict(replica, Errc::kDivergentCall, error.detail);
      }
      continue;
    }
    if (!drained_.empty()) {
      const auto [model, id] = drained_.front();
      drained_.pop_front();
      auto found = model->copies.find(id);
      if (found != model->copies.end() && found->second->state == CopyState::kDraining &&
          found->second->readers == 0 && found->second->awaiting_offload == 0) {
        on_drained(*found->second);
      }
      continue;
    }
    Model* dirty = nullptr;
    for (auto& [name, model] : models_) {
      if (model->dirty) {
        dirty = model.get();
        break;
      }
    }
    if (dirty == nullptr) return;
    dirty->dirty = false;
    settle_model(*dirty);
  }
}

void Hub::settle_model(Model& model) {
  // Transfers waiting for a source, for versions whose sources changed.
  const std::vector<Version> versions(model.versions_with_waiters.begin(),
                                      model.versions_with_waiters.end());
  for (Version version : versions) {
    auto record = model.versions.find(version);
    if (record == model.versions.end() || !record->second.dirty) continue;
    record->second.dirty = false;
    std::vector<TransferId> ids;
    for (const Transfer* transfer : record->second.waiting) ids.push_back(transfer->id);
    for (TransferId id : ids) {
      auto found = model.transfers.find(id);
      if (found != model.transfers.end() && found->second->queued) try_assign(*found->second);
    }
  }
  // Calls waiting for a version to exist.
  const std::vector<std::pair<std::uint64_t, TxnRef>> unresolved(model.unresolved.begin(),
                                                                  model.unresolved.end());
  for (const auto& [ticket, ref] : unresolved) {
    if (!model.unresolved.contains(ticket)) continue;
    Txn& txn = ref.replica->txns.at(ref.seq);
    try_resolve(*ref.replica, txn);
  }
  // Calls waiting for a predicate.
  const std::vector<std::pair<std::uint64_t, TxnRef>> waits(model.waits.begin(), model.waits.end());
  for (const auto& [ticket, ref] : waits) {
    if (!model.waits.contains(ticket)) continue;
    Txn& txn = ref.replica->txns.at(ref.seq);
    Error error{Errc::kInvalidArgument, {}};
    if (evaluate_wait(model, txn.op.predicate, &error)) {
      finish(*ref.replica, txn, WaitOk{});
    } else if (!error.detail.empty()) {
      finish(*ref.replica, txn, error);
    }
  }
  reconcile_offloads(model);
  forget_versions(model);
}

// ==== Small helpers ================================================================================

Hub::VersionRecord& Hub::record_for(Model& model, Version version) {
  auto [found, inserted] = model.versions.try_emplace(version);
  if (inserted) {
    found->second.version = version;
    found->second.checksums.resize(model.num_shards);
  }
  TH_ASSERT(found->second.version == version && found->second.checksums.size() == model.num_shards);
  return found->second;
}

void Hub::forget_versions(Model& model) {
  // A version nobody holds is remembered while it is near `latest` (so readers learn that it is
  // unavailable rather than unknown); one that never completed is forgotten at once.
  auto idle = [](const VersionRecord& record) {
    return record.copies.empty() && record.waiting.empty();
  };
  for (Version version : model.forgettable) {
    auto found = model.versions.find(version);
    if (found != model.versions.end() && idle(found->second) && !found->second.ever_complete) {
      model.versions.erase(found);
    }
  }
  model.forgettable.clear();
  for (auto it = model.versions.begin(); it != model.versions.end();) {
    const bool old = model.latest && it->first + limits::kForgottenVersionsWindow < *model.latest;
    if (!old) break;  // versions are ordered: nothing further is old
    it = idle(it->second) ? model.versions.erase(it) : std::next(it);
  }
}

DcId Hub::intern_dc(const std::string& datacenter) {
  auto [found, inserted] = datacenters_.try_emplace(datacenter, static_cast<DcId>(datacenter_names_.size()));
  if (inserted) datacenter_names_.push_back(datacenter);
  return found->second;
}

void Hub::emit_to_replica(const Replica& replica, const Message& message) {
  for (const ShardSlot& slot : replica.shards) {
    emit_to(slot, message);
  }
}

std::optional<Version> Hub::latest(std::string_view model) const {
  auto found = models_.find(model);
  if (found == models_.end()) return std::nullopt;
  return found->second->latest;
}

std::vector<std::string> Hub::model_names() const {
  std::vector<std::string> names;
  names.reserve(models_.size());
  for (const auto& [name, model] : models_) names.push_back(name);
  return names;
}

std::optional<ListSnapshot> Hub::snapshot(std::string_view model) const {
  auto found = models_.find(model);
  if (found == models_.end()) return std::nullopt;
  return *make_snapshot(*found->second);
}

HubActivity Hub::activity() const {
  HubActivity activity;
  for (const auto& [name, model] : models_) {
    for (const auto& [id, transfer] : model->transfers) {
      switch (transfer->reader->state) {
        case CopyState::kGathering: ++activity.transfers_gathering; break;
        case CopyState::kWaiting: ++activity.transfers_waiting; break;
        default: ++activity.transfers_active; break;
      }
    }
    for (const auto& [id, copy] : model->copies) {
      activity.copies_draining += copy->state == CopyState::kDraining;
      activity.copies_offloading += copy->state == CopyState::kOffloading;
    }
    activity.calls_unresolved += model->unresolved.size();
    activity.calls_waiting += model->waits.size();
  }
  return activity;
}

bool Hub::retained(std::string_view model, Version version) const {
  auto found = models_.find(model);
  return found != models_.end() && is_retained(*found->second, version);
}

}  // namespace th
