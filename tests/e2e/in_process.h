// What the in-process e2e tests (libthclient against a real th-server) share: a shard's options
// on loopback with the suite's token, and an open that fails the test rather than return null
// silently.
#pragma once

#include <gtest/gtest.h>

#include <memory>
#include <string>

#include "fixture.h"
#include "tensorhub/client.h"

namespace th::e2e {

inline ClientOptions options_for(const std::string& server, const std::string& replica, const std::string& role) {
  ClientOptions options;
  options.servers = {server};
  options.token = kToken;
  options.model = "m";
  options.replica = replica;
  options.role = role;
  options.open_timeout_ms = kStepMs;
  options.data_listen = "127.0.0.1:0";
  return options;
}

inline std::unique_ptr<Handle> open_or_fail(const ClientOptions& options) {
  auto handle = Handle::open(options);
  EXPECT_TRUE(handle.ok()) << handle.error().detail;
  return handle.ok() ? std::move(handle).value() : nullptr;
}

}  // namespace th::e2e
