// TensorHub's public value types: what a libthclient user passes and gets back.
//
// The core (core/types.h, core/messages.h) uses these same types; everything else of the core
// stays private to the library.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace th {

using Version = std::uint64_t;
// Milliseconds (on the clock of whoever drives the state machine; virtual in the simulator).
using TimeMs = std::int64_t;

// ---- Tensors ------------------------------------------------------------------------------------

enum class DType : std::uint8_t {
  kFloat32, kFloat16, kBFloat16, kFloat8E4M3, kFloat8E5M2, kFloat64,
  kInt8, kUInt8, kInt16, kInt32, kInt64, kBool,
};
inline constexpr int kDTypeCount = 12;
std::string_view dtype_name(DType dtype);
std::optional<DType> parse_dtype(std::string_view name);
std::uint32_t dtype_bytes(DType dtype);  // bytes per element

// Where a shard's piece of a logical tensor sits in the whole of it (README "Layouts"): the
// elements per dimension, outermost first, and a box of them (offset and extent per dimension).
// A piece's buffer holds its box row-major, as a contiguous torch tensor of shape `extent` does.
using Shape = std::vector<std::uint64_t>;
struct Box {
  Shape offset;
  Shape extent;
  friend bool operator==(const Box&, const Box&) = default;
};

// ---- Retention --------------------------------------------------------------------------------------

// What one open asks the hub to keep available. The hub keeps the union of the rules of every open
// shard of a model. `keep_latest = k` keeps versions latest-k … latest (so `latest-k` stays readable).
struct Retention {
  std::optional<std::uint64_t> keep_latest;
  std::vector<Version> pinned;

  friend bool operator==(const Retention&, const Retention&) = default;
};

// ---- Answers ------------------------------------------------------------------------------------

// update(): moved to a newer version; none is newer than the one held; or one is, but not yet
// readable here (smart skipping, offload seeding: ask again).
enum class UpdateStatus : std::uint8_t { kUpdated, kNoNewerVersion, kNotYet };
std::string_view update_status_name(UpdateStatus status);

// list(): a model's versions and replicas.
struct ListSnapshot {
  struct VersionInfo {
    Version version = 0;
    std::uint32_t complete = 0;  // complete copies (primary and offload)
    std::uint32_t partial = 0;   // copies being published or received
    bool retained = false;
    bool offloaded = false;
    friend bool operator==(const VersionInfo&, const VersionInfo&) = default;
  };
  struct ReplicaInfo {
    std::string name;
    std::uint64_t incarnation = 0;
    std::string datacenter;
    bool spot = false;
    std::string role;
    std::uint32_t num_shards = 0;
    std::string state;  // "empty", "publishing", "receiving", "waiting", "complete", "draining", …
    std::optional<Version> version;
    std::uint32_t serving = 0;  // transfers this replica's copies serve now
    std::vector<Version> offloads;
    friend bool operator==(const ReplicaInfo&, const ReplicaInfo&) = default;
  };
  std::string model;
  std::optional<Version> latest;
  std::vector<VersionInfo> versions;
  std::vector<ReplicaInfo> replicas;
  friend bool operator==(const ListSnapshot&, const ListSnapshot&) = default;
};

// wait(): what to wait for.
struct WaitPredicate {
  enum class Kind : std::uint8_t {
    kVersionAtLeast,  // some version >= `version` has been published
    kReplicasHold,    // at least `replicas_min` replicas hold `version` completely
    kRoleHolds,       // some replica has role `role`, and every one that is open (not closing)
                      // holds a complete version >= `version`
  };
  Kind kind = Kind::kVersionAtLeast;
  Version version = 0;
  std::uint32_t replicas_min = 1;
  std::string role;

  friend bool operator==(const WaitPredicate&, const WaitPredicate&) = default;
};

}  // namespace th
