// test_logits_bf16.cpp — a GPU build's bf16 step keeps the logits in bf16 and writes their
// gradient over them (model/bf16_activations.hpp logits_bf16); a CPU build keeps fp32 logits, and
// logits_bf16_on_host() runs the GPU build's choice here. As specifications: the logits are the
// fp32 run's rounded to bf16, the loss is their cross-entropy and the gradient left in their place
// is dloss·(softmax − onehot) of them rounded to bf16 (both against double loops), a split
// backward (input, then weight gradients) gives the fused pass's bits, and the buffer and its plan
// hold the logits in half the floats.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "kernels/half.hpp"
#include "model/bf16_activations.hpp"
#include "model/model.hpp"
#include "support/typed_param_store.hpp"

using namespace zero3d;

namespace {

const GPTShape kShape{96, 16, 2, 2, 32};  // V 96, T 16, L 2, H 2, C 32
constexpr int64_t kB = 2, kT = 16, kBT = kB * kT, kV = 96;

// The GPU build's choice for the scope, whatever it was before.
class GpuLogits {
 public:
  explicit GpuLogits(bool on) : was_(logits_bf16_on_host()) { logits_bf16_on_host() = on; }
  ~GpuLogits() { logits_bf16_on_host() = was_; }
  GpuLogits(const GpuLogits&) = delete;
  GpuLogits& operator=(const GpuLogits&) = delete;

 private:
  bool was_;
};

struct Pass {
  float loss = 0.0f;
  std::vector<float> logits;    // after the forward (bf16 ones widened)
  std::vector<float> gradient;  // what the logits' memory holds after the backward (bf16 ones widened)
  std::vector<float> grads;
  int64_t buffer_bytes = 0;
};

std::vector<float> read_logits(const float* z, bool bf16) {
  std::vector<float> out(static_cast<size_t>(kBT * kV));
  for (size_t i = 0; i < out.size(); ++i) out[i] = bf16 ? kernels::to_float(as_bf16(z)[i]) : z[i];
  return out;
}

int32_t target_of(int64_t i) { return static_cast<int32_t>((i * 5 + 11) % kShape.vocab_size); }

Pass train_pass(bool gpu_logits, bool split_backward) {
  const GpuLogits hook(gpu_logits);
  GPT model(kShape, kB, kT, DType::BF16, gpt_model_part(kShape, {0, int(kShape.n_layer) + 2}, 1, 0));
  TypedParamStore store(model, DType::BF16, 7);
  ActivationBuffer buf = model.make_buffer(split_backward);
  for (int64_t i = 0; i < kBT; ++i) {
    buf.token_ids(i) = static_cast<int32_t>((i * 7 + 3) % kShape.vocab_size);
    buf.target_ids(i) = target_of(i);
  }
  Pass out;
  out.buffer_bytes = buf.bytes();
  out.loss = model.forward(0, buf, store);
  out.logits = read_logits(buf.logits, gpu_logits);
  if (split_backward) {
    model.backward(0, buf, 1.0f, store, BackwardPart::Input);
    model.backward(0, buf, 1.0f, store, BackwardPart::Weight);
  } else {
    model.backward(0, buf, 1.0f, store);
  }
  out.gradient = read_logits(buf.logits, gpu_logits);
  out.grads = store.grads();
  return out;
}

float bf16_rounded(float x) { return kernels::to_float(kernels::to_bf16(x)); }

// log Σ_v exp(z[v]) over a row of logits, in double.
double log_sum_exp(const float* z) {
  const double mx = *std::max_element(z, z + kV);
  double sum = 0.0;
  for (int64_t v = 0; v < kV; ++v) sum += std::exp(double(z[v]) - mx);
  return mx + std::log(sum);
}

// One bf16 unit in the last place of x: 2^(exponent − 7).
double bf16_ulp(double x) { return x == 0.0 ? std::ldexp(1.0, -133) : std::ldexp(1.0, std::ilogb(x) - 7); }

}  // namespace

TEST(LogitsBf16, OnlyAGpuBuildsBf16StepKeepsBf16Logits) {
  const GpuLogits hook(false);
  EXPECT_EQ(logits_bf16(DType::BF16), kernels::kGpuBuild);
  EXPECT_TRUE(logits_bf16(DType::BF16, kernels::Backend::Gpu)) << "a GPU build's plan";
  EXPECT_FALSE(logits_bf16(DType::BF16, kernels::Backend::Cpu)) << "a CPU build's plan";
  logits_bf16_on_host() = true;
  EXPECT_TRUE(logits_bf16(DType::BF16));
  EXPECT_FALSE(logits_bf16(DType::F32));
  EXPECT_FALSE(logits_bf16(DType::F16));
}

TEST(LogitsBf16, TheLogitsAreTheFp32ProductRoundedAndTheLossTheirCrossEntropy) {
  const Pass fp32 = train_pass(false, false), bf16 = train_pass(true, false);
  // The head's product rounded in its epilogue: the fp32 run's logits rounded to bf16 (the same
  // bf16 operands; an accumulation in another order may move a value across a rounding boundary).
  size_t equal = 0;
  for (size_t i = 0; i < fp32.logits.size(); ++i) {
    ASSERT_LE(std::fabs(bf16.logits[i] - fp32.logits[i]), bf16_ulp(fp32.logits[i])) << "logit " << i;
    equal += bf16.logits[i] == bf16_rounded(fp32.logits[i]);
  }
  EXPECT_GE(equal, fp32.logits.size() * 99 / 100);
  EXPECT_NE(bf16.logits, fp32.logits) << "the logits were not rounded";
  // The mean cross-entropy of those bf16 logits, in double.
  double loss = 0.0;
  for (int64_t i = 0; i < kBT; ++i) loss += log_sum_exp(bf16.logits.data() + i * kV) - bf16.logits[i * kV + target_of(i)];
  loss /= double(kBT);
  EXPECT_NEAR(bf16.loss, loss, 2e-6 * loss);
  EXPECT_NEAR(bf16.loss, fp32.loss, 1e-2 * fp32.loss) << "bf16 logits move the loss by their rounding only";
}

TEST(LogitsBf16, TheGradientIsWrittenOverTheLogitsInBf16) {
  const Pass p = train_pass(true, false);
  const double dloss = 1.0 / double(kBT);  // the mean over B·T tokens, grad_scale 1
  double worst_ulps = 0.0;
  for (int64_t i = 0; i < kBT; ++i) {
    const float* z = p.logits.data() + i * kV;
    const double lse = log_sum_exp(z);
    for (int64_t v = 0; v < kV; ++v) {
      const double want = dloss * (std::exp(double(z[v]) - lse) - (v == target_of(i) ? 1.0 : 0.0));
      const double got = p.gradient[static_cast<size_t>(i * kV + v)];
      worst_ulps = std::max(worst_ulps, std::fabs(got - want) / bf16_ulp(want));
    }
  }
  // bf16's rounding of an fp32 value within a few fp32 ulps of the double one: at most one bf16 ulp
  EXPECT_LE(worst_ulps, 1.0);
}

// The weight pass reads the gradient the input pass left over the logits: the head's gradient
// (wte's, tied) has the fused pass's bits. (The blocks' bias gradients of a bf16 split backward
// sum in another order than the fused pass's, bf16 logits or not: within fp32 rounding.)
TEST(LogitsBf16, ASplitBackwardReadsTheGradientTheInputPassLeft) {
  const Pass fused = train_pass(true, false), split = train_pass(true, true);
  EXPECT_EQ(fused.gradient, split.gradient);
  ASSERT_EQ(fused.grads.size(), split.grads.size());
  GPT model(kShape, kB, kT, DType::BF16, gpt_model_part(kShape, {0, int(kShape.n_layer) + 2}, 1, 0));
  const TensorSpec* wte = model.layout().find("wte.weight");
  ASSERT_NE(wte, nullptr);
  EXPECT_EQ(std::memcmp(fused.grads.data() + wte->offset, split.grads.data() + wte->offset, wte->numel * sizeof(float)), 0);
  for (size_t i = 0; i < fused.grads.size(); ++i)
    ASSERT_NEAR(split.grads[i], fused.grads[i], 1e-6 * (1.0 + std::fabs(fused.grads[i]))) << "gradient element " << i;
}

TEST(LogitsBf16, TheBufferAndItsPlanHoldTheLogitsInHalfTheFloats) {
  const ModelPart part = gpt_model_part(kShape, {0, int(kShape.n_layer) + 2}, 1, 0);
  for (const bool split : {false, true}) {
    int64_t planned[2] = {0, 0}, made[2] = {0, 0};
    for (const bool gpu_logits : {false, true}) {
      const GpuLogits hook(gpu_logits);
      GPT model(kShape, kB, kT, DType::BF16, part);
      made[gpu_logits] = model.make_buffer(split).bytes();
      planned[gpu_logits] = gpt_activation_bytes(kShape, part, kB, kT, false, split, {}, {}, DType::BF16).buffer;
    }
    EXPECT_EQ(made[1], planned[1]) << "split " << split;
    EXPECT_EQ(made[0] - made[1], 4 * kBT * kV / 2) << "split " << split;  // B·T·V floats became B·T·V bf16
  }
}
