// What th-server saw of every transfer: who read which shard of which version from whom, when,
// how many bytes, and how it ended. Feeds the transfer timeline (--timeline, th-ctl timeline) and
// the transfer metrics (bytes moved, read failures).
//
// The Hub's transfers are replica-wide and leave no trace once finished; the ledger follows one
// shard's read at a time from the effects and reports that pass through the shell:
//   StartRead to a reader shard        opens (transfer, epoch, reader client)
//   TransferDone / TransferFailed      closes it as done / failed (from that reader shard)
//   StopServing (transfer, epoch)      closes what is still open of that epoch as withdrawn
//                                      (the hub moved the reader elsewhere or cancelled it)
//   StartRead of a later epoch         closes the earlier epochs of that reader shard likewise
// Memory is bounded twice: a ring of the last `finished_max` closed records, and at most
// `open_max` open ones (past it, new transfers are counted as unrecorded, not kept).
#pragma once

#include <cstdint>
#include <deque>
#include <map>
#include <string>
#include <tuple>
#include <vector>

#include "core/hub.h"

namespace th::server {

struct TransferRecord {
  enum class End : std::uint8_t { kOpen, kDone, kFailed, kWithdrawn };
  TransferId transfer = 0;
  std::uint32_t epoch = 0;
  Version version = 0;
  std::uint32_t shard = 0;
  std::string model;
  std::string reader;
  std::string reader_datacenter;
  std::string source;
  std::string source_datacenter;
  CopyKind source_kind = CopyKind::kPrimary;
  bool source_partial = false;  // the source was still receiving (pipeline replication)
  std::uint64_t bytes = 0;      // the shard's size; 0 if the model's layout was not known yet
  std::int64_t start_us = 0;    // since the server started
  std::int64_t end_us = -1;     // -1 while open
  End end = End::kOpen;
  ReadFailure failure = ReadFailure::kSourceUnreachable;  // kFailed: why
};
std::string end_description(const TransferRecord& record);  // "done", "failed: checksum-mismatch", ...

class TransferLedger {
 public:
  static constexpr std::size_t kFinishedMaxDefault = 16384;
  static constexpr std::size_t kOpenMax = 1 << 18;

  explicit TransferLedger(std::size_t finished_max = kFinishedMaxDefault);

  // After each Hub::step: the input it took and the effects it produced, at `now_us`.
  void observe(const Hub& hub, const Input& input, const Effects& effects, std::int64_t now_us);

  // The finished records in the ring (oldest first), then open ones (at most finished_max of them).
  std::vector<TransferRecord> records() const;
  std::size_t finished_max() const { return finished_max_; }
  std::uint64_t dropped() const { return dropped_; }  // closed records pushed out of the ring, or never kept

  // Totals since the server started (metrics).
  struct LinkKey {
    std::string source_datacenter;
    std::string reader_datacenter;
    friend auto operator<=>(const LinkKey&, const LinkKey&) = default;
  };
  struct FailureKey {
    ReadFailure reason = ReadFailure::kSourceUnreachable;
    std::string source_datacenter;
    friend auto operator<=>(const FailureKey&, const FailureKey&) = default;
  };
  const std::map<LinkKey, std::uint64_t>& bytes_by_link() const { return bytes_by_link_; }
  const std::map<FailureKey, std::uint64_t>& failures() const { return failures_; }
  std::uint64_t withdrawn() const { return withdrawn_; }
  std::uint64_t reads_done() const { return reads_done_; }
  std::size_t open_count() const { return open_.size(); }
  std::uint64_t revision() const { return revision_; }  // changes with every record opened or closed

 private:
  using Key = std::tuple<TransferId, std::uint32_t, ClientId>;  // transfer, epoch, reader client
  void on_start(const Hub& hub, ClientId reader, const StartRead& start, std::int64_t now_us);
  // Closes the open records of `transfer` that `match(key, record)`.
  template <typename Match>
  void close_matching(TransferId transfer, TransferRecord::End end, ReadFailure failure, std::int64_t now_us,
                      const Match& match);
  void close(std::map<Key, TransferRecord>::iterator open, TransferRecord::End end, ReadFailure failure,
             std::int64_t now_us);

  std::size_t finished_max_;
  std::deque<TransferRecord> finished_;
  std::map<Key, TransferRecord> open_;
  std::uint64_t dropped_ = 0;
  std::uint64_t withdrawn_ = 0;
  std::uint64_t reads_done_ = 0;
  std::uint64_t revision_ = 0;
  // Bounded by the datacenters the hub knows (and the three read failure reasons).
  std::map<LinkKey, std::uint64_t> bytes_by_link_;
  std::map<FailureKey, std::uint64_t> failures_;
};

}  // namespace th::server
