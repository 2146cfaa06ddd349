// checkpoint_format.cpp — the on-disk format shared by saving (checkpoint.cpp) and loading
// (checkpoint_reader.cpp): shard names, the metadata JSON, digests, and the mapping from shard
// segments to tensor hyperslabs that index.h5's virtual datasets record.
#include "io/checkpoint_format.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <map>

#include "base/errors.hpp"
#include "base/failure.hpp"

namespace zero3d::ckpt {
std::string shard_name(int64_t rank) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "rank_%05lld.h5", static_cast<long long>(rank));
  return buf;
}

std::string errstr(int e) { return std::strerror(e); }

// A regular file of at most `max_bytes`, whole; InputError naming it otherwise.
std::string read_small_file(const std::string& path, size_t max_bytes) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) throw InputError(path + ": cannot open: " + errstr(errno));
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) || static_cast<size_t>(st.st_size) > max_bytes) {
    ::close(fd);
    throw InputError(path + ": not a regular file of at most " + std::to_string(max_bytes) + " bytes");
  }
  std::string s(static_cast<size_t>(st.st_size), '\0');
  size_t done = 0;
  while (done < s.size()) {
    const ssize_t n = ::read(fd, s.data() + done, s.size() - done);
    if (n <= 0) break;
    done += static_cast<size_t>(n);
  }
  ::close(fd);
  s.resize(done);
  return s;
}

// Size and XXH64 of a whole file. Load-side failures are bad input, save-side ones system errors.
std::pair<int64_t, uint64_t> file_digest(const std::string& path, bool saving) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    const std::string msg = path + ": cannot open: " + errstr(errno);
    if (saving) throw SystemError(msg);
    throw InputError(msg);
  }
  Xxh64 x;
  std::vector<unsigned char> buf(size_t(1) << 20);
  int64_t total = 0;
  for (;;) {
    const ssize_t n = ::read(fd, buf.data(), buf.size());
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      const std::string msg = path + ": read failed: " + errstr(errno);
      ::close(fd);
      if (saving) throw SystemError(msg);
      throw InputError(msg);
    }
    if (n == 0) break;
    x.update(buf.data(), static_cast<size_t>(n));
    total += n;
  }
  ::close(fd);
  return {total, x.digest()};
}

// ---- metadata ------------------------------------------------------------------------------------

nlohmann::json meta_to_json(const CheckpointMeta& m) {
  nlohmann::json ranges = nlohmann::json::array();
  for (const SegmentList& segs : m.ranges) {
    nlohmann::json s = nlohmann::json::array();
    for (const auto& [b, e] : segs) s.push_back({b, e});
    ranges.push_back(s);
  }
  return {{"format", "zero3d-checkpoint"},
          {"format_version", kCheckpointFormatVersion},
          {"tag_id", m.tag_id},
          {"step", m.step},
          {"global_samples", m.global_samples},
          {"zero_stage", m.zero_stage},
          {"dp_world_size", m.dp_world_size},
          {"topology", {{"pipe", m.pipe_size}, {"data", m.dp_world_size}, {"model", m.tensor_size}}},
          {"optimizer_type", m.optimizer_type},
          {"optimizer_update_rule", m.update_rule},
          {"optimizer_name", m.optimizer_name},
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
          {"model", m.config.is_object() ? m.config.value("model", nlohmann::json()) : nlohmann::json()},
          {"config", m.config}};
}

// "" when `ranges` tile [0, total) exactly without overlap, else what is wrong.
std::string tiling_problem(const std::vector<SegmentList>& ranges, int64_t total) {
  std::vector<std::pair<int64_t, int64_t>> all;
  for (const SegmentList& segs : ranges)
    for (const auto& s : segs) {
      if (s.first < 0 || s.second <= s.first || s.second > total)
        return "segment [" + std::to_string(s.first) + ", " + std::to_string(s.second) + ") is empty or outside [0, " +
               std::to_string(total) + ")";
      all.push_back(s);
    }
  std::sort(all.begin(), all.end());
  int64_t at = 0;
  for (const auto& [b, e] : all) {
    if (b != at)
      return b < at ? "segments overlap at element " + std::to_string(b) : "elements [" + std::to_string(at) + ", " +
                                                                               std::to_string(b) + ") are in no segment";
    at = e;
  }
  if (at != total) return "elements [" + std::to_string(at) + ", " + std::to_string(total) + ") are in no segment";
  return "";
}

CheckpointMeta meta_from_json(const nlohmann::json& j, const std::string& where) {
  try {
    if (j.at("format") != "zero3d-checkpoint") throw InputError(where + ": not a zero3d checkpoint");
    const int version = j.at("format_version").get<int>();
    if (version > kCheckpointFormatVersion)
      throw InputError(where + ": written by a newer zero3d (format " + std::to_string(version) + ")");
    if (version < 1) throw InputError(where + ": unknown checkpoint format " + std::to_string(version));
    CheckpointMeta m;
    m.step = j.at("step");
    m.global_samples = j.at("global_samples");
    m.zero_stage = j.at("zero_stage");
    m.dp_world_size = j.at("dp_world_size");
    if (j.contains("topology")) {  // pipe and model were recorded as 1 before they were filled in
      m.pipe_size = j["topology"].value("pipe", int64_t(1));
      m.tensor_size = j["topology"].value("model", int64_t(1));
    }
    m.optimizer_type = j.at("optimizer_type");
    m.update_rule = j.value("optimizer_update_rule", std::string());
    m.optimizer_name = j.value("optimizer_name", std::string());
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
    for (const auto& r : j.at("partition_ranges")) {
      SegmentList segs;
      if (version == 1) segs.emplace_back(r.at(0).get<int64_t>(), r.at(1).get<int64_t>());  // one range per shard
      else
        for (const auto& s : r) segs.emplace_back(s.at(0).get<int64_t>(), s.at(1).get<int64_t>());
      if (version == 1 && segs[0].first == segs[0].second) segs.clear();  // an empty range held nothing
      m.ranges.push_back(segs);
    }
    m.states = j.at("states").get<std::vector<std::string>>();
    m.tensors = j.at("tensors");
    m.config = j.at("config");
    if (version >= 2) m.tag_id = j.at("tag_id").get<std::string>();
    // Consistency the writer guarantees; anything else is damage or a hand edit.
    auto bad = [&](const std::string& what) { return InputError(where + ": checkpoint metadata is inconsistent: " + what); };
    if (m.step < 0 || m.optimizer_step < 0 || m.skipped_steps < 0 || m.data_position < 0 || m.total_params < 0)
      throw bad("negative step, sample or parameter count");
    if (m.dtype != "fp32") throw bad("master dtype \"" + m.dtype + "\" (always fp32)");
    std::vector<std::string> expect;
    if (m.optimizer_type == "Adam" || m.optimizer_type == "Lamb") expect = {"params", "exp_avg", "exp_avg_sq"};
    else if (m.optimizer_type == "Lion") expect = {"params", "exp_avg"};
    else if (m.optimizer_type == "Adagrad") expect = {"params", "exp_avg_sq"};
    else if (m.optimizer_type == "OneBitLamb")  // 1-bit LAMB's state keys (optim/onebit.hpp)
      expect = {"params", "exp_avg", "exp_avg_sq", "exp_avg_sq_fresh", "lamb_coeff_freeze", "last_factor", "scaling_coeff"};
    else if (m.optimizer_type == "SGD")
      expect = m.states.size() == 2 ? std::vector<std::string>{"params", "momentum_buffer"}
                                    : std::vector<std::string>{"params"};
    else throw bad("unknown optimizer type \"" + m.optimizer_type + "\"");
    if (m.states != expect)
      throw bad("states " + nlohmann::json(m.states).dump() + " do not belong to optimizer " + m.optimizer_type);
    int64_t offset = 0;
    std::set<std::string> names;
    for (const auto& t : m.tensors) {
      int64_t numel = 1;
      for (int64_t d : t.at("shape").get<std::vector<int64_t>>()) {
        if (d <= 0 || d > (int64_t(1) << 40)) throw bad("tensor " + t.at("name").dump() + " has a bad shape");
        numel *= d;
      }
      if (t.at("offset").get<int64_t>() != offset) throw bad("tensor " + t.at("name").dump() + " is not at offset " + std::to_string(offset));
      if (!names.insert(t.at("name").get<std::string>()).second) throw bad("tensor " + t.at("name").dump() + " twice");
      offset += numel;
      if (offset > (int64_t(1) << 50)) throw bad("tensor sizes overflow");
    }
    if (offset != m.total_params) throw bad("tensors hold " + std::to_string(offset) + " elements, total_params says " + std::to_string(m.total_params));
    const std::string tiling = tiling_problem(m.ranges, m.total_params);
    if (!tiling.empty()) throw bad("shard segments: " + tiling);
    return m;
  } catch (const nlohmann::json::exception& e) {
    throw InputError(where + ": checkpoint metadata is incomplete (" + std::string(e.what()) + ")");
  }
}

// ---- the index's virtual datasets: which shard elements make each tensor -------------------------

namespace {
// The flat range [lo, hi) of a tensor (row-major `shape`, at flat offset `off`) as up to three
// hyperslabs for a matrix (partial first row, whole rows, partial last row), from `src0` on.
std::vector<Piece> pieces_of(const std::vector<int64_t>& shape, int64_t off, int64_t lo, int64_t hi, int64_t src0) {
  std::vector<Piece> out;
  int64_t a = lo - off, b = hi - off, src = src0;  // tensor-relative flat range
  if (shape.size() == 1) return {Piece{{hsize_t(a)}, {hsize_t(b - a)}, src}};
  const int64_t cols = shape[1];
  if (a % cols != 0) {  // partial first row
    const int64_t take = std::min(b - a, cols - a % cols);
    out.push_back({{hsize_t(a / cols), hsize_t(a % cols)}, {1, hsize_t(take)}, src});
    a += take;
    src += take;
  }
  if (b - a >= cols) {  // whole rows
    const int64_t rows = (b - a) / cols;
    out.push_back({{hsize_t(a / cols), 0}, {hsize_t(rows), hsize_t(cols)}, src});
    a += rows * cols;
    src += rows * cols;
  }
  if (b > a) out.push_back({{hsize_t(a / cols), 0}, {1, hsize_t(b - a)}, src});  // partial last row
  return out;
}
}  // namespace

SourceSlab source_slab(const Piece& p) {
  if (p.count.size() == 1) return {hsize_t(p.src), 1, 1, p.count[0]};
  const hsize_t width = p.count[1], stride = p.row_stride > 0 ? hsize_t(p.row_stride) : width;
  // Packed rows are one contiguous run: one block, as HDF5 stores the simplest selection.
  if (stride == width) return {hsize_t(p.src), 1, 1, p.count[0] * width};
  return {hsize_t(p.src), stride, p.count[0], width};
}

namespace {
// Extends `block` (an earlier piece of the same shard) by the single-row piece p when p is the
// next row of the same columns at a constant source distance: rows of a column block become one
// rectangular piece (the source a strided selection) instead of one piece per row.
bool extend_column_block(Piece& block, const Piece& p) {
  if (p.count.size() != 2 || p.count[0] != 1 || block.start[1] != p.start[1] || block.count[1] != p.count[1] ||
      block.start[0] + block.count[0] != p.start[0])
    return false;
  const int64_t step = p.src - block.src;
  if (block.count[0] == 1) {
    if (step < int64_t(p.count[1])) return false;  // source rows must not overlap
    block.row_stride = step;
  } else if (step != int64_t(block.count[0]) * (block.row_stride > 0 ? block.row_stride : int64_t(block.count[1]))) {
    return false;
  }
  block.count[0] += 1;
  return true;
}
}  // namespace

std::vector<Mapping> mappings_of(const CheckpointMeta& m, const std::vector<std::vector<int64_t>>& offsets,
                                 const std::vector<int64_t>& shape, int64_t off, int64_t numel, bool coalesce) {
  std::vector<Mapping> out;
  for (size_t q = 0; q < m.ranges.size(); ++q) {
    const int64_t len = offsets[q].empty() ? 0 : offsets[q].back() + (m.ranges[q].back().second - m.ranges[q].back().first);
    std::map<std::pair<hsize_t, hsize_t>, size_t> open_block;  // (first column, width) -> its piece in `out`
    for (size_t k = 0; k < m.ranges[q].size(); ++k) {
      const auto [b, e] = m.ranges[q][k];
      const int64_t lo = std::max(b, off), hi = std::min(e, off + numel);
      if (lo < hi)
        for (Piece& p : pieces_of(shape, off, lo, hi, offsets[q][k] + (lo - b))) {
          if (coalesce && p.count.size() == 2) {
            const auto key = std::make_pair(p.start[1], p.count[1]);
            const auto it = open_block.find(key);
            if (it != open_block.end() && extend_column_block(out[it->second].piece, p)) continue;
            if (p.count[0] == 1) open_block[key] = out.size();
          }
          out.push_back({int64_t(q), p, len});
        }
    }
  }
  return out;
}

// Per shard, per segment: where the segment starts in the shard's concatenated datasets.
std::vector<std::vector<int64_t>> local_offsets(const std::vector<SegmentList>& ranges) {
  std::vector<std::vector<int64_t>> out;
  for (const SegmentList& segs : ranges) {
    std::vector<int64_t> o;
    int64_t at = 0;
    for (const auto& [b, e] : segs) {
      o.push_back(at);
      at += e - b;
    }
    out.push_back(o);
  }
  return out;
}

nlohmann::json segments_json(const SegmentList& segs) {
  nlohmann::json j = nlohmann::json::array();
  for (const auto& [b, e] : segs) j.push_back({b, e});
  return j;
}

// The manifest's own digest: over its JSON without the "xxh64" member.
std::string manifest_digest(nlohmann::json man) {
  man.erase("xxh64");
  const std::string text = man.dump();
  return hex64(xxh64(text.data(), text.size()));
}

}  // namespace zero3d::ckpt
