// A th-server on a thread of its own, for tools that bring their own (th-demo, th-bench): the same
// HubService, on loopback, with heartbeat datagrams as th-server takes them by default.
#pragma once

#include <kj/async.h>

#include <string>
#include <thread>

#include "server/hub_service.h"

namespace th::server {

class EmbeddedServer {
 public:
  // Listens on 127.0.0.1 at a free port; returns once it accepts connections.
  EmbeddedServer(ServiceConfig config, LogLevel log_level);
  ~EmbeddedServer();  // stops the server and joins its thread
  EmbeddedServer(const EmbeddedServer&) = delete;
  EmbeddedServer& operator=(const EmbeddedServer&) = delete;

  const std::string& address() const { return address_; }  // "127.0.0.1:PORT"
  // The server's transfer timeline (HubService::timeline_json), taken on its thread.
  std::string timeline_json() const;

 private:
  std::thread thread_;
  std::string address_;
  const kj::Executor* executor_ = nullptr;
  const HubService* service_ = nullptr;  // lives on thread_ while it serves
  kj::Own<kj::PromiseFulfiller<void>> stop_;
};

}  // namespace th::server
