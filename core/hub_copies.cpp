// Copies and retention: creating and removing copies, the per-version counters that source
// selection and retention read (kept in step with each copy's state), draining, offload copies, and
// which versions are retained or forgotten. Apart because it is the bookkeeping the rest relies on.
#include "core/hub.h"

#include <algorithm>
#include <iterator>
#include <map>
#include <memory>
#include <set>
#include <utility>
#include <vector>

#include "core/hub_internal.h"

namespace th {

using detail::Contribution;
using detail::CopyId;
using detail::CopyState;
using detail::DcSources;
using detail::DrainPurpose;
using detail::ShardSlot;
using detail::SourceKey;
using detail::TxnStage;

namespace {

void add_count(std::uint32_t& counter, bool present, int sign) {
  if (!present) return;
  if (sign > 0) {
    ++counter;
  } else {
    TH_ASSERT(counter > 0, "counter would go negative");
    --counter;
  }
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
  disarm_drain_deadline(copy);
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
  c.crossing = active && copy.incoming != nullptr && copy.incoming->cross_dc;
  c.seeding = usable && c.crossing;
  // The copies that hold, or will hold without reading another copy, every byte: every chain of
  // sources ends in one, or its readers are told the version is unavailable. A draining copy is
  // one (it serves its readers to the end, and they then hold the bytes; one without readers goes
  // within the step), a receiving copy is not (it holds only what its own source gave it). A copy
  // a reader reported is only suspected: it still counts until its replica is evicted.
  // A corrupt copy holds other bytes than the version's: whatever its state, it is no root.
  c.root = !copy.corrupt && (complete || copy.state == CopyState::kPublishing ||
                             copy.state == CopyState::kOffloading || copy.state == CopyState::kDraining);
  // A seed (an offload copy being read) is not a pipeline source: its buffer is the data plane's
  // until verified whole.
  // Nor is a copy reading another layout: its shards assemble their bytes out of order, and
  // vouch for them only once done (TransferDone::checksums).
  const bool pipelines = active && settings_.pipeline && copy.kind == CopyKind::kPrimary &&
                         copy.incoming != nullptr && !copy.incoming->reshard;
  const bool serves_now = usable && (complete || pipelines);
  c.eligible = serves_now && has_slot(copy, false);
  c.eligible_across = serves_now && has_slot(copy, true);
  c.layout = copy.owner->layout != nullptr ? copy.owner->layout->id : detail::kNoLayout;
  const auto partial = static_cast<std::uint8_t>(active ? 1 : 0);
  c.key = SourceKey{copy.readers - copy.readers_across, partial, copy.id};
  c.key_across = SourceKey{copy.readers, partial, copy.id};
  return c;
}

void Hub::apply(Copy& copy, const Contribution& c, int sign) {
  VersionRecord& record = *copy.record;
  DcSources& sources = record.by_dc[copy.owner->dc];
  auto index = [&](bool indexed, const detail::SourceKey& key,
                   std::set<std::pair<detail::SourceKey, Copy*>>& eligible) {
    if (!indexed) return;
    if (sign > 0) {
      const bool inserted = eligible.emplace(key, &copy).second;
      TH_ASSERT(inserted);
    } else {
      const std::size_t erased = eligible.erase({key, &copy});
      TH_ASSERT(erased == 1);
    }
  };
  index(c.eligible, c.key, sources.eligible);
  index(c.eligible_across, c.key_across, sources.eligible_across);
  add_count(sources.servable, c.servable, sign);
  add_count(sources.complete, c.complete, sign);
  add_count(sources.seeding, c.seeding, sign);
  add_count(sources.crossing, c.crossing, sign);
  add_count(record.safe_primaries, c.safe_primary, sign);
  add_count(record.safe_offloads, c.safe_offload, sign);
  add_count(record.complete_primaries, c.complete_primary, sign);
  add_count(record.roots, c.root, sign);
  if (c.root) {
    std::uint32_t& roots = record.roots_by_layout[c.layout];
    add_count(roots, true, sign);
    if (roots == 0) record.roots_by_layout.erase(c.layout);
  }
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
  if (copy.state == CopyState::kDraining && state != CopyState::kDraining) disarm_drain_deadline(copy);
  copy.state = state;
  reindex(copy);
  // Waits on what replicas hold may hold now (or fail), whichever way the copy went: a copy that
  // is complete again (an update cancelled while its old copy drained) makes no new version, so
  // nothing else would look at them.
  waits_may_change(*copy.owner->model);
}

void Hub::set_failed(Copy& copy) {
  copy.failed = true;
  reindex(copy);
  waits_may_change(*copy.owner->model);
}

bool Hub::has_slot(const Copy& copy, bool across) const {
  TH_ASSERT(copy.readers_across <= copy.readers);
  const std::uint32_t taken = across ? copy.readers_across : copy.readers - copy.readers_across;
  return taken < settings_.fanout_max;
}

void Hub::count_reader(Copy& source, const Transfer& transfer, int delta) {
  TH_ASSERT(delta == 1 || delta == -1);
  TH_ASSERT(delta > 0 || (source.readers > 0 && (!transfer.cross_dc || source.readers_across > 0)),
            "a source counts the transfer that leaves it");
  source.readers += delta;
  if (delta > 0) {
    ++source.readers_joined;
    source.reading.push_back(transfer.id);
  } else {
    const auto found = std::find(source.reading.begin(), source.reading.end(), transfer.id);
    TH_ASSERT(found != source.reading.end(), "a source lists the transfer that leaves it");
    source.reading.erase(found);
  }
  TH_ASSERT(source.reading.size() == source.readers);
  if (transfer.cross_dc) source.readers_across += delta;
  TH_ASSERT(source.readers_across <= source.readers);
  reindex(source);
}


void Hub::on_mismatch(Copy& copy, std::uint32_t shard) {
  TH_ASSERT(shard < copy.owner->num_shards);
  if (copy.mismatched.test(shard)) {
    if (!copy.corrupt) tell_corrupt(copy, shard);
    copy.corrupt = true;
  } else {
    copy.mismatched.set(shard);
  }
  set_failed(copy);
}

// The owner hears that its copy is no source any more (issue 33, friction 1: a trainer writing
// its tensors while published was never told), once, as the copy becomes corrupt. Only a copy
// with every byte: one still receiving passes on what its own source sent (that source is the one
// at fault), and its next read starts it afresh.
void Hub::tell_corrupt(const Copy& copy, std::uint32_t shard) {
  TH_ASSERT(!copy.corrupt, "told once per copy");
  if (copy.state != CopyState::kComplete && copy.state != CopyState::kDraining) return;
  const CopyCorrupt notice{copy.record->version, copy.kind == CopyKind::kOffload ? copy.id : 0};
  emit_to(copy.owner->shards.at(shard), notice);
  ++stats_.copies_found_corrupt;
}

// The copy as a whole is suspect: a second failure of any of its shards, for a reader of any
// layout, condemns it. Without this a corrupt source of another layout would be retried for ever
// as the last resort (found by th-sim --seed 50337 --workload layouts --profile harsh-net). A good
// read across layouts clears nothing: it may not have touched the shard at fault.
// (Its owner is not told: a reader across layouts also fails a source whose every piece matched
// its checksums when what it assembled disagrees with a copy of its own layout, where nobody is
// known to be at fault.)
void Hub::on_reshard_mismatch(Copy& copy) {
  if (copy.mismatched.any()) {
    copy.corrupt = true;
  } else {
    for (std::uint32_t shard = 0; shard < copy.owner->num_shards; ++shard) copy.mismatched.set(shard);
  }
  set_failed(copy);
}

void Hub::on_copy_complete(Copy& copy) {
  Model& model = *copy.owner->model;
  VersionRecord& record = *copy.record;
  TH_ASSERT(copy.state == CopyState::kComplete);
  TH_ASSERT(copy.ready.count() == copy.owner->num_shards);
  record.ever_complete = true;
  record.left_with.clear();  // a reader of the closed copy finished: the version has a holder again
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
  arm_drain_deadline(copy);
  if (copy.readers == 0) drained_.emplace_back(copy.owner->model, copy.id);
}

void Hub::arm_drain_deadline(Copy& copy) {
  TH_ASSERT(copy.state == CopyState::kDraining && copy.drain_deadline_ms == 0);
  copy.drain_deadline_ms = now_ms_ + settings_.drain_grace_ms;
  copy.owner->model->drain_deadlines.emplace(copy.drain_deadline_ms, copy.id);
}

void Hub::disarm_drain_deadline(Copy& copy) {
  if (copy.drain_deadline_ms == 0) return;
  const std::size_t erased = copy.owner->model->drain_deadlines.erase({copy.drain_deadline_ms, copy.id});
  TH_ASSERT(erased == 1, "a pending drain deadline is indexed");
  copy.drain_deadline_ms = 0;
}

void Hub::revoke_readers(Copy& copy) {
  TH_ASSERT(copy.state == CopyState::kDraining && copy.drain_deadline_ms == 0);
  if (copy.readers == 0) return;  // (waiting for its offload copy, say)
  std::vector<Transfer*> readers;  // in transfer order: deterministic
  for (const auto& [id, transfer] : copy.owner->model->transfers) {
    if (transfer->source == &copy) readers.push_back(transfer.get());
  }
  TH_ASSERT(readers.size() == copy.readers);
  for (Transfer* transfer : readers) {
    // Nobody's failure: the copy is not marked failed and the reader's give-up count stays.
    reassign(*transfer, /*failed=*/false);
    ++stats_.readers_revoked;
  }
  TH_ASSERT(copy.readers == 0, "a copy past its drain grace keeps no reader");
}

bool Hub::needs_offload(const Copy& copy) const {
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
      if (offload_needed_again(copy)) {
        set_state(copy, CopyState::kComplete);
        return;
      }
      emit_to_replica(owner, ReleaseOffload{copy.record->version, copy.id});
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
        // One that a reader reported is never read again: the new copy replaces it.
        if (Copy* releasing = releasing_offload(owner, copy.record->version)) {
          set_state(*releasing, CopyState::kComplete);
        } else {
          if (Copy* failed = failed_offload(owner, copy.record->version)) {
            // Its readers (one may read it as a last resort) are told to stop before the shards
            // free its memory.
            const ReleaseOffload release{failed->record->version, failed->id};
            remove_copy(*failed);
            emit_to_replica(owner, release);
          }
          Copy& offload = start_offload(owner, *copy.record);
          copy.awaiting_offload = offload.id;
          return;
        }
      }
      const detail::CopyHealth health = copy.health();
      remove_copy(copy);
      after_primary_drained(owner, purpose, health);
      return;
  }
}

void Hub::after_primary_drained(Replica& replica, DrainPurpose purpose,
                                const detail::CopyHealth& health) {
  const TxnStage stage = purpose == DrainPurpose::kUpdate ? TxnStage::kDrainingOld : TxnStage::kDraining;
  for (auto& [seq, txn] : replica.txns) {
    if (txn.stage != stage || txn.result) continue;
    if (purpose == DrainPurpose::kUpdate) {
      txn.previous_health = health;
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

Hub::Copy* Hub::failed_offload(const Replica& replica, Version version) const {
  for (Copy* offload : replica.offloads) {
    if (offload->record->version == version && offload->failed) return offload;
  }
  return nullptr;
}

Hub::Copy& Hub::start_offload(Replica& replica, VersionRecord& record) {
  // A seed of this version still being read is moot: the buffers hold the version already, and a
  // replica holds one offload copy per version.
  release_unfinished_seeds(replica, [&](const Copy& seed) { return seed.record == &record; });
  TH_ASSERT(replica.offloads.size() < limits::kOffloadsPerReplicaMax, "offloads per replica");
  TH_ASSERT(!replica.spot, "a spot replica's copy never counts, so it never offloads");
  Copy& offload = create_copy(replica, record, CopyKind::kOffload, CopyState::kOffloading);
  replica.offloads.push_back(&offload);
  replica.model->offload_copies.insert(offload.id);
  ++stats_.offloads_started;
  emit_to_replica(replica, Offload{record.version, offload.id});
  return offload;
}

void Hub::reconcile_offloads(Model& model) {
  const std::vector<CopyId> ids(model.offload_copies.begin(), model.offload_copies.end());
  for (CopyId id : ids) {
    auto found = model.copies.find(id);
    if (found == model.copies.end()) continue;
    Copy& offload = *found->second;
    if (offload_needed_again(offload)) {
      // It was being released because another safe copy held the version; that copy is gone
      // (its replica crashed or moved on) before the release finished: keep it, readable again.
      set_state(offload, CopyState::kComplete);
      continue;
    }
    const bool reading = offload.state == CopyState::kWaiting || offload.state == CopyState::kActive;
    if (offload.seed && reading && !seed_needed(offload)) {
      // Its owner has the version (or a newer one) some other way: the read is for nothing.
      release_unfinished_seeds(*offload.owner, [&](const Copy& seed) { return &seed == &offload; });
      continue;
    }
    if (offload.state != CopyState::kComplete) continue;
    const VersionRecord& record = *offload.record;
    // (A seed a reader reported is not trusted any more: kept only as retention needs.)
    if (offload.seed && !offload.failed && seed_needed(offload)) continue;
    // Released once another non-spot replica holds the version completely, once another safe
    // offload copy holds it (this one is among the safe ones unless a reader reported it: a
    // reported copy beside one safe copy is not needed either), or once the version leaves
    // retention.
    const std::uint32_t own = offload.counted.safe_offload ? 1 : 0;
    if (record.safe_primaries > 0 || record.safe_offloads > own ||
        !is_retained(model, record.version)) {
      start_drain(offload, DrainPurpose::kRelease);
    }
  }
}

bool Hub::offload_needed_again(const Copy& offload) const {
  if (offload.state != CopyState::kDraining || offload.drain_purpose != DrainPurpose::kRelease ||
      offload.failed) {
    return false;
  }
  const VersionRecord& record = *offload.record;
  return !offload.owner->spot && record.safe_primaries + record.safe_offloads == 0 &&
         is_retained(*offload.owner->model, record.version);
}

void Hub::release_unfinished_seeds(Replica& replica, const std::function<bool(const Copy&)>& match) {
  const std::vector<Copy*> offloads = replica.offloads;
  for (Copy* offload : offloads) {
    const bool reading = offload->state == CopyState::kWaiting || offload->state == CopyState::kActive;
    if (!offload->seed || !reading || !match(*offload)) continue;
    TH_ASSERT(offload->readers == 0, "a seed serves only once whole");
    const ReleaseOffload release{offload->record->version, offload->id};
    remove_copy(*offload);
    emit_to_replica(replica, release);
  }
}

bool Hub::seed_needed(const Copy& seed) const {
  TH_ASSERT(seed.seed && seed.kind == CopyKind::kOffload);
  const Version version = seed.record->version;
  // Until its owner holds the version (or a newer one) in its buffers, or seeds a newer one: in
  // the steady state one model's worth of CPU memory per seeding replica. (Not "until a newer
  // version exists": a replica that follows latest-k seeds versions older than latest.)
  const Copy* primary = seed.owner->primary;
  const bool consumed = primary != nullptr && primary->record->version >= version &&
                        (primary->state == CopyState::kComplete ||
                         primary->state == CopyState::kDraining);
  const bool superseded =
      std::any_of(seed.owner->offloads.begin(), seed.owner->offloads.end(), [&](const Copy* other) {
        return other->seed && other->record->version > version;
      });
  return !consumed && !superseded;
}

void Hub::on_offload_done(Replica& replica, std::uint32_t shard, const OffloadDone& done) {
  const auto found = std::find_if(replica.offloads.begin(), replica.offloads.end(), [&](const Copy* copy) {
    return copy->id == done.copy && copy->record->version == done.version;
  });
  if (found == replica.offloads.end()) {
    // Not a copy this server counts under that id. A copy a resume announced that this server
    // adopted is reported under the previous server's id until the renaming Offload arrives: it
    // is named again (that Offload may have been lost). Any other (cancelled before it was made,
    // made for a late instruction, announced and not adopted): the shard frees it rather than
    // keep CPU memory nobody reads; it reports the copy until told, so a lost release is repeated.
    const auto adopted = std::find_if(replica.offloads.begin(), replica.offloads.end(), [&](const Copy* copy) {
      return copy->record->version == done.version && !copy->seed &&
             (copy->state == CopyState::kComplete || copy->state == CopyState::kDraining);
    });
    if (adopted != replica.offloads.end()) {
      emit_to(replica.shards[shard], Offload{done.version, (*adopted)->id});
    } else {
      emit_to(replica.shards[shard], ReleaseOffload{done.version, done.copy});
    }
    return;
  }
  Copy* offload = *found;
  if (offload->state != CopyState::kOffloading) return;  // a duplicate
  offload->ready.set(shard);
  if (offload->ready.count() < replica.num_shards) return;
  set_state(*offload, CopyState::kComplete);
  on_copy_complete(*offload);
  Copy* primary = replica.primary;
  if (primary != nullptr && primary->awaiting_offload == offload->id) {
    primary->awaiting_offload = 0;
    const DrainPurpose purpose = primary->drain_purpose;
    const detail::CopyHealth health = primary->health();
    remove_copy(*primary);
    after_primary_drained(replica, purpose, health);
  }
}

// ---- retention -------------------------------------------------------------------------------------

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
  if (model.keep_latest.empty()) return false;
  return kept_latest(model, version, *model.keep_latest.rbegin());
}

bool Hub::retained_by_others(const Model& model, Version version, const Replica& replica) const {
  std::multiset<std::uint64_t> own_keep;
  std::map<Version, std::uint32_t> own_pins;
  for (const ShardSlot& slot : replica.shards) {
    if (!slot.client) continue;
    if (slot.retention.keep_latest) own_keep.insert(*slot.retention.keep_latest);
    for (Version pinned : slot.retention.pinned) ++own_pins[pinned];
  }
  if (auto pinned = model.pinned.find(version);
      pinned != model.pinned.end() && pinned->second > own_pins[version]) {
    return true;
  }
  // The largest latest-k rule of the other replicas.
  for (auto rule = model.keep_latest.rbegin(); rule != model.keep_latest.rend(); ++rule) {
    if (auto own = own_keep.find(*rule); own != own_keep.end()) {
      own_keep.erase(own);
      continue;
    }
    return kept_latest(model, version, *rule);
  }
  return false;
}

bool Hub::kept_latest(const Model& model, Version version, std::uint64_t keep) const {
  // keep_latest = k keeps what latest-0 … latest-k name: the k + 1 newest existing versions.
  if (!model.latest) return false;
  auto found = model.versions.find(version);
  if (found == model.versions.end() || !found->second.ever_complete) return false;
  const std::optional<Version> floor = newest_existing(model, keep);
  return !floor || version >= *floor;
}

std::vector<Version> Hub::last_retained_copies(const Replica& replica) const {
  std::vector<Version> versions;
  if (replica.spot) return versions;  // a spot replica's copies never count
  std::vector<const Copy*> copies(replica.offloads.begin(), replica.offloads.end());
  if (replica.primary != nullptr) copies.push_back(replica.primary);
  for (const Copy* copy : copies) {
    // Copies with every byte: complete, or on their way to an offload copy.
    const bool held = copy->state == CopyState::kComplete || copy->state == CopyState::kDraining ||
                      copy->state == CopyState::kOffloading;
    if (!held || copy->failed) continue;
    const VersionRecord& record = *copy->record;
    std::uint32_t own = 0;
    for (const Copy* other : copies) {
      own += other->record == &record && (other->counted.safe_primary || other->counted.safe_offload);
    }
    const std::uint32_t safe = record.safe_primaries + record.safe_offloads;
    TH_ASSERT(own <= safe, "a replica's safe copies are counted in its version's");
    if (safe - own == 0 && retained_by_others(*replica.model, record.version, replica) &&
        std::find(versions.begin(), versions.end(), record.version) == versions.end()) {
      versions.push_back(record.version);
    }
  }
  return versions;
}

std::string Hub::why_none_left(const VersionRecord& record) {
  if (record.left_with.empty()) return {};
  // The last non-spot copy went with that close; spot copies that held it may have gone since.
  return " (its last non-spot copy left with " + record.left_with + ", which closed)";
}

std::optional<Version> Hub::newest_existing(const Model& model, std::uint64_t k) const {
  // Bounded by the versions remembered (kForgottenVersionsWindow below latest, and those still
  // being published), whatever k a client asks for.
  std::uint64_t seen = 0;
  for (auto it = model.versions.rbegin(); it != model.versions.rend(); ++it) {
    if (!it->second.ever_complete) continue;
    if (seen == k) return it->first;
    ++seen;
  }
  return std::nullopt;
}

std::optional<Version> Hub::newest_readable_from(const Model& model, Version start) const {
  for (auto it = std::make_reverse_iterator(model.versions.upper_bound(start)); it != model.versions.rend(); ++it) {
    if (it->second.ever_complete && it->second.roots > 0) return it->first;
  }
  return std::nullopt;
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

}  // namespace th
