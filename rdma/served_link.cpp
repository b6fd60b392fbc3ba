// The source side of rdma/: a reader's connection to the data port, handed over by the data server
// at its RDMA hello, becomes a link: a queue pair connected to the reader's, and the reader's grant
// opens answered with memory windows bound to that queue pair (see transport.h).
#include "rdma/protocol.h"

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
  std::unique_ptr<CompletionQueue> cq;
  std::unique_ptr<QueuePair> qp;
  std::vector<net::GrantKey> open;  // grants with windows on this link
  std::shared_ptr<RdmaTransport::State::Notifier> notifier = std::make_shared<RdmaTransport::State::Notifier>();
  ~LinkResources() {
    {
      std::lock_guard writing(notifier->mutex);
      notifier->socket = nullptr;
    }
    // Windows go before the queue pair they are bound to.
    std::lock_guard lock(state.mutex);
    state.notifiers.erase(id);
    for (const net::GrantKey& key : open) {
      if (auto grant = state.grants.find(key); grant != state.grants.end()) state.invalidate_windows(*grant->second, id);
    }
  }
};

// Binds one window per registration the grant's regions use, to this link's queue pair, and fills
// the regions' keys. Throws VerbsError (the link is then unusable).
void bind_windows(RdmaTransport::State& state, LinkResources& link, RdmaTransport::State::Grant& grant,
                  std::vector<RemoteRegion>& out, std::vector<RdmaTransport::State::Window>& windows) {
  std::map<MemoryRegion*, std::pair<std::uintptr_t, std::uintptr_t>> spans;  // registration -> [begin, end)
  for (std::size_t i = 0; i < grant.regions.size(); ++i) {
    if (grant.regions[i].bytes == 0) continue;
    const auto begin = reinterpret_cast<std::uintptr_t>(grant.regions[i].base);
    auto [span, fresh] = spans.try_emplace(grant.registrations[i].get(), begin, begin + grant.regions[i].bytes);
    if (!fresh) {
      span->second.first = std::min(span->second.first, begin);
      span->second.second = std::max(span->second.second, begin + grant.regions[i].bytes);
    }
  }
  std::map<MemoryRegion*, std::uint32_t> keys;
  std::uint32_t posted = 0;
  for (const auto& [region, span] : spans) {
    auto window = std::make_unique<MemoryWindow>(state.device);
    ibv_send_wr request{};
    ibv_send_wr* bad = nullptr;
    request.opcode = IBV_WR_BIND_MW;
    request.send_flags = IBV_SEND_SIGNALED;
    request.wr_id = posted++;
    request.bind_mw.mw = window->get();
    request.bind_mw.rkey = ibv_inc_rkey(window->get()->rkey);
    request.bind_mw.bind_info.mr = region->get();
    request.bind_mw.bind_info.addr = span.first;
    request.bind_mw.bind_info.length = span.second - span.first;
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
    keys[region] = request.bind_mw.rkey;
    windows.push_back({link.id, std::move(window)});
    ++state.windows_bound;
  }
  for (std::size_t i = 0; i < grant.regions.size(); ++i) {
    out[i].key = grant.regions[i].bytes == 0 ? 0 : keys.at(grant.registrations[i].get());
  }
}

// Answers one open request; false: the link is to end.
bool answer_open(RdmaTransport::State& state, const net::Fd& socket, LinkResources& link, const Request& request,
                 int& grant_wait_left_ms, std::uint32_t& refusals) {
  const net::GrantKey key{request.transfer, request.epoch};
  const Deadline deadline = after_ms(state.options.handshake_timeout_ms);
  auto refuse = [&](Answer status) {
    ++refusals;
    OpenAnswer answer;
    answer.status = status;
    std::lock_guard writing(link.notifier->mutex);
    net::send_all_by(socket, &answer, sizeof answer, deadline);
    return true;
  };
  std::shared_ptr<RdmaTransport::State::Grant> grant;
  {
    std::unique_lock lock(state.mutex);
    auto found = state.grants.find(key);
    if (found == state.grants.end() && grant_wait_left_ms > 0 && !state.revoked_recently(key)) {
      // The hub tells reader and source at once: the open may come first. Bounded per link.
      const auto began = Clock::now();
      state.granted.wait_for(lock, std::chrono::milliseconds(grant_wait_left_ms),
                             [&] { return (found = state.grants.find(key)) != state.grants.end() || state.revoked_recently(key); });
      grant_wait_left_ms -= static_cast<int>(
          std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - began).count());
    }
    if (found == state.grants.end() || !same_secret(found->second->secret, secret_of(request))) {
      lock.unlock();
      return refuse(Answer::kNoGrant);  // a wrong secret is answered as no grant
    }
    grant = found->second;
    if (!grant->slot || grant->regions.size() > state.options.regions_per_grant_max) {
      lock.unlock();
      return refuse(Answer::kUnsupported);  // the reader pulls this one over TCP
    }
    if (link.open.size() >= state.options.grants_per_link_max &&
        std::find(link.open.begin(), link.open.end(), key) == link.open.end()) {
      lock.unlock();
      return refuse(Answer::kBusy);
    }
  }
  {
    // Registered at the first open, on a connection thread (gigabytes pin for a while: not on the
    // client's I/O thread, which grant() runs on).
    std::lock_guard registering(grant->registering);
    if (grant->registrations.empty()) {
      for (const net::ExposedRegion& region : grant->regions) {
        grant->registrations.push_back(region.bytes == 0 ? nullptr : state.region_for(region.base, region.bytes));
      }
    }
  }
  std::vector<RemoteRegion> regions(grant->regions.size());
  for (std::size_t i = 0; i < regions.size(); ++i) {
    regions[i].address = reinterpret_cast<std::uintptr_t>(grant->regions[i].base);
    regions[i].bytes = grant->regions[i].bytes;
    regions[i].key = grant->regions[i].bytes == 0 ? 0 : grant->registrations[i]->get()->rkey;
  }
  std::vector<RdmaTransport::State::Window> windows;
  if (state.device.has_memory_windows()) bind_windows(state, link, *grant, regions, windows);
  OpenAnswer answer;
  answer.regions = static_cast<std::uint32_t>(regions.size());
  answer.total_bytes = grant->total_bytes;
  answer.progress_key = state.progress_region->get()->rkey;
  {
    std::lock_guard lock(state.mutex);
    if (grant->revoked) {
      // Revoked while the windows were bound: they die here, unused.
      windows.clear();
      answer.status = Answer::kNoGrant;
      ++refusals;
    } else {
      answer.progress_address = reinterpret_cast<std::uintptr_t>(&state.progress_words[*grant->slot]);
      for (auto& window : windows) grant->windows.push_back(std::move(window));
      if (std::find(link.open.begin(), link.open.end(), key) == link.open.end()) link.open.push_back(key);
    }
  }
  std::lock_guard writing(link.notifier->mutex);
  net::send_all_by(socket, &answer, sizeof answer, deadline);
  if (answer.status == Answer::kOk) net::send_all_by(socket, regions.data(), regions.size() * sizeof(RemoteRegion), deadline);
  return true;
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
  try {
    link.cq = std::make_unique<CompletionQueue>(state.device, 16);
    link.qp = std::make_unique<QueuePair>(state.device, *link.cq, 4, std::min<std::uint32_t>(state.device.max_read_atoms(), 16));
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
  int grant_wait_left_ms = state.grant_wait_ms_max;
  std::uint32_t refusals = 0;
  constexpr std::uint32_t kRefusalsMax = 8;  // as the TCP data plane's refusals_per_connection_max
  for (;;) {
    connection.set_idle(true);
    Request request;
    try {
      if (!net::recv_all_or_eof_by(socket, &request, sizeof request, after_ms(state.options.link_idle_timeout_ms))) {
        return "";
      }
    } catch (const net::SocketTimeout&) {
      return "";  // idle for link_idle_timeout_ms: the reader dials again when it needs to
    }
    connection.set_idle(false);
    if (connection.dropped()) return "";
    if (request.magic != kMagic) return "a request of another protocol on an RDMA link";
    try {
      if (request.kind == Kind::kOpen) {
        if (!answer_open(state, socket, link, request, grant_wait_left_ms, refusals)) return "";
      } else if (request.kind == Kind::kClose) {
        const net::GrantKey key{request.transfer, request.epoch};
        std::lock_guard lock(state.mutex);
        if (auto grant = state.grants.find(key); grant != state.grants.end()) {
          state.invalidate_windows(*grant->second, link.id);
        }
        std::erase(link.open, key);
      } else {
        return "an RDMA request of unknown kind";
      }
    } catch (const VerbsError& error) {
      return std::string("RDMA link failed: ") + error.what();
    }
    if (refusals >= kRefusalsMax) return "refused " + std::to_string(refusals) + " opens";
  }
}

}  // namespace

std::shared_ptr<net::DataPortExtension> make_served_link(std::weak_ptr<RdmaTransport::State> state) {
  return std::make_shared<ServedLink>(std::move(state));
}

}  // namespace th::rdma
