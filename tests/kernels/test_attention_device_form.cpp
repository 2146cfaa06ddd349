// test_attention_device_form.cpp — the fp32 attention's device form (kernels/attention.hpp
// gpu::, what a GPU build runs: heads split, batched products, a team per softmax row) against
// the CPU form, on the CPU. The two sum in different orders (whole rows in one product against
// 64-row blocks; the scale applied after the product instead of inside it), so they agree to
// a few fp32 roundings, not in every bit; the device form agrees with itself in every bit.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <tuple>
#include <vector>

#include "base/rng.hpp"
#include "kernels/attention.hpp"
#include "support/model_memory.hpp"

using namespace zero3d;
using namespace zero3d::kernels;

using test_support::worst_error;

namespace {

std::vector<float> random_vector(size_t n, uint64_t stream) {
  return test_support::normal_vector(11, n, stream);
}

struct Shape {
  Index B, T, C, H;
};

class Fp32AttentionDeviceForm : public ::testing::TestWithParam<Shape> {};

TEST_P(Fp32AttentionDeviceForm, ForwardAndBackwardAgreeWithTheCpuForm) {
  const auto [B, T, C, H] = GetParam();
  const auto qkv = random_vector(B * T * 3 * C, 1), dout = random_vector(B * T * C, 2);
  std::vector<float> out_cpu(B * T * C), att_cpu(B * H * T * T), dqkv_cpu(B * T * 3 * C), scratch(kRowBlock * T);
  attention_forward_fp32(out_cpu.data(), att_cpu.data(), qkv.data(), B, T, C, H);
  attention_backward(dqkv_cpu.data(), scratch.data(), dout.data(), qkv.data(), att_cpu.data(), B, T, C, H);

  std::vector<float> out(B * T * C), att(B * H * T * T, -1.0f), dqkv(B * T * 3 * C, -1.0f);
  gpu::attention_forward_fp32(out.data(), att.data(), qkv.data(), B, T, C, H);
  gpu::attention_backward_fp32(dqkv.data(), dout.data(), qkv.data(), att.data(), B, T, C, H);
  EXPECT_LE(worst_error(out, out_cpu), 2e-6) << "output";
  EXPECT_LE(worst_error(dqkv, dqkv_cpu), 1e-5) << "dqkv";
  // The probabilities: equal below the diagonal, zero above it in both (the backward reads them).
  EXPECT_LE(worst_error(att, att_cpu), 1e-6) << "probabilities";
  for (Index bh = 0; bh < B * H; ++bh)
    for (Index i = 0; i < T; ++i)
      for (Index j = i + 1; j < T; ++j) ASSERT_EQ(att[(bh * T + i) * T + j], 0.0f) << bh << " " << i << " " << j;
}

// Attention dropout: both forms draw the same mask (global heads from first_head) and keep the
// undropped probabilities; the output differs from the undropped one.
TEST_P(Fp32AttentionDeviceForm, WithDropoutAgreeWithTheCpuForm) {
  const auto [B, T, C, H] = GetParam();
  DropoutMask drop = dropout_mask(0.3, 17, 40, 2, DropoutSite::Probabilities);
  drop.first_head = 3;  // as tensor rank 1 of heads 3, 4, ...
  const auto qkv = random_vector(B * T * 3 * C, 5), dout = random_vector(B * T * C, 6);
  std::vector<float> out_cpu(B * T * C), att_cpu(B * H * T * T), dqkv_cpu(B * T * 3 * C), scratch(kRowBlock * T);
  std::vector<float> plain(B * T * C), plain_att(B * H * T * T);
  attention_forward_fp32(out_cpu.data(), att_cpu.data(), qkv.data(), B, T, C, H, drop);
  attention_backward(dqkv_cpu.data(), scratch.data(), dout.data(), qkv.data(), att_cpu.data(), B, T, C, H, DType::F32,
                     drop);
  attention_forward_fp32(plain.data(), plain_att.data(), qkv.data(), B, T, C, H);
  EXPECT_EQ(att_cpu, plain_att) << "the kept probabilities are the undropped ones";
  EXPECT_GT(worst_error(out_cpu, plain), 1e-3) << "dropout changes the output";

  std::vector<float> out(B * T * C), att(B * H * T * T, -1.0f), dqkv(B * T * 3 * C, -1.0f);
  gpu::attention_forward_fp32(out.data(), att.data(), qkv.data(), B, T, C, H, drop);
  gpu::attention_backward_fp32(dqkv.data(), dout.data(), qkv.data(), att.data(), B, T, C, H, drop);
  EXPECT_LE(worst_error(out, out_cpu), 2e-6) << "output";
  EXPECT_LE(worst_error(dqkv, dqkv_cpu), 1e-5) << "dqkv";
  EXPECT_LE(worst_error(att, att_cpu), 1e-6) << "probabilities";
}

TEST_P(Fp32AttentionDeviceForm, TwoRunsGiveTheSameBits) {
  const auto [B, T, C, H] = GetParam();
  const auto qkv = random_vector(B * T * 3 * C, 3), dout = random_vector(B * T * C, 4);
  std::vector<float> out1(B * T * C), out2(B * T * C), att(B * H * T * T), d1(B * T * 3 * C), d2(B * T * 3 * C);
  gpu::attention_forward_fp32(out1.data(), att.data(), qkv.data(), B, T, C, H);
  gpu::attention_backward_fp32(d1.data(), dout.data(), qkv.data(), att.data(), B, T, C, H);
  gpu::attention_forward_fp32(out2.data(), att.data(), qkv.data(), B, T, C, H);
  gpu::attention_backward_fp32(d2.data(), dout.data(), qkv.data(), att.data(), B, T, C, H);
  EXPECT_EQ(out1, out2);
  EXPECT_EQ(d1, d2);
}

// The causal products' query blocks: about T/8 rows, a multiple of 64, the last one what is left.
TEST(CausalBlocks, AreAboutAnEighthOfTheSequenceInMultiplesOf64Rows) {
  for (const auto& [T, rows, count] : {std::tuple<Index, Index, Index>{1024, 128, 8}, {2048, 256, 8}, {4096, 512, 8},
                                       {300, 64, 5}, {70, 64, 2}, {64, 64, 1}, {33, 64, 1}, {1, 64, 1}}) {
    const CausalBlocks blocks(T);
    EXPECT_EQ(blocks.rows, rows) << "T " << T;
    EXPECT_EQ(blocks.count, count) << "T " << T;
    EXPECT_EQ(blocks.end(blocks.count - 1, T), T) << "T " << T;
    EXPECT_GT(blocks.end(blocks.count - 1, T), blocks.begin(blocks.count - 1)) << "T " << T;
  }
}

// T = 70 crosses the CPU form's 64-row blocks and is two of the device form's causal blocks (64
// and 6 rows); T = 300 is five (four of 64, one of 44); hs 16 and 64 (GPT-2's).
INSTANTIATE_TEST_SUITE_P(Shapes, Fp32AttentionDeviceForm,
                         ::testing::Values(Shape{2, 70, 48, 3}, Shape{1, 33, 128, 2}, Shape{2, 16, 64, 1},
                                           Shape{1, 300, 32, 2}),
                         [](const ::testing::TestParamInfo<Shape>& i) {
                           return "B" + std::to_string(i.param.B) + "_T" + std::to_string(i.param.T) + "_C" +
                                  std::to_string(i.param.C) + "_H" + std::to_string(i.param.H);
                         });

}  // namespace
