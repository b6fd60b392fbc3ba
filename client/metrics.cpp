#include "client/metrics.h"

#include <algorithm>

#include "core/assert.h"

namespace th::client {

namespace {

using Type = net::MetricsText::Type;
constexpr std::size_t kCalls = 7;

}  // namespace

std::string_view HandleMetrics::call_name(Call call) {
  switch (call) {
    case Call::kPublish: return "publish";
    case Call::kUnpublish: return "unpublish";
    case Call::kReplicate: return "replicate";
    case Call::kUpdate: return "update";
    case Call::kList: return "list";
    case Call::kWait: return "wait";
    case Call::kClose: return "close";
  }
  return "unknown";
}

HandleMetrics::HandleMetrics(const ClientOptions& options, std::function<HandleStats()> stats)
    : labels_{{"model", options.model}, {"replica", options.replica}, {"shard", std::to_string(options.shard)}},
      stats_(std::move(stats)),
      stall_replicate_(net::latency_buckets_seconds()),
      stall_update_(net::latency_buckets_seconds()) {}

void HandleMetrics::record(Call call, double seconds, std::string_view result) {
  std::lock_guard lock(mutex_);
  ++calls_[{call, std::string(result)}];
  if (call == Call::kReplicate) stall_replicate_.observe(seconds);
  if (call == Call::kUpdate) stall_update_.observe(seconds);
}

ClientMetrics& ClientMetrics::instance() {
  // Never destroyed: handles may outlive static destruction order, and the endpoint's thread
  // ends with the process.
  static ClientMetrics* metrics = new ClientMetrics();
  return *metrics;
}

Status ClientMetrics::serve(const std::string& address) {
  std::lock_guard lock(mutex_);
  if (endpoint_ != nullptr) {
    if (address == requested_ || address == endpoint_->address()) return Unit{};
    return Error{Errc::kInvalidArgument, "this process serves its metrics on " + endpoint_->address() +
                                             " already (one endpoint per process; metrics_listen " + address +
                                             " differs)"};
  }
  auto started = net::MetricsHttpThread::start(address, [this] { return render(); });
  if (!started.ok()) return started.error();
  endpoint_ = std::move(started).value();
  requested_ = address;
  return Unit{};
}

std::string ClientMetrics::address() const {
  std::lock_guard lock(mutex_);
  return endpoint_ != nullptr ? endpoint_->address() : "";
}

void ClientMetrics::attach(std::shared_ptr<HandleMetrics> handle) {
  TH_REQUIRE(handle != nullptr, "a handle to attach");
  std::lock_guard lock(mutex_);
  handles_.push_back(std::move(handle));
}

void ClientMetrics::detach(const HandleMetrics* handle) {
  std::lock_guard lock(mutex_);
  std::erase_if(handles_, [handle](const auto& attached) { return attached.get() == handle; });
}

std::string ClientMetrics::render() const {
  // Holding mutex_ keeps every attached handle's stats source alive (detach waits for it).
  std::lock_guard lock(mutex_);
  std::vector<HandleStats> stats;
  stats.reserve(handles_.size());
  for (const auto& handle : handles_) stats.push_back(handle->stats_());
  net::MetricsText out;
  auto each = [&](auto&& write) {
    for (std::size_t i = 0; i < handles_.size(); ++i) write(*handles_[i], stats[i]);
  };
  auto counter = [&](std::string_view name, std::string_view help, std::uint64_t HandleStats::*field) {
    out.family(name, Type::kCounter, help);
    each([&](const HandleMetrics& handle, const HandleStats& figures) {
      out.sample(handle.labels_, static_cast<double>(figures.*field));
    });
  };

  out.family("th_client_stall_seconds", Type::kHistogram,
             "How long a replicate or update call held the application, from call to return (one per version)");
  each([&](const HandleMetrics& handle, const HandleStats&) {
    std::lock_guard handle_lock(handle.mutex_);
    auto labels = handle.labels_;
    labels.emplace_back("op", "replicate");
    if (handle.stall_replicate_.count() > 0) out.histogram(labels, handle.stall_replicate_);
    labels.back().second = "update";
    if (handle.stall_update_.count() > 0) out.histogram(labels, handle.stall_update_);
  });
  out.family("th_client_operations_total", Type::kCounter, "Calls returned, by kind and result");
  each([&](const HandleMetrics& handle, const HandleStats&) {
    std::lock_guard handle_lock(handle.mutex_);
    for (const auto& [key, count] : handle.calls_) {
      auto labels = handle.labels_;
      labels.emplace_back("op", HandleMetrics::call_name(key.first));
      labels.emplace_back("result", key.second);
      out.sample(labels, static_cast<double>(count));
    }
  });
  out.family("th_client_received_bytes_total", Type::kCounter,
             "Bytes received from peers, by the data plane this shard runs (tcp or rdma)");
  each([&](const HandleMetrics& handle, const HandleStats& figures) {
    auto labels = handle.labels_;
    labels.emplace_back("transport", figures.transport.empty() ? "tcp" : figures.transport);
    out.sample(labels, static_cast<double>(figures.bytes_received));
  });
  counter("th_client_served_bytes_total", "Bytes served to peers", &HandleStats::bytes_served);
  out.family("th_client_pulls_total", Type::kCounter, "Reads of a version's shard, by how the bytes moved");
  each([&](const HandleMetrics& handle, const HandleStats& figures) {
    auto labels = handle.labels_;
    labels.emplace_back("transport", "rdma");
    out.sample(labels, static_cast<double>(figures.pulls_rdma));
    labels.back().second = "tcp";
    out.sample(labels, static_cast<double>(figures.pulls_tcp));
  });
  counter("th_client_pulls_fell_back_total", "TCP reads taken because the source could not do RDMA",
          &HandleStats::pulls_fell_back);
  counter("th_client_read_failures_total", "Reads from a source that failed (the server picked another)",
          &HandleStats::reads_failed);
  counter("th_client_checksum_failures_total", "Received bytes that did not match their checksum",
          &HandleStats::checksum_failures);
  counter("th_client_copies_found_corrupt_total",
          "Times readers found this shard's copy failing its checksums twice (written while published?)",
          &HandleStats::copies_found_corrupt);
  counter("th_client_servers_lost_total", "Control connections lost (each a failover or a reconnect)",
          &HandleStats::servers_lost);
  counter("th_client_memory_registrations_total", "NIC memory registrations made", &HandleStats::memory_registrations);
  // Delta versions: of the bytes received, those of patch reads (the rest: versions read whole).
  counter("th_client_patch_reads_total", "Versions received as a patch against the one held", &HandleStats::patch_reads);
  counter("th_client_patch_received_bytes_total", "Bytes received by patch reads (patches, and tensors read whole)",
          &HandleStats::patch_bytes_received);
  counter("th_client_patch_reads_failed_total", "Patch reads that failed (the bytes were read next)",
          &HandleStats::patch_reads_failed);
  counter("th_client_patches_published_total", "Versions published with a patch", &HandleStats::patches_published);
  static_assert(kCalls == static_cast<std::size_t>(HandleMetrics::Call::kClose) + 1, "every call kind");
  return out.take();
}

}  // namespace th::client
