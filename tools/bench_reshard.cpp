// th-bench reshard: see bench_reshard.h. Each scenario runs two models side by side on one embedded
// th-server: in the first a trainer of layout S publishes and a rollout of layout R reads across
// layouts; in the second (the reference) a trainer of layout R publishes the same bytes and the
// same rollout layout reads them with no resharding. Rounds alternate between the two, so the
// ratio holds on a noisy machine.
#include "tools/bench_reshard.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <functional>
#include <iomanip>
#include <iostream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "server/embedded_server.h"
#include "tensorhub/client.h"
#include "tools/big_buffer.h"

namespace th::bench {
namespace {

const char* const kToken = "th-bench-reshard-token";
constexpr std::uint64_t kElementBytes = 2;  // bfloat16

// Along which dimension tensor parallelism splits the weights of the model: the outer one (rows:
// Megatron's column-parallel layers, whose pieces are contiguous) or the inner one (columns: its
// row-parallel layers, whose pieces are strided in the full tensor).
enum class Split { kOuter, kInner };
const char* split_name(Split split) { return split == Split::kOuter ? "outer" : "inner"; }

struct TensorDef {
  std::string name;
  Shape shape;  // 2-D weights, 1-D norms
  bool weight = true;
};

std::vector<TensorDef> model_tensors(const ReshardBenchOptions& options) {
  const std::uint64_t h = options.hidden;
  std::vector<TensorDef> tensors;
  for (std::uint32_t layer = 0; layer < options.layers; ++layer) {
    const std::string prefix = "layers." + std::to_string(layer) + ".";
    tensors.push_back({prefix + "qkv.weight", {3 * h, h}});
    tensors.push_back({prefix + "o.weight", {h, h}});
    tensors.push_back({prefix + "up.weight", {4 * h, h}});
    tensors.push_back({prefix + "down.weight", {h, 4 * h}});
    tensors.push_back({prefix + "norm.weight", {h}, /*weight=*/false});
  }
  return tensors;
}

std::uint64_t elements(const Shape& shape) {
  std::uint64_t count = 1;
  for (const std::uint64_t extent : shape) count *= extent;
  return count;
}

// A layout: TP=n (weights split along the model's dimension, norms whole on every shard) or
// FSDP x n (every tensor split along dimension 0, as FSDP's flat parameter shards are).
struct LayoutDef {
  std::uint32_t shards = 1;
  bool fsdp = false;
  std::string name() const { return (fsdp ? "FSDP x" : "TP=") + std::to_string(shards); }
};

Box box_of(const TensorDef& tensor, const LayoutDef& layout, Split split, std::uint32_t shard) {
  Box box{Shape(tensor.shape.size(), 0), tensor.shape};
  std::size_t dim = 0;
  if (layout.fsdp) {
    dim = 0;
  } else if (!tensor.weight) {
    return box;  // replicated under tensor parallelism
  } else {
    dim = split == Split::kOuter ? 0 : 1;
  }
  const std::uint64_t part = tensor.shape[dim] / layout.shards;
  box.offset[dim] = part * shard;
  box.extent[dim] = part;
  return box;
}

// The value of element `index` (row-major in the full tensor) of tensor `t` at `version`: every
// element differs from version to version and from tensor to tensor.
std::uint16_t value_at(std::size_t t, std::uint64_t index, Version version) {
  std::uint64_t x = (t + 1) * 0x9E3779B97F4A7C15ull ^ index * 0xBF58476D1CE4E5B9ull ^ version * 0x94D049BB133111EBull;
  x ^= x >> 31;
  x *= 0xD6E8FEB86CA6F5C3ull;
  x ^= x >> 29;
  return static_cast<std::uint16_t>(x);
}

// Calls `visit(global_index, local_index)` for every element of `box` in row-major order.
template <typename Visit>
void for_each_element(const TensorDef& tensor, const Box& box, Visit&& visit) {
  if (tensor.shape.size() == 1) {
    for (std::uint64_t i = 0; i < box.extent[0]; ++i) visit(box.offset[0] + i, i);
    return;
  }
  const std::uint64_t cols = tensor.shape[1];
  std::uint64_t local = 0;
  for (std::uint64_t r = 0; r < box.extent[0]; ++r) {
    const std::uint64_t row_start = (box.offset[0] + r) * cols + box.offset[1];
    for (std::uint64_t c = 0; c < box.extent[1]; ++c) visit(row_start + c, local++);
  }
}

struct Placed {
  std::size_t tensor;
  Box box;
  std::uint16_t* data;
};

// One replica: a handle per shard and the memory behind its pieces.
struct Replica {
  LayoutDef layout;
  std::vector<std::unique_ptr<BigBuffer>> memory;
  std::vector<std::unique_ptr<Handle>> handles;
  std::vector<std::vector<Placed>> pieces;  // per shard
};

[[noreturn]] void die(const std::string& what, const Error& error) {
  std::cerr << "th-bench reshard: " << what << ": " << error.detail << "\n";
  std::exit(1);
}

Replica open_replica(const std::string& server, const std::string& model, const std::string& name,
                     const std::string& role, const LayoutDef& layout, Split split,
                     const std::vector<TensorDef>& tensors) {
  Replica replica;
  replica.layout = layout;
  for (std::uint32_t shard = 0; shard < layout.shards; ++shard) {
    std::uint64_t bytes = 0;
    for (const TensorDef& tensor : tensors) bytes += elements(box_of(tensor, layout, split, shard).extent) * kElementBytes;
    // Touched now: a worker's tensors are memory in use, not fresh pages that fault in mid-read.
    auto memory = std::make_unique<BigBuffer>(bytes);
    std::memset(memory->get(), 0, bytes);
    ClientOptions options;
    options.servers = {server};
    options.token = kToken;
    options.model = model;
    options.replica = name;
    options.role = role;
    options.shard = shard;
    options.num_shards = layout.shards;
    options.transport = "tcp";
    options.log_level = LogLevel::kWarning;
    auto opened = Handle::open(options);
    if (!opened.ok()) die("open " + name, opened.error());
    std::unique_ptr<Handle> handle = std::move(opened).value();
    std::vector<Placed> placed;
    std::uint64_t at = 0;
    for (std::size_t t = 0; t < tensors.size(); ++t) {
      Box box = box_of(tensors[t], layout, split, shard);
      auto* data = reinterpret_cast<std::uint16_t*>(memory->get() + at);
      at += elements(box.extent) * kElementBytes;
      const Status registered = handle->register_piece(tensors[t].name, data, DType::kBFloat16, tensors[t].shape, box);
      if (!registered.ok()) die("register " + tensors[t].name, registered.error());
      placed.push_back({t, std::move(box), data});
    }
    replica.memory.push_back(std::move(memory));
    replica.handles.push_back(std::move(handle));
    replica.pieces.push_back(std::move(placed));
  }
  return replica;
}

// Runs `call(shard)` on every shard at once (a replica's calls return when all its shards made
// them) and fails the run on the first error (`call` returns what went wrong, or "").
void on_every_shard(Replica& replica, const std::string& what, const std::function<std::string(std::uint32_t)>& call) {
  std::vector<std::string> errors(replica.handles.size());
  std::vector<std::thread> threads;
  for (std::uint32_t shard = 0; shard < replica.handles.size(); ++shard) {
    threads.emplace_back([&, shard] { errors[shard] = call(shard); });
  }
  for (std::thread& thread : threads) thread.join();
  for (const std::string& error : errors) {
    if (!error.empty()) {
      std::cerr << "th-bench reshard: " << what << ": " << error << "\n";
      std::exit(1);
    }
  }
}

template <typename T>
std::string error_of(const Result<T>& result) {
  return result.ok() ? std::string() : result.error().detail;
}

void fill(Replica& trainer, const std::vector<TensorDef>& tensors, Version version) {
  for (const auto& shard : trainer.pieces) {
    for (const Placed& piece : shard) {
      for_each_element(tensors[piece.tensor], piece.box, [&](std::uint64_t global, std::uint64_t local) {
        piece.data[local] = value_at(piece.tensor, global, version);
      });
    }
  }
}

// Names the first element of the rollout that differs from the version's, or returns "".
std::string first_wrong(const Replica& rollout, const std::vector<TensorDef>& tensors, Version version) {
  for (std::size_t shard = 0; shard < rollout.pieces.size(); ++shard) {
    for (const Placed& piece : rollout.pieces[shard]) {
      std::string wrong;
      for_each_element(tensors[piece.tensor], piece.box, [&](std::uint64_t global, std::uint64_t local) {
        if (wrong.empty() && piece.data[local] != value_at(piece.tensor, global, version)) {
          wrong = tensors[piece.tensor].name + " element " + std::to_string(global) + " on shard " + std::to_string(shard);
        }
      });
      if (!wrong.empty()) return wrong;
    }
  }
  return "";
}

struct Pair {
  Replica trainer;
  Replica rollout;
};

struct RoundFigures {
  double gbps = 0;
  double read_s = 0;             // the slowest shard's read itself (the rest of the call: the hub)
  std::uint64_t bytes_read = 0;  // by all the rollout's shards, from their sources
};

// Publishes `version` from the trainer, brings it into the rollout (all shards at once) and
// checks every element.
RoundFigures run_round(Pair& pair, const std::vector<TensorDef>& tensors, std::uint64_t model_bytes, Version version) {
  fill(pair.trainer, tensors, version);
  on_every_shard(pair.trainer, "publish",
                 [&](std::uint32_t shard) { return error_of(pair.trainer.handles[shard]->publish(version)); });
  const auto started = std::chrono::steady_clock::now();
  on_every_shard(pair.rollout, "replicate/update", [&](std::uint32_t shard) -> std::string {
    Handle& handle = *pair.rollout.handles[shard];
    if (version == 1) return error_of(handle.replicate("latest"));
    auto updated = handle.update("latest");
    if (!updated.ok()) return updated.error().detail;
    if (updated.value().version != version) return "update brought another version than " + std::to_string(version);
    return "";
  });
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  if (const std::string wrong = first_wrong(pair.rollout, tensors, version); !wrong.empty()) {
    std::cerr << "th-bench reshard: version " << version << " differs at " << wrong << "\n";
    std::exit(1);
  }
  RoundFigures figures;
  figures.gbps = double(model_bytes) / seconds / 1e9;
  for (const auto& handle : pair.rollout.handles) {
    const HandleStats stats = handle->stats();
    figures.bytes_read += stats.last_read_bytes;
    figures.read_s = std::max(figures.read_s, stats.last_read_seconds);
  }
  on_every_shard(pair.trainer, "unpublish",
                 [&](std::uint32_t shard) { return error_of(pair.trainer.handles[shard]->unpublish()); });
  return figures;
}

double median(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  return values[values.size() / 2];
}

struct Scenario {
  Split split;
  LayoutDef trainer;
  LayoutDef rollout;
};

}  // namespace

int run_reshard(const ReshardBenchOptions& options) {
  const std::vector<TensorDef> tensors = model_tensors(options);
  std::uint64_t model_bytes = 0;
  for (const TensorDef& tensor : tensors) model_bytes += elements(tensor.shape) * kElementBytes;
  if (options.hidden % 8 != 0 || options.layers == 0 || options.rounds < 1) {
    std::cerr << "th-bench reshard: --hidden must be a multiple of 8, --layers and --rounds at least 1\n";
    return 2;
  }
  const std::vector<Scenario> scenarios = {
      {Split::kOuter, {8, false}, {4, false}}, {Split::kOuter, {8, false}, {2, false}},
      {Split::kOuter, {8, false}, {1, false}}, {Split::kInner, {8, false}, {4, false}},
      {Split::kInner, {8, false}, {2, false}}, {Split::kInner, {8, false}, {1, false}},
      {Split::kOuter, {8, true}, {2, false}},  {Split::kInner, {8, true}, {2, false}},
  };

  server::ServiceConfig config;
  config.token = kToken;
  // (Its warnings go to stdout and would land in the results: a handle closed between scenarios may
  // leave a heartbeat datagram in flight, which the server refuses and says so.)
  server::EmbeddedServer server(config, server::LogLevel::kError);
  std::cout << "th-bench reshard: " << tensors.size() << " bf16 tensors, " << model_bytes
            << " bytes per version (hidden " << options.hidden << ", " << options.layers
            << " layers), checksums on, CPU memory, loopback TCP, " << options.rounds << " rounds\n";

  int index = 0;
  for (const Scenario& scenario : scenarios) {
    ++index;
    const std::string label = scenario.trainer.name() + " -> " + scenario.rollout.name() + " (" +
                              split_name(scenario.split) + ")";
    const std::string model = "reshard-" + std::to_string(index);
    Pair across{open_replica(server.address(), model, "trainer", "trainer", scenario.trainer, scenario.split, tensors),
                open_replica(server.address(), model, "rollout", "rollout", scenario.rollout, scenario.split, tensors)};
    Pair same{open_replica(server.address(), model + "-same", "trainer", "trainer", scenario.rollout, scenario.split, tensors),
              open_replica(server.address(), model + "-same", "rollout", "rollout", scenario.rollout, scenario.split, tensors)};
    std::vector<double> across_gbps;
    std::vector<double> same_gbps;
    double read_ratio = 0;
    for (int round = 1; round <= options.rounds; ++round) {
      const auto version = static_cast<Version>(round);
      const RoundFigures a = run_round(across, tensors, model_bytes, version);
      const RoundFigures s = run_round(same, tensors, model_bytes, version);
      across_gbps.push_back(a.gbps);
      same_gbps.push_back(s.gbps);
      read_ratio = double(a.bytes_read) / double(s.bytes_read);
      std::cout << std::fixed << std::setprecision(3) << label << " round " << round << ": across layouts "
                << a.gbps << " GB/s (" << a.bytes_read << " bytes read; the slowest shard's read " << a.read_s
                << " s), same layout " << s.gbps << " GB/s (" << s.bytes_read << " bytes; " << s.read_s
                << " s), bit-exact\n";
    }
    const double ratio = median(across_gbps) / median(same_gbps);
    std::cout << std::fixed << std::setprecision(3) << label << ": median " << median(across_gbps)
              << " GB/s across layouts, " << median(same_gbps) << " GB/s same layout: " << ratio
              << " x; it reads " << read_ratio << " x the bytes\n";
    std::cout << std::fixed << std::setprecision(4) << "RESULT scenario=" << index << " trainer=" << scenario.trainer.shards
              << (scenario.trainer.fsdp ? "fsdp" : "tp") << " rollout=" << scenario.rollout.shards
              << " split=" << split_name(scenario.split) << " across_gbps=" << median(across_gbps)
              << " same_gbps=" << median(same_gbps) << " ratio=" << ratio << " read_ratio=" << read_ratio << std::endl;
  }
  return 0;
}

}  // namespace th::bench
