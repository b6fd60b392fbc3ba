// libthclient's data path: the transport (net/transport.h; TCP today) serves grants from the
// registered tensors (or from an offload copy); one reader thread pulls versions into them and
// verifies their checksums; offloads copy the tensors to CPU memory on threads of their own; seed
// reads fill a CPU copy.
#include "client/cuda/ipc.h"
#include "client/handle_impl.h"
#include "client/receive.h"
#include "client/reshard_read.h"

namespace th {
namespace {

// Offload seeding: fills `copy` (empty) with a CPU buffer laid out like the buffers of `layout`
// would be on the data plane (the packed small tensors, then each big one), and returns the plan
// that reads into it in place. Allocates gigabytes: called on the seed's own thread.
Plan seed_copy_of(const LayoutRef& layout, OffloadCopy& copy) {
  Plan plan;
  plan.layout = layout;
  DataPlaneGeometry geometry = data_plane_geometry(*layout);
  plan.packed_offset = std::move(geometry.packed_offset);
  plan.packed_bytes = geometry.packed_bytes;
  plan.big = std::move(geometry.big);
  std::uint64_t big_bytes = 0;
  for (std::size_t index : plan.big) big_bytes += layout->tensors()[index].bytes;
  TH_ASSERT(copy.bytes.empty() && copy.regions.empty(), "a seed copy is filled once");
  copy.bytes.resize(plan.packed_bytes + big_bytes);
  if (plan.packed_bytes > 0) copy.regions.push_back({copy.bytes.data(), plan.packed_bytes});
  std::byte* at = copy.bytes.data() + plan.packed_bytes;
  const auto& tensors = layout->tensors();
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    if (plan.packed_offset[i] != Plan::kNotPacked) {
      plan.tensor_data.push_back(copy.bytes.data() + plan.packed_offset[i]);  // read in place
    } else {
      plan.tensor_data.push_back(at);
      copy.regions.push_back({at, tensors[i].bytes});
      at += tensors[i].bytes;
    }
  }
  TH_ASSERT(at == copy.bytes.data() + copy.bytes.size(), "a seed copy has the layout's size");
  return plan;
}

}  // namespace

namespace {

std::vector<net::ExposedRegion> regions_of(const Plan& plan, const std::byte* packed) {
  std::vector<net::ExposedRegion> regions;
  if (plan.packed_bytes > 0) regions.push_back({packed, plan.packed_bytes});
  for (std::size_t index : plan.big) {
    regions.push_back({plan.tensor_data[index], plan.layout->tensors()[index].bytes, plan.device_tensor(index)});
  }
  return regions;
}

}  // namespace

void Handle::Impl::serve(const ServeRead& grant) {
  const net::GrantKey key{grant.transfer, grant.epoch};
  if (grant.kind == CopyKind::kOffload) {
    auto found = offloads_.find(grant.version);
    if (found == offloads_.end()) {
      log(LogLevel::kWarning, "data", "asked to serve offload copy of version " + std::to_string(grant.version) + ", which is not here");
      return;  // the reader is refused and reports it; the server picks another source
    }
    offload_grants_[key] = found->second;
    transport_->grant(key, grant.secret, found->second->regions, std::make_shared<net::Progress>(found->second->bytes.size()));
    return;
  }
  if (!buffers_version_ || *buffers_version_ != grant.version || buffers_progress_ == nullptr) {
    log(LogLevel::kWarning, "data", "asked to serve version " + std::to_string(grant.version) + ", which the buffers do not hold");
    return;
  }
  const Plan& current = plan();  // first: it may rebuild packed_
  if (grant.patch) {
    // A reader that holds the base: this shard's patches, and its tensors that have none, whole.
    // A shard that made no patch of the version its buffers hold (a stage whose weights did not
    // change, while its peers' did) serves every tensor whole: the server announced it so.
    KeptPatch none;
    none.version = grant.version;
    none.patches.resize(current.layout->tensors().size());
    const bool kept = kept_patch_ != nullptr && kept_patch_->version == grant.version &&
                      kept_patch_->patches.size() == current.layout->tensors().size();
    std::vector<net::ExposedRegion> regions = patch_regions(kept ? *kept_patch_ : none, current, packed_.data());
    std::uint64_t total = 0;
    for (const net::ExposedRegion& region : regions) total += region.bytes;
    transport_->grant(key, grant.secret, std::move(regions), std::make_shared<net::Progress>(total));
    return;
  }
  transport_->grant(key, grant.secret, regions_of(current, packed_.data()), buffers_progress_);
}

void Handle::Impl::start_read(const StartRead& read) {
  // Another read of the same version (another source, after a failure) rewrites the same bytes:
  // what is already ready stays ready for our own readers. A new version starts from nothing.
  if (!buffers_version_ || *buffers_version_ != read.version || buffers_progress_ == nullptr) {
    buffers_version_ = read.version;
    buffers_progress_ = std::make_shared<net::Progress>(0);
  }
  ReadJob job{read, std::make_shared<std::atomic<bool>>(false), buffers_progress_, plan(), packed_.data(),
              nullptr, nullptr};
  // The buffers change: the patch of what they held is no longer theirs to serve. A patch read
  // starts from what they hold (its base); any other read writes them.
  kept_patch_.reset();
  if (read.patch != nullptr && held_checksums_ && held_checksums_->first == read.patch->base) {
    job.base_checksums = held_checksums_->second;
  }
  if (read.patch == nullptr) held_checksums_.reset();
  {
    // The call this read serves streams it (the agent drops instructions of other calls).
    std::lock_guard lock(calls_mutex_);
    job.stream = active_receive_;
  }
  if (job.stream == nullptr) job.stream = std::make_shared<Receive::State>(Plan{}, 0, nullptr);
  std::lock_guard lock(reader_mutex_);
  // One read at a time into these buffers: a newer one replaces whatever is queued or running.
  for (ReadJob& queued : read_jobs_) queued.cancelled->store(true);
  if (running_read_) running_read_->cancelled->store(true);
  read_jobs_.push_back(std::move(job));
  reader_wakeup_.notify_one();
}

void Handle::Impl::start_seed_read(const StartRead& read) {
  TH_ASSERT(read.layout != nullptr, "a seed read names its layout");
  if (auto previous = seed_reads_.find(read.transfer); previous != seed_reads_.end()) {
    previous->second.cancelled->store(true);  // from the source this read replaces
  }
  auto cancelled = std::make_shared<std::atomic<bool>>(false);
  seed_reads_[read.transfer] = SeedRead{read.version, cancelled};
  // A fresh buffer each time (a replaced read may still be writing into the old one). The agent
  // grants reads of it only once it is whole, after this thread has said so through the loop.
  auto copy = std::make_shared<OffloadCopy>();
  offloads_[read.version] = copy;
  auto fail = [this, read](const std::string& why) {
    log(LogLevel::kWarning, "data", "seed of version " + std::to_string(read.version) + ": " + why);
    post(ReadFinished{read.transfer, read.epoch, ReadFailure::kSourceUnreachable});
  };
  if (threads_closed_) return;  // closing: nobody waits for it
  join_reported_threads();
  const std::uint64_t id = next_offload_id_++;
  try {
    offload_threads_[id] = std::thread([this, id, read, copy, cancelled] {
      try {
        Plan plan = seed_copy_of(read.layout, *copy);
        std::byte* packed = copy->bytes.data();
        ReadJob job{read, cancelled, std::make_shared<net::Progress>(0), std::move(plan), packed, copy,
                    std::make_shared<Receive::State>(Plan{}, 0, nullptr)};
        run_read(job);
      } catch (const std::bad_alloc&) {
        on_io([this, read] {
          log(LogLevel::kWarning, "data", "seed of version " + std::to_string(read.version) + ": no memory for the CPU copy");
          step(ReadFinished{read.transfer, read.epoch, ReadFailure::kSourceUnreachable});
        });
      }
      on_io([this, id, transfer = read.transfer, cancelled] {
        if (auto entry = seed_reads_.find(transfer);
            entry != seed_reads_.end() && entry->second.cancelled == cancelled) {
          seed_reads_.erase(entry);
        }
        offloads_reported_.push_back(id);
      });
    });
  } catch (const std::system_error& error) {
    offload_threads_.erase(id);
    fail(std::string("no thread to read it: ") + error.what());
  }
}

void Handle::Impl::join_reported_threads() {
  for (std::uint64_t done : offloads_reported_) {
    // (Shutdown may have taken the thread to join it itself.)
    if (auto thread = offload_threads_.find(done); thread != offload_threads_.end()) {
      thread->second.join();
      offload_threads_.erase(thread);
    }
  }
  offloads_reported_.clear();
}

void Handle::Impl::reader_main() {
  for (;;) {
    ReadJob job;
    {
      std::unique_lock lock(reader_mutex_);
      reader_wakeup_.wait(lock, [&] { return reader_stopping_ || !read_jobs_.empty(); });
      if (reader_stopping_) return;
      job = std::move(read_jobs_.front());
      read_jobs_.pop_front();
      running_read_ = RunningRead{job.read.transfer, job.cancelled};
    }
    if (!job.cancelled->load()) run_read(job);
    std::optional<std::pair<std::uint64_t, Outcome>> release;
    {
      std::lock_guard lock(reader_mutex_);
      running_read_.reset();
      if (read_jobs_.empty()) release = std::exchange(completion_after_reads_, std::nullopt);
    }
    // The buffers are the application's again: the failed call it waits for may return.
    if (release) on_io([this, &release] { complete_call(release->first, std::move(release->second)); });
  }
}

void Handle::Impl::run_read(ReadJob& job) {
  if (job.read.patch != nullptr && job.seed == nullptr) return run_patch_read(job);
  if (!job.read.reshard.empty()) return run_reshard_read(job);
  const Plan& plan = job.plan;
  std::vector<net::LocalRegion> targets;
  for (const net::ExposedRegion& region : regions_of(plan, job.packed)) {
    targets.push_back({const_cast<std::byte*>(region.base), region.bytes, region.on_device});
  }
  net::PullOptions pull_options = pull_options_for_reads();
  pull_options.partial = job.read.source.partial;
  if (plan.gpu != nullptr && options_.cuda_ipc) {
    if (ipc_importer_ == nullptr) ipc_importer_ = make_ipc_importer(plan.gpu_device);
    pull_options.ipc = ipc_importer_;
  }
  {
    std::lock_guard lock(stats_mutex_);
    stats_.reading_from = job.read.source.replica;
  }
  pull_options.cancelled = [&] { return job.cancelled->load(); };
  // The tensors are checked as they complete (by the application's Receive::next, which hands
  // them out) or all at the end (by this thread): each once per read.
  auto attempt = std::make_shared<ReadAttempt>(plan, job.packed, job.read.checksums, job.read.version,
                                               /*scatter=*/job.seed == nullptr);
  // Another source for the same transfer (the last one failed, or the server moved the read):
  // go on after the tensors that arrived whole and verify, rather than from byte 0 (issue 34).
  // A source still receiving may be behind the resume point: the reader waits there while the
  // source catches up (its empty answers say it advances, so it is not called stalled), and gets
  // there no later than reading from byte 0 would. (A seed reads into a fresh buffer each time, on
  // a thread of its own: never resumed.)
  if (job.seed == nullptr) {
    const std::optional<Resumable> earlier = std::exchange(resumable_, std::nullopt);
    if (options_.resume_reads && earlier && earlier->transfer == job.read.transfer &&
        earlier->epoch < job.read.epoch &&
        earlier->progress == job.progress && earlier->stream == job.stream &&
        earlier->attempt->version == job.read.version && earlier->attempt->plan.layout == plan.layout &&
        earlier->attempt->packed == job.packed && earlier->attempt->scatter) {
      pull_options.start_bytes = job.stream->resume(*earlier->attempt, *attempt, *job.cancelled);
    }
  }
  attempt->hash_from(pull_options.start_bytes);
  job.stream->begin(attempt);
  if (pull_options.start_bytes > 0) {
    log(LogLevel::kInfo, "data", "version " + std::to_string(job.read.version) + " from " + job.read.source.replica +
                                     ": going on at byte " + std::to_string(pull_options.start_bytes) + " of " +
                                     std::to_string(plan.layout->total_bytes()) +
                                     " (the tensors before it arrived whole from the last source, and verify)");
  }
  // A NIC may write GPU tensors (RDMA READs): flushed before any of them counts as arrived, since
  // arrived bytes are checked on the GPU, handed out, and served on to pipeline readers.
  const bool flush_nic_writes = plan.gpu != nullptr && transport_->kind() == "rdma";
  std::atomic<bool> flush_failed{false};
  std::string flush_error;  // written once, by whoever set flush_failed
  auto flush = [&] {
    if (!flush_nic_writes || flush_failed.load()) return;
    try {
      plan.gpu->flush_remote_writes(plan.gpu_device);
    } catch (const net::DeviceCopyError& error) {
      if (!flush_failed.exchange(true)) flush_error = error.what();
    }
  };
  // The server times this replica by the first sixteenth from this source (ReadProgress): a
  // version's first chains form before any read has ended, maybe behind a slow member.
  const std::uint64_t shard_bytes = plan.layout->total_bytes();
  const std::uint64_t report_progress_at = pull_options.start_bytes + progress_report_bytes(shard_bytes);
  bool progress_reported = job.seed != nullptr || shard_bytes == 0;  // (a seed's read is not timed)
  pull_options.on_progress = [&](std::uint64_t ready) {
    flush();
    if (flush_failed.load()) return;
    job.progress->advance_to(ready);
    attempt->hash_arrived(ready);  // (after the pipeline readers hear of the bytes: they check their own)
    job.stream->advance(*attempt, ready);
    if (!progress_reported && ready >= report_progress_at && ready < shard_bytes) {
      progress_reported = true;
      on_io([this, progress = ReadProgress{job.read.transfer, job.read.epoch, ready - pull_options.start_bytes}] {
        step(progress);
      });
    }
  };
  const auto started = std::chrono::steady_clock::now();
  net::PullOutcome outcome = [&] {
    try {
      return transport_->pull(net::parse_endpoint(job.read.source.endpoint), {job.read.transfer, job.read.epoch},
                              job.read.secret, targets, pull_options);
    } catch (const net::SocketError& bad_endpoint) {
      return net::PullOutcome{0, net::ReadError::kUnreachable, bad_endpoint.what()};
    }
  }();
  const double pull_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  if (!outcome.ipc_fallback.empty()) log(LogLevel::kInfo, "data", "not over CUDA IPC: " + outcome.ipc_fallback);
  if (outcome.ok()) flush();  // (a pull reports its last bytes by returning)
  if (outcome.ok() && flush_failed.load()) {
    outcome = net::PullOutcome{outcome.bytes, net::ReadError::kUnreachable, "GPU tensors: " + flush_error};
  }
  auto stopped = [&] {
    std::lock_guard lock(stats_mutex_);
    stats_.reading_from.clear();
  };
  // Ended short (cancelled for another source, or failed; a bad tensor stops resume() there): a
  // later read of this transfer may go on from what arrived.
  auto keep_for_resume = [&] {
    if (job.seed == nullptr) {
      resumable_ = Resumable{job.read.transfer, job.read.epoch, job.progress, job.stream, attempt};
    }
  };
  if (outcome.error == net::ReadError::kCancelled || job.cancelled->load()) {
    keep_for_resume();
    return stopped();
  }
  std::optional<ReadFailure> failure;
  if (!outcome.ok()) {
    log(LogLevel::kWarning, "data", outcome.detail);
    failure = outcome.error == net::ReadError::kRefused ? ReadFailure::kSourceRefused
                                                         : ReadFailure::kSourceUnreachable;
  } else {
    job.stream->advance(*attempt, attempt->unit_end.empty() ? 0 : attempt->unit_end.back());
    // Scatter the packed tensors, and check every tensor against the checksum of its publisher.
    if (const std::optional<std::size_t> bad = job.stream->check_rest(*attempt, *job.cancelled)) {
      const std::string device_failure = attempt->device_failure();
      if (device_failure.empty()) {
        log(LogLevel::kError, "data", "tensor '" + plan.layout->tensors()[*bad].name + "' of version " +
            std::to_string(job.read.version) + " from " + job.read.source.replica + " does not match its checksum");
        failure = ReadFailure::kChecksumMismatch;
      } else {
        // Not the source's fault: the read fails, and the server tries again (another source).
        log(LogLevel::kError, "data", "tensor '" + plan.layout->tensors()[*bad].name + "' of version " +
            std::to_string(job.read.version) + " could not be checked on this host's GPU: " + device_failure);
        failure = ReadFailure::kSourceUnreachable;
      }
    }
    if (job.cancelled->load()) {
      keep_for_resume();
      return stopped();  // (and the checks stopped short)
    }
  }
  if (failure) keep_for_resume();
  {
    std::lock_guard lock(stats_mutex_);
    stats_.bytes_received += outcome.bytes;
    if (pull_options.start_bytes > 0) {
      ++stats_.reads_resumed;
      stats_.bytes_resumed += pull_options.start_bytes;
    }
    if (outcome.bytes_over_ipc > 0) ++stats_.pulls_ipc;
    stats_.reading_from.clear();
    if (failure) {
      ++stats_.reads_failed;
      if (*failure == ReadFailure::kChecksumMismatch) ++stats_.checksum_failures;
    } else {
      stats_.last_read_bytes = outcome.bytes;
      stats_.last_pull_seconds = pull_seconds;
      stats_.last_read_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
    }
  }
  on_io([this, finished = ReadFinished{job.read.transfer, job.read.epoch, failure}, seed = job.seed != nullptr,
         version = job.read.version, checksums = job.read.checksums] {
    if (!finished.failure && !seed) hold_verified(version, checksums, nullptr);
    step(finished);
  });
}

net::PullOptions Handle::Impl::pull_options_for_reads() const {
  net::PullOptions options;
  options.chunk_bytes = options_.chunk_bytes;
  options.rate_bytes_per_s = options_.read_rate_bytes_per_s;
  options.streams = options_.data_streams;
  options.io_timeout_ms = static_cast<int>(data_timeout_ms());
  options.staging = pull_staging_;
  return options;
}

void Handle::Impl::hold_verified(Version version, ChecksumsRef checksums, std::shared_ptr<KeptPatch> kept) {
  if (!buffers_version_ || *buffers_version_ != version || checksums == nullptr) return;  // moved on since
  held_checksums_ = {version, std::move(checksums)};
  kept_patch_ = std::move(kept);
}

// A patch read (client/patch_read.h): nothing of it is handed out before every tensor verified, as
// for a read across layouts, and the patch is kept to serve onwards.
void Handle::Impl::run_patch_read(ReadJob& job) {
  const net::PullOptions pull_options = pull_options_for_reads();
  {
    std::lock_guard lock(stats_mutex_);
    stats_.reading_from = job.read.source.replica;
  }
  job.stream->begin(nullptr);
  const auto started = std::chrono::steady_clock::now();
  PatchReadOutcome outcome =
      read_patch(*transport_, job.read, job.plan, job.packed, job.base_checksums, pull_options, *job.cancelled);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  if (outcome.cancelled || job.cancelled->load()) {
    std::lock_guard lock(stats_mutex_);
    stats_.reading_from.clear();
    return;  // replaced by a newer read, or dropped: nothing to report
  }
  if (outcome.failure) {
    log(*outcome.failure == ReadFailure::kChecksumMismatch ? LogLevel::kError : LogLevel::kWarning, "data",
        "the patch of version " + std::to_string(job.read.version) + " against " + std::to_string(job.read.patch->base) +
            " from " + job.read.source.replica + ": " + outcome.detail);
  } else {
    log(LogLevel::kInfo, "data", "version " + std::to_string(job.read.version) + " from " + job.read.source.replica + ": a patch against " +
                                     std::to_string(job.read.patch->base) + ", " + std::to_string(outcome.bytes_read) + " bytes of " +
                                     std::to_string(job.plan.layout->total_bytes()) + ", " +
                                     std::to_string(outcome.elements_changed) + " elements changed");
  }
  {
    std::lock_guard lock(stats_mutex_);
    ++(outcome.failure ? stats_.patch_reads_failed : stats_.patch_reads);
    if (!outcome.failure) stats_.patch_bytes_received += outcome.bytes_read;
  }
  finish_whole_read(job, outcome.failure, outcome.bytes_read, seconds, nullptr, std::move(outcome.kept));
}

void Handle::Impl::finish_whole_read(const ReadJob& job, std::optional<ReadFailure> failure, std::uint64_t bytes,
                                     double seconds, ChecksumsRef assembled, std::shared_ptr<KeptPatch> kept) {
  {
    std::lock_guard lock(stats_mutex_);
    stats_.reading_from.clear();
    stats_.bytes_received += bytes;
    if (failure) {
      ++stats_.reads_failed;
      if (*failure == ReadFailure::kChecksumMismatch) ++stats_.checksum_failures;
    } else {
      stats_.last_read_bytes = bytes;
      stats_.last_pull_seconds = seconds;
      stats_.last_read_seconds = seconds;
    }
  }
  if (!failure) job.progress->advance_to(job.plan.layout->total_bytes());
  // The buffers hold the version whole: its checksums (as assembled, after a read across layouts)
  // are the base of the next patch.
  ChecksumsRef held = assembled != nullptr ? assembled : job.read.checksums;
  on_io([this, finished = ReadFinished{job.read.transfer, job.read.epoch, failure, failure ? nullptr : assembled},
         version = job.read.version, held = std::move(held), kept = std::move(kept)]() mutable {
    if (!finished.failure) hold_verified(version, held, std::move(kept));
    step(finished);
  });
}

// A read from a source of another layout (client/reshard_read.h). Nothing of it is handed out
// before it is whole: its bytes land piece by piece, tensor after tensor, and the checksums that
// vouch for them are computed once all landed. So the Receive hears no attempt (and gives the
// tensors once the call is answered), and the buffers count as ready, for readers of this shard,
// only at the end.
void Handle::Impl::run_reshard_read(ReadJob& job) {
  net::PullOptions pull_options;
  pull_options.chunk_bytes = options_.chunk_bytes;
  pull_options.rate_bytes_per_s = options_.read_rate_bytes_per_s;
  pull_options.io_timeout_ms = static_cast<int>(data_timeout_ms());
  {
    std::lock_guard lock(stats_mutex_);
    stats_.reading_from = job.read.source.replica;
  }
  job.stream->begin(nullptr);  // (units checked by an earlier attempt are not this one's)
  const auto started = std::chrono::steady_clock::now();
  // Bytes an earlier read of this version made ready may be read by our own readers and were
  // handed to the application: only verified bytes may overwrite them.
  const bool in_place = job.progress->ready_bytes() == 0;
  const ReshardOutcome outcome = read_resharded(job.read, job.plan, job.packed, pull_options, *job.cancelled, in_place);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  if (outcome.cancelled || job.cancelled->load()) {
    std::lock_guard lock(stats_mutex_);
    stats_.reading_from.clear();
    return;  // replaced by a newer read, or dropped: nothing to report
  }
  if (outcome.failure) {
    log(*outcome.failure == ReadFailure::kChecksumMismatch ? LogLevel::kError : LogLevel::kWarning, "data",
        "version " + std::to_string(job.read.version) + " from " + job.read.source.replica +
            " (another layout, " + std::to_string(job.read.reshard.size()) + " shards): " + outcome.detail);
  }
  finish_whole_read(job, outcome.failure, outcome.bytes_read, seconds, outcome.checksums, nullptr);
}

void Handle::Impl::start_offload(Version version) {
  if (!buffers_version_ || *buffers_version_ != version) {
    log(LogLevel::kWarning, "data", "asked to offload version " + std::to_string(version) + ", which the buffers do not hold");
    return;  // the server times the offload out and carries on
  }
  // Copy on a thread of its own: gigabytes must not stall heartbeats. The buffers do not change
  // meanwhile: the application's unpublish() is still blocked.
  if (threads_closed_) return;
  join_reported_threads();
  const Plan& current = plan();  // first: it may rebuild packed_
  auto regions = regions_of(current, packed_.data());
  const std::uint64_t id = next_offload_id_++;
  offload_threads_[id] = std::thread([this, id, version, regions = std::move(regions), gpu = current.gpu] {
    auto copy = std::make_shared<OffloadCopy>();
    std::uint64_t total = 0;
    for (const auto& region : regions) total += region.bytes;
    copy->bytes.resize(total);
    std::uint64_t at = 0;
    std::vector<Gpu::Copy> from_devices;  // the GPU tensors' bytes come down in one batch
    for (const auto& region : regions) {
      if (region.on_device) {
        from_devices.push_back({const_cast<std::byte*>(region.base), copy->bytes.data() + at, region.bytes});
      } else {
        std::memcpy(copy->bytes.data() + at, region.base, region.bytes);
      }
      copy->regions.push_back({copy->bytes.data() + at, region.bytes});
      at += region.bytes;
    }
    if (!from_devices.empty()) {
      try {
        // Into pinned memory: a device-to-host copy into pageable memory goes through the
        // driver's own small bounce buffers, at a fraction of the link's speed. Unpinned once
        // copied: a retained copy may be held for a long time, and pinned pages are the host's
        // scarcest memory.
        const std::shared_ptr<void> pinned = gpu->pin_host(copy->bytes.data(), copy->bytes.size());
        gpu->to_host(from_devices);
      } catch (const net::DeviceCopyError& error) {
        // No copy: the server times the offload out and carries on (the version may be lost if
        // this was its last copy; the log says why); asked again, the agent tries again.
        log(LogLevel::kError, "data", "offload of version " + std::to_string(version) +
                                          ": copying the GPU tensors to CPU memory failed: " + error.what());
        on_io([this, id, version] {
          offloads_reported_.push_back(id);
          step(OffloadFinished{version, /*failed=*/true});
        });
        return;
      }
    }
    copy->lease = transport_->lease_memory(copy->bytes.data(), copy->bytes.size(), false);
    on_io([this, id, version, copy] {
      offloads_reported_.push_back(id);
      // A seed of this version started meanwhile (after a re-open): its buffer stays.
      const bool seeding = std::any_of(seed_reads_.begin(), seed_reads_.end(),
                                       [&](const auto& seed) { return seed.second.version == version; });
      if (!seeding) offloads_[version] = copy;
      step(OffloadFinished{version});
    });
  });
}

}  // namespace th
