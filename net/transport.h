// The data plane behind one interface, so that libthclient does not care how bytes move.
//
// One transport per shard both serves this shard's regions under the hub's grants and pulls a
// source's regions into local memory. TcpTransport (below, over net/data_plane.h) is the one every
// peer has; one-sided RDMA reads (rdma/) slot in behind the same calls where both ends have a
// device. The calls keep the shape of RDMA on purpose (see net/data_plane.h): grant ~ register and
// hand out a key, pull ~ READs into local memory, revoke ~ invalidate, after which the owner may
// change or free the memory.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <span>
#include <string_view>
#include <vector>

#include "core/types.h"
#include "net/data_plane.h"
#include "net/socket.h"

namespace th::net {

struct TransportStats {
  std::uint64_t bytes_served = 0;          // sent by this source's CPU (TCP); one-sided reads are not seen
  std::uint64_t pulls_rdma = 0;            // pulls done with one-sided RDMA reads
  std::uint64_t pulls_striped = 0;         // of those, over several devices at once
  std::uint64_t pulls_tcp = 0;             // pulls over TCP
  std::uint64_t pulls_fell_back = 0;       // of those, because the source could not do RDMA
  std::uint64_t memory_registrations = 0;  // ibv_reg_mr calls (grows with allocations, not versions)
  std::uint64_t windows_bound = 0;         // memory windows bound for grants (one per grant and region)
  std::uint64_t windows_invalidated = 0;   // of those, invalidated by a revoke or a reader's close
  std::vector<std::uint64_t> bytes_read_per_device;  // pulled through each RDMA device in use
  std::uint64_t device_registrations = 0;  // GPU allocations registered with a NIC (in memory_registrations too)
  std::string device_registration;         // how GPU memory is registered: "dma-buf", "peermem", "staging"
};

class DataTransport {
 public:
  virtual ~DataTransport() = default;

  // What this transport is ("tcp", "rdma"): logged, and named in the handle's stats.
  virtual std::string_view kind() const = 0;
  // Where peers reach this shard's data.
  virtual Endpoint endpoint() const = 0;

  // Serving. Exposes `regions` (in layout order) to the read that presents `secret` under `key`;
  // they must stay alive and unchanged (up to `progress`) until revoke(key) returns. Granting a key
  // twice is a bug.
  virtual void grant(GrantKey key, const GrantSecret& secret, std::vector<ExposedRegion> regions,
                     std::shared_ptr<Progress> progress) = 0;
  // Withdraws the grant without waiting for any reader: reads in flight under it fail, later ones
  // are refused. Unknown keys are ignored.
  virtual void revoke(GrantKey key) = 0;
  virtual TransportStats stats() const = 0;

  // The owner of [base, +bytes) lends it to the data plane until the returned lease is dropped
  // (null: this transport keeps nothing). Meanwhile the transport may register it, or a run of
  // adjacent leased memory around it, with the NIC once and reuse that for every grant and pull;
  // dropping the lease drops every registration that covers it. Drop it before freeing the memory:
  // a registration pins the physical pages it was made on, and a reused address would read stale.
  // `on_device`: GPU memory (see ExposedRegion).
  virtual std::shared_ptr<void> lease_memory(const std::byte* base, std::uint64_t bytes, bool on_device) {
    (void)base;
    (void)bytes;
    (void)on_device;
    return nullptr;
  }

  // Reading. Pulls every byte of the regions `source` exposes under `key` into `targets` (same
  // sizes, same order), straight into them. A failed source is an outcome, not an exception.
  virtual PullOutcome pull(const Endpoint& source, GrantKey key, const GrantSecret& secret,
                           std::span<const LocalRegion> targets, const PullOptions& options) = 0;
};

// The TCP data plane: a DataServer for serving, net::pull for reading.
class TcpTransport final : public DataTransport {
 public:
  // Listens at once; throws SocketError if the address cannot be bound.
  explicit TcpTransport(DataServerConfig config) : server_(std::move(config)) {}

  std::string_view kind() const override { return "tcp"; }
  Endpoint endpoint() const override { return server_.endpoint(); }
  void grant(GrantKey key, const GrantSecret& secret, std::vector<ExposedRegion> regions,
             std::shared_ptr<Progress> progress) override {
    server_.grant(key, secret, std::move(regions), std::move(progress));
  }
  void revoke(GrantKey key) override { server_.revoke(key); }
  TransportStats stats() const override {
    TransportStats stats;
    stats.bytes_served = server_.stats().bytes_served;
    stats.pulls_tcp = pulls_.load();
    return stats;
  }
  PullOutcome pull(const Endpoint& source, GrantKey key, const GrantSecret& secret,
                   std::span<const LocalRegion> targets, const PullOptions& options) override {
    ++pulls_;
    return net::pull(source, key, secret, targets, options);
  }

 private:
  DataServer server_;
  std::atomic<std::uint64_t> pulls_{0};
};

}  // namespace th::net
