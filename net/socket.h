// Blocking TCP sockets for the data plane: an owning file descriptor, whole-buffer send and
// receive, and "host:port" endpoints. Failures of the peer are I/O logistics: they throw
// SocketError, which the data plane turns into a failed read of that source.
#pragma once

#include <chrono>
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
// A timeout or deadline passed: the peer is slow, hung or gone without a word. (Any other
// SocketError means the peer or the network said something: a close, a reset.)
struct SocketTimeout : SocketError {
  using SocketError::SocketError;
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
// The address of this host's interface that reaches `peer` (a UDP socket connected to it, which
// sends nothing: the kernel's route lookup picks the source address). Throws SocketError naming
// the peer if it does not resolve or no route reaches it.
std::string local_address_towards(const Endpoint& peer);
// An address that listens on every interface (and that no peer can dial): "", or any spelling
// of 0.0.0.0 or :: ("0", "::0", ...).
bool is_wildcard_host(std::string_view host);
// An IPv6 link-local address (fe80::/10): dialled only with its interface, which it does not carry.
bool is_link_local(std::string_view host);

// Name resolution for TCP (SOCK_STREAM) or UDP (SOCK_DGRAM) sockets; passive: for bind().
// Throws SocketError naming the endpoint if it does not resolve.
struct AddrInfoDeleter {
  void operator()(addrinfo* info) const;
};
using AddrInfo = std::unique_ptr<addrinfo, AddrInfoDeleter>;
AddrInfo resolve(const Endpoint& endpoint, int socket_type, bool passive);

// A listening socket on host:port (port 0: the kernel picks; see local_port). It does not block:
// wait for it with wait_readable, then accept_tcp.
Fd listen_tcp(const Endpoint& endpoint, int backlog);
// The next connection waiting on `listener`, or an invalid Fd when there is none after all (it
// was reset while it waited). Throws SocketError when the process is out of descriptors or memory.
Fd accept_tcp(const Fd& listener);
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

// As send_all and recv_all_or_eof, but the whole message must go (or come) by `deadline`: a peer
// that trickles cannot stretch it, as it stretches a timeout that restarts on every partial
// transfer. Throws SocketTimeout when the deadline passes. The socket's own timeouts do not apply.
using Deadline = std::chrono::steady_clock::time_point;
void send_all_by(const Fd& socket, const void* data, std::size_t bytes, Deadline deadline);
bool recv_all_or_eof_by(const Fd& socket, void* data, std::size_t bytes, Deadline deadline);

// Wakes a thread that waits in wait_readable (an eventfd): signals are not counted, only noticed.
class Wakeup {
 public:
  Wakeup();
  Wakeup(const Wakeup&) = delete;
  Wakeup& operator=(const Wakeup&) = delete;
  void signal() const;
  void clear() const;  // call when wait_readable reported it
  const Fd& fd() const { return fd_; }

 private:
  Fd fd_;
};

// Waits until `first` (skipped when null) or `second` can be read, or has closed.
struct Readable {
  bool first = false;
  bool second = false;
};
Readable wait_readable(const Fd* first, const Fd& second);

}  // namespace th::net
