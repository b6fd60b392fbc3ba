// The layouts of a model's replicas (README "Layouts", hub_state.h ModelLayout): which layout a
// replica has, whether it may read copies of another, and the checksums that vouch for a
// version's bytes in each. Apart because layouts are a rule of their own, whichever call (publish,
// replicate, update, a failover's resume) meets them.
#include <algorithm>
#include <map>
#include <string>
#include <string_view>

#include "core/box.h"
#include "core/hub.h"
#include "core/reshard.h"

namespace th {

using detail::Copy;
using detail::CopyState;
using detail::LayoutId;
using detail::Model;
using detail::ModelLayout;
using detail::Replica;
using detail::VersionRecord;

namespace {

bool all_pieces(const ShardLayout& layout) {
  return std::all_of(layout.tensors().begin(), layout.tensors().end(),
                     [](const TensorSpec& tensor) { return tensor.kind == TensorKind::kPiece; });
}

std::string first_not_piece(const std::vector<LayoutRef>& shards) {
  for (std::uint32_t shard = 0; shard < shards.size(); ++shard) {
    if (shards[shard] == nullptr) continue;
    for (const TensorSpec& tensor : shards[shard]->tensors()) {
      if (tensor.kind != TensorKind::kPiece) return "tensor '" + tensor.name + "' of shard " + std::to_string(shard);
    }
  }
  return "a tensor";
}

std::string describe_layout(const ModelLayout& layout) {
  return "the layout of " + std::to_string(layout.shards.size()) + " shards (" + std::to_string(layout.id) + ")";
}

// Why the shards' layouts differ from `layout`'s, naming the shard and tensor (nullopt: they agree).
std::optional<std::string> differs(const ModelLayout& layout, const std::vector<LayoutRef>& shards) {
  if (layout.shards.size() != shards.size()) return "another number of shards";
  for (std::uint32_t shard = 0; shard < shards.size(); ++shard) {
    if (shards[shard] == nullptr) continue;
    if (auto why = layout.shards[shard]->mismatch(*shards[shard])) return "shard " + std::to_string(shard) + ": " + *why;
  }
  return std::nullopt;
}

}  // namespace

// Why replicas of `reader` cannot read a complete copy of `source`, naming the tensor (nullopt: they
// can). Every tensor of the reader must be a piece of a tensor the source's shards hold as pieces,
// of the same global shape and of a dtype that converts (core/reshard.h); the source's pieces tile
// each of their tensors (check_replica_pieces), so every box of it is held somewhere.
std::optional<std::string> Hub::reads_across(const ModelLayout& reader, const ModelLayout& source) {
  std::map<std::string_view, const TensorSpec*> held;
  for (const LayoutRef& shard : source.shards) {
    for (const TensorSpec& tensor : shard->tensors()) {
      if (tensor.kind == TensorKind::kPiece) held.emplace(tensor.name, &tensor);
    }
  }
  for (std::uint32_t shard = 0; shard < reader.shards.size(); ++shard) {
    for (const TensorSpec& tensor : reader.shards[shard]->tensors()) {
      if (tensor.kind != TensorKind::kPiece) {
        return "tensor '" + tensor.name + "' of shard " + std::to_string(shard) +
               " is not a piece of the model's (register_piece), so it is read only from replicas of its own layout";
      }
      const auto found = held.find(tensor.name);
      if (found == held.end()) {
        return "tensor '" + tensor.name + "': no shard of " + describe_layout(source) + " holds it";
      }
      const TensorSpec& other = *found->second;
      if (other.shape != tensor.shape || !converts(other.dtype, tensor.dtype)) {
        return "tensor '" + tensor.name + "': shard " + std::to_string(shard) + " takes it as " +
               std::string(dtype_name(tensor.dtype)) + " " + describe_shape(tensor.shape) + ", " +
               describe_layout(source) + " holds " + std::string(dtype_name(other.dtype)) + " " +
               describe_shape(other.shape);
      }
    }
  }
  return std::nullopt;
}

std::optional<Error> Hub::early_layout_mismatch(const Replica& replica, std::uint32_t shard,
                                                const LayoutRef& layout) const {
  TH_ASSERT(layout != nullptr && shard < replica.num_shards);
  if (replica.layout != nullptr) {
    if (auto why = replica.layout->shards[shard]->mismatch(*layout)) {
      return make_error(Errc::kLayoutMismatch, "shard " + std::to_string(shard) + ": " + *why);
    }
    return std::nullopt;
  }
  // A layout of pieces may be new to the model: that is known once every shard described its own.
  // Any other must be one the model has, shard for shard.
  if (all_pieces(*layout)) return std::nullopt;
  const Model& model = *replica.model;
  std::optional<Error> first;
  for (const auto& known : model.layouts) {
    if (known->shards.size() != replica.num_shards) continue;
    auto why = known->shards[shard]->mismatch(*layout);
    if (!why) return std::nullopt;
    if (!first) first = make_error(Errc::kLayoutMismatch, "shard " + std::to_string(shard) + ": " + *why);
  }
  if (first) return first;
  if (!model.layouts.empty()) {
    return make_error(Errc::kLayoutMismatch,
                      "model '" + model.name + "' has no replicas of " + std::to_string(replica.num_shards) +
                          " shards, and shard " + std::to_string(shard) + "'s tensors are not all pieces of the model's "
                          "(register_piece): a replica reads another layout only if its every tensor says its place");
  }
  return std::nullopt;
}

Result<ModelLayout*> Hub::layout_for(Model& model, const std::vector<LayoutRef>& shards) {
  TH_ASSERT(!shards.empty());
  const bool partial = std::any_of(shards.begin(), shards.end(), [](const LayoutRef& s) { return s == nullptr; });
  std::optional<std::string> first_why;
  for (const auto& known : model.layouts) {
    if (known->shards.size() != shards.size()) continue;
    auto why = differs(*known, shards);
    if (why) {
      if (!first_why) first_why = std::move(why);
      continue;
    }
    // The same layout: it grows as specific as the most specific replica accepted (see refine()).
    bool refined = false;
    if (Status fits = refine_layout(model, *known, shards, refined); !fits) return fits.error();
    if (refined) relate(model, *known);  // bytes became pieces: other layouts may read it now
    return known.get();
  }
  if (first_why && (partial || !std::all_of(shards.begin(), shards.end(),
                                            [](const LayoutRef& s) { return all_pieces(*s); }))) {
    return make_error(Errc::kLayoutMismatch, *first_why);
  }
  if (partial) {
    // After a failover, some shards' layouts unknown: only a layout the model has can be meant.
    return make_error(Errc::kLayoutMismatch, "model '" + model.name + "' has no layout of " +
                                                 std::to_string(shards.size()) + " shards matching what the replica's shards hold");
  }
  if (!model.layouts.empty() &&
      !std::all_of(shards.begin(), shards.end(), [](const LayoutRef& s) { return all_pieces(*s); })) {
    return make_error(Errc::kLayoutMismatch,
                      "model '" + model.name + "' has no replicas of " + std::to_string(shards.size()) + " shards, and " +
                          first_not_piece(shards) + " is not a piece of the model's (register_piece): a replica " +
                          "reads another layout only if its every tensor says its place");
  }
  if (model.layouts.size() >= limits::kLayoutsPerModelMax) {
    return make_error(Errc::kLimitExceeded, "model '" + model.name + "' already has " +
                                                std::to_string(limits::kLayoutsPerModelMax) +
                                                " layouts (kinds of replicas with their own shards and pieces)");
  }
  std::uint64_t described = 0;
  for (const LayoutRef& shard : shards) described += shard->description_bytes();
  if (Status fits = admit_descriptions(model, described); !fits) return fits.error();
  auto made = std::make_unique<ModelLayout>();
  made->id = static_cast<LayoutId>(model.layouts.size());
  made->shards = shards;
  ModelLayout& layout = *made;
  model.layouts.push_back(std::move(made));
  charge_descriptions(model, layout, described);
  relate(model, layout);
  return &layout;
}

// ---- What descriptions cost (HubSettings::description_bytes_max) ---------------------------------

Status Hub::admit_descriptions(const Model& model, std::uint64_t added) const {
  if (added > settings_.model_description_bytes_max - model.description_bytes) {
    return make_error(Errc::kLimitExceeded,
                      "model '" + model.name + "' would keep " + std::to_string(model.description_bytes + added) +
                          " bytes of tensor descriptions, over its limit of " +
                          std::to_string(settings_.model_description_bytes_max) +
                          " (--model-description-bytes-max; fewer or shorter tensor names, or fewer layouts)");
  }
  if (added > settings_.description_bytes_max - description_bytes_) {
    return make_error(Errc::kLimitExceeded,
                      "the server's models would keep " + std::to_string(description_bytes_ + added) +
                          " bytes of tensor descriptions, over its limit of " +
                          std::to_string(settings_.description_bytes_max) +
                          " (--description-bytes-max; a model's are freed when it ends)");
  }
  return Unit{};
}

void Hub::charge_descriptions(Model& model, ModelLayout& layout, std::uint64_t added) {
  layout.description_bytes += added;
  model.description_bytes += added;
  description_bytes_ += added;
  TH_ASSERT(model.description_bytes <= settings_.model_description_bytes_max &&
                description_bytes_ <= settings_.description_bytes_max,
            "descriptions are admitted before they are kept");
}

Status Hub::refine_layout(Model& model, ModelLayout& layout, const std::vector<LayoutRef>& shards, bool& refined) {
  TH_ASSERT(shards.size() == layout.shards.size());
  // The refined descriptions first, then their cost, then (if they fit) the change.
  std::vector<LayoutRef> more(layout.shards.size());
  std::uint64_t added = 0;
  for (std::uint32_t shard = 0; shard < shards.size(); ++shard) {
    more[shard] = shards[shard] == nullptr ? layout.shards[shard] : ShardLayout::refine(layout.shards[shard], shards[shard]);
    const std::uint64_t before = layout.shards[shard]->description_bytes();
    const std::uint64_t after = more[shard]->description_bytes();
    // Refining only adds a shape or a box to a tensor (bytes, then shape, then piece).
    TH_ASSERT(after >= before, "a refined description is no smaller");
    added += after - before;
  }
  if (Status fits = admit_descriptions(model, added); !fits) return fits;
  refined = false;
  for (std::uint32_t shard = 0; shard < shards.size(); ++shard) {
    refined = refined || more[shard] != layout.shards[shard];
    layout.shards[shard] = std::move(more[shard]);
  }
  charge_descriptions(model, layout, added);
  return Unit{};
}

std::uint64_t Hub::description_bytes(std::string_view model) const {
  const auto found = models_.find(model);
  return found == models_.end() ? 0 : found->second->description_bytes;
}

ModelLayout* Hub::known_layout(const Model& model, const std::vector<LayoutRef>& shards, std::uint32_t num_shards) {
  for (const auto& known : model.layouts) {
    if (known->shards.size() != num_shards) continue;
    bool agrees = true;
    for (std::uint32_t shard = 0; agrees && shard < shards.size() && shard < num_shards; ++shard) {
      agrees = shards[shard] == nullptr || !known->shards[shard]->mismatch(*shards[shard]).has_value();
    }
    if (agrees) return known.get();
  }
  return nullptr;
}

void Hub::relate(Model& model, ModelLayout& layout) {
  layout.pieces_only = std::all_of(layout.shards.begin(), layout.shards.end(),
                                   [](const LayoutRef& s) { return all_pieces(*s); });
  for (const auto& other : model.layouts) {
    if (other.get() == &layout) continue;
    layout.reads_from[other->id] = reads_across(layout, *other);
    other->reads_from[layout.id] = reads_across(*other, layout);
  }
}

void Hub::set_layout(Replica& replica, ModelLayout* layout) {
  TH_ASSERT(layout != nullptr && layout->shards.size() == replica.num_shards);
  if (replica.layout == layout) return;
  replica.layout = layout;
  // What a copy adds to its version's roots is counted under its replica's layout.
  if (replica.primary != nullptr) reindex(*replica.primary);
  for (Copy* offload : replica.offloads) reindex(*offload);
}

bool Hub::serves(const Copy& candidate, const Copy& reader) const {
  // Another layout is read whole (no pipelining: a piece needs all of its bytes before it
  // verifies, and the reader's shards need bytes of every source shard).
  return serves_once_complete(candidate, reader) &&
         (candidate.owner->layout == reader.owner->layout || candidate.state == CopyState::kComplete);
}

bool Hub::serves_once_complete(const Copy& candidate, const Copy& reader) const {
  const ModelLayout* wanted = reader.owner->layout;
  const ModelLayout* held = candidate.owner->layout;
  TH_ASSERT(wanted != nullptr, "a reader looks for a source once its layout is known");
  if (held == wanted) return true;
  if (held == nullptr) return false;
  // Never into a seed's CPU copy: an offload holds its replica's layout, byte for byte.
  return reader.kind == CopyKind::kPrimary && !wanted->reads_from.at(held->id).has_value();
}

bool Hub::may_complete(const Copy& reader) const {
  const VersionRecord& record = *reader.record;
  const ModelLayout* wanted = reader.owner->layout;
  TH_ASSERT(wanted != nullptr);
  for (const auto& [layout, roots] : record.roots_by_layout) {
    if (roots == 0) continue;
    // A copy still publishing has no layout yet: it may turn out one the reader reads.
    if (layout == detail::kNoLayout || layout == wanted->id) return true;
    if (reader.kind == CopyKind::kPrimary && !wanted->reads_from.at(layout).has_value()) return true;
  }
  return false;
}

std::optional<std::string> Hub::unreadable(const ModelLayout& wanted, const Model& model,
                                           const VersionRecord& record) const {
  std::optional<std::string> why;
  for (const auto& [layout, checksums] : record.checksums) {
    if (layout == wanted.id) return std::nullopt;
    // (A layout the model does not have yet is related to none: compared here, once.)
    std::optional<std::string> across = wanted.id != detail::kNoLayout ? wanted.reads_from.at(layout)
                                                                       : reads_across(wanted, *model.layouts[layout]);
    if (!across) return std::nullopt;
    if (!why) why = std::move(across);
  }
  return why;
}

Status Hub::check_shard(const Replica& replica, const VersionRecord& record, std::uint32_t shard,
                        const LayoutRef& layout, const ChecksumsRef& checksums) const {
  if (!layout || !checksums) {
    return make_error(Errc::kInvalidArgument, "publish needs registered tensors and checksums");
  }
  if (checksums->size() != layout->tensors().size()) {
    return make_error(Errc::kInvalidArgument,
                      "shard " + std::to_string(shard) + " sent " + std::to_string(checksums->size()) +
                          " checksums for " + std::to_string(layout->tensors().size()) + " tensors");
  }
  if (auto error = early_layout_mismatch(replica, shard, layout)) return *error;
  if (replica.layout != nullptr) return check_checksums(record, *replica.layout, shard, layout, checksums);
  return Unit{};
}

Status Hub::check_checksums(const VersionRecord& record, const ModelLayout& layout, std::uint32_t shard,
                            const LayoutRef& tensors, const ChecksumsRef& checksums) const {
  TH_ASSERT(shard < layout.shards.size() && checksums != nullptr);
  const auto found = record.checksums.find(layout.id);
  if (found == record.checksums.end() || found->second[shard] == nullptr) return Unit{};
  const Checksums& known = *found->second[shard];
  if (known.size() != checksums->size()) {
    return make_error(Errc::kInvalidArgument, "shard " + std::to_string(shard) + " has " +
                                                  std::to_string(checksums->size()) + " checksums for " +
                                                  std::to_string(known.size()) + " tensors");
  }
  if (known == *checksums) return Unit{};
  std::size_t tensor = 0;
  while (known[tensor] == (*checksums)[tensor]) ++tensor;
  return make_error(Errc::kChecksumConflict, "version " + std::to_string(record.version) + " shard " +
                                                 std::to_string(shard) + " tensor '" + tensors->tensors()[tensor].name +
                                                 "' differs from what an earlier copy of its layout holds");
}

void Hub::commit_checksums(VersionRecord& record, const ModelLayout& layout, std::uint32_t shard,
                           const ChecksumsRef& checksums) {
  TH_ASSERT(checksums != nullptr && checksums->size() == layout.shards[shard]->tensors().size());
  auto& per_shard = record.checksums[layout.id];
  if (per_shard.empty()) per_shard.resize(layout.shards.size());
  if (per_shard[shard] == nullptr) per_shard[shard] = checksums;
}

const ChecksumsRef& Hub::checksums_of(const VersionRecord& record, const ModelLayout& layout,
                                      std::uint32_t shard) {
  static const ChecksumsRef kNone;
  const auto found = record.checksums.find(layout.id);
  if (found == record.checksums.end()) return kNone;
  TH_ASSERT(shard < found->second.size());
  return found->second[shard];
}

bool Hub::vouched(const VersionRecord& record, const ModelLayout& layout) {
  const auto found = record.checksums.find(layout.id);
  return found != record.checksums.end() &&
         std::all_of(found->second.begin(), found->second.end(), [](const ChecksumsRef& c) { return c != nullptr; });
}

}  // namespace th
