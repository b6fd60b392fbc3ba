// libFuzzer target: the data plane's request parser (net/data_plane.cpp), which a source's
// DataServer runs on whatever a peer sends to its data port. Each input is sent on a fresh
// connection to one in-process server that holds three grants (complete, partial, and one of "GPU
// memory", staged and exported over CUDA IPC). The server must answer or close, never crash or
// hang, and must never serve a byte, nor an IPC handle, to a request that lacks the grant's secret.
#include <sys/socket.h>

#include <cerrno>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <vector>

#include "net/data_plane.h"
#include "net/ipc.h"
#include "net/staging.h"

namespace {

constexpr th::GrantSecret kSecret{0x243f6a8885a308d3ULL, 0x13198a2e03707344ULL};
constexpr std::uint64_t kExposedBytes = 1 << 16;
constexpr std::byte kHandleByte{0xa7};  // every byte of an exported IPC handle

// "GPU memory" that is host memory: staging copies are plain copies, done at once.
class InstantLane final : public th::net::CopyLane {
 public:
  Ticket to_host(std::byte* host, const std::byte* device, std::uint64_t bytes) override {
    std::memcpy(host, device, bytes);
    return next_++;
  }
  Ticket to_device(std::byte* device, const std::byte* host, std::uint64_t bytes) override {
    std::memcpy(device, host, bytes);
    return next_++;
  }
  void wait(Ticket) override {}

 private:
  Ticket next_ = 0;
};
class InstantStaging final : public th::net::StagingProvider {
 public:
  std::unique_ptr<th::net::CopyLane> make_lane() override { return std::make_unique<InstantLane>(); }
  std::shared_ptr<std::byte[]> allocate_pinned(std::uint64_t bytes) override { return std::make_shared<std::byte[]>(bytes); }
};
// Exports every GPU region with a recognisable handle: a request without the secret must never
// see one.
class MarkedExporter final : public th::net::IpcExporter {
 public:
  std::optional<th::net::IpcExport> export_region(const std::byte*, std::uint64_t bytes) override {
    th::net::IpcExport exported;
    exported.handle.fill(kHandleByte);
    exported.offset = 0;
    exported.allocation_bytes = bytes;
    return exported;
  }
  std::string host_identity() override { return "fuzz-host"; }
  std::uint64_t process_identity() override { return 1; }
};

struct Fixture {
  std::vector<std::byte> memory = std::vector<std::byte>(kExposedBytes, std::byte{0x5a});
  std::unique_ptr<th::net::DataServer> server;

  Fixture() {
    th::net::DataServerConfig config;
    config.grant_wait_ms_max = 1;            // unknown grants: refused, not awaited
    config.progress_wait_ms_max = 1;         // nor bytes that are not ready
    config.first_request_timeout_ms = 1000;  // a truncated request: the input's end closes it
    config.idle_timeout_ms = 1000;
    config.staging = std::make_shared<th::net::StagingPool>(std::make_shared<InstantStaging>(), th::net::StagingConfig{});
    config.ipc = std::make_shared<MarkedExporter>();
    server = std::make_unique<th::net::DataServer>(config);
    // A complete copy under (7, 1) and a partial one under (8, 1) (half ready).
    server->grant({7, 1}, kSecret, {{memory.data(), memory.size()}}, std::make_shared<th::net::Progress>(kExposedBytes));
    server->grant({8, 1}, kSecret, {{memory.data(), memory.size() / 2}, {memory.data(), memory.size() / 2}},
                  std::make_shared<th::net::Progress>(kExposedBytes / 4));
    // And a complete copy in "GPU memory" under (9, 1): reads staged, IPC handles answered.
    server->grant({9, 1}, kSecret,
                  {{memory.data(), memory.size() / 2, true}, {memory.data() + memory.size() / 2, memory.size() / 2, true}},
                  std::make_shared<th::net::Progress>(kExposedBytes));
  }
};

bool contains(const std::uint8_t* data, std::size_t size, const void* needle, std::size_t needle_size) {
  for (std::size_t i = 0; i + needle_size <= size; ++i) {
    if (std::memcmp(data + i, needle, needle_size) == 0) return true;
  }
  return false;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  static Fixture fixture;
  try {
    th::net::Fd connection = th::net::connect_tcp(fixture.server->endpoint(), 5000);
    th::net::set_io_timeout(connection, 5000);
    th::net::send_all(connection, data, size);
    ::shutdown(connection.get(), SHUT_WR);  // the end of the input: the server sees EOF
    std::vector<std::uint8_t> answer(1 << 20);
    std::size_t got = 0;
    for (;;) {
      if (got == answer.size()) answer.resize(answer.size() * 2);
      const ssize_t n = ::recv(connection.get(), answer.data() + got, answer.size() - got, 0);
      if (n > 0) {
        got += static_cast<std::size_t>(n);
        continue;
      }
      if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
        throw std::logic_error("the data server neither answered nor closed within 5 s of the input's end");
      }
      break;  // closed or reset
    }
    // Payload bytes are 0x5a: any run of them in the answer means the server served memory.
    const std::uint8_t served[8] = {0x5a, 0x5a, 0x5a, 0x5a, 0x5a, 0x5a, 0x5a, 0x5a};
    if (contains(answer.data(), got, served, sizeof served) && !contains(data, size, kSecret.data(), sizeof kSecret)) {
      throw std::logic_error("the data server served bytes to a request without the grant's secret");
    }
    const std::uint8_t handle[8] = {0xa7, 0xa7, 0xa7, 0xa7, 0xa7, 0xa7, 0xa7, 0xa7};
    if (contains(answer.data(), got, handle, sizeof handle) && !contains(data, size, kSecret.data(), sizeof kSecret)) {
      throw std::logic_error("the data server answered IPC handles to a request without the grant's secret");
    }
  } catch (const th::net::SocketError&) {
    // The server closed the connection while we sent: an answer too.
  }
  return 0;
}
