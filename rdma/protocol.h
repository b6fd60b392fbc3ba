// rdma/'s own: the frames a reader and a source exchange on the data port's TCP connection (see
// transport.h for the exchange), and the state the transport shares with the connection threads of
// its data server. Included by transport.cpp, served_link.cpp and reader.cpp only.
#pragma once

#include <poll.h>
#include <sys/socket.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <iostream>
#include <map>
#include <mutex>
#include <thread>

#include "core/assert.h"
#include "rdma/transport.h"
#include "rdma/verbs.h"

namespace th::rdma {

using Clock = std::chrono::steady_clock;
using net::Deadline;

inline Deadline after_ms(int ms) { return Clock::now() + std::chrono::milliseconds(ms); }

// ---- Frames on the data port ------------------------------------------------------------------
// Requests are kDataRequestBytes long and begin with kMagic, like the TCP data plane's (its server
// hands a connection whose first request carries this magic to this file). Little-endian, as the
// TCP frames (net/data_frames.h asserts the host's order).

constexpr std::uint32_t kMagic = 0x31524454;  // "TDR1"
constexpr std::uint32_t kProtocolVersion = 2;  // 2: the hello carries the rail and the read depth

enum class Kind : std::uint32_t { kHello = 1, kOpen = 2, kClose = 3 };
enum class Answer : std::uint32_t { kOk = 0, kNoGrant = 1, kUnsupported = 2, kBusy = 3 };

struct Request {
  std::uint32_t magic = kMagic;
  Kind kind = Kind::kHello;
  // kHello
  std::uint32_t version = kProtocolVersion;
  std::uint32_t qp_number = 0;
  std::uint32_t packet_sequence = 0;
  std::uint16_t lid = 0;
  std::uint8_t mtu = 0;
  std::uint8_t rail = 0;  // the reader's device index: the source answers from its device of that index
  Gid gid{};
  // kOpen, kClose
  std::uint32_t epoch = 0;
  std::uint32_t read_atoms = 0;  // kHello: READs the reader's queue pair takes outstanding
  std::uint64_t transfer = 0;
};
static_assert(sizeof(Request) == 56);
static_assert(sizeof(Request) == net::kDataRequestBytes);
// An open request carries the grant's secret where a hello carries its GID (16 bytes either way).
static_assert(sizeof(GrantSecret) == sizeof(Gid));

struct HelloAnswer {
  Answer status = Answer::kOk;
  std::uint32_t version = kProtocolVersion;
  std::uint32_t qp_number = 0;
  std::uint32_t packet_sequence = 0;
  std::uint16_t lid = 0;
  std::uint8_t mtu = 0;
  std::uint8_t read_atoms = 0;  // READs the source's queue pair takes outstanding
  std::uint32_t reserved1 = 0;
  Gid gid{};
};
static_assert(sizeof(HelloAnswer) == 40);

struct OpenAnswer {
  Answer status = Answer::kOk;
  std::uint32_t regions = 0;  // RemoteRegion entries that follow
  std::uint64_t total_bytes = 0;
  std::uint64_t progress_address = 0;  // the grant's ready-bytes word
  std::uint32_t progress_key = 0;
  std::uint32_t reserved = 0;
};
static_assert(sizeof(OpenAnswer) == 32);

struct RemoteRegion {
  std::uint64_t address = 0;
  std::uint64_t bytes = 0;
  std::uint32_t key = 0;
  std::uint32_t reserved = 0;
};
static_assert(sizeof(RemoteRegion) == 24);

// Unasked, from the source to a reader on its link: "the grant you opened here is revoked" (its
// windows are gone already; this only tells the reader at once instead of at its next READ's
// error, which a soft-RoCE device may take its retry timeout to report).
constexpr std::uint32_t kNoticeMagic = 0x4e524454;  // "TDRN"; an answer's first word is a status (small)
struct RevokedNotice {
  std::uint32_t magic = kNoticeMagic;
  std::uint32_t epoch = 0;
  std::uint64_t transfer = 0;
};
static_assert(sizeof(RevokedNotice) == 16);

inline GrantSecret secret_of(const Request& request) {
  GrantSecret secret;
  std::memcpy(secret.data(), request.gid.data(), sizeof secret);
  return secret;
}

inline bool same_secret(const GrantSecret& a, const GrantSecret& b) {
  std::uint64_t differ = 0;  // constant time: no oracle for where the secrets differ
  for (std::size_t i = 0; i < a.size(); ++i) differ |= a[i] ^ b[i];
  return differ == 0;
}

inline QueuePairAddress address_of(const Request& hello) {
  return {hello.qp_number, hello.packet_sequence, hello.lid, hello.mtu, hello.gid,
          static_cast<std::uint8_t>(std::clamp<std::uint32_t>(hello.read_atoms, 1, 255))};
}

inline std::uint32_t first_packet_sequence() {
  // Any 24-bit start works; a fresh one per queue pair keeps a stale packet of an old pair with the
  // same number from being taken for a new one's.
  static std::atomic<std::uint32_t> counter{static_cast<std::uint32_t>(Clock::now().time_since_epoch().count())};
  return (counter.fetch_add(0x9e3779b9u) >> 8) & 0xffffff;
}

// How memory is registered. With memory windows the registration itself grants no remote access:
// any connected queue pair (a hello needs no secret) could otherwise read a whole registration
// with its key, which is small and often guessable; only a window bound for one grant to one
// reader's queue pair can be read through. Without windows, the registration must be readable.
inline int register_access(bool windows) {
  return windows ? IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_MW_BIND : IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_READ;
}

// A line of the RDMA data plane: to the options' log (libthclient's hook), else to stderr.
inline void log_line(const RdmaOptions& options, const std::string& line) {
  if (options.log) return options.log(line);
  std::cerr << ("th rdma: " + line + "\n");  // one write per line
}


// ---- Shared state ------------------------------------------------------------------------------

struct RdmaTransport::State {
  // Opens the devices (throws VerbsError when there is none).
  explicit State(RdmaOptions options_in);

  const RdmaOptions options;
  // The grants' ready-byte counters, exposed to one-sided reads (one registration per port).
  std::unique_ptr<std::atomic<std::uint64_t>[]> progress_words;
  // One opened device: this process's end of rail i (its index). Declared before everything that
  // holds verbs objects of it, so that they are destroyed first.
  struct Port {
    Port(const std::string& name, int gid_index) : device(name, gid_index) {}
    Device device;
    bool windows = false;  // grants are exposed through memory windows (the device has them, and they are on)
    std::unique_ptr<MemoryRegion> progress_region;  // progress_words, registered on this device
    std::atomic<std::uint64_t> bytes_read{0};       // pulled through this device
  };
  static constexpr std::size_t kPortsMax = 8;
  std::vector<std::unique_ptr<Port>> ports;
  // -- GPU memory (rdma/device_memory.h): how it is registered, and the registrations of leased
  // CUDA allocations (null without options.device_memory). After `ports`: destroyed first.
  GpuRegistrationChoice gpu;
  std::unique_ptr<AllocationRegistry<MemoryRegion>> device_allocations;
  int grant_wait_ms_max = 0;      // the data server's: an open may wait this long for its grant
  std::uint32_t grant_waiters_max = 0;  // and this many opens at once (a waiting link cannot be shed)
  std::uint32_t grant_waiters = 0;      // guarded by mutex

  std::atomic<std::uint64_t> pulls_rdma{0};
  std::atomic<std::uint64_t> pulls_striped{0};
  std::atomic<std::uint64_t> pulls_tcp{0};
  std::atomic<std::uint64_t> pulls_fell_back{0};
  std::atomic<std::uint64_t> registrations{0};
  std::atomic<std::uint64_t> windows_bound{0};
  std::atomic<std::uint64_t> windows_invalidated{0};

  // -- Registrations (see lease_memory) --
  std::mutex registrations_mutex;
  std::multimap<std::uintptr_t, std::uint64_t> leased;  // begin -> bytes
  std::uint64_t leases_ended = 0;  // counts release_lease calls (a registration made meanwhile may be stale)
  struct Cached {
    std::size_t port = 0;
    std::uintptr_t begin = 0;
    std::uintptr_t end = 0;
    std::shared_ptr<MemoryRegion> region;
  };
  std::vector<Cached> cached;

  std::shared_ptr<MemoryRegion> register_memory(std::size_t port, void* base, std::uint64_t bytes) {
    ++registrations;
    const Port& on = *ports.at(port);
    return std::make_shared<MemoryRegion>(on.device, base, bytes, register_access(on.windows));
  }

  // A registration on `port` covering [base, +bytes): the cached one of its leased run, else a new
  // one of that run (cached), else (memory never leased) one of exactly this range, kept by the
  // caller alone. Registering pins pages (seconds for tens of GB): done outside the lock, which
  // lease_memory() on the client's I/O thread also takes. Throws VerbsError.
  std::shared_ptr<MemoryRegion> region_for(std::size_t port, const std::byte* base, std::uint64_t bytes) {
    TH_REQUIRE(bytes > 0);
    TH_REQUIRE(port < ports.size());
    const auto begin = reinterpret_cast<std::uintptr_t>(base);
    std::uintptr_t run_begin = 0;
    std::uintptr_t run_end = 0;
    std::uint64_t ended_before = 0;
    {
      std::lock_guard lock(registrations_mutex);
      ended_before = leases_ended;
      for (const Cached& entry : cached) {
        if (entry.port == port && entry.region->covers(begin, bytes)) return entry.region;
      }
      // The run of touching leases around `begin`.
      for (const auto& [lease_begin, lease_bytes] : leased) {
        const std::uintptr_t lease_end = lease_begin + lease_bytes;
        if (run_end != 0 && lease_begin <= run_end) {
          run_end = std::max(run_end, lease_end);
          continue;
        }
        if (run_end != 0 && run_begin <= begin && begin + bytes <= run_end) break;  // found it
        run_begin = lease_begin;
        run_end = lease_end;
      }
    }
    if (run_end == 0 || begin < run_begin || begin + bytes > run_end) {
      return register_memory(port, const_cast<std::byte*>(base), bytes);
    }
    auto region = register_memory(port, reinterpret_cast<void*>(run_begin), run_end - run_begin);
    std::lock_guard lock(registrations_mutex);
    // Cached only if no lease ended meanwhile (one of the run's may have been freed and its address
    // leased again: this registration would pin the old pages) and nobody cached one first. Either
    // way the caller may use it for what it asked: that memory was leased when it asked.
    const bool raced = std::any_of(cached.begin(), cached.end(), [&](const Cached& entry) {
      return entry.port == port && entry.region->covers(begin, bytes);
    });
    if (leases_ended == ended_before && !raced) cached.push_back({port, run_begin, run_end, region});
    return region;
  }

  // A registration on `port` of the GPU allocation around [base, +bytes): the leased allocation's,
  // else one for this caller alone. A failed registration was logged when it failed (and a leased
  // allocation's failure is remembered until its lease ends); a bad pointer (kInvalidArgument) is
  // the caller's to log. An error means this memory cannot be read or written by RDMA
  // here: the grant is answered "unsupported", the pull goes over TCP (staged through host memory).
  // Registering may take a while: called on connection threads and pulls, never under a lock.
  Result<std::shared_ptr<MemoryRegion>> device_region_for(std::size_t port, const std::byte* base, std::uint64_t bytes) {
    TH_REQUIRE(bytes > 0);
    TH_REQUIRE(port < ports.size());
    if (device_allocations == nullptr) {
      return make_error(Errc::kUnavailable, "GPU memory is not registered: the transport has no CUDA driver "
                                            "(RdmaOptions::device_memory)");
    }
    if (!ports[port]->windows) {
      // A GPU registration covers the whole CUDA allocation (a PyTorch segment: activations, KV
      // cache, weights not published). Without windows a peer reads through the registration's
      // own key, for as long as it lives: staging over TCP exposes only the granted bytes.
      return make_error(Errc::kUnavailable, "GPU memory is registered with the NIC only where it has memory "
                                            "windows: staged through host memory over TCP instead");
    }
    return device_allocations->registration(port, base, bytes);
  }

  // Ends a lease: every cached registration that covers any of it goes, deregistered after the lock
  // is let go (grants holding one keep it until they are revoked; the owner revokes before it frees).
  void release_lease(std::uintptr_t begin, std::uint64_t bytes) {
    std::vector<Cached> dropped;
    {
      std::lock_guard lock(registrations_mutex);
      ++leases_ended;
      for (auto it = leased.lower_bound(begin); it != leased.end() && it->first == begin; ++it) {
        if (it->second == bytes) {
          leased.erase(it);
          break;
        }
      }
      for (auto it = cached.begin(); it != cached.end();) {
        if (it->begin < begin + bytes && begin < it->end) {
          dropped.push_back(std::move(*it));
          it = cached.erase(it);
        } else {
          ++it;
        }
      }
    }
  }

  std::vector<std::uint32_t> free_progress_slots;  // of progress_words; guarded by mutex

  // -- Source side --
  struct Window {
    std::uint64_t link = 0;  // the served link whose queue pair it is bound to
    std::unique_ptr<MemoryWindow> window;
  };
  struct Grant {
    GrantSecret secret{};
    std::vector<net::ExposedRegion> regions;
    std::uint64_t total_bytes = 0;
    std::shared_ptr<net::Progress> progress;
    std::optional<std::uint32_t> slot;
    std::mutex registering;  // the first open on a port registers (outside the state's lock)
    // Per port, per region, once registered (ports.size() entries, empty until the first open).
    std::vector<std::vector<std::shared_ptr<MemoryRegion>>> registrations;
    std::vector<std::uint64_t> opened_on;  // links that opened it (revoke tells them); State::mutex
    std::uint32_t opening = 0;    // opens registering or binding for it now; guarded by State::mutex
    std::vector<Window> windows;  // guarded by State::mutex; declared last: dies first
    bool revoked = false;         // guarded by State::mutex
  };
  std::mutex mutex;
  std::condition_variable granted;
  std::condition_variable opened;  // an open let go of its grant (revoke waits for them)
  std::map<net::GrantKey, std::shared_ptr<Grant>> grants;
  // Grants revoked lately: an open of one is refused at once, not after grant_wait_ms_max.
  static constexpr std::size_t kRevokedRemembered = 1024;
  std::deque<net::GrantKey> revoked;
  bool revoked_recently(net::GrantKey key) const { return std::find(revoked.begin(), revoked.end(), key) != revoked.end(); }
  std::uint64_t next_link = 1;
  // Per served link, its socket for writing: answers (the connection thread) and revoked notices
  // (revoke(), any thread) are whole frames under `mutex`.
  struct Notifier {
    std::mutex mutex;
    const net::Fd* socket = nullptr;  // null once the link ends
    net::Wakeup wakeup;  // revoke() wakes the link to look whether it is still busy
  };
  std::map<std::uint64_t, std::shared_ptr<Notifier>> notifiers;  // guarded by State::mutex
  std::map<std::uint64_t, std::size_t> link_ports;  // served link -> its port; guarded by State::mutex

  // Deallocates the windows of `grant` bound on `link` (0: all): a read through them fails now.
  void invalidate_windows(Grant& grant, std::uint64_t link) {
    const auto before = grant.windows.size();
    std::erase_if(grant.windows, [&](const Window& window) { return link == 0 || window.link == link; });
    windows_invalidated += before - grant.windows.size();
  }

  void end_grant(Grant& grant) {
    invalidate_windows(grant, 0);
    grant.revoked = true;
    if (grant.slot) {
      grant.progress->remove_mirror(&progress_words[*grant.slot]);
      free_progress_slots.push_back(*grant.slot);
      grant.slot.reset();
    }
    grant.progress->wake_all();
  }

  // -- Reader side --
  struct Link {
    std::string source;
    std::size_t port = 0;  // the rail: this device and the source's device of the same index
    net::Fd socket;
    std::unique_ptr<CompletionQueue> cq;
    std::unique_ptr<QueuePair> qp;  // after cq: destroyed first
    std::uint64_t progress_word = 0;  // a partial source's word is read into here
    std::unique_ptr<MemoryRegion> progress_region;
    bool in_use = false;
    Clock::time_point used = Clock::now();
  };
  std::mutex links_mutex;
  std::map<std::pair<std::string, std::size_t>, std::vector<std::shared_ptr<Link>>> links;  // by (source, port)
  std::size_t links_count = 0;
  // Rails found out (no RDMA there, or a rail whose devices do not reach each other), by (source,
  // port), until a recheck: port 0 out means the source is read over TCP; another port, that the
  // source is read without that rail. Bounded by links_max (the oldest-keyed entry goes).
  std::map<std::pair<std::string, std::size_t>, Clock::time_point> rails_out_until;
};

// The source side's extension of the data port (served_link.cpp).
std::shared_ptr<net::DataPortExtension> make_served_link(std::weak_ptr<RdmaTransport::State> state);

}  // namespace th::rdma
