// The source side of rdma/: a reader's connection to the data port, handed over by the data server
// at its RDMA hello, becomes a link: a queue pair connected to the reader's, and the reader's grant
// opens answered with memory windows bound to that queue pair (see transport.h).
#include "rdma/protocol.h"

#include <optional>

namespace th::rdma {
namespace {

class ServedLink final : public net::DataPortExtension {
 public:
  explicit ServedLink(std::weak_ptr<RdmaTransport::State> state) : state_(std::move(state)) {}
  std::uint32_t magic() const override { return kMagic; }
  std::string serve(const net::Fd& socket, std::span<const std::byte> first, net::DataConnection& connection) override;

 private:
  std::weak_ptr<RdmaTransport::State> state_;
};

struct LinkResources {
  explicit LinkResources(RdmaTransport::State& state_in) : state(state_in) {}
  LinkResources(const LinkResources&) = delete;
  LinkResources& operator=(const LinkResources&) = delete;
  RdmaTransport::State& state;
  std::uint64_t id = 0;
  std::size_t port = 0;  // the rail the reader asked for, modulo this source's devices
  std::unique_ptr<CompletionQueue> cq;
  std::unique_ptr<QueuePair> qp;
  // The grants this link's reader opened and has not closed (revoked ones too: a revoke() on a
  // device without windows waits for the reader to let go). Guarded by State::mutex.
  std::vector<std::pair<net::GrantKey, std::shared_ptr<RdmaTransport::State::Grant>>> open;
  std::shared_ptr<RdmaTransport::State::Notifier> notifier = std::make_shared<RdmaTransport::State::Notifier>();

  bool has_open(net::GrantKey key) const {
    return std::any_of(open.begin(), open.end(), [&](const auto& entry) { return entry.first == key; });
  }
  // The reader let go of `key` (or the link ends): its windows here go, and a revoke() waiting for
  // the reader hears of it. Called with State::mutex held.
  void close(net::GrantKey key) {
    for (auto it = open.begin(); it != open.end();) {
      if (it->first != key) {
        ++it;
        continue;
      }
      state.invalidate_windows(*it->second, id);
      std::erase(it->second->opened_on, id);
      it = open.erase(it);
    }
  }

  ~LinkResources() {
    {
      std::lock_guard writing(notifier->mutex);
      notifier->socket = nullptr;
    }
    {
      // Windows go before the queue pair they are bound to.
      std::lock_guard lock(state.mutex);
      for (auto& [key, grant] : open) state.invalidate_windows(*grant, id);
    }
    // Then the queue pair: once it is destroyed, no READ through it is answered any more (not even
    // the rest of one the device had begun: rxe goes on with a READ it validated before its window
    // was invalidated). A revoke() waiting for this link learns of it only after this.
    qp.reset();
    cq.reset();
    {
      std::lock_guard lock(state.mutex);
      state.notifiers.erase(id);
      state.link_ports.erase(id);
      while (!open.empty()) close(open.front().first);
    }
    state.opened.notify_all();
  }
};

// Binds one window per maximal contiguous span of the grant's regions within a registration (not
// one over the registration: the gaps between regions are memory the grant does not expose), to
// this link's queue pair, and fills the regions' keys. Throws VerbsError (the link then ends).
void bind_windows(RdmaTransport::State& state, LinkResources& link, RdmaTransport::State::Grant& grant,
                  std::vector<RemoteRegion>& out, std::vector<RdmaTransport::State::Window>& windows) {
  struct Span {
    MemoryRegion* registration;
    std::uintptr_t begin;
    std::uintptr_t end;
    std::vector<std::size_t> regions;  // the grant's regions inside it
  };
  std::vector<std::size_t> order;
  for (std::size_t i = 0; i < grant.regions.size(); ++i) {
    if (grant.regions[i].bytes > 0) order.push_back(i);
  }
  const auto& registrations = grant.registrations[link.port];
  const auto begin_of = [&](std::size_t i) { return reinterpret_cast<std::uintptr_t>(grant.regions[i].base); };
  std::sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) {
    return std::pair(registrations[a].get(), begin_of(a)) < std::pair(registrations[b].get(), begin_of(b));
  });
  std::vector<Span> spans;
  for (std::size_t i : order) {
    const std::uintptr_t begin = begin_of(i);
    const std::uintptr_t end = begin + grant.regions[i].bytes;
    if (!spans.empty() && spans.back().registration == registrations[i].get() && begin <= spans.back().end) {
      spans.back().end = std::max(spans.back().end, end);  // touching (or overlapping): one window
    } else {
      spans.push_back({registrations[i].get(), begin, end, {}});
    }
    spans.back().regions.push_back(i);
  }
  for (const Span& span : spans) {
    TH_ASSERT(span.registration->covers(span.begin, span.end - span.begin), "a window inside its registration");
    auto window = std::make_unique<MemoryWindow>(state.ports[link.port]->device);
    ibv_send_wr request{};
    ibv_send_wr* bad = nullptr;
    request.opcode = IBV_WR_BIND_MW;
    request.send_flags = IBV_SEND_SIGNALED;
    request.bind_mw.mw = window->get();
    request.bind_mw.rkey = ibv_inc_rkey(window->get()->rkey);
    request.bind_mw.bind_info.mr = span.registration->get();
    request.bind_mw.bind_info.addr = span.begin;
    request.bind_mw.bind_info.length = span.end - span.begin;
    request.bind_mw.bind_info.mw_access_flags = IBV_ACCESS_REMOTE_READ;
    if (const int result = ibv_post_send(link.qp->get(), &request, &bad); result != 0) {
      throw VerbsError("ibv_post_send(BIND_MW) failed: " + std::string(std::strerror(result)));
    }
    // One at a time: a send queue of a few entries suffices, and an open is not the hot path.
    const Deadline deadline = after_ms(state.options.handshake_timeout_ms);
    ibv_wc completion{};
    while (link.cq->poll(&completion, 1) == 0) {
      if (Clock::now() > deadline) throw VerbsError("binding a memory window timed out");
      link.cq->wait(10);
    }
    if (completion.status != IBV_WC_SUCCESS) {
      throw VerbsError(std::string("binding a memory window failed: ") + ibv_wc_status_str(completion.status));
    }
    for (std::size_t i : span.regions) out[i].key = request.bind_mw.rkey;
    windows.push_back({link.id, std::move(window)});
    ++state.windows_bound;
  }
}

// Counts an open binding windows for a grant (revoke() waits until none is), from when the grant
// was found live after registering until its windows are in place or given up.
class Opening {
 public:
  Opening(RdmaTransport::State& state, std::shared_ptr<RdmaTransport::State::Grant> grant)
      : state_(state), grant_(std::move(grant)) {
    ++grant_->opening;  // the caller holds state.mutex
  }
  ~Opening() {
    {
      std::lock_guard lock(state_.mutex);
      TH_ASSERT(grant_->opening > 0);
      --grant_->opening;
    }
    state_.opened.notify_all();
  }
  Opening(const Opening&) = delete;
  Opening& operator=(const Opening&) = delete;

 private:
  RdmaTransport::State& state_;
  std::shared_ptr<RdmaTransport::State::Grant> grant_;
};

// The per-link budgets of open requests, spent by early and refused opens, and refilled by every
// open that succeeds: a link lives across many versions, and an honest reader's open sometimes
// comes before the source heard of its grant.
struct OpenBudget {
  int grant_wait_left_ms = 0;
  std::uint32_t refusals = 0;
};

// Answers one open request; false: the link is to end.
bool answer_open(RdmaTransport::State& state, const net::Fd& socket, LinkResources& link, const Request& request,
                 OpenBudget& budget) {
  const net::GrantKey key{request.transfer, request.epoch};
  // An answer's deadline runs from when it is sent (a grant wait or a registration came first).
  auto refuse = [&](Answer status) {
    if (status == Answer::kNoGrant) ++budget.refusals;
    OpenAnswer answer;
    answer.status = status;
    std::lock_guard writing(link.notifier->mutex);
    net::send_all_by(socket, &answer, sizeof answer, after_ms(state.options.handshake_timeout_ms));
    return true;
  };
  std::shared_ptr<RdmaTransport::State::Grant> grant;
  std::optional<Opening> opening;
  {
    std::unique_lock lock(state.mutex);
    auto found = state.grants.find(key);
    if (found == state.grants.end() && budget.grant_wait_left_ms > 0 && !state.revoked_recently(key) &&
        state.grant_waiters < state.grant_waiters_max) {
      // The hub tells reader and source at once: the open may come first. A waiting link is busy
      // (it cannot be shed to make room), so waits are capped, as the TCP data plane's are:
      // otherwise anyone reaching the port could keep every slot waiting for grants that never come.
      ++state.grant_waiters;
      const auto began = Clock::now();
      state.granted.wait_for(lock, std::chrono::milliseconds(budget.grant_wait_left_ms), [&] {
        return (found = state.grants.find(key)) != state.grants.end() || state.revoked_recently(key);
      });
      --state.grant_waiters;
      budget.grant_wait_left_ms -= static_cast<int>(
          std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - began).count());
    }
    if (found == state.grants.end() || !same_secret(found->second->secret, secret_of(request))) {
      lock.unlock();
      return refuse(Answer::kNoGrant);  // a wrong secret is answered as no grant
    }
    grant = found->second;
    TH_ASSERT(!grant->revoked, "a revoked grant is not in the table");
    if (!grant->slot || grant->regions.size() > state.options.regions_per_grant_max) {
      lock.unlock();
      return refuse(Answer::kUnsupported);  // the reader pulls this one over TCP
    }
    const bool again = link.has_open(key);
    if (!again && link.open.size() >= state.options.grants_per_link_max) {
      lock.unlock();
      return refuse(Answer::kBusy);
    }
    // Opened again on this link (the reader retried): its earlier windows go, so that re-opening
    // cannot pile windows up.
    if (again) link.close(key);
  }
  const RdmaTransport::State::Port& port = *state.ports[link.port];
  std::optional<Error> device_failure;  // a GPU region that cannot be registered here
  try {
    // Registered at the first open on this port, on a connection thread (gigabytes pin for a while:
    // not on the client's I/O thread, which grant() runs on). Assigned only once whole.
    std::lock_guard registering(grant->registering);
    TH_ASSERT(grant->registrations.size() == state.ports.size());
    if (grant->registrations[link.port].empty()) {
      const std::vector<net::ExposedRegion>& regions = grant->regions;
      std::vector<std::shared_ptr<MemoryRegion>> made(regions.size());
      // GPU regions first: when one cannot be registered (no dma-buf and no nvidia-peermem, say)
      // the whole grant goes over TCP, and the host regions need not be pinned for nothing.
      for (std::size_t i = 0; i < regions.size() && !device_failure; ++i) {
        if (regions[i].bytes == 0 || !regions[i].on_device) continue;
        Result<std::shared_ptr<MemoryRegion>> device = state.device_region_for(link.port, regions[i].base, regions[i].bytes);
        if (device) {
          made[i] = std::move(device).value();
        } else {
          device_failure = device.error();
        }
      }
      for (std::size_t i = 0; i < regions.size() && !device_failure; ++i) {
        if (regions[i].bytes > 0 && !regions[i].on_device) made[i] = state.region_for(link.port, regions[i].base, regions[i].bytes);
      }
      if (!device_failure) grant->registrations[link.port] = std::move(made);
    }
  } catch (const VerbsError& error) {
    // Most likely the memlock limit: this grant goes over TCP, the link stays.
    log_line(state.options, std::string("cannot register a grant's memory (the reader pulls it over TCP): ") + error.what());
    return refuse(Answer::kUnsupported);
  }
  if (device_failure) {
    // Over TCP the data server stages GPU memory through pinned host memory. A registration that
    // failed was logged as it failed; a bad pointer (the application's) is logged here.
    if (device_failure->code == Errc::kInvalidArgument) {
      log_line(state.options, "a grant's GPU memory is not registered (the reader pulls it over TCP): " + device_failure->detail);
    }
    return refuse(Answer::kUnsupported);
  }
  {
    // Revoked while it registered (which may take seconds, and which revoke() does not wait for:
    // it runs on the client's I/O thread): nothing is exposed. A registration of memory the owner
    // freed meanwhile pins pages no window ever covers, and is dropped with the grant.
    std::unique_lock lock(state.mutex);
    if (grant->revoked) {
      lock.unlock();
      return refuse(Answer::kNoGrant);
    }
    // From here until its windows are in place revoke() waits for this open (binding is local, and
    // bounded by the handshake deadline): no window is bound after revoke() returned.
    opening.emplace(state, grant);
  }
  const auto& registrations = grant->registrations[link.port];
  std::vector<RemoteRegion> regions(grant->regions.size());
  for (std::size_t i = 0; i < regions.size(); ++i) {
    regions[i].address = reinterpret_cast<std::uintptr_t>(grant->regions[i].base);
    regions[i].bytes = grant->regions[i].bytes;
    regions[i].key = grant->regions[i].bytes == 0 ? 0 : registrations[i]->get()->rkey;
  }
  std::vector<RdmaTransport::State::Window> windows;
  if (port.windows) bind_windows(state, link, *grant, regions, windows);  // throws: the link ends
  OpenAnswer answer;
  answer.regions = static_cast<std::uint32_t>(regions.size());
  answer.total_bytes = grant->total_bytes;
  answer.progress_key = port.progress_region->get()->rkey;
  {
    std::lock_guard lock(state.mutex);
    if (grant->revoked) {
      // Revoked while the windows were bound: they die here, unused (revoke() waits for that).
      windows.clear();
      answer.status = Answer::kNoGrant;
    } else {
      answer.progress_address = reinterpret_cast<std::uintptr_t>(&state.progress_words[*grant->slot]);
      for (auto& window : windows) grant->windows.push_back(std::move(window));
      if (!link.has_open(key)) link.open.emplace_back(key, grant);
      if (std::find(grant->opened_on.begin(), grant->opened_on.end(), link.id) == grant->opened_on.end()) {
        grant->opened_on.push_back(link.id);
      }
    }
  }
  opening.reset();
  if (answer.status == Answer::kOk) budget = OpenBudget{state.grant_wait_ms_max, 0};
  const Deadline deadline = after_ms(state.options.handshake_timeout_ms);
  std::lock_guard writing(link.notifier->mutex);
  net::send_all_by(socket, &answer, sizeof answer, deadline);
  if (answer.status == Answer::kOk) net::send_all_by(socket, regions.data(), regions.size() * sizeof(RemoteRegion), deadline);
  return true;
}

// Whether a reader reads through this link now: windows of a live grant are bound to it. A busy
// link is neither dropped to make room nor ended for idleness (its reader's pull may take long).
bool link_busy(RdmaTransport::State& state, const LinkResources& link) {
  std::lock_guard lock(state.mutex);
  for (const auto& [key, grant] : link.open) {
    if (grant->revoked) continue;
    for (const auto& window : grant->windows) {
      if (window.link == link.id) return true;
    }
    // (Without windows: an open grant is read through the registration's key.)
    if (!state.ports[link.port]->windows) return true;
  }
  return false;
}

std::string ServedLink::serve(const net::Fd& socket, std::span<const std::byte> first, net::DataConnection& connection) {
  auto shared = state_.lock();
  if (shared == nullptr) return "the transport is gone";
  RdmaTransport::State& state = *shared;
  Request hello;
  TH_REQUIRE(first.size() == sizeof hello);
  std::memcpy(&hello, first.data(), sizeof hello);
  const Deadline deadline = after_ms(state.options.handshake_timeout_ms);
  HelloAnswer answer;
  if (hello.kind != Kind::kHello || hello.version != kProtocolVersion || hello.mtu < IBV_MTU_256 ||
      hello.mtu > IBV_MTU_4096) {
    answer.status = Answer::kUnsupported;  // the reader falls back to TCP
    net::send_all_by(socket, &answer, sizeof answer, deadline);
    return "an RDMA hello of another version or kind";
  }
  LinkResources link(state);
  link.notifier->socket = &socket;
  {
    std::lock_guard lock(state.mutex);
    link.id = state.next_link++;
    state.notifiers[link.id] = link.notifier;
  }
  // Rail i of the reader meets this source's device i (modulo: a source with fewer devices serves
  // several rails from one).
  link.port = hello.rail % state.ports.size();
  {
    std::lock_guard lock(state.mutex);
    state.link_ports[link.id] = link.port;
  }
  const Device& device = state.ports[link.port]->device;
  try {
    link.cq = std::make_unique<CompletionQueue>(device, 16);
    link.qp = std::make_unique<QueuePair>(device, *link.cq, 4, std::min<std::uint32_t>(device.max_read_atoms(), 16));
    answer.read_atoms = static_cast<std::uint8_t>(link.qp->read_atoms());
    const QueuePairAddress local = link.qp->local_address(first_packet_sequence());
    link.qp->connect(local, address_of(hello), state.options.qp_timeout_exponent, state.options.qp_retry_count);
    answer.qp_number = local.qp_number;
    answer.packet_sequence = local.packet_sequence;
    answer.lid = local.lid;
    answer.mtu = local.mtu;
    answer.gid = local.gid;
  } catch (const VerbsError& error) {
    answer = HelloAnswer{};
    answer.status = Answer::kUnsupported;
    net::send_all_by(socket, &answer, sizeof answer, deadline);
    return std::string("no queue pair for a reader: ") + error.what();
  }
  net::send_all_by(socket, &answer, sizeof answer, deadline);
  OpenBudget budget{state.grant_wait_ms_max, 0};
  constexpr std::uint32_t kRefusalsMax = 8;  // as the TCP data plane's refusals_per_connection_max
  // A link waits for its reader's next request in slices: between them it looks whether it is busy
  // (a pull reads through it: not idle, no idle deadline) or idle (may be shed; ends after
  // link_idle_timeout_ms).
  constexpr int kSliceMs = 1'000;
  auto idle_since = Clock::now();
  for (;;) {
    const bool busy = link_busy(state, link);
    connection.set_idle(!busy);
    if (busy) idle_since = Clock::now();
    if (connection.dropped()) return "";
    if (!busy && Clock::now() - idle_since > std::chrono::milliseconds(state.options.link_idle_timeout_ms)) {
      return "";  // idle for link_idle_timeout_ms: the reader dials again when it needs to
    }
    pollfd waiting[2] = {{socket.get(), POLLIN, 0}, {link.notifier->wakeup.fd().get(), POLLIN, 0}};
    const int ready = ::poll(waiting, 2, kSliceMs);
    if (ready < 0 && errno != EINTR) return std::string("poll: ") + std::strerror(errno);
    if (waiting[1].revents != 0) link.notifier->wakeup.clear();  // a revoke: look again at once
    if (ready <= 0 || waiting[0].revents == 0) continue;
    connection.set_idle(false);
    Request request;
    // The request began: the rest must come by the handshake deadline.
    if (!net::recv_all_or_eof_by(socket, &request, sizeof request, after_ms(state.options.handshake_timeout_ms))) {
      return "";
    }
    if (connection.dropped()) return "";
    if (request.magic != kMagic) return "a request of another protocol on an RDMA link";
    try {
      if (request.kind == Kind::kOpen) {
        if (!answer_open(state, socket, link, request, budget)) return "";
      } else if (request.kind == Kind::kClose) {
        {
          std::lock_guard lock(state.mutex);
          link.close({request.transfer, request.epoch});
        }
        state.opened.notify_all();
      } else {
        return "an RDMA request of unknown kind";
      }
    } catch (const VerbsError& error) {
      return std::string("RDMA link failed: ") + error.what();
    } catch (const net::SocketError&) {
      throw;  // the data server ends the connection and says why
    } catch (const std::exception& error) {
      // A bug of ours, or no memory: this link ends; the process (a trainer, with its job) goes on.
      return std::string("RDMA link failed (a bug?): ") + error.what();
    }
    if (budget.refusals >= kRefusalsMax) return "refused " + std::to_string(budget.refusals) + " opens";
  }
}

}  // namespace

std::shared_ptr<net::DataPortExtension> make_served_link(std::weak_ptr<RdmaTransport::State> state) {
  return std::make_shared<ServedLink>(std::move(state));
}

}  // namespace th::rdma
