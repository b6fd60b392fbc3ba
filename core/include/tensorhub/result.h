// TensorHub's one error type, public: expected outcomes are values, never exceptions.
//
// `Errc` names every case a client can run into. `Result<T>` carries either a value or an `Error`;
// `Status` is a Result that carries nothing on success. Exceptions are reserved for bugs (reading a
// Result the wrong way throws a std::logic_error).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <variant>

namespace th {

enum class Errc : std::uint8_t {
  // The request itself is malformed or out of range.
  kInvalidArgument,
  kBadSelector,
  // The client is not (or no longer) known to the hub.
  kUnknownClient,
  kAlreadyOpen,
  kShardAlreadyOpen,
  kOpenMismatch,       // num_shards, datacenter, spot or role differ from the replica's other shards
  kStaleIncarnation,   // a newer incarnation of this replica is already open
  kSequenceGap,        // a request skipped a sequence number (client bug or lost request)
  kLimitExceeded,      // a named limit (models_max, replicas_per_model_max, …) would be exceeded
  // Versions.
  kVersionNotFound,     // never published here, or forgotten long ago
  kVersionUnavailable,  // was published, but no copy that could serve it is left
  kStaleVersion,        // publishing a version below latest that the model does not know
  kNotPublished,        // unpublish without a published version
  kAlreadyHolding,      // publish/replicate while the replica already holds a version
  kLayoutMismatch,      // tensor names, dtypes or sizes differ from the model's layout
  kChecksumConflict,    // a second publisher of a version announced different checksums
  // Replica transactions and lifecycle.
  kDivergentCall,    // shards of one replica issued different operations at the same position
  kReplicaEvicted,   // the replica was removed (heartbeat timeout, connection loss, restart)
  kReplicaClosed,    // another shard of the replica closed it
  kBarrierTimeout,   // not every shard re-opened within the failover barrier
  kTimeout,          // the call's own deadline passed
  // Raised by the shells, never by the core.
  kPermissionDenied,  // the server refused the cluster token
  kUnavailable,       // no server could be reached (libthclient's open deadline passed)
  // No longer given: close was once refused while the replica held the last non-spot copy of a
  // version another replica's rule keeps. A close is never refused now (hub.h); the value stays
  // so that the codes after it keep their numbers on the wire.
  kLastRetainedCopy,
  // A shard of the replica cancelled the call (Receive::cancel); every shard gets this answer.
  kCancelled,
};

inline constexpr Errc kErrcLast = Errc::kCancelled;  // the wire checks codes against it
std::string_view errc_name(Errc code);

struct Error {
  Errc code;
  std::string detail;  // human-readable; never parsed

  friend bool operator==(const Error& a, const Error& b) { return a.code == b.code; }
};

inline Error make_error(Errc code, std::string detail = {}) { return Error{code, std::move(detail)}; }

namespace detail {
// A Result read the wrong way (value() of an error, error() of a value): a bug in the caller.
// Throws a std::logic_error naming the error (its code and detail), if there is one.
[[noreturn]] void result_misuse(const char* what, const Error* error);
}  // namespace detail

template <typename T>
class [[nodiscard]] Result {
 public:
  Result(T value) : state_(std::move(value)) {}          // NOLINT: implicit by design
  Result(Error error) : state_(std::move(error)) {}      // NOLINT: implicit by design

  bool ok() const { return std::holds_alternative<T>(state_); }
  explicit operator bool() const { return ok(); }

  const T& value() const& {
    if (!ok()) detail::result_misuse("Result::value() of an error", &error());
    return std::get<T>(state_);
  }
  T&& value() && {
    if (!ok()) detail::result_misuse("Result::value() of an error", &error());
    return std::get<T>(std::move(state_));
  }
  const Error& error() const {
    if (ok()) detail::result_misuse("Result::error() of a value", nullptr);
    return std::get<Error>(state_);
  }

 private:
  std::variant<T, Error> state_;
};

// For operations whose success carries nothing.
struct Unit {
  friend bool operator==(Unit, Unit) { return true; }
};
using Status = Result<Unit>;

}  // namespace th
