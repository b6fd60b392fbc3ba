// libthclient built without the CUDA Toolkit: there is no GPU access, and a kCuda registration
// says why.
#include "client/gpu.h"

namespace th::client_impl {

Result<std::shared_ptr<Gpu>> gpu() {
  return make_error(Errc::kInvalidArgument,
                    "this libthclient was built without the CUDA Toolkit, so it cannot take GPU memory: register "
                    "CPU memory, or rebuild where the toolkit is (cmake -DTH_CUDA=ON)");
}

}  // namespace th::client_impl
