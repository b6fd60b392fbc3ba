#include "client/patch_writer.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>

#include "client/convert.h"
#include "core/assert.h"

namespace th::client_impl {
namespace {

// Elements converted at a time into a buffer on the stack, then compared with the published ones.
constexpr std::uint64_t kBatchElements = 4096;

std::uint64_t patch_bytes_max(std::uint64_t tensor_bytes, double fraction_max) {
  return static_cast<std::uint64_t>(std::floor(static_cast<double>(tensor_bytes) * fraction_max));
}

}  // namespace

PatchWriter::PatchWriter(DType dtype, std::span<std::byte> published, std::uint64_t base_checksum,
                         double fraction_max)
    : dtype_(dtype),
      element_bytes_(dtype_bytes(dtype)),
      published_(published),
      builder_(element_bytes_, published.size(), base_checksum, patch_bytes_max(published.size(), fraction_max)) {
  TH_REQUIRE(fraction_max >= 0 && fraction_max <= 1, "a fraction of the dense bytes", fraction_max);
}

void PatchWriter::write(DType source_dtype, const std::byte* source, std::uint64_t count) {
  const std::uint64_t elements = published_.size() / element_bytes_;
  TH_REQUIRE(count <= elements - written_, "no more elements than the buffer has left", count, elements - written_);
  TH_REQUIRE(convertible(source_dtype, dtype_), "a source dtype that converts to the buffer's");
  const std::uint32_t source_bytes = dtype_bytes(source_dtype);
  std::array<std::byte, kBatchElements * 8> batch;
  for (std::uint64_t done = 0; done < count;) {
    const std::uint64_t n = std::min(kBatchElements, count - done);
    convert_elements(source_dtype, source + done * source_bytes, dtype_, batch.data(), n);
    std::byte* at = published_.data() + (written_ + done) * element_bytes_;
    const std::uint64_t bytes = n * element_bytes_;
    // Most elements keep their bits: compare 8 bytes at a time, look closer only where they differ.
    for (std::uint64_t word = 0; word < bytes; word += 8) {
      const std::uint64_t word_bytes = std::min<std::uint64_t>(8, bytes - word);
      if (std::memcmp(at + word, batch.data() + word, word_bytes) == 0) continue;
      for (std::uint64_t offset = word; offset < word + word_bytes; offset += element_bytes_) {
        if (std::memcmp(at + offset, batch.data() + offset, element_bytes_) != 0) {
          builder_.changed(written_ + done + offset / element_bytes_, batch.data() + offset);
        }
      }
    }
    std::memcpy(at, batch.data(), bytes);
    done += n;
  }
  written_ += count;
}

std::optional<std::vector<std::byte>> PatchWriter::finish() {
  TH_REQUIRE(written_ == published_.size() / element_bytes_, "every element written before finish()", written_);
  return builder_.finish();
}

}  // namespace th::client_impl
