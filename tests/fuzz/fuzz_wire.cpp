// libFuzzer target: the control-plane decoder (net/wire.cpp), where untrusted bytes from a client
// (ToHub) or a server (Effect, ListSnapshot) enter. Any input must decode to a value the core can
// hold or to Errc::kInvalidArgument: never a crash, a hang or unbounded memory. A value that
// decodes must encode and decode again to the same thing (the same bytes when encoded again).
#include <capnp/message.h>
#include <capnp/serialize.h>

#include <cstring>
#include <optional>
#include <stdexcept>

#include "net/wire.h"

namespace {

template <typename Wire, typename Value>
kj::Array<capnp::word> encoded(const Value& value) {
  capnp::MallocMessageBuilder builder;
  th::net::encode(value, builder.initRoot<Wire>());
  return capnp::messageToFlatArray(builder);
}

// Whatever decodes must encode, decode again to the same value: compared as the bytes each value
// encodes to (the messages have no operator==). Outside any catch: a throw here is a find.
template <typename Wire, typename Value>
void round_trip(const Value& decoded) {
  const kj::Array<capnp::word> first = encoded<Wire>(decoded);
  capnp::FlatArrayMessageReader reader(first);
  auto again = th::net::decode(reader.getRoot<Wire>());
  if (!again.ok()) throw std::logic_error("a decoded value does not survive encode + decode: " + again.error().detail);
  const kj::Array<capnp::word> second = encoded<Wire>(again.value());
  if (first.size() != second.size() || std::memcmp(first.begin(), second.begin(), first.size() * sizeof(capnp::word)) != 0) {
    throw std::logic_error("a decoded value changes through encode + decode");
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  // A message as it arrives: a segment table and segments, read with the server's limits.
  kj::Array<capnp::word> words = kj::heapArray<capnp::word>(size / sizeof(capnp::word));
  std::memcpy(words.begin(), data, words.size() * sizeof(capnp::word));
  capnp::ReaderOptions options;
  options.traversalLimitInWords = 1 << 20;
  options.nestingLimit = 64;
  // Decoding the untrusted bytes: a malformed message (bad segment table, pointer out of bounds,
  // over the limits) is refused by Cap'n Proto, and the server drops the connection.
  std::optional<th::Result<th::net::ToHubMessage>> to_hub;
  std::optional<th::Result<th::Effect>> effect;
  std::optional<th::Result<th::ListSnapshot>> snapshot;
  try {
    capnp::FlatArrayMessageReader reader(words, options);
    to_hub = th::net::decode(reader.getRoot<th::wire::ToHub>());
    effect = th::net::decode(reader.getRoot<th::wire::Effect>());
    snapshot = th::net::decode(reader.getRoot<th::wire::ListSnapshot>());
  } catch (const kj::Exception&) {
  }
  if (to_hub && to_hub->ok()) round_trip<th::wire::ToHub>(to_hub->value());
  if (effect && effect->ok()) round_trip<th::wire::Effect>(effect->value());
  if (snapshot && snapshot->ok()) round_trip<th::wire::ListSnapshot>(snapshot->value());
  return 0;
}
