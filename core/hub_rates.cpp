// Rate-aware source selection (issue 34): how fast each replica receives, as the hub measures it,
// and the two rules that use it. A pipeline runs at its slowest link, so a reader behind a slow
// member waits for it; reading complete copies only (no pipeline) would spare the reader that, at
// the price of every static fan-out. Instead:
//   - a reader passes over a copy whose owner receives at well under the reader's own rate, for
//     any other copy here that can serve it now (a slow copy serves only when none can);
//   - if every copy that can serve it now is such a slow one, still early in its own read, the
//     reader takes that copy's source and the slow copy reads behind the reader: slow members
//     move to the end of the chain.
// The hub measures rates itself (grant to TransferDone, per shard, the slowest shard counting), so
// a client's word is not needed and a client that reports late only makes itself look slow. A
// replica never measured counts as fast: the first version of a job pipelines as before. While a
// model has had one exact rate only (the root of its first chain, which everyone else may have
// read behind), its measured readers go ahead of that copy once, to be timed themselves.
#include "core/hub.h"

#include <algorithm>
#include <set>
#include <vector>

#include "core/hub_internal.h"

namespace th {

using detail::CopyState;

namespace {

// "Well under": a copy is passed over when its owner receives at less than 1/kSlowFactor of the
// reader's rate. A factor near 1 would reorder chains over noise, each time at the cost of a read
// started again; 2 leaves alone what a pipeline absorbs (a link at half rate halves one hop).
constexpr double kSlowFactor = 2;
// Reordering a chain costs only the bytes the slower copy read early on, so a smaller gap is
// worth it there: 5/4 still keeps equal members (measured within a few percent) in place.
constexpr double kReorderFactor = 1.25;
// A read went at the reader's own pace when it took under 4/5 of the rate its source itself
// received the same version at, divided among the readers the source served: the source kept
// ahead of it.
constexpr double kBehindFraction = 0.8;
// A sixteenth of a read that took less than this (TransferProgress) is mostly the time to start
// it and to report it (a control-plane round trip of a millisecond or two): it is not timed. A
// fast read ends before moving it could pay; a slow member's sixteenth takes far longer (th-plan's
// 1 GB shards at 25 GB/s: 2.5 ms, timed at half their pace, made equal replicas look slow).
constexpr TimeMs kProgressTimedMinMs = 20;
// A sixteenth that went more than this many times faster than its shard's whole read under the
// same source could have is not believed (Hub::check_progress_claim): a second reader at the
// source may halve a read's pace on the way, but a claim of bytes that never arrived, or of a
// resumed prefix, is many times over (a whole shard claimed a sixteenth in: 16 x at least).
constexpr double kProgressClaimSlackFactor = 4;
// A slow copy gives its source away only in the first 1/kDisplaceWindowDivisor of its read (as
// long as its rate says the read takes), counted from its first source: it then reads the bytes
// it had again, from the faster reader, which soon passes it.
constexpr double kDisplaceWindowDivisor = 8;

std::uint64_t smallest_shard_bytes(const detail::Replica& replica) {
  TH_ASSERT(replica.layout != nullptr, "a replica that reads has a layout");
  std::uint64_t smallest = 0;
  for (const LayoutRef& shard : replica.layout->shards) {
    if (shard == nullptr || shard->total_bytes() == 0) continue;
    if (smallest == 0 || shard->total_bytes() < smallest) smallest = shard->total_bytes();
  }
  return smallest;
}

}  // namespace

void Hub::measure_shard_read(Transfer& transfer, std::uint32_t shard) {
  const Replica& replica = *transfer.reader->owner;
  TH_ASSERT(shard < replica.num_shards && transfer.started.test(shard), "a shard of this epoch's read");
  // A seed's read crosses datacenters over TCP, which says nothing of how fast the replica
  // receives here (record_receive_rate leaves it out too). Only a transfer's first source is
  // timed: at a later one a shard may go on from the bytes it verified (client resume), and its
  // whole shard over the time since would look far faster than it read. Nor is a patch read
  // (hub_patches.cpp): it moves a few percent of the shard, which would look many times faster
  // than any read of the bytes and make every other reader look slow (bench/run-delta: a rollout
  // passed over as "much slower" read a version's bytes instead of its patch).
  if (transfer.cross_dc || transfer.reader->kind != CopyKind::kPrimary || transfer.epoch != 1 || transfer.patch) return;
  const LayoutRef& layout = replica.layout->shards[shard];
  if (layout == nullptr || layout->total_bytes() == 0) return;
  const TimeMs elapsed_ms = std::max<TimeMs>(now_ms_ - transfer.assigned_ms, 1);
  const double rate = static_cast<double>(layout->total_bytes()) / static_cast<double>(elapsed_ms);
  transfer.slowest_bytes_per_ms =
      transfer.slowest_bytes_per_ms == 0 ? rate : std::min(transfer.slowest_bytes_per_ms, rate);
  replica.model->fastest_shard_read.record(transfer.reader->record->version, rate);
  TH_ASSERT(transfer.slowest_bytes_per_ms > 0 && transfer.slowest_bytes_per_ms <= rate);
}

void Hub::record_receive_rate(const Transfer& transfer) {
  const Copy& reader = *transfer.reader;
  Replica& replica = *reader.owner;
  // The read's progress reports timed a sixteenth of it; its end, where timed, times all of it,
  // as if they had said nothing (and where not, the sixteenth is all the hub knows of it, unless
  // its end showed the sixteenth claimed more than arrived: check_progress_claim).
  const std::optional<detail::ReceiveRate> before_progress = std::exchange(replica.rate_before_progress, std::nullopt);
  // Nor does a read with no shard finished under its last source.
  const bool timed = transfer.slowest_bytes_per_ms > 0 && transfer.source != nullptr && !transfer.cross_dc &&
                     reader.kind == CopyKind::kPrimary;
  if (before_progress && (timed || transfer.progress_refuted)) {
    set_receive_rate(replica, before_progress->bytes_per_ms, before_progress->exact, before_progress->provisional);
    replica.receive_rate.last_version = before_progress->last_version;
    replica.receive_rate.last_bytes_per_ms = before_progress->last_bytes_per_ms;
  }
  if (!timed) return;
  const Version version = reader.record->version;
  const double measured = transfer.slowest_bytes_per_ms;
  // A source that served other readers too (rollouts of its datacenter, a seed across) shared its
  // upload with them: the reader may have gone at its share, however fast the source received. It
  // set its own pace only if it went clearly slower than that share (the readers the source had
  // when this one joined, and those that joined since, counted for the whole read: a bound that
  // errs towards "not known"). Taking the share for the reader's pace made a reader behind a slow
  // rollout that also fed a seed across look twice as slow as the slow one, which went back ahead
  // of it (HubModel.ShardsAndSharedSourcesFollowMeasuredRates); ignoring every shared read left a
  // slow rollout behind a seeding source unknown for ever, and the readers behind it at its pace
  // (HubRates.ASlowReaderBehindASourceThatFeedsASeedIsStillFoundOut).
  const Copy& source = *transfer.source;
  const std::uint64_t shared_with = readers_shared_with(transfer);
  const detail::ReceiveRate& upstream = source.owner->receive_rate;
  const bool source_ahead = upstream.last_version == version && upstream.last_bytes_per_ms > 0 &&
                            measured * static_cast<double>(1 + shared_with) <
                                upstream.last_bytes_per_ms * kBehindFraction;
  const detail::ReceiveRate& rate = replica.receive_rate;
  const bool paced_by_reader = alone_at_complete(transfer) || source_ahead;
  if (paced_by_reader) {
    set_receive_rate(replica, measured, /*exact=*/true, /*provisional=*/false);  // what it can do now
  } else if (measured > rate.bytes_per_ms) {
    // It went at least this fast, behind its source. Faster than its exact rate by less than the
    // reordering factor is noise: the rate stays exact, at the faster figure (else one shared read
    // a little faster would make a replica known slow unknown again, and readers would go behind
    // it once more: the property test's HubModel.ChainsFollowMeasuredRates, with 10 % jitter).
    set_receive_rate(replica, measured, rate.exact && measured < rate.bytes_per_ms * kReorderFactor,
                     /*provisional=*/false);
  } else {
    replica.receive_rate.provisional = false;
  }
  replica.receive_rate.last_version = version;
  replica.receive_rate.last_bytes_per_ms = measured;
  replica.model->fastest_replica_read_by_dc[replica.dc].record(version, measured);
  TH_ASSERT(paced_by_reader ? rate.exact && rate.bytes_per_ms == measured : rate.bytes_per_ms >= measured);
}

std::uint64_t Hub::readers_shared_with(const Transfer& transfer) const {
  // A source that served other readers too (rollouts of its datacenter, a seed across) shared its
  // upload with them: the readers it had when this one joined, and those that joined since, counted
  // for the whole read (a bound that errs towards "not known").
  const Copy& source = *transfer.source;
  TH_ASSERT(source.readers_joined >= transfer.source_readers_joined);
  return transfer.source_readers_at_assign + (source.readers_joined - transfer.source_readers_joined);
}

bool Hub::alone_at_complete(const Transfer& transfer) const {
  // Alone at a complete copy of its own layout from the start (a CPU offload copy or pieces of
  // another layout set their own pace).
  TH_ASSERT(transfer.source != nullptr);
  return readers_shared_with(transfer) == 0 && transfer.source_was_complete &&
         transfer.source->kind == CopyKind::kPrimary && !transfer.reshard;
}

void Hub::set_receive_rate(Replica& replica, double bytes_per_ms, bool exact, bool provisional) {
  TH_ASSERT(bytes_per_ms > 0 || (bytes_per_ms == 0 && !exact && !provisional), "a rate measured, or none");
  detail::ReceiveRate& rate = replica.receive_rate;
  Model& model = *replica.model;
  std::multiset<double>& exact_rates = model.exact_rates_bytes_per_ms;
  if (rate.exact) {
    const auto found = exact_rates.find(rate.bytes_per_ms);
    TH_ASSERT(found != exact_rates.end(), "the model holds each exact rate of its replicas");
    exact_rates.erase(found);
  }
  rate.bytes_per_ms = bytes_per_ms;
  rate.exact = exact;
  rate.provisional = provisional;
  if (exact) exact_rates.insert(bytes_per_ms);
  if (exact_rates.size() >= 2) model.exact_rates_compared = true;
}

// ---- timing a read on the way (TransferProgress) ------------------------------------------------
//
// A replica never timed counts as fast, so the first version's chains form in the order the
// readers ask; if the first to ask is a slow member (bench/run-change "slow": one link at a quarter
// rate), everyone behind it waits for it to the end of the version: 3.15 x the ideal, where only a
// read's end timed replicas. Each reader shard reports once, a sixteenth into its read, how many
// bytes came from its source; the hub times the reader as at a read's end (the root, alone at a
// complete copy, exactly; a reader behind a copy still receiving, as a lower bound), and a reader
// behind a copy it may be faster than (Hub::slower, Hub::unexplored: the same tests as a chain's
// reorder) takes that copy's source there and then; the slow copy looks for another, at a chain's
// end. Both go on from the bytes they verified (client resume), so the move costs little, and
// each transfer gives its source away a bounded number of times. A replica timed by a read that
// ended keeps that rate: a sixteenth of a read says less.

void Hub::on_transfer_progress(Replica& replica, std::uint32_t shard, const TransferProgress& progress) {
  Model& model = *replica.model;
  const auto found = model.transfers.find(progress.transfer);
  if (found == model.transfers.end()) return;  // ended or cancelled: a late report
  Transfer& transfer = *found->second;
  Copy& reader = *transfer.reader;
  TH_ASSERT(shard < replica.num_shards);
  // This epoch's only, once per shard still reading: a report repeated, late or made up counts at
  // most once, and moves nothing the hub would not move for an honest one.
  if (reader.owner != &replica || progress.epoch != transfer.epoch || !transfer.started.test(shard) ||
      reader.ready.test(shard) || transfer.progress_heard.test(shard)) {
    return;
  }
  transfer.progress_heard.set(shard);
  ++stats_.progress_reports;
  // What measure_shard_read leaves out, for the same reasons.
  if (!settings_.rate_aware_sources || transfer.source == nullptr || transfer.cross_dc ||
      reader.kind != CopyKind::kPrimary || transfer.reshard || transfer.patch) {
    return;
  }
  const LayoutRef& layout = replica.layout->shards[shard];
  if (layout == nullptr || progress.bytes == 0 || progress.bytes > layout->total_bytes()) return;
  const TimeMs elapsed_ms = now_ms_ - transfer.assigned_ms;
  if (elapsed_ms < kProgressTimedMinMs) return;
  std::vector<double>& shard_rates = transfer.progress_bytes_per_ms;
  if (shard_rates.empty()) shard_rates.assign(replica.num_shards, 0.0);
  shard_rates[shard] = static_cast<double>(progress.bytes) / static_cast<double>(elapsed_ms);
  // The slowest shard heard sets the replica's rate, as at a read's end.
  double slowest = 0;
  bool every_shard_timed = true;
  for (std::uint32_t at = 0; at < replica.num_shards; ++at) {
    if (!transfer.started.test(at)) continue;
    if (shard_rates[at] == 0) every_shard_timed = false;
    if (shard_rates[at] > 0 && (slowest == 0 || shard_rates[at] < slowest)) slowest = shard_rates[at];
  }
  TH_ASSERT(slowest > 0);
  // The replica's own rate, if no read's end timed it: as at a read's end, the pace it set itself
  // (alone at a complete copy), or a lower bound that only raises what is known (a slow copy
  // timed alone, then read behind another's prefix, stays known slow; a little faster than its
  // exact rate is noise). A replica timed by a read that ended keeps that rate: a sixteenth of a
  // read says less (its shards' figures still say whether it kept the pace of the copy ahead).
  const detail::ReceiveRate& rate = replica.receive_rate;
  if (rate.bytes_per_ms == 0 || rate.provisional) {
    if (!replica.rate_before_progress) replica.rate_before_progress = rate;
    const bool alone = alone_at_complete(transfer);
    if (alone || slowest > rate.bytes_per_ms) {
      const bool exact = alone || (rate.exact && slowest < rate.bytes_per_ms * kReorderFactor);
      set_receive_rate(replica, slowest, exact, /*provisional=*/true);
    }
    replica.receive_rate.last_version = reader.record->version;
    replica.receive_rate.last_bytes_per_ms = slowest;
  }
  if (!every_shard_timed || pass_mid_read(transfer)) return;
  // Every shard of the reader is timed now: one behind it that was timed first may go ahead of it
  // (a copy of the transfers it serves, which a pass changes).
  const std::vector<TransferId> behind = reader.reading;
  for (TransferId id : behind) {
    const auto next = model.transfers.find(id);
    TH_ASSERT(next != model.transfers.end() && next->second->source == &reader, "a copy lists its readers");
    if (pass_mid_read(*next->second)) return;
  }
}

void Hub::check_progress_claim(Transfer& transfer, std::uint32_t shard) {
  // A shard that ended its read under this epoch's source moved at most its whole shard since the
  // source was given: a sixteenth that claimed a pace far above that (more bytes than arrived, or
  // counted from before a resume) is not believed, and what it set is undone at the read's end.
  // (Nothing else checks it: a read moved to another source is not timed at its end.) A liar can
  // still move one chain once a version, as an honest reader behind a slow root would be moved.
  const std::vector<double>& shard_rates = transfer.progress_bytes_per_ms;
  if (shard_rates.empty() || shard_rates[shard] == 0) return;
  const LayoutRef& layout = transfer.reader->owner->layout->shards[shard];
  TH_ASSERT(layout != nullptr, "a timed shard has a layout");
  const TimeMs elapsed_ms = std::max<TimeMs>(now_ms_ - transfer.assigned_ms, 1);
  const double at_most = static_cast<double>(layout->total_bytes()) / static_cast<double>(elapsed_ms);
  if (shard_rates[shard] > at_most * kProgressClaimSlackFactor) {
    if (!transfer.progress_refuted) ++stats_.progress_claims_refuted;
    transfer.progress_refuted = true;
  }
}

bool Hub::kept_pace(const Transfer& behind, const Transfer& ahead) const {
  // On every shard it reads, the reader went nearly as fast as the copy ahead of it received:
  // that copy set the pace on each, and the reader is slow on none. A replica receives on as many
  // NICs as it has shards, and one source serves all of them: a copy slow on one shard only,
  // moved to a chain's end, would wait there on each other shard for the slowest member's NIC
  // (th-plan --nic-jitter 0.99 with 8 shards a replica: the first version 80 -> 115 GPU-s when
  // any lower bound above the copy's rate moved it).
  const std::vector<double>& mine = behind.progress_bytes_per_ms;
  const std::vector<double>& theirs = ahead.progress_bytes_per_ms;
  if (mine.empty() || theirs.size() != mine.size()) return false;
  for (std::uint32_t shard = 0; shard < mine.size(); ++shard) {
    if (!behind.started.test(shard)) continue;
    if (mine[shard] == 0 || theirs[shard] == 0 || mine[shard] < theirs[shard] * kBehindFraction) return false;
  }
  return true;
}

bool Hub::pass_mid_read(Transfer& faster) {
  Copy* slow = faster.source;
  Copy& reader = *faster.reader;
  if (slow == nullptr || slow->state != CopyState::kActive || reader.owner->receive_rate.bytes_per_ms <= 0) {
    return false;
  }
  if (!slower(*slow->owner, *reader.owner, kReorderFactor, Risk::kReorder) && !unexplored(*slow->owner, *reader.owner)) {
    return false;
  }
  Transfer& behind = *slow->incoming;
  if (!displaceable(*slow, reader) || !early(*slow) || !kept_pace(faster, behind)) return false;
  Copy& source = *behind.source;
  ++behind.displacements;
  ++stats_.transfers_displaced;
  ++stats_.passed_mid_read;
  unhook(faster);
  unhook(behind);
  TH_ASSERT(has_slot(source, /*across=*/false), "the slow copy's place at its source is free");
  assign(faster, source);
  // The slow copy reads wherever settle() finds it a place: a chain's end, most often.
  orphans_.emplace_back(reader.owner->model, behind.id);
  TH_ASSERT(faster.source == &source && behind.source == nullptr);
  return true;
}

bool Hub::slower(const Replica& candidate, const Replica& reader, double factor, Risk risk) const {
  const detail::ReceiveRate& slow = candidate.receive_rate;
  const detail::ReceiveRate& fast = reader.receive_rate;
  // Only a candidate measured exactly is known slow (a lower bound may be far below what it can do).
  if (!settings_.rate_aware_sources || !slow.exact || slow.bytes_per_ms <= 0) return false;
  if (fast.exact) return slow.bytes_per_ms * factor < fast.bytes_per_ms;
  // A reader with a lower bound kept pace with its source (within kBehindFraction), and may be far
  // faster: it counts as faster than a copy it could have kept pace with, if that copy is slow
  // against the model's fastest shard read (a fleet that is alike keeps its order). So the readers
  // that spent a version behind a slow member go ahead of it the next, and show their own rate
  // (one step a version: a bubble sort over the versions). A reader never measured joins where it
  // would have.
  // "Slow" against the fastest this model's replicas have shown: the newest version's fastest
  // read, or a replica's own pace measured in any version (when every reader of the newest one
  // went behind a slow member, its fastest read is the slow member's pace).
  // Putting a reader ahead compares with the fastest shard read: a replica with a shard far
  // slower than that may be slow, and if it was not (the source set the pace), the reader, timed
  // alone at the source, says so. Passing over a copy for a busier source compares only with the
  // newest version's fastest replica read in the reader's datacenter: with NICs of unequal speed
  // nearly every replica has a shard far slower than the fastest shard anywhere, and replicas of
  // another datacenter read other sources (its seeder); measured against either, a reader passed
  // over its chain and shared the trainer whose slowest NIC set everyone's pace, halving it
  // (th-plan --nic-jitter 0.99 --fanout 2 --seed 5: 128.6 -> 237.4 GPU-s per version from the
  // second version on; with 2 remote rollouts and 2 joining, 6 rollouts, seed 15: 107 -> 210).
  const Model& model = *reader.model;
  double fastest = 0;
  if (risk == Risk::kReorder) {
    const std::multiset<double>& exact = model.exact_rates_bytes_per_ms;
    const double fastest_exact = exact.empty() ? 0.0 : *exact.rbegin();
    fastest = std::max(model.fastest_shard_read.bytes_per_ms, fastest_exact);
  } else if (const auto here = model.fastest_replica_read_by_dc.find(reader.dc);
             here != model.fastest_replica_read_by_dc.end()) {
    fastest = here->second.bytes_per_ms;
  }
  return fast.bytes_per_ms > 0 && slow.bytes_per_ms * kBehindFraction <= fast.bytes_per_ms &&
         slow.bytes_per_ms * kSlowFactor < fastest;
}

bool Hub::unexplored(const Replica& candidate, const Replica& reader) const {
  // Nothing to compare the candidate with: it is the model's only replica measured exactly, and
  // never had another beside it, so every other read the hub timed (lower bounds, the reader's
  // among them) may have gone at the candidate's pace, behind it (a slow member at the root of
  // the first version's chain: bench/run-change "slow"). Its readers go ahead of it, to be
  // measured themselves; the first to read alone gives the model a second exact rate, and from
  // then on for good either the fastest rate says the candidate is slow, or the two say the fleet
  // is alike and it keeps its order (sticky: a noisy read that turns an exact rate into a lower
  // bound, or a replica leaving, does not start it again: helper review, jitter of 1-10 % reordered
  // 16-41 % of alike fleets again). (The reader is not exact: the candidate is the only one. A
  // reader never measured joins where it would have, as everywhere. That an exact rate with no
  // other is the model's only one, check_invariants asserts: not here, on every hop of a walk.)
  return settings_.rate_aware_sources && candidate.receive_rate.exact && reader.receive_rate.bytes_per_ms > 0 &&
         !reader.model->exact_rates_compared;
}

bool Hub::much_slower(const Replica& candidate, const Replica& reader) const {
  return slower(candidate, reader, kSlowFactor, Risk::kShare);
}

bool Hub::slow_chain(const Copy& candidate, const Copy& reader) const {
  // A complete copy serves at its own pace, which its owner's receive rate does not say; a copy
  // still receiving passes its bytes on at most as fast as they reach it, through every copy on
  // its chain (the nearest kChainHopsWeighedMax weighed).
  const Copy* at = &candidate;
  for (std::size_t hops = 0; at->state == CopyState::kActive && hops < limits::kChainHopsWeighedMax; ++hops) {
    if (much_slower(*at->owner, *reader.owner)) return true;
    at = at->incoming->source;
    TH_ASSERT(at != nullptr, "an active copy reads");
  }
  return false;
}

bool Hub::movable(const Copy& slow) const {
  if (!settings_.rate_aware_sources || !settings_.pipeline) return false;
  if (slow.state != CopyState::kActive || slow.kind != CopyKind::kPrimary) return false;
  const Transfer* moving = slow.incoming;
  TH_ASSERT(moving != nullptr && moving->source != nullptr, "a receiving copy reads from a source");
  return !moving->cross_dc && !moving->reshard && moving->displacements < limits::kDisplacementsPerTransferMax &&
         moving->source->owner->layout == slow.owner->layout;
}

bool Hub::displaceable(const Copy& slow, const Copy& reader) const {
  // (Of the reader's layout too: movable() ties the slow copy's layout to its source's, below.)
  if (reader.kind != CopyKind::kPrimary || !movable(slow) || slow.owner == reader.owner ||
      slow.owner->dc != reader.owner->dc) {
    return false;
  }
  // The reader reads the slow copy's source in its place: of its layout, and not itself slow.
  // A source that drains, or that a reader failed, takes no new reader; one still receiving
  // serves on only as a pipeline of its own layout.
  const Copy& source = *slow.incoming->source;
  const bool takes_readers =
      !source.failed && !source.corrupt &&
      (source.state == CopyState::kComplete ||
       (source.state == CopyState::kActive && source.kind == CopyKind::kPrimary && !source.incoming->reshard));
  return takes_readers && source.owner != reader.owner && source.owner->layout == reader.owner->layout &&
         !much_slower(*source.owner, *reader.owner);
}

Hub::Copy* Hub::insertion_point(Copy& candidate, const Copy& reader) const {
  // The slower copy will read from the reader: it must be a source a reader may take.
  if (!settings_.rate_aware_sources || !settings_.pipeline || reader.readers > 0 || reader.failed ||
      reader.corrupt) {
    return nullptr;
  }
  // The copies nearest the candidate only: at fan-out 1 each new reader picks the end of the
  // chain, and a walk to the root would make a fleet's updates quadratic in its size.
  Copy* point = nullptr;
  Copy* at = &candidate;
  for (std::size_t hops = 0; at->state == CopyState::kActive && hops < limits::kChainHopsWeighedMax; ++hops) {
    if ((slower(*at->owner, *reader.owner, kReorderFactor, Risk::kReorder) || unexplored(*at->owner, *reader.owner)) &&
        displaceable(*at, reader) && early(*at)) {
      point = at;  // the last one found is nearest the root
    }
    at = at->incoming->source;
    TH_ASSERT(at != nullptr, "an active copy reads");
  }
  return point;
}

bool Hub::early(const Copy& slow) const {
  // However often it gave its source away, the slow copy reads again at most an eighth of what
  // its read takes, at the rate it is known to receive at.
  const double rate = slow.owner->receive_rate.bytes_per_ms;
  TH_ASSERT(rate > 0, "a slow copy's rate is known");
  const double expected_ms = static_cast<double>(smallest_shard_bytes(*slow.owner)) / rate;
  return static_cast<double>(now_ms_ - slow.incoming->first_assigned_ms) * kDisplaceWindowDivisor <= expected_ms;
}

void Hub::put_ahead(Transfer& faster, Transfer& slower) {
  Copy& fast_copy = *faster.reader;
  TH_ASSERT(faster.source == nullptr && fast_copy.readers == 0, "a reader still looking for its source");
  TH_ASSERT(slower.source != nullptr && slower.reader != &fast_copy);
  Copy& source = *slower.source;
  ++slower.displacements;
  ++stats_.transfers_displaced;
  unhook(faster);
  unhook(slower);
  assign(faster, source);
  // The slower copy reads behind the faster one, which serves no one yet: the chain keeps its
  // order, and no other copy takes the place (settle() could give it its old source back).
  TH_ASSERT(has_slot(fast_copy, /*across=*/false), "a reader that took a source serves no one yet");
  assign(slower, fast_copy);
  TH_ASSERT(faster.source == &source && slower.source == &fast_copy);
}

void Hub::unhook(Transfer& moving) {
  detach_source(moving);
  dequeue_waiting(moving);
  // It reads afresh from its next source (see reassign): verified shards stay.
  moving.reader->mismatched.reset();
  moving.reader->corrupt = false;
  set_state(*moving.reader, CopyState::kWaiting);
}

}  // namespace th
