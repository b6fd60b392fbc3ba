// The trainer's side of a patch (client/patch_writer.h): the buffer ends holding exactly what
// convert_elements would have written, and the patch turns the buffer's old bytes into it.
#include "client/patch_writer.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "client/convert.h"
#include "core/assert.h"

namespace th::client_impl {
namespace {

using Bytes = std::vector<std::byte>;

template <typename T>
Bytes bytes_of(const std::vector<T>& values) {
  Bytes out(values.size() * sizeof(T));
  std::memcpy(out.data(), values.data(), out.size());
  return out;
}

// float32 master weights and their bfloat16 copy, then an optimizer step: `per_thousand` of
// the weights move by a relative 1e-2 (beyond bf16's resolution), the others by 1e-6 (within it).
struct Step {
  std::vector<float> master;
  Bytes published;  // bf16 of the master before the step: version v-1
};

Step make_step(std::size_t elements, int per_thousand) {
  Step step;
  step.master.resize(elements);
  for (std::size_t i = 0; i < elements; ++i) step.master[i] = std::sin(static_cast<float>(i) * 0.37f) * 0.05f;
  step.published.resize(elements * 2);
  convert_elements(DType::kFloat32, reinterpret_cast<const std::byte*>(step.master.data()), DType::kBFloat16,
                   step.published.data(), elements);
  for (std::size_t i = 0; i < elements; ++i) {
    step.master[i] *= (static_cast<int>(i * 7919 % 1000) < per_thousand) ? 1.01f : 1.000001f;
  }
  return step;
}

Bytes converted(const std::vector<float>& master) {
  Bytes out(master.size() * 2);
  convert_elements(DType::kFloat32, reinterpret_cast<const std::byte*>(master.data()), DType::kBFloat16, out.data(),
                   master.size());
  return out;
}

TEST(PatchWriter, WritesTheNewVersionAndAPatchThatMakesItFromTheOld) {
  Step step = make_step(3 * (1 << 19) + 123, 30);  // three 1 MiB blocks of bf16 and a bit
  const Bytes old_bytes = step.published;
  PatchWriter writer(DType::kBFloat16, step.published, 42);
  writer.write(DType::kFloat32, reinterpret_cast<const std::byte*>(step.master.data()), step.master.size());
  auto patch = writer.finish();
  EXPECT_EQ(step.published, converted(step.master));
  ASSERT_TRUE(patch.has_value());
  std::uint64_t changed = 0;
  for (std::size_t at = 0; at < old_bytes.size(); at += 2) changed += std::memcmp(&old_bytes[at], &step.published[at], 2) != 0;
  EXPECT_EQ(writer.elements_changed(), changed);
  EXPECT_GT(changed, 0u);
  // About 3 % changed: the patch is about a twentieth of the dense bytes, within the 0.15.
  EXPECT_LT(patch->size(), old_bytes.size() * 15 / 100);
  Bytes tensor = old_bytes;
  auto applied = apply_patch(*patch, 2, tensor, 42);
  ASSERT_TRUE(applied.ok()) << applied.error().detail;
  EXPECT_EQ(applied.value(), changed);
  EXPECT_EQ(tensor, step.published);
}

TEST(PatchWriter, WritingInPiecesMakesTheSamePatchAsInOne) {
  Step step = make_step((1 << 19) + 999, 100);
  Bytes whole_buffer = step.published;
  PatchWriter whole(DType::kBFloat16, whole_buffer, 1);
  whole.write(DType::kFloat32, reinterpret_cast<const std::byte*>(step.master.data()), step.master.size());
  PatchWriter pieces(DType::kBFloat16, step.published, 1);
  for (std::size_t done = 0, piece = 1; done < step.master.size(); piece = piece * 3 + 1) {
    const std::size_t n = std::min(piece, step.master.size() - done);
    pieces.write(DType::kFloat32, reinterpret_cast<const std::byte*>(step.master.data() + done), n);
    done += n;
  }
  EXPECT_EQ(pieces.finish(), whole.finish());
  EXPECT_EQ(step.published, whole_buffer);
}

TEST(PatchWriter, BitsNotValuesSayWhatChanged) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  // 4,096 float32 elements, three of them odd: +0 becomes -0 (equal as floats, not as bits), a
  // NaN stays the same NaN (unequal as floats, equal as bits), a NaN becomes another NaN.
  std::vector<float> old_values(4096, 1.0f);
  old_values[10] = 0.0f;
  old_values[20] = nan;
  old_values[30] = nan;
  std::vector<float> new_values = old_values;
  new_values[10] = -0.0f;
  new_values[30] = -nan;
  Bytes published = bytes_of(old_values);
  const Bytes old_bytes = published;
  PatchWriter writer(DType::kFloat32, published, 0);
  writer.write(DType::kFloat32, bytes_of(new_values).data(), new_values.size());
  EXPECT_EQ(writer.elements_changed(), 2u);  // 10 and 30
  EXPECT_EQ(published, bytes_of(new_values));
  auto patch = writer.finish();
  ASSERT_TRUE(patch.has_value());
  Bytes tensor = old_bytes;
  auto applied = apply_patch(*patch, 4, tensor, 0);
  ASSERT_TRUE(applied.ok()) << applied.error().detail;
  EXPECT_EQ(applied.value(), 2u);
  EXPECT_EQ(tensor, published);
}

// 16 bytes: a patch's header alone (40) is longer, so none is made; the tensor goes dense.
TEST(PatchWriter, ATinyTensorHasNoPatch) {
  Bytes published(16);
  PatchWriter writer(DType::kFloat32, published, 0);
  const std::vector<float> ones(4, 1.0f);
  writer.write(DType::kFloat32, bytes_of(ones).data(), 4);
  EXPECT_EQ(writer.elements_changed(), 4u);
  EXPECT_FALSE(writer.finish().has_value());
  EXPECT_EQ(published, bytes_of(ones));
}

TEST(PatchWriter, APatchPastItsLimitIsNotMadeButTheBufferHoldsTheNewVersion) {
  Step step = make_step(1 << 18, 600);  // 60 % changed: more than 40 % of the bytes in any encoding
  PatchWriter writer(DType::kBFloat16, step.published, 0);
  writer.write(DType::kFloat32, reinterpret_cast<const std::byte*>(step.master.data()), step.master.size());
  EXPECT_FALSE(writer.finish().has_value());
  EXPECT_EQ(step.published, converted(step.master));
}

TEST(PatchWriter, MisuseIsACallersBug) {
  Bytes published(8);
  PatchWriter writer(DType::kBFloat16, published, 0);
  const Bytes five_floats(20);
  EXPECT_THROW(writer.write(DType::kFloat32, five_floats.data(), 5), RequirementFailure);  // 4 elements only
  EXPECT_THROW(writer.finish(), RequirementFailure);  // none written yet
  EXPECT_THROW(writer.write(DType::kInt8, five_floats.data(), 1), RequirementFailure);
  EXPECT_THROW(PatchWriter(DType::kBFloat16, published, 0, 1.5), RequirementFailure);
  EXPECT_THROW(PatchWriter(DType::kBFloat16, published, 0, -0.5), RequirementFailure);
  EXPECT_THROW(PatchWriter(DType::kBFloat16, published, 0, std::nan("")), RequirementFailure);
}

}  // namespace
}  // namespace th::client_impl
