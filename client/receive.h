// libthclient's streaming receive (not installed): what a replicate or update in flight shares
// between the application (Receive: next, wait, cancel), the I/O thread (the call's answer) and the
// reader thread (the bytes and their checksums).
//
// A read of the buffers (a ReadAttempt: one source, one epoch) checks its tensors unit by unit: the
// packed small tensors, in the order of the packed region, make units of about kPackedUnitBytes
// (each scattered and checked once its part of the region has arrived, so that a model of small
// tensors streams too), each big tensor is a unit of its own. A unit is checked once per attempt, by whichever
// thread gets to it first: the application's next() as soon as the unit's bytes are in (so that
// hashing overlaps the transfer), else the reader thread once the pull is done. The call is
// answered only after every unit of the last attempt was checked, as before streaming.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <vector>

#include "client/checksum.h"
#include "client/plan.h"
#include "core/messages.h"
#include "tensorhub/client.h"

namespace th {
namespace client_impl {

// A unit of packed tensors closes once it holds this many bytes: small enough that a region of
// hundreds of megabytes of small tensors streams, large enough that a unit's one wait for its
// copies to a GPU is not paid per tensor.
inline constexpr std::uint64_t kPackedUnitBytes = std::uint64_t{4} << 20;

struct ReadAttempt {
  enum class Unit : std::uint8_t { kPending, kChecking, kGood, kBad };

  // `scatter`: copy the packed tensors from the packed region into their own buffers (a seed copy
  // keeps them where they arrived).
  ReadAttempt(Plan plan, std::byte* packed, ChecksumsRef checksums, Version version, bool scatter);

  // Scatters (if packed) and checks unit `unit` against the checksums; no lock held. Returns the
  // layout index of the first tensor that does not match, if one does not.
  std::optional<std::size_t> check(std::size_t unit) const;
  // Hashes the checksum blocks of the host-memory tensors with a region of their own (plan.big)
  // that lie wholly below `ready` and were not hashed yet, so that their units are then checked
  // from these digests (client/checksum.h: a tensor's checksum is the hash of its blocks'
  // digests) instead of by a second pass over memory. Called by whoever tells the read's progress,
  // right after the bytes arrived (still in cache), one call at a time; bytes below `ready` are
  // final for this attempt (net::PullOptions::on_progress's prefix).
  void hash_arrived(std::uint64_t ready);
  // A resumed attempt: hashing starts at the unit that holds byte `start_bytes` (those before it
  // were verified by the earlier attempt). Before the pull begins.
  void hash_from(std::uint64_t start_bytes);
  std::size_t unit_of(std::size_t tensor) const { return tensor_unit[tensor]; }
  // What failed on this host's GPU while checking, if anything did ("" otherwise).
  std::string device_failure() const {
    std::lock_guard lock(device_error_mutex);
    return device_error;
  }

  const client_impl::Plan plan;
  std::byte* const packed;
  const ChecksumsRef checksums;
  const Version version;
  const bool scatter;
  // Units 0 .. packed_units - 1 hold the packed tensors, if there are any (even of 0 bytes each);
  // the big tensors' units follow, in plan.big's order.
  std::size_t packed_units = 0;
  std::vector<std::uint64_t> unit_end;     // where each unit's bytes end on the data plane
  std::vector<std::size_t> tensor_unit;    // per layout index
  // Guarded by the Receive::State's mutex.
  std::vector<Unit> units;
  std::uint64_t ready_bytes = 0;
  std::optional<std::size_t> bad_tensor;

 private:
  std::optional<std::size_t> check_unit(std::size_t unit) const;
  // The packed tensors (layout indices) in the order of the packed region, and where each packed
  // unit's begin in it.
  std::vector<std::size_t> packed_tensors;
  std::vector<std::size_t> packed_unit_first;
  // hash_arrived's: per big unit (index unit - packed_units) its blocks' digests, filled in order;
  // the next byte to hash (a data-plane offset) and its unit; the block it lies in, hashed up to
  // it. Only hash_arrived's caller touches these until it publishes a unit through hashed_through.
  std::vector<std::vector<std::uint64_t>> big_digests;
  std::uint64_t hash_cursor = 0;
  std::size_t hash_unit = 0;
  std::size_t hash_first_unit = 0;  // hash_from's: units before it are never hashed here
  BlockHasher block_hasher;
  // Every unit that ends at or below it is hashed, if it is one hash_arrived hashes (release: a
  // checker that reads it with acquire sees the digests).
  std::atomic<std::uint64_t> hashed_through{0};
  mutable std::mutex device_error_mutex;
  mutable std::string device_error;
};

}  // namespace client_impl

struct Receive::State {
  // Told the call's result ("ok", an error code, an update status) and how long it ran, once.
  using Recorder = std::function<void(std::string_view result, double seconds)>;
  // Reads outside any Receive (a seed copy) get a State of their own: `plan` empty.
  State(client_impl::Plan plan, std::uint64_t call_id, Recorder record);

  // The reader thread: a read of the buffers begins, its prefix grows, its remaining units are
  // checked (returns the first tensor that does not match).
  void begin(std::shared_ptr<client_impl::ReadAttempt> attempt);
  void advance(client_impl::ReadAttempt& attempt, std::uint64_t ready_bytes);
  // Stops (nothing found) once `cancelled` holds: the buffers are the application's again.
  std::optional<std::size_t> check_rest(client_impl::ReadAttempt& attempt, const std::atomic<bool>& cancelled);
  // A read of the same version into the same buffers after `earlier` (of this call) ended short:
  // the units from the first on that `earlier` verified, or that arrived whole and verify now, are
  // good in `next` too, up to the first that is not. Returns where `next` goes on (layout order).
  // Cancelled, it checks nothing more but still carries what is known good.
  std::uint64_t resume(client_impl::ReadAttempt& earlier, client_impl::ReadAttempt& next,
                       const std::atomic<bool>& cancelled);
  // The I/O thread (or a shutdown): the call's answer. The first one counts.
  void finish(Outcome outcome);
  bool finished() const;

  const client_impl::Plan plan;
  std::vector<std::size_t> order;  // layout indices, in the order next() hands them out
  const std::uint64_t call_id;
  const Recorder record;
  const std::chrono::steady_clock::time_point started = std::chrono::steady_clock::now();

  mutable std::mutex mutex;
  std::condition_variable changed;
  std::shared_ptr<client_impl::ReadAttempt> attempt;  // the latest read into the buffers
  std::optional<Outcome> outcome;
  std::size_t handed_out = 0;  // of `order`
  bool abandoned = false;      // the Receive was dropped before the answer

  // The handle, until it shuts down (then nullptr). Its own lock: taken to cancel, which waits for
  // the I/O thread, and the I/O thread takes `mutex` (never this one).
  std::mutex impl_mutex;
  Handle::Impl* impl = nullptr;
};

}  // namespace th
