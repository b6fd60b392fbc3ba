#include "sim/trace.h"

#include <cstdio>
#include <fstream>

namespace th::sim {

std::string json_escape(std::string_view text) {
  std::string out;
  out.reserve(text.size());
  for (char c : text) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\t': out += "\\t"; break;
      default:
        if (static_cast<unsigned char>(c) < 0x20) {
          char escaped[8];
          std::snprintf(escaped, sizeof escaped, "\\u%04x", c);
          out += escaped;
        } else {
          out += c;
        }
    }
  }
  return out;
}

namespace {
// Chrome traces count microseconds.
std::string micros(TimeMs ms) { return std::to_string(ms * 1000); }
}  // namespace

void Trace::lane(int lane, std::string_view name) {
  if (!keep_events_) return;
  events_.push_back(R"({"ph":"M","name":"thread_name","pid":1,"tid":)" + std::to_string(lane) +
                    R"(,"args":{"name":")" + json_escape(name) + "\"}}");
}

void Trace::span(int lane, std::string_view name, std::string_view category, TimeMs start_ms,
                 TimeMs end_ms, std::string_view args_json) {
  if (!keep_events_) return;
  events_.push_back(R"({"ph":"X","name":")" + json_escape(name) + R"(","cat":")" +
                    json_escape(category) + R"(","pid":1,"tid":)" + std::to_string(lane) +
                    R"(,"ts":)" + micros(start_ms) + R"(,"dur":)" + micros(end_ms - start_ms) +
                    R"(,"args":)" + std::string(args_json) + "}");
}

void Trace::instant(int lane, std::string_view name, std::string_view category, TimeMs at_ms,
                    bool global) {
  if (!keep_events_) return;
  events_.push_back(R"({"ph":"i","name":")" + json_escape(name) + R"(","cat":")" +
                    json_escape(category) + R"(","pid":1,"tid":)" + std::to_string(lane) +
                    R"(,"ts":)" + micros(at_ms) + R"(,"s":")" + (global ? "g" : "t") + "\"}");
}

Status Trace::write(const std::string& path) const {
  std::ofstream out(path, std::ios::trunc);
  if (!out) return make_error(Errc::kInvalidArgument, "cannot write trace file '" + path + "'");
  out << "{\"displayTimeUnit\":\"ms\",\"traceEvents\":[\n";
  for (std::size_t i = 0; i < events_.size(); ++i) {
    out << events_[i] << (i + 1 < events_.size() ? ",\n" : "\n");
  }
  out << "]}\n";
  if (!out) return make_error(Errc::kInvalidArgument, "failed writing trace file '" + path + "'");
  return Unit{};
}

}  // namespace th::sim
