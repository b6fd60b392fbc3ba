#pragma once
// libibverbs is opened at run time (rdma/verbs_loader.cpp), not linked: this says whether it was.
#include <optional>
#include <string>

namespace th::rdma {

// Why libibverbs cannot be used (the library's name, dlopen's reason, what to install), or
// nullopt when it loaded. TH_IBVERBS_LIBRARY names another library (a path or a soname).
std::optional<std::string> verbs_unavailable();

}  // namespace th::rdma
