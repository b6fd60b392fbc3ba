// GCC 12 takes the std::string inside kj's ExceptionOr<std::string> (a union member) for one that
// may be used uninitialized once inlined: a known false positive of -Wmaybe-uninitialized. (Before
// the includes: the warning is reported at the library's lines.)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

#include "net/metrics_http.h"


#include <algorithm>
#include <cctype>
#include <future>
#include <utility>

#include "core/assert.h"
#include "net/event_loop.h"

namespace th::net {

namespace {

kj::HttpServerSettings scrape_settings(const MetricsHttpLimits& limits) {
  kj::HttpServerSettings settings;
  // A scraper sends its request at once; a connection that does not is holding a slot.
  settings.headerTimeout = limits.request_wait_ms * kj::MILLISECONDS;
  settings.pipelineTimeout = limits.request_wait_ms * kj::MILLISECONDS;
  return settings;
}

constexpr std::string_view kIndex = "TensorHub metrics: GET /metrics (Prometheus text exposition format 0.0.4)\n";

}  // namespace

// kj::HttpService and kj::HttpServerErrorHandler have no virtual destructors; these classes are
// only ever destroyed as themselves.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wnon-virtual-dtor"
// One per connection (so that a request can have its own connection closed).
class MetricsHttpServer::Service final : public kj::HttpService {
 public:
  Service(MetricsHttpServer& owner, std::uint64_t connection) : owner_(owner), connection_(connection) {}

  kj::Promise<void> request(kj::HttpMethod method, kj::StringPtr url, const kj::HttpHeaders& request_headers,
                            kj::AsyncInputStream&, Response& response) override {
    // kj's server keeps every connection open for the next request; one that asks otherwise (curl
    // and one-shot scrapers say `Connection: close`) is closed once its answer is written, rather
    // than held until the pipeline timeout.
    bool close = false;
    KJ_IF_MAYBE(connection, request_headers.get(kj::HttpHeaderId::CONNECTION)) {
      std::string value(connection->cStr());
      std::transform(value.begin(), value.end(), value.begin(), [](unsigned char c) { return std::tolower(c); });
      close = value.find("close") != std::string::npos;
    }
    auto answered = answer(method, url, response);
    if (!close) return answered;
    return answered.then([this] { owner_.close_later(connection_); });
  }

 private:
  kj::Promise<void> answer(kj::HttpMethod method, kj::StringPtr url, Response& response) {
    // (url is only valid until the first suspension: decide what to answer now.)
    const std::string_view path(url.cStr(), url.size());
    const std::string_view bare = path.substr(0, path.find('?'));
    const bool allowed = method == kj::HttpMethod::GET || method == kj::HttpMethod::HEAD;
    const bool head = method == kj::HttpMethod::HEAD;
    enum class What : std::uint8_t { kMetrics, kIndex, kNotFound, kNotAllowed };
    const What what = !allowed ? What::kNotAllowed : bare == "/metrics" ? What::kMetrics
                                                    : bare == "/"       ? What::kIndex
                                                                        : What::kNotFound;
    return owner_.request_turn().then([this, what, head, &response](bool admitted) -> kj::Promise<void> {
      kj::HttpHeaders headers(owner_.header_table_);
      if (!admitted) return response.sendError(503, "Service Unavailable", headers);
      if (what == What::kNotAllowed) return response.sendError(405, "Method Not Allowed", headers);
      if (what == What::kNotFound) return response.sendError(404, "Not Found", headers);
      if (what == What::kIndex) return send(response, std::string(kIndex), "text/plain; charset=utf-8", head);
      ++owner_.scrapes_;
      return owner_.rendered().then([this, &response, head](std::string body) {
        return send(response, std::move(body), "text/plain; version=0.0.4; charset=utf-8", head);
      });
    });
  }

  kj::Promise<void> send(Response& response, std::string body, const char* content_type, bool head) {
    kj::HttpHeaders headers(owner_.header_table_);
    headers.set(kj::HttpHeaderId::CONTENT_TYPE, content_type);
    auto stream = response.send(200, "OK", headers, body.size());
    if (head) return kj::READY_NOW;
    auto text = kj::heapString(body.data(), body.size());
    auto written = stream->write(text.begin(), text.size());
    return written.attach(kj::mv(stream), kj::mv(text));
  }

  MetricsHttpServer& owner_;
  std::uint64_t connection_;
};

// Malformed requests are answered 400 and counted: anyone can send them, so they are not logged
// (kj's default handler logs each with a stack trace).
class MetricsHttpServer::Errors final : public kj::HttpServerErrorHandler {
 public:
  explicit Errors(MetricsHttpServer& owner) : owner_(owner) {}
  kj::Promise<void> handleClientProtocolError(kj::HttpHeaders::ProtocolError,
                                              kj::HttpService::Response& response) override {
    ++owner_.bad_requests_;
    kj::HttpHeaders headers(owner_.header_table_);
    return response.sendError(400, "Bad Request", headers);
  }
  kj::Promise<void> handleApplicationError(kj::Exception, kj::Maybe<kj::HttpService::Response&> response) override {
    // (No response: the connection is gone, e.g. closed for a newer one; nothing to count.)
    KJ_IF_MAYBE(answer, response) {
      ++owner_.bad_requests_;
      kj::HttpHeaders headers(owner_.header_table_);
      return answer->sendError(400, "Bad Request", headers);
    }
    return kj::READY_NOW;
  }

 private:
  MetricsHttpServer& owner_;
};
#pragma GCC diagnostic pop

MetricsHttpServer::MetricsHttpServer(kj::Timer& timer, Render render, MetricsHttpLimits limits)
    : timer_(timer),
      render_(std::move(render)),
      limits_(limits),
      tokens_(limits.requests_per_s_max),
      refilled_(timer.now()),
      errors_(std::make_unique<Errors>(*this)),
      http_(timer, header_table_,
            [this](kj::AsyncIoStream&) -> kj::Own<kj::HttpService> {
              TH_ASSERT(accepting_ != 0, "kj asks for a connection's service as it starts serving it");
              return kj::heap<Service>(*this, std::exchange(accepting_, 0));
            },
            [this] {
              auto settings = scrape_settings(limits_);
              settings.errorHandler = *errors_;
              return settings;
            }()),
      tasks_(*this) {
  TH_REQUIRE(limits_.connections_max > 0, "a metrics endpoint takes at least one connection");
  TH_REQUIRE(limits_.requests_per_s_max >= 1, "a metrics endpoint answers at least a request a second");
  TH_REQUIRE(limits_.request_wait_ms > 0, "a metrics endpoint waits for a request a while");
}

MetricsHttpServer::~MetricsHttpServer() = default;

kj::Promise<void> MetricsHttpServer::serve(kj::ConnectionReceiver& listener) { return accept_loop(listener); }

void MetricsHttpServer::refill() {
  const kj::TimePoint now = timer_.now();
  tokens_ = std::min(limits_.requests_per_s_max,
                     tokens_ + limits_.requests_per_s_max * static_cast<double>((now - refilled_) / kj::NANOSECONDS) / 1e9);
  refilled_ = now;
}

kj::Promise<bool> MetricsHttpServer::request_turn() {
  refill();
  if (waiters_.empty() && tokens_ >= 1) {
    tokens_ -= 1;
    return true;
  }
  if (waiters_.size() >= limits_.connections_max) {
    // Requests whose connection went (closed for a newer one) hold no place.
    std::erase_if(waiters_, [](auto& waiter) { return !waiter->isWaiting(); });
    if (waiters_.size() >= limits_.connections_max) {
      ++requests_shed_;
      return false;
    }
  }
  ++requests_delayed_;
  auto turn = kj::newPromiseAndFulfiller<void>();
  waiters_.push_back(kj::mv(turn.fulfiller));
  if (!dispensing_) {
    dispensing_ = true;
    tasks_.add(dispense_turns());
  }
  return turn.promise.then([] { return true; });
}

kj::Promise<void> MetricsHttpServer::dispense_turns() {
  refill();
  while (!waiters_.empty() && (tokens_ >= 1 || !waiters_.front()->isWaiting())) {
    auto waiter = kj::mv(waiters_.front());
    waiters_.pop_front();
    if (!waiter->isWaiting()) continue;  // its connection went: it takes no turn
    tokens_ -= 1;
    waiter->fulfill();
  }
  if (waiters_.empty()) {
    dispensing_ = false;
    return kj::READY_NOW;
  }
  const auto wait_ns = static_cast<std::int64_t>((1 - tokens_) / limits_.requests_per_s_max * 1e9) + 1;
  return timer_.afterDelay(wait_ns * kj::NANOSECONDS).then([this] { return dispense_turns(); });
}

void MetricsHttpServer::close_later(std::uint64_t id) {
  // Not from inside the connection's own continuation (dropping its promise destroys it), and last:
  // kj writes an answer without a body (HEAD, errors) only as it flushes, after this turn.
  tasks_.add(kj::evalLast([this, id] { connections_.erase(id); }));
}

kj::Promise<std::string> MetricsHttpServer::rendered() {
  // The rendering runs to its end even if the scraper goes meanwhile: a render handed to another
  // thread's loop is not cancelled from here (kj would wait for that loop to take the cancel).
  auto text = kj::newPromiseAndFulfiller<std::string>();
  tasks_.add(render_()
                 .then([fulfiller = kj::mv(text.fulfiller)](std::string rendered) mutable {
                   fulfiller->fulfill(std::move(rendered));
                 })
                 .catch_([](kj::Exception&&) {}));  // (the fulfiller, dropped, fails the request)
  return kj::mv(text.promise);
}

kj::Promise<void> MetricsHttpServer::accept_loop(kj::ConnectionReceiver& listener) {
  return listener.accept().then(
      [this, &listener](kj::Own<kj::AsyncIoStream> stream) {
        if (connections_.size() >= limits_.connections_max) {
          connections_.erase(connections_.begin());  // the oldest: its connection closes
          ++connections_evicted_;
        }
        const std::uint64_t id = next_connection_++;
        accepting_ = id;  // listenHttp asks the factory for the connection's service at once
        // When it ends, it leaves the map later (not from inside its own continuation).
        auto served = http_.listenHttp(kj::mv(stream));
        TH_ASSERT(accepting_ == 0, "the connection's service was made for it");
        connections_.emplace(id, kj::mv(served).then(
                                     [this, id] { tasks_.add(kj::evalLater([this, id] { connections_.erase(id); })); },
                                     [this, id](kj::Exception&&) {
                                       tasks_.add(kj::evalLater([this, id] { connections_.erase(id); }));
                                     }).eagerlyEvaluate(nullptr));
        TH_ASSERT(connections_.size() <= limits_.connections_max, "connections stay within their bound");
        return accept_loop(listener);
      },
      [this, &listener](kj::Exception&&) {
        // An accept can fail for lack of descriptors; pause rather than spin, then go on serving.
        return timer_.afterDelay(100 * kj::MILLISECONDS).then([this, &listener] { return accept_loop(listener); });
      });
}

void MetricsHttpServer::taskFailed(kj::Exception&&) {
  // (Only the deferred map erasures, renders (their failures caught) and the turn dispenser run
  // here; none fails.)
  dispensing_ = false;
}

Result<std::unique_ptr<MetricsHttpThread>> MetricsHttpThread::start(const std::string& address,
                                                                  MetricsHttpServer::Render render,
                                                                  MetricsHttpLimits limits) {
  std::unique_ptr<MetricsHttpThread> self(new MetricsHttpThread());
  std::promise<std::string> bound;
  auto chosen = bound.get_future();
  MetricsHttpThread* raw = self.get();
  self->thread_ = std::thread([raw, &bound, address, limits, render = std::move(render)]() mutable {
    bool started = false;
    try {
      IoLoop loop;
      auto listener = loop.io().getNetwork().parseAddress(address).wait(loop.wait_scope())->listen();
      {
        MetricsHttpServer server(loop.timer(), std::move(render), limits);
        raw->server_ = &server;
        auto stop = kj::newPromiseAndFulfiller<void>();
        raw->executor_ = &kj::getCurrentThreadExecutor();
        raw->stop_ = kj::mv(stop.fulfiller);
        auto serving = server.serve(*listener).eagerlyEvaluate(nullptr);
        bound.set_value(address.substr(0, address.rfind(':')) + ":" + std::to_string(listener->getPort()));
        started = true;
        stop.promise.wait(loop.wait_scope());
      }  // the server is gone, with what it asked of other threads' loops
      KJ_IF_MAYBE(ended, raw->ended_) { (*ended)->fulfill(); }
    } catch (const kj::Exception& exception) {
      if (!started) bound.set_exception(std::make_exception_ptr(std::runtime_error(exception.getDescription().cStr())));
    } catch (...) {
      if (!started) bound.set_exception(std::current_exception());
    }
  });
  try {
    self->address_ = chosen.get();
  } catch (const std::exception& error) {
    self->thread_.join();
    return Error{Errc::kInvalidArgument, "cannot serve metrics on " + address + ": " + error.what()};
  }
  return self;
}

void MetricsHttpThread::stop(kj::WaitScope& wait_scope) {
  if (executor_ == nullptr || !thread_.joinable()) return;
  auto ended = kj::newPromiseAndCrossThreadFulfiller<void>();
  executor_
      ->executeAsync([this, fulfiller = kj::mv(ended.fulfiller)]() mutable {
        ended_ = kj::mv(fulfiller);
        stop_->fulfill();
      })
      .wait(wait_scope);
  // This loop runs while the thread tears its server down: a render it asked of this loop is
  // cancelled here, not waited for by a loop that no longer turns.
  ended.promise.wait(wait_scope);
  thread_.join();
}

MetricsHttpThread::~MetricsHttpThread() {
  // (A start that failed joined the thread and never set the executor; stop() joined it already.)
  if (executor_ != nullptr && thread_.joinable()) executor_->executeSync([this] { stop_->fulfill(); });
  if (thread_.joinable()) thread_.join();
}

}  // namespace th::net
