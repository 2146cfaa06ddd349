// device.cpp (CUDA) — see device.hpp. Each rank takes the device of its rank on the node
// (llm.c's multi_gpu_config: local rank → device), set before Kokkos starts so that Kokkos,
// cuBLASLt and NCCL all use it.
#include "kernels/device.hpp"

#include "base/profiler.hpp"

#include <cuda_runtime.h>

#include <Kokkos_Core.hpp>
#include <algorithm>
#include <atomic>
#include <cstring>
#include <stdexcept>
#include <string>

namespace zero3d::kernels {

namespace {
// Device memory the model holds (every Kokkos allocation in CudaSpace), counted by Kokkos's
// allocation hooks: the figure the memory plan predicts, without the CUDA context or the
// allocator's caches, which cudaMemGetInfo would add.
std::atomic<int64_t> g_live_bytes{0}, g_peak_bytes{0};

bool in_device_space(Kokkos_Profiling_SpaceHandle space) { return std::strcmp(space.name, "Cuda") == 0; }

void on_allocate(Kokkos_Profiling_SpaceHandle space, const char*, const void*, uint64_t bytes) {
  if (!in_device_space(space)) return;
  const int64_t live = g_live_bytes += static_cast<int64_t>(bytes);
  int64_t peak = g_peak_bytes.load();
  while (live > peak && !g_peak_bytes.compare_exchange_weak(peak, live)) {
  }
}

void on_deallocate(Kokkos_Profiling_SpaceHandle space, const char*, const void*, uint64_t bytes) {
  if (in_device_space(space)) g_live_bytes -= static_cast<int64_t>(bytes);
}
}  // namespace

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
  Kokkos::Tools::Experimental::set_allocate_data_callback(on_allocate);
  Kokkos::Tools::Experimental::set_deallocate_data_callback(on_deallocate);
  obs::g_hooks.device_fence = [] { Kokkos::fence("zero3d profiled region"); };
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

bool backend_started() { return Kokkos::is_initialized(); }

void page_lock(void* p, size_t bytes) {
  const cudaError_t e = cudaHostRegister(p, bytes, cudaHostRegisterDefault);
  if (e != cudaSuccess)
    throw std::runtime_error("cannot page-lock " + std::to_string(bytes) + " bytes of swap buffer (cudaHostRegister): " +
                             cudaGetErrorString(e));
}

void page_unlock(void* p) {
  if (cudaHostUnregister(p) != cudaSuccess) cudaGetLastError();  // freed next either way
}

int64_t device_peak_bytes() { return g_peak_bytes.load(); }

int64_t device_live_bytes() { return g_live_bytes.load(); }

void* compute_stream_handle() { return Kokkos::DefaultExecutionSpace().cuda_stream(); }

namespace {
cudaStream_t compute_stream() { return static_cast<cudaStream_t>(compute_stream_handle()); }

void check_copy(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw std::runtime_error(std::string("copy stream: ") + what + ": " + cudaGetErrorString(e));
}

// A copy waits on the compute stream's work so far (the kernels that wrote what it reads, or
// read what it overwrites), not on the host.
void copy_after_compute(cudaStream_t s, cudaEvent_t computed, void* dst, const void* src, size_t bytes,
                        cudaMemcpyKind kind) {
  if (bytes == 0) return;
  check_copy(cudaEventRecord(computed, compute_stream()), "cudaEventRecord");
  check_copy(cudaStreamWaitEvent(s, computed, 0), "cudaStreamWaitEvent");
  check_copy(cudaMemcpyAsync(dst, src, bytes, kind, s), "cudaMemcpyAsync");
}
}  // namespace

CopyStream::CopyStream() {
  cudaStream_t s = nullptr;
  check_copy(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
  cudaEvent_t e = nullptr;
  check_copy(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "cudaEventCreateWithFlags");
  stream_ = s;
  computed_ = e;
}

CopyStream::~CopyStream() {
  cudaStreamSynchronize(static_cast<cudaStream_t>(stream_));
  cudaEventDestroy(static_cast<cudaEvent_t>(computed_));
  cudaStreamDestroy(static_cast<cudaStream_t>(stream_));
}

void CopyStream::to_host(void* host, const void* device, size_t bytes) {
  copy_after_compute(static_cast<cudaStream_t>(stream_), static_cast<cudaEvent_t>(computed_), host, device, bytes,
                     cudaMemcpyDeviceToHost);
}

void CopyStream::to_device(void* device, const void* host, size_t bytes) {
  copy_after_compute(static_cast<cudaStream_t>(stream_), static_cast<cudaEvent_t>(computed_), device, host, bytes,
                     cudaMemcpyHostToDevice);
}

void CopyStream::wait() { check_copy(cudaStreamSynchronize(static_cast<cudaStream_t>(stream_)), "cudaStreamSynchronize"); }

void reset_device_peak() { g_peak_bytes = g_live_bytes.load(); }

}  // namespace zero3d::kernels
