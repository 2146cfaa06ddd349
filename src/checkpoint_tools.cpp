// checkpoint_tools.cpp — `zero3d inspect` and `zero3d convert`: whole-checkpoint readers for
// people and other tools. Both stream: one tensor (or one chunk of a shard) in memory at a time.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>

#include "base.hpp"
#include "checkpoint.hpp"
#include "input_file.hpp"
#include "h5.hpp"

namespace fs = std::filesystem;

namespace zero3d {

namespace {

// Round-to-nearest-even float -> bfloat16 bits (NaN stays NaN).
uint16_t to_bf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40);
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

// A tag directory from `path` (a tag directory, or a save directory plus optional tag).
std::string resolve_tag_dir(const std::string& path, const std::string& tag) {
  if (fs::exists(fs::path(path) / "index.h5")) return path;
  if (!fs::is_directory(path)) throw InputError(path + ": no such checkpoint directory");
  if (!tag.empty()) return (fs::path(path) / tag).string();
  if (fs::exists(fs::path(path) / "latest")) return path;  // CheckpointReader follows `latest`
  throw InputError(path + ": neither a checkpoint tag directory nor a directory with `latest`");
}

ParamLayout layout_of(const CheckpointMeta& m) {
  ParamLayout layout;
  for (const auto& t : m.tensors) layout.add(t.at("name"), t.at("shape").get<std::vector<int64_t>>());
  return layout;
}

}  // namespace

// One parser for every size option: a finite, non-negative number with a known unit whose
// value fits int64 (larger values would be undefined when converted).
int64_t parse_byte_size(const std::string& text, const std::string& option) {
  const std::string where = option.empty() ? "size \"" + echo(text, 40) + "\"" : option + " " + echo(text, 40);
  size_t pos = 0;
  double value = 0.0;
  try {
    value = std::stod(text, &pos);
  } catch (...) {
    throw InputError(where + ": expected a number with an optional unit (5GB, 500MB, 2GiB)");
  }
  if (!std::isfinite(value)) throw InputError(where + ": expected a finite size");
  if (value < 0 || text.find('-') == 0) throw InputError(where + ": a size cannot be negative");
  std::string unit = text.substr(pos);
  for (auto& c : unit) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  const std::pair<const char*, double> units[] = {{"", 1},       {"B", 1},         {"KB", 1e3},     {"MB", 1e6},
                                                  {"GB", 1e9},   {"TB", 1e12},     {"KIB", 1024.0}, {"MIB", 1048576.0},
                                                  {"GIB", 1073741824.0}, {"TIB", 1099511627776.0}};
  for (const auto& [name, factor] : units)
    if (unit == name) {
      if (value * factor > 9.0e18) throw InputError(where + ": too large (at most 8 EiB)");
      return static_cast<int64_t>(value * factor);
    }
  throw InputError(where + ": unknown unit \"" + echo(text.substr(pos), 20) + "\" (B, KB, MB, GB, TB, KiB, MiB, GiB, TiB)");
}

nlohmann::json inspect_checkpoint(const std::string& path, const std::string& tag, const std::string& tensor) {
  const std::string tag_dir = resolve_tag_dir(path, tag);
  CheckpointReader reader = CheckpointReader::open(tag_dir, "");
  const CheckpointMeta& m = reader.meta();
  nlohmann::json report = {{"dir", reader.dir()},
                           {"step", m.step},
                           {"global_samples", m.global_samples},
                           {"zero_stage", m.zero_stage},
                           {"topology", {{"pipe", 1}, {"data", m.dp_world_size}, {"model", 1}}},
                           {"dtypes", {{"master", m.dtype}, {"optimizer_states", "fp32"}}},
                           {"optimizer", m.optimizer_type},
                           {"states", m.states},
                           {"shards", m.ranges.size()}};
  const fs::path parent = fs::path(reader.dir()).parent_path();
  std::error_code ec;
  if (fs::is_regular_file(parent / "latest", ec) && fs::file_size(parent / "latest", ec) <= 4096) {
    report["tags"] = list_checkpoint_tags(parent.string());
    std::ifstream latest(parent / "latest");
    std::string name;
    std::getline(latest, name);
    report["latest"] = name;
  }
  // The verification resume runs happened in open(); on top: every file's digest, every shard
  // checksum (read every element of every segment, chunk by chunk), and every tensor read
  // through index.h5's virtual datasets equal to what the shards hold.
  reader.verify_files();
  constexpr int64_t kChunk = int64_t(1) << 22;
  std::vector<float> buf, via_index;
  for (const std::string& state : m.states)
    for (const SegmentList& segs : m.ranges)
      for (const auto& [b, e] : segs)
        for (int64_t lo = b; lo < e; lo += kChunk) {
          const int64_t hi = std::min(e, lo + kChunk);
          buf.resize(static_cast<size_t>(hi - lo));
          reader.read_range(state, lo, hi, buf.data());
        }
  const ParamLayout layout = layout_of(m);
  const std::string index_path = (fs::path(reader.dir()) / "index.h5").string();
  h5::File index = h5::File::open_read(index_path);
  for (const std::string& state : m.states)
    for (const TensorSpec& t : layout.tensors()) {
      const std::string name = (state == "params" ? "/" : "/" + state + "/") + t.name;
      buf.resize(static_cast<size_t>(t.numel));
      reader.read_range(state, t.offset, t.offset + t.numel, buf.data());
      try {
        via_index = index.read_floats(name);
      } catch (const InputError&) {
        throw InputError(index_path + ": virtual dataset " + name + " cannot be read (index.h5 damaged)");
      }
      if (via_index.size() != buf.size() || std::memcmp(via_index.data(), buf.data(), buf.size() * sizeof(float)) != 0)
        throw InputError(index_path + ": virtual dataset " + name + " differs from the shards (index.h5 from another save?)");
    }
  report["verified"] = true;
  report["tag_id"] = m.tag_id;
  report["digests"] = reader.has_manifest() ? "xxh64 manifest" : "none (format 1)";
  nlohmann::json tensors = nlohmann::json::array();
  for (const TensorSpec& t : layout.tensors()) {
    if (!tensor.empty() && t.name != tensor) continue;
    buf.resize(static_cast<size_t>(t.numel));
    reader.read_range("params", t.offset, t.offset + t.numel, buf.data());
    double lo = std::numeric_limits<double>::infinity(), hi = -lo, sum = 0.0, sq = 0.0;
    for (float x : buf) {
      lo = std::min(lo, double(x));
      hi = std::max(hi, double(x));
      sum += x;
      sq += double(x) * x;
    }
    tensors.push_back({{"name", t.name}, {"shape", t.shape}, {"dtype", m.dtype}, {"min", lo}, {"max", hi},
                       {"mean", sum / double(t.numel)}, {"l2_norm", std::sqrt(sq)}});
  }
  if (!tensor.empty() && tensors.empty()) throw InputError(reader.dir() + ": no tensor named `" + tensor + "`");
  report["tensors"] = tensors;
  return report;
}

namespace {

struct OutputFile {
  std::string path;
  std::vector<const TensorSpec*> tensors;
  int64_t bytes = 0;
};

void write_safetensors(const OutputFile& out, const CheckpointReader& reader, bool bf16) {
  const int64_t width = bf16 ? 2 : 4;
  nlohmann::json header = nlohmann::json::object();
  int64_t offset = 0;
  for (const TensorSpec* t : out.tensors) {
    header[t->name] = {{"dtype", bf16 ? "BF16" : "F32"}, {"shape", t->shape}, {"data_offsets", {offset, offset + width * t->numel}}};
    offset += width * t->numel;
  }
  header["__metadata__"] = {{"format", "pt"}, {"source", "zero3d convert"}};
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');  // data starts 8-byte aligned
  std::ofstream f(out.path, std::ios::binary | std::ios::trunc);
  const uint64_t len = text.size();
  f.write(reinterpret_cast<const char*>(&len), 8);
  f << text;
  std::vector<float> buf;
  std::vector<uint16_t> half;
  for (const TensorSpec* t : out.tensors) {
    buf.resize(static_cast<size_t>(t->numel));
    reader.read_range("params", t->offset, t->offset + t->numel, buf.data());
    if (bf16) {
      half.resize(buf.size());
      std::transform(buf.begin(), buf.end(), half.begin(), to_bf16);
      f.write(reinterpret_cast<const char*>(half.data()), static_cast<std::streamsize>(half.size() * 2));
    } else {
      f.write(reinterpret_cast<const char*>(buf.data()), static_cast<std::streamsize>(buf.size() * 4));
    }
  }
  if (!f) throw SystemError(out.path + ": write failed");
}

void write_hdf5(const OutputFile& out, const CheckpointReader& reader, bool bf16) {
  h5::File f = h5::File::create(out.path);
  h5::write_attribute(f.id(), "source", "zero3d convert");
  h5::write_attribute(f.id(), "step", reader.meta().step);
  h5::Handle bf16_t = bf16 ? h5::bf16_type() : h5::Handle();
  std::vector<float> buf;
  std::vector<uint16_t> half;
  for (const TensorSpec* t : out.tensors) {
    buf.resize(static_cast<size_t>(t->numel));
    reader.read_range("params", t->offset, t->offset + t->numel, buf.data());
    std::vector<hsize_t> dims(t->shape.begin(), t->shape.end());
    h5::Handle space(H5Screate_simple(static_cast<int>(dims.size()), dims.data(), nullptr), H5Sclose);
    const hid_t type = bf16 ? bf16_t.get() : H5T_IEEE_F32LE;
    h5::Handle ds(H5Dcreate2(f.id(), t->name.c_str(), type, space.get(), H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT), H5Dclose);
    herr_t rc = -1;
    if (ds.valid() && bf16) {  // round-to-nearest-even ourselves; the bits go out as they are
      half.resize(buf.size());
      std::transform(buf.begin(), buf.end(), half.begin(), to_bf16);
      rc = H5Dwrite(ds.get(), type, H5S_ALL, H5S_ALL, H5P_DEFAULT, half.data());
    } else if (ds.valid()) {
      rc = H5Dwrite(ds.get(), H5T_NATIVE_FLOAT, H5S_ALL, H5S_ALL, H5P_DEFAULT, buf.data());
    }
    if (ds.get() < 0 || rc < 0 || !ds.close()) throw SystemError(out.path + ": cannot write " + t->name);
  }
  f.close();
}

}  // namespace

std::vector<std::string> convert_checkpoint(const std::string& path, const std::string& tag, const std::string& out,
                                            const std::string& format, const std::string& dtype,
                                            int64_t max_shard_bytes) {
  if (format != "hdf5" && format != "safetensors") throw InputError("--format: \"" + format + "\" is not hdf5 or safetensors");
  if (dtype != "fp32" && dtype != "bf16") throw InputError("--dtype: \"" + dtype + "\" is not fp32 or bf16");
  CheckpointReader reader = CheckpointReader::open(resolve_tag_dir(path, tag), "");
  const ParamLayout layout = layout_of(reader.meta());
  const bool bf16 = dtype == "bf16";
  const int64_t width = bf16 ? 2 : 4;
  // Greedy shards in layout order, as Hugging Face's save_pretrained cuts them.
  std::vector<OutputFile> files(1);
  int64_t total = 0;
  for (const TensorSpec& t : layout.tensors()) {
    const int64_t bytes = width * t.numel;
    if (max_shard_bytes > 0 && files.back().bytes > 0 && files.back().bytes + bytes > max_shard_bytes) files.emplace_back();
    files.back().tensors.push_back(&t);
    files.back().bytes += bytes;
    total += bytes;
  }
  const fs::path out_path(out);
  std::error_code ec;
  if (out_path.has_parent_path()) fs::create_directories(out_path.parent_path(), ec);
  const std::string ext = format == "safetensors" ? ".safetensors" : ".h5";
  std::string stem = out_path.filename().string();
  if (stem.size() > ext.size() && stem.substr(stem.size() - ext.size()) == ext) stem.resize(stem.size() - ext.size());
  std::vector<std::string> written;
  nlohmann::json weight_map = nlohmann::json::object();
  for (size_t k = 0; k < files.size(); ++k) {
    if (files.size() == 1) {
      files[k].path = (out_path.parent_path() / (stem + ext)).string();
    } else {
      char name[64];
      std::snprintf(name, sizeof(name), "-%05zu-of-%05zu", k + 1, files.size());
      files[k].path = (out_path.parent_path() / (stem + name + ext)).string();
    }
    if (format == "safetensors") write_safetensors(files[k], reader, bf16);
    else write_hdf5(files[k], reader, bf16);
    for (const TensorSpec* t : files[k].tensors) weight_map[t->name] = fs::path(files[k].path).filename().string();
    written.push_back(files[k].path);
  }
  if (files.size() > 1) {  // the Hugging Face sharded layout: <stem><ext>.index.json
    const std::string index = (out_path.parent_path() / (stem + ext + ".index.json")).string();
    std::ofstream f(index);
    f << nlohmann::json{{"metadata", {{"total_size", total}, {"format", format}}}, {"weight_map", weight_map}}.dump(2)
      << '\n';
    if (!f) throw SystemError(index + ": write failed");
    written.push_back(index);
  }
  return written;
}

}  // namespace zero3d
