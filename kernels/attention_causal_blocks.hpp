// attention_causal_blocks.hpp — the causal attention's products in query blocks, for a GPU.
//
// Dense products over the whole T×T square do twice the causal work; products per (query tile,
// key tile ≤ it) pair do only the causal work but cost a call each (36 pairs of 128-position
// tiles a product at T 1024; 30 ms a layer on an H100). Query blocks take the middle way: the
// queries in about eight row blocks, each product of a query block over the keys it sees (from
// its first row's window start to its last row), each key block's gradient over the queries that
// see it, one strided-batched call a block (and query head of a group) over every K/V head. With
// nb blocks and no window that is (nb + 1) / 2nb of the square's products: 56% at nb 8.
#pragma once

#include <algorithm>

#include "base/dtype.hpp"
#include "kernels/attention_window.hpp"
#include "kernels/common.hpp"
#include "kernels/gemm.hpp"
#include "kernels/half.hpp"
#include "kernels/matmul.hpp"  // dtype_of

namespace zero3d::kernels {

// The query blocks: about T/8 rows each, a multiple of 64 (the last block takes what is left),
// at least 64 rows, so a short sequence is one block.
struct CausalBlocks {
  Index rows, count;
  explicit CausalBlocks(Index T) : rows(std::max<Index>(64, ((T + 7) / 8 + 63) / 64 * 64)), count((T + rows - 1) / rows) {}
  Index begin(Index r) const { return r * rows; }
  Index end(Index r, Index T) const { return std::min(T, (r + 1) * rows); }
};

// The six products of causal attention for `groups` K/V heads, each read by G query heads (G 1:
// multi-head attention), over T positions of head size d, with a sliding window (0: none).
// Query-side tensors are dense [groups·G][T][d], key-side ones [groups][T][d], scores
// [groups·G][T][T]; results are fp32. Scores are made only over the keys a query block sees, and
// the products that read them read only those, so the softmax must write zeros at the keys a row
// does not see inside them (causal_softmax_row does). Each call is batched over the groups.
struct CausalProducts {
  Index groups, G, T, d, window;
  CausalBlocks blocks;
  CausalProducts(Index groups_, Index G_, Index T_, Index d_, Index window_ = 0)
      : groups(groups_), G(G_), T(T_), d(d_), window(window_), blocks(T_) {}

  // S = A·Bᵀ over each query block's keys: S = Q·Kᵀ, and dP = dY·Vᵀ.
  template <typename E>
  void scores(float* s, const E* a, const E* b) const {
    for (Index r = 0; r < blocks.count; ++r) {
      const Index r0 = blocks.begin(r), r1 = blocks.end(r, T), k0 = gqa_first_key(r0, window);
      for (Index h = 0; h < G; ++h)
        gemm_batched_blocks(groups, r1 - r0, r1 - k0, d, query_side(a, h, r0), key_side(b, k0, true),
                            s + (h * T + r0) * T + k0, T, G * T * T, false);
    }
  }
  // Y = P·B over each query block's keys: Y = (P ∘ M)·V, and dQ = dS·K.
  template <typename Pe, typename E>
  void rows(float* y, const Pe* p, const E* b) const {
    for (Index r = 0; r < blocks.count; ++r) {
      const Index r0 = blocks.begin(r), r1 = blocks.end(r, T), k0 = gqa_first_key(r0, window);
      for (Index h = 0; h < G; ++h)
        gemm_batched_blocks(groups, r1 - r0, d, r1 - k0, score_side(p, h, r0, k0, false), key_side(b, k0, false),
                            y + (h * T + r0) * d, d, G * T * d, false);
    }
  }
  // X = Σ_h P_hᵀ·A_h over the queries that see each key block, the group's query heads added in
  // head order: dV = (P ∘ M)ᵀ·dY, and dK = dSᵀ·Q.
  template <typename Pe, typename E>
  void keys(float* x, const Pe* p, const E* a) const {
    for (Index c = 0; c < blocks.count; ++c) {
      const Index c0 = blocks.begin(c), c1 = blocks.end(c, T);
      const Index q1 = window > 0 ? std::min(T, c1 - 1 + window) : T;  // past the last query that sees key c1 − 1
      for (Index h = 0; h < G; ++h)
        gemm_batched_blocks(groups, c1 - c0, d, q1 - c0, score_side(p, h, c0, c0, true), query_side(a, h, c0),
                            x + c0 * d, d, T * d, h > 0);
    }
  }

 private:
  // Query head h of each group from row r0; each K/V head from row r0 (read transposed or not);
  // the scores of query head h from row r0 and key k0.
  template <typename E>
  BatchedOperand query_side(const E* x, Index h, Index r0) const {
    return {{x + (h * T + r0) * d, dtype_of<E>(), false, d}, G * T * d};
  }
  template <typename E>
  BatchedOperand key_side(const E* x, Index r0, bool trans) const {
    return {{x + r0 * d, dtype_of<E>(), trans, d}, T * d};
  }
  template <typename Pe>
  BatchedOperand score_side(const Pe* p, Index h, Index r0, Index k0, bool trans) const {
    return {{p + (h * T + r0) * T + k0, dtype_of<Pe>(), trans, T}, G * T * T};
  }
};

}  // namespace zero3d::kernels
