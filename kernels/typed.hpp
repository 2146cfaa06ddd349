// typed.hpp — flat buffers whose element type is chosen at run time (fp32, bf16, fp16), and
// the element-wise operations ZeRO needs on them. Kernels stay templates over the type;
// these functions dispatch once per call, not per element.
#pragma once

#include <Kokkos_Core.hpp>
#include <cstdint>
#include <string>

#include "base/dtype.hpp"
#include "kernels/memory.hpp"

namespace zero3d {

// Where a TypedBuffer lives: model memory (the device's), or page-locked host memory that the
// device's kernels read and write in place over the bus (unified addressing: offload_param cpu's
// partition). On a CPU build both are host memory.
enum class BufferPlace { Model, PinnedHost };

class TypedBuffer {
 public:
  TypedBuffer() = default;
  TypedBuffer(const std::string& label, DType type, int64_t n, bool zero = true, BufferPlace place = BufferPlace::Model);
  void* data() const { return data_; }
  DType type() const { return type_; }
  int64_t size() const { return n_; }
  int64_t bytes() const { return n_ * static_cast<int64_t>(dtype_size(type_)); }
  // Address of element i.
  void* at(int64_t i) const { return data_ + i * static_cast<int64_t>(dtype_size(type_)); }
  template <typename T>
  T* as() const {
    return reinterpret_cast<T*>(data_);
  }
  BufferPlace place() const { return place_; }

 private:
  Kokkos::View<char*> bytes_;
  Kokkos::View<char*, kernels::PinnedHostSpace> pinned_;  // BufferPlace::PinnedHost on a GPU build
  char* data_ = nullptr;
  DType type_ = DType::F32;
  int64_t n_ = 0;
  BufferPlace place_ = BufferPlace::Model;
};

// dst[i] (=|+=) src[i]·scale, computed in fp32, rounded once to dst's type (RNE).
void convert_any(void* dst, DType dst_type, const void* src, DType src_type, int64_t n, float scale = 1.0f,
                 bool accumulate = false);
// convert_any for host memory (the offload tiers, checkpoint chunks): the same arithmetic,
// run by the host thread. On a CPU build host memory is model memory and it is convert_any;
// on a GPU build a kernel could not read pageable host memory.
void convert_on_host(void* dst, DType dst_type, const void* src, DType src_type, int64_t n, float scale = 1.0f,
                     bool accumulate = false);
// The host loop itself, on every build (its bits are convert_any's: tested on the CPU build).
void convert_serial(void* dst, DType dst_type, const void* src, DType src_type, int64_t n, float scale = 1.0f,
                    bool accumulate = false);
// Σ x² in fp64 (inf/NaN propagate).
double sum_of_squares_any(const void* x, DType type, int64_t n);
void zero_any(void* x, DType type, int64_t n);

}  // namespace zero3d
