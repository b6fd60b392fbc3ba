// libthclient's connections to th-server: one Cap'n Proto connection per server (TLS when the
// options give a CA), opened on demand, with a bounded number of Session.send calls in flight;
// heartbeats as sealed UDP datagrams where the server hears them; a hung server detected by its
// silence and a lost one failed over (see handle_impl.h for how the files divide the work).
#include "client/handle_impl.h"

#include <arpa/inet.h>

namespace th {
namespace {

bool is_ip_address(const std::string& host) {
  in6_addr any{};
  return ::inet_pton(AF_INET, host.c_str(), &any) == 1 || ::inet_pton(AF_INET6, host.c_str(), &any) == 1;
}

// What a user can do about a failed connection, when the reason names a likely mistake.
std::string hint_for(const std::string& why, bool tls, const std::string& address, const std::string& server_name) {
  if (tls && why.find("ostname mismatch") != std::string::npos && server_name.empty() &&
      is_ip_address(net::tls_server_name(address, ""))) {
    return " (the server was dialled by IP address: give the DNS name its certificate carries in tls_server_name)";
  }
  if (tls && (why.find("wrong version number") != std::string::npos ||
              why.find("packet length too long") != std::string::npos ||
              why.find("unexpected eof") != std::string::npos)) {
    return " (TLS at this end only? the server needs --tls-cert and --tls-key)";
  }
  if (!tls && why.find("Peer disconnected") != std::string::npos) {
    return " (if the server runs with --tls-cert, give tls_ca_file)";
  }
  return "";
}

}  // namespace

class Handle::Impl::SinkImpl final : public wire::Sink::Server {
 public:
  SinkImpl(Impl& impl, std::uint32_t server) : impl_(impl), server_(server) {}

  kj::Promise<void> deliver(DeliverContext context) override {
    for (auto effect : context.getParams().getEffects()) {
      auto decoded = net::decode(effect);
      if (!decoded.ok()) {
        impl_.log("server " + std::to_string(server_) + " sent an invalid message: " + decoded.error().detail);
        continue;
      }
      impl_.step(FromHub{server_, std::move(decoded).value()});
    }
    return kj::READY_NOW;
  }

 private:
  Impl& impl_;
  std::uint32_t server_;
};

TimeMs Handle::Impl::server_timeout_ms() const {
  if (options_.server_timeout_ms > 0) return options_.server_timeout_ms;
  const TimeMs told = server_heartbeat_timeout_ms_.load();
  return told > 0 ? std::min<TimeMs>(2 * told, kDataTimeoutMaxMs) : kDataTimeoutUnknownMs;
}

void Handle::Impl::check_links() {
  const TimeMs now = steady_now_ms();
  const TimeMs timeout_ms = server_timeout_ms();
  // Also at most 3/4 of the server's heartbeat timeout: the server counts a probe as a heartbeat,
  // which keeps this client alive while its datagrams are lost, until a reply says so and it beats
  // by calls again. No more often than that: each probe is a call, and an idle fleet's calls are
  // what the datagrams save (8,192 idle clients probing every half timeout cost the server 12 % of
  // a core, bench/results/heartbeats-*).
  const TimeMs told_ms = server_heartbeat_timeout_ms_.load();
  const TimeMs probe_ms = told_ms > 0 ? std::min(timeout_ms / kProbesPerTimeout, told_ms * 3 / 4) : timeout_ms / kProbesPerTimeout;
  std::vector<std::pair<std::uint32_t, std::uint64_t>> hung;
  for (auto& [server, link] : links_) {
    if (link->waiting_since_ms != 0) {
      if (now - link->waiting_since_ms > timeout_ms) hung.emplace_back(server, link->generation);
    } else if (link->session != nullptr && now - link->heard_ms > probe_ms) {
      // Nothing of ours waits (heartbeats go as datagrams, which nobody answers): ask something
      // of the server now and then, so that it is seen to hang while nothing else would tell.
      send_batch(*link, 0);
    }
  }
  for (const auto& [server, generation] : hung) {
    lose(server, generation, "the server answered nothing for " + std::to_string(timeout_ms) + " ms (hung?)");
  }
}

void Handle::Impl::send_to(std::uint32_t server, net::ToHubMessage message) {
  auto found = links_.find(server);
  if (found == links_.end()) {
    connect(server);
    found = links_.find(server);
  }
  Link& link = *found->second;
  if (const auto* report = std::get_if<Report>(&message);
      report != nullptr && std::holds_alternative<Heartbeat>(report->body) && link.heartbeats != nullptr) {
    // Also as a call until the server says it hears the datagrams (they may be filtered on the way).
    link.heartbeats->send(net::seal(report->client, report->session, ++link.heartbeat_count, link.heartbeat_key));
    if (link.heartbeat_datagrams_heard) return;
  }
  link.queue.push_back(std::move(message));
  flush(link);
}

void Handle::Impl::connect(std::uint32_t server) {
  auto fresh = std::make_unique<Link>();
  fresh->server = server;
  fresh->generation = next_generation_++;
  const std::uint64_t generation = fresh->generation;
  const TimeMs not_before = reconnect_.contains(server) ? reconnect_[server].first : 0;
  const TimeMs delay_ms = std::max<TimeMs>(0, not_before - steady_now_ms());
  fresh->waiting_since_ms = steady_now_ms() + delay_ms;  // for the TCP connect, then the connect call
  Link& added = *(links_[server] = std::move(fresh));
  const std::string address = options_.servers.at(server);
  auto find_link = [this, server, generation]() -> Link* {
    auto found = links_.find(server);
    return found != links_.end() && found->second->generation == generation ? found->second.get() : nullptr;
  };
  // Owned by the link: losing it (a server that hangs mid-handshake, say) cancels the connect.
  added.connecting =
      loop_->timer()
          .afterDelay(delay_ms * kj::MILLISECONDS)
          .then([this, address] { return loop_->io().getNetwork().parseAddress(address); })
          .then([](kj::Own<kj::NetworkAddress> resolved) { return resolved->connect().attach(kj::mv(resolved)); })
          .then([this, address, find_link](kj::Own<kj::AsyncIoStream> stream) -> kj::Promise<kj::Own<kj::AsyncIoStream>> {
            if (Link* link = find_link(); link != nullptr) {
              sockaddr_storage peer{};
              kj::uint length = sizeof peer;
              try {
                stream->getpeername(reinterpret_cast<sockaddr*>(&peer), &length);
                link->peer = peer;
              } catch (const kj::Exception&) {
                // No address (not a socket): heartbeats go as calls.
              }
            }
            if (tls_ == nullptr) return kj::mv(stream);
            return tls_->wrapClient(kj::mv(stream), net::tls_server_name(address, options_.tls_server_name));
          })
          .then([this, server, generation, find_link](kj::Own<kj::AsyncIoStream> stream) -> kj::Promise<void> {
            Link* link = find_link();
            if (link == nullptr) return kj::READY_NOW;
            link->stream = kj::mv(stream);
            link->rpc = kj::heap<capnp::TwoPartyClient>(*link->stream);
            tasks_->add(link->rpc->onDisconnect().then([this, server, generation, find_link] {
              const Link* closed = find_link();
              const bool unanswered = closed != nullptr && !closed->connected;
              lose(server, generation,
                   std::string("the server closed the connection") +
                       (unanswered && tls_ == nullptr
                            ? " before answering connect (if it runs with --tls-cert, give tls_ca_file)"
                            : ""));
            }));
            auto request = link->rpc->bootstrap().castAs<wire::Hub>().connectRequest();
            request.setToken(options_.token);
            request.setSink(kj::heap<SinkImpl>(*this, server));
            request.setClientName(options_.replica + "/" + std::to_string(options_.shard));
            request.setClient(client_id_);
            request.setClientSecret(kj::arrayPtr(client_secret_.data(), client_secret_.size()));
            // Pipelined: the queued messages go out on the promised session at once, in the same
            // flight as bootstrap and connect. On a busy server every round trip waits behind the
            // other connections' calls, so an open that needs one round trip instead of three is
            // answered that much sooner. A refused token fails those calls and this promise.
            auto connected = request.send();
            link->session = connected.getSession();
            flush(*link);
            return connected.then([this, server, find_link](auto response) {
              Link* connected_link = find_link();
              if (connected_link == nullptr) return;
              connected_link->connected = true;
              ever_connected_ = true;
              reconnect_.erase(server);
              connected_link->heard_ms = steady_now_ms();
              connected_link->waiting_since_ms = connected_link->sends_in_flight > 0 ? connected_link->heard_ms : 0;
              if (response.getHeartbeatTimeoutMs() > 0) {
                server_heartbeat_timeout_ms_.store(response.getHeartbeatTimeoutMs());
              }
              const auto channel = response.getHeartbeats();
              const auto key = net::key_from_bytes({channel.getKey().begin(), channel.getKey().size()});
              if (channel.getPort() == 0 || !key || !connected_link->peer) return;
              try {
                connected_link->heartbeats = std::make_unique<net::HeartbeatSender>(*connected_link->peer, channel.getPort());
                connected_link->heartbeat_key = *key;
              } catch (const net::SocketError& error) {
                log(std::string("heartbeats go as calls: ") + error.what());
              }
            });
          })
          .catch_([this, server, generation, address](kj::Exception&& exception) {
            const std::string why = exception.getDescription().cStr();
            const std::string hint = hint_for(why, tls_ != nullptr, address, options_.tls_server_name);
            if (why.find("wrong cluster token") != std::string::npos) {
              fail_everything(make_error(Errc::kPermissionDenied, "server " + address + " refused the cluster token"));
            } else if (tls_ != nullptr && net::is_certificate_refusal(why) && !ever_connected_) {
              // A wrong CA file or server name, or an impostor, before any server took us: a
              // configuration error that retrying cannot mend, so open() says so at once. Later
              // (a certificate expired, a backup with another name, someone in the path) it is a
              // lost server like any other: retried, and logged, while the others serve.
              fail_everything(make_error(Errc::kPermissionDenied, "server " + address + ": TLS: " + why + hint));
            }
            // (Refused because another connection holds our id with another secret: someone else
            // uses it. Retried with backoff like any lost server; it succeeds once that one is gone.)
            lose(server, generation, "cannot reach server " + address + ": " + why + hint);
          })
          .eagerlyEvaluate(nullptr);
}

void Handle::Impl::flush(Link& link) {
  if (link.session == nullptr) return;  // connecting: the queue goes once the session is there
  while (link.sends_in_flight < kSendsInFlightMax && !link.queue.empty()) {
    send_batch(link, std::min(link.queue.size(), net::kMessagesPerCallMax));
  }
}

void Handle::Impl::send_batch(Link& link, std::size_t count) {
  TH_ASSERT(count <= link.queue.size());
  KJ_IF_MAYBE(session, link.session) {
    auto request = session->sendRequest();
    auto list = request.initMessages(static_cast<unsigned>(count));
    for (std::size_t i = 0; i < count; ++i) net::encode(link.queue[i], list[static_cast<unsigned>(i)]);
    link.queue.erase(link.queue.begin(), link.queue.begin() + static_cast<long>(count));
    ++link.sends_in_flight;
    if (link.waiting_since_ms == 0) link.waiting_since_ms = steady_now_ms();
    const std::uint32_t server = link.server;
    const std::uint64_t generation = link.generation;
    auto answered = [this](Link& sent) {
      --sent.sends_in_flight;
      sent.heard_ms = steady_now_ms();
      sent.waiting_since_ms = sent.sends_in_flight > 0 ? sent.heard_ms : 0;
      flush(sent);
    };
    tasks_->add(request.send().then(
        [this, server, generation, answered](auto response) {
          auto found = links_.find(server);
          if (found == links_.end() || found->second->generation != generation) return;
          Link& sent = *found->second;
          sent.heartbeat_datagrams_heard = sent.heartbeats != nullptr && response.getHeartbeatDatagramsHeard();
          answered(sent);
        },
        [this, server, generation, answered](kj::Exception&& exception) {
          if (exception.getType() == kj::Exception::Type::DISCONNECTED) {
            lose(server, generation, "the connection broke");
          } else {
            // Our own message was refused: a bug here or a server of another version.
            log(std::string("the server refused a message: ") + exception.getDescription().cStr());
            auto found = links_.find(server);
            if (found != links_.end() && found->second->generation == generation) answered(*found->second);
          }
        }));
  }
}

void Handle::Impl::lose(std::uint32_t server, std::uint64_t generation, const std::string& why) {
  auto found = links_.find(server);
  if (found == links_.end() || found->second->generation != generation) return;
  log("lost server " + options_.servers.at(server) + ": " + why);
  {
    std::lock_guard lock(calls_mutex_);
    last_server_error_ = options_.servers.at(server) + ": " + why;
  }
  std::unique_ptr<Link> link = std::move(found->second);
  links_.erase(found);
  auto& [not_before, backoff] = reconnect_[server];
  backoff = backoff == 0 ? kReconnectBackoffInitialMs : std::min(backoff * 2, kReconnectBackoffMaxMs);
  not_before = steady_now_ms() + backoff;
  // Destroy the connection after the current callback unwinds; tell the agent.
  tasks_->add(kj::evalLater([link = std::move(link)] {}));
  post(ServerLost{server});
}

}  // namespace th
