#include "tools/bench_delta.h"

#include <chrono>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <thread>
#include <vector>

#include "client/convert.h"
#include "tensorhub/client.h"

namespace th::bench {
namespace {

struct Parameter {
  std::string name;
  std::uint64_t elements = 0;
};

void wait_for_file(const std::filesystem::path& path) {
  while (!std::filesystem::exists(path)) std::this_thread::sleep_for(std::chrono::milliseconds(2));
}

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// params.tsv: "name<TAB>elements" per line, in the order of the step files.
std::vector<Parameter> read_parameters(const std::filesystem::path& dir) {
  std::vector<Parameter> parameters;
  std::ifstream in(dir / "params.tsv");
  for (Parameter parameter; std::getline(in, parameter.name, '\t') && in >> parameter.elements;) {
    in.ignore(1);  // the newline
    parameters.push_back(parameter);
  }
  return parameters;
}

// Step `step`'s float32 master weights, every parameter flattened, in params.tsv's order; empty if
// the file is missing or of another size.
std::vector<float> read_step(const std::filesystem::path& dir, std::uint32_t step, std::uint64_t elements) {
  std::ifstream in(dir / ("step-" + std::to_string(step) + ".f32"), std::ios::binary);
  std::vector<float> weights(elements);
  in.read(reinterpret_cast<char*>(weights.data()), static_cast<std::streamsize>(elements * sizeof(float)));
  if (!in || in.peek() != std::char_traits<char>::eof()) weights.clear();
  return weights;
}

}  // namespace

int run_delta_node(const DeltaNodeOptions& options) {
  const bool trainer = options.role == "trainer";
  if (!trainer && options.role != "rollout") {
    std::cerr << "th-bench delta-node: --role is trainer or rollout\n";
    return 2;
  }
  if (options.mode != "patch" && options.mode != "dense") {
    std::cerr << "th-bench delta-node: --mode is patch or dense\n";
    return 2;
  }
  const std::filesystem::path dir = options.steps_dir;
  const std::filesystem::path control = options.control_dir;
  const std::vector<Parameter> parameters = read_parameters(dir);
  if (parameters.empty()) {
    std::cerr << "th-bench delta-node: no parameters in " << (dir / "params.tsv") << " (bench/delta_train.py writes it)\n";
    return 2;
  }
  std::uint64_t elements = 0;
  for (const Parameter& parameter : parameters) elements += parameter.elements;
  // The steps, read once at the start: the timed part is the transfer, not the disk.
  std::vector<std::vector<float>> steps;
  for (std::uint32_t step = 0; step < options.versions; ++step) {
    steps.push_back(read_step(dir, step, elements));
    if (steps.back().empty()) {
      std::cerr << "th-bench delta-node: " << (dir / ("step-" + std::to_string(step) + ".f32")) << " is missing or not "
                << elements << " float32 values\n";
      return 2;
    }
  }

  ClientOptions client;
  client.servers = {options.server};
  client.token = options.token;
  client.model = "bench-delta";
  client.replica = options.replica;
  client.role = options.role;
  if (!options.data_ip.empty()) client.data_listen = options.data_ip + ":0";
  auto opened = Handle::open(client);
  if (!opened.ok()) {
    std::cerr << "th-bench delta-node: open: " << opened.error().detail << "\n";
    return 1;
  }
  std::unique_ptr<Handle> handle = std::move(opened).value();
  std::vector<std::uint16_t> published(elements);  // every parameter's bfloat16, one after another
  std::uint64_t offset = 0;
  for (const Parameter& parameter : parameters) {
    if (auto registered = handle->register_tensor(parameter.name, published.data() + offset, parameter.elements * 2,
                                                  DType::kBFloat16);
        !registered.ok()) {
      std::cerr << "th-bench delta-node: register: " << registered.error().detail << "\n";
      return 1;
    }
    offset += parameter.elements;
  }
  // Step `step` as bfloat16, as the trainer publishes it.
  auto expected = [&](std::uint32_t step) {
    std::vector<std::uint16_t> bf16(elements);
    client_impl::convert_elements(DType::kFloat32, reinterpret_cast<const std::byte*>(steps[step].data()),
                                  DType::kBFloat16, reinterpret_cast<std::byte*>(bf16.data()), elements);
    return bf16;
  };

  if (trainer) {
    auto write = [&](std::uint32_t step) -> bool {
      if (options.mode == "dense") {
        client_impl::convert_elements(DType::kFloat32, reinterpret_cast<const std::byte*>(steps[step].data()),
                                      DType::kBFloat16, reinterpret_cast<std::byte*>(published.data()), elements);
        return true;
      }
      std::uint64_t at = 0;
      for (const Parameter& parameter : parameters) {
        if (auto written = handle->write_tensor(parameter.name, steps[step].data() + at, DType::kFloat32); !written.ok()) {
          std::cerr << "th-bench delta-node: write_tensor: " << written.error().detail << "\n";
          return false;
        }
        at += parameter.elements;
      }
      return true;
    };
    if (!write(0)) return 1;
    if (auto first = handle->publish(1); !first.ok()) {
      std::cerr << "th-bench delta-node: publish 1: " << first.error().detail << "\n";
      return 1;
    }
    std::cout << "node ready data_endpoint=" << handle->data_endpoint() << std::endl;
    for (std::uint32_t version = 2; version <= options.versions; ++version) {
      wait_for_file(control / ("publish-" + std::to_string(version)));
      if (auto unpublished = handle->unpublish(); !unpublished.ok()) {
        std::cerr << "th-bench delta-node: unpublish: " << unpublished.error().detail << "\n";
        return 1;
      }
      const std::uint64_t patch_bytes_before = handle->stats().patch_bytes_published;
      const auto started = std::chrono::steady_clock::now();
      if (!write(version - 1)) return 1;
      const double write_s = seconds_since(started);
      if (auto next = handle->publish(version); !next.ok()) {
        std::cerr << "th-bench delta-node: publish " << version << ": " << next.error().detail << "\n";
        return 1;
      }
      std::cout << std::fixed << std::setprecision(4) << "published " << version << " write_seconds=" << write_s
                << " patch_bytes=" << handle->stats().patch_bytes_published - patch_bytes_before << std::endl;
    }
  } else {
    auto first = handle->replicate("latest");
    if (!first.ok() || first.value().version != 1 || published != expected(0)) {
      std::cerr << "th-bench delta-node: replicate version 1: "
                << (first.ok() ? "got version " + std::to_string(first.value().version) + (published != expected(0) ? ", not exact" : "")
                               : first.error().detail)
                << "\n";
      return 1;
    }
    std::cout << "node ready" << std::endl;
    for (std::uint32_t version = 2; version <= options.versions; ++version) {
      wait_for_file(control / ("read-" + std::to_string(version)));
      const HandleStats before = handle->stats();
      const auto started = std::chrono::steady_clock::now();
      auto updated = handle->update("latest");
      const double seconds = seconds_since(started);
      if (!updated.ok() || updated.value().version.value_or(0) != version) {
        std::cerr << "th-bench delta-node: update to version " << version << ": "
                  << (updated.ok() ? "got version " + std::to_string(updated.value().version.value_or(0))
                                   : updated.error().detail)
                  << "\n";
        return 1;
      }
      const HandleStats after = handle->stats();
      std::cout << std::fixed << std::setprecision(4) << "RESULT version=" << version << " seconds=" << seconds
                << " bytes=" << after.bytes_received - before.bytes_received
                << " patch=" << after.patch_reads - before.patch_reads
                << " source=" << updated.value().source_replica
                << " exact=" << (published == expected(version - 1) ? 1 : 0) << std::endl;
    }
  }
  wait_for_file(control / "stop");
  return 0;
}

}  // namespace th::bench
