// libibverbs, opened on first use instead of linked. A libthclient (or a Python wheel) built with
// RDMA then loads and runs on a machine without rdma-core: transport "rdma" fails there with an
// error that names the missing library, and TCP carries the bytes.
//
// The functions below are the verbs entry points rdma/ calls, defined here with hidden visibility:
// they satisfy the link inside libthclient without exporting anything, so a process that also
// loads the real libibverbs (torch, NCCL) never calls these by accident. Each one resolves its
// real counterpart once, in the library named by TH_IBVERBS_LIBRARY (default libibverbs.so.1).
// Inline helpers of <infiniband/verbs.h> (ibv_post_send, ibv_poll_cq, ...) call through the
// device context's function table and need nothing here. A name in parentheses is not expanded by
// the header's function-like macros (ibv_query_port is one): the definition is of the symbol.
#include "rdma/verbs_loader.h"

#include <dlfcn.h>
#include <infiniband/verbs.h>

#include <cerrno>
#include <cstdlib>
#include <optional>
#include <string>

namespace th::rdma {
namespace {

struct VerbsLibrary {
  void* handle = nullptr;
  std::string name;
  std::string error;  // why dlopen failed; empty when handle is set
};

const VerbsLibrary& verbs_library() {
  static const VerbsLibrary library = [] {
    VerbsLibrary opened;
    const char* configured = std::getenv("TH_IBVERBS_LIBRARY");
    opened.name = configured != nullptr && configured[0] != '\0' ? configured : "libibverbs.so.1";
    // RTLD_LOCAL: our lookups go through the handle; the library's symbols stay out of the
    // process's global scope, as when a plain dlopen'd plugin uses it.
    opened.handle = ::dlopen(opened.name.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (opened.handle == nullptr) {
      const char* reason = ::dlerror();
      opened.error = reason != nullptr ? reason : "dlopen failed";
    } else if (::dlsym(opened.handle, "ibv_get_device_list") == nullptr) {
      // Another library by mistake (TH_IBVERBS_LIBRARY=libz.so.1): say so, rather than "no device".
      ::dlclose(opened.handle);
      opened.handle = nullptr;
      opened.error = "it has no ibv_get_device_list: it is not libibverbs";
    }
    return opened;
  }();
  return library;
}

// The real function, or nullptr (errno ENOSYS) when the library or this symbol is missing: an
// older rdma-core may lack a newer call (ibv_reg_dmabuf_mr is rdma-core 34), which then fails alone.
template <typename Function>
Function resolve(const char* symbol) {
  const VerbsLibrary& library = verbs_library();
  if (library.handle == nullptr) return nullptr;
  return reinterpret_cast<Function>(::dlsym(library.handle, symbol));
}

}  // namespace

std::optional<std::string> verbs_unavailable() {
  const VerbsLibrary& library = verbs_library();
  if (library.handle != nullptr) return std::nullopt;
  return library.name + " could not be loaded (" + library.error +
         "): install rdma-core's libibverbs1 and ibverbs-providers, or set TH_IBVERBS_LIBRARY to its path";
}

}  // namespace th::rdma

#define TH_VERBS_FORWARD(result_type, failed_value, symbol, parameters, arguments)                 \
  extern "C" __attribute__((visibility("hidden"))) result_type(symbol) parameters {                 \
    using Function = result_type(*) parameters;                                                   \
    static const Function real = th::rdma::resolve<Function>(#symbol);                            \
    if (real == nullptr) {                                                                        \
      errno = ENOSYS;                                                                             \
      return failed_value;                                                                        \
    }                                                                                             \
    return real arguments;                                                                        \
  }

#define TH_VERBS_FORWARD_VOID(symbol, parameters, arguments)                                       \
  extern "C" __attribute__((visibility("hidden"))) void(symbol) parameters {                        \
    using Function = void(*) parameters;                                                          \
    static const Function real = th::rdma::resolve<Function>(#symbol);                            \
    if (real != nullptr) real arguments;                                                          \
  }

// ibv_get_device_list reports "no devices" (nullptr, *count 0) when the library is missing, as
// it does on a machine whose rdma-core finds no device: callers already handle that.
extern "C" __attribute__((visibility("hidden"))) ibv_device** ibv_get_device_list(int* count) {
  using Function = ibv_device** (*)(int*);
  static const Function real = th::rdma::resolve<Function>("ibv_get_device_list");
  if (real == nullptr) {
    if (count != nullptr) *count = 0;
    errno = ENOSYS;
    return nullptr;
  }
  return real(count);
}

TH_VERBS_FORWARD_VOID(ibv_free_device_list, (ibv_device** list), (list))
TH_VERBS_FORWARD(const char*, "unknown", ibv_get_device_name, (ibv_device* device), (device))
TH_VERBS_FORWARD(ibv_context*, nullptr, ibv_open_device, (ibv_device* device), (device))
TH_VERBS_FORWARD(int, ENOSYS, ibv_close_device, (ibv_context* context), (context))
TH_VERBS_FORWARD(int, ENOSYS, ibv_query_device, (ibv_context* context, ibv_device_attr* attr), (context, attr))
TH_VERBS_FORWARD(int, ENOSYS, ibv_query_port, (ibv_context* context, uint8_t port, _compat_ibv_port_attr* attr),
                 (context, port, attr))
TH_VERBS_FORWARD(int, ENOSYS, ibv_query_gid, (ibv_context* context, uint8_t port, int index, ibv_gid* gid),
                 (context, port, index, gid))
TH_VERBS_FORWARD(int, ENOSYS, _ibv_query_gid_ex,
                 (ibv_context* context, uint32_t port, uint32_t index, ibv_gid_entry* entry, uint32_t flags,
                  size_t entry_size),
                 (context, port, index, entry, flags, entry_size))
TH_VERBS_FORWARD(ibv_pd*, nullptr, ibv_alloc_pd, (ibv_context* context), (context))
TH_VERBS_FORWARD(int, ENOSYS, ibv_dealloc_pd, (ibv_pd* pd), (pd))
TH_VERBS_FORWARD(ibv_mr*, nullptr, ibv_reg_mr_iova2,
                 (ibv_pd* pd, void* address, size_t length, uint64_t iova, unsigned int access),
                 (pd, address, length, iova, access))
TH_VERBS_FORWARD(ibv_mr*, nullptr, ibv_reg_dmabuf_mr,
                 (ibv_pd* pd, uint64_t offset, size_t length, uint64_t iova, int fd, int access),
                 (pd, offset, length, iova, fd, access))
TH_VERBS_FORWARD(int, ENOSYS, ibv_dereg_mr, (ibv_mr* mr), (mr))
TH_VERBS_FORWARD(ibv_comp_channel*, nullptr, ibv_create_comp_channel, (ibv_context* context), (context))
TH_VERBS_FORWARD(int, ENOSYS, ibv_destroy_comp_channel, (ibv_comp_channel* channel), (channel))
TH_VERBS_FORWARD(ibv_cq*, nullptr, ibv_create_cq,
                 (ibv_context* context, int entries, void* cq_context, ibv_comp_channel* channel, int vector),
                 (context, entries, cq_context, channel, vector))
TH_VERBS_FORWARD(int, ENOSYS, ibv_destroy_cq, (ibv_cq* cq), (cq))
TH_VERBS_FORWARD(int, ENOSYS, ibv_get_cq_event, (ibv_comp_channel* channel, ibv_cq** cq, void** cq_context),
                 (channel, cq, cq_context))
TH_VERBS_FORWARD_VOID(ibv_ack_cq_events, (ibv_cq* cq, unsigned int events), (cq, events))
TH_VERBS_FORWARD(ibv_qp*, nullptr, ibv_create_qp, (ibv_pd* pd, ibv_qp_init_attr* attr), (pd, attr))
TH_VERBS_FORWARD(int, ENOSYS, ibv_modify_qp, (ibv_qp* qp, ibv_qp_attr* attr, int mask), (qp, attr, mask))
TH_VERBS_FORWARD(int, ENOSYS, ibv_destroy_qp, (ibv_qp* qp), (qp))
TH_VERBS_FORWARD(const char*, "unknown work completion status", ibv_wc_status_str, (ibv_wc_status status),
                 (status))
