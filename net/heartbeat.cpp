#include "net/heartbeat.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <cerrno>
#include <cstring>

namespace th::net {
namespace {

constexpr std::array<std::byte, 4> kMagic{std::byte{'T'}, std::byte{'H'}, std::byte{'H'}, std::byte{'B'}};
constexpr std::uint32_t kFormatVersion = 2;  // 1 carried the key itself

void put(std::byte* at, std::uint64_t value, int bytes) {
  for (int i = 0; i < bytes; ++i) at[i] = static_cast<std::byte>((value >> (8 * i)) & 0xff);
}

std::uint64_t get(const std::byte* at, int bytes) {
  std::uint64_t value = 0;
  for (int i = 0; i < bytes; ++i) value |= static_cast<std::uint64_t>(at[i]) << (8 * i);
  return value;
}

Fd udp_socket(const addrinfo& info) {
  Fd socket(::socket(info.ai_family, SOCK_DGRAM | SOCK_CLOEXEC | SOCK_NONBLOCK, info.ai_protocol));
  if (!socket.valid()) throw SocketError(std::string("socket: ") + std::strerror(errno));
  return socket;
}

std::array<std::uint64_t, 2> mac_of(ClientId client, std::uint64_t session, std::uint64_t count, const HeartbeatKey& key) {
  std::array<std::byte, 24> message;
  put(message.data(), client, 8);
  put(message.data() + 8, session, 8);
  put(message.data() + 16, count, 8);
  return siphash128(key, {reinterpret_cast<const std::uint8_t*>(message.data()), message.size()});
}

}  // namespace

HeartbeatDatagram seal(ClientId client, std::uint64_t session, std::uint64_t count, const HeartbeatKey& key) {
  return HeartbeatDatagram{client, session, count, mac_of(client, session, count, key)};
}

bool authentic(const HeartbeatDatagram& datagram, const HeartbeatKey& key) {
  const auto expected = mac_of(datagram.client, datagram.session, datagram.count, key);
  // Constant time: how much of a forged MAC matched must not show in the time the check takes.
  const std::uint64_t difference = (expected[0] ^ datagram.mac[0]) | (expected[1] ^ datagram.mac[1]);
  return difference == 0;
}

std::array<std::uint8_t, 16> key_bytes(const HeartbeatKey& key) {
  std::array<std::uint8_t, 16> bytes;
  put(reinterpret_cast<std::byte*>(bytes.data()), key[0], 8);
  put(reinterpret_cast<std::byte*>(bytes.data()) + 8, key[1], 8);
  return bytes;
}

std::optional<HeartbeatKey> key_from_bytes(std::span<const std::uint8_t> bytes) {
  if (bytes.size() != 16) return std::nullopt;
  const auto* at = reinterpret_cast<const std::byte*>(bytes.data());
  return HeartbeatKey{get(at, 8), get(at + 8, 8)};
}

HeartbeatBytes encode(const HeartbeatDatagram& datagram) {
  HeartbeatBytes bytes{};
  std::memcpy(bytes.data(), kMagic.data(), kMagic.size());
  put(bytes.data() + 4, kFormatVersion, 4);
  put(bytes.data() + 8, datagram.client, 8);
  put(bytes.data() + 16, datagram.session, 8);
  put(bytes.data() + 24, datagram.count, 8);
  put(bytes.data() + 32, datagram.mac[0], 8);
  put(bytes.data() + 40, datagram.mac[1], 8);
  return bytes;
}

std::optional<HeartbeatDatagram> decode_heartbeat(std::span<const std::byte> bytes) {
  if (bytes.size() != kHeartbeatDatagramBytes) return std::nullopt;
  if (std::memcmp(bytes.data(), kMagic.data(), kMagic.size()) != 0) return std::nullopt;
  if (get(bytes.data() + 4, 4) != kFormatVersion) return std::nullopt;
  HeartbeatDatagram datagram;
  datagram.client = get(bytes.data() + 8, 8);
  datagram.session = get(bytes.data() + 16, 8);
  datagram.count = get(bytes.data() + 24, 8);
  datagram.mac = {get(bytes.data() + 32, 8), get(bytes.data() + 40, 8)};
  if (datagram.count == 0) return std::nullopt;  // counts start at 1
  return datagram;
}

HeartbeatReceiver::HeartbeatReceiver(const Endpoint& bind) {
  auto info = resolve(bind, SOCK_DGRAM, true);
  socket_ = udp_socket(*info);
  const int on = 1;
  ::setsockopt(socket_.get(), SOL_SOCKET, SO_REUSEADDR, &on, sizeof on);
  // Best effort: the kernel caps it at net.core.rmem_max; beats lost to a full buffer are retried
  // by the next interval, and the timeout spans many intervals.
  ::setsockopt(socket_.get(), SOL_SOCKET, SO_RCVBUF, &kReceiveBufferBytes, sizeof kReceiveBufferBytes);
  if (::bind(socket_.get(), info->ai_addr, info->ai_addrlen) != 0) {
    throw SocketError("bind udp " + bind.to_string() + ": " + std::strerror(errno));
  }
  port_ = local_port(socket_);
}

std::size_t HeartbeatReceiver::receive(std::vector<HeartbeatDatagram>& out, std::size_t max) {
  TH_ASSERT(max >= 1 && max <= kBatch);
  // One byte more than a datagram, so that a longer one shows as longer rather than truncated.
  std::array<std::array<std::byte, kHeartbeatDatagramBytes + 1>, kBatch> buffers;
  std::array<iovec, kBatch> vectors;
  std::array<mmsghdr, kBatch> headers{};
  for (std::size_t i = 0; i < kBatch; ++i) {
    vectors[i] = iovec{buffers[i].data(), buffers[i].size()};
    headers[i].msg_hdr.msg_iov = &vectors[i];
    headers[i].msg_hdr.msg_iovlen = 1;
  }
  const int received = ::recvmmsg(socket_.get(), headers.data(), static_cast<unsigned>(max), MSG_DONTWAIT, nullptr);
  if (received < 0) {
    if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) return 0;
    throw SocketError(std::string("recvmmsg: ") + std::strerror(errno));
  }
  for (int i = 0; i < received; ++i) {
    const auto& header = headers[static_cast<std::size_t>(i)];
    const bool truncated = (header.msg_hdr.msg_flags & MSG_TRUNC) != 0;
    auto datagram = truncated ? std::nullopt
                              : decode_heartbeat({buffers[static_cast<std::size_t>(i)].data(), header.msg_len});
    if (datagram) {
      out.push_back(*datagram);
    } else {
      ++malformed_;
    }
  }
  return static_cast<std::size_t>(received);
}

HeartbeatSender::HeartbeatSender(const Endpoint& server) {
  auto info = resolve(server, SOCK_DGRAM, false);
  socket_ = udp_socket(*info);
  if (::connect(socket_.get(), info->ai_addr, info->ai_addrlen) != 0) {
    throw SocketError("connect udp " + server.to_string() + ": " + std::strerror(errno));
  }
}

HeartbeatSender::HeartbeatSender(const sockaddr_storage& peer, std::uint16_t port) {
  sockaddr_storage to = peer;
  socklen_t length = 0;
  if (to.ss_family == AF_INET) {
    reinterpret_cast<sockaddr_in*>(&to)->sin_port = htons(port);
    length = sizeof(sockaddr_in);
  } else if (to.ss_family == AF_INET6) {
    reinterpret_cast<sockaddr_in6*>(&to)->sin6_port = htons(port);
    length = sizeof(sockaddr_in6);
  } else {
    throw SocketError("heartbeat datagrams need an IPv4 or IPv6 peer");
  }
  socket_ = Fd(::socket(to.ss_family, SOCK_DGRAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
  if (!socket_.valid()) throw SocketError(std::string("socket: ") + std::strerror(errno));
  if (::connect(socket_.get(), reinterpret_cast<const sockaddr*>(&to), length) != 0) {
    throw SocketError(std::string("connect udp: ") + std::strerror(errno));
  }
}

bool HeartbeatSender::send(const HeartbeatDatagram& datagram) {
  const HeartbeatBytes bytes = encode(datagram);
  return ::send(socket_.get(), bytes.data(), bytes.size(), MSG_DONTWAIT | MSG_NOSIGNAL) ==
         static_cast<ssize_t>(bytes.size());
}

}  // namespace th::net
