// The blocked checksum of device memory (client/checksum.h) on the GPU.
//
// checksum_blocks.h gives every block of every tensor a digest slot. One kernel computes the digest
// of every slot of more than 240 bytes, XXH3's long path: one thread block (256 threads) per slot,
// grid-striding when there are more slots than the grid holds. Its threads work in rounds of
// xxh3::kRoundBlocks = 32 internal 1 KiB blocks: thread (slot, lane) computes the lane sum of
// internal block round*32 + slot, which needs no accumulator; then the 8 threads of slot 0 fold the
// round's 32 sums into their lane's accumulator, in order (the only sequential part, per lane);
// after the last round they add the last stripe, and thread 0 merges the 8 lanes into the digest.
// That is exactly xxh3::xxh3_by_parts, which the CPU test checks against XXH3_64bits.
// A block of at most 240 bytes takes XXH3's short paths: its bytes (240 at most) are copied to the
// host and hashed there, rather than porting three more code paths to the device for a rare case.
//
// Scratch device memory: one cudaMallocAsync per call on the caller's stream, freed on it too
// (stream-ordered: no device-wide synchronisation, and no state kept between calls). Its size:
// 8 bytes per slot (ceil(bytes / 1 MiB) for each tensor), 24 bytes per non-empty tensor, and
// 240 bytes per tensor whose last block is short; for an 8 GiB tensor, 64 KiB and 24 bytes.
#include "client/cuda/checksum.h"

#include <algorithm>
#include <limits>
#include <utility>
#include <vector>

#include "client/checksum.h"
#include "client/cuda/xxh3_parts.h"
#include "core/assert.h"

namespace th::cuda {
namespace {

using client_impl::kChecksumBlockBytes;
using xxh3::kLanes;
using xxh3::kMidSizeMax;
using xxh3::kRoundBlocks;
using xxh3::kSecretBytes;

constexpr unsigned kThreads = kRoundBlocks * kLanes;  // one per (internal block of a round, lane)
// Grid-striding past this many thread blocks keeps gridDim.x far below every architecture's limit
// (2^31 - 1) for any tensor size, while filling a GPU many times over (132 SMs on an H100).
constexpr std::uint64_t kGridBlocksMax = 1u << 16;

static_assert(kChecksumBlockBytes > kMidSizeMax, "only a tensor's last block can take XXH3's short paths");
static_assert(kThreads >= kSecretBytes, "each thread copies at most one byte of the secret");

// The default secret, passed by value: kernel parameters live in the constant bank, so this is the
// __constant__ copy without a per-device cudaMemcpyToSymbol (and the state that would need).
struct Secret {
  std::uint8_t bytes[kSecretBytes];
};

// digests[slot] = XXH3_64bits of the slot's block, for every slot of more than 240 bytes (the
// others are left alone for the host). Launched with kThreads threads per block.
__global__ void __launch_bounds__(kThreads)
    digest_blocks(const TensorBlocks* table, std::uint32_t table_count, std::uint64_t slot_count,
                  std::uint64_t* digests, Secret secret_parameter) {
  // In shared memory, the secret's aligned words are single 8-byte loads, and the lanes' different
  // words do not serialise as they would in the constant cache.
  __shared__ alignas(8) std::uint8_t secret[kSecretBytes];
  __shared__ std::uint64_t sums[kRoundBlocks][kLanes];
  __shared__ std::uint64_t acc[kLanes];
  if (threadIdx.x < kSecretBytes) secret[threadIdx.x] = secret_parameter.bytes[threadIdx.x];
  __syncthreads();

  const unsigned lane = threadIdx.x % kLanes;
  const unsigned slot = threadIdx.x / kLanes;  // within a round
  // The loop variables are the same in every thread of the block, so all reach each __syncthreads.
  for (std::uint64_t digest = blockIdx.x; digest < slot_count; digest += gridDim.x) {
    const BlockInput block = block_input(table, table_count, digest);
    if (block.bytes <= kMidSizeMax) continue;
    const xxh3::LongShape shape = xxh3::long_shape(block.bytes);

    std::uint64_t lane_acc = xxh3::init_acc(lane);  // meaningful in slot 0's threads
    for (std::uint64_t first = 0; first <= shape.full_blocks; first += kRoundBlocks) {
      sums[slot][lane] = xxh3::internal_lane_sum(block.data, first + slot, shape, secret, lane);
      __syncthreads();
      if (slot == 0) lane_acc = xxh3::fold_round(lane_acc, sums, first, shape, secret, lane);
      __syncthreads();  // sums is rewritten next round
    }
    if (slot == 0) acc[lane] = lane_acc + xxh3::last_stripe_term(block.data, block.bytes, secret, lane);
    __syncthreads();
    // acc is next written after the next digest's rounds, whose __syncthreads thread 0 reaches only
    // once done here.
    if (threadIdx.x == 0) digests[digest] = xxh3::merge_accs(acc, secret, block.bytes);
  }
}

// Device memory for one call, allocated and freed in stream order (cudaMallocAsync: from the
// device's pool, without the device-wide synchronisation of cudaMalloc and cudaFree).
class StreamScratch {
 public:
  StreamScratch(std::uint64_t bytes, cudaStream_t stream) : stream_(stream) {
    TH_CUDA_CHECK(cudaMallocAsync(&data_, bytes, stream));
  }
  // Frees it in stream order, after everything queued so far (the kernel and copies that use it).
  void release() {
    void* data = std::exchange(data_, nullptr);
    TH_CUDA_CHECK(cudaFreeAsync(data, stream_));
  }
  // Frees only on a failure path (release() did not run): an error here has nothing to add to the
  // one already being thrown.
  ~StreamScratch() {
    if (data_ != nullptr) static_cast<void>(cudaFreeAsync(data_, stream_));
  }
  StreamScratch(const StreamScratch&) = delete;
  StreamScratch& operator=(const StreamScratch&) = delete;

  std::byte* at(std::uint64_t offset) const { return static_cast<std::byte*>(data_) + offset; }

 private:
  cudaStream_t stream_;
  void* data_ = nullptr;
};

constexpr std::uint64_t align8(std::uint64_t bytes) { return (bytes + 7) / 8 * 8; }

// Fills `digests` (one per slot of `plan`, which has a block): the long blocks on the device, the
// short ones on the host.
void compute_digests(const BlockPlan& plan, std::span<std::uint64_t> digests, cudaStream_t stream) {
  TH_ASSERT(!plan.table.empty());
  TH_ASSERT(digests.size() == plan.slots);
  TH_REQUIRE(plan.table.size() <= std::numeric_limits<std::uint32_t>::max(), plan.table.size(), "tensors");
  // Scratch: the digests, the table, then each short block's bytes in a kMidSizeMax-byte place.
  const std::uint64_t table_offset = align8(digests.size_bytes());
  const std::uint64_t tails_offset = align8(table_offset + plan.table.size() * sizeof(TensorBlocks));
  StreamScratch scratch(tails_offset + plan.short_blocks.size() * kMidSizeMax, stream);
  auto* device_digests = reinterpret_cast<std::uint64_t*>(scratch.at(0));
  auto* device_table = reinterpret_cast<TensorBlocks*>(scratch.at(table_offset));

  if (plan.slots > plan.short_blocks.size()) {  // a block for the kernel
    // From pageable memory: returns once the table was staged, so it may go before the copy runs.
    TH_CUDA_CHECK(cudaMemcpyAsync(device_table, plan.table.data(), plan.table.size() * sizeof(TensorBlocks),
                                  cudaMemcpyHostToDevice, stream));
    Secret secret;
    std::copy_n(xxh3::default_secret().begin(), kSecretBytes, secret.bytes);
    const auto grid = static_cast<unsigned>(std::min(plan.slots, kGridBlocksMax));
    digest_blocks<<<grid, kThreads, 0, stream>>>(device_table, static_cast<std::uint32_t>(plan.table.size()),
                                                plan.slots, device_digests, secret);
    TH_CUDA_CHECK(cudaGetLastError());
    // The short blocks' slots come too, unwritten; hash_short_blocks overwrites them.
    TH_CUDA_CHECK(cudaMemcpyAsync(digests.data(), device_digests, digests.size_bytes(), cudaMemcpyDeviceToHost,
                                  stream));
  }
  // The short blocks gather on the device first: one copy to the host instead of one each.
  for (std::size_t i = 0; i < plan.short_blocks.size(); ++i) {
    TH_CUDA_CHECK(cudaMemcpyAsync(scratch.at(tails_offset + i * kMidSizeMax), plan.short_blocks[i].data,
                                  plan.short_blocks[i].bytes, cudaMemcpyDeviceToDevice, stream));
  }
  std::vector<std::byte> tails(plan.short_blocks.size() * kMidSizeMax);
  if (!tails.empty()) {
    TH_CUDA_CHECK(cudaMemcpyAsync(tails.data(), scratch.at(tails_offset), tails.size(), cudaMemcpyDeviceToHost,
                                  stream));
  }
  scratch.release();
  TH_CUDA_CHECK(cudaStreamSynchronize(stream));
  hash_short_blocks(plan, tails, digests);
}

}  // namespace

void device_checksums(std::span<const DeviceSpan> tensors, std::span<std::uint64_t> out, cudaStream_t stream) {
  TH_REQUIRE(out.size() == tensors.size(), out.size(), "results for", tensors.size(), "tensors");
  const BlockPlan plan = plan_blocks(tensors);
  std::vector<std::uint64_t> digests(plan.slots);
  if (!plan.table.empty()) compute_digests(plan, digests, stream);
  combine_digests(plan, digests, out);
}

std::uint64_t device_checksum(const std::byte* device_data, std::uint64_t bytes, cudaStream_t stream) {
  const DeviceSpan tensor{device_data, bytes};
  std::uint64_t result = 0;
  device_checksums({&tensor, 1}, {&result, 1}, stream);
  return result;
}

}  // namespace th::cuda
