#include "net/metrics_http.h"

#include <future>

#include "net/event_loop.h"

namespace th::net {

namespace {

kj::HttpServerSettings scrape_settings() {
  kj::HttpServerSettings settings;
  // A scraper sends its request at once; a connection that does not is holding a slot.
  settings.headerTimeout = 5 * kj::SECONDS;
  settings.pipelineTimeout = 30 * kj::SECONDS;  // Prometheus keeps its connection between scrapes
  return settings;
}

constexpr std::string_view kIndex =
    "TensorHub metrics: GET /metrics (Prometheus text exposition format 0.0.4)\n";

}  // namespace

// kj::HttpService has no virtual destructor; this class is only ever destroyed as itself.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wnon-virtual-dtor"
class MetricsHttpServer::Service final : public kj::HttpService {
 public:
  explicit Service(MetricsHttpServer& owner) : owner_(owner) {}

  kj::Promise<void> request(kj::HttpMethod method, kj::StringPtr url, const kj::HttpHeaders&,
                            kj::AsyncInputStream&, Response& response) override {
    kj::HttpHeaders headers(owner_.header_table_);
    if (method != kj::HttpMethod::GET && method != kj::HttpMethod::HEAD) {
      return response.sendError(405, "Method Not Allowed", headers);
    }
    const std::string_view path(url.cStr(), url.size());
    const std::string_view bare = path.substr(0, path.find('?'));
    std::string body;
    if (bare == "/metrics") {
      ++owner_.scrapes_;
      body = owner_.render_();
      headers.set(kj::HttpHeaderId::CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8");
    } else if (bare == "/") {
      body = kIndex;
      headers.set(kj::HttpHeaderId::CONTENT_TYPE, "text/plain; charset=utf-8");
    } else {
      return response.sendError(404, "Not Found", headers);
    }
    auto stream = response.send(200, "OK", headers, body.size());
    if (method == kj::HttpMethod::HEAD) return kj::READY_NOW;
    auto text = kj::heapString(body.data(), body.size());
    auto written = stream->write(text.begin(), text.size());
    return written.attach(kj::mv(stream), kj::mv(text));
  }

 private:
  MetricsHttpServer& owner_;
};
#pragma GCC diagnostic pop

MetricsHttpServer::MetricsHttpServer(kj::Timer& timer, Render render, std::size_t connections_max)
    : render_(std::move(render)),
      connections_max_(connections_max),
      service_(std::make_unique<Service>(*this)),
      http_(timer, header_table_, *service_, scrape_settings()),
      tasks_(*this) {
  TH_REQUIRE(connections_max_ > 0, "a metrics endpoint takes at least one connection");
}

MetricsHttpServer::~MetricsHttpServer() = default;

kj::Promise<void> MetricsHttpServer::serve(kj::ConnectionReceiver& listener) { return accept_loop(listener); }

kj::Promise<void> MetricsHttpServer::accept_loop(kj::ConnectionReceiver& listener) {
  return listener.accept().then(
      [this, &listener](kj::Own<kj::AsyncIoStream> stream) {
        if (connections_ >= connections_max_) {
          ++connections_refused_;  // closed at once: the stream goes out of scope
        } else {
          ++connections_;
          tasks_.add(http_.listenHttp(kj::mv(stream)).attach(kj::defer([this] { --connections_; })));
        }
        return accept_loop(listener);
      },
      [this, &listener](kj::Exception&&) {
        // An accept can fail for lack of descriptors; try again shortly rather than stop serving.
        return accept_loop(listener);
      });
}

void MetricsHttpServer::taskFailed(kj::Exception&&) {
  // A scraper that sent garbage or vanished: its connection is gone, nothing else is affected.
}

Result<std::unique_ptr<MetricsHttpThread>> MetricsHttpThread::start(const std::string& address,
                                                                  MetricsHttpServer::Render render) {
  std::unique_ptr<MetricsHttpThread> self(new MetricsHttpThread());
  std::promise<std::string> bound;
  auto chosen = bound.get_future();
  MetricsHttpThread* raw = self.get();
  self->thread_ = std::thread([raw, &bound, address, render = std::move(render)]() mutable {
    bool started = false;
    try {
      IoLoop loop;
      auto listener = loop.io().getNetwork().parseAddress(address).wait(loop.wait_scope())->listen();
      MetricsHttpServer server(loop.timer(), std::move(render));
      auto stop = kj::newPromiseAndFulfiller<void>();
      raw->executor_ = &kj::getCurrentThreadExecutor();
      raw->stop_ = kj::mv(stop.fulfiller);
      auto serving = server.serve(*listener).eagerlyEvaluate(nullptr);
      bound.set_value(address.substr(0, address.rfind(':')) + ":" + std::to_string(listener->getPort()));
      started = true;
      stop.promise.wait(loop.wait_scope());
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

MetricsHttpThread::~MetricsHttpThread() {
  // (A start that failed joined the thread and never set the executor.)
  if (executor_ != nullptr) executor_->executeSync([this] { stop_->fulfill(); });
  if (thread_.joinable()) thread_.join();
}

}  // namespace th::net
