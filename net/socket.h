// Blocking TCP sockets for the data plane: an owning file descriptor, whole-buffer send and
// receive, and "host:port" endpoints. Failures of the peer are I/O logistics: they throw
// SocketError, which the data plane turns into a failed read of that source.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <string_view>

struct addrinfo;

namespace th::net {

struct SocketError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// Owns one file descriptor; closes it once.
class Fd {
 public:
  Fd() = default;
  explicit Fd(int fd) : fd_(fd) {}
  Fd(Fd&& other) noexcept : fd_(other.release()) {}
  Fd& operator=(Fd&& other) noexcept;
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  ~Fd();

  int get() const { return fd_; }
  bool valid() const { return fd_ >= 0; }
  int release();
  // Stops both directions now: a thread blocked in recv on this socket returns.
  void shutdown() const;

 private:
  int fd_ = -1;
};

struct Endpoint {
  std::string host;
  std::uint16_t port = 0;
  std::string to_string() const;
};
// Parses "host:port" (IPv4 dotted quad or a name that resolves; "[v6]:port" for IPv6).
Endpoint parse_endpoint(std::string_view text);

// Name resolution for TCP (SOCK_STREAM) or UDP (SOCK_DGRAM) sockets; passive: for bind().
// Throws SocketError naming the endpoint if it does not resolve.
struct AddrInfoDeleter {
  void operator()(addrinfo* info) const;
};
using AddrInfo = std::unique_ptr<addrinfo, AddrInfoDeleter>;
AddrInfo resolve(const Endpoint& endpoint, int socket_type, bool passive);

// A listening socket on host:port (port 0: the kernel picks; see local_port).
Fd listen_tcp(const Endpoint& endpoint, int backlog);
std::uint16_t local_port(const Fd& socket);
// Connects with a deadline; throws SocketError naming the endpoint on failure.
Fd connect_tcp(const Endpoint& endpoint, int timeout_ms);
// Sets a receive/send timeout so that a silent peer cannot block a thread for ever.
void set_io_timeout(const Fd& socket, int timeout_ms);
void set_buffer_bytes(const Fd& socket, int bytes);

void send_all(const Fd& socket, const void* data, std::size_t bytes);
// Receives exactly `bytes`; throws SocketError if the peer closes first or the timeout passes.
void recv_all(const Fd& socket, void* data, std::size_t bytes);
// As recv_all, but a clean close before the first byte returns false (the peer hung up between
// messages).
bool recv_all_or_eof(const Fd& socket, void* data, std::size_t bytes);

}  // namespace th::net
