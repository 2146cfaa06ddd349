// test_attention_flash.cpp — the fused (FlashAttention-2 style) bf16 attention against a
// double-precision reference attention on the same bf16-rounded q, k, v: outputs and all three
// gradients, at head sizes that are and are not a multiple of 16, sequence lengths that are and
// are not a multiple of the tiles (16-column groups, 32-row forward blocks, 256-key online
// softmax blocks, 32-key / 64-query backward tiles), and several batch × head counts. Where a
// build has no fused kernel (no AVX512-BF16) the same tests check the bf16 path it has.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "base/rng.hpp"
#include "kernels/attention.hpp"
#include "kernels/half.hpp"

using namespace zero3d;
using namespace zero3d::kernels;

namespace {

std::vector<float> random_vector(size_t n, uint64_t stream, float scale = 1.0f) {
  Rng rng(5, stream);
  std::vector<float> v(n);
  for (auto& x : v) x = static_cast<float>(scale * rng.normal());
  return v;
}

std::vector<float> rounded_to_bf16(std::vector<float> v) {
  for (float& x : v) x = to_float(to_bf16(x));
  return v;
}

// Causal attention in double: out[B,T,C] and dqkv[B,T,3C] from qkv[B,T,3C] and dout.
void reference_attention(std::vector<double>& out, std::vector<double>& dqkv, const std::vector<float>& qkv,
                         const std::vector<float>& dout, Index B, Index T, Index C, Index H) {
  const Index hs = C / H, C3 = 3 * C;
  const double scale = 1.0 / std::sqrt(static_cast<double>(hs));
  out.assign(B * T * C, 0.0);
  dqkv.assign(B * T * C3, 0.0);
  std::vector<double> p(T), dp(T);
  for (Index b = 0; b < B; ++b)
    for (Index h = 0; h < H; ++h) {
      const auto q = [&](Index t, Index d) { return double(qkv[(b * T + t) * C3 + h * hs + d]); };
      const auto k = [&](Index t, Index d) { return double(qkv[(b * T + t) * C3 + C + h * hs + d]); };
      const auto v = [&](Index t, Index d) { return double(qkv[(b * T + t) * C3 + 2 * C + h * hs + d]); };
      for (Index i = 0; i < T; ++i) {
        double mx = -INFINITY;
        for (Index j = 0; j <= i; ++j) {
          double s = 0.0;
          for (Index d = 0; d < hs; ++d) s += q(i, d) * k(j, d);
          p[j] = s * scale;
          mx = std::max(mx, p[j]);
        }
        double sum = 0.0;
        for (Index j = 0; j <= i; ++j) sum += (p[j] = std::exp(p[j] - mx));
        for (Index j = 0; j <= i; ++j) p[j] /= sum;
        const float* g = dout.data() + (b * T + i) * C + h * hs;
        double dot = 0.0;
        for (Index j = 0; j <= i; ++j) {
          dp[j] = 0.0;
          for (Index d = 0; d < hs; ++d) {
            out[(b * T + i) * C + h * hs + d] += p[j] * v(j, d);
            dp[j] += g[d] * v(j, d);
          }
          dot += p[j] * dp[j];
        }
        for (Index j = 0; j <= i; ++j) {
          const double ds = p[j] * (dp[j] - dot) * scale;
          for (Index d = 0; d < hs; ++d) {
            dqkv[(b * T + i) * C3 + h * hs + d] += ds * k(j, d);
            dqkv[(b * T + j) * C3 + C + h * hs + d] += ds * q(i, d);
            dqkv[(b * T + j) * C3 + 2 * C + h * hs + d] += p[j] * g[d];
          }
        }
      }
    }
}

// Largest |a - b| and the root-mean-square of a - b, both relative to max |b|.
struct Error {
  double max, rms;
};
template <typename A>
Error error_of(const std::vector<A>& a, const std::vector<double>& b) {
  double scale = 0.0, worst = 0.0, sq = 0.0;
  for (double x : b) scale = std::max(scale, std::fabs(x));
  for (size_t i = 0; i < a.size(); ++i) {
    const double e = std::fabs(double(a[i]) - b[i]);
    worst = std::max(worst, e);
    sq += e * e;
  }
  return {worst / scale, std::sqrt(sq / double(a.size())) / scale};
}

struct Shape {
  Index B, T, C, H;
};
void PrintTo(const Shape& s, std::ostream* os) { *os << "B" << s.B << " T" << s.T << " C" << s.C << " H" << s.H; }

class FlashAttention : public ::testing::TestWithParam<Shape> {};

TEST_P(FlashAttention, MatchesADoublePrecisionReferenceOnTheSameRoundedInputs) {
  const auto [B, T, C, H] = GetParam();
  const auto qkv = rounded_to_bf16(random_vector(B * T * 3 * C, 1));
  const auto dout = random_vector(B * T * C, 2);
  std::vector<float> out(B * T * C, NAN), att(B * H * T * T, NAN), dqkv(B * T * 3 * C, NAN);
  std::vector<bf16> out16(B * T * C);
  attention_forward(out.data(), att.data(), qkv.data(), B, T, C, H, DType::BF16);
  attention_forward(out16.data(), att.data(), qkv.data(), B, T, C, H, DType::BF16);  // the model's bf16 output
  attention_backward(dqkv.data(), nullptr, dout.data(), qkv.data(), att.data(), B, T, C, H, DType::BF16);
  std::vector<double> ref_out, ref_dqkv;
  reference_attention(ref_out, ref_dqkv, qkv, dout, B, T, C, H);
  for (float x : dqkv) ASSERT_TRUE(std::isfinite(x)) << "dqkv is written everywhere";
  for (size_t i = 0; i < out.size(); ++i) ASSERT_EQ(out16[i].bits, to_bf16(out[i]).bits) << "bf16 output " << i;
  // bf16 probabilities and bf16 operands: 2^-9 relative per product term, fp32 sums (measured
  // here: max 0.7-1.1e-3, rms 0.5-1.4e-4 for out; max 1.7-4.8e-3, rms 0.8-4.5e-4 for the gradients)
  const Error eo = error_of(out, ref_out);
  EXPECT_LT(eo.max, 4e-3) << "out";
  EXPECT_LT(eo.rms, 5e-4) << "out";
  for (int part = 0; part < 3; ++part) {  // dq, dk, dv each against its own scale
    std::vector<float> got;
    std::vector<double> want;
    for (Index bt = 0; bt < B * T; ++bt)
      for (Index c = 0; c < C; ++c) {
        got.push_back(dqkv[bt * 3 * C + part * C + c]);
        want.push_back(ref_dqkv[bt * 3 * C + part * C + c]);
      }
    const Error e = error_of(got, want);
    EXPECT_LT(e.max, 1e-2) << "d" << "qkv"[part];
    EXPECT_LT(e.rms, 1.5e-3) << "d" << "qkv"[part];
  }
}

TEST_P(FlashAttention, IsCausal) {
  const auto [B, T, C, H] = GetParam();
  auto qkv = random_vector(B * T * 3 * C, 3);
  std::vector<float> out1(B * T * C), out2(B * T * C), att(B * H * T * T);
  attention_forward(out1.data(), att.data(), qkv.data(), B, T, C, H, DType::BF16);
  for (Index b = 0; b < B; ++b)  // change only the last token of each sequence
    for (Index c = 0; c < 3 * C; ++c) qkv[(b * T + T - 1) * 3 * C + c] += 1.0f;
  attention_forward(out2.data(), att.data(), qkv.data(), B, T, C, H, DType::BF16);
  for (Index b = 0; b < B; ++b)
    for (Index i = 0; i < (T - 1) * C; ++i) ASSERT_EQ(out1[b * T * C + i], out2[b * T * C + i]) << "saw the future";
}

// T = 256: exactly the tiles; T = 300: a ragged last 16-column group and row block, two key
// blocks of the online softmax; T = 600: three key blocks; T = 77 with hs = 24 (padded to 32
// for the products); hs = 8 with B·H = 18; T = 1024 at GPT-2's head size.
INSTANTIATE_TEST_SUITE_P(Shapes, FlashAttention,
                         ::testing::Values(Shape{2, 256, 128, 2}, Shape{1, 300, 192, 3}, Shape{1, 600, 64, 1},
                                           Shape{2, 77, 96, 4}, Shape{3, 40, 48, 6}, Shape{1, 1024, 128, 2},
                                           Shape{2, 41, 64, 1}));

// The online softmax: scores that grow along the sequence put each row's maximum in its last
// key block, so the running max moves up at every block and the partial sums and outputs must
// be rescaled (a missing rescale is off by factors of e^(Δmax), not by rounding).
TEST(FlashAttentionOnlineSoftmax, RescalesWhenTheMaximumMovesToALaterKeyBlock) {
  const Index B = 1, T = 700, C = 64, H = 1, C3 = 3 * C;
  auto qkv = rounded_to_bf16(random_vector(B * T * C3, 4, 0.3f));
  for (Index t = 0; t < T; ++t) {
    qkv[t * C3 + 0] = 4.0f;                                   // q: a constant first component
    qkv[t * C3 + C + 0] = to_float(to_bf16(0.02f * float(t)));  // k: scores rise with the key's position
  }
  const auto dout = random_vector(B * T * C, 5);
  std::vector<float> out(B * T * C), att(B * H * T * T), dqkv(B * T * C3);
  attention_forward(out.data(), att.data(), qkv.data(), B, T, C, H, DType::BF16);
  attention_backward(dqkv.data(), nullptr, dout.data(), qkv.data(), att.data(), B, T, C, H, DType::BF16);
  std::vector<double> ref_out, ref_dqkv;
  reference_attention(ref_out, ref_dqkv, qkv, dout, B, T, C, H);
  EXPECT_LT(error_of(out, ref_out).max, 4e-3);
  EXPECT_LT(error_of(dqkv, ref_dqkv).max, 1e-2);
}

// Shapes whose att has no room for what the fused kernel keeps (T far below the head size) run
// the tiled kernel, forward and backward alike.
TEST(FlashAttentionFallback, ShortSequencesWithWideHeadsRunTheTiledKernel) {
  const Index B = 2, T = 4, C = 128, H = 2;
  EXPECT_FALSE(attention_flash_fits(B * H, T, C / H));
  const auto qkv = rounded_to_bf16(random_vector(B * T * 3 * C, 6));
  const auto dout = random_vector(B * T * C, 7);
  std::vector<float> out(B * T * C), att(B * H * T * T), dqkv(B * T * 3 * C);
  attention_forward(out.data(), att.data(), qkv.data(), B, T, C, H, DType::BF16);
  attention_backward(dqkv.data(), nullptr, dout.data(), qkv.data(), att.data(), B, T, C, H, DType::BF16);
  std::vector<double> ref_out, ref_dqkv;
  reference_attention(ref_out, ref_dqkv, qkv, dout, B, T, C, H);
  EXPECT_LT(error_of(out, ref_out).max, 1e-2);
  EXPECT_LT(error_of(dqkv, ref_dqkv).max, 2e-2);
}

// A qkv that c_attn already rounded to bf16 gives the bits the same values in fp32 give, in both
// kernels (each rounds q, k and v to bf16 as it packs them): the bf16 model may hand either.
TEST(BfloatAttention, ABf16QkvGivesTheBitsOfTheSameValuesInFp32) {
  for (const Index T : {Index(4), Index(40)}) {  // the tiled kernel (no room for the fused one's saves), then the fused
    const Index B = 2, C = 128, H = 2;
    const auto qkv = rounded_to_bf16(random_vector(B * T * 3 * C, 10));
    const auto dout = random_vector(B * T * C, 11);
    std::vector<bf16> qkv16(qkv.size());
    for (size_t i = 0; i < qkv.size(); ++i) qkv16[i] = to_bf16(qkv[i]);
    std::vector<float> out(B * T * C), out16(B * T * C), att(B * H * T * T), att16(B * H * T * T);
    std::vector<float> dqkv(B * T * 3 * C), dqkv16(B * T * 3 * C);
    attention_forward(out.data(), att.data(), qkv.data(), B, T, C, H, DType::BF16);
    attention_forward(out16.data(), att16.data(), qkv16.data(), B, T, C, H, DType::BF16);
    attention_backward(dqkv.data(), nullptr, dout.data(), qkv.data(), att.data(), B, T, C, H, DType::BF16);
    attention_backward(dqkv16.data(), nullptr, dout.data(), qkv16.data(), att16.data(), B, T, C, H, DType::BF16);
    EXPECT_EQ(out, out16) << "T " << T;
    EXPECT_EQ(dqkv, dqkv16) << "T " << T;
  }
}

// The backward that feeds c_attn's bf16 products writes dqkv in bf16 with c_attn's bias gradient
// beside it: the same bits as rounding the fp32 dqkv and summing its columns (what gemm_operand
// does), added to the bias gradient already there. The fused kernel (T = 40, 77 with hs = 24,
// and 300 with a ragged last tile) and the tiled one (T = 4).
TEST(BfloatAttention, Bf16GradientWithBiasSumsGivesTheBitsOfConvertingTheFp32One) {
  struct Case { Index B, T, C, H; };
  for (const Case k : {Case{2, 4, 128, 2}, Case{2, 40, 128, 2}, Case{2, 77, 96, 4}, Case{1, 300, 192, 3}}) {
    const Index N = k.B * k.T, C3 = 3 * k.C;
    const auto qkv = rounded_to_bf16(random_vector(N * C3, 12));
    const auto dout = random_vector(N * k.C, 13);
    std::vector<bf16> qkv16(qkv.size());
    for (size_t i = 0; i < qkv.size(); ++i) qkv16[i] = to_bf16(qkv[i]);
    std::vector<float> out(N * k.C), att(k.B * k.H * k.T * k.T), dqkv(N * C3), scratch(N * C3);
    attention_forward(out.data(), att.data(), qkv16.data(), k.B, k.T, k.C, k.H, DType::BF16);
    attention_backward(dqkv.data(), nullptr, dout.data(), qkv16.data(), att.data(), k.B, k.T, k.C, k.H, DType::BF16);
    std::vector<bf16> want(N * C3), got(N * C3);
    std::vector<float> want_bias(C3, 0.5f), got_bias(C3, 0.5f);  // a gradient already there: added to
    convert_summing_columns(want.data(), want_bias.data(), dqkv.data(), N, C3);
    attention_backward_summing_columns(got.data(), got_bias.data(), scratch.data(), dout.data(), qkv16.data(), att.data(),
                                       k.B, k.T, k.C, k.H);
    for (Index i = 0; i < N * C3; ++i) ASSERT_EQ(want[i].bits, got[i].bits) << "T " << k.T << " element " << i;
    EXPECT_EQ(want_bias, got_bias) << "T " << k.T;
  }
}

#ifdef ZERO3D_FLASH_ATTENTION
// The fused and the tiled kernels agree with each other as closely as each agrees with exact
// arithmetic (they round different intermediates), and the model's shapes take the fused one.
TEST(FlashAttentionKernel, AgreesWithTheTiledKernelAtGptSmallsShape) {
  const Index B = 2, T = 256, C = 384, H = 6;
  EXPECT_TRUE(attention_flash_fits(B * H, T, C / H));
  EXPECT_TRUE(attention_flash_fits(1 * 12, 1024, 64));  // GPT-2 124M
  const auto qkv = random_vector(B * T * 3 * C, 8);
  const auto dout = random_vector(B * T * C, 9);
  std::vector<float> out(B * T * C), tiled_out(B * T * C), att(B * H * T * T), tiled_att(B * H * T * T);
  std::vector<float> dqkv(B * T * 3 * C), tiled_dqkv(B * T * 3 * C);
  flash::forward(out.data(), att.data(), qkv.data(), B, T, C, H);
  flash::backward(dqkv.data(), nullptr, dout.data(), qkv.data(), att.data(), B, T, C, H);
  attention_forward_tiled_bf16(tiled_out.data(), tiled_att.data(), qkv.data(), B, T, C, H);
  attention_backward_tiled_bf16(tiled_dqkv.data(), dout.data(), qkv.data(), tiled_att.data(), B, T, C, H);
  const std::vector<double> ref_out(tiled_out.begin(), tiled_out.end()), ref_dqkv(tiled_dqkv.begin(), tiled_dqkv.end());
  EXPECT_LT(error_of(out, ref_out).rms, 5e-4);  // measured 1.3e-4
  EXPECT_LT(error_of(dqkv, ref_dqkv).rms, 5e-4);  // measured 0.9e-4
}
#endif

}  // namespace
