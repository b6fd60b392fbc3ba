// th-sim: replay failure schedules of a TensorHub deployment by seed (see sim/simulation.h).
#include <CLI/CLI.hpp>

#include <chrono>
#include <cstdio>
#include <iostream>
#include <optional>
#include <string>

#include "sim/simulation.h"

namespace {

using th::sim::Knobs;

struct Cli {
  std::uint64_t seed = 1;
  std::string seeds;  // "A..B"
  std::string workload;
  double duration_s = 30;
  double liveness_s = 90;
  std::string profile = "drawn";
  std::string faults;
  std::string trace;
  bool check_determinism = false;
  bool verbose = false;
  bool keep_going = false;
};

std::optional<std::pair<std::uint64_t, std::uint64_t>> parse_range(const std::string& text) {
  const std::size_t dots = text.find("..");
  if (dots == std::string::npos) return std::nullopt;
  try {
    std::size_t used = 0;
    const std::uint64_t first = std::stoull(text.substr(0, dots), &used);
    if (used != dots) return std::nullopt;
    const std::string rest = text.substr(dots + 2);
    const std::uint64_t last = std::stoull(rest, &used);
    if (used != rest.size() || last < first) return std::nullopt;
    return std::pair{first, last};
  } catch (const std::exception&) {
    return std::nullopt;
  }
}

// The command that replays one seed exactly as it ran.
std::string replay_command(const Cli& cli, std::uint64_t seed) {
  std::string command = "th-sim";
  command += " --seed " + std::to_string(seed);
  if (!cli.workload.empty()) command += " --workload " + cli.workload;
  if (cli.duration_s != 30) command += " --duration " + std::to_string(cli.duration_s);
  if (cli.liveness_s != 90) command += " --liveness " + std::to_string(cli.liveness_s);
  if (cli.profile != "drawn") command += " --profile " + cli.profile;
  if (!cli.faults.empty()) command += " --faults " + cli.faults;
  return command + " -v";
}

// Everything a seed decides, drawn the same way for every run of it.
th::Result<th::sim::SimOptions> options_for(const Cli& cli, std::uint64_t seed) {
  th::sim::Rng knob_rng(seed);
  std::optional<th::sim::Workload> workload;
  if (!cli.workload.empty()) {
    auto parsed = th::sim::parse_workload(cli.workload);
    if (!parsed.ok()) return parsed.error();
    workload = parsed.value();
  }
  th::sim::SimOptions options;
  options.seed = seed;
  options.knobs = th::sim::draw_knobs(knob_rng, workload ? &*workload : nullptr);
  if (auto profiled = th::sim::apply_profile(options.knobs, cli.profile); !profiled.ok()) {
    return profiled.error();
  }
  if (auto applied = th::sim::apply_overrides(options.knobs, cli.faults); !applied.ok()) {
    return applied.error();
  }
  options.knobs.safety_ms = static_cast<th::TimeMs>(cli.duration_s * 1000);
  options.knobs.liveness_ms = static_cast<th::TimeMs>(cli.liveness_s * 1000);
  options.verbose = cli.verbose;
  options.trace_path = cli.trace;
  return options;
}

}  // namespace

int main(int argc, char** argv) {
  Cli cli;
  CLI::App app{
      "th-sim: a deterministic simulation of a TensorHub deployment, replayed by seed.\n\n"
      "The real reference server (primary and backup) and one real shard agent per simulated worker\n"
      "run in virtual time on one thread. Every random choice comes from the seed: the workload, the\n"
      "fault knobs (swarm testing: each fault is off entirely in some seeds), message delays, drops,\n"
      "duplicates, partitions, crashes, preemption storms, stragglers, clock skew and a server\n"
      "failover. A run has a safety phase (faults on; no invariant of DESIGN.md §5 may break) and a\n"
      "liveness phase (faults healed; every rollout must reach the final version, every call return).\n\n"
      "The first line printed is the seed and every knob; a violation prints the command that\n"
      "replays it. Exit status: 0 all seeds passed, 1 a violation, 2 bad usage.\n\n"
      "Workloads: " + th::sim::workload_list()};
  app.add_option("--seed", cli.seed, "run this seed (default 1)");
  app.add_option("--seeds", cli.seeds, "run a block of seeds, A..B inclusive");
  app.add_option("--workload", cli.workload,
                 "fix the workload instead of drawing it from the seed: " + th::sim::workload_list());
  app.add_option("--duration", cli.duration_s, "seconds of simulated time with faults on (30)")
      ->check(CLI::Range(1.0, 3600.0));
  app.add_option("--liveness", cli.liveness_s,
                 "seconds after healing within which everything must converge (90)")
      ->check(CLI::Range(1.0, 3600.0));
  app.add_option("--profile", cli.profile,
                 "a named fault profile over the drawn knobs: " + th::sim::profile_list() +
                     " (harsh-net: partition=1,clog=1,delay=100,stale=0.05; harsh-crash: drop=0.05,crash=0.5,"
                     "read-failure=0.1,server-crash=1; harsh-bytes: corrupt=0.1,tamper=0.5; harsh: all three)");
  app.add_option("--faults", cli.faults,
                 "override drawn fault knobs, key=value,...; keys: " + th::sim::fault_keys());
  app.add_option("--trace", cli.trace,
                 "write the run as Chrome Trace Event JSON to this file (open it in Perfetto)");
  app.add_flag("--check-determinism", cli.check_determinism,
               "run every seed twice and require the same trace hash");
  app.add_flag("--keep-going", cli.keep_going, "with --seeds: do not stop at the first violation");
  app.add_flag("-v,--verbose", cli.verbose, "print the knobs of every seed and notable events");
  CLI11_PARSE(app, argc, argv);

  std::uint64_t first = cli.seed;
  std::uint64_t last = cli.seed;
  if (!cli.seeds.empty()) {
    const auto range = parse_range(cli.seeds);
    if (!range) {
      std::fprintf(stderr, "th-sim: --seeds wants A..B with A <= B, got '%s'\n", cli.seeds.c_str());
      return 2;
    }
    std::tie(first, last) = *range;
  }
  if (!cli.trace.empty() && first != last) {
    std::fprintf(stderr, "th-sim: --trace writes one run; give one --seed\n");
    return 2;
  }

  const bool block = first != last;
  std::uint64_t violations = 0;
  std::uint64_t events = 0;
  std::uint64_t runs = 0;  // seeds run (a block stops at its first violation without --keep-going)
  const auto started = std::chrono::steady_clock::now();
  for (std::uint64_t seed = first;; ++seed) {
    auto options = options_for(cli, seed);
    if (!options.ok()) {
      std::fprintf(stderr, "th-sim: %s\n", options.error().detail.c_str());
      return 2;
    }
    if (!block || cli.verbose) {
      std::printf("seed=%llu %s\n", static_cast<unsigned long long>(seed),
                  th::sim::describe(options.value().knobs).c_str());
    }
    th::sim::SimResult result = th::sim::simulate(options.value());
    events += result.events;
    if (cli.check_determinism && result.ok) {
      th::sim::SimOptions again = options.value();
      again.trace_path.clear();
      again.verbose = false;
      const th::sim::SimResult second = th::sim::simulate(again);
      events += second.events;
      if (second.trace_hash != result.trace_hash || second.events != result.events) {
        result.ok = false;
        result.violation = "determinism: two runs of the seed differ (trace hash " +
                           std::to_string(result.trace_hash) + " vs " +
                           std::to_string(second.trace_hash) + ")";
      }
    }
    ++runs;
    if (!block || cli.verbose || !result.ok) std::printf("%s\n", result.summary().c_str());
    if (cli.check_determinism && result.ok && (!block || cli.verbose)) {
      std::printf("deterministic: a second run gave trace hash %llx too\n",
                  static_cast<unsigned long long>(result.trace_hash));
    }
    if (!result.ok) {
      ++violations;
      if (block && !cli.verbose) {
        std::printf("seed=%llu %s\n", static_cast<unsigned long long>(seed),
                    th::sim::describe(options.value().knobs).c_str());
      }
      std::printf("violation %s\nreplay: %s\n", result.violation.c_str(),
                  replay_command(cli, seed).c_str());
      if (!cli.keep_going) break;
    }
    if (seed == last) break;
  }
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  if (block) {
    std::printf("seeds %llu..%llu: %llu seeds run%s, %llu violations; %llu events in %.1f s (%.0f events/s, "
                "%.0f seeds/min)\n",
                static_cast<unsigned long long>(first), static_cast<unsigned long long>(last),
                static_cast<unsigned long long>(runs),
                cli.check_determinism ? " (each twice, same trace hash)" : "",
                static_cast<unsigned long long>(violations), static_cast<unsigned long long>(events),
                seconds, static_cast<double>(events) / seconds,
                static_cast<double>(runs) * 60.0 / seconds);
  }
  return violations == 0 ? 0 : 1;
}
