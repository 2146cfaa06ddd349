// llama_block.cpp — the Llama family's decoder block (Hugging Face modeling_llama.py
// LlamaDecoderLayer; Mistral's and Qwen2's are the same block), forward then backward:
//
//   h   = x + o_proj(attention(rope(q), rope(k), v)),  [q | k | v] = qkv_proj(RMSNorm(x))
//   out = h + down_proj(silu(gate) · up),               [gate | up] = gate_up_proj(RMSNorm(h))
//
// q/k/v_proj and gate/up_proj are each one product: the layout stores their weights one after
// another (model_layout.cpp llama_block_tensors), so they form one [(H + 2·Hkv)·d, C] and one
// [2I, C] matrix. Attention is grouped-query with the layer's sliding window
// (kernels/attention_gqa.hpp). Activations stay fp32; the products run in the model's compute
// dtype. Tensor and sequence parallelism and progressive layer drop are refused for the family
// at validation (config.cpp), so a block here always holds every head.
#include "base/profiler.hpp"
#include "kernels/attention_gqa.hpp"
#include "kernels/elementwise.hpp"
#include "kernels/matmul.hpp"
#include "kernels/rmsnorm.hpp"
#include "kernels/rope.hpp"
#include "kernels/swiglu.hpp"
#include "model/model.hpp"
#include "model/stopwatch.hpp"

namespace zero3d {

using namespace kernels;

namespace {

// One block's tensors inside its unit (a flat buffer of T: parameters, or fp32 gradients), in
// llama_block_tensors' order; absent biases are null.
template <typename T>
struct LlamaTensors {
  T *input_norm, *qkv_w, *qkv_b, *o_w, *o_b, *post_norm, *gate_up_w, *gate_up_b, *down_w, *down_b;
};

template <typename T>
LlamaTensors<T> llama_tensors(T* p, const GPTShape& s) {
  const DecoderFamily& f = s.family;
  const BlockWidths w = block_widths(s, 1);
  const int64_t C = s.n_embd, I = f.intermediate_size;
  LlamaTensors<T> t{};
  const auto take = [&p](int64_t n) {
    T* out = p;
    p += n;
    return out;
  };
  t.input_norm = take(C);
  t.qkv_w = take(w.qkv * C);
  if (f.qkv_bias) t.qkv_b = take(w.qkv);
  t.o_w = take(C * w.attn);
  if (f.o_bias) t.o_b = take(C);
  t.post_norm = take(C);
  t.gate_up_w = take(2 * I * C);
  if (f.mlp_bias) t.gate_up_b = take(2 * I);
  t.down_w = take(C * I);
  if (f.mlp_bias) t.down_b = take(C);
  return t;
}

}  // namespace

template <typename P>
void GPT::llama_block_forward(const ModelChunk& c, int l, BlockActivations& a, const float* residual, ParamStore& store,
                              double* attention_ms) {
  const DecoderFamily& f = shape_.family;
  const int64_t B = B_, T = T_, C = shape_.n_embd, BT = B * T, H = shape_.n_head, Hkv = f.num_key_value_heads,
                d = f.head_dim, I = f.intermediate_size;
  const BlockWidths& w = widths_;
  const float eps = static_cast<float>(f.rms_norm_eps);
  const DType cmp = compute_type();
  const int u = c.first_block_unit + l, global_block = c.first_block + l;
  const LlamaTensors<const P> p = llama_tensors(static_cast<const P*>(store.fetch(u)), shape_);
  obs::Region region(obs::attention_module(global_block));
  // h = x + o_proj(attention(...)) on input_layernorm(x)
  rmsnorm_forward(a.ln_1, a.ln_1_rstd, residual, p.input_norm, BT, C, eps);
  linear_forward(a.qkv, a.ln_1, p.qkv_w, p.qkv_b, BT, C, w.qkv, false, cmp);
  rope_forward(a.qkv, rope_cos_, rope_sin_, B, T, H, Hkv, d);  // q and k rotated in place: the saves hold them rotated
  {
    const Stopwatch sw(attention_ms != nullptr);
    gqa_attention_forward(a.atty, a.att, a.qkv, B, T, H, Hkv, d, f.window_of(global_block));
    if (attention_ms) *attention_ms += sw.ms();
  }
  copy(a.res_2, residual, BT * C);
  linear_forward(a.res_2, a.atty, p.o_w, p.o_b, BT, w.attn, C, /*accumulate=*/true, cmp);
  // out = h + down_proj(silu(gate) · up) on post_attention_layernorm(h)
  region.next(obs::mlp_module(global_block));
  rmsnorm_forward(a.ln_2, a.ln_2_rstd, a.res_2, p.post_norm, BT, C, eps);
  linear_forward(a.fch, a.ln_2, p.gate_up_w, p.gate_up_b, BT, C, 2 * I, false, cmp);  // rows [gate | up]
  swiglu_forward(a.fch_gelu, a.fch, a.fch + I, BT, I, 2 * I);
  copy(a.res_3, a.res_2, BT * C);
  linear_forward(a.res_3, a.fch_gelu, p.down_w, p.down_b, BT, I, C, /*accumulate=*/true, cmp);
  store.release(u);
  store.progress();
}

// Full: input and weight gradients together, operands in scratch. Input: input gradients only,
// the products' output gradients kept in buf.grad_operands[l]. Weight: the weight products
// from those operands and the forward's saves, no parameters fetched. The same kernel calls in
// all three, the skipped part's pointers null, so a split backward gives the fused one's numbers.
template <typename P>
void GPT::llama_block_backward(const ModelChunk& c, int l, const BlockActivations& a, const float* residual,
                               ActivationBuffer& buf, float* dres, ParamStore& store, BackwardPart part) {
  const DecoderFamily& f = shape_.family;
  const int64_t B = B_, T = T_, C = shape_.n_embd, BT = B * T, H = shape_.n_head, Hkv = f.num_key_value_heads,
                d = f.head_dim, I = f.intermediate_size;
  const BlockWidths& w = widths_;
  const DType cmp = compute_type();
  const bool input = part != BackwardPart::Weight, weights = part != BackwardPart::Input;
  const bool keep = part == BackwardPart::Input;
  const int u = c.first_block_unit + l, global_block = c.first_block + l;
  const int64_t window = f.window_of(global_block);
  const LlamaTensors<const P> p =
      input ? llama_tensors(static_cast<const P*>(store.fetch(u)), shape_) : LlamaTensors<const P>{};
  const LlamaTensors<float> dw = weights ? llama_tensors(store.grad_target(u), shape_) : LlamaTensors<float>{};
  // each weight's gradient is one product: into a zeroed window it is written, not added
  const bool add_dw = !(weights && store.grads_start_at_zero(u));
  const bool saved = part != BackwardPart::Full;
  const BlockGradOperands& g = saved ? buf.grad_operands[l] : BlockGradOperands{};
  float* d_fch = saved ? g.d_fch : dfch_;  // d[gate | up]
  float* d_ln_2 = saved ? g.d_ln_2 : dln_;
  float* d_qkv = saved ? g.d_qkv : dqkv_;
  float* d_ln_1 = saved ? g.d_ln_1 : dln_;
  obs::Region region(obs::mlp_module(global_block));
  // MLP half: dres holds d(out), which is also the residual path's d(h)
  const float* d_out = part == BackwardPart::Weight ? g.d_res_3 : dres;
  if (keep) copy(g.d_res_3, dres, BT * C);
  linear_backward(input ? dact_ : nullptr, weights ? dw.down_w : nullptr, weights ? dw.down_b : nullptr, d_out,
                  a.fch_gelu, p.down_w, BT, I, C, cmp, add_dw);
  store.progress();
  if (input) swiglu_backward(d_fch, d_fch + I, dact_, a.fch, a.fch + I, BT, I, 2 * I);
  linear_backward(input ? d_ln_2 : nullptr, weights ? dw.gate_up_w : nullptr, weights ? dw.gate_up_b : nullptr, d_fch,
                  a.ln_2, p.gate_up_w, BT, C, 2 * I, cmp, add_dw);
  store.progress();
  rmsnorm_backward(input ? dres : nullptr, weights ? dw.post_norm : nullptr, d_ln_2, a.res_2, p.post_norm, a.ln_2_rstd,
                   BT, C);
  // attention half: dres now holds d(h), which is also the residual path's d(x)
  region.next(obs::attention_module(global_block));
  const float* d_h = part == BackwardPart::Weight ? g.d_res_2 : dres;
  if (keep) copy(g.d_res_2, dres, BT * C);
  if (input && ac_.selective()) {  // the probabilities were not kept: recompute them (datty_ is free until o_proj)
    const obs::PassScope recompute(obs::Pass::Recompute);
    checkpoint_boundary();
    const Stopwatch sw(ac_.profile);
    gqa_attention_forward(datty_, a.att, a.qkv, B, T, H, Hkv, d, window);
    if (ac_.profile) time_of(global_block, 1).recompute_ms += sw.ms();
    checkpoint_boundary();
  }
  linear_backward(input ? datty_ : nullptr, weights ? dw.o_w : nullptr, weights ? dw.o_b : nullptr, d_h, a.atty, p.o_w,
                  BT, w.attn, C, cmp, add_dw);
  store.progress();
  if (input) {
    gqa_attention_backward(d_qkv, datt_scratch_, datty_, a.qkv, a.att, B, T, H, Hkv, d, window);
    rope_backward(d_qkv, rope_cos_, rope_sin_, B, T, H, Hkv, d);  // to the gradient of q and k before rotation
  }
  store.progress();
  linear_backward(input ? d_ln_1 : nullptr, weights ? dw.qkv_w : nullptr, weights ? dw.qkv_b : nullptr, d_qkv, a.ln_1,
                  p.qkv_w, BT, C, w.qkv, cmp, add_dw);
  rmsnorm_backward(input ? dres : nullptr, weights ? dw.input_norm : nullptr, d_ln_1, residual, p.input_norm,
                   a.ln_1_rstd, BT, C);
  if (input) store.release(u);
  if (weights) store.grads_done(u);
}

#define ZERO3D_LLAMA_BLOCK(P)                                                                                        \
  template void GPT::llama_block_forward<P>(const ModelChunk&, int, BlockActivations&, const float*, ParamStore&,     \
                                            double*);                                                                 \
  template void GPT::llama_block_backward<P>(const ModelChunk&, int, const BlockActivations&, const float*,           \
                                             ActivationBuffer&, float*, ParamStore&, BackwardPart);
ZERO3D_LLAMA_BLOCK(float)
ZERO3D_LLAMA_BLOCK(bf16)
ZERO3D_LLAMA_BLOCK(fp16)
#undef ZERO3D_LLAMA_BLOCK

}  // namespace zero3d
