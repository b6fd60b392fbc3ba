// Reading a version from a source replica of another layout (README "Layouts", DESIGN.md §7):
// the reader thread's read when StartRead::reshard is set. Not installed.
//
// The hub names every shard of the source replica with its layout and checksums, and has told each
// to serve this (transfer, epoch) with the read's secret. The reader plans which pieces of which
// source shards cover its own pieces (core/reshard.h), reads each such piece WHOLE into a CPU
// scratch buffer, verifies it against its source shard's checksum, and lands the parts it needs
// in its registered tensors, converting the dtype (client/convert.h). Then it computes the
// checksums of its own tensors as assembled, which the agent reports (ReadFinished::checksums).
//
// Costs, by design:
//   - a piece is read whole even where the reader needs a part of it (a TP=4 reader of a TP=2
//     source reads twice what it keeps): a checksum covers a whole source tensor, and a part
//     cannot be verified;
//   - the small tensors travel packed (client/plan.h): a source shard's needed packed pieces come
//     with one read of its packed region, from its start to the end of the last one needed (the
//     TCP data plane reads a region from offset 0);
//   - up to 4 pieces are in flight at once (kReshardPullsInFlightMax), each on its own
//     connection (the read's rate cap shared among them): one piece's bytes cross the network
//     while others are verified and landed; fewer where their scratch buffers would pass 1 GiB
//     (kReshardScratchBytesMax) or a thread cannot be started;
//   - a big piece that is one run of a destination tensor's elements in host memory, of the same
//     dtype (outer-dimension splits), is read straight into that tensor and verified there;
//   - memory: a scratch buffer per piece in flight, the largest of (any other big piece, a source
//     shard's packed prefix), plus, where tensors are on a GPU, one host buffer each for what one
//     piece lands there;
//   - reads go over the TCP data plane (net::pull), which every source serves whatever its
//     transport; the RDMA transport reads whole shards only.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "client/plan.h"
#include "core/messages.h"
#include "net/data_plane.h"

namespace th::client_impl {

// Where a shard's tensors sit on its data plane: region 0 is the packed buffer of the small
// tensors (bytes < kPackedTensorBytesMax) at their packed offsets, in layout order, if that buffer
// has any byte; then each big tensor is a region of its own, in layout order. What a source serves
// (Plan, regions_of) and what a seed copy holds (seed_copy_of) are laid out by this.
struct DataPlaneGeometry {
  struct Place {
    std::uint32_t region = 0;
    std::uint64_t offset_bytes = 0;  // in that region
  };
  std::vector<Place> place;                  // per tensor, layout order
  std::vector<std::uint64_t> packed_offset;  // per tensor: its place in the packed buffer, or Plan::kNotPacked
  std::uint64_t packed_bytes = 0;
  std::vector<std::size_t> big;  // layout indices of the tensors with a region of their own
};
DataPlaneGeometry data_plane_geometry(const ShardLayout& layout);

struct ReshardOutcome {
  // None, and not cancelled: the buffers hold the version (and `checksums` says what they hold).
  std::optional<ReadFailure> failure;
  bool cancelled = false;  // the read was replaced or dropped: nothing to report
  // Why it failed, for the log: names the tensor, or the source shard and its endpoint.
  std::string detail;
  // Success: the checksums of the reader's tensors as assembled, in its layout order (the same
  // blocked checksum as publish computes).
  ChecksumsRef checksums;
  std::uint64_t bytes_read = 0;  // from the sources: whole pieces and packed prefixes
  std::uint64_t pieces_read = 0;
};

// Carries out `read` (read.reshard non-empty: every shard of the source replica, in shard order)
// into the buffers of `plan` (packed: its packed buffer, host memory, plan.packed_bytes long).
// Every tensor of the plan must be a piece (TensorKind::kPiece); one that is not, or that the
// source cannot fill (core/reshard.h names why), fails the read with kSourceRefused, the tensor
// named. A piece that does not match its checksum fails it with kChecksumMismatch, as does an
// assembled tensor that differs from read.checksums where the hub sent them. `pull` gives the
// timeouts, chunk size and rate of the reads (its streams, partial, ipc, progress and cancel
// hooks are set here); `cancelled` is polled between pieces and during each read.
// Runs on the reader thread (or a seed's): blocks for the whole read.
// `in_place`: a piece may be received straight into its destination before it is verified; false
// where the buffers already hold verified bytes of the version that others may be reading (an
// earlier read's ready prefix), which only verified bytes may overwrite.
ReshardOutcome read_resharded(const StartRead& read, const Plan& plan, std::byte* packed, const net::PullOptions& pull,
                              const std::atomic<bool>& cancelled, bool in_place = true);

}  // namespace th::client_impl
