// The transfer timeline as Chrome Trace Event JSON, for Perfetto (ui.perfetto.dev) and
// chrome://tracing; tools/timeline-plot draws the same file as a PNG.
//
// Layout: one process per replica (sources first: replicas that never read, then in the order they
// first read); in it a "shard S receive" lane with a slice per read, and "shard S serve N" lanes
// with a slice per read served (as many lanes as reads overlapped). A flow arrow goes from the
// serving slice to the receiving slice of each read, so a fan-out tree, a pipeline chain (a reader
// serving while it receives) or a failover (a failed slice, then one from another source) show at
// a glance. Times are microseconds since the server started.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "server/transfer_ledger.h"

namespace th::server {

// `now_us` closes the open records' slices (their outcome says "open"); `dropped` is how many
// earlier transfers the ring no longer holds (written to otherData, so a reader knows it is partial).
std::string chrome_trace_json(const std::vector<TransferRecord>& records, std::int64_t now_us, std::uint64_t dropped);

// A JSON string literal (quotes included) of `text`, escaped; bytes that are not UTF-8 pass through.
std::string json_string(std::string_view text);

}  // namespace th::server
