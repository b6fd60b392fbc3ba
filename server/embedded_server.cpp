#include "server/embedded_server.h"

#include <future>
#include <iostream>

#include "net/event_loop.h"
#include "net/heartbeat.h"

namespace th::server {

EmbeddedServer::EmbeddedServer(ServiceConfig config, LogLevel log_level) {
  std::promise<std::uint16_t> port;
  auto chosen = port.get_future();
  thread_ = std::thread([this, &port, config = std::move(config), log_level] {
    bool started = false;
    try {
      net::IoLoop loop;
      HubService service(config, loop.timer(), log_level);
      service.use_event_port(loop.port());
      auto listener = loop.io().getNetwork().parseAddress("127.0.0.1:0").wait(loop.wait_scope())->listen();
      const auto listen_port = static_cast<std::uint16_t>(listener->getPort());
      service.serve_heartbeats(loop.port(), std::make_unique<net::HeartbeatReceiver>(net::Endpoint{"127.0.0.1", listen_port}));
      auto stop = kj::newPromiseAndFulfiller<void>();
      executor_ = &kj::getCurrentThreadExecutor();
      service_ = &service;
      stop_ = kj::mv(stop.fulfiller);
      auto serving = service.serve(*listener).eagerlyEvaluate(nullptr);
      port.set_value(listen_port);
      started = true;
      stop.promise.wait(loop.wait_scope());
    } catch (...) {
      if (!started) {
        port.set_exception(std::current_exception());
      } else {
        std::cerr << "embedded th-server stopped on an error\n";
      }
    }
  });
  try {
    address_ = "127.0.0.1:" + std::to_string(chosen.get());
  } catch (...) {
    thread_.join();
    throw;
  }
}

std::string EmbeddedServer::timeline_json() const {
  std::string json;
  executor_->executeSync([this, &json] { json = service_->timeline_json(); });
  return json;
}

EmbeddedServer::~EmbeddedServer() {
  executor_->executeSync([this] { stop_->fulfill(); });
  thread_.join();
}

}  // namespace th::server
