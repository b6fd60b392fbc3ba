// CUDA IPC for the data plane (net/ipc.h): same host, GPU to GPU, device to device instead of
// through pinned staging and TCP. Declared without CUDA: client/cuda/ipc.cpp implements it with the
// runtime, and client/cuda/no_cuda.cpp returns nullptr (no IPC: every read goes over TCP).
//
// Only memory from cudaMalloc (and allocators built on it, such as PyTorch's caching allocator
// without expandable segments) can be exported: memory from cudaMallocAsync pools or from the
// virtual memory API (cuMemCreate: expandable segments) is refused by cudaIpcGetMemHandle, so
// export_region() returns nullopt and its readers use TCP.
#pragma once

#include <memory>

#include "net/ipc.h"

namespace th::client_impl {

// This process's exporter (for DataServerConfig::ipc). Makes no CUDA call until a grant of GPU
// memory is asked for its handles: a handle with CPU tensors only never touches the driver.
std::shared_ptr<net::IpcExporter> make_ipc_exporter();

// An importer (for PullOptions::ipc) that maps sources' allocations into `device`'s context and
// copies from them into `device`'s memory on a stream of its own. It keeps the last
// CachingIpcImporter::kMappingsMaxDefault allocations open and closes them all when dropped.
// Makes no CUDA call until its first pull over IPC.
std::shared_ptr<net::IpcImporter> make_ipc_importer(int device);

}  // namespace th::client_impl
