// The TCP data plane's frames (not installed): what net/data_plane.cpp's server and
// net/data_pull.cpp's reader send each other. Fixed-size headers in the host's byte order: every
// TensorHub host is little-endian (x86-64, aarch64), and the static_assert below keeps it that
// way. Payload bytes follow a response header.
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>

#include "core/types.h"
#include "net/data_plane.h"

namespace th::net {

static_assert(std::endian::native == std::endian::little, "the data plane's frames are little-endian");

inline constexpr std::uint32_t kMagic = 0x32504454;  // "TDP2": requests carry the grant's secret

struct ReadRequestFrame {
  std::uint32_t magic = kMagic;
  std::uint32_t epoch = 0;
  std::uint64_t transfer = 0;
  std::uint32_t region = 0;
  std::uint32_t wait_for_bytes = 0;  // 1: if nothing is ready yet, wait (bounded) for progress
  std::uint64_t offset = 0;
  std::uint64_t length = 0;
  GrantSecret secret{};  // the grant's capability, as the hub told it to the reader
};
static_assert(sizeof(ReadRequestFrame) == kDataRequestBytes);

enum class FrameStatus : std::uint32_t { kOk = 0, kNoGrant = 1, kOutOfBounds = 2 };

// In a time that does not depend on where the secrets differ (a timing oracle would let a guesser
// find a secret word by word).
inline bool same_secret(const GrantSecret& a, const GrantSecret& b) {
  std::uint64_t differ = 0;
  for (std::size_t i = 0; i < a.size(); ++i) differ |= a[i] ^ b[i];
  return differ == 0;
}

// ReadResponseFrame::flags. kSourceAdvanced, on an empty answer only: nothing is ready at the
// offset asked yet, but the source's own ready prefix grew while it waited. A reader resumed
// ahead of a source still receiving waits for it to catch up, and counts this as progress rather
// than calling a healthy source stalled (issue 34). (A reader before it ignores the field, and a
// source before it sends 0.)
inline constexpr std::uint32_t kSourceAdvanced = 1;

struct ReadResponseFrame {
  std::uint32_t status = 0;
  std::uint32_t flags = 0;
  std::uint64_t length = 0;  // payload bytes that follow (the ready prefix of what was asked)
};
static_assert(sizeof(ReadResponseFrame) == 16);

}  // namespace th::net
