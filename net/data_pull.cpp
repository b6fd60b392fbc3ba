// The TCP data plane's reader: net::pull (see net/data_plane.h), over the frames of
// net/data_frames.h; the server is net/data_plane.cpp.
#include <sys/socket.h>
#include <sys/time.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <deque>
#include <mutex>
#include <system_error>
#include <thread>

#include "core/assert.h"
#include "net/data_frames.h"
#include "net/data_plane.h"
#include "net/ipc.h"

namespace th::net {

using Clock = std::chrono::steady_clock;

// ---- Reader ----------------------------------------------------------------------------------------

namespace {

// Whether the source serves reads under `key` now, by one empty read of `region`: none (it does),
// kRefused (no grant), or kUnreachable.
std::optional<ReadError> probe_grant(const Endpoint& source, GrantKey key, const GrantSecret& secret,
                                     std::uint32_t region, const PullOptions& options) {
  try {
    Fd connection = connect_tcp(source, options.connect_timeout_ms);
    set_io_timeout(connection, std::max(options.io_timeout_ms, 1));
    const ReadRequestFrame request{kMagic, key.epoch, key.transfer, region, 0, 0, 0, secret};
    send_all(connection, &request, sizeof request);
    ReadResponseFrame response;
    recv_all(connection, &response, sizeof response);
    if (response.status == static_cast<std::uint32_t>(FrameStatus::kOk) && response.length == 0) return std::nullopt;
    if (response.status == static_cast<std::uint32_t>(FrameStatus::kNoGrant)) return ReadError::kRefused;
    return ReadError::kUnreachable;
  } catch (const SocketError&) {
    return ReadError::kUnreachable;
  }
}

// Whether the source refuses reads under `key` now. A source cuts off the reads in flight when it
// revokes their grant (revoke() does not wait for readers): such a read was refused, as any read
// the source will not serve, and must not make the source look unreachable. One empty read tells.
bool source_refuses(const Endpoint& source, GrantKey key, const GrantSecret& secret, std::uint32_t region,
                    const PullOptions& options) {
  return probe_grant(source, key, secret, region, options) == ReadError::kRefused;
}

// Thrown by receive() when the pull is cancelled while it waits for bytes.
struct PullCancelled {};

// How often a reader waiting for bytes looks at its cancel flag: the hub moves a reader off a hung
// source by telling it another one, and the reader must let go of the hung one at once (it used to
// wait out the whole I/O timeout first, and the next version queued behind it).
constexpr int kCancelPollMs = 50;
constexpr std::chrono::microseconds kRateSleepSlice{kCancelPollMs * 1000};  // a capped pull's sleeps
// A reader resumed ahead of a source still receiving waits for it while the source's empty answers
// say it advances (kSourceAdvanced), but not for ever: at most this many stall limits without a
// byte (10 minutes by default: a 50 GB shard at 1 Gbit/s takes 7), then it calls the source
// stalled. A source that says it advances and never sends a byte gets no more than that.
constexpr int kBehindStallsMax = 10;
// After an empty answer, before asking again: a healthy source answers empty only after waiting
// for bytes (DataServerConfig::progress_wait_ms_max), so this costs it nothing; one that answers
// at once does not make the reader spin.
constexpr std::chrono::milliseconds kEmptyAnswerPause{1};

// Receives exactly `bytes` on a socket whose receive timeout is kCancelPollMs (one blocking recv
// per wake-up, as fast as a plain blocking read). Throws PullCancelled when the pull is cancelled
// meanwhile, SocketTimeout when nothing arrives for io_timeout_ms, SocketError when the source
// closes the connection.
void receive(const Fd& socket, void* data, std::size_t bytes, const PullOptions& options) {
  auto* at = static_cast<char*>(data);
  auto quiet_since = std::chrono::steady_clock::now();
  while (bytes > 0) {
    // Also while bytes flow: a source that dribbles must not keep a cancelled reader until its
    // chunk is done.
    if (options.cancelled && options.cancelled()) throw PullCancelled{};
    const ssize_t got = ::recv(socket.get(), at, bytes, 0);
    if (got > 0) {
      at += got;
      bytes -= static_cast<std::size_t>(got);
      quiet_since = std::chrono::steady_clock::now();
      continue;
    }
    if (got == 0) throw SocketError("peer closed the connection");
    if (errno == EINTR) continue;
    if (errno != EAGAIN && errno != EWOULDBLOCK) throw SocketError(std::string("recv: ") + std::strerror(errno));
    if (options.cancelled && options.cancelled()) throw PullCancelled{};
    if (std::chrono::steady_clock::now() - quiet_since > std::chrono::milliseconds(options.io_timeout_ms)) {
      throw SocketTimeout("no bytes from the source for " + std::to_string(options.io_timeout_ms) + " ms");
    }
  }
}

// The reader's socket: sends time out as a whole I/O timeout; receives wake every kCancelPollMs
// to look at the cancel flag (receive() keeps the I/O timeout itself).
void set_reader_timeouts(const Fd& socket, const PullOptions& options) {
  set_io_timeout(socket, std::max(options.io_timeout_ms, 1));
  const timeval poll{0, kCancelPollMs * 1000};
  ::setsockopt(socket.get(), SOL_SOCKET, SO_RCVTIMEO, &poll, sizeof poll);
}

// One connection: targets[i] is the source's region first_region + i.
PullOutcome pull_stream(const Endpoint& source, GrantKey key, const GrantSecret& secret,
                        std::span<const LocalRegion> targets, std::uint32_t first_region,
                        const PullOptions& options) {
  PullOutcome outcome;
  auto fail = [&](ReadError error, std::string detail) {
    outcome.error = error;
    outcome.detail = "reading transfer " + std::to_string(key.transfer) + " epoch " +
                     std::to_string(key.epoch) + " from " + source.to_string() + ": " + std::move(detail);
    return outcome;
  };
  bool connected = false;
  try {
    Fd connection = connect_tcp(source, options.connect_timeout_ms);
    set_reader_timeouts(connection, options);
    connected = true;
    // Bytes for GPU memory land in a staging ring (borrowed at the first such response) and are
    // copied to the device while the next piece arrives; the response is whole once fill returns.
    StagingPool::Loan ring;
    auto receive_to_device = [&](std::byte* device, std::uint64_t bytes) {
      TH_REQUIRE(options.staging != nullptr, "a pull into GPU memory needs a staging pool");
      if (!ring) ring = options.staging->borrow(options.cancelled);
      if (!ring) throw PullCancelled{};
      ring->fill(device, bytes, [&](std::span<std::byte> piece) { receive(connection, piece.data(), piece.size(), options); });
    };

    struct Ask {
      std::uint32_t region;
      std::uint64_t offset;
      std::uint64_t length;
      std::uint64_t global_end;  // where it ends in layout order
    };
    std::deque<Ask> in_flight;
    // The cursor: the next byte to ask for, as (region, offset).
    std::uint32_t region = 0;
    std::uint64_t offset = 0;
    std::uint64_t region_start = 0;
    std::uint64_t ready = 0;  // prefix of the targets that has arrived
    // A partial source answers with what it has: one request at a time, so that a short answer
    // moves the cursor. A complete source answers in full: `depth` requests keep the pipe busy.
    std::uint32_t depth = options.partial ? 1 : options.depth;
    bool wait_for_bytes = options.partial;  // let the source wait (bounded) for bytes to be ready
    const auto now = [] { return std::chrono::steady_clock::now(); };
    auto last_progress = now();
    auto last_byte = now();
    const auto pull_started = now();

    auto skip_empty_regions = [&] {
      while (region < targets.size() && offset == targets[region].bytes) {
        region_start += targets[region].bytes;
        ++region;
        offset = 0;
      }
    };
    // Resume: the cursor starts after the prefix the reader holds.
    while (region < targets.size() && region_start + targets[region].bytes <= options.start_bytes) {
      region_start += targets[region].bytes;
      ++region;
    }
    if (region < targets.size()) offset = options.start_bytes - region_start;
    TH_ASSERT(region < targets.size() || region_start == options.start_bytes, "a resume starts within the targets");
    ready = options.start_bytes;
    skip_empty_regions();
    if (region == targets.size()) return outcome;  // nothing to pull
    for (;;) {
      while (in_flight.size() < depth && region < targets.size()) {
        const std::uint64_t length = std::min(options.chunk_bytes, targets[region].bytes - offset);
        ReadRequestFrame request{kMagic, key.epoch, key.transfer, first_region + region,
                                 wait_for_bytes ? 1u : 0u, offset, length, secret};
        send_all(connection, &request, sizeof request);
        in_flight.push_back(Ask{region, offset, length, region_start + offset + length});
        offset += length;
        skip_empty_regions();
      }
      if (in_flight.empty()) break;
      if (options.cancelled && options.cancelled()) return fail(ReadError::kCancelled, "cancelled");

      const Ask ask = in_flight.front();
      in_flight.pop_front();
      ReadResponseFrame response;
      receive(connection, &response, sizeof response, options);
      if (response.status != static_cast<std::uint32_t>(FrameStatus::kOk)) {
        return fail(ReadError::kRefused, response.status == static_cast<std::uint32_t>(FrameStatus::kNoGrant)
                                             ? "the source holds no grant for it"
                                             : "outside the source's exposed regions");
      }
      if (response.length > ask.length) return fail(ReadError::kUnreachable, "the source sent too much");
      // In steps, telling on_progress as the prefix grows: this is the front request, so every
      // byte before it has arrived. (A whole 8 MiB chunk per step made each hop of a pipeline
      // chain trail its source by 67 ms at 1 Gbit/s.)
      if (targets[ask.region].on_device) {
        receive_to_device(targets[ask.region].base + ask.offset, response.length);
      } else {
        for (std::uint64_t received = 0; received < response.length;) {
          const std::uint64_t step = std::min(options.progress_step_bytes, response.length - received);
          receive(connection, targets[ask.region].base + ask.offset + received, step, options);
          received += step;
          if (received < response.length && options.on_progress) {
            options.on_progress(ask.global_end - ask.length + received);
          }
        }
      }
      outcome.bytes += response.length;
      if (options.rate_bytes_per_s > 0) {
        // Sleep until the bytes so far fit the rate since the pull began, in slices: a cancelled
        // pull stops within one (a capped reader would otherwise hold a cancel or a deadline's
        // answer for a whole chunk's time: 8 s for 8 MiB at 1 MB/s).
        const auto due = pull_started + std::chrono::microseconds(outcome.bytes * 1'000'000 / options.rate_bytes_per_s);
        for (auto left = due - Clock::now(); left > left.zero(); left = due - Clock::now()) {
          if (options.cancelled && options.cancelled()) return fail(ReadError::kCancelled, "cancelled");
          std::this_thread::sleep_for(std::min<std::chrono::microseconds>(
              std::chrono::duration_cast<std::chrono::microseconds>(left), kRateSleepSlice));
        }
      }
      if (response.length == ask.length) {
        ready = ask.global_end;
        if (options.on_progress && response.length > 0) options.on_progress(ready);
        last_progress = last_byte = now();
        continue;
      }
      // A short answer: the source has no more yet. Drain what is in flight, then ask again from
      // the first missing byte, one request at a time.
      const std::uint64_t got_end = ask.global_end - ask.length + response.length;
      const std::chrono::milliseconds stall_max{options.stall_ms_max};
      if (response.length > 0) {
        ready = got_end;
        if (options.on_progress) options.on_progress(ready);
        last_progress = last_byte = now();
      } else if ((response.flags & kSourceAdvanced) != 0 && options.partial &&
                 now() - last_byte <= stall_max * kBehindStallsMax) {
        last_progress = now();  // still behind where this reader resumed, but receiving
      } else if (now() - last_progress > stall_max) {
        return fail(ReadError::kStalled, now() - last_byte > stall_max * kBehindStallsMax
                                             ? "still behind where this read resumed after " +
                                                   std::to_string(options.stall_ms_max * kBehindStallsMax) + " ms"
                                             : "no progress for " + std::to_string(options.stall_ms_max) + " ms");
      }
      if (response.length == 0) std::this_thread::sleep_for(kEmptyAnswerPause);
      while (!in_flight.empty()) {
        const Ask later = in_flight.front();
        in_flight.pop_front();
        receive(connection, &response, sizeof response, options);
        if (response.status != static_cast<std::uint32_t>(FrameStatus::kOk)) {
          return fail(ReadError::kRefused, "the source refused a read it had granted");
        }
        if (response.length > later.length) return fail(ReadError::kUnreachable, "the source sent too much");
        if (targets[later.region].on_device) {
          receive_to_device(targets[later.region].base + later.offset, response.length);
        } else {
          receive(connection, targets[later.region].base + later.offset, response.length, options);
        }
      }
      depth = 1;
      wait_for_bytes = true;
      region = ask.region;
      offset = ask.offset + response.length;
      region_start = ask.global_end - ask.offset - ask.length;
      skip_empty_regions();
    }
    TH_ASSERT(options.start_bytes + outcome.bytes >= ready);
    return outcome;
  } catch (const PullCancelled&) {
    return fail(ReadError::kCancelled, "cancelled");
  } catch (const DeviceCopyError& error) {
    // This reader's GPU failed, not the source; the hub hears of a failed read and decides.
    return fail(ReadError::kUnreachable, std::string("staging into GPU memory: ") + error.what());
  } catch (const SocketTimeout& error) {
    return fail(ReadError::kUnreachable, error.what());
  } catch (const SocketError& error) {
    // The source closed the connection: it stopped, dropped us, or revoked the grant mid-read.
    if (connected && source_refuses(source, key, secret, first_region, options)) {
      return fail(ReadError::kRefused, std::string("the source holds no grant for it (revoked during the read: ") +
                                           error.what() + ")");
    }
    return fail(ReadError::kUnreachable, error.what());
  }
}

// Over TCP: targets[i] is the source's region first_region + i.
PullOutcome pull_tcp(const Endpoint& source, GrantKey key, const GrantSecret& secret, std::span<const LocalRegion> targets,
                     std::uint32_t first_region, const PullOptions& options) {
  // A partial source is read in order on one connection: its ready prefix grows in order. So is the
  // rest of a resumed read (rare: after a source failed).
  if (options.streams == 1 || options.partial || targets.size() < 2 || options.start_bytes > 0) {
    return pull_stream(source, key, secret, targets, first_region, options);
  }
  // Several connections, each taking the next region nobody has claimed yet. The ready prefix
  // (for our own pipeline readers) is the run of finished regions from the first one.
  std::mutex mutex;
  std::vector<bool> finished(targets.size(), false);
  std::size_t prefix_regions = 0;
  std::uint64_t prefix_bytes = 0;
  OrderedProgress progress(options.on_progress);  // (outside `mutex`: the streams go on meanwhile)
  std::atomic<std::size_t> next_region{0};
  std::atomic<bool> failed{false};
  PullOutcome total;
  PullOptions one = options;
  one.on_progress = nullptr;
  one.cancelled = [&] { return failed.load() || (options.cancelled && options.cancelled()); };
  auto stream = [&] {
    for (std::size_t region = next_region++; region < targets.size() && !failed.load(); region = next_region++) {
      PullOutcome part = pull_stream(source, key, secret, targets.subspan(region, 1),
                                     first_region + static_cast<std::uint32_t>(region), one);
      std::uint64_t prefix = 0;
      {
        std::lock_guard lock(mutex);
        total.bytes += part.bytes;
        if (!part.ok()) {
          if (!total.error || *total.error == ReadError::kCancelled) {
            total.error = part.error;
            total.detail = part.detail;
          }
          failed.store(true);
          return;
        }
        finished[region] = true;
        while (prefix_regions < targets.size() && finished[prefix_regions]) {
          prefix_bytes += targets[prefix_regions++].bytes;
        }
        prefix = prefix_bytes;
      }
      progress.tell(prefix);
    }
  };
  std::vector<std::thread> helpers;
  const std::size_t helper_count = std::min<std::size_t>(options.streams, targets.size()) - 1;
  for (std::size_t i = 0; i < helper_count; ++i) {
    try {
      helpers.emplace_back(stream);
    } catch (const std::system_error&) {
      break;  // no thread to be had: fewer streams (this one takes the regions nobody claims)
    }
  }
  stream();
  for (std::thread& helper : helpers) helper.join();
  return total;
}

}  // namespace

PullOutcome pull(const Endpoint& source, GrantKey key, const GrantSecret& secret, std::span<const LocalRegion> targets,
                 const PullOptions& options) {
  TH_REQUIRE(options.chunk_bytes > 0 && options.progress_step_bytes > 0 && options.depth > 0 && options.streams > 0 &&
             options.streams <= kPullStreamsMax);
  std::uint64_t target_bytes = 0;
  for (const LocalRegion& target : targets) target_bytes += target.bytes;
  TH_REQUIRE(options.start_bytes <= target_bytes, "a resume starts within the targets");
  if (options.start_bytes == target_bytes) return PullOutcome{};  // all here: no source needed
  std::string ipc_fallback;
  if (options.ipc != nullptr && !options.partial && options.start_bytes == 0) {
    const ipc_detail::TcpSide tcp{
        [&](std::span<const LocalRegion> part, std::uint32_t first_region, const PullOptions& part_options) {
          return pull_tcp(source, key, secret, part, first_region, part_options);
        },
        [&] { return probe_grant(source, key, secret, 0, options); }};
    if (std::optional<PullOutcome> done =
            ipc_detail::pull_over_ipc(source, key, secret, targets, options, tcp, ipc_fallback)) {
      return *std::move(done);
    }
  }
  PullOutcome outcome = pull_tcp(source, key, secret, targets, 0, options);
  outcome.ipc_fallback = std::move(ipc_fallback);
  return outcome;
}

}  // namespace th::net
