#include "sim/observer.h"

#include <algorithm>
#include <iterator>
#include <sstream>

namespace th::sim {

namespace {

std::string replica_key(const OpenRequest& request) {
  return request.model + "/" + request.replica + "#" + std::to_string(request.incarnation);
}

// A canonical summary of an answer: equal summaries mean "the same answer" for replica consistency.
std::string summarize(const Outcome& outcome) {
  std::ostringstream out;
  out << outcome.index() << ':';
  std::visit(
      [&](const auto& value) {
        using T = std::decay_t<decltype(value)>;
        if constexpr (std::is_same_v<T, Error>) {
          out << errc_name(value.code);
        } else if constexpr (std::is_same_v<T, OpenOk>) {
          out << value.num_shards;
        } else if constexpr (std::is_same_v<T, PublishOk>) {
          out << value.version;
        } else if constexpr (std::is_same_v<T, ReplicateOk>) {
          out << value.version << '/' << value.source_replica;
        } else if constexpr (std::is_same_v<T, UpdateOk>) {
          out << update_status_name(value.status) << '/'
              << (value.version ? std::to_string(*value.version) : "-") << '/'
              << value.source_replica;
        } else if constexpr (std::is_same_v<T, ListOk>) {
          const ListSnapshot& snapshot = *value.snapshot;
          out << (snapshot.latest ? std::to_string(*snapshot.latest) : "-");
          for (const auto& version : snapshot.versions) {
            out << " v" << version.version << ':' << version.complete << '+' << version.partial;
          }
          for (const auto& replica : snapshot.replicas) {
            out << ' ' << replica.name << ':' << replica.state << ':'
                << (replica.version ? std::to_string(*replica.version) : "-");
          }
        }
      },
      outcome);
  return out.str();
}

// Answers that end a call without being the replica's answer to it.
bool is_exit_error(const Outcome& outcome) {
  const auto* error = std::get_if<Error>(&outcome);
  if (error == nullptr) return false;
  switch (error->code) {
    case Errc::kReplicaEvicted:
    case Errc::kDivergentCall:
    case Errc::kReplicaClosed:
    case Errc::kUnknownClient:
    case Errc::kSequenceGap:
      return true;
    default:
      return false;
  }
}

}  // namespace

void Observer::on_open(ClientId client, std::uint64_t seq, std::uint64_t session,
                       const OpenRequest& request) {
  if (auto found = clients_.find(client); found != clients_.end()) {
    // The same open again (its session and number) is answered again; an open of a newer session
    // ends the old binding (the hub evicts that replica), which the Evicted effects report; one of
    // an older session is refused.
    if (found->second.open_session == session && found->second.open_seq == seq) {
      // After an eviction (of which the client may not know yet) the hub takes it as a new open.
      if (request.resume && !found->second.bound) announced_[client] = *request.resume;
      return;
    }
    if (session < found->second.open_session) return;
    if (found->second.bound) leave(client);
    drop_grants_of(client);  // a new session: the client revoked every grant of the old one
  }
  const std::string key = replica_key(request);
  if (request.resume) {
    // A backup learns versions from resumes, in any order: each one announced is known.
    std::set<Version>& named = named_versions_[request.model];
    if (request.resume->primary) named.insert(request.resume->primary->version);
    for (const HeldCopy& offload : request.resume->offloads) named.insert(offload.version);
  }
  clients_[client] = ClientInfo{key, request.shard, seq, session, request.retention, false, 0, {}};
  // An open of a newer incarnation replaces the older ones (the hub evicts them, whichever of
  // their shards it tells): nothing they held is held any more.
  for (auto& [other_key, other] : replicas_) {
    if (other.model == request.model && other.name == request.replica &&
        other.incarnation < request.incarnation && (other.held || !other.offloads.empty())) {
      other.held.reset();
      other.offloads.clear();
      other.leaving = false;
      other.reading_across.reset();
      ++changes_[other.model];
    }
  }
  ReplicaInfo& replica = replicas_[key];
  replica.model = request.model;
  replica.name = request.replica;
  replica.incarnation = request.incarnation;
  replica.datacenter = request.datacenter;
  datacenter_of_[request.model + "/" + request.replica] = request.datacenter;
  replica.spot = request.spot;
  replica.num_shards = request.num_shards;
  if (request.resume) {
    announced_[client] = *request.resume;
  } else {
    announced_.erase(client);
  }
}

void Observer::on_call(ClientId client, std::uint64_t seq, const RequestBody& body) {
  auto found = clients_.find(client);
  if (found == clients_.end()) return;
  found->second.called_seq = std::max(found->second.called_seq, seq);
  // Calls far behind the latest are answered long since (a replica's shards stay within
  // limits::kTxnWindowMax calls of each other): forgotten, so that the map stays small.
  std::map<std::uint64_t, OpKey>& ops = found->second.ops;
  ops[seq] = op_key(body);
  while (!ops.empty() && ops.begin()->first + 2 * limits::kTxnWindowMax < found->second.called_seq) {
    ops.erase(ops.begin());
  }
  if (!found->second.bound) return;
  // A shard late to a call its replica already got the answer to changes nothing.
  if (answers_.contains({found->second.replica_key, seq})) return;
  ReplicaInfo& replica = replicas_[found->second.replica_key];
  if (const auto* publish = std::get_if<PublishRequest>(&body)) {
    std::set<Version>& named = named_versions_[replica.model];
    const std::optional<Version> latest = hub_latest_[replica.model];
    if (latest && publish->version < *latest && !named.contains(publish->version) &&
        !completed_[replica.model].contains(publish->version)) {
      out_of_order_[{found->second.replica_key, seq}] = {publish->version, *latest};
    }
    named.insert(publish->version);
  }
  const bool unpublish = std::holds_alternative<UnpublishRequest>(body);
  const bool update = std::holds_alternative<UpdateRequest>(body);
  const bool close = std::holds_alternative<CloseRequest>(body);
  if (!unpublish && !update && !close) return;
  if (close) replica.closing = true;
  if (!replica.leaving) replica.leaving_rules = changes_[replica.model];
  replica.leaving = true;
  if (update) replica.pending_update_seqs.insert(seq);
}

void Observer::on_report(ClientId client, const ReportBody& body) {
  auto found = clients_.find(client);
  if (found == clients_.end() || !found->second.bound) return;
  const ClientInfo& info = found->second;
  ReplicaInfo& replica = replicas_[info.replica_key];
  if (const auto* failed = std::get_if<TransferFailed>(&body)) {
    auto read = reads_.find({client, failed->transfer});
    if (read != reads_.end() && read->second.source.kind == CopyKind::kPrimary) {
      const std::string source_key = replica.model + "/" + read->second.source.replica + "#" +
                                     std::to_string(read->second.source.incarnation);
      if (auto source = replicas_.find(source_key); source != replicas_.end()) {
        source->second.failed = read->second.version;
      }
    }
  } else if (const auto* done = std::get_if<TransferDone>(&body)) {
    // A seed's shard has its bytes: the copy counts once every shard has.
    auto read = reads_.find({client, done->transfer});
    if (read == reads_.end() || read->second.offload_copy == 0) return;
    auto offload = replica.offloads.find(read->second.version);
    if (offload == replica.offloads.end() || offload->second.copy != read->second.offload_copy ||
        offload->second.released) {
      return;
    }
    offload->second.reported.insert(info.shard);
    if (offload->second.reported.size() == replica.num_shards) offload->second.complete = true;
  } else if (const auto* offloaded = std::get_if<OffloadDone>(&body)) {
    auto offload = replica.offloads.find(offloaded->version);
    if (offload == replica.offloads.end() || offload->second.copy != offloaded->copy ||
        offload->second.released) {
      return;
    }
    offload->second.reported.insert(info.shard);
    if (offload->second.reported.size() == replica.num_shards) offload->second.complete = true;
  }
}

bool Observer::retained(const std::string& model, Version version) const {
  std::optional<std::uint64_t> keep;
  for (const auto& [client, info] : clients_) {
    if (!info.bound) continue;
    auto replica = replicas_.find(info.replica_key);
    if (replica == replicas_.end() || replica->second.model != model) continue;
    for (Version pinned : info.retention.pinned) {
      if (pinned == version) return true;
    }
    if (info.retention.keep_latest) keep = std::max(keep.value_or(0), *info.retention.keep_latest);
  }
  // keep_latest = k keeps the k + 1 newest versions that exist (latest-0 … latest-k).
  auto completed = completed_.find(model);
  if (!keep || completed == completed_.end() || !completed->second.contains(version)) return false;
  auto newer = completed->second.upper_bound(version);
  return static_cast<std::uint64_t>(std::distance(newer, completed->second.end())) <= *keep;
}

std::size_t Observer::safe_holders(const std::string& model, Version version,
                                   const ReplicaInfo* except) const {
  std::size_t holders = 0;
  for (const auto& [key, replica] : replicas_) {
    if (replica.model != model) continue;
    if (&replica != except && !replica.spot && replica.held == version) ++holders;
    if (auto offload = replica.offloads.find(version);
        offload != replica.offloads.end() && offload->second.complete) {
      ++holders;
    }
  }
  return holders;
}

void Observer::stop_holding(ReplicaInfo& replica, const char* why) {
  const bool rules_unchanged = replica.leaving_rules == changes_[replica.model];
  // The cheaper test first (replicas, not clients): both are pure, and in a large fleet another
  // holder nearly always exists.
  if (replica.held && !replica.spot && rules_unchanged &&
      safe_holders(replica.model, *replica.held, &replica) == 0 && retained(replica.model, *replica.held)) {
    violation("retention: " + replica.name + " stopped holding retained version " +
              std::to_string(*replica.held) + " (" + why +
              ") while no other non-spot replica or offload copy held it");
  }
  // The failed mark belongs to a version: the copy being received may already carry one.
  if (replica.failed == replica.held) replica.failed.reset();
  replica.held.reset();
  replica.reading_across.reset();
}

void Observer::leave(ClientId client) {
  auto found = clients_.find(client);
  if (found == clients_.end() || !found->second.bound) return;
  found->second.bound = false;
  const std::string& key = found->second.replica_key;
  ReplicaInfo& replica = replicas_[key];
  replica.bound.erase(client);
  if (!replica.bound.empty()) return;
  std::erase_if(answers_, [&](const auto& entry) { return entry.first.first == key; });
  std::erase_if(answered_ops_, [&](const auto& entry) { return entry.first.first == key; });
  std::erase_if(closed_calls_, [&](const auto& entry) { return entry.first.first == key; });
  replica.closed_at_seq.reset();
}

// Grants are ordered by source first: a source's are one range (a fleet of thousands has many).
std::map<Observer::Grant, ServeRead>::iterator Observer::first_grant_of(ClientId client) {
  return grants_.lower_bound(Grant{client, 0, 0});
}

void Observer::drop_grants_of(ClientId client) {
  auto it = first_grant_of(client);
  while (it != grants_.end() && it->first.source == client) it = grants_.erase(it);
}

void Observer::check_consistency(const ClientInfo& info, const Reply& reply) {
  if (std::holds_alternative<OpenOk>(reply.outcome)) return;
  if (is_exit_error(reply.outcome)) {
    check_ending(info, reply, std::get<Error>(reply.outcome).code);
    return;
  }
  const std::pair key{info.replica_key, reply.seq};
  const std::string summary = summarize(reply.outcome);
  auto [found, inserted] = answers_.try_emplace(key, summary);
  if (!inserted && found->second != summary) {
    violation("consistency: shard " + std::to_string(info.shard) + " of " + info.replica_key +
              " got '" + summary + "' for call " + std::to_string(reply.seq) +
              " where another shard got '" + found->second + "'");
  }
  const auto own_op = info.ops.find(reply.seq);
  const auto [closed_begin, closed_end] = closed_calls_.equal_range(key);
  const bool closed_out = std::any_of(closed_begin, closed_end, [&](const auto& closed) {
    return !closed.second || own_op == info.ops.end() || *closed.second == own_op->second;
  });
  if (closed_out) {
    violation("consistency: shard " + std::to_string(info.shard) + " of " + info.replica_key + " got '" +
              summary + "' for call " + std::to_string(reply.seq) + " where another shard was told the "
              "replica closed");
  }
  const std::optional<std::uint64_t> closed_at = replicas_[info.replica_key].closed_at_seq;
  if (closed_at && reply.seq > *closed_at && !std::holds_alternative<CloseOk>(reply.outcome)) {
    violation("consistency: shard " + std::to_string(info.shard) + " of " + info.replica_key + " got '" +
              summary + "' for call " + std::to_string(reply.seq) + " after a shard was told at call " +
              std::to_string(*closed_at) + " that the replica closed");
  }
  if (inserted) {
    if (auto op = info.ops.find(reply.seq); op != info.ops.end()) answered_ops_.emplace(key, op->second);
  }
}

void Observer::check_ending(const ClientInfo& info, const Reply& reply, Errc code) {
  const std::pair key{info.replica_key, reply.seq};
  const auto answered = answers_.find(key);
  const std::string who = "consistency: shard " + std::to_string(info.shard) + " of " + info.replica_key;
  if (code == Errc::kReplicaClosed) {
    const auto own = info.ops.find(reply.seq);
    closed_calls_.emplace(key, own == info.ops.end() ? std::nullopt : std::optional<OpKey>(own->second));
    std::optional<std::uint64_t>& closed_at = replicas_[info.replica_key].closed_at_seq;
    closed_at = std::min(closed_at.value_or(reply.seq), reply.seq);
  }
  if (answered == answers_.end()) return;
  // A call its peers got the replica's answer to was decided: closing the replica or evicting it
  // afterwards does not undo that (the hub answers late shards the same).
  if (code == Errc::kReplicaClosed || code == Errc::kReplicaEvicted) {
    violation(who + " was told " + std::string(errc_name(code)) + " for call " + std::to_string(reply.seq) +
              " where another shard got '" + answered->second + "'");
  }
  if (code == Errc::kDivergentCall) {
    const auto own = info.ops.find(reply.seq);
    const auto theirs = answered_ops_.find(key);
    if (own != info.ops.end() && theirs != answered_ops_.end() && own->second == theirs->second) {
      violation(who + " was told its call " + std::to_string(reply.seq) + " diverged although it made the "
                "call another shard got '" + answered->second + "' for");
    }
  }
}

void Observer::on_reply(ClientId client, const Reply& reply) {
  auto found = clients_.find(client);
  if (found == clients_.end()) return;
  ClientInfo& info = found->second;
  ReplicaInfo& replica = replicas_[info.replica_key];
  if (reply.to_open) {
    // The answer to an open: not a transaction of the replica. One to an earlier open of this
    // client (a late or repeated answer) changes nothing.
    if (reply.seq != info.open_seq || info.bound) return;
    info.bound = std::holds_alternative<OpenOk>(reply.outcome);
    // A fresh open is let in only where the hub holds no closing replica of this name and
    // incarnation: a new one begins (the agent's after its resume was told the replica closed).
    if (info.bound && !announced_.contains(client) && replica.bound.empty()) replica.closed_at_seq.reset();
    if (info.bound) {
      replica.bound.insert(client);
      if (info.retention != Retention{}) ++changes_[replica.model];
      on_opened(client, info, replica);
    }
    return;
  }
  const bool first = !answers_.contains({info.replica_key, reply.seq});
  if (auto judged = out_of_order_.find({info.replica_key, reply.seq}); judged != out_of_order_.end()) {
    if (std::holds_alternative<PublishOk>(reply.outcome)) {
      violation("order: " + info.replica_key + " published version " + std::to_string(judged->second.first) +
                " below latest " + std::to_string(judged->second.second) +
                ", which no replica had published (versions increase within a model's life)");
    }
    out_of_order_.erase(judged);
  }
  check_consistency(info, reply);
  if (reply.seq < info.called_seq) return;  // an earlier call answered again: nothing happens
  const Outcome& outcome = reply.outcome;
  auto has_grant = [&](auto predicate) {
    for (auto it = first_grant_of(client); it != grants_.end() && it->first.source == client; ++it) {
      if (predicate(it->second)) return true;
    }
    return false;
  };

  if (std::holds_alternative<UnpublishOk>(outcome) &&
      has_grant([](const ServeRead& serve) { return serve.kind == CopyKind::kPrimary; })) {
    violation("integrity: shard " + std::to_string(info.shard) + " of " + info.replica_key +
              " was told its unpublish returned while a reader may still read its buffers");
  }
  if (std::holds_alternative<CloseOk>(outcome) && has_grant([](const ServeRead&) { return true; })) {
    violation("integrity: shard " + std::to_string(info.shard) + " of " + info.replica_key +
              " was told its close returned while a reader may still read its buffers");
  }
  // The shard left: what it announced at a resume went with it (a replica of the same name and
  // incarnation that opens later holds only what its own shards announce).
  if (std::holds_alternative<CloseOk>(outcome)) announced_.erase(client);
  if (!first) return;
  // State changes, once per call of the replica.
  auto completed = [&](Version version) {
    // A copy marked failed while it was still receiving stays failed once complete.
    if (replica.failed != version) replica.failed.reset();
    replica.held = version;
    replica.reading_across.reset();
    replica.leaving = false;
    completed_[replica.model].insert(version);
  };
  if (const auto* published = std::get_if<PublishOk>(&outcome)) {
    completed(published->version);
  } else if (const auto* replicated = std::get_if<ReplicateOk>(&outcome)) {
    completed(replicated->version);
  } else if (const auto* updated = std::get_if<UpdateOk>(&outcome)) {
    replica.pending_update_seqs.erase(reply.seq);
    if (updated->status == UpdateStatus::kUpdated) {
      if (replica.held && replica.held != updated->version) stop_holding(replica, "update");
      completed(*updated->version);
    } else {
      replica.leaving = false;
    }
  } else if (std::holds_alternative<UnpublishOk>(outcome)) {
    stop_holding(replica, "unpublish");
    replica.leaving = false;
  } else if (std::holds_alternative<CloseOk>(outcome)) {
    // A departure, like a crash: an offload would live in the memory of the process that leaves.
    replica.held.reset();
    replica.reading_across.reset();
    replica.offloads.clear();
    ++changes_[replica.model];
  } else if (std::holds_alternative<Error>(outcome)) {
    // A failed update leaves the previous version held unless the shards were told to read.
    if (replica.pending_update_seqs.erase(reply.seq) > 0 && replica.update_wrote) {
      stop_holding(replica, "failed update");
    }
    replica.leaving = false;
  }
  if (replica.pending_update_seqs.empty()) replica.update_wrote = false;
}

void Observer::on_opened(ClientId client, const ClientInfo& info, ReplicaInfo& replica) {
  if (!announced_.contains(client)) return;
  // Resumed after a failover: the replica holds what every one of its shards announced.
  std::map<Version, std::size_t> primaries;
  std::map<Version, std::pair<std::size_t, std::uint64_t>> offloads;  // holders, the copy's id
  for (const auto& [other, resume] : announced_) {
    if (clients_[other].replica_key != info.replica_key) continue;
    if (resume.primary) ++primaries[resume.primary->version];
    for (const HeldCopy& held : resume.offloads) {
      auto& [holders, copy] = offloads[held.version];
      ++holders;
      copy = held.copy;
    }
  }
  for (const auto& [version, count] : primaries) {
    if (count != replica.num_shards) continue;
    replica.held = version;
    completed_[replica.model].insert(version);
  }
  for (const auto& [version, held] : offloads) {
    if (held.first != replica.num_shards) continue;
    // The new server names the copy (its Offload comes before the open's answer): keep its id.
    ReplicaInfo::OffloadInfo& offload = replica.offloads[version];
    if (offload.copy == 0) offload.copy = held.second;
    offload.complete = true;
    offload.released = false;
    completed_[replica.model].insert(version);
  }
}

void Observer::on_effects(const Effects& effects) {
  for (const Effect& effect : effects) {
    const ClientId client = effect.client;
    std::visit(
        [&](const auto& message) {
          using T = std::decay_t<decltype(message)>;
          if constexpr (std::is_same_v<T, Reply>) {
            on_reply(client, message);
            if (std::holds_alternative<CloseOk>(message.outcome)) leave(client);
          } else if constexpr (std::is_same_v<T, ServeRead>) {
            grants_[Grant{client, message.transfer, message.epoch}] = message;
            // Load: the fan-out limit counts the readers of the source's own datacenter and
            // those of others apart (a seeder's slow read across must not take the local slot).
            const auto source = clients_.find(client);
            if (source == clients_.end()) return;
            const ReplicaInfo& owner = replicas_[source->second.replica_key];
            auto across = [&](const ServeRead& grant) {
              const auto dc = datacenter_of_.find(owner.model + "/" + grant.reader_replica);
              return dc != datacenter_of_.end() && dc->second != owner.datacenter;
            };
            const bool this_across = across(message);
            std::size_t serving = 0;
            for (auto it = first_grant_of(client); it != grants_.end() && it->first.source == client;
                 ++it) {
              if (it->second.kind == message.kind && it->second.version == message.version &&
                  across(it->second) == this_across) {
                ++serving;
              }
            }
            if (serving > fanout_max_) {
              violation("load: a source shard serves " + std::to_string(serving) +
                        " transfers of version " + std::to_string(message.version) + " to readers " +
                        (this_across ? "of other datacenters" : "of its own datacenter") +
                        " with a fan-out limit of " + std::to_string(fanout_max_));
            }
          } else if constexpr (std::is_same_v<T, StopServing>) {
            grants_.erase(Grant{client, message.transfer, message.epoch});
          } else if constexpr (std::is_same_v<T, StartRead>) {
            on_start_read(client, message);
          } else if constexpr (std::is_same_v<T, Offload>) {
            // A new copy, or (after a failover) the new server's id for one the shards hold.
            if (auto found = clients_.find(client); found != clients_.end()) {
              ReplicaInfo& replica = replicas_[found->second.replica_key];
              ReplicaInfo::OffloadInfo& offload = replica.offloads[message.version];
              if (offload.copy != message.copy) {
                offload.released = false;
                if (!offload.complete) offload.reported.clear();
              }
              offload.copy = message.copy;
            }
          } else if constexpr (std::is_same_v<T, ReleaseOffload>) {
            auto found = clients_.find(client);
            if (found == clients_.end()) return;
            ReplicaInfo& replica = replicas_[found->second.replica_key];
            auto offload = replica.offloads.find(message.version);
            // A release of another copy than the one the shard holds frees nothing (the agent
            // compares ids): only the copy it names goes, and each shard told is checked.
            if (offload == replica.offloads.end() || offload->second.copy != message.copy) return;
            // Released by a close in progress (the hub dropped the copy when the close began and
            // answers a late report of it so): the departure the CloseOk will announce, already
            // made, and the same change of rules for the replicas that leave meanwhile.
            if (replica.closing && offload->second.complete) ++changes_[replica.model];
            for (auto it = first_grant_of(client); it != grants_.end() && it->first.source == client;
                 ++it) {
              if (it->second.kind == CopyKind::kOffload && it->second.version == message.version) {
                violation("integrity: an offload copy of version " +
                          std::to_string(message.version) +
                          " was released while a reader may still read it");
              }
            }
            offload->second.complete = false;
            offload->second.released = true;
          } else if constexpr (std::is_same_v<T, Evicted>) {
            // About the binding of an earlier open of this client (the one that ended it, a newer
            // session or incarnation, was seen already): nothing of the current one changes.
            auto found = clients_.find(client);
            if (found != clients_.end() && effect.session < found->second.open_session) return;
            drop_grants_of(client);
            announced_.erase(client);  // what it held went with it; a new shard announces anew
            if (found != clients_.end()) {
              leave(client);
              ReplicaInfo& replica = replicas_[found->second.replica_key];
              replica.held.reset();
              replica.offloads.clear();
              replica.leaving = false;
              replica.reading_across.reset();
              ++changes_[replica.model];
            }
          } else if constexpr (std::is_same_v<T, CopyCorrupt>) {
            // Judged by the simulation where the agent hands it to its worker (check_corrupt_notice),
            // which knows which faults changed whose bytes; nothing here depends on it.
          } else {
            static_assert(!std::is_same_v<T, T>, "a new Message: say what the observer checks of it");
          }
        },
        effect.message);
  }
  std::vector<std::pair<ClientId, StartRead>> checks;
  checks.swap(sources_to_check_);
  for (const auto& [client, read] : checks) {
    if (auto problem = source_problem(client, read)) violation(std::move(*problem));
  }
}

void Observer::on_start_read(ClientId client, const StartRead& read) {
  auto found = clients_.find(client);
  if (found == clients_.end()) return;
  const ClientInfo& info = found->second;
  ReplicaInfo& reader = replicas_[info.replica_key];
  // The same instruction sent again (the client asked again) repeats an earlier decision.
  auto earlier = reads_.find({client, read.transfer});
  if (earlier != reads_.end() && earlier->second.epoch == read.epoch) return;
  reads_[{client, read.transfer}] = read;
  if (read.offload_copy != 0) {
    // Offload seeding: a new CPU copy is filled; the registered buffers are untouched.
    ReplicaInfo::OffloadInfo& offload = reader.offloads[read.version];
    if (offload.copy != read.offload_copy) {
      offload = ReplicaInfo::OffloadInfo{};
      offload.copy = read.offload_copy;
    }
  } else {
    on_buffer_read(client, info, reader, read);
    if (!read.reshard.empty()) {
      reader.reading_across = ReplicaInfo::Across{read.version, read.transfer, read.epoch};
    } else if (reader.reading_across &&
               (reader.reading_across->transfer != read.transfer || reader.reading_across->epoch < read.epoch)) {
      reader.reading_across.reset();
    }
  }
  if ((!read.reshard.empty() || read.source.partial) && source_problem(client, read)) {
    sources_to_check_.emplace_back(client, read);
  }
  check_topology(info, reader, read);
}

std::optional<std::string> Observer::source_problem(ClientId client, const StartRead& read) {
  auto found = clients_.find(client);
  if (found == clients_.end()) return std::nullopt;
  const ClientInfo& info = found->second;
  const ReplicaInfo& reader = replicas_[info.replica_key];
  const std::string source_key =
      reader.model + "/" + read.source.replica + "#" + std::to_string(read.source.incarnation);
  auto source = replicas_.find(source_key);
  if (source == replicas_.end()) return std::nullopt;
  const ReplicaInfo& held = source->second;
  const std::string who = "layouts: shard " + std::to_string(info.shard) + " of " + info.replica_key +
                          " is told to read version " + std::to_string(read.version) + " from " + source_key;
  if (!read.reshard.empty()) {
    auto offload = held.offloads.find(read.version);
    const bool complete = read.source.kind == CopyKind::kOffload
                              ? offload != held.offloads.end() && offload->second.complete
                              : held.held == read.version;
    if (!complete) return who + " across layouts, which holds no complete copy of it";
    if (read.reshard.size() != held.num_shards) {
      return who + " across layouts, listing " + std::to_string(read.reshard.size()) + " of its " +
             std::to_string(held.num_shards) + " shards";
    }
  } else if (read.source.partial && held.reading_across && held.reading_across->version == read.version &&
             held.held != read.version) {
    return who + " as a pipeline source, which itself reads it from a copy of another layout";
  }
  return std::nullopt;
}

void Observer::on_buffer_read(ClientId client, const ClientInfo& info, ReplicaInfo& reader,
                              const StartRead& read) {
  if (!reader.pending_update_seqs.empty()) reader.update_wrote = true;
  // Integrity: the reader's buffers are about to be overwritten with `read.version`.
  for (const auto& [grant, serve] : grants_) {
    if (grant.source == client && serve.kind == CopyKind::kPrimary && serve.version != read.version) {
      violation("integrity: " + info.replica_key + " is told to overwrite its buffers while a reader "
                "may still read version " + std::to_string(serve.version) + " from them");
    }
  }
  if (read.source.kind == CopyKind::kPrimary && read.source.replica == reader.name) {
    violation("topology: " + info.replica_key + " is told to read from itself");
  }
}

void Observer::check_topology(const ClientInfo& info, const ReplicaInfo& reader,
                              const StartRead& read) {
  // Topology: another datacenter only when no complete, healthy copy is in the reader's own.
  if (read.source.datacenter != reader.datacenter) {
    for (const auto& [key, other] : replicas_) {
      if (&other == &reader || other.model != reader.model) continue;
      if (other.datacenter == reader.datacenter && other.held == read.version && !other.leaving &&
          other.failed != read.version) {
        violation("topology: " + info.replica_key + " reads version " +
                  std::to_string(read.version) + " from datacenter '" + read.source.datacenter +
                  "' although " + other.name + " holds it in '" + reader.datacenter + "'");
      }
    }
  }
}

void Observer::on_latest(const std::string& model, std::optional<Version> latest, TimeMs now_ms) {
  const bool bound = std::any_of(replicas_.begin(), replicas_.end(), [&](const auto& entry) {
    return entry.second.model == model && !entry.second.bound.empty();
  });
  if (bound) {
    unbound_since_.erase(model);
  } else {
    unbound_since_.try_emplace(model, now_ms);
  }
  std::optional<Version>& previous = hub_latest_[model];
  if (previous && !latest) {
    // The model ended (its versions forgotten): only once it had no replica for the grace, which
    // the hub counts from later than any shard's last binding seen here.
    const auto since = unbound_since_.find(model);
    if (since == unbound_since_.end() || now_ms - since->second < model_grace_ms_) {
      violation("monotonicity: latest of model " + model + " moved from " + std::to_string(*previous) +
                " to nothing while " +
                (since == unbound_since_.end() ? std::string("shards of it were bound")
                                               : "no shard of it was bound for " +
                                                     std::to_string(now_ms - since->second) + " ms of a " +
                                                     std::to_string(model_grace_ms_) + " ms grace"));
    }
    // A new life: what it knew is gone with it (a publish judged in the old one included).
    completed_.erase(model);
    named_versions_.erase(model);
    std::erase_if(out_of_order_, [&](const auto& entry) { return entry.first.first.rfind(model + "/", 0) == 0; });
  } else if (previous && *latest < *previous) {
    violation("monotonicity: latest of model " + model + " moved from " + std::to_string(*previous) + " to " +
              std::to_string(*latest));
  }
  previous = latest;
}

void Observer::on_server_reset(bool answers_delivered) {
  if (!answers_delivered) {
    answers_.clear();
    answered_ops_.clear();
    closed_calls_.clear();
  }
  grants_.clear();
  reads_.clear();
  hub_latest_.clear();
  completed_.clear();
  announced_.clear();
  out_of_order_.clear();  // the new server learns versions in any order: a retried publish is new there
  for (auto& [key, replica] : replicas_) {
    replica.held.reset();
    replica.offloads.clear();
    replica.leaving = false;
    replica.failed.reset();
    replica.pending_update_seqs.clear();
    replica.update_wrote = false;
    replica.reading_across.reset();
    replica.bound.clear();  // the new server binds the shards anew
    if (!answers_delivered) replica.closed_at_seq.reset();
  }
  for (auto& [client, info] : clients_) info.bound = false;
}

}  // namespace th::sim
