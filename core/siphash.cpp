#include "core/siphash.h"

#include <bit>

namespace th {
namespace {

struct SipState {
  std::uint64_t v0, v1, v2, v3;

  void round() {
    v0 += v1;
    v1 = std::rotl(v1, 13);
    v1 ^= v0;
    v0 = std::rotl(v0, 32);
    v2 += v3;
    v3 = std::rotl(v3, 16);
    v3 ^= v2;
    v0 += v3;
    v3 = std::rotl(v3, 21);
    v3 ^= v0;
    v2 += v1;
    v1 = std::rotl(v1, 17);
    v1 ^= v2;
    v2 = std::rotl(v2, 32);
  }

  void absorb(std::uint64_t word) {  // two compression rounds per word (the "2" of 2-4)
    v3 ^= word;
    round();
    round();
    v0 ^= word;
  }

  std::uint64_t squeeze(std::uint64_t flag) {  // four finalisation rounds (the "4")
    v2 ^= flag;
    for (int i = 0; i < 4; ++i) round();
    return v0 ^ v1 ^ v2 ^ v3;
  }
};

std::uint64_t load_le(const std::uint8_t* bytes, std::size_t count) {
  std::uint64_t word = 0;
  for (std::size_t i = 0; i < count; ++i) word |= static_cast<std::uint64_t>(bytes[i]) << (8 * i);
  return word;
}

}  // namespace

std::array<std::uint64_t, 2> siphash128(const SipKey& key, std::span<const std::uint8_t> message) {
  SipState state{key[0] ^ 0x736f6d6570736575ULL, key[1] ^ 0x646f72616e646f6dULL,
                 key[0] ^ 0x6c7967656e657261ULL, key[1] ^ 0x7465646279746573ULL};
  state.v1 ^= 0xee;  // the 128-bit variant
  const std::size_t whole = message.size() / 8 * 8;
  for (std::size_t i = 0; i < whole; i += 8) state.absorb(load_le(message.data() + i, 8));
  state.absorb((static_cast<std::uint64_t>(message.size()) << 56) | load_le(message.data() + whole, message.size() - whole));
  const std::uint64_t first = state.squeeze(0xee);
  state.v1 ^= 0xdd;
  const std::uint64_t second = state.squeeze(0);
  return {first, second};
}

}  // namespace th
