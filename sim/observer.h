// Checks DESIGN.md §5 from the outside: it sees only what clients send and what the hub tells them,
// and keeps its own (conservative) view of who holds what. It never reads the hub's internals, so a
// hub whose bookkeeping is wrong cannot fool it.
//
//   integrity    no grant to read a replica's buffer is active when the replica is told its
//                unpublish/close returned, or is told to overwrite that buffer, or to free an offload
//   retention    when a non-spot holder of a retained version stops holding it by unpublish or update,
//                some other non-spot holder or an offload copy still holds it (close and crashes are
//                departures: what the leaving process held goes with it)
//   consistency  the shards of a replica get equal answers to the same call; a shard is told its
//                replica closed or was evicted only while no peer got the replica's answer, and
//                that its call diverged only if it made another call than the peer that did
//   load         a source shard serves at most fanout_max transfers at once
//   topology     a reader is sent to another datacenter only when no complete, healthy copy is in its own
//   layouts      a reader of another layout is sent to a complete copy, with every shard of it
//                (StartRead::reshard); a copy that reads another layout is no pipeline source
//   monotonicity `latest` never decreases on one server; it goes back to nothing only when the
//                model ends, once no shard of it was bound for the model grace
//   order        no publish is accepted of a version below latest that no replica had published,
//                been answered or announced (versions increase within a model's life)
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "core/messages.h"

namespace th::sim {

class Observer {
 public:
  explicit Observer(std::uint32_t fanout_max, TimeMs model_grace_ms = HubSettings{}.model_grace_ms)
      : fanout_max_(fanout_max), model_grace_ms_(model_grace_ms) {}

  void on_open(ClientId client, std::uint64_t seq, std::uint64_t session, const OpenRequest& request);
  void on_call(ClientId client, std::uint64_t seq, const RequestBody& body);
  void on_report(ClientId client, const ReportBody& body);
  void on_effects(const Effects& effects);
  void on_latest(const std::string& model, std::optional<Version> latest, TimeMs now_ms);
  // A new, empty server replaced the old one (failover): server-scoped expectations start over.
  // Where the network loses messages, an answer of the old server may never have reached its client,
  // which then asks the new server: answers are compared across the failover only when every
  // answer is known to have been delivered.
  void on_server_reset(bool answers_delivered = true);

  const std::vector<std::string>& violations() const { return violations_; }

 private:
  struct ClientInfo {
    std::string replica_key;  // model/replica#incarnation
    std::uint32_t shard = 0;
    std::uint64_t open_seq = 0;
    std::uint64_t open_session = 0;
    Retention retention;
    bool bound = false;  // from the OpenOk reply until eviction or close
    // The latest call this client made: the hub answers a late retransmission of an earlier call
    // again, which tells a client that moved on nothing (its agent ignores it).
    std::uint64_t called_seq = 0;
    // What it called as its recent calls (by number), to tell a divergent call from a same one.
    std::map<std::uint64_t, OpKey> ops;
  };
  struct ReplicaInfo {
    std::string model;
    std::string name;
    std::uint64_t incarnation = 0;
    std::string datacenter;
    bool spot = false;
    std::uint32_t num_shards = 1;
    std::optional<Version> held;     // complete copy, as the replies said
    bool leaving = false;            // an unpublish/update/close may be draining the held copy
    std::uint64_t leaving_rules = 0; // the model's changes_ when that call was made
    // A shard called close: from then on the hub may drop what the replica holds (a close is never
    // refused and may take the last copy of a retained version) before the CloseOk says so.
    bool closing = false;
    std::optional<Version> failed;   // a reader could not read this replica's copy of this version
    // Offload copies by version (a replica holds at most one of each): the id the hub names it by
    // (its latest Offload instruction), the shards that reported it made, and whether it is
    // complete. A ReleaseOffload or OffloadDone naming another id is about an earlier copy.
    struct OffloadInfo {
      std::uint64_t copy = 0;
      std::set<std::uint32_t> reported;
      bool complete = false;
      bool released = false;
    };
    std::map<Version, OffloadInfo> offloads;
    std::set<std::uint64_t> pending_update_seqs;
    bool update_wrote = false;       // a StartRead arrived during the pending update: buffers changed
    // The copy it is receiving is read from a copy of another layout (the latest StartRead of its
    // registered buffers listed a reshard): until complete, it serves nobody.
    struct Across {
      Version version = 0;
      TransferId transfer = 0;
      std::uint32_t epoch = 0;
    };
    std::optional<Across> reading_across;
    std::set<ClientId> bound;        // shards between OpenOk and CloseOk/eviction
    // The first call a shard was told "replica closed" for: closing ends an incarnation, so no
    // later call of it is answered as if it lived on (a close joins the closing, CloseOk).
    std::optional<std::uint64_t> closed_at_seq;
  };
  struct Grant {
    ClientId source;
    TransferId transfer;
    std::uint32_t epoch;
    friend auto operator<=>(const Grant&, const Grant&) = default;
  };

  void violation(std::string what) { violations_.push_back(std::move(what)); }
  void on_reply(ClientId client, const Reply& reply);
  void on_start_read(ClientId client, const StartRead& read);
  void on_buffer_read(ClientId client, const ClientInfo& info, ReplicaInfo& reader,
                      const StartRead& read);
  void check_topology(const ClientInfo& info, const ReplicaInfo& reader, const StartRead& read);
  // What is wrong with the source a read across layouts or a pipelined read was sent to, if
  // anything: judged when the instruction is seen and, if wrong then, again once every effect of
  // its step is (the answer that completes a copy may follow the instruction that reads it, and
  // a copy may be withdrawn later in the step that chose it).
  std::optional<std::string> source_problem(ClientId client, const StartRead& read);
  void on_opened(ClientId client, const ClientInfo& info, ReplicaInfo& replica);
  void check_consistency(const ClientInfo& info, const Reply& reply);
  // An error that ends the call for this shard alone, beside its peers' answers.
  void check_ending(const ClientInfo& info, const Reply& reply, Errc code);
  void stop_holding(ReplicaInfo& replica, const char* why);
  bool retained(const std::string& model, Version version) const;
  std::size_t safe_holders(const std::string& model, Version version, const ReplicaInfo* except) const;
  void drop_grants_of(ClientId client);
  std::map<Grant, ServeRead>::iterator first_grant_of(ClientId client);
  // A shard left (close, eviction). When the last one leaves, the hub forgets the replica, and a
  // later open with the same name and incarnation starts a new one: its answers start afresh.
  void leave(ClientId client);

  std::uint32_t fanout_max_;
  TimeMs model_grace_ms_;
  std::map<std::string, TimeMs> unbound_since_;  // per model: since when no shard of it is bound
  std::map<ClientId, ClientInfo> clients_;
  std::map<std::string, ReplicaInfo> replicas_;
  // model/replica -> the datacenter its latest open named (a grant names its reader by name).
  std::map<std::string, std::string> datacenter_of_;
  std::map<Grant, ServeRead> grants_;
  std::map<std::pair<ClientId, TransferId>, StartRead> reads_;  // the latest per reader and transfer
  std::vector<std::pair<ClientId, StartRead>> sources_to_check_;  // this step's (check_source)
  std::map<ClientId, Resume> announced_;                          // what resumed clients announced
  std::map<std::pair<std::string, std::uint64_t>, std::string> answers_;  // (replica, seq) -> summary
  // (replica, seq) -> the call of the shard that got that answer first; and the calls a shard was
  // told the replica closed.
  std::map<std::pair<std::string, std::uint64_t>, OpKey> answered_ops_;
  // (A shard's call, where known: one whose program diverged was told "closed" about another call.)
  std::multimap<std::pair<std::string, std::uint64_t>, std::optional<OpKey>> closed_calls_;
  std::map<std::string, std::set<Version>> completed_;  // per model: versions complete (replies)
  // Counts, per model, opens that added a retention rule and departures (close, eviction). The hub
  // decides on an offload at some point while a call runs; a rule added or a holder gone meanwhile
  // may or may not have counted, so such a call is not judged.
  std::map<std::string, std::uint64_t> changes_;
  std::map<std::string, std::optional<Version>> hub_latest_;
  // Per model: versions some replica called publish with, was answered, or announced at a resume
  // (what the hub may know; generous, so that order is judged only where it surely applies).
  std::map<std::string, std::set<Version>> named_versions_;
  // (replica, seq) of publishes that named an unknown version below latest as they were called:
  // the hub must not accept them.
  std::map<std::pair<std::string, std::uint64_t>, std::pair<Version, Version>> out_of_order_;
  std::vector<std::string> violations_;
};

}  // namespace th::sim
