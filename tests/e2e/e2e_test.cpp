// End-to-end: th-server and th-e2e-worker processes on loopback, moving real bytes.
//
// Each worker is one shard (see worker.cpp for its script language). The tests stage a scenario,
// read the workers' lines and check the outcome; a worker's `verify` checks every byte against the
// version it claims to hold. Failures print every process's command, output and stderr.
#include <gtest/gtest.h>

#include <chrono>
#include <csignal>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "fixture.h"
#include "net/data_plane.h"
#include "net/heartbeat.h"
#include "process.h"

namespace th::e2e {
namespace {

class EndToEnd : public ProcessTest {};

TEST_F(EndToEnd, ReplicateIsBitExact) {
  const std::string server = start_server();
  Process& trainer = worker({server}, "trainer", {}, {"publish:1", "wait-line", "unpublish", "close"});
  expect(trainer, "publish ok 1");
  Process& rollout = worker({server}, "rollout", {}, {"replicate:latest", "verify", "close"});
  EXPECT_EQ(expect(rollout, "replicate "), "replicate ok 1 from trainer");
  EXPECT_EQ(expect(rollout, "verify "), "verify ok 1");
  expect(rollout, "close ok");
  trainer.send_line("go");
  expect(trainer, "unpublish ok");
  expect(trainer, "close ok");
  EXPECT_EQ(trainer.wait_exit(kStepMs), 0);
  EXPECT_EQ(rollout.wait_exit(kStepMs), 0);
}

TEST_F(EndToEnd, ReplicateOverSeveralStreamsIsBitExact) {
  const std::string server = start_server();
  Process& trainer = worker({server}, "trainer", {"--tensors", "6"}, {"publish:1", "wait-line"});
  expect(trainer, "publish ok 1");
  Process& rollout = worker({server}, "rollout", {"--tensors", "6", "--data-streams", "4"}, {"replicate:latest", "verify"});
  EXPECT_EQ(expect(rollout, "replicate "), "replicate ok 1 from trainer");
  EXPECT_EQ(expect(rollout, "verify "), "verify ok 1");
}

// Pipeline replication: the trainer serves one reader at a time (fan-out 1), so the second rollout
// reads from the first while the first is still receiving. (The first takes ~1.2 s, ~5 s in the
// RDMA guest: at 40 MB/s, a loaded machine let it finish before the second had opened.)
TEST_F(EndToEnd, PipelineReadsFromAPartialSource) {
  // Pipeline mechanics, not source choice: two alike readers, neither ever timed, may swap places
  // a sixteenth in (the first version's exploration, README "what happens underneath").
  const std::string server = start_server({"--no-rate-aware-sources"});
  Process& trainer = worker({server}, "trainer", {"--tensor-bytes", "8000000"}, {"publish:1", "wait-line"});
  expect(trainer, "publish ok 1");
  const std::vector<std::string> slow = {"--read-rate", read_rate(20000000), "--tensor-bytes", "8000000", "--report-source"};
  Process& first = worker({server}, "rollout-a", slow, {"replicate:latest", "verify"});
  EXPECT_EQ(expect(first, "source "), "source trainer");
  Process& second = worker({server}, "rollout-b", slow, {"replicate:latest", "verify"});
  EXPECT_EQ(expect(second, "source "), "source rollout-a");
  EXPECT_EQ(expect(first, "verify "), "verify ok 1");
  EXPECT_EQ(expect(second, "replicate "), "replicate ok 1 from rollout-a");
  EXPECT_EQ(expect(second, "verify "), "verify ok 1");
}

// unpublish returns only when no reader reads the buffers: the trainer scribbles over them the
// moment it returns, and the reader still gets every byte of version 1.
TEST_F(EndToEnd, UnpublishWaitsForAnInFlightReader) {
  const std::string server = start_server();
  Process& trainer = worker({server}, "trainer", {"--tensor-bytes", "8000000"}, {"publish:1", "wait-line", "unpublish", "scribble"});
  expect(trainer, "publish ok 1");
  Process& rollout = worker({server}, "rollout", {"--read-rate", read_rate(30000000), "--tensor-bytes", "8000000", "--report-source"},
                            {"replicate:latest", "verify"});
  expect(rollout, "source trainer");
  trainer.send_line("go");
  expect(trainer, "unpublish ok");
  EXPECT_EQ(expect(rollout, "replicate "), "replicate ok 1 from trainer");
  EXPECT_EQ(expect(rollout, "verify "), "verify ok 1");
}

// A reader capped at 2 KB/s (a throttled rollout) holds its trainer's unpublish one drain grace at
// most: its grant is revoked (TCP: the connection cut; RDMA: the window invalidated), the trainer
// overwrites its buffers, and the reader, with no other copy to read, is told so and never keeps
// torn bytes. (In the RDMA guest too: ctest -L rdma runs this suite over RDMA.)
TEST_F(EndToEnd, ASlowReaderHoldsUnpublishOnlyUntilTheDrainGrace) {
  const std::string server = start_server({"--drain-grace-ms", "2000"});
  const std::vector<std::string> model = {"--tensor-bytes", "4000000", "--tensors", "2"};
  Process& trainer = worker({server}, "trainer", model, {"publish:1", "wait-line", "unpublish", "scribble", "publish:2"});
  expect(trainer, "publish ok 1");
  std::vector<std::string> slow = model;
  slow.insert(slow.end(), {"--read-rate", "2000", "--report-source"});  // 4,000 s for 8 MB
  Process& reader = worker({server}, "reader", slow, {"replicate:1", "verify"});
  EXPECT_EQ(expect(reader, "source "), "source trainer");
  const auto asked = std::chrono::steady_clock::now();
  trainer.send_line("go");
  EXPECT_EQ(expect(trainer, "unpublish "), "unpublish ok");
  const auto waited_ms =
      std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - asked).count();
  // (A figure for the record, issue 32 finding 4; before the drain grace: 60 s until the reader was killed.)
  std::cout << "unpublish with a 2 KB/s reader returned after " << waited_ms << " ms (drain grace 2000 ms)\n";
  expect(trainer, "scribble ok");
  expect(trainer, "publish ok 2");
  const std::string answer = expect(reader, "replicate ");
  EXPECT_EQ(answer.rfind("replicate error version-unavailable", 0), 0u) << answer;
}

// A source killed mid-transfer: the reader finishes from the other holder.
TEST_F(EndToEnd, ReaderFinishesFromAnotherSourceAfterKill9) {
  const std::string server = start_server();
  const std::vector<std::string> big = {"--tensor-bytes", "8000000"};
  Process& trainer = worker({server}, "trainer", big, {"publish:1", "wait-line"});
  expect(trainer, "publish ok 1");
  Process& first = worker({server}, "rollout-a", big, {"replicate:latest", "verify", "wait-line"});
  EXPECT_EQ(expect(first, "verify "), "verify ok 1");
  Process& reader = worker({server}, "rollout-b", {"--tensor-bytes", "8000000", "--read-rate", read_rate(20000000), "--report-source"},
                           {"replicate:latest", "verify"});
  const std::string source = expect(reader, "source ").substr(7);
  ASSERT_TRUE(source == "trainer" || source == "rollout-a") << source;
  (source == "trainer" ? trainer : first).kill9();
  const std::string survivor = source == "trainer" ? "rollout-a" : "trainer";
  EXPECT_EQ(expect(reader, "replicate "), "replicate ok 1 from " + survivor);
  EXPECT_EQ(expect(reader, "verify "), "verify ok 1");
}

// Issue 34: a source killed mid-transfer, and the reader goes on from the tensors that arrived
// whole and verify (it pulls only the rest from the other holder), bit-exact.
TEST_F(EndToEnd, AReaderWhoseSourceIsKilledGoesOnFromTheVerifiedTensors) {
  const std::string server = start_server();
  const std::vector<std::string> shape = {"--tensors", "8", "--tensor-bytes", "4000000"};
  auto with = [&](std::vector<std::string> more) {
    more.insert(more.begin(), shape.begin(), shape.end());
    return more;
  };
  Process& trainer = worker({server}, "trainer", shape, {"publish:1", "wait-line"});
  expect(trainer, "publish ok 1");
  Process& first = worker({server}, "rollout-a", shape, {"replicate:latest", "verify", "wait-line"});
  EXPECT_EQ(expect(first, "verify "), "verify ok 1");
  // 32 MB at 20 MB/s: killed once 12 MB (two whole big tensors at least) arrived.
  Process& reader = worker({server}, "rollout-b",
                           with({"--read-rate", read_rate(20000000), "--report-source", "--halfway-bytes", "12000000"}),
                           {"replicate-watched:latest", "verify"});
  const std::string source = expect(reader, "source ").substr(7);
  ASSERT_TRUE(source == "trainer" || source == "rollout-a") << source;
  expect(reader, "halfway");
  (source == "trainer" ? trainer : first).kill9();
  const std::string survivor = source == "trainer" ? "rollout-a" : "trainer";
  EXPECT_EQ(expect(reader, "replicate "), "replicate ok 1 from " + survivor);
  const std::string stats = expect(reader, "stats ");
  std::istringstream words(stats);
  std::string word;
  std::uint64_t reads_failed = 0, reads_resumed = 0, bytes_resumed = 0;
  words >> word >> word >> reads_failed >> word >> reads_resumed >> word >> bytes_resumed;
  EXPECT_EQ(reads_resumed, 1u) << stats;
  EXPECT_GE(bytes_resumed, 8000000u) << stats;
  EXPECT_LT(bytes_resumed, 8u * 4000000u) << stats;
  EXPECT_EQ(expect(reader, "verify "), "verify ok 1");
}

// The server dies; every client moves to the backup and the job carries on with version 2.
TEST_F(EndToEnd, ClientsFailOverToTheBackupServer) {
  const std::string primary = start_server();
  const std::string backup = start_server();
  Process& trainer = worker({primary, backup}, "trainer", {},
                            {"publish:1", "wait-line", "unpublish", "publish:2", "wait-line"});
  expect(trainer, "publish ok 1");
  Process& rollout = worker({primary, backup}, "rollout", {}, {"replicate:latest", "verify", "wait-line", "update:latest", "verify"});
  EXPECT_EQ(expect(rollout, "verify "), "verify ok 1");
  servers_[0]->kill9();
  trainer.send_line("go");
  expect(trainer, "unpublish ok");
  expect(trainer, "publish ok 2");
  rollout.send_line("go");
  EXPECT_EQ(expect(rollout, "update "), "update updated 2 from trainer");
  EXPECT_EQ(expect(rollout, "verify "), "verify ok 2");
}

// The last copy of a retained version is unpublished: it is offloaded to CPU memory first, and a
// later reader gets it from there (the trainer's own buffers are scribbled by then).
TEST_F(EndToEnd, LastCopyIsOffloadedAndServedFromThere) {
  const std::string server = start_server();
  Process& trainer = worker({server}, "trainer", {"--retain-latest", "0"}, {"publish:1", "unpublish", "scribble", "wait-line"});
  expect(trainer, "unpublish ok");
  expect(trainer, "scribble ok");
  Process& rollout = worker({server}, "rollout", {}, {"replicate:1", "verify"});
  EXPECT_EQ(expect(rollout, "replicate "), "replicate ok 1 from trainer");
  EXPECT_EQ(expect(rollout, "verify "), "verify ok 1");
}

// Offload seeding (paper §4.3.4): the first update of a datacenter answers "not yet" at once and
// reads the version across datacenters into CPU memory; its next update reads that copy, bit-exact,
// and the datacenter's other replicas read locally.
TEST_F(EndToEnd, OffloadSeedingAnswersNotYetThenServesTheCpuCopy) {
  const std::string server = start_server({"--offload-seeding"});
  Process& trainer = worker({server}, "trainer", {"--datacenter", "dc0", "--small-tensors", "3"},
                            {"publish:1", "wait-line"});
  expect(trainer, "publish ok 1");
  const std::vector<std::string> polls = {"update:latest", "poll:latest"};
  std::vector<std::string> seeder_script = polls;
  seeder_script.push_back("verify");
  seeder_script.push_back("wait-line");  // stays, holding version 1 in dc1
  Process& seeder = worker({server}, "far", {"--datacenter", "dc1", "--small-tensors", "3"}, seeder_script);
  EXPECT_EQ(expect(seeder, "update "), "update not-yet nothing from ");
  EXPECT_EQ(expect(seeder, "update updated"), "update updated 1 from far") << "read from its own CPU copy";
  EXPECT_EQ(expect(seeder, "verify "), "verify ok 1");
  std::vector<std::string> local_script = polls;
  local_script.push_back("verify");
  Process& local = worker({server}, "far2", {"--datacenter", "dc1", "--small-tensors", "3"}, local_script);
  EXPECT_EQ(expect(local, "update updated"), "update updated 1 from far") << "read inside dc1";
  EXPECT_EQ(expect(local, "verify "), "verify ok 1");
  trainer.send_line("go");
  seeder.send_line("go");
}

// kill -9 of a seeder halfway through its seed: once the server has evicted it, the next replica of
// the datacenter seeds instead, and nobody is left reading from, or waiting on, the dead one.
TEST_F(EndToEnd, ASeederKilledMidSeedIsReplacedByAnotherReplicaOfItsDatacenter) {
  const std::string server = start_server({"--offload-seeding"});
  const std::vector<std::string> big = {"--tensor-bytes", "8000000"};
  std::vector<std::string> trainer_flags = big;
  trainer_flags.insert(trainer_flags.end(), {"--datacenter", "dc0"});
  Process& trainer = worker({server}, "trainer", trainer_flags, {"publish:1", "wait-line", "unpublish"});
  expect(trainer, "publish ok 1");
  // About 6 s to read 24 MB at 4 MB/s: killed well before the seed is whole.
  Process& slow = worker({server}, "far1", {"--tensor-bytes", "8000000", "--read-rate", read_rate(4000000),
                                            "--datacenter", "dc1"},
                         {"update:latest", "wait-line"});
  EXPECT_EQ(expect(slow, "update "), "update not-yet nothing from ");
  slow.kill9();
  // The server evicts far1 after 3 s of silence; far2's polls go on for up to 30 s.
  Process& next = worker({server}, "far2", {"--tensor-bytes", "8000000", "--datacenter", "dc1"},
                         {"poll:latest", "verify"});
  EXPECT_EQ(expect(next, "update updated"), "update updated 1 from far2") << "its own seed";
  EXPECT_EQ(expect(next, "verify "), "verify ok 1");
  trainer.send_line("go");
  EXPECT_EQ(expect(trainer, "unpublish "), "unpublish ok");
}

// A rollout killed and restarted (a new incarnation) catches up with the newest version.
TEST_F(EndToEnd, RestartedRolloutCatchesUp) {
  const std::string server = start_server();
  Process& trainer = worker({server}, "trainer", {}, {"publish:1", "wait-line", "unpublish", "publish:2", "wait-line"});
  expect(trainer, "publish ok 1");
  Process& before = worker({server}, "rollout", {}, {"replicate:latest", "verify", "wait-line"});
  EXPECT_EQ(expect(before, "verify "), "verify ok 1");
  before.kill9();
  trainer.send_line("go");
  expect(trainer, "publish ok 2");
  Process& after = worker({server}, "rollout", {"--incarnation", "2"}, {"replicate:latest", "verify"});
  EXPECT_EQ(expect(after, "replicate "), "replicate ok 2 from trainer");
  EXPECT_EQ(expect(after, "verify "), "verify ok 2");
}

// Bad input gets a clear error, and nobody else notices.
TEST_F(EndToEnd, BadInputGetsClearErrorsAndDisturbsNobody) {
  const std::string server = start_server();
  Process& trainer = worker({server}, "trainer", {}, {"publish:1", "wait-line"});
  const std::string opened = expect(trainer, "open ok ");
  expect(trainer, "publish ok 1");

  Process& intruder = worker({server}, "intruder", {}, {"list"}, "wrong-token");
  EXPECT_EQ(expect(intruder, "open ").substr(0, 28), "open error permission-denied");

  // Options the hub would refuse are refused before anything is sent (no silent timeout).
  Process& miscounted = worker({server}, "miscounted", {"--shard", "2", "--shards", "2"}, {"list"});
  EXPECT_EQ(expect(miscounted, "open ").substr(0, 27), "open error invalid-argument");

  Process& confused = worker({server}, "confused", {}, {"replicate:latest-x", "list"});
  EXPECT_EQ(expect(confused, "replicate ").substr(0, 28), "replicate error bad-selector");
  Process& misshapen = worker({server}, "misshapen", {"--tensor-bytes", "12345"}, {"replicate:latest"});
  EXPECT_EQ(expect(misshapen, "replicate ").substr(0, 31), "replicate error layout-mismatch");

  // A read of the trainer's buffers without a grant from the server.
  const net::Endpoint data = net::parse_endpoint(opened.substr(std::string("open ok ").size()));
  std::vector<std::byte> stolen(1000);
  const net::LocalRegion target{stolen.data(), stolen.size()};
  const net::PullOutcome theft = net::pull(data, {1, 1}, GrantSecret{}, {&target, 1}, net::PullOptions{});
  EXPECT_EQ(theft.error, net::ReadError::kRefused) << theft.detail;

  Process& rollout = worker({server}, "rollout", {}, {"replicate:latest", "verify"});
  EXPECT_EQ(expect(rollout, "replicate "), "replicate ok 1 from trainer");
  EXPECT_EQ(expect(rollout, "verify "), "verify ok 1");
  EXPECT_EQ(expect(confused, "list ").substr(0, 13), "list latest=1");
}

// th-ctl's "heartbeats: D as datagrams (R refused), C as calls".
struct HeartbeatCounts {
  std::uint64_t datagrams = 0;
  std::uint64_t refused = 0;
  std::uint64_t calls = 0;
};

HeartbeatCounts heartbeat_counts(const std::string& listing) {
  HeartbeatCounts counts;
  const auto at = listing.find("heartbeats: ");
  EXPECT_NE(at, std::string::npos) << listing;
  if (at == std::string::npos) return counts;
  std::istringstream line(listing.substr(at + std::string("heartbeats: ").size()));
  std::string as, datagrams_word, refused_word, as2, calls_word;
  char open_paren = 0;
  line >> counts.datagrams >> as >> datagrams_word >> open_paren >> counts.refused >> refused_word >> counts.calls;
  return counts;
}

// An idle worker's heartbeats go as UDP datagrams once the server hears them, and no longer as
// calls; datagrams that name the client but lack its connection's secret keep nobody alive.
TEST_F(EndToEnd, HeartbeatsGoAsDatagramsThatOnlyTheirConnectionCanSend) {
  const std::string server = start_server();  // heartbeat timeout 3 s; the client beats every 1 s
  Process& idle = worker({server}, "idle", {}, {"wait-line", "list"});
  expect(idle, "open ok ");
  const std::string client_line = expect(idle, "client ");
  const ClientId client = std::stoull(client_line.substr(std::string("client ").size()));

  // The first beats go both ways; once a send reply says the datagrams are heard, only datagrams.
  HeartbeatCounts before;
  for (int attempt = 0; attempt < 100 && before.datagrams < 2; ++attempt) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    before = heartbeat_counts(ctl(server));
  }
  ASSERT_GE(before.datagrams, 2u);
  std::this_thread::sleep_for(std::chrono::milliseconds(3500));  // more than the heartbeat timeout
  const std::string listing = ctl(server);
  const HeartbeatCounts after = heartbeat_counts(listing);
  EXPECT_GE(after.datagrams, before.datagrams + 2) << listing;
  EXPECT_EQ(after.calls, before.calls) << "an idle client heard by datagram sends no heartbeat calls\n" << listing;
  EXPECT_NE(listing.find("idle"), std::string::npos) << "alive on datagrams alone\n" << listing;

  // Stop the worker and beat in its name without the key, for longer than the timeout.
  ASSERT_EQ(::kill(idle.pid(), SIGSTOP), 0);
  const net::Endpoint endpoint = net::parse_endpoint(server);
  net::HeartbeatSender forger(endpoint);  // the datagram port has the control port's number
  for (std::uint64_t beat = 0; beat < 45; ++beat) {
    EXPECT_TRUE(forger.send(net::seal(client, 1, 1'000'000 + beat, net::HeartbeatKey{0x5EC2E7, beat})));
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  const std::string forged = ctl(server);
  EXPECT_GE(heartbeat_counts(forged).refused, 40u) << forged;  // a few may be lost on the way
  EXPECT_EQ(forged.find("idle"), std::string::npos) << "forged beats kept a stopped client alive\n" << forged;

  // Woken, the worker learns of its eviction: its call fails with it, or (if its own heartbeat got
  // the news first and its agent re-opened) the call is answered.
  ASSERT_EQ(::kill(idle.pid(), SIGCONT), 0);
  idle.send_line("go");
  const std::string answer = expect(idle, "list ");
  EXPECT_TRUE(answer.starts_with("list error replica-evicted") || answer.starts_with("list latest=none")) << answer;
}

// With datagrams off at the server, heartbeats go as calls and keep the client alive.
TEST_F(EndToEnd, HeartbeatsGoAsCallsWhenTheServerTakesNoDatagrams) {
  const std::string server = start_server({"--no-heartbeat-datagrams"});
  Process& idle = worker({server}, "idle", {}, {"wait-line", "list"});
  expect(idle, "open ok ");
  std::this_thread::sleep_for(std::chrono::milliseconds(4500));  // more than the heartbeat timeout
  const std::string listing = ctl(server);
  const HeartbeatCounts counts = heartbeat_counts(listing);
  EXPECT_EQ(counts.datagrams, 0u) << listing;
  EXPECT_GE(counts.calls, 3u) << listing;
  EXPECT_NE(listing.find("idle"), std::string::npos) << listing;
  idle.send_line("go");
  EXPECT_EQ(expect(idle, "list ").substr(0, 5), "list ");
}

}  // namespace
}  // namespace th::e2e
