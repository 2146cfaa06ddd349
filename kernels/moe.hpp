// moe.hpp — DeepSpeed's Mixture-of-Experts gate and the token dispatch/combine around the
// experts, forward and backward (DEEPSPEED-FACTS-2 §4.2–4.5: TopKGate, top1gating, top2gating,
// topkgating, MOELayer; GShard arXiv:2006.16668, Switch Transformer arXiv:2101.03961).
//
// MPI-free: the caller runs the gate matmul (logits = x·wgᵀ in fp32), supplies the random draws,
// agrees the capacity across the expert-parallel group when drop_tokens is false (between the
// two forward phases), moves the dispatched rows between ranks and runs the experts.
//
// Routing is kept sparse — per token and choice an expert, a slot and a weight — where DeepSpeed
// builds a dense [S, E, C] combine tensor; the two are the same map (tests/kernels/test_moe_gating.cpp
// checks it against a dense PyTorch reference, tests/golden/make_moe_goldens.py).
//
// Orders DeepSpeed leaves to torch.topk's tie-breaking are fixed here, and the reference
// implements the same rules explicitly:
//   * top-1 without random token selection keeps each expert's FIRST C tokens in token order;
//   * top-1 with RTS keeps each expert's C tokens with the highest U (equal U: token order);
//   * top-k (k > 2, drop policy "probs") keeps each expert's C tokens with the highest gate
//     probability (equal: token order); a token's k experts are its k highest probabilities
//     (equal: lower expert id first).
//
// Two forms of the routing, one contract (the names below): the CPU form (namespace cpu, host
// tables, std::stable_sort for the selection policies) and the device form (kernels/moe_device.hpp,
// namespace gpu: tables in model memory, the stable order from prefix sums). A GPU build runs the
// device form; a CPU build the CPU form, or the device form under moe_device_form_on_host().
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "base/errors.hpp"
#include "kernels/common.hpp"
#include "kernels/moe_device.hpp"
#include "kernels/moe_routing.hpp"

namespace zero3d::kernels::moe {

#ifndef ZERO3D_DEVICE
// The CPU form: routing tables in host vectors (a GPU build compiles only the device form).
namespace cpu {

// Phase 1: fp32 softmax, each token's k experts, exp_counts and l_aux.
//   top-1: argmax of the gates, or of logits + Gumbel with RSample in training (the noisy logits
//          only pick; the weight stays the clean probability); l_aux over that one-hot mask.
//   top-2: first = argmax of the gates; second = argmax of the logits (+ Gumbel when
//          top2_2nd_expert_sampling) with the first masked out; l_aux over first choices only.
//   top-k: the k highest probabilities; l_aux over the k-hot mask, divided by k.
// l_aux = E·Σ_e mean_s(gates[:,e])·mean_s(mask[:,e]) (top-k: ·1/k), mask before any dropping.
// Mixtral: any k as top-k; l_aux over the k-hot mask, not divided by k.
ZERO3D_KERNEL void gate_forward_choose(const float* logits, int64_t S, const GateConfig& c, const GateDraws& draws,
                                Routing& r) {
  const detail::ChoicePolicy p = detail::begin_choice(S, c, draws, r, /*device_form=*/false);
  const int E = c.num_experts, k = c.k;
  const bool rsample = p.rsample, sample2 = p.sample2, argmax = p.argmax;
  r.gates.resize(S * E);
  r.choice.resize(S * k);
  float* gates = r.gates.data();
  int32_t* choice = r.choice.data();
  const float* gumbel = draws.gumbel;
  Kokkos::parallel_for("moe_gate_choose", range(S), KOKKOS_LAMBDA(Index s) {
    detail::choose_token(logits + s * E, gates + s * E, choice + s * k, gumbel ? gumbel + s * E : nullptr, E, k, argmax,
                         rsample, sample2);
  });
  // Counts and the fill order (a short scan in token order, as DeepSpeed's cumsum).
  r.exp_counts.assign(E, 0);
  for (int64_t i = 0; i < S * k; ++i) ++r.exp_counts[choice[i]];
  r.fill_offset.assign(E + 1, 0);
  for (int e = 0; e < E; ++e) r.fill_offset[e + 1] = r.fill_offset[e] + r.exp_counts[e];
  r.fill_order.resize(S * k);
  std::vector<int64_t> next(r.fill_offset.begin(), r.fill_offset.end() - 1);
  if (k == 2) {
    for (int j = 0; j < 2; ++j)
      for (int64_t s = 0; s < S; ++s) r.fill_order[next[choice[s * 2 + j]]++] = s * 2 + j;
  } else {
    for (int64_t i = 0; i < S * k; ++i) r.fill_order[next[choice[i]]++] = i;
  }
  // l_aux: ce from the top-1 mask, the top-2 first choices, or the top-k k-hot mask.
  std::vector<int64_t> aux_count(E, 0);
  for (int64_t s = 0; s < S; ++s)
    for (int j = 0; j < (k == 2 && !c.mixtral ? 1 : k); ++j) ++aux_count[choice[s * k + j]];
  r.aux_scale = k <= 2 || c.mixtral ? E : static_cast<double>(E) / k;
  r.aux_fraction.resize(E);
  double l_aux = 0.0;
  for (int e = 0; e < E; ++e) {
    double me = 0.0;
    for (int64_t s = 0; s < S; ++s) me += gates[s * E + e];
    r.aux_fraction[e] = static_cast<float>(static_cast<double>(aux_count[e]) / S);
    l_aux += me / S * r.aux_fraction[e];
  }
  r.l_aux = static_cast<float>(r.aux_scale * l_aux);
}

// Phase 2: the capacity cut, slots and combine weights, for capacity C (capacity() with
// drop_tokens; capacity_without_drops() of the group's largest count without).
//   top-1: an expert keeps C of its tokens — the first C in token order, or with use_rts the C
//          with the highest mask·U; slots follow token order among the kept. Weight: the raw
//          softmax probability (not renormalised).
//   top-2: position = cumsum in fill order (every first choice before every second choice);
//          kept when < C. Weights g_j / max(g_1 + g_2, eps) over the kept choices' probabilities.
//   top-k: an expert keeps its C most probable tokens ("probs"); slots in token order; weights
//          as top-2 over all k choices.
ZERO3D_KERNEL void gate_forward_assign(int64_t C, const GateConfig& c, const GateDraws& draws, Routing& r) {
  const int64_t S = r.num_tokens;
  const int E = r.num_experts, k = r.k;
  const bool rts = k == 1 && c.use_rts;
  if (rts) detail::check_draw(draws.rts_uniform, "random token selection", c);
  r.capacity = C;
  r.expert.assign(S * k, -1);
  r.slot.assign(S * k, -1);
  r.weight.resize(S * k);
  const bool renormalize = k >= 2 || c.mixtral;
  r.renormalized = renormalize;
  r.kept_gate_sum.assign(renormalize ? S : 0, 0.0f);
  r.kept_per_expert.resize(E);
  r.scratch_key.resize(S * k);
  r.scratch_order.resize(S * k);
  int32_t* expert = r.expert.data();
  int32_t* slot = r.slot.data();
  int64_t* kept = r.kept_per_expert.data();
  const int64_t* off = r.fill_offset.data();
  const int64_t* fill = r.fill_order.data();
  const float* gates = r.gates.data();
  const float* uniform = draws.rts_uniform;
  float* key = r.scratch_key.data();
  int64_t* order = r.scratch_order.data();
  // On the host: it sorts with std::stable_sort, over the routing tables (host vectors).
  Kokkos::parallel_for("moe_gate_assign", host_range(E), [=](Index e) {
    const int64_t n = off[e + 1] - off[e];
    const int64_t keep = n < C ? n : C;
    kept[e] = keep;
    if (!rts && k <= 2) {  // position policy: the first C in fill order
      for (int64_t i = 0; i < keep; ++i) {
        expert[fill[off[e] + i]] = static_cast<int32_t>(e);
        slot[fill[off[e] + i]] = static_cast<int32_t>(i);
      }
      return;
    }
    // Highest key first (U for RTS, the probability for top-k), equal keys in token order.
    for (int64_t i = off[e]; i < off[e + 1]; ++i) {
      const int64_t s = fill[i] / k;
      key[i] = rts ? uniform[s * E + e] : gates[s * E + e];
      order[i] = i;
    }
    std::stable_sort(order + off[e], order + off[e + 1], [&](int64_t a, int64_t b) { return key[a] > key[b]; });
    for (int64_t i = 0; i < keep; ++i) expert[fill[order[off[e] + i]]] = static_cast<int32_t>(e);
    int32_t next = 0;
    for (int64_t i = off[e]; i < off[e + 1]; ++i)
      if (expert[fill[i]] >= 0) slot[fill[i]] = next++;
  });
  float* weight = r.weight.data();
  float* sum_out = r.kept_gate_sum.data();
  const int32_t* choice = r.choice.data();
  Kokkos::parallel_for("moe_gate_weights", range(S), KOKKOS_LAMBDA(Index s) {
    detail::token_weights(weight + s * k, sum_out + s, expert + s * k, choice + s * k, gates + s * E, k, renormalize);
  });
  r.row_offset.assign(E + 1, 0);
  for (int e = 0; e < E; ++e) r.row_offset[e + 1] = r.row_offset[e] + kept[e];
}

// The backward, dispatch and combine: their contracts are the entry points' (below).
ZERO3D_KERNEL void gate_backward(const Routing& r, const float* d_weight, float d_l_aux, float* d_logits) {
  detail::gate_backward_tokens("moe_gate_backward", r, r.gates.data(), r.expert.data(), r.weight.data(),
                               r.aux_fraction.data(), r.kept_gate_sum.data(), d_weight, d_l_aux, d_logits);
}

ZERO3D_KERNEL void dispatch_forward(float* rows, const float* x, const Routing& r, Index h) {
  const int k = r.k;
  const int32_t* expert = r.expert.data();
  const int32_t* slot = r.slot.data();
  const int64_t* row_offset = r.row_offset.data();
  Kokkos::parallel_for("moe_dispatch_forward", range(r.num_tokens * k), KOKKOS_LAMBDA(Index i) {
    if (expert[i] < 0) return;
    float* out = rows + (row_offset[expert[i]] + slot[i]) * h;
    const float* in = x + (i / k) * h;
    for (Index c = 0; c < h; ++c) out[c] = in[c];
  });
}

ZERO3D_KERNEL void dispatch_backward(float* dx, const float* d_rows, const Routing& r, Index h) {
  const int k = r.k;
  const int32_t* expert = r.expert.data();
  const int32_t* slot = r.slot.data();
  const int64_t* row_offset = r.row_offset.data();
  Kokkos::parallel_for("moe_dispatch_backward", range(r.num_tokens), KOKKOS_LAMBDA(Index s) {
    float* d = dx + s * h;
    for (Index c = 0; c < h; ++c) d[c] = 0.0f;
    for (int j = 0; j < k; ++j) {
      const int64_t i = s * k + j;
      if (expert[i] < 0) continue;
      const float* g = d_rows + (row_offset[expert[i]] + slot[i]) * h;
      for (Index c = 0; c < h; ++c) d[c] += g[c];
    }
  });
}

ZERO3D_KERNEL void combine_forward(float* out, const float* y_rows, const Routing& r, Index h) {
  const int k = r.k;
  const int32_t* expert = r.expert.data();
  const int32_t* slot = r.slot.data();
  const float* weight = r.weight.data();
  const int64_t* row_offset = r.row_offset.data();
  Kokkos::parallel_for("moe_combine_forward", range(r.num_tokens), KOKKOS_LAMBDA(Index s) {
    float* o = out + s * h;
    for (Index c = 0; c < h; ++c) o[c] = 0.0f;
    for (int j = 0; j < k; ++j) {
      const int64_t i = s * k + j;
      if (expert[i] < 0) continue;
      const float* y = y_rows + (row_offset[expert[i]] + slot[i]) * h;
      for (Index c = 0; c < h; ++c) o[c] += weight[i] * y[c];
    }
  });
}

ZERO3D_KERNEL void combine_backward(float* d_rows, float* d_weight, const float* d_out, const float* y_rows,
                             const Routing& r, Index h) {
  const int k = r.k;
  const int32_t* expert = r.expert.data();
  const int32_t* slot = r.slot.data();
  const float* weight = r.weight.data();
  const int64_t* row_offset = r.row_offset.data();
  Kokkos::parallel_for("moe_combine_backward", range(r.num_tokens * k), KOKKOS_LAMBDA(Index i) {
    d_weight[i] = 0.0f;
    if (expert[i] < 0) return;
    const int64_t row = row_offset[expert[i]] + slot[i];
    const float* d = d_out + (i / k) * h;
    const float* y = y_rows + row * h;
    float* dr = d_rows + row * h;
    double dot = 0.0;
    for (Index c = 0; c < h; ++c) {
      dr[c] = weight[i] * d[c];
      dot += static_cast<double>(d[c]) * y[c];
    }
    d_weight[i] = static_cast<float>(dot);
  });
}

}  // namespace cpu
#endif

// The entry points: the device form on a GPU build; on a CPU build the CPU form unless the test
// hook asks for the device form. Phase 1 picks the form; the routing remembers it for the rest.
ZERO3D_KERNEL void gate_forward_choose(const float* logits, int64_t S, const GateConfig& c, const GateDraws& draws,
                                       Routing& r) {
#ifndef ZERO3D_DEVICE
  if (!moe_device_form_on_host()) return cpu::gate_forward_choose(logits, S, c, draws, r);
#endif
  gpu::gate_forward_choose(logits, S, c, draws, r);
}

ZERO3D_KERNEL void gate_forward_assign(int64_t C, const GateConfig& c, const GateDraws& draws, Routing& r) {
#ifndef ZERO3D_DEVICE
  if (!r.device_form) return cpu::gate_forward_assign(C, c, draws, r);
#endif
  gpu::gate_forward_assign(C, c, draws, r);
}

// Single-process convenience: both phases with the local capacity.
inline void gate_forward(const float* logits, int64_t S, const GateConfig& c, const GateDraws& draws, Routing& r) {
  gate_forward_choose(logits, S, c, draws, r);
  const int64_t C = c.drop_tokens
                        ? capacity(S, c)
                        : capacity_without_drops(*std::max_element(r.exp_counts.begin(), r.exp_counts.end()), S, 1, c);
  gate_forward_assign(C, c, draws, r);
}

// d_logits [S, E] (written) from d(combine weight) per choice [S·k] and d(l_aux) (e.g.
// aux_loss_coef · loss scale). The weights reach the gates through the top-2/top-k normalisation
// (w_j = g_j / D, D = Σ kept g; a clamped D is a constant); l_aux reaches them through
// mean_s(gates) (its mask is not differentiated); then the softmax backward.
ZERO3D_KERNEL void gate_backward(const Routing& r, const float* d_weight, float d_l_aux, float* d_logits) {
#ifndef ZERO3D_DEVICE
  if (!r.device_form) return cpu::gate_backward(r, d_weight, d_l_aux, d_logits);
#endif
  gpu::gate_backward(r, d_weight, d_l_aux, d_logits);
}

// rows[row(s, j)] = x[s] for every kept choice: [num_rows, h], expert-major.
ZERO3D_KERNEL void dispatch_forward(float* rows, const float* x, const Routing& r, Index h) {
#ifndef ZERO3D_DEVICE
  if (!r.device_form) return cpu::dispatch_forward(rows, x, r, h);
#endif
  gpu::dispatch_forward(rows, x, r, h);
}

// dx[s] = Σ over token s's kept choices of d_rows[row] (written; 0 for a token with none).
ZERO3D_KERNEL void dispatch_backward(float* dx, const float* d_rows, const Routing& r, Index h) {
#ifndef ZERO3D_DEVICE
  if (!r.device_form) return cpu::dispatch_backward(dx, d_rows, r, h);
#endif
  gpu::dispatch_backward(dx, d_rows, r, h);
}

// out[s] = Σ_j weight[s, j] · y_rows[row(s, j)] (written; 0 for a token whose choices all dropped:
// the block's residual carries it).
ZERO3D_KERNEL void combine_forward(float* out, const float* y_rows, const Routing& r, Index h) {
#ifndef ZERO3D_DEVICE
  if (!r.device_form) return cpu::combine_forward(out, y_rows, r, h);
#endif
  gpu::combine_forward(out, y_rows, r, h);
}

// d_rows[row(s, j)] = weight[s, j] · d_out[s]; d_weight[s, j] = d_out[s] · y_rows[row(s, j)]
// (both written; d_weight is 0 for a dropped choice).
ZERO3D_KERNEL void combine_backward(float* d_rows, float* d_weight, const float* d_out, const float* y_rows,
                                    const Routing& r, Index h) {
#ifndef ZERO3D_DEVICE
  if (!r.device_form) return cpu::combine_backward(d_rows, d_weight, d_out, y_rows, r, h);
#endif
  gpu::combine_backward(d_rows, d_weight, d_out, y_rows, r, h);
}

// The gate's draws where the form reads them: the device form's copied once from the host's
// (the same numbers: the draw is the CPU form's host stream) into the routing's tables.
inline GateDraws draws_for_form(Routing& r, bool device_form, const GateDraws& host, int64_t n) {
  if (!device_form) return host;
  GateDraws out;
  if (host.rts_uniform) {
    float* d = r.device.grown(r.device.rts_uniform, n, "moe_rts_uniform");
    copy_to_device(d, host.rts_uniform, static_cast<size_t>(n) * sizeof(float));
    out.rts_uniform = d;
  }
  if (host.gumbel) {
    float* d = r.device.grown(r.device.gumbel, n, "moe_gumbel");
    copy_to_device(d, host.gumbel, static_cast<size_t>(n) * sizeof(float));
    out.gumbel = d;
  }
  return out;
}

// Σ_s gates[s, e] per expert, token order in double (Mixtral's router loss over layers).
inline std::vector<double> probability_sums(const Routing& r) {
  if (r.device_form) return r.prob_sum;
  const int64_t S = r.num_tokens, E = r.num_experts;
  std::vector<double> out(static_cast<size_t>(E), 0.0);
  for (int64_t e = 0; e < E; ++e) {
    double p = 0.0;
    for (int64_t s = 0; s < S; ++s) p += r.gates[s * E + e];
    out[e] = p;
  }
  return out;
}

// Mixtral's l_aux over all layers: every layer's ce and scale replaced (GPT::mixtral_router_fractions).
inline void set_aux_fraction(Routing& r, const std::vector<float>& fraction, double scale) {
  r.aux_fraction = fraction;
  r.aux_scale = scale;
  if (r.device_form) {
    float* d = r.device.grown(r.device.aux_fraction, static_cast<int64_t>(fraction.size()), "moe_aux_fraction");
    copy_to_device(d, fraction.data(), fraction.size() * sizeof(float));
  }
}

// Jitter: the gate sees x · factors (factors U(0.99, 1.01), training only); n = S·h.
ZERO3D_KERNEL void jitter_forward(float* out, const float* x, const float* factors, Index n) {
  Kokkos::parallel_for("moe_jitter_forward", range(n), KOKKOS_LAMBDA(Index i) { out[i] = x[i] * factors[i]; });
}
ZERO3D_KERNEL void jitter_backward(float* dx, const float* d_out, const float* factors, Index n) {
  Kokkos::parallel_for("moe_jitter_backward", range(n), KOKKOS_LAMBDA(Index i) { dx[i] = d_out[i] * factors[i]; });
}

// Residual MoE (PR-MoE, DeepSpeed's use_residual): coef = softmax(coef_logits) with coef_logits
// = x·Wcᵀ + b from the caller's Linear(h, 2); out = moe_out·coef[0] + mlp_out·coef[1]. coef [S, 2]
// is kept for the backward.
ZERO3D_KERNEL void residual_mix_forward(float* out, float* coef, const float* moe_out, const float* mlp_out,
                                 const float* coef_logits, Index S, Index h) {
  Kokkos::parallel_for("moe_residual_mix_forward", range(S), KOKKOS_LAMBDA(Index s) {
    const float a = coef_logits[2 * s], b = coef_logits[2 * s + 1];
    const float m = a > b ? a : b;
    const float ea = std::exp(a - m), eb = std::exp(b - m);
    const float c0 = ea / (ea + eb), c1 = eb / (ea + eb);
    coef[2 * s] = c0;
    coef[2 * s + 1] = c1;
    for (Index c = 0; c < h; ++c) out[s * h + c] = moe_out[s * h + c] * c0 + mlp_out[s * h + c] * c1;
  });
}

// d_moe_out, d_mlp_out [S, h] and d_coef_logits [S, 2], all written.
ZERO3D_KERNEL void residual_mix_backward(float* d_moe_out, float* d_mlp_out, float* d_coef_logits, const float* d_out,
                                  const float* moe_out, const float* mlp_out, const float* coef, Index S, Index h) {
  Kokkos::parallel_for("moe_residual_mix_backward", range(S), KOKKOS_LAMBDA(Index s) {
    const float c0 = coef[2 * s], c1 = coef[2 * s + 1];
    double d0 = 0.0, d1 = 0.0;
    for (Index c = 0; c < h; ++c) {
      const float d = d_out[s * h + c];
      d_moe_out[s * h + c] = d * c0;
      d_mlp_out[s * h + c] = d * c1;
      d0 += static_cast<double>(d) * moe_out[s * h + c];
      d1 += static_cast<double>(d) * mlp_out[s * h + c];
    }
    const double dot = c0 * d0 + c1 * d1;  // softmax backward over the two coefficients
    d_coef_logits[2 * s] = static_cast<float>(c0 * (d0 - dot));
    d_coef_logits[2 * s + 1] = static_cast<float>(c1 * (d1 - dot));
  });
}

}  // namespace zero3d::kernels::moe
