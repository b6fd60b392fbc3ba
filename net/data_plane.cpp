#include "net/data_plane.h"

#include <sys/socket.h>

#include <algorithm>
#include <bit>
#include <chrono>
#include <cstring>
#include <deque>
#include <iostream>

#include "core/assert.h"

namespace th::net {
namespace {

// ---- Frames ----------------------------------------------------------------------------------------
// Fixed-size headers in the host's byte order: every TensorHub host is little-endian (x86-64,
// aarch64), and the static_assert below keeps it that way. Payload bytes follow a response header.

static_assert(std::endian::native == std::endian::little, "the data plane's frames are little-endian");

constexpr std::uint32_t kMagic = 0x31504454;  // "TDP1"

struct ReadRequestFrame {
  std::uint32_t magic = kMagic;
  std::uint32_t epoch = 0;
  std::uint64_t transfer = 0;
  std::uint32_t region = 0;
  std::uint32_t wait_for_bytes = 0;  // 1: if nothing is ready yet, wait (bounded) for progress
  std::uint64_t offset = 0;
  std::uint64_t length = 0;
};
static_assert(sizeof(ReadRequestFrame) == 40);

enum class Status : std::uint32_t { kOk = 0, kNoGrant = 1, kOutOfBounds = 2 };

struct ReadResponseFrame {
  std::uint32_t status = 0;
  std::uint32_t reserved = 0;
  std::uint64_t length = 0;  // payload bytes that follow (the ready prefix of what was asked)
};
static_assert(sizeof(ReadResponseFrame) == 16);

}  // namespace

std::string_view read_error_name(ReadError error) {
  switch (error) {
    case ReadError::kRefused: return "refused";
    case ReadError::kUnreachable: return "unreachable";
    case ReadError::kStalled: return "stalled";
    case ReadError::kCancelled: return "cancelled";
  }
  return "?";
}

// ---- Progress --------------------------------------------------------------------------------------

void Progress::advance_to(std::uint64_t ready_bytes) {
  {
    std::lock_guard lock(mutex_);
    if (ready_bytes <= ready_bytes_.load(std::memory_order_relaxed)) return;
    ready_bytes_.store(ready_bytes, std::memory_order_release);
  }
  changed_.notify_all();
}

void Progress::wait_beyond(std::uint64_t beyond, int timeout_ms, const std::function<bool()>& stop) {
  std::unique_lock lock(mutex_);
  changed_.wait_for(lock, std::chrono::milliseconds(timeout_ms),
                    [&] { return ready_bytes_.load(std::memory_order_relaxed) > beyond || stop(); });
}

void Progress::wake_all() {
  { std::lock_guard lock(mutex_); }
  changed_.notify_all();
}

// ---- Server ----------------------------------------------------------------------------------------

struct DataServer::Grant {
  std::vector<ExposedRegion> regions;
  std::vector<std::uint64_t> starts;  // where each region begins in layout order
  std::shared_ptr<Progress> progress;
  std::uint32_t reads_in_flight = 0;  // guarded by DataServer::mutex_
  std::atomic<bool> revoked{false};
};

DataServer::DataServer(DataServerConfig config) : config_(std::move(config)) {
  TH_REQUIRE(config_.connections_max > 0 && config_.progress_wait_ms_max > 0 &&
             config_.response_bytes_max > 0);
  listener_ = listen_tcp(config_.listen, static_cast<int>(std::min<std::uint32_t>(config_.connections_max, 4096)));
  endpoint_ = Endpoint{config_.listen.host, local_port(listener_)};
  acceptor_ = std::thread([this] { accept_loop(); });
}

DataServer::~DataServer() {
  stopping_.store(true);
  listener_.shutdown();
  std::vector<std::thread> threads;
  {
    std::lock_guard lock(mutex_);
    for (int fd : open_connections_) ::shutdown(fd, SHUT_RDWR);
    for (auto& [key, grant] : grants_) {
      grant->revoked.store(true);
      grant->progress->wake_all();
    }
  }
  acceptor_.join();
  {
    std::lock_guard lock(mutex_);
    threads.swap(connection_threads_);
  }
  for (std::thread& thread : threads) thread.join();
}

void DataServer::grant(GrantKey key, std::vector<ExposedRegion> regions, std::shared_ptr<Progress> progress) {
  TH_REQUIRE(progress != nullptr, "a grant needs a progress counter");
  auto entry = std::make_shared<Grant>();
  std::uint64_t start = 0;
  for (const ExposedRegion& region : regions) {
    TH_REQUIRE(region.base != nullptr || region.bytes == 0, "an exposed region has memory");
    entry->starts.push_back(start);
    start += region.bytes;
  }
  entry->regions = std::move(regions);
  entry->progress = std::move(progress);
  {
    std::lock_guard lock(mutex_);
    const bool fresh = grants_.emplace(key, std::move(entry)).second;
    TH_REQUIRE(fresh, "transfer", key.transfer, "epoch", key.epoch, "is granted twice");
  }
  granted_.notify_all();
}

void DataServer::revoke(GrantKey key) {
  std::unique_lock lock(mutex_);
  auto found = grants_.find(key);
  if (found == grants_.end()) return;
  std::shared_ptr<Grant> grant = found->second;
  grants_.erase(found);
  revoked_.push_back(key);
  if (revoked_.size() > kRevokedRemembered) revoked_.pop_front();
  grant->revoked.store(true);
  grant->progress->wake_all();  // a read waiting for progress gives up now
  drained_.wait(lock, [&] { return grant->reads_in_flight == 0; });
}

DataServer::Stats DataServer::stats() const {
  std::lock_guard lock(mutex_);
  return stats_;
}

void DataServer::accept_loop() {
  while (!stopping_.load()) {
    Fd connection(::accept4(listener_.get(), nullptr, nullptr, SOCK_CLOEXEC));
    if (!connection.valid()) {
      if (stopping_.load()) return;
      continue;  // EINTR, ECONNABORTED, EMFILE: the listener itself is fine
    }
    std::lock_guard lock(mutex_);
    if (connections_ >= config_.connections_max) {
      std::cerr << "th data server: refusing a connection: " << connections_ << " open (limit "
                << config_.connections_max << ")\n";
      continue;  // closes it
    }
    ++connections_;
    open_connections_.push_back(connection.get());
    connection_threads_.emplace_back([this, socket = std::move(connection)]() mutable { serve(std::move(socket)); });
  }
}

void DataServer::serve(Fd connection) {
  set_io_timeout(connection, config_.io_timeout_ms);
  const int fd = connection.get();
  std::uint64_t refusals = 0;
  try {
    ReadRequestFrame request;
    while (!stopping_.load() && recv_all_or_eof(connection, &request, sizeof request)) {
      if (request.magic != kMagic) {
        std::cerr << "th data server: dropping a connection that does not speak the data protocol\n";
        break;
      }
      const GrantKey key{request.transfer, request.epoch};
      std::shared_ptr<Grant> grant;
      Status status = Status::kOk;
      {
        std::unique_lock lock(mutex_);
        auto found = grants_.find(key);
        if (found == grants_.end() && !revoked_recently(key)) {
          granted_.wait_for(lock, std::chrono::milliseconds(config_.grant_wait_ms_max), [&] {
            found = grants_.find(key);
            return found != grants_.end() || stopping_.load() || revoked_recently(key);
          });
        }
        if (found == grants_.end()) {
          status = Status::kNoGrant;
        } else if (request.region >= found->second->regions.size() ||
                   request.length > config_.response_bytes_max ||
                   request.offset > found->second->regions[request.region].bytes ||
                   request.length > found->second->regions[request.region].bytes - request.offset) {
          status = Status::kOutOfBounds;
        } else {
          grant = found->second;
          ++grant->reads_in_flight;
        }
        if (status != Status::kOk) ++stats_.reads_refused;
      }
      if (status != Status::kOk) {
        // One line per connection: a pipelined reader's whole burst is refused at once.
        if (refusals++ == 0) {
          std::cerr << "th data server: refused a read of transfer " << key.transfer << " epoch "
                  << key.epoch << " region " << request.region << " [" << request.offset << ", +"
                  << request.length << "): "
                  << (status == Status::kNoGrant ? "no grant" : "outside the exposed region")
                  << " (further refusals on this connection are counted, not logged)\n";
        }
        ReadResponseFrame refusal{static_cast<std::uint32_t>(status), 0, 0};
        send_all(connection, &refusal, sizeof refusal);
        continue;
      }
      // From here the grant's memory is pinned by reads_in_flight: revoke() waits for us.
      struct Release {
        DataServer* server;
        Grant* grant;
        ~Release() {
          std::lock_guard lock(server->mutex_);
          --grant->reads_in_flight;
          server->drained_.notify_all();
        }
      } release{this, grant.get()};
      const std::uint64_t begin = grant->starts[request.region] + request.offset;
      auto ready_after_begin = [&] {
        const std::uint64_t ready = grant->progress->ready_bytes();
        return ready > begin ? std::min(ready - begin, request.length) : 0;
      };
      std::uint64_t length = ready_after_begin();
      if (length == 0 && request.length > 0 && request.wait_for_bytes != 0) {
        grant->progress->wait_beyond(begin, config_.progress_wait_ms_max,
                                     [&] { return grant->revoked.load() || stopping_.load(); });
        length = grant->revoked.load() ? 0 : ready_after_begin();
      }
      if (grant->revoked.load()) {
        ReadResponseFrame refusal{static_cast<std::uint32_t>(Status::kNoGrant), 0, 0};
        send_all(connection, &refusal, sizeof refusal);
        continue;
      }
      ReadResponseFrame response{static_cast<std::uint32_t>(Status::kOk), 0, length};
      send_all(connection, &response, sizeof response);
      send_all(connection, grant->regions[request.region].base + request.offset, length);
      std::lock_guard lock(mutex_);
      stats_.bytes_served += length;
      ++stats_.reads_served;
    }
  } catch (const SocketError& error) {
    if (!stopping_.load()) std::cerr << "th data server: reader connection dropped: " << error.what() << "\n";
  }
  std::lock_guard lock(mutex_);
  --connections_;
  std::erase(open_connections_, fd);
}

// ---- Reader ----------------------------------------------------------------------------------------

namespace {

// One connection: targets[i] is the source's region first_region + i.
PullOutcome pull_stream(const Endpoint& source, GrantKey key, std::span<const LocalRegion> targets,
                        std::uint32_t first_region, const PullOptions& options) {
  PullOutcome outcome;
  auto fail = [&](ReadError error, std::string detail) {
    outcome.error = error;
    outcome.detail = "reading transfer " + std::to_string(key.transfer) + " epoch " +
                     std::to_string(key.epoch) + " from " + source.to_string() + ": " + std::move(detail);
    return outcome;
  };
  try {
    Fd connection = connect_tcp(source, options.connect_timeout_ms);
    set_io_timeout(connection, std::max(options.io_timeout_ms, 1));

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
    const auto pull_started = now();

    auto skip_empty_regions = [&] {
      while (region < targets.size() && offset == targets[region].bytes) {
        region_start += targets[region].bytes;
        ++region;
        offset = 0;
      }
    };
    skip_empty_regions();
    if (region == targets.size()) return outcome;  // nothing to pull
    for (;;) {
      while (in_flight.size() < depth && region < targets.size()) {
        const std::uint64_t length = std::min(options.chunk_bytes, targets[region].bytes - offset);
        ReadRequestFrame request{kMagic, key.epoch, key.transfer, first_region + region,
                                 wait_for_bytes ? 1u : 0u, offset, length};
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
      recv_all(connection, &response, sizeof response);
      if (response.status != static_cast<std::uint32_t>(Status::kOk)) {
        return fail(ReadError::kRefused, response.status == static_cast<std::uint32_t>(Status::kNoGrant)
                                             ? "the source holds no grant for it"
                                             : "outside the source's exposed regions");
      }
      if (response.length > ask.length) return fail(ReadError::kUnreachable, "the source sent too much");
      // In steps, telling on_progress as the prefix grows: this is the front request, so every
      // byte before it has arrived. (A whole 8 MiB chunk per step made each hop of a pipeline
      // chain trail its source by 67 ms at 1 Gbit/s.)
      for (std::uint64_t received = 0; received < response.length;) {
        const std::uint64_t step = std::min(options.progress_step_bytes, response.length - received);
        recv_all(connection, targets[ask.region].base + ask.offset + received, step);
        received += step;
        if (received < response.length && options.on_progress) {
          options.on_progress(ask.global_end - ask.length + received);
        }
      }
      outcome.bytes += response.length;
      if (options.rate_bytes_per_s > 0) {
        // Sleep until the bytes so far fit the rate since the pull began.
        const auto due = pull_started + std::chrono::microseconds(outcome.bytes * 1'000'000 / options.rate_bytes_per_s);
        std::this_thread::sleep_until(due);
      }
      if (response.length == ask.length) {
        ready = ask.global_end;
        if (options.on_progress && response.length > 0) options.on_progress(ready);
        last_progress = now();
        continue;
      }
      // A short answer: the source has no more yet. Drain what is in flight, then ask again from
      // the first missing byte, one request at a time.
      const std::uint64_t got_end = ask.global_end - ask.length + response.length;
      if (response.length > 0) {
        ready = got_end;
        if (options.on_progress) options.on_progress(ready);
        last_progress = now();
      } else if (now() - last_progress > std::chrono::milliseconds(options.stall_ms_max)) {
        return fail(ReadError::kStalled, "no progress for " + std::to_string(options.stall_ms_max) + " ms");
      }
      while (!in_flight.empty()) {
        const Ask later = in_flight.front();
        in_flight.pop_front();
        recv_all(connection, &response, sizeof response);
        if (response.status != static_cast<std::uint32_t>(Status::kOk)) {
          return fail(ReadError::kRefused, "the source refused a read it had granted");
        }
        if (response.length > later.length) return fail(ReadError::kUnreachable, "the source sent too much");
        recv_all(connection, targets[later.region].base + later.offset, response.length);
      }
      depth = 1;
      wait_for_bytes = true;
      region = ask.region;
      offset = ask.offset + response.length;
      region_start = ask.global_end - ask.offset - ask.length;
      skip_empty_regions();
    }
    TH_ASSERT(outcome.bytes >= ready);
    return outcome;
  } catch (const SocketError& error) {
    return fail(ReadError::kUnreachable, error.what());
  }
}

}  // namespace

PullOutcome pull(const Endpoint& source, GrantKey key, std::span<const LocalRegion> targets,
                 const PullOptions& options) {
  TH_REQUIRE(options.chunk_bytes > 0 && options.progress_step_bytes > 0 && options.depth > 0 && options.streams > 0 &&
             options.streams <= kPullStreamsMax);
  // A partial source is read in order on one connection: its ready prefix grows in order.
  if (options.streams == 1 || options.partial || targets.size() < 2) {
    return pull_stream(source, key, targets, 0, options);
  }
  // Several connections, each taking the next region nobody has claimed yet. The ready prefix
  // (for our own pipeline readers) is the run of finished regions from the first one.
  std::mutex mutex;
  std::vector<bool> finished(targets.size(), false);
  std::size_t prefix_regions = 0;
  std::uint64_t prefix_bytes = 0;
  std::atomic<std::size_t> next_region{0};
  std::atomic<bool> failed{false};
  PullOutcome total;
  PullOptions one = options;
  one.on_progress = nullptr;
  one.cancelled = [&] { return failed.load() || (options.cancelled && options.cancelled()); };
  auto stream = [&] {
    for (std::size_t region = next_region++; region < targets.size() && !failed.load(); region = next_region++) {
      PullOutcome part = pull_stream(source, key, targets.subspan(region, 1), static_cast<std::uint32_t>(region), one);
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
      const std::uint64_t before = prefix_bytes;
      while (prefix_regions < targets.size() && finished[prefix_regions]) {
        prefix_bytes += targets[prefix_regions++].bytes;
      }
      if (prefix_bytes > before && options.on_progress) options.on_progress(prefix_bytes);
    }
  };
  std::vector<std::thread> helpers;
  const std::size_t helper_count = std::min<std::size_t>(options.streams, targets.size()) - 1;
  for (std::size_t i = 0; i < helper_count; ++i) helpers.emplace_back(stream);
  stream();
  for (std::thread& helper : helpers) helper.join();
  return total;
}

}  // namespace th::net
