// test_pld.cpp — progressive layer drop against its independent references
// (tests/golden/make_pld_goldens.py): DeepSpeed's θ(t) schedule, and ten AdamW steps of the
// tiny goldens with blocks dropped and scaled as zero3d's counter RNG decides, in PyTorch.
// Tolerances as tests/model/test_golden.cpp: the loss trajectory within 1e-4 relative.
#include <gtest/gtest.h>

#include <cmath>
#include <string>

#include "io/h5.hpp"
#include "io/weights.hpp"
#include "model/model.hpp"
#include "model/pld.hpp"
#include "optim/optimizer.hpp"
#include "support/golden_file.hpp"

using namespace zero3d;

namespace {

const std::string kGolden = std::string(ZERO3D_GOLDEN_DIR) + "/pld.h5";

using test::read_doubles;

const auto group_attr = test::group_attribute;

// DeepSpeed's test_pld.py: θ after step i equals (1−θ̄)·exp(−γ·i) + θ̄ for θ̄ ∈ {0, 0.1, 0.9, 1.0}.
TEST(ProgressiveLayerDrop, ThetaAfterEachStepIsDeepSpeeds) {
  const h5::File f = h5::File::open_read(kGolden);
  for (const char* name : {"0", "0.1", "0.9", "1.0"}) {
    PldConfig pld;
    pld.enabled = true;
    pld.theta = group_attr(f, std::string("theta/") + name, "theta");
    pld.gamma = group_attr(f, "theta", "gamma");
    const std::vector<double> ref = read_doubles(f, std::string("theta/") + name);
    ASSERT_EQ(ref.size(), 2000u);
    for (size_t i = 0; i < ref.size(); ++i) {
      // within 4 ulps: numpy's exp (DeepSpeed's np.exp) and libm's differ in the last bit at some t
      ASSERT_DOUBLE_EQ(pld_theta(pld, static_cast<int64_t>(i)), ref[i]) << "theta " << name << " step " << i;
      // step i + 1 (0-based) runs with the θ DeepSpeed holds after step i; step 0 with 1.0
      ASSERT_EQ(pld_theta_in_step(pld, static_cast<int64_t>(i) + 1), pld_theta(pld, static_cast<int64_t>(i)));
    }
    EXPECT_EQ(pld_theta_in_step(pld, 0), 1.0);
  }
}

// θ̄ = 1 keeps every block at every step, unscaled: bit-identical to PLD off.
TEST(ProgressiveLayerDrop, ThetaBarOneRunsEveryBlockUnscaled) {
  PldConfig pld;
  pld.enabled = true;
  pld.theta = 1.0;
  pld.gamma = 0.5;
  for (int64_t step : {0, 1, 7, 1000})
    for (int64_t micro : {0, 3})
      for (float s : pld_block_scales(pld, 42, step, micro, 12)) EXPECT_EQ(s, 1.0f);
}

// DeepSpeedExamples' rule: the first block always runs, p falls linearly to 1 − (L−1)(1−θ)/L.
TEST(ProgressiveLayerDrop, KeepProbabilityFallsWithDepth) {
  EXPECT_EQ(pld_keep_probability(0.5, 0, 4), 1.0);
  EXPECT_DOUBLE_EQ(pld_keep_probability(0.5, 1, 4), 0.875);
  EXPECT_DOUBLE_EQ(pld_keep_probability(0.5, 3, 4), 0.625);
  EXPECT_DOUBLE_EQ(pld_keep_probability(0.0, 3, 4), 0.25);
  // Over many micro-batches the last block runs about p of the time.
  PldConfig pld;
  pld.enabled = true;
  pld.theta = 0.0;
  pld.gamma = 1e9;  // θ(t ≥ 0) = 0 at once
  int kept = 0;
  const int n = 20000;
  for (int m = 0; m < n; ++m) kept += pld_block_scales(pld, 7, 5, m, 4)[3] != 0.0f ? 1 : 0;
  EXPECT_NEAR(static_cast<double>(kept) / n, 0.25, 0.015);
}

class PldGolden : public ::testing::TestWithParam<std::string> {};

TEST_P(PldGolden, TenAdamWStepsWithLayerDropFollowPyTorch) {
  const std::string name = GetParam();
  const h5::File f = h5::File::open_read(kGolden);
  const h5::File weights = h5::File::open_read(std::string(ZERO3D_GOLDEN_DIR) + "/" + name + ".h5");
  int64_t B = 0;
  const GPTShape shape = test::golden_gpt_shape(weights, B);
  const int64_t T = shape.n_positions, L = shape.n_layer;
  FlatModel model(shape, B, T);
  load_weights(weights.path(), model.model.layout(), model.params.data());
  const std::vector<int32_t> inputs = weights.read_ints("golden/inputs");
  const std::vector<int32_t> targets = weights.read_ints("golden/targets");
  const std::vector<double> hp = read_doubles(weights, "golden/hparams");

  PldConfig pld;
  pld.enabled = true;
  pld.theta = group_attr(f, name, "theta");
  pld.gamma = group_attr(f, name, "gamma");
  const auto seed = static_cast<uint64_t>(group_attr(f, name, "seed"));
  const std::vector<float> ref = f.read_floats(name + "/losses");
  const std::vector<float> ref_scales = f.read_floats(name + "/scales");
  ASSERT_EQ(ref_scales.size(), ref.size() * static_cast<size_t>(L));

  const OptimizerConfig oc = test::golden_adamw(hp);
  Optimizer opt(oc, model.model.layout());
  int dropped = 0;
  for (size_t step = 0; step < ref.size(); ++step) {
    const std::vector<float> scales = pld_block_scales(pld, seed, static_cast<int64_t>(step), 0, L);
    for (int64_t l = 0; l < L; ++l) {
      ASSERT_EQ(scales[l], ref_scales[step * L + l]) << "step " << step + 1 << " block " << l;
      dropped += scales[l] == 0.0f ? 1 : 0;
    }
    model.model.set_block_scales(scales);
    model.zero_grad();
    const float loss = model.forward(inputs.data(), targets.data());
    EXPECT_NEAR(loss, ref[step], 1e-4 * std::fabs(ref[step])) << "step " << step + 1;
    model.backward(1.0f);
    clip_grad_norm(model.grads.data(), model.model.num_params(), hp[5]);
    opt.step(model.params.data(), model.grads.data(), oc.lr);
  }
  EXPECT_GT(dropped, 0);  // the reference exercises a dropped block
}

INSTANTIATE_TEST_SUITE_P(PyTorch, PldGolden, ::testing::Values("gpt_tiny", "gpt_ragged"));

}  // namespace
