// llama_block.cpp — the Llama family's decoder block (Hugging Face modeling_llama.py
// LlamaDecoderLayer; Mistral's and Qwen2's are the same block), forward then backward:
//
//   h   = x + o_proj(attention(rope(q), rope(k), v)),  [q | k | v] = qkv_proj(RMSNorm(x))
//   out = h + down_proj(silu(gate) · up),               [gate | up] = gate_up_proj(RMSNorm(h))
//
// q/k/v_proj and gate/up_proj are each one product: the layout stores their weights one after
// another (model_layout.cpp llama_block_tensors), so they form one [(H + 2·Hkv)·d, C] and one
// [2I, C] matrix. Attention is grouped-query with the layer's sliding window
// (kernels/attention_gqa.hpp). The products run in the model's compute dtype. bf16 compute
// (bf16_activations.hpp, as GPT-2's block: under tensor parallelism on a GPU build only) keeps the
// products' inputs in bf16 where they are made: the RMSNorms write bf16 (a sequence-parallel
// shard gathered in bf16); q/k/v_proj rounds its output, rope
// rotates it in place in bf16, attention reads bf16 q, k, v (the fused AVX512-BF16 kernel where
// built) and writes the bf16 output o_proj reads; gate_up_proj writes bf16, SwiGLU reads and
// writes bf16, and its backward makes [dgate | dup] in bf16 straight into the gate/up product's
// operand; a whole backward also makes dqkv in bf16 straight into q/k/v_proj's operand, rope's
// backward and the bias gradient folded into the fused attention backward (as GPT-2's c_attn's);
// the other gradients stay fp32. attention_dropout drops the probabilities in training
// (LlamaAttention's dropout on attn_weights), inside the attention kernels (the fused bf16 one
// too: it draws dropout.hpp's mask itself).
//
// Tensor parallelism (DeepSpeed AutoTP's llama preset, Megatron's split): q/k/v_proj and
// gate/up_proj column-parallel, each rank holding H/t query heads with their Hkv/t K/V heads
// (whole groups) and I/t of the MLP; o_proj and down_proj row-parallel, their biases added once
// after the sum; RMSNorms replicated. The local q, k and v rows (and gate, up) still lie one
// after another, so each rank's products stay fused. With sequence parallelism the RMSNorms
// and residual adds run on this rank's 1/t of the tokens, gathered before the column-parallel
// products and reduce-scattered after the row-parallel ones.
//
// Mixtral (modeling_mixtral.py MixtralDecoderLayer): the same attention half; the MLP half is
// out = h + MixtralSparseMoeBlock(RMSNorm(h)), run by moe_forward/moe_backward (moe_layer.cpp)
// with the router in this block's unit and the experts in their own.
#include "base/profiler.hpp"
#include "kernels/attention_gqa.hpp"
#include "kernels/elementwise.hpp"
#include "kernels/matmul.hpp"
#include "kernels/rmsnorm.hpp"
#include "kernels/rope.hpp"
#include "kernels/swiglu.hpp"
#include "model/bf16_activations.hpp"
#include "model/llama_tensors.hpp"
#include "model/model.hpp"
#include "model/stopwatch.hpp"
#include "model/tp_regions.hpp"
#include "parallel/comm.hpp"

#include <type_traits>

namespace zero3d {

using namespace kernels;

template <typename P>
void GPT::llama_block_forward(const ModelChunk& c, int l, BlockActivations& a, const float* residual, ParamStore& store,
                              double* attention_ms, ActivationBuffer* buf) {
  const DecoderFamily& f = shape_.family;
  const int64_t t = part_.tp_size, B = B_, T = T_, C = shape_.n_embd, BT = B * T, Ns = Ns_, H = Hl_,
                Hkv = f.num_key_value_heads / t, d = f.head_dim, I = widths_.act;
  const BlockWidths& w = widths_;
  const bool tp = t > 1, sp = tp_.sequence_parallel;
  const float eps = static_cast<float>(f.rms_norm_eps);
  const DType cmp = compute_type();
  // the attention half's activations in bf16; the MLP half's too, but for Mixtral's MoE MLP
  const bool lp = activations_bf16(cmp, tp, f.mixtral(), false), lp_mlp = activations_bf16(cmp, tp, f.mixtral(), true);
  // res = res_in + inp · Wᵀ + bias: one product on one rank; a row-parallel product's partial
  // sums over the group (into this rank's tokens with sequence parallelism) then the bias once.
  // inp: fp32, or bf16 kept under tensor parallelism (one rank's bf16 input adds in the epilogue).
  const auto residual_product = [&](float* res, const float* res_in, const auto* inp, const P* weight, const P* bias,
                                    int64_t IC) {
    if (!tp) {
      copy(res, res_in, BT * C);
      linear_forward(res, inp, weight, bias, BT, IC, C, /*accumulate=*/true, cmp);
      return;
    }
    linear_forward(row_out_, inp, weight, static_cast<const P*>(nullptr), BT, IC, C, false, cmp);
    const float* sum = row_out_;
    if (!sp) {
      reduce_from_tp_region_forward(tp_, row_out_, BT * C);
    } else {
      reduce_scatter_to_sequence_parallel_region_forward(tp_, row_out_, shard_, Ns * C);
      sum = shard_;
    }
    if (bias) add_residual_and_bias(res, res_in, sum, bias, Ns, C);
    else add(res, res_in, sum, Ns * C);
  };
  const int u = c.first_block_unit + l, global_block = c.first_block + l;
  const LlamaTensors<const P> p = llama_tensors(static_cast<const P*>(store.fetch(u)), shape_, w);
  obs::Region region(obs::attention_module(global_block));
  // h = x + o_proj(attention(...)) on input_layernorm(x)
  const DropoutMask attn_drop = dropout_mask(shape_.dropout.attn, global_block, DropoutSite::Probabilities);
  if (lp) {  // q/k/v_proj reads bf16 and rounds its own output: attention reads q, k and v in bf16
    rmsnorm_forward(as_bf16(a.ln_1), a.ln_1_rstd, residual, p.input_norm, Ns, C, eps);
    linear_forward(as_bf16(a.qkv), column_parallel_input(as_bf16(a.ln_1)), p.qkv_w, p.qkv_b, BT, C, w.qkv);
    rope_forward(as_bf16(a.qkv), rope_cos_, rope_sin_, B, T, H, Hkv, d);
  } else {
    rmsnorm_forward(a.ln_1, a.ln_1_rstd, residual, p.input_norm, Ns, C, eps);
    linear_forward(a.qkv, column_parallel_input(a.ln_1), p.qkv_w, p.qkv_b, BT, C, w.qkv, false, cmp);
    rope_forward(a.qkv, rope_cos_, rope_sin_, B, T, H, Hkv, d);
  }  // q and k rotated in place: the saves hold them rotated
  {
    const Stopwatch sw(attention_ms != nullptr);
    const int64_t window = f.window_of(global_block);
    if (lp) gqa_attention_forward(as_bf16(a.atty), a.att, as_bf16(a.qkv), B, T, H, Hkv, d, window, attn_drop);
    else gqa_attention_forward(a.atty, a.att, a.qkv, B, T, H, Hkv, d, window, attn_drop);
    if (attention_ms) *attention_ms += sw.ms();
  }
  if (lp && !tp) linear_forward_adding(a.res_2, residual, as_bf16(a.atty), p.o_w, p.o_b, BT, w.attn, C);
  else if (lp) residual_product(a.res_2, residual, as_bf16(a.atty), p.o_w, p.o_b, w.attn);
  else residual_product(a.res_2, residual, a.atty, p.o_w, p.o_b, w.attn);
  // out = h + down_proj(silu(gate) · up) on post_attention_layernorm(h)
  region.next(obs::mlp_module(global_block));
  if (lp_mlp) {  // gate_up_proj writes bf16 (as autocast's linear does): SwiGLU reads half the bytes
    rmsnorm_forward(as_bf16(a.ln_2), a.ln_2_rstd, a.res_2, p.post_norm, Ns, C, eps);
    linear_forward(as_bf16(a.fch), column_parallel_input(as_bf16(a.ln_2)), p.gate_up_w, p.gate_up_b, BT, C,
                   w.fc);  // rows [gate | up]
    swiglu_forward(as_bf16(a.fch_gelu), as_bf16(a.fch), as_bf16(a.fch) + I, BT, I, w.fc);
    if (!tp) linear_forward_adding(a.res_3, a.res_2, as_bf16(a.fch_gelu), p.down_w, p.down_b, BT, I, C);
    else residual_product(a.res_3, a.res_2, as_bf16(a.fch_gelu), p.down_w, p.down_b, I);
    store.release(u);
    store.progress();
    return;
  }
  rmsnorm_forward(a.ln_2, a.ln_2_rstd, a.res_2, p.post_norm, Ns, C, eps);
  if (f.mixtral()) {  // model.moe's checks keep sequence parallelism and full recompute away (Ns = B·T, buf given)
    BlockTensors<const P> router{};
    router.gate_w = p.router_w;
    moe_forward<P>(global_block, a, *moe_saves(c, l, *buf), router, *buf, store);
    store.release(u);
    store.progress();
    return;
  }
  linear_forward(a.fch, column_parallel_input(a.ln_2), p.gate_up_w, p.gate_up_b, BT, C, w.fc, false, cmp);  // rows [gate | up]
  swiglu_forward(a.fch_gelu, a.fch, a.fch + I, BT, I, w.fc);
  residual_product(a.res_3, a.res_2, a.fch_gelu, p.down_w, p.down_b, I);
  store.release(u);
  store.progress();
}

// Full: input and weight gradients together, operands in scratch. Input: input gradients only,
// the products' output gradients kept in buf.grad_operands[l]. Weight: the weight products
// from those operands and the forward's saves, no parameters fetched. The same kernel calls in
// all three, the skipped part's pointers null, so a split backward gives the fused one's
// numbers. Tensor-parallel regions sit on the lines mirroring the forward's.
template <typename P>
void GPT::llama_block_backward(const ModelChunk& c, int l, const BlockActivations& a, const float* residual,
                               ActivationBuffer& buf, float* dres, ParamStore& store, BackwardPart part,
                               float grad_scale) {
  const DecoderFamily& f = shape_.family;
  const int64_t t = part_.tp_size, B = B_, T = T_, C = shape_.n_embd, BT = B * T, Ns = Ns_, H = Hl_,
                Hkv = f.num_key_value_heads / t, d = f.head_dim, I = widths_.act;
  const BlockWidths& w = widths_;
  const bool sp = tp_.sequence_parallel;
  const DType cmp = compute_type();
  const bool lp = activations_bf16(cmp, t > 1, f.mixtral(), false), lp_mlp = activations_bf16(cmp, t > 1, f.mixtral(), true);
  const bool input = part != BackwardPart::Weight, weights = part != BackwardPart::Input;
  const bool keep = part == BackwardPart::Input;
  const int u = c.first_block_unit + l, global_block = c.first_block + l;
  const int64_t window = f.window_of(global_block);
  const LlamaTensors<const P> p =
      input ? llama_tensors(static_cast<const P*>(store.fetch(u)), shape_, w) : LlamaTensors<const P>{};
  const LlamaTensors<float> dw = weights ? llama_tensors(store.grad_target(u), shape_, w) : LlamaTensors<float>{};
  // each weight's gradient is one product: into a zeroed window it is written, not added
  const bool add_dw = !(weights && store.grads_start_at_zero(u));
  const bool saved = part != BackwardPart::Full;
  const BlockGradOperands& g = saved ? buf.grad_operands[l] : BlockGradOperands{};
  float* d_fch = saved ? g.d_fch : dfch_;  // d[gate | up]
  float* d_ln_2 = saved ? g.d_ln_2 : dln_;
  float* d_qkv = saved ? g.d_qkv : dqkv_;
  float* d_ln_1 = saved ? g.d_ln_1 : dln_;
  // A column-parallel product's backward (tp_regions.hpp) with nn.Linear's products: x the norm's
  // output (fp32, or bf16 where it was kept so), dout fp32 or already in the products' form (the
  // bias gradient taken where it was made). One rank passes straight through the regions.
  const auto column_backward = [&](float* dinp_shard, float* dweight, float* dbias, const auto& dout, const auto* x,
                                   const P* weight, int64_t OC) {
    column_parallel_backward(dinp_shard, dweight, dbias, x, C, store,
                             [&](float* dinp, float* dw_, float* db, const auto* inp) {
                               if constexpr (std::is_same_v<std::decay_t<decltype(dout)>, GemmOperand>) {
                                 (void)db;
                                 linear_backward(dinp, dw_, dout, inp, weight, BT, C, OC, cmp, add_dw);
                               } else {
                                 linear_backward(dinp, dw_, db, dout, inp, weight, BT, C, OC, cmp, add_dw);
                               }
                             });
  };
  // q/k/v_proj's and gate/up_proj's: ln_1 or ln_2 in the type the forward kept
  const auto qkv_backward = [&](float* dinp, float* dweight, float* dbias, const auto& dout) {
    if (lp) column_backward(dinp, dweight, dbias, dout, as_bf16(a.ln_1), p.qkv_w, w.qkv);
    else column_backward(dinp, dweight, dbias, dout, static_cast<const float*>(a.ln_1), p.qkv_w, w.qkv);
  };
  const auto gate_up_backward = [&](float* dinp, float* dweight, float* dbias, const auto& dout) {
    if (lp_mlp) column_backward(dinp, dweight, dbias, dout, as_bf16(a.ln_2), p.gate_up_w, w.fc);
    else column_backward(dinp, dweight, dbias, dout, static_cast<const float*>(a.ln_2), p.gate_up_w, w.fc);
  };
  obs::Region region(obs::mlp_module(global_block));
  // MLP half: dres holds d(out) (this rank's tokens), which is also the residual path's d(h)
  const float* d_out = part == BackwardPart::Weight ? g.d_res_3 : row_output_grad(dres, saved ? g.d_res_3 : gathered_);
  if (keep && !sp) copy(g.d_res_3, dres, BT * C);
  if (f.mixtral()) {  // the sparse MoE block writes d(ln_2) (a full backward: model.moe's checks)
    BlockTensors<const P> router{};
    BlockTensors<float> d_router{};
    router.gate_w = p.router_w;
    d_router.gate_w = dw.router_w;
    moe_backward<P>(global_block, a, *moe_saves(c, l, buf), router, d_router, d_out, d_ln_2, grad_scale, store);
  } else if (lp_mlp) {  // the forward kept ln_2, [gate | up] and SwiGLU's output in bf16
    linear_backward(input ? dact_ : nullptr, weights ? dw.down_w : nullptr, weights ? dw.down_b : nullptr, d_out,
                    as_bf16(a.fch_gelu), p.down_w, BT, I, C, cmp, add_dw);
    store.progress();
    if (part == BackwardPart::Full) {  // SwiGLU's gradient made in the products' bf16, gate/up's bias gradients beside it
      const GemmOperand d = gemm_operand_slot(BT, w.fc);
      swiglu_backward_summing_columns(static_cast<bf16*>(const_cast<void*>(d.data)), dw.gate_up_b, dact_, as_bf16(a.fch),
                                      BT, I);
      gate_up_backward(d_ln_2, dw.gate_up_w, nullptr, d);
    } else {  // a split backward keeps the fp32 gradient for its weight pass (as GPT-2's block)
      if (input) swiglu_backward(d_fch, d_fch + I, dact_, as_bf16(a.fch), as_bf16(a.fch) + I, BT, I, w.fc);
      gate_up_backward(input ? d_ln_2 : nullptr, weights ? dw.gate_up_w : nullptr, weights ? dw.gate_up_b : nullptr,
                       static_cast<const float*>(d_fch));
    }
  } else {
    linear_backward(input ? dact_ : nullptr, weights ? dw.down_w : nullptr, weights ? dw.down_b : nullptr, d_out,
                    a.fch_gelu, p.down_w, BT, I, C, cmp, add_dw);
    store.progress();
    if (input) swiglu_backward(d_fch, d_fch + I, dact_, a.fch, a.fch + I, BT, I, w.fc);
    gate_up_backward(input ? d_ln_2 : nullptr, weights ? dw.gate_up_w : nullptr, weights ? dw.gate_up_b : nullptr,
                     static_cast<const float*>(d_fch));
  }
  store.progress();
  rmsnorm_backward(input ? dres : nullptr, weights ? dw.post_norm : nullptr, d_ln_2, a.res_2, p.post_norm, a.ln_2_rstd,
                   Ns, C);
  // attention half: dres now holds d(h), which is also the residual path's d(x)
  region.next(obs::attention_module(global_block));
  const float* d_h = part == BackwardPart::Weight ? g.d_res_2 : row_output_grad(dres, saved ? g.d_res_2 : gathered_);
  if (keep && !sp) copy(g.d_res_2, dres, BT * C);
  // attention_dropout's mask, redrawn (also by the bf16 recompute: the kernel it picks depends on it)
  const DropoutMask attn_drop = dropout_mask(shape_.dropout.attn, global_block, DropoutSite::Probabilities);
  if (input && ac_.selective()) {  // the probabilities were not kept: recompute them (datty_ is free until o_proj)
    const obs::PassScope recompute(obs::Pass::Recompute);
    checkpoint_boundary();
    const Stopwatch sw(ac_.profile);
    if (lp) gqa_attention_forward(datty_, a.att, as_bf16(a.qkv), B, T, H, Hkv, d, window, attn_drop);
    else gqa_attention_forward(datty_, a.att, a.qkv, B, T, H, Hkv, d, window);
    if (ac_.profile) time_of(global_block, 1).recompute_ms += sw.ms();
    checkpoint_boundary();
  }
  if (lp)
    linear_backward(input ? datty_ : nullptr, weights ? dw.o_w : nullptr, weights ? dw.o_b : nullptr, d_h,
                    as_bf16(a.atty), p.o_w, BT, w.attn, C, cmp, add_dw);
  else
    linear_backward(input ? datty_ : nullptr, weights ? dw.o_w : nullptr, weights ? dw.o_b : nullptr, d_h, a.atty,
                    p.o_w, BT, w.attn, C, cmp, add_dw);
  store.progress();
  // a whole backward makes dqkv (of q and k before rotation) in the products' bf16 directly,
  // q/k/v_proj's bias gradient beside it, as GPT-2's block makes c_attn's
  const bool dqkv_bf16 = lp && part == BackwardPart::Full;
  const GemmOperand dqkv_slot = dqkv_bf16 ? gemm_operand_slot(BT, w.qkv) : GemmOperand{};
  if (dqkv_bf16) {
    gqa_attention_backward_summing_columns(static_cast<bf16*>(const_cast<void*>(dqkv_slot.data)), dw.qkv_b, d_qkv,
                                           datt_scratch_, datty_, as_bf16(a.qkv), a.att, B, T, H, Hkv, d, window,
                                           rope_cos_, rope_sin_, attn_drop);
  } else if (input) {
    if (lp)
      gqa_attention_backward(d_qkv, datt_scratch_, datty_, as_bf16(a.qkv), a.att, B, T, H, Hkv, d, window, attn_drop);
    else
      gqa_attention_backward(d_qkv, datt_scratch_, datty_, a.qkv, a.att, B, T, H, Hkv, d, window, attn_drop);
    rope_backward(d_qkv, rope_cos_, rope_sin_, B, T, H, Hkv, d);  // to the gradient of q and k before rotation
  }
  store.progress();
  if (dqkv_bf16)
    qkv_backward(d_ln_1, dw.qkv_w, nullptr, dqkv_slot);
  else
    qkv_backward(input ? d_ln_1 : nullptr, weights ? dw.qkv_w : nullptr, weights ? dw.qkv_b : nullptr,
                 static_cast<const float*>(d_qkv));
  rmsnorm_backward(input ? dres : nullptr, weights ? dw.input_norm : nullptr, d_ln_1, residual, p.input_norm,
                   a.ln_1_rstd, Ns, C);
  if (input) store.release(u);
  if (weights) store.grads_done(u);
}

#define ZERO3D_LLAMA_BLOCK(P)                                                                                        \
  template void GPT::llama_block_forward<P>(const ModelChunk&, int, BlockActivations&, const float*, ParamStore&,     \
                                            double*, ActivationBuffer*);                                              \
  template void GPT::llama_block_backward<P>(const ModelChunk&, int, const BlockActivations&, const float*,           \
                                             ActivationBuffer&, float*, ParamStore&, BackwardPart, float);
ZERO3D_LLAMA_BLOCK(float)
ZERO3D_LLAMA_BLOCK(bf16)
ZERO3D_LLAMA_BLOCK(fp16)
#undef ZERO3D_LLAMA_BLOCK

}  // namespace zero3d
