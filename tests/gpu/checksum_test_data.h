// Inputs shared by the checksum tests (checksum_parts_test on the CPU, gpu_checksum_test on a GPU):
// the same lengths and the same seeded bytes on both sides.
#pragma once

#include <cstddef>
#include <cstdint>
#include <random>
#include <vector>

#include "client/checksum.h"

namespace th::test {

inline constexpr std::uint64_t kBlockBytes = client_impl::kChecksumBlockBytes;

// `count` bytes from mt19937_64 (a fixed algorithm, so the same bytes everywhere) seeded with `seed`.
inline std::vector<std::byte> random_bytes(std::uint64_t seed, std::uint64_t count) {
  std::mt19937_64 generator(seed);
  std::vector<std::byte> bytes(count);
  for (std::uint64_t i = 0; i < count; i += 8) {
    std::uint64_t word = generator();
    for (std::uint64_t j = i; j < i + 8 && j < count; ++j, word >>= 8) bytes[j] = static_cast<std::byte>(word);
  }
  return bytes;
}

// Lengths that reach every branch of XXH3's long path: the first long input (241), internal-block
// and stripe boundaries, the kernel's rounds of 32 internal blocks, 64 KiB multiples +- 1..63 (every
// count of stripes in the last internal block), a checksum block and one past it, and random lengths
// up to 3 MiB (drawn with a fixed seed).
inline std::vector<std::uint64_t> long_path_lengths() {
  std::vector<std::uint64_t> lengths = {241,  255,  256,  257,  319,  320,   321,   1023,  1024,       1025,
                                        1087, 1088, 1089, 2047, 2048, 16383, 16384, 16385, 32 * 1024 - 1,
                                        32 * 1024, 32 * 1024 + 1, 33 * 1024, 33 * 1024 + 1, kBlockBytes - 1,
                                        kBlockBytes, kBlockBytes + 1};
  for (std::uint64_t multiple : {1u, 2u, 15u}) {
    for (std::uint64_t delta = 1; delta <= 63; ++delta) {
      lengths.push_back(multiple * 65536 - delta);
      lengths.push_back(multiple * 65536 + delta);
    }
  }
  std::mt19937_64 generator(20240615);
  for (int i = 0; i < 24; ++i) lengths.push_back(241 + generator() % (3 * kBlockBytes - 241));
  return lengths;
}

}  // namespace th::test
