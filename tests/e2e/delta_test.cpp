// Delta versions end to end (issue 35): a trainer writes each version through write_tensor, which
// records what changed; a rollout that holds the version before pulls the patch, applies it and
// ends bit-exact on the trainer's tensors; a patch that does not make the version (the rollout's
// buffers were written behind the server's back) is followed by a read of the bytes, still exact.
// In process, against a real th-server.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <sstream>
#include <utility>
#include <thread>
#include <chrono>
#include <string>
#include <vector>

#include "fixture.h"
#include "in_process.h"
#include "tensorhub/client.h"

namespace th::e2e {
namespace {

class Delta : public ProcessTest {};

// A model of two bfloat16 tensors (one of 4 MiB, one small, packed) trained with float32 master
// weights: each step moves a few percent of the weights by more than bfloat16 resolves.
struct Model {
  std::vector<float> weight_master;
  std::vector<float> bias_master = std::vector<float>(2048);
  std::vector<std::uint16_t> weight;
  std::vector<std::uint16_t> bias = std::vector<std::uint16_t>(bias_master.size());
  std::mt19937_64 rng{7};

  explicit Model(std::size_t weights = 2u << 20) : weight_master(weights), weight(weights) {
    std::normal_distribution<float> normal(0.0f, 0.02f);
    for (float& w : weight_master) w = normal(rng);
    for (float& b : bias_master) b = normal(rng);
  }
  // One step: 1 / `share` of the weights (2 % by default) move by about 1 %, every bias by a little
  // (its patch is too big).
  void step(std::size_t share = 50) {
    std::uniform_int_distribution<std::size_t> pick(0, weight_master.size() - 1);
    for (std::size_t i = 0; i < weight_master.size() / share; ++i) weight_master[pick(rng)] *= 1.01f;
    for (float& b : bias_master) b += 0.01f;
  }
  void register_with(Handle& handle) {
    ASSERT_TRUE(handle.register_tensor("layer.weight", weight.data(), weight.size() * 2, DType::kBFloat16).ok());
    ASSERT_TRUE(handle.register_tensor("layer.bias", bias.data(), bias.size() * 2, DType::kBFloat16).ok());
  }
  void write(Handle& handle) {
    ASSERT_TRUE(handle.write_tensor("layer.weight", weight_master.data(), DType::kFloat32).ok());
    ASSERT_TRUE(handle.write_tensor("layer.bias", bias_master.data(), DType::kFloat32).ok());
  }
};

struct Engine {
  std::vector<std::uint16_t> weight = std::vector<std::uint16_t>(2u << 20);
  std::vector<std::uint16_t> bias = std::vector<std::uint16_t>(2048);
  Engine() = default;
  explicit Engine(const Model& like) : weight(like.weight.size()), bias(like.bias.size()) {}
  void register_with(Handle& handle) {
    ASSERT_TRUE(handle.register_tensor("layer.weight", weight.data(), weight.size() * 2, DType::kBFloat16).ok());
    ASSERT_TRUE(handle.register_tensor("layer.bias", bias.data(), bias.size() * 2, DType::kBFloat16).ok());
  }
  bool holds(const Model& model) const { return weight == model.weight && bias == model.bias; }
};

TEST_F(Delta, ARolloutThatHoldsTheVersionBeforePullsThePatchAndEndsBitExact) {
  const std::string server = start_server();
  Model model;
  auto trainer = open_or_fail(options_for(server, "trainer", "trainer"));
  ASSERT_NE(trainer, nullptr);
  model.register_with(*trainer);
  model.write(*trainer);  // the first version: nothing to patch against
  ASSERT_TRUE(trainer->publish(1).ok());
  EXPECT_EQ(trainer->stats().patches_published, 0u);

  Engine engine;
  auto rollout = open_or_fail(options_for(server, "rollout", "rollout"));
  ASSERT_NE(rollout, nullptr);
  engine.register_with(*rollout);
  auto first = rollout->update();
  ASSERT_TRUE(first.ok()) << first.error().detail;
  ASSERT_TRUE(engine.holds(model));
  EXPECT_EQ(rollout->stats().patch_reads, 0u) << "it held nothing: the bytes";
  const std::uint64_t dense_bytes = rollout->stats().bytes_received;

  for (Version version = 2; version <= 3; ++version) {
    ASSERT_TRUE(trainer->unpublish().ok());
    model.step();
    model.write(*trainer);
    ASSERT_TRUE(trainer->publish(version).ok());
    EXPECT_EQ(trainer->stats().patches_published, version - 1);
    const std::uint64_t received_before = rollout->stats().bytes_received;
    auto updated = rollout->update();
    ASSERT_TRUE(updated.ok()) << updated.error().detail;
    EXPECT_TRUE(engine.holds(model)) << "version " << version << " is the trainer's, bit for bit";
    const HandleStats stats = rollout->stats();
    EXPECT_EQ(stats.patch_reads, version - 1);
    EXPECT_EQ(stats.patch_reads_failed, 0u);
    const std::uint64_t moved = stats.bytes_received - received_before;
    // About 2 % of the weight's elements changed (positions and values) and the bias read whole.
    EXPECT_LT(moved, dense_bytes / 8) << "a patch read pulled " << moved << " of " << dense_bytes << " bytes";
  }

  // The rollout's buffers written behind the server's back: the patch cannot make the version,
  // which the rollout's checksums see; it then reads the bytes, and ends exact all the same.
  ASSERT_TRUE(trainer->unpublish().ok());
  model.step();
  model.write(*trainer);
  ASSERT_TRUE(trainer->publish(4).ok());
  engine.weight[12345] ^= 0x40;
  auto updated = rollout->update();
  ASSERT_TRUE(updated.ok()) << updated.error().detail;
  EXPECT_TRUE(engine.holds(model)) << "after a failed patch read, the bytes";
  EXPECT_EQ(rollout->stats().patch_reads_failed, 1u);

  // A tensor written twice between publishes no longer holds the base when it is written the
  // second time: that write records no patch, and the tensor is read whole (still exact).
  ASSERT_TRUE(trainer->unpublish().ok());
  model.step();
  model.write(*trainer);
  model.step();
  model.write(*trainer);
  ASSERT_TRUE(trainer->publish(5).ok());
  EXPECT_EQ(trainer->stats().patches_published, 3u) << "nothing of version 5 has a patch";
  updated = rollout->update();
  ASSERT_TRUE(updated.ok()) << updated.error().detail;
  EXPECT_TRUE(engine.holds(model)) << "after a failed patch read, the bytes";
  EXPECT_EQ(rollout->stats().patch_reads_failed, 1u);
}

// A source that leaves in the middle of serving a patch: its grant is revoked at the drain grace
// (the connection cut mid-read), the server moves the read, and the reader ends exact: the cut read
// changed no tensor it patches (patches are applied once whole), and the next read writes every
// byte. (Three rollouts, fan-out 1: r2, holding nothing, reads the bytes slowly from the trainer,
// so that r0, which holds the version before, reads the patch from r1, which applied it; once r1
// left, the other holder's slot is held by a long read of the bytes, so r0 reads the bytes behind
// r2 rather than wait.)
TEST_F(Delta, ASourceThatLeavesMidPatchLeavesTheReaderExact) {
  const std::string server = start_server({"--drain-grace-ms", "1000"});
  Model model(512u << 10);
  auto trainer = open_or_fail(options_for(server, "trainer", "trainer"));
  ASSERT_NE(trainer, nullptr);
  model.register_with(*trainer);
  model.write(*trainer);
  ASSERT_TRUE(trainer->publish(1).ok());
  Engine engine0(model), engine1(model), engine2(model);
  ClientOptions slow0 = options_for(server, "r0", "rollout");
  slow0.read_rate_bytes_per_s = 150'000;  // the patch takes about 2 s: r1 leaves within it
  slow0.chunk_bytes = 32u << 10;          // asked for a piece at a time (not all in the socket at once)
  auto r0 = open_or_fail(slow0);
  auto r1 = open_or_fail(options_for(server, "r1", "rollout"));
  ASSERT_TRUE(r0 != nullptr && r1 != nullptr);
  engine0.register_with(*r0);
  engine1.register_with(*r1);
  ASSERT_TRUE(r0->update().ok());
  ASSERT_TRUE(r1->update().ok());

  ASSERT_TRUE(trainer->unpublish().ok());
  model.step(4);  // a quarter of the weights change
  model.write(*trainer);
  ASSERT_TRUE(trainer->publish(2).ok());
  ASSERT_TRUE(r1->update().ok());
  ASSERT_EQ(r1->stats().patch_reads, 1u);
  ClientOptions slow2 = options_for(server, "r2", "rollout");
  slow2.read_rate_bytes_per_s = 150'000;
  auto r2 = open_or_fail(slow2);
  ASSERT_NE(r2, nullptr);
  engine2.register_with(*r2);
  auto whole = r2->update_async();  // takes the trainer's one slot for about 7 s
  ASSERT_TRUE(whole.ok()) << whole.error().detail;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  while (r2->stats().reading_from != "trainer" && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  ASSERT_EQ(r2->stats().reading_from, "trainer");
  auto patched = r0->update_async();
  ASSERT_TRUE(patched.ok()) << patched.error().detail;
  while (r0->stats().reading_from != "r1" && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  ASSERT_EQ(r0->stats().reading_from, "r1") << "r0 reads the patch from r1, which applied it";
  r1.reset();  // leaves: its copy drains, and r0's grant is revoked within a second
  auto done = patched.value()->wait();
  ASSERT_TRUE(done.ok()) << done.error().detail;
  EXPECT_TRUE(engine0.holds(model)) << "after the patch read was cut, exact";
  EXPECT_EQ(done.value().source_replica, "r2") << "the read moved off the replica that left";
  EXPECT_EQ(r0->stats().patch_reads, 0u);
  ASSERT_TRUE(whole.value()->wait().ok());
  EXPECT_TRUE(engine2.holds(model));
}

// Worker processes whose bytes change in one version of ten (th-e2e-worker --change-period): the
// trainer publishes version 2 with patches against version 1. A patch read is slowed to take a
// second or more, so that it is in flight when the test kills something.
const std::vector<std::string> kPatchedShape = {"--tensors", "2", "--tensor-bytes", "262144", "--change-period", "10"};
std::vector<std::string> patched_shape(std::vector<std::string> more = {}) {
  more.insert(more.begin(), kPatchedShape.begin(), kPatchedShape.end());
  return more;
}

// "patch-stats reads R failed F patch_bytes P bytes B" → {R, F}.
std::pair<std::uint64_t, std::uint64_t> patch_reads_of(const std::string& line) {
  std::istringstream words(line);
  std::string word;
  std::uint64_t reads = 0, failed = 0;
  words >> word >> word >> reads >> word >> failed;
  return {reads, failed};
}

// A source killed (kill -9) while it serves a patch: the reader's read is cut mid-patch, no tensor
// it patches was written (a patch is applied once whole), and it ends bit-exact on version 2 from
// the other holder.
TEST_F(Delta, ASourceKilledMidPatchLeavesTheReaderExact) {
  const std::string server = start_server();
  Process& trainer = worker({server}, "trainer", patched_shape(), {"publish:1", "wait-line", "unpublish", "publish:2", "wait-line"});
  expect(trainer, "publish ok 1");
  Process& first = worker({server}, "rollout-a", patched_shape(),
                          {"replicate:latest", "verify", "wait-line", "update:latest", "verify", "patch-stats", "wait-line"});
  EXPECT_EQ(expect(first, "verify "), "verify ok 1");
  // About 105 KB of patch at 60 KB/s: killed within the first few milliseconds of it.
  Process& reader = worker({server}, "rollout-b", patched_shape({"--read-rate", read_rate(60000), "--report-source"}),
                           {"replicate:latest", "verify", "wait-line", "update:latest", "verify", "patch-stats"});
  EXPECT_EQ(expect(reader, "verify "), "verify ok 1");
  trainer.send_line("go");
  expect(trainer, "publish ok 2");
  first.send_line("go");
  EXPECT_EQ(expect(first, "update "), "update updated 2 from trainer");
  EXPECT_EQ(expect(first, "verify "), "verify ok 2");
  EXPECT_EQ(patch_reads_of(expect(first, "patch-stats ")), std::make_pair(std::uint64_t{1}, std::uint64_t{0}))
      << "rollout-a applied the patch (and keeps it to serve)";
  reader.send_line("go");
  // (Version 1's "source" line went by before its "verify".)
  const std::string source = expect(reader, "source ").substr(7);
  ASSERT_TRUE(source == "trainer" || source == "rollout-a") << source;
  (source == "trainer" ? trainer : first).kill9();
  const std::string survivor = source == "trainer" ? "rollout-a" : "trainer";
  EXPECT_EQ(expect(reader, "update "), "update updated 2 from " + survivor);
  EXPECT_EQ(expect(reader, "verify "), "verify ok 2") << "bit-exact on the trainer's version 2";
  // The server placed the read again on the other holder of the patch (which rollout-a keeps) if
  // it saw the source go first, or the bytes if the reader's report of the cut read came first;
  // the reader counts the cut read as a failed patch read if it saw it before the new grant.
  const auto [reads, failed] = patch_reads_of(expect(reader, "patch-stats "));
  EXPECT_LE(reads, 1u);
  EXPECT_LE(failed, 1u);
  EXPECT_GE(reads + failed, 1u) << "one patch read, applied or cut";
}

// The server is killed (kill -9) while a rollout reads a patch: every client moves to the backup,
// and the rollout ends bit-exact on version 2 (the read in flight is given up with the server that
// placed it, and the rollout, whose buffers may be partly patched, reads the bytes), and a rollout
// that asks the backup afterwards reads the patch: the trainer told the backup it keeps it.
TEST_F(Delta, AServerFailoverMidPatchLeavesTheReadersExact) {
  const std::string primary = start_server();
  const std::string backup = start_server();
  Process& trainer = worker({primary, backup}, "trainer", patched_shape(),
                            {"publish:1", "wait-line", "unpublish", "publish:2", "wait-line"});
  expect(trainer, "publish ok 1");
  Process& reader = worker({primary, backup}, "rollout-a", patched_shape({"--read-rate", read_rate(60000), "--report-source"}),
                           {"replicate:latest", "verify", "wait-line", "update:latest", "verify", "wait-line", "update:latest", "verify"});
  EXPECT_EQ(expect(reader, "verify "), "verify ok 1");
  Process& later = worker({primary, backup}, "rollout-b", patched_shape(),
                          {"replicate:latest", "verify", "wait-line", "poll:latest", "verify", "patch-stats"});
  EXPECT_EQ(expect(later, "verify "), "verify ok 1");
  trainer.send_line("go");
  expect(trainer, "publish ok 2");
  reader.send_line("go");
  EXPECT_EQ(expect(reader, "source "), "source trainer") << "the patch's one holder";
  servers_[0]->kill9();
  // The update, re-sent to the backup, may reach it before the trainer re-opened there: the backup
  // then knows version 1 as the latest (rollout-b re-opened first), and the rollout, whose buffers
  // held no version, reads that, exact; or nothing yet, and the rollout is told so (it holds
  // nothing). Its next update gets version 2.
  const std::string first = expect(reader, "update ");
  if (first != "update updated 2 from trainer") {
    const bool got_one = first.rfind("update updated 1 ", 0) == 0;
    EXPECT_TRUE(got_one || first == "update no-newer-version nothing from ") << first;
    const std::string verified = expect(reader, "verify ");
    if (got_one) {
      EXPECT_EQ(verified, "verify ok 1");
    }
    reader.send_line("go");
    EXPECT_EQ(expect(reader, "update "), "update updated 2 from trainer");
  }
  EXPECT_EQ(expect(reader, "verify "), "verify ok 2") << "bit-exact on the trainer's version 2";
  later.send_line("go");
  EXPECT_EQ(expect(later, "update "), "update updated 2 from trainer") << "through the backup";
  EXPECT_EQ(expect(later, "verify "), "verify ok 2");
  EXPECT_EQ(patch_reads_of(expect(later, "patch-stats ")), std::make_pair(std::uint64_t{1}, std::uint64_t{0}))
      << "the backup placed a patch read";
}

TEST_F(Delta, WriteTensorRefusesWhatItCannotDoNamingTheTensor) {
  const std::string server = start_server();
  Model model;
  auto trainer = open_or_fail(options_for(server, "trainer", "trainer"));
  ASSERT_NE(trainer, nullptr);
  model.register_with(*trainer);
  Status unknown = trainer->write_tensor("layer.nope", model.weight_master.data(), DType::kFloat32);
  ASSERT_FALSE(unknown.ok());
  EXPECT_NE(unknown.error().detail.find("layer.nope"), std::string::npos) << unknown.error().detail;
  Status integer = trainer->write_tensor("layer.weight", model.weight_master.data(), DType::kInt32);
  ASSERT_FALSE(integer.ok());
  EXPECT_EQ(integer.error().code, Errc::kInvalidArgument);
  // A bfloat16 tensor of an odd number of bytes: registered and published, but not written by
  // elements (refused, naming it, after a publish too: the patch writer takes whole elements).
  std::vector<std::uint16_t> odd(1024);
  ASSERT_TRUE(trainer->register_tensor("layer.odd", odd.data(), 2047, DType::kBFloat16).ok());
  for (int round = 0; round < 2; ++round) {
    Status partial = trainer->write_tensor("layer.odd", model.bias_master.data(), DType::kFloat32);
    ASSERT_FALSE(partial.ok());
    EXPECT_EQ(partial.error().code, Errc::kInvalidArgument);
    EXPECT_NE(partial.error().detail.find("layer.odd"), std::string::npos) << partial.error().detail;
    if (round == 0) {
      model.write(*trainer);
      ASSERT_TRUE(trainer->publish(1).ok());
      ASSERT_TRUE(trainer->unpublish().ok());
    }
  }
  model.write(*trainer);
  ASSERT_TRUE(trainer->publish(2).ok());
  Status published = trainer->write_tensor("layer.weight", model.weight_master.data(), DType::kFloat32);
  ASSERT_FALSE(published.ok()) << "tensors change only while not published";
  EXPECT_EQ(published.error().code, Errc::kAlreadyHolding);
}

}  // namespace
}  // namespace th::e2e
