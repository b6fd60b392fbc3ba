// SipHash-2-4 with a 128-bit output (Aumasson and Bernstein): a keyed pseudo-random function. The
// hub derives each data-plane grant's secret from (transfer, epoch) under a key the shell draws
// from the OS, so the core stays pure and deterministic while nobody without the key can compute
// a grant's secret.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <span>

namespace th {

using SipKey = std::array<std::uint64_t, 2>;

// The 16 output bytes (in the reference implementation's order) as two little-endian words.
std::array<std::uint64_t, 2> siphash128(const SipKey& key, std::span<const std::uint8_t> message);

}  // namespace th
