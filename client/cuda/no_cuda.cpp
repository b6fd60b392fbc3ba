// libthclient built without the CUDA Toolkit: there is no GPU access, and a kCuda registration
// says why.
#include "client/cuda/ipc.h"
#include "client/gpu.h"

namespace th::client_impl {

Result<std::shared_ptr<Gpu>> gpu() {
  return make_error(Errc::kInvalidArgument,
                    "this libthclient was built without the CUDA Toolkit, so it cannot take GPU memory: register "
                    "CPU memory, or rebuild where the toolkit is (cmake -DTH_CUDA=ON)");
}

// No CUDA IPC either (there is no GPU memory to share): every read goes over TCP.
std::shared_ptr<net::IpcExporter> make_ipc_exporter() { return nullptr; }
std::shared_ptr<net::IpcImporter> make_ipc_importer(int device) {
  (void)device;
  return nullptr;
}

}  // namespace th::client_impl
