// th-ctl: look inside a running th-server. See --help.
#include <CLI/CLI.hpp>
#include <capnp/rpc-twoparty.h>
#include <kj/async-io.h>

#include <chrono>
#include <iomanip>
#include <iostream>
#include <thread>

#include "net/tensorhub.capnp.h"
#include "net/tls.h"
#include "net/token.h"
#include "net/wire.h"

namespace {

constexpr long kTlsHandshakeTimeoutMs = 10'000;

std::string joined(const std::vector<th::Version>& versions) {
  std::string text;
  for (th::Version version : versions) text += (text.empty() ? "" : ",") + std::to_string(version);
  return text.empty() ? "-" : text;
}

void print(const th::ListSnapshot& model) {
  std::cout << "model " << model.model << "  latest "
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
    std::cout << "    " << std::setw(18) << replica.name << std::setw(6) << replica.incarnation << std::setw(12)
              << replica.datacenter << std::setw(6) << (replica.spot ? "yes" : "no") << std::setw(10)
              << (replica.role.empty() ? "-" : replica.role) << std::setw(8) << replica.num_shards << std::setw(12)
              << replica.state << std::setw(9)
              << (replica.version ? std::to_string(*replica.version) : std::string("-")) << std::setw(9)
              << replica.serving << joined(replica.offloads) << "\n";
  }
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{
      "th-ctl: show what a running th-server knows: every model's versions (complete and partial\n"
      "copies, retention, offloads) and replicas (datacenter, spot, role, state, version held, transfers\n"
      "served), and the server's counters."};
  std::string server = "127.0.0.1:7400";
  std::string token_file;
  std::string model_filter;
  bool watch = false;
  int interval_ms = 1000;
  app.add_option("--server", server, "th-server address HOST:PORT")->capture_default_str();
  app.add_option("--token-file", token_file, "file holding the cluster token")->required()->check(CLI::ExistingFile);
  app.add_option("--model", model_filter, "only this model");
  app.add_flag("--watch", watch, "refresh until interrupted");
  app.add_option("--interval-ms", interval_ms, "refresh interval for --watch")->capture_default_str()->check(CLI::Range(100, 3'600'000));
  std::string tls_ca_file;
  std::string tls_server_name;
  auto* tls_ca_option = app.add_option("--tls-ca", tls_ca_file,
                                       "Speak TLS to a th-server run with --tls-cert: its certificate must chain "
                                       "to a CA in this PEM file")
                            ->check(CLI::ExistingFile);
  app.add_option("--tls-server-name", tls_server_name,
                 "The name the server's certificate must carry (default: the host of --server)")
      ->needs(tls_ca_option);
  CLI11_PARSE(app, argc, argv);
  std::unique_ptr<kj::TlsContext> tls;
  if (!tls_ca_file.empty()) {
    auto made = th::net::make_client_tls(tls_ca_file);
    if (!made.ok()) {
      std::cerr << "th-ctl: " << made.error().detail << "\n";
      return 2;
    }
    tls = std::move(made).value();
  }
  const auto token_read = th::net::read_token_file(token_file);
  if (!token_read.ok()) {
    std::cerr << "th-ctl: " << token_read.error().detail << "\n";
    return 2;
  }
  const std::string& token = token_read.value();

  try {
    auto io = kj::setupAsyncIo();
    auto stream = io.provider->getNetwork().parseAddress(server).wait(io.waitScope)->connect().wait(io.waitScope);
    if (tls != nullptr) {
      // Bounded: a server that accepted the TCP connection but hangs must not hang th-ctl.
      stream = io.provider->getTimer()
                   .timeoutAfter(kTlsHandshakeTimeoutMs * kj::MILLISECONDS,
                                 tls->wrapClient(kj::mv(stream), th::net::tls_server_name(server, tls_server_name)))
                   .wait(io.waitScope);
    }
    capnp::TwoPartyClient rpc(*stream);
    auto hub = rpc.bootstrap().castAs<th::wire::Hub>();
    for (;;) {
      auto request = hub.inspectRequest();
      request.setToken(token);
      auto response = request.send().wait(io.waitScope);
      if (watch) std::cout << "\x1b[2J\x1b[H";  // clear the terminal
      const auto stats = response.getStats();
      std::cout << "th-server " << server << ": up " << stats.getUptimeMs() / 1000 << " s, " << stats.getConnections()
                << " connections, " << stats.getClients() << " clients; " << stats.getRequests() << " requests, "
                << stats.getTransfersCompleted() << "/" << stats.getTransfersStarted() << " transfers done, "
                << stats.getSourceFailures() << " source failures, " << stats.getOffloadsStarted() << " offloads, "
                << stats.getEvictions() << " evictions\n"
                << "heartbeats: " << stats.getHeartbeatDatagrams() << " as datagrams ("
                << stats.getHeartbeatDatagramsRefused() << " refused), " << stats.getHeartbeatCalls() << " as calls\n";
      std::size_t shown = 0;
      for (auto wire_model : response.getModels()) {
        auto model = th::net::decode(wire_model);
        if (!model.ok()) {
          std::cerr << "th-ctl: the server sent an invalid listing: " << model.error().detail << "\n";
          return 1;
        }
        if (!model_filter.empty() && model.value().model != model_filter) continue;
        print(model.value());
        ++shown;
      }
      if (shown == 0) std::cout << (model_filter.empty() ? "no models\n" : "no model " + model_filter + "\n");
      std::cout << std::flush;
      if (!watch) break;
      io.provider->getTimer().afterDelay(interval_ms * kj::MILLISECONDS).wait(io.waitScope);
    }
  } catch (const kj::Exception& exception) {
    std::cerr << "th-ctl: " << server << ": " << exception.getDescription().cStr() << "\n";
    return 1;
  }
  return 0;
}
