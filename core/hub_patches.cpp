// Delta versions (README "Delta versions", issue 35): a publisher announces, with a version, its
// patch against the version it published before; a reader whose buffers hold that base whole and
// healthy reads the patch (a few percent of the bytes at RL learning rates) instead of the bytes,
// from a copy that has it, and then has it too and serves it onwards. Apart from the source graph
// (hub_transfers.cpp) because it is one rule laid over it: which of the usable sources to prefer,
// and what a failed patch read means. Correctness never rests on the patch: the reader verifies
// the version's checksums after applying it, and any failure of a patch read is followed by a
// read of the bytes.
#include "core/hub.h"

#include <algorithm>
#include <string>
#include <utility>

#include "core/hub_internal.h"
#include "core/patch.h"

namespace th {

using detail::Copy;
using detail::CopyState;
using detail::DcId;

Status Hub::check_patch(const Replica& replica, Version version, std::uint32_t shard, const LayoutRef& layout,
                        const PatchRef& patch) const {
  if (patch == nullptr) return Unit{};
  const std::string at = detail::describe(replica) + " shard " + std::to_string(shard) + ": ";
  if (patch->base >= version) {
    return make_error(Errc::kInvalidArgument, at + "a patch of version " + std::to_string(version) +
                                                  " is against an earlier version, not " + std::to_string(patch->base));
  }
  const std::vector<TensorSpec>& tensors = layout->tensors();
  if (patch->tensor_bytes.size() != tensors.size()) {
    return make_error(Errc::kInvalidArgument, at + "the patch has " + std::to_string(patch->tensor_bytes.size()) +
                                                  " sizes for " + std::to_string(tensors.size()) + " tensors");
  }
  for (std::size_t tensor = 0; tensor < tensors.size(); ++tensor) {
    // Past 40 % a read of the bytes costs little more: the publisher leaves it out (size 0). The
    // waits for a busy holder (patch_source) and every reader's memory count on the limit.
    if (patch->tensor_bytes[tensor] > patch_bytes_limit(tensors[tensor].bytes)) {
      return make_error(Errc::kInvalidArgument,
                        at + "the patch of tensor '" + tensors[tensor].name + "' is " +
                            std::to_string(patch->tensor_bytes[tensor]) + " bytes, more than 40 % of the tensor's " +
                            std::to_string(tensors[tensor].bytes));
    }
  }
  return Unit{};
}

void Hub::commit_patches(Copy& copy) {
  TH_ASSERT(copy.state == CopyState::kPublishing && copy.patch.empty());
  const std::uint32_t shards = copy.owner->num_shards;
  // A reader reads every shard's patch or none. A shard that announced none (a pipeline stage whose
  // weights are frozen wrote nothing through a patch writer) is read whole within the patch read:
  // its patch has no tensor's. Not after a failover, whose shards announced theirs to the old
  // server; nor where two shards disagree on the base.
  const PatchRef* first = nullptr;
  bool agreed = copy.pending_patches.size() == shards && copy.pending_layouts.size() == shards;
  for (std::uint32_t shard = 0; agreed && shard < shards; ++shard) {
    const PatchRef& patch = copy.pending_patches[shard];
    if (patch == nullptr) {
      agreed = copy.pending_layouts[shard] != nullptr;
    } else if (first == nullptr) {
      first = &patch;
    } else {
      agreed = patch->base == (*first)->base;
    }
  }
  if (agreed && first != nullptr) {
    const Version base = (*first)->base;
    for (std::uint32_t shard = 0; shard < shards; ++shard) {
      if (copy.pending_patches[shard] != nullptr) continue;
      copy.pending_patches[shard] = std::make_shared<const PatchInfo>(
          PatchInfo{base, std::vector<std::uint64_t>(copy.pending_layouts[shard]->tensors().size(), 0)});
    }
    copy.patch = std::move(copy.pending_patches);
    ++stats_.patches_published;
  }
  copy.pending_patches.clear();
}

void Hub::resume_patches(const Replica& replica, Copy& copy) {
  TH_ASSERT(copy.state == CopyState::kComplete && copy.kind == CopyKind::kPrimary && copy.patch.empty());
  // As a publish's (commit_patches), but every shard must name its own: the server that knew which
  // shard had none is gone. A patch the shard no longer has is refused by it at the first read
  // (kSourceRefused), and dropped then.
  std::vector<PatchRef> patches;
  for (std::uint32_t shard = 0; shard < replica.num_shards; ++shard) {
    const auto& resume = replica.shards[shard].resume;
    if (!resume || !resume->primary || resume->primary->version != copy.record->version) return;
    const HeldCopy& held = *resume->primary;
    if (held.patch == nullptr || (!patches.empty() && held.patch->base != patches.front()->base)) return;
    if (!check_patch(replica, held.version, shard, held.layout, held.patch)) return;
    patches.push_back(held.patch);
  }
  copy.patch = std::move(patches);
}

std::optional<Version> Hub::patch_base(const Replica& replica, const Txn& txn) const {
  // The replica's buffers hold `previous` whole (its copy was complete when the update began) and,
  // as far as readers found, as published. A copy that readers reported may hold other bytes: the
  // patch's base checksum would refuse them, at a round trip's cost.
  if (!txn.previous || txn.seeded) return std::nullopt;
  const detail::CopyHealth& health = txn.previous_health;
  if (health.failed || health.corrupt || health.mismatched.any()) return std::nullopt;
  if (replica.layout == nullptr) return std::nullopt;
  return txn.previous;
}

bool Hub::holds_patch(const Copy& candidate, const Transfer& transfer) const {
  const Copy& reader = *transfer.reader;
  return transfer.patch_base && !candidate.patch.empty() && candidate.patch.front()->base == *transfer.patch_base &&
         candidate.state == CopyState::kComplete && !candidate.failed && !candidate.corrupt &&
         candidate.owner->layout == reader.owner->layout && &candidate != &reader;
}

// Whether `candidate` reads the reader's patch now, and so will hold it.
bool Hub::reading_patch(const Copy& candidate, const Transfer& transfer) const {
  const Transfer* incoming = candidate.incoming;
  return &candidate != transfer.reader && incoming != nullptr && incoming->patch &&
         incoming->patch_base == transfer.patch_base && candidate.kind == CopyKind::kPrimary &&
         candidate.owner->layout == transfer.reader->owner->layout;
}

// Among the copies `usable` allows: a holder of the reader's patch with a free slot, in the
// reader's datacenter first; else, while one here has its slots held by patch reads (or is still
// reading the patch), none of them known to go at under half the reader's rate, wait for it: a
// patch is at most 40 % of the bytes (patch_bytes_limit) and each reader that applies it serves it
// too, so holders double while a read of the bytes would still be under way. A holder whose slot a
// read of the bytes holds may stay busy long: not waited for. Across datacenters only into a
// datacenter with no other copy, from a holder with a slot.
// None: choose as for the bytes. (Linear in the version's copies, for each reader that can read a
// patch: hub_bench's 2,048 readers would pay it; an index of holders by datacenter is the remedy.)
Hub::PatchSource Hub::patch_source(const Transfer& transfer, const std::function<bool(const Copy*)>& usable) const {
  const Copy& reader = *transfer.reader;
  const detail::VersionRecord& record = *reader.record;
  const DcId dc = reader.owner->dc;
  Copy* best = nullptr;
  bool busy_here = false;
  bool any_here = false;
  // Patch reads here that are known to go at under half this reader's rate (hub_rates.cpp): their
  // sources are not freed soon, nor are they holders soon. Waiting behind one could take longer
  // than reading the bytes (an attack's find: a rollout at 400 kB/s reading a 1.2 MB patch held a
  // fast one up 3 s where the bytes took 4 ms); the reader chooses as for the bytes instead, which
  // may put it ahead of the slow one (Hub::put_ahead), where it reads the patch.
  std::vector<const Copy*> slow_patch_readers;
  for (const Copy* copy : record.copies) {
    const Transfer* incoming = copy->incoming;
    if (copy->owner->dc == dc && incoming != nullptr && incoming->patch && incoming->source != nullptr &&
        copy != &reader && much_slower(*copy->owner, *reader.owner)) {
      slow_patch_readers.push_back(copy);
    }
  }
  auto held_by_slow = [&](const Copy& holder) {
    return std::any_of(slow_patch_readers.begin(), slow_patch_readers.end(),
                       [&](const Copy* slow) { return slow->incoming->source == &holder; });
  };
  auto better = [](const Copy* a, const Copy* b) {
    return b == nullptr || std::pair{a->readers, a->id} < std::pair{b->readers, b->id};
  };
  for (Copy* copy : record.copies) {
    if (copy->owner->dc != dc) continue;
    if (copy != &reader && (copy->counted.servable || copy->state == CopyState::kComplete)) any_here = true;
    // A holder once its own read is done, unless that read is a slow one.
    if (reading_patch(*copy, transfer) && !much_slower(*copy->owner, *reader.owner)) busy_here = true;
    if (!holds_patch(*copy, transfer) || !usable(copy)) continue;
    if (!has_slot(*copy, false)) {
      // Freed soon only if patch reads hold its slots; a read of the bytes may take long.
      if (copy->patch_readers == copy->readers && !held_by_slow(*copy)) busy_here = true;
      continue;
    }
    if (better(copy, best)) best = copy;
  }
  if (best != nullptr) return {best, false};
  if (busy_here) return {nullptr, true};
  // Across datacenters only into one that has no copy but the reader's (no second seeder, no
  // complete copy passed over: DESIGN.md §5.5), and not for a chain root (its detour rules).
  if (any_here || reader.readers > 0) return {};
  for (Copy* copy : record.copies) {
    if (copy->owner->dc == dc || !holds_patch(*copy, transfer) || !usable(copy) || !has_slot(*copy, true)) continue;
    if (better(copy, best)) best = copy;
  }
  return {best, false};
}

void Hub::on_patch_read_failed(Transfer& transfer, ReadFailure reason) {
  TH_ASSERT(transfer.patch && transfer.source != nullptr);
  Copy& source = *transfer.source;
  ++stats_.patch_reads_failed;
  switch (reason) {
    case ReadFailure::kPatchBaseMismatch:
      break;  // the reader's buffers changed since they held the base: the source is not at fault
    case ReadFailure::kChecksumMismatch:
      // The patch did not make the version: made against other bytes than the base, damaged on its
      // way, or applied to buffers written since they held the base (a reader cannot tell that
      // without hashing them all). Twice, from two reads: the source serves the bytes only. Its
      // bytes are not in doubt either way.
      if (std::exchange(source.patch_suspect, true)) source.patch.clear();
      break;
    case ReadFailure::kSourceRefused:
      source.patch.clear();  // it no longer has the patch
      break;
    case ReadFailure::kSourceUnreachable:
      set_failed(source);
      break;
  }
  // Whatever went wrong, the rest of this transfer reads the bytes: the buffers may be partly patched.
  transfer.patch_base.reset();
}

void Hub::patch_read_done(Transfer& transfer) {
  // A patch that made the version once is not the suspect of a reader that could not use it.
  if (transfer.patch && transfer.source != nullptr) transfer.source->patch_suspect = false;
}

void Hub::keep_patch(Copy& reader, const Transfer& transfer) {
  TH_ASSERT(reader.patch.empty());
  if (reader.kind != CopyKind::kPrimary || transfer.patch_read.empty()) return;
  if (transfer.patched.count() != reader.owner->num_shards) return;  // some shard read the bytes
  reader.patch = transfer.patch_read;
  ++stats_.patches_kept;
}

}  // namespace th
