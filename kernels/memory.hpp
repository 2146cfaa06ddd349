// memory.hpp — model memory seen from the host. Every model buffer lives in the default
// execution space's memory (device memory on a GPU build, host memory on a CPU build); host
// code reads or writes one only through these copies, and scratch that a kernel reads is
// device scratch, never a std::vector. On a CPU build the copies are memcpy, so nothing moves.
#pragma once

#include <Kokkos_Core.hpp>
#include <cstddef>
#include <cstdint>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "kernels/common.hpp"

namespace zero3d::kernels {

using DeviceSpace = ExecSpace::memory_space;
// Whether model memory is host memory (a CPU build): host staging can then alias it.
constexpr bool kHostIsDevice = std::is_same<DeviceSpace, Kokkos::HostSpace>::value;

namespace detail {
using HostBytes = Kokkos::View<char*, Kokkos::HostSpace, Kokkos::MemoryUnmanaged>;
using DeviceBytes = Kokkos::View<char*, DeviceSpace, Kokkos::MemoryUnmanaged>;
}  // namespace detail

// bytes from model memory into host memory (blocking: the host reads it next).
inline void copy_to_host(void* host, const void* device, size_t bytes) {
  if (bytes == 0) return;
  Kokkos::deep_copy(detail::HostBytes(static_cast<char*>(host), bytes),
                    detail::DeviceBytes(static_cast<char*>(const_cast<void*>(device)), bytes));
}

// bytes from host memory into model memory (blocking: the host may reuse its buffer next).
inline void copy_to_device(void* device, const void* host, size_t bytes) {
  if (bytes == 0) return;
  Kokkos::deep_copy(detail::DeviceBytes(static_cast<char*>(device), bytes),
                    detail::HostBytes(static_cast<char*>(const_cast<void*>(host)), bytes));
}

// bytes within model memory.
inline void copy_on_device(void* dst, const void* src, size_t bytes) {
  if (bytes == 0 || dst == src) return;
  Kokkos::deep_copy(detail::DeviceBytes(static_cast<char*>(dst), bytes),
                    detail::DeviceBytes(static_cast<char*>(const_cast<void*>(src)), bytes));
}

// One value of model memory, for the host (a loss, a norm, a flag a kernel wrote).
template <typename T>
inline T read_one(const T* device) {
  T v{};
  copy_to_host(&v, device, sizeof(T));
  return v;
}

// Bytes in one memory space that move like a std::vector<char> (a staging pool's buffers,
// base/byte_pool.hpp). Contents start undefined, as a reused staging buffer's are.
template <class Space>
class SpaceBytes {
 public:
  SpaceBytes() = default;
  explicit SpaceBytes(size_t bytes) : bytes_(Kokkos::view_alloc(Kokkos::WithoutInitializing, std::string("staging")), bytes) {}
  SpaceBytes(SpaceBytes&& other) noexcept { std::swap(bytes_, other.bytes_); }
  SpaceBytes& operator=(SpaceBytes&& other) noexcept {
    SpaceBytes gone(std::move(other));
    std::swap(bytes_, gone.bytes_);
    return *this;
  }
  char* data() const { return bytes_.data(); }
  size_t size() const { return bytes_.extent(0); }
  bool empty() const { return size() == 0; }

 private:
  Kokkos::View<char*, Space> bytes_;
};

// Bytes in model memory.
using DeviceBuffer = SpaceBytes<DeviceSpace>;

// Staging for buffers that kernels convert: host bytes on a CPU build (what it always used),
// device bytes on a GPU build.
using StagingBuffer = std::conditional_t<kHostIsDevice, std::vector<char>, DeviceBuffer>;

// Page-locked host memory on a GPU build (DeepSpeed's pin_memory: copies to and from the
// device run at the link's rate, without a bounce through a driver buffer); the host's own
// memory on a CPU build.
#if defined(KOKKOS_ENABLE_CUDA)
using PinnedHostSpace = Kokkos::CudaHostPinnedSpace;
#else
using PinnedHostSpace = Kokkos::HostSpace;
#endif

// Host bytes that model memory is copied to and from (the offload tiers, their staging):
// page-locked when `pinned` on a GPU build. Contents start zeroed; grow() keeps none of them.
class HostBuffer {
 public:
  HostBuffer() = default;
  HostBuffer(const std::string& label, size_t bytes, bool pinned) : label_(label), pinned_(pinned) { grow(bytes); }
  char* data() const { return pinned_ ? locked_.data() : plain_.data(); }
  size_t size() const { return pinned_ ? locked_.extent(0) : plain_.extent(0); }
  // At least `bytes`, reallocated (contents undefined) when smaller.
  char* grow(size_t bytes) {
    if (bytes <= size()) return data();
    if (pinned_) locked_ = Kokkos::View<char*, PinnedHostSpace>(label_, bytes);
    else plain_ = Kokkos::View<char*, Kokkos::HostSpace>(label_, bytes);
    return data();
  }

 private:
  std::string label_ = "host_buffer";
  bool pinned_ = false;
  Kokkos::View<char*, Kokkos::HostSpace> plain_;
  Kokkos::View<char*, PinnedHostSpace> locked_;
};

// Page-locked host bytes: a pool's staging between model memory and the host's MPI
// (comm_staged.hpp), so each copy runs at the link's rate.
using PinnedBytes = SpaceBytes<PinnedHostSpace>;

// Host staging for model memory: unused on a CPU build, where model memory is host memory (kept
// the plain vector the CPU suite's injected routes exercise); page-locked on a GPU build.
using HostStagingBuffer = std::conditional_t<kHostIsDevice, std::vector<char>, PinnedBytes>;

// Model memory [src, src + bytes) in `stage` for the host, or the memory itself where the host
// is the device.
inline const char* host_view_of(HostBuffer& stage, const void* src, size_t bytes) {
  if (kHostIsDevice) return static_cast<const char*>(src);
  char* h = stage.grow(bytes);
  copy_to_host(h, src, bytes);
  return h;
}

// Scratch in model memory that grows to the largest request and is then reused, so a training
// step allocates nothing. take() may move it: a pointer is valid until the next take().
class DeviceScratch {
 public:
  explicit DeviceScratch(const char* label) : label_(label) {}
  void* take(int64_t bytes) {
    if (bytes > static_cast<int64_t>(bytes_.extent(0)))
      bytes_ = Kokkos::View<char*, DeviceSpace>(Kokkos::view_alloc(Kokkos::WithoutInitializing, std::string(label_)),
                                                static_cast<size_t>(bytes));
    return bytes_.data();
  }
  template <typename T>
  T* take(int64_t n) {
    return static_cast<T*>(take(n * static_cast<int64_t>(sizeof(T))));
  }
  int64_t capacity() const { return static_cast<int64_t>(bytes_.extent(0)); }
  void release() { bytes_ = Kokkos::View<char*, DeviceSpace>(); }

 private:
  const char* label_;
  Kokkos::View<char*, DeviceSpace> bytes_;
};

// A scratch that lives from call to call (one per Id): a function static, emptied when Kokkos
// finalises, while its memory space still exists (a View freed after Kokkos::finalize aborts).
template <int Id>
inline DeviceScratch& static_scratch(const char* label) {
  static DeviceScratch* s = [label] {
    static DeviceScratch scratch(label);
    Kokkos::push_finalize_hook([] { scratch.release(); });
    return &scratch;
  }();
  return *s;
}

}  // namespace zero3d::kernels
