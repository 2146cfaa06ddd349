// test_moe_gating.cpp — DeepSpeed's MoE gate, dispatch and combine (kernels/moe.hpp).
//
// First the rules as small hand-made cases (capacity arithmetic, fill order, what drops and what
// a dropped token gets); then a whole single-process MoE layer — gate matmul, gate, dispatch,
// GPT-2 expert MLPs (matmul.hpp, gelu.hpp), combine, residual MoE — forward and backward against
// the PyTorch reference in tests/golden/moe_gating.h5 (tests/golden/make_moe_goldens.py), which
// builds DeepSpeed's dense [S, E, C] combine tensor, to 1e-6.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <string>
#include <vector>

#include "io/h5.hpp"
#include "kernels/gelu.hpp"
#include "kernels/matmul.hpp"
#include "kernels/moe.hpp"

using namespace zero3d;
using namespace zero3d::kernels;
using namespace zero3d::kernels::moe;

namespace {

GateConfig config(int E, int k, double cf, int64_t min_capacity = 0) {
  GateConfig c;
  c.num_experts = E;
  c.k = k;
  c.capacity_factor = cf;
  c.min_capacity = min_capacity;
  return c;
}

// Logits that make each token prefer experts in the given order (first strongest).
std::vector<float> logits_preferring(const std::vector<std::vector<int>>& prefs, int E) {
  std::vector<float> z(prefs.size() * E, 0.0f);
  for (size_t s = 0; s < prefs.size(); ++s)
    for (size_t r = 0; r < prefs[s].size(); ++r) z[s * E + prefs[s][r]] = 3.0f - static_cast<float>(r);
  return z;
}

// ---- capacity -------------------------------------------------------------------------------

TEST(MoeCapacity, IsCeilOfTokensPerExpertTimesFactor) {
  EXPECT_EQ(capacity(3, config(4, 1, 8.0)), 6);    // ceil(3/4 · 8)
  EXPECT_EQ(capacity(16, config(4, 1, 0.3)), 2);   // ceil(1.2)
  EXPECT_EQ(capacity(8, config(2, 1, 4.0)), 16);   // may exceed the token count
  EXPECT_EQ(capacity(16, config(4, 2, 0.5)), 4);   // top-2 doubles the factor
  EXPECT_EQ(capacity(16, config(6, 3, 0.75)), 6);  // top-k multiplies it by k
}

TEST(MoeCapacity, IsRaisedToMinCapacity) {
  EXPECT_EQ(capacity(16, config(4, 1, 0.1, 3)), 3);
  EXPECT_EQ(capacity(16, config(4, 1, 0.1, 0)), 1);
  EXPECT_EQ(capacity(16, config(4, 1, 2.0, 3)), 8);
}

TEST(MoeCapacity, UsesTheEvalFactorOutsideTraining) {
  GateConfig c = config(4, 1, 2.0);
  c.eval_capacity_factor = 0.5;
  EXPECT_EQ(capacity(16, c), 8);
  c.training = false;
  EXPECT_EQ(capacity(16, c), 2);
}

TEST(MoeCapacity, RoundsLikeDeepSpeedsFloat32Product) {
  // 25/2 · 1.2 is 15 (so in double too), but float32(12.5) · float32(1.2) rounds to 15.000001.
  EXPECT_EQ(capacity(25, config(2, 1, 1.2)), 16);
  // 25/3 · 2·0.9 is 15: double gives 15.000000000000002 (16), float32 gives 15.0 — as DeepSpeed.
  EXPECT_EQ(capacity(25, config(3, 2, 0.9)), 15);
}

TEST(MoeCapacity, WithoutDropsIsTheLargestCountRoundedToTensorParallel) {
  EXPECT_EQ(capacity_without_drops(5, 16, 1, config(4, 2, 1.0)), 5);
  EXPECT_EQ(capacity_without_drops(5, 16, 2, config(4, 2, 1.0)), 6);
  EXPECT_EQ(capacity_without_drops(5, 4, 2, config(4, 2, 1.0)), 6);  // top-2: no cap at S
  EXPECT_EQ(capacity_without_drops(5, 4, 2, config(4, 1, 1.0)), 4);  // top-1: at most S
}

// ---- routing rules --------------------------------------------------------------------------

TEST(MoeGate, Top1WithCapacityAboveTokenCountKeepsEveryToken) {
  GateConfig c = config(2, 1, 4.0);
  c.use_rts = false;
  const std::vector<float> z = logits_preferring({{0}, {0}, {1}, {0}, {0}, {1}, {0}, {0}}, 2);
  Routing r;
  gate_forward(z.data(), 8, c, {}, r);
  EXPECT_EQ(r.capacity, 16);
  EXPECT_EQ(r.dropped(), 0);
  EXPECT_EQ(r.exp_counts, (std::vector<int64_t>{6, 2}));
  EXPECT_EQ(r.slot, (std::vector<int32_t>{0, 1, 0, 2, 3, 1, 4, 5}));
}

TEST(MoeGate, Top1WithoutRtsKeepsEachExpertsFirstTokens) {
  GateConfig c = config(2, 1, 0.5);  // C = ceil(6/2 · 0.5) = 2
  c.use_rts = false;
  const std::vector<float> z = logits_preferring({{1}, {0}, {0}, {1}, {0}, {0}}, 2);
  Routing r;
  gate_forward(z.data(), 6, c, {}, r);
  EXPECT_EQ(r.expert, (std::vector<int32_t>{1, 0, 0, 1, -1, -1}));
  EXPECT_EQ(r.slot, (std::vector<int32_t>{0, 0, 1, 1, -1, -1}));
  EXPECT_EQ(r.exp_counts, (std::vector<int64_t>{4, 2}));  // counted before dropping
  EXPECT_EQ(r.weight[4], 0.0f);
  EXPECT_FLOAT_EQ(r.weight[1], r.gates[1 * 2 + 0]);  // top-1 weight: the raw probability
}

TEST(MoeGate, Top1WithRtsKeepsHighestDrawsInTokenOrderSlots) {
  GateConfig c = config(2, 1, 0.5);  // C = 2
  const std::vector<float> z = logits_preferring({{0}, {0}, {0}, {0}, {1}, {1}}, 2);
  // U for expert 0's tokens 0..3: tokens 3 and 1 draw highest; token 4's draw for expert 0 is
  // the largest of all but the token is not expert 0's, so it does not count.
  const std::vector<float> u = {0.1f, 0.0f, 0.8f, 0.0f, 0.3f, 0.0f, 0.9f, 0.0f, 0.99f, 0.2f, 0.0f, 0.4f};
  GateDraws d;
  d.rts_uniform = u.data();
  Routing r;
  gate_forward(z.data(), 6, c, d, r);
  EXPECT_EQ(r.expert, (std::vector<int32_t>{-1, 0, -1, 0, 1, 1}));
  EXPECT_EQ(r.slot, (std::vector<int32_t>{-1, 0, -1, 1, 0, 1}));
}

TEST(MoeGate, Top2FillsEveryFirstChoiceBeforeAnySecondChoice) {
  GateConfig c = config(3, 2, 1.0);  // C = ceil(4/3 · 2) = 3
  c.top2_2nd_expert_sampling = false;
  // Token 0's second choice is expert 1, which tokens 1..3 take first: it queues behind them.
  const std::vector<float> z = logits_preferring({{0, 1}, {1, 2}, {1, 0}, {1, 2}}, 3);
  Routing r;
  gate_forward(z.data(), 4, c, {}, r);
  EXPECT_EQ(r.capacity, 3);
  EXPECT_EQ(r.choice, (std::vector<int32_t>{0, 1, 1, 2, 1, 0, 1, 2}));
  // expert 1: first choices of tokens 1, 2, 3 take slots 0..2; token 0's second choice is 4th: dropped.
  EXPECT_EQ(r.expert, (std::vector<int32_t>{0, -1, 1, 2, 1, 0, 1, 2}));
  EXPECT_EQ(r.slot, (std::vector<int32_t>{0, -1, 0, 0, 1, 1, 2, 1}));
  EXPECT_EQ(r.exp_counts, (std::vector<int64_t>{2, 4, 2}));
  // The kept choice alone carries the token: renormalised to 1.
  EXPECT_FLOAT_EQ(r.weight[0], 1.0f);
  EXPECT_EQ(r.weight[1], 0.0f);
  EXPECT_FLOAT_EQ(r.weight[2] + r.weight[3], 1.0f);
}

TEST(MoeGate, Top2SecondExpertFollowsGumbelSampling) {
  GateConfig c = config(3, 2, 1.0);
  const std::vector<float> z = logits_preferring({{0, 1, 2}, {0, 1, 2}}, 3);
  const std::vector<float> gumbel = {0.0f, 0.0f, 1.5f, 0.0f, 0.0f, 0.5f};  // token 0: 0+1.5 > 1
  GateDraws d;
  d.gumbel = gumbel.data();
  Routing r;
  gate_forward(z.data(), 2, c, d, r);
  EXPECT_EQ(r.choice, (std::vector<int32_t>{0, 2, 0, 1}));
}

TEST(MoeGate, TopKKeepsEachExpertsMostProbableTokens) {
  GateConfig c = config(4, 3, 0.25);  // C = ceil(3/4 · 3 · 0.25) = 1
  // Every token ranks 0 > 1 > 2 > 3 but with different confidence in expert 0.
  const std::vector<float> z = {1.0f, 0.5f, 0.0f, -1.0f, 3.0f, 0.5f, 0.0f, -1.0f, 2.0f, 0.5f, 0.0f, -1.0f};
  Routing r;
  gate_forward(z.data(), 3, c, {}, r);
  EXPECT_EQ(r.capacity, 1);
  EXPECT_EQ(r.choice, (std::vector<int32_t>{0, 1, 2, 0, 1, 2, 0, 1, 2}));
  // expert 0 keeps token 1 (p highest); experts 1 and 2 keep token 0 (its probabilities there are highest).
  EXPECT_EQ(r.expert, (std::vector<int32_t>{-1, 1, 2, 0, -1, -1, -1, -1, -1}));
  EXPECT_FLOAT_EQ(r.weight[3], 1.0f);
  EXPECT_FLOAT_EQ(r.weight[1] + r.weight[2], 1.0f);
}

TEST(MoeGate, AuxLossCountsTop1MaskBeforeDropping) {
  GateConfig c = config(2, 1, 0.5);  // C = 2: token 4, 5 drop
  c.use_rts = false;
  const std::vector<float> z = logits_preferring({{1}, {0}, {0}, {1}, {0}, {0}}, 2);
  Routing r;
  gate_forward(z.data(), 6, c, {}, r);
  double me0 = 0.0, me1 = 0.0;
  for (int s = 0; s < 6; ++s) me0 += r.gates[s * 2] / 6.0, me1 += r.gates[s * 2 + 1] / 6.0;
  EXPECT_NEAR(r.l_aux, 2.0 * (me0 * 4.0 / 6.0 + me1 * 2.0 / 6.0), 1e-6);
}

TEST(MoeGate, RefusesMissingDrawsAndTooFewTokens) {
  Routing r;
  const std::vector<float> z(8 * 2, 0.0f);
  EXPECT_THROW(gate_forward(z.data(), 8, config(2, 1, 1.0), {}, r), SystemError);  // use_rts needs U
  GateConfig c2 = config(2, 2, 1.0);
  EXPECT_THROW(gate_forward(z.data(), 8, c2, {}, r), SystemError);  // second-expert sampling needs Gumbel
  GateConfig c = config(2, 1, 1.0, 9);
  c.use_rts = false;
  EXPECT_THROW(gate_forward(z.data(), 8, c, {}, r), InputError);  // S < min_capacity (top-1)
  EXPECT_THROW(gate_forward(z.data(), 8, config(2, 3, 1.0), {}, r), InputError);  // k > E
}

TEST(MoeGate, DroppedTokensGetZeroOutputAndZeroGradient) {
  GateConfig c = config(2, 1, 0.5);  // C = 1 of 4 tokens
  c.use_rts = false;
  const std::vector<float> z = logits_preferring({{0}, {0}, {1}, {1}}, 2);
  Routing r;
  gate_forward(z.data(), 4, c, {}, r);
  ASSERT_EQ(r.expert, (std::vector<int32_t>{0, -1, 1, -1}));
  const Index h = 3;
  std::vector<float> x(4 * h), rows(r.num_rows() * h), out(4 * h, 7.0f), dx(4 * h, 7.0f);
  std::iota(x.begin(), x.end(), 1.0f);
  dispatch_forward(rows.data(), x.data(), r, h);
  EXPECT_EQ(rows, (std::vector<float>{1, 2, 3, 7, 8, 9}));  // tokens 0 and 2, expert-major
  combine_forward(out.data(), rows.data(), r, h);           // identity experts
  for (Index i = 0; i < h; ++i) {
    EXPECT_EQ(out[1 * h + i], 0.0f);
    EXPECT_EQ(out[3 * h + i], 0.0f);
    EXPECT_FLOAT_EQ(out[i], r.weight[0] * x[i]);
  }
  std::vector<float> d_rows(rows.size()), d_weight(4, 7.0f), d_out(4 * h, 1.0f);
  combine_backward(d_rows.data(), d_weight.data(), d_out.data(), rows.data(), r, h);
  EXPECT_EQ(d_weight[1], 0.0f);
  EXPECT_FLOAT_EQ(d_weight[0], 1.0f + 2.0f + 3.0f);
  dispatch_backward(dx.data(), d_rows.data(), r, h);
  for (Index i = 0; i < h; ++i) EXPECT_EQ(dx[1 * h + i], 0.0f);
}

// ---- the layer against PyTorch --------------------------------------------------------------

struct Case {
  h5::File file;
  std::string name;
  GateConfig cfg;
  int64_t S = 0, h = 0, capacity = 0;
  bool residual = false;
  double aux_coef = 0.0;
  std::vector<float> get(const std::string& key) const { return file.read_floats(name + "/" + key); }
  std::vector<int32_t> ints(const std::string& key) const { return file.read_ints(name + "/" + key); }
  bool has(const std::string& key) const { return file.has(name + "/" + key); }
};

Case load(const std::string& name) {
  Case c{h5::File::open_read(std::string(ZERO3D_GOLDEN_DIR) + "/moe_gating.h5"), name, {}};
  h5::Handle g(H5Gopen2(c.file.id(), name.c_str(), H5P_DEFAULT), H5Gclose);
  auto attr = [&](const char* key) {
    int64_t v = 0;
    EXPECT_TRUE(h5::read_attribute(g.get(), key, v)) << name << ": " << key;
    return v;
  };
  c.cfg.k = static_cast<int>(attr("k"));
  c.cfg.num_experts = static_cast<int>(attr("num_experts"));
  c.cfg.min_capacity = attr("min_capacity");
  c.cfg.drop_tokens = attr("drop_tokens") != 0;
  c.cfg.use_rts = attr("use_rts") != 0;
  c.cfg.top2_2nd_expert_sampling = attr("top2_2nd_expert_sampling") != 0;
  c.cfg.training = attr("training") != 0;
  c.residual = attr("use_residual") != 0;
  c.capacity = attr("capacity");
  std::string noise;
  EXPECT_TRUE(h5::read_attribute(g.get(), "noise", noise));
  c.cfg.noise = noise == "Jitter" ? NoisyGate::Jitter : noise == "RSample" ? NoisyGate::RSample : NoisyGate::None;
  const std::vector<float> hp = c.get("hparams");
  c.cfg.capacity_factor = hp[0];
  c.cfg.eval_capacity_factor = hp[1];
  c.aux_coef = hp[2];
  const std::vector<int64_t> xs = c.file.shape(name + "/x");
  c.S = xs[0];
  c.h = xs[1];
  return c;
}

// |got - ref| <= tol · max(1, |ref|): absolute for values up to 1, relative above. The reference
// is float64; 1e-6 is a few float32 roundings of these sums.
constexpr double kTol = 1e-6;
// Gradients behind the experts' GELU backward: gelu.hpp's fast_tanh is accurate to ~1e-7
// absolute, and its error in gelu' reaches c_fc's gradients scaled by |x|·|d_act| (worst seen:
// 2.4e-6; with std::tanh every tensor here is within 8.4e-7).
constexpr double kGeluBackwardTol = 5e-6;

void expect_close(const std::string& what, const std::vector<float>& got, const std::vector<float>& ref,
                  double tol = kTol) {
  ASSERT_EQ(got.size(), ref.size()) << what;
  double worst = 0.0;
  size_t at = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    const double err = std::fabs(double(got[i]) - ref[i]) / std::max(1.0, std::fabs(double(ref[i])));
    if (err > worst) worst = err, at = i;
  }
  EXPECT_LE(worst, tol) << what << "[" << at << "]: " << got[at] << " vs PyTorch " << ref[at];
}

std::vector<float> transpose(const std::vector<float>& a, int64_t rows, int64_t cols) {
  std::vector<float> t(a.size());
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = 0; j < cols; ++j) t[j * rows + i] = a[i * cols + j];
  return t;
}

// A GPT-2 MLP over n rows: c_proj(gelu(c_fc(x))); keeps fch and its gelu for the backward.
struct Mlp {
  const float *fc_w, *fc_b, *proj_w, *proj_b;
  void forward(float* y, std::vector<float>& fch, std::vector<float>& act, const float* x, Index n, Index h) const {
    fch.resize(n * 4 * h);
    act.resize(n * 4 * h);
    matmul_forward(fch.data(), x, fc_w, fc_b, n, h, 4 * h);
    gelu_forward(act.data(), fch.data(), n * 4 * h);
    matmul_forward(y, act.data(), proj_w, proj_b, n, 4 * h, h);
  }
  // dx written; d_fc_w.. accumulated.
  void backward(float* dx, float* d_fc_w, float* d_fc_b, float* d_proj_w, float* d_proj_b, const float* dy,
                const float* x, const std::vector<float>& fch, const std::vector<float>& act, Index n, Index h) const {
    std::vector<float> d_act(n * 4 * h), d_fch(n * 4 * h);
    matmul_backward(d_act.data(), d_proj_w, d_proj_b, dy, act.data(), proj_w, n, 4 * h, h);
    gelu_backward(d_fch.data(), fch.data(), d_act.data(), n * 4 * h);
    matmul_backward(dx, d_fc_w, d_fc_b, d_fch.data(), x, fc_w, n, h, 4 * h);
  }
};

class MoeLayerGolden : public ::testing::TestWithParam<std::string> {};

TEST_P(MoeLayerGolden, ForwardAndBackwardMatchPyTorch) {
  const Case c = load(GetParam());
  const int64_t S = c.S, h = c.h, E = c.cfg.num_experts, k = c.cfg.k, F = 4 * h;
  const std::vector<float> x = c.get("x"), wg = c.get("wg"), d_out = c.get("d_out");
  const std::vector<float> fc_w = c.get("experts/c_fc_w"), fc_b = c.get("experts/c_fc_b");
  const std::vector<float> proj_w = c.get("experts/c_proj_w"), proj_b = c.get("experts/c_proj_b");
  const std::vector<float> jitter = c.has("draws/jitter") ? c.get("draws/jitter") : std::vector<float>();
  const std::vector<float> rts = c.has("draws/rts_uniform") ? c.get("draws/rts_uniform") : std::vector<float>();
  const std::vector<float> gumbel = c.has("draws/gumbel") ? c.get("draws/gumbel") : std::vector<float>();
  // The golden file holds exactly the draws the configuration consumes.
  EXPECT_EQ(!jitter.empty(), uses_jitter(c.cfg));
  EXPECT_EQ(!rts.empty(), uses_rts_uniform(c.cfg));
  EXPECT_EQ(!gumbel.empty(), uses_gumbel(c.cfg));

  // Gate: logits = (x ⊙ jitter) · wgᵀ in fp32.
  const std::vector<float> wg_t = transpose(wg, E, h);  // [h, E], the Conv1D layout matmul_forward takes
  std::vector<float> xg = x, logits(S * E);
  if (!jitter.empty()) jitter_forward(xg.data(), x.data(), jitter.data(), S * h);
  matmul_forward(logits.data(), xg.data(), wg_t.data(), static_cast<const float*>(nullptr), S, h, E);
  expect_close("logits", logits, c.get("logits"));

  GateDraws draws;
  draws.rts_uniform = rts.empty() ? nullptr : rts.data();
  draws.gumbel = gumbel.empty() ? nullptr : gumbel.data();
  Routing r;
  gate_forward(logits.data(), S, c.cfg, draws, r);
  EXPECT_EQ(r.capacity, c.capacity);
  expect_close("gates", r.gates, c.get("gates"));
  EXPECT_EQ(r.expert, c.ints("expert"));
  EXPECT_EQ(r.slot, c.ints("slot"));
  expect_close("weight", r.weight, c.get("weight"));
  const std::vector<int32_t> counts = c.ints("exp_counts");
  EXPECT_EQ(r.exp_counts, std::vector<int64_t>(counts.begin(), counts.end()));
  expect_close("l_aux", {r.l_aux}, c.get("l_aux"));

  // Experts on their dispatched rows, then the combine.
  std::vector<float> rows(r.num_rows() * h), y(r.num_rows() * h), moe_out(S * h);
  dispatch_forward(rows.data(), x.data(), r, h);
  std::vector<std::vector<float>> fch(E), act(E);
  auto expert = [&](int64_t e) {
    return Mlp{fc_w.data() + e * h * F, fc_b.data() + e * F, proj_w.data() + e * F * h, proj_b.data() + e * h};
  };
  for (int64_t e = 0; e < E; ++e)
    if (r.kept_per_expert[e] > 0)
      expert(e).forward(y.data() + r.row_offset[e] * h, fch[e], act[e], rows.data() + r.row_offset[e] * h,
                        r.kept_per_expert[e], h);
  combine_forward(moe_out.data(), y.data(), r, h);

  std::vector<float> out = moe_out, mlp_out(S * h), coef_logits(S * 2), coef(S * 2), mlp_fch, mlp_act;
  std::vector<float> m_fc_w, m_fc_b, m_proj_w, m_proj_b, coef_w_t, coef_b;
  if (c.residual) {
    m_fc_w = c.get("mlp/c_fc_w"), m_fc_b = c.get("mlp/c_fc_b"), m_proj_w = c.get("mlp/c_proj_w");
    m_proj_b = c.get("mlp/c_proj_b"), coef_w_t = transpose(c.get("coef_w"), 2, h), coef_b = c.get("coef_b");
    Mlp{m_fc_w.data(), m_fc_b.data(), m_proj_w.data(), m_proj_b.data()}.forward(mlp_out.data(), mlp_fch, mlp_act,
                                                                                 x.data(), S, h);
    matmul_forward(coef_logits.data(), x.data(), coef_w_t.data(), coef_b.data(), S, h, 2);
    residual_mix_forward(out.data(), coef.data(), moe_out.data(), mlp_out.data(), coef_logits.data(), S, h);
  }
  expect_close("out", out, c.get("out"));

  // Backward of  Σ out ⊙ d_out + aux_coef · l_aux.
  std::vector<float> d_moe = d_out, dx(S * h, 0.0f), tmp(S * h);
  auto add_into_dx = [&](const std::vector<float>& d) {
    for (int64_t i = 0; i < S * h; ++i) dx[i] += d[i];
  };
  std::vector<float> dm_fc_w(h * F, 0.0f), dm_fc_b(F, 0.0f), dm_proj_w(F * h, 0.0f), dm_proj_b(h, 0.0f);
  std::vector<float> d_coef_w_t(h * 2, 0.0f), d_coef_b(2, 0.0f);
  if (c.residual) {
    std::vector<float> d_mlp(S * h), d_coef_logits(S * 2);
    residual_mix_backward(d_moe.data(), d_mlp.data(), d_coef_logits.data(), d_out.data(), moe_out.data(),
                          mlp_out.data(), coef.data(), S, h);
    Mlp{m_fc_w.data(), m_fc_b.data(), m_proj_w.data(), m_proj_b.data()}.backward(
        tmp.data(), dm_fc_w.data(), dm_fc_b.data(), dm_proj_w.data(), dm_proj_b.data(), d_mlp.data(), x.data(),
        mlp_fch, mlp_act, S, h);
    add_into_dx(tmp);
    matmul_backward(tmp.data(), d_coef_w_t.data(), d_coef_b.data(), d_coef_logits.data(), x.data(), coef_w_t.data(),
                    S, h, 2);
    add_into_dx(tmp);
  }
  std::vector<float> d_y(y.size()), d_weight(S * k), d_rows(rows.size(), 0.0f);
  combine_backward(d_y.data(), d_weight.data(), d_moe.data(), y.data(), r, h);
  std::vector<float> d_fc_w(fc_w.size(), 0.0f), d_fc_b(fc_b.size(), 0.0f);
  std::vector<float> d_proj_w(proj_w.size(), 0.0f), d_proj_b(proj_b.size(), 0.0f);
  for (int64_t e = 0; e < E; ++e)
    if (r.kept_per_expert[e] > 0) {
      const int64_t at = r.row_offset[e] * h;
      expert(e).backward(d_rows.data() + at, d_fc_w.data() + e * h * F, d_fc_b.data() + e * F,
                         d_proj_w.data() + e * F * h, d_proj_b.data() + e * h, d_y.data() + at, rows.data() + at,
                         fch[e], act[e], r.kept_per_expert[e], h);
    }
  dispatch_backward(tmp.data(), d_rows.data(), r, h);
  add_into_dx(tmp);

  std::vector<float> d_logits(S * E), d_xg(S * h), d_wg_t(h * E, 0.0f);
  gate_backward(r, d_weight.data(), static_cast<float>(c.aux_coef), d_logits.data());
  expect_close("grads/logits", d_logits, c.get("grads/logits"));
  matmul_backward(d_xg.data(), d_wg_t.data(), static_cast<float*>(nullptr), d_logits.data(), xg.data(), wg_t.data(),
                  S, h, E);
  if (!jitter.empty()) jitter_backward(d_xg.data(), d_xg.data(), jitter.data(), S * h);
  add_into_dx(d_xg);

  expect_close("grads/x", dx, c.get("grads/x"));
  expect_close("grads/wg", transpose(d_wg_t, h, E), c.get("grads/wg"));
  expect_close("grads/experts/c_fc_w", d_fc_w, c.get("grads/experts/c_fc_w"), kGeluBackwardTol);
  expect_close("grads/experts/c_fc_b", d_fc_b, c.get("grads/experts/c_fc_b"), kGeluBackwardTol);
  expect_close("grads/experts/c_proj_w", d_proj_w, c.get("grads/experts/c_proj_w"));
  expect_close("grads/experts/c_proj_b", d_proj_b, c.get("grads/experts/c_proj_b"));
  if (c.residual) {
    expect_close("grads/mlp/c_fc_w", dm_fc_w, c.get("grads/mlp/c_fc_w"), kGeluBackwardTol);
    expect_close("grads/mlp/c_fc_b", dm_fc_b, c.get("grads/mlp/c_fc_b"), kGeluBackwardTol);
    expect_close("grads/mlp/c_proj_w", dm_proj_w, c.get("grads/mlp/c_proj_w"));
    expect_close("grads/mlp/c_proj_b", dm_proj_b, c.get("grads/mlp/c_proj_b"));
    // The coefficients' gradients weigh the two branches' outputs, each behind a GELU forward
    // (fast_tanh, ~1e-7): on an Intel Xeon (OpenBLAS's SkylakeX kernels) coef_w reached 1.1e-6.
    expect_close("grads/coef_w", transpose(d_coef_w_t, h, 2), c.get("grads/coef_w"), kGeluBackwardTol);
    expect_close("grads/coef_b", d_coef_b, c.get("grads/coef_b"), kGeluBackwardTol);
  }
}

INSTANTIATE_TEST_SUITE_P(PyTorch, MoeLayerGolden,
                         ::testing::Values("top1_rts_drops", "top1_first_come_drops", "top1_rsample",
                                           "top1_jitter_residual", "top1_no_drops", "top1_min_capacity", "top1_eval",
                                           "top2_drops", "top2_no_sampling_drops", "top2_no_drops",
                                           "top2_jitter_residual", "top2_eval", "top3_drops", "top3_no_drops"));

// The two top-1 cases share inputs and capacity: random token selection keeps other tokens.
TEST(MoeLayerGoldenFile, RandomTokenSelectionChangesWhichTokensSurvive) {
  const Case rts = load("top1_rts_drops"), first = load("top1_first_come_drops");
  EXPECT_EQ(rts.get("logits"), first.get("logits"));
  EXPECT_EQ(rts.capacity, first.capacity);
  EXPECT_NE(rts.ints("expert"), first.ints("expert"));
}

}  // namespace
