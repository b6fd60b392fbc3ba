// The shard agent, one input at a time: what it sends, when it retries, and how it comes back
// after eviction, failover and divergence. The simulator covers the agent against the real hub;
// these tests pin each rule down on its own.
#include <gtest/gtest.h>

#include <memory>
#include <optional>
#include <utility>
#include <variant>
#include <vector>

#include "core/agent.h"

namespace th {
namespace {

constexpr ClientId kClient = 7;

AgentConfig test_config() {
  AgentConfig config;
  config.client = kClient;
  config.servers = 2;
  config.heartbeat_interval_ms = 1000;
  config.retry_initial_ms = 250;
  config.retry_max_ms = 4000;
  return config;
}

OpenRequest open_request() {
  OpenRequest open;
  open.model = "m";
  open.replica = "r";
  open.incarnation = 1;
  open.shard = 0;
  open.num_shards = 2;
  open.datacenter = "dc";
  open.role = "rollout";
  return open;
}

template <typename T>
std::vector<T> all_of(const AgentEffects& effects) {
  std::vector<T> found;
  for (const AgentEffect& effect : effects) {
    if (const auto* e = std::get_if<T>(&effect)) found.push_back(*e);
  }
  return found;
}

template <typename T>
T only(const AgentEffects& effects) {
  const std::vector<T> found = all_of<T>(effects);
  EXPECT_EQ(found.size(), 1u);
  if (found.empty()) throw std::logic_error("missing effect");
  return found.front();
}

std::vector<Request> requests(const AgentEffects& effects) {
  std::vector<Request> found;
  for (const SendRequest& send : all_of<SendRequest>(effects)) found.push_back(send.request);
  return found;
}

std::vector<ReportBody> reports(const AgentEffects& effects) {
  std::vector<ReportBody> found;
  for (const SendReport& send : all_of<SendReport>(effects)) found.push_back(send.report.body);
  return found;
}

class AgentTest : public ::testing::Test {
 protected:
  AgentEffects step(const AgentInput& input) {
    AgentEffects effects;
    agent_.step(input, now_ms_, effects);
    return effects;
  }
  AgentEffects tick_at(TimeMs now_ms) {
    now_ms_ = now_ms;
    return step(AgentTick{});
  }
  // A message from the hub in the agent's current session, from its current server.
  AgentEffects hub(Message message) {
    FromHub from;  // built field by field: GCC 12 misreads the aggregate's variant as uninitialized
    from.server = agent_.server();
    from.effect.client = kClient;
    from.effect.message = std::move(message);
    from.effect.session = agent_.session();
    return step(std::move(from));
  }
  AgentEffects reply(std::uint64_t seq, const Outcome& outcome) {
    Reply answer;  // built field by field: GCC 12 misreads the aggregate's variant as uninitialized
    answer.seq = seq;
    answer.outcome = outcome;
    return hub(answer);
  }
  // The hub's answer to an open (numbered with the last call the client completed).
  AgentEffects open_reply(std::uint64_t seq, const Outcome& outcome,
                          std::uint64_t replica_incarnation = 0) {
    Reply answer;
    answer.seq = seq;
    answer.outcome = outcome;
    answer.to_open = true;
    answer.replica_incarnation = replica_incarnation;
    return hub(answer);
  }
  AgentEffects call(const RequestBody& body) {
    UserCall user_call;  // field by field, for the same reason as in reply()
    user_call.call_id = ++call_id_;
    user_call.body = body;
    return step(user_call);
  }

  void open() {
    call(open_request());
    const AgentEffects effects = open_reply(0, OpenOk{2, std::nullopt});
    ASSERT_EQ(only<CallDone>(effects).call_id, call_id_);
    ASSERT_EQ(agent_.phase(), AgentPhase::kOpen);
  }

  // Publishes `version` (call `seq`): the shard holds it afterwards.
  void publish(std::uint64_t seq, Version version) {
    call(PublishRequest{version, layout_, checksums_});
    const AgentEffects effects = reply(seq, PublishOk{version});
    ASSERT_TRUE(std::holds_alternative<PublishOk>(only<CallDone>(effects).outcome));
    ASSERT_TRUE(agent_.held().has_value());
    ASSERT_EQ(agent_.held()->version, version);
  }

  // An instruction for the call in flight (`call` 0), or for call `call`.
  StartRead start_read(TransferId transfer, std::uint32_t epoch, Version version,
                       std::uint64_t call = 0) const {
    StartRead read;
    read.transfer = transfer;
    read.epoch = epoch;
    read.call = call != 0 ? call : agent_.last_seq() + 1;
    read.version = version;
    read.source.replica = "source";
    read.source.incarnation = 1;
    read.checksums = checksums_;
    return read;
  }

  // Offload seeding: read `version` into the new CPU copy `copy`, outside any call.
  StartRead seed_read(TransferId transfer, std::uint32_t epoch, Version version, std::uint64_t copy) const {
    StartRead read = start_read(transfer, epoch, version, 0);
    read.call = 0;
    read.offload_copy = copy;
    read.layout = layout_;
    return read;
  }

  ShardAgent agent_{test_config()};
  TimeMs now_ms_ = 0;
  std::uint64_t call_id_ = 0;
  LayoutRef layout_ = ShardLayout::make({{"w", DType::kBFloat16, 1024}}).value();
  ChecksumsRef checksums_ = std::make_shared<const Checksums>(Checksums{1, 2, 3});
};

TEST(AgentConfigTest, RejectsNonsense) {
  AgentConfig config = test_config();
  EXPECT_TRUE(validate(config).ok());
  config.servers = 0;
  EXPECT_EQ(validate(config).error().code, Errc::kInvalidArgument);
  config = test_config();
  config.retry_max_ms = config.retry_initial_ms - 1;
  EXPECT_EQ(validate(config).error().code, Errc::kInvalidArgument);
  config = test_config();
  config.heartbeat_interval_ms = 0;
  EXPECT_EQ(validate(config).error().code, Errc::kInvalidArgument);
}

TEST_F(AgentTest, OpenIsAFreshSessionAtSequenceZero) {
  const AgentEffects effects = call(open_request());
  const std::vector<Request> sent = requests(effects);
  ASSERT_EQ(sent.size(), 1u);
  EXPECT_EQ(sent[0].client, kClient);
  EXPECT_EQ(sent[0].seq, 0u);
  EXPECT_EQ(sent[0].session, 1u);
  const auto& open = std::get<OpenRequest>(sent[0].body);
  EXPECT_EQ(open.resume, nullptr);
  EXPECT_EQ(agent_.phase(), AgentPhase::kOpening);
  EXPECT_EQ(agent_.starts(), 0u);  // counted once the open succeeds
}

TEST_F(AgentTest, OnlySuccessfulFreshOpensAreStarts) {
  for (int attempt = 0; attempt < 3; ++attempt) {  // an application retrying a refused open
    call(open_request());
    open_reply(0, make_error(Errc::kShardAlreadyOpen, "another process holds this shard"));
    EXPECT_EQ(agent_.phase(), AgentPhase::kIdle);
  }
  EXPECT_EQ(agent_.starts(), 0u);
  open();
  EXPECT_EQ(agent_.starts(), 1u);
}

TEST_F(AgentTest, CallsAreNumberedAndAnsweredInOrder) {
  open();
  const std::vector<Request> sent = requests(call(ListRequest{}));
  ASSERT_EQ(sent.size(), 1u);
  EXPECT_EQ(sent[0].seq, 1u);
  // An answer to another number (a late duplicate) is not this call's answer.
  EXPECT_TRUE(all_of<CallDone>(reply(7, WaitOk{})).empty());
  const AgentEffects effects = reply(1, ListOk{});
  EXPECT_EQ(only<CallDone>(effects).call_id, call_id_);
  EXPECT_EQ(agent_.last_seq(), 1u);
  EXPECT_EQ(requests(call(ListRequest{}))[0].seq, 2u);
}

TEST_F(AgentTest, OneCallAtATime) {
  open();
  call(ListRequest{});
  EXPECT_THROW(call(ListRequest{}), RequirementFailure);
}

TEST_F(AgentTest, RetransmitsAnUnansweredCallWithBoundedBackoff) {
  open();
  call(UnpublishRequest{});
  // Resent at 250, then after 500, 1000, 2000, 4000 and then every 4000 ms (retry_max_ms).
  std::vector<TimeMs> sent_at;
  for (TimeMs t = 0; t <= 20'000; t += 50) {
    for (const Request& request : requests(tick_at(t))) {
      EXPECT_EQ(request.seq, 1u);
      EXPECT_EQ(request.session, 1u);
      EXPECT_TRUE(std::holds_alternative<UnpublishRequest>(request.body));
      sent_at.push_back(t);
    }
  }
  const std::vector<TimeMs> expected{250, 750, 1750, 3750, 7750, 11750, 15750, 19750};
  EXPECT_EQ(sent_at, expected);
}

TEST_F(AgentTest, HeartbeatsOnlyOnceOpen) {
  call(open_request());
  // A heartbeat that overtook the open would come back "unknown client": none while opening.
  for (TimeMs t = 0; t <= 5000; t += 100) {
    const AgentEffects effects = tick_at(t);
    EXPECT_TRUE(all_of<SendReport>(effects).empty()) << "at " << t;
    for (const Request& request : requests(effects)) {
      EXPECT_TRUE(std::holds_alternative<OpenRequest>(request.body));
    }
  }
  // The open's retransmissions come at least once per heartbeat interval.
  std::vector<TimeMs> opens_at;
  for (TimeMs t = 5100; t <= 9000; t += 100) {
    if (!requests(tick_at(t)).empty()) opens_at.push_back(t);
  }
  ASSERT_GE(opens_at.size(), 3u);
  for (std::size_t i = 1; i < opens_at.size(); ++i) EXPECT_LE(opens_at[i] - opens_at[i - 1], 1000);

  open_reply(0, OpenOk{2, std::nullopt});
  int heartbeats = 0;
  for (TimeMs t = 9000; t <= 12'000; t += 100) {
    for (const ReportBody& body : reports(tick_at(t))) {
      heartbeats += std::holds_alternative<Heartbeat>(body) ? 1 : 0;
    }
  }
  EXPECT_GE(heartbeats, 3);
}

TEST_F(AgentTest, IgnoresMessagesOfAnotherSessionOrServer) {
  open();
  call(ListRequest{});
  AgentEffects effects =
      step(FromHub{agent_.server(), Effect{kClient, Reply{1, ListOk{}}, agent_.session() + 1}});
  EXPECT_TRUE(effects.empty());
  effects = step(FromHub{agent_.server() + 1, Effect{kClient, Reply{1, ListOk{}}, agent_.session()}});
  EXPECT_TRUE(effects.empty());
  effects = step(FromHub{agent_.server(), Effect{kClient, Evicted{}, agent_.session() - 1}});
  EXPECT_TRUE(effects.empty());
  EXPECT_EQ(agent_.phase(), AgentPhase::kOpen);
}

TEST_F(AgentTest, EvictionFailsTheCallThenReopensAsTheNextIncarnationAnnouncingTheCopy) {
  open();
  publish(1, 5);
  call(ListRequest{});
  const AgentEffects evicted = hub(Evicted{Errc::kReplicaEvicted, "heartbeat"});
  const auto error = std::get<Error>(only<CallDone>(evicted).outcome);
  EXPECT_EQ(error.code, Errc::kReplicaEvicted);
  EXPECT_EQ(agent_.phase(), AgentPhase::kEvicted);
  // It comes back by itself after a backoff: its program may be waiting in a collective.
  const TimeMs reopen_at = *agent_.next_deadline_ms();
  EXPECT_GT(reopen_at, now_ms_);
  const std::vector<Request> sent = requests(tick_at(reopen_at));
  ASSERT_EQ(sent.size(), 1u);
  const auto& open = std::get<OpenRequest>(sent[0].body);
  EXPECT_EQ(open.incarnation, 2u);
  ASSERT_NE(open.resume, nullptr);
  ASSERT_TRUE(open.resume->primary.has_value());
  EXPECT_EQ(open.resume->primary->version, 5u);
  ASSERT_TRUE(open.resume->last_txn.has_value());
  EXPECT_EQ(open.resume->last_txn->seq, 1u);
  EXPECT_EQ(sent[0].seq, 1u);  // numbered with the last completed call
  EXPECT_EQ(sent[0].session, 2u);
  EXPECT_EQ(agent_.starts(), 1u);  // a resume is not a new start
}

TEST_F(AgentTest, FailoverReopensOnTheNextServerAndSendsTheCallAgain) {
  open();
  publish(1, 3);
  call(ListRequest{});
  const AgentEffects lost = step(ServerLost{0});
  EXPECT_EQ(agent_.server(), 1u);
  EXPECT_EQ(agent_.phase(), AgentPhase::kOpening);
  const std::vector<Request> sent = requests(lost);
  ASSERT_EQ(sent.size(), 1u);
  EXPECT_EQ(std::get<OpenRequest>(sent[0].body).incarnation, 1u);  // not evicted: same one
  ASSERT_NE(std::get<OpenRequest>(sent[0].body).resume, nullptr);
  EXPECT_TRUE(all_of<CallDone>(lost).empty());  // the call goes on
  // A server lost that is not ours changes nothing.
  EXPECT_TRUE(step(ServerLost{0}).empty());
  const std::vector<Request> after_open = requests(open_reply(1, OpenOk{2, 3}));
  ASSERT_EQ(after_open.size(), 1u);
  EXPECT_EQ(after_open[0].seq, 2u);
  EXPECT_TRUE(std::holds_alternative<ListRequest>(after_open[0].body));
  EXPECT_EQ(only<CallDone>(reply(2, ListOk{})).call_id, call_id_);
}

TEST_F(AgentTest, DivergentCallStartsOverWithNothingAnnounced) {
  open();
  publish(1, 4);
  hub(Offload{4, 40});
  const AgentEffects offloaded = step(OffloadFinished{4});
  ASSERT_EQ(reports(offloaded).size(), 1u);
  call(ListRequest{});
  const AgentEffects diverged = reply(2, make_error(Errc::kDivergentCall, "other shards differ"));
  EXPECT_EQ(std::get<Error>(only<CallDone>(diverged).outcome).code, Errc::kDivergentCall);
  EXPECT_EQ(only<FreeOffload>(diverged).version, 4u);
  EXPECT_FALSE(agent_.held().has_value());
  const std::vector<Request> sent = requests(tick_at(*agent_.next_deadline_ms()));
  ASSERT_EQ(sent.size(), 1u);
  const auto& open = std::get<OpenRequest>(sent[0].body);
  EXPECT_EQ(open.resume, nullptr);
  EXPECT_EQ(open.incarnation, 2u);
  EXPECT_EQ(sent[0].seq, 0u);
  open_reply(0, OpenOk{2, std::nullopt});
  EXPECT_EQ(agent_.starts(), 2u);
  EXPECT_EQ(agent_.last_seq(), 0u);
  EXPECT_EQ(requests(call(ListRequest{}))[0].seq, 1u);
}

// Soak find (AgentModel, lossy network): the server failed over while a start-over open was in
// flight; the open went again as a resume and the new run was not counted, so the application's
// checks took the first call of the new run for the first call of the old one.
TEST_F(AgentTest, AStartOverOpenResentAfterAFailoverStillStartsARun) {
  open();
  publish(1, 4);
  call(ListRequest{});
  reply(2, make_error(Errc::kDivergentCall, "other shards differ"));
  const std::vector<Request> sent = requests(tick_at(*agent_.next_deadline_ms()));
  ASSERT_EQ(sent.size(), 1u);
  ASSERT_EQ(std::get<OpenRequest>(sent[0].body).resume, nullptr);
  const std::vector<Request> again = requests(step(ServerLost{agent_.server()}));
  ASSERT_EQ(again.size(), 1u);
  const auto& reopen = std::get<OpenRequest>(again[0].body);
  ASSERT_NE(reopen.resume, nullptr) << "the new server gathers the replica in its barrier";
  EXPECT_FALSE(reopen.resume->primary.has_value());
  EXPECT_EQ(again[0].seq, 0u);
  open_reply(0, OpenOk{2, std::nullopt});
  EXPECT_EQ(agent_.starts(), 2u);
  EXPECT_EQ(requests(call(ListRequest{}))[0].seq, 1u);
}

// property-long seed 5: the new server refuses to resume a replica one of whose shards was told
// "replica closed" by the old one. Resuming again would be refused the same way for ever; the
// shard starts over (its copies went with the close) and opens the same incarnation afresh.
TEST_F(AgentTest, AResumeRefusedAsClosedStartsOver) {
  open();
  publish(1, 4);
  hub(Offload{4, 40});
  ASSERT_EQ(reports(step(OffloadFinished{4})).size(), 1u);
  const std::vector<Request> resumed = requests(step(ServerLost{agent_.server()}));
  ASSERT_EQ(resumed.size(), 1u);
  const auto& resume = std::get<OpenRequest>(resumed[0].body);
  ASSERT_NE(resume.resume, nullptr);
  ASSERT_TRUE(resume.resume->primary.has_value());
  const AgentEffects refused = open_reply(1, make_error(Errc::kReplicaClosed, "closing on the previous server"), 2);
  EXPECT_EQ(only<FreeOffload>(refused).version, 4u);
  EXPECT_FALSE(agent_.held().has_value());
  const std::vector<Request> sent = requests(tick_at(*agent_.next_deadline_ms()));
  ASSERT_EQ(sent.size(), 1u);
  const auto& fresh = std::get<OpenRequest>(sent[0].body);
  EXPECT_EQ(fresh.resume, nullptr) << "a resume would be refused as closed again";
  EXPECT_EQ(fresh.incarnation, 2u);
  EXPECT_EQ(sent[0].seq, 0u);
  open_reply(0, OpenOk{2, std::nullopt});
  EXPECT_EQ(agent_.starts(), 2u);
}

TEST_F(AgentTest, JoinsTheIncarnationTheHubNamesInsteadOfReplacingIt) {
  open();
  hub(Evicted{Errc::kReplicaEvicted, "heartbeat"});
  requests(tick_at(*agent_.next_deadline_ms()));  // resume as incarnation 2
  // Its peers re-formed the replica as incarnation 5 meanwhile.
  open_reply(0, make_error(Errc::kStaleIncarnation, "newer"), 5);
  std::vector<Request> sent = requests(tick_at(*agent_.next_deadline_ms()));
  ASSERT_EQ(sent.size(), 1u);
  EXPECT_EQ(std::get<OpenRequest>(sent[0].body).incarnation, 5u);
  EXPECT_NE(std::get<OpenRequest>(sent[0].body).resume, nullptr);
  // Incarnation 5 went on without this shard: it starts over and joins 5 fresh (not 6, which
  // would evict the peers, which would come back as 7, and so on).
  open_reply(0, make_error(Errc::kDivergentCall, "started over"), 5);
  sent = requests(tick_at(*agent_.next_deadline_ms()));
  ASSERT_EQ(sent.size(), 1u);
  EXPECT_EQ(std::get<OpenRequest>(sent[0].body).incarnation, 5u);
  EXPECT_EQ(std::get<OpenRequest>(sent[0].body).resume, nullptr);
}

TEST_F(AgentTest, AnUnpublishEndedByEvictionHoldsItsPromise) {
  open();
  publish(1, 2);
  hub(ServeRead{9, 1, 2, CopyKind::kPrimary, 0, "reader"});
  call(UnpublishRequest{});
  const AgentEffects evicted = hub(Evicted{Errc::kReplicaEvicted, "gone"});
  EXPECT_TRUE(std::holds_alternative<UnpublishOk>(only<CallDone>(evicted).outcome));
  EXPECT_EQ(only<RevokeServe>(evicted).transfer, 9u);  // nothing may read the buffers any more
  EXPECT_FALSE(agent_.held().has_value());
  EXPECT_EQ(agent_.last_seq(), 2u);  // the call took its number
  const std::vector<Request> sent = requests(tick_at(*agent_.next_deadline_ms()));
  const auto& open = std::get<OpenRequest>(sent.at(0).body);
  ASSERT_NE(open.resume, nullptr);
  EXPECT_FALSE(open.resume->primary.has_value());
  ASSERT_TRUE(open.resume->last_txn.has_value());
  EXPECT_EQ(open.resume->last_txn->seq, 2u);
  EXPECT_TRUE(std::holds_alternative<UnpublishOk>(open.resume->last_txn->outcome));
}

// th-sim --seed 750100 --workload colocated --profile harsh-net: an unpublish ended by a
// divergence was answered UnpublishOk, so the shard's program went on while its peers started
// over: the replica waited in its collective for ever. A divergence is told as it is.
TEST_F(AgentTest, AnUnpublishEndedByDivergenceSaysSo) {
  open();
  publish(1, 2);
  call(UnpublishRequest{});
  const AgentEffects diverged = reply(2, make_error(Errc::kDivergentCall, "peers differ"));
  EXPECT_EQ(std::get<Error>(only<CallDone>(diverged).outcome).code, Errc::kDivergentCall);
  EXPECT_FALSE(agent_.held().has_value());
}

TEST_F(AgentTest, ServesOnlyWhatItHoldsOrReceives) {
  open();
  publish(1, 2);
  EXPECT_EQ(only<GrantServe>(hub(ServeRead{1, 1, 2, CopyKind::kPrimary, 0, "a"})).grant.transfer, 1u);
  // A late grant for another version, or for an offload it never made: refused silently.
  EXPECT_TRUE(hub(ServeRead{2, 1, 3, CopyKind::kPrimary, 0, "b"}).empty());
  EXPECT_TRUE(hub(ServeRead{3, 1, 2, CopyKind::kOffload, 0, "c"}).empty());
  // Once an update starts writing, the old version's grants are revoked and new ones refused.
  call(UpdateRequest{Selector::latest(), layout_});
  const AgentEffects reading = hub(start_read(4, 1, 6));
  EXPECT_EQ(only<BeginRead>(reading).read.version, 6u);
  EXPECT_EQ(only<RevokeServe>(reading).transfer, 1u);
  EXPECT_TRUE(hub(ServeRead{5, 1, 2, CopyKind::kPrimary, 0, "d"}).empty());
  // Pipeline replication: the version being received may be served as it arrives.
  EXPECT_EQ(only<GrantServe>(hub(ServeRead{6, 1, 6, CopyKind::kPrimary, 0, "e"})).grant.transfer, 6u);
}

// Property-test find (AgentModel, lossy network): the hub's StopServing for a pipelined read was
// lost, the receive failed, and the application wrote the buffers while the grant still stood.
TEST_F(AgentTest, AFailedReceiveRevokesTheGrantsToPipelineFromIt) {
  open();
  call(UpdateRequest{Selector::latest(), layout_});
  hub(start_read(1, 1, 3));
  EXPECT_EQ(only<GrantServe>(hub(ServeRead{2, 1, 3, CopyKind::kPrimary, 0, "downstream"})).grant.transfer,
            2u);
  // No StopServing: the answer alone gives the buffers back to the application.
  const AgentEffects failed = reply(1, Error{Errc::kVersionUnavailable, "no copy is left"});
  EXPECT_EQ(only<RevokeServe>(failed).transfer, 2u);
  EXPECT_FALSE(agent_.held().has_value());
  EXPECT_TRUE(hub(ServeRead{3, 1, 3, CopyKind::kPrimary, 0, "late"}).empty());
}

TEST_F(AgentTest, ReadsOnlyInsideAReadingCallAndReportsOnce) {
  open();
  EXPECT_TRUE(hub(start_read(1, 1, 2)).empty());  // no replicate/update in flight: stale
  call(ReplicateRequest{Selector::absolute(2), layout_, 0});
  EXPECT_EQ(only<BeginRead>(hub(start_read(1, 1, 2))).read.transfer, 1u);
  EXPECT_TRUE(hub(start_read(1, 1, 2)).empty());  // a duplicate of the same epoch
  // A newer epoch (another source) replaces the read.
  EXPECT_EQ(only<BeginRead>(hub(start_read(1, 2, 2))).read.epoch, 2u);
  EXPECT_TRUE(step(ReadFinished{1, 1, std::nullopt}).empty());  // the old epoch's read
  const std::vector<ReportBody> done = reports(step(ReadFinished{1, 2, std::nullopt}));
  ASSERT_EQ(done.size(), 1u);
  EXPECT_EQ(std::get<TransferDone>(done[0]).epoch, 2u);
  // The hub missed the report and says to read again: the agent reports again, reads nothing.
  const AgentEffects again = hub(start_read(1, 2, 2));
  EXPECT_TRUE(all_of<BeginRead>(again).empty());
  EXPECT_EQ(reports(again).size(), 1u);
  EXPECT_EQ(only<CallDone>(reply(1, ReplicateOk{2, "source"})).call_id, call_id_);
  ASSERT_TRUE(agent_.held().has_value());
  EXPECT_EQ(agent_.held()->version, 2u);
}

TEST_F(AgentTest, ReportsAReadsProgressOnceAnEpochAndOnlyOfTheCurrentRead) {
  open();
  call(ReplicateRequest{Selector::absolute(2), layout_, 0});
  only<BeginRead>(hub(start_read(1, 1, 2)));
  const std::vector<ReportBody> first = reports(step(ReadProgress{1, 1, 64}));
  ASSERT_EQ(first.size(), 1u);
  const auto& progress = std::get<TransferProgress>(first[0]);
  EXPECT_EQ(progress.transfer, 1u);
  EXPECT_EQ(progress.epoch, 1u);
  EXPECT_EQ(progress.bytes, 64u);
  EXPECT_TRUE(step(ReadProgress{1, 1, 128}).empty());  // once an epoch
  EXPECT_TRUE(step(ReadProgress{7, 1, 64}).empty());   // no such read
  // Not retransmitted: a lost one only means the hub times the read at its end.
  for (const ReportBody& body : reports(tick_at(60'000))) EXPECT_FALSE(std::holds_alternative<TransferProgress>(body));
  // Another source: a report of its own; the old epoch's data plane, late, is not heard.
  only<BeginRead>(hub(start_read(1, 2, 2)));
  EXPECT_TRUE(step(ReadProgress{1, 1, 64}).empty());
  EXPECT_EQ(reports(step(ReadProgress{1, 2, 32})).size(), 1u);
  // Nor a read that is done.
  only<BeginRead>(hub(start_read(1, 3, 2)));
  EXPECT_EQ(reports(step(ReadFinished{1, 3, std::nullopt})).size(), 1u);
  EXPECT_TRUE(step(ReadProgress{1, 3, 64}).empty());
}

TEST_F(AgentTest, AReadOfAnotherLayoutReportsWhatItAssembledAndHoldsIt) {
  open();
  call(ReplicateRequest{Selector::absolute(2), layout_, 0});
  StartRead read = start_read(1, 1, 2);
  read.checksums = nullptr;  // the reader's layout has none yet
  read.reshard.push_back(SourceShard{"source-0", layout_, std::make_shared<const Checksums>(Checksums{7})});
  EXPECT_EQ(only<BeginRead>(hub(read)).read.reshard.size(), 1u);
  // The data plane owes the checksums of what it assembled: without them nobody vouches.
  const std::vector<ReportBody> refused = reports(step(ReadFinished{1, 1, std::nullopt}));
  ASSERT_EQ(refused.size(), 1u);
  EXPECT_EQ(std::get<TransferFailed>(refused[0]).reason, ReadFailure::kChecksumMismatch);
  read.epoch = 2;
  hub(read);
  const auto assembled = std::make_shared<const Checksums>(Checksums{42});
  const std::vector<ReportBody> done = reports(step(ReadFinished{1, 2, std::nullopt, assembled}));
  ASSERT_EQ(done.size(), 1u);
  ASSERT_NE(std::get<TransferDone>(done[0]).checksums, nullptr);
  EXPECT_EQ(*std::get<TransferDone>(done[0]).checksums, *assembled);
  // Told again (the hub missed the report): the same checksums, no second read.
  const AgentEffects again = hub(read);
  EXPECT_TRUE(all_of<BeginRead>(again).empty());
  ASSERT_EQ(reports(again).size(), 1u);
  EXPECT_EQ(*std::get<TransferDone>(reports(again)[0]).checksums, *assembled);
  reply(1, ReplicateOk{2, "source"});
  ASSERT_TRUE(agent_.held().has_value());
  ASSERT_NE(agent_.held()->checksums, nullptr);
  EXPECT_EQ(*agent_.held()->checksums, *assembled) << "what a failover's resume says the buffers hold";
}

TEST_F(AgentTest, AFailedReadIsReportedAndRetransmittedUntilAnswered) {
  open();
  call(ReplicateRequest{Selector::absolute(2), layout_, 0});
  hub(start_read(1, 1, 2));
  const std::vector<ReportBody> failed =
      reports(step(ReadFinished{1, 1, ReadFailure::kChecksumMismatch}));
  ASSERT_EQ(failed.size(), 1u);
  EXPECT_EQ(std::get<TransferFailed>(failed[0]).reason, ReadFailure::kChecksumMismatch);
  int resent = 0;
  for (TimeMs t = 0; t <= 2000; t += 50) {
    for (const ReportBody& body : reports(tick_at(t))) {
      resent += std::holds_alternative<TransferFailed>(body) ? 1 : 0;
    }
  }
  EXPECT_GE(resent, 2);
  // The answer is the next epoch: the failure report has served its purpose.
  hub(start_read(1, 2, 2));
  for (TimeMs t = 2050; t <= 8000; t += 50) {
    for (const ReportBody& body : reports(tick_at(t))) {
      EXPECT_FALSE(std::holds_alternative<TransferFailed>(body)) << "at " << t;
    }
  }
}

// A copy the data plane failed to make (a GPU copy failed) is not reported, and a second request
// for it makes it afresh instead of waiting for the failed one for ever.
TEST_F(AgentTest, AFailedOffloadIsForgottenAndMadeAgainWhenAskedAgain) {
  open();
  publish(1, 8);
  EXPECT_EQ(only<MakeOffload>(hub(Offload{8, 80})).version, 8u);
  const AgentEffects failed = step(OffloadFinished{8, /*failed=*/true});
  EXPECT_TRUE(reports(failed).empty());
  EXPECT_TRUE(all_of<FreeOffload>(failed).empty());
  EXPECT_EQ(only<MakeOffload>(hub(Offload{8, 81})).version, 8u);
  EXPECT_EQ(std::get<OffloadDone>(reports(step(OffloadFinished{8})).at(0)).copy, 81u);
}

TEST_F(AgentTest, ReportsAnOffloadAgainWhenAskedForOneItHas) {
  open();
  publish(1, 8);
  EXPECT_EQ(only<MakeOffload>(hub(Offload{8, 80})).version, 8u);
  EXPECT_EQ(std::get<OffloadDone>(reports(step(OffloadFinished{8})).at(0)).copy, 80u);
  // A new server (or a hub that missed the report) asks again: no second copy, the same report,
  // under the id it names now.
  const AgentEffects again = hub(Offload{8, 81});
  EXPECT_TRUE(all_of<MakeOffload>(again).empty());
  const std::vector<ReportBody> sent = reports(again);
  ASSERT_EQ(sent.size(), 1u);
  EXPECT_EQ(std::get<OffloadDone>(sent[0]).version, 8u);
  EXPECT_EQ(std::get<OffloadDone>(sent[0]).copy, 81u);
  // Asked for a version its buffers do not hold: nothing.
  EXPECT_TRUE(hub(Offload{9, 90}).empty());
  // Released under an id that is not the copy's (a late message about the earlier id): nothing.
  EXPECT_TRUE(hub(ReleaseOffload{8, 80}).empty());
  // Released: freed once, and its grants revoked.
  hub(ServeRead{4, 1, 8, CopyKind::kOffload, 0, "reader"});
  const AgentEffects released = hub(ReleaseOffload{8, 81});
  EXPECT_EQ(only<FreeOffload>(released).version, 8u);
  EXPECT_EQ(only<RevokeServe>(released).transfer, 4u);
  EXPECT_TRUE(hub(ReleaseOffload{8, 81}).empty());
  // Property-test find (AgentModel, lossy network): the report under the first id (80) was still
  // retransmitted after the copy was freed. No report about a freed copy goes out again.
  for (TimeMs t = 0; t <= 10000; t += 50) {
    for (const ReportBody& body : reports(tick_at(t))) {
      EXPECT_FALSE(std::holds_alternative<OffloadDone>(body)) << "at " << t;
    }
  }
}

// th-sim seed 31701838 (elastic, harsh-net): a late Offload naming the copy's earlier id relabelled
// it back; the hub, which counted the newer id, answered the report with a release of the earlier
// one, and the shard freed the copy the hub still sent readers to (every read failed).
TEST_F(AgentTest, ALateOffloadNamingAnEarlierIdIsStale) {
  open();
  publish(1, 8);
  hub(Offload{8, 80});
  step(OffloadFinished{8});
  ASSERT_EQ(reports(hub(Offload{8, 81})).size(), 1u);  // the server renamed the copy
  EXPECT_TRUE(hub(Offload{8, 80}).empty()) << "the earlier instruction, late";
  EXPECT_TRUE(hub(ReleaseOffload{8, 80}).empty()) << "the hub's answer to a report under 80";
  EXPECT_EQ(only<GrantServe>(hub(ServeRead{4, 1, 8, CopyKind::kOffload, 0, "reader"})).grant.transfer, 4u);
  EXPECT_EQ(only<FreeOffload>(hub(ReleaseOffload{8, 81})).version, 8u);
}

// Property-test find (AgentModel, lossy network, soak seed 14219638959452584725): after the hub
// released the copy, late copies of an earlier Offload and of its ReleaseOffload arrive. The agent
// makes a copy for the late instruction; the late release names it, so the buffer is freed when
// made and never reported (the hub counts no such copy).
TEST_F(AgentTest, ACopyMadeForALateOffloadIsFreedByItsLateRelease) {
  open();
  publish(1, 8);
  hub(Offload{8, 81});
  ASSERT_EQ(reports(step(OffloadFinished{8})).size(), 1u);
  EXPECT_EQ(only<FreeOffload>(hub(ReleaseOffload{8, 81})).version, 8u);
  EXPECT_EQ(only<MakeOffload>(hub(Offload{8, 80})).version, 8u) << "nothing says it is late";
  EXPECT_TRUE(hub(ReleaseOffload{8, 80}).empty()) << "freed when made";
  const AgentEffects finished = step(OffloadFinished{8});
  EXPECT_EQ(only<FreeOffload>(finished).version, 8u);
  EXPECT_TRUE(reports(finished).empty());
  for (TimeMs t = 0; t <= 10000; t += 50) {
    for (const ReportBody& body : reports(tick_at(t))) {
      EXPECT_FALSE(std::holds_alternative<OffloadDone>(body)) << "at " << t;
    }
  }
}

TEST_F(AgentTest, AnOffloadOfBuffersThatMovedOnIsDropped) {
  open();
  publish(1, 8);
  hub(Offload{8, 80});
  call(UnpublishRequest{});
  reply(2, UnpublishOk{});
  // The buffers no longer hold version 8: the copy is not trusted, and its memory goes.
  const AgentEffects finished = step(OffloadFinished{8});
  EXPECT_TRUE(reports(finished).empty());
  EXPECT_EQ(only<FreeOffload>(finished).version, 8u);
}

// th-sim seed 3114 (colocated, harsh-crash): after a failover the new server adopted the copy the
// open announced (under an id of its own) and later released it, but its renaming Offload had been
// lost: the release named an id the shard did not know, and the copy stayed in CPU memory for
// ever while no server counted it.
TEST_F(AgentTest, AReleaseOfTheVersionFreesTheCopyTheOpenAnnouncedThoughItsNewNameNeverCame) {
  open();
  publish(1, 8);
  hub(Offload{8, 80});
  step(OffloadFinished{8});
  const AgentEffects lost = step(ServerLost{0});
  ASSERT_EQ(std::get<OpenRequest>(requests(lost).at(0).body).resume->offloads.at(0).copy, 80u);
  open_reply(1, OpenOk{2, std::nullopt});
  ASSERT_EQ(agent_.phase(), AgentPhase::kOpen);
  // The new server counts the copy as its 3 (Offload{8, 3} lost) and releases it.
  EXPECT_TRUE(hub(ReleaseOffload{9, 3}).empty()) << "another version: nothing";
  EXPECT_EQ(only<FreeOffload>(hub(ReleaseOffload{8, 3})).version, 8u);
  EXPECT_TRUE(hub(ReleaseOffload{8, 3}).empty()) << "freed once";
  // Once this server named the copy, a release under another id is stale again.
  publish(2, 9);
  hub(Offload{9, 5});
  step(OffloadFinished{9});
  EXPECT_TRUE(hub(ReleaseOffload{9, 4}).empty()) << "an earlier copy's release, late";
  EXPECT_EQ(only<FreeOffload>(hub(ReleaseOffload{9, 5})).version, 9u);
}

// Property-test find (AgentModel, lossy network, property-long seed 4): the new server answered
// the copy an open announced with its release, and the network lost it; nothing asked again, and
// the shard kept the memory for ever while no server counted the copy. The shard reports each
// announced copy under its old id until the server renames or releases it.
TEST_F(AgentTest, AnAnnouncedCopyIsReportedUntilTheNewServerNamesOrReleasesIt) {
  open();
  publish(1, 8);
  hub(Offload{8, 80});
  step(OffloadFinished{8});
  publish(2, 9);
  hub(Offload{9, 90});
  step(OffloadFinished{9});
  const AgentEffects lost = step(ServerLost{0});
  ASSERT_EQ(std::get<OpenRequest>(requests(lost).at(0).body).resume->offloads.size(), 2u);
  // The new server's rename of 8 overtakes the open's answer; its release of 9 is lost.
  EXPECT_EQ(std::get<OffloadDone>(reports(hub(Offload{8, 3})).at(0)).copy, 3u);
  const AgentEffects opened = open_reply(2, OpenOk{2, std::nullopt});
  ASSERT_EQ(agent_.phase(), AgentPhase::kOpen);
  const std::vector<ReportBody> announced = reports(opened);
  ASSERT_EQ(announced.size(), 1u) << "copy 8 is named already";
  EXPECT_EQ(std::get<OffloadDone>(announced[0]).version, 9u);
  EXPECT_EQ(std::get<OffloadDone>(announced[0]).copy, 90u) << "under the id the open announced";
  // Repeated until answered; the repeated release frees it, and the reports stop.
  auto reported_9 = [&](TimeMs from, TimeMs to) {
    std::size_t count = 0;
    for (TimeMs t = from; t <= to; t += 50) {
      for (const ReportBody& body : reports(tick_at(t))) {
        const auto* offloaded = std::get_if<OffloadDone>(&body);
        if (offloaded != nullptr && offloaded->version == 9) ++count;
      }
    }
    return count;
  };
  EXPECT_GE(reported_9(0, 10000), 2u);
  EXPECT_EQ(only<FreeOffload>(hub(ReleaseOffload{9, 90})).version, 9u);
  EXPECT_EQ(reported_9(10050, 20000), 0u);
}

// th-sim seed 3308 (mixed, harsh-net): a seed's ReleaseOffload overtook its StartRead; the shard
// then read the seed, and kept a CPU copy nobody counted.
TEST_F(AgentTest, ASeedWhoseReleaseCameFirstIsNeverStarted) {
  open();
  publish(1, 4);
  EXPECT_TRUE(hub(ReleaseOffload{5, 50}).empty()) << "nothing of version 5 held yet";
  EXPECT_TRUE(hub(seed_read(7, 1, 5, 50)).empty()) << "overtaken by its release";
  EXPECT_EQ(only<BeginRead>(hub(seed_read(8, 1, 5, 51))).read.offload_copy, 51u) << "a later copy";
  // Remembered by version and id: the same number for another version is another copy (a
  // release of a number the open announced may echo an earlier server's id).
  EXPECT_EQ(only<BeginRead>(hub(seed_read(9, 1, 6, 50))).read.offload_copy, 50u);
}

TEST_F(AgentTest, ASeedIsReadOutsideAnyCallAndServedOnlyOnceWhole) {
  open();
  publish(1, 4);
  // No call in flight, and the registered buffers (version 4) are untouched.
  const BeginRead begin = only<BeginRead>(hub(seed_read(7, 1, 5, 50)));
  EXPECT_EQ(begin.read.offload_copy, 50u);
  ASSERT_TRUE(agent_.held().has_value());
  EXPECT_EQ(agent_.held()->version, 4u);
  EXPECT_TRUE(hub(seed_read(7, 1, 5, 50)).empty()) << "repeated while under way: nothing";
  EXPECT_TRUE(hub(ServeRead{9, 1, 5, CopyKind::kOffload, 0, "peer"}).empty()) << "not whole yet";
  // The buffers' own grant is unaffected.
  EXPECT_EQ(only<GrantServe>(hub(ServeRead{8, 1, 4, CopyKind::kPrimary, 0, "peer"})).grant.version, 4u);
  const std::vector<ReportBody> done = reports(step(ReadFinished{7, 1, std::nullopt}));
  ASSERT_EQ(done.size(), 2u);
  EXPECT_EQ(std::get<TransferDone>(done[0]).transfer, 7u);
  // Whole, it is an offload copy, reported as one (see below).
  EXPECT_EQ(std::get<OffloadDone>(done[1]).version, 5u);
  EXPECT_EQ(std::get<OffloadDone>(done[1]).copy, 50u);
  EXPECT_EQ(only<GrantServe>(hub(ServeRead{9, 2, 5, CopyKind::kOffload, 0, "peer"})).grant.version, 5u);
  // The transfer's report is sent once (no call's answer acknowledges it): not retransmitted;
  // answered again when the hub, which may have missed it, repeats the instruction. The copy's
  // report is repeated while the copy is held, so that a lost release is asked for again.
  std::size_t offload_reports = 0;
  for (TimeMs t = 0; t <= 10000; t += 50) {
    for (const ReportBody& body : reports(tick_at(t))) {
      EXPECT_FALSE(std::holds_alternative<TransferDone>(body)) << "at " << t;
      if (const auto* offloaded = std::get_if<OffloadDone>(&body)) {
        EXPECT_EQ(offloaded->copy, 50u);
        ++offload_reports;
      }
    }
  }
  EXPECT_GE(offload_reports, 2u);
  EXPECT_EQ(reports(hub(seed_read(7, 1, 5, 50))).size(), 1u);
  // A failover announces the whole seed like any offload copy.
  const AgentEffects lost = step(ServerLost{0});
  const Request reopen = requests(lost).at(0);
  const auto& resume = std::get<OpenRequest>(reopen.body).resume;
  ASSERT_NE(resume, nullptr);
  ASSERT_EQ(resume->offloads.size(), 1u);
  EXPECT_EQ(resume->offloads[0].version, 5u);
  EXPECT_EQ(resume->offloads[0].copy, 50u);
}

TEST_F(AgentTest, AFailedSeedReadIsReportedAgainWhenAskedAndReadAgainFromTheNextSource) {
  open();
  hub(seed_read(7, 1, 5, 50));
  const AgentEffects failed = step(ReadFinished{7, 1, ReadFailure::kSourceUnreachable});
  EXPECT_EQ(reports(failed).size(), 1u);
  // Sim find (th-sim 102489, harsh-net, once a lost instruction no longer excused kept memory):
  // the hub released the seed as it failed, the release was lost, and the failed seed's buffer,
  // waiting for a next source that never came, stayed for ever. A failed seed holds no buffer.
  EXPECT_EQ(only<FreeOffload>(failed).version, 5u);
  const std::vector<ReportBody> again = reports(hub(seed_read(7, 1, 5, 50)));
  ASSERT_EQ(again.size(), 1u);
  EXPECT_EQ(std::get<TransferFailed>(again[0]).reason, ReadFailure::kSourceUnreachable);
  EXPECT_EQ(only<BeginRead>(hub(seed_read(7, 2, 5, 50))).read.epoch, 2u);
  EXPECT_TRUE(reports(step(ReadFinished{7, 1, std::nullopt})).empty()) << "the old source's read";
  // Failed again, then released: its buffer is freed once, at the failure.
  EXPECT_EQ(only<FreeOffload>(step(ReadFinished{7, 2, ReadFailure::kChecksumMismatch})).version, 5u);
  const AgentEffects released = hub(ReleaseOffload{5, 50});
  EXPECT_TRUE(all_of<FreeOffload>(released).empty());
  EXPECT_TRUE(all_of<CancelRead>(released).empty()) << "its read ended";
}

TEST_F(AgentTest, AReleasedSeedStopsItsReadFreesItsBufferAndIsNeverStartedAgain) {
  open();
  hub(seed_read(7, 1, 5, 50));
  EXPECT_TRUE(hub(ReleaseOffload{5, 49}).empty()) << "another copy's release";
  const AgentEffects released = hub(ReleaseOffload{5, 50});
  EXPECT_EQ(only<CancelRead>(released).transfer, 7u);
  EXPECT_EQ(only<FreeOffload>(released).version, 5u);
  EXPECT_TRUE(hub(seed_read(7, 1, 5, 50)).empty()) << "late: about the released seed";
  EXPECT_TRUE(step(ReadFinished{7, 1, std::nullopt}).empty()) << "its read, finishing anyway";
  // A new seed of the same version (a later copy) starts afresh.
  EXPECT_EQ(only<BeginRead>(hub(seed_read(8, 1, 5, 51))).read.offload_copy, 51u);
  // A server loss drops a seed in progress: the next server knows nothing of it.
  const AgentEffects lost = step(ServerLost{0});
  EXPECT_EQ(only<CancelRead>(lost).transfer, 8u);
  EXPECT_EQ(only<FreeOffload>(lost).version, 5u);
  EXPECT_TRUE(std::get<OpenRequest>(requests(lost).at(0).body).resume->offloads.empty());
}

// Review find: an offload copy still being made when the session ended finished after a seed of
// the same version had started; the agent freed "the" buffer of that version: the seed's.
TEST_F(AgentTest, AnUnwantedOffloadNeverFreesTheBufferOfASeed) {
  open();
  publish(1, 5);
  hub(Offload{5, 80});
  step(ServerLost{0});
  open_reply(1, OpenOk{2, 5});
  ASSERT_EQ(agent_.phase(), AgentPhase::kOpen);
  EXPECT_EQ(only<BeginRead>(hub(seed_read(7, 1, 5, 50))).read.offload_copy, 50u);
  EXPECT_TRUE(all_of<FreeOffload>(step(OffloadFinished{5})).empty());
}

// Soak find (AgentModel, lossy network): an update failed after the hub told the shard to read,
// but that instruction was lost; the agent still called its untouched buffers published, the hub
// no longer did, and the application published new weights it never wrote.
TEST_F(AgentTest, AFailedUpdateTheHubSaysReleasedTheCopyHoldsNothingEvenUnread) {
  open();
  publish(1, 1);
  hub(ServeRead{4, 1, 1, CopyKind::kPrimary, 0, "reader"});
  call(UpdateRequest{Selector::latest(), layout_});
  Reply answer;
  answer.seq = 2;
  answer.outcome = make_error(Errc::kVersionUnavailable, "no copy of version 3 is left");
  answer.released = true;
  const AgentEffects effects = hub(answer);
  EXPECT_TRUE(std::holds_alternative<Error>(only<CallDone>(effects).outcome));
  EXPECT_FALSE(agent_.held().has_value());
  EXPECT_EQ(only<RevokeServe>(effects).transfer, 4u);
}

TEST_F(AgentTest, AFailedUpdateThatReleasedNothingKeepsTheCopy) {
  open();
  publish(1, 1);
  call(UpdateRequest{Selector::latest(), layout_});
  reply(2, make_error(Errc::kVersionUnavailable, "gone before anyone was told to read"));
  ASSERT_TRUE(agent_.held().has_value());
  EXPECT_EQ(agent_.held()->version, 1u);
}

TEST_F(AgentTest, CloseEndsEverything) {
  open();
  publish(1, 8);
  hub(Offload{8, 80});
  step(OffloadFinished{8});
  call(CloseRequest{});
  const AgentEffects closed = reply(2, CloseOk{});
  EXPECT_EQ(only<FreeOffload>(closed).version, 8u);
  EXPECT_EQ(agent_.phase(), AgentPhase::kClosed);
  EXPECT_FALSE(agent_.next_deadline_ms().has_value());
  const AgentEffects after = call(ListRequest{});
  EXPECT_EQ(std::get<Error>(only<CallDone>(after).outcome).code, Errc::kUnknownClient);
}

// th-sim --seed 720279 --workload cross-dc --faults partition=1,clog=1,delay=100 (issue 10,
// point 3): the hub sent a StartRead of call 10 again to the call's retransmission; the copy came
// after call 10 was answered, during call 11, and was obeyed: the buffers were rewritten while
// the hub (and the application) thought the shard held what call 10 brought.
TEST_F(AgentTest, AStartReadOfAnEarlierCallIsStale) {
  open();
  call(ReplicateRequest{Selector::latest(), layout_, 0});
  hub(start_read(1, 1, 8));
  step(ReadFinished{1, 1, std::nullopt});
  reply(1, ReplicateOk{8, "source"});
  call(UpdateRequest{Selector::latest(), layout_});
  const AgentEffects late = hub(start_read(1, 1, 8, /*call=*/1));
  EXPECT_TRUE(late.empty()) << "neither read nor revoke: the buffers keep version 8";
  ASSERT_TRUE(agent_.held().has_value());
  EXPECT_EQ(agent_.held()->version, 8u);
  EXPECT_EQ(only<BeginRead>(hub(start_read(2, 1, 9, /*call=*/2))).read.version, 9u);
}

// A late answer to an open is not a call's answer, nor a call's answer an open's.
TEST_F(AgentTest, AnswersToOpensAndToCallsAreNotConfused) {
  call(open_request());
  EXPECT_TRUE(reply(0, ListOk{}).empty()) << "a call's answer numbered like the open";
  EXPECT_EQ(agent_.phase(), AgentPhase::kOpening);
  open_reply(0, OpenOk{2, std::nullopt});
  call(ListRequest{});
  EXPECT_TRUE(open_reply(1, make_error(Errc::kAlreadyOpen, "late")).empty());
  EXPECT_EQ(only<CallDone>(reply(1, ListOk{})).call_id, call_id_);
}

// th-sim --seed 710240 --workload cross-dc --faults drop=0.05,crash=0.5,read-failure=0.1,
// server-crash=1 (issue 10, point 4): a restarted shard's own open was refused because its peers
// had moved the replica to incarnation 4 on their own; the application could only retry the
// number it knew, forever, while its peers' barrier timed out again and again.
TEST_F(AgentTest, TheApplicationsOpenJoinsTheNewerIncarnationTheHubNames) {
  call(open_request());  // incarnation 1
  const std::vector<Request> sent =
      requests(open_reply(0, make_error(Errc::kStaleIncarnation, "newer"), 4));
  ASSERT_EQ(sent.size(), 1u);
  const auto& again = std::get<OpenRequest>(sent[0].body);
  EXPECT_EQ(again.incarnation, 4u);
  EXPECT_EQ(again.resume, nullptr) << "still the application's fresh open";
  EXPECT_EQ(agent_.phase(), AgentPhase::kOpening);
  EXPECT_EQ(only<CallDone>(open_reply(0, OpenOk{2, std::nullopt})).call_id, call_id_);
  EXPECT_EQ(agent_.incarnation(), 4u);
}

// helper-22: one shard of two restarted alone, with the incarnation left to the hub. Its fresh open
// joined the replica its peer was resuming after the eviction, and the barrier answered
// kDivergentCall, which failed the application's open; the peer then waited for it for ever. Now
// the agent opens afresh again (bounded), to meet the peer when it starts over.
TEST_F(AgentTest, AnAutomaticIncarnationsOpenOpensAgainAfterADivergentBarrier) {
  OpenRequest automatic = open_request();
  automatic.incarnation_auto = true;
  call(automatic);
  for (std::uint32_t attempt = 0; attempt < 8; ++attempt) {
    const std::vector<Request> sent = requests(open_reply(0, make_error(Errc::kDivergentCall, "resumed at 0 and 37"), 2));
    ASSERT_EQ(sent.size(), 1u) << "attempt " << attempt;
    const auto& again = std::get<OpenRequest>(sent[0].body);
    EXPECT_TRUE(again.incarnation_auto);
    EXPECT_EQ(again.resume, nullptr) << "a fresh open, holding nothing";
  }
  // Bounded: the ninth refusal reaches the application.
  const AgentEffects refused = open_reply(0, make_error(Errc::kDivergentCall, "again"), 2);
  EXPECT_EQ(only<CallDone>(refused).call_id, call_id_);
  EXPECT_EQ(agent_.phase(), AgentPhase::kIdle);
}

// A named incarnation's open is not retried after kDivergentCall: the application chose it.
TEST_F(AgentTest, ANamedIncarnationsOpenFailsOnADivergentBarrier) {
  call(open_request());
  EXPECT_EQ(only<CallDone>(open_reply(0, make_error(Errc::kDivergentCall, "resumed at 0 and 37"), 2)).call_id, call_id_);
}

// A grant that arrives after its own withdrawal (messages crossed or repeated) is never served.
TEST_F(AgentTest, AGrantAfterItsStopServingIsStale) {
  open();
  publish(1, 2);
  EXPECT_EQ(only<GrantServe>(hub(ServeRead{1, 1, 2, CopyKind::kPrimary, 0, "a"})).grant.transfer, 1u);
  EXPECT_EQ(only<RevokeServe>(hub(StopServing{1, 1})).transfer, 1u);
  EXPECT_TRUE(hub(ServeRead{1, 1, 2, CopyKind::kPrimary, 0, "a"}).empty());
  EXPECT_EQ(only<GrantServe>(hub(ServeRead{1, 2, 2, CopyKind::kPrimary, 0, "a"})).grant.epoch, 2u);
}

// The hub numbers this shard's calls otherwise (a gap): the agent does not take that as the call's
// answer; it opens a new session, as after an eviction.
TEST_F(AgentTest, ASequenceGapIsNotAnAnswer) {
  open();
  call(ListRequest{});
  const AgentEffects gap = reply(1, make_error(Errc::kSequenceGap, "expected call 3"));
  EXPECT_EQ(std::get<Error>(only<CallDone>(gap).outcome).code, Errc::kSequenceGap);
  EXPECT_EQ(agent_.phase(), AgentPhase::kEvicted);
  EXPECT_EQ(agent_.last_seq(), 0u) << "the call did not take its number";
}

// The open may have bound the shard on the server that failed, and its peers made calls there: on
// the new server it resumes, holding nothing at call 0, so that the barrier gathers the replica.
TEST_F(AgentTest, AnOpenInFlightAtAFailoverResumesHoldingNothing) {
  call(open_request());
  const std::vector<Request> sent = requests(step(ServerLost{0}));
  ASSERT_EQ(sent.size(), 1u);
  EXPECT_EQ(sent[0].seq, 0u);
  const auto& open = std::get<OpenRequest>(sent[0].body);
  ASSERT_NE(open.resume, nullptr);
  EXPECT_TRUE(open.resume->nothing());
  const AgentEffects effects = open_reply(0, OpenOk{2, std::nullopt});
  EXPECT_EQ(only<CallDone>(effects).call_id, call_id_);
  EXPECT_EQ(agent_.starts(), 1u) << "the application's open begins a run of its program";
}

TEST_F(AgentTest, ClockMayNotGoBackwards) {
  tick_at(100);
  now_ms_ = 99;
  EXPECT_THROW(step(AgentTick{}), RequirementFailure);
}

// Readers found this shard's copy corrupt (issue 33, friction 1): the application is told, about
// its buffers or about an offload copy; nothing else of the agent changes.
TEST_F(AgentTest, ACopyFoundCorruptIsToldToTheApplication) {
  open();
  publish(1, 8);
  const CopyFoundCorrupt buffers = only<CopyFoundCorrupt>(hub(CopyCorrupt{8, 0}));
  EXPECT_EQ(buffers.version, 8u);
  EXPECT_FALSE(buffers.offload);
  const AgentEffects offload = hub(CopyCorrupt{8, 81});
  EXPECT_TRUE(only<CopyFoundCorrupt>(offload).offload);
  EXPECT_EQ(offload.size(), 1u) << "news only";
  ASSERT_TRUE(agent_.held().has_value());
  EXPECT_EQ(agent_.held()->version, 8u);
}


}  // namespace
}  // namespace th
