#include "server/log.h"

#include <chrono>
#include <cstdio>
#include <ctime>
#include <mutex>

namespace th::server {

namespace {

struct Output {
  std::mutex mutex;
  std::string path;       // empty: stderr
  std::FILE* file = nullptr;
};

Output& output() {
  static Output instance;
  return instance;
}

}  // namespace

std::optional<LogLevel> parse_log_level(std::string_view name) {
  if (name == "error") return LogLevel::kError;
  if (name == "warn") return LogLevel::kWarn;
  if (name == "info") return LogLevel::kInfo;
  if (name == "debug") return LogLevel::kDebug;
  return std::nullopt;
}

std::string_view log_level_name(LogLevel level) {
  switch (level) {
    case LogLevel::kError: return "error";
    case LogLevel::kWarn: return "warn";
    case LogLevel::kInfo: return "info";
    case LogLevel::kDebug: return "debug";
  }
  return "?";
}

Status LogOutput::use_file(const std::string& path) {
  std::FILE* file = std::fopen(path.c_str(), "a");
  if (file == nullptr) return Error{Errc::kInvalidArgument, "cannot open the log file " + path};
  std::setvbuf(file, nullptr, _IOLBF, 0);
  Output& out = output();
  std::lock_guard lock(out.mutex);
  if (out.file != nullptr) std::fclose(out.file);
  out.file = file;
  out.path = path;
  return Unit{};
}

Status LogOutput::reopen() {
  Output& out = output();
  std::string path;
  {
    std::lock_guard lock(out.mutex);
    path = out.path;
  }
  if (path.empty()) return Unit{};
  return use_file(path);
}

void LogOutput::write(LogLevel level, std::string_view component, std::string_view text) {
  const auto now = std::chrono::system_clock::now();
  const std::time_t seconds = std::chrono::system_clock::to_time_t(now);
  const auto millis =
      std::chrono::duration_cast<std::chrono::milliseconds>(now.time_since_epoch()).count() % 1000;
  std::tm utc{};
  gmtime_r(&seconds, &utc);
  char stamp[40];
  const std::size_t length = std::strftime(stamp, sizeof stamp, "%Y-%m-%dT%H:%M:%S", &utc);
  std::string line(stamp, length);
  char fraction[8];
  std::snprintf(fraction, sizeof fraction, ".%03dZ ", static_cast<int>(millis));
  line += fraction;
  const std::string_view name = log_level_name(level);
  line += name;
  line.append(name.size() < 5 ? 5 - name.size() + 1 : 1, ' ');
  line += component;
  line += ": ";
  line += text;
  line += '\n';
  Output& out = output();
  std::lock_guard lock(out.mutex);
  std::FILE* file = out.file != nullptr ? out.file : stderr;
  std::fwrite(line.data(), 1, line.size(), file);
  std::fflush(file);
}

}  // namespace th::server
