// th-server's log lines: "2026-12-01T13:05:00.123Z warn  auth: 3 call(s) with a wrong cluster token
// refused (...)" — time (UTC, ms), level, component, text. One process-wide output, stderr unless
// a file is named (th-server --log-file); reopen() after logrotate moved the file (SIGHUP).
// Lines are written whole under a mutex (tools embed servers on threads of their own).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "core/result.h"

namespace th::server {

enum class LogLevel : std::uint8_t { kError, kWarn, kInfo, kDebug };
std::optional<LogLevel> parse_log_level(std::string_view name);
std::string_view log_level_name(LogLevel level);

class LogOutput {
 public:
  // Appends to `path` from now on (created if missing); fails with kInvalidArgument if it cannot
  // be opened, and the output stays as it was.
  static Status use_file(const std::string& path);
  // Opens the file again by its name (after logrotate moved it); stderr: nothing to do.
  static Status reopen();
  static void write(LogLevel level, std::string_view component, std::string_view text);
};

}  // namespace th::server
