#include "net/frames.h"

#include <algorithm>
#include <cstring>

#include "core/assert.h"

namespace th::net {

FrameStream::FrameStream(kj::Own<kj::AsyncIoStream> stream)
    : stream_(kj::mv(stream)), buffer_(kReadBufferWordsMin), tasks_(*this) {}

FrameStream::~FrameStream() = default;

kj::ArrayPtr<capnp::word> FrameStream::scratch_segment() {
  // Zeroed once; MallocMessageBuilder zeroes what it used when it is destroyed, as it requires.
  // 64 KiB: a batch of a few hundred effects fits; larger ones take heap segments.
  thread_local std::vector<std::uint64_t> scratch(8192, 0);
  return kj::arrayPtr(reinterpret_cast<capnp::word*>(scratch.data()), scratch.size());
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
  // Room for the whole frame in progress (its size is known once its table is in), and for at
  // least one more byte; a buffer grown for a large frame goes back to its small size once that
  // frame is gone.
  const std::size_t whole_words = end_bytes_ / sizeof(capnp::word);
  std::size_t wanted_words = std::max(kReadBufferWordsMin, whole_words + 1);
  if (whole_words > 0) {
    const std::size_t expected = capnp::expectedSizeInWordsFromPrefix(kj::arrayPtr(words(buffer_), whole_words));
    if (expected > frame_words_max_) {
      return KJ_EXCEPTION(FAILED, "a frame larger than the limit", expected, frame_words_max_);
    }
    wanted_words = std::max(wanted_words, expected);
  }
  if (buffer_.size() < wanted_words) {
    // Doubling (bounded by the frame limit): a large frame arriving in pieces is not copied often.
    const std::size_t doubled = std::min<std::size_t>(2 * buffer_.size(), frame_words_max_ + kReadBufferWordsMin);
    buffer_.resize(std::max(wanted_words, doubled));
  } else if (buffer_.size() > kReadChunkWordsMax && wanted_words == kReadBufferWordsMin) {
    std::vector<std::uint64_t> smaller(kReadBufferWordsMin);
    std::memcpy(smaller.data(), buffer_.data(), end_bytes_);
    buffer_.swap(smaller);
  }
  const std::size_t room_bytes = buffer_.size() * sizeof(capnp::word) - end_bytes_;
  TH_ASSERT(room_bytes > 0);
  auto* into = reinterpret_cast<kj::byte*>(buffer_.data()) + end_bytes_;
  return stream_->tryRead(into, 1, room_bytes).then([this](std::size_t got) {
    end_bytes_ += got;
    return got > 0;
  });
}

capnp::MessageReader* FrameStream::next_frame() {
  current_.reset();
  const std::size_t whole_words = end_bytes_ / sizeof(capnp::word) - begin_words_;
  if (whole_words == 0) return nullptr;
  auto available = kj::arrayPtr(words(buffer_, begin_words_), whole_words);
  const std::size_t expected = capnp::expectedSizeInWordsFromPrefix(available);
  if (expected > frame_words_max_) {
    kj::throwFatalException(KJ_EXCEPTION(FAILED, "a frame larger than the limit", expected, frame_words_max_));
  }
  if (expected > whole_words) return nullptr;
  capnp::ReaderOptions options;
  options.traversalLimitInWords = frame_words_max_;
  // Validates the segment table against the bytes (throws for a malformed one).
  current_.emplace(kj::arrayPtr(available.begin(), expected), options);
  TH_ASSERT(current_->getEnd() == available.begin() + expected);
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
  tasks_.add(stream_->write(in_flight_.data(), in_flight_.size() * sizeof(capnp::word)).then([this] {
    writing_ = false;
    in_flight_.clear();
    if (in_flight_.capacity() > kReadChunkWordsMax) in_flight_.shrink_to_fit();  // after a burst
    if (!pending_.empty()) {
      start_write();
    } else if (on_written_) {
      on_written_();
    }
  }));
}

void FrameStream::taskFailed(kj::Exception&& exception) {
  writing_ = false;
  if (broken_) return;
  broken_ = true;
  if (on_broken_) on_broken_(exception);
}

}  // namespace th::net
