// The th-server shell: connections in, the core Hub in the middle, effects out.
//
// One thread, one IoLoop. A connection speaks one of two protocols over the same port, told apart
// by its first 8 bytes: framed (net/frames.h; libthclient's: Cap'n Proto messages back to back,
// batched both ways, server/framed_connections.cpp) or Cap'n Proto RPC (th-ctl's inspect, older
// clients: Hub.connect, Session.send, Sink.deliver). Every message that arrives is decoded
// (net/wire), fed to the Hub with the server's clock, and the Hub's effects are routed to the
// connections of the clients they name and delivered in batches. The shell adds no protocol logic;
// what it owns is logistics:
//   - authentication: a connection must present the cluster token before it gets a Session, within
//     a deadline, in small messages, and a few wrong tokens close it; unauthenticated connections
//     are capped apart from the others (the oldest goes first), so silent ones cannot fill the
//     server; an authenticated connection that goes quiet is closed too;
//   - client binding: a connection speaks for the one client it named at connect; the id moves to
//     another connection only with the secret it was first claimed with (a reconnecting handle);
//     when a connection closes, the Hub hears ConnectionLost for its client;
//   - flow control: each connection has one write (framed) or a bounded number of Sink.deliver
//     calls (RPC) in flight and a bounded backlog of effects; a client that falls behind further
//     is disconnected;
//   - time: a timer feeds Tick so that heartbeat expiry, barriers and call deadlines fire;
//   - heartbeat datagrams (net/heartbeat.h): each connection gets a secret at connect; a datagram
//     naming a client bound to that connection, with that secret, is the client's Heartbeat report.
#pragma once

#include <capnp/rpc-twoparty.h>
#include <kj/async-io.h>
#include <kj/async-unix.h>
#include <kj/compat/tls.h>

#include <chrono>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <optional>
#include <string_view>
#include <string>
#include <unordered_map>
#include <vector>

#include "core/hub.h"
#include "net/metrics_http.h"
#include "net/fair_stream.h"
#include "net/heartbeat.h"
#include "net/tensorhub.capnp.h"
#include "server/log.h"
#include "server/service_metrics.h"

namespace th::server {

struct ServiceConfig {
  HubSettings hub;
  std::string token;            // the cluster token every connection must present
  std::vector<std::string> more_tokens;  // also accepted (a rotation in progress)
  std::int64_t tick_ms = 100;   // how often the Hub hears the clock
  std::uint32_t delivers_in_flight_max = 8;      // Sink.deliver calls per connection
  std::size_t effects_backlog_max = 1 << 16;     // undelivered effects per connection
  // Bytes of answers (and calls) an RPC connection's peer has not read yet: past it, nothing more
  // is read from the connection until the peer reads (net/fair_stream.h); a peer that never does
  // is closed by the idle timeout. (Framed connections: effects_backlog_max.)
  std::size_t rpc_answers_bytes_max = 1 << 20;
  // Calls an RPC connection may leave open (no Cap'n Proto Finish): each keeps its answer in the RPC
  // system's table. Past it the connection is closed. (th-ctl keeps a few.)
  static constexpr std::uint64_t kRpcOpenQuestionsMax = 4096;
  std::size_t connections_max = 65536;  // th-server lowers it to fit RLIMIT_NOFILE
  // Before the token: how many such connections at once (the oldest is closed to admit a new one),
  // how long each may take, its largest message (a connect is ~100 bytes), and how many wrong
  // tokens it may present before it is closed.
  std::size_t unauthenticated_max = 256;
  std::int64_t auth_deadline_ms = 10'000;
  std::uint64_t unauthenticated_message_words_max = 8192;  // 64 KiB
  std::uint64_t unauthenticated_messages_max = 64;         // a handshake takes 2, then the calls behind it
  std::uint32_t wrong_tokens_per_connection_max = 3;
  // An authenticated connection with no message and no heartbeat datagram for this long is closed
  // (a live client heartbeats several times per heartbeat timeout). 0: 10 x the heartbeat timeout,
  // at least a minute.
  std::int64_t idle_timeout_ms = 0;
  // Heartbeat datagrams read per second at most (a burst of one second's worth is allowed): a flood
  // of UDP datagrams must not take the server's CPU. Past it the socket is left unread (the kernel
  // drops what does not fit its buffer); clients whose beats are lost stay alive by their calls (a
  // quiet client probes the server, which counts as a heartbeat) and go back to heartbeat calls.
  // 0: kHeartbeatDatagramsPerConnectionPerSecond per connection, at least kHeartbeatDatagramsPerSecondFloor.
  std::uint64_t heartbeat_datagrams_per_s_max = 0;
  static constexpr std::uint64_t kHeartbeatDatagramsPerConnectionPerSecond = 8;  // libthclient beats once a second
  static constexpr std::uint64_t kHeartbeatDatagramsPerSecondFloor = 8192;
  // TLS handshakes begun per second at most (each costs the loop a key exchange and a signature);
  // past it, a connection that has sent its first bytes waits for its turn (bounded by the auth
  // deadline). 8,192 clients reconnect in ~4 s.
  std::uint64_t tls_handshakes_per_s_max = 2000;
  // Messages one connection may read before the loop looks at the kernel again (net/fair_stream.h).
  std::uint32_t messages_per_turn = net::FairMessageStream::kMessagesPerTurnDefault;
  std::uint32_t wakeups_per_poll = net::TurnGate::kWakeupsPerPollDefault;
  // The transfer timeline keeps the last this many shard reads (th-server --timeline, th-ctl timeline).
  std::size_t timeline_transfers_max = TransferLedger::kFinishedMaxDefault;
};
Status validate(const ServiceConfig& config);


class HubService final : private kj::TaskSet::ErrorHandler {
 public:
  HubService(ServiceConfig config, kj::Timer& timer, LogLevel log_level);
  ~HubService();
  HubService(const HubService&) = delete;
  HubService& operator=(const HubService&) = delete;

  // Serves connections from `listener` until it is destroyed; also starts the clock.
  kj::Promise<void> serve(kj::ConnectionReceiver& listener);
  // Takes heartbeats as datagrams from `receiver` too, and offers its port to every connection.
  // Call before serve(); without it, clients send heartbeats as calls.
  void serve_heartbeats(kj::UnixEventPort& port, std::unique_ptr<net::HeartbeatReceiver> receiver);
  // Wraps every accepted connection in TLS with `tls` (which must outlive the service); the
  // handshake counts as part of authentication (the auth deadline and the unauthenticated limit
  // bound it). Call before serve().
  void use_tls(kj::TlsContext& tls) { tls_ = &tls; }
  // Framed connections over plain TCP do their own socket I/O on `port`, the loop's (net/frames.h).
  // Call before serve(); without it they go through kj's streams.
  void use_event_port(kj::UnixEventPort& port) { event_port_ = &port; }
  // ---- Operations (server/operations.cpp) ----
  // Serves Prometheus metrics (GET /metrics) on `address` (HOST:PORT; port 0: any) until destroyed:
  // the connections on a thread of their own, each scrape rendered on this loop. kInvalidArgument
  // if the address cannot be bound. Call from the thread that runs this service's loop.
  Status serve_metrics(const std::string& address);
  // Where metrics are served (with the port chosen), or "".
  std::string metrics_address() const;
  // Stops the metrics endpoint while this loop still runs (its thread may cancel a render it
  // asked of this loop). Call before leaving the loop; ~HubService would otherwise do it blind.
  void stop_metrics(kj::WaitScope& wait_scope);
  std::string render_metrics() const;
  // The transfer timeline as Chrome Trace Event JSON (server/chrome_trace.h).
  std::string timeline_json(std::string_view model = {}) const;  // every model's when empty
  std::uint64_t timeline_revision() const { return metrics_.ledger().revision(); }
  // Stops for good: every connection is told (framed: a notice) and closed once what is owed to it
  // is written, so that clients fail over to their next server now rather than at a timeout.
  // Resolves when every connection has closed or after `timeout_ms`. The caller stops accepting
  // first (drops serve()'s promise and its listener).
  kj::Promise<void> drain(std::int64_t timeout_ms);
  bool draining() const { return draining_; }
  // Accepts these tokens from now on (SIGHUP after the token file changed); connections already
  // authenticated stay. At least one, none empty.
  void set_tokens(std::vector<std::string> tokens);


 private:
  struct Connection;
  class HubImpl;
  class SessionImpl;

  void taskFailed(kj::Exception&& exception) override;
  [[noreturn]] void stop_on_bug(const char* loop, const kj::Exception& exception);
  kj::Promise<void> accept_loop(kj::ConnectionReceiver& listener);
  kj::Promise<void> clock_loop();
  kj::Promise<void> heartbeat_loop();
  void on_heartbeat_datagram(const net::HeartbeatDatagram& datagram);
  // Whether the connection's clients may stop sending heartbeats as calls (Session.send's reply).
  bool heartbeat_datagrams_heard(const Connection& connection) const;
  void on_connection(kj::Own<kj::AsyncIoStream> stream);
  // Resolves when a TLS handshake may start (ServiceConfig::tls_handshakes_per_s_max): at once if
  // a turn is free and nobody waits, else in arrival order as turns come.
  kj::Promise<void> handshake_turn();
  kj::Promise<void> dispense_handshake_turns();
  std::deque<kj::Own<kj::PromiseFulfiller<void>>> handshake_waiters_;
  bool dispensing_handshake_turns_ = false;
  // Reads a connection's first 8 bytes from its (clear or TLS) stream: net::kFramedMagic starts a
  // framed connection, anything else Cap'n Proto RPC (the bytes replayed to it).
  kj::Promise<void> start_protocol(std::uint64_t connection_id, kj::Own<kj::AsyncIoStream> stream);
  // Starts the RPC system of a connection.
  void start_rpc(Connection& connection, kj::Own<kj::AsyncIoStream> stream);

  // ---- Framed connections (server/framed_connections.cpp) ----
  void start_framed(Connection& connection, kj::Own<kj::AsyncIoStream> stream);
  // One read from the socket, then take_frames.
  kj::Promise<void> read_frames(std::uint64_t connection_id);
  // Feeds the frames read, a turn's share at a time (the TurnGate between shares).
  kj::Promise<void> take_frames(std::uint64_t connection_id);
  void on_frame(Connection& connection, wire::ClientFrame::Reader frame);
  void on_hello(Connection& connection, wire::Hello::Reader hello);
  // Answers the hello with `why`; the write side closes once it is written (the peer then closes,
  // or the auth deadline or idle timeout does).
  void refuse_hello(Connection& connection, const std::string& why);
  // Marks the connection for write_dirty (at the end of this turn of the loop: what the turn
  // produced for it leaves in one write).
  void schedule_write(Connection& connection);
  void write_dirty();
  // Writes the connection's backlog, ack and notice as frames, unless a write is in flight.
  void write_frames(Connection& connection);
  // A framed connection's peer ended its side: what is owed to it goes out, then it closes.
  void on_framed_end(Connection& connection);
  std::vector<std::uint64_t> dirty_;
  bool write_dirty_scheduled_ = false;
  void on_disconnect(std::uint64_t connection_id);
  // Closes a connection the server gives up on (its client, if any, is lost to the Hub).
  void close_connection(std::uint64_t connection_id, const std::string& why);
  // Closes the oldest connection that has not authenticated; false if there is none.
  bool shed_oldest_unauthenticated();
  // Closes connections past their auth deadline or idle timeout (once a second).
  void sweep_connections();
  std::int64_t idle_timeout_ms() const;
  // Checks a presented cluster token; the first right one authenticates the connection, and too
  // many wrong ones close it.
  bool check_token(Connection& connection, capnp::Text::Reader token);
  // Connect (RPC) or hello (framed): the token, then the client's claim; the refusal's text, if any.
  std::optional<std::string> admit(Connection& connection, capnp::Text::Reader token, capnp::Text::Reader client_name,
                                   ClientId client, kj::ArrayPtr<const kj::byte> secret);
  // The heartbeat channel admit() opened for the connection (none: left unset, port 0).
  void describe_heartbeats(const Connection& connection, wire::HeartbeatChannel::Builder channel) const;
  // A client's claim at connect: binds it to the connection, or refuses with the reason.
  std::optional<std::string> claim_client(Connection& connection, ClientId client, kj::ArrayPtr<const kj::byte> secret);
  // Decodes and feeds a batch from one connection. Returns an error text for the caller if some
  // message was refused (the rest are still fed).
  std::string on_messages(Connection& connection, capnp::List<wire::ToHub>::Reader messages);
  // An empty Session.send: a quiet client asking whether the server is alive.
  void on_probe(Connection& connection);
  // The client's session as its messages show it (for on_probe).
  void note_session(Connection& connection, std::uint64_t session);
  void feed(const Input& input);
  // Logs what a step ended that operators look for: reads revoked at the drain grace, models ended.
  void log_lifecycle(const HubStats& before, const HubStats& after);
  void route(const Effects& effects);
  void flush(Connection& connection);
  TimeMs now_ms() const;
  void log(LogLevel level, const std::string& line, std::string_view component = "server") const;
  std::int64_t now_us() const;
  kj::Promise<void> wait_drained(TimeMs deadline_ms);

  ServiceConfig config_;
  kj::Timer& timer_;
  LogLevel log_level_;
  Hub hub_;
  ServiceMetrics metrics_;
  std::unique_ptr<net::MetricsHttpThread> metrics_http_;
  bool draining_ = false;
  net::TurnGate turn_gate_;
  std::chrono::steady_clock::time_point started_ = std::chrono::steady_clock::now();

  std::unique_ptr<net::HeartbeatReceiver> heartbeat_receiver_;
  kj::Own<kj::UnixEventPort::FdObserver> heartbeat_observer_;
  std::vector<net::HeartbeatDatagram> heartbeat_batch_;  // reused; at most one recvmmsg batch
  std::uint64_t heartbeat_datagrams_ = 0;
  std::uint64_t heartbeat_calls_ = 0;
  std::uint64_t heartbeat_datagrams_refused_ = 0;  // unknown client or wrong secret
  std::uint64_t heartbeat_refusals_unlogged_ = 0;
  // A rate limit: `per_s` a second, in bursts of at most one second's worth.
  struct RateBudget {
    double available = 0;
    TimeMs refilled_ms = 0;
    void fill(TimeMs now, double per_s) {
      available = per_s;
      refilled_ms = now;
    }
    void refill(TimeMs now, double per_s) {
      available = std::min(per_s, available + per_s * static_cast<double>(now - refilled_ms) / 1000.0);
      refilled_ms = now;
    }
  };
  // Datagrams that may be read now (ServiceConfig::heartbeat_datagrams_per_s_max).
  RateBudget heartbeat_budget_;
  std::uint64_t heartbeat_datagrams_per_s() const;
  // TLS handshakes that may start now (ServiceConfig::tls_handshakes_per_s_max).
  RateBudget handshake_budget_;
  TimeMs heartbeat_refusal_logged_ms_ = -1'000'000;

  // Warnings an attacker can provoke at will are counted and logged at most every kSummaryLogMs.
  struct LogSummary {
    std::uint64_t unlogged = 0;
    TimeMs logged_ms = -1'000'000;
  };
  static constexpr TimeMs kSummaryLogMs = 10'000;
  void log_summarised(LogSummary& summary, LogLevel level, const std::string& what, const std::string& last,
                      std::string_view component = "server");
  LogSummary wrong_tokens_log_;
  LogSummary refused_connections_log_;
  LogSummary accept_errors_log_;
  LogSummary foreign_messages_log_;
  LogSummary invalid_messages_log_;
  LogSummary claims_refused_log_;
  LogSummary progress_claims_log_;  // progress reports a read's end belied (HubStats::progress_claims_refuted)
  LogSummary tls_failures_log_;
  LogSummary heartbeat_budget_log_;
  LogSummary handshake_budget_log_;
  kj::TlsContext* tls_ = nullptr;  // owned by whoever called use_tls
  kj::UnixEventPort* event_port_ = nullptr;  // the loop's, for framed connections' own I/O

  std::uint64_t next_connection_id_ = 1;
  std::deque<std::uint64_t> unauthenticated_;  // in accept order; closed or authenticated ones linger
  std::size_t unauthenticated_count_ = 0;
  TimeMs swept_ms_ = 0;
  // Hashed: a heartbeat datagram looks its connection up, 8,192 times a second for 8,192 clients.
  std::unordered_map<std::uint64_t, std::unique_ptr<Connection>> connections_;
  std::unordered_map<ClientId, std::uint64_t> client_connection_;  // client -> connection id
  // After its connection closed, a client's id stays reserved to its secret for a while, so that
  // nobody who saw the id (heartbeat datagrams carry it in clear) claims it before the handle
  // reconnects. At most connections_max entries; expired ones go at the sweep.
  struct RememberedClaim {
    std::string secret;
    TimeMs until_ms = 0;
  };
  std::unordered_map<ClientId, RememberedClaim> remembered_claims_;
  void remember_claim(ClientId client, std::string secret);
  kj::TaskSet tasks_;
};

}  // namespace th::server
