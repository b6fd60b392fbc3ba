// th::Hub: construction, the step function, request dispatch and read-only introspection. The rest
// of the class has one file per concept: hub_calls.cpp (replica transactions and the calls),
// hub_transfers.cpp (source selection, transfers), hub_copies.cpp (copies, offloads, retention),
// hub_replicas.cpp (open, eviction, failover barrier), hub_settle.cpp (clock ticks, deferred work),
// invariants.cpp (check_invariants); hub_internal.h holds what the hub*.cpp files share.
#include "core/hub.h"

#include <string>
#include <utility>

#include "core/hub_internal.h"

namespace th {

using detail::Binding;
using detail::CopyState;
using detail::DcId;
using detail::describe;
using detail::ReplicaPhase;
using detail::ShardSlot;

// ==== Construction and the step function ==========================================================

Hub::Hub(HubSettings settings)
    : settings_(settings), next_copy_id_(settings.id_base + 1), next_transfer_id_(settings.id_base + 1) {
  const Status valid = validate(settings_);
  TH_REQUIRE(valid.ok(), valid.ok() ? "" : valid.error().detail);
}


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
  take_request(request);
}

void Hub::take_request(const Request& request) {
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
    if (slot.last_reply && !slot.last_reply->to_open && slot.last_reply->seq == request.seq) {
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
  if (replica.phase == ReplicaPhase::kResuming || replica.deferred_opens.test(shard)) {
    // The shard's open is not answered yet (it waits in the failover barrier): a call can only
    // come from a client that took a late answer of an earlier binding for this one. It is not
    // answered, nor numbered: once the open is, its retransmission is taken as the call it is.
    return;
  }
  if (!replica.whole) {
    // Not every shard has opened: the call waits for them (a retransmission replaces it), up to
    // the barrier timeout from the first call that waits.
    TH_ASSERT(replica.phase == ReplicaPhase::kLive && replica.txns.empty(),
              "a replica takes calls only once whole");
    slot.waiting_call = request;
    if (replica.barrier_deadline_ms == 0) {
      replica.barrier_deadline_ms = now_ms_ + settings_.barrier_timeout_ms;
      expiry_due_by(replica.barrier_deadline_ms);
    }
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

// ==== Small helpers ================================================================================

Hub::VersionRecord& Hub::record_for(Model& model, Version version) {
  auto [found, inserted] = model.versions.try_emplace(version);
  if (inserted) found->second.version = version;
  TH_ASSERT(found->second.version == version);
  return found->second;
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

bool Hub::has_session(ClientId client, std::uint64_t session) const {
  const Binding* found = clients_.find(client);
  return found != nullptr && found->replica->shards[found->shard].session == session;
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

std::optional<ClientIdentity> Hub::identify(ClientId client) const {
  const detail::Binding* binding = clients_.find(client);
  if (binding == nullptr) return std::nullopt;
  const Replica& replica = *binding->replica;
  const Model& model = *replica.model;
  TH_ASSERT(binding->shard < replica.num_shards, "a binding names a shard of its replica");
  ClientIdentity identity{model.name, replica.name, replica.incarnation, binding->shard, replica.datacenter,
                          replica.role, 0};
  if (replica.layout != nullptr) identity.shard_bytes = replica.layout->shards[binding->shard]->total_bytes();
  return identity;
}

bool Hub::retained(std::string_view model, Version version) const {
  auto found = models_.find(model);
  return found != models_.end() && is_retained(*found->second, version);
}

}  // namespace th
