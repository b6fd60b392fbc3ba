// dtype on landing (README "Layouts"): a reader's tensor may hold another floating dtype than the
// publisher's; bytes are verified as sent, then converted into the reader's buffer. CPU only here;
// bfloat16, float16 and float32 into one another, rounding to nearest even as torch's .to() does.
#pragma once

#include <cstddef>
#include <cstdint>

#include "tensorhub/types.h"

namespace th::client_impl {

// Whether convert_elements takes this pair (the same dtype always: a copy).
bool convertible(DType from, DType to);

// `count` elements of `from` at `source` into `to` at `destination` (unaligned is fine; the two
// must not overlap). NaN stays NaN (quiet), infinities and signed zeros stay; a float32 too big for
// float16 becomes an infinity, as IEEE 754 rounding says.
void convert_elements(DType from, const std::byte* source, DType to, std::byte* destination, std::uint64_t count);

// One element, for tests and for the checks of callers.
float bfloat16_to_float(std::uint16_t bits);
std::uint16_t float_to_bfloat16(float value);
float float16_to_float(std::uint16_t bits);
std::uint16_t float_to_float16(float value);

}  // namespace th::client_impl
