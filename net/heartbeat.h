// Heartbeats as one-way UDP datagrams.
//
// An idle fleet's cost on th-server is its heartbeats. As Cap'n Proto calls they cost ~64 us of
// server CPU each (a message in, a Return out, promises, allocations, two syscalls): 8,192 clients
// beating once a second took 58% of a core (bench/results/heartbeats-*.md). As datagrams, read in
// batches with recvmmsg, they cost about a microsecond each.
//
// A datagram names its client and session, carries a count that only goes up, and is sealed with
// a MAC (SipHash-2-4) under a 128-bit key the server gave the client's connection at connect, after
// the cluster token was checked, over the control connection (TLS when th-server has a
// certificate). The key never crosses the network in clear: a forged datagram fails the MAC, and a
// replayed one carries a count the server has seen already. Datagrams can be lost; a client keeps
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

#include "core/siphash.h"
#include "core/types.h"
#include "net/socket.h"

namespace th::net {

using HeartbeatKey = SipKey;

struct HeartbeatDatagram {
  ClientId client = 0;
  std::uint64_t session = 0;
  std::uint64_t count = 0;                // > every count the server has accepted from the connection
  std::array<std::uint64_t, 2> mac{};     // SipHash-2-4-128 of (client, session, count) under the key
  bool operator==(const HeartbeatDatagram&) const = default;
};

// "THHB", format version 2, client, session, count, MAC; integers little-endian.
inline constexpr std::size_t kHeartbeatDatagramBytes = 48;
using HeartbeatBytes = std::array<std::byte, kHeartbeatDatagramBytes>;

// The datagram of (client, session, count), sealed under `key`.
HeartbeatDatagram seal(ClientId client, std::uint64_t session, std::uint64_t count, const HeartbeatKey& key);
// Whether the MAC is the one `key` gives (compared in constant time).
bool authentic(const HeartbeatDatagram& datagram, const HeartbeatKey& key);
// The key as the 16 bytes the control connection carries (little-endian words), and back (nothing
// unless exactly 16 bytes).
std::array<std::uint8_t, 16> key_bytes(const HeartbeatKey& key);
std::optional<HeartbeatKey> key_from_bytes(std::span<const std::uint8_t> bytes);
HeartbeatBytes encode(const HeartbeatDatagram& datagram);
// Nothing for anything that is not exactly one well-formed datagram of this format (the MAC is
// checked by whoever knows the key: authentic()).
std::optional<HeartbeatDatagram> decode_heartbeat(std::span<const std::byte> bytes);

// th-server's end: a UDP socket bound to the control port's address, read without blocking.
class HeartbeatReceiver {
 public:
  static constexpr std::size_t kBatch = 64;                 // datagrams per recvmmsg
  static constexpr int kReceiveBufferBytes = 4 << 20;       // a second of 8,192 clients' beats, many times

  explicit HeartbeatReceiver(const Endpoint& bind);

  int fd() const { return socket_.get(); }
  std::uint16_t port() const { return port_; }
  // Appends up to `max` (at most kBatch) well-formed datagrams that have arrived; never blocks.
  // Returns how many datagrams were read (well-formed or not): 0 means the socket is drained.
  std::size_t receive(std::vector<HeartbeatDatagram>& out, std::size_t max = kBatch);
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
