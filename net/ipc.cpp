#include "net/ipc.h"

#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <fstream>
#include <limits>

#include "core/assert.h"
#include "core/limits.h"

namespace th::net {

// ---- The mapping cache -----------------------------------------------------------------------------

CachingIpcImporter::CachingIpcImporter(std::size_t mappings_max) : mappings_max_(mappings_max) {
  TH_REQUIRE(mappings_max_ > 0);
}

CachingIpcImporter::~CachingIpcImporter() {
  // close_mapping() is the subclass's, gone by now: its destructor closed everything.
  TH_ASSERT(mappings_.empty(), "a CachingIpcImporter's subclass must call close_all() in its destructor");
}

IpcMapping CachingIpcImporter::open(const IpcHandleBytes& handle) {
  std::lock_guard lock(mutex_);
  auto found = std::find_if(mappings_.begin(), mappings_.end(), [&](const Mapping& m) { return m.handle == handle; });
  if (found != mappings_.end()) {
    mappings_.splice(mappings_.begin(), mappings_, found);  // most recently used
    return mappings_.front().mapped;
  }
  const IpcMapping mapped = open_mapping(handle);
  if (mapped.base == nullptr) return {};
  mappings_.push_front(Mapping{handle, mapped});
  while (mappings_.size() > mappings_max_) {
    // The least recently used: not the one just opened (mappings_max_ >= 1), so a mapping open()
    // returned last stays valid, as the interface promises.
    close_mapping(mappings_.back().mapped.base);
    mappings_.pop_back();
  }
  TH_ASSERT(mappings_.size() <= mappings_max_);
  return mapped;
}

void CachingIpcImporter::forget(const IpcHandleBytes& handle) {
  std::lock_guard lock(mutex_);
  auto found = std::find_if(mappings_.begin(), mappings_.end(), [&](const Mapping& m) { return m.handle == handle; });
  if (found == mappings_.end()) return;
  close_mapping(found->mapped.base);
  mappings_.erase(found);
}

void CachingIpcImporter::keep_only(std::span<const IpcHandleBytes> kept) {
  std::lock_guard lock(mutex_);
  for (auto it = mappings_.begin(); it != mappings_.end();) {
    if (std::find(kept.begin(), kept.end(), it->handle) != kept.end()) {
      ++it;
      continue;
    }
    close_mapping(it->mapped.base);
    it = mappings_.erase(it);
  }
}

std::size_t CachingIpcImporter::mappings_open() const {
  std::lock_guard lock(mutex_);
  return mappings_.size();
}

void CachingIpcImporter::close_all() {
  std::lock_guard lock(mutex_);
  for (const Mapping& mapping : mappings_) close_mapping(mapping.mapped.base);
  mappings_.clear();
}

// ---- Identity --------------------------------------------------------------------------------------

std::string local_host_identity() {
  // The boot id changes with every boot of the kernel: two hosts (or one host before and after a
  // reboot) never share it. The PID namespace's inode tells containers apart.
  std::string boot_id;
  std::ifstream("/proc/sys/kernel/random/boot_id") >> boot_id;
  char pid_namespace[128] = {};
  const ssize_t length = ::readlink("/proc/self/ns/pid", pid_namespace, sizeof pid_namespace - 1);
  if (boot_id.empty() || length <= 0) return "";  // unknown: no IPC (a reader needs a match)
  std::string identity = boot_id + " " + std::string(pid_namespace, static_cast<std::size_t>(length));
  // "pid:[4026531836]": 36 + 1 + at most 27 bytes.
  if (identity.size() > kIpcHostIdentityBytesMax) identity.resize(kIpcHostIdentityBytesMax);
  return identity;
}

namespace ipc_detail {
namespace {

std::array<char, kIpcHostIdentityBytesMax> host_field(const std::string& identity) {
  // (Longer ones are cut on both sides alike: local_host_identity() never is.)
  std::array<char, kIpcHostIdentityBytesMax> field{};
  std::memcpy(field.data(), identity.data(), std::min(identity.size(), field.size()));
  return field;
}

bool fits(std::uint64_t offset, std::uint64_t bytes, std::uint64_t within) {
  return offset <= within && bytes <= within - offset;
}

}  // namespace

IpcAnswerFrame answer_header(IpcExporter& exporter) {
  IpcAnswerFrame header;
  header.status = 0;
  header.process = exporter.process_identity();
  header.host = host_field(exporter.host_identity());
  return header;
}

std::vector<IpcRegionRecord> export_records(IpcExporter& exporter, std::span<const ExposedRegion> regions) {
  TH_REQUIRE(regions.size() <= kIpcRegionsPerAnswerMax);
  std::vector<IpcRegionRecord> records(regions.size());
  for (std::size_t i = 0; i < regions.size(); ++i) {
    IpcRegionRecord& record = records[i];
    record.bytes = regions[i].bytes;
    // Host memory goes over TCP (another process cannot map it with CUDA IPC); so does an empty
    // region (nothing to copy).
    if (!regions[i].on_device || regions[i].bytes == 0) continue;
    std::optional<IpcExport> exported;
    try {
      exported = exporter.export_region(regions[i].base, regions[i].bytes);
    } catch (const std::exception&) {
      // Unexported (a device error, no memory for it): the reader pulls it over TCP. Nothing may
      // escape a connection thread.
      exported.reset();
    }
    // An exporter's bug must not send a reader out of bounds: checked before sending, and by the
    // reader after receiving.
    if (!exported || !fits(exported->offset, regions[i].bytes, exported->allocation_bytes)) continue;
    record.exported = 1;
    record.offset = exported->offset;
    record.allocation_bytes = exported->allocation_bytes;
    record.handle = exported->handle;
  }
  return records;
}

namespace {

// The handles of every region of the grant, asked for in pages on one connection, or nullopt (why:
// in `fallback`).
std::optional<std::vector<IpcRegionRecord>> fetch_records(const Endpoint& source, GrantKey key, const GrantSecret& secret,
                                                          std::size_t regions, IpcImporter& importer,
                                                          const PullOptions& options, std::string& fallback) {
  // A grant holds the shard's tensors (kTensorsPerShardMax) and its packed region.
  if (regions > limits::kTensorsPerShardMax + 1) {
    fallback = "more regions than a shard may hold";
    return std::nullopt;
  }
  const std::string own_host = importer.host_identity();
  if (own_host.empty()) {
    fallback = "this process has no host identity for CUDA IPC";
    return std::nullopt;
  }
  std::vector<IpcRegionRecord> records;
  records.reserve(regions);
  try {
    Fd connection = connect_tcp(source, options.connect_timeout_ms);
    set_io_timeout(connection, std::max(options.io_timeout_ms, 1));
    while (records.size() < regions) {
      if (options.cancelled && options.cancelled()) {
        fallback = "cancelled";  // (the TCP pull that follows stops at once too)
        return std::nullopt;
      }
      const auto first = static_cast<std::uint32_t>(records.size());
      const auto count = static_cast<std::uint32_t>(std::min<std::size_t>(kIpcRegionsPerAnswerMax, regions - first));
      const IpcRequestFrame request{kIpcMagic, key.epoch, key.transfer, first, count, {0, 0}, secret};
      send_all(connection, &request, sizeof request);
      IpcAnswerFrame answer;
      // The first 16 bytes first: a server that does not know this protocol answers only those.
      static_assert(sizeof answer > 16);
      recv_all(connection, &answer, 16);
      if (answer.status == kUnknownProtocolStatus) {
        fallback = "the source does not serve CUDA IPC handles";
        return std::nullopt;
      }
      recv_all(connection, reinterpret_cast<std::byte*>(&answer) + 16, sizeof answer - 16);
      if (answer.status != 0) {
        fallback = answer.status == kIpcUnsupported ? "the source does not export this grant (partial, or no exporter)"
                   : answer.status == 1             ? "the source refused: no grant"
                                                    : "the source refused: out of bounds";
        return std::nullopt;
      }
      if (answer.grant_regions != regions) {
        fallback = "the source grants " + std::to_string(answer.grant_regions) + " regions, the reader has " +
                   std::to_string(regions);
        return std::nullopt;
      }
      if (answer.count != count) {
        fallback = "the source answered " + std::to_string(answer.count) + " regions of " + std::to_string(count);
        return std::nullopt;
      }
      if (first == 0) {
        if (answer.host != host_field(own_host)) {
          fallback = "the source is on another host";
          return std::nullopt;
        }
        if (answer.process == importer.process_identity()) {
          // CUDA cannot open a handle in the process that made it.
          fallback = "the source is this process";
          return std::nullopt;
        }
      }
      records.resize(first + count);
      recv_all(connection, records.data() + first, count * sizeof(IpcRegionRecord));
    }
  } catch (const SocketError& error) {
    fallback = std::string("asking for IPC handles: ") + error.what();
    return std::nullopt;
  }
  TH_ASSERT(records.size() == regions);
  return records;
}

}  // namespace

std::optional<PullOutcome> pull_over_ipc(const Endpoint& source, GrantKey key, const GrantSecret& secret,
                                         std::span<const LocalRegion> targets, const PullOptions& options,
                                         const TcpSide& tcp, std::string& fallback) {
  TH_REQUIRE(options.ipc != nullptr);
  TH_REQUIRE(!options.partial, "a partial source's memory is still written: it is read over TCP");
  IpcImporter& importer = *options.ipc;
  if (std::none_of(targets.begin(), targets.end(), [](const LocalRegion& t) { return t.on_device && t.bytes > 0; })) {
    return std::nullopt;  // nothing for IPC to do (and nothing to tell)
  }
  std::optional<std::vector<IpcRegionRecord>> records =
      fetch_records(source, key, secret, targets.size(), importer, options, fallback);
  if (!records) return std::nullopt;
  // After receiving, before any copy: every GPU target has a region of its size, inside the
  // allocation it was exported from.
  for (std::size_t i = 0; i < targets.size(); ++i) {
    const IpcRegionRecord& record = (*records)[i];
    if (record.bytes != targets[i].bytes) {
      fallback = "region " + std::to_string(i) + " has " + std::to_string(record.bytes) + " bytes at the source, " +
                 std::to_string(targets[i].bytes) + " here";
      return std::nullopt;
    }
    if (!targets[i].on_device || targets[i].bytes == 0) continue;
    if (record.exported != 1) {
      fallback = "the source could not export region " + std::to_string(i) +
                 " (not GPU memory there, or from a pool CUDA IPC cannot export)";
      return std::nullopt;
    }
    if (!fits(record.offset, record.bytes, record.allocation_bytes)) {
      fallback = "the source exported region " + std::to_string(i) + " outside its allocation";
      return std::nullopt;
    }
  }

  // In layout order: runs of host regions over TCP, GPU regions copied one by one. The prefix
  // that has arrived grows in order, as over TCP.
  PullOutcome outcome;
  std::uint64_t ready = 0;  // the prefix of the targets that has arrived
  std::uint64_t told = 0;   // what on_progress heard last: it hears of each growth once
  // Once a region was copied over IPC, nothing more is told until the grant is known to have been
  // live through the copies (below): revoke() cannot cut a device copy, and what on_progress hears
  // is served on to this reader's own readers at once.
  bool holding = false;
  std::uint64_t held = 0;
  auto tell = [&](std::uint64_t prefix) {
    if (holding) {
      held = std::max(held, prefix);
      return;
    }
    if (prefix <= told) return;
    told = prefix;
    if (options.on_progress) options.on_progress(prefix);
  };
  std::vector<IpcHandleBytes> used;  // the allocations this pull mapped: the importer keeps only these
  // The targets from `from` on over TCP: the run of host (or empty) regions there, or `all`.
  auto pull_rest_over_tcp = [&](std::size_t from, bool all) {
    std::size_t to = from;
    std::uint64_t bytes = 0;
    for (; to < targets.size() && (all || !targets[to].on_device || targets[to].bytes == 0); ++to) {
      bytes += targets[to].bytes;
    }
    if (bytes == 0) return to;
    PullOptions part = options;
    part.ipc = nullptr;
    const std::uint64_t base = ready;
    part.on_progress = [&, base](std::uint64_t part_ready) { tell(base + part_ready); };
    PullOutcome got = tcp.pull(targets.subspan(from, to - from), static_cast<std::uint32_t>(from), part);
    outcome.bytes += got.bytes;
    if (!got.ok()) {
      outcome.error = got.error;
      outcome.detail = std::move(got.detail);
      return to;
    }
    ready += bytes;
    tell(ready);
    return to;
  };
  for (std::size_t i = 0; i < targets.size() && outcome.ok();) {
    if (options.cancelled && options.cancelled()) {
      outcome.error = ReadError::kCancelled;
      outcome.detail = "cancelled";
      break;
    }
    if (!targets[i].on_device || targets[i].bytes == 0) {
      i = pull_rest_over_tcp(i, false);
      continue;
    }
    const IpcRegionRecord& record = (*records)[i];
    std::string failed;
    if (const IpcMapping mapped = importer.open(record.handle); mapped.base == nullptr) {
      failed = "could not open the IPC handle of region " + std::to_string(i);
    } else if (!fits(record.offset, record.bytes, mapped.bytes)) {
      // The source's offset or size does not match what the driver mapped here: a copy would
      // read outside the mapping (a sticky fault of the whole context, or this process's memory).
      failed = "the source placed region " + std::to_string(i) + " outside the allocation it exported";
    } else {
      if (std::find(used.begin(), used.end(), record.handle) == used.end()) used.push_back(record.handle);
      try {
        importer.copy(targets[i].base, mapped.base + record.offset, record.bytes);
      } catch (const DeviceCopyError& error) {
        // The mapping may be stale (the source freed the allocation): open it afresh next time.
        importer.forget(record.handle);
        failed = "copying region " + std::to_string(i) + " over CUDA IPC: " + error.what();
      }
    }
    if (!failed.empty()) {
      fallback = std::move(failed);
      if (outcome.bytes_over_ipc == 0 && outcome.bytes == 0) return std::nullopt;  // all of it over TCP
      // The rest over TCP; what arrived stays (the source is complete and unchanged while granted,
      // and it was told to on_progress already, so it must not be written again).
      outcome.ipc_fallback = fallback;
      pull_rest_over_tcp(i, true);
      break;
    }
    outcome.bytes += record.bytes;
    outcome.bytes_over_ipc += record.bytes;
    ready += record.bytes;
    holding = true;
    tell(ready);
    ++i;
  }
  importer.keep_only(used);
  // The copies read the source's memory with no server in the way, so revoke() could not cut them
  // off: a grant still live once they all completed proves that the memory was not yet handed back
  // to its owner meanwhile (net/ipc.h). A revoked one fails the read as a read cut off over TCP does.
  if (outcome.ok() && outcome.bytes_over_ipc > 0) {
    if (options.cancelled && options.cancelled()) {
      outcome.error = ReadError::kCancelled;
      outcome.detail = "cancelled";
    } else if (const std::optional<ReadError> why = tcp.still_granted()) {
      outcome.error = *why;
      outcome.detail = "reading transfer " + std::to_string(key.transfer) + " epoch " + std::to_string(key.epoch) +
                       " from " + source.to_string() +
                       (*why == ReadError::kRefused ? ": the grant was revoked while its GPU memory was copied over CUDA IPC"
                                                    : ": the source stopped answering after a copy over CUDA IPC");
    }
  }
  if (outcome.ok() && holding) {
    holding = false;
    tell(held);
  }
  TH_ASSERT(outcome.bytes_over_ipc <= outcome.bytes);
  return outcome;
}

}  // namespace ipc_detail
}  // namespace th::net
