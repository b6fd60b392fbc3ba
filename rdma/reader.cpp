// The reader side of rdma/: links to sources (kept across versions), grant opens, and the chunked
// one-sided READs of a pull (see transport.h).
#include "rdma/protocol.h"

namespace th::rdma {

namespace {

using Link = RdmaTransport::State::Link;

// Receives a whole answer on a link, skipping the revoked notices of earlier grants that may come
// first. False: the source closed the link before the answer began.
bool recv_answer(const net::Fd& socket, void* answer, std::size_t bytes, Deadline deadline) {
  TH_REQUIRE(bytes > sizeof(std::uint32_t));
  for (;;) {
    std::uint32_t head = 0;
    if (!net::recv_all_or_eof_by(socket, &head, sizeof head, deadline)) return false;
    auto* rest = static_cast<std::byte*>(answer) + sizeof head;
    std::size_t rest_bytes = bytes - sizeof head;
    RevokedNotice notice;
    if (head == kNoticeMagic) {
      rest = reinterpret_cast<std::byte*>(&notice) + sizeof head;
      rest_bytes = sizeof notice - sizeof head;
    } else {
      std::memcpy(answer, &head, sizeof head);
    }
    if (!net::recv_all_or_eof_by(socket, rest, rest_bytes, deadline)) throw net::SocketError("the link closed mid-answer");
    if (head != kNoticeMagic) return true;
  }
}

// Why no link was made.
enum class NoLink { kNone, kNoRdma, kUnreachable };

// Dials `source` and connects a queue pair to one of its own.
std::shared_ptr<Link> make_link(RdmaTransport::State& state, const net::Endpoint& source, std::size_t port,
                                int connect_timeout_ms, NoLink& failed, std::string& why) {
  auto link = std::make_shared<Link>();
  link->source = source.to_string();
  link->port = port;
  const Device& device = state.ports.at(port)->device;
  try {
    link->socket = net::connect_tcp(source, connect_timeout_ms);
  } catch (const net::SocketError& error) {
    failed = NoLink::kUnreachable;
    why = error.what();
    return nullptr;
  }
  const Deadline deadline = after_ms(state.options.handshake_timeout_ms);
  QueuePairAddress local;
  try {
    link->cq = std::make_unique<CompletionQueue>(device, static_cast<int>(state.options.reads_in_flight_max + 8));
    link->qp = std::make_unique<QueuePair>(device, *link->cq, state.options.reads_in_flight_max + 2,
                                           std::min<std::uint32_t>(device.max_read_atoms(), 16));
    link->progress_region = std::make_unique<MemoryRegion>(device, &link->progress_word,
                                                           sizeof link->progress_word, IBV_ACCESS_LOCAL_WRITE);
    ++state.registrations;  // one per link, not per version
    local = link->qp->local_address(first_packet_sequence());
  } catch (const VerbsError& error) {
    failed = NoLink::kNoRdma;  // this end cannot: TCP it is
    why = std::string("no queue pair here: ") + error.what();
    return nullptr;
  }
  Request hello;
  hello.kind = Kind::kHello;
  hello.qp_number = local.qp_number;
  hello.packet_sequence = local.packet_sequence;
  hello.lid = local.lid;
  hello.mtu = local.mtu;
  hello.gid = local.gid;
  hello.rail = static_cast<std::uint8_t>(port);
  hello.read_atoms = local.read_atoms;
  HelloAnswer answer;
  try {
    net::send_all_by(link->socket, &hello, sizeof hello, deadline);
    // A source without RDMA answers "unknown protocol" (16 bytes) and closes; one that closes
    // without a word is dying, and so unreachable, not a TCP-only peer.
    if (!net::recv_all_or_eof_by(link->socket, &answer.status, sizeof answer.status, deadline)) {
      throw net::SocketError("the source closed the connection at the hello");
    }
    if (static_cast<std::uint32_t>(answer.status) == net::kUnknownProtocolStatus) {
      failed = NoLink::kNoRdma;
      why = "the source does not speak RDMA";
      return nullptr;
    }
    auto* rest = reinterpret_cast<std::byte*>(&answer) + sizeof answer.status;
    if (!net::recv_all_or_eof_by(link->socket, rest, sizeof answer - sizeof answer.status, deadline)) {
      throw net::SocketError("the source closed the connection mid-answer");
    }
  } catch (const net::SocketError& error) {
    failed = NoLink::kUnreachable;
    why = std::string("RDMA hello: ") + error.what();
    return nullptr;
  }
  if (answer.status != Answer::kOk || answer.version != kProtocolVersion || answer.mtu < IBV_MTU_256 ||
      answer.mtu > IBV_MTU_4096) {
    failed = NoLink::kNoRdma;
    why = "the source has no RDMA for us (answer " + std::to_string(static_cast<std::uint32_t>(answer.status)) + ")";
    return nullptr;
  }
  try {
    link->qp->connect(local,
                      {answer.qp_number, answer.packet_sequence, answer.lid, answer.mtu, answer.gid,
                       static_cast<std::uint8_t>(std::max<std::uint8_t>(answer.read_atoms, 1))},
                      state.options.qp_timeout_exponent, state.options.qp_retry_count);
  } catch (const VerbsError& error) {
    failed = NoLink::kNoRdma;
    why = std::string("cannot connect to the source's queue pair: ") + error.what();
    return nullptr;
  }
  return link;
}

// Whether a kept link is still up: the source closes it when idle too long, to make room, or when it
// stops; it writes nothing else unasked but revoked notices, which are read here and dropped.
bool still_up(const Link& link) {
  for (;;) {
    pollfd waiting{link.socket.get(), POLLIN, 0};
    if (::poll(&waiting, 1, 0) <= 0) return true;  // nothing to read: up
    RevokedNotice notice;
    try {
      if (!net::recv_all_or_eof_by(link.socket, &notice, sizeof notice, after_ms(100))) return false;
    } catch (const net::SocketError&) {
      return false;
    }
    if (notice.magic != kNoticeMagic) return false;
  }
}

// Called with links_mutex held.
void mark_rail_out(RdmaTransport::State& state, const std::pair<std::string, std::size_t>& slot) {
  state.rails_out_until[slot] = after_ms(state.options.fallback_recheck_ms);
  if (state.rails_out_until.size() > state.options.links_max) state.rails_out_until.erase(state.rails_out_until.begin());
}

struct Acquired {
  std::shared_ptr<Link> link;
  bool reused = false;
  NoLink failed = NoLink::kNone;
  std::string why;
};

Acquired acquire(RdmaTransport::State& state, const net::Endpoint& source, std::size_t port, int connect_timeout_ms) {
  const std::string name = source.to_string();
  const std::pair<std::string, std::size_t> slot{name, port};
  {
    std::lock_guard lock(state.links_mutex);
    if (auto until = state.rails_out_until.find(slot); until != state.rails_out_until.end()) {
      if (Clock::now() < until->second) return {nullptr, false, NoLink::kNoRdma, "found out lately"};
      state.rails_out_until.erase(until);
    }
    if (auto kept = state.links.find(slot); kept != state.links.end()) {
      for (auto it = kept->second.begin(); it != kept->second.end();) {
        if ((*it)->in_use) {
          ++it;
        } else if (!still_up(**it)) {
          it = kept->second.erase(it);  // closed by the source: its queue pair goes with it
          --state.links_count;
        } else {
          (*it)->in_use = true;
          return {*it, true, NoLink::kNone, ""};
        }
      }
      if (kept->second.empty()) state.links.erase(kept);
    }
  }
  Acquired made;
  made.link = make_link(state, source, port, connect_timeout_ms, made.failed, made.why);
  std::lock_guard lock(state.links_mutex);
  if (made.link == nullptr) {
    if (made.failed == NoLink::kNoRdma) {
      mark_rail_out(state, slot);
      log_line(state.options, port == 0 ? "pulling from " + name + " over TCP: " + made.why
                         : "rail " + std::to_string(port) + " to " + name + " is out: " + made.why);
    }
    return made;
  }
  made.link->in_use = true;
  if (state.links_count >= state.options.links_max) {
    // Make room: the link used the longest ago that nobody uses now.
    std::shared_ptr<Link> oldest;
    for (const auto& [source_name, list] : state.links) {
      for (const auto& link : list) {
        if (!link->in_use && (oldest == nullptr || link->used < oldest->used)) oldest = link;
      }
    }
    if (oldest != nullptr) {
      auto list = state.links.find({oldest->source, oldest->port});
      std::erase(list->second, oldest);
      if (list->second.empty()) state.links.erase(list);
      --state.links_count;
    }
  }
  state.links[slot].push_back(made.link);
  ++state.links_count;
  return made;
}

void release(RdmaTransport::State& state, const std::shared_ptr<Link>& link, bool broken) {
  std::lock_guard lock(state.links_mutex);
  link->in_use = false;
  link->used = Clock::now();
  if (!broken) return;
  auto list = state.links.find({link->source, link->port});
  if (list == state.links.end()) return;
  const auto before = list->second.size();
  std::erase(list->second, link);
  state.links_count -= before - list->second.size();
  if (list->second.empty()) state.links.erase(list);
}

net::ReadError error_of(ibv_wc_status status) {
  // The source's windows are gone (revoked) or never covered this: it refuses, as over TCP.
  if (status == IBV_WC_REM_ACCESS_ERR || status == IBV_WC_REM_INV_REQ_ERR) return net::ReadError::kRefused;
  return net::ReadError::kUnreachable;
}

constexpr std::uint64_t kProgressRead = ~0ull;  // wr_id of a read of the source's progress word
constexpr int kPollMs = 20;
constexpr int kFlushWaitMs = 500;  // for a failed queue pair's flushed completions  // how often a waiting reader looks at its cancel flag and deadlines

// The reads of one grant's layout bytes [begin, end): RDMA READs of `remote` (layout order) into
// `targets`. On any failure the queue pair is failed and drained before returning, so that nothing
// lands afterwards; `broken` then says the link is not to be used again. on_progress hears the
// layout offset up to which every byte of [begin, end) landed.
net::PullOutcome read_grant(RdmaTransport::State& state, Link& link, net::GrantKey key,
                            const std::vector<RemoteRegion>& remote, const OpenAnswer& opened,
                            std::span<const net::LocalRegion> targets,
                            const std::vector<std::shared_ptr<MemoryRegion>>& local, std::uint64_t begin, std::uint64_t end,
                            const net::PullOptions& options, bool& broken) {
  TH_ASSERT(remote.size() == targets.size());
  TH_ASSERT(begin <= end && end <= opened.total_bytes);
  TH_ASSERT(!options.partial || (begin == 0 && end == opened.total_bytes), "a partial source is read in order");
  TH_ASSERT(local.size() == targets.size());
  const std::uint64_t total = end;
  std::uint64_t ready = options.partial ? 0 : end;
  std::uint64_t posted = begin;     // layout bytes posted
  std::uint64_t completed = begin;  // layout prefix of [begin, end) known to have landed
  std::uint64_t reported = begin;
  std::size_t region = 0;           // where `posted` is: region and offset in it
  std::uint64_t offset = begin;
  while (region < targets.size() && offset >= targets[region].bytes) {
    offset -= targets[region].bytes;
    ++region;
  }
  struct Posted {
    std::uint64_t sequence;
    std::uint64_t end;  // layout offset after it
  };
  std::deque<Posted> in_flight;
  std::uint64_t next_sequence = 0;
  bool progress_in_flight = false;
  auto last_completion = Clock::now();
  auto last_growth = Clock::now();
  auto last_progress_read = Clock::time_point{};
  const auto started = Clock::now();
  const std::uint32_t depth = state.options.reads_in_flight_max;

  auto fail = [&](net::ReadError error, std::string detail) {
    // Nothing may land after we return: fail the queue pair, then wait for every posted request's
    // (flushed) completion. Unsignalled ones complete in error too once the pair has failed.
    broken = true;
    std::size_t outstanding = in_flight.size() + (progress_in_flight ? 1 : 0);
    try {
      link.qp->fail();
      const Deadline deadline = after_ms(kFlushWaitMs);
      std::vector<ibv_wc> completions(16);
      std::size_t seen = 0;
      while (outstanding > 0 && Clock::now() < deadline) {
        const int got = link.cq->poll(completions.data(), static_cast<int>(completions.size()));
        seen += static_cast<std::size_t>(got);
        for (int i = 0; i < got; ++i) {
          if (completions[i].wr_id == kProgressRead) {
            progress_in_flight = false;
          } else {
            while (!in_flight.empty() && in_flight.front().sequence <= completions[i].wr_id) in_flight.pop_front();
          }
        }
        outstanding = in_flight.size() + (progress_in_flight ? 1 : 0);
        if (got == 0) link.cq->wait(kPollMs);
      }
      // (Not flushed in time: the caller destroys the queue pair before pull() returns, and
      // ibv_destroy_qp is the barrier after which nothing lands.)
      if (outstanding > 0) log_line(state.options, "a failed queue pair did not flush " + std::to_string(outstanding) + " reads in time");
    } catch (const VerbsError& verbs) {
      log_line(state.options, std::string("draining a failed queue pair: ") + verbs.what());
    }
    return net::PullOutcome{completed - begin, error, std::move(detail)};
  };

  std::vector<ibv_wc> completions(32);
  while (completed < total) {
    if (options.cancelled && options.cancelled()) return fail(net::ReadError::kCancelled, "cancelled");
    const auto now = Clock::now();
    // Follow a partial source: read its progress word whenever everything ready is posted.
    if (ready < total && posted == ready && !progress_in_flight && now - last_progress_read >= std::chrono::milliseconds(1)) {
      ibv_sge sge{reinterpret_cast<std::uintptr_t>(&link.progress_word), sizeof link.progress_word,
                  link.progress_region->get()->lkey};
      ibv_send_wr request{};
      ibv_send_wr* bad = nullptr;
      request.wr_id = kProgressRead;
      request.opcode = IBV_WR_RDMA_READ;
      request.send_flags = IBV_SEND_SIGNALED;
      request.sg_list = &sge;
      request.num_sge = 1;
      request.wr.rdma.remote_addr = opened.progress_address;
      request.wr.rdma.rkey = opened.progress_key;
      if (const int result = ibv_post_send(link.qp->get(), &request, &bad); result != 0) {
        return fail(net::ReadError::kUnreachable, std::string("ibv_post_send: ") + std::strerror(result));
      }
      progress_in_flight = true;
      last_progress_read = now;
    }
    // Post READs of what is ready, up to the depth.
    while (posted < ready && in_flight.size() < depth) {
      while (region < targets.size() && offset == targets[region].bytes) {
        ++region;
        offset = 0;
      }
      TH_ASSERT(region < targets.size(), "posted", posted, "of", total);
      if (options.rate_bytes_per_s > 0) {
        const double allowed = std::chrono::duration<double>(now - started).count() *
                               static_cast<double>(options.rate_bytes_per_s);
        if (static_cast<double>(posted - begin) > allowed) break;  // paced: post later
      }
      const std::uint64_t length =
          std::min({state.options.read_bytes, ready - posted, targets[region].bytes - offset});
      TH_ASSERT(length > 0);
      TH_ASSERT(offset + length <= remote[region].bytes, "a read inside the source's region");
      ibv_sge sge{reinterpret_cast<std::uintptr_t>(targets[region].base + offset), static_cast<std::uint32_t>(length),
                  local[region]->get()->lkey};
      ibv_send_wr request{};
      ibv_send_wr* bad = nullptr;
      request.wr_id = next_sequence;
      request.opcode = IBV_WR_RDMA_READ;
      request.sg_list = &sge;
      request.num_sge = 1;
      request.wr.rdma.remote_addr = remote[region].address + offset;
      request.wr.rdma.rkey = remote[region].key;
      const bool last_now = posted + length == ready || in_flight.size() + 1 == depth;
      // Selective signalling: completions of an RC queue pair come in order, so one signalled
      // READ tells that every earlier one landed too.
      // (Paced reads are each signalled: the loop may stop posting after any of them.)
      if (last_now || options.rate_bytes_per_s > 0 ||
          next_sequence % state.options.signal_every == state.options.signal_every - 1) {
        request.send_flags = IBV_SEND_SIGNALED;
      }
      if (const int result = ibv_post_send(link.qp->get(), &request, &bad); result != 0) {
        return fail(net::ReadError::kUnreachable, std::string("ibv_post_send: ") + std::strerror(result));
      }
      posted += length;
      offset += length;
      in_flight.push_back({next_sequence, posted});
      ++next_sequence;
      last_completion = in_flight.size() == 1 ? now : last_completion;
    }
    // Completions.
    int got = 0;
    try {
      got = link.cq->poll(completions.data(), static_cast<int>(completions.size()));
    } catch (const VerbsError& error) {
      return fail(net::ReadError::kUnreachable, error.what());
    }
    for (int i = 0; i < got; ++i) {
      const ibv_wc& completion = completions[i];
      if (completion.status != IBV_WC_SUCCESS) {
        // This request and (in order) every earlier one are done with, and so is every request of
        // the rest of this batch (flushed, most likely); fail() waits for the others.
        for (int rest = i; rest < got; ++rest) {
          if (completions[rest].wr_id == kProgressRead) {
            progress_in_flight = false;
          } else {
            while (!in_flight.empty() && in_flight.front().sequence <= completions[rest].wr_id) in_flight.pop_front();
          }
        }
        return fail(error_of(completion.status), "RDMA read from " + link.source + " failed: " +
                                                     ibv_wc_status_str(completion.status));
      }
      last_completion = Clock::now();
      if (completion.wr_id == kProgressRead) {
        progress_in_flight = false;
        const std::uint64_t word = std::min(link.progress_word, total);
        if (word > ready) {
          ready = word;
          last_growth = last_completion;
        }
        continue;
      }
      TH_ASSERT(!in_flight.empty() && in_flight.front().sequence <= completion.wr_id, "completions in order");
      while (!in_flight.empty() && in_flight.front().sequence <= completion.wr_id) {
        completed = in_flight.front().end;
        in_flight.pop_front();
      }
    }
    TH_ASSERT(completed <= posted);
    TH_ASSERT(posted <= ready);
    if (options.on_progress && (completed - reported >= options.progress_step_bytes || completed == total) &&
        completed > reported) {
      options.on_progress(completed);
      reported = completed;
    }
    if (got > 0) continue;
    const auto waited = Clock::now();
    if (!in_flight.empty() && waited - last_completion > std::chrono::milliseconds(options.io_timeout_ms)) {
      return fail(net::ReadError::kUnreachable, "RDMA reads from " + link.source + " made no progress for " +
                                                    std::to_string(options.io_timeout_ms) + " ms");
    }
    if (ready < total && posted == ready && waited - last_growth > std::chrono::milliseconds(options.stall_ms_max)) {
      return fail(net::ReadError::kStalled, "partial source " + link.source + " made no progress for " +
                                                std::to_string(options.stall_ms_max) + " ms");
    }
    // The source never writes on the link unasked: a readable link means it closed (the process
    // died: kill -9 closes its sockets at once, while its queue pair just stops answering).
    bool source_closed = false;
    if (!in_flight.empty() || progress_in_flight) {
      try {
        source_closed = link.cq->wait(kPollMs, link.socket.get()).watched;
      } catch (const VerbsError& error) {
        return fail(net::ReadError::kUnreachable, error.what());
      }
    } else {
      pollfd entry{link.socket.get(), POLLIN, 0};  // paced, or polling a partial source
      source_closed = ::poll(&entry, 1, 1) > 0;
    }
    if (source_closed) {
      // A revoked notice (this grant's, or an earlier one's still in the socket), or the end.
      RevokedNotice notice;
      try {
        if (!net::recv_all_or_eof_by(link.socket, &notice, sizeof notice, after_ms(1'000))) {
          return fail(net::ReadError::kUnreachable, "the source " + link.source + " closed its link");
        }
      } catch (const net::SocketError& error) {
        return fail(net::ReadError::kUnreachable, "the link to " + link.source + " failed: " + error.what());
      }
      if (notice.magic != kNoticeMagic) {
        return fail(net::ReadError::kUnreachable, "the source " + link.source + " sent what is not a notice");
      }
      if (notice.transfer == key.transfer && notice.epoch == key.epoch) {
        return fail(net::ReadError::kRefused, "the source revoked the grant");
      }
    }
  }
  TH_ASSERT(in_flight.empty());
  TH_ASSERT(completed == end);
  return net::PullOutcome{completed - begin, std::nullopt, ""};
}

}  // namespace

namespace {

// One rail of a pull: its link, and the grant as the source answered on it.
struct Rail {
  std::vector<std::shared_ptr<MemoryRegion>> local;  // the targets' registrations on this rail's device
  Acquired acquired;
  OpenAnswer answer;
  std::vector<RemoteRegion> remote;
  bool fall_back = false;                 // the source cannot do RDMA (or not for this grant): TCP
  std::optional<net::PullOutcome> failed;  // or the open failed thus
  std::uint64_t begin = 0;                 // the layout bytes this rail reads
  std::uint64_t end = 0;
  net::PullOutcome outcome;
  bool broken = false;
};

Request open_request(Kind kind, net::GrantKey key, const GrantSecret& secret) {
  Request request;
  request.kind = kind;
  request.transfer = key.transfer;
  request.epoch = key.epoch;
  if (kind == Kind::kOpen) std::memcpy(request.gid.data(), secret.data(), sizeof secret);
  return request;
}

// Acquires a link on `port` and opens the grant on it (dialling once more when a kept link turns
// out to be closed: the source may have shed it while idle, or restarted).
Rail open_rail(RdmaTransport::State& state, const net::Endpoint& source, std::size_t port, net::GrantKey key,
               const GrantSecret& secret, std::span<const net::LocalRegion> targets, std::uint64_t target_bytes,
               const net::PullOptions& options) {
  std::vector<std::shared_ptr<MemoryRegion>> local(targets.size());
  // GPU targets first: RDMA READs land straight in GPU memory when it is registered here; if one
  // cannot be, the whole pull goes over TCP (which stages GPU memory through pinned host memory),
  // and the host targets need not be pinned for nothing.
  for (std::size_t i = 0; i < targets.size(); ++i) {
    if (targets[i].bytes == 0 || !targets[i].on_device) continue;
    Result<std::shared_ptr<MemoryRegion>> device = state.device_region_for(port, targets[i].base, targets[i].bytes);
    if (!device) {
      // A registration that failed was logged as it failed; a bad pointer (the application's) here.
      if (device.error().code == Errc::kInvalidArgument) {
        log_line(state.options, "a pull's GPU target is not registered (pulling over TCP): " + device.error().detail);
      }
      Rail rail;
      rail.fall_back = true;
      return rail;
    }
    local[i] = std::move(device).value();
  }
  try {
    for (std::size_t i = 0; i < targets.size(); ++i) {
      if (targets[i].bytes > 0 && !targets[i].on_device) local[i] = state.region_for(port, targets[i].base, targets[i].bytes);
    }
  } catch (const VerbsError& error) {
    // Most likely the memlock limit (registration pins pages): this pull goes over TCP.
    log_line(state.options, std::string("cannot register the reader's memory (pulling over TCP; is the memlock limit ") +
             "high enough?): " + error.what());
    Rail rail;
    rail.fall_back = true;
    return rail;
  }
  // Kept links the source has closed are dropped as they are found (still_up() looks first, but a
  // close may cross the open): dial on while the failure was a kept link's.
  constexpr int kKeptLinksTriedMax = 4;
  for (int attempt = 0;; ++attempt) {
    Rail rail;
    rail.local = local;
    rail.acquired = acquire(state, source, port, options.connect_timeout_ms);
    if (rail.acquired.link == nullptr) {
      if (rail.acquired.failed == NoLink::kNoRdma) {
        rail.fall_back = true;
      } else {
        rail.failed = net::PullOutcome{0, net::ReadError::kUnreachable,
                                       "cannot reach " + source.to_string() + ": " + rail.acquired.why};
      }
      return rail;
    }
    Link& link = *rail.acquired.link;
    auto refused = [&](std::string why) {
      release(state, rail.acquired.link, true);
      rail.acquired.link.reset();
      rail.failed = net::PullOutcome{0, net::ReadError::kRefused, std::move(why)};
      return std::move(rail);
    };
    try {
      // The source may wait for its grant (grant_wait_ms_max) before it answers.
      const Deadline deadline = after_ms(state.options.handshake_timeout_ms + state.grant_wait_ms_max);
      const Request open = open_request(Kind::kOpen, key, secret);
      net::send_all_by(link.socket, &open, sizeof open, deadline);
      if (!recv_answer(link.socket, &rail.answer, sizeof rail.answer, deadline)) {
        throw net::SocketError("the source closed the link");
      }
      if (rail.answer.status == Answer::kOk) {
        if (rail.answer.regions != targets.size()) {
          return refused("the source exposes " + std::to_string(rail.answer.regions) + " regions, the reader has " +
                         std::to_string(targets.size()));
        }
        rail.remote.resize(rail.answer.regions);
        if (!net::recv_all_or_eof_by(link.socket, rail.remote.data(), rail.remote.size() * sizeof(RemoteRegion),
                                     deadline)) {
          throw net::SocketError("the source closed the link mid-answer");
        }
      }
    } catch (const net::SocketError& error) {
      release(state, rail.acquired.link, true);
      if (rail.acquired.reused && attempt < kKeptLinksTriedMax) continue;
      rail.acquired.link.reset();
      rail.failed = net::PullOutcome{0, net::ReadError::kUnreachable, "RDMA open at " + source.to_string() + ": " + error.what()};
      return rail;
    }
    if (rail.answer.status == Answer::kNoGrant) {
      release(state, rail.acquired.link, false);
      rail.acquired.link.reset();
      rail.failed = net::PullOutcome{0, net::ReadError::kRefused, "the source refuses the grant (no grant, or revoked)"};
      return rail;
    }
    if (rail.answer.status != Answer::kOk) {
      release(state, rail.acquired.link, false);  // no room for this grant on RDMA there now
      rail.acquired.link.reset();
      rail.fall_back = true;
      return rail;
    }
    for (std::size_t i = 0; i < targets.size(); ++i) {
      if (rail.remote[i].bytes != targets[i].bytes) {
        return refused("region " + std::to_string(i) + " differs in size at the source");
      }
    }
    if (rail.answer.total_bytes != target_bytes) return refused("the source's total size differs");
    return rail;
  }
}

// Ends a rail's use of its link: closes the grant there (its windows go now, not at revoke), and
// gives the link back, or destroys it if broken. After this no READ of the rail can land.
void finish_rail(RdmaTransport::State& state, Rail& rail, net::GrantKey key) {
  if (rail.acquired.link == nullptr) return;
  if (!rail.broken) {
    const Request close = open_request(Kind::kClose, key, {});
    try {
      net::send_all_by(rail.acquired.link->socket, &close, sizeof close, after_ms(state.options.handshake_timeout_ms));
    } catch (const net::SocketError&) {
      rail.broken = true;
    }
  }
  release(state, rail.acquired.link, rail.broken);
  // A broken link's queue pair is destroyed here, before pull() returns: after ibv_destroy_qp no
  // READ of it can land in the targets (the caller may reuse them at once).
  if (rail.broken) TH_ASSERT(rail.acquired.link.use_count() == 1, "a broken link is ours alone");
  rail.acquired.link.reset();
}

// Where each rail's part ends: near equal parts of [0, total), cut at read boundaries.
std::vector<std::uint64_t> stripe_ends(std::uint64_t total, std::size_t rails, std::uint64_t read_bytes) {
  std::vector<std::uint64_t> ends;
  for (std::size_t i = 1; i < rails; ++i) {
    const std::uint64_t cut = total / rails * i / read_bytes * read_bytes;
    ends.push_back(std::max(cut, ends.empty() ? 0 : ends.back()));
  }
  ends.push_back(total);
  return ends;
}

}  // namespace

namespace {

// Every rail still holding a link when pull() leaves by an exception lets it go as broken (its
// queue pair destroyed): no READ of it lands later, and no link stays marked in use for ever.
struct RailsGuard {
  RdmaTransport::State& state;
  std::vector<Rail>& rails;
  net::GrantKey key;
  ~RailsGuard() {
    for (Rail& rail : rails) {
      if (rail.acquired.link == nullptr) continue;
      rail.broken = true;
      release(state, rail.acquired.link, true);
      rail.acquired.link.reset();
    }
  }
};

// read_grant, and if it throws (a bug: an assertion), the rail's queue pair is failed before the
// exception goes on, so that the link is dropped and nothing of it lands later.
void read_rail(RdmaTransport::State& state, Rail& rail, net::GrantKey key, std::span<const net::LocalRegion> targets,
               std::uint64_t begin, std::uint64_t end, const net::PullOptions& options) {
  try {
    rail.outcome = read_grant(state, *rail.acquired.link, key, rail.remote, rail.answer, targets, rail.local, begin,
                              end, options, rail.broken);
  } catch (...) {
    rail.broken = true;
    try {
      rail.acquired.link->qp->fail();
    } catch (const VerbsError&) {
      // The link is destroyed anyway.
    }
    throw;
  }
}

}  // namespace

net::PullOutcome RdmaTransport::pull(const net::Endpoint& source, net::GrantKey key, const GrantSecret& secret,
                                     std::span<const net::LocalRegion> targets, const net::PullOptions& options) {
  State& state = *state_;
  auto over_tcp = [&] {
    ++state.pulls_fell_back;
    ++state.pulls_tcp;
    return net::pull(source, key, secret, targets, options);
  };
  std::uint64_t target_bytes = 0;
  for (const net::LocalRegion& target : targets) target_bytes += target.bytes;
  TH_REQUIRE(options.start_bytes <= target_bytes, "a resume starts within the targets");
  if (options.start_bytes == target_bytes) return net::PullOutcome{};  // all here: no source needed
  // Resume (PullOptions::start_bytes) from a partial source: over TCP, which asks the source to
  // wait for the bytes at the resume point; read_grant follows a partial source from byte 0, and
  // must not write again the prefix the reader verified and may have handed out.
  if (options.partial && options.start_bytes > 0) return over_tcp();
  const std::uint64_t start = options.start_bytes;
  // A complete source that is big enough is read over every rail at once; a partial one is
  // followed in layout order on rail 0.
  const std::size_t wanted =
      !options.partial && target_bytes - start >= state.options.stripe_bytes_min ? state.ports.size() : 1;
  std::vector<Rail> rails;
  rails.reserve(wanted);
  RailsGuard guard{state, rails, key};
  rails.push_back(open_rail(state, source, 0, key, secret, targets, target_bytes, options));
  if (rails[0].fall_back) return over_tcp();
  if (rails[0].failed) return *rails[0].failed;
  for (std::size_t port = 1; port < wanted; ++port) {
    Rail rail = open_rail(state, source, port, key, secret, targets, target_bytes, options);
    if (rail.failed && rail.failed->error == net::ReadError::kRefused) {
      for (Rail& opened : rails) finish_rail(state, opened, key);
      return *rail.failed;
    }
    if (rail.fall_back || rail.failed) continue;  // the other rails read its part (logged by acquire)
    rails.push_back(std::move(rail));
  }
  std::vector<std::uint64_t> ends = stripe_ends(target_bytes - start, rails.size(), state.options.read_bytes);
  for (std::uint64_t& end : ends) end += start;
  for (std::size_t i = 0; i < rails.size(); ++i) {
    rails[i].begin = i == 0 ? start : ends[i - 1];
    rails[i].end = ends[i];
  }
  if (rails.size() == 1) {
    Rail& rail = rails[0];
    read_rail(state, rail, key, targets, start, target_bytes, options);
    state.ports[rail.acquired.link->port]->bytes_read += rail.outcome.bytes;
    finish_rail(state, rail, key);
    if (rail.outcome.ok()) ++state.pulls_rdma;
    return rail.outcome;
  }
  // Striped: one thread per further rail. The landed prefix (for on_progress) is the whole of
  // every leading rail that finished plus the next one's part. A failure of rail 0, a refusal
  // (the grant was revoked) or a cancel stops every rail; any other failure of a further rail
  // (its devices do not reach each other, say) leaves its remainder to rail 0 below.
  std::atomic<bool> stop{false};
  std::mutex progress_mutex;
  std::vector<std::uint64_t> done(rails.size());
  for (std::size_t i = 0; i < rails.size(); ++i) done[i] = rails[i].begin;
  net::OrderedProgress progress(options.on_progress);  // (outside progress_mutex: the rails go on meanwhile)
  auto report = [&](std::size_t i, std::uint64_t landed) {
    std::uint64_t prefix = 0;
    {
      std::lock_guard lock(progress_mutex);
      done[i] = std::max(done[i], landed);
      for (std::size_t r = 0; r < rails.size(); ++r) {
        prefix = done[r];
        if (done[r] < rails[r].end) break;
      }
    }
    progress.tell(prefix);
  };
  auto options_of = [&](std::size_t i) {
    net::PullOptions mine = options;
    // The cap is on the shard's receive rate: the rails share it.
    if (options.rate_bytes_per_s > 0) mine.rate_bytes_per_s = std::max<std::uint64_t>(1, options.rate_bytes_per_s / rails.size());
    mine.cancelled = [&] { return stop.load() || (options.cancelled && options.cancelled()); };
    mine.on_progress = [&, i](std::uint64_t landed) { report(i, landed); };
    return mine;
  };
  auto run = [&](std::size_t i) {
    Rail& rail = rails[i];
    read_rail(state, rail, key, targets, rail.begin, rail.end, options_of(i));
    const bool stops_all = i == 0 || rail.outcome.error == net::ReadError::kRefused;
    if (!rail.outcome.ok() && stops_all) stop.store(true);
  };
  std::vector<std::thread> threads;
  std::vector<std::exception_ptr> errors(rails.size());
  std::vector<bool> ran(rails.size(), true);
  for (std::size_t i = 1; i < rails.size(); ++i) {
    try {
      threads.emplace_back([&, i] {
        try {
          run(i);
        } catch (...) {
          errors[i] = std::current_exception();
          stop.store(true);
        }
      });
    } catch (const std::system_error&) {
      ran[i] = false;  // no thread for it: rail 0 reads its part below
    }
  }
  try {
    run(0);
  } catch (...) {
    errors[0] = std::current_exception();
    stop.store(true);
  }
  for (std::thread& thread : threads) thread.join();
  for (const std::exception_ptr& error : errors) {
    if (error) std::rethrow_exception(error);  // a bug: the guard lets every rail go as broken
  }
  // Rail 0 rescues the remainder of every further rail that failed on its own (or never ran).
  Rail& first = rails[0];
  std::uint64_t rescued = 0;
  for (std::size_t i = 1; i < rails.size() && first.outcome.ok() && !stop.load(); ++i) {
    Rail& rail = rails[i];
    const bool failed_alone = !ran[i] || (!rail.outcome.ok() && rail.outcome.error != net::ReadError::kRefused &&
                                          rail.outcome.error != net::ReadError::kCancelled);
    if (!failed_alone) continue;
    const std::uint64_t from = ran[i] ? rail.begin + rail.outcome.bytes : rail.begin;
    if (ran[i]) {
      std::lock_guard lock(state.links_mutex);
      mark_rail_out(state, {source.to_string(), rail.acquired.link->port});
      log_line(state.options, "rail " + std::to_string(rail.acquired.link->port) + " to " + source.to_string() +
               " is out (rail 0 reads its part): " + rail.outcome.detail);
    }
    const std::uint64_t first_bytes = first.outcome.bytes;
    read_rail(state, first, key, targets, from, rail.end, options_of(i));
    rescued += first.outcome.bytes;
    state.ports[first.acquired.link->port]->bytes_read += first.outcome.bytes;
    // Rail i's part is whole now (or not, and then rail 0 failed too and names why).
    rail.outcome.error = first.outcome.error;
    rail.outcome.detail = first.outcome.detail;
    first.outcome.bytes = first_bytes;
  }
  net::PullOutcome outcome;
  outcome.bytes = rescued;
  for (Rail& rail : rails) {
    const std::size_t port = rail.acquired.link->port;
    state.ports[port]->bytes_read += rail.outcome.bytes;
    outcome.bytes += rail.outcome.bytes;
    // The first real failure names the outcome (the others were stopped because of it).
    if (!rail.outcome.ok() && (!outcome.error || *outcome.error == net::ReadError::kCancelled)) {
      outcome.error = rail.outcome.error;
      outcome.detail = "rail " + std::to_string(port) + ": " + rail.outcome.detail;
    }
    finish_rail(state, rail, key);
  }
  if (outcome.ok()) {
    ++state.pulls_rdma;
    ++state.pulls_striped;
  }
  return outcome;
}

}  // namespace th::rdma
