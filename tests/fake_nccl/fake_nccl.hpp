// fake_nccl.hpp — an NCCL for the CPU suite (nccl.h, cuda_runtime.h and fake_nccl.cpp here):
// src/parallel/comm_nccl.cpp compiled against it runs the engine's NCCL path over MPI on host
// memory, so that a GPU build's use of NCCL is checked without a GPU. It carries out each call as
// NCCL specifies it and refuses what NCCL leaves undefined or forbids, with a message:
//   - buffers that overlap other than in NCCL's in-place forms (all_gather: send at recv +
//     rank·count; reduce_scatter: recv at send + rank·count; the rest: send == recv);
//   - a call on a stream not ordered after the compute stream since its last call (an event
//     recorded on the kernels' stream and waited on by cudaStreamWaitEvent);
//   - ncclCommSplit inside a group, a communicator from ncclCommInitRank other than the world's,
//     receive buffers of a group that overlap its other buffers, a null buffer with elements.
// Point-to-point is a rendezvous (MPI_Ssend), as NCCL's is; a group's calls start together and
// complete at ncclGroupEnd.
//
// Environment: ZERO3D_FAKE_NCCL_REPORT=DIR writes DIR/rank<R>.txt (the counts below) when the
// world's communicator is destroyed; ZERO3D_FAKE_GPU_SHARED=1 gives every rank one PCI address
// (ranks sharing a GPU, which NCCL refuses).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace fake_nccl {

struct Counts {
  int64_t all_reduce = 0, reduce_scatter = 0, all_gather = 0, reduce = 0, broadcast = 0, send = 0, recv = 0;
  int64_t groups = 0;  // ncclGroupEnd closing an outermost group
  int64_t bytes = 0;   // elements × size of every call's send side
};
Counts counts();

// Ranges cudaPointerGetAttributes calls host memory; every other pointer is device memory.
void set_host_ranges(std::vector<std::pair<const void*, size_t>> ranges);

// The last refusal's message since the last take ("" if none), then forgotten; each refusal is
// also printed to stderr.
std::string take_error();

}  // namespace fake_nccl
