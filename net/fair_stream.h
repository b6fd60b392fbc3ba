// Fair turns for the connections of one kj event loop.
//
// kj reads a socket without asking the kernel first whenever the previous read left data behind, so
// a connection whose peer always has more to send keeps being read in the same turn of the loop and
// the loop's queue never drains. Until it drains, kj neither polls the kernel (a new connection waits
// in the listen queue) nor runs evalLast() callbacks (where Cap'n Proto 0.9.2 writes its queued
// replies). And when kj does poll, it takes at most 16 ready descriptors per epoll_wait, so a new
// connection queues behind every busy one in the kernel's ready list, one poll per 16.
//
// Measured on this machine (bench/results/fairness-*.md): with 1,000 connections keeping 64 calls
// each in flight, a restarting worker's open took a median of 1-2 s (up to 3 s) with kj alone; and
// letting each connection read a bounded number of messages but waking all of them at the next poll
// made it minutes (every poll did a whole round of work, and a new connection needs ~60 polls to
// reach the head of the ready list). With the gate below (4 messages, 4 wakeups): 8-24 ms median.
//
// So: a connection reads at most `messages_per_turn` messages (framed connections: frames, in
// server/framed_connections.cpp), then waits on the TurnGate, which
// wakes at most `wakeups_per_poll` waiting connections after each kernel poll, oldest first. The
// work between two polls is then bounded by (16 + wakeups_per_poll) x messages_per_turn messages,
// whatever the number of busy connections, and a new one is reached within a bounded time.
#pragma once

#include <capnp/serialize-async.h>
#include <kj/async-io.h>
#include <kj/timer.h>

#include <cstdint>
#include <deque>
#include <functional>

namespace th::net {

class TurnGate final : private kj::TaskSet::ErrorHandler {
 public:
  // Small, so that a poll's work is small and the ~N/16 polls a new connection may wait for to reach
  // the head of epoll's ready list pass quickly (16 measured 3-9x slower opens than 4; see below).
  static constexpr std::uint32_t kWakeupsPerPollDefault = 4;

  TurnGate(kj::Timer& timer, std::uint32_t wakeups_per_poll);
  TurnGate(const TurnGate&) = delete;
  TurnGate& operator=(const TurnGate&) = delete;

  // Resolves after a later kernel poll of the loop, in the order of asking.
  kj::Promise<void> next_turn();
  std::size_t waiting() const { return waiters_.size(); }

 private:
  void taskFailed(kj::Exception&& exception) override;
  void arm();
  void wake();

  kj::Timer& timer_;
  std::uint32_t wakeups_per_poll_;
  std::deque<kj::Own<kj::PromiseFulfiller<void>>> waiters_;
  bool armed_ = false;
  kj::TaskSet tasks_;
};

// capnp::MessageStream has virtual methods and a non-virtual destructor; this class is final and
// owned as itself (kj::Own<FairMessageStream>), so deleting it through the base cannot happen.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wnon-virtual-dtor"
class FairMessageStream final : public capnp::MessageStream {
 public:
  static constexpr std::uint32_t kMessagesPerTurnDefault = 4;
  // A new connection's first turn: its handshake (bootstrap, connect) and the calls pipelined behind
  // it (a restarting worker's open) are read at once rather than one gate round each.
  static constexpr std::uint32_t kMessagesFirstTurn = 16;

  // `stream` and `gate` must outlive this stream.
  FairMessageStream(kj::AsyncIoStream& stream, TurnGate& gate, std::uint32_t messages_per_turn);

  kj::Promise<kj::Maybe<capnp::MessageReaderAndFds>> tryReadMessage(
      kj::ArrayPtr<kj::AutoCloseFd> fd_space, capnp::ReaderOptions options,
      kj::ArrayPtr<capnp::word> scratch_space) override;
  kj::Promise<void> writeMessage(kj::ArrayPtr<const int> fds,
                                 kj::ArrayPtr<const kj::ArrayPtr<const capnp::word>> segments) override;
  kj::Promise<void> writeMessages(
      kj::ArrayPtr<kj::ArrayPtr<const kj::ArrayPtr<const capnp::word>>> messages) override;
  kj::Maybe<int> getSendBufferSize() override;
  kj::Promise<void> end() override;

  // Reads started so far: one more than the messages that arrived (the owner's evidence that the
  // peer is alive: it stands still while the peer is silent).
  std::uint64_t messages_read() const { return messages_read_; }
  // Caps the size of every message read from now on (Cap'n Proto allocates a message's declared
  // size as soon as it has read its segment table, before the bytes arrive).
  void set_message_words_max(std::uint64_t words_max) { message_words_max_ = words_max; }
  // Caps the number of messages read in all (a peer that has not authenticated may send a few;
  // each message can leave an answer and a reply queued). Beyond it the stream fails.
  void set_messages_max(std::uint64_t messages_max) { messages_max_ = messages_max; }
  // Caps the answers the peer has not read: while more than `bytes_max` bytes of messages wait to
  // be written to it (`queued_bytes`: Cap'n Proto's outgoing queue, TwoPartyVatNetwork::
  // getCurrentQueueSize), no message is read, so a peer that pipelines calls and never reads
  // their answers holds at most about this much of the server's memory, not one answer per call.
  void limit_unread_answers(std::function<std::size_t()> queued_bytes, std::size_t bytes_max);
  // Caps the questions (Cap'n Proto calls and bootstraps) the peer asked and has not finished: an
  // answer stays in the RPC system's table until the peer's Finish, read or not, so a peer that
  // reads its answers but never finishes would otherwise grow it without end. Past the cap the
  // stream fails (the connection closes); a client keeping that many calls open is broken.
  void limit_open_questions(std::uint64_t questions_max) { questions_max_ = questions_max; }
  bool too_many_open_questions() const { return open_questions_ > questions_max_; }
  // Whether reading waits for the peer to read its answers (the owner's evidence for why it is
  // silent).
  bool waiting_for_peer_to_read() const { return reading_held_; }

 private:
  kj::Promise<kj::Maybe<capnp::MessageReaderAndFds>> read(kj::ArrayPtr<kj::AutoCloseFd> fd_space,
                                                         capnp::ReaderOptions options,
                                                         kj::ArrayPtr<capnp::word> scratch_space);

  // Reads only once fewer than answers_bytes_max_ bytes wait to be written.
  kj::Promise<kj::Maybe<capnp::MessageReaderAndFds>> read_when_answers_read(kj::ArrayPtr<kj::AutoCloseFd> fd_space,
                                                                           capnp::ReaderOptions options,
                                                                           kj::ArrayPtr<capnp::word> scratch_space);
  // A write of `bytes` ended: resumes a read that waits, if the queue has room now.
  void written(std::size_t bytes);

  capnp::AsyncIoMessageStream inner_;
  TurnGate& gate_;
  std::uint32_t messages_per_turn_;
  std::uint32_t messages_allowed_ = kMessagesFirstTurn;  // left in this turn
  std::uint64_t messages_read_ = 0;
  std::uint64_t message_words_max_ = UINT64_MAX;
  std::uint64_t messages_max_ = UINT64_MAX;
  std::uint64_t questions_max_ = UINT64_MAX;  // UINT64_MAX: messages are not looked into
  std::uint64_t open_questions_ = 0;
  std::function<std::size_t()> queued_bytes_;  // empty: answers are not limited
  std::size_t answers_bytes_max_ = SIZE_MAX;
  kj::Own<kj::PromiseFulfiller<void>> read_resumer_;  // a read that waits for the peer to read
  bool reading_held_ = false;                          // (read_resumer_ waits)
};
#pragma GCC diagnostic pop

}  // namespace th::net
