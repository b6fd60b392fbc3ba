// th-bench's control-plane benchmark (issue 5, benchmark 1): many clients over real connections in
// a closed loop of publish -> update(latest) -> unpublish against a th-server, and the reference
// it is judged against: the same connections doing request/response round trips with an echo
// server (the loopback ceiling of this RPC stack).
#pragma once

#include <cstdint>
#include <string>

#include "core/types.h"

namespace th::bench {

struct ControlLoadOptions {
  std::string server;           // host:port of th-server (or of th-bench echo-server)
  std::string token;
  std::uint32_t clients = 1024;  // connections, one shard agent each
  std::uint32_t shards = 8;      // shards per replica (clients must be a multiple)
  std::uint32_t first_replica = 0;  // replica numbers of this process start here (several processes)
  double seconds = 10;           // measurement window, after every client opened and the start file exists
  std::string start_file;        // measure once this file exists ("" : at once)
  bool echo = false;             // round trips of one message against an echo server, no agents
  bool rpc = false;              // Cap'n Proto RPC per message (Hub.connect, Session.send), the former design
  // The step-boundary burst instead of the closed loop: replica 0 (in the process with
  // --first-replica 0) publishes version 1 and prints "control published"; at the instant the
  // start file names (CLOCK_MONOTONIC microseconds) every other shard calls update(latest), once.
  bool burst = false;
  TimeMs retry_initial_ms = 10000;  // the agents' first retransmission (libthclient's)
  std::string tls_ca_file;       // TLS to a th-server run with --tls-cert ("": clear text)
  std::string tls_server_name;   // the name its certificate carries (default: the host of server)
};

// Prints "control ready N" once every client opened (echo: connected), then measures and prints
// "RESULT control_ops=... control_seconds=... control_p50_us=... control_p99_us=... control_errors=...";
// a burst prints "RESULT burst_calls=... burst_last_us=... burst_p50_us=... burst_p99_us=... burst_errors=...".
int run_control_load(const ControlLoadOptions& options);

// A server that answers at once and does nothing else, over the same two stacks as th-server: a
// framed connection's every frame with an ack, an RPC connection's every Session.send. Prints
// "echo listening on HOST:PORT"; runs until killed.
int run_echo_server(const std::string& listen);

}  // namespace th::bench
