// device.cpp (CPU) — see device.hpp. The host is the device: Kokkos starts on its default
// (Serial) space without the command line, which it would answer `--help` on with its own
// 40-line banner before ours.
#include "kernels/device.hpp"

#include <Kokkos_Core.hpp>
#include <cstring>

namespace zero3d::kernels {

std::string backend_name() {
#ifdef ZERO3D_HAVE_ONEDNN
  return "CPU: Kokkos Serial, OpenBLAS, oneDNN";
#else
  return "CPU: Kokkos Serial, OpenBLAS";
#endif
}

std::string device_problem() { return ""; }

void initialize_backend(int, char** argv) {
  int kokkos_argc = 1;
  Kokkos::initialize(kokkos_argc, argv);
}

DeviceInfo device_info() { return DeviceInfo{backend_name(), "", -1, 0, 0, 0}; }

bool backend_started() { return Kokkos::is_initialized(); }

void page_lock(void*, size_t) {}

void page_unlock(void*) {}

int64_t device_peak_bytes() { return 0; }

int64_t device_live_bytes() { return 0; }

void reset_device_peak() {}

bool is_device_memory(const void*) { return false; }

void* compute_stream_handle() { return nullptr; }

void fence() {}

// Model memory is host memory: a copy is a memcpy, done when it returns.
CopyStream::CopyStream() = default;
CopyStream::~CopyStream() = default;
void CopyStream::to_host(void* host, const void* device, size_t bytes) {
  if (bytes > 0 && host != device) std::memcpy(host, device, bytes);
}
void CopyStream::to_device(void* device, const void* host, size_t bytes) {
  if (bytes > 0 && host != device) std::memcpy(device, host, bytes);
}
void CopyStream::wait() {}

}  // namespace zero3d::kernels
