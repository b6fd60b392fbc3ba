#include "client/checksum.h"

#include <xxhash.h>

#include <algorithm>
#include <bit>
#include <new>
#include <vector>

#include "client/xxh3_build_of_this_unit.h"
#include "core/assert.h"

namespace th::client_impl {

// AVX2's build is compiled in only for x86 (client/CMakeLists.txt), and checked for here again.
#if defined(TH_HAVE_XXH3_AVX2) && (defined(__x86_64__) || defined(__i386__))
#define TH_XXH3_AVX2 1
#endif

namespace {

const Xxh3Build& chosen_build() {
  static const Xxh3Build& build = []() -> const Xxh3Build& {
#if defined(TH_XXH3_AVX2)
    if (xxh3_avx2_usable()) return xxh3_avx2_build();
#endif
    return build_of_this_unit();  // libxxhash as the platform builds it (baseline x86-64 on Debian)
  }();
  return build;
}

}  // namespace

bool xxh3_avx2_usable() {
#if defined(TH_XXH3_AVX2)
  return __builtin_cpu_supports("avx2");  // (libgcc's check includes the OS saving AVX state)
#else
  return false;
#endif
}

std::uint64_t xxh3_64_avx2(const std::byte* data, std::uint64_t bytes) {
  TH_REQUIRE(xxh3_avx2_usable(), "XXH3 for AVX2 is not built here (not x86-64) or this CPU has no AVX2");
#if defined(TH_XXH3_AVX2)
  return xxh3_avx2_build().hash(data, bytes);
#else
  (void)data;
  (void)bytes;
  return 0;
#endif
}

std::uint64_t checksum_block(const std::byte* data, std::uint64_t bytes) {
  TH_REQUIRE((data != nullptr || bytes == 0) && bytes <= kChecksumBlockBytes, "a block of", bytes, "bytes");
  return chosen_build().hash(data, bytes);
}

BlockHasher::BlockHasher() : build_(&chosen_build()), state_(build_->new_state()) {
  if (state_ == nullptr) throw std::bad_alloc();
}

BlockHasher::~BlockHasher() { build_->free_state(state_); }

void BlockHasher::update(const std::byte* data, std::uint64_t bytes) {
  TH_REQUIRE((data != nullptr || bytes == 0) && bytes <= kChecksumBlockBytes - fed_bytes_, "a block's piece of", bytes,
             "bytes after", fed_bytes_);
  build_->update(state_, data, bytes);
  fed_bytes_ += bytes;
}

std::uint64_t BlockHasher::finish() {
  const std::uint64_t digest = build_->digest(state_);
  build_->reset(state_);
  fed_bytes_ = 0;
  return digest;
}

std::uint64_t checksum_of_digests(std::span<const std::uint64_t> digests) {
  // The definition hashes little-endian bytes: on a little-endian host, the array's own bytes.
  static_assert(std::endian::native == std::endian::little, "checksum_of_digests assumes a little-endian host");
  return XXH3_64bits(digests.data(), digests.size_bytes());
}

std::uint64_t checksum(const std::byte* data, std::uint64_t bytes) {
  TH_REQUIRE(data != nullptr || bytes == 0, "no data for", bytes, "bytes");
  const std::uint64_t blocks = checksum_blocks(bytes);
  std::vector<std::uint64_t> digests(blocks);
  for (std::uint64_t block = 0; block < blocks; ++block) {
    const std::uint64_t offset = block * kChecksumBlockBytes;
    digests[block] = checksum_block(data + offset, std::min(kChecksumBlockBytes, bytes - offset));
  }
  return checksum_of_digests(digests);
}

}  // namespace th::client_impl
