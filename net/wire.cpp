#include "net/wire.h"

#include <kj/exception.h>

#include <cstring>
#include <string>
#include <utility>

namespace th::net {
namespace {

// ---- Encoding --------------------------------------------------------------------------------------

void put(const Selector& selector, wire::Selector::Builder out) {
  if (selector.kind == Selector::Kind::kAbsolute) {
    out.setAbsolute(selector.value);
  } else {
    out.setLatestMinus(selector.value);
  }
}

void put_shape(const Shape& shape, capnp::List<std::uint64_t>::Builder out) {
  for (unsigned d = 0; d < shape.size(); ++d) out.set(d, shape[d]);
}

template <typename InitList>
void put_layout(const LayoutRef& layout, InitList init) {
  if (layout == nullptr) return;  // an absent layout is an empty list; decode refuses it where needed
  const auto& tensors = layout->tensors();
  auto list = init(static_cast<unsigned>(tensors.size()));
  for (unsigned i = 0; i < tensors.size(); ++i) {
    list[i].setName(tensors[i].name);
    list[i].setDtype(static_cast<std::uint8_t>(tensors[i].dtype));
    list[i].setBytes(tensors[i].bytes);
    if (tensors[i].kind == TensorKind::kBytes) continue;
    list[i].setKind(static_cast<std::uint8_t>(tensors[i].kind));
    put_shape(tensors[i].shape, list[i].initShape(static_cast<unsigned>(tensors[i].shape.size())));
    if (tensors[i].kind != TensorKind::kPiece) continue;
    const Box& box = tensors[i].box;
    put_shape(box.offset, list[i].initBoxOffset(static_cast<unsigned>(box.offset.size())));
    put_shape(box.extent, list[i].initBoxExtent(static_cast<unsigned>(box.extent.size())));
  }
}

template <typename InitList>
void put_checksums(const ChecksumsRef& checksums, InitList init) {
  if (checksums == nullptr) return;
  auto list = init(static_cast<unsigned>(checksums->size()));
  for (unsigned i = 0; i < checksums->size(); ++i) list.set(i, (*checksums)[i]);
}

template <typename InitList, typename Values>
void put_u64s(const Values& values, InitList init) {
  auto list = init(static_cast<unsigned>(values.size()));
  unsigned i = 0;
  for (std::uint64_t value : values) list.set(i++, value);
}

void put(const WaitPredicate& predicate, wire::WaitPredicate::Builder out) {
  out.setKind(static_cast<std::uint8_t>(predicate.kind));
  out.setVersion(predicate.version);
  out.setReplicasMin(predicate.replicas_min);
  out.setRole(predicate.role);
}

void put(const OpKey& op, wire::OpKey::Builder out) {
  out.setKind(static_cast<std::uint8_t>(op.kind));
  put(op.selector, out.initSelector());
  out.setVersion(op.version);
  put(op.predicate, out.initPredicate());
}

void put(const ListSnapshot& snapshot, wire::ListSnapshot::Builder out) {
  out.setModel(snapshot.model);
  out.setHasLatest(snapshot.latest.has_value());
  out.setLatest(snapshot.latest.value_or(0));
  auto versions = out.initVersions(static_cast<unsigned>(snapshot.versions.size()));
  for (unsigned i = 0; i < snapshot.versions.size(); ++i) {
    const auto& info = snapshot.versions[i];
    versions[i].setVersion(info.version);
    versions[i].setComplete(info.complete);
    versions[i].setPartial(info.partial);
    versions[i].setRetained(info.retained);
    versions[i].setOffloaded(info.offloaded);
  }
  auto replicas = out.initReplicas(static_cast<unsigned>(snapshot.replicas.size()));
  for (unsigned i = 0; i < snapshot.replicas.size(); ++i) {
    const auto& info = snapshot.replicas[i];
    auto replica = replicas[i];
    replica.setName(info.name);
    replica.setIncarnation(info.incarnation);
    replica.setDatacenter(info.datacenter);
    replica.setSpot(info.spot);
    replica.setRole(info.role);
    replica.setNumShards(info.num_shards);
    replica.setState(info.state);
    replica.setHasVersion(info.version.has_value());
    replica.setVersion(info.version.value_or(0));
    replica.setServing(info.serving);
    put_u64s(info.offloads, [&](unsigned n) { return replica.initOffloads(n); });
  }
}

void put(const Outcome& outcome, wire::Outcome::Builder out) {
  std::visit(
      [&](const auto& answer) {
        using T = std::decay_t<decltype(answer)>;
        if constexpr (std::is_same_v<T, Error>) {
          auto error = out.initError();
          error.setCode(static_cast<std::uint8_t>(answer.code));
          error.setDetail(answer.detail);
        } else if constexpr (std::is_same_v<T, OpenOk>) {
          auto ok = out.initOpenOk();
          ok.setNumShards(answer.num_shards);
          ok.setHasLatest(answer.latest.has_value());
          ok.setLatest(answer.latest.value_or(0));
          ok.setIncarnation(answer.incarnation);
        } else if constexpr (std::is_same_v<T, PublishOk>) {
          out.setPublishOk(answer.version);
        } else if constexpr (std::is_same_v<T, UnpublishOk>) {
          out.setUnpublishOk();
        } else if constexpr (std::is_same_v<T, ReplicateOk>) {
          auto ok = out.initReplicateOk();
          ok.setVersion(answer.version);
          ok.setSourceReplica(answer.source_replica);
        } else if constexpr (std::is_same_v<T, UpdateOk>) {
          auto ok = out.initUpdateOk();
          ok.setStatus(static_cast<std::uint8_t>(answer.status));
          ok.setHolding(answer.version.has_value());
          ok.setVersion(answer.version.value_or(0));
          ok.setSourceReplica(answer.source_replica);
        } else if constexpr (std::is_same_v<T, ListOk>) {
          TH_REQUIRE(answer.snapshot != nullptr, "a list answer carries its snapshot");
          put(*answer.snapshot, out.initListOk());
        } else if constexpr (std::is_same_v<T, WaitOk>) {
          out.setWaitOk();
        } else {
          static_assert(std::is_same_v<T, CloseOk>);
          out.setCloseOk();
        }
      },
      outcome);
}

void put_patch(const PatchInfo& patch, wire::PatchInfo::Builder out);

void put(const HeldCopy& held, wire::HeldCopy::Builder out) {
  out.setVersion(held.version);
  out.setCopy(held.copy);
  put_layout(held.layout, [&](unsigned n) { return out.initLayout(n); });
  put_checksums(held.checksums, [&](unsigned n) { return out.initChecksums(n); });
  if (held.patch != nullptr) put_patch(*held.patch, out.initPatch());
}

void put(const Resume& resume, wire::Resume::Builder out) {
  out.setHasPrimary(resume.primary.has_value());
  if (resume.primary) put(*resume.primary, out.initPrimary());
  auto offloads = out.initOffloads(static_cast<unsigned>(resume.offloads.size()));
  for (unsigned i = 0; i < resume.offloads.size(); ++i) put(resume.offloads[i], offloads[i]);
  out.setHasLastTxn(resume.last_txn.has_value());
  if (resume.last_txn) {
    auto txn = out.initLastTxn();
    txn.setSeq(resume.last_txn->seq);
    put(resume.last_txn->op, txn.initOp());
    put(resume.last_txn->outcome, txn.initOutcome());
  }
}

void put(const OpenRequest& open, wire::OpenRequest::Builder out) {
  out.setModel(open.model);
  out.setReplica(open.replica);
  out.setIncarnation(open.incarnation);
  out.setIncarnationAuto(open.incarnation_auto);
  out.setShard(open.shard);
  out.setNumShards(open.num_shards);
  out.setDatacenter(open.datacenter);
  out.setSpot(open.spot);
  out.setRole(open.role);
  auto retention = out.initRetention();
  retention.setHasKeepLatest(open.retention.keep_latest.has_value());
  retention.setKeepLatest(open.retention.keep_latest.value_or(0));
  put_u64s(open.retention.pinned, [&](unsigned n) { return retention.initPinned(n); });
  out.setDataEndpoint(open.data_endpoint);
  out.setHasResume(open.resume != nullptr);
  if (open.resume != nullptr) put(*open.resume, out.initResume());
}

// ---- Decoding --------------------------------------------------------------------------------------

// Thrown inside this file only, when a field is out of range; decode() turns it into an Error.
// (Decoding walks a deep tree; one exit for "this field is bad" keeps every step a plain line.)
struct Invalid {
  std::string what;
};

[[noreturn]] void invalid(std::string what) { throw Invalid{std::move(what)}; }

template <typename Enum>
Enum enum_in_range(std::uint8_t raw, Enum last, const char* field) {
  if (raw > static_cast<std::uint8_t>(last)) {
    invalid(std::string(field) + " " + std::to_string(raw) + " is out of range");
  }
  return static_cast<Enum>(raw);
}

std::string text(capnp::Text::Reader value, std::size_t bytes_max, const char* field) {
  if (value.size() > bytes_max) {
    invalid(std::string(field) + " is " + std::to_string(value.size()) + " bytes, over the limit of " +
            std::to_string(bytes_max));
  }
  // A NUL inside would be cut off wherever the text is used as a C string (and on the way back out:
  // fuzzing found a name that decoded, then encoded as another name).
  if (std::memchr(value.cStr(), '\0', value.size()) != nullptr) invalid(std::string(field) + " contains a NUL byte");
  return std::string(value.cStr(), value.size());
}
std::string name(capnp::Text::Reader value, const char* field) {
  return text(value, limits::kNameBytesMax, field);
}

template <typename List>
void list_at_most(const List& list, std::size_t size_max, const char* field) {
  if (list.size() > size_max) {
    invalid(std::string(field) + " has " + std::to_string(list.size()) + " entries, over the limit of " +
            std::to_string(size_max));
  }
}

TimeMs timeout(std::int64_t value, const char* field) {
  if (value < 0 || value > limits::kDeadlineMsMax) {
    invalid(std::string(field) + " " + std::to_string(value) + " ms is outside 0.." +
            std::to_string(limits::kDeadlineMsMax));
  }
  return value;
}

Selector get(wire::Selector::Reader in) {
  switch (in.which()) {
    case wire::Selector::ABSOLUTE: return Selector::absolute(in.getAbsolute());
    case wire::Selector::LATEST_MINUS: return Selector::latest(in.getLatestMinus());
  }
  invalid("selector of an unknown kind");
}

Shape get_shape(capnp::List<std::uint64_t>::Reader in) {
  list_at_most(in, limits::kBoxRankMax, "shape");
  Shape shape;
  shape.reserve(in.size());
  for (std::uint64_t length : in) shape.push_back(length);
  return shape;
}

// An empty list is "no layout": the hub refuses a call that needs one with its own error.
LayoutRef get_layout(capnp::List<wire::TensorSpec>::Reader in) {
  if (in.size() == 0) return nullptr;
  list_at_most(in, limits::kTensorsPerShardMax, "layout");
  std::vector<TensorSpec> tensors;
  tensors.reserve(in.size());
  for (auto tensor : in) {
    TensorSpec spec{name(tensor.getName(), "tensor name"), enum_in_range(tensor.getDtype(), DType::kBool, "dtype"),
                    tensor.getBytes()};
    spec.kind = enum_in_range(tensor.getKind(), TensorKind::kPiece, "tensor kind");
    spec.shape = get_shape(tensor.getShape());
    spec.box = Box{get_shape(tensor.getBoxOffset()), get_shape(tensor.getBoxExtent())};
    tensors.push_back(std::move(spec));
  }
  auto layout = ShardLayout::make(std::move(tensors));
  if (!layout.ok()) invalid("layout: " + layout.error().detail);
  return std::move(layout).value();
}

// A patch's sizes: one per tensor, checked against the layout by the hub (Hub::check_patch) and
// by the reader (it reads no more than they say).
PatchRef get_patch(wire::PatchInfo::Reader in) {
  list_at_most(in.getTensorBytes(), limits::kTensorsPerShardMax, "patch sizes");
  auto patch = std::make_shared<PatchInfo>();
  patch->base = in.getBase();
  patch->tensor_bytes.reserve(in.getTensorBytes().size());
  for (std::uint64_t bytes : in.getTensorBytes()) patch->tensor_bytes.push_back(bytes);
  if (patch->tensor_bytes.empty()) invalid("a patch without sizes");
  return patch;
}

void put_patch(const PatchInfo& patch, wire::PatchInfo::Builder out) {
  out.setBase(patch.base);
  put_u64s(patch.tensor_bytes, [&](unsigned n) { return out.initTensorBytes(n); });
}

ChecksumsRef get_checksums(capnp::List<std::uint64_t>::Reader in) {
  if (in.size() == 0) return nullptr;
  list_at_most(in, limits::kTensorsPerShardMax, "checksums");
  auto checksums = std::make_shared<Checksums>();
  checksums->reserve(in.size());
  for (std::uint64_t value : in) checksums->push_back(value);
  return checksums;
}

// A grant's secret: 16 bytes as two little-endian words (the data plane sends them as they are).
GrantSecret get_secret(capnp::Data::Reader in) {
  if (in.size() != sizeof(GrantSecret)) invalid("a grant secret is " + std::to_string(sizeof(GrantSecret)) + " bytes");
  GrantSecret secret{};
  std::memcpy(secret.data(), in.begin(), sizeof secret);
  return secret;
}

void put_secret(const GrantSecret& secret, capnp::Data::Builder out) {
  std::memcpy(out.begin(), secret.data(), sizeof secret);
}

WaitPredicate get(wire::WaitPredicate::Reader in) {
  WaitPredicate predicate;
  predicate.kind = enum_in_range(in.getKind(), WaitPredicate::Kind::kRoleHolds, "wait predicate");
  predicate.version = in.getVersion();
  predicate.replicas_min = in.getReplicasMin();
  predicate.role = name(in.getRole(), "role");
  return predicate;
}

OpKey get(wire::OpKey::Reader in) {
  OpKey op;
  op.kind = enum_in_range(in.getKind(), OpKind::kClose, "operation");
  op.selector = get(in.getSelector());
  op.version = in.getVersion();
  op.predicate = get(in.getPredicate());
  return op;
}

std::shared_ptr<const ListSnapshot> get(wire::ListSnapshot::Reader in) {
  auto snapshot = std::make_shared<ListSnapshot>();
  snapshot->model = name(in.getModel(), "model");
  if (in.getHasLatest()) snapshot->latest = in.getLatest();
  list_at_most(in.getVersions(), limits::kForgottenVersionsWindow * 2, "versions");
  for (auto info : in.getVersions()) {
    snapshot->versions.push_back({info.getVersion(), info.getComplete(), info.getPartial(),
                                  info.getRetained(), info.getOffloaded()});
  }
  list_at_most(in.getReplicas(), limits::kReplicasPerModelMax, "replicas");
  for (auto info : in.getReplicas()) {
    ListSnapshot::ReplicaInfo replica;
    replica.name = name(info.getName(), "replica");
    replica.incarnation = info.getIncarnation();
    replica.datacenter = name(info.getDatacenter(), "datacenter");
    replica.spot = info.getSpot();
    replica.role = name(info.getRole(), "role");
    replica.num_shards = info.getNumShards();
    replica.state = name(info.getState(), "state");
    if (info.getHasVersion()) replica.version = info.getVersion();
    replica.serving = info.getServing();
    list_at_most(info.getOffloads(), limits::kOffloadsPerReplicaMax, "offloads");
    for (std::uint64_t version : info.getOffloads()) replica.offloads.push_back(version);
    snapshot->replicas.push_back(std::move(replica));
  }
  return snapshot;
}

Outcome get(wire::Outcome::Reader in) {
  switch (in.which()) {
    case wire::Outcome::ERROR: {
      auto error = in.getError();
      return make_error(enum_in_range(error.getCode(), kErrcLast, "error code"),
                        text(error.getDetail(), kErrorDetailBytesMax, "error detail"));
    }
    case wire::Outcome::OPEN_OK: {
      auto ok = in.getOpenOk();
      OpenOk open{ok.getNumShards(), std::nullopt, ok.getIncarnation()};
      if (ok.getHasLatest()) open.latest = ok.getLatest();
      return open;
    }
    case wire::Outcome::PUBLISH_OK: return PublishOk{in.getPublishOk()};
    case wire::Outcome::UNPUBLISH_OK: return UnpublishOk{};
    case wire::Outcome::REPLICATE_OK: {
      auto ok = in.getReplicateOk();
      return ReplicateOk{ok.getVersion(), name(ok.getSourceReplica(), "source replica")};
    }
    case wire::Outcome::UPDATE_OK: {
      auto ok = in.getUpdateOk();
      const auto status = enum_in_range(ok.getStatus(), UpdateStatus::kNotYet, "update status");
      if (status == UpdateStatus::kUpdated && !ok.getHolding()) {
        invalid("an update that moved names the version it holds");
      }
      return UpdateOk{status, ok.getHolding() ? std::optional(ok.getVersion()) : std::nullopt,
                      name(ok.getSourceReplica(), "source replica")};
    }
    case wire::Outcome::LIST_OK: return ListOk{get(in.getListOk())};
    case wire::Outcome::WAIT_OK: return WaitOk{};
    case wire::Outcome::CLOSE_OK: return CloseOk{};
  }
  invalid("answer of an unknown kind");
}

HeldCopy get(wire::HeldCopy::Reader in) {
  HeldCopy held{in.getVersion(), get_layout(in.getLayout()), get_checksums(in.getChecksums()),
                in.getCopy(), in.hasPatch() ? get_patch(in.getPatch()) : nullptr};
  if (held.layout == nullptr || held.checksums == nullptr ||
      held.checksums->size() != held.layout->tensors().size()) {
    invalid("a held copy needs a layout and one checksum per tensor");
  }
  return held;
}

std::shared_ptr<const Resume> get(wire::Resume::Reader in) {
  auto resume = std::make_shared<Resume>();
  if (in.getHasPrimary()) resume->primary = get(in.getPrimary());
  list_at_most(in.getOffloads(), limits::kOffloadsPerReplicaMax, "offloads");
  for (auto offload : in.getOffloads()) resume->offloads.push_back(get(offload));
  if (in.getHasLastTxn()) {
    auto txn = in.getLastTxn();
    resume->last_txn = TxnRecord{txn.getSeq(), get(txn.getOp()), get(txn.getOutcome())};
  }
  return resume;
}

OpenRequest get(wire::OpenRequest::Reader in) {
  OpenRequest open;
  open.model = name(in.getModel(), "model");
  open.replica = name(in.getReplica(), "replica");
  open.incarnation = in.getIncarnation();
  open.incarnation_auto = in.getIncarnationAuto();
  // Shard numbers and retention rules pass through: the hub checks them (validate(OpenRequest))
  // and answers with a typed error, which a refusal here would turn into silence.
  open.num_shards = in.getNumShards();
  open.shard = in.getShard();
  open.datacenter = name(in.getDatacenter(), "datacenter");
  open.spot = in.getSpot();
  open.role = name(in.getRole(), "role");
  auto retention = in.getRetention();
  if (retention.getHasKeepLatest()) open.retention.keep_latest = retention.getKeepLatest();
  list_at_most(retention.getPinned(), limits::kPinnedPerOpenMax, "pinned versions");
  for (std::uint64_t version : retention.getPinned()) open.retention.pinned.push_back(version);
  open.data_endpoint = text(in.getDataEndpoint(), limits::kEndpointBytesMax, "data endpoint");
  if (in.getHasResume()) open.resume = get(in.getResume());
  return open;
}

Request get(wire::Request::Reader in) {
  Request request;
  request.client = in.getClient();
  request.seq = in.getSeq();
  request.session = in.getSession();
  auto body = in.getBody();
  switch (body.which()) {
    case wire::Request::Body::OPEN: request.body = get(body.getOpen()); break;
    case wire::Request::Body::PUBLISH: {
      auto publish = body.getPublish();
      PublishRequest out{publish.getVersion(), get_layout(publish.getLayout()),
                         get_checksums(publish.getChecksums())};
      const std::size_t tensors = out.layout == nullptr ? 0 : out.layout->tensors().size();
      const std::size_t checksums = out.checksums == nullptr ? 0 : out.checksums->size();
      if (tensors == 0 || checksums != tensors) {
        invalid("publish needs a layout and one checksum per tensor (" + std::to_string(tensors) +
                " tensors, " + std::to_string(checksums) + " checksums)");
      }
      if (publish.hasPatch()) out.patch = get_patch(publish.getPatch());
      request.body = std::move(out);
      break;
    }
    case wire::Request::Body::UNPUBLISH: request.body = UnpublishRequest{}; break;
    case wire::Request::Body::REPLICATE: {
      auto replicate = body.getReplicate();
      request.body = ReplicateRequest{get(replicate.getSelector()), get_layout(replicate.getLayout()),
                                      timeout(replicate.getTimeoutMs(), "replicate timeout")};
      break;
    }
    case wire::Request::Body::UPDATE: {
      auto update = body.getUpdate();
      request.body = UpdateRequest{get(update.getSelector()), get_layout(update.getLayout())};
      break;
    }
    case wire::Request::Body::LIST: request.body = ListRequest{}; break;
    case wire::Request::Body::WAIT: {
      auto wait = body.getWait();
      request.body = WaitRequest{get(wait.getPredicate()), timeout(wait.getTimeoutMs(), "wait timeout")};
      break;
    }
    case wire::Request::Body::CLOSE: request.body = CloseRequest{}; break;
    default: invalid("request of an unknown kind");
  }
  return request;
}

Report get(wire::Report::Reader in) {
  Report report;
  report.client = in.getClient();
  report.session = in.getSession();
  auto body = in.getBody();
  switch (body.which()) {
    case wire::Report::Body::HEARTBEAT: report.body = Heartbeat{}; break;
    case wire::Report::Body::TRANSFER_DONE:
      report.body = TransferDone{body.getTransferDone().getTransfer(), body.getTransferDone().getEpoch(),
                                 get_checksums(body.getTransferDone().getChecksums())};
      break;
    case wire::Report::Body::TRANSFER_FAILED: {
      auto failed = body.getTransferFailed();
      report.body = TransferFailed{failed.getTransfer(), failed.getEpoch(),
                                   enum_in_range(failed.getReason(), ReadFailure::kPatchBaseMismatch,
                                                 "read failure")};
      break;
    }
    case wire::Report::Body::OFFLOAD_DONE:
      report.body = OffloadDone{body.getOffloadDone(), in.getOffloadCopy()};
      break;
    case wire::Report::Body::CANCEL_CALL: report.body = CancelCall{body.getCancelCall()}; break;
    case wire::Report::Body::TRANSFER_PROGRESS: {
      auto progress = body.getTransferProgress();
      report.body = TransferProgress{progress.getTransfer(), progress.getEpoch(), progress.getBytes()};
      break;
    }
    default: invalid("report of an unknown kind");
  }
  return report;
}

Effect get(wire::Effect::Reader in) {
  Effect effect;
  effect.client = in.getClient();
  effect.session = in.getSession();
  auto message = in.getMessage();
  switch (message.which()) {
    case wire::Effect::Message::REPLY: {
      auto reply = message.getReply();
      effect.message = Reply{reply.getSeq(), get(reply.getOutcome()), reply.getToOpen(),
                             reply.getReplicaIncarnation(), reply.getReleased()};
      break;
    }
    case wire::Effect::Message::START_READ: {
      auto read = message.getStartRead();
      auto source = read.getSource();
      effect.message = StartRead{
          read.getTransfer(), read.getEpoch(), read.getCall(), read.getVersion(), read.getShard(),
          SourceRef{name(source.getReplica(), "source replica"), source.getIncarnation(),
                    name(source.getDatacenter(), "source datacenter"),
                    text(source.getEndpoint(), limits::kEndpointBytesMax, "source endpoint"),
                    enum_in_range(source.getKind(), CopyKind::kOffload, "copy kind"),
                    source.getPartial()},
          get_checksums(read.getChecksums()), read.getOffloadCopy(), get_layout(read.getLayout()),
          get_secret(read.getGrantSecret()), {}};
      auto& start = std::get<StartRead>(effect.message);
      list_at_most(read.getReshard(), limits::kShardsMax, "source shards");
      for (auto shard : read.getReshard()) {
        start.reshard.push_back(SourceShard{text(shard.getEndpoint(), limits::kEndpointBytesMax, "source endpoint"),
                                           get_layout(shard.getLayout()), get_checksums(shard.getChecksums())});
        if (start.reshard.back().layout == nullptr || start.reshard.back().checksums == nullptr) {
          invalid("a source shard of another layout without its tensors or checksums");
        }
      }
      if (start.offload_copy != 0 && start.layout == nullptr) invalid("a seed read without a layout");
      if (read.hasPatch()) start.patch = get_patch(read.getPatch());
      break;
    }
    case wire::Effect::Message::SERVE_READ: {
      auto serve = message.getServeRead();
      effect.message = ServeRead{serve.getTransfer(), serve.getEpoch(), serve.getVersion(),
                                 enum_in_range(serve.getKind(), CopyKind::kOffload, "copy kind"),
                                 serve.getShard(), name(serve.getReaderReplica(), "reader replica"),
                                 get_secret(serve.getGrantSecret()), serve.getPatch()};
      break;
    }
    case wire::Effect::Message::STOP_SERVING:
      effect.message = StopServing{message.getStopServing().getTransfer(),
                                   message.getStopServing().getEpoch()};
      break;
    case wire::Effect::Message::OFFLOAD:
      effect.message = Offload{message.getOffload(), in.getOffloadCopy()};
      break;
    case wire::Effect::Message::RELEASE_OFFLOAD:
      effect.message = ReleaseOffload{message.getReleaseOffload(), in.getOffloadCopy()};
      break;
    case wire::Effect::Message::COPY_CORRUPT:
      effect.message = CopyCorrupt{message.getCopyCorrupt(), in.getOffloadCopy()};
      break;
    case wire::Effect::Message::EVICTED: {
      auto evicted = message.getEvicted();
      effect.message = Evicted{enum_in_range(evicted.getReason(), kErrcLast, "eviction reason"),
                               text(evicted.getDetail(), kErrorDetailBytesMax, "detail")};
      break;
    }
    default: invalid("message of an unknown kind");
  }
  return effect;
}

ToHubMessage get(wire::ToHub::Reader in) {
  switch (in.which()) {
    case wire::ToHub::REQUEST: return get(in.getRequest());
    case wire::ToHub::REPORT: return get(in.getReport());
  }
  invalid("message of an unknown kind");
}

// Runs a decoder over untrusted bytes: an out-of-range field or a malformed Cap'n Proto message
// (which the reader reports by throwing kj::Exception) becomes a typed error.
template <typename Decoded, typename Reader>
Result<Decoded> decode_checked(Reader in, const char* what) {
  try {
    return get(in);
  } catch (const Invalid& bad) {
    return make_error(Errc::kInvalidArgument, std::string(what) + ": " + bad.what);
  } catch (const kj::Exception& malformed) {
    return make_error(Errc::kInvalidArgument,
                      std::string(what) + " is malformed: " + malformed.getDescription().cStr());
  }
}

}  // namespace

void encode(const Request& request, wire::Request::Builder out) {
  out.setClient(request.client);
  out.setSeq(request.seq);
  out.setSession(request.session);
  auto body = out.initBody();
  std::visit(
      [&](const auto& call) {
        using T = std::decay_t<decltype(call)>;
        if constexpr (std::is_same_v<T, OpenRequest>) {
          put(call, body.initOpen());
        } else if constexpr (std::is_same_v<T, PublishRequest>) {
          auto publish = body.initPublish();
          publish.setVersion(call.version);
          put_layout(call.layout, [&](unsigned n) { return publish.initLayout(n); });
          put_checksums(call.checksums, [&](unsigned n) { return publish.initChecksums(n); });
          if (call.patch) put_patch(*call.patch, publish.initPatch());
        } else if constexpr (std::is_same_v<T, UnpublishRequest>) {
          body.setUnpublish();
        } else if constexpr (std::is_same_v<T, ReplicateRequest>) {
          auto replicate = body.initReplicate();
          put(call.selector, replicate.initSelector());
          put_layout(call.layout, [&](unsigned n) { return replicate.initLayout(n); });
          replicate.setTimeoutMs(call.timeout_ms);
        } else if constexpr (std::is_same_v<T, UpdateRequest>) {
          auto update = body.initUpdate();
          put(call.selector, update.initSelector());
          put_layout(call.layout, [&](unsigned n) { return update.initLayout(n); });
        } else if constexpr (std::is_same_v<T, ListRequest>) {
          body.setList();
        } else if constexpr (std::is_same_v<T, WaitRequest>) {
          auto wait = body.initWait();
          put(call.predicate, wait.initPredicate());
          wait.setTimeoutMs(call.timeout_ms);
        } else {
          static_assert(std::is_same_v<T, CloseRequest>);
          body.setClose();
        }
      },
      request.body);
}

void encode(const Report& report, wire::Report::Builder out) {
  out.setClient(report.client);
  out.setSession(report.session);
  auto body = out.initBody();
  std::visit(
      [&](const auto& fact) {
        using T = std::decay_t<decltype(fact)>;
        if constexpr (std::is_same_v<T, Heartbeat>) {
          body.setHeartbeat();
        } else if constexpr (std::is_same_v<T, TransferDone>) {
          auto done = body.initTransferDone();
          done.setTransfer(fact.transfer);
          done.setEpoch(fact.epoch);
          put_checksums(fact.checksums, [&](unsigned n) { return done.initChecksums(n); });
        } else if constexpr (std::is_same_v<T, TransferFailed>) {
          auto failed = body.initTransferFailed();
          failed.setTransfer(fact.transfer);
          failed.setEpoch(fact.epoch);
          failed.setReason(static_cast<std::uint8_t>(fact.reason));
        } else if constexpr (std::is_same_v<T, CancelCall>) {
          body.setCancelCall(fact.seq);
        } else if constexpr (std::is_same_v<T, TransferProgress>) {
          auto progress = body.initTransferProgress();
          progress.setTransfer(fact.transfer);
          progress.setEpoch(fact.epoch);
          progress.setBytes(fact.bytes);
        } else {
          static_assert(std::is_same_v<T, OffloadDone>);
          body.setOffloadDone(fact.version);
          out.setOffloadCopy(fact.copy);
        }
      },
      report.body);
}

void encode(const Effect& effect, wire::Effect::Builder out) {
  out.setClient(effect.client);
  out.setSession(effect.session);
  auto message = out.initMessage();
  std::visit(
      [&](const auto& body) {
        using T = std::decay_t<decltype(body)>;
        if constexpr (std::is_same_v<T, Reply>) {
          auto reply = message.initReply();
          reply.setSeq(body.seq);
          put(body.outcome, reply.initOutcome());
          reply.setReplicaIncarnation(body.replica_incarnation);
          reply.setToOpen(body.to_open);
          reply.setReleased(body.released);
        } else if constexpr (std::is_same_v<T, StartRead>) {
          auto read = message.initStartRead();
          read.setTransfer(body.transfer);
          read.setEpoch(body.epoch);
          read.setVersion(body.version);
          read.setShard(body.shard);
          read.setCall(body.call);
          auto source = read.initSource();
          source.setReplica(body.source.replica);
          source.setIncarnation(body.source.incarnation);
          source.setDatacenter(body.source.datacenter);
          source.setEndpoint(body.source.endpoint);
          source.setKind(static_cast<std::uint8_t>(body.source.kind));
          source.setPartial(body.source.partial);
          put_checksums(body.checksums, [&](unsigned n) { return read.initChecksums(n); });
          read.setOffloadCopy(body.offload_copy);
          if (body.layout) put_layout(body.layout, [&](unsigned n) { return read.initLayout(n); });
          put_secret(body.secret, read.initGrantSecret(sizeof(GrantSecret)));
          auto reshard = read.initReshard(static_cast<unsigned>(body.reshard.size()));
          for (unsigned i = 0; i < body.reshard.size(); ++i) {
            const SourceShard& shard = body.reshard[i];
            auto source_shard = reshard[i];
            source_shard.setEndpoint(shard.endpoint);
            put_layout(shard.layout, [&](unsigned n) { return source_shard.initLayout(n); });
            put_checksums(shard.checksums, [&](unsigned n) { return source_shard.initChecksums(n); });
          }
          if (body.patch) put_patch(*body.patch, read.initPatch());
        } else if constexpr (std::is_same_v<T, ServeRead>) {
          auto serve = message.initServeRead();
          serve.setTransfer(body.transfer);
          serve.setEpoch(body.epoch);
          serve.setVersion(body.version);
          serve.setKind(static_cast<std::uint8_t>(body.kind));
          serve.setShard(body.shard);
          serve.setReaderReplica(body.reader_replica);
          put_secret(body.secret, serve.initGrantSecret(sizeof(GrantSecret)));
          serve.setPatch(body.patch);
        } else if constexpr (std::is_same_v<T, StopServing>) {
          auto stop = message.initStopServing();
          stop.setTransfer(body.transfer);
          stop.setEpoch(body.epoch);
        } else if constexpr (std::is_same_v<T, Offload>) {
          message.setOffload(body.version);
          out.setOffloadCopy(body.copy);
        } else if constexpr (std::is_same_v<T, ReleaseOffload>) {
          message.setReleaseOffload(body.version);
          out.setOffloadCopy(body.copy);
        } else if constexpr (std::is_same_v<T, CopyCorrupt>) {
          message.setCopyCorrupt(body.version);
          out.setOffloadCopy(body.offload_copy);
        } else {
          static_assert(std::is_same_v<T, Evicted>);
          auto evicted = message.initEvicted();
          evicted.setReason(static_cast<std::uint8_t>(body.reason));
          evicted.setDetail(body.detail);
        }
      },
      effect.message);
}

void encode(const ListSnapshot& snapshot, wire::ListSnapshot::Builder out) { put(snapshot, out); }

Result<ListSnapshot> decode(wire::ListSnapshot::Reader in) {
  auto decoded = decode_checked<std::shared_ptr<const ListSnapshot>>(in, "listing");
  if (!decoded.ok()) return decoded.error();
  return *decoded.value();
}

void encode(const ToHubMessage& message, wire::ToHub::Builder out) {
  if (const auto* request = std::get_if<Request>(&message)) {
    encode(*request, out.initRequest());
  } else {
    encode(std::get<Report>(message), out.initReport());
  }
}

Result<Request> decode(wire::Request::Reader in) { return decode_checked<Request>(in, "request"); }
Result<Report> decode(wire::Report::Reader in) { return decode_checked<Report>(in, "report"); }
Result<Effect> decode(wire::Effect::Reader in) { return decode_checked<Effect>(in, "effect"); }

Result<ToHubMessage> decode(wire::ToHub::Reader in) { return decode_checked<ToHubMessage>(in, "message"); }

}  // namespace th::net
