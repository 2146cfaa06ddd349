// device.cpp (CPU) — see device.hpp. The host is the device: Kokkos starts on its default
// (Serial) space without the command line, which it would answer `--help` on with its own
// 40-line banner before ours.
#include "kernels/device.hpp"

#include <Kokkos_Core.hpp>

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

int64_t device_peak_bytes() { return 0; }

void reset_device_peak() {}

bool is_device_memory(const void*) { return false; }

void fence() {}

}  // namespace zero3d::kernels
