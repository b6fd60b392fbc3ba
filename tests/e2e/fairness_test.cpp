// Fairness under load: a worker that restarts gets its open answered promptly while 1,000 other
// clients keep the server busy (issue: Cap'n Proto 0.9.2's loop, left to itself, can starve a new
// connection for over a minute). The load runs in its own process (th-e2e-load); this process
// opens a real libthclient handle again and again, each time as the next incarnation of a
// restarting worker, and measures how long open() takes.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <sstream>
#include <vector>

#include "process.h"
#include "tensorhub/client.h"

namespace th::e2e {
namespace {

const std::string kToken = "fairness-secret";

struct Measured {
  std::vector<double> open_ms;
  double median() const {
    auto sorted = open_ms;
    std::sort(sorted.begin(), sorted.end());
    return sorted[sorted.size() / 2];
  }
  double max() const { return *std::max_element(open_ms.begin(), open_ms.end()); }
};

std::string env_or(const char* name, const std::string& fallback) {
  const char* value = std::getenv(name);
  return value != nullptr ? std::string(value) : fallback;
}

// The load: `connections` clients split over `loads` processes, each keeping `in_flight` calls
// (framed: frames asking for an ack; --rpc: Session.send calls) of `batch` heartbeats outstanding.
struct Load {
  int connections = 1000;
  int loads = 2;
  std::string in_flight = "64";
  std::string batch = "1";
};

Measured measure_under_load(const std::filesystem::path& dir, const Load& load_shape,
                            const std::string& server_args, int opens) {
  std::vector<std::string> server_argv{TH_SERVER_PATH, "--listen", "127.0.0.1:0", "--token-file",
                                       (dir / "token").string(), "--log-level", "warn"};
  std::istringstream extra(server_args);
  for (std::string arg; extra >> arg;) server_argv.push_back(arg);
  Process server(server_argv, (dir / "server.log").string());
  const std::string listening = server.wait_for("th-server listening on ", 30'000);
  EXPECT_FALSE(listening.empty()) << server.describe();
  const std::string address = listening.substr(std::string("th-server listening on ").size());
  std::vector<std::unique_ptr<Process>> loads;
  for (int i = 0; i < load_shape.loads; ++i) {
    const int share = load_shape.connections / load_shape.loads + (i < load_shape.connections % load_shape.loads);
    std::vector<std::string> load_argv{TH_LOAD_PATH, "--server", address, "--token", kToken, "--connections",
                                       std::to_string(share), "--in-flight", load_shape.in_flight, "--batch",
                                       load_shape.batch};
    // (TH_FAIRNESS_LOAD_ARGS="--rpc": the load over Cap'n Proto RPC, bench/run-fairness's comparison.)
    std::istringstream load_extra(env_or("TH_FAIRNESS_LOAD_ARGS", ""));
    for (std::string arg; load_extra >> arg;) load_argv.push_back(arg);
    loads.push_back(std::make_unique<Process>(load_argv, (dir / ("load-" + std::to_string(i) + ".log")).string()));
  }
  for (auto& load : loads) {
    EXPECT_FALSE(load->wait_for("load ready", 120'000).empty()) << load->describe();
  }
  // Measure in the steady state: right after "ready", every connection's first calls arrive at
  // once, a burst that is not the load the issue describes.
  for (auto& load : loads) {
    for (int second = 0; second < 3; ++second) {
      EXPECT_FALSE(load->wait_for("load calls", 10'000).empty()) << load->describe();
    }
  }

  Measured measured;
  for (int incarnation = 1; incarnation <= opens; ++incarnation) {
    ClientOptions options;
    options.servers = {address};
    options.token = kToken;
    options.model = "fairness";
    options.replica = "restarting-worker";
    options.incarnation = static_cast<std::uint64_t>(incarnation);
    options.open_timeout_ms = 120'000;
    const auto started = std::chrono::steady_clock::now();
    auto handle = Handle::open(options);
    const double took_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - started).count();
    EXPECT_TRUE(handle.ok()) << (handle.ok() ? "" : handle.error().detail);
    measured.open_ms.push_back(took_ms);
    // The worker "crashes": the handle goes without closing (its next incarnation replaces it).
  }
  // The server's throughput meanwhile: each load's calls in the second after the opens.
  std::uint64_t calls_per_s = 0;
  for (auto& load : loads) {
    const std::string line = load->wait_for("load calls", 10'000);
    const auto at = line.find("last-second ");
    if (at != std::string::npos) calls_per_s += std::stoull(line.substr(at + 12));
  }
  std::cout << "  th-server [" << server_args << "]: open under " << load_shape.connections
            << " clients in " << load_shape.loads << " processes (in flight " << load_shape.in_flight << ", batch "
            << load_shape.batch << "; " << calls_per_s << " calls/s served): median "
            << measured.median() << " ms, max " << measured.max() << " ms, all:";
  for (double ms : measured.open_ms) std::cout << " " << static_cast<int>(ms);
  std::cout << "\n";
  return measured;
}

// The load's shape and the server's fairness knob come from the environment: TH_FAIRNESS_CONNECTIONS
// (default 1000), TH_FAIRNESS_LOADS (2), TH_FAIRNESS_IN_FLIGHT (64), TH_FAIRNESS_BATCH (1),
// TH_FAIRNESS_SERVER_ARGS (extra th-server options, e.g. "--messages-per-turn 8"). TH_FAIRNESS_BOUND_MS, when set, bounds
// every open. ctest runs it twice: a smoke run in the default suite (200 clients, no bound: the
// opens must succeed) and the measurement under the label bench (1,000 clients, 100 ms).
TEST(Fairness, ARestartingWorkerIsAnsweredPromptlyUnderBusyClients) {
  const auto dir = std::filesystem::temp_directory_path() / ("th-fairness-" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  std::ofstream(dir / "token") << kToken << "\n";
  Load load;
  load.connections = std::stoi(env_or("TH_FAIRNESS_CONNECTIONS", "1000"));
  load.loads = std::stoi(env_or("TH_FAIRNESS_LOADS", "2"));
  load.in_flight = env_or("TH_FAIRNESS_IN_FLIGHT", "64");
  load.batch = env_or("TH_FAIRNESS_BATCH", "1");
  ASSERT_GT(load.loads, 0);
  ASSERT_GE(load.connections, load.loads);
  const Measured fair = measure_under_load(dir, load, env_or("TH_FAIRNESS_SERVER_ARGS", ""), 9);
  if (const char* bound = std::getenv("TH_FAIRNESS_BOUND_MS")) {
    // Every one of the nine restarts (the issue: "must get its open answered within 100 ms").
    EXPECT_LT(fair.max(), std::stod(bound));
  }
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace th::e2e
