// device.hpp — the device the kernels run on, one implementation per backend (kernels/cpu/,
// kernels/cuda/): which device a rank takes when Kokkos starts, what it is, how much memory
// it has. On a CPU build the "device" is the host and Kokkos starts as it always has.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace zero3d::kernels {

// Whether this binary is the GPU build (CMake's ZERO3D_GPU: a Kokkos with CUDA), for code that
// decides without including Kokkos (the config's checks).
#ifdef ZERO3D_GPU_BUILD
constexpr bool kGpuBuild = true;
#else
constexpr bool kGpuBuild = false;
#endif

// The kind of build a memory plan is for. The kernels run this binary's only (kBuildBackend), but
// their sizing functions answer for either, so that a CPU build on a login node plans a GPU run
// (`zero3d estimate --device gpu`): the GPU's attention kernels, bf16 logits and padded vocabulary.
enum class Backend { Cpu, Gpu };
constexpr Backend kBuildBackend = kGpuBuild ? Backend::Gpu : Backend::Cpu;

struct DeviceInfo {
  std::string backend;  // "CPU: Kokkos Serial, OpenBLAS, oneDNN" or "CUDA 13.0: Kokkos 4.6 Cuda, cuBLASLt, NCCL"
  std::string name;     // the GPU's name; empty on a CPU build
  int id = -1;          // the device this rank uses (-1: the host)
  int visible = 0;      // devices this process sees
  int64_t total_bytes = 0, free_bytes = 0;  // device memory (0 on a CPU build: see available_memory)
};

// The backend this binary was built for, for --version and the start-up lines.
std::string backend_name();

// Why this process cannot run its kernels (a GPU build that sees no GPU), or empty. Asked
// before Kokkos starts, so that every rank can agree on one message.
std::string device_problem();

// Starts Kokkos. A GPU build gives each rank the device of its rank on this node, local_rank
// mod the visible devices (several ranks share a device when there are more ranks than
// devices), before Kokkos would pick one itself.
void initialize_backend(int local_rank, char** argv);

// What the device is now (memory free at the time of the call).
DeviceInfo device_info();

// Whether initialize_backend has run (the planning commands run without it on a login node).
bool backend_started();

// Waits until the device has run everything queued so far: a timer's boundary (kernel launches
// return before the kernels run). Nothing to wait for on a CPU build.
void fence();

// The stream the kernels and products are queued on (a cudaStream_t on a GPU build), for a
// transport on a stream of its own (NCCL) to wait on before it reads what they wrote. Null on a
// CPU build, where a kernel has run by the time its call returns.
void* compute_stream_handle();

// Whether p lies in memory only the device may touch (host code must copy it: kernels/memory.hpp).
// Never on a CPU build, whose model memory is host memory.
bool is_device_memory(const void* p);

// The high-water mark of the device memory Kokkos allocated since start-up (0 on a CPU build,
// where the process's peak resident memory is the measure).
int64_t device_peak_bytes();
// The device memory Kokkos holds allocated now (0 on a CPU build).
int64_t device_live_bytes();
// Restarts that high-water mark at the memory in use now (after a start-up probe's buffers are gone).
void reset_device_peak();

// Page-locks host memory allocated elsewhere (an NVMe bounce buffer from posix_memalign), so
// copies between it and the device run at the link's rate (cudaHostRegister); page_unlock
// before it is freed. Nothing on a CPU build.
void page_lock(void* p, size_t bytes);
void page_unlock(void* p);

// Copies between model memory and host memory on a stream of their own, so that they run while
// the host works (ZeRO-Offload's gradients coming over beside the CPU optimizer, as DeepSpeed's
// stage3.py moves them on a separate stream). A copy starts after the device's work queued so
// far (the compute stream's); wait() returns when every copy queued is done. Host buffers should
// be page-locked (HostBuffer with pinned), else the driver copies through its own. On a CPU build
// each copy happens at once.
class CopyStream {
 public:
  CopyStream();
  ~CopyStream();
  CopyStream(const CopyStream&) = delete;
  CopyStream& operator=(const CopyStream&) = delete;
  void to_host(void* host, const void* device, size_t bytes);
  void to_device(void* device, const void* host, size_t bytes);
  void wait();

 private:
  void* stream_ = nullptr;    // cudaStream_t on a GPU build
  void* computed_ = nullptr;  // cudaEvent_t: the compute stream's work before a copy
};

}  // namespace zero3d::kernels
