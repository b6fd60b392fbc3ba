#include "server/hub_service.h"

#include <capnp/rpc.h>

#include <algorithm>
#include <ctime>
#include <iostream>
#include <random>

#include "net/wire.h"

// Cap'n Proto's generated Server classes have virtual methods and a non-virtual destructor; kj owns
// them through kj::Own, which deletes the most-derived type, so the warning does not apply.
#pragma GCC diagnostic ignored "-Wnon-virtual-dtor"

namespace th::server {

Status validate(const ServiceConfig& config) {
  if (auto hub = validate(config.hub); !hub.ok()) return hub;
  if (config.token.empty()) return make_error(Errc::kInvalidArgument, "the cluster token is empty");
  if (config.tick_ms <= 0 || config.tick_ms > 1000) {
    return make_error(Errc::kInvalidArgument, "tick_ms must be in 1..1000");
  }
  if (config.delivers_in_flight_max == 0 || config.effects_backlog_max == 0 || config.connections_max == 0 ||
      config.messages_per_turn == 0 || config.wakeups_per_poll == 0) {
    return make_error(Errc::kInvalidArgument, "flow-control limits must be positive");
  }
  return Unit{};
}

std::optional<LogLevel> parse_log_level(std::string_view name) {
  if (name == "error") return LogLevel::kError;
  if (name == "warn") return LogLevel::kWarn;
  if (name == "info") return LogLevel::kInfo;
  if (name == "debug") return LogLevel::kDebug;
  return std::nullopt;
}

namespace {

// How long heartbeat datagrams gather in the socket's buffer between two reads while they keep
// coming. Far below any heartbeat timeout; at 8,192 beats/s, ~80 datagrams per read.
constexpr std::int64_t kHeartbeatGatherMs = 10;

std::string_view level_name(LogLevel level) {
  switch (level) {
    case LogLevel::kError: return "error";
    case LogLevel::kWarn: return "warn";
    case LogLevel::kInfo: return "info";
    case LogLevel::kDebug: return "debug";
  }
  return "?";
}

// Token comparison that takes the same time wherever the first difference is.
bool same_token(std::string_view a, std::string_view b) {
  unsigned char differ = a.size() == b.size() ? 0 : 1;
  for (std::size_t i = 0; i < std::max(a.size(), b.size()); ++i) {
    differ |= static_cast<unsigned char>((i < a.size() ? a[i] : 0) ^ (i < b.size() ? b[i] : 0));
  }
  return differ == 0;
}

// A connection's heartbeat secret: unpredictable to other peers, never 0 (0 means "no channel").
std::uint64_t new_secret() {
  static std::random_device device;  // the kernel's getrandom
  std::uint64_t secret = 0;
  while (secret == 0) secret = (static_cast<std::uint64_t>(device()) << 32) | device();
  return secret;
}

ClientId client_of(const net::ToHubMessage& message) {
  return std::visit([](const auto& m) { return m.client; }, message);
}

}  // namespace

// ---- Connections -------------------------------------------------------------------------------------

struct HubService::Connection {
  std::uint64_t id = 0;
  std::string name = "?";  // what the client calls itself (logs only)
  kj::Own<kj::AsyncIoStream> stream;
  kj::Own<net::FairMessageStream> messages;
  kj::Own<capnp::TwoPartyVatNetwork> network;
  kj::Own<capnp::RpcSystem<capnp::rpc::twoparty::VatId>> rpc;
  kj::Maybe<wire::Sink::Client> sink;  // set once authenticated
  std::vector<ClientId> clients;       // bound here; a handful per process
  std::vector<Effect> backlog;         // effects not yet handed to deliver()
  std::uint32_t delivers_in_flight = 0;
  std::uint64_t heartbeat_secret = 0;        // 0: no datagram channel
  std::optional<TimeMs> heartbeat_datagram_ms;  // when the last datagram of its clients came

  std::string describe() const { return "connection " + std::to_string(id) + " (" + name + ")"; }
};

class HubService::SessionImpl final : public wire::Session::Server {
 public:
  SessionImpl(HubService& service, std::uint64_t connection) : service_(service), connection_(connection) {}

  kj::Promise<void> send(SendContext context) override {
    auto found = service_.connections_.find(connection_);
    if (found == service_.connections_.end()) {
      return KJ_EXCEPTION(DISCONNECTED, "the connection is closing");
    }
    const auto messages = context.getParams().getMessages();
    if (messages.size() > net::kMessagesPerCallMax) {
      return KJ_EXCEPTION(FAILED, "invalid-argument: more than kMessagesPerCallMax messages in one call");
    }
    const std::string refused = service_.on_messages(*found->second, messages);
    if (!refused.empty()) return KJ_EXCEPTION(FAILED, "invalid-argument", refused);
    context.getResults().setHeartbeatDatagramsHeard(service_.heartbeat_datagrams_heard(*found->second));
    return kj::READY_NOW;
  }

 private:
  HubService& service_;
  std::uint64_t connection_;
};

class HubService::HubImpl final : public wire::Hub::Server {
 public:
  HubImpl(HubService& service, std::uint64_t connection) : service_(service), connection_(connection) {}

  kj::Promise<void> connect(ConnectContext context) override {
    auto found = service_.connections_.find(connection_);
    if (found == service_.connections_.end()) return KJ_EXCEPTION(DISCONNECTED, "the connection is closing");
    Connection& connection = *found->second;
    auto params = context.getParams();
    connection.name = std::string(params.getClientName().cStr()).substr(0, limits::kNameBytesMax);
    if (!same_token(params.getToken().cStr(), service_.config_.token)) {
      service_.log(LogLevel::kWarn, connection.describe() + " presented a wrong cluster token: refused");
      return KJ_EXCEPTION(FAILED, "permission denied: wrong cluster token");
    }
    if (connection.sink != nullptr) return KJ_EXCEPTION(FAILED, "invalid-argument: connect called twice");
    connection.sink = params.getSink();
    service_.log(LogLevel::kDebug, connection.describe() + " authenticated");
    auto results = context.getResults();
    results.setSession(kj::heap<SessionImpl>(service_, connection_));
    if (service_.heartbeat_receiver_ != nullptr) {
      connection.heartbeat_secret = new_secret();
      auto channel = results.initHeartbeats();
      channel.setPort(service_.heartbeat_receiver_->port());
      channel.setSecret(connection.heartbeat_secret);
    }
    return kj::READY_NOW;
  }

  kj::Promise<void> inspect(InspectContext context) override {
    if (!same_token(context.getParams().getToken().cStr(), service_.config_.token)) {
      service_.log(LogLevel::kWarn, "an inspect call presented a wrong cluster token: refused");
      return KJ_EXCEPTION(FAILED, "permission denied: wrong cluster token");
    }
    const Hub& hub = service_.hub_;
    const auto names = hub.model_names();
    auto results = context.getResults();
    auto models = results.initModels(static_cast<unsigned>(names.size()));
    for (unsigned i = 0; i < names.size(); ++i) net::encode(*hub.snapshot(names[i]), models[i]);
    auto stats = results.initStats();
    stats.setRequests(hub.stats().requests);
    stats.setReports(hub.stats().reports);
    stats.setTransfersStarted(hub.stats().transfers_started);
    stats.setTransfersCompleted(hub.stats().transfers_completed);
    stats.setSourceFailures(hub.stats().source_failures);
    stats.setOffloadsStarted(hub.stats().offloads_started);
    stats.setEvictions(hub.stats().evictions);
    stats.setClients(hub.client_count());
    stats.setConnections(service_.connections_.size());
    stats.setUptimeMs(service_.now_ms());
    stats.setHeartbeatDatagrams(service_.heartbeat_datagrams_);
    stats.setHeartbeatCalls(service_.heartbeat_calls_);
    stats.setHeartbeatDatagramsRefused(
        service_.heartbeat_datagrams_refused_ +
        (service_.heartbeat_receiver_ != nullptr ? service_.heartbeat_receiver_->malformed() : 0));
    return kj::READY_NOW;
  }

 private:
  HubService& service_;
  std::uint64_t connection_;
};

// ---- The service -------------------------------------------------------------------------------------

HubService::HubService(ServiceConfig config, kj::Timer& timer, LogLevel log_level)
    : config_(std::move(config)), timer_(timer), log_level_(log_level), hub_(config_.hub),
      turn_gate_(timer, config_.wakeups_per_poll), tasks_(*this) {
  TH_REQUIRE(validate(config_).ok(), "invalid service config");
}

HubService::~HubService() = default;

void HubService::taskFailed(kj::Exception&& exception) {
  log(LogLevel::kError, std::string("internal task failed: ") + exception.getDescription().cStr());
}

kj::Promise<void> HubService::serve(kj::ConnectionReceiver& listener) {
  tasks_.add(clock_loop());
  return accept_loop(listener);
}

void HubService::serve_heartbeats(kj::UnixEventPort& port, std::unique_ptr<net::HeartbeatReceiver> receiver) {
  TH_REQUIRE(heartbeat_receiver_ == nullptr, "serve_heartbeats is called once");
  heartbeat_receiver_ = std::move(receiver);
  heartbeat_observer_ = kj::heap<kj::UnixEventPort::FdObserver>(port, heartbeat_receiver_->fd(),
                                                                 kj::UnixEventPort::FdObserver::OBSERVE_READ);
  tasks_.add(heartbeat_loop());
}

kj::Promise<void> HubService::heartbeat_loop() {
  // A few batches, then the other connections' turn (a flood of datagrams must not starve them).
  constexpr int kBatchesPerTurnMax = 4;
  std::size_t read_total = 0;
  for (int batch = 0; batch < kBatchesPerTurnMax; ++batch) {
    heartbeat_batch_.clear();
    std::size_t read = 0;
    try {
      read = heartbeat_receiver_->receive(heartbeat_batch_);
    } catch (const net::SocketError& error) {
      log(LogLevel::kError, std::string("reading heartbeat datagrams: ") + error.what());
      break;
    }
    read_total += read;
    for (const net::HeartbeatDatagram& datagram : heartbeat_batch_) on_heartbeat_datagram(datagram);
    if (read == 0) {
      if (read_total == 0) {
        // Idle: wait for the next datagram (the socket is drained, so the edge will come).
        return heartbeat_observer_->whenBecomesReadable().then([this] { return heartbeat_loop(); });
      }
      // Beats keep coming: let them gather in the socket's buffer for a while and take them in one
      // go. Waking for every datagram of 8,192 clients cost more than reading them.
      return timer_.afterDelay(kHeartbeatGatherMs * kj::MILLISECONDS).then([this] { return heartbeat_loop(); });
    }
  }
  return turn_gate_.next_turn().then([this] { return heartbeat_loop(); });
}

void HubService::on_heartbeat_datagram(const net::HeartbeatDatagram& datagram) {
  auto bound = client_connection_.find(datagram.client);
  Connection* connection = bound != client_connection_.end() ? connections_.at(bound->second).get() : nullptr;
  if (connection == nullptr || connection->heartbeat_secret != datagram.secret) {
    // Not proof of an attack (a datagram can outlive its connection); logged in summary, since
    // a flood of them must not flood the log.
    ++heartbeat_datagrams_refused_;
    ++heartbeat_refusals_unlogged_;
    const TimeMs now = now_ms();
    if (now - heartbeat_refusal_logged_ms_ >= 10'000) {
      log(LogLevel::kWarn, "refused " + std::to_string(heartbeat_refusals_unlogged_) +
                               " heartbeat datagram(s) (unknown client or wrong secret), the last for client " +
                               std::to_string(datagram.client));
      heartbeat_refusals_unlogged_ = 0;
      heartbeat_refusal_logged_ms_ = now;
    }
    return;
  }
  ++heartbeat_datagrams_;
  connection->heartbeat_datagram_ms = now_ms();
  feed(Report{datagram.client, Heartbeat{}, datagram.session});
}

bool HubService::heartbeat_datagrams_heard(const Connection& connection) const {
  // Recently enough that the client, told so, has time to go back to calls before its timeout.
  return connection.heartbeat_datagram_ms.has_value() &&
         now_ms() - *connection.heartbeat_datagram_ms <= config_.hub.heartbeat_timeout_ms / 2;
}

kj::Promise<void> HubService::accept_loop(kj::ConnectionReceiver& listener) {
  return listener.accept().then([this, &listener](kj::Own<kj::AsyncIoStream> stream) {
    on_connection(kj::mv(stream));
    return accept_loop(listener);
  });
}

kj::Promise<void> HubService::clock_loop() {
  return timer_.afterDelay(config_.tick_ms * kj::MILLISECONDS).then([this] {
    feed(Tick{});
    return clock_loop();
  });
}

void HubService::on_connection(kj::Own<kj::AsyncIoStream> stream) {
  if (connections_.size() >= config_.connections_max) {
    log(LogLevel::kWarn, "refusing a connection: " + std::to_string(connections_.size()) +
                             " open (limit " + std::to_string(config_.connections_max) + ")");
    return;  // dropping the stream closes it
  }
  auto connection = std::make_unique<Connection>();
  connection->id = next_connection_id_++;
  connection->stream = kj::mv(stream);
  connection->messages = kj::heap<net::FairMessageStream>(*connection->stream, turn_gate_,
                                                          config_.messages_per_turn);
  connection->network = kj::heap<capnp::TwoPartyVatNetwork>(*connection->messages, capnp::rpc::twoparty::Side::SERVER);
  connection->rpc = kj::heap(capnp::makeRpcServer(*connection->network,
                                                  kj::heap<HubImpl>(*this, connection->id)));
  const std::uint64_t id = connection->id;
  tasks_.add(connection->network->onDisconnect().then([this, id] { on_disconnect(id); }));
  connections_.emplace(id, std::move(connection));
}

void HubService::on_disconnect(std::uint64_t connection_id) {
  auto found = connections_.find(connection_id);
  if (found == connections_.end()) return;
  std::unique_ptr<Connection> connection = std::move(found->second);
  connections_.erase(found);
  log(connection->clients.empty() ? LogLevel::kDebug : LogLevel::kInfo,
      connection->describe() + " closed; " + std::to_string(connection->clients.size()) + " client(s) lost");
  for (ClientId client : connection->clients) {
    client_connection_.erase(client);
    feed(ConnectionLost{client});
  }
  // The RPC system may still be unwinding the call stack that brought us here: free it later.
  tasks_.add(kj::evalLater([connection = std::move(connection)] {}));
}

std::string HubService::on_messages(Connection& connection, capnp::List<wire::ToHub>::Reader messages) {
  std::string refused;
  for (auto message : messages) {
    auto decoded = net::decode(message);
    if (!decoded.ok()) {
      log(LogLevel::kWarn, connection.describe() + " sent an invalid message: " + decoded.error().detail);
      if (refused.empty()) refused = decoded.error().detail;
      continue;
    }
    const ClientId client = client_of(decoded.value());
    auto bound = client_connection_.find(client);
    if (bound == client_connection_.end() || bound->second != connection.id) {
      // A client speaks on its newest connection (it reconnected before we saw the old one close).
      if (bound != client_connection_.end()) {
        if (auto old = connections_.find(bound->second); old != connections_.end()) {
          std::erase(old->second->clients, client);
          log(LogLevel::kInfo, "client " + std::to_string(client) + " moved from " +
                                   old->second->describe() + " to " + connection.describe());
        }
      }
      client_connection_[client] = connection.id;
      connection.clients.push_back(client);
    }
    if (const auto* report = std::get_if<Report>(&decoded.value());
        report != nullptr && std::holds_alternative<Heartbeat>(report->body)) {
      ++heartbeat_calls_;
    }
    if (log_level_ >= LogLevel::kDebug) {
      if (const auto* request = std::get_if<Request>(&decoded.value())) {
        log(LogLevel::kDebug, "client " + std::to_string(client) + " seq " + std::to_string(request->seq) +
                                  (std::holds_alternative<OpenRequest>(request->body)
                                       ? std::string(" open")
                                       : " " + std::string(op_name(op_kind(request->body)))));
      }
    }
    std::visit([this](const auto& input) { feed(input); }, std::move(decoded).value());
  }
  return refused;
}

void HubService::feed(const Input& input) {
  Effects effects;
  hub_.step(input, now_ms(), effects);
  route(effects);
}

void HubService::route(const Effects& effects) {
  std::vector<std::uint64_t> touched;
  for (const Effect& effect : effects) {
    if (const auto* evicted = std::get_if<Evicted>(&effect.message)) {
      log(LogLevel::kInfo, "client " + std::to_string(effect.client) + " evicted (" +
                               std::string(errc_name(evicted->reason)) + "): " + evicted->detail);
    }
    auto bound = client_connection_.find(effect.client);
    if (bound == client_connection_.end()) continue;  // the client is gone; the Hub will learn it
    Connection& connection = *connections_.at(bound->second);
    connection.backlog.push_back(effect);
    if (connection.backlog.size() == 1) touched.push_back(connection.id);
  }
  std::vector<std::uint64_t> overloaded;
  for (std::uint64_t id : touched) {
    Connection& connection = *connections_.at(id);
    if (connection.backlog.size() > config_.effects_backlog_max) {
      overloaded.push_back(id);
    } else {
      flush(connection);
    }
  }
  // After routing, so that the Hub is not re-entered while its effects are being handed out.
  for (std::uint64_t id : overloaded) {
    log(LogLevel::kWarn, connections_.at(id)->describe() + " fell more than " +
                             std::to_string(config_.effects_backlog_max) + " effects behind: disconnecting it");
    on_disconnect(id);
  }
}

void HubService::flush(Connection& connection) {
  KJ_IF_MAYBE(sink, connection.sink) {
    while (connection.delivers_in_flight < config_.delivers_in_flight_max && !connection.backlog.empty()) {
      const std::size_t count = std::min(connection.backlog.size(), net::kMessagesPerCallMax);
      auto request = sink->deliverRequest();
      auto list = request.initEffects(static_cast<unsigned>(count));
      for (std::size_t i = 0; i < count; ++i) net::encode(connection.backlog[i], list[static_cast<unsigned>(i)]);
      connection.backlog.erase(connection.backlog.begin(), connection.backlog.begin() + static_cast<long>(count));
      ++connection.delivers_in_flight;
      const std::uint64_t id = connection.id;
      auto delivered = [this, id] {
        auto found = connections_.find(id);
        if (found == connections_.end()) return;
        --found->second->delivers_in_flight;
        flush(*found->second);
      };
      // (kj::mv: `then` keeps a reference to an lvalue callback, which would dangle.)
      tasks_.add(request.send().ignoreResult().then(
          kj::mv(delivered), [](kj::Exception&&) { /* the client went away: its disconnect reports it */ }));
    }
  }
  // Not authenticated yet: effects wait (the Hub only answers clients that sent something, which
  // needs a session, so this is rare and brief).
}

TimeMs HubService::now_ms() const {
  return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - started_).count();
}

void HubService::log(LogLevel level, const std::string& line) const {
  if (level > log_level_) return;
  const std::time_t now = std::time(nullptr);
  char stamp[32];
  std::strftime(stamp, sizeof stamp, "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&now));
  std::cerr << stamp << " th-server " << level_name(level) << ": " << line << "\n";
}

}  // namespace th::server
