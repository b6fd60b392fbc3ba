#include "net/fair_stream.h"

#include <capnp/rpc.capnp.h>

#include <algorithm>
#include <iostream>

#include "core/assert.h"

namespace th::net {

TurnGate::TurnGate(kj::Timer& timer, std::uint32_t wakeups_per_poll)
    : timer_(timer), wakeups_per_poll_(wakeups_per_poll), tasks_(*this) {
  TH_REQUIRE(wakeups_per_poll > 0, "the gate must wake someone per poll");
}

void TurnGate::taskFailed(kj::Exception&& exception) {
  // A zero-delay timer cannot fail; if it ever does, say so rather than strand the waiters.
  std::cerr << "turn gate: " << exception.getDescription().cStr() << "\n";
  armed_ = false;
  arm();
}

kj::Promise<void> TurnGate::next_turn() {
  auto paf = kj::newPromiseAndFulfiller<void>();
  waiters_.push_back(kj::mv(paf.fulfiller));
  arm();
  return kj::mv(paf.promise);
}

void TurnGate::arm() {
  if (armed_ || waiters_.empty()) return;
  armed_ = true;
  // kj's timers fire only right after the loop polled the kernel, so a zero delay means "after the
  // next poll" (and the poll does not block while a timer is due).
  tasks_.add(timer_.afterDelay(0 * kj::NANOSECONDS).then([this] {
    armed_ = false;
    wake();
    arm();
  }));
}

void TurnGate::wake() {
  std::uint32_t woken = 0;
  while (woken < wakeups_per_poll_ && !waiters_.empty()) {
    kj::Own<kj::PromiseFulfiller<void>> waiter = kj::mv(waiters_.front());
    waiters_.pop_front();
    if (!waiter->isWaiting()) continue;  // its connection closed meanwhile
    waiter->fulfill();
    ++woken;
  }
}

FairMessageStream::FairMessageStream(kj::AsyncIoStream& stream, TurnGate& gate, std::uint32_t messages_per_turn)
    : inner_(stream), gate_(gate), messages_per_turn_(messages_per_turn) {
  TH_REQUIRE(messages_per_turn > 0, "a connection must be allowed at least one message per turn");
}

kj::Promise<kj::Maybe<capnp::MessageReaderAndFds>> FairMessageStream::tryReadMessage(
    kj::ArrayPtr<kj::AutoCloseFd> fd_space, capnp::ReaderOptions options, kj::ArrayPtr<capnp::word> scratch_space) {
  if (messages_allowed_ > 0) {
    --messages_allowed_;
    return read(fd_space, options, scratch_space);
  }
  // This connection had its share: read again when the gate lets it.
  return gate_.next_turn().then([this, fd_space, options, scratch_space] {
    messages_allowed_ = messages_per_turn_ - 1;
    return read(fd_space, options, scratch_space);
  });
}

kj::Promise<kj::Maybe<capnp::MessageReaderAndFds>> FairMessageStream::read(
    kj::ArrayPtr<kj::AutoCloseFd> fd_space, capnp::ReaderOptions options, kj::ArrayPtr<capnp::word> scratch_space) {
  // The limit in force when the read starts: Cap'n Proto refuses a larger segment table at once.
  options.traversalLimitInWords = std::min<std::uint64_t>(options.traversalLimitInWords, message_words_max_);
  // Counted as the read starts (the RPC system starts the next read once a message arrived), so
  // that no promise is added per message: a silent peer's count stands still all the same.
  if (++messages_read_ > messages_max_) {
    return KJ_EXCEPTION(FAILED, "too many messages before authentication");
  }
  auto message = read_when_answers_read(fd_space, options, scratch_space);
  if (questions_max_ == UINT64_MAX) return message;
  return message.then([this](kj::Maybe<capnp::MessageReaderAndFds> read) -> kj::Maybe<capnp::MessageReaderAndFds> {
    KJ_IF_MAYBE(got, read) {
      const auto which = got->reader->getRoot<capnp::rpc::Message>().which();
      if (which == capnp::rpc::Message::CALL || which == capnp::rpc::Message::BOOTSTRAP) {
        if (++open_questions_ > questions_max_) {
          kj::throwFatalException(KJ_EXCEPTION(FAILED, "too many calls left open (no Finish)", questions_max_));
        }
      } else if (which == capnp::rpc::Message::FINISH && open_questions_ > 0) {
        --open_questions_;
      }
    }
    return kj::mv(read);
  });
}

void FairMessageStream::limit_unread_answers(std::function<std::size_t()> queued_bytes, std::size_t bytes_max) {
  TH_REQUIRE(queued_bytes && bytes_max > 0, "the unread answers need a queue to watch and room for one");
  queued_bytes_ = std::move(queued_bytes);
  answers_bytes_max_ = bytes_max;
}

kj::Promise<kj::Maybe<capnp::MessageReaderAndFds>> FairMessageStream::read_when_answers_read(
    kj::ArrayPtr<kj::AutoCloseFd> fd_space, capnp::ReaderOptions options, kj::ArrayPtr<capnp::word> scratch_space) {
  if (!queued_bytes_ || queued_bytes_() <= answers_bytes_max_) {
    return inner_.tryReadMessage(fd_space, options, scratch_space);
  }
  // The queue drains only by writes, and each write that ends looks at it (written()): no polling.
  auto resumed = kj::newPromiseAndFulfiller<void>();
  read_resumer_ = kj::mv(resumed.fulfiller);
  reading_held_ = true;
  return resumed.promise.then([this, fd_space, options, scratch_space] {
    return read_when_answers_read(fd_space, options, scratch_space);
  });
}

void FairMessageStream::written(std::size_t bytes) {
  if (!waiting_for_peer_to_read()) return;
  // The network takes a written message off its queue after this write's promise resolves, so the
  // queue may still count it: room is judged without it. (Once the last write ends, a read resumes
  // whatever the size of that message.)
  if (queued_bytes_() <= answers_bytes_max_ + bytes) {
    reading_held_ = false;
    read_resumer_->fulfill();
  }
}

namespace {
std::size_t bytes_of(kj::ArrayPtr<const kj::ArrayPtr<const capnp::word>> segments) {
  std::size_t words = 0;
  for (const auto& segment : segments) words += segment.size();
  return words * sizeof(capnp::word);
}
}  // namespace

kj::Promise<void> FairMessageStream::writeMessage(kj::ArrayPtr<const int> fds,
                                                  kj::ArrayPtr<const kj::ArrayPtr<const capnp::word>> segments) {
  const std::size_t bytes = bytes_of(segments);
  return inner_.writeMessage(fds, segments).then([this, bytes] { written(bytes); });
}

kj::Promise<void> FairMessageStream::writeMessages(
    kj::ArrayPtr<kj::ArrayPtr<const kj::ArrayPtr<const capnp::word>>> messages) {
  std::size_t bytes = 0;
  for (const auto& message : messages) bytes += bytes_of(message);
  return inner_.writeMessages(messages).then([this, bytes] { written(bytes); });
}

kj::Maybe<int> FairMessageStream::getSendBufferSize() { return inner_.getSendBufferSize(); }

kj::Promise<void> FairMessageStream::end() { return inner_.end(); }

}  // namespace th::net
