// Patch reads (README "Delta versions", issue 35; not installed): a shard that holds version v-1
// reads v as the source's patches, applies them in place and verifies v's checksums; the source
// serves patches it made (Handle::write_tensor) or applied. Over the ordinary data plane: a grant
// exposes, per tensor in layout order, its patch or (where it has none) the tensor's bytes, and the
// reader pulls them into a staging buffer per patch and straight into the tensors otherwise.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "client/plan.h"
#include "core/messages.h"
#include "net/transport.h"

namespace th::client_impl {

// What a shard keeps of the patch its buffers' version came with: served to readers that hold the
// base (ServeRead::patch) until the buffers change.
struct KeptPatch {
  Version version = 0;
  PatchRef info;                                 // the base, and the sizes announced per tensor
  std::vector<std::vector<std::byte>> patches;   // per tensor (layout order); empty: none (read whole)
};

// What a source exposes for a patch read of its shard: per tensor its patch, or its bytes.
std::vector<net::ExposedRegion> patch_regions(const KeptPatch& kept, const Plan& plan, const std::byte* packed);

struct PatchReadOutcome {
  std::optional<ReadFailure> failure;  // none: every tensor holds the version and verified
  std::string detail;                  // why it failed, for the log
  bool cancelled = false;              // replaced by a newer read: nothing to report
  std::uint64_t bytes_read = 0;
  std::uint64_t elements_changed = 0;
  std::shared_ptr<KeptPatch> kept;     // on success: the patch, to serve onwards
};

// Reads `read` (StartRead::patch set) into the shard's tensors, which hold the patch's base, whose
// checksums are `base_checksums` (null: unknown, so the read is refused without a byte written).
// Every patch is checked whole before it writes (core/patch.h); a patch whose base checksum is not
// the one recorded for the tensor is the source's fault (kChecksumMismatch: two such reads and the
// server stops placing its patch) unless the tensor holds the version already (an earlier attempt
// of the same transfer patched it). Then every tensor is verified against the version's checksums.
// CPU tensors only, for now: a shard with GPU tensors refuses (kPatchBaseMismatch), and reads the
// bytes next.
PatchReadOutcome read_patch(net::DataTransport& transport, const StartRead& read, const Plan& plan, std::byte* packed,
                            const ChecksumsRef& base_checksums, const net::PullOptions& options,
                            const std::atomic<bool>& cancelled);

}  // namespace th::client_impl
