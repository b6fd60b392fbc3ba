// Conversions between the core's messages (core/messages.h) and the Cap'n Proto wire
// (net/tensorhub.capnp).
//
// Encoding cannot fail: the values come from our own core. Decoding is where untrusted bytes enter:
// every decode checks each enum against its range, each name and list against the limits of
// core/limits.h, and the shape of layouts, so that the Hub and the agent only ever see values they
// can hold. Plain numbers the hub judges itself (shard numbers, retention depth) pass through, so
// that the client gets the hub's typed answer. A message that fails gets Errc::kInvalidArgument naming the field; a malformed Cap'n Proto
// message (bad pointers, truncated) is caught and reported the same way.
#pragma once

#include "core/messages.h"
#include "net/tensorhub.capnp.h"

namespace th::net {

void encode(const Request& request, wire::Request::Builder out);
void encode(const Report& report, wire::Report::Builder out);
void encode(const Effect& effect, wire::Effect::Builder out);

Result<Request> decode(wire::Request::Reader in);
Result<Report> decode(wire::Report::Reader in);
Result<Effect> decode(wire::Effect::Reader in);

void encode(const ListSnapshot& snapshot, wire::ListSnapshot::Builder out);
Result<ListSnapshot> decode(wire::ListSnapshot::Reader in);

// Requests and reports travel together, in order, as ToHub.
using ToHubMessage = std::variant<Request, Report>;
void encode(const ToHubMessage& message, wire::ToHub::Builder out);
Result<ToHubMessage> decode(wire::ToHub::Reader in);

// Messages per Session.send / Sink.deliver call: a sender batches up to this many.
inline constexpr std::size_t kMessagesPerCallMax = 4096;
// An error's free text (Error::detail, Evicted::detail) from the wire.
inline constexpr std::size_t kErrorDetailBytesMax = 4096;

}  // namespace th::net
