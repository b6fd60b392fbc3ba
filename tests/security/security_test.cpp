// The security and fault suite (label security): each test stages one attack or fault that took
// th-server or libthclient down before (issue 11 lists them), against real processes on loopback,
// and checks the fixed behaviour: the server alive and serving others, nobody evicted who did
// nothing wrong, resources bounded, a forged or stolen credential refused.
#include <capnp/rpc-twoparty.h>
#include <kj/async-io.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <fstream>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "security_fixture.h"
#include "net/data_plane.h"
#include "net/heartbeat.h"
#include "net/socket.h"
#include "net/tensorhub.capnp.h"
#include "net/wire.h"
#include "tensorhub/client.h"

// Cap'n Proto's generated Server classes have virtual methods and a non-virtual destructor.
#pragma GCC diagnostic ignored "-Wnon-virtual-dtor"

namespace th::e2e {
namespace {

class NullSink final : public wire::Sink::Server {
 protected:
  kj::Promise<void> deliver(DeliverContext) override { return kj::READY_NOW; }
};

// A peer that takes the server's deliveries and never answers them.
class HangingSink final : public wire::Sink::Server {
 protected:
  kj::Promise<void> deliver(DeliverContext) override { return kj::NEVER_DONE; }
};

// A fixed 16-byte secret per test client (tests choose them; libthclient draws them from the OS).
std::string secret_of(char fill) { return std::string(16, fill); }

// A Cap'n Proto connection to th-server, driven from the test's thread.
class RpcClient {
 public:
  RpcClient(kj::AsyncIoContext& io, const std::string& server) : io_(io) {
    auto address = io_.provider->getNetwork().parseAddress(server).wait(io_.waitScope);
    stream_ = address->connect().wait(io_.waitScope);
    rpc_ = kj::heap<capnp::TwoPartyClient>(*stream_);
  }

  // Calls Hub.connect; returns "" when it succeeds, else the server's reason.
  std::string connect(const std::string& token, ClientId client, const std::string& secret,
                      const std::string& name = "test", bool answers_deliveries = true) {
    auto request = rpc_->bootstrap().castAs<wire::Hub>().connectRequest();
    request.setToken(token);
    if (answers_deliveries) {
      request.setSink(kj::heap<NullSink>());
    } else {
      request.setSink(kj::heap<HangingSink>());
    }
    request.setClientName(name);
    request.setClient(client);
    request.setClientSecret(kj::arrayPtr(reinterpret_cast<const kj::byte*>(secret.data()), secret.size()));
    try {
      auto response = request.send().wait(io_.waitScope);
      session_ = response.getSession();
      const auto channel = response.getHeartbeats();
      heartbeat_port_ = channel.getPort();
      heartbeat_key_ = net::key_from_bytes({channel.getKey().begin(), channel.getKey().size()});
      return "";
    } catch (const kj::Exception& exception) {
      return exception.getDescription().cStr();
    }
  }

  // Asks for the server's bootstrap capability and drops it (one message each way).
  void bootstrap_only() { (void)rpc_->bootstrap(); }

  // The datagram channel the server offered at connect (port 0: none).
  std::uint16_t heartbeat_port() const { return heartbeat_port_; }
  std::optional<net::HeartbeatKey> heartbeat_key() const { return heartbeat_key_; }

  // Sends one heartbeat report naming `client` on the session; "" when the server took it.
  std::string heartbeat(ClientId client) { return send({net::ToHubMessage{Report{client, Heartbeat{}, 0}}}); }

  // One Session.send of `messages` (none: a quiet client's probe); "" when the server took it.
  std::string send(const std::vector<net::ToHubMessage>& messages) {
    KJ_IF_MAYBE(session, session_) {
      auto request = session->sendRequest();
      auto list = request.initMessages(static_cast<unsigned>(messages.size()));
      for (unsigned i = 0; i < messages.size(); ++i) net::encode(messages[i], list[i]);
      try {
        request.send().wait(io_.waitScope);
        return "";
      } catch (const kj::Exception& exception) {
        return exception.getDescription().cStr();
      }
    }
    return "no session";
  }

 private:
  kj::AsyncIoContext& io_;
  kj::Own<kj::AsyncIoStream> stream_;
  kj::Own<capnp::TwoPartyClient> rpc_;
  kj::Maybe<wire::Session::Client> session_;
  std::uint16_t heartbeat_port_ = 0;
  std::optional<net::HeartbeatKey> heartbeat_key_;
};


// Item 1: silent TCP connections past the descriptor limit used to make accept() throw and
// th-server exit with status 0; nothing closed them.
TEST_F(Security, SilentConnectionsPastTheDescriptorLimitNeitherEndNorBlockTheServer) {
  constexpr int kServerFds = 256;
  constexpr int kSilentConnections = 600;  // more than the server has descriptors
  const std::string server = start_server({}, kServerFds);  // auth deadline 10 s
  const net::Endpoint endpoint = net::parse_endpoint(server);
  std::vector<net::Fd> silent;
  int refused = 0;
  for (int i = 0; i < kSilentConnections; ++i) {
    try {
      silent.push_back(net::connect_tcp(endpoint, 2000));
    } catch (const net::SocketError&) {
      ++refused;  // the listen queue was full for a moment: tolerated, not required
    }
  }
  EXPECT_LT(refused, kSilentConnections / 2);
  ASSERT_TRUE(running(*servers_[0])) << "th-server ended under silent connections";
  // Others are still served while the silent ones hold on.
  EXPECT_NE(ctl(server).find("th-server "), std::string::npos);
  Process& trainer = worker({server}, "trainer", {}, {"publish:1", "list"});
  expect(trainer, "publish ok 1");
  EXPECT_EQ(expect(trainer, "list ").substr(0, 13), "list latest=1");
  // Every silent connection is closed: shed to admit others, or at its auth deadline.
  EXPECT_EQ(open_after(silent), 0u);
  EXPECT_TRUE(running(*servers_[0]));
}

// Item 6: before authentication, a segment table declaring a huge message made the server reserve
// it (300 connections: VmSize 19.7 GB).
TEST_F(Security, UnauthenticatedConnectionsCannotMakeTheServerReserveMemory) {
  constexpr int kConnections = 300;
  constexpr long kGrowthMaxKb = 512 * 1024;  // far below the 300 x 64 MiB the headers declare
  const std::string server = start_server({"--log-level", "info"});
  const int pid = servers_[0]->pid();
  const long before_kb = status_field(pid, "VmSize");
  std::vector<net::Fd> attackers;
  for (int i = 0; i < kConnections; ++i) {
    net::Fd socket = net::connect_tcp(net::parse_endpoint(server), 5000);
    // Cap'n Proto framing: (segment count - 1) = 0, then the first segment's size in words: just
    // under Cap'n Proto's own limit (64 MiB), which an authenticated peer may use.
    const std::uint32_t header[2] = {0, (64u << 20) / 8 - 1};
    net::send_all(socket, header, sizeof header);
    attackers.push_back(std::move(socket));
  }
  EXPECT_EQ(open_after(attackers), 0u) << "connections that sent an oversized message are kept";
  const long after_kb = status_field(pid, "VmSize");
  EXPECT_LT(after_kb - before_kb, kGrowthMaxKb) << "VmSize " << before_kb << " kB -> " << after_kb << " kB";
  EXPECT_NE(ctl(server).find("th-server "), std::string::npos);
}

// Item 6: 20,000 wrong tokens on one connection in 2 s were never cut off and wrote 40,000 log
// lines.
TEST_F(Security, WrongTokensCloseTheConnectionAndAreLoggedInSummary) {
  constexpr int kAttempts = 50;
  constexpr std::size_t kLogLinesMax = 3;  // summaries, at most one per 10 s
  const std::string server = start_server({"--log-level", "info"});
  RpcClient attacker(io(), server);
  int refused = 0;
  std::string closed;
  for (int i = 0; i < kAttempts && closed.empty(); ++i) {
    const std::string why = attacker.connect("guess-" + std::to_string(i), 7, secret_of('a'));
    ASSERT_NE(why, "");
    if (why.find("wrong cluster token") != std::string::npos) {
      ++refused;
    } else {
      closed = why;  // (a closed Cap'n Proto connection cannot be used again)
    }
  }
  EXPECT_LE(refused, 3) << "the connection was not closed after a few wrong tokens";
  EXPECT_FALSE(closed.empty()) << "the connection took " << kAttempts << " wrong tokens and stayed open";
  for (int i = 0; i < kAttempts; ++i) {
    RpcClient another(io(), server);
    EXPECT_NE(another.connect("guess", 7, secret_of('a')), "");
  }
  std::size_t lines = 0;
  std::istringstream log(server_log(*servers_[0]));
  for (std::string line; std::getline(log, line);) lines += line.find("wrong cluster token") != std::string::npos;
  EXPECT_LE(lines, kLogLinesMax) << server_log(*servers_[0]);
  EXPECT_NE(ctl(server).find("th-server "), std::string::npos);
}

// Item 6: a client-supplied name was logged raw before the token check, so a name with a newline
// forged a server log line.
TEST_F(Security, ClientNamesCannotForgeLogLines) {
  const std::string forged = "2026-01-01T00:00:00Z th-server error: forged";
  const std::string server = start_server({"--log-level", "debug"});
  {
    RpcClient wrong(io(), server);
    EXPECT_NE(wrong.connect("wrong", 5, secret_of('b'), "x\n" + forged), "");
    RpcClient right(io(), server);
    EXPECT_EQ(right.connect(kToken, 6, secret_of('c'), "y\n" + forged), "");
    EXPECT_EQ(right.heartbeat(6), "");
  }
  // The closes are logged once the server notices them.
  ctl(server);
  std::istringstream log(server_log(*servers_[0]));
  for (std::string line; std::getline(log, line);) {
    EXPECT_NE(line.rfind(forged, 0), 0u) << "a forged line: " << line;
  }
}

// Item 5: the server bound a client id to whichever connection last named it, so any token holder
// could take over another client's id (its answers went to the attacker).
TEST_F(Security, AClientIdBelongsToTheConnectionThatClaimedIt) {
  const std::string server = start_server({"--log-level", "info"});
  constexpr ClientId kVictim = 0x1234;
  RpcClient victim(io(), server);
  ASSERT_EQ(victim.connect(kToken, kVictim, secret_of('v')), "");
  EXPECT_EQ(victim.heartbeat(kVictim), "");

  RpcClient thief(io(), server);
  const std::string claimed = thief.connect(kToken, kVictim, secret_of('t'));
  EXPECT_NE(claimed.find("permission denied"), std::string::npos) << claimed;
  RpcClient impostor(io(), server);
  ASSERT_EQ(impostor.connect(kToken, 0x9999, secret_of('i')), "");
  EXPECT_NE(impostor.heartbeat(kVictim), "") << "a message naming another connection's client was taken";
  EXPECT_EQ(impostor.heartbeat(0x9999), "");
  EXPECT_EQ(victim.heartbeat(kVictim), "") << "the victim lost its id";

  // The holder of the secret (a reconnecting handle) takes its id over; the old connection is mute.
  auto reconnected = std::make_unique<RpcClient>(io(), server);
  EXPECT_EQ(reconnected->connect(kToken, kVictim, secret_of('v')), "");
  EXPECT_EQ(reconnected->heartbeat(kVictim), "");
  EXPECT_NE(victim.heartbeat(kVictim), "");

  // Its connection gone, the id stays reserved to its secret for a while (heartbeat datagrams carry
  // ids in clear: whoever saw one must not claim it before the handle reconnects).
  reconnected.reset();
  ctl(server);  // (the server has seen the close by the time it answers another connection)
  RpcClient squatter(io(), server);
  const std::string squatted = squatter.connect(kToken, kVictim, secret_of('s'));
  EXPECT_NE(squatted.find("permission denied"), std::string::npos) << squatted;
  // And again (attack find: a refused claim used the reservation up, and the second try took the id).
  for (char fill : {'s', 'x'}) {
    RpcClient next_squatter(io(), server);
    const std::string again = next_squatter.connect(kToken, kVictim, secret_of(fill));
    EXPECT_NE(again.find("permission denied"), std::string::npos) << again;
  }
  RpcClient back(io(), server);
  EXPECT_EQ(back.connect(kToken, kVictim, secret_of('v')), "");
}

// Item 6 (review find): before authentication a peer could send any number of messages (each
// bootstrap or unknown call leaves an answer and a reply queued); the connection is closed after a
// few dozen.
TEST_F(Security, ANonAuthenticatedPeerCannotSendMessagesWithoutEnd) {
  const std::string server = start_server({"--log-level", "info"});
  RpcClient chatty(io(), server);
  for (int i = 0; i < 200; ++i) chatty.bootstrap_only();
  const std::string refused = chatty.connect(kToken, 21, secret_of('c'));
  EXPECT_NE(refused, "") << "200 messages before the token were taken";
  RpcClient polite(io(), server);
  EXPECT_EQ(polite.connect(kToken, 22, secret_of('p')), "");
}

// Items 1 and 6: an authenticated connection that goes silent is closed after the idle timeout;
// one that heartbeats stays.
TEST_F(Security, AnAuthenticatedConnectionThatGoesSilentIsClosed) {
  const std::string server =
      start_server({"--heartbeat-timeout-ms", "1000", "--idle-timeout-ms", "2000", "--no-heartbeat-datagrams"});
  RpcClient quiet(io(), server);
  ASSERT_EQ(quiet.connect(kToken, 11, secret_of('q')), "");
  RpcClient lively(io(), server);
  ASSERT_EQ(lively.connect(kToken, 12, secret_of('l')), "");
  for (int i = 0; i < 20; ++i) {  // 6 s
    EXPECT_EQ(lively.heartbeat(12), "") << "after " << i * 300 << " ms";
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
  }
  EXPECT_NE(quiet.heartbeat(11), "") << "a connection silent for 6 s (idle timeout 2 s) is still open";
}

// Items 3 and 11: a reader that hangs mid-read (SIGSTOP) held its source's revoke(), which runs on
// the source's I/O thread, the one that sends heartbeats: the healthy trainer was evicted 3 s after
// the reader, and its list() and unpublish() took a minute.
TEST_F(Security, AHungReaderDoesNotGetItsSourceEvicted) {
  const std::string server = start_server({"--heartbeat-timeout-ms", "3000"});
  const std::vector<std::string> model = {"--tensor-bytes", "10000000", "--tensors", "4"};
  Process& trainer = worker({server}, "trainer", model, {"publish:1", "wait-line", "list", "unpublish", "list"});
  expect(trainer, "publish ok 1");
  std::vector<std::string> slow = model;
  slow.insert(slow.end(), {"--read-rate", "4000000", "--report-source"});  // 10 s for 40 MB
  Process& reader = worker({server}, "reader", slow, {"replicate:latest"});
  expect(reader, "source trainer");
  std::this_thread::sleep_for(std::chrono::milliseconds(800));
  ASSERT_EQ(::kill(reader.pid(), SIGSTOP), 0);
  // The reader is evicted ~3 s later and the trainer told to stop serving it: the revoke must not
  // wait for the stopped reader.
  std::this_thread::sleep_for(std::chrono::milliseconds(7000));
  trainer.send_line("go");
  EXPECT_EQ(expect(trainer, "list ").substr(0, 13), "list latest=1");
  EXPECT_EQ(expect(trainer, "unpublish "), "unpublish ok");
  EXPECT_EQ(expect(trainer, "list ").substr(0, 13), "list latest=1") << "the trainer was evicted";
  ::kill(reader.pid(), SIGCONT);
}

// Item 12: a source that hangs (SIGSTOP) held its reader for the whole I/O timeout (~30 s) after
// the server had evicted it and named another source.
TEST_F(Security, AReaderLetsGoOfAHungSourceAsSoonAsTheServerReplacesIt) {
  const std::string server = start_server({"--heartbeat-timeout-ms", "3000"});
  const std::vector<std::string> model = {"--tensor-bytes", "10000000", "--tensors", "4"};
  Process& trainer = worker({server}, "trainer", model, {"publish:1", "wait-line"});
  expect(trainer, "publish ok 1");
  Process& holder = worker({server}, "holder", model, {"replicate:latest", "wait-line"});
  expect(holder, "replicate ok 1");
  std::vector<std::string> slow = model;
  slow.insert(slow.end(), {"--read-rate", "8000000", "--report-source"});  // 5 s for 40 MB
  Process& reader = worker({server}, "reader", slow, {"replicate:latest", "verify"});
  const std::string source = expect(reader, "source ");
  Process& hung = source == "source trainer" ? trainer : holder;
  const std::string other = source == "source trainer" ? "holder" : "trainer";
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  ASSERT_EQ(::kill(hung.pid(), SIGSTOP), 0);
  // Evicted after 3 s, the reader moved to the other holder and reads the 40 MB again (5 s): well
  // within the step bound, where waiting out a 30 s I/O timeout is not.
  EXPECT_EQ(expect(reader, "replicate "), "replicate ok 1 from " + other);
  EXPECT_EQ(expect(reader, "verify "), "verify ok 1");
  ::kill(hung.pid(), SIGCONT);
}

// Item 12 with one holder: the typed error came in time (2.25 s), but the next version on the same
// handle took 33-35 s, the reader waiting out the hung source's I/O timeout first.
TEST_F(Security, AfterItsOnlySourceHungAReaderTakesTheNextVersionWithoutWaitingForIt) {
  const std::string server = start_server({"--heartbeat-timeout-ms", "3000"});
  const std::vector<std::string> model = {"--tensor-bytes", "10000000", "--tensors", "4"};
  Process& trainer = worker({server}, "trainer", model, {"publish:1", "wait-line"});
  expect(trainer, "publish ok 1");
  std::vector<std::string> slow = model;
  slow.insert(slow.end(), {"--read-rate", "8000000", "--report-source"});  // 5 s for 40 MB
  Process& reader = worker({server}, "reader", slow, {"replicate:latest", "wait-line", "replicate:latest", "verify"});
  EXPECT_EQ(expect(reader, "source "), "source trainer");
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  ASSERT_EQ(::kill(trainer.pid(), SIGSTOP), 0);
  // The only copy's holder is evicted after 3 s: the read fails with a typed error.
  EXPECT_EQ(expect(reader, "replicate ").rfind("replicate error ", 0), 0u);
  Process& next = worker({server}, "trainer-2", model, {"publish:2", "wait-line"});
  expect(next, "publish ok 2");
  const auto asked = std::chrono::steady_clock::now();
  reader.send_line("");
  // 40 MB at 8 MB/s: 5 s. Within the step bound (15 s), where the old wait (~30 s) is not.
  EXPECT_EQ(expect(reader, "replicate "), "replicate ok 2 from trainer-2");
  EXPECT_EQ(expect(reader, "verify "), "verify ok 2");
  std::cout << "the next version took "
            << std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - asked).count()
            << " ms\n";
  ::kill(trainer.pid(), SIGCONT);
}

// Item 13: register_tensor from a second thread while publish() ran was accepted, and the
// published version became unreadable. Every call made while another runs gets a typed error.
TEST_F(Security, ACallWhileAnotherRunsOnTheHandleIsRefused) {
  const std::string server = start_server();
  ClientOptions options;
  options.servers = {server};
  options.token = kToken;
  options.model = "m";
  options.replica = "trainer";
  auto opened = Handle::open(options);
  ASSERT_TRUE(opened.ok()) << opened.error().detail;
  std::unique_ptr<Handle> handle = std::move(opened).value();
  std::vector<std::byte> weights(512u << 20, std::byte{7});  // publish hashes it: a while
  ASSERT_TRUE(handle->register_tensor("t1", weights.data(), weights.size(), DType::kUInt8).ok());
  auto busy = [](const Status& status) {
    return !status.ok() && status.error().detail.find("another call is in flight") != std::string::npos;
  };
  std::atomic<bool> published{false};
  std::vector<std::byte> extra(64);
  int calls_during = 0;
  int accepted = 0;
  std::thread meddler([&] {
    // Harmless probes until publish() is seen running (a probe that gets in changes nothing) ...
    while (!published.load() && !busy(handle->unregister_tensor("no-such-tensor"))) std::this_thread::yield();
    // ... then what used to corrupt the published version, in each of the three ways to register.
    for (int i = 0; !published.load(); ++i) {
      const std::string name = "extra-" + std::to_string(i);
      const Status status =
          i % 3 == 0   ? handle->register_tensor(name, extra.data(), extra.size(), DType::kUInt8)
          : i % 3 == 1 ? handle->register_tensor(name, extra.data(), DType::kUInt8, {extra.size()})
                       : handle->register_piece(name, extra.data(), DType::kUInt8, {extra.size()}, Box{{0}, {extra.size()}});
      ++calls_during;
      if (status.ok()) ++accepted;
    }
  });
  Result<Version> version = make_error(Errc::kInvalidArgument, "");
  do {
    version = handle->publish(1);  // (refused while a probe holds the handle: again)
  } while (!version.ok() && version.error().detail.find("another call is in flight") != std::string::npos);
  published.store(true);
  meddler.join();
  ASSERT_TRUE(version.ok()) << version.error().detail;
  EXPECT_GT(calls_during, 0);
  EXPECT_EQ(accepted, 0) << "a tensor was registered while publish ran";
  // The version is readable with the layout it was published with.
  Process& rollout = worker({server}, "rollout", {"--model", "m", "--tensor-bytes", std::to_string(weights.size()),
                                                  "--tensors", "1", "--small-tensors", "0"},
                            {"replicate:latest"});
  EXPECT_EQ(expect(rollout, "replicate ").substr(0, 14), "replicate ok 1");
}

// Item 9: a hung server (SIGSTOP) keeps its TCP connections open, so nothing failed over: a
// client's list() was still blocked 45 s later. Now a server that answers nothing for twice its
// heartbeat timeout is dropped and the clients move to the backup, as if it had died.
TEST_F(Security, AHungServerIsFailedOverWithinItsBound) {
  const std::string primary = start_server({"--heartbeat-timeout-ms", "2000"});
  const std::string backup = start_server({"--heartbeat-timeout-ms", "2000"});
  Process& trainer = worker({primary, backup}, "trainer", {}, {"publish:1", "wait-line", "list", "unpublish", "publish:2", "wait-line"});
  expect(trainer, "publish ok 1");
  Process& rollout = worker({primary, backup}, "rollout", {}, {"replicate:latest", "wait-line", "update:latest", "verify"});
  expect(rollout, "replicate ok 1");
  ASSERT_EQ(::kill(servers_[0]->pid(), SIGSTOP), 0);
  trainer.send_line("go");
  // Detected after 4 s of silence (twice the heartbeat timeout), then the backup's failover barrier:
  // within the step bound, where a stopped server used to hold every call for ever.
  EXPECT_EQ(expect(trainer, "list ").substr(0, 13), "list latest=1");
  expect(trainer, "unpublish ok");
  expect(trainer, "publish ok 2");
  rollout.send_line("go");
  EXPECT_EQ(expect(rollout, "update "), "update updated 2 from trainer");
  EXPECT_EQ(expect(rollout, "verify "), "verify ok 2");
  ::kill(servers_[0]->pid(), SIGCONT);
}

// Item 2: every reader connection left a thread stack mapped until the data server was destroyed
// (3,000 connections: VmSize 80 MB -> 24.9 GB; 34,000 aborted the trainer).
TEST_F(Security, ReaderConnectionsLeaveNoThreadsBehindInTheSource) {
  constexpr int kConnections = 3000;
  constexpr long kVmGrowthMaxKb = 256 * 1024;  // the leak grew it by ~8 MiB per connection
  constexpr long kThreadsGrowthMax = 4;
  const std::string server = start_server();
  Process& trainer = worker({server}, "trainer", {}, {"publish:1", "wait-line"});
  const net::Endpoint data = net::parse_endpoint(expect(trainer, "open ok ").substr(std::string("open ok ").size()));
  expect(trainer, "publish ok 1");
  const long vm_before_kb = status_field(trainer.pid(), "VmSize");
  const long threads_before = status_field(trainer.pid(), "Threads");
  const char garbage[64] = "GET / HTTP/1.0\r\n\r\n";
  for (int i = 0; i < kConnections; ++i) {
    std::vector<net::Fd> one;
    one.push_back(net::connect_tcp(data, 5000));
    net::send_all(one[0], garbage, sizeof garbage);
    EXPECT_EQ(open_after(one), 0u) << "connection " << i;
  }
  Process& rollout = worker({server}, "rollout", {}, {"replicate:latest", "verify"});
  EXPECT_EQ(expect(rollout, "verify "), "verify ok 1");
  const long vm_after_kb = status_field(trainer.pid(), "VmSize");
  EXPECT_LT(vm_after_kb - vm_before_kb, kVmGrowthMaxKb) << vm_before_kb << " kB -> " << vm_after_kb << " kB";
  EXPECT_LE(status_field(trainer.pid(), "Threads"), threads_before + kThreadsGrowthMax);
}

// Items 4 and 8: a grant used to be (transfer, epoch), counted from 1: any host that reached a data
// port read a live trainer's weights with (5, 1); and 256 silent connections to a data port made
// legitimate reads fail for 31 s.
TEST_F(Security, ADataPortServesOnlyGrantHoldersAndOutlastsSilentConnections) {
  constexpr int kSilent = 300;  // more than the data server's connection slots (256)
  const std::string server = start_server();
  Process& trainer = worker({server}, "trainer", {}, {"publish:1", "wait-line"});
  const net::Endpoint data = net::parse_endpoint(expect(trainer, "open ok ").substr(std::string("open ok ").size()));
  expect(trainer, "publish ok 1");
  std::vector<net::Fd> silent;
  for (int i = 0; i < kSilent; ++i) silent.push_back(net::connect_tcp(data, 5000));
  // A slow rollout keeps a grant alive while the thief guesses keys without its secret.
  Process& rollout = worker({server}, "rollout", {"--read-rate", "2000000", "--report-source"}, {"replicate:latest", "verify"});
  expect(rollout, "source trainer");
  std::vector<std::byte> stolen(1 << 16);
  const net::LocalRegion target{stolen.data(), stolen.size()};
  net::PullOptions quick;
  quick.connect_timeout_ms = 2000;
  quick.io_timeout_ms = 5000;
  // (Each guess of a grant the source has not heard of waits 2 s for it: a few guesses.)
  for (TransferId transfer = 1; transfer <= 2; ++transfer) {
    for (std::uint32_t epoch = 1; epoch <= 2; ++epoch) {
      const net::PullOutcome theft = net::pull(data, {transfer, epoch}, GrantSecret{transfer, epoch}, {&target, 1}, quick);
      EXPECT_FALSE(theft.ok()) << "read (" << transfer << ", " << epoch << ") without the grant's secret";
      EXPECT_EQ(theft.bytes, 0u);
    }
  }
  EXPECT_EQ(expect(rollout, "replicate ").substr(0, 14), "replicate ok 1");
  EXPECT_EQ(expect(rollout, "verify "), "verify ok 1");
}

// Review find (fragile ordering): messages are limited to 64 KiB before authentication, and a
// client sends its calls right behind connect, in the same flight. A trainer that fails over
// re-opens with what it holds (its layout and checksums: over 64 KiB for thousands of tensors);
// that message must pass.
TEST_F(Security, AResumeWithALargeLayoutPassesThePreAuthenticationLimit) {
  // Registering 5,000 tensors takes a starved CI machine seconds (the RDMA guest shares its two
  // cores): heartbeats are not what this test is about, so the timeout is generous.
  const std::string primary = start_server({"--heartbeat-timeout-ms", "15000"});
  const std::string backup = start_server({"--heartbeat-timeout-ms", "15000"});
  const std::vector<std::string> model = {"--tensors", "1", "--small-tensors", "4000"};
  Process& trainer = worker({primary, backup}, "trainer", model, {"publish:1", "wait-line", "list", "wait-line"});
  expect(trainer, "publish ok 1");
  servers_[0]->kill9();
  trainer.send_line("go");
  EXPECT_EQ(expect(trainer, "list ").substr(0, 13), "list latest=1");
  Process& rollout = worker({backup}, "rollout", model, {"replicate:latest", "verify"});
  EXPECT_EQ(expect(rollout, "replicate "), "replicate ok 1 from trainer");
  EXPECT_EQ(expect(rollout, "verify "), "verify ok 1");
}

// Item 7's other half: heartbeat datagrams used to carry the connection's secret in clear text, so
// whoever saw one could beat for that client for ever (TLS on the control connection could not
// help). Now they are sealed with a key that travels only on the control connection, and each
// count is taken once.
TEST_F(Security, HeartbeatDatagramsCannotBeForgedOrReplayed) {
  const std::string server = start_server();
  RpcClient client(io(), server);
  ASSERT_EQ(client.connect(kToken, 77, secret_of('a')), "");
  ASSERT_NE(client.heartbeat_port(), 0);
  ASSERT_TRUE(client.heartbeat_key().has_value());
  const net::HeartbeatKey key = *client.heartbeat_key();
  net::HeartbeatSender sender(net::Endpoint{"127.0.0.1", client.heartbeat_port()});
  const net::HeartbeatDatagram beat = net::seal(77, 0, 1, key);
  ASSERT_TRUE(sender.send(beat));                                                  // taken
  ASSERT_TRUE(sender.send(beat));                                                  // a replay
  ASSERT_TRUE(sender.send(net::seal(77, 0, 2, net::HeartbeatKey{key[0], key[1] ^ 1})));  // a guessed key
  RpcClient other(io(), server);  // a second client, with a key of its own
  ASSERT_EQ(other.connect(kToken, 78, secret_of('b')), "");
  net::HeartbeatDatagram moved = net::seal(77, 0, 3, key);
  moved.client = 78;                                                               // for the other client
  ASSERT_TRUE(sender.send(moved));
  ASSERT_TRUE(sender.send(net::seal(77, 0, 4, key)));                              // taken
  // th-ctl shows the server's counts; datagrams on loopback arrive, but not at once.
  std::string counts;
  for (int attempt = 0; attempt < 50; ++attempt) {
    const std::string listing = ctl(server);
    counts = listing.substr(listing.find("heartbeats: "), listing.find(" as calls") - listing.find("heartbeats: "));
    if (counts.find("heartbeats: 2 as datagrams (3 refused)") == 0) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  EXPECT_EQ(counts.rfind("heartbeats: 2 as datagrams (3 refused)", 0), 0u) << counts;
}

// Item 10: 180 K forged datagrams a second cost th-server 35 % of a core, all of it spent reading
// what it then refused. Now it reads at most its budget a second and leaves the rest to the kernel;
// the clients whose datagrams are lost in the flood stay alive by their probes and beat by calls.
TEST_F(Security, AUdpFloodNeitherTakesTheServersCpuNorEvictsItsClients) {
  constexpr std::uint64_t kBudgetPerS = 2000;
  constexpr int kFloodSeconds = 8;  // more than twice the heartbeat timeout (3 s)
  const std::string server = start_server({"--heartbeat-datagrams-per-s-max", std::to_string(kBudgetPerS)});
  const int pid = servers_[0]->pid();
  Process& trainer = worker({server}, "trainer", {}, {"publish:1", "wait-line", "list"});
  const std::string client = expect(trainer, "client ").substr(7);
  expect(trainer, "publish ok 1");
  auto cpu_seconds = [pid] {
    std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
    std::string field;
    long ticks = 0;
    for (int i = 1; i <= 15 && stat >> field; ++i) {
      if (i == 14 || i == 15) ticks += std::stol(field);  // utime, stime
    }
    return static_cast<double>(ticks) / static_cast<double>(::sysconf(_SC_CLK_TCK));
  };
  // Until the server hears the trainer's datagrams and the trainer stops beating by calls: then
  // its liveness hangs on datagrams the flood drowns.
  std::this_thread::sleep_for(std::chrono::milliseconds(2500));
  const double cpu_before_s = cpu_seconds();
  // Forged datagrams for the trainer's own id: each one is looked up and its MAC checked.
  Process& flood = spawn({TH_FLOOD_PATH, "--to", server, "--seconds", std::to_string(kFloodSeconds), "--client", client},
                         "flood");
  std::this_thread::sleep_for(std::chrono::seconds(kFloodSeconds / 2));
  Process& rollout = worker({server}, "rollout", {}, {"update:latest", "verify"});
  expect(rollout, "update updated 1");
  expect(rollout, "verify ok 1");
  ASSERT_EQ(flood.wait_exit(kHangGuardMs), 0) << flood.describe();
  const double cpu_used_s = cpu_seconds() - cpu_before_s;
  flood.read_available();
  const std::string last = flood.lines().empty() ? "" : flood.lines().back();
  ASSERT_EQ(last.rfind("flood sent ", 0), 0u) << flood.describe();
  const std::uint64_t sent = std::stoull(last.substr(11));

  ASSERT_TRUE(running(*servers_[0]));
  trainer.send_line("");
  EXPECT_EQ(expect(trainer, "list ").substr(0, 13), "list latest=1") << "the trainer was evicted in the flood";
  const std::string listing = ctl(server);
  EXPECT_NE(listing.find(" 0 evictions"), std::string::npos) << listing;
  // What the server read: at most its budget a second (one second's burst included).
  const std::size_t up_at = listing.find(": up ");
  const std::uint64_t uptime_s = std::stoull(listing.substr(up_at + 5));
  const std::size_t counts_at = listing.find("heartbeats: ");
  const std::uint64_t accepted = std::stoull(listing.substr(counts_at + 12));
  const std::uint64_t refused = std::stoull(listing.substr(listing.find('(', counts_at) + 1));
  EXPECT_LE(accepted + refused, kBudgetPerS * (uptime_s + 2)) << listing;
  EXPECT_GE(sent, 10 * (accepted + refused)) << "the flood did not exceed the budget: this test proves nothing";
  // A resource bound, not a speed claim: reading all of it took 2.4 s of CPU for 5 s of flood here
  // (b41472f: 35 % of a core); what the budget lets through costs a small fraction of that.
  EXPECT_LT(cpu_used_s, 0.25 * kFloodSeconds) << sent << " datagrams sent";
  std::cout << "flood: " << sent << " datagrams in " << kFloodSeconds << " s; th-server read " << accepted + refused
            << " and used " << cpu_used_s << " s of CPU\n";
}

// Item 10's other half: under a flood the server leaves datagrams unread, the client's with the
// rest. A client that beats by datagram sends nothing else while idle but a probe now and then
// (an empty Session.send); the server counts the probe as a heartbeat, so that the client is not
// evicted before the probe's reply tells it to beat by calls again.
TEST_F(Security, AQuietClientsProbesKeepItAliveWhenItsDatagramsAreLost) {
  const std::string server = start_server();  // heartbeat timeout 3 s
  RpcClient quiet(io(), server);
  ASSERT_EQ(quiet.connect(kToken, 91, secret_of('q')), "");
  OpenRequest open;
  open.model = "m";
  open.replica = "quiet";
  open.incarnation = 1;
  open.datacenter = "dc";
  open.data_endpoint = "127.0.0.1:1";
  ASSERT_EQ(quiet.send({net::ToHubMessage{Request{91, 0, open, 1}}}), "");
  // Twice the heartbeat timeout with probes only, every half timeout (as libthclient does).
  for (int probe = 0; probe < 4; ++probe) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1500));
    ASSERT_EQ(quiet.send({}), "");
  }
  std::string listing = ctl(server);
  EXPECT_NE(listing.find(" 0 evictions"), std::string::npos) << listing;
  EXPECT_NE(listing.find("quiet"), std::string::npos) << listing;
  // Without them it is evicted in its time, which shows the probes are what kept it.
  std::this_thread::sleep_for(std::chrono::seconds(5));
  listing = ctl(server);
  EXPECT_NE(listing.find(" 1 evictions"), std::string::npos) << listing;
}

// The effects backlog: a peer that never answers Sink.deliver made the server keep every effect
// for it, without bound. Past --effects-backlog-max undelivered effects it is disconnected, and
// everyone else is served on.
TEST_F(Security, AConnectionThatTakesNoDeliveriesIsClosedWhenItFallsTooFarBehind) {
  constexpr int kBacklogMax = 100;
  const std::string server = start_server({"--effects-backlog-max", std::to_string(kBacklogMax)});
  RpcClient stuck(io(), server);
  ASSERT_EQ(stuck.connect(kToken, 93, secret_of('s'), "stuck", /*answers_deliveries=*/false), "");
  // A client that never opened: every report it sends is answered "unknown client, re-open" (an
  // effect). 8 deliveries go out and hang; the rest wait in the backlog.
  const std::vector<net::ToHubMessage> reports(64, net::ToHubMessage{Report{93, Heartbeat{}, 0}});
  std::string refused;
  int sends = 0;
  for (; sends < 100 && refused.empty(); ++sends) refused = stuck.send(reports);
  EXPECT_FALSE(refused.empty()) << "100 sends of 64 effects each were all taken: the backlog is not bounded";
  EXPECT_LE(sends, (8 * 64 + kBacklogMax) / 64 + 3) << "disconnected later than the cap allows";
  EXPECT_TRUE(server_log_says(*servers_[0], "effects behind: disconnecting it", kHangGuardMs)) << server_log(*servers_[0]);
  ASSERT_TRUE(running(*servers_[0]));
  Process& trainer = worker({server}, "trainer", {}, {"publish:1"});
  expect(trainer, "publish ok 1");
}

}  // namespace
}  // namespace th::e2e
