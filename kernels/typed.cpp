// typed.cpp — run-time dispatch onto the typed kernels of half.hpp and reduce.hpp.
#include "kernels/typed.hpp"

#include "base/errors.hpp"
#include "kernels/half.hpp"
#include "kernels/reduce.hpp"

namespace zero3d {

using kernels::bf16;
using kernels::fp16;

TypedBuffer::TypedBuffer(const std::string& label, DType type, int64_t n, bool zero, BufferPlace place)
    : type_(type), n_(n), place_(place) {
  if (type != DType::F32 && type != DType::BF16 && type != DType::F16)
    throw SystemError("TypedBuffer " + label + ": unsupported element type " + dtype_name(type));
  const int64_t bytes = n * static_cast<int64_t>(dtype_size(type));
  if (place == BufferPlace::PinnedHost && !kernels::kHostIsDevice) {
    pinned_ = zero ? Kokkos::View<char*, kernels::PinnedHostSpace>(label, bytes)
                   : Kokkos::View<char*, kernels::PinnedHostSpace>(Kokkos::view_alloc(Kokkos::WithoutInitializing, label), bytes);
    data_ = pinned_.data();
    return;
  }
  bytes_ = zero ? Kokkos::View<char*>(label, bytes) : Kokkos::View<char*>(Kokkos::view_alloc(Kokkos::WithoutInitializing, label), bytes);
  data_ = bytes_.data();
}

namespace {
template <typename F>
auto dispatch(DType t, F&& f) {
  switch (t) {
    case DType::BF16: return f(bf16{});
    case DType::F16: return f(fp16{});
    case DType::F32: return f(float{});
    default: throw SystemError("unsupported element type " + dtype_name(t));
  }
}
}  // namespace

void convert_any(void* dst, DType dst_type, const void* src, DType src_type, int64_t n, float scale, bool accumulate) {
  dispatch(dst_type, [&](auto d) {
    using D = decltype(d);
    dispatch(src_type, [&](auto s) {
      using S = decltype(s);
      kernels::convert(static_cast<D*>(dst), static_cast<const S*>(src), n, scale, accumulate);
      return 0;
    });
    return 0;
  });
}

void convert_serial(void* dst, DType dst_type, const void* src, DType src_type, int64_t n, float scale,
                    bool accumulate) {
  dispatch(dst_type, [&](auto d) {
    using D = decltype(d);
    dispatch(src_type, [&](auto s) {
      using S = decltype(s);
      D* out = static_cast<D*>(dst);
      const S* in = static_cast<const S*>(src);
      // convert()'s three loops, each expression as written there (its contraction decides the bits)
      if (accumulate)
        for (int64_t i = 0; i < n; ++i) out[i] = kernels::from_float<D>(kernels::to_float(out[i]) + kernels::to_float(in[i]) * scale);
      else if (scale == 1.0f)
        for (int64_t i = 0; i < n; ++i) out[i] = kernels::from_float<D>(kernels::to_float(in[i]));
      else
        for (int64_t i = 0; i < n; ++i) out[i] = kernels::from_float<D>(kernels::to_float(in[i]) * scale);
      return 0;
    });
    return 0;
  });
}

void convert_on_host(void* dst, DType dst_type, const void* src, DType src_type, int64_t n, float scale,
                     bool accumulate) {
#ifdef ZERO3D_GPU_BUILD
  convert_serial(dst, dst_type, src, src_type, n, scale, accumulate);
#else
  convert_any(dst, dst_type, src, src_type, n, scale, accumulate);
#endif
}

double sum_of_squares_any(const void* x, DType type, int64_t n) {
  return dispatch(type, [&](auto t) {
    using T = decltype(t);
    return kernels::sum_of_squares(static_cast<const T*>(x), n);
  });
}

void zero_any(void* x, DType type, int64_t n) {
  Kokkos::deep_copy(Kokkos::View<char*, Kokkos::MemoryUnmanaged>(static_cast<char*>(x), n * dtype_size(type)), char(0));
}

}  // namespace zero3d
