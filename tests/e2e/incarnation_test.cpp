// Incarnations without bookkeeping (issue 18): a process that restarts opens with default options
// and the server gives it the replica's next incarnation, replacing its old self at once, where a
// fixed incarnation is refused until the old one is evicted. In process, against a real th-server.
#include <gtest/gtest.h>
#include <signal.h>

#include <string>
#include <thread>
#include <vector>

#include "fixture.h"
#include "tensorhub/client.h"

namespace th::e2e {
namespace {

class Incarnations : public ProcessTest {};

ClientOptions options_for(const std::string& server, const std::string& replica, std::uint32_t shard = 0,
                          std::uint32_t shards = 1) {
  ClientOptions options;
  options.servers = {server};
  options.token = kToken;
  options.model = "e2e";  // th-e2e-worker's
  options.replica = replica;
  options.shard = shard;
  options.num_shards = shards;
  options.open_timeout_ms = kStepMs;
  options.data_listen = "127.0.0.1:0";
  return options;
}

// A process that hangs (a host that froze or fell off the network keeps its connection open): the
// server would evict it only after its heartbeat timeout. Its replacement, with default options,
// takes over at once; with the same fixed incarnation it is refused until then.
TEST_F(Incarnations, ARestartedProcessWithDefaultOptionsReplacesItsHungSelfAtOnce) {
  const std::string server = start_server({"--heartbeat-timeout-ms", "60000"});
  Process& hung = worker({server}, "rollout", {}, {"sleep:600000"});
  expect(hung, "open ok");
  EXPECT_EQ(expect(hung, "incarnation "), "incarnation 1");
  hung.signal(SIGSTOP);
  ClientOptions fixed = options_for(server, "rollout");
  fixed.incarnation = 1;
  auto refused = Handle::open(fixed);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.error().code, Errc::kShardAlreadyOpen) << refused.error().detail;
  auto restarted = Handle::open(options_for(server, "rollout"));
  ASSERT_TRUE(restarted.ok()) << restarted.error().detail;
  EXPECT_EQ(restarted.value()->incarnation(), 2U);
  auto listed = restarted.value()->list();
  ASSERT_TRUE(listed.ok()) << listed.error().detail;
  ASSERT_EQ(listed.value().replicas.size(), 1U);
  EXPECT_EQ(listed.value().replicas[0].incarnation, 2U);
  hung.signal(SIGCONT);
  hung.kill9();
}

// Both shards of a replica hang; their replacements open one after the other with default
// options: the first replaces the replica (incarnation 2), the second joins it.
TEST_F(Incarnations, TheShardsOfARestartedReplicaMeetInOneIncarnation) {
  const std::string server = start_server({"--heartbeat-timeout-ms", "60000"});
  std::vector<Process*> hung;
  for (int shard = 0; shard < 2; ++shard) {
    hung.push_back(&worker({server}, "tp", {"--shard", std::to_string(shard), "--shards", "2"}, {"sleep:600000"}));
  }
  for (Process* process : hung) EXPECT_EQ(expect(*process, "incarnation "), "incarnation 1");
  for (Process* process : hung) process->signal(SIGSTOP);
  std::vector<std::unique_ptr<Handle>> shards;
  for (std::uint32_t shard = 0; shard < 2; ++shard) {
    auto opened = Handle::open(options_for(server, "tp", shard, 2));
    ASSERT_TRUE(opened.ok()) << opened.error().detail;
    shards.push_back(std::move(opened).value());
  }
  EXPECT_EQ(shards[0]->incarnation(), 2U);
  EXPECT_EQ(shards[1]->incarnation(), 2U) << "shard 1 joins the incarnation shard 0 started";
  // The replica works: both shards list together (an SPMD call).
  Result<ListSnapshot> listed0 = make_error(Errc::kUnavailable, "not run");
  std::thread other([&] { listed0 = shards[0]->list(); });
  auto listed1 = shards[1]->list();
  other.join();
  ASSERT_TRUE(listed0.ok()) << listed0.error().detail;
  ASSERT_TRUE(listed1.ok()) << listed1.error().detail;
  for (const ListSnapshot::ReplicaInfo& replica : listed1.value().replicas) EXPECT_EQ(replica.incarnation, 2U) << replica.name;
  for (Process* process : hung) {
    process->signal(SIGCONT);
    process->kill9();
  }
}

}  // namespace
}  // namespace th::e2e
