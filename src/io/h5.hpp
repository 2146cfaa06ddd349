// h5.hpp — small RAII layer over the HDF5 C API: every call checked, errors name the file.
//
// No HDF5 handle outlives the function that opened it: every hid_t lives in a Handle (or a
// File), so an exception closes it while the stack unwinds, long before MPI_Finalize (where
// hdf5-mpich would otherwise flush a leaked file and crash). Writers close explicitly with
// close(), whose result is checked: chunked data reaches the file only when it closes.
#pragma once

#include <hdf5.h>

#include <cstdint>
#include <string>
#include <vector>

namespace zero3d::h5 {

// Owns one hid_t and closes it with the matching H5*close.
class Handle {
 public:
  using Closer = herr_t (*)(hid_t);
  Handle() = default;
  Handle(hid_t id, Closer close) : id_(id), close_(close) {}
  Handle(const Handle&) = delete;
  Handle& operator=(const Handle&) = delete;
  Handle(Handle&& o) noexcept : id_(o.id_), close_(o.close_) { o.id_ = -1; }
  Handle& operator=(Handle&& o) noexcept {
    reset();
    id_ = o.id_;
    close_ = o.close_;
    o.id_ = -1;
    return *this;
  }
  ~Handle() { reset(); }
  hid_t get() const { return id_; }
  bool valid() const { return id_ >= 0; }
  // Closes now and reports whether the close succeeded (a dataset's or file's last writes
  // happen here). The handle is released either way.
  bool close() {
    if (id_ < 0 || !close_) return true;
    const herr_t rc = close_(id_);
    id_ = -1;
    return rc >= 0;
  }
  void reset() { close(); }

 private:
  hid_t id_ = -1;
  Closer close_ = nullptr;
};

class File {
 public:
  static File open_read(const std::string& path);   // InputError if missing or not HDF5
  // Truncates; SystemError on failure. reserve_bytes > 0 allocates that much disk space for the
  // file up front (fallocate, keeping its size): a full disk then fails here, cleanly, instead
  // of in HDF5's final flush, after which HDF5 1.10 can never close the file.
  static File create(const std::string& path, int64_t reserve_bytes = 0);
  // A file built in memory (core driver): nothing reaches the disk until close_to_image().
  static File create_in_memory(const std::string& path);
  // For create_in_memory files: closes and returns the file's bytes for the caller to write.
  std::vector<char> close_to_image();
  hid_t id() const { return handle_.get(); }
  const std::string& path() const { return path_; }
  // Flushes and closes; SystemError naming the file when HDF5 could not write it out.
  void close();
  File(File&&) = default;
  File& operator=(File&&) = delete;
  ~File();

  bool has(const std::string& name) const;
  std::vector<int64_t> shape(const std::string& name) const;
  // Reads a dataset of any floating type as float (HDF5 converts).
  std::vector<float> read_floats(const std::string& name) const;
  std::vector<int32_t> read_ints(const std::string& name) const;
  void write_floats(const std::string& name, const float* data, const std::vector<int64_t>& shape);
  std::vector<int8_t> read_int8(const std::string& name) const;
  void write_int8(const std::string& name, const int8_t* data, const std::vector<int64_t>& shape);

 private:
  File(hid_t id, std::string path, bool writable) : handle_(id, H5Fclose), writable_(writable), path_(std::move(path)) {}
  // Releases a file whose writes failed (see h5.cpp); never throws.
  void release_after_failure() noexcept;
  Handle handle_;
  bool writable_ = false;
  int64_t reserved_ = 0;
  std::string path_;
};

// The closer for datasets being written (instead of H5Dclose). HDF5 1.10 frees a dataset whose
// close failed to flush yet keeps its id, and library shutdown inside MPI_Finalize then closes
// that id again and crashes (likewise a file). So the dataset is flushed first; when that fails
// the write has failed and its file is being discarded: the file's descriptor is pointed at
// memory (discard_file_writes) and the flush retried there, then the dataset is closed. Returns
// H5Dclose's result, negative when the dataset's writes failed: its writer then throws.
herr_t close_dataset(hid_t ds);

// Points the descriptor of the disk file `obj` lives in (sec2 driver) at an anonymous memory
// file: HDF5's remaining and retried writes for a file that is being discarded succeed there,
// so that it can close it. No effect on other drivers.
void discard_file_writes(hid_t obj) noexcept;

// Silences HDF5's own error-stack printing: zero3d reports errors itself, once.
void quiet_errors();

// The name of the file an HDF5 object lives in ("?" when unknown), for error messages.
std::string file_name(hid_t obj);

// SystemError "<file of obj>: <what>" unless rc >= 0: for the many HDF5 calls on a write path.
void check(herr_t rc, hid_t obj, const std::string& what);

// Attributes on any object (file, group, dataset). Writers throw SystemError naming the file;
// readers return false when absent or unreadable.
void write_attribute(hid_t obj, const std::string& name, int64_t value);
void write_attribute(hid_t obj, const std::string& name, const std::string& value);
bool read_attribute(hid_t obj, const std::string& name, int64_t& value);
bool read_attribute(hid_t obj, const std::string& name, std::string& value);

// A text of any size under `name` of `obj` (a file or group): an attribute while it fits one
// (HDF5 object headers hold at most 64 KiB), else a scalar string dataset of that name. Both
// read as a string in h5dump/h5py; read_text returns false when neither is there or readable.
void write_text(hid_t obj, const std::string& name, const std::string& value);
bool read_text(hid_t obj, const std::string& name, std::string& value);

// Dataset access properties whose chunk cache holds `bytes` (two chunks, say): segments far
// smaller than a chunk (a tensor-parallel shard has one per matrix row) are then read or written
// in memory, where HDF5's default 1 MiB cache would read, checksum and rewrite a bigger chunk
// once per segment.
Handle chunk_cache_access(size_t bytes);

// A 16-bit brain-float type (8-bit exponent, 7-bit mantissa) that HDF5 converts to and from
// native float itself, so h5py/h5dump read bf16 datasets as numbers.
Handle bf16_type();

}  // namespace zero3d::h5
