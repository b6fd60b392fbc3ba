// Replica transactions and the calls they carry (publish, unpublish, replicate, update, list, wait,
// close): how the calls of a replica's shards become one answer. Apart because this is the protocol
// clients see; the transfers, copies and failover it drives live in files of their own.
#include "core/hub.h"

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "core/hub_internal.h"
#include "core/replica_layout.h"

namespace th {

using detail::CopyState;
using detail::describe;
using detail::DrainPurpose;
using detail::for_each_shard;
using detail::ReplicaPhase;
using detail::ShardSlot;
using detail::TxnRef;
using detail::TxnStage;

namespace {

ShardSet first_shards(std::uint32_t count) {
  TH_ASSERT(count <= limits::kShardsMax, count);
  ShardSet set;
  for (std::uint32_t i = 0; i < count; ++i) set.set(i);
  return set;
}

std::string describe_outcome(const Outcome& outcome) {
  if (const auto* error = std::get_if<Error>(&outcome)) return std::string(errc_name(error->code));
  return "another answer";
}

}  // namespace

struct Hub::Resolution {
  enum class Kind : std::uint8_t { kWait, kGo, kError };
  Kind kind = Kind::kWait;
  Version version = 0;
  Error error;
};

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
    const Outcome& outcome = *txn.result;
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

void Hub::send_reply(Replica& replica, std::uint32_t shard, std::uint64_t seq, const Outcome& outcome,
                     bool to_open, bool released) {
  TH_ASSERT(shard < replica.num_shards);
  ShardSlot& slot = replica.shards[shard];
  TH_ASSERT(!slot.last_reply || slot.last_reply->seq <= seq, "replies go forward in sequence");
  TH_ASSERT(!to_open || seq == slot.open_seq, "an open is answered with its own number");
  TH_ASSERT(!released || std::holds_alternative<Error>(outcome), "only a failed call releases");
  Reply reply{seq, outcome, to_open};
  reply.released = released;
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
    send_reply(replica, shard, txn.seq, *txn.result, /*to_open=*/false,
               txn.released && std::holds_alternative<Error>(*txn.result));
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

// A shard gave up on its call: the call ends for the whole replica, as at a deadline. Only calls
// that wait (for a version, its bytes, or a predicate); a publish, unpublish or close is short or
// must run to its end (an unpublish's drain is what makes the buffers the application's again).
void Hub::on_cancel_call(Replica& replica, std::uint32_t shard, const CancelCall& cancel) {
  auto found = replica.txns.find(cancel.seq);
  // Answered and collected, or not taken yet (the replica waits for a shard to re-open): the
  // client repeats the cancel until its call is answered.
  if (found == replica.txns.end()) return;
  Txn& txn = found->second;
  if (txn.result || !txn.arrived.test(shard)) return;
  if (txn.op.kind != OpKind::kReplicate && txn.op.kind != OpKind::kUpdate && txn.op.kind != OpKind::kWait) {
    return;
  }
  // Some shards completed it before a failover: their answer is the replica's answer.
  if (txn.seeded_outcome) return;
  ++stats_.calls_cancelled;
  abort_txn(replica, txn, make_error(Errc::kCancelled, std::string(op_name(txn.op.kind)) + " cancelled by shard " +
                                                           std::to_string(shard) + " of " + describe(replica)));
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
    // The copy in progress is moot.
    emit_to_replica(replica, ReleaseOffload{copy->record->version, offload->second->id});
    remove_copy(*offload->second);
    copy->awaiting_offload = 0;
  }
  set_state(*copy, CopyState::kComplete);
}

// An update that fails after its held copy drained but before any shard was told to read: the
// buffers still hold the previous version, so the replica holds it again (as readers found it).
void Hub::restore_previous(Replica& replica, Version version, const detail::CopyHealth& health) {
  Model& model = *replica.model;
  TH_ASSERT(replica.primary == nullptr);
  VersionRecord& record = record_for(model, version);
  if (replica.layout == nullptr || !vouched(record, *replica.layout)) return;  // cannot vouch for the bytes
  Copy& copy = create_copy(replica, record, CopyKind::kPrimary, CopyState::kComplete);
  copy.ready = first_shards(replica.num_shards);
  replica.primary = &copy;
  copy.mismatched = health.mismatched;
  copy.corrupt = health.corrupt;
  if (health.failed) {
    set_failed(copy);
  } else {
    reindex(copy);  // a corrupt copy is no root
  }
  on_copy_complete(copy);
}

bool Hub::record_layout(Replica& replica, Txn& txn, std::uint32_t shard, const LayoutRef& layout) {
  TH_ASSERT(shard < replica.num_shards);
  TH_ASSERT(txn.op.kind == OpKind::kReplicate || txn.op.kind == OpKind::kUpdate);
  if (!layout) {
    abort_txn(replica, txn, make_error(Errc::kInvalidArgument, "register tensors first"));
    return false;
  }
  if (txn.layouts.empty()) txn.layouts.resize(replica.num_shards);
  txn.layouts[shard] = layout;
  if (auto error = early_layout_mismatch(replica, shard, layout)) {
    abort_txn(replica, txn, *error);
    return false;
  }
  return true;
}

// ---- publish ---------------------------------------------------------------------------------------

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
    if (version > limits::kVersionMax) {
      finish(replica, txn, make_error(Errc::kInvalidArgument,
                                      "version " + std::to_string(version) +
                                          " is above the largest a model takes (2^63-1)"));
      return;
    }
    // Versions increase within a model's life (DESIGN.md §5.7): below latest, only a version the
    // model knows (a data-parallel peer's, published or being published, within
    // kForgottenVersionsWindow). A publish the previous server took before a failover is not
    // judged again: a backup learns versions in any order.
    if (!txn.seeded && !in_order(model, version)) {
      finish(replica, txn, make_error(Errc::kStaleVersion,
                                      "version " + std::to_string(version) + " is below latest " +
                                          std::to_string(*model.latest) + " of model '" + model.name +
                                          "' and not one it knows: versions increase within a model's "
                                          "life (a run restarting from an earlier step publishes above " +
                                          std::to_string(*model.latest) + ", or under a new model name)"));
      return;
    }
    if (replica.primary == nullptr) {
      Copy& copy = create_copy(replica, record_for(model, version), CopyKind::kPrimary,
                               CopyState::kPublishing);
      replica.primary = &copy;
    }
    replica.primary->pending_layouts.resize(replica.num_shards);
    replica.primary->pending_checksums.resize(replica.num_shards);
    replica.primary->pending_patches.resize(replica.num_shards);
    txn.stage = TxnStage::kPublishing;
  }
  TH_ASSERT(txn.stage == TxnStage::kPublishing, "publish in stage", static_cast<int>(txn.stage));
  Copy& copy = *replica.primary;
  TH_ASSERT(copy.state == CopyState::kPublishing);
  TH_ASSERT(copy.record->version == version, "divergent versions pass the op check");
  VersionRecord& record = *copy.record;

  if (Status checked = check_shard(replica, record, shard, request.layout, request.checksums); !checked) {
    abort_txn(replica, txn, checked.error());
    return;
  }
  if (Status checked = check_patch(replica, version, shard, request.layout, request.patch); !checked) {
    abort_txn(replica, txn, checked.error());
    return;
  }
  copy.pending_layouts[shard] = request.layout;
  copy.pending_checksums[shard] = request.checksums;
  if (copy.pending_patches.size() == replica.num_shards) copy.pending_patches[shard] = request.patch;
  copy.ready.set(shard);
  if (copy.ready.count() < replica.num_shards) return;

  // Every shard published. The shards' pieces of each logical tensor must tile it: readers of
  // other layouts rely on it.
  std::vector<LayoutRef> layouts(replica.num_shards);
  for (std::uint32_t s = 0; s < replica.num_shards; ++s) {
    // (A shard that announced its bytes before a failover did so in the replica's layout.)
    TH_ASSERT(copy.pending_layouts[s] || replica.layout, "a shard announced before a failover fixed its layout");
    layouts[s] = copy.pending_layouts[s] ? copy.pending_layouts[s] : replica.layout->shards[s];
  }
  if (Status tiled = check_replica_pieces(layouts); !tiled) {
    abort_txn(replica, txn, tiled.error());
    return;
  }
  Result<detail::ModelLayout*> layout = replica.layout ? replica.layout : layout_for(model, layouts);
  if (!layout) {
    abort_txn(replica, txn, layout.error());
    return;
  }
  // Another copy of this version may have completed meanwhile: check every shard's checksums
  // before committing any.
  for (std::uint32_t s = 0; s < replica.num_shards; ++s) {
    if (!copy.pending_layouts[s]) continue;  // announced before a failover, already committed
    Status checked = check_checksums(record, *layout.value(), s, copy.pending_layouts[s], copy.pending_checksums[s]);
    if (!checked) {
      abort_txn(replica, txn, checked.error());
      return;
    }
  }
  set_layout(replica, layout.value());
  for (std::uint32_t s = 0; s < replica.num_shards; ++s) {
    if (copy.pending_layouts[s]) commit_checksums(record, *layout.value(), s, copy.pending_checksums[s]);
  }
  commit_patches(copy);  // (reads pending_layouts)
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
}

// ---- replicate and update --------------------------------------------------------------------------

bool Hub::in_order(const Model& model, Version version) const {
  return !model.latest || version >= *model.latest || model.versions.contains(version);
}

Hub::Resolution Hub::resolve(const Model& model, const Selector& selector) const {
  Resolution resolution;
  if (!model.latest) return resolution;  // nothing published yet: wait
  const Version latest = *model.latest;
  Version target = selector.value;
  if (selector.kind == Selector::Kind::kLatest) {
    // latest-k is the k-th newest version that exists (was complete here), not latest minus k:
    // trainers skip numbers (a restart, a data-parallel group that publishes every other step).
    const std::optional<Version> existing = newest_existing(model, selector.value);
    if (!existing) {
      resolution.kind = Resolution::Kind::kError;
      resolution.error = make_error(Errc::kVersionNotFound,
                                    format_selector(selector) + ": fewer than " +
                                        std::to_string(selector.value + 1) +
                                        " versions exist here (latest is " + std::to_string(latest) + ")");
      return resolution;
    }
    // If no copy of it is left (its trainer unpublished it, its holders went), the newest older
    // version that has one: a selector never names a version nobody can read while an older one
    // can be read. The answer names the version it resolved to.
    const std::optional<Version> readable = newest_readable_from(model, *existing);
    if (!readable) {
      resolution.kind = Resolution::Kind::kError;
      resolution.error = make_error(Errc::kVersionUnavailable,
                                    "no copy of " + format_selector(selector) + " (version " +
                                        std::to_string(*existing) + ") or of any older version is left" +
                                        why_none_left(model.versions.at(*existing)));
      return resolution;
    }
    target = *readable;
  } else if (selector.value > latest) {
    return resolution;  // not published yet: wait
  }
  auto found = model.versions.find(target);
  if (found == model.versions.end() ||
      (!found->second.ever_complete && found->second.roots == 0)) {
    resolution.kind = Resolution::Kind::kError;
    resolution.error = make_error(Errc::kVersionNotFound,
                                  "version " + std::to_string(target) + " was never published here");
    return resolution;
  }
  if (found->second.roots == 0) {
    resolution.kind = Resolution::Kind::kError;
    resolution.error = make_error(Errc::kVersionUnavailable,
                                  "no copy of version " + std::to_string(target) + " is left" +
                                      why_none_left(found->second));
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
  const std::optional<Version> held_version =
      held != nullptr ? std::optional(held->record->version) : std::nullopt;
  const Resolution resolution = resolve(model, txn.op.selector);
  if (resolution.kind == Resolution::Kind::kError) {
    finish(replica, txn, resolution.error);
    return;
  }
  if (resolution.kind == Resolution::Kind::kWait ||
      (held_version && resolution.version <= *held_version)) {
    finish(replica, txn, UpdateOk{UpdateStatus::kNoNewerVersion, held_version, {}});
    return;
  }
  const VersionRecord& record = model.versions.at(resolution.version);
  if (settings_.smart_skipping && smart_skip(record, replica.dc)) {
    finish(replica, txn, UpdateOk{UpdateStatus::kNotYet, held_version, {}});
    return;
  }
  // The first shard's call decides: a replica whose layout is not settled yet seeds in the layout
  // of the model that its shards' descriptions so far match (a layout new to the model has no copy
  // to seed from).
  detail::ModelLayout* layout = replica.layout != nullptr ? replica.layout : known_layout(model, txn.layouts, replica.num_shards);
  if (settings_.offload_seeding && layout != nullptr && wants_seed(record, replica, *layout)) {
    // The replica's buffers keep what they hold; it seeds its datacenter from CPU memory and
    // consumes that copy at its next update (paper §4.3.4).
    set_layout(replica, layout);
    start_seed(replica, model.versions.at(resolution.version));
    finish(replica, txn, UpdateOk{UpdateStatus::kNotYet, held_version, {}});
    return;
  }
  txn.target = resolution.version;
  if (held != nullptr) {
    txn.previous = held_version;
    TH_ASSERT(txn.previous.has_value());
    txn.stage = TxnStage::kDrainingOld;
    start_drain(*held, DrainPurpose::kUpdate);
    return;
  }
  begin_receive(replica, txn, resolution.version);
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
        if (found->second.ever_complete && found->second.roots == 0) {
          *error = make_error(Errc::kVersionUnavailable,
                              "no copy of version " + std::to_string(predicate.version) + " is left" +
                                  why_none_left(found->second));
        }
        return false;
      }
      if (model.latest && predicate.version < *model.latest) {
        *error = make_error(Errc::kVersionNotFound,
                            "version " + std::to_string(predicate.version) + " is not known here");
      }
      return false;
    }
    case WaitPredicate::Kind::kRoleHolds: {
      // Not vacuously true: a role nobody plays (yet) holds nothing; the wait goes on until a
      // replica of the role is open and every one holds the version or a newer one.
      bool any = false;
      for (const auto& [name, replica] : model.replicas) {
        if (replica->role != predicate.role || replica->phase == ReplicaPhase::kClosing) continue;
        const Copy* copy = replica->primary;
        if (copy == nullptr || copy->state != CopyState::kComplete ||
            copy->record->version < predicate.version) {
          return false;
        }
        any = true;
      }
      return any;
    }
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
  // A departure is never refused (see close in hub.h): a clean close must not be worse than a
  // crash, which nobody can refuse. A retained version that leaves with it is counted and named.
  for (Version version : last_retained_copies(replica)) {
    replica.model->versions.at(version).left_with = describe(replica);  // see why_none_left
    ++stats_.retained_versions_left;
  }
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
        if (copy->seed) {
          // Still reading across datacenters: the shards stop and free the buffer.
          emit_to_replica(replica, ReleaseOffload{copy->record->version, copy->id});
        }
        remove_copy(*copy);  // not yet a source, or an offload that will not be needed
        break;
    }
  }
  if (replica.primary == nullptr && replica.offloads.empty()) finish(replica, txn, CloseOk{});
}

}  // namespace th
