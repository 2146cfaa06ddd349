// checkpoint.cpp — see checkpoint.hpp for the layout and the guarantees.



#include "base/errors.hpp"
#include "base/failure.hpp"
#include "base/input_file.hpp"
#include "io/checkpoint.hpp"
#include "io/checkpoint_format.hpp"
#include "io/h5.hpp"
#include "kernels/memory.hpp"
#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fcntl.h>
#include <filesystem>
#include <random>
#include <sys/stat.h>
#include <unistd.h>

namespace fs = std::filesystem;

namespace zero3d {

using namespace ckpt;

namespace {

using h5::Handle;

const char* const kFamilyFile = "zero3d.family";

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

void write_shard(const std::string& path, const CheckpointMeta& meta, const std::vector<const ShardSegment*>& segs,
                 const std::vector<RankState>& rank_state, int rank) {
  SegmentList ranges;
  hsize_t n = 0;
  for (const ShardSegment* s : segs) {
    ranges.emplace_back(s->begin, s->end);
    n += static_cast<hsize_t>(s->end - s->begin);
  }
  // The data plus room for HDF5's metadata (superblock, attributes, chunk indexes: a few KiB
  // per buffer and about 1% of the data at most).
  const int64_t data_bytes = static_cast<int64_t>(n) * 4 * static_cast<int64_t>(meta.states.size());
  int64_t reserve = data_bytes + data_bytes / 100 + (int64_t(64) << 10);
  for (const RankState& r : rank_state)
    reserve += static_cast<int64_t>(r.codes.size() + 4 * r.scales.size() + r.meta.size()) + (int64_t(4) << 10);
  h5::File f = h5::File::create(path, reserve);
  h5::write_attribute(f.id(), "format_version", kCheckpointFormatVersion);
  h5::write_attribute(f.id(), "rank", rank);
  h5::write_text(f.id(), "segments", segments_json(ranges).dump());
  h5::write_attribute(f.id(), "tag_id", meta.tag_id);
  h5::write_attribute(f.id(), "step", meta.step);
  h5::write_attribute(f.id(), "zero_stage", meta.zero_stage);
  const hsize_t chunk = std::max<hsize_t>(1, std::min<hsize_t>(n, kShardChunk));
  for (const std::string& name : meta.states) {
    Handle space(H5Screate_simple(1, &n, nullptr), H5Sclose);
    Handle dcpl(H5Pcreate(H5P_DATASET_CREATE), H5Pclose);
    h5::check(space.valid() && dcpl.valid() ? 0 : -1, f.id(), "cannot create dataspace for " + name);
    if (n > 0) {  // a chunked dataset needs a non-empty extent
      h5::check(H5Pset_chunk(dcpl.get(), 1, &chunk), f.id(), "cannot set chunking of " + name);
      h5::check(H5Pset_fletcher32(dcpl.get()), f.id(), "cannot enable Fletcher32 on " + name);
    }
    const Handle dapl = h5::chunk_cache_access(2 * kShardChunk * sizeof(float));
    Handle ds(H5Dcreate2(f.id(), name.c_str(), H5T_IEEE_F32LE, space.get(), H5P_DEFAULT, dcpl.get(), dapl.get()),
              h5::close_dataset);
    if (!ds.valid()) throw SystemError(path + ": cannot create dataset " + name);
    hsize_t at = 0;
    std::vector<float> bounce;  // a GPU build's segment, copied out of device memory for HDF5
    for (const ShardSegment* s : segs) {
      const float* data = nullptr;
      for (const auto& [array, ptr] : s->arrays)
        if (array == name) data = ptr;
      const hsize_t len = static_cast<hsize_t>(s->end - s->begin);
      if constexpr (!kernels::kHostIsDevice) {
        bounce.resize(static_cast<size_t>(len));
        kernels::copy_to_host(bounce.data(), data, bounce.size() * sizeof(float));
        data = bounce.data();
      }
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
  for (const RankState& r : rank_state) {
    h5::write_text(f.id(), r.name, r.meta);
    f.write_int8(r.name + "_codes", r.codes.data(), {static_cast<int64_t>(r.codes.size())});
    f.write_floats(r.name + "_scales", r.scales.data(), {static_cast<int64_t>(r.scales.size())});
  }
  if (const int e = io_point("close")) throw SystemError(path + ": cannot write HDF5 file: " + errstr(e));
  f.close();
}

// Built in memory and written with checked writes: index.h5 is metadata only (small), and a
// failed write then fails only our write, never an HDF5 flush.
void write_index(const std::string& path, const CheckpointMeta& meta, const ParamLayout& layout) {
  h5::File f = h5::File::create_in_memory(path);
  h5::write_text(f.id(), "meta", meta_to_json(meta).dump());
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
        const SourceSlab src = source_slab(mp.piece);
        const hsize_t src_dims = static_cast<hsize_t>(mp.src_len);
        Handle sspace(H5Screate_simple(1, &src_dims, nullptr), H5Sclose);
        // Relative file names resolve against the index file's directory.
        const std::string src_file = shard_name(mp.shard);
        if (!sspace.valid() ||
            H5Sselect_hyperslab(vspace.get(), H5S_SELECT_SET, mp.piece.start.data(), nullptr, mp.piece.count.data(),
                                nullptr) < 0 ||
            H5Sselect_hyperslab(sspace.get(), H5S_SELECT_SET, &src.start, &src.stride, &src.count, &src.block) < 0 ||
            H5Pset_virtual(dcpl.get(), vspace.get(), src_file.c_str(), state.c_str(), sspace.get()) < 0)
          throw SystemError(path + ": cannot map virtual dataset " + prefix + t.name + " onto " + src_file);
      }
      h5::check(H5Sselect_all(vspace.get()), f.id(), "cannot select " + t.name);
      Handle ds(H5Dcreate2(f.id(), (prefix + t.name).c_str(), H5T_IEEE_F32LE, vspace.get(), H5P_DEFAULT, dcpl.get(),
                           H5P_DEFAULT),
                h5::close_dataset);
      if (!ds.valid() || !ds.close()) throw SystemError(path + ": cannot create virtual dataset " + prefix + t.name);
    }
  }
  const std::vector<char> image = f.close_to_image();
  write_small_file(path, std::string(image.begin(), image.end()));
}

// ---- ownership: run family and marker -----------------------------------------------------------

bool is_hex_id(const std::string& s) {
  return s.size() == 32 && std::all_of(s.begin(), s.end(), [](char c) { return std::isxdigit(static_cast<unsigned char>(c)); });
}

// The save directory's run-family id; empty when it has none yet.
std::string read_family(const fs::path& dir) {
  const fs::path path = dir / kFamilyFile;
  std::error_code ec;
  if (!fs::exists(fs::symlink_status(path, ec))) return "";
  std::string id = read_small_file(path.string(), 256);
  while (!id.empty() && (id.back() == '\n' || id.back() == '\r')) id.pop_back();
  if (!is_hex_id(id)) throw InputError(path.string() + ": not a zero3d run-family file (expected 32 hex digits)");
  return id;
}

// The save directory's run-family id, created by its first save.
std::string load_or_create_family(const fs::path& dir) {
  if (std::string id = read_family(dir); !id.empty()) return id;
  const fs::path path = dir / kFamilyFile;
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

// A re-save killed between moving the old tag aside (<tag>.old.tmp) and publishing the new one
// leaves `latest` naming a directory that is not there: the complete old tag goes back in place.
void restore_moved_aside(const fs::path& dir, const std::string& family) {
  std::error_code ec;
  std::vector<fs::path> aside;
  for (const auto& entry : fs::directory_iterator(dir, ec)) {
    const std::string name = entry.path().filename().string();
    if (ends_with(name, ".old.tmp") && is_ours(entry.path(), family)) aside.push_back(entry.path());
  }
  for (const fs::path& p : aside) {
    const std::string name = p.filename().string();
    const fs::path base = dir / name.substr(0, name.size() - 8);
    if (!fs::exists(fs::symlink_status(base, ec)) && looks_complete(p)) {
      rename_path(p, base);
      fsync_path(dir.string());
    }
  }
}

// Rank 0 before a save: recover a re-save interrupted between its renames, remove this family's
// stale saves (and nothing else), then make <tag>.tmp with its marker (made as a staging
// directory, marked, then renamed: <tag>.tmp never exists without the marker).
void prepare_save(const fs::path& dir, const fs::path& tmp, const std::string& family, const std::string& tag,
                  const std::string& tag_id) {
  std::error_code ec;
  restore_moved_aside(dir, family);
  for (const auto& entry : fs::directory_iterator(dir, ec)) {
    const std::string name = entry.path().filename().string();
    if (!ends_with(name, ".tmp")) continue;
    const bool staging = name.rfind(staging_prefix(family), 0) == 0;
    if (!staging && !is_ours(entry.path(), family)) continue;
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

}  // namespace

int64_t tag_step(const std::string& tag) {
  const std::string prefix = "global_step";
  if (tag.rfind(prefix, 0) != 0) return -1;
  try {
    return std::stoll(tag.substr(prefix.size()));
  } catch (...) {
    return -1;
  }
}

void check_save_dir_before_run(const std::string& save_dir, int64_t resumed_step, int64_t last_step) {
  const fs::path dir(save_dir);
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) return;
  const std::string family = read_family(dir);
  const std::string fix = ". Resume it (training.resume \"auto\") or give this run its own output directory or training.save_dir";
  if (resumed_step < 0 && fs::exists(fs::symlink_status(dir / "latest", ec))) {
    std::string latest = read_small_file((dir / "latest").string(), 4096);
    while (!latest.empty() && (latest.back() == '\n' || latest.back() == '\r')) latest.pop_back();
    throw InputError((dir / "latest").string() + ": names " + echo(latest, 200) +
                     ", a checkpoint of an earlier run; this run starts fresh, and its saves would overwrite that "
                     "run's checkpoints and move `latest` back" + fix);
  }
  for (const auto& entry : fs::directory_iterator(dir, ec)) {
    const std::string name = entry.path().filename().string();
    const int64_t step = tag_step(name);
    // Only the tags this run will save: global_step<N> for N past its first step, up to its last.
    if (step <= std::max<int64_t>(resumed_step, 0) || step > last_step || name != "global_step" + std::to_string(step))
      continue;
    if (!family.empty() && is_ours(entry.path(), family)) {
      if (resumed_step >= 0) continue;  // resuming an earlier tag saves the later ones again (a rewind)
      throw InputError(entry.path().string() + ": a checkpoint of an earlier run, which this run's save at step " +
                       std::to_string(step) + " would overwrite" + fix);
    }
    throw InputError(entry.path().string() + ": exists and no zero3d run of this save_dir wrote it (no " + kMarker +
                     " marker of its run family), and this run saves a tag of that name at step " + std::to_string(step) +
                     ". Move it away or give this run its own output directory or training.save_dir");
  }
  if (ec) throw InputError("training.save_dir " + echo(save_dir, 200) + ": cannot list it: " + ec.message());
}

void restore_interrupted_resave(const std::string& save_dir) {
  std::error_code ec;
  if (!fs::is_directory(save_dir, ec)) return;
  if (const std::string family = read_family(save_dir); !family.empty()) restore_moved_aside(save_dir, family);
}

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
      write_shard(path, meta, segs, mine.rank_state, rank);
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

}  // namespace zero3d
