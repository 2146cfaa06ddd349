// moe_routing.hpp — what the Mixture-of-Experts gate's two forms share (kernels/moe.hpp, the CPU
// form over host tables; kernels/moe_device.hpp, the device form over tables in model memory):
// the gate's settings, the draws it consumes, the capacity rules, the routing of a micro-batch,
// and the per-token arithmetic both forms run (so the two agree bit for bit there).
// DEEPSPEED-FACTS-2 §4.2–4.5 (TopKGate, top1gating, top2gating, topkgating, MOELayer).
#pragma once

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "base/errors.hpp"
#include "kernels/common.hpp"
#include "kernels/memory.hpp"

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

// Host memory for the CPU form; model memory for the device form (draws_in_model_memory copies
// the host's draws there once).
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

// The device form's tables, in model memory (GPU-GAP C5: routing read by device code lives in
// device memory, never in host vectors). Grown to the largest micro-batch and then reused.
struct RoutingTables {
  template <typename T>
  using Table = Kokkos::View<T*, DeviceSpace>;
  Table<float> gates, weight, kept_gate_sum, aux_fraction, rts_uniform, gumbel;
  Table<int32_t> choice, expert, slot;
  Table<int64_t> position;      // [S·k] place of each choice in its expert's fill order
  Table<int64_t> fill_offset;   // [E+1]
  Table<int64_t> fill_order;    // [S·k]
  Table<int64_t> exp_counts, aux_count, kept_per_expert, row_offset;  // [E], [E], [E], [E+1]
  Table<int64_t> chunk_base;    // [chunks·E] the scan's per-chunk counts, then its bases
  Table<double> prob_sum;       // [E] Σ_s gates[s, e], token order
  Table<double> l_aux;          // [1] Σ_e mean_s(gates[:, e])·ce[e]

  template <typename T>
  static T* grown(Table<T>& t, int64_t n, const char* label) {
    if (static_cast<int64_t>(t.extent(0)) < n || t.extent(0) == 0)
      t = Table<T>(Kokkos::view_alloc(Kokkos::WithoutInitializing, std::string(label)), static_cast<size_t>(n < 1 ? 1 : n));
    return t.data();
  }
};

// The routing of S tokens, choice j of token s at flat index s·k + j.
//
// The CPU form fills the host vectors below. The device form (device_form = true) keeps the
// per-token and per-choice tables in `device` and copies to the host only the per-expert
// figures the host needs (exp_counts, prob_sum, aux_fraction, l_aux, kept_per_expert,
// row_offset: the all-to-all's counts, the metrics, Mixtral's router loss); the *_table()
// accessors give kernels the form's tables.
struct Routing {
  int64_t num_tokens = 0;
  int num_experts = 0, k = 0;
  bool device_form = false;
  // Phase 1 (gate_forward_choose)
  std::vector<float> gates;            // [S, E] softmax of the logits, fp32
  std::vector<int32_t> choice;         // [S, k] expert of each choice before the capacity cut
  std::vector<int64_t> exp_counts;     // [E] choices per expert before dropping (DeepSpeed's exp_counts)
  std::vector<float> aux_fraction;     // [E] ce: share of tokens whose l_aux mask picks e (not differentiated)
  std::vector<double> prob_sum;        // [E] device form: Σ_s gates[s, e] in token order
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
  RoutingTables device;                // the device form's tables

  // The form's tables, where kernels read them (model memory for the device form).
  const float* gates_table() const { return device_form ? device.gates.data() : gates.data(); }
  const int32_t* choice_table() const { return device_form ? device.choice.data() : choice.data(); }
  const int32_t* expert_table() const { return device_form ? device.expert.data() : expert.data(); }
  const int32_t* slot_table() const { return device_form ? device.slot.data() : slot.data(); }
  const float* weight_table() const { return device_form ? device.weight.data() : weight.data(); }
  const float* aux_fraction_table() const { return device_form ? device.aux_fraction.data() : aux_fraction.data(); }
  const float* kept_gate_sum_table() const { return device_form ? device.kept_gate_sum.data() : kept_gate_sum.data(); }
  const int64_t* row_offset_table() const { return device_form ? device.row_offset.data() : row_offset.data(); }

  // Dispatch row of a choice (CPU form): experts in order, each expert's kept choices by slot
  // (slots are 0..kept-1, so rows pack without gaps); the order tokens go out in. -1 when dropped.
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

// What phase 1 checks before either form routes.
inline void check_gate(int64_t S, const GateConfig& c) {
  const int E = c.num_experts, k = c.k;
  if (k < 1 || k > E)
    throw InputError("model.moe.k = " + std::to_string(k) + " must be between 1 and num_experts = " +
                     std::to_string(E));
  if (k == 1 && S < c.min_capacity)  // DeepSpeed's top1gating asserts it
    throw InputError("model.moe.min_capacity = " + std::to_string(c.min_capacity) + " exceeds the " +
                     std::to_string(S) + " tokens a top-1 gate routes per micro-batch; lower it or raise the batch");
}

// How phase 1 chooses (both forms): RSample's noisy top-1 in training, top-2's sampled second
// expert, argmax choices (top-1/2 outside Mixtral) rather than the k highest probabilities.
struct ChoicePolicy {
  bool rsample, sample2, argmax;
};

// What either form's phase 1 does before its first kernel: the gate checked, the draws it needs
// present, the routing's sizes and form set.
inline ChoicePolicy begin_choice(int64_t S, const GateConfig& c, const GateDraws& draws, Routing& r, bool device_form) {
  check_gate(S, c);
  const int k = c.k;
  const ChoicePolicy p{k == 1 && c.noise == NoisyGate::RSample && c.training, k == 2 && c.top2_2nd_expert_sampling,
                       k <= 2 && !c.mixtral};
  if (p.rsample || p.sample2) check_draw(draws.gumbel, "Gumbel", c);
  r.num_tokens = S;
  r.num_experts = c.num_experts;
  r.k = k;
  r.device_form = device_form;
  return p;
}

// One token's fp32 softmax p[E] of its logits z[E] and its k choices ch[k] (both forms run this).
//   argmax (top-1, top-2): the first maximum, as torch.argmax; top-1 RSample picks by z + Gumbel;
//   top-2's second is the argmax of z (+ Gumbel when sampling) with the first masked out.
//   top-k / Mixtral: insertion into a descending list, equal probabilities keep the lower id first.
KOKKOS_INLINE_FUNCTION void choose_token(const float* z, float* p, int32_t* ch, const float* g, int E, int k,
                                         bool argmax, bool rsample, bool sample2) {
  float mx = z[0];
  for (int e = 1; e < E; ++e) mx = z[e] > mx ? z[e] : mx;
  double sum = 0.0;
  for (int e = 0; e < E; ++e) sum += (p[e] = std::exp(z[e] - mx));
  const float inv = static_cast<float>(1.0 / sum);
  for (int e = 0; e < E; ++e) p[e] *= inv;
  if (argmax) {
    int best = 0;
    if (rsample) {
      for (int e = 1; e < E; ++e)
        if (z[e] + g[e] > z[best] + g[best]) best = e;
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
        const float v = sample2 ? z[e] + g[e] : z[e];
        if (second < 0 || v > top) second = e, top = v;
      }
      ch[1] = second;
    }
  } else {
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
}

// One token's combine weights w[k] from its kept choices (expert ex[j] >= 0) and probabilities
// p[E]: the raw probability without renormalisation (top-1), else g_j / max(Σ kept g, eps) with
// the sum kept for the backward.
KOKKOS_INLINE_FUNCTION void token_weights(float* w, float* sum_out, const int32_t* ex, const int32_t* ch,
                                          const float* p, int k, bool renormalize) {
  if (!renormalize) {
    w[0] = ex[0] >= 0 ? p[ch[0]] : 0.0f;
    return;
  }
  float sum = 0.0f;
  for (int j = 0; j < k; ++j) {
    w[j] = ex[j] >= 0 ? p[ch[j]] : 0.0f;
    sum += w[j];
  }
  *sum_out = sum;
  const float denom = sum < kNormEps ? kNormEps : sum;
  for (int j = 0; j < k; ++j) w[j] /= denom;
}

// One token's d(logits) dg[E] (written) from its d(weights) dw[k] and the l_aux term aux·ce[e].
// The weights reach the gates through the renormalisation (w_j = g_j / D, D = Σ kept g; a clamped
// D is a constant), then the softmax backward.
KOKKOS_INLINE_FUNCTION void token_gate_backward(float* dg, const float* p, const int32_t* ex, const float* w,
                                                const float* dw, const float* ce, float aux, float sum, int E, int k,
                                                bool renormalized) {
  for (int e = 0; e < E; ++e) dg[e] = aux * ce[e];
  if (!renormalized) {
    if (ex[0] >= 0) dg[ex[0]] += dw[0];
  } else {
    const bool clamped = sum < kNormEps;
    const float denom = clamped ? kNormEps : sum;
    // Σ_j dw_j·g_j / D² = Σ_j dw_j·w_j / D
    float through_denom = 0.0f;
    if (!clamped)
      for (int j = 0; j < k; ++j) through_denom += dw[j] * w[j];
    for (int j = 0; j < k; ++j) {
      const int32_t e = ex[j];
      if (e >= 0) dg[e] += (dw[j] - through_denom) / denom;
    }
  }
  double dot = 0.0;
  for (int e = 0; e < E; ++e) dot += static_cast<double>(p[e]) * dg[e];
  for (int e = 0; e < E; ++e) dg[e] = p[e] * (dg[e] - static_cast<float>(dot));
}

// d_logits [S, E] (written) from d(weights) [S·k] and d(l_aux), a token per thread, over a
// routing's tables wherever they live (the CPU form's host vectors, the device form's views).
ZERO3D_KERNEL void gate_backward_tokens(const char* label, const Routing& r, const float* gates, const int32_t* expert,
                                        const float* weight, const float* aux_fraction, const float* kept_gate_sum,
                                        const float* d_weight, float d_l_aux, float* d_logits) {
  const int64_t S = r.num_tokens;
  const int E = r.num_experts, k = r.k;
  const float aux = static_cast<float>(d_l_aux * r.aux_scale / S);
  const bool renormalized = r.renormalized;
  Kokkos::parallel_for(label, range(S), KOKKOS_LAMBDA(Index s) {
    token_gate_backward(d_logits + s * E, gates + s * E, expert + s * k, weight + s * k, d_weight + s * k,
                        aux_fraction, aux, renormalized ? kept_gate_sum[s] : 0.0f, E, k, renormalized);
  });
}
}  // namespace detail

// Tests only: a CPU build routes through the device form when this is set (a GPU build always
// does), so the CPU suite checks it against the CPU form (tests/kernels/test_moe_device_form.cpp).
inline bool& moe_device_form_on_host() {
  static bool on = false;
  return on;
}

// Whether the gate routes through its device form: always on a GPU build.
inline bool routes_on_device() {
#ifdef ZERO3D_DEVICE
  return true;
#else
  return moe_device_form_on_host();
#endif
}

}  // namespace zero3d::kernels::moe
