// checkpoint_reader.cpp — loading: CheckpointReader opens a tag (from `latest`, a tag name or a
// path), verifies its manifest and digests, and reads any flat range of a state whatever the
// number of ranks that saved it (see checkpoint.hpp).
#include <algorithm>
#include <filesystem>

#include "base/errors.hpp"
#include "base/failure.hpp"
#include "io/checkpoint.hpp"
#include "io/checkpoint_format.hpp"
#include "io/h5.hpp"

namespace fs = std::filesystem;

namespace zero3d {

using namespace ckpt;
using h5::Handle;

CheckpointReader CheckpointReader::open(const std::string& spec, const std::string& save_dir, bool node_local) {
  h5::quiet_errors();
  fs::path dir;
  auto from_latest = [](const fs::path& d) {
    const fs::path latest = d / "latest";
    std::error_code ec;
    if (!fs::exists(latest, ec)) throw InputError(latest.string() + ": not found: no checkpoint to resume from");
    std::string tag = read_small_file(latest.string(), 4096);
    while (!tag.empty() && (tag.back() == '\n' || tag.back() == '\r')) tag.pop_back();
    if (tag.empty()) throw InputError(latest.string() + ": empty");
    const bool printable = std::all_of(tag.begin(), tag.end(), [](char c) { return c > 0x20 && c < 0x7f && c != '/'; });
    if (!printable || tag == "." || tag == "..")
      throw InputError(latest.string() + ": does not hold a tag name (" + std::to_string(tag.size()) + " bytes)");
    return d / tag;
  };
  std::error_code ec;
  auto exists = [&](const fs::path& p) { return fs::exists(p, ec); };
  auto tag_like = [&](const fs::path& p) { return exists(p / "index.h5") || exists(fs::path(p.string() + ".old.tmp") / "index.h5"); };
  if (spec == "latest") dir = from_latest(save_dir);
  else if (tag_like(spec)) dir = spec;
  else if (exists(fs::path(spec) / "latest")) dir = from_latest(spec);
  else if (!save_dir.empty() && tag_like(fs::path(save_dir) / spec)) dir = fs::path(save_dir) / spec;
  else if (save_dir.empty()) throw InputError("\"" + spec + "\": neither `latest` nor a checkpoint directory");
  else throw InputError("training.resume: \"" + spec + "\" is neither `latest`, a tag in " + save_dir + ", nor a checkpoint directory");
  // A kill between a re-save's two renames: the previous save waits, complete, in .old.tmp.
  const fs::path aside(dir.string() + ".old.tmp");
  if (!exists(dir) && exists(aside / kManifest)) dir = aside;
  CheckpointReader r;
  r.dir_ = dir.string();
  const std::string index = (dir / "index.h5").string(), manifest = (dir / kManifest).string();
  if (!exists(index)) throw InputError(index + ": missing: the checkpoint is incomplete");
  // The manifest first: it says what every other file must be.
  if (exists(manifest)) {
    try {
      r.manifest_ = nlohmann::json::parse(read_small_file(manifest, size_t(64) << 20));
    } catch (const nlohmann::json::exception&) {
      throw InputError(manifest + ": corrupted (not JSON)");
    }
    if (!r.manifest_.is_object() || r.manifest_.value("format", "") != "zero3d-checkpoint-manifest" ||
        !r.manifest_.contains("xxh64") || !r.manifest_["xxh64"].is_string() ||
        r.manifest_["xxh64"].get<std::string>() != manifest_digest(r.manifest_))
      throw InputError(manifest + ": checksum mismatch: the manifest is corrupted or edited");
    try {
      for (const auto& [name, f] : r.manifest_.at("files").items()) {
        const fs::path p = dir / name;
        if (name.find('/') != std::string::npos) throw InputError(manifest + ": lists a file outside the tag");
        if (!exists(p)) {
          const bool shard = name.rfind("rank_", 0) == 0;
          if (shard && node_local) {  // written on another node; read_range says so if this rank needs it
            r.absent_.insert(name);
            continue;
          }
          throw InputError(p.string() + (shard ? ": missing shard (" + std::to_string(r.manifest_.at("shards").get<int64_t>()) + " expected)"
                                               : ": missing: the checkpoint is incomplete"));
        }
        const auto size = fs::file_size(p, ec);
        if (ec || static_cast<int64_t>(size) != f.at("bytes").get<int64_t>())
          throw InputError(p.string() + ": truncated or replaced: " + std::to_string(ec ? 0 : size) + " bytes, " + kManifest +
                           " records " + std::to_string(f.at("bytes").get<int64_t>()));
      }
    } catch (const nlohmann::json::exception& e) {
      throw InputError(manifest + ": incomplete (" + std::string(e.what()) + ")");
    }
    r.verify_file("index.h5");
    r.verify_file(kMarker);
  }
  h5::File f = h5::File::open_read(index);
  std::string text;
  if (!h5::read_text(f.id(), "meta", text)) throw InputError(index + ": no checkpoint metadata (corrupted?)");
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(text);
  } catch (const nlohmann::json::parse_error&) {
    throw InputError(index + ": checkpoint metadata is corrupted");
  }
  r.meta_ = meta_from_json(j, index);
  const int version = j.value("format_version", 1);
  if (r.has_manifest()) {
    if (r.manifest_.value("meta_xxh64", "") != hex64(xxh64(text.data(), text.size())))
      throw InputError(index + ": checksum mismatch: the metadata differs from what " + kManifest + " records");
    if (r.manifest_.value("tag_id", "") != r.meta_.tag_id)
      throw InputError(index + ": belongs to another save (tag id " + r.meta_.tag_id + ", " + kManifest + " says " +
                       r.manifest_.value("tag_id", "") + ")");
    if (r.manifest_.value("shards", int64_t(-1)) != static_cast<int64_t>(r.meta_.ranges.size()))
      throw InputError(manifest + ": records " + r.manifest_.value("shards", nlohmann::json()).dump() + " shards, " + index +
                       " " + std::to_string(r.meta_.ranges.size()));
  } else if (version >= 2) {
    throw InputError(manifest + ": missing: the checkpoint is incomplete");
  }
  r.local_offsets_ = local_offsets(r.meta_.ranges);
  for (size_t q = 0; q < r.meta_.ranges.size(); ++q) {
    const fs::path shard = dir / shard_name(static_cast<int64_t>(q));
    if (!exists(shard) && node_local && r.has_manifest()) r.absent_.insert(shard_name(static_cast<int64_t>(q)));
    else if (!exists(shard))
      throw InputError(shard.string() + ": missing shard (" + std::to_string(r.meta_.ranges.size()) + " expected)");
    if (r.has_manifest() && !r.manifest_["files"].contains(shard_name(static_cast<int64_t>(q))))
      throw InputError(manifest + ": does not list " + shard_name(static_cast<int64_t>(q)));
  }
  // index.h5's own structure: one float virtual dataset per tensor and state, of the tensor's
  // shape, mapped from exactly the shard pieces the metadata implies.
  for (const std::string& state : r.meta_.states) {
    const std::string prefix = state == "params" ? "/" : "/" + state + "/";
    for (const auto& t : r.meta_.tensors) {
      const std::string name = prefix + t.at("name").get<std::string>();
      const auto shape = t.at("shape").get<std::vector<int64_t>>();
      const auto damaged = [&](const std::string& what) { return InputError(index + ": dataset " + name + " " + what + " (index.h5 damaged or from another save)"); };
      if (H5Lexists(f.id(), name.c_str(), H5P_DEFAULT) <= 0) throw damaged("is missing");
      Handle ds(H5Dopen2(f.id(), name.c_str(), H5P_DEFAULT), H5Dclose);
      if (!ds.valid()) throw damaged("cannot be opened");
      Handle type(H5Dget_type(ds.get()), H5Tclose);
      if (!type.valid() || H5Tget_class(type.get()) != H5T_FLOAT || H5Tget_size(type.get()) != 4) throw damaged("is not fp32");
      std::vector<int64_t> dims;
      try {
        dims = f.shape(name);
      } catch (const InputError&) {
        throw damaged("has no readable shape");
      }
      if (dims != shape) throw damaged("has shape " + nlohmann::json(dims).dump() + ", the metadata " + nlohmann::json(shape).dump());
      Handle dcpl(H5Dget_create_plist(ds.get()), H5Pclose);
      size_t count = 0;
      if (!dcpl.valid() || H5Pget_layout(dcpl.get()) != H5D_VIRTUAL || H5Pget_virtual_count(dcpl.get(), &count) < 0)
        throw damaged("is not a virtual dataset");
      int64_t numel = 1;
      for (int64_t d : shape) numel *= d;
      auto expect = mappings_of(r.meta_, r.local_offsets_, shape, t.at("offset").get<int64_t>(), numel);
      if (count != expect.size())  // a save from before row blocks were coalesced
        expect = mappings_of(r.meta_, r.local_offsets_, shape, t.at("offset").get<int64_t>(), numel, false);
      if (count != expect.size())
        throw damaged("maps " + std::to_string(count) + " pieces, the shard segments make " + std::to_string(expect.size()));
      for (size_t i = 0; i < count; ++i) {
        char file[256] = {0}, dset[256] = {0};
        const ssize_t nf = H5Pget_virtual_filename(dcpl.get(), i, file, sizeof(file));
        const ssize_t nd = H5Pget_virtual_dsetname(dcpl.get(), i, dset, sizeof(dset));
        Handle vs(H5Pget_virtual_vspace(dcpl.get(), i), H5Sclose), ss(H5Pget_virtual_srcspace(dcpl.get(), i), H5Sclose);
        hsize_t vlo[2] = {0, 0}, vhi[2] = {0, 0}, slo[1] = {0}, shi[1] = {0};
        const Mapping& m = expect[i];
        bool ok = nf > 0 && nd > 0 && std::string(file) == shard_name(m.shard) && std::string(dset) == state && vs.valid() &&
                  ss.valid() && H5Sget_select_bounds(vs.get(), vlo, vhi) >= 0 && H5Sget_select_bounds(ss.get(), slo, shi) >= 0;
        for (size_t d = 0; ok && d < shape.size(); ++d)
          ok = vlo[d] == m.piece.start[d] && vhi[d] + 1 == m.piece.start[d] + m.piece.count[d];
        // The source selection: its first and last element and its element count.
        const SourceSlab src = source_slab(m.piece);
        ok = ok && slo[0] == src.start && shi[0] + 1 == src.start + (src.count - 1) * src.stride + src.block &&
             H5Sget_select_npoints(ss.get()) == hssize_t(src.count * src.block);
        if (!ok) throw damaged("maps piece " + std::to_string(i) + " differently from the shard segments");
      }
    }
  }
  return r;
}

void CheckpointReader::verify_file(const std::string& name) const {
  if (!has_manifest() || verified_.count(name)) return;
  const std::string path = (fs::path(dir_) / name).string();
  const nlohmann::json& files = manifest_.at("files");
  if (!files.contains(name)) throw InputError(path + ": not listed in " + std::string(kManifest));
  const auto [bytes, digest] = file_digest(path, false);
  if (bytes != files[name].value("bytes", int64_t(-1)) || hex64(digest) != files[name].value("xxh64", ""))
    throw InputError(path + ": checksum mismatch: its content digest (XXH64) differs from " + kManifest +
                     " — corrupted, or a file from another save");
  verified_.insert(name);
}

void CheckpointReader::verify_files() const {
  if (!has_manifest()) return;
  for (const auto& [name, f] : manifest_.at("files").items()) verify_file(name);
}

std::optional<RankState> CheckpointReader::read_rank_state(int64_t rank, const std::string& name) const {
  const std::string shard = shard_name(rank);
  if (rank < 0 || static_cast<size_t>(rank) >= meta_.ranges.size() || absent_.count(shard)) return std::nullopt;
  verify_file(shard);
  const h5::File f = h5::File::open_read((fs::path(dir_) / shard).string());
  RankState r;
  r.name = name;
  if (!h5::read_text(f.id(), name, r.meta)) return std::nullopt;
  r.codes = f.read_int8(name + "_codes");
  r.scales = f.read_floats(name + "_scales");
  return r;
}

void CheckpointReader::read_range(const std::string& state, int64_t begin, int64_t end, float* out) const {
  if (std::find(meta_.states.begin(), meta_.states.end(), state) == meta_.states.end())
    throw InputError(dir_ + ": the checkpoint holds no `" + state + "` (saved with optimizer " + meta_.optimizer_type + ")");
  if (begin < 0 || end > meta_.total_params || begin > end)
    throw InputError(dir_ + ": range [" + std::to_string(begin) + ", " + std::to_string(end) + ") is outside the " +
                     std::to_string(meta_.total_params) + " saved elements");
  const int version = has_manifest() ? kCheckpointFormatVersion : 1;
  for (size_t q = 0; q < meta_.ranges.size(); ++q) {
    const SegmentList& segs = meta_.ranges[q];
    bool needed = false;
    for (const auto& [b, e] : segs) needed = needed || (std::max(b, begin) < std::min(e, end));
    if (!needed) continue;
    const std::string name = shard_name(static_cast<int64_t>(q)), path = (fs::path(dir_) / name).string();
    if (absent_.count(name))
      throw InputError(path + ": not on this node (checkpoint.use_node_local_storage): the range [" + std::to_string(begin) +
                       ", " + std::to_string(end) + ") of `" + state + "` lies in a shard another node wrote; resume "
                       "with the ranks on each node of the run that saved, or gather every node's shards into one "
                       "save_dir");
    verify_file(name);
    hid_t fid = H5Fopen(path.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT);
    if (fid < 0) throw InputError(path + ": cannot open shard (truncated or not an HDF5 file)");
    Handle file(fid, H5Fclose);
    bool same = false;
    if (version == 1) {
      int64_t rb = -1, re = -1;
      same = h5::read_attribute(fid, "range_begin", rb) && h5::read_attribute(fid, "range_end", re) &&
             (segs.empty() ? rb == re : (rb == segs[0].first && re == segs[0].second));
    } else {
      std::string seg_text, tag_id;
      same = h5::read_text(fid, "segments", seg_text) && h5::read_attribute(fid, "tag_id", tag_id) &&
             tag_id == meta_.tag_id && seg_text == segments_json(segs).dump();
    }
    int64_t step = -1;
    if (!same || !h5::read_attribute(fid, "step", step) || step != meta_.step)
      throw InputError(path + ": shard does not belong to this checkpoint (segments, tag id or step differ from index.h5)");
    const Handle dapl = h5::chunk_cache_access(2 * kShardChunk * sizeof(float));
    Handle ds(H5Dopen2(fid, state.c_str(), dapl.get()), H5Dclose);
    if (!ds.valid()) throw InputError(path + ": dataset `" + state + "` missing");
    Handle fspace(H5Dget_space(ds.get()), H5Sclose);
    hsize_t len = 0;
    const int64_t expect_len = segs.empty() ? 0 : local_offsets_[q].back() + (segs.back().second - segs.back().first);
    if (!fspace.valid() || H5Sget_simple_extent_ndims(fspace.get()) != 1 ||
        H5Sget_simple_extent_dims(fspace.get(), &len, nullptr) < 0 || static_cast<int64_t>(len) != expect_len)
      throw InputError(path + ": dataset `" + state + "` does not have the " + std::to_string(expect_len) + " elements of its segments");
    for (size_t k = 0; k < segs.size(); ++k) {
      const auto [b, e] = segs[k];
      const int64_t lo = std::max(b, begin), hi = std::min(e, end);
      if (lo >= hi) continue;
      const hsize_t start = static_cast<hsize_t>(local_offsets_[q][k] + (lo - b)), count = static_cast<hsize_t>(hi - lo);
      Handle mspace(H5Screate_simple(1, &count, nullptr), H5Sclose);
      if (H5Sselect_hyperslab(fspace.get(), H5S_SELECT_SET, &start, nullptr, &count, nullptr) < 0 || !mspace.valid() ||
          H5Dread(ds.get(), H5T_NATIVE_FLOAT, mspace.get(), fspace.get(), H5P_DEFAULT, out + (lo - begin)) < 0)
        throw InputError(path + ": dataset `" + state + "` cannot be read: checksum mismatch or corrupted data");
    }
  }
}

void CheckpointReader::check_layout(const ParamLayout& layout) const {
  const auto& tensors = meta_.tensors;
  const std::string where = dir_ + "/index.h5";
  if (tensors.size() != layout.tensors().size())
    throw InputError(where + ": the checkpoint has " + std::to_string(tensors.size()) + " tensors, the configured model " +
                     std::to_string(layout.tensors().size()) + " (different n_layer?)");
  for (size_t i = 0; i < tensors.size(); ++i) {
    const TensorSpec& t = layout.tensors()[i];
    const auto shape = tensors[i].at("shape").get<std::vector<int64_t>>();
    if (tensors[i].at("name") != t.name || shape != t.shape)
      throw InputError(where + ": tensor `" + t.name + "` has shape " + nlohmann::json(shape).dump() +
                       " in the checkpoint but " + nlohmann::json(t.shape).dump() + " in the configured model");
  }
}

void CheckpointReader::check_model(const nlohmann::json& model_section) const {
  const std::string where = dir_ + "/index.h5";
  const nlohmann::json saved = meta_.config.is_object() ? meta_.config.value("model", nlohmann::json()) : nlohmann::json();
  if (!saved.is_object()) {
    if (has_manifest()) throw InputError(where + ": the checkpoint metadata has no model section");
    return;  // format 1 without a saved config: tensor shapes are all there is to compare
  }
  for (const auto& [key, value] : saved.items()) {
    if (key == "init_from") continue;  // where the first run's weights came from, not the model
    // how a run pads the vocabulary in memory: checkpoints hold the real V rows at any padding
    if (key == "make_vocab_size_divisible_by") continue;
    if (key == "moe" && value.is_object()) {
      // Which blocks hold which experts is the model; ep_size, k, capacity and noise are how a run
      // routes and lays them out, and may change on resume (DeepSpeed reloads experts at any ep_size).
      const nlohmann::json now = model_section.is_object() ? model_section.value("moe", nlohmann::json::object()) : nlohmann::json();
      for (const char* k : {"num_experts", "every", "use_residual"})
        if (now.value(k, nlohmann::json()) != value.value(k, nlohmann::json()))
          throw InputError(where + ": model.moe." + k + " is " + value.value(k, nlohmann::json()).dump() +
                           " in the checkpoint but " + now.value(k, nlohmann::json()).dump() + " in the configured model");
      continue;
    }
    const nlohmann::json now = model_section.is_object() && model_section.contains(key) ? model_section[key] : nlohmann::json();
    if (now != value)
      throw InputError(where + ": model." + key + " is " + value.dump() + " in the checkpoint but " +
                       (now.is_null() ? std::string("unset") : now.dump()) + " in the configured model");
  }
}

}  // namespace zero3d
