// Heartbeats as one-way UDP datagrams.
//
// An idle fleet's cost on th-server is its heartbeats. As Cap'n Proto calls they cost ~64 us of
// server CPU each (a message in, a Return out, promises, allocations, two syscalls): 8,192 clients
// beating once a second took 58% of a core (bench/results/heartbeats-*.md). As datagrams, read in
// batches with recvmmsg, they cost about a microsecond each.
//
// A datagram carries the client id, its session, and the secret the server gave the client's
// connection at connect (after the cluster token was checked): the server accepts it only from a
// client bound to the connection that holds that secret. Datagrams can be lost; a client keeps
// sending heartbeats as calls until the server says it hears the datagrams (Session.send's reply),
// and goes back to calls when it stops saying so (see client/handle.cpp).
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <vector>

#include <sys/socket.h>

#include "core/types.h"
#include "net/socket.h"

namespace th::net {

struct HeartbeatDatagram {
  ClientId client = 0;
  std::uint64_t session = 0;
  std::uint64_t secret = 0;
  bool operator==(const HeartbeatDatagram&) const = default;
};

// "THHB", format version, client, session, secret; integers little-endian.
inline constexpr std::size_t kHeartbeatDatagramBytes = 32;
using HeartbeatBytes = std::array<std::byte, kHeartbeatDatagramBytes>;

HeartbeatBytes encode(const HeartbeatDatagram& datagram);
// Nothing for anything that is not exactly one well-formed datagram of this format.
std::optional<HeartbeatDatagram> decode_heartbeat(std::span<const std::byte> bytes);

// th-server's end: a UDP socket bound to the control port's address, read without blocking.
class HeartbeatReceiver {
 public:
  static constexpr std::size_t kBatch = 64;                 // datagrams per recvmmsg
  static constexpr int kReceiveBufferBytes = 4 << 20;       // a second of 8,192 clients' beats, many times

  explicit HeartbeatReceiver(const Endpoint& bind);

  int fd() const { return socket_.get(); }
  std::uint16_t port() const { return port_; }
  // Appends up to kBatch well-formed datagrams that have arrived; never blocks. Returns how many
  // datagrams were read (well-formed or not): 0 means the socket is drained.
  std::size_t receive(std::vector<HeartbeatDatagram>& out);
  std::uint64_t malformed() const { return malformed_; }

 private:
  Fd socket_;
  std::uint16_t port_ = 0;
  std::uint64_t malformed_ = 0;
};

// libthclient's end: a UDP socket connected to the server's heartbeat port.
class HeartbeatSender {
 public:
  explicit HeartbeatSender(const Endpoint& server);
  // To `port` at the address of `peer` (the control connection's peer: no name lookup, and the very
  // address the TCP connection reached). `peer` is a sockaddr_in or sockaddr_in6.
  HeartbeatSender(const sockaddr_storage& peer, std::uint16_t port);
  // Best effort, never blocks: false if the kernel did not take it (buffer full, port unreachable).
  bool send(const HeartbeatDatagram& datagram);

 private:
  Fd socket_;
};

}  // namespace th::net
