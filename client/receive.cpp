// libthclient's streaming receive: the units a read checks, and the Receive the application holds
// (see receive.h).
#include "client/receive.h"

#include <algorithm>
#include <cstring>

#include "client/handle_impl.h"

namespace th {
namespace client_impl {

ReadAttempt::ReadAttempt(Plan plan_, std::byte* packed_, ChecksumsRef checksums_, Version version_, bool scatter_)
    : plan(std::move(plan_)), packed(packed_), checksums(std::move(checksums_)), version(version_), scatter(scatter_) {
  TH_ASSERT(plan.layout != nullptr, "a read has a layout");
  const auto& tensors = plan.layout->tensors();
  tensor_unit.assign(tensors.size(), 0);
  // The packed region holds its tensors back to back in layout order (client/handle.cpp): a unit
  // ends where the next one's first tensor begins, the last one where the region ends.
  std::uint64_t unit_bytes = 0;
  std::uint64_t previous_offset = 0;
  for (std::size_t index = 0; index < tensors.size(); ++index) {
    const std::uint64_t offset = plan.packed_offset[index];
    if (offset == Plan::kNotPacked) continue;
    TH_ASSERT(offset >= previous_offset && offset <= plan.packed_bytes, "packed tensors lie in layout order");
    previous_offset = offset;
    if (packed_tensors.empty() || unit_bytes >= kPackedUnitBytes) {
      if (!packed_tensors.empty()) unit_end.push_back(offset);
      packed_unit_first.push_back(packed_tensors.size());
      unit_bytes = 0;
    }
    tensor_unit[index] = packed_unit_first.size() - 1;
    packed_tensors.push_back(index);
    unit_bytes += tensors[index].bytes;
  }
  packed_units = packed_unit_first.size();
  std::uint64_t end = 0;
  if (packed_units > 0) {
    end = plan.packed_bytes;
    unit_end.push_back(end);
  }
  TH_ASSERT(unit_end.size() == packed_units);
  for (std::size_t index : plan.big) {
    end += tensors[index].bytes;
    tensor_unit[index] = unit_end.size();
    unit_end.push_back(end);
  }
  units.assign(unit_end.size(), Unit::kPending);
  TH_ASSERT(end == plan.layout->total_bytes(), "the units cover the shard");
  big_digests.resize(plan.big.size());
  for (std::size_t big = 0; big < plan.big.size(); ++big) {
    big_digests[big].resize(checksum_blocks(tensors[plan.big[big]].bytes));
  }
}

void ReadAttempt::hash_from(std::uint64_t start_bytes) {
  TH_ASSERT(hash_cursor == 0 && hash_unit == 0, "before the pull");
  while (hash_unit < unit_end.size() && unit_end[hash_unit] <= start_bytes) ++hash_unit;
  hash_first_unit = hash_unit;
  hash_cursor = hash_unit == 0 ? 0 : unit_end[hash_unit - 1];
  hashed_through.store(hash_cursor, std::memory_order_release);
}

void ReadAttempt::hash_arrived(std::uint64_t ready) {
  while (hash_unit < unit_end.size()) {
    const std::uint64_t unit_start = hash_unit == 0 ? 0 : unit_end[hash_unit - 1];
    const std::uint64_t unit_stop = unit_end[hash_unit];
    TH_ASSERT(hash_cursor >= unit_start && hash_cursor <= unit_stop, "the cursor lies in its unit");
    if (hash_unit >= packed_units && !plan.device_tensor(plan.big[hash_unit - packed_units])) {
      // (Packed units are scattered before they are checked, and GPU tensors hashed on their
      // device: check_unit does both as before.)
      const std::byte* data = plan.tensor_data[plan.big[hash_unit - packed_units]];
      std::vector<std::uint64_t>& digests = big_digests[hash_unit - packed_units];
      // A block at a time, in pieces as they arrive (the receive steps are smaller than a block:
      // each piece is hashed while it is in cache, twice as fast as a block read back whole).
      while (hash_cursor < unit_stop) {
        const std::uint64_t offset = hash_cursor - unit_start;
        const std::uint64_t block = offset / kChecksumBlockBytes;
        const std::uint64_t block_stop = std::min(unit_start + (block + 1) * kChecksumBlockBytes, unit_stop);
        TH_ASSERT(block < digests.size() && block_hasher.fed_bytes() == offset % kChecksumBlockBytes,
                  "the hasher holds the block up to the cursor");
        const std::uint64_t piece_stop = std::min(block_stop, ready);
        if (piece_stop <= hash_cursor) return;
        if (block_hasher.fed_bytes() == 0 && piece_stop == block_stop) {
          digests[block] = checksum_block(data + offset, block_stop - hash_cursor);
        } else {
          block_hasher.update(data + offset, piece_stop - hash_cursor);
          if (piece_stop == block_stop) digests[block] = block_hasher.finish();
        }
        hash_cursor = piece_stop;
        if (hash_cursor < block_stop) return;  // (`ready` lies inside the block)
      }
    } else if (unit_stop > ready) {
      return;
    }
    hash_cursor = unit_stop;
    ++hash_unit;
    hashed_through.store(unit_stop, std::memory_order_release);
  }
}

std::optional<std::size_t> ReadAttempt::check(std::size_t unit) const {
  TH_ASSERT(unit < unit_end.size());
  try {
    return check_unit(unit);
  } catch (const net::DeviceCopyError& error) {
    // This host's GPU failed a copy or a checksum: the unit is not known good, so the read fails
    // (run_read says why).
    std::lock_guard lock(device_error_mutex);
    device_error = error.what();
    return unit < packed_units ? packed_tensors[packed_unit_first[unit]] : plan.big[unit - packed_units];
  }
}

std::optional<std::size_t> ReadAttempt::check_unit(std::size_t unit) const {
  const auto& tensors = plan.layout->tensors();
  const bool whole = checksums != nullptr && checksums->size() == tensors.size();
  auto matches = [&](std::size_t index, const std::byte* at) {
    if (!whole) return false;
    const bool on_gpu = plan.device_tensor(index) && at == plan.tensor_data[index];
    return (on_gpu ? plan.gpu->checksum(at, tensors[index].bytes) : checksum(at, tensors[index].bytes)) ==
           (*checksums)[index];
  };
  if (unit < packed_units) {
    // Small GPU tensors are verified where they landed, in the packed buffer, and then copied to
    // their devices all at once (one wait for the unit's copies).
    std::vector<Gpu::Copy> to_devices;
    const std::size_t last = unit + 1 < packed_units ? packed_unit_first[unit + 1] : packed_tensors.size();
    for (std::size_t at = packed_unit_first[unit]; at < last; ++at) {
      const std::size_t index = packed_tensors[at];
      std::byte* landed = packed + plan.packed_offset[index];
      if (scatter && plan.device_tensor(index)) {
        if (!matches(index, landed)) return index;
        to_devices.push_back({plan.tensor_data[index], landed, tensors[index].bytes});
        continue;
      }
      if (scatter) std::memcpy(plan.tensor_data[index], landed, tensors[index].bytes);
      if (!matches(index, scatter ? plan.tensor_data[index] : landed)) return index;
    }
    if (!to_devices.empty()) plan.gpu->to_device(to_devices);
    return std::nullopt;
  }
  const std::size_t index = plan.big[unit - packed_units];
  if (!plan.device_tensor(index) && unit >= hash_first_unit &&
      hashed_through.load(std::memory_order_acquire) >= unit_end[unit]) {
    // Hashed as it arrived (hash_arrived): its blocks' digests make its checksum.
    if (!whole || checksum_of_digests(big_digests[unit - packed_units]) != (*checksums)[index]) return index;
    return std::nullopt;
  }
  if (!matches(index, plan.tensor_data[index])) return index;
  return std::nullopt;
}

}  // namespace client_impl

using client_impl::ReadAttempt;

Receive::State::State(Plan plan_, std::uint64_t call_id_, Recorder record_)
    : plan(std::move(plan_)), call_id(call_id_), record(std::move(record_)) {
  if (plan.layout == nullptr) return;
  for (std::size_t index = 0; index < plan.packed_offset.size(); ++index) {
    if (plan.packed_offset[index] != Plan::kNotPacked) order.push_back(index);
  }
  order.insert(order.end(), plan.big.begin(), plan.big.end());
}

void Receive::State::begin(std::shared_ptr<ReadAttempt> next) {
  {
    std::lock_guard lock(mutex);
    attempt = std::move(next);
  }
  changed.notify_all();
}

void Receive::State::advance(ReadAttempt& read, std::uint64_t ready_bytes) {
  {
    std::lock_guard lock(mutex);
    if (ready_bytes <= read.ready_bytes) return;
    read.ready_bytes = ready_bytes;
  }
  changed.notify_all();
}

std::optional<std::size_t> Receive::State::check_rest(ReadAttempt& read, const std::atomic<bool>& cancelled) {
  std::unique_lock lock(mutex);
  for (std::size_t unit = 0; unit < read.units.size(); ++unit) {
    if (cancelled.load()) return std::nullopt;
    // The application may be checking it right now: its verdict counts.
    changed.wait(lock, [&] { return read.units[unit] != ReadAttempt::Unit::kChecking; });
    if (read.units[unit] == ReadAttempt::Unit::kGood) continue;
    if (read.units[unit] == ReadAttempt::Unit::kBad) return read.bad_tensor;
    read.units[unit] = ReadAttempt::Unit::kChecking;
    lock.unlock();
    const std::optional<std::size_t> bad = read.check(unit);
    lock.lock();
    read.units[unit] = bad ? ReadAttempt::Unit::kBad : ReadAttempt::Unit::kGood;
    if (bad) read.bad_tensor = bad;
    changed.notify_all();
    if (bad) return bad;
  }
  return std::nullopt;
}

std::uint64_t Receive::State::resume(ReadAttempt& earlier, ReadAttempt& next, const std::atomic<bool>& cancelled) {
  TH_ASSERT(earlier.unit_end == next.unit_end && earlier.version == next.version, "a resumed read has the same units");
  std::unique_lock lock(mutex);
  std::uint64_t verified = 0;
  for (std::size_t unit = 0; unit < earlier.units.size(); ++unit) {
    // The application may be checking it right now: its verdict counts.
    changed.wait(lock, [&] { return earlier.units[unit] != ReadAttempt::Unit::kChecking; });
    ReadAttempt::Unit& verdict = earlier.units[unit];
    if (verdict == ReadAttempt::Unit::kPending) {
      if (earlier.ready_bytes < earlier.unit_end[unit]) break;  // not all of it arrived
      // Cancelled (the server moved the read on again): no more checks, but what is known good
      // stays good, so that the read after this one still goes on from there.
      if (cancelled.load()) break;
      verdict = ReadAttempt::Unit::kChecking;
      lock.unlock();
      // (A failure of this host's GPU is the earlier attempt's to remember: the unit is bad, and
      // the next source's read of it is judged on its own.)
      const std::optional<std::size_t> bad = earlier.check(unit);
      lock.lock();
      verdict = bad ? ReadAttempt::Unit::kBad : ReadAttempt::Unit::kGood;
      if (bad) earlier.bad_tensor = bad;
      changed.notify_all();
    }
    if (verdict != ReadAttempt::Unit::kGood) break;
    next.units[unit] = ReadAttempt::Unit::kGood;
    verified = earlier.unit_end[unit];
  }
  next.ready_bytes = verified;
  TH_ASSERT(verified <= earlier.ready_bytes || verified == 0, "only what arrived is verified");
  return verified;
}

namespace {

std::string outcome_label(const Outcome& outcome) {
  if (const auto* error = std::get_if<Error>(&outcome)) return std::string(errc_name(error->code));
  if (const auto* updated = std::get_if<UpdateOk>(&outcome); updated && updated->status != UpdateStatus::kUpdated) {
    return std::string(update_status_name(updated->status));
  }
  return "ok";
}

}  // namespace

void Receive::State::finish(Outcome answer) {
  {
    std::lock_guard lock(mutex);
    if (outcome) return;
    outcome = std::move(answer);
  }
  changed.notify_all();
  if (record) {
    record(outcome_label(*outcome), std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count());
  }
}

bool Receive::State::finished() const {
  std::lock_guard lock(mutex);
  return outcome.has_value();
}

// ==== Receive ======================================================================================

Receive::Receive(std::shared_ptr<State> state) : state_(std::move(state)) {}

Receive::~Receive() {
  {
    std::lock_guard lock(state_->mutex);
    if (state_->outcome) return;
    state_->abandoned = true;
  }
  cancel();
}

Result<std::optional<ReceivedTensor>> Receive::next(TimeMs timeout_ms) {
  if (timeout_ms < 0) return make_error(Errc::kInvalidArgument, "timeout_ms must be >= 0");
  State& state = *state_;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
  const auto& tensors = state.plan.layout->tensors();
  auto hand_out = [&](std::size_t index, Version version) {
    ++state.handed_out;
    return ReceivedTensor{tensors[index].name, state.plan.tensor_data[index], tensors[index].bytes,
                          tensors[index].dtype, version};
  };
  std::unique_lock lock(state.mutex);
  for (;;) {
    if (state.handed_out == state.order.size()) return std::optional<ReceivedTensor>{};
    const std::size_t index = state.order[state.handed_out];
    if (state.outcome) {
      if (const auto* error = std::get_if<Error>(&*state.outcome)) return *error;
      // Answered: the buffers hold the version, every byte verified (by a read of this call, or
      // before it, for a shard that held it already after a failover).
      if (const auto* replicated = std::get_if<ReplicateOk>(&*state.outcome)) {
        return std::optional(hand_out(index, replicated->version));
      }
      const auto& updated = std::get<UpdateOk>(*state.outcome);
      if (updated.status != UpdateStatus::kUpdated) return std::optional<ReceivedTensor>{};
      return std::optional(hand_out(index, *updated.version));
    }
    if (const std::shared_ptr<ReadAttempt> read = state.attempt) {
      const std::size_t unit = read->unit_of(index);
      const ReadAttempt::Unit verdict = read->units[unit];
      if (verdict == ReadAttempt::Unit::kGood) return std::optional(hand_out(index, read->version));
      if (verdict == ReadAttempt::Unit::kPending && read->ready_bytes >= read->unit_end[unit]) {
        read->units[unit] = ReadAttempt::Unit::kChecking;
        lock.unlock();
        const std::optional<std::size_t> bad = read->check(unit);
        lock.lock();
        read->units[unit] = bad ? ReadAttempt::Unit::kBad : ReadAttempt::Unit::kGood;
        if (bad) read->bad_tensor = bad;
        state.changed.notify_all();
        continue;  // good: handed out above; bad: the reader reports it and another read comes
      }
    }
    if (timeout_ms == 0) {
      state.changed.wait(lock);
    } else if (state.changed.wait_until(lock, deadline) == std::cv_status::timeout) {
      return make_error(Errc::kTimeout, "no tensor completed within " + std::to_string(timeout_ms) +
                                            " ms (the call goes on)");
    }
  }
}

Result<UpdateInfo> Receive::wait() {
  std::unique_lock lock(state_->mutex);
  state_->changed.wait(lock, [&] { return state_->outcome.has_value(); });
  const Outcome& outcome = *state_->outcome;
  if (const auto* error = std::get_if<Error>(&outcome)) return *error;
  if (const auto* replicated = std::get_if<ReplicateOk>(&outcome)) {
    return UpdateInfo{UpdateStatus::kUpdated, replicated->version, replicated->source_replica};
  }
  const auto& updated = std::get<UpdateOk>(outcome);
  return UpdateInfo{updated.status, updated.version, updated.source_replica};
}

bool Receive::wait_for(TimeMs timeout_ms) {
  std::unique_lock lock(state_->mutex);
  return state_->changed.wait_for(lock, std::chrono::milliseconds(std::max<TimeMs>(timeout_ms, 0)),
                                  [&] { return state_->outcome.has_value(); });
}

ReceiveProgress Receive::progress() const {
  std::lock_guard lock(state_->mutex);
  ReceiveProgress progress;
  progress.bytes_total = state_->plan.layout->total_bytes();
  progress.tensors_total = static_cast<std::uint32_t>(state_->order.size());
  progress.tensors_handed_out = static_cast<std::uint32_t>(state_->handed_out);
  progress.done = state_->outcome.has_value();
  if (state_->attempt != nullptr) {
    progress.version = state_->attempt->version;
    progress.bytes_ready = state_->attempt->ready_bytes;
  }
  // Answered with a version in the buffers: all of it is here.
  if (state_->outcome) {
    if (const auto* replicated = std::get_if<ReplicateOk>(&*state_->outcome)) {
      progress.version = replicated->version;
      progress.bytes_ready = progress.bytes_total;
    } else if (const auto* updated = std::get_if<UpdateOk>(&*state_->outcome)) {
      progress.version = updated->version;
      if (updated->status == UpdateStatus::kUpdated) progress.bytes_ready = progress.bytes_total;
    }
  }
  return progress;
}

void Receive::cancel() {
  std::lock_guard lock(state_->impl_mutex);
  // A finished call's handle may be gone already; the one in flight's is here until it nulls this.
  if (state_->impl == nullptr || state_->finished()) return;
  state_->impl->cancel_call(state_->call_id);
}

namespace {

// Hands every tensor of `receive` to `hook`, then returns the call's answer (see TensorHook).
Result<UpdateInfo> hand_to(Receive& receive, const TensorHook& hook) {
  for (;;) {
    auto next = receive.next();
    if (!next.ok()) return next.error();
    if (!next.value()) break;
    try {
      hook(*next.value());
    } catch (...) {
      // The application stopped taking tensors: end the call rather than leave it running with
      // half-loaded weights, and let the handle take calls again before the exception goes on.
      receive.cancel();
      (void)receive.wait();
      throw;
    }
  }
  return receive.wait();
}

}  // namespace

Result<ReplicateInfo> Handle::replicate(std::string_view selector, TimeMs timeout_ms, const TensorHook& hook) {
  if (!hook) return make_error(Errc::kInvalidArgument, "replicate: the tensor hook is empty");
  auto started = replicate_async(selector, timeout_ms);
  if (!started.ok()) return started.error();
  auto answer = hand_to(*started.value(), hook);
  if (!answer.ok()) return answer.error();
  TH_ASSERT(answer.value().version.has_value(), "a replicate that succeeded holds a version");
  return ReplicateInfo{*answer.value().version, answer.value().source_replica};
}

Result<UpdateInfo> Handle::update(std::string_view selector, const TensorHook& hook) {
  if (!hook) return make_error(Errc::kInvalidArgument, "update: the tensor hook is empty");
  auto started = update_async(selector);
  if (!started.ok()) return started.error();
  return hand_to(*started.value(), hook);
}

}  // namespace th
