// model_memory.hpp — model memory (device memory on a GPU build) for kernel tests, filled from
// and read back into host vectors.
#pragma once

#include <Kokkos_Core.hpp>
#include <string>
#include <vector>

namespace test_support {

template <typename T>
class Buffer {
 public:
  explicit Buffer(const std::vector<T>& host)
      : view_(Kokkos::view_alloc(Kokkos::WithoutInitializing, std::string("test_buffer")), host.size()) {
    Kokkos::deep_copy(view_,
                      Kokkos::View<const T*, Kokkos::HostSpace, Kokkos::MemoryUnmanaged>(host.data(), host.size()));
  }
  explicit Buffer(size_t n) : Buffer(std::vector<T>(n)) {}  // zeros
  T* data() const { return view_.data(); }
  std::vector<T> host() const {
    std::vector<T> out(view_.extent(0));
    Kokkos::deep_copy(Kokkos::View<T*, Kokkos::HostSpace, Kokkos::MemoryUnmanaged>(out.data(), out.size()), view_);
    return out;
  }

 private:
  Kokkos::View<T*> view_;
};

}  // namespace test_support
