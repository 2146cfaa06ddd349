// cuda_runtime.h (fake) — the CUDA runtime calls src/parallel/comm_nccl.cpp makes, for its build
// against fake_nccl.cpp in the CPU suite. Streams and events keep only what the fake checks: that
// each NCCL call's stream was ordered after the compute stream (the kernels that wrote its inputs).
// Memory is host memory; cudaPointerGetAttributes calls it device memory (fake_nccl.hpp).
#pragma once

#include <cstddef>

enum cudaError { cudaSuccess = 0, cudaErrorInvalidValue = 1, cudaErrorNotReady = 600 };
typedef enum cudaError cudaError_t;
typedef struct FakeCudaStream* cudaStream_t;
typedef struct FakeCudaEvent* cudaEvent_t;

#define cudaStreamNonBlocking 0x01
#define cudaEventDisableTiming 0x02

enum cudaMemoryType { cudaMemoryTypeUnregistered = 0, cudaMemoryTypeHost = 1, cudaMemoryTypeDevice = 2, cudaMemoryTypeManaged = 3 };
struct cudaPointerAttributes {
  enum cudaMemoryType type;
  int device;
  void* devicePointer;
  void* hostPointer;
};

cudaError_t cudaStreamCreateWithFlags(cudaStream_t* stream, unsigned int flags);
cudaError_t cudaStreamDestroy(cudaStream_t stream);
cudaError_t cudaStreamSynchronize(cudaStream_t stream);
cudaError_t cudaStreamWaitEvent(cudaStream_t stream, cudaEvent_t event, unsigned int flags);
cudaError_t cudaEventCreateWithFlags(cudaEvent_t* event, unsigned int flags);
cudaError_t cudaEventRecord(cudaEvent_t event, cudaStream_t stream);
cudaError_t cudaEventQuery(cudaEvent_t event);
cudaError_t cudaEventSynchronize(cudaEvent_t event);
cudaError_t cudaEventDestroy(cudaEvent_t event);
cudaError_t cudaPointerGetAttributes(cudaPointerAttributes* attributes, const void* ptr);
cudaError_t cudaGetLastError();
const char* cudaGetErrorString(cudaError_t error);
cudaError_t cudaGetDevice(int* device);
cudaError_t cudaDeviceGetPCIBusId(char* bus_id, int len, int device);
