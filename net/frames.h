// Framed control connections: Cap'n Proto messages back to back on a byte stream, without RPC.
//
// Why (issue 14, bench/results/control-plane-*): with an RPC per message, every operation cost
// th-server ~184 us of CPU — three or more calls, each with its own return, question table entry,
// promise chain and write. Here a connection is a FrameStream: the reader takes whatever the socket
// has in one read and hands out every complete frame in it; the writer appends frames to one buffer
// and writes it with one call, while the previous write is in flight nothing else is written, so
// what a loop turn produced for a peer leaves in one write. Frames are standard Cap'n Proto stream
// messages (segment table, segments), so `capnp decode` reads a capture, and the schema stays
// net/tensorhub.capnp (ClientFrame, ServerFrame).
//
// I/O: given the loop's UnixEventPort and a plain socket, a FrameStream takes the socket over and
// does its own non-blocking reads and writes: kj's stream reads again after every read, and the
// second read of a drained socket is a wasted system call (EAGAIN) per message; here a short read
// (with no end of stream seen) means the socket is drained, and the next read waits for epoll.
// Without a port, or over TLS (no socket underneath), it uses the kj stream.
//
// Limits: a frame is refused (the read fails) when its segment table declares more than
// frame_words_max words, before any of it is buffered; the read buffer grows only to hold the frame
// in progress and shrinks back once it is consumed.
#pragma once

#include <capnp/message.h>
#include <capnp/serialize.h>
#include <kj/async-io.h>
#include <kj/async-unix.h>

#include <array>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string_view>
#include <vector>

namespace th::net {

// The first 8 bytes of a framed connection (after TLS, if any). Read as a little-endian word, its
// first half is far above Cap'n Proto's segment count limit, so a Cap'n Proto RPC peer's first
// message can never start this way: th-server tells the two apart by these bytes.
inline constexpr std::array<kj::byte, 8> kFramedMagic = {'T', 'H', 'F', 'R', 'A', 'M', 'E', '1'};
// How a FrameStream's error begins when the peer's bytes are HTTP (a metrics port, a web server):
// libthclient recognises such a server by it.
inline constexpr std::string_view kPeerSpeaksHttp = "the peer speaks HTTP";

class FrameStream final : private kj::TaskSet::ErrorHandler {
 public:
  // Cap'n Proto's own traversal limit: the largest message RPC took before (64 MiB).
  static constexpr std::uint64_t kFrameWordsMaxDefault = 8u << 20;
  // The read buffer's size while no large frame is in progress (x 8,192 connections on a server).
  static constexpr std::size_t kReadBufferWordsMin = 512;  // 4 KiB
  // How far the read buffer grows ahead of the bytes that arrived (64 KiB), and the size past which
  // it shrinks again once empty.
  static constexpr std::size_t kReadChunkWordsMax = 8192;
  // Segments per frame at most (Cap'n Proto's stream readers' limit).
  static constexpr std::uint64_t kSegmentsMax = 512;

  // `port`: the event loop's, for the socket's own I/O (above); null: through `stream`. Only for
  // a plain socket's stream: kj's TLS stream reports its socket's descriptor too, and reading that
  // would bypass the decryption.
  explicit FrameStream(kj::Own<kj::AsyncIoStream> stream, kj::UnixEventPort* port = nullptr);
  ~FrameStream();
  FrameStream(const FrameStream&) = delete;
  FrameStream& operator=(const FrameStream&) = delete;

  // Whether it does its own socket I/O (else through the kj stream).
  bool raw() const { return fd_ >= 0; }
  // Closes the write side (the peer reads the end of the stream once what was written arrives).
  void shutdown_write();

  // ---- Reading ----
  // One read from the socket: resolves true once some bytes arrived, false at the end of the
  // stream. Frames read are then taken with next_frame() (do so before reading again).
  kj::Promise<bool> read_some();
  // The next complete frame in what was read, or null. Valid until the next call of next_frame or
  // read_some. Throws kj::Exception (FAILED) for a frame over frame_words_max or a malformed table.
  capnp::MessageReader* next_frame();
  // Bytes read and not yet taken as frames (part of a frame in progress).
  std::size_t buffered_bytes() const { return end_bytes_ - begin_words_ * sizeof(capnp::word); }
  void set_frame_words_max(std::uint64_t words) { frame_words_max_ = words; }
  std::uint64_t frames_read() const { return frames_read_; }

  // ---- Writing ----
  // Appends one frame built by `fill` (called with the message's root of type Root). Encoding uses
  // a scratch segment of the thread, so a small frame costs no allocation.
  template <typename Root, typename Fill>
  void append(Fill&& fill) {
    capnp::MallocMessageBuilder message(scratch_segment());
    fill(message.initRoot<Root>());
    append(message);
  }
  void append(capnp::MessageBuilder& message);
  // Raw bytes, a whole number of words (the magic).
  void append_bytes(kj::ArrayPtr<const kj::byte> bytes);
  // Starts writing what was appended, unless a write is in flight (then what was appended goes
  // when it ends). `on_written` runs when a write that had to wait for the socket ends and nothing
  // appended waits (the owner may append more then; a write that completes within flush() does
  // not call it); `on_broken` once, when a write fails (the peer reset), possibly within flush().
  void flush();
  bool writing() const { return writing_; }
  // Appended and not yet fully written, in bytes (the one write in flight included).
  std::size_t unwritten_bytes() const { return (pending_.size() + in_flight_.size()) * sizeof(std::uint64_t); }
  void on_written(std::function<void()> callback) { on_written_ = std::move(callback); }
  void on_broken(std::function<void(const kj::Exception&)> callback) { on_broken_ = std::move(callback); }

 private:
  static kj::ArrayPtr<capnp::word> scratch_segment();
  capnp::word* words(std::vector<std::uint64_t>& buffer, std::size_t at = 0) {
    return reinterpret_cast<capnp::word*>(buffer.data() + at);
  }
  void taskFailed(kj::Exception&& exception) override;
  void start_write();
  void write_done();
  kj::Promise<bool> read_raw(kj::byte* into, std::size_t room_bytes);
  void arm_readable();
  // The words the frame at the read position declares (its table complete or not); throws past
  // kSegmentsMax or frame_words_max_.
  std::size_t declared_words(std::size_t whole_words) const;
  void write_raw();
  void broke(const kj::Exception& exception);

  kj::Own<kj::AsyncIoStream> stream_;  // null in raw mode
  // Raw mode: the socket (a duplicate of the kj stream's, which is gone) and its epoll observer.
  kj::AutoCloseFd fd_owned_;
  int fd_ = -1;
  kj::Own<kj::UnixEventPort::FdObserver> observer_;
  // The socket was seen empty (a short read or EAGAIN) and readiness armed then; the next read
  // waits for it unless it fired meanwhile.
  bool drained_ = false;
  bool readable_since_drained_ = false;
  bool readable_armed_ = false;
  kj::Maybe<kj::Promise<void>> readable_;
  kj::Maybe<kj::Own<kj::PromiseFulfiller<void>>> read_waiter_;
  std::size_t written_bytes_ = 0;  // of in_flight_, in raw mode
  // Read side: words [begin_words_, end_bytes_/8) hold unconsumed bytes (frames are whole words).
  // (Plain 64-bit words: capnp::word cannot be copied under every compiler.)
  std::vector<std::uint64_t> buffer_;
  std::size_t begin_words_ = 0;
  std::size_t end_bytes_ = 0;
  std::uint64_t frame_words_max_ = kFrameWordsMaxDefault;
  std::uint64_t frames_read_ = 0;
  std::optional<capnp::FlatArrayMessageReader> current_;
  // Write side: appended frames, and the buffer of the write in flight (swapped, so no copy).
  std::vector<std::uint64_t> pending_;
  std::vector<std::uint64_t> in_flight_;
  bool writing_ = false;
  bool broken_ = false;
  std::function<void()> on_written_;
  std::function<void(const kj::Exception&)> on_broken_;
  kj::TaskSet tasks_;  // the write in flight (cancelled with the stream)
};

}  // namespace th::net
