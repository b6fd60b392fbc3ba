// What a simulation run did: a hash of every event (two runs of one seed must hash the same), and,
// when asked for, a Chrome Trace Event file (opens in Perfetto or chrome://tracing): one lane per
// worker with its calls, transfers (source -> reader), offloads, crashes and the server failover.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "core/result.h"
#include "core/types.h"

namespace th::sim {

class Trace {
 public:
  explicit Trace(bool keep_events) : keep_events_(keep_events) {}

  // Folds a value into the run's hash (FNV-1a over its 8 bytes).
  void mix(std::uint64_t value) {
    for (int i = 0; i < 8; ++i) {
      hash_ ^= (value >> (8 * i)) & 0xff;
      hash_ *= 0x100000001b3ULL;
    }
  }
  std::uint64_t hash() const { return hash_; }
  bool keeps_events() const { return keep_events_; }

  // Chrome Trace Event records (only kept when writing a file). Times in virtual milliseconds.
  void lane(int lane, std::string_view name);
  void span(int lane, std::string_view name, std::string_view category, TimeMs start_ms,
            TimeMs end_ms, std::string_view args_json = "{}");
  void instant(int lane, std::string_view name, std::string_view category, TimeMs at_ms,
               bool global = false);
  Status write(const std::string& path) const;

 private:
  bool keep_events_;
  std::uint64_t hash_ = 0xcbf29ce484222325ULL;
  std::vector<std::string> events_;
};

std::string json_escape(std::string_view text);

}  // namespace th::sim
