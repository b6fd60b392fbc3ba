#include <gtest/gtest.h>

#include "core/box.h"
#include "core/siphash.h"
#include "core/types.h"
#include "tests/core/testkit/tensors.h"

namespace th {
namespace {

using test::own;
using test::piece;

// A Result read the wrong way throws a std::logic_error that says what the error was (an
// adopter's Handle::open(options).value() on a failed open shows why it failed).
TEST(Result, MisuseThrowsALogicErrorNamingTheError) {
  const Result<int> failed = make_error(Errc::kTimeout, "no server answered");
  try {
    (void)failed.value();
    FAIL() << "value() of an error returned";
  } catch (const std::logic_error& error) {
    EXPECT_STREQ(error.what(), "Result::value() of an error: timeout: no server answered");
  }
  const Result<int> fine = 7;
  EXPECT_THROW((void)fine.error(), std::logic_error);
}

TEST(Selector, ParsesTheThreeForms) {
  EXPECT_EQ(parse_selector("latest").value(), Selector::latest());
  EXPECT_EQ(parse_selector("latest-3").value(), Selector::latest(3));
  EXPECT_EQ(parse_selector("latest-0").value(), Selector::latest(0));
  EXPECT_EQ(parse_selector("42").value(), Selector::absolute(42));
  EXPECT_EQ(parse_selector("0").value(), Selector::absolute(0));
  EXPECT_EQ(parse_selector("18446744073709551615").value(), Selector::absolute(UINT64_MAX));
}

TEST(Selector, RejectsEverythingElseWithATypedError) {
  for (const char* text : {"", " latest", "latest ", "Latest", "latest-", "latest-x", "latest+1",
                           "latest--1", "-1", "+1", "1.5", "0x10", "18446744073709551616",
                           "latest-18446744073709551616", "newest"}) {
    const auto parsed = parse_selector(text);
    ASSERT_FALSE(parsed.ok()) << "'" << text << "'";
    EXPECT_EQ(parsed.error().code, Errc::kBadSelector) << text;
  }
}

TEST(Selector, FormatsBackToItsText) {
  for (const char* text : {"latest", "latest-7", "12"}) {
    EXPECT_EQ(format_selector(parse_selector(text).value()), text);
  }
}

TEST(Layout, DigestAndMismatchDescribeDifferences) {
  auto a = ShardLayout::make({{"w", DType::kBFloat16, 100}, {"b", DType::kFloat32, 4}}).value();
  auto same = ShardLayout::make({{"w", DType::kBFloat16, 100}, {"b", DType::kFloat32, 4}}).value();
  auto bigger = ShardLayout::make({{"w", DType::kBFloat16, 200}, {"b", DType::kFloat32, 4}}).value();
  auto shorter = ShardLayout::make({{"w", DType::kBFloat16, 100}}).value();
  auto longer = ShardLayout::make({{"w", DType::kBFloat16, 100}, {"b", DType::kFloat32, 4}, {"a", DType::kInt8, 1}}).value();
  auto wider = ShardLayout::make({{"w", DType::kFloat32, 200}, {"b", DType::kFloat32, 4}}).value();
  EXPECT_EQ(a->digest(), same->digest());
  EXPECT_EQ(a->total_bytes(), 104u);
  EXPECT_FALSE(a->mismatch(*same));
  EXPECT_NE(a->digest(), bigger->digest());
  EXPECT_EQ(*a->mismatch(*bigger), "tensor 'w': 100 bytes in the model, 200 here");
  EXPECT_EQ(*a->mismatch(*wider), "tensor 'w': dtype bfloat16 in the model, float32 here");
  // Counts alone do not say which tensor to look for: the first one missing or extra is named.
  EXPECT_EQ(*a->mismatch(*shorter), "tensor 'b' is missing here (the model's shard has 2 tensors, this one 1)");
  EXPECT_EQ(*a->mismatch(*longer), "tensor 'a' is not in the model (the model's shard has 2 tensors, this one 3)");
}

TEST(Layout, ShapesBothSidesSaidMustAgree) {
  // The silent garbage of before: 32×64 and 64×32 have one size.
  auto model = ShardLayout::make({own("w", {32, 64}, DType::kBFloat16)}).value();
  auto transposed = ShardLayout::make({own("w", {64, 32}, DType::kBFloat16)}).value();
  EXPECT_EQ(*model->mismatch(*transposed), "tensor 'w': shape [32, 64] in the model, [64, 32] here");
  // A side that said only bytes (the C++ register of before) still meets one that said a shape.
  auto bytes_only = ShardLayout::make({{"w", DType::kBFloat16, 32 * 64 * 2}}).value();
  EXPECT_FALSE(model->mismatch(*bytes_only));
  EXPECT_FALSE(bytes_only->mismatch(*transposed));
  // A piece meets a shard's own tensor of its box's shape (a TP slice registered plainly).
  auto half = ShardLayout::make({piece("w", {64, 64}, Box{{0, 0}, {32, 64}}, DType::kBFloat16)}).value();
  EXPECT_FALSE(half->mismatch(*model));
  EXPECT_EQ(*half->mismatch(*transposed), "tensor 'w': shape [32, 64] in the model, [64, 32] here");
  auto other_half = ShardLayout::make({piece("w", {64, 64}, Box{{32, 0}, {32, 64}}, DType::kBFloat16)}).value();
  EXPECT_EQ(*half->mismatch(*other_half), "tensor 'w': box [0:32, 0:64] in the model, [32:64, 0:64] here");
  auto other_global = ShardLayout::make({piece("w", {32, 128}, Box{{0, 0}, {32, 64}}, DType::kBFloat16)}).value();
  EXPECT_EQ(*half->mismatch(*other_global), "tensor 'w': global shape [64, 64] in the model, [32, 128] here");
  EXPECT_NE(half->digest(), other_half->digest());
}

TEST(Layout, RefiningKeepsTheMostSpecificDescriptionOfEachTensor) {
  const LayoutRef bytes = ShardLayout::make({{"w", DType::kBFloat16, 32 * 64 * 2}, {"b", DType::kFloat32, 16}}).value();
  const LayoutRef shaped = ShardLayout::make({own("w", {32, 64}, DType::kBFloat16), {"b", DType::kFloat32, 16}}).value();
  const LayoutRef placed =
      ShardLayout::make({piece("w", {64, 64}, Box{{0, 0}, {32, 64}}, DType::kBFloat16), {"b", DType::kFloat32, 16}}).value();
  EXPECT_EQ(ShardLayout::refine(shaped, bytes), shaped) << "nothing new: the same layout";
  EXPECT_EQ(ShardLayout::refine(bytes, shaped)->tensors(), shaped->tensors());
  EXPECT_EQ(ShardLayout::refine(shaped, placed)->tensors(), placed->tensors());
  EXPECT_EQ(ShardLayout::refine(placed, shaped), placed);
  // After refining, what matched the vaguer layout alone is told apart.
  const LayoutRef transposed = ShardLayout::make({own("w", {64, 32}, DType::kBFloat16), {"b", DType::kFloat32, 16}}).value();
  EXPECT_FALSE(bytes->mismatch(*transposed));
  EXPECT_TRUE(ShardLayout::refine(bytes, shaped)->mismatch(*transposed));
  EXPECT_THROW(ShardLayout::refine(shaped, transposed), std::logic_error);
}

TEST(Layout, ShapesAndBoxesAgreeWithKindAndSize) {
  const auto refused = [](TensorSpec spec, const std::string& says) {
    auto made = ShardLayout::make({std::move(spec)});
    ASSERT_FALSE(made.ok()) << says;
    EXPECT_EQ(made.error().code, Errc::kInvalidArgument);
    EXPECT_NE(made.error().detail.find(says), std::string::npos) << made.error().detail;
  };
  TensorSpec wrong_size = own("w", {4, 4}, DType::kFloat32);
  wrong_size.bytes = 32;
  refused(wrong_size, "tensor 'w': 32 bytes for shape [4, 4] of float32, which is 64 bytes");
  refused(piece("w", {4, 4}, Box{{2, 0}, {4, 4}}, DType::kFloat32), "lies outside its shape [4, 4]");
  refused(piece("w", {4, 4}, Box{{0}, {4}}, DType::kFloat32), "tensor 'w': a box of 1 offsets");
  TensorSpec bytes_with_shape{"w", DType::kInt8, 4};
  bytes_with_shape.shape = {4};
  refused(bytes_with_shape, "tensor 'w': a tensor of bytes has no shape");
  TensorSpec local_with_box = own("w", {4}, DType::kInt8);
  local_with_box.box = Box{{0}, {4}};
  refused(local_with_box, "tensor 'w': a shard's own tensor has no box");
  refused(own("w", Shape(limits::kBoxRankMax + 1, 1), DType::kInt8), "has more than 8 dimensions");
  TensorSpec huge = own("w", {1}, DType::kInt8);
  huge.shape = {1ull << 40, 1ull << 40};
  refused(huge, "has more than 2^64 bytes");
  TensorSpec bad_kind = own("w", {4}, DType::kInt8);
  bad_kind.kind = static_cast<TensorKind>(7);
  refused(bad_kind, "tensor 'w': no valid kind");
  EXPECT_TRUE(ShardLayout::make({own("scalar", {}, DType::kFloat32)}).ok());
  EXPECT_TRUE(ShardLayout::make({own("empty", {0, 8}, DType::kFloat32)}).ok());
}

TEST(Layout, RejectsInvalidTensors) {
  EXPECT_EQ(ShardLayout::make({}).error().code, Errc::kInvalidArgument);
  EXPECT_EQ(ShardLayout::make({{"", DType::kInt8, 1}}).error().code, Errc::kInvalidArgument);
  EXPECT_EQ(ShardLayout::make({{"x", static_cast<DType>(200), 1}}).error().code,
            Errc::kInvalidArgument);
  EXPECT_EQ(ShardLayout::make({{"x", DType::kInt8, UINT64_MAX}, {"y", DType::kInt8, 1}})
                .error()
                .code,
            Errc::kInvalidArgument);
  const auto twice = ShardLayout::make({{"w", DType::kInt8, 1}, {"b", DType::kInt8, 1}, {"w", DType::kInt8, 2}});
  ASSERT_FALSE(twice.ok());
  EXPECT_EQ(twice.error().code, Errc::kInvalidArgument);
  EXPECT_NE(twice.error().detail.find("'w' appears twice"), std::string::npos);
}

TEST(DType, NamesRoundTrip) {
  for (int i = 0; i < kDTypeCount; ++i) {
    const auto dtype = static_cast<DType>(i);
    EXPECT_EQ(parse_dtype(dtype_name(dtype)), dtype);
  }
  EXPECT_FALSE(parse_dtype("float128"));
}

TEST(Result, HoldsAValueOrAnError) {
  Result<int> value = 3;
  Result<int> error = make_error(Errc::kTimeout, "late");
  EXPECT_TRUE(value.ok());
  EXPECT_EQ(value.value(), 3);
  EXPECT_FALSE(error.ok());
  EXPECT_EQ(error.error().code, Errc::kTimeout);
  EXPECT_THROW((void)error.value(), AssertionFailure);
  EXPECT_THROW((void)value.error(), AssertionFailure);
  EXPECT_EQ(errc_name(Errc::kVersionUnavailable), "version-unavailable");
}

}  // namespace
}  // namespace th

// The reference implementation's first vectors (key 00 01 .. 0f, message 00 01 .. of growing
// length), as the two little-endian words of its 16 output bytes.
TEST(SipHash128, MatchesTheReferenceVectors) {
  const th::SipKey key{0x0706050403020100ULL, 0x0f0e0d0c0b0a0908ULL};
  const std::uint8_t message[] = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  auto words = [](std::array<std::uint8_t, 16> bytes) {
    std::array<std::uint64_t, 2> out{};
    for (int i = 0; i < 16; ++i) out[i / 8] |= static_cast<std::uint64_t>(bytes[i]) << (8 * (i % 8));
    return out;
  };
  EXPECT_EQ(th::siphash128(key, {message, 0}),
            words({0xa3, 0x81, 0x7f, 0x04, 0xba, 0x25, 0xa8, 0xe6, 0x6d, 0xf6, 0x72, 0x14, 0xc7, 0x55, 0x02, 0x93}));
  EXPECT_EQ(th::siphash128(key, {message, 1}),
            words({0xda, 0x87, 0xc1, 0xd8, 0x6b, 0x99, 0xaf, 0x44, 0x34, 0x76, 0x59, 0x11, 0x9b, 0x22, 0xfc, 0x45}));
  EXPECT_EQ(th::siphash128(key, {message, 2}),
            words({0x81, 0x77, 0x22, 0x8d, 0xa4, 0xa4, 0x5d, 0xc7, 0xfc, 0xa3, 0x8b, 0xde, 0xf6, 0x0a, 0xff, 0xe4}));
}

namespace th {
namespace {

TEST(Names, AreUtf8TextWithoutControlCharacters) {
  EXPECT_TRUE(valid_name("rollout-17", false));
  EXPECT_TRUE(valid_name("数据中心-東", false));                 // 3-byte characters
  EXPECT_TRUE(valid_name("r\xF0\x9F\x9A\x80", false));            // U+1F680, 4 bytes
  EXPECT_TRUE(valid_name("", true));
  EXPECT_FALSE(valid_name("", false));
  EXPECT_FALSE(valid_name(std::string(limits::kNameBytesMax + 1, 'a'), false));
  EXPECT_FALSE(valid_name("tab\there", false));
  EXPECT_FALSE(valid_name("esc\x1b[2J", false));                  // terminal escapes
  EXPECT_FALSE(valid_name("del\x7f", false));
  EXPECT_FALSE(valid_name("ro\xff", false));                      // not UTF-8
  EXPECT_FALSE(valid_name("tr\xc3\x28", false));                  // a lead without its continuation
  EXPECT_FALSE(valid_name("\xc0\xaf", false));                    // overlong '/'
  EXPECT_FALSE(valid_name("\xe0\x80\xaf", false));                // overlong, 3 bytes
  EXPECT_FALSE(valid_name("\xed\xa0\x80", false));                // a surrogate
  EXPECT_FALSE(valid_name("\xf4\x90\x80\x80", false));            // past U+10FFFF
  EXPECT_FALSE(valid_name("cut\xe6\x95", false));                 // truncated at the end
  EXPECT_FALSE(valid_name("nel\xc2\x85", false));                // U+0085, a C1 control
  EXPECT_FALSE(valid_name("csi\xc2\x9b", false));                // U+009B
  EXPECT_FALSE(valid_name("a\xe2\x80\xa8" "b", false));             // U+2028 line separator
  EXPECT_FALSE(valid_name("evil\xe2\x80\xaegnp", false));        // U+202E right-to-left override
  EXPECT_FALSE(valid_name("zero\xe2\x80\x8bwidth", false));      // U+200B
  EXPECT_FALSE(valid_name("\xef\xbb\xbf" "bom", false));            // U+FEFF
  EXPECT_TRUE(valid_name("caf\xc3\xa9", false));                 // U+00E9 is text
}

}  // namespace
}  // namespace th
