// The simulator's only source of randomness: xoshiro256** seeded through splitmix64, written out
// here so that a seed gives the same numbers with every compiler and standard library (std::mt19937
// would too, but std::uniform_int_distribution and friends do not).
#pragma once

#include <cstdint>

#include "core/assert.h"

namespace th::sim {

class Rng {
 public:
  explicit Rng(std::uint64_t seed) {
    std::uint64_t x = seed;
    for (std::uint64_t& word : state_) word = splitmix64(x);
  }

  std::uint64_t next() {
    const std::uint64_t result = rotl(state_[1] * 5, 7) * 9;
    const std::uint64_t t = state_[1] << 17;
    state_[2] ^= state_[0];
    state_[3] ^= state_[1];
    state_[1] ^= state_[2];
    state_[0] ^= state_[3];
    state_[2] ^= t;
    state_[3] = rotl(state_[3], 45);
    return result;
  }

  // Uniform in [0, bound): Lemire's multiply-shift with rejection, so no modulo bias.
  std::uint64_t below(std::uint64_t bound) {
    TH_REQUIRE(bound > 0);
    __extension__ typedef unsigned __int128 u128;  // GCC and Clang; pedantic ISO C++ has none
    while (true) {
      const u128 product = static_cast<u128>(next()) * bound;
      const auto low = static_cast<std::uint64_t>(product);
      if (low >= bound || low >= (0 - bound) % bound) return static_cast<std::uint64_t>(product >> 64);
    }
  }

  // Uniform in [low, high].
  std::int64_t range(std::int64_t low, std::int64_t high) {
    TH_REQUIRE(low <= high);
    return low + static_cast<std::int64_t>(below(static_cast<std::uint64_t>(high - low) + 1));
  }

  // Uniform in [0, 1), from the top 53 bits.
  double unit() { return static_cast<double>(next() >> 11) * 0x1.0p-53; }

  bool chance(double probability) { return unit() < probability; }

 private:
  static std::uint64_t rotl(std::uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }
  static std::uint64_t splitmix64(std::uint64_t& x) {
    std::uint64_t z = (x += 0x9E3779B97F4A7C15ULL);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
  }

  std::uint64_t state_[4];
};

}  // namespace th::sim
