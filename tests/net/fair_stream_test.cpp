// TurnGate and FairMessageStream: a connection reads a bounded number of messages per turn, and the
// gate lets waiters in first come, first served, a bounded number per kernel poll.
#include "net/fair_stream.h"

#include <capnp/message.h>
#include <capnp/serialize-async.h>
#include <gtest/gtest.h>

#include <functional>
#include <vector>

#include "net/event_loop.h"
#include "net/tensorhub.capnp.h"

namespace th::net {
namespace {

// Samples `value` once per kernel poll of the loop (a zero-delay timer fires only after one), until
// it reaches `until`: an observer of the loop's turns that does not rely on the gate's own counting.
kj::Promise<void> sample_per_poll(kj::Timer& timer, const std::function<std::size_t()>& value, std::size_t until,
                                  std::vector<std::size_t>& samples) {
  return timer.afterDelay(0 * kj::NANOSECONDS).then([&timer, &value, until, &samples]() -> kj::Promise<void> {
    samples.push_back(value());
    if (samples.back() >= until || samples.size() > 1000) return kj::READY_NOW;
    return sample_per_poll(timer, value, until, samples);
  });
}

void expect_steps_at_most(const std::vector<std::size_t>& samples, std::size_t first_max, std::size_t step_max) {
  ASSERT_FALSE(samples.empty());
  EXPECT_LE(samples.front(), first_max);
  for (std::size_t i = 1; i < samples.size(); ++i) {
    EXPECT_LE(samples[i] - samples[i - 1], step_max) << "between polls " << i - 1 << " and " << i;
  }
}

TEST(TurnGate, WakesWaitersInOrderABoundedNumberPerPoll) {
  IoLoop loop;
  TurnGate gate(loop.timer(), 4);
  std::vector<int> woken;
  std::vector<kj::Promise<void>> waits;
  for (int i = 0; i < 10; ++i) {
    waits.push_back(gate.next_turn().then([&woken, i] { woken.push_back(i); }).eagerlyEvaluate(nullptr));
  }
  std::vector<std::size_t> samples;
  const std::function<std::size_t()> count = [&] { return woken.size(); };
  sample_per_poll(loop.timer(), count, 10, samples).wait(loop.wait_scope());
  ASSERT_EQ(woken.size(), 10u);
  expect_steps_at_most(samples, 4, 4);
  EXPECT_GE(samples.size(), 3u) << "10 waiters at 4 per poll take 3 polls";
  for (int i = 0; i < 10; ++i) EXPECT_EQ(woken[static_cast<std::size_t>(i)], i);
  EXPECT_EQ(gate.waiting(), 0u);
}

TEST(TurnGate, SkipsWaitersThatGaveUp) {
  IoLoop loop;
  TurnGate gate(loop.timer(), 1);
  bool second_woken = false;
  {
    auto abandoned = gate.next_turn();  // dropped: its connection closed
  }
  auto second = gate.next_turn().then([&] { second_woken = true; }).eagerlyEvaluate(nullptr);
  for (int poll = 0; poll < 3 && !second_woken; ++poll) loop.wait_scope().poll();
  EXPECT_TRUE(second_woken) << "a dropped waiter must not use up a wakeup";
}

// Messages written by a peer that always has more to send: the stream reads the first turn's
// allowance at once, then one turn's worth per gate wakeup.
TEST(FairMessageStream, ReadsABoundedNumberOfMessagesPerTurn) {
  IoLoop loop;
  TurnGate gate(loop.timer(), 1);
  auto pipe = loop.io().newTwoWayPipe();
  constexpr int kMessages = FairMessageStream::kMessagesFirstTurn + 8;
  for (int i = 0; i < kMessages; ++i) {
    capnp::MallocMessageBuilder message;
    message.initRoot<wire::Selector>();
    capnp::writeMessage(*pipe.ends[1], message).wait(loop.wait_scope());
  }
  FairMessageStream reader(*pipe.ends[0], gate, 2);
  int read = 0;
  std::function<kj::Promise<void>()> read_next = [&]() -> kj::Promise<void> {
    return reader.tryReadMessage(nullptr, capnp::ReaderOptions(), nullptr).then([&](auto maybe) -> kj::Promise<void> {
      if (maybe == nullptr) return kj::READY_NOW;
      ++read;
      return read_next();
    });
  };
  auto reading = read_next().eagerlyEvaluate(nullptr);
  std::vector<std::size_t> samples;
  const std::function<std::size_t()> count = [&] { return static_cast<std::size_t>(read); };
  sample_per_poll(loop.timer(), count, kMessages, samples).wait(loop.wait_scope());
  EXPECT_EQ(read, kMessages);
  // The first turn's allowance at once (plus at most one turn if the gate fired before the sample),
  // then at most 2 messages per poll.
  expect_steps_at_most(samples, FairMessageStream::kMessagesFirstTurn + 2, 2);
  EXPECT_GE(samples.size(), 4u) << "8 messages past the first turn at 2 per turn take 4 polls";
}

// A peer that pipelines calls and never reads their answers: once more than the limit of answers
// waits to be written, the stream reads nothing more, and only a write that ends with room in the
// queue lets it read again (the queue is the test's number here, as Cap'n Proto's would be).
TEST(FairMessageStream, ReadsNothingWhileThePeersUnreadAnswersPassTheLimit) {
  IoLoop loop;
  TurnGate gate(loop.timer(), 1);
  auto pipe = loop.io().newTwoWayPipe();
  auto write_one = [&](capnp::MessageStream& to) {
    capnp::MallocMessageBuilder message;
    message.initRoot<wire::Selector>();
    to.writeMessage(nullptr, message.getSegmentsForOutput()).wait(loop.wait_scope());
  };
  capnp::AsyncIoMessageStream peer(*pipe.ends[1]);
  for (int i = 0; i < 4; ++i) write_one(peer);
  FairMessageStream stream(*pipe.ends[0], gate, 100);
  std::size_t queued_bytes = 0;
  stream.limit_unread_answers([&queued_bytes] { return queued_bytes; }, 1000);
  auto read_one = [&] { return stream.tryReadMessage(nullptr, capnp::ReaderOptions(), nullptr); };
  EXPECT_NE(read_one().wait(loop.wait_scope()), nullptr);

  queued_bytes = 5000;  // the peer stopped reading
  bool read = false;
  auto blocked = read_one().then([&read](auto message) { read = message != nullptr; }).eagerlyEvaluate(nullptr);
  for (int poll = 0; poll < 5; ++poll) loop.wait_scope().poll();
  EXPECT_FALSE(read) << "a message was read while 5000 bytes of answers wait (limit 1000)";
  EXPECT_TRUE(stream.waiting_for_peer_to_read());
  write_one(stream);  // an answer written; the queue is still full
  for (int poll = 0; poll < 5; ++poll) loop.wait_scope().poll();
  EXPECT_FALSE(read) << "a write that left the queue over the limit resumed reading";

  queued_bytes = 900;  // the peer read
  write_one(stream);
  blocked.wait(loop.wait_scope());
  EXPECT_TRUE(read);
  EXPECT_FALSE(stream.waiting_for_peer_to_read());
  EXPECT_NE(read_one().wait(loop.wait_scope()), nullptr) << "reading goes on while the queue has room";
}

}  // namespace
}  // namespace th::net
