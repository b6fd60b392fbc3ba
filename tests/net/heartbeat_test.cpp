// Heartbeat datagrams: the format round-trips and refuses anything else; a sender's datagrams reach
// a receiver on loopback, and malformed ones are counted, not delivered.
#include "net/heartbeat.h"

#include <gtest/gtest.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>

#include <vector>

namespace th::net {
namespace {

constexpr HeartbeatKey kKey{0x0706050403020100ull, 0x0F0E0D0C0B0A0908ull};

TEST(HeartbeatDatagram, RoundTrips) {
  const HeartbeatDatagram datagram = seal(0x0102030405060708ull, 42, 0xFEDCBA9876543210ull, kKey);
  const HeartbeatBytes bytes = encode(datagram);
  const auto decoded = decode_heartbeat(bytes);
  ASSERT_TRUE(decoded.has_value());
  EXPECT_EQ(*decoded, datagram);
  EXPECT_TRUE(authentic(*decoded, kKey));
  EXPECT_EQ(bytes[8], std::byte{0x08}) << "little-endian on the wire";
}

TEST(HeartbeatDatagram, RefusesAnythingElse) {
  const HeartbeatBytes good = encode(seal(7, 1, 99, kKey));
  EXPECT_FALSE(decode_heartbeat(std::span<const std::byte>(good.data(), good.size() - 1)));
  std::vector<std::byte> longer(good.begin(), good.end());
  longer.push_back(std::byte{0});
  EXPECT_FALSE(decode_heartbeat(longer));
  HeartbeatBytes bad_magic = good;
  bad_magic[0] = std::byte{'X'};
  EXPECT_FALSE(decode_heartbeat(bad_magic));
  HeartbeatBytes format_1 = good;
  format_1[4] = std::byte{1};
  EXPECT_FALSE(decode_heartbeat(format_1)) << "format 1 carried the key in clear";
  EXPECT_FALSE(decode_heartbeat(encode(seal(7, 1, 0, kKey)))) << "counts start at 1";
}

// The MAC binds every field to the key: whoever does not hold the key cannot make a datagram the
// server takes, nor change one it saw (another client, session or count).
TEST(HeartbeatDatagram, OnlyTheKeyMakesAnAuthenticDatagram) {
  const HeartbeatDatagram sealed = seal(7, 1, 99, kKey);
  EXPECT_TRUE(authentic(sealed, kKey));
  EXPECT_FALSE(authentic(sealed, HeartbeatKey{kKey[0], kKey[1] ^ 1}));
  for (auto change : {+[](HeartbeatDatagram& d) { d.client ^= 1; }, +[](HeartbeatDatagram& d) { d.session ^= 1; },
                      +[](HeartbeatDatagram& d) { d.count += 1; }, +[](HeartbeatDatagram& d) { d.mac[0] ^= 1; },
                      +[](HeartbeatDatagram& d) { d.mac[1] ^= 1ull << 63; }}) {
    HeartbeatDatagram forged = sealed;
    change(forged);
    EXPECT_FALSE(authentic(forged, kKey));
  }
  EXPECT_NE(seal(7, 1, 99, kKey).mac, seal(7, 1, 100, kKey).mac);
}

TEST(HeartbeatDatagram, KeysTravelAsSixteenLittleEndianBytes) {
  const auto bytes = key_bytes(kKey);
  for (std::size_t i = 0; i < 16; ++i) EXPECT_EQ(bytes[i], i);
  EXPECT_EQ(key_from_bytes(bytes), kKey);
  EXPECT_FALSE(key_from_bytes(std::span<const std::uint8_t>(bytes.data(), 15)));
}

// Waits until the receiver has `count` datagrams (or a few seconds passed: loopback does not drop
// a handful of datagrams, so a shortfall is a failure).
std::vector<HeartbeatDatagram> receive_at_least(HeartbeatReceiver& receiver, std::size_t count) {
  std::vector<HeartbeatDatagram> got;
  for (int attempt = 0; attempt < 50 && got.size() < count; ++attempt) {
    pollfd readable{receiver.fd(), POLLIN, 0};
    ::poll(&readable, 1, 100);
    while (receiver.receive(got) > 0) {
    }
  }
  return got;
}

TEST(HeartbeatChannel, DatagramsReachTheReceiverAndMalformedOnesAreCounted) {
  HeartbeatReceiver receiver(Endpoint{"127.0.0.1", 0});
  ASSERT_NE(receiver.port(), 0);
  HeartbeatSender sender(Endpoint{"127.0.0.1", receiver.port()});
  for (std::uint64_t i = 1; i <= 100; ++i) EXPECT_TRUE(sender.send(seal(i, i * 10, i, kKey)));

  // Garbage from another socket: counted as malformed, never delivered.
  Fd raw(::socket(AF_INET, SOCK_DGRAM, 0));
  sockaddr_in to{};
  to.sin_family = AF_INET;
  to.sin_port = htons(receiver.port());
  to.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  const char garbage[] = "not a heartbeat, and much too long to be one anyway";
  ASSERT_EQ(::sendto(raw.get(), garbage, sizeof garbage, 0, reinterpret_cast<sockaddr*>(&to), sizeof to),
            static_cast<ssize_t>(sizeof garbage));

  const auto got = receive_at_least(receiver, 100);
  ASSERT_EQ(got.size(), 100u);
  for (std::uint64_t i = 1; i <= 100; ++i) {
    EXPECT_EQ(got[i - 1], seal(i, i * 10, i, kKey));
  }
  for (int attempt = 0; attempt < 50 && receiver.malformed() == 0; ++attempt) {
    std::vector<HeartbeatDatagram> more;
    receiver.receive(more);
    EXPECT_TRUE(more.empty());
    pollfd readable{receiver.fd(), POLLIN, 0};
    ::poll(&readable, 1, 100);
  }
  EXPECT_EQ(receiver.malformed(), 1u);
}

}  // namespace
}  // namespace th::net
