// A server that runs for months among token holders (issue 32): what any holder of the cluster
// token can do to th-server's memory and to the other clients, against real processes on loopback
// (label security). Each test is one finding, with the figure before the fix in its comment.
#include <capnp/rpc.capnp.h>
#include <capnp/serialize.h>
#include <poll.h>
#include <unistd.h>
#include <sys/socket.h>

#include <cerrno>
#include <fstream>
#include <chrono>
#include <iostream>
#include <iterator>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "security_fixture.h"
#include "net/socket.h"
#include "net/tensorhub.capnp.h"
#include "net/token.h"
#include "tensorhub/client.h"

namespace th::e2e {
namespace {

// One Cap'n Proto RPC message, framed as on the wire.
kj::Array<capnp::word> framed(capnp::MallocMessageBuilder& message) { return capnp::messageToFlatArray(message); }

// The RPC messages of the attacks, framed: the bootstrap (question 0), Hub.inspect with the token
// on its promised answer, and the Finish of a question.
kj::Array<capnp::word> bootstrap_message() {
  capnp::MallocMessageBuilder message;
  message.initRoot<capnp::rpc::Message>().initBootstrap().setQuestionId(0);
  return framed(message);
}

kj::Array<capnp::word> inspect_call(std::uint32_t question) {
  capnp::MallocMessageBuilder message;
  auto call = message.initRoot<capnp::rpc::Message>().initCall();
  call.setQuestionId(question);
  call.initTarget().initPromisedAnswer().setQuestionId(0);
  call.setInterfaceId(capnp::typeId<wire::Hub>());
  call.setMethodId(1);  // inspect @1
  call.initParams().getContent().initAs<wire::Hub::InspectParams>().setToken(kToken);
  return framed(message);
}

kj::Array<capnp::word> finish_message(std::uint32_t question) {
  capnp::MallocMessageBuilder message;
  message.initRoot<capnp::rpc::Message>().initFinish().setQuestionId(question);
  return framed(message);
}

// Sends `bytes` without blocking for longer than `stall_ms` at a time; returns how many the kernel
// took before the peer stopped reading (all of them if it never did).
std::size_t send_until_stalled(const net::Fd& socket, const std::vector<kj::byte>& bytes, int stall_ms) {
  std::size_t sent = 0;
  while (sent < bytes.size()) {
    const ssize_t took = ::send(socket.get(), bytes.data() + sent, bytes.size() - sent, MSG_DONTWAIT | MSG_NOSIGNAL);
    if (took > 0) {
      sent += static_cast<std::size_t>(took);
      continue;
    }
    if (took < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) break;
    pollfd writable{socket.get(), POLLOUT, 0};
    if (::poll(&writable, 1, stall_ms) == 0) break;  // nothing drained for stall_ms: it stopped reading
  }
  return sent;
}

// Whether the peer closes (or resets) `socket` within `guard_ms`, watched without reading from it.
bool closed_by_peer_without_reading(const net::Fd& socket, int guard_ms) {
  pollfd hangup{socket.get(), POLLRDHUP, 0};
  return ::poll(&hangup, 1, guard_ms) > 0 && (hangup.revents & (POLLRDHUP | POLLHUP | POLLERR)) != 0;
}

// Finding 3: one RPC connection sending 200,000 pipelined `inspect` calls and never reading took
// th-server to 1.78 GB (about 8.8 KB per unread answer, linear, no cap), never given back. Now the
// server stops reading a connection while more than --rpc-answers-bytes-max of its answers wait,
// and the idle timeout closes it.
TEST_F(Security, ACallerThatNeverReadsItsAnswersHoldsABoundedShareOfTheServer) {
  constexpr std::uint32_t kCalls = 200'000;
  constexpr long kGrowthMaxKb = 64 * 1024;  // 1 MiB of answers + the kernel's buffers + slack
  const std::string server =
      start_server({"--heartbeat-timeout-ms", "1000", "--idle-timeout-ms", "4000", "--log-level", "info"});
  // A model, so that each answer carries its snapshot (as in a real deployment).
  Process& trainer = worker({server}, "trainer", {}, {"publish:1"});
  expect(trainer, "publish ok 1");
  const int pid = servers_[0]->pid();
  const long before_kb = status_field(pid, "VmRSS");

  // Bootstrap (question 0), then calls on its promised answer: Hub.inspect with the token.
  std::vector<kj::byte> bytes;
  auto append = [&bytes](const kj::Array<capnp::word>& words) {
    const auto view = words.asBytes();
    bytes.insert(bytes.end(), view.begin(), view.end());
  };
  append(bootstrap_message());
  for (std::uint32_t question = 1; question <= kCalls; ++question) {
    append(inspect_call(question));
    // Each call finished at once (so that no answer is kept for a later Finish: that is the next
    // test's attack); its Return is still owed.
    append(finish_message(question));
  }
  net::Fd attacker = net::connect_tcp(net::parse_endpoint(server), 5000);
  const std::size_t sent = send_until_stalled(attacker, bytes, 3000);
  const long during_kb = status_field(pid, "VmRSS");
  std::cout << "pipelined " << kCalls << " inspect calls (" << bytes.size() << " bytes); the server took "
            << sent << " bytes before it stopped reading; VmRSS " << before_kb << " kB -> " << during_kb << " kB\n";
  EXPECT_LT(sent, bytes.size()) << "the server read every call while none of the answers was read";
  EXPECT_LT(during_kb - before_kb, kGrowthMaxKb) << "VmRSS " << before_kb << " kB -> " << during_kb << " kB";
  // Everyone else is served meanwhile.
  EXPECT_NE(ctl(server).find("th-server "), std::string::npos);
  // The idle timeout closes the connection (watched without reading, which would let it go on),
  // and the log says why.
  EXPECT_TRUE(closed_by_peer_without_reading(attacker, kHangGuardMs)) << "a connection that never reads its answers is kept";
  EXPECT_TRUE(server_log_says(*servers_[0], "has not read its answers", kHangGuardMs)) << server_log(*servers_[0]);
  ASSERT_TRUE(running(*servers_[0]));
}

// The same attack by a caller that does read its answers but never finishes its calls (Cap'n
// Proto's Finish): each answer stays in the RPC system's table until then. Past 4,096 open calls
// the connection is closed.
TEST_F(Security, ACallerThatNeverFinishesItsCallsIsClosed) {
  constexpr std::uint32_t kCalls = 20'000;
  const std::string server = start_server({"--log-level", "info"});
  const int pid = servers_[0]->pid();
  const long before_kb = status_field(pid, "VmRSS");
  net::Fd attacker = net::connect_tcp(net::parse_endpoint(server), 5000);
  auto send = [&attacker](const kj::Array<capnp::word>& words) {
    net::send_all(attacker, words.asBytes().begin(), words.asBytes().size());
  };
  send(bootstrap_message());
  bool closed = false;
  std::uint32_t question = 1;
  for (; question <= kCalls && !closed; ++question) {
    try {
      send(inspect_call(question));
    } catch (const net::SocketError&) {
      closed = true;
      break;
    }
    // Read every answer there is (so the unread-answers cap never holds the connection).
    char drained[65536];
    ssize_t got = 0;
    while ((got = ::recv(attacker.get(), drained, sizeof drained, MSG_DONTWAIT)) > 0) {
    }
    if (got == 0) closed = true;
  }
  if (!closed) closed = closed_by_peer_without_reading(attacker, kHangGuardMs);
  EXPECT_TRUE(closed) << "a connection that left " << question - 1 << " calls open is kept";
  const long after_kb = status_field(pid, "VmRSS");
  EXPECT_LT(after_kb - before_kb, 64 * 1024) << "VmRSS " << before_kb << " kB -> " << after_kb << " kB";
  EXPECT_TRUE(server_log_says(*servers_[0], "calls open: no Cap'n Proto Finish", kHangGuardMs)) << server_log(*servers_[0]);
  EXPECT_NE(ctl(server).find("th-server "), std::string::npos);
}

// Finding 6: a 1 MiB token made open() retry for 10 s and end `unavailable` (the server resets a
// first message over the limit for connections that have not authenticated) instead of saying what
// is wrong. Now the client refuses it at once, and th-server refuses such a token file.
TEST_F(Security, ATokenTooLongToPresentIsRefusedAsSuchNotRetried) {
  const std::string server = start_server();
  ClientOptions options;
  options.servers = {server};
  options.token = std::string(1 << 20, 't');
  options.model = "m";
  options.replica = "r";
  auto opened = Handle::open(options);
  ASSERT_FALSE(opened.ok());
  EXPECT_EQ(opened.error().code, Errc::kInvalidArgument) << opened.error().detail;
  EXPECT_NE(opened.error().detail.find("at most " + std::to_string(net::kTokenBytesMax)), std::string::npos)
      << opened.error().detail;
  options.token = std::string(net::kTokenBytesMax, 't');  // the longest: refused by the server as wrong, not reset
  opened = Handle::open(options);
  ASSERT_FALSE(opened.ok());
  EXPECT_EQ(opened.error().code, Errc::kPermissionDenied) << opened.error().detail;

  std::ofstream(dir_ / "long-token") << std::string(net::kTokenBytesMax + 1, 't') << "\n";
  Process& refused = spawn({TH_SERVER_PATH, "--listen", "127.0.0.1:0", "--token-file", (dir_ / "long-token").string()},
                           "server-long-token");
  EXPECT_EQ(refused.wait_exit(kStepMs), 2) << refused.describe();
  std::stringstream said;
  said << std::ifstream(refused.log_path()).rdbuf();
  EXPECT_NE(said.str().find("token 1 of"), std::string::npos) << said.str();
}

// Seconds of CPU that thread `tid` of process `pid` has used (utime + stime).
double thread_cpu_seconds(int pid, int tid) {
  std::ifstream stat("/proc/" + std::to_string(pid) + "/task/" + std::to_string(tid) + "/stat");
  std::string text((std::istreambuf_iterator<char>(stat)), std::istreambuf_iterator<char>());
  // The command may hold blanks: fields are counted from the ')' that ends it (field 2).
  std::istringstream fields(text.substr(text.rfind(')') + 2));
  std::string field;
  long ticks = 0;
  for (int i = 3; i <= 15 && fields >> field; ++i) {
    if (i == 14 || i == 15) ticks += std::stol(field);
  }
  return static_cast<double>(ticks) / static_cast<double>(::sysconf(_SC_CLK_TCK));
}

// Finding 6: 25-31 k connections a second to the metrics port cost th-server's one loop 75 % of a
// core (scrapes and th-ctl were still answered). The endpoint now has a thread of its own; the
// loop only renders scrapes, at most 20 a second.
TEST_F(Security, AConnectionFloodOnTheMetricsPortCostsTheControlLoopLittle) {
  constexpr int kFloodSeconds = 4;
  const std::string server = start_server({"--metrics-listen", "127.0.0.1:0", "--log-level", "info"});
  const std::string line = servers_[0]->wait_for("th-server metrics on ", kStepMs);
  ASSERT_FALSE(line.empty()) << servers_[0]->describe();
  const std::string metrics = line.substr(std::string("th-server metrics on ").size());
  const int pid = servers_[0]->pid();
  const double loop_before_s = thread_cpu_seconds(pid, pid);  // the main thread runs the loop

  std::uint64_t connections = 0;
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(kFloodSeconds);
  const std::string request = "GET /metrics HTTP/1.1\r\nHost: flood\r\n\r\n";
  while (std::chrono::steady_clock::now() < until) {
    net::Fd flood = net::connect_tcp(net::parse_endpoint(metrics), 5000);
    net::send_all(flood, request.data(), request.size());
    ++connections;
  }
  const double loop_used_s = thread_cpu_seconds(pid, pid) - loop_before_s;
  std::cout << "metrics flood: " << connections << " connections in " << kFloodSeconds
            << " s; th-server's loop used " << loop_used_s << " s of CPU\n";
  EXPECT_GE(connections, 500u * kFloodSeconds) << "no flood: this test proves nothing";
  // A resource bound, not a speed claim: the flood cost the loop 3 s of CPU in 4 s when it was the
  // endpoint's; 20 renders a second cost it a small fraction of that.
  EXPECT_LT(loop_used_s, 0.25 * kFloodSeconds);
  EXPECT_NE(ctl(server).find("th-server "), std::string::npos);
  net::Fd scraper = net::connect_tcp(net::parse_endpoint(metrics), 5000);
  net::set_io_timeout(scraper, kHangGuardMs);
  net::send_all(scraper, request.data(), request.size());
  std::string head;
  char byte = 0;
  while (head.find("\r\n\r\n") == std::string::npos && net::recv_all_or_eof(scraper, &byte, 1)) head += byte;
  EXPECT_EQ(head.substr(0, head.find("\r\n")), "HTTP/1.1 200 OK") << head;
}

// Finding 5: `publish(5); unpublish(); publish(3)` was accepted, and `replicate("latest")` then
// failed with "no copy of version 5 is left" while 3 was live; one publish(2^64-1) made every
// later publish of the model stale for ever.
TEST_F(Security, VersionsIncreaseWithinAModelsLifeAndLatestNamesAVersionACopyIsLeftOf) {
  const std::string server = start_server({"--log-level", "info"});
  Process& trainer = worker({server}, "trainer", {},
                            {"publish:5", "unpublish", "publish:3", "publish:18446744073709551615", "publish:6",
                             "wait-line", "unpublish", "publish:7", "unpublish", "wait-line"});
  expect(trainer, "publish ok 5");
  EXPECT_EQ(expect(trainer, "unpublish "), "unpublish ok");
  const std::string stale = expect(trainer, "publish ");
  EXPECT_EQ(stale.rfind("publish error stale-version", 0), 0u) << stale;
  EXPECT_NE(stale.find("versions increase within a model's life"), std::string::npos) << stale;
  const std::string top = expect(trainer, "publish ");
  EXPECT_EQ(top.rfind("publish error invalid-argument", 0), 0u) << top;
  expect(trainer, "publish ok 6");
  Process& holder = worker({server}, "holder", {}, {"replicate:latest", "verify", "wait-line"});
  expect(holder, "replicate ok 6");
  expect(holder, "verify ok 6");
  trainer.send_line("go");  // unpublish 6, publish 7, unpublish 7: nobody holds 7
  EXPECT_EQ(expect(trainer, "unpublish "), "unpublish ok");
  expect(trainer, "publish ok 7");
  EXPECT_EQ(expect(trainer, "unpublish "), "unpublish ok");
  Process& late = worker({server}, "late", {}, {"list", "replicate:latest", "verify"});
  EXPECT_EQ(expect(late, "list ").substr(0, 13), "list latest=7");
  EXPECT_EQ(expect(late, "replicate "), "replicate ok 6 from holder");
  expect(late, "verify ok 6");
}

// Finding 4 (a legitimate reader capped at 2 KB/s kept its trainer's unpublish() waiting until
// the reader was killed: 60 s, over 190 s in another run) is EndToEnd.
// ASlowReaderHoldsUnpublishOnlyUntilTheDrainGrace (tests/e2e/e2e_test.cpp), which the RDMA guest
// runs over verbs too.

// Finding 1: 64 short-lived replicas, each on its own model, left 64 empty models behind and every
// later open of a new model failed with `limit-exceeded` for ever; a model's shard count was fixed
// by its first open for ever. A model with no replica now ends after --model-grace-ms.
TEST_F(Security, SixtyFourShortLivedModelsEndAndTheirNamesAreFreeAgain) {
  const std::string server = start_server({"--model-grace-ms", "1000", "--log-level", "info"});
  for (int batch = 0; batch < 8; ++batch) {
    std::vector<Process*> workers;
    for (int i = 0; i < 8; ++i) {
      const std::string name = "m" + std::to_string(batch * 8 + i);
      workers.push_back(&worker({server}, "t" + name, {"--model", name}, {"publish:1", "close"}));
    }
    for (Process* one : workers) EXPECT_EQ(expect(*one, "close "), "close ok");
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(1500));
  Process& next = worker({server}, "next", {"--model", "m-next"}, {"publish:1", "close"});
  expect(next, "publish ok 1");
  // The first model's name again, with another shard count, from version 1 (a restarted run).
  Process& shard0 = worker({server}, "again", {"--model", "m0", "--shards", "2", "--shard", "0"}, {"publish:1"});
  Process& shard1 = worker({server}, "again", {"--model", "m0", "--shards", "2", "--shard", "1"}, {"publish:1"});
  expect(shard0, "publish ok 1");
  expect(shard1, "publish ok 1");
}

// The body of a scrape of th-server's metrics endpoint at `address`.
std::string scrape(const std::string& address) {
  net::Fd scraper = net::connect_tcp(net::parse_endpoint(address), 5000);
  net::set_io_timeout(scraper, kHangGuardMs);
  const std::string request = "GET /metrics HTTP/1.1\r\nHost: test\r\nConnection: close\r\n\r\n";
  net::send_all(scraper, request.data(), request.size());
  std::string response;
  char byte = 0;
  while (net::recv_all_or_eof(scraper, &byte, 1)) response += byte;  // until the server closes
  const std::size_t body = response.find("\r\n\r\n");
  return body == std::string::npos ? "" : response.substr(body + 4);
}

// The value of an unlabelled sample in a scrape (-1 if absent).
double sample_of(const std::string& scrape_body, const std::string& family) {
  std::istringstream lines(scrape_body);
  for (std::string line; std::getline(lines, line);) {
    if (line.rfind(family + " ", 0) == 0) return std::stod(line.substr(family.size() + 1));
  }
  return -1;
}

// Finding 2: one 16-shard replica publishing 65,536 tensors a shard with 250-byte names took
// th-server from 8.8 to 369 MB in 6.5 s (a second model: 709 MB), and nothing was returned after
// every connection closed. Tensor descriptions are now counted per model and per server, refused
// past --model-description-bytes-max / --description-bytes-max, and freed when the model ends.
TEST_F(Security, TensorDescriptionsAreBoundedAndFreedWhenTheirModelEnds) {
  constexpr int kShards = 4;
  constexpr std::uint64_t kTensors = 65'536;
  constexpr std::uint64_t kNameBytes = 250;
  auto wide = [&](const std::string& server, int shard, const std::vector<std::string>& script) -> Process& {
    return worker({server}, "wide",
                  {"--tensors", "0", "--small-tensors", "0", "--tiny-tensors", std::to_string(kTensors), "--name-bytes",
                   std::to_string(kNameBytes), "--shards", std::to_string(kShards), "--shard", std::to_string(shard)},
                  script);
  };
  // Counted: 96 bytes a tensor besides its name (limits::kTensorDescriptionOverheadBytes), no
  // shape: 4 x 65,536 x 346 = 90.7 MB, over a 64 MiB limit.
  const std::uint64_t counted = kShards * kTensors * (96 + kNameBytes);
  const std::string bounded = start_server({"--model-description-bytes-max", "67108864", "--log-level", "info"});
  std::vector<Process*> refused;
  for (int shard = 0; shard < kShards; ++shard) refused.push_back(&wide(bounded, shard, {"publish:1"}));
  for (Process* shard : refused) {
    const std::string line = expect(*shard, "publish ");
    EXPECT_EQ(line.rfind("publish error limit-exceeded", 0), 0u) << line;
    EXPECT_NE(line.find("--model-description-bytes-max"), std::string::npos) << line;
  }

  // With room for them: kept while the model lives, given back when it ends.
  const std::string roomy =
      start_server({"--model-grace-ms", "1000", "--metrics-listen", "127.0.0.1:0", "--log-level", "info"});
  const std::string metrics_line = servers_[1]->wait_for("th-server metrics on ", kStepMs);
  ASSERT_FALSE(metrics_line.empty()) << servers_[1]->describe();
  const std::string metrics = metrics_line.substr(std::string("th-server metrics on ").size());
  const int pid = servers_[1]->pid();
  const long before_kb = status_field(pid, "VmRSS");
  std::vector<Process*> shards;
  for (int shard = 0; shard < kShards; ++shard) shards.push_back(&wide(roomy, shard, {"publish:1", "wait-line", "close"}));
  for (Process* shard : shards) expect(*shard, "publish ok 1");
  const long during_kb = status_field(pid, "VmRSS");
  EXPECT_EQ(sample_of(scrape(metrics), "th_server_description_bytes"), static_cast<double>(counted));
  for (Process* shard : shards) {
    shard->send_line("go");
    EXPECT_EQ(expect(*shard, "close "), "close ok");
  }
  std::string after;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(kHangGuardMs);
  while (sample_of(after = scrape(metrics), "th_server_models_ended_total") < 1 && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }
  EXPECT_EQ(sample_of(after, "th_server_models_ended_total"), 1);
  EXPECT_EQ(sample_of(after, "th_server_description_bytes"), 0);
  const long after_kb = status_field(pid, "VmRSS");
  std::cout << "tensor descriptions: " << kShards << " shards x " << kTensors << " tensors x " << kNameBytes
            << "-byte names counted " << counted << " bytes; th-server VmRSS " << before_kb << " kB -> " << during_kb
            << " kB while the model lived -> " << after_kb << " kB after it ended\n";
  // Freed, not only forgotten: most of what the descriptions took comes back (malloc_trim; frames
  // and buffers of the calls may stay). Before, all of it stayed.
  EXPECT_GT(during_kb - before_kb, 32 * 1024) << "the descriptions took little: this test proves nothing";
  EXPECT_LT(after_kb - before_kb, (during_kb - before_kb) / 2)
      << "VmRSS " << before_kb << " kB -> " << during_kb << " -> " << after_kb;
}

}  // namespace
}  // namespace th::e2e
