// Value types shared by every layer: identifiers, version selectors, tensor layouts, retention rules.
#pragma once

#include <array>
#include <bitset>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "core/box.h"
#include "core/limits.h"
#include "core/result.h"
#include "tensorhub/types.h"

namespace th {

// A client is one shard handle, named by the shell (a connection may carry several handles).
using ClientId = std::uint64_t;
using TransferId = std::uint64_t;
// A data-plane grant's capability (ServeRead::secret): 128 bits.
using GrantSecret = std::array<std::uint64_t, 2>;

// One bit per shard of a replica.
using ShardSet = std::bitset<limits::kShardsMax>;

// Model, replica, datacenter, role and tensor names: at most kNameBytesMax bytes of UTF-8 text
// without control characters; empty only where the field is optional. (Names show in logs, in
// th-ctl's tables and JSON, in the timeline's JSON and in Prometheus labels, which all need text.)
bool valid_name(std::string_view name, bool may_be_empty);
// Well-formed UTF-8 (no overlong forms, no surrogates, at most U+10FFFF) without control
// characters (C0, DEL, C1), line or paragraph separators, bidirectional formatting characters
// (which make a name read as another) or the zero-width no-break space / byte order mark.
bool printable_utf8(std::string_view text);

// ---- Version selectors: `N`, `latest`, `latest-k` -------------------------------------------------

struct Selector {
  enum class Kind : std::uint8_t { kAbsolute, kLatest };
  Kind kind = Kind::kLatest;
  std::uint64_t value = 0;  // the version (kAbsolute) or k (kLatest: latest minus k)

  static Selector absolute(Version version) { return {Kind::kAbsolute, version}; }
  static Selector latest(std::uint64_t minus = 0) { return {Kind::kLatest, minus}; }

  friend bool operator==(const Selector&, const Selector&) = default;
};

// Parses "42", "latest", "latest-3". Anything else (spaces, signs, "latest-", overflow) is kBadSelector.
Result<Selector> parse_selector(std::string_view text);
std::string format_selector(const Selector& selector);

// ---- Tensor layouts ---------------------------------------------------------------------------------


// What a registered tensor is, as far as its shard said (README "Layouts").
enum class TensorKind : std::uint8_t {
  kBytes,  // a size only (register_tensor of bytes): matched by name, dtype and size
  kLocal,  // a tensor of `shape` that belongs to its shard alone (such as a slice the engine owns)
  kPiece,  // the box `box` of the model's logical tensor `name`, whose (global) shape is `shape`;
           // a replica's pieces of one tensor tile it
};
std::string_view tensor_kind_name(TensorKind kind);

struct TensorSpec {
  std::string name;
  DType dtype = DType::kFloat32;
  std::uint64_t bytes = 0;
  TensorKind kind = TensorKind::kBytes;
  Shape shape{};  // kLocal: the tensor's shape; kPiece: the logical tensor's; kBytes: empty
  Box box{};      // kPiece: where its bytes sit in `shape`; otherwise empty

  // The shape of the bytes themselves, where the registering shard said it.
  std::optional<Shape> buffer_shape() const;

  friend bool operator==(const TensorSpec&, const TensorSpec&) = default;
};

// The ordered tensors one shard registers. Immutable once made, shared by reference; `digest` makes
// the common comparison (equal layouts) one integer compare.
class ShardLayout {
 public:
  static Result<std::shared_ptr<const ShardLayout>> make(std::vector<TensorSpec> tensors);

  const std::vector<TensorSpec>& tensors() const { return tensors_; }
  std::uint64_t digest() const { return digest_; }
  std::uint64_t total_bytes() const { return total_bytes_; }
  // What the hub counts for keeping this description (limits::kTensorDescriptionOverheadBytes).
  std::uint64_t description_bytes() const { return description_bytes_; }

  // Why `other` (a reader's, or another publisher's) is not compatible with this layout (the
  // model's), or nothing when it is. Tensors of kind kBytes on either side compare by dtype and
  // size; tensors whose shapes both sides said compare by shape too; pieces by global shape and box.
  std::optional<std::string> mismatch(const ShardLayout& other) const;

  // What the model knows of a shard's tensors once `other`, compatible with `known` (mismatch()
  // said nothing), was accepted too: each tensor as the more specific of the two says it (a piece
  // over a shape over bytes). Without it, two replicas that each matched a model that said only
  // bytes could say contradictory things (32×64 and 64×32) and read each other's bytes. `known`
  // itself when `other` adds nothing.
  static std::shared_ptr<const ShardLayout> refine(const std::shared_ptr<const ShardLayout>& known,
                                                   const std::shared_ptr<const ShardLayout>& other);

 private:
  explicit ShardLayout(std::vector<TensorSpec> tensors);
  std::vector<TensorSpec> tensors_;
  std::uint64_t digest_ = 0;
  std::uint64_t total_bytes_ = 0;
  std::uint64_t description_bytes_ = 0;
};
using LayoutRef = std::shared_ptr<const ShardLayout>;

// One checksum per tensor of a shard, in layout order (computed by the publishing client).
using Checksums = std::vector<std::uint64_t>;
using ChecksumsRef = std::shared_ptr<const Checksums>;

// A shard's patch of a version against an earlier one (core/patch.h): what a reader whose buffers
// hold `base` reads instead of the version's bytes. Per tensor of the shard, in layout order, the
// bytes of its patch; 0: the tensor has none (too much of it changed) and is read whole.
struct PatchInfo {
  Version base = 0;
  std::vector<std::uint64_t> tensor_bytes;

  // The bytes a patch read moves: the patches, and the whole tensors that have none.
  std::uint64_t read_bytes(const ShardLayout& layout) const;
  friend bool operator==(const PatchInfo&, const PatchInfo&) = default;
};
using PatchRef = std::shared_ptr<const PatchInfo>;

// ---- Hub settings -----------------------------------------------------------------------------------

struct HubSettings {
  TimeMs heartbeat_timeout_ms = 10'000;
  // How long a re-opened replica (after a server failover) waits for all of its shards.
  TimeMs barrier_timeout_ms = 30'000;
  // How long a draining copy (unpublish, an update's old copy, close, an offload's release) waits
  // for its readers. Past it each reader's grant is revoked (StopServing: TCP cuts the connection,
  // RDMA invalidates the window) and the reader reads elsewhere, later, or is told the version is
  // unavailable: a slow or throttled reader holds a trainer this long at most. 30 s: three
  // heartbeat timeouts (a dead reader is evicted first), and a healthy reader of a big shard over
  // TCP finishes (17 GB at 10 Gbit/s: 14 s).
  TimeMs drain_grace_ms = 30'000;
  // Pipeline replication: a replica still receiving a version already serves it to others.
  bool pipeline = true;
  // Transfers one source copy serves at a time to readers of its own datacenter; as many again to
  // readers of other datacenters (issue 34: a seed's slow read across datacenters must not hold
  // the slot local readers need). Under pipeline replication the paper uses 1.
  std::uint32_t fanout_max = 1;
  // `update` answers "not yet" while a datacenter's only copies hang off a cross-datacenter seeder.
  bool smart_skipping = true;
  // Rate-aware source selection (issue 34; README "What happens underneath"): the hub measures
  // how fast each replica receives, and a reader does not pipeline behind a copy that receives at
  // well under its own rate while another can serve it; if none can, it takes that copy's source
  // and the slower copy reads behind it (early in its read only).
  bool rate_aware_sources = true;
  // Offload seeding (paper §4.3.4): the first `update` of a datacenter that would read a version
  // across datacenters instead has it read, in the background, into a CPU copy of its replica's
  // (an offload copy that seeds the datacenter) and answers "not yet" at once; the next update
  // reads that local copy. Trades one model's worth of CPU memory per datacenter for GPU stall.
  bool offload_seeding = false;
  // Copy and transfer ids count up from above this. A shell gives each server a base of its own
  // (drawn at random), so that a client never takes an id of a failed server for one of its
  // successor's (an offload copy is named by id; see Offload).
  std::uint64_t id_base = 0;
  // Keys the secrets of data-plane grants (GrantSecret). th-server draws it from the OS at start;
  // the simulator and the tests leave it zero (a key is needed, not its secrecy, to check them).
  std::array<std::uint64_t, 2> grant_secret_key{};
  // A model ends once it has had no replica this long: its versions, latest and layouts are
  // forgotten, and its name may be opened afresh (with another shard count or layout; a run that
  // restarts from step 0). No call can be waiting then: each was answered as its replica went.
  TimeMs model_grace_ms = 60'000;
  // The tensor descriptions the hub keeps (layouts: names, shapes, boxes; see
  // ShardLayout::description_bytes), per model and for all models together. A publish, replicate
  // or resume that would pass either is refused (kLimitExceeded); a model's are freed when it ends.
  // 512 MiB is a 16-shard replica of 65,536 tensors a shard with 256-byte names, about.
  std::uint64_t model_description_bytes_max = std::uint64_t{512} << 20;
  std::uint64_t description_bytes_max = std::uint64_t{2} << 30;
};

inline constexpr std::uint64_t kIdBaseMax = 1ULL << 62;

// Checks settings before a hub is built from them.
Status validate(const HubSettings& settings);

}  // namespace th
