// th-e2e-load: many clients keeping a th-server busy, for the fairness test and benchmarks.
//
// Opens --connections framed connections (net/frames.h, as libthclient; --rpc: Cap'n Proto RPC, the
// former design) on one thread and authenticates each. Then either
//   (default) keeps --in-flight calls (frames asking for an ack, or Session.send calls) outstanding
//   on every connection, each a batch of --batch heartbeats of a client id of its own: a server
//   kept as busy as this process can make it;
// or, with --heartbeat-interval-ms, behaves like that many idle workers: each connection opens a
//   one-shard replica and then sends one heartbeat per interval (the cost of a large idle fleet),
//   as a datagram once the server hears them, plus an empty call every 3/4 heartbeat timeout
//   (a probe that the server is alive), as libthclient does (--no-probes: without the probes).
// Prints "load ready N" once every connection has its session, then "load calls N last-second M"
// every second (calls completed in all, and in the last second), until killed.
#include <CLI/CLI.hpp>
#include <capnp/rpc-twoparty.h>
#include <kj/async-io.h>

#include <chrono>
#include <cstring>
#include <iostream>
#include <memory>
#include <optional>
#include <vector>

#include "net/frames.h"
#include "net/heartbeat.h"
#include "net/tls.h"
#include "net/tensorhub.capnp.h"

#pragma GCC diagnostic ignored "-Wnon-virtual-dtor"  // Cap'n Proto's generated Server classes

namespace {

class NullSink final : public th::wire::Sink::Server {
 protected:
  kj::Promise<void> deliver(DeliverContext) override { return kj::READY_NOW; }
};

struct Client {
  kj::Own<kj::AsyncIoStream> stream;
  kj::Own<capnp::TwoPartyClient> rpc;
  kj::Maybe<th::wire::Session::Client> session;
  kj::Own<th::net::FrameStream> frames;  // framed (then stream and rpc are unused)
  kj::Maybe<kj::Promise<void>> reading;
  std::uint64_t acks_asked = 0;
  std::uint64_t acked = 0;
  bool welcomed = false;
  unsigned index = 0;
  std::uint64_t id = 0;
  std::optional<th::net::HeartbeatKey> heartbeat_key;  // none: the server offered no datagram channel
  std::uint64_t heartbeat_count = 0;
  std::int64_t heartbeat_timeout_ms = 10'000;  // told at connect
  std::int64_t last_call_ms = 0;               // when this client last sent a call
  bool heartbeat_datagrams_heard = false;
};

// Fills `messages` with heartbeat reports of `client` (session 1).
void heartbeats_into(capnp::List<th::wire::ToHub>::Builder messages, std::uint64_t client) {
  for (auto message : messages) {
    auto report = message.initReport();
    report.setClient(client);
    report.setSession(1);
    report.getBody().setHeartbeat();
  }
}

// An idle worker's open: a one-shard replica of its own.
void idle_open_into(th::wire::ToHub::Builder into, std::uint64_t client, unsigned index) {
  auto message = into.initRequest();
  message.setClient(client);
  message.setSeq(0);
  message.setSession(1);
  auto body = message.getBody().initOpen();
  body.setModel("idle-fleet");
  body.setReplica("worker-" + std::to_string(index));
  body.setIncarnation(1);
  body.setShard(0);
  body.setNumShards(1);
  body.setDatacenter("dc");
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"th-e2e-load: keeps a th-server busy with many connections"};
  std::string server;
  std::string token;
  unsigned connections = 1000;
  unsigned in_flight = 8;
  unsigned batch = 16;
  unsigned heartbeat_interval_ms = 0;
  app.add_option("--server", server)->required();
  app.add_option("--token", token)->required();
  std::string tls_ca_file;
  std::string tls_server_name;
  app.add_option("--tls-ca", tls_ca_file, "TLS to a th-server run with --tls-cert: trust this CA file");
  app.add_option("--tls-server-name", tls_server_name, "TLS: the name the server's certificate carries");
  app.add_option("--connections", connections)->capture_default_str();
  app.add_option("--in-flight", in_flight)->capture_default_str();
  app.add_option("--batch", batch)->capture_default_str();
  app.add_option("--heartbeat-interval-ms", heartbeat_interval_ms, "idle workers: one heartbeat per interval");
  bool rpc = false;
  app.add_flag("--rpc", rpc, "Cap'n Proto RPC connections (Session.send per batch) instead of framed ones");
  bool probes = true;
  app.add_flag("!--no-probes", probes, "idle workers: no empty calls while the datagrams are heard (libthclient probes)");
  CLI11_PARSE(app, argc, argv);

  auto io = kj::setupAsyncIo();
  io.waitScope.setBusyPollInterval(64);
  std::unique_ptr<kj::TlsContext> tls;
  if (!tls_ca_file.empty()) {
    auto made = th::net::make_client_tls(tls_ca_file);
    if (!made.ok()) {
      std::cerr << "th-e2e-load: " << made.error().detail << "\n";
      return 2;
    }
    tls = std::move(made).value();
  }
  auto address = io.provider->getNetwork().parseAddress(server).wait(io.waitScope);
  std::vector<std::unique_ptr<Client>> clients;
  std::uint64_t calls = 0;
  unsigned ready = 0;
  kj::TaskSet::ErrorHandler* handler = nullptr;
  struct Errors : kj::TaskSet::ErrorHandler {
    void taskFailed(kj::Exception&& exception) override {
      std::cerr << "th-e2e-load: " << exception.getDescription().cStr() << "\n";
    }
  } errors;
  handler = &errors;
  kj::TaskSet tasks(*handler);

  // One call; when it returns, the next (the connection always has `in_flight` outstanding).
  std::function<kj::Promise<void>(Client&)> pump = [&](Client& client) -> kj::Promise<void> {
    KJ_IF_MAYBE(session, client.session) {
      auto request = session->sendRequest();
      heartbeats_into(request.initMessages(batch), client.id);
      return request.send().ignoreResult().then([&] {
        ++calls;
        return pump(client);
      });
    }
    return kj::READY_NOW;
  };

  std::unique_ptr<th::net::HeartbeatSender> datagrams;
  const auto now_ms = [] {
    return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now().time_since_epoch())
        .count();
  };
  // What connect (RPC) or the welcome (framed) tells: the server's heartbeat timeout and channel.
  const auto take_channel = [&](Client& client, std::int64_t timeout_ms, th::wire::HeartbeatChannel::Reader channel) {
    if (timeout_ms > 0) client.heartbeat_timeout_ms = timeout_ms;
    if (channel.getPort() == 0 || heartbeat_interval_ms == 0) return;
    client.heartbeat_key = th::net::key_from_bytes({channel.getKey().begin(), channel.getKey().size()});
    if (datagrams == nullptr) {
      datagrams = std::make_unique<th::net::HeartbeatSender>(
          th::net::Endpoint{th::net::parse_endpoint(server).host, channel.getPort()});
    }
  };

  // ---- Framed connections ----
  // A batch of heartbeats (none: a probe) in a frame asking for the next ack.
  const auto send_frame = [&](Client& client, unsigned heartbeats_in_batch) {
    client.frames->append<th::wire::ClientFrame>([&](th::wire::ClientFrame::Builder frame) {
      heartbeats_into(frame.initMessages(heartbeats_in_batch), client.id);
      frame.setAck(++client.acks_asked);
    });
    client.frames->flush();
    client.last_call_ms = now_ms();
  };
  // As libthclient does: a datagram where the server offers a channel, and a call as well until
  // the server says it hears the datagrams; once it does, an empty call (a probe that the server
  // is alive) whenever no call went for 3/4 of the server's heartbeat timeout.
  std::function<kj::Promise<void>(Client&, unsigned)> heartbeats = [&](Client& client, unsigned delay_ms) {
    return io.provider->getTimer().afterDelay(delay_ms * kj::MILLISECONDS).then([&]() -> kj::Promise<void> {
      if (datagrams != nullptr && client.heartbeat_key) {
        if (datagrams->send(th::net::seal(client.id, 1, ++client.heartbeat_count, *client.heartbeat_key))) ++calls;
      }
      if (client.frames.get() != nullptr) {
        const bool probe = client.heartbeat_datagrams_heard && probes &&
                           now_ms() - client.last_call_ms >= client.heartbeat_timeout_ms * 3 / 4;
        if (!client.heartbeat_datagrams_heard || probe) send_frame(client, probe ? 0 : 1);
      }
      KJ_IF_MAYBE(session, client.session) {
        const bool probe = client.heartbeat_datagrams_heard && probes &&
                           now_ms() - client.last_call_ms >= client.heartbeat_timeout_ms * 3 / 4;
        if (!client.heartbeat_datagrams_heard || probe) {
          auto request = session->sendRequest();
          if (!probe) {
            auto report = request.initMessages(1)[0].initReport();
            report.setClient(client.id);
            report.setSession(1);
            report.getBody().setHeartbeat();
          }
          client.last_call_ms = now_ms();
          tasks.add(request.send().then([&](auto response) {
            ++calls;
            client.heartbeat_datagrams_heard = response.getHeartbeatDatagramsHeard();
          }));
        }
      }
      return heartbeats(client, heartbeat_interval_ms);
    });
  };

  // Once welcomed: the pumps, or an idle worker's open and heartbeats.
  const auto on_welcome = [&](Client& client, unsigned) {
    if (++ready == connections) std::cout << "load ready " << connections << std::endl;
    if (heartbeat_interval_ms == 0) {
      for (unsigned k = 0; k < in_flight; ++k) send_frame(client, batch);
      return;
    }
    client.frames->append<th::wire::ClientFrame>([&](th::wire::ClientFrame::Builder frame) {
      idle_open_into(frame.initMessages(1)[0], client.id, client.index);
    });
    client.frames->flush();
    tasks.add(heartbeats(client, (client.index * 7919u) % heartbeat_interval_ms));
  };
  std::function<kj::Promise<void>(Client&)> read_frames = [&](Client& client) -> kj::Promise<void> {
    return client.frames->read_some().then([&](bool more) -> kj::Promise<void> {
      if (!more) return KJ_EXCEPTION(DISCONNECTED, "the server closed a connection");
      while (capnp::MessageReader* message = client.frames->next_frame()) {
        auto frame = message->getRoot<th::wire::ServerFrame>();
        if (frame.isRefused()) return KJ_EXCEPTION(FAILED, "refused", frame.getRefused().cStr());
        if (frame.isWelcome() && !client.welcomed) {
          client.welcomed = true;
          auto welcome = frame.getWelcome();
          take_channel(client, welcome.getHeartbeatTimeoutMs(), welcome.getHeartbeats());
          on_welcome(client, welcome.getHeartbeats().getPort());
        }
        if (frame.getAck() > client.acked) {
          const std::uint64_t newly = frame.getAck() - client.acked;
          client.acked = frame.getAck();
          calls += newly;
          client.heartbeat_datagrams_heard = frame.getHeartbeatDatagramsHeard();
          if (heartbeat_interval_ms == 0) {
            for (std::uint64_t k = 0; k < newly; ++k) send_frame(client, batch);  // keep in_flight outstanding
          }
        }
      }
      return read_frames(client);
    });
  };

  for (unsigned i = 0; i < connections; ++i) {
    auto client = std::make_unique<Client>();
    client->id = 0x10AD000000000000ull + i;
    client->index = i;
    client->stream = address->connect().wait(io.waitScope);
    if (tls != nullptr) {
      client->stream =
          tls->wrapClient(kj::mv(client->stream), th::net::tls_server_name(server, tls_server_name)).wait(io.waitScope);
    }
    if (!rpc) {
      Client& ref = *client;
      ref.frames = kj::heap<th::net::FrameStream>(kj::mv(client->stream), tls == nullptr ? &io.unixEventPort : nullptr);
      ref.frames->append_bytes(kj::arrayPtr(th::net::kFramedMagic.data(), th::net::kFramedMagic.size()));
      ref.frames->append<th::wire::ClientFrame>([&](th::wire::ClientFrame::Builder frame) {
        auto hello = frame.initHello();
        hello.setToken(token);
        hello.setClientName("load");
        kj::byte secret[16] = {};  // a load generator's clients are not attacked
        std::memcpy(secret, &ref.id, sizeof ref.id);
        hello.setClient(ref.id);
        hello.setClientSecret(kj::arrayPtr(secret, sizeof secret));
      });
      ref.frames->flush();
      ref.reading = read_frames(ref).eagerlyEvaluate([&](kj::Exception&& exception) { errors.taskFailed(kj::mv(exception)); });
      clients.push_back(std::move(client));
      continue;
    }
    client->rpc = kj::heap<capnp::TwoPartyClient>(*client->stream);
    auto request = client->rpc->bootstrap().castAs<th::wire::Hub>().connectRequest();
    request.setToken(token);
    request.setSink(kj::heap<NullSink>());
    request.setClientName("load");
    // A load generator's clients are not attacked: a secret derived from the id is enough.
    kj::byte secret[16] = {};
    std::memcpy(secret, &client->id, sizeof client->id);
    request.setClient(client->id);
    request.setClientSecret(kj::arrayPtr(secret, sizeof secret));
    Client& ref = *client;
    tasks.add(request.send().then([&, i](auto response) {
      ref.session = response.getSession();
      take_channel(ref, response.getHeartbeatTimeoutMs(), response.getHeartbeats());
      if (++ready == connections) std::cout << "load ready " << connections << std::endl;
      if (heartbeat_interval_ms == 0) {
        for (unsigned k = 0; k < in_flight; ++k) tasks.add(pump(ref));
        return;
      }
      // An idle worker: open a one-shard replica, then heartbeat (first beats spread over the interval).
      KJ_IF_MAYBE(session, ref.session) {
        auto open = session->sendRequest();
        idle_open_into(open.initMessages(1)[0], ref.id, i);
        tasks.add(open.send().ignoreResult());
      }
      tasks.add(heartbeats(ref, (i * 7919u) % heartbeat_interval_ms));
    }));
    clients.push_back(std::move(client));
  }
  std::uint64_t calls_last = 0;
  for (;;) {
    io.provider->getTimer().afterDelay(1 * kj::SECONDS).wait(io.waitScope);
    std::cout << "load calls " << calls << " last-second " << calls - calls_last << std::endl;
    calls_last = calls;
  }
}
