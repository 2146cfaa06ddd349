// mma_sync.hpp (CUDA) — the PTX instructions under the fused attention
// (attention_flash_bf16_kernels.hpp), each by its PTX ISA name and contract: the warp-level
// products and matrix loads, the softmax's exponential, every access the kernels make to shared
// memory, the asynchronous copies into it, and the block's dynamic shared memory. A build with ZERO3D_WARP_SIMULATION set to a header's name takes that header's host
// simulation of the same functions instead (tests/cuda_sim: the kernels then run on a CPU,
// against a reference and the checks of racecheck and memcheck, where no GPU is).
#pragma once

#include <cuda_bf16.h>
#include <vector_types.h>

#include <cstdint>

#ifdef ZERO3D_WARP_SIMULATION
#include ZERO3D_WARP_SIMULATION
#else
namespace zero3d::kernels::cuda_ptx {

// mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32: c (16×8, fp32) += a (16×16, row) ·
// b (16×8, col) over the warp. Lane 4g + t holds a's rows g, g + 8 at columns 2t, 2t + 1 and
// 2t + 8, 2t + 9 (a[0]: row g, a[1]: row g + 8, a[2], a[3] the same at + 8 columns); b's column g
// at rows 2t, 2t + 1 (b0) and 2t + 8, 2t + 9 (b1); c's rows g (c[0], c[1]) and g + 8 (c[2], c[3])
// at columns 2t, 2t + 1. A register's lower half holds the lower column (or row) index.
__device__ inline void mma_bf16_16x8x16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16: lane l names, in `row`, row l % 8 of 8×8 matrix
// l / 8 (8 consecutive 16-bit elements, 16-byte aligned shared memory); m[i] of lane 4g + t is
// matrix i's elements [2t][g] (lower half) and [2t + 1][g]: the matrix transposed.
__device__ inline void ldmatrix_x4_trans(uint32_t (&m)[4], const __nv_bfloat16* row) {
  const auto addr = static_cast<uint32_t>(__cvta_generic_to_shared(row));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(m[0]), "=r"(m[1]), "=r"(m[2]), "=r"(m[3])
               : "r"(addr));
}

// ldmatrix.sync.aligned.m8n8.x4.shared.b16: the same rows named, untransposed: m[i] of lane 4g + t
// is matrix i's elements [g][2t] (lower half) and [g][2t + 1], the layout of mma's A and B
// fragments, so an A fragment's four registers come in one instruction where 32-bit loads took four.
__device__ inline void ldmatrix_x4(uint32_t (&m)[4], const __nv_bfloat16* row) {
  const auto addr = static_cast<uint32_t>(__cvta_generic_to_shared(row));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(m[0]), "=r"(m[1]), "=r"(m[2]), "=r"(m[3])
               : "r"(addr));
}

// ldmatrix.sync.aligned.m8n8.x2.shared.b16: two matrices, their rows named by lanes 0-15 (the other
// lanes' addresses are not read), delivered as ldmatrix_x4's first two: a B fragment.
__device__ inline void ldmatrix_x2(uint32_t (&m)[2], const __nv_bfloat16* row) {
  const auto addr = static_cast<uint32_t>(__cvta_generic_to_shared(row));
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0, %1}, [%2];" : "=r"(m[0]), "=r"(m[1]) : "r"(addr));
}

// st.shared.v4.b32: eight bf16 into shared memory (16-byte aligned), a tile's row chunk.
__device__ inline void st_shared_b128(__nv_bfloat16* p, uint4 v) { *reinterpret_cast<uint4*>(p) = v; }

// ex2.approx.ftz.f32: 2^x on the special-function unit alone. exp2f without fast math compiles to
// ex2.approx.f32, whose subnormal range costs a scaling before and after; the softmax's
// probabilities below 2^-126 (0 here) are 0 in bf16's rounding of P anyway (FlashAttention-2 builds
// with --use_fast_math for the same instruction).
__device__ inline float ex2_approx(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// ld.shared.f32 / st.shared.f32: one float of shared memory (a block's per-query L and D).
__device__ inline float ld_shared_f32(const float* p) { return *p; }
__device__ inline void st_shared_f32(float* p, float v) { *p = v; }

// cp.async.cg.shared.global: 16 bytes from global memory into shared memory (both 16-byte
// aligned) without passing through registers, landing later (sm_80+): the next tile's copy is in
// flight while the warps compute on this one. src_bytes < 16 fills the rest with zeros (0: a row
// past the sequence, nothing read). The copy is the issuing thread's until cp_async_wait says it
// has landed; other threads see it after a __syncthreads that follows.
__device__ inline void cp_async_16(__nv_bfloat16* dst, const __nv_bfloat16* src, int src_bytes) {
  const auto addr = static_cast<uint32_t>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(addr), "l"(src), "r"(src_bytes) : "memory");
}
// cp.async.commit_group: the thread's copies issued since the last commit form one group.
__device__ inline void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
// cp.async.wait_group N: returns once at most the N most recent of the thread's groups are in flight.
template <int N>
__device__ inline void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

// The block's dynamic shared memory (the launch's third argument).
__device__ inline unsigned char* dynamic_smem() {
  extern __shared__ __align__(128) unsigned char smem[];
  return smem;
}

}  // namespace zero3d::kernels::cuda_ptx
#endif
