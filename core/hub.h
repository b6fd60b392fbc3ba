// The reference server as a pure state machine.
//
//   hub.step(input, now_ms, effects)
//
// consumes one input (a client request, a data-plane report, a connection loss, or a clock tick) and
// appends what must happen as a result to `effects`: replies to requests, and instructions to clients
// ("read shard 3 of version 7 from replica r2", "offload version 7", "serve this grant"). It performs
// no I/O, reads no clock and draws no random numbers, so the server, the simulator and the property
// tests run exactly the same code. See hub_state.h for the states and transitions of copies and
// DESIGN.md §5 for the invariants `check_invariants` verifies.
//
// Calls and how they block (a reply is an Effect carrying a Reply with the request's seq):
//   open       immediate, except when resuming after a failover: waits until every shard re-opened
//              (Errc::kBarrierTimeout after settings.barrier_timeout_ms)
//   (any call) taken only once every shard of the replica has opened: until then it waits, and if
//              the others do not open within settings.barrier_timeout_ms of the first call that
//              waits, the replica is evicted with kBarrierTimeout
//   publish    when every shard of the replica has published (the version is then visible)
//   unpublish  when no transfer reads the replica's copy any more, after an offload if retention needs
//   replicate  when the version exists and every shard has received it; a lost version fails with
//              kVersionUnavailable; an optional timeout fails with kTimeout. `latest-k` is the k-th
//              newest version that exists (was ever complete), whatever the numbers skipped, or if
//              no copy of it is left the newest older one a copy is left of (the answer names it). With
//              smart skipping, readers do not pipeline behind a copy still seeding across
//              datacenters: they wait for it, then read at local speed
//   update     at once with kNoNewerVersion / kNotYet, else like unpublish followed by replicate;
//              if it fails before the shards were told to read (no StartRead), the replica still
//              holds its previous version; once reading began, it holds nothing. UpdateOk names
//              the version held afterwards, or none (holding nothing is not version 0)
//   list       immediate
//   wait       when the predicate holds (or its timeout, or kVersionUnavailable). kRoleHolds is
//              not vacuous: it holds only once some open replica plays the role and every such
//              replica holds the version or a newer one
//   close      when the replica's copies have drained; a departure: no offload is made, since it
//              would live in the memory of the process that leaves. Never refused: a replica
//              leaves as it may crash, without anyone's consent (paper §2: rollouts join and
//              leave without the trainer's awareness). The last non-spot copy of a version
//              another replica's rule retains leaves with it, as with a crash (DESIGN.md §5,
//              invariant 2 holds while a holder exists): counted (retained_versions_left), and
//              named in the kVersionUnavailable of the readers it fails. A trainer that must not
//              lose its last version waits first for a non-spot replica to hold it
// Every call of a replica is a transaction: its shards get identical answers.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <tuple>
#include <vector>

#include "core/client_table.h"
#include "core/hub_state.h"
#include "core/messages.h"
#include "core/types.h"

namespace th {

struct HubStats {
  std::uint64_t requests = 0;
  std::uint64_t reports = 0;
  std::uint64_t transfers_started = 0;
  std::uint64_t transfers_completed = 0;
  std::uint64_t source_failures = 0;
  std::uint64_t offloads_started = 0;
  std::uint64_t seeds_started = 0;  // offload seeding: CPU copies read across datacenters
  std::uint64_t evictions = 0;
  std::uint64_t calls_cancelled = 0;  // calls a shard cancelled (CancelCall)
  std::uint64_t models_forgotten = 0;  // models that ended (no replica for model_grace_ms)
  std::uint64_t readers_revoked = 0;   // reads of a draining copy cut at its drain grace
  // Closes that took the last non-spot copy of a version another replica's rule retained (see
  // close, above); readers still pulling from the closing copy as it drains may yet keep it.
  std::uint64_t retained_versions_left = 0;
  // Copies whose bytes failed readers' checksums twice; their owners are told (CopyCorrupt).
  std::uint64_t copies_found_corrupt = 0;
  // Rate-aware source selection: reads placed past a copy much slower than their reader, and
  // slow readers that gave their source to a faster one and read behind it.
  std::uint64_t slow_sources_passed = 0;
  std::uint64_t transfers_displaced = 0;
  std::uint64_t progress_reports = 0;  // TransferProgress heard (once per shard and epoch)
  std::uint64_t passed_mid_read = 0;   // of transfers_displaced: on a read's progress (pass_mid_read)
  std::uint64_t progress_claims_refuted = 0;  // reads whose progress claimed more than arrived
  // Delta versions (hub_patches.cpp): copies published with a patch, reads placed as patch reads,
  // patch reads that failed (the transfer went on with the bytes), readers that kept the patch.
  std::uint64_t patches_published = 0;
  std::uint64_t patch_reads_started = 0;
  std::uint64_t patch_reads_failed = 0;
  std::uint64_t patches_kept = 0;
};

// Who a client is (th-server's transfer timeline and metrics).
struct ClientIdentity {
  std::string model;
  std::string replica;
  std::uint64_t incarnation = 0;
  std::uint32_t shard = 0;
  std::string datacenter;
  std::string role;
  // What a transfer of this shard moves: the model's layout of the shard once a version of it
  // completed somewhere; 0 before.
  std::uint64_t shard_bytes = 0;
};

// What is in flight right now (th-ctl, liveness checks).
struct HubActivity {
  std::size_t transfers_gathering = 0;  // waiting for the reader's shards to call
  std::size_t transfers_waiting = 0;    // waiting for a source
  std::size_t transfers_active = 0;
  std::size_t copies_draining = 0;
  std::size_t copies_offloading = 0;
  std::size_t calls_unresolved = 0;     // replicate of a version that does not exist yet
  std::size_t calls_waiting = 0;        // wait() whose predicate does not hold yet
};

class Hub {
 public:
  // A seed's read instructions are repeated to a shard at most this often (see resend_seed_reads).
  static constexpr TimeMs kSeedResendMs = 3000;

  explicit Hub(HubSettings settings);
  Hub(const Hub&) = delete;
  Hub& operator=(const Hub&) = delete;
  ~Hub();

  // `now_ms` must not decrease from one call to the next.
  void step(const Input& input, TimeMs now_ms, Effects& effects);

  // ---- Read-only introspection (th-ctl, tests, simulator checkers) ----
  const HubSettings& settings() const { return settings_; }
  std::optional<Version> latest(std::string_view model) const;
  std::optional<ListSnapshot> snapshot(std::string_view model) const;
  std::vector<std::string> model_names() const;  // in name order
  bool retained(std::string_view model, Version version) const;
  const HubStats& stats() const { return stats_; }
  HubActivity activity() const;
  // The tensor descriptions kept (HubSettings::description_bytes_max): of all models, of one.
  std::uint64_t description_bytes() const { return description_bytes_; }
  std::uint64_t description_bytes(std::string_view model) const;
  std::size_t client_count() const { return clients_.size(); }
  bool has_client(ClientId client) const { return clients_.find(client) != nullptr; }
  std::optional<ClientIdentity> identify(ClientId client) const;
  // Whether `client` is open in `session` (its reports of that session count).
  bool has_session(ClientId client, std::uint64_t session) const;

  // Verifies every structural invariant; throws AssertionFailure naming the first that fails.
  void check_invariants() const;

 private:
  using Model = detail::Model;
  using Replica = detail::Replica;
  using Copy = detail::Copy;
  using Transfer = detail::Transfer;
  using Txn = detail::Txn;
  using VersionRecord = detail::VersionRecord;

  struct Resolution;
  enum class Pick : std::uint8_t;
  struct SourceChoice;

  // Inputs.
  void on_request(const Request& request);
  void take_request(const Request& request);  // also the calls that waited for every shard
  void on_open(ClientId client, std::uint64_t seq, std::uint64_t session, const OpenRequest& open);
  void on_report(const Report& report);
  void on_tick();
  void on_transfer_done(Replica& replica, std::uint32_t shard, const TransferDone& done);
  void on_transfer_failed(Replica& replica, std::uint32_t shard, const TransferFailed& failed);
  void on_offload_done(Replica& replica, std::uint32_t shard, const OffloadDone& done);
  void on_cancel_call(Replica& replica, std::uint32_t shard, const CancelCall& cancel);
  void on_transfer_progress(Replica& replica, std::uint32_t shard, const TransferProgress& progress);

  // Transactions.
  Txn* txn_for(Replica& replica, std::uint32_t shard, std::uint64_t seq, const OpKey& op);
  void arrive(Replica& replica, Txn& txn, std::uint32_t shard, const RequestBody& body);
  void on_publish(Replica& replica, Txn& txn, std::uint32_t shard, const PublishRequest& request);
  void on_unpublish(Replica& replica, Txn& txn);
  void on_replicate(Replica& replica, Txn& txn, std::uint32_t shard, const ReplicateRequest& request);
  void on_update(Replica& replica, Txn& txn, std::uint32_t shard, const UpdateRequest& request);
  bool continue_receive(Replica& replica, Txn& txn, std::uint32_t shard, const LayoutRef& layout);
  void on_wait(Replica& replica, Txn& txn, const WaitRequest& request);
  void on_close(Replica& replica, Txn& txn);
  void finish(Replica& replica, Txn& txn, Outcome outcome);
  void abort_txn(Replica& replica, Txn& txn, const Error& error);
  void send_reply(Replica& replica, std::uint32_t shard, std::uint64_t seq, const Outcome& outcome,
                  bool to_open = false, bool released = false);
  // The answer to the shard's open (OpenOk, or why the replica cannot go on).
  void answer_open(Replica& replica, std::uint32_t shard, const Outcome& outcome) {
    send_reply(replica, shard, replica.shards[shard].open_seq, outcome, /*to_open=*/true);
  }
  void collect_txn(Replica& replica, std::uint64_t seq);
  void become_whole(Replica& replica);
  bool record_layout(Replica& replica, Txn& txn, std::uint32_t shard, const LayoutRef& layout);

  // Versions, sources and transfers.
  Resolution resolve(const Model& model, const Selector& selector) const;
  void try_resolve(Replica& replica, Txn& txn);
  void begin_receive(Replica& replica, Txn& txn, Version version);
  void maybe_start_transfer(Replica& replica, Txn& txn);
  bool settle_layout(Replica& replica, Txn& txn);
  void try_assign(Transfer& transfer);
  SourceChoice select_source(const Transfer& transfer) const;
  void assign(Transfer& transfer, Copy& source);
  // Both halves of a shard's grant: ServeRead to the source, StartRead to the reader.
  void emit_grant(const Transfer& transfer, std::uint32_t shard);
  void emit_start_read(const Transfer& transfer, std::uint32_t shard);
  GrantSecret grant_secret(const Transfer& transfer) const;
  void resend_instructions(Replica& replica, std::uint32_t shard);
  // `now`: whatever the time of the last repeat.
  void resend_seed_reads(Replica& replica, std::uint32_t shard, bool now);
  void detach_source(Transfer& transfer);
  // The transfer looks for another source (in settle()); `failed`: its source failed it.
  void reassign(Transfer& transfer, bool failed = true);
  // Rate-aware source selection (hub_rates.cpp).
  void measure_shard_read(Transfer& transfer, std::uint32_t shard);
  void record_receive_rate(const Transfer& transfer);
  // How many other readers the transfer's source served during its read (hub_rates.cpp).
  std::uint64_t readers_shared_with(const Transfer& transfer) const;
  // Sets the replica's rate, keeping its model's set of exact rates in step.
  void set_receive_rate(Replica& replica, double bytes_per_ms, bool exact, bool provisional);
  // Whether the transfer's source is alone with it, complete and of its layout: its reader sets its
  // own pace.
  bool alone_at_complete(const Transfer& transfer) const;
  // A reader behind a copy still receiving that the hub now knows is slower (or cannot compare)
  // takes that copy's source in the middle of the read, and the copy looks for another (the
  // progress of a version's first chain, hub_rates.cpp): whether it did.
  bool pass_mid_read(Transfer& faster);
  // Whether `behind`, reading from `ahead`'s copy, kept that copy's pace on every shard it reads
  // (each timed by its progress report).
  bool kept_pace(const Transfer& behind, const Transfer& ahead) const;
  // At the end of a shard's read under this epoch: whether its progress report claimed more than
  // could have arrived (Transfer::progress_refuted).
  void check_progress_claim(Transfer& transfer, std::uint32_t shard);
  // What a wrong "slower" would cost: a reorder (the reader goes ahead of the candidate, and is
  // timed) or a shared source (the reader passes over the candidate for a busier source).
  enum class Risk : std::uint8_t { kReorder, kShare };
  // Whether `candidate` is known to receive at under 1/factor of `reader`'s rate.
  bool slower(const Replica& candidate, const Replica& reader, double factor, Risk risk) const;
  bool much_slower(const Replica& candidate, const Replica& reader) const;
  // Whether `reader` may be faster than `candidate`, which nothing measured can say: it goes
  // ahead of it to find out (insertion_point only).
  bool unexplored(const Replica& candidate, const Replica& reader) const;
  // Whether the copy, still receiving, or one on its chain (the nearest few) is much slower.
  bool slow_chain(const Copy& candidate, const Copy& reader) const;
  // Whether a receiving copy may give its source away (its transfer is local, of its own layout,
  // and has not done so too often), and to this reader.
  bool movable(const Copy& slow) const;
  bool displaceable(const Copy& slow, const Copy& reader) const;
  // Whether the copy is in the first part of its read (its rate known), where reading again is cheap.
  bool early(const Copy& slow) const;
  // The copy nearest the root on `candidate`'s chain that is slower than `reader` and gives it its
  // place (null: none).
  Copy* insertion_point(Copy& candidate, const Copy& reader) const;
  // `faster`'s reader takes `slower`'s source, and `slower` reads behind it.
  void put_ahead(Transfer& faster, Transfer& slower);
  // The transfer leaves its source and waits, its verified shards kept (for put_ahead, pass_mid_read).
  void unhook(Transfer& moving);
  void keep_one_seeder(const Copy& seeder);
  void complete_transfer(Transfer& transfer);
  void fail_transfer(Transfer& transfer, const Error& error);
  void undrain(Replica& replica);
  void restore_previous(Replica& replica, Version version, const detail::CopyHealth& health);
  void enqueue_waiting(Transfer& transfer);
  void dequeue_waiting(Transfer& transfer);
  bool smart_skip(const VersionRecord& record, detail::DcId dc) const;
  // Offload seeding: whether this update would be the first read of the version into the
  // replica's datacenter, and so reads it into a CPU copy in the background instead.
  bool wants_seed(const VersionRecord& record, const Replica& replica, const detail::ModelLayout& layout) const;
  void start_seed(Replica& replica, VersionRecord& record);
  // Whether an offload seed may still be consumed by its owner (see reconcile_offloads).
  bool seed_needed(const Copy& seed) const;
  // Stops and frees the replica's seeds still being read that `match`.
  void release_unfinished_seeds(Replica& replica, const std::function<bool(const Copy&)>& match);

  // Copies.
  Copy& create_copy(Replica& owner, VersionRecord& record, CopyKind kind, detail::CopyState state);
  void remove_copy(Copy& copy);
  void set_state(Copy& copy, detail::CopyState state);
  // Whether `copy` may take one more reader of its own datacenter (`across` false) or of another
  // (true): the fan-out limit counts each side apart (Copy::readers_across).
  bool has_slot(const Copy& copy, bool across) const;
  // `transfer` starts (+1) or stops (-1) reading from `source`.
  void count_reader(Copy& source, const Transfer& transfer, int delta);
  void set_failed(Copy& copy);
  // A reader found shard `shard` of `copy` failing the version's checksums (see Copy::corrupt).
  void on_mismatch(Copy& copy, std::uint32_t shard);
  // A reader of another layout found a piece of `copy` failing its checksum, or assembled bytes
  // that a copy of its own layout does not hold: it read from every shard and names none.
  void on_reshard_mismatch(Copy& copy);
  // Tells the shard at fault of a whole copy becoming corrupt (CopyCorrupt).
  void tell_corrupt(const Copy& copy, std::uint32_t shard);
  void reindex(Copy& copy);
  detail::Contribution contribution(const Copy& copy) const;
  void apply(Copy& copy, const detail::Contribution& contribution, int sign);
  void on_copy_complete(Copy& copy);
  void start_drain(Copy& copy, detail::DrainPurpose purpose);
  void on_drained(Copy& copy);
  // `health`: what readers found of the primary copy that drained.
  void after_primary_drained(Replica& replica, detail::DrainPurpose purpose,
                             const detail::CopyHealth& health);
  Copy& start_offload(Replica& replica, VersionRecord& record);
  Copy* releasing_offload(const Replica& replica, Version version) const;
  Copy* failed_offload(const Replica& replica, Version version) const;
  bool needs_offload(const Copy& copy) const;
  // An offload copy draining to be released that is again the last safe copy of a retained
  // version (the copy that made it redundant went first).
  bool offload_needed_again(const Copy& offload) const;

  // Delta versions (hub_patches.cpp).
  struct PatchSource {
    Copy* copy = nullptr;  // a holder of the reader's patch with a free slot
    bool wait = false;     // none is free, but one in the reader's datacenter will be
  };
  Status check_patch(const Replica& replica, Version version, std::uint32_t shard, const LayoutRef& layout,
                     const PatchRef& patch) const;
  // A publish completes: its shards' patches become the copy's if every shard announced one.
  void commit_patches(Copy& copy);
  // A replica re-opened (failover) holding `copy` whole: the patches its shards say they keep.
  void resume_patches(const Replica& replica, Copy& copy);
  // The version an update's reader may read a patch against: the one its buffers hold whole.
  std::optional<Version> patch_base(const Replica& replica, const Txn& txn) const;
  bool holds_patch(const Copy& candidate, const Transfer& transfer) const;
  bool reading_patch(const Copy& candidate, const Transfer& transfer) const;
  PatchSource patch_source(const Transfer& transfer, const std::function<bool(const Copy*)>& usable) const;
  void on_patch_read_failed(Transfer& transfer, ReadFailure reason);
  // A shard finished a patch read under the current epoch.
  void patch_read_done(Transfer& transfer);
  // A transfer completes: a reader whose every shard applied a patch keeps it, to serve onwards.
  void keep_patch(Copy& reader, const Transfer& transfer);

  // Layouts (hub_layouts.cpp).
  // Why shard `shard`'s tensors cannot be of `replica`'s layout, known before its peers described
  // theirs: another than the replica's, or not pieces and unlike every layout of its shard count.
  std::optional<Error> early_layout_mismatch(const Replica& replica, std::uint32_t shard,
                                             const LayoutRef& layout) const;
  // The model's layout these shards' layouts make (refined by them), or a new one if they are all
  // pieces. Null entries (shards unknown after a failover) only match a layout the model has.
  Result<detail::ModelLayout*> layout_for(Model& model, const std::vector<LayoutRef>& shards);
  void relate(Model& model, detail::ModelLayout& layout);
  // Gives the replica its layout, recounting what its copies add to their versions.
  void set_layout(Replica& replica, detail::ModelLayout* layout);
  // The model's first layout of `num_shards` shards that the shards' layouts so far match (null
  // entries: not described yet), or null.
  static detail::ModelLayout* known_layout(const Model& model, const std::vector<LayoutRef>& shards,
                                           std::uint32_t num_shards);
  static std::optional<std::string> reads_across(const detail::ModelLayout& reader,
                                                 const detail::ModelLayout& source);
  // Whether `reader` may read from `candidate` (its layout, or a complete copy of one it reads).
  bool serves(const Copy& candidate, const Copy& reader) const;
  // Whether `reader` may read from `candidate` once that is complete: its layout, or one it reads.
  bool serves_once_complete(const Copy& candidate, const Copy& reader) const;
  // Whether some copy the reader may read holds, or will hold without reading another, every byte.
  bool may_complete(const Copy& reader) const;
  // Why replicas of `wanted` (a layout of the model, or one it would make: id kNoLayout) can read
  // no copy of the version: no layout that holds it (a complete copy made its checksums) serves them.
  std::optional<std::string> unreadable(const detail::ModelLayout& wanted, const Model& model,
                                        const VersionRecord& record) const;
  Status check_shard(const Replica& replica, const VersionRecord& record, std::uint32_t shard,
                     const LayoutRef& layout, const ChecksumsRef& checksums) const;
  Status check_checksums(const VersionRecord& record, const detail::ModelLayout& layout, std::uint32_t shard,
                         const LayoutRef& tensors, const ChecksumsRef& checksums) const;
  static void commit_checksums(VersionRecord& record, const detail::ModelLayout& layout, std::uint32_t shard,
                               const ChecksumsRef& checksums);
  static const ChecksumsRef& checksums_of(const VersionRecord& record, const detail::ModelLayout& layout,
                                          std::uint32_t shard);
  // Every shard of the layout has the version's checksums.
  static bool vouched(const VersionRecord& record, const detail::ModelLayout& layout);

  // Replicas, retention, failover.
  void evict(Replica& replica, Errc reason, const std::string& detail);
  void remove_replica(Replica& replica);
  void unbind(Replica& replica, std::uint32_t shard);
  void add_retention(Model& model, const Retention& retention, int sign);
  bool is_retained(const Model& model, Version version) const;
  // Retained by the rules of every open shard except those of `replica`.
  bool retained_by_others(const Model& model, Version version, const Replica& replica) const;
  bool kept_latest(const Model& model, Version version, std::uint64_t keep) const;
  // The versions whose last non-spot copy goes if `replica` leaves, and that another replica's
  // rule retains.
  std::vector<Version> last_retained_copies(const Replica& replica) const;
  // Why no copy of a version is left, when the hub knows more than that (for kVersionUnavailable).
  static std::string why_none_left(const VersionRecord& record);
  // The k-th newest version that was ever complete here (0: latest); none if fewer exist.
  std::optional<Version> newest_existing(const Model& model, std::uint64_t k) const;
  // Drain deadlines (settings_.drain_grace_ms): armed as a copy starts draining, disarmed as it
  // stops; at the deadline every reader of the copy is sent elsewhere (revoke_readers).
  void arm_drain_deadline(Copy& copy);
  void disarm_drain_deadline(Copy& copy);
  void revoke_readers(Copy& copy);
  // Models with no replica for settings_.model_grace_ms end: forgotten (Tick).
  void forget_idle_models();
  // Whether `model` may keep `added` more bytes of tensor descriptions (kLimitExceeded naming the
  // limit if not); charge_descriptions counts them for the layout, the model and the server.
  Status admit_descriptions(const Model& model, std::uint64_t added) const;
  void charge_descriptions(Model& model, detail::ModelLayout& layout, std::uint64_t added);
  // Refines `layout`'s shards with `shards` (ShardLayout::refine) if the more specific
  // descriptions fit the limits; `refined` says whether any changed.
  Status refine_layout(Model& model, detail::ModelLayout& layout, const std::vector<LayoutRef>& shards,
                       bool& refined);
  // Why an open of a new model is refused at kModelsMax (how many are idle, when the first ends).
  std::string models_limit_detail() const;
  // The newest version at or below `start` that was complete here and has a copy left.
  std::optional<Version> newest_readable_from(const Model& model, Version start) const;
  // Whether a publish of `version` keeps the model's order (versions increase within its life).
  bool in_order(const Model& model, Version version) const;
  void complete_barrier(Replica& replica);
  void caught_up(Replica& replica, const Txn& txn);
  void fail_barrier(Replica& replica, const Error& error);
  bool announce(Replica& replica, Txn* seeded);
  void reconcile_offloads(Model& model);
  bool evaluate_wait(const Model& model, const WaitPredicate& predicate, Error* error) const;
  std::shared_ptr<const ListSnapshot> make_snapshot(const Model& model) const;

  // Work deferred to the end of a step, so that no handler re-enters another.
  void settle();
  void settle_model(Model& model);
  void mark_dirty(Model& model) { model.dirty = true; }
  // A copy's state or health changed: the model's waits are evaluated again (if it has any).
  void waits_may_change(Model& model) {
    if (!model.waits.empty()) mark_dirty(model);
  }

  VersionRecord& record_for(Model& model, Version version);
  void forget_versions(Model& model);
  detail::DcId intern_dc(const std::string& datacenter);
  // To a client the hub does not (or no longer) know: answered in the sender's session.
  void emit(ClientId client, std::uint64_t session, Message message) {
    TH_ASSERT(effects_ != nullptr, "effects are emitted only inside step()");
    effects_->push_back(Effect{client, std::move(message), session});
  }
  // To the client bound to a shard, if any, in its session.
  void emit_to(const detail::ShardSlot& slot, Message message) {
    if (slot.client) emit(*slot.client, slot.session, std::move(message));
  }
  void emit_to_replica(const Replica& replica, const Message& message);

  HubSettings settings_;
  HubStats stats_;
  std::map<std::string, std::unique_ptr<Model>, std::less<>> models_;
  std::uint64_t description_bytes_ = 0;  // Σ models_' description_bytes
  // Lookup only (never iterated to decide anything): which replica and shard a client is.
  ClientTable<detail::Binding> clients_;
  std::map<std::string, detail::DcId, std::less<>> datacenters_;
  std::vector<std::string> datacenter_names_;
  std::uint64_t next_copy_id_ = 1;
  TransferId next_transfer_id_ = 1;
  std::uint64_t next_ticket_ = 1;
  TimeMs now_ms_ = 0;
  // Nothing can expire before this: the earliest heartbeat deadline (last seen + timeout + 1) or
  // barrier deadline as of the last expiry scan, lowered when a shard binds or a barrier starts.
  // A tick before it skips the scan of every shard (8,192 idle clients, 10 ticks a second).
  TimeMs expiry_scan_due_ms_ = 0;
  void expiry_due_by(TimeMs deadline_ms) { expiry_scan_due_ms_ = std::min(expiry_scan_due_ms_, deadline_ms); }
  Effects* effects_ = nullptr;  // valid during step()
  // Deferred work (see settle()), in the order it arose; dirty models are visited in name order.
  std::deque<std::pair<Model*, TransferId>> orphans_;
  std::deque<std::pair<Model*, detail::CopyId>> drained_;
  // Replicas whose shards could not agree after a failover: (model, name, incarnation, call).
  std::deque<std::tuple<Model*, std::string, std::uint64_t, std::uint64_t>> diverged_;
};

}  // namespace th
