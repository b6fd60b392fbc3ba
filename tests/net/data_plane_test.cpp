// The TCP data plane on loopback: bit-exact pulls, pipeline reads of a partial source, refusals
// outside a grant, and revoke() as the integrity barrier (no read is in flight once it returns).
#include "net/data_plane.h"

#include <gtest/gtest.h>

#include <cstring>
#include <thread>
#include <vector>

namespace th::net {
namespace {

// Bytes that name their position: a byte in the wrong place cannot pass for the right one.
std::vector<std::byte> pattern(std::size_t bytes, std::uint64_t seed) {
  std::vector<std::byte> data(bytes);
  std::uint64_t state = seed * 0x9E3779B97F4A7C15ull + 1;
  for (auto& byte : data) {
    state ^= state << 13;
    state ^= state >> 7;
    state ^= state << 17;
    byte = static_cast<std::byte>(state);
  }
  return data;
}

struct Shard {
  std::vector<std::vector<std::byte>> tensors;
  std::vector<ExposedRegion> exposed() const {
    std::vector<ExposedRegion> regions;
    for (const auto& tensor : tensors) regions.push_back({tensor.data(), tensor.size()});
    return regions;
  }
  std::uint64_t total() const {
    std::uint64_t bytes = 0;
    for (const auto& tensor : tensors) bytes += tensor.size();
    return bytes;
  }
};

Shard source_shard() {
  // Sizes that do not divide the chunk size, an empty tensor, and a big one.
  return Shard{{pattern(3 << 20, 1), pattern(0, 2), pattern(777, 3), pattern((9 << 20) + 5, 4)}};
}

struct Reader {
  std::vector<std::vector<std::byte>> buffers;
  explicit Reader(const Shard& like) {
    for (const auto& tensor : like.tensors) buffers.emplace_back(tensor.size(), std::byte{0xEE});
  }
  std::vector<LocalRegion> targets() {
    std::vector<LocalRegion> regions;
    for (auto& buffer : buffers) regions.push_back({buffer.data(), buffer.size()});
    return regions;
  }
};

PullOptions small_chunks() {
  PullOptions options;
  options.chunk_bytes = 1 << 20;
  options.io_timeout_ms = 10'000;
  return options;
}

// Pulls `shard`, granted under `key`, over `streams` connections; checks every byte, the byte
// count, and that the reported ready prefix only grew, up to the whole shard.
void expect_bit_exact_pull(const DataServer& server, const Shard& shard, GrantKey key, std::uint32_t streams) {
  Reader reader(shard);
  std::uint64_t last_progress = 0;
  PullOptions options = small_chunks();
  options.streams = streams;
  options.on_progress = [&](std::uint64_t ready) {
    EXPECT_GT(ready, last_progress);
    last_progress = ready;
  };
  const auto targets = reader.targets();
  const PullOutcome outcome = pull(server.endpoint(), key, targets, options);
  ASSERT_TRUE(outcome.ok()) << outcome.detail;
  EXPECT_EQ(outcome.bytes, shard.total());
  EXPECT_EQ(last_progress, shard.total());
  EXPECT_EQ(reader.buffers, shard.tensors);
}

TEST(DataPlane, PullsACompleteSourceBitExact) {
  DataServer server(DataServerConfig{});
  const Shard shard = source_shard();
  server.grant({7, 1}, shard.exposed(), std::make_shared<Progress>(shard.total()));
  expect_bit_exact_pull(server, shard, {7, 1}, 1);
  EXPECT_EQ(server.stats().bytes_served, shard.total());
  server.revoke({7, 1});
}

// A read of a grant the source has not heard of waits (grant_wait_ms_max), then is refused.
TEST(DataPlane, RefusesReadsWithoutAGrant) {
  DataServer server(DataServerConfig{.grant_wait_ms_max = 50});
  const Shard shard = source_shard();
  server.grant({7, 1}, shard.exposed(), std::make_shared<Progress>(shard.total()));
  Reader reader(shard);
  const auto targets = reader.targets();
  // Another epoch of the same transfer is another grant: the hub moved the reader elsewhere.
  PullOutcome outcome = pull(server.endpoint(), {7, 2}, targets, small_chunks());
  ASSERT_FALSE(outcome.ok());
  EXPECT_EQ(outcome.error, ReadError::kRefused);
  EXPECT_NE(outcome.detail.find("no grant"), std::string::npos) << outcome.detail;
  // After revoke, the grant is gone for everyone.
  server.revoke({7, 1});
  outcome = pull(server.endpoint(), {7, 1}, targets, small_chunks());
  EXPECT_EQ(outcome.error, ReadError::kRefused);
  EXPECT_GE(server.stats().reads_refused, 2u);
}

TEST(DataPlane, PullsOverSeveralStreamsBitExact) {
  DataServer server(DataServerConfig{});
  Shard shard = source_shard();
  for (int i = 0; i < 5; ++i) shard.tensors.push_back(pattern((1 << 20) + 17 * i, 10 + i));
  server.grant({7, 1}, shard.exposed(), std::make_shared<Progress>(shard.total()));
  expect_bit_exact_pull(server, shard, {7, 1}, 3);
  // A refusal on one stream fails the whole pull, typed.
  PullOptions options = small_chunks();
  options.streams = 3;
  Shard bigger = shard;
  bigger.tensors[4].resize(bigger.tensors[4].size() + 1);
  Reader wrong(bigger);
  const auto wrong_targets = wrong.targets();
  EXPECT_EQ(pull(server.endpoint(), {7, 1}, wrong_targets, options).error, ReadError::kRefused);
  server.revoke({7, 1});
}

TEST(DataPlane, RefusesReadsOutsideTheExposedRegions) {
  DataServer server(DataServerConfig{});
  const Shard shard = source_shard();
  server.grant({7, 1}, shard.exposed(), std::make_shared<Progress>(shard.total()));
  // A reader that believes the last tensor is bigger than the source exposed.
  Shard bigger = shard;
  bigger.tensors.back().resize(bigger.tensors.back().size() + 1);
  Reader reader(bigger);
  const auto targets = reader.targets();
  PullOutcome outcome = pull(server.endpoint(), {7, 1}, targets, small_chunks());
  EXPECT_EQ(outcome.error, ReadError::kRefused);
  EXPECT_NE(outcome.detail.find("outside"), std::string::npos) << outcome.detail;
  // And one more region than exposed.
  Shard more = shard;
  more.tensors.push_back(pattern(10, 9));
  Reader reader_more(more);
  const auto more_targets = reader_more.targets();
  outcome = pull(server.endpoint(), {7, 1}, more_targets, small_chunks());
  EXPECT_EQ(outcome.error, ReadError::kRefused);
  server.revoke({7, 1});
}

TEST(DataPlane, UnreachableSourceIsATypedFailure) {
  Endpoint nowhere;
  {
    DataServer server(DataServerConfig{});
    nowhere = server.endpoint();
  }  // closed: nothing listens there now
  const Shard shard = source_shard();
  Reader reader(shard);
  const auto targets = reader.targets();
  const PullOutcome outcome = pull(nowhere, {1, 1}, targets, small_chunks());
  EXPECT_EQ(outcome.error, ReadError::kUnreachable);
}

// Pipeline replication: the source is still receiving; it exposes its prefix as it grows and the
// reader follows it to the end.
TEST(DataPlane, ReadsAPartialSourceAsItGrows) {
  DataServer server(DataServerConfig{});
  const Shard original = source_shard();
  Shard receiving{std::vector<std::vector<std::byte>>(original.tensors.size())};
  for (std::size_t i = 0; i < original.tensors.size(); ++i) {
    receiving.tensors[i].assign(original.tensors[i].size(), std::byte{0});
  }
  auto progress = std::make_shared<Progress>(0);
  server.grant({9, 1}, receiving.exposed(), progress);

  // The "upstream" fills the receiving copy in layout order, 300 KB at a time.
  std::thread upstream([&] {
    std::uint64_t done = 0;
    std::size_t tensor = 0;
    std::uint64_t offset = 0;
    while (tensor < original.tensors.size()) {
      const std::uint64_t step = std::min<std::uint64_t>(300'000, original.tensors[tensor].size() - offset);
      std::memcpy(receiving.tensors[tensor].data() + offset, original.tensors[tensor].data() + offset, step);
      offset += step;
      done += step;
      progress->advance_to(done);
      if (offset == original.tensors[tensor].size()) {
        ++tensor;
        offset = 0;
      }
      std::this_thread::yield();
    }
  });
  Reader reader(original);
  PullOptions options = small_chunks();
  options.partial = true;
  const auto targets = reader.targets();
  const PullOutcome outcome = pull(server.endpoint(), {9, 1}, targets, options);
  upstream.join();
  ASSERT_TRUE(outcome.ok()) << outcome.detail;
  EXPECT_EQ(reader.buffers, original.tensors);
  server.revoke({9, 1});
}

TEST(DataPlane, APartialSourceThatStopsGrowingStalls) {
  DataServer server(DataServerConfig{.progress_wait_ms_max = 20});
  const Shard shard = source_shard();
  server.grant({9, 1}, shard.exposed(), std::make_shared<Progress>(1000));  // stuck at 1000 bytes
  Reader reader(shard);
  PullOptions options = small_chunks();
  options.partial = true;
  options.stall_ms_max = 100;
  const auto targets = reader.targets();
  const PullOutcome outcome = pull(server.endpoint(), {9, 1}, targets, options);
  EXPECT_EQ(outcome.error, ReadError::kStalled);
  EXPECT_EQ(outcome.bytes, 1000u);
  server.revoke({9, 1});
}

TEST(DataPlane, ACancelledPullStops) {
  DataServer server(DataServerConfig{});
  const Shard shard = source_shard();
  server.grant({3, 1}, shard.exposed(), std::make_shared<Progress>(shard.total()));
  Reader reader(shard);
  PullOptions options = small_chunks();
  options.cancelled = [] { return true; };
  const auto targets = reader.targets();
  EXPECT_EQ(pull(server.endpoint(), {3, 1}, targets, options).error, ReadError::kCancelled);
  server.revoke({3, 1});
}

// The integrity barrier: once revoke() returns, the owner overwrites its buffers; no reader may
// receive a single overwritten byte. Readers pull in a loop while the owner revokes and scribbles;
// every pull either completes with the original bytes or is refused.
TEST(DataPlane, NoReadSeesBytesWrittenAfterRevoke) {
  DataServer server(DataServerConfig{});
  Shard shard = source_shard();
  const Shard original = shard;
  server.grant({5, 1}, shard.exposed(), std::make_shared<Progress>(shard.total()));
  std::atomic<int> completed{0};
  std::atomic<int> refused{0};
  std::vector<std::thread> readers;
  for (int i = 0; i < 2; ++i) {
    readers.emplace_back([&] {
      for (;;) {
        Reader reader(original);
        PullOptions options = small_chunks();
        options.chunk_bytes = 64 << 10;  // many requests: revoke lands between or during them
        const auto targets = reader.targets();
        const PullOutcome outcome = pull(server.endpoint(), {5, 1}, targets, options);
        if (!outcome.ok()) {
          EXPECT_EQ(outcome.error, ReadError::kRefused) << outcome.detail;
          ++refused;
          return;
        }
        EXPECT_EQ(reader.buffers, original.tensors);  // never a scribbled byte
        ++completed;
      }
    });
  }
  while (completed.load() < 2) std::this_thread::yield();
  server.revoke({5, 1});
  for (auto& tensor : shard.tensors) std::fill(tensor.begin(), tensor.end(), std::byte{0xAB});
  for (auto& reader : readers) reader.join();
  EXPECT_EQ(refused.load(), 2);
}

// The hub tells reader and source at once: a reader that is first waits for the grant.
TEST(DataPlane, AReadThatArrivesBeforeItsGrantWaitsForIt) {
  DataServer server(DataServerConfig{});
  const Shard shard = source_shard();
  Reader reader(shard);
  const auto targets = reader.targets();
  PullOutcome outcome;
  std::thread early([&] { outcome = pull(server.endpoint(), {8, 1}, targets, small_chunks()); });
  std::this_thread::sleep_for(std::chrono::milliseconds(20));  // ordering help, not an assertion
  server.grant({8, 1}, shard.exposed(), std::make_shared<Progress>(shard.total()));
  early.join();
  ASSERT_TRUE(outcome.ok()) << outcome.detail;
  EXPECT_EQ(reader.buffers, shard.tensors);
  server.revoke({8, 1});
}

TEST(DataPlane, ParsesEndpoints) {
  EXPECT_EQ(parse_endpoint("10.0.0.1:7000").host, "10.0.0.1");
  EXPECT_EQ(parse_endpoint("10.0.0.1:7000").port, 7000);
  EXPECT_EQ(parse_endpoint("[::1]:80").host, "::1");
  EXPECT_EQ(parse_endpoint("[::1]:80").to_string(), "[::1]:80");
  EXPECT_THROW(parse_endpoint("nohost"), SocketError);
  EXPECT_THROW(parse_endpoint("h:70000"), SocketError);
  EXPECT_THROW(parse_endpoint("h:7x"), SocketError);
}

}  // namespace
}  // namespace th::net
