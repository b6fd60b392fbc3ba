// th-server: the reference server of one training job. See --help.
#include <CLI/CLI.hpp>
#include <kj/async-unix.h>

#include <sys/resource.h>

#include <algorithm>
#include <csignal>
#include <iostream>

#include "net/event_loop.h"
#include "net/tls.h"
#include "net/token.h"
#include "server/hub_service.h"

namespace {

// Descriptors th-server keeps for itself beyond its connections (listener, heartbeat socket, epoll,
// logs, the loader's).
constexpr std::size_t kFdsReserved = 64;

// Raises the soft descriptor limit to the hard one and returns how many connections fit under it:
// at the limit, accept() fails and a connection cannot even be refused politely.
std::size_t connections_that_fit() {
  rlimit limit{};
  if (getrlimit(RLIMIT_NOFILE, &limit) != 0) return SIZE_MAX;
  if (limit.rlim_cur < limit.rlim_max) {
    rlimit raised = limit;
    raised.rlim_cur = limit.rlim_max;
    if (setrlimit(RLIMIT_NOFILE, &raised) == 0) limit = raised;
  }
  if (limit.rlim_cur == RLIM_INFINITY) return SIZE_MAX;
  return limit.rlim_cur > 2 * kFdsReserved ? limit.rlim_cur - kFdsReserved : limit.rlim_cur / 2;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{
      "th-server: the TensorHub reference server of one training job.\n"
      "It stores no weights: it keeps references to the workers (libthclient handles) that hold each\n"
      "version and tells readers which peer to pull from. Clients authenticate with the cluster token.\n"
      "Prints 'th-server listening on HOST:PORT' once it accepts connections; stops on SIGINT/SIGTERM."};
  std::string listen = "0.0.0.0:7400";
  std::string token_file;
  std::string log_level_name = "info";
  th::server::ServiceConfig config;
  bool no_pipeline = false;
  bool no_smart_skipping = false;
  bool no_heartbeat_datagrams = false;
  app.add_option("--listen", listen, "Address to listen on, HOST:PORT (port 0: any free port)")
      ->capture_default_str();
  app.add_option("--token-file", token_file, "File holding the cluster token clients must present")
      ->required()
      ->check(CLI::ExistingFile);
  std::string tls_certificate_file;
  std::string tls_key_file;
  auto* tls_certificate_option =
      app.add_option("--tls-cert", tls_certificate_file,
                     "TLS on every control connection: this PEM certificate (chain), presented to clients "
                     "(who check it against their CA file); needs --tls-key. Without it, control "
                     "connections are clear text (see the README's trust model)")
          ->check(CLI::ExistingFile);
  auto* tls_key_option = app.add_option("--tls-key", tls_key_file, "The PEM private key of --tls-cert (unencrypted)")
                             ->check(CLI::ExistingFile);
  tls_certificate_option->needs(tls_key_option);
  tls_key_option->needs(tls_certificate_option);
  app.add_option("--tls-handshakes-per-s-max", config.tls_handshakes_per_s_max,
                 "TLS handshakes begun per second at most (each costs the server a key exchange and a "
                 "signature); past it, a connection waits for its turn (within --auth-deadline-ms)")
      ->capture_default_str()
      ->check(CLI::Range(std::uint64_t{1}, std::uint64_t{1} << 24));
  app.add_option("--heartbeat-timeout-ms", config.hub.heartbeat_timeout_ms,
                 "Evict a client not heard from for this long")
      ->capture_default_str();
  app.add_option("--barrier-timeout-ms", config.hub.barrier_timeout_ms,
                 "After a failover, how long a re-opened replica waits for all its shards")
      ->capture_default_str();
  app.add_option("--fanout-max", config.hub.fanout_max, "Transfers one source copy serves at a time")
      ->capture_default_str();
  app.add_flag("--no-pipeline", no_pipeline, "Readers pull only from complete copies (no pipeline replication)");
  app.add_flag("--no-smart-skipping", no_smart_skipping,
               "update() never answers 'not yet' while a cross-datacenter seeder is still receiving");
  app.add_flag("--offload-seeding", config.hub.offload_seeding,
               "The first update() of a datacenter that would read a version across datacenters reads it "
               "into a CPU copy in the background and answers 'not yet'; its next update() reads that copy "
               "(paper §4.3.4; costs one model shard of client CPU memory per seeding replica)");
  app.add_flag("--no-heartbeat-datagrams", no_heartbeat_datagrams,
               "Take heartbeats as calls only (by default also as UDP datagrams on the listen port's number, "
               "which costs the server ~60x less CPU per heartbeat)");
  app.add_option("--heartbeat-datagrams-per-s-max", config.heartbeat_datagrams_per_s_max,
                 "Heartbeat datagrams read per second at most, so that a UDP flood cannot take the server's CPU "
                 "(the excess is left to the kernel; clients whose beats are lost go back to calls). "
                 "0: 8 per connection, at least 8192")
      ->capture_default_str();
  app.add_option("--tick-ms", config.tick_ms, "How often expiry, barriers and deadlines are checked")
      ->capture_default_str();
  app.add_option("--log-level", log_level_name, "error, warn, info or debug")->capture_default_str();
  app.add_option("--connections-max", config.connections_max,
                 "Connections open at once (lowered to fit the descriptor limit, which th-server raises to "
                 "its hard limit; see ulimit -Hn)")
      ->capture_default_str()
      ->check(CLI::Range(std::size_t{1}, std::size_t{1} << 24));
  app.add_option("--unauthenticated-max", config.unauthenticated_max,
                 "Connections that have not presented the token yet; the oldest is closed to admit a new one")
      ->capture_default_str()
      ->check(CLI::Range(std::size_t{1}, std::size_t{1} << 24));
  app.add_option("--auth-deadline-ms", config.auth_deadline_ms,
                 "A connection that has not presented the token this long after it connected is closed")
      ->capture_default_str()
      ->check(CLI::Range(std::int64_t{1}, std::int64_t{3'600'000}));
  app.add_option("--effects-backlog-max", config.effects_backlog_max,
                 "Messages for one connection that may wait while it takes no deliveries; past it, the "
                 "connection is closed (its client is lost and re-opens)")
      ->capture_default_str()
      ->check(CLI::Range(std::size_t{1}, std::size_t{1} << 24));
  app.add_option("--idle-timeout-ms", config.idle_timeout_ms,
                 "An authenticated connection with no message and no heartbeat this long is closed "
                 "(0: 10 x the heartbeat timeout, at least 60 s)")
      ->capture_default_str()
      ->check(CLI::Range(std::int64_t{0}, std::int64_t{86'400'000}));
  unsigned turns_per_poll = th::net::IoLoop::kTurnsPerPollDefault;
  app.add_option("--turns-per-poll", turns_per_poll,
                 "Events handled between two looks at the kernel for new connections and data while busy; "
                 "0: only when idle (default; see net/event_loop.h for why)")
      ->capture_default_str();
  app.add_option("--messages-per-turn", config.messages_per_turn,
                 "Messages one connection may send before the others get their turn (fairness under load)")
      ->capture_default_str()
      ->check(CLI::Range(1u, 1u << 20));
  app.add_option("--wakeups-per-poll", config.wakeups_per_poll,
                 "Connections that waited for their turn let in after each poll of the kernel")
      ->capture_default_str()
      ->check(CLI::Range(1u, 1u << 20));
  CLI11_PARSE(app, argc, argv);

  const auto log_level = th::server::parse_log_level(log_level_name);
  if (!log_level) {
    std::cerr << "th-server: --log-level must be error, warn, info or debug, not '" << log_level_name << "'\n";
    return 2;
  }
  config.hub.pipeline = !no_pipeline;
  config.hub.smart_skipping = !no_smart_skipping;
  auto token = th::net::read_token_file(token_file);
  if (!token.ok()) {
    std::cerr << "th-server: " << token.error().detail << "\n";
    return 2;
  }
  config.token = std::move(token).value();
  if (const std::size_t fit = connections_that_fit(); config.connections_max > fit) {
    std::cerr << "th-server: --connections-max " << config.connections_max << " lowered to " << fit
              << " to fit the descriptor limit (raise it with ulimit -n)\n";
    config.connections_max = fit;
  }
  config.unauthenticated_max = std::min(config.unauthenticated_max, config.connections_max);
  if (auto valid = th::server::validate(config); !valid.ok()) {
    std::cerr << "th-server: " << valid.error().detail << "\n";
    return 2;
  }

  std::unique_ptr<kj::TlsContext> tls;
  if (!tls_certificate_file.empty()) {
    auto made = th::net::make_server_tls(tls_certificate_file, tls_key_file);
    if (!made.ok()) {
      std::cerr << "th-server: " << made.error().detail << "\n";
      return 2;
    }
    tls = std::move(made).value();
    std::cerr << "th-server: control connections use TLS with the certificate " << tls_certificate_file << "\n";
  }

  kj::UnixEventPort::captureSignal(SIGINT);
  kj::UnixEventPort::captureSignal(SIGTERM);
  th::net::IoLoop loop(turns_per_poll);
  th::server::HubService service(config, loop.timer(), *log_level);
  service.use_event_port(loop.port());
  if (tls != nullptr) service.use_tls(*tls);
  try {
    auto address = loop.io().getNetwork().parseAddress(listen).wait(loop.wait_scope());
    auto listener = address->listen();
    if (!no_heartbeat_datagrams) {
      try {
        const auto endpoint = th::net::parse_endpoint(listen);
        service.serve_heartbeats(loop.port(), std::make_unique<th::net::HeartbeatReceiver>(
                                                  th::net::Endpoint{endpoint.host, static_cast<std::uint16_t>(
                                                                                       listener->getPort())}));
      } catch (const th::net::SocketError& error) {
        std::cerr << "th-server: cannot take heartbeat datagrams: " << error.what()
                  << " (--no-heartbeat-datagrams takes them as calls only)\n";
        return 1;
      }
    }
    std::cout << "th-server listening on " << listen.substr(0, listen.rfind(':')) << ":" << listener->getPort()
              << std::endl;
    // Serving never ends by itself (accept failures are retried); if it ever does, that is a failure.
    bool serving_failed = false;
    auto serving = service.serve(*listener).then(
        [&serving_failed] {
          std::cerr << "th-server: stopped accepting connections\n";
          serving_failed = true;
        },
        [&serving_failed](kj::Exception&& exception) {
          std::cerr << "th-server: accepting connections failed: " << exception.getDescription().cStr() << "\n";
          serving_failed = true;
        }).eagerlyEvaluate(nullptr);
    auto on_signal = [](siginfo_t info) {
      std::cerr << "th-server: signal " << info.si_signo << ", stopping\n";
    };
    loop.port()
        .onSignal(SIGINT)
        .exclusiveJoin(loop.port().onSignal(SIGTERM))
        .then(on_signal)
        .exclusiveJoin(kj::mv(serving))
        .wait(loop.wait_scope());
    if (serving_failed) return 1;
  } catch (const kj::Exception& exception) {
    std::cerr << "th-server: " << exception.getDescription().cStr() << "\n";
    return 1;
  }
  return 0;
}
