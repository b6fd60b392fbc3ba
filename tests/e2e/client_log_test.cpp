// libthclient's log hook (issue 18): lines go to ClientOptions::log with their level and
// component, those below log_level are dropped, and without a hook they go to stderr as before.
#include <gtest/gtest.h>

#include <chrono>
#include <mutex>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "fixture.h"
#include "tensorhub/client.h"

namespace th::e2e {
namespace {

class ClientLog : public ProcessTest {};

struct Captured {
  std::mutex mutex;
  std::vector<std::tuple<LogLevel, std::string, std::string>> lines;

  LogHook hook() {
    return [this](LogLevel level, std::string_view component, std::string_view message) {
      std::lock_guard lock(mutex);
      lines.emplace_back(level, std::string(component), std::string(message));
    };
  }
  bool has(LogLevel level, const std::string& component, const std::string& words) {
    std::lock_guard lock(mutex);
    for (const auto& [l, c, m] : lines) {
      if (l == level && c == component && m.find(words) != std::string::npos) return true;
    }
    return false;
  }
  std::size_t size() {
    std::lock_guard lock(mutex);
    return lines.size();
  }
};

ClientOptions options_for(const std::string& server, const std::string& replica) {
  ClientOptions options;
  options.servers = {server};
  options.token = kToken;
  options.model = "m";
  options.replica = replica;
  options.open_timeout_ms = kStepMs;
  return options;
}

TEST_F(ClientLog, LinesGoToTheHookWithLevelAndComponentAndBelowTheLevelAreDropped) {
  const std::string server = start_server();
  Captured warnings;
  Captured errors_only;
  ClientOptions options = options_for(server, "a");
  options.log = warnings.hook();
  options.log_level = LogLevel::kInfo;
  auto a = Handle::open(options);
  ASSERT_TRUE(a.ok()) << a.error().detail;
  ClientOptions quiet = options_for(server, "b");
  quiet.log = errors_only.hook();
  quiet.log_level = LogLevel::kError;
  auto b = Handle::open(quiet);
  ASSERT_TRUE(b.ok()) << b.error().detail;
  // The only server goes: both handles lose it, a warning of the control connections.
  servers_.front()->kill9();
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(kStepMs);
  while (!warnings.has(LogLevel::kWarning, "control", "lost server " + server) &&
         std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  EXPECT_TRUE(warnings.has(LogLevel::kWarning, "control", "lost server " + server));
  EXPECT_GE(b.value()->stats().servers_lost, 1U);  // b lost it too, and said nothing below kError
  EXPECT_EQ(errors_only.size(), 0U);
}

TEST(LogLevelName, NamesEveryLevel) {
  EXPECT_EQ(log_level_name(LogLevel::kDebug), "debug");
  EXPECT_EQ(log_level_name(LogLevel::kInfo), "info");
  EXPECT_EQ(log_level_name(LogLevel::kWarning), "warning");
  EXPECT_EQ(log_level_name(LogLevel::kError), "error");
}

}  // namespace
}  // namespace th::e2e
