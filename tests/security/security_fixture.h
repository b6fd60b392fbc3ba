// The fixture of the security suite (label security): real th-server and worker processes on
// loopback (tests/e2e/fixture.h), with what the attacks need to observe them.
#pragma once

#include <kj/async-io.h>
#include <poll.h>
#include <sys/socket.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <fstream>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "fixture.h"
#include "net/socket.h"

namespace th::e2e {

// How long a test waits for something that must happen "promptly" before calling it a hang. Not a
// speed claim: a bound that turns a hang into a failure.
constexpr int kHangGuardMs = 20'000;

class Security : public ProcessTest {
 protected:
  kj::AsyncIoContext& io() {
    if (!io_) io_.emplace(kj::setupAsyncIo());
    return *io_;
  }


  // A field of /proc/PID/status in kB (VmSize, VmRSS) or as a count (Threads).
  static long status_field(int pid, const std::string& field) {
    std::ifstream status("/proc/" + std::to_string(pid) + "/status");
    for (std::string line; std::getline(status, line);) {
      if (line.rfind(field + ":", 0) == 0) return std::stol(line.substr(field.size() + 1));
    }
    return -1;
  }

  // The server's stderr so far.
  std::string server_log(const Process& server) const {
    std::ifstream log(log_path_of(server));
    std::stringstream text;
    text << log.rdbuf();
    return text.str();
  }

  // Whether the server's stderr says `text` within `timeout_ms`: the server writes a line about a
  // connection it closes after closing it, so a test that saw the close may read the log first.
  bool server_log_says(const Process& server, const std::string& text, int timeout_ms) const {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
    for (;;) {
      if (server_log(server).find(text) != std::string::npos) return true;
      if (std::chrono::steady_clock::now() >= deadline) return false;
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
  }

  std::string log_path_of(const Process& server) const {
    for (std::size_t i = 0; i < processes_.size(); ++i) {
      if (processes_[i].get() == &server) return (dir_ / ("server-" + std::to_string(i) + ".log")).string();
    }
    return "";
  }

  // Waits until the peer closes every socket (EOF or reset); returns how many are still open when
  // the guard passes (one guard for all of them).
  static std::size_t open_after(const std::vector<net::Fd>& sockets, int guard_ms = kHangGuardMs) {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(guard_ms);
    std::vector<bool> closed(sockets.size(), false);
    std::size_t open = sockets.size();
    while (open > 0) {
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
      if (left.count() <= 0) break;
      std::vector<pollfd> pollers;
      std::vector<std::size_t> index;
      for (std::size_t i = 0; i < sockets.size(); ++i) {
        if (closed[i]) continue;
        pollers.push_back({sockets[i].get(), POLLIN, 0});
        index.push_back(i);
      }
      if (::poll(pollers.data(), pollers.size(), static_cast<int>(std::min<long>(left.count(), 100))) <= 0) continue;
      for (std::size_t k = 0; k < pollers.size(); ++k) {
        if (pollers[k].revents == 0) continue;
        char bytes[4096];
        const ssize_t got = ::recv(pollers[k].fd, bytes, sizeof bytes, MSG_DONTWAIT);
        if (got == 0 || (got < 0 && errno != EAGAIN && errno != EINTR)) {
          closed[index[k]] = true;
          --open;
        }
      }
    }
    return open;
  }

  std::optional<kj::AsyncIoContext> io_;
};

}  // namespace th::e2e
