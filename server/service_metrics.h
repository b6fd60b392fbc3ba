// th-server's figures for Prometheus (--metrics-listen) and its transfer timeline (--timeline).
//
// Fed by the shell after every Hub::step with the input, the effects and how long the step took;
// rendered when scraped. The Hub's own counters and state (replicas, versions, transfers in
// flight) are read at scrape time, not copied; what is accumulated here is what only the shell
// sees: when an operation's request arrived and when its reply left (latency), the time the hub
// spent on it (CPU), and the transfers' bytes and failures (TransferLedger).
#pragma once

#include <array>
#include <cstdint>
#include <map>
#include <string>
#include <unordered_map>

#include "core/hub.h"
#include "net/metrics.h"
#include "server/transfer_ledger.h"

namespace th::server {

// What the shell knows that the Hub does not, read at scrape time.
struct ShellFigures {
  std::size_t connections = 0;
  std::uint64_t heartbeat_datagrams = 0;
  std::uint64_t heartbeat_calls = 0;
  std::uint64_t heartbeat_datagrams_refused = 0;
  double uptime_seconds = 0;
  bool draining = false;
  // The metrics endpoint itself (net/metrics_http.h).
  std::uint64_t scrapes = 0;
  std::uint64_t scrape_connections_evicted = 0;
  std::uint64_t scrape_requests_delayed = 0;
  std::uint64_t scrape_bad_requests = 0;
  std::uint64_t scrape_requests_shed = 0;
};

class ServiceMetrics {
 public:
  explicit ServiceMetrics(std::size_t timeline_transfers_max = TransferLedger::kFinishedMaxDefault);

  // After Hub::step(input): its effects, and when the step began and ended (us since the server
  // started; the server has one thread, so the step's wall time is the hub's CPU time for it).
  void observe(const Hub& hub, const Input& input, const Effects& effects, std::int64_t step_start_us,
               std::int64_t step_end_us);

  const TransferLedger& ledger() const { return ledger_; }
  std::string render(const Hub& hub, const ShellFigures& shell) const;

  // Operation kinds as labelled: open, then OpKind's (publish, unpublish, ...).
  static constexpr std::size_t kOps = 8;
  static std::string_view op_label(std::size_t op);
  std::uint64_t operations(std::size_t op, std::string_view result) const;

 private:
  // The call a client has outstanding (libthclient makes one at a time per shard).
  struct Pending {
    std::uint64_t seq = 0;
    std::uint8_t op = 0;
    std::int64_t arrival_us = 0;
    double cpu_seconds = 0;
    bool answered = false;  // a retransmission of an answered call is not counted again
  };
  // Clients that vanish without a ConnectionLost (evicted) are dropped with their Evicted effect;
  // past this many (a bug elsewhere), the table is cleared rather than grow.
  static constexpr std::size_t kPendingMax = 1 << 20;

  void on_request(const Request& request, double step_seconds, std::int64_t arrival_us);
  void on_reply(ClientId client, const Reply& reply, std::int64_t now_us);

  std::unordered_map<ClientId, Pending> pending_;
  std::array<net::Histogram, kOps> latency_;
  std::array<net::Histogram, kOps> cpu_;
  std::map<std::pair<std::uint8_t, std::string>, std::uint64_t> operations_;  // (op, result) -> count
  std::uint64_t resumed_opens_ = 0;  // opens that carried a resume: a failover from another server
  double hub_seconds_ = 0;           // time in Hub::step, all inputs
  TransferLedger ledger_;
};

}  // namespace th::server
