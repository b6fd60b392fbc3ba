#include "server/hub_service.h"
#include "server/connection.h"

#include <capnp/rpc.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <ctime>
#include <iostream>
#include <random>

#include <arpa/inet.h>
#ifdef __GLIBC__
#include <malloc.h>  // malloc_trim
#endif
#include <netinet/in.h>
#include <sys/socket.h>

#include "net/tls.h"
#include "net/token.h"
#include "net/wire.h"

// Cap'n Proto's generated Server classes have virtual methods and a non-virtual destructor; kj owns
// them through kj::Own, which deletes the most-derived type, so the warning does not apply.
#pragma GCC diagnostic ignored "-Wnon-virtual-dtor"

namespace th::server {

Status validate(const ServiceConfig& config) {
  if (auto hub = validate(config.hub); !hub.ok()) return hub;
  if (Status token = net::check_token_size(config.token, "the cluster token"); !token.ok()) return token;
  for (const std::string& more : config.more_tokens) {
    if (Status token = net::check_token_size(more, "a further cluster token"); !token.ok()) return token;
  }
  if (config.tick_ms <= 0 || config.tick_ms > 1000) {
    return make_error(Errc::kInvalidArgument, "tick_ms must be in 1..1000");
  }
  if (config.delivers_in_flight_max == 0 || config.effects_backlog_max == 0 || config.connections_max == 0 ||
      config.rpc_answers_bytes_max == 0 ||
      config.messages_per_turn == 0 || config.wakeups_per_poll == 0) {
    return make_error(Errc::kInvalidArgument, "flow-control limits must be positive");
  }
  if (config.unauthenticated_max == 0 || config.auth_deadline_ms <= 0 ||
      config.unauthenticated_message_words_max == 0 || config.unauthenticated_messages_max == 0 ||
      config.wrong_tokens_per_connection_max == 0 || config.tls_handshakes_per_s_max == 0 ||
      config.idle_timeout_ms < 0) {
    return make_error(Errc::kInvalidArgument, "connection limits must be positive");
  }
  if (config.idle_timeout_ms != 0 && config.idle_timeout_ms <= config.hub.heartbeat_timeout_ms) {
    return make_error(Errc::kInvalidArgument, "the idle timeout must exceed the heartbeat timeout");
  }
  return Unit{};
}

namespace {

// How often connections are checked against their auth deadline and idle timeout.
constexpr TimeMs kSweepMs = 1000;
// Before its handshake is given a turn, a connection must send something: at least one byte, read
// up to a TLS record header's 5 (then replayed to kj-tls). Sending nothing costs the server no turn.
constexpr std::size_t kTlsFirstBytes = 5;
// How long accepting pauses after accept() failed (out of descriptors): long enough not to spin.
constexpr std::int64_t kAcceptRetryDelayMs = 100;
// A client's secret at connect: at least 128 bits.
constexpr std::size_t kClientSecretBytesMin = 16;
constexpr std::size_t kClientSecretBytesMax = 64;

// How long heartbeat datagrams gather in the socket's buffer between two reads while they keep
// coming. Far below any heartbeat timeout; at 8,192 beats/s, ~80 datagrams per read.
constexpr std::int64_t kHeartbeatGatherMs = 10;

// Token comparison that takes the same time wherever the first difference is.
bool same_token(std::string_view a, std::string_view b) {
  unsigned char differ = a.size() == b.size() ? 0 : 1;
  for (std::size_t i = 0; i < std::max(a.size(), b.size()); ++i) {
    differ |= static_cast<unsigned char>((i < a.size() ? a[i] : 0) ^ (i < b.size() ? b[i] : 0));
  }
  return differ == 0;
}

// Whether two secrets are equal, in a time that does not depend on where they differ.
bool same_secret(kj::ArrayPtr<const kj::byte> a, std::string_view b) {
  if (a.size() != b.size()) return false;
  unsigned char differ = 0;
  for (std::size_t i = 0; i < a.size(); ++i) differ |= static_cast<unsigned char>(a[i] ^ static_cast<kj::byte>(b[i]));
  return differ == 0;
}

// Text from the network, fit for one log line: printable ASCII only, bounded.
std::string sanitised(std::string_view text) {
  std::string out;
  for (char c : text.substr(0, limits::kNameBytesMax)) out += c >= 0x20 && c < 0x7f ? c : '?';
  return out;
}

std::string peer_of(kj::AsyncIoStream& stream) {
  sockaddr_storage address{};
  kj::uint length = sizeof address;
  try {
    stream.getpeername(reinterpret_cast<sockaddr*>(&address), &length);
  } catch (const kj::Exception&) {
    return "?";
  }
  char host[INET6_ADDRSTRLEN] = "?";
  std::uint16_t port = 0;
  if (address.ss_family == AF_INET) {
    const auto& in = reinterpret_cast<const sockaddr_in&>(address);
    inet_ntop(AF_INET, &in.sin_addr, host, sizeof host);
    port = ntohs(in.sin_port);
  } else if (address.ss_family == AF_INET6) {
    const auto& in6 = reinterpret_cast<const sockaddr_in6&>(address);
    inet_ntop(AF_INET6, &in6.sin6_addr, host, sizeof host);
    port = ntohs(in6.sin6_port);
  }
  return std::string(host) + ":" + std::to_string(port);
}

// 64 bits from the kernel's getrandom: keys and id bases, unpredictable to peers.
std::uint64_t random_word() {
  static std::random_device device;
  return (static_cast<std::uint64_t>(device()) << 32) | device();
}

// A connection's heartbeat key.
net::HeartbeatKey new_heartbeat_key() { return {random_word(), random_word()}; }

ClientId client_of(const net::ToHubMessage& message) {
  return std::visit([](const auto& m) { return m.client; }, message);
}

}  // namespace

// ---- Connections -------------------------------------------------------------------------------------

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
    if (messages.size() == 0) service_.on_probe(*found->second);
    const std::string refused = service_.on_messages(*found->second, messages);
    if (!refused.empty()) return KJ_EXCEPTION(FAILED, "invalid-argument", refused);
    // (Looked up again: feeding the hub may have closed connections.)
    found = service_.connections_.find(connection_);
    if (found == service_.connections_.end()) return KJ_EXCEPTION(DISCONNECTED, "the connection is closing");
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
    if (connection.sink != nullptr) return KJ_EXCEPTION(FAILED, "invalid-argument: connect called twice");
    if (auto refused = service_.admit(connection, params.getToken(), params.getClientName(), params.getClient(),
                                      params.getClientSecret())) {
      return KJ_EXCEPTION(FAILED, *refused);
    }
    connection.sink = params.getSink();
    auto results = context.getResults();
    results.setSession(kj::heap<SessionImpl>(service_, connection_));
    results.setHeartbeatTimeoutMs(service_.config_.hub.heartbeat_timeout_ms);
    service_.describe_heartbeats(connection, results.initHeartbeats());
    return kj::READY_NOW;
  }

  kj::Promise<void> inspect(InspectContext context) override {
    auto found = service_.connections_.find(connection_);
    if (found == service_.connections_.end()) return KJ_EXCEPTION(DISCONNECTED, "the connection is closing");
    if (!service_.check_token(*found->second, context.getParams().getToken())) {
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
  kj::Promise<void> timeline(TimelineContext context) override {
    auto found = service_.connections_.find(connection_);
    if (found == service_.connections_.end()) return KJ_EXCEPTION(DISCONNECTED, "the connection is closing");
    if (!service_.check_token(*found->second, context.getParams().getToken())) {
      return KJ_EXCEPTION(FAILED, "permission denied: wrong cluster token");
    }
    context.getResults().setJson(service_.timeline_json(context.getParams().getModel().cStr()));
    return kj::READY_NOW;
  }




 private:
  HubService& service_;
  std::uint64_t connection_;
};

// ---- The service -------------------------------------------------------------------------------------

namespace {

// What the shell draws for the pure Hub (core/ takes randomness as input): the key of the grants'
// secrets, and where its transfer and copy ids start, so that a successor server after a failover
// never hands out ids its predecessor used (a late instruction of the old server would pass for a
// new one) and ids reveal nothing about how many there were.
ServiceConfig with_server_secrets(ServiceConfig config) {
  config.hub.grant_secret_key = {random_word(), random_word()};
  config.hub.id_base = (random_word() % (kIdBaseMax >> 32)) << 32;  // 2^32 ids before the next base
  return config;
}

}  // namespace

HubService::HubService(ServiceConfig config, kj::Timer& timer, LogLevel log_level)
    : config_(with_server_secrets(std::move(config))), timer_(timer), log_level_(log_level), hub_(config_.hub),
      metrics_(config_.timeline_transfers_max),
      turn_gate_(timer, config_.wakeups_per_poll), tasks_(*this) {
  TH_REQUIRE(validate(config_).ok(), "invalid service config");
}

HubService::~HubService() {
  // First the metrics thread: a scrape it asked this loop to render must not outlive the service.
  metrics_http_.reset();
}

void HubService::stop_on_bug(const char* loop, const kj::Exception& exception) {
  // Without these loops no heartbeat expires and no deadline passes while clients stay connected:
  // a server in that state is worse than none. Stop, so that clients fail over to the backup.
  log(LogLevel::kError, std::string(loop) + " stopped (a bug): " + exception.getDescription().cStr() +
                            "; th-server stops so that clients fail over");
  std::abort();
}

void HubService::taskFailed(kj::Exception&& exception) {
  log(LogLevel::kError, std::string("internal task failed: ") + exception.getDescription().cStr());
}

kj::Promise<void> HubService::serve(kj::ConnectionReceiver& listener) {
  tasks_.add(clock_loop().catch_([this](kj::Exception&& exception) { stop_on_bug("the clock", exception); }));
  handshake_budget_.fill(now_ms(), static_cast<double>(config_.tls_handshakes_per_s_max));
  return accept_loop(listener);
}

void HubService::serve_heartbeats(kj::UnixEventPort& port, std::unique_ptr<net::HeartbeatReceiver> receiver) {
  TH_REQUIRE(heartbeat_receiver_ == nullptr, "serve_heartbeats is called once");
  heartbeat_receiver_ = std::move(receiver);
  heartbeat_budget_.fill(now_ms(), static_cast<double>(heartbeat_datagrams_per_s()));  // a start is no flood
  heartbeat_observer_ = kj::heap<kj::UnixEventPort::FdObserver>(port, heartbeat_receiver_->fd(),
                                                                 kj::UnixEventPort::FdObserver::OBSERVE_READ);
  tasks_.add(heartbeat_loop().catch_([this](kj::Exception&& exception) { stop_on_bug("heartbeat datagrams", exception); }));
}

std::uint64_t HubService::heartbeat_datagrams_per_s() const {
  if (config_.heartbeat_datagrams_per_s_max != 0) return config_.heartbeat_datagrams_per_s_max;
  return std::max<std::uint64_t>(ServiceConfig::kHeartbeatDatagramsPerSecondFloor,
                                 ServiceConfig::kHeartbeatDatagramsPerConnectionPerSecond * connections_.size());
}

kj::Promise<void> HubService::heartbeat_loop() {
  // A few batches, then the other connections' turn (a flood of datagrams must not starve them).
  constexpr int kBatchesPerTurnMax = 4;
  heartbeat_budget_.refill(now_ms(), static_cast<double>(heartbeat_datagrams_per_s()));
  std::size_t read_total = 0;
  for (int batch = 0; batch < kBatchesPerTurnMax; ++batch) {
    if (heartbeat_budget_.available < 1) {
      // More datagrams than the fleet sends: a flood (or a budget set too low). Leave them to the
      // kernel for a while; its buffer drops what does not fit.
      log_summarised(heartbeat_budget_log_, LogLevel::kWarn,
                     "time(s) heartbeat datagrams came faster than the read budget; the excess was left unread "
                     "(a flood? see --heartbeat-datagrams-per-s-max)",
                     std::to_string(heartbeat_datagrams_per_s()) + " a second for " +
                         std::to_string(connections_.size()) + " connections", "heartbeat");
      return timer_.afterDelay(kHeartbeatGatherMs * kj::MILLISECONDS).then([this] { return heartbeat_loop(); });
    }
    heartbeat_batch_.clear();
    std::size_t read = 0;
    try {
      read = heartbeat_receiver_->receive(
          heartbeat_batch_, std::min<std::size_t>(net::HeartbeatReceiver::kBatch, static_cast<std::size_t>(heartbeat_budget_.available)));
    } catch (const net::SocketError& error) {
      log(LogLevel::kError, std::string("reading heartbeat datagrams: ") + error.what(), "heartbeat");
      break;
    }
    heartbeat_budget_.available -= static_cast<double>(read);
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
  if (connection == nullptr || !connection->heartbeat_key || datagram.count <= connection->heartbeat_count ||
      !net::authentic(datagram, *connection->heartbeat_key)) {
    // Not proof of an attack (a datagram can outlive its connection); logged in summary, since
    // a flood of them must not flood the log.
    ++heartbeat_datagrams_refused_;
    ++heartbeat_refusals_unlogged_;
    const TimeMs now = now_ms();
    if (now - heartbeat_refusal_logged_ms_ >= 10'000) {
      log(LogLevel::kWarn, "refused " + std::to_string(heartbeat_refusals_unlogged_) +
                               " heartbeat datagram(s) (unknown client, wrong MAC or a count seen before), the last for client " +
                               std::to_string(datagram.client), "heartbeat");
      heartbeat_refusals_unlogged_ = 0;
      heartbeat_refusal_logged_ms_ = now;
    }
    return;
  }
  ++heartbeat_datagrams_;
  connection->heartbeat_count = datagram.count;
  note_session(*connection, datagram.session);
  connection->heartbeat_datagram_ms = now_ms();
  feed(Report{datagram.client, Heartbeat{}, datagram.session});
}

bool HubService::heartbeat_datagrams_heard(const Connection& connection) const {
  // Recently enough that the client, told so, has time to go back to calls before its timeout.
  return connection.heartbeat_datagram_ms.has_value() &&
         now_ms() - *connection.heartbeat_datagram_ms <= config_.hub.heartbeat_timeout_ms / 2;
}

kj::Promise<void> HubService::accept_loop(kj::ConnectionReceiver& listener) {
  return listener.accept().then(
      [this, &listener](kj::Own<kj::AsyncIoStream> stream) {
        // One connection's trouble (a peer that reset before we looked at it) must never end
        // the accept loop, and with it the server.
        KJ_IF_MAYBE(exception, kj::runCatchingExceptions([&] { on_connection(kj::mv(stream)); })) {
          log_summarised(accept_errors_log_, LogLevel::kWarn, "connection(s) dropped as they were accepted",
                         exception->getDescription().cStr(), "conn");
        }
        return accept_loop(listener);
      },
      [this, &listener](kj::Exception&& exception) {
        // Out of descriptors or memory (EMFILE, ENFILE, ENOBUFS): the listener itself is fine.
        // Make room if silent connections hold descriptors, pause, and go on; a server that stops
        // accepting, or exits, would end the training job.
        shed_oldest_unauthenticated();
        log_summarised(accept_errors_log_, LogLevel::kError, "accept failure(s), retrying",
                       exception.getDescription().cStr(), "conn");
        return timer_.afterDelay(kAcceptRetryDelayMs * kj::MILLISECONDS).then([this, &listener] {
          return accept_loop(listener);
        });
      });
}

kj::Promise<void> HubService::clock_loop() {
  return timer_.afterDelay(config_.tick_ms * kj::MILLISECONDS).then([this] {
    feed(Tick{});
    if (now_ms() - swept_ms_ >= kSweepMs) sweep_connections();
    return clock_loop();
  });
}

void HubService::on_connection(kj::Own<kj::AsyncIoStream> stream) {
  if (connections_.size() >= config_.connections_max && !shed_oldest_unauthenticated()) {
    log_summarised(refused_connections_log_, LogLevel::kWarn,
                   "connection(s) refused at the limit of " + std::to_string(config_.connections_max),
                   "from " + peer_of(*stream), "conn");
    return;  // dropping the stream closes it
  }
  if (unauthenticated_count_ >= config_.unauthenticated_max) shed_oldest_unauthenticated();
  auto connection = std::make_unique<Connection>();
  connection->id = next_connection_id_++;
  connection->peer = peer_of(*stream);  // now: a peer that resets during its handshake has none later
  connection->accepted_ms = connection->active_ms = now_ms();
  const std::uint64_t id = connection->id;
  Connection& added = *connections_.emplace(id, std::move(connection)).first->second;
  unauthenticated_.push_back(id);
  ++unauthenticated_count_;
  if (tls_ == nullptr) {
    added.handshake = start_protocol(id, kj::mv(stream)).eagerlyEvaluate([this, id](kj::Exception&& exception) {
      close_connection(id, std::string("failed before it said anything: ") + exception.getDescription().cStr());
    });
    return;
  }
  // A handshake costs the loop a key exchange and a signature: it starts only once the peer has
  // sent its first bytes (an empty connect, or one reset at once, costs nothing) and a handshake
  // turn is free (handshake_turn). Until it ends, the connection counts as unauthenticated.
  auto first = kj::heapArray<kj::byte>(kTlsFirstBytes);
  kj::AsyncIoStream& raw = *stream;
  kj::byte* first_bytes = first.begin();
  added.handshake =
      // evalNow: the read is tried at once, and a peer that already reset makes it throw here.
      kj::evalNow([&raw, first_bytes] { return raw.tryRead(first_bytes, 1, kTlsFirstBytes); })
          .then([this, id, stream = kj::mv(stream), first = kj::mv(first)](std::size_t got) mutable
                -> kj::Promise<void> {
            if (got == 0) {
              close_connection(id, "closed before its TLS handshake");
              return kj::READY_NOW;
            }
            auto replayed = net::with_first_bytes(kj::heapArray<kj::byte>(first.begin(), got), kj::mv(stream));
            return handshake_turn()
                .then([this, replayed = kj::mv(replayed)]() mutable { return tls_->wrapServer(kj::mv(replayed)); })
                .then([this, id](kj::Own<kj::AsyncIoStream> secure) { return start_protocol(id, kj::mv(secure)); });
          })
          .catch_([this, id](kj::Exception&& exception) {
            // Scanners, clear-text clients and wrong certificates: an attacker's to provoke at will,
            // so summarised.
            auto found = connections_.find(id);
            const std::string from = found != connections_.end() ? found->second->peer : "?";
            log_summarised(tls_failures_log_, LogLevel::kWarn, "TLS handshake(s) failed",
                           "from " + from + ": " + sanitised(exception.getDescription().cStr()), "auth");
            close_connection(id, "TLS handshake failed");
          })
          .eagerlyEvaluate(nullptr);
}

kj::Promise<void> HubService::handshake_turn() {
  const auto per_s = static_cast<double>(config_.tls_handshakes_per_s_max);
  handshake_budget_.refill(now_ms(), per_s);
  if (handshake_waiters_.empty() && handshake_budget_.available >= 1) {
    handshake_budget_.available -= 1;
    return kj::READY_NOW;
  }
  // Handshakes come faster than they may start: a flood, or a whole fleet reconnecting at once.
  // This one waits its turn, first come first served (bounded by the auth deadline, and shed like
  // any unauthenticated connection, which drops its place in the queue).
  log_summarised(handshake_budget_log_, LogLevel::kWarn,
                 "TLS handshake(s) waited for a turn: they came faster than --tls-handshakes-per-s-max",
                 std::to_string(config_.tls_handshakes_per_s_max) + " a second", "auth");
  if (handshake_waiters_.size() > 2 * config_.unauthenticated_max) {
    // Places of connections that went meanwhile (each waiter is an unauthenticated connection).
    std::erase_if(handshake_waiters_, [](auto& waiter) { return !waiter->isWaiting(); });
  }
  auto turn = kj::newPromiseAndFulfiller<void>();
  handshake_waiters_.push_back(kj::mv(turn.fulfiller));
  if (!dispensing_handshake_turns_) {
    dispensing_handshake_turns_ = true;
    tasks_.add(dispense_handshake_turns());
  }
  return kj::mv(turn.promise);
}

kj::Promise<void> HubService::dispense_handshake_turns() {
  const auto per_s = static_cast<double>(config_.tls_handshakes_per_s_max);
  handshake_budget_.refill(now_ms(), per_s);
  while (!handshake_waiters_.empty()) {
    if (!handshake_waiters_.front()->isWaiting()) {  // its connection went: no turn spent
      handshake_waiters_.pop_front();
      continue;
    }
    if (handshake_budget_.available < 1) break;
    handshake_budget_.available -= 1;
    handshake_waiters_.front()->fulfill();
    handshake_waiters_.pop_front();
  }
  if (handshake_waiters_.empty()) {
    dispensing_handshake_turns_ = false;
    return kj::READY_NOW;
  }
  const auto wait_ms = static_cast<std::int64_t>(std::ceil((1 - handshake_budget_.available) * 1000 / per_s));
  return timer_.afterDelay(std::max<std::int64_t>(wait_ms, 1) * kj::MILLISECONDS).then([this] {
    return dispense_handshake_turns();
  });
}

kj::Promise<void> HubService::start_protocol(std::uint64_t connection_id, kj::Own<kj::AsyncIoStream> stream) {
  auto first = kj::heapArray<kj::byte>(net::kFramedMagic.size());
  kj::AsyncIoStream& raw = *stream;
  kj::byte* first_bytes = first.begin();
  // evalNow: a peer that already reset makes the read throw here.
  return kj::evalNow([&raw, first_bytes] { return raw.tryRead(first_bytes, net::kFramedMagic.size(), net::kFramedMagic.size()); })
      .then([this, connection_id, stream = kj::mv(stream), first = kj::mv(first)](std::size_t got) mutable {
        auto found = connections_.find(connection_id);
        if (found == connections_.end()) return;
        if (got == 0) {
          close_connection(connection_id, "closed before it said anything");
        } else if (got == first.size() && std::equal(first.begin(), first.end(), net::kFramedMagic.begin())) {
          start_framed(*found->second, kj::mv(stream));
        } else {
          start_rpc(*found->second, net::with_first_bytes(kj::heapArray<kj::byte>(first.begin(), got), kj::mv(stream)));
        }
      });
}

void HubService::start_rpc(Connection& connection, kj::Own<kj::AsyncIoStream> stream) {
  TH_ASSERT(connection.stream.get() == nullptr && connection.rpc.get() == nullptr);
  connection.stream = kj::mv(stream);
  connection.messages = kj::heap<net::FairMessageStream>(*connection.stream, turn_gate_, config_.messages_per_turn);
  connection.messages->set_message_words_max(config_.unauthenticated_message_words_max);
  connection.messages->set_messages_max(config_.unauthenticated_messages_max);
  connection.network = kj::heap<capnp::TwoPartyVatNetwork>(*connection.messages, capnp::rpc::twoparty::Side::SERVER);
  capnp::TwoPartyVatNetwork& network = *connection.network;
  connection.messages->limit_unread_answers([&network] { return network.getCurrentQueueSize(); },
                                            config_.rpc_answers_bytes_max);
  connection.messages->limit_open_questions(ServiceConfig::kRpcOpenQuestionsMax);
  connection.rpc = kj::heap(capnp::makeRpcServer(*connection.network, kj::heap<HubImpl>(*this, connection.id)));
  const std::uint64_t id = connection.id;
  tasks_.add(connection.network->onDisconnect().then([this, id] { on_disconnect(id); }));
}

void HubService::on_disconnect(std::uint64_t connection_id) {
  auto found = connections_.find(connection_id);
  if (found == connections_.end()) return;
  std::unique_ptr<Connection> connection = std::move(found->second);
  connections_.erase(found);
  if (!connection->authenticated) {
    TH_ASSERT(unauthenticated_count_ > 0);
    --unauthenticated_count_;
  }
  const bool client_lost = connection->client != 0;
  const bool questions = connection->messages.get() != nullptr && connection->messages->too_many_open_questions();
  log(client_lost || questions ? LogLevel::kInfo : LogLevel::kDebug,
      connection->describe() + " closed" +
          (questions ? " (it left more than " + std::to_string(ServiceConfig::kRpcOpenQuestionsMax) +
                           " calls open: no Cap'n Proto Finish)"
                     : "") +
          (client_lost ? "; client " + std::to_string(connection->client) + " lost" : ""),
      "conn");
  if (client_lost) {
    const ClientId client = std::exchange(connection->client, 0);  // it speaks for nobody now
    client_connection_.erase(client);
    remember_claim(client, std::move(connection->client_secret));
    feed(ConnectionLost{client});
  }
  // The RPC system may still be unwinding the call stack that brought us here: free it later.
  tasks_.add(kj::evalLater([connection = std::move(connection)] {}));
}

void HubService::close_connection(std::uint64_t connection_id, const std::string& why) {
  auto found = connections_.find(connection_id);
  if (found == connections_.end()) return;
  log(found->second->authenticated ? LogLevel::kInfo : LogLevel::kDebug,
      "closing " + found->second->describe() + ": " + why, "auth");
  on_disconnect(connection_id);  // destroying its RPC system and stream closes the socket
}

bool HubService::shed_oldest_unauthenticated() {
  while (!unauthenticated_.empty()) {
    const std::uint64_t id = unauthenticated_.front();
    unauthenticated_.pop_front();
    auto found = connections_.find(id);
    if (found == connections_.end() || found->second->authenticated) continue;
    close_connection(id, "the oldest of the connections that have not authenticated, to make room");
    return true;
  }
  return false;
}

std::int64_t HubService::idle_timeout_ms() const {
  if (config_.idle_timeout_ms != 0) return config_.idle_timeout_ms;
  return std::max<std::int64_t>(10 * config_.hub.heartbeat_timeout_ms, 60'000);
}

void HubService::sweep_connections() {
  const TimeMs now = now_ms();
  swept_ms_ = now;
  std::vector<std::pair<std::uint64_t, std::string>> expired;
  for (auto& [id, connection] : connections_) {
    if (connection->messages_read() != connection->messages_seen) {
      connection->messages_seen = connection->messages_read();
      connection->active_ms = now;
    }
    if (connection->heartbeat_datagram_ms) connection->active_ms = std::max(connection->active_ms, *connection->heartbeat_datagram_ms);
    if (!connection->authenticated && now - connection->accepted_ms > config_.auth_deadline_ms) {
      expired.emplace_back(id, "no cluster token within " + std::to_string(config_.auth_deadline_ms) + " ms");
    } else if (connection->authenticated && now - connection->active_ms > idle_timeout_ms()) {
      const bool unread = connection->messages.get() != nullptr && connection->messages->waiting_for_peer_to_read();
      expired.emplace_back(id, (unread ? "has not read its answers (over " + std::to_string(config_.rpc_answers_bytes_max) +
                                             " bytes of them, --rpc-answers-bytes-max) for "
                                       : std::string("silent for ")) +
                                   std::to_string(now - connection->active_ms) + " ms");
    }
  }
  for (const auto& [id, why] : expired) close_connection(id, why);
  std::erase_if(remembered_claims_, [&](const auto& entry) { return entry.second.until_ms < now; });
  // Forget the closed and the authenticated (the queue holds at most one entry per connection made
  // since it was last empty; keep it proportional to the connections that are open).
  if (unauthenticated_.size() > 2 * connections_.size() + 64) {
    std::erase_if(unauthenticated_, [&](std::uint64_t id) {
      auto found = connections_.find(id);
      return found == connections_.end() || found->second->authenticated;
    });
  }
}

void HubService::remember_claim(ClientId client, std::string secret) {
  if (remembered_claims_.size() >= config_.connections_max) return;  // bounded; the sweep frees room
  // Twice the heartbeat timeout: a handle reconnects well within it (its backoff is at most 2 s).
  remembered_claims_[client] = RememberedClaim{std::move(secret), now_ms() + 2 * config_.hub.heartbeat_timeout_ms};
}

bool HubService::check_token(Connection& connection, capnp::Text::Reader token) {
  // Every accepted token is compared (in constant time each), so timing tells nothing about which.
  bool accepted = same_token(token.cStr(), config_.token);
  for (const std::string& more : config_.more_tokens) accepted |= same_token(token.cStr(), more);
  if (accepted) {
    if (!connection.authenticated) {
      connection.authenticated = true;
      TH_ASSERT(unauthenticated_count_ > 0);
      --unauthenticated_count_;
      // (A framed connection's limits are lifted once its whole hello is admitted: on_hello.)
      if (!connection.framed()) {
        connection.messages->set_message_words_max(UINT64_MAX);  // Cap'n Proto's own limit (64 MiB)
        connection.messages->set_messages_max(UINT64_MAX);
      }
    }
    return true;
  }
  ++connection.wrong_tokens;
  log_summarised(wrong_tokens_log_, LogLevel::kWarn, "call(s) with a wrong cluster token refused",
                 "from " + connection.peer, "auth");
  if (connection.wrong_tokens >= config_.wrong_tokens_per_connection_max) {
    // After the refusal goes out; the call that brought us here is still on the stack.
    const std::uint64_t id = connection.id;
    tasks_.add(kj::evalLater([this, id] {
      close_connection(id, std::to_string(config_.wrong_tokens_per_connection_max) + " wrong cluster tokens");
    }));
  }
  return false;
}

std::optional<std::string> HubService::admit(Connection& connection, capnp::Text::Reader token,
                                             capnp::Text::Reader client_name, ClientId client,
                                             kj::ArrayPtr<const kj::byte> secret) {
  if (!check_token(connection, token)) return "permission denied: wrong cluster token";
  connection.name = sanitised(client_name.cStr());
  if (auto refused = claim_client(connection, client, secret)) return refused;
  log(LogLevel::kDebug, connection.describe() + " authenticated", "auth");
  if (heartbeat_receiver_ != nullptr) {
    connection.heartbeat_key = new_heartbeat_key();
    connection.heartbeat_count = 0;
  }
  return std::nullopt;
}

void HubService::describe_heartbeats(const Connection& connection, wire::HeartbeatChannel::Builder channel) const {
  if (heartbeat_receiver_ == nullptr || !connection.heartbeat_key) return;  // port 0: calls only
  channel.setPort(heartbeat_receiver_->port());
  const auto key = net::key_bytes(*connection.heartbeat_key);
  channel.setKey(kj::arrayPtr(key.data(), key.size()));
}

std::optional<std::string> HubService::claim_client(Connection& connection, ClientId client,
                                                    kj::ArrayPtr<const kj::byte> secret) {
  if (client == 0) return std::nullopt;  // speaks for no client (inspect-only)
  if (secret.size() < kClientSecretBytesMin || secret.size() > kClientSecretBytesMax) {
    return "invalid-argument: a client's secret is " + std::to_string(kClientSecretBytesMin) + ".." +
           std::to_string(kClientSecretBytesMax) + " bytes";
  }
  if (auto remembered = remembered_claims_.find(client); remembered != remembered_claims_.end()) {
    const bool same = same_secret(secret, remembered->second.secret);
    const bool current = now_ms() <= remembered->second.until_ms;
    if (current && !same) {
      // The reservation stays: a refused claim must not use it up (the next one would succeed).
      log_summarised(claims_refused_log_, LogLevel::kWarn,
                     "connect(s) naming a client held by another connection, with another secret, refused",
                     "client " + std::to_string(client) + " claimed by " + connection.describe() +
                         " while reserved for its handle's reconnect", "auth");
      return "permission denied: client " + std::to_string(client) + " belongs to another connection";
    }
    remembered_claims_.erase(remembered);  // its handle is back, or it expired
  }
  if (auto bound = client_connection_.find(client); bound != client_connection_.end()) {
    Connection& holder = *connections_.at(bound->second);
    if (!same_secret(secret, holder.client_secret)) {
      log_summarised(claims_refused_log_, LogLevel::kWarn,
                     "connect(s) naming a client held by another connection, with another secret, refused",
                     "client " + std::to_string(client) + " claimed by " + connection.describe() + ", held by " +
                         holder.describe(), "auth");
      return "permission denied: client " + std::to_string(client) + " belongs to another connection";
    }
    // The handle reconnected before its old connection was seen to close: it speaks here now.
    holder.client = 0;
    log(LogLevel::kInfo, "client " + std::to_string(client) + " moved from " + holder.describe() + " to " +
                             connection.describe(), "conn");
  }
  connection.client = client;
  connection.client_secret.assign(reinterpret_cast<const char*>(secret.begin()), secret.size());
  client_connection_[client] = connection.id;
  return std::nullopt;
}

std::string HubService::on_messages(Connection& connection, capnp::List<wire::ToHub>::Reader messages) {
  std::string refused;
  for (auto message : messages) {
    auto decoded = net::decode(message);
    if (!decoded.ok()) {
      // Summarised: a frame of 4,096 invalid messages must not write 4,096 lines.
      log_summarised(invalid_messages_log_, LogLevel::kWarn, "invalid message(s) refused",
                     connection.describe() + ": " + decoded.error().detail, "conn");
      if (refused.empty()) refused = decoded.error().detail;
      continue;
    }
    const ClientId client = client_of(decoded.value());
    if (client != connection.client || client == 0) {
      // Another client's id (a stolen one, or a bug): the Hub never sees it.
      const std::string why = connection.client == 0
                                  ? std::string("this connection named no client at connect")
                                  : "this connection speaks for client " + std::to_string(connection.client);
      log_summarised(foreign_messages_log_, LogLevel::kWarn, "message(s) naming another connection's client refused",
                     connection.describe() + " named client " + std::to_string(client), "conn");
      if (refused.empty()) refused = "a message names client " + std::to_string(client) + ": " + why;
      continue;
    }
    if (const auto* report = std::get_if<Report>(&decoded.value())) {
      if (std::holds_alternative<Heartbeat>(report->body)) ++heartbeat_calls_;
      note_session(connection, report->session);
    } else if (const auto* request = std::get_if<Request>(&decoded.value())) {
      note_session(connection, request->session);
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

void HubService::note_session(Connection& connection, std::uint64_t session) {
  // Sessions of a client only grow (one per open); a late datagram of the last one must not take
  // the probes back to it.
  connection.client_session = std::max(connection.client_session.value_or(0), session);
}

void HubService::on_probe(Connection& connection) {
  // The client's I/O thread is alive, which is what a heartbeat says. Its datagrams may be lost on
  // the way (filtered, or left unread under a flood): this keeps it from being evicted until it
  // hears so in the reply and beats by calls again.
  // Only for a client open in that session: a closed or evicted one would be told again that the
  // hub does not know it, once a probe.
  if (connection.client == 0 || !connection.client_session ||
      !hub_.has_session(connection.client, *connection.client_session)) {
    return;
  }
  feed(Report{connection.client, Heartbeat{}, *connection.client_session});
}

void HubService::feed(const Input& input) {
  Effects effects;
  const std::int64_t step_start_us = now_us();
  const HubStats before = hub_.stats();
  hub_.step(input, step_start_us / 1000, effects);
  metrics_.observe(hub_, input, effects, step_start_us, now_us());
  log_lifecycle(before, hub_.stats());
  route(effects);
}

void HubService::log_lifecycle(const HubStats& before, const HubStats& after) {
  if (after.readers_revoked > before.readers_revoked) {
    log(LogLevel::kInfo, std::to_string(after.readers_revoked - before.readers_revoked) +
                             " read(s) of a draining copy revoked at the drain grace (" +
                             std::to_string(hub_.settings().drain_grace_ms) + " ms): read elsewhere", "hub");
  }
  if (after.transfers_displaced > before.transfers_displaced) {
    log(LogLevel::kDebug, std::to_string(after.transfers_displaced - before.transfers_displaced) +
                              " slower reader(s) moved behind a faster one (rate-aware source selection)", "hub");
  }
  // A token holder can provoke these at will (one a read): summarised.
  for (std::uint64_t refuted = before.progress_claims_refuted; refuted < after.progress_claims_refuted; ++refuted) {
    log_summarised(progress_claims_log_, LogLevel::kWarn,
                   "read(s) ended later than their progress report allowed: the rate it set is undone",
                   "it claimed more bytes than arrived (a client counting a resumed prefix?)", "hub");
  }
  if (after.copies_found_corrupt > before.copies_found_corrupt) {
    log(LogLevel::kWarn, std::to_string(after.copies_found_corrupt - before.copies_found_corrupt) +
                             " copy(ies) failed readers' checksums twice: no longer read from, their owners told "
                             "(tensors written while published?)", "hub");
  }
  if (after.retained_versions_left > before.retained_versions_left) {
    log(LogLevel::kWarn, "a closing replica took the last copy of " +
                                std::to_string(after.retained_versions_left - before.retained_versions_left) +
                                " version(s) another replica's retention rule keeps: unless a reader still "
                                "pulling from it finishes, their readers get version-unavailable (to keep a "
                                "version, wait until another replica holds it before closing)", "hub");
  }
  if (after.models_forgotten > before.models_forgotten) {
    log(LogLevel::kInfo, std::to_string(after.models_forgotten - before.models_forgotten) +
                             " model(s) ended after " + std::to_string(hub_.settings().model_grace_ms) +
                             " ms with no replica; " + std::to_string(hub_.description_bytes()) +
                             " bytes of tensor descriptions kept", "hub");
#ifdef __GLIBC__
    // The model's descriptions were many small allocations: give the freed pages back, or the
    // server's resident size would not show that they went.
    malloc_trim(0);
#endif
  }
}

void HubService::route(const Effects& effects) {
  std::vector<std::uint64_t> touched;
  for (const Effect& effect : effects) {
    if (const auto* evicted = std::get_if<Evicted>(&effect.message)) {
      // "Unknown client" is the hub's answer to a message from a client it does not have open (one
      // that just closed, or a late heartbeat): routine, not an eviction.
      log(evicted->reason == Errc::kUnknownClient ? LogLevel::kDebug : LogLevel::kInfo,
          "client " + std::to_string(effect.client) + " evicted (" +
                               std::string(errc_name(evicted->reason)) + "): " + evicted->detail, "hub");
    }
    auto bound = client_connection_.find(effect.client);
    if (bound == client_connection_.end()) continue;  // the client is gone; the Hub will learn it
    Connection& connection = *connections_.at(bound->second);
    connection.backlog.push_back(effect);
    if (connection.backlog.size() == 1) touched.push_back(connection.id);
    // Checked at every effect: a peer that takes no deliveries must not grow its backlog for ever.
    if (connection.backlog.size() == config_.effects_backlog_max + 1) {
      const std::uint64_t id = connection.id;
      log(LogLevel::kWarn, connection.describe() + " fell more than " + std::to_string(config_.effects_backlog_max) +
                               " effects behind: disconnecting it", "conn");
      // Later: the call that fed the hub may be this connection's own, still on the stack, and the
      // hub must not be re-entered while its effects are handed out.
      tasks_.add(kj::evalLater([this, id] { close_connection(id, "too far behind"); }));
    }
  }
  for (std::uint64_t id : touched) {
    Connection& connection = *connections_.at(id);
    if (connection.backlog.size() > config_.effects_backlog_max) continue;
    if (connection.framed()) {
      schedule_write(connection);
    } else {
      flush(connection);
    }
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

void HubService::log_summarised(LogSummary& summary, LogLevel level, const std::string& what,
                                const std::string& last, std::string_view component) {
  ++summary.unlogged;
  const TimeMs now = now_ms();
  if (now - summary.logged_ms < kSummaryLogMs) return;
  log(level, std::to_string(summary.unlogged) + " " + what + " (the last: " + sanitised(last) + ")", component);
  summary.unlogged = 0;
  summary.logged_ms = now;
}

void HubService::log(LogLevel level, const std::string& line, std::string_view component) const {
  if (level > log_level_) return;
  LogOutput::write(level, component, line);
}

std::int64_t HubService::now_us() const {
  return std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::steady_clock::now() - started_).count();
}

}  // namespace th::server
