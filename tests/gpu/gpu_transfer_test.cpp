// GPU memory end to end (issue 15), on a real GPU: an embedded th-server, a trainer and a rollout
// in this process, moving the shard GPU to GPU, GPU to CPU and CPU to GPU over TCP (through the
// pinned staging rings), streaming into GPU memory, serving an offload copy of GPU tensors, and
// publish ordered after the application's stream. Every version is compared byte for byte on the
// host. Exits 77 (skipped) where there is no CUDA device; tools/gpu-check runs it.
#include <cuda_runtime_api.h>

#include <cstdio>
#include <map>

#include "tests/gpu/gpu_fixture.h"
#include "tests/gpu/gpu_main.h"

namespace th::gpu_test {
namespace {

#define CHECK_CUDA(call) ASSERT_EQ((call), cudaSuccess) << #call << ": " << cudaGetErrorString(call)

// Device memory with an owner.
class DeviceBuffer {
 public:
  explicit DeviceBuffer(std::uint64_t bytes) : bytes_(bytes) {
    if (bytes > 0 && cudaMalloc(&data_, bytes) != cudaSuccess) throw std::runtime_error("cudaMalloc failed");
  }
  ~DeviceBuffer() {
    if (data_ != nullptr) cudaFree(data_);
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  std::byte* data() const { return static_cast<std::byte*>(data_); }
  std::uint64_t bytes() const { return bytes_; }

 private:
  void* data_ = nullptr;
  std::uint64_t bytes_;
};

// One shard's tensors, in GPU or CPU memory.
struct Shard {
  explicit Shard(bool gpu_memory) : on_gpu(gpu_memory) {
    for (const TensorShape& shape : shard_shapes()) {
      if (on_gpu) {
        gpu.emplace(shape.name, std::make_unique<DeviceBuffer>(shape.bytes));
      } else {
        cpu[shape.name].resize(shape.bytes);
      }
    }
  }
  std::byte* data(const std::string& name) { return on_gpu ? gpu.at(name)->data() : cpu.at(name).data(); }
  void register_with(Handle& handle) {
    for (const TensorShape& shape : shard_shapes()) {
      const Status status = handle.register_tensor(shape.name, data(shape.name), shape.bytes, DType::kUInt8,
                                                   on_gpu ? MemoryKind::kCuda : MemoryKind::kCpu);
      ASSERT_TRUE(status.ok()) << shape.name << ": " << status.error().detail;
    }
  }
  void write(std::uint64_t version) {
    for (const TensorShape& shape : shard_shapes()) {
      const std::vector<std::byte> bytes = tensor_bytes(shape, version);
      if (on_gpu) {
        CHECK_CUDA(cudaMemcpy(data(shape.name), bytes.data(), bytes.size(), cudaMemcpyHostToDevice));
      } else {
        std::copy(bytes.begin(), bytes.end(), cpu.at(shape.name).begin());
      }
    }
  }
  std::vector<std::byte> read(const TensorShape& shape) {
    if (!on_gpu) return cpu.at(shape.name);
    std::vector<std::byte> out(shape.bytes);
    if (shape.bytes > 0) cudaMemcpy(out.data(), data(shape.name), shape.bytes, cudaMemcpyDeviceToHost);
    return out;
  }
  // Every tensor holds version `version`, byte for byte.
  void expect_holds(std::uint64_t version) {
    for (const TensorShape& shape : shard_shapes()) {
      EXPECT_TRUE(read(shape) == tensor_bytes(shape, version)) << shape.name << " does not hold version " << version;
    }
  }
  void scribble() {
    for (const TensorShape& shape : shard_shapes()) {
      if (shape.bytes == 0) continue;
      if (on_gpu) {
        cudaMemset(data(shape.name), 0xa5, shape.bytes);
      } else {
        std::fill(cpu.at(shape.name).begin(), cpu.at(shape.name).end(), std::byte{0xa5});
      }
    }
  }

  const bool on_gpu;
  std::map<std::string, std::unique_ptr<DeviceBuffer>> gpu;
  std::map<std::string, std::vector<std::byte>> cpu;
};

using GpuTransfer = ServerFixture;

class GpuPaths : public GpuTransfer, public ::testing::WithParamInterface<std::pair<bool, bool>> {};

TEST_P(GpuPaths, AVersionArrivesByteForByte) {
  const auto [trainer_on_gpu, rollout_on_gpu] = GetParam();
  auto trainer = open(options_for("trainer", "trainer"));
  auto rollout = open(options_for("rollout", "rollout"));
  ASSERT_TRUE(trainer && rollout);
  Shard source(trainer_on_gpu), target(rollout_on_gpu);
  source.register_with(*trainer);
  target.register_with(*rollout);
  source.write(1);
  auto published = trainer->publish(1);
  ASSERT_TRUE(published.ok()) << published.error().detail;
  auto replicated = rollout->replicate("latest", 60'000);
  ASSERT_TRUE(replicated.ok()) << replicated.error().detail;
  EXPECT_EQ(replicated.value().version, 1u);
  target.expect_holds(1);
  EXPECT_EQ(rollout->stats().checksum_failures, 0u);
  // A second version through the same handles (the rings are reused).
  ASSERT_TRUE(trainer->unpublish().ok());
  source.write(2);
  ASSERT_TRUE(trainer->publish(2).ok());
  auto updated = rollout->update("latest");
  ASSERT_TRUE(updated.ok()) << updated.error().detail;
  EXPECT_EQ(updated.value().status, UpdateStatus::kUpdated);
  target.expect_holds(2);
}

INSTANTIATE_TEST_SUITE_P(Paths, GpuPaths,
                         ::testing::Values(std::pair{true, true}, std::pair{true, false}, std::pair{false, true}),
                         [](const auto& param_info) {
                           return std::string(param_info.param.first ? "Gpu" : "Cpu") + "To" +
                                  (param_info.param.second ? "Gpu" : "Cpu");
                         });

// Streaming into GPU memory: each tensor handed out is complete and right on the device.
TEST_F(GpuTransfer, AStreamHandsOutGpuTensorsThatAreAlreadyRight) {
  auto trainer = open(options_for("trainer", "trainer"));
  auto rollout = open(options_for("rollout", "rollout"));
  ASSERT_TRUE(trainer && rollout);
  Shard source(true), target(true);
  source.register_with(*trainer);
  target.register_with(*rollout);
  source.write(1);
  ASSERT_TRUE(trainer->publish(1).ok());
  auto receive = rollout->replicate_async("latest");
  ASSERT_TRUE(receive.ok()) << receive.error().detail;
  std::size_t handed_out = 0;
  for (;;) {
    auto tensor = receive.value()->next(60'000);
    ASSERT_TRUE(tensor.ok()) << tensor.error().detail;
    if (!tensor.value()) break;
    ++handed_out;
    const TensorShape shape{tensor.value()->name, tensor.value()->bytes};
    EXPECT_EQ(tensor.value()->data, target.data(shape.name));
    EXPECT_TRUE(target.read(shape) == tensor_bytes(shape, 1)) << shape.name << " handed out before it was right";
  }
  EXPECT_EQ(handed_out, shard_shapes().size());
  ASSERT_TRUE(receive.value()->wait().ok());
}

// publish(version, stream) reads the GPU tensors only after the application's stream wrote them.
TEST_F(GpuTransfer, PublishWaitsForTheApplicationsStream) {
  auto trainer = open(options_for("trainer", "trainer"));
  auto rollout = open(options_for("rollout", "rollout"));
  ASSERT_TRUE(trainer && rollout);
  Shard source(true), target(false);
  source.register_with(*trainer);
  target.register_with(*rollout);
  source.write(1);
  cudaStream_t stream = nullptr;
  CHECK_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  // Queue a lot of work ahead of the last write, so that it lands well after publish was called.
  const TensorShape big = shard_shapes().back();
  DeviceBuffer scratch(1ull << 30);
  for (int i = 0; i < 200; ++i) CHECK_CUDA(cudaMemsetAsync(scratch.data(), i, scratch.bytes(), stream));
  const std::vector<std::byte> version2 = tensor_bytes(big, 2);
  CHECK_CUDA(cudaMemcpyAsync(source.data(big.name), version2.data(), version2.size(), cudaMemcpyHostToDevice, stream));
  ASSERT_TRUE(trainer->publish(1, stream).ok());
  ASSERT_TRUE(rollout->replicate("latest", 60'000).ok());
  EXPECT_TRUE(target.read(big) == version2) << "publish read the tensor before the stream wrote it";
  cudaStreamDestroy(stream);
}

// The last copy of a retained version lives in GPU memory: unpublish offloads it to CPU memory,
// and a reader gets it from there after the trainer wrote over its GPU buffers.
TEST_F(GpuTransfer, TheLastGpuCopyIsOffloadedAndServedFromCpuMemory) {
  ClientOptions trainer_options = options_for("trainer", "trainer");
  trainer_options.retention.keep_latest = 0;
  auto trainer = open(trainer_options);
  ASSERT_NE(trainer, nullptr);
  Shard source(true);
  source.register_with(*trainer);
  source.write(1);
  ASSERT_TRUE(trainer->publish(1).ok());
  const Status unpublished = trainer->unpublish();
  ASSERT_TRUE(unpublished.ok()) << unpublished.error().detail;
  source.scribble();
  auto rollout = open(options_for("rollout", "rollout"));
  ASSERT_NE(rollout, nullptr);
  Shard target(true);
  target.register_with(*rollout);
  auto replicated = rollout->replicate("1", 60'000);
  ASSERT_TRUE(replicated.ok()) << replicated.error().detail;
  target.expect_holds(1);
}

TEST_F(GpuTransfer, MemoryThatIsNotAGpusIsRefusedAsKCuda) {
  auto handle = open(options_for("trainer", "trainer"));
  ASSERT_NE(handle, nullptr);
  std::vector<std::byte> host(4096);
  const Status pageable = handle->register_tensor("host", host.data(), host.size(), DType::kUInt8, MemoryKind::kCuda);
  ASSERT_FALSE(pageable.ok());
  EXPECT_EQ(pageable.error().code, Errc::kInvalidArgument);
  DeviceBuffer device(1 << 20);
  const Status past_end =
      handle->register_tensor("past", device.data() + 4096, device.bytes(), DType::kUInt8, MemoryKind::kCuda);
  ASSERT_FALSE(past_end.ok()) << "a range past its allocation was taken";
  EXPECT_NE(past_end.error().detail.find("past the end of its allocation"), std::string::npos) << past_end.error().detail;
  EXPECT_TRUE(handle->register_tensor("inside", device.data() + 4096, 8192, DType::kUInt8, MemoryKind::kCuda).ok());
}

}  // namespace
}  // namespace th::gpu_test

int main(int argc, char** argv) { return th::gpu_test::run_where_a_gpu_is(argc, argv); }
