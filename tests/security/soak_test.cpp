// An hour of churn against real processes (label soak, outside the default run; TH_SOAK_SECONDS
// sets the length, TH_SOAK_REPORT where the figures go): a trainer publishing a version every few
// seconds, a steady rollout and three churning ones updating and verifying every byte, rollouts
// killed with -9 (mid-read or not) and restarted with a new incarnation, and the server they use
// killed with -9 and restarted every few minutes (the clients fail over to the other one). Threads,
// descriptors and RSS of every process are sampled; the long-lived ones (the trainer, the steady
// rollout) must stay flat, every verify must pass, and versions must keep arriving.
#include <dirent.h>
#include <signal.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <ctime>
#include <fstream>
#include <map>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "fixture.h"

namespace th::e2e {
namespace {

using Clock = std::chrono::steady_clock;

constexpr int kSampleEverySeconds = 10;
constexpr int kKillRolloutEveryMs = 7'000;   // on average
constexpr int kKillServerEverySeconds = 300;
constexpr int kChurningRollouts = 3;
// Flat: the late average of a figure is at most this factor of the early one (plus the slack).
constexpr double kGrowthFactorMax = 1.3;
constexpr long kThreadsSlack = 4;
constexpr long kFdsSlack = 8;
constexpr long kRssSlackKb = 32 * 1024;

struct Sample {
  int at_s;
  std::string who;
  long threads;
  long fds;
  long rss_kb;
};

long status_field(int pid, const std::string& field) {
  std::ifstream status("/proc/" + std::to_string(pid) + "/status");
  for (std::string line; std::getline(status, line);) {
    if (line.rfind(field + ":", 0) == 0) return std::stol(line.substr(field.size() + 1));
  }
  return -1;
}

long open_fds(int pid) {
  long count = 0;
  if (DIR* dir = ::opendir(("/proc/" + std::to_string(pid) + "/fd").c_str())) {
    while (const dirent* entry = ::readdir(dir)) count += entry->d_name[0] != '.';
    ::closedir(dir);
  }
  return count;
}

std::string machine() {
  std::ifstream cpuinfo("/proc/cpuinfo");
  std::string model = "?";
  for (std::string line; std::getline(cpuinfo, line);) {
    if (line.rfind("model name", 0) == 0) {
      model = line.substr(line.find(':') + 2);
      break;
    }
  }
  return model + ", " + std::to_string(std::thread::hardware_concurrency()) + " cores";
}

class Soak : public ProcessTest {
 protected:

  // A worker's lines so far (read without waiting, so that no pipe fills up during an hour).
  static void drain(Process& process) { process.read_available(); }

  static int count_lines(const Process& process, const std::string& prefix) {
    return static_cast<int>(std::count_if(process.lines().begin(), process.lines().end(),
                                          [&](const std::string& line) { return line.rfind(prefix, 0) == 0; }));
  }

  // th-server on a fixed port, so that a restart comes back where the clients look for it.
  Process& server_at(const std::string& address) {
    Process& server = spawn({TH_SERVER_PATH, "--listen", address, "--token-file", (dir_ / "token").string(),
                             "--heartbeat-timeout-ms", "3000", "--log-level", "info"},
                            "server");
    EXPECT_FALSE(server.wait_for("th-server listening on ", kStepMs).empty()) << server.describe();
    return server;
  }
};

TEST_F(Soak, AnHourOfChurnLeavesNothingBehind) {
  const int seconds = std::getenv("TH_SOAK_SECONDS") ? std::atoi(std::getenv("TH_SOAK_SECONDS")) : 3600;
  ASSERT_GE(seconds, 60);
  // Two servers on ports the kernel picks once.
  std::vector<std::string> addresses;
  for (int i = 0; i < 2; ++i) addresses.push_back(start_server({"--heartbeat-timeout-ms", "3000", "--log-level", "info"}));
  std::vector<Process*> server = {servers_[0], servers_[1]};
  int active = 0;  // the server the clients use now
  auto servers_for_new = [&] { return std::vector<std::string>{addresses[active], addresses[1 - active]}; };

  const std::vector<std::string> model = {"--tensor-bytes", "4000000", "--tensors", "3", "--small-tensors", "4"};
  auto trainer_script = [&](std::uint64_t first) {
    std::vector<std::string> script;
    for (std::uint64_t v = first; v < first + static_cast<std::uint64_t>(seconds); ++v) {
      script.insert(script.end(), {"publish:" + std::to_string(v), "sleep:3000", "unpublish"});
    }
    return script;
  };
  // Longer than the soak (each step sleeps at least 500 ms): a script that ran out would leave a
  // process that no longer does anything, and its flat figures would prove nothing.
  auto rollout_script = [&] {
    std::vector<std::string> script;
    for (int i = 0; i < 2 * seconds; ++i) script.insert(script.end(), {"update:latest", "verify", "sleep:500"});
    return script;
  };
  std::uint64_t trainer_incarnation = 1;
  Process* trainer = &worker(servers_for_new(), "trainer", model, trainer_script(1));
  Process* steady = &worker(servers_for_new(), "steady", model, rollout_script());
  std::vector<Process*> churning;
  std::vector<std::uint64_t> incarnation(kChurningRollouts, 1);
  for (int i = 0; i < kChurningRollouts; ++i) {
    churning.push_back(&worker(servers_for_new(), "churn" + std::to_string(i), model, rollout_script()));
  }
  int verified = 0;
  int updated = 0;  // transfers: updates that moved to a newer version
  int verify_failures = 0;
  int rollout_kills = 0;
  int server_kills = 0;
  int trainer_restarts = 0;
  int rollout_restarts = 0;
  std::uint64_t steady_incarnation = 1;
  std::uint64_t last_published = 0;
  // Lines of processes that are gone, counted before they go.
  auto settle = [&](Process& process) {
    drain(process);
    verified += count_lines(process, "verify ok");
    updated += count_lines(process, "update updated");
    verify_failures += count_lines(process, "verify error");
  };
  std::vector<Sample> samples;
  std::mt19937 random(20261201);
  const auto started = Clock::now();
  auto elapsed_s = [&] { return static_cast<int>(std::chrono::duration_cast<std::chrono::seconds>(Clock::now() - started).count()); };
  int next_sample_s = 0;
  const int kill_server_every_s = std::min(kKillServerEverySeconds, seconds / 3);  // at least twice
  int next_server_kill_s = kill_server_every_s;
  auto next_rollout_kill = Clock::now() + std::chrono::milliseconds(random() % (2 * kKillRolloutEveryMs));
  while (elapsed_s() < seconds) {
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    for (Process* process : {trainer, steady}) drain(*process);
    for (Process* process : churning) drain(*process);
    for (const std::string& line : trainer->lines()) {
      if (line.rfind("publish ok ", 0) == 0) last_published = std::max<std::uint64_t>(last_published, std::stoull(line.substr(11)));
    }
    // A trainer evicted during a failover (its barrier passed without it) starts over, as a job's would.
    if (!trainer->lines().empty() && trainer->lines().back().find("error replica-evicted") != std::string::npos) {
      ++trainer_restarts;
      trainer->kill9();
      std::vector<std::string> again = model;
      again.insert(again.end(), {"--incarnation", std::to_string(++trainer_incarnation)});
      trainer = &worker(servers_for_new(), "trainer", again, trainer_script(last_published + 1));
    }
    // A rollout evicted (a failover barrier passed without it) is restarted, and counted.
    auto evicted = [](const Process& process) {
      return !process.lines().empty() && process.lines().back().find("error replica-evicted") != std::string::npos;
    };
    if (evicted(*steady)) {
      ++rollout_restarts;
      settle(*steady);
      steady->kill9();
      std::vector<std::string> again = model;
      again.insert(again.end(), {"--incarnation", std::to_string(++steady_incarnation)});
      steady = &worker(servers_for_new(), "steady", again, rollout_script());
    }
    if (Clock::now() >= next_rollout_kill) {
      const int victim = static_cast<int>(random() % kChurningRollouts);
      settle(*churning[victim]);
      churning[victim]->kill9();
      ++rollout_kills;
      std::vector<std::string> again = model;
      again.insert(again.end(), {"--incarnation", std::to_string(++incarnation[victim])});
      churning[victim] = &worker(servers_for_new(), "churn" + std::to_string(victim), again, rollout_script());
      next_rollout_kill = Clock::now() + std::chrono::milliseconds(random() % (2 * kKillRolloutEveryMs));
    }
    if (elapsed_s() >= next_server_kill_s) {
      server[active]->kill9();
      ++server_kills;
      server[active] = &server_at(addresses[active]);  // back, as the backup now
      active = 1 - active;
      next_server_kill_s += kill_server_every_s;
    }
    if (elapsed_s() >= next_sample_s) {
      auto sample = [&](const std::string& who, const Process& process) {
        samples.push_back({elapsed_s(), who, status_field(process.pid(), "Threads"), open_fds(process.pid()),
                           status_field(process.pid(), "VmRSS")});
      };
      sample("trainer", *trainer);
      sample("steady", *steady);
      sample("server-a", *server[0]);
      sample("server-b", *server[1]);
      sample("churn0", *churning[0]);
      next_sample_s += kSampleEverySeconds;
    }
  }
  settle(*steady);
  settle(*trainer);
  for (Process* process : churning) settle(*process);

  // The figures, for bench/results.
  std::string report_path = std::getenv("TH_SOAK_REPORT") ? std::getenv("TH_SOAK_REPORT") : "";
  if (report_path.empty()) {
    char date[16];
    const std::time_t now = std::time(nullptr);
    std::strftime(date, sizeof date, "%Y-%m-%d", std::gmtime(&now));
    report_path = std::string(TH_SOURCE_DIR) + "/bench/results/soak-" + date + ".md";
  }
  std::ostringstream report;
  report << "# Soak: " << seconds << " s of churn (tests/security/soak_test.cpp)\n\n"
         << "Machine: " << machine() << "\n\n"
         << "- versions published: " << last_published << "; updates that moved to a newer version (transfers): " << updated
         << "; verify calls (every byte checked): " << verified
         << "; verify failures: " << verify_failures << "\n- rollouts killed with -9 and restarted: " << rollout_kills
         << "; servers killed with -9 and restarted: " << server_kills << "; trainer restarts (evicted): " << trainer_restarts
         << "; steady rollout restarts (evicted): " << rollout_restarts
         << "\n\n| t (s) | process | threads | fds | RSS (MiB) |\n|---|---|---|---|---|\n";
  for (const Sample& s : samples) {
    report << "| " << s.at_s << " | " << s.who << " | " << s.threads << " | " << s.fds << " | " << s.rss_kb / 1024 << " |\n";
  }
  std::ofstream(report_path) << report.str();
  std::cout << report.str().substr(0, 600) << "\n";

  for (const auto& [who, process] : {std::pair{"trainer", trainer}, {"steady", steady}}) {
    EXPECT_TRUE(running(*process)) << who << " is no longer running at the end: its figures prove nothing";
  }
  EXPECT_EQ(verify_failures, 0);
  EXPECT_GE(last_published, static_cast<std::uint64_t>(seconds / 10)) << "versions stopped coming";
  EXPECT_GE(updated, seconds / 10) << "transfers stopped succeeding";
  // Flat: the last quarter against the second (after warm-up), for each long-lived process.
  for (const std::string who : {"trainer", "steady"}) {
    auto average = [&](int from_s, int to_s, long Sample::*field) {
      long sum = 0, count = 0;
      for (const Sample& s : samples) {
        if (s.who == who && s.at_s >= from_s && s.at_s < to_s && s.*field >= 0) {
          sum += s.*field;
          ++count;
        }
      }
      return count > 0 ? static_cast<double>(sum) / static_cast<double>(count) : 0.0;
    };
    const int quarter = seconds / 4;
    for (const auto& [name, field, slack] : {std::tuple{"threads", &Sample::threads, kThreadsSlack},
                                             std::tuple{"fds", &Sample::fds, kFdsSlack},
                                             std::tuple{"RSS kB", &Sample::rss_kb, kRssSlackKb}}) {
      const double early = average(quarter, 2 * quarter, field);
      const double late = average(3 * quarter, seconds + 1, field);
      EXPECT_LE(late, early * kGrowthFactorMax + static_cast<double>(slack))
          << who << " " << name << " grew from " << early << " to " << late;
    }
  }
}

// Models that come and go for an hour (issue 32, finding 1): a server shared by experiments opens
// a model per run, and each run ends. Every couple of seconds four trainers each publish version 1
// of a model and four rollouts read and verify it, then all close; the model ends a grace later
// (--model-grace-ms 1000) and its name comes back with the next run, from version 1 again. The
// server's threads, descriptors and RSS must stay flat, and every run must get in (64 models at
// once would be refused if ended models stayed).
TEST_F(Soak, ModelChurnLeavesTheServerFlat) {
  const int seconds = std::getenv("TH_SOAK_SECONDS") ? std::atoi(std::getenv("TH_SOAK_SECONDS")) : 3600;
  ASSERT_GE(seconds, 60);
  const std::string address = start_server({"--model-grace-ms", "1000", "--log-level", "info"});
  Process& server = *servers_[0];
  constexpr int kRunsAtOnce = 4;
  // A round takes kRoundMs at least, so each name comes back 8 rounds (2 s) later: a second after
  // the model ended (--model-grace-ms 1000); at most ~20 models wait out their grace at once.
  constexpr int kModelNames = 32;
  constexpr auto kRoundMs = std::chrono::milliseconds(250);
  int runs = 0;
  int published = 0;
  int verified = 0;
  int refused = 0;
  std::vector<Sample> samples;
  const auto started = Clock::now();
  auto elapsed_s = [&] { return static_cast<int>(std::chrono::duration_cast<std::chrono::seconds>(Clock::now() - started).count()); };
  int next_sample_s = 0;
  for (int round = 0; elapsed_s() < seconds; ++round) {
    const auto round_started = Clock::now();
    std::vector<Process*> trainers;
    std::vector<Process*> rollouts;
    for (int i = 0; i < kRunsAtOnce; ++i) {
      const std::string model = "churn-" + std::to_string((round * kRunsAtOnce + i) % kModelNames);
      trainers.push_back(&worker({address}, "trainer", {"--model", model}, {"publish:1", "wait-line", "unpublish", "close"}));
    }
    for (int i = 0; i < kRunsAtOnce; ++i) {
      const std::string line = trainers[i]->wait_for("publish ", kStepMs);
      published += line == "publish ok 1";
      refused += line.find("limit-exceeded") != std::string::npos;
      EXPECT_EQ(line, "publish ok 1") << trainers[i]->describe();
      const std::string model = "churn-" + std::to_string((round * kRunsAtOnce + i) % kModelNames);
      rollouts.push_back(&worker({address}, "rollout", {"--model", model}, {"replicate:latest", "verify", "close"}));
    }
    for (Process* rollout : rollouts) {
      verified += rollout->wait_for("verify ", kStepMs) == "verify ok 1";
      EXPECT_EQ(expect(*rollout, "close "), "close ok");
    }
    for (Process* trainer : trainers) {
      trainer->send_line("go");
      EXPECT_EQ(expect(*trainer, "close "), "close ok");
    }
    for (Process* process : trainers) forget(*process);
    for (Process* process : rollouts) forget(*process);
    runs += kRunsAtOnce;
    if (elapsed_s() >= next_sample_s) {
      samples.push_back({elapsed_s(), "server", status_field(server.pid(), "Threads"), open_fds(server.pid()),
                         status_field(server.pid(), "VmRSS")});
      next_sample_s += kSampleEverySeconds;
    }
    if (::testing::Test::HasFailure()) break;  // one failed run says enough
    std::this_thread::sleep_until(round_started + kRoundMs);
  }
  std::ifstream log(server.log_path());
  int ended_lines = 0;
  for (std::string line; std::getline(log, line);) ended_lines += line.find("model(s) ended after") != std::string::npos;

  char date[16];
  const std::time_t now = std::time(nullptr);
  std::strftime(date, sizeof date, "%Y-%m-%d", std::gmtime(&now));
  const std::string report_path = std::getenv("TH_SOAK_REPORT")
                                      ? std::string(std::getenv("TH_SOAK_REPORT")) + ".models"
                                      : std::string(TH_SOURCE_DIR) + "/bench/results/soak-model-churn-" + date + ".md";
  std::ostringstream report;
  report << "# Soak: " << seconds << " s of model churn (tests/security/soak_test.cpp ModelChurnLeavesTheServerFlat)\n\n"
         << "Machine: " << machine() << "\n\n- runs (a model opened, published, read, closed, ended): " << runs
         << "; versions published: " << published << "; reads verified: " << verified << "; opens refused: " << refused
         << "; server log lines of models ended: " << ended_lines
         << "\n\n| t (s) | process | threads | fds | RSS (MiB) |\n|---|---|---|---|---|\n";
  for (const Sample& s : samples) {
    report << "| " << s.at_s << " | " << s.who << " | " << s.threads << " | " << s.fds << " | " << s.rss_kb / 1024 << " |\n";
  }
  std::ofstream(report_path) << report.str();
  std::cout << report.str().substr(0, 600) << "\n";

  EXPECT_EQ(published, runs);
  EXPECT_EQ(verified, runs);
  EXPECT_EQ(refused, 0);
  EXPECT_GT(ended_lines, 0) << "no model ended: the churn proved nothing";
  auto average = [&](int from_s, int to_s, long Sample::*field) {
    long sum = 0, count = 0;
    for (const Sample& s : samples) {
      if (s.at_s >= from_s && s.at_s < to_s && s.*field >= 0) {
        sum += s.*field;
        ++count;
      }
    }
    return count > 0 ? static_cast<double>(sum) / static_cast<double>(count) : 0.0;
  };
  const int quarter = seconds / 4;
  for (const auto& [name, field, slack] : {std::tuple{"threads", &Sample::threads, kThreadsSlack},
                                           std::tuple{"fds", &Sample::fds, kFdsSlack},
                                           std::tuple{"RSS kB", &Sample::rss_kb, kRssSlackKb}}) {
    const double early = average(quarter, 2 * quarter, field);
    const double late = average(3 * quarter, seconds + 1, field);
    EXPECT_LE(late, early * kGrowthFactorMax + static_cast<double>(slack)) << "th-server " << name << " grew from " << early << " to " << late;
  }
}

}  // namespace
}  // namespace th::e2e
