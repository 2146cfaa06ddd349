// test_loss_scaler.cpp — the fp16 loss scaler against DeepSpeed's own test behaviours
// (DEEPSPEED-TEST-BEHAVIOURS.md §B; DEEPSPEED-FACTS §2.2-2.3) and the unscale+clip factor (§3).
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "base/errors.hpp"
#include "optim/loss_scaler.hpp"
#include "zero/zero.hpp"

using namespace zero3d;

namespace {

LossScalerConfig dynamic_config(int power, int64_t window, int hysteresis, bool zero_path) {
  LossScalerConfig c;
  c.dynamic = true;
  c.initial_scale_power = power;
  c.scale_window = window;
  c.hysteresis = hysteresis;
  c.zero_path = zero_path;
  return c;
}

// The scale after each update, for a sequence of overflow flags.
std::vector<double> scales(LossScaler& s, const std::vector<bool>& overflows) {
  std::vector<double> out;
  int64_t step = 1;
  for (bool o : overflows) {
    s.update(o, step++);
    out.push_back(s.scale());
  }
  return out;
}

}  // namespace

TEST(LossScaler, StartsAtTwoToTheInitialScalePower) {
  LossScaler s(dynamic_config(16, 1000, 2, true));
  EXPECT_EQ(s.scale(), 65536.0);
}

TEST(LossScaler, CleanStepsDoubleTheScaleAtEveryMultipleOfTheWindow) {
  // initial_scale_power 8, window 2: 256, 256, 512, 512, 1024 after steps 1..5.
  for (bool zero_path : {false, true}) {
    LossScaler s(dynamic_config(8, 2, 2, zero_path));
    EXPECT_EQ(scales(s, {false, false, false, false, false}), (std::vector<double>{256, 256, 512, 512, 1024}))
        << "zero_path " << zero_path;
    EXPECT_EQ(s.state().cur_iter, 5);
  }
}

TEST(LossScaler, NonZeroPathHalvesOnEveryOverflowFlooredAtTheMinimumWithoutError) {
  LossScaler s(dynamic_config(4, 1000, 2, /*zero_path=*/false));
  EXPECT_EQ(scales(s, std::vector<bool>(8, true)), (std::vector<double>{8, 4, 2, 1, 1, 1, 1, 1}));
  LossScalerConfig c = dynamic_config(4, 1000, 2, false);
  c.min_scale = 2.0;
  LossScaler floored(c);
  EXPECT_EQ(scales(floored, std::vector<bool>(8, true)), (std::vector<double>{8, 4, 2, 2, 2, 2, 2, 2}));
}

TEST(LossScaler, AfterOverflowsGrowthNeedsWindowPlusOneCleanSteps) {
  // Two overflows from 2^8 give 2^6; window + 1 = 3 clean steps give one doubling; one
  // more overflow halves again.
  LossScaler s(dynamic_config(8, 2, 1, /*zero_path=*/false));
  EXPECT_EQ(scales(s, {true, true, false, false, false, true}), (std::vector<double>{128, 64, 64, 64, 128, 64}));
}

TEST(LossScaler, ZeroPathFirstOverflowOnlyUsesUpHysteresis) {
  LossScaler s(dynamic_config(8, 1000, 2, /*zero_path=*/true));
  s.update(true, 1);
  EXPECT_EQ(s.scale(), 256.0);
  EXPECT_EQ(s.state().cur_hysteresis, 1);
  s.update(true, 2);
  EXPECT_EQ(s.scale(), 128.0);
  s.update(true, 3);
  EXPECT_EQ(s.scale(), 64.0) << "hysteresis stays used up until the scale grows";
}

TEST(LossScaler, HysteresisIsRefilledOnlyWhenTheScaleGrows) {
  LossScaler s(dynamic_config(8, 2, 2, /*zero_path=*/true));
  scales(s, {true, false});  // overflow at iteration 0, then one clean step: no growth yet
  EXPECT_EQ(s.state().cur_hysteresis, 1);
  scales(s, {false});  // stable = 2 - 0 - 1 = 1: still no growth
  EXPECT_EQ(s.state().cur_hysteresis, 1);
  scales(s, {false});  // stable = 2: growth and refill
  EXPECT_EQ(s.scale(), 512.0);
  EXPECT_EQ(s.state().cur_hysteresis, 2);
}

TEST(LossScaler, ConsecutiveHysteresisIsRefilledByEveryCleanStep) {
  LossScalerConfig c = dynamic_config(8, 1000, 2, true);
  c.consecutive_hysteresis = true;
  LossScaler s(c);
  EXPECT_EQ(scales(s, {true, false, true, false, true}), (std::vector<double>{256, 256, 256, 256, 256}));
  EXPECT_EQ(s.state().cur_hysteresis, 1);
}

TEST(LossScaler, ZeroPathEndsAtOneAfterEightOverflowsFrom256AndTheNinthIsAnErrorNamingTheStep) {
  LossScaler s(dynamic_config(8, 1000, 1, /*zero_path=*/true));
  for (int64_t step = 1; step <= 8; ++step) s.update(true, step);
  EXPECT_EQ(s.scale(), 1.0);
  try {
    s.update(true, 9);
    FAIL() << "no error at the minimum scale";
  } catch (const SystemError& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("step 9"), std::string::npos) << m;
    EXPECT_NE(m.find("bf16"), std::string::npos) << m;
  }
}

// torch_autocast with fp16: torch.amp.GradScaler (DeepSpeed's engine creates one with its
// defaults; torch/amp/grad_scaler.py update): halve on every overflow with no floor,
// hysteresis or error, double on the growth_interval-th clean step in a row. Window 2 here.
TEST(LossScaler, GradScalerHalvesEveryOverflowAndDoublesOnTheIntervalthCleanStep) {
  LossScalerConfig c = dynamic_config(4, 2, /*hysteresis=*/2, /*zero_path=*/true);
  c.grad_scaler = true;
  c.min_scale = 1.0;  // GradScaler has no floor, and a ZeRO-path scaler would stop at it
  LossScaler s(c);
  EXPECT_EQ(scales(s, {false, false, true, true, true, true, true, false, false, false}),
            (std::vector<double>{16, 32, 16, 8, 4, 2, 1, 1, 2, 2}));
  EXPECT_NO_THROW(s.update(true, 11));
  EXPECT_EQ(s.scale(), 1.0);
  EXPECT_NO_THROW(s.update(true, 12));
  EXPECT_EQ(s.scale(), 0.5);
}

TEST(LossScaler, StaticScaleNeverChanges) {
  LossScalerConfig c;
  c.dynamic = false;
  c.static_scale = 128.0;
  LossScaler s(c);
  EXPECT_EQ(scales(s, {true, false, true, false}), (std::vector<double>{128, 128, 128, 128}));
}

TEST(UnscaleAndClip, OneFactorDividesByTheScaleAndClipsTheUnscaledNorm) {
  // Scaled norm 1000 at scale 100 is an unscaled norm of 10: clip 1 gives c = 10 + 1e-6.
  EXPECT_DOUBLE_EQ(unscale_clip_multiplier(1000.0, 100.0, 1.0), 1.0 / ((10.0 + 1e-6) * 100.0));
  // Below the clip threshold only the scale is removed; clip 0 disables clipping.
  EXPECT_DOUBLE_EQ(unscale_clip_multiplier(50.0, 100.0, 1.0), 1.0 / 100.0);
  EXPECT_DOUBLE_EQ(unscale_clip_multiplier(1000.0, 100.0, 0.0), 1.0 / 100.0);
}
