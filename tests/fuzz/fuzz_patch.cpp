// libFuzzer target: apply_patch (core/patch.h), which a reader runs on the patch bytes a source
// sent it (issue 35). Whatever the bytes, it must answer, never write outside the tensor (ASan),
// and leave the tensor as it was when it refuses. The tensor is sized as the patch's header says
// (up to a little over 1 MiB: two blocks), with the header's base, so that the fuzzer reaches
// past the header's checks; a header that says more is applied to a small tensor and must be
// refused.
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <span>
#include <vector>

#include "core/patch.h"

// Two blocks' worth and a little (the "gaps" seed's tensor): every input allocates, fills and
// compares its tensor: 4 MiB ran 215 inputs a second, this 395.
constexpr std::uint64_t kTensorBytesMax = (1u << 20) + (64u << 10);

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::span<const std::byte> patch(reinterpret_cast<const std::byte*>(data), size);
  std::uint32_t element_bytes = 2;
  std::uint64_t tensor_bytes = 64;
  std::uint64_t base = 0;
  if (auto header = th::read_patch_header(patch); header.ok() && header.value().tensor_bytes <= kTensorBytesMax) {
    element_bytes = header.value().element_bytes;
    tensor_bytes = header.value().tensor_bytes;
    base = header.value().base_checksum;
  }
  std::vector<std::byte> tensor(tensor_bytes);
  for (std::size_t i = 0; i < tensor.size(); ++i) tensor[i] = static_cast<std::byte>(i * 131 + 7);
  const std::vector<std::byte> before = tensor;
  auto applied = th::apply_patch(patch, element_bytes, tensor, base);
  if (!applied.ok() && tensor != before) std::abort();  // refused, yet it wrote
  if (applied.ok() && applied.value() > tensor_bytes / element_bytes) std::abort();
  return 0;
}
