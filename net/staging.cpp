#include "net/staging.h"

#include <algorithm>
#include <chrono>
#include <utility>

#include "core/assert.h"

namespace th::net {

StagingRing::StagingRing(std::unique_ptr<CopyLane> lane, std::shared_ptr<std::byte[]> memory, std::uint32_t slots,
                         std::uint64_t slot_bytes)
    : memory_(std::move(memory)), lane_(std::move(lane)), slots_(slots), slot_bytes_(slot_bytes) {
  TH_REQUIRE(lane_ != nullptr && memory_ != nullptr);
  // Two slots at least: with one, the copy and the socket would take turns.
  TH_REQUIRE(slots_ >= 2 && slot_bytes_ > 0, "slots", slots_, "slot_bytes", slot_bytes_);
}

void StagingRing::settle(std::uint64_t last_ticket, bool unwinding) {
  if (!unwinding) return lane_->wait(last_ticket);
  try {
    lane_->wait(last_ticket);
  } catch (const DeviceCopyError&) {
    // The consumer's or producer's own exception is the one the caller must see.
  }
}

void StagingRing::drain(const std::byte* device, std::uint64_t bytes,
                        const std::function<void(std::span<const std::byte>)>& consume) {
  TH_REQUIRE(device != nullptr || bytes == 0);
  const std::uint64_t pieces = (bytes + slot_bytes_ - 1) / slot_bytes_;
  auto piece_bytes = [&](std::uint64_t piece) { return std::min(slot_bytes_, bytes - piece * slot_bytes_); };
  std::vector<CopyLane::Ticket> tickets(slots_);  // [piece % slots]: the copy into that slot
  std::uint64_t started = 0;                       // pieces whose copy was started
  try {
    for (std::uint64_t piece = 0; piece < pieces; ++piece) {
      // Every slot busy: the slots of the pieces consumed so far are free again.
      for (; started < pieces && started < piece + slots_; ++started) {
        tickets[started % slots_] = lane_->to_host(slot(started), device + started * slot_bytes_, piece_bytes(started));
      }
      lane_->wait(tickets[piece % slots_]);
      consume({slot(piece), piece_bytes(piece)});
    }
  } catch (...) {
    // The copies already started read the device and write the ring: both must be over before
    // the caller (who may hand the memory back once this returns) goes on.
    if (started > 0) settle(tickets[(started - 1) % slots_], /*unwinding=*/true);
    throw;
  }
  TH_ASSERT(started == pieces);
}

void StagingRing::fill(std::byte* device, std::uint64_t bytes, const std::function<void(std::span<std::byte>)>& produce) {
  TH_REQUIRE(device != nullptr || bytes == 0);
  const std::uint64_t pieces = (bytes + slot_bytes_ - 1) / slot_bytes_;
  std::vector<CopyLane::Ticket> tickets(slots_);  // [piece % slots]: the copy out of that slot
  std::uint64_t started = 0;                       // pieces whose copy to the device was started
  try {
    for (std::uint64_t piece = 0; piece < pieces; ++piece) {
      // The slot's previous piece must have left it before this one is written there.
      if (piece >= slots_) lane_->wait(tickets[piece % slots_]);
      const std::uint64_t length = std::min(slot_bytes_, bytes - piece * slot_bytes_);
      produce({slot(piece), length});
      tickets[piece % slots_] = lane_->to_device(device + piece * slot_bytes_, slot(piece), length);
      started = piece + 1;
    }
  } catch (...) {
    if (started > 0) settle(tickets[(started - 1) % slots_], /*unwinding=*/true);
    throw;
  }
  if (pieces > 0) settle(tickets[(pieces - 1) % slots_], /*unwinding=*/false);
}

// ---- StagingPool -----------------------------------------------------------------------------------

StagingPool::StagingPool(std::shared_ptr<StagingProvider> provider, StagingConfig config)
    : provider_(std::move(provider)), config_(config) {
  TH_REQUIRE(provider_ != nullptr);
  TH_REQUIRE(config_.slots >= 2 && config_.slot_bytes > 0 && config_.rings_max > 0 && config_.ring_wait_ms_max >= 0);
}

StagingPool::Loan StagingPool::borrow(const std::function<bool()>& give_up) {
  std::unique_lock lock(mutex_);
  auto available = [&] { return !idle_.empty() || made_ < config_.rings_max; };
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(config_.ring_wait_ms_max);
  while (!available() && std::chrono::steady_clock::now() < deadline) {
    if (give_up && give_up()) return Loan();
    returned_.wait_until(lock, std::min(deadline, std::chrono::steady_clock::now() +
                                                      std::chrono::milliseconds(kGiveUpPollMs)));
  }
  if (!available()) {
    throw DeviceCopyError("no staging ring came free in " + std::to_string(config_.ring_wait_ms_max) + " ms (" +
                          std::to_string(config_.rings_max) + " in use)");
  }
  if (!idle_.empty()) {
    std::unique_ptr<StagingRing> ring = std::move(idle_.back());
    idle_.pop_back();
    return Loan(this, std::move(ring));
  }
  ++made_;  // counted before the allocation, which happens unlocked (pinning takes milliseconds)
  lock.unlock();
  try {
    auto ring = std::make_unique<StagingRing>(provider_->make_lane(),
                                              provider_->allocate_pinned(config_.slots * config_.slot_bytes),
                                              config_.slots, config_.slot_bytes);
    return Loan(this, std::move(ring));
  } catch (...) {
    lock.lock();
    --made_;
    returned_.notify_one();
    throw;
  }
}

std::uint32_t StagingPool::rings_made() const {
  std::lock_guard lock(mutex_);
  return made_;
}

StagingPool::Loan::Loan(Loan&& other) noexcept
    : pool_(std::exchange(other.pool_, nullptr)), ring_(std::move(other.ring_)) {}

StagingPool::Loan& StagingPool::Loan::operator=(Loan&& other) noexcept {
  if (this != &other) {
    give_back();
    pool_ = std::exchange(other.pool_, nullptr);
    ring_ = std::move(other.ring_);
  }
  return *this;
}

StagingPool::Loan::~Loan() { give_back(); }

void StagingPool::Loan::give_back() {
  if (pool_ == nullptr || ring_ == nullptr) return;
  {
    std::lock_guard lock(pool_->mutex_);
    pool_->idle_.push_back(std::move(ring_));
  }
  pool_->returned_.notify_one();
  pool_ = nullptr;
}

}  // namespace th::net
