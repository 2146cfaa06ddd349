// moe_layer.cpp — an MoE block's MLP half (DEEPSPEED-FACTS-2 §4.5, DeepSpeed MOELayer; Megatron
// moe_layer.py): route → dispatch (all-to-all over the expert group) → experts → return
// (all-to-all back) → combine, and its backward on the mirrored lines.
//
// Tokens leave in dispatch order: experts ascending, each expert's kept tokens by slot. Expert e
// lives on expert rank e / (E/ep), so dispatch order is already grouped by destination rank. A
// rank receives, from each source in rank order, the rows of its local experts (expert by
// expert); the experts run on an expert-major copy of them.
//
// Expert gradients are reduced by the expert-data-parallel optimizer (the engine); everything
// here is local to the rank except the two all-to-alls (and, without drop_tokens, one MAX).
#include <algorithm>
#include <cmath>

#include "base/profiler.hpp"
#include "base/rng.hpp"
#include "kernels/elementwise.hpp"
#include "kernels/gelu.hpp"
#include "kernels/matmul.hpp"
#include "kernels/memory.hpp"
#include "kernels/moe.hpp"
#include "kernels/swiglu.hpp"
#include "model/model.hpp"
#include "parallel/comm.hpp"

namespace zero3d {

using namespace kernels;

namespace {

moe::GateConfig gate_config(const MoeShape& shape, const MoeRouting& r, bool training) {
  moe::GateConfig g;
  g.num_experts = static_cast<int>(shape.num_experts);
  g.k = r.k;
  g.capacity_factor = r.capacity_factor;
  g.eval_capacity_factor = r.eval_capacity_factor;
  g.min_capacity = r.min_capacity;
  g.drop_tokens = r.drop_tokens;
  g.use_rts = r.use_rts;
  g.top2_2nd_expert_sampling = r.top2_2nd_expert_sampling;
  g.noise = r.noise;
  g.training = training;
  g.mixtral = r.mixtral;
  return g;
}

// The gate's random draws for one block of one micro-batch: a stream of their own per (seed,
// micro-batch key, block, kind), so any layout that trains the same micro-batch draws the same.
enum class Draw : uint64_t { Jitter = 1, Uniform = 2, Gumbel = 3 };
void draw(std::vector<float>& out, int64_t n, const MoeRouting& r, uint64_t key, int block, Draw kind) {
  out.resize(static_cast<size_t>(n));
  Rng rng(r.seed ^ 0x6d6f65ull, Rng(key, static_cast<uint64_t>(block) * 4 + static_cast<uint64_t>(kind)).next_u64());
  for (int64_t i = 0; i < n; ++i) {
    const double u = rng.uniform();
    switch (kind) {
      case Draw::Jitter: out[i] = static_cast<float>(1.0 - 0.01 + 0.02 * u); break;  // U(1-eps, 1+eps), eps 1e-2
      case Draw::Uniform: out[i] = static_cast<float>(u); break;
      case Draw::Gumbel: out[i] = static_cast<float>(-std::log(-std::log(std::max(u, 1e-20)))); break;
    }
  }
}

// Mixtral's router jitter (MixtralSparseMoeBlock in training: hidden_states *= U(1 - j, 1 + j)):
// the factor of channel c of global token g (sample · T + position) in layer `layer` is draw c of
// Rng(seed ⊕ key, g · L + layer), SplitMix64 over a counter, so it depends on those alone and
// every layout that holds the token (any micro-batch split, data, expert or tensor rank, pipeline
// stage) multiplies it by the same factor. tests/golden/make_mixtral_goldens.py draws the same.
void mixtral_jitter(float* factors, const MoeRouting& r, int64_t layers, int layer, int64_t first_token, int64_t S,
                    int64_t C) {
  std::vector<float> host(static_cast<size_t>(S * C));
  const double j = r.router_jitter_noise;
  for (int64_t s = 0; s < S; ++s) {
    Rng rng(r.seed ^ 0x6a6974746572ull, static_cast<uint64_t>((first_token + s) * layers + layer));
    for (int64_t c = 0; c < C; ++c) host[s * C + c] = static_cast<float>(1.0 - j + 2.0 * j * rng.uniform());
  }
  copy_to_device(factors, host.data(), host.size() * sizeof(float));
}

// One expert's weights inside its unit: c_fc [C, F], c_fc.b [F], c_proj [F, C], c_proj.b [C], with
// F = 4C, or 4C/t of it under expert tensor parallelism. Mixtral's: w1 and w3 [I, C] (one [2I, C]
// matrix, fc_w), w2 [C, I] (proj_w), no biases; I/t of each under expert tensor parallelism.
template <typename T>
struct ExpertTensors {
  T *fc_w, *fc_b, *proj_w, *proj_b;
};
template <typename T>
ExpertTensors<T> expert_tensors(T* unit, int64_t i, int64_t C, const ExpertWidths& F, bool mixtral) {
  if (mixtral) {
    T* p = unit + i * (F.fch + F.act) * C;
    return {p, nullptr, p + F.fch * C, nullptr};
  }
  T* p = unit + i * (2 * C * F.fch + F.fch + C);
  return {p, p + C * F.fch, p + C * F.fch + F.fch, p + 2 * C * F.fch + F.fch};
}

void copy_rows(float* dst, const float* src, int64_t rows, int64_t width) {
  kernels::copy(dst, src, rows * width, "moe_copy_rows");
}

// Received rows (source-major: per source, its rows for each local expert) <-> expert-major (per
// local expert, its rows from each source), one block copy per (source, expert).
void permute_rows(float* dst, const float* src, const std::vector<int64_t>& recv_counts, int ep, int64_t local,
                  int64_t width, bool to_expert_major) {
  std::vector<int64_t> src_off(static_cast<size_t>(ep * local)), exp_off(static_cast<size_t>(ep * local));
  int64_t at = 0;
  for (int s = 0; s < ep; ++s)
    for (int64_t i = 0; i < local; ++i) src_off[s * local + i] = at, at += recv_counts[s * local + i];
  at = 0;
  for (int64_t i = 0; i < local; ++i)
    for (int s = 0; s < ep; ++s) exp_off[s * local + i] = at, at += recv_counts[s * local + i];
  for (int64_t j = 0; j < ep * local; ++j) {
    const int64_t from = to_expert_major ? src_off[j] : exp_off[j], to = to_expert_major ? exp_off[j] : src_off[j];
    copy_rows(dst + to * width, src + from * width, recv_counts[j], width);
  }
}

// Rows per local expert, summed over sources, and their first expert-major row.
std::vector<int64_t> expert_row_offsets(const std::vector<int64_t>& recv_counts, int ep, int64_t local) {
  std::vector<int64_t> off(static_cast<size_t>(local + 1), 0);
  for (int64_t i = 0; i < local; ++i) {
    int64_t n = 0;
    for (int s = 0; s < ep; ++s) n += recv_counts[s * local + i];
    off[i + 1] = off[i] + n;
  }
  return off;
}

// Rows per source rank from the per-(source, expert) counts.
std::vector<int64_t> rows_per_rank(const std::vector<int64_t>& counts, int ep, int64_t local, int64_t width) {
  std::vector<int64_t> out(static_cast<size_t>(ep), 0);
  for (int s = 0; s < ep; ++s)
    for (int64_t i = 0; i < local; ++i) out[s] += counts[s * local + i] * width;
  return out;
}

}  // namespace

template <typename P>
void GPT::moe_forward(int block, BlockActivations& a, MoeActivations& m, const BlockTensors<const P>& w,
                      ActivationBuffer& buf, ParamStore& store) {
  const int64_t S = B_ * T_, C = shape_.n_embd, E = shape_.moe.num_experts;
  const int ep = part_.ep_size;
  const int64_t local = E / ep;
  const DType cmp = compute_type();
  const moe::GateConfig gc = gate_config(shape_.moe, moe_, buf.training);
  const bool mixtral = shape_.family.mixtral();
  // The gate in fp32 (TopKGate casts input and wg to fp32): logits = (ln_2 ∘ jitter) · wg
  const float* gate_in = a.ln_2;
  std::vector<float> draws_a, draws_b;
  if (moe::uses_jitter(gc)) {
    draw(draws_a, S * C, moe_, buf.draw_key, block, Draw::Jitter);
    copy_to_device(m.gate_noise, draws_a.data(), draws_a.size() * sizeof(float));  // host draws into model memory
    moe::jitter_forward(moe_tokens_c_, a.ln_2, m.gate_noise, S * C);
    gate_in = moe_tokens_c_;
  } else if (mixtral && moe_.router_jitter_noise > 0.0 && buf.training) {
    mixtral_jitter(m.gate_noise, moe_, shape_.n_layer, block, buf.first_sample * T_, S, C);
    moe::jitter_forward(moe_tokens_c_, a.ln_2, m.gate_noise, S * C);
    gate_in = moe_tokens_c_;
  }
  // (Mixtral's router is an nn.Linear [E, C]; GPT-2's gate is stored input-major [C, E])
  if (mixtral) linear_forward(moe_logits_, gate_in, w.gate_w, static_cast<const P*>(nullptr), S, C, E, false, DType::F32);
  else matmul_forward(moe_logits_, gate_in, w.gate_w, static_cast<const P*>(nullptr), S, C, E, false, DType::F32);
  moe::GateDraws host_draws;
  if (moe::uses_rts_uniform(gc)) draw(draws_a, S * E, moe_, buf.draw_key, block, Draw::Uniform), host_draws.rts_uniform = draws_a.data();
  if (moe::uses_gumbel(gc)) draw(draws_b, S * E, moe_, buf.draw_key, block, Draw::Gumbel), host_draws.gumbel = draws_b.data();
  if (!m.routing) m.routing = std::make_shared<moe::Routing>();
  moe::Routing& r = *m.routing;
  // The device form reads the same draws, copied once into model memory.
  const moe::GateDraws draws = moe::draws_for_form(r, moe::routes_on_device(), host_draws, S * E);
  moe::gate_forward_choose(moe_logits_, S, gc, draws, r);
  int64_t capacity = 0;
  if (gc.drop_tokens) {
    capacity = moe::capacity(S, gc);
  } else {  // DeepSpeed: the largest expert load, agreed over the expert group (all-reduce MAX)
    int64_t most = *std::max_element(r.exp_counts.begin(), r.exp_counts.end());
    if (ep > 1) moe_.expert->all_reduce(&most, 1, DType::I64, ReduceOp::Max);
    capacity = moe::capacity_without_drops(most, S, 1, gc);
  }
  moe::gate_forward_assign(capacity, gc, draws, r);
  buf.aux_loss += r.l_aux;
  // Dispatch: rows in expert order are grouped by expert rank; counts travel first. (DeepSpeed's
  // Jitter noises the gate's input only; Mixtral's experts take the noisy input the router saw.)
  moe::dispatch_forward(moe_send_, mixtral ? gate_in : a.ln_2, r, C);
  m.send_rows.assign(static_cast<size_t>(ep), 0);
  for (int j = 0; j < ep; ++j) m.send_rows[j] = r.row_offset[(j + 1) * local] - r.row_offset[j * local];
  m.recv_counts.assign(static_cast<size_t>(ep * local), 0);
  if (ep > 1) {
    moe_.expert->all_to_all(r.kept_per_expert.data(), m.recv_counts.data(), local, DType::I64);
  } else {
    std::copy(r.kept_per_expert.begin(), r.kept_per_expert.end(), m.recv_counts.begin());
  }
  const std::vector<int64_t> offsets = expert_row_offsets(m.recv_counts, ep, local);
  const int64_t R = offsets.back();
  if (R > moe_rows_) throw std::logic_error("MoE rows received exceed the planned bound");
  std::vector<int64_t> send_elems(static_cast<size_t>(ep));
  for (int j = 0; j < ep; ++j) send_elems[j] = m.send_rows[j] * C;
  const std::vector<int64_t> recv_elems = rows_per_rank(m.recv_counts, ep, local, C);
  const float* received = moe_send_;
  if (ep > 1) {
    moe_.expert->all_to_all_v(moe_send_, send_elems, moe_recv_, recv_elems, DType::F32);
    received = moe_recv_;
  }
  permute_rows(m.expert_in, received, m.recv_counts, ep, local, C, /*to_expert_major=*/true);
  // The experts: GPT-2 MLPs over their rows, or Mixtral's SwiGLU MLPs w2(silu(w1 x) · w3 x).
  // Expert tensor parallelism (Megatron's MLP per expert): each tensor rank computes 1/t of the
  // hidden units, the partial outputs are summed over the tensor group once for all rows, then
  // each expert's c_proj bias is added.
  const int eu = part_.expert_unit[static_cast<size_t>(block)];
  const ExpertWidths F = expert_widths_;
  const bool split = shape_.moe.expert_tensor_parallel && part_.tp_size > 1;
  const P* experts = static_cast<const P*>(store.fetch(eu));
  for (int64_t i = 0; i < local; ++i) {
    const int64_t n = offsets[i + 1] - offsets[i], o = offsets[i];
    if (n == 0) continue;
    const ExpertTensors<const P> x = expert_tensors(experts, i, C, F, mixtral);
    float *fch = m.expert_fch + o * F.fch, *act = m.expert_fch_gelu + o * F.act;
    if (mixtral) {  // rows [w1 x | w3 x], then silu(gate) · up
      linear_forward(fch, m.expert_in + o * C, x.fc_w, static_cast<const P*>(nullptr), n, C, F.fch, false, cmp);
      swiglu_forward(act, fch, fch + F.act, n, F.act, F.fch);
      linear_forward(moe_rows_c_ + o * C, act, x.proj_w, static_cast<const P*>(nullptr), n, F.act, C, false, cmp);
      continue;
    }
    matmul_forward(fch, m.expert_in + o * C, x.fc_w, x.fc_b, n, C, F.fch, false, cmp);
    gelu_forward(act, fch, n * F.fch);
    matmul_forward(moe_rows_c_ + o * C, act, x.proj_w, split ? static_cast<const P*>(nullptr) : x.proj_b, n, F.fch, C,
                   false, cmp);
  }
  if (split) {
    reduce_from_tp_region_forward(tp_, moe_rows_c_, R * C);
    for (int64_t i = 0; i < local && !mixtral; ++i)
      add_bias_rows(moe_rows_c_ + offsets[i] * C, expert_tensors(experts, i, C, F, false).proj_b,
                    offsets[i + 1] - offsets[i], C);
  }
  store.release(eu);
  // Return: expert-major outputs back to source-major, then to the tokens' ranks (dispatch order)
  permute_rows(moe_recv_, moe_rows_c_, m.recv_counts, ep, local, C, /*to_expert_major=*/false);
  if (ep > 1) moe_.expert->all_to_all_v(moe_recv_, recv_elems, m.returned, send_elems, DType::F32);
  else copy_rows(m.returned, moe_recv_, r.num_rows(), C);
  // Combine, then the block's residual: res_3 = res_2 + moe_out (PR-MoE: the coefficient mix)
  float* out = shape_.moe.use_residual ? m.moe_out : moe_tokens_c_;
  moe::combine_forward(out, m.returned, r, C);
  if (shape_.moe.use_residual) {
    float* coef_logits = moe_logits_;  // free again: the gate is done
    matmul_forward(coef_logits, a.ln_2, w.coef_w, w.coef_b, S, C, 2, false, cmp);
    moe::residual_mix_forward(moe_tokens_c_, m.coef, m.moe_out, m.mlp_out, coef_logits, S, C);
  }
  // resid_pdrop on the block's output, where GPT2MLP's dropout sits (DeepSpeed's MoE layer replaces
  // the MLP, the model's residual dropout stays): keyed by the token's row in its micro-batch, as
  // the dense MLP's mask, whichever expert rank computed it.
  const DropoutMask drop = dropout_mask(shape_.dropout.resid, block, DropoutSite::MlpOutput);
  if (drop.on()) dropout_residual_add(a.res_3, a.res_2, moe_tokens_c_, static_cast<const float*>(nullptr), drop, 0, S, T_, C);
  else add(a.res_3, a.res_2, moe_tokens_c_, S * C, "moe_residual");
  if (buf.training) {
    for (MoeLayerStats& st : moe_stats_)
      if (st.block == block) {
        for (int64_t e = 0; e < E; ++e) st.tokens_per_expert[e] += r.exp_counts[e];
        st.routed += S * r.k;
        st.dropped += r.dropped();
        st.l_aux += r.l_aux;
        ++st.forwards;
      }
  }
}

// transformers' load_balancing_loss_func (modeling_mixtral.py) over the router logits of all L
// layers concatenated: aux = E·Σ_e f_e·P_e, where f_e is the share of all L·S·k choices that pick
// expert e and P_e the mean over all L·S tokens of its probability. Its gradient reaches layer l's
// probabilities as E·f_e/(L·S), which gate_backward computes from aux_scale·ce/S: every layer's
// routing gets ce = f and aux_scale = E/L. A pipeline splits the layers over stages, so the sums
// of choices and probabilities run along the stages with the activations (the embedding's chunk
// starts them), the last stage forms f and the loss, and f returns with the gradients: every
// stage's backward of a micro-batch follows the last stage's forward of it.
void GPT::mixtral_router_loss(const ModelChunk& c, ActivationBuffer& buf) const {
  const int64_t E = shape_.moe.num_experts, S = B_ * T_;
  std::vector<double>& sums = buf.router_sums;  // [E] choices, then [E] summed probabilities
  if (c.embedding) sums.assign(static_cast<size_t>(2 * E), 0.0);
  for (int l = 0; l < c.num_blocks; ++l) {
    const moe::Routing& r = *buf.moe[static_cast<size_t>(l)].routing;
    const std::vector<double> p = moe::probability_sums(r);  // either form's, token order
    for (int64_t e = 0; e < E; ++e) {
      sums[e] += r.exp_counts[e];
      sums[E + e] += p[e];
    }
  }
  if (!c.final) return;
  const double tokens = static_cast<double>(shape_.n_layer) * static_cast<double>(S);
  buf.router_fraction.resize(static_cast<size_t>(E));
  double aux = 0.0;
  for (int64_t e = 0; e < E; ++e) {
    buf.router_fraction[e] = static_cast<float>(sums[e] / tokens);
    aux += static_cast<double>(buf.router_fraction[e]) * (sums[E + e] / tokens);
  }
  buf.aux_loss = static_cast<double>(E) * aux;
}

void GPT::mixtral_router_fractions(const ModelChunk& c, ActivationBuffer& buf) const {
  for (int l = 0; l < c.num_blocks; ++l) {
    moe::set_aux_fraction(*buf.moe[static_cast<size_t>(l)].routing, buf.router_fraction,
                          static_cast<double>(shape_.moe.num_experts) / static_cast<double>(shape_.n_layer));
  }
}

void GPT::moe_mix_backward(const MoeActivations& m, const float* d_res_3, float* d_mlp_out) {
  moe::residual_mix_backward(moe_dmoe_, d_mlp_out, moe_dcoef_, d_res_3, m.moe_out, m.mlp_out, m.coef, B_ * T_,
                             shape_.n_embd);
}

template <typename P>
void GPT::moe_backward(int block, const BlockActivations& a, const MoeActivations& m, const BlockTensors<const P>& w,
                       const BlockTensors<float>& dw, const float* d_res_3, float* d_ln_2, float grad_scale,
                       ParamStore& store) {
  const int64_t S = B_ * T_, C = shape_.n_embd, E = shape_.moe.num_experts;
  const int ep = part_.ep_size;
  const int64_t local = E / ep;
  const DType cmp = compute_type();
  const moe::Routing& r = *m.routing;
  const bool mixtral = shape_.family.mixtral();
  const auto add_into = [](float* dst, const float* src, int64_t n) { kernels::add_into(dst, src, n, "moe_add"); };
  // PR-MoE's coefficient: d(ln_2) += d(coef_logits) · Wcᵀ
  if (shape_.moe.use_residual) {
    matmul_backward(moe_tokens_c_, dw.coef_w, dw.coef_b, moe_dcoef_, a.ln_2, w.coef_w, S, C, 2, cmp);
    add_into(d_ln_2, moe_tokens_c_, S * C);
  }
  // Combine backward: d(returned rows) in dispatch order, d(combine weights)
  const float* d_moe_out = shape_.moe.use_residual ? moe_dmoe_ : d_res_3;
  moe::combine_backward(moe_send_, moe_dweight_, d_moe_out, m.returned, r, C);
  // without the dense branch d(ln_2) starts here: resid_pdrop's masked d(res_3) may live in its buffer
  if (!shape_.moe.use_residual) Kokkos::deep_copy(Kokkos::View<float*, Kokkos::MemoryUnmanaged>(d_ln_2, S * C), 0.0f);
  // The rows' gradients travel the dispatch's way to the experts
  std::vector<int64_t> send_elems(static_cast<size_t>(ep));
  for (int j = 0; j < ep; ++j) send_elems[j] = m.send_rows[j] * C;
  const std::vector<int64_t> recv_elems = rows_per_rank(m.recv_counts, ep, local, C);
  const std::vector<int64_t> offsets = expert_row_offsets(m.recv_counts, ep, local);
  const float* received = moe_send_;
  if (ep > 1) {
    moe_.expert->all_to_all_v(moe_send_, send_elems, moe_recv_, recv_elems, DType::F32);
    received = moe_recv_;
  }
  permute_rows(moe_rows_c_, received, m.recv_counts, ep, local, C, /*to_expert_major=*/true);
  // The experts' backward: d(rows) expert-major into moe_recv_ (free once permuted)
  const int eu = part_.expert_unit[static_cast<size_t>(block)];
  const ExpertWidths F = expert_widths_;
  const P* experts = static_cast<const P*>(store.fetch(eu));
  float* grads = store.grad_target(eu);
  for (int64_t i = 0; i < local; ++i) {
    const int64_t n = offsets[i + 1] - offsets[i], o = offsets[i];
    if (n == 0) continue;
    const ExpertTensors<const P> x = expert_tensors(experts, i, C, F, mixtral);
    const ExpertTensors<float> dx = expert_tensors(grads, i, C, F, mixtral);
    const float *fch = m.expert_fch + o * F.fch, *act = m.expert_fch_gelu + o * F.act;
    float* d_fch = moe_rows_4c_ + o * F.fch;
    if (mixtral) {  // d(w2), d(SwiGLU output), d[gate | up], then d(w1 | w3) and d(rows)
      float* d_act = moe_rows_act_ + o * F.act;
      linear_backward(d_act, dx.proj_w, static_cast<float*>(nullptr), moe_rows_c_ + o * C, act, x.proj_w, n, F.act, C, cmp);
      swiglu_backward(d_fch, d_fch + F.act, d_act, fch, fch + F.act, n, F.act, F.fch);
      linear_backward(moe_recv_ + o * C, dx.fc_w, static_cast<float*>(nullptr), d_fch, m.expert_in + o * C, x.fc_w, n, C,
                      F.fch, cmp);
      store.progress();
      continue;
    }
    matmul_backward(d_fch, dx.proj_w, dx.proj_b, moe_rows_c_ + o * C, act, x.proj_w, n, F.fch, C, cmp);
    gelu_backward(d_fch, fch, d_fch, n * F.fch);
    matmul_backward(moe_recv_ + o * C, dx.fc_w, dx.fc_b, d_fch, m.expert_in + o * C, x.fc_w, n, C, F.fch, cmp);
    store.progress();
  }
  // expert tensor parallelism: each rank's input gradient is partial over the hidden units
  if (shape_.moe.expert_tensor_parallel && part_.tp_size > 1)
    copy_to_tp_region_backward(tp_, moe_recv_, offsets.back() * C);
  store.release(eu);
  store.grads_done(eu);
  // ... and back to the tokens' ranks, then summed per token into d(ln_2)
  permute_rows(moe_rows_c_, moe_recv_, m.recv_counts, ep, local, C, /*to_expert_major=*/false);
  if (ep > 1) moe_.expert->all_to_all_v(moe_rows_c_, recv_elems, moe_send_, send_elems, DType::F32);
  else copy_rows(moe_send_, moe_rows_c_, r.num_rows(), C);
  moe::dispatch_backward(moe_tokens_c_, moe_send_, r, C);
  if (mixtral && m.gate_noise) moe::jitter_backward(moe_tokens_c_, moe_tokens_c_, m.gate_noise, S * C);
  add_into(d_ln_2, moe_tokens_c_, S * C);
  // The gate: d(logits) from the combine weights and l_aux (weighted by aux_loss_coef in the
  // loss, scaled as the loss is), then the fp32 product's backward; the noise scales d(input).
  const float d_l_aux = static_cast<float>(moe_.aux_loss_coef) * grad_scale;
  moe::gate_backward(r, moe_dweight_, d_l_aux, moe_dlogits_);
  const float* gate_in = a.ln_2;
  if (m.gate_noise) {
    moe::jitter_forward(moe_rows_c_, a.ln_2, m.gate_noise, S * C);  // the gate's input again (its rows are free)
    gate_in = moe_rows_c_;
  }
  if (mixtral)
    linear_backward(moe_tokens_c_, dw.gate_w, static_cast<float*>(nullptr), moe_dlogits_, gate_in, w.gate_w, S, C, E,
                    DType::F32);
  else
    matmul_backward(moe_tokens_c_, dw.gate_w, static_cast<float*>(nullptr), moe_dlogits_, gate_in, w.gate_w, S, C, E,
                    DType::F32);
  if (m.gate_noise) moe::jitter_backward(moe_tokens_c_, moe_tokens_c_, m.gate_noise, S * C);
  add_into(d_ln_2, moe_tokens_c_, S * C);
}

template void GPT::moe_forward<float>(int, BlockActivations&, MoeActivations&, const BlockTensors<const float>&,
                                      ActivationBuffer&, ParamStore&);
template void GPT::moe_forward<bf16>(int, BlockActivations&, MoeActivations&, const BlockTensors<const bf16>&,
                                     ActivationBuffer&, ParamStore&);
template void GPT::moe_forward<fp16>(int, BlockActivations&, MoeActivations&, const BlockTensors<const fp16>&,
                                     ActivationBuffer&, ParamStore&);
template void GPT::moe_backward<float>(int, const BlockActivations&, const MoeActivations&,
                                       const BlockTensors<const float>&, const BlockTensors<float>&, const float*,
                                       float*, float, ParamStore&);
template void GPT::moe_backward<bf16>(int, const BlockActivations&, const MoeActivations&,
                                      const BlockTensors<const bf16>&, const BlockTensors<float>&, const float*, float*,
                                      float, ParamStore&);
template void GPT::moe_backward<fp16>(int, const BlockActivations&, const MoeActivations&,
                                      const BlockTensors<const fp16>&, const BlockTensors<float>&, const float*, float*,
                                      float, ParamStore&);

}  // namespace zero3d
