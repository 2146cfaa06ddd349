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
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "base/errors.hpp"
#include "kernels/common.hpp"

namespace zero3d::kernels::moe {

enum class NoisyGate { None, Jitter, RSample };  // DeepSpeed's noisy_gate_policy

struct GateConfig {
  int num_experts = 1;
  int k = 1;
  double capacity_factor = 1.0;
  double eval_capacity_factor = 1.0;
  int64_t min_capacity = 4;  // MoE's default (the bare TopKGate's is 8)
  bool drop_tokens = true;
  bool use_rts = true;
  bool top2_2nd_expert_sampling = true;
  NoisyGate noise = NoisyGate::None;
  bool training = true;  // eval: eval_capacity_factor, and neither Jitter nor RSample
  // Hugging Face's MixtralSparseMoeBlock (modeling_mixtral.py): for any k the k most probable
  // experts (torch.topk of the fp32 softmax), their weights renormalised to sum to 1 (k = 1: 1),
  // and l_aux = E·Σ_e (share of all k choices picking e)·mean_s(gates[:, e]), one layer's
  // load_balancing_loss_func. Used without drops (no capacity) and without noise.
  bool mixtral = false;
};

// Which draws a gate call consumes (each [S, ·] float32, from the caller's random stream).
// Jitter: factors U(1-0.01, 1+0.01) on the gate input [S, h] (TopKGate, training only; the caller
// applies them with jitter_forward before the gate matmul). RTS: U[0,1) [S, E] (top-1 with use_rts,
// in eval too). Gumbel(0,1) = -log(-log U) [S, E]: top-1 RSample (training only) and top-2's
// second-expert sampling (in eval too: DeepSpeed does not look at training there). top2gating
// never sees noisy_gate_policy, so RSample has no effect at k = 2; top-k (k > 2) draws nothing.
inline bool uses_jitter(const GateConfig& c) { return c.noise == NoisyGate::Jitter && c.training; }
inline bool uses_rts_uniform(const GateConfig& c) { return c.k == 1 && c.use_rts; }
inline bool uses_gumbel(const GateConfig& c) {
  return (c.k == 1 && c.noise == NoisyGate::RSample && c.training) || (c.k == 2 && c.top2_2nd_expert_sampling);
}

struct GateDraws {
  const float* rts_uniform = nullptr;  // [S, E]
  const float* gumbel = nullptr;       // [S, E]
};

// Capacity with drop_tokens (DeepSpeed's _capacity): ceil(S/E · f) raised to min_capacity, where
// f = (capacity_factor, or eval_capacity_factor in eval) · k. DeepSpeed holds f in a float32
// tensor, so the product and its ceiling are float32 ones: S=25, E=2, f=1.2 gives 16, not 15.
inline int64_t capacity(int64_t S, const GateConfig& c) {
  const double factor = (c.training ? c.capacity_factor : c.eval_capacity_factor) * c.k;
  const float per_expert = static_cast<float>(static_cast<double>(S) / c.num_experts);
  const float product = per_expert * static_cast<float>(factor);
  const int64_t C = static_cast<int64_t>(std::ceil(product));
  return C < c.min_capacity ? c.min_capacity : C;
}

// Capacity without drop_tokens: the largest expert count over the expert-parallel group (the
// caller's all-reduce MAX of max(exp_counts)), rounded up to a multiple of tp when the dense
// layers are tensor-parallel and the experts are not (DeepSpeed later splits slots over TP
// ranks; pass tp = 1 otherwise); top-1 then caps it at the local token count S.
inline int64_t capacity_without_drops(int64_t max_count, int64_t S, int64_t tp, const GateConfig& c) {
  int64_t C = (max_count + tp - 1) / tp * tp;
  if (c.k == 1 && C > S) C = S;
  return C;
}

// The routing of S tokens, choice j of token s at flat index s·k + j.
struct Routing {
  int64_t num_tokens = 0;
  int num_experts = 0, k = 0;
  // Phase 1 (gate_forward_choose)
  std::vector<float> gates;            // [S, E] softmax of the logits, fp32
  std::vector<int32_t> choice;         // [S, k] expert of each choice before the capacity cut
  std::vector<int64_t> exp_counts;     // [E] choices per expert before dropping (DeepSpeed's exp_counts)
  std::vector<float> aux_fraction;     // [E] ce: share of tokens whose l_aux mask picks e (not differentiated)
  double aux_scale = 0.0;              // l_aux = aux_scale · Σ_e mean_s(gates[:, e]) · ce[e]
  float l_aux = 0.0f;
  std::vector<int64_t> fill_offset;    // [E+1] CSR over experts of the choices in fill order:
  std::vector<int64_t> fill_order;     // [S·k] top-1/top-k token order; top-2 all first choices, then second
  // Phase 2 (gate_forward_assign)
  int64_t capacity = 0;
  std::vector<int32_t> expert;         // [S, k] expert, or -1 when the capacity dropped the choice
  std::vector<int32_t> slot;           // [S, k] position in the expert's buffer, or -1
  std::vector<float> weight;           // [S, k] combine weight (0 when dropped)
  bool renormalized = false;           // weights over the kept choices' sum (k ≥ 2, or Mixtral's any k)
  std::vector<float> kept_gate_sum;    // [S] k ≥ 2: Σ of kept choices' gates, before the eps clamp
  std::vector<int64_t> kept_per_expert;  // [E]
  std::vector<int64_t> row_offset;     // [E+1] first dispatch row of each expert (rows expert-major)
  std::vector<float> scratch_key;      // [S·k] selection keys, per expert segment of fill_order
  std::vector<int64_t> scratch_order;  // [S·k]

  // Dispatch row of a choice: experts in order, each expert's kept choices by slot (slots are
  // 0..kept-1, so rows pack without gaps); the order tokens go out in. -1 when dropped.
  int64_t row(int64_t s, int j) const {
    const int64_t i = s * k + j;
    return expert[i] < 0 ? -1 : row_offset[expert[i]] + slot[i];
  }
  int64_t num_rows() const { return row_offset.empty() ? 0 : row_offset.back(); }
  int64_t dropped() const { return num_tokens * k - num_rows(); }
};

namespace detail {
constexpr float kNormEps = 1.1920929e-07f;  // torch.finfo(float32).eps, DeepSpeed's clamp of the top-k normaliser

inline void check_draw(const float* p, const char* what, const GateConfig& c) {
  if (!p)
    throw SystemError(std::string("moe gate: the ") + what + " draws are missing (k=" + std::to_string(c.k) + ")");
}
}  // namespace detail

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
  const int E = c.num_experts, k = c.k;
  if (k < 1 || k > E)
    throw InputError("model.moe.k = " + std::to_string(k) + " must be between 1 and num_experts = " +
                     std::to_string(E));
  if (k == 1 && S < c.min_capacity)  // DeepSpeed's top1gating asserts it
    throw InputError("model.moe.min_capacity = " + std::to_string(c.min_capacity) + " exceeds the " +
                     std::to_string(S) + " tokens a top-1 gate routes per micro-batch; lower it or raise the batch");
  const bool rsample = k == 1 && c.noise == NoisyGate::RSample && c.training;
  const bool sample2 = k == 2 && c.top2_2nd_expert_sampling;
  const bool argmax = k <= 2 && !c.mixtral;
  if (rsample || sample2) detail::check_draw(draws.gumbel, "Gumbel", c);
  r.num_tokens = S;
  r.num_experts = E;
  r.k = k;
  r.gates.resize(S * E);
  r.choice.resize(S * k);
  float* gates = r.gates.data();
  int32_t* choice = r.choice.data();
  const float* gumbel = draws.gumbel;
  Kokkos::parallel_for("moe_gate_choose", range(S), KOKKOS_LAMBDA(Index s) {
    const float* z = logits + s * E;
    float* p = gates + s * E;
    float mx = z[0];
    for (int e = 1; e < E; ++e) mx = z[e] > mx ? z[e] : mx;
    double sum = 0.0;
    for (int e = 0; e < E; ++e) sum += (p[e] = std::exp(z[e] - mx));
    const float inv = static_cast<float>(1.0 / sum);
    for (int e = 0; e < E; ++e) p[e] *= inv;
    int32_t* ch = choice + s * k;
    if (argmax) {  // argmax: the first maximum, as torch.argmax
      int best = 0;
      if (rsample) {
        for (int e = 1; e < E; ++e)
          if (z[e] + gumbel[s * E + e] > z[best] + gumbel[s * E + best]) best = e;
      } else {
        for (int e = 1; e < E; ++e)
          if (p[e] > p[best]) best = e;
      }
      ch[0] = best;
      if (k == 2) {
        int second = -1;
        float top = 0.0f;
        for (int e = 0; e < E; ++e) {
          if (e == best) continue;
          const float v = sample2 ? z[e] + gumbel[s * E + e] : z[e];
          if (second < 0 || v > top) second = e, top = v;
        }
        ch[1] = second;
      }
    } else {  // top-k: insertion into a descending list, equal probabilities keep the lower id first
      int n = 0;
      for (int e = 0; e < E; ++e) {
        int at = n < k ? n : k;
        while (at > 0 && p[ch[at - 1]] < p[e]) --at;
        if (at >= k) continue;
        for (int m = (n < k ? n : k - 1); m > at; --m) ch[m] = ch[m - 1];
        ch[at] = e;
        if (n < k) ++n;
      }
    }
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
    if (!renormalize) {
      weight[s] = expert[s] >= 0 ? gates[s * E + choice[s]] : 0.0f;
      return;
    }
    float sum = 0.0f;
    for (int j = 0; j < k; ++j) {
      weight[s * k + j] = expert[s * k + j] >= 0 ? gates[s * E + choice[s * k + j]] : 0.0f;
      sum += weight[s * k + j];
    }
    sum_out[s] = sum;
    const float denom = sum < detail::kNormEps ? detail::kNormEps : sum;
    for (int j = 0; j < k; ++j) weight[s * k + j] /= denom;
  });
  r.row_offset.assign(E + 1, 0);
  for (int e = 0; e < E; ++e) r.row_offset[e + 1] = r.row_offset[e] + kept[e];
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
  const int64_t S = r.num_tokens;
  const int E = r.num_experts, k = r.k;
  const float* gates = r.gates.data();
  const int32_t* expert = r.expert.data();
  const float* weight = r.weight.data();
  const float* ce = r.aux_fraction.data();
  const float* sums = r.kept_gate_sum.data();
  const float aux = static_cast<float>(d_l_aux * r.aux_scale / S);
  const bool renormalized = r.renormalized;
  Kokkos::parallel_for("moe_gate_backward", range(S), KOKKOS_LAMBDA(Index s) {
    float* dg = d_logits + s * E;  // d(gates) first, then turned into d(logits) in place
    for (int e = 0; e < E; ++e) dg[e] = aux * ce[e];
    if (!renormalized) {
      if (expert[s] >= 0) dg[expert[s]] += d_weight[s];
    } else {
      const float sum = sums[s];
      const bool clamped = sum < detail::kNormEps;
      const float denom = clamped ? detail::kNormEps : sum;
      // Σ_j dw_j·g_j / D² = Σ_j dw_j·w_j / D
      float through_denom = 0.0f;
      if (!clamped)
        for (int j = 0; j < k; ++j) through_denom += d_weight[s * k + j] * weight[s * k + j];
      for (int j = 0; j < k; ++j) {
        const int32_t e = expert[s * k + j];
        if (e >= 0) dg[e] += (d_weight[s * k + j] - through_denom) / denom;
      }
    }
    double dot = 0.0;
    for (int e = 0; e < E; ++e) dot += static_cast<double>(gates[s * E + e]) * dg[e];
    for (int e = 0; e < E; ++e) dg[e] = gates[s * E + e] * (dg[e] - static_cast<float>(dot));
  });
}

// rows[row(s, j)] = x[s] for every kept choice: [num_rows, h], expert-major.
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

// dx[s] = Σ over token s's kept choices of d_rows[row] (written; 0 for a token with none).
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

// out[s] = Σ_j weight[s, j] · y_rows[row(s, j)] (written; 0 for a token whose choices all dropped:
// the block's residual carries it).
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

// d_rows[row(s, j)] = weight[s, j] · d_out[s]; d_weight[s, j] = d_out[s] · y_rows[row(s, j)]
// (both written; d_weight is 0 for a dropped choice).
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
