// The one place CUDA runtime calls are checked (conventions §8, after NCCL's CUDACHECK).
//
// A failing call throws CudaError naming the call as written and the runtime's description of the
// error, so that a log line says which call failed and why without a debugger. CUDA errors are I/O
// logistics of the device, as VerbsError is for the NIC: callers turn them into a failed transfer
// or verification, never into an assertion.
#pragma once

#include <cuda_runtime_api.h>

#include <stdexcept>
#include <string>

namespace th::cuda {

struct CudaError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

}  // namespace th::cuda

// Evaluates `call` (a cudaError_t expression) once; on failure throws CudaError("<call>: <error>").
#define TH_CUDA_CHECK(call)                                                                        \
  do {                                                                                             \
    const ::cudaError_t th_cuda_check_status_ = (call);                                            \
    if (th_cuda_check_status_ != ::cudaSuccess) [[unlikely]] {                                     \
      throw ::th::cuda::CudaError(std::string(#call) + ": " +                                      \
                                  ::cudaGetErrorString(th_cuda_check_status_));                    \
    }                                                                                              \
  } while (false)
