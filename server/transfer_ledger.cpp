#include "server/transfer_ledger.h"

#include "core/assert.h"

namespace th::server {

std::string end_description(const TransferRecord& record) {
  switch (record.end) {
    case TransferRecord::End::kOpen: return "open";
    case TransferRecord::End::kDone: return "done";
    case TransferRecord::End::kFailed: return "failed: " + std::string(read_failure_name(record.failure));
    case TransferRecord::End::kWithdrawn: return "withdrawn";
  }
  return "unknown";
}

TransferLedger::TransferLedger(std::size_t finished_max) : finished_max_(finished_max) {
  TH_REQUIRE(finished_max_ > 0, "the timeline keeps at least one transfer");
}

void TransferLedger::observe(const Hub& hub, const Input& input, const Effects& effects, std::int64_t now_us) {
  // The report first: the effects it caused (a StopServing to its source) come after it.
  if (const auto* report = std::get_if<Report>(&input)) {
    if (const auto* done = std::get_if<TransferDone>(&report->body)) {
      // The hub counts bytes read from an earlier source too (every tensor was verified), so a
      // done of an earlier epoch completes the shard's read of the current one.
      close_matching(done->transfer, TransferRecord::End::kDone, ReadFailure::kSourceUnreachable, now_us,
                     [&](const Key& key, const TransferRecord&) { return std::get<2>(key) == report->client; });
    } else if (const auto* failed = std::get_if<TransferFailed>(&report->body)) {
      close_matching(failed->transfer, TransferRecord::End::kFailed, failed->reason, now_us,
                     [&](const Key& key, const TransferRecord&) {
                       return std::get<1>(key) == failed->epoch && std::get<2>(key) == report->client;
                     });
    }
  }
  for (const Effect& effect : effects) {
    if (const auto* start = std::get_if<StartRead>(&effect.message)) {
      on_start(hub, effect.client, *start, now_us);
    } else if (const auto* stop = std::get_if<StopServing>(&effect.message)) {
      // To one source shard: the reader shard with its index no longer reads from it. (A source
      // the hub no longer knows was evicted: every reader of it moves.)
      const auto source = hub.identify(effect.client);
      close_matching(stop->transfer, TransferRecord::End::kWithdrawn, ReadFailure::kSourceUnreachable, now_us,
                     [&](const Key& key, const TransferRecord& record) {
                       return std::get<1>(key) == stop->epoch && (!source || record.shard == source->shard);
                     });
    }
  }
}

template <typename Match>
void TransferLedger::close_matching(TransferId transfer, TransferRecord::End end, ReadFailure failure,
                                    std::int64_t now_us, const Match& match) {
  for (auto open = open_.lower_bound(Key{transfer, 0, 0});
       open != open_.end() && std::get<0>(open->first) == transfer;) {
    auto next = std::next(open);
    if (match(open->first, open->second)) close(open, end, failure, now_us);
    open = next;
  }
}

void TransferLedger::on_start(const Hub& hub, ClientId reader, const StartRead& start, std::int64_t now_us) {
  const Key key{start.transfer, start.epoch, reader};
  if (open_.contains(key)) return;  // the same instruction again (a retransmitted call, a seed's resend)
  // This reader shard's earlier epochs of the transfer are over: the hub picked another source.
  close_matching(start.transfer, TransferRecord::End::kWithdrawn, ReadFailure::kSourceUnreachable, now_us,
                 [&](const Key& open, const TransferRecord&) {
                   return std::get<1>(open) < start.epoch && std::get<2>(open) == reader;
                 });
  if (open_.size() >= kOpenMax) {
    ++dropped_;
    return;
  }
  TransferRecord record;
  record.transfer = start.transfer;
  record.epoch = start.epoch;
  record.version = start.version;
  record.shard = start.shard;
  record.source = start.source.replica;
  record.source_datacenter = start.source.datacenter;
  record.source_kind = start.source.kind;
  record.source_partial = start.source.partial;
  record.start_us = now_us;
  if (auto identity = hub.identify(reader)) {
    record.model = std::move(identity->model);
    record.reader = std::move(identity->replica);
    record.reader_datacenter = std::move(identity->datacenter);
    record.bytes = identity->shard_bytes;
  }
  // Offload seeding reads into a buffer of the layout it names (the model's may not be fixed yet).
  if (start.layout != nullptr) record.bytes = start.layout->total_bytes();
  open_.emplace(key, std::move(record));
  ++revision_;
}

void TransferLedger::close(std::map<Key, TransferRecord>::iterator open, TransferRecord::End end,
                           ReadFailure failure, std::int64_t now_us) {
  TH_ASSERT(open != open_.end(), "close names an open transfer");
  TH_REQUIRE(end != TransferRecord::End::kOpen, "a closed transfer has an end");
  TransferRecord record = std::move(open->second);
  open_.erase(open);
  ++revision_;
  record.end = end;
  record.failure = failure;
  record.end_us = std::max(now_us, record.start_us);
  if (end == TransferRecord::End::kDone) {
    bytes_by_link_[LinkKey{record.source_datacenter, record.reader_datacenter}] += record.bytes;
    ++reads_done_;
  } else if (end == TransferRecord::End::kFailed) {
    ++failures_[FailureKey{failure, record.source_datacenter}];
  } else {
    ++withdrawn_;
  }
  if (finished_.size() == finished_max_) {
    finished_.pop_front();
    ++dropped_;
  }
  finished_.push_back(std::move(record));
  TH_ASSERT(finished_.size() <= finished_max_, "the ring stays within its bound");
}

std::vector<TransferRecord> TransferLedger::records() const {
  std::vector<TransferRecord> records(finished_.begin(), finished_.end());
  // Open reads too, as many as the ring holds at most (a timeline's size stays bounded by it).
  for (const auto& [key, record] : open_) {
    if (records.size() >= 2 * finished_max_) break;
    records.push_back(record);
  }
  return records;
}

}  // namespace th::server
