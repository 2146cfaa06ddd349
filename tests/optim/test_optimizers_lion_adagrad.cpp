// test_optimizers_lion_adagrad.cpp — DeepSpeed's "lion" (FusedLion) and "adagrad"
// (torch.optim.Adagrad without offload, DeepSpeedCPUAdagrad with) against references computed outside zero3d:
// tests/golden/optimizer_reference.py (torch 1.13 for Adagrad, numpy for Lion) printed the
// parameters after each of three steps from the same inputs.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "base/errors.hpp"
#include "config/config.hpp"
#include "offload/offload_optimizer.hpp"
#include "optim/optimizer.hpp"

using namespace zero3d;
using json = nlohmann::json;

namespace {

std::string error_of(const json& j) {
  try {
    read_config(j, "cfg.json", 2);
  } catch (const InputError& e) {
    return e.what();
  }
  return "";
}

const std::vector<float> kP0 = {0.5f, -0.3f, 0.0f, 1.2f};
const std::vector<std::vector<float>> kGrads = {{0.1f, -0.2f, 0.0f, 0.3f}, {-0.05f, 0.1f, 0.2f, -0.3f},
                                                {0.02f, 0.02f, -0.4f, 0.0f}};

// Runs three steps; returns the parameters after each.
std::vector<std::vector<float>> three_steps(const OptimizerConfig& c) {
  ParamLayout layout;
  layout.add("w", {static_cast<int64_t>(kP0.size())});
  Optimizer opt(c, layout);
  std::vector<float> p = kP0;
  std::vector<std::vector<float>> out;
  for (const auto& g : kGrads) {
    opt.step(p.data(), g.data(), c.lr);
    out.push_back(p);
  }
  return out;
}

void expect_rows(const std::vector<std::vector<float>>& got, const std::vector<std::vector<float>>& want, double tol) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t s = 0; s < want.size(); ++s)
    for (size_t i = 0; i < want[s].size(); ++i) EXPECT_NEAR(got[s][i], want[s][i], tol) << "step " << s + 1 << " [" << i << "]";
}

TEST(LionOptimizer, MatchesFusedLionWrittenOutInNumpy) {
  OptimizerConfig c;
  c.type = OptimizerType::Lion;
  c.lr = 0.01;
  c.beta1 = 0.9;
  c.beta2 = 0.99;
  c.weight_decay = 0.1;
  expect_rows(three_steps(c),
              {{0.489500016f, -0.289700031f, 0.00999999978f, 1.1888001f},
               {0.499010503f, -0.299410313f, -9.99961048e-06f, 1.19761133f},
               {0.488511503f, -0.30911091f, 0.00999001041f, 1.20641375f}},
              1e-6);
}

TEST(LionOptimizer, EveryStepIsLrInSizeBesidesTheDecay) {
  // The sign update: without weight decay each parameter moves by exactly lr.
  OptimizerConfig c;
  c.type = OptimizerType::Lion;
  c.lr = 0.25;
  const auto rows = three_steps(c);
  for (size_t i = 0; i < kP0.size(); ++i) EXPECT_FLOAT_EQ(std::fabs(rows[0][i] - kP0[i]), 0.25f) << i;
}

TEST(AdagradOptimizer, MatchesTorchAdagrad) {
  OptimizerConfig c;
  c.type = OptimizerType::Adagrad;
  c.lr = 0.1;
  c.lr_decay = 0.05;
  c.weight_decay = 0.01;
  c.initial_accumulator_value = 0.1;
  c.eps = 1e-10;
  expect_rows(three_steps(c),
              {{0.468487799f, -0.245978743f, 0.0f, 1.12976682f},
               {0.481321841f, -0.26990664f, -0.050906904f, 1.18166423f},
               {0.474631906f, -0.273953855f, 0.0155231059f, 1.17963707f}},
              1e-6);
}

// With offload_optimizer DeepSpeed runs DeepSpeedCPUAdagrad: the decay goes into the
// accumulated squares only, the step divides the raw gradient (optimizer_reference.py writes
// csrc/adagrad/cpu_adagrad.cpp's loop out in numpy).
TEST(AdagradOptimizer, OffloadedItIsDeepSpeedCpuAdagrad) {
  OptimizerConfig c;
  c.type = OptimizerType::Adagrad;
  c.lr = 0.1;
  c.weight_decay = 0.01;
  c.eps = 1e-10;
  OffloadOptimizerConfig off;
  off.device = OffloadDevice::Cpu;
  offload::OffloadedOptimizer opt(off, AioConfig{}, c, 4, 1000, /*hold_master=*/false, "");
  std::vector<float> p = kP0;
  offload::ParamAccess access;
  access.acquire = [&](int64_t b, int64_t) { return TypedSpan{p.data() + b, DType::F32}; };
  access.release = [](int64_t, int64_t, TypedSpan) {};
  std::vector<std::vector<float>> rows;
  for (const auto& g : kGrads) {
    opt.step(access, g.data(), DType::F32, 1.0f, c.lr, std::nullopt);
    rows.push_back(p);
  }
  expect_rows(rows,
              {{0.40476191f, -0.201477855f, 0.0f, 1.10384619f},
               {0.448386192f, -0.245841265f, -0.100000001f, 1.17439187f},
               {0.431321502f, -0.25468719f, -0.0107358545f, 1.17439187f}},
              1e-6);
  // The device update with the same parameters is torch's: the decay also steps.
  EXPECT_NE(three_steps(c)[0][0], rows[0][0]);
}

TEST(AdagradOptimizer, KeepsOneStateNamedAsDeepSpeedCpuAdagradDoes) {
  OptimizerConfig c;
  c.type = OptimizerType::Adagrad;
  ParamLayout layout;
  layout.add("w", {4});
  Optimizer opt(c, layout);
  EXPECT_EQ(opt.state_names(), std::vector<std::string>{"exp_avg_sq"});
  EXPECT_EQ(opt.state_bytes(), 16);
  c.type = OptimizerType::Lion;
  EXPECT_EQ(Optimizer(c, layout).state_names(), std::vector<std::string>{"exp_avg"});
}

TEST(LionAdagradConfig, DeepSpeedsNamesAndDefaultsAreRead) {
  json j = {{"train_batch_size", 8}, {"train_micro_batch_size_per_gpu", 4}};
  for (const char* name : {"Lion", "FusedLion", "CPULion", "DeepSpeedCPULion"}) {
    j["optimizer"] = {{"type", name}};
    const Config c = read_config(j, "cfg.json", 2);
    EXPECT_EQ(c.optimizer.type, OptimizerType::Lion) << name;
    EXPECT_DOUBLE_EQ(c.optimizer.lr, 1e-3);
    EXPECT_DOUBLE_EQ(c.optimizer.beta2, 0.999);
  }
  for (const char* name : {"Adagrad", "adagrad", "CPUAdagrad", "DeepSpeedCPUAdagrad"}) {
    j["optimizer"] = {{"type", name}};
    const Config c = read_config(j, "cfg.json", 2);
    EXPECT_EQ(c.optimizer.type, OptimizerType::Adagrad) << name;
    EXPECT_DOUBLE_EQ(c.optimizer.lr, 1e-2);
    EXPECT_DOUBLE_EQ(c.optimizer.eps, 1e-10);
  }
}

// Offload runs DeepSpeed's CPU optimizers: DeepSpeedCPULion and DeepSpeedCPUAdagrad exist, SGD
// has none; DeepSpeedCPUAdagrad(lr, eps, weight_decay) has no lr_decay.
TEST(LionAdagradConfig, ZeroRunsThemAndOffloadRunsDeepSpeedsCpuOptimizers) {
  json j = {{"train_batch_size", 8}, {"train_micro_batch_size_per_gpu", 4}, {"optimizer", {{"type", "Lion"}}}};
  j["zero_optimization"] = {{"stage", 3}};  // both are in DeepSpeed's ZERO_SUPPORTED_OPTIMIZERS
  EXPECT_NO_THROW(read_config(j, "cfg.json", 2));
  j["zero_optimization"]["offload_optimizer"] = {{"device", "cpu"}};
  EXPECT_NO_THROW(read_config(j, "cfg.json", 2));
  j["optimizer"] = {{"type", "Adagrad"}, {"params", {{"lr_decay", 0.1}}}};
  EXPECT_NE(error_of(j).find("`optimizer.params.lr_decay`: with offload_optimizer DeepSpeed runs DeepSpeedCPUAdagrad"),
            std::string::npos)
      << error_of(j);
  j["optimizer"] = {{"type", "SGD"}};
  j["zero_allow_untested_optimizer"] = true;
  EXPECT_NE(error_of(j).find("need optimizer Adam, AdamW, Lion or Adagrad (got SGD)"), std::string::npos) << error_of(j);
}

}  // namespace
