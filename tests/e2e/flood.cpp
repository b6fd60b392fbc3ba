// th-e2e-flood: floods a th-server's heartbeat port with UDP datagrams, as an attacker on the network
// would, for the security suite and bench/run-heartbeat-flood.
//
// The datagrams are well formed (format 2: the server parses each, looks its client up and, for a
// client it knows, checks the MAC) but sealed with keys the attacker made up, so the server must
// refuse every one. Sent with sendmmsg in batches, as fast as the machine allows or paced to --rate.
// Prints "flood sent N" every second and at the end.
#include <CLI/CLI.hpp>
#include <netdb.h>
#include <sys/socket.h>

#include <chrono>
#include <cerrno>
#include <cstring>
#include <iostream>
#include <random>
#include <thread>
#include <vector>

#include "net/heartbeat.h"
#include "net/socket.h"

namespace {

constexpr std::size_t kBatch = 64;

// A UDP socket connected to `to`; the flood needs sendmmsg, which libthclient's sender does not.
th::net::Fd connected_udp(const th::net::Endpoint& to) {
  auto info = th::net::resolve(to, SOCK_DGRAM, false);
  th::net::Fd socket(::socket(info->ai_family, SOCK_DGRAM | SOCK_CLOEXEC, info->ai_protocol));
  if (!socket.valid() || ::connect(socket.get(), info->ai_addr, info->ai_addrlen) != 0) {
    throw th::net::SocketError(std::string("udp to ") + to.to_string() + ": " + std::strerror(errno));
  }
  return socket;
}

// Sends the batch with one sendmmsg; returns how many datagrams the kernel took.
std::size_t send_batch(const th::net::Fd& socket, std::vector<th::net::HeartbeatBytes>& batch) {
  std::vector<iovec> vectors(batch.size());
  std::vector<mmsghdr> headers(batch.size());
  for (std::size_t i = 0; i < batch.size(); ++i) {
    vectors[i] = iovec{batch[i].data(), batch[i].size()};
    headers[i] = mmsghdr{};
    headers[i].msg_hdr.msg_iov = &vectors[i];
    headers[i].msg_hdr.msg_iovlen = 1;
  }
  const int taken = ::sendmmsg(socket.get(), headers.data(), static_cast<unsigned>(headers.size()), 0);
  return taken > 0 ? static_cast<std::size_t>(taken) : 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"th-e2e-flood: floods a th-server heartbeat port with forged UDP datagrams"};
  std::string to;
  double seconds = 5;
  std::uint64_t rate_per_s = 0;
  std::vector<std::uint64_t> clients;
  app.add_option("--to", to, "the server's heartbeat port, HOST:PORT (the control port's number)")->required();
  app.add_option("--seconds", seconds, "how long")->capture_default_str()->check(CLI::Range(0.1, 3600.0));
  app.add_option("--rate", rate_per_s, "datagrams per second (0: as fast as possible)")->capture_default_str();
  app.add_option("--client", clients, "client ids to forge datagrams for (default: random ids)");
  CLI11_PARSE(app, argc, argv);

  const th::net::Fd socket = connected_udp(th::net::parse_endpoint(to));
  std::mt19937_64 random(std::random_device{}());
  std::vector<th::net::HeartbeatBytes> batch(kBatch);
  std::uint64_t sent = 0;
  std::uint64_t count = 1;
  const auto start = std::chrono::steady_clock::now();
  auto reported = start;
  for (;;) {
    const auto now = std::chrono::steady_clock::now();
    const double elapsed_s = std::chrono::duration<double>(now - start).count();
    if (elapsed_s >= seconds) break;
    if (now - reported >= std::chrono::seconds(1)) {
      std::cout << "flood sent " << sent << std::endl;
      reported = now;
    }
    if (rate_per_s > 0 && static_cast<double>(sent) >= elapsed_s * static_cast<double>(rate_per_s)) {
      std::this_thread::sleep_for(std::chrono::microseconds(200));
      continue;
    }
    for (auto& bytes : batch) {
      const th::ClientId client = clients.empty() ? random() : clients[count % clients.size()];
      bytes = th::net::encode(th::net::seal(client, 1, count++, th::net::HeartbeatKey{random(), random()}));
    }
    sent += send_batch(socket, batch);
  }
  std::cout << "flood sent " << sent << std::endl;
  return 0;
}
