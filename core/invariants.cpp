// Hub::check_invariants: recomputes everything the hub maintains incrementally and compares, and
// checks the structural halves of DESIGN.md §5 (load, topology, monotonicity, consistency of the
// bookkeeping that integrity and retention rest on). The behavioural halves (what clients observe)
// are checked by the tests' observers and the simulator's checkers.
#include <algorithm>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "core/hub.h"

namespace th {

using detail::Contribution;
using detail::CopyId;
using detail::CopyState;
using detail::DcId;
using detail::ReplicaPhase;
using detail::ShardSlot;
using detail::TxnStage;

namespace {

// What a version record's counters should be, summed from its copies' contributions.
struct DcCounts {
  DcId dc = 0;
  std::uint32_t eligible = 0;
  std::uint32_t eligible_across = 0;
  std::uint32_t servable = 0;
  std::uint32_t complete = 0;
  std::uint32_t seeding = 0;
  std::uint32_t crossing = 0;
};
struct RecordCounts {
  std::vector<DcCounts> by_dc;  // a handful of datacenters: a flat list
  std::uint32_t safe_primaries = 0;
  std::uint32_t safe_offloads = 0;
  std::uint32_t complete_primaries = 0;
  std::uint32_t roots = 0;

  void reset() {
    by_dc.clear();  // keeps its capacity: one allocation per check, not per record
    safe_primaries = safe_offloads = complete_primaries = roots = 0;
  }
  const DcCounts* find(DcId dc) const {
    const auto found = std::find_if(by_dc.begin(), by_dc.end(),
                                    [dc](const DcCounts& counts) { return counts.dc == dc; });
    return found == by_dc.end() ? nullptr : &*found;
  }
  DcCounts& at(DcId dc) {
    const auto found = std::find_if(by_dc.begin(), by_dc.end(),
                                    [dc](const DcCounts& counts) { return counts.dc == dc; });
    return found == by_dc.end() ? by_dc.emplace_back(DcCounts{dc}) : *found;
  }
};

}  // namespace

// Runs after every step in the simulator and the property tests: it allocates little (no copy of
// the hub's indexes) and is linear in the hub's size.
void Hub::check_invariants() const {
  TH_ASSERT(orphans_.empty() && drained_.empty() && diverged_.empty(),
            "deferred work is settled after every step");
  std::size_t bound_total = 0;
  std::uint64_t all_description_bytes = 0;

  for (const auto& [model_name, model_ptr] : models_) {
    const Model& model = *model_ptr;
    TH_ASSERT(model.name == model_name);
    TH_ASSERT(model.layouts.size() <= limits::kLayoutsPerModelMax);
    for (std::size_t id = 0; id < model.layouts.size(); ++id) {
      const detail::ModelLayout& layout = *model.layouts[id];
      TH_ASSERT(layout.id == id && !layout.shards.empty());
      TH_ASSERT(layout.reads_from.size() + 1 == model.layouts.size(), "a layout is related to every other");
      for (const LayoutRef& shard : layout.shards) TH_ASSERT(shard != nullptr, "a layout describes every shard");
    }
    TH_ASSERT(!model.dirty, "dirty models are settled after every step");
    std::uint64_t model_description_bytes = 0;
    for (const auto& layout : model.layouts) {
      std::uint64_t layout_bytes = 0;
      for (const LayoutRef& shard : layout->shards) layout_bytes += shard->description_bytes();
      TH_ASSERT(layout->description_bytes == layout_bytes, "a layout counts its shards' descriptions");
      model_description_bytes += layout_bytes;
    }
    TH_ASSERT(model.description_bytes == model_description_bytes &&
                  model.description_bytes <= settings_.model_description_bytes_max,
              "a model counts its layouts' descriptions, within its limit");
    all_description_bytes += model.description_bytes;
    // The idle clock runs exactly while the model has no replica; it ends model_grace_ms later.
    TH_ASSERT(model.replicas.empty() == model.idle_since_ms.has_value(), "an idle model has no replica");
    TH_ASSERT(!model.idle_since_ms || *model.idle_since_ms <= now_ms_);
    std::size_t drain_deadlines = 0;
    for (const auto& [id, copy] : model.copies) {
      if (copy->drain_deadline_ms == 0) {
        // Past its drain grace a draining copy has no reader (and assign() adds none).
        TH_ASSERT(copy->state != CopyState::kDraining || copy->readers == 0,
                  "a copy past its drain grace keeps no reader");
        continue;
      }
      ++drain_deadlines;
      TH_ASSERT(copy->state == CopyState::kDraining && model.drain_deadlines.contains({copy->drain_deadline_ms, id}) &&
                    copy->drain_deadline_ms <= now_ms_ + settings_.drain_grace_ms,
                "a drain deadline belongs to a draining copy, indexed, within one grace");
    }
    TH_ASSERT(drain_deadlines == model.drain_deadlines.size(), "every indexed drain deadline is a copy's");
    // latest's own record is never forgotten, and no version is past the largest a model takes.
    TH_ASSERT(!model.latest || (model.versions.contains(*model.latest) && *model.latest <= limits::kVersionMax),
              "latest names a version the model remembers");

    // ---- replicas ----
    std::vector<std::uint64_t> keep_latest;
    std::map<Version, std::uint32_t> pinned;
    std::unordered_set<const Replica*> replicas;  // to check copy owners without name lookups
    replicas.reserve(model.replicas.size());
    for (const auto& [name, replica_ptr] : model.replicas) {
      const Replica& replica = *replica_ptr;
      replicas.insert(&replica);
      TH_ASSERT(replica.model == &model && replica.name == name);
      TH_ASSERT(replica.layout == nullptr ||
                    (replica.layout->id < model.layouts.size() && model.layouts[replica.layout->id].get() == replica.layout &&
                     replica.layout->shards.size() == replica.num_shards),
                "a replica's layout is one of its model's, of its shard count");
      TH_ASSERT(replica.shards.size() == replica.num_shards);
      std::uint32_t bound = 0;
      for (std::uint32_t shard = 0; shard < replica.num_shards; ++shard) {
        const ShardSlot& slot = replica.shards[shard];
        if (!slot.client) continue;
        ++bound;
        TH_ASSERT(expiry_scan_due_ms_ <= slot.last_seen_ms + settings_.heartbeat_timeout_ms + 1,
                  "no heartbeat deadline comes before the next expiry scan");
        const detail::Binding* found = clients_.find(*slot.client);
        TH_ASSERT(found != nullptr && found->replica == &replica && found->shard == shard,
                  "a bound shard is in the client map");
        if (slot.retention.keep_latest) keep_latest.push_back(*slot.retention.keep_latest);
        for (Version version : slot.retention.pinned) ++pinned[version];
      }
      TH_ASSERT(bound == replica.bound_shards, "bound shard count");
      TH_ASSERT(replica.phase != ReplicaPhase::kResuming || expiry_scan_due_ms_ <= replica.barrier_deadline_ms,
                "no barrier deadline comes before the next expiry scan");
      bool waiting = false;
      for (const ShardSlot& slot : replica.shards) waiting = waiting || slot.waiting_call.has_value();
      TH_ASSERT(replica.whole || replica.txns.empty(), "a replica takes calls only once whole");
      TH_ASSERT(!waiting || (!replica.whole && replica.phase == ReplicaPhase::kLive &&
                             replica.barrier_deadline_ms != 0 &&
                             expiry_scan_due_ms_ <= replica.barrier_deadline_ms),
                "a call waits for every shard to open only with a deadline");
      TH_ASSERT(replica.whole || replica.phase != ReplicaPhase::kLive ||
                    replica.bound_shards < replica.num_shards,
                "a live replica with every shard bound is whole");
      TH_ASSERT(bound > 0, "a replica without shards is removed");
      bound_total += bound;
      if (replica.primary != nullptr) {
        TH_ASSERT(replica.primary->owner == &replica && replica.primary->kind == CopyKind::kPrimary);
        TH_ASSERT(model.copies.contains(replica.primary->id));
      }
      TH_ASSERT(replica.offloads.size() <= limits::kOffloadsPerReplicaMax);
      for (auto offload_it = replica.offloads.begin(); offload_it != replica.offloads.end();
           ++offload_it) {
        const Copy* offload = *offload_it;
        // ReleaseOffload names a version: a replica holds at most one offload copy of each.
        // (Pairwise: the list is bounded by kOffloadsPerReplicaMax.)
        TH_ASSERT(std::none_of(std::next(offload_it), replica.offloads.end(),
                               [offload](const Copy* other) {
                                 return other->record == offload->record;
                               }),
                  "two offload copies of one version in", replica.name);
        TH_ASSERT(offload->owner == &replica && offload->kind == CopyKind::kOffload);
        TH_ASSERT(model.copies.contains(offload->id) && model.offload_copies.contains(offload->id));
      }
      if (!replica.txns.empty()) {
        TH_ASSERT(replica.txns.rbegin()->first - replica.txns.begin()->first <
                      limits::kTxnWindowMax,
                  "transaction window");
      }
      for (const auto& [seq, txn] : replica.txns) {
        TH_ASSERT(txn.seq == seq);
        TH_ASSERT((txn.arrived & ~txn.expected).none(), "only expected shards arrive");
        TH_ASSERT((txn.replied & ~txn.arrived).none(), "only arrived shards are answered");
        TH_ASSERT(txn.replied.none() || txn.result.has_value(), "answers come from the result");
        TH_ASSERT(!txn.result || txn.replied == txn.arrived, "a result reaches every arrived shard");
        TH_ASSERT(txn.replied != txn.expected || txn.expected.none(), "answered transactions go");
        if (txn.ticket != 0) {
          TH_ASSERT(!txn.result);
          TH_ASSERT(txn.stage == TxnStage::kUnresolved || txn.stage == TxnStage::kWaiting);
          const auto& tickets = txn.stage == TxnStage::kUnresolved ? model.unresolved : model.waits;
          auto found = tickets.find(txn.ticket);
          TH_ASSERT(found != tickets.end() && found->second.replica == &replica &&
                    found->second.seq == seq);
        }
      }
    }
    std::sort(keep_latest.begin(), keep_latest.end());
    TH_ASSERT(std::equal(keep_latest.begin(), keep_latest.end(), model.keep_latest.begin(),
                         model.keep_latest.end()),
              "retention union: latest-k rules");
    TH_ASSERT(pinned == model.pinned, "retention union: pinned versions");
    for (const auto* tickets : {&model.unresolved, &model.waits}) {
      for (const auto& [ticket, ref] : *tickets) {
        auto txn = ref.replica->txns.find(ref.seq);
        TH_ASSERT(txn != ref.replica->txns.end() && txn->second.ticket == ticket, "ticket owner");
      }
    }

    // ---- copies ----
    // Counted from the transfers: all of a copy's readers, and those in another datacenter.
    std::unordered_map<const Copy*, std::pair<std::uint32_t, std::uint32_t>> readers_of;
    std::unordered_map<const Copy*, std::uint32_t> patch_readers_of;
    for (const auto& [id, transfer] : model.transfers) {
      if (transfer->source == nullptr) continue;
      const bool across = transfer->source->owner->dc != transfer->reader->owner->dc;
      TH_ASSERT(transfer->cross_dc == across, "transfer", id, "says it reads across datacenters:", transfer->cross_dc);
      ++readers_of[transfer->source].first;
      patch_readers_of[transfer->source] += transfer->patch ? 1 : 0;
      readers_of[transfer->source].second += across;
    }
    for (const auto& [id, copy_ptr] : model.copies) {
      const Copy& copy = *copy_ptr;
      TH_ASSERT(copy.id == id);
      TH_ASSERT(replicas.contains(copy.owner), "copy owner");
      auto record = model.versions.find(copy.record->version);
      TH_ASSERT(record != model.versions.end() && &record->second == copy.record, "copy record");
      TH_ASSERT(copy.index_in_record < copy.record->copies.size() &&
                    copy.record->copies[copy.index_in_record] == &copy,
                "a copy is listed once, where it says, in its version's copies");
      if (copy.kind == CopyKind::kPrimary) {
        TH_ASSERT(copy.owner->primary == &copy, "a primary copy is its owner's primary");
        TH_ASSERT(copy.state != CopyState::kOffloading);
      } else {
        TH_ASSERT(copy.state == CopyState::kOffloading || copy.state == CopyState::kComplete ||
                      copy.state == CopyState::kDraining ||
                      (copy.seed && (copy.state == CopyState::kWaiting ||
                                     copy.state == CopyState::kActive)),
                  "offload copy state", copy_state_name(copy.state));
        TH_ASSERT(!copy.seed || copy.state != CopyState::kOffloading, "a seed is read, not copied");
      }
      const bool reading = copy.state == CopyState::kWaiting || copy.state == CopyState::kActive;
      TH_ASSERT(!reading || copy.incoming != nullptr, "a receiving copy has a transfer");
      if (copy.incoming != nullptr) {
        TH_ASSERT(reading || copy.state == CopyState::kGathering);
        TH_ASSERT(copy.incoming->reader == &copy);
      }
      if (copy.state == CopyState::kComplete || copy.state == CopyState::kDraining) {
        TH_ASSERT(copy.ready.count() == copy.owner->num_shards, "complete copies have every shard");
      }
      const auto counted_readers = readers_of.find(&copy);
      const auto [readers, across] =
          counted_readers == readers_of.end() ? std::pair<std::uint32_t, std::uint32_t>{} : counted_readers->second;
      TH_ASSERT(readers == copy.readers, "reader count of copy", id, ":", copy.readers, "vs", readers);
      TH_ASSERT(across == copy.readers_across, "readers across datacenters of copy", id, ":", copy.readers_across,
                "vs", across);
      // Load (§5.4): a source serves at most its fan-out limit at a time, counted apart for the
      // readers of its datacenter and those of others (Copy::readers_across).
      TH_ASSERT(readers - across <= settings_.fanout_max, "fan-out limit exceeded within a datacenter");
      TH_ASSERT(across <= settings_.fanout_max, "fan-out limit exceeded across datacenters");
      TH_ASSERT(copy.counted == contribution(copy), "stale contribution of copy", id);
      // Delta versions (hub_patches.cpp): a patch is every shard's, against one earlier version, and
      // held by a primary that published or applied it, until it leaves.
      if (!copy.patch.empty()) {
        TH_ASSERT(copy.kind == CopyKind::kPrimary && copy.patch.size() == copy.owner->num_shards,
                  "copy", id, "has a patch of every shard");
        TH_ASSERT(copy.state == CopyState::kComplete || copy.state == CopyState::kDraining ||
                      copy.state == CopyState::kActive, "copy", id, "has a patch in state", copy_state_name(copy.state));
        TH_ASSERT(copy.state != CopyState::kActive || copy.incoming == nullptr, "a reader keeps a patch once complete");
        for (const PatchRef& patch : copy.patch) {
          TH_ASSERT(patch != nullptr && patch->base == copy.patch.front()->base && patch->base < copy.record->version,
                    "copy", id, "has a patch of its version against one earlier version");
        }
      }
      const auto counted_patch_readers = patch_readers_of.find(&copy);
      TH_ASSERT(copy.patch_readers == (counted_patch_readers == patch_readers_of.end() ? 0 : counted_patch_readers->second),
                "patch reader count of copy", id, ":", copy.patch_readers);
      if (copy.awaiting_offload != 0) {
        TH_ASSERT(copy.state == CopyState::kDraining && copy.readers == 0);
        auto offload = model.copies.find(copy.awaiting_offload);
        TH_ASSERT(offload != model.copies.end() && offload->second->owner == copy.owner &&
                      offload->second->state == CopyState::kOffloading,
                  "a draining primary waits for its own offload copy");
      }
    }
    for (CopyId id : model.offload_copies) {
      TH_ASSERT(model.copies.contains(id) && model.copies.at(id)->kind == CopyKind::kOffload);
    }

    std::multiset<double> exact_rates;
    for (const auto& [name, replica] : model.replicas) {
      const detail::ReceiveRate& rate = replica->receive_rate;
      TH_ASSERT(rate.bytes_per_ms >= 0 && (!rate.exact || rate.bytes_per_ms > 0) && rate.last_bytes_per_ms >= 0 &&
                    (rate.bytes_per_ms == 0) == (rate.last_bytes_per_ms == 0),
                "the receive rate of", name, "is a measurement or none");
      TH_ASSERT(!rate.provisional || rate.bytes_per_ms > 0, "a rate timed on the way is a measurement");
      if (rate.exact) exact_rates.insert(rate.bytes_per_ms);
    }
    TH_ASSERT(exact_rates == model.exact_rates_bytes_per_ms, "the model holds exactly its replicas' exact rates");
    TH_ASSERT(exact_rates.size() < 2 || model.exact_rates_compared, "two exact rates have been compared");
    TH_ASSERT(model.fastest_shard_read.bytes_per_ms >= 0, "the model's fastest shard read is a measurement or none");
    TH_ASSERT(model.fastest_replica_read_by_dc.size() <= limits::kDatacentersMax);
    for (const auto& [dc, fastest] : model.fastest_replica_read_by_dc) {
      // A replica's read is timed by its shards': none newer, none faster than the fastest shard.
      TH_ASSERT(fastest.bytes_per_ms > 0 && fastest.version <= model.fastest_shard_read.version &&
                    (fastest.version < model.fastest_shard_read.version ||
                     fastest.bytes_per_ms <= model.fastest_shard_read.bytes_per_ms),
                "the fastest replica read of datacenter", dc, "is a measurement of its shards'");
    }

    // Each copy lists the transfers it serves (the readers it counts), each of them reading it.
    for (const auto& [copy_id, copy] : model.copies) {
      TH_ASSERT(copy->reading.size() == copy->readers, "copy", copy_id, "lists", copy->reading.size(),
                "transfers and counts", copy->readers);
      for (TransferId id : copy->reading) {
        const auto reading = model.transfers.find(id);
        TH_ASSERT(reading != model.transfers.end() && reading->second->source == copy.get(), "copy", copy_id,
                  "lists transfer", id, "which does not read it");
      }
    }

    // ---- transfers ----
    for (const auto& [id, transfer_ptr] : model.transfers) {
      const Transfer& transfer = *transfer_ptr;
      TH_ASSERT(transfer.id == id);
      const Copy& reader = *transfer.reader;
      TH_ASSERT(model.copies.contains(reader.id) && reader.incoming == &transfer);
      TH_ASSERT((reader.state == CopyState::kActive) == (transfer.source != nullptr),
                "a transfer has a source exactly while its reader is active");
      TH_ASSERT(transfer.queued == (reader.state == CopyState::kWaiting),
                "a waiting transfer is queued for a source");
      TH_ASSERT(transfer.queued == (std::count(reader.record->waiting.begin(),
                                               reader.record->waiting.end(), &transfer) == 1));
      TH_ASSERT((transfer.started & reader.ready).none(), "done shards are not reading");
      // Rate-aware selection (hub_rates.cpp): a transfer gives its source away a bounded number of
      // times, each time to a reader that then serves it; its measurements are of this epoch.
      TH_ASSERT(transfer.displacements <= limits::kDisplacementsPerTransferMax &&
                    transfer.displacements <= transfer.epoch,
                "transfer", id, "gave its source away", transfer.displacements, "times");
      TH_ASSERT(transfer.slowest_bytes_per_ms >= 0 && transfer.first_assigned_ms <= transfer.assigned_ms &&
                    transfer.assigned_ms <= now_ms_ && (transfer.epoch > 0 || transfer.slowest_bytes_per_ms == 0),
                "transfer", id, "measures its read from when its source was given");
      TH_ASSERT((transfer.progress_heard & ~(transfer.started | reader.ready)).none() &&
                    (transfer.progress_bytes_per_ms.empty() ||
                     transfer.progress_bytes_per_ms.size() == reader.owner->num_shards),
                "transfer", id, "heard the progress of shards of this epoch's read only");
      for (std::uint32_t shard = 0; shard < transfer.progress_bytes_per_ms.size(); ++shard) {
        TH_ASSERT(transfer.progress_bytes_per_ms[shard] >= 0 &&
                      (transfer.progress_bytes_per_ms[shard] == 0 || transfer.progress_heard.test(shard)),
                  "transfer", id, "timed shard", shard, "by its progress report");
      }
      // A patch read: from a complete holder of the patch against the version the reader's buffers
      // hold, of the reader's layout; the epochs that read one come first.
      TH_ASSERT(!transfer.patch_base || *transfer.patch_base < reader.record->version, "transfer", id,
                "patches against an earlier version");
      TH_ASSERT(transfer.patch_epochs <= transfer.epoch && (!transfer.patch || transfer.patch_epochs == transfer.epoch),
                "transfer", id, "reads patches in its first epochs only");
      TH_ASSERT((transfer.patched & ~reader.ready).none(), "transfer", id, "patched shards are done");
      if (transfer.patch) {
        TH_ASSERT(transfer.source != nullptr && transfer.patch_base && reader.kind == CopyKind::kPrimary &&
                      !transfer.reshard && transfer.source->owner->layout == reader.owner->layout,
                  "transfer", id, "reads a patch of its own layout into a primary");
        TH_ASSERT(transfer.source->patch.empty() || transfer.source->patch.front()->base == *transfer.patch_base,
                  "transfer", id, "reads a patch against the base its reader holds");
      }
      if (transfer.source != nullptr) {
        const Copy& source = *transfer.source;
        TH_ASSERT(model.copies.contains(source.id) && source.record == reader.record);
        TH_ASSERT(&source != &reader);
        TH_ASSERT(source.state == CopyState::kComplete || source.state == CopyState::kActive ||
                      source.state == CopyState::kWaiting || source.state == CopyState::kDraining,
                  "source state", copy_state_name(source.state));
        // The chain of partial sources ends at a copy that does not receive: no cycles. It ends
        // in the bytes (a complete copy, or one draining, which keeps its readers) or in a reader
        // waiting for a source, which itself can still get one (below): every transfer can still
        // complete, or its readers are told the version is unavailable (§5.2, §5.6).
        const Copy* at = &source;
        std::size_t hops = 0;
        while (at->incoming != nullptr && at->incoming->source != nullptr) {
          at = at->incoming->source;
          TH_ASSERT(++hops <= model.copies.size(), "the source chain has a cycle");
        }
        TH_ASSERT(at->state == CopyState::kComplete || at->state == CopyState::kDraining ||
                      at->state == CopyState::kWaiting,
                  "a chain of sources ends in", copy_state_name(at->state));
      } else if (transfer.queued) {
        // A reader waits only while some copy holds, or will hold without reading another, every
        // byte of the version; otherwise it must have been told the version is unavailable.
        TH_ASSERT(reader.record->roots > 0, "transfer", id, "waits for version",
                  reader.record->version, "of which no copy can be read any more");
      }
    }

    // ---- version records ----
    // Every copy sits at its own index in its record's list (checked above); with the lengths
    // summing to the number of copies, the lists hold nothing else, so the counters can be
    // recomputed from them.
    bool any_complete = false;
    std::size_t listed_copies = 0;
    RecordCounts sums;
    for (const auto& [version, record] : model.versions) {
      TH_ASSERT(record.version == version);
      for (const auto& [layout, checksums] : record.checksums) {
        TH_ASSERT(layout < model.layouts.size() && checksums.size() == model.layouts[layout]->shards.size(),
                  "a version's checksums are per shard of a layout of its model");
      }
      listed_copies += record.copies.size();
      sums.reset();
      std::map<detail::LayoutId, std::uint32_t> roots_by_layout;
      for (const Copy* copy : record.copies) {
        const Contribution& c = copy->counted;
        if (c.root) ++roots_by_layout[c.layout];
        DcCounts& sources = sums.at(copy->owner->dc);
        // Each eligible copy is indexed; with the counts equal below, the indexes hold no others.
        // (Not `record` inside the lambda: clang before 16 cannot capture a structured binding.)
        const auto indexed = record.by_dc.find(copy->owner->dc);
        const bool has_sources = indexed != record.by_dc.end();
        auto check_indexed = [&](std::set<std::pair<detail::SourceKey, Copy*>> detail::DcSources::*index,
                                 const detail::SourceKey& key, const char* readers) {
          TH_ASSERT(has_sources && (indexed->second.*index).contains({key, const_cast<Copy*>(copy)}),
                    "eligible copy", copy->id, "is indexed as a source for readers", readers);
        };
        if (c.eligible) {
          ++sources.eligible;
          check_indexed(&detail::DcSources::eligible, c.key, "here");
        }
        if (c.eligible_across) {
          ++sources.eligible_across;
          check_indexed(&detail::DcSources::eligible_across, c.key_across, "across datacenters");
        }
        sources.servable += c.servable;
        sources.complete += c.complete;
        sources.seeding += c.seeding;
        sources.crossing += c.crossing;
        sums.safe_primaries += c.safe_primary;
        sums.safe_offloads += c.safe_offload;
        sums.complete_primaries += c.complete_primary;
        sums.roots += c.root;
      }
      for (const auto& [dc, sources] : record.by_dc) {
        const DcCounts* found = sums.find(dc);
        const DcCounts none{dc};
        const DcCounts& want = found == nullptr ? none : *found;
        TH_ASSERT(sources.eligible.size() == want.eligible && sources.eligible_across.size() == want.eligible_across,
                  "eligible sources of version", version);
        TH_ASSERT(sources.servable == want.servable && sources.complete == want.complete &&
                      sources.seeding == want.seeding && sources.crossing == want.crossing,
                  "datacenter counters of version", version);
        // Topology (§5.5): at most one seeding replica per datacenter per version at a time.
        TH_ASSERT(sources.seeding <= 1, "two seeding replicas in one datacenter");
      }
      for (const DcCounts& want : sums.by_dc) {
        TH_ASSERT(record.by_dc.contains(want.dc), "a datacenter with copies has counters");
      }
      TH_ASSERT(record.safe_primaries == sums.safe_primaries &&
                    record.safe_offloads == sums.safe_offloads &&
                    record.complete_primaries == sums.complete_primaries &&
                    record.roots == sums.roots && record.roots_by_layout == roots_by_layout,
                "version counters of", version);
      TH_ASSERT(model.versions_with_waiters.contains(version) == !record.waiting.empty());
      for (const Transfer* transfer : record.waiting) {
        TH_ASSERT(transfer->reader->record == &record && transfer->queued);
      }
      if (record.ever_complete) {
        any_complete = true;
        // Monotonicity (§5.7) rests on this: latest covers every version that ever completed.
        TH_ASSERT((model.latest && version <= *model.latest),
                  "latest is below a complete version");
      }
    }
    TH_ASSERT(listed_copies == model.copies.size(), "version records list only live copies");
    TH_ASSERT(!any_complete || model.latest.has_value());
  }
  TH_ASSERT(bound_total == clients_.size(), "every client is bound to one shard");
  TH_ASSERT(description_bytes_ == all_description_bytes && description_bytes_ <= settings_.description_bytes_max,
            "the server counts its models' descriptions, within its limit");
}

}  // namespace th
