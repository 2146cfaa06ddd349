// device_forms.hpp — what the kernels' device forms (namespace gpu) share: device scratch that
// lives from call to call, column sums in two deterministic stages, and 16-byte accesses.
//
// A column sum over N rows (a bias gradient, LayerNorm's parameter gradient) cannot be one thread
// per column on a GPU: 768 columns are 768 threads (GPU-GAP §3, "catastrophic"). Stage 1 gives
// each (chunk of kColumnChunkRows rows, group of kVec columns, or one column where the widths do
// not allow vectors) a thread that adds its rows in order into partial[chunk·cols + column],
// neighbouring threads reading neighbouring columns (coalesced); stage 2 adds each column's chunk
// sums in a fixed order, a warp a column (llm.c matmul.cuh:17-80, matmul_backward_bias_kernel9
// then reduce_add_sum_kernel). No atomics: the same bits every run. With a single chunk
// (N <= kColumnChunkRows) the order is the CPU forms' own, rows 0..N-1.
//
// Sixteen bytes a load. A GPU keeps HBM busy only with about bandwidth × latency bytes in flight
// (Little's law: 4.8 TB/s × ~0.7 µs ≈ 3.4 MB on an H200), and a thread that loads one float and
// waits holds 4 of them: 2,048 resident threads × 132 SMs × 4 B is 1.1 MB, and the H200 measured
// 1.6 TB/s for such a GELU and 1.4 TB/s for LayerNorm's lane-strided floats against its 3.7 TB/s
// copy (issue 31's per-kernel table). So a device form moves kVec consecutive elements a thread
// with 16-byte loads (llm.c's Packed128, llmc/cuda_utils.cuh) where its pointers and widths allow,
// and element by element where they do not; either way each element's arithmetic is the same.
#pragma once

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <type_traits>

#include "kernels/common.hpp"
#include "kernels/memory.hpp"

// The loop that follows is unrolled n times (nvcc's device pass and GCC each by their own
// spelling; nvcc's host pass knows neither): a thread's independent loads of several iterations
// are then in flight together.
#define ZERO3D_PRAGMA(x) _Pragma(#x)
#if defined(__CUDA_ARCH__)
#define ZERO3D_UNROLL(n) ZERO3D_PRAGMA(unroll n)
#elif defined(__CUDACC__)
#define ZERO3D_UNROLL(n)
#else
#define ZERO3D_UNROLL(n) ZERO3D_PRAGMA(GCC unroll n)
#endif

namespace zero3d::kernels::gpu {

// Elements a device thread moves at a time: 16 bytes of bf16, two 16-byte loads of fp32.
constexpr int kVec = 8;
template <typename T>
struct alignas(16) Vec {
  T v[kVec];
};
// Element-wise device forms take kVec consecutive elements a thread: thread p the elements
// p·kVec .. vector_end(p·kVec, n) − 1.
inline Kokkos::RangePolicy<ExecSpace, Kokkos::IndexType<Index>> vector_threads(Index n) {
  return range((n + kVec - 1) / kVec);
}
KOKKOS_INLINE_FUNCTION Index vector_end(Index i0, Index n) { return i0 + kVec < n ? i0 + kVec : n; }
// The width a kernel's loops take: kVec elements, or one.
template <int W>
using Width = std::integral_constant<int, W>;

KOKKOS_INLINE_FUNCTION bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }
// Whether every pointer is 16-byte aligned (a null one is not read).
template <typename... P>
bool all_aligned16(const P*... p) {
  return (... && (p == nullptr || aligned16(p)));
}
// Whether rows of `cols` elements from these pointers can all be read by whole vectors: each row
// starts 16-byte aligned.
template <typename... P>
bool vectorizable(Index cols, const P*... p) {
  return cols % kVec == 0 && all_aligned16(p...);
}

// On the host, where the CPU suite runs these forms, a vector access off a 16-byte boundary
// stops the process as it would stop a GPU's kernel (CUDA's "misaligned address"), where the
// memcpy standing in for it would pass.
inline void expect_aligned16(const void* p) {
  if (aligned16(p)) return;
  std::fprintf(stderr, "zero3d: a device form's 16-byte vector access at %p is not 16-byte aligned\n", p);
  std::abort();
}

// kVec elements from p (16-byte aligned): a vector load per 16 bytes on a device; memcpy on the
// host.
template <typename T>
KOKKOS_INLINE_FUNCTION Vec<T> load_vec(const T* p) {
#if defined(__CUDA_ARCH__)
  return *reinterpret_cast<const Vec<T>*>(p);
#else
  expect_aligned16(p);
  Vec<T> x;
  std::memcpy(&x, p, sizeof x);
  return x;
#endif
}
template <typename T>
KOKKOS_INLINE_FUNCTION void store_vec(T* p, const Vec<T>& x) {
#if defined(__CUDA_ARCH__)
  *reinterpret_cast<Vec<T>*>(p) = x;
#else
  expect_aligned16(p);
  std::memcpy(p, &x, sizeof x);
#endif
}

// Rows per stage-1 thread: at GPT-2 124M's 16,384 rows (micro-batch 16) × 768 columns, 256
// chunks, 24,576 threads of eight columns each.
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

// Stage 1's thread j of a column sum over N rows and OC columns, W columns a thread (OC a
// multiple of W): columns o0 .. o0 + W − 1 of rows [i0, i1), its partial sums at partial[at ..]
// (chunk·OC + o0). Neighbouring threads take neighbouring columns (coalesced).
template <int W>
struct ColumnChunk {
  Index o0, i0, i1, at;
  KOKKOS_INLINE_FUNCTION ColumnChunk(Index j, Index N, Index OC) {
    const Index groups = OC / W, chunk = j / groups;
    o0 = j % groups * W;
    i0 = chunk * kColumnChunkRows;
    i1 = i0 + kColumnChunkRows < N ? i0 + kColumnChunkRows : N;
    at = chunk * OC + o0;
  }
};
template <int W>
Index column_chunk_threads(Index N, Index OC) {
  return column_chunks(N) * (OC / W);
}

// Stage 2: sums[o] += Σ_k partial[k·cols + o] for k = 0..chunks-1, a column to a row team (a warp
// on a device: its lanes take chunks lane, lane + 32, … and the vector reduction adds their sums
// in a fixed tree), into a fresh sum as the CPU forms add their rows (0 + p is p: one chunk gives
// the CPU form's bits; the host's single lane adds the chunks in order). A thread per column
// made 768 threads of 256 dependent loads each at GPT-2's shapes.
ZERO3D_KERNEL void add_chunk_sums(float* sums, const float* partial, Index chunks, Index cols) {
  Kokkos::parallel_for("column_chunk_sums", row_teams(cols), KOKKOS_LAMBDA(const RowTeam& team) {
    const Index o = team_row(team);
    if (o >= cols) return;
    float s = 0.0f;
    Kokkos::parallel_reduce(
        Kokkos::ThreadVectorRange(team, chunks), [&](Index k, float& acc) { acc += partial[k * cols + o]; }, s);
    Kokkos::single(Kokkos::PerThread(team), [&] { sums[o] += s; });
  });
}

}  // namespace zero3d::kernels::gpu
