// Streaming receive (issue 18): replicate_async / update_async hand each tensor out as soon as it
// is complete and verified, before the last byte of the version arrived; cancel ends the call for
// the replica and leaves the handle usable for the next version. In process, against a real
// th-server, with a rate-limited reader so that the transfer takes a while.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <map>
#include <set>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "client/receive.h"
#include "fixture.h"
#include "in_process.h"
#include "tensorhub/client.h"

namespace th::e2e {
namespace {

class Receiving : public ProcessTest {};

// A shard of 6 tensors: 4 of 2 MiB (each its own region) and 2 small ones (packed together); or,
// `small_only`, 16 tensors of 1 MiB, every one packed (a model of small layers).
struct Shard {
  std::map<std::string, std::vector<std::byte>> tensors;
  explicit Shard(bool small_only = false) {
    if (small_only) {
      for (int i = 0; i < 16; ++i) tensors["layer" + std::to_string(10 + i) + ".weight"].resize(1u << 20);
      return;
    }
    for (int i = 0; i < 4; ++i) tensors["layer" + std::to_string(i) + ".weight"].resize(2u << 20);
    tensors["layer0.bias"].resize(4096);
    tensors["norm.scale"].resize(1000);
  }
  std::uint64_t total_bytes() const {
    std::uint64_t total = 0;
    for (const auto& [name, bytes] : tensors) total += bytes.size();
    return total;
  }
  static std::byte content(Version version, const std::string& name, std::size_t offset) {
    return static_cast<std::byte>((version * 131 + name.size() * 17 + name[5] + offset * 7 + offset / 251) & 0xff);
  }
  void write(Version version) {
    for (auto& [name, bytes] : tensors) {
      for (std::size_t i = 0; i < bytes.size(); ++i) bytes[i] = content(version, name, i);
    }
  }
  bool holds(const std::string& name, const void* data, Version version) const {
    const auto& bytes = tensors.at(name);
    std::vector<std::byte> expected(bytes.size());
    for (std::size_t i = 0; i < expected.size(); ++i) expected[i] = content(version, name, i);
    return std::memcmp(data, expected.data(), expected.size()) == 0;
  }
  void register_with(Handle& handle) {
    for (auto& [name, bytes] : tensors) {
      ASSERT_TRUE(handle.register_tensor(name, bytes.data(), bytes.size(), DType::kUInt8).ok()) << name;
    }
  }
};

// A reader at 4 MB/s: the shard's 8.4 MB take about 2 s.
constexpr std::uint64_t kSlowBytesPerSecond = 4'000'000;

// A trainer that published version 1 of a Shard (unless `publish` is false: no trainer), and a
// rollout with the same tensors registered whose reads are capped at `read_rate` bytes/s (0: none).
struct Published {
  Shard trained;
  Shard engine;
  std::unique_ptr<Handle> trainer;
  std::unique_ptr<Handle> rollout;

  Published(const std::string& server, std::uint64_t read_rate, bool publish = true, bool small_only = false)
      : trained(small_only), engine(small_only), published(!publish) {
    if (publish) {
      trained.write(1);
      trainer = open_or_fail(options_for(server, "trainer", "trainer"));
      if (trainer == nullptr) return;
      trained.register_with(*trainer);
      published = trainer->publish(1).ok();
    }
    ClientOptions reader = options_for(server, "rollout", "rollout");
    reader.read_rate_bytes_per_s = read_rate;
    rollout = open_or_fail(reader);
    if (rollout != nullptr) engine.register_with(*rollout);
  }
  bool ready() const { return published && rollout != nullptr; }

 private:
  bool published = false;
};

TEST_F(Receiving, TensorsAreHandedOutVerifiedBeforeTheLastByteArrives) {
  Published job(start_server(), kSlowBytesPerSecond);
  ASSERT_TRUE(job.ready());
  Shard& engine = job.engine;
  Handle* rollout = job.rollout.get();

  auto receive = rollout->replicate_async("latest");
  ASSERT_TRUE(receive.ok()) << receive.error().detail;
  const auto started = std::chrono::steady_clock::now();
  std::vector<std::string> order;
  std::optional<double> first_s;
  std::optional<ReceiveProgress> at_first;
  for (;;) {
    auto tensor = receive.value()->next();
    ASSERT_TRUE(tensor.ok()) << tensor.error().detail;
    if (!tensor.value()) break;
    const ReceivedTensor& got = *tensor.value();
    if (!first_s) {
      first_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
      at_first = receive.value()->progress();
    }
    EXPECT_EQ(got.version, 1U);
    EXPECT_EQ(got.data, engine.tensors.at(got.name).data()) << "handed out in its registered buffer";
    EXPECT_EQ(got.bytes, engine.tensors.at(got.name).size());
    EXPECT_TRUE(engine.holds(got.name, got.data, 1)) << got.name << " is bit-exact when handed out";
    order.push_back(got.name);
  }
  const double last_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  auto answer = receive.value()->wait();
  ASSERT_TRUE(answer.ok()) << answer.error().detail;
  EXPECT_EQ(answer.value().status, UpdateStatus::kUpdated);
  EXPECT_EQ(answer.value().version, std::optional<Version>(1));
  EXPECT_EQ(answer.value().source_replica, "trainer");
  // Every tensor once: the packed small ones first, then the big ones in name order.
  EXPECT_EQ(order, (std::vector<std::string>{"layer0.bias", "norm.scale", "layer0.weight", "layer1.weight",
                                             "layer2.weight", "layer3.weight"}));
  // The first tensor came out while most of the shard was still on its way.
  ASSERT_TRUE(at_first.has_value());
  EXPECT_LT(at_first->bytes_ready, at_first->bytes_total / 2) << "first tensor at " << *first_s << " s";
  EXPECT_FALSE(at_first->done);
  EXPECT_EQ(at_first->bytes_total, engine.total_bytes());
  const ReceiveProgress end = receive.value()->progress();
  EXPECT_TRUE(end.done);
  EXPECT_EQ(end.tensors_handed_out, 6U);
  EXPECT_EQ(end.bytes_ready, end.bytes_total);
  std::printf("streaming: first tensor after %.2f s, last after %.2f s, %llu bytes at 4 MB/s\n", *first_s, last_s,
              static_cast<unsigned long long>(engine.total_bytes()));
  for (const auto& [name, bytes] : engine.tensors) EXPECT_TRUE(engine.holds(name, bytes.data(), 1)) << name;
}

// Issue 33, friction 5: a model whose tensors are all under the packing size streams too. Its
// packed region arrives in units (of 4 MiB here: four), each handed out as soon as it is in.
TEST_F(Receiving, AModelOfSmallTensorsStreamsUnitByUnit) {
  Published job(start_server(), kSlowBytesPerSecond, /*publish=*/true, /*small_only=*/true);
  ASSERT_TRUE(job.ready());
  auto receive = job.rollout->replicate_async("latest");
  ASSERT_TRUE(receive.ok()) << receive.error().detail;
  std::optional<ReceiveProgress> at_first;
  std::size_t handed_out = 0;
  for (;;) {
    auto tensor = receive.value()->next();
    ASSERT_TRUE(tensor.ok()) << tensor.error().detail;
    if (!tensor.value()) break;
    if (!at_first) at_first = receive.value()->progress();
    EXPECT_TRUE(job.engine.holds(tensor.value()->name, tensor.value()->data, 1)) << tensor.value()->name;
    ++handed_out;
  }
  ASSERT_TRUE(receive.value()->wait().ok());
  EXPECT_EQ(handed_out, 16U);
  ASSERT_TRUE(at_first.has_value());
  EXPECT_FALSE(at_first->done);
  EXPECT_LT(at_first->bytes_ready, at_first->bytes_total / 2)
      << "the first small tensor came out only once most of the region was in";
  std::printf("small tensors streaming: first handed out with %llu of %llu bytes in\n",
              static_cast<unsigned long long>(at_first->bytes_ready),
              static_cast<unsigned long long>(at_first->bytes_total));
}

TEST_F(Receiving, ACancelMidwayLeavesTheHandleUsableForTheNextVersion) {
  Published job(start_server(), kSlowBytesPerSecond);
  ASSERT_TRUE(job.ready());
  Shard& trained = job.trained;
  Shard& engine = job.engine;
  Handle* trainer = job.trainer.get();
  Handle* rollout = job.rollout.get();

  auto receive = rollout->replicate_async("latest");
  ASSERT_TRUE(receive.ok()) << receive.error().detail;
  auto first = receive.value()->next();
  ASSERT_TRUE(first.ok() && first.value().has_value());
  // While it runs, the handle takes no other call.
  auto list = rollout->list();
  ASSERT_FALSE(list.ok());
  EXPECT_EQ(list.error().code, Errc::kInvalidArgument);
  receive.value()->cancel();
  auto answer = receive.value()->wait();
  ASSERT_FALSE(answer.ok());
  EXPECT_EQ(answer.error().code, Errc::kCancelled) << answer.error().detail;
  EXPECT_LT(receive.value()->progress().bytes_ready, engine.total_bytes()) << "cancelled midway";
  // next() after the answer: the call's error.
  auto after = receive.value()->next();
  ASSERT_FALSE(after.ok());
  EXPECT_EQ(after.error().code, Errc::kCancelled);

  // The same handle receives the version again, then the next one.
  auto again = rollout->replicate("latest");
  ASSERT_TRUE(again.ok()) << again.error().detail;
  EXPECT_EQ(again.value().version, 1U);
  for (const auto& [name, bytes] : engine.tensors) EXPECT_TRUE(engine.holds(name, bytes.data(), 1)) << name;
  ASSERT_TRUE(trainer->unpublish().ok());
  trained.write(2);
  ASSERT_TRUE(trainer->publish(2).ok());
  auto update = rollout->update_async("latest");
  ASSERT_TRUE(update.ok()) << update.error().detail;
  std::set<std::string> seen;
  for (;;) {
    auto tensor = update.value()->next();
    ASSERT_TRUE(tensor.ok()) << tensor.error().detail;
    if (!tensor.value()) break;
    EXPECT_EQ(tensor.value()->version, 2U);
    EXPECT_TRUE(engine.holds(tensor.value()->name, tensor.value()->data, 2)) << tensor.value()->name;
    EXPECT_TRUE(seen.insert(tensor.value()->name).second) << "handed out once";
  }
  EXPECT_EQ(seen.size(), 6U);
  auto updated = update.value()->wait();
  ASSERT_TRUE(updated.ok()) << updated.error().detail;
  EXPECT_EQ(updated.value().version, std::optional<Version>(2));
  // The trainer's unpublish waits for readers; none is left.
  EXPECT_TRUE(trainer->unpublish().ok());
}

// The per-tensor hook: each tensor reaches it verified, once, in next()'s order (next() hands them
// out as they arrive: the test above); a hook that throws cancels the call and leaves the handle
// usable.
TEST_F(Receiving, AHookGetsEachVerifiedTensorOnceAndAThrowingHookCancelsTheCall) {
  Published job(start_server(), kSlowBytesPerSecond);
  ASSERT_TRUE(job.ready());
  Shard& trained = job.trained;
  Shard& engine = job.engine;
  Handle* rollout = job.rollout.get();

  std::vector<std::string> hooked;
  auto replicated = rollout->replicate("latest", 0, [&](const ReceivedTensor& tensor) {
    EXPECT_EQ(tensor.version, 1U);
    EXPECT_EQ(tensor.data, engine.tensors.at(tensor.name).data());
    EXPECT_TRUE(engine.holds(tensor.name, tensor.data, 1)) << tensor.name << " is bit-exact when hooked";
    hooked.push_back(tensor.name);
  });
  ASSERT_TRUE(replicated.ok()) << replicated.error().detail;
  EXPECT_EQ(replicated.value().version, 1U);
  EXPECT_EQ(replicated.value().source_replica, "trainer");
  EXPECT_EQ(hooked, (std::vector<std::string>{"layer0.bias", "norm.scale", "layer0.weight", "layer1.weight",
                                              "layer2.weight", "layer3.weight"}));

  // Version 2: the hook gives up at the second tensor. The call ends cancelled, the exception
  // reaches the caller, and the handle takes the next call.
  ASSERT_TRUE(job.trainer->unpublish().ok());
  trained.write(2);
  ASSERT_TRUE(job.trainer->publish(2).ok());
  int calls = 0;
  struct EngineFull : std::runtime_error {
    EngineFull() : std::runtime_error("engine full") {}
  };
  EXPECT_THROW((void)rollout->update("latest", [&](const ReceivedTensor&) {
    if (++calls == 2) throw EngineFull();
  }),
               EngineFull);
  EXPECT_EQ(calls, 2);
  auto again = rollout->update("latest", [&](const ReceivedTensor& tensor) {
    EXPECT_TRUE(engine.holds(tensor.name, tensor.data, 2)) << tensor.name;
  });
  ASSERT_TRUE(again.ok()) << again.error().detail;
  EXPECT_EQ(again.value().version, std::optional<Version>(2));
  auto empty = rollout->update("latest", TensorHook{});
  ASSERT_FALSE(empty.ok());
  EXPECT_EQ(empty.error().code, Errc::kInvalidArgument);
}

// Once wait() answered kCancelled the buffers are the application's: nothing writes them any more
// (a read told to stop, or its scatter of packed tensors, could still be at work), the shard holds
// no version, and publishing or changing tensors is allowed again. (helper-21 found all three.)
TEST_F(Receiving, AfterACancelNothingWritesTheBuffersAndTheShardHoldsNothing) {
  const std::string server = start_server();
  // 40 packed tensors (80 MB): their scatter and checks run after the pull, on the reader thread.
  std::map<std::string, std::vector<std::byte>> trained;
  std::map<std::string, std::vector<std::byte>> engine;
  for (int i = 0; i < 40; ++i) {
    const std::string name = "small" + std::to_string(100 + i);
    trained[name].assign((2u << 20) - 64, static_cast<std::byte>(i + 1));
    engine[name].resize((2u << 20) - 64);
  }
  auto trainer = open_or_fail(options_for(server, "trainer", "trainer"));
  ASSERT_NE(trainer, nullptr);
  for (auto& [name, bytes] : trained) ASSERT_TRUE(trainer->register_tensor(name, bytes.data(), bytes.size(), DType::kUInt8).ok());
  ASSERT_TRUE(trainer->publish(1).ok());
  auto rollout = open_or_fail(options_for(server, "rollout", "rollout"));
  ASSERT_NE(rollout, nullptr);
  for (auto& [name, bytes] : engine) ASSERT_TRUE(rollout->register_tensor(name, bytes.data(), bytes.size(), DType::kUInt8).ok());
  auto receive = rollout->replicate_async("latest");
  ASSERT_TRUE(receive.ok());
  // Cancel as the last byte arrives: the reader is scattering and checking then.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(kStepMs);
  while (receive.value()->progress().bytes_ready < receive.value()->progress().bytes_total &&
         std::chrono::steady_clock::now() < deadline) {
    std::this_thread::yield();
  }
  receive.value()->cancel();
  auto answer = receive.value()->wait();
  if (!answer.ok()) {
    EXPECT_EQ(answer.error().code, Errc::kCancelled);
    for (auto& [name, bytes] : engine) std::fill(bytes.begin(), bytes.end(), std::byte{0x55});
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    for (const auto& [name, bytes] : engine) {
      EXPECT_EQ(std::count(bytes.begin(), bytes.end(), std::byte{0x55}), static_cast<std::ptrdiff_t>(bytes.size()))
          << name << " was written after the call's answer";
    }
    EXPECT_EQ(rollout->stats().checksum_failures, 0U);
    EXPECT_EQ(rollout->stats().reading_from, "");
    // The shard holds nothing: its tensors may change, and it may publish what it has.
    auto& first = engine.begin()->second;
    EXPECT_TRUE(rollout->unregister_tensor(engine.begin()->first).ok());
    EXPECT_TRUE(rollout->register_tensor(engine.begin()->first, first.data(), first.size(), DType::kUInt8).ok());
  } else {
    std::printf("the replicate completed before the cancel: nothing to check\n");
  }
  EXPECT_TRUE(trainer->unpublish().ok());
}

// A shard of tensors of 0 bytes streams too (they are "packed", in a region of 0 bytes).
TEST_F(Receiving, TensorsOfZeroBytesAreHandedOut) {
  const std::string server = start_server();
  std::byte nothing[1];
  auto trainer = open_or_fail(options_for(server, "trainer", "trainer"));
  ASSERT_NE(trainer, nullptr);
  ASSERT_TRUE(trainer->register_tensor("a", nothing, 0, DType::kUInt8).ok());
  ASSERT_TRUE(trainer->register_tensor("b", nothing, 0, DType::kUInt8).ok());
  ASSERT_TRUE(trainer->publish(1).ok());
  auto rollout = open_or_fail(options_for(server, "rollout", "rollout"));
  ASSERT_NE(rollout, nullptr);
  ASSERT_TRUE(rollout->register_tensor("a", nothing, 0, DType::kUInt8).ok());
  ASSERT_TRUE(rollout->register_tensor("b", nothing, 0, DType::kUInt8).ok());
  auto receive = rollout->replicate_async("latest");
  ASSERT_TRUE(receive.ok());
  std::vector<std::string> names;
  for (;;) {
    auto tensor = receive.value()->next(kStepMs);
    ASSERT_TRUE(tensor.ok()) << tensor.error().detail;
    if (!tensor.value()) break;
    EXPECT_EQ(tensor.value()->bytes, 0U);
    names.push_back(tensor.value()->name);
  }
  EXPECT_EQ(names, (std::vector<std::string>{"a", "b"}));
  EXPECT_TRUE(receive.value()->wait().ok());
}

TEST_F(Receiving, AWaitingCallCanBeCancelledAndNextTimesOutWhileItWaits) {
  Published nothing_published(start_server(), 0, /*publish=*/false);
  ASSERT_TRUE(nothing_published.ready());
  std::unique_ptr<Handle>& rollout = nothing_published.rollout;
  // Nothing is published: the replicate waits for a version.
  auto receive = rollout->replicate_async("latest");
  ASSERT_TRUE(receive.ok()) << receive.error().detail;
  auto none_yet = receive.value()->next(200);
  ASSERT_FALSE(none_yet.ok());
  EXPECT_EQ(none_yet.error().code, Errc::kTimeout);
  EXPECT_FALSE(receive.value()->wait_for(100));
  EXPECT_FALSE(receive.value()->progress().version.has_value());
  // A second call while it runs is refused; so is changing the tensors.
  auto second = rollout->update_async("latest");
  ASSERT_FALSE(second.ok());
  EXPECT_EQ(second.error().code, Errc::kInvalidArgument);
  std::vector<std::byte> extra(16);
  EXPECT_FALSE(rollout->register_tensor("extra", extra.data(), extra.size(), DType::kUInt8).ok());
  receive.value()->cancel();
  receive.value()->cancel();  // twice: the same
  ASSERT_TRUE(receive.value()->wait_for(kStepMs));
  auto answer = receive.value()->wait();
  ASSERT_FALSE(answer.ok());
  EXPECT_EQ(answer.error().code, Errc::kCancelled);
  // Dropping an unfinished receive cancels it; the next call waits for that answer and runs.
  {
    auto dropped = rollout->replicate_async("latest");
    ASSERT_TRUE(dropped.ok());
  }
  auto update = rollout->update("latest");
  ASSERT_TRUE(update.ok()) << update.error().detail;
  EXPECT_NE(update.value().status, UpdateStatus::kUpdated);
}

TEST_F(Receiving, AnUpdateWithNothingNewerHandsOutNothing) {
  Published job(start_server(), 0);
  ASSERT_TRUE(job.ready());
  Handle* rollout = job.rollout.get();
  ASSERT_TRUE(rollout->replicate("latest").ok());
  auto update = rollout->update_async("latest");
  ASSERT_TRUE(update.ok());
  auto tensor = update.value()->next();
  ASSERT_TRUE(tensor.ok()) << tensor.error().detail;
  EXPECT_FALSE(tensor.value().has_value());
  auto answer = update.value()->wait();
  ASSERT_TRUE(answer.ok());
  EXPECT_EQ(answer.value().status, UpdateStatus::kNoNewerVersion);
  EXPECT_EQ(update.value()->progress().tensors_handed_out, 0U);
  // Argument errors come back at once.
  auto bad = rollout->update_async("newest");
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.error().code, Errc::kBadSelector);
  auto negative = rollout->replicate_async("latest", -5);
  ASSERT_FALSE(negative.ok());
  EXPECT_EQ(negative.error().code, Errc::kInvalidArgument);
}

TEST_F(Receiving, InterruptEndsAStreamAndAReceiveOutlivingItsHandleIsSafe) {
  Published nothing_published(start_server(), 0, /*publish=*/false);
  ASSERT_TRUE(nothing_published.ready());
  std::unique_ptr<Handle>& rollout = nothing_published.rollout;
  auto receive = rollout->replicate_async("latest");
  ASSERT_TRUE(receive.ok());
  std::thread stopper([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    rollout->interrupt("test over");
  });
  auto tensor = receive.value()->next();  // blocks until the interrupt
  stopper.join();
  ASSERT_FALSE(tensor.ok());
  EXPECT_EQ(tensor.error().code, Errc::kUnavailable);
  EXPECT_NE(tensor.error().detail.find("test over"), std::string::npos);
  rollout.reset();  // the handle goes first
  auto answer = receive.value()->wait();
  ASSERT_FALSE(answer.ok());
  EXPECT_EQ(answer.error().code, Errc::kUnavailable);
  receive.value()->cancel();  // no handle to reach: nothing happens
}

// ---- The checks per unit, without a network ------------------------------------------------------

struct Units {
  std::map<std::string, client_impl::Registered, std::less<>> registry;
  std::vector<std::vector<std::byte>> memory;
  client_impl::Plan plan;
  std::vector<std::byte> packed;
  std::shared_ptr<Checksums> checksums = std::make_shared<Checksums>();

  // Two packed tensors and two big ones, the packed region filled as a read would fill it.
  Units() {
    const std::vector<std::pair<std::string, std::uint64_t>> sizes = {
        {"a.small", 100}, {"b.big", 3u << 20}, {"c.small", 300}, {"d.big", 2u << 20}};
    for (const auto& [name, bytes] : sizes) {
      auto& buffer = memory.emplace_back(bytes);
      for (std::size_t i = 0; i < bytes; ++i) buffer[i] = static_cast<std::byte>(i * 13 + name[0]);
      registry.emplace(name, client_impl::Registered{buffer.data(), TensorSpec{name, DType::kUInt8, bytes}, nullptr});
    }
    plan = client_impl::make_plan(registry);
    packed.resize(plan.packed_bytes);
    for (std::size_t i = 0; i < plan.tensor_data.size(); ++i) {
      checksums->push_back(client_impl::checksum(plan.tensor_data[i], plan.layout->tensors()[i].bytes));
      if (plan.packed_offset[i] != client_impl::Plan::kNotPacked) {
        std::memcpy(packed.data() + plan.packed_offset[i], plan.tensor_data[i], plan.layout->tensors()[i].bytes);
        std::memset(plan.tensor_data[i], 0, plan.layout->tensors()[i].bytes);  // not scattered yet
      }
    }
  }
};

TEST(ReadAttempt, UnitsArePackedFirstThenEachBigTensorWhereItsBytesEnd) {
  Units shard;
  client_impl::ReadAttempt read(shard.plan, shard.packed.data(), shard.checksums, 3, /*scatter=*/true);
  ASSERT_EQ(read.unit_end.size(), 3U);
  EXPECT_EQ(read.unit_end[0], 400U);
  EXPECT_EQ(read.unit_end[1], 400U + (3u << 20));
  EXPECT_EQ(read.unit_end[2], 400U + (5u << 20));
  EXPECT_EQ(read.unit_of(0), 0U);  // a.small
  EXPECT_EQ(read.unit_of(1), 1U);  // b.big
  EXPECT_EQ(read.unit_of(2), 0U);  // c.small
  EXPECT_EQ(read.unit_of(3), 2U);  // d.big
  // The packed unit scatters its tensors into their buffers and checks them there.
  EXPECT_EQ(read.check(0), std::nullopt);
  EXPECT_EQ(std::memcmp(shard.plan.tensor_data[2], shard.packed.data() + 100, 300), 0);
  EXPECT_EQ(read.check(1), std::nullopt);
  EXPECT_EQ(read.check(2), std::nullopt);
}

TEST(ReadAttempt, AFlippedByteFailsItsUnitAndNamesTheTensor) {
  Units shard;
  shard.packed[150] ^= std::byte{1};         // in c.small
  shard.plan.tensor_data[3][12345] ^= std::byte{0x80};  // in d.big
  client_impl::ReadAttempt read(shard.plan, shard.packed.data(), shard.checksums, 3, /*scatter=*/true);
  EXPECT_EQ(read.check(0), std::optional<std::size_t>(2));
  EXPECT_EQ(read.check(1), std::nullopt);
  EXPECT_EQ(read.check(2), std::optional<std::size_t>(3));
  // Checksums missing or of another layout: nothing matches.
  client_impl::ReadAttempt unverifiable(shard.plan, shard.packed.data(), nullptr, 3, /*scatter=*/true);
  EXPECT_EQ(unverifiable.check(1), std::optional<std::size_t>(1));
}

TEST(ReadAttempt, TheReaderChecksOnlyWhatTheApplicationDidNotAndStopsAtABadUnit) {
  Units shard;
  auto state = std::make_shared<Receive::State>(shard.plan, 1, nullptr);
  EXPECT_EQ(state->order, (std::vector<std::size_t>{0, 2, 1, 3}));  // packed first, then big, by name
  auto read = std::make_shared<client_impl::ReadAttempt>(shard.plan, shard.packed.data(), shard.checksums, 3, true);
  state->begin(read);
  state->advance(*read, read->unit_end.back());
  // The application checked unit 1 already (and found it good); the reader does the others.
  read->units[1] = client_impl::ReadAttempt::Unit::kGood;
  shard.plan.tensor_data[1][0] ^= std::byte{1};  // would fail if checked again
  const std::atomic<bool> going{false};
  EXPECT_EQ(state->check_rest(*read, going), std::nullopt);
  EXPECT_EQ(read->units, (std::vector<client_impl::ReadAttempt::Unit>(3, client_impl::ReadAttempt::Unit::kGood)));
  // A new read of the same version checks everything again, and stops at the first bad unit.
  auto again = std::make_shared<client_impl::ReadAttempt>(shard.plan, shard.packed.data(), shard.checksums, 3, true);
  state->begin(again);
  EXPECT_EQ(state->check_rest(*again, going), std::optional<std::size_t>(1));
  EXPECT_EQ(again->units[2], client_impl::ReadAttempt::Unit::kPending) << "nothing checked past the bad unit";
  EXPECT_EQ(again->bad_tensor, std::optional<std::size_t>(1));
  // A cancelled read checks (and scatters) nothing more: the buffers are the application's again.
  auto cancelled_read = std::make_shared<client_impl::ReadAttempt>(shard.plan, shard.packed.data(), shard.checksums, 3, true);
  state->begin(cancelled_read);
  std::memset(shard.plan.tensor_data[0], 0x77, 100);
  const std::atomic<bool> cancelled{true};
  EXPECT_EQ(state->check_rest(*cancelled_read, cancelled), std::nullopt);
  EXPECT_EQ(cancelled_read->units[0], client_impl::ReadAttempt::Unit::kPending);
  EXPECT_EQ(shard.plan.tensor_data[0][0], std::byte{0x77}) << "not scattered";
}

// Resume (issue 34): a read after its source failed keeps the units the last one verified and
// those that arrived whole and verify now, up to the first that is not; it goes on from there.
TEST(ReadAttempt, AResumedReadKeepsTheVerifiedPrefixUpToTheFirstUnitThatIsNot) {
  using Unit = client_impl::ReadAttempt::Unit;
  Units shard;
  auto state = std::make_shared<Receive::State>(shard.plan, 1, nullptr);
  const std::atomic<bool> going{false};
  auto attempt = [&] {
    return std::make_shared<client_impl::ReadAttempt>(shard.plan, shard.packed.data(), shard.checksums, 3, true);
  };
  // Unit 0 checked (by the application), unit 1 whole but not checked, unit 2 half there.
  auto earlier = attempt();
  state->begin(earlier);
  state->advance(*earlier, earlier->unit_end[1] + 1000);
  earlier->units[0] = Unit::kGood;
  auto next = attempt();
  EXPECT_EQ(state->resume(*earlier, *next, going), earlier->unit_end[1]);
  EXPECT_EQ(next->units, (std::vector<Unit>{Unit::kGood, Unit::kGood, Unit::kPending}));
  EXPECT_EQ(next->ready_bytes, earlier->unit_end[1]);
  EXPECT_EQ(earlier->units[1], Unit::kGood) << "its verdict is kept";
  // Resumed again after that one failed too: nothing is checked twice, and a unit that arrived
  // with a flipped byte stops it (the next source reads it again).
  state->begin(next);
  state->advance(*next, next->unit_end[2]);
  shard.plan.tensor_data[3][77] ^= std::byte{4};
  auto third = attempt();
  EXPECT_EQ(state->resume(*next, *third, going), next->unit_end[1]);
  EXPECT_EQ(next->units[2], Unit::kBad);
  EXPECT_EQ(next->bad_tensor, std::optional<std::size_t>(3));
  EXPECT_EQ(third->units, (std::vector<Unit>{Unit::kGood, Unit::kGood, Unit::kPending}));
  // A unit the earlier read found bad, or nothing whole: from byte 0.
  auto bad_first = attempt();
  bad_first->units[0] = Unit::kBad;
  state->advance(*bad_first, bad_first->unit_end.back());
  auto fourth = attempt();
  EXPECT_EQ(state->resume(*bad_first, *fourth, going), 0u);
  EXPECT_EQ(fourth->units, std::vector<Unit>(3, Unit::kPending));
  auto barely = attempt();
  state->advance(*barely, barely->unit_end[0] - 1);
  EXPECT_EQ(state->resume(*barely, *attempt(), going), 0u);
  // Cancelled (the server moved the read on again): nothing more is checked, but what is known
  // good is carried, so that the read after it still goes on from there.
  auto whole = attempt();
  state->advance(*whole, whole->unit_end.back());
  whole->units[0] = Unit::kGood;
  const std::atomic<bool> cancelled{true};
  auto fifth = attempt();
  EXPECT_EQ(state->resume(*whole, *fifth, cancelled), whole->unit_end[0]);
  EXPECT_EQ(whole->units, (std::vector<Unit>{Unit::kGood, Unit::kPending, Unit::kPending})) << "nothing checked";
  EXPECT_EQ(fifth->units, (std::vector<Unit>{Unit::kGood, Unit::kPending, Unit::kPending}));
}

// A model of small tensors only (issue 33, friction 5: 243 tensors under the packing size, the
// first handed out with the last): its packed region is cut into units of about kPackedUnitBytes,
// each checked, and its tensors handed out, as soon as that part of the region is in.
TEST(ReadAttempt, PackedTensorsStreamInUnitsOfTheirRegion) {
  std::map<std::string, client_impl::Registered, std::less<>> registry;
  std::vector<std::vector<std::byte>> memory;
  constexpr std::uint64_t kTensorBytes = 1536u << 10;  // 1.5 MiB: packed
  constexpr int kTensors = 12;                          // 18 MiB of them
  for (int i = 0; i < kTensors; ++i) {
    const std::string name = "layer" + std::to_string(10 + i) + ".weight";
    auto& buffer = memory.emplace_back(kTensorBytes);
    for (std::size_t b = 0; b < kTensorBytes; ++b) buffer[b] = static_cast<std::byte>(b * 7 + i);
    registry.emplace(name, client_impl::Registered{buffer.data(), TensorSpec{name, DType::kUInt8, kTensorBytes}, nullptr});
  }
  client_impl::Plan plan = client_impl::make_plan(registry);
  ASSERT_TRUE(plan.big.empty()) << "every tensor is packed";
  auto checksums = std::make_shared<Checksums>();
  std::vector<std::byte> packed(plan.packed_bytes);
  for (std::size_t i = 0; i < plan.tensor_data.size(); ++i) {
    checksums->push_back(client_impl::checksum(plan.tensor_data[i], kTensorBytes));
    std::memcpy(packed.data() + plan.packed_offset[i], plan.tensor_data[i], kTensorBytes);
    std::memset(plan.tensor_data[i], 0, kTensorBytes);
  }
  auto read = std::make_shared<client_impl::ReadAttempt>(plan, packed.data(), checksums, 1, /*scatter=*/true);
  // Three tensors (4.5 MiB) close a unit of at least 4 MiB: four units.
  ASSERT_EQ(read->packed_units, 4U);
  ASSERT_EQ(read->unit_end, (std::vector<std::uint64_t>{3 * kTensorBytes, 6 * kTensorBytes, 9 * kTensorBytes,
                                                        12 * kTensorBytes}));
  for (std::size_t i = 0; i < plan.tensor_data.size(); ++i) EXPECT_EQ(read->unit_of(i), i / 3) << i;
  // A flipped byte in the third unit fails that unit alone, naming its tensor.
  packed[7 * kTensorBytes + 5] ^= std::byte{1};
  EXPECT_EQ(read->check(0), std::nullopt);
  EXPECT_EQ(std::memcmp(plan.tensor_data[2], packed.data() + 2 * kTensorBytes, kTensorBytes), 0) << "scattered";
  EXPECT_EQ(plan.tensor_data[3][0], std::byte{0}) << "the next unit is not scattered yet";
  EXPECT_EQ(read->check(2), std::optional<std::size_t>(7));
}

TEST(ReadAttempt, TensorsOfZeroBytesMakeAPackedUnitOfZeroBytes) {
  std::map<std::string, client_impl::Registered, std::less<>> registry;
  std::byte nothing[1];
  registry.emplace("a", client_impl::Registered{nothing, TensorSpec{"a", DType::kUInt8, 0}, nullptr});
  registry.emplace("b", client_impl::Registered{nothing, TensorSpec{"b", DType::kUInt8, 0}, nullptr});
  const client_impl::Plan plan = client_impl::make_plan(registry);
  auto checksums = std::make_shared<Checksums>(2, client_impl::checksum(nothing, 0));
  client_impl::ReadAttempt read(plan, nullptr, checksums, 1, true);
  ASSERT_EQ(read.unit_end, (std::vector<std::uint64_t>{0}));
  EXPECT_EQ(read.unit_of(0), 0U);
  EXPECT_EQ(read.unit_of(1), 0U);
  EXPECT_EQ(read.check(0), std::nullopt);
}

}  // namespace
}  // namespace th::e2e
