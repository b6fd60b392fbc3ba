// Delta versions at the hub (core/hub_patches.cpp): which reads are patch reads, from whom, and
// what a failed one leaves. The property (hub_patch_property.cpp) checks the same rules against a
// model of the buffers over random fleets; these pin each rule by name.
#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <vector>

#include "tests/core/testkit/driver.h"

namespace th::test {
namespace {

// A patch of a twentieth of each large tensor; small ones have none (they are read whole).
PatchRef patch_against(Version base) {
  PatchInfo info{base, {}};
  const LayoutRef layout = layout_for(0);
  for (const TensorSpec& tensor : layout->tensors()) info.tensor_bytes.push_back(tensor.bytes >= 1000 ? tensor.bytes / 20 : 0);
  return std::make_shared<const PatchInfo>(std::move(info));
}

class HubPatches : public ::testing::Test {
 protected:
  HubPatches() : driver_(settings(1)) {
    trainer_ = driver_.open_replica(spec("t", "trainer"));
    for (const char* name : {"r0", "r1"}) rollouts_.push_back(driver_.open_replica(spec(name, "rollout")).at(0));
  }
  static HubSettings settings(std::uint32_t fanout_max) {
    HubSettings s;
    s.fanout_max = fanout_max;
    return s;
  }
  static ReplicaSpec spec(const std::string& name, const std::string& role) {
    ReplicaSpec s;
    s.name = name;
    s.role = role;
    return s;
  }
  // The trainer publishes `version` (after unpublishing the one before), with a patch or not.
  void publish(Version version, PatchRef patch) {
    if (version > 1) {
      driver_.call_all(trainer_, UnpublishRequest{});
      ASSERT_TRUE(is<UnpublishOk>(driver_.replies(trainer_)));
    }
    driver_.call(trainer_.at(0), PublishRequest{version, layout_for(0), checksums_for(version, 0), std::move(patch)});
    const std::optional<Outcome> outcome = driver_.replies(trainer_);
    ASSERT_TRUE(is<PublishOk>(outcome)) << (outcome ? describe(*outcome) : "no reply");
  }
  void update(std::size_t rollout) { driver_.call(rollouts_.at(rollout), UpdateRequest{Selector::latest(), layout_for(0)}); }
  // The rollout's one outstanding read, taken from its inbox.
  StartRead take_read(std::size_t rollout) {
    auto& reads = driver_.inbox(rollouts_.at(rollout)).reads;
    EXPECT_EQ(reads.size(), 1u);
    if (reads.empty()) return {};
    StartRead read = reads.begin()->second;
    reads.erase(reads.begin());
    return read;
  }
  void finish(std::size_t rollout, const StartRead& read, Version version) {
    driver_.report(rollouts_.at(rollout), TransferDone{read.transfer, read.epoch, nullptr});
    const std::optional<Outcome> outcome = driver_.replies({rollouts_.at(rollout)});
    ASSERT_TRUE(is<UpdateOk>(outcome)) << (outcome ? describe(*outcome) : "no reply");
    EXPECT_EQ(std::get<UpdateOk>(*outcome).version, std::optional<Version>(version));
  }
  // r0 and r1 hold version 1 whole (read before any patch), and the trainer published 2 with a
  // patch against 1.
  void both_hold_one_then_two_is_patched() {
    publish(1, nullptr);
    read_version(0, 1);
    read_version(1, 1);
    publish(2, patch_against(1));
  }
  void read_version(std::size_t rollout, Version version) {
    update(rollout);
    finish(rollout, take_read(rollout), version);
  }

  Driver driver_;
  std::vector<ClientId> trainer_;
  std::vector<ClientId> rollouts_;
};

TEST_F(HubPatches, AReaderHoldingTheVersionBeforeReadsThePatch) {
  publish(1, nullptr);
  read_version(0, 1);
  publish(2, patch_against(1));
  update(0);
  const StartRead read = take_read(0);
  ASSERT_NE(read.patch, nullptr) << "the rollout holds version 1 whole: it reads the patch";
  EXPECT_EQ(*read.patch, *patch_against(1));
  EXPECT_EQ(read.source.replica, "t");
  const auto& grants = driver_.inbox(trainer_.at(0)).grants;
  ASSERT_EQ(grants.size(), 1u);
  EXPECT_TRUE(grants.begin()->second.patch) << "the source is told to serve its patch";
  finish(0, read, 2);
  EXPECT_EQ(driver_.hub().stats().patch_reads_started, 1u);
  EXPECT_EQ(driver_.hub().stats().patches_kept, 1u);
}

TEST_F(HubPatches, AReaderThatHoldsNothingOrSkippedAVersionReadsTheBytes) {
  publish(1, nullptr);
  read_version(0, 1);
  publish(2, patch_against(1));
  update(1);  // holds nothing
  const StartRead whole = take_read(1);
  EXPECT_EQ(whole.patch, nullptr);
  finish(1, whole, 2);
  publish(3, patch_against(2));
  update(0);  // holds 1: the patch is against 2
  EXPECT_EQ(take_read(0).patch, nullptr);
}

TEST_F(HubPatches, AFailedPatchReadGoesOnWithTheBytes) {
  publish(1, nullptr);
  read_version(0, 1);
  publish(2, patch_against(1));
  update(0);
  const StartRead patched = take_read(0);
  ASSERT_NE(patched.patch, nullptr);
  // The rollout's buffers were written since it held version 1: it wrote nothing and says so.
  driver_.report(rollouts_.at(0), TransferFailed{patched.transfer, patched.epoch, ReadFailure::kPatchBaseMismatch});
  const StartRead dense = take_read(0);
  EXPECT_EQ(dense.transfer, patched.transfer);
  EXPECT_GT(dense.epoch, patched.epoch);
  EXPECT_EQ(dense.patch, nullptr) << "after a failed patch read, the bytes";
  finish(0, dense, 2);
  EXPECT_EQ(driver_.hub().stats().patches_kept, 0u) << "a reader that read the bytes has no patch to serve";
  EXPECT_EQ(driver_.hub().stats().patch_reads_failed, 1u);
}

// A source that no longer has its patch (it refused the read) serves no more patch reads; its bytes
// are not in doubt.
TEST_F(HubPatches, APatchItsSourceRefusedIsNotServedAgain) {
  both_hold_one_then_two_is_patched();
  update(0);
  const StartRead first = take_read(0);
  ASSERT_NE(first.patch, nullptr);
  driver_.report(rollouts_.at(0), TransferFailed{first.transfer, first.epoch, ReadFailure::kSourceRefused});
  const StartRead again = take_read(0);
  EXPECT_EQ(again.patch, nullptr);
  EXPECT_EQ(again.source.replica, "t") << "the trainer's bytes still serve";
  finish(0, again, 2);
  update(1);
  const StartRead second = take_read(1);
  EXPECT_EQ(second.patch, nullptr) << "nobody holds a patch it can serve";
}

// With the only holder busy (fan-out 1, the default), a reader that can read the patch waits for it (a patch is a small
// part of the bytes) and then reads it from the first reader, which applied and kept it.
TEST_F(HubPatches, AReaderWaitsForABusyHolderAndReadsThePatchFromThoseThatAppliedIt) {
  both_hold_one_then_two_is_patched();
  update(0);
  const StartRead first = take_read(0);
  ASSERT_NE(first.patch, nullptr);
  update(1);
  EXPECT_TRUE(driver_.inbox(rollouts_.at(1)).reads.empty()) << "r1 waits for a holder of the patch";
  finish(0, first, 2);
  const StartRead second = take_read(1);
  ASSERT_NE(second.patch, nullptr);
  EXPECT_EQ(second.source.replica, "t") << "the least loaded holder";
  finish(1, second, 2);
  EXPECT_EQ(driver_.hub().stats().patches_kept, 2u);
}

// The wait above is for a holder whose slots patch reads hold (short reads). One whose slot a read
// of the bytes holds may stay busy long: the reader reads the bytes from an idle copy at once.
TEST_F(HubPatches, AReaderDoesNotWaitForAHolderThatServesTheBytes) {
  const ClientId r2 = driver_.open_replica(spec("r2", "rollout")).at(0);
  rollouts_.push_back(r2);
  publish(1, nullptr);
  read_version(0, 1);
  publish(2, patch_against(1));
  read_version(2, 2);  // r2 held nothing: the bytes, and it is complete now
  update(1);           // holds nothing either: the bytes, from the trainer (the older copy)
  const StartRead whole = take_read(1);
  ASSERT_EQ(whole.source.replica, "t");
  ASSERT_EQ(whole.patch, nullptr);
  update(0);
  const StartRead read = take_read(0);
  EXPECT_EQ(read.source.replica, "r2") << "not a wait for the trainer, whose slot a long read holds";
  EXPECT_EQ(read.patch, nullptr);
}

// A patch that failed its checksums once may have met a reader whose buffers were written behind
// the server's back: the holder keeps serving it until a second reader fails with it.
TEST_F(HubPatches, OneReaderFailingAPatchDoesNotTakeItFromEveryone) {
  both_hold_one_then_two_is_patched();
  update(0);
  const StartRead first = take_read(0);
  ASSERT_NE(first.patch, nullptr);
  driver_.report(rollouts_.at(0), TransferFailed{first.transfer, first.epoch, ReadFailure::kChecksumMismatch});
  finish(0, take_read(0), 2);
  update(1);
  const StartRead second = take_read(1);
  EXPECT_NE(second.patch, nullptr) << "one failure is not the patch's fault for sure";
  driver_.report(rollouts_.at(1), TransferFailed{second.transfer, second.epoch, ReadFailure::kChecksumMismatch});
  const StartRead third = take_read(1);
  EXPECT_EQ(third.patch, nullptr) << "two are";
}

// A pipeline stage whose weights are frozen writes nothing through a patch writer: its shard
// announces no patch while its peers do. Readers still read the patch, that shard's tensors whole.
TEST(HubPatchesSharded, AShardWithoutAPatchIsReadWholeWithinThePatchRead) {
  Driver driver;
  ReplicaSpec trainer_spec;
  trainer_spec.name = "t";
  trainer_spec.role = "trainer";
  trainer_spec.num_shards = 2;
  ReplicaSpec rollout_spec;
  rollout_spec.name = "r";
  rollout_spec.num_shards = 2;
  const std::vector<ClientId> trainer = driver.open_replica(trainer_spec);
  const std::vector<ClientId> rollout = driver.open_replica(rollout_spec);
  driver.publish(trainer, 1);
  for (std::uint32_t shard = 0; shard < 2; ++shard) driver.call(rollout[shard], UpdateRequest{Selector::latest(), layout_for(shard)});
  driver.finish_reads(rollout);
  ASSERT_TRUE(is<UpdateOk>(driver.replies(rollout)));
  driver.call_all(trainer, UnpublishRequest{});
  ASSERT_TRUE(is<UnpublishOk>(driver.replies(trainer)));
  const LayoutRef layout0 = layout_for(0);
  PatchInfo info{1, std::vector<std::uint64_t>(layout0->tensors().size(), 0)};
  info.tensor_bytes.back() = 1;
  driver.call(trainer[0], PublishRequest{2, layout0, checksums_for(2, 0), std::make_shared<const PatchInfo>(info)});
  driver.call(trainer[1], PublishRequest{2, layout_for(1), checksums_for(2, 1), nullptr});
  ASSERT_TRUE(is<PublishOk>(driver.replies(trainer)));
  for (std::uint32_t shard = 0; shard < 2; ++shard) driver.call(rollout[shard], UpdateRequest{Selector::latest(), layout_for(shard)});
  for (std::uint32_t shard = 0; shard < 2; ++shard) {
    const auto& reads = driver.inbox(rollout[shard]).reads;
    ASSERT_EQ(reads.size(), 1u);
    const PatchRef& patch = reads.begin()->second.patch;
    ASSERT_NE(patch, nullptr) << "shard " << shard;
    EXPECT_EQ(patch->base, 1u);
    const std::uint64_t patched = std::count_if(patch->tensor_bytes.begin(), patch->tensor_bytes.end(), [](std::uint64_t b) { return b != 0; });
    EXPECT_EQ(patched, shard == 0 ? 1u : 0u) << "shard 1 announced none: every tensor of it whole";
  }
}

// A shard that re-opens on a fresh server (failover) holding `version`, with the patch it keeps.
ClientId resume_holding(Driver& driver, const std::string& name, const std::string& role, Version version, PatchRef patch) {
  ReplicaSpec spec;
  spec.name = name;
  spec.role = role;
  OpenRequest request = driver.open_request(spec, 0);
  Resume resume;
  resume.primary = HeldCopy{version, layout_for(0), checksums_for(version, 0), 0, std::move(patch)};
  request.resume = std::make_shared<const Resume>(std::move(resume));
  const ClientId client = driver.new_client();
  driver.open(client, request, 5);
  EXPECT_TRUE(is<OpenOk>(driver.replies({client})));
  driver.set_next_seq(client, 6);
  return client;
}

// After a failover the new server knows the patches the shards keep: a rollout that holds the base
// reads the patch, as it would have from the old server; a patch that is not against an earlier
// version is not believed (the bytes are read).
TEST(HubPatchesFailover, APatchTheShardsKeepIsServedByTheNewServer) {
  for (const bool sound : {true, false}) {
    SCOPED_TRACE(sound ? "a patch against 1" : "a patch against itself");
    Driver driver;
    resume_holding(driver, "t", "trainer", 2, sound ? patch_against(1) : patch_against(2));
    const ClientId rollout = resume_holding(driver, "r", "rollout", 1, nullptr);
    driver.call(rollout, UpdateRequest{Selector::latest(), layout_for(0)});
    auto& reads = driver.inbox(rollout).reads;
    ASSERT_EQ(reads.size(), 1u);
    const StartRead read = reads.begin()->second;
    EXPECT_EQ(read.source.replica, "t");
    if (sound) {
      ASSERT_NE(read.patch, nullptr) << "the trainer said it keeps the patch of 2 against 1";
      EXPECT_EQ(*read.patch, *patch_against(1));
    } else {
      EXPECT_EQ(read.patch, nullptr);
    }
    driver.report(rollout, TransferDone{read.transfer, read.epoch, nullptr});
    EXPECT_TRUE(is<UpdateOk>(driver.replies({rollout})));
    EXPECT_EQ(driver.hub().stats().patches_kept, sound ? 1u : 0u);
  }
}

TEST_F(HubPatches, APublishRefusesAPatchOverFortyPercentOfItsTensorNamingIt) {
  publish(1, nullptr);
  driver_.call_all(trainer_, UnpublishRequest{});
  ASSERT_TRUE(is<UnpublishOk>(driver_.replies(trainer_)));
  PatchInfo info = *patch_against(1);
  const LayoutRef layout = layout_for(0);
  std::size_t largest = 0;
  for (std::size_t t = 0; t < layout->tensors().size(); ++t) {
    if (layout->tensors()[t].bytes > layout->tensors()[largest].bytes) largest = t;
  }
  info.tensor_bytes[largest] = layout->tensors()[largest].bytes * 2 / 5 + 1;  // past 40 %
  driver_.call(trainer_.at(0), PublishRequest{2, layout, checksums_for(2, 0), std::make_shared<const PatchInfo>(info)});
  const std::optional<Outcome> outcome = driver_.replies(trainer_);
  ASSERT_TRUE(is_error(*outcome, Errc::kInvalidArgument)) << describe(*outcome);
  EXPECT_NE(describe(*outcome).find(layout->tensors()[largest].name), std::string::npos) << describe(*outcome);
  // Sizes for another count of tensors, and a base that is not earlier, are refused too.
  info = *patch_against(1);
  info.tensor_bytes.pop_back();
  driver_.call(trainer_.at(0), PublishRequest{2, layout, checksums_for(2, 0), std::make_shared<const PatchInfo>(info)});
  EXPECT_TRUE(is_error(*driver_.replies(trainer_), Errc::kInvalidArgument));
  driver_.call(trainer_.at(0), PublishRequest{2, layout, checksums_for(2, 0), patch_against(2)});
  EXPECT_TRUE(is_error(*driver_.replies(trainer_), Errc::kInvalidArgument));
}

}  // namespace
}  // namespace th::test
