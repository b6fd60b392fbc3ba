// Tensor descriptions for the layout tests: a shard's own tensor of a shape, and a piece (a box)
// of the model's tensor of a global shape, with their sizes worked out.
#pragma once

#include <string>
#include <utility>

#include "core/box.h"
#include "core/types.h"

namespace th::test {

inline TensorSpec own(std::string name, Shape shape, DType dtype = DType::kBFloat16) {
  TensorSpec spec{std::move(name), dtype, 0};
  spec.kind = TensorKind::kLocal;
  spec.shape = std::move(shape);
  spec.bytes = element_count(spec.shape) * dtype_bytes(dtype);
  return spec;
}

inline TensorSpec piece(std::string name, Shape shape, Box box, DType dtype = DType::kBFloat16) {
  TensorSpec spec{std::move(name), dtype, element_count(box.extent) * dtype_bytes(dtype)};
  spec.kind = TensorKind::kPiece;
  spec.shape = std::move(shape);
  spec.box = std::move(box);
  return spec;
}

}  // namespace th::test
