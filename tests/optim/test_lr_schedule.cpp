// test_lr_schedule.cpp — each DeepSpeed schedule at listed iterations, against values worked
// out by hand from DEEPSPEED-FACTS §4 (i = last_batch_iteration; -1 = at construction).
#include <gtest/gtest.h>

#include <cmath>

#include "optim/lr_schedule.hpp"

using namespace zero3d;

namespace {

SchedulerConfig warmup(SchedulerType type, bool log) {
  SchedulerConfig s;
  s.type = type;
  s.warmup_min_lr = 0.0;
  s.warmup_max_lr = 0.01;
  s.warmup_num_steps = 10;
  s.warmup_log = log;
  s.total_num_steps = 100;
  return s;
}

TEST(LRSchedule, WarmupLRLogRisesAsLnOfIterationAndHolds) {
  LRSchedule s(warmup(SchedulerType::WarmupLR, true), 0.01);
  EXPECT_DOUBLE_EQ(s.lr_at(-1), 0.0);
  EXPECT_DOUBLE_EQ(s.lr_at(0), 0.0);  // ln(1) = 0
  EXPECT_NEAR(s.lr_at(4), 0.01 * std::log(5.0) / std::log(10.0), 1e-15);
  EXPECT_NEAR(s.lr_at(9), 0.01, 1e-15);  // log warm-up reaches max at W-1
  EXPECT_DOUBLE_EQ(s.lr_at(1000), 0.01);
}

TEST(LRSchedule, WarmupLRLinearReachesMaxAtWarmupSteps) {
  LRSchedule s(warmup(SchedulerType::WarmupLR, false), 0.01);
  EXPECT_NEAR(s.lr_at(5), 0.005, 1e-15);
  EXPECT_NEAR(s.lr_at(9), 0.009, 1e-15);
  EXPECT_DOUBLE_EQ(s.lr_at(10), 0.01);
}

TEST(LRSchedule, WarmupOfOneStepIsTreatedAsTwo) {
  SchedulerConfig c = warmup(SchedulerType::WarmupLR, true);
  c.warmup_num_steps = 1;  // W' = max(2, 1)
  LRSchedule s(c, 0.01);
  EXPECT_DOUBLE_EQ(s.lr_at(0), 0.0);
  EXPECT_NEAR(s.lr_at(1), 0.01, 1e-15);
}

TEST(LRSchedule, WarmupDecayLRDecaysLinearlyToZeroAtTotalSteps) {
  LRSchedule s(warmup(SchedulerType::WarmupDecayLR, false), 0.01);
  EXPECT_NEAR(s.lr_at(10), 0.01, 1e-15);
  EXPECT_NEAR(s.lr_at(55), 0.005, 1e-15);  // (100-55)/(100-10)
  EXPECT_DOUBLE_EQ(s.lr_at(100), 0.0);
  EXPECT_DOUBLE_EQ(s.lr_at(150), 0.0);
}

TEST(LRSchedule, WarmupCosineLRScalesTheOptimizerLr) {
  SchedulerConfig c;
  c.type = SchedulerType::WarmupCosineLR;
  c.warmup_num_steps = 10;
  c.total_num_steps = 110;
  c.warmup_min_ratio = 0.0;
  c.cos_min_ratio = 1e-4;
  c.warmup_log = true;
  LRSchedule s(c, 0.1);
  EXPECT_DOUBLE_EQ(s.lr_at(-1), 0.0);  // the very first update uses lr 0
  EXPECT_NEAR(s.lr_at(4), 0.1 * std::log(5.0) / std::log(10.0), 1e-15);
  const double p10 = 0.01;  // (10 - 10 + 1) / (110 - 10)
  EXPECT_NEAR(s.lr_at(10), 0.1 * (1e-4 + (1 - 1e-4) * (1 + std::cos(M_PI * p10)) / 2), 1e-15);
  EXPECT_NEAR(s.lr_at(59), 0.1 * (1e-4 + (1 - 1e-4) * 0.5), 1e-15);
  EXPECT_NEAR(s.lr_at(500), 0.1 * 1e-4, 1e-15);  // progress clamped at 1
}

SchedulerConfig one_cycle() {
  SchedulerConfig c;
  c.type = SchedulerType::OneCycle;
  c.cycle_min_lr = 0.001;
  c.cycle_max_lr = 0.01;
  c.cycle_first_step_size = 10;
  c.cycle_second_step_size = 10;
  c.cycle_min_mom = 0.8;
  c.cycle_max_mom = 0.9;
  return c;
}

TEST(LRSchedule, OneCycleRisesThenFallsOverTheCycle) {
  LRSchedule s(one_cycle(), 0.01);
  EXPECT_DOUBLE_EQ(s.lr_at(-1), 0.001);
  EXPECT_NEAR(s.lr_at(4), 0.0055, 1e-15);   // b=5: x=0.25, sf=0.5
  EXPECT_NEAR(s.lr_at(9), 0.01, 1e-15);     // b=10: peak
  EXPECT_NEAR(s.lr_at(14), 0.0055, 1e-15);  // b=15: falling half
  EXPECT_DOUBLE_EQ(s.lr_at(25), 0.001);     // after the cycle, no decay configured
}

TEST(LRSchedule, OneCycleCyclesMomentumInverselyAndStartsAtMinMomentum) {
  LRSchedule s(one_cycle(), 0.01);
  EXPECT_DOUBLE_EQ(s.betas_at(-1)->first, 0.8);  // DeepSpeed writes min_mom at construction
  EXPECT_DOUBLE_EQ(s.betas_at(-1)->second, 0.99);
  EXPECT_NEAR(s.betas_at(4)->first, 0.85, 1e-15);
  EXPECT_NEAR(s.betas_at(9)->first, 0.8, 1e-15);
}

TEST(LRSchedule, OneCycleDecaysAfterTheCycle) {
  SchedulerConfig c = one_cycle();
  c.decay_lr_rate = 0.5;
  c.decay_step_size = 5;
  c.decay_mom_rate = 0.1;
  LRSchedule s(c, 0.01);
  EXPECT_NEAR(s.lr_at(25), 0.001 / (1 + 0.5 * 6.0 / 5.0), 1e-15);  // d = 25 - 20 + 1
  EXPECT_NEAR(s.betas_at(25)->first, 0.9 * (1 + 0.1 * 6.0 / 5.0), 1e-15);
}

TEST(LRSchedule, OneCycleStaircaseHoldsValuesBetweenStairs) {
  SchedulerConfig c = one_cycle();
  c.cycle_first_stair_count = 2;
  LRSchedule s(c, 0.01);
  EXPECT_DOUBLE_EQ(s.lr_at(2), 0.001);             // pos 0.6 -> stair 0
  EXPECT_NEAR(s.lr_at(4), 0.0055, 1e-15);          // pos 1.0 -> stair 1
  EXPECT_NEAR(s.lr_at(6), 0.0055, 1e-15);          // pos 1.4 -> stair 1
}

TEST(LRSchedule, LRRangeTestGrowsLinearlyOrInStairs) {
  SchedulerConfig c;
  c.type = SchedulerType::LRRangeTest;
  c.lr_range_test_min_lr = 0.001;
  c.lr_range_test_step_size = 10;
  c.lr_range_test_step_rate = 2.0;
  LRSchedule s(c, 0.01);
  EXPECT_DOUBLE_EQ(s.lr_at(-1), 0.001);
  EXPECT_NEAR(s.lr_at(4), 0.002, 1e-15);
  EXPECT_NEAR(s.lr_at(19), 0.005, 1e-15);
  c.lr_range_test_staircase = true;
  LRSchedule stairs(c, 0.01);
  EXPECT_DOUBLE_EQ(stairs.lr_at(4), 0.001);
  EXPECT_NEAR(stairs.lr_at(9), 0.003, 1e-15);
}

TEST(LRSchedule, NthStepTrainsWithTheLrOfIterationNMinusTwo) {
  LRSchedule s(warmup(SchedulerType::WarmupLR, false), 0.01);
  EXPECT_EQ(s.lr(), s.lr_at(-1));  // step 1
  s.step();
  EXPECT_EQ(s.lr(), s.lr_at(0));  // step 2
  s.step();
  EXPECT_EQ(s.lr(), s.lr_at(1));  // step 3
}

TEST(LRSchedule, NoSchedulerKeepsTheOptimizerLr) {
  LRSchedule s(SchedulerConfig{}, 0.003);
  s.step();
  EXPECT_DOUBLE_EQ(s.lr(), 0.003);
  EXPECT_FALSE(s.betas().has_value());
}

}  // namespace
