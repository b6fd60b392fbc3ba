// th-ctl: look inside a running th-server, and block on it from job scripts. See --help.
#include <CLI/CLI.hpp>
#include <capnp/rpc-twoparty.h>
#include <kj/async-io.h>

#include <chrono>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <optional>
#include <string_view>
#include <thread>

#include "net/tensorhub.capnp.h"
#include "net/tls.h"
#include "net/token.h"
#include "net/wire.h"
#include "server/chrome_trace.h"

namespace {

// Exit codes (documented in --help): scripts tell "not yet" from "broken".
constexpr int kExitOk = 0;
constexpr int kExitServer = 1;    // unreachable, refused the token, TLS failed, sent something invalid
constexpr int kExitUsage = 2;     // bad arguments, unreadable token file
constexpr int kExitTimeout = 3;   // wait-version: the condition did not hold in time
constexpr int kExitNotFound = 4;  // list --model: no such model

constexpr long kTlsHandshakeTimeoutMs = 10'000;
// One inspect call at most this long: a server that accepted the connection and hangs must not
// hang a job script.
constexpr long kCallTimeoutMs = 30'000;

using th::server::json_string;

struct Listing {
  std::vector<th::ListSnapshot> models;
  std::string stats_json;   // the server's counters, as a JSON object
  std::string stats_line;   // the same, for people
};

class ServerConnection {
 public:
  // Connecting, the TLS handshake and each call give up after `timeout_ms` (set_timeout changes it).
  ServerConnection(kj::AsyncIoContext& io, const std::string& server, const std::string& token, kj::TlsContext* tls,
                   const std::string& tls_server_name, long timeout_ms)
      : io_(io), token_(token), timeout_ms_(timeout_ms) {
    stream_ = io.provider->getTimer()
                  .timeoutAfter(timeout_ms_ * kj::MILLISECONDS,
                                io.provider->getNetwork().parseAddress(server).then(
                                    [](kj::Own<kj::NetworkAddress> address) { return address->connect(); }))
                  .wait(io.waitScope);
    if (tls != nullptr) {
      stream_ = io.provider->getTimer()
                    .timeoutAfter(std::min(kTlsHandshakeTimeoutMs, timeout_ms_) * kj::MILLISECONDS,
                                  tls->wrapClient(kj::mv(stream_), th::net::tls_server_name(server, tls_server_name)))
                    .wait(io.waitScope);
    }
    rpc_ = kj::heap<capnp::TwoPartyClient>(*stream_);
    hub_ = rpc_->bootstrap().castAs<th::wire::Hub>();
  }
  void set_timeout(long timeout_ms) { timeout_ms_ = timeout_ms; }

  // Every model's listing and the server's counters; kj::Exception on failure.
  Listing inspect() {
    auto request = hub_.inspectRequest();
    request.setToken(token_);
    auto response = io_.provider->getTimer().timeoutAfter(timeout_ms_ * kj::MILLISECONDS, request.send())
                        .wait(io_.waitScope);
    Listing listing;
    for (auto wire_model : response.getModels()) {
      auto model = th::net::decode(wire_model);
      if (!model.ok()) KJ_FAIL_REQUIRE("the server sent an invalid listing", model.error().detail.c_str());
      listing.models.push_back(std::move(model).value());
    }
    const auto stats = response.getStats();
    const std::uint64_t refused = stats.getHeartbeatDatagramsRefused();
    listing.stats_json = "{\"uptime_ms\":" + std::to_string(stats.getUptimeMs()) +
                         ",\"connections\":" + std::to_string(stats.getConnections()) +
                         ",\"clients\":" + std::to_string(stats.getClients()) +
                         ",\"requests\":" + std::to_string(stats.getRequests()) +
                         ",\"reports\":" + std::to_string(stats.getReports()) +
                         ",\"transfers_started\":" + std::to_string(stats.getTransfersStarted()) +
                         ",\"transfers_completed\":" + std::to_string(stats.getTransfersCompleted()) +
                         ",\"source_failures\":" + std::to_string(stats.getSourceFailures()) +
                         ",\"offloads_started\":" + std::to_string(stats.getOffloadsStarted()) +
                         ",\"evictions\":" + std::to_string(stats.getEvictions()) +
                         ",\"heartbeat_datagrams\":" + std::to_string(stats.getHeartbeatDatagrams()) +
                         ",\"heartbeat_datagrams_refused\":" + std::to_string(refused) +
                         ",\"heartbeat_calls\":" + std::to_string(stats.getHeartbeatCalls()) + "}";
    listing.stats_line = "up " + std::to_string(stats.getUptimeMs() / 1000) + " s, " +
                         std::to_string(stats.getConnections()) + " connections, " +
                         std::to_string(stats.getClients()) + " clients; " + std::to_string(stats.getRequests()) +
                         " requests, " + std::to_string(stats.getTransfersCompleted()) + "/" +
                         std::to_string(stats.getTransfersStarted()) + " transfers done, " +
                         std::to_string(stats.getSourceFailures()) + " source failures, " +
                         std::to_string(stats.getOffloadsStarted()) + " offloads, " +
                         std::to_string(stats.getEvictions()) + " evictions\nheartbeats: " +
                         std::to_string(stats.getHeartbeatDatagrams()) + " as datagrams (" + std::to_string(refused) +
                         " refused), " + std::to_string(stats.getHeartbeatCalls()) + " as calls";
    return listing;
  }

  std::string timeline(const std::string& model) {
    auto request = hub_.timelineRequest();
    request.setToken(token_);
    request.setModel(model);
    auto response = io_.provider->getTimer().timeoutAfter(timeout_ms_ * kj::MILLISECONDS, request.send())
                        .wait(io_.waitScope);
    return response.getJson();
  }

 private:
  kj::AsyncIoContext& io_;
  std::string token_;
  long timeout_ms_;
  kj::Own<kj::AsyncIoStream> stream_;
  kj::Own<capnp::TwoPartyClient> rpc_;
  th::wire::Hub::Client hub_ = nullptr;
};

// What went wrong, for people. A peer that hangs up without a word (or answers bytes that are no
// Cap'n Proto frame) is most often not a th-server's --listen address at all: th-server's metrics
// endpoint and other web servers speak HTTP. Ask it, in HTTP, and say so if it answers.
std::string describe_failure(kj::AsyncIoContext& io, const std::string& server, bool tls, const kj::Exception& exception) {
  std::string text = exception.getDescription().cStr();
  // (A web server that answers with a page alone leaves Cap'n Proto waiting for a frame it
  // announced: the call times out, OVERLOADED.)
  const bool unexpected_peer = exception.getType() == kj::Exception::Type::DISCONNECTED ||
                               exception.getType() == kj::Exception::Type::OVERLOADED ||
                               text.find("segments") != std::string::npos;
  if (!unexpected_peer || tls) return text;
  constexpr long kProbeTimeoutMs = 1'000;
  try {
    auto& timer = io.provider->getTimer();
    auto stream = timer.timeoutAfter(kProbeTimeoutMs * kj::MILLISECONDS,
                                     io.provider->getNetwork().parseAddress(server).then(
                                         [](kj::Own<kj::NetworkAddress> address) { return address->connect(); }))
                      .wait(io.waitScope);
    static constexpr char kRequest[] = "HEAD / HTTP/1.0\r\n\r\n";
    stream->write(kRequest, sizeof kRequest - 1).wait(io.waitScope);
    char reply[5] = {};
    const std::size_t got =
        timer.timeoutAfter(kProbeTimeoutMs * kj::MILLISECONDS, stream->tryRead(reply, sizeof reply, sizeof reply))
            .wait(io.waitScope);
    if (got == sizeof reply && std::string_view(reply, sizeof reply) == "HTTP/") {
      return text + " (" + server + " answers HTTP: it is an HTTP endpoint, such as th-server's --metrics-listen " +
             "address, not th-server's --listen address)";
    }
  } catch (const kj::Exception&) {
    // The probe is a hint only: the original failure stands.
  }
  return text;
}

// Names as a terminal shows them: control characters (which could move the cursor or retitle the
// window) become '?'. (th-server refuses such names; this guards against any other server.)
std::string printable(std::string text) {
  for (char& c : text) {
    if (static_cast<unsigned char>(c) < 0x20 || c == 0x7F) c = '?';
  }
  return text;
}

std::string joined(const std::vector<th::Version>& versions) {
  std::string text;
  for (th::Version version : versions) text += (text.empty() ? "" : ",") + std::to_string(version);
  return text.empty() ? "-" : text;
}

std::string optional_json(const std::optional<th::Version>& version) {
  return version ? std::to_string(*version) : "null";
}

std::string model_json(const th::ListSnapshot& model) {
  std::string out = "{\"model\":" + json_string(model.model) + ",\"latest\":" + optional_json(model.latest) +
                    ",\"versions\":[";
  for (std::size_t i = 0; i < model.versions.size(); ++i) {
    const auto& version = model.versions[i];
    out += (i == 0 ? "" : ",") + std::string("{\"version\":") + std::to_string(version.version) +
           ",\"complete\":" + std::to_string(version.complete) + ",\"partial\":" + std::to_string(version.partial) +
           ",\"retained\":" + (version.retained ? "true" : "false") +
           ",\"offloaded\":" + (version.offloaded ? "true" : "false") + "}";
  }
  out += "],\"replicas\":[";
  for (std::size_t i = 0; i < model.replicas.size(); ++i) {
    const auto& replica = model.replicas[i];
    std::string offloads;
    for (th::Version version : replica.offloads) offloads += (offloads.empty() ? "" : ",") + std::to_string(version);
    out += (i == 0 ? "" : ",") + std::string("{\"name\":") + json_string(replica.name) +
           ",\"incarnation\":" + std::to_string(replica.incarnation) +
           ",\"datacenter\":" + json_string(replica.datacenter) + ",\"spot\":" + (replica.spot ? "true" : "false") +
           ",\"role\":" + json_string(replica.role) + ",\"shards\":" + std::to_string(replica.num_shards) +
           ",\"state\":" + json_string(replica.state) + ",\"version\":" + optional_json(replica.version) +
           ",\"serving\":" + std::to_string(replica.serving) + ",\"offloads\":[" + offloads + "]}";
  }
  return out + "]}";
}

void print_model(const th::ListSnapshot& model) {
  std::cout << "model " << printable(model.model) << "  latest "
            << (model.latest ? std::to_string(*model.latest) : std::string("none")) << "\n";
  std::cout << "  versions:\n    " << std::left << std::setw(10) << "version" << std::setw(10) << "complete"
            << std::setw(9) << "partial" << std::setw(10) << "retained" << "offloaded\n";
  for (const auto& version : model.versions) {
    std::cout << "    " << std::setw(10) << version.version << std::setw(10) << version.complete << std::setw(9)
              << version.partial << std::setw(10) << (version.retained ? "yes" : "no")
              << (version.offloaded ? "yes" : "no") << "\n";
  }
  std::cout << "  replicas:\n    " << std::setw(18) << "name" << std::setw(6) << "inc" << std::setw(12)
            << "datacenter" << std::setw(6) << "spot" << std::setw(10) << "role" << std::setw(8) << "shards"
            << std::setw(12) << "state" << std::setw(9) << "version" << std::setw(9) << "serving"
            << "offloads\n";
  for (const auto& replica : model.replicas) {
    std::cout << "    " << std::setw(18) << printable(replica.name) << std::setw(6) << replica.incarnation
              << std::setw(12) << printable(replica.datacenter) << std::setw(6) << (replica.spot ? "yes" : "no")
              << std::setw(10) << (replica.role.empty() ? "-" : printable(replica.role)) << std::setw(8) << replica.num_shards << std::setw(12)
              << printable(replica.state) << std::setw(9)
              << (replica.version ? std::to_string(*replica.version) : std::string("-")) << std::setw(9)
              << replica.serving << joined(replica.offloads) << "\n";
  }
}

// wait-version's condition: replicas of `role` (any if empty) holding `version` or a newer one.
std::vector<std::string> holders(const th::ListSnapshot& model, th::Version version, const std::string& role) {
  std::vector<std::string> names;
  for (const auto& replica : model.replicas) {
    if (!role.empty() && replica.role != role) continue;
    if (replica.version && *replica.version >= version && replica.state == "complete") names.push_back(replica.name);
  }
  return names;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{
      "th-ctl: look inside a running th-server, or wait on it from a job script.\n"
      "  list (default)  every model's versions (complete and partial copies, retention, offloads) and\n"
      "                  replicas (datacenter, spot, role, state, version held, transfers served), and the\n"
      "                  server's counters\n"
      "  timeline        the transfer timeline as Chrome Trace Event JSON (ui.perfetto.dev; tools/timeline-plot)\n"
      "  wait-version    block until enough replicas hold a version (exit 0), or time out (exit 3)\n"
      "--json gives machine-readable output on every command."};
  app.footer(
      "Exit codes: 0 done; 1 the server could not be reached, refused the token, failed TLS or answered\n"
      "something invalid; 2 bad arguments or token file; 3 wait-version timed out; 4 list --model: no such model.");
  app.fallthrough();
  app.require_subcommand(0, 1);
  std::string server = "127.0.0.1:7400";
  std::string token_file;
  bool json = false;
  std::string tls_ca_file;
  std::string tls_server_name;
  app.add_option("--server", server, "th-server address HOST:PORT")->capture_default_str();
  app.add_option("--token-file", token_file, "file holding the cluster token")->required()->check(CLI::ExistingFile);
  app.add_flag("--json", json, "print JSON (one object per refresh) instead of tables");
  auto* tls_ca_option = app.add_option("--tls-ca", tls_ca_file,
                                       "Speak TLS to a th-server run with --tls-cert: its certificate must chain "
                                       "to a CA in this PEM file")
                            ->check(CLI::ExistingFile);
  app.add_option("--tls-server-name", tls_server_name,
                 "The name the server's certificate must carry (default: the host of --server)")
      ->needs(tls_ca_option);

  std::string model_filter;
  bool watch = false;
  int interval_ms = 1000;
  auto* list = app.add_subcommand("list", "models, versions, replicas and the server's counters (the default)");
  // Also on the top level, so that the command-less form of older scripts keeps working.
  for (CLI::App* scope : {static_cast<CLI::App*>(&app), list}) {
    scope->add_option("--model", model_filter, "only this model (exit 4 if the server has none by that name)");
    scope->add_flag("--watch", watch, "refresh until interrupted");
    scope->add_option("--interval-ms", interval_ms, "refresh interval for --watch")
        ->capture_default_str()
        ->check(CLI::Range(100, 3'600'000));
  }

  std::string timeline_out;
  auto* timeline = app.add_subcommand("timeline", "write the transfer timeline (Chrome Trace Event JSON)");
  timeline->add_option("-o,--output", timeline_out, "write it to this file (default: stdout)");
  timeline->add_option("--model", model_filter, "only this model's transfers (default: every model's)");

  std::string wait_model;
  th::Version wait_version = 0;
  std::uint32_t wait_replicas = 1;
  std::string wait_role;
  std::int64_t wait_timeout_ms = 600'000;
  int wait_interval_ms = 200;
  auto* wait = app.add_subcommand("wait-version",
                                  "wait until at least --replicas replicas (of --role) hold --version or newer, "
                                  "complete; rides out a restarting server until the timeout");
  wait->add_option("--model", wait_model, "the model")->required();
  wait->add_option("--version", wait_version, "the version (or newer)")->required();
  wait->add_option("--replicas", wait_replicas, "how many replicas must hold it")->capture_default_str()
      ->check(CLI::Range(1u, 1u << 20));
  wait->add_option("--role", wait_role, "count only replicas of this role (e.g. rollout)");
  wait->add_option("--timeout-ms", wait_timeout_ms, "give up (exit 3) after this long")->capture_default_str()
      ->check(CLI::Range(std::int64_t{0}, std::int64_t{86'400'000}));
  wait->add_option("--interval-ms", wait_interval_ms, "how often to look")->capture_default_str()
      ->check(CLI::Range(10, 60'000));

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& error) {
    const int code = app.exit(error);
    return code == 0 ? kExitOk : kExitUsage;
  }
  std::unique_ptr<kj::TlsContext> tls;
  if (!tls_ca_file.empty()) {
    auto made = th::net::make_client_tls(tls_ca_file);
    if (!made.ok()) {
      std::cerr << "th-ctl: " << made.error().detail << "\n";
      return kExitUsage;
    }
    tls = std::move(made).value();
  }
  const auto token_read = th::net::read_token_file(token_file);
  if (!token_read.ok()) {
    std::cerr << "th-ctl: " << token_read.error().detail << "\n";
    return kExitUsage;
  }
  const std::string& token = token_read.value();
  auto io = kj::setupAsyncIo();
  auto connect = [&](long timeout_ms) {
    return std::make_unique<ServerConnection>(io, server, token, tls.get(), tls_server_name, timeout_ms);
  };

  if (*wait) {
    // A job script's barrier: connection failures are retried (the server may be restarting or
    // failing over) until the deadline; the last one is reported.
    const auto started = std::chrono::steady_clock::now();
    const auto deadline = started + std::chrono::milliseconds(wait_timeout_ms);
    std::unique_ptr<ServerConnection> connection;
    std::string last_problem = "no answer yet";
    std::size_t seen = 0;
    for (;;) {
      try {
        // Never past the deadline, however the server behaves (a stopped one accepts and says nothing).
        const long left_ms = std::max<long>(
            1, std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now()).count());
        const long call_ms = std::min(kCallTimeoutMs, left_ms);
        if (connection == nullptr) connection = connect(call_ms);
        connection->set_timeout(call_ms);
        const Listing listing = connection->inspect();
        last_problem = "no model " + wait_model;
        for (const auto& model : listing.models) {
          if (model.model != wait_model) continue;
          const auto names = holders(model, wait_version, wait_role);
          seen = names.size();
          last_problem = std::to_string(seen) + " of " + std::to_string(wait_replicas) + " replicas hold it";
          if (names.size() >= wait_replicas) {
            const auto waited_ms =
                std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - started).count();
            if (json) {
              std::string list_json;
              for (const auto& name : names) list_json += (list_json.empty() ? "" : ",") + json_string(name);
              std::cout << "{\"met\":true,\"model\":" << json_string(wait_model) << ",\"version\":" << wait_version
                        << ",\"latest\":" << optional_json(model.latest) << ",\"replicas\":[" << list_json
                        << "],\"waited_ms\":" << waited_ms << "}" << std::endl;
            } else {
              std::cout << names.size() << " replica(s) hold " << wait_model << " version " << wait_version
                        << " or newer (waited " << waited_ms << " ms)" << std::endl;
            }
            return kExitOk;
          }
        }
      } catch (const kj::Exception& exception) {
        connection.reset();
        last_problem = server + ": " + describe_failure(io, server, tls != nullptr, exception);
      }
      if (std::chrono::steady_clock::now() + std::chrono::milliseconds(wait_interval_ms) > deadline) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(wait_interval_ms));
    }
    if (json) {
      std::cout << "{\"met\":false,\"model\":" << json_string(wait_model) << ",\"version\":" << wait_version
                << ",\"replicas_holding\":" << seen << ",\"why\":" << json_string(last_problem) << "}" << std::endl;
    }
    std::cerr << "th-ctl: timed out after " << wait_timeout_ms << " ms waiting for " << wait_replicas
              << " replica(s) to hold " << wait_model << " version " << wait_version << ": " << last_problem << "\n";
    return kExitTimeout;
  }

  if (*timeline) {
    try {
      const std::string trace = connect(kCallTimeoutMs)->timeline(model_filter);
      if (timeline_out.empty()) {
        std::cout << trace << std::flush;
        return kExitOk;
      }
      std::ofstream out(timeline_out, std::ios::trunc);
      out << trace;
      if (!out.flush()) {
        std::cerr << "th-ctl: cannot write " << timeline_out << "\n";
        return kExitUsage;
      }
      if (!json) std::cerr << "th-ctl: timeline written to " << timeline_out << "\n";
      return kExitOk;
    } catch (const kj::Exception& exception) {
      std::cerr << "th-ctl: " << server << ": " << describe_failure(io, server, tls != nullptr, exception) << "\n";
      return kExitServer;
    }
  }
  std::unique_ptr<ServerConnection> connection;
  for (;;) {
    try {
      if (connection == nullptr) connection = connect(kCallTimeoutMs);
      const Listing listing = connection->inspect();
      std::vector<const th::ListSnapshot*> shown;
      for (const auto& model : listing.models) {
        if (model_filter.empty() || model.model == model_filter) shown.push_back(&model);
      }
      if (json) {
        std::string models;
        for (const auto* model : shown) models += (models.empty() ? "" : ",") + model_json(*model);
        std::cout << "{\"server\":" << json_string(server) << ",\"stats\":" << listing.stats_json << ",\"models\":["
                  << models << "]}" << std::endl;
      } else {
        if (watch) std::cout << "\x1b[2J\x1b[H";  // clear the terminal
        std::cout << "th-server " << server << ": " << listing.stats_line << "\n";
        for (const auto* model : shown) print_model(*model);
        if (shown.empty()) std::cout << (model_filter.empty() ? "no models\n" : "no model " + printable(model_filter) + "\n");
        std::cout << std::flush;
      }
      if (!watch) return shown.empty() && !model_filter.empty() ? kExitNotFound : kExitOk;
    } catch (const kj::Exception& exception) {
      std::cerr << "th-ctl: " << server << ": " << describe_failure(io, server, tls != nullptr, exception) << "\n";
      if (!watch) return kExitServer;
      connection.reset();  // --watch rides out a restarting server: try again at the next refresh
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(interval_ms));
  }
}
