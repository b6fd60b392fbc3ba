// rdma/ on real verbs: run inside the soft-RoCE guest (tests/rdma/guest; ctest -L rdma does it).
// On a host without an RDMA device every test skips.
//
// Bit-exact pulls of mixed sizes with the source's CPU sending nothing; pipeline reads of a partial
// source through its progress word; a grant revoked mid-read cuts the reader off (memory window)
// and nothing lands afterwards; registrations made once per allocation, not per version; TCP
// fallback both ways; a source killed with SIGKILL mid-read, then another finishing; a reader and
// a source on different devices.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <iostream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "net/transport.h"
#include "tests/net/test_bytes.h"
#include "rdma/protocol.h"  // the rogue peer below speaks the protocol by hand
#include "rdma/transport.h"
#include "rdma/verbs.h"

namespace th::rdma {
namespace {

constexpr GrantSecret kSecret{0x5ec2e7, 0xca9ab1e};

using testing_bytes::pattern;  // bytes that name their position

// One allocation with tensors side by side (as a model's parameters often are), plus a separate
// packed buffer: sizes that do not divide the read size, an empty tensor, a tiny one.
struct Shard {
  std::vector<std::byte> allocation;
  std::vector<std::byte> packed;
  std::vector<std::uint64_t> sizes{(3u << 20) + 7, 0, 777, (5u << 20) + 5};
  explicit Shard(std::uint64_t seed, std::vector<std::uint64_t> sizes_in = {}) : packed(pattern(1000, seed + 100)) {
    if (!sizes_in.empty()) sizes = std::move(sizes_in);
    std::uint64_t total = 0;
    for (auto size : sizes) total += size;
    allocation = pattern(total, seed);
  }
  std::vector<net::ExposedRegion> regions() const {
    std::vector<net::ExposedRegion> out{{packed.data(), packed.size()}};
    std::uint64_t at = 0;
    for (auto size : sizes) {
      out.push_back({allocation.data() + at, size});
      at += size;
    }
    return out;
  }
  std::uint64_t total() const { return allocation.size() + packed.size(); }
};

struct Target {
  std::vector<std::byte> allocation;
  std::vector<std::byte> packed;
  const Shard& like;
  explicit Target(const Shard& shard)
      : allocation(shard.allocation.size(), std::byte{0xEE}), packed(shard.packed.size(), std::byte{0xEE}), like(shard) {}
  std::vector<net::LocalRegion> regions() {
    std::vector<net::LocalRegion> out{{packed.data(), packed.size()}};
    std::uint64_t at = 0;
    for (auto size : like.sizes) {
      out.push_back({allocation.data() + at, size});
      at += size;
    }
    return out;
  }
  bool equals(const Shard& shard) const { return allocation == shard.allocation && packed == shard.packed; }
};

std::unique_ptr<RdmaTransport> make_rdma(std::vector<std::string> devices = {}) {
  RdmaOptions options;
  options.devices = std::move(devices);
  options.read_bytes = 256 << 10;
  return std::make_unique<RdmaTransport>(net::DataServerConfig{}, options);
}

net::PullOptions pull_options() {
  net::PullOptions options;
  options.io_timeout_ms = 10'000;
  options.stall_ms_max = 10'000;
  return options;
}

// A source and a reader on the default devices, the source granting `shard` under {1, 1}.
struct GrantedPair {
  std::unique_ptr<RdmaTransport> source = make_rdma();
  std::unique_ptr<RdmaTransport> reader = make_rdma();
  Shard shard;
  Target target{shard};
  std::vector<net::LocalRegion> regions = target.regions();
  explicit GrantedPair(std::uint64_t seed) : shard(seed) {
    source->grant({1, 1}, kSecret, shard.regions(), std::make_shared<net::Progress>(shard.total()));
  }
};

#define REQUIRE_DEVICE()                                                        \
  if (device_names().empty()) GTEST_SKIP() << "no RDMA device (run in tests/rdma/guest)"

TEST(RdmaPair, BitExactMixedSizesWithoutTheSourceCpu) {
  REQUIRE_DEVICE();
  GrantedPair pair(1);
  auto& [source, reader, shard, target, regions] = pair;
  std::uint64_t last = 0;
  auto options = pull_options();
  options.on_progress = [&](std::uint64_t ready) {
    EXPECT_GT(ready, last);
    last = ready;
  };
  const net::PullOutcome outcome = reader->pull(source->endpoint(), {1, 1}, kSecret, regions, options);
  ASSERT_TRUE(outcome.ok()) << outcome.detail;
  EXPECT_EQ(outcome.bytes, shard.total());
  EXPECT_EQ(last, shard.total());
  EXPECT_TRUE(target.equals(shard));
  EXPECT_EQ(reader->stats().pulls_rdma, 1u);
  EXPECT_EQ(reader->stats().pulls_tcp, 0u);
  EXPECT_EQ(source->stats().bytes_served, 0u) << "one-sided: the source's CPU sends no data";
  EXPECT_GE(source->stats().windows_bound, 1u);
}

TEST(RdmaPair, WrongSecretIsRefused) {
  REQUIRE_DEVICE();
  GrantedPair pair(2);
  auto& [source, reader, shard, target, regions] = pair;
  const GrantSecret wrong{kSecret[0], kSecret[1] ^ 1};
  const net::PullOutcome outcome = reader->pull(source->endpoint(), {1, 1}, wrong, regions, pull_options());
  EXPECT_EQ(outcome.error, net::ReadError::kRefused) << outcome.detail;
  EXPECT_EQ(outcome.bytes, 0u);
  EXPECT_EQ(source->stats().windows_bound, 0u);
}

TEST(RdmaPair, PipelineFromAPartialSource) {
  REQUIRE_DEVICE();
  auto source = make_rdma();
  auto reader = make_rdma();
  Shard shard(3);
  // The source's own copy arrives step by step (as if it were still receiving it).
  Shard arriving(3);
  std::fill(arriving.allocation.begin(), arriving.allocation.end(), std::byte{0});
  std::fill(arriving.packed.begin(), arriving.packed.end(), std::byte{0});
  auto progress = std::make_shared<net::Progress>(0);
  source->grant({1, 1}, kSecret, arriving.regions(), progress);
  std::thread writer([&] {
    const std::uint64_t step = 512 << 10;
    for (std::uint64_t done = 0; done < shard.total();) {
      const std::uint64_t next = std::min(shard.total(), done + step);
      // Layout order: the packed buffer, then the allocation.
      for (std::uint64_t at = done; at < next; ++at) {
        if (at < shard.packed.size()) {
          arriving.packed[at] = shard.packed[at];
        } else {
          arriving.allocation[at - shard.packed.size()] = shard.allocation[at - shard.packed.size()];
        }
      }
      progress->advance_to(next);
      done = next;
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  });
  Target target(shard);
  auto regions = target.regions();
  auto options = pull_options();
  options.partial = true;
  std::vector<std::uint64_t> seen;
  options.on_progress = [&](std::uint64_t ready) { seen.push_back(ready); };
  const net::PullOutcome outcome = reader->pull(source->endpoint(), {1, 1}, kSecret, regions, options);
  writer.join();
  ASSERT_TRUE(outcome.ok()) << outcome.detail;
  EXPECT_TRUE(target.equals(shard));
  ASSERT_FALSE(seen.empty());
  EXPECT_TRUE(std::is_sorted(seen.begin(), seen.end()));
  EXPECT_GT(seen.size(), 2u) << "the reader followed the source's progress, not only its end";
}

TEST(RdmaPair, RevokeCutsOffAReadAndNothingLandsAfterwards) {
  REQUIRE_DEVICE();
  GrantedPair pair(4);
  auto& [source, reader, shard, target, regions] = pair;
  auto options = pull_options();
  options.rate_bytes_per_s = 2 << 20;  // ~4 s for the shard: revoked well before the end
  std::uint64_t landed = 0;
  options.on_progress = [&](std::uint64_t ready) { landed = ready; };
  std::thread revoker([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(800));
    source->revoke({1, 1});
  });
  const net::PullOutcome outcome = reader->pull(source->endpoint(), {1, 1}, kSecret, regions, options);
  revoker.join();
  EXPECT_EQ(outcome.error, net::ReadError::kRefused) << outcome.detail;
  EXPECT_LT(outcome.bytes, shard.total());
  EXPECT_GT(source->stats().windows_invalidated, 0u);
  // What did not land by the time pull() returned never lands: the reader's memory is its own again.
  const auto snapshot = target.allocation;
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  EXPECT_EQ(snapshot, target.allocation);
  // And the grant stays closed to a late open.
  const net::PullOutcome late = reader->pull(source->endpoint(), {1, 1}, kSecret, regions, pull_options());
  EXPECT_EQ(late.error, net::ReadError::kRefused) << late.detail;
}

// Without the notice, the memory windows alone: once revoke() returned the source rewrites its
// memory, and none of the new bytes may reach the reader, however long it keeps reading.
TEST(RdmaPair, AfterRevokeNoReadSeesTheMemoryAgain) {
  REQUIRE_DEVICE();
  RdmaOptions quiet;
  quiet.read_bytes = 64 << 10;
  quiet.revoke_notices = false;
  auto source = std::make_unique<RdmaTransport>(net::DataServerConfig{}, quiet);
  auto reader = make_rdma();
  Shard shard(10);
  const Shard original(10);
  source->grant({1, 1}, kSecret, shard.regions(), std::make_shared<net::Progress>(shard.total()));
  Target target(shard);
  auto regions = target.regions();
  auto options = pull_options();
  options.io_timeout_ms = 3'000;
  options.rate_bytes_per_s = 2 << 20;
  std::thread revoker([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(800));
    source->revoke({1, 1});
    std::fill(shard.allocation.begin(), shard.allocation.end(), std::byte{0x5A});  // the owner's again
    std::fill(shard.packed.begin(), shard.packed.end(), std::byte{0x5A});
  });
  const net::PullOutcome outcome = reader->pull(source->endpoint(), {1, 1}, kSecret, regions, options);
  revoker.join();
  EXPECT_FALSE(outcome.ok());
  std::cout << "read after revoke without a notice: " << net::read_error_name(*outcome.error) << ": "
            << outcome.detail << "\n";
  std::uint64_t rewritten = 0;
  for (std::size_t i = 0; i < target.allocation.size(); ++i) {
    if (target.allocation[i] != original.allocation[i] && target.allocation[i] != std::byte{0xEE}) ++rewritten;
  }
  EXPECT_EQ(rewritten, 0u) << "bytes written by the owner after revoke() reached the reader";
}

// A peer that speaks the link protocol by hand: a hello (no secret needed) gets it a connected
// queue pair; it may then open grants, and READ whatever it likes through its queue pair.
struct RoguePeer {
  Device device{"", -1};
  CompletionQueue cq{device, 16};
  QueuePair qp{device, cq, 8, 1};
  net::Fd socket;
  std::vector<std::byte> landing = std::vector<std::byte>(4096, std::byte{0xEE});
  MemoryRegion landing_region{device, landing.data(), landing.size(), IBV_ACCESS_LOCAL_WRITE};

  explicit RoguePeer(const net::Endpoint& source) : socket(net::connect_tcp(source, 5'000)) {
    const QueuePairAddress local = qp.local_address(first_packet_sequence());
    Request hello;
    hello.qp_number = local.qp_number;
    hello.packet_sequence = local.packet_sequence;
    hello.lid = local.lid;
    hello.mtu = local.mtu;
    hello.gid = local.gid;
    net::send_all(socket, &hello, sizeof hello);
    HelloAnswer answer;
    net::recv_all(socket, &answer, sizeof answer);
    EXPECT_EQ(answer.status, Answer::kOk);
    qp.connect(local, {answer.qp_number, answer.packet_sequence, answer.lid, answer.mtu, answer.gid}, 14, 7);
  }
  // Asks to open a grant like a reader, without waiting for the answer.
  void send_open(net::GrantKey key, const GrantSecret& secret) {
    Request request;
    request.kind = Kind::kOpen;
    request.transfer = key.transfer;
    request.epoch = key.epoch;
    std::memcpy(request.gid.data(), secret.data(), sizeof secret);
    net::send_all(socket, &request, sizeof request);
  }
  // Opens a grant like a reader; returns its regions (empty when refused).
  std::vector<RemoteRegion> open(net::GrantKey key, const GrantSecret& secret) {
    send_open(key, secret);
    OpenAnswer answer;
    net::recv_all(socket, &answer, sizeof answer);
    std::vector<RemoteRegion> regions(answer.status == Answer::kOk ? answer.regions : 0);
    if (!regions.empty()) net::recv_all(socket, regions.data(), regions.size() * sizeof(RemoteRegion));
    return regions;
  }
  // One RDMA READ of `bytes` at (address, key); the completion's status.
  ibv_wc_status read(std::uint64_t address, std::uint32_t key, std::uint32_t bytes) {
    ibv_sge sge{reinterpret_cast<std::uintptr_t>(landing.data()), bytes, landing_region.get()->lkey};
    ibv_send_wr request{};
    ibv_send_wr* bad = nullptr;
    request.opcode = IBV_WR_RDMA_READ;
    request.send_flags = IBV_SEND_SIGNALED;
    request.sg_list = &sge;
    request.num_sge = 1;
    request.wr.rdma.remote_addr = address;
    request.wr.rdma.rkey = key;
    EXPECT_EQ(ibv_post_send(qp.get(), &request, &bad), 0);
    ibv_wc completion{};
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(3);
    while (cq.poll(&completion, 1) == 0) {
      // No answer at all (the source destroyed its queue pair): that is no success either.
      if (std::chrono::steady_clock::now() > deadline) return IBV_WC_RESP_TIMEOUT_ERR;
      cq.wait(20);
    }
    return completion.status;
  }
};

// The attacks a peer that reaches the data port can try, each refused: opening with a wrong secret,
// reading through a window bound to another reader's queue pair, reading through its own window
// once the grant is revoked.
TEST(RdmaPair, ARoguePeerReadsNothingItWasNotGranted) {
  REQUIRE_DEVICE();
  auto source = make_rdma();
  Shard shard(11);
  source->grant({1, 1}, kSecret, shard.regions(), std::make_shared<net::Progress>(shard.total()));
  const GrantSecret wrong{kSecret[0] ^ 1, kSecret[1]};
  RoguePeer rogue(source->endpoint());
  EXPECT_TRUE(rogue.open({1, 1}, wrong).empty()) << "a wrong secret opens nothing";
  // A reader opens the grant honestly; the rogue learns its window keys (as if it sniffed them).
  RoguePeer honest(source->endpoint());
  const std::vector<RemoteRegion> regions = honest.open({1, 1}, kSecret);
  ASSERT_EQ(regions.size(), shard.regions().size());
  const RemoteRegion& big = regions.back();
  EXPECT_EQ(honest.read(big.address, big.key, 4096), IBV_WC_SUCCESS);
  EXPECT_EQ(std::memcmp(honest.landing.data(), shard.allocation.data() + shard.allocation.size() - big.bytes, 4096), 0);
  EXPECT_EQ(rogue.read(big.address, big.key, 4096), IBV_WC_REM_ACCESS_ERR) << "the window is bound to the honest pair";
  EXPECT_EQ(rogue.landing[0], std::byte{0xEE});
  // After revoke, the honest reader's own window is dead too.
  source->revoke({1, 1});
  RoguePeer late(source->endpoint());
  EXPECT_TRUE(late.open({1, 1}, kSecret).empty()) << "a revoked grant opens nothing";
  std::fill(honest.landing.begin(), honest.landing.end(), std::byte{0xEE});
  EXPECT_NE(honest.read(big.address, big.key, 4096), IBV_WC_SUCCESS);
  EXPECT_EQ(honest.landing[0], std::byte{0xEE});
}

// Without memory windows (a device that has none, or they are turned off), the registration's key
// is handed out; revoke() tells the reader and cuts its link, and returns once the link's queue
// pair is destroyed: no byte the owner writes afterwards reaches the reader.
TEST(RdmaPair, WithoutWindowsRevokeCutsTheReaderOff) {
  REQUIRE_DEVICE();
  RdmaOptions no_windows;
  no_windows.devices = {device_names()[0]};
  no_windows.memory_windows = false;
  auto source = std::make_unique<RdmaTransport>(net::DataServerConfig{}, no_windows);
  auto reader = make_rdma({device_names()[0]});
  Shard shard(15);
  const Shard original(15);
  source->grant({1, 1}, kSecret, shard.regions(), std::make_shared<net::Progress>(shard.total()));
  Target target(shard);
  auto regions = target.regions();
  auto options = pull_options();
  options.rate_bytes_per_s = 2 << 20;
  std::thread revoker([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(800));
    source->revoke({1, 1});
    std::fill(shard.allocation.begin(), shard.allocation.end(), std::byte{0x5A});  // the owner's again
  });
  const net::PullOutcome outcome = reader->pull(source->endpoint(), {1, 1}, kSecret, regions, options);
  revoker.join();
  EXPECT_EQ(outcome.error, net::ReadError::kRefused) << outcome.detail << " (the notice comes before the cut)";
  EXPECT_EQ(source->stats().windows_bound, 0u);
  for (std::size_t i = 0; i < target.allocation.size(); ++i) {
    ASSERT_TRUE(target.allocation[i] == original.allocation[i] || target.allocation[i] == std::byte{0xEE}) << i;
  }
}

// A grant of two regions of one allocation with a gap between them: each region gets a window of
// its own, and no window covers the gap (one over the registration would expose memory the grant
// does not: the other tensors of the allocation). The window geometry is what is checked: rxe of
// kernel 6.1 checks a READ against the window's registration, not the window's own bounds, so a
// read of the gap through a window succeeds there (real NICs refuse it); the test says which.
TEST(RdmaPair, NoWindowCoversTheGapBetweenAGrantsRegions) {
  REQUIRE_DEVICE();
  auto source = make_rdma({device_names()[0]});
  std::vector<std::byte> allocation = pattern(192 << 10, 16);
  const auto lease = source->lease_memory(allocation.data(), allocation.size(), false);  // one registration
  source->grant({1, 1}, kSecret, {{allocation.data(), 64 << 10}, {allocation.data() + (128 << 10), 64 << 10}},
                std::make_shared<net::Progress>(128 << 10));
  RoguePeer reader(source->endpoint());
  const std::vector<RemoteRegion> regions = reader.open({1, 1}, kSecret);
  ASSERT_EQ(regions.size(), 2u);
  EXPECT_EQ(source->stats().windows_bound, 2u) << "a window per contiguous span, not one per registration";
  EXPECT_NE(regions[0].key, regions[1].key);
  for (const RemoteRegion& region : regions) {
    EXPECT_EQ(reader.read(region.address, region.key, 4096), IBV_WC_SUCCESS);
    EXPECT_EQ(std::memcmp(reader.landing.data(), reinterpret_cast<const std::byte*>(region.address), 4096), 0);
  }
  std::fill(reader.landing.begin(), reader.landing.end(), std::byte{0xEE});
  const ibv_wc_status gap = reader.read(regions[0].address + (64 << 10), regions[0].key, 4096);
  std::cout << "a read of the gap through region 0's window: " << ibv_wc_status_str(gap)
            << (gap == IBV_WC_SUCCESS ? " (this device does not check a window's bounds)" : "") << "\n";
}

// Anyone who reaches the data port can ask to open grants that do not exist; each such open waits
// a while for its grant, busy, so it cannot be shed. Those waits are capped (grant_waiters_max),
// so such peers cannot hold every slot: an honest reader still gets one (an idle peer is shed).
TEST(RdmaPair, OpensOfGrantsThatNeverComeDoNotLockReadersOut) {
  REQUIRE_DEVICE();
  net::DataServerConfig small;
  small.connections_max = 24;
  small.grant_waiters_max = 8;
  RdmaOptions options;
  options.devices = {device_names()[0]};
  auto source = std::make_unique<RdmaTransport>(small, options);
  auto reader = make_rdma({device_names()[0]});
  std::vector<std::unique_ptr<RoguePeer>> squatters;
  for (std::uint32_t i = 0; i < small.connections_max; ++i) {
    squatters.push_back(std::make_unique<RoguePeer>(source->endpoint()));
    squatters.back()->send_open({9'000 + i, 1}, kSecret);  // no such grant: waits, or is refused
  }
  Shard shard(17);
  source->grant({1, 1}, kSecret, shard.regions(), std::make_shared<net::Progress>(shard.total()));
  Target target(shard);
  auto regions = target.regions();
  const net::PullOutcome outcome = reader->pull(source->endpoint(), {1, 1}, kSecret, regions, pull_options());
  ASSERT_TRUE(outcome.ok()) << outcome.detail;
  EXPECT_TRUE(target.equals(shard));
}

TEST(RdmaPair, RegistrationsAreMadeOncePerAllocationNotPerVersion) {
  REQUIRE_DEVICE();
  auto source = make_rdma({device_names()[0]});
  auto reader = make_rdma({device_names()[0]});
  Shard shard(5);
  Target target(shard);
  // The owners lend their allocations (libthclient does so per registered tensor and buffer).
  std::vector<std::shared_ptr<void>> leases;
  std::uint64_t at = 0;
  for (auto size : shard.sizes) {  // tensor by tensor: adjacent leases make one run
    leases.push_back(source->lease_memory(shard.allocation.data() + at, size, false));
    leases.push_back(reader->lease_memory(target.allocation.data() + at, size, false));
    at += size;
  }
  leases.push_back(source->lease_memory(shard.packed.data(), shard.packed.size(), false));
  leases.push_back(reader->lease_memory(target.packed.data(), target.packed.size(), false));
  auto regions = target.regions();
  std::uint64_t source_after_first = 0;
  std::uint64_t reader_after_first = 0;
  for (std::uint32_t version = 1; version <= 4; ++version) {
    source->grant({version, 1}, kSecret, shard.regions(), std::make_shared<net::Progress>(shard.total()));
    const net::PullOutcome outcome = reader->pull(source->endpoint(), {version, 1}, kSecret, regions, pull_options());
    ASSERT_TRUE(outcome.ok()) << outcome.detail;
    source->revoke({version, 1});
    if (version == 1) {
      source_after_first = source->stats().memory_registrations;
      reader_after_first = reader->stats().memory_registrations;
    }
  }
  EXPECT_TRUE(target.equals(shard));
  EXPECT_EQ(source->stats().memory_registrations, source_after_first);
  EXPECT_EQ(reader->stats().memory_registrations, reader_after_first);
  // The progress table, the allocation's run, the packed buffer (and, at the reader, its link's word).
  EXPECT_EQ(source_after_first, 3u);
  EXPECT_EQ(reader_after_first, 4u);
  EXPECT_EQ(reader->stats().pulls_rdma, 4u);
  EXPECT_GE(source->stats().windows_bound, 4u) << "a window per grant";
}

// Two devices at each end (rail i to rail i): a big version is read over both at once, each rail
// its own part, and still registered once per allocation and device.
TEST(RdmaPair, ABigReadIsStripedOverTwoDevices) {
  REQUIRE_DEVICE();
  if (device_names().size() < 2) GTEST_SKIP() << "one RDMA device";
  auto source = make_rdma({device_names()[0], device_names()[1]});
  auto reader = make_rdma({device_names()[0], device_names()[1]});
  Shard shard(12, {(11u << 20) + 3, 777, (9u << 20) + 1});  // 20 MiB: above stripe_bytes_min
  Target target(shard);
  std::vector<std::shared_ptr<void>> leases{source->lease_memory(shard.allocation.data(), shard.allocation.size(), false),
                                            source->lease_memory(shard.packed.data(), shard.packed.size(), false),
                                            reader->lease_memory(target.allocation.data(), target.allocation.size(), false),
                                            reader->lease_memory(target.packed.data(), target.packed.size(), false)};
  auto regions = target.regions();
  std::uint64_t registrations_after_first = 0;
  for (std::uint32_t version = 1; version <= 3; ++version) {
    std::fill(target.allocation.begin(), target.allocation.end(), std::byte{0xEE});
    source->grant({version, 1}, kSecret, shard.regions(), std::make_shared<net::Progress>(shard.total()));
    std::vector<std::uint64_t> seen;
    auto options = pull_options();
    options.on_progress = [&](std::uint64_t ready) { seen.push_back(ready); };
    const net::PullOutcome outcome = reader->pull(source->endpoint(), {version, 1}, kSecret, regions, options);
    source->revoke({version, 1});
    ASSERT_TRUE(outcome.ok()) << outcome.detail;
    EXPECT_EQ(outcome.bytes, shard.total());
    EXPECT_TRUE(target.equals(shard));
    ASSERT_FALSE(seen.empty());
    EXPECT_TRUE(std::is_sorted(seen.begin(), seen.end()));
    EXPECT_EQ(seen.back(), shard.total()) << "the prefix reported covers every rail at the end";
    if (version == 1) registrations_after_first = reader->stats().memory_registrations;
  }
  const net::TransportStats stats = reader->stats();
  EXPECT_EQ(stats.pulls_striped, 3u);
  ASSERT_EQ(stats.bytes_read_per_device.size(), 2u);
  EXPECT_GT(stats.bytes_read_per_device[0], shard.total());  // about half of each of 3 versions
  EXPECT_GT(stats.bytes_read_per_device[1], shard.total());
  EXPECT_EQ(stats.bytes_read_per_device[0] + stats.bytes_read_per_device[1], 3 * shard.total());
  EXPECT_EQ(stats.memory_registrations, registrations_after_first);
}

// Rail 1 of the reader (rxe1) meets the source's rail 1, which is rxe0 here: rxe devices of one
// kernel do not reach each other, as when a rail-optimised network's rails do not meet. That rail
// fails alone; rail 0 reads its part, and the next pull leaves the rail out.
TEST(RdmaPair, ARailWhoseDevicesDoNotMeetIsLeftOutAndRailZeroReadsItsPart) {
  REQUIRE_DEVICE();
  if (device_names().size() < 2) GTEST_SKIP() << "one RDMA device";
  auto source = make_rdma({device_names()[0], device_names()[0]});
  auto reader = make_rdma({device_names()[0], device_names()[1]});
  Shard shard(14, {(11u << 20) + 3, 777, (9u << 20) + 1});
  Target target(shard);
  auto regions = target.regions();
  for (std::uint32_t version = 1; version <= 2; ++version) {
    std::fill(target.allocation.begin(), target.allocation.end(), std::byte{0xEE});
    source->grant({version, 1}, kSecret, shard.regions(), std::make_shared<net::Progress>(shard.total()));
    auto options = pull_options();
    options.io_timeout_ms = 2'000;
    std::uint64_t last = 0;
    options.on_progress = [&](std::uint64_t ready) {
      EXPECT_GE(ready, last);
      last = ready;
    };
    const net::PullOutcome outcome = reader->pull(source->endpoint(), {version, 1}, kSecret, regions, options);
    source->revoke({version, 1});
    ASSERT_TRUE(outcome.ok()) << "version " << version << ": " << outcome.detail;
    EXPECT_EQ(outcome.bytes, shard.total());
    EXPECT_EQ(last, shard.total());
    EXPECT_TRUE(target.equals(shard));
  }
  const net::TransportStats stats = reader->stats();
  EXPECT_EQ(stats.pulls_rdma, 2u);
  EXPECT_EQ(stats.pulls_striped, 1u) << "the first pull was striped; the second left rail 1 out";
  EXPECT_EQ(stats.bytes_read_per_device[1], 0u) << "nothing came through rail 1";
  EXPECT_EQ(stats.bytes_read_per_device[0], 2 * shard.total());
}

// A kept link the source has closed meanwhile (idle too long) is found closed and dialled anew.
TEST(RdmaPair, ALinkTheSourceShedIsDialledAgain) {
  REQUIRE_DEVICE();
  RdmaOptions impatient;
  impatient.devices = {device_names()[0]};
  impatient.link_idle_timeout_ms = 200;
  auto source = std::make_unique<RdmaTransport>(net::DataServerConfig{}, impatient);
  auto reader = make_rdma({device_names()[0]});
  Shard shard(13);
  Target target(shard);
  auto regions = target.regions();
  for (std::uint32_t version = 1; version <= 2; ++version) {
    source->grant({version, 1}, kSecret, shard.regions(), std::make_shared<net::Progress>(shard.total()));
    const net::PullOutcome outcome = reader->pull(source->endpoint(), {version, 1}, kSecret, regions, pull_options());
    source->revoke({version, 1});
    ASSERT_TRUE(outcome.ok()) << "version " << version << ": " << outcome.detail;
    EXPECT_TRUE(target.equals(shard));
    std::this_thread::sleep_for(std::chrono::milliseconds(2'500));  // the source sheds the idle link
  }
  EXPECT_EQ(reader->stats().pulls_rdma, 2u);
}

TEST(RdmaPair, FallsBackToTcpWhenTheSourceHasNoRdma) {
  REQUIRE_DEVICE();
  net::TcpTransport source(net::DataServerConfig{});
  auto reader = make_rdma();
  Shard shard(6);
  source.grant({1, 1}, kSecret, shard.regions(), std::make_shared<net::Progress>(shard.total()));
  Target target(shard);
  auto regions = target.regions();
  const net::PullOutcome outcome = reader->pull(source.endpoint(), {1, 1}, kSecret, regions, pull_options());
  ASSERT_TRUE(outcome.ok()) << outcome.detail;
  EXPECT_TRUE(target.equals(shard));
  EXPECT_EQ(reader->stats().pulls_fell_back, 1u);
  EXPECT_EQ(reader->stats().pulls_rdma, 0u);
  EXPECT_EQ(source.stats().bytes_served, shard.total());
}

TEST(RdmaPair, ATcpReaderPullsFromAnRdmaSource) {
  REQUIRE_DEVICE();
  auto source = make_rdma();
  net::TcpTransport reader(net::DataServerConfig{});
  Shard shard(7);
  source->grant({1, 1}, kSecret, shard.regions(), std::make_shared<net::Progress>(shard.total()));
  Target target(shard);
  auto regions = target.regions();
  const net::PullOutcome outcome = reader.pull(source->endpoint(), {1, 1}, kSecret, regions, pull_options());
  ASSERT_TRUE(outcome.ok()) << outcome.detail;
  EXPECT_TRUE(target.equals(shard));
  EXPECT_EQ(source->stats().bytes_served, shard.total());
}

// A device named by the user, not the first one. (Both ends on it: rxe devices of one kernel do not
// reach each other, since a packet to a local address goes over lo, where no rxe listens.)
TEST(RdmaPair, ANamedDeviceOtherThanTheFirst) {
  REQUIRE_DEVICE();
  if (device_names().size() < 2) GTEST_SKIP() << "one RDMA device";
  auto source = make_rdma({device_names()[1]});
  auto reader = make_rdma({device_names()[1]});
  EXPECT_EQ(reader->device_names(), device_names()[1]);
  Shard shard(8);
  source->grant({1, 1}, kSecret, shard.regions(), std::make_shared<net::Progress>(shard.total()));
  Target target(shard);
  auto regions = target.regions();
  const net::PullOutcome outcome = reader->pull(source->endpoint(), {1, 1}, kSecret, regions, pull_options());
  ASSERT_TRUE(outcome.ok()) << outcome.detail;
  EXPECT_TRUE(target.equals(shard));
  EXPECT_EQ(reader->stats().pulls_rdma, 1u);
}

// A source in a child process (this binary with --serve), so that it can be killed with SIGKILL.
struct ChildSource {
  pid_t pid = -1;
  net::Endpoint endpoint;
  explicit ChildSource(std::uint64_t seed) {
    int pipe_fds[2];
    EXPECT_EQ(::pipe(pipe_fds), 0);
    pid = ::fork();
    if (pid == 0) {
      ::dup2(pipe_fds[1], STDOUT_FILENO);
      ::close(pipe_fds[0]);
      const std::string seed_text = std::to_string(seed);
      ::execl("/proc/self/exe", "th-rdma-test", "--serve", seed_text.c_str(), nullptr);
      ::_exit(127);
    }
    ::close(pipe_fds[1]);
    char line[128] = {};
    std::size_t got = 0;
    while (got < sizeof line - 1) {
      const ssize_t n = ::read(pipe_fds[0], line + got, 1);
      if (n <= 0 || line[got] == '\n') break;
      got += static_cast<std::size_t>(n);
    }
    line[got] = '\0';
    ::close(pipe_fds[0]);
    endpoint = net::parse_endpoint(line);
  }
  void kill() {
    if (pid > 0) {
      ::kill(pid, SIGKILL);
      ::waitpid(pid, nullptr, 0);
      pid = -1;
    }
  }
  ~ChildSource() { kill(); }
};

TEST(RdmaPair, SourceKilledMidReadThenAnotherSourceFinishesBitExact) {
  REQUIRE_DEVICE();
  Shard shard(9);  // the child serves the same bytes (Shard(9)) under {1, 1}
  ChildSource doomed(9);
  auto reader = make_rdma();
  Target target(shard);
  auto regions = target.regions();
  auto options = pull_options();
  options.rate_bytes_per_s = 2 << 20;
  std::thread killer([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(800));
    doomed.kill();
  });
  const auto began = std::chrono::steady_clock::now();
  const net::PullOutcome outcome = reader->pull(doomed.endpoint, {1, 1}, kSecret, regions, options);
  killer.join();
  EXPECT_FALSE(outcome.ok());
  EXPECT_EQ(outcome.error, net::ReadError::kUnreachable) << outcome.detail;
  EXPECT_LT(std::chrono::steady_clock::now() - began, std::chrono::seconds(5)) << "the reader noticed the death";
  std::cout << "killed source: the read failed after "
            << std::chrono::duration<double>(std::chrono::steady_clock::now() - began).count() << " s: "
            << outcome.detail << "\n";
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  const auto snapshot = target.allocation;  // nothing lands after pull() returned
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  EXPECT_EQ(snapshot, target.allocation);
  // The hub would now name another source; the reader finishes from it.
  auto other = make_rdma();
  other->grant({2, 1}, kSecret, shard.regions(), std::make_shared<net::Progress>(shard.total()));
  const net::PullOutcome finished = reader->pull(other->endpoint(), {2, 1}, kSecret, regions, pull_options());
  ASSERT_TRUE(finished.ok()) << finished.detail;
  EXPECT_TRUE(target.equals(shard));
}

int serve_forever(std::uint64_t seed) {
  auto source = make_rdma();
  Shard shard(seed);
  source->grant({1, 1}, kSecret, shard.regions(), std::make_shared<net::Progress>(shard.total()));
  std::printf("%s\n", source->endpoint().to_string().c_str());
  std::fflush(stdout);
  for (;;) std::this_thread::sleep_for(std::chrono::seconds(1));
}

}  // namespace
}  // namespace th::rdma

int main(int argc, char** argv) {
  if (argc == 3 && std::string(argv[1]) == "--serve") return th::rdma::serve_forever(std::stoull(argv[2]));
  testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
