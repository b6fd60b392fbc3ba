// XXH3-64's long path, taken apart so that a GPU computes it in parallel (issue 15).
//
// Scope: inputs of more than kMidSizeMax = 240 bytes, seed 0, the default secret: exactly what
// XXH3_64bits does for them (xxhash 0.8.1, XXH3_hashLong_64b_internal with the scalar
// accumulate_512 and scrambleAcc; the SIMD variants compute the same values). The functions are
// TH_HD, so g++ compiles them for tests/gpu/checksum_parts_test.cpp, which checks xxh3_by_parts
// against XXH3_64bits, and client/cuda/checksum.cu composes exactly the same functions in the
// same grouping on the device.
//
// The long path over `len` bytes, with acc[8] starting at kInitAcc:
//   - internal blocks of 1 KiB = 16 stripes of 64 bytes; full_blocks = (len - 1) / 1024 of them
//     are full: each accumulates its 16 stripes (stripe s with the secret at 8*s), then scrambles
//     every lane (secret at 128);
//   - the internal block after them accumulates last_stripes = ((len-1) - 1024*full_blocks) / 64
//     stripes (0 to 15) and is not scrambled;
//   - the input's last 64 bytes (overlapping the above) accumulate once more, secret at 121;
//   - the digest is avalanche(len * P64_1 + sum over i < 4 of
//     mul128_fold64(acc[2i] ^ secret[11+16i], acc[2i+1] ^ secret[19+16i])).
// Accumulating stripe word i adds to lanes i and i^1 only:
//   acc[i ^ 1] += word_i;   acc[i] += lo32(word_i ^ key_i) * hi32(word_i ^ key_i)
// so inside an internal block each lane receives a plain sum, independent of acc: lane_sum(). Only
// the scramble between internal blocks is sequential, and it mixes each lane with nothing but its
// own secret word: the 8 lanes fold independently, acc[i] = scramble_i(acc[i] + lane_sum_i).
//
// All arithmetic is modulo 2^64, as in xxhash. Device code cannot throw, so the only checks are in
// host-only code: xxh3_by_parts's preconditions, and that no 8-byte load is of an unaligned
// address (which would fault on the device).
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>

#include "core/assert.h"

#ifdef __CUDACC__
#define TH_HD __host__ __device__ __forceinline__
#else
#define TH_HD inline
#endif

namespace th::cuda::xxh3 {

static_assert(std::endian::native == std::endian::little,
              "XXH3 reads little-endian words, as the host and every CUDA device do");

inline constexpr std::uint64_t kMidSizeMax = 240;  // longer inputs take the long path
inline constexpr std::uint64_t kLanes = 8;         // u64 accumulators, one per 8 bytes of a stripe
inline constexpr std::uint64_t kStripeBytes = 64;
inline constexpr std::uint64_t kSecretBytes = 192;  // XXH_SECRET_DEFAULT_SIZE
inline constexpr std::uint64_t kSecretBytesPerStripe = 8;  // XXH_SECRET_CONSUME_RATE
inline constexpr std::uint64_t kStripesPerBlock = (kSecretBytes - kStripeBytes) / kSecretBytesPerStripe;  // 16
inline constexpr std::uint64_t kInternalBlockBytes = kStripesPerBlock * kStripeBytes;                     // 1 KiB
inline constexpr std::uint64_t kScrambleSecretOffset = kSecretBytes - kStripeBytes;                        // 128
inline constexpr std::uint64_t kLastStripeSecretOffset = kSecretBytes - kStripeBytes - 7;                  // 121, XXH_SECRET_LASTACC_START
inline constexpr std::uint64_t kMergeSecretOffset = 11;                                                    // XXH_SECRET_MERGEACCS_START

// xxhash's primes (xxh3_parts.cpp checks each against XXH_PRIME*, visible only to an
// implementation unit) and XXH3_avalanche's multiplier.
inline constexpr std::uint64_t kPrime32_1 = 0x9E3779B1u;
inline constexpr std::uint64_t kPrime32_2 = 0x85EBCA77u;
inline constexpr std::uint64_t kPrime32_3 = 0xC2B2AE3Du;
inline constexpr std::uint64_t kPrime64_1 = 0x9E3779B185EBCA87ull;
inline constexpr std::uint64_t kPrime64_2 = 0xC2B2AE3D27D4EB4Full;
inline constexpr std::uint64_t kPrime64_3 = 0x165667B19E3779F9ull;
inline constexpr std::uint64_t kPrime64_4 = 0x85EBCA77C2B2AE63ull;
inline constexpr std::uint64_t kPrime64_5 = 0x27D4EB2F165667C5ull;
inline constexpr std::uint64_t kAvalancheMultiplier = 0x165667919E3779F9ull;

// How many internal blocks the kernel sums side by side (one thread per block and lane: 256
// threads) before one thread per lane folds them. xxh3_by_parts groups them the same way, so that
// the host test runs the kernel's round bounds too.
inline constexpr std::uint64_t kRoundBlocks = 32;

// XXH3_kSecret, the default secret (xxh3_parts.cpp takes it from xxhash.h).
std::span<const std::uint8_t, kSecretBytes> default_secret();

TH_HD bool is_aligned8(const std::uint8_t* p) { return reinterpret_cast<std::uintptr_t>(p) % 8 == 0; }

// The little-endian u64 at `p`. kAligned: p is 8-byte aligned, one load; otherwise assembled from
// bytes, since an unaligned 8-byte load faults on a GPU (a tensor may start anywhere, and the
// input's last stripe and the secret at 121 and 11 are unaligned).
template <bool kAligned>
TH_HD std::uint64_t load_le64(const std::uint8_t* p) {
  if constexpr (kAligned) {
#ifdef __CUDA_ARCH__
    return *reinterpret_cast<const std::uint64_t*>(p);
#else
    // x86 would load an unaligned word without complaint; the check makes the host tests catch a
    // composition that would fault on the device.
    TH_ASSERT(is_aligned8(p), "an 8-byte load of an unaligned address");
    std::uint64_t word;  // memcpy: no aliasing question on the host, where this is one load too
    std::memcpy(&word, p, sizeof word);
    return word;
#endif
  } else {
    std::uint64_t word = 0;
    for (unsigned byte = 0; byte < sizeof word; ++byte) word |= std::uint64_t{p[byte]} << (8 * byte);
    return word;
  }
}

TH_HD std::uint64_t load_le64(const std::uint8_t* p) { return is_aligned8(p) ? load_le64<true>(p) : load_le64<false>(p); }

// XXH_mult32to64 of the halves of `key`.
TH_HD std::uint64_t multiply_halves(std::uint64_t key) {
  return std::uint64_t{static_cast<std::uint32_t>(key)} * static_cast<std::uint32_t>(key >> 32);
}

// What accumulate_512 of the stripe at `stripe`, with the secret at `key`, adds to lane `lane`
// (kAligned: both are 8-byte aligned).
template <bool kAligned>
TH_HD std::uint64_t stripe_lane_term(const std::uint8_t* stripe, const std::uint8_t* key, unsigned lane) {
  const std::uint64_t own = load_le64<kAligned>(stripe + 8 * lane);
  const std::uint64_t pair = load_le64<kAligned>(stripe + 8 * (lane ^ 1u));  // acc[i ^ 1] += word_i
  return pair + multiply_halves(own ^ load_le64<kAligned>(key + 8 * lane));
}

template <bool kAligned>
TH_HD std::uint64_t lane_sum_loads(const std::uint8_t* block, std::uint64_t stripes, const std::uint8_t* secret,
                                   unsigned lane) {
  std::uint64_t sum = 0;
  // A constant trip count, so that the device compiler unrolls it and issues the loads together.
  for (std::uint64_t stripe = 0; stripe < kStripesPerBlock; ++stripe) {
    if (stripe < stripes) {
      sum += stripe_lane_term<kAligned>(block + stripe * kStripeBytes, secret + stripe * kSecretBytesPerStripe, lane);
    }
  }
  return sum;
}

// The sum over the first `stripes` (at most 16) stripes of the internal block at `block` of what
// they add to lane `lane`: independent of the accumulators, so every internal block's sums can be
// computed at once. Stripe words are 8 bytes apart, so one check of `block` and `secret` tells
// whether all loads may be 8-byte ones.
TH_HD std::uint64_t lane_sum(const std::uint8_t* block, std::uint64_t stripes, const std::uint8_t* secret,
                             unsigned lane) {
  if (is_aligned8(block) && is_aligned8(secret)) return lane_sum_loads<true>(block, stripes, secret, lane);
  return lane_sum_loads<false>(block, stripes, secret, lane);
}

TH_HD std::uint64_t init_acc(unsigned lane) {
  constexpr std::uint64_t kInitAcc[kLanes] = {kPrime32_3, kPrime64_1, kPrime64_2, kPrime64_3,
                                              kPrime64_4, kPrime32_2, kPrime64_5, kPrime32_1};
  return kInitAcc[lane];
}

// scrambleAcc for one lane.
TH_HD std::uint64_t scramble_lane(std::uint64_t acc, const std::uint8_t* secret, unsigned lane) {
  acc ^= acc >> 47;
  acc ^= load_le64(secret + kScrambleSecretOffset + 8 * lane);
  return acc * kPrime32_1;
}

// How the long path cuts `len` (> kMidSizeMax) bytes into internal blocks.
struct LongShape {
  std::uint64_t full_blocks = 0;   // accumulated, then scrambled
  std::uint64_t last_stripes = 0;  // of internal block full_blocks, accumulated only (0 to 15)
};

TH_HD LongShape long_shape(std::uint64_t len) {
  LongShape shape;
  shape.full_blocks = (len - 1) / kInternalBlockBytes;
  shape.last_stripes = ((len - 1) - kInternalBlockBytes * shape.full_blocks) / kStripeBytes;
  return shape;
}

// The lane sum of internal block `index` of the input at `input` (0 past the last one, which has
// index full_blocks: the slots of a round that run beyond the input).
TH_HD std::uint64_t internal_lane_sum(const std::uint8_t* input, std::uint64_t index, const LongShape& shape,
                                      const std::uint8_t* secret, unsigned lane) {
  if (index > shape.full_blocks) return 0;
  const std::uint64_t stripes = index < shape.full_blocks ? kStripesPerBlock : shape.last_stripes;
  return lane_sum(input + index * kInternalBlockBytes, stripes, secret, lane);
}

// Folds the lane sums of internal blocks first .. first + kRoundBlocks - 1 (sums[j] is block
// first + j; those past the last one are ignored) into lane `lane`'s accumulator, in order.
TH_HD std::uint64_t fold_round(std::uint64_t acc, const std::uint64_t (*sums)[kLanes], std::uint64_t first,
                               const LongShape& shape, const std::uint8_t* secret, unsigned lane) {
  for (std::uint64_t j = 0; j < kRoundBlocks && first + j <= shape.full_blocks; ++j) {
    acc += sums[j][lane];
    if (first + j < shape.full_blocks) acc = scramble_lane(acc, secret, lane);
  }
  return acc;
}

// What the input's last stripe (its final 64 bytes) adds to lane `lane`.
TH_HD std::uint64_t last_stripe_term(const std::uint8_t* input, std::uint64_t len, const std::uint8_t* secret,
                                     unsigned lane) {
  return stripe_lane_term<false>(input + len - kStripeBytes, secret + kLastStripeSecretOffset, lane);
}

// XXH3_mul128_fold64: the 128-bit product's halves xor-ed, from 32-bit products (xxhash's portable
// form) so that host and device run the same code.
TH_HD std::uint64_t mul128_fold64(std::uint64_t lhs, std::uint64_t rhs) {
  const std::uint64_t lo_lo = std::uint64_t{static_cast<std::uint32_t>(lhs)} * static_cast<std::uint32_t>(rhs);
  const std::uint64_t hi_lo = (lhs >> 32) * static_cast<std::uint32_t>(rhs);
  const std::uint64_t lo_hi = std::uint64_t{static_cast<std::uint32_t>(lhs)} * (rhs >> 32);
  const std::uint64_t hi_hi = (lhs >> 32) * (rhs >> 32);
  const std::uint64_t cross = (lo_lo >> 32) + (hi_lo & 0xFFFFFFFFu) + lo_hi;
  const std::uint64_t upper = (hi_lo >> 32) + (cross >> 32) + hi_hi;
  const std::uint64_t lower = (cross << 32) | (lo_lo & 0xFFFFFFFFu);
  return lower ^ upper;
}

TH_HD std::uint64_t avalanche(std::uint64_t hash) {
  hash ^= hash >> 37;
  hash *= kAvalancheMultiplier;
  return hash ^ (hash >> 32);
}

// mergeAccs and avalanche: the digest of `len` bytes from the final accumulators.
TH_HD std::uint64_t merge_accs(const std::uint64_t* acc, const std::uint8_t* secret, std::uint64_t len) {
  std::uint64_t result = len * kPrime64_1;
  for (unsigned pair = 0; pair < kLanes / 2; ++pair) {
    const std::uint8_t* key = secret + kMergeSecretOffset + 16 * pair;
    result += mul128_fold64(acc[2 * pair] ^ load_le64(key), acc[2 * pair + 1] ^ load_le64(key + 8));
  }
  return avalanche(result);
}

// XXH3_64bits(data, len) for len > kMidSizeMax, composed from the parts above exactly as the
// kernel composes them, round by round (host only: the test's oracle, slower than XXH3_64bits).
inline std::uint64_t xxh3_by_parts(const std::byte* data, std::uint64_t len) {
  TH_REQUIRE(len > kMidSizeMax, "the long path takes more than", kMidSizeMax, "bytes, not", len);
  TH_REQUIRE(data != nullptr);
  const auto* input = reinterpret_cast<const std::uint8_t*>(data);
  const std::uint8_t* secret = default_secret().data();
  const LongShape shape = long_shape(len);
  std::uint64_t acc[kLanes];
  for (unsigned lane = 0; lane < kLanes; ++lane) acc[lane] = init_acc(lane);
  for (std::uint64_t first = 0; first <= shape.full_blocks; first += kRoundBlocks) {
    std::uint64_t sums[kRoundBlocks][kLanes];  // the kernel's shared sums: slot j is block first + j
    for (unsigned slot = 0; slot < kRoundBlocks; ++slot) {
      for (unsigned lane = 0; lane < kLanes; ++lane) sums[slot][lane] = internal_lane_sum(input, first + slot, shape, secret, lane);
    }
    for (unsigned lane = 0; lane < kLanes; ++lane) acc[lane] = fold_round(acc[lane], sums, first, shape, secret, lane);
  }
  for (unsigned lane = 0; lane < kLanes; ++lane) acc[lane] += last_stripe_term(input, len, secret, lane);
  return merge_accs(acc, secret, len);
}

}  // namespace th::cuda::xxh3
