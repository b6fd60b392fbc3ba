#include "client/patch_writer.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>

#include "client/checksum.h"
#include "client/convert.h"
#include "core/assert.h"

namespace th::client_impl {
namespace {

// A patch's blocks are the checksum's: a reader can apply and verify a block at a time.
static_assert(kPatchBlockBytes == kChecksumBlockBytes);

// Elements converted at a time into a buffer on the stack, then compared with the published ones.
constexpr std::uint64_t kBatchElements = 4096;

std::uint64_t patch_bytes_max(std::uint64_t tensor_bytes, double fraction_max) {
  // Checked here, before the builder is made with it (a negative or NaN fraction would not convert).
  TH_REQUIRE(fraction_max >= 0 && fraction_max <= 1, "a fraction of the dense bytes", fraction_max);
  return static_cast<std::uint64_t>(std::floor(static_cast<double>(tensor_bytes) * fraction_max));
}

}  // namespace

PatchWriter::PatchWriter(DType dtype, std::span<std::byte> published, std::uint64_t base_checksum,
                         double fraction_max)
    : dtype_(dtype),
      element_bytes_(dtype_bytes(dtype)),
      published_(published),
      builder_(element_bytes_, published.size(), base_checksum,
               std::min(patch_bytes_max(published.size(), fraction_max), patch_bytes_limit(published.size()))) {}

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
    const std::uint64_t first = written_ + done;
    switch (element_bytes_) {
      case 1: record_changes<1>(at, batch.data(), n, first); break;
      case 2: record_changes<2>(at, batch.data(), n, first); break;
      case 4: record_changes<4>(at, batch.data(), n, first); break;
      default: record_changes<8>(at, batch.data(), n, first); break;
    }
    std::memcpy(at, batch.data(), n * element_bytes_);
    done += n;
  }
  written_ += count;
}

template <std::uint32_t kElementBytes>
void PatchWriter::record_changes(const std::byte* old_bytes, const std::byte* new_bytes, std::uint64_t count,
                                 std::uint64_t first) {
  // Most elements keep their bits: compare a word at a time (sizes known here, so no call to
  // memcmp), and look at its elements only where it differs.
  constexpr std::uint64_t kPerWord = 8 / kElementBytes;
  auto element_differs = [&](std::uint64_t i) {
    return std::memcmp(old_bytes + i * kElementBytes, new_bytes + i * kElementBytes, kElementBytes) != 0;
  };
  std::uint64_t i = 0;
  for (; i + kPerWord <= count; i += kPerWord) {
    std::uint64_t old_word;
    std::uint64_t new_word;
    std::memcpy(&old_word, old_bytes + i * kElementBytes, 8);
    std::memcpy(&new_word, new_bytes + i * kElementBytes, 8);
    if (old_word == new_word) continue;
    for (std::uint64_t j = i; j < i + kPerWord; ++j) {
      if (element_differs(j)) builder_.changed(first + j, new_bytes + j * kElementBytes);
    }
  }
  for (; i < count; ++i) {
    if (element_differs(i)) builder_.changed(first + i, new_bytes + i * kElementBytes);
  }
}

std::optional<std::vector<std::byte>> PatchWriter::finish() {
  TH_REQUIRE(written_ == published_.size() / element_bytes_, "every element written before finish()", written_);
  return builder_.finish();
}

}  // namespace th::client_impl
