// model_memory.hpp — model memory (device memory on a GPU build) for kernel tests, filled from
// and read back into host vectors, and the elementwise comparison the kernel tests share.
#pragma once

#include <gtest/gtest.h>

#include <Kokkos_Core.hpp>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "base/rng.hpp"
#include "kernels/half.hpp"

namespace test_support {

// Model memory filled from `host`, its data starting `shift` elements into the allocation: a shift
// of one puts it off every 16-byte boundary, as a named view may start at any element of a big
// buffer (the device forms then take elements one at a time, device_forms.hpp).
template <typename T>
class Buffer {
 public:
  explicit Buffer(const std::vector<T>& host, size_t shift = 0)
      : view_(Kokkos::view_alloc(Kokkos::WithoutInitializing, std::string("test_buffer")), host.size() + shift),
        shift_(shift) {
    Kokkos::deep_copy(data_view(),
                      Kokkos::View<const T*, Kokkos::HostSpace, Kokkos::MemoryUnmanaged>(host.data(), host.size()));
  }
  explicit Buffer(size_t n, size_t shift = 0) : Buffer(std::vector<T>(n), shift) {}  // zeros
  T* data() const { return view_.data() + shift_; }
  std::vector<T> host() const {
    std::vector<T> out(view_.extent(0) - shift_);
    Kokkos::deep_copy(Kokkos::View<T*, Kokkos::HostSpace, Kokkos::MemoryUnmanaged>(out.data(), out.size()), data_view());
    return out;
  }

 private:
  Kokkos::View<T*> data_view() const { return Kokkos::subview(view_, Kokkos::make_pair(shift_, view_.extent(0))); }
  Kokkos::View<T*> view_;
  size_t shift_ = 0;
};

// Which one pointer of a kernel test starts one element off a 16-byte boundary (-1: none):
// shift(k) is pointer k's Buffer shift, label() says which in a failure's message.
struct ShiftedPointer {
  int which = -1;
  size_t operator()(int k) const { return which == k ? 1 : 0; }
  std::string label() const { return which >= 0 ? " [pointer " + std::to_string(which) + " shifted]" : ""; }
};

inline double value(float x) { return x; }
inline double value(zero3d::kernels::bf16 x) { return zero3d::kernels::to_float(x); }

// |got - want| <= abs + rel·|want| for every element; the worst element is reported.
template <typename T>
void expect_close(const std::string& what, const std::vector<T>& got, const std::vector<T>& want, double abs,
                  double rel) {
  ASSERT_EQ(got.size(), want.size()) << what;
  size_t worst = 0;
  double worst_excess = 0.0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double excess = std::fabs(value(got[i]) - value(want[i])) - (abs + rel * std::fabs(value(want[i])));
    if (!(excess <= worst_excess)) {  // NaN counts as a failure
      worst = i;
      worst_excess = excess;
    }
  }
  EXPECT_LE(worst_excess, 0.0) << what << ": element " << worst << " is " << value(got[worst]) << ", expected "
                               << value(want[worst]) << " within " << abs << " + " << rel << "·|expected|";
}

// n normal draws from stream `stream` of the generator seeded `seed` (each test file its own
// seed), times scale plus shift.
inline std::vector<float> normal_vector(uint64_t seed, size_t n, uint64_t stream, float scale = 1.0f,
                                        float shift = 0.0f) {
  zero3d::Rng rng(seed, stream);
  std::vector<float> v(n);
  for (auto& x : v) x = shift + static_cast<float>(scale * rng.normal());
  return v;
}

// x rounded to bf16, element by element (a bf16 kernel's input drawn in fp32).
inline std::vector<zero3d::kernels::bf16> bf16_rounded(const std::vector<float>& x) {
  std::vector<zero3d::kernels::bf16> out(x.size());
  for (size_t i = 0; i < x.size(); ++i) out[i] = zero3d::kernels::to_bf16(x[i]);
  return out;
}

// max |a - b| / max(1, |b|)
inline double worst_error(const std::vector<float>& a, const std::vector<float>& b) {
  double worst = 0.0;
  for (size_t i = 0; i < a.size(); ++i)
    worst = std::max(worst, std::fabs(double(a[i]) - b[i]) / std::max(1.0, std::fabs(double(b[i]))));
  return worst;
}

// got equals want bit for bit; the first element that does not is reported.
template <typename T>
void expect_same_bits(const std::string& what, const std::vector<T>& got, const std::vector<T>& want) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t i = 0; i < got.size(); ++i)
    if (std::memcmp(&got[i], &want[i], sizeof(T)) != 0) {
      ADD_FAILURE() << what << ": element " << i << " is " << value(got[i]) << ", expected " << value(want[i])
                    << " bit for bit";
      return;
    }
}

}  // namespace test_support
