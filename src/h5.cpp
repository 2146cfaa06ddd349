// h5.cpp — checked HDF5 file, dataset read and write.
#include "h5.hpp"

#include <sys/stat.h>

#include "base.hpp"

namespace zero3d::h5 {

void quiet_errors() { H5Eset_auto2(H5E_DEFAULT, nullptr, nullptr); }

File File::open_read(const std::string& path) {
  quiet_errors();
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) throw InputError(path + ": file not found");
  if (H5Fis_hdf5(path.c_str()) <= 0) throw InputError(path + ": not an HDF5 file");
  hid_t id = H5Fopen(path.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT);
  if (id < 0) throw InputError(path + ": cannot open HDF5 file");
  return File(id, path);
}

File File::create(const std::string& path) {
  quiet_errors();
  hid_t id = H5Fcreate(path.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT);
  if (id < 0) throw SystemError(path + ": cannot create HDF5 file");
  return File(id, path);
}

bool File::has(const std::string& name) const {
  return H5Lexists(id(), name.c_str(), H5P_DEFAULT) > 0;
}

std::vector<int64_t> File::shape(const std::string& name) const {
  Handle ds(H5Dopen2(id(), name.c_str(), H5P_DEFAULT), H5Dclose);
  if (ds.get() < 0) throw InputError(path_ + ": no dataset `" + name + "`");
  Handle space(H5Dget_space(ds.get()), H5Sclose);
  int rank = H5Sget_simple_extent_ndims(space.get());
  std::vector<hsize_t> dims(static_cast<size_t>(rank > 0 ? rank : 0));
  if (rank > 0) H5Sget_simple_extent_dims(space.get(), dims.data(), nullptr);
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
  if (H5Dread(ds.get(), mem_type, H5S_ALL, H5S_ALL, H5P_DEFAULT, out.data()) < 0)
    throw InputError(f.path() + ": cannot read dataset `" + name + "` (corrupt or not numeric)");
  return out;
}

void write_as(File& f, const std::string& name, const void* data, const std::vector<int64_t>& shape, hid_t file_type,
              hid_t mem_type) {
  std::vector<hsize_t> dims(shape.begin(), shape.end());
  Handle space(H5Screate_simple(static_cast<int>(dims.size()), dims.data(), nullptr), H5Sclose);
  Handle lcpl(H5Pcreate(H5P_LINK_CREATE), H5Pclose);
  H5Pset_create_intermediate_group(lcpl.get(), 1);
  Handle ds(H5Dcreate2(f.id(), name.c_str(), file_type, space.get(), lcpl.get(), H5P_DEFAULT, H5P_DEFAULT),
            H5Dclose);
  if (ds.get() < 0 || H5Dwrite(ds.get(), mem_type, H5S_ALL, H5S_ALL, H5P_DEFAULT, data) < 0)
    throw SystemError(f.path() + ": cannot write dataset `" + name + "`");
}
}  // namespace

std::vector<float> File::read_floats(const std::string& name) const { return read_as<float>(*this, name, H5T_NATIVE_FLOAT); }
std::vector<int32_t> File::read_ints(const std::string& name) const { return read_as<int32_t>(*this, name, H5T_NATIVE_INT32); }

void File::write_floats(const std::string& name, const float* data, const std::vector<int64_t>& shape) {
  write_as(*this, name, data, shape, H5T_IEEE_F32LE, H5T_NATIVE_FLOAT);
}

void write_attribute(hid_t obj, const std::string& name, int64_t value) {
  Handle space(H5Screate(H5S_SCALAR), H5Sclose);
  Handle attr(H5Acreate2(obj, name.c_str(), H5T_STD_I64LE, space.get(), H5P_DEFAULT, H5P_DEFAULT), H5Aclose);
  if (attr.get() < 0 || H5Awrite(attr.get(), H5T_NATIVE_INT64, &value) < 0)
    throw SystemError("cannot write HDF5 attribute " + name);
}

void write_attribute(hid_t obj, const std::string& name, const std::string& value) {
  Handle type(H5Tcopy(H5T_C_S1), H5Tclose);
  H5Tset_size(type.get(), value.empty() ? 1 : value.size());
  H5Tset_cset(type.get(), H5T_CSET_UTF8);
  Handle space(H5Screate(H5S_SCALAR), H5Sclose);
  Handle attr(H5Acreate2(obj, name.c_str(), type.get(), space.get(), H5P_DEFAULT, H5P_DEFAULT), H5Aclose);
  const std::string padded = value.empty() ? std::string(1, '\0') : value;
  if (attr.get() < 0 || H5Awrite(attr.get(), type.get(), padded.data()) < 0)
    throw SystemError("cannot write HDF5 attribute " + name);
}

bool read_attribute(hid_t obj, const std::string& name, int64_t& value) {
  if (H5Aexists(obj, name.c_str()) <= 0) return false;
  Handle attr(H5Aopen(obj, name.c_str(), H5P_DEFAULT), H5Aclose);
  return H5Aread(attr.get(), H5T_NATIVE_INT64, &value) >= 0;
}

bool read_attribute(hid_t obj, const std::string& name, std::string& value) {
  if (H5Aexists(obj, name.c_str()) <= 0) return false;
  Handle attr(H5Aopen(obj, name.c_str(), H5P_DEFAULT), H5Aclose);
  Handle type(H5Aget_type(attr.get()), H5Tclose);
  const size_t n = H5Tget_size(type.get());
  std::string buf(n, '\0');
  if (H5Aread(attr.get(), type.get(), buf.data()) < 0) return false;
  value = std::string(buf.c_str());
  return true;
}

hid_t bf16_type() {
  hid_t t = H5Tcopy(H5T_IEEE_F32LE);
  H5Tset_fields(t, 15, 7, 8, 0, 7);  // sign bit 15, exponent bits 7..14, mantissa bits 0..6
  H5Tset_offset(t, 0);
  H5Tset_precision(t, 16);
  H5Tset_size(t, 2);
  H5Tset_ebias(t, 127);
  return t;
}

}  // namespace zero3d::h5
