// dtype on landing: client/convert against independent oracles (the compiler's _Float16 for
// float16; nearest-with-ties-to-even worked out in double for bfloat16), over every 16-bit pattern
// and a few million float32 values.
#include "client/convert.h"

#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

namespace th::client_impl {
namespace {

std::uint32_t bits_of(float value) { return std::bit_cast<std::uint32_t>(value); }
float float_of(std::uint32_t bits) { return std::bit_cast<float>(bits); }

std::uint16_t oracle_float16(float value) { return std::bit_cast<std::uint16_t>(static_cast<_Float16>(value)); }
float oracle_from_float16(std::uint16_t bits) { return static_cast<float>(std::bit_cast<_Float16>(bits)); }

// The bfloat16 nearest to `value` (ties to the even one), by comparing the two candidates in double.
std::uint16_t oracle_bfloat16(float value) {
  const std::uint32_t bits = bits_of(value);
  const auto below = static_cast<std::uint16_t>(bits >> 16);  // toward zero
  const auto above = static_cast<std::uint16_t>(below + 1);   // away from zero (may be inf)
  const double low = std::fabs(static_cast<double>(float_of(static_cast<std::uint32_t>(below) << 16)));
  // Past the largest finite value IEEE rounding goes on as if the exponent had no end: infinity
  // stands for 2^128.
  const double high = (above & 0x7f80u) == 0x7f80u
                          ? std::ldexp(1.0, 128)
                          : std::fabs(static_cast<double>(float_of(static_cast<std::uint32_t>(above) << 16)));
  const double x = std::fabs(static_cast<double>(value));
  if (x - low < high - x) return below;
  if (x - low > high - x) return above;
  return (below & 1u) ? above : below;
}

std::vector<float> samples() {
  std::vector<float> values = {0.0f, -0.0f, 1.0f, -1.0f, 65504.0f, 65519.99f, 65520.0f, 1e-8f, 5.96e-8f, 2.98e-8f,
                               6.1e-5f, std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity(),
                               std::numeric_limits<float>::max(), std::numeric_limits<float>::denorm_min(), 3.0e38f};
  std::mt19937 random(20261204);
  for (int i = 0; i < 2'000'000; ++i) {
    const float value = float_of(static_cast<std::uint32_t>(random()));
    if (!std::isnan(value)) values.push_back(value);
  }
  // Values near every float16 boundary, where rounding decides.
  for (std::uint32_t half = 0; half < 0x7c00u; ++half) {
    const float exact = oracle_from_float16(static_cast<std::uint16_t>(half));
    values.push_back(exact);
    values.push_back(std::nextafter(exact, 1e9f));
    values.push_back(std::nextafter(exact, -1e9f));
  }
  return values;
}

TEST(Convert, EveryFloat16PatternWidensExactly) {
  for (std::uint32_t bits = 0; bits < 0x10000u; ++bits) {
    const float got = float16_to_float(static_cast<std::uint16_t>(bits));
    const float want = oracle_from_float16(static_cast<std::uint16_t>(bits));
    if (std::isnan(want)) {
      EXPECT_TRUE(std::isnan(got)) << bits;
    } else {
      EXPECT_EQ(bits_of(got), bits_of(want)) << bits;
    }
  }
}

TEST(Convert, Float32NarrowsToTheNearestFloat16AndBfloat16) {
  std::uint64_t wrong16 = 0;
  std::uint64_t wrongb16 = 0;
  for (const float value : samples()) {
    if (float_to_float16(value) != oracle_float16(value) && ++wrong16 < 10) {
      ADD_FAILURE() << "float16 of " << value << " (0x" << std::hex << bits_of(value) << "): got 0x"
                    << float_to_float16(value) << ", want 0x" << oracle_float16(value);
    }
    if (float_to_bfloat16(value) != oracle_bfloat16(value) && ++wrongb16 < 10) {
      ADD_FAILURE() << "bfloat16 of " << value << " (0x" << std::hex << bits_of(value) << "): got 0x"
                    << float_to_bfloat16(value) << ", want 0x" << oracle_bfloat16(value);
    }
  }
  EXPECT_EQ(wrong16, 0u);
  EXPECT_EQ(wrongb16, 0u);
}

TEST(Convert, NanStaysNanAndSixteenBitValuesRoundTrip) {
  EXPECT_TRUE(std::isnan(bfloat16_to_float(float_to_bfloat16(std::nanf("")))));
  EXPECT_TRUE(std::isnan(float16_to_float(float_to_float16(std::nanf("1")))));
  // A signalling NaN whose payload lives only in the low bits must not become an infinity.
  EXPECT_TRUE(std::isnan(bfloat16_to_float(float_to_bfloat16(float_of(0x7f800001u)))));
  EXPECT_TRUE(std::isnan(float16_to_float(float_to_float16(float_of(0x7f800001u)))));
  std::vector<std::uint16_t> all(0x10000);
  for (std::uint32_t bits = 0; bits < all.size(); ++bits) all[bits] = static_cast<std::uint16_t>(bits);
  for (const DType narrow : {DType::kBFloat16, DType::kFloat16}) {
    std::vector<float> wide(all.size());
    std::vector<std::uint16_t> back(all.size());
    convert_elements(narrow, reinterpret_cast<const std::byte*>(all.data()), DType::kFloat32,
                     reinterpret_cast<std::byte*>(wide.data()), all.size());
    convert_elements(DType::kFloat32, reinterpret_cast<const std::byte*>(wide.data()), narrow,
                     reinterpret_cast<std::byte*>(back.data()), all.size());
    for (std::uint32_t bits = 0; bits < all.size(); ++bits) {
      if (std::isnan(wide[bits])) continue;
      ASSERT_EQ(back[bits], all[bits]) << dtype_name(narrow) << " 0x" << std::hex << bits;
    }
  }
}

// float32 -> bfloat16 has a loop of its own (the trainer's every step). Checked against rounding
// done here another way: of the two bfloat16 values around the float (its bits cut, and one up),
// the nearer in double arithmetic, the even one on a tie; one past the largest finite value
// stands for the infinity (IEEE 754 rounds there to infinity). NaNs stay NaNs of the same sign.
std::uint16_t reference_bfloat16(std::uint32_t bits) {
  const float value = float_of(bits);
  if (std::isnan(value)) return 0;  // compared apart
  const auto down = static_cast<std::uint16_t>(bits >> 16);
  if ((bits & 0xffffu) == 0) return down;
  const auto up = static_cast<std::uint16_t>(down + 1);
  auto as_double = [](std::uint16_t half) {
    if ((half & 0x7fffu) == 0x7f80u) return std::copysign(std::ldexp(1.0, 128), (half & 0x8000u) ? -1.0 : 1.0);
    return static_cast<double>(float_of(static_cast<std::uint32_t>(half) << 16));
  };
  const double below = std::fabs(static_cast<double>(value) - as_double(down));
  const double above = std::fabs(as_double(up) - static_cast<double>(value));
  if (below != above) return below < above ? down : up;
  return (down & 1u) == 0 ? down : up;
}

TEST(Convert, FloatToBfloat16InBulkRoundsToNearestEven) {
  std::vector<std::uint32_t> bits;
  for (std::uint64_t b = 0; b <= 0xffffffffull; b += 0x10001ull * 7) bits.push_back(static_cast<std::uint32_t>(b));
  for (const std::uint32_t edge : {0x7f800001u, 0xff800000u, 0x7f7fffffu, 0x7f7f8000u, 0x00008000u, 0x3f808000u,
                                   0x3f818000u, 0x80000001u, 0x7fc00000u, 0x00000000u, 0x80000000u}) {
    bits.push_back(edge);
  }
  std::vector<std::uint16_t> bulk(bits.size());
  convert_elements(DType::kFloat32, reinterpret_cast<const std::byte*>(bits.data()), DType::kBFloat16,
                   reinterpret_cast<std::byte*>(bulk.data()), bits.size());
  for (std::size_t i = 0; i < bits.size(); ++i) {
    if (std::isnan(float_of(bits[i]))) {
      ASSERT_TRUE(std::isnan(bfloat16_to_float(bulk[i]))) << "0x" << std::hex << bits[i];
      ASSERT_EQ(bulk[i] & 0x8000u, (bits[i] >> 16) & 0x8000u) << "0x" << std::hex << bits[i];
      continue;
    }
    ASSERT_EQ(bulk[i], reference_bfloat16(bits[i])) << "0x" << std::hex << bits[i];
  }
}

TEST(Convert, OnlyFloatsConvertAndTheSameDtypeCopies) {
  EXPECT_TRUE(convertible(DType::kBFloat16, DType::kFloat16));
  EXPECT_TRUE(convertible(DType::kInt32, DType::kInt32));
  EXPECT_FALSE(convertible(DType::kInt32, DType::kFloat32));
  EXPECT_FALSE(convertible(DType::kFloat8E4M3, DType::kBFloat16));
  const std::int32_t values[3] = {1, -2, 3};
  std::int32_t copied[3] = {};
  convert_elements(DType::kInt32, reinterpret_cast<const std::byte*>(values), DType::kInt32,
                   reinterpret_cast<std::byte*>(copied), 3);
  EXPECT_EQ(std::memcmp(values, copied, sizeof values), 0);
  EXPECT_THROW(convert_elements(DType::kInt32, reinterpret_cast<const std::byte*>(values), DType::kFloat32,
                                reinterpret_cast<std::byte*>(copied), 3),
               std::logic_error);
}

}  // namespace
}  // namespace th::client_impl
