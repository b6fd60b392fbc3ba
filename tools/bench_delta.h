// th-bench's delta node (issue 35): one emulated host of bench/run-delta, started inside that
// host's network namespace. The weights are those of a real training run (bench/delta_train.py:
// DIR/params.tsv and DIR/step-K.f32, float32 master weights after step K), published as bfloat16.
//   trainer: publishes step 0 as version 1; then, for K = 2, 3, ..., once DIR/../control/publish-K
//            exists, writes step K-1 and publishes it as version K: through write_tensor (mode
//            "patch": readers that hold K-1 pull what changed) or converted in place (mode "dense":
//            every reader pulls the bytes). Prints "published K write_seconds=W patch_bytes=P".
//   rollout: replicates version 1; then, for each K, once control/read-K exists, calls
//            update("latest") once and prints "RESULT version=K seconds=S bytes=B patch=0|1
//            source=R exact=0|1": S the call's time, B the bytes it received, exact whether every
//            tensor now holds step K-1 converted to bfloat16, bit for bit.
#pragma once

#include <cstdint>
#include <string>

namespace th::bench {

struct DeltaNodeOptions {
  std::string role;     // "trainer" or "rollout"
  std::string server;   // th-server, host:port
  std::string token;
  std::string replica;
  std::string data_ip;  // this host's address: the data server listens there
  std::string steps_dir;    // bench/delta_train.py's output
  std::string control_dir;  // publish-K, read-K and stop: made by the script
  std::string mode = "patch";  // trainer: "patch" or "dense"
  std::uint32_t versions = 2;  // versions 1..versions (steps 0..versions-1)
};

int run_delta_node(const DeltaNodeOptions& options);

}  // namespace th::bench
