// th-gpu-bench (issue 15): a bf16 state dict in GPU memory moved GPU to GPU and GPU to CPU on one
// host through each path libthclient has here (TCP through pinned staging; RDMA where the host
// has a device that can register GPU memory), next to cudaMemcpy device-to-device, host-to-device
// and device-to-host bandwidth and the GPU checksum's rate, all measured in the same run.
// Prints a Markdown table; tools/gpu-check writes it to bench/results/.
#include <CLI/CLI.hpp>
#include <cuda_runtime_api.h>

#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "server/embedded_server.h"
#include "tensorhub/client.h"

namespace {

using Clock = std::chrono::steady_clock;

[[noreturn]] void die(const std::string& what) {
  std::fprintf(stderr, "th-gpu-bench: %s\n", what.c_str());
  std::exit(1);
}

void check(cudaError_t status, const char* call) {
  if (status != cudaSuccess) die(std::string(call) + ": " + cudaGetErrorString(status));
}

template <typename T>
T must(th::Result<T> result, const char* what) {
  if (!result.ok()) die(std::string(what) + ": " + result.error().detail);
  return std::move(result).value();
}

// Device buffers of one state dict: `count` tensors of `bytes` each.
struct StateDict {
  StateDict(std::size_t count, std::uint64_t bytes, bool on_gpu) : bytes_each(bytes), gpu(on_gpu) {
    for (std::size_t i = 0; i < count; ++i) {
      void* memory = nullptr;
      if (gpu) {
        check(cudaMalloc(&memory, bytes), "cudaMalloc");
      } else {
        check(cudaMallocHost(&memory, bytes), "cudaMallocHost");
      }
      tensors.push_back(static_cast<std::byte*>(memory));
    }
  }
  ~StateDict() {
    for (std::byte* tensor : tensors) gpu ? cudaFree(tensor) : cudaFreeHost(tensor);
  }
  StateDict(const StateDict&) = delete;
  StateDict& operator=(const StateDict&) = delete;
  std::uint64_t total() const { return bytes_each * tensors.size(); }
  void register_with(th::Handle& handle) const {
    for (std::size_t i = 0; i < tensors.size(); ++i) {
      char name[48];
      std::snprintf(name, sizeof name, "layers.%04zu.weight", i);
      const th::Status status = handle.register_tensor(name, tensors[i], bytes_each, th::DType::kBFloat16,
                                                       gpu ? th::MemoryKind::kCuda : th::MemoryKind::kCpu);
      if (!status.ok()) die("register " + std::string(name) + ": " + status.error().detail);
    }
  }
  std::uint64_t bytes_each;
  bool gpu;
  std::vector<std::byte*> tensors;
};

// GB/s of `copy` over `bytes`, timed with CUDA events on `stream`, best of `rounds`.
template <typename Copy>
double copy_rate(std::uint64_t bytes, int rounds, cudaStream_t stream, Copy copy) {
  cudaEvent_t start = nullptr, stop = nullptr;
  check(cudaEventCreate(&start), "cudaEventCreate");
  check(cudaEventCreate(&stop), "cudaEventCreate");
  float best_ms = 1e30f;
  for (int round = 0; round < rounds; ++round) {
    check(cudaEventRecord(start, stream), "cudaEventRecord");
    copy();
    check(cudaEventRecord(stop, stream), "cudaEventRecord");
    check(cudaEventSynchronize(stop), "cudaEventSynchronize");
    float ms = 0;
    check(cudaEventElapsedTime(&ms, start, stop), "cudaEventElapsedTime");
    best_ms = std::min(best_ms, ms);
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  return static_cast<double>(bytes) / (best_ms * 1e6);
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"th-gpu-bench: GPU state dicts moved through libthclient's paths, next to cudaMemcpy"};
  double gib = 4;
  int tensor_mib = 64;
  int rounds = 2;
  app.add_option("--gib", gib, "state dict size in GiB")->check(CLI::Range(0.0625, 64.0));
  app.add_option("--tensor-mib", tensor_mib, "MiB per tensor")->check(CLI::Range(1, 4096));
  app.add_option("--rounds", rounds, "versions moved per path (the best is reported)")->check(CLI::Range(1, 20));
  std::string trainer_of;
  app.add_option("--trainer-of", trainer_of,
                 "(internal) be the other process's trainer: publish version 2 to this th-server, then "
                 "serve it until stdin closes");
  CLI11_PARSE(app, argc, argv);

  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::printf("SKIP: no CUDA device\n");
    return 77;
  }
  cudaDeviceProp properties{};
  check(cudaGetDeviceProperties(&properties, 0), "cudaGetDeviceProperties");
  const std::uint64_t tensor_bytes = static_cast<std::uint64_t>(tensor_mib) << 20;
  const auto count = static_cast<std::size_t>(gib * 1024 / tensor_mib);
  StateDict trained(count, tensor_bytes, true);
  for (std::size_t i = 0; i < count; ++i) check(cudaMemset(trained.tensors[i], static_cast<int>(i), tensor_bytes), "cudaMemset");
  if (!trainer_of.empty()) {
    // The trainer of another process on this host (for the same-host paths below).
    th::ClientOptions options;
    options.servers = {trainer_of};
    options.token = "gpu-bench";
    options.model = "gpu-bench";
    options.replica = "trainer-process";
    options.data_listen = "127.0.0.1:0";
    options.transport = "tcp";
    options.log_level = th::LogLevel::kWarning;
    auto handle = must(th::Handle::open(options), "trainer process open");
    trained.register_with(*handle);
    must(handle->publish(2), "trainer process publish");
    while (std::getchar() != EOF) {
    }
    return 0;
  }
  const double total_gb = static_cast<double>(trained.total()) / 1e9;
  std::printf("# th-gpu-bench: %s, %zu bf16 tensors of %d MiB (%.2f GB), best of %d\n\n", properties.name, count,
              tensor_mib, total_gb, rounds);
  std::printf("| path | GB/s | seconds per version |\n|---|---|---|\n");
  auto row = [&](const std::string& path, double gb_per_s) {
    std::printf("| %s | %.2f | %.3f |\n", path.c_str(), gb_per_s, total_gb / gb_per_s);
    std::fflush(stdout);
  };

  // The device's own rates, as references.
  {
    cudaStream_t stream = nullptr;
    check(cudaStreamCreate(&stream), "cudaStreamCreate");
    StateDict copy(count, tensor_bytes, true);
    StateDict pinned(1, tensor_bytes, false);
    row("cudaMemcpy device to device", copy_rate(trained.total(), rounds, stream, [&] {
          for (std::size_t i = 0; i < count; ++i) {
            check(cudaMemcpyAsync(copy.tensors[i], trained.tensors[i], tensor_bytes, cudaMemcpyDeviceToDevice, stream), "memcpy");
          }
        }));
    row("cudaMemcpy host (pinned) to device", copy_rate(trained.total(), rounds, stream, [&] {
          for (std::size_t i = 0; i < count; ++i) {
            check(cudaMemcpyAsync(copy.tensors[i], pinned.tensors[0], tensor_bytes, cudaMemcpyHostToDevice, stream), "memcpy");
          }
        }));
    row("cudaMemcpy device to host (pinned)", copy_rate(trained.total(), rounds, stream, [&] {
          for (std::size_t i = 0; i < count; ++i) {
            check(cudaMemcpyAsync(pinned.tensors[0], trained.tensors[i], tensor_bytes, cudaMemcpyDeviceToHost, stream), "memcpy");
          }
        }));
    cudaStreamDestroy(stream);
  }

  th::server::ServiceConfig config;
  config.token = "gpu-bench";
  th::server::EmbeddedServer server(config, th::server::LogLevel::kWarn);
  auto options_for = [&](const std::string& replica, const std::string& transport, bool cuda_ipc = true) {
    th::ClientOptions options;
    options.servers = {server.address()};
    options.token = "gpu-bench";
    options.model = "gpu-bench";
    options.replica = replica;
    options.data_listen = "127.0.0.1:0";
    options.transport = transport;
    options.cuda_ipc = cuda_ipc;
    options.log_level = th::LogLevel::kWarning;
    return options;
  };
  auto trainer = must(th::Handle::open(options_for("trainer", "auto")), "trainer open");
  trained.register_with(*trainer);
  const auto publish_started = Clock::now();
  must(trainer->publish(1), "publish");
  const double publish_s = std::chrono::duration<double>(Clock::now() - publish_started).count();
  std::printf("| publish (GPU checksums of the whole state dict) | %.2f | %.3f |\n", total_gb / publish_s, publish_s);

  struct Path {
    std::string name;
    std::string transport;
    bool gpu_target;
    std::string version;  // "1": this process's trainer; "2": the trainer process's
    bool cuda_ipc;
  };
  const std::vector<Path> paths = {
      {"TensorHub GPU to GPU, TCP through pinned staging", "tcp", true, "1", true},
      {"TensorHub GPU to CPU, TCP", "tcp", false, "1", true},
      {"TensorHub GPU to GPU, auto (RDMA where a device registers GPU memory)", "auto", true, "1", true},
      {"TensorHub GPU to GPU from another process, CUDA IPC", "tcp", true, "2", true},
      {"TensorHub GPU to GPU from another process, TCP through pinned staging (cuda_ipc off)", "tcp", true, "2", false}};
  // The trainer process (an IPC reader cannot map memory of its own process): ourselves again.
  char self[4096] = {};
  if (::readlink("/proc/self/exe", self, sizeof self - 1) <= 0) die("cannot find this program (/proc/self/exe)");
  const std::string command = std::string(self) + " --trainer-of " + server.address() + " --gib " + std::to_string(gib) +
                              " --tensor-mib " + std::to_string(tensor_mib);
  FILE* trainer_process = ::popen(command.c_str(), "w");  // it serves until we close its stdin
  if (trainer_process == nullptr) die("cannot start " + command);
  int replica = 0;
  for (const Path& path : paths) {
    StateDict target(count, tensor_bytes, path.gpu_target);
    auto rollout = th::Handle::open(options_for("rollout-" + std::to_string(replica++), path.transport, path.cuda_ipc));
    if (!rollout.ok()) {
      std::printf("| %s | not run: %s | |\n", path.name.c_str(), rollout.error().detail.c_str());
      continue;
    }
    target.register_with(*rollout.value());
    double best_s = 1e30;
    for (int round = 0; round < rounds; ++round) {
      const auto started = Clock::now();
      must(rollout.value()->replicate(path.version, 600'000), "replicate");
      best_s = std::min(best_s, std::chrono::duration<double>(Clock::now() - started).count());
      if (auto status = rollout.value()->unpublish(); !status.ok()) die("unpublish: " + status.error().detail);
    }
    const th::HandleStats stats = rollout.value()->stats();
    row(path.name + " (" + stats.transport + ", GPU registration " + stats.gpu_registration + ", " +
            std::to_string(stats.pulls_ipc) + " reads over IPC, " + std::to_string(stats.checksum_failures) +
            " checksum failures)",
        total_gb / best_s);
  }
  ::pclose(trainer_process);

  // Offload: unpublishing the last copy of a retained version copies it to CPU memory first.
  {
    th::ClientOptions keeper_options = options_for("keeper", "tcp");
    keeper_options.retention.keep_latest = 0;
    auto keeper = must(th::Handle::open(keeper_options), "keeper open");
    trained.register_with(*keeper);
    must(keeper->publish(5), "keeper publish");
    const auto started = Clock::now();
    if (auto status = keeper->unpublish(); !status.ok()) die("keeper unpublish: " + status.error().detail);
    const double offload_s = std::chrono::duration<double>(Clock::now() - started).count();
    std::printf("| unpublish of the last copy: offload GPU to CPU memory (pinned while copied) | %.2f | %.3f |\n",
                total_gb / offload_s, offload_s);
  }
  return 0;
}
