// libthclient's Prometheus metrics: one HTTP endpoint per process (ClientOptions::metrics_listen),
// a section per handle.
//
// Every handle registers its HandleMetrics here; a scrape renders each handle's figures under its
// labels (model, replica, shard), so a process with 8 shards shows 8 series per metric and
// nothing unbounded. What the handle already counts (HandleStats: bytes, failures, pulls by
// transport) is read at scrape time; what only the public calls see (how long a call stalled the
// application, and its result) is recorded here as the calls return.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "net/metrics.h"
#include "net/metrics_http.h"
#include "tensorhub/client.h"

namespace th::client {

class HandleMetrics {
 public:
  enum class Call : std::uint8_t { kPublish, kUnpublish, kReplicate, kUpdate, kList, kWait, kClose };
  static std::string_view call_name(Call call);

  // `stats` is read at each scrape, on the endpoint's thread, while the handle is attached.
  HandleMetrics(const ClientOptions& options, std::function<HandleStats()> stats);
  // A call returned after `seconds` with `result` ("ok", an error code, "no-newer-version", ...).
  void record(Call call, double seconds, std::string_view result);

 private:
  friend class ClientMetrics;
  std::vector<std::pair<std::string, std::string>> labels_;  // model, replica, shard
  std::function<HandleStats()> stats_;
  mutable std::mutex mutex_;
  net::Histogram stall_replicate_;  // replicate and update: how long the call held the application
  net::Histogram stall_update_;
  std::map<std::pair<Call, std::string>, std::uint64_t> calls_;
};

class ClientMetrics {
 public:
  static ClientMetrics& instance();  // lives until the process exits
  // Starts the endpoint on `address` unless it runs already; one per process: asking for another
  // address fails with kInvalidArgument (every handle of the process shows on the first one).
  Status serve(const std::string& address);
  std::string address() const;  // with the port chosen; "" while not serving
  void attach(std::shared_ptr<HandleMetrics> handle);
  void detach(const HandleMetrics* handle);  // before the handle's stats source goes away
  std::string render() const;

 private:
  mutable std::mutex mutex_;
  std::string requested_;
  std::unique_ptr<net::MetricsHttpThread> endpoint_;
  std::vector<std::shared_ptr<HandleMetrics>> handles_;
};

}  // namespace th::client
