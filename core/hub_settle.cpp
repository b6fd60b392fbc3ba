// Time and deferred work: clock ticks (heartbeat, barrier and call deadlines), and settle(), which
// runs what handlers queued at the end of every step, so that no handler re-enters another. Apart
// because neither reacts to one message: they decide when, and in which order, work happens.
#include "core/hub.h"

#include <algorithm>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "core/hub_internal.h"

namespace th {

using detail::CopyState;
using detail::describe;
using detail::for_each_shard;
using detail::ReplicaPhase;
using detail::ShardSlot;
using detail::TxnRef;

namespace {

// settle() runs deferred work until none is left; each round retires at least one item, so this
// bound is only reached by a bug that keeps producing work.
constexpr std::size_t kSettleRoundsMax = 10'000'000;

}  // namespace

// ==== Clock ========================================================================================

void Hub::forget_idle_models() {
  std::vector<std::string> ended;  // (in name order: deterministic)
  for (const auto& [name, model] : models_) {
    if (model->idle_since_ms && now_ms_ - *model->idle_since_ms >= settings_.model_grace_ms) ended.push_back(name);
  }
  for (const std::string& name : ended) {
    auto found = models_.find(name);
    const Model& model = *found->second;
    // With no replica there is no copy, no transfer, no retention rule and no call: each call was
    // answered as its replica went (evicted, closed, its barrier failed).
    TH_ASSERT(model.replicas.empty() && model.copies.empty() && model.transfers.empty() &&
                  model.offload_copies.empty(),
              "a model with no replica holds nothing");
    TH_ASSERT(model.unresolved.empty() && model.waits.empty() && model.deadlines.empty() &&
                  model.keep_latest.empty() && model.pinned.empty(),
              "a model with no replica has no call and no retention rule");
    ++stats_.models_forgotten;
    TH_ASSERT(description_bytes_ >= model.description_bytes);
    description_bytes_ -= model.description_bytes;  // (its layouts go with it)
    models_.erase(found);
  }
}

void Hub::on_tick() {
  forget_idle_models();
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
      } else if (!replica->whole && replica->barrier_deadline_ms != 0) {
        next_due_ms = std::min(next_due_ms, replica->barrier_deadline_ms);
        if (now_ms_ >= replica->barrier_deadline_ms) {
          expired.push_back({model.get(), name, replica->incarnation, true,
                             "not every shard of " + describe(*replica) + " opened within " +
                                 std::to_string(settings_.barrier_timeout_ms) +
                                 " ms of a call that waits for them"});
          continue;
        }
      }
      for (std::uint32_t shard = 0; shard < replica->num_shards; ++shard) {
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
    if (entry.barrier && found->second->phase == ReplicaPhase::kResuming) {
      fail_barrier(*found->second, make_error(Errc::kBarrierTimeout, entry.detail));
    } else if (entry.barrier) {
      evict(*found->second, Errc::kBarrierTimeout, entry.detail);  // their opens were answered
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
  // Drain deadlines: the readers still reading a draining copy one drain grace after it began are
  // sent elsewhere, so that a slow reader cannot hold its source's unpublish, update or close.
  for (auto& [model_name, model] : models_) {
    while (!model->drain_deadlines.empty() && model->drain_deadlines.begin()->first <= now_ms_) {
      Copy& copy = *model->copies.at(model->drain_deadlines.begin()->second);
      disarm_drain_deadline(copy);
      revoke_readers(copy);
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
          answer_open(replica, shard, error);
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

}  // namespace th
