#include "core/agent.h"

#include <algorithm>
#include <utility>

namespace th {

namespace {
bool primary(const ServeRead& grant) { return grant.kind == CopyKind::kPrimary; }
}  // namespace

std::string_view agent_phase_name(AgentPhase phase) {
  switch (phase) {
    case AgentPhase::kIdle: return "idle";
    case AgentPhase::kOpening: return "opening";
    case AgentPhase::kOpen: return "open";
    case AgentPhase::kEvicted: return "evicted";
    case AgentPhase::kClosed: return "closed";
  }
  return "unknown-phase";
}

Status validate(const AgentConfig& config) {
  if (config.servers == 0) return make_error(Errc::kInvalidArgument, "at least one server address");
  if (config.heartbeat_interval_ms <= 0 || config.retry_initial_ms <= 0 ||
      config.retry_max_ms < config.retry_initial_ms || config.retry_max_ms > limits::kDeadlineMsMax) {
    return make_error(Errc::kInvalidArgument,
                      "heartbeat interval and retry delays must be positive, retry_max >= initial");
  }
  return Unit{};
}

ShardAgent::ShardAgent(AgentConfig config) : config_(config) {
  const Status valid = validate(config_);
  TH_REQUIRE(valid.ok(), valid.ok() ? "" : valid.error().detail);
}

void ShardAgent::step(const AgentInput& input, TimeMs now_ms, AgentEffects& effects) {
  TH_REQUIRE(now_ms >= now_ms_, "the agent's clock went backwards:", now_ms, "<", now_ms_);
  TH_REQUIRE(effects_ == nullptr, "step() is not reentrant");
  now_ms_ = now_ms;
  effects_ = &effects;
  struct Reset {
    AgentEffects*& target;
    ~Reset() { target = nullptr; }
  } reset{effects_};
  std::visit(
      [this](const auto& in) {
        using T = std::decay_t<decltype(in)>;
        if constexpr (std::is_same_v<T, UserCall>) {
          on_call(in);
        } else if constexpr (std::is_same_v<T, FromHub>) {
          on_hub(in);
        } else if constexpr (std::is_same_v<T, ReadFinished>) {
          on_read_finished(in);
        } else if constexpr (std::is_same_v<T, ReadProgress>) {
          on_read_progress(in);
        } else if constexpr (std::is_same_v<T, OffloadFinished>) {
          on_offload_finished(in);
        } else if constexpr (std::is_same_v<T, ServerLost>) {
          on_server_lost(in);
        } else if constexpr (std::is_same_v<T, UserCancel>) {
          on_cancel(in);
        } else {
          static_assert(std::is_same_v<T, AgentTick>);
          on_tick();
        }
      },
      input);
}

// ---- the application's calls -----------------------------------------------------------------------

void ShardAgent::on_call(const UserCall& call) {
  TH_REQUIRE(!call_ && !open_call_id_, "one call at a time per shard");
  if (const auto* request = std::get_if<OpenRequest>(&call.body)) {
    if (phase_ != AgentPhase::kIdle) {
      emit(CallDone{call.call_id, make_error(Errc::kAlreadyOpen, "this shard handle is open")});
      return;
    }
    open_ = *request;
    open_.resume.reset();
    open_call_id_ = call.call_id;
    open(/*resume=*/false);
    return;
  }
  if (phase_ == AgentPhase::kIdle || phase_ == AgentPhase::kClosed) {
    emit(CallDone{call.call_id, make_error(Errc::kUnknownClient, "open the shard handle first")});
    return;
  }
  call_ = Call{call.call_id, last_seq_ + 1, call.body, false, 0, config_.retry_initial_ms};
  if (phase_ == AgentPhase::kEvicted) {
    reopen();  // the call follows once the hub has answered the open
    return;
  }
  if (phase_ == AgentPhase::kOpen) send_call();
  // kOpening (a failover re-open): sent once the open is answered.
}

void ShardAgent::on_cancel(const UserCancel& cancel) {
  if (!call_ || call_->id != cancel.call_id || call_->cancelled) return;
  const OpKind kind = op_kind(call_->body);
  if (kind != OpKind::kReplicate && kind != OpKind::kUpdate && kind != OpKind::kWait) return;
  call_->cancelled = true;
  // Not open (re-opening after a failover or an eviction): it goes after the call, once sent.
  if (phase_ == AgentPhase::kOpen) send_cancel();
}

// After the call's request, on the same connection: the hub knows the call when the cancel comes.
// Repeated like any report until the call is answered (finish_call drops it): a hub that had not
// taken the call yet (its replica waited for a shard) ignored it.
void ShardAgent::send_cancel() {
  TH_ASSERT(call_.has_value() && call_->cancelled && phase_ == AgentPhase::kOpen);
  const bool pending = std::any_of(reports_.begin(), reports_.end(), [&](const PendingReport& report) {
    const auto* cancel = std::get_if<CancelCall>(&report.body);
    return cancel != nullptr && cancel->seq == call_->seq;
  });
  if (!pending) report(CancelCall{call_->seq});
}

// Back after an eviction: as the incarnation the hub named, else the next one if the replica was
// evicted; from scratch if it diverged, otherwise announcing what the shard holds.
void ShardAgent::reopen() {
  TH_ASSERT(phase_ == AgentPhase::kEvicted);
  reopen_at_ms_ = -1;
  const bool next_incarnation = std::exchange(next_incarnation_, false);
  if (rejoin_incarnation_ != 0) {
    open_.incarnation = std::exchange(rejoin_incarnation_, 0);
  } else if (next_incarnation) {
    ++open_.incarnation;
  }
  if (std::exchange(start_over_, false)) {
    if (call_) call_->seq = 1;  // numbered afresh, as the first call after a fresh open
    open(/*resume=*/false);
  } else {
    open(/*resume=*/true);
  }
}

void ShardAgent::open(bool resume) {
  ++session_;
  named_this_session_.clear();  // the next server names the copies anew
  released_seeds_.clear();      // ids of the previous session's copies mean nothing to this one
  phase_ = AgentPhase::kOpening;
  reports_.clear();  // reports belong to a session: the new one announces what is held instead
  OpenRequest request = open_;
  if (resume) {
    auto announced = std::make_shared<Resume>();
    const bool dirty = call_ && call_->writes;
    if (!dirty) announced->primary = held_;
    for (const auto& [version, held] : offloads_) announced->offloads.push_back(held);
    announced->last_txn = last_txn_;
    request.resume = std::move(announced);
  } else {
    last_seq_ = 0;
    start_open_ = true;
  }
  open_request_ = Request{config_.client, last_seq_, std::move(request), session_};
  emit(SendRequest{server_, *open_request_});
  open_sent_ms_ = now_ms_;
  open_backoff_ms_ = config_.retry_initial_ms;
  next_heartbeat_ms_ = now_ms_ + config_.heartbeat_interval_ms;
}

void ShardAgent::send_call() {
  TH_ASSERT(call_.has_value() && phase_ == AgentPhase::kOpen);
  emit(SendRequest{server_, Request{config_.client, call_->seq, call_->body, session_}});
  call_->next_send_ms = now_ms_ + call_->backoff_ms;
  call_->backoff_ms = std::min(2 * call_->backoff_ms, config_.retry_max_ms);
  if (call_->cancelled) send_cancel();
}

// ---- messages from the hub -------------------------------------------------------------------------

void ShardAgent::on_hub(const FromHub& message) {
  // Anything from another server, or from before this agent's last open, is stale; so is anything
  // of a session the hub has ended (kEvicted: the next open starts a new one).
  if (message.server != server_ || message.effect.session != session_) return;
  if (phase_ != AgentPhase::kOpening && phase_ != AgentPhase::kOpen) return;
  std::visit(
      [&](const auto& body) {
        using T = std::decay_t<decltype(body)>;
        if constexpr (std::is_same_v<T, Reply>) {
          on_reply(body);
        } else if constexpr (std::is_same_v<T, StartRead>) {
          on_start_read(body);
        } else if constexpr (std::is_same_v<T, ServeRead>) {
          on_serve(body);
        } else if constexpr (std::is_same_v<T, StopServing>) {
          on_stop_serving(body);
        } else if constexpr (std::is_same_v<T, Offload>) {
          on_offload(body);
        } else if constexpr (std::is_same_v<T, ReleaseOffload>) {
          on_release_offload(body);
        } else if constexpr (std::is_same_v<T, CopyCorrupt>) {
          // Only news for the application: the hub already stopped reading from the copy.
          if (phase_ == AgentPhase::kOpen) emit(CopyFoundCorrupt{body.version, body.offload_copy != 0});
        } else {
          static_assert(std::is_same_v<T, Evicted>);
          // While an open is in flight, "unknown client" only means the hub has not seen it yet.
          if (phase_ == AgentPhase::kOpen) became_evicted(make_error(body.reason, body.detail));
        }
      },
      message.effect.message);
}

void ShardAgent::on_reply(const Reply& reply) {
  if (phase_ == AgentPhase::kOpening) {
    // The open is numbered with the last completed call; a call's late answer is not the open's.
    if (!reply.to_open || reply.seq != last_seq_) return;
    TH_ASSERT(open_request_.has_value(), "an open in flight is remembered");
    // The application's open begins a run of the replica's program even when it resumed (it may
    // have reached the previous server); so does a re-open after the shards diverged.
    // (A start-over open sent again as a resume after a failover, holding nothing at call 0, is
    // still one.)
    const bool fresh = open_call_id_.has_value() || start_open_;
    const bool resumed = std::get<OpenRequest>(open_request_->body).resume != nullptr;
    open_request_.reset();
    if (const auto* opened = std::get_if<OpenOk>(&reply.outcome)) {
      // The replica's incarnation, which the hub chose if asked to: re-opens name it from now on.
      if (opened->incarnation != 0) {
        open_.incarnation = opened->incarnation;
        open_.incarnation_auto = false;
      }
      phase_ = AgentPhase::kOpen;
      if (fresh) ++starts_;
      start_open_ = false;
      reopen_backoff_ms_ = 0;
      next_heartbeat_ms_ = now_ms_;
      if (resumed) report_announced_offloads();
      if (open_call_id_) {
        emit(CallDone{*open_call_id_, reply.outcome});
        open_call_id_.reset();
      }
      if (call_) {
        call_->backoff_ms = config_.retry_initial_ms;
        send_call();
      }
      return;
    }
    const Error& refusal = std::get<Error>(reply.outcome);
    // The application's incarnation is only a lower bound: the replica's shards advance it on
    // their own (after an eviction). Told of a newer one, a shard joins it rather than ask the
    // application, which could only try the number it knows again.
    if (open_call_id_ && refusal.code == Errc::kStaleIncarnation &&
        reply.replica_incarnation > open_.incarnation) {
      open_.incarnation = reply.replica_incarnation;
      open(/*resume=*/false);
      return;
    }
    // An open that lets the hub choose joined a replica whose other shards were resuming after
    // an eviction, and met their history (a shard restarted alone): the hub ends that replica and
    // its shards start over, so this shard opens afresh again to meet them, rather than fail the
    // application's open. Bounded: the application's own deadline, and these retries.
    if (open_call_id_ && open_.incarnation_auto && refusal.code == Errc::kDivergentCall &&
        auto_open_retries_ < kAutoOpenRetriesMax) {
      ++auto_open_retries_;
      open(/*resume=*/false);
      return;
    }
    // The (re-)open failed: a fresh open lets the application try again; a re-open fails the
    // call it was made for, and the next call tries as the next incarnation.
    if (open_call_id_) {
      emit(CallDone{*open_call_id_, reply.outcome});
      open_call_id_.reset();
      phase_ = AgentPhase::kIdle;
      return;
    }
    // Told of a newer incarnation of the replica, the shard joins it: both shards replacing the
    // replica with incarnations of their own would evict each other forever.
    if (reply.replica_incarnation > open_.incarnation ||
        (reply.replica_incarnation == open_.incarnation && refusal.code == Errc::kDivergentCall)) {
      rejoin_incarnation_ = reply.replica_incarnation;
    }
    became_evicted(refusal);
    return;
  }
  if (phase_ != AgentPhase::kOpen || reply.to_open || !call_ || reply.seq != call_->seq) return;
  if (const auto* error = std::get_if<Error>(&reply.outcome)) {
    switch (error->code) {
      case Errc::kUnknownClient:
      case Errc::kReplicaEvicted:
      case Errc::kDivergentCall:
      case Errc::kSequenceGap:  // the hub numbers this shard's calls otherwise: start a session anew
        became_evicted(*error);
        return;
      default:
        break;
    }
  }
  finish_call(reply.outcome, reply.released);
}

void ShardAgent::finish_call(const Outcome& outcome, bool released) {
  TH_ASSERT(call_.has_value());
  const Call call = std::move(*call_);
  call_.reset();
  TH_ASSERT(call.seq == last_seq_ + 1, "calls complete in order");
  auto received = [&](Version version, const LayoutRef& layout) {
    for (const auto& [transfer, reading] : reads_) {
      if (reading.version == version && reading.done) {
        held_ = HeldCopy{version, layout, reading.checksums, 0, reading.patch};
        return;
      }
    }
    TH_ASSERT(false, "a completed transfer of version", version, "was read by this shard");
  };
  std::visit(
      [&](const auto& value) {
        using T = std::decay_t<decltype(value)>;
        if constexpr (std::is_same_v<T, PublishOk>) {
          const auto& publish = std::get<PublishRequest>(call.body);
          held_ = HeldCopy{value.version, publish.layout, publish.checksums, 0, publish.patch};
        } else if constexpr (std::is_same_v<T, ReplicateOk>) {
          // Resumed after a failover, the shard may already have held it and read nothing.
          if (!held_ || held_->version != value.version || call.writes) {
            received(value.version, std::get<ReplicateRequest>(call.body).layout);
          }
        } else if constexpr (std::is_same_v<T, UpdateOk>) {
          TH_ASSERT(value.status != UpdateStatus::kUpdated || value.version.has_value(),
                    "an update that moved names the version");
          if (value.status == UpdateStatus::kUpdated &&
              (!held_ || held_->version != *value.version || call.writes)) {
            received(*value.version, std::get<UpdateRequest>(call.body).layout);
          }
        } else if constexpr (std::is_same_v<T, UnpublishOk>) {
          held_.reset();
          revoke_grants(primary);
        } else if constexpr (std::is_same_v<T, Error>) {
          // A failed receive leaves the buffers holding nothing, and an error kNotPublished says
          // the hub holds nothing of this replica's as published: either way the buffers are the
          // application's again, so no grant to read them may stand (its StopServing may be late
          // or lost with a connection).
          // The hub says so too when it told some shard to read (`released`): this shard's
          // instruction may have been lost, and its intact buffers no longer count as published.
          if (call.writes || value.code == Errc::kNotPublished || released) {
            held_.reset();
            revoke_grants(primary);
          }
        } else if constexpr (std::is_same_v<T, CloseOk>) {
          held_.reset();
          revoke_grants();
          drop_seeds_in_progress();
          seeds_.clear();  // the complete ones are offload copies: freed below
          for (const auto& [version, offload] : offloads_) emit(FreeOffload{version});
          offloads_.clear();
          offloading_.clear();
          named_this_session_.clear();
          reports_.clear();
          phase_ = AgentPhase::kClosed;
        }
      },
      outcome);
  cancel_reads();
  std::erase_if(reports_, [](const PendingReport& pending) {
    return !std::holds_alternative<OffloadDone>(pending.body);
  });
  last_seq_ = call.seq;
  last_txn_ = TxnRecord{call.seq, op_key(call.body), outcome};
  emit(CallDone{call.id, outcome});
}

void ShardAgent::became_evicted(const Error& error) {
  switch (error.code) {
    case Errc::kReplicaEvicted:
    case Errc::kDivergentCall:
    case Errc::kUnknownClient:
    case Errc::kStaleIncarnation:
    case Errc::kSequenceGap:
      next_incarnation_ = true;
      break;
    default:
      break;  // e.g. a barrier that timed out: the replica is gone, not replaced
  }
  // A replica whose shards cannot agree, or cannot all come back after a failover (one closed,
  // or died for good), starts over: resuming again would wait in the same barrier for ever. So does
  // one whose re-open is told it closed: its copies went with the close, and a resume would be told
  // the same again.
  if (error.code == Errc::kDivergentCall || error.code == Errc::kBarrierTimeout ||
      error.code == Errc::kReplicaClosed) {
    start_over();
    start_over_ = true;
  }
  phase_ = AgentPhase::kEvicted;
  reopen_backoff_ms_ = reopen_backoff_ms_ == 0 ? config_.retry_initial_ms
                                               : std::min(2 * reopen_backoff_ms_, config_.retry_max_ms);
  reopen_at_ms_ = now_ms_ + reopen_backoff_ms_;
  reset_connection_state();
  if (call_) {
    const std::uint64_t id = call_->id;
    if (std::holds_alternative<UnpublishRequest>(call_->body) && error.code != Errc::kDivergentCall) {
      // What unpublish promises holds: the hub lists no copy of this replica and no grant to read
      // the buffers is left. The call is complete (it takes its number, and a resume says so to
      // the shards that may redo it); the buffers are the application's again. (A divergence is
      // told as it is: the replica's program must start over, and it has to know.)
      held_.reset();
      last_seq_ = call_->seq;
      last_txn_ = TxnRecord{call_->seq, op_key(call_->body), UnpublishOk{}};
      call_.reset();
      emit(CallDone{id, UnpublishOk{}});
    } else {
      call_.reset();
      emit(CallDone{id, error});
    }
  }
}

// The replica diverged: nothing the shard held or did is trusted any more.
void ShardAgent::start_over() {
  held_.reset();
  drop_seeds_in_progress();
  seeds_.clear();
  for (const auto& [version, offload] : offloads_) emit(FreeOffload{version});
  offloads_.clear();
  offloading_.clear();
  last_txn_.reset();
}

// What belonged to the old server or session: grants, reads, unacknowledged reports.
void ShardAgent::reset_connection_state() {
  revoke_grants();
  if (call_ && call_->writes) held_.reset();
  cancel_reads();
  reports_.clear();
  offloading_.clear();  // copies still being made are freed when done: no server counts them
  // Seeds in progress go with the server that started them; complete ones are offload copies,
  // announced to the next server like any other.
  drop_seeds_in_progress();
  seeds_.clear();
  stopped_.clear();
  stopped_order_.clear();
}

void ShardAgent::on_start_read(const StartRead& read) {
  if (read.offload_copy != 0) {
    on_seed_read(read);
    return;
  }
  // Only for the call in flight: one of an earlier call, arriving late (the hub sends them again
  // to a call's retransmissions), would overwrite buffers the application now uses.
  if (!reading_call() || read.call != call_->seq) return;
  auto found = reads_.find(read.transfer);
  if (found != reads_.end()) {
    if (found->second.done) {
      report(done_report(read.transfer, found->second));  // the hub missed our report
      return;
    }
    if (read.epoch <= found->second.epoch) return;
    drop_reports(read.transfer);  // a failure report about the old source is answered
  }
  if (!call_->writes) {
    // The buffers are about to be overwritten: they no longer hold the old version, and nobody may
    // read that version from them any more.
    call_->writes = true;
    held_.reset();
    revoke_grants(primary);
  }
  const bool reshard = !read.reshard.empty();
  reads_[read.transfer] = Reading{read.epoch, read.version, reshard ? nullptr : read.checksums, false, reshard, read.patch};
  emit(BeginRead{read});
}

void ShardAgent::on_serve(const ServeRead& grant) {
  // A grant arrives after its own withdrawal when messages cross or repeat: never serve it again.
  if (stopped_.contains({grant.transfer, grant.epoch})) return;
  bool holds = false;
  if (grant.kind == CopyKind::kOffload) {
    holds = offloads_.contains(grant.version);
  } else if (held_ && held_->version == grant.version && !(call_ && call_->writes)) {
    holds = true;
  } else if (call_ && call_->writes) {
    // Pipeline replication: a version being received is served as it arrives.
    for (const auto& [transfer, reading] : reads_) holds = holds || reading.version == grant.version;
  }
  if (!holds) return;  // a late grant for buffers that moved on: never serve it
  if (grants_.emplace(std::pair{grant.transfer, grant.epoch}, grant).second) emit(GrantServe{grant});
}

void ShardAgent::on_stop_serving(const StopServing& stop) {
  const std::pair key{stop.transfer, stop.epoch};
  if (grants_.erase(key) > 0) emit(RevokeServe{stop.transfer, stop.epoch});
  if (stopped_.insert(key).second) {
    stopped_order_.push_back(key);
    if (stopped_order_.size() > kStoppedGrantsMax) {
      stopped_.erase(stopped_order_.front());
      stopped_order_.pop_front();
    }
  }
  TH_ASSERT(stopped_.size() == stopped_order_.size() && stopped_.size() <= kStoppedGrantsMax);
}

// ---- offload copies --------------------------------------------------------------------------------

void ShardAgent::on_offload(const Offload& offload) {
  if (auto seed = seeds_.find(offload.version); seed != seeds_.end()) {
    if (offload.copy < seed->second.copy) return;  // a late instruction from before the seed
    // The server names this version's copy anew (a complete seed is now an ordinary offload
    // copy), or released the seed and makes another: either way the seed is no longer tracked.
    drop_seed(offload.version);
  }
  if (auto made = offloads_.find(offload.version); made != offloads_.end()) {
    if (auto named = named_this_session_.find(offload.version);
        named != named_this_session_.end() && offload.copy < named->second) {
      return;  // a late instruction about a copy of this version the server has since replaced
    }
    // Made before (for an earlier instruction, or announced to a new server): it is this copy now,
    // and a report under its old id no longer says anything (one report per copy is pending).
    made->second.copy = offload.copy;
    named_this_session_[offload.version] = offload.copy;
    drop_offload_reports(offload.version);
    report(OffloadDone{offload.version, offload.copy});
    return;
  }
  if (auto making = offloading_.find(offload.version); making != offloading_.end()) {
    // Being made: reported under this id once done (unless the instruction is a late one).
    making->second = std::max(making->second, offload.copy);
    return;
  }
  if (!held_ || held_->version != offload.version || (call_ && call_->writes)) return;  // moved on
  TH_ASSERT(offloading_.size() < limits::kOffloadsPerReplicaMax, "offloads in progress");
  offloading_[offload.version] = offload.copy;
  emit(MakeOffload{offload.version});
}

// The offload copies this open announced that the server has neither renamed nor released yet
// are reported under their old ids until it does one or the other. It answers each at the resume,
// but a lost answer is never repeated on its own: a release lost would keep CPU memory for ever
// that no server counts, a rename lost would leave a copy the next release could not name.
void ShardAgent::report_announced_offloads() {
  for (const auto& [version, held] : offloads_) {
    if (!named_this_session_.contains(version)) report(OffloadDone{version, held.copy});
  }
}

void ShardAgent::on_offload_finished(const OffloadFinished& finished) {
  auto making = offloading_.find(finished.version);
  if (finished.failed) {
    if (making != offloading_.end()) offloading_.erase(making);
    return;  // no copy was made: nothing to free
  }
  const bool wanted = making != offloading_.end() && held_ && held_->version == finished.version;
  if (!wanted) {
    // Released meanwhile, or the buffers moved on while they were copied: the copy is not
    // trustworthy or not needed; the data plane frees it.
    if (making != offloading_.end()) offloading_.erase(making);
    // (The data plane's buffer of this version may be a seed's now: FreeOffload would free it.)
    if (!offloads_.contains(finished.version) && !seeds_.contains(finished.version)) {
      emit(FreeOffload{finished.version});
    }
    return;
  }
  HeldCopy copy = *held_;
  copy.copy = making->second;
  named_this_session_[finished.version] = copy.copy;  // offloading_ holds this session's ids only
  offloading_.erase(making);
  offloads_[finished.version] = copy;
  TH_ASSERT(offloads_.size() <= limits::kOffloadsPerReplicaMax, "offload copies held");
  report(OffloadDone{copy.version, copy.copy});
}

void ShardAgent::on_release_offload(const ReleaseOffload& release) {
  auto remember_released_seed = [&] {
    released_seeds_.emplace_back(release.version, release.copy);
    if (released_seeds_.size() > kReleasedSeedsMax) released_seeds_.pop_front();
  };
  if (!seeds_.contains(release.version) && !offloads_.contains(release.version) &&
      !offloading_.contains(release.version)) {
    // Nothing of this version is held: the release may have overtaken the StartRead of the seed
    // it frees, and a seed begun after its release is memory no server counts. (By version and
    // id: an id alone may be an earlier server's number, echoed back by this one.)
    remember_released_seed();
  }
  if (auto seed = seeds_.find(release.version);
      seed != seeds_.end() && seed->second.copy == release.copy) {
    remember_released_seed();
    const bool done = seed->second.done;
    drop_seed(release.version);
    if (!done) return;  // freed with the read; a complete one is released below
  }
  if (auto making = offloading_.find(release.version);
      making != offloading_.end() && making->second == release.copy) {
    offloading_.erase(making);  // freed when the copy finishes
  }
  auto made = offloads_.find(release.version);
  if (made == offloads_.end()) return;
  // A copy this session's server never named to this shard is one it adopted from the open's
  // announcement (its renaming Offload lost or still on the way): the server knows one copy per
  // version of a replica, so a release of the version this session names that copy. Ignoring it
  // would keep the memory for ever while the server counts nothing.
  const bool named_this_session = named_this_session_.contains(release.version);
  if (named_this_session && made->second.copy != release.copy) return;  // stale: another copy
  // The hub releases only a drained copy, but its StopServing may still be on the way.
  revoke_grants([&](const ServeRead& grant) {
    return grant.kind == CopyKind::kOffload && grant.version == release.version;
  });
  drop_offload_reports(release.version);  // under any id: the copy is freed
  offloads_.erase(made);
  named_this_session_.erase(release.version);
  emit(FreeOffload{release.version});
}

void ShardAgent::revoke_grants(const std::function<bool(const ServeRead&)>& match) {
  for (auto it = grants_.begin(); it != grants_.end();) {
    if (match && !match(it->second)) {
      ++it;
      continue;
    }
    emit(RevokeServe{it->first.first, it->first.second});
    it = grants_.erase(it);
  }
}


void ShardAgent::cancel_reads() {
  for (const auto& [transfer, reading] : reads_) {
    if (!reading.done) emit(CancelRead{transfer});
  }
  reads_.clear();
}

bool ShardAgent::reading_call() const {
  return phase_ == AgentPhase::kOpen && call_ &&
         (std::holds_alternative<ReplicateRequest>(call_->body) ||
          std::holds_alternative<UpdateRequest>(call_->body));
}

// ---- offload seeding -------------------------------------------------------------------------------

void ShardAgent::on_seed_read(const StartRead& read) {
  TH_ASSERT(read.layout != nullptr && read.checksums != nullptr, "a seed read names its layout");
  // While (re-)opening, the hub repeats the instruction with the heartbeats that follow.
  if (phase_ != AgentPhase::kOpen) return;
  if (std::find(released_seeds_.begin(), released_seeds_.end(), std::pair{read.version, read.offload_copy}) !=
      released_seeds_.end()) {
    return;  // repeated or late (or overtaken by its release), about a seed the hub released
  }
  if (auto found = seeds_.find(read.version); found != seeds_.end()) {
    Seeding& seed = found->second;
    if (read.offload_copy < seed.copy) return;  // about an earlier copy of this version
    if (read.offload_copy == seed.copy) {
      // The instruction again (the hub repeats it with heartbeats until it hears how the read
      // went): answered again, since that answer may have been lost.
      if (read.transfer != seed.transfer || read.epoch < seed.epoch) return;
      if (seed.done) {
        send_report(TransferDone{seed.transfer, seed.epoch, nullptr});
        return;
      }
      if (read.epoch == seed.epoch) {
        if (seed.failure) send_report(TransferFailed{seed.transfer, seed.epoch, *seed.failure});
        return;  // otherwise under way
      }
      seed.epoch = read.epoch;
      seed.failure.reset();
      emit(BeginRead{read});  // replaces the read from the old source
      return;
    }
    // A newer copy of this version: the hub released the older one (its ReleaseOffload is late).
    drop_seed(read.version);
  }
  if (auto made = offloads_.find(read.version); made != offloads_.end()) {
    // A copy the hub does not count (it seeds only a replica without one): freed first.
    revoke_grants([&](const ServeRead& grant) {
      return grant.kind == CopyKind::kOffload && grant.version == read.version;
    });
    drop_offload_reports(read.version);
    offloads_.erase(made);
    emit(FreeOffload{read.version});
  }
  offloading_.erase(read.version);  // a copy being made for a late instruction: freed when done
  TH_ASSERT(seeds_.size() + offloads_.size() < 2 * limits::kOffloadsPerReplicaMax, "seeds held");
  seeds_[read.version] = Seeding{read.transfer, read.epoch, read.offload_copy, read.layout,
                                 read.checksums, false, std::nullopt};
  emit(BeginRead{read});
}

void ShardAgent::on_seed_finished(const ReadFinished& finished) {
  for (auto& [version, seed] : seeds_) {
    if (seed.transfer != finished.transfer) continue;
    if (seed.epoch != finished.epoch || seed.done || seed.failure) return;
    // Sent once, not retransmitted: no call's answer acknowledges a seed's report, and the hub
    // repeats the instruction until it has one.
    if (finished.failure.has_value()) {
      seed.failure = finished.failure;
      // Its buffer goes now (a read from the next source fills a fresh one): a failed seed waits
      // for the hub to name that source, and if the hub released the seed instead and that
      // release was lost, nothing else would ever free the memory.
      emit(FreeOffload{version});
      send_report(TransferFailed{finished.transfer, finished.epoch, *finished.failure});
      return;
    }
    seed.done = true;
    offloads_[version] = HeldCopy{version, seed.layout, seed.checksums, seed.copy};
    named_this_session_[version] = seed.copy;
    send_report(TransferDone{seed.transfer, seed.epoch, nullptr});
    // Whole, the seed is an offload copy, reported like one until released: the server answers a
    // report of a copy it no longer counts with its release again, so a lost release is repeated.
    report(OffloadDone{version, seed.copy});
    return;
  }
  // A seed dropped meanwhile: its buffer was freed with it.
}

void ShardAgent::drop_seed(Version version) {
  auto found = seeds_.find(version);
  TH_ASSERT(found != seeds_.end());
  if (!found->second.done && !found->second.failure) {
    emit(CancelRead{found->second.transfer});
    emit(FreeOffload{version});
  }
  seeds_.erase(found);
}

void ShardAgent::drop_seeds_in_progress() {
  std::vector<Version> in_progress;
  for (const auto& [version, seed] : seeds_) {
    if (!seed.done) in_progress.push_back(version);
  }
  for (Version version : in_progress) drop_seed(version);
}

// ---- the data plane --------------------------------------------------------------------------------

void ShardAgent::on_read_finished(const ReadFinished& finished) {
  auto found = reads_.find(finished.transfer);
  if (found == reads_.end()) {
    on_seed_finished(finished);
    return;
  }
  if (found->second.epoch != finished.epoch || found->second.done) return;
  if (!finished.failure) {
    Reading& reading = found->second;
    if (reading.reshard) {
      if (finished.checksums == nullptr) {
        // The data plane owes these; without them nobody could vouch for the bytes.
        report(TransferFailed{finished.transfer, finished.epoch, ReadFailure::kChecksumMismatch});
        return;
      }
      reading.checksums = finished.checksums;
    }
    reading.done = true;
    report(done_report(finished.transfer, reading));
  } else {
    report(TransferFailed{finished.transfer, finished.epoch, *finished.failure});
  }
}

void ShardAgent::on_read_progress(const ReadProgress& progress) {
  auto found = reads_.find(progress.transfer);
  // A seed's read crosses datacenters, a patch moves a few percent of the shard and a read across
  // layouts reads pieces of several sources: none says how fast this replica receives here (the
  // hub would not time it).
  if (found == reads_.end() || phase_ != AgentPhase::kOpen) return;
  Reading& reading = found->second;
  if (reading.epoch != progress.epoch || reading.done || reading.progress_reported || reading.reshard ||
      reading.patch != nullptr) {
    return;
  }
  reading.progress_reported = true;
  send_report(TransferProgress{progress.transfer, progress.epoch, progress.bytes});
}

std::uint64_t progress_report_bytes(std::uint64_t shard_bytes) {
  constexpr std::uint64_t kProgressReportDivisor = 16;
  return shard_bytes == 0 ? 0 : std::max<std::uint64_t>(shard_bytes / kProgressReportDivisor, 1);
}

TransferDone ShardAgent::done_report(TransferId transfer, const Reading& reading) {
  TH_ASSERT(reading.done);
  return TransferDone{transfer, reading.epoch, reading.reshard ? reading.checksums : nullptr};
}

void ShardAgent::report(ReportBody body) {
  emit(SendReport{server_, Report{config_.client, body, session_}});
  reports_.push_back(PendingReport{std::move(body), now_ms_ + config_.retry_initial_ms,
                                   config_.retry_initial_ms});
}

void ShardAgent::drop_offload_reports(Version version) {
  std::erase_if(reports_, [&](const PendingReport& pending) {
    const auto* done = std::get_if<OffloadDone>(&pending.body);
    return done != nullptr && done->version == version;
  });
}

void ShardAgent::send_report(ReportBody body) {
  emit(SendReport{server_, Report{config_.client, std::move(body), session_}});
}

void ShardAgent::drop_reports(TransferId transfer) {
  std::erase_if(reports_, [&](const PendingReport& pending) {
    const auto* failed = std::get_if<TransferFailed>(&pending.body);
    return failed != nullptr && failed->transfer == transfer;
  });
}

// ---- failover and time -----------------------------------------------------------------------------

void ShardAgent::on_server_lost(const ServerLost& lost) {
  if (lost.server != server_ || phase_ == AgentPhase::kIdle || phase_ == AgentPhase::kClosed) return;
  server_ = (server_ + 1) % config_.servers;
  reset_connection_state();
  if (phase_ == AgentPhase::kEvicted) return;  // the next call re-opens, on the new server
  // The client "resets to unpublished" and re-opens on the next server, announcing what it holds;
  // the call in flight is sent again once the open is answered. An open of the application's that
  // got no answer resumes too, holding nothing at call 0: it may have bound the shard on the
  // previous server, whose peers then made calls there, and the new server must gather the
  // replica in its barrier rather than let this shard start afresh alone.
  open(/*resume=*/true);
}

void ShardAgent::on_tick() {
  if (phase_ == AgentPhase::kEvicted && reopen_at_ms_ >= 0 && now_ms_ >= reopen_at_ms_) reopen();
  if (phase_ != AgentPhase::kOpening && phase_ != AgentPhase::kOpen) return;
  // Heartbeats only once open: one sent before the hub saw the open would come back "unknown
  // client" (after the open's answer, if messages cross) and evict the shard it just opened. While
  // opening, the open's retransmissions, at least once per heartbeat interval, keep it alive.
  if (phase_ == AgentPhase::kOpen && now_ms_ >= next_heartbeat_ms_) {
    emit(SendReport{server_, Report{config_.client, Heartbeat{}, session_}});
    next_heartbeat_ms_ = now_ms_ + config_.heartbeat_interval_ms;
  }
  if (phase_ == AgentPhase::kOpening && now_ms_ >= open_sent_ms_ + open_backoff_ms_) {
    TH_ASSERT(open_request_.has_value(), "an open in flight is remembered");
    emit(SendRequest{server_, *open_request_});  // same session, same sequence number
    open_sent_ms_ = now_ms_;
    open_backoff_ms_ = std::min({2 * open_backoff_ms_, config_.retry_max_ms,
                                 config_.heartbeat_interval_ms});
  }
  if (phase_ == AgentPhase::kOpen && call_ && now_ms_ >= call_->next_send_ms) send_call();
  for (PendingReport& pending : reports_) {
    if (now_ms_ < pending.next_send_ms) continue;
    emit(SendReport{server_, Report{config_.client, pending.body, session_}});
    pending.backoff_ms = std::min(2 * pending.backoff_ms, config_.retry_max_ms);
    pending.next_send_ms = now_ms_ + pending.backoff_ms;
  }
}

std::optional<TimeMs> ShardAgent::next_deadline_ms() const {
  if (phase_ == AgentPhase::kEvicted && reopen_at_ms_ >= 0) return reopen_at_ms_;
  if (phase_ != AgentPhase::kOpening && phase_ != AgentPhase::kOpen) return std::nullopt;
  if (phase_ == AgentPhase::kOpening) return open_sent_ms_ + open_backoff_ms_;
  TimeMs next = next_heartbeat_ms_;
  if (phase_ == AgentPhase::kOpen && call_) next = std::min(next, call_->next_send_ms);
  for (const PendingReport& pending : reports_) next = std::min(next, pending.next_send_ms);
  return next;
}

}  // namespace th
