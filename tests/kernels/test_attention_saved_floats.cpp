// test_attention_saved_floats.cpp — what the Llama family's bf16 attention keeps for its backward
// fits the floats the model allocates for it (gqa_attention_bf16_saved_floats, which the memory
// plan counts), on each backend: a GPU's bf16 form keeps bf16 probabilities, half the floats of
// the fp32 ones the portable form keeps. The GPU forms compile on every build (namespace gpu), so
// the CPU suite runs them here.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "kernels/attention_gqa.hpp"
#include "kernels/device.hpp"
#include "kernels/half.hpp"
#include "support/model_memory.hpp"

using namespace zero3d;
using namespace zero3d::kernels;
using test_support::Buffer;
using test_support::expect_same_bits;
using test_support::normal_vector;

namespace {

constexpr uint64_t kSeed = 0xa77;
constexpr float kUntouched = 12345.0f;  // what att holds past the floats it was given

struct Case {
  Index B, T, H, Hkv, d, window;
};

std::string describe(const Case& c) {
  return " (B " + std::to_string(c.B) + ", T " + std::to_string(c.T) + ", H " + std::to_string(c.H) + "/" +
         std::to_string(c.Hkv) + ", d " + std::to_string(c.d) + ", window " + std::to_string(c.window) + ")";
}

std::vector<bf16> rounded(const std::vector<float>& x) {
  std::vector<bf16> out(x.size());
  for (size_t i = 0; i < x.size(); ++i) out[i] = to_bf16(x[i]);
  return out;
}

// The GPU's bf16 form over att of `floats` floats followed by a guard of untouched values: its
// output and dqkv, and att as it was left.
struct GpuBf16Run {
  std::vector<bf16> out;
  std::vector<float> dqkv, att;
  GpuBf16Run(const Case& c, Index floats) {
    const Index W = (c.H + 2 * c.Hkv) * c.d;
    Buffer<bf16> qkv(rounded(normal_vector(kSeed, c.B * c.T * W, 1))), y(c.B * c.T * c.H * c.d);
    Buffer<float> dout(normal_vector(kSeed, c.B * c.T * c.H * c.d, 2)), dq(c.B * c.T * W);
    Buffer<float> saved(std::vector<float>(floats + 64, kUntouched));
    gpu::gqa_attention_forward_bf16(y.data(), saved.data(), qkv.data(), c.B, c.T, c.H, c.Hkv, c.d, c.window);
    gpu::gqa_attention_backward_bf16(dq.data(), dout.data(), qkv.data(), saved.data(), c.B, c.T, c.H, c.Hkv, c.d,
                                     c.window);
    out = y.host();
    dqkv = dq.host();
    att = saved.host();
  }
};

TEST(GqaAttentionSavedFloats, AGpusBf16FormKeepsItsBf16ProbabilitiesInHalfTheFloats) {
  // an odd count of probabilities (1·3·33·33) rounds up to whole floats
  for (const Case& c : {Case{2, 40, 4, 2, 16, 0}, Case{1, 33, 3, 1, 32, 9}, Case{1, 64, 8, 2, 64, 0}}) {
    const Index BH = c.B * c.H, probabilities = BH * c.T * c.T;
    const Index floats = gqa_attention_bf16_saved_floats(BH, c.T, c.d, false, Backend::Gpu);
    ASSERT_EQ(floats, (probabilities + 1) / 2) << describe(c);
    const GpuBf16Run planned(c, floats), roomy(c, probabilities);
    for (Index i = floats; i < floats + 64; ++i)
      ASSERT_EQ(planned.att[i], kUntouched) << "att written past its planned floats at " << i << describe(c);
    expect_same_bits("out" + describe(c), planned.out, roomy.out);
    expect_same_bits("dqkv" + describe(c), planned.dqkv, roomy.dqkv);
  }
}

// Under attention dropout a GPU's training passes run the portable form, whose fp32 probabilities
// take every float; a CPU keeps the portable form's (or, built with AVX512-BF16, the fused
// kernel's log-sum-exp and output where they fit) either way.
TEST(GqaAttentionSavedFloats, DropoutAndTheCpuKeepFp32ProbabilitiesOrTheFusedKernelsSaves) {
  const Index BH = 8, T = 40, d = 16;
  EXPECT_EQ(gqa_attention_bf16_saved_floats(BH, T, d, true, Backend::Gpu), BH * T * T);
  const Index cpu = gqa_attention_bf16_saved_floats(BH, T, d, false, Backend::Cpu);
  if (gqa_attention_flash_chosen(BH, T, d, {}, Backend::Cpu))
    EXPECT_EQ(cpu, attention_flash_o_offset(BH, T) + (BH * T * d + 1) / 2);
  else
    EXPECT_EQ(cpu, BH * T * T);
}

}  // namespace
