// The HTTP endpoint Prometheus scrapes: GET /metrics answers with the text a callback renders.
//
// kj-http does the HTTP (no parser of ours). What this adds is the bound a server exposed on a
// port needs: at most `connections_max` scrapers at once (a further connection is closed at
// accept), a request must arrive within the header timeout, and only GET/HEAD of /metrics and /
// are answered (404 otherwise). Rendering runs on the serving loop, so the callback reads the
// owner's state without locks (th-server: its one thread); MetricsHttpThread runs a loop of its
// own for a process that has none to offer (libthclient), and then the callback must be
// thread-safe.
#pragma once

#include <kj/async-io.h>
#include <kj/compat/http.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <thread>

#include "core/result.h"

namespace th::net {

class MetricsHttpServer final : private kj::TaskSet::ErrorHandler {
 public:
  using Render = std::function<std::string()>;
  static constexpr std::size_t kConnectionsMaxDefault = 16;

  MetricsHttpServer(kj::Timer& timer, Render render, std::size_t connections_max = kConnectionsMaxDefault);
  ~MetricsHttpServer();
  MetricsHttpServer(const MetricsHttpServer&) = delete;
  MetricsHttpServer& operator=(const MetricsHttpServer&) = delete;

  // Accepts scrapers on `listener` until the promise is dropped (accept errors are retried).
  kj::Promise<void> serve(kj::ConnectionReceiver& listener);
  std::uint64_t scrapes() const { return scrapes_; }
  std::uint64_t connections_refused() const { return connections_refused_; }

 private:
  class Service;
  kj::Promise<void> accept_loop(kj::ConnectionReceiver& listener);
  void taskFailed(kj::Exception&& exception) override;

  Render render_;
  std::size_t connections_max_;
  std::size_t connections_ = 0;
  std::uint64_t scrapes_ = 0;
  std::uint64_t connections_refused_ = 0;
  kj::HttpHeaderTable header_table_;
  std::unique_ptr<Service> service_;
  kj::HttpServer http_;
  kj::TaskSet tasks_;
};

// A MetricsHttpServer on a thread and event loop of its own. `render` is called on that thread.
class MetricsHttpThread {
 public:
  // Listens on `address` (HOST:PORT, port 0: any free port); fails with kInvalidArgument if the
  // address does not parse or cannot be bound.
  static Result<std::unique_ptr<MetricsHttpThread>> start(const std::string& address, MetricsHttpServer::Render render);
  ~MetricsHttpThread();  // stops serving and joins the thread
  MetricsHttpThread(const MetricsHttpThread&) = delete;
  MetricsHttpThread& operator=(const MetricsHttpThread&) = delete;

  const std::string& address() const { return address_; }  // with the port the kernel chose

 private:
  MetricsHttpThread() = default;
  std::thread thread_;
  std::string address_;
  const kj::Executor* executor_ = nullptr;
  kj::Own<kj::PromiseFulfiller<void>> stop_;
};

}  // namespace th::net
