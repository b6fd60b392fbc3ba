#include "client/checksum.h"

#include <xxhash.h>

#include <algorithm>
#include <bit>
#include <vector>

#include "core/assert.h"

namespace th::client_impl {

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
    digests[block] = XXH3_64bits(data + offset, std::min(kChecksumBlockBytes, bytes - offset));
  }
  return checksum_of_digests(digests);
}

}  // namespace th::client_impl
