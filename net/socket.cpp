#include "net/socket.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <limits>
#include <memory>

namespace th::net {
namespace {

[[noreturn]] void fail(const std::string& what) {
  throw SocketError(what + ": " + std::strerror(errno));
}

// Milliseconds left until `deadline`, rounded up (poll would spin on a sub-millisecond rest);
// throws SocketTimeout naming `what` once it has passed.
int ms_until(Deadline deadline, const char* what) {
  const auto left = deadline - std::chrono::steady_clock::now();
  if (left <= std::chrono::steady_clock::duration::zero()) throw SocketTimeout(std::string(what) + ": deadline passed");
  const auto ms = std::chrono::ceil<std::chrono::milliseconds>(left).count();
  return static_cast<int>(std::min<decltype(ms)>(ms, std::numeric_limits<int>::max()));
}

// Waits for `events` on the socket until the deadline. A closed or reset socket reports ready:
// the send or recv that follows says what happened.
void wait_for(const Fd& socket, short events, Deadline deadline, const char* what) {
  for (;;) {
    pollfd waiting{socket.get(), events, 0};
    const int ready = ::poll(&waiting, 1, ms_until(deadline, what));
    if (ready > 0) return;
    if (ready < 0 && errno != EINTR) fail("poll");
  }
}

}  // namespace

void AddrInfoDeleter::operator()(addrinfo* info) const { freeaddrinfo(info); }

AddrInfo resolve(const Endpoint& endpoint, int socket_type, bool passive) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = socket_type;
  hints.ai_flags = passive ? AI_PASSIVE : 0;
  addrinfo* found = nullptr;
  const std::string port = std::to_string(endpoint.port);
  const int rc = getaddrinfo(endpoint.host.empty() ? nullptr : endpoint.host.c_str(), port.c_str(),
                             &hints, &found);
  if (rc != 0) throw SocketError("cannot resolve " + endpoint.to_string() + ": " + gai_strerror(rc));
  return AddrInfo(found);
}

Fd& Fd::operator=(Fd&& other) noexcept {
  if (this != &other) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = other.release();
  }
  return *this;
}

Fd::~Fd() {
  if (fd_ >= 0) ::close(fd_);
}

int Fd::release() {
  const int fd = fd_;
  fd_ = -1;
  return fd;
}

void Fd::shutdown() const {
  if (fd_ >= 0) ::shutdown(fd_, SHUT_RDWR);
}

std::string Endpoint::to_string() const {
  const bool v6 = host.find(':') != std::string::npos;
  return (v6 ? "[" + host + "]" : host) + ":" + std::to_string(port);
}

Endpoint parse_endpoint(std::string_view text) {
  const auto colon = text.rfind(':');
  if (colon == std::string_view::npos || colon + 1 == text.size()) {
    throw SocketError("endpoint '" + std::string(text) + "' is not host:port");
  }
  std::string_view host = text.substr(0, colon);
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') host = host.substr(1, host.size() - 2);
  unsigned port = 0;
  for (char c : text.substr(colon + 1)) {
    if (c < '0' || c > '9' || (port = port * 10 + static_cast<unsigned>(c - '0')) > 65535) {
      throw SocketError("endpoint '" + std::string(text) + "' has no valid port");
    }
  }
  return Endpoint{std::string(host), static_cast<std::uint16_t>(port)};
}

std::string local_address_towards(const Endpoint& peer) {
  auto info = resolve(peer, SOCK_DGRAM, false);
  Fd probe(::socket(info->ai_family, SOCK_DGRAM | SOCK_CLOEXEC, 0));
  if (!probe.valid()) fail("socket");
  if (::connect(probe.get(), info->ai_addr, info->ai_addrlen) != 0) {
    throw SocketError("no route from this host to " + peer.to_string() + ": " + std::strerror(errno));
  }
  sockaddr_storage local{};
  socklen_t length = sizeof local;
  if (::getsockname(probe.get(), reinterpret_cast<sockaddr*>(&local), &length) != 0) fail("getsockname");
  char text[INET6_ADDRSTRLEN] = {};
  const void* address = local.ss_family == AF_INET6
                            ? static_cast<const void*>(&reinterpret_cast<sockaddr_in6*>(&local)->sin6_addr)
                            : static_cast<const void*>(&reinterpret_cast<sockaddr_in*>(&local)->sin_addr);
  if (::inet_ntop(local.ss_family, address, text, sizeof text) == nullptr) fail("inet_ntop");
  return text;
}

bool is_wildcard_host(std::string_view host) {
  if (host.empty()) return true;
  const std::string text(host);
  in_addr v4{};
  if (::inet_aton(text.c_str(), &v4) != 0) return v4.s_addr == htonl(INADDR_ANY);  // "0", "0.0.0.0"
  in6_addr v6{};
  return ::inet_pton(AF_INET6, text.c_str(), &v6) == 1 && IN6_IS_ADDR_UNSPECIFIED(&v6);
}

bool is_link_local(std::string_view host) {
  const std::string text(host);
  in6_addr v6{};
  return ::inet_pton(AF_INET6, text.c_str(), &v6) == 1 && IN6_IS_ADDR_LINKLOCAL(&v6);
}

Fd listen_tcp(const Endpoint& endpoint, int backlog) {
  auto info = resolve(endpoint, SOCK_STREAM, true);
  Fd socket(::socket(info->ai_family, info->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, info->ai_protocol));
  if (!socket.valid()) fail("socket");
  const int on = 1;
  ::setsockopt(socket.get(), SOL_SOCKET, SO_REUSEADDR, &on, sizeof on);
  if (info->ai_family == AF_INET6 && is_wildcard_host(endpoint.host)) {
    // "[::]" listens for IPv4 too, whatever net.ipv6.bindv6only says.
    const int off = 0;
    ::setsockopt(socket.get(), IPPROTO_IPV6, IPV6_V6ONLY, &off, sizeof off);
  }
  if (::bind(socket.get(), info->ai_addr, info->ai_addrlen) != 0) fail("bind " + endpoint.to_string());
  if (::listen(socket.get(), backlog) != 0) fail("listen " + endpoint.to_string());
  return socket;
}

Fd accept_tcp(const Fd& listener) {
  for (;;) {
    // Accepted sockets do not inherit O_NONBLOCK: they block unless a call says otherwise.
    Fd connection(::accept4(listener.get(), nullptr, nullptr, SOCK_CLOEXEC));
    if (connection.valid()) return connection;
    switch (errno) {
      case EINTR: continue;
      case EAGAIN:
#if EWOULDBLOCK != EAGAIN
      case EWOULDBLOCK:
#endif
      case ECONNABORTED:
      case EPROTO:
        return Fd();  // nothing waits any more: the listener itself is fine
      default: fail("accept");
    }
  }
}

std::uint16_t local_port(const Fd& socket) {
  sockaddr_storage address{};
  socklen_t length = sizeof address;
  if (::getsockname(socket.get(), reinterpret_cast<sockaddr*>(&address), &length) != 0) fail("getsockname");
  if (address.ss_family == AF_INET6) return ntohs(reinterpret_cast<sockaddr_in6*>(&address)->sin6_port);
  return ntohs(reinterpret_cast<sockaddr_in*>(&address)->sin_port);
}

Fd connect_tcp(const Endpoint& endpoint, int timeout_ms) {
  auto info = resolve(endpoint, SOCK_STREAM, false);
  Fd socket(::socket(info->ai_family, info->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK,
                     info->ai_protocol));
  if (!socket.valid()) fail("socket");
  if (::connect(socket.get(), info->ai_addr, info->ai_addrlen) != 0) {
    if (errno != EINPROGRESS) fail("connect " + endpoint.to_string());
    pollfd waiting{socket.get(), POLLOUT, 0};
    const int ready = ::poll(&waiting, 1, timeout_ms);
    if (ready == 0) throw SocketError("connect " + endpoint.to_string() + ": timed out");
    if (ready < 0) fail("poll");
    int error = 0;
    socklen_t length = sizeof error;
    ::getsockopt(socket.get(), SOL_SOCKET, SO_ERROR, &error, &length);
    if (error != 0) {
      errno = error;
      fail("connect " + endpoint.to_string());
    }
  }
  // Back to blocking: the data plane uses one thread per stream.
  ::fcntl(socket.get(), F_SETFL, ::fcntl(socket.get(), F_GETFL) & ~O_NONBLOCK);
  const int on = 1;
  ::setsockopt(socket.get(), IPPROTO_TCP, TCP_NODELAY, &on, sizeof on);
  return socket;
}

void set_io_timeout(const Fd& socket, int timeout_ms) {
  timeval timeout{timeout_ms / 1000, (timeout_ms % 1000) * 1000};
  ::setsockopt(socket.get(), SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof timeout);
  ::setsockopt(socket.get(), SOL_SOCKET, SO_SNDTIMEO, &timeout, sizeof timeout);
}

void set_buffer_bytes(const Fd& socket, int bytes) {
  ::setsockopt(socket.get(), SOL_SOCKET, SO_RCVBUF, &bytes, sizeof bytes);
  ::setsockopt(socket.get(), SOL_SOCKET, SO_SNDBUF, &bytes, sizeof bytes);
}

void send_all(const Fd& socket, const void* data, std::size_t bytes) {
  const auto* at = static_cast<const char*>(data);
  while (bytes > 0) {
    const ssize_t sent = ::send(socket.get(), at, bytes, MSG_NOSIGNAL);
    if (sent < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) throw SocketTimeout("send: timed out");
      fail("send");
    }
    at += sent;
    bytes -= static_cast<std::size_t>(sent);
  }
}

bool recv_all_or_eof(const Fd& socket, void* data, std::size_t bytes) {
  auto* at = static_cast<char*>(data);
  const std::size_t wanted = bytes;
  while (bytes > 0) {
    const ssize_t got = ::recv(socket.get(), at, bytes, 0);
    if (got == 0) {
      if (bytes == wanted) return false;
      throw SocketError("peer closed the connection mid-message");
    }
    if (got < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) throw SocketTimeout("recv: timed out");
      fail("recv");
    }
    at += got;
    bytes -= static_cast<std::size_t>(got);
  }
  return true;
}

void recv_all(const Fd& socket, void* data, std::size_t bytes) {
  if (!recv_all_or_eof(socket, data, bytes)) throw SocketError("peer closed the connection");
}

void send_all_by(const Fd& socket, const void* data, std::size_t bytes, Deadline deadline) {
  const auto* at = static_cast<const char*>(data);
  while (bytes > 0) {
    const ssize_t sent = ::send(socket.get(), at, bytes, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (sent < 0) {
      if (errno == EINTR) continue;
      if (errno != EAGAIN && errno != EWOULDBLOCK) fail("send");
      wait_for(socket, POLLOUT, deadline, "send");
      continue;
    }
    at += sent;
    bytes -= static_cast<std::size_t>(sent);
  }
}

bool recv_all_or_eof_by(const Fd& socket, void* data, std::size_t bytes, Deadline deadline) {
  auto* at = static_cast<char*>(data);
  const std::size_t wanted = bytes;
  while (bytes > 0) {
    const ssize_t got = ::recv(socket.get(), at, bytes, MSG_DONTWAIT);
    if (got == 0) {
      if (bytes == wanted) return false;
      throw SocketError("peer closed the connection mid-message");
    }
    if (got < 0) {
      if (errno == EINTR) continue;
      if (errno != EAGAIN && errno != EWOULDBLOCK) fail("recv");
      wait_for(socket, POLLIN, deadline, "recv");
      continue;
    }
    at += got;
    bytes -= static_cast<std::size_t>(got);
  }
  return true;
}

Wakeup::Wakeup() : fd_(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK)) {
  if (!fd_.valid()) fail("eventfd");
}

void Wakeup::signal() const {
  const std::uint64_t one = 1;
  // Fails only when the counter is about to overflow: then it is signalled already.
  [[maybe_unused]] const ssize_t written = ::write(fd_.get(), &one, sizeof one);
}

void Wakeup::clear() const {
  std::uint64_t count = 0;
  // EAGAIN: another reader cleared it first; nothing to do.
  [[maybe_unused]] const ssize_t got = ::read(fd_.get(), &count, sizeof count);
}

Readable wait_readable(const Fd* first, const Fd& second) {
  pollfd waiting[2] = {{first != nullptr ? first->get() : -1, POLLIN, 0}, {second.get(), POLLIN, 0}};
  for (;;) {
    const int ready = ::poll(waiting, 2, -1);
    if (ready > 0) break;
    if (ready < 0 && errno != EINTR) fail("poll");
  }
  return Readable{waiting[0].revents != 0, waiting[1].revents != 0};
}

}  // namespace th::net
