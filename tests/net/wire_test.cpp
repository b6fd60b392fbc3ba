// The wire codec: every message kind survives encode → decode with every field intact, and every
// out-of-range or malformed message is refused with a typed error instead of reaching the core.
#include "net/wire.h"

#include <capnp/message.h>
#include <capnp/serialize.h>
#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <vector>

namespace th::net {
namespace {

LayoutRef layout_of(std::vector<TensorSpec> tensors) { return ShardLayout::make(std::move(tensors)).value(); }

LayoutRef sample_layout() {
  return layout_of({{"embed", DType::kBFloat16, 4096}, {"head", DType::kFloat8E5M2, 77}});
}
ChecksumsRef sample_checksums() { return std::make_shared<Checksums>(Checksums{0xDEADBEEF, 42}); }

// The bytes of one encoded message, flattened: equal bytes mean equal messages.
template <typename WireType, typename Value>
kj::Array<capnp::word> bytes_of(const Value& value) {
  capnp::MallocMessageBuilder message;
  encode(value, message.initRoot<WireType>());
  return capnp::messageToFlatArray(message);
}

// encode, then decode from the flat bytes (as the far end would), asserting success.
template <typename WireType, typename Value>
Value round_trip(const Value& value) {
  auto flat = bytes_of<WireType>(value);
  capnp::FlatArrayMessageReader reader(flat);
  auto decoded = decode(reader.getRoot<WireType>());
  EXPECT_TRUE(decoded.ok()) << (decoded.ok() ? "" : decoded.error().detail);
  Value result = std::move(decoded).value();
  // And the decoded value encodes to the very same bytes: nothing lost on the way back either.
  auto again = bytes_of<WireType>(result);
  EXPECT_EQ(flat.asBytes().size(), again.asBytes().size());
  EXPECT_EQ(0, std::memcmp(flat.asBytes().begin(), again.asBytes().begin(),
                           std::min(flat.asBytes().size(), again.asBytes().size())));
  return result;
}

void expect_same_layout(const LayoutRef& a, const LayoutRef& b) {
  ASSERT_NE(a, nullptr);
  ASSERT_NE(b, nullptr);
  EXPECT_EQ(a->tensors(), b->tensors());
  EXPECT_EQ(a->digest(), b->digest());
}

TEST(Wire, OpenWithResumeKeepsEveryField) {
  auto resume = std::make_shared<Resume>();
  resume->primary = HeldCopy{7, sample_layout(), sample_checksums(), 0,
                             std::make_shared<const PatchInfo>(PatchInfo{6, std::vector<std::uint64_t>(sample_layout()->tensors().size(), 3)})};
  resume->offloads.push_back(HeldCopy{5, sample_layout(), sample_checksums(), 44});
  resume->last_txn = TxnRecord{
      9, OpKey{OpKind::kReplicate, Selector::latest(2), 0, WaitPredicate{}},
      ReplicateOk{7, "trainer-0"}};
  OpenRequest open{"llama", "rollout-3", 4, 1, 2, "dc-east", true, "rollout",
                   Retention{3, {11, 12}}, "10.0.0.7:5555", resume};
  open.incarnation_auto = true;
  const Request sent{99, 9, open, 17};

  const Request got = round_trip<wire::Request>(sent);
  EXPECT_TRUE(std::get<OpenRequest>(got.body).incarnation_auto);
  EXPECT_EQ(got.client, 99u);
  EXPECT_EQ(got.seq, 9u);
  EXPECT_EQ(got.session, 17u);
  const auto& o = std::get<OpenRequest>(got.body);
  EXPECT_EQ(o.model, "llama");
  EXPECT_EQ(o.replica, "rollout-3");
  EXPECT_EQ(o.incarnation, 4u);
  EXPECT_EQ(o.shard, 1u);
  EXPECT_EQ(o.num_shards, 2u);
  EXPECT_EQ(o.datacenter, "dc-east");
  EXPECT_TRUE(o.spot);
  EXPECT_EQ(o.role, "rollout");
  EXPECT_EQ(o.retention, (Retention{3, {11, 12}}));
  EXPECT_EQ(o.data_endpoint, "10.0.0.7:5555");
  ASSERT_NE(o.resume, nullptr);
  ASSERT_TRUE(o.resume->primary.has_value());
  EXPECT_EQ(o.resume->primary->version, 7u);
  expect_same_layout(o.resume->primary->layout, sample_layout());
  EXPECT_EQ(*o.resume->primary->checksums, *sample_checksums());
  ASSERT_NE(o.resume->primary->patch, nullptr);
  EXPECT_EQ(*o.resume->primary->patch, *resume->primary->patch);
  ASSERT_EQ(o.resume->offloads.size(), 1u);
  EXPECT_EQ(o.resume->offloads[0].patch, nullptr);
  EXPECT_EQ(o.resume->offloads[0].version, 5u);
  EXPECT_EQ(o.resume->offloads[0].copy, 44u);
  ASSERT_TRUE(o.resume->last_txn.has_value());
  EXPECT_EQ(o.resume->last_txn->seq, 9u);
  EXPECT_EQ(o.resume->last_txn->op, resume->last_txn->op);
  EXPECT_TRUE(same_answer(o.resume->last_txn->outcome, resume->last_txn->outcome));
}

TEST(Wire, OpenWithoutOptionalsStaysWithout) {
  OpenRequest open{"m", "r", 1, 0, 1, "", false, "", Retention{}, "", nullptr};
  const auto got = std::get<OpenRequest>(round_trip<wire::Request>(Request{1, 0, open, 1}).body);
  EXPECT_FALSE(got.retention.keep_latest.has_value());
  EXPECT_TRUE(got.retention.pinned.empty());
  EXPECT_EQ(got.resume, nullptr);
}

TEST(Wire, EveryCallKind) {
  {
    const auto got = round_trip<wire::Request>(
        Request{1, 2, PublishRequest{5, sample_layout(), sample_checksums()}, 3});
    const auto& publish = std::get<PublishRequest>(got.body);
    EXPECT_EQ(publish.version, 5u);
    expect_same_layout(publish.layout, sample_layout());
    EXPECT_EQ(*publish.checksums, *sample_checksums());
    EXPECT_EQ(publish.patch, nullptr);
  }
  {
    // With a patch against the version before (delta versions): its base and sizes travel.
    const auto patch = std::make_shared<const PatchInfo>(PatchInfo{4, std::vector<std::uint64_t>(sample_layout()->tensors().size(), 0)});
    const auto got = round_trip<wire::Request>(
        Request{1, 2, PublishRequest{5, sample_layout(), sample_checksums(), patch}, 3});
    const auto& publish = std::get<PublishRequest>(got.body);
    ASSERT_NE(publish.patch, nullptr);
    EXPECT_EQ(*publish.patch, *patch);
  }
  EXPECT_TRUE(std::holds_alternative<UnpublishRequest>(
      round_trip<wire::Request>(Request{1, 2, UnpublishRequest{}, 3}).body));
  {
    const auto got = round_trip<wire::Request>(
        Request{1, 2, ReplicateRequest{Selector::absolute(8), sample_layout(), 1500}, 3});
    const auto& replicate = std::get<ReplicateRequest>(got.body);
    EXPECT_EQ(replicate.selector, Selector::absolute(8));
    expect_same_layout(replicate.layout, sample_layout());
    EXPECT_EQ(replicate.timeout_ms, 1500);
  }
  {
    const auto got =
        round_trip<wire::Request>(Request{1, 2, UpdateRequest{Selector::latest(1), sample_layout()}, 3});
    EXPECT_EQ(std::get<UpdateRequest>(got.body).selector, Selector::latest(1));
  }
  EXPECT_TRUE(std::holds_alternative<ListRequest>(
      round_trip<wire::Request>(Request{1, 2, ListRequest{}, 3}).body));
  {
    const WaitPredicate predicate{WaitPredicate::Kind::kRoleHolds, 6, 2, "rollout"};
    const auto got = round_trip<wire::Request>(Request{1, 2, WaitRequest{predicate, 250}, 3});
    EXPECT_EQ(std::get<WaitRequest>(got.body).predicate, predicate);
    EXPECT_EQ(std::get<WaitRequest>(got.body).timeout_ms, 250);
  }
  EXPECT_TRUE(std::holds_alternative<CloseRequest>(
      round_trip<wire::Request>(Request{1, 2, CloseRequest{}, 3}).body));
}

// A tensor of each kind (bytes, a shard's own of a shape, a piece of the model's tensor).
LayoutRef placed_layout() {
  TensorSpec own{"bias", DType::kFloat32, 4 * 4 * 4};
  own.kind = TensorKind::kLocal;
  own.shape = {4, 4};
  TensorSpec piece{"qkv", DType::kBFloat16, 48 * 64 * 2};
  piece.kind = TensorKind::kPiece;
  piece.shape = {96, 64};
  piece.box = Box{{48, 0}, {48, 64}};
  return layout_of({{"embed", DType::kBFloat16, 4096}, own, piece});
}

TEST(Wire, TensorsKeepTheirShapeAndPlace) {
  const auto checksums = std::make_shared<const Checksums>(Checksums{1, 2, 3});
  const auto got = std::get<PublishRequest>(
      round_trip<wire::Request>(Request{1, 2, PublishRequest{5, placed_layout(), checksums}, 3}).body);
  expect_same_layout(got.layout, placed_layout());
  EXPECT_EQ(got.layout->tensors()[2].box, (Box{{48, 0}, {48, 64}}));
}

TEST(Wire, EveryReportKind) {
  const auto failed = std::get<TransferFailed>(
      round_trip<wire::Report>(Report{4, TransferFailed{10, 2, ReadFailure::kChecksumMismatch}, 6}).body);
  EXPECT_EQ(failed.transfer, 10u);
  EXPECT_EQ(failed.epoch, 2u);
  EXPECT_EQ(failed.reason, ReadFailure::kChecksumMismatch);
  const auto done = std::get<TransferDone>(round_trip<wire::Report>(Report{4, TransferDone{11, 3}, 6}).body);
  EXPECT_EQ(done.transfer, 11u);
  EXPECT_EQ(done.epoch, 3u);
  const auto offloaded =
      std::get<OffloadDone>(round_trip<wire::Report>(Report{4, OffloadDone{12, 13}, 6}).body);
  EXPECT_EQ(offloaded.version, 12u);
  EXPECT_EQ(offloaded.copy, 13u);
  EXPECT_EQ(std::get<CancelCall>(round_trip<wire::Report>(Report{4, CancelCall{31}, 6}).body).seq, 31u);
  const auto progress =
      std::get<TransferProgress>(round_trip<wire::Report>(Report{4, TransferProgress{14, 5, 1ULL << 40}, 6}).body);
  EXPECT_EQ(progress.transfer, 14u);
  EXPECT_EQ(progress.epoch, 5u);
  EXPECT_EQ(progress.bytes, 1ULL << 40);
  const Report heartbeat = round_trip<wire::Report>(Report{4, Heartbeat{}, 6});
  EXPECT_TRUE(std::holds_alternative<Heartbeat>(heartbeat.body));
  EXPECT_EQ(heartbeat.client, 4u);
  EXPECT_EQ(heartbeat.session, 6u);
}

TEST(Wire, EveryAnswerKind) {
  auto snapshot = std::make_shared<ListSnapshot>();
  snapshot->model = "llama";
  snapshot->latest = 9;
  snapshot->versions.push_back({9, 2, 1, true, false});
  snapshot->replicas.push_back({"trainer", 1, "dc-a", false, "trainer", 2, "complete", 9, 1, {7, 8}});
  const std::vector<Outcome> answers = {
      make_error(Errc::kVersionUnavailable, "gone"),
      OpenOk{2, 5, 12},
      OpenOk{2, std::nullopt},
      PublishOk{5},
      UnpublishOk{},
      ReplicateOk{6, "trainer"},
      UpdateOk{UpdateStatus::kNotYet, 4, ""},
      UpdateOk{UpdateStatus::kNoNewerVersion, 0, ""},
      UpdateOk{UpdateStatus::kNoNewerVersion, std::nullopt, ""},
      ListOk{snapshot},
      WaitOk{},
      CloseOk{},
  };
  for (const Outcome& answer : answers) {
    const Effect got = round_trip<wire::Effect>(Effect{3, Reply{8, answer, true, 2}, 5});
    EXPECT_EQ(got.client, 3u);
    EXPECT_EQ(got.session, 5u);
    const auto& reply = std::get<Reply>(got.message);
    EXPECT_EQ(reply.seq, 8u);
    EXPECT_EQ(reply.replica_incarnation, 2u);
    EXPECT_TRUE(reply.to_open);
    EXPECT_TRUE(same_answer(reply.outcome, answer)) << answer.index();
    EXPECT_EQ(reply.outcome.index(), answer.index());
  }
  // Holding nothing and holding version 0 are different answers.
  EXPECT_FALSE(same_answer(answers[7], answers[8]));
  const auto nothing = std::get<UpdateOk>(
      std::get<Reply>(round_trip<wire::Effect>(Effect{3, Reply{8, answers[8]}, 5}).message).outcome);
  EXPECT_FALSE(nothing.version.has_value());
  const auto error = std::get<Error>(
      std::get<Reply>(round_trip<wire::Effect>(Effect{3, Reply{8, answers[0]}, 5}).message).outcome);
  EXPECT_EQ(error.detail, "gone");
  const auto open = std::get<OpenOk>(
      std::get<Reply>(round_trip<wire::Effect>(Effect{3, Reply{8, answers[1]}, 5}).message).outcome);
  EXPECT_EQ(open.latest, std::optional<Version>(5));
  EXPECT_EQ(open.incarnation, 12u);
  const auto list = std::get<ListOk>(
      std::get<Reply>(round_trip<wire::Effect>(Effect{3, Reply{8, answers[9]}, 5}).message).outcome);
  EXPECT_EQ(*list.snapshot, *snapshot);
}

TEST(Wire, EveryServerMessageKind) {
  {
    const StartRead sent{21, 3, 17, 9, 1,
                         SourceRef{"rollout-2", 4, "dc-b", "10.1.1.1:7000", CopyKind::kOffload, true},
                         sample_checksums(), 0, nullptr};
    const auto got = std::get<StartRead>(round_trip<wire::Effect>(Effect{1, sent, 2}).message);
    EXPECT_EQ(got.transfer, 21u);
    EXPECT_EQ(got.epoch, 3u);
    EXPECT_EQ(got.call, 17u);
    EXPECT_EQ(got.version, 9u);
    EXPECT_EQ(got.shard, 1u);
    EXPECT_EQ(got.source.replica, "rollout-2");
    EXPECT_EQ(got.source.incarnation, 4u);
    EXPECT_EQ(got.source.datacenter, "dc-b");
    EXPECT_EQ(got.source.endpoint, "10.1.1.1:7000");
    EXPECT_EQ(got.source.kind, CopyKind::kOffload);
    EXPECT_TRUE(got.source.partial);
    EXPECT_EQ(*got.checksums, *sample_checksums());
    EXPECT_EQ(got.offload_copy, 0u);
    EXPECT_EQ(got.layout, nullptr);
    EXPECT_EQ(got.patch, nullptr);
  }
  {
    // A patch read: the patch's base and sizes.
    StartRead sent{21, 3, 17, 9, 1,
                   SourceRef{"rollout-2", 4, "dc-b", "10.1.1.1:7000", CopyKind::kPrimary, false},
                   sample_checksums(), 0, nullptr};
    sent.patch = std::make_shared<const PatchInfo>(PatchInfo{8, {120, 0, 7}});
    const auto got = std::get<StartRead>(round_trip<wire::Effect>(Effect{1, sent, 2}).message);
    ASSERT_NE(got.patch, nullptr);
    EXPECT_EQ(*got.patch, *sent.patch);
  }
  {
    // Offload seeding: into a new CPU copy of the given layout.
    const StartRead sent{21, 3, 0, 9, 1,
                         SourceRef{"trainer-0", 1, "dc-a", "10.1.1.2:7000", CopyKind::kPrimary, false},
                         sample_checksums(), 88, sample_layout()};
    const auto got = std::get<StartRead>(round_trip<wire::Effect>(Effect{1, sent, 2}).message);
    EXPECT_EQ(got.offload_copy, 88u);
    expect_same_layout(got.layout, sample_layout());
    // A seed read without a layout cannot be carried out: refused at the boundary.
    StartRead bad = sent;
    bad.layout = nullptr;
    auto flat = bytes_of<wire::Effect>(Effect{1, bad, 2});
    capnp::FlatArrayMessageReader reader(flat);
    const auto decoded = decode(reader.getRoot<wire::Effect>());
    ASSERT_FALSE(decoded.ok());
    EXPECT_EQ(decoded.error().code, Errc::kInvalidArgument);
  }
  {
    const ServeRead sent{22, 1, 9, CopyKind::kPrimary, 1, "rollout-5"};
    const auto got = std::get<ServeRead>(round_trip<wire::Effect>(Effect{1, sent, 2}).message);
    EXPECT_EQ(got.transfer, 22u);
    EXPECT_EQ(got.epoch, 1u);
    EXPECT_EQ(got.version, 9u);
    EXPECT_EQ(got.kind, CopyKind::kPrimary);
    EXPECT_EQ(got.shard, 1u);
    EXPECT_EQ(got.reader_replica, "rollout-5");
    EXPECT_FALSE(got.patch);
    ServeRead patch = sent;
    patch.patch = true;
    EXPECT_TRUE(std::get<ServeRead>(round_trip<wire::Effect>(Effect{1, patch, 2}).message).patch);
  }
  const auto stop = std::get<StopServing>(round_trip<wire::Effect>(Effect{1, StopServing{23, 4}, 2}).message);
  EXPECT_EQ(stop.transfer, 23u);
  EXPECT_EQ(stop.epoch, 4u);
  const auto offload = std::get<Offload>(round_trip<wire::Effect>(Effect{1, Offload{30, 77}, 2}).message);
  EXPECT_EQ(offload.version, 30u);
  EXPECT_EQ(offload.copy, 77u);
  const auto release =
      std::get<ReleaseOffload>(round_trip<wire::Effect>(Effect{1, ReleaseOffload{31, 78}, 2}).message);
  EXPECT_EQ(release.version, 31u);
  EXPECT_EQ(release.copy, 78u);
  const auto corrupt =
      std::get<CopyCorrupt>(round_trip<wire::Effect>(Effect{1, CopyCorrupt{32, 79}, 2}).message);
  EXPECT_EQ(corrupt.version, 32u);
  EXPECT_EQ(corrupt.offload_copy, 79u);
  EXPECT_EQ(std::get<CopyCorrupt>(round_trip<wire::Effect>(Effect{1, CopyCorrupt{33, 0}, 2}).message).offload_copy, 0u);
  const auto evicted = std::get<Evicted>(
      round_trip<wire::Effect>(Effect{1, Evicted{Errc::kBarrierTimeout, "late"}, 2}).message);
  EXPECT_EQ(evicted.reason, Errc::kBarrierTimeout);
  EXPECT_EQ(evicted.detail, "late");
}

// ---- Refusals ---------------------------------------------------------------------------------------

// Builds a request on the wire with `edit` applied, and decodes it.
template <typename Edit>
Result<Request> decode_edited_open(Edit edit) {
  capnp::MallocMessageBuilder message;
  auto request = message.initRoot<wire::Request>();
  encode(Request{1, 0, OpenRequest{"m", "r", 1, 0, 2, "dc", false, "", {}, "", nullptr}, 1}, request);
  edit(request.getBody().getOpen());
  return decode(request.asReader());
}

void expect_refused(const Result<Request>& decoded, const std::string& mentions) {
  ASSERT_FALSE(decoded.ok());
  EXPECT_EQ(decoded.error().code, Errc::kInvalidArgument);
  EXPECT_NE(decoded.error().detail.find(mentions), std::string::npos) << decoded.error().detail;
}

// Numbers the hub judges itself reach it, and validate(OpenRequest) (what the hub answers with)
// refuses them with a typed error.
TEST(Wire, OpensTheHubJudgesPassThroughToItsTypedRefusal) {
  auto judged = [](const Result<Request>& decoded) {
    EXPECT_TRUE(decoded.ok()) << (decoded.ok() ? "" : decoded.error().detail);
    return decoded.ok() ? validate(std::get<OpenRequest>(decoded.value().body)) : Status(Unit{});
  };
  auto code_of = [](const Status& status) { return status.ok() ? std::optional<Errc>() : status.error().code; };
  EXPECT_EQ(code_of(judged(decode_edited_open([](auto open) { open.setNumShards(0); }))), Errc::kInvalidArgument);
  EXPECT_EQ(code_of(judged(decode_edited_open([](auto open) { open.setNumShards(limits::kShardsMax + 1); }))),
            Errc::kInvalidArgument);
  EXPECT_EQ(code_of(judged(decode_edited_open([](auto open) { open.setShard(2); }))), Errc::kInvalidArgument);
  EXPECT_EQ(code_of(judged(decode_edited_open([](auto open) {
              open.getRetention().setHasKeepLatest(true);
              open.getRetention().setKeepLatest(limits::kKeepLatestMax + 1);
            }))),
            Errc::kLimitExceeded);
}

TEST(WireRefuses, OutOfRangeOpens) {
  expect_refused(decode_edited_open([](auto open) {
                   open.setModel(std::string(limits::kNameBytesMax + 1, 'x'));
                 }),
                 "model");
  expect_refused(decode_edited_open([](auto open) {
                   open.setDataEndpoint(std::string(limits::kEndpointBytesMax + 1, 'x'));
                 }),
                 "data endpoint");
  expect_refused(decode_edited_open([](auto open) {
                   open.getRetention().initPinned(limits::kPinnedPerOpenMax + 1);
                 }),
                 "pinned");
  expect_refused(decode_edited_open([](auto open) {
                   open.setHasResume(true);
                   open.initResume().setHasPrimary(true);  // a held copy without layout
                 }),
                 "held copy");
}

TEST(WireRefuses, BadCalls) {
  capnp::MallocMessageBuilder message;
  auto request = message.initRoot<wire::Request>();
  encode(Request{1, 1, PublishRequest{5, sample_layout(), sample_checksums()}, 1}, request);
  request.getBody().getPublish().getLayout()[0].setDtype(kDTypeCount);
  expect_refused(decode(request.asReader()), "dtype");

  encode(Request{1, 1, PublishRequest{5, sample_layout(), nullptr}, 1}, request);
  expect_refused(decode(request.asReader()), "one checksum per tensor");

  encode(Request{1, 1, PublishRequest{5, sample_layout(), sample_checksums()}, 1}, request);
  request.getBody().getPublish().getLayout()[1].setName("embed");
  expect_refused(decode(request.asReader()), "layout");

  // Fuzzing find (tests/fuzz/regressions/fuzz_wire/name-with-nul): a name with a NUL inside
  // decoded, then encoded as another name.
  encode(Request{1, 1, PublishRequest{5, sample_layout(), sample_checksums()}, 1}, request);
  const char nul_inside[] = {'w', '\0', 'x'};
  request.getBody().getPublish().getLayout()[0].setName(capnp::Text::Reader(nul_inside, sizeof nul_inside));
  expect_refused(decode(request.asReader()), "NUL");

  encode(Request{1, 1, WaitRequest{WaitPredicate{}, -1}, 1}, request);
  expect_refused(decode(request.asReader()), "wait timeout");

  encode(Request{1, 1, WaitRequest{WaitPredicate{}, 0}, 1}, request);
  request.getBody().getWait().getPredicate().setKind(3);
  expect_refused(decode(request.asReader()), "wait predicate");

  encode(Request{1, 1, ReplicateRequest{Selector::latest(), nullptr, limits::kDeadlineMsMax + 1}, 1},
         request);
  expect_refused(decode(request.asReader()), "replicate timeout");
}

TEST(WireRefuses, ShapesAndPlacesThatCannotBe) {
  capnp::MallocMessageBuilder message;
  auto request = message.initRoot<wire::Request>();
  const auto checksums = std::make_shared<const Checksums>(Checksums{1, 2, 3});
  const auto fresh = [&] {
    encode(Request{1, 1, PublishRequest{5, placed_layout(), checksums}, 1}, request);
    return request.getBody().getPublish().getLayout();
  };
  fresh()[2].setKind(3);
  expect_refused(decode(request.asReader()), "tensor kind");
  fresh()[2].getBoxOffset().set(0, 64);  // rows 64..112 of 96
  expect_refused(decode(request.asReader()), "lies outside its shape");
  fresh()[1].initShape(9);
  expect_refused(decode(request.asReader()), "shape");
  fresh()[1].getShape().set(0, 5);  // 5×4 float32 is not 64 bytes
  expect_refused(decode(request.asReader()), "tensor 'bias': 64 bytes for shape [5, 4]");
  fresh()[0].initShape(1).set(0, 4096);  // a tensor of bytes has no shape
  expect_refused(decode(request.asReader()), "no shape");
}

TEST(WireRefuses, BadReportsAndEffects) {
  capnp::MallocMessageBuilder message;
  auto report = message.initRoot<wire::Report>();
  encode(Report{1, TransferFailed{1, 1, ReadFailure::kSourceRefused}, 1}, report);
  report.getBody().getTransferFailed().setReason(200);
  auto decoded_report = decode(report.asReader());
  ASSERT_FALSE(decoded_report.ok());
  EXPECT_NE(decoded_report.error().detail.find("read failure"), std::string::npos);
  // The last reason there is travels (a shard that found its buffers were not a patch's base).
  report.getBody().getTransferFailed().setReason(static_cast<std::uint8_t>(ReadFailure::kPatchBaseMismatch));
  decoded_report = decode(report.asReader());
  ASSERT_TRUE(decoded_report.ok());
  EXPECT_EQ(std::get<TransferFailed>(decoded_report.value().body).reason, ReadFailure::kPatchBaseMismatch);
  report.getBody().getTransferFailed().setReason(static_cast<std::uint8_t>(ReadFailure::kPatchBaseMismatch) + 1);
  EXPECT_FALSE(decode(report.asReader()).ok());

  capnp::MallocMessageBuilder effect_message;
  auto effect = effect_message.initRoot<wire::Effect>();
  encode(Effect{1, Reply{1, make_error(Errc::kTimeout), 0}, 1}, effect);
  effect.getMessage().getReply().getOutcome().getError().setCode(
      static_cast<std::uint8_t>(kErrcLast) + 1);
  auto decoded_effect = decode(effect.asReader());
  ASSERT_FALSE(decoded_effect.ok());
  EXPECT_NE(decoded_effect.error().detail.find("error code"), std::string::npos);
}

// Garbage that claims to be a message: pointers out of bounds, lists past the end. The reader
// throws inside decode; the caller gets a typed error, never an exception or a crash.
TEST(WireRefuses, MalformedBytes) {
  std::uint64_t state = 0x9E3779B97F4A7C15ull;  // a fixed sequence: the test is repeatable
  std::size_t refused = 0;
  for (int trial = 0; trial < 2000; ++trial) {
    kj::Array<capnp::word> words = kj::heapArray<capnp::word>(8);
    auto bytes = words.asBytes();
    for (auto& byte : bytes) {
      state = state * 6364136223846793005ull + 1442695040888963407ull;
      byte = static_cast<kj::byte>(state >> 56);
    }
    const kj::ArrayPtr<const capnp::word> segments[] = {words};
    capnp::SegmentArrayMessageReader reader(kj::arrayPtr(segments, 1));
    // The root pointer itself is checked by the RPC layer before a method sees its parameters.
    wire::ToHub::Reader root;
    try {
      root = reader.getRoot<wire::ToHub>();
    } catch (const kj::Exception&) {
      ++refused;
      continue;
    }
    Result<ToHubMessage> decoded = make_error(Errc::kInvalidArgument);
    try {
      decoded = decode(root);
    } catch (...) {
      FAIL() << "decode let an exception out on trial " << trial;
    }
    if (!decoded.ok()) ++refused;
  }
  // Random words are almost never a valid message with in-range fields.
  EXPECT_GT(refused, 1000u);
}

}  // namespace
}  // namespace th::net
