// The staging ring's logic (net/staging.h), on a fake copy lane whose "device" is host memory.
// The fake performs a copy only when it is waited for (or a later one is): a ring that wrote a slot
// before the copy out of it ran, or read a slot before the copy into it ran, delivers wrong bytes,
// and the fake also checks each slot still holds, when its copy runs, what it held when the copy
// was started.
#include <gtest/gtest.h>

#include <atomic>
#include <cstring>
#include <deque>
#include <numeric>
#include <thread>

#include "net/data_plane.h"
#include "net/staging.h"

namespace th::net {
namespace {

struct FakeDevice {
  struct Copy {
    std::byte* to;
    const std::byte* from;
    std::uint64_t bytes;
    bool from_slot;                   // to_device: the slot must not change until the copy ran
    std::vector<std::byte> snapshot;  // what the slot held when the copy was started
  };
  std::deque<Copy> pending;
  CopyLane::Ticket next_ticket = 0;  // tickets below `done` have run
  CopyLane::Ticket done = 0;
  std::uint64_t started = 0;
  std::uint64_t slot_changed_before_copy = 0;
  std::uint64_t most_in_flight = 0;
  std::optional<CopyLane::Ticket> fail_at;  // wait() on or after this ticket throws

  void run_until(CopyLane::Ticket ticket) {
    while (done <= ticket) {
      if (fail_at && done >= *fail_at) {
        pending.clear();  // a failed stream: its later copies never run
        done = next_ticket;
        throw DeviceCopyError("fake device: copy failed");
      }
      Copy copy = std::move(pending.front());
      pending.pop_front();
      if (copy.from_slot && std::memcmp(copy.from, copy.snapshot.data(), copy.bytes) != 0) ++slot_changed_before_copy;
      std::memcpy(copy.to, copy.from, copy.bytes);
      ++done;
    }
  }
};

class FakeLane final : public CopyLane {
 public:
  explicit FakeLane(FakeDevice& device) : device_(device) {}
  // A lane of its own device (lanes are used from several threads at once).
  FakeLane() : owned_(std::make_unique<FakeDevice>()), device_(*owned_) {}
  Ticket to_host(std::byte* host, const std::byte* device, std::uint64_t bytes) override {
    return start({host, device, bytes, false, {}});
  }
  Ticket to_device(std::byte* device, const std::byte* host, std::uint64_t bytes) override {
    return start({device, host, bytes, true, std::vector<std::byte>(host, host + bytes)});
  }
  void wait(Ticket ticket) override {
    EXPECT_LT(ticket, device_.next_ticket) << "waits only for copies it started";
    device_.run_until(ticket);
  }

 private:
  Ticket start(FakeDevice::Copy copy) {
    device_.pending.push_back(std::move(copy));
    ++device_.started;
    device_.most_in_flight = std::max<std::uint64_t>(device_.most_in_flight, device_.pending.size());
    return device_.next_ticket++;
  }
  std::unique_ptr<FakeDevice> owned_;
  FakeDevice& device_;
};

std::vector<std::byte> pattern(std::uint64_t bytes, std::uint8_t seed) {
  std::vector<std::byte> out(bytes);
  for (std::uint64_t i = 0; i < bytes; ++i) out[i] = static_cast<std::byte>((i * 131 + seed + (i >> 9)) & 0xff);
  return out;
}

StagingRing make_ring(FakeDevice& device, std::uint32_t slots, std::uint64_t slot_bytes) {
  return StagingRing(std::make_unique<FakeLane>(device), std::make_shared<std::byte[]>(slots * slot_bytes), slots,
                     slot_bytes);
}

constexpr std::uint64_t kSlot = 1000;  // not a power of two: pieces end mid-word

TEST(StagingRing, DrainHandsOverEveryByteInOrderWithTheCopiesAhead) {
  for (std::uint32_t slots : {2u, 3u, 4u}) {
    for (std::uint64_t bytes : std::initializer_list<std::uint64_t>{0, 1, kSlot - 1, kSlot, kSlot + 1, 5 * kSlot + 500, 12 * kSlot}) {
      FakeDevice fake;
      StagingRing ring = make_ring(fake, slots, kSlot);
      const std::vector<std::byte> source = pattern(bytes, 7);
      const std::uint64_t pieces = (bytes + kSlot - 1) / kSlot;
      std::vector<std::byte> received;
      std::uint64_t piece = 0;
      ring.drain(source.data(), bytes, [&](std::span<const std::byte> part) {
        // The copies of the next pieces are already running while this one is consumed.
        EXPECT_EQ(fake.started, std::min(pieces, piece + slots)) << "slots " << slots << " bytes " << bytes;
        EXPECT_EQ(part.size(), std::min(kSlot, bytes - piece * kSlot));
        received.insert(received.end(), part.begin(), part.end());
        ++piece;
      });
      EXPECT_EQ(received, source) << "slots " << slots << " bytes " << bytes;
      EXPECT_EQ(piece, pieces);
      EXPECT_EQ(fake.started, pieces);
      EXPECT_LE(fake.most_in_flight, slots);
    }
  }
}

TEST(StagingRing, FillPutsEveryByteOnTheDeviceOverlappingTheProducer) {
  for (std::uint32_t slots : {2u, 3u, 4u}) {
    for (std::uint64_t bytes : std::initializer_list<std::uint64_t>{0, 1, kSlot - 1, kSlot, kSlot + 1, 5 * kSlot + 500, 12 * kSlot}) {
      FakeDevice fake;
      StagingRing ring = make_ring(fake, slots, kSlot);
      const std::vector<std::byte> source = pattern(bytes, 3);
      std::vector<std::byte> device(bytes, std::byte{0xee});
      std::uint64_t produced = 0;
      std::uint64_t overlapped = 0;
      ring.fill(device.data(), bytes, [&](std::span<std::byte> part) {
        // The copy of the previous piece has not been waited for: it runs while this one arrives.
        if (produced > 0 && fake.done < fake.next_ticket) ++overlapped;
        std::memcpy(part.data(), source.data() + produced, part.size());
        produced += part.size();
      });
      // Every byte is on the device when fill returns, and no slot was written under a copy.
      EXPECT_EQ(device, source) << "slots " << slots << " bytes " << bytes;
      EXPECT_TRUE(fake.pending.empty());
      EXPECT_EQ(fake.slot_changed_before_copy, 0u);
      const std::uint64_t pieces = (bytes + kSlot - 1) / kSlot;
      EXPECT_EQ(overlapped, pieces > 0 ? pieces - 1 : 0);
      EXPECT_LE(fake.most_in_flight, slots);
    }
  }
}

TEST(StagingRing, AConsumerThatThrowsLeavesNoCopyRunning) {
  FakeDevice fake;
  StagingRing ring = make_ring(fake, 4, kSlot);
  const std::vector<std::byte> source = pattern(10 * kSlot, 1);
  int consumed = 0;
  EXPECT_THROW(ring.drain(source.data(), source.size(),
                          [&](std::span<const std::byte>) {
                            if (++consumed == 3) throw std::runtime_error("socket cut off");
                          }),
               std::runtime_error);
  EXPECT_EQ(consumed, 3);
  EXPECT_TRUE(fake.pending.empty()) << "a copy still reads the device after drain() returned";
  EXPECT_EQ(fake.started, 6u);  // the three consumed and the three that ran ahead, no more
}

TEST(StagingRing, AProducerThatThrowsLeavesNoCopyRunningAndWritesNothingAfter) {
  FakeDevice fake;
  StagingRing ring = make_ring(fake, 3, kSlot);
  const std::vector<std::byte> source = pattern(10 * kSlot, 2);
  std::vector<std::byte> device(source.size(), std::byte{0});
  std::uint64_t produced = 0;
  EXPECT_THROW(ring.fill(device.data(), device.size(),
                         [&](std::span<std::byte> part) {
                           if (produced == 5 * kSlot) throw std::runtime_error("peer closed the connection");
                           std::memcpy(part.data(), source.data() + produced, part.size());
                           produced += part.size();
                         }),
               std::runtime_error);
  EXPECT_TRUE(fake.pending.empty()) << "a copy still writes the device after fill() returned";
  EXPECT_TRUE(std::equal(device.begin(), device.begin() + 5 * kSlot, source.begin()));
  EXPECT_TRUE(std::all_of(device.begin() + 5 * kSlot, device.end(), [](std::byte b) { return b == std::byte{0}; }));
  EXPECT_EQ(fake.slot_changed_before_copy, 0u);
}

TEST(StagingRing, ADeviceErrorIsReportedAndNoCopyIsLeftRunning) {
  for (bool draining : {true, false}) {
    FakeDevice fake;
    fake.fail_at = 4;
    StagingRing ring = make_ring(fake, 4, kSlot);
    std::vector<std::byte> memory = pattern(10 * kSlot, 5);
    if (draining) {
      EXPECT_THROW(ring.drain(memory.data(), memory.size(), [](std::span<const std::byte>) {}), DeviceCopyError);
    } else {
      EXPECT_THROW(ring.fill(memory.data(), memory.size(), [](std::span<std::byte>) {}), DeviceCopyError);
    }
    EXPECT_TRUE(fake.pending.empty());
  }
}

// ---- StagingPool -----------------------------------------------------------------------------------

class FakeProvider final : public StagingProvider {
 public:
  std::unique_ptr<CopyLane> make_lane() override {
    if (fail_next.exchange(false)) throw DeviceCopyError("fake: no stream");
    return std::make_unique<FakeLane>();
  }
  std::shared_ptr<std::byte[]> allocate_pinned(std::uint64_t bytes) override {
    ++allocations;
    return std::make_shared<std::byte[]>(bytes);
  }
  std::atomic<bool> fail_next{false};
  std::atomic<int> allocations{0};
};

TEST(StagingPool, LendsAtMostRingsMaxAndReusesThem) {
  auto provider = std::make_shared<FakeProvider>();
  StagingPool pool(provider, StagingConfig{2, 64, 2, 50});
  {
    StagingPool::Loan first = pool.borrow();
    StagingPool::Loan second = pool.borrow();
    EXPECT_TRUE(first && second);
    EXPECT_EQ(pool.rings_made(), 2u);
    // Both lent: a third borrower waits ring_wait_ms_max, then fails with a reason.
    try {
      pool.borrow();
      ADD_FAILURE() << "a third ring was lent";
    } catch (const DeviceCopyError& error) {
      EXPECT_NE(std::string(error.what()).find("no staging ring came free"), std::string::npos) << error.what();
    }
  }
  StagingPool::Loan again = pool.borrow();  // an idle one, not a new one
  EXPECT_EQ(pool.rings_made(), 2u);
  EXPECT_EQ(provider->allocations.load(), 2);
}

TEST(StagingPool, AWaitingBorrowerGetsTheRingGivenBack) {
  auto provider = std::make_shared<FakeProvider>();
  StagingPool pool(provider, StagingConfig{2, 64, 1, 60'000});
  auto held = std::make_unique<StagingPool::Loan>(pool.borrow());
  std::atomic<bool> got{false};
  std::thread waiter([&] {
    StagingPool::Loan loan = pool.borrow();
    got = static_cast<bool>(loan);
  });
  held.reset();
  waiter.join();
  EXPECT_TRUE(got.load());
  EXPECT_EQ(pool.rings_made(), 1u);
}

TEST(StagingPool, AFailedRingDoesNotCountAgainstTheLimit) {
  auto provider = std::make_shared<FakeProvider>();
  StagingPool pool(provider, StagingConfig{2, 64, 1, 50});
  provider->fail_next = true;
  EXPECT_THROW(pool.borrow(), DeviceCopyError);
  EXPECT_EQ(pool.rings_made(), 0u);
  StagingPool::Loan loan = pool.borrow();
  EXPECT_TRUE(loan);
}

// ---- The TCP data plane with regions "on a device" -------------------------------------------------
// The fake's device memory is host memory, so the whole path runs here: a source serves regions
// marked on_device through its rings, a reader pulls into targets marked on_device through its
// own, and the bytes must arrive whole, whatever the pieces, chunks and streams.

TEST(StagedDataPlane, GpuRegionsTravelWholeThroughBothEndsRings) {
  auto provider = std::make_shared<FakeProvider>();
  // Small slots and chunks, so that responses span several pieces and pieces end mid-chunk.
  auto staging = std::make_shared<StagingPool>(provider, StagingConfig{3, 4096 + 8, 4, 10'000});
  DataServerConfig config;
  config.staging = staging;
  DataServer server(config);
  const std::vector<std::byte> packed = pattern(3000, 11);   // host memory: the packed region
  const std::vector<std::byte> big = pattern(100'003, 12);   // "GPU"
  const std::vector<std::byte> empty;                        // a zero-byte GPU region
  const std::vector<std::byte> bigger = pattern(250'000, 13);  // "GPU"
  const GrantSecret secret{0x1234, 0x5678};
  server.grant({7, 1}, secret,
               {{packed.data(), packed.size(), false}, {big.data(), big.size(), true}, {empty.data(), 0, true},
                {bigger.data(), bigger.size(), true}},
               std::make_shared<Progress>(packed.size() + big.size() + bigger.size()));
  for (std::uint32_t streams : {1u, 3u}) {
    std::vector<std::byte> packed_in(packed.size()), big_in(big.size()), bigger_in(bigger.size());
    std::vector<LocalRegion> targets{{packed_in.data(), packed_in.size(), false},
                                     {big_in.data(), big_in.size(), true},
                                     {nullptr, 0, true},
                                     {bigger_in.data(), bigger_in.size(), true}};
    PullOptions options;
    options.chunk_bytes = 30'000;
    options.streams = streams;
    options.staging = staging;
    std::uint64_t reported = 0;
    options.on_progress = [&](std::uint64_t ready) {
      EXPECT_GE(ready, reported) << "progress never moves back";
      reported = ready;
    };
    const PullOutcome outcome = pull(server.endpoint(), {7, 1}, secret, targets, options);
    ASSERT_TRUE(outcome.ok()) << outcome.detail;
    EXPECT_EQ(outcome.bytes, packed.size() + big.size() + bigger.size());
    EXPECT_EQ(packed_in, packed);
    EXPECT_EQ(big_in, big) << "streams " << streams;
    EXPECT_EQ(bigger_in, bigger) << "streams " << streams;
    EXPECT_EQ(reported, outcome.bytes);
  }
  EXPECT_LE(staging->rings_made(), 4u);
  EXPECT_GE(staging->rings_made(), 2u) << "the source and the reader each staged";
  server.revoke({7, 1});
}

TEST(StagedDataPlane, AReaderWhoseRingsAreAllLentFailsTheReadInsteadOfHanging) {
  auto provider = std::make_shared<FakeProvider>();
  auto source_staging = std::make_shared<StagingPool>(provider, StagingConfig{2, 4096, 1, 10'000});
  auto reader_staging = std::make_shared<StagingPool>(provider, StagingConfig{2, 4096, 1, 100});
  DataServerConfig config;
  config.staging = source_staging;
  DataServer server(config);
  const std::vector<std::byte> big = pattern(50'000, 3);
  const GrantSecret secret{9, 10};
  server.grant({8, 1}, secret, {{big.data(), big.size(), true}}, std::make_shared<Progress>(big.size()));
  StagingPool::Loan taken = reader_staging->borrow();  // the reader's only ring is busy elsewhere
  std::vector<std::byte> into(big.size());
  std::vector<LocalRegion> targets{{into.data(), into.size(), true}};
  PullOptions options;
  options.staging = reader_staging;
  const PullOutcome outcome = pull(server.endpoint(), {8, 1}, secret, targets, options);
  ASSERT_FALSE(outcome.ok());
  EXPECT_NE(outcome.detail.find("no staging ring came free"), std::string::npos) << outcome.detail;
  server.revoke({8, 1});
}

// revoke() waits for the connections that pin the grant; one waiting for a staging ring (all lent)
// must let go at once, not after ring_wait_ms_max: revoke runs on the client's I/O thread.
TEST(StagedDataPlane, ARevokeDoesNotWaitForAConnectionWaitingForARing) {
  auto provider = std::make_shared<FakeProvider>();
  auto staging = std::make_shared<StagingPool>(provider, StagingConfig{2, 4096, 1, 60'000});
  DataServerConfig config;
  config.staging = staging;
  DataServer server(config);
  const std::vector<std::byte> big = pattern(50'000, 4);
  const GrantSecret secret{5, 6};
  server.grant({9, 1}, secret, {{big.data(), big.size(), true}}, std::make_shared<Progress>(big.size()));
  auto taken = std::make_unique<StagingPool::Loan>(staging->borrow());  // the server's only ring
  std::vector<std::byte> into(big.size());
  std::vector<LocalRegion> targets{{into.data(), into.size(), false}};
  PullOutcome outcome;
  std::thread reader([&] { outcome = pull(server.endpoint(), {9, 1}, secret, targets, PullOptions{}); });
  // Wait until the request is being served (the connection pins the grant, waiting for the ring).
  for (int i = 0; i < 2000 && server.stats().connections_open == 0; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  std::atomic<bool> revoked{false};
  std::thread revoking([&] {
    server.revoke({9, 1});
    revoked = true;
  });
  // Ten seconds is far beyond the poll (50 ms) and far below the ring wait (60 s): a revoke that
  // waited for the ring would still be waiting when the ring is given back below.
  for (int i = 0; i < 10'000 && !revoked.load(); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  const bool revoked_while_the_ring_was_lent = revoked.load();
  taken.reset();
  revoking.join();
  reader.join();
  EXPECT_TRUE(revoked_while_the_ring_was_lent) << "revoke() waited for a connection waiting for a staging ring";
  EXPECT_FALSE(outcome.ok());
  EXPECT_EQ(outcome.error, ReadError::kRefused) << outcome.detail;
}

}  // namespace
}  // namespace th::net
