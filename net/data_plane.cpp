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
#include "net/ipc.h"

namespace th::net {
namespace {

// ---- Frames ----------------------------------------------------------------------------------------
// Fixed-size headers in the host's byte order: every TensorHub host is little-endian (x86-64,
// aarch64), and the static_assert below keeps it that way. Payload bytes follow a response header.

static_assert(std::endian::native == std::endian::little, "the data plane's frames are little-endian");

constexpr std::uint32_t kMagic = 0x32504454;  // "TDP2": requests carry the grant's secret

}  // namespace

// Outside the anonymous namespace: DataServer's private members name it.
struct ReadRequestFrame {
  std::uint32_t magic = kMagic;
  std::uint32_t epoch = 0;
  std::uint64_t transfer = 0;
  std::uint32_t region = 0;
  std::uint32_t wait_for_bytes = 0;  // 1: if nothing is ready yet, wait (bounded) for progress
  std::uint64_t offset = 0;
  std::uint64_t length = 0;
  GrantSecret secret{};  // the grant's capability, as the hub told it to the reader
};
static_assert(sizeof(ReadRequestFrame) == kDataRequestBytes);

namespace {

enum class Status : std::uint32_t { kOk = 0, kNoGrant = 1, kOutOfBounds = 2 };

// In a time that does not depend on where the secrets differ (a timing oracle would let a guesser
// find a secret word by word).
bool same_secret(const GrantSecret& a, const GrantSecret& b) {
  std::uint64_t differ = 0;
  for (std::size_t i = 0; i < a.size(); ++i) differ |= a[i] ^ b[i];
  return differ == 0;
}

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
  } catch (const SocketError& error) {
    log(std::string("could not send a refusal: ") + error.what());
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
  Status status = Status::kOk;
  {
    std::unique_lock lock(mutex_);
    const auto found = wait_for_grant(lock, key, grant_wait_left_ms);
    if (found == grants_.end() || !same_secret(found->second->secret, request.secret)) {
      // A wrong secret is answered as no grant: the answer tells a guesser nothing.
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
    log("refused a read of transfer " + std::to_string(key.transfer) + " epoch " + std::to_string(key.epoch) +
        " region " + std::to_string(request.region) + " [" + std::to_string(request.offset) + ", +" +
        std::to_string(request.length) + "): " +
        (status == Status::kNoGrant ? "no grant" : "outside the exposed region"));
    return refuse(self, static_cast<std::uint32_t>(status));
  }
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
  if (length == 0 && request.length > 0 && request.wait_for_bytes != 0) {
    grant->progress->wait_beyond(begin, config_.progress_wait_ms_max,
                                 [&] { return grant->revoked.load() || stopping_.load(); });
    length = ready_after_begin();
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
    return refuse(self, static_cast<std::uint32_t>(Status::kNoGrant));
  }
  TH_ASSERT(length <= request.length);
  // (Nothing ready yet at `begin`, which may lie beyond the ready prefix: an empty answer.)
  TH_ASSERT(length == 0 || begin + length <= grant->progress->ready_bytes(), "only ready bytes are sent");
  const ReadResponseFrame response{static_cast<std::uint32_t>(Status::kOk), 0, length};
  const Deadline deadline = response_deadline(config_, length);  // for the response as a whole
  try {
    send_all_by(self.socket, &response, sizeof response, deadline);
    if (!ring) {
      TH_ASSERT(!region.on_device || length == 0, "GPU memory is sent through a ring");
      send_all_by(self.socket, region.base + request.offset, length, deadline);
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
  std::uint32_t status = static_cast<std::uint32_t>(Status::kOk);
  std::shared_ptr<Grant> grant;
  {
    std::unique_lock lock(mutex_);
    const auto found = wait_for_grant(lock, key, grant_wait_left_ms);
    if (found == grants_.end() || !same_secret(found->second->secret, request.secret)) {
      status = static_cast<std::uint32_t>(Status::kNoGrant);
    } else if (request.regions > kIpcRegionsPerAnswerMax || request.first_region > found->second->regions.size() ||
               request.regions > found->second->regions.size() - request.first_region) {
      status = static_cast<std::uint32_t>(Status::kOutOfBounds);
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
    if (status == static_cast<std::uint32_t>(Status::kNoGrant) ||
        status == static_cast<std::uint32_t>(Status::kOutOfBounds)) {
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
  if (status == static_cast<std::uint32_t>(Status::kNoGrant) ||
      status == static_cast<std::uint32_t>(Status::kOutOfBounds)) {
    ++self.refusals;
    log("refused a request for the IPC handles of transfer " + std::to_string(key.transfer) + " epoch " +
        std::to_string(key.epoch) + ": " + (status == static_cast<std::uint32_t>(Status::kNoGrant) ? "no grant" : "out of bounds"));
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
    if (response.status == static_cast<std::uint32_t>(Status::kOk) && response.length == 0) return std::nullopt;
    if (response.status == static_cast<std::uint32_t>(Status::kNoGrant)) return ReadError::kRefused;
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
      if (response.status != static_cast<std::uint32_t>(Status::kOk)) {
        return fail(ReadError::kRefused, response.status == static_cast<std::uint32_t>(Status::kNoGrant)
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
        receive(connection, &response, sizeof response, options);
        if (response.status != static_cast<std::uint32_t>(Status::kOk)) {
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
    TH_ASSERT(outcome.bytes >= ready);
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
  // A partial source is read in order on one connection: its ready prefix grows in order.
  if (options.streams == 1 || options.partial || targets.size() < 2) {
    return pull_stream(source, key, secret, targets, first_region, options);
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
      PullOutcome part = pull_stream(source, key, secret, targets.subspan(region, 1),
                                     first_region + static_cast<std::uint32_t>(region), one);
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
  std::string ipc_fallback;
  if (options.ipc != nullptr && !options.partial) {
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
