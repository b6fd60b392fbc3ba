// The Xxh3Build (client/xxh3_build.h) of the XXH3 the including file is compiled with: included,
// after <xxhash.h>, by client/checksum.cpp (libxxhash's build) and client/xxh3_avx2.cpp
// (XXH_INLINE_ALL with -mavx2). In an unnamed namespace on purpose: each file keeps its own copy,
// compiled with its own flags (an inline function both shared would be one definition, the linker's
// pick of the two).
#pragma once

#include "client/xxh3_build.h"

namespace th::client_impl {
namespace {

XXH3_state_t* state_of(void* state) { return static_cast<XXH3_state_t*>(state); }

const Xxh3Build& build_of_this_unit() {
  static const Xxh3Build build{
      [](const std::byte* data, std::uint64_t bytes) -> std::uint64_t { return XXH3_64bits(data, bytes); },
      []() -> void* {
        XXH3_state_t* state = XXH3_createState();
        if (state != nullptr) XXH3_64bits_reset(state);
        return state;
      },
      [](void* state) { XXH3_freeState(state_of(state)); },
      [](void* state) { XXH3_64bits_reset(state_of(state)); },
      [](void* state, const std::byte* data, std::uint64_t bytes) { XXH3_64bits_update(state_of(state), data, bytes); },
      [](const void* state) -> std::uint64_t { return XXH3_64bits_digest(static_cast<const XXH3_state_t*>(state)); },
  };
  return build;
}

}  // namespace
}  // namespace th::client_impl
