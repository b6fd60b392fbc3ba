#include "tests/core/testkit/reference.h"

#include <algorithm>
#include <array>
#include <sstream>
#include <tuple>

#include "core/assert.h"
#include "core/limits.h"
#include "tests/core/testkit/driver.h"  // describe(Outcome)

namespace th::test {

namespace {

// Errors that end a call for one shard without being the replica's answer to it: the shard's
// replica went (evicted, closed, divergent), or the hub does not know the shard or its numbering.
// Which of them a shard may get is judged by judge_exit.
constexpr std::array kEndingErrors = {Errc::kReplicaEvicted, Errc::kDivergentCall, Errc::kReplicaClosed,
                                      Errc::kUnknownClient, Errc::kSequenceGap};

std::optional<Errc> ending_error(const Outcome& outcome) {
  const auto* error = std::get_if<Error>(&outcome);
  if (error == nullptr ||
      std::find(kEndingErrors.begin(), kEndingErrors.end(), error->code) == kEndingErrors.end()) {
    return std::nullopt;
  }
  return error->code;
}

bool exit_error(const Outcome& outcome) { return ending_error(outcome).has_value(); }

std::optional<Errc> error_of(const Outcome& outcome) {
  if (const auto* error = std::get_if<Error>(&outcome)) return error->code;
  return std::nullopt;
}

ShardSet all_shards(std::uint32_t count) {
  ShardSet set;
  for (std::uint32_t shard = 0; shard < count; ++shard) set.set(shard);
  return set;
}

}  // namespace

void Reference::fail(const std::string& what) const { throw AssertionFailure("reference: " + what); }

std::string Reference::key_of(const OpenRequest& open) const {
  return open.model + "/" + open.replica + "#" + std::to_string(open.incarnation);
}

std::string Reference::key_of(const Replica& replica) const {
  return replica.model + "/" + replica.name + "#" + std::to_string(replica.incarnation);
}

// The replica a client's open names, as the open describes it (made if the model has none).
Reference::Replica& Reference::replica_for(const Client& client) {
  Replica& replica = replicas_[client.key];
  const OpenRequest& open = client.open;
  replica.model = open.model;
  replica.name = open.replica;
  replica.incarnation = open.incarnation;
  replica.datacenter = open.datacenter;
  replica.role = open.role;
  replica.spot = open.spot;
  replica.num_shards = open.num_shards;
  return replica;
}

Reference::Replica* Reference::replica_of(ClientId client) {
  auto found = clients_.find(client);
  if (found == clients_.end()) return nullptr;
  auto replica = replicas_.find(found->second.key);
  return replica == replicas_.end() ? nullptr : &replica->second;
}

// ==== What the specification says, over the model's account ========================================

std::optional<Version> Reference::latest(const std::string& model) const {
  auto found = existing_.find(model);
  if (found == existing_.end() || found->second.empty()) return std::nullopt;
  return *found->second.rbegin();
}

bool Reference::model_unsure(const std::string& model) const { return unsure_models_.contains(model); }

// Whether some copy holds, or will hold without reading another, every byte of the version: a
// complete copy (even one a reader reported), one being published, one draining (it serves its
// readers to the end; `unsure`: it may be gone), an offload copy made or being made; but not a
// copy whose bytes failed readers' checksums twice (corrupt).
bool Reference::has_bytes(const std::string& model, Version version, bool* unsure) const {
  bool bytes = false;
  for (const auto& [key, replica] : replicas_) {
    if (replica.model != model || !present(replica)) continue;
    const bool primary = replica.version == version && !replica.corrupt &&
                         (replica.holding == Holding::kComplete || replica.holding == Holding::kPublishing ||
                          replica.holding == Holding::kDraining);
    // A draining copy (an unpublish, a close, an update's old copy) goes within the step once no
    // reader is left: whether it is still there the model does not follow.
    if (primary && (replica.drain_unsure || replica.holding == Holding::kDraining)) *unsure = true;
    const bool offload = (replica.offloads.contains(version) || replica.offloading.contains(version)) &&
                         !replica.corrupt_offloads.contains(version);
    // A closing replica's offload copies leave with it: the hub may already have stopped counting
    // them as a source.
    if (offload && replica.closing) *unsure = true;
    bytes = bytes || primary || offload;
  }
  return bytes;
}

bool Reference::held_anywhere(const std::string& model, Version version) const {
  for (const auto& [key, replica] : replicas_) {
    if (replica.model != model) continue;
    if ((replica.holding != Holding::kNone && replica.version == version) || replica.offloads.contains(version) ||
        replica.offloading.contains(version)) {
      return true;
    }
  }
  return false;
}

void Reference::strike(ShardSet& mismatched, bool& corrupt, std::uint32_t shard) {
  if (mismatched.test(shard)) corrupt = true;
  mismatched.set(shard);
}

void Reference::fresh_copy(Replica& replica) {
  replica.failed = false;
  replica.mismatched.reset();
  replica.corrupt = false;
}

Reference::Resolution Reference::resolve(const std::string& model, const Selector& selector) const {
  Resolution resolution;
  const auto found = existing_.find(model);
  if (found == existing_.end() || found->second.empty()) return resolution;  // wait
  const std::set<Version>& existing = found->second;
  Version target = selector.value;
  if (selector.kind == Selector::Kind::kLatest) {
    if (selector.value >= existing.size()) {
      resolution.kind = Resolution::Kind::kNotFound;
      return resolution;
    }
    auto it = existing.rbegin();
    std::advance(it, static_cast<std::ptrdiff_t>(selector.value));
    // The k-th newest, or the newest older one whose bytes some copy has.
    for (auto down = it; down != existing.rend(); ++down) {
      bool unsure = false;
      const bool bytes = has_bytes(model, *down, &unsure);
      resolution.version = *down;
      if (unsure) {
        resolution.kind = Resolution::Kind::kUnsure;
        return resolution;
      }
      if (bytes) {
        resolution.kind = Resolution::Kind::kGo;
        return resolution;
      }
    }
    resolution.version = *it;
    resolution.kind = Resolution::Kind::kUnavailable;
    return resolution;
  } else if (target > *existing.rbegin()) {
    return resolution;  // wait
  }
  resolution.version = target;
  bool unsure = false;
  const bool bytes = has_bytes(model, target, &unsure);
  if (!existing.contains(target)) {
    // Never complete here: only a copy being published can still make it.
    resolution.kind = bytes ? Resolution::Kind::kGo : Resolution::Kind::kNotFound;
    return resolution;
  }
  resolution.kind = unsure ? Resolution::Kind::kUnsure
                           : bytes ? Resolution::Kind::kGo : Resolution::Kind::kUnavailable;
  return resolution;
}

// Smart skipping: the reader's datacenter has no complete, healthy copy of the version, and one
// of its replicas seeds it (reads it from another datacenter now, healthy).
bool Reference::smart_skip(const Replica& reader, Version version, bool* unsure) const {
  bool complete_here = false;
  bool seeding = false;
  for (const auto& [key, replica] : replicas_) {
    if (replica.model != reader.model || replica.datacenter != reader.datacenter ||
        !present(replica)) {
      continue;
    }
    if (replica.drain_unsure || replica.resuming) *unsure = true;
    if (replica.holding == Holding::kComplete && replica.version == version && !replica.failed) {
      complete_here = true;
    }
    if (replica.offloads.contains(version) && !replica.failed_offloads.contains(version)) {
      // Unless the hub may be releasing it (it then takes no new reader).
      if (offload_may_go(reader.model, version)) {
        *unsure = true;
      } else {
        complete_here = true;
      }
    }
    if (replica.holding == Holding::kReceiving && replica.version == version && !replica.failed) {
      for (const auto& [transfer_key, transfer] : transfers_) {
        if (transfer.reader == key && transfer.attached && transfer.source_dc != replica.datacenter) {
          seeding = true;
        }
      }
    }
  }
  return !complete_here && seeding;
}

// Whether a rule keeps `version`: pinned by an open shard, or among the k+1 newest versions that
// exist for a shard that keeps the latest k.
bool Reference::retained(const std::string& model, Version version) const {
  const auto found = existing_.find(model);
  std::size_t newer = 0;
  if (found != existing_.end()) {
    newer = static_cast<std::size_t>(std::distance(found->second.upper_bound(version), found->second.end()));
  }
  for (const auto& [id, client] : clients_) {
    if (!client.bound || client.open.model != model) continue;
    const Retention& rule = client.open.retention;
    if (std::find(rule.pinned.begin(), rule.pinned.end(), version) != rule.pinned.end()) return true;
    if (rule.keep_latest && newer <= *rule.keep_latest) return true;
  }
  return false;
}

// An offload copy the hub may have begun to release: another safe copy of its version exists, or
// the version left retention.
bool Reference::offload_may_go(const std::string& model, Version version) const {
  std::size_t offloads = 0;
  for (const auto& [key, replica] : replicas_) {
    if (replica.model != model || !present(replica)) continue;
    if (!replica.spot && replica.holding == Holding::kComplete && replica.version == version &&
        !replica.failed) {
      return true;
    }
    offloads += replica.offloads.contains(version) && !replica.failed_offloads.contains(version);
  }
  return offloads > 1 || !retained(model, version);
}

std::optional<bool> Reference::predicate_holds(const std::string& model,
                                               const WaitPredicate& predicate,
                                               std::optional<Errc>* error) const {
  const std::optional<Version> newest = latest(model);
  switch (predicate.kind) {
    case WaitPredicate::Kind::kVersionAtLeast:
      return newest && *newest >= predicate.version;
    case WaitPredicate::Kind::kReplicasHold: {
      std::uint32_t holders = 0;
      bool unsure = false;
      for (const auto& [key, replica] : replicas_) {
        if (replica.model != model || !present(replica)) continue;
        if (replica.drain_unsure || replica.resuming) unsure = true;
        holders += replica.holding == Holding::kComplete && replica.version == predicate.version &&
                   !replica.failed;
      }
      if (unsure) return std::nullopt;
      if (holders >= predicate.replicas_min) return true;
      const auto versions = existing_.find(model);
      const bool existed = versions != existing_.end() && versions->second.contains(predicate.version);
      bool bytes_unsure = false;
      if (existed && !has_bytes(model, predicate.version, &bytes_unsure)) {
        if (bytes_unsure) return std::nullopt;
        *error = Errc::kVersionUnavailable;
      }
      return false;
    }
    case WaitPredicate::Kind::kRoleHolds: {
      bool any = false;
      for (const auto& [key, replica] : replicas_) {
        if (replica.model != model || replica.role != predicate.role || replica.closing ||
            !present(replica)) {
          continue;
        }
        if (replica.drain_unsure || replica.resuming) return std::nullopt;
        if (replica.holding != Holding::kComplete || replica.version < predicate.version) return false;
        any = true;
      }
      return any;
    }
  }
  return std::nullopt;
}

// ==== Inputs =======================================================================================

void Reference::before_step(const Input& input, TimeMs now_ms) {
  corrupt_now_.clear();
  if (std::holds_alternative<Tick>(input)) {
    // A model with no replica for the grace ends at this tick (before anything else of it).
    for (auto it = idle_since_.begin(); it != idle_since_.end();) {
      if (now_ms - it->second < settings_.model_grace_ms) {
        ++it;
        continue;
      }
      existing_.erase(it->first);
      heard_.erase(it->first);
      ++seen_.lives_ended;
      it = idle_since_.erase(it);
    }
  }
  if (const auto* request = std::get_if<Request>(&input)) {
    if (const auto* open = std::get_if<OpenRequest>(&request->body)) {
      on_open(*request, *open, now_ms);
    } else {
      on_call(*request, now_ms);
    }
  } else if (const auto* report = std::get_if<Report>(&input)) {
    // Heard of (also while its open waits in a failover barrier, where the hub has it already).
    if (auto client = clients_.find(report->client); client != clients_.end()) {
      client->second.last_seen_ms = now_ms;
    }
    on_report(*report);
  }
}

void Reference::on_open(const Request& request, const OpenRequest& open, TimeMs now_ms) {
  if (auto known = clients_.find(request.client);
      known != clients_.end() && (request.session < known->second.session ||
                                  (request.session == known->second.session &&
                                   request.seq == known->second.open_seq && known->second.bound))) {
    // An open of an earlier session (refused), or the same open again: it keeps the shard alive.
    if (request.session == known->second.session) known->second.last_seen_ms = now_ms;
    return;
  }
  Client& client = clients_[request.client];
  if (request.session != client.session && !client.key.empty()) {
    client.previous_key = client.key;
    client.previous_session = client.session;
  }
  client.key = key_of(open);
  client.open = open;
  client.open.resume.reset();
  client.shard = open.shard;
  client.session = request.session;
  client.open_seq = request.seq;
  client.bound = false;
  client.last_seen_ms = now_ms;
  client.resume = open.resume;
  client.waiting.reset();
  if (open.resume) {
    // The hub may keep a record of what any shard announces (a partial offload included): such a
    // version is one the model may know, in the order rule.
    std::set<Version>& heard = heard_[open.model];
    if (open.resume->primary) heard.insert(open.resume->primary->version);
    for (const HeldCopy& held : open.resume->offloads) heard.insert(held.version);
  }
  Replica& replica = replica_for(client);
  // A resume never joins a replica that is live (some shard in, no barrier): the hub refuses it,
  // or, for a shard that made no call and holds nothing while its peers are not all in yet, lets
  // it join as if it opened afresh.
  if (client.resume && !replica.bound.empty() && !replica.resuming) client.resume.reset();
  if (client.resume) {
    replica.resuming = true;
    unsure_models_.insert(open.model);
  }
}

namespace {

// Whether a request's layout (if it has one) is one the testkit gives `shard` of a replica of
// `num_shards` shards: its own tensors, or its sliced ones.
bool testkit_layout(const RequestBody& body, std::uint32_t shard, std::uint32_t num_shards) {
  LayoutRef layout;
  if (const auto* publish = std::get_if<PublishRequest>(&body)) layout = publish->layout;
  if (const auto* replicate = std::get_if<ReplicateRequest>(&body)) layout = replicate->layout;
  if (const auto* update = std::get_if<UpdateRequest>(&body)) layout = update->layout;
  if (layout == nullptr || layout->tensors() == layout_for(shard)->tensors()) return true;
  return num_shards >= 1 && num_shards <= kSlicedShardsMax && shard < num_shards &&
         layout->tensors() == sliced_layout_for(shard, num_shards)->tensors();
}

}  // namespace

void Reference::on_call(const Request& request, TimeMs now_ms) {
  auto found = clients_.find(request.client);
  if (found == clients_.end()) return;
  Client& client = found->second;
  client.last_seen_ms = now_ms;
  if (!client.bound) return;  // answered "unknown client", or not let in yet
  if (request.session != client.session || request.seq != client.last_seq + 1) return;
  Replica* replica = replica_of(request.client);
  if (replica == nullptr) return;
  if (!replica->whole) {
    client.waiting = request;  // taken once every shard is in (a retransmission replaces it)
    return;
  }
  client.last_seq = request.seq;
  auto [entry, created] = replica->calls.try_emplace(request.seq);
  Call& call = entry->second;
  if (created) {
    call.body = request.body;
    call.op = op_key(request.body);
    call.arrived_ms = now_ms;
    call.exact = !model_unsure(replica->model) && !replica->drain_unsure;
    call.seeded = request.seq <= replica->resumed_at;
    if (!call.seeded) arrive(*replica, call, client.shard, now_ms);
  }
  call.arrived.set(client.shard);
  call.ops[client.shard] = op_key(request.body);
  if (testkit_layout(request.body, client.shard, replica->num_shards)) {
    call.layout_good.set(client.shard);
  } else {
    call.layout_bad = true;
  }
}

// The first shard of a call arrived: what the hub decides now, it decides from what is now.
void Reference::arrive(Replica& replica, Call& call, std::uint32_t shard, TimeMs now_ms) {
  (void)shard;
  const std::optional<Version> held =
      replica.holding == Holding::kComplete ? std::optional(replica.version) : std::nullopt;
  call.held_before = held;
  if (replica.closing && call.op.kind != OpKind::kClose) {
    call.decided = make_error(Errc::kReplicaClosed, "");
    return;
  }
  std::visit(
      [&](const auto& body) {
        using T = std::decay_t<decltype(body)>;
        if constexpr (std::is_same_v<T, PublishRequest>) {
          // Order: below latest, only a version the model knows. It surely knows one that exists
          // within the window it remembers; it may know one any replica holds or publishes.
          const std::optional<Version> newest = latest(replica.model);
          const bool below = newest && body.version < *newest;
          const auto versions = existing_.find(replica.model);
          const bool exists = versions != existing_.end() && versions->second.contains(body.version);
          // (exists: version <= newest, the newest that exists.)
          const bool surely_known = exists && newest.value_or(0) - body.version <= limits::kForgottenVersionsWindow;
          const auto heard = heard_.find(replica.model);
          const bool maybe_known = exists || held_anywhere(replica.model, body.version) ||
                                   (heard != heard_.end() && heard->second.contains(body.version));
          call.may_stale = !call.exact || (below && !surely_known);
          if (replica.holding != Holding::kNone) {
            call.decided = make_error(Errc::kAlreadyHolding, "");
          } else if (body.version > limits::kVersionMax) {
            call.decided = make_error(Errc::kInvalidArgument, "");
          } else if (call.exact && below && !maybe_known) {
            call.decided = make_error(Errc::kStaleVersion, "");
          } else {
            replica.holding = Holding::kPublishing;
            replica.version = body.version;
            fresh_copy(replica);
          }
        } else if constexpr (std::is_same_v<T, UnpublishRequest>) {
          if (replica.holding != Holding::kComplete) {
            call.decided = make_error(Errc::kNotPublished, "");
          } else {
            replica.holding = Holding::kDraining;
            replica.drain_since_ms = now_ms;
          }
        } else if constexpr (std::is_same_v<T, ReplicateRequest>) {
          if (body.timeout_ms < 0 || body.timeout_ms > limits::kDeadlineMsMax) {
            call.decided = make_error(Errc::kInvalidArgument, "");
          } else if (replica.holding != Holding::kNone) {
            call.decided = make_error(Errc::kAlreadyHolding, "");
          } else {
            const Resolution resolution = resolve(replica.model, body.selector);
            switch (resolution.kind) {
              case Resolution::Kind::kNotFound:
                call.decided = make_error(Errc::kVersionNotFound, "");
                if (resolution.version != 0 || body.selector.kind == Selector::Kind::kAbsolute) {
                  ++seen_.skipped_versions;
                }
                break;
              case Resolution::Kind::kUnavailable:
                call.decided = make_error(Errc::kVersionUnavailable, "");
                break;
              case Resolution::Kind::kUnsure:
                call.exact = false;
                break;
              case Resolution::Kind::kGo:
                call.allowed.insert(resolution.version);
                replica.holding = Holding::kReceiving;
                replica.version = resolution.version;
                fresh_copy(replica);
                break;
              case Resolution::Kind::kWait:
                break;  // resolved later (see end_of_step)
            }
          }
        } else if constexpr (std::is_same_v<T, UpdateRequest>) {
          if (replica.holding == Holding::kPublishing || replica.holding == Holding::kReceiving ||
              replica.holding == Holding::kDraining) {
            call.decided = make_error(Errc::kAlreadyHolding, "");
            return;
          }
          const Resolution resolution = resolve(replica.model, body.selector);
          bool unsure = resolution.kind == Resolution::Kind::kUnsure;
          if (resolution.kind == Resolution::Kind::kNotFound) {
            call.decided = make_error(Errc::kVersionNotFound, "");
          } else if (resolution.kind == Resolution::Kind::kUnavailable) {
            call.decided = make_error(Errc::kVersionUnavailable, "");
          } else if (resolution.kind == Resolution::Kind::kWait ||
                     (resolution.kind == Resolution::Kind::kGo && held && resolution.version <= *held)) {
            call.decided = UpdateOk{UpdateStatus::kNoNewerVersion, held, {}};
          } else if (resolution.kind == Resolution::Kind::kGo && settings_.smart_skipping &&
                     smart_skip(replica, resolution.version, &unsure) && !unsure) {
            call.decided = UpdateOk{UpdateStatus::kNotYet, held, {}};
            ++seen_.not_yet;
          } else if (resolution.kind == Resolution::Kind::kGo && !unsure) {
            call.moves = true;
            call.allowed.insert(resolution.version);
            if (held) {
              replica.holding = Holding::kDraining;
              replica.drain_unsure = true;  // until it reads: the old copy drains, then goes
            } else {
              replica.holding = Holding::kReceiving;
              replica.version = resolution.version;
              fresh_copy(replica);
            }
          }
          if (unsure) {
            // The model cannot tell whether it moves: the held copy may be draining.
            call.exact = false;
            if (held) replica.drain_unsure = true;
          }
        } else if constexpr (std::is_same_v<T, ListRequest>) {
          // Answered at once; judged when answered (the listing reflects this very moment).
        } else if constexpr (std::is_same_v<T, WaitRequest>) {
          if (body.timeout_ms < 0 || body.timeout_ms > limits::kDeadlineMsMax ||
              body.predicate.replicas_min == 0 || !valid_name(body.predicate.role, true)) {
            call.decided = make_error(Errc::kInvalidArgument, "");
          }
        } else if constexpr (std::is_same_v<T, CloseRequest>) {
          // Its copies drain (no longer complete). A close is never refused.
          replica.closing = true;
          if (replica.holding == Holding::kComplete) {
            replica.holding = Holding::kDraining;
            replica.drain_since_ms = now_ms;
          }
        }
      },
      call.body);
}

void Reference::on_report(const Report& report) {
  auto client = clients_.find(report.client);
  if (client == clients_.end() || !client->second.bound) return;
  const std::string& key = client->second.key;
  const std::uint32_t shard = client->second.shard;
  Replica* replica = replica_of(report.client);
  if (replica == nullptr) return;
  if (const auto* cancel = std::get_if<CancelCall>(&report.body)) {
    // Only a call of the current session that this shard made, that waits, that no shard had an
    // answer to before a failover, and that is unanswered.
    if (report.session != client->second.session) return;
    auto call = replica->calls.find(cancel->seq);
    if (call == replica->calls.end() || call->second.answer || call->second.seeded ||
        !call->second.arrived.test(shard)) {
      return;
    }
    const OpKind kind = call->second.op.kind;
    if (kind == OpKind::kReplicate || kind == OpKind::kUpdate || kind == OpKind::kWait) {
      call->second.cancelled = true;
      ++seen_.cancels;
    }
    return;
  }
  if (const auto* done = std::get_if<TransferDone>(&report.body)) {
    for (auto& [transfer_key, transfer] : transfers_) {
      if (transfer.reader != key || transfer.id != done->transfer || done->epoch == 0 ||
          done->epoch > transfer.epoch) {
        continue;
      }
      // A shard done in the current epoch counts only while the transfer has its source (the hub
      // forgets who read what when it detaches one); done in an earlier epoch, it counts once
      // the transfer reads from a new source.
      if (done->epoch == transfer.epoch && (!transfer.started.test(shard) || !transfer.attached)) continue;
      // Read well from the current source: its bytes of this shard are good after all. (A read
      // across layouts took pieces of every shard and vouches for none in particular.)
      if (done->epoch == transfer.epoch && !transfer.done.test(shard) && !transfer.reshard) {
        if (auto source = replicas_.find(transfer.source); source != replicas_.end()) {
          if (transfer.kind == CopyKind::kOffload) {
            source->second.offload_mismatched[transfer.version].reset(shard);
          } else if (source->second.version == transfer.version) {
            source->second.mismatched.reset(shard);
          }
        }
      }
      transfer.done.set(shard);
      if (auto call = replica->calls.find(transfer.call); call != replica->calls.end()) {
        call->second.done.set(shard);
      }
    }
  } else if (const auto* failed = std::get_if<TransferFailed>(&report.body)) {
    for (auto& [transfer_key, transfer] : transfers_) {
      if (transfer.reader != key || transfer.id != failed->transfer || transfer.epoch != failed->epoch ||
          !transfer.attached || !transfer.started.test(shard) || transfer.done.test(shard)) {
        continue;
      }
      // The hub no longer trusts the source copy: it serves only as a last resort; bytes that fail
      // their checksums twice for a shard make it no source at all.
      auto source = replicas_.find(transfer.source);
      if (source == replicas_.end()) continue;
      const bool mismatch = failed->reason == ReadFailure::kChecksumMismatch;
      Replica& from = source->second;
      auto strike_copy = [&](ShardSet& mismatched, bool& corrupt) {
        if (!transfer.reshard) {
          strike(mismatched, corrupt, shard);
          return;
        }
        // Read across layouts, the bytes of some shard of the source failed; which one, the
        // reader does not say: every shard is suspect, and a second such failure before a good
        // read of each condemns the copy (README "Layouts").
        if (mismatched.any()) corrupt = true;
        for (std::uint32_t source_shard = 0; source_shard < from.num_shards; ++source_shard) {
          mismatched.set(source_shard);
        }
      };
      const bool at_fault = !transfer.reshard;  // a read across layouts cannot say whose bytes
      if (transfer.kind == CopyKind::kOffload) {
        from.failed_offloads.insert(transfer.version);
        if (mismatch) {
          bool corrupt = from.corrupt_offloads.contains(transfer.version);
          const bool was = corrupt;
          strike_copy(from.offload_mismatched[transfer.version], corrupt);
          if (corrupt) from.corrupt_offloads.insert(transfer.version);
          if (corrupt && !was && at_fault && from.offloads.contains(transfer.version)) {
            corrupt_now_.push_back({transfer.source, transfer.version, true, shard, true});
          }
        }
      } else if (from.version == transfer.version) {
        from.failed = true;
        const bool was = from.corrupt;
        if (mismatch) strike_copy(from.mismatched, from.corrupt);
        // Told only of a whole copy (a receiving one passes on its source's bytes), and not of
        // a read across layouts (which cannot say whose bytes failed). The model cannot always
        // tell a draining copy's end: told or not, both are right there.
        const bool whole = from.holding == Holding::kComplete || from.holding == Holding::kDraining;
        if (from.corrupt && !was && at_fault && whole) {
          corrupt_now_.push_back({transfer.source, transfer.version, false, shard,
                                  from.holding == Holding::kComplete && !from.drain_unsure});
        }
      }
    }
  } else if (const auto* offloaded = std::get_if<OffloadDone>(&report.body)) {
    // An offload copy is complete once every shard reported the copy the hub asked for.
    auto making = replica->offloading.find(offloaded->version);
    if (making == replica->offloading.end() || making->second != offloaded->copy) return;
    ShardSet& reported = replica->offload_reported[offloaded->version];
    reported.set(shard);
    if (reported == all_shards(replica->num_shards)) {
      replica->offloads[offloaded->version] = offloaded->copy;
      replica->failed_offloads.erase(offloaded->version);
      replica->offload_mismatched.erase(offloaded->version);
      replica->corrupt_offloads.erase(offloaded->version);
      replica->offloading.erase(making);
      replica->offload_reported.erase(offloaded->version);
    }
  }
}

// ==== Effects ======================================================================================

void Reference::after_step(const Input& input, const Effects& effects, TimeMs now_ms) {
  // The replicas the hub ends in this step: their shards' calls may end without an answer.
  evicted_now_.clear();
  released_now_.clear();
  for (const Effect& effect : effects) {
    const auto* evicted = std::get_if<Evicted>(&effect.message);
    auto client = clients_.find(effect.client);
    if (evicted != nullptr && evicted->reason != Errc::kUnknownClient && client != clients_.end() &&
        client->second.bound && effect.session == client->second.session) {
      evicted_now_.emplace(client->second.key, evicted->reason);
    }
  }
  // The replicas a call of which is answered in this step (a reader whose call ends stops reading).
  std::set<std::string> answered_now;
  for (const Effect& effect : effects) {
    const auto client = clients_.find(effect.client);
    if (std::holds_alternative<Reply>(effect.message) && client != clients_.end() && client->second.bound) {
      answered_now.insert(client->second.key);
    }
  }
  // Effects in the order the hub made them: an eviction takes a replica's copies before the
  // answers that follow from it (a reader told the version is unavailable).
  for (const Effect& effect : effects) {
    if (auto client = clients_.find(effect.client);
        client != clients_.end() && effect.session != client->second.session) {
      // About the binding of an earlier session (the client opened anew since): only an
      // eviction of that binding tells the model anything.
      if (std::holds_alternative<Evicted>(effect.message) &&
          effect.session == client->second.previous_session) {
        evict(client->second.previous_key);
      }
      continue;
    }
    std::visit(
        [&](const auto& message) {
          using T = std::decay_t<decltype(message)>;
          if constexpr (std::is_same_v<T, Reply>) {
            if (message.to_open) {
              on_open_answer(effect.client, message, now_ms);
            } else {
              on_reply(effect.client, message, now_ms);
            }
          } else if constexpr (std::is_same_v<T, StartRead>) {
            on_start_read(effect.client, message);
          } else if constexpr (std::is_same_v<T, StopServing>) {
            const auto client = clients_.find(effect.client);
            if (client == clients_.end()) return;
            for (auto& [key, transfer] : transfers_) {
              if (transfer.id == message.transfer && transfer.epoch == message.epoch &&
                  transfer.source == client->second.key) {
                if (std::holds_alternative<Tick>(input)) judge_revoke(transfer, answered_now, now_ms);
                transfer.stopped.set(client->second.shard);
                // Read across layouts, every source shard serves every reader shard until the last
                // is done: one told to stop means the source is gone (its shards are not the
                // reader's, so `stopped` cannot tell it by shard).
                if (transfer.reshard) transfer.attached = false;
              }
            }
          } else if constexpr (std::is_same_v<T, Offload>) {
            Replica* replica = replica_of(effect.client);
            if (replica == nullptr) return;
            if (replica->offloads.contains(message.version)) {
              replica->offloads[message.version] = message.copy;  // the new server's id for it
            } else {
              if (replica->offloading[message.version] != message.copy) {
                replica->offload_reported.erase(message.version);
              }
              replica->offloading[message.version] = message.copy;
            }
          } else if constexpr (std::is_same_v<T, ReleaseOffload>) {
            if (Replica* replica = replica_of(effect.client)) on_release(*replica, effect.client, message, input);
          } else if constexpr (std::is_same_v<T, Evicted>) {
            auto client = clients_.find(effect.client);
            if (client == clients_.end()) return;
            if (message.reason == Errc::kUnknownClient) {
              // Told to a client the hub does not know: one the model must not think bound.
              if (client->second.bound) {
                fail("the hub does not know shard " + std::to_string(client->second.shard) + " of " +
                     client->second.key + ", which it let in and never evicted");
              }
              return;
            }
            evict(client->second.key);
          } else if constexpr (std::is_same_v<T, ServeRead>) {
            // The source's half of a grant: the reader's StartRead names the same source, and the
            // model follows the read from there (on_start_read, judge_load).
          } else if constexpr (std::is_same_v<T, CopyCorrupt>) {
            // Judged over the whole step, once every report is in (judge_corrupt_notices).
          } else {
            static_assert(!std::is_same_v<T, T>, "a new Message: say what the reference model expects of it");
          }
        },
        effect.message);
  }
  judge_corrupt_notices(effects);
  end_of_step(input, effects, now_ms);
}

// Issue 33, friction 1: the owner of a copy readers found corrupt is told, in the step that
// condemned it, and nobody else is: an application told wrongly hunts for a writer that is not
// there, one never told writes on while every reader fails.
void Reference::judge_corrupt_notices(const Effects& effects) {
  std::set<std::pair<std::string, std::uint32_t>> told;  // (replica key, shard)
  for (const Effect& effect : effects) {
    const auto* notice = std::get_if<CopyCorrupt>(&effect.message);
    if (notice == nullptr) continue;
    const auto client = clients_.find(effect.client);
    if (client == clients_.end() || !client->second.bound || effect.session != client->second.session) continue;
    const std::string& key = client->second.key;
    const std::uint32_t shard = client->second.shard;
    const bool offload = notice->offload_copy != 0;
    const bool found = std::any_of(corrupt_now_.begin(), corrupt_now_.end(), [&](const CorruptNews& news) {
      return news.key == key && news.version == notice->version && news.offload == offload &&
             news.shard == shard;
    });
    if (!found) {
      fail("the hub told shard " + std::to_string(shard) + " of " + key + " that readers found its " +
           (offload ? "offload copy" : "copy") + " of version " + std::to_string(notice->version) +
           " corrupt, which no two failed checksums of this step's reports make it");
    }
    told.emplace(key, shard);
    ++seen_.corrupt_notices;
  }
  for (const CorruptNews& news : corrupt_now_) {
    const auto replica = replicas_.find(news.key);
    if (!news.required || replica == replicas_.end() || model_unsure(replica->second.model)) continue;
    for (const auto& [id, client] : clients_) {
      if (!client.bound || client.key != news.key || client.shard != news.shard) continue;
      if (!told.contains({news.key, client.shard})) {
        fail("readers found the " + std::string(news.offload ? "offload copy" : "copy") + " of version " +
             std::to_string(news.version) + " of " + news.key + " corrupt (its checksums failed twice), and its shard " +
             std::to_string(client.shard) + " was not told");
      }
    }
  }
}

// Every ReleaseOffload names a copy the hub made (or was told of at a resume) and releases once;
// told to every shard of the replica, it is one release.
void Reference::on_release(Replica& replica, ClientId client_id, const ReleaseOffload& release,
                           const Input& input) {
  const std::string key = key_of(replica);
  if (!released_now_.emplace(key, release.copy).second) return;
  const Version version = release.version;
  bool counted = false;
  if (auto found = replica.offloads.find(version); found != replica.offloads.end() && found->second == release.copy) {
    replica.offloads.erase(found);
    replica.failed_offloads.erase(version);
    replica.offload_mismatched.erase(version);
    replica.corrupt_offloads.erase(version);
    counted = true;
  }
  if (auto found = replica.offloading.find(version); found != replica.offloading.end() && found->second == release.copy) {
    replica.offloading.erase(found);
    counted = true;
  }
  if (counted) {
    released_.insert(release.copy);
    return;
  }
  // Not a copy the hub counts for the replica: the answer to a shard that reported a copy it no
  // longer counts (or never did), or a copy a shard announced at a resume that cannot be used.
  const auto* report = std::get_if<Report>(&input);
  const auto* reported = report != nullptr && report->client == client_id ? std::get_if<OffloadDone>(&report->body)
                                                                          : nullptr;
  if (reported != nullptr && reported->version == version && reported->copy == release.copy) return;
  for (const auto& [id, client] : clients_) {
    if (client.key != key || !client.resume) continue;
    for (const HeldCopy& held : client.resume->offloads) {
      if (held.version == version && held.copy == release.copy) return;
    }
  }
  if (model_unsure(replica.model)) return;
  fail("offloads: " + replica.name + " is told to free offload copy " + std::to_string(release.copy) +
       " of version " + std::to_string(version) +
       (released_.contains(release.copy) ? ", which it was told to free before (released twice)"
                                         : ", which the hub never made"));
}

bool Reference::offload_needed(const Replica& replica, Version version) const {
  if (!retained(replica.model, version)) return false;
  for (const auto& [key, other] : replicas_) {
    if (other.model != replica.model || !present(other)) continue;
    if (!other.spot && other.holding == Holding::kComplete && other.version == version && !other.failed &&
        !other.corrupt) {
      return false;
    }
    if (&other != &replica && other.offloads.contains(version) && !other.failed_offloads.contains(version)) {
      return false;
    }
  }
  return true;
}

void Reference::on_open_answer(ClientId client_id, const Reply& reply, TimeMs now_ms) {
  auto found = clients_.find(client_id);
  if (found == clients_.end() || reply.seq != found->second.open_seq) return;
  Client& client = found->second;
  if (!std::holds_alternative<OpenOk>(reply.outcome)) {
    // A refused open: a replica the model made up for it, with nobody in it, is not there.
    auto replica = replicas_.find(client.key);
    if (replica != replicas_.end() && replica->second.bound.empty() &&
        std::none_of(clients_.begin(), clients_.end(), [&](const auto& entry) {
          return entry.first != found->first && entry.second.key == client.key && !entry.second.bound;
        })) {
      replicas_.erase(replica);
    }
    client.key.clear();
    return;
  }
  if (client.bound) return;
  // Closing ends a replica (§5.3): a shard that resumes saying its last call was answered "replica
  // closed" is not let back into it, on this server or any later one; otherwise the replica its
  // application was told had closed lives on, holding and serving what it held.
  if (client.resume && client.resume->last_txn) {
    const auto* told = std::get_if<Error>(&client.resume->last_txn->outcome);
    if (told != nullptr && told->code == Errc::kReplicaClosed) {
      fail("shard " + std::to_string(client.shard) + " of " + client.key + " resumes saying call " +
           std::to_string(client.resume->last_txn->seq) +
           " was answered 'replica closed', and is let back in (OpenOk)");
    }
  }
  client.bound = true;
  client.last_seq = client.open_seq;
  Replica& replica = replica_for(client);
  replica.bound[client.shard] = client_id;
  // OpenOk tells latest as the hub knows it; for a fresh open of a model the model follows, it
  // must be what the model says.
  const auto& ok = std::get<OpenOk>(reply.outcome);
  if (!client.resume && !model_unsure(replica.model) && ok.latest != latest(replica.model)) {
    fail("OpenOk tells latest " + (ok.latest ? std::to_string(*ok.latest) : "none") + ", not " +
         (latest(replica.model) ? std::to_string(*latest(replica.model)) : "none"));
  }
  if (!replica.resuming) {
    if (!replica.whole && replica.bound.size() == replica.num_shards) become_whole(replica, now_ms);
    return;
  }
  // The barrier let every shard in (this one may have opened afresh and joined it).
  replica.whole = true;
  // A replica back after a failover: once its shards are let in, what every shard announced is
  // what it holds; an announcement of only some shards (a call in flight) the model does not
  // follow.
  replica.resuming = false;
  for (const auto& [id, other] : clients_) {
    if (other.key == client.key) replica.resumed_at = std::max(replica.resumed_at, other.open_seq);
  }
  std::map<Version, std::uint32_t> primaries;
  std::map<Version, std::uint32_t> offloads;
  std::uint32_t resumed = 0;
  for (const auto& [id, other] : clients_) {
    if (other.key != client.key || !other.resume) continue;
    ++resumed;
    if (other.resume->primary) ++primaries[other.resume->primary->version];
    for (const HeldCopy& held : other.resume->offloads) ++offloads[held.version];
  }
  replica.drain_unsure = resumed != replica.num_shards || primaries.size() > 1 ||
                         (primaries.size() == 1 && primaries.begin()->second != replica.num_shards);
  if (primaries.size() == 1 && primaries.begin()->second == replica.num_shards) {
    replica.holding = Holding::kComplete;
    replica.version = primaries.begin()->first;
    existing_[replica.model].insert(replica.version);
  }
  for (const auto& [version, holders] : offloads) {
    if (holders != replica.num_shards) continue;
    // The hub named the copy (its Offload came just before this answer).
    std::uint64_t copy = 0;
    if (auto named = replica.offloading.find(version); named != replica.offloading.end()) {
      copy = named->second;
      replica.offloading.erase(named);
    }
    replica.offloads[version] = copy;
    existing_[replica.model].insert(version);
  }
}

void Reference::on_start_read(ClientId client_id, const StartRead& read) {
  Replica* reader = replica_of(client_id);
  if (reader == nullptr) return;
  auto call = reader->calls.find(read.call);
  if (call == reader->calls.end()) fail("a StartRead names call " + std::to_string(read.call) +
                                        ", which " + reader->name + " did not make");
  Transfer& transfer = transfers_[{clients_.at(client_id).key, read.call}];
  const bool assigned = read.epoch > transfer.epoch;  // a source chosen now, not told again
  if (read.epoch > transfer.epoch) {
    transfer.epoch = read.epoch;
    transfer.stopped.reset();
    transfer.started.reset();
  }
  // Every source after the first replaces one that failed or went away: after more than
  // kSourceFailuresPerTransferMax of them the hub may give up on the transfer.
  if (read.epoch > limits::kSourceFailuresPerTransferMax) call->second.may_unavailable = true;
  transfer.id = read.transfer;
  transfer.started.set(read.shard);
  transfer.reader = clients_.at(client_id).key;
  transfer.call = read.call;
  transfer.source = reader->model + "/" + read.source.replica + "#" + std::to_string(read.source.incarnation);
  transfer.source_dc = read.source.datacenter;
  transfer.kind = read.source.kind;
  transfer.version = read.version;
  transfer.attached = true;
  transfer.reshard = !read.reshard.empty();
  call->second.read_started = true;
  call->second.last_source = read.source.replica;
  if (call->second.allowed.size() == 1 && !call->second.allowed.contains(read.version) &&
      call->second.exact) {
    fail(reader->name + " is told to read version " + std::to_string(read.version) + " for call " +
         std::to_string(read.call) + ", whose selector names " +
         std::to_string(*call->second.allowed.begin()));
  }
  // A complete copy whose bytes failed readers' checksums twice holds other bytes than the
  // version's: no reader is sent to it, even as a last resort (it would fail again and again).
  if (assigned && !read.source.partial && !model_unsure(reader->model)) {
    auto source = replicas_.find(transfer.source);
    const bool corrupt =
        source != replicas_.end() &&
        (read.source.kind == CopyKind::kOffload
             ? source->second.corrupt_offloads.contains(read.version)
             : source->second.corrupt && source->second.version == read.version &&
                   source->second.holding != Holding::kReceiving);
    if (corrupt) {
      fail(reader->name + " is sent to read version " + std::to_string(read.version) + " from " +
           read.source.replica + (read.source.kind == CopyKind::kOffload ? "'s offload copy" : "") +
           ", whose bytes of a shard failed their checksums twice");
    }
  }
  // Smart skipping (paper §4.3.4), for replicate as for update: nobody starts to pipeline from a
  // copy that is itself still receiving across datacenters. (One already pipelining when its
  // source turned to another datacenter goes on: the bytes it has are not read again.)
  if (assigned && settings_.smart_skipping && read.source.partial &&
      read.source.kind == CopyKind::kPrimary) {
    auto source = replicas_.find(transfer.source);
    for (const auto& [key, upstream] : transfers_) {
      if (source == replicas_.end() || upstream.reader != transfer.source || !upstream.attached ||
          (upstream.started & ~upstream.done).none()) {
        continue;
      }
      if (upstream.source_dc != source->second.datacenter) {
        fail(reader->name + " pipelines version " + std::to_string(read.version) + " from " +
             read.source.replica + ", which still seeds it from datacenter '" + upstream.source_dc +
             "' (smart skipping)");
      }
    }
  }
  judge_layouts(*reader, transfer, read);
  // The old copy of a moving update is gone once the new one is read into the buffers; a copy
  // that reads from a new source reads afresh.
  if (reader->holding != Holding::kReceiving) fresh_copy(*reader);
  if (assigned) {
    reader->mismatched.reset();
    reader->corrupt = false;
  }
  reader->holding = Holding::kReceiving;
  reader->version = read.version;
  reader->drain_unsure = false;
}

// Reads across layouts (README "Layouts"): a replica reads a copy of another shard count, and only
// then, by pieces of every one of its shards; only from a complete copy, whose every shard holds
// what its checksums vouch for (a copy still receiving has pieces missing, and one receiving
// across layouts assembles its bytes out of order); and a copy receiving across layouts serves
// no reader of its own layout until it is complete (its bytes are not there in order, and nobody
// has vouched for them yet).
void Reference::judge_layouts(const Replica& reader, const Transfer& transfer, const StartRead& read) const {
  if (model_unsure(reader.model) || read.source.kind != CopyKind::kPrimary) return;
  const auto source = replicas_.find(transfer.source);
  if (source == replicas_.end()) return;
  const Replica& from = source->second;
  const std::string what = reader.name + " is told to read version " + std::to_string(read.version) + " from " +
                           read.source.replica;
  if (transfer.reshard != (from.num_shards != reader.num_shards)) {
    fail(what + (transfer.reshard ? " across layouts, though both have " + std::to_string(from.num_shards) + " shards"
                                  : " as a copy of its own layout, though it has " + std::to_string(from.num_shards) +
                                        " shards and the reader " + std::to_string(reader.num_shards)));
  }
  if (transfer.reshard && read.reshard.size() != from.num_shards) {
    fail(what + " across layouts, naming " + std::to_string(read.reshard.size()) + " of its " +
         std::to_string(from.num_shards) + " shards");
  }
  const bool still_coming = from.version == read.version && !from.drain_unsure &&
                            (from.holding == Holding::kReceiving || from.holding == Holding::kPublishing);
  if (transfer.reshard && (read.source.partial || still_coming)) {
    fail(what + " across layouts while that copy is still " +
         (from.holding == Holding::kPublishing ? "publishing" : "receiving"));
  }
  if (!transfer.reshard && read.source.partial) {
    for (const auto& [key, upstream] : transfers_) {
      if (upstream.reader == transfer.source && upstream.attached && upstream.reshard &&
          upstream.version == read.version && (upstream.started & ~upstream.done).any()) {
        fail(what + " as a pipeline source, which itself reads it across layouts from " + upstream.source +
             " (its bytes are out of order and vouched for by nobody yet)");
      }
    }
  }
}

// A source told at a tick to stop serving a reader whose call goes on, neither of them evicted:
// the only reason is its drain grace, which must have passed.
void Reference::judge_revoke(const Transfer& transfer, const std::set<std::string>& answered_now,
                             TimeMs now_ms) {
  const auto source = replicas_.find(transfer.source);
  if (source == replicas_.end() || transfer.kind != CopyKind::kPrimary) return;
  const Replica& from = source->second;
  if (from.holding != Holding::kDraining || from.version != transfer.version || !from.drain_since_ms ||
      from.drain_unsure || model_unsure(from.model) || evicted_now_.contains(transfer.source) ||
      evicted_now_.contains(transfer.reader) || answered_now.contains(transfer.reader)) {
    return;
  }
  // A reader across datacenters may be moved off for another reason at the same tick (one seeder
  // per datacenter: keep_one_seeder, when a revoke or an eviction frees a source there).
  if (const auto reader = replicas_.find(transfer.reader);
      reader == replicas_.end() || reader->second.datacenter != transfer.source_dc) {
    return;
  }
  if (now_ms < *from.drain_since_ms + settings_.drain_grace_ms) {
    fail(transfer.reader + "'s read of " + transfer.source + "'s draining copy of version " +
         std::to_string(transfer.version) + " is revoked at " + std::to_string(now_ms) +
         " ms, before its drain grace ended (" + std::to_string(settings_.drain_grace_ms) + " ms from " +
         std::to_string(*from.drain_since_ms) + ")");
  }
  ++seen_.revokes;
}

void Reference::evict(const std::string& evicted) {
  const std::string key = evicted;  // a copy: callers pass a client's key, which is cleared below
  auto found = replicas_.find(key);
  if (found == replicas_.end()) return;
  for (auto& [id, client] : clients_) {
    if (client.key != key || !client.bound) continue;  // (one not bound may be opening anew)
    // Gone with it: what it announced no longer counts for a replica of the same name (and
    // incarnation) that opens later.
    client.bound = false;
    client.key.clear();
    client.resume.reset();
    client.waiting.reset();
  }
  std::erase_if(transfers_, [&](const auto& entry) { return entry.second.reader == key; });
  for (auto& [transfer_key, transfer] : transfers_) {
    if (transfer.source == key) transfer.attached = false;
  }
  replicas_.erase(found);
}

// Every shard is in: the calls that waited for it are taken, in shard order, as the hub does.
void Reference::become_whole(Replica& replica, TimeMs now_ms) {
  replica.whole = true;
  const std::map<std::uint32_t, ClientId> bound = replica.bound;
  for (const auto& [shard, id] : bound) {
    auto client = clients_.find(id);
    if (client == clients_.end() || !client->second.waiting) continue;
    const Request request = *std::exchange(client->second.waiting, std::nullopt);
    on_call(request, now_ms);
  }
}

void Reference::on_reply(ClientId client_id, const Reply& reply, TimeMs now_ms) {
  Replica* replica = replica_of(client_id);
  auto client = clients_.find(client_id);
  if (replica == nullptr || client == clients_.end() || !client->second.bound) {
    // A client the hub does not know gets "unknown client"; one the model lost track of (its
    // replica went) only an exit error.
    if (!exit_error(reply.outcome) && !std::holds_alternative<Error>(reply.outcome)) {
      fail("an answer (" + describe(reply.outcome) + ") to a client the hub does not know");
    }
    return;
  }
  auto call = replica->calls.find(reply.seq);
  if (call == replica->calls.end()) {
    if (error_of(reply.outcome) == Errc::kSequenceGap) {
      if (reply.seq == client->second.last_seq + 1) {
        fail("shard " + std::to_string(client->second.shard) + " of " + replica->name +
             " is told sequence-gap for call " + std::to_string(reply.seq) +
             ", which is the call the hub expects next");
      }
      return;
    }
    const auto& last = client->second.last_answer;
    if (last && last->first == reply.seq) {
      // The answer again, to a retransmission of a call the model has settled.
      if (!same_answer(last->second, reply.outcome)) {
        fail(replica->name + " call " + std::to_string(reply.seq) + " is answered " +
             describe(reply.outcome) + " again, after " + describe(last->second));
      }
      return;
    }
    fail(replica->name + " got an answer (" + describe(reply.outcome) + ") for call " +
         std::to_string(reply.seq) + ", which the hub never took");
  }
  const std::uint32_t shard = client->second.shard;
  if (!call->second.arrived.test(shard)) {
    fail("shard " + std::to_string(shard) + " of " + replica->name + " is answered call " +
         std::to_string(reply.seq) + " before it made it");
  }
  if (call->second.answered.test(shard)) return;  // the same answer again (a retransmission)
  call->second.answered.set(shard);
  client->second.last_answer = std::pair{reply.seq, reply.outcome};
  if (std::holds_alternative<CloseOk>(reply.outcome)) {
    // The shard leaves; the last one to leave takes the replica with it. What it announced no
    // longer counts for a replica of the same name that opens later.
    client->second.bound = false;
    client->second.key.clear();
    client->second.resume.reset();
    replica->bound.erase(shard);
    // Its replica is closing (also when the close was seeded after a failover and so never
    // "arrived" here): it no longer counts for a role, and its other shards leave with it.
    replica->closing = true;
    if (replica->bound.empty() && !replica->resuming) {
      evict(key_of(*replica));
      return;
    }
  }
  // Consistency (§5.3): an error that ends the call for this shard alone must be explained by the
  // shard's own situation; the replica's answer may not follow "closed" told to a peer.
  if (const std::optional<Errc> ending = ending_error(reply.outcome)) {
    judge_exit(*replica, call->second, shard, client->second, reply.seq, *ending);
    // (Only a shard that made the replica's call: one whose call diverged from its peers' is
    // told "closed" about a call that is not the one they are answered.)
    const auto own = call->second.ops.find(shard);
    const bool made_the_call = own == call->second.ops.end() || own->second == call->second.op;
    if (*ending == Errc::kReplicaClosed && made_the_call) call->second.closed_out = true;
  } else {
    if (call->second.closed_out && !call->second.seeded && !model_unsure(replica->model)) {
      fail("shard " + std::to_string(shard) + " of " + replica->name + " got " + describe(reply.outcome) +
           " for call " + std::to_string(reply.seq) + " where a peer was told the replica closed");
    }
    call->second.answered_for_all = true;
  }
  // The first answer that is the replica's (not an exit error told to one shard, such as "closed"
  // to a shard that diverged from a close) is the one the model applies.
  if (call->second.answer && (exit_error(*call->second.answer) == exit_error(reply.outcome) ||
                              exit_error(reply.outcome))) {
    // Replica consistency (§5.3): every shard gets the first shard's answer.
    if (!exit_error(reply.outcome) && !exit_error(*call->second.answer) &&
        !same_answer(reply.outcome, *call->second.answer)) {
      fail("shard " + std::to_string(shard) + " of " + replica->name + " got " +
           describe(reply.outcome) + " for call " + std::to_string(reply.seq) +
           " where another shard got " + describe(*call->second.answer));
    }
    return;
  }
  call->second.answer = reply.outcome;
  ++seen_.answers_checked;
  check_answer(*replica, reply.seq, call->second, reply.outcome, now_ms);
  apply_answer(*replica, reply.seq, call->second, reply.outcome);
}

void Reference::judge_exit(const Replica& replica, const Call& call, std::uint32_t shard,
                           const Client& client, std::uint64_t seq, Errc code) const {
  // After a failover the shards behind are told what their peers were told before it: the model
  // does not follow those calls.
  if (call.seeded || model_unsure(replica.model)) return;
  const std::string what = "shard " + std::to_string(shard) + " of " + replica.name + " is told " +
                           std::string(errc_name(code)) + " for call " + std::to_string(seq) + " (" +
                           std::string(op_name(call.op.kind)) + ")";
  const bool evicted_now = evicted_now_.contains(key_of(replica));
  switch (code) {
    case Errc::kReplicaEvicted:
      if (!evicted_now) fail(what + ", but the hub does not evict its replica");
      break;
    case Errc::kDivergentCall: {
      // Its own call was not the replica's, it ran too far ahead of a peer, or the replica ends
      // now because another shard diverged.
      const auto own = call.ops.find(shard);
      const bool differs = own != call.ops.end() && !(own->second == call.op);
      const bool ahead = !replica.calls.empty() && seq - replica.calls.begin()->first >= limits::kTxnWindowMax;
      if (!differs && !ahead && !evicted_now) fail(what + ", although it made the call its peers made");
      break;
    }
    case Errc::kReplicaClosed:
      if (!replica.closing) fail(what + ", but no shard of the replica is closing it");
      break;
    case Errc::kUnknownClient:
      fail(what + ", although the hub let it in and did not evict it");
    case Errc::kSequenceGap:
      if (seq == client.last_seq + 1) fail(what + ", although it is the call the hub expects next");
      break;
    default:
      TH_ASSERT(false, "not an error that ends a call", errc_name(code));
  }
  // The replica's answer went to a peer: this shard is owed the same, unless it made another call.
  if (call.answered_for_all && (code == Errc::kReplicaEvicted || code == Errc::kReplicaClosed)) {
    fail(what + " where a peer got the replica's answer" +
         (call.answer ? " (" + describe(*call.answer) + ")" : std::string()));
  }
}

void Reference::check_answer(Replica& replica, std::uint64_t seq, Call& call, const Outcome& outcome,
                             TimeMs now_ms) {
  if (exit_error(outcome)) return;
  // Layouts, whatever else the model knows: a call with a layout the testkit never makes for a
  // shard is never carried out, and one whose every shard sent the testkit's is never refused
  // for its layout (every publish that succeeds sent the testkit's, so that is the model's).
  const bool bad_layout = call.layout_bad;
  const bool refused_for_layout = error_of(outcome) == Errc::kLayoutMismatch;
  const auto* moved = std::get_if<UpdateOk>(&outcome);
  const bool carried_out = std::holds_alternative<PublishOk>(outcome) || std::holds_alternative<ReplicateOk>(outcome) ||
                           (moved != nullptr && moved->status == UpdateStatus::kUpdated);
  if (bad_layout && carried_out) {
    fail(replica.name + " call " + std::to_string(seq) + " (" + std::string(op_name(call.op.kind)) + "): answered " +
         describe(outcome) + " although a shard sent a layout the model does not have");
  }
  if (!bad_layout && call.layout_good == all_shards(replica.num_shards) && refused_for_layout) {
    fail(replica.name + " call " + std::to_string(seq) + " (" + std::string(op_name(call.op.kind)) + "): answered " +
         describe(outcome) + " although every shard sent the model's layout");
  }
  // Refused, or a call some shard of which the model did not see: which check came first is the hub's.
  if (bad_layout || refused_for_layout) return;
  if (call.seeded || !call.exact || model_unsure(replica.model)) return;
  auto wrong = [&](const std::string& why) {
    std::string allowed;
    for (Version version : call.allowed) allowed += " " + std::to_string(version);
    fail(replica.name + " call " + std::to_string(seq) + " (" + std::string(op_name(call.op.kind)) +
         "): answered " + describe(outcome) + ", " + why + " [arrived at " +
         std::to_string(call.arrived_ms) + " ms; versions it may read:" + allowed +
         (call.moves ? "; moves" : "") + (call.read_started ? "; read" : "") +
         (call.may_unavailable ? "; may be unavailable" : "") +
         (call.may_not_found ? "; may be not found" : "") + "; holders: " +
         describe_holders(replica.model) + "]");
  };
  const std::optional<Errc> error = error_of(outcome);
  const ShardSet everyone = all_shards(replica.num_shards);
  if (error == Errc::kCancelled) {
    if (!call.cancelled) wrong("but no shard cancelled it");
    return;
  }
  refresh(replica, call);  // what changed in this very step counts
  if (call.decided) {
    if (!same_answer(outcome, *call.decided)) wrong("expected " + describe(*call.decided));
    return;
  }
  if (error == Errc::kTimeout) {
    TimeMs timeout_ms = 0;
    if (const auto* replicate = std::get_if<ReplicateRequest>(&call.body)) timeout_ms = replicate->timeout_ms;
    if (const auto* wait = std::get_if<WaitRequest>(&call.body)) timeout_ms = wait->timeout_ms;
    if (timeout_ms == 0 || now_ms < call.arrived_ms + timeout_ms) {
      wrong("but its timeout (" + std::to_string(timeout_ms) + " ms from " +
            std::to_string(call.arrived_ms) + ") has not passed");
    }
    ++seen_.timeouts;
    return;
  }
  switch (call.op.kind) {
    case OpKind::kPublish:
      if (const auto* published = std::get_if<PublishOk>(&outcome)) {
        if (published->version != call.op.version) wrong("for another version");
        if (call.arrived != everyone) wrong("before every shard published");
      }
      if (error == Errc::kStaleVersion && !call.may_stale) {
        wrong("although the version is not below latest or is one the model knows");
      }
      return;
    case OpKind::kUnpublish:
      return;  // integrity and retention: the Observer; its answer when due: liveness
    case OpKind::kReplicate:
    case OpKind::kUpdate: {
      Version version = 0;
      std::string source;
      if (const auto* replicated = std::get_if<ReplicateOk>(&outcome)) {
        version = replicated->version;
        source = replicated->source_replica;
      } else if (const auto* updated = std::get_if<UpdateOk>(&outcome)) {
        if (updated->status != UpdateStatus::kUpdated) {
          wrong(call.moves ? "although a newer version could be read"
                           : "which the model cannot tell (a decision it did not follow)");
        }
        version = updated->version.value_or(0);
        source = updated->source_replica;
      } else {
        if (error == Errc::kVersionUnavailable && call.may_unavailable) return;
        if (error == Errc::kVersionNotFound && call.may_not_found) return;
        wrong("an error the specification does not give here");
        return;
      }
      ++seen_.resolutions;
      if (!call.allowed.contains(version)) {
        std::string allowed;
        for (Version v : call.allowed) allowed += " " + std::to_string(v);
        wrong("but its selector named{" + allowed + " }");
      }
      if (!call.last_source || source != *call.last_source) {
        wrong("but the bytes came from " + call.last_source.value_or("nobody"));
      }
      if (call.done != everyone) wrong("before every shard's bytes arrived");
      return;
    }
    case OpKind::kList: {
      const auto* listed = std::get_if<ListOk>(&outcome);
      if (listed == nullptr) {
        wrong("an error");
        return;
      }
      const ListSnapshot& snapshot = *listed->snapshot;
      if (snapshot.latest != latest(replica.model)) {
        wrong("with latest " + (snapshot.latest ? std::to_string(*snapshot.latest) : "none") +
              " where " + (latest(replica.model) ? std::to_string(*latest(replica.model)) : "none") +
              " exists");
      }
      for (const auto& [key, other] : replicas_) {
        if (other.model != replica.model || other.bound.empty() || other.drain_unsure ||
            other.closing || other.holding != Holding::kComplete) {
          continue;
        }
        const auto shown = std::find_if(snapshot.replicas.begin(), snapshot.replicas.end(),
                                         [&](const auto& info) { return info.name == other.name; });
        if (shown == snapshot.replicas.end() || shown->version != other.version ||
            shown->state != "complete") {
          wrong("but " + other.name + " holds version " + std::to_string(other.version) +
                " completely");
        }
      }
      return;
    }
    case OpKind::kWait: {
      const auto& predicate = std::get<WaitRequest>(call.body).predicate;
      std::optional<Errc> predicate_error;
      const std::optional<bool> holds = predicate_holds(replica.model, predicate, &predicate_error);
      if (std::holds_alternative<WaitOk>(outcome)) {
        ++seen_.waits_answered;
        if (holds == false) {
          static constexpr const char* kKinds[] = {"version >=", "replicas hold", "role holds"};
          wrong("but its predicate (" + std::string(kKinds[static_cast<int>(predicate.kind)]) + " v" +
                std::to_string(predicate.version) + ", replicas " +
                std::to_string(predicate.replicas_min) + ", role '" + predicate.role +
                "') does not hold");
        }
      } else if (error == Errc::kVersionUnavailable || error == Errc::kVersionNotFound) {
        if (holds == true) wrong("but its predicate holds");
      } else {
        wrong("an error the specification does not give here");
      }
      return;
    }
    case OpKind::kClose:
      // A departure needs nobody's consent, not even that of a rule retaining what it holds.
      if (!std::holds_alternative<CloseOk>(outcome)) wrong("but a close is never refused");
      return;
  }
}

// A call waiting for its version resolves as soon as the version is there (the hub resolves it in
// the step that changed what exists); a transfer fails "unavailable" once no copy with the bytes is
// left. Returns whether the call can only end in an error now.
bool Reference::refresh(Replica& replica, Call& call) {
  bool resolution_error = false;
  if (const auto* replicate = std::get_if<ReplicateRequest>(&call.body);
      replicate != nullptr && !call.decided && call.allowed.empty()) {
    const Resolution resolution = resolve(replica.model, replicate->selector);
    switch (resolution.kind) {
      case Resolution::Kind::kGo:
        call.allowed.insert(resolution.version);
        if (replica.holding == Holding::kNone) {
          replica.holding = Holding::kReceiving;
          replica.version = resolution.version;
          fresh_copy(replica);
        }
        break;
      case Resolution::Kind::kNotFound:
        call.may_not_found = true;
        resolution_error = true;
        break;
      case Resolution::Kind::kUnavailable:
        call.may_unavailable = true;
        resolution_error = true;
        break;
      case Resolution::Kind::kUnsure:
        call.exact = false;
        break;
      case Resolution::Kind::kWait:
        break;
    }
  }
  for (Version version : call.allowed) {
    bool unsure = false;
    if (!has_bytes(replica.model, version, &unsure) || unsure) call.may_unavailable = true;
  }
  return resolution_error;
}

void Reference::apply_answer(Replica& replica, std::uint64_t seq, Call& call, const Outcome& outcome) {
  // An answer given after a shard already made a later call (after a failover, the shards behind
  // are told what the others were told before it) changes nothing: that later call decided what
  // the replica holds since.
  const auto later = replica.calls.upper_bound(seq);
  if (call.seeded && later != replica.calls.end() && later->second.arrived.any()) {
    transfers_.erase({key_of(replica), seq});
    return;
  }
  auto hold = [&](Version version) {
    // A copy a reader reported while it was received stays reported once complete; what readers
    // found of its bytes while they arrived is moot (every shard verified them).
    if (replica.holding != Holding::kReceiving || replica.version != version) replica.failed = false;
    replica.mismatched.reset();
    replica.corrupt = false;
    replica.holding = Holding::kComplete;
    replica.version = version;
    replica.drain_unsure = false;
    existing_[replica.model].insert(version);
  };
  std::visit(
      [&](const auto& answer) {
        using T = std::decay_t<decltype(answer)>;
        if constexpr (std::is_same_v<T, PublishOk>) {
          hold(answer.version);
        } else if constexpr (std::is_same_v<T, ReplicateOk>) {
          hold(answer.version);
        } else if constexpr (std::is_same_v<T, UpdateOk>) {
          if (answer.status == UpdateStatus::kUpdated) {
            hold(*answer.version);
          } else {
            replica.drain_unsure = false;  // it did not move: it holds what it held
          }
        } else if constexpr (std::is_same_v<T, UnpublishOk>) {
          replica.holding = Holding::kNone;
          replica.drain_unsure = false;
        } else if constexpr (std::is_same_v<T, CloseOk>) {
          replica.holding = Holding::kNone;
          replica.offloads.clear();
          replica.offloading.clear();
        } else if constexpr (std::is_same_v<T, Error>) {
          if (call.seeded) return;  // given as it was before the failover: nothing happened here
          switch (call.op.kind) {
            case OpKind::kPublish:
              if (replica.holding == Holding::kPublishing && !call.decided) replica.holding = Holding::kNone;
              break;
            case OpKind::kReplicate:
            case OpKind::kUpdate:
              // Decided at arrival, yet a read may have begun since (soak seed: the version was
              // published anew by a restarted trainer, whose crash then failed the read): the
              // buffers changed all the same.
              if (call.decided && !call.read_started) break;
              if (call.read_started || !call.held_before) {
                replica.holding = Holding::kNone;  // the buffers changed, or held nothing
              } else {
                // Failed before any read: still the previous copy, the same bytes in the same
                // buffers, and so still reported if a reader reported it.
                replica.holding = Holding::kComplete;
                replica.version = *call.held_before;
                replica.drain_unsure = false;
              }
              break;
            case OpKind::kUnpublish:
              break;
            default:
              break;
          }
        }
      },
      outcome);
  transfers_.erase({key_of(replica), seq});
}

// ==== The end of a step: what the hub owed by now ==================================================

// Load (DESIGN.md §5.4, issue 34): a source serves at most fan-out-limit transfers at a time to
// readers of its own datacenter, and at most as many to readers of other datacenters, so that a
// slow read across datacenters never takes the slot its own datacenter's readers need. Counted per
// source shard, from what the hub told the readers: a shard serves a transfer from the StartRead
// until the reader shard is done, or the source shard is told to stop (a read across layouts: every
// source shard, until any is told to stop). The hub counts per copy until the whole transfer ends,
// so this count is never above the hub's own.
void Reference::judge_load() const {
  struct Served {
    std::uint32_t here = 0;
    std::uint32_t across = 0;
  };
  // (source replica, copy kind, version, source shard)
  std::map<std::tuple<std::string, CopyKind, Version, std::uint32_t>, Served> served;
  for (const auto& [key, transfer] : transfers_) {
    if (!transfer.attached) continue;
    const auto reader = replicas_.find(transfer.reader);
    const auto source = replicas_.find(transfer.source);
    if (reader == replicas_.end() || source == replicas_.end()) continue;
    const bool across = reader->second.datacenter != transfer.source_dc;
    auto count = [&](std::uint32_t shard) {
      Served& load = served[{transfer.source, transfer.kind, transfer.version, shard}];
      ++(across ? load.across : load.here);
      if ((across ? load.across : load.here) > settings_.fanout_max) {
        fail("load: shard " + std::to_string(shard) + " of " + transfer.source + " serves " +
             std::to_string(across ? load.across : load.here) + " reads of version " +
             std::to_string(transfer.version) + " at once to readers " +
             (across ? "of other datacenters" : "of its own datacenter") + " (the last: " + transfer.reader +
             "), with a fan-out limit of " + std::to_string(settings_.fanout_max));
      }
    };
    if (transfer.reshard) {
      if ((transfer.started & ~transfer.done).none()) continue;
      for (std::uint32_t shard = 0; shard < source->second.num_shards; ++shard) count(shard);
    } else {
      const ShardSet serving = transfer.started & ~transfer.done & ~transfer.stopped;
      for (std::uint32_t shard = 0; shard < limits::kShardsMax; ++shard) {
        if (serving.test(shard)) count(shard);
      }
    }
  }
}

void Reference::end_of_step(const Input& input, const Effects& effects, TimeMs now_ms) {
  (void)effects;
  const bool tick = std::holds_alternative<Tick>(input);
  // A transfer whose unfinished shards' sources were all told to stop has no source now.
  for (auto& [key, transfer] : transfers_) {
    if ((transfer.started & ~transfer.done & ~transfer.stopped).none() &&
        (transfer.started & ~transfer.done).any()) {
      transfer.attached = false;
    }
  }
  judge_load();
  // Evictions are due a tick past the heartbeat timeout.
  if (tick) {
    for (const auto& [id, client] : clients_) {
      if (!client.bound) continue;
      if (now_ms >= client.last_seen_ms + settings_.heartbeat_timeout_ms + 1) {
        fail("shard " + std::to_string(client.shard) + " of " + client.key + " was last heard of at " +
             std::to_string(client.last_seen_ms) + " ms and is not evicted at " + std::to_string(now_ms) +
             " ms (heartbeat timeout " + std::to_string(settings_.heartbeat_timeout_ms) + " ms)");
      }
    }
  }
  for (auto& [key, replica] : replicas_) {
    const bool judged = !model_unsure(replica.model) && !replica.drain_unsure;
    for (auto& [seq, call] : replica.calls) {
      if (call.answer || call.seeded) continue;
      // Calls still waiting for their version resolve as soon as it is there.
      const bool resolution_error = refresh(replica, call);
      if (!call.exact || !judged) continue;
      const std::string what = replica.name + " call " + std::to_string(seq) + " (" +
                               std::string(op_name(call.op.kind)) + ")";
      if (call.cancelled) fail(what + " is not answered though a shard cancelled it");
      if (call.decided) fail(what + " is not answered at once: expected " + describe(*call.decided));
      if (resolution_error) fail(what + " is not answered though its version can never be read");
      if (call.op.kind == OpKind::kList) fail(what + " is not answered at once");
      if (call.op.kind == OpKind::kPublish && call.arrived == all_shards(replica.num_shards)) {
        fail(what + " is not answered though every shard published");
      }
      TimeMs timeout_ms = 0;
      if (const auto* replicate = std::get_if<ReplicateRequest>(&call.body)) timeout_ms = replicate->timeout_ms;
      if (const auto* wait = std::get_if<WaitRequest>(&call.body)) {
        timeout_ms = wait->timeout_ms;
        std::optional<Errc> error;
        if (predicate_holds(replica.model, wait->predicate, &error) == true) {
          fail(what + " is not answered though its predicate holds (" + describe_holders(replica.model) + ")");
        }
      }
      if (tick && timeout_ms > 0 && now_ms >= call.arrived_ms + timeout_ms) {
        fail(what + " is not answered though its timeout passed (" + std::to_string(timeout_ms) +
             " ms from " + std::to_string(call.arrived_ms) + ")");
      }
    }
    std::erase_if(replica.calls, [&](const auto& entry) {
      const Call& call = entry.second;
      return call.answer && (call.answered | ~call.arrived) == ShardSet().set() &&
             call.arrived == all_shards(replica.num_shards);
    });
  }
  // Drains: one drain grace after a copy began to drain, nobody reads it any more (its readers were
  // sent elsewhere at the tick the grace ended). An update's old copy is followed too loosely.
  for (auto& [key, replica] : replicas_) {
    if (replica.holding != Holding::kDraining) {
      replica.drain_since_ms.reset();
      continue;
    }
    if (!tick || !replica.drain_since_ms || replica.drain_unsure || model_unsure(replica.model) ||
        now_ms < *replica.drain_since_ms + settings_.drain_grace_ms) {
      continue;
    }
    for (const auto& [id, transfer] : transfers_) {
      if (transfer.source == key && transfer.kind == CopyKind::kPrimary && transfer.version == replica.version &&
          transfer.attached && (transfer.started & ~transfer.done & ~transfer.stopped).any()) {
        fail(transfer.reader + " still reads " + key + "'s draining copy of version " +
             std::to_string(replica.version) + " at " + std::to_string(now_ms) + " ms, past its drain grace (" +
             std::to_string(settings_.drain_grace_ms) + " ms from " + std::to_string(*replica.drain_since_ms) + ")");
      }
    }
  }
  // Lives: a model's idle clock runs while no replica of it is present.
  std::set<std::string> models;
  for (const auto& [model, versions] : existing_) models.insert(model);
  for (const auto& [key, replica] : replicas_) models.insert(replica.model);
  for (const std::string& model : models) {
    const bool any = std::any_of(replicas_.begin(), replicas_.end(), [&](const auto& entry) {
      return entry.second.model == model && present(entry.second);
    });
    if (any) {
      idle_since_.erase(model);
    } else {
      idle_since_.try_emplace(model, now_ms);
    }
  }
  // A model whose replicas are all back after a failover is followed exactly again.
  for (auto it = unsure_models_.begin(); it != unsure_models_.end();) {
    const bool back = std::none_of(replicas_.begin(), replicas_.end(), [&](const auto& entry) {
      return entry.second.model == *it && (entry.second.resuming || entry.second.drain_unsure);
    });
    it = back ? unsure_models_.erase(it) : std::next(it);
  }
}

// What the model thinks each replica of `model` holds, for failure messages.
std::string Reference::describe_holders(const std::string& model) const {
  static constexpr const char* kHoldings[] = {"nothing", "publishing", "receiving", "complete", "draining"};
  std::string text;
  for (const auto& [key, replica] : replicas_) {
    if (replica.model != model || !present(replica)) continue;
    if (!text.empty()) text += ", ";
    text += replica.name + " " + kHoldings[static_cast<int>(replica.holding)];
    if (replica.holding != Holding::kNone) text += " v" + std::to_string(replica.version);
    if (replica.failed) text += " reported";
    for (const auto& [version, copy] : replica.offloads) text += " offload v" + std::to_string(version);
    for (const auto& [version, copy] : replica.offloading) text += " offloading v" + std::to_string(version);
  }
  return text;
}

void Reference::on_server_restart() {
  // A fresh server knows nothing: what it will know comes from the clients' resumes.
  for (const auto& [key, replica] : replicas_) unsure_models_.insert(replica.model);
  clients_.clear();
  replicas_.clear();
  existing_.clear();
  heard_.clear();
  idle_since_.clear();
  transfers_.clear();
  released_.clear();  // copy ids are the new server's
}

void Reference::check_quiescent() const {
  for (const auto& [key, replica] : replicas_) {
    if (replica.bound.empty()) continue;
    for (const auto& [seq, call] : replica.calls) {
      if (call.answer) continue;
      if (const auto* wait = std::get_if<WaitRequest>(&call.body); wait != nullptr && wait->timeout_ms == 0) {
        continue;  // may wait for ever: its predicate may never hold
      }
      if (const auto* replicate = std::get_if<ReplicateRequest>(&call.body);
          replicate != nullptr && replicate->timeout_ms == 0 && call.allowed.empty()) {
        continue;  // its version may never be published
      }
      fail("liveness: " + replica.name + " call " + std::to_string(seq) + " (" +
           std::string(op_name(call.op.kind)) + ") is still unanswered after healing");
    }
    // Every offload copy left is one retention needs: any other is CPU memory never given back.
    if (model_unsure(replica.model)) continue;
    for (const auto& [version, copy] : replica.offloads) {
      if (!offload_needed(replica, version)) {
        fail("offloads: " + replica.name + " still holds offload copy " + std::to_string(copy) + " of version " +
             std::to_string(version) + " after healing, although " +
             (retained(replica.model, version) ? "another safe copy holds it" : "no rule retains it"));
      }
    }
  }
}

}  // namespace th::test
