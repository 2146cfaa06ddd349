// checkpoint.cpp — see checkpoint.hpp for the layout and the guarantees.
#include "checkpoint.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <random>

#include "base.hpp"
#include "failure.hpp"
#include "h5.hpp"

namespace fs = std::filesystem;

namespace zero3d {

namespace {

using h5::Handle;

const char* const kMarker = "zero3d.tag";
const char* const kManifest = "manifest.json";
const char* const kFamilyFile = "zero3d.family";

std::string shard_name(int64_t rank) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "rank_%05lld.h5", static_cast<long long>(rank));
  return buf;
}

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

// 128 random bits as 32 hex digits: tag ids and run-family ids.
std::string random_id() {
  std::random_device rd;
  std::mt19937_64 gen((uint64_t(rd()) << 32) ^ rd() ^
                      static_cast<uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count()) ^
                      (uint64_t(::getpid()) << 16));
  return hex64(gen()) + hex64(gen());
}

// ---- fault injection ---------------------------------------------------------------------------
// ZERO3D_IO_FAULT=<op>:<n>[:<how>[:<rank>]] (tests only): the n-th I/O point (1-based, counted
// in this process over all its saves) of kind <op> — write | fsync | rename | close, or `any`
// for every kind — fails as if the system returned ENOSPC (how = enospc, the default) or EIO
// (how = eio), or the process dies there without any cleanup (how = kill, exit 137); on every
// rank, or only on MPI_COMM_WORLD rank <rank>. The points are: each
// dataset write of a shard, each small-file write (marker, manifest, latest), each fsync (files
// and directories), each rename, and each file close. index.h5 is built in memory and written
// as a small file. The checkpoint fault suite walks n over every point of a save.
struct IoFault {
  std::string op, how;
  long long n = 0, seen = 0;
  int rank = -1;  // -1: every rank
};

IoFault& io_fault() {
  static IoFault f = [] {
    IoFault r;
    const char* spec = std::getenv("ZERO3D_IO_FAULT");
    if (!spec) return r;
    char op[16] = {0}, how[16] = {0};
    long long n = 0;
    int rank = -1;
    const int got = std::sscanf(spec, "%15[a-z]:%lld:%15[a-z]:%d", op, &n, how, &rank);
    if (got >= 2 && n > 0) {
      r.op = op;
      r.n = n;
      r.how = got >= 3 ? how : "enospc";
      r.rank = got == 4 ? rank : -1;
    }
    return r;
  }();
  return f;
}

// 0, or the errno this I/O point is to fail with.
int io_point(const char* op) {
  IoFault& f = io_fault();
  if (f.n <= 0 || (f.op != "any" && f.op != op)) return 0;
  if (f.rank >= 0) {
    int rank = 0;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    if (rank != f.rank) return 0;
  }
  if (++f.seen != f.n) return 0;
  if (f.how == "kill") std::_Exit(137);
  return f.how == "eio" ? EIO : ENOSPC;
}

std::string errstr(int e) { return std::strerror(e); }

// Data and metadata on disk before the rename that publishes them (files and directories).
void fsync_path(const std::string& path) {
  if (const int e = io_point("fsync")) throw SystemError(path + ": fsync failed: " + errstr(e));
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw SystemError(path + ": cannot open for fsync: " + errstr(errno));
  const int rc = ::fsync(fd), fsync_errno = errno;
  ::close(fd);
  if (rc != 0) throw SystemError(path + ": fsync failed: " + errstr(fsync_errno));
}

void rename_path(const fs::path& from, const fs::path& to) {
  int e = io_point("rename");
  if (e == 0 && ::rename(from.c_str(), to.c_str()) != 0) e = errno;
  if (e != 0) throw SystemError(to.string() + ": cannot rename " + from.string() + " to it: " + errstr(e));
}

// Writes, fsyncs and closes a file from memory, every step checked; a failed write leaves no file.
void write_small_file(const std::string& path, const std::string& content) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) throw SystemError(path + ": cannot create: " + errstr(errno));
  std::string what = "write";
  int e = io_point("write");
  for (size_t done = 0; e == 0 && done < content.size();) {
    const ssize_t n = ::write(fd, content.data() + done, content.size() - done);
    if (n < 0 && errno != EINTR) e = errno;
    if (n > 0) done += static_cast<size_t>(n);
  }
  if (e == 0) {
    what = "fsync";
    if ((e = io_point("fsync")) == 0 && ::fsync(fd) != 0) e = errno;
  }
  const int close_fault = io_point("close");
  const int close_rc = ::close(fd), close_errno = errno;
  if (e == 0 && (close_fault != 0 || close_rc != 0)) {
    what = "close";
    e = close_fault != 0 ? close_fault : close_errno;
  }
  if (e != 0) {
    ::unlink(path.c_str());
    throw SystemError(path + ": " + what + " failed: " + errstr(e));
  }
}

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
          {"topology", {{"pipe", 1}, {"data", m.dp_world_size}, {"model", 1}}},
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

// ---- HDF5 writing and the index's virtual datasets ------------------------------------------------

// One hyperslab of a virtual dataset: [start, start + count) of the tensor, from source
// elements [src, src + prod(count)) of a shard's 1-D dataset.
struct Piece {
  std::vector<hsize_t> start, count;
  int64_t src;
};

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

struct Mapping {
  int64_t shard;
  Piece piece;
  int64_t src_len;
};

// Every piece of tensor t, in shard and segment order: what index.h5 maps and what open() expects.
std::vector<Mapping> mappings_of(const CheckpointMeta& m, const std::vector<std::vector<int64_t>>& offsets,
                                 const std::vector<int64_t>& shape, int64_t off, int64_t numel) {
  std::vector<Mapping> out;
  for (size_t q = 0; q < m.ranges.size(); ++q) {
    const int64_t len = offsets[q].empty() ? 0 : offsets[q].back() + (m.ranges[q].back().second - m.ranges[q].back().first);
    for (size_t k = 0; k < m.ranges[q].size(); ++k) {
      const auto [b, e] = m.ranges[q][k];
      const int64_t lo = std::max(b, off), hi = std::min(e, off + numel);
      if (lo < hi)
        for (Piece& p : pieces_of(shape, off, lo, hi, offsets[q][k] + (lo - b))) out.push_back({int64_t(q), p, len});
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

void write_shard(const std::string& path, const CheckpointMeta& meta, const std::vector<const ShardSegment*>& segs,
                 int rank) {
  SegmentList ranges;
  hsize_t n = 0;
  for (const ShardSegment* s : segs) {
    ranges.emplace_back(s->begin, s->end);
    n += static_cast<hsize_t>(s->end - s->begin);
  }
  // The data plus room for HDF5's metadata (superblock, attributes, chunk indexes: a few KiB
  // per buffer and about 1% of the data at most).
  const int64_t data_bytes = static_cast<int64_t>(n) * 4 * static_cast<int64_t>(meta.states.size());
  const int64_t reserve = data_bytes + data_bytes / 100 + (int64_t(64) << 10);
  h5::File f = h5::File::create(path, reserve);
  h5::write_attribute(f.id(), "format_version", kCheckpointFormatVersion);
  h5::write_attribute(f.id(), "rank", rank);
  h5::write_attribute(f.id(), "segments", segments_json(ranges).dump());
  h5::write_attribute(f.id(), "tag_id", meta.tag_id);
  h5::write_attribute(f.id(), "step", meta.step);
  h5::write_attribute(f.id(), "zero_stage", meta.zero_stage);
  const hsize_t chunk = std::max<hsize_t>(1, std::min<hsize_t>(n, hsize_t(1) << 20));  // 4 MiB chunks
  for (const std::string& name : meta.states) {
    Handle space(H5Screate_simple(1, &n, nullptr), H5Sclose);
    Handle dcpl(H5Pcreate(H5P_DATASET_CREATE), H5Pclose);
    h5::check(space.valid() && dcpl.valid() ? 0 : -1, f.id(), "cannot create dataspace for " + name);
    if (n > 0) {  // a chunked dataset needs a non-empty extent
      h5::check(H5Pset_chunk(dcpl.get(), 1, &chunk), f.id(), "cannot set chunking of " + name);
      h5::check(H5Pset_fletcher32(dcpl.get()), f.id(), "cannot enable Fletcher32 on " + name);
    }
    Handle ds(H5Dcreate2(f.id(), name.c_str(), H5T_IEEE_F32LE, space.get(), H5P_DEFAULT, dcpl.get(), H5P_DEFAULT),
              H5Dclose);
    if (!ds.valid()) throw SystemError(path + ": cannot create dataset " + name);
    hsize_t at = 0;
    for (const ShardSegment* s : segs) {
      const float* data = nullptr;
      for (const auto& [array, ptr] : s->arrays)
        if (array == name) data = ptr;
      const hsize_t len = static_cast<hsize_t>(s->end - s->begin);
      if (const int e = io_point("write")) throw SystemError(path + ": cannot write dataset " + name + ": " + errstr(e));
      Handle fspace(H5Dget_space(ds.get()), H5Sclose);
      Handle mspace(H5Screate_simple(1, &len, nullptr), H5Sclose);
      if (!fspace.valid() || !mspace.valid() ||
          H5Sselect_hyperslab(fspace.get(), H5S_SELECT_SET, &at, nullptr, &len, nullptr) < 0 ||
          H5Dwrite(ds.get(), H5T_NATIVE_FLOAT, mspace.get(), fspace.get(), H5P_DEFAULT, data) < 0)
        throw SystemError(path + ": cannot write dataset " + name + " (disk full or I/O error)");
      at += len;
    }
    if (!ds.close()) throw SystemError(path + ": cannot write dataset " + name + " (disk full or I/O error)");
    // Test hook for the interrupted-save test: die in the middle of writing a shard.
    if (const char* fault = std::getenv("ZERO3D_FAULT")) {
      long long step = -1;
      int r = -1;
      if (std::sscanf(fault, "save_crash:%d:%lld", &r, &step) == 2 && r == rank && step == meta.step) std::_Exit(137);
    }
  }
  if (const int e = io_point("close")) throw SystemError(path + ": cannot write HDF5 file: " + errstr(e));
  f.close();
}

// Built in memory and written with checked writes: index.h5 is metadata only (small), and a
// failed write then fails only our write, never an HDF5 flush.
void write_index(const std::string& path, const CheckpointMeta& meta, const ParamLayout& layout) {
  h5::File f = h5::File::create_in_memory(path);
  h5::write_attribute(f.id(), "meta", meta_to_json(meta).dump());
  h5::write_attribute(f.id(), "format_version", kCheckpointFormatVersion);
  h5::write_attribute(f.id(), "tag_id", meta.tag_id);
  h5::write_attribute(f.id(), "step", meta.step);
  h5::write_attribute(f.id(), "zero_stage", meta.zero_stage);
  h5::write_attribute(f.id(), "dp_world_size", meta.dp_world_size);
  const auto offsets = local_offsets(meta.ranges);
  for (const std::string& state : meta.states) {
    const std::string prefix = state == "params" ? "/" : "/" + state + "/";
    if (state != "params") {
      Handle g(H5Gcreate2(f.id(), state.c_str(), H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT), H5Gclose);
      if (!g.valid() || !g.close()) throw SystemError(path + ": cannot create group " + state);
    }
    for (const TensorSpec& t : layout.tensors()) {
      std::vector<hsize_t> dims(t.shape.begin(), t.shape.end());
      Handle vspace(H5Screate_simple(static_cast<int>(dims.size()), dims.data(), nullptr), H5Sclose);
      Handle dcpl(H5Pcreate(H5P_DATASET_CREATE), H5Pclose);
      h5::check(vspace.valid() && dcpl.valid() ? 0 : -1, f.id(), "cannot create dataspace for " + t.name);
      for (const Mapping& mp : mappings_of(meta, offsets, t.shape, t.offset, t.numel)) {
        hsize_t count = 1;
        for (hsize_t c : mp.piece.count) count *= c;
        const hsize_t src_dims = static_cast<hsize_t>(mp.src_len), s0 = static_cast<hsize_t>(mp.piece.src);
        Handle sspace(H5Screate_simple(1, &src_dims, nullptr), H5Sclose);
        // Relative file names resolve against the index file's directory.
        const std::string src_file = shard_name(mp.shard);
        if (!sspace.valid() ||
            H5Sselect_hyperslab(vspace.get(), H5S_SELECT_SET, mp.piece.start.data(), nullptr, mp.piece.count.data(),
                                nullptr) < 0 ||
            H5Sselect_hyperslab(sspace.get(), H5S_SELECT_SET, &s0, nullptr, &count, nullptr) < 0 ||
            H5Pset_virtual(dcpl.get(), vspace.get(), src_file.c_str(), state.c_str(), sspace.get()) < 0)
          throw SystemError(path + ": cannot map virtual dataset " + prefix + t.name + " onto " + src_file);
      }
      h5::check(H5Sselect_all(vspace.get()), f.id(), "cannot select " + t.name);
      Handle ds(H5Dcreate2(f.id(), (prefix + t.name).c_str(), H5T_IEEE_F32LE, vspace.get(), H5P_DEFAULT, dcpl.get(),
                           H5P_DEFAULT),
                H5Dclose);
      if (!ds.valid() || !ds.close()) throw SystemError(path + ": cannot create virtual dataset " + prefix + t.name);
    }
  }
  const std::vector<char> image = f.close_to_image();
  write_small_file(path, std::string(image.begin(), image.end()));
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

// ---- ownership: run family and marker -----------------------------------------------------------

bool is_hex_id(const std::string& s) {
  return s.size() == 32 && std::all_of(s.begin(), s.end(), [](char c) { return std::isxdigit(static_cast<unsigned char>(c)); });
}

// The save directory's run-family id, created by its first save.
std::string load_or_create_family(const fs::path& dir) {
  const fs::path path = dir / kFamilyFile;
  std::error_code ec;
  if (fs::exists(fs::symlink_status(path, ec))) {
    std::string id = read_small_file(path.string(), 256);
    while (!id.empty() && (id.back() == '\n' || id.back() == '\r')) id.pop_back();
    if (!is_hex_id(id)) throw InputError(path.string() + ": not a zero3d run-family file (expected 32 hex digits)");
    return id;
  }
  const std::string id = random_id();
  const std::string tmp = path.string() + ".tmp";
  write_small_file(tmp, id + "\n");
  rename_path(tmp, path);
  fsync_path(dir.string());
  return id;
}

// The marker of a tag directory: {"zero3d_checkpoint": version, "run_family", "tag_id"}; null if
// absent or not ours to read.
nlohmann::json read_marker(const fs::path& tag_dir) {
  std::error_code ec;
  if (!fs::is_regular_file(fs::symlink_status(tag_dir / kMarker, ec))) return nullptr;
  try {
    nlohmann::json j = nlohmann::json::parse(read_small_file((tag_dir / kMarker).string(), 4096));
    if (j.is_object() && j.contains("zero3d_checkpoint") && j.value("run_family", "") != "") return j;
  } catch (const std::exception&) {
  }
  return nullptr;
}

// A real directory (not a symlink) marked as a tag of `family`.
bool is_ours(const fs::path& tag_dir, const std::string& family) {
  std::error_code ec;
  if (!fs::is_directory(fs::symlink_status(tag_dir, ec))) return false;
  const nlohmann::json m = read_marker(tag_dir);
  return !m.is_null() && m.value("run_family", "") == family;
}

// Every file its manifest lists is there with its recorded size (cheap; not the digests).
bool looks_complete(const fs::path& tag_dir) {
  try {
    const nlohmann::json man = nlohmann::json::parse(read_small_file((tag_dir / kManifest).string(), size_t(64) << 20));
    for (const auto& [name, f] : man.at("files").items()) {
      std::error_code ec;
      const auto size = fs::file_size(tag_dir / name, ec);
      if (ec || static_cast<int64_t>(size) != f.at("bytes").get<int64_t>()) return false;
    }
    return true;
  } catch (const std::exception&) {
    return false;
  }
}

void warn(const std::string& msg) {
  std::fprintf(stderr, "warning: %s\n", msg.c_str());
  std::fflush(stderr);
}

// Where a save's directory is made before it carries its marker: the family id in the name
// makes a leftover recognisably this family's even when the kill came before the marker.
std::string staging_prefix(const std::string& family) { return ".zero3d-" + family + "-"; }

// Rank 0 before a save: recover a re-save interrupted between its renames, remove this family's
// stale saves (and nothing else), then make <tag>.tmp with its marker (made as a staging
// directory, marked, then renamed: <tag>.tmp never exists without the marker).
void prepare_save(const fs::path& dir, const fs::path& tmp, const std::string& family, const std::string& tag,
                  const std::string& tag_id) {
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(dir, ec)) {
    const std::string name = entry.path().filename().string();
    if (!ends_with(name, ".tmp")) continue;
    const bool staging = name.rfind(staging_prefix(family), 0) == 0;
    if (!staging && !is_ours(entry.path(), family)) continue;
    if (!staging && ends_with(name, ".old.tmp")) {
      const fs::path base = dir / name.substr(0, name.size() - 8);
      std::error_code ec2;
      if (!fs::exists(fs::symlink_status(base, ec2)) && looks_complete(entry.path())) {
        rename_path(entry.path(), base);  // the kill came between moving it aside and publishing
        fsync_path(dir.string());
        continue;
      }
    }
    std::error_code ec2;
    fs::remove_all(entry.path(), ec2);
    if (ec2) throw SystemError(entry.path().string() + ": cannot remove this run's stale save: " + ec2.message());
  }
  if (ec) throw SystemError(dir.string() + ": cannot list: " + ec.message());
  if (fs::exists(fs::symlink_status(tmp, ec)))
    throw InputError(tmp.string() + ": exists and is not a save of this run family (no " + kMarker +
                     " naming it); move it away");
  const fs::path staging = dir / (staging_prefix(family) + tag_id + ".tmp");
  fs::create_directory(staging, ec);
  if (ec) throw SystemError(staging.string() + ": cannot create: " + ec.message());
  try {
    write_small_file((staging / kMarker).string(),
                     nlohmann::json{{"zero3d_checkpoint", kCheckpointFormatVersion}, {"run_family", family},
                                    {"tag", tag}, {"tag_id", tag_id}}
                             .dump() +
                         "\n");
    rename_path(staging, tmp);
  } catch (...) {
    std::error_code ec2;
    fs::remove_all(staging, ec2);
    throw;
  }
}

// Keeps the newest `keep_last` tags of this family (`tag` always). Runs only after a publish;
// a failure here loses nothing, so it warns instead of failing the save.
void rotate(const fs::path& dir, const std::string& family, const std::string& tag, int64_t keep_last) {
  std::vector<std::pair<int64_t, std::string>> tags;
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(dir, ec)) {
    const std::string name = entry.path().filename().string();
    if (!ends_with(name, ".tmp") && is_ours(entry.path(), family) && fs::exists(entry.path() / kManifest))
      tags.emplace_back(tag_step(name), name);
  }
  std::sort(tags.begin(), tags.end());
  for (size_t k = 0; k + static_cast<size_t>(keep_last) < tags.size(); ++k) {
    if (tags[k].second == tag) continue;
    // Renamed first so a kill mid-removal leaves a stale .tmp (removed next time), not a half tag.
    const fs::path victim = dir / tags[k].second, doomed = dir / (tags[k].second + ".del.tmp");
    try {
      rename_path(victim, doomed);
      std::error_code ec2;
      fs::remove_all(doomed, ec2);
      if (ec2) warn(doomed.string() + ": keep_last could not remove it: " + ec2.message());
    } catch (const std::exception& e) {
      warn(std::string("keep_last: ") + e.what());
    }
  }
}

std::vector<SegmentList> gather_segments(const std::vector<const ShardSegment*>& segs, MPI_Comm world) {
  int size = 1;
  MPI_Comm_size(world, &size);
  std::vector<int64_t> flat;
  for (const ShardSegment* s : segs) {
    flat.push_back(s->begin);
    flat.push_back(s->end);
  }
  const int n = static_cast<int>(flat.size());
  std::vector<int> counts(static_cast<size_t>(size)), displs(static_cast<size_t>(size));
  MPI_Allgather(&n, 1, MPI_INT, counts.data(), 1, MPI_INT, world);
  int total = 0;
  for (int r = 0; r < size; ++r) {
    displs[r] = total;
    total += counts[r];
  }
  std::vector<int64_t> all(static_cast<size_t>(std::max(total, 1)));
  MPI_Allgatherv(flat.data(), n, MPI_INT64_T, all.data(), counts.data(), displs.data(), MPI_INT64_T, world);
  std::vector<SegmentList> out(static_cast<size_t>(size));
  for (int r = 0; r < size; ++r)
    for (int k = 0; k < counts[r]; k += 2) out[r].emplace_back(all[displs[r] + k], all[displs[r] + k + 1]);
  return out;
}

void bcast_string(std::string& s, MPI_Comm world) {
  int n = static_cast<int>(s.size());
  MPI_Bcast(&n, 1, MPI_INT, 0, world);
  s.resize(static_cast<size_t>(n));
  MPI_Bcast(s.data(), n, MPI_CHAR, 0, world);
}

nlohmann::json file_entry(const std::pair<int64_t, uint64_t>& d) { return {{"bytes", d.first}, {"xxh64", hex64(d.second)}}; }

// The manifest's own digest: over its JSON without the "xxh64" member.
std::string manifest_digest(nlohmann::json man) {
  man.erase("xxh64");
  const std::string text = man.dump();
  return hex64(xxh64(text.data(), text.size()));
}

}  // namespace

bool checkpoint_exists(const std::string& save_dir) {
  std::error_code ec;
  return fs::exists(fs::path(save_dir) / "latest", ec);
}

std::vector<std::string> list_checkpoint_tags(const std::string& save_dir) {
  std::vector<std::pair<int64_t, std::string>> tags;
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(save_dir, ec)) {
    const std::string name = entry.path().filename().string();
    if (entry.is_directory() && fs::exists(entry.path() / "index.h5") && !ends_with(name, ".tmp"))
      tags.emplace_back(tag_step(name), name);
  }
  std::sort(tags.begin(), tags.end());
  std::vector<std::string> out;
  for (auto& t : tags) out.push_back(t.second);
  return out;
}

void save_checkpoint(const std::string& save_dir, const std::string& tag, const CheckpointMeta& meta_in,
                     const ShardSlice& mine, const ParamLayout& layout, MPI_Comm world, int64_t keep_last,
                     bool node_local) {
  h5::quiet_errors();
  int rank = 0, size = 1;
  MPI_Comm_rank(world, &rank);
  MPI_Comm_size(world, &size);
  // Who creates the tag directory and publishes it: rank 0, or with node-local storage the first
  // rank of every node, in that node's own save_dir (checkpoint_options.hpp).
  const bool publisher = node_local ? is_first_rank_of_node(world) : rank == 0;
  const fs::path dir(save_dir), tmp = dir / (tag + ".tmp"), final_dir = dir / tag, old = dir / (tag + ".old.tmp");
  CheckpointMeta meta = meta_in;
  std::vector<const ShardSegment*> segs;
  for (const ShardSegment& s : mine.segments)
    if (s.end > s.begin) segs.push_back(&s);
  meta.ranges = gather_segments(segs, world);
  run_collectively(world, [&] {  // a layout bug must not reach the disk
    const std::string tiling = tiling_problem(meta.ranges, meta.total_params);
    if (!tiling.empty()) throw SystemError("internal error: checkpoint " + tag + ": the ranks' segments: " + tiling);
    for (const ShardSegment* s : segs)
      for (const std::string& state : meta.states)
        if (std::none_of(s->arrays.begin(), s->arrays.end(), [&](const auto& a) { return a.first == state && a.second; }))
          throw SystemError("internal error: checkpoint " + tag + ": rank " + std::to_string(rank) + " holds no `" +
                            state + "` for segment [" + std::to_string(s->begin) + ", " + std::to_string(s->end) + ")");
  });
  std::string family;
  if (rank == 0) meta.tag_id = random_id();
  bcast_string(meta.tag_id, world);
  run_collectively(world, [&] {
    if (!publisher) return;
    std::error_code ec;
    fs::create_directories(dir, ec);
    if (ec) throw SystemError(save_dir + ": cannot create checkpoint directory: " + ec.message());
    family = load_or_create_family(dir);
    prepare_save(dir, tmp, family, tag, meta.tag_id);
  });
  bool published = false;
  try {
    std::pair<int64_t, uint64_t> digest{0, 0};
    run_collectively(world, [&] {
      const std::string path = (tmp / shard_name(rank)).string();
      write_shard(path, meta, segs, rank);
      fsync_path(path);
      digest = file_digest(path, true);
    });
    std::vector<int64_t> digests(2 * static_cast<size_t>(size));
    const int64_t mine_d[2] = {digest.first, static_cast<int64_t>(digest.second)};
    MPI_Allgather(mine_d, 2, MPI_INT64_T, digests.data(), 2, MPI_INT64_T, world);  // every publisher lists all
    run_collectively(world, [&] {
      if (!publisher) return;
      const std::string index = (tmp / "index.h5").string();
      write_index(index, meta, layout);  // written and fsynced
      nlohmann::json files = nlohmann::json::object();
      for (int r = 0; r < size; ++r)
        files[shard_name(r)] = file_entry({digests[2 * r], static_cast<uint64_t>(digests[2 * r + 1])});
      files["index.h5"] = file_entry(file_digest(index, true));
      files[kMarker] = file_entry(file_digest((tmp / kMarker).string(), true));
      const std::string meta_text = meta_to_json(meta).dump();
      nlohmann::json man = {{"format", "zero3d-checkpoint-manifest"}, {"format_version", kCheckpointFormatVersion},
                            {"tag", tag}, {"tag_id", meta.tag_id}, {"run_family", family}, {"shards", size},
                            {"meta_xxh64", hex64(xxh64(meta_text.data(), meta_text.size()))}, {"files", files}};
      man["xxh64"] = manifest_digest(man);
      write_small_file((tmp / kManifest).string(), man.dump(1) + "\n");
      fsync_path(tmp.string());
      // Publish. An existing <tag> is moved aside, never deleted first: until the second rename
      // readers fall back to <tag>.old.tmp, and the next save restores it.
      std::error_code ec;
      if (fs::exists(fs::symlink_status(final_dir, ec))) {
        if (!is_ours(final_dir, family))
          throw InputError(final_dir.string() + ": exists and was not written by this run family (no " + kMarker +
                           " naming it); not replacing it");
        rename_path(final_dir, old);
      }
      try {
        rename_path(tmp, final_dir);
        fsync_path(dir.string());
      } catch (...) {
        std::error_code ec2;  // put the previous save back where `latest` may look for it
        if (!fs::exists(final_dir, ec2) && fs::exists(old, ec2)) fs::rename(old, final_dir, ec2);
        throw;
      }
      published = true;
      const fs::path latest = dir / "latest", latest_tmp = dir / "latest.tmp";
      write_small_file(latest_tmp.string(), tag + "\n");
      rename_path(latest_tmp, latest);
      fsync_path(dir.string());
      fs::remove_all(old, ec);
      if (ec) warn(old.string() + ": cannot remove the replaced save: " + ec.message());
      if (keep_last > 0) rotate(dir, family, tag, keep_last);
    });
  } catch (...) {
    if (publisher && !published) {  // free the space a failed save took; nothing else is touched
      std::error_code ec;
      fs::remove_all(tmp, ec);
    }
    throw;
  }
}

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
  if (!h5::read_attribute(f.id(), "meta", text)) throw InputError(index + ": no checkpoint metadata (corrupted?)");
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
      const auto expect = mappings_of(r.meta_, r.local_offsets_, shape, t.at("offset").get<int64_t>(), numel);
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
        hsize_t n = 1;
        for (hsize_t c : m.piece.count) n *= c;
        ok = ok && slo[0] == static_cast<hsize_t>(m.piece.src) && shi[0] + 1 == static_cast<hsize_t>(m.piece.src) + n;
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
      same = h5::read_attribute(fid, "segments", seg_text) && h5::read_attribute(fid, "tag_id", tag_id) &&
             tag_id == meta_.tag_id && seg_text == segments_json(segs).dump();
    }
    int64_t step = -1;
    if (!same || !h5::read_attribute(fid, "step", step) || step != meta_.step)
      throw InputError(path + ": shard does not belong to this checkpoint (segments, tag id or step differ from index.h5)");
    Handle ds(H5Dopen2(fid, state.c_str(), H5P_DEFAULT), H5Dclose);
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
