// libthclient's connections to th-server: one framed connection per server (net/frames.h; TLS when
// the options give a CA), opened on demand, one write in flight and what comes meanwhile batched;
// heartbeats as sealed UDP datagrams where the server hears them; a hung server detected by its
// silence and a lost one failed over (see handle_impl.h for how the files divide the work).
#include "client/handle_impl.h"

#include <arpa/inet.h>

#include <string_view>

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
    } else if (link->connected && now - link->heard_ms > probe_ms) {
      // Nothing of ours waits (heartbeats go as datagrams, which nobody answers): ask something
      // of the server now and then, so that it is seen to hang while nothing else would tell.
      probe(*link);
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
          .then([this, server, generation, find_link](kj::Own<kj::AsyncIoStream> stream) {
            Link* link = find_link();
            if (link == nullptr) return;
            link->frames = kj::heap<net::FrameStream>(kj::mv(stream), tls_ == nullptr ? &loop_->port() : nullptr);
            link->frames->on_written([this, find_link] {
              if (Link* written = find_link(); written != nullptr) flush(*written);
            });
            link->frames->on_broken([this, server, generation](const kj::Exception& exception) {
              const std::string why = std::string("the connection broke: ") + exception.getDescription().cStr();
              tasks_->add(kj::evalLater([this, server, generation, why] { lose(server, generation, why); }));
            });
            // The magic, the hello and what is queued, in one write: on a busy server every round
            // trip waits behind the other connections, so an open needs one, not two.
            link->frames->append_bytes(kj::arrayPtr(net::kFramedMagic.data(), net::kFramedMagic.size()));
            link->frames->append<wire::ClientFrame>([&](wire::ClientFrame::Builder frame) {
              auto hello = frame.initHello();
              hello.setToken(options_.token);
              hello.setClientName(options_.replica + "/" + std::to_string(options_.shard));
              hello.setClient(client_id_);
              hello.setClientSecret(kj::arrayPtr(client_secret_.data(), client_secret_.size()));
            });
            flush(*link);
            if (tls_ == nullptr && !ever_connected_) {
              // th-server answers a hello at once; an HTTP endpoint waits for a request line
              // (kj-http: 5 s) before it hangs up. Ask a peer that stays quiet, before open()'s
              // deadline can pass on it.
              tasks_->add(loop_->timer().afterDelay(kHelloQuietMs * kj::MILLISECONDS).then([this, server, find_link] {
                Link* quiet = find_link();
                if (quiet != nullptr && !quiet->connected && !ever_connected_) probe_http(server);
              }));
            }
            link->reading = read_frames(server, generation).eagerlyEvaluate([this, server, generation](kj::Exception&& exception) {
              const std::string why = exception.getDescription().cStr();
              lose(server, generation,
                   "the connection broke: " + why + hint_for(why, tls_ != nullptr, options_.servers.at(server), options_.tls_server_name));
            });
          })
          .catch_([this, server, generation, address](kj::Exception&& exception) {
            const std::string why = exception.getDescription().cStr();
            const std::string hint = hint_for(why, tls_ != nullptr, address, options_.tls_server_name);
            if (tls_ != nullptr && net::is_certificate_refusal(why) && !ever_connected_) {
              // A wrong CA file or server name, or an impostor, before any server took us: a
              // configuration error that retrying cannot mend, so open() says so at once. Later
              // (a certificate expired, a backup with another name, someone in the path) it is a
              // lost server like any other: retried, and logged, while the others serve.
              fail_everything(make_error(Errc::kPermissionDenied, "server " + address + ": TLS: " + why + hint));
            }
            lose(server, generation, "cannot reach server " + address + ": " + why + hint);
          })
          .eagerlyEvaluate(nullptr);
}

void Handle::Impl::flush(Link& link) {
  if (link.frames.get() == nullptr || link.queue.empty()) return;  // connecting: the queue goes once it is up
  for (std::size_t done = 0; done < link.queue.size();) {
    const std::size_t count = std::min(link.queue.size() - done, net::kMessagesPerCallMax);
    const bool ask = link.ack_awaited == 0;
    link.frames->append<wire::ClientFrame>([&](wire::ClientFrame::Builder frame) {
      auto list = frame.initMessages(static_cast<unsigned>(count));
      for (std::size_t i = 0; i < count; ++i) net::encode(link.queue[done + i], list[static_cast<unsigned>(i)]);
      if (ask) frame.setAck(link.ack_awaited = ++link.acks_asked);
    });
    done += count;
  }
  link.queue.clear();
  if (link.waiting_since_ms == 0) link.waiting_since_ms = steady_now_ms();
  link.frames->flush();
}

void Handle::Impl::probe(Link& link) {
  if (link.frames.get() == nullptr || !link.connected || link.ack_awaited != 0) return;
  link.frames->append<wire::ClientFrame>([&](wire::ClientFrame::Builder frame) {
    frame.initMessages(0);
    frame.setAck(link.ack_awaited = ++link.acks_asked);
  });
  link.waiting_since_ms = steady_now_ms();
  link.frames->flush();
}

kj::Promise<void> Handle::Impl::read_frames(std::uint32_t server, std::uint64_t generation) {
  auto found = links_.find(server);
  if (found == links_.end() || found->second->generation != generation) return kj::READY_NOW;
  return found->second->frames->read_some().then([this, server, generation](bool more) -> kj::Promise<void> {
    for (;;) {
      auto current = links_.find(server);
      if (current == links_.end() || current->second->generation != generation) return kj::READY_NOW;
      Link& link = *current->second;
      if (!more) {
        if (!link.connected && tls_ == nullptr && !ever_connected_) probe_http(server);
        lose(server, generation,
             link.connected ? "the server closed the connection"
                            : std::string("the server closed the connection before answering the hello") +
                                  (tls_ == nullptr ? " (if it runs with --tls-cert, give tls_ca_file)" : ""));
        return kj::READY_NOW;
      }
      capnp::MessageReader* frame = link.frames->next_frame();
      if (frame == nullptr) return read_frames(server, generation);
      on_frame(link, frame->getRoot<wire::ServerFrame>());
    }
  });
}

void Handle::Impl::probe_http(std::uint32_t server) {
  // A peer that hangs up on the hello without a word is most often no th-server at all: its
  // metrics endpoint, or another web server, speaks HTTP. Retrying it until open()'s deadline
  // would only end in "no server answered"; one HTTP request tells.
  if (!http_probed_.insert(server).second) return;
  constexpr TimeMs kProbeTimeoutMs = 2'000;
  const std::string address = options_.servers.at(server);
  auto answers_http =
      loop_->io()
          .getNetwork()
          .parseAddress(address)
          .then([](kj::Own<kj::NetworkAddress> resolved) { return resolved->connect().attach(kj::mv(resolved)); })
          .then([](kj::Own<kj::AsyncIoStream> stream) {
            static constexpr char kRequest[] = "HEAD / HTTP/1.0\r\n\r\n";
            constexpr std::size_t kStatusBytes = 5;  // "HTTP/"
            auto reply = kj::heapArray<char>(kStatusBytes);
            kj::AsyncIoStream& peer = *stream;
            char* at = reply.begin();
            return peer.write(kRequest, sizeof kRequest - 1)
                .then([&peer, at] { return peer.tryRead(at, kStatusBytes, kStatusBytes); })
                .then([at](std::size_t got) { return got == kStatusBytes && std::string_view(at, got) == "HTTP/"; })
                .attach(kj::mv(stream), kj::mv(reply));
          });
  tasks_->add(loop_->timer()
                  .timeoutAfter(kProbeTimeoutMs * kj::MILLISECONDS, kj::mv(answers_http))
                  .then(
                      [this, server](bool http) {
                        if (http) note_http(server);
                      },
                      [](kj::Exception&&) {
                        // The probe is a hint only: the retries go on as for any lost server.
                      }));
}

void Handle::Impl::note_http(std::uint32_t server) {
  if (!http_servers_.insert(server).second) return;
  const std::string hint = "server " + options_.servers.at(server) +
                           " answers HTTP: it is an HTTP endpoint (th-server's --metrics-listen address, or a web "
                           "server?), not th-server's --listen address";
  log(LogLevel::kWarning, "control", hint);
  {
    std::lock_guard lock(calls_mutex_);
    http_hint_ = hint;
  }
  // Waiting for it to hang up (kj-http: 5 s) would only delay the next server.
  if (auto found = links_.find(server); found != links_.end() && !found->second->connected) {
    lose(server, found->second->generation, hint);
  }
  // Retrying cannot help once every server answers HTTP: open() fails now. While another might
  // still answer, the others are tried until open()'s deadline, whose error carries the hint.
  if (!ever_connected_ && http_servers_.size() == options_.servers.size()) {
    fail_everything(make_error(Errc::kInvalidArgument, options_.servers.size() == 1
                                                           ? hint
                                                           : "every server answers HTTP; " + hint));
  }
}

void Handle::Impl::on_frame(Link& link, wire::ServerFrame::Reader frame) {
  const std::uint32_t server = link.server;
  const std::uint64_t generation = link.generation;
  link.heard_ms = steady_now_ms();
  if (frame.getAck() != 0 && frame.getAck() == link.ack_awaited) {
    link.ack_awaited = 0;
    link.waiting_since_ms = 0;
    link.heartbeat_datagrams_heard = link.heartbeats != nullptr && frame.getHeartbeatDatagramsHeard();
  }
  switch (frame.which()) {
    case wire::ServerFrame::WELCOME: {
      if (link.connected) break;  // (a second one: ignored)
      link.connected = true;
      ever_connected_ = true;
      reconnect_.erase(server);
      link.waiting_since_ms = link.ack_awaited != 0 ? link.heard_ms : 0;
      const auto welcome = frame.getWelcome();
      if (welcome.getHeartbeatTimeoutMs() > 0) server_heartbeat_timeout_ms_.store(welcome.getHeartbeatTimeoutMs());
      const auto channel = welcome.getHeartbeats();
      const auto key = net::key_from_bytes({channel.getKey().begin(), channel.getKey().size()});
      if (channel.getPort() == 0 || !key || !link.peer) break;
      try {
        link.heartbeats = std::make_unique<net::HeartbeatSender>(*link.peer, channel.getPort());
        link.heartbeat_key = *key;
      } catch (const net::SocketError& error) {
        log(LogLevel::kInfo, "control", std::string("heartbeats go as messages: ") + error.what());
      }
      break;
    }
    case wire::ServerFrame::REFUSED: {
      const std::string why = frame.getRefused().cStr();
      const std::string address = options_.servers.at(server);
      if (why.find("wrong cluster token") != std::string::npos) {
        fail_everything(make_error(Errc::kPermissionDenied, "server " + address + " refused the cluster token"));
      }
      // (Refused because another connection holds our id with another secret: someone else uses
      // it. Retried with backoff like any lost server; it succeeds once that one is gone.)
      lose(server, generation, "server " + address + " refused the hello: " + why);
      return;
    }
    case wire::ServerFrame::EFFECTS:
      for (auto effect : frame.getEffects()) {
        auto decoded = net::decode(effect);
        if (!decoded.ok()) {
          log(LogLevel::kError, "control", "server " + std::to_string(server) + " sent an invalid message: " + decoded.error().detail);
          continue;
        }
        step(FromHub{server, std::move(decoded).value()});
      }
      break;
    case wire::ServerFrame::NOTICE:
      // Our own message was refused: a bug here or a server of another version.
      log(LogLevel::kWarning, "control", std::string("the server refused a message: ") + frame.getNotice().cStr());
      break;
    case wire::ServerFrame::GOING_AWAY:
      // A draining server: its last answers came before this; fail over now rather than when the
      // connection closes (and do not come back to it before the reconnect backoff).
      lose(server, generation, std::string("the server is going away: ") + frame.getGoingAway().cStr());
      return;
  }
}

void Handle::Impl::lose(std::uint32_t server, std::uint64_t generation, const std::string& why) {
  auto found = links_.find(server);
  if (found == links_.end() || found->second->generation != generation) return;
  log(LogLevel::kWarning, "control", "lost server " + options_.servers.at(server) + ": " + why);
  {
    std::lock_guard lock(calls_mutex_);
    last_server_error_ = options_.servers.at(server) + ": " + why;
  }
  {
    std::lock_guard lock(stats_mutex_);
    ++stats_.servers_lost;
  }
  std::unique_ptr<Link> link = std::move(found->second);
  links_.erase(found);
  auto& [not_before, backoff] = reconnect_[server];
  backoff = backoff == 0 ? kReconnectBackoffInitialMs : std::min(backoff * 2, kReconnectBackoffMaxMs);
  not_before = steady_now_ms() + backoff;
  // Destroy the connection after the current callback unwinds; tell the agent.
  tasks_->add(kj::evalLater([link = std::move(link)] {}));
  post(ServerLost{server});
  // Last: the link is gone, so note_http finds none to lose again.
  if (!ever_connected_ && why.find(net::kPeerSpeaksHttp) != std::string::npos) note_http(server);
}

}  // namespace th
