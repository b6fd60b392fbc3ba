// libFuzzer target: the control-plane decoder (net/wire.cpp), where untrusted bytes from a client
// (ToHub) or a server (Effect, ListSnapshot) enter. Any input must decode to a value the core can
// hold or to Errc::kInvalidArgument: never a crash, a hang or unbounded memory. A value that
// decodes must encode and decode again to the same thing.
#include <capnp/message.h>
#include <capnp/serialize.h>

#include <cstring>
#include <stdexcept>

#include "net/wire.h"

namespace {

template <typename Wire>
void round_trip(const typename Wire::Reader& in) {
  auto decoded = th::net::decode(in);
  if (!decoded.ok()) return;
  capnp::MallocMessageBuilder builder;
  th::net::encode(decoded.value(), builder.initRoot<Wire>());
  auto again = th::net::decode(builder.getRoot<Wire>().asReader());
  if (!again.ok()) throw std::logic_error("a decoded value does not survive encode + decode: " + again.error().detail);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  // A message as it arrives: a segment table and segments, read with the server's limits.
  kj::Array<capnp::word> words = kj::heapArray<capnp::word>(size / sizeof(capnp::word));
  std::memcpy(words.begin(), data, words.size() * sizeof(capnp::word));
  capnp::ReaderOptions options;
  options.traversalLimitInWords = 1 << 20;
  options.nestingLimit = 64;
  try {
    capnp::FlatArrayMessageReader reader(words, options);
    round_trip<th::wire::ToHub>(reader.getRoot<th::wire::ToHub>());
    round_trip<th::wire::Effect>(reader.getRoot<th::wire::Effect>());
    round_trip<th::wire::ListSnapshot>(reader.getRoot<th::wire::ListSnapshot>());
  } catch (const kj::Exception&) {
    // A malformed message (bad segment table, pointer out of bounds, over the limits): Cap'n Proto
    // refuses it, and the server drops the connection.
  }
  return 0;
}
