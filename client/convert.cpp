#include "client/convert.h"

#include <bit>
#include <cstring>
#include <stdexcept>
#include <string>

#include "core/reshard.h"

namespace th::client_impl {
namespace {

std::uint32_t bits_of(float value) { return std::bit_cast<std::uint32_t>(value); }
float float_of(std::uint32_t bits) { return std::bit_cast<float>(bits); }

float load(DType dtype, const std::byte* at) {
  if (dtype == DType::kFloat32) {
    float value;
    std::memcpy(&value, at, sizeof value);
    return value;
  }
  std::uint16_t bits;
  std::memcpy(&bits, at, sizeof bits);
  return dtype == DType::kBFloat16 ? bfloat16_to_float(bits) : float16_to_float(bits);
}

void store(DType dtype, float value, std::byte* at) {
  if (dtype == DType::kFloat32) {
    std::memcpy(at, &value, sizeof value);
    return;
  }
  const std::uint16_t bits = dtype == DType::kBFloat16 ? float_to_bfloat16(value) : float_to_float16(value);
  std::memcpy(at, &bits, sizeof bits);
}

}  // namespace

bool convertible(DType from, DType to) { return converts(from, to); }  // the planner's rule, one place

float bfloat16_to_float(std::uint16_t bits) { return float_of(static_cast<std::uint32_t>(bits) << 16); }

std::uint16_t float_to_bfloat16(float value) {
  const std::uint32_t bits = bits_of(value);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<std::uint16_t>((bits >> 16) | 0x0040u);  // quiet NaN
  // Round to nearest, ties to even: add half of the dropped range, less one unless the kept lsb is 1.
  const std::uint32_t rounding = 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<std::uint16_t>((bits + rounding) >> 16);
}

float float16_to_float(std::uint16_t bits) {
  const std::uint32_t sign = static_cast<std::uint32_t>(bits & 0x8000u) << 16;
  const std::uint32_t exponent = (bits >> 10) & 0x1fu;
  std::uint32_t mantissa = bits & 0x3ffu;
  if (exponent == 0x1f) return float_of(sign | 0x7f800000u | (mantissa << 13) | (mantissa ? 0x00400000u : 0u));
  if (exponent != 0) return float_of(sign | ((exponent + 112u) << 23) | (mantissa << 13));
  if (mantissa == 0) return float_of(sign);
  // Subnormal: normalise (float32 holds every float16 subnormal as a normal number).
  std::uint32_t shift = 0;
  while ((mantissa & 0x400u) == 0) {
    mantissa <<= 1;
    ++shift;
  }
  return float_of(sign | ((113u - shift) << 23) | ((mantissa & 0x3ffu) << 13));
}

std::uint16_t float_to_float16(float value) {
  const std::uint32_t bits = bits_of(value);
  const auto sign = static_cast<std::uint16_t>((bits >> 16) & 0x8000u);
  const std::uint32_t magnitude = bits & 0x7fffffffu;
  if (magnitude > 0x7f800000u) return static_cast<std::uint16_t>(sign | 0x7e00u | ((magnitude >> 13) & 0x3ffu));
  if (magnitude >= 0x477ff000u) return static_cast<std::uint16_t>(sign | 0x7c00u);  // rounds to >= 65520: inf
  const std::int32_t exponent = static_cast<std::int32_t>(magnitude >> 23) - 127;
  if (exponent >= -14) {  // a normal float16
    std::uint32_t rounded = magnitude + 0xfffu + ((magnitude >> 13) & 1u);  // nearest even at bit 13
    return static_cast<std::uint16_t>(sign | ((rounded - (112u << 23)) >> 13));
  }
  if (exponent < -25) return sign;  // below half the smallest subnormal: zero
  // Subnormal float16: the significand with its implicit bit, shifted into place, rounded to even.
  const std::uint32_t significand = (magnitude & 0x7fffffu) | 0x800000u;
  const auto shift = static_cast<std::uint32_t>(-exponent - 14 + 13);  // 14..24
  const std::uint32_t kept = significand >> shift;
  const std::uint32_t dropped = significand & ((1u << shift) - 1u);
  const std::uint32_t half = 1u << (shift - 1);
  const std::uint32_t result = kept + ((dropped > half || (dropped == half && (kept & 1u))) ? 1u : 0u);
  return static_cast<std::uint16_t>(sign | result);
}

void convert_elements(DType from, const std::byte* source, DType to, std::byte* destination, std::uint64_t count) {
  if (!convertible(from, to)) {
    throw std::logic_error("convert_elements: " + std::string(dtype_name(from)) + " does not convert to " +
                           std::string(dtype_name(to)));
  }
  if (from == to) {
    std::memcpy(destination, source, count * dtype_bytes(from));
    return;
  }
  if (from == DType::kFloat32 && to == DType::kBFloat16) {
    // The trainer's every step (master weights into the published bf16 buffers, PatchWriter):
    // a loop of its own, without the general loop's dtype decoding per element (GCC 12 does not
    // vectorise it: it cannot tell that the buffers do not overlap).
    for (std::uint64_t i = 0; i < count; ++i) {
      std::uint32_t bits;
      std::memcpy(&bits, source + i * 4, 4);
      const std::uint16_t half = float_to_bfloat16(float_of(bits));
      std::memcpy(destination + i * 2, &half, 2);
    }
    return;
  }
  const std::uint32_t from_bytes = dtype_bytes(from);
  const std::uint32_t to_bytes = dtype_bytes(to);
  for (std::uint64_t i = 0; i < count; ++i) store(to, load(from, source + i * from_bytes), destination + i * to_bytes);
}

}  // namespace th::client_impl
