// th-server's lifecycle: a SIGTERM drains it (clients fail over to the backup at once, the
// server exits 0), a SIGHUP reopens its log file (logrotate), and its log lines say when, what and
// where.
#include <gtest/gtest.h>

#include <chrono>
#include <csignal>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>

#include "fixture.h"
#include "process.h"

namespace th::e2e {
namespace {

class Lifecycle : public ProcessTest {};

std::string read_file(const std::filesystem::path& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

// Waits (bounded) until `path` holds `needle`; returns the file's text then (or at the deadline).
std::string wait_for_text(const std::filesystem::path& path, const std::string& needle) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(kStepMs);
  std::string text;
  while (std::chrono::steady_clock::now() < deadline) {
    text = read_file(path);
    if (text.find(needle) != std::string::npos) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return text;
}

TEST_F(Lifecycle, SigtermDrainsTheServerAndItsClientsFailOverToTheBackupAtOnce) {
  const auto log = dir_ / "primary.log";
  const auto timeline = dir_ / "timeline.json";
  // The heartbeat timeout is long: a client that moved on must have been told, not have timed out.
  const std::string primary = start_server({"--log-file", log.string(), "--log-level", "info", "--timeline",
                                            timeline.string(), "--heartbeat-timeout-ms", "60000"});
  const std::string backup = start_server({"--heartbeat-timeout-ms", "60000"});
  Process& trainer = worker({primary, backup}, "trainer", {},
                            {"publish:1", "wait-line", "unpublish", "publish:2", "wait-line"});
  expect(trainer, "publish ok 1");
  Process& rollout = worker({primary, backup}, "rollout", {},
                            {"replicate:latest", "verify", "wait-line", "update:latest", "verify"});
  EXPECT_EQ(expect(rollout, "verify "), "verify ok 1");

  servers_[0]->signal(SIGTERM);
  EXPECT_EQ(servers_[0]->wait_exit(kStepMs), 0) << servers_[0]->describe();
  const std::string said = read_file(log);
  EXPECT_NE(said.find(" info  lifecycle: signal 15: draining"), std::string::npos) << said;
  EXPECT_NE(said.find("lifecycle: draining: closing 2 connection(s) (clients told to fail over)"), std::string::npos) << said;
  EXPECT_NE(said.find("lifecycle: drained: every connection closed"), std::string::npos) << said;
  EXPECT_NE(said.find("lifecycle: stopped"), std::string::npos) << said;
  // Each client heard why, rather than finding a closed connection.
  EXPECT_NE(wait_for_text(rollout.log_path(), "the server is going away: th-server is shutting down")
                .find("the server is going away"),
            std::string::npos);

  // The job carries on with the backup.
  trainer.send_line("go");
  expect(trainer, "unpublish ok");
  expect(trainer, "publish ok 2");
  rollout.send_line("go");
  EXPECT_EQ(expect(rollout, "update "), "update updated 2 from trainer");
  EXPECT_EQ(expect(rollout, "verify "), "verify ok 2");

  // The timeline was written at exit: the rollout's read of version 1 from the trainer.
  const std::string trace = read_file(timeline);
  EXPECT_NE(trace.find("\"cat\":\"receive\",\"name\":\"v1 <- trainer\""), std::string::npos) << trace;
  EXPECT_NE(trace.find("\"outcome\":\"done\""), std::string::npos) << trace;
}

TEST_F(Lifecycle, SighupReopensTheLogFileThatLogrotateMoved) {
  const auto log = dir_ / "server.log";
  const auto rotated = dir_ / "server.log.1";
  const std::string server = start_server({"--log-file", log.string(), "--log-level", "debug"});
  ctl(server);  // something to log: a connection that comes and goes
  const std::string first = wait_for_text(log, ") closed");
  ASSERT_NE(first.find(" debug conn: connection "), std::string::npos) << first;

  std::filesystem::rename(log, rotated);  // what logrotate does, then it sends SIGHUP
  servers_[0]->signal(SIGHUP);
  const std::string reopened = wait_for_text(log, "lifecycle: SIGHUP: log file reopened");
  EXPECT_NE(reopened.find("lifecycle: SIGHUP: log file reopened"), std::string::npos) << reopened;
  ctl(server);  // the server still serves, and logs into the new file
  EXPECT_NE(wait_for_text(log, ") closed").find(") closed"), std::string::npos);
  const std::string old = read_file(rotated);
  EXPECT_EQ(old, first.substr(0, old.size())) << "the rotated file only kept what came before";
  EXPECT_EQ(old.find("SIGHUP"), std::string::npos) << old;
}

// A token rotation without a restart: both tokens for a while, then only the new one.
TEST_F(Lifecycle, SighupTakesTheTokenFileAgainSoThatATokenCanBeRotated) {
  const auto tokens = dir_ / "server-tokens";
  const auto old_token = dir_ / "old-token";
  const auto new_token = dir_ / "new-token";
  std::ofstream(old_token) << kToken << "\n";
  std::ofstream(new_token) << "the-new-cluster-token-2026\n";
  std::ofstream(tokens) << kToken << "\n";
  const std::string server = start_server({"--token-file", tokens.string()});
  auto ctl_exit = [&](const std::filesystem::path& token) {
    Process& ctl = spawn({TH_CTL_PATH, "--server", server, "--token-file", token.string()}, "ctl");
    return ctl.wait_exit(kStepMs);
  };
  auto sighup_and_wait = [&](std::size_t accepted) {
    servers_[0]->signal(SIGHUP);
    const std::string said = std::to_string(accepted) + " cluster token(s) accepted";
    EXPECT_NE(wait_for_text(servers_[0]->log_path(), said).find(said), std::string::npos) << servers_[0]->describe();
  };
  EXPECT_EQ(ctl_exit(old_token), 0);
  EXPECT_EQ(ctl_exit(new_token), 1);  // not yet
  std::ofstream(tokens, std::ios::trunc) << kToken << "\nthe-new-cluster-token-2026\n";
  sighup_and_wait(2);
  EXPECT_EQ(ctl_exit(old_token), 0);
  EXPECT_EQ(ctl_exit(new_token), 0);
  std::ofstream(tokens, std::ios::trunc) << "the-new-cluster-token-2026\n";
  sighup_and_wait(1);
  EXPECT_EQ(ctl_exit(old_token), 1);
  EXPECT_EQ(ctl_exit(new_token), 0);
  // An emptied file is a mistake, not "accept nothing": the tokens stay.
  std::ofstream(tokens, std::ios::trunc) << "\n";
  servers_[0]->signal(SIGHUP);
  EXPECT_NE(wait_for_text(servers_[0]->log_path(), "the tokens stay as they were").find("stay as they were"),
            std::string::npos)
      << servers_[0]->describe();
  EXPECT_EQ(ctl_exit(new_token), 0);
}

}  // namespace
}  // namespace th::e2e
