// device.cpp (CUDA) — see device.hpp. Each rank takes the device of its rank on the node
// (llm.c's multi_gpu_config: local rank → device), set before Kokkos starts so that Kokkos,
// cuBLASLt and NCCL all use it.
#include "kernels/device.hpp"

#include <cuda_runtime.h>

#include <Kokkos_Core.hpp>
#include <algorithm>

namespace zero3d::kernels {

namespace {
int64_t g_peak_bytes = 0;  // the largest device memory in use seen at a device_info() call
}

std::string backend_name() {
  return "CUDA " + std::to_string(CUDART_VERSION / 1000) + "." + std::to_string(CUDART_VERSION / 10 % 100) +
         ": Kokkos " + std::to_string(KOKKOS_VERSION / 10000) + "." + std::to_string(KOKKOS_VERSION / 100 % 100) +
         " Cuda, cuBLASLt, NCCL";
}

std::string device_problem() {
  int visible = 0;
  const cudaError_t e = cudaGetDeviceCount(&visible);
  if (e == cudaSuccess && visible > 0) return "";
  return std::string("no CUDA device is visible (") +
         (e != cudaSuccess ? cudaGetErrorString(e) : "cudaGetDeviceCount found none") +
         "): this is zero3d's GPU build; check CUDA_VISIBLE_DEVICES and the job's GPU request";
}

void initialize_backend(int local_rank, char** argv) {
  int visible = 1;
  cudaGetDeviceCount(&visible);
  const int id = local_rank % visible;
  cudaSetDevice(id);
  Kokkos::InitializationSettings settings;
  settings.set_device_id(id);
  (void)argv;  // Kokkos takes its settings from its environment variables, not our command line
  Kokkos::initialize(settings);
}

DeviceInfo device_info() {
  DeviceInfo d;
  d.backend = backend_name();
  cudaGetDeviceCount(&d.visible);
  cudaGetDevice(&d.id);
  cudaDeviceProp prop{};
  if (cudaGetDeviceProperties(&prop, d.id) == cudaSuccess) d.name = prop.name;
  size_t free_bytes = 0, total_bytes = 0;
  if (cudaMemGetInfo(&free_bytes, &total_bytes) == cudaSuccess) {
    d.free_bytes = static_cast<int64_t>(free_bytes);
    d.total_bytes = static_cast<int64_t>(total_bytes);
    g_peak_bytes = std::max(g_peak_bytes, d.total_bytes - d.free_bytes);
  }
  return d;
}

void fence() { Kokkos::fence("zero3d timer"); }

bool is_device_memory(const void* p) {
  cudaPointerAttributes a{};
  if (cudaPointerGetAttributes(&a, p) != cudaSuccess) {
    cudaGetLastError();  // a pointer the runtime does not know is host memory; clear the error
    return false;
  }
  return a.type == cudaMemoryTypeDevice;
}

int64_t device_peak_bytes() {
  device_info();
  return g_peak_bytes;
}

}  // namespace zero3d::kernels
