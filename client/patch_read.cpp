#include "client/patch_read.h"

#include <cstring>
#include <new>
#include <span>
#include <utility>

#include "client/checksum.h"
#include "core/patch.h"
#include "net/socket.h"

namespace th::client_impl {

namespace {

// Where tensor `index` of the plan lives in host memory, as served: a small one in the packed
// buffer (what publish and reads keep there), a big one in its own memory.
const std::byte* served_bytes(const Plan& plan, const std::byte* packed, std::size_t index) {
  return plan.packed_offset[index] != Plan::kNotPacked ? packed + plan.packed_offset[index] : plan.tensor_data[index];
}

}  // namespace

std::vector<net::ExposedRegion> patch_regions(const KeptPatch& kept, const Plan& plan, const std::byte* packed) {
  const auto& tensors = plan.layout->tensors();
  TH_REQUIRE(kept.patches.size() == tensors.size(), "a kept patch has an entry per tensor");
  std::vector<net::ExposedRegion> regions;
  for (std::size_t index = 0; index < tensors.size(); ++index) {
    if (!kept.patches[index].empty()) {
      regions.push_back({kept.patches[index].data(), kept.patches[index].size(), false});
    } else if (tensors[index].bytes > 0) {  // (an empty tensor has no region on either side)
      const bool device = plan.packed_offset[index] == Plan::kNotPacked && plan.device_tensor(index);
      regions.push_back({served_bytes(plan, packed, index), tensors[index].bytes, device});
    }
  }
  return regions;
}

PatchReadOutcome read_patch(net::DataTransport& transport, const StartRead& read, const Plan& plan, std::byte* packed,
                            const ChecksumsRef& base_checksums, const net::PullOptions& options,
                            const std::atomic<bool>& cancelled) {
  TH_REQUIRE(read.patch != nullptr && read.checksums != nullptr);
  PatchReadOutcome outcome;
  auto fail = [&](ReadFailure failure, std::string detail) {
    outcome.failure = failure;
    outcome.detail = std::move(detail);
    return outcome;
  };
  const auto& tensors = plan.layout->tensors();
  const std::vector<std::uint64_t>& sizes = read.patch->tensor_bytes;
  if (sizes.size() != tensors.size() || read.checksums->size() != tensors.size()) {
    return fail(ReadFailure::kSourceRefused, "the patch has " + std::to_string(sizes.size()) + " sizes for " +
                                                 std::to_string(tensors.size()) + " tensors");
  }
  // Refusals before a byte moves: the bytes are read next, from wherever the server says.
  if (plan.gpu != nullptr) {
    return fail(ReadFailure::kPatchBaseMismatch, "patch reads into GPU tensors are not built yet: reading the bytes");
  }
  if (base_checksums == nullptr || base_checksums->size() != tensors.size()) {
    return fail(ReadFailure::kPatchBaseMismatch, "the buffers' checksums of version " + std::to_string(read.patch->base) +
                                                     " are not known here: reading the bytes");
  }
  auto kept = std::make_shared<KeptPatch>();
  kept->version = read.version;
  kept->info = read.patch;
  kept->patches.resize(tensors.size());
  std::vector<net::LocalRegion> targets;
  for (std::size_t index = 0; index < tensors.size(); ++index) {
    if (sizes[index] > patch_bytes_limit(tensors[index].bytes)) {  // (the server refuses such a publish)
      return fail(ReadFailure::kSourceRefused, "the patch of tensor '" + tensors[index].name + "' is over 40 % of it");
    }
    if (sizes[index] != 0) {
      try {
        kept->patches[index].resize(sizes[index]);
      } catch (const std::bad_alloc&) {
        return fail(ReadFailure::kPatchBaseMismatch, "no memory for the patch of tensor '" + tensors[index].name +
                                                         "' (" + std::to_string(sizes[index]) + " bytes): reading the bytes");
      }
      targets.push_back({kept->patches[index].data(), sizes[index], false});
    } else if (tensors[index].bytes > 0) {
      targets.push_back({plan.tensor_data[index], tensors[index].bytes, false});
    }
  }
  net::PullOptions pull = options;
  pull.partial = false;  // a patch is served by complete copies only
  pull.start_bytes = 0;
  pull.cancelled = [&] { return cancelled.load(); };
  const net::PullOutcome pulled = [&] {
    try {
      return transport.pull(net::parse_endpoint(read.source.endpoint), {read.transfer, read.epoch}, read.secret,
                            targets, pull);
    } catch (const net::SocketError& bad_endpoint) {
      return net::PullOutcome{0, net::ReadError::kUnreachable, bad_endpoint.what()};
    }
  }();
  outcome.bytes_read = pulled.bytes;
  if (pulled.error == net::ReadError::kCancelled || cancelled.load()) {
    outcome.cancelled = true;
    return outcome;
  }
  if (!pulled.ok()) {
    // The tensors read whole may be partly written: the bytes are read next, verified as always.
    return fail(pulled.error == net::ReadError::kRefused ? ReadFailure::kSourceRefused : ReadFailure::kSourceUnreachable,
                pulled.detail);
  }
  for (std::size_t index = 0; index < tensors.size(); ++index) {
    if (sizes[index] == 0) continue;
    std::span<std::byte> tensor(plan.tensor_data[index], tensors[index].bytes);
    Result<std::uint64_t> applied =
        apply_patch(kept->patches[index], dtype_bytes(tensors[index].dtype), tensor, (*base_checksums)[index]);
    if (applied.ok()) {
      outcome.elements_changed += applied.value();
      continue;
    }
    if (applied.error().code == Errc::kChecksumConflict) {
      // Patched by an earlier attempt of this transfer (the server moved it). Else the patch was
      // made against other bytes than the base whose checksums this shard recorded when it held
      // it whole (none was hashed now): the source's patch is at fault, as for a malformed one.
      if (checksum(tensor.data(), tensor.size()) == (*read.checksums)[index]) continue;
      return fail(ReadFailure::kChecksumMismatch, "the patch of tensor '" + tensors[index].name + "' from " +
                                                      read.source.replica + " is not against version " +
                                                      std::to_string(read.patch->base) + " as this shard holds it: " +
                                                      applied.error().detail);
    }
    // Malformed, or made for another tensor: the source's patch is at fault, nothing was written.
    return fail(ReadFailure::kChecksumMismatch, "the patch of tensor '" + tensors[index].name + "' from " +
                                                    read.source.replica + ": " + applied.error().detail);
  }
  // End to end: every tensor against the version's checksum, then the packed copies that serve on.
  for (std::size_t index = 0; index < tensors.size(); ++index) {
    if (checksum(plan.tensor_data[index], tensors[index].bytes) != (*read.checksums)[index]) {
      return fail(ReadFailure::kChecksumMismatch, "tensor '" + tensors[index].name + "' of version " +
                                                      std::to_string(read.version) + " from " + read.source.replica +
                                                      (sizes[index] != 0 ? " (patched)" : "") +
                                                      " does not match its checksum");
    }
    if (plan.packed_offset[index] != Plan::kNotPacked) {
      std::memcpy(packed + plan.packed_offset[index], plan.tensor_data[index], tensors[index].bytes);
    }
  }
  outcome.kept = std::move(kept);
  return outcome;
}

}  // namespace th::client_impl
