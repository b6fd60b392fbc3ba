// What the GPU tests share: an embedded th-server on loopback, handles opened against it, and the
// shard they move (small tensors that travel packed, big ones with regions of their own, sizes
// that end mid-word, an empty one).
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "server/embedded_server.h"
#include "tensorhub/client.h"

namespace th::gpu_test {

struct TensorShape {
  std::string name;
  std::uint64_t bytes;
};

inline std::vector<TensorShape> shard_shapes() {
  return {{"a.small", 1000}, {"b.small", 17}, {"c.zero", 0}, {"d.big", (3ull << 20) + 5}, {"e.big", 40ull << 20}};
}

// The bytes of version `version` of a tensor: they differ between tensors, versions and places.
inline std::vector<std::byte> tensor_bytes(const TensorShape& shape, std::uint64_t version) {
  std::vector<std::byte> out(shape.bytes);
  const auto salt = static_cast<std::uint64_t>(std::hash<std::string>{}(shape.name)) + version * 7919;
  for (std::uint64_t i = 0; i < shape.bytes; ++i) {
    out[i] = static_cast<std::byte>(((i * 2654435761u) >> 7) + salt + (i >> 13));
  }
  return out;
}

class ServerFixture : public ::testing::Test {
 protected:
  void SetUp() override {
    server::ServiceConfig config;
    config.token = "gpu-test";
    server_ = std::make_unique<server::EmbeddedServer>(config, server::LogLevel::kWarn);
  }

  ClientOptions options_for(const std::string& replica, const std::string& role) const {
    ClientOptions options;
    options.servers = {server_->address()};
    options.token = "gpu-test";
    options.model = "gpu-test";
    options.replica = replica;
    options.role = role;
    options.data_listen = "127.0.0.1:0";
    options.transport = "tcp";
    return options;
  }

  std::unique_ptr<Handle> open(const ClientOptions& options) const {
    auto handle = Handle::open(options);
    if (!handle.ok()) {
      ADD_FAILURE() << "open " << options.replica << ": " << handle.error().detail;
      return nullptr;
    }
    return std::move(handle).value();
  }

  std::unique_ptr<server::EmbeddedServer> server_;
};

}  // namespace th::gpu_test
