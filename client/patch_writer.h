// The trainer's side of a patch (issue 35): writes a tensor's new value into its published buffer
// and records what changed against what the buffer held (version v-1), in the same pass: no
// second copy of the model, only the patch, at most kPatchFractionMax of the tensor's bytes.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <vector>

#include "core/patch.h"
#include "tensorhub/types.h"

namespace th::client_impl {

// A patch larger than this part of the dense bytes is not made: reading it would save little, and
// the trainer would hold that much besides its weights.
inline constexpr double kPatchFractionMax = 0.4;

class PatchWriter {
 public:
  // `published`: the buffer of `dtype` that holds v-1 (its checksum `base_checksum`) and is to
  // hold v. `fraction_max`: of its bytes, the largest patch kept.
  PatchWriter(DType dtype, std::span<std::byte> published, std::uint64_t base_checksum,
              double fraction_max = kPatchFractionMax);

  // Writes `count` elements of `source_dtype` at `source` (the trainer's master weights: float32
  // into a bfloat16 buffer, or the buffer's own dtype) into the buffer from the first element not
  // yet written on, rounding as convert_elements does, and records each whose bits change (bits,
  // not values: -0 over +0 is a change, a NaN that stays the same NaN is not).
  void write(DType source_dtype, const std::byte* source, std::uint64_t count);
  // Once every element was written: the patch, or nothing if it passed fraction_max. The buffer
  // holds v either way. Call once.
  std::optional<std::vector<std::byte>> finish();

  std::uint64_t elements_written() const { return written_; }
  std::uint64_t elements_changed() const { return builder_.changed_elements(); }

 private:
  template <std::uint32_t kElementBytes>
  void record_changes(const std::byte* old_bytes, const std::byte* new_bytes, std::uint64_t count,
                      std::uint64_t first);

  DType dtype_;
  std::uint32_t element_bytes_;
  std::span<std::byte> published_;
  std::uint64_t written_ = 0;
  PatchBuilder builder_;
};

}  // namespace th::client_impl
