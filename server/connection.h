// th-server's view of one client connection (server/hub_service.cpp, server/framed_connections.cpp).
#pragma once

#include <capnp/rpc-twoparty.h>

#include <optional>
#include <string>
#include <vector>

#include "net/fair_stream.h"
#include "net/frames.h"
#include "server/hub_service.h"

namespace th::server {

struct HubService::Connection {
  std::uint64_t id = 0;
  std::string peer = "?";  // the address it connects from
  std::string name = "?";  // what the client calls itself (logs only; sanitised, once authenticated)
  // Until the protocol is known: the TLS handshake and the first 8 bytes (cancelled if the
  // connection goes first).
  kj::Maybe<kj::Promise<void>> handshake;
  // A Cap'n Proto RPC connection (th-ctl, older clients): the stream, read through `messages`.
  kj::Own<kj::AsyncIoStream> stream;
  kj::Own<net::FairMessageStream> messages;
  kj::Own<capnp::TwoPartyVatNetwork> network;
  kj::Own<capnp::RpcSystem<capnp::rpc::twoparty::VatId>> rpc;
  kj::Maybe<wire::Sink::Client> sink;  // set by connect
  bool authenticated = false;          // presented the token (connect or inspect)
  std::uint32_t wrong_tokens = 0;
  TimeMs accepted_ms = 0;
  TimeMs active_ms = 0;                // when it last sent a message or a heartbeat datagram came
  std::uint64_t messages_seen = 0;     // messages_read() at active_ms
  ClientId client = 0;                 // the client it speaks for (0: none)
  std::string client_secret;           // what the client proved it with
  std::vector<Effect> backlog;         // effects not yet handed to deliver() or written
  std::uint32_t delivers_in_flight = 0;
  // A framed connection (net/frames.h; libthclient): its stream and what it owes the client.
  kj::Own<net::FrameStream> frames;
  kj::Maybe<kj::Promise<void>> reading;  // the loop that reads its frames
  std::uint32_t frames_allowed = 0;      // frames it may still take in this turn (the TurnGate)
  bool welcomed = false;
  bool refused = false;                  // its hello was refused: the write side closes after the answer
  bool ended = false;                    // the peer closed its side: close once what it is owed is written
  bool write_scheduled = false;          // in HubService::dirty_
  std::uint64_t ack_pending = 0;         // the client's latest ack, fed and not yet answered
  std::string notice;                    // why a message of its last frames was refused (once per write)
  std::string going_away;                // draining: said in the connection's last frame
  // The session of the client's last message: an empty Session.send (a quiet client's probe) counts
  // as a heartbeat of that session, so that a client whose datagrams are lost is not evicted.
  std::optional<std::uint64_t> client_session;
  std::optional<net::HeartbeatKey> heartbeat_key;  // none: no datagram channel
  std::uint64_t heartbeat_count = 0;               // the highest count accepted (replays are refused)
  std::optional<TimeMs> heartbeat_datagram_ms;  // when the last datagram of its clients came

  bool framed() const { return frames.get() != nullptr; }
  // Messages (RPC) or frames read so far: the evidence that the peer is alive.
  std::uint64_t messages_read() const {
    if (frames.get() != nullptr) return frames->frames_read();
    return messages.get() != nullptr ? messages->messages_read() : 0;
  }

  std::string describe() const { return "connection " + std::to_string(id) + " (" + name + " from " + peer + ")"; }
};

}  // namespace th::server
