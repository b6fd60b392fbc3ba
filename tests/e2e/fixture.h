// The fixture of the tests that run real th-server, worker and th-ctl processes on loopback (the
// e2e and security suites): a scratch directory with the token, processes that are killed when the
// test ends, and their output printed when it failed.
#pragma once

#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "process.h"

namespace th::e2e {

constexpr int kStepMs = 15'000;  // generous: CI machines are slow and shared
const std::string kToken = "e2e-secret";

class ProcessTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    dir_ = std::filesystem::temp_directory_path() /
           ("th-" + std::string(info->test_suite_name()) + "-" + std::to_string(::getpid()) + "-" + info->name());
    std::filesystem::create_directories(dir_);
    std::ofstream(dir_ / "token") << kToken << "\n";
  }

  void TearDown() override {
    expect_pulls_over_the_transport_asked_for();
    if (HasFailure()) {
      for (const auto& process : processes_) std::cerr << process->describe() << "\n\n";
    }
    processes_.clear();  // kills whatever still runs
    std::filesystem::remove_all(dir_);
  }

  // A worker's --read-rate: `bytes_per_s`, divided by TH_E2E_SLOWDOWN where the suite runs on a
  // slow machine (the rdma guest emulates its CPUs: a reader must still be reading when the next
  // worker, slower to start there, comes to pipeline from it).
  static std::string read_rate(std::uint64_t bytes_per_s) {
    const char* slowdown = std::getenv("TH_E2E_SLOWDOWN");
    const std::uint64_t factor = slowdown != nullptr ? std::max<std::uint64_t>(1, std::strtoull(slowdown, nullptr, 10)) : 1;
    return std::to_string(bytes_per_s / factor);
  }

  // The suite runs once per transport (TH_E2E_TRANSPORT, set by the rdma guest): under rdma every
  // pull a worker made must have been one-sided (workers say how on stderr, into their logs).
  void expect_pulls_over_the_transport_asked_for() {
    const char* transport = std::getenv("TH_E2E_TRANSPORT");
    if (transport == nullptr || std::string(transport) != "rdma") return;
    for (const auto& entry : std::filesystem::directory_iterator(dir_)) {
      std::ifstream log(entry.path());
      for (std::string line; std::getline(log, line);) {
        EXPECT_NE(line, "th-e2e-worker: pulled over tcp") << entry.path() << ": a pull fell back to TCP";
      }
    }
  }

  // Starts a th-server; returns its "127.0.0.1:PORT". With `fds`, the process may hold at most that
  // many descriptors (soft and hard limit).
  std::string start_server(std::vector<std::string> extra = {}, int fds = 0) {
    std::vector<std::string> argv = {TH_SERVER_PATH, "--listen", "127.0.0.1:0"};
    if (std::find(extra.begin(), extra.end(), "--token-file") == extra.end()) {
      argv.insert(argv.end(), {"--token-file", (dir_ / "token").string()});
    }
    if (fds > 0) argv.insert(argv.begin(), {"/bin/sh", "-c", "ulimit -n " + std::to_string(fds) + " && exec \"$0\" \"$@\""});
    // Defaults unless `extra` sets them (an option given twice is refused).
    for (const auto& [option, value] : {std::pair{"--log-level", "debug"}, {"--heartbeat-timeout-ms", "3000"}}) {
      if (std::find(extra.begin(), extra.end(), option) == extra.end()) {
        argv.push_back(option);
        argv.push_back(value);
      }
    }
    argv.insert(argv.end(), extra.begin(), extra.end());
    Process& server = spawn(argv, "server");
    const std::string line = server.wait_for("th-server listening on ", kStepMs);
    EXPECT_FALSE(line.empty()) << server.describe();
    servers_.push_back(&server);
    return line.substr(std::string("th-server listening on ").size());
  }

  // Whether the process runs (not exited, not a zombie).
  static bool running(const Process& process) {
    std::ifstream stat("/proc/" + std::to_string(process.pid()) + "/stat");
    std::string pid, name, state;
    stat >> pid >> name >> state;
    return stat.good() && state != "Z" && state != "X";
  }

  Process& worker(const std::vector<std::string>& servers, const std::string& replica,
                  std::vector<std::string> flags, const std::vector<std::string>& script,
                  const std::string& token = kToken) {
    std::vector<std::string> argv = {TH_WORKER_PATH, "--token", token, "--replica", replica};
    for (const auto& server : servers) {
      argv.push_back("--server");
      argv.push_back(server);
    }
    argv.insert(argv.end(), flags.begin(), flags.end());
    argv.push_back("--");
    argv.insert(argv.end(), script.begin(), script.end());
    return spawn(argv, replica);
  }

  Process& spawn(std::vector<std::string> argv, const std::string& name) {
    const auto log = dir_ / (name + "-" + std::to_string(processes_.size()) + ".log");
    processes_.push_back(std::make_unique<Process>(std::move(argv), log.string()));
    return *processes_.back();
  }

  // Ends `process` (killed and reaped if still running) and forgets it: a long test's finished
  // workers, whose pipes would otherwise stay open until the test ends.
  void forget(Process& process) {
    std::erase_if(processes_, [&](const std::unique_ptr<Process>& each) { return each.get() == &process; });
  }

  // Expects `prefix…` from `process` (within the step timeout) and returns the line.
  std::string expect(Process& process, const std::string& prefix) {
    const std::string line = process.wait_for(prefix, kStepMs);
    EXPECT_FALSE(line.empty()) << "expected '" << prefix << "' from\n" << process.describe();
    return line;
  }

  // th-ctl's listing of `server` (waits for it to exit).
  std::string ctl(const std::string& server) {
    Process& ctl = spawn({TH_CTL_PATH, "--server", server, "--token-file", (dir_ / "token").string()}, "ctl");
    std::string listing;
    for (std::string line; !(line = ctl.wait_for("", kStepMs)).empty();) listing += line + "\n";
    EXPECT_EQ(ctl.wait_exit(kStepMs), 0) << ctl.describe();
    return listing;
  }

  std::filesystem::path dir_;
  std::vector<std::unique_ptr<Process>> processes_;
  std::vector<Process*> servers_;
};

}  // namespace th::e2e
