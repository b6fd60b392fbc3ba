#include "client/log_sink.h"

#include <exception>
#include <iostream>

namespace th::client {

LogSink::LogSink(LogHook hook, LogLevel level, std::string prefix)
    : hook_(std::move(hook)), level_(level), prefix_(std::move(prefix)) {
  if (hook_) thread_ = std::thread([this] { run(); });
}

LogSink::~LogSink() {
  {
    std::lock_guard lock(mutex_);
    stopping_ = true;
  }
  wakeup_.notify_all();
  if (thread_.joinable()) thread_.join();
}

void LogSink::log(LogLevel level, std::string_view component, std::string_view message) {
  if (level < level_) return;
  if (!hook_) return to_stderr(level, component, message);
  {
    std::lock_guard lock(mutex_);
    if (queue_.size() >= kQueuedLinesMax) {
      ++dropped_;
      return;
    }
    queue_.push_back({level, std::string(component), std::string(message)});
  }
  wakeup_.notify_one();
}

void LogSink::run() {
  std::unique_lock lock(mutex_);
  for (;;) {
    wakeup_.wait(lock, [&] { return stopping_ || !queue_.empty() || dropped_ > 0; });
    if (queue_.empty() && dropped_ == 0) return;  // stopping, and everything handed over
    std::deque<Line> lines;
    lines.swap(queue_);
    const std::uint64_t dropped = dropped_;
    dropped_ = 0;
    lock.unlock();
    if (dropped > 0) {
      lines.push_back({LogLevel::kWarning, "handle",
                       std::to_string(dropped) + " log lines were dropped: the log hook fell behind"});
    }
    for (const Line& line : lines) {
      try {
        hook_(line.level, line.component, line.message);
      } catch (const std::exception& error) {
        to_stderr(line.level, line.component, line.message + " (the log hook threw: " + error.what() + ")");
      } catch (...) {
        to_stderr(line.level, line.component, line.message + " (the log hook threw)");
      }
    }
    lock.lock();
  }
}

void LogSink::to_stderr(LogLevel level, std::string_view component, std::string_view message) const {
  // One write per line: the shards of a job often share one terminal or log file.
  std::cerr << (prefix_ + " " + std::string(log_level_name(level)) + " " + std::string(component) + ": " +
                std::string(message) + "\n");
}

}  // namespace th::client
