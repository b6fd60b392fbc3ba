// The source graph and transfers: which copy a reader reads from (load, topology, pipelines), and
// the data-plane reports of how reading went. Apart because choosing and replacing sources is a
// policy of its own, whichever call asked for the bytes.
#include "core/hub.h"

#include <algorithm>
#include <memory>
#include <string>
#include <tuple>
#include <unordered_map>
#include <vector>

#include "core/hub_internal.h"
#include "core/replica_layout.h"
#include "core/siphash.h"

namespace th {

using detail::Binding;
using detail::Copy;
using detail::CopyState;
using detail::DcId;
using detail::DcSources;
using detail::for_each_shard;
using detail::SourceKey;
using detail::TxnStage;

// kDisplace: the reader takes the source of `copy` (a slower reader early in its read, on the
// chain the reader would join), which then reads again, behind the reader (hub_rates.cpp).
enum class Hub::Pick : std::uint8_t { kFound, kWait, kUnavailable, kDisplace };

struct Hub::SourceChoice {
  Pick pick = Pick::kWait;
  Copy* copy = nullptr;
  bool passed_slow = false;  // a copy much slower than the reader was passed over for `copy`
};

bool Hub::smart_skip(const VersionRecord& record, DcId dc) const {
  auto found = record.by_dc.find(dc);
  return found != record.by_dc.end() && found->second.complete == 0 && found->second.seeding > 0;
}

bool Hub::wants_seed(const VersionRecord& record, const Replica& replica, const detail::ModelLayout& layout) const {
  // One slot is kept for the offload copy retention may need when the primary drains.
  if (replica.spot || replica.offloads.size() + 1 >= limits::kOffloadsPerReplicaMax) return false;
  if (replica.seed_failed == record.version) return false;
  // A seed is read from a copy of the replica's own layout (hub_layouts.cpp, serves()), verified
  // against that layout's checksums: some copy of it must have completed.
  if (!vouched(record, layout)) return false;
  const auto local = record.by_dc.find(replica.dc);
  if (local != record.by_dc.end() && (local->second.servable > 0 || local->second.complete > 0)) {
    return false;  // a copy here serves, or will: read it instead (the common case, decided in O(1))
  }
  for (const Copy* offload : replica.offloads) {
    if (offload->record == &record) return false;  // one offload copy per version and replica
  }
  // Only readers still waiting for their first source may be here: no copy here holds bytes.
  // A seed waiting for a source is this datacenter's seed already (one per datacenter).
  for (const Copy* copy : record.copies) {
    if (copy->owner->dc == replica.dc &&
        (copy->seed || (copy->state != CopyState::kGathering && copy->state != CopyState::kWaiting))) {
      return false;
    }
  }
  // With no root left the version is unavailable, which the update's own path tells the reader.
  return record.roots > 0;
}

void Hub::start_seed(Replica& replica, VersionRecord& record) {
  TH_ASSERT(replica.layout != nullptr && wants_seed(record, replica, *replica.layout));
  Model& model = *replica.model;
  // At most one seed of a replica is read at a time: an older one still crossing datacenters is
  // moot once the replica's updates have moved past it (they would otherwise pile up, each a
  // model's worth of CPU memory competing for the same link).
  release_unfinished_seeds(replica, [&](const Copy& other) { return other.record != &record; });
  Copy& seed = create_copy(replica, record, CopyKind::kOffload, CopyState::kWaiting);
  seed.seed = true;
  replica.offloads.push_back(&seed);
  model.offload_copies.insert(seed.id);
  auto transfer = std::make_unique<Transfer>();
  transfer->id = next_transfer_id_++;
  transfer->reader = &seed;
  transfer->resend_at_ms.assign(replica.num_shards, 0);
  Transfer& ref = *transfer;
  seed.incoming = &ref;
  model.transfers.emplace(ref.id, std::move(transfer));
  ++stats_.seeds_started;
  try_assign(ref);  // may fail it at once (nothing to read from): the copy is then gone
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
  transfer->patch_base = patch_base(replica, txn);
  copy->incoming = transfer.get();
  model.transfers.emplace(transfer->id, std::move(transfer));
  TH_ASSERT(replica.primary == copy && copy->incoming != nullptr);
  maybe_start_transfer(replica, txn);
}

// The replica's layout: known already (it published or read before), or made of what every shard
// described. A reader becomes a source too: its pieces must tile as a publisher's do, and what it
// says of its tensors binds the replicas after it (so that no two sources describe them
// differently). False: the transaction failed, saying why.
bool Hub::settle_layout(Replica& replica, Txn& txn) {
  Model& model = *replica.model;
  std::vector<LayoutRef> layouts(replica.num_shards);
  for (std::uint32_t shard = 0; shard < replica.num_shards; ++shard) {
    if (shard < txn.layouts.size() && txn.layouts[shard]) {
      layouts[shard] = txn.layouts[shard];
    } else if (replica.layout != nullptr) {
      layouts[shard] = replica.layout->shards[shard];
    }
  }
  const bool described = std::all_of(layouts.begin(), layouts.end(), [](const LayoutRef& l) { return l != nullptr; });
  if (described) {
    if (Status tiled = check_replica_pieces(layouts); !tiled) {
      abort_txn(replica, txn, tiled.error());
      return false;
    }
  }
  if (replica.layout != nullptr) {
    for (std::uint32_t shard = 0; shard < replica.num_shards; ++shard) {
      if (auto why = replica.layout->shards[shard]->mismatch(*layouts[shard])) {
        abort_txn(replica, txn, make_error(Errc::kLayoutMismatch, "shard " + std::to_string(shard) + ": " + *why));
        return false;
      }
    }
  }
  if (replica.layout != nullptr) {
    bool refined = false;
    if (Status fits = refine_layout(model, *replica.layout, layouts, refined); !fits) {
      abort_txn(replica, txn, fits.error());
      return false;
    }
    return true;
  }
  Result<detail::ModelLayout*> layout = layout_for(model, layouts);
  if (!layout) {
    abort_txn(replica, txn, layout.error());
    return false;
  }
  set_layout(replica, layout.value());
  return true;
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
  // A layout nobody holding the version has, nor one it reads: say which tensor, rather than wait.
  // Judged before the replica takes a layout, so that a refused call pins nothing: the application
  // may register otherwise and call again.
  auto refuse = [&](const std::string& why) {
    abort_txn(replica, txn, make_error(Errc::kLayoutMismatch, "version " + std::to_string(copy.record->version) +
                                                                  " cannot be read into " + describe(replica) + ": " + why));
  };
  Model& model = *replica.model;
  if (replica.layout == nullptr && txn.layouts.size() == replica.num_shards &&
      std::all_of(txn.layouts.begin(), txn.layouts.end(), [](const LayoutRef& l) { return l != nullptr; })) {
    detail::ModelLayout candidate;
    candidate.id = detail::kNoLayout;
    candidate.shards = txn.layouts;
    const detail::ModelLayout* known = known_layout(model, txn.layouts, replica.num_shards);
    if (auto why = unreadable(known != nullptr ? *known : candidate, model, *copy.record)) {
      refuse(*why);
      return;
    }
  }
  if (!settle_layout(replica, txn)) return;
  if (auto why = unreadable(*replica.layout, model, *copy.record)) {
    refuse(*why);
    return;
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
      if (choice.passed_slow) ++stats_.slow_sources_passed;
      dequeue_waiting(transfer);
      assign(transfer, *choice.copy);
      TH_ASSERT(transfer.source == choice.copy && transfer.reader->state == CopyState::kActive);
      if (transfer.cross_dc) keep_one_seeder(*transfer.reader);
      return;
    case Pick::kDisplace:
      put_ahead(transfer, *choice.copy->incoming);
      TH_ASSERT(choice.copy->incoming->source == transfer.reader && transfer.reader->state == CopyState::kActive);
      return;
    case Pick::kWait:
      enqueue_waiting(transfer);
      TH_ASSERT(transfer.queued);
      return;
    case Pick::kUnavailable: {
      // Copies whose bytes failed readers' checksums twice are left out (Copy::corrupt): name
      // them, since the likely cause is on their owner's side, not this reader's.
      constexpr std::size_t kNamedMax = 3;  // a version may have thousands of copies
      std::string corrupt;
      std::size_t corrupt_count = 0;
      for (const Copy* copy : transfer.reader->record->copies) {
        if (!copy->corrupt || copy == transfer.reader) continue;
        if (++corrupt_count <= kNamedMax) corrupt += (corrupt.empty() ? "" : ", ") + detail::describe(*copy->owner);
      }
      std::string message = "no copy of version " + std::to_string(transfer.reader->record->version) +
                            " is left to read from" + why_none_left(*transfer.reader->record);
      if (corrupt_count > 0) {
        if (corrupt_count > kNamedMax) corrupt += " and " + std::to_string(corrupt_count - kNamedMax) + " more";
        message += ": the copies of " + corrupt +
                   " failed readers' checksums at their source (tensors written while published?)";
      }
      fail_transfer(transfer, make_error(Errc::kVersionUnavailable, std::move(message)));
      return;
    }
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
  // No copy holds, or will hold without reading another, every byte (the last one went, or its
  // bytes turned out corrupt): no chain of sources can complete, however busy it looks.
  if (record.roots == 0 || !may_complete(reader)) return {Pick::kUnavailable, nullptr};
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
    // (Only a reader that serves others has copies downstream: the walk over every copy of the
    // version is skipped otherwise, which is nearly always; hub_bench 2048 x 4 spent a quarter of
    // its time here.)
    if (has_downstream) {
      for (const Copy* copy : record.copies) {
        if (copy != &reader && is_downstream(*copy, reader, model.copies.size()) &&
            std::find(downstream_dcs.begin(), downstream_dcs.end(), copy->owner->dc) == downstream_dcs.end()) {
          downstream_dcs.push_back(copy->owner->dc);
        }
      }
    }
  }
  auto usable = [&](const Copy* candidate) {
    return candidate != &reader && serves(*candidate, reader) &&
           (!has_downstream || !is_downstream(*candidate, reader, model.copies.size())) &&
           (!several_dcs || !makes_detour(*candidate, dc, downstream_dcs, model.copies.size()));
  };
  // Offload seeding: the replica's own seed copy first, once complete; reading it crosses no
  // network (paper §4.3.4: "subsequent polling prioritizes consuming the offloaded copy").
  if (reader.kind == CopyKind::kPrimary) {
    for (Copy* own : reader.owner->offloads) {
      if (own->seed && own->record == &record && own->counted.eligible && usable(own)) {
        return {Pick::kFound, own};
      }
    }
  }
  // A reader that holds the version before whole reads the patch from a copy that has it, if one
  // here has (or will soon have) a free slot (hub_patches.cpp).
  if (transfer.patch_base) {
    const PatchSource patch = patch_source(transfer, usable);
    if (patch.copy != nullptr) return {Pick::kFound, patch.copy};
    if (patch.wait) return {Pick::kWait, nullptr};
  }
  // With smart skipping, nobody pipelines behind a seeder still crossing datacenters: the readers
  // here wait until it is complete and then pipeline at local speed (paper §4.3.4). Nor does a
  // reader in a third datacenter read from a copy still crossing into another one (a chain across
  // three datacenters, as slow as its slowest link).
  const auto local = record.by_dc.find(dc);
  const bool any_crossing_here = local != record.by_dc.end() && local->second.crossing > 0;
  auto behind_seeder = [&](const Copy* candidate) {
    // A local candidate's chain can cross datacenters only through a copy here.
    const bool may_cross = candidate->owner->dc != dc || any_crossing_here;
    if (!settings_.smart_skipping || !may_cross) return false;
    const Copy* at = candidate;
    for (std::size_t hops = 0; hops <= model.copies.size(); ++hops) {
      if (at->state != CopyState::kActive) return false;
      TH_ASSERT(at->incoming != nullptr && at->incoming->source != nullptr, "an active copy reads");
      if (at->incoming->cross_dc) return true;
      at = at->incoming->source;
    }
    TH_ASSERT(false, "the source chain has a cycle");
  };

  // Whether a copy here serves or will serve soon. A complete copy has no source: it is its own
  // root, and never downstream of the reader. Receiving copies count if their chain of sources
  // reaches a complete one (followed with a memo, so this is linear in the copies), and so does
  // this datacenter's seeder whatever its chain: a second one may not start (DESIGN.md §5.5).
  auto source_soon_here = [&] {
    const DcSources& here = record.by_dc.at(dc);
    if (here.servable == 0) return false;
    if (here.complete > 0) return true;
    std::unordered_map<const Copy*, bool> grounded;
    auto reaches_root = [&](const Copy* start) {
      std::vector<const Copy*> path;
      const Copy* at = start;
      bool result = false;
      for (std::size_t hops = 0;; ++hops) {
        TH_ASSERT(hops <= model.copies.size(), "the source chain has a cycle");
        if (auto known = grounded.find(at); known != grounded.end()) {
          result = known->second;
          break;
        }
        path.push_back(at);
        if (at->state != CopyState::kActive) {
          result = !at->corrupt && (at->state == CopyState::kComplete || at->state == CopyState::kDraining);
          break;
        }
        at = at->incoming->source;
      }
      for (const Copy* on_path : path) grounded[on_path] = result;
      return result;
    };
    // A copy of another layout the reader reads counts too: the reader waits until it is
    // complete and then reads it here. Seeding past it would make two seeders, and each would
    // take the other's place (keep_one_seeder) without end.
    auto serves_here = [&](const Copy* copy) {
      return usable(copy) || (copy != &reader && copy->owner->layout != reader.owner->layout &&
                              serves_once_complete(*copy, reader));
    };
    for (const Copy* copy : record.copies) {
      if (copy->owner->dc == dc && copy->counted.servable && serves_here(copy) &&
          (copy->counted.seeding || reaches_root(copy))) {
        return true;
      }
    }
    return false;
  };

  if (local != record.by_dc.end()) {
    // Least loaded first; a copy still receiving behind a much slower one (itself, or one on its
    // chain) only if no other can serve now. A copy on the chosen one's chain that is slower than
    // the reader and early in its read gives its source to the reader and reads behind it
    // (hub_rates.cpp).
    Copy* chosen = nullptr;
    Copy* slow = nullptr;
    std::size_t slow_passed = 0;
    for (const auto& [key, copy] : local->second.eligible) {
      if (!usable(copy) || behind_seeder(copy)) continue;
      if (!slow_chain(*copy, reader)) {
        chosen = copy;
        break;
      }
      if (slow == nullptr) slow = copy;
      if (++slow_passed >= limits::kSlowSourcesPassedMax) break;
    }
    const bool passed_slow = chosen != nullptr && slow != nullptr;
    if (chosen == nullptr) chosen = slow;
    if (chosen != nullptr) {
      if (Copy* ahead_of = insertion_point(*chosen, reader)) return {Pick::kDisplace, ahead_of};
      return {Pick::kFound, chosen, passed_slow};
    }
  }
  // Copies here that serve or will serve soon: wait for them rather than seed across datacenters a
  // second time. A chain that ends in a reader still waiting for a source does not count: it
  // serves nothing until that reader does (two such readers would otherwise wait for each other).
  if (local != record.by_dc.end() && source_soon_here()) return {Pick::kWait, nullptr};

  Copy* best = nullptr;
  SourceKey best_key;
  for (const auto& [other_dc, sources] : record.by_dc) {
    if (other_dc == dc) continue;
    for (const auto& [key, copy] : sources.eligible_across) {
      if (!usable(copy) || behind_seeder(copy)) continue;
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
  Copy* suspect = nullptr;
  for (Copy* copy : record.copies) {
    if (!copy->failed || copy->corrupt || copy->state != CopyState::kComplete || !usable(copy) ||
        !has_slot(*copy, copy->owner->dc != dc)) {
      continue;
    }
    auto rank = [&](const Copy* c) { return std::tuple{c->owner->dc != dc, c->readers, c->id}; };
    if (suspect == nullptr || rank(copy) < rank(suspect)) suspect = copy;
  }
  if (suspect != nullptr) return {Pick::kFound, suspect};

  // Last, a complete copy in another datacenter that only the detour rule ruled out: one of the
  // datacenters downstream of this reader holds it. Waiting would be for nothing (seed 722011:
  // the only complete copy sat in the datacenter of a downstream reader, which read across
  // datacenters from this reader's chain, and the root of that chain waited forever). A complete
  // copy has no sources of its own: the reader becomes its datacenter's seeder.
  if (several_dcs && has_downstream) {
    // Unless this datacenter has a seeder already, whose bytes do not come through this reader:
    // then wait for it (it completes, and is read here). Taking a complete copy across as well
    // would make a second seeder here; keep_one_seeder would send the first back to choose again,
    // which (by this same rule) takes a copy across once more and sends this one back, without
    // end (th-sim seed 66992, harsh-bytes, fan-out 2: two seeders of dc2 taking each other's
    // place within one step, until settle() gave up).
    for (const Copy* copy : record.copies) {
      if (copy != &reader && copy->owner->dc == dc && copy->counted.seeding &&
          serves_once_complete(*copy, reader) && !is_downstream(*copy, reader, model.copies.size())) {
        return {Pick::kWait, nullptr};
      }
    }
    Copy* detour = nullptr;
    for (Copy* copy : record.copies) {
      if (copy->state != CopyState::kComplete || copy->corrupt || copy->owner->dc == dc ||
          !has_slot(*copy, true) || !serves(*copy, reader)) {
        continue;
      }
      auto rank = [](const Copy* c) { return std::tuple{c->failed, c->readers, c->id}; };
      if (detour == nullptr || rank(copy) < rank(detour)) detour = copy;
    }
    if (detour != nullptr) return {Pick::kFound, detour};
  }

  // Wait: some copy holds, or will hold without reading from another copy, all the bytes (a root
  // every chain of sources must reach; none is ever downstream of this reader). Without one the
  // reader was told at the top: no transfer of the version can complete.
  TH_ASSERT(record.roots > 0, "a reader waits only for a version some copy holds");
  return {Pick::kWait, nullptr};
}

void Hub::assign(Transfer& transfer, Copy& source) {
  Copy& reader = *transfer.reader;
  Replica& owner = *reader.owner;
  TH_ASSERT(source.state == CopyState::kComplete ||
                (settings_.pipeline && source.state == CopyState::kActive),
            "source state", copy_state_name(source.state));
  TH_ASSERT(!source.failed || source.state == CopyState::kComplete, "a suspect is a last resort");
  TH_ASSERT(source.record == reader.record);
  transfer.cross_dc = source.owner->dc != owner.dc;
  TH_ASSERT(has_slot(source, transfer.cross_dc), "fan-out limit");
  if (transfer.cross_dc && reader.readers == 0) {
    // Topology (§5.5): across datacenters only when no copy here is complete. (Receiving copies
    // here may be unusable: behind a seeder, or in a chain that waits for its source. A reader
    // waits while any copy here is complete, even one of a layout it does not read.)
    const auto local = reader.record->by_dc.find(owner.dc);
    TH_ASSERT(local == reader.record->by_dc.end() ||
                  std::none_of(local->second.eligible.begin(), local->second.eligible.end(),
                               [](const auto& entry) { return entry.second->state == CopyState::kComplete; }),
              "a remote source was chosen while a complete local one could serve");
  }
  transfer.source = &source;
  transfer.reshard = source.owner->layout != owner.layout;
  TH_ASSERT(!transfer.reshard || (source.state == CopyState::kComplete && reader.kind == CopyKind::kPrimary),
            "another layout is read from complete copies only");
  if (transfer.epoch == 0) transfer.first_assigned_ms = now_ms_;
  ++transfer.epoch;
  transfer.last_source = source.owner->name;
  transfer.assigned_ms = now_ms_;
  transfer.source_readers_at_assign = source.readers;
  transfer.source_was_complete = source.state == CopyState::kComplete;
  transfer.slowest_bytes_per_ms = 0;
  transfer.progress_heard.reset();
  transfer.progress_bytes_per_ms.clear();
  // A patch where the source has the reader's; else the bytes, which leave the buffers no base.
  transfer.patch = !transfer.reshard && reader.kind == CopyKind::kPrimary && holds_patch(source, transfer);
  if (transfer.patch) {
    transfer.patch_epochs = transfer.epoch;
    transfer.patch_read = source.patch;
    ++source.patch_readers;
    ++stats_.patch_reads_started;
  } else {
    transfer.patch_base.reset();
  }
  count_reader(source, transfer, +1);
  transfer.source_readers_joined = source.readers_joined;
  set_state(reader, CopyState::kActive);
  ++stats_.transfers_started;

  for (std::uint32_t shard = 0; shard < owner.num_shards; ++shard) {
    if (reader.ready.test(shard)) continue;
    transfer.started.set(shard);
    emit_grant(transfer, shard);
    if (!transfer.resend_at_ms.empty()) transfer.resend_at_ms[shard] = now_ms_ + kSeedResendMs;
  }
}

void Hub::resend_instructions(Replica& replica, std::uint32_t shard) {
  if (const Copy* copy = replica.primary; copy != nullptr && copy->incoming != nullptr) {
    const Transfer& transfer = *copy->incoming;
    if (transfer.source != nullptr && transfer.started.test(shard)) emit_grant(transfer, shard);
  }
  for (const Copy* offload : replica.offloads) {
    if (offload->state == CopyState::kOffloading && !offload->ready.test(shard)) {
      emit_to(replica.shards[shard], Offload{offload->record->version, offload->id});
    }
  }
  resend_seed_reads(replica, shard, /*now=*/false);
}

// A seed's transfer belongs to no call, so no retransmitted call brings its instructions again:
// they are repeated with the shard's heartbeats until the shard has its bytes (a lost StartRead
// would otherwise leave the datacenter skipping the version for ever), at most every
// kSeedResendMs: a read that goes well takes far longer than a heartbeat, and the repeat (with
// the layout and checksums) is not free.
void Hub::resend_seed_reads(Replica& replica, std::uint32_t shard, bool now) {
  for (Copy* offload : replica.offloads) {
    if (offload->incoming == nullptr) continue;
    Transfer& transfer = *offload->incoming;
    TH_ASSERT(transfer.resend_at_ms.size() == replica.num_shards, "a seed's transfer times repeats");
    if (!now && now_ms_ < transfer.resend_at_ms[shard]) continue;
    transfer.resend_at_ms[shard] = now_ms_ + kSeedResendMs;
    if (transfer.source != nullptr && transfer.started.test(shard)) emit_grant(transfer, shard);
  }
}

GrantSecret Hub::grant_secret(const Transfer& transfer) const {
  // Unique per (transfer, epoch): a reader of an earlier epoch cannot read under the new one.
  std::array<std::uint8_t, 12> message{};
  for (int i = 0; i < 8; ++i) message[i] = static_cast<std::uint8_t>(transfer.id >> (8 * i));
  for (int i = 0; i < 4; ++i) message[8 + i] = static_cast<std::uint8_t>(transfer.epoch >> (8 * i));
  return siphash128(settings_.grant_secret_key, message);
}

void Hub::emit_grant(const Transfer& transfer, std::uint32_t shard) {
  TH_ASSERT(transfer.source != nullptr && transfer.started.test(shard));
  const Copy& source = *transfer.source;
  // Another layout: every source shard serves every reader shard (a repeated grant is one grant).
  const std::uint32_t first = transfer.reshard ? 0 : shard;
  const std::uint32_t end = transfer.reshard ? source.owner->num_shards : std::min(shard + 1, source.owner->num_shards);
  for (std::uint32_t serving = first; serving < end; ++serving) {
    emit_to(source.owner->shards[serving],
            ServeRead{transfer.id, transfer.epoch, transfer.reader->record->version, source.kind, serving,
                      transfer.reader->owner->name, grant_secret(transfer), transfer.patch});
  }
  emit_start_read(transfer, shard);
}

void Hub::emit_start_read(const Transfer& transfer, std::uint32_t shard) {
  const Copy& reader = *transfer.reader;
  const Copy& source = *transfer.source;
  const VersionRecord& record = *reader.record;
  TH_ASSERT(transfer.started.test(shard));
  const detail::ModelLayout& layout = *reader.owner->layout;
  const ChecksumsRef& checksums = checksums_of(record, layout, shard);
  TH_ASSERT(transfer.reshard || checksums != nullptr, "a source's version has checksums");
  const std::uint32_t source_shard = transfer.reshard ? 0 : shard;
  StartRead start{transfer.id, transfer.epoch, transfer.txn_seq, record.version, shard,
                  SourceRef{source.owner->name, source.owner->incarnation, source.owner->datacenter,
                            source.owner->shards[source_shard].endpoint, source.kind,
                            source.state != CopyState::kComplete},
                  checksums, 0, nullptr, grant_secret(transfer), {}};
  if (transfer.patch) {
    // As the source announced it when the read was placed (it may have dropped it since: then this
    // read fails, and the next reads the bytes).
    TH_ASSERT(transfer.patch_read.size() == source.owner->num_shards, "a patch read has every shard's patch");
    start.patch = transfer.patch_read[shard];
  }
  if (transfer.reshard) {
    const detail::ModelLayout& held = *source.owner->layout;
    for (std::uint32_t serving = 0; serving < source.owner->num_shards; ++serving) {
      const ChecksumsRef& vouching = checksums_of(record, held, serving);
      TH_ASSERT(vouching != nullptr, "a complete copy's layout has the version's checksums");
      start.reshard.push_back(SourceShard{source.owner->shards[serving].endpoint, held.shards[serving], vouching});
    }
  }
  if (reader.kind == CopyKind::kOffload) {
    TH_ASSERT(reader.seed && !transfer.reshard, "only a seed copy is read into, from its own layout");
    start.offload_copy = reader.id;
    start.layout = layout.shards[shard];
  }
  emit_to(reader.owner->shards[shard], std::move(start));
}

void Hub::detach_source(Transfer& transfer) {
  Copy* source = transfer.source;
  if (source == nullptr) return;
  Model& model = *source->owner->model;
  if (transfer.reshard) {
    // Every source shard served every reader shard until the last was done.
    for (std::uint32_t shard = 0; shard < source->owner->num_shards; ++shard) {
      emit_to(source->owner->shards[shard], StopServing{transfer.id, transfer.epoch});
    }
  } else {
    for_each_shard(transfer.started, source->owner->num_shards, [&](std::uint32_t shard) {
      emit_to(source->owner->shards[shard], StopServing{transfer.id, transfer.epoch});
    });
  }
  transfer.started.reset();
  transfer.progress_heard.reset();
  transfer.progress_bytes_per_ms.clear();
  transfer.reshard = false;
  if (transfer.patch) {
    TH_ASSERT(source->patch_readers > 0);
    --source->patch_readers;
  }
  transfer.patch = false;
  transfer.source = nullptr;
  count_reader(*source, transfer, -1);
  if (source->state == CopyState::kDraining && source->readers == 0) {
    drained_.emplace_back(&model, source->id);
  }
}

void Hub::reassign(Transfer& transfer, bool failed) {
  Model& model = *transfer.reader->owner->model;
  detach_source(transfer);
  // The reader reads afresh from its next source: what its readers found in its old bytes no
  // longer says anything about it.
  transfer.reader->mismatched.reset();
  transfer.reader->corrupt = false;
  set_state(*transfer.reader, CopyState::kWaiting);
  if (failed) ++transfer.failures;
  orphans_.emplace_back(&model, transfer.id);  // settle() picks another source, or gives up
}

// A datacenter has at most one seeder per version for the copies that can read it (§5.5; a copy of
// a layout that reads no other here seeds for itself). A new one only starts where no other
// could serve (select_source), except for a chain root that took a complete copy in a datacenter
// downstream of it: a copy of its own datacenter that reads across datacenters from that chain
// then reads here instead (it waits for the new seeder, or pipelines from it).
void Hub::keep_one_seeder(const Copy& seeder) {
  TH_ASSERT(seeder.counted.seeding || seeder.failed, "called for a copy that seeds");
  for (Copy* copy : seeder.record->copies) {
    // Only a copy that can read the new seeder gives way to it: one of a layout that cannot would
    // seed again, and take the new seeder's place in turn.
    if (copy != &seeder && copy->owner->dc == seeder.owner->dc && copy->counted.seeding &&
        serves_once_complete(seeder, *copy)) {
      reassign(*copy->incoming, /*failed=*/false);
    }
  }
}

void Hub::complete_transfer(Transfer& transfer) {
  Copy& reader = *transfer.reader;
  Replica& replica = *reader.owner;
  TH_ASSERT(reader.ready.count() == replica.num_shards, "every shard has its bytes");
  TH_ASSERT(reader.incoming == &transfer);
  Model& model = *replica.model;
  dequeue_waiting(transfer);
  const std::string source_name = transfer.last_source;
  const std::uint64_t seq = transfer.txn_seq;
  record_receive_rate(transfer);
  keep_patch(reader, transfer);
  detach_source(transfer);
  reader.incoming = nullptr;
  model.transfers.erase(transfer.id);
  ++stats_.transfers_completed;
  // Every shard verified its bytes: what readers found in them while they arrived is moot. Those
  // read from another layout vouch for their layout's bytes from now on, unless a copy of it
  // completed meanwhile (then they were compared with it, on_transfer_done).
  reader.mismatched.reset();
  reader.corrupt = false;
  for (std::uint32_t shard = 0; shard < reader.pending_checksums.size(); ++shard) {
    if (reader.pending_checksums[shard] != nullptr) {
      commit_checksums(*reader.record, *replica.layout, shard, reader.pending_checksums[shard]);
    }
  }
  reader.pending_checksums.clear();
  set_state(reader, CopyState::kComplete);
  on_copy_complete(reader);
  if (reader.kind == CopyKind::kOffload) return;  // a seed: no call waits for it
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
  if (transfer.reader->kind == CopyKind::kOffload) {
    // A seed: no call waits for it; the shards stop reading and free the buffer. The next update
    // learns what became of the version on its own path (not by seeding it again).
    replica.seed_failed = transfer.reader->record->version;
    const ReleaseOffload release{transfer.reader->record->version, transfer.reader->id};
    remove_copy(*transfer.reader);
    emit_to_replica(replica, release);
    return;
  }
  const std::uint64_t seq = transfer.txn_seq;
  const bool written = transfer.epoch > 0;  // some shard was told to read: its buffers changed
  remove_copy(*transfer.reader);            // also ends the transfer
  auto found = replica.txns.find(seq);
  if (found == replica.txns.end() || found->second.result) return;
  if (!written && found->second.previous) {
    restore_previous(replica, *found->second.previous, found->second.previous_health);
  }
  found->second.released = written;
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
        } else if constexpr (std::is_same_v<T, CancelCall>) {
          on_cancel_call(replica, shard, body);
        } else if constexpr (std::is_same_v<T, TransferProgress>) {
          on_transfer_progress(replica, shard, body);
        } else {
          static_assert(std::is_same_v<T, Heartbeat>);
          if (!replica.offloads.empty()) resend_seed_reads(replica, shard, /*now=*/false);
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
  // After a read from another layout the shard says what it assembled; else it verified its bytes
  // against its layout's checksums, which the version has then.
  const detail::ModelLayout& layout = *replica.layout;
  if (done.checksums != nullptr) {
    if (done.checksums->size() != layout.shards[shard]->tensors().size()) return;  // not this layout's
    if (!check_checksums(*reader.record, layout, shard, layout.shards[shard], done.checksums)) {
      // What it assembled is not what a copy of its layout holds: read again, from another source.
      on_transfer_failed(replica, shard, TransferFailed{done.transfer, done.epoch, ReadFailure::kChecksumMismatch});
      return;
    }
    if (reader.pending_checksums.empty()) reader.pending_checksums.resize(replica.num_shards);
    reader.pending_checksums[shard] = done.checksums;
  } else if (checksums_of(*reader.record, layout, shard) == nullptr) {
    return;  // nothing vouches for its bytes (a report that is not this read's)
  }
  if (transfer.started.test(shard)) {
    TH_ASSERT(transfer.source != nullptr, "started shards read from a source");
    if (done.epoch == transfer.epoch) {
      measure_shard_read(transfer, shard);
      check_progress_claim(transfer, shard);
    }
    if (!transfer.reshard) {
      emit_to(transfer.source->owner->shards[shard], StopServing{transfer.id, transfer.epoch});
      // The source's bytes of this shard read well: an earlier checksum failure was passing trouble.
      if (done.epoch == transfer.epoch) transfer.source->mismatched.reset(shard);
    }
    transfer.started.reset(shard);
  }
  if (done.epoch <= transfer.patch_epochs) transfer.patched.set(shard);
  if (done.epoch == transfer.epoch) patch_read_done(transfer);
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
  if (transfer.patch) {
    on_patch_read_failed(transfer, failed.reason);
  } else if (failed.reason == ReadFailure::kChecksumMismatch && transfer.reshard) {
    on_reshard_mismatch(*transfer.source);
  } else if (failed.reason == ReadFailure::kChecksumMismatch) {
    on_mismatch(*transfer.source, shard);
  } else {
    set_failed(*transfer.source);
  }
  reassign(transfer);
}

}  // namespace th
