// device_checksum on a real GPU (issue 15; label gpu): the checksum the kernel computes of device
// memory equals client_impl::checksum of the same bytes in host memory, for the lengths the CPU
// parts test covers, at every alignment, for 1 GiB, and in batches. Without a usable CUDA device it
// prints why and exits 77, which CTest reports as skipped.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <initializer_list>

#include "client/checksum.h"
#include "client/cuda/checksum.h"
#include "core/assert.h"
#include "tests/gpu/checksum_test_data.h"
#include "tests/gpu/gpu_main.h"

namespace th {
namespace {

using client_impl::checksum;
using cuda::device_checksum;
using cuda::device_checksums;
using cuda::DeviceSpan;
using test::kBlockBytes;
using test::random_bytes;
using Lengths = std::initializer_list<std::uint64_t>;

// Device memory (cudaMalloc: 256-byte aligned), freed when the test ends.
class DeviceBuffer {
 public:
  explicit DeviceBuffer(std::uint64_t bytes) { TH_CUDA_CHECK(cudaMalloc(&data_, bytes)); }
  ~DeviceBuffer() { static_cast<void>(cudaFree(data_)); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  std::byte* at(std::uint64_t offset) const { return static_cast<std::byte*>(data_) + offset; }
  void upload(std::uint64_t offset, const std::vector<std::byte>& bytes) const {
    TH_CUDA_CHECK(cudaMemcpy(at(offset), bytes.data(), bytes.size(), cudaMemcpyHostToDevice));
  }

 private:
  void* data_ = nullptr;
};

class GpuChecksum : public ::testing::Test {
 protected:
  // A stream of its own, not the legacy default stream: the checksum must follow the stream it is given.
  void SetUp() override { TH_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking)); }
  void TearDown() override { TH_CUDA_CHECK(cudaStreamDestroy(stream_)); }

  cudaStream_t stream_ = nullptr;
};

TEST_F(GpuChecksum, EqualsCpuForEveryLength) {
  const std::vector<std::byte> data = random_bytes(1, 3 * kBlockBytes);
  DeviceBuffer device(data.size());
  device.upload(0, data);
  std::vector<std::uint64_t> lengths = test::long_path_lengths();
  lengths.insert(lengths.end(), Lengths{0, 1, 17, 128, 129, 240, kBlockBytes + 17, kBlockBytes + 240,
                                        2 * kBlockBytes + 241, 3 * kBlockBytes});
  for (std::uint64_t length : lengths) {
    ASSERT_LE(length, data.size());
    EXPECT_EQ(device_checksum(device.at(0), length, stream_), checksum(data.data(), length)) << "length " << length;
  }
}

TEST_F(GpuChecksum, EqualsCpuAtEveryAlignment) {
  // Tensors packed into one allocation start anywhere: the kernel must not issue unaligned loads.
  const std::vector<std::byte> data = random_bytes(2, 3 * kBlockBytes);
  DeviceBuffer device(data.size() + 16);
  for (std::uint64_t offset = 1; offset < 16; ++offset) {
    device.upload(offset, data);
    for (std::uint64_t length : Lengths{17, 241, 1025, 70000, kBlockBytes + 17, kBlockBytes + 241, 3 * kBlockBytes}) {
      EXPECT_EQ(device_checksum(device.at(offset), length, stream_), checksum(data.data(), length))
          << "offset " << offset << " length " << length;
    }
  }
}

TEST_F(GpuChecksum, OfNothing) {
  EXPECT_EQ(device_checksum(nullptr, 0, stream_), checksum(nullptr, 0));
  device_checksums({}, {}, stream_);
}

TEST_F(GpuChecksum, EqualsCpuForOneGibibyte) {
  std::vector<std::byte> data = random_bytes(3, 1ull << 30);
  DeviceBuffer device(data.size());
  device.upload(0, data);
  EXPECT_EQ(device_checksum(device.at(0), data.size(), stream_), checksum(data.data(), data.size()));
  // One flipped bit in the middle of block 700, on both sides.
  const std::uint64_t at = 700 * kBlockBytes + 12345;
  data[at] ^= std::byte{0x10};
  TH_CUDA_CHECK(cudaMemcpy(device.at(at), &data[at], 1, cudaMemcpyHostToDevice));
  EXPECT_EQ(device_checksum(device.at(0), data.size(), stream_), checksum(data.data(), data.size()));
}

TEST_F(GpuChecksum, FollowsItsStream) {
  // Work queued on the stream before (a memset here, a copy into the tensor in the client) is done
  // when the checksum reads the tensor.
  const std::uint64_t length = 5 * kBlockBytes + 3;
  DeviceBuffer device(length);
  device.upload(0, random_bytes(4, length));
  TH_CUDA_CHECK(cudaMemsetAsync(device.at(0), 0xAB, length, stream_));
  const std::vector<std::byte> expected(length, std::byte{0xAB});
  EXPECT_EQ(device_checksum(device.at(0), length, stream_), checksum(expected.data(), length));
}

TEST_F(GpuChecksum, BatchEqualsCpuPerTensor) {
  // 70000 tensors at assorted offsets in one allocation: more checksum blocks than the kernel's grid
  // (so its blocks grid-stride) and a long tensor table to search; every 7th tensor is short (its
  // one block is hashed on the host), some are empty, and a few span several checksum blocks.
  constexpr std::size_t kTensors = 70000;
  std::mt19937_64 generator(5);
  std::vector<DeviceSpan> tensors;
  std::vector<std::uint64_t> offsets;
  std::uint64_t end = 0;
  for (std::size_t i = 0; i < kTensors; ++i) {
    std::uint64_t bytes = 241 + generator() % 2048;
    if (i % 7 == 0) bytes = generator() % 241;
    if (i % 5000 == 1) bytes = 2 * kBlockBytes + generator() % kBlockBytes;
    end += generator() % 16;  // unaligned starts
    offsets.push_back(end);
    tensors.push_back({nullptr, bytes});
    end += bytes;
  }
  const std::vector<std::byte> data = random_bytes(6, end);
  DeviceBuffer device(end);
  device.upload(0, data);
  for (std::size_t i = 0; i < kTensors; ++i) tensors[i].data = tensors[i].bytes == 0 ? nullptr : device.at(offsets[i]);

  std::vector<std::uint64_t> out(kTensors);
  device_checksums(tensors, out, stream_);
  for (std::size_t i = 0; i < kTensors; ++i) {
    ASSERT_EQ(out[i], checksum(data.data() + offsets[i], tensors[i].bytes))
        << "tensor " << i << " at " << offsets[i] << ", " << tensors[i].bytes << " bytes";
  }
}

TEST_F(GpuChecksum, RefusesMismatchedOutput) {
  const DeviceSpan tensor{nullptr, 0};
  std::vector<std::uint64_t> out(2);
  EXPECT_THROW(device_checksums({&tensor, 1}, out, stream_), RequirementFailure);
}

}  // namespace
}  // namespace th

int main(int argc, char** argv) { return th::gpu_test::run_where_a_gpu_is(argc, argv); }
