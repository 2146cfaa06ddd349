// matmul.hpp — Hugging Face Conv1D linear layer: out[N,OC] = inp[N,IC] · weight[IC,OC] + bias.
// The weight is input-major (GPT-2's Conv1D layout), so both products are plain row-major
// matrix products. linear_forward/linear_backward are nn.Linear's (the Llama family's):
// out = inp · weight[OC,IC]ᵀ + bias, the weight output-major as Hugging Face stores it. Weights and biases are stored as P (float, bf16 or fp16); the products go
// through gemm() in the `compute` dtype (gemm.hpp: sgemm, or bf16 through oneDNN).
#pragma once

#include "kernels/common.hpp"
#include "kernels/device_forms.hpp"
#include "kernels/gemm.hpp"
#include "kernels/half.hpp"

#include <type_traits>

namespace zero3d::kernels {

template <typename P>
constexpr DType dtype_of();
template <>
constexpr DType dtype_of<float>() { return DType::F32; }
template <>
constexpr DType dtype_of<bf16>() { return DType::BF16; }
template <>
constexpr DType dtype_of<fp16>() { return DType::F16; }

namespace gpu {

// A thread per kVec elements of a row (coalesced, device_forms.hpp) where a thread walked a row;
// the same sum per element.
template <typename P>
ZERO3D_KERNEL void add_bias_rows(float* out, const P* bias, Index N, Index OC) {
  if (vectorizable(OC, out, bias)) {
    const Index per_row = OC / kVec;
    Kokkos::parallel_for("add_bias_rows", range(N * per_row), KOKKOS_LAMBDA(Index j) {
      const Index i = j / per_row, o0 = (j - i * per_row) * kVec;
      float y[kVec], b[kVec];
      load_floats(y, out + i * OC + o0);
      load_floats(b, bias + o0);
      for (int k = 0; k < kVec; ++k) y[k] += b[k];
      store_floats(out + i * OC + o0, y);
    });
  } else {
    Kokkos::parallel_for("add_bias_rows", range(N * OC), KOKKOS_LAMBDA(Index j) { out[j] += to_float(bias[j % OC]); });
  }
}

// Two stages (device_forms.hpp) where 16-column blocks gave 48 threads at OC = 768.
ZERO3D_KERNEL void accumulate_column_sums(float* dbias, const float* dout, Index N, Index OC) {
  sum_columns(nullptr, dbias, dout, N, OC, "column_sums");
}

}  // namespace gpu

// Adds bias[OC] (stored as P) to every row of out[N,OC].
template <typename P>
ZERO3D_KERNEL void add_bias_rows(float* out, const P* bias16, Index N, Index OC) {
#ifdef ZERO3D_DEVICE
  gpu::add_bias_rows(out, bias16, N, OC);
#else
  WidenedParams widen;
  const float* bias = widen(bias16, OC);
  Kokkos::parallel_for("add_bias_rows", range(N), KOKKOS_LAMBDA(Index i) {
    float* row = out + i * OC;
    for (Index o = 0; o < OC; ++o) row[o] += bias[o];
  });
#endif
}

// res = residual + partial + bias: a row-parallel layer's output once its partial products are
// summed over the tensor group (Megatron RowParallelLinear adds the bias after the all-reduce).
template <typename P>
ZERO3D_KERNEL void add_residual_and_bias(float* res, const float* residual, const float* partial, const P* bias, Index N,
                                  Index C) {
#ifdef ZERO3D_DEVICE
  // One thread per element (coalesced); the same sum per element as the row loop's.
  Kokkos::parallel_for("residual_bias", range(N * C), KOKKOS_LAMBDA(Index j) {
    res[j] = residual[j] + partial[j] + to_float(bias[j % C]);
  });
#else
  Kokkos::parallel_for("residual_bias", range(N), KOKKOS_LAMBDA(Index i) {
    for (Index c = 0; c < C; ++c) res[i * C + c] = residual[i * C + c] + partial[i * C + c] + to_float(bias[c]);
  });
#endif
}

// Column sums: dbias[OC] += sum over rows of dout[N,OC] (each column owned by one iteration).
ZERO3D_KERNEL void accumulate_column_sums(float* dbias, const float* dout, Index N, Index OC) {
#ifdef ZERO3D_DEVICE
  gpu::accumulate_column_sums(dbias, dout, N, OC);
#else
  constexpr Index kBlock = 16;  // 16 columns = one cache line per row visit
  Kokkos::parallel_for("column_sums", range((OC + kBlock - 1) / kBlock), KOKKOS_LAMBDA(Index blk) {
    const Index o0 = blk * kBlock, o1 = o0 + kBlock < OC ? o0 + kBlock : OC;
    float acc[kBlock] = {};
    for (Index i = 0; i < N; ++i)
      for (Index o = o0; o < o1; ++o) acc[o - o0] += dout[i * OC + o];
    for (Index o = o0; o < o1; ++o) dbias[o] += acc[o - o0];
  });
#endif
}

// accumulate=true adds into out (used to fold the residual add into the projection).
// BF16: the bias rides in the product's epilogue (no pass over out of its own).
template <typename P>
inline void matmul_forward(float* out, const float* inp, const P* weight, const P* bias, Index N, Index IC, Index OC,
                           bool accumulate = false, DType compute = DType::F32) {
  if (compute != DType::F32) {  // 16-bit products take the bias into the product (rounded with it)
    gemm(N, OC, IC, {inp, DType::F32, false, IC}, {weight, dtype_of<P>(), false, OC}, out, OC, accumulate, compute,
         bias, dtype_of<P>());
    return;
  }
  gemm(N, OC, IC, {inp, DType::F32, false, IC}, {weight, dtype_of<P>(), false, OC}, out, OC, accumulate, compute);
  if (bias) add_bias_rows(out, bias, N, OC);
}

// The same with the input already bf16 (an activation kept in bf16 because a bf16 product is
// its only reader): nothing to round. Only for compute = BF16.
template <typename P>
inline void matmul_forward(float* out, const bf16* inp, const P* weight, const P* bias, Index N, Index IC, Index OC,
                           bool accumulate = false, DType compute = DType::BF16) {
  gemm(N, OC, IC, {inp, DType::BF16, false, IC}, {weight, dtype_of<P>(), false, OC}, out, OC, accumulate, compute, bias,
       dtype_of<P>());
}

// out = inp · weight + bias + residual: a block's residual add in the product's epilogue
// (gemm_adding), the bits of copying residual into out and accumulating. compute is BF16.
template <typename P>
inline void matmul_forward_adding(float* out, const float* residual, const bf16* inp, const P* weight, const P* bias,
                                  Index N, Index IC, Index OC) {
  gemm_adding(N, OC, IC, {inp, DType::BF16, false, IC}, {weight, dtype_of<P>(), false, OC}, out, residual, bias,
              dtype_of<P>());
}

// out = bf16(inp · weight + bias): the product rounds its own result (gemm_bf16_output) when
// its only reader takes bf16, as the MLP's GELU does. compute is BF16. In: the input's stored
// type (fp32: a sequence-parallel gather's tokens).
template <typename P, typename In>
inline void matmul_forward(bf16* out, const In* inp, const P* weight, const P* bias, Index N, Index IC, Index OC) {
  gemm_bf16_output(N, OC, IC, {inp, dtype_of<In>(), false, IC}, {weight, dtype_of<P>(), false, OC}, out, bias,
                   dtype_of<P>());
}

// Whether the weight-gradient product adds into dweight: writing saves oneDNN's read of the old
// values, but sgemm's beta = 0 first zeroes C in a pass of its own, and adding to the zeros
// there gives the same bits without it.
inline bool dweight_accumulates(bool add_dweight, DType compute) { return add_dweight || compute != DType::BF16; }

// dinp = dout · weightᵀ (written, skipped when null); dweight += inpᵀ · dout (skipped when null:
// the input-gradient pass of a zero-bubble schedule); dbias += Σ rows (skipped when null).
// dout feeds two products and is converted to `compute` once, its column sums (the bias
// gradient) taken in the same pass. add_dweight = false says dweight holds zeros (a zeroed
// gradient window), so the product may write it instead of adding (dweight_accumulates).
// In: the input's stored type. A bf16 input (see the bf16 matmul_forward) is read transposed as it
// is by the weight product (oneDNN's transposed-A kernel; a transposing pass would cost what it
// saves), and its products default to bf16.
template <typename P, typename In>
inline void matmul_backward(float* dinp, float* dweight, float* dbias, const float* dout, const In* inp,
                            const P* weight, Index N, Index IC, Index OC,
                            DType compute = std::is_same_v<In, bf16> ? DType::BF16 : DType::F32,
                            bool add_dweight = true) {
  const GemmOperand d = gemm_operand({dout, DType::F32, false, OC}, N * OC, compute, dbias);
  if (dinp) gemm(N, IC, OC, d, {weight, dtype_of<P>(), true, OC}, dinp, IC, false, compute);
  if (dweight) gemm(IC, OC, N, {inp, dtype_of<In>(), true, IC}, d, dweight, OC, dweight_accumulates(add_dweight, compute), compute);
}

// The same with dout already in the products' form (a bf16 gemm_operand_slot its producer
// filled, the bias gradient taken in that same pass). In: as above (fp32: a sequence-parallel gather's).
template <typename P, typename In>
inline void matmul_backward(float* dinp, float* dweight, const GemmOperand& dout, const In* inp, const P* weight,
                            Index N, Index IC, Index OC, DType compute = DType::BF16, bool add_dweight = true) {
  if (dinp) gemm(N, IC, OC, dout, {weight, dtype_of<P>(), true, OC}, dinp, IC, false, compute);
  if (dweight) gemm(IC, OC, N, {inp, dtype_of<In>(), true, IC}, dout, dweight, OC, dweight_accumulates(add_dweight, compute), compute);
}

// nn.Linear: out[N,OC] = inp[N,IC] · weight[OC,IC]ᵀ + bias (+ out when accumulate: a residual
// folded into the product). gemm adds the bias (in oneDNN's epilogue for bf16 products, a pass
// after sgemm otherwise). In: the input's stored type (bf16: an activation kept in bf16 because
// bf16 products are its only readers, as for matmul_forward).
template <typename P, typename In>
inline void linear_forward(float* out, const In* inp, const P* weight, const P* bias, Index N, Index IC, Index OC,
                           bool accumulate = false, DType compute = DType::F32) {
  gemm(N, OC, IC, {inp, dtype_of<In>(), false, IC}, {weight, dtype_of<P>(), true, IC}, out, OC, accumulate, compute,
       bias, dtype_of<P>());
}

// out = bf16(inp · weightᵀ + bias), rounded in the product's epilogue (gemm_bf16_output), for an
// output whose only reader takes bf16 (the Llama MLP's [gate | up], which SwiGLU reads; attention's
// q, k and v). compute is BF16.
template <typename P, typename In>
inline void linear_forward(bf16* out, const In* inp, const P* weight, const P* bias, Index N, Index IC, Index OC) {
  gemm_bf16_output(N, OC, IC, {inp, dtype_of<In>(), false, IC}, {weight, dtype_of<P>(), true, IC}, out, bias,
                   dtype_of<P>());
}

// out = inp · weightᵀ + bias + residual, the residual added in the product's epilogue
// (gemm_adding), as matmul_forward_adding. compute is BF16.
template <typename P>
inline void linear_forward_adding(float* out, const float* residual, const bf16* inp, const P* weight, const P* bias,
                                  Index N, Index IC, Index OC) {
  gemm_adding(N, OC, IC, {inp, DType::BF16, false, IC}, {weight, dtype_of<P>(), true, IC}, out, residual, bias,
              dtype_of<P>());
}

// nn.Linear's backward with dout already in the products' form (converted once for both
// products, or a bf16 gemm_operand_slot its producer filled with the bias gradient taken in the
// same pass): dinp = dout · weight (written, skipped when null); dweight[OC,IC] += doutᵀ · inp
// (skipped when null); add_dweight = false says dweight holds zeros (dweight_accumulates).
template <typename P, typename In>
inline void linear_backward(float* dinp, float* dweight, const GemmOperand& dout, const In* inp, const P* weight,
                            Index N, Index IC, Index OC, DType compute, bool add_dweight = true) {
  if (dinp) gemm(N, IC, OC, dout, {weight, dtype_of<P>(), false, IC}, dinp, IC, false, compute);
  if (dweight)
    gemm(OC, IC, N, {dout.data, dout.type, true, dout.ld}, {inp, dtype_of<In>(), false, IC}, dweight, IC,
         dweight_accumulates(add_dweight, compute), compute);
}

// The same from an fp32 dout, converted to `compute` once for both products with dbias += Σ rows
// of dout (skipped when null) taken in that pass.
template <typename P, typename In>
inline void linear_backward(float* dinp, float* dweight, float* dbias, const float* dout, const In* inp,
                            const P* weight, Index N, Index IC, Index OC, DType compute = DType::F32,
                            bool add_dweight = true) {
  linear_backward(dinp, dweight, gemm_operand({dout, DType::F32, false, OC}, N * OC, compute, dbias), inp, weight, N,
                  IC, OC, compute, add_dweight);
}

}  // namespace zero3d::kernels
