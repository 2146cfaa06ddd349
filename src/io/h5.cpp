// h5.cpp — checked HDF5 file, dataset and attribute access.
#include "io/h5.hpp"

#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <fcntl.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <exception>
#include <functional>

#include "base/errors.hpp"

namespace zero3d::h5 {

void quiet_errors() { H5Eset_auto2(H5E_DEFAULT, nullptr, nullptr); }

std::string file_name(hid_t obj) {
  char buf[4096];
  const ssize_t n = H5Fget_name(obj, buf, sizeof(buf));
  return n > 0 ? std::string(buf, static_cast<size_t>(std::min<ssize_t>(n, sizeof(buf) - 1))) : std::string("?");
}

void check(herr_t rc, hid_t obj, const std::string& what) {
  if (rc < 0) throw SystemError(file_name(obj) + ": " + what);
}

File File::open_read(const std::string& path) {
  quiet_errors();
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) throw InputError(path + ": file not found");
  if (!S_ISREG(st.st_mode)) throw InputError(path + ": not a regular file");
  if (H5Fis_hdf5(path.c_str()) <= 0) throw InputError(path + ": not an HDF5 file");
  hid_t id = H5Fopen(path.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT);
  if (id < 0) throw InputError(path + ": cannot open HDF5 file (truncated or corrupted)");
  return File(id, path, false);
}

File File::create(const std::string& path, int64_t reserve_bytes) {
  quiet_errors();
  errno = 0;
  hid_t id = H5Fcreate(path.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT);
  // HDF5's sec2 driver leaves the open(2) error in errno: the reason a user can act on.
  if (id < 0) throw SystemError(path + ": cannot create HDF5 file" + (errno != 0 ? std::string(": ") + std::strerror(errno) : ""));
  File f(id, path, true);
  void* vfd = nullptr;
  if (reserve_bytes > 0 && H5Fget_vfd_handle(id, H5P_DEFAULT, &vfd) >= 0 && vfd) {
    if (::fallocate(*static_cast<int*>(vfd), FALLOC_FL_KEEP_SIZE, 0, reserve_bytes) == 0) {
      f.reserved_ = reserve_bytes;
    } else if (errno != EOPNOTSUPP && errno != ENOSYS && errno != EINVAL) {  // unsupported: go on unreserved
      const int e = errno;
      f.release_after_failure();
      throw SystemError(path + ": cannot allocate " + std::to_string(reserve_bytes) + " bytes: " + std::strerror(e));
    }
  }
  return f;
}

File File::create_in_memory(const std::string& path) {
  quiet_errors();
  Handle fapl(H5Pcreate(H5P_FILE_ACCESS), H5Pclose);
  if (!fapl.valid() || H5Pset_fapl_core(fapl.get(), size_t(1) << 20, 0) < 0)
    throw SystemError(path + ": cannot set up an in-memory HDF5 file");
  hid_t id = H5Fcreate(path.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, fapl.get());
  if (id < 0) throw SystemError(path + ": cannot create HDF5 file in memory");
  return File(id, path, false);  // in memory: a failure cannot wedge it
}

std::vector<char> File::close_to_image() {
  std::vector<char> image;
  if (H5Fflush(id(), H5F_SCOPE_LOCAL) >= 0) {
    const ssize_t n = H5Fget_file_image(id(), nullptr, 0);
    if (n > 0) {
      image.resize(static_cast<size_t>(n));
      if (H5Fget_file_image(id(), image.data(), image.size()) != n) image.clear();
    }
  }
  if (!handle_.close() || image.empty()) throw SystemError(path_ + ": cannot build the HDF5 file in memory");
  return image;
}

void File::close() {
  if (!handle_.valid()) return;
  // Flush first: a failed flush leaves nothing for the close (and for HDF5's exit hooks) to retry.
  if (H5Fflush(handle_.get(), H5F_SCOPE_LOCAL) < 0 || !handle_.close()) {
    release_after_failure();
    throw SystemError(path_ + ": cannot write HDF5 file (flush/close failed: disk full or I/O error)");
  }
  if (reserved_ > 0) {  // give back the reserved space beyond the file's end
    const int fd = ::open(path_.c_str(), O_WRONLY | O_CLOEXEC);
    struct stat st {};
    if (fd >= 0 && ::fstat(fd, &st) == 0 && reserved_ > st.st_size)
      ::fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, st.st_size, reserved_ - st.st_size);
    if (fd >= 0) ::close(fd);
  }
}

File::~File() {
  // Unwinding: the file is being discarded after an error. Otherwise Handle closes it as usual
  // (writers that must know the outcome call close()).
  if (handle_.valid() && writable_ && std::uncaught_exceptions() > 0) release_after_failure();
}

namespace {
// HDF5's retried writes of a discarded file go to memory, where they fail only while an I/O
// error is still being delivered (a burst of EIO): a bounded number of tries outlasts one.
constexpr int kFlushTries = 64;

template <typename Flush>
bool flush_with_retries(hid_t obj, Flush flush) {
  for (int i = 0; i < kFlushTries; ++i)
    if (flush(obj) >= 0) return true;
  return false;
}
}  // namespace

void discard_file_writes(hid_t obj) noexcept {
  const hid_t file = H5Iget_file_id(obj);  // a new reference, closed below
  if (file < 0) return;
  const hid_t fapl = H5Fget_access_plist(file);
  void* vfd = nullptr;
  if (fapl >= 0 && H5Pget_driver(fapl) == H5FD_SEC2 && H5Fget_vfd_handle(file, H5P_DEFAULT, &vfd) >= 0 && vfd) {
    const int fd = *static_cast<int*>(vfd);  // the sec2 driver's descriptor
    const int mem = ::memfd_create("zero3d-discarded-hdf5", MFD_CLOEXEC);
    if (mem >= 0) {
      ::dup2(mem, fd);
      ::close(mem);
    }
  }
  if (fapl >= 0) H5Pclose(fapl);
  H5Fclose(file);  // not the last reference: nothing is flushed
}

herr_t close_dataset(hid_t ds) {
  if (H5Dflush(ds) >= 0) return H5Dclose(ds);
  discard_file_writes(ds);
  flush_with_retries(ds, H5Dflush);
  H5Dclose(ds);
  return -1;
}

// HDF5 keeps a file open when its final flush fails (H5Fclose returns before releasing the id),
// and frees one whose close failed later while keeping its id (then library shutdown inside
// MPI_Finalize crashes on it). The file is being discarded anyway: point its descriptor at an
// anonymous memory file, so the remaining writes succeed there, close what is still open in it
// (datasets flushed first, close_dataset), flush it until that succeeds, and close it for good.
void File::release_after_failure() noexcept {
  if (!handle_.valid()) return;
  const hid_t id = handle_.get();
  discard_file_writes(id);
  const unsigned kinds = H5F_OBJ_DATASET | H5F_OBJ_GROUP | H5F_OBJ_DATATYPE | H5F_OBJ_ATTR | H5F_OBJ_LOCAL;
  const ssize_t n = H5Fget_obj_count(id, kinds);
  if (n > 0) {
    std::vector<hid_t> ids(static_cast<size_t>(n));
    const ssize_t got = H5Fget_obj_ids(id, kinds, ids.size(), ids.data());
    for (ssize_t k = 0; k < got; ++k) {
      const H5I_type_t type = H5Iget_type(ids[k]);
      if (type == H5I_DATASET) close_dataset(ids[k]);
      else if (type == H5I_GROUP) H5Gclose(ids[k]);
      else if (type == H5I_DATATYPE) H5Tclose(ids[k]);
      else if (type == H5I_ATTR) H5Aclose(ids[k]);
    }
  }
  flush_with_retries(id, [](hid_t f) { return H5Fflush(f, H5F_SCOPE_LOCAL); });
  handle_.close();
}

bool File::has(const std::string& name) const {
  return H5Lexists(id(), name.c_str(), H5P_DEFAULT) > 0;
}

std::vector<int64_t> File::shape(const std::string& name) const {
  Handle ds(H5Dopen2(id(), name.c_str(), H5P_DEFAULT), H5Dclose);
  if (ds.get() < 0) throw InputError(path_ + ": no dataset `" + name + "`");
  Handle space(H5Dget_space(ds.get()), H5Sclose);
  const int rank = space.valid() ? H5Sget_simple_extent_ndims(space.get()) : -1;
  if (rank < 0) throw InputError(path_ + ": dataset `" + name + "` has no readable shape (corrupted)");
  std::vector<hsize_t> dims(static_cast<size_t>(rank));
  if (rank > 0 && H5Sget_simple_extent_dims(space.get(), dims.data(), nullptr) < 0)
    throw InputError(path_ + ": dataset `" + name + "` has no readable shape (corrupted)");
  return std::vector<int64_t>(dims.begin(), dims.end());
}

namespace {
template <typename T>
std::vector<T> read_as(const File& f, const std::string& name, hid_t mem_type) {
  std::vector<int64_t> dims = f.shape(name);
  int64_t n = 1;
  for (int64_t d : dims) n *= d;
  std::vector<T> out(static_cast<size_t>(n));
  Handle ds(H5Dopen2(f.id(), name.c_str(), H5P_DEFAULT), H5Dclose);
  if (!ds.valid() || H5Dread(ds.get(), mem_type, H5S_ALL, H5S_ALL, H5P_DEFAULT, out.data()) < 0)
    throw InputError(f.path() + ": cannot read dataset `" + name + "` (corrupt or not numeric)");
  return out;
}

void write_as(File& f, const std::string& name, const void* data, const std::vector<int64_t>& shape, hid_t file_type,
              hid_t mem_type) {
  std::vector<hsize_t> dims(shape.begin(), shape.end());
  Handle space(H5Screate_simple(static_cast<int>(dims.size()), dims.data(), nullptr), H5Sclose);
  Handle lcpl(H5Pcreate(H5P_LINK_CREATE), H5Pclose);
  const bool ok = space.valid() && lcpl.valid() && H5Pset_create_intermediate_group(lcpl.get(), 1) >= 0;
  Handle ds(ok ? H5Dcreate2(f.id(), name.c_str(), file_type, space.get(), lcpl.get(), H5P_DEFAULT, H5P_DEFAULT) : -1,
            close_dataset);
  if (!ds.valid() || H5Dwrite(ds.get(), mem_type, H5S_ALL, H5S_ALL, H5P_DEFAULT, data) < 0 || !ds.close())
    throw SystemError(f.path() + ": cannot write dataset `" + name + "`");
}
}  // namespace

std::vector<float> File::read_floats(const std::string& name) const { return read_as<float>(*this, name, H5T_NATIVE_FLOAT); }
std::vector<int32_t> File::read_ints(const std::string& name) const { return read_as<int32_t>(*this, name, H5T_NATIVE_INT32); }

void File::write_floats(const std::string& name, const float* data, const std::vector<int64_t>& shape) {
  write_as(*this, name, data, shape, H5T_IEEE_F32LE, H5T_NATIVE_FLOAT);
}
std::vector<int8_t> File::read_int8(const std::string& name) const { return read_as<int8_t>(*this, name, H5T_NATIVE_INT8); }
void File::write_int8(const std::string& name, const int8_t* data, const std::vector<int64_t>& shape) {
  write_as(*this, name, data, shape, H5T_STD_I8LE, H5T_NATIVE_INT8);
}

namespace {
// A fixed-length UTF-8 string type of n bytes (n >= 1).
Handle string_type(size_t n) {
  Handle type(H5Tcopy(H5T_C_S1), H5Tclose);
  if (!type.valid() || H5Tset_size(type.get(), n) < 0 || H5Tset_cset(type.get(), H5T_CSET_UTF8) < 0) type.reset();
  return type;
}

// A string of at most 1 GiB from a fixed-length string type (a corrupted size must not become a huge allocation).
bool read_string(hid_t type, const std::function<herr_t(hid_t, char*)>& read, std::string& value) {
  if (H5Tget_class(type) != H5T_STRING || H5Tis_variable_str(type) != 0) return false;
  const size_t n = H5Tget_size(type);
  if (n == 0 || n > (size_t(1) << 30)) return false;
  std::string buf(n, '\0');
  if (read(type, buf.data()) < 0) return false;
  value = std::string(buf.c_str());
  return true;
}
}  // namespace

void write_attribute(hid_t obj, const std::string& name, int64_t value) {
  Handle space(H5Screate(H5S_SCALAR), H5Sclose);
  Handle attr(space.valid() ? H5Acreate2(obj, name.c_str(), H5T_STD_I64LE, space.get(), H5P_DEFAULT, H5P_DEFAULT) : -1,
              H5Aclose);
  if (!attr.valid() || H5Awrite(attr.get(), H5T_NATIVE_INT64, &value) < 0 || !attr.close())
    throw SystemError(file_name(obj) + ": cannot write HDF5 attribute " + name);
}

void write_attribute(hid_t obj, const std::string& name, const std::string& value) {
  Handle type = string_type(value.empty() ? 1 : value.size());
  Handle space(H5Screate(H5S_SCALAR), H5Sclose);
  Handle attr(type.valid() && space.valid() ? H5Acreate2(obj, name.c_str(), type.get(), space.get(), H5P_DEFAULT, H5P_DEFAULT) : -1,
              H5Aclose);
  const std::string padded = value.empty() ? std::string(1, '\0') : value;
  if (!attr.valid() || H5Awrite(attr.get(), type.get(), padded.data()) < 0 || !attr.close())
    throw SystemError(file_name(obj) + ": cannot write HDF5 attribute " + name);
}

bool read_attribute(hid_t obj, const std::string& name, int64_t& value) {
  if (H5Aexists(obj, name.c_str()) <= 0) return false;
  Handle attr(H5Aopen(obj, name.c_str(), H5P_DEFAULT), H5Aclose);
  return attr.valid() && H5Aread(attr.get(), H5T_NATIVE_INT64, &value) >= 0;
}

bool read_attribute(hid_t obj, const std::string& name, std::string& value) {
  if (H5Aexists(obj, name.c_str()) <= 0) return false;
  Handle attr(H5Aopen(obj, name.c_str(), H5P_DEFAULT), H5Aclose);
  if (!attr.valid()) return false;
  Handle type(H5Aget_type(attr.get()), H5Tclose);
  return type.valid() && read_string(type.get(), [&](hid_t t, char* buf) { return H5Aread(attr.get(), t, buf); }, value);
}


void write_text(hid_t obj, const std::string& name, const std::string& value) {
  constexpr size_t kAttributeLimit = 60000;  // below the 64 KiB header message limit, with room for the rest
  if (value.size() < kAttributeLimit) return write_attribute(obj, name, value);
  Handle type = string_type(value.size());
  Handle space(H5Screate(H5S_SCALAR), H5Sclose);
  Handle ds(type.valid() && space.valid()
                ? H5Dcreate2(obj, name.c_str(), type.get(), space.get(), H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT)
                : -1,
            close_dataset);
  if (!ds.valid() || H5Dwrite(ds.get(), type.get(), H5S_ALL, H5S_ALL, H5P_DEFAULT, value.data()) < 0 || !ds.close())
    throw SystemError(file_name(obj) + ": cannot write HDF5 dataset " + name);
}

bool read_text(hid_t obj, const std::string& name, std::string& value) {
  if (read_attribute(obj, name, value)) return true;
  if (H5Lexists(obj, name.c_str(), H5P_DEFAULT) <= 0) return false;
  Handle ds(H5Dopen2(obj, name.c_str(), H5P_DEFAULT), H5Dclose);
  if (!ds.valid()) return false;
  Handle type(H5Dget_type(ds.get()), H5Tclose);
  return type.valid() && read_string(type.get(), [&](hid_t t, char* buf) {
    return H5Dread(ds.get(), t, H5S_ALL, H5S_ALL, H5P_DEFAULT, buf);
  }, value);
}

Handle chunk_cache_access(size_t bytes) {
  Handle dapl(H5Pcreate(H5P_DATASET_ACCESS), H5Pclose);
  if (!dapl.valid() || H5Pset_chunk_cache(dapl.get(), 521, bytes, 1.0) < 0)
    throw SystemError("cannot set up an HDF5 chunk cache of " + std::to_string(bytes) + " bytes");
  return dapl;
}

Handle bf16_type() {
  Handle t(H5Tcopy(H5T_IEEE_F32LE), H5Tclose);
  // sign bit 15, exponent bits 7..14, mantissa bits 0..6
  const bool ok = t.valid() && H5Tset_fields(t.get(), 15, 7, 8, 0, 7) >= 0 && H5Tset_offset(t.get(), 0) >= 0 &&
                  H5Tset_precision(t.get(), 16) >= 0 && H5Tset_size(t.get(), 2) >= 0 && H5Tset_ebias(t.get(), 127) >= 0;
  if (!ok) throw SystemError("cannot build the HDF5 bf16 type");
  return t;
}

}  // namespace zero3d::h5
