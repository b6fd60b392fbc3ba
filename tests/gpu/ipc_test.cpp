// Same host, GPU to GPU over CUDA IPC (net/ipc.h), on the CPU: "device memory" is host memory, the
// fake exporter's handle names an allocation by its address and the fake importer maps it back, in
// one process (the fakes claim two processes). A pull over IPC must deliver every byte without a
// payload byte over TCP; every case IPC cannot serve (refused, another host, a partial source, a
// handle that will not open, a region that cannot be exported) must fall back to TCP and still
// deliver; a grant revoked while its memory was copied fails the read; the reader's mapping cache
// stays bounded.
#include <gtest/gtest.h>

#include <atomic>
#include <cstring>
#include <map>
#include <mutex>
#include <set>

#include "net/data_plane.h"
#include "net/ipc.h"
#include "net/staging.h"
#include "tests/net/test_bytes.h"

namespace th::net {
namespace {

constexpr GrantSecret kSecret{0x1bc5ec, 0x7e57};
constexpr GrantSecret kWrongSecret{0x1bc5ec, 0x7e58};
constexpr std::uint64_t kSourceProcess = 1001;
constexpr std::uint64_t kReaderProcess = 1002;
const std::string kHost = "boot-id-of-this-fake-host pid:[1]";

using testing_bytes::pattern;

// ---- Fakes -----------------------------------------------------------------------------------------

// Copies at once: the staging ring's logic has its own test (staging_test).
class InstantLane final : public CopyLane {
 public:
  Ticket to_host(std::byte* host, const std::byte* device, std::uint64_t bytes) override {
    std::memcpy(host, device, bytes);
    return next_++;
  }
  Ticket to_device(std::byte* device, const std::byte* host, std::uint64_t bytes) override {
    std::memcpy(device, host, bytes);
    return next_++;
  }
  void wait(Ticket) override {}

 private:
  Ticket next_ = 0;
};

class InstantStaging final : public StagingProvider {
 public:
  std::unique_ptr<CopyLane> make_lane() override { return std::make_unique<InstantLane>(); }
  std::shared_ptr<std::byte[]> allocate_pinned(std::uint64_t bytes) override {
    return std::make_shared<std::byte[]>(bytes);
  }
};

std::shared_ptr<StagingPool> staging() {
  return std::make_shared<StagingPool>(std::make_shared<InstantStaging>(), StagingConfig{2, 64 << 10, 8, 10'000});
}

// A handle: the allocation's address and size, then zeros.
IpcHandleBytes handle_of(const std::byte* base, std::uint64_t bytes) {
  IpcHandleBytes handle{};
  const auto address = reinterpret_cast<std::uintptr_t>(base);
  std::memcpy(handle.data(), &address, sizeof address);
  std::memcpy(handle.data() + 8, &bytes, sizeof bytes);
  return handle;
}

// "Device memory" of the source: allocations (as cudaMalloc makes them), with regions inside.
class FakeExporter final : public IpcExporter {
 public:
  std::byte* allocate(std::vector<std::byte> bytes) {
    std::lock_guard lock(mutex_);
    allocations_.push_back(std::move(bytes));
    return allocations_.back().data();
  }
  std::optional<IpcExport> export_region(const std::byte* base, std::uint64_t bytes) override {
    std::lock_guard lock(mutex_);
    ++exports;
    for (const std::vector<std::byte>& allocation : allocations_) {
      const std::byte* begin = allocation.data();
      if (base < begin || base + bytes > begin + allocation.size()) continue;
      if (unexportable.contains(begin)) return std::nullopt;  // a cudaMallocAsync pool, say
      if (lie_about_place) {
        // A lying (or broken) source: its handle maps the real allocation, but it places the
        // region far beyond it and claims an allocation big enough to hold it there.
        return IpcExport{handle_of(begin, allocation.size()), static_cast<std::uint64_t>(base - begin) + (1ull << 40),
                         ~0ull};
      }
      return IpcExport{handle_of(begin, allocation.size()), static_cast<std::uint64_t>(base - begin), allocation.size()};
    }
    return std::nullopt;
  }
  std::string host_identity() override { return kHost; }
  std::uint64_t process_identity() override { return kSourceProcess; }

  std::set<const std::byte*> unexportable;  // set before the pull
  bool lie_about_place = false;             // set before the pull
  std::uint64_t exports = 0;                // guarded by mutex_

 private:
  std::mutex mutex_;
  std::list<std::vector<std::byte>> allocations_;  // stable addresses
};

class FakeImporter final : public CachingIpcImporter {
 public:
  explicit FakeImporter(std::size_t mappings_max = kMappingsMaxDefault) : CachingIpcImporter(mappings_max) {}
  ~FakeImporter() override { close_all(); }

  void copy(std::byte* to_device, const std::byte* from_device, std::uint64_t bytes) override {
    ++copies;
    if (before_copy) before_copy(copies);
    if (fail_copy_number == copies) throw DeviceCopyError("fake: the copy failed");
    std::memcpy(to_device, from_device, bytes);
  }
  std::string host_identity() override { return host; }
  std::uint64_t process_identity() override { return process; }

  std::string host = kHost;
  std::uint64_t process = kReaderProcess;
  bool fail_open = false;
  int fail_copy_number = -1;              // that copy (from 1) throws
  std::function<void(int copy)> before_copy;
  int copies = 0;
  int opens = 0;
  int closes = 0;
  std::set<std::uintptr_t> open_now;  // mapped allocations

 protected:
  IpcMapping open_mapping(const IpcHandleBytes& handle) override {
    if (fail_open) return {};
    ++opens;
    std::uintptr_t address = 0;
    std::uint64_t bytes = 0;
    std::memcpy(&address, handle.data(), sizeof address);
    std::memcpy(&bytes, handle.data() + 8, sizeof bytes);
    EXPECT_TRUE(open_now.insert(address).second) << "an allocation mapped twice";
    return {reinterpret_cast<std::byte*>(address), bytes};
  }
  void close_mapping(std::byte* base) override {
    ++closes;
    EXPECT_EQ(open_now.erase(reinterpret_cast<std::uintptr_t>(base)), 1u) << "closed what was not open";
  }
};

// ---- A source and a reader -------------------------------------------------------------------------

struct Region {
  std::vector<std::byte> expected;
  const std::byte* at = nullptr;  // in the source's memory
  bool on_device = true;
};

struct Source {
  std::shared_ptr<FakeExporter> exporter = std::make_shared<FakeExporter>();
  std::list<std::vector<std::byte>> host_memory;
  std::vector<Region> regions;

  // Device regions `sizes`, placed one after another (with a gap) in one allocation.
  std::vector<std::byte*> allocation_with(std::vector<std::uint64_t> sizes, std::uint64_t seed) {
    std::uint64_t total = 64;  // the first region does not start at the allocation's base
    for (std::uint64_t size : sizes) total += size + 32;
    std::byte* base = exporter->allocate(pattern(total, seed));
    std::vector<std::byte*> placed;
    std::uint64_t at = 64;
    for (std::uint64_t size : sizes) {
      std::vector<std::byte> bytes = pattern(size, seed * 31 + at);
      std::memcpy(base + at, bytes.data(), size);
      regions.push_back({std::move(bytes), base + at, true});
      placed.push_back(base + at);
      at += size + 32;
    }
    return placed;
  }
  void host_region(std::uint64_t size, std::uint64_t seed) {
    host_memory.push_back(pattern(size, seed));
    regions.push_back({host_memory.back(), host_memory.back().data(), false});
  }
  std::vector<ExposedRegion> exposed() const {
    std::vector<ExposedRegion> out;
    for (const Region& region : regions) out.push_back({region.at, region.expected.size(), region.on_device});
    return out;
  }
  std::uint64_t total() const {
    std::uint64_t bytes = 0;
    for (const Region& region : regions) bytes += region.expected.size();
    return bytes;
  }
  std::uint64_t device_bytes() const {
    std::uint64_t bytes = 0;
    for (const Region& region : regions) bytes += region.on_device ? region.expected.size() : 0;
    return bytes;
  }
};

// A typical shard: a packed host region, device tensors in two allocations, an empty one.
Source typical_source() {
  Source source;
  source.host_region(5000, 1);
  source.allocation_with({3 << 20, 777, 0}, 2);
  source.allocation_with({(1 << 20) + 5}, 3);
  return source;
}

DataServerConfig server_config(const Source& source, bool with_exporter = true) {
  DataServerConfig config;
  config.staging = staging();
  if (with_exporter) config.ipc = source.exporter;
  config.log = [](const std::string&) {};
  config.grant_wait_ms_max = 0;  // these tests grant before they read
  return config;
}

void grant_complete(DataServer& server, const Source& source, GrantKey key) {
  server.grant(key, kSecret, source.exposed(), std::make_shared<Progress>(source.total()));
}

struct Reader {
  std::vector<std::vector<std::byte>> buffers;
  std::vector<bool> on_device;
  explicit Reader(const Source& like) {
    for (const Region& region : like.regions) {
      buffers.emplace_back(region.expected.size(), std::byte{0xEE});
      on_device.push_back(region.on_device);
    }
  }
  std::vector<LocalRegion> targets() {
    std::vector<LocalRegion> out;
    for (std::size_t i = 0; i < buffers.size(); ++i) out.push_back({buffers[i].data(), buffers[i].size(), on_device[i]});
    return out;
  }
  void expect_holds(const Source& source) const {
    for (std::size_t i = 0; i < buffers.size(); ++i) EXPECT_EQ(buffers[i], source.regions[i].expected) << "region " << i;
  }
};

PullOptions reader_options(std::shared_ptr<IpcImporter> importer) {
  PullOptions options;
  options.chunk_bytes = 256 << 10;
  options.io_timeout_ms = 10'000;
  options.staging = staging();
  options.ipc = std::move(importer);
  return options;
}

// Pulls `source` from `server` and checks every byte and a progress that only grows to the end.
PullOutcome pull_and_check(const DataServer& server, const Source& source, GrantKey key, PullOptions options) {
  Reader reader(source);
  std::uint64_t last_progress = 0;
  options.on_progress = [&](std::uint64_t ready) {
    EXPECT_GT(ready, last_progress);
    EXPECT_LE(ready, source.total());
    last_progress = ready;
  };
  const std::vector<LocalRegion> targets = reader.targets();
  PullOutcome outcome = pull(server.endpoint(), key, kSecret, targets, options);
  if (outcome.ok()) {
    reader.expect_holds(source);
    EXPECT_EQ(outcome.bytes, source.total());
    EXPECT_EQ(last_progress, source.total());
  }
  return outcome;
}

// One raw request for the handles of regions [first, +count).
IpcAnswerFrame ask(const DataServer& server, GrantKey key, const GrantSecret& secret, std::uint32_t first,
                   std::uint32_t count, std::vector<IpcRegionRecord>* records = nullptr) {
  Fd connection = connect_tcp(server.endpoint(), 5'000);
  set_io_timeout(connection, 5'000);
  const IpcRequestFrame request{kIpcMagic, key.epoch, key.transfer, first, count, {0, 0}, secret};
  send_all(connection, &request, sizeof request);
  IpcAnswerFrame answer;
  recv_all(connection, &answer, sizeof answer);
  if (records != nullptr) {
    records->resize(answer.count);
    recv_all(connection, records->data(), records->size() * sizeof(IpcRegionRecord));
  }
  return answer;
}

// ---- Pulls -----------------------------------------------------------------------------------------

TEST(IpcPull, GpuToGpuSendsNoPayloadOverTcp) {
  Source source;
  source.allocation_with({3 << 20, 777, 0, 4096}, 1);
  source.allocation_with({(1 << 20) + 5}, 2);
  DataServer server(server_config(source));
  grant_complete(server, source, {7, 1});
  auto importer = std::make_shared<FakeImporter>();
  const PullOutcome outcome = pull_and_check(server, source, {7, 1}, reader_options(importer));
  ASSERT_TRUE(outcome.ok()) << outcome.detail;
  EXPECT_EQ(outcome.bytes_over_ipc, source.total());
  EXPECT_TRUE(outcome.ipc_fallback.empty()) << outcome.ipc_fallback;
  EXPECT_EQ(server.stats().bytes_served, 0u) << "no payload over TCP";
  EXPECT_EQ(server.stats().ipc_answers, 1u);
  EXPECT_EQ(importer->opens, 2) << "one mapping per allocation, not per region";
  EXPECT_EQ(importer->copies, 4) << "the empty region is not copied";

  // The next version from the same allocations opens nothing new.
  server.revoke({7, 1});
  grant_complete(server, source, {8, 1});
  ASSERT_TRUE(pull_and_check(server, source, {8, 1}, reader_options(importer)).ok());
  EXPECT_EQ(importer->opens, 2);
  EXPECT_EQ(importer->closes, 0);
}

TEST(IpcPull, MixedGrantArrivesWhole) {
  Source source = typical_source();
  source.host_region(3000, 9);  // a host region after device ones, too
  DataServer server(server_config(source));
  grant_complete(server, source, {7, 1});
  auto importer = std::make_shared<FakeImporter>();
  PullOptions options = reader_options(importer);
  options.streams = 3;
  const PullOutcome outcome = pull_and_check(server, source, {7, 1}, options);
  ASSERT_TRUE(outcome.ok()) << outcome.detail;
  EXPECT_EQ(outcome.bytes_over_ipc, source.device_bytes());
  EXPECT_EQ(server.stats().bytes_served, source.total() - source.device_bytes()) << "only the host regions";
}

TEST(IpcPull, AWrongSecretIsRefusedAndTheReadFailsAsOverTcp) {
  Source source = typical_source();
  DataServer server(server_config(source));
  grant_complete(server, source, {7, 1});
  auto importer = std::make_shared<FakeImporter>();
  Reader reader(source);
  const std::vector<LocalRegion> targets = reader.targets();
  const PullOutcome outcome = pull(server.endpoint(), {7, 1}, kWrongSecret, targets, reader_options(importer));
  ASSERT_FALSE(outcome.ok());
  EXPECT_EQ(*outcome.error, ReadError::kRefused);
  EXPECT_NE(outcome.ipc_fallback.find("no grant"), std::string::npos) << outcome.ipc_fallback;
  EXPECT_EQ(outcome.bytes_over_ipc, 0u);
  EXPECT_EQ(importer->opens, 0);
  EXPECT_EQ(server.stats().ipc_answers, 0u);
  EXPECT_GE(server.stats().reads_refused, 2u) << "the handle request and the TCP read";
}

TEST(IpcPull, AnotherHostUsesTcp) {
  Source source = typical_source();
  DataServer server(server_config(source));
  grant_complete(server, source, {7, 1});
  auto importer = std::make_shared<FakeImporter>();
  importer->host = "another boot id pid:[1]";
  const PullOutcome outcome = pull_and_check(server, source, {7, 1}, reader_options(importer));
  ASSERT_TRUE(outcome.ok()) << outcome.detail;
  EXPECT_EQ(outcome.bytes_over_ipc, 0u);
  EXPECT_NE(outcome.ipc_fallback.find("another host"), std::string::npos) << outcome.ipc_fallback;
  EXPECT_EQ(server.stats().bytes_served, source.total());
  EXPECT_EQ(importer->opens, 0);
}

TEST(IpcPull, TheSameProcessUsesTcp) {
  Source source = typical_source();
  DataServer server(server_config(source));
  grant_complete(server, source, {7, 1});
  auto importer = std::make_shared<FakeImporter>();
  importer->process = kSourceProcess;  // CUDA cannot open a handle in the process that exported it
  const PullOutcome outcome = pull_and_check(server, source, {7, 1}, reader_options(importer));
  ASSERT_TRUE(outcome.ok()) << outcome.detail;
  EXPECT_EQ(outcome.bytes_over_ipc, 0u);
  EXPECT_NE(outcome.ipc_fallback.find("this process"), std::string::npos) << outcome.ipc_fallback;
  EXPECT_EQ(importer->opens, 0);
}

TEST(IpcPull, APartialSourceUsesTcp) {
  Source source = typical_source();
  DataServer server(server_config(source));
  // The reader knows it is partial: it does not ask.
  server.grant({7, 1}, kSecret, source.exposed(), std::make_shared<Progress>(source.total()));
  auto importer = std::make_shared<FakeImporter>();
  PullOptions options = reader_options(importer);
  options.partial = true;
  const PullOutcome outcome = pull_and_check(server, source, {7, 1}, options);
  ASSERT_TRUE(outcome.ok()) << outcome.detail;
  EXPECT_EQ(outcome.bytes_over_ipc, 0u);
  EXPECT_EQ(server.stats().ipc_answers, 0u);
  EXPECT_EQ(server.stats().bytes_served, source.total());

  // A source still receiving answers "unsupported", whatever the reader thinks.
  server.grant({8, 1}, kSecret, source.exposed(), std::make_shared<Progress>(source.total() - 1));
  EXPECT_EQ(ask(server, {8, 1}, kSecret, 0, 1).status, kIpcUnsupported);
  EXPECT_EQ(server.stats().ipc_answers, 0u);
}

TEST(IpcPull, AServerWithoutAnExporterUsesTcp) {
  Source source = typical_source();
  DataServer server(server_config(source, /*with_exporter=*/false));
  grant_complete(server, source, {7, 1});
  const PullOutcome outcome = pull_and_check(server, source, {7, 1}, reader_options(std::make_shared<FakeImporter>()));
  ASSERT_TRUE(outcome.ok()) << outcome.detail;
  EXPECT_EQ(outcome.bytes_over_ipc, 0u);
  EXPECT_NE(outcome.ipc_fallback.find("does not export"), std::string::npos) << outcome.ipc_fallback;
}

TEST(IpcPull, AHandleThatWillNotOpenUsesTcp) {
  Source source = typical_source();
  DataServer server(server_config(source));
  grant_complete(server, source, {7, 1});
  auto importer = std::make_shared<FakeImporter>();
  importer->fail_open = true;
  const PullOutcome outcome = pull_and_check(server, source, {7, 1}, reader_options(importer));
  ASSERT_TRUE(outcome.ok()) << outcome.detail;
  EXPECT_EQ(outcome.bytes_over_ipc, 0u);
  EXPECT_NE(outcome.ipc_fallback.find("could not open"), std::string::npos) << outcome.ipc_fallback;
  EXPECT_EQ(server.stats().bytes_served, source.total()) << "all of it over TCP";
}

// The reader checks each region against the size its own driver mapped, never the source's word:
// a copy outside the mapping would fault the reader's whole CUDA context or copy its own memory.
TEST(IpcPull, ASourceThatPlacesARegionOutsideItsAllocationIsReadOverTcp) {
  Source source = typical_source();
  source.exporter->lie_about_place = true;
  DataServer server(server_config(source));
  grant_complete(server, source, {7, 1});
  auto importer = std::make_shared<FakeImporter>();
  const PullOutcome outcome = pull_and_check(server, source, {7, 1}, reader_options(importer));
  ASSERT_TRUE(outcome.ok()) << outcome.detail;
  EXPECT_EQ(outcome.bytes_over_ipc, 0u);
  EXPECT_EQ(importer->copies, 0) << "a copy was started from outside the mapping";
  EXPECT_NE(outcome.ipc_fallback.find("outside the allocation"), std::string::npos) << outcome.ipc_fallback;
  EXPECT_EQ(server.stats().bytes_served, source.total()) << "all of it over TCP";
}

// A pull keeps only the mappings it used: the source may free the others once their grant ended.
TEST(IpcMappingCache, APullClosesTheMappingsItDidNotUse) {
  Source first = typical_source();
  DataServer first_server(server_config(first));
  grant_complete(first_server, first, {7, 1});
  auto importer = std::make_shared<FakeImporter>();
  ASSERT_TRUE(pull_and_check(first_server, first, {7, 1}, reader_options(importer)).ok());
  const std::size_t first_mappings = importer->mappings_open();
  ASSERT_GT(first_mappings, 0u);
  Source second = typical_source();  // other allocations
  DataServer second_server(server_config(second));
  grant_complete(second_server, second, {8, 1});
  ASSERT_TRUE(pull_and_check(second_server, second, {8, 1}, reader_options(importer)).ok());
  EXPECT_EQ(importer->mappings_open(), first_mappings) << "the first source's mappings stayed open";
  EXPECT_EQ(importer->closes, static_cast<int>(first_mappings));
}

TEST(IpcPull, ARegionThatCannotBeExportedSendsAllOverTcp) {
  Source source;
  source.allocation_with({4096}, 1);
  const std::vector<std::byte*> pooled = source.allocation_with({8192}, 2);
  source.exporter->unexportable.insert(pooled[0] - 64);  // the allocation's base
  DataServer server(server_config(source));
  grant_complete(server, source, {7, 1});
  auto importer = std::make_shared<FakeImporter>();
  const PullOutcome outcome = pull_and_check(server, source, {7, 1}, reader_options(importer));
  ASSERT_TRUE(outcome.ok()) << outcome.detail;
  EXPECT_EQ(outcome.bytes_over_ipc, 0u);
  EXPECT_NE(outcome.ipc_fallback.find("could not export region 1"), std::string::npos) << outcome.ipc_fallback;
  EXPECT_EQ(importer->opens, 0);
}

TEST(IpcPull, ACopyThatFailsMidwayLeavesTheRestToTcp) {
  Source source = typical_source();
  DataServer server(server_config(source));
  grant_complete(server, source, {7, 1});
  auto importer = std::make_shared<FakeImporter>();
  importer->fail_copy_number = 2;
  const PullOutcome outcome = pull_and_check(server, source, {7, 1}, reader_options(importer));
  ASSERT_TRUE(outcome.ok()) << outcome.detail;
  EXPECT_EQ(outcome.bytes_over_ipc, source.regions[1].expected.size()) << "the first device region only";
  EXPECT_NE(outcome.ipc_fallback.find("copying region 2"), std::string::npos) << outcome.ipc_fallback;
  EXPECT_EQ(server.stats().bytes_served, source.total() - source.regions[1].expected.size())
      << "the packed region and the rest, and nothing twice";
  EXPECT_EQ(importer->closes, 1) << "the mapping of a failed copy is closed: the next pull opens it afresh";
  EXPECT_EQ(importer->mappings_open(), 0u);
}

TEST(IpcPull, AGrantRevokedDuringTheCopiesFailsTheRead) {
  Source source = typical_source();
  DataServer server(server_config(source));
  grant_complete(server, source, {7, 1});
  auto importer = std::make_shared<FakeImporter>();
  // The source unpublishes while the reader's copy engine reads: nothing stops the copy.
  importer->before_copy = [&](int copy) {
    if (copy == 2) server.revoke({7, 1});
  };
  Reader reader(source);
  const std::vector<LocalRegion> targets = reader.targets();
  const PullOutcome outcome = pull(server.endpoint(), {7, 1}, kSecret, targets, reader_options(importer));
  ASSERT_FALSE(outcome.ok());
  EXPECT_EQ(*outcome.error, ReadError::kRefused);
  EXPECT_NE(outcome.detail.find("revoked while its GPU memory was copied"), std::string::npos) << outcome.detail;
}

TEST(IpcPull, ACancelStopsBetweenRegions) {
  Source source = typical_source();
  DataServer server(server_config(source));
  grant_complete(server, source, {7, 1});
  auto importer = std::make_shared<FakeImporter>();
  std::atomic<bool> cancelled{false};
  importer->before_copy = [&](int) { cancelled = true; };
  PullOptions options = reader_options(importer);
  options.cancelled = [&] { return cancelled.load(); };
  Reader reader(source);
  const std::vector<LocalRegion> targets = reader.targets();
  const PullOutcome outcome = pull(server.endpoint(), {7, 1}, kSecret, targets, options);
  ASSERT_FALSE(outcome.ok());
  EXPECT_EQ(*outcome.error, ReadError::kCancelled);
  EXPECT_EQ(importer->copies, 1);
}

TEST(IpcPull, ManyRegionsAreAskedForInPages) {
  Source source;
  source.allocation_with(std::vector<std::uint64_t>(kIpcRegionsPerAnswerMax + 100, 64), 1);
  DataServer server(server_config(source));
  grant_complete(server, source, {7, 1});
  auto importer = std::make_shared<FakeImporter>();
  const PullOutcome outcome = pull_and_check(server, source, {7, 1}, reader_options(importer));
  ASSERT_TRUE(outcome.ok()) << outcome.detail;
  EXPECT_EQ(outcome.bytes_over_ipc, source.total());
  EXPECT_EQ(server.stats().ipc_answers, 2u);
  EXPECT_EQ(importer->opens, 1);
}

// ---- The server's answers --------------------------------------------------------------------------

TEST(IpcServer, AnswersHandlesOnlyUnderALiveGrant) {
  Source source = typical_source();
  DataServer server(server_config(source));
  grant_complete(server, source, {7, 1});
  std::vector<IpcRegionRecord> records;
  const IpcAnswerFrame answer = ask(server, {7, 1}, kSecret, 0, 5, &records);
  ASSERT_EQ(answer.status, 0u);
  EXPECT_EQ(answer.grant_regions, 5u);
  EXPECT_EQ(answer.process, kSourceProcess);
  EXPECT_EQ(std::string(answer.host.data()), kHost);
  ASSERT_EQ(records.size(), 5u);
  EXPECT_EQ(records[0].exported, 0u) << "host memory";
  EXPECT_EQ(records[1].exported, 1u);
  EXPECT_EQ(records[1].offset, 64u);
  EXPECT_EQ(records[3].exported, 0u) << "an empty region";
  EXPECT_EQ(records[1].handle, records[2].handle) << "one allocation";
  EXPECT_NE(records[1].handle, records[4].handle);

  EXPECT_EQ(ask(server, {7, 1}, kWrongSecret, 0, 5).status, 1u) << "a wrong secret: no grant";
  EXPECT_EQ(ask(server, {7, 1}, kSecret, 4, 2).status, 2u) << "past the last region";
  EXPECT_EQ(ask(server, {7, 1}, kSecret, 0, kIpcRegionsPerAnswerMax + 1).status, 2u) << "a page too big";
  server.revoke({7, 1});
  EXPECT_EQ(ask(server, {7, 1}, kSecret, 0, 5).status, 1u) << "revoked";
  EXPECT_EQ(server.stats().ipc_answers, 1u);
}

TEST(IpcServer, RefusalsCountAgainstTheConnection) {
  Source source = typical_source();
  DataServerConfig config = server_config(source);
  config.refusals_per_connection_max = 3;
  DataServer server(config);
  grant_complete(server, source, {7, 1});
  Fd connection = connect_tcp(server.endpoint(), 5'000);
  set_io_timeout(connection, 5'000);
  const IpcRequestFrame request{kIpcMagic, 1, 7, 0, 1, {0, 0}, kWrongSecret};
  for (int i = 0; i < 3; ++i) {
    send_all(connection, &request, sizeof request);
    IpcAnswerFrame answer;
    recv_all(connection, &answer, sizeof answer);
    EXPECT_EQ(answer.status, 1u);
  }
  // The third refusal closed it.
  char byte;
  EXPECT_THROW(recv_all(connection, &byte, 1), SocketError);
}

// ---- The mapping cache -----------------------------------------------------------------------------

TEST(IpcMappingCache, ClosesTheLeastRecentlyUsedBeyondItsBound) {
  std::vector<std::vector<std::byte>> allocations(4, std::vector<std::byte>(16));
  auto handle = [&](int i) { return handle_of(allocations[i].data(), 16); };
  {
    FakeImporter importer(2);
    EXPECT_EQ(importer.open(handle(0)).base, allocations[0].data());
    EXPECT_EQ(importer.open(handle(1)).base, allocations[1].data());
    EXPECT_EQ(importer.open(handle(0)).base, allocations[0].data());  // cached, and now the most recent
    EXPECT_EQ(importer.opens, 2);
    EXPECT_EQ(importer.open(handle(2)).base, allocations[2].data());  // closes 1, the least recently used
    EXPECT_EQ(importer.closes, 1);
    EXPECT_EQ(importer.open_now, (std::set<std::uintptr_t>{reinterpret_cast<std::uintptr_t>(allocations[0].data()),
                                                            reinterpret_cast<std::uintptr_t>(allocations[2].data())}));
    EXPECT_EQ(importer.open(handle(1)).base, allocations[1].data());  // again: closes 0
    EXPECT_EQ(importer.opens, 4);
    EXPECT_EQ(importer.closes, 2);
    EXPECT_FALSE(importer.open_now.contains(reinterpret_cast<std::uintptr_t>(allocations[0].data())));
    EXPECT_EQ(importer.mappings_open(), 2u);
    importer.forget(handle(2));
    EXPECT_EQ(importer.closes, 3);
    importer.fail_open = true;
    EXPECT_EQ(importer.open(handle(3)).base, nullptr);
    EXPECT_EQ(importer.mappings_open(), 1u) << "a failed open is not cached";
  }
}

TEST(IpcMappingCache, PullsFromManyAllocationsStayWithinTheBound) {
  Source source;
  for (int i = 0; i < 5; ++i) source.allocation_with({1000}, 10 + i);
  DataServer server(server_config(source));
  grant_complete(server, source, {7, 1});
  auto importer = std::make_shared<FakeImporter>(3);
  ASSERT_TRUE(pull_and_check(server, source, {7, 1}, reader_options(importer)).ok());
  EXPECT_EQ(importer->opens, 5);
  EXPECT_EQ(importer->closes, 2);
  EXPECT_EQ(importer->mappings_open(), 3u);
  importer.reset();  // closes the rest (FakeImporter checks each close matches an open)
}

}  // namespace
}  // namespace th::net
