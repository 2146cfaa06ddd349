// gemm.hpp — the model's matrix products, with the parameters in their stored type.
//
// C[M,N] = op(A)·op(B) (+ C when accumulate). A is an fp32 activation; B is a weight in the
// parameter dtype (fp32, bf16 or fp16) or another fp32 activation. `compute` picks the
// arithmetic: F32 runs OpenBLAS sgemm (16-bit weights are widened first); BF16 rounds both
// operands to bf16 and multiplies with fp32 accumulation — through oneDNN's AVX512-BF16
// kernels when zero3d was built with oneDNN (about 4x sgemm on one Zen 4 core), otherwise
// with sgemm on the rounded values (same inputs, slower); F16 (torch_autocast's fp16 products)
// rounds both operands to fp16 and runs sgemm on the rounded values (this CPU has no fp16
// products). An fp32 bias of a 16-bit product is rounded to its dtype first.
#pragma once

#include <cstdint>
#include <string>

#include "base/dtype.hpp"

namespace zero3d {
namespace kernels {
struct bf16;
}

struct GemmOperand {
  const void* data;
  DType type;      // F32, BF16 or F16
  bool trans;      // op(X) = Xᵀ
  int64_t ld;      // leading dimension of X as stored (row-major)
};

// bias (bias_type F32, BF16 or F16; null: none) adds bias[n] to every row: in oneDNN's epilogue
// for BF16 (before `accumulate` adds the old C), a pass over C after sgemm otherwise. An fp32 A
// read transposed is rounded into its transposed layout for BF16 (the plain layout multiplies
// ~12% faster, and it is converted anyway).
void gemm(int64_t M, int64_t N, int64_t K, GemmOperand A, GemmOperand B, float* C, int64_t ldc, bool accumulate,
          DType compute, const void* bias = nullptr, DType bias_type = DType::F32);

// C[M,N] = A·B (+ bias) rounded to bf16 (dense C): a product whose only reader wants bf16, so
// the fp32 result is never written (the MLP's c_fc output, which GELU reads). A is bf16 (no
// rounding of its own: it is an activation kept in bf16) and not transposed; B either way round
// (a Conv1D weight as stored, an nn.Linear weight transposed); compute is BF16.
void gemm_bf16_output(int64_t M, int64_t N, int64_t K, GemmOperand A, GemmOperand B, kernels::bf16* C,
                      const void* bias = nullptr, DType bias_type = DType::F32);

// C[M,N] = A·B + bias + R (R fp32 [M][N], C dense fp32): a residual added in the product's
// epilogue (oneDNN's binary post-op) where copying R into C and accumulating the product onto
// it made an extra pass over C; the same bits (the epilogue adds R to the same A·B + bias).
// A is bf16 and not transposed, B either way round; compute is BF16.
void gemm_adding(int64_t M, int64_t N, int64_t K, GemmOperand A, GemmOperand B, float* C, const float* R,
                 const void* bias = nullptr, DType bias_type = DType::F32);

// `batch` independent products over dense bf16 operands with fp32 results, for attention's
// tiles: C_b = op(A_b)·op(B_b) (+ C_b when accumulate), where A_b starts at A + b·M·K (stored
// M×K, or K×M when ta), B_b at B + b·K·N (K×N, or N×K when tb) and C_b at C + b·M·N (M×N),
// in elements. oneDNN's batched brgemm when built with it (dense operands are what lets it pick
// brgemm), else sgemm per problem on the widened values. MACs are counted by the caller.
void gemm_batched_bf16(int64_t batch, int64_t M, int64_t N, int64_t K, const void* A, bool ta, const void* B, bool tb,
                       float* C, bool accumulate);

// The same over dense fp32 operands, each product in fp32 (the fp32 attention's batched form):
// sgemm per problem on the CPU, one strided-batched cuBLASLt call on the GPU.
void gemm_batched(int64_t batch, int64_t M, int64_t N, int64_t K, const float* A, bool ta, const float* B, bool tb,
                  float* C, bool accumulate);

// One operand of a batch of products over blocks of larger matrices: the first problem's
// operand as a GemmOperand (ld its row stride as stored), the next problems' `stride` (> 0)
// elements on.
struct BatchedOperand {
  GemmOperand x;
  int64_t stride;
};

// `batch` products over blocks of larger operands, fp32 results: C_b[M,N] (row stride ldc, at
// C + b·stride_c) = op(A_b)·op(B_b) (+ C_b when accumulate). A and B both F32 (an fp32 product)
// or both BF16 (fp32 accumulation). The causal attention's products over the key blocks a query
// block sees: one strided-batched cuBLASLt call on the GPU; sgemm per problem on the CPU, where
// only the device forms' tests call it. MACs are counted by the caller.
void gemm_batched_blocks(int64_t batch, int64_t M, int64_t N, int64_t K, BatchedOperand A, BatchedOperand B, float* C,
                         int64_t ldc, int64_t stride_c, bool accumulate);
// Why gemm_batched_blocks cannot take these operands (null when it can): both builds' forms ask.
inline const char* batched_blocks_refusal(const BatchedOperand& A, const BatchedOperand& B, int64_t stride_c) {
  if (A.x.type != B.x.type || (A.x.type != DType::F32 && A.x.type != DType::BF16)) return "operands both fp32 or both bf16";
  if (A.stride <= 0 || B.stride <= 0 || stride_c <= 0) return "strides must be positive";
  return nullptr;
}

// x as the products in `compute` read it (bf16 operands for BF16; x itself for F32),
// converted once into a workspace slot of its own: an operand that feeds two products (dout
// in a linear layer's backward) is converted once. Valid until the next gemm_operand call.
// column_sums (x plain and dense, `elems` = rows·x.ld): Σ over x's rows added into it, for BF16
// in the same pass over memory as the rounding (a linear layer's bias gradient).
GemmOperand gemm_operand(GemmOperand x, int64_t elems, DType compute, float* column_sums = nullptr);

// A bf16 operand of rows×ld elements for the caller to fill (a kernel that makes a product's
// operand in bf16 directly, such as GELU's backward): gemm_operand's slot, valid as long.
GemmOperand gemm_operand_slot(int64_t rows, int64_t ld);

// "oneDNN bf16 (AVX512-BF16)" or "sgemm on bf16-rounded operands" / "OpenBLAS sgemm".
std::string gemm_path(DType compute);
// Bytes of conversion scratch the products have needed so far (the model's gemm workspace).
int64_t gemm_workspace_bytes();

}  // namespace zero3d
