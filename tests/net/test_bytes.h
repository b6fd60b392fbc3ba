// Test bytes for the data-plane suites (TCP in tests/net, RDMA in tests/rdma).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace th::testing_bytes {

// Bytes that name their position: a byte in the wrong place cannot pass for the right one.
inline std::vector<std::byte> pattern(std::size_t bytes, std::uint64_t seed) {
  std::vector<std::byte> data(bytes);
  std::uint64_t state = seed * 0x9E3779B97F4A7C15ull + 1;
  for (auto& byte : data) {
    state ^= state << 13;
    state ^= state >> 7;
    state ^= state << 17;
    byte = static_cast<std::byte>(state);
  }
  return data;
}

}  // namespace th::testing_bytes
