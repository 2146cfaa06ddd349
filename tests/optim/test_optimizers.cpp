// test_optimizers.cpp — one or two updates of each optimizer against values computed by hand.
#include <gtest/gtest.h>

#include "optim/optimizer.hpp"

using namespace zero3d;

namespace {

ParamLayout single_tensor(int64_t n) {
  ParamLayout l;
  l.add("w", {n});
  return l;
}

struct OneTensor {
  ParamLayout layout;
  Optimizer opt;
  std::vector<float> p, g;
  OneTensor(const OptimizerConfig& c, std::vector<float> params, std::vector<float> grads)
      : layout(single_tensor(static_cast<int64_t>(params.size()))), opt(c, layout), p(std::move(params)),
        g(std::move(grads)) {}
  void step(double lr) { opt.step(p.data(), g.data(), lr); }
};

OptimizerConfig adam(bool adamw) {
  OptimizerConfig c;
  c.type = OptimizerType::Adam;
  c.beta1 = 0.9;
  c.beta2 = 0.999;
  c.eps = 1e-8;
  c.weight_decay = 0.01;
  c.adam_w_mode = adamw;
  return c;
}

TEST(Optimizers, AdamWFirstStepMovesByLrTimesOnePlusDecay) {
  OneTensor r(adam(true), {1.0f}, {0.5f});
  r.step(0.1);
  // m̂ = 0.5, v̂ = 0.25 -> update 1 (up to eps) + wd·p = 1.01
  EXPECT_NEAR(r.p[0], 1.0 - 0.1 * 1.01, 1e-6);
}

TEST(Optimizers, AdamWSecondStepUsesBiasCorrectedMoments) {
  OneTensor r(adam(true), {1.0f}, {0.5f});
  r.step(0.1);
  r.step(0.1);
  EXPECT_NEAR(r.p[0], 0.899 - 0.1 * (1.0 + 0.01 * 0.899), 1e-5);
}

TEST(Optimizers, AdamL2ModeAddsDecayToTheGradient) {
  OneTensor r(adam(false), {1.0f}, {0.5f});
  r.step(0.1);
  // g' = 0.5 + 0.01 = 0.51; m̂/sqrt(v̂) = 1 -> p = 0.9
  EXPECT_NEAR(r.p[0], 0.9, 1e-6);
}

TEST(Optimizers, AdamWithoutBiasCorrectionUsesRawMoments) {
  OptimizerConfig c = adam(true);
  c.bias_correction = false;
  c.weight_decay = 0.0;
  OneTensor r(c, {1.0f}, {0.5f});
  r.step(0.1);
  // m = 0.05, v = 0.00025: m/sqrt(v) = 0.05/0.0158114
  EXPECT_NEAR(r.p[0], 1.0 - 0.1 * 0.05 / std::sqrt(0.00025), 1e-5);
}

OptimizerConfig lamb(double max_coeff) {
  OptimizerConfig c;
  c.type = OptimizerType::Lamb;
  c.beta1 = 0.9;
  c.beta2 = 0.999;
  c.eps = 0.0;
  c.max_coeff = max_coeff;
  c.min_coeff = 0.01;
  return c;
}

TEST(Optimizers, LambScalesTheStepByTheTrustRatio) {
  OneTensor r(lamb(10.0), {3.0f, 4.0f}, {0.3f, 0.4f});
  r.step(0.1);
  // update = m/sqrt(v) = 0.1/sqrt(0.001) each; ‖p‖ = 5, ‖u‖ = sqrt(2)·3.16228; step size lr·sqrt(1-β2)/(1-β1)
  const double u = 0.1 / std::sqrt(0.001), coeff = 5.0 / (u * std::sqrt(2.0)), step = 0.1 * std::sqrt(0.001) / 0.1;
  EXPECT_NEAR(r.p[0], 3.0 - step * coeff * u, 1e-5);
  EXPECT_NEAR(r.p[1], 4.0 - step * coeff * u, 1e-5);
}

TEST(Optimizers, LambClampsTheTrustRatioAtMaxCoeff) {
  OneTensor r(lamb(1.0), {3.0f, 4.0f}, {0.3f, 0.4f});
  r.step(0.1);
  EXPECT_NEAR(r.p[0], 2.9, 1e-5);  // coeff 1.118 clamped to 1: step·u = 0.1
  EXPECT_NEAR(r.p[1], 3.9, 1e-5);
}

TEST(Optimizers, LambUsesTrustRatioOneForZeroWeights) {
  OneTensor r(lamb(10.0), {0.0f, 0.0f}, {0.3f, 0.4f});
  r.step(0.1);
  EXPECT_NEAR(r.p[0], -0.1, 1e-5);
}

OptimizerConfig sgd(double momentum, bool nesterov, double wd) {
  OptimizerConfig c;
  c.type = OptimizerType::SGD;
  c.momentum = momentum;
  c.nesterov = nesterov;
  c.weight_decay = wd;
  return c;
}

TEST(Optimizers, SgdMomentumBufferStartsAsTheGradient) {
  OneTensor r(sgd(0.9, false, 0.0), {1.0f}, {0.5f});
  r.step(0.1);
  EXPECT_NEAR(r.p[0], 0.95, 1e-6);
  r.step(0.1);
  EXPECT_NEAR(r.p[0], 0.95 - 0.1 * (0.9 * 0.5 + 0.5), 1e-6);
}

TEST(Optimizers, SgdNesterovLooksAhead) {
  OneTensor r(sgd(0.9, true, 0.0), {1.0f}, {0.5f});
  r.step(0.1);
  EXPECT_NEAR(r.p[0], 1.0 - 0.1 * (0.5 + 0.9 * 0.5), 1e-6);
}

TEST(Optimizers, SgdWeightDecayIsAddedToTheGradient) {
  OneTensor r(sgd(0.0, false, 0.1), {1.0f}, {0.5f});
  r.step(0.1);
  EXPECT_NEAR(r.p[0], 0.94, 1e-6);
}

TEST(Optimizers, ClipGradNormScalesToMaxNormAndReportsTheNormBefore) {
  std::vector<float> g = {3.0f, 4.0f};
  EXPECT_NEAR(clip_grad_norm(g.data(), 2, 1.0), 5.0, 1e-12);
  EXPECT_NEAR(g[0], 3.0 / (5.0 + 1e-6), 1e-6);
  EXPECT_NEAR(g[1], 4.0 / (5.0 + 1e-6), 1e-6);
}

TEST(Optimizers, ClipGradNormLeavesSmallGradientsAlone) {
  std::vector<float> g = {0.3f, 0.4f};
  clip_grad_norm(g.data(), 2, 1.0);
  EXPECT_FLOAT_EQ(g[0], 0.3f);
}

}  // namespace
