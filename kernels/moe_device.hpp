// moe_device.hpp — the Mixture-of-Experts gate, dispatch and combine in their device form
// (namespace gpu): what a GPU build runs, and what a CPU build runs under moe_device_form_on_host()
// (tests/kernels/test_moe_device_form.cpp checks it against the CPU form, kernels/moe.hpp cpu::).
//
// Same contract and same semantics as the CPU form (DeepSpeed's top1/top2/topk gating, capacity,
// drop_tokens, RTS, noisy gates; Mixtral's renormalised top-k), with every per-token and per-choice
// table in model memory (RoutingTables) and no host algorithm in a kernel (GPU-GAP A2, C5):
//   * each expert's fill order (DeepSpeed's cumsum over the one-hot mask, token order; top-2 every
//     first choice before every second) is a stable counting sort: per chunk of choices its count
//     per expert, each expert's chunk bases by a prefix sum over chunks, then each chunk places
//     its choices in order. No atomics: the same tables every run, equal to the CPU form's;
//   * the selection policies (top-1 RTS: the C highest uniforms; top-k: the C highest
//     probabilities; equal keys in fill order, as std::stable_sort keeps them) rank each choice
//     within its expert's segment by counting the choices ahead of it, which is the stable sort's
//     position;
//   * per-expert counts and probability sums are team reductions (integers: exact; the double
//     sums in a fixed tree, token order on the host), the aux loss a short serial sum over experts;
//   * dispatch and combine are a team per row, lanes over the hidden size (common.hpp row_teams).
// Only the per-expert figures the host needs cross to it, through the copy helpers (memory.hpp).
//
// Which results equal the CPU form's bits: all routing tables (choices, fill order, experts, slots,
// weights), exp_counts and the rows always; on the host (one lane per team) also l_aux, d(logits)
// and d(weights), which sum in the CPU form's order. On a GPU the double reductions (probability
// sums, combine's d(weight) dot) add in a tree: within a few fp32 roundings.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "kernels/common.hpp"
#include "kernels/memory.hpp"
#include "kernels/moe_routing.hpp"

namespace zero3d::kernels::moe::gpu {

// Choices per scan thread of the fill order: at 8192 choices, 32 chunks.
constexpr Index kFillChunk = 256;

// The flat choice index at place q of the fill sequence: top-2 takes every first choice (token
// order), then every second (DeepSpeed's top2gating: locations2 += sum(mask1)); otherwise s·k + j.
KOKKOS_INLINE_FUNCTION Index fill_choice(Index q, Index S, bool first_choices_first) {
  return first_choices_first ? (q < S ? q * 2 : (q - S) * 2 + 1) : q;
}

using ExpertTeams = Kokkos::TeamPolicy<ExecSpace>;
using ExpertTeam = ExpertTeams::member_type;

// Phase 1: the gates, each token's choices, the per-expert counts, the fill order and l_aux.
ZERO3D_KERNEL void gate_forward_choose(const float* logits, int64_t S, const GateConfig& c, const GateDraws& draws,
                                       Routing& r) {
  const detail::ChoicePolicy p = detail::begin_choice(S, c, draws, r, /*device_form=*/true);
  const int E = c.num_experts, k = c.k;
  const bool rsample = p.rsample, sample2 = p.sample2, argmax = p.argmax;
  RoutingTables& t = r.device;
  const Index n = S * k, chunks = (n + kFillChunk - 1) / kFillChunk;
  float* gates = t.grown(t.gates, S * E, "moe_gates");
  int32_t* choice = t.grown(t.choice, n, "moe_choice");
  int64_t* position = t.grown(t.position, n, "moe_position");
  int64_t* fill_order = t.grown(t.fill_order, n, "moe_fill_order");
  int64_t* fill_offset = t.grown(t.fill_offset, E + 1, "moe_fill_offset");
  int64_t* exp_counts = t.grown(t.exp_counts, E, "moe_exp_counts");
  int64_t* aux_count = t.grown(t.aux_count, E, "moe_aux_count");
  int64_t* base = t.grown(t.chunk_base, chunks * E, "moe_chunk_base");
  double* prob_sum = t.grown(t.prob_sum, E, "moe_prob_sum");
  double* l_aux = t.grown(t.l_aux, 1, "moe_l_aux");
  float* aux_fraction = t.grown(t.aux_fraction, E, "moe_aux_fraction");
  const float* gumbel = draws.gumbel;
  Kokkos::parallel_for("moe_gate_choose_device", range(S), KOKKOS_LAMBDA(Index s) {
    detail::choose_token(logits + s * E, gates + s * E, choice + s * k, gumbel ? gumbel + s * E : nullptr, E, k, argmax,
                         rsample, sample2);
  });
  // Per expert: its choices (exp_counts), the choices l_aux's mask counts (top-2: first choices
  // only), and Σ_s gates[s, e] (double, as the CPU form's mean).
  const int aux_choices = k == 2 && !c.mixtral ? 1 : k;
  Kokkos::parallel_for("moe_expert_counts", ExpertTeams(E, Kokkos::AUTO), KOKKOS_LAMBDA(const ExpertTeam& team) {
    const int e = team.league_rank();
    int64_t chosen = 0, masked = 0;
    double p = 0.0;
    Kokkos::parallel_reduce(
        Kokkos::TeamThreadRange(team, n), [&](Index i, int64_t& acc) { acc += choice[i] == e ? 1 : 0; }, chosen);
    Kokkos::parallel_reduce(
        Kokkos::TeamThreadRange(team, S),
        [&](Index s, int64_t& acc) {
          for (int j = 0; j < aux_choices; ++j) acc += choice[s * k + j] == e ? 1 : 0;
        },
        masked);
    Kokkos::parallel_reduce(
        Kokkos::TeamThreadRange(team, S), [&](Index s, double& acc) { acc += gates[s * E + e]; }, p);
    Kokkos::single(Kokkos::PerTeam(team), [&]() {
      exp_counts[e] = chosen;
      aux_count[e] = masked;
      prob_sum[e] = p;
    });
  });
  // The experts' segments of the fill order, ce and l_aux: E steps, one thread.
  Kokkos::parallel_for("moe_expert_offsets", range(1), KOKKOS_LAMBDA(Index) {
    fill_offset[0] = 0;
    double sum = 0.0;
    for (int e = 0; e < E; ++e) {
      fill_offset[e + 1] = fill_offset[e] + exp_counts[e];
      aux_fraction[e] = static_cast<float>(static_cast<double>(aux_count[e]) / S);
      sum += prob_sum[e] / S * aux_fraction[e];
    }
    l_aux[0] = sum;
  });
  // The stable counting sort: per chunk its count per expert, then per expert its chunks' bases
  // (a prefix sum over chunks in order), then each chunk places its choices in fill order.
  const bool first_choices_first = k == 2;
  Kokkos::parallel_for("moe_fill_chunk_counts", range(chunks), KOKKOS_LAMBDA(Index ch) {
    int64_t* count = base + ch * E;
    for (int e = 0; e < E; ++e) count[e] = 0;
    const Index end = (ch + 1) * kFillChunk < n ? (ch + 1) * kFillChunk : n;
    for (Index q = ch * kFillChunk; q < end; ++q) ++count[choice[fill_choice(q, S, first_choices_first)]];
  });
  Kokkos::parallel_for("moe_fill_chunk_bases", range(E), KOKKOS_LAMBDA(Index e) {
    int64_t at = fill_offset[e];
    for (Index ch = 0; ch < chunks; ++ch) {
      const int64_t count = base[ch * E + e];
      base[ch * E + e] = at;
      at += count;
    }
  });
  Kokkos::parallel_for("moe_fill_order", range(chunks), KOKKOS_LAMBDA(Index ch) {
    int64_t* next = base + ch * E;
    const Index end = (ch + 1) * kFillChunk < n ? (ch + 1) * kFillChunk : n;
    for (Index q = ch * kFillChunk; q < end; ++q) {
      const Index i = fill_choice(q, S, first_choices_first);
      const int32_t e = choice[i];
      const int64_t at = next[e]++;
      fill_order[at] = i;
      position[i] = at - fill_offset[e];
    }
  });
  // What the host needs: the counts (capacity without drops, metrics), Mixtral's probability
  // sums and fractions (its router loss over layers), l_aux.
  r.exp_counts.resize(E);
  r.prob_sum.resize(E);
  r.aux_fraction.resize(E);
  copy_to_host(r.exp_counts.data(), exp_counts, E * sizeof(int64_t));
  copy_to_host(r.prob_sum.data(), prob_sum, E * sizeof(double));
  copy_to_host(r.aux_fraction.data(), aux_fraction, E * sizeof(float));
  r.aux_scale = k <= 2 || c.mixtral ? E : static_cast<double>(E) / k;
  r.l_aux = static_cast<float>(r.aux_scale * read_one(l_aux));
}

// Phase 2: the capacity cut, slots and combine weights for capacity C (the CPU form's rules).
ZERO3D_KERNEL void gate_forward_assign(int64_t C, const GateConfig& c, const GateDraws& draws, Routing& r) {
  const int64_t S = r.num_tokens;
  const int E = r.num_experts, k = r.k;
  const bool rts = k == 1 && c.use_rts;
  if (rts) detail::check_draw(draws.rts_uniform, "random token selection", c);
  const bool by_key = rts || k > 2;  // the selection policies; otherwise the first C in fill order
  r.capacity = C;
  const bool renormalize = k >= 2 || c.mixtral;
  r.renormalized = renormalize;
  RoutingTables& t = r.device;
  const Index n = S * k;
  int32_t* expert = t.grown(t.expert, n, "moe_expert");
  int32_t* slot = t.grown(t.slot, n, "moe_slot");
  float* weight = t.grown(t.weight, n, "moe_weight");
  float* sum_out = t.grown(t.kept_gate_sum, S, "moe_kept_gate_sum");
  int64_t* kept = t.grown(t.kept_per_expert, E, "moe_kept_per_expert");
  int64_t* row_offset = t.grown(t.row_offset, E + 1, "moe_row_offset");
  const int32_t* choice = t.choice.data();
  const int64_t* position = t.position.data();
  const int64_t* fill = t.fill_order.data();
  const int64_t* off = t.fill_offset.data();
  const float* gates = t.gates.data();
  const float* uniform = draws.rts_uniform;
  // Kept when among the expert's first C: by place in the fill order, or by the stable sort's
  // place (choices with a higher key, and equal keys earlier in fill order, go first).
  Kokkos::parallel_for("moe_gate_keep", range(n), KOKKOS_LAMBDA(Index i) {
    const int32_t e = choice[i];
    const int64_t pos = position[i];
    bool keep = pos < C;
    if (by_key) {
      const int64_t first = off[e], end = off[e + 1], a = first + pos;
      keep = end - first <= C;
      if (!keep) {
        const float ka = rts ? uniform[(i / k) * E + e] : gates[(i / k) * E + e];
        int64_t ahead = 0;
        for (int64_t b = first; b < end && ahead < C; ++b) {
          if (b == a) continue;
          const int64_t sb = fill[b] / k;
          const float kb = rts ? uniform[sb * E + e] : gates[sb * E + e];
          if (kb > ka || (b < a && !(ka > kb))) ++ahead;
        }
        keep = ahead < C;
      }
    }
    expert[i] = keep ? e : -1;
    slot[i] = keep && !by_key ? static_cast<int32_t>(pos) : -1;
  });
  // Selection policies: slots follow fill order among the kept choices.
  if (by_key)
    Kokkos::parallel_for("moe_gate_slots", range(n), KOKKOS_LAMBDA(Index i) {
      if (expert[i] < 0) return;
      const int64_t first = off[choice[i]], a = first + position[i];
      int32_t before = 0;
      for (int64_t b = first; b < a; ++b) before += expert[fill[b]] >= 0 ? 1 : 0;
      slot[i] = before;
    });
  Kokkos::parallel_for("moe_expert_rows", range(1), KOKKOS_LAMBDA(Index) {
    row_offset[0] = 0;
    for (int e = 0; e < E; ++e) {
      const int64_t count = off[e + 1] - off[e];
      kept[e] = count < C ? count : C;
      row_offset[e + 1] = row_offset[e] + kept[e];
    }
  });
  Kokkos::parallel_for("moe_gate_weights_device", range(S), KOKKOS_LAMBDA(Index s) {
    detail::token_weights(weight + s * k, sum_out + s, expert + s * k, choice + s * k, gates + s * E, k, renormalize);
  });
  // The host's: the all-to-all's counts and the rows.
  r.kept_per_expert.resize(E);
  r.row_offset.resize(E + 1);
  copy_to_host(r.kept_per_expert.data(), kept, E * sizeof(int64_t));
  copy_to_host(r.row_offset.data(), row_offset, (E + 1) * sizeof(int64_t));
}

// d_logits [S, E] (written) from d(weights) [S·k] and d(l_aux), as the CPU form.
ZERO3D_KERNEL void gate_backward(const Routing& r, const float* d_weight, float d_l_aux, float* d_logits) {
  const RoutingTables& t = r.device;
  detail::gate_backward_tokens("moe_gate_backward_device", r, t.gates.data(), t.expert.data(), t.weight.data(),
                               t.aux_fraction.data(), t.kept_gate_sum.data(), d_weight, d_l_aux, d_logits);
}

// rows[row(i)] = x[token of i] for every kept choice i: a team per choice, lanes over h.
ZERO3D_KERNEL void dispatch_forward(float* rows, const float* x, const Routing& r, Index h) {
  const int k = r.k;
  const Index n = r.num_tokens * k;
  const int32_t* expert = r.device.expert.data();
  const int32_t* slot = r.device.slot.data();
  const int64_t* row_offset = r.device.row_offset.data();
  Kokkos::parallel_for("moe_dispatch_forward_device", row_teams(n), KOKKOS_LAMBDA(const RowTeam& team) {
    const Index i = team_row(team);
    if (i >= n || expert[i] < 0) return;
    float* out = rows + (row_offset[expert[i]] + slot[i]) * h;
    const float* in = x + (i / k) * h;
    Kokkos::parallel_for(Kokkos::ThreadVectorRange(team, h), [&](Index c) { out[c] = in[c]; });
  });
}

// dx[s] = Σ_j d_rows[row(s, j)] over kept choices in j order (written): a team per token.
ZERO3D_KERNEL void dispatch_backward(float* dx, const float* d_rows, const Routing& r, Index h) {
  const int k = r.k;
  const Index S = r.num_tokens;
  const int32_t* expert = r.device.expert.data();
  const int32_t* slot = r.device.slot.data();
  const int64_t* row_offset = r.device.row_offset.data();
  Kokkos::parallel_for("moe_dispatch_backward_device", row_teams(S), KOKKOS_LAMBDA(const RowTeam& team) {
    const Index s = team_row(team);
    if (s >= S) return;
    float* d = dx + s * h;
    Kokkos::parallel_for(Kokkos::ThreadVectorRange(team, h), [&](Index c) {
      float v = 0.0f;
      for (int j = 0; j < k; ++j) {
        const int64_t i = s * k + j;
        if (expert[i] >= 0) v += d_rows[(row_offset[expert[i]] + slot[i]) * h + c];
      }
      d[c] = v;
    });
  });
}

// out[s] = Σ_j weight[s, j]·y_rows[row(s, j)] in j order (written; 0 when every choice dropped).
ZERO3D_KERNEL void combine_forward(float* out, const float* y_rows, const Routing& r, Index h) {
  const int k = r.k;
  const Index S = r.num_tokens;
  const int32_t* expert = r.device.expert.data();
  const int32_t* slot = r.device.slot.data();
  const float* weight = r.device.weight.data();
  const int64_t* row_offset = r.device.row_offset.data();
  Kokkos::parallel_for("moe_combine_forward_device", row_teams(S), KOKKOS_LAMBDA(const RowTeam& team) {
    const Index s = team_row(team);
    if (s >= S) return;
    float* o = out + s * h;
    Kokkos::parallel_for(Kokkos::ThreadVectorRange(team, h), [&](Index c) {
      float v = 0.0f;
      for (int j = 0; j < k; ++j) {
        const int64_t i = s * k + j;
        if (expert[i] >= 0) v += weight[i] * y_rows[(row_offset[expert[i]] + slot[i]) * h + c];
      }
      o[c] = v;
    });
  });
}

// d_rows[row(i)] = weight[i]·d_out[token of i]; d_weight[i] = d_out[token]·y_rows[row(i)] (a
// double dot over the lanes; 0 for a dropped choice). A team per choice.
ZERO3D_KERNEL void combine_backward(float* d_rows, float* d_weight, const float* d_out, const float* y_rows,
                                    const Routing& r, Index h) {
  const int k = r.k;
  const Index n = r.num_tokens * k;
  const int32_t* expert = r.device.expert.data();
  const int32_t* slot = r.device.slot.data();
  const float* weight = r.device.weight.data();
  const int64_t* row_offset = r.device.row_offset.data();
  Kokkos::parallel_for("moe_combine_backward_device", row_teams(n), KOKKOS_LAMBDA(const RowTeam& team) {
    const Index i = team_row(team);
    if (i >= n) return;
    if (expert[i] < 0) {
      Kokkos::single(Kokkos::PerThread(team), [&]() { d_weight[i] = 0.0f; });
      return;
    }
    const int64_t row = row_offset[expert[i]] + slot[i];
    const float* d = d_out + (i / k) * h;
    const float* y = y_rows + row * h;
    float* dr = d_rows + row * h;
    const float w = weight[i];
    double dot = 0.0;
    Kokkos::parallel_reduce(
        Kokkos::ThreadVectorRange(team, h),
        [&](Index c, double& acc) {
          dr[c] = w * d[c];
          acc += static_cast<double>(d[c]) * y[c];
        },
        dot);
    Kokkos::single(Kokkos::PerThread(team), [&]() { d_weight[i] = static_cast<float>(dot); });
  });
}

}  // namespace zero3d::kernels::moe::gpu
