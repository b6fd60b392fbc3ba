#include "core/messages.h"


namespace th {

std::string_view read_failure_name(ReadFailure failure) {
  switch (failure) {
    case ReadFailure::kSourceUnreachable: return "source-unreachable";
    case ReadFailure::kChecksumMismatch: return "checksum-mismatch";
    case ReadFailure::kSourceRefused: return "source-refused";
    case ReadFailure::kPatchBaseMismatch: return "patch-base-mismatch";
  }
  return "unknown-failure";
}

std::string_view op_name(OpKind kind) {
  switch (kind) {
    case OpKind::kPublish: return "publish";
    case OpKind::kUnpublish: return "unpublish";
    case OpKind::kReplicate: return "replicate";
    case OpKind::kUpdate: return "update";
    case OpKind::kList: return "list";
    case OpKind::kWait: return "wait";
    case OpKind::kClose: return "close";
  }
  return "unknown-op";
}

std::string_view update_status_name(UpdateStatus status) {
  switch (status) {
    case UpdateStatus::kUpdated: return "updated";
    case UpdateStatus::kNoNewerVersion: return "no-newer-version";
    case UpdateStatus::kNotYet: return "not-yet";
  }
  return "unknown-status";
}

bool same_answer(const Outcome& a, const Outcome& b) {
  if (a.index() != b.index()) return false;
  return std::visit(
      [&](const auto& left) {
        using T = std::decay_t<decltype(left)>;
        const T& right = std::get<T>(b);
        if constexpr (std::is_same_v<T, Error>) {
          return left.code == right.code;
        } else if constexpr (std::is_same_v<T, OpenOk>) {
          return left.num_shards == right.num_shards;
        } else if constexpr (std::is_same_v<T, PublishOk>) {
          return left.version == right.version;
        } else if constexpr (std::is_same_v<T, ReplicateOk>) {
          return left.version == right.version && left.source_replica == right.source_replica;
        } else if constexpr (std::is_same_v<T, UpdateOk>) {
          return left.status == right.status && left.version == right.version &&
                 left.source_replica == right.source_replica;
        } else if constexpr (std::is_same_v<T, ListOk>) {
          return left.snapshot == right.snapshot ||
                 (left.snapshot && right.snapshot && *left.snapshot == *right.snapshot);
        } else {
          return true;  // UnpublishOk, WaitOk, CloseOk carry nothing
        }
      },
      a);
}

OpKey op_key(const RequestBody& body) {
  OpKey key;
  key.kind = op_kind(body);
  if (const auto* publish = std::get_if<PublishRequest>(&body)) key.version = publish->version;
  if (const auto* replicate = std::get_if<ReplicateRequest>(&body)) key.selector = replicate->selector;
  if (const auto* update = std::get_if<UpdateRequest>(&body)) key.selector = update->selector;
  if (const auto* wait = std::get_if<WaitRequest>(&body)) key.predicate = wait->predicate;
  return key;
}

namespace {

Status check_held_copy(const HeldCopy& held) {
  if (held.version > limits::kVersionMax) {
    return make_error(Errc::kInvalidArgument, "an announced copy of version " + std::to_string(held.version) +
                                                  ", above the largest a model takes (2^63-1)");
  }
  if (!held.layout || !held.checksums) {
    return make_error(Errc::kInvalidArgument, "an announced copy needs a layout and checksums");
  }
  if (held.checksums->size() != held.layout->tensors().size()) {
    return make_error(Errc::kInvalidArgument, "an announced copy needs one checksum per tensor");
  }
  return Unit{};
}

}  // namespace

Status validate(const OpenRequest& open) {
  if (!valid_name(open.model, false) || !valid_name(open.replica, false) ||
      !valid_name(open.datacenter, true) || !valid_name(open.role, true)) {
    return make_error(Errc::kInvalidArgument, "model and replica names need 1 to 256 bytes, datacenter and "
                                              "role at most 256, all UTF-8 text without control characters");
  }
  if (open.data_endpoint.size() > limits::kEndpointBytesMax) {
    return make_error(Errc::kInvalidArgument, "data endpoint longer than 512 bytes");
  }
  if (open.num_shards == 0 || open.num_shards > limits::kShardsMax || open.shard >= open.num_shards) {
    return make_error(Errc::kInvalidArgument, "shard " + std::to_string(open.shard) + " of " +
                                                  std::to_string(open.num_shards) +
                                                  " (1 to 256 shards per replica)");
  }
  if ((open.retention.keep_latest && *open.retention.keep_latest > limits::kKeepLatestMax) ||
      open.retention.pinned.size() > limits::kPinnedPerOpenMax) {
    return make_error(Errc::kLimitExceeded, "retention keeps at most latest-64 and 16 pinned versions");
  }
  for (const Version pinned : open.retention.pinned) {
    if (pinned > limits::kVersionMax) {
      return make_error(Errc::kInvalidArgument, "pinned version " + std::to_string(pinned) +
                                                    " is above the largest a model takes (2^63-1)");
    }
  }
  if (open.resume) {
    if (open.resume->offloads.size() > limits::kOffloadsPerReplicaMax) {
      return make_error(Errc::kLimitExceeded, "too many offload copies announced");
    }
    if (open.resume->primary) {
      if (Status valid = check_held_copy(*open.resume->primary); !valid.ok()) return valid;
    }
    for (const HeldCopy& offload : open.resume->offloads) {
      if (Status valid = check_held_copy(offload); !valid.ok()) return valid;
    }
  }
  return Unit{};
}

OpKind op_kind(const RequestBody& body) {
  struct Visitor {
    OpKind operator()(const OpenRequest&) const {
      TH_REQUIRE(false, "open is not a transaction");
    }
    OpKind operator()(const PublishRequest&) const { return OpKind::kPublish; }
    OpKind operator()(const UnpublishRequest&) const { return OpKind::kUnpublish; }
    OpKind operator()(const ReplicateRequest&) const { return OpKind::kReplicate; }
    OpKind operator()(const UpdateRequest&) const { return OpKind::kUpdate; }
    OpKind operator()(const ListRequest&) const { return OpKind::kList; }
    OpKind operator()(const WaitRequest&) const { return OpKind::kWait; }
    OpKind operator()(const CloseRequest&) const { return OpKind::kClose; }
  };
  return std::visit(Visitor{}, body);
}

}  // namespace th
