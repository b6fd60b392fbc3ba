// GCC 12 reports kj::Own inside capnp::makeRpcServer as maybe uninitialized once that call is
// inlined here (a false positive that comes and goes with unrelated changes to the schema).
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include "tools/bench_control.h"

#include <capnp/rpc-twoparty.h>
#include <kj/async-io.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <deque>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iomanip>
#include <iostream>
#include <memory>
#include <vector>

#include "core/agent.h"
#include "net/event_loop.h"
#include "net/frames.h"
#include "net/tls.h"
#include "net/wire.h"

// Cap'n Proto's generated Server classes have virtual methods and a non-virtual destructor; kj owns
// them through kj::Own, which deletes the most-derived type, so the warning does not apply.
#pragma GCC diagnostic ignored "-Wnon-virtual-dtor"

namespace th::bench {
namespace {

constexpr std::uint32_t kSendsInFlightMax = 4;  // Session.send calls per connection, as libthclient
constexpr TimeMs kTickMs = 100;                 // how often agents hear the clock
constexpr std::size_t kLatenciesMax = 20'000'000;  // samples kept for the percentiles

TimeMs now_ms() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

double now_us() {
  return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// What every shard of every replica publishes: tiny, the benchmark is about the control plane.
struct Shape {
  std::vector<LayoutRef> layouts;
  std::vector<ChecksumsRef> checksums;
  explicit Shape(std::uint32_t shards) {
    for (std::uint32_t shard = 0; shard < shards; ++shard) {
      layouts.push_back(ShardLayout::make({{"w" + std::to_string(shard), DType::kBFloat16, 1 << 20}}).value());
      checksums.push_back(std::make_shared<const Checksums>(Checksums{shard + 1ULL}));
    }
  }
};

class Load;

struct Client {
  std::uint32_t replica = 0;
  std::uint32_t shard = 0;
  std::unique_ptr<ShardAgent> agent;
  // --rpc: a Cap'n Proto RPC connection, a bounded number of Session.send calls in flight.
  kj::Own<kj::AsyncIoStream> stream;
  kj::Own<capnp::TwoPartyClient> rpc;
  kj::Maybe<wire::Session::Client> session;
  std::uint32_t sends_in_flight = 0;
  // Else a framed one, as libthclient's.
  kj::Own<net::FrameStream> frames;
  kj::Maybe<kj::Promise<void>> reading;
  std::uint64_t acks_asked = 0;
  std::vector<net::ToHubMessage> queue;
  std::uint64_t round = 1;  // publishes 2 * round + replica % 2, as bench/hub_bench.cpp
  int phase = 0;            // 0 publish, 1 update, 2 unpublish
  std::uint64_t next_call_id = 1;
  double call_started_us = 0;
  bool opened = false;
  bool trainer() const { return replica == 0; }
};

class SinkImpl final : public wire::Sink::Server {
 public:
  SinkImpl(Load& load, Client& client) : load_(load), client_(client) {}
  kj::Promise<void> deliver(DeliverContext context) override;

 private:
  Load& load_;
  Client& client_;
};

class Load : private kj::TaskSet::ErrorHandler {
 public:
  Load(const ControlLoadOptions& options, net::IoLoop& loop)
      : options_(options), loop_(loop), shape_(options.shards), tasks_(*this) {}

  int run();
  void step(Client& client, const AgentInput& input);

 private:
  void taskFailed(kj::Exception&& exception) override {
    if (failures_++ == 0) std::cerr << "th-bench control-load: " << exception.getDescription().cStr() << "\n";
  }
  void connect(Client& client, kj::NetworkAddress& address);
  void connect_framed(Client& client);
  kj::Promise<void> read_frames(Client& client);
  void echo_frame(Client& client);
  int run_burst();
  void apply(Client& client, const AgentEffect& effect);
  void post(Client& client, AgentInput input) {
    tasks_.add(kj::evalLater([this, &client, input = std::move(input)] { step(client, input); }));
  }
  void next_call(Client& client);
  void flush(Client& client);
  kj::Promise<void> tick_loop();
  kj::Promise<void> echo_loop(Client& client);
  void record(double latency_us, bool error);
  kj::Promise<void> wait_for_start();

  const ControlLoadOptions& options_;
  net::IoLoop& loop_;
  Shape shape_;
  std::unique_ptr<kj::TlsContext> tls_;  // before clients_: outlives their streams
  std::vector<std::unique_ptr<Client>> clients_;
  std::uint32_t ready_ = 0;
  bool measuring_ = false;
  std::uint64_t ops_ = 0;
  std::uint64_t errors_ = 0;
  std::string first_error_;
  std::uint64_t failures_ = 0;
  std::vector<double> latencies_us_;
  // The burst: trainer shards whose publish was answered; update answers and the last one's time.
  std::uint32_t published_ = 0;
  std::uint64_t burst_answered_ = 0;
  double burst_last_us_ = 0;
  kj::TaskSet tasks_;
};

kj::Promise<void> SinkImpl::deliver(DeliverContext context) {
  for (auto effect : context.getParams().getEffects()) {
    auto decoded = net::decode(effect);
    if (!decoded.ok()) {
      std::cerr << "th-bench control-load: invalid effect: " << decoded.error().detail << "\n";
      continue;
    }
    load_.step(client_, FromHub{0, std::move(decoded).value()});
  }
  return kj::READY_NOW;
}

void Load::record(double latency_us, bool error) {
  if (!measuring_) return;
  ++ops_;
  if (error) ++errors_;
  if (latencies_us_.size() < kLatenciesMax) latencies_us_.push_back(latency_us);
}

void Load::step(Client& client, const AgentInput& input) {
  AgentEffects effects;
  client.agent->step(input, now_ms(), effects);
  for (const AgentEffect& effect : effects) apply(client, effect);
}

void Load::apply(Client& client, const AgentEffect& effect) {
  std::visit(
      [&](const auto& e) {
        using T = std::decay_t<decltype(e)>;
        if constexpr (std::is_same_v<T, SendRequest>) {
          client.queue.push_back(e.request);
          flush(client);
        } else if constexpr (std::is_same_v<T, SendReport>) {
          client.queue.push_back(e.report);
          flush(client);
        } else if constexpr (std::is_same_v<T, BeginRead>) {
          // An instantaneous data plane: the read is done as soon as it starts.
          post(client, ReadFinished{e.read.transfer, e.read.epoch, std::nullopt});
        } else if constexpr (std::is_same_v<T, MakeOffload>) {
          post(client, OffloadFinished{e.version});
        } else if constexpr (std::is_same_v<T, CallDone>) {
          const Error* error = std::get_if<Error>(&e.outcome);
          if (!client.opened) {
            if (error != nullptr) {
              std::cerr << "th-bench control-load: open failed: " << error->detail << "\n";
              std::exit(1);
            }
            client.opened = true;
            if (++ready_ == clients_.size()) std::cout << "control ready " << ready_ << std::endl;
            if (options_.burst) return;  // its one call comes at the burst
          } else if (options_.burst) {
            if (client.trainer()) {
              ++published_;
            } else {
              if (error != nullptr && first_error_.empty()) first_error_ = error->detail;
              record(now_us() - client.call_started_us, error != nullptr);
              ++burst_answered_;
              burst_last_us_ = std::max(burst_last_us_, now_us());
            }
            return;
          } else {
            if (error != nullptr && first_error_.empty()) first_error_ = error->detail;
            record(now_us() - client.call_started_us, error != nullptr);
            client.phase = (client.phase + 1) % 3;
            if (client.phase == 0) ++client.round;
          }
          tasks_.add(kj::evalLater([this, &client] { next_call(client); }));
        }
        // Grants, revocations, cancellations and freed offloads concern a data plane there is not.
      },
      effect);
}

void Load::next_call(Client& client) {
  RequestBody body;
  const std::uint32_t shard = client.shard;
  switch (client.phase) {
    case 0:
      body = PublishRequest{2 * client.round + client.replica % 2, shape_.layouts[shard], shape_.checksums[shard]};
      break;
    case 1:
      body = UpdateRequest{Selector::latest(), shape_.layouts[shard]};
      break;
    default:
      body = UnpublishRequest{};
  }
  client.call_started_us = now_us();
  step(client, UserCall{client.next_call_id++, std::move(body)});
}

void Load::flush(Client& client) {
  if (client.frames.get() != nullptr) {
    if (client.queue.empty()) return;
    client.frames->append<wire::ClientFrame>([&](wire::ClientFrame::Builder frame) {
      auto list = frame.initMessages(static_cast<unsigned>(client.queue.size()));
      for (std::size_t i = 0; i < client.queue.size(); ++i) net::encode(client.queue[i], list[static_cast<unsigned>(i)]);
    });
    client.queue.clear();
    client.frames->flush();
    return;
  }
  KJ_IF_MAYBE(session, client.session) {
    while (client.sends_in_flight < kSendsInFlightMax && !client.queue.empty()) {
      const std::size_t count = std::min(client.queue.size(), net::kMessagesPerCallMax);
      auto request = session->sendRequest();
      auto list = request.initMessages(static_cast<unsigned>(count));
      for (std::size_t i = 0; i < count; ++i) net::encode(client.queue[i], list[static_cast<unsigned>(i)]);
      client.queue.erase(client.queue.begin(), client.queue.begin() + static_cast<long>(count));
      ++client.sends_in_flight;
      tasks_.add(request.send().ignoreResult().then([this, &client] {
        --client.sends_in_flight;
        flush(client);
      }));
    }
  }
}

// A client id unique across load processes, from replica and shard (0 names no client).
ClientId client_id_of(const Client& client) {
  return ((static_cast<ClientId>(client.replica) << 8) | client.shard) + 1;
}

void Load::connect(Client& client, kj::NetworkAddress& address) {
  client.stream = address.connect().wait(loop_.wait_scope());
  if (tls_ != nullptr) {
    client.stream = tls_->wrapClient(kj::mv(client.stream), net::tls_server_name(options_.server, options_.tls_server_name))
                        .wait(loop_.wait_scope());
  }
  if (!options_.rpc) {
    connect_framed(client);
    return;
  }
  client.rpc = kj::heap<capnp::TwoPartyClient>(*client.stream);
  auto request = client.rpc->bootstrap().castAs<wire::Hub>().connectRequest();
  request.setToken(options_.token);
  request.setSink(kj::heap<SinkImpl>(*this, client));
  request.setClientName("bench-" + std::to_string(client.replica) + "/" + std::to_string(client.shard));
  // A benchmark's clients are not attacked: a secret derived from the id is enough.
  const ClientId id = client_id_of(client);
  kj::byte secret[16] = {};
  std::memcpy(secret, &id, sizeof id);
  request.setClient(id);
  request.setClientSecret(kj::arrayPtr(secret, sizeof secret));
  auto connected = request.send();
  client.session = connected.getSession();
  tasks_.add(connected.ignoreResult());
}

void Load::connect_framed(Client& client) {
  client.frames = kj::heap<net::FrameStream>(kj::mv(client.stream), tls_ == nullptr ? &loop_.port() : nullptr);
  client.frames->on_written([this, &client] { flush(client); });
  client.frames->append_bytes(kj::arrayPtr(net::kFramedMagic.data(), net::kFramedMagic.size()));
  client.frames->append<wire::ClientFrame>([&](wire::ClientFrame::Builder frame) {
    auto hello = frame.initHello();
    hello.setToken(options_.token);
    hello.setClientName("bench-" + std::to_string(client.replica) + "/" + std::to_string(client.shard));
    const ClientId id = client_id_of(client);
    kj::byte secret[16] = {};  // a benchmark's clients are not attacked
    std::memcpy(secret, &id, sizeof id);
    hello.setClient(id);
    hello.setClientSecret(kj::arrayPtr(secret, sizeof secret));
  });
  client.frames->flush();
  client.reading = read_frames(client).eagerlyEvaluate([this](kj::Exception&& exception) { taskFailed(kj::mv(exception)); });
}

kj::Promise<void> Load::read_frames(Client& client) {
  return client.frames->read_some().then([this, &client](bool more) -> kj::Promise<void> {
    if (!more) return KJ_EXCEPTION(DISCONNECTED, "the server closed a connection");
    while (capnp::MessageReader* message = client.frames->next_frame()) {
      auto frame = message->getRoot<wire::ServerFrame>();
      if (frame.isRefused()) return KJ_EXCEPTION(FAILED, "refused", frame.getRefused().cStr());
      if (frame.isNotice()) std::cerr << "th-bench control-load: notice: " << frame.getNotice().cStr() << "\n";
      if (frame.isEffects()) {
        for (auto effect : frame.getEffects()) {
          auto decoded = net::decode(effect);
          if (!decoded.ok()) {
            std::cerr << "th-bench control-load: invalid effect: " << decoded.error().detail << "\n";
            continue;
          }
          step(client, FromHub{0, std::move(decoded).value()});
        }
      }
      if (options_.echo && frame.getAck() != 0 && frame.getAck() == client.acks_asked) {
        record(now_us() - client.call_started_us, false);
        echo_frame(client);
      }
    }
    return read_frames(client);
  });
}

void Load::echo_frame(Client& client) {
  client.frames->append<wire::ClientFrame>([&](wire::ClientFrame::Builder frame) {
    auto report = frame.initMessages(1)[0].initReport();
    report.setClient(client.replica);
    report.setSession(1);
    report.getBody().setHeartbeat();
    frame.setAck(++client.acks_asked);
  });
  client.call_started_us = now_us();
  client.frames->flush();
}

kj::Promise<void> Load::tick_loop() {
  return loop_.timer().afterDelay(kTickMs * kj::MILLISECONDS).then([this] {
    const TimeMs now = now_ms();
    for (auto& client : clients_) {
      if (client->agent == nullptr) continue;
      const auto due = client->agent->next_deadline_ms();
      if (due && *due <= now) step(*client, AgentTick{});
    }
    return tick_loop();
  });
}

kj::Promise<void> Load::echo_loop(Client& client) {
  KJ_IF_MAYBE(session, client.session) {
    auto request = session->sendRequest();
    auto report = request.initMessages(1)[0].initReport();
    report.setClient(client.replica);
    report.setSession(1);
    report.getBody().setHeartbeat();
    const double started = now_us();
    return request.send().ignoreResult().then([this, &client, started] {
      record(now_us() - started, false);
      return echo_loop(client);
    });
  }
  return kj::READY_NOW;
}

kj::Promise<void> Load::wait_for_start() {
  if (options_.start_file.empty() || std::filesystem::exists(options_.start_file)) return kj::READY_NOW;
  return loop_.timer().afterDelay(10 * kj::MILLISECONDS).then([this] { return wait_for_start(); });
}

int Load::run() {
  if (options_.shards == 0 || options_.clients % options_.shards != 0) {
    std::cerr << "th-bench control-load: --clients must be a multiple of --shards\n";
    return 2;
  }
  if (!options_.tls_ca_file.empty()) {
    auto tls = net::make_client_tls(options_.tls_ca_file);
    if (!tls.ok()) {
      std::cerr << "th-bench control-load: " << tls.error().detail << "\n";
      return 2;
    }
    tls_ = std::move(tls).value();
  }
  auto address = loop_.io().getNetwork().parseAddress(options_.server).wait(loop_.wait_scope());
  for (std::uint32_t i = 0; i < options_.clients; ++i) {
    auto client = std::make_unique<Client>();
    client->replica = options_.first_replica + i / options_.shards;
    client->shard = i % options_.shards;
    connect(*client, *address);
    clients_.push_back(std::move(client));
  }
  if (options_.echo) {
    std::cout << "control ready " << clients_.size() << std::endl;
  } else {
    tasks_.add(tick_loop());
    for (auto& client : clients_) {
      const ClientId id = client_id_of(*client);
      // Heartbeats every 5 s: their cost is the idle-fleet benchmark's subject, not this one's.
      // Retransmissions as libthclient's (TCP loses nothing while the connection lives).
      client->agent = std::make_unique<ShardAgent>(AgentConfig{id, 1, 5000, options_.retry_initial_ms, 60000});
      OpenRequest open;
      open.model = "bench-control";
      open.replica = "replica-" + std::to_string(client->replica);
      open.incarnation = 1;
      open.shard = client->shard;
      open.num_shards = options_.shards;
      open.datacenter = "dc0";
      open.role = client->replica == 0 ? "trainer" : "rollout";
      open.data_endpoint = "127.0.0.1:1";
      step(*client, UserCall{client->next_call_id++, std::move(open)});
    }
    while (ready_ < clients_.size()) {
      loop_.timer().afterDelay(10 * kj::MILLISECONDS).wait(loop_.wait_scope());
      if (failures_ > 0) return 1;
    }
  }
  if (options_.burst) return run_burst();
  wait_for_start().wait(loop_.wait_scope());
  measuring_ = true;
  const double started_us = now_us();
  if (options_.echo) {
    for (auto& client : clients_) {
      if (client->frames.get() != nullptr) {
        echo_frame(*client);
      } else {
        tasks_.add(echo_loop(*client));
      }
    }
  }
  loop_.timer().afterDelay(static_cast<std::int64_t>(options_.seconds * 1000) * kj::MILLISECONDS).wait(loop_.wait_scope());
  measuring_ = false;
  const double window_s = (now_us() - started_us) / 1e6;
  std::sort(latencies_us_.begin(), latencies_us_.end());
  auto percentile = [&](double p) {
    return latencies_us_.empty() ? 0.0 : latencies_us_[static_cast<std::size_t>(p * double(latencies_us_.size() - 1))];
  };
  std::cout << std::fixed << std::setprecision(1) << "RESULT control_ops=" << ops_ << " control_seconds=" << window_s << " control_p50_us=" << percentile(0.5)
            << " control_p99_us=" << percentile(0.99) << " control_errors=" << errors_ << std::endl;
  if (!first_error_.empty()) std::cerr << "th-bench control-load: first error: " << first_error_ << "\n";
  std::cout.flush();
  std::_Exit(failures_ > 0 ? 1 : 0);  // 8,192 connections need no orderly goodbye
}

int Load::run_burst() {
  constexpr double kBurstAnswerWaitUs = 60e6;  // a burst not answered by then is reported as such
  constexpr double kStartLeadUs = 300'000;     // every process sees the start file well before it
  std::vector<Client*> trainers;
  for (auto& client : clients_) {
    if (client->trainer()) trainers.push_back(client.get());
  }
  if (!trainers.empty()) {
    for (Client* trainer : trainers) {
      step(*trainer, UserCall{trainer->next_call_id++, PublishRequest{1, shape_.layouts[trainer->shard], shape_.checksums[trainer->shard]}});
    }
    while (published_ < trainers.size()) {
      loop_.timer().afterDelay(1 * kj::MILLISECONDS).wait(loop_.wait_scope());
      if (failures_ > 0) return 1;
    }
    std::cout << "control published " << std::fixed << std::setprecision(0) << now_us() + kStartLeadUs << std::endl;
  }
  wait_for_start().wait(loop_.wait_scope());
  double start_us = 0;
  {
    std::ifstream start(options_.start_file);
    start >> start_us;
  }
  if (start_us <= 0) {
    std::cerr << "th-bench control-load: the start file names no start time\n";
    return 2;
  }
  while (now_us() + 2000 < start_us) loop_.timer().afterDelay(1 * kj::MILLISECONDS).wait(loop_.wait_scope());
  while (now_us() < start_us) {
  }
  measuring_ = true;
  std::uint64_t calls = 0;
  for (auto& client : clients_) {
    if (client->trainer()) continue;
    client->call_started_us = now_us();
    step(*client, UserCall{client->next_call_id++, UpdateRequest{Selector::latest(), shape_.layouts[client->shard]}});
    ++calls;
  }
  const double issued_us = now_us();
  while (burst_answered_ < calls && now_us() - start_us < kBurstAnswerWaitUs && failures_ == 0) {
    loop_.timer().afterDelay(1 * kj::MILLISECONDS).wait(loop_.wait_scope());
  }
  std::sort(latencies_us_.begin(), latencies_us_.end());
  auto percentile = [&](double p) {
    return latencies_us_.empty() ? 0.0 : latencies_us_[static_cast<std::size_t>(p * double(latencies_us_.size() - 1))];
  };
  std::cout << std::fixed << std::setprecision(1) << "RESULT burst_calls=" << calls << " burst_answered=" << burst_answered_
            << " burst_issue_us=" << issued_us - start_us << " burst_last_us=" << burst_last_us_ - start_us
            << " burst_p50_us=" << percentile(0.5) << " burst_p99_us=" << percentile(0.99) << " burst_errors=" << errors_
            << std::endl;
  if (!first_error_.empty()) std::cerr << "th-bench control-load: first error: " << first_error_ << "\n";
  std::cout.flush();
  std::_Exit(failures_ > 0 || burst_answered_ < calls ? 1 : 0);
}

// ---- The echo server ----------------------------------------------------------------------------

class EchoSession final : public wire::Session::Server {
 protected:
  kj::Promise<void> send(SendContext) override { return kj::READY_NOW; }
};

class EchoHub final : public wire::Hub::Server {
 protected:
  kj::Promise<void> connect(ConnectContext context) override {
    context.getResults().setSession(kj::heap<EchoSession>());
    return kj::READY_NOW;
  }
};

struct EchoConnection {
  // RPC
  kj::Own<kj::AsyncIoStream> stream;
  kj::Own<capnp::TwoPartyVatNetwork> network;
  kj::Own<capnp::RpcSystem<capnp::rpc::twoparty::VatId>> rpc;
  // Framed: every frame answered with its ack, what a loop turn owes in one write (as th-server).
  kj::Own<net::FrameStream> frames;
  kj::Maybe<kj::Promise<void>> reading;
  std::uint64_t ack = 0;
  bool dirty = false;
};

class EchoServer : private kj::TaskSet::ErrorHandler {
 public:
  explicit EchoServer(net::IoLoop& loop) : loop_(loop), tasks_(*this) {}

  kj::Promise<void> accept(kj::ConnectionReceiver& listener) {
    return listener.accept().then([this, &listener](kj::Own<kj::AsyncIoStream> stream) {
      auto* connection = connections_.emplace_back(std::make_unique<EchoConnection>()).get();
      auto first = kj::heapArray<kj::byte>(net::kFramedMagic.size());
      auto& raw = *stream;
      tasks_.add(raw.read(first.begin(), first.size())
                     .then([this, connection, stream = kj::mv(stream), first = kj::mv(first)]() mutable {
                       if (std::equal(first.begin(), first.end(), net::kFramedMagic.begin())) {
                         connection->frames = kj::heap<net::FrameStream>(kj::mv(stream), &loop_.port());
                         connection->frames->on_written([this, connection] { write(*connection); });
                         connection->reading = read(*connection).eagerlyEvaluate(nullptr);
                         return;
                       }
                       connection->stream = net::with_first_bytes(kj::mv(first), kj::mv(stream));
                       connection->network = kj::heap<capnp::TwoPartyVatNetwork>(*connection->stream,
                                                                                capnp::rpc::twoparty::Side::SERVER);
                       connection->rpc = kj::heap(capnp::makeRpcServer(*connection->network, kj::heap<EchoHub>()));
                     }));
      return accept(listener);
    });
  }

 private:
  void taskFailed(kj::Exception&&) override {}  // a load process that exits

  kj::Promise<void> read(EchoConnection& connection) {
    return connection.frames->read_some().then([this, &connection](bool more) -> kj::Promise<void> {
      if (!more) return kj::READY_NOW;
      while (capnp::MessageReader* message = connection.frames->next_frame()) {
        auto frame = message->getRoot<wire::ClientFrame>();
        if (frame.isHello()) {
          connection.frames->append<wire::ServerFrame>([](wire::ServerFrame::Builder answer) { answer.initWelcome(); });
        } else if (frame.getAck() != 0) {
          connection.ack = frame.getAck();
        }
        if (!connection.dirty) {
          connection.dirty = true;
          dirty_.push_back(&connection);
          if (dirty_.size() == 1) tasks_.add(kj::evalLast([this] { write_dirty(); }));
        }
      }
      return read(connection);
    });
  }

  void write_dirty() {
    std::vector<EchoConnection*> dirty;
    dirty.swap(dirty_);
    for (EchoConnection* connection : dirty) {
      connection->dirty = false;
      write(*connection);
    }
  }

  void write(EchoConnection& connection) {
    if (connection.frames->writing()) return;  // on_written comes back
    if (connection.ack != 0) {
      connection.frames->append<wire::ServerFrame>([&](wire::ServerFrame::Builder answer) {
        answer.initEffects(0);
        answer.setAck(connection.ack);
      });
      connection.ack = 0;
    }
    connection.frames->flush();
  }

  net::IoLoop& loop_;
  std::vector<std::unique_ptr<EchoConnection>> connections_;
  std::vector<EchoConnection*> dirty_;
  kj::TaskSet tasks_;
};

}  // namespace

int run_control_load(const ControlLoadOptions& options) {
  net::IoLoop loop;
  Load load(options, loop);
  return load.run();
}

int run_echo_server(const std::string& listen) {
  net::IoLoop loop;
  auto listener = loop.io().getNetwork().parseAddress(listen).wait(loop.wait_scope())->listen();
  std::cout << "echo listening on " << listen.substr(0, listen.rfind(':')) << ":" << listener->getPort() << std::endl;
  EchoServer server(loop);
  server.accept(*listener).wait(loop.wait_scope());
  return 0;
}

}  // namespace th::bench
