// tcp_ceiling (issue 34, deliverable 4): what one loopback TCP stream moves with nothing of
// TensorHub's around it, so that th-bench pair can be compared with the floor of its own work and
// not only with iperf3. One sender thread send()s 1 MiB at a time, one receiver thread recv()s
// 256 KiB at a time and hashes each piece as it arrives (client/checksum.h's blocks, the reader's
// hasher); `--span-bytes` is the memory the bytes come from and go to, reused until `--bytes` moved:
// 1 MiB is iperf3's case (one buffer, always in cache), a version's size a weight transfer's (every
// byte read from and written to memory once).
//
// Prints "RESULT ceiling_span_bytes=S ceiling_gbps=G ceiling_hash=0|1" (the median of --rounds).
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstring>
#include <iomanip>
#include <iostream>
#include <memory>
#include <stdexcept>
#include <string>
#include <system_error>
#include <thread>
#include <vector>

#include "client/checksum.h"
#include "net/socket.h"

namespace {

constexpr std::size_t kSendBytes = std::size_t{1} << 20;
constexpr std::size_t kReceiveBytes = std::size_t{256} << 10;

using th::net::Fd;  // (the project's owner of a descriptor: closed when it goes out of scope)

// A new TCP socket, or the error.
Fd tcp_socket() {
  Fd socket(::socket(AF_INET, SOCK_STREAM, 0));
  if (!socket.valid()) throw std::system_error(errno, std::generic_category(), "socket");
  return socket;
}

void check(bool ok, const char* what) {
  if (!ok) throw std::system_error(errno, std::generic_category(), what);
}

// One run: seconds to move `bytes` from `source` to `target` (each `span` bytes, reused); `digest`:
// the blocks' digests folded (printed, so that the hashing is not optimised away).
double move_once(const std::byte* source, std::byte* target, std::size_t span, std::uint64_t bytes, bool hash,
                 std::uint64_t& digest) {
  const Fd listener = tcp_socket();
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  check(::bind(listener.get(), reinterpret_cast<sockaddr*>(&address), sizeof address) == 0, "bind");
  check(::listen(listener.get(), 1) == 0, "listen");
  socklen_t length = sizeof address;
  check(::getsockname(listener.get(), reinterpret_cast<sockaddr*>(&address), &length) == 0, "getsockname");
  // accept() gives up after this: a sender that could not connect must not leave us waiting.
  const timeval accept_timeout{10, 0};
  check(::setsockopt(listener.get(), SOL_SOCKET, SO_RCVTIMEO, &accept_timeout, sizeof accept_timeout) == 0,
        "setsockopt");

  std::thread sender([&] {
    const Fd connection = tcp_socket();
    if (::connect(connection.get(), reinterpret_cast<sockaddr*>(&address), sizeof address) != 0) return;
    for (std::uint64_t sent = 0; sent < bytes;) {
      const std::size_t at = sent % span;
      const std::size_t piece = std::min<std::uint64_t>({kSendBytes, bytes - sent, span - at});
      const ssize_t done = ::send(connection.get(), source + at, piece, MSG_NOSIGNAL);
      if (done <= 0) return;
      sent += static_cast<std::uint64_t>(done);
    }
  });
  const int accepted = ::accept(listener.get(), nullptr, nullptr);
  if (accepted < 0) {
    const int error = errno;
    sender.join();
    throw std::system_error(error, std::generic_category(), "accept");
  }
  const Fd connection(accepted);
  th::client_impl::BlockHasher hasher;
  std::uint64_t digests = 0;
  const auto started = std::chrono::steady_clock::now();
  for (std::uint64_t received = 0; received < bytes;) {
    const std::size_t at = received % span;
    const std::size_t piece = std::min<std::uint64_t>({kReceiveBytes, bytes - received, span - at});
    for (std::size_t got = 0; got < piece;) {
      const ssize_t done = ::recv(connection.get(), target + at + got, piece - got, 0);
      if (done <= 0) {
        sender.join();
        throw std::runtime_error("the sender stopped early");
      }
      got += static_cast<std::size_t>(done);
    }
    if (hash) {
      if (hasher.fed_bytes() + piece > th::client_impl::kChecksumBlockBytes) digests ^= hasher.finish();
      hasher.update(target + at, piece);
    }
    received += piece;
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  sender.join();
  digest = digests ^ hasher.finish();
  return seconds;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"One loopback TCP stream with nothing around it: the floor th-bench pair is measured against"};
  std::uint64_t span_bytes = kSendBytes;
  double gib = 4;
  int rounds = 3;
  bool hash = true;
  app.add_option("--span-bytes", span_bytes, "Memory the bytes come from and go to (1 MiB: iperf3's case; a version's size)")
      ->check(CLI::Range(std::uint64_t{1} << 20, std::uint64_t{64} << 30));
  app.add_option("--gib", gib, "GiB to move per round")->check(CLI::Range(0.01, 64.0));
  app.add_option("--rounds", rounds, "Rounds; the median is reported")->check(CLI::Range(1, 100));
  app.add_flag("!--no-hash", hash, "Do not hash what arrives (the reader's checksum blocks)");
  CLI11_PARSE(app, argc, argv);

  const auto bytes = static_cast<std::uint64_t>(gib * double(1ull << 30));
  std::vector<std::byte> source(span_bytes);
  std::vector<std::byte> target(span_bytes);
  for (std::size_t i = 0; i < span_bytes; ++i) source[i] = static_cast<std::byte>(i * 2654435761u >> 13);
  std::vector<double> gbps;
  for (int round = 0; round < rounds; ++round) {
    std::uint64_t digest = 0;
    gbps.push_back(double(bytes) / move_once(source.data(), target.data(), span_bytes, bytes, hash, digest) / 1e9);
    std::cout << std::fixed << std::setprecision(3) << "round " << round + 1 << ": " << gbps.back() << " GB/s (digests "
              << std::hex << digest << std::dec << ")\n";
  }
  std::sort(gbps.begin(), gbps.end());
  std::cout << "RESULT ceiling_span_bytes=" << span_bytes << " ceiling_gbps=" << std::setprecision(3)
            << gbps[gbps.size() / 2] << " ceiling_hash=" << (hash ? 1 : 0) << std::endl;
  return 0;
}
