// Where libthclient cannot take GPU memory (built without the CUDA Toolkit, or no CUDA device
// here, as on CI machines), registering kCuda memory is refused at once, saying which, and the
// handle goes on working with CPU memory. Where a GPU exists, the gpu tests cover kCuda instead.
#include <vector>

#include "tests/gpu/gpu_fixture.h"

#ifdef TH_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif

namespace th::gpu_test {
namespace {

bool a_gpu_is_here() {
#ifdef TH_HAVE_CUDA
  int devices = 0;
  return cudaGetDeviceCount(&devices) == cudaSuccess && devices > 0;
#else
  return false;
#endif
}

using GpuRefusal = ServerFixture;

TEST_F(GpuRefusal, KCudaMemoryIsRefusedWithTheReasonAndTheHandleGoesOn) {
  if (a_gpu_is_here()) GTEST_SKIP() << "a CUDA device is here: the gpu tests cover kCuda";
  auto handle = open(options_for("trainer", "trainer"));
  ASSERT_NE(handle, nullptr);
  std::vector<std::byte> memory(4096);
  const Status refused = handle->register_tensor("w", memory.data(), memory.size(), DType::kBFloat16, MemoryKind::kCuda);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.error().code, Errc::kInvalidArgument);
#ifdef TH_HAVE_CUDA
  EXPECT_NE(refused.error().detail.find("no CUDA device here"), std::string::npos) << refused.error().detail;
#else
  EXPECT_NE(refused.error().detail.find("built without the CUDA Toolkit"), std::string::npos) << refused.error().detail;
#endif
  EXPECT_NE(refused.error().detail.find("tensor 'w'"), std::string::npos) << refused.error().detail;
  // Nothing was registered: the same name as CPU memory works, and so does a publish.
  ASSERT_TRUE(handle->register_tensor("w", memory.data(), memory.size(), DType::kBFloat16).ok());
  auto published = handle->publish(1);
  ASSERT_TRUE(published.ok()) << published.error().detail;
}

// An empty kCuda tensor has no memory to move: it is taken as it is, wherever the build runs.
TEST_F(GpuRefusal, AnEmptyKCudaTensorNeedsNoDevice) {
  auto handle = open(options_for("trainer", "trainer"));
  ASSERT_NE(handle, nullptr);
  EXPECT_TRUE(handle->register_tensor("empty", nullptr, 0, DType::kFloat32, MemoryKind::kCuda).ok());
}

}  // namespace
}  // namespace th::gpu_test
