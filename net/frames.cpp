#include "net/frames.h"

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <string_view>

#include <fcntl.h>
#include <sys/socket.h>
#include <unistd.h>

#include "core/assert.h"

namespace th::net {

FrameStream::FrameStream(kj::Own<kj::AsyncIoStream> stream, kj::UnixEventPort* port)
    : stream_(kj::mv(stream)), buffer_(kReadBufferWordsMin), tasks_(*this) {
  if (port == nullptr) return;
  KJ_IF_MAYBE(fd, stream_->getFd()) {
    // A duplicate, then the kj stream goes (its epoll registration with it): one observer per socket.
    const int own = ::fcntl(*fd, F_DUPFD_CLOEXEC, 0);
    if (own < 0) return;  // out of descriptors: the kj stream serves
    fd_owned_ = kj::AutoCloseFd(own);
    fd_ = own;
    stream_ = nullptr;
    observer_ = kj::heap<kj::UnixEventPort::FdObserver>(*port, fd_, kj::UnixEventPort::FdObserver::OBSERVE_READ_WRITE);
  }
}

FrameStream::~FrameStream() = default;

kj::ArrayPtr<capnp::word> FrameStream::scratch_segment() {
  // Zeroed once; MallocMessageBuilder zeroes what it used when it is destroyed, as it requires.
  // 64 KiB: a batch of a few hundred effects fits; larger ones take heap segments.
  thread_local std::vector<std::uint64_t> scratch(8192, 0);
  return kj::arrayPtr(reinterpret_cast<capnp::word*>(scratch.data()), scratch.size());
}

std::size_t FrameStream::declared_words(std::size_t whole_words) const {
  TH_ASSERT(whole_words > 0);
  const capnp::word* start = reinterpret_cast<const capnp::word*>(buffer_.data() + begin_words_);
  // Cap'n Proto's own stream readers refuse more than 512 segments; a table of millions would
  // cost a pass over it per read, and 16 bytes each to read the frame.
  std::uint32_t segments_minus_one = 0;
  std::memcpy(&segments_minus_one, start, sizeof segments_minus_one);
  if (static_cast<std::uint64_t>(segments_minus_one) + 1 > kSegmentsMax) {
    // A peer that is not TensorHub at all is the likelier mistake (an address of the metrics
    // endpoint, a web server, a TLS port): say what it speaks, not what its bytes would mean.
    const char* text = reinterpret_cast<const char*>(start);
    auto starts_with = [&](std::string_view prefix) { return std::string_view(text, 4).substr(0, prefix.size()) == prefix; };
    // (An HTTP/0.9-style answer is the page alone: "<!DOCTYPE html>", "<html>".)
    if (starts_with("HTTP") || starts_with("GET ") || starts_with("POST") || starts_with("HEAD") || starts_with("PUT ") ||
        starts_with("<!DO") || starts_with("<!do") || starts_with("<htm") || starts_with("<HTM")) {
      kj::throwFatalException(KJ_EXCEPTION(FAILED, std::string(kPeerSpeaksHttp) + ", not TensorHub's protocol (is this "
                                                   "th-server's --metrics-listen address, or a web server? dial its "
                                                   "--listen address)"));
    }
    if (text[0] == 0x16 && text[1] == 0x03) {
      kj::throwFatalException(KJ_EXCEPTION(FAILED, "the peer speaks TLS and this end does not (give both ends the same "
                                                   "--tls settings)"));
    }
    kj::throwFatalException(
        KJ_EXCEPTION(FAILED, "a frame of too many segments", static_cast<std::uint64_t>(segments_minus_one) + 1));
  }
  const std::size_t expected = capnp::expectedSizeInWordsFromPrefix(kj::arrayPtr(start, whole_words));
  if (expected > frame_words_max_) {
    kj::throwFatalException(KJ_EXCEPTION(FAILED, "a frame larger than the limit", expected, frame_words_max_));
  }
  return expected;
}

kj::Promise<bool> FrameStream::read_some() {
  current_.reset();  // it points into the buffer, which moves now
  // Compact: what is left is the start of a frame in progress.
  const std::size_t left_bytes = buffered_bytes();
  if (begin_words_ > 0) {
    std::memmove(buffer_.data(), buffer_.data() + begin_words_, left_bytes);
    begin_words_ = 0;
    end_bytes_ = left_bytes;
  }
  // Room for at least one more byte, and for the frame in progress as its bytes come: the buffer
  // grows with what arrived (doubling, at most a chunk ahead of it), never to a size a table merely
  // declares; one grown for a large frame goes back to its small size once that frame is gone.
  const std::size_t whole_words = end_bytes_ / sizeof(capnp::word);
  std::size_t wanted_words = std::max(kReadBufferWordsMin, whole_words + 1);
  if (whole_words > 0) {
    const std::size_t expected = declared_words(whole_words);  // throws past the limits
    wanted_words = std::max(wanted_words, std::min(expected, whole_words + kReadChunkWordsMax));
  }
  if (buffer_.size() < wanted_words) {
    buffer_.resize(std::max(wanted_words, std::min(2 * buffer_.size(), whole_words + kReadChunkWordsMax)));
  } else if (buffer_.size() > kReadChunkWordsMax && wanted_words == kReadBufferWordsMin) {
    std::vector<std::uint64_t> smaller(kReadBufferWordsMin);
    std::memcpy(smaller.data(), buffer_.data(), end_bytes_);
    buffer_.swap(smaller);
  }
  const std::size_t room_bytes = buffer_.size() * sizeof(capnp::word) - end_bytes_;
  TH_ASSERT(room_bytes > 0);
  auto* into = reinterpret_cast<kj::byte*>(buffer_.data()) + end_bytes_;
  if (raw()) return read_raw(into, room_bytes);
  return stream_->tryRead(into, 1, room_bytes).then([this](std::size_t got) {
    end_bytes_ += got;
    return got > 0;
  });
}

kj::Promise<bool> FrameStream::read_raw(kj::byte* into, std::size_t room_bytes) {
  if (drained_ && !readable_since_drained_) {
    // Nothing came since the socket was seen empty: wait for the readiness armed then.
    auto woken = kj::newPromiseAndFulfiller<void>();
    read_waiter_ = kj::mv(woken.fulfiller);
    return woken.promise.then([this, into, room_bytes] { return read_raw(into, room_bytes); });
  }
  drained_ = false;
  const ssize_t got = ::recv(fd_, into, room_bytes, MSG_DONTWAIT);
  if (got == 0) return false;
  if (got < 0) {
    if (errno == EINTR) return read_raw(into, room_bytes);  // (a signal: the bytes may be there)
    if (errno != EAGAIN && errno != EWOULDBLOCK) {
      return KJ_EXCEPTION(DISCONNECTED, "read failed", strerror(errno));
    }
    arm_readable();
    return read_raw(into, room_bytes);
  }
  end_bytes_ += static_cast<std::size_t>(got);
  // A short read, and the peer has not closed: the socket is empty now (the FdObserver contract),
  // so the next read may wait for epoll instead of asking the kernel in vain.
  bool at_end = true;
  KJ_IF_MAYBE(hint, observer_->atEndHint()) { at_end = *hint; }
  if (static_cast<std::size_t>(got) < room_bytes && !at_end) arm_readable();
  return true;
}

void FrameStream::arm_readable() {
  // Armed at once, in the turn that saw the socket empty: an edge that comes while the owner is
  // busy elsewhere (processing, waiting for its turn) is caught here, not lost.
  drained_ = true;
  readable_since_drained_ = false;
  if (readable_armed_) return;  // the previous arming has not fired: it covers this one too
  readable_armed_ = true;
  readable_ = observer_->whenBecomesReadable()
                  .then([this] {
                    readable_armed_ = false;
                    readable_since_drained_ = true;
                    KJ_IF_MAYBE(waiter, read_waiter_) {
                      auto fulfiller = kj::mv(*waiter);
                      read_waiter_ = nullptr;
                      fulfiller->fulfill();
                    }
                  })
                  .eagerlyEvaluate(nullptr);
}

capnp::MessageReader* FrameStream::next_frame() {
  current_.reset();
  const std::size_t whole_words = end_bytes_ / sizeof(capnp::word) - begin_words_;
  if (whole_words == 0) return nullptr;
  const std::size_t expected = declared_words(whole_words);  // throws past the limits
  if (expected > whole_words) return nullptr;
  auto available = kj::arrayPtr(words(buffer_, begin_words_), expected);
  capnp::ReaderOptions options;
  options.traversalLimitInWords = frame_words_max_;
  // Validates the segment table against the bytes (throws for a malformed one).
  current_.emplace(available, options);
  TH_ASSERT(current_->getEnd() == available.end());
  begin_words_ += expected;
  ++frames_read_;
  return &*current_;
}

void FrameStream::append(capnp::MessageBuilder& message) {
  const auto segments = message.getSegmentsForOutput();
  TH_ASSERT(segments.size() > 0);
  // The stream framing: segment count - 1, each segment's size (32-bit words), padded to a word.
  const std::size_t table_words = segments.size() / 2 + 1;
  std::size_t body_words = 0;
  for (const auto& segment : segments) body_words += segment.size();
  const std::size_t at = pending_.size();
  pending_.resize(at + table_words + body_words);
  auto* table = reinterpret_cast<std::uint32_t*>(pending_.data() + at);
  std::memset(table, 0, table_words * sizeof(std::uint64_t));
  table[0] = static_cast<std::uint32_t>(segments.size() - 1);
  for (std::size_t i = 0; i < segments.size(); ++i) table[i + 1] = static_cast<std::uint32_t>(segments[i].size());
  capnp::word* out = words(pending_, at + table_words);
  for (const auto& segment : segments) {
    std::memcpy(out, segment.begin(), segment.size() * sizeof(capnp::word));
    out += segment.size();
  }
}

void FrameStream::append_bytes(kj::ArrayPtr<const kj::byte> bytes) {
  TH_REQUIRE(bytes.size() % sizeof(capnp::word) == 0, "raw bytes go in whole words");
  const std::size_t at = pending_.size();
  pending_.resize(at + bytes.size() / sizeof(capnp::word));
  std::memcpy(pending_.data() + at, bytes.begin(), bytes.size());
}

void FrameStream::flush() {
  if (writing_ || broken_ || pending_.empty()) return;
  start_write();
}

void FrameStream::start_write() {
  TH_ASSERT(!writing_ && in_flight_.empty() && !pending_.empty());
  in_flight_.swap(pending_);
  writing_ = true;
  if (raw()) {
    written_bytes_ = 0;
    write_raw();
    return;
  }
  tasks_.add(stream_->write(in_flight_.data(), in_flight_.size() * sizeof(capnp::word)).then([this] {
    write_done();
    if (!writing_ && on_written_) on_written_();
  }));
}

void FrameStream::write_done() {
  writing_ = false;
  in_flight_.clear();
  if (in_flight_.capacity() > kReadChunkWordsMax) in_flight_.shrink_to_fit();  // after a burst
  if (!pending_.empty()) start_write();  // appended while this write waited
}

void FrameStream::write_raw() {
  const auto* bytes = reinterpret_cast<const kj::byte*>(in_flight_.data());
  const std::size_t total = in_flight_.size() * sizeof(std::uint64_t);
  std::size_t done = written_bytes_;
  while (done < total) {
    const ssize_t sent = ::send(fd_, bytes + done, total - done, MSG_DONTWAIT | MSG_NOSIGNAL);
    if (sent > 0) {
      done += static_cast<std::size_t>(sent);
      continue;
    }
    if (sent < 0 && errno == EINTR) continue;
    if (sent < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      written_bytes_ = done;
      // The socket is full (a slow or stuck peer): go on once it drains, then tell the owner.
      tasks_.add(observer_->whenBecomesWritable().then([this] {
        write_raw();
        if (!writing_ && !broken_ && on_written_) on_written_();
      }));
      return;
    }
    broke(KJ_EXCEPTION(DISCONNECTED, "write failed", strerror(errno)));
    return;
  }
  write_done();
}

void FrameStream::shutdown_write() {
  if (raw()) {
    ::shutdown(fd_, SHUT_WR);  // (fails only if the peer is gone: nothing to do then)
    return;
  }
  try {
    stream_->shutdownWrite();
  } catch (const kj::Exception&) {
    // Already gone: its read side will see it.
  }
}

void FrameStream::broke(const kj::Exception& exception) {
  writing_ = false;
  if (broken_) return;
  broken_ = true;
  if (on_broken_) on_broken_(exception);
}

void FrameStream::taskFailed(kj::Exception&& exception) { broke(exception); }

}  // namespace th::net
