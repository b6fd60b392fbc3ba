// libFuzzer target: framed control connections (net/frames.h), where a peer's bytes enter th-server
// before anything else looks at them. The input arrives through an in-memory stream in pieces of
// the sizes its first byte picks, and is read with the server's limit before authentication; every
// frame taken is decoded as a ClientFrame (hello fields, messages through net::decode) and as a
// ServerFrame (effects, as libthclient does). Never a crash, a hang or a buffer past its bound; a
// malformed or oversized frame must end the stream with a kj::Exception, as the server then closes.
#include <capnp/message.h>
#include <kj/async-io.h>

#include <algorithm>
#include <cstring>
#include <stdexcept>

#include "net/frames.h"
#include "net/tensorhub.capnp.h"
#include "net/wire.h"

namespace {

constexpr std::uint64_t kFrameWordsMax = 8192;  // th-server's limit before authentication

kj::AsyncIoContext& io() {
  static kj::AsyncIoContext context = kj::setupAsyncIo();
  return context;
}

void take(capnp::MessageReader& frame) {
  auto client = frame.getRoot<th::wire::ClientFrame>();
  if (client.isHello()) {
    auto hello = client.getHello();
    (void)hello.getToken().size();
    (void)hello.getClientName().size();
    (void)hello.getClientSecret().size();
  } else if (client.isMessages()) {
    for (auto message : client.getMessages()) (void)th::net::decode(message);
  }
  auto server = frame.getRoot<th::wire::ServerFrame>();
  if (server.isEffects()) {
    for (auto effect : server.getEffects()) (void)th::net::decode(effect);
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size == 0) return 0;
  kj::WaitScope& wait_scope = io().waitScope;  // (the event loop first: pipes and promises need it)
  const std::size_t piece_bytes = 1 + data[0] % 64;  // how the bytes trickle in
  auto input = kj::arrayPtr(reinterpret_cast<const kj::byte*>(data) + 1, size - 1);
  auto pipe = kj::newTwoWayPipe();
  th::net::FrameStream frames(kj::mv(pipe.ends[1]));
  frames.set_frame_words_max(kFrameWordsMax);
  kj::AsyncIoStream& writer = *pipe.ends[0];
  std::function<kj::Promise<void>(std::size_t)> write_from = [&](std::size_t at) -> kj::Promise<void> {
    if (at >= input.size()) {
      writer.shutdownWrite();
      return kj::READY_NOW;
    }
    const std::size_t bytes = std::min(piece_bytes, input.size() - at);
    return writer.write(input.begin() + at, bytes).then([&write_from, at, bytes] { return write_from(at + bytes); });
  };
  auto writing = write_from(0).eagerlyEvaluate([](kj::Exception&&) {});  // the reader may stop first
  try {
    while (frames.read_some().wait(wait_scope)) {
      if (frames.buffered_bytes() > (kFrameWordsMax + th::net::FrameStream::kReadBufferWordsMin) * sizeof(capnp::word)) {
        throw std::logic_error("the read buffer grew past the frame limit");
      }
      while (capnp::MessageReader* frame = frames.next_frame()) take(*frame);
    }
  } catch (const kj::Exception&) {
    // Refused: oversized, malformed. The server closes such a connection.
  }
  return 0;
}
