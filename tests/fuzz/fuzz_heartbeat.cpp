// libFuzzer target: the heartbeat datagram parser (net/heartbeat.cpp), which th-server runs on
// every UDP datagram anyone sends to its port, then the MAC check. A datagram that parses must be
// exactly the encoding of what it parsed to.
#include <cstring>
#include <stdexcept>

#include "net/heartbeat.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::span<const std::byte> bytes(reinterpret_cast<const std::byte*>(data), size);
  const auto datagram = th::net::decode_heartbeat(bytes);
  if (!datagram) return 0;
  const th::net::HeartbeatBytes encoded = th::net::encode(*datagram);
  if (size != encoded.size() || std::memcmp(encoded.data(), data, size) != 0) {
    throw std::logic_error("a datagram parsed to something that encodes differently");
  }
  constexpr th::net::HeartbeatKey kCorpusKey{1, 2};  // tests/fuzz/make_corpus.cpp seals with it
  volatile bool accepted = th::net::authentic(*datagram, kCorpusKey);  // runs on every datagram that parses
  (void)accepted;
  return 0;
}
