// Every queue, fan-out, retry and retained set in core/ has a named upper bound here. The hub asserts
// them (our bug) or rejects a request that would cross one with Errc::kLimitExceeded (the caller's
// choice), so that no input can make the state grow without bound.
#pragma once

#include <cstddef>
#include <cstdint>

namespace th::limits {

inline constexpr std::size_t kModelsMax = 64;
inline constexpr std::size_t kReplicasPerModelMax = 16384;
inline constexpr std::uint32_t kShardsMax = 256;  // model-parallel group size
inline constexpr std::size_t kTensorsPerShardMax = 65536;
// Layouts (core/box.h): a tensor's rank, its pieces in one layout, and the byte runs that fill
// one piece from another layout's pieces (a column split finer than this is packed at the source).
inline constexpr std::size_t kBoxRankMax = 8;
inline constexpr std::size_t kBoxesPerTensorMax = 4096;
inline constexpr std::size_t kCopyRunsPerTensorMax = std::size_t{1} << 20;
// Pieces of tensors in all of a replica's shards, checked for tiling once per publish.
inline constexpr std::size_t kPiecesPerReplicaMax = std::size_t{1} << 20;
// Layouts of one model's replicas (a trainer's and each kind of rollout's): kept for the life of
// the model, each a description of every shard's tensors.
inline constexpr std::size_t kLayoutsPerModelMax = 16;
// What the hub counts for one tensor's description (ShardLayout::description_bytes): its name,
// its shape and box at 8 bytes a number, and this much besides (about a TensorSpec and the
// allocator's slack). A constant, not sizeof, so that every build and the checkers count alike.
inline constexpr std::uint64_t kTensorDescriptionOverheadBytes = 96;
// The most an operator may let the descriptions of tensors take (HubSettings::description_bytes_max).
inline constexpr std::uint64_t kDescriptionBytesCeiling = std::uint64_t{64} << 30;
inline constexpr std::size_t kNameBytesMax = 256;  // model, replica, datacenter, role, tensor names
inline constexpr std::size_t kEndpointBytesMax = 512;
inline constexpr std::size_t kDatacentersMax = 256;

// Retention: how far back `latest-k` reaches and how many versions one open may pin.
inline constexpr std::uint64_t kKeepLatestMax = 64;
inline constexpr std::size_t kPinnedPerOpenMax = 16;
// A replica holds at most one offload copy per retained version.
inline constexpr std::size_t kOffloadsPerReplicaMax = kKeepLatestMax + 1 + kPinnedPerOpenMax;

// The largest version a model takes. Versions are the hub's order within a model's life (a lower
// one than latest is refused unless the model knows it), so one publish near 2^64 would leave a
// life no room above it; and no sum with the windows here can wrap below this.
inline constexpr std::uint64_t kVersionMax = (std::uint64_t{1} << 63) - 1;

// Versions whose last copy is gone are remembered (to answer "unavailable" instead of "not found")
// for this many versions below `latest`.
inline constexpr std::uint64_t kForgottenVersionsWindow = 1024;
static_assert(kVersionMax + kForgottenVersionsWindow > kVersionMax, "version sums cannot wrap");

// Replica transactions: how far the fastest shard of a replica may run ahead of the slowest one.
// Calls that wait for the whole group (publish, replicate, update, unpublish, close) stop a fast
// shard at once, so only list/wait can pile up here.
inline constexpr std::size_t kTxnWindowMax = 64;

// A reader's source may fail this many times in one transfer before the hub gives up on it.
inline constexpr std::uint32_t kSourceFailuresPerTransferMax = 64;

// Rate-aware source selection (core/hub_rates.cpp): a reader gives its source to a faster one at
// most this many times in one transfer (each time it reads again from byte 0 of its new source,
// and only early in its read), and a reader passes over at most this many slow copies before it
// takes the first of them.
inline constexpr std::uint32_t kDisplacementsPerTransferMax = 16;
inline constexpr std::size_t kSlowSourcesPassedMax = 16;
// ... and weighs at most this many copies up a candidate's chain of sources (the walk runs for
// every reader that joins a chain: the whole chain would make a fleet's updates quadratic).
inline constexpr std::size_t kChainHopsWeighedMax = 16;

// Upper bound on heartbeat timeout and call deadlines accepted from a client (one day).
inline constexpr std::int64_t kDeadlineMsMax = 24LL * 3600 * 1000;

}  // namespace th::limits
