// test_moe_device_form.cpp — the Mixture-of-Experts gate, dispatch and combine in their device
// form (kernels/moe_device.hpp, what a GPU build runs: routing tables in model memory, each
// expert's fill order a stable counting sort from prefix sums over chunks of choices, the
// selection policies as ranks within an expert's segment, dispatch and combine a team per row)
// against the CPU form (kernels/moe.hpp cpu::, host vectors and std::stable_sort), on the CPU
// through moe_device_form_on_host().
//
// On the host (one lane per team) both forms add in the same order, so they agree bit for bit:
// routing tables, counts, l_aux, outputs and every gradient. (On a GPU the probability sums and
// combine's d(weight) dot add in a tree; the GPU suite holds that to the CPU build's losses.)
// Then training: a tiny GPT-2 MoE (also PR-MoE with RTS, and RSample without drops) and a tiny
// Mixtral through the engine give the CPU form's losses within 1e-5 (on the host: equal).
#include <gtest/gtest.h>
#include <mpi.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "base/rng.hpp"
#include "config/config.hpp"
#include "kernels/moe.hpp"
#include "parallel/comm.hpp"
#include "parallel/topology.hpp"
#include "support/model_memory.hpp"
#include "support/moe_training.hpp"
#include "train/engine.hpp"
#include "zero/shard_groups.hpp"

using namespace zero3d;
using namespace zero3d::kernels;
using namespace zero3d::kernels::moe;
using test_support::expect_same_bits;
using test_support::normal_vector;

namespace {

constexpr Index kHidden = 24;

// A case: the gate's settings, the micro-batch's tokens, and logits (optionally biased towards
// some experts, so loads are uneven or an expert gets no token).
struct Case {
  Case(std::string n, const GateConfig& g) : name(std::move(n)), gate(g) {}
  std::string name;
  GateConfig gate;
  int64_t S = 300;  // 300 tokens: top-2's 600 choices span three scan chunks
  std::vector<float> expert_bias;  // added to every token's logit of expert e (empty: none)
  bool tied_logits = false;        // every token's logits equal: every selection key ties
};

GateConfig gate(int E, int k, double cf, bool drop_tokens = true) {
  GateConfig c;
  c.num_experts = E;
  c.k = k;
  c.capacity_factor = cf;
  c.min_capacity = 4;
  c.drop_tokens = drop_tokens;
  c.use_rts = false;
  c.top2_2nd_expert_sampling = false;
  return c;
}

// What one form computes for a case: the routing as the host sees it, the tables (read through
// the copy helpers), and a layer's forward and backward around a made-up expert y = tanh(x)·(e+1).
struct Layer {
  std::vector<int64_t> exp_counts, kept_per_expert, row_offset;
  std::vector<float> aux_fraction;
  float l_aux = 0.0f;
  std::vector<int32_t> expert, slot;
  std::vector<float> weight, rows, out, d_weight, dx, d_logits;
};

template <typename T>
std::vector<T> to_host(const T* p, size_t n) {
  std::vector<T> v(n);
  copy_to_host(v.data(), p, n * sizeof(T));
  return v;
}

Layer run(const Case& cs, bool device_form) {
  const GateConfig& c = cs.gate;
  const int E = c.num_experts, k = c.k;
  const int64_t S = cs.S;
  std::vector<float> logits = normal_vector(41, S * E, 1, 1.5f);
  if (cs.tied_logits) std::fill(logits.begin(), logits.end(), 0.25f);
  if (!cs.expert_bias.empty())
    for (int64_t s = 0; s < S; ++s)
      for (int e = 0; e < E; ++e) logits[s * E + e] += cs.expert_bias[e];
  std::vector<float> uniform(S * E), gumbel(S * E);
  Rng rng(77, 3);
  for (auto& u : uniform) u = static_cast<float>(rng.uniform());
  if (cs.tied_logits)  // ties among the RTS keys too: four values only
    for (auto& u : uniform) u = std::floor(u * 4.0f) / 4.0f;
  for (auto& g : gumbel) g = static_cast<float>(-std::log(-std::log(std::max(rng.uniform(), 1e-20))));
  GateDraws host;
  if (uses_rts_uniform(c)) host.rts_uniform = uniform.data();
  if (uses_gumbel(c)) host.gumbel = gumbel.data();
  const std::vector<float> x = normal_vector(41, S * kHidden, 2), d_out = normal_vector(41, S * kHidden, 3);

  Routing r;
  moe_device_form_on_host() = device_form;
  const GateDraws draws = draws_for_form(r, device_form, host, S * E);
  gate_forward(logits.data(), S, c, draws, r);
  moe_device_form_on_host() = false;
  EXPECT_EQ(r.device_form, device_form) << cs.name;
  const int64_t R = r.num_rows();
  Layer l;
  l.exp_counts = r.exp_counts;
  l.kept_per_expert = r.kept_per_expert;
  l.row_offset = r.row_offset;
  l.aux_fraction = r.aux_fraction;
  l.l_aux = r.l_aux;
  l.expert = to_host(r.expert_table(), S * k);
  l.slot = to_host(r.slot_table(), S * k);
  l.weight = to_host(r.weight_table(), S * k);
  l.rows.assign(R * kHidden, -7.0f);
  dispatch_forward(l.rows.data(), x.data(), r, kHidden);
  std::vector<float> y(R * kHidden), dy_rows(R * kHidden), dr(R * kHidden);
  for (int e = 0; e < E; ++e)
    for (int64_t row = r.row_offset[e]; row < r.row_offset[e + 1]; ++row)
      for (Index i = 0; i < kHidden; ++i) y[row * kHidden + i] = std::tanh(l.rows[row * kHidden + i]) * (e + 1);
  l.out.assign(S * kHidden, -7.0f);
  combine_forward(l.out.data(), y.data(), r, kHidden);
  l.d_weight.assign(S * k, -7.0f);
  combine_backward(dr.data(), l.d_weight.data(), d_out.data(), y.data(), r, kHidden);
  for (int e = 0; e < E; ++e)
    for (int64_t row = r.row_offset[e]; row < r.row_offset[e + 1]; ++row)
      for (Index i = 0; i < kHidden; ++i) {
        const float t = std::tanh(l.rows[row * kHidden + i]);
        dy_rows[row * kHidden + i] = dr[row * kHidden + i] * (1.0f - t * t) * (e + 1);
      }
  l.dx.assign(S * kHidden, -7.0f);
  dispatch_backward(l.dx.data(), dy_rows.data(), r, kHidden);
  l.d_logits.assign(S * E, -7.0f);
  gate_backward(r, l.d_weight.data(), 0.37f, l.d_logits.data());
  return l;
}

void expect_forms_agree(const Case& cs) {
  const Layer cpu = run(cs, false), dev = run(cs, true);
  const std::string& n = cs.name;
  EXPECT_EQ(dev.exp_counts, cpu.exp_counts) << n;
  EXPECT_EQ(dev.kept_per_expert, cpu.kept_per_expert) << n;
  EXPECT_EQ(dev.row_offset, cpu.row_offset) << n;
  EXPECT_EQ(dev.expert, cpu.expert) << n << ": which choices are kept";
  EXPECT_EQ(dev.slot, cpu.slot) << n << ": slots";
  expect_same_bits(n + " aux fractions", dev.aux_fraction, cpu.aux_fraction);
  EXPECT_EQ(dev.l_aux, cpu.l_aux) << n << ": l_aux";
  expect_same_bits(n + " combine weights", dev.weight, cpu.weight);
  expect_same_bits(n + " dispatched rows", dev.rows, cpu.rows);
  expect_same_bits(n + " output", dev.out, cpu.out);
  expect_same_bits(n + " d(weights)", dev.d_weight, cpu.d_weight);
  expect_same_bits(n + " d(input)", dev.dx, cpu.dx);
  expect_same_bits(n + " d(logits)", dev.d_logits, cpu.d_logits);
  int64_t kept = 0;
  for (int32_t e : cpu.expert) kept += e >= 0;
  std::printf("[ moe      ] %s: %lld of %zu choices kept, loads", n.c_str(), static_cast<long long>(kept),
              cpu.expert.size());
  for (int64_t c : cpu.exp_counts) std::printf(" %lld", static_cast<long long>(c));
  std::printf(", l_aux %.6f%s\n", cpu.l_aux,
              ::testing::Test::HasFailure() ? "" : ": device form = CPU form bit for bit");
}

int64_t dropped(const Layer& l) {
  return static_cast<int64_t>(std::count(l.expert.begin(), l.expert.end(), -1));
}

}  // namespace

// ---- top-1 ----------------------------------------------------------------------------------

TEST(MoeDeviceForm, TopOneKeepsTheFirstTokensUpToCapacity) {
  Case c{"top-1 first C", gate(4, 1, 0.5)};
  expect_forms_agree(c);
  EXPECT_GT(dropped(run(c, true)), 0) << "the capacity drops tokens";
}

TEST(MoeDeviceForm, TopOneWithRandomTokenSelectionKeepsTheHighestUniforms) {
  Case c{"top-1 RTS", gate(4, 1, 0.6)};
  c.gate.use_rts = true;
  expect_forms_agree(c);
  // ... and the selection is not the first-C rule
  Case first = c;
  first.gate.use_rts = false;
  EXPECT_NE(run(c, true).expert, run(first, true).expert);
}

TEST(MoeDeviceForm, TopOneWithRSampleAndWithoutDroppingTokens) {
  Case c{"top-1 RSample, no drops", gate(4, 1, 1.0, /*drop_tokens=*/false)};
  c.gate.noise = NoisyGate::RSample;
  expect_forms_agree(c);
  EXPECT_EQ(dropped(run(c, true)), 0);
  c.gate.training = false;  // eval: no Gumbel noise, the eval capacity factor
  c.name = "top-1 eval";
  c.gate.drop_tokens = true;
  c.gate.eval_capacity_factor = 0.5;
  expect_forms_agree(c);
}

// ---- top-2 ----------------------------------------------------------------------------------

TEST(MoeDeviceForm, TopTwoFillsFirstChoicesBeforeSecondAndDrops) {
  Case c{"top-2 drops", gate(6, 2, 0.5)};
  expect_forms_agree(c);
  EXPECT_GT(dropped(run(c, true)), 0);
  c.name = "top-2 drops, second expert sampled";
  c.gate.top2_2nd_expert_sampling = true;
  expect_forms_agree(c);
}

TEST(MoeDeviceForm, TopTwoWithoutDroppingTokens) {
  Case c{"top-2 no drops", gate(6, 2, 0.5, /*drop_tokens=*/false)};
  expect_forms_agree(c);
  EXPECT_EQ(dropped(run(c, true)), 0);
}

// ---- top-k, Mixtral -------------------------------------------------------------------------

TEST(MoeDeviceForm, TopThreeKeepsEachExpertsMostProbableTokens) {
  Case c{"top-3 probs policy", gate(8, 3, 0.6)};
  expect_forms_agree(c);
  EXPECT_GT(dropped(run(c, true)), 0);
}

TEST(MoeDeviceForm, MixtralsRouterRenormalisesItsTopK) {
  for (int k : {1, 2, 3}) {
    Case c{"Mixtral top-" + std::to_string(k), gate(4, k, 1.0, /*drop_tokens=*/false)};
    c.gate.mixtral = true;
    c.gate.use_rts = false;
    expect_forms_agree(c);
  }
}

// ---- loads ----------------------------------------------------------------------------------

// Expert 0 wanted by most tokens, expert 3 by none: counts 0 and capacity cuts in one layer.
TEST(MoeDeviceForm, UnevenLoadsAndAnExpertWithNoToken) {
  for (int k : {1, 2, 3}) {
    Case c{"uneven top-" + std::to_string(k), gate(5, k, 1.0)};
    c.expert_bias = {3.0f, 1.0f, 0.0f, -40.0f, 0.5f};
    c.S = 97;
    expect_forms_agree(c);
    const Layer l = run(c, true);
    EXPECT_EQ(l.exp_counts[3], 0) << c.name;
    EXPECT_GT(l.exp_counts[0], l.exp_counts[2]) << c.name;
  }
}

// Every key equal: the stable order (fill order among equals) decides what is kept.
TEST(MoeDeviceForm, EqualKeysKeepTheFillOrder) {
  Case topk{"tied top-3", gate(6, 3, 0.4)};
  topk.tied_logits = true;
  expect_forms_agree(topk);
  Case rts{"tied RTS", gate(3, 1, 0.5)};
  rts.gate.use_rts = true;
  rts.tied_logits = true;
  expect_forms_agree(rts);
  EXPECT_GT(dropped(run(rts, true)), 0);
}

TEST(MoeDeviceForm, TwoRunsGiveTheSameBits) {
  Case c{"top-2 sampled", gate(6, 2, 0.5)};
  c.gate.top2_2nd_expert_sampling = true;
  const Layer a = run(c, true), b = run(c, true);
  EXPECT_EQ(a.expert, b.expert);
  EXPECT_EQ(a.slot, b.slot);
  expect_same_bits("output", a.out, b.out);
  expect_same_bits("d(logits)", a.d_logits, b.d_logits);
  expect_same_bits("d(input)", a.dx, b.dx);
}

// ---- training -------------------------------------------------------------------------------

namespace {

using json = nlohmann::json;

// A tiny GPT-2 with MoE in both blocks (top-2 over 4 experts dropping about half, Jitter noise on
// the gate's input), and a tiny Mixtral (top-2 of 4 SwiGLU experts, router jitter).
json gpt2_moe() { return test_support::tiny_gpt2_moe(1, {{"noisy_gate_policy", "Jitter"}}); }

json mixtral() {
  return json{{"train_batch_size", 8},
              {"train_micro_batch_size_per_gpu", 4},
              {"gradient_clipping", 1.0},
              {"steps_per_print", 1000},
              {"optimizer", {{"type", "AdamW"}, {"params", {{"lr", 3e-3}, {"weight_decay", 0.01}}}}},
              {"model",
               {{"architecture", "mixtral"},
                {"vocab_size", 64},
                {"hidden_size", 32},
                {"intermediate_size", 48},
                {"num_hidden_layers", 2},
                {"num_attention_heads", 4},
                {"num_key_value_heads", 2},
                {"num_local_experts", 4},
                {"num_experts_per_tok", 2},
                {"router_jitter_noise", 0.1},
                {"max_position_embeddings", 64},
                {"seq_length", 16}}},
              {"training", {{"steps", 4}, {"seed", 5}}}};
}

void expect_training_agrees(const json& j, const std::string& name) {
  const std::vector<double> cpu = test_support::moe_losses_and_norms(j, false),
                            dev = test_support::moe_losses_and_norms(j, true);
  ASSERT_EQ(cpu.size(), dev.size());
  ASSERT_EQ(cpu.size(), 8u);
  double worst = 0.0;
  for (size_t i = 0; i < cpu.size(); ++i) worst = std::max(worst, std::fabs(dev[i] - cpu[i]) / std::fabs(cpu[i]));
  std::printf("[ moe      ] %s: 4 AdamW steps, losses and gradient norms within %.1e of the CPU form's\n",
              name.c_str(), worst);
  for (size_t i = 0; i < cpu.size(); ++i)
    EXPECT_NEAR(dev[i], cpu[i], 1e-5 * std::fabs(cpu[i])) << name << " step " << i / 2 + 1
                                                          << (i % 2 ? " gradient norm" : " loss");
  EXPECT_NE(cpu.front(), cpu[cpu.size() - 2]) << name << ": the model trains";
}

}  // namespace

TEST(MoeDeviceForm, TrainingAGpt2MoeGivesTheCpuFormsLosses) {
  expect_training_agrees(gpt2_moe(), "GPT-2 MoE");
  // PR-MoE (use_residual) with top-1's random token selection, and top-1 RSample without drops
  json residual = gpt2_moe();
  residual["model"]["moe"].update(json{{"k", 1}, {"use_residual", true}, {"capacity_factor", 0.7}});
  expect_training_agrees(residual, "GPT-2 residual MoE, top-1 RTS");
  json no_drops = gpt2_moe();
  no_drops["model"]["moe"].update(json{{"k", 1}, {"drop_tokens", false}, {"noisy_gate_policy", "RSample"}});
  expect_training_agrees(no_drops, "GPT-2 MoE, top-1 RSample without drops");
}

TEST(MoeDeviceForm, TrainingATinyMixtralGivesTheCpuFormsLosses) { expect_training_agrees(mixtral(), "Mixtral"); }
