// RdmaTransport: grants and revokes (source side), registrations by lease, stats. The source's
// links are in served_link.cpp, the reader's pulls in reader.cpp.
#include "rdma/protocol.h"
#include "rdma/verbs_loader.h"

namespace th::rdma {

RdmaTransport::State::State(RdmaOptions options_in)
    : options(std::move(options_in)), gpu(GpuRegistrationChoice::detect(options.device_memory.get(), "/sys")) {
  TH_REQUIRE(options.read_bytes > 0);
  TH_REQUIRE(options.reads_in_flight_max > 0);
  TH_REQUIRE(options.signal_every > 0);
  TH_REQUIRE(options.progress_slots > 0);
  if (std::optional<std::string> missing = verbs_unavailable()) throw VerbsError("no RDMA: " + *missing);
  std::vector<std::string> names = options.devices.empty() ? choose_devices(list_devices(), current_numa_node())
                                                           : options.devices;
  if (names.empty()) throw VerbsError("no RDMA device has an active port");
  if (names.size() > kPortsMax) names.resize(kPortsMax);
  progress_words = std::make_unique<std::atomic<std::uint64_t>[]>(options.progress_slots);
  for (const std::string& name : names) {
    auto port = std::make_unique<Port>(name, options.gid_index);
    port->progress_region = std::make_unique<MemoryRegion>(port->device, progress_words.get(),
                                                           options.progress_slots * sizeof(std::uint64_t),
                                                           IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_READ);
    ++registrations;
    port->windows = options.memory_windows && port->device.has_memory_windows();
    if (!port->windows) {
      log_line(options, "device " + name + (options.memory_windows ? " has no type-2 memory windows" : ": memory windows off") +
               ": readers get the registration's key (any peer that says hello may guess it), and only "
               "cutting their links at revoke() ends their reads");
    }
    ports.push_back(std::move(port));
  }
  for (std::uint32_t slot = options.progress_slots; slot > 0; --slot) free_progress_slots.push_back(slot - 1);
  TH_ASSERT(!ports.empty());
  TH_ASSERT(ports.size() <= kPortsMax);
  if (options.device_memory != nullptr) {
    // Called by the registry outside its lock, once per (leased allocation, port); a failure is
    // logged here, once (the registry remembers it), unless GPU memory is staged anyway: that was
    // said at start, or when dma-buf turned out not to work.
    device_allocations = std::make_unique<AllocationRegistry<MemoryRegion>>(
        options.device_memory, ports.size(), [this](std::size_t port, const AllocationRange& allocation) {
          const Port& on = *ports.at(port);
          auto made = register_gpu_allocation(on.device, *options.device_memory, gpu, allocation,
                                              register_access(on.windows),
                                              [this](const std::string& line) { log_line(options, line); });
          if (made) {
            ++registrations;
          } else if (gpu.method() != GpuRegistration::kNone) {
            log_line(options, "cannot register a GPU allocation of " + std::to_string(allocation.bytes) + " bytes on " +
                                  on.device.name() + " (it goes over TCP, staged): " + made.error().detail);
          }
          return made;
        });
    // Once, at start: which method this process's GPU memory will use. (Without a DeviceMemoryApi the
    // process has no GPU memory to speak of: the log hook is libthclient's warning level, so no
    // line in every host-only process; stats().device_registration says "staging".)
    log_line(options, gpu.describe());
  }
}

RdmaTransport::RdmaTransport(net::DataServerConfig tcp, RdmaOptions options)
    : state_(std::make_shared<State>(std::move(options))) {
  state_->grant_wait_ms_max = tcp.grant_wait_ms_max;
  state_->grant_waiters_max = tcp.grant_waiters_max;
  tcp.extension = make_served_link(state_);
  server_ = std::make_unique<net::DataServer>(std::move(tcp));
}

RdmaTransport::~RdmaTransport() {
  server_.reset();  // joins the connection threads: no served link is left
  std::lock_guard lock(state_->mutex);
  for (auto& [key, grant] : state_->grants) state_->end_grant(*grant);
  state_->grants.clear();
}

net::Endpoint RdmaTransport::endpoint() const { return server_->endpoint(); }
std::string RdmaTransport::device_names() const {
  std::string names;
  for (const auto& port : state_->ports) names += (names.empty() ? "" : ",") + port->device.name();
  return names;
}

void RdmaTransport::grant(net::GrantKey key, const GrantSecret& secret, std::vector<net::ExposedRegion> regions,
                          std::shared_ptr<net::Progress> progress) {
  TH_REQUIRE(progress != nullptr, "a grant needs a progress counter");
  auto entry = std::make_shared<State::Grant>();
  entry->secret = secret;
  entry->regions = regions;
  for (const net::ExposedRegion& region : regions) entry->total_bytes += region.bytes;
  entry->progress = progress;
  entry->registrations.resize(state_->ports.size());
  {
    std::lock_guard lock(state_->mutex);
    if (!state_->free_progress_slots.empty()) {
      entry->slot = state_->free_progress_slots.back();
      state_->free_progress_slots.pop_back();
      entry->progress->add_mirror(&state_->progress_words[*entry->slot]);
    }  // else: no slot, opens are answered "unsupported" and readers pull over TCP
    const bool fresh = state_->grants.emplace(key, std::move(entry)).second;
    TH_REQUIRE(fresh, "transfer", key.transfer, "epoch", key.epoch, "is granted twice");
  }
  state_->granted.notify_all();
  server_->grant(key, secret, std::move(regions), std::move(progress));  // for readers over TCP
}

void RdmaTransport::revoke(net::GrantKey key) {
  std::vector<std::shared_ptr<State::Notifier>> readers;  // the links that opened this grant
  std::shared_ptr<State::Grant> grant;
  {
    std::unique_lock lock(state_->mutex);
    auto found = state_->grants.find(key);
    if (found != state_->grants.end()) {
      grant = found->second;
      for (std::uint64_t link : grant->opened_on) {
        if (auto notifier = state_->notifiers.find(link); notifier != state_->notifiers.end()) {
          readers.push_back(notifier->second);
        }
      }
      state_->end_grant(*grant);
      state_->grants.erase(found);
      state_->revoked.push_back(key);
      if (state_->revoked.size() > State::kRevokedRemembered) state_->revoked.pop_front();
      // An open binding windows for this grant sees `revoked` when it is done and lets them go;
      // wait for that, so that no window exposes the memory after we return (the owner may free
      // it then). Short: binding is local, and has the handshake deadline. (An open still
      // registering does not hold this up: it looks at `revoked` before it binds.)
      state_->opened.wait(lock, [&] { return grant->opening == 0; });
      TH_ASSERT(grant->windows.empty(), "a revoked grant has no windows");
    }
  }
  state_->granted.notify_all();  // an open waiting for this grant is refused now
  // The windows are dead already (that is the guarantee); the notices only tell the readers now.
  // Never blocking: revoke() runs on the client's I/O thread, and a reader that does not drain its
  // link must not stall it. A notice that does not fit now is skipped (the reader's next READ fails).
  const RevokedNotice notice{kNoticeMagic, key.epoch, key.transfer};
  for (const auto& reader : readers) reader->wakeup.signal();  // the link is not busy any more
  for (const auto& reader : readers) {
    if (!state_->options.revoke_notices) break;
    std::unique_lock writing(reader->mutex, std::try_to_lock);
    if (!writing.owns_lock() || reader->socket == nullptr) continue;
    const ssize_t sent = ::send(reader->socket->get(), &notice, sizeof notice, MSG_DONTWAIT | MSG_NOSIGNAL);
    if (sent > 0 && sent != static_cast<ssize_t>(sizeof notice)) reader->socket->shutdown();  // framing is lost
  }
  if (grant != nullptr && !readers.empty()) {
    // A reader that still has the grant open may be mid-READ, and a device may finish a READ it
    // began even after the window is gone (rxe does, a packet or more); without windows nothing
    // stops its reads at all. So its link is cut, as the TCP data plane cuts a send in flight: the
    // notice above goes first, then the connection ends, and the link's queue pair is destroyed.
    // Wait (bounded) until every such link is gone: then no READ of this memory is answered.
    // A reader that finished has sent its close, maybe not yet read here: a moment's grace for
    // it, so that a finished reader keeps its link for the next version. (Through libthclient the
    // close is long in by the time the hub revokes: the reader closes before it reports.)
    constexpr auto kCloseGrace = std::chrono::milliseconds(250);
    std::unique_lock lock(state_->mutex);
    state_->opened.wait_for(lock, kCloseGrace, [&] { return grant->opened_on.empty(); });
    std::vector<std::shared_ptr<State::Notifier>> still_open;
    for (std::uint64_t link : grant->opened_on) {
      if (auto notifier = state_->notifiers.find(link); notifier != state_->notifiers.end()) {
        still_open.push_back(notifier->second);
      }
    }
    lock.unlock();
    for (const auto& reader : still_open) {
      std::lock_guard writing(reader->mutex);
      if (reader->socket != nullptr) reader->socket->shutdown();
    }
    lock.lock();
    const bool cut = state_->opened.wait_for(lock, std::chrono::milliseconds(state_->options.revoke_wait_ms),
                                             [&] { return grant->opened_on.empty(); });
    if (!cut) {
      log_line(state_->options, "revoke of transfer " + std::to_string(key.transfer) + " epoch " + std::to_string(key.epoch) +
               ": a reader's link did not end in " + std::to_string(state_->options.revoke_wait_ms) +
               " ms; a late read may see the memory change");
    }
  }
  server_->revoke(key);
}

net::TransportStats RdmaTransport::stats() const {
  net::TransportStats stats;
  stats.bytes_served = server_->stats().bytes_served;
  stats.pulls_rdma = state_->pulls_rdma.load();
  stats.pulls_striped = state_->pulls_striped.load();
  for (const auto& port : state_->ports) stats.bytes_read_per_device.push_back(port->bytes_read.load());
  stats.pulls_tcp = state_->pulls_tcp.load();
  stats.pulls_fell_back = state_->pulls_fell_back.load();
  stats.memory_registrations = state_->registrations.load();
  stats.windows_bound = state_->windows_bound.load();
  stats.windows_invalidated = state_->windows_invalidated.load();
  stats.device_registrations = state_->device_allocations ? state_->device_allocations->registrations() : 0;
  stats.device_registration = gpu_registration_name(state_->gpu.method());
  return stats;
}

std::shared_ptr<void> RdmaTransport::lease_memory(const std::byte* base, std::uint64_t bytes, bool on_device) {
  if (base == nullptr || bytes == 0) return nullptr;
  if (on_device) {
    // GPU memory: its whole CUDA allocation is leased, not a run of host ranges (device_memory.h).
    if (state_->device_allocations == nullptr) return nullptr;  // never registered: nothing to keep
    Result<std::shared_ptr<void>> lease = state_->device_allocations->lease(base, bytes);
    if (!lease) {
      // The application's bad pointer: its grants and pulls go over TCP (which says more if it fails).
      log_line(state_->options, "GPU memory not leased to the NIC: " + lease.error().detail);
      return nullptr;
    }
    return std::move(lease).value();
  }
  const auto begin = reinterpret_cast<std::uintptr_t>(base);
  {
    std::lock_guard lock(state_->registrations_mutex);
    state_->leased.emplace(begin, bytes);
  }
  std::weak_ptr<State> weak = state_;
  // The lease holds no memory of its own: a token whose deleter ends the lease.
  return std::shared_ptr<void>(reinterpret_cast<void*>(begin), [weak, begin, bytes](void*) {
    if (auto state = weak.lock()) state->release_lease(begin, bytes);
  });
}

}  // namespace th::rdma
