#include "net/data_plane.h"

#include <sys/socket.h>
#include <sys/time.h>

#include <algorithm>
#include <array>
#include <bit>
#include <chrono>
#include <cstring>
#include <deque>
#include <iostream>
#include <system_error>
#include <type_traits>

#include "core/assert.h"
#include "net/data_frames.h"
#include "net/ipc.h"

namespace th::net {

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
    for (std::atomic<std::uint64_t>* word : mirrors_) word->store(ready_bytes, std::memory_order_release);
  }
  changed_.notify_all();
}

void Progress::add_mirror(std::atomic<std::uint64_t>* word) {
  TH_REQUIRE(word != nullptr);
  std::lock_guard lock(mutex_);
  word->store(ready_bytes_.load(std::memory_order_relaxed), std::memory_order_release);
  mirrors_.push_back(word);
}

void Progress::remove_mirror(std::atomic<std::uint64_t>* word) {
  std::lock_guard lock(mutex_);
  std::erase(mirrors_, word);
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

namespace {

using Clock = std::chrono::steady_clock;

// The kernel caps a listen backlog near this anyway (net.core.somaxconn).
constexpr std::uint32_t kListenBacklogMax = 4096;
// When accept fails for want of descriptors or memory the listener stays readable: the acceptor
// pauses this long instead of spinning (and lets finished connections give their descriptors back).
constexpr auto kAcceptBackoff = std::chrono::milliseconds(100);

// Host memory is handed to the kernel this much per send(): a reader's request is 8 MiB, and one
// send() of it filled the socket buffer with megabytes that left the cache before the reader
// copied them out, so every byte crossed memory twice more (bench/results/data-pair-2026-12-06.md:
// one stream over loopback, 1 MiB sends of distinct memory 3.0-3.6 GB/s, 8 MiB ones 2.1-2.5).
constexpr std::size_t kSendPieceBytesMax = std::size_t{1} << 20;

Deadline after_ms(int ms) { return Clock::now() + std::chrono::milliseconds(ms); }

// A response of `bytes` must be sent by then: a reader may be slow, but not slower than
// reader_bytes_per_s_min.
Deadline response_deadline(const DataServerConfig& config, std::uint64_t bytes) {
  const std::chrono::duration<double> drain(static_cast<double>(bytes) /
                                            static_cast<double>(config.reader_bytes_per_s_min));
  return after_ms(config.response_ms_base) + std::chrono::duration_cast<Clock::duration>(drain);
}

}  // namespace

class DataServer::Log {
 public:
  Log(int interval_ms, std::function<void(const std::string&)> sink)
      : interval_(std::chrono::milliseconds(interval_ms)), sink_(std::move(sink)) {}
  ~Log() {
    if (held_back_ > 0) write(std::to_string(held_back_) + " more lines were held back");
  }
  void line(const std::string& text) {
    std::lock_guard lock(mutex_);
    const auto now = Clock::now();
    if (written_ && now - *written_ < interval_) {
      ++held_back_;
      return;
    }
    write(held_back_ == 0 ? text
                          : text + " (and " + std::to_string(held_back_) + " lines held back since the last one)");
    held_back_ = 0;
    written_ = now;
  }

 private:
  void write(const std::string& text) const {
    if (sink_) {
      sink_(text);
    } else {
      std::cerr << ("th data server: " + text + "\n");  // one write per line
    }
  }

  const Clock::duration interval_;
  const std::function<void(const std::string&)> sink_;
  std::mutex mutex_;
  std::optional<Clock::time_point> written_;
  std::uint64_t held_back_ = 0;
};

struct DataServer::Grant {
  GrantSecret secret{};
  std::vector<ExposedRegion> regions;
  std::vector<std::uint64_t> starts;  // where each region begins in layout order
  std::shared_ptr<Progress> progress;
  std::uint32_t reads_in_flight = 0;  // guarded by DataServer::mutex_
  std::atomic<bool> revoked{false};
};

struct DataServer::Connection {
  Fd socket;           // set before the thread starts; closed when the thread is joined
  std::thread thread;
  // Guarded by DataServer::mutex_:
  bool idle = true;    // awaiting a request: may be dropped to make room
  Clock::time_point idle_since = Clock::now();
  const Grant* sending = nullptr;  // sending this grant's bytes: revoke() cuts the connection off
  bool dropped = false;   // shut down by the server: to make room, or because it stops
  bool finished = false;  // the thread has nothing left to do but exit: join it
  std::uint32_t refusals = 0;  // reads refused on this connection (its thread only)
};

DataServer::DataServer(DataServerConfig config)
    : config_(std::move(config)), log_(std::make_unique<Log>(config_.log_interval_ms, config_.log)) {
  TH_REQUIRE(config_.connections_max > 0);
  TH_REQUIRE(config_.progress_wait_ms_max > 0);
  TH_REQUIRE(config_.grant_wait_ms_max >= 0);
  TH_REQUIRE(config_.first_request_timeout_ms > 0);
  TH_REQUIRE(config_.idle_timeout_ms > 0);
  TH_REQUIRE(config_.response_ms_base > 0);
  TH_REQUIRE(config_.reader_bytes_per_s_min > 0);
  TH_REQUIRE(config_.response_bytes_max > 0);
  TH_REQUIRE(config_.log_interval_ms >= 0);
  TH_REQUIRE(config_.refusals_per_connection_max > 0);
  listener_ = listen_tcp(config_.listen, static_cast<int>(std::min(config_.connections_max, kListenBacklogMax)));
  endpoint_ = Endpoint{config_.listen.host, local_port(listener_)};
  acceptor_ = std::thread([this] { accept_loop(); });
}

DataServer::~DataServer() {
  {
    std::lock_guard lock(mutex_);
    stopping_.store(true);
    for (Connection& connection : connections_) {
      connection.dropped = true;
      connection.socket.shutdown();
    }
    for (auto& [key, grant] : grants_) {
      grant->revoked.store(true);
      grant->progress->wake_all();
    }
  }
  granted_.notify_all();
  wakeup_.signal();
  acceptor_.join();
  // Nobody adds or removes connections now, and every thread is ending: its socket is shut down.
  for (Connection& connection : connections_) connection.thread.join();
  connections_.clear();
}

void DataServer::log(const std::string& line) { log_->line(line); }

void DataServer::grant(GrantKey key, const GrantSecret& secret, std::vector<ExposedRegion> regions,
                       std::shared_ptr<Progress> progress) {
  TH_REQUIRE(progress != nullptr, "a grant needs a progress counter");
  auto entry = std::make_shared<Grant>();
  entry->secret = secret;
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
  grant->progress->wake_all();  // a read waiting for progress is refused now
  // A connection sending the grant's bytes is cut off: its send fails at once. Waiting for the
  // send to end instead would wait on the reader, as long as a slow or stopped one takes; and the
  // caller (the client's I/O thread) also sends the heartbeats that keep this source alive.
  for (const Connection& connection : connections_) {
    if (connection.sending == grant.get()) connection.socket.shutdown();
  }
  // No read of the memory starts or goes on once this returns. The wait is short: every thread
  // that pins the grant is now refusing, failing its send, or about to see `revoked` and refuse.
  drained_.wait(lock, [&] { return grant->reads_in_flight == 0; });
}

DataServer::Stats DataServer::stats() const {
  std::lock_guard lock(mutex_);
  Stats stats = stats_;
  stats.connections_open = static_cast<std::uint32_t>(connections_.size());
  stats.connections_idle = static_cast<std::uint32_t>(
      std::count_if(connections_.begin(), connections_.end(), [](const Connection& c) { return c.idle; }));
  return stats;
}

void DataServer::accept_loop() {
  Fd waiting;  // accepted while every slot was taken: waits for the slot of a connection dropped for it
  for (;;) {
    Readable ready;
    try {
      ready = wait_readable(waiting.valid() ? nullptr : &listener_, wakeup_.fd());
    } catch (const SocketError& error) {
      // poll() itself failed (out of memory): nothing to do but wait and look again. An exception
      // out of this thread would end the whole process (a trainer, with its job).
      log(std::string("waiting for connections: ") + error.what());
      std::this_thread::sleep_for(kAcceptBackoff);
      continue;
    }
    if (ready.second) wakeup_.clear();
    {
      std::lock_guard lock(mutex_);
      if (stopping_.load()) return;
      // Join the threads that finished, at once: an unjoined thread keeps its stack mapped (3,000
      // connections once took 25 GB of address space, and 34,000 the process, at vm.max_map_count).
      // Under the lock, because a finished thread never takes it again: this waits only for exits.
      for (auto it = connections_.begin(); it != connections_.end();) {
        if (!it->finished) {
          ++it;
          continue;
        }
        it->thread.join();
        it = connections_.erase(it);
      }
    }
    if (ready.first) {
      try {
        waiting = accept_tcp(listener_);
      } catch (const SocketError& error) {
        log(std::string("cannot accept a connection: ") + error.what());
        std::this_thread::sleep_for(kAcceptBackoff);
      }
    }
    if (waiting.valid()) admit(waiting);
  }
}

// Gives `waiting` a slot and a thread if one is free. If not, it drops the connection idle the
// longest (idle ones cost a slot and serve nobody) and keeps `waiting` until that one's thread is
// joined; it refuses `waiting` only when every connection is busy serving a read.
void DataServer::admit(Fd& waiting) {
  std::lock_guard lock(mutex_);
  if (stopping_.load()) {
    waiting = Fd();
    return;
  }
  TH_ASSERT(connections_.size() <= config_.connections_max, connections_.size(), "connections open");
  if (connections_.size() < config_.connections_max) {
    Connection& connection = connections_.emplace_back();
    connection.socket = std::move(waiting);
    try {
      connection.thread = std::thread([this, &connection] { serve(connection); });
    } catch (const std::system_error& error) {
      connections_.pop_back();  // closes it: the reader sees its connection fail
      log(std::string("refused a connection: cannot start its thread: ") + error.what());
    }
    return;
  }
  Connection* victim = nullptr;
  for (Connection& connection : connections_) {
    // One dropped already, or finished and not yet joined: its slot is coming (the thread ends as
    // soon as it wakes, and wakes this loop when it does).
    if (connection.dropped || connection.finished) return;
    if (connection.idle && !connection.finished && (victim == nullptr || connection.idle_since < victim->idle_since)) {
      victim = &connection;
    }
  }
  if (victim == nullptr) {
    log("refused a connection: all " + std::to_string(connections_.size()) +
        " are busy with reads (connections_max)");
    waiting = Fd();
    return;
  }
  victim->dropped = true;
  victim->socket.shutdown();
  ++stats_.connections_dropped;
  log("dropped the connection idle the longest to make room: " + std::to_string(connections_.size()) +
      " open (connections_max)");
}

void DataServer::serve(Connection& self) {
  int grant_wait_left_ms = config_.grant_wait_ms_max;
  std::string ended;  // why the server ends the connection, for the log; empty: the reader hung up
  try {
    for (bool first = true;; first = false) {
      ReadRequestFrame request;
      // The whole request must come by the deadline: a reader cannot keep a silent connection
      // alive by sending a byte now and then.
      const int timeout_ms = first ? config_.first_request_timeout_ms : config_.idle_timeout_ms;
      try {
        if (!recv_all_or_eof_by(self.socket, &request, sizeof request, after_ms(timeout_ms))) break;
      } catch (const SocketTimeout&) {
        ended = first ? "no request within first_request_timeout_ms" : "idle for idle_timeout_ms";
        std::lock_guard lock(mutex_);
        ++stats_.connections_dropped;
        break;
      }
      {
        std::lock_guard lock(mutex_);
        if (self.dropped) break;  // to make room, or the server stops: the request goes unanswered
        self.idle = false;
      }
      if (request.magic == kIpcMagic) {
        // (The same request, reinterpreted: IpcRequestFrame has the layout of the data frame.)
        if (!answer_ipc(self, request, grant_wait_left_ms)) break;
      } else if (request.magic != kMagic) {
        if (first && config_.extension != nullptr && request.magic == config_.extension->magic()) {
          ended = serve_extension(self, request);
        } else {
          ended = "it does not speak the data protocol";
          const ReadResponseFrame unknown{kUnknownProtocolStatus, 0, 0};
          try {
            send_all_by(self.socket, &unknown, sizeof unknown, after_ms(100));
          } catch (const SocketError&) {
            // It learns the same from the close.
          }
        }
        break;
      } else if (!answer(self, request, grant_wait_left_ms)) {
        break;
      }
      if (self.refusals >= config_.refusals_per_connection_max) {
        // A reader is refused once when its grant ends (its reads in flight, a few); a guesser of
        // secrets is refused for ever, each refusal costing this thread and holding its slot.
        ended = "refused " + std::to_string(self.refusals) + " reads";
        break;
      }
      std::lock_guard lock(mutex_);
      self.idle = true;
      self.idle_since = Clock::now();
    }
  } catch (const SocketError& error) {
    ended = error.what();
  }
  bool quiet = false;
  {
    std::lock_guard lock(mutex_);
    TH_ASSERT(self.sending == nullptr, "a finished connection sends nothing");
    quiet = self.dropped;  // the server shut it down: the reader's failure says nothing new
    self.idle = false;
    self.finished = true;
  }
  if (!ended.empty() && !quiet) log("closed a reader connection: " + ended);
  wakeup_.signal();  // the acceptor joins this thread
}

// The connection as a DataPortExtension sees it.
class DataServer::ExtensionConnection final : public DataConnection {
 public:
  ExtensionConnection(DataServer& server, Connection& self) : server_(server), self_(self) {}
  void set_idle(bool idle) override {
    std::lock_guard lock(server_.mutex_);
    self_.idle = idle;
    if (idle) self_.idle_since = Clock::now();
  }
  bool dropped() const override {
    std::lock_guard lock(server_.mutex_);
    return self_.dropped || server_.stopping_.load();
  }

 private:
  DataServer& server_;
  Connection& self_;
};

std::string DataServer::serve_extension(Connection& self, const ReadRequestFrame& first) {
  ExtensionConnection connection(*this, self);
  std::array<std::byte, kDataRequestBytes> frame;
  std::memcpy(frame.data(), &first, frame.size());
  return config_.extension->serve(self.socket, frame, connection);
}

bool DataServer::refuse(Connection& self, std::uint32_t status) {
  ++self.refusals;
  const ReadResponseFrame refusal{status, 0, 0};
  try {
    send_all_by(self.socket, &refusal, sizeof refusal, response_deadline(config_, 0));
    return true;
  } catch (const SocketError&) {
    // The reader hung up, as a reader does at its first refusal with more requests in flight: the
    // refusal was logged (or, for a grant just revoked, deliberately not) before.
    return false;
  }
}

// The grant of `key`, waiting for it if it is not here yet (see grant_wait_ms_max); grants_.end()
// if it did not come. `lock` holds mutex_.
std::map<GrantKey, std::shared_ptr<DataServer::Grant>>::iterator DataServer::wait_for_grant(
    std::unique_lock<std::mutex>& lock, GrantKey key, int& grant_wait_left_ms) {
  TH_ASSERT(lock.owns_lock());
  auto found = grants_.find(key);
  if (found == grants_.end() && !revoked_recently(key) && grant_wait_left_ms > 0 &&
      grant_waiters_ < config_.grant_waiters_max) {
    ++grant_waiters_;
    // The connection is busy meanwhile (it cannot be dropped to make room), so the wait is
    // bounded per connection, not per request: a burst of requests for a grant that never
    // comes cannot hold this thread for grant_wait_ms_max each.
    const auto began = Clock::now();
    const bool arrived = granted_.wait_for(lock, std::chrono::milliseconds(grant_wait_left_ms), [&] {
      found = grants_.find(key);
      return found != grants_.end() || stopping_.load() || revoked_recently(key);
    });
    const auto waited = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - began);
    grant_wait_left_ms = arrived ? std::max(0, grant_wait_left_ms - static_cast<int>(waited.count())) : 0;
    --grant_waiters_;
  }
  return found;
}

// Answers one request; false: the connection is to end (a send failed or was cut off).
bool DataServer::answer(Connection& self, const ReadRequestFrame& request, int& grant_wait_left_ms) {
  const GrantKey key{request.transfer, request.epoch};
  std::shared_ptr<Grant> grant;
  FrameStatus status = FrameStatus::kOk;
  bool revoked_grant = false;  // one this source had: the hub moved the read, and the reader races it
  {
    std::unique_lock lock(mutex_);
    const auto found = wait_for_grant(lock, key, grant_wait_left_ms);
    if (found == grants_.end() || !same_secret(found->second->secret, request.secret)) {
      // A wrong secret is answered as no grant: the answer tells a guesser nothing.
      status = FrameStatus::kNoGrant;
    } else if (request.region >= found->second->regions.size() ||
               request.length > config_.response_bytes_max ||
               request.offset > found->second->regions[request.region].bytes ||
               request.length > found->second->regions[request.region].bytes - request.offset) {
      status = FrameStatus::kOutOfBounds;
    } else {
      grant = found->second;
      ++grant->reads_in_flight;
    }
    if (status != FrameStatus::kOk) ++stats_.reads_refused;
    revoked_grant = status == FrameStatus::kNoGrant && revoked_recently(key);
  }
  // A read of a grant revoked a moment ago is the ordinary race of a read the hub moved (the
  // reader had not heard yet): counted, not logged. Any other refusal is a reader's bug, a stale
  // instruction, or a guesser, and is logged.
  if (status != FrameStatus::kOk && !revoked_grant) {
    log("refused a read of transfer " + std::to_string(key.transfer) + " epoch " + std::to_string(key.epoch) +
        " region " + std::to_string(request.region) + " [" + std::to_string(request.offset) + ", +" +
        std::to_string(request.length) + "): " +
        (status == FrameStatus::kNoGrant ? "no grant" : "outside the exposed region"));
  }
  if (status != FrameStatus::kOk) return refuse(self, static_cast<std::uint32_t>(status));
  // From here the grant's memory is pinned by reads_in_flight: revoke() waits until it is let go.
  // It is let go before any send that revoke() would not cut off: revoke() never waits on a reader.
  struct Pin {
    DataServer* server;
    Connection* self;
    Grant* grant;
    bool held = true;
    void release() {
      if (!held) return;
      held = false;
      std::lock_guard lock(server->mutex_);
      TH_ASSERT(grant->reads_in_flight > 0);
      --grant->reads_in_flight;
      self->sending = nullptr;
      server->drained_.notify_all();
    }
    ~Pin() { release(); }
  } pin{this, &self, grant.get()};
  const std::uint64_t begin = grant->starts[request.region] + request.offset;
  auto ready_after_begin = [&] {
    const std::uint64_t ready = grant->progress->ready_bytes();
    return ready > begin ? std::min(ready - begin, request.length) : 0;
  };
  std::uint64_t length = ready_after_begin();
  bool advanced = false;  // while nothing was ready at `begin`
  if (length == 0 && request.length > 0 && request.wait_for_bytes != 0) {
    const std::uint64_t ready_before = grant->progress->ready_bytes();
    grant->progress->wait_beyond(begin, config_.progress_wait_ms_max,
                                 [&] { return grant->revoked.load() || stopping_.load(); });
    length = ready_after_begin();
    advanced = grant->progress->ready_bytes() > ready_before;
  }
  // GPU memory goes out through a staging ring, borrowed before the answer begins. Waiting for one
  // holds the pin, so the wait ends as soon as revoke() marks the grant (revoke waits for pins).
  const ExposedRegion& region = grant->regions[request.region];
  StagingPool::Loan ring;
  if (region.on_device && length > 0) {
    TH_ASSERT(config_.staging != nullptr, "GPU memory is granted only by a server that can stage it");
    try {
      ring = config_.staging->borrow([&] { return grant->revoked.load() || stopping_.load(); });
    } catch (const DeviceCopyError& error) {
      pin.release();
      log("could not stage a read of transfer " + std::to_string(key.transfer) + " epoch " +
          std::to_string(key.epoch) + " (" + std::to_string(length) + " bytes of GPU memory): " + error.what());
      return false;
    }
    if (!ring && !grant->revoked.load()) {
      pin.release();
      return false;  // the server stops
    }
  }
  bool revoked = false;
  {
    // Either revoke() has marked the grant (and we refuse), or it will find us sending and cut us
    // off: it marks the grant and looks for senders under this same lock.
    std::lock_guard lock(mutex_);
    revoked = grant->revoked.load();
    if (!revoked) self.sending = grant.get();
  }
  if (revoked) {
    pin.release();
    return refuse(self, static_cast<std::uint32_t>(FrameStatus::kNoGrant));
  }
  TH_ASSERT(length <= request.length);
  // (Nothing ready yet at `begin`, which may lie beyond the ready prefix: an empty answer.)
  TH_ASSERT(length == 0 || begin + length <= grant->progress->ready_bytes(), "only ready bytes are sent");
  const ReadResponseFrame response{static_cast<std::uint32_t>(FrameStatus::kOk),
                                   length == 0 && advanced ? kSourceAdvanced : 0u, length};
  const Deadline deadline = response_deadline(config_, length);  // for the response as a whole
  try {
    send_all_by(self.socket, &response, sizeof response, deadline);
    if (!ring) {
      TH_ASSERT(!region.on_device || length == 0, "GPU memory is sent through a ring");
      for (std::uint64_t sent = 0; sent < length;) {
        const std::size_t piece = static_cast<std::size_t>(std::min<std::uint64_t>(kSendPieceBytesMax, length - sent));
        send_all_by(self.socket, region.base + request.offset + sent, piece, deadline);
        sent += piece;
      }
    } else {
      ring->drain(region.base + request.offset, length, [&](std::span<const std::byte> piece) {
        send_all_by(self.socket, piece.data(), piece.size(), deadline);
      });
    }
  } catch (const DeviceCopyError& error) {
    // (drain() waited for its copies: the device memory is let go with the pin.)
    pin.release();
    {
      std::lock_guard lock(mutex_);
      ++stats_.reads_cut_off;
    }
    log("cut off a read of transfer " + std::to_string(key.transfer) + " epoch " + std::to_string(key.epoch) +
        " (" + std::to_string(length) + " bytes of GPU memory): " + error.what());
    return false;
  } catch (const SocketError& error) {
    revoked = grant->revoked.load();
    pin.release();
    {
      std::lock_guard lock(mutex_);
      ++stats_.reads_cut_off;
    }
    if (!revoked) {  // a cut by revoke() is business as usual
      log("cut off a read of transfer " + std::to_string(key.transfer) + " epoch " + std::to_string(key.epoch) +
          " (" + std::to_string(length) + " bytes): " + error.what());
    }
    return false;
  }
  pin.release();
  std::lock_guard lock(mutex_);
  stats_.bytes_served += length;
  ++stats_.reads_served;
  return true;
}

// Answers a request for the CUDA IPC handles of a page of a grant's regions (net/ipc.h); false:
// the connection is to end. The grant is looked up and its secret checked as for a read.
bool DataServer::answer_ipc(Connection& self, const ReadRequestFrame& raw, int& grant_wait_left_ms) {
  static_assert(sizeof(IpcRequestFrame) == sizeof(ReadRequestFrame));
  IpcRequestFrame request;
  static_assert(std::is_trivially_copyable_v<IpcRequestFrame>);
  std::memcpy(static_cast<void*>(&request), &raw, sizeof request);
  const GrantKey key{request.transfer, request.epoch};
  std::uint32_t status = static_cast<std::uint32_t>(FrameStatus::kOk);
  std::shared_ptr<Grant> grant;
  {
    std::unique_lock lock(mutex_);
    const auto found = wait_for_grant(lock, key, grant_wait_left_ms);
    if (found == grants_.end() || !same_secret(found->second->secret, request.secret)) {
      status = static_cast<std::uint32_t>(FrameStatus::kNoGrant);
    } else if (request.regions > kIpcRegionsPerAnswerMax || request.first_region > found->second->regions.size() ||
               request.regions > found->second->regions.size() - request.first_region) {
      status = static_cast<std::uint32_t>(FrameStatus::kOutOfBounds);
    } else if (config_.ipc == nullptr ||
               found->second->progress->ready_bytes() <
                   (found->second->regions.empty() ? 0 : found->second->starts.back() + found->second->regions.back().bytes)) {
      // A partial source's memory is still being written: its readers follow its progress over TCP.
      status = kIpcUnsupported;
    } else {
      // Pinned while the handles are made: the owner cannot free the memory (and a new allocation
      // take its address) before revoke() returns, and revoke() waits for this.
      grant = found->second;
      ++grant->reads_in_flight;
    }
    if (status == static_cast<std::uint32_t>(FrameStatus::kNoGrant) ||
        status == static_cast<std::uint32_t>(FrameStatus::kOutOfBounds)) {
      ++stats_.reads_refused;
    }
  }
  IpcAnswerFrame answer{status, 0, 0, 0, 0, {}};
  std::vector<IpcRegionRecord> records;
  if (grant != nullptr) {
    // Let go of the pin however this ends (an allocation failure here must not leave revoke()
    // waiting for ever).
    struct Unpin {
      DataServer* server;
      Grant* grant;
      ~Unpin() {
        std::lock_guard lock(server->mutex_);
        TH_ASSERT(grant->reads_in_flight > 0);
        --grant->reads_in_flight;
        server->drained_.notify_all();
      }
    } unpin{this, grant.get()};
    answer = ipc_detail::answer_header(*config_.ipc);
    answer.count = request.regions;
    answer.grant_regions = static_cast<std::uint32_t>(grant->regions.size());
    records = ipc_detail::export_records(
        *config_.ipc, std::span<const ExposedRegion>(grant->regions).subspan(request.first_region, request.regions));
  }
  TH_ASSERT(records.size() == answer.count);
  if (status == static_cast<std::uint32_t>(FrameStatus::kNoGrant) ||
      status == static_cast<std::uint32_t>(FrameStatus::kOutOfBounds)) {
    ++self.refusals;
    log("refused a request for the IPC handles of transfer " + std::to_string(key.transfer) + " epoch " +
        std::to_string(key.epoch) + ": " + (status == static_cast<std::uint32_t>(FrameStatus::kNoGrant) ? "no grant" : "out of bounds"));
  }
  const std::uint64_t bytes = sizeof answer + records.size() * sizeof(IpcRegionRecord);
  try {
    const Deadline deadline = response_deadline(config_, bytes);
    send_all_by(self.socket, &answer, sizeof answer, deadline);
    send_all_by(self.socket, records.data(), records.size() * sizeof(IpcRegionRecord), deadline);
  } catch (const SocketError& error) {
    log(std::string("could not send IPC handles: ") + error.what());
    return false;
  }
  if (grant != nullptr) {
    std::lock_guard lock(mutex_);
    ++stats_.ipc_answers;
  }
  return true;
}

}  // namespace th::net
