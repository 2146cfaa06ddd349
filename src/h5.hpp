// h5.hpp — small RAII layer over the HDF5 C API: every call checked, errors name the file.
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
  void reset() {
    if (id_ >= 0 && close_) close_(id_);
    id_ = -1;
  }

 private:
  hid_t id_ = -1;
  Closer close_ = nullptr;
};

class File {
 public:
  static File open_read(const std::string& path);   // InputError if missing or not HDF5
  static File create(const std::string& path);      // truncates; SystemError on failure
  hid_t id() const { return handle_.get(); }
  const std::string& path() const { return path_; }

  bool has(const std::string& name) const;
  std::vector<int64_t> shape(const std::string& name) const;
  // Reads a dataset of any floating type as float (HDF5 converts).
  std::vector<float> read_floats(const std::string& name) const;
  std::vector<int32_t> read_ints(const std::string& name) const;
  void write_floats(const std::string& name, const float* data, const std::vector<int64_t>& shape);

 private:
  File(hid_t id, std::string path) : handle_(id, H5Fclose), path_(std::move(path)) {}
  Handle handle_;
  std::string path_;
};

// Silences HDF5's own error-stack printing: zero3d reports errors itself, once.
void quiet_errors();

// Attributes on any object (file, group, dataset). Readers return false when absent.
void write_attribute(hid_t obj, const std::string& name, int64_t value);
void write_attribute(hid_t obj, const std::string& name, const std::string& value);
bool read_attribute(hid_t obj, const std::string& name, int64_t& value);
bool read_attribute(hid_t obj, const std::string& name, std::string& value);

// A 16-bit brain-float type (8-bit exponent, 7-bit mantissa) that HDF5 converts to and from
// native float itself, so h5py/h5dump read bf16 datasets as numbers. Caller closes it.
hid_t bf16_type();

}  // namespace zero3d::h5
