// test_optimizers_bf16.cpp — DeepSpeed's bf16.bf16_master_weights_and_grads and
// bf16_optimizer_states (issue 18): the master weights (and the moments) are bf16 tensors that
// every step widens to fp32, updates with the fp32 kernels and rounds back (RNE), as
// DeepSpeed's FusedAdam and CPU optimizers treat bf16 tensors (multi_tensor_adam.cu loads
// every operand into fp32 "MATH_T" and stores it in its own type).
#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <vector>

#include "config/config.hpp"
#include "kernels/typed.hpp"
#include "optim/optimizer.hpp"

using namespace zero3d;

namespace {

constexpr int64_t kN = 40000;  // more than two of the updater's 16384-element chunks

std::vector<float> random_values(int64_t n, uint32_t seed, float scale) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> d(0.0f, scale);
  std::vector<float> v(static_cast<size_t>(n));
  for (float& x : v) x = d(gen);
  return v;
}

// x rounded to bf16 and widened back.
void round_to_bf16(float* x, int64_t n) {
  std::vector<uint16_t> bits(static_cast<size_t>(n));
  convert_any(bits.data(), DType::BF16, x, DType::F32, n);
  convert_any(x, DType::F32, bits.data(), DType::BF16, n);
}

std::vector<OptimizerConfig> elementwise_optimizers() {
  OptimizerConfig adamw, adam_l2, lion, adagrad, sgd;
  adamw.lr = 1e-3;
  adamw.weight_decay = 0.1;
  adam_l2 = adamw;
  adam_l2.adam_w_mode = false;
  lion.type = OptimizerType::Lion;
  lion.lr = 1e-4;
  lion.weight_decay = 0.1;
  adagrad.type = OptimizerType::Adagrad;
  adagrad.lr = 1e-2;
  adagrad.weight_decay = 0.01;
  adagrad.initial_accumulator_value = 0.1;
  sgd.type = OptimizerType::SGD;
  sgd.lr = 1e-2;
  sgd.momentum = 0.9;
  return {adamw, adam_l2, lion, adagrad, sgd};
}

// Three steps of `cfg` on bf16 parameters (states of state_type) against the specification
// written with the fp32 optimizer: widen, update in fp32, round the parameters (and, for bf16
// states, the states) to bf16. Both must agree bit for bit.
void expect_rounded_fp32_update(const OptimizerConfig& cfg, DType state_type) {
  ParamLayout layout;
  layout.add("partition", {kN});
  Optimizer bf16(cfg, layout, state_type), spec(cfg, layout);
  std::vector<float> p = random_values(kN, 1, 0.05f);
  round_to_bf16(p.data(), kN);  // the bf16 master starts from rounded values
  std::vector<uint16_t> master(kN);
  convert_any(master.data(), DType::BF16, p.data(), DType::F32, kN);
  if (state_type == DType::BF16)  // Adagrad's initial accumulator starts rounded too
    for (TypedBuffer* s : spec.state_buffers()) round_to_bf16(s->as<float>(), kN);
  for (int step = 1; step <= 3; ++step) {
    const std::vector<float> g = random_values(kN, 10 + step, 0.01f);
    spec.step(p.data(), g.data(), cfg.lr);
    round_to_bf16(p.data(), kN);
    if (state_type == DType::BF16)
      for (TypedBuffer* s : spec.state_buffers()) round_to_bf16(s->as<float>(), kN);
    bf16.step(TypedSpan{master.data(), DType::BF16}, g.data(), DType::F32, 1.0f, cfg.lr);
    std::vector<float> got(kN);
    convert_any(got.data(), DType::F32, master.data(), DType::BF16, kN);
    ASSERT_EQ(std::memcmp(got.data(), p.data(), kN * 4), 0) << cfg.type_name << " step " << step;
    for (size_t k = 0; k < spec.state_names().size(); ++k) {
      convert_any(got.data(), DType::F32, bf16.state_buffers()[k]->data(), state_type, kN);
      ASSERT_EQ(std::memcmp(got.data(), spec.state_buffers()[k]->data(), kN * 4), 0)
          << spec.state_names()[k] << " step " << step;
    }
  }
}

TEST(Bf16MasterWeights, EachStepIsTheFp32UpdateOfTheBf16ValuesRounded) {
  for (const OptimizerConfig& cfg : elementwise_optimizers()) {
    SCOPED_TRACE(static_cast<int>(cfg.type));
    expect_rounded_fp32_update(cfg, DType::F32);
  }
}

TEST(Bf16OptimizerStates, TheStatesAreRoundedAfterEachUpdateToo) {
  for (const OptimizerConfig& cfg : elementwise_optimizers()) {
    SCOPED_TRACE(static_cast<int>(cfg.type));
    expect_rounded_fp32_update(cfg, DType::BF16);
  }
}

TEST(Bf16OptimizerStates, HalfTheBytesOfFp32States) {
  ParamLayout layout;
  layout.add("w", {1000});
  OptimizerConfig adam, lion;
  lion.type = OptimizerType::Lion;
  EXPECT_EQ(Optimizer(adam, layout).state_bytes(), 8000);
  EXPECT_EQ(Optimizer(adam, layout, DType::BF16).state_bytes(), 4000);
  EXPECT_EQ(Optimizer(lion, layout, DType::BF16).state_bytes(), 2000);
}

// The precision cost DeepSpeed documents for these options: a bf16 master weight cannot take an
// update smaller than half its unit in the last place (2^-9 to 2^-8 of its size), which an fp32 master
// accumulates over steps. Adam with lr 1e-5 on weights near 1 moves them by ~1e-5 < 2^-9.
TEST(Bf16MasterWeights, UpdatesBelowHalfAnUlpAreLostWhereAnFp32MasterKeepsThem) {
  OptimizerConfig adam;
  adam.lr = 1e-5;
  ParamLayout layout;
  layout.add("w", {256});
  Optimizer bf16(adam, layout), fp32(adam, layout);
  std::vector<float> p32(256, 1.0f), g(256, 1.0f);
  std::vector<uint16_t> p16(256);
  convert_any(p16.data(), DType::BF16, p32.data(), DType::F32, 256);
  for (int step = 0; step < 10; ++step) {
    fp32.step(p32.data(), g.data(), adam.lr);
    bf16.step(TypedSpan{p16.data(), DType::BF16}, g.data(), DType::F32, 1.0f, adam.lr);
  }
  float back = 0.0f;
  convert_any(&back, DType::F32, p16.data(), DType::BF16, 1);
  EXPECT_EQ(back, 1.0f);                 // every step rounded back to 1
  EXPECT_NEAR(p32[0], 1.0f - 1e-4f, 1e-6f);  // ten steps of lr·m/sqrt(v) = 1e-5 each
}

}  // namespace
