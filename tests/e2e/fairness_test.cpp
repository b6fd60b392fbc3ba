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

Measured measure_under_load(const std::filesystem::path& dir, const std::string& turns_per_poll, int opens,
                            const std::string& connections) {
  Process server({TH_SERVER_PATH, "--listen", "127.0.0.1:0", "--token-file", (dir / "token").string(), "--log-level",
                  "warn", "--turns-per-poll", turns_per_poll},
                 (dir / ("server-" + turns_per_poll + ".log")).string());
  const std::string listening = server.wait_for("th-server listening on ", 30'000);
  EXPECT_FALSE(listening.empty()) << server.describe();
  const std::string address = listening.substr(std::string("th-server listening on ").size());
  Process load({TH_LOAD_PATH, "--server", address, "--token", kToken, "--connections", connections},
               (dir / ("load-" + turns_per_poll + ".log")).string());
  EXPECT_FALSE(load.wait_for("load ready", 120'000).empty()) << load.describe();
  EXPECT_FALSE(load.wait_for("load calls", 10'000).empty()) << load.describe();

  Measured measured;
  for (int incarnation = 1; incarnation <= opens; ++incarnation) {
    ClientOptions options;
    options.servers = {address};
    options.token = kToken;
    options.model = "fairness";
    options.replica = "restarting-worker";
    options.incarnation = static_cast<std::uint64_t>(incarnation);
    options.open_timeout_ms = 20'000;
    const auto started = std::chrono::steady_clock::now();
    auto handle = Handle::open(options);
    const double took_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - started).count();
    EXPECT_TRUE(handle.ok()) << (handle.ok() ? "" : handle.error().detail);
    measured.open_ms.push_back(took_ms);
    // The worker "crashes": the handle goes without closing (its next incarnation replaces it).
  }
  const std::string progress = load.wait_for("load calls", 10'000);
  std::cout << "  turns-per-poll " << turns_per_poll << ": open under load of " << connections << " clients ("
            << progress << "): median " << measured.median() << " ms, max " << measured.max() << " ms\n";
  return measured;
}

// TH_FAIRNESS_CONNECTIONS sets the load (default 1000); TH_FAIRNESS_BOUND_MS, when set, is the
// bound on the median open. ctest runs it twice: a smoke run in the default suite (200 clients, no
// bound: the opens must succeed) and the measurement under the label bench (1000 clients, 100 ms).
TEST(Fairness, ARestartingWorkerIsAnsweredPromptlyUnderBusyClients) {
  const auto dir = std::filesystem::temp_directory_path() / ("th-fairness-" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  std::ofstream(dir / "token") << kToken << "\n";
  const char* connections = std::getenv("TH_FAIRNESS_CONNECTIONS");
  const char* turns = std::getenv("TH_FAIRNESS_TURNS_PER_POLL");  // 0: kj's default, for comparison
  const Measured fair = measure_under_load(dir, turns != nullptr ? turns : "0", 9,
                                           connections != nullptr ? connections : "1000");
  if (const char* bound = std::getenv("TH_FAIRNESS_BOUND_MS")) {
    // On the median of nine restarts: one open may meet a scheduling hiccup of a shared machine.
    EXPECT_LT(fair.median(), std::stod(bound));
  }
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace th::e2e
