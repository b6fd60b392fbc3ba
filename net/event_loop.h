// A kj event loop that stays fair under load.
//
// kj's wait loop asks the kernel for new I/O once its queue of ready events is empty, unless told to
// poll every so many events (WaitScope::setBusyPollInterval, off by default in Cap'n Proto 0.9.2).
// Reads that find data already buffered complete without the kernel, so a few busy connections can
// keep the queue non-empty for a long time: a newly connecting client, the timer and every quieter
// connection then wait (measured: over a minute). FairLoop polls the kernel, without sleeping, every
// `turns_per_poll` events, so new readiness queues up behind the busy connections instead of after
// them.
#pragma once

#include <kj/async-io.h>
#include <kj/async-unix.h>

namespace th::net {

class FairLoop {
 public:
  static constexpr unsigned kTurnsPerPollDefault = 64;

  explicit FairLoop(unsigned turns_per_poll = kTurnsPerPollDefault) : io_(kj::setupAsyncIo()) {
    io_.waitScope.setBusyPollInterval(turns_per_poll);
  }

  kj::AsyncIoProvider& io() { return *io_.provider; }
  kj::Timer& timer() { return io_.provider->getTimer(); }
  kj::UnixEventPort& port() { return io_.unixEventPort; }
  kj::WaitScope& wait_scope() { return io_.waitScope; }

 private:
  kj::AsyncIoContext io_;
};

}  // namespace th::net
