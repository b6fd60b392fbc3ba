// Unit tests of the Hub: each operation, each typed error, each mechanism of paper §3–§4.5. Every
// step also runs Hub::check_invariants and the Observer (see testkit/driver.h).
#include <gtest/gtest.h>

#include "tests/core/testkit/driver.h"

namespace th::test {
namespace {

ReplicaSpec trainer(std::string name, std::uint32_t shards = 2) {
  ReplicaSpec spec;
  spec.name = std::move(name);
  spec.num_shards = shards;
  spec.role = "trainer";
  return spec;
}

ReplicaSpec rollout(std::string name, std::uint32_t shards = 2, std::string datacenter = "dc0") {
  ReplicaSpec spec;
  spec.name = std::move(name);
  spec.num_shards = shards;
  spec.datacenter = std::move(datacenter);
  return spec;
}

ReplicateRequest replicate(Selector selector, std::uint32_t shard, TimeMs timeout_ms = 0) {
  return ReplicateRequest{selector, layout_for(shard), timeout_ms};
}

// Every shard calls replicate(selector).
void start_replicate(Driver& driver, const std::vector<ClientId>& shards, Selector selector) {
  for (std::uint32_t shard = 0; shard < shards.size(); ++shard) {
    driver.call(shards[shard], replicate(selector, shard));
  }
}

void start_update(Driver& driver, const std::vector<ClientId>& shards, Selector selector) {
  for (std::uint32_t shard = 0; shard < shards.size(); ++shard) {
    driver.call(shards[shard], UpdateRequest{selector, layout_for(shard)});
  }
}

// The source the hub told the reader's shard to read from.
std::optional<StartRead> read_of(Driver& driver, ClientId client) {
  const auto& reads = driver.inbox(client).reads;
  if (reads.empty()) return std::nullopt;
  return reads.rbegin()->second;
}

// A rollout of two shards opens in `datacenter` and replicates the latest version: its shards.
std::vector<ClientId> replicating(Driver& driver, std::string name, std::string datacenter) {
  const std::vector<ClientId> shards = driver.open_replica(rollout(std::move(name), 2, std::move(datacenter)));
  start_replicate(driver, shards, Selector::latest());
  return shards;
}

// The replica the hub told the first shard to read from ("(none)": none yet).
std::string source_of(Driver& driver, const std::vector<ClientId>& shards) {
  const std::optional<StartRead> read = read_of(driver, shards[0]);
  return read ? read->source.replica : "(none)";
}

std::string expect_error(const std::optional<Outcome>& outcome, Errc code) {
  if (!outcome) return "no reply";
  if (!is_error(*outcome, code)) return "got " + describe(*outcome);
  return {};
}

// The detail of an error of `code`, or what came instead.
std::string error_detail(const std::optional<Outcome>& outcome, Errc code) {
  if (const std::string unexpected = expect_error(outcome, code); !unexpected.empty()) return unexpected;
  return std::get<Error>(*outcome).detail;
}

// The listing of one replica of model m.
const ListSnapshot::ReplicaInfo& replica_info(Driver& driver, const std::string& name) {
  static std::optional<ListSnapshot> snapshot;
  snapshot = driver.hub().snapshot("m");
  for (const auto& info : snapshot->replicas) {
    if (info.name == name) return info;
  }
  throw std::runtime_error("no replica " + name);
}

// ---- open -----------------------------------------------------------------------------------------

TEST(HubOpen, RejectsMalformedRequests) {
  Driver driver;
  auto rejected = [&](OpenRequest request, Errc code) {
    const ClientId client = driver.new_client();
    driver.open(client, request);
    auto reply = driver.take_reply(client);
    EXPECT_TRUE(reply && is_error(reply->outcome, code))
        << (reply ? describe(reply->outcome) : "no reply");
  };
  OpenRequest request = driver.open_request(rollout("r"), 0);
  request.shard = 2;
  rejected(request, Errc::kInvalidArgument);
  request = driver.open_request(rollout("r"), 0);
  request.model.clear();
  rejected(request, Errc::kInvalidArgument);
  request = driver.open_request(rollout("r"), 0);
  request.num_shards = 0;
  rejected(request, Errc::kInvalidArgument);
  request = driver.open_request(rollout("r"), 0);
  request.retention.keep_latest = 1000;
  rejected(request, Errc::kLimitExceeded);
  EXPECT_EQ(driver.hub().client_count(), 0u);
}

TEST(HubOpen, TypedErrorsForConflictingOpens) {
  Driver driver;
  const auto shards = driver.open_replica(rollout("r"));
  // The same handle again, another num_shards for the replica, another datacenter for it,
  // a shard that is already open, an older incarnation.
  auto rejected = [&](ClientId client, const OpenRequest& request, Errc code) {
    driver.open(client, request, 5);
    auto reply = driver.take_reply(client);
    EXPECT_TRUE(reply && is_error(reply->outcome, code))
        << errc_name(code) << ": " << (reply ? describe(reply->outcome) : "no reply");
  };
  rejected(shards[0], driver.open_request(rollout("other"), 0), Errc::kAlreadyOpen);
  rejected(driver.new_client(), driver.open_request(rollout("r", 3), 0), Errc::kOpenMismatch);
  rejected(driver.new_client(), driver.open_request(rollout("r", 2, "dc9"), 0), Errc::kOpenMismatch);
  rejected(driver.new_client(), driver.open_request(rollout("r"), 1), Errc::kShardAlreadyOpen);
  ReplicaSpec old = rollout("r");
  old.incarnation = 0;
  rejected(driver.new_client(), driver.open_request(old, 0), Errc::kStaleIncarnation);
  EXPECT_EQ(driver.hub().client_count(), 2u);
}

TEST(HubOpen, NewIncarnationReplacesTheOldReplica) {
  Driver driver;
  const auto old_shards = driver.open_replica(trainer("t"));
  driver.publish(old_shards, 1);
  ReplicaSpec restarted = trainer("t");
  restarted.incarnation = 2;
  const auto new_shards = driver.open_replica(restarted);
  for (ClientId client : old_shards) {
    ASSERT_EQ(driver.inbox(client).evictions.size(), 1u);
    EXPECT_EQ(driver.inbox(client).evictions[0].reason, Errc::kReplicaEvicted);
  }
  // The restarted replica holds nothing: its copy of version 1 went with the old incarnation.
  driver.call_all(new_shards, UnpublishRequest{});
  EXPECT_EQ(expect_error(driver.replies(new_shards), Errc::kNotPublished), "");
}

// An open that lets the hub choose its incarnation (libthclient's default): 1 for a new replica;
// the next one where its shard is still held (a restarted process the hub has not seen leave),
// which replaces the replica; the current one where its shard is free (peers of a restart).
TEST(HubOpen, AnAutomaticIncarnationReplacesAHeldShardAndJoinsAFreeOne) {
  Driver driver;
  auto auto_open = [&](const std::string& name, std::uint32_t shard, std::uint32_t shards) {
    OpenRequest request = driver.open_request(rollout(name, shards), shard);
    request.model = shards == 1 ? "m" : "m2";  // a model's replicas have one shard count
    request.incarnation = 77;  // ignored
    request.incarnation_auto = true;
    const ClientId client = driver.new_client();
    driver.open(client, request, 0);
    auto reply = driver.take_reply(client);
    EXPECT_TRUE(reply && std::holds_alternative<OpenOk>(reply->outcome)) << (reply ? describe(reply->outcome) : "none");
    return std::pair{client, reply ? std::get<OpenOk>(reply->outcome).incarnation : 0};
  };
  const auto [first, first_incarnation] = auto_open("r", 0, 1);
  EXPECT_EQ(first_incarnation, 1U);
  // The process restarts; its old handle is still bound: replaced at once, as incarnation 2.
  const auto [second, second_incarnation] = auto_open("r", 0, 1);
  EXPECT_EQ(second_incarnation, 2U);
  ASSERT_EQ(driver.inbox(first).evictions.size(), 1U);
  EXPECT_EQ(driver.hub().client_count(), 1U);
  // A two-shard replica restarts: shard 0 replaces it, shard 1 joins the new incarnation.
  const auto [a0, a0_incarnation] = auto_open("two", 0, 2);
  const auto [a1, a1_incarnation] = auto_open("two", 1, 2);
  EXPECT_EQ(a0_incarnation, 1U);
  EXPECT_EQ(a1_incarnation, 1U);
  const auto [b0, b0_incarnation] = auto_open("two", 0, 2);
  EXPECT_EQ(b0_incarnation, 2U);
  EXPECT_EQ(driver.inbox(a0).evictions.size(), 1U);
  EXPECT_EQ(driver.inbox(a1).evictions.size(), 1U);
  const auto [b1, b1_incarnation] = auto_open("two", 1, 2);
  EXPECT_EQ(b1_incarnation, 2U);
  EXPECT_TRUE(driver.inbox(b1).evictions.empty());
  EXPECT_TRUE(driver.inbox(b0).evictions.empty()) << "joining does not evict";
  // Both shards of incarnation 2 make calls together.
  driver.call_all({b0, b1}, ListRequest{});
  EXPECT_TRUE(is<ListOk>(driver.replies({b0, b1})));
  // A named incarnation below the chosen one is stale, as before.
  OpenRequest named = driver.open_request(rollout("two", 2), 0);
  named.model = "m2";
  const ClientId late = driver.new_client();
  driver.open(late, named, 0);
  auto refused = driver.take_reply(late);
  ASSERT_TRUE(refused.has_value());
  EXPECT_TRUE(is_error(refused->outcome, Errc::kStaleIncarnation)) << describe(refused->outcome);
  EXPECT_EQ(refused->replica_incarnation, 2U);
  EXPECT_EQ(driver.hub().client_count(), 3U);
}

// ---- publish / unpublish --------------------------------------------------------------------------

TEST(HubPublish, VisibleOnlyWhenEveryShardPublished) {
  Driver driver;
  const auto shards = driver.open_replica(trainer("t", 3));
  driver.call(shards[0], PublishRequest{7, layout_for(0), checksums_for(7, 0)});
  driver.call(shards[1], PublishRequest{7, layout_for(1), checksums_for(7, 1)});
  EXPECT_FALSE(driver.has_reply(shards[0]));
  EXPECT_FALSE(driver.hub().latest("m").has_value());
  driver.call(shards[2], PublishRequest{7, layout_for(2), checksums_for(7, 2)});
  EXPECT_TRUE(is<PublishOk>(driver.replies(shards)));
  EXPECT_EQ(driver.hub().latest("m"), 7u);
}

TEST(HubPublish, TypedErrors) {
  Driver driver;
  const auto t = driver.open_replica(trainer("t"));
  const auto u = driver.open_replica(trainer("u"));
  driver.publish(t, 5);
  // Publishing while holding a version.
  driver.call(t[0], PublishRequest{6, layout_for(0), checksums_for(6, 0)});
  driver.call(t[1], PublishRequest{6, layout_for(1), checksums_for(6, 1)});
  EXPECT_EQ(expect_error(driver.replies(t), Errc::kAlreadyHolding), "");
  // Another replica may publish the same version (data-parallel trainers)…
  driver.publish(u, 5);
  // …but not with other bytes.
  driver.call_all(u, UnpublishRequest{});
  EXPECT_TRUE(is<UnpublishOk>(driver.replies(u)));
  driver.call(u[0], PublishRequest{5, layout_for(0), checksums_for(99, 0)});
  driver.call(u[1], PublishRequest{5, layout_for(1), checksums_for(5, 1)});
  EXPECT_EQ(expect_error(driver.replies(u), Errc::kChecksumConflict), "");
  // Nor a layout the model does not have.
  driver.call(u[0], PublishRequest{6, layout_for(0, 8192), checksums_for(6, 0)});
  driver.call(u[1], PublishRequest{6, layout_for(1), checksums_for(6, 1)});
  EXPECT_EQ(expect_error(driver.replies(u), Errc::kLayoutMismatch), "");
  // Versions increase within a model's life: below latest, a version the model knows is fine (a
  // slower data-parallel trainer publishing its peer's)…
  driver.call_all(t, UnpublishRequest{});
  EXPECT_TRUE(is<UnpublishOk>(driver.replies(t)));
  driver.publish(t, 7);
  driver.call_all(t, UnpublishRequest{});
  EXPECT_TRUE(is<UnpublishOk>(driver.replies(t)));
  driver.publish(u, 5);
  driver.call_all(u, UnpublishRequest{});
  EXPECT_TRUE(is<UnpublishOk>(driver.replies(u)));
  // …one it never saw is stale (publish(5); unpublish(); publish(3) had made latest name a version
  // nobody could read), with the way out in the error…
  driver.call(t[0], PublishRequest{3, layout_for(0), checksums_for(3, 0)});
  driver.call(t[1], PublishRequest{3, layout_for(1), checksums_for(3, 1)});
  const auto refused = driver.replies(t);
  ASSERT_EQ(expect_error(refused, Errc::kStaleVersion), "");
  const std::string& stale = std::get<Error>(*refused).detail;
  EXPECT_NE(stale.find("below latest 7"), std::string::npos) << stale;
  EXPECT_NE(stale.find("publishes above 7"), std::string::npos) << stale;
  // …and so is one it knew but forgot (further below latest than it remembers).
  const Version far = 5 + limits::kForgottenVersionsWindow + 10;
  driver.publish(t, far);
  driver.call_all(t, UnpublishRequest{});
  EXPECT_TRUE(is<UnpublishOk>(driver.replies(t)));
  driver.call(t[0], PublishRequest{5, layout_for(0), checksums_for(5, 0)});
  driver.call(t[1], PublishRequest{5, layout_for(1), checksums_for(5, 1)});
  EXPECT_EQ(expect_error(driver.replies(t), Errc::kStaleVersion), "");
  // Unpublishing what is not published.
  driver.call_all(t, UnpublishRequest{});
  EXPECT_EQ(expect_error(driver.replies(t), Errc::kNotPublished), "");
  EXPECT_EQ(driver.hub().latest("m"), far);
}

// Issue 32, finding 5: one publish(2^64-1) made every later publish of the model stale for ever
// (and the window's sums wrapped). The top of the range cannot be published.
TEST(HubPublish, NoVersionNearTwoToTheSixtyFourCanWedgeAModel) {
  Driver driver;
  const auto t = driver.open_replica(trainer("t"));
  driver.call(t[0], PublishRequest{UINT64_MAX, layout_for(0), checksums_for(1, 0)});
  driver.call(t[1], PublishRequest{UINT64_MAX, layout_for(1), checksums_for(1, 1)});
  const auto refused = driver.replies(t);
  ASSERT_EQ(expect_error(refused, Errc::kInvalidArgument), "");
  EXPECT_NE(std::get<Error>(*refused).detail.find("2^63-1"), std::string::npos) << describe(*refused);
  driver.publish(t, limits::kVersionMax);  // the largest is taken
  EXPECT_EQ(driver.hub().latest("m"), limits::kVersionMax);
  driver.call_all(t, UnpublishRequest{});
  EXPECT_TRUE(is<UnpublishOk>(driver.replies(t)));
  // Below it, judged without wrapping: the known version is taken again, an unknown one is stale.
  driver.publish(t, limits::kVersionMax);
  driver.call_all(t, UnpublishRequest{});
  EXPECT_TRUE(is<UnpublishOk>(driver.replies(t)));
  driver.call(t[0], PublishRequest{limits::kVersionMax - 1, layout_for(0), checksums_for(2, 0)});
  driver.call(t[1], PublishRequest{limits::kVersionMax - 1, layout_for(1), checksums_for(2, 1)});
  EXPECT_EQ(expect_error(driver.replies(t), Errc::kStaleVersion), "");
  // A pinned version past it is refused at open.
  OpenRequest pinning = driver.open_request(rollout("r"), 0);
  pinning.retention.pinned = {UINT64_MAX};
  const ClientId client = driver.new_client();
  driver.open(client, pinning);
  const auto reply = driver.take_reply(client);
  EXPECT_TRUE(reply && is_error(reply->outcome, Errc::kInvalidArgument)) << (reply ? describe(reply->outcome) : "no reply");
}

// Issue 32, finding 5: latest named a version with no copy left while an older one could be read
// ("no copy of version 5 is left" with 3 live and complete). latest-k now walks down to the newest
// version some copy has, and the answer names it; latest itself does not move back.
TEST(HubReplicate, LatestNamesTheNewestVersionACopyIsLeftOf) {
  Driver driver;
  const auto t = driver.open_replica(trainer("t"));
  const auto r = driver.open_replica(rollout("r"));
  driver.publish(t, 3);
  start_replicate(driver, r, Selector::latest());
  driver.finish_reads(r);
  ASSERT_TRUE(is<ReplicateOk>(driver.replies(r)));
  driver.call_all(t, UnpublishRequest{});
  EXPECT_TRUE(is<UnpublishOk>(driver.replies(t)));
  driver.publish(t, 5);
  driver.call_all(t, UnpublishRequest{});
  EXPECT_TRUE(is<UnpublishOk>(driver.replies(t)));  // nobody holds 5 now; r holds 3
  EXPECT_EQ(driver.hub().latest("m"), 5u);
  const auto late = driver.open_replica(rollout("late"));
  start_replicate(driver, late, Selector::latest());
  driver.finish_reads(late);
  const auto outcome = driver.replies(late);
  ASSERT_TRUE(is<ReplicateOk>(outcome)) << (outcome ? describe(*outcome) : "no reply");
  EXPECT_EQ(std::get<ReplicateOk>(*outcome).version, 3u);
  EXPECT_EQ(driver.hub().latest("m"), 5u);
  // With no copy of anything left, the error names latest's version and says nothing older is left.
  const auto empty = driver.open_replica(rollout("empty"));
  driver.call_all(r, CloseRequest{});
  EXPECT_TRUE(is<CloseOk>(driver.replies(r)));
  driver.call_all(late, CloseRequest{});
  EXPECT_TRUE(is<CloseOk>(driver.replies(late)));
  start_replicate(driver, empty, Selector::latest());
  const auto gone = driver.replies(empty);
  ASSERT_EQ(expect_error(gone, Errc::kVersionUnavailable), "");
  EXPECT_NE(std::get<Error>(*gone).detail.find("version 5) or of any older version"), std::string::npos)
      << describe(*gone);
}

// ---- model lives (issue 32, finding 1) ---------------------------------------------------------

// 64 short-lived replicas, each on its own model, left 64 empty models behind, and every later open
// of a new model was refused for ever; a model's shard count was fixed by its first open for ever.
// A model with no replica ends after its grace: its name is free, for any shape.
TEST(HubModelLife, AModelWithNoReplicaEndsAfterItsGraceAndItsNameIsFree) {
  HubSettings settings;
  settings.model_grace_ms = 5000;
  Driver driver(settings);
  const auto t = driver.open_replica(trainer("t"));
  driver.publish(t, 7);
  driver.call_all(t, UnpublishRequest{});
  EXPECT_TRUE(is<UnpublishOk>(driver.replies(t)));
  driver.call_all(t, CloseRequest{});
  EXPECT_TRUE(is<CloseOk>(driver.replies(t)));
  driver.advance(4000);
  EXPECT_EQ(driver.hub().latest("m"), 7u) << "ended before its grace";
  driver.advance(1100);
  EXPECT_TRUE(driver.hub().model_names().empty());
  EXPECT_EQ(driver.hub().stats().models_forgotten, 1u);
  // A run restarting from step 0, with another shard count: a new life.
  const auto again = driver.open_replica(trainer("t2", 4));
  driver.publish(again, 1);
  EXPECT_EQ(driver.hub().latest("m"), 1u);
}

TEST(HubModelLife, AModelWithAReplicaOrOneBackWithinTheGraceLivesOn) {
  HubSettings settings;
  settings.model_grace_ms = 5000;
  Driver driver(settings);
  const auto t = driver.open_replica(trainer("t"));
  driver.publish(t, 3);
  const auto r = driver.open_replica(rollout("r"));
  driver.call_all(r, CloseRequest{});
  EXPECT_TRUE(is<CloseOk>(driver.replies(r)));
  driver.advance(20'000);  // t heartbeats: it is still there
  EXPECT_EQ(driver.hub().latest("m"), 3u);
  driver.call_all(t, CloseRequest{});  // the last copy goes with it
  EXPECT_TRUE(is<CloseOk>(driver.replies(t)));
  driver.advance(3000);
  const auto back = driver.open_replica(rollout("back"));  // within the grace: the same life
  driver.advance(10'000);
  EXPECT_EQ(driver.hub().latest("m"), 3u);
  EXPECT_EQ(driver.hub().stats().models_forgotten, 0u);
  (void)back;
}

TEST(HubModelLife, TheModelLimitSaysWhenTheFirstIdleModelEnds) {
  HubSettings settings;
  settings.model_grace_ms = 5000;
  Driver driver(settings);
  for (std::size_t i = 0; i < limits::kModelsMax; ++i) {
    ReplicaSpec spec = trainer("t", 1);
    spec.model = "m" + std::to_string(i);
    const auto shards = driver.open_replica(spec);
    driver.call_all(shards, CloseRequest{});
    EXPECT_TRUE(is<CloseOk>(driver.replies(shards)));
  }
  ReplicaSpec next = trainer("t", 1);
  next.model = "one-more";
  const ClientId client = driver.new_client();
  driver.open(client, driver.open_request(next, 0));
  const auto refused = driver.take_reply(client);
  ASSERT_TRUE(refused && is_error(refused->outcome, Errc::kLimitExceeded)) << (refused ? describe(refused->outcome) : "no reply");
  const std::string& detail = std::get<Error>(refused->outcome).detail;
  EXPECT_NE(detail.find("64 of them with no replica; the first ends in"), std::string::npos) << detail;
  driver.advance(5100);
  EXPECT_EQ(driver.hub().model_names().size(), 0u);
  const auto opened = driver.open_replica(next);
  EXPECT_EQ(opened.size(), 1u);
}

// ---- tensor descriptions, counted and bounded (issue 32, finding 2) ------------------------------

// What the testkit's layout of shard `shard` costs (driver.h layout_for: "bias" [16] as a piece,
// "layer.<s>.weight" of one dimension), counted as ShardLayout::description_bytes says.
std::uint64_t testkit_description_bytes(std::uint32_t shard) {
  const std::string weight = "layer." + std::to_string(shard) + ".weight";
  return (limits::kTensorDescriptionOverheadBytes + 4 + 8 * 3) + (limits::kTensorDescriptionOverheadBytes + weight.size() + 8);
}

// One replica publishing 65,536 tensors a shard with 250-byte names took th-server from 8.8 MB to
// 369 MB, and nothing was returned. A model's descriptions are counted and bounded.
TEST(HubDescriptions, APublishPastTheModelsLimitIsRefusedNamingTheLimitAndKeepsNothing) {
  HubSettings settings;
  settings.model_description_bytes_max = testkit_description_bytes(0) + testkit_description_bytes(1) - 1;
  Driver driver(settings);
  EXPECT_EQ(layout_for(1)->description_bytes(), testkit_description_bytes(1)) << "the unit of account";
  const auto t = driver.open_replica(trainer("t"));
  for (std::uint32_t shard = 0; shard < t.size(); ++shard) {
    driver.call(t[shard], PublishRequest{1, layout_for(shard), checksums_for(1, shard)});
  }
  const auto refused = driver.replies(t);
  ASSERT_TRUE(refused && is_error(*refused, Errc::kLimitExceeded)) << (refused ? describe(*refused) : "no reply");
  EXPECT_NE(std::get<Error>(*refused).detail.find("--model-description-bytes-max"), std::string::npos)
      << std::get<Error>(*refused).detail;
  EXPECT_EQ(driver.hub().description_bytes("m"), 0u);
  EXPECT_EQ(driver.hub().description_bytes(), 0u);
  EXPECT_FALSE(driver.hub().latest("m").has_value());
}

TEST(HubDescriptions, TheServersLimitCountsEveryModelAndAModelsAreFreedWhenItEnds) {
  const std::uint64_t one_model = testkit_description_bytes(0) + testkit_description_bytes(1);
  HubSettings settings;
  settings.model_grace_ms = 1000;
  settings.model_description_bytes_max = one_model;
  settings.description_bytes_max = one_model + one_model / 2;
  Driver driver(settings);
  const auto first = driver.open_replica(trainer("t"));
  driver.publish(first, 1);
  EXPECT_EQ(driver.hub().description_bytes("m"), one_model);
  EXPECT_EQ(driver.hub().description_bytes(), one_model);

  ReplicaSpec other = trainer("t");
  other.model = "other";
  const auto second = driver.open_replica(other);
  for (std::uint32_t shard = 0; shard < second.size(); ++shard) {
    driver.call(second[shard], PublishRequest{1, layout_for(shard), checksums_for(1, shard)});
  }
  const auto refused = driver.replies(second);
  ASSERT_TRUE(refused && is_error(*refused, Errc::kLimitExceeded)) << (refused ? describe(*refused) : "no reply");
  // The server's limit refused it, not the model's.
  EXPECT_NE(std::get<Error>(*refused).detail.find("the server's models would keep"), std::string::npos)
      << std::get<Error>(*refused).detail;
  EXPECT_EQ(std::get<Error>(*refused).detail.find("--model-description-bytes-max"), std::string::npos)
      << std::get<Error>(*refused).detail;

  // The first model ends: its descriptions go with it, and the other's fit.
  driver.call_all(first, UnpublishRequest{});
  EXPECT_TRUE(is<UnpublishOk>(driver.replies(first)));
  driver.call_all(first, CloseRequest{});
  EXPECT_TRUE(is<CloseOk>(driver.replies(first)));
  driver.advance(1100);
  EXPECT_EQ(driver.hub().description_bytes(), 0u);
  driver.publish(second, 1);
  EXPECT_EQ(driver.hub().description_bytes(), one_model);
}

// ---- drains with a deadline (issue 32, finding 4) ------------------------------------------------

// A reader capped at 2 KB/s kept its trainer's unpublish waiting until the reader was killed. A
// draining copy's readers are sent elsewhere at its drain grace, and the call returns.
TEST(HubDrain, AReaderStillReadingAtTheDrainGraceIsSentElsewhereAndTheUnpublishReturns) {
  HubSettings settings;
  settings.drain_grace_ms = 2000;
  Driver driver(settings);
  const auto t = driver.open_replica(trainer("t"));
  driver.publish(t, 1);
  const auto held = driver.open_replica(rollout("held"));
  start_replicate(driver, held, Selector::latest());
  driver.finish_reads(held);
  ASSERT_TRUE(is<ReplicateOk>(driver.replies(held)));
  const auto slow = driver.open_replica(rollout("slow"));
  start_replicate(driver, slow, Selector::absolute(1));
  // (Held by the slow reader whichever source it got: make it read the trainer.)
  const auto first = read_of(driver, slow[0]);
  ASSERT_TRUE(first);
  driver.call_all(first->source.replica == "t" ? t : held, UnpublishRequest{});
  const auto& draining = first->source.replica == "t" ? t : held;
  driver.advance(1900);
  EXPECT_FALSE(driver.has_reply(draining[0])) << "revoked before the drain grace";
  driver.advance(200);
  EXPECT_TRUE(is<UnpublishOk>(driver.replies(draining)));
  EXPECT_EQ(driver.hub().stats().readers_revoked, 1u);  // one transfer (both shards' reads)
  // The reader goes on from the other holder, and finishes.
  const auto second = read_of(driver, slow[0]);
  ASSERT_TRUE(second);
  EXPECT_NE(second->source.replica, first->source.replica);
  driver.finish_reads(slow);
  const auto done = driver.replies(slow);
  ASSERT_TRUE(is<ReplicateOk>(done)) << (done ? describe(*done) : "no reply");
}

TEST(HubDrain, AReaderThatFinishesWithinTheGraceIsNotRevoked) {
  HubSettings settings;
  settings.drain_grace_ms = 2000;
  Driver driver(settings);
  const auto t = driver.open_replica(trainer("t"));
  driver.publish(t, 1);
  const auto r = driver.open_replica(rollout("r"));
  start_replicate(driver, r, Selector::latest());
  driver.call_all(t, UnpublishRequest{});
  driver.advance(1500);
  driver.finish_reads(r);
  EXPECT_TRUE(is<ReplicateOk>(driver.replies(r)));
  EXPECT_TRUE(is<UnpublishOk>(driver.replies(t)));
  driver.advance(1000);
  EXPECT_EQ(driver.hub().stats().readers_revoked, 0u);
}

TEST(HubPublish, ChecksumCountMustMatchTensors) {
  Driver driver;
  const auto t = driver.open_replica(trainer("t", 1));
  driver.call(t[0], PublishRequest{1, layout_for(0),
                                   std::make_shared<const Checksums>(Checksums{1, 2, 3})});
  EXPECT_EQ(expect_error(driver.replies(t), Errc::kInvalidArgument), "");
}

TEST(HubUnpublish, WaitsUntilInFlightReadsDrain) {
  Driver driver;
  const auto t = driver.open_replica(trainer("t"));
  const auto r = driver.open_replica(rollout("r"));
  driver.publish(t, 1);
  start_replicate(driver, r, Selector::latest());
  ASSERT_TRUE(read_of(driver, r[0]));
  EXPECT_EQ(driver.inbox(t[0]).grants.size(), 1u);
  driver.call_all(t, UnpublishRequest{});
  EXPECT_FALSE(driver.has_reply(t[0])) << "unpublish must wait for the reader";
  // The unpublished copy is not offered to new readers meanwhile.
  const auto late = driver.open_replica(rollout("late"));
  start_replicate(driver, late, Selector::latest());
  EXPECT_EQ(read_of(driver, late[0])->source.replica, "r");
  driver.finish_reads(r);
  EXPECT_TRUE(is<ReplicateOk>(driver.replies(r)));
  EXPECT_TRUE(is<UnpublishOk>(driver.replies(t)));
  EXPECT_TRUE(driver.inbox(t[0]).grants.empty());
}

// ---- replicate ------------------------------------------------------------------------------------

TEST(HubReplicate, BlocksUntilTheVersionExistsThenCopiesIt) {
  Driver driver;
  const auto t = driver.open_replica(trainer("t"));
  const auto r = driver.open_replica(rollout("r"));
  start_replicate(driver, r, Selector::latest());
  EXPECT_FALSE(read_of(driver, r[0]));
  driver.publish(t, 4);
  const auto read = read_of(driver, r[1]);
  ASSERT_TRUE(read);
  EXPECT_EQ(read->version, 4u);
  EXPECT_EQ(read->shard, 1u);
  EXPECT_EQ(read->source.replica, "t");
  EXPECT_EQ(read->source.endpoint, "tcp://t/1");
  EXPECT_FALSE(read->source.partial);
  EXPECT_EQ(*read->checksums, *checksums_for(4, 1));
  driver.finish_reads({r[0]});
  EXPECT_FALSE(driver.has_reply(r[0])) << "replicate answers when every shard has its bytes";
  driver.finish_reads({r[1]});
  const auto outcome = driver.replies(r);
  ASSERT_TRUE(is<ReplicateOk>(outcome));
  EXPECT_EQ(std::get<ReplicateOk>(*outcome).version, 4u);
  EXPECT_EQ(std::get<ReplicateOk>(*outcome).source_replica, "t");
}

// Data-plane grants are capabilities: the source and the reader of a transfer get the same secret,
// every transfer (and epoch) another one, and they depend on the server's key.
TEST(HubReplicate, EachGrantCarriesASecretOnlyItsSourceAndReaderShare) {
  auto secrets = [](std::array<std::uint64_t, 2> server_key) {
    HubSettings settings;
    settings.grant_secret_key = server_key;
    Driver driver(settings);
    const auto t = driver.open_replica(trainer("t"));
    driver.publish(t, 4);
    std::vector<ClientId> readers;
    for (const char* name : {"r1", "r2"}) {
      const auto r = driver.open_replica(rollout(name));
      start_replicate(driver, r, Selector::latest());
      readers.insert(readers.end(), r.begin(), r.end());
    }
    std::map<std::pair<TransferId, std::uint32_t>, GrantSecret> granted;
    std::vector<ClientId> everyone = readers;  // (a reader may source another: pipeline replication)
    everyone.insert(everyone.end(), t.begin(), t.end());
    for (ClientId source : everyone) {
      for (const auto& [transfer_shard, grant] : driver.inbox(source).grants) {
        granted[{grant.transfer, grant.epoch}] = grant.secret;
      }
    }
    for (ClientId reader : readers) {
      const auto read = read_of(driver, reader);
      EXPECT_TRUE(read.has_value());
      if (!read) continue;
      const auto grant = granted.find({read->transfer, read->epoch});
      EXPECT_TRUE(grant != granted.end()) << "a read without its source's grant";
      if (grant != granted.end()) {
        EXPECT_EQ(read->secret, grant->second) << "reader and source disagree";
      }
    }
    return granted;
  };
  const auto granted = secrets({0x0123456789abcdefULL, 0xfedcba9876543210ULL});
  ASSERT_EQ(granted.size(), 2u) << "two transfers, one epoch each";
  EXPECT_NE(granted.begin()->second, std::next(granted.begin())->second);
  for (const auto& [transfer_epoch, secret] : granted) EXPECT_NE(secret, (GrantSecret{0, 0}));
  const auto rekeyed = secrets({0x0123456789abcdefULL, 0xfedcba9876543211ULL});
  ASSERT_EQ(rekeyed.size(), granted.size());
  EXPECT_EQ(rekeyed.begin()->first, granted.begin()->first) << "the same transfers";
  EXPECT_NE(rekeyed.begin()->second, granted.begin()->second) << "another server key, another secret";
}

TEST(HubReplicate, SelectorsResolveAgainstLatest) {
  Driver driver;
  const auto t = driver.open_replica(trainer("t"));
  for (Version version : {1, 2, 3}) {
    driver.publish(t, version);
    if (version < 3) {
      driver.call_all(t, UnpublishRequest{});
      EXPECT_TRUE(is<UnpublishOk>(driver.replies(t)));
    }
  }
  const auto r = driver.open_replica(rollout("r"));
  // latest-5 reaches below version 0; version 1 has no copy left; latest-0 == latest.
  start_replicate(driver, r, Selector::latest(5));
  EXPECT_EQ(expect_error(driver.replies(r), Errc::kVersionNotFound), "");
  start_replicate(driver, r, Selector::absolute(1));
  EXPECT_EQ(expect_error(driver.replies(r), Errc::kVersionUnavailable), "");
  start_replicate(driver, r, Selector::latest(0));
  EXPECT_EQ(read_of(driver, r[0])->version, 3u);
}

// latest-k names the k-th newest version that exists, not latest minus k: trainers skip numbers.
TEST(HubReplicate, LatestMinusKCountsOnlyVersionsThatExist) {
  Driver driver;
  ReplicaSpec spec = trainer("t");
  spec.retention.keep_latest = 1;  // keeps latest-0 and latest-1: versions 7 and 4 below
  const auto t = driver.open_replica(spec);
  ReplicaSpec other_spec = trainer("u");
  const auto u = driver.open_replica(other_spec);
  for (Version version : {2, 4, 7}) {
    driver.publish(t, version);
    driver.publish(u, version);  // so that nothing offloads: u holds every version too
    driver.call_all(t, UnpublishRequest{});
    EXPECT_TRUE(is<UnpublishOk>(driver.replies(t)));
    if (version != 7) {
      driver.call_all(u, UnpublishRequest{});
      driver.finish_offloads(u);
      EXPECT_TRUE(is<UnpublishOk>(driver.replies(u)));
    }
  }
  EXPECT_TRUE(driver.hub().retained("m", 7));
  EXPECT_TRUE(driver.hub().retained("m", 4)) << "latest-1 is version 4";
  EXPECT_FALSE(driver.hub().retained("m", 6)) << "version 6 never existed";
  EXPECT_FALSE(driver.hub().retained("m", 2));
  const auto r = driver.open_replica(rollout("r"));
  start_replicate(driver, r, Selector::latest(1));
  ASSERT_TRUE(read_of(driver, r[0]));
  EXPECT_EQ(read_of(driver, r[0])->version, 4u) << "from the offload copy u made";
  driver.finish_reads(r);
  const auto outcome = driver.replies(r);
  ASSERT_TRUE(is<ReplicateOk>(outcome));
  EXPECT_EQ(std::get<ReplicateOk>(*outcome).version, 4u);
  const auto r2 = driver.open_replica(rollout("r2"));
  start_replicate(driver, r2, Selector::latest(3));  // only three versions exist
  EXPECT_EQ(expect_error(driver.replies(r2), Errc::kVersionNotFound), "");
  start_replicate(driver, r2, Selector::latest(2));
  EXPECT_EQ(expect_error(driver.replies(r2), Errc::kVersionUnavailable), "") << "version 2 went";
  // r holds the last copy of retained version 4 (u's offload copy went once r held it): it may
  // leave all the same, taking version 4 with it; latest-1 then names no version with a copy.
  driver.call_all(r, CloseRequest{});
  EXPECT_TRUE(is<CloseOk>(driver.replies(r)));
  EXPECT_EQ(driver.hub().stats().retained_versions_left, 1u);
  start_replicate(driver, r2, Selector::latest(1));
  EXPECT_EQ(error_detail(driver.replies(r2), Errc::kVersionUnavailable),
            "no copy of latest-1 (version 4) or of any older version is left (its last non-spot copy left with "
            "replica 'r' (incarnation 1), which closed)");
}

TEST(HubReplicate, SkippedVersionIsNotFoundOnceLatestPassesIt) {
  Driver driver;
  const auto t = driver.open_replica(trainer("t"));
  const auto r = driver.open_replica(rollout("r"));
  start_replicate(driver, r, Selector::absolute(2));
  driver.publish(t, 1);
  EXPECT_FALSE(driver.has_reply(r[0]));
  driver.call_all(t, UnpublishRequest{});
  EXPECT_TRUE(is<UnpublishOk>(driver.replies(t)));
  driver.publish(t, 3);
  EXPECT_EQ(expect_error(driver.replies(r), Errc::kVersionNotFound), "");
}

TEST(HubReplicate, LayoutMismatchIsATypedError) {
  Driver driver;
  const auto t = driver.open_replica(trainer("t"));
  driver.publish(t, 1);
  const auto r = driver.open_replica(rollout("r"));
  driver.call(r[0], ReplicateRequest{Selector::latest(), layout_for(0, 1024), 0});
  driver.call(r[1], replicate(Selector::latest(), 1));
  EXPECT_EQ(expect_error(driver.replies(r), Errc::kLayoutMismatch), "");
  EXPECT_TRUE(driver.inbox(t[0]).grants.empty()) << "nothing is transferred";
}

LayoutRef pieces_of_w(Box box) {
  TensorSpec spec{"w", DType::kBFloat16, element_count(box.extent) * 2};
  spec.kind = TensorKind::kPiece;
  spec.shape = {64, 64};
  spec.box = std::move(box);
  return ShardLayout::make({spec}).value();
}

ChecksumsRef one_checksum(std::uint64_t value) { return std::make_shared<const Checksums>(Checksums{value}); }

TEST(HubPublish, PiecesThatOverlapAreRefusedOnEveryShardAndFixNoLayout) {
  Driver driver;
  const auto t = driver.open_replica(trainer("t"));
  driver.call(t[0], PublishRequest{1, pieces_of_w(Box{{0, 0}, {40, 64}}), one_checksum(1)});
  driver.call(t[1], PublishRequest{1, pieces_of_w(Box{{32, 0}, {32, 64}}), one_checksum(2)});
  const auto refused = driver.replies(t);  // one answer, the same on both shards
  ASSERT_EQ(expect_error(refused, Errc::kLayoutMismatch), "");
  const std::string said = describe(*refused);
  EXPECT_NE(said.find("tensor 'w'"), std::string::npos) << said;
  EXPECT_NE(said.find("overlap in [32:40, 0:64]"), std::string::npos) << said;
  EXPECT_FALSE(driver.hub().latest("m").has_value()) << "a refused publish makes no version";
  // The layout was not fixed by the refused publish: the right tiling is taken.
  driver.call(t[0], PublishRequest{1, pieces_of_w(Box{{0, 0}, {32, 64}}), one_checksum(1)});
  driver.call(t[1], PublishRequest{1, pieces_of_w(Box{{32, 0}, {32, 64}}), one_checksum(2)});
  EXPECT_TRUE(is<PublishOk>(driver.replies(t)));
  // A reader whose pieces overlap one another is told which and where (it would be a source too).
  const auto r = driver.open_replica(rollout("r"));
  driver.call(r[0], ReplicateRequest{Selector::latest(), pieces_of_w(Box{{0, 0}, {32, 64}}), 0});
  driver.call(r[1], ReplicateRequest{Selector::latest(), pieces_of_w(Box{{0, 32}, {64, 32}}), 0});
  const auto mismatched = driver.replies(r);
  ASSERT_EQ(expect_error(mismatched, Errc::kLayoutMismatch), "");
  EXPECT_NE(describe(*mismatched).find("tensor 'w': boxes [0:32, 0:64] and [0:64, 32:64] overlap in [0:32, 32:64]"),
            std::string::npos)
      << describe(*mismatched);
}

LayoutRef w_as_bytes() { return ShardLayout::make({TensorSpec{"w", DType::kBFloat16, 32 * 64 * 2}}).value(); }

LayoutRef w_of_shape(Shape shape) {
  TensorSpec spec{"w", DType::kBFloat16, 32 * 64 * 2};
  spec.kind = TensorKind::kLocal;
  spec.shape = std::move(shape);
  return ShardLayout::make({spec}).value();
}

TEST(HubReplicate, AReplicaThatSaidMoreBindsThoseAfterIt) {
  // The first publisher says only bytes; the second says 32×64. A reader of 64×32 matched the
  // first alone, but would read the second's bytes: refused (it used to load them).
  Driver driver;
  const auto a = driver.open_replica(trainer("a"));
  const auto b = driver.open_replica(trainer("b"));
  for (std::uint32_t shard = 0; shard < 2; ++shard) driver.call(a[shard], PublishRequest{1, w_as_bytes(), one_checksum(1)});
  EXPECT_TRUE(is<PublishOk>(driver.replies(a)));
  for (std::uint32_t shard = 0; shard < 2; ++shard) driver.call(b[shard], PublishRequest{1, w_of_shape({32, 64}), one_checksum(1)});
  EXPECT_TRUE(is<PublishOk>(driver.replies(b)));
  const auto r = driver.open_replica(rollout("r"));
  for (std::uint32_t shard = 0; shard < 2; ++shard) driver.call(r[shard], ReplicateRequest{Selector::latest(), w_of_shape({64, 32}), 0});
  const auto refused = driver.replies(r);
  ASSERT_EQ(expect_error(refused, Errc::kLayoutMismatch), "");
  EXPECT_NE(describe(*refused).find("tensor 'w': shape [32, 64] in the model, [64, 32] here"), std::string::npos)
      << describe(*refused);
}

TEST(HubReplicate, AReaderWhosePiecesOverlapIsRefusedBeforeItReads) {
  Driver driver;
  const auto t = driver.open_replica(trainer("t"));
  for (std::uint32_t shard = 0; shard < 2; ++shard) driver.call(t[shard], PublishRequest{1, w_of_shape({32, 64}), one_checksum(1)});
  EXPECT_TRUE(is<PublishOk>(driver.replies(t)));
  const auto r = driver.open_replica(rollout("r"));
  TensorSpec top{"w", DType::kBFloat16, 32 * 64 * 2};
  top.kind = TensorKind::kPiece;
  top.shape = {64, 64};
  top.box = Box{{0, 0}, {32, 64}};
  const LayoutRef both_top = ShardLayout::make({top}).value();
  for (std::uint32_t shard = 0; shard < 2; ++shard) driver.call(r[shard], ReplicateRequest{Selector::latest(), both_top, 0});
  // Both shards holding rows 0:32 is one box held twice (a replicated tensor), but then rows
  // 32:64 are nobody's.
  const auto refused = driver.replies(r);
  ASSERT_EQ(expect_error(refused, Errc::kLayoutMismatch), "");
  EXPECT_NE(describe(*refused).find("2048 of the 4096 elements"), std::string::npos) << describe(*refused);
  EXPECT_TRUE(driver.inbox(t[0]).grants.empty()) << "nothing is transferred";
}

TEST(HubPublish, PiecesWithAGapAreRefused) {
  Driver driver;
  const auto t = driver.open_replica(trainer("t"));
  driver.call(t[0], PublishRequest{1, pieces_of_w(Box{{0, 0}, {32, 64}}), one_checksum(1)});
  driver.call(t[1], PublishRequest{1, pieces_of_w(Box{{32, 0}, {16, 64}}), one_checksum(2)});
  const auto refused = driver.replies(t);
  ASSERT_EQ(expect_error(refused, Errc::kLayoutMismatch), "");
  EXPECT_NE(describe(*refused).find("3072 of the 4096 elements"), std::string::npos) << describe(*refused);
}

TEST(HubReplicate, TimeoutIsATypedError) {
  Driver driver;
  const auto r = driver.open_replica(rollout("r"));
  for (std::uint32_t shard = 0; shard < 2; ++shard) {
    driver.call(r[shard], replicate(Selector::latest(), shard, 500));
  }
  driver.advance(400);
  EXPECT_FALSE(driver.has_reply(r[0]));
  driver.advance(200);
  EXPECT_EQ(expect_error(driver.replies(r), Errc::kTimeout), "");
}

TEST(HubReplicate, WhileHoldingIsATypedError) {
  Driver driver;
  const auto t = driver.open_replica(trainer("t"));
  driver.publish(t, 1);
  start_replicate(driver, t, Selector::latest());
  EXPECT_EQ(expect_error(driver.replies(t), Errc::kAlreadyHolding), "");
}

// ---- pipeline, load balancing, topology -----------------------------------------------------------

TEST(HubPipeline, ReadersChainFromPartialSources) {
  Driver driver;  // pipeline on, fan-out 1
  const auto t = driver.open_replica(trainer("t"));
  driver.publish(t, 1);
  std::vector<std::vector<ClientId>> readers;
  for (int i = 0; i < 4; ++i) {
    readers.push_back(driver.open_replica(rollout("r" + std::to_string(i))));
    start_replicate(driver, readers.back(), Selector::latest());
  }
  // t -> r0 -> r1 -> r2 -> r3, each a partial source for the next.
  EXPECT_EQ(read_of(driver, readers[0][0])->source.replica, "t");
  EXPECT_FALSE(read_of(driver, readers[0][0])->source.partial);
  for (int i = 1; i < 4; ++i) {
    const auto read = read_of(driver, readers[i][0]);
    EXPECT_EQ(read->source.replica, "r" + std::to_string(i - 1));
    EXPECT_TRUE(read->source.partial);
  }
  // They finish in any order.
  for (int i = 3; i >= 0; --i) {
    driver.finish_reads(readers[i]);
    EXPECT_TRUE(is<ReplicateOk>(driver.replies(readers[i])));
  }
}

TEST(HubPipeline, WithoutPipelineOnlyCompleteCopiesServeUpToTheFanOut) {
  HubSettings settings;
  settings.pipeline = false;
  settings.fanout_max = 2;
  Driver driver(settings);
  const auto t = driver.open_replica(trainer("t"));
  driver.publish(t, 1);
  std::vector<std::vector<ClientId>> readers;
  for (int i = 0; i < 3; ++i) {
    readers.push_back(driver.open_replica(rollout("r" + std::to_string(i))));
    start_replicate(driver, readers.back(), Selector::latest());
  }
  EXPECT_EQ(read_of(driver, readers[0][0])->source.replica, "t");
  EXPECT_EQ(read_of(driver, readers[1][0])->source.replica, "t");
  EXPECT_FALSE(read_of(driver, readers[2][0])) << "the third reader waits for a free source";
  driver.finish_reads(readers[0]);
  EXPECT_TRUE(is<ReplicateOk>(driver.replies(readers[0])));
  // r0 is now complete and least loaded.
  EXPECT_EQ(read_of(driver, readers[2][0])->source.replica, "r0");
}

TEST(HubTopology, PrefersTheReadersDatacenterAndSeedsOncePerDatacenter) {
  Driver driver;
  const auto t = driver.open_replica(trainer("t"));  // dc0
  driver.publish(t, 1);
  const auto far1 = driver.open_replica(rollout("far1", 2, "dc1"));
  start_replicate(driver, far1, Selector::latest());
  EXPECT_EQ(read_of(driver, far1[0])->source.replica, "t");
  EXPECT_EQ(read_of(driver, far1[0])->source.datacenter, "dc0");
  // The second reader in dc1 reads from the seeding replica, not across datacenters (once the
  // seeder is complete: smart skipping).
  const auto far2 = driver.open_replica(rollout("far2", 2, "dc1"));
  start_replicate(driver, far2, Selector::latest());
  EXPECT_FALSE(read_of(driver, far2[0]));
  driver.finish_reads(far1);
  EXPECT_TRUE(is<ReplicateOk>(driver.replies(far1)));
  EXPECT_EQ(read_of(driver, far2[0])->source.replica, "far1");
  // A reader in dc0 reads from dc0 even though far1/far2 are idle in dc1.
  const auto near = driver.open_replica(rollout("near", 2, "dc0"));
  driver.finish_reads(far2);
  EXPECT_TRUE(is<ReplicateOk>(driver.replies(far2)));
  start_replicate(driver, near, Selector::latest());
  EXPECT_EQ(read_of(driver, near[0])->source.replica, "t");
}

// Issue 34: a seeder's read across datacenters (slow: TCP through the VPC) does not take the slot
// the readers of the source's own datacenter need. The fan-out limit counts each side apart.
TEST(HubTopology, ASeedAcrossDatacentersDoesNotTakeTheLocalReadersSlot) {
  Driver driver;  // pipeline on, fan-out 1
  const auto t = driver.open_replica(trainer("t"));  // dc0
  driver.publish(t, 1);
  const auto far = replicating(driver, "far", "dc1");
  EXPECT_EQ(source_of(driver, far), "t");
  // The side across is limited too: a reader of a third datacenter waits, since the trainer
  // serves one reader across already and nobody reads behind a copy still crossing datacenters.
  const auto third = replicating(driver, "third", "dc2");
  EXPECT_FALSE(read_of(driver, third[0])) << "the trainer's slot across datacenters is taken";
  // A local reader joins while the seed crosses: it reads the trainer too, at once.
  const auto near = replicating(driver, "near", "dc0");
  const auto near_read = read_of(driver, near[0]);
  ASSERT_TRUE(near_read) << "a local reader must not queue behind a seed across datacenters";
  EXPECT_EQ(near_read->source.replica, "t");
  EXPECT_FALSE(near_read->source.partial);
  // near's chain stays in dc0: the third datacenter's reader pipelines from it across.
  ASSERT_TRUE(read_of(driver, third[0]));
  EXPECT_EQ(read_of(driver, third[0])->source.replica, "near");
  // near serves one reader across and none here: a second local reader pipelines from it too.
  const auto near2 = replicating(driver, "near2", "dc0");
  EXPECT_EQ(source_of(driver, near2), "near");
  for (const auto& reader : {far, near, near2, third}) {
    driver.finish_reads(reader);
    EXPECT_TRUE(is<ReplicateOk>(driver.replies(reader)));
  }
  EXPECT_EQ(driver.hub().stats().transfers_started, 4u);
}

// Least loaded, counting the readers that share what a new reader takes: a rollout that joins
// while the end of the chain seeds another datacenter reads that end (no reader here), not the
// trainer, which already feeds the chain: sharing the trainer would halve the pace of everyone on
// the chain (th-plan --fanout 2 --spot 2 --remote 2 --nic-jitter 0.99 --seed 5: 98.9 -> 172.2 GPU-s
// in the second version, when a joiner shared a trainer whose NIC set the chain's pace).
TEST(HubTopology, AJoinerReadsTheChainsEndThatSeedsAcrossRatherThanShareTheTrainer) {
  HubSettings settings;
  settings.fanout_max = 2;
  Driver driver(settings);
  const auto t = driver.open_replica(trainer("t"));  // dc0
  driver.publish(t, 1);
  const auto near = replicating(driver, "near", "dc0");
  EXPECT_EQ(source_of(driver, near), "t");
  // near is the least loaded copy here and across (no reader), partial: it seeds dc1.
  const auto far = replicating(driver, "far", "dc1");
  EXPECT_EQ(source_of(driver, far), "near");
  // Each copy here has one reader: near's reads across, the trainer's here.
  const auto joiner = replicating(driver, "joiner", "dc0");
  EXPECT_EQ(source_of(driver, joiner), "near");
  for (const auto& reader : {near, far, joiner}) {
    driver.finish_reads(reader);
    EXPECT_TRUE(is<ReplicateOk>(driver.replies(reader)));
  }
}

TEST(HubTopology, WithoutPipelineASecondReaderWaitsForTheSeederInsteadOfSeedingAgain) {
  HubSettings settings;
  settings.pipeline = false;
  settings.fanout_max = 4;
  Driver driver(settings);
  const auto t = driver.open_replica(trainer("t"));
  driver.publish(t, 1);
  const auto far1 = driver.open_replica(rollout("far1", 2, "dc1"));
  const auto far2 = driver.open_replica(rollout("far2", 2, "dc1"));
  start_replicate(driver, far1, Selector::latest());
  start_replicate(driver, far2, Selector::latest());
  EXPECT_EQ(read_of(driver, far1[0])->source.replica, "t");
  EXPECT_FALSE(read_of(driver, far2[0])) << "far2 must not pull across datacenters a second time";
  driver.finish_reads(far1);
  EXPECT_EQ(read_of(driver, far2[0])->source.replica, "far1");
}

TEST(HubTopology, SmartSkippingAnswersNotYetWhileTheSeederFetches) {
  Driver driver;
  const auto t = driver.open_replica(trainer("t"));
  const auto seeder = driver.open_replica(rollout("seeder", 2, "dc1"));
  const auto poller = driver.open_replica(rollout("poller", 2, "dc1"));
  driver.publish(t, 1);
  start_replicate(driver, poller, Selector::latest());
  driver.finish_reads(poller);  // poller holds version 1 (it seeded it)
  EXPECT_TRUE(is<ReplicateOk>(driver.replies(poller)));
  driver.call_all(t, UnpublishRequest{});
  EXPECT_TRUE(is<UnpublishOk>(driver.replies(t)));
  driver.publish(t, 2);
  start_replicate(driver, seeder, Selector::latest());  // seeds version 2 into dc1
  EXPECT_EQ(read_of(driver, seeder[0])->source.datacenter, "dc0");
  start_update(driver, poller, Selector::latest());
  auto outcome = driver.replies(poller);
  ASSERT_TRUE(is<UpdateOk>(outcome));
  EXPECT_EQ(std::get<UpdateOk>(*outcome).status, UpdateStatus::kNotYet);
  EXPECT_EQ(std::get<UpdateOk>(*outcome).version, 1u);
  driver.finish_reads(seeder);
  EXPECT_TRUE(is<ReplicateOk>(driver.replies(seeder)));
  start_update(driver, poller, Selector::latest());
  EXPECT_EQ(read_of(driver, poller[0])->source.replica, "seeder");
}

// Smart skipping applies to replicate too: a replicate in a datacenter whose only copy is a
// seeder still crossing datacenters does not pipeline behind it (nor seed again); it waits until
// the seeder is complete and then reads at local speed.
TEST(HubTopology, SmartSkippingMakesReplicateWaitForTheSeeder) {
  Driver driver;
  const auto t = driver.open_replica(trainer("t"));
  const auto seeder = driver.open_replica(rollout("seeder", 2, "dc1"));
  const auto late = driver.open_replica(rollout("late", 2, "dc1"));
  driver.publish(t, 1);
  start_replicate(driver, seeder, Selector::latest());
  EXPECT_EQ(read_of(driver, seeder[0])->source.replica, "t");
  start_replicate(driver, late, Selector::latest());
  EXPECT_FALSE(read_of(driver, late[0])) << "late neither chains behind the seeder nor seeds again";
  driver.finish_reads(seeder);
  EXPECT_TRUE(is<ReplicateOk>(driver.replies(seeder)));
  const auto read = read_of(driver, late[0]);
  ASSERT_TRUE(read);
  EXPECT_EQ(read->source.replica, "seeder");
  EXPECT_FALSE(read->source.partial);
}

// Property-test find (three datacenters): a reader in dc2 pipelined from a copy in dc0 that was
// still seeding from dc1. With smart skipping nobody reads behind a copy still crossing
// datacenters, whichever datacenter that copy is in.
TEST(HubTopology, SmartSkippingAlsoKeepsAThirdDatacenterFromPipeliningBehindASeeder) {
  Driver driver;
  const auto t = driver.open_replica(trainer("t"));  // dc0
  const auto seeder = driver.open_replica(rollout("seeder", 2, "dc1"));
  const auto third = driver.open_replica(rollout("third", 2, "dc2"));
  driver.publish(t, 1);
  start_replicate(driver, seeder, Selector::latest());
  EXPECT_EQ(read_of(driver, seeder[0])->source.replica, "t");
  start_replicate(driver, third, Selector::latest());  // t serves its one reader across already
  EXPECT_FALSE(read_of(driver, third[0])) << "not behind the seeder still crossing into dc1";
  driver.finish_reads(seeder);
  EXPECT_TRUE(is<ReplicateOk>(driver.replies(seeder)));
  const auto read = read_of(driver, third[0]);
  ASSERT_TRUE(read);
  EXPECT_FALSE(read->source.partial);
}

TEST(HubTopology, SmartSkippingCanBeSwitchedOff) {
  HubSettings settings;
  settings.smart_skipping = false;
  Driver driver(settings);
  const auto t = driver.open_replica(trainer("t"));
  const auto seeder = driver.open_replica(rollout("seeder", 2, "dc1"));
  const auto poller = driver.open_replica(rollout("poller", 2, "dc1"));
  driver.publish(t, 1);
  start_replicate(driver, seeder, Selector::latest());
  start_update(driver, poller, Selector::latest());
  EXPECT_EQ(read_of(driver, poller[0])->source.replica, "seeder");
}

// An update that fails after a shard was told to read says so in its answer (Reply::released):
// a shard whose instruction was lost must not go on calling its buffers published.
TEST(HubUpdate, AFailedUpdateSaysWhetherTheHeldVersionStillCounts) {
  Driver driver;
  const auto t = driver.open_replica(trainer("t", 1));
  const auto r = driver.open_replica(rollout("r", 1));
  driver.publish(r, 1);
  driver.publish(t, 2);
  driver.call(r[0], UpdateRequest{Selector::latest(), layout_for(0)});
  ASSERT_TRUE(read_of(driver, r[0]));
  driver.lose_connection(t[0]);  // the only source of version 2 dies mid-read
  auto reply = driver.take_reply(r[0]);
  ASSERT_TRUE(reply);
  EXPECT_TRUE(is_error(reply->outcome, Errc::kVersionUnavailable)) << describe(reply->outcome);
  EXPECT_TRUE(reply->released);
  EXPECT_EQ(replica_info(driver, "r").version, std::nullopt);
}

// ---- offload seeding (paper §4.3.4) ----------------------------------------------------------------

HubSettings seeding_settings() {
  HubSettings settings;
  settings.offload_seeding = true;
  return settings;
}

// t (dc0) publishes version 1; far (dc1) updates: "not yet", and a seed of version 1 is read.
struct Seeded {
  Driver driver{seeding_settings()};
  std::vector<ClientId> t = driver.open_replica(trainer("t"));
  std::vector<ClientId> far = driver.open_replica(rollout("far", 2, "dc1"));
  Seeded() {
    driver.publish(t, 1);
    start_update(driver, far, Selector::latest());
    const auto outcome = driver.replies(far);
    EXPECT_TRUE(is<UpdateOk>(outcome) && std::get<UpdateOk>(*outcome).status == UpdateStatus::kNotYet);
  }
};

TEST(HubOffloadSeeding, TheFirstUpdateOfADatacenterSeedsACpuCopyAndItsNextUpdateReadsIt) {
  Driver driver(seeding_settings());
  const auto t = driver.open_replica(trainer("t"));  // dc0
  const auto far1 = driver.open_replica(rollout("far1", 2, "dc1"));
  const auto far2 = driver.open_replica(rollout("far2", 2, "dc1"));
  driver.publish(t, 1);
  start_update(driver, far1, Selector::latest());
  // Answered at once: the buffers keep what they hold (nothing), the seed is read in the background.
  auto outcome = driver.replies(far1);
  ASSERT_TRUE(is<UpdateOk>(outcome));
  EXPECT_EQ(std::get<UpdateOk>(*outcome).status, UpdateStatus::kNotYet);
  EXPECT_EQ(std::get<UpdateOk>(*outcome).version, std::nullopt);
  for (std::uint32_t shard = 0; shard < 2; ++shard) {
    const auto seed = read_of(driver, far1[shard]);
    ASSERT_TRUE(seed);
    EXPECT_NE(seed->offload_copy, 0u) << "into a CPU copy, not the registered buffers";
    ASSERT_NE(seed->layout, nullptr);
    EXPECT_FALSE(seed->layout->mismatch(*layout_for(shard)));
    EXPECT_EQ(seed->source.replica, "t");
    EXPECT_EQ(seed->source.datacenter, "dc0");
  }
  EXPECT_EQ(replica_info(driver, "far1").state, "empty");
  EXPECT_EQ(replica_info(driver, "far1").offloads, std::vector<Version>{1});
  EXPECT_EQ(driver.hub().stats().seeds_started, 1u);
  // One seed per datacenter: the other replica there skips the version until the seed is whole.
  start_update(driver, far2, Selector::latest());
  outcome = driver.replies(far2);
  ASSERT_TRUE(is<UpdateOk>(outcome));
  EXPECT_EQ(std::get<UpdateOk>(*outcome).status, UpdateStatus::kNotYet);
  EXPECT_FALSE(read_of(driver, far2[0]));
  EXPECT_EQ(driver.hub().stats().seeds_started, 1u);
  driver.finish_reads(far1);
  // The seeder's next update reads its own CPU copy, and nothing crosses datacenters again.
  start_update(driver, far1, Selector::latest());
  for (std::uint32_t shard = 0; shard < 2; ++shard) {
    const auto read = read_of(driver, far1[shard]);
    ASSERT_TRUE(read);
    EXPECT_EQ(read->offload_copy, 0u);
    EXPECT_EQ(read->source.replica, "far1");
    EXPECT_EQ(read->source.kind, CopyKind::kOffload);
  }
  start_update(driver, far2, Selector::latest());
  EXPECT_EQ(read_of(driver, far2[0])->source.datacenter, "dc1");
  driver.finish_reads(far1);
  outcome = driver.replies(far1);
  ASSERT_TRUE(is<UpdateOk>(outcome));
  EXPECT_EQ(std::get<UpdateOk>(*outcome).status, UpdateStatus::kUpdated);
  EXPECT_EQ(std::get<UpdateOk>(*outcome).version, 1u);
  driver.finish_reads(far2);
  EXPECT_EQ(std::get<UpdateOk>(*driver.replies(far2)).version, 1u);
  // Consumed: the CPU memory is given back (once its last reader finished).
  EXPECT_TRUE(replica_info(driver, "far1").offloads.empty());
  for (ClientId client : far1) {
    EXPECT_EQ(driver.inbox(client).releases, std::vector<Version>{1});
  }
}

TEST(HubOffloadSeeding, OnlyAReadAcrossDatacentersSeeds) {
  Driver driver(seeding_settings());
  const auto t = driver.open_replica(trainer("t"));
  const auto near = driver.open_replica(rollout("near", 2, "dc0"));
  ReplicaSpec spot = rollout("spot", 2, "dc1");
  spot.spot = true;
  const auto far_spot = driver.open_replica(spot);
  driver.publish(t, 1);
  // A reader in the publisher's datacenter reads into its buffers as usual.
  start_update(driver, near, Selector::latest());
  EXPECT_EQ(read_of(driver, near[0])->offload_copy, 0u);
  // A spot replica never seeds: its copies do not count, and it may vanish at any moment.
  start_update(driver, far_spot, Selector::latest());
  ASSERT_TRUE(read_of(driver, far_spot[0]));
  EXPECT_EQ(read_of(driver, far_spot[0])->offload_copy, 0u);
  EXPECT_EQ(driver.hub().stats().seeds_started, 0u);
}

TEST(HubOffloadSeeding, TheSeedInstructionRepeatsWithHeartbeatsUntilTheShardHasItsBytes) {
  Seeded seeded;
  Driver& driver = seeded.driver;
  const auto& far = seeded.far;
  const auto seed = read_of(driver, far[0]);
  ASSERT_TRUE(seed);
  // Lost: no call of the replica is in flight to bring it again.
  driver.inbox(far[0]).reads.clear();
  driver.inbox(far[1]).reads.clear();
  driver.advance(Hub::kSeedResendMs - 1000);
  EXPECT_FALSE(read_of(driver, far[0])) << "not at every heartbeat";
  driver.advance(1100);  // (heartbeats come at the start of each 100 ms slice)
  const auto again = read_of(driver, far[0]);
  ASSERT_TRUE(again) << "repeated with the shard's heartbeat";
  EXPECT_EQ(again->transfer, seed->transfer);
  EXPECT_EQ(again->epoch, seed->epoch);
  EXPECT_EQ(again->offload_copy, seed->offload_copy);
  driver.report(far[0], TransferDone{seed->transfer, seed->epoch});
  driver.inbox(far[0]).reads.clear();
  driver.inbox(far[1]).reads.clear();
  driver.advance(Hub::kSeedResendMs + 100);
  EXPECT_FALSE(read_of(driver, far[0])) << "shard 0 has its bytes";
  EXPECT_TRUE(read_of(driver, far[1])) << "shard 1 does not yet";
}

TEST(HubOffloadSeeding, ASeedWhoseSourcesAreGoneIsReleasedAndTheNextUpdateSaysWhy) {
  Seeded seeded;
  Driver& driver = seeded.driver;
  const auto& t = seeded.t;
  const auto& far = seeded.far;
  // The trainer dies before the seed is read: nothing holds version 1 any more.
  driver.lose_connection(t[0]);
  for (ClientId client : far) {
    EXPECT_EQ(driver.inbox(client).releases, std::vector<Version>{1}) << "the shards free the buffer";
  }
  EXPECT_TRUE(replica_info(driver, "far").offloads.empty());
  start_update(driver, far, Selector::latest());
  EXPECT_EQ(expect_error(driver.replies(far), Errc::kVersionUnavailable), "");
}

TEST(HubOffloadSeeding, CloseWhileSeedingFreesTheSeed) {
  Seeded seeded;
  Driver& driver = seeded.driver;
  const auto& t = seeded.t;
  const auto& far = seeded.far;
  driver.call_all(far, CloseRequest{});
  EXPECT_TRUE(is<CloseOk>(driver.replies(far)));
  for (ClientId client : far) EXPECT_EQ(driver.inbox(client).releases, std::vector<Version>{1});
  // The trainer's copy no longer serves anyone.
  driver.call_all(t, UnpublishRequest{});
  EXPECT_TRUE(is<UnpublishOk>(driver.replies(t)));
}

// Review find: seeds of successive versions piled up while each crossed datacenters (each a
// model's worth of CPU memory on one link). A replica reads one seed at a time.
TEST(HubOffloadSeeding, ANewerSeedReplacesAnOlderOneStillBeingRead) {
  Driver driver(seeding_settings());
  const auto t1 = driver.open_replica(trainer("t1"));
  const auto t2 = driver.open_replica(trainer("t2"));
  const auto far = driver.open_replica(rollout("far", 2, "dc1"));
  driver.publish(t1, 1);
  start_update(driver, far, Selector::latest());
  ASSERT_TRUE(is<UpdateOk>(driver.replies(far)));
  ASSERT_EQ(read_of(driver, far[0])->version, 1u);
  driver.publish(t2, 2);
  start_update(driver, far, Selector::latest());
  ASSERT_TRUE(is<UpdateOk>(driver.replies(far)));
  EXPECT_EQ(read_of(driver, far[0])->version, 2u);
  for (ClientId client : far) EXPECT_EQ(driver.inbox(client).releases, std::vector<Version>{1});
  EXPECT_EQ(replica_info(driver, "far").offloads, std::vector<Version>{2});
  // Nothing reads t1's copy any more: its unpublish returns at once.
  driver.call_all(t1, UnpublishRequest{});
  EXPECT_TRUE(is<UnpublishOk>(driver.replies(t1)));
}

// Review find: a seed still waiting for a source counted as "no copy here", so every other
// replica of the datacenter started a seed of its own.
TEST(HubOffloadSeeding, ASeedWaitingForASourceIsTheDatacentersSeedAlready) {
  HubSettings settings = seeding_settings();
  settings.pipeline = false;  // so that the seed waits while t serves its one reader across
  Driver driver(settings);
  const auto t = driver.open_replica(trainer("t"));
  const auto other = driver.open_replica(rollout("other", 2, "dc2"));
  const auto far1 = driver.open_replica(rollout("far1", 2, "dc1"));
  const auto far2 = driver.open_replica(rollout("far2", 2, "dc1"));
  driver.publish(t, 1);
  start_replicate(driver, other, Selector::latest());  // takes t's slot for readers across
  start_update(driver, far1, Selector::latest());
  ASSERT_TRUE(is<UpdateOk>(driver.replies(far1)));
  EXPECT_FALSE(read_of(driver, far1[0])) << "the seed waits for t";
  start_update(driver, far2, Selector::latest());
  EXPECT_EQ(driver.hub().stats().seeds_started, 1u);
  EXPECT_TRUE(replica_info(driver, "far2").offloads.empty());
  // Once t is free the seed reads (from t, or from `other`, complete now); far2 reads in dc1
  // after it.
  driver.finish_reads(other);
  ASSERT_TRUE(read_of(driver, far1[0]));
  EXPECT_NE(read_of(driver, far1[0])->offload_copy, 0u);
  EXPECT_FALSE(read_of(driver, far2[0]));
  driver.finish_reads(far1);
  ASSERT_TRUE(read_of(driver, far2[0]));
  EXPECT_EQ(read_of(driver, far2[0])->source.datacenter, "dc1");
}

// Review find: a seed whose reads keep failing was released and seeded again at the next update,
// which answered "not yet" for ever. After a failed seed the replica reads the ordinary way.
TEST(HubOffloadSeeding, AfterASeedFailsTheNextUpdateReadsTheOrdinaryWay) {
  Seeded seeded;
  Driver& driver = seeded.driver;
  const auto& far = seeded.far;
  for (std::uint32_t i = 0; i <= limits::kSourceFailuresPerTransferMax + 1; ++i) {
    const auto read = read_of(driver, far[0]);
    if (!read) break;
    driver.inbox(far[0]).reads.clear();
    driver.report(far[0], TransferFailed{read->transfer, read->epoch, ReadFailure::kSourceUnreachable});
  }
  for (ClientId client : far) EXPECT_EQ(driver.inbox(client).releases, std::vector<Version>{1});
  EXPECT_TRUE(replica_info(driver, "far").offloads.empty());
  driver.inbox(far[0]).reads.clear();
  driver.inbox(far[1]).reads.clear();
  start_update(driver, far, Selector::latest());
  const auto read = read_of(driver, far[0]);
  ASSERT_TRUE(read) << "reads now (t, though reported, is the last resort)";
  EXPECT_EQ(read->offload_copy, 0u) << "into the buffers, not another seed";
  EXPECT_EQ(driver.hub().stats().seeds_started, 1u);
}

// A replica that follows latest-k seeds a version older than latest; the seed waits for it.
TEST(HubOffloadSeeding, ASeedIsKeptUntilItsOwnerConsumesItEvenWhenNewerVersionsExist) {
  Seeded seeded;
  Driver& driver = seeded.driver;
  const auto& t = seeded.t;
  const auto& far = seeded.far;
  driver.finish_reads(far);
  driver.call_all(t, UnpublishRequest{});
  EXPECT_TRUE(is<UnpublishOk>(driver.replies(t)));
  driver.publish(t, 2);
  EXPECT_EQ(replica_info(driver, "far").offloads, std::vector<Version>{1}) << "not consumed yet";
  start_update(driver, far, Selector::latest(1));
  EXPECT_EQ(read_of(driver, far[0])->source.replica, "far");
  driver.finish_reads(far);
  EXPECT_EQ(std::get<UpdateOk>(*driver.replies(far)).version, 1u);
  EXPECT_TRUE(replica_info(driver, "far").offloads.empty());
}

// ---- update ---------------------------------------------------------------------------------------

TEST(HubUpdate, NoNewerVersionAtOnceOtherwiseDrainAndReplicate) {
  Driver driver;
  const auto t = driver.open_replica(trainer("t"));
  const auto r = driver.open_replica(rollout("r"));
  start_update(driver, r, Selector::latest());
  auto outcome = driver.replies(r);
  ASSERT_TRUE(is<UpdateOk>(outcome));
  EXPECT_EQ(std::get<UpdateOk>(*outcome).status, UpdateStatus::kNoNewerVersion);

  driver.publish(t, 1);
  start_update(driver, r, Selector::latest());  // holds nothing: like replicate
  driver.finish_reads(r);
  outcome = driver.replies(r);
  ASSERT_TRUE(is<UpdateOk>(outcome));
  EXPECT_EQ(std::get<UpdateOk>(*outcome).status, UpdateStatus::kUpdated);
  EXPECT_EQ(std::get<UpdateOk>(*outcome).version, 1u);

  start_update(driver, r, Selector::latest());
  outcome = driver.replies(r);
  EXPECT_EQ(std::get<UpdateOk>(*outcome).status, UpdateStatus::kNoNewerVersion);
  EXPECT_EQ(std::get<UpdateOk>(*outcome).version, 1u);

  // r serves version 1 to a newcomer while version 2 appears: r's update waits for that reader.
  const auto newcomer = driver.open_replica(rollout("newcomer"));
  driver.call_all(t, UnpublishRequest{});
  EXPECT_TRUE(is<UnpublishOk>(driver.replies(t)));
  start_replicate(driver, newcomer, Selector::absolute(1));
  EXPECT_EQ(read_of(driver, newcomer[0])->source.replica, "r");
  driver.publish(t, 2);
  start_update(driver, r, Selector::latest());
  EXPECT_TRUE(driver.inbox(r[0]).reads.empty()) << "r's buffers still serve version 1";
  driver.finish_reads(newcomer);
  EXPECT_TRUE(is<ReplicateOk>(driver.replies(newcomer)));
  EXPECT_EQ(read_of(driver, r[0])->version, 2u);
  driver.finish_reads(r);
  outcome = driver.replies(r);
  EXPECT_EQ(std::get<UpdateOk>(*outcome).status, UpdateStatus::kUpdated);
  EXPECT_EQ(std::get<UpdateOk>(*outcome).version, 2u);
}

// Rollout r holds version 1 (the trainer t has dropped it) and serves it to `newcomer`, so that an
// update of r must wait for that reader; trainer u holds version 2.
struct UpdateWhileServing {
  Driver driver;
  std::vector<ClientId> u, r, newcomer;

  UpdateWhileServing() {
    const auto t = driver.open_replica(trainer("t"));
    u = driver.open_replica(trainer("u"));
    r = driver.open_replica(rollout("r"));
    newcomer = driver.open_replica(rollout("newcomer"));
    driver.publish(t, 1);
    start_replicate(driver, r, Selector::latest());
    driver.finish_reads(r);
    EXPECT_TRUE(is<ReplicateOk>(driver.replies(r)));
    driver.call_all(t, UnpublishRequest{});
    EXPECT_TRUE(is<UnpublishOk>(driver.replies(t)));
    start_replicate(driver, newcomer, Selector::absolute(1));  // reads from r
    driver.publish(u, 2);
  }
};

TEST(HubUpdate, FailingBeforeAnyReadKeepsThePreviousVersion) {
  UpdateWhileServing fleet;
  Driver& driver = fleet.driver;
  start_update(driver, fleet.r, Selector::latest());
  // Version 2 disappears while r drains; r's update then has nothing to read from.
  driver.call_all(fleet.u, UnpublishRequest{});
  EXPECT_TRUE(is<UnpublishOk>(driver.replies(fleet.u)));
  driver.finish_reads(fleet.newcomer);
  EXPECT_TRUE(is<ReplicateOk>(driver.replies(fleet.newcomer)));
  EXPECT_EQ(expect_error(driver.replies(fleet.r), Errc::kVersionUnavailable), "");
  EXPECT_TRUE(driver.inbox(fleet.r[0]).reads.empty()) << "r was never told to read";
  // r's buffers were never written: it still holds version 1 and serves it.
  const auto late = driver.open_replica(rollout("late"));
  driver.call_all(fleet.newcomer, UnpublishRequest{});
  EXPECT_TRUE(is<UnpublishOk>(driver.replies(fleet.newcomer)));
  start_replicate(driver, late, Selector::absolute(1));
  EXPECT_EQ(read_of(driver, late[0])->source.replica, "r");
}

TEST(HubUpdate, FailingWhileDrainingKeepsThePreviousVersion) {
  UpdateWhileServing fleet;
  Driver& driver = fleet.driver;
  // Shard 0 starts the update (r drains); shard 1 registered the wrong tensors.
  driver.call(fleet.r[0], UpdateRequest{Selector::latest(), layout_for(0)});
  driver.call(fleet.r[1], UpdateRequest{Selector::latest(), layout_for(1, 80)});
  EXPECT_EQ(expect_error(driver.replies(fleet.r), Errc::kLayoutMismatch), "");
  driver.finish_reads(fleet.newcomer);
  EXPECT_TRUE(is<ReplicateOk>(driver.replies(fleet.newcomer)));
  driver.call_all(fleet.r, UnpublishRequest{});
  EXPECT_TRUE(is<UnpublishOk>(driver.replies(fleet.r))) << "r still holds version 1";
}

// ---- retention ------------------------------------------------------------------------------------

TEST(HubRetention, LastCopyIsOffloadedBeforeUnpublishReturns) {
  Driver driver;
  ReplicaSpec spec = trainer("t");
  spec.retention.keep_latest = 0;
  const auto t = driver.open_replica(spec);
  driver.publish(t, 1);
  driver.call_all(t, UnpublishRequest{});
  EXPECT_FALSE(driver.has_reply(t[0]));
  ASSERT_EQ(driver.inbox(t[0]).offloads, std::vector<Version>{1});
  ASSERT_EQ(driver.inbox(t[1]).offloads, std::vector<Version>{1});
  driver.finish_offloads({t[0]});
  EXPECT_FALSE(driver.has_reply(t[0])) << "every shard must have offloaded";
  driver.finish_offloads({t[1]});
  EXPECT_TRUE(is<UnpublishOk>(driver.replies(t)));
  EXPECT_TRUE(driver.hub().retained("m", 1));

  // A reader gets version 1 from the offload copy; once it holds it, the offload is released.
  const auto r = driver.open_replica(rollout("r"));
  start_replicate(driver, r, Selector::latest());
  const auto read = read_of(driver, r[0]);
  EXPECT_EQ(read->source.replica, "t");
  EXPECT_EQ(read->source.kind, CopyKind::kOffload);
  EXPECT_TRUE(driver.inbox(t[0]).releases.empty());
  driver.finish_reads(r);
  EXPECT_TRUE(is<ReplicateOk>(driver.replies(r)));
  EXPECT_EQ(driver.inbox(t[0]).releases, std::vector<Version>{1});
  EXPECT_EQ(driver.inbox(t[1]).releases, std::vector<Version>{1});
}

TEST(HubRetention, SpotCopiesDoNotCount) {
  Driver driver;
  ReplicaSpec spec = trainer("t");
  spec.retention.keep_latest = 0;
  const auto t = driver.open_replica(spec);
  ReplicaSpec spot = rollout("spot");
  spot.spot = true;
  const auto s = driver.open_replica(spot);
  driver.publish(t, 1);
  start_replicate(driver, s, Selector::latest());
  driver.finish_reads(s);
  EXPECT_TRUE(is<ReplicateOk>(driver.replies(s)));
  driver.call_all(t, UnpublishRequest{});
  EXPECT_EQ(driver.inbox(t[0]).offloads, std::vector<Version>{1});
  driver.finish_offloads(t);
  EXPECT_TRUE(is<UnpublishOk>(driver.replies(t)));
}

TEST(HubRetention, NoOffloadWhenAnotherNonSpotReplicaHoldsTheVersion) {
  Driver driver;
  ReplicaSpec spec = trainer("t");
  spec.retention.keep_latest = 2;
  const auto t = driver.open_replica(spec);
  const auto r = driver.open_replica(rollout("r"));
  driver.publish(t, 1);
  start_replicate(driver, r, Selector::latest());
  driver.finish_reads(r);
  EXPECT_TRUE(is<ReplicateOk>(driver.replies(r)));
  driver.call_all(t, UnpublishRequest{});
  EXPECT_TRUE(is<UnpublishOk>(driver.replies(t)));
  EXPECT_TRUE(driver.inbox(t[0]).offloads.empty());
}

TEST(HubRetention, OffloadIsReleasedWhenTheVersionLeavesRetention) {
  Driver driver;
  ReplicaSpec spec = trainer("t");
  spec.retention.keep_latest = 1;  // keeps latest and latest-1
  const auto t = driver.open_replica(spec);
  driver.publish(t, 1);
  driver.call_all(t, UnpublishRequest{});
  driver.finish_offloads(t);
  EXPECT_TRUE(is<UnpublishOk>(driver.replies(t)));
  driver.publish(t, 2);
  EXPECT_TRUE(driver.inbox(t[0]).releases.empty()) << "version 1 is latest-1: still retained";
  driver.call_all(t, UnpublishRequest{});
  driver.finish_offloads(t);
  EXPECT_TRUE(is<UnpublishOk>(driver.replies(t)));
  driver.publish(t, 3);
  EXPECT_EQ(driver.inbox(t[0]).releases, std::vector<Version>{1});
  EXPECT_FALSE(driver.hub().retained("m", 1));
  EXPECT_TRUE(driver.hub().retained("m", 2));
}

TEST(HubRetention, PinnedVersionsAreKept) {
  Driver driver;
  ReplicaSpec spec = trainer("t");
  spec.retention.pinned = {1};
  const auto t = driver.open_replica(spec);
  driver.publish(t, 1);
  driver.call_all(t, UnpublishRequest{});
  driver.finish_offloads(t);
  EXPECT_TRUE(is<UnpublishOk>(driver.replies(t)));
  driver.publish(t, 2);
  driver.call_all(t, UnpublishRequest{});
  EXPECT_TRUE(is<UnpublishOk>(driver.replies(t))) << "version 2 is not retained: no offload";
  EXPECT_TRUE(driver.hub().retained("m", 1));
}

TEST(HubRetention, LastHolderCrashGivesVersionUnavailableNotAHang) {
  HubSettings settings;
  settings.heartbeat_timeout_ms = 1000;
  Driver driver(settings);
  ReplicaSpec spec = trainer("t");
  spec.retention.keep_latest = 0;
  const auto t = driver.open_replica(spec);
  driver.publish(t, 1);
  const auto r = driver.open_replica(rollout("r"));
  start_replicate(driver, r, Selector::latest());
  ASSERT_TRUE(read_of(driver, r[0]));
  const auto waiter = driver.open_replica(trainer("waiter"));
  driver.call_all(waiter, WaitRequest{{WaitPredicate::Kind::kReplicasHold, 1, 3, {}}, 0});
  // The trainer crashes mid-transfer: it stops heartbeating.
  driver.advance(800, {t[0], t[1]});
  driver.advance(800, {t[0], t[1]});
  EXPECT_EQ(expect_error(driver.replies(r), Errc::kVersionUnavailable), "");
  EXPECT_EQ(expect_error(driver.replies(waiter), Errc::kVersionUnavailable), "");
  start_replicate(driver, r, Selector::latest());
  EXPECT_EQ(expect_error(driver.replies(r), Errc::kVersionUnavailable), "");
}

// ---- failures -------------------------------------------------------------------------------------

TEST(HubFailures, FailedSourceIsReplacedForTheSameTransfer) {
  Driver driver;
  const auto t1 = driver.open_replica(trainer("t1"));
  const auto t2 = driver.open_replica(trainer("t2"));
  driver.publish(t1, 1);
  driver.publish(t2, 1);
  const auto r = driver.open_replica(rollout("r"));
  start_replicate(driver, r, Selector::latest());
  const auto first = *read_of(driver, r[0]);
  EXPECT_EQ(first.source.replica, "t1");
  driver.finish_reads({r[1]});  // shard 1 finished before the source failed
  driver.report(r[0], TransferFailed{first.transfer, first.epoch, ReadFailure::kSourceUnreachable});
  const auto second = *read_of(driver, r[0]);
  EXPECT_EQ(second.transfer, first.transfer);
  EXPECT_EQ(second.epoch, first.epoch + 1);
  EXPECT_EQ(second.source.replica, "t2");
  EXPECT_TRUE(driver.inbox(t1[0]).grants.empty());
  EXPECT_TRUE(driver.inbox(r[1]).reads.empty()) << "a finished shard is not sent again";
  // A stale report about the old source changes nothing but re-sends where to read.
  driver.report(r[0], TransferFailed{first.transfer, first.epoch, ReadFailure::kSourceUnreachable});
  EXPECT_EQ(read_of(driver, r[0])->source.replica, "t2");
  driver.finish_reads({r[0]});
  const auto outcome = driver.replies(r);
  ASSERT_TRUE(is<ReplicateOk>(outcome));
  EXPECT_EQ(std::get<ReplicateOk>(*outcome).source_replica, "t2");
  // t1 is never chosen again.
  const auto r2 = driver.open_replica(rollout("r2"));
  start_replicate(driver, r2, Selector::latest());
  EXPECT_NE(read_of(driver, r2[0])->source.replica, "t1");
}

// Bytes that fail a reader's checksums: a source is suspected at once and tried again only as a
// last resort; failing a second time with no good read between, it holds other bytes than the
// version's (a buffer written while published), and with no other copy the reader is told the
// version is unavailable at once, not after kSourceFailuresPerTransferMax tries.
TEST(HubFailures, ACopyWhoseBytesFailChecksumsTwiceIsNoSourceAnyMore) {
  Driver driver;
  const auto t = driver.open_replica(trainer("t", 1));
  driver.publish(t, 1);
  const auto r = driver.open_replica(rollout("r", 1));
  start_replicate(driver, r, Selector::latest());
  const auto first = *read_of(driver, r[0]);
  driver.report(r[0], TransferFailed{first.transfer, first.epoch, ReadFailure::kChecksumMismatch});
  const auto second = read_of(driver, r[0]);
  ASSERT_TRUE(second && second->epoch == first.epoch + 1) << "one failure: the only copy, as a last resort";
  EXPECT_EQ(second->source.replica, "t");
  EXPECT_TRUE(driver.inbox(t[0]).corrupt_notices.empty()) << "one failure may be the link's";
  driver.report(r[0], TransferFailed{second->transfer, second->epoch, ReadFailure::kChecksumMismatch});
  // The publisher hears it (issue 33, friction 1: a trainer writing while published was never told).
  ASSERT_EQ(driver.inbox(t[0]).corrupt_notices.size(), 1u);
  EXPECT_EQ(driver.inbox(t[0]).corrupt_notices[0].version, 1u);
  EXPECT_EQ(driver.inbox(t[0]).corrupt_notices[0].offload_copy, 0u) << "its registered buffers";
  EXPECT_TRUE(driver.inbox(r[0]).corrupt_notices.empty()) << "not the reader";
  EXPECT_EQ(driver.hub().stats().copies_found_corrupt, 1u);
  const std::optional<Outcome> refused = driver.replies(r);
  EXPECT_EQ(expect_error(refused, Errc::kVersionUnavailable), "");
  // The error names the copy at fault and the likely cause (issue 33, friction 1), not the reader.
  const std::string detail = std::get<Error>(*refused).detail;
  EXPECT_NE(detail.find("replica 't'"), std::string::npos) << detail;
  EXPECT_NE(detail.find("failed readers' checksums at their source"), std::string::npos) << detail;
  // A later reader is not sent to it either: the version is unavailable while t holds those bytes.
  const auto r2 = driver.open_replica(rollout("r2", 1));
  start_replicate(driver, r2, Selector::latest());
  EXPECT_EQ(expect_error(driver.replies(r2), Errc::kVersionUnavailable), "");
  EXPECT_FALSE(read_of(driver, r2[0]));
  EXPECT_EQ(driver.inbox(t[0]).corrupt_notices.size(), 1u) << "told once";
}

// Of a replica of two shards, only the shard whose bytes failed is told.
TEST(HubFailures, OnlyTheShardWhoseBytesFailedIsToldItsCopyIsCorrupt) {
  Driver driver;
  const auto t = driver.open_replica(trainer("t", 2));
  driver.publish(t, 1);
  const auto r = driver.open_replica(rollout("r", 2));
  start_replicate(driver, r, Selector::latest());
  for (int strike = 0; strike < 2; ++strike) {
    const auto read = *read_of(driver, r[1]);
    driver.report(r[1], TransferFailed{read.transfer, read.epoch, ReadFailure::kChecksumMismatch});
  }
  EXPECT_TRUE(driver.inbox(t[0]).corrupt_notices.empty());
  ASSERT_EQ(driver.inbox(t[1]).corrupt_notices.size(), 1u);
  EXPECT_EQ(driver.inbox(t[1]).corrupt_notices[0].version, 1u);
}

// A good read between two checksum failures says the first was passing trouble (a link, the
// reader): the copy stays a last resort.
TEST(HubFailures, AGoodReadClearsAnEarlierChecksumFailure) {
  Driver driver;
  const auto t = driver.open_replica(trainer("t", 1));
  driver.publish(t, 1);
  const auto a = driver.open_replica(rollout("a", 1));
  start_replicate(driver, a, Selector::latest());
  const auto first = *read_of(driver, a[0]);
  driver.report(a[0], TransferFailed{first.transfer, first.epoch, ReadFailure::kChecksumMismatch});
  driver.finish_reads(a);  // from t again, well
  ASSERT_TRUE(is<ReplicateOk>(driver.replies(a)));
  driver.call_all(a, UnpublishRequest{});
  ASSERT_TRUE(is<UnpublishOk>(driver.replies(a)));
  const auto b = driver.open_replica(rollout("b", 1));
  start_replicate(driver, b, Selector::latest());
  const auto read = *read_of(driver, b[0]);
  EXPECT_EQ(read.source.replica, "t");
  driver.report(b[0], TransferFailed{read.transfer, read.epoch, ReadFailure::kChecksumMismatch});
  const auto again = read_of(driver, b[0]);
  ASSERT_TRUE(again && again->epoch == read.epoch + 1) << "t is still a last resort";
  driver.finish_reads(b);
  EXPECT_TRUE(is<ReplicateOk>(driver.replies(b)));
}

// A wait on what replicas hold is answered when a copy is complete again without a new version:
// an update cancelled while its old copy drained (property-regressions.txt, RC seeds 7 and 16).
TEST(HubRegression, AWaitIsAnsweredWhenACancelledUpdateKeepsItsCopy) {
  Driver driver;
  const auto t = driver.open_replica(trainer("t", 1));
  driver.publish(t, 1);
  const auto a = driver.open_replica(rollout("a", 1));
  const auto b = driver.open_replica(rollout("b", 1));
  for (const auto& replica : {a, b}) {
    start_replicate(driver, replica, Selector::latest());
    driver.finish_reads(replica);
    ASSERT_TRUE(is<ReplicateOk>(driver.replies(replica)));
  }
  driver.call_all(t, UnpublishRequest{});
  ASSERT_TRUE(is<UnpublishOk>(driver.replies(t)));
  // c reads version 1 from a, so that a's copy drains (waits for c) when a moves on.
  const auto c = driver.open_replica(rollout("c", 1));
  start_replicate(driver, c, Selector::latest());
  ASSERT_EQ(read_of(driver, c[0])->source.replica, "a");
  driver.publish(t, 2);
  const std::uint64_t update = driver.call(a[0], UpdateRequest{Selector::latest(), layout_for(0)});
  const auto w = driver.open_replica(rollout("w", 1));
  driver.call(w[0], WaitRequest{{WaitPredicate::Kind::kReplicasHold, 1, 2, ""}, 0});
  EXPECT_FALSE(driver.has_reply(w[0])) << "a's copy of version 1 drains: only b holds it";
  driver.report(a[0], CancelCall{update});
  EXPECT_EQ(expect_error(driver.replies(a), Errc::kCancelled), "");
  EXPECT_TRUE(is<WaitOk>(driver.replies(w))) << "a holds version 1 again";
}

TEST(HubFailures, EvictedReaderReleasesItsSource) {
  HubSettings settings;
  settings.heartbeat_timeout_ms = 1000;
  Driver driver(settings);
  const auto t = driver.open_replica(trainer("t"));
  driver.publish(t, 1);
  const auto r = driver.open_replica(rollout("r"));
  start_replicate(driver, r, Selector::latest());
  driver.call_all(t, UnpublishRequest{});
  EXPECT_FALSE(driver.has_reply(t[0]));
  driver.advance(1500, {r[0], r[1]});
  EXPECT_TRUE(is<UnpublishOk>(driver.replies(t))) << "the crashed reader no longer holds t";
  EXPECT_EQ(driver.inbox(r[0]).evictions.size(), 1u);
}

TEST(HubFailures, PipelineReaderWhoseSourceCrashesReadsElsewhere) {
  HubSettings settings;
  settings.heartbeat_timeout_ms = 1000;
  Driver driver(settings);
  const auto t = driver.open_replica(trainer("t"));
  driver.publish(t, 1);
  const auto a = driver.open_replica(rollout("a"));
  const auto b = driver.open_replica(rollout("b"));
  start_replicate(driver, a, Selector::latest());
  start_replicate(driver, b, Selector::latest());
  EXPECT_EQ(read_of(driver, b[0])->source.replica, "a");
  driver.advance(1500, {a[0], a[1]});  // a crashes mid-transfer (paper Figure 7(c))
  EXPECT_EQ(read_of(driver, b[0])->source.replica, "t");
  EXPECT_EQ(read_of(driver, b[0])->epoch, 2u);
  driver.finish_reads(b);
  EXPECT_TRUE(is<ReplicateOk>(driver.replies(b)));
}

// The hub skips the scan for expired heartbeats until the earliest deadline it knows of; a shard
// that binds after that scan (here: into an empty hub, whose next scan was "never") lowers it, and
// a silent shard is evicted on the first tick past its timeout, not later.
TEST(HubFailures, SilentShardIsEvictedOnTheFirstTickPastItsTimeout) {
  HubSettings settings;
  settings.heartbeat_timeout_ms = 1000;
  Driver driver(settings);
  driver.advance(500);  // ticks of an empty hub
  const auto early = driver.open_replica(trainer("early"));
  driver.advance(300);
  const auto late = driver.open_replica(trainer("late"));  // opened after the last scan
  const TimeMs late_opened_ms = driver.now_ms();
  driver.advance(900, {late[0], late[1]});  // "early" keeps beating; "late" is silent
  EXPECT_TRUE(driver.inbox(late[0]).evictions.empty()) << "not before its timeout";
  while (driver.inbox(late[0]).evictions.empty() && driver.now_ms() < late_opened_ms + 3000) {
    driver.advance(100, {late[0], late[1]});
  }
  ASSERT_EQ(driver.inbox(late[0]).evictions.size(), 1u);
  // Ticks come every 100 ms: the first one past the 1,000 ms timeout.
  EXPECT_LE(driver.now_ms(), late_opened_ms + 1100);
  EXPECT_TRUE(driver.inbox(early[0]).evictions.empty());
}

TEST(HubFailures, ConnectionLossEvictsTheWholeReplica) {
  Driver driver;
  const auto r = driver.open_replica(rollout("r", 3));
  driver.lose_connection(r[1]);
  EXPECT_EQ(driver.inbox(r[0]).evictions.size(), 1u);
  EXPECT_EQ(driver.inbox(r[2]).evictions.size(), 1u);
  EXPECT_EQ(driver.hub().client_count(), 0u);
  driver.call(r[0], ListRequest{});
  EXPECT_EQ(expect_error(driver.replies({r[0]}), Errc::kUnknownClient), "");
  driver.report(r[0], Heartbeat{});
  EXPECT_EQ(driver.inbox(r[0]).evictions.size(), 2u) << "a heartbeat from the past is told to re-open";
}

// ---- replica transactions -------------------------------------------------------------------------

TEST(HubTransactions, ShardsGetTheAnswerTheFirstShardGot) {
  // Paper Figure 6: shard 0 of r sees version 1 as latest, version 2 appears, then shard 1 asks.
  Driver driver;
  const auto t = driver.open_replica(trainer("t"));
  const auto u = driver.open_replica(trainer("u"));
  const auto r = driver.open_replica(rollout("r"));
  driver.publish(t, 1);
  driver.call(r[0], UpdateRequest{Selector::latest(), layout_for(0)});
  driver.publish(u, 2);
  driver.call(r[1], UpdateRequest{Selector::latest(), layout_for(1)});
  EXPECT_EQ(read_of(driver, r[0])->version, 1u);
  EXPECT_EQ(read_of(driver, r[1])->version, 1u);
  driver.finish_reads(r);
  const auto outcome = driver.replies(r);
  ASSERT_TRUE(is<UpdateOk>(outcome));
  EXPECT_EQ(std::get<UpdateOk>(*outcome).version, 1u);
}

TEST(HubTransactions, ListIsTheSameForEveryShard) {
  Driver driver;
  const auto t = driver.open_replica(trainer("t"));
  const auto r = driver.open_replica(rollout("r"));
  driver.call(r[0], ListRequest{});
  driver.publish(t, 1);
  driver.call(r[1], ListRequest{});
  const auto outcome = driver.replies(r);
  ASSERT_TRUE(is<ListOk>(outcome));
  EXPECT_FALSE(std::get<ListOk>(*outcome).snapshot->latest.has_value());
}

TEST(HubTransactions, DivergentCallsAreAnErrorForEveryShard) {
  Driver driver;
  const auto t = driver.open_replica(trainer("t", 3));
  driver.publish(t, 1);
  const auto r = driver.open_replica(rollout("r", 3));
  driver.call(r[0], replicate(Selector::latest(), 0));
  driver.call(r[1], replicate(Selector::latest(), 1));
  driver.call(r[2], UpdateRequest{Selector::latest(), layout_for(2)});
  for (ClientId client : r) {
    auto reply = driver.take_reply(client);
    ASSERT_TRUE(reply) << "shard " << client;
    EXPECT_TRUE(is_error(reply->outcome, Errc::kDivergentCall)) << describe(reply->outcome);
    EXPECT_EQ(driver.inbox(client).evictions.size(), 1u);
  }
  EXPECT_EQ(driver.hub().snapshot("m")->replicas.size(), 1u);
}

TEST(HubTransactions, RetransmissionsAreAnsweredOnceAndGapsAreErrors) {
  Driver driver;
  const auto r = driver.open_replica(rollout("r", 1));
  const std::uint64_t seq = driver.call(r[0], ListRequest{});
  ASSERT_TRUE(driver.take_reply(r[0]));
  driver.step(Request{r[0], seq, ListRequest{}});  // the same call again
  auto again = driver.take_reply(r[0]);
  ASSERT_TRUE(again);
  EXPECT_EQ(again->seq, seq);
  driver.step(Request{r[0], seq + 5, ListRequest{}});
  auto gap = driver.take_reply(r[0]);
  ASSERT_TRUE(gap);
  EXPECT_TRUE(is_error(gap->outcome, Errc::kSequenceGap));
}

TEST(HubTransactions, MessagesOfAnEarlierSessionAreIgnored) {
  Driver driver;
  const ClientId client = driver.new_client();
  OpenRequest open = driver.open_request(rollout("r", 1), 0);
  driver.step(Request{client, 0, open, /*session=*/7});
  ASSERT_TRUE(is<OpenOk>(driver.replies({client})));
  EXPECT_EQ(driver.inbox(client).session, 7u) << "effects carry the client's session";
  driver.step(Request{client, 1, ListRequest{}, /*session=*/6});
  EXPECT_FALSE(driver.has_reply(client)) << "a request from session 6 is stale";
  driver.step(Request{client, 1, ListRequest{}, /*session=*/7});
  EXPECT_TRUE(is<ListOk>(driver.replies({client})));
  driver.lose_connection(client);
  driver.step(Report{client, Heartbeat{}, /*session=*/7});
  ASSERT_EQ(driver.inbox(client).evictions.size(), 2u);
  EXPECT_EQ(driver.inbox(client).evictions.back().reason, Errc::kUnknownClient);
  EXPECT_EQ(driver.inbox(client).session, 7u) << "an unknown client is answered in its own session";
}

// ---- wait, list, close ----------------------------------------------------------------------------

TEST(HubWait, PredicatesBlockUntilTheyHold) {
  Driver driver;
  const auto t = driver.open_replica(trainer("t", 1));
  const auto r1 = driver.open_replica(rollout("r1", 1));
  const auto r2 = driver.open_replica(rollout("r2", 1));
  driver.call_all(t, WaitRequest{{WaitPredicate::Kind::kVersionAtLeast, 1, 1, {}}, 0});
  EXPECT_FALSE(driver.has_reply(t[0]));
  driver.call_all(r1, WaitRequest{{WaitPredicate::Kind::kVersionAtLeast, 1, 1, {}}, 0});
  // Publishing needs t's call slot, so another trainer publishes.
  const auto p = driver.open_replica(trainer("p", 1));
  driver.publish(p, 1);
  EXPECT_TRUE(is<WaitOk>(driver.replies(t)));
  EXPECT_TRUE(is<WaitOk>(driver.replies(r1)));
  // The trainer waits for every rollout to hold version >= 1.
  driver.call_all(t, WaitRequest{{WaitPredicate::Kind::kRoleHolds, 1, 1, "rollout"}, 0});
  for (const auto* rollout_shards : {&r1, &r2}) {
    EXPECT_FALSE(driver.has_reply(t[0]));
    driver.call((*rollout_shards)[0], replicate(Selector::latest(), 0));
    driver.finish_reads(*rollout_shards);
    EXPECT_TRUE(is<ReplicateOk>(driver.replies(*rollout_shards)));
  }
  EXPECT_TRUE(is<WaitOk>(driver.replies(t)));
  driver.call_all(t, WaitRequest{{WaitPredicate::Kind::kReplicasHold, 1, 3, {}}, 0});
  EXPECT_TRUE(is<WaitOk>(driver.replies(t)));
  driver.call_all(t, WaitRequest{{WaitPredicate::Kind::kReplicasHold, 1, 4, {}}, 100});
  driver.advance(150);
  EXPECT_TRUE(is_error(*driver.replies(t), Errc::kTimeout));
}

// wait(role holds >= v) is not vacuously true: a role nobody plays holds nothing yet.
TEST(HubWait, RoleHoldsWaitsForARoleWithoutReplicas) {
  Driver driver;
  const auto t = driver.open_replica(trainer("t", 1));
  driver.publish(t, 1);
  const auto w = driver.open_replica(trainer("w", 1));
  driver.call_all(w, WaitRequest{{WaitPredicate::Kind::kRoleHolds, 1, 1, "evaluator"}, 0});
  EXPECT_FALSE(driver.has_reply(w[0])) << "no evaluator is open";
  ReplicaSpec spec = rollout("e", 1);
  spec.role = "evaluator";
  const auto e = driver.open_replica(spec);
  EXPECT_FALSE(driver.has_reply(w[0])) << "the evaluator holds nothing";
  driver.call(e[0], replicate(Selector::latest(), 0));
  driver.finish_reads(e);
  EXPECT_TRUE(is<ReplicateOk>(driver.replies(e)));
  EXPECT_TRUE(is<WaitOk>(driver.replies(w)));
}

// update tells holding nothing apart from holding version 0.
TEST(HubUpdate, HoldingNothingIsNotVersionZero) {
  Driver driver;
  const auto t = driver.open_replica(trainer("t"));
  const auto r = driver.open_replica(rollout("r"));
  start_update(driver, r, Selector::latest());
  auto outcome = driver.replies(r);
  ASSERT_TRUE(is<UpdateOk>(outcome));
  EXPECT_EQ(std::get<UpdateOk>(*outcome).status, UpdateStatus::kNoNewerVersion);
  EXPECT_FALSE(std::get<UpdateOk>(*outcome).version.has_value());
  driver.publish(t, 0);
  start_update(driver, r, Selector::latest());
  driver.finish_reads(r);
  outcome = driver.replies(r);
  ASSERT_TRUE(is<UpdateOk>(outcome));
  EXPECT_EQ(std::get<UpdateOk>(*outcome).version, std::optional<Version>(0));
  start_update(driver, r, Selector::latest());
  outcome = driver.replies(r);
  ASSERT_TRUE(is<UpdateOk>(outcome));
  EXPECT_EQ(std::get<UpdateOk>(*outcome).status, UpdateStatus::kNoNewerVersion);
  EXPECT_EQ(std::get<UpdateOk>(*outcome).version, std::optional<Version>(0));
}

// A close is never refused, not even with the last non-spot copy of a version another replica's
// rule retains (issue 33, friction 2: a rollout's close failed under a trainer's keep_latest=0).
// The version leaves with it as with a crash; the count and the readers' error say so. A reader
// that was already pulling from the closing copy keeps it: the copy drains first.
TEST(HubClose, NeverRefusedAndSaysWhenItTakesARetainedVersion) {
  Driver driver;
  ReplicaSpec trainer_spec = trainer("t");
  trainer_spec.retention.keep_latest = 0;
  const auto t = driver.open_replica(trainer_spec);
  const auto r = driver.open_replica(rollout("r"));
  driver.publish(t, 1);
  start_replicate(driver, r, Selector::latest());
  driver.finish_reads(r);
  EXPECT_TRUE(is<ReplicateOk>(driver.replies(r)));
  // The trainer unpublishes to write version 2: r's copy is safe, so nothing offloads.
  driver.call_all(t, UnpublishRequest{});
  EXPECT_TRUE(is<UnpublishOk>(driver.replies(t)));
  EXPECT_TRUE(driver.hub().retained("m", 1));
  // A second rollout starts pulling from r, then r closes: r drains to its reader first.
  const auto late = driver.open_replica(rollout("late"));
  start_replicate(driver, late, Selector::latest());
  ASSERT_TRUE(read_of(driver, late[0]));
  EXPECT_EQ(read_of(driver, late[0])->source.replica, "r");
  driver.call_all(r, CloseRequest{});
  EXPECT_FALSE(driver.has_reply(r[0])) << "drains to its reader first";
  EXPECT_EQ(driver.hub().stats().retained_versions_left, 1u);
  driver.finish_reads(late);
  EXPECT_TRUE(is<ReplicateOk>(driver.replies(late)));
  EXPECT_TRUE(is<CloseOk>(driver.replies(r)));
  // `late` holds version 1 now; its close takes the last copy, with no reader to save it.
  driver.call_all(late, CloseRequest{});
  EXPECT_TRUE(is<CloseOk>(driver.replies(late)));
  EXPECT_EQ(driver.hub().stats().retained_versions_left, 2u);
  const auto again = driver.open_replica(rollout("again"));
  start_replicate(driver, again, Selector::absolute(1));
  EXPECT_EQ(error_detail(driver.replies(again), Errc::kVersionUnavailable),
            "no copy of version 1 is left (its last non-spot copy left with replica 'late' (incarnation 1), which closed)");
  // The trainer's own close with its own rule, and a spot replica's, count nothing.
  driver.publish(t, 2);
  driver.call_all(t, CloseRequest{});
  EXPECT_TRUE(is<CloseOk>(driver.replies(t)));
  EXPECT_EQ(driver.hub().stats().retained_versions_left, 2u);
}

TEST(HubList, DescribesVersionsAndReplicas) {
  Driver driver;
  ReplicaSpec spec = trainer("t", 1);
  spec.retention.keep_latest = 0;
  const auto t = driver.open_replica(spec);
  driver.publish(t, 3);
  const auto r = driver.open_replica(rollout("r", 1, "dc1"));
  driver.call(r[0], replicate(Selector::latest(), 0));
  driver.call(t[0], ListRequest{});
  const auto outcome = driver.replies(t);
  ASSERT_TRUE(is<ListOk>(outcome));
  const ListSnapshot& snapshot = *std::get<ListOk>(*outcome).snapshot;
  EXPECT_EQ(snapshot.latest, 3u);
  ASSERT_EQ(snapshot.versions.size(), 1u);
  EXPECT_EQ(snapshot.versions[0].complete, 1u);
  EXPECT_EQ(snapshot.versions[0].partial, 1u);
  EXPECT_TRUE(snapshot.versions[0].retained);
  ASSERT_EQ(snapshot.replicas.size(), 2u);
  EXPECT_EQ(snapshot.replicas[0].name, "r");
  EXPECT_EQ(snapshot.replicas[0].state, "receiving");
  EXPECT_EQ(snapshot.replicas[0].datacenter, "dc1");
  EXPECT_EQ(snapshot.replicas[1].serving, 1u);
}

TEST(HubClose, DrainsThenForgetsTheReplica) {
  Driver driver;
  const auto t = driver.open_replica(trainer("t"));
  driver.publish(t, 1);
  const auto r = driver.open_replica(rollout("r"));
  start_replicate(driver, r, Selector::latest());
  driver.call_all(t, CloseRequest{});
  EXPECT_FALSE(driver.has_reply(t[0]));
  driver.finish_reads(r);
  EXPECT_TRUE(is<ReplicateOk>(driver.replies(r)));
  EXPECT_TRUE(is<CloseOk>(driver.replies(t)));
  EXPECT_EQ(driver.hub().snapshot("m")->replicas.size(), 1u);
  EXPECT_EQ(driver.hub().client_count(), 2u);
}

TEST(HubModels, AreIndependent) {
  Driver driver;
  ReplicaSpec a = trainer("t", 1);
  a.model = "actor";
  ReplicaSpec c = trainer("t", 4);
  c.model = "critic";
  const auto actor = driver.open_replica(a);
  const auto critic = driver.open_replica(c);
  driver.publish(actor, 10);
  driver.publish(critic, 2);
  EXPECT_EQ(driver.hub().latest("actor"), 10u);
  EXPECT_EQ(driver.hub().latest("critic"), 2u);
  EXPECT_FALSE(driver.hub().latest("nothing"));
}

// ---- server failover ------------------------------------------------------------------------------

// What a shard's resume says of its last answered call.
TxnRecord answered(std::uint64_t seq, OpKind kind, Outcome outcome) {
  TxnRecord record;
  record.seq = seq;
  record.op.kind = kind;
  record.outcome = std::move(outcome);
  return record;
}

OpenRequest resume_request(Driver& driver, const ReplicaSpec& spec, std::uint32_t shard,
                           std::optional<Version> held, std::optional<TxnRecord> last = {}) {
  OpenRequest request = driver.open_request(spec, shard);
  Resume resume;
  if (held) resume.primary = HeldCopy{*held, layout_for(shard), checksums_for(*held, shard)};
  resume.last_txn = last;
  request.resume = std::make_shared<const Resume>(std::move(resume));
  return request;
}

TEST(HubFailover, ReopenedReplicasRepopulateAFreshServer) {
  Driver driver;  // a fresh server: nothing is known
  const ReplicaSpec t = trainer("t");
  std::vector<ClientId> shards;
  for (std::uint32_t shard = 0; shard < 2; ++shard) {
    shards.push_back(driver.new_client());
    driver.open(shards.back(), resume_request(driver, t, shard, 9), 12);
    EXPECT_EQ(driver.has_reply(shards[0]), shard == 1) << "the barrier waits for every shard";
  }
  const auto opened = driver.replies(shards);
  ASSERT_TRUE(is<OpenOk>(opened));
  EXPECT_EQ(std::get<OpenOk>(*opened).latest, 9u);
  // Calls continue after the sequence number the client resumed at.
  driver.set_next_seq(shards[0], 13);
  driver.set_next_seq(shards[1], 13);
  const auto r = driver.open_replica(rollout("r"));
  start_replicate(driver, r, Selector::latest());
  EXPECT_EQ(read_of(driver, r[0])->source.replica, "t");
  driver.finish_reads(r);
  EXPECT_TRUE(is<ReplicateOk>(driver.replies(r)));
  driver.call_all(shards, UnpublishRequest{});
  EXPECT_TRUE(is<UnpublishOk>(driver.replies(shards)));
}

// Property-test find (AgentModel, lossy network, property-long seed 4): the server's answer to an
// offload copy a resume announced (its renaming Offload, or its release when the copy is of no
// use) was lost, and nothing asked again. The shard reports the copy under the announced id until
// answered; the server answers each such report again: the rename of a copy it adopted, the
// release of any other.
TEST(HubFailover, AReportOfAnAnnouncedCopyIsAnsweredAgain) {
  Driver driver;  // a fresh server
  ReplicaSpec t = trainer("t");
  t.retention.pinned = {8};  // its offload copy of version 8 is needed
  std::vector<ClientId> shards;
  for (std::uint32_t shard = 0; shard < 2; ++shard) {
    OpenRequest request = resume_request(driver, t, shard, 9);
    Resume resume = *request.resume;
    resume.offloads.push_back(HeldCopy{8, layout_for(shard), checksums_for(8, shard), 77});
    // Only shard 0 still holds a copy of version 7: of no use, released.
    if (shard == 0) resume.offloads.push_back(HeldCopy{7, layout_for(shard), checksums_for(7, shard), 66});
    request.resume = std::make_shared<const Resume>(std::move(resume));
    shards.push_back(driver.new_client());
    driver.open(shards.back(), request, 12);
  }
  ASSERT_TRUE(is<OpenOk>(driver.replies(shards)));
  const std::uint64_t adopted = driver.inbox(shards[0]).offload_copies.at(8);
  EXPECT_EQ(driver.inbox(shards[1]).offload_copies.at(8), adopted);
  EXPECT_EQ(driver.inbox(shards[0]).releases, std::vector<Version>{7});
  EXPECT_EQ(replica_info(driver, "t").offloads, std::vector<Version>{8});
  // Both answers lost; the shard reports the copies under the ids its open announced.
  driver.inbox(shards[0]).offloads.clear();
  driver.inbox(shards[0]).offload_copies.clear();
  driver.inbox(shards[0]).releases.clear();
  driver.report(shards[0], OffloadDone{8, 77});
  EXPECT_EQ(driver.inbox(shards[0]).offload_copies.at(8), adopted) << "renamed again";
  EXPECT_TRUE(driver.inbox(shards[0]).releases.empty()) << "the adopted copy is not freed";
  driver.report(shards[0], OffloadDone{7, 66});
  EXPECT_EQ(driver.inbox(shards[0]).releases, std::vector<Version>{7}) << "released again";
  EXPECT_FALSE(driver.inbox(shards[0]).offload_copies.contains(7));
  // Under the new id, the report of the adopted copy is a duplicate: nothing.
  driver.inbox(shards[0]).offloads.clear();
  driver.report(shards[0], OffloadDone{8, adopted});
  EXPECT_TRUE(driver.inbox(shards[0]).offloads.empty());
  EXPECT_EQ(driver.inbox(shards[0]).releases, std::vector<Version>{7});
  EXPECT_EQ(replica_info(driver, "t").offloads, std::vector<Version>{8});
}

TEST(HubFailover, BarrierTimesOutWhenAShardNeverReturns) {
  HubSettings settings;
  settings.barrier_timeout_ms = 1000;
  Driver driver(settings);
  const ClientId client = driver.new_client();
  driver.open(client, resume_request(driver, trainer("t"), 0, 9), 3);
  driver.advance(1200);
  EXPECT_EQ(expect_error(driver.replies({client}), Errc::kBarrierTimeout), "");
  EXPECT_EQ(driver.hub().client_count(), 0u);
}

TEST(HubFailover, ShardsBehindTheFailoverGetTheAnswerTheOthersGot) {
  Driver driver;
  const auto old = driver.open_replica(trainer("old", 2));
  const auto source = driver.open_replica(trainer("source", 2));
  driver.publish(old, 4);
  driver.publish(source, 5);
  // Replica r called replicate(latest-1) as call 8 on the old server: shard 0 completed it (version
  // 4), shard 1 did not. Both resume here; shard 1 calls it again and must get version 4 as well.
  const ReplicaSpec spec = rollout("r");
  TxnRecord record;
  record.seq = 8;
  record.op.kind = OpKind::kReplicate;
  record.op.selector = Selector::latest(1);
  record.outcome = ReplicateOk{4, "old"};
  const ClientId shard0 = driver.new_client();
  const ClientId shard1 = driver.new_client();
  driver.open(shard0, resume_request(driver, spec, 0, 4, record), 8);
  driver.open(shard1, resume_request(driver, spec, 1, std::nullopt), 7);
  // Shard 1 is let in to redo call 8; shard 0 waits until the replica is whole again.
  ASSERT_TRUE(is<OpenOk>(driver.replies({shard1})));
  EXPECT_FALSE(driver.has_reply(shard0));
  driver.set_next_seq(shard1, 8);
  driver.call(shard1, replicate(Selector::latest(1), 1));
  EXPECT_TRUE(driver.inbox(shard0).reads.empty()) << "shard 0 already holds its part";
  const auto read = read_of(driver, shard1);
  ASSERT_TRUE(read);
  EXPECT_EQ(read->version, 4u);
  EXPECT_EQ(read->source.replica, "old");
  driver.finish_reads({shard1});
  const auto reply = driver.take_reply(shard1);
  ASSERT_TRUE(reply && std::holds_alternative<ReplicateOk>(reply->outcome));
  EXPECT_EQ(std::get<ReplicateOk>(reply->outcome).version, 4u);
  EXPECT_TRUE(is<OpenOk>(driver.replies({shard0}))) << "shard 0 goes on now";
  // From here on the replica is whole: both shards hold version 4.
  driver.set_next_seq(shard0, 9);
  driver.call(shard0, ListRequest{});
  driver.call(shard1, ListRequest{});
  const auto list = driver.replies({shard0, shard1});
  ASSERT_TRUE(is<ListOk>(list));
  const auto& replicas = std::get<ListOk>(*list).snapshot->replicas;
  ASSERT_EQ(replicas.size(), 3u);
  EXPECT_EQ(replicas[1].name, "r");
  EXPECT_EQ(replicas[1].state, "complete");
  EXPECT_EQ(replicas[1].version, 4u);
}

TEST(HubFailover, ShardsThatDisagreeAboutTheirPositionFailTheBarrier) {
  Driver driver;
  const ReplicaSpec spec = rollout("r");
  const ClientId shard0 = driver.new_client();
  const ClientId shard1 = driver.new_client();
  driver.open(shard0, resume_request(driver, spec, 0, std::nullopt), 9);
  driver.open(shard1, resume_request(driver, spec, 1, std::nullopt), 5);
  EXPECT_EQ(expect_error(driver.replies({shard0, shard1}), Errc::kDivergentCall), "");
}

// ---- regressions: cases the property test once falsified ------------------------------------------

// Found by property-long (seed 5): the shards of a closing replica were told "replica closed" by the
// old server, which died before the close finished. They resumed the replica on a fresh server and
// a later close of it was answered CloseOk: the replica its shards were told had closed lived on.
// Closing ends the incarnation, across failovers too.
TEST(HubRegression, AReplicaOneShardWasToldClosedIsNotResumed) {
  Driver driver;
  const ReplicaSpec spec = trainer("t");
  const TxnRecord record = answered(6, OpKind::kClose, make_error(Errc::kReplicaClosed, "closed on the old server"));
  const ClientId shard0 = driver.new_client();
  const ClientId shard1 = driver.new_client();
  driver.open(shard0, resume_request(driver, spec, 0, 3, record), 6);
  driver.open(shard1, resume_request(driver, spec, 1, 3), 5);
  const auto refused = driver.replies({shard0, shard1});
  ASSERT_EQ(expect_error(refused, Errc::kReplicaClosed), "");
  const std::string& detail = std::get<Error>(*refused).detail;
  EXPECT_NE(detail.find("shard 0 was told so at call 6"), std::string::npos) << detail;
  EXPECT_FALSE(driver.hub().latest("m")) << "the closed replica's copy is not published again";
  // Opened afresh, it is a new replica that holds nothing.
  const auto fresh = driver.open_replica(spec);
  driver.call_all(fresh, ListRequest{});
  const auto list = driver.replies(fresh);
  ASSERT_TRUE(is<ListOk>(list));
  EXPECT_EQ(std::get<ListOk>(*list).snapshot->replicas.size(), 1u);
  EXPECT_EQ(std::get<ListOk>(*list).snapshot->replicas[0].state, "empty");
}

// Found by HubProperty: after a failover, a shard that had not yet called `list` got the new server's
// answer while its peer had the old server's. The resuming client's record now carries the answer.
TEST(HubRegression, ListAnsweredBeforeAFailoverIsAnsweredTheSameAfterIt) {
  Driver driver;
  const ReplicaSpec spec = rollout("r");
  auto old_listing = std::make_shared<ListSnapshot>();
  old_listing->model = "m";
  old_listing->latest = 17;
  const TxnRecord record = answered(4, OpKind::kList, ListOk{old_listing});
  const ClientId shard0 = driver.new_client();
  const ClientId shard1 = driver.new_client();
  driver.open(shard0, resume_request(driver, spec, 0, std::nullopt, record), 4);
  driver.open(shard1, resume_request(driver, spec, 1, std::nullopt), 3);
  ASSERT_TRUE(is<OpenOk>(driver.replies({shard0, shard1})));
  driver.set_next_seq(shard1, 4);
  driver.call(shard1, ListRequest{});
  const auto reply = driver.take_reply(shard1);
  ASSERT_TRUE(reply && std::holds_alternative<ListOk>(reply->outcome));
  EXPECT_EQ(std::get<ListOk>(reply->outcome).snapshot->latest, 17u) << "the old server's answer";
}

// Found by th-demo: one shard of a replica had its unpublish answered and closed before its peer's
// unpublish arrived; the peer was told "replica closed" for a call already decided (different
// answers for one call). A call decided before the close gets its answer.
TEST(HubRegression, ACallDecidedBeforeACloseIsAnsweredTheSameToLateShards) {
  Driver driver;
  const auto t = driver.open_replica(trainer("t"));
  driver.publish(t, 1);
  driver.call(t[0], UnpublishRequest{});
  const auto first = driver.take_reply(t[0]);
  ASSERT_TRUE(first && std::holds_alternative<UnpublishOk>(first->outcome));
  driver.call(t[0], CloseRequest{});
  driver.call(t[1], UnpublishRequest{});
  const auto late = driver.take_reply(t[1]);
  ASSERT_TRUE(late.has_value());
  EXPECT_TRUE(std::holds_alternative<UnpublishOk>(late->outcome)) << "the same answer as shard 0";
  driver.call(t[1], CloseRequest{});
  EXPECT_TRUE(is<CloseOk>(driver.replies(t)));
}

// Found by HubProperty: a seeder that a reader reported as failed still counted towards "one seeder
// per datacenter", so the hub's own invariant tripped when the reader seeded again.
TEST(HubRegression, AFailedSeederMayBeReplacedByAnotherSeeder) {
  HubSettings settings;
  settings.fanout_max = 2;
  settings.smart_skipping = false;  // so that b pipelines behind the seeder
  Driver driver(settings);
  const auto t = driver.open_replica(trainer("t"));
  driver.publish(t, 1);
  const auto a = driver.open_replica(rollout("a", 2, "dc1"));
  const auto b = driver.open_replica(rollout("b", 2, "dc1"));
  start_replicate(driver, a, Selector::latest());
  start_replicate(driver, b, Selector::latest());
  const auto read = *read_of(driver, b[0]);
  ASSERT_EQ(read.source.replica, "a");
  driver.report(b[0], TransferFailed{read.transfer, read.epoch, ReadFailure::kChecksumMismatch});
  EXPECT_EQ(read_of(driver, b[0])->source.replica, "t") << "b seeds dc1 itself";
  driver.finish_reads(a);
  driver.finish_reads(b);
  EXPECT_TRUE(is<ReplicateOk>(driver.replies(a)));
  EXPECT_TRUE(is<ReplicateOk>(driver.replies(b)));
}

// Found by HubRetentionProperty: an offload copy draining to be released coexisted with a new
// offload of the same version, and ReleaseOffload{version} named both. The releasing copy is kept.
TEST(HubRegression, AnOffloadBeingReleasedIsKeptInsteadOfMadeTwice) {
  Driver driver;
  ReplicaSpec spec = trainer("t");
  spec.retention.keep_latest = 0;
  const auto t = driver.open_replica(spec);
  const auto r = driver.open_replica(rollout("r"));
  driver.publish(t, 1);
  driver.call_all(t, UnpublishRequest{});
  driver.finish_offloads(t);
  EXPECT_TRUE(is<UnpublishOk>(driver.replies(t)));
  start_replicate(driver, r, Selector::latest());  // reads the offload copy
  ASSERT_EQ(read_of(driver, r[0])->source.kind, CopyKind::kOffload);
  driver.publish(t, 1);  // t holds version 1 again: its offload copy starts draining for release
  driver.call_all(t, UnpublishRequest{});
  EXPECT_TRUE(is<UnpublishOk>(driver.replies(t))) << "the draining offload copy is kept";
  EXPECT_TRUE(driver.inbox(t[0]).offloads.empty()) << "no second offload of version 1";
  driver.finish_reads(r);
  EXPECT_TRUE(is<ReplicateOk>(driver.replies(r)));
  EXPECT_EQ(driver.inbox(t[0]).releases, std::vector<Version>{1}) << "released once, once r holds it";
}

// th-sim --seed 500238 --workload cross-dc (issue 10, point 1): two root readers each counted the
// other's downstream copies as "could still serve" and waited for each other forever. Here at the
// hub alone: the chain t -> a -> b -> c -> d -> e -> f, with f, d and b reporting failed reads,
// leaves c and e reading from waiting roots; once t unpublishes (not retained) and a's read from
// t fails, no copy holds the bytes any more: every reader is told so, none waits.
TEST(HubRegression, ChainsEndingInWaitingReadersAreUnavailableNotAHang) {
  Driver driver;  // pipeline, fan-out 1
  const auto t = driver.open_replica(trainer("t"));
  driver.publish(t, 1);
  const std::vector<std::string> names = {"a", "b", "c", "d", "e", "f"};
  std::map<std::string, std::vector<ClientId>> r;
  for (const std::string& name : names) {
    r[name] = driver.open_replica(rollout(name));
    start_replicate(driver, r[name], Selector::latest());
  }
  for (std::size_t i = 1; i < names.size(); ++i) {
    ASSERT_EQ(read_of(driver, r[names[i]][0])->source.replica, names[i - 1]);
  }
  auto fail_read = [&](const std::string& name) {
    for (ClientId client : r[name]) {
      const StartRead read = *read_of(driver, client);
      driver.report(client, TransferFailed{read.transfer, read.epoch, ReadFailure::kSourceUnreachable});
    }
  };
  fail_read("f");
  fail_read("d");
  fail_read("b");
  driver.call_all(t, UnpublishRequest{});
  fail_read("a");
  EXPECT_TRUE(is<UnpublishOk>(driver.replies(t)));
  for (const std::string& name : names) {
    EXPECT_EQ(expect_error(driver.replies(r[name]), Errc::kVersionUnavailable), "") << name;
  }
  const HubActivity activity = driver.hub().activity();
  EXPECT_EQ(activity.transfers_waiting + activity.transfers_active, 0u);
}

// Two chain roots in one datacenter lose their sources at once; each chain has a tail in a
// datacenter of its own, so that the only complete copy (in a fourth) is a detour for neither.
// A chain that ends in a reader still waiting must not count as "a source soon here": each root
// would wait for the other's chain, for ever. (Since reads across datacenters have a slot of their
// own (563da0a), a root here reads the other chain's end at once, and this shape no longer reaches
// that rule: the mutant 'waiting-chain-counts' is pinned across layouts instead, by
// HubLayouts.TwoRootsOfOtherLayoutsDoNotWaitForEachOthersWaitingChains and gen_chain_case.)
TEST(HubRegression, TwoRootsDoNotWaitForEachOthersWaitingChains) {
  Driver driver;  // pipeline, fan-out 1, smart skipping
  auto one = [&](const std::string& name, const std::string& datacenter) {
    return driver.open_replica(rollout(name, 1, datacenter));
  };
  ReplicaSpec far_trainer = trainer("t", 1);
  far_trainer.datacenter = "dc3";
  const auto t = driver.open_replica(far_trainer);
  driver.publish(t, 1);
  std::map<std::string, std::vector<ClientId>> r;
  auto replicate_from = [&](const std::string& name, const std::string& datacenter,
                            const std::string& source) {
    r[name] = one(name, datacenter);
    start_replicate(driver, r[name], Selector::latest());
    const auto read = read_of(driver, r[name][0]);
    ASSERT_TRUE(read) << name;
    ASSERT_EQ(read->source.replica, source) << name;
  };
  replicate_from("s1", "dc0", "t");
  driver.finish_reads(r["s1"]);
  replicate_from("s2", "dc0", "s1");
  driver.finish_reads(r["s2"]);
  ASSERT_TRUE(is<ReplicateOk>(driver.replies(r["s1"])));
  ASSERT_TRUE(is<ReplicateOk>(driver.replies(r["s2"])));
  replicate_from("w1", "dc0", "s1");
  replicate_from("w2", "dc0", "s2");
  replicate_from("c1", "dc0", "w1");
  replicate_from("c2", "dc0", "w2");
  replicate_from("f", "dc3", "t");
  replicate_from("d1", "dc1", "c1");
  replicate_from("d2", "dc2", "c2");
  // Both roots' sources die.
  // Their reads from the sources about to die are void (the data plane fails them).
  driver.inbox(r["w1"][0]).reads.clear();
  driver.inbox(r["w2"][0]).reads.clear();
  driver.lose_connection(r["s1"][0]);
  driver.lose_connection(r["s2"][0]);
  // Every reader finishes: each round, whoever reads from a complete copy reads to the end.
  const std::vector<std::string> readers = {"f", "w1", "w2", "c1", "c2", "d1", "d2"};
  EXPECT_EQ(driver.finish_chains(r, readers, {"t"}), std::vector<std::string>{}) << "readers left waiting for ever";
  const HubActivity activity = driver.hub().activity();
  EXPECT_EQ(activity.transfers_waiting + activity.transfers_active, 0u);
}

// Soak find (AgentModel, three datacenters): an offload copy being released, because another
// non-spot replica had come to hold the version, was still released after that replica crashed:
// the retained version was left on nothing safe. The release is taken back.
TEST(HubRegression, AnOffloadBeingReleasedIsKeptWhenTheCopyThatMadeItRedundantGoes) {
  Driver driver;
  ReplicaSpec spec = trainer("t", 1);
  spec.retention.keep_latest = 0;  // latest is retained
  const auto t = driver.open_replica(spec);
  driver.publish(t, 1);
  driver.call_all(t, UnpublishRequest{});
  driver.finish_offloads(t);
  ASSERT_TRUE(is<UnpublishOk>(driver.replies(t)));
  const auto q = driver.open_replica(rollout("q", 1));
  start_replicate(driver, q, Selector::latest());
  ASSERT_EQ(read_of(driver, q[0])->source.kind, CopyKind::kOffload);
  const auto r = driver.open_replica(rollout("r", 1));
  start_replicate(driver, r, Selector::latest());
  driver.finish_reads(r);
  ASSERT_TRUE(is<ReplicateOk>(driver.replies(r)));
  // r holds version 1: t's offload copy drains to be released (q still reads it)...
  EXPECT_TRUE(driver.inbox(t[0]).releases.empty());
  auto offloaded = [&] {
    const auto snapshot = driver.hub().snapshot("m");
    return snapshot->versions.at(0).version == 1 && snapshot->versions.at(0).offloaded;
  };
  EXPECT_FALSE(offloaded()) << "draining: it takes no new reader";
  // ...and r crashes before q is done: the offload copy is the last safe one again.
  driver.lose_connection(r[0]);
  EXPECT_TRUE(offloaded()) << "complete again, readable";
  EXPECT_TRUE(driver.inbox(t[0]).releases.empty());
  // Once q holds the version, the offload copy may go (q is a safe copy).
  driver.finish_reads(q);
  ASSERT_TRUE(is<ReplicateOk>(driver.replies(q)));
  EXPECT_EQ(driver.inbox(t[0]).releases, std::vector<Version>{1});
}

// The same, as the paper's pathological case: a retained version whose last non-spot holder
// crashes (its connection drops) while readers chain behind it ends in version-unavailable.
TEST(HubRegression, RetainedVersionWhoseLastHolderCrashesIsUnavailableToEveryChain) {
  Driver driver;
  ReplicaSpec spec = trainer("t");
  spec.retention.keep_latest = 1;
  const auto t = driver.open_replica(spec);
  driver.publish(t, 1);
  std::vector<std::vector<ClientId>> readers;
  for (int i = 0; i < 4; ++i) {
    readers.push_back(driver.open_replica(rollout("r" + std::to_string(i))));
    start_replicate(driver, readers.back(), Selector::latest());
  }
  // r1 and r3 lost their sources (partial chains r1 -> r2 and r3 hang off waiting roots).
  for (int i : {1, 3}) {
    for (ClientId client : readers[i]) {
      const StartRead read = *read_of(driver, client);
      driver.report(client, TransferFailed{read.transfer, read.epoch, ReadFailure::kSourceUnreachable});
    }
  }
  driver.lose_connection(t[0]);
  for (const auto& reader : readers) {
    EXPECT_EQ(expect_error(driver.replies(reader), Errc::kVersionUnavailable), "");
  }
}

// A reader may wait for a copy that is still receiving when that copy's chain ends in one that is
// draining: the draining copy serves its readers to the end, so the chain completes.
TEST(HubRegression, ReaderWaitsBehindAChainFromADrainingCopy) {
  HubSettings settings;
  settings.pipeline = false;
  Driver driver(settings);
  const auto t = driver.open_replica(trainer("t"));
  driver.publish(t, 1);
  const auto a = driver.open_replica(rollout("a"));
  start_replicate(driver, a, Selector::latest());
  driver.call_all(t, UnpublishRequest{});  // not retained: t drains, then goes
  const auto b = driver.open_replica(rollout("b"));
  start_replicate(driver, b, Selector::latest());
  EXPECT_FALSE(driver.has_reply(b[0])) << "b waits for a, which will hold version 1";
  driver.finish_reads(a);
  EXPECT_TRUE(is<ReplicateOk>(driver.replies(a)));
  EXPECT_TRUE(is<UnpublishOk>(driver.replies(t)));
  EXPECT_EQ(read_of(driver, b[0])->source.replica, "a");
  driver.finish_reads(b);
  EXPECT_TRUE(is<ReplicateOk>(driver.replies(b)));
}

// th-sim --seed 722011 --workload cross-dc --faults drop=0.05,crash=0.5,read-failure=0.1,
// server-crash=1: a chain r3 -> r2 -> r1 in dc1, which r0 in dc0 reads from across datacenters,
// lost its root's source; the only complete copy left, t0, is in dc0, so the detour rule ruled it
// out and r3 waited for ever. A complete copy is taken then.
TEST(HubRegression, AChainRootTakesADetourRatherThanWaitForNothing) {
  HubSettings settings;
  settings.smart_skipping = false;  // so that readers chain behind the seeder
  settings.fanout_max = 2;
  Driver driver(settings);
  const auto t0 = driver.open_replica(rollout("t0", 2, "dc0"));
  const auto t2 = driver.open_replica(rollout("t2", 2, "dc2"));
  driver.publish(t0, 1);
  driver.publish(t2, 1);
  std::map<std::string, std::vector<ClientId>> r;
  auto fail_read = [&](const std::string& name) {  // every shard reports the same source
    std::vector<StartRead> reads;
    for (ClientId client : r[name]) reads.push_back(*read_of(driver, client));
    for (std::size_t shard = 0; shard < reads.size(); ++shard) {
      driver.report(r[name][shard], TransferFailed{reads[shard].transfer, reads[shard].epoch,
                                                   ReadFailure::kSourceUnreachable});
    }
  };
  r["r3"] = driver.open_replica(rollout("r3", 2, "dc1"));
  start_replicate(driver, r["r3"], Selector::latest());
  ASSERT_EQ(read_of(driver, r["r3"][0])->source.replica, "t0");
  fail_read("r3");  // t0 is suspect from now on
  ASSERT_EQ(read_of(driver, r["r3"][0])->source.replica, "t2");
  for (const char* name : {"r2", "r1"}) {
    r[name] = driver.open_replica(rollout(name, 2, "dc1"));
    start_replicate(driver, r[name], Selector::latest());
  }
  ASSERT_EQ(read_of(driver, r["r1"][0])->source.replica, "r2");
  r["r0"] = driver.open_replica(rollout("r0", 2, "dc0"));
  start_replicate(driver, r["r0"], Selector::latest());
  ASSERT_EQ(read_of(driver, r["r0"][0])->source.replica, "r1") << "across datacenters";
  driver.lose_connection(t2[0]);  // r3's source is gone
  const auto read = read_of(driver, r["r3"][0]);
  ASSERT_TRUE(read);
  EXPECT_EQ(read->source.replica, "t0");
  EXPECT_EQ(read->epoch, 3u);
  for (const char* name : {"r3", "r2", "r1", "r0"}) {
    driver.finish_reads(r[name]);
    EXPECT_TRUE(is<ReplicateOk>(driver.replies(r[name]))) << name;
  }
}

// Found by AgentModel (lossy): shard 1 of a replica was answered "version unavailable" for call 1
// while shard 0's open was still lost; after a failover shard 0 opened afresh first, shard 1's
// resume was refused, and shard 0 got "no newer version" for the same call. A replica now takes
// calls only once every shard has opened, so no shard learns anything its peers' opens could
// change, and a shard with nothing to resume joins peers that opened afresh.
TEST(HubRegression, ACallWaitsUntilEveryShardHasOpened) {
  Driver driver;
  const ReplicaSpec spec = rollout("r");
  const ClientId shard0 = driver.new_client();
  const ClientId shard1 = driver.new_client();
  driver.open(shard1, driver.open_request(spec, 1));
  ASSERT_TRUE(is<OpenOk>(driver.replies({shard1})));
  driver.call(shard1, UpdateRequest{Selector::latest(), layout_for(1)});
  EXPECT_FALSE(driver.has_reply(shard1)) << "shard 0 has not opened";
  driver.advance(1000);
  EXPECT_FALSE(driver.has_reply(shard1));
  driver.open(shard0, driver.open_request(spec, 0));
  ASSERT_TRUE(is<OpenOk>(driver.replies({shard0})));
  ASSERT_TRUE(driver.has_reply(shard1)) << "taken once every shard opened";
  driver.call(shard0, UpdateRequest{Selector::latest(), layout_for(0)});
  EXPECT_TRUE(is<UpdateOk>(driver.replies({shard0, shard1})));
}

TEST(HubRegression, AShardWithNothingToResumeJoinsPeersThatOpenedAfresh) {
  Driver driver;  // the new server
  const ReplicaSpec spec = rollout("r");
  const ClientId shard0 = driver.new_client();
  const ClientId shard1 = driver.new_client();
  driver.open(shard0, driver.open_request(spec, 0));
  ASSERT_TRUE(is<OpenOk>(driver.replies({shard0})));
  driver.open(shard1, resume_request(driver, spec, 1, std::nullopt), 0);
  ASSERT_TRUE(is<OpenOk>(driver.replies({shard1}))) << "not told to start over";
  driver.call_all({shard0, shard1}, ListRequest{});
  EXPECT_TRUE(is<ListOk>(driver.replies({shard0, shard1})));
}

// Trainer t publishes version 1, unpublishes it (an offload copy keeps it), reads it back from
// that copy and reports it; a spot rollout r pipelining from t's buffers reports them too, so no
// copy of version 1 is trusted. Neither read is finished.
void report_every_copy_of_version_1(Driver& driver, std::vector<ClientId>* t, std::vector<ClientId>* r,
                                    StartRead* pipelined) {
  ReplicaSpec spec = trainer("t", 1);
  spec.retention.keep_latest = 0;
  *t = driver.open_replica(spec);
  driver.publish(*t, 1);
  driver.call_all(*t, UnpublishRequest{});
  driver.finish_offloads(*t);
  ASSERT_TRUE(is<UnpublishOk>(driver.replies(*t)));
  driver.call_all(*t, UpdateRequest{Selector::latest(), layout_for(0)});
  const auto read = read_of(driver, (*t)[0]);
  ASSERT_TRUE(read && read->source.kind == CopyKind::kOffload);
  driver.report((*t)[0], TransferFailed{read->transfer, read->epoch, ReadFailure::kSourceUnreachable});
  ReplicaSpec r_spec = rollout("r", 1);
  r_spec.spot = true;
  *r = driver.open_replica(r_spec);
  driver.call_all(*r, UpdateRequest{Selector::latest(), layout_for(0)});
  const auto from_buffers = read_of(driver, (*r)[0]);
  ASSERT_TRUE(from_buffers && from_buffers->source.replica == "t" && from_buffers->source.partial);
  driver.report((*r)[0], TransferFailed{from_buffers->transfer, from_buffers->epoch,
                                        ReadFailure::kSourceUnreachable});
  *pipelined = *from_buffers;
}

// Found by AgentModel (lossy): a trainer read its own offload copy back, a read of it failed, and
// its next unpublish made a second offload copy of the version beside the reported one (the agent
// keeps one per version). The reported copy, never read again, is released for the new one.
TEST(HubRegression, AnUnpublishReplacesAnOffloadCopyAReaderReported) {
  Driver driver;
  std::vector<ClientId> t, r;
  StartRead pipelined;
  ASSERT_NO_FATAL_FAILURE(report_every_copy_of_version_1(driver, &t, &r, &pipelined));
  driver.finish_reads(t);  // from the reported copy, the last resort
  ASSERT_TRUE(is<UpdateOk>(driver.replies(t)));
  driver.finish_reads(r);
  ASSERT_TRUE(is<UpdateOk>(driver.replies(r)));
  ASSERT_TRUE(driver.inbox(t[0]).releases.empty());
  driver.call_all(t, UnpublishRequest{});
  EXPECT_EQ(driver.inbox(t[0]).releases, std::vector<Version>{1}) << "the reported copy goes";
  ASSERT_EQ(driver.inbox(t[0]).offloads, std::vector<Version>{1}) << "a new one is made";
  driver.finish_offloads(t);
  EXPECT_TRUE(is<UnpublishOk>(driver.replies(t)));
}

// Soak find (AgentModel, lossy network): the reported offload copy an unpublish replaces was
// released while a reader still read it as its last resort. The reader is told to stop first.
TEST(HubRegression, AReplacedOffloadCopysReaderStopsBeforeTheCopyIsReleased) {
  Driver driver;
  std::vector<ClientId> t, r;
  StartRead pipelined;
  ASSERT_NO_FATAL_FAILURE(report_every_copy_of_version_1(driver, &t, &r, &pipelined));
  // Once t is done, r goes on from the reported offload copy: the last resort.
  driver.finish_reads(t);
  ASSERT_TRUE(is<UpdateOk>(driver.replies(t)));
  const auto from_offload = read_of(driver, r[0]);
  ASSERT_TRUE(from_offload && from_offload->epoch > pipelined.epoch);
  ASSERT_EQ(from_offload->source.kind, CopyKind::kOffload);
  // t unpublishes: the reported copy is replaced while r still reads it. (The outside observer
  // fails the step if the copy is released while r's grant to read it stands.)
  driver.call_all(t, UnpublishRequest{});
  EXPECT_EQ(driver.inbox(t[0]).releases, std::vector<Version>{1}) << "the reported copy goes";
  EXPECT_EQ(driver.inbox(t[0]).offloads, std::vector<Version>{1}) << "a new one is made";
  driver.finish_offloads(t);
  EXPECT_TRUE(is<UnpublishOk>(driver.replies(t)));
  const auto last = read_of(driver, r[0]);
  ASSERT_TRUE(last && last->epoch > from_offload->epoch) << "r reads from another copy";
  driver.finish_reads(r);
  EXPECT_TRUE(is<UpdateOk>(driver.replies(r)));
}

// A shard that never opens cannot keep its peers' calls waiting for ever.
TEST(HubOpen, ACallWaitsForMissingShardsOnlyUntilTheBarrierTimeout) {
  HubSettings settings;
  settings.barrier_timeout_ms = 5'000;
  Driver driver(settings);
  const ReplicaSpec spec = rollout("r");
  const ClientId shard0 = driver.new_client();
  driver.open(shard0, driver.open_request(spec, 0));
  ASSERT_TRUE(is<OpenOk>(driver.replies({shard0})));
  driver.advance(10'000);  // no call waits: the replica may take its time to fill
  EXPECT_TRUE(driver.inbox(shard0).evictions.empty());
  driver.call(shard0, ListRequest{});
  driver.advance(4'900);
  EXPECT_TRUE(driver.inbox(shard0).evictions.empty());
  driver.advance(200);
  ASSERT_EQ(driver.inbox(shard0).evictions.size(), 1u);
  EXPECT_EQ(driver.inbox(shard0).evictions[0].reason, Errc::kBarrierTimeout);
  EXPECT_TRUE(driver.hub().snapshot("m")->replicas.empty()) << "the replica is gone";
}

TEST(HubSettingsTest, InvalidSettingsAreRejected) {
  HubSettings settings;
  settings.fanout_max = 0;
  EXPECT_FALSE(validate(settings).ok());
  EXPECT_THROW(Hub{settings}, RequirementFailure);
  settings = HubSettings{};
  settings.heartbeat_timeout_ms = 0;
  EXPECT_FALSE(validate(settings).ok());
  EXPECT_TRUE(validate(HubSettings{}).ok());
}

TEST(HubStep, TimeMustNotGoBackwards) {
  Hub hub(HubSettings{});
  Effects effects;
  hub.step(Tick{}, 100, effects);
  EXPECT_THROW(hub.step(Tick{}, 99, effects), RequirementFailure);
}

}  // namespace
}  // namespace th::test
