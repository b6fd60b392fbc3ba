#include "tests/core/testkit/driver.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <iostream>
#include <sstream>

#include "tests/core/testkit/tensors.h"

namespace th::test {

// TH_TRACE=1 prints every input and effect: the way to read a failing property case.
bool tracing() {
  static const bool enabled = std::getenv("TH_TRACE") != nullptr;
  return enabled;
}

std::string describe_input(const Input& input) {
  std::ostringstream out;
  std::visit(
      [&](const auto& in) {
        using T = std::decay_t<decltype(in)>;
        if constexpr (std::is_same_v<T, Request>) {
          out << "request c" << in.client << " #" << in.seq << " ";
          if (const auto* open = std::get_if<OpenRequest>(&in.body)) {
            out << "open " << open->replica << "/" << open->shard << " inc " << open->incarnation
                << (open->resume ? " resume" : "");
          } else if (const auto* publish = std::get_if<PublishRequest>(&in.body)) {
            out << "publish " << publish->version;
          } else if (const auto* replicate = std::get_if<ReplicateRequest>(&in.body)) {
            out << "replicate " << format_selector(replicate->selector);
          } else if (const auto* update = std::get_if<UpdateRequest>(&in.body)) {
            out << "update " << format_selector(update->selector);
          } else {
            out << op_name(op_kind(in.body));
          }
        } else if constexpr (std::is_same_v<T, Report>) {
          out << "report c" << in.client << " ";
          if (const auto* done = std::get_if<TransferDone>(&in.body)) {
            out << "done t" << done->transfer << "/" << done->epoch;
          } else if (const auto* failed = std::get_if<TransferFailed>(&in.body)) {
            out << "failed t" << failed->transfer << "/" << failed->epoch;
          } else if (const auto* offloaded = std::get_if<OffloadDone>(&in.body)) {
            out << "offload-done " << offloaded->version;
          } else {
            out << "heartbeat";
          }
        } else if constexpr (std::is_same_v<T, ConnectionLost>) {
          out << "connection-lost c" << in.client;
        } else {
          out << "tick";
        }
      },
      input);
  return out.str();
}

std::string describe_effect(const Effect& effect) {
  std::ostringstream out;
  out << "  -> c" << effect.client << " ";
  std::visit(
      [&](const auto& message) {
        using T = std::decay_t<decltype(message)>;
        if constexpr (std::is_same_v<T, Reply>) {
          out << "reply #" << message.seq << " " << describe(message.outcome);
        } else if constexpr (std::is_same_v<T, StartRead>) {
          out << "start-read t" << message.transfer << "/" << message.epoch << " v"
              << message.version << " from " << message.source.replica
              << (message.source.kind == CopyKind::kOffload ? " (offload)" : "")
              << (message.source.partial ? " (partial)" : "")
              << (message.patch ? " (patch against v" + std::to_string(message.patch->base) + ")" : "");
        } else if constexpr (std::is_same_v<T, ServeRead>) {
          out << "serve t" << message.transfer << "/" << message.epoch << " v" << message.version
              << " to " << message.reader_replica;
        } else if constexpr (std::is_same_v<T, StopServing>) {
          out << "stop-serving t" << message.transfer << "/" << message.epoch;
        } else if constexpr (std::is_same_v<T, Offload>) {
          out << "offload v" << message.version;
        } else if constexpr (std::is_same_v<T, ReleaseOffload>) {
          out << "release-offload v" << message.version;
        } else if constexpr (std::is_same_v<T, CopyCorrupt>) {
          out << "copy-corrupt v" << message.version << (message.offload_copy != 0 ? " (offload)" : "");
        } else {
          out << "evicted " << errc_name(message.reason) << ": " << message.detail;
        }
      },
      effect.message);
  return out.str();
}


LayoutRef layout_for(std::uint32_t shard, std::uint64_t bytes, LayoutFault fault) {
  TH_ASSERT(bytes % 4 == 0, "a weight of whole bfloat16 pairs");
  TensorSpec weight{"layer." + std::to_string(shard) + ".weight", DType::kBFloat16, bytes};
  weight.kind = TensorKind::kLocal;
  weight.shape = fault == LayoutFault::kTransposed ? Shape{2, bytes / 4} : Shape{bytes / 2};
  TensorSpec bias{"bias", DType::kFloat32, 64};
  bias.kind = TensorKind::kPiece;
  bias.shape = {16};
  bias.box = Box{{0}, {16}};
  if (fault == LayoutFault::kBadBox) {
    bias.box.extent = {8};
    bias.bytes = 32;
  }
  return ShardLayout::make({std::move(bias), std::move(weight)}).value();
}

ChecksumsRef checksums_for(Version version, std::uint32_t shard) {
  return std::make_shared<const Checksums>(
      Checksums{version * 1000003 + shard * 17 + 1, version * 1000003 + shard * 17 + 2});
}

LayoutRef sliced_layout_for(std::uint32_t shard, std::uint32_t num_shards, LayoutFault fault) {
  constexpr std::uint64_t kRows = 12;
  constexpr std::uint64_t kColumns = 128;
  static_assert(kRows % 3 == 0 && kRows % 4 == 0, "every shard count up to kSlicedShardsMax divides the rows");
  TH_ASSERT(num_shards >= 1 && num_shards <= kSlicedShardsMax && shard < num_shards);
  const std::uint64_t rows = kRows / num_shards;
  TensorSpec weight = piece("weight", {kRows, kColumns}, Box{{shard * rows, 0}, {rows, kColumns}});
  if (fault == LayoutFault::kTransposed) weight = piece("weight", {kColumns, kRows}, Box{{0, shard * rows}, {kColumns, rows}});
  TensorSpec bias = piece("bias", {16}, Box{{0}, {16}}, DType::kFloat32);
  if (fault == LayoutFault::kBadBox) bias = piece("bias", {16}, Box{{0}, {8}}, DType::kFloat32);
  return ShardLayout::make({std::move(bias), std::move(weight)}).value();
}

ChecksumsRef sliced_checksums_for(Version version, std::uint32_t shard, std::uint32_t num_shards) {
  const std::uint64_t base = version * 1000003 + shard * 17 + num_shards * 7919;
  return std::make_shared<const Checksums>(Checksums{base + 3, base + 4});
}

std::string describe(const Outcome& outcome) {
  std::ostringstream out;
  std::visit(
      [&](const auto& value) {
        using T = std::decay_t<decltype(value)>;
        if constexpr (std::is_same_v<T, Error>) {
          out << "Error{" << errc_name(value.code) << ": " << value.detail << "}";
        } else if constexpr (std::is_same_v<T, OpenOk>) {
          out << "OpenOk";
        } else if constexpr (std::is_same_v<T, PublishOk>) {
          out << "PublishOk{" << value.version << "}";
        } else if constexpr (std::is_same_v<T, UnpublishOk>) {
          out << "UnpublishOk";
        } else if constexpr (std::is_same_v<T, ReplicateOk>) {
          out << "ReplicateOk{" << value.version << " from " << value.source_replica << "}";
        } else if constexpr (std::is_same_v<T, UpdateOk>) {
          out << "UpdateOk{" << update_status_name(value.status) << " "
              << (value.version ? std::to_string(*value.version) : "nothing") << "}";
        } else if constexpr (std::is_same_v<T, ListOk>) {
          out << "ListOk";
        } else if constexpr (std::is_same_v<T, WaitOk>) {
          out << "WaitOk";
        } else {
          static_assert(std::is_same_v<T, CloseOk>);
          out << "CloseOk";
        }
      },
      outcome);
  return out.str();
}

bool is_error(const Outcome& outcome, Errc code) {
  const auto* error = std::get_if<Error>(&outcome);
  return error != nullptr && error->code == code;
}

Driver::Driver(HubSettings settings)
    : settings_(settings), hub_(std::make_unique<Hub>(settings)), observer_(settings.fanout_max, settings.model_grace_ms) {}

void Driver::restart_server() {
  hub_ = std::make_unique<Hub>(settings_);
  observer_.on_server_reset();
  if (watcher_ != nullptr) watcher_->on_server_restart();
  inboxes_.clear();
  seqs_.clear();
}

void Driver::step(const Input& input) {
  Effects effects;
  const bool heartbeat = std::holds_alternative<Report>(input) &&
                         std::holds_alternative<Heartbeat>(std::get<Report>(input).body);
  if (tracing() && !heartbeat) std::cerr << now_ms_ << " " << describe_input(input) << "\n";
  if (watcher_ != nullptr) watcher_->before_step(input, now_ms_);
  hub_->step(input, now_ms_, effects);
  if (tracing()) {
    for (const Effect& effect : effects) std::cerr << describe_effect(effect) << "\n";
  }
  hub_->check_invariants();
  if (watcher_ != nullptr) watcher_->after_step(input, effects, now_ms_);
  observer_.on_effects(effects);
  for (const std::string& name : model_names_) observer_.on_latest(name, hub_->latest(name), now_ms_);
  route(effects);
  if (!observer_.violations().empty()) {
    throw AssertionFailure("observer: " + observer_.violations().front());
  }
}

void Driver::route(const Effects& effects) {
  for (const Effect& effect : effects) {
    Inbox& box = inboxes_[effect.client];
    box.session = effect.session;
    std::visit(
        [&](const auto& message) {
          using T = std::decay_t<decltype(message)>;
          if constexpr (std::is_same_v<T, Reply>) {
            box.replies.push_back(message);
          } else if constexpr (std::is_same_v<T, StartRead>) {
            // The metadata a reader verifies against must be the version's published checksums
            // (each source shard's, for a read of another layout).
            // (A model's replicas have the testkit's tensors or sliced ones, which vary with the
            // shard count: the reader's, or its source's for a read of another layout.)
            auto check = [&](const ChecksumsRef& checksums, std::uint32_t shard, std::uint32_t num_shards) {
              if (checksums == nullptr || (*checksums != *checksums_for(message.version, shard) &&
                                           *checksums != *sliced_checksums_for(message.version, shard, num_shards))) {
                throw AssertionFailure("a reader was given checksums of another version");
              }
            };
            const auto source_shards = static_cast<std::uint32_t>(message.reshard.size());
            for (std::uint32_t shard = 0; shard < source_shards; ++shard) {
              check(message.reshard[shard].checksums, shard, source_shards);
            }
            if (message.reshard.empty() || message.checksums != nullptr) {
              check(message.checksums, message.shard, box.num_shards);
            }
            box.reads[message.transfer] = message;
          } else if constexpr (std::is_same_v<T, ServeRead>) {
            box.grants[{message.transfer, message.epoch}] = message;
          } else if constexpr (std::is_same_v<T, StopServing>) {
            box.grants.erase({message.transfer, message.epoch});
          } else if constexpr (std::is_same_v<T, Offload>) {
            box.offloads.push_back(message.version);
            box.offload_copies[message.version] = message.copy;
          } else if constexpr (std::is_same_v<T, ReleaseOffload>) {
            box.releases.push_back(message.version);
          } else if constexpr (std::is_same_v<T, CopyCorrupt>) {
            box.corrupt_notices.push_back(message);
          } else {
            static_assert(std::is_same_v<T, Evicted>);
            box.evictions.push_back(message);
          }
        },
        effect.message);
  }
}

void Driver::open(ClientId client, const OpenRequest& request, std::uint64_t seq) {
  model_names_.insert(request.model);
  inboxes_[client].num_shards = request.num_shards;
  observer_.on_open(client, seq, /*session=*/0, request);
  seqs_[client] = seq + 1;
  step(Request{client, seq, request});
}

std::uint64_t Driver::call(ClientId client, RequestBody body) {
  const std::uint64_t seq = seqs_[client]++;
  observer_.on_call(client, seq, body);
  step(Request{client, seq, std::move(body)});
  return seq;
}

void Driver::report(ClientId client, ReportBody body) {
  observer_.on_report(client, body);
  step(Report{client, std::move(body)});
}

void Driver::lose_connection(ClientId client) { step(ConnectionLost{client}); }

void Driver::advance(TimeMs ms, const std::set<ClientId>& silent) {
  // In slices, so that live clients heartbeat well within any timeout a test sets.
  constexpr TimeMs kSliceMs = 100;
  for (TimeMs passed = 0; passed < ms; passed += kSliceMs) {
    for (const auto& [client, seq] : seqs_) {
      if (!silent.contains(client) && inboxes_[client].evictions.empty()) {
        step(Report{client, Heartbeat{}});
      }
    }
    now_ms_ += std::min(kSliceMs, ms - passed);
    step(Tick{});
  }
}

std::optional<Reply> Driver::take_reply(ClientId client) {
  Inbox& box = inboxes_[client];
  if (box.replies.empty()) return std::nullopt;
  Reply reply = std::move(box.replies.front());
  box.replies.pop_front();
  return reply;
}

OpenRequest Driver::open_request(const ReplicaSpec& spec, std::uint32_t shard) const {
  OpenRequest request;
  request.model = spec.model;
  request.replica = spec.name;
  request.incarnation = spec.incarnation;
  request.shard = shard;
  request.num_shards = spec.num_shards;
  request.datacenter = spec.datacenter;
  request.spot = spec.spot;
  request.role = spec.role;
  request.retention = spec.retention;
  request.data_endpoint = "tcp://" + spec.name + "/" + std::to_string(shard);
  return request;
}

std::vector<ClientId> Driver::open_replica(const ReplicaSpec& spec) {
  std::vector<ClientId> shards;
  for (std::uint32_t shard = 0; shard < spec.num_shards; ++shard) {
    const ClientId client = new_client();
    open(client, open_request(spec, shard));
    auto reply = take_reply(client);
    EXPECT_TRUE(reply && std::holds_alternative<OpenOk>(reply->outcome))
        << "open of " << spec.name << "/" << shard << ": "
        << (reply ? describe(reply->outcome) : "no reply");
    shards.push_back(client);
  }
  return shards;
}

void Driver::call_all(const std::vector<ClientId>& shards, const RequestBody& body) {
  for (ClientId client : shards) call(client, body);
}

std::optional<Outcome> Driver::replies(const std::vector<ClientId>& shards) {
  std::optional<Outcome> first;
  for (ClientId client : shards) {
    auto reply = take_reply(client);
    if (!reply) return std::nullopt;
    if (!first) {
      first = reply->outcome;
    } else {
      EXPECT_EQ(describe(*first), describe(reply->outcome)) << "shards answered differently";
    }
  }
  return first;
}

void Driver::publish(const std::vector<ClientId>& shards, Version version) {
  for (std::uint32_t shard = 0; shard < shards.size(); ++shard) {
    call(shards[shard], PublishRequest{version, layout_for(shard), checksums_for(version, shard)});
  }
  auto outcome = replies(shards);
  ASSERT_TRUE(is<PublishOk>(outcome)) << (outcome ? describe(*outcome) : "no reply");
}

void Driver::finish_reads(const std::vector<ClientId>& shards, bool sliced) {
  for (ClientId client : shards) {
    auto reads = inbox(client).reads;
    inbox(client).reads.clear();
    for (const auto& [transfer, read] : reads) {
      // A read across layouts reports the checksums of what it assembled.
      const bool across = sliced && !read.reshard.empty();
      report(client, TransferDone{transfer, read.epoch,
                                  across ? sliced_checksums_for(read.version, read.shard, inbox(client).num_shards)
                                         : nullptr});
    }
  }
}

std::vector<std::string> Driver::finish_chains(const std::map<std::string, std::vector<ClientId>>& replicas,
                                               const std::vector<std::string>& readers, std::set<std::string> complete,
                                               bool sliced, int rounds) {
  std::set<std::string> answered;
  for (int round = 0; round < rounds && answered.size() < readers.size(); ++round) {
    for (const std::string& name : readers) {
      if (answered.contains(name)) continue;
      const std::vector<ClientId>& shards = replicas.at(name);
      const bool from_complete = std::all_of(shards.begin(), shards.end(), [&](ClientId client) {
        const auto& reads = inbox(client).reads;
        return !reads.empty() && complete.contains(reads.rbegin()->second.source.replica);
      });
      if (!from_complete) continue;
      finish_reads(shards, sliced);
      if (auto outcome = replies(shards)) {
        EXPECT_TRUE(is<ReplicateOk>(outcome)) << name << ": " << describe(*outcome);
        answered.insert(name);
        complete.insert(name);
      }
    }
  }
  std::vector<std::string> left;
  for (const std::string& name : readers) {
    if (!answered.contains(name)) left.push_back(name);
  }
  return left;
}

void Driver::finish_offloads(const std::vector<ClientId>& shards) {
  for (ClientId client : shards) {
    auto offloads = inbox(client).offloads;
    inbox(client).offloads.clear();
    for (Version version : offloads) {
      report(client, OffloadDone{version, inbox(client).offload_copies.at(version)});
    }
  }
}

}  // namespace th::test
