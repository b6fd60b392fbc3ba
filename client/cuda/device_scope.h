// What client/cuda's files share (not installed): driver functions without linking libcuda, and
// DeviceScope, which makes a device current for a scope and puts back the thread's own context.
#pragma once

#include <cuda.h>
#include <cuda_runtime_api.h>

#include <string>

#include "net/staging.h"

namespace th::client_impl::cuda_detail {

inline void check(cudaError_t status, const char* call) {
  if (status != cudaSuccess) throw net::DeviceCopyError(std::string(call) + ": " + cudaGetErrorString(status));
}

// A driver function through the runtime's entry point (no link against libcuda), or null.
template <typename Function>
inline Function driver_function(const char* name) {
  void* function = nullptr;
  cudaDriverEntryPointQueryResult found{};
  if (cudaGetDriverEntryPointByVersion(name, &function, 12000, cudaEnableDefault, &found) != cudaSuccess ||
      found != cudaDriverEntryPointSuccess) {
    cudaGetLastError();
    return nullptr;
  }
  return reinterpret_cast<Function>(function);
}

using CtxGetCurrent = CUresult (*)(CUcontext* context);
using CtxSetCurrent = CUresult (*)(CUcontext context);
struct ContextFunctions {
  CtxGetCurrent get = driver_function<CtxGetCurrent>("cuCtxGetCurrent");
  CtxSetCurrent set = driver_function<CtxSetCurrent>("cuCtxSetCurrent");
};
inline const ContextFunctions& context_functions() {
  static const ContextFunctions functions;
  return functions;
}

// Makes `device` current on this thread for a scope (kernels, streams and pinned allocations
// belong to the current device), then puts back the thread's own context exactly, none included:
// restoring "device 0" instead would create a context on GPU 0 in every process (hundreds of MiB
// each, and a failure where GPU 0 is in exclusive-process mode). `quiet`: never throws (for
// destructors); the calls that follow then fail on their own, and say so where they can.
class DeviceScope {
 public:
  explicit DeviceScope(int device, bool quiet = false) {
    const ContextFunctions& context = context_functions();
    CUcontext saved = nullptr;
    saved_known_ = context.get != nullptr && context.set != nullptr && context.get(&saved) == CUDA_SUCCESS;
    saved_ = saved;
    if (!saved_known_) cudaGetDevice(&previous_device_);
    const cudaError_t status = cudaSetDevice(device);
    if (status != cudaSuccess && !quiet) check(status, "cudaSetDevice");
  }
  ~DeviceScope() {
    if (saved_known_) {
      context_functions().set(saved_);
    } else {
      cudaSetDevice(previous_device_);
    }
  }
  DeviceScope(const DeviceScope&) = delete;
  DeviceScope& operator=(const DeviceScope&) = delete;

 private:
  bool saved_known_ = false;
  CUcontext saved_ = nullptr;
  int previous_device_ = 0;
};

}  // namespace th::client_impl::cuda_detail
