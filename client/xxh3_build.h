// One build of XXH3-64 (libthclient's private header): the one-shot hash and the streaming state,
// as libxxhash's baseline build (client/checksum.cpp) or the AVX2 build (client/xxh3_avx2.cpp)
// compiles them. Every build gives the same digests; client/checksum.cpp picks one by the CPU.
#pragma once

#include <cstddef>
#include <cstdint>

namespace th::client_impl {

struct Xxh3Build {
  std::uint64_t (*hash)(const std::byte* data, std::uint64_t bytes);
  // A streaming state (XXH3_state_t of this build): new_state returns one reset, or null when no
  // memory is to be had; free_state takes null too.
  void* (*new_state)();
  void (*free_state)(void* state);
  void (*reset)(void* state);
  void (*update)(void* state, const std::byte* data, std::uint64_t bytes);
  std::uint64_t (*digest)(const void* state);
};

// The AVX2 build; only where TH_HAVE_XXH3_AVX2 is defined (x86), to be used only on a CPU with AVX2.
const Xxh3Build& xxh3_avx2_build();

}  // namespace th::client_impl
