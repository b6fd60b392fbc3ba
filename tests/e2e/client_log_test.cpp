// libthclient's log hook (issue 18): lines go to ClientOptions::log with their level and
// component, those below log_level are dropped, and without a hook they go to stderr as before.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <stdexcept>
#include <mutex>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "client/log_sink.h"
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

TEST_F(ClientLog, AHookThatThrowsLosesOnlyItsLineToStderr) {
  const std::string server = start_server();
  std::atomic<int> calls{0};
  ClientOptions options = options_for(server, "a");
  options.log = [&calls](LogLevel, std::string_view, std::string_view) {
    ++calls;
    throw std::runtime_error("the hook threw");
  };
  auto a = Handle::open(options);
  ASSERT_TRUE(a.ok()) << a.error().detail;
  servers_.front()->kill9();
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(kStepMs);
  while (calls.load() == 0 && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  EXPECT_GE(calls.load(), 1);
  EXPECT_GE(a.value()->stats().servers_lost, 1U);  // the handle carries on
}

// The sink's queue: a hook that does not return stalls no caller; past 1,024 queued lines the rest
// are dropped and counted, and the hook hears of them once it catches up.
TEST(LogSink, ASlowHookStallsNoCallerAndHearsWhatWasDropped) {
  std::mutex mutex;
  std::condition_variable changed;
  bool entered = false;
  bool released = false;
  std::vector<std::string> seen;
  {
    client::LogSink sink(
        [&](LogLevel, std::string_view, std::string_view message) {
          std::unique_lock lock(mutex);
          seen.emplace_back(message);
          entered = true;
          changed.notify_all();
          changed.wait(lock, [&] { return released; });
        },
        LogLevel::kDebug, "thclient test/0");
    sink.log(LogLevel::kInfo, "handle", "line 0");
    {
      std::unique_lock lock(mutex);
      changed.wait(lock, [&] { return entered; });  // the hook holds line 0
    }
    for (int i = 1; i < 2000; ++i) sink.log(LogLevel::kInfo, "handle", "line " + std::to_string(i));
    sink.log(LogLevel::kInfo, "handle", "line 2000");
    {
      std::lock_guard lock(mutex);
      released = true;
    }
    changed.notify_all();
  }  // ~LogSink hands over what is queued
  // Line 0, the 1,024 that were queued (lines 1..1024), and the count of lines 1025..2000.
  ASSERT_EQ(seen.size(), 1U + client::LogSink::kQueuedLinesMax + 1U);
  EXPECT_EQ(seen[1], "line 1");
  EXPECT_EQ(seen[client::LogSink::kQueuedLinesMax], "line 1024");
  EXPECT_EQ(seen.back(), "976 log lines were dropped: the log hook fell behind");
}

TEST(LogSink, DropsLinesBelowItsLevel) {
  std::vector<LogLevel> seen;
  {
    client::LogSink sink([&](LogLevel level, std::string_view, std::string_view) { seen.push_back(level); },
                         LogLevel::kWarning, "thclient test/0");
    sink.log(LogLevel::kDebug, "handle", "no");
    sink.log(LogLevel::kInfo, "handle", "no");
    sink.log(LogLevel::kWarning, "handle", "yes");
    sink.log(LogLevel::kError, "handle", "yes");
  }
  EXPECT_EQ(seen, (std::vector<LogLevel>{LogLevel::kWarning, LogLevel::kError}));
}

TEST(LogLevelName, NamesEveryLevel) {
  EXPECT_EQ(log_level_name(LogLevel::kDebug), "debug");
  EXPECT_EQ(log_level_name(LogLevel::kInfo), "info");
  EXPECT_EQ(log_level_name(LogLevel::kWarning), "warning");
  EXPECT_EQ(log_level_name(LogLevel::kError), "error");
}

}  // namespace
}  // namespace th::e2e
