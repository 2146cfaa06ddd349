// device_forms.hpp — what the kernels' device forms (namespace gpu) share: device scratch that
// lives from call to call, and column sums in two deterministic stages.
//
// A column sum over N rows (a bias gradient, LayerNorm's parameter gradient) cannot be one thread
// per column on a GPU: 768 columns are 768 threads (GPU-GAP §3, "catastrophic"). Stage 1 gives
// each (chunk of kColumnChunkRows rows, column) pair a thread that adds its rows in order into
// partial[chunk·cols + column], neighbouring threads reading neighbouring columns (coalesced);
// stage 2 adds each column's chunk sums in chunk order (llm.c matmul.cuh:17-80,
// matmul_backward_bias_kernel9 then reduce_add_sum_kernel). No atomics: the same bits every run.
// With a single chunk (N <= kColumnChunkRows) the order is the CPU forms' own, rows 0..N-1.
#pragma once

#include <memory>
#include <string>

#include "kernels/common.hpp"
#include "kernels/memory.hpp"

namespace zero3d::kernels::gpu {

// Rows per stage-1 thread: at GPT-2's 8192 rows × 768 columns, 98k threads of 64 loads each.
constexpr Index kColumnChunkRows = 64;

inline Index column_chunks(Index rows) { return (rows + kColumnChunkRows - 1) / kColumnChunkRows; }

// Partial sums and sort keys of the device forms, in model memory: grown to the largest request
// and then reused, so a step allocates nothing (a View per call would be a cudaMalloc and a
// synchronising cudaFree). A pointer is valid until the next call; the kernels of one stream
// run in order, so the next kernel's growth cannot free what an earlier one still reads
// (cudaFree waits for the device).
template <typename T>
inline T* kernel_scratch(Index n) {
  return static_scratch<0>("kernel_partials").take<T>(n);
}

// Stage 2: sums[o] += Σ_k partial[k·cols + o] for k = 0..chunks-1 in order, into a fresh sum as
// the CPU forms add their rows (0 + p is p: one chunk gives the CPU form's bits).
ZERO3D_KERNEL void add_chunk_sums(float* sums, const float* partial, Index chunks, Index cols) {
  Kokkos::parallel_for("column_chunk_sums", range(cols), KOKKOS_LAMBDA(Index o) {
    float s = 0.0f;
    for (Index k = 0; k < chunks; ++k) s += partial[k * cols + o];
    sums[o] += s;
  });
}

}  // namespace zero3d::kernels::gpu
