// th-demo: the README's main job. A whole TensorHub job on loopback, with real processes:
//
//   th-demo (this process)      an embedded th-server (the core Hub behind Cap'n Proto RPC)
//     ├─ trainer, shard 0..S-1   change their weights every step, publish, wait for the rollouts,
//     │                          unpublish
//     └─ rollout-k, shard 0..S-1 update to each new version and check every byte
//
// Workers are this same binary re-run with --worker. Each rollout shard reports what it got; the
// demo prints one row per step and rollout replica and exits non-zero if anything failed.
#include <CLI/CLI.hpp>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <optional>
#include <iomanip>
#include <iostream>
#include <map>
#include <sstream>
#include <thread>
#include <vector>

#include "net/token.h"
#include "server/embedded_server.h"
#include "tensorhub/client.h"

namespace {

const char* const kToken = "th-demo-token";

// The weights of (version, shard), word by word: a wrong byte anywhere cannot pass for a right one.
std::uint64_t word_of(std::uint64_t version, std::uint32_t shard, std::uint64_t tensor, std::uint64_t index) {
  std::uint64_t x = (version << 40) ^ (static_cast<std::uint64_t>(shard) << 32) ^ (tensor << 24) ^ index;
  x ^= x >> 31;
  x *= 0x7FB5D329728EA185ull;
  x ^= x >> 27;
  return x;
}

struct Model {
  std::vector<std::vector<std::uint64_t>> tensors;
  // Two big tensors per shard and a few small ones (packed on the wire).
  explicit Model(std::uint64_t shard_bytes) {
    const std::uint64_t big_words = shard_bytes / 8 / 2;
    tensors.emplace_back(big_words);
    tensors.emplace_back(big_words);
    for (std::uint64_t words : {64, 1000, 4096}) tensors.emplace_back(words);
  }
  void fill(std::uint64_t version, std::uint32_t shard) {
    for (std::size_t t = 0; t < tensors.size(); ++t) {
      for (std::size_t i = 0; i < tensors[t].size(); ++i) tensors[t][i] = word_of(version, shard, t, i);
    }
  }
  bool holds(std::uint64_t version, std::uint32_t shard) const {
    for (std::size_t t = 0; t < tensors.size(); ++t) {
      for (std::size_t i = 0; i < tensors[t].size(); ++i) {
        if (tensors[t][i] != word_of(version, shard, t, i)) return false;
      }
    }
    return true;
  }
  th::Status register_with(th::Handle& handle) {
    for (std::size_t t = 0; t < tensors.size(); ++t) {
      auto status = handle.register_tensor("layer" + std::to_string(t), tensors[t].data(), tensors[t].size() * 8,
                                           th::DType::kBFloat16);
      if (!status.ok()) return status;
    }
    return th::Unit{};
  }
};

[[noreturn]] void die(const std::string& what, const th::Error& error) {
  std::cout << "FAIL " << what << ": " << th::errc_name(error.code) << " " << error.detail << std::endl;
  std::exit(1);
}

// ---- Workers (child processes) -----------------------------------------------------------------

// What a worker does besides its job: tell the demo where it serves metrics, and stay up (open) a
// while after its last transfer so that a scraper sees the final figures.
struct WorkerExtras {
  bool metrics = false;
  std::int64_t linger_ms = 0;
};

void announce_metrics(const WorkerExtras& extras) {
  if (extras.metrics) std::cout << "METRICS " << th::Handle::metrics_address() << std::endl;
}

void linger(const WorkerExtras& extras) {
  if (extras.linger_ms > 0) std::this_thread::sleep_for(std::chrono::milliseconds(extras.linger_ms));
}

int run_trainer(th::ClientOptions options, std::uint64_t steps, std::uint64_t shard_bytes, std::uint32_t rollouts,
                const WorkerExtras& extras) {
  options.role = "trainer";
  options.retention.keep_latest = 0;  // the latest version stays readable (offloaded if need be)
  auto opened = th::Handle::open(options);
  if (!opened.ok()) die("trainer open", opened.error());
  auto handle = std::move(opened).value();
  announce_metrics(extras);
  // A long-lived server may know this model from an earlier run: its versions would satisfy the
  // rollouts' waits before this run published anything.
  if (auto listed = handle->list(); listed.ok() && listed.value().latest) {
    die("trainer open", th::make_error(th::Errc::kInvalidArgument,
                                       "model '" + options.model + "' already has versions on this server (latest " +
                                           std::to_string(*listed.value().latest) + "): give this run another --model"));
  }
  Model model(shard_bytes);
  if (auto status = model.register_with(*handle); !status.ok()) die("trainer register", status.error());
  // Start once every rollout replica is there, so that each of them sees every version. (Every
  // shard of the trainer sees the same answers: a replica's calls are transactions.)
  for (int attempt = 0;; ++attempt) {
    auto listed = handle->list();
    if (!listed.ok()) die("list", listed.error());
    const auto& replicas = listed.value().replicas;
    const auto ready = std::count_if(replicas.begin(), replicas.end(), [](const auto& r) { return r.role == "rollout"; });
    if (ready >= static_cast<long>(rollouts)) break;
    if (attempt == 1200) die("waiting for the rollouts to open", th::make_error(th::Errc::kTimeout, "60 s"));
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  for (std::uint64_t version = 1; version <= steps; ++version) {
    model.fill(version, options.shard);  // a training step changed the weights
    if (auto published = handle->publish(version); !published.ok()) die("publish", published.error());
    // Every rollout replica holds the new version before the trainer writes its buffers again.
    th::WaitPredicate all_rollouts{th::WaitPredicate::Kind::kRoleHolds, version, 1, "rollout"};
    if (auto waited = handle->wait(all_rollouts, 120'000); !waited.ok()) die("wait for rollouts", waited.error());
    if (auto status = handle->unpublish(); !status.ok()) die("unpublish", status.error());
  }
  linger(extras);
  if (auto status = handle->close(); !status.ok()) die("trainer close", status.error());
  return 0;
}

int run_rollout(th::ClientOptions options, std::uint64_t steps, std::uint64_t shard_bytes, const WorkerExtras& extras) {
  options.role = "rollout";
  auto opened = th::Handle::open(options);
  if (!opened.ok()) die("rollout open", opened.error());
  auto handle = std::move(opened).value();
  announce_metrics(extras);
  Model model(shard_bytes);
  if (auto status = model.register_with(*handle); !status.ok()) die("rollout register", status.error());
  std::uint64_t held = 0;
  while (held < steps) {
    th::WaitPredicate next{th::WaitPredicate::Kind::kVersionAtLeast, held + 1, 1, ""};
    if (auto waited = handle->wait(next, 120'000); !waited.ok()) die("wait for a version", waited.error());
    const auto started = std::chrono::steady_clock::now();
    const std::uint64_t received_before = handle->stats().bytes_received;
    const std::uint64_t rdma_before = handle->stats().pulls_rdma;
    auto updated = held == 0 ? [&]() -> th::Result<th::UpdateInfo> {
      auto replicated = handle->replicate("latest");
      if (!replicated.ok()) return replicated.error();
      return th::UpdateInfo{th::UpdateStatus::kUpdated, replicated.value().version, replicated.value().source_replica};
    }()
                             : handle->update("latest");
    const double stall_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
    if (!updated.ok()) die("update", updated.error());
    if (updated.value().status != th::UpdateStatus::kUpdated) continue;  // not yet: wait again
    held = *updated.value().version;  // kUpdated names it
    const auto stats = handle->stats();
    const std::uint64_t bytes = stats.bytes_received - received_before;
    const bool exact = model.holds(held, options.shard);
    // ROW version replica shard source bytes read_seconds stall_seconds ok via
    std::cout << "ROW " << held << " " << options.replica << " " << options.shard << " "
              << updated.value().source_replica << " " << bytes << " " << stats.last_read_seconds << " "
              << stall_s << " " << (exact && stats.checksum_failures == 0 ? "ok" : "BAD") << " "
              << (stats.pulls_rdma > rdma_before ? "rdma" : "tcp") << std::endl;
  }
  linger(extras);
  // A close is never refused (it may take the last copy of a version the trainer's rule keeps).
  if (auto status = handle->close(); !status.ok()) die("rollout close", status.error());
  return 0;
}

// ---- The embedded server -------------------------------------------------------------------------

struct Child {
  pid_t pid = -1;
  FILE* output = nullptr;
  std::string name;
};

Child spawn(const std::vector<std::string>& args, const std::string& name) {
  int out[2];
  if (::pipe(out) != 0) throw std::runtime_error("pipe");
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::dup2(out[1], 1);
    ::close(out[0]);
    ::close(out[1]);
    std::vector<char*> argv;
    for (const auto& arg : args) argv.push_back(const_cast<char*>(arg.c_str()));
    argv.push_back(nullptr);
    ::execv("/proc/self/exe", argv.data());
    std::perror("execv");
    ::_exit(127);
  }
  ::close(out[1]);
  return Child{pid, ::fdopen(out[0], "r"), name};
}

// Prometheus file_sd: [{"targets": [...], "labels": {...}}], written whole (renamed into place).
bool write_targets(const std::string& path, const std::vector<std::string>& targets) {
  std::string json = "[{\"targets\":[";
  for (std::size_t i = 0; i < targets.size(); ++i) json += (i == 0 ? "\"" : ",\"") + targets[i] + "\"";
  json += "],\"labels\":{\"th_job\":\"th-demo\"}}]\n";
  const std::string temporary = path + ".tmp";
  {
    std::ofstream out(temporary, std::ios::trunc);
    out << json;
    if (!out.flush()) return false;
  }
  return std::rename(temporary.c_str(), path.c_str()) == 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{
      "th-demo: a TensorHub job on loopback with real processes. An embedded th-server, one trainer\n"
      "replica and several rollout replicas (each with --shards processes). Every step the trainer\n"
      "changes its weights and publishes; the rollouts update, pulling from the trainer or from each\n"
      "other (pipeline replication), and check every byte. One row per step and rollout replica:\n"
      "version, source replica, bytes, GB/s, stall ms, checksum, and how the bytes moved (tcp, rdma).\n"
      "Exits non-zero if anything failed."};
  std::uint64_t steps = 5;
  std::uint32_t shards = 2;
  std::uint32_t rollouts = 4;
  std::uint64_t shard_mb = 64;
  std::string worker;
  std::string server;
  std::string replica;
  std::uint32_t shard = 0;
  std::string transport = "auto";
  std::string token_file;
  std::string timeline_file;
  std::string metrics_targets_file;
  std::int64_t linger_ms = 0;
  bool worker_metrics = false;
  std::string model_name = "demo";
  app.add_option("--steps", steps, "training steps (versions published)")->capture_default_str()->check(CLI::Range(1, 1000));
  app.add_option("--shards", shards, "shards per replica (processes per replica)")->capture_default_str()->check(CLI::Range(1, 16));
  app.add_option("--rollouts", rollouts, "rollout replicas")->capture_default_str()->check(CLI::Range(1, 32));
  app.add_option("--shard-mb", shard_mb, "MiB of weights per shard")->capture_default_str()->check(CLI::Range(1, 4096));
  app.add_option("--transport", transport,
                 "how rollouts pull: auto (RDMA where this host has a device, else TCP), rdma (fail without "
                 "a device), tcp")
      ->capture_default_str()
      ->check(CLI::IsMember({"auto", "rdma", "tcp"}));
  auto* server_option = app.add_option("--server", server,
                                       "run the job against this running th-server (HOST:PORT) instead of an embedded "
                                       "one; needs --token-file");
  app.add_option("--token-file", token_file, "the cluster token of --server's th-server")
                           ->check(CLI::ExistingFile);
  app.add_option("--timeline", timeline_file,
                 "at the end, write the embedded server's transfer timeline here (Chrome Trace Event JSON: "
                 "ui.perfetto.dev, or tools/timeline-plot FILE -o PNG); with --server use th-ctl timeline")
      ->excludes(server_option);
  app.add_option("--client-metrics-targets", metrics_targets_file,
                 "every worker serves its libthclient metrics on 127.0.0.1 (a free port); write their addresses to "
                 "this file as Prometheus file_sd targets (JSON)");
  app.add_option("--model", model_name, "the model's name (a run against a long-lived --server needs a new one)")
      ->capture_default_str();
  app.add_option("--linger-ms", linger_ms,
                 "workers stay up this long after their last call (so that a scraper sees the final figures)")
      ->capture_default_str()
      ->check(CLI::Range(std::int64_t{0}, std::int64_t{600'000}));
  app.add_option("--worker", worker, "(internal) run as a worker: trainer or rollout")->group("");
  app.add_option("--replica", replica, "(internal)")->group("");
  app.add_option("--shard", shard, "(internal)")->group("");
  app.add_flag("--worker-metrics", worker_metrics, "(internal)")->group("");
  CLI11_PARSE(app, argc, argv);
  const std::uint64_t shard_bytes = shard_mb << 20;
  std::string token = kToken;
  if (!token_file.empty()) {
    auto read = th::net::read_token_file(token_file);
    if (!read.ok()) {
      std::cerr << "th-demo: " << read.error().detail << "\n";
      return 2;
    }
    token = std::move(read).value();
  }

  if (!worker.empty()) {
    th::ClientOptions options;
    options.servers = {server};
    options.token = token;
    options.model = model_name;
    options.replica = replica;
    options.shard = shard;
    options.num_shards = shards;
    options.transport = transport;
    const WorkerExtras extras{worker_metrics, linger_ms};
    if (worker_metrics) options.metrics_listen = "127.0.0.1:0";
    if (worker == "trainer") return run_trainer(options, steps, shard_bytes, rollouts, extras);
    if (worker == "rollout") return run_rollout(options, steps, shard_bytes, extras);
    std::cerr << "th-demo: unknown worker kind " << worker << "\n";
    return 2;
  }

  if (!server.empty() && token_file.empty()) {
    std::cerr << "th-demo: --server needs --token-file (the cluster token of that th-server)\n";
    return 2;
  }
  ::signal(SIGPIPE, SIG_IGN);
  std::optional<th::server::EmbeddedServer> embedded;
  if (server.empty()) {
    th::server::ServiceConfig config;
    config.token = token;
    // TH_DEMO_LOG=debug shows every call the server sees.
    const char* level = std::getenv("TH_DEMO_LOG");
    embedded.emplace(config, th::server::parse_log_level(level ? level : "warn").value_or(th::server::LogLevel::kWarn));
    server = embedded->address();
  }
  std::cout << "th-demo: th-server on " << server << (embedded ? " (embedded)" : "") << "; trainer + " << rollouts
            << " rollout replicas x " << shards << " shards, " << shard_mb << " MiB per shard, " << steps << " steps"
            << std::endl;
  std::vector<Child> children;
  auto common = [&](const std::string& kind, const std::string& name, std::uint32_t index) {
    std::vector<std::string> args{"th-demo", "--worker", kind, "--server", server, "--replica", name,
                                  "--shard", std::to_string(index), "--shards", std::to_string(shards),
                                  "--steps", std::to_string(steps), "--shard-mb", std::to_string(shard_mb),
                                  "--rollouts", std::to_string(rollouts), "--transport", transport,
                                  "--linger-ms", std::to_string(linger_ms), "--model", model_name};
    if (!token_file.empty()) args.insert(args.end(), {"--token-file", token_file});
    if (!metrics_targets_file.empty()) args.push_back("--worker-metrics");
    return args;
  };
  for (std::uint32_t s = 0; s < shards; ++s) children.push_back(spawn(common("trainer", "trainer", s), "trainer/" + std::to_string(s)));
  for (std::uint32_t r = 0; r < rollouts; ++r) {
    for (std::uint32_t s = 0; s < shards; ++s) {
      const std::string name = "rollout-" + std::to_string(r);
      children.push_back(spawn(common("rollout", name, s), name + "/" + std::to_string(s)));
    }
  }

  // Collect rows from every child (one reader thread each), then print them per step and replica.
  struct Shard {
    std::string source;
    std::uint64_t bytes = 0;
    double read_s = 0;
    double stall_s = 0;
    bool ok = false;
    std::string via;  // tcp or rdma
  };
  std::mutex mutex;
  std::map<std::pair<std::uint64_t, std::string>, std::vector<Shard>> rows;
  std::vector<std::string> failures;
  std::vector<std::string> metrics_targets;
  std::vector<std::thread> readers;
  for (Child& child : children) {
    readers.emplace_back([&, child] {
      char line[1024];
      while (std::fgets(line, sizeof line, child.output) != nullptr) {
        std::istringstream fields(line);
        std::string tag;
        fields >> tag;
        std::lock_guard lock(mutex);
        if (tag == "ROW") {
          std::uint64_t version = 0;
          std::string name;
          std::uint32_t index = 0;
          Shard row;
          std::string ok;
          fields >> version >> name >> index >> row.source >> row.bytes >> row.read_s >> row.stall_s >> ok >> row.via;
          row.ok = ok == "ok";
          rows[{version, name}].push_back(row);
        } else if (tag == "METRICS") {
          std::string address;
          fields >> address;
          metrics_targets.push_back(address);
          // Once every worker said where it serves, the scraper learns them all at once.
          if (metrics_targets.size() == children.size() && !write_targets(metrics_targets_file, metrics_targets)) {
            failures.push_back("cannot write " + metrics_targets_file);
          }
        } else {
          failures.push_back(child.name + ": " + line);
        }
      }
      std::fclose(child.output);
    });
  }
  // Once one worker fails, the others would wait for it (up to minutes): stop them too.
  bool all_exited_cleanly = true;
  std::size_t running = children.size();
  while (running > 0) {
    int status = 0;
    const pid_t pid = ::waitpid(-1, &status, 0);
    if (pid < 0) break;
    auto child = std::find_if(children.begin(), children.end(), [pid](const Child& c) { return c.pid == pid; });
    if (child == children.end()) continue;
    --running;
    child->pid = -1;
    if (WIFEXITED(status) && WEXITSTATUS(status) == 0) continue;
    {
      std::lock_guard lock(mutex);
      failures.push_back(child->name + " exited with status " + std::to_string(status));
    }
    if (all_exited_cleanly) {
      for (const Child& other : children) {
        if (other.pid > 0) ::kill(other.pid, SIGTERM);
      }
    }
    all_exited_cleanly = false;
  }
  for (std::thread& reader : readers) reader.join();

  std::cout << std::left << std::setw(8) << "version" << std::setw(12) << "replica" << std::setw(12) << "source"
            << std::right << std::setw(12) << "bytes" << std::setw(9) << "GB/s" << std::setw(11) << "stall ms"
            << "  checksum  via\n";
  bool all_ok = all_exited_cleanly;
  for (const auto& [key, shards_of] : rows) {
    std::uint64_t bytes = 0;
    double read_s = 0;
    double stall_s = 0;
    bool ok = shards_of.size() == shards;
    std::string source = shards_of.empty() ? "?" : shards_of[0].source;
    std::string via;
    for (const Shard& row : shards_of) {
      if (via.find(row.via) == std::string::npos) via += via.empty() ? row.via : "+" + row.via;
      bytes += row.bytes;
      read_s = std::max(read_s, row.read_s);
      stall_s = std::max(stall_s, row.stall_s);
      ok = ok && row.ok && row.source == source;  // replica consistency: one source for all shards
    }
    all_ok = all_ok && ok;
    std::cout << std::left << std::setw(8) << key.first << std::setw(12) << key.second << std::setw(12) << source
              << std::right << std::setw(12) << bytes << std::setw(9) << std::fixed << std::setprecision(2)
              << (read_s > 0 ? static_cast<double>(bytes) / read_s / 1e9 : 0.0) << std::setw(11)
              << std::setprecision(1) << stall_s * 1000 << "  " << std::left << std::setw(8) << (ok ? "ok" : "FAILED")
              << "  " << via << "\n";
  }
  if (rows.size() != steps * rollouts) {
    all_ok = false;
    failures.push_back("expected " + std::to_string(steps * rollouts) + " rows, got " + std::to_string(rows.size()));
  }
  for (const std::string& failure : failures) std::cout << "FAILURE " << failure << "\n";
  if (!timeline_file.empty()) {
    std::ofstream out(timeline_file, std::ios::trunc);
    out << embedded->timeline_json();
    if (!out.flush()) {
      all_ok = false;
      std::cout << "FAILURE cannot write the timeline to " << timeline_file << "\n";
    } else {
      std::cout << "th-demo: transfer timeline in " << timeline_file
                << " (ui.perfetto.dev, or tools/timeline-plot " << timeline_file << " -o timeline.png)\n";
    }
  }
  std::cout << (all_ok ? "th-demo: ok" : "th-demo: FAILED") << std::endl;
  return all_ok ? 0 : 1;
}
