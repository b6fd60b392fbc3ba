// th-server: the reference server of one training job. See --help.
#include <CLI/CLI.hpp>
#include <kj/async-unix.h>

#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <csignal>
#include <cstdio>
#include <fstream>
#include <iostream>

#include "core/limits.h"
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

// Writes `text` to `path` whole or not at all (a temporary file renamed over it): a reader of the
// timeline never sees half a file.
bool write_file_atomically(const std::string& path, const std::string& text) {
  // (Named per process: a primary and a backup started with the same path must not share it.)
  const std::string temporary = path + ".tmp." + std::to_string(::getpid());
  {
    std::ofstream out(temporary, std::ios::binary | std::ios::trunc);
    out << text;
    if (!out.flush()) {
      std::remove(temporary.c_str());
      return false;
    }
  }
  if (std::rename(temporary.c_str(), path.c_str()) != 0) {
    std::remove(temporary.c_str());
    return false;
  }
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{
      "th-server: the TensorHub reference server of one training job.\n"
      "It stores no weights: it keeps references to the workers (libthclient handles) that hold each\n"
      "version and tells readers which peer to pull from. Clients authenticate with the cluster token.\n"
      "Prints 'th-server listening on HOST:PORT' once it accepts connections.\n"
      "SIGTERM or SIGINT: drain (stop accepting, answer what is in flight, tell every client to fail over to\n"
      "its next server, exit 0 once all have closed or --drain-timeout-ms passed); a second one stops at once.\n"
      "SIGHUP: reopen --log-file (after logrotate moved it) and rewrite --timeline."};
  std::string listen = "0.0.0.0:7400";
  std::string token_file;
  std::string log_level_name = "info";
  th::server::ServiceConfig config;
  bool no_pipeline = false;
  bool no_smart_skipping = false;
  bool no_rate_aware_sources = false;
  bool no_heartbeat_datagrams = false;
  app.add_option("--listen", listen, "Address to listen on, HOST:PORT (port 0: any free port)")
      ->capture_default_str();
  app.add_option("--token-file", token_file, "File holding the cluster token clients must present: one per line, any accepted (a rotation: add a line, SIGHUP, move the clients, remove the old line, SIGHUP)")
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
  app.add_option("--drain-grace-ms", config.hub.drain_grace_ms,
                 "How long unpublish, update and close wait for a reader of the copy they drain; past it "
                 "the reader's grant is revoked and it reads elsewhere (a slow reader holds a trainer this "
                 "long at most)")
      ->capture_default_str()
      ->check(CLI::Range(std::int64_t{1}, std::int64_t{86'400'000}));
  app.add_option("--model-grace-ms", config.hub.model_grace_ms,
                 "A model with no replica this long ends: its versions are forgotten and its name may be "
                 "opened afresh, with any shard count or layout (a run restarting from step 0)")
      ->capture_default_str()
      ->check(CLI::Range(std::int64_t{0}, std::int64_t{86'400'000}));
  app.add_option("--model-description-bytes-max", config.hub.model_description_bytes_max,
                 "Bytes of tensor descriptions (names, shapes, boxes of every layout) one model may keep; a "
                 "publish, replicate or resume past it is refused (limit-exceeded)")
      ->capture_default_str()
      ->check(CLI::Range(std::uint64_t{1}, th::limits::kDescriptionBytesCeiling));
  app.add_option("--description-bytes-max", config.hub.description_bytes_max,
                 "Bytes of tensor descriptions all models together may keep (a model's are freed when it ends)")
      ->capture_default_str()
      ->check(CLI::Range(std::uint64_t{1}, th::limits::kDescriptionBytesCeiling));
  app.add_option("--fanout-max", config.hub.fanout_max, "Transfers one source copy serves at a time to readers of its own datacenter, "
                 "and as many again to readers of other datacenters (a seed's slow read across "
                 "datacenters never takes the slot local readers need)")
      ->capture_default_str();
  app.add_flag("--no-pipeline", no_pipeline, "Readers pull only from complete copies (no pipeline replication)");
  app.add_flag("--no-rate-aware-sources", no_rate_aware_sources,
               "Readers choose sources without the rates the server measured (a slow replica then stays "
               "wherever it joined a pipeline chain, and holds up every reader behind it)");
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
  std::string log_file;
  app.add_option("--log-file", log_file,
                 "Append log lines (time, level, component, text) to this file instead of stderr; reopened on SIGHUP");
  std::string metrics_listen;
  app.add_option("--metrics-listen", metrics_listen,
                 "Serve Prometheus metrics (GET /metrics) on HOST:PORT (port 0: any free port; printed as "
                 "'th-server metrics on HOST:PORT'). Off by default");
  std::string timeline_file;
  app.add_option("--timeline", timeline_file,
                 "Write the transfer timeline (Chrome Trace Event JSON: open in ui.perfetto.dev, or draw with "
                 "tools/timeline-plot) to this file every --timeline-interval-ms while it changes, and at exit");
  std::int64_t timeline_interval_ms = 10'000;
  app.add_option("--timeline-interval-ms", timeline_interval_ms, "How often --timeline is rewritten")
      ->capture_default_str()
      ->check(CLI::Range(std::int64_t{100}, std::int64_t{3'600'000}));
  app.add_option("--timeline-transfers-max", config.timeline_transfers_max,
                 "Shard reads the timeline keeps (the last ones; ~1 KiB of JSON each, rendered whole at every "
                 "rewrite and th-ctl timeline, so at most 32768)")
      ->capture_default_str()
      ->check(CLI::Range(std::size_t{1}, std::size_t{1} << 15));
  std::int64_t drain_timeout_ms = 5'000;
  app.add_option("--drain-timeout-ms", drain_timeout_ms,
                 "On SIGTERM, how long to wait for connections to take their last answers before exiting")
      ->capture_default_str()
      ->check(CLI::Range(std::int64_t{0}, std::int64_t{600'000}));
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
  app.add_option("--rpc-answers-bytes-max", config.rpc_answers_bytes_max,
                 "Bytes of answers a Cap'n Proto RPC connection (th-ctl, older clients) may leave unread; "
                 "past it the server reads nothing more from it until it reads (one that never does is "
                 "closed by the idle timeout)")
      ->capture_default_str()
      ->check(CLI::Range(std::size_t{4096}, std::size_t{1} << 30));
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
  if (!log_file.empty()) {
    if (auto opened = th::server::LogOutput::use_file(log_file); !opened.ok()) {
      std::cerr << "th-server: " << opened.error().detail << "\n";
      return 2;
    }
  }
  config.hub.pipeline = !no_pipeline;
  config.hub.smart_skipping = !no_smart_skipping;
  config.hub.rate_aware_sources = !no_rate_aware_sources;
  auto tokens = th::net::read_token_lines(token_file);
  if (!tokens.ok()) {
    std::cerr << "th-server: " << tokens.error().detail << "\n";
    return 2;
  }
  config.token = tokens.value().front();
  config.more_tokens.assign(tokens.value().begin() + 1, tokens.value().end());
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
  kj::UnixEventPort::captureSignal(SIGHUP);
  th::net::IoLoop loop(turns_per_poll);
  th::server::HubService service(config, loop.timer(), *log_level);
  service.use_event_port(loop.port());
  if (tls != nullptr) service.use_tls(*tls);
  auto log = [&](th::server::LogLevel level, const std::string& text) {
    if (level <= *log_level) th::server::LogOutput::write(level, "lifecycle", text);
  };
  std::uint64_t timeline_written = ~std::uint64_t{0};
  bool timeline_failing = false;  // logged once per failure, and once when it works again
  auto write_timeline = [&] {
    if (timeline_file.empty() || service.timeline_revision() == timeline_written) return;
    if (write_file_atomically(timeline_file, service.timeline_json())) {
      timeline_written = service.timeline_revision();
      if (timeline_failing) log(th::server::LogLevel::kInfo, "the timeline is written to " + timeline_file + " again");
      timeline_failing = false;
    } else if (!timeline_failing) {
      timeline_failing = true;
      log(th::server::LogLevel::kWarn, "cannot write the timeline to " + timeline_file + " (will keep trying)");
    }
  };
  // A path that cannot be written is a mistake to report now, not every 10 s for ever.
  if (!timeline_file.empty() && !write_file_atomically(timeline_file, service.timeline_json())) {
    std::cerr << "th-server: --timeline " << timeline_file << ": cannot write it\n";
    return 2;
  }
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
    if (!metrics_listen.empty()) {
      if (auto served = service.serve_metrics(metrics_listen); !served.ok()) {
        std::cerr << "th-server: --metrics-listen " << metrics_listen << ": " << served.error().detail << "\n";
        return 2;
      }
    }
    std::cout << "th-server listening on " << listen.substr(0, listen.rfind(':')) << ":" << listener->getPort()
              << std::endl;
    if (!service.metrics_address().empty()) std::cout << "th-server metrics on " << service.metrics_address() << std::endl;
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
        });
    // SIGHUP, for as long as the server runs: reopen the log file, rewrite the timeline.
    std::function<kj::Promise<void>()> on_hangups = [&]() -> kj::Promise<void> {
      return loop.port().onSignal(SIGHUP).then([&](siginfo_t) {
        if (auto reopened = th::server::LogOutput::reopen(); !reopened.ok()) {
          log(th::server::LogLevel::kError, "SIGHUP: " + reopened.error().detail + "; logging on to the old file");
        } else {
          log(th::server::LogLevel::kInfo, "SIGHUP: log file reopened");
        }
        // A token rotation: the file's tokens are the ones accepted from now on.
        if (auto reread = th::net::read_token_lines(token_file); reread.ok()) {
          const std::size_t count = reread.value().size();
          service.set_tokens(std::move(reread).value());
          log(th::server::LogLevel::kInfo, "SIGHUP: " + std::to_string(count) + " cluster token(s) accepted from " +
                                               token_file);
        } else {
          log(th::server::LogLevel::kError, "SIGHUP: " + reread.error().detail + "; the tokens stay as they were");
        }
        timeline_written = ~std::uint64_t{0};
        write_timeline();
        return on_hangups();
      });
    };
    auto hangups = on_hangups().eagerlyEvaluate(nullptr);
    std::function<kj::Promise<void>()> timeline_loop = [&]() -> kj::Promise<void> {
      return loop.timer().afterDelay(timeline_interval_ms * kj::MILLISECONDS).then([&] {
        write_timeline();
        return timeline_loop();
      });
    };
    kj::Promise<void> timeline_writes =
        timeline_file.empty() ? kj::Promise<void>(kj::NEVER_DONE) : timeline_loop().eagerlyEvaluate(nullptr);
    int stop_signal = 0;
    auto stop_requested = loop.port()
                              .onSignal(SIGINT)
                              .exclusiveJoin(loop.port().onSignal(SIGTERM))
                              .then([&stop_signal](siginfo_t info) { stop_signal = info.si_signo; });
    // (Once this returns, the accept loop is gone with the joined promise.)
    stop_requested.exclusiveJoin(kj::mv(serving)).wait(loop.wait_scope());
    if (serving_failed) {
      service.stop_metrics(loop.wait_scope());
      return 1;
    }
    // Drain: stop accepting (the listener closes, so a reconnecting client is refused at once and
    // tries its next server), then tell every connection and let it take its last answers.
    log(th::server::LogLevel::kInfo, "signal " + std::to_string(stop_signal) + ": draining (at most " +
                                         std::to_string(drain_timeout_ms) + " ms; a second signal stops at once)");
    listener = nullptr;
    service.drain(drain_timeout_ms)
        .exclusiveJoin(loop.port().onSignal(SIGINT).exclusiveJoin(loop.port().onSignal(SIGTERM)).then([&](siginfo_t) {
          log(th::server::LogLevel::kWarn, "second signal: stopping without waiting for the drain");
        }))
        .wait(loop.wait_scope());
    service.stop_metrics(loop.wait_scope());  // while this loop runs (a scrape may be rendering)
    write_timeline();
    log(th::server::LogLevel::kInfo, "stopped");
  } catch (const kj::Exception& exception) {
    std::cerr << "th-server: " << exception.getDescription().cStr() << "\n";
    return 1;
  }
  return 0;
}
