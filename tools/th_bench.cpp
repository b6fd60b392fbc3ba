// th-bench: TensorHub's benchmarks (issue 5). Each subcommand prints its figures and a final
// "RESULT key=value ..." line that the scripts under bench/ turn into bench/results/*.md next to
// the reference they measure in the same run (iperf3, an echo server, MPI_Bcast).
//
//   pair          one source, one reader over loopback: bytes per second of a whole version
//                 (checksums on, CPU memory), as the reader's replicate()/update() sees it; with
//                 --source-process the source is a child process (pair-source) and the CPU each side
//                 spent per GB moved is measured too (bench/run-rdma-pair: one-sided reads against TCP).
//   control-load  many clients in a closed loop of publish/update/unpublish against a th-server (or
//                 round trips against echo-server): operations/s and latency percentiles.
//   echo-server   the reference for control-load: answers every call at once.
//   fanout-node   one emulated host of bench/run-fanout (network namespaces, shaped links).
//   delta-node    one emulated host of bench/run-delta (a real training run's versions, patch or dense).
//   reshard       rollouts reading from trainers of another layout against the same-layout read of
//                 the same bytes (bench/run-reshard; tools/bench_reshard.h).
#include <CLI/CLI.hpp>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <iomanip>
#include <iostream>
#include <memory>
#include <optional>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "server/embedded_server.h"
#include "tools/bench_control.h"
#include "tools/big_buffer.h"
#include "tools/bench_delta.h"
#include "tools/bench_fanout.h"
#include "tools/bench_reshard.h"
#include "tensorhub/client.h"

namespace {

const char* const kToken = "th-bench-token";

[[noreturn]] void die(const std::string& what, const th::Error& error) {
  std::cerr << "th-bench: " << what << ": " << error.detail << "\n";
  std::exit(1);
}

template <typename T>
T value_or_die(th::Result<T> result, const std::string& what) {
  if (!result.ok()) die(what, result.error());
  return std::move(result).value();
}

void ok_or_die(const th::Status& status, const std::string& what) {
  if (!status.ok()) die(what, status.error());
}

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

double median(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  return values[values.size() / 2];
}

// One side of the pair: a handle and the memory behind its tensors.
struct Side {
  std::unique_ptr<th::bench::BigBuffer> memory;
  std::unique_ptr<th::Handle> handle;
};

Side open_side(const std::string& server, const std::string& replica, const std::string& role,
               std::uint64_t tensor_bytes, std::uint64_t tensors, std::uint32_t streams,
               const std::string& transport = "auto", const std::string& rdma_device = "") {
  th::ClientOptions options;
  options.transport = transport;
  options.rdma_device = rdma_device;
  options.servers = {server};
  options.token = kToken;
  options.model = "bench-pair";
  options.replica = replica;
  options.role = role;
  options.data_streams = streams;
  Side side;
  // Touched now: a trainer's or rollout's tensors are memory in use, not fresh pages that fault
  // in while the bytes arrive (measured: the first version then took 10x longer).
  side.memory = std::make_unique<th::bench::BigBuffer>(tensor_bytes * tensors);
  std::memset(side.memory->get(), 0, tensor_bytes * tensors);
  side.handle = value_or_die(th::Handle::open(options), "open " + replica);
  for (std::uint64_t i = 0; i < tensors; ++i) {
    char name[32];
    std::snprintf(name, sizeof name, "tensor.%05llu", static_cast<unsigned long long>(i));
    ok_or_die(side.handle->register_tensor(name, side.memory->get() + i * tensor_bytes, tensor_bytes,
                                           th::DType::kUInt8),
              "register");
  }
  return side;
}

// A version of `gib` GiB in tensors of `tensor_mb` MB, rounded up to whole tensors.
struct PairShape {
  std::uint64_t tensor_bytes;
  std::uint64_t tensors;
  std::uint64_t total_bytes;
};
PairShape pair_shape(double gib, std::uint64_t tensor_mb) {
  const std::uint64_t tensor_bytes = tensor_mb * 1'000'000;
  const auto total_wanted = static_cast<std::uint64_t>(gib * double(1ull << 30));
  const std::uint64_t tensors = std::max<std::uint64_t>(1, (total_wanted + tensor_bytes - 1) / tensor_bytes);
  return {tensor_bytes, tensors, tensors * tensor_bytes};
}

// register: how long registering `tensors` small tensors takes (a state dict's worth), the
// reference of the Python package's register_state_dict (bench/run-python-overhead).
int run_register(std::uint64_t tensors, std::uint64_t tensor_bytes, int rounds) {
  th::server::ServiceConfig config;
  config.token = kToken;
  th::server::EmbeddedServer server(config, th::server::LogLevel::kWarn);
  std::vector<double> seconds;
  for (int round = 0; round < rounds; ++round) {
    th::ClientOptions options;
    options.servers = {server.address()};
    options.token = kToken;
    options.model = "bench-register";
    options.replica = "r" + std::to_string(round);
    auto handle = value_or_die(th::Handle::open(options), "open");
    std::vector<float> memory(tensors * tensor_bytes / sizeof(float));
    const auto started = std::chrono::steady_clock::now();
    for (std::uint64_t i = 0; i < tensors; ++i) {
      ok_or_die(handle->register_tensor("layers." + std::to_string(i) + ".weight",
                                        reinterpret_cast<std::byte*>(memory.data()) + i * tensor_bytes, tensor_bytes,
                                        th::DType::kFloat32),
                "register");
    }
    seconds.push_back(seconds_since(started));
  }
  std::cout << std::fixed << std::setprecision(6) << "th-bench register: " << tensors << " tensors of " << tensor_bytes
            << " bytes, median of " << rounds << ": " << median(seconds) * 1e3 << " ms\n";
  std::cout << "RESULT register_tensors=" << tensors << " register_ms=" << median(seconds) * 1e3 << std::endl;
  return 0;
}

int run_pair(double gib, std::uint64_t tensor_mb, int rounds, std::uint32_t streams, const std::string& transport) {
  const auto [tensor_bytes, tensors, total_bytes] = pair_shape(gib, tensor_mb);

  th::server::ServiceConfig config;
  config.token = kToken;
  th::server::EmbeddedServer server(config, th::server::LogLevel::kWarn);
  Side source = open_side(server.address(), "source", "trainer", tensor_bytes, tensors, 1, transport);
  Side reader = open_side(server.address(), "reader", "rollout", tensor_bytes, tensors, streams, transport);
  std::cout << "th-bench pair: " << tensors << " tensors x " << tensor_mb << " MB = " << total_bytes
            << " bytes per version, " << streams << " stream(s), checksums on, CPU memory, loopback TCP\n";

  // Random bytes once (nothing on the way compresses, but no pattern should help either); each
  // round then changes the first word of every tensor, so each version differs everywhere it counts.
  std::mt19937_64 random(42);
  auto* words = reinterpret_cast<std::uint64_t*>(source.memory->get());
  for (std::uint64_t i = 0; i < total_bytes / 8; ++i) words[i] = random();

  std::vector<double> call_gbps;
  std::vector<double> read_gbps;
  for (int round = 1; round <= rounds; ++round) {
    const auto version = static_cast<th::Version>(round);
    for (std::uint64_t i = 0; i < tensors; ++i) {
      std::memcpy(source.memory->get() + i * tensor_bytes, &version, sizeof version);
    }
    value_or_die(source.handle->publish(version), "publish");
    const auto started = std::chrono::steady_clock::now();
    std::string from;
    if (round == 1) {
      from = value_or_die(reader.handle->replicate("latest"), "replicate").source_replica;
    } else {
      const auto updated = value_or_die(reader.handle->update("latest"), "update");
      if (updated.version != version) {
        std::cerr << "th-bench: update brought version "
                  << (updated.version ? std::to_string(*updated.version) : "nothing") << ", not "
                  << version << "\n";
        return 1;
      }
      from = updated.source_replica;
    }
    const double call_s = seconds_since(started);
    const th::HandleStats stats = reader.handle->stats();
    const bool exact = std::memcmp(source.memory->get(), reader.memory->get(), total_bytes) == 0;
    if (!exact || stats.checksum_failures != 0) {
      std::cerr << "th-bench: round " << round << ": the reader's bytes differ from the source's\n";
      return 1;
    }
    call_gbps.push_back(double(total_bytes) / call_s / 1e9);
    read_gbps.push_back(double(stats.last_read_bytes) / stats.last_read_seconds / 1e9);
    std::cout << std::fixed << std::setprecision(3) << "round " << round << ": " << total_bytes << " bytes from "
              << from << " in " << call_s << " s (" << call_gbps.back() << " GB/s; the read itself "
              << stats.last_read_seconds << " s, " << read_gbps.back() << " GB/s), bit-exact\n";
    ok_or_die(source.handle->unpublish(), "unpublish");
  }
  std::cout << std::fixed << std::setprecision(3) << "median of " << rounds << " rounds: " << median(call_gbps)
            << " GB/s per call, " << median(read_gbps) << " GB/s per read\n";
  std::cout << "RESULT pair_bytes=" << total_bytes << " pair_streams=" << streams
            << " pair_call_gbps=" << median(call_gbps) << " pair_read_gbps=" << median(read_gbps) << std::endl;
  return 0;
}


// CPU seconds this process has used, every thread included (those that ended too).
double process_cpu_seconds() {
  rusage usage{};
  ::getrusage(RUSAGE_SELF, &usage);
  return double(usage.ru_utime.tv_sec + usage.ru_stime.tv_sec) +
         double(usage.ru_utime.tv_usec + usage.ru_stime.tv_usec) / 1e6;
}

// The source's bytes: random once (seed 42), then each version stamps the first word of every
// tensor. The reader's process computes the same to check what arrived.
void fill_source(std::byte* memory, std::uint64_t total_bytes) {
  std::mt19937_64 random(42);
  auto* words = reinterpret_cast<std::uint64_t*>(memory);
  for (std::uint64_t i = 0; i < total_bytes / 8; ++i) words[i] = random();
}
void stamp(std::byte* memory, std::uint64_t tensor_bytes, std::uint64_t tensors, th::Version version) {
  for (std::uint64_t i = 0; i < tensors; ++i) std::memcpy(memory + i * tensor_bytes, &version, sizeof version);
}

// pair-source: the source of `pair --source-process`, driven line by line on stdin:
//   publish V -> "published V"; unpublish -> "unpublished"; cpu -> "cpu SECONDS"; exit.
int run_pair_source(const std::string& server, std::uint64_t tensor_bytes, std::uint64_t tensors,
                    const std::string& transport, const std::string& rdma_device) {
  Side source = open_side(server, "source", "trainer", tensor_bytes, tensors, 1, transport, rdma_device);
  fill_source(source.memory->get(), tensor_bytes * tensors);
  std::cout << "ready " << source.handle->stats().transport << std::endl;
  for (std::string command; std::cin >> command;) {
    if (command == "publish") {
      th::Version version = 0;
      std::cin >> version;
      stamp(source.memory->get(), tensor_bytes, tensors, version);
      value_or_die(source.handle->publish(version), "publish");
      std::cout << "published " << version << std::endl;
    } else if (command == "unpublish") {
      ok_or_die(source.handle->unpublish(), "unpublish");
      std::cout << "unpublished" << std::endl;
    } else if (command == "cpu") {
      std::cout << "cpu " << std::setprecision(9) << process_cpu_seconds() << std::endl;
    } else if (command == "exit") {
      break;
    }
  }
  return 0;
}

struct Child {
  pid_t pid = -1;
  FILE* to = nullptr;
  FILE* from = nullptr;
  std::string ask(const std::string& command, const std::string& expect) {
    std::fprintf(to, "%s\n", command.c_str());
    std::fflush(to);
    char line[256];
    if (std::fgets(line, sizeof line, from) == nullptr) {
      std::cerr << "th-bench: the source process ended\n";
      std::exit(1);
    }
    std::string answer(line);
    if (answer.rfind(expect, 0) != 0) {
      std::cerr << "th-bench: the source process said '" << answer << "' to '" << command << "'\n";
      std::exit(1);
    }
    return answer.substr(expect.size());
  }
};

Child spawn_source(const std::vector<std::string>& args) {
  int to_child[2];
  int from_child[2];
  if (::pipe(to_child) != 0 || ::pipe(from_child) != 0) throw std::runtime_error("pipe failed");
  Child child;
  child.pid = ::fork();
  if (child.pid == 0) {
    ::dup2(to_child[0], STDIN_FILENO);
    ::dup2(from_child[1], STDOUT_FILENO);
    ::close(to_child[1]);
    ::close(from_child[0]);
    std::vector<char*> argv;
    for (const auto& arg : args) argv.push_back(const_cast<char*>(arg.c_str()));
    argv.push_back(nullptr);
    ::execv("/proc/self/exe", argv.data());
    ::_exit(127);
  }
  ::close(to_child[0]);
  ::close(from_child[1]);
  child.to = ::fdopen(to_child[1], "w");
  child.from = ::fdopen(from_child[0], "r");
  return child;
}

// pair --source-process: as run_pair, with the source in a child process, and the CPU both
// processes spent while the reader's call ran (the reader's process also runs the embedded server).
int run_pair_split(double gib, std::uint64_t tensor_mb, int rounds, std::uint32_t streams, const std::string& transport,
                   const std::string& rdma_device) {
  const auto [tensor_bytes, tensors, total_bytes] = pair_shape(gib, tensor_mb);
  th::server::ServiceConfig config;
  config.token = kToken;
  th::server::EmbeddedServer server(config, th::server::LogLevel::kWarn);
  Child source = spawn_source({"th-bench", "pair-source", "--server", server.address(), "--tensor-mb",
                               std::to_string(tensor_mb), "--tensors", std::to_string(tensors), "--transport", transport,
                               "--rdma-device", rdma_device});
  char line[256];
  if (std::fgets(line, sizeof line, source.from) == nullptr) {
    std::cerr << "th-bench: the source process did not start\n";
    return 1;
  }
  const std::string source_transport = std::string(line).substr(6, std::string(line).find('\n') - 6);
  Side reader = open_side(server.address(), "reader", "rollout", tensor_bytes, tensors, streams, transport, rdma_device);
  auto expected = std::make_unique<th::bench::BigBuffer>(total_bytes);
  fill_source(expected->get(), total_bytes);
  std::cout << "th-bench pair: " << tensors << " tensors x " << tensor_mb << " MB = " << total_bytes
            << " bytes per version, source process (" << source_transport << "), reader ("
            << reader.handle->stats().transport << "), checksums on, CPU memory\n";
  std::vector<double> call_gbps;
  std::vector<double> pull_gbps;
  std::vector<double> source_cpu_per_gb;
  std::vector<double> reader_cpu_per_gb;
  std::uint64_t rdma_before = 0;
  for (int round = 1; round <= rounds; ++round) {
    const auto version = static_cast<th::Version>(round);
    source.ask("publish " + std::to_string(version), "published");
    stamp(expected->get(), tensor_bytes, tensors, version);
    const double source_cpu_before = std::stod(source.ask("cpu", "cpu "));
    const double reader_cpu_before = process_cpu_seconds();
    const auto started = std::chrono::steady_clock::now();
    std::optional<th::Version> got;
    if (round == 1) {
      got = value_or_die(reader.handle->replicate("latest"), "replicate").version;
    } else {
      got = value_or_die(reader.handle->update("latest"), "update").version;
    }
    const double call_s = seconds_since(started);
    const double reader_cpu = process_cpu_seconds() - reader_cpu_before;
    const double source_cpu = std::stod(source.ask("cpu", "cpu ")) - source_cpu_before;
    const th::HandleStats stats = reader.handle->stats();
    if (got != version || std::memcmp(expected->get(), reader.memory->get(), total_bytes) != 0 ||
        stats.checksum_failures != 0) {
      std::cerr << "th-bench: round " << round << ": the reader's bytes differ from the source's\n";
      return 1;
    }
    const double gb = double(total_bytes) / 1e9;
    call_gbps.push_back(gb / call_s);
    pull_gbps.push_back(gb / stats.last_pull_seconds);
    source_cpu_per_gb.push_back(source_cpu / gb);
    reader_cpu_per_gb.push_back(reader_cpu / gb);
    std::cout << std::fixed << std::setprecision(3) << "round " << round << ": " << total_bytes << " bytes in "
              << call_s << " s (" << call_gbps.back() << " GB/s; moving the bytes " << stats.last_pull_seconds
              << " s, " << pull_gbps.back() << " GB/s) over "
              << (stats.pulls_rdma > rdma_before ? "rdma" : "tcp") << "; CPU per GB: source "
              << source_cpu_per_gb.back() << " s, reader " << reader_cpu_per_gb.back() << " s; bit-exact\n";
    rdma_before = stats.pulls_rdma;
    source.ask("unpublish", "unpublished");
  }
  std::fprintf(source.to, "exit\n");
  std::fclose(source.to);
  std::fclose(source.from);
  ::waitpid(source.pid, nullptr, 0);
  std::cout << std::fixed << std::setprecision(4) << "RESULT pair_bytes=" << total_bytes << " pair_transport="
            << reader.handle->stats().transport << " pair_rdma_pulls=" << reader.handle->stats().pulls_rdma
            << " pair_call_gbps=" << median(call_gbps) << " pair_pull_gbps=" << median(pull_gbps)
            << " pair_source_cpu_s_per_gb=" << median(source_cpu_per_gb)
            << " pair_reader_cpu_s_per_gb=" << median(reader_cpu_per_gb) << std::endl;
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"th-bench: TensorHub's benchmarks. Each subcommand prints its figures and a final RESULT line;\n"
               "the scripts under bench/ run them next to their references and write bench/results/."};
  app.require_subcommand(1);

  auto* pair = app.add_subcommand("pair", "One source and one reader over loopback TCP: a whole version per round");
  double gib = 4.0;
  std::uint64_t tensor_mb = 50;
  int rounds = 3;
  std::uint32_t streams = 1;
  pair->add_option("--gib", gib, "Bytes per version, in GiB (rounded up to whole tensors)")
      ->capture_default_str()
      ->check(CLI::Range(0.001, 64.0));
  pair->add_option("--tensor-mb", tensor_mb, "Size of each tensor, in MB")->capture_default_str()->check(CLI::Range(1, 4096));
  pair->add_option("--rounds", rounds, "Versions to move; the median is reported")->capture_default_str()->check(CLI::Range(1, 1000));
  pair->add_option("--streams", streams, "TCP connections per read (ClientOptions::data_streams)")
      ->capture_default_str()
      ->check(CLI::Range(1, 16));
  std::string transport = "auto";
  bool source_process = false;
  pair->add_option("--transport", transport, "auto, rdma or tcp (ClientOptions::transport)")
      ->capture_default_str()
      ->check(CLI::IsMember({"auto", "rdma", "tcp"}));
  std::string rdma_device;
  pair->add_option("--rdma-device", rdma_device, "RDMA devices, comma-separated (ClientOptions::rdma_device; empty: auto)");
  pair->add_flag("--source-process", source_process,
                 "run the source in a child process and measure the CPU each side spends per GB");
  auto* pair_source = app.add_subcommand("pair-source", "(internal) the source process of pair --source-process");
  pair_source->group("");
  std::string source_server;
  std::uint64_t source_tensors = 1;
  pair_source->add_option("--server", source_server)->required();
  pair_source->add_option("--tensor-mb", tensor_mb)->required();
  pair_source->add_option("--tensors", source_tensors)->required();
  pair_source->add_option("--transport", transport)->required();
  pair_source->add_option("--rdma-device", rdma_device);

  auto* reg = app.add_subcommand("register", "Registering a state dict's worth of small tensors (the Python package's reference)");
  std::uint64_t register_tensors = 500;
  std::uint64_t register_bytes = 4000;
  reg->add_option("--tensors", register_tensors)->capture_default_str()->check(CLI::Range(1, 1000000));
  reg->add_option("--bytes", register_bytes, "bytes per tensor")->capture_default_str()->check(CLI::Range(4, 1 << 30));
  reg->add_option("--rounds", rounds)->capture_default_str();

  auto* control = app.add_subcommand(
      "control-load", "Clients in a closed loop of publish -> update(latest) -> unpublish (bench/run-control-plane)");
  th::bench::ControlLoadOptions load;
  control->add_option("--server", load.server, "th-server (or echo-server) address")->required();
  control->add_option("--token", load.token, "cluster token");
  control->add_option("--clients", load.clients, "connections, one shard each")->capture_default_str()->check(CLI::Range(1u, 65536u));
  control->add_option("--shards", load.shards, "shards per replica")->capture_default_str()->check(CLI::Range(1u, 8u));
  control->add_option("--first-replica", load.first_replica, "number of this process's first replica")->capture_default_str();
  control->add_option("--seconds", load.seconds, "measurement window")->capture_default_str()->check(CLI::Range(0.1, 3600.0));
  control->add_option("--start-file", load.start_file, "start measuring once this file exists");
  control->add_flag("--echo", load.echo, "round trips against echo-server instead of hub calls");
  control->add_flag("--rpc", load.rpc, "Cap'n Proto RPC per message (the design before framed connections)");
  control->add_flag("--burst", load.burst,
                    "the step-boundary burst: replica 0 publishes, then every other shard calls update once, at the "
                    "CLOCK_MONOTONIC microsecond the start file names");
  control->add_option("--tls-ca", load.tls_ca_file, "TLS to a th-server run with --tls-cert: trust this CA file");
  control->add_option("--tls-server-name", load.tls_server_name, "TLS: the name the server's certificate carries");
  control->add_option("--retry-initial-ms", load.retry_initial_ms, "the agents' first retransmission")
      ->capture_default_str()
      ->check(CLI::Range(10, 60000));

  auto* echo = app.add_subcommand("echo-server", "Answers every frame (or RPC Session.send) at once (control-load's reference)");
  std::string echo_listen = "127.0.0.1:0";
  echo->add_option("--listen", echo_listen, "HOST:PORT")->capture_default_str();

  auto* fanout = app.add_subcommand("fanout-node", "One emulated host of bench/run-fanout (trainer or rollout)");
  th::bench::FanoutNodeOptions node;
  fanout->add_option("--role", node.role, "trainer or rollout")->required();
  fanout->add_option("--server", node.server, "th-server address")->required();
  fanout->add_option("--token", node.token, "cluster token");
  fanout->add_option("--replica", node.replica, "replica name")->required();
  fanout->add_option("--datacenter", node.datacenter)->capture_default_str();
  fanout->add_option("--data-ip", node.data_ip,
                     "this host's address for the data plane (default: libthclient's, which listens on every "
                     "interface and advertises the one that reaches the server)");
  fanout->add_option("--mib", node.mib, "shard size, MiB")->capture_default_str()->check(CLI::Range(1, 65536));
  fanout->add_option("--tensors", node.tensors, "tensors the shard is cut into")
      ->capture_default_str()
      ->check(CLI::Range(1, 65536));
  fanout->add_flag("!--no-resume", node.resume_reads,
                   "after a source fails, read the next one from byte 0 (not from the verified tensors)");
  fanout->add_option("--start-file", node.start_file, "rollout: replicate once this file exists");
  fanout->add_option("--stop-file", node.stop_file, "exit once this file exists")->required();
  fanout->add_option("--second-version-file", node.second_version_file,
                     "cross-datacenter mode: the trainer publishes version 2 once this file exists; rollouts update to it");
  fanout->add_option("--next-version-file", node.next_version_file,
                     "rollout: after replicating version 1, update to version 2 once this file exists, timed "
                     "(the trainer runs with --second-version-file)");

  auto* delta = app.add_subcommand("delta-node", "One emulated host of bench/run-delta (trainer or rollout)");
  th::bench::DeltaNodeOptions delta_node;
  delta->add_option("--role", delta_node.role, "trainer or rollout")->required();
  delta->add_option("--server", delta_node.server, "th-server address")->required();
  delta->add_option("--token", delta_node.token, "cluster token");
  delta->add_option("--replica", delta_node.replica, "replica name")->required();
  delta->add_option("--data-ip", delta_node.data_ip, "this host's address for the data plane");
  delta->add_option("--steps-dir", delta_node.steps_dir, "bench/delta_train.py's output (params.tsv, step-K.f32)")
      ->required();
  delta->add_option("--control-dir", delta_node.control_dir, "where the script makes publish-K, read-K and stop")
      ->required();
  delta->add_option("--mode", delta_node.mode, "trainer: patch (write_tensor) or dense (the bytes)")->capture_default_str();
  delta->add_option("--versions", delta_node.versions, "versions 1..N: steps 0..N-1")
      ->capture_default_str()
      ->check(CLI::Range(2, 1000));

  auto* reshard = app.add_subcommand(
      "reshard", "Rollouts reading from a trainer of another layout (TP=8 -> TP=4/2/1, FSDP x8 -> TP=2) against "
                 "the same-layout read of the same bytes");
  th::bench::ReshardBenchOptions reshard_options;
  reshard->add_option("--hidden", reshard_options.hidden, "hidden size H (a multiple of 8)")
      ->capture_default_str()
      ->check(CLI::Range(8, 65536));
  reshard->add_option("--layers", reshard_options.layers, "layers of 12 H^2 bf16 weights and a norm")
      ->capture_default_str()
      ->check(CLI::Range(1, 1024));
  reshard->add_option("--rounds", reshard_options.rounds, "versions per scenario; medians are reported")
      ->capture_default_str()
      ->check(CLI::Range(1, 1000));

  CLI11_PARSE(app, argc, argv);
  if (reshard->parsed()) return th::bench::run_reshard(reshard_options);
  if (fanout->parsed()) return th::bench::run_fanout_node(node);
  if (delta->parsed()) return th::bench::run_delta_node(delta_node);
  if (reg->parsed()) return run_register(register_tensors, register_bytes, rounds);
  if (pair->parsed() && source_process) return run_pair_split(gib, tensor_mb, rounds, streams, transport, rdma_device);
  if (pair->parsed()) return run_pair(gib, tensor_mb, rounds, streams, transport);
  if (pair_source->parsed()) return run_pair_source(source_server, tensor_mb * 1'000'000, source_tensors, transport, rdma_device);
  if (control->parsed()) return th::bench::run_control_load(load);
  if (echo->parsed()) return th::bench::run_echo_server(echo_listen);
  return 2;
}
