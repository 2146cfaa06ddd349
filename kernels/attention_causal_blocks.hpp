// attention_causal_blocks.hpp — the causal attention's products in query blocks, for a GPU.
//
// Dense products over the whole T×T square do twice the causal work; products per (query tile,
// key tile ≤ it) pair do only the causal work but cost a call each (36 pairs of 128-position
// tiles a product at T 1024; 30 ms a layer on an H100). Query blocks take the middle way: the
// queries in about eight row blocks, each product of a query block over the keys up to its end,
// each key block's (dK, dV) over the queries from its start on, one strided-batched call a block
// over every head. With nb blocks that is (nb + 1) / 2nb of the square's products: 56% at nb 8.
// The operands are dense per head ([heads][T][ld]); each block is a strided view of them.
#pragma once

#include <algorithm>

#include "base/dtype.hpp"
#include "kernels/common.hpp"
#include "kernels/gemm.hpp"
#include "kernels/half.hpp"

namespace zero3d::kernels {

// The query blocks: about T/8 rows each, a multiple of 64 (the last block takes what is left),
// at least 64 rows, so a short sequence is one block.
struct CausalBlocks {
  Index rows, count;
  explicit CausalBlocks(Index T) : rows(std::max<Index>(64, ((T + 7) / 8 + 63) / 64 * 64)), count((T + rows - 1) / rows) {}
  Index begin(Index r) const { return r * rows; }
  Index end(Index r, Index T) const { return std::min(T, (r + 1) * rows); }
};

inline DType element_type(const float*) { return DType::F32; }
inline DType element_type(const bf16*) { return DType::BF16; }

// Each head's block of the dense [heads][T][ld] tensor x from row r0 and column c0, as stored or
// read transposed: an operand of a block product over all heads.
template <typename E>
BatchedOperand head_block(const E* x, Index r0, Index c0, Index ld, Index T, bool trans = false) {
  return {{x + r0 * ld + c0, element_type(x), trans, ld}, T * ld};
}

// out = op(A)·op(B) for each of the `heads` heads, out dense per head ([heads][T][ld], fp32).
inline void head_product(Index heads, Index M, Index N, Index K, BatchedOperand A, BatchedOperand B, float* out,
                         Index ld, Index T) {
  gemm_batched_blocks(heads, M, N, K, A, B, out, ld, T * ld, false);
}

}  // namespace zero3d::kernels
