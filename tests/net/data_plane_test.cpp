// The TCP data plane on loopback: bit-exact pulls, pipeline reads of a partial source, refusals
// outside a grant, and revoke() as the integrity barrier (no read is in flight once it returns).
// Then the server against readers that misbehave: many short connections (every thread joined),
// readers that stop reading (revoke() does not wait for them), silent connections (they do not
// starve readers), bursts for an unknown grant (bounded), with a rate-limited log.
#include "net/data_plane.h"

#include <gtest/gtest.h>
#include <poll.h>
#include <sys/socket.h>

#include <cerrno>
#include <atomic>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <future>
#include <mutex>
#include <sstream>
#include <thread>
#include <vector>

#include "tests/net/test_bytes.h"

namespace th::net {
namespace {

// The grants' secret in these tests (the hub draws one per grant).
constexpr GrantSecret kSecret{0x5ec2e7, 0xca9ab1e};

using testing_bytes::pattern;

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
  const PullOutcome outcome = pull(server.endpoint(), key, kSecret, targets, options);
  ASSERT_TRUE(outcome.ok()) << outcome.detail;
  EXPECT_EQ(outcome.bytes, shard.total());
  EXPECT_EQ(last_progress, shard.total());
  EXPECT_EQ(reader.buffers, shard.tensors);
}

TEST(DataPlane, PullsACompleteSourceBitExact) {
  DataServer server(DataServerConfig{});
  const Shard shard = source_shard();
  server.grant({7, 1}, kSecret, shard.exposed(), std::make_shared<Progress>(shard.total()));
  expect_bit_exact_pull(server, shard, {7, 1}, 1);
  EXPECT_EQ(server.stats().bytes_served, shard.total());
  server.revoke({7, 1});
}

// Resume (issue 34): a reader that holds the first `start_bytes` (its last source failed after
// them) pulls only the rest, from anywhere in a region: at a region's start, inside one, at the
// empty one, at the very end; whatever streams it asked for. The prefix is left as it was.
TEST(DataPlane, AResumedPullFetchesOnlyTheRest) {
  DataServer server(DataServerConfig{});
  Shard shard = source_shard();
  shard.tensors.push_back(pattern((2 << 20) + 3, 5));
  server.grant({7, 2}, kSecret, shard.exposed(), std::make_shared<Progress>(shard.total()));
  const std::uint64_t first = shard.tensors[0].size();
  for (const std::uint64_t start : {std::uint64_t{1}, first - 1, first, first + 100, first + 777 + 5, shard.total() - 1,
                                    shard.total()}) {
    for (const std::uint32_t streams : {1u, 3u}) {
      SCOPED_TRACE("start " + std::to_string(start) + ", streams " + std::to_string(streams));
      Reader reader(shard);
      PullOptions options = small_chunks();
      options.streams = streams;
      options.start_bytes = start;
      std::uint64_t last_progress = start;
      options.on_progress = [&](std::uint64_t ready) {
        EXPECT_GT(ready, last_progress);
        last_progress = ready;
      };
      const auto targets = reader.targets();
      const PullOutcome outcome = pull(server.endpoint(), {7, 2}, kSecret, targets, options);
      ASSERT_TRUE(outcome.ok()) << outcome.detail;
      EXPECT_EQ(outcome.bytes, shard.total() - start);
      EXPECT_EQ(last_progress, shard.total());
      // Byte by byte: the prefix untouched (0xEE), the rest the source's.
      std::uint64_t at = 0;
      for (std::size_t t = 0; t < shard.tensors.size(); ++t) {
        for (std::size_t i = 0; i < shard.tensors[t].size(); ++i, ++at) {
          const std::byte want = at < start ? std::byte{0xEE} : shard.tensors[t][i];
          if (reader.buffers[t][i] != want) {
            ADD_FAILURE() << "byte " << at << " (tensor " << t << ", offset " << i << ") is wrong";
            t = shard.tensors.size();
            break;
          }
        }
      }
    }
  }
  server.revoke({7, 2});
}

// A resumed pull from a source still receiving waits at the resume point for its bytes.
TEST(DataPlane, AResumedPullFollowsAPartialSource) {
  DataServer server(DataServerConfig{});
  const Shard original = source_shard();
  Shard receiving{std::vector<std::vector<std::byte>>(original.tensors.size())};
  for (std::size_t i = 0; i < original.tensors.size(); ++i) receiving.tensors[i].assign(original.tensors[i].size(), std::byte{0});
  auto progress = std::make_shared<Progress>(0);
  server.grant({9, 2}, kSecret, receiving.exposed(), progress);
  std::thread upstream([&] {
    std::uint64_t done = 0;
    for (std::size_t tensor = 0; tensor < original.tensors.size(); ++tensor) {
      for (std::uint64_t offset = 0; offset < original.tensors[tensor].size();) {
        const std::uint64_t step = std::min<std::uint64_t>(300'000, original.tensors[tensor].size() - offset);
        std::memcpy(receiving.tensors[tensor].data() + offset, original.tensors[tensor].data() + offset, step);
        offset += step;
        done += step;
        progress->advance_to(done);
        std::this_thread::yield();
      }
    }
  });
  Reader reader(original);
  const std::uint64_t start = (3 << 20) + 777 + 4096;  // inside the big tensor
  std::memcpy(reader.buffers[0].data(), original.tensors[0].data(), original.tensors[0].size());
  std::memcpy(reader.buffers[2].data(), original.tensors[2].data(), original.tensors[2].size());
  std::memcpy(reader.buffers[3].data(), original.tensors[3].data(), 4096);
  PullOptions options = small_chunks();
  options.partial = true;
  options.start_bytes = start;
  const auto targets = reader.targets();
  const PullOutcome outcome = pull(server.endpoint(), {9, 2}, kSecret, targets, options);
  upstream.join();
  ASSERT_TRUE(outcome.ok()) << outcome.detail;
  EXPECT_EQ(outcome.bytes, original.total() - start);
  EXPECT_EQ(reader.buffers, original.tensors);
  server.revoke({9, 2});
}

// A source still receiving, far behind where a reader resumed: the reader waits longer than its
// stall limit for the bytes at its resume point, and does not call the source stalled while the
// source's own prefix grows (kSourceAdvanced); one that stops growing is stalled all the same.
TEST(DataPlane, AResumedPullWaitsForAPartialSourceFarBehindIt) {
  DataServer server(DataServerConfig{.progress_wait_ms_max = 10});
  const Shard original = source_shard();
  Shard receiving{std::vector<std::vector<std::byte>>(original.tensors.size())};
  for (std::size_t i = 0; i < original.tensors.size(); ++i) receiving.tensors[i].assign(original.tensors[i].size(), std::byte{0});
  auto progress = std::make_shared<Progress>(0);
  server.grant({9, 3}, kSecret, receiving.exposed(), progress);
  // The reader holds the first two tensors and the third (the second is empty); the source needs
  // 160 steps of 5 ms or more to reach them: several times the reader's stall limit.
  const std::uint64_t start = (3 << 20) + 777;
  const std::uint64_t step_bytes = start / 160 + 1;
  std::atomic<std::uint64_t> ready_when_reached{0};
  std::thread upstream([&] {
    std::uint64_t done = 0;
    for (std::size_t tensor = 0; tensor < original.tensors.size(); ++tensor) {
      for (std::uint64_t offset = 0; offset < original.tensors[tensor].size();) {
        const std::uint64_t step = std::min<std::uint64_t>(step_bytes, original.tensors[tensor].size() - offset);
        std::memcpy(receiving.tensors[tensor].data() + offset, original.tensors[tensor].data() + offset, step);
        offset += step;
        done += step;
        progress->advance_to(done);
        if (done < start) std::this_thread::sleep_for(std::chrono::milliseconds(5));
      }
    }
  });
  Reader reader(original);
  for (std::size_t t : {0, 2}) std::memcpy(reader.buffers[t].data(), original.tensors[t].data(), original.tensors[t].size());
  PullOptions options = small_chunks();
  options.partial = true;
  options.start_bytes = start;
  options.stall_ms_max = 200;
  options.on_progress = [&](std::uint64_t ready) {
    if (ready_when_reached.load() == 0) ready_when_reached = progress->ready_bytes();
    EXPECT_GT(ready, start);
  };
  const auto targets = reader.targets();
  const PullOutcome outcome = pull(server.endpoint(), {9, 3}, kSecret, targets, options);
  upstream.join();
  ASSERT_TRUE(outcome.ok()) << outcome.detail;
  EXPECT_EQ(outcome.bytes, original.total() - start) << "only the rest is pulled";
  EXPECT_GT(ready_when_reached.load(), start) << "the first bytes came once the source had them";
  EXPECT_EQ(reader.buffers, original.tensors);
  server.revoke({9, 3});

  // Stuck behind the resume point: no answer says it advances.
  server.grant({9, 4}, kSecret, original.exposed(), std::make_shared<Progress>(1000));
  Reader stuck_reader(original);
  options.on_progress = nullptr;
  const auto stuck_targets = stuck_reader.targets();
  const PullOutcome stuck = pull(server.endpoint(), {9, 4}, kSecret, stuck_targets, options);
  EXPECT_EQ(stuck.error, ReadError::kStalled) << stuck.detail;
  EXPECT_EQ(stuck.bytes, 0u);
  server.revoke({9, 4});
}

// A read of a grant the source has not heard of waits (grant_wait_ms_max), then is refused.
TEST(DataPlane, RefusesReadsWithoutAGrant) {
  DataServer server(DataServerConfig{.grant_wait_ms_max = 50});
  const Shard shard = source_shard();
  server.grant({7, 1}, kSecret, shard.exposed(), std::make_shared<Progress>(shard.total()));
  Reader reader(shard);
  const auto targets = reader.targets();
  // Another epoch of the same transfer is another grant: the hub moved the reader elsewhere.
  PullOutcome outcome = pull(server.endpoint(), {7, 2}, kSecret, targets, small_chunks());
  ASSERT_FALSE(outcome.ok());
  EXPECT_EQ(outcome.error, ReadError::kRefused);
  EXPECT_NE(outcome.detail.find("no grant"), std::string::npos) << outcome.detail;
  // After revoke, the grant is gone for everyone.
  server.revoke({7, 1});
  outcome = pull(server.endpoint(), {7, 1}, kSecret, targets, small_chunks());
  EXPECT_EQ(outcome.error, ReadError::kRefused);
  EXPECT_GE(server.stats().reads_refused, 2u);
}

// A read of a grant revoked a moment ago is the race of a read the hub moved elsewhere: refused,
// counted, and not logged (a reader's log of warnings failed bench/run-crossdc now and then); a
// read of a grant this source never had is logged (each of the requests in flight).
TEST(DataPlane, ARefusedReadIsLoggedUnlessItsGrantWasJustRevoked) {
  std::mutex lines_mutex;
  std::vector<std::string> lines;
  DataServerConfig config{.grant_wait_ms_max = 20};
  config.log_interval_ms = 0;
  config.log = [&](const std::string& line) {
    std::lock_guard lock(lines_mutex);
    lines.push_back(line);
  };
  DataServer server(config);
  const Shard shard = source_shard();
  server.grant({7, 1}, kSecret, shard.exposed(), std::make_shared<Progress>(shard.total()));
  server.revoke({7, 1});
  Reader reader(shard);
  const auto targets = reader.targets();
  EXPECT_EQ(pull(server.endpoint(), {7, 1}, kSecret, targets, small_chunks()).error, ReadError::kRefused);
  EXPECT_EQ(pull(server.endpoint(), {7, 9}, kSecret, targets, small_chunks()).error, ReadError::kRefused);
  EXPECT_GE(server.stats().reads_refused, 2u);
  std::lock_guard lock(lines_mutex);
  // (A reader that hangs up at its first refusal may also be logged as a reset connection.)
  std::size_t refusals_logged = 0;
  for (const std::string& line : lines) {
    if (line.find("refused a read") == std::string::npos) continue;
    ++refusals_logged;
    EXPECT_NE(line.find("epoch 9"), std::string::npos) << line;
  }
  EXPECT_GE(refusals_logged, 1u);
}

// A grant is a capability: knowing (transfer, epoch), which an attacker may guess or see, is not
// enough. A read with another secret is refused, and refused at once (no wait for the grant).
TEST(DataPlane, RefusesReadsThatPresentAnotherSecret) {
  DataServer server(DataServerConfig{.grant_wait_ms_max = 60'000});
  const Shard shard = source_shard();
  server.grant({7, 1}, kSecret, shard.exposed(), std::make_shared<Progress>(shard.total()));
  Reader reader(shard);
  const auto targets = reader.targets();
  for (const GrantSecret& forged : {GrantSecret{0, 0}, GrantSecret{kSecret[0], kSecret[1] ^ 1},
                                     GrantSecret{kSecret[0] ^ (1ull << 63), kSecret[1]}}) {
    const PullOutcome outcome = pull(server.endpoint(), {7, 1}, forged, targets, small_chunks());
    EXPECT_EQ(outcome.error, ReadError::kRefused) << outcome.detail;
    EXPECT_EQ(outcome.bytes, 0u);
  }
  EXPECT_EQ(server.stats().bytes_served, 0u);
  expect_bit_exact_pull(server, shard, {7, 1}, 1);  // the rightful reader is served
  server.revoke({7, 1});
}

TEST(DataPlane, PullsOverSeveralStreamsBitExact) {
  DataServer server(DataServerConfig{});
  Shard shard = source_shard();
  for (int i = 0; i < 5; ++i) shard.tensors.push_back(pattern((1 << 20) + 17 * i, 10 + i));
  server.grant({7, 1}, kSecret, shard.exposed(), std::make_shared<Progress>(shard.total()));
  expect_bit_exact_pull(server, shard, {7, 1}, 3);
  // A refusal on one stream fails the whole pull, typed.
  PullOptions options = small_chunks();
  options.streams = 3;
  Shard bigger = shard;
  bigger.tensors[4].resize(bigger.tensors[4].size() + 1);
  Reader wrong(bigger);
  const auto wrong_targets = wrong.targets();
  EXPECT_EQ(pull(server.endpoint(), {7, 1}, kSecret, wrong_targets, options).error, ReadError::kRefused);
  server.revoke({7, 1});
}

TEST(DataPlane, RefusesReadsOutsideTheExposedRegions) {
  DataServer server(DataServerConfig{});
  const Shard shard = source_shard();
  server.grant({7, 1}, kSecret, shard.exposed(), std::make_shared<Progress>(shard.total()));
  // A reader that believes the last tensor is bigger than the source exposed.
  Shard bigger = shard;
  bigger.tensors.back().resize(bigger.tensors.back().size() + 1);
  Reader reader(bigger);
  const auto targets = reader.targets();
  PullOutcome outcome = pull(server.endpoint(), {7, 1}, kSecret, targets, small_chunks());
  EXPECT_EQ(outcome.error, ReadError::kRefused);
  EXPECT_NE(outcome.detail.find("outside"), std::string::npos) << outcome.detail;
  // And one more region than exposed.
  Shard more = shard;
  more.tensors.push_back(pattern(10, 9));
  Reader reader_more(more);
  const auto more_targets = reader_more.targets();
  outcome = pull(server.endpoint(), {7, 1}, kSecret, more_targets, small_chunks());
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
  const PullOutcome outcome = pull(nowhere, {1, 1}, kSecret, targets, small_chunks());
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
  server.grant({9, 1}, kSecret, receiving.exposed(), progress);

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
  const PullOutcome outcome = pull(server.endpoint(), {9, 1}, kSecret, targets, options);
  upstream.join();
  ASSERT_TRUE(outcome.ok()) << outcome.detail;
  EXPECT_EQ(reader.buffers, original.tensors);
  server.revoke({9, 1});
}

TEST(DataPlane, APartialSourceThatStopsGrowingStalls) {
  DataServer server(DataServerConfig{.progress_wait_ms_max = 20});
  const Shard shard = source_shard();
  server.grant({9, 1}, kSecret, shard.exposed(), std::make_shared<Progress>(1000));  // stuck at 1000 bytes
  Reader reader(shard);
  PullOptions options = small_chunks();
  options.partial = true;
  options.stall_ms_max = 100;
  const auto targets = reader.targets();
  const PullOutcome outcome = pull(server.endpoint(), {9, 1}, kSecret, targets, options);
  EXPECT_EQ(outcome.error, ReadError::kStalled);
  EXPECT_EQ(outcome.bytes, 1000u);
  server.revoke({9, 1});
}

TEST(DataPlane, ACancelledPullStops) {
  DataServer server(DataServerConfig{});
  const Shard shard = source_shard();
  server.grant({3, 1}, kSecret, shard.exposed(), std::make_shared<Progress>(shard.total()));
  Reader reader(shard);
  PullOptions options = small_chunks();
  options.cancelled = [] { return true; };
  const auto targets = reader.targets();
  EXPECT_EQ(pull(server.endpoint(), {3, 1}, kSecret, targets, options).error, ReadError::kCancelled);
  server.revoke({3, 1});
}

// The integrity barrier: once revoke() returns, the owner overwrites its buffers; no reader may
// receive a single overwritten byte. Readers pull in a loop while the owner revokes and scribbles;
// every pull either completes with the original bytes or is refused.
TEST(DataPlane, NoReadSeesBytesWrittenAfterRevoke) {
  DataServer server(DataServerConfig{});
  Shard shard = source_shard();
  const Shard original = shard;
  server.grant({5, 1}, kSecret, shard.exposed(), std::make_shared<Progress>(shard.total()));
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
        const PullOutcome outcome = pull(server.endpoint(), {5, 1}, kSecret, targets, options);
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
  std::thread early([&] { outcome = pull(server.endpoint(), {8, 1}, kSecret, targets, small_chunks()); });
  std::this_thread::sleep_for(std::chrono::milliseconds(20));  // ordering help, not an assertion
  server.grant({8, 1}, kSecret, shard.exposed(), std::make_shared<Progress>(shard.total()));
  early.join();
  ASSERT_TRUE(outcome.ok()) << outcome.detail;
  EXPECT_EQ(reader.buffers, shard.tensors);
  server.revoke({8, 1});
}

// ---- Misbehaving readers ----------------------------------------------------------------------------
// Waits below only turn a hang (the bug) into a failure: none asserts how fast anything is.
constexpr auto kHangGuard = std::chrono::seconds(20);

// Polls `done` until it holds or the hang guard passes; returns whether it holds.
template <typename Done>
bool eventually(Done done) {
  const auto give_up = std::chrono::steady_clock::now() + kHangGuard;
  while (!done()) {
    if (std::chrono::steady_clock::now() > give_up) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return true;
}

std::size_t threads_now() {
  std::size_t count = 0;
  for ([[maybe_unused]] const auto& task : std::filesystem::directory_iterator("/proc/self/task")) ++count;
  return count;
}

// Memory mappings of the process: each thread that is never joined keeps two (its stack and its
// guard page), and vm.max_map_count is what aborted the process in production.
std::size_t mappings_now() {
  std::ifstream maps("/proc/self/maps");
  std::size_t count = 0;
  for (std::string line; std::getline(maps, line);) ++count;
  return count;
}

// A reader that speaks raw frames (the layout the data plane's wire uses: see net/data_frames.h).
constexpr std::uint32_t kRawMagic = 0x32504454;  // "TDP2"
struct RawRequest {
  std::uint32_t magic = kRawMagic;
  std::uint32_t epoch = 0;
  std::uint64_t transfer = 0;
  std::uint32_t region = 0;
  std::uint32_t wait_for_bytes = 0;
  std::uint64_t offset = 0;
  std::uint64_t length = 0;
  GrantSecret secret = kSecret;
};
struct RawResponse {
  std::uint32_t status = 0;
  std::uint32_t flags = 0;  // 1: an empty answer, and the source's own prefix grew meanwhile
  std::uint64_t length = 0;
};

Fd raw_connection(const DataServer& server) {
  Fd connection = connect_tcp(server.endpoint(), 5'000);
  // A stuck test fails at the hang guard instead of hanging.
  set_io_timeout(connection, static_cast<int>(std::chrono::milliseconds(kHangGuard).count()));
  return connection;
}

void send_request(const Fd& connection, GrantKey key, std::uint64_t offset, std::uint64_t length) {
  const RawRequest request{kRawMagic, key.epoch, key.transfer, 0, 0, offset, length};
  send_all(connection, &request, sizeof request);
}

// Reads what the server sends until it closes (or resets) the connection; counts the bytes. A
// connection the server still holds open at the hang guard is a failure.
std::uint64_t read_to_close(const Fd& connection, std::vector<std::byte>* into = nullptr) {
  std::uint64_t bytes = 0;
  std::vector<std::byte> buffer(1 << 16);
  for (;;) {
    const ssize_t got = ::recv(connection.get(), buffer.data(), buffer.size(), 0);
    if (got < 0 && errno == EINTR) continue;
    if (got < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) ADD_FAILURE() << "the server keeps it open";
    if (got <= 0) return bytes;
    if (into != nullptr) into->insert(into->end(), buffer.begin(), buffer.begin() + got);
    bytes += static_cast<std::uint64_t>(got);
  }
}

// True once the server has closed the connection (it has nothing to send on it).
bool closed_by_server(const Fd& connection) { return read_to_close(connection) == 0; }

// 2,000 connections, one after another: each one's thread is joined when it ends, so threads and
// mappings come back to where they were. (Mappings are the measure of the leak: an exited thread
// leaves /proc/self/task joined or not, but its stack stays mapped until it is joined.) The log
// says a line, not one per bad connection.
TEST(DataPlane, EveryConnectionThreadIsJoinedWhenItEnds) {
  constexpr int kConnections = 2'000;
  // Above the starting point once every connection has ended: no thread at all; mappings only for
  // what malloc keeps (an arena per thread that ever ran, at most 8 per core) and glibc's cache of
  // thread stacks. Not a function of kConnections: the leak added 2 per connection.
  constexpr std::size_t kThreadsAboveStartMax = 0;
  constexpr std::size_t kMappingsAboveStartMax = 256;
  constexpr std::size_t kLogLinesMax = 1;  // the interval below is longer than the test
  DataServer server(DataServerConfig{.log_interval_ms = 3'600'000});
  const Shard shard{{pattern(4096, 1)}};
  server.grant({2, 1}, kSecret, shard.exposed(), std::make_shared<Progress>(shard.total()));
  const std::size_t threads_at_start = threads_now();
  const std::size_t mappings_at_start = mappings_now();

  testing::internal::CaptureStderr();
  int pulls_ok = 0;
  for (int i = 0; i < kConnections; ++i) {
    switch (i % 3) {
      case 0: {  // a reader
        Reader reader(shard);
        const auto targets = reader.targets();
        pulls_ok += pull(server.endpoint(), {2, 1}, kSecret, targets, small_chunks()).ok() ? 1 : 0;
        break;
      }
      case 1: {  // garbage
        Fd connection = raw_connection(server);
        const std::vector<std::byte> garbage = pattern(sizeof(RawRequest), 100 + i);
        send_all(connection, garbage.data(), garbage.size());
        break;
      }
      default:  // silent, then closed
        raw_connection(server);
        break;
    }
  }
  ASSERT_TRUE(eventually([&] { return server.stats().connections_open == 0; }));
  const std::string log = testing::internal::GetCapturedStderr();
  EXPECT_EQ(pulls_ok, (kConnections + 2) / 3);
  EXPECT_LE(threads_now(), threads_at_start + kThreadsAboveStartMax);
  EXPECT_LE(mappings_now(), mappings_at_start + kMappingsAboveStartMax);
  std::size_t log_lines = 0;
  std::istringstream lines(log);
  for (std::string line; std::getline(lines, line);) log_lines += line.starts_with("th data server:") ? 1 : 0;
  EXPECT_GE(log_lines, 1u) << "the garbage is worth a line";
  EXPECT_LE(log_lines, kLogLinesMax) << log;
  server.revoke({2, 1});
}

// revoke() cuts off a reader that asked for a lot and never reads: it does not wait for it (it
// once waited up to io_timeout_ms per partial send, on the thread that sends the heartbeats).
// Once it returns the owner scribbles on the memory, and not one scribbled byte reaches the reader.
TEST(DataPlane, RevokeDoesNotWaitForAReaderThatStopsReading) {
  DataServer server(DataServerConfig{});
  constexpr std::uint64_t kAsked = 64ull << 20;  // far more than the socket buffers hold
  std::vector<std::byte> memory = pattern(kAsked, 21);
  const std::vector<std::byte> original = memory;
  server.grant({4, 1}, kSecret, {{memory.data(), memory.size()}}, std::make_shared<Progress>(kAsked));
  Fd reader = raw_connection(server);
  set_buffer_bytes(reader, 64 << 10);
  send_request(reader, {4, 1}, 0, kAsked);
  pollfd response_started{reader.get(), POLLIN, 0};  // the server is sending: it is mid-response
  ASSERT_EQ(::poll(&response_started, 1, static_cast<int>(std::chrono::milliseconds(kHangGuard).count())), 1);

  auto revoking = std::async(std::launch::async, [&] { server.revoke({4, 1}); });
  ASSERT_EQ(revoking.wait_for(kHangGuard), std::future_status::ready) << "revoke() waits on the reader";
  std::fill(memory.begin(), memory.end(), std::byte{0xAB});

  std::vector<std::byte> received;
  read_to_close(reader, &received);
  ASSERT_GE(received.size(), sizeof(RawResponse));
  RawResponse response;
  std::memcpy(&response, received.data(), sizeof response);
  EXPECT_EQ(response.status, 0u);
  EXPECT_EQ(response.length, kAsked);
  const std::uint64_t payload = received.size() - sizeof response;
  EXPECT_LT(payload, kAsked) << "the read was cut off";
  EXPECT_TRUE(std::equal(received.begin() + sizeof response, received.end(), original.begin()))
      << "a byte written after revoke() reached the reader";
  EXPECT_TRUE(eventually([&] { return server.stats().reads_cut_off == 1; }));
  EXPECT_EQ(server.stats().reads_served, 0u);
}

// A reader that drains its response at a trickle is cut off at the response's deadline, though
// every one of its partial reads is quick (a timeout that restarted on each let it hold on).
TEST(DataPlane, AReaderSlowerThanTheResponseDeadlineIsCutOff) {
  DataServer server(DataServerConfig{.response_ms_base = 1'000, .reader_bytes_per_s_min = 64ull << 20});
  constexpr std::uint64_t kAsked = 8ull << 20;   // due in 1 s + 125 ms
  constexpr std::size_t kSipBytes = 4 << 10;     // every 5 ms: 8 MiB would take 10 s
  const std::vector<std::byte> memory = pattern(kAsked, 22);
  server.grant({4, 2}, kSecret, {{memory.data(), memory.size()}}, std::make_shared<Progress>(kAsked));
  Fd reader = raw_connection(server);
  set_buffer_bytes(reader, 64 << 10);
  send_request(reader, {4, 2}, 0, kAsked);
  std::uint64_t received = 0;
  std::vector<std::byte> sip(kSipBytes);
  const auto give_up = std::chrono::steady_clock::now() + kHangGuard;
  while (server.stats().reads_cut_off == 0 && std::chrono::steady_clock::now() < give_up) {
    const ssize_t got = ::recv(reader.get(), sip.data(), sip.size(), 0);
    if (got <= 0) break;
    received += static_cast<std::uint64_t>(got);
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  received += read_to_close(reader);
  EXPECT_EQ(server.stats().reads_cut_off, 1u);
  EXPECT_LT(received, sizeof(RawResponse) + kAsked) << "the trickling reader got its whole response";
  EXPECT_EQ(server.stats().reads_served, 0u);
  server.revoke({4, 2});
}

// connections_max silent connections hold every slot; a reader still gets its read: the silent
// connection idle the longest makes room. (The first-request deadline is out of reach here.)
TEST(DataPlane, SilentConnectionsDoNotStarveReaders) {
  constexpr std::uint32_t kSlots = 8;
  DataServer server(DataServerConfig{.connections_max = kSlots, .first_request_timeout_ms = 600'000});
  const Shard shard = source_shard();
  server.grant({6, 1}, kSecret, shard.exposed(), std::make_shared<Progress>(shard.total()));
  std::vector<Fd> silent;
  for (std::uint32_t i = 0; i < kSlots; ++i) {
    silent.push_back(raw_connection(server));
    // One at a time, so that the first is the one idle the longest.
    ASSERT_TRUE(eventually([&] { return server.stats().connections_open == i + 1; }));
  }
  expect_bit_exact_pull(server, shard, {6, 1}, 1);
  EXPECT_TRUE(closed_by_server(silent.front()));
  EXPECT_GE(server.stats().connections_dropped, 1u);
  EXPECT_LE(server.stats().connections_open, kSlots);
  server.revoke({6, 1});
}

// A connection that says nothing, says half a request, or goes quiet after a read is closed.
TEST(DataPlane, SilentAndIdleConnectionsAreClosed) {
  DataServer server(DataServerConfig{.first_request_timeout_ms = 50, .idle_timeout_ms = 50});
  const Shard shard{{pattern(1000, 5)}};
  server.grant({6, 2}, kSecret, shard.exposed(), std::make_shared<Progress>(shard.total()));
  Fd silent = raw_connection(server);
  Fd half = raw_connection(server);
  const RawRequest request{kRawMagic, 2, 6, 0, 0, 0, 1000};
  send_all(half, &request, sizeof request / 2);  // the rest never comes
  Fd quiet_after_read = raw_connection(server);
  send_request(quiet_after_read, {6, 2}, 0, 1000);
  EXPECT_TRUE(closed_by_server(silent));
  EXPECT_TRUE(closed_by_server(half));
  EXPECT_EQ(read_to_close(quiet_after_read), sizeof(RawResponse) + 1000);
  EXPECT_EQ(server.stats().reads_served, 1u);
  EXPECT_TRUE(eventually([&] { return server.stats().connections_dropped == 3; }));
  server.revoke({6, 2});
}

// Requests for a grant the source has not heard of wait for it, but the connection is busy, not
// idle, while they do: it keeps its slot and thread, no connection beyond connections_max is
// taken in, and the wait is spent once per connection, not once per pipelined request.
TEST(DataPlane, WaitingForAnUnknownGrantIsBounded) {
  constexpr std::uint32_t kSlots = 4;
  DataServer server(DataServerConfig{.connections_max = kSlots, .grant_wait_ms_max = 600'000});
  const Shard shard{{pattern(1000, 6)}};
  const std::size_t threads_at_start = threads_now();
  std::vector<Fd> early;
  for (std::uint32_t i = 0; i < kSlots; ++i) {
    early.push_back(raw_connection(server));
    send_request(early.back(), {6, 3}, 0, 1000);
  }
  ASSERT_TRUE(eventually([&] {
    const DataServer::Stats stats = server.stats();
    return stats.connections_open == kSlots && stats.connections_idle == 0;
  }));
  Fd one_more = raw_connection(server);
  EXPECT_TRUE(closed_by_server(one_more)) << "every slot waits for its grant: none is idle";
  EXPECT_LE(threads_now(), threads_at_start + kSlots);
  server.grant({6, 3}, kSecret, shard.exposed(), std::make_shared<Progress>(shard.total()));
  for (const Fd& connection : early) {
    RawResponse response;
    recv_all(connection, &response, sizeof response);
    EXPECT_EQ(response.status, 0u);
    EXPECT_EQ(response.length, 1000u);
  }
  server.revoke({6, 3});

  // A burst for a grant that never comes: the first request spends the connection's wait, the
  // rest are refused at once (at grant_wait_ms_max each, the burst would outlast the hang guard).
  constexpr int kBurst = 200;
  DataServer bounded(DataServerConfig{.grant_wait_ms_max = 500, .refusals_per_connection_max = kBurst});
  Fd burst = raw_connection(bounded);
  for (int i = 0; i < kBurst; ++i) send_request(burst, {6, 4}, 0, 1000);
  const auto give_up = std::chrono::steady_clock::now() + kHangGuard;
  int refused = 0;
  for (; refused < kBurst && std::chrono::steady_clock::now() < give_up; ++refused) {
    RawResponse response;
    recv_all(burst, &response, sizeof response);
    ASSERT_EQ(response.status, 1u);  // no grant
  }
  EXPECT_EQ(refused, kBurst);
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

// libthclient's default data address (issue 18): the interface that reaches the server.
TEST(DataPlane, FindsTheLocalAddressTowardsAPeer) {
  EXPECT_EQ(local_address_towards(parse_endpoint("127.0.0.1:7400")), "127.0.0.1");
  EXPECT_EQ(local_address_towards(parse_endpoint("127.3.4.5:1")), "127.0.0.1");  // lo answers 127/8
  // Every spelling of "any address" (an attack advertised "[::0]" and "0" verbatim).
  for (const char* wildcard : {"0.0.0.0", "::", "", "::0", "0", "0:0:0:0:0:0:0:0"}) {
    EXPECT_TRUE(is_wildcard_host(wildcard)) << wildcard;
  }
  for (const char* host : {"10.0.0.1", "::1", "127.0.0.1", "localhost", "fe80::1"}) {
    EXPECT_FALSE(is_wildcard_host(host)) << host;
  }
  EXPECT_TRUE(is_link_local("fe80::fc:ff:fe00:1"));
  EXPECT_FALSE(is_link_local("fd00::2"));
  EXPECT_FALSE(is_link_local("10.0.0.1"));
}

// Fuzzing find (tests/fuzz/regressions/fuzz_data_request): a read of a partial source's second
// region, beyond what is ready, tripped an assertion and took the source down. It gets an empty
// answer, and the connection goes on.
TEST(DataPlane, AReadBeyondTheReadyPrefixGetsAnEmptyAnswer) {
  DataServer server(DataServerConfig{.progress_wait_ms_max = 10});
  const Shard shard{{pattern(1000, 1), pattern(1000, 2)}};
  server.grant({8, 1}, kSecret, shard.exposed(), std::make_shared<Progress>(500));  // half of region 0
  Fd connection = raw_connection(server);
  const RawRequest beyond{kRawMagic, 1, 8, 1, 1, 0, 100};  // region 1, waiting for bytes
  send_all(connection, &beyond, sizeof beyond);
  RawResponse response;
  recv_all(connection, &response, sizeof response);
  EXPECT_EQ(response.status, 0u);
  EXPECT_EQ(response.length, 0u);
  send_request(connection, {8, 1}, 0, 100);  // region 0, ready: served on the same connection
  recv_all(connection, &response, sizeof response);
  EXPECT_EQ(response.status, 0u);
  EXPECT_EQ(response.length, 100u);
  server.revoke({8, 1});
}

// Review find: a connection waiting for an unknown grant is busy (it cannot be dropped to make
// room), so anyone who reaches the port could keep every slot waiting. At most grant_waiters_max
// wait at once; beyond, a read of an unknown grant is refused at once.
TEST(DataPlane, FewConnectionsWaitForUnknownGrantsAtOnce) {
  DataServer server(DataServerConfig{.grant_wait_ms_max = 600'000, .grant_waiters_max = 2});
  std::vector<Fd> waiting;
  for (int i = 0; i < 2; ++i) {
    waiting.push_back(raw_connection(server));
    send_request(waiting.back(), {9, 9}, 0, 100);
  }
  ASSERT_TRUE(eventually([&] {
    const DataServer::Stats stats = server.stats();
    return stats.connections_open == 2 && stats.connections_idle == 0;
  }));
  Fd third = raw_connection(server);
  send_request(third, {9, 9}, 0, 100);
  RawResponse response;
  recv_all(third, &response, sizeof response);  // (a wait would outlast the hang guard)
  EXPECT_EQ(response.status, 1u) << "no grant";
}

// Attack find: a wrong secret was refused and the connection went on, for ever. A guesser that
// never read its refusals kept the connection thread sending them, and 300 such connections kept
// most slots busy (a rollout's replicate took 13 s instead of 0.4). Now a connection is closed
// after refusals_per_connection_max refusals.
TEST(DataPlane, AConnectionWhoseReadsAreRefusedOverAndOverIsClosed) {
  DataServer server(DataServerConfig{.grant_wait_ms_max = 0, .refusals_per_connection_max = 3});
  const Shard shard = source_shard();
  server.grant({8, 1}, kSecret, shard.exposed(), std::make_shared<Progress>(shard.total()));
  Fd guesser = raw_connection(server);
  for (std::uint64_t guess = 1; guess <= 3; ++guess) {
    RawRequest request{kRawMagic, 1, 8, 0, 0, 0, 100};
    request.secret = GrantSecret{guess, guess};
    send_all(guesser, &request, sizeof request);
    RawResponse response;
    recv_all(guesser, &response, sizeof response);
    EXPECT_EQ(response.status, 1u) << "no grant";
  }
  EXPECT_TRUE(closed_by_server(guesser)) << "three refusals, then the connection is closed";
  // A rightful reader is served, on a connection of its own.
  expect_bit_exact_pull(server, shard, {8, 1}, 1);
  server.revoke({8, 1});
}

// A source that says it advances (an empty answer, flag 1) at once, for ever, without a byte: a
// reader resumed ahead of it gives up after ten stall limits, and calls it stalled; meanwhile it
// does not spin (it pauses after each empty answer).
TEST(DataPlane, ASourceThatSaysItAdvancesButSendsNothingIsStalledInTheEnd) {
  Fd listener = listen_tcp(Endpoint{"127.0.0.1", 0}, 4);
  const Endpoint endpoint{"127.0.0.1", local_port(listener)};
  std::atomic<int> answers{0};
  std::atomic<bool> done{false};
  std::thread liar([&] {
    // Every connection the reader makes (a probe, then the pull), one after the other.
    while (!done.load()) {
      pollfd entry{listener.get(), POLLIN, 0};
      if (::poll(&entry, 1, 50) != 1) continue;
      Fd connection = accept_tcp(listener);
      if (!connection.valid()) continue;
      try {
        RawRequest request;
        while (recv_all_or_eof(connection, &request, sizeof request)) {
          const RawResponse empty{0, 1, 0};
          send_all(connection, &empty, sizeof empty);
          ++answers;
        }
      } catch (const SocketError&) {
        // the reader hung up mid-answer
      }
    }
  });
  const Shard shard = source_shard();
  Reader reader(shard);
  PullOptions options = small_chunks();
  options.partial = true;
  options.start_bytes = 1000;
  options.stall_ms_max = 20;
  const auto targets = reader.targets();
  const PullOutcome outcome = pull(endpoint, {9, 5}, kSecret, targets, options);
  done = true;
  liar.join();
  EXPECT_EQ(outcome.error, ReadError::kStalled) << outcome.detail;
  EXPECT_NE(outcome.detail.find("still behind where this read resumed"), std::string::npos) << outcome.detail;
  EXPECT_EQ(outcome.bytes, 0u);
  // At most one answer a millisecond over the 200 ms and more it waited (not a timing bound on
  // the reader: a bound on how hard it asked).
  EXPECT_LT(answers.load(), 2'000);
}

}  // namespace
}  // namespace th::net
