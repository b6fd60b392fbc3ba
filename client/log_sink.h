// Where a handle's log lines go (ClientOptions::log, log_level). Without a hook: stderr, one write
// per line, on the calling thread. With one: a bounded queue and a thread of the sink's own, so
// that a hook that is slow (a log shipper stuck on the network) or throws cannot stall or kill the
// library's threads: the I/O thread's heartbeats, a data server holding its lock, the reader.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <mutex>
#include <string>
#include <string_view>
#include <thread>

#include "tensorhub/client.h"

namespace th::client {

class LogSink {
 public:
  // Lines waiting for a slow hook; past this, new lines are dropped and counted (the hook is told
  // how many once it catches up).
  static constexpr std::size_t kQueuedLinesMax = 1024;

  LogSink(LogHook hook, LogLevel level, std::string prefix);
  // Hands the hook what is queued, then stops the thread (so ~Handle waits for a hook that is
  // still running).
  ~LogSink();
  LogSink(const LogSink&) = delete;
  LogSink& operator=(const LogSink&) = delete;

  // Thread-safe; returns at once with a hook.
  void log(LogLevel level, std::string_view component, std::string_view message);

 private:
  struct Line {
    LogLevel level;
    std::string component;
    std::string message;
  };
  void run();
  void to_stderr(LogLevel level, std::string_view component, std::string_view message) const;

  const LogHook hook_;
  const LogLevel level_;
  const std::string prefix_;  // "thclient REPLICA/SHARD"
  std::mutex mutex_;
  std::condition_variable wakeup_;
  std::deque<Line> queue_;
  std::uint64_t dropped_ = 0;
  bool stopping_ = false;
  std::thread thread_;  // last: starts once the rest is built
};

}  // namespace th::client
