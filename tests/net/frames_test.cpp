// FrameStream (net/frames.h): frames arrive whole and in order however the bytes are cut, over a
// socket it drives itself (raw) or over a kj stream; a frame over the limit is refused from its
// table; a writer whose peer does not read keeps one write in flight and sends the rest after.
#include "net/frames.h"

#include <capnp/message.h>
#include <gtest/gtest.h>
#include <sys/socket.h>

#include <string>
#include <vector>

#include "net/event_loop.h"
#include "net/tensorhub.capnp.h"

namespace th::net {
namespace {

// Two connected FrameStreams: over a loopback TCP connection that the streams drive themselves
// (raw), or through kj's streams (of the same kind of connection, or of an in-memory pipe).
enum class Kind { kRaw, kKjSocket, kKjPipe };

struct Pair {
  std::unique_ptr<FrameStream> writer;
  std::unique_ptr<FrameStream> reader;
};

Pair connected(IoLoop& loop, Kind kind) {
  if (kind == Kind::kKjPipe) {
    auto pipe = kj::newTwoWayPipe();
    return {std::make_unique<FrameStream>(kj::mv(pipe.ends[0])), std::make_unique<FrameStream>(kj::mv(pipe.ends[1]))};
  }
  auto listener = loop.io().getNetwork().parseAddress("127.0.0.1:0").wait(loop.wait_scope())->listen();
  auto address = loop.io().getNetwork().parseAddress("127.0.0.1", listener->getPort()).wait(loop.wait_scope());
  auto connecting = address->connect();
  auto accepted = listener->accept().wait(loop.wait_scope());
  auto connected = connecting.wait(loop.wait_scope());
  kj::UnixEventPort* port = kind == Kind::kRaw ? &loop.port() : nullptr;
  Pair pair{std::make_unique<FrameStream>(kj::mv(connected), port), std::make_unique<FrameStream>(kj::mv(accepted), port)};
  EXPECT_EQ(pair.writer->raw(), kind == Kind::kRaw);
  return pair;
}

class FrameStreamTest : public ::testing::TestWithParam<Kind> {};

// A frame whose one message names `index` and carries `bytes` bytes of text.
void append_frame(FrameStream& out, std::uint32_t index, std::size_t bytes) {
  out.append<wire::ServerFrame>([&](wire::ServerFrame::Builder frame) {
    frame.setNotice(std::string(bytes, static_cast<char>('a' + index % 26)));
    frame.setAck(index);
  });
}

// Reads frames until `count` arrived; checks order and content.
void read_frames(IoLoop& loop, FrameStream& in, std::uint32_t count, const std::vector<std::size_t>& sizes) {
  std::uint32_t seen = 0;
  while (seen < count) {
    ASSERT_TRUE(in.read_some().wait(loop.wait_scope())) << "the stream ended after " << seen << " frames";
    while (capnp::MessageReader* message = in.next_frame()) {
      auto frame = message->getRoot<wire::ServerFrame>();
      ASSERT_EQ(frame.getAck(), seen);
      ASSERT_EQ(frame.getNotice().size(), sizes[seen]);
      ASSERT_EQ(std::string(frame.getNotice().cStr()), std::string(sizes[seen], static_cast<char>('a' + seen % 26)));
      ++seen;
    }
  }
  EXPECT_EQ(in.frames_read(), count);
  EXPECT_EQ(in.buffered_bytes(), 0u);
}

// Frames of every size, among them ones far past the read buffer (it grows for them and shrinks
// after) and ones of several segments, come out whole and in order.
TEST_P(FrameStreamTest, FramesArriveWholeAndInOrder) {
  IoLoop loop;
  Pair pair = connected(loop, GetParam());
  std::vector<std::size_t> sizes;
  for (std::uint32_t i = 0; i < 200; ++i) sizes.push_back(i % 50 == 7 ? 300'000 + i : (i * 37) % 3000);
  for (std::uint32_t i = 0; i < sizes.size(); ++i) {
    append_frame(*pair.writer, i, sizes[i]);
    if (i % 3 == 0) pair.writer->flush();  // several writes, some with many frames
  }
  pair.writer->flush();
  read_frames(loop, *pair.reader, static_cast<std::uint32_t>(sizes.size()), sizes);
}

// The end of the stream: read_some says so once every frame before it was taken.
TEST_P(FrameStreamTest, TheEndOfTheStreamComesAfterTheLastFrame) {
  IoLoop loop;
  Pair pair = connected(loop, GetParam());
  append_frame(*pair.writer, 0, 10);
  pair.writer->flush();
  read_frames(loop, *pair.reader, 1, {10});
  while (pair.writer->writing()) loop.wait_scope().poll();
  pair.writer->shutdown_write();
  EXPECT_FALSE(pair.reader->read_some().wait(loop.wait_scope()));
}

// A frame whose table declares more than the limit, or more segments than Cap'n Proto allows, is
// refused before its bytes are buffered; a declared size far past what arrived does not make the
// reader reserve it.
TEST_P(FrameStreamTest, AFrameOverTheLimitIsRefusedFromItsTable) {
  IoLoop loop;
  Pair pair = connected(loop, GetParam());
  pair.reader->set_frame_words_max(64);
  const std::uint32_t table[2] = {0, 1000};  // one segment of 1,000 words
  pair.writer->append_bytes(kj::arrayPtr(reinterpret_cast<const kj::byte*>(table), sizeof table));
  pair.writer->flush();
  bool refused = false;
  try {
    for (int reads = 0; reads < 10 && !refused; ++reads) {
      ASSERT_TRUE(pair.reader->read_some().wait(loop.wait_scope()));
      EXPECT_EQ(pair.reader->next_frame(), nullptr);
    }
  } catch (const kj::Exception& exception) {
    refused = true;
    EXPECT_NE(std::string(exception.getDescription().cStr()).find("larger than the limit"), std::string::npos);
  }
  EXPECT_TRUE(refused);
  EXPECT_LE(pair.reader->buffered_bytes(), 64u * sizeof(capnp::word));
}

TEST_P(FrameStreamTest, ATableOfTooManySegmentsIsRefused) {
  IoLoop loop;
  Pair pair = connected(loop, GetParam());
  const std::uint32_t table[2] = {FrameStream::kSegmentsMax, 1};  // kSegmentsMax + 1 segments
  pair.writer->append_bytes(kj::arrayPtr(reinterpret_cast<const kj::byte*>(table), sizeof table));
  pair.writer->flush();
  EXPECT_THROW(
      {
        for (int reads = 0; reads < 10; ++reads) {
          if (!pair.reader->read_some().wait(loop.wait_scope())) break;
          (void)pair.reader->next_frame();
        }
      },
      kj::Exception);
}

// A peer that is not TensorHub (an HTTP server such as th-server's metrics endpoint, a TLS port)
// is named as what it speaks, not as a table of a billion segments.
TEST_P(FrameStreamTest, APeerThatSpeaksHttpOrTlsIsNamedSo) {
  for (const auto& [bytes, words] :
       {std::pair<std::string, std::string>{"HTTP/1.1 400 Bad Request\r\n\r\n", "speaks HTTP"},
        {"GET /metrics HTTP/1.1\r\n\r\n", "--metrics-listen"},
        {"<!DOCTYPE HTML>\n<html><body>Error response</body></html>\n", "speaks HTTP"},  // HTTP/0.9: the page alone
        {std::string("\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03", 11), "speaks TLS"}}) {
    IoLoop loop;
    Pair pair = connected(loop, GetParam());
    std::string sent = bytes;
    sent.resize((sent.size() + 7) / 8 * 8, '\n');  // (append_bytes takes whole words)
    pair.writer->append_bytes(kj::arrayPtr(reinterpret_cast<const kj::byte*>(sent.data()), sent.size()));
    pair.writer->flush();
    std::string refused;
    try {
      for (int reads = 0; reads < 10; ++reads) {
        if (!pair.reader->read_some().wait(loop.wait_scope())) break;
        (void)pair.reader->next_frame();
      }
    } catch (const kj::Exception& exception) {
      refused = exception.getDescription().cStr();
    }
    EXPECT_NE(refused.find(words), std::string::npos) << "'" << refused << "' for " << bytes;
  }
}

// A peer that reads nothing: one write stays in flight, what is appended meanwhile waits (counted in
// unwritten_bytes), and once the peer reads, everything arrives in order and on_written tells.
TEST_P(FrameStreamTest, APeerThatDoesNotReadHoldsOneWriteAndTheRestWaits) {
  if (GetParam() == Kind::kKjPipe) GTEST_SKIP() << "an in-memory pipe has no buffer to fill";
  IoLoop loop;
  Pair pair = connected(loop, GetParam());
  std::vector<std::size_t> sizes;
  int written = 0;
  pair.writer->on_written([&] { ++written; });
  for (std::uint32_t i = 0; i < 400 && !pair.writer->writing(); ++i) {
    sizes.push_back(100'000);
    append_frame(*pair.writer, i, sizes.back());
    pair.writer->flush();
    loop.wait_scope().poll();
  }
  ASSERT_TRUE(pair.writer->writing()) << "40 MB went into the socket buffers of a peer that reads nothing";
  const std::size_t in_flight = pair.writer->unwritten_bytes();
  const int written_when_stuck = written;
  for (int i = 0; i < 3; ++i) {
    sizes.push_back(10);
    append_frame(*pair.writer, static_cast<std::uint32_t>(sizes.size() - 1), 10);
    pair.writer->flush();  // a write is in flight: these wait
  }
  EXPECT_GT(pair.writer->unwritten_bytes(), in_flight);
  loop.wait_scope().poll();
  EXPECT_EQ(written, written_when_stuck) << "a write ended while the peer read nothing";
  read_frames(loop, *pair.reader, static_cast<std::uint32_t>(sizes.size()), sizes);
  while (pair.writer->writing()) loop.wait_scope().poll();
  EXPECT_EQ(pair.writer->unwritten_bytes(), 0u);
  EXPECT_GT(written, written_when_stuck);
}

INSTANTIATE_TEST_SUITE_P(Kinds, FrameStreamTest, ::testing::Values(Kind::kRaw, Kind::kKjSocket, Kind::kKjPipe),
                         [](const auto& kind_info) {
                           switch (kind_info.param) {
                             case Kind::kRaw: return std::string("Raw");
                             case Kind::kKjSocket: return std::string("KjSocket");
                             case Kind::kKjPipe: return std::string("KjPipe");
                           }
                           return std::string("?");
                         });

}  // namespace
}  // namespace th::net
