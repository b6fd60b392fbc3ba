// patch_bench (issue 35): how big the patches of real training steps are, and what making them
// costs the trainer. Reads the float32 master weights bench/delta_train.py wrote after each step,
// publishes each step as bfloat16 (step 0 by plain conversion), and for every later step writes
// the new master weights into the published buffers tensor by tensor through PatchWriter (which
// records what changed), then times the same writes without recording. Prints one line per step
// and a summary; bench/run-delta-encoding keeps them in bench/results/.
#include <chrono>
#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include "client/convert.h"
#include "client/patch_writer.h"
#include "core/patch.h"

namespace {

using th::DType;
using Clock = std::chrono::steady_clock;

struct Param {
  std::string name;
  std::uint64_t elements = 0;
};

std::vector<Param> read_params(const std::string& dir) {
  std::ifstream in(dir + "/params.tsv");
  std::vector<Param> params;
  std::string name;
  std::uint64_t elements = 0;
  while (in >> name >> elements) params.push_back({name, elements});
  return params;
}

std::vector<float> read_step(const std::string& dir, int step, std::uint64_t elements) {
  std::ifstream in(dir + "/step-" + std::to_string(step) + ".f32", std::ios::binary);
  std::vector<float> values(elements);
  in.read(reinterpret_cast<char*>(values.data()), static_cast<std::streamsize>(elements * sizeof(float)));
  if (static_cast<std::uint64_t>(in.gcount()) != elements * sizeof(float)) return {};
  return values;
}

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2 || std::strcmp(argv[1], "--help") == 0) {
    std::fprintf(stderr, "usage: patch_bench DIR   (DIR: what bench/delta_train.py wrote)\n");
    return 2;
  }
  const std::string dir = argv[1];
  const std::vector<Param> params = read_params(dir);
  std::uint64_t total = 0;
  for (const Param& param : params) total += param.elements;
  if (params.empty() || total == 0) {
    std::fprintf(stderr, "patch_bench: no parameters in %s/params.tsv\n", dir.c_str());
    return 1;
  }
  std::vector<float> master = read_step(dir, 0, total);
  if (master.empty()) {
    std::fprintf(stderr, "patch_bench: %s/step-0.f32 is missing or short\n", dir.c_str());
    return 1;
  }
  std::vector<std::byte> published(total * 2);
  th::client_impl::convert_elements(DType::kFloat32, reinterpret_cast<const std::byte*>(master.data()),
                                    DType::kBFloat16, published.data(), total);
  std::printf("%" PRIu64 " parameters in %zu tensors; dense bf16 %.1f MiB per version\n", total, params.size(),
              static_cast<double>(total * 2) / (1 << 20));
  std::printf("step  changed  patch/dense  dense-tensors  write+record GB/s  write alone GB/s\n");
  double patch_fraction_sum = 0;
  int steps = 0;
  for (int step = 1;; ++step) {
    master = read_step(dir, step, total);
    if (master.empty()) break;
    // The published buffer after this step, written with and without recording (the second from
    // the same v-1, so both do the same conversion).
    std::vector<std::byte> plain = published;
    std::uint64_t changed = 0;
    std::uint64_t wire_bytes = 0;  // patches, and the dense bytes of tensors with none
    std::uint32_t dense_tensors = 0;
    const auto recording_start = Clock::now();
    std::uint64_t offset = 0;
    for (const Param& param : params) {
      std::span<std::byte> buffer(published.data() + offset * 2, param.elements * 2);
      th::client_impl::PatchWriter writer(DType::kBFloat16, buffer, /*base_checksum=*/0);
      writer.write(DType::kFloat32, reinterpret_cast<const std::byte*>(master.data() + offset), param.elements);
      changed += writer.elements_changed();
      auto patch = writer.finish();
      if (patch) {
        wire_bytes += patch->size();
      } else {
        wire_bytes += buffer.size();
        ++dense_tensors;
      }
      offset += param.elements;
    }
    const double recording_s = seconds_since(recording_start);
    const auto plain_start = Clock::now();
    th::client_impl::convert_elements(DType::kFloat32, reinterpret_cast<const std::byte*>(master.data()),
                                      DType::kBFloat16, plain.data(), total);
    const double plain_s = seconds_since(plain_start);
    if (plain != published) {
      std::fprintf(stderr, "patch_bench: step %d: the recording writer wrote other bytes than convert\n", step);
      return 1;
    }
    const double dense_gb = static_cast<double>(total * 2) / 1e9;
    const double fraction = static_cast<double>(wire_bytes) / static_cast<double>(total * 2);
    std::printf("%4d  %6.2f%%  %11.3f  %13u  %17.2f  %16.2f\n", step,
                100.0 * static_cast<double>(changed) / static_cast<double>(total), fraction, dense_tensors,
                dense_gb / recording_s, dense_gb / plain_s);
    patch_fraction_sum += fraction;
    ++steps;
  }
  if (steps == 0) {
    std::fprintf(stderr, "patch_bench: no step after step 0 in %s\n", dir.c_str());
    return 1;
  }
  std::printf("mean patch/dense over %d steps: %.3f\n", steps, patch_fraction_sum / steps);
  return 0;
}
