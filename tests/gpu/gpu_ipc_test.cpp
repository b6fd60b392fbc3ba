// CUDA IPC on a real GPU (net/ipc.h, client/cuda/ipc.h): a forked child exports a cudaMalloc
// buffer (two regions inside it, at offsets) through a DataServer; the parent pulls them into its
// own device memory over IPC, and compares every byte on the host. No TCP staging is configured on
// either side: a pull that did not go over IPC fails. Exits 77 (skipped) without a CUDA device.
// The child is forked before either process touches CUDA (a CUDA context does not survive fork).
#include <cuda_runtime_api.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <vector>

#include "client/cuda/ipc.h"
#include "net/data_plane.h"
#include "tests/net/test_bytes.h"

namespace {

using namespace th;

constexpr GrantSecret kSecret{0x6e0, 0x1bc};
constexpr std::uint64_t kAllocationBytes = 64ull << 20;
constexpr std::uint64_t kRegionOffsets[2] = {4096, 40ull << 20};
constexpr std::uint64_t kRegionBytes[2] = {(24ull << 20) + 3, 1ull << 20};
constexpr int kSkipped = 77;

std::vector<std::byte> expected(int region) { return testing_bytes::pattern(kRegionBytes[region], 40 + region); }

// The source: answers its port (0: no GPU) on `to_parent`, serves until the parent writes a byte.
int child(int to_parent, int from_parent) {
  std::uint32_t port = 0;
  int devices = 0;
  void* memory = nullptr;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0 || cudaMalloc(&memory, kAllocationBytes) != cudaSuccess) {
    (void)!write(to_parent, &port, sizeof port);
    return 0;
  }
  auto* base = static_cast<std::byte*>(memory);
  std::vector<net::ExposedRegion> regions;
  for (int i = 0; i < 2; ++i) {
    const std::vector<std::byte> bytes = expected(i);
    if (cudaMemcpy(base + kRegionOffsets[i], bytes.data(), bytes.size(), cudaMemcpyHostToDevice) != cudaSuccess) return 1;
    regions.push_back({base + kRegionOffsets[i], kRegionBytes[i], true});
  }
  net::DataServerConfig config;
  config.ipc = client_impl::make_ipc_exporter();
  net::DataServer server(config);
  server.grant({1, 1}, kSecret, regions, std::make_shared<net::Progress>(kRegionBytes[0] + kRegionBytes[1]));
  port = server.endpoint().port;
  (void)!write(to_parent, &port, sizeof port);
  char done = 0;
  (void)!read(from_parent, &done, 1);
  server.revoke({1, 1});
  cudaFree(memory);
  return 0;
}

int parent(std::uint32_t port) {
  void* memory = nullptr;
  if (cudaMalloc(&memory, kRegionBytes[0] + kRegionBytes[1]) != cudaSuccess) {
    std::fprintf(stderr, "cudaMalloc failed in the reader\n");
    return 1;
  }
  auto* base = static_cast<std::byte*>(memory);
  const net::LocalRegion targets[2] = {{base, kRegionBytes[0], true}, {base + kRegionBytes[0], kRegionBytes[1], true}};
  net::PullOptions options;
  options.ipc = client_impl::make_ipc_importer(0);
  const net::PullOutcome outcome = net::pull(net::Endpoint{"127.0.0.1", static_cast<std::uint16_t>(port)}, {1, 1}, kSecret, targets, options);
  if (!outcome.ok() || outcome.bytes_over_ipc != kRegionBytes[0] + kRegionBytes[1]) {
    std::fprintf(stderr, "the pull did not go over IPC: %s / %s\n", outcome.detail.c_str(), outcome.ipc_fallback.c_str());
    return 1;
  }
  for (int i = 0; i < 2; ++i) {
    std::vector<std::byte> got(kRegionBytes[i]);
    if (cudaMemcpy(got.data(), targets[i].base, got.size(), cudaMemcpyDeviceToHost) != cudaSuccess || got != expected(i)) {
      std::fprintf(stderr, "region %d differs\n", i);
      return 1;
    }
  }
  options.ipc.reset();  // closes the mapping before the source frees its memory
  cudaFree(memory);
  std::printf("gpu_ipc_test: %llu bytes over CUDA IPC, every byte as sent\n",
              static_cast<unsigned long long>(outcome.bytes_over_ipc));
  return 0;
}

}  // namespace

int main() {
  int to_parent[2];
  int from_parent[2];
  if (pipe(to_parent) != 0 || pipe(from_parent) != 0) return 1;
  const pid_t pid = fork();
  if (pid < 0) return 1;
  if (pid == 0) _exit(child(to_parent[1], from_parent[0]));
  std::uint32_t port = 0;
  if (read(to_parent[0], &port, sizeof port) != sizeof port) return 1;
  int result = kSkipped;
  if (port == 0) {
    std::printf("gpu_ipc_test: skipped: no CUDA device\n");
  } else {
    result = parent(port);
  }
  (void)!write(from_parent[1], "x", 1);
  int status = 0;
  waitpid(pid, &status, 0);
  if (result == 0 && (!WIFEXITED(status) || WEXITSTATUS(status) != 0)) result = 1;
  return result;
}
