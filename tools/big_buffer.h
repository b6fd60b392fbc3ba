// Big anonymous buffers for th-bench: tensors of gigabytes, in huge pages where the kernel allows.
#pragma once

#include <sys/mman.h>

#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>

namespace th::bench {

// Anonymous memory in 2 MiB pages where the kernel allows (transparent huge pages on madvise):
// touching gigabytes in 4 KiB pages costs tens of seconds of page faults on this VM.
class BigBuffer {
 public:
  explicit BigBuffer(std::uint64_t bytes) : bytes_(bytes) {
    void* at = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (at == MAP_FAILED) throw std::runtime_error("mmap of " + std::to_string(bytes) + " bytes failed");
    ::madvise(at, bytes, MADV_HUGEPAGE);  // advice only: 4 KiB pages if refused
    data_ = static_cast<std::byte*>(at);
  }
  ~BigBuffer() { ::munmap(data_, bytes_); }
  BigBuffer(const BigBuffer&) = delete;
  BigBuffer& operator=(const BigBuffer&) = delete;
  std::byte* get() const { return data_; }

 private:
  std::byte* data_ = nullptr;
  std::uint64_t bytes_ = 0;
};

}  // namespace th::bench
