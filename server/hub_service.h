// The th-server shell: Cap'n Proto RPC connections in, the core Hub in the middle, effects out.
//
// One thread, one IoLoop. Every message that arrives is decoded (net/wire), fed to the Hub with the
// server's clock, and the Hub's effects are routed to the connections of the clients they name and
// delivered in batches. The shell adds no protocol logic; what it owns is logistics:
//   - authentication: a connection must present the cluster token before it gets a Session;
//   - client binding: a client id belongs to the connection it last spoke on; when a connection
//     closes, the Hub hears ConnectionLost for each of its clients;
//   - flow control: each connection has a bounded number of Sink.deliver calls in flight and a
//     bounded backlog of effects; a client that falls behind further is disconnected;
//   - time: a timer feeds Tick so that heartbeat expiry, barriers and call deadlines fire;
//   - heartbeat datagrams (net/heartbeat.h): each connection gets a secret at connect; a datagram
//     naming a client bound to that connection, with that secret, is the client's Heartbeat report.
#pragma once

#include <capnp/rpc-twoparty.h>
#include <kj/async-io.h>
#include <kj/async-unix.h>

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string_view>
#include <string>
#include <unordered_map>
#include <vector>

#include "core/hub.h"
#include "net/fair_stream.h"
#include "net/heartbeat.h"
#include "net/tensorhub.capnp.h"

namespace th::server {

struct ServiceConfig {
  HubSettings hub;
  std::string token;            // the cluster token every connection must present
  std::int64_t tick_ms = 100;   // how often the Hub hears the clock
  std::uint32_t delivers_in_flight_max = 8;      // Sink.deliver calls per connection
  std::size_t effects_backlog_max = 1 << 16;     // undelivered effects per connection
  std::size_t connections_max = 65536;
  // Messages one connection may read before the loop looks at the kernel again (net/fair_stream.h).
  std::uint32_t messages_per_turn = net::FairMessageStream::kMessagesPerTurnDefault;
  std::uint32_t wakeups_per_poll = net::TurnGate::kWakeupsPerPollDefault;
};
Status validate(const ServiceConfig& config);

enum class LogLevel : std::uint8_t { kError, kWarn, kInfo, kDebug };
std::optional<LogLevel> parse_log_level(std::string_view name);

class HubService final : private kj::TaskSet::ErrorHandler {
 public:
  HubService(ServiceConfig config, kj::Timer& timer, LogLevel log_level);
  ~HubService();
  HubService(const HubService&) = delete;
  HubService& operator=(const HubService&) = delete;

  // Serves connections from `listener` until it is destroyed; also starts the clock.
  kj::Promise<void> serve(kj::ConnectionReceiver& listener);
  // Takes heartbeats as datagrams from `receiver` too, and offers its port to every connection.
  // Call before serve(); without it, clients send heartbeats as calls.
  void serve_heartbeats(kj::UnixEventPort& port, std::unique_ptr<net::HeartbeatReceiver> receiver);


 private:
  struct Connection;
  class HubImpl;
  class SessionImpl;

  void taskFailed(kj::Exception&& exception) override;
  kj::Promise<void> accept_loop(kj::ConnectionReceiver& listener);
  kj::Promise<void> clock_loop();
  kj::Promise<void> heartbeat_loop();
  void on_heartbeat_datagram(const net::HeartbeatDatagram& datagram);
  // Whether the connection's clients may stop sending heartbeats as calls (Session.send's reply).
  bool heartbeat_datagrams_heard(const Connection& connection) const;
  void on_connection(kj::Own<kj::AsyncIoStream> stream);
  void on_disconnect(std::uint64_t connection_id);
  // Decodes and feeds a batch from one connection. Returns an error text for the caller if some
  // message was refused (the rest are still fed).
  std::string on_messages(Connection& connection, capnp::List<wire::ToHub>::Reader messages);
  void feed(const Input& input);
  void route(const Effects& effects);
  void flush(Connection& connection);
  TimeMs now_ms() const;
  void log(LogLevel level, const std::string& line) const;

  ServiceConfig config_;
  kj::Timer& timer_;
  LogLevel log_level_;
  Hub hub_;
  net::TurnGate turn_gate_;
  std::chrono::steady_clock::time_point started_ = std::chrono::steady_clock::now();

  std::unique_ptr<net::HeartbeatReceiver> heartbeat_receiver_;
  kj::Own<kj::UnixEventPort::FdObserver> heartbeat_observer_;
  std::vector<net::HeartbeatDatagram> heartbeat_batch_;  // reused; at most one recvmmsg batch
  std::uint64_t heartbeat_datagrams_ = 0;
  std::uint64_t heartbeat_calls_ = 0;
  std::uint64_t heartbeat_datagrams_refused_ = 0;  // unknown client or wrong secret
  std::uint64_t heartbeat_refusals_unlogged_ = 0;
  TimeMs heartbeat_refusal_logged_ms_ = -1'000'000;

  std::uint64_t next_connection_id_ = 1;
  // Hashed: a heartbeat datagram looks its connection up, 8,192 times a second for 8,192 clients.
  std::unordered_map<std::uint64_t, std::unique_ptr<Connection>> connections_;
  std::unordered_map<ClientId, std::uint64_t> client_connection_;  // client -> connection id
  kj::TaskSet tasks_;
};

}  // namespace th::server
