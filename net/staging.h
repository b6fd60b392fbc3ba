// Pinned host staging for GPU memory on the TCP data plane (issue 15).
//
// A socket cannot send from or receive into GPU memory, so a region on a device travels through a
// ring of pinned host slots: a source copies the next pieces device-to-host while it sends the
// current one, a reader receives the next piece while the current one is copied host-to-device.
// With S slots, up to S - 1 copies run ahead of (drain) or behind (fill) the socket, so the copy
// engine and the network overlap and neither waits for the other but at the ends.
//
// The copies themselves are a CopyLane's (client/cuda makes CUDA's: one stream of its own per
// lane, an event per copy); this file is the ring's logic, which tests drive with a fake lane that
// performs each copy only when it is waited for, so that a slot reused too early shows as wrong
// bytes.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <span>
#include <stdexcept>
#include <vector>

namespace th::net {

// The device failed a copy (an error of the CUDA runtime): logistics, like a socket error.
struct DeviceCopyError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// Copies between device memory and pinned host memory, run in the order they were started.
// One thread uses a lane at a time.
class CopyLane {
 public:
  using Ticket = std::uint64_t;
  virtual ~CopyLane() = default;
  // Start a copy and return at once.
  virtual Ticket to_host(std::byte* host, const std::byte* device, std::uint64_t bytes) = 0;
  virtual Ticket to_device(std::byte* device, const std::byte* host, std::uint64_t bytes) = 0;
  // Blocks until the copy `ticket`, and every copy started before it, completed. Throws
  // DeviceCopyError if one failed.
  virtual void wait(Ticket ticket) = 0;
};

// What rings are made of: lanes and pinned host memory (client/cuda supplies CUDA's).
class StagingProvider {
 public:
  virtual ~StagingProvider() = default;
  virtual std::unique_ptr<CopyLane> make_lane() = 0;  // throws DeviceCopyError
  // Page-locked host memory, so that copies to and from it run asynchronously at full speed.
  virtual std::shared_ptr<std::byte[]> allocate_pinned(std::uint64_t bytes) = 0;  // throws DeviceCopyError
};

struct StagingConfig {
  std::uint32_t slots = 4;                 // per ring: up to slots - 1 copies overlap the socket
  std::uint64_t slot_bytes = 2ull << 20;   // a piece: the unit of a copy and of a send or receive
  // Rings at once (each slots * slot_bytes of pinned memory, made when first needed and kept):
  // one per connection serving GPU memory, one per stream of a pull into it.
  std::uint32_t rings_max = 16;
  int ring_wait_ms_max = 10'000;           // a connection waits this long for a ring, then fails
};

class StagingRing {
 public:
  StagingRing(std::unique_ptr<CopyLane> lane, std::shared_ptr<std::byte[]> memory, std::uint32_t slots,
              std::uint64_t slot_bytes);

  // Device to consumer: copies [device, +bytes) to the host piece by piece and calls consume()
  // on each piece in order. If consume() throws, the copies in flight are waited for (they write
  // the ring, and may read memory whose owner takes it back once this returns), then it rethrows.
  void drain(const std::byte* device, std::uint64_t bytes,
             const std::function<void(std::span<const std::byte>)>& consume);
  // Producer to device: produce() fills each piece in order; its copy to [device, +bytes) starts at
  // once and runs while the next piece is produced. Returns once every byte is on the device. If
  // produce() throws, the copies in flight are waited for, then it rethrows: nothing writes the
  // device after either return.
  void fill(std::byte* device, std::uint64_t bytes, const std::function<void(std::span<std::byte>)>& produce);

  std::uint32_t slots() const { return slots_; }
  std::uint64_t slot_bytes() const { return slot_bytes_; }

 private:
  std::byte* slot(std::uint64_t piece) const { return memory_.get() + (piece % slots_) * slot_bytes_; }
  // Waits for every copy started and not yet waited for; during unwinding, swallows a device error
  // (the exception in flight is the one to report).
  void settle(std::uint64_t last_ticket, bool unwinding);

  // The memory first: destroyed after the lane, whose end waits for the copies that use it.
  std::shared_ptr<std::byte[]> memory_;
  std::unique_ptr<CopyLane> lane_;
  const std::uint32_t slots_;
  const std::uint64_t slot_bytes_;
};

// The rings of one data server or reader, lent to one user at a time. Bounded: rings_max rings
// exist at most; a borrower waits up to ring_wait_ms_max for one to come back.
class StagingPool {
 public:
  StagingPool(std::shared_ptr<StagingProvider> provider, StagingConfig config);

  class Loan {
   public:
    Loan() = default;
    Loan(Loan&& other) noexcept;
    Loan& operator=(Loan&& other) noexcept;
    ~Loan();
    StagingRing* operator->() const { return ring_.get(); }
    StagingRing& operator*() const { return *ring_; }
    explicit operator bool() const { return ring_ != nullptr; }

   private:
    friend class StagingPool;
    Loan(StagingPool* pool, std::unique_ptr<StagingRing> ring) : pool_(pool), ring_(std::move(ring)) {}
    void give_back();
    StagingPool* pool_ = nullptr;
    std::unique_ptr<StagingRing> ring_;
  };

  // A ring, made if none is free and fewer than rings_max exist. Throws DeviceCopyError if none
  // came back in ring_wait_ms_max, or the provider failed to make one. Returns an empty loan as
  // soon as `give_up` holds (looked at every kGiveUpPollMs while it waits): a revoked grant or a
  // cancelled pull must not keep its thread, nor whoever waits for that thread, for long.
  Loan borrow(const std::function<bool()>& give_up = nullptr);
  static constexpr int kGiveUpPollMs = 50;
  const StagingConfig& config() const { return config_; }
  std::uint32_t rings_made() const;

 private:
  std::shared_ptr<StagingProvider> provider_;
  const StagingConfig config_;
  mutable std::mutex mutex_;
  std::condition_variable returned_;
  std::vector<std::unique_ptr<StagingRing>> idle_;  // guarded by mutex_
  std::uint32_t made_ = 0;                          // guarded by mutex_; at most rings_max
};

}  // namespace th::net
