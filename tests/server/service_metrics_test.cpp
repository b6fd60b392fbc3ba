// th-server's observations of the hub: the transfer ledger (every shard read, how it ended), the
// Prometheus figures rendered from it, and the Chrome trace of the timeline. Driven by the real Hub
// through the core's test driver (every step's input and effects are fed as th-server feeds them).
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "core/assert.h"
#include "server/chrome_trace.h"
#include "server/service_metrics.h"
#include "tests/core/testkit/driver.h"

namespace th::server {
namespace {

using test::Driver;
using test::ReplicaSpec;

// Feeds ServiceMetrics like HubService::feed: each step at a later microsecond.
class Feed final : public test::StepWatcher {
 public:
  Feed(Driver& driver, std::size_t finished_max) : driver_(driver), metrics_(finished_max) {}
  void before_step(const Input&, TimeMs) override {}
  void after_step(const Input& input, const Effects& effects, TimeMs now_ms) override {
    const std::int64_t start_us = std::max(clock_us_ + 1, now_ms * 1000);
    clock_us_ = start_us + 7;  // each step "takes" 7 us
    metrics_.observe(driver_.hub(), input, effects, start_us, clock_us_);
  }
  void on_server_restart() override {}
  ServiceMetrics& metrics() { return metrics_; }
  std::int64_t now_us() const { return clock_us_; }

 private:
  Driver& driver_;
  ServiceMetrics metrics_;
  std::int64_t clock_us_ = 0;
};

ReplicaSpec replica(std::string name, std::string role, std::string datacenter = "dc0") {
  ReplicaSpec spec;
  spec.name = std::move(name);
  spec.num_shards = 2;
  spec.role = std::move(role);
  spec.datacenter = std::move(datacenter);
  return spec;
}

void replicate(Driver& driver, const std::vector<ClientId>& shards) {
  for (std::uint32_t shard = 0; shard < shards.size(); ++shard) {
    driver.call(shards[shard], ReplicateRequest{Selector::latest(), test::layout_for(shard), 0});
  }
}

std::size_t count(const std::string& text, const std::string& needle) {
  std::size_t found = 0;
  for (auto at = text.find(needle); at != std::string::npos; at = text.find(needle, at + 1)) ++found;
  return found;
}

bool has_line(const std::string& text, const std::string& line) { return text.find("\n" + line + "\n") != std::string::npos; }

// A hub observed as th-server observes it, with a trainer that published version 1.
struct PublishedJob {
  explicit PublishedJob(std::size_t finished_max = TransferLedger::kFinishedMaxDefault) : feed(driver, finished_max) {
    driver.set_watcher(&feed);
    trainer = driver.open_replica(replica("trainer", "trainer"));
    driver.publish(trainer, 1);
  }
  Driver driver;
  Feed feed;
  std::vector<ClientId> trainer;
};

TEST(TransferLedger, RecordsEveryShardReadOfAPipelineChainWithItsSourceAndBytes) {
  PublishedJob job;
  Driver& driver = job.driver;
  Feed& feed = job.feed;
  const auto first = driver.open_replica(replica("r0", "rollout"));
  const auto second = driver.open_replica(replica("r1", "rollout", "dc1"));
  replicate(driver, first);
  replicate(driver, second);  // reads r0 while r0 still receives (pipeline)
  EXPECT_EQ(feed.metrics().ledger().open_count(), 4u);
  driver.finish_reads(second);
  driver.finish_reads(first);
  EXPECT_TRUE(test::is<ReplicateOk>(driver.replies(first)));
  EXPECT_TRUE(test::is<ReplicateOk>(driver.replies(second)));

  const TransferLedger& ledger = feed.metrics().ledger();
  const auto records = ledger.records();
  ASSERT_EQ(records.size(), 4u);
  EXPECT_EQ(ledger.open_count(), 0u);
  for (const TransferRecord& record : records) {
    EXPECT_EQ(record.end, TransferRecord::End::kDone);
    EXPECT_EQ(record.model, "m");
    EXPECT_EQ(record.version, 1u);
    EXPECT_EQ(record.bytes, test::layout_for(record.shard)->total_bytes());
    EXPECT_GT(record.end_us, record.start_us);
    if (record.reader == "r0") {
      EXPECT_EQ(record.source, "trainer");
      EXPECT_FALSE(record.source_partial);
    } else {
      EXPECT_EQ(record.reader, "r1");
      EXPECT_EQ(record.source, "r0");
      EXPECT_TRUE(record.source_partial);
      EXPECT_EQ(record.reader_datacenter, "dc1");
      EXPECT_EQ(record.source_datacenter, "dc0");
    }
  }
  const std::uint64_t shard_pair = test::layout_for(0)->total_bytes() + test::layout_for(1)->total_bytes();
  EXPECT_EQ(ledger.bytes_by_link().at({"dc0", "dc0"}), shard_pair);
  EXPECT_EQ(ledger.bytes_by_link().at({"dc0", "dc1"}), shard_pair);

  const std::string text = feed.metrics().render(driver.hub(), ShellFigures{});
  EXPECT_TRUE(has_line(text, "th_server_operations_total{op=\"publish\",result=\"ok\"} 2")) << text;
  EXPECT_TRUE(has_line(text, "th_server_operations_total{op=\"replicate\",result=\"ok\"} 4")) << text;
  EXPECT_TRUE(has_line(text, "th_server_operations_total{op=\"open\",result=\"ok\"} 6")) << text;
  EXPECT_TRUE(has_line(text, "th_server_shard_reads_total{outcome=\"done\"} 4")) << text;
  EXPECT_TRUE(has_line(text, "th_server_transfers_completed_total 2")) << text;
  EXPECT_TRUE(has_line(text, "th_server_transfer_bytes_total{source_datacenter=\"dc0\",reader_datacenter=\"dc1\"} " +
                                 std::to_string(shard_pair)))
      << text;
  EXPECT_TRUE(has_line(text, "th_server_operation_seconds_count{op=\"replicate\"} 4")) << text;
  EXPECT_TRUE(has_line(text, "th_server_replicas{model=\"m\",role=\"rollout\",state=\"complete\"} 2")) << text;
  EXPECT_TRUE(has_line(text, "th_server_versions_held{model=\"m\"} 1")) << text;

  const std::string trace = chrome_trace_json(records, feed.now_us(), ledger.dropped());
  EXPECT_EQ(count(trace, "\"ph\":\"s\""), 4u);
  EXPECT_EQ(count(trace, "\"ph\":\"f\",\"bp\":\"e\""), 4u);
  EXPECT_EQ(count(trace, "\"cat\":\"receive\""), 4u);
  EXPECT_EQ(count(trace, "\"cat\":\"serve\""), 4u);
  // r0 serves r1 while it receives: a serve lane and a receive lane in r0's process.
  EXPECT_NE(trace.find("\"name\":\"v1 -> r1\""), std::string::npos) << trace;
  EXPECT_NE(trace.find("\"args\":{\"name\":\"shard 1 serve 1\"}"), std::string::npos) << trace;
}

TEST(TransferLedger, AFailedReadThenAnotherSourceShowsBothWithTheFailureCounted) {
  PublishedJob job;
  Driver& driver = job.driver;
  Feed& feed = job.feed;
  const auto backup = driver.open_replica(replica("backup", "rollout"));
  replicate(driver, backup);
  driver.finish_reads(backup);
  ASSERT_TRUE(test::is<ReplicateOk>(driver.replies(backup)));
  const auto reader = driver.open_replica(replica("reader", "rollout"));
  replicate(driver, reader);
  // Shard 0's source fails it; the hub moves the whole replica's read to the other source.
  const auto read = driver.inbox(reader[0]).reads;
  ASSERT_EQ(read.size(), 1u);
  const std::string first_source = read.begin()->second.source.replica;
  driver.report(reader[0], TransferFailed{read.begin()->first, read.begin()->second.epoch, ReadFailure::kChecksumMismatch});
  driver.finish_reads(reader);
  driver.finish_reads(reader);
  EXPECT_TRUE(test::is<ReplicateOk>(driver.replies(reader)));

  const TransferLedger& ledger = feed.metrics().ledger();
  std::size_t failed = 0;
  std::size_t done_elsewhere = 0;
  for (const TransferRecord& record : ledger.records()) {
    if (record.reader != "reader") continue;
    EXPECT_NE(record.end, TransferRecord::End::kOpen);
    if (record.end == TransferRecord::End::kFailed) {
      ++failed;
      EXPECT_EQ(record.source, first_source);
      EXPECT_EQ(end_description(record), "failed: checksum-mismatch");
    }
    if (record.end == TransferRecord::End::kDone && record.source != first_source && record.epoch > 1) ++done_elsewhere;
  }
  EXPECT_EQ(failed, 1u);
  EXPECT_EQ(done_elsewhere, 2u);  // both shards, from the other source, in the new epoch
  EXPECT_EQ(ledger.failures().at({ReadFailure::kChecksumMismatch, "dc0"}), 1u);
  const std::string text = feed.metrics().render(driver.hub(), ShellFigures{});
  EXPECT_TRUE(has_line(text, "th_server_read_failures_total{reason=\"checksum-mismatch\",source_datacenter=\"dc0\"} 1"))
      << text;
}

TEST(TransferLedger, KeepsOnlyTheLastFinishedReadsAndCountsTheRest) {
  PublishedJob job(3);
  Driver& driver = job.driver;
  Feed& feed = job.feed;
  for (int i = 0; i < 3; ++i) {
    const auto reader = driver.open_replica(replica("r" + std::to_string(i), "rollout"));
    replicate(driver, reader);
    driver.finish_reads(reader);
    EXPECT_TRUE(test::is<ReplicateOk>(driver.replies(reader)));
  }
  const TransferLedger& ledger = feed.metrics().ledger();
  const auto records = ledger.records();
  EXPECT_EQ(records.size(), 3u);
  EXPECT_EQ(ledger.dropped(), 3u);
  EXPECT_EQ(records.back().reader, "r2");  // the newest kept
  EXPECT_EQ(ledger.reads_done(), 6u);      // the totals count every read
  EXPECT_NE(chrome_trace_json(records, feed.now_us(), ledger.dropped()).find("\"dropped\":3"), std::string::npos);
}

TEST(ServiceMetrics, AnOperationRetransmittedAfterItsAnswerIsCountedOnce) {
  PublishedJob job(16);
  Driver& driver = job.driver;
  Feed& feed = job.feed;
  const auto& trainer = job.trainer;
  // The same publish again (a client that did not hear the answer): answered again, counted once.
  const std::uint64_t seq = driver.next_seq(trainer[0]) - 1;
  driver.set_next_seq(trainer[0], seq);
  driver.call(trainer[0], PublishRequest{1, test::layout_for(0), test::checksums_for(1, 0)});
  EXPECT_TRUE(driver.take_reply(trainer[0]).has_value());
  EXPECT_EQ(feed.metrics().operations(1 + static_cast<std::size_t>(OpKind::kPublish), "ok"), 2u);
}

TEST(ChromeTrace, EscapesNamesSoThatAnyReplicaNameGivesValidJson) {
  EXPECT_EQ(json_string("plain"), "\"plain\"");
  EXPECT_EQ(json_string("a\"b\\c\nd\x01"), "\"a\\\"b\\\\c\\u000ad\\u0001\"");
  TransferRecord record;
  record.reader = "r\"1";
  record.source = "t\n";
  record.end = TransferRecord::End::kDone;
  record.end_us = 5;
  const std::string trace = chrome_trace_json({record}, 10, 0);
  EXPECT_NE(trace.find("\"name\":\"r\\\"1\""), std::string::npos) << trace;
  EXPECT_EQ(trace.find("t\n"), std::string::npos) << trace;
}

// Two jobs whose replicas have the same names ("trainer", "rollout-0": every job's defaults) are
// two processes each in the timeline, not one row that mixes their transfers (issue 33).
TEST(ChromeTrace, SameNamedReplicasOfTwoModelsAreTwoProcesses) {
  std::vector<TransferRecord> records;
  for (const std::string model : {"policy", "reward"}) {
    TransferRecord record;
    record.model = model;
    record.reader = "rollout-0";
    record.source = "trainer";
    record.end = TransferRecord::End::kDone;
    record.start_us = records.empty() ? 1 : 3;
    record.end_us = record.start_us + 1;
    records.push_back(record);
  }
  const std::string trace = chrome_trace_json(records, 10, 0);
  for (const char* process : {"policy/trainer", "policy/rollout-0", "reward/trainer", "reward/rollout-0"}) {
    EXPECT_NE(trace.find("\"args\":{\"name\":\"" + std::string(process) + "\"}"), std::string::npos) << process << trace;
  }
  // One model: plain replica names, as before.
  const std::string one = chrome_trace_json({records[0]}, 10, 0);
  EXPECT_NE(one.find("\"args\":{\"name\":\"rollout-0\"}"), std::string::npos) << one;
}

}  // namespace
}  // namespace th::server
