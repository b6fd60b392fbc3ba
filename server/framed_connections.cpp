// th-server's framed connections (net/frames.h): libthclient's control path.
//
// A connection sends ClientFrames: a hello (token and client claim), then batches of messages; the
// server answers with ServerFrames: welcome or refused, then batches of effects. Per frame the work
// is one decode and one Hub step per message; per loop turn and connection, at most one write:
// route() only collects effects in the connection's backlog and marks it dirty, and write_dirty()
// runs once the loop's queue is empty (kj::evalLast), so that everything the turn produced for a
// client (answers to several frames, read instructions, the ack) leaves together. While a write is
// in flight nothing more is written; effects wait in the backlog, bounded by effects_backlog_max as
// for RPC connections.
//
// The limits of RPC connections hold here: before its hello is accepted a connection may send at
// most unauthenticated_messages_max frames of unauthenticated_message_words_max words; a wrong
// token is answered and the connection's write side closed; frames are taken messages_per_turn at
// a time between kernel polls (net::TurnGate), so that a busy connection cannot starve the others.
#include <kj/debug.h>

#include "net/wire.h"
#include "server/connection.h"
#include "server/hub_service.h"

namespace th::server {
namespace {

// How long a connection whose hello was refused may stay, for its peer to read the refusal.
constexpr std::int64_t kRefusedLingerMs = 1000;

}  // namespace

void HubService::start_framed(Connection& connection, kj::Own<kj::AsyncIoStream> stream) {
  TH_ASSERT(!connection.framed() && connection.stream.get() == nullptr);
  connection.frames = kj::heap<net::FrameStream>(kj::mv(stream), tls_ == nullptr ? event_port_ : nullptr);
  connection.frames->set_frame_words_max(connection.authenticated ? net::FrameStream::kFrameWordsMaxDefault
                                                                  : config_.unauthenticated_message_words_max);
  connection.frames_allowed = net::FairMessageStream::kMessagesFirstTurn;
  const std::uint64_t id = connection.id;
  connection.frames->on_written([this, id] {
    auto found = connections_.find(id);
    if (found == connections_.end()) return;
    Connection& written = *found->second;
    if (written.refused) {
      written.frames->shutdown_write();
      return;
    }
    write_frames(written);  // what came while the write was in flight
    if (written.ended && !written.frames->writing()) on_disconnect(id);  // answered; logged as any end
  });
  connection.frames->on_broken([this, id](const kj::Exception& exception) {
    // A peer that reset. Later: this runs inside the stream's own task.
    const std::string why = std::string("write failed: ") + exception.getDescription().cStr();
    tasks_.add(kj::evalLater([this, id, why] { close_connection(id, why); }));
  });
  connection.reading = read_frames(id).eagerlyEvaluate([this, id](kj::Exception&& exception) {
    auto found = connections_.find(id);
    const bool known = found != connections_.end();
    // A malformed or oversized frame, or a reset: the peer's doing, logged like a closed connection.
    close_connection(id, std::string(known && !found->second->authenticated ? "before authenticating: " : "") +
                             "read failed: " + exception.getDescription().cStr());
  });
}

kj::Promise<void> HubService::read_frames(std::uint64_t connection_id) {
  auto found = connections_.find(connection_id);
  if (found == connections_.end()) return kj::READY_NOW;
  return found->second->frames->read_some().then([this, connection_id](bool more) -> kj::Promise<void> {
    if (!more) {
      auto ended = connections_.find(connection_id);
      if (ended != connections_.end()) on_framed_end(*ended->second);
      return kj::READY_NOW;
    }
    return take_frames(connection_id);
  });
}

kj::Promise<void> HubService::take_frames(std::uint64_t connection_id) {
  for (;;) {
    auto found = connections_.find(connection_id);
    if (found == connections_.end()) return kj::READY_NOW;  // closed by what a frame did
    Connection& connection = *found->second;
    if (connection.frames_allowed == 0) {
      // This connection had its share of the turn: the rest after the next kernel poll.
      return turn_gate_.next_turn().then([this, connection_id] {
        auto again = connections_.find(connection_id);
        if (again == connections_.end()) return kj::Promise<void>(kj::READY_NOW);
        again->second->frames_allowed = config_.messages_per_turn;
        return take_frames(connection_id);
      });
    }
    capnp::MessageReader* frame = connection.frames->next_frame();
    if (frame == nullptr) return read_frames(connection_id);
    --connection.frames_allowed;
    if (!connection.authenticated && connection.frames->frames_read() > config_.unauthenticated_messages_max) {
      close_connection(connection_id, "too many frames before authentication");
      return kj::READY_NOW;
    }
    on_frame(connection, frame->getRoot<wire::ClientFrame>());
  }
}

void HubService::on_frame(Connection& connection, wire::ClientFrame::Reader frame) {
  if (connection.refused) return;  // its answer is out; it should have closed
  switch (frame.which()) {
    case wire::ClientFrame::HELLO:
      if (connection.welcomed) {  // (a refused one's frames are not read: above)
        close_connection(connection.id, "a second hello");
        return;
      }
      on_hello(connection, frame.getHello());
      return;  // an ack of a hello is its welcome
    case wire::ClientFrame::MESSAGES: {
      if (!connection.welcomed) {
        close_connection(connection.id, "messages before a hello was accepted");
        return;
      }
      const auto messages = frame.getMessages();
      const std::uint64_t id = connection.id;
      if (messages.size() > net::kMessagesPerCallMax) {
        // Not fed, so not acknowledged (an ack says the frame reached the hub).
        connection.notice = "invalid-argument: more than kMessagesPerCallMax messages in one frame";
        schedule_write(connection);
        return;
      } else {
        if (messages.size() == 0) on_probe(connection);
        std::string refused = on_messages(connection, messages);
        if (!refused.empty()) {
          auto found = connections_.find(id);
          if (found == connections_.end()) return;
          found->second->notice = "invalid-argument: " + std::move(refused);
        }
      }
      // Feeding the hub may have closed connections, this one too.
      auto found = connections_.find(id);
      if (found == connections_.end()) return;
      if (frame.getAck() != 0 || !found->second->notice.empty()) {
        if (frame.getAck() != 0) found->second->ack_pending = frame.getAck();
        schedule_write(*found->second);
      }
      return;
    }
  }
  close_connection(connection.id, "a frame of an unknown kind");
}

void HubService::on_hello(Connection& connection, wire::Hello::Reader hello) {
  if (auto refused = admit(connection, hello.getToken(), hello.getClientName(), hello.getClient(),
                           hello.getClientSecret())) {
    refuse_hello(connection, *refused);
    return;
  }
  connection.welcomed = true;
  connection.frames->set_frame_words_max(net::FrameStream::kFrameWordsMaxDefault);
  connection.frames->append<wire::ServerFrame>([&](wire::ServerFrame::Builder frame) {
    auto welcome = frame.initWelcome();
    welcome.setHeartbeatTimeoutMs(config_.hub.heartbeat_timeout_ms);
    describe_heartbeats(connection, welcome.initHeartbeats());
  });
  schedule_write(connection);
}

void HubService::refuse_hello(Connection& connection, const std::string& why) {
  connection.refused = true;
  connection.frames->append<wire::ServerFrame>(
      [&](wire::ServerFrame::Builder frame) { frame.setRefused(why); });
  connection.frames->flush();
  // The refusal is out (or goes when the socket drains, and on_written closes then): nothing more
  // goes to this peer. (Closing the socket now could reset it before the peer read the refusal, if
  // it sent more behind its hello.)
  if (!connection.frames->writing()) connection.frames->shutdown_write();
  // And it goes soon whatever the peer does: its frames are not read any more, so they would keep
  // it looking active to the idle sweep.
  const std::uint64_t id = connection.id;
  tasks_.add(timer_.afterDelay(kRefusedLingerMs * kj::MILLISECONDS).then([this, id] {
    close_connection(id, "its hello was refused");
  }));
}

void HubService::on_framed_end(Connection& connection) {
  // A client that half-closes after its last frames still gets their answers (the welcome, acks,
  // effects this turn produced), as an RPC client gets the returns of calls it made before.
  connection.ended = true;
  if (connection.refused) {
    close_connection(connection.id, "closed by the peer after its refusal");
    return;
  }
  write_frames(connection);
  if (!connection.frames->writing()) on_disconnect(connection.id);  // logged as an RPC connection's end
  // else on_written closes it once the answers are out (or the write fails).
}

void HubService::schedule_write(Connection& connection) {
  TH_ASSERT(connection.framed());
  if (connection.write_scheduled) return;
  connection.write_scheduled = true;
  dirty_.push_back(connection.id);
  if (write_dirty_scheduled_) return;
  write_dirty_scheduled_ = true;
  // Once this turn's work is done (the TurnGate bounds it): one write per connection for all of it.
  tasks_.add(kj::evalLast([this] { write_dirty(); }));
}

void HubService::write_dirty() {
  write_dirty_scheduled_ = false;
  std::vector<std::uint64_t> dirty;
  dirty.swap(dirty_);
  for (std::uint64_t id : dirty) {
    auto found = connections_.find(id);
    if (found == connections_.end()) continue;
    found->second->write_scheduled = false;
    write_frames(*found->second);
  }
}

void HubService::write_frames(Connection& connection) {
  if (!connection.welcomed || connection.frames->writing()) return;  // on_written comes back here
  if (connection.backlog.size() > config_.effects_backlog_max) return;  // being closed (route)
  std::size_t done = 0;
  do {
    const std::size_t count = std::min(connection.backlog.size() - done, net::kMessagesPerCallMax);
    const bool last = done + count == connection.backlog.size();
    if (count == 0 && connection.ack_pending == 0) break;  // nothing but a notice
    connection.frames->append<wire::ServerFrame>([&](wire::ServerFrame::Builder frame) {
      auto effects = frame.initEffects(static_cast<unsigned>(count));
      for (std::size_t i = 0; i < count; ++i) net::encode(connection.backlog[done + i], effects[static_cast<unsigned>(i)]);
      if (last && connection.ack_pending != 0) {
        frame.setAck(connection.ack_pending);
        frame.setHeartbeatDatagramsHeard(heartbeat_datagrams_heard(connection));
      }
    });
    done += count;
  } while (done < connection.backlog.size());
  connection.backlog.clear();
  connection.ack_pending = 0;
  if (!connection.notice.empty()) {
    // (on_messages logged each refused message.)
    connection.frames->append<wire::ServerFrame>(
        [&](wire::ServerFrame::Builder frame) { frame.setNotice(connection.notice); });
    connection.notice.clear();
  }
  if (!connection.going_away.empty()) {
    connection.frames->append<wire::ServerFrame>(
        [&](wire::ServerFrame::Builder frame) { frame.setGoingAway(connection.going_away); });
    connection.going_away.clear();
  }
  connection.frames->flush();
}

}  // namespace th::server
