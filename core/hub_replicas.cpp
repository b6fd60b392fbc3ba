// Replicas: open, eviction and removal, and the barrier that re-forms a replica after a failover.
// Apart because it is the replica's own lifecycle; the calls made while it lives are in
// hub_calls.cpp.
#include "core/hub.h"

#include <algorithm>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "core/hub_internal.h"

namespace th {

using detail::Binding;
using detail::CopyState;
using detail::describe;
using detail::for_each_shard;
using detail::ReplicaPhase;
using detail::ShardSlot;

void Hub::on_open(ClientId client, std::uint64_t seq, std::uint64_t open_session,
                  const OpenRequest& asked) {
  // `asked`, with the incarnation the hub chooses below if it is to choose (1 until then).
  OpenRequest chosen;
  if (asked.incarnation_auto) {
    chosen = asked;
    chosen.incarnation_auto = false;
    chosen.incarnation = 1;
  }
  const OpenRequest& open = asked.incarnation_auto ? chosen : asked;
  auto reject = [&](Errc code, std::string detail, std::uint64_t replica_incarnation = 0) {
    emit(client, open_session,
         Reply{seq, make_error(code, std::move(detail)), /*to_open=*/true, replica_incarnation});
  };
  if (const Binding* bound = clients_.find(client)) {
    const ShardSlot& slot = bound->replica->shards[bound->shard];
    const bool retransmitted = open_session == slot.session && seq == slot.open_seq;
    if (retransmitted) {
      // Answer it again if the answer exists; a resuming open may still wait in its barrier, and
      // its retransmissions are its heartbeats meanwhile.
      bound->replica->shards[bound->shard].last_seen_ms = now_ms_;
      if (slot.last_reply && slot.last_reply->to_open && slot.last_reply->seq == seq) {
        emit_to(slot, *slot.last_reply);
      }
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

  // (Checked before a model is made: a refused open leaves nothing behind.)
  if (!datacenters_.contains(open.datacenter) && datacenters_.size() >= limits::kDatacentersMax) {
    reject(Errc::kLimitExceeded, "more than 256 datacenters");
    return;
  }
  auto model_found = models_.find(open.model);
  if (model_found == models_.end()) {
    if (models_.size() >= limits::kModelsMax) {
      reject(Errc::kLimitExceeded, models_limit_detail());
      return;
    }
    auto model = std::make_unique<Model>();
    model->name = open.model;
    model->idle_since_ms = now_ms_;  // until its first replica is in
    model_found = models_.emplace(open.model, std::move(model)).first;
  }
  // Replicas of one model may have any number of shards: their layouts say whether they read one
  // another (hub_layouts.cpp), once their shards have described their tensors.
  Model& model = *model_found->second;

  if (asked.incarnation_auto) {
    // Join the replica where this shard's slot is free (the shard's peers of a restart opened
    // first); replace it where the slot is taken (this process restarted before its old one was
    // noticed gone) or it closes; 1 if there is none.
    if (auto found = model.replicas.find(asked.replica); found != model.replicas.end()) {
      const Replica& current = *found->second;
      const bool joins = current.phase != ReplicaPhase::kClosing && !current.shards[asked.shard].client;
      chosen.incarnation = joins ? current.incarnation : current.incarnation + 1;
    }
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
      if (replica->num_shards != open.num_shards) {
        reject(Errc::kOpenMismatch, describe(*replica) + " has " + std::to_string(replica->num_shards) +
                                        " shards, not " + std::to_string(open.num_shards));
        return;
      }
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
      if (replica->phase == ReplicaPhase::kLive && open.resume != nullptr &&
          !(open.resume->nothing() && seq == 0 && !replica->whole)) {
        // The replica's other shards started afresh: this shard's history no longer applies.
        // (A shard that had made no call and holds nothing joins them: its open may have reached
        // the previous server, or not, and either way there is nothing to resume.)
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
    model.idle_since_ms.reset();
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
  slot.resume = replica->phase == ReplicaPhase::kResuming ? open.resume : nullptr;
  slot.waiting_call.reset();
  ++replica->bound_shards;
  TH_ASSERT(replica->bound_shards <= replica->num_shards);
  clients_.insert(client, Binding{replica, open.shard});
  add_retention(model, slot.retention, +1);

  if (replica->phase == ReplicaPhase::kResuming) {
    if (!slot.resume) slot.resume = std::make_shared<const Resume>();
    if (replica->bound_shards == replica->num_shards) complete_barrier(*replica);
    return;
  }
  answer_open(*replica, open.shard, OpenOk{replica->num_shards, model.latest, replica->incarnation});
  if (replica->bound_shards == replica->num_shards && !replica->whole) become_whole(*replica);
}

// Every shard has opened: the calls that waited for that are taken, in shard order (replica
// consistency does not depend on it: the first to arrive decides for all).
void Hub::become_whole(Replica& replica) {
  TH_ASSERT(replica.phase == ReplicaPhase::kLive && replica.bound_shards == replica.num_shards);
  replica.whole = true;
  replica.barrier_deadline_ms = 0;
  std::vector<Request> waiting;
  for (ShardSlot& slot : replica.shards) {
    if (slot.waiting_call) waiting.push_back(*std::exchange(slot.waiting_call, std::nullopt));
  }
  for (const Request& request : waiting) {
    // An earlier one may have ended the replica (a divergent call): the rest are moot.
    if (clients_.find(request.client) == nullptr) continue;
    take_request(request);
  }
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

void Hub::evict(Replica& replica, Errc reason, const std::string& detail) {
  ++stats_.evictions;
  const Error error = make_error(reason, detail);
  for (auto& [txn_seq, txn] : replica.txns) {
    if (txn.result) continue;
    const std::uint64_t seq = txn_seq;  // (a lambda may not capture a structured binding before C++20 in clang 14)
    for_each_shard(txn.arrived & ~txn.replied, replica.num_shards,
                   [&](std::uint32_t shard) { send_reply(replica, shard, seq, error); });
  }
  if (replica.phase == ReplicaPhase::kResuming) {
    // Shards waiting in the barrier have an open call outstanding: answer it.
    for (std::uint32_t shard = 0; shard < replica.num_shards; ++shard) {
      if (replica.shards[shard].client) answer_open(replica, shard, error);
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
  if (replica.receive_rate.exact) {
    const auto found = model.exact_rates_bytes_per_ms.find(replica.receive_rate.bytes_per_ms);
    TH_ASSERT(found != model.exact_rates_bytes_per_ms.end(), "the model holds each exact rate of its replicas");
    model.exact_rates_bytes_per_ms.erase(found);
  }
  model.replicas.erase(replica.name);  // destroys `replica`
  if (model.replicas.empty()) model.idle_since_ms = now_ms_;
}

std::string Hub::models_limit_detail() const {
  std::size_t idle = 0;
  TimeMs first_end_ms = std::numeric_limits<TimeMs>::max();
  for (const auto& [name, model] : models_) {
    if (!model->idle_since_ms) continue;
    ++idle;
    first_end_ms = std::min(first_end_ms, *model->idle_since_ms + settings_.model_grace_ms);
  }
  std::string detail = "this server already hosts " + std::to_string(limits::kModelsMax) + " models";
  if (idle == 0) return detail + ", each with replicas";
  return detail + ", " + std::to_string(idle) + " of them with no replica; the first ends in " +
         std::to_string(std::max<TimeMs>(first_end_ms - now_ms_, 0)) + " ms (model grace " +
         std::to_string(settings_.model_grace_ms) + " ms)";
}

void Hub::fail_barrier(Replica& replica, const Error& error) {
  for (std::uint32_t shard = 0; shard < replica.num_shards; ++shard) {
    if (replica.shards[shard].client) answer_open(replica, shard, error);
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
  // Closing is the end of an incarnation: a shard told so by the previous server (its last call was
  // answered "replica closed") says this one ended there, though no shard saw the close finish.
  // Resumed here it would answer a close its peers were told had ended the replica (§5.3).
  for (std::uint32_t shard = 0; shard < replica.num_shards; ++shard) {
    const std::shared_ptr<const Resume>& resume = replica.shards[shard].resume;
    const auto* error = resume && resume->last_txn ? std::get_if<Error>(&resume->last_txn->outcome) : nullptr;
    if (error != nullptr && error->code == Errc::kReplicaClosed) {
      fail_barrier(replica, make_error(Errc::kReplicaClosed,
                                       describe(replica) + " was closing on the previous server (shard " +
                                           std::to_string(shard) + " was told so at call " +
                                           std::to_string(resume->last_txn->seq) +
                                           "); open it afresh"));
      return;
    }
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
  replica.whole = true;
  replica.barrier_deadline_ms = 0;
  // Shards that are ahead wait for the others to redo the call they missed, if it has work left to
  // do here (a receive or a publish): until then the replica is not whole, and a new call of theirs
  // would be answered about a replica that is not what the others will see.
  const bool catching_up = seeded != nullptr && seeded->seeded_outcome.has_value();
  for (std::uint32_t shard = 0; shard < replica.num_shards; ++shard) {
    if (catching_up && replica.shards[shard].open_seq == high) {
      replica.deferred_opens.set(shard);
      continue;
    }
    answer_open(replica, shard, OpenOk{replica.num_shards, replica.model->latest, replica.incarnation});
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
      answer_open(replica, shard, OpenOk{replica.num_shards, replica.model->latest, replica.incarnation});
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
    std::vector<LayoutRef> held_layouts(shards);
    for (std::uint32_t shard = 0; shard < shards; ++shard) {
      if (!holders.test(shard)) continue;
      const HeldCopy& held = *replica.shards[shard].resume->primary;
      if (Status checked = check_shard(replica, record, shard, held.layout, held.checksums); !checked) {
        fail_barrier(replica, checked.error());
        return false;
      }
      held_layouts[shard] = held.layout;
    }
    // Which of the model's layouts the replica has. A copy only some shards hold may be of a
    // layout the model does not know yet (a first publish, or a first read from another layout,
    // when the server failed over): its shards' descriptions wait for the others'.
    Result<detail::ModelLayout*> layout = replica.layout ? replica.layout : layout_for(model, held_layouts);
    if (!layout && full) {
      fail_barrier(replica, layout.error());
      return false;
    }
    if (layout) {
      for (std::uint32_t shard = 0; shard < shards; ++shard) {
        if (!holders.test(shard)) continue;
        const HeldCopy& held = *replica.shards[shard].resume->primary;
        if (Status checked = check_checksums(record, *layout.value(), shard, held.layout, held.checksums); !checked) {
          fail_barrier(replica, checked.error());
          return false;
        }
      }
      set_layout(replica, layout.value());
    }
    Copy& copy = create_copy(replica, record, CopyKind::kPrimary, state);
    copy.ready = holders;
    if (state == CopyState::kPublishing) copy.pending_layouts.resize(shards);
    // (A copy receiving keeps what shards that read another layout assembled: complete_transfer.)
    if (state != CopyState::kComplete) copy.pending_checksums.resize(shards);
    for (std::uint32_t shard = 0; shard < shards; ++shard) {
      if (!holders.test(shard)) continue;
      const HeldCopy& held = *replica.shards[shard].resume->primary;
      if (replica.layout != nullptr) {
        commit_checksums(record, *replica.layout, shard, held.checksums);
      } else if (state == CopyState::kPublishing) {
        copy.pending_layouts[shard] = held.layout;
        copy.pending_checksums[shard] = held.checksums;
      } else {
        TH_ASSERT(state == CopyState::kGathering && seeded != nullptr);
        if (seeded->layouts.empty()) seeded->layouts.resize(shards);
        seeded->layouts[shard] = held.layout;
        copy.pending_checksums[shard] = held.checksums;
      }
    }
    replica.primary = &copy;
    if (full) {
      resume_patches(replica, copy);
      on_copy_complete(copy);
    }
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
    std::vector<LayoutRef> held_layouts(shards);
    for (std::uint32_t shard = 0; usable && shard < shards; ++shard) {
      for (const HeldCopy& held : replica.shards[shard].resume->offloads) {
        if (held.version != offload_version) continue;
        usable = usable && check_shard(replica, record, shard, held.layout, held.checksums).ok();
        held_layouts[shard] = held.layout;
      }
    }
    detail::ModelLayout* layout = replica.layout;
    if (usable && layout == nullptr) {
      Result<detail::ModelLayout*> found = layout_for(model, held_layouts);
      usable = found.ok();
      if (usable) layout = found.value();
    }
    for (std::uint32_t shard = 0; usable && shard < shards; ++shard) {
      for (const HeldCopy& held : replica.shards[shard].resume->offloads) {
        if (held.version != offload_version) continue;
        usable = check_checksums(record, *layout, shard, held.layout, held.checksums).ok();
      }
    }
    if (!usable || replica.offloads.size() >= limits::kOffloadsPerReplicaMax) {
      for (std::uint32_t shard = 0; shard < shards; ++shard) {
        for (const HeldCopy& held : replica.shards[shard].resume->offloads) {
          if (held.version == offload_version) {
            emit_to(replica.shards[shard], ReleaseOffload{offload_version, held.copy});
          }
        }
      }
      continue;
    }
    set_layout(replica, layout);
    for (std::uint32_t shard = 0; shard < shards; ++shard) {
      for (const HeldCopy& held : replica.shards[shard].resume->offloads) {
        if (held.version == offload_version) commit_checksums(record, *layout, shard, held.checksums);
      }
    }
    Copy& offload = create_copy(replica, record, CopyKind::kOffload, CopyState::kComplete);
    offload.ready = offload_holders;
    replica.offloads.push_back(&offload);
    model.offload_copies.insert(offload.id);
    on_copy_complete(offload);
    // Each shard now knows its copy by this server's id (it answers at once: it holds it).
    emit_to_replica(replica, Offload{offload_version, offload.id});
  }
  for (ShardSlot& slot : replica.shards) slot.resume.reset();
  return true;
}

}  // namespace th
