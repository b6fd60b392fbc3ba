// The HTTP endpoint Prometheus scrapes: GET /metrics answers with the text a callback renders.
//
// kj-http does the HTTP (no parser of ours). What this adds is the bounds a port exposed to a
// network needs, since it runs on the owner's event loop (th-server's one thread: the control
// plane must not starve behind it):
//   - requests: at most `requests_per_s_max` answered a second (a burst of one second's worth);
//     a request past it waits for its turn, first come first served, so a flood of pipelined
//     requests costs the loop that many renders a second and leaves it idle in between. A turn
//     is taken only when the request is answered (one whose connection went meanwhile takes
//     none), and at most `connections_max` wait: past that a request is answered 503 at once, so
//     no burst can build a queue that outlives it;
//   - connections: at most `connections_max`; a new one closes the oldest (a scraper that holds a
//     connection idle cannot lock the others out); a request must arrive within
//     `request_wait_ms`; one that says `Connection: close` has its connection closed once answered;
//   - only GET/HEAD of /metrics and / are answered (404, 405 otherwise); malformed requests get 400
//     and are counted, not logged.
// MetricsHttpThread runs one on a thread and loop of its own: for a process that has none to offer
// (libthclient; then the callback must be thread-safe), and for one whose loop must not pay for a
// flood of connections (th-server: the callback hands the rendering to the owner's loop).
// (A flood of 25-31 k connections a second cost th-server's one loop 75 % of a core when the
// endpoint shared it.)
#pragma once

#include <kj/async-io.h>
#include <kj/compat/http.h>

#include <atomic>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>

#include "core/result.h"

namespace th::net {

struct MetricsHttpLimits {
  std::size_t connections_max = 16;
  double requests_per_s_max = 20;
  std::int64_t request_wait_ms = 5000;  // for a connection's (next) request, then it is closed
};

class MetricsHttpServer final : private kj::TaskSet::ErrorHandler {
 public:
  // The text to answer a scrape with, as a promise so that it may come from another thread's loop
  // (kj::Executor::executeAsync) without blocking this one; a function returning the text will do.
  using Render = std::function<kj::Promise<std::string>()>;

  MetricsHttpServer(kj::Timer& timer, Render render, MetricsHttpLimits limits = {});
  ~MetricsHttpServer();
  MetricsHttpServer(const MetricsHttpServer&) = delete;
  MetricsHttpServer& operator=(const MetricsHttpServer&) = delete;

  // Accepts scrapers on `listener` until the promise is dropped (accept errors are retried).
  kj::Promise<void> serve(kj::ConnectionReceiver& listener);

  // Counted on this server's loop; read from any thread.
  std::uint64_t scrapes() const { return scrapes_.load(std::memory_order_relaxed); }
  std::uint64_t connections_evicted() const { return connections_evicted_.load(std::memory_order_relaxed); }
  std::uint64_t requests_delayed() const { return requests_delayed_.load(std::memory_order_relaxed); }
  std::uint64_t bad_requests() const { return bad_requests_.load(std::memory_order_relaxed); }
  // Answered 503: too many waiting.
  std::uint64_t requests_shed() const { return requests_shed_.load(std::memory_order_relaxed); }

 private:
  class Service;
  class Errors;
  kj::Promise<void> accept_loop(kj::ConnectionReceiver& listener);
  // Resolves when a request may be answered (true), or at once with false when too many wait.
  kj::Promise<bool> request_turn();
  kj::Promise<void> dispense_turns();
  void refill();
  // Closes connection `id` (once its answer is written: the connection asked for it).
  void close_later(std::uint64_t id);
  // The text for a scrape; the rendering is not cancelled if the scraper goes meanwhile.
  kj::Promise<std::string> rendered();
  void taskFailed(kj::Exception&& exception) override;

  kj::Timer& timer_;
  Render render_;
  MetricsHttpLimits limits_;
  std::atomic<std::uint64_t> scrapes_ = 0;
  std::atomic<std::uint64_t> connections_evicted_ = 0;
  std::atomic<std::uint64_t> requests_delayed_ = 0;
  std::atomic<std::uint64_t> bad_requests_ = 0;
  std::atomic<std::uint64_t> requests_shed_ = 0;
  std::deque<kj::Own<kj::PromiseFulfiller<void>>> waiters_;  // requests waiting for a turn, in order
  bool dispensing_ = false;
  // The request budget: tokens, refilled at requests_per_s_max, at most one second's worth.
  double tokens_;
  kj::TimePoint refilled_;
  kj::HttpHeaderTable header_table_;
  std::unique_ptr<Errors> errors_;
  std::uint64_t accepting_ = 0;  // the id of the connection whose service is being made (the factory's)
  kj::HttpServer http_;
  // Connections being served, oldest first (ids rise); dropping a promise closes its connection.
  std::map<std::uint64_t, kj::Promise<void>> connections_;
  std::uint64_t next_connection_ = 1;
  kj::TaskSet tasks_;
};

// A MetricsHttpServer on a thread and event loop of its own. `render` is called on that thread.
class MetricsHttpThread {
 public:
  // Listens on `address` (HOST:PORT, port 0: any free port); fails with kInvalidArgument if the
  // address does not parse or cannot be bound.
  static Result<std::unique_ptr<MetricsHttpThread>> start(const std::string& address, MetricsHttpServer::Render render,
                                                          MetricsHttpLimits limits = {});
  // Stops serving and joins the thread, running the caller's loop meanwhile: for an owner whose
  // render hands work to that loop (the thread may have to cancel it). Then the destructor does
  // nothing more.
  void stop(kj::WaitScope& wait_scope);
  ~MetricsHttpThread();  // stops serving and joins the thread (if stop() did not)
  MetricsHttpThread(const MetricsHttpThread&) = delete;
  MetricsHttpThread& operator=(const MetricsHttpThread&) = delete;

  const std::string& address() const { return address_; }  // with the port the kernel chose
  // The endpoint's own figures (any thread; they live as long as this object).
  const MetricsHttpServer& server() const { return *server_; }

 private:
  MetricsHttpThread() = default;
  std::thread thread_;
  std::string address_;
  const kj::Executor* executor_ = nullptr;
  const MetricsHttpServer* server_ = nullptr;  // on the thread's stack, until the thread ends
  kj::Own<kj::PromiseFulfiller<void>> stop_;
  kj::Maybe<kj::Own<kj::CrossThreadPromiseFulfiller<void>>> ended_;  // (stop(): told once the server is gone)
};

}  // namespace th::net
