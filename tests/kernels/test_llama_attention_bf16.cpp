// test_llama_attention_bf16.cpp — the Llama family's bf16 attention backward as the block runs it
// (kernels/attention_gqa.hpp gqa_attention_backward_summing_columns): the fused AVX512-BF16
// kernel (where built) folds rope's backward and the bf16 rounding of dqkv, with q/k/v_proj's
// bias gradient, into what it writes; the portable form writes the fp32 dqkv, runs rope_backward
// and rounds after. The two give the same bits. And what the bf16 attention keeps for its
// backward fits the floats the model allocates for it (gqa_attention_bf16_saved_floats, which the
// memory plan counts) on each backend: a GPU's bf16 form keeps bf16 probabilities, half the floats
// of the portable form's fp32 ones (the GPU forms compile on every build, so they run here).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "base/rng.hpp"
#include "kernels/attention.hpp"
#include "kernels/attention_gqa.hpp"
#include "kernels/half.hpp"
#include "kernels/rope.hpp"
#include "support/model_memory.hpp"

using namespace zero3d;
using namespace zero3d::kernels;

namespace {

using test_support::Buffer;
using test_support::expect_same_bits;
using test_support::value;

std::vector<float> random_vector(size_t n, uint64_t stream, float scale = 1.0f) {
  return test_support::normal_vector(33, n, stream, scale);
}

std::vector<bf16> rounded(const std::vector<float>& x) {
  std::vector<bf16> out(x.size());
  for (size_t i = 0; i < x.size(); ++i) out[i] = to_bf16(x[i]);
  return out;
}

struct Case {
  Index B, T, H, Hkv, d, window;
};
std::string describe(const Case& c) {
  return " [B " + std::to_string(c.B) + ", T " + std::to_string(c.T) + ", H " + std::to_string(c.H) + ", Hkv " +
         std::to_string(c.Hkv) + ", d " + std::to_string(c.d) + ", window " + std::to_string(c.window) + "]";
}

// rope's default tables [T][d/2] (theta 10000), as rope_config.hpp makes them.
struct RopeTables {
  Buffer<float> cos, sin;
  RopeTables(Index T, Index d) : cos(table(T, d, true)), sin(table(T, d, false)) {}
  static std::vector<float> table(Index T, Index d, bool c) {
    std::vector<float> v(T * (d / 2));
    for (Index t = 0; t < T; ++t)
      for (Index i = 0; i < d / 2; ++i) {
        const double a = t * std::pow(1e4, -2.0 * i / d);
        v[t * (d / 2) + i] = static_cast<float>(c ? std::cos(a) : std::sin(a));
      }
    return v;
  }
};

// Groups of 1, 2 and 4 query heads a K/V head; head sizes 64, 128 and 16; ragged T; windows.
const Case kCases[] = {{2, 80, 4, 4, 64, 0}, {1, 130, 4, 2, 64, 50}, {1, 300, 8, 2, 64, 100},
                       {2, 77, 4, 1, 128, 0}, {2, 64, 4, 2, 16, 24}};

// The block's whole bf16 backward: dqkv of q and k before rotation, rounded to bf16, and the bias
// gradient summed beside it — bit for bit what rope_backward on the fp32 dqkv, then rounding with
// column sums (gemm_operand's pass), give. With and without a bias (Qwen2 has one, Llama none).
TEST(LlamaGqaAttentionBf16, BackwardSummingColumnsIsRopeBackwardThenRoundingBitForBit) {
  for (const Case& c : kCases)
    for (const bool bias : {false, true}) {
      const std::string at = describe(c) + (bias ? " with a bias" : "");
      const Index W = (c.H + 2 * c.Hkv) * c.d, rows = c.B * c.T;
      Buffer<bf16> qkv(rounded(random_vector(rows * W, 41, 0.8f))), out(rows * c.H * c.d), fused(rows * W),
          portable(rows * W);
      Buffer<float> dout(random_vector(rows * c.H * c.d, 42)), att(c.B * c.H * c.T * c.T), wide(rows * W),
          scratch(kRowBlock * c.T);
      const std::vector<float> start = random_vector(W, 43);
      Buffer<float> fused_bias(start), portable_bias(start);
      const RopeTables rope(c.T, c.d);
      gqa_attention_forward(out.data(), att.data(), qkv.data(), c.B, c.T, c.H, c.Hkv, c.d, c.window);
      gqa_attention_backward_summing_columns(fused.data(), bias ? fused_bias.data() : nullptr, wide.data(),
                                             scratch.data(), dout.data(), qkv.data(), att.data(), c.B, c.T, c.H, c.Hkv,
                                             c.d, c.window, rope.cos.data(), rope.sin.data());
      gqa_attention_backward(wide.data(), scratch.data(), dout.data(), qkv.data(), att.data(), c.B, c.T, c.H, c.Hkv,
                             c.d, c.window);
      rope_backward(wide.data(), rope.cos.data(), rope.sin.data(), c.B, c.T, c.H, c.Hkv, c.d);
      convert_summing_columns(portable.data(), bias ? portable_bias.data() : nullptr, wide.data(), rows, W);
      expect_same_bits("dqkv" + at, fused.host(), portable.host());
      expect_same_bits("bias gradient" + at, fused_bias.host(), portable_bias.host());
      if (!bias) expect_same_bits("no bias, none touched" + at, fused_bias.host(), start);
    }
}

// Largest |got − want| over columns [first, first + width) of each row of `stride`, relative to
// the largest |want| there.
template <typename T>
double worst_relative(const std::vector<T>& got, const std::vector<float>& want, Index stride, Index first,
                      Index width) {
  double scale = 0.0, worst = 0.0;
  for (size_t r = 0; r < want.size() / stride; ++r)
    for (Index c = first; c < first + width; ++c) {
      scale = std::max(scale, std::fabs(static_cast<double>(want[r * stride + c])));
      const double e = std::fabs(value(got[r * stride + c]) - want[r * stride + c]);
      worst = std::isnan(e) ? INFINITY : std::max(worst, e);
    }
  return scale > 0.0 ? worst / scale : worst;
}

// The bf16 attention with attention dropout (the fused kernel where built: it draws the mask
// itself) and the fp32 kernel on the same widened q, k, v with the same mask (the portable form's
// computation, dropout_probability_rows' mask): within the bf16 bounds of the fused kernel
// against its definition; against the fp32 kernel under another layer's mask, far apart, so the
// fused kernel drops exactly dropout.hpp's elements. first_head: a tensor rank's global heads.
TEST(LlamaGqaAttentionBf16, DropoutDrawsThePortableFormsMask) {
  DropoutMask drop = dropout_mask(0.25, 9, 12, 1, DropoutSite::Probabilities);
  DropoutMask other = dropout_mask(0.25, 9, 12, 2, DropoutSite::Probabilities);
  drop.first_head = other.first_head = 2;
  for (const Case& c : kCases) {
    const std::string at = describe(c);
#ifdef ZERO3D_FLASH_ATTENTION
    EXPECT_TRUE(gqa_attention_flash_chosen(c.B * c.H, c.T, c.d)) << "the fused kernel runs" << at;
#endif
    const Index W = (c.H + 2 * c.Hkv) * c.d, rows = c.B * c.T, A = c.H * c.d;
    const std::vector<bf16> q = rounded(random_vector(rows * W, 51, 0.8f));
    std::vector<float> wide_q(q.size());
    for (size_t i = 0; i < q.size(); ++i) wide_q[i] = to_float(q[i]);
    Buffer<bf16> qkv(q), out(rows * A);
    Buffer<float> wide(wide_q), dout(random_vector(rows * A, 52)), att(c.B * c.H * c.T * c.T), dqkv(rows * W),
        scratch(kRowBlock * c.T);
    gqa_attention_forward(out.data(), att.data(), qkv.data(), c.B, c.T, c.H, c.Hkv, c.d, c.window, drop);
    gqa_attention_backward(dqkv.data(), scratch.data(), dout.data(), qkv.data(), att.data(), c.B, c.T, c.H, c.Hkv, c.d,
                           c.window, drop);
    const std::vector<bf16> got_out = out.host();
    const std::vector<float> got_dqkv = dqkv.host();
    for (float x : got_dqkv) ASSERT_TRUE(std::isfinite(x)) << "dqkv written everywhere" << at;
    for (const DropoutMask* mask : {&drop, &other}) {
      Buffer<float> ref_out(rows * A), ref_att(c.B * c.H * c.T * c.T), ref_dqkv(rows * W);
      gqa_attention_forward(ref_out.data(), ref_att.data(), wide.data(), c.B, c.T, c.H, c.Hkv, c.d, c.window, *mask);
      gqa_attention_backward(ref_dqkv.data(), scratch.data(), dout.data(), wide.data(), ref_att.data(), c.B, c.T, c.H,
                             c.Hkv, c.d, c.window, *mask);
      const std::vector<float> want_out = ref_out.host(), want_dqkv = ref_dqkv.host();
      const double out_err = worst_relative(got_out, want_out, A, 0, A),
                   dq_err = worst_relative(got_dqkv, want_dqkv, W, 0, A),
                   dk_err = worst_relative(got_dqkv, want_dqkv, W, A, c.Hkv * c.d),
                   dv_err = worst_relative(got_dqkv, want_dqkv, W, A + c.Hkv * c.d, c.Hkv * c.d);
      if (mask == &drop) {
        EXPECT_LT(out_err, 6e-3) << "out" << at;
        EXPECT_LT(dq_err, 1e-2) << "dq" << at;
        EXPECT_LT(dk_err, 1e-2) << "dk" << at;
        EXPECT_LT(dv_err, 1e-2) << "dv" << at;
      } else {
        EXPECT_GT(out_err, 5e-2) << "another mask's out" << at;
        EXPECT_GT(dv_err, 5e-2) << "another mask's dv" << at;
      }
    }
  }
}

constexpr float kUntouched = 12345.0f;  // what att holds past the floats it was given

// The GPU's bf16 form over att of `floats` floats followed by a guard of untouched values: its
// output and dqkv, and att as it was left.
struct GpuBf16Run {
  std::vector<bf16> out;
  std::vector<float> dqkv, att;
  GpuBf16Run(const Case& c, Index floats) {
    const Index W = (c.H + 2 * c.Hkv) * c.d;
    Buffer<bf16> qkv(rounded(random_vector(c.B * c.T * W, 51))), y(c.B * c.T * c.H * c.d);
    Buffer<float> dout(random_vector(c.B * c.T * c.H * c.d, 52)), dq(c.B * c.T * W);
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
