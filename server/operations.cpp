// th-server's operations side (README "Operating TensorHub"): the Prometheus endpoint, the
// transfer timeline, the drain on SIGTERM and the token rotation on SIGHUP. The figures
// themselves are server/service_metrics.h's and server/transfer_ledger.h's.
#include "server/connection.h"
#include "server/chrome_trace.h"
#include "server/hub_service.h"

namespace th::server {

void HubService::set_tokens(std::vector<std::string> tokens) {
  TH_REQUIRE(!tokens.empty(), "a server accepts at least one token");
  for (const std::string& token : tokens) TH_REQUIRE(!token.empty(), "no token is empty");
  config_.token = std::move(tokens.front());
  config_.more_tokens.assign(std::make_move_iterator(tokens.begin() + 1), std::make_move_iterator(tokens.end()));
}

Status HubService::serve_metrics(const std::string& address) {
  TH_REQUIRE(metrics_http_ == nullptr, "serve_metrics is called once");
  // The endpoint's thread asks this loop for the text and waits for it without blocking its own
  // loop. stop_metrics() ends the thread while this loop still runs (a render it asked of this
  // loop is cancelled then); ~HubService does it blind only if the owner did not.
  const kj::Executor& here = kj::getCurrentThreadExecutor();
  auto started = net::MetricsHttpThread::start(address, [this, &here] {
    return here.executeAsync([this] { return render_metrics(); });
  });
  if (!started.ok()) return started.error();
  metrics_http_ = std::move(started).value();
  return Unit{};
}

void HubService::stop_metrics(kj::WaitScope& wait_scope) {
  if (metrics_http_ == nullptr) return;
  metrics_http_->stop(wait_scope);
  metrics_http_.reset();
}

std::string HubService::metrics_address() const { return metrics_http_ != nullptr ? metrics_http_->address() : ""; }

std::string HubService::render_metrics() const {
  ShellFigures shell;
  shell.connections = connections_.size();
  shell.heartbeat_datagrams = heartbeat_datagrams_;
  shell.heartbeat_calls = heartbeat_calls_;
  shell.heartbeat_datagrams_refused =
      heartbeat_datagrams_refused_ + (heartbeat_receiver_ != nullptr ? heartbeat_receiver_->malformed() : 0);
  shell.uptime_seconds = static_cast<double>(now_us()) / 1e6;
  shell.draining = draining_;
  if (metrics_http_ != nullptr) {
    const net::MetricsHttpServer& endpoint = metrics_http_->server();
    shell.scrapes = endpoint.scrapes();
    shell.scrape_connections_evicted = endpoint.connections_evicted();
    shell.scrape_requests_delayed = endpoint.requests_delayed();
    shell.scrape_bad_requests = endpoint.bad_requests();
    shell.scrape_requests_shed = endpoint.requests_shed();
  }
  return metrics_.render(hub_, shell);
}

std::string HubService::timeline_json(std::string_view model) const {
  const TransferLedger& ledger = metrics_.ledger();
  std::vector<TransferRecord> records = ledger.records();  // a copy: filtered in place
  if (!model.empty()) std::erase_if(records, [&](const TransferRecord& record) { return record.model != model; });
  // (`dropped` counts every model's: the ring keeps no count per model.)
  return chrome_trace_json(records, now_us(), ledger.dropped());
}

kj::Promise<void> HubService::drain(std::int64_t timeout_ms) {
  TH_REQUIRE(timeout_ms >= 0, "a drain has a deadline");
  draining_ = true;
  log(LogLevel::kInfo,
      "draining: closing " + std::to_string(connections_.size()) + " connection(s) (clients told to fail over), " +
          std::to_string(hub_.client_count()) + " client shard(s) open",
      "lifecycle");
  std::vector<std::uint64_t> ids;
  ids.reserve(connections_.size());
  for (const auto& [id, connection] : connections_) ids.push_back(id);
  for (std::uint64_t id : ids) {
    auto found = connections_.find(id);
    if (found == connections_.end()) continue;
    Connection& connection = *found->second;
    if (connection.framed() && connection.welcomed && !connection.ended) {
      // Nothing more is read; what the hub owes it (answers, instructions) and the notice go out
      // in one last write, then the connection closes.
      connection.reading = nullptr;
      connection.going_away = "th-server is shutting down (drain)";
      on_framed_end(connection);
    } else {
      close_connection(id, "th-server is shutting down");
    }
  }
  return wait_drained(now_ms() + timeout_ms);
}

kj::Promise<void> HubService::wait_drained(TimeMs deadline_ms) {
  if (connections_.empty()) {
    log(LogLevel::kInfo, "drained: every connection closed", "lifecycle");
    return kj::READY_NOW;
  }
  if (now_ms() >= deadline_ms) {
    log(LogLevel::kWarn, std::to_string(connections_.size()) + " connection(s) still writing at the drain deadline",
        "lifecycle");
    return kj::READY_NOW;
  }
  return timer_.afterDelay(10 * kj::MILLISECONDS).then([this, deadline_ms] { return wait_drained(deadline_ms); });
}

}  // namespace th::server
