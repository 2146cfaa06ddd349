// gemm.hpp — the model's matrix products, with the parameters in their stored type.
//
// C[M,N] = op(A)·op(B) (+ C when accumulate). A is an fp32 activation; B is a weight in the
// parameter dtype (fp32, bf16 or fp16) or another fp32 activation. `compute` picks the
// arithmetic: F32 runs OpenBLAS sgemm (16-bit weights are widened first); BF16 rounds both
// operands to bf16 and multiplies with fp32 accumulation — through oneDNN's AVX512-BF16
// kernels when zero3d was built with oneDNN (about 4x sgemm on one Zen 4 core), otherwise
// with sgemm on the rounded values (same inputs, slower).
#pragma once

#include <cstdint>
#include <string>

#include "dtype.hpp"

namespace zero3d {

struct GemmOperand {
  const void* data;
  DType type;      // F32, BF16 or F16
  bool trans;      // op(X) = Xᵀ
  int64_t ld;      // leading dimension of X as stored (row-major)
};

void gemm(int64_t M, int64_t N, int64_t K, GemmOperand A, GemmOperand B, float* C, int64_t ldc, bool accumulate,
          DType compute);

// x as the products in `compute` read it (bf16 operands for BF16; x itself for F32),
// converted once into a workspace slot of its own: an operand that feeds two products (dout
// in a linear layer's backward) is converted once. Valid until the next gemm_operand call.
GemmOperand gemm_operand(GemmOperand x, int64_t elems, DType compute);

// "oneDNN bf16 (AVX512-BF16)" or "sgemm on bf16-rounded operands" / "OpenBLAS sgemm".
std::string gemm_path(DType compute);
// Bytes of conversion scratch the products have needed so far (the model's gemm workspace).
int64_t gemm_workspace_bytes();

}  // namespace zero3d
