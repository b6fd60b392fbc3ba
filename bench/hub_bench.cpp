// The Hub alone, in a closed loop (paper §5.1.4): every client of every replica cycles through
// publish(v) -> update(latest) -> unpublish, issuing its next call as soon as its previous one is
// answered. Odd replicas publish one version ahead of even ones (v = 2 * round + replica % 2), so
// the updates of even replicas move to a newer version: drain, source selection, transfer. The data
// plane is instantaneous: a StartRead is answered by TransferDone at once.
// One benchmark iteration is one input to Hub::step; the "ops" counter counts client calls only
// (the paper's operations), "inputs" adds the data-plane reports.
#include <benchmark/benchmark.h>

#include <deque>
#include <vector>

#include "core/hub.h"

namespace th {
namespace {

struct Client {
  std::uint32_t replica = 0;
  std::uint32_t shard = 0;
  std::uint64_t seq = 0;
  std::uint64_t round = 0;  // the cycle: this client publishes 2 * round + replica % 2
  int phase = 0;            // 0 publish, 1 update, 2 unpublish
};

// What a client sends next, kept small; the Input is built only when the hub steps it, so that the
// benchmark measures the hub rather than copies of large variants through a queue.
struct Work {
  ClientId client = 0;
  bool report = false;     // a TransferDone, else the client's next call
  TransferId transfer = 0;
  std::uint32_t epoch = 0;
};

class ClosedLoop {
 public:
  ClosedLoop(std::uint32_t replicas, std::uint32_t shards) : hub_(HubSettings{}) {
    for (std::uint32_t shard = 0; shard < shards; ++shard) {
      layouts_.push_back(ShardLayout::make({{"w" + std::to_string(shard), DType::kBFloat16, 1 << 20},
                                            {"b" + std::to_string(shard), DType::kFloat32, 256}})
                             .value());
      checksums_.push_back(std::make_shared<const Checksums>(Checksums{shard + 1ULL, shard + 2ULL}));
    }
    for (std::uint32_t replica = 0; replica < replicas; ++replica) {
      for (std::uint32_t shard = 0; shard < shards; ++shard) {
        const ClientId id = clients_.size();
        clients_.push_back(Client{replica, shard, 0, 1, 0});
        OpenRequest open;
        open.model = "model";
        open.replica = "replica-" + std::to_string(replica);
        open.incarnation = 1;
        open.shard = shard;
        open.num_shards = shards;
        open.datacenter = replica % 8 == 0 ? "dc1" : "dc0";
        open.role = replica == 0 ? "trainer" : "rollout";
        open.data_endpoint = "10.0.0." + std::to_string(replica % 250) + ":" + std::to_string(shard);
        effects_.clear();
        hub_.step(Request{id, 0, std::move(open)}, now_ms_, effects_);
      }
    }
    for (ClientId id = 0; id < clients_.size(); ++id) work_.push_back(Work{id});
  }

  void step() {
    const Work work = work_.front();
    work_.pop_front();
    effects_.clear();
    if (work.report) {
      hub_.step(Report{work.client, TransferDone{work.transfer, work.epoch}}, now_ms_, effects_);
    } else {
      hub_.step(next_call(work.client), now_ms_, effects_);
      ++calls_;
    }
    ++inputs_;
    for (const Effect& effect : effects_) {
      if (const auto* reply = std::get_if<Reply>(&effect.message)) {
        const auto* error = std::get_if<Error>(&reply->outcome);
        if (error != nullptr && error->code == Errc::kStaleVersion && clients_[effect.client].phase == 0) {
          // Versions increase within a model's life: a replica whose rounds fell behind the others'
          // publishes its next round's version instead (as a lagging trainer would skip ahead).
          ++stale_;
          ++clients_[effect.client].round;
          work_.push_back(Work{effect.client});
          continue;
        }
        if (error != nullptr && errors_++ == 0) first_error_ = error->detail;
        advance(effect.client);
      } else if (const auto* read = std::get_if<StartRead>(&effect.message)) {
        work_.push_back(Work{effect.client, true, read->transfer, read->epoch});
      }
    }
  }

  std::uint64_t calls() const { return calls_; }
  std::uint64_t inputs() const { return inputs_; }
  std::uint64_t errors() const { return errors_; }
  std::uint64_t stale() const { return stale_; }
  const std::string& first_error() const { return first_error_; }
  const HubStats& stats() const { return hub_.stats(); }

 private:
  void advance(ClientId id) {
    Client& client = clients_[id];
    client.phase = (client.phase + 1) % 3;
    if (client.phase == 0) ++client.round;
    work_.push_back(Work{id});
  }

  Request next_call(ClientId id) {
    Client& client = clients_[id];
    const std::uint64_t seq = ++client.seq;
    switch (client.phase) {
      case 0:
        return Request{id, seq,
                       PublishRequest{2 * client.round + client.replica % 2, layouts_[client.shard],
                                      checksums_[client.shard]}};
      case 1:
        return Request{id, seq, UpdateRequest{Selector::latest(), layouts_[client.shard]}};
      default:
        return Request{id, seq, UnpublishRequest{}};
    }
  }

  Hub hub_;
  std::vector<LayoutRef> layouts_;
  std::vector<ChecksumsRef> checksums_;
  std::vector<Client> clients_;
  std::deque<Work> work_;
  Effects effects_;
  TimeMs now_ms_ = 0;
  std::uint64_t calls_ = 0;
  std::uint64_t inputs_ = 0;
  std::uint64_t errors_ = 0;
  std::uint64_t stale_ = 0;  // publishes refused as below latest, published again a round later
  std::string first_error_;
};

void BM_HubClosedLoop(benchmark::State& state) {
  ClosedLoop loop(static_cast<std::uint32_t>(state.range(0)), static_cast<std::uint32_t>(state.range(1)));
  for (auto _ : state) loop.step();
  if (loop.errors() != 0) {
    const std::string message = std::to_string(loop.errors()) + " calls failed, first: " + loop.first_error();
    state.SkipWithError(message.c_str());
  }
  state.counters["ops"] = benchmark::Counter(static_cast<double>(loop.calls()),
                                             benchmark::Counter::kIsRate);
  state.counters["inputs"] = benchmark::Counter(static_cast<double>(loop.inputs()),
                                                benchmark::Counter::kIsRate);
  state.counters["transfers"] = static_cast<double>(loop.stats().transfers_completed);
  state.counters["stale"] = static_cast<double>(loop.stale());
  state.counters["clients"] = static_cast<double>(state.range(0) * state.range(1));
}

// The paper's shape (1024 replicas x 8 shards = 8192 clients), and replicas of 1-4 shards.
BENCHMARK(BM_HubClosedLoop)
    ->ArgNames({"replicas", "shards"})
    ->Args({1024, 8})
    ->Args({2048, 4})
    ->Args({8192, 1})
    ->MinTime(2.0)
    ->Unit(benchmark::kNanosecond);

}  // namespace
}  // namespace th

BENCHMARK_MAIN();
