#include "server/service_metrics.h"

#include "core/assert.h"

namespace th::server {

namespace {

using Type = net::MetricsText::Type;

constexpr std::size_t kOpenOp = 0;

std::size_t op_index(const RequestBody& body) {
  if (std::holds_alternative<OpenRequest>(body)) return kOpenOp;
  return 1 + static_cast<std::size_t>(op_kind(body));
}

std::array<net::Histogram, ServiceMetrics::kOps> latency_histograms() {
  return {net::Histogram(net::latency_buckets_seconds()), net::Histogram(net::latency_buckets_seconds()),
          net::Histogram(net::latency_buckets_seconds()), net::Histogram(net::latency_buckets_seconds()),
          net::Histogram(net::latency_buckets_seconds()), net::Histogram(net::latency_buckets_seconds()),
          net::Histogram(net::latency_buckets_seconds()), net::Histogram(net::latency_buckets_seconds())};
}

std::string result_label(const Outcome& outcome) {
  if (const auto* error = std::get_if<Error>(&outcome)) return std::string(errc_name(error->code));
  if (const auto* update = std::get_if<UpdateOk>(&outcome)) {
    // "Nothing newer" and "not yet" are answers, not failures, but a dashboard wants them apart.
    if (update->status != UpdateStatus::kUpdated) return std::string(update_status_name(update->status));
  }
  return "ok";
}

}  // namespace

std::string_view ServiceMetrics::op_label(std::size_t op) {
  TH_REQUIRE(op < kOps, "an operation index");
  if (op == kOpenOp) return "open";
  return op_name(static_cast<OpKind>(op - 1));
}

ServiceMetrics::ServiceMetrics(std::size_t timeline_transfers_max)
    : latency_(latency_histograms()), cpu_(latency_histograms()), ledger_(timeline_transfers_max) {
  static_assert(kOps == 1 + static_cast<std::size_t>(OpKind::kClose) + 1, "open plus every OpKind");
}

void ServiceMetrics::observe(const Hub& hub, const Input& input, const Effects& effects, std::int64_t step_start_us,
                             std::int64_t step_end_us) {
  TH_REQUIRE(step_end_us >= step_start_us, "a step ends after it began");
  const double step_seconds = static_cast<double>(step_end_us - step_start_us) / 1e6;
  hub_seconds_ += step_seconds;
  if (const auto* request = std::get_if<Request>(&input)) {
    on_request(*request, step_seconds, step_start_us);
  } else if (const auto* lost = std::get_if<ConnectionLost>(&input)) {
    pending_.erase(lost->client);
  }
  for (const Effect& effect : effects) {
    if (const auto* reply = std::get_if<Reply>(&effect.message)) {
      on_reply(effect.client, *reply, step_end_us);
    } else if (std::holds_alternative<Evicted>(effect.message)) {
      pending_.erase(effect.client);
    }
  }
  ledger_.observe(hub, input, effects, step_end_us);
}

void ServiceMetrics::on_request(const Request& request, double step_seconds, std::int64_t arrival_us) {
  const auto op = static_cast<std::uint8_t>(op_index(request.body));
  if (op == kOpenOp) {
    if (const auto* open = std::get_if<OpenRequest>(&request.body); open->resume != nullptr) ++resumed_opens_;
  }
  auto [pending, inserted] = pending_.try_emplace(request.client);
  if (!inserted && pending->second.seq == request.seq && pending->second.op == op) {
    pending->second.cpu_seconds += step_seconds;  // a retransmission: the same call
    return;
  }
  if (pending_.size() > kPendingMax) {
    pending_.clear();
    return;
  }
  pending->second = Pending{request.seq, op, arrival_us, step_seconds, false};  // a new call
}

void ServiceMetrics::on_reply(ClientId client, const Reply& reply, std::int64_t now_us) {
  auto found = pending_.find(client);
  if (found == pending_.end()) return;
  Pending& pending = found->second;
  const bool matches = reply.to_open ? pending.op == kOpenOp : (pending.op != kOpenOp && pending.seq == reply.seq);
  if (!matches || pending.answered) return;
  pending.answered = true;
  ++operations_[{pending.op, result_label(reply.outcome)}];
  latency_[pending.op].observe(static_cast<double>(now_us - pending.arrival_us) / 1e6);
  cpu_[pending.op].observe(pending.cpu_seconds);
}

std::uint64_t ServiceMetrics::operations(std::size_t op, std::string_view result) const {
  auto found = operations_.find({static_cast<std::uint8_t>(op), std::string(result)});
  return found == operations_.end() ? 0 : found->second;
}

std::string ServiceMetrics::render(const Hub& hub, const ShellFigures& shell) const {
  net::MetricsText out;
  out.family("th_server_operations_total", Type::kCounter,
             "Operations answered, by kind and result (ok, an error code, or update's no-newer-version/not-yet)");
  for (const auto& [key, count] : operations_) {
    out.sample({{"op", op_label(key.first)}, {"result", key.second}}, static_cast<double>(count));
  }
  out.family("th_server_operation_seconds", Type::kHistogram,
             "From an operation's request reaching th-server to its reply leaving the hub (includes waiting for "
             "versions, shards and transfers)");
  for (std::size_t op = 0; op < kOps; ++op) {
    if (latency_[op].count() > 0) out.histogram({{"op", op_label(op)}}, latency_[op]);
  }
  out.family("th_server_operation_cpu_seconds", Type::kHistogram,
             "Time the hub spent on an operation's request (the hub steps that took it; one thread)");
  for (std::size_t op = 0; op < kOps; ++op) {
    if (cpu_[op].count() > 0) out.histogram({{"op", op_label(op)}}, cpu_[op]);
  }
  out.family("th_server_hub_seconds_total", Type::kCounter, "Time spent in the hub, every input");
  out.sample({}, hub_seconds_);
  out.family("th_server_resumed_opens_total", Type::kCounter,
             "Opens that resumed a replica's state from another server (failovers to this server)");
  out.sample({}, static_cast<double>(resumed_opens_));

  out.family("th_server_connections", Type::kGauge, "Connections open");
  out.sample({}, static_cast<double>(shell.connections));
  out.family("th_server_clients", Type::kGauge, "Client shards open in the hub");
  out.sample({}, static_cast<double>(hub.client_count()));
  out.family("th_server_draining", Type::kGauge, "1 while th-server drains before it stops (SIGTERM)");
  out.sample({}, shell.draining ? 1.0 : 0.0);
  out.family("th_server_uptime_seconds", Type::kGauge, "Seconds since th-server started");
  out.sample({}, shell.uptime_seconds);
  out.family("th_server_metrics_requests_total", Type::kCounter,
             "Requests to this endpoint: scrapes answered, delayed past the request budget, malformed, shed (503: too many waiting)");
  out.sample({{"kind", "scrape"}}, static_cast<double>(shell.scrapes));
  out.sample({{"kind", "delayed"}}, static_cast<double>(shell.scrape_requests_delayed));
  out.sample({{"kind", "malformed"}}, static_cast<double>(shell.scrape_bad_requests));
  out.sample({{"kind", "shed"}}, static_cast<double>(shell.scrape_requests_shed));
  out.family("th_server_metrics_connections_evicted_total", Type::kCounter,
             "Connections to this endpoint closed to admit a newer one (more than 16 at once)");
  out.sample({}, static_cast<double>(shell.scrape_connections_evicted));

  out.family("th_server_heartbeats_total", Type::kCounter, "Heartbeats taken, by path (datagram or call)");
  out.sample({{"path", "datagram"}}, static_cast<double>(shell.heartbeat_datagrams));
  out.sample({{"path", "call"}}, static_cast<double>(shell.heartbeat_calls));
  out.family("th_server_heartbeat_datagrams_refused_total", Type::kCounter,
             "Heartbeat datagrams refused: malformed, unknown client, wrong MAC or replayed");
  out.sample({}, static_cast<double>(shell.heartbeat_datagrams_refused));

  const HubStats& stats = hub.stats();
  out.family("th_server_transfers_started_total", Type::kCounter, "Replica transfers the hub started");
  out.sample({}, static_cast<double>(stats.transfers_started));
  out.family("th_server_transfers_completed_total", Type::kCounter,
             "Replica transfers completed (every shard of the reader received the version)");
  out.sample({}, static_cast<double>(stats.transfers_completed));
  out.family("th_server_shard_reads_total", Type::kCounter,
             "Shard reads ended: done, failed (the reader reported it), withdrawn (moved to another source or cancelled)");
  std::uint64_t failed = 0;
  for (const auto& [key, count] : ledger_.failures()) failed += count;
  out.sample({{"outcome", "done"}}, static_cast<double>(ledger_.reads_done()));
  out.sample({{"outcome", "failed"}}, static_cast<double>(failed));
  out.sample({{"outcome", "withdrawn"}}, static_cast<double>(ledger_.withdrawn()));
  out.family("th_server_source_failures_total", Type::kCounter, "Transfers moved off a source that failed");
  out.sample({}, static_cast<double>(stats.source_failures));
  out.family("th_server_evictions_total", Type::kCounter, "Replicas evicted (heartbeat timeout, connection loss, ...)");
  out.sample({}, static_cast<double>(stats.evictions));
  out.family("th_server_offloads_started_total", Type::kCounter, "Offloads of a last copy to CPU memory started");
  out.sample({}, static_cast<double>(stats.offloads_started));
  out.family("th_server_readers_revoked_total", Type::kCounter,
             "Reads of a draining copy revoked at its drain grace (--drain-grace-ms) and sent elsewhere");
  out.sample({}, static_cast<double>(stats.readers_revoked));
  out.family("th_server_readers_put_ahead_total", Type::kCounter,
             "Readers that took the source of a slower copy early in its read, which then read behind them");
  out.sample({}, static_cast<double>(stats.transfers_displaced));
  out.family("th_server_readers_passed_mid_read_total", Type::kCounter,
             "Of those, readers that did so on their progress report (a sixteenth into their read), having kept "
             "the slower copy's pace on every shard");
  out.sample({}, static_cast<double>(stats.passed_mid_read));
  out.family("th_server_progress_claims_refuted_total", Type::kCounter,
             "Reads that ended later than their progress report allowed: the rate it set was undone");
  out.sample({}, static_cast<double>(stats.progress_claims_refuted));
  out.family("th_server_slow_sources_passed_total", Type::kCounter,
             "Reads placed past a copy that receives at under half the reader's rate");
  out.sample({}, static_cast<double>(stats.slow_sources_passed));
  // Delta versions (README "Delta versions"): how many reads moved a patch, not the bytes.
  out.family("th_server_patches_published_total", Type::kCounter,
             "Versions a replica published with a patch against the version before");
  out.sample({}, static_cast<double>(stats.patches_published));
  out.family("th_server_patch_reads_total", Type::kCounter,
             "Reads placed as patch reads (a reader holding the version before, a holder of the patch)");
  out.sample({}, static_cast<double>(stats.patch_reads_started));
  out.family("th_server_patch_reads_failed_total", Type::kCounter,
             "Patch reads that failed; each went on with the bytes");
  out.sample({}, static_cast<double>(stats.patch_reads_failed));
  out.family("th_server_patches_kept_total", Type::kCounter,
             "Readers that applied a patch and serve it onwards");
  out.sample({}, static_cast<double>(stats.patches_kept));
  out.family("th_server_copies_found_corrupt_total", Type::kCounter,
             "Copies whose bytes failed readers' checksums twice (their owners are told)");
  out.sample({}, static_cast<double>(stats.copies_found_corrupt));
  out.family("th_server_retained_versions_left_total", Type::kCounter,
             "Closes that took the last copy of a version another replica's retention rule kept");
  out.sample({}, static_cast<double>(stats.retained_versions_left));
  out.family("th_server_models_ended_total", Type::kCounter,
             "Models forgotten after having no replica for the model grace (--model-grace-ms)");
  out.sample({}, static_cast<double>(stats.models_forgotten));
  out.family("th_server_description_bytes", Type::kGauge,
             "Bytes of tensor descriptions the hub keeps for all models (--description-bytes-max)");
  out.sample({}, static_cast<double>(hub.description_bytes()));

  const HubActivity activity = hub.activity();
  out.family("th_server_transfers", Type::kGauge,
             "Replica transfers in flight: gathering (waiting for the reader's shards), waiting (for a source), active");
  out.sample({{"state", "gathering"}}, static_cast<double>(activity.transfers_gathering));
  out.sample({{"state", "waiting"}}, static_cast<double>(activity.transfers_waiting));
  out.sample({{"state", "active"}}, static_cast<double>(activity.transfers_active));
  out.family("th_server_calls_blocked", Type::kGauge,
             "Calls blocked: replicate of a version not yet published (unresolved), wait() not yet true");
  out.sample({{"reason", "unresolved"}}, static_cast<double>(activity.calls_unresolved));
  out.sample({{"reason", "wait"}}, static_cast<double>(activity.calls_waiting));

  out.family("th_server_transfer_bytes_total", Type::kCounter,
             "Bytes of shard reads completed, by the source's and the reader's datacenter");
  for (const auto& [link, bytes] : ledger_.bytes_by_link()) {
    out.sample({{"source_datacenter", link.source_datacenter}, {"reader_datacenter", link.reader_datacenter}},
               static_cast<double>(bytes));
  }
  out.family("th_server_read_failures_total", Type::kCounter,
             "Shard reads a reader reported failed, by reason and the source's datacenter");
  for (const auto& [key, count] : ledger_.failures()) {
    out.sample({{"reason", read_failure_name(key.reason)}, {"source_datacenter", key.source_datacenter}},
               static_cast<double>(count));
  }
  // Per model: bounded by the hub's models_max; replicas by the roles and states they have.
  const auto names = hub.model_names();
  std::map<std::tuple<std::string, std::string, std::string>, std::uint64_t> replicas;
  std::map<std::string, std::pair<std::uint64_t, std::uint64_t>> versions;  // held, retained
  for (const std::string& name : names) {
    const auto snapshot = hub.snapshot(name);
    if (!snapshot) continue;
    for (const auto& replica : snapshot->replicas) ++replicas[{name, replica.role, replica.state}];
    auto& [held, retained] = versions[name];
    for (const auto& version : snapshot->versions) {
      held += version.complete > 0;
      retained += version.retained;
    }
  }
  out.family("th_server_replicas", Type::kGauge, "Replicas open, by model, role and state");
  for (const auto& [key, count] : replicas) {
    out.sample({{"model", std::get<0>(key)}, {"role", std::get<1>(key)}, {"state", std::get<2>(key)}},
               static_cast<double>(count));
  }
  out.family("th_server_versions_held", Type::kGauge, "Versions with at least one complete copy, by model");
  for (const auto& [name, counts] : versions) out.sample({{"model", name}}, static_cast<double>(counts.first));
  out.family("th_server_versions_retained", Type::kGauge, "Versions a retention rule keeps, by model");
  for (const auto& [name, counts] : versions) out.sample({{"model", name}}, static_cast<double>(counts.second));
  out.family("th_server_model_description_bytes", Type::kGauge,
             "Bytes of tensor descriptions the hub keeps, by model (--model-description-bytes-max)");
  for (const std::string& name : names) out.sample({{"model", name}}, static_cast<double>(hub.description_bytes(name)));
  return out.take();
}

}  // namespace th::server
