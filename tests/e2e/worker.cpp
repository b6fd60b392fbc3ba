// th-e2e-worker: one shard of a replica, as a real process, driven by a script of commands so that
// the end-to-end tests can stage scenarios (and kill -9 it at any point).
//
//   th-e2e-worker --server HOST:PORT [--server BACKUP] --token T --replica NAME [options] -- CMD...
//
// Commands (each prints one line when it finishes; errors print "<cmd> error <code> <detail>"):
//   publish:V        fill the tensors with the bytes of version V, publish V (with --change-period,
//                    through write_tensor: a patch against the version published before)
//   unpublish        unpublish
//   scribble         overwrite every tensor (as a trainer's next step would)
//   replicate:SEL    replicate; prints "replicate ok V from SOURCE"
//   update:SEL       update; prints "update STATUS V from SOURCE"
//   poll:SEL         update every 250 ms while it answers not-yet (at most 30 s), printing each
//   verify           check every byte against the version last received or published
//   wait-line        block until a line arrives on stdin (the test says "go")
//   sleep:MS         sleep
//   list             prints "list latest=V replicas=N"
//   close            close
//   patch-stats      prints "patch-stats reads R failed F patch_bytes P bytes B" (HandleStats)
// Tensor bytes are a function of (version, shard, tensor, offset): a byte from the wrong version,
// tensor or place cannot pass `verify`. With --change-period P, a byte changes in one version of
// every P (at a phase of its own), as a trainer's weights do at a small learning rate: version V
// differs from V-1 in about 1/P of its bytes, which a patch carries.
#include <CLI/CLI.hpp>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <iostream>
#include <string>
#include <thread>
#include <vector>

#include <cstdlib>

#include "tensorhub/client.h"

namespace {

std::uint8_t byte_of(std::uint64_t version, std::uint32_t shard, std::size_t tensor, std::uint64_t offset) {
  std::uint64_t x = version * 0x9E3779B97F4A7C15ull ^ (shard + 1) * 0xC2B2AE3D27D4EB4Full ^
                    (tensor + 1) * 0x165667B19E3779F9ull ^ (offset / 8) * 0xD6E8FEB86659FD93ull;
  x ^= x >> 29;
  x *= 0xBF58476D1CE4E5B9ull;
  x ^= x >> 32;
  return static_cast<std::uint8_t>(x >> (8 * (offset % 8)));
}

// The byte at `offset` in version `version` when each byte changes once every `change_period`
// versions (0: every version).
std::uint8_t content_of(std::uint64_t version, std::uint32_t change_period, std::uint32_t shard, std::size_t tensor,
                        std::uint64_t offset) {
  if (change_period == 0) return byte_of(version, shard, tensor, offset);
  std::uint64_t phase = (offset + 1) * 0x9E3779B97F4A7C15ull ^ (tensor + 1) * 0xD1B54A32D192ED03ull;
  phase ^= phase >> 31;
  return byte_of((version + phase % change_period) / change_period, shard, tensor, offset);
}

void say(const std::string& line) {
  std::cout << line << std::endl;  // one line per event, flushed: the test reads them as they come
}

// How the last pulls went, on stderr (the test's log; stdout is the scripted dialogue): the suite
// run with TH_E2E_TRANSPORT=rdma fails if any went over TCP.
void report_transport(const th::Handle& handle) {
  static std::uint64_t rdma_before = 0;
  static std::uint64_t tcp_before = 0;
  const th::HandleStats stats = handle.stats();
  if (stats.pulls_rdma > rdma_before) std::cerr << "th-e2e-worker: pulled over rdma\n";
  if (stats.pulls_tcp > tcp_before) std::cerr << "th-e2e-worker: pulled over tcp\n";
  rdma_before = stats.pulls_rdma;
  tcp_before = stats.pulls_tcp;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"th-e2e-worker: one scripted TensorHub shard, for end-to-end tests"};
  th::ClientOptions options;
  std::uint64_t tensor_bytes = 1 << 20;
  std::uint32_t tensors = 3;
  std::uint32_t small_tensors = 2;
  std::uint32_t tiny_tensors = 0;
  std::size_t name_bytes = 0;
  bool report_source = false;
  std::uint64_t halfway_bytes = 0;
  std::uint32_t change_period = 0;
  std::uint64_t retain_latest = 0;
  bool retain = false;
  std::vector<std::string> script;
  app.add_option("--server", options.servers, "th-server address (repeat for backups)")->required();
  app.add_option("--token", options.token, "cluster token")->required();
  app.add_option("--model", options.model)->capture_default_str();
  app.add_option("--replica", options.replica)->required();
  app.add_option("--incarnation", options.incarnation)->capture_default_str();
  app.add_option("--shard", options.shard)->capture_default_str();
  app.add_option("--shards", options.num_shards)->capture_default_str();
  app.add_option("--datacenter", options.datacenter)->capture_default_str();
  app.add_option("--role", options.role);
  app.add_flag("--spot", options.spot);
  app.add_option("--retain-latest", retain_latest, "keep latest-K readable")->each([&](const std::string&) { retain = true; });
  app.add_option("--tensor-bytes", tensor_bytes, "bytes of each big tensor")->capture_default_str();
  app.add_option("--tensors", tensors, "big tensors")->capture_default_str();
  app.add_option("--small-tensors", small_tensors, "tensors under 2 MB (packed)")->capture_default_str();
  app.add_option("--tiny-tensors", tiny_tensors, "8-byte tensors besides (many descriptions, few bytes)")
      ->capture_default_str();
  app.add_option("--name-bytes", name_bytes, "pad every tensor name to this many bytes (at most 256)")
      ->capture_default_str()
      ->check(CLI::Range(std::size_t{0}, std::size_t{256}));
  app.add_option("--read-rate", options.read_rate_bytes_per_s, "receive rate cap, bytes/s")->capture_default_str();
  app.add_option("--data-streams", options.data_streams, "connections per read")->capture_default_str();
  app.add_option("--change-period", change_period,
                 "each byte changes once every this many versions, and publish writes through "
                 "write_tensor (patches); 0: every byte, every version")
      ->capture_default_str();
  app.add_flag("--report-source", report_source, "print 'source NAME' when a read from NAME starts");
  app.add_option("--halfway-bytes", halfway_bytes, "replicate-watched: print 'halfway' once this much arrived")
      ->capture_default_str();
  // The e2e suite runs once per transport: the guest of ctest -L rdma sets TH_E2E_TRANSPORT=rdma.
  if (const char* transport = std::getenv("TH_E2E_TRANSPORT")) options.transport = transport;
  app.add_option("--transport", options.transport, "data plane: auto, rdma, tcp")->capture_default_str();
  app.add_option("--tls-ca", options.tls_ca_file, "TLS to the server: trust this CA file");
  app.add_option("--tls-server-name", options.tls_server_name, "TLS: the name the server's certificate carries");
  app.add_option("script", script, "commands")->required();
  options.model = "e2e";
  CLI11_PARSE(app, argc, argv);
  if (retain) options.retention.keep_latest = retain_latest;

  auto opened = th::Handle::open(options);
  if (!opened.ok()) {
    say("open error " + std::string(th::errc_name(opened.error().code)) + " " + opened.error().detail);
    return 3;
  }
  auto handle = std::move(opened).value();
  say("open ok " + handle->data_endpoint());
  say("client " + std::to_string(handle->client_id()));
  say("incarnation " + std::to_string(handle->incarnation()));

  // Big tensors first, then small ones; names in a different order than sizes on purpose.
  std::vector<std::vector<std::uint8_t>> buffers;
  std::vector<std::string> names;
  for (std::uint32_t i = 0; i < tensors; ++i) buffers.emplace_back(tensor_bytes + i * 4099);
  for (std::uint32_t i = 0; i < small_tensors; ++i) buffers.emplace_back(1000 + i * 77);
  for (std::uint32_t i = 0; i < tiny_tensors; ++i) buffers.emplace_back(8);
  for (std::size_t i = 0; i < buffers.size(); ++i) {
    std::string name = "t" + std::to_string(buffers.size() - i);
    if (name.size() < name_bytes) name.insert(0, name_bytes - name.size(), 'n');
    names.push_back(name);
    auto status = handle->register_tensor(name, buffers[i].data(), buffers[i].size(), th::DType::kUInt8);
    if (!status.ok()) {
      say("register error " + std::string(th::errc_name(status.error().code)) + " " + status.error().detail);
      return 3;
    }
  }

  std::atomic<bool> done{false};
  std::thread source_reporter;
  if (report_source) {
    source_reporter = std::thread([&] {
      std::string last;
      while (!done.load()) {
        const std::string now = handle->stats().reading_from;
        if (!now.empty() && now != last) say("source " + now);
        last = now;
        std::this_thread::sleep_for(std::chrono::milliseconds(2));
      }
    });
  }

  std::uint64_t held = 0;
  auto fail = [](const std::string& command, const th::Error& error) {
    say(command + " error " + std::string(th::errc_name(error.code)) + " " + error.detail);
  };
  for (const std::string& command : script) {
    const auto colon = command.find(':');
    const std::string verb = command.substr(0, colon);
    const std::string arg = colon == std::string::npos ? "" : command.substr(colon + 1);
    if (verb == "publish") {
      const std::uint64_t version = std::stoull(arg);
      bool written = true;
      std::vector<std::uint8_t> next;
      for (std::size_t t = 0; t < buffers.size() && written; ++t) {
        std::vector<std::uint8_t>& into = change_period == 0 ? buffers[t] : next;
        into.resize(buffers[t].size());
        for (std::uint64_t at = 0; at < into.size(); ++at) into[at] = content_of(version, change_period, options.shard, t, at);
        if (change_period == 0) continue;
        auto status = handle->write_tensor(names[t], next.data(), th::DType::kUInt8);
        if (!status.ok()) {
          fail(verb, status.error());
          written = false;
        }
      }
      if (!written) continue;
      auto published = handle->publish(version);
      if (!published.ok()) {
        fail(verb, published.error());
        continue;
      }
      held = version;
      say("publish ok " + std::to_string(version));
    } else if (verb == "unpublish") {
      auto status = handle->unpublish();
      status.ok() ? say("unpublish ok") : fail(verb, status.error());
    } else if (verb == "scribble") {
      for (auto& buffer : buffers) std::fill(buffer.begin(), buffer.end(), 0xAB);
      say("scribble ok");
    } else if (verb == "replicate") {
      auto replicated = handle->replicate(arg);
      if (!replicated.ok()) {
        fail(verb, replicated.error());
        continue;
      }
      held = replicated.value().version;
      say("replicate ok " + std::to_string(held) + " from " + replicated.value().source_replica);
      report_transport(*handle);
    } else if (verb == "replicate-watched") {
      // replicate(arg), saying "halfway" once --halfway-bytes of it arrived (a test kills the
      // source then), and then how the reads went.
      auto started = handle->replicate_async(arg, 0);
      if (!started.ok()) {
        fail("replicate", started.error());
        continue;
      }
      th::Receive& receive = *started.value();
      bool said = false;
      while (!receive.wait_for(2)) {
        if (!said && receive.progress().bytes_ready >= halfway_bytes) {
          say("halfway");
          said = true;
        }
      }
      auto answer = receive.wait();
      if (!answer.ok()) {
        fail("replicate", answer.error());
        continue;
      }
      held = answer.value().version.value_or(0);
      say("replicate ok " + std::to_string(held) + " from " + answer.value().source_replica);
      const th::HandleStats stats = handle->stats();
      say("stats reads_failed " + std::to_string(stats.reads_failed) + " reads_resumed " +
          std::to_string(stats.reads_resumed) + " bytes_resumed " + std::to_string(stats.bytes_resumed));
    } else if (verb == "update" || verb == "poll") {
      // poll: update every 250 ms while the answer is "not yet" (at most 120 times), as a rollout
      // loop would.
      const int tries = verb == "poll" ? 120 : 1;
      for (int attempt = 0; attempt < tries; ++attempt) {
        if (attempt > 0) std::this_thread::sleep_for(std::chrono::milliseconds(250));
        auto updated = handle->update(arg);
        if (!updated.ok()) {
          fail("update", updated.error());
          break;
        }
        held = updated.value().version.value_or(0);
        say("update " + std::string(th::update_status_name(updated.value().status)) + " " +
            (updated.value().version ? std::to_string(held) : "nothing") +
            " from " + updated.value().source_replica);
        if (updated.value().status == th::UpdateStatus::kUpdated) report_transport(*handle);
        if (updated.value().status != th::UpdateStatus::kNotYet) break;
      }
    } else if (verb == "verify") {
      std::uint64_t wrong = 0;
      for (std::size_t t = 0; t < buffers.size(); ++t) {
        for (std::uint64_t at = 0; at < buffers[t].size(); ++at) {
          wrong += buffers[t][at] != content_of(held, change_period, options.shard, t, at);
        }
      }
      say(wrong == 0 ? "verify ok " + std::to_string(held) : "verify BAD " + std::to_string(wrong) + " bytes");
    } else if (verb == "wait-line") {
      std::string line;
      std::getline(std::cin, line);
      say("wait-line ok");
    } else if (verb == "sleep") {
      std::this_thread::sleep_for(std::chrono::milliseconds(std::stoll(arg)));
      say("sleep ok");
    } else if (verb == "list") {
      auto listed = handle->list();
      if (!listed.ok()) {
        fail(verb, listed.error());
        continue;
      }
      say("list latest=" + (listed.value().latest ? std::to_string(*listed.value().latest) : std::string("none")) +
          " replicas=" + std::to_string(listed.value().replicas.size()));
    } else if (verb == "patch-stats") {
      const th::HandleStats stats = handle->stats();
      say("patch-stats reads " + std::to_string(stats.patch_reads) + " failed " + std::to_string(stats.patch_reads_failed) +
          " patch_bytes " + std::to_string(stats.patch_bytes_received) + " bytes " + std::to_string(stats.bytes_received));
    } else if (verb == "close") {
      auto status = handle->close();
      status.ok() ? say("close ok") : fail(verb, status.error());
    } else {
      say("unknown command " + command);
      done.store(true);
      if (source_reporter.joinable()) source_reporter.join();
      return 2;
    }
  }
  done.store(true);
  if (source_reporter.joinable()) source_reporter.join();
  // The handle goes before the buffers it serves: its close waits for readers still pulling from
  // them (a pipeline reader of this copy), which the freed memory would cut off ("Bad address").
  handle.reset();
  say("done");
  return 0;
}
