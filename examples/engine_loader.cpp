// engine_loader: how an inference engine takes a new version of its weights tensor by tensor while
// the rest is still arriving (libthclient's Handle::replicate_async and Receive::next), against a
// blocking replicate followed by the load.
//
// The "engine" is a mock: it keeps its weights in float32 buffers of its own, and loading a tensor
// converts the bfloat16 bytes that arrived into them (the kind of per-tensor work vLLM's and
// SGLang's load_weights do). A trainer in this process publishes one version; a rollout handle,
// whose reads are capped at --rate-mb-per-s to stand for a network link, receives it twice:
//   blocking:   replicate(), then load every tensor;
//   streaming:  replicate_async(), loading each tensor as next() hands it out, verified.
// It prints when the first and the last tensor were loaded in each, and checks the engine's
// weights bit for bit against the trainer's.
//
//   engine_loader                              # an embedded th-server on loopback
//   engine_loader --server HOST:PORT --token-file F  # a running th-server (th-ctl's option; or --token T)
#include <CLI/CLI.hpp>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "server/embedded_server.h"  // only to run standalone; an engine connects to its cluster's server
#include "net/token.h"               // --token-file, read as th-ctl reads it
#include "tensorhub/client.h"

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point start) { return std::chrono::duration<double>(Clock::now() - start).count(); }

// bfloat16 is the upper half of a float32.
float from_bfloat16(std::uint16_t bits) {
  const std::uint32_t word = static_cast<std::uint32_t>(bits) << 16;
  float value = 0;
  std::memcpy(&value, &word, sizeof value);
  return value;
}

// The mock engine: float32 weights of its own, filled one tensor at a time.
class MockEngine {
 public:
  void load(const std::string& name, const void* data, std::uint64_t bytes) {
    std::vector<float>& weights = weights_[name];
    weights.resize(bytes / 2);
    const auto* halves = static_cast<const std::uint16_t*>(data);
    for (std::size_t i = 0; i < weights.size(); ++i) weights[i] = from_bfloat16(halves[i]);
  }
  // Whether every weight is the float32 of the trainer's bfloat16.
  bool matches(const std::map<std::string, std::vector<std::uint16_t>>& trained) const {
    for (const auto& [name, halves] : trained) {
      auto found = weights_.find(name);
      if (found == weights_.end() || found->second.size() != halves.size()) return false;
      for (std::size_t i = 0; i < halves.size(); ++i) {
        const float expected = from_bfloat16(halves[i]);
        if (std::memcmp(&found->second[i], &expected, sizeof expected) != 0) return false;
      }
    }
    return true;
  }
  void clear() { weights_.clear(); }

 private:
  std::map<std::string, std::vector<float>> weights_;
};

struct Timing {
  double first_loaded_s = 0;
  double last_loaded_s = 0;
};

[[noreturn]] void die(const std::string& what, const th::Error& error) {
  std::fprintf(stderr, "engine_loader: %s: %s: %s\n", what.c_str(), std::string(th::errc_name(error.code)).c_str(),
               error.detail.c_str());
  std::exit(1);
}

template <typename T>
T must(th::Result<T> result, const std::string& what) {
  if (!result.ok()) die(what, result.error());
  return std::move(result).value();
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{
      "engine_loader: an inference engine loads a new version tensor by tensor as it arrives "
      "(replicate_async + Receive::next), against a blocking replicate followed by the load. Prints the time to "
      "the first and the last tensor loaded in each; exits 1 if the engine's weights are not the trainer's."};
  std::string server;
  std::string token = "engine-loader-token";
  int tensors = 16;
  int tensor_mb = 16;
  double rate_mb_per_s = 400;
  app.add_option("--server", server, "a running th-server (HOST:PORT); default: an embedded one on loopback");
  std::string token_file;
  auto* token_option = app.add_option("--token", token, "the cluster token of --server");
  app.add_option("--token-file", token_file, "a file holding the cluster token (its first line), as th-ctl and th-server take it")
      ->excludes(token_option);
  app.add_option("--tensors", tensors, "tensors in the shard")->check(CLI::Range(1, 4096));
  app.add_option("--tensor-mb", tensor_mb, "MiB per tensor (bfloat16)")->check(CLI::Range(1, 1024));
  app.add_option("--rate-mb-per-s", rate_mb_per_s, "the rollout's receive rate cap (a network link); 0: none")
      ->check(CLI::Range(0.0, 1e6));
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& error) {
    const int code = app.exit(error);
    return code == 0 ? 0 : 2;
  }

  if (!token_file.empty()) {
    auto read = th::net::read_token_file(token_file);
    if (!read.ok()) {
      std::fprintf(stderr, "engine_loader: --token-file: %s\n", read.error().detail.c_str());
      return 2;
    }
    token = std::move(read).value();
  }
  std::optional<th::server::EmbeddedServer> embedded;
  if (server.empty()) {
    th::server::ServiceConfig config;
    config.token = token;
    embedded.emplace(config, th::server::LogLevel::kWarn);
    server = embedded->address();
  }
  auto options_for = [&](const std::string& replica, const std::string& role) {
    th::ClientOptions options;
    options.servers = {server};
    options.token = token;
    options.model = "engine-loader";
    options.replica = replica;
    options.role = role;
    options.data_listen = "127.0.0.1:0";
    return options;
  };

  // The trainer's version: bfloat16 tensors with values that differ everywhere.
  std::map<std::string, std::vector<std::uint16_t>> trained;
  const std::size_t halves = static_cast<std::size_t>(tensor_mb) << 19;
  for (int t = 0; t < tensors; ++t) {
    char name[32];
    std::snprintf(name, sizeof name, "layers.%03d.weight", t);
    std::vector<std::uint16_t>& values = trained[name];
    values.resize(halves);
    for (std::size_t i = 0; i < halves; ++i) values[i] = static_cast<std::uint16_t>(0x3c00 + ((i * 2654435761u + t) & 0x3ff));
  }
  auto trainer = must(th::Handle::open(options_for("trainer", "trainer")), "trainer open");
  for (auto& [name, values] : trained) {
    if (auto status = trainer->register_tensor(name, values.data(), values.size() * 2, th::DType::kBFloat16); !status.ok()) {
      die("trainer register", status.error());
    }
  }
  must(trainer->publish(1), "publish");

  // The rollout's receive buffers (where libthclient writes), and the engine that loads from them.
  th::ClientOptions rollout_options = options_for("rollout", "rollout");
  rollout_options.read_rate_bytes_per_s = static_cast<std::uint64_t>(rate_mb_per_s * 1e6);
  auto rollout = must(th::Handle::open(rollout_options), "rollout open");
  std::map<std::string, std::vector<std::uint16_t>> received;
  for (const auto& [name, values] : trained) {
    std::vector<std::uint16_t>& buffer = received[name];
    buffer.resize(values.size());
    if (auto status = rollout->register_tensor(name, buffer.data(), buffer.size() * 2, th::DType::kBFloat16); !status.ok()) {
      die("rollout register", status.error());
    }
  }
  MockEngine engine;
  const double total_mb = static_cast<double>(tensors) * tensor_mb * 1.048576;
  std::printf("engine_loader: %d bf16 tensors, %.0f MB, th-server %s, receive capped at %s\n", tensors, total_mb,
              server.c_str(), rate_mb_per_s > 0 ? (std::to_string(static_cast<int>(rate_mb_per_s)) + " MB/s").c_str() : "none");

  // 1. Blocking: the engine starts once the whole version is here.
  Timing blocking;
  {
    const auto start = Clock::now();
    must(rollout->replicate("latest"), "replicate");
    for (const auto& [name, buffer] : received) {
      engine.load(name, buffer.data(), buffer.size() * 2);
      if (blocking.first_loaded_s == 0) blocking.first_loaded_s = seconds_since(start);
    }
    blocking.last_loaded_s = seconds_since(start);
  }
  const bool blocking_ok = engine.matches(trained);
  engine.clear();
  if (auto status = rollout->unpublish(); !status.ok()) die("unpublish", status.error());  // the buffers are ours again
  for (auto& [name, buffer] : received) std::fill(buffer.begin(), buffer.end(), 0);

  // 2. Streaming: each tensor is loaded as soon as it is complete and verified.
  Timing streaming;
  std::optional<std::size_t> bytes_ready_at_first;
  {
    const auto start = Clock::now();
    auto receive = must(rollout->replicate_async("latest"), "replicate_async");
    for (;;) {
      auto tensor = must(receive->next(), "next");
      if (!tensor) break;
      if (!bytes_ready_at_first) bytes_ready_at_first = receive->progress().bytes_ready;  // as it is handed out
      engine.load(tensor->name, tensor->data, tensor->bytes);
      if (streaming.first_loaded_s == 0) streaming.first_loaded_s = seconds_since(start);
    }
    streaming.last_loaded_s = seconds_since(start);
    const th::UpdateInfo answer = must(receive->wait(), "the call's answer");
    std::printf("streaming: version %llu from %s\n", static_cast<unsigned long long>(answer.version.value_or(0)),
                answer.source_replica.c_str());
  }
  const bool streaming_ok = engine.matches(trained);

  std::printf("%-10s first tensor loaded at %6.3f s, last at %6.3f s  weights %s\n", "blocking",
              blocking.first_loaded_s, blocking.last_loaded_s, blocking_ok ? "ok" : "WRONG");
  std::printf("%-10s first tensor loaded at %6.3f s, last at %6.3f s  weights %s\n", "streaming",
              streaming.first_loaded_s, streaming.last_loaded_s, streaming_ok ? "ok" : "WRONG");
  std::printf("streaming: the first tensor was handed out when %.1f%% of the shard had arrived; the version was "
              "loaded %.3f s (%.0f%%) sooner\n",
              100.0 * static_cast<double>(bytes_ready_at_first.value_or(0)) / (total_mb * 1e6),
              blocking.last_loaded_s - streaming.last_loaded_s,
              100.0 * (blocking.last_loaded_s - streaming.last_loaded_s) / blocking.last_loaded_s);
  if (auto status = trainer->unpublish(); !status.ok()) die("trainer unpublish", status.error());
  return blocking_ok && streaming_ok ? 0 : 1;
}
