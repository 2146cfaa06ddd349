// checkpoint.cpp — see checkpoint.hpp for the layout and the guarantees.
#include "checkpoint.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <thread>

#include "base.hpp"
#include "failure.hpp"
#include "h5.hpp"

namespace fs = std::filesystem;

namespace zero3d {

namespace {

using h5::Handle;

std::string shard_name(int64_t rank) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "rank_%05lld.h5", static_cast<long long>(rank));
  return buf;
}

// Data and metadata on disk before the rename that publishes them.
void fsync_path(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY);
  if (fd < 0) throw SystemError(path + ": cannot open for fsync: " + std::strerror(errno));
  const int rc = ::fsync(fd);
  ::close(fd);
  if (rc != 0) throw SystemError(path + ": fsync failed: " + std::strerror(errno));
}

nlohmann::json meta_to_json(const CheckpointMeta& m) {
  nlohmann::json ranges = nlohmann::json::array();
  for (const auto& [b, e] : m.ranges) ranges.push_back({b, e});
  return {{"format", "zero3d-checkpoint"},
          {"format_version", kCheckpointFormatVersion},
          {"step", m.step},
          {"global_samples", m.global_samples},
          {"zero_stage", m.zero_stage},
          {"dp_world_size", m.dp_world_size},
          {"topology", {{"pipe", 1}, {"data", m.dp_world_size}, {"model", 1}}},
          {"optimizer_type", m.optimizer_type},
          {"optimizer_step", m.optimizer_step},
          {"lr_scheduler", {{"last_batch_iteration", m.lr_last_batch_iteration}}},
          {"loss_scaler", m.loss_scaler},
          {"skipped_steps", m.skipped_steps},
          {"data", {{"position", m.data_position}, {"micro_batch", m.micro_batch},
                    {"gradient_accumulation_steps", m.gradient_accumulation_steps}}},
          {"rng", {{"seed", m.seed}, {"note", "data and initialisation are pure functions of (seed, index)"}}},
          {"dtypes", {{"master", m.dtype}, {"model", m.model_dtype}, {"optimizer_states", "fp32"}}},
          {"total_params", m.total_params},
          {"partition_ranges", ranges},
          {"states", m.states},
          {"tensors", m.tensors},
          {"config", m.config}};
}

CheckpointMeta meta_from_json(const nlohmann::json& j, const std::string& where) {
  try {
    if (j.at("format") != "zero3d-checkpoint") throw InputError(where + ": not a zero3d checkpoint");
    if (j.at("format_version").get<int>() > kCheckpointFormatVersion)
      throw InputError(where + ": written by a newer zero3d (format " + j.at("format_version").dump() + ")");
    CheckpointMeta m;
    m.step = j.at("step");
    m.global_samples = j.at("global_samples");
    m.zero_stage = j.at("zero_stage");
    m.dp_world_size = j.at("dp_world_size");
    m.optimizer_type = j.at("optimizer_type");
    m.optimizer_step = j.at("optimizer_step");
    m.lr_last_batch_iteration = j.at("lr_scheduler").at("last_batch_iteration");
    m.data_position = j.at("data").at("position");
    m.micro_batch = j.at("data").at("micro_batch");
    m.gradient_accumulation_steps = j.at("data").at("gradient_accumulation_steps");
    m.seed = j.at("rng").at("seed");
    m.dtype = j.at("dtypes").at("master");
    m.model_dtype = j.at("dtypes").value("model", "fp32");
    m.skipped_steps = j.value("skipped_steps", int64_t(0));
    m.loss_scaler = j.at("loss_scaler");
    m.total_params = j.at("total_params");
    for (const auto& r : j.at("partition_ranges")) m.ranges.emplace_back(r.at(0), r.at(1));
    m.states = j.at("states").get<std::vector<std::string>>();
    m.tensors = j.at("tensors");
    m.config = j.at("config");
    return m;
  } catch (const nlohmann::json::exception& e) {
    throw InputError(where + ": checkpoint metadata is incomplete (" + std::string(e.what()) + ")");
  }
}

void write_shard(const std::string& path, const CheckpointMeta& meta, const ShardSlice& mine, int rank) {
  h5::File f = h5::File::create(path);
  h5::write_attribute(f.id(), "format_version", kCheckpointFormatVersion);
  h5::write_attribute(f.id(), "rank", rank);
  h5::write_attribute(f.id(), "range_begin", mine.begin);
  h5::write_attribute(f.id(), "range_end", mine.end);
  h5::write_attribute(f.id(), "step", meta.step);
  h5::write_attribute(f.id(), "zero_stage", meta.zero_stage);
  const hsize_t n = static_cast<hsize_t>(mine.end - mine.begin);
  const hsize_t chunk = std::max<hsize_t>(1, std::min<hsize_t>(n, hsize_t(1) << 20));  // 4 MiB chunks
  for (const auto& [name, data] : mine.arrays) {
    Handle space(H5Screate_simple(1, &n, nullptr), H5Sclose);
    Handle dcpl(H5Pcreate(H5P_DATASET_CREATE), H5Pclose);
    H5Pset_chunk(dcpl.get(), 1, &chunk);
    H5Pset_fletcher32(dcpl.get());
    Handle ds(H5Dcreate2(f.id(), name.c_str(), H5T_IEEE_F32LE, space.get(), H5P_DEFAULT, dcpl.get(), H5P_DEFAULT),
              H5Dclose);
    if (ds.get() < 0 || (n > 0 && H5Dwrite(ds.get(), H5T_NATIVE_FLOAT, H5S_ALL, H5S_ALL, H5P_DEFAULT, data) < 0))
      throw SystemError(path + ": cannot write dataset " + name);
    // Test hook for the interrupted-save test: die in the middle of writing a shard.
    if (const char* fault = std::getenv("ZERO3D_FAULT")) {
      long long at = -1;
      int r = -1;
      if (std::sscanf(fault, "save_crash:%d:%lld", &r, &at) == 2 && r == rank && at == meta.step) std::_Exit(137);
    }
  }
}

// Maps the flat range [lo, hi) of a tensor (row-major `shape`, starting at flat offset `off`)
// onto 1-D source elements [src0, src0 + hi - lo): up to three hyperslabs for a matrix
// (partial first row, whole rows, partial last row).
void add_virtual_mapping(hid_t dcpl, hid_t vspace, const std::vector<int64_t>& shape, int64_t off, int64_t lo,
                         int64_t hi, const std::string& src_file, const std::string& src_dataset, int64_t src0,
                         int64_t src_len) {
  const hsize_t src_dims = static_cast<hsize_t>(src_len);
  auto map = [&](std::vector<hsize_t> start, std::vector<hsize_t> count, int64_t src_begin) {
    H5Sselect_hyperslab(vspace, H5S_SELECT_SET, start.data(), nullptr, count.data(), nullptr);
    hsize_t n = 1;
    for (hsize_t c : count) n *= c;
    Handle sspace(H5Screate_simple(1, &src_dims, nullptr), H5Sclose);
    const hsize_t s0 = static_cast<hsize_t>(src_begin);
    H5Sselect_hyperslab(sspace.get(), H5S_SELECT_SET, &s0, nullptr, &n, nullptr);
    if (H5Pset_virtual(dcpl, vspace, src_file.c_str(), src_dataset.c_str(), sspace.get()) < 0)
      throw SystemError("cannot map virtual dataset onto " + src_file + ":" + src_dataset);
  };
  int64_t a = lo - off, b = hi - off, src = src0;  // tensor-relative flat range
  if (shape.size() == 1) {
    map({static_cast<hsize_t>(a)}, {static_cast<hsize_t>(b - a)}, src);
    return;
  }
  const int64_t cols = shape[1];
  if (a % cols != 0) {  // partial first row
    const int64_t take = std::min(b - a, cols - a % cols);
    map({static_cast<hsize_t>(a / cols), static_cast<hsize_t>(a % cols)}, {1, static_cast<hsize_t>(take)}, src);
    a += take;
    src += take;
  }
  if (b - a >= cols) {  // whole rows
    const int64_t rows = (b - a) / cols;
    map({static_cast<hsize_t>(a / cols), 0}, {static_cast<hsize_t>(rows), static_cast<hsize_t>(cols)}, src);
    a += rows * cols;
    src += rows * cols;
  }
  if (b > a) map({static_cast<hsize_t>(a / cols), 0}, {1, static_cast<hsize_t>(b - a)}, src);  // partial last row
}

void write_index(const std::string& path, const CheckpointMeta& meta, const ParamLayout& layout) {
  h5::File f = h5::File::create(path);
  h5::write_attribute(f.id(), "meta", meta_to_json(meta).dump());
  h5::write_attribute(f.id(), "format_version", kCheckpointFormatVersion);
  h5::write_attribute(f.id(), "step", meta.step);
  h5::write_attribute(f.id(), "zero_stage", meta.zero_stage);
  h5::write_attribute(f.id(), "dp_world_size", meta.dp_world_size);
  for (const std::string& state : meta.states) {
    const std::string prefix = state == "params" ? "/" : "/" + state + "/";
    if (state != "params") Handle(H5Gcreate2(f.id(), state.c_str(), H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT), H5Gclose);
    for (const TensorSpec& t : layout.tensors()) {
      std::vector<hsize_t> dims(t.shape.begin(), t.shape.end());
      Handle vspace(H5Screate_simple(static_cast<int>(dims.size()), dims.data(), nullptr), H5Sclose);
      Handle dcpl(H5Pcreate(H5P_DATASET_CREATE), H5Pclose);
      for (size_t r = 0; r < meta.ranges.size(); ++r) {
        const auto [b, e] = meta.ranges[r];
        const int64_t lo = std::max(b, t.offset), hi = std::min(e, t.offset + t.numel);
        if (lo < hi)  // relative file names resolve against the index file's directory
          add_virtual_mapping(dcpl.get(), vspace.get(), t.shape, t.offset, lo, hi, shard_name(static_cast<int64_t>(r)),
                              state, lo - b, e - b);
      }
      Handle ds(H5Dcreate2(f.id(), (prefix + t.name).c_str(), H5T_IEEE_F32LE, vspace.get(), H5P_DEFAULT, dcpl.get(),
                           H5P_DEFAULT),
                H5Dclose);
      if (ds.get() < 0) throw SystemError(path + ": cannot create virtual dataset " + prefix + t.name);
    }
  }
}

int64_t tag_step(const std::string& tag) {
  const std::string prefix = "global_step";
  if (tag.rfind(prefix, 0) != 0) return -1;
  try {
    return std::stoll(tag.substr(prefix.size()));
  } catch (...) {
    return -1;
  }
}

std::string read_text_file(const std::string& path) {
  std::ifstream in(path);
  std::string s;
  std::getline(in, s);
  return s;
}

}  // namespace

std::vector<std::string> list_checkpoint_tags(const std::string& save_dir) {
  std::vector<std::pair<int64_t, std::string>> tags;
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(save_dir, ec)) {
    const std::string name = entry.path().filename().string();
    if (entry.is_directory() && fs::exists(entry.path() / "index.h5") && name.size() > 4 &&
        name.substr(name.size() - 4) != ".tmp")
      tags.emplace_back(tag_step(name), name);
  }
  std::sort(tags.begin(), tags.end());
  std::vector<std::string> out;
  for (auto& t : tags) out.push_back(t.second);
  return out;
}

void save_checkpoint(const std::string& save_dir, const std::string& tag, const CheckpointMeta& meta,
                     const ShardSlice& mine, const ParamLayout& layout, MPI_Comm world, int64_t keep_last) {
  int rank = 0;
  MPI_Comm_rank(world, &rank);
  const fs::path dir(save_dir), tmp = dir / (tag + ".tmp"), final_dir = dir / tag;
  run_collectively(world, [&] {
    if (rank != 0) return;
    std::error_code ec;
    fs::create_directories(dir, ec);
    if (ec) throw SystemError(save_dir + ": cannot create checkpoint directory: " + ec.message());
    for (const auto& entry : fs::directory_iterator(dir))  // stale, never-published saves
      if (entry.is_directory() && entry.path().extension() == ".tmp") fs::remove_all(entry.path());
    fs::create_directories(tmp, ec);
    if (ec) throw SystemError(tmp.string() + ": cannot create: " + ec.message());
  });
  run_collectively(world, [&] {
    const std::string path = (tmp / shard_name(rank)).string();
    write_shard(path, meta, mine, rank);
    fsync_path(path);
  });
  run_collectively(world, [&] {
    if (rank != 0) return;
    const std::string index = (tmp / "index.h5").string();
    write_index(index, meta, layout);
    fsync_path(index);
    fsync_path(tmp.string());
    std::error_code ec;
    // Re-saving a step: move the old tag aside (as a .tmp, which the next save removes) so the
    // directory `latest` may name is replaced by one rename, never deleted first.
    const fs::path old = dir / (tag + ".old.tmp");
    if (fs::exists(final_dir)) fs::rename(final_dir, old, ec);
    if (ec) throw SystemError(final_dir.string() + ": cannot move the previous save aside: " + ec.message());
    fs::rename(tmp, final_dir, ec);
    if (ec) throw SystemError(final_dir.string() + ": cannot publish checkpoint: " + ec.message());
    fs::remove_all(old, ec);
    const fs::path latest = dir / "latest", latest_tmp = dir / "latest.tmp";
    {
      std::ofstream out(latest_tmp);
      out << tag << '\n';
      if (!out) throw SystemError(latest_tmp.string() + ": write failed");
    }
    fsync_path(latest_tmp.string());
    fs::rename(latest_tmp, latest, ec);
    if (ec) throw SystemError(latest.string() + ": cannot replace: " + ec.message());
    fsync_path(dir.string());
    if (keep_last > 0) {  // rotation: oldest complete tags beyond keep_last
      auto tags = list_checkpoint_tags(save_dir);
      for (size_t k = 0; k + static_cast<size_t>(keep_last) < tags.size(); ++k)
        if (tags[k] != tag) fs::remove_all(dir / tags[k]);
    }
  });
}

CheckpointReader CheckpointReader::open(const std::string& spec, const std::string& save_dir) {
  fs::path dir;
  auto from_latest = [](const fs::path& d) {
    const fs::path latest = d / "latest";
    if (!fs::exists(latest)) throw InputError(latest.string() + ": not found: no checkpoint to resume from");
    const std::string tag = read_text_file(latest.string());
    if (tag.empty()) throw InputError(latest.string() + ": empty");
    return d / tag;
  };
  if (spec == "latest") dir = from_latest(save_dir);
  else if (fs::exists(fs::path(spec) / "index.h5")) dir = spec;
  else if (fs::exists(fs::path(spec) / "latest")) dir = from_latest(spec);
  else if (fs::exists(fs::path(save_dir) / spec)) dir = fs::path(save_dir) / spec;
  else throw InputError("training.resume: \"" + spec + "\" is neither `latest`, a tag in " + save_dir + ", nor a checkpoint directory");
  CheckpointReader r;
  r.dir_ = dir.string();
  const std::string index = (dir / "index.h5").string();
  if (!fs::exists(index)) throw InputError(index + ": missing: the checkpoint is incomplete");
  h5::File f = h5::File::open_read(index);
  std::string text;
  if (!h5::read_attribute(f.id(), "meta", text)) throw InputError(index + ": no checkpoint metadata");
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(text);
  } catch (const nlohmann::json::parse_error&) {
    throw InputError(index + ": checkpoint metadata is corrupted");
  }
  r.meta_ = meta_from_json(j, index);
  for (size_t q = 0; q < r.meta_.ranges.size(); ++q) {
    const fs::path shard = dir / shard_name(static_cast<int64_t>(q));
    if (!fs::exists(shard)) throw InputError(shard.string() + ": missing shard (" + std::to_string(r.meta_.ranges.size()) + " expected)");
  }
  return r;
}

void CheckpointReader::read_range(const std::string& state, int64_t begin, int64_t end, float* out) const {
  if (std::find(meta_.states.begin(), meta_.states.end(), state) == meta_.states.end())
    throw InputError(dir_ + ": the checkpoint holds no `" + state + "` (saved with optimizer " + meta_.optimizer_type + ")");
  for (size_t q = 0; q < meta_.ranges.size(); ++q) {
    const auto [b, e] = meta_.ranges[q];
    const int64_t lo = std::max(b, begin), hi = std::min(e, end);
    if (lo >= hi) continue;
    const std::string path = (fs::path(dir_) / shard_name(static_cast<int64_t>(q))).string();
    hid_t fid = H5Fopen(path.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT);
    if (fid < 0) throw InputError(path + ": cannot open shard (truncated or not an HDF5 file)");
    Handle file(fid, H5Fclose);
    int64_t rb = -1, re = -1;
    if (!h5::read_attribute(fid, "range_begin", rb) || !h5::read_attribute(fid, "range_end", re) || rb != b || re != e)
      throw InputError(path + ": shard range does not match the index (mixed checkpoints?)");
    Handle ds(H5Dopen2(fid, state.c_str(), H5P_DEFAULT), H5Dclose);
    if (ds.get() < 0) throw InputError(path + ": dataset `" + state + "` missing");
    Handle fspace(H5Dget_space(ds.get()), H5Sclose);
    const hsize_t start = static_cast<hsize_t>(lo - b), count = static_cast<hsize_t>(hi - lo);
    H5Sselect_hyperslab(fspace.get(), H5S_SELECT_SET, &start, nullptr, &count, nullptr);
    Handle mspace(H5Screate_simple(1, &count, nullptr), H5Sclose);
    if (H5Dread(ds.get(), H5T_NATIVE_FLOAT, mspace.get(), fspace.get(), H5P_DEFAULT, out + (lo - begin)) < 0)
      throw InputError(path + ": dataset `" + state + "` cannot be read: checksum mismatch or corrupted data");
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

}  // namespace zero3d
