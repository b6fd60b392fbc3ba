// The kj event loop of th-server and libthclient, with one tuning knob.
//
// kj's wait loop asks the kernel for new I/O once its queue of ready events is empty, unless told
// to poll every so many events (WaitScope::setBusyPollInterval). Polling while busy looks like the
// cure for a server whose queue never empties (new connections would wait for ever), but measured
// here it hurts: Cap'n Proto 0.9.2 flushes outgoing RPC messages from an evalLast() callback, which
// runs only when the queue drains, so the more often the loop polls while busy, the longer every
// reply waits. With 1,000 clients keeping 8 calls each in flight (tests/e2e/fairness_test.cpp), a
// new client's open took a median of 4 ms with no busy polling and 180-370 ms when polling every
// 64 to 1,024 events (bench/results/fairness-*.md). So the default is kj's own behaviour (0); the
// knob stays for experiments (th-server --turns-per-poll). Fairness between th-server's connections
// is net/fair_stream.h's job.
#pragma once

#include <kj/async-io.h>
#include <kj/async-unix.h>

namespace th::net {

class IoLoop {
 public:
  static constexpr unsigned kTurnsPerPollDefault = 0;

  // turns_per_poll 0: poll the kernel only when idle (kj's default).
  explicit IoLoop(unsigned turns_per_poll = kTurnsPerPollDefault) : io_(kj::setupAsyncIo()) {
    if (turns_per_poll > 0) io_.waitScope.setBusyPollInterval(turns_per_poll);
  }

  kj::AsyncIoProvider& io() { return *io_.provider; }
  kj::Timer& timer() { return io_.provider->getTimer(); }
  kj::UnixEventPort& port() { return io_.unixEventPort; }
  kj::WaitScope& wait_scope() { return io_.waitScope; }

 private:
  kj::AsyncIoContext io_;
};

}  // namespace th::net
