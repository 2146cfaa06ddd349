// model.cpp — GPT-2 forward and backward: the layer loop, read top-down then bottom-up. The Llama
// family runs the same loop with its own embedding, block (llama_block.cpp), final norm and head.


#include "base/profiler.hpp"
#include "base/rng.hpp"
#include "kernels/attention.hpp"
#include "kernels/attention_sparse.hpp"
#include "kernels/crossentropy.hpp"
#include "kernels/elementwise.hpp"
#include "kernels/encoder.hpp"
#include "kernels/gelu.hpp"
#include "kernels/layernorm.hpp"
#include "kernels/matmul.hpp"
#include "kernels/rmsnorm.hpp"
#include "kernels/vocab_parallel.hpp"
#include "model/bf16_activations.hpp"
#include "model/model.hpp"
#include "model/pld.hpp"
#include "model/stopwatch.hpp"
#include "model/tp_regions.hpp"
#include "parallel/comm.hpp"
#include <algorithm>
#include <chrono>
#include <cmath>
#include <stdexcept>
#include <type_traits>

namespace zero3d {

using namespace kernels;

namespace {

// dst <- src (n floats), each in host memory (cpu_checkpointing) or in the device's. On a CPU
// build both are the same memory and this is a plain copy.
void copy_spaces(float* dst, bool dst_host, const float* src, bool src_host, int64_t n) {
  using Host = Kokkos::View<float*, Kokkos::HostSpace, Kokkos::MemoryUnmanaged>;
  using Device = Kokkos::View<float*, Kokkos::MemoryUnmanaged>;
  float* from = const_cast<float*>(src);
  if (dst_host && src_host) Kokkos::deep_copy(Host(dst, n), Host(from, n));
  else if (dst_host) Kokkos::deep_copy(Host(dst, n), Device(from, n));
  else if (src_host) Kokkos::deep_copy(Device(dst, n), Host(from, n));
  else Kokkos::deep_copy(Device(dst, n), Device(from, n));
}

}  // namespace

template <typename T>
BlockTensors<T> GPT::block(T* unit, int global_block) const {
  const int64_t C = shape_.n_embd, Cl = Cl_;
  T* p = unit;
  BlockTensors<T> b;
  T** fields[] = {&b.ln_1_w, &b.ln_1_b, &b.c_attn_w, &b.c_attn_b, &b.attn_proj_w, &b.attn_proj_b,
                  &b.ln_2_w, &b.ln_2_b, &b.c_fc_w,   &b.c_fc_b,   &b.mlp_proj_w,  &b.mlp_proj_b};
  // local shapes (model_part's splits): c_attn [C, 3C/t], attn.c_proj [C/t, C], c_fc [C, 4C/t], mlp.c_proj [4C/t, C]
  const int64_t sizes[] = {C, C, 3 * C * Cl, 3 * Cl, Cl * C, C, C, C, 4 * C * Cl, 4 * Cl, 4 * Cl * C, C};
  const bool moe = shape_.moe.is_moe_block(global_block), dense_mlp = !moe || shape_.moe.use_residual;
  for (int k = 0; k < 12; ++k) {
    if (k >= 8 && !dense_mlp) break;
    *fields[k] = p;
    p += sizes[k];
  }
  if (moe && shape_.moe.use_residual) {  // mlp.coefficient [C, 2] + [2] (block_tensors' order)
    b.coef_w = p;
    b.coef_b = p + 2 * C;
    p += 2 * C + 2;
  }
  if (moe) b.gate_w = p;  // mlp.gate.weight [C, E]
  return b;
}
// Parameters as a unit holds them, for GPT::block_tensors (generation's own passes).
template BlockTensors<const float> GPT::block(const float*, int) const;
template BlockTensors<const bf16> GPT::block(const bf16*, int) const;
template BlockTensors<const fp16> GPT::block(const fp16*, int) const;

float GPT::forward(int chunk, ActivationBuffer& buf, ParamStore& store) {
  const obs::PassScope pass(obs::Pass::Forward);
  const ModelChunk& c = part_.chunks[chunk];
  switch (param_type_) {
    case DType::BF16: return forward_impl<bf16>(c, buf, store);
    case DType::F16: return forward_impl<fp16>(c, buf, store);
    default: return forward_impl<float>(c, buf, store);
  }
}

void GPT::backward(int chunk, ActivationBuffer& buf, float grad_scale, ParamStore& store, BackwardPart part) {
  const obs::PassScope pass(obs::Pass::Backward);
  const ModelChunk& c = part_.chunks[chunk];
  if (shape_.family.mixtral()) mixtral_router_fractions(c, buf);
  switch (param_type_) {
    case DType::BF16: return backward_impl<bf16>(c, buf, grad_scale, store, part);
    case DType::F16: return backward_impl<fp16>(c, buf, grad_scale, store, part);
    default: return backward_impl<float>(c, buf, grad_scale, store, part);
  }
}

float GPT::forward(const int32_t* tokens, const int32_t* targets, ParamStore& store) {
  if (own_.storage.extent(0) == 0) {  // what the setters gave the buffer before it existed stays
    ActivationBuffer fresh = make_buffer(false);
    fresh.block_scale = std::move(own_.block_scale);
    fresh.first_sample = own_.first_sample;
    fresh.training = own_.training;
    own_ = std::move(fresh);
  }
  own_.tokens = tokens;
  own_.targets = targets;
  return forward(0, own_, store);
}

void GPT::backward(float grad_scale, ParamStore& store) { backward(0, own_, grad_scale, store); }

void GPT::begin_pass(const ActivationBuffer& buf) {
  pass_trains_ = buf.training && shape_.dropout.any();
  pass_first_sample_ = buf.first_sample;
}

DropoutMask GPT::dropout_mask(double p, int64_t layer, DropoutSite site) const {
  if (!pass_trains_ || p == 0.0) return {};
  DropoutMask m = kernels::dropout_mask(p, shape_.dropout.seed, pass_first_sample_, layer, site);
  m.first_head = part_.tp_rank * Hl_;  // tensor rank r holds heads r·H/t, ... (whole heads, model_part's split)
  return m;
}

template <typename P>
void GPT::block_forward(const ModelChunk& c, int l, BlockActivations& a, const float* residual, ParamStore& store,
                        double* attention_ms, ActivationBuffer* buf, float scale) {
  if (shape_.llama()) {
    // progressive layer drop is refused for the Llama family at validation (config.cpp)
    if (scale != 1.0f) throw std::logic_error("progressive layer drop reached a Llama-family block");
    return llama_block_forward<P>(c, l, a, residual, store, attention_ms, buf);
  }
  if (scale == 0.0f) return dropped_block_forward(a, residual);  // progressive layer drop: the identity
  const int64_t B = B_, T = T_, C = shape_.n_embd, Cl = Cl_, H = Hl_, BT = B * T, Ns = Ns_;
  const bool tp = part_.tp_size > 1, sp = tp_.sequence_parallel;
  const DType cmp = compute_type();
  // A row-parallel product's partial sums (row_out_, all tokens) summed over the group into
  // this rank's tokens, then the bias once and the residual: res = residual + Σ partial + bias.
  // With dropout on the branch: res = residual + mask ∘ (Σ partial + bias).
  const auto row_output = [&](float* res, const float* res_in, const P* bias, const DropoutMask& drop) {
    const float* sum = row_out_;
    if (!sp) {
      reduce_from_tp_region_forward(tp_, row_out_, BT * C);
    } else {
      reduce_scatter_to_sequence_parallel_region_forward(tp_, row_out_, shard_, Ns * C);
      sum = shard_;
    }
    if (drop.on()) dropout_residual_add(res, res_in, sum, bias, drop, first_row(), Ns, T, C);
    else add_residual_and_bias(res, res_in, sum, bias, Ns, C);
  };
  // One rank's product: res = residual + mask ∘ (inp · W + bias), the branch made in res first
  // (inp fp32, or bf16 where activations_bf16 keeps it).
  const auto dropped_output = [&](float* res, const float* res_in, const auto* inp, const P* weight, const P* bias,
                                  int64_t IC, const DropoutMask& drop) {
    matmul_forward(res, inp, weight, bias, BT, IC, C, /*accumulate=*/false, cmp);
    dropout_residual_add(res, res_in, res, static_cast<const float*>(nullptr), drop, 0, BT, T, C);
  };
  const int u = c.first_block_unit + l;
  const int global_block = c.first_block + l;
  const BlockTensors<const P> w = block(static_cast<const P*>(store.fetch(u)), global_block);
  const DropoutMask attn_drop = dropout_mask(shape_.dropout.attn, global_block, DropoutSite::Probabilities),
                    attn_out_drop = dropout_mask(shape_.dropout.resid, global_block, DropoutSite::AttentionOutput),
                    mlp_out_drop = dropout_mask(shape_.dropout.resid, global_block, DropoutSite::MlpOutput);
  // Inputs of bf16 products kept in bf16 where they are made (activations_bf16): the products
  // round them anyway, so the rounding passes go and the backward reads half the bytes.
  const bool moe_block = shape_.moe.is_moe_block(global_block);
  // (sparse attention runs in fp32 and hands the product an fp32 input)
  const bool lp = !shape_.sparse.enabled && activations_bf16(cmp, tp, moe_block, false),
             lp_mlp = activations_bf16(cmp, tp, moe_block, true);
  obs::Region region(obs::attention_module(c.first_block + l));  // the flops profiler's and trace's module
  // x + attn(ln_1(x)): c_attn column-parallel (this rank's heads), attn.c_proj row-parallel
  if (lp) {
    layernorm_forward(as_bf16(a.ln_1), a.ln_1_mean, a.ln_1_rstd, residual, w.ln_1_w, w.ln_1_b, Ns, C);
    // c_attn rounds its own output: attention rounds q, k and v to bf16 anyway (same bits)
    matmul_forward(as_bf16(a.qkv), column_parallel_input(as_bf16(a.ln_1)), w.c_attn_w, w.c_attn_b, BT, C, 3 * Cl);
  } else {
    layernorm_forward(a.ln_1, a.ln_1_mean, a.ln_1_rstd, residual, w.ln_1_w, w.ln_1_b, Ns, C);
    matmul_forward(a.qkv, column_parallel_input(a.ln_1), w.c_attn_w, w.c_attn_b, BT, C, 3 * Cl, /*accumulate=*/false, cmp);
  }
  {
    const Stopwatch sw(attention_ms != nullptr);
    if (shape_.sparse.enabled)
      sparse_attention_forward(a.atty, a.att, sparse_att_stride_, a.qkv, sparse_layouts_[global_block], B, T, Cl, H,
                               attn_drop);
    else if (lp) attention_forward(as_bf16(a.atty), a.att, as_bf16(a.qkv), B, T, Cl, H, cmp, attn_drop);
    else attention_forward(a.atty, a.att, a.qkv, B, T, Cl, H, cmp, attn_drop);
    if (attention_ms) *attention_ms += sw.ms();
  }
  if (lp && !tp && attn_out_drop.on()) {
    dropped_output(a.res_2, residual, as_bf16(a.atty), w.attn_proj_w, w.attn_proj_b, C, attn_out_drop);
  } else if (lp && !tp) {
    matmul_forward_adding(a.res_2, residual, as_bf16(a.atty), w.attn_proj_w, w.attn_proj_b, BT, C, C);
  } else if (!tp && attn_out_drop.on()) {
    dropped_output(a.res_2, residual, a.atty, w.attn_proj_w, w.attn_proj_b, C, attn_out_drop);
  } else if (!tp) {
    copy(a.res_2, residual, BT * C);
    matmul_forward(a.res_2, a.atty, w.attn_proj_w, w.attn_proj_b, BT, C, C, /*accumulate=*/true, cmp);
  } else {
    if (lp) matmul_forward(row_out_, as_bf16(a.atty), w.attn_proj_w, static_cast<const P*>(nullptr), BT, Cl, C, false, cmp);
    else matmul_forward(row_out_, a.atty, w.attn_proj_w, static_cast<const P*>(nullptr), BT, Cl, C, false, cmp);
    row_output(a.res_2, residual, w.attn_proj_b, attn_out_drop);
  }
  if (scale != 1.0f) scale_residual_branch(a.res_2, residual, scale, Ns * C);  // progressive layer drop's 1/p
  // x + mlp(ln_2(x)): c_fc column-parallel, mlp.c_proj row-parallel
  region.next(obs::mlp_module(c.first_block + l));
  if (lp_mlp) layernorm_forward(as_bf16(a.ln_2), a.ln_2_mean, a.ln_2_rstd, a.res_2, w.ln_2_w, w.ln_2_b, Ns, C);
  else layernorm_forward(a.ln_2, a.ln_2_mean, a.ln_2_rstd, a.res_2, w.ln_2_w, w.ln_2_b, Ns, C);
  if (shape_.moe.is_moe_block(global_block)) {
    MoeActivations& m = *moe_saves(c, l, *buf);
    if (shape_.moe.use_residual) {  // PR-MoE's dense branch: mlp_out = mlp(ln_2), no residual yet
      matmul_forward(a.fch, column_parallel_input(a.ln_2), w.c_fc_w, w.c_fc_b, BT, C, 4 * Cl, /*accumulate=*/false, cmp);
      gelu_forward(a.fch_gelu, a.fch, BT * 4 * Cl);
      if (!tp) {
        matmul_forward(m.mlp_out, a.fch_gelu, w.mlp_proj_w, w.mlp_proj_b, BT, 4 * C, C, /*accumulate=*/false, cmp);
      } else {
        matmul_forward(row_out_, a.fch_gelu, w.mlp_proj_w, static_cast<const P*>(nullptr), BT, 4 * Cl, C, false, cmp);
        reduce_from_tp_region_forward(tp_, row_out_, BT * C);
        copy(m.mlp_out, row_out_, BT * C);
        add_bias_rows(m.mlp_out, w.mlp_proj_b, BT, C);
      }
    }
    moe_forward<P>(global_block, a, m, w, *buf, store);
    if (scale != 1.0f) scale_residual_branch(a.res_3, a.res_2, scale, Ns * C);
    store.release(u);
    store.progress();
    return;
  }
  if (lp_mlp) {  // c_fc writes bf16 (as autocast's linear does): GELU reads half the bytes
    matmul_forward(as_bf16(a.fch), column_parallel_input(as_bf16(a.ln_2)), w.c_fc_w, w.c_fc_b, BT, C, 4 * Cl);
    gelu_forward(as_bf16(a.fch_gelu), as_bf16(a.fch), BT * 4 * Cl);
    if (tp) {
      matmul_forward(row_out_, as_bf16(a.fch_gelu), w.mlp_proj_w, static_cast<const P*>(nullptr), BT, 4 * Cl, C, false,
                     cmp);
      row_output(a.res_3, a.res_2, w.mlp_proj_b, mlp_out_drop);
    } else if (mlp_out_drop.on()) {
      dropped_output(a.res_3, a.res_2, as_bf16(a.fch_gelu), w.mlp_proj_w, w.mlp_proj_b, 4 * C, mlp_out_drop);
    } else {
      matmul_forward_adding(a.res_3, a.res_2, as_bf16(a.fch_gelu), w.mlp_proj_w, w.mlp_proj_b, BT, 4 * C, C);
    }
    if (scale != 1.0f) scale_residual_branch(a.res_3, a.res_2, scale, Ns * C);
    store.release(u);
    store.progress();
    return;
  }
  matmul_forward(a.fch, column_parallel_input(a.ln_2), w.c_fc_w, w.c_fc_b, BT, C, 4 * Cl, /*accumulate=*/false, cmp);
  gelu_forward(a.fch_gelu, a.fch, BT * 4 * Cl);
  if (!tp && mlp_out_drop.on()) {
    dropped_output(a.res_3, a.res_2, a.fch_gelu, w.mlp_proj_w, w.mlp_proj_b, 4 * C, mlp_out_drop);
  } else if (!tp) {
    copy(a.res_3, a.res_2, BT * C);
    matmul_forward(a.res_3, a.fch_gelu, w.mlp_proj_w, w.mlp_proj_b, BT, 4 * C, C, /*accumulate=*/true, cmp);
  } else {
    matmul_forward(row_out_, a.fch_gelu, w.mlp_proj_w, static_cast<const P*>(nullptr), BT, 4 * Cl, C, false, cmp);
    row_output(a.res_3, a.res_2, w.mlp_proj_b, mlp_out_drop);
  }
  if (scale != 1.0f) scale_residual_branch(a.res_3, a.res_2, scale, Ns * C);
  store.release(u);
  store.progress();
}

template <typename P>
float GPT::forward_impl(const ModelChunk& c, ActivationBuffer& buf, ParamStore& store) {
  const int64_t B = B_, T = T_, C = shape_.n_embd, V = Vl_, BT = B * T, Ns = Ns_;
  const bool tp = part_.tp_size > 1, sp = tp_.sequence_parallel;
  const DType cmp = compute_type();
  buf.aux_loss = 0.0;
  begin_pass(buf);
  if (c.embedding) {
    const P* E = static_cast<const P*>(store.fetch(c.embed_unit));  // wte [V(/t),C] then wpe [T,C]
    const obs::Region region(obs::embedding_module());
    if (shape_.llama() && !tp) {  // embed_tokens alone: RoPE places tokens inside attention
      token_embedding_forward(buf.input, buf.tokens, E, BT, C);
    } else if (shape_.llama()) {  // vocab-parallel: each rank looks up the ids it owns, the group sums
      float* lookup = sp ? row_out_ : buf.input;
      vocab_embedding_forward(lookup, buf.tokens, E, part_.vocab_begin, V, BT, C);
      if (!sp) reduce_from_tp_region_forward(tp_, buf.input, BT * C);
      else reduce_scatter_to_sequence_parallel_region_forward(tp_, row_out_, buf.input, Ns * C);
    } else if (!tp) {
      encoder_forward(buf.input, buf.tokens, E, E + V * C, B, T, C);
    } else {  // vocab-parallel: each rank looks up the ids it owns, the group sums, then + wpe
      float* lookup = sp ? row_out_ : buf.input;
      vocab_embedding_forward(lookup, buf.tokens, E, part_.vocab_begin, V, BT, C);
      if (!sp) reduce_from_tp_region_forward(tp_, buf.input, BT * C);
      else reduce_scatter_to_sequence_parallel_region_forward(tp_, row_out_, buf.input, Ns * C);
      add_position_embedding(buf.input, E + V * C, sp ? tp_.rank * Ns : 0, Ns, T, C);
    }
    const DropoutMask drop = dropout_mask(shape_.dropout.embd, 0, DropoutSite::Embedding);  // GPT2Model's drop
    if (drop.on()) dropout_rows(buf.input, buf.input, drop, first_row(), Ns, T, C);
    store.release(c.embed_unit);
  }
  if (ac_.full()) {
    // Checkpoints of `interval` blocks: each saves its input, runs its blocks in the shared
    // recompute workspace and keeps only its output (the next checkpoint's input).
    const int N = ac_.interval;
    for (int g = 0, g0 = 0; g0 < c.num_blocks; ++g, g0 += N) {
      const int n = std::min(N, c.num_blocks - g0);
      const float* in = g == 0 ? buf.input : ckpt_input_;
      checkpoint_boundary();
      const Stopwatch sw(ac_.profile);
      save_checkpoint(buf, g, in);
      for (int i = 0; i < n; ++i)
        block_forward<P>(c, g0 + i, recompute_blocks_[i], i == 0 ? in : recompute_blocks_[i - 1].res_3, store, nullptr,
                         nullptr, block_scale(buf, c, g0 + i));
      copy(g0 + n == c.num_blocks ? buf.output : ckpt_input_, recompute_blocks_[n - 1].res_3, Ns * C);
      if (ac_.profile) time_of(c.first_block + g0, n).forward_ms += sw.ms();
      checkpoint_boundary();
    }
  } else {
    const bool timed = ac_.selective() && ac_.profile;
    for (int l = 0; l < c.num_blocks; ++l) {
      if (ac_.selective()) checkpoint_boundary();
      double attention_ms = 0.0;
      block_forward<P>(c, l, buf.blocks[l], l == 0 ? buf.input : buf.blocks[l - 1].res_3, store,
                       timed ? &attention_ms : nullptr, &buf, block_scale(buf, c, l));
      if (timed) time_of(c.first_block + l, 1).forward_ms += attention_ms;
    }
  }
  if (shape_.family.mixtral()) mixtral_router_loss(c, buf);
  if (!c.final) return 0.0f;
  const float* x = chunk_output(c, buf);
  const P* F = static_cast<const P*>(store.fetch(c.final_unit));  // weight [C] then bias [C] (model.norm: weight)
  obs::Region head(obs::ln_f_module(static_cast<int>(shape_.n_layer)));
  // ln_f over this rank's tokens; the head reads all tokens (gathered with sequence parallelism)
  if (shape_.llama())
    rmsnorm_forward(sp ? shard_ : buf.ln_f, buf.ln_f_rstd, x, F, Ns, C, static_cast<float>(shape_.family.rms_norm_eps));
  else layernorm_forward(sp ? shard_ : buf.ln_f, buf.ln_f_mean, buf.ln_f_rstd, x, F, F + C, Ns, C);
  store.release(c.final_unit);
  if (sp) gather_from_sequence_parallel_region_forward(tp_, shard_, buf.ln_f, Ns * C);
  else copy_to_tp_region_forward(tp_, buf.ln_f, BT * C);
  // LM head tied to wte: logits = ln_f · wteᵀ (this rank's vocabulary rows with tensor parallelism);
  // an untied head's lm_head.weight [V, C] follows model.norm.weight in the final unit
  const P* E = static_cast<const P*>(store.fetch(c.head_unit)) + head_offset();
  head.next(obs::lm_head_module(static_cast<int>(shape_.n_layer)));
  const GemmOperand lnf{buf.ln_f, DType::F32, false, C}, wte{E, dtype_of<P>(), true, C};
  const bool logits16 = logits_bf16(cmp);  // rounded in the product's epilogue
  if (logits16) gemm_bf16_output(BT, V, C, gemm_operand(lnf, BT * C, cmp), wte, as_bf16(buf.logits));
  else gemm(BT, V, C, lnf, wte, buf.logits, V, false, cmp);
  store.release(c.head_unit);
  // vocab-parallel cross-entropy: max, then sum-exp and target logit, over the group (fp32 row
  // statistics, whatever the logits' type)
  const auto vocab_parallel_crossentropy = [&](const auto* z) {
    const int64_t real = part_.vocab_real, v0 = part_.vocab_begin;
    vocab_ce_local_max(ce_max_, z, BT, V, real);
    tp_.all_reduce_max(ce_max_, BT);
    vocab_ce_local_sums(ce_sum_, ce_target_, z, ce_max_, buf.targets, v0, BT, V, real);
    tp_.all_reduce_sum(ce_sum_, 2 * BT);  // ce_sum_ and ce_target_ are adjacent
    vocab_ce_finish(buf.losses, buf.lse, ce_max_, ce_sum_, ce_target_, BT);
  };
  if (logits16 && tp) {
    vocab_parallel_crossentropy(as_bf16(buf.logits));
  } else if (logits16) {  // the real columns (ids < V) of rows padded to make_vocab_size_divisible_by
    crossentropy_forward(buf.losses, buf.lse, as_bf16(buf.logits), buf.targets, BT, part_.vocab_real, V);
  } else if (!tp) {
    crossentropy_forward(buf.losses, buf.lse, buf.logits, buf.targets, BT, part_.vocab_real, V);
  } else {
    vocab_parallel_crossentropy(buf.logits);
  }
  return sum(buf.losses, BT, "mean_loss") / static_cast<float>(BT);
}

// One backward over a chunk. Full: today's fused pass, every layer's input and weight
// gradients together, operands in scratch. Input (zero-bubble B): input gradients only, the
// output gradients the weight products need kept in buf.grad_operands. Weight (W): the weight
// products from those operands and the forward saves, with no parameters fetched. Every
// kernel call is the same in all three, with the skipped part's pointers null, so a split
// backward computes the same numbers as a fused one. Where a bf16 fused pass rounds a gradient
// into the products' operand and sums its bias gradient beside it (GELU's with c_fc's, the
// attention's with c_attn's), the split keeps the fp32 values that pass computes, and its weight
// pass rounds and sums them in the same order (tests/kernels/test_split_backward.cpp): the same
// bits. Tensor-parallel regions sit on the lines mirroring the forward's.
template <typename P>
void GPT::backward_impl(const ModelChunk& c, ActivationBuffer& buf, float grad_scale, ParamStore& store,
                        BackwardPart part) {
  const int64_t B = B_, T = T_, C = shape_.n_embd, Cl = Cl_, H = Hl_, V = Vl_, BT = B * T, Ns = Ns_;
  const bool tp = part_.tp_size > 1, sp = tp_.sequence_parallel;
  const DType cmp = compute_type();
  const bool input = part != BackwardPart::Weight, weights = part != BackwardPart::Input;
  const bool keep = part == BackwardPart::Input;  // save operands for the later W pass
  float* dres = buf.d_input;  // the residual stream's gradient (this rank's tokens), from the chunk's end down
  float* dE = nullptr;        // the head's wte gradient stays open until the chunk is done
  begin_pass(buf);
  // A column-parallel layer's backward (tp_regions.hpp) with Conv1D's products.
  const auto column_backward = [&](float* dinp_shard, float* dweight, float* dbias, const float* dout, const float* x,
                                   const P* weight, int64_t IC, int64_t OC) {
    column_parallel_backward(dinp_shard, dweight, dbias, x, IC, store,
                             [&](float* dinp, float* dw_, float* db, const float* inp) {
                               matmul_backward(dinp, dw_, db, dout, inp, weight, BT, IC, OC, cmp);
                             });
  };

  if (c.final) {
    obs::Region head(obs::lm_head_module(static_cast<int>(shape_.n_layer)));
    const float* x = chunk_output(c, buf);
    float* dlnf = keep || part == BackwardPart::Weight ? buf.d_ln_f : dln_;  // this rank's tokens
    // loss = mean over BT tokens, so each token's loss carries weight grad_scale / BT.
    const float dloss = grad_scale / static_cast<float>(BT);
    // bf16 logits (logits_bf16) take their gradient in place, the products' bf16 operand for both
    // passes. Otherwise a full pass in bf16 writes the gradient straight into the products' bf16
    // operand (the fused classifier), and a split pass keeps it in fp32 in the logits for its
    // weight pass.
    const bool logits16 = logits_bf16(cmp);
    const bool fused_classifier = !logits16 && part == BackwardPart::Full && !tp && cmp == DType::BF16;
    if (input && logits16) {
      bf16* z = as_bf16(buf.logits);
      if (!tp)
        crossentropy_backward_bf16(z, static_cast<const bf16*>(z), buf.lse, buf.targets, dloss, BT, part_.vocab_real, V);
      else vocab_ce_backward_bf16(z, buf.lse, buf.targets, dloss, part_.vocab_begin, BT, V, part_.vocab_real);
    } else if (input && !fused_classifier) {
      if (!tp) crossentropy_backward(buf.logits, buf.lse, buf.targets, dloss, BT, part_.vocab_real, V);
      else vocab_ce_backward(buf.logits, buf.lse, buf.targets, dloss, part_.vocab_begin, BT, V, part_.vocab_real);
    }
    const float* dlogits = buf.logits;
    const GemmOperand dlogits16{as_bf16(buf.logits), DType::BF16, false, V};
    // tied head: dln_f = dlogits · wte ; dwte += dlogitsᵀ · ln_f (an untied head: lm_head.weight's)
    if (weights) dE = store.grad_target(c.head_unit) + head_offset();
    if (input) {
      const P* E = static_cast<const P*>(store.fetch(c.head_unit)) + head_offset();
      GemmOperand d{};  // dlogits in the products' type, made once for both
      if (logits16) {
        d = dlogits16;
      } else if (fused_classifier) {
        d = gemm_operand_slot(BT, V);
        crossentropy_backward_bf16(static_cast<bf16*>(const_cast<void*>(d.data)), buf.logits, buf.lse, buf.targets,
                                   dloss, BT, part_.vocab_real, V);
      } else {
        d = gemm_operand({dlogits, DType::F32, false, V}, BT * V, cmp);
      }
      float* dlnf_all = sp ? row_out_ : dlnf;
      gemm(BT, C, V, d, {E, dtype_of<P>(), false, C}, dlnf_all, C, false, cmp);
      if (weights) gemm(V, C, BT, {d.data, d.type, true, V}, {buf.ln_f, DType::F32, false, C}, dE, C, true, cmp);
      store.release(c.head_unit);
      if (sp) gather_from_sequence_parallel_region_backward(tp_, dlnf_all, dlnf, Ns * C);
      else copy_to_tp_region_backward(tp_, dlnf, BT * C);
    } else {
      const GemmOperand d = logits16 ? dlogits16 : gemm_operand({dlogits, DType::F32, false, V}, BT * V, cmp);
      gemm(V, C, BT, {d.data, d.type, true, V}, {buf.ln_f, DType::F32, false, C}, dE, C, true, cmp);
    }
    head.next(obs::ln_f_module(static_cast<int>(shape_.n_layer)));
    if (input) Kokkos::deep_copy(Kokkos::View<float*, Kokkos::MemoryUnmanaged>(dres, Ns * C), 0.0f);
    const P* F = input ? static_cast<const P*>(store.fetch(c.final_unit)) : nullptr;
    // an untied head's unit is the final unit, whose gradients the head has opened already
    float* dF = !weights ? nullptr : c.head_unit == c.final_unit ? dE - head_offset() : store.grad_target(c.final_unit);
    if (shape_.llama())
      rmsnorm_backward(input ? dres : nullptr, dF, dlnf, x, F, buf.ln_f_rstd, Ns, C);
    else
      layernorm_backward(input ? dres : nullptr, dF, dF ? dF + C : nullptr, dlnf, x, F, buf.ln_f_mean, buf.ln_f_rstd,
                         Ns, C);
    if (input) store.release(c.final_unit);
    if (weights) store.grads_done(c.final_unit);
  } else if (input) {
    copy(dres, buf.d_output, Ns * C);
  }

  // One block's backward from its saves `a` and its input `residual`; dres holds d(res_3) on entry
  // and d(residual) on exit.
  const auto block_backward = [&](int l, const BlockActivations& a, const float* residual) {
    const float s = block_scale(buf, c, l);  // progressive layer drop: 0 dropped, else the branches' 1/p
    if (shape_.llama()) {
      if (s != 1.0f) throw std::logic_error("progressive layer drop reached a Llama-family block");
      return llama_block_backward<P>(c, l, a, residual, buf, dres, store, part, grad_scale);
    }
    if (s == 0.0f) return dropped_block_backward(c, l, store, part);
    const int u = c.first_block_unit + l, global_block = c.first_block + l;
    obs::Region region(obs::mlp_module(c.first_block + l));
    const BlockTensors<const P> w =
        input ? block(static_cast<const P*>(store.fetch(u)), global_block) : BlockTensors<const P>{};
    const BlockTensors<float> dw = weights ? block(store.grad_target(u), global_block) : BlockTensors<float>{};
    // each weight's gradient is one product: into a zeroed window it is written, not added
    const bool add_dw = !(weights && store.grads_start_at_zero(u));
    // Where the output gradients of the five products and two LayerNorms live.
    const bool saved = part != BackwardPart::Full;
    const BlockGradOperands& g = saved ? buf.grad_operands[l] : BlockGradOperands{};
    float* d_fch = saved ? g.d_fch : dfch_;
    float* d_ln_2 = saved ? g.d_ln_2 : dln_;
    float* d_qkv = saved ? g.d_qkv : dqkv_;
    float* d_ln_1 = saved ? g.d_ln_1 : dln_;
    // MLP half: dres holds d(res_3); the row-parallel product's output gradient covers all tokens.
    // Under resid_pdrop the branch's gradient is d(res_3) ∘ mask, made in dln_ (free until c_fc's
    // backward writes d(ln_2), after the branch's product has read it).
    if (input && s != 1.0f) scaled_branch_backward_begin(dres, s);
    const float* d_branch = input ? dropped_gradient(dres, global_block, DropoutSite::MlpOutput) : dres;
    const float* d_res_3 =
        part == BackwardPart::Weight ? g.d_res_3 : row_output_grad(d_branch, saved ? g.d_res_3 : gathered_);
    if (keep && !sp) copy(g.d_res_3, d_branch, BT * C);
    // An MoE block (full backward only: model.moe excludes split schedules): the dense branch of
    // residual MoE reads d(mlp_out), the MoE part then adds its input gradients into d(ln_2).
    const bool moe = shape_.moe.is_moe_block(global_block);
    const MoeActivations* m = moe ? moe_saves(c, l, buf) : nullptr;
    const float* d_mlp = d_res_3;
    if (moe && shape_.moe.use_residual) {
      moe_mix_backward(*m, d_res_3, moe_tokens_c_);
      d_mlp = moe_tokens_c_;
    }
    const bool lp = !shape_.sparse.enabled && activations_bf16(cmp, tp, moe, false),
               lp_mlp = activations_bf16(cmp, tp, moe, true);
    // A column-parallel product's backward from its kept bf16 saves (x: the norm's output) and dout
    // in the products' form or fp32: column_parallel_backward's regions, which one rank passes
    // straight through.
    const auto bf16_column_backward = [&](float* dinp, float* dweight, float* dbias, const auto& dout, const bf16* x,
                                          const P* weight, int64_t OC) {
      column_parallel_backward(dinp, dweight, dbias, x, C, store,
                               [&](float* di, float* dw_, float* db, const auto* inp) {
                                 if constexpr (std::is_same_v<std::decay_t<decltype(dout)>, GemmOperand>) {
                                   (void)db;  // taken where dout was made
                                   matmul_backward(di, dw_, dout, inp, weight, BT, C, OC, cmp, add_dw);
                                 } else {
                                   matmul_backward(di, dw_, db, dout, inp, weight, BT, C, OC, cmp, add_dw);
                                 }
                               });
    };
    if (lp_mlp) {  // the forward kept c_fc's output, the GELU output and ln_2 in bf16
      matmul_backward(input ? d_fch : nullptr, weights ? dw.mlp_proj_w : nullptr, weights ? dw.mlp_proj_b : nullptr,
                      d_mlp, as_bf16(a.fch_gelu), w.mlp_proj_w, BT, 4 * Cl, C, cmp, add_dw);
      store.progress();
      if (part == BackwardPart::Full) {  // GELU's gradient made in the products' bf16, c_fc's bias gradient beside it
        const GemmOperand d = gemm_operand_slot(BT, 4 * Cl);
        gelu_backward_summing_columns(static_cast<bf16*>(const_cast<void*>(d.data)), dw.c_fc_b, as_bf16(a.fch), d_fch,
                                      BT, 4 * Cl);
        bf16_column_backward(d_ln_2, dw.c_fc_w, nullptr, d, as_bf16(a.ln_2), w.c_fc_w, 4 * Cl);
      } else {  // a split backward keeps the fp32 gradient (the values above) for its weight pass
        if (input) gelu_backward(d_fch, as_bf16(a.fch), d_fch, BT, 4 * Cl);
        bf16_column_backward(input ? d_ln_2 : nullptr, weights ? dw.c_fc_w : nullptr, weights ? dw.c_fc_b : nullptr,
                             static_cast<const float*>(d_fch), as_bf16(a.ln_2), w.c_fc_w, 4 * Cl);
      }
    } else if (!moe || shape_.moe.use_residual) {
      matmul_backward(input ? d_fch : nullptr, weights ? dw.mlp_proj_w : nullptr, weights ? dw.mlp_proj_b : nullptr,
                      d_mlp, a.fch_gelu, w.mlp_proj_w, BT, 4 * Cl, C, cmp, add_dw);
      store.progress();
      if (input) gelu_backward(d_fch, a.fch, d_fch, BT * 4 * Cl);
      if (!tp) {
        matmul_backward(input ? d_ln_2 : nullptr, weights ? dw.c_fc_w : nullptr, weights ? dw.c_fc_b : nullptr, d_fch,
                        a.ln_2, w.c_fc_w, BT, C, 4 * Cl, cmp, add_dw);
      } else {
        column_backward(input ? d_ln_2 : nullptr, weights ? dw.c_fc_w : nullptr, weights ? dw.c_fc_b : nullptr, d_fch,
                        a.ln_2, w.c_fc_w, C, 4 * Cl);
      }
    }
    if (moe) moe_backward<P>(global_block, a, *m, w, dw, d_res_3, d_ln_2, grad_scale, store);
    store.progress();
    layernorm_backward(input ? dres : nullptr, weights ? dw.ln_2_w : nullptr, weights ? dw.ln_2_b : nullptr, d_ln_2,
                       a.res_2, w.ln_2_w, a.ln_2_mean, a.ln_2_rstd, Ns, C);
    if (input && s != 1.0f) scaled_branch_backward_end(dres, s);
    // attention half: dres now holds d(res_2)
    region.next(obs::attention_module(c.first_block + l));
    if (input && s != 1.0f) scaled_branch_backward_begin(dres, s);
    const float* d_branch_2 = input ? dropped_gradient(dres, global_block, DropoutSite::AttentionOutput) : dres;
    const float* d_res_2 =
        part == BackwardPart::Weight ? g.d_res_2 : row_output_grad(d_branch_2, saved ? g.d_res_2 : gathered_);
    if (keep && !sp) copy(g.d_res_2, d_branch_2, BT * C);
    // attn_pdrop's mask, redrawn (also by the recompute: the bf16 kernel it picks depends on it)
    const DropoutMask attn_drop = dropout_mask(shape_.dropout.attn, global_block, DropoutSite::Probabilities);
    if (input && ac_.selective()) {  // the attention probabilities were not kept: recompute them
      const obs::PassScope recompute(obs::Pass::Recompute);
      checkpoint_boundary();
      const Stopwatch sw(ac_.profile);
      if (shape_.sparse.enabled)  // datty_ is free until the product below
        sparse_attention_forward(datty_, a.att, sparse_att_stride_, a.qkv, sparse_layouts_[c.first_block + l], B, T,
                                 Cl, H, attn_drop);
      else if (lp) attention_forward(datty_, a.att, as_bf16(a.qkv), B, T, Cl, H, cmp, attn_drop);
      else attention_forward(datty_, a.att, a.qkv, B, T, Cl, H, cmp, attn_drop);
      if (ac_.profile) time_of(c.first_block + l, 1).recompute_ms += sw.ms();
      checkpoint_boundary();
    }
    if (lp)
      matmul_backward(input ? datty_ : nullptr, weights ? dw.attn_proj_w : nullptr, weights ? dw.attn_proj_b : nullptr,
                      d_res_2, as_bf16(a.atty), w.attn_proj_w, BT, Cl, C, cmp, add_dw);
    else
      matmul_backward(input ? datty_ : nullptr, weights ? dw.attn_proj_w : nullptr, weights ? dw.attn_proj_b : nullptr,
                      d_res_2, a.atty, w.attn_proj_w, BT, Cl, C, cmp, add_dw);
    store.progress();
    // a whole backward makes dqkv in the products' bf16 directly, c_attn's bias gradient beside it
    const bool dqkv_bf16 = lp && part == BackwardPart::Full;
    const GemmOperand dqkv_slot = dqkv_bf16 ? gemm_operand_slot(BT, 3 * Cl) : GemmOperand{};
    if (input && shape_.sparse.enabled)
      sparse_attention_backward(d_qkv, datty_, a.qkv, a.att, sparse_att_stride_, sparse_layouts_[c.first_block + l], B,
                                T, Cl, H, attn_drop);
    else if (dqkv_bf16)
      attention_backward_summing_columns(static_cast<bf16*>(const_cast<void*>(dqkv_slot.data)), dw.c_attn_b, d_qkv,
                                         datty_, as_bf16(a.qkv), a.att, B, T, Cl, H, attn_drop);
    else if (input && lp)
      attention_backward(d_qkv, datt_scratch_, datty_, as_bf16(a.qkv), a.att, B, T, Cl, H, cmp, attn_drop);
    else if (input) attention_backward(d_qkv, datt_scratch_, datty_, a.qkv, a.att, B, T, Cl, H, cmp, attn_drop);
    store.progress();
    if (dqkv_bf16) {
      bf16_column_backward(d_ln_1, dw.c_attn_w, nullptr, dqkv_slot, as_bf16(a.ln_1), w.c_attn_w, 3 * Cl);
    } else if (lp) {
      bf16_column_backward(input ? d_ln_1 : nullptr, weights ? dw.c_attn_w : nullptr, weights ? dw.c_attn_b : nullptr,
                           static_cast<const float*>(d_qkv), as_bf16(a.ln_1), w.c_attn_w, 3 * Cl);
    } else if (!tp) {
      matmul_backward(input ? d_ln_1 : nullptr, weights ? dw.c_attn_w : nullptr, weights ? dw.c_attn_b : nullptr,
                      d_qkv, a.ln_1, w.c_attn_w, BT, C, 3 * Cl, cmp, add_dw);
    } else {
      column_backward(input ? d_ln_1 : nullptr, weights ? dw.c_attn_w : nullptr, weights ? dw.c_attn_b : nullptr,
                      d_qkv, a.ln_1, w.c_attn_w, C, 3 * Cl);
    }
    layernorm_backward(input ? dres : nullptr, weights ? dw.ln_1_w : nullptr, weights ? dw.ln_1_b : nullptr, d_ln_1,
                       residual, w.ln_1_w, a.ln_1_mean, a.ln_1_rstd, Ns, C);
    if (input && s != 1.0f) scaled_branch_backward_end(dres, s);
    if (input) store.release(u);
    if (weights) store.grads_done(u);
  };
  if (!ac_.full()) {
    for (int l = c.num_blocks - 1; l >= 0; --l)
      block_backward(l, buf.blocks[l], l == 0 ? buf.input : buf.blocks[l - 1].res_3);
  } else {
    // Each checkpoint, last first: restore its input, recompute its blocks with the forward's
    // code into the workspace, then run their backward (DeepSpeed CheckpointFunction.backward).
    const int N = ac_.interval;
    for (int g = (c.num_blocks - 1) / N, g0 = g * N; g0 >= 0 && c.num_blocks > 0; --g, g0 -= N) {
      const int n = std::min(N, c.num_blocks - g0);
      checkpoint_boundary();
      const Stopwatch sw(ac_.profile);
      const float* in = restore_checkpoint(buf, g);
      obs::PassScope recompute(obs::Pass::Recompute);
      for (int i = 0; i < n; ++i)
        block_forward<P>(c, g0 + i, recompute_blocks_[i], i == 0 ? in : recompute_blocks_[i - 1].res_3, store, nullptr,
                         nullptr, block_scale(buf, c, g0 + i));
      recompute.end();
      if (ac_.profile) time_of(c.first_block + g0, n).recompute_ms += sw.ms();
      checkpoint_boundary();
      for (int i = n - 1; i >= 0; --i)
        block_backward(g0 + i, recompute_blocks_[i], i == 0 ? in : recompute_blocks_[i - 1].res_3);
    }
  }
  if (c.embedding && weights) {
    const obs::Region region(obs::embedding_module());
    // one stage: the head already opened the embedding unit's gradients (asking again would reset them)
    float* dEmb = dE && c.head_unit == c.embed_unit ? dE : store.grad_target(c.embed_unit);
    // the embedding's output gradient over all tokens (gathered from the shards with sequence
    // parallelism); through embd_pdrop's mask first (in place: no later pass reads this chunk's d(input))
    const DropoutMask drop = dropout_mask(shape_.dropout.embd, 0, DropoutSite::Embedding);
    if (drop.on()) dropout_rows(dres, dres, drop, first_row(), Ns, T, C);
    const float* d_embedded = dres;
    if (sp) {
      reduce_scatter_to_sequence_parallel_region_backward(tp_, dres, gathered_, Ns * C);
      d_embedded = gathered_;
    } else {
      reduce_from_tp_region_backward(tp_, dres, BT * C);
    }
    if (shape_.llama()) token_embedding_backward(dEmb, d_embedded, buf.tokens, part_.vocab_begin, V, BT, C);
    else if (!tp) encoder_backward(dEmb, dEmb + V * C, d_embedded, buf.tokens, B, T, C);  // no parameters needed
    else vocab_embedding_backward(dEmb, dEmb + V * C, d_embedded, buf.tokens, part_.vocab_begin, V, B, T, C);
    store.grads_done(c.embed_unit);
  } else if (c.final && weights && c.head_unit != c.final_unit) {
    store.grads_done(c.head_unit);  // the tied copy: complete once the chunk is done
  }
}

// Checkpoint g's input into its slot: this rank's contiguous 1/t of the flattened tensor when
// partitioned (DeepSpeed's partition: start = numel/t · rank, FACTS-2 §6.2), else all of it.
void GPT::save_checkpoint(ActivationBuffer& buf, int g, const float* input) const {
  const bool split = ac_.partition_activations && part_.tp_size > 1;
  copy_spaces(buf.checkpoints[g], ac_.cpu_checkpointing, split ? input + part_.tp_rank * ckpt_slot_ : input, false,
              ckpt_slot_);
}

// Checkpoint g's whole input on the device: the slot itself, or rebuilt in the workspace
// (brought from host memory; partitions all-gathered over the tensor group, FACTS-2 §6.3).
const float* GPT::restore_checkpoint(ActivationBuffer& buf, int g) {
  const bool split = ac_.partition_activations && part_.tp_size > 1, host = ac_.cpu_checkpointing;
  const float* saved = buf.checkpoints[g];
  if (!split && !host) return saved;
  if (!split) {
    copy_spaces(ckpt_input_, false, saved, true, ckpt_slot_);
    return ckpt_input_;
  }
  if (host) {
    copy_spaces(ckpt_staging_, false, saved, true, ckpt_slot_);
    saved = ckpt_staging_;
  }
  tp_.all_gather_tokens(saved, ckpt_input_, ckpt_slot_);
  return ckpt_input_;
}

// synchronize_checkpoint_boundary: DeepSpeed synchronises the device at each boundary; here
// also the tensor group, the ranks that run the same checkpoints in step.
void GPT::checkpoint_boundary() const {
  if (!ac_.synchronize_checkpoint_boundary) return;
  Kokkos::fence();
  if (tp_.comm && tp_.size > 1) tp_.comm->barrier();
}

GPT::CheckpointTime& GPT::time_of(int first_block, int num_blocks) {
  for (CheckpointTime& t : times_)
    if (t.first_block == first_block) return t;
  times_.push_back({first_block, num_blocks, 0.0, 0.0});
  return times_.back();
}

void GPT::reset_checkpoint_times() {
  for (CheckpointTime& t : times_) t.forward_ms = t.recompute_ms = 0.0;
}


const float* GPT::column_parallel_input(const float* x) {
  if (tp_.sequence_parallel) {  // Megatron's "g": all tokens gathered from the shards
    gather_from_sequence_parallel_region_forward(tp_, x, gathered_, Ns_ * shape_.n_embd);
    return gathered_;
  }
  copy_to_tp_region_forward(tp_, x, B_ * T_ * shape_.n_embd);  // "f": the identity forward
  return x;
}

const bf16* GPT::column_parallel_input(const bf16* x) {
  if (tp_.sequence_parallel) {  // "g" in bf16: half the bytes
    bf16* full = reinterpret_cast<bf16*>(gathered_);
    gather_from_sequence_parallel_region_forward(tp_, x, full, Ns_ * shape_.n_embd);
    return full;
  }
  return x;  // "f": the identity forward
}

const float* GPT::dropped_gradient(const float* d_res, int64_t layer, DropoutSite site) {
  const DropoutMask drop = dropout_mask(shape_.dropout.resid, layer, site);
  if (!drop.on()) return d_res;
  dropout_rows(dln_, d_res, drop, first_row(), Ns_, T_, shape_.n_embd);
  return dln_;
}

const float* GPT::row_output_grad(const float* d_shard, float* full) {
  const int64_t C = shape_.n_embd;
  if (!tp_.sequence_parallel) {
    reduce_from_tp_region_backward(tp_, d_shard, B_ * T_ * C);
    return d_shard;
  }
  reduce_scatter_to_sequence_parallel_region_backward(tp_, d_shard, full, Ns_ * C);
  return full;
}
}  // namespace zero3d
