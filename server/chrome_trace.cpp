#include "server/chrome_trace.h"

#include <algorithm>
#include <map>
#include <set>

#include "core/assert.h"

namespace th::server {

namespace {

// Lanes per shard within a replica's process: tid = shard * kLanesPerShard + lane, lane 0 receives,
// lanes 1.. serve. Reads served at once beyond kLanesPerShard - 1 share the last lane.
constexpr std::int64_t kLanesPerShard = 64;

struct Slice {
  const TransferRecord* record = nullptr;
  std::int64_t end_us = 0;
  int reader_pid = 0;
  std::int64_t reader_tid = 0;
  int source_pid = 0;
  std::int64_t source_tid = 0;
};

void append_args(std::string& out, const TransferRecord& record) {
  out += "\"args\":{\"transfer\":" + std::to_string(record.transfer) + ",\"epoch\":" + std::to_string(record.epoch) +
         ",\"model\":" + json_string(record.model) + ",\"version\":" + std::to_string(record.version) +
         ",\"shard\":" + std::to_string(record.shard) + ",\"reader\":" + json_string(record.reader) +
         ",\"source\":" + json_string(record.source) + ",\"source_kind\":\"" +
         (record.source_kind == CopyKind::kPrimary ? "primary" : "offload") + "\",\"partial\":" +
         (record.source_partial ? "true" : "false") + ",\"bytes\":" + std::to_string(record.bytes) +
         ",\"outcome\":" + json_string(end_description(record)) +
         ",\"reader_datacenter\":" + json_string(record.reader_datacenter) +
         ",\"source_datacenter\":" + json_string(record.source_datacenter) + "}";
}

}  // namespace

std::string json_string(std::string_view text) {
  std::string out = "\"";
  for (char c : text) {
    const auto byte = static_cast<unsigned char>(c);
    if (c == '"') {
      out += "\\\"";
    } else if (c == '\\') {
      out += "\\\\";
    } else if (byte < 0x20) {
      static constexpr char kHex[] = "0123456789abcdef";
      out += "\\u00";
      out += kHex[byte >> 4];
      out += kHex[byte & 0xF];
    } else {
      out += c;
    }
  }
  out += '"';
  return out;
}

std::string chrome_trace_json(const std::vector<TransferRecord>& records, std::int64_t now_us, std::uint64_t dropped) {
  // Processes: replicas that never read first (trainers), then readers by their first read.
  std::vector<const TransferRecord*> by_start;
  by_start.reserve(records.size());
  for (const TransferRecord& record : records) by_start.push_back(&record);
  std::stable_sort(by_start.begin(), by_start.end(),
                   [](const TransferRecord* a, const TransferRecord* b) { return a->start_us < b->start_us; });
  // A process is a replica of a model: replicas of the same name in different models (every job's
  // "rollout-0") are told apart by their model's name when the timeline holds several models.
  std::set<std::string> models;
  for (const TransferRecord* record : by_start) models.insert(record->model);
  const bool several_models = models.size() > 1;
  auto reader_of = [&](const TransferRecord& record) {
    return several_models ? record.model + "/" + record.reader : record.reader;
  };
  auto source_of = [&](const TransferRecord& record) {
    return several_models ? record.model + "/" + record.source : record.source;
  };
  std::set<std::string> readers;
  for (const TransferRecord* record : by_start) readers.insert(reader_of(*record));
  std::vector<std::string> order;
  std::set<std::string> seen;
  for (const TransferRecord* record : by_start) {
    if (!readers.contains(source_of(*record)) && seen.insert(source_of(*record)).second) order.push_back(source_of(*record));
  }
  for (const TransferRecord* record : by_start) {
    if (seen.insert(reader_of(*record)).second) order.push_back(reader_of(*record));
  }
  for (const TransferRecord* record : by_start) {
    if (seen.insert(source_of(*record)).second) order.push_back(source_of(*record));
  }
  std::map<std::string, int> pid_of;
  for (std::size_t i = 0; i < order.size(); ++i) pid_of[order[i]] = static_cast<int>(i) + 1;

  // Serve lanes: greedy, in start order, the first lane of (source, shard) free by the read's start.
  std::map<std::pair<std::string, std::uint32_t>, std::vector<std::int64_t>> lane_ends;
  std::set<std::pair<int, std::int64_t>> lanes_used;  // (pid, tid)
  std::vector<Slice> slices;
  slices.reserve(by_start.size());
  for (const TransferRecord* record : by_start) {
    Slice slice;
    slice.record = record;
    // At least 1 us, so that the slice exists and its flow binds to it.
    slice.end_us = std::max(record->end_us < 0 ? now_us : record->end_us, record->start_us + 1);
    slice.reader_pid = pid_of.at(reader_of(*record));
    slice.reader_tid = static_cast<std::int64_t>(record->shard) * kLanesPerShard;
    slice.source_pid = pid_of.at(source_of(*record));
    auto& ends = lane_ends[{source_of(*record), record->shard}];
    std::size_t lane = 0;
    while (lane < ends.size() && ends[lane] > record->start_us) ++lane;
    if (lane == ends.size()) {
      if (ends.size() < static_cast<std::size_t>(kLanesPerShard - 1)) {
        ends.push_back(0);
      } else {
        lane = ends.size() - 1;
      }
    }
    ends[lane] = std::max(ends[lane], slice.end_us);
    slice.source_tid = static_cast<std::int64_t>(record->shard) * kLanesPerShard + 1 + static_cast<std::int64_t>(lane);
    lanes_used.insert({slice.reader_pid, slice.reader_tid});
    lanes_used.insert({slice.source_pid, slice.source_tid});
    slices.push_back(slice);
  }

  std::string out = "{\"displayTimeUnit\":\"ms\",\"otherData\":{\"generator\":\"th-server\",\"transfers\":" +
                    std::to_string(records.size()) + ",\"dropped\":" + std::to_string(dropped) +
                    "},\"traceEvents\":[";
  bool first = true;
  auto event = [&](const std::string& body) {
    if (!first) out += ",\n";
    first = false;
    out += body;
  };
  for (std::size_t i = 0; i < order.size(); ++i) {
    const std::string pid = std::to_string(i + 1);
    event("{\"ph\":\"M\",\"name\":\"process_name\",\"pid\":" + pid + ",\"args\":{\"name\":" + json_string(order[i]) + "}}");
    event("{\"ph\":\"M\",\"name\":\"process_sort_index\",\"pid\":" + pid + ",\"args\":{\"sort_index\":" + pid + "}}");
  }
  for (const auto& [pid, tid] : lanes_used) {
    const std::int64_t shard = tid / kLanesPerShard;
    const std::int64_t lane = tid % kLanesPerShard;
    const std::string name = "shard " + std::to_string(shard) + (lane == 0 ? " receive" : " serve " + std::to_string(lane));
    event("{\"ph\":\"M\",\"name\":\"thread_name\",\"pid\":" + std::to_string(pid) + ",\"tid\":" + std::to_string(tid) +
          ",\"args\":{\"name\":" + json_string(name) + "}}");
    event("{\"ph\":\"M\",\"name\":\"thread_sort_index\",\"pid\":" + std::to_string(pid) + ",\"tid\":" +
          std::to_string(tid) + ",\"args\":{\"sort_index\":" + std::to_string(tid) + "}}");
  }
  std::uint64_t flow = 0;
  for (const Slice& slice : slices) {
    const TransferRecord& record = *slice.record;
    const std::string ts = std::to_string(record.start_us);
    const std::string dur = std::to_string(slice.end_us - record.start_us);
    const std::string version = "v" + std::to_string(record.version);
    std::string receive = "{\"ph\":\"X\",\"cat\":\"receive\",\"name\":" + json_string(version + " <- " + record.source) +
                          ",\"pid\":" + std::to_string(slice.reader_pid) + ",\"tid\":" +
                          std::to_string(slice.reader_tid) + ",\"ts\":" + ts + ",\"dur\":" + dur + ",";
    append_args(receive, record);
    event(receive + "}");
    std::string serve = "{\"ph\":\"X\",\"cat\":\"serve\",\"name\":" + json_string(version + " -> " + record.reader) +
                        ",\"pid\":" + std::to_string(slice.source_pid) + ",\"tid\":" + std::to_string(slice.source_tid) +
                        ",\"ts\":" + ts + ",\"dur\":" + dur + ",";
    append_args(serve, record);
    event(serve + "}");
    ++flow;
    event("{\"ph\":\"s\",\"cat\":\"flow\",\"name\":\"transfer\",\"id\":" + std::to_string(flow) + ",\"pid\":" +
          std::to_string(slice.source_pid) + ",\"tid\":" + std::to_string(slice.source_tid) + ",\"ts\":" + ts + "}");
    event("{\"ph\":\"f\",\"bp\":\"e\",\"cat\":\"flow\",\"name\":\"transfer\",\"id\":" + std::to_string(flow) +
          ",\"pid\":" + std::to_string(slice.reader_pid) + ",\"tid\":" + std::to_string(slice.reader_tid) +
          ",\"ts\":" + ts + "}");
  }
  out += "]}\n";
  TH_ASSERT(flow == records.size(), "one flow per transfer");
  return out;
}

}  // namespace th::server
