// The main of a GoogleTest binary that needs a GPU: where there is none, one line says why and it
// exits 77, which ctest counts as skipped (SKIP_RETURN_CODE 77); tools/gpu-check fails on a skip.
#pragma once

#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cstdio>

namespace th::gpu_test {

inline int run_where_a_gpu_is(int argc, char** argv) {
  int devices = 0;
  const cudaError_t status = cudaGetDeviceCount(&devices);
  if (status != cudaSuccess || devices == 0) {
    std::printf("SKIP: no CUDA device (%s)\n", status != cudaSuccess ? cudaGetErrorString(status) : "none found");
    return 77;
  }
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}

}  // namespace th::gpu_test
