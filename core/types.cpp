#include "core/types.h"

#include <algorithm>
#include <array>
#include <charconv>
#include <limits>

namespace th {

bool printable_utf8(std::string_view text) {
  std::size_t i = 0;
  while (i < text.size()) {
    const auto lead = static_cast<unsigned char>(text[i]);
    if (lead < 0x80) {
      if (lead < 0x20 || lead == 0x7F) return false;
      ++i;
      continue;
    }
    std::size_t length = 0;
    std::uint32_t code = 0;
    if (lead >= 0xC2 && lead <= 0xDF) {
      length = 2;
      code = lead & 0x1Fu;
    } else if (lead >= 0xE0 && lead <= 0xEF) {
      length = 3;
      code = lead & 0x0Fu;
    } else if (lead >= 0xF0 && lead <= 0xF4) {
      length = 4;
      code = lead & 0x07u;
    } else {
      return false;  // a continuation byte, an overlong 2-byte lead (C0, C1), or past U+10FFFF
    }
    if (i + length > text.size()) return false;
    for (std::size_t k = 1; k < length; ++k) {
      const auto next = static_cast<unsigned char>(text[i + k]);
      if ((next & 0xC0u) != 0x80u) return false;
      code = (code << 6) | (next & 0x3Fu);
    }
    const bool overlong = (length == 3 && code < 0x800) || (length == 4 && code < 0x10000);
    const bool surrogate = code >= 0xD800 && code <= 0xDFFF;
    if (overlong || surrogate || code > 0x10FFFF) return false;
    const bool c1_control = code >= 0x80 && code <= 0x9F;
    const bool invisible_or_bidi = (code >= 0x200B && code <= 0x200F) || (code >= 0x2028 && code <= 0x202E) ||
                                   (code >= 0x2066 && code <= 0x2069) || code == 0xFEFF;
    if (c1_control || invisible_or_bidi) return false;
    i += length;
  }
  return true;
}

bool valid_name(std::string_view name, bool may_be_empty) {
  if (name.empty()) return may_be_empty;
  return name.size() <= limits::kNameBytesMax && printable_utf8(name);
}

namespace detail {
void result_misuse(const char* what, const Error* error) {
  std::string message = what;
  if (error != nullptr) {
    message += ": " + std::string(errc_name(error->code));
    if (!error->detail.empty()) message += ": " + error->detail;
  }
  throw AssertionFailure(message);
}
}  // namespace detail

std::string_view errc_name(Errc code) {
  switch (code) {
    case Errc::kInvalidArgument: return "invalid-argument";
    case Errc::kBadSelector: return "bad-selector";
    case Errc::kUnknownClient: return "unknown-client";
    case Errc::kAlreadyOpen: return "already-open";
    case Errc::kShardAlreadyOpen: return "shard-already-open";
    case Errc::kOpenMismatch: return "open-mismatch";
    case Errc::kStaleIncarnation: return "stale-incarnation";
    case Errc::kSequenceGap: return "sequence-gap";
    case Errc::kLimitExceeded: return "limit-exceeded";
    case Errc::kVersionNotFound: return "version-not-found";
    case Errc::kVersionUnavailable: return "version-unavailable";
    case Errc::kStaleVersion: return "stale-version";
    case Errc::kNotPublished: return "not-published";
    case Errc::kAlreadyHolding: return "already-holding";
    case Errc::kLayoutMismatch: return "layout-mismatch";
    case Errc::kChecksumConflict: return "checksum-conflict";
    case Errc::kDivergentCall: return "divergent-call";
    case Errc::kReplicaEvicted: return "replica-evicted";
    case Errc::kReplicaClosed: return "replica-closed";
    case Errc::kBarrierTimeout: return "barrier-timeout";
    case Errc::kTimeout: return "timeout";
    case Errc::kPermissionDenied: return "permission-denied";
    case Errc::kUnavailable: return "unavailable";
    case Errc::kLastRetainedCopy: return "last-retained-copy";
    case Errc::kCancelled: return "cancelled";
  }
  return "unknown-error";
}

// ---- Selectors ------------------------------------------------------------------------------------

namespace {

// Parses a non-empty run of decimal digits that fills `text` exactly. No sign, no spaces, no overflow.
std::optional<std::uint64_t> parse_decimal(std::string_view text) {
  if (text.empty()) return std::nullopt;
  for (char c : text) {
    if (c < '0' || c > '9') return std::nullopt;
  }
  std::uint64_t value = 0;
  const auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (error != std::errc() || end != text.data() + text.size()) return std::nullopt;
  return value;
}

}  // namespace

Result<Selector> parse_selector(std::string_view text) {
  constexpr std::string_view kLatest = "latest";
  if (text == kLatest) return Selector::latest();
  if (text.starts_with(kLatest)) {
    std::string_view rest = text.substr(kLatest.size());
    if (rest.starts_with('-')) {
      if (auto k = parse_decimal(rest.substr(1))) return Selector::latest(*k);
    }
  } else if (auto version = parse_decimal(text)) {
    return Selector::absolute(*version);
  }
  return make_error(Errc::kBadSelector,
                    "'" + std::string(text.substr(0, 64)) + "' is not N, latest or latest-k");
}

std::string format_selector(const Selector& selector) {
  if (selector.kind == Selector::Kind::kAbsolute) return std::to_string(selector.value);
  if (selector.value == 0) return "latest";
  return "latest-" + std::to_string(selector.value);
}

// ---- DTypes -----------------------------------------------------------------------------------------

namespace {
constexpr std::array<std::string_view, kDTypeCount> kDTypeNames = {
    "float32", "float16", "bfloat16", "float8_e4m3", "float8_e5m2", "float64",
    "int8",    "uint8",   "int16",    "int32",       "int64",       "bool",
};
}  // namespace

std::string_view dtype_name(DType dtype) {
  const auto index = static_cast<std::size_t>(dtype);
  TH_ASSERT(index < kDTypeNames.size(), "dtype", index);
  return kDTypeNames[index];
}

std::uint32_t dtype_bytes(DType dtype) {
  constexpr std::array<std::uint32_t, kDTypeCount> kBytes = {4, 2, 2, 1, 1, 8, 1, 1, 2, 4, 8, 1};
  const auto index = static_cast<std::size_t>(dtype);
  TH_ASSERT(index < kBytes.size(), "dtype", index);
  return kBytes[index];
}

std::optional<DType> parse_dtype(std::string_view name) {
  for (std::size_t i = 0; i < kDTypeNames.size(); ++i) {
    if (kDTypeNames[i] == name) return static_cast<DType>(i);
  }
  return std::nullopt;
}

// ---- Layouts ----------------------------------------------------------------------------------------

namespace {

// FNV-1a: a fixed, portable function, so digests agree across machines and builds.
constexpr std::uint64_t kFnvOffset = 0xcbf29ce484222325ULL;
constexpr std::uint64_t kFnvPrime = 0x100000001b3ULL;

void fnv_mix(std::uint64_t& hash, std::string_view bytes) {
  for (unsigned char c : bytes) {
    hash ^= c;
    hash *= kFnvPrime;
  }
}

void fnv_mix(std::uint64_t& hash, std::uint64_t value) {
  for (int i = 0; i < 8; ++i) {
    hash ^= (value >> (8 * i)) & 0xff;
    hash *= kFnvPrime;
  }
}

}  // namespace

std::string_view tensor_kind_name(TensorKind kind) {
  switch (kind) {
    case TensorKind::kBytes: return "bytes";
    case TensorKind::kLocal: return "local";
    case TensorKind::kPiece: return "piece";
  }
  TH_ASSERT(false, "tensor kind", static_cast<int>(kind));
}

std::optional<Shape> TensorSpec::buffer_shape() const {
  switch (kind) {
    case TensorKind::kBytes: return std::nullopt;
    case TensorKind::kLocal: return shape;
    case TensorKind::kPiece: return box.extent;
  }
  TH_ASSERT(false, "tensor kind", static_cast<int>(kind));
}

ShardLayout::ShardLayout(std::vector<TensorSpec> tensors) : tensors_(std::move(tensors)) {
  digest_ = kFnvOffset;
  for (const TensorSpec& tensor : tensors_) {
    fnv_mix(digest_, tensor.name.size());
    fnv_mix(digest_, tensor.name);
    fnv_mix(digest_, static_cast<std::uint64_t>(tensor.dtype));
    fnv_mix(digest_, tensor.bytes);
    fnv_mix(digest_, static_cast<std::uint64_t>(tensor.kind));
    fnv_mix(digest_, tensor.shape.size());
    for (std::uint64_t length : tensor.shape) fnv_mix(digest_, length);
    for (std::uint64_t at : tensor.box.offset) fnv_mix(digest_, at);
    for (std::uint64_t length : tensor.box.extent) fnv_mix(digest_, length);
    total_bytes_ += tensor.bytes;
    description_bytes_ += limits::kTensorDescriptionOverheadBytes + tensor.name.size() +
                          8 * (tensor.shape.size() + tensor.box.offset.size() + tensor.box.extent.size());
  }
}

namespace {

// A tensor's shape and box agree with its kind, its dtype and its size.
Status check_tensor(const TensorSpec& tensor) {
  const auto invalid = [&](const std::string& why) {
    return make_error(Errc::kInvalidArgument, "tensor '" + tensor.name + "': " + why);
  };
  if (static_cast<int>(tensor.kind) > static_cast<int>(TensorKind::kPiece)) return invalid("no valid kind");
  if (tensor.kind == TensorKind::kBytes) {
    if (!tensor.shape.empty() || !tensor.box.offset.empty() || !tensor.box.extent.empty()) {
      return invalid("a tensor of bytes has no shape");
    }
    return Unit{};
  }
  if (tensor.shape.size() > limits::kBoxRankMax) {
    return invalid("its shape " + describe_shape(tensor.shape) + " has more than " +
                   std::to_string(limits::kBoxRankMax) + " dimensions");
  }
  if (tensor.kind == TensorKind::kLocal) {
    if (!tensor.box.offset.empty() || !tensor.box.extent.empty()) {
      return invalid("a shard's own tensor has no box (register it as a piece of the model's tensor)");
    }
  } else if (Status placed = check_box(tensor.name, tensor.shape, tensor.box); !placed) {
    return placed;
  }
  const Shape buffer = *tensor.buffer_shape();
  const std::optional<std::uint64_t> elements = checked_element_count(buffer);
  std::uint64_t bytes = 0;
  if (!elements || __builtin_mul_overflow(*elements, dtype_bytes(tensor.dtype), &bytes)) {
    return invalid("shape " + describe_shape(buffer) + " has more than 2^64 bytes");
  }
  if (bytes != tensor.bytes) {
    return invalid(std::to_string(tensor.bytes) + " bytes for shape " + describe_shape(buffer) + " of " +
                   std::string(dtype_name(tensor.dtype)) + ", which is " + std::to_string(bytes) + " bytes");
  }
  return Unit{};
}

}  // namespace

Result<LayoutRef> ShardLayout::make(std::vector<TensorSpec> tensors) {
  if (tensors.empty()) return make_error(Errc::kInvalidArgument, "a shard layout needs a tensor");
  if (tensors.size() > limits::kTensorsPerShardMax) {
    return make_error(Errc::kLimitExceeded, "more than " +
                                                std::to_string(limits::kTensorsPerShardMax) +
                                                " tensors in one shard");
  }
  std::uint64_t total_bytes = 0;
  for (const TensorSpec& tensor : tensors) {
    if (tensor.name.empty() || tensor.name.size() > limits::kNameBytesMax) {
      return make_error(Errc::kInvalidArgument, "tensor names must have 1 to " +
                                                    std::to_string(limits::kNameBytesMax) +
                                                    " bytes");
    }
    if (static_cast<int>(tensor.dtype) >= kDTypeCount) {
      return make_error(Errc::kInvalidArgument, "tensor '" + tensor.name + "' has no valid dtype");
    }
    if (Status valid = check_tensor(tensor); !valid) return valid.error();
    if (tensor.bytes > std::numeric_limits<std::uint64_t>::max() - total_bytes) {
      return make_error(Errc::kInvalidArgument, "shard size overflows 64 bits");
    }
    total_bytes += tensor.bytes;
  }
  // Clients address tensors by name (register, checksums per tensor): names must be unique.
  std::vector<std::string_view> names;
  names.reserve(tensors.size());
  for (const TensorSpec& tensor : tensors) names.push_back(tensor.name);
  std::sort(names.begin(), names.end());
  if (const auto twice = std::adjacent_find(names.begin(), names.end()); twice != names.end()) {
    return make_error(Errc::kInvalidArgument, "tensor '" + std::string(*twice) + "' appears twice");
  }
  return LayoutRef(new ShardLayout(std::move(tensors)));
}

namespace {

// Why a reader's tensor `got` cannot take the bytes of the model's `want` (same name), if so.
std::optional<std::string> tensor_mismatch(const TensorSpec& want, const TensorSpec& got) {
  const std::string prefix = "tensor '" + want.name + "': ";
  if (want.dtype != got.dtype) {
    return prefix + "dtype " + std::string(dtype_name(want.dtype)) + " in the model, " +
           std::string(dtype_name(got.dtype)) + " here";
  }
  if (want.kind == TensorKind::kPiece && got.kind == TensorKind::kPiece) {
    if (want.shape != got.shape) {
      return prefix + "global shape " + describe_shape(want.shape) + " in the model, " +
             describe_shape(got.shape) + " here";
    }
    if (want.box != got.box) {
      return prefix + "box " + describe_box(want.box) + " in the model, " + describe_box(got.box) + " here";
    }
  }
  const std::optional<Shape> want_shape = want.buffer_shape();
  const std::optional<Shape> got_shape = got.buffer_shape();
  if (want_shape && got_shape && *want_shape != *got_shape) {
    return prefix + "shape " + describe_shape(*want_shape) + " in the model, " + describe_shape(*got_shape) +
           " here";
  }
  if (want.bytes != got.bytes) {
    return prefix + std::to_string(want.bytes) + " bytes in the model, " + std::to_string(got.bytes) + " here";
  }
  return std::nullopt;
}

}  // namespace

std::optional<std::string> ShardLayout::mismatch(const ShardLayout& other) const {
  if (digest_ == other.digest_ && tensors_ == other.tensors_) return std::nullopt;
  // The common case first: the same names in the same order (clients send them sorted), told
  // apart tensor by tensor without sorting anything.
  if (tensors_.size() == other.tensors_.size()) {
    bool same_names = true;
    for (std::size_t i = 0; i < tensors_.size() && same_names; ++i) same_names = tensors_[i].name == other.tensors_[i].name;
    if (same_names) {
      for (std::size_t i = 0; i < tensors_.size(); ++i) {
        if (auto why = tensor_mismatch(tensors_[i], other.tensors_[i])) return why;
      }
      return std::nullopt;  // compatible: equal where both sides said what their tensors are
    }
  }
  // Name the first tensor (by name) that one side has and the other lacks.
  std::vector<std::string_view> want;
  std::vector<std::string_view> got;
  for (const TensorSpec& tensor : tensors_) want.push_back(tensor.name);
  for (const TensorSpec& tensor : other.tensors_) got.push_back(tensor.name);
  std::sort(want.begin(), want.end());
  std::sort(got.begin(), got.end());
  const std::string counts =
      " (the model's shard has " + std::to_string(want.size()) + " tensors, this one " + std::to_string(got.size()) + ")";
  for (std::size_t i = 0; i < want.size() || i < got.size(); ++i) {
    if (i < want.size() && i < got.size() && want[i] == got[i]) continue;
    if (i >= got.size() || (i < want.size() && want[i] < got[i])) {
      return "tensor '" + std::string(want[i]) + "' is missing here" + counts;
    }
    return "tensor '" + std::string(got[i]) + "' is not in the model" + counts;
  }
  for (std::size_t i = 0; i < tensors_.size(); ++i) {
    const TensorSpec& mine = tensors_[i];
    const TensorSpec& theirs = other.tensors_[i];
    if (mine.name != theirs.name) {
      return "tensor " + std::to_string(i) + " is '" + mine.name + "' in the model, '" + theirs.name +
             "' here: tensors go in one order";
    }
    if (auto why = tensor_mismatch(mine, theirs)) return why;
  }
  return std::nullopt;
}

LayoutRef ShardLayout::refine(const LayoutRef& known, const LayoutRef& other) {
  TH_ASSERT(known != nullptr && other != nullptr, "refining layouts that exist");
  if (known == other || (known->digest_ == other->digest_ && known->tensors_ == other->tensors_)) {
    return known;  // the common case: nothing to compare, nothing to copy
  }
  TH_ASSERT(!known->mismatch(*other), "only a compatible layout refines the model's");
  const auto more_specific = [&](std::size_t i) {
    return static_cast<int>(other->tensors_[i].kind) > static_cast<int>(known->tensors_[i].kind);
  };
  std::size_t first = 0;
  while (first < known->tensors_.size() && !more_specific(first)) ++first;
  if (first == known->tensors_.size()) return known;  // nothing to add: no copy
  std::vector<TensorSpec> tensors = known->tensors_;
  for (std::size_t i = first; i < tensors.size(); ++i) {
    if (more_specific(i)) tensors[i] = other->tensors_[i];
  }
  return LayoutRef(new ShardLayout(std::move(tensors)));
}

// ---- Settings ---------------------------------------------------------------------------------------

Status validate(const HubSettings& settings) {
  if (settings.heartbeat_timeout_ms <= 0 || settings.heartbeat_timeout_ms > limits::kDeadlineMsMax) {
    return make_error(Errc::kInvalidArgument, "heartbeat timeout must be in (0, 1 day] ms");
  }
  if (settings.barrier_timeout_ms <= 0 || settings.barrier_timeout_ms > limits::kDeadlineMsMax) {
    return make_error(Errc::kInvalidArgument, "barrier timeout must be in (0, 1 day] ms");
  }
  if (settings.fanout_max == 0) {
    return make_error(Errc::kInvalidArgument, "fan-out limit must be at least 1");
  }
  if (settings.drain_grace_ms <= 0 || settings.drain_grace_ms > limits::kDeadlineMsMax) {
    return make_error(Errc::kInvalidArgument, "drain grace must be in (0, 1 day] ms");
  }
  if (settings.model_grace_ms < 0 || settings.model_grace_ms > limits::kDeadlineMsMax) {
    return make_error(Errc::kInvalidArgument, "model grace must be in [0, 1 day] ms");
  }
  if (settings.model_description_bytes_max == 0 ||
      settings.model_description_bytes_max > settings.description_bytes_max ||
      settings.description_bytes_max > limits::kDescriptionBytesCeiling) {
    return make_error(Errc::kInvalidArgument,
                      "description limits must satisfy 1 <= per model <= per server <= 64 GiB");
  }
  if (settings.id_base > kIdBaseMax) {
    return make_error(Errc::kInvalidArgument, "id base must leave room to count up (at most 2^62)");
  }
  return Unit{};
}

std::uint64_t PatchInfo::read_bytes(const ShardLayout& layout) const {
  TH_REQUIRE(tensor_bytes.size() == layout.tensors().size(), "a patch has one size per tensor");
  std::uint64_t bytes = 0;
  for (std::size_t tensor = 0; tensor < tensor_bytes.size(); ++tensor) {
    bytes += tensor_bytes[tensor] != 0 ? tensor_bytes[tensor] : layout.tensors()[tensor].bytes;
  }
  return bytes;
}

}  // namespace th
