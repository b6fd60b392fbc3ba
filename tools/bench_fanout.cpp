#include "tools/bench_fanout.h"

#include <chrono>
#include <cstring>
#include <filesystem>
#include <iomanip>
#include <iostream>
#include <random>
#include <thread>

#include "tensorhub/client.h"
#include "tools/big_buffer.h"

namespace th::bench {
namespace {

void wait_for_file(const std::string& path) {
  while (!path.empty() && !std::filesystem::exists(path)) std::this_thread::sleep_for(std::chrono::milliseconds(5));
}

}  // namespace

int run_fanout_node(const FanoutNodeOptions& options) {
  if (options.role != "trainer" && options.role != "rollout") {
    std::cerr << "th-bench fanout-node: --role is trainer or rollout\n";
    return 2;
  }
  ClientOptions client;
  client.servers = {options.server};
  client.token = options.token;
  client.model = "bench-fanout";
  client.replica = options.replica;
  client.role = options.role;
  client.datacenter = options.datacenter;
  if (!options.data_ip.empty()) client.data_listen = options.data_ip + ":0";
  client.resume_reads = options.resume_reads;
  const std::uint64_t bytes = options.mib << 20;
  if (options.tensors == 0 || options.tensors > bytes) {
    std::cerr << "th-bench fanout-node: --tensors is 1 to the shard's bytes\n";
    return 2;
  }
  BigBuffer memory(bytes);
  std::memset(memory.get(), 0, bytes);  // memory in use, as a worker's tensors are
  auto opened = Handle::open(client);
  if (!opened.ok()) {
    std::cerr << "th-bench fanout-node: open: " << opened.error().detail << "\n";
    return 1;
  }
  std::unique_ptr<Handle> handle = std::move(opened).value();
  const std::uint64_t tensor_bytes = bytes / options.tensors;
  for (std::uint32_t i = 0; i < options.tensors; ++i) {
    const std::uint64_t size = i + 1 < options.tensors ? tensor_bytes : bytes - tensor_bytes * i;
    const std::string name = options.tensors == 1 ? "weights" : "weights." + std::to_string(i);
    if (auto registered = handle->register_tensor(name, memory.get() + tensor_bytes * i, size, DType::kUInt8);
        !registered.ok()) {
      std::cerr << "th-bench fanout-node: register: " << registered.error().detail << "\n";
      return 1;
    }
  }
  const bool two_versions = !options.second_version_file.empty();
  if (options.role == "trainer") {
    std::mt19937_64 random(7);
    auto* words = reinterpret_cast<std::uint64_t*>(memory.get());
    for (std::uint64_t i = 0; i < bytes / 8; ++i) words[i] = random();
    if (auto published = handle->publish(1); !published.ok()) {
      std::cerr << "th-bench fanout-node: publish: " << published.error().detail << "\n";
      return 1;
    }
    std::cout << "node ready data_endpoint=" << handle->data_endpoint() << std::endl;
    if (two_versions) {
      wait_for_file(options.second_version_file);
      if (auto unpublished = handle->unpublish(); !unpublished.ok()) {
        std::cerr << "th-bench fanout-node: unpublish: " << unpublished.error().detail << "\n";
        return 1;
      }
      for (std::uint64_t i = 0; i < bytes / 8; i += 4096) words[i] ^= 0x5A5A5A5A5A5A5A5Aull;  // new weights
      if (auto published = handle->publish(2); !published.ok()) {
        std::cerr << "th-bench fanout-node: publish 2: " << published.error().detail << "\n";
        return 1;
      }
      std::cout << "node published 2" << std::endl;
    }
  } else if (two_versions) {
    if (auto first = handle->replicate("latest"); !first.ok()) {
      std::cerr << "th-bench fanout-node: replicate: " << first.error().detail << "\n";
      return 1;
    }
    std::cout << "node ready" << std::endl;
    wait_for_file(options.start_file);
    const auto started = std::chrono::steady_clock::now();
    double stall_s = 0;
    int not_yet = 0;
    std::string source;
    for (;;) {
      const auto asked = std::chrono::steady_clock::now();
      auto updated = handle->update("latest");
      stall_s += std::chrono::duration<double>(std::chrono::steady_clock::now() - asked).count();
      if (!updated.ok()) {
        std::cerr << "th-bench fanout-node: update: " << updated.error().detail << "\n";
        return 1;
      }
      if (updated.value().version.value_or(0) >= 2) {
        source = updated.value().source_replica;
        break;
      }
      if (updated.value().status == UpdateStatus::kNotYet) ++not_yet;
      std::this_thread::sleep_for(std::chrono::milliseconds(50));  // generating with version 1
      if (std::chrono::steady_clock::now() - started > std::chrono::minutes(10)) {
        std::cerr << "th-bench fanout-node: no version 2 within 10 minutes\n";
        return 1;
      }
    }
    const double until_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
    std::cout << std::fixed << std::setprecision(3) << "RESULT stall_seconds=" << stall_s << " until_seconds=" << until_s
              << " not_yet=" << not_yet << " source=" << source << " checksum_failures="
              << handle->stats().checksum_failures << std::endl;
  } else {
    std::cout << "node ready" << std::endl;
    wait_for_file(options.start_file);
    const auto started = std::chrono::steady_clock::now();
    auto replicated = handle->replicate("latest");
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
    if (!replicated.ok()) {
      std::cerr << "th-bench fanout-node: replicate: " << replicated.error().detail << "\n";
      return 1;
    }
    const HandleStats stats = handle->stats();
    // (bytes_resumed before source=: tests/e2e/two_hosts_test.sh reads the line's end as it was.)
    std::cout << std::fixed << std::setprecision(3) << "RESULT fanout_seconds=" << seconds
              << " bytes_resumed=" << stats.bytes_resumed << " source=" << replicated.value().source_replica
              << " checksum_failures=" << stats.checksum_failures << " data_endpoint=" << handle->data_endpoint()
              << std::endl;
    if (!options.next_version_file.empty()) {
      wait_for_file(options.next_version_file);
      const auto asked = std::chrono::steady_clock::now();
      auto updated = handle->update("latest");
      const double next_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - asked).count();
      if (!updated.ok() || updated.value().version.value_or(0) != 2) {
        std::cerr << "th-bench fanout-node: update to version 2: "
                  << (updated.ok() ? "got version " + std::to_string(updated.value().version.value_or(0))
                                   : updated.error().detail)
                  << "\n";
        return 1;
      }
      std::cout << std::fixed << std::setprecision(3) << "RESULT next_seconds=" << next_s
                << " source=" << updated.value().source_replica
                << " checksum_failures=" << handle->stats().checksum_failures << std::endl;
    }
  }
  wait_for_file(options.stop_file);
  return 0;
}

}  // namespace th::bench
