// test_kernels.cpp — each backward kernel against central finite differences of its forward.
//
// Objective f = Σ out ⊙ R for a fixed random R, so df/dout = R is what the backward receives.
#include <gtest/gtest.h>

#include <cfloat>
#include <cmath>
#include <functional>
#include <vector>

#include "base/rng.hpp"
#include "kernels/attention.hpp"
#include "kernels/crossentropy.hpp"
#include "kernels/encoder.hpp"
#include "kernels/fastmath.hpp"
#include "kernels/gelu.hpp"
#include "kernels/layernorm.hpp"
#include "kernels/matmul.hpp"

using namespace zero3d;
using namespace zero3d::kernels;

namespace {

std::vector<float> random_vector(size_t n, uint64_t stream, float scale = 1.0f) {
  Rng rng(7, stream);
  std::vector<float> v(n);
  for (auto& x : v) x = static_cast<float>(scale * rng.normal());
  return v;
}

double dot(const std::vector<float>& a, const std::vector<float>& b) {
  double s = 0.0;
  for (size_t i = 0; i < a.size(); ++i) s += static_cast<double>(a[i]) * b[i];
  return s;
}

// Compares analytic[i] with (f(x+h) - f(x-h)) / 2h for up to `samples` evenly spread indices.
void expect_gradient(const char* what, std::vector<float>& x, const std::vector<float>& analytic,
                     const std::function<double()>& f, int samples = 48, float h = 1e-2f) {
  ASSERT_EQ(x.size(), analytic.size()) << what;
  const size_t stride = std::max<size_t>(1, x.size() / samples);
  for (size_t i = 0; i < x.size(); i += stride) {
    const float saved = x[i];
    x[i] = saved + h;
    const double up = f();
    x[i] = saved - h;
    const double down = f();
    x[i] = saved;
    const double numeric = (up - down) / (2.0 * h);
    EXPECT_NEAR(analytic[i], numeric, 2e-3 + 2e-2 * std::fabs(numeric)) << what << " element " << i;
  }
}

TEST(KernelGradients, MatmulBackwardMatchesFiniteDifferences) {
  const Index N = 6, IC = 5, OC = 7;
  auto inp = random_vector(N * IC, 1), w = random_vector(IC * OC, 2), b = random_vector(OC, 3);
  const auto R = random_vector(N * OC, 4);
  std::vector<float> out(N * OC);
  auto f = [&] {
    matmul_forward(out.data(), inp.data(), w.data(), b.data(), N, IC, OC);
    return dot(out, R);
  };
  std::vector<float> dinp(N * IC), dw(IC * OC, 0.0f), db(OC, 0.0f);
  matmul_backward(dinp.data(), dw.data(), db.data(), R.data(), inp.data(), w.data(), N, IC, OC);
  expect_gradient("dinp", inp, dinp, f);
  expect_gradient("dweight", w, dw, f);
  expect_gradient("dbias", b, db, f);
}

TEST(KernelGradients, MatmulBackwardAccumulatesParameterGradients) {
  const Index N = 3, IC = 2, OC = 4;
  auto inp = random_vector(N * IC, 5), w = random_vector(IC * OC, 6), dout = random_vector(N * OC, 7);
  std::vector<float> dinp(N * IC), dw(IC * OC, 0.0f), db(OC, 0.0f);
  matmul_backward(dinp.data(), dw.data(), db.data(), dout.data(), inp.data(), w.data(), N, IC, OC);
  const auto dw1 = dw, db1 = db;
  matmul_backward(dinp.data(), dw.data(), db.data(), dout.data(), inp.data(), w.data(), N, IC, OC);
  for (size_t i = 0; i < dw.size(); ++i) EXPECT_FLOAT_EQ(dw[i], 2.0f * dw1[i]);
  for (size_t i = 0; i < db.size(); ++i) EXPECT_FLOAT_EQ(db[i], 2.0f * db1[i]);
}

// Into a gradient window the store zeroed, the weight product writes instead of adding (fp32
// and bf16 products alike); the bias gradient still adds, and neither changes a bit.
TEST(KernelGradients, MatmulBackwardIntoAZeroedWindowGivesTheBitsOfAdding) {
  const Index N = 9, IC = 16, OC = 32;
  auto inp = random_vector(N * IC, 5), w = random_vector(IC * OC, 6), dout = random_vector(N * OC, 7);
  for (const DType compute : {DType::F32, DType::BF16}) {
    std::vector<float> dinp(N * IC), dw_added(IC * OC, 0.0f), db_added(OC, 0.0f);
    matmul_backward(dinp.data(), dw_added.data(), db_added.data(), dout.data(), inp.data(), w.data(), N, IC, OC, compute);
    std::vector<float> dw_written(IC * OC, 0.0f), db_written(OC, 0.0f);  // a zeroed window, as the store hands out
    matmul_backward(dinp.data(), dw_written.data(), db_written.data(), dout.data(), inp.data(), w.data(), N, IC, OC,
                    compute, /*add_dweight=*/false);
    EXPECT_EQ(dw_written, dw_added) << dtype_name(compute);
    EXPECT_EQ(db_written, db_added) << dtype_name(compute);
  }
}

TEST(KernelGradients, LayerNormBackwardMatchesFiniteDifferences) {
  const Index N = 5, C = 12;
  auto inp = random_vector(N * C, 8, 2.0f), w = random_vector(C, 9), b = random_vector(C, 10);
  const auto R = random_vector(N * C, 11);
  std::vector<float> out(N * C), mean(N), rstd(N);
  auto f = [&] {
    layernorm_forward(out.data(), mean.data(), rstd.data(), inp.data(), w.data(), b.data(), N, C);
    return dot(out, R);
  };
  f();
  std::vector<float> dinp(N * C, 0.0f), dw(C, 0.0f), db(C, 0.0f);
  layernorm_backward(dinp.data(), dw.data(), db.data(), R.data(), inp.data(), w.data(), mean.data(), rstd.data(), N, C);
  expect_gradient("dinp", inp, dinp, f);
  expect_gradient("dweight", w, dw, f);
  expect_gradient("dbias", b, db, f);
}

TEST(KernelGradients, GeluBackwardMatchesFiniteDifferences) {
  const Index n = 64;
  auto inp = random_vector(n, 12, 2.0f);
  const auto R = random_vector(n, 13);
  std::vector<float> out(n), dinp(n);
  auto f = [&] {
    gelu_forward(out.data(), inp.data(), n);
    return dot(out, R);
  };
  gelu_backward(dinp.data(), inp.data(), R.data(), n);
  expect_gradient("dinp", inp, dinp, f, 64, 1e-3f);
}

// The bf16 MLP's GELU (c_fc wrote bf16; its gradient goes to two bf16 products and c_fc's bias):
// forward and the fused backward against the tanh GELU in double. Each output is the reference
// rounded to bf16 — the fast exponential may move a value across a rounding boundary, so one
// bf16 step (2^-8 relative) is allowed; the bias gradient sums the unrounded values in fp32.
// 67 columns: four full vectors and a 3-lane tail per row.
TEST(KernelValues, Bf16GeluForwardAndFusedBackwardMatchTheTanhGelu) {
  const Index N = 5, OC = 67, n = N * OC;
  const auto x32 = random_vector(n, 21, 4.0f), dy = random_vector(n, 22);
  std::vector<bf16> x(n), y(n), dx(n);
  for (Index i = 0; i < n; ++i) x[i] = to_bf16(x32[i]);
  std::vector<float> sums(OC, 0.5f);
  gelu_forward(y.data(), x.data(), n);
  gelu_backward_summing_columns(dx.data(), sums.data(), x.data(), dy.data(), N, OC);
  std::vector<double> want_sums(OC, 0.5);
  for (Index i = 0; i < n; ++i) {
    const double v = to_float(x[i]), k = std::sqrt(2.0 / M_PI), u = k * (v + 0.044715 * v * v * v), t = std::tanh(u);
    const double gelu = 0.5 * v * (1.0 + t);
    const double grad = (0.5 * (1.0 + t) + 0.5 * v * (1.0 - t * t) * k * (1.0 + 3.0 * 0.044715 * v * v)) * dy[i];
    EXPECT_NEAR(to_float(y[i]), gelu, 1e-6 + std::abs(gelu) / 256) << i;
    // (the portable build's scalar tanh form is accurate to ~1e-7 absolute, which 1 - tanh² and
    // x·dy scale: the tolerance's first term)
    EXPECT_NEAR(to_float(dx[i]), grad, 1e-6 * (1.0 + std::abs(v * dy[i])) + std::abs(grad) / 256) << i;
    want_sums[i % OC] += grad;
  }
  for (Index o = 0; o < OC; ++o) EXPECT_NEAR(sums[o], want_sums[o], 1e-5) << o;
}

TEST(KernelGradients, CrossEntropyBackwardMatchesFiniteDifferences) {
  const Index N = 4, V = 9;
  auto logits = random_vector(N * V, 14, 2.0f);
  const std::vector<int32_t> targets = {3, 0, 8, 3};
  std::vector<float> losses(N), lse(N);
  auto f = [&] {
    crossentropy_forward(losses.data(), lse.data(), logits.data(), targets.data(), N, V, V);
    double s = 0.0;
    for (float l : losses) s += l;
    return s / N;
  };
  f();
  std::vector<float> grad = logits;
  crossentropy_backward(grad.data(), lse.data(), targets.data(), 1.0f / N, N, V, V);
  expect_gradient("dlogits", logits, grad, f, 36);
}

// A padded vocabulary (rows Vp apart, Vp − V columns past the real V, whatever the head's
// product wrote there): the real columns give the unpadded kernel's bits, the padding a zero gradient.
TEST(KernelGradients, CrossEntropyOverPaddedRowsIsTheUnpaddedOneWithZeroPaddingGradients) {
  const Index N = 5, V = 61, Vp = 64;
  const auto real = random_vector(N * V, 17, 3.0f);
  std::vector<float> padded(static_cast<size_t>(N * Vp), 1e4f);  // large logits: a leak would dominate the sum
  for (Index i = 0; i < N; ++i)
    for (Index v = 0; v < V; ++v) padded[i * Vp + v] = real[i * V + v];
  const std::vector<int32_t> targets = {60, 0, 17, 59, 3};
  std::vector<float> losses(N), lse(N), padded_losses(N), padded_lse(N);
  crossentropy_forward(losses.data(), lse.data(), real.data(), targets.data(), N, V, V);
  crossentropy_forward(padded_losses.data(), padded_lse.data(), padded.data(), targets.data(), N, V, Vp);
  std::vector<float> grad = real;
  crossentropy_backward(grad.data(), lse.data(), targets.data(), 0.25f, N, V, V);
  crossentropy_backward(padded.data(), padded_lse.data(), targets.data(), 0.25f, N, V, Vp);
  for (Index i = 0; i < N; ++i) {
    EXPECT_EQ(padded_losses[i], losses[i]) << "row " << i;
    EXPECT_EQ(padded_lse[i], lse[i]) << "row " << i;
    for (Index v = 0; v < V; ++v) EXPECT_EQ(padded[i * Vp + v], grad[i * V + v]) << "row " << i << " column " << v;
    for (Index v = V; v < Vp; ++v) EXPECT_EQ(padded[i * Vp + v], 0.0f) << "row " << i << " padding column " << v;
  }
}

// The fused classifier's backward writes the bf16 operand the head's products take: the bits of
// the fp32 gradient made in place and then converted, with the logits left as they were. Rows
// span three of the CPU form's 512-column pieces with targets at their edges; logits spread over
// ±50 give gradients down to fast_exp's floor, subnormal once scaled.
TEST(KernelGradients, CrossEntropyBackwardInBf16IsTheFp32GradientRounded) {
  const Index N = 6, V = 1100, Vp = 1152;
  const auto logits = random_vector(N * Vp, 18, 50.0f);
  const std::vector<int32_t> targets = {0, 511, 512, 1099, 1023, 700};
  std::vector<float> losses(N), lse(N);
  crossentropy_forward(losses.data(), lse.data(), logits.data(), targets.data(), N, V, Vp);
  const float dloss = 0.25f / N;
  std::vector<float> grad = logits;
  crossentropy_backward(grad.data(), lse.data(), targets.data(), dloss, N, V, Vp);
  std::vector<bf16> want(grad.size()), got(grad.size(), bf16{0x7FC0});  // NaN where nothing is written
  convert(want.data(), grad.data(), N * Vp);
  std::vector<float> kept = logits;
  crossentropy_backward_bf16(got.data(), kept.data(), lse.data(), targets.data(), dloss, N, V, Vp);
  int subnormal = 0;
  for (Index j = 0; j < N * Vp; ++j) {
    ASSERT_EQ(got[j].bits, want[j].bits) << "row " << j / Vp << " column " << j % Vp;
    if (grad[j] != 0.0f && std::fabs(grad[j]) < FLT_MIN) ++subnormal;
  }
  EXPECT_GT(subnormal, 0) << "the spread should reach subnormal gradients";
  EXPECT_EQ(kept, logits) << "the logits are only read";
}

TEST(KernelGradients, AttentionBackwardMatchesFiniteDifferencesAcrossRowBlocks) {
  // T = 70 spans a full row block of 64 and a ragged one of 6.
  const Index B = 1, T = 70, C = 8, H = 2;
  auto qkv = random_vector(B * T * 3 * C, 15);
  const auto R = random_vector(B * T * C, 16);
  std::vector<float> out(B * T * C), att(B * H * T * T), scratch(kRowBlock * T), dqkv(B * T * 3 * C);
  auto f = [&] {
    attention_forward(out.data(), att.data(), qkv.data(), B, T, C, H);
    return dot(out, R);
  };
  f();
  attention_backward(dqkv.data(), scratch.data(), R.data(), qkv.data(), att.data(), B, T, C, H);
  expect_gradient("dqkv", qkv, dqkv, f, 96);
}

TEST(KernelGradients, AttentionIsCausal) {
  const Index B = 1, T = 5, C = 4, H = 1;
  auto qkv = random_vector(T * 3 * C, 17);
  std::vector<float> out1(T * C), out2(T * C), att(T * T);
  attention_forward(out1.data(), att.data(), qkv.data(), B, T, C, H);
  for (Index c = 0; c < 3 * C; ++c) qkv[(T - 1) * 3 * C + c] += 1.0f;  // change only the last token
  attention_forward(out2.data(), att.data(), qkv.data(), B, T, C, H);
  for (Index i = 0; i < (T - 1) * C; ++i) EXPECT_FLOAT_EQ(out1[i], out2[i]) << "earlier position saw the future";
}

TEST(KernelGradients, EncoderBackwardSumsRepeatedTokens) {
  const Index B = 1, T = 3, C = 2;
  const std::vector<int32_t> tokens = {1, 1, 0};
  const std::vector<float> dout = {1, 2, 3, 4, 5, 6};
  std::vector<float> dwte(2 * C, 0.0f), dwpe(T * C, 0.0f);
  encoder_backward(dwte.data(), dwpe.data(), dout.data(), tokens.data(), B, T, C);
  EXPECT_EQ(dwte, (std::vector<float>{5, 6, 4, 6}));  // token 0: row 2; token 1: rows 0 + 1
  EXPECT_EQ(dwpe, dout);
}

}  // namespace

namespace {

TEST(FastMath, ExpIsWithinFourUlpOfLibmAcrossTheFloatRange) {
  for (float x = -87.0f; x < 88.0f; x += 0.01234f) {
    const double ref = std::exp(static_cast<double>(x));
    EXPECT_NEAR(fast_exp(x) / ref, 1.0, 5e-7) << "x = " << x;
  }
}

TEST(FastMath, TanhSaturatesAndMatchesLibm) {
  EXPECT_EQ(fast_tanh(100.0f), 1.0f);
  EXPECT_EQ(fast_tanh(-100.0f), -1.0f);
  for (float u = -10.0f; u < 10.0f; u += 0.0173f) EXPECT_NEAR(fast_tanh(u), std::tanh(u), 3e-7f) << "u = " << u;
}

}  // namespace
