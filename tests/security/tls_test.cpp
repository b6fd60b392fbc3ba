// Item 7 of the security suite: TLS on the control connection (th-server --tls-cert/--tls-key,
// libthclient's tls_ca_file, th-ctl --tls-ca). Without it the cluster token, the heartbeat secret and
// the grant secrets crossed the network in clear text. The certificates are in tls/ (make-certs).
#include <kj/vector.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "net/socket.h"
#include "net/tls.h"
#include "security_fixture.h"

namespace th::e2e {
namespace {

const std::string kTlsDir = TH_TLS_DIR;
// What th-server logs (in summary) when handshakes wait for their turn.
const std::string kWaitedForATurn = "TLS handshake(s) waited for a turn";

std::vector<std::string> tls_server_flags(const std::string& name = "server") {
  return {"--tls-cert", kTlsDir + "/" + name + ".pem", "--tls-key", kTlsDir + "/" + name + ".key"};
}

// The test certificate names th-server and localhost; clients reach 127.0.0.1, so they name it.
std::vector<std::string> tls_client_flags(const std::string& ca = "ca") {
  return {"--tls-ca", kTlsDir + "/" + ca + ".pem", "--tls-server-name", "th-server"};
}

// A TCP relay between clients and a server that keeps every byte it forwards, as an eavesdropper on
// the path would. One thread, poll; enough for a few connections of control traffic.
class RecordingRelay {
 public:
  explicit RecordingRelay(const std::string& target)
      : target_(net::parse_endpoint(target)), listener_(net::listen_tcp(net::Endpoint{"127.0.0.1", 0}, 16)) {
    thread_ = std::thread([this] { run(); });
  }
  ~RecordingRelay() {
    stopping_ = true;
    thread_.join();
  }
  RecordingRelay(const RecordingRelay&) = delete;
  RecordingRelay& operator=(const RecordingRelay&) = delete;

  std::string address() const { return "127.0.0.1:" + std::to_string(net::local_port(listener_)); }
  std::string recorded() const {
    std::lock_guard lock(mutex_);
    return recorded_;
  }

 private:
  void run() {
    std::vector<std::pair<net::Fd, net::Fd>> pairs;  // (client, server); closed pairs are dropped
    while (!stopping_) {
      std::vector<pollfd> pollers{{listener_.get(), POLLIN, 0}};
      for (const auto& [client, server] : pairs) {
        pollers.push_back({client.get(), POLLIN, 0});
        pollers.push_back({server.get(), POLLIN, 0});
      }
      if (::poll(pollers.data(), pollers.size(), 50) <= 0) continue;
      if (pollers[0].revents != 0) {
        try {
          net::Fd client = net::accept_tcp(listener_);
          if (client.valid()) pairs.emplace_back(std::move(client), net::connect_tcp(target_, 2000));
        } catch (const net::SocketError&) {
          // The server is gone: the client's connection is dropped, as a broken path would.
        }
      }
      std::vector<bool> ended(pairs.size(), false);
      for (std::size_t i = 0; i < pairs.size() && 1 + 2 * i + 1 < pollers.size(); ++i) {
        for (int side = 0; side < 2; ++side) {
          if (pollers[1 + 2 * i + side].revents == 0) continue;
          const net::Fd& from = side == 0 ? pairs[i].first : pairs[i].second;
          const net::Fd& to = side == 0 ? pairs[i].second : pairs[i].first;
          char bytes[65536];
          const ssize_t got = ::recv(from.get(), bytes, sizeof bytes, MSG_DONTWAIT);
          if (got <= 0) {
            ended[i] = got == 0 || (errno != EAGAIN && errno != EINTR);
            continue;
          }
          {
            std::lock_guard lock(mutex_);
            recorded_.append(bytes, static_cast<std::size_t>(got));
          }
          try {
            net::send_all(to, bytes, static_cast<std::size_t>(got));
          } catch (const net::SocketError&) {
            ended[i] = true;
          }
        }
      }
      for (std::size_t i = pairs.size(); i-- > 0;) {
        if (ended[i]) pairs.erase(pairs.begin() + static_cast<long>(i));
      }
    }
  }

  net::Endpoint target_;
  net::Fd listener_;
  std::atomic<bool> stopping_{false};
  mutable std::mutex mutex_;
  std::string recorded_;
  std::thread thread_;
};

// What an eavesdropper on the control connection sees of a trainer's session: with TLS, neither the
// cluster token nor anything the client says (its name here) in clear text. The same eavesdropper
// sees both without TLS, which shows the check can fail.
TEST_F(Security, TlsKeepsTheTokenAndWhatClientsSayOffTheWire) {
  const std::string marker = "replica-name-that-only-travels-inside-tls";
  auto eavesdrop = [&](bool tls) {
    const std::string server = start_server(tls ? tls_server_flags() : std::vector<std::string>{});
    RecordingRelay relay(server);
    Process& trainer = worker({relay.address()}, marker, tls ? tls_client_flags() : std::vector<std::string>{},
                              {"publish:1", "list", "close"});
    expect(trainer, "publish ok 1");
    expect(trainer, "list latest=1");
    expect(trainer, "close ok");
    return relay.recorded();
  };
  const std::string clear = eavesdrop(false);
  ASSERT_NE(clear.find(kToken), std::string::npos) << "without TLS the relay must see the token, or this test proves nothing";
  ASSERT_NE(clear.find(marker), std::string::npos);
  const std::string secure = eavesdrop(true);
  EXPECT_GT(secure.size(), 1000u) << "the TLS session went through the relay";
  EXPECT_EQ(secure.find(kToken), std::string::npos) << "the token crossed the wire in clear text";
  EXPECT_EQ(secure.find(marker), std::string::npos) << "the client's name crossed the wire in clear text";
}

// A client that cannot verify the server refuses it at once with a typed error, instead of handing
// its token to an impostor or retrying until its open timeout.
TEST_F(Security, AClientRefusesAServerItsCaDidNotSignOrThatCarriesAnotherName) {
  const std::string impostor = start_server(tls_server_flags("impostor"));
  Process& fooled = worker({impostor}, "trainer", tls_client_flags(), {"list"});
  const std::string refusal = expect(fooled, "open error permission-denied");
  EXPECT_NE(refusal.find("certificate is not trusted"), std::string::npos) << refusal;

  const std::string genuine = start_server(tls_server_flags());
  // The certificate names th-server and localhost; a client that checks another name refuses it.
  Process& misnamed = worker({genuine}, "trainer", {"--tls-ca", kTlsDir + "/ca.pem", "--tls-server-name", "elsewhere"},
                             {"list"});
  // ("ostname": OpenSSL 3 says "hostname mismatch", 1.1 "Hostname mismatch".)
  EXPECT_NE(expect(misnamed, "open error permission-denied").find("ostname mismatch"), std::string::npos);
  // Dialled by IP address without the name: refused, with what to do about it.
  Process& by_ip = worker({genuine}, "trainer", {"--tls-ca", kTlsDir + "/ca.pem"}, {"list"});
  EXPECT_NE(expect(by_ip, "open error permission-denied").find("give the DNS name"), std::string::npos);

  Process& ctl = spawn({TH_CTL_PATH, "--server", genuine, "--token-file", (dir_ / "token").string(), "--tls-ca",
                        kTlsDir + "/impostor-ca.pem", "--tls-server-name", "th-server"},
                       "ctl");
  EXPECT_EQ(ctl.wait_exit(kHangGuardMs), 1);
  // The genuine server serves a client that trusts its CA, by name or as localhost.
  Process& trainer = worker({genuine}, "trainer", tls_client_flags(), {"publish:1", "wait-line"});
  expect(trainer, "publish ok 1");
  const std::string port = genuine.substr(genuine.rfind(':') + 1);
  Process& rollout = worker({"localhost:" + port}, "rollout", {"--tls-ca", kTlsDir + "/ca.pem"}, {"update:latest", "verify"});
  expect(rollout, "update updated 1");
  expect(rollout, "verify ok 1");
}

// Before the handshake ends a connection has shown nothing: clear-text peers, garbage, and
// handshakes that stall are closed (the auth deadline covers the handshake) and logged in summary,
// while TLS clients are served.
TEST_F(Security, PeersThatDoNotFinishTheTlsHandshakeAreClosedWhileOthersAreServed) {
  std::vector<std::string> flags = tls_server_flags();
  flags.insert(flags.end(), {"--auth-deadline-ms", "2000"});
  const std::string server = start_server(flags);
  const net::Endpoint endpoint = net::parse_endpoint(server);
  std::vector<net::Fd> garbage, silent, stalled;
  const std::string junk = "GET / HTTP/1.0\r\n\r\n";
  const unsigned char client_hello_start[] = {0x16, 0x03, 0x01, 0x02, 0x00, 0x01};  // a record, then nothing
  for (int i = 0; i < 60; ++i) {
    garbage.push_back(net::connect_tcp(endpoint, 2000));
    net::send_all(garbage.back(), junk.data(), junk.size());
    silent.push_back(net::connect_tcp(endpoint, 2000));
    stalled.push_back(net::connect_tcp(endpoint, 2000));
    net::send_all(stalled.back(), client_hello_start, sizeof client_hello_start);
  }
  Process& trainer = worker({server}, "trainer", tls_client_flags(), {"publish:1", "list"});
  expect(trainer, "publish ok 1");
  expect(trainer, "list latest=1");
  EXPECT_EQ(open_after(garbage), 0u);
  EXPECT_EQ(open_after(silent), 0u);
  EXPECT_EQ(open_after(stalled), 0u);
  ASSERT_TRUE(running(*servers_[0]));
  // 60 failed handshakes, logged as a summary (a line per 10 s), not a line each.
  const std::string log = server_log(*servers_[0]);
  std::size_t lines = 0;
  for (std::size_t at = 0; (at = log.find("TLS handshake(s) failed", at)) != std::string::npos; ++at) ++lines;
  EXPECT_GE(lines, 1u);
  EXPECT_LE(lines, 5u);
}

// Past open(), a refused certificate is a lost server like any other: a backup with another name or
// an expired certificate, or someone in the path, must not end the job when the primary fails.
TEST_F(Security, ACertificateRefusedAfterOpenIsALostServerNotTheEndOfTheHandle) {
  const std::string primary = start_server(tls_server_flags());
  const std::string impostor = start_server(tls_server_flags("impostor"));
  const std::string backup = start_server(tls_server_flags());
  Process& trainer = worker({primary, impostor, backup}, "trainer", tls_client_flags(), {"publish:1", "wait-line", "list"});
  expect(trainer, "publish ok 1");
  servers_[0]->kill9();
  trainer.send_line("");
  // Fails over past the impostor (refused, logged) to the genuine backup.
  EXPECT_EQ(expect(trainer, "list ").substr(0, 13), "list latest=1") << trainer.describe();
}

// Handshakes cost the server a key exchange and a signature each, before any token: at most
// --tls-handshakes-per-s-max begin a second, and a client still gets in during a flood of them.
TEST_F(Security, AFloodOfTlsHandshakesIsPacedAndAClientStillGetsIn) {
  constexpr int kHandshakesPerS = 50;
  constexpr int kFloodSeconds = 4;
  constexpr int kConcurrent = 8;
  std::vector<std::string> flags = tls_server_flags();
  flags.insert(flags.end(), {"--tls-handshakes-per-s-max", std::to_string(kHandshakesPerS)});
  const std::string server = start_server(flags);
  auto tls = net::make_client_tls(kTlsDir + "/ca.pem");
  ASSERT_TRUE(tls.ok());
  std::atomic<int> completed{0};
  std::atomic<bool> stop{false};
  std::thread flood([&] {
    auto flood_io = kj::setupAsyncIo();
    auto address = flood_io.provider->getNetwork().parseAddress(server).wait(flood_io.waitScope);
    std::function<kj::Promise<void>()> one = [&]() -> kj::Promise<void> {
      if (stop) return kj::READY_NOW;
      return address->connect()
          .then([&](kj::Own<kj::AsyncIoStream> stream) { return tls.value()->wrapClient(kj::mv(stream), "th-server"); })
          .then([&](kj::Own<kj::AsyncIoStream>) { ++completed; },  // dropped at once: the next one
                [](kj::Exception&&) {})
          .then([&] { return one(); });
    };
    kj::Vector<kj::Promise<void>> chains;
    for (int i = 0; i < kConcurrent; ++i) chains.add(one());
    flood_io.provider->getTimer().afterDelay(kFloodSeconds * kj::SECONDS).wait(flood_io.waitScope);
    stop = true;
    kj::joinPromises(chains.releaseAsArray()).wait(flood_io.waitScope);
  });
  std::this_thread::sleep_for(std::chrono::seconds(1));
  Process& trainer = worker({server}, "trainer", tls_client_flags(), {"publish:1"});
  expect(trainer, "publish ok 1");
  flood.join();
  // The first second's burst, then the rate (the flood ran kFloodSeconds and then finished the
  // handshakes it had begun).
  EXPECT_LE(completed.load(), kHandshakesPerS * (kFloodSeconds + 2)) << completed.load() << " handshakes";
  EXPECT_GE(completed.load(), kHandshakesPerS) << "the flood did not reach the limit: this test proves nothing";
  EXPECT_NE(server_log(*servers_[0]).find(kWaitedForATurn), std::string::npos);
  ASSERT_TRUE(running(*servers_[0]));
}

// A connection costs a handshake turn only once it has sent its first bytes: empty connects, reset
// at once or left silent, cost the attacker nothing and used to take the turns (the accept loop
// paused, honest clients waited seconds in the listen backlog). With 5 turns a second, 2,000 of
// them would have stalled it for minutes; a client behind them now opens at once.
TEST_F(Security, EmptyConnectsTakeNoHandshakeTurns) {
  std::vector<std::string> flags = tls_server_flags();
  flags.insert(flags.end(), {"--tls-handshakes-per-s-max", "5"});
  const std::string server = start_server(flags);
  const net::Endpoint endpoint = net::parse_endpoint(server);
  std::vector<net::Fd> silent;
  for (int i = 0; i < 2000; ++i) {
    net::Fd reset = net::connect_tcp(endpoint, 2000);
    const linger abort{1, 0};  // close() sends a reset
    ::setsockopt(reset.get(), SOL_SOCKET, SO_LINGER, &abort, sizeof abort);
    if (i % 10 == 0) silent.push_back(net::connect_tcp(endpoint, 2000));
  }
  Process& trainer = worker({server}, "trainer", tls_client_flags(), {"publish:1"});
  expect(trainer, "publish ok 1");
  EXPECT_EQ(server_log(*servers_[0]).find(kWaitedForATurn), std::string::npos)
      << "empty connects took handshake turns";
  ASSERT_TRUE(running(*servers_[0]));
}

// A key that is not the certificate's used to be accepted by OpenSSL and fail every handshake later;
// th-server refuses to start instead, saying why.
TEST_F(Security, AServerRefusesToStartWithAKeyThatIsNotItsCertificates) {
  auto start = [&](std::vector<std::string> tls) {
    std::vector<std::string> argv = {TH_SERVER_PATH, "--listen", "127.0.0.1:0", "--token-file", (dir_ / "token").string()};
    argv.insert(argv.end(), tls.begin(), tls.end());
    Process& server = spawn(argv, "server");
    const int status = server.wait_exit(kHangGuardMs);
    return std::pair{status, server.describe()};
  };
  const auto [mismatched, mismatched_log] =
      start({"--tls-cert", kTlsDir + "/server.pem", "--tls-key", kTlsDir + "/impostor.key"});
  EXPECT_EQ(mismatched, 2) << mismatched_log;
  EXPECT_NE(mismatched_log.find("does not belong to the certificate"), std::string::npos) << mismatched_log;
  const auto [not_pem, not_pem_log] = start({"--tls-cert", (dir_ / "token").string(), "--tls-key", kTlsDir + "/server.key"});
  EXPECT_EQ(not_pem, 2) << not_pem_log;
  EXPECT_NE(not_pem_log.find("holds no PEM certificate"), std::string::npos) << not_pem_log;
  const auto [half, half_log] = start({"--tls-cert", kTlsDir + "/server.pem"});
  EXPECT_NE(half, 0) << half_log;
}

}  // namespace
}  // namespace th::e2e
