// The checksum every tensor is verified with, in host or device memory alike (issue 15).
//
// Definition (the "blocked checksum"): cut the tensor's n bytes into k = ceil(n / B) blocks of
// B = kChecksumBlockBytes = 1 MiB (block i is bytes [i*B, min(n, (i+1)*B)); only the last may be
// shorter), hash each block with XXH3-64 (seed 0, default secret) to a digest d_i, and hash the
// digests' bytes, each as a little-endian u64, in block order:
//
//   checksum(data, n) = XXH3_64bits(d_0 || d_1 || ... || d_{k-1}),   d_i = XXH3_64bits(block i)
//
// so an empty tensor (k = 0) has XXH3_64bits of the empty input.
//
// Why not XXH3 over the whole tensor: that is one sequential pass, which a GPU cannot spread over
// its cores. Blocks hash independently (client/cuda/checksum.cu gives each its own thread block),
// and verifying device memory copies only the digests to the host, 8 bytes per MiB, never the
// weights. A publisher and a reader may hold the same tensor one in host and one in device memory,
// so both compute this one definition.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

namespace th::client_impl {

inline constexpr std::uint64_t kChecksumBlockBytes = 1ull << 20;

// k = ceil(bytes / kChecksumBlockBytes): how many digests the checksum of `bytes` bytes combines.
constexpr std::uint64_t checksum_blocks(std::uint64_t bytes) {
  return bytes / kChecksumBlockBytes + (bytes % kChecksumBlockBytes != 0 ? 1 : 0);
}

// The blocked checksum of host memory (`data` may be null when `bytes` is 0).
std::uint64_t checksum(const std::byte* data, std::uint64_t bytes);

// XXH3_64bits over the digests' little-endian bytes: the last step of checksum(), shared with the
// GPU path, which computes the digests on the device.
std::uint64_t checksum_of_digests(std::span<const std::uint64_t> digests);

// XXH3_64bits of one block (at most kChecksumBlockBytes): a digest d_i of the definition.
std::uint64_t checksum_block(const std::byte* data, std::uint64_t bytes);

struct Xxh3Build;  // client/xxh3_build.h

// The digest of one block fed in pieces, in order, as they arrive: a reader hashes each piece right
// after receiving it, while it is still in cache (client/receive.h). finish() equals
// checksum_block of the pieces together, and starts the next block.
class BlockHasher {
 public:
  BlockHasher();  // throws std::bad_alloc when no memory is to be had for the state
  ~BlockHasher();
  BlockHasher(const BlockHasher&) = delete;
  BlockHasher& operator=(const BlockHasher&) = delete;

  void update(const std::byte* data, std::uint64_t bytes);  // at most a block in all
  std::uint64_t fed_bytes() const { return fed_bytes_; }
  std::uint64_t finish();

 private:
  const Xxh3Build* build_;  // the build checksum_block uses
  void* state_;             // owned: build_'s streaming state
  std::uint64_t fed_bytes_ = 0;
};

// XXH3_64bits built for AVX2 (client/xxh3_avx2.cpp), where the build has it (x86-64) and the CPU
// can run it (checksum_block then uses it); callable only when usable. For tests.
bool xxh3_avx2_usable();
std::uint64_t xxh3_64_avx2(const std::byte* data, std::uint64_t bytes);

}  // namespace th::client_impl
