// test_gpu_kernels.cpp — the `gpu` label's kernel checks: each kernel, as the build selects it
// (its device form on a GPU build), on model memory at GPT-2 124M shapes (C 768, H 12, T 1024,
// V 50257), against a plain double-precision loop on the host written here, independent of
// kernels/. On a CPU build they run only under ZERO3D_GPU_TESTS_ON_HOST=1 (gpu_test_main.cpp),
// which holds these references against the CPU kernels.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "gpu/gpu_test_support.hpp"
#include "kernels/attention.hpp"
#include "kernels/crossentropy.hpp"
#include "kernels/device.hpp"
#include "kernels/elementwise.hpp"
#include "kernels/encoder.hpp"
#include "kernels/gelu.hpp"
#include "kernels/gemm.hpp"
#include "kernels/layernorm.hpp"
#include "kernels/memory.hpp"
#include "kernels/optimizers.hpp"
#include "kernels/reduce.hpp"

namespace {

using namespace zero3d;
using namespace zero3d::kernels;
using namespace zero3d::gpu_test;

constexpr Index kC = 768, kH = 12, kT = 1024, kV = 50257;

// Layer norm (eps 1e-5) forward and backward, B·T 8 × 1024 rows of 768.
TEST(GpuKernels, LayerNormForwardAndBackwardMatchTheHostAtGpt2Shapes) {
  const Index N = 8 * kT, C = kC;
  const std::vector<float> x = normal(N * C, 1.0f, 1), w = normal(C, 0.2f, 2), b = normal(C, 0.1f, 3),
                           dy = normal(N * C, 1.0f, 4);
  std::vector<double> out(N * C), dx(N * C), dw(C), db(C);
  std::vector<double> mean(N), rstd(N);
  for (Index i = 0; i < N; ++i) {
    double m = 0, v = 0;
    for (Index c = 0; c < C; ++c) m += x[i * C + c];
    m /= C;
    for (Index c = 0; c < C; ++c) v += (x[i * C + c] - m) * (x[i * C + c] - m);
    const double s = 1.0 / std::sqrt(v / C + 1e-5);
    mean[i] = m, rstd[i] = s;
    double g_mean = 0, g_norm_mean = 0;
    for (Index c = 0; c < C; ++c) {
      const double norm = (x[i * C + c] - m) * s;
      out[i * C + c] = norm * w[c] + b[c];
      g_mean += w[c] * dy[i * C + c];
      g_norm_mean += w[c] * dy[i * C + c] * norm;
      dw[c] += dy[i * C + c] * norm;
      db[c] += dy[i * C + c];
    }
    g_mean /= C, g_norm_mean /= C;
    for (Index c = 0; c < C; ++c) {
      const double norm = (x[i * C + c] - m) * s;
      dx[i * C + c] = 1.0 + (w[c] * dy[i * C + c] - g_mean - norm * g_norm_mean) * s;  // dinp starts at 1
    }
  }
  ModelArray<float> X(x), W(w), Bi(b), Dy(dy), Out(N * C), Mean(N), Rstd(N);
  ModelArray<float> Dx(std::vector<float>(N * C, 1.0f)), Dw(std::vector<float>(C, 0.0f)), Db(std::vector<float>(C, 0.0f));
  layernorm_forward(Out.data(), Mean.data(), Rstd.data(), X.data(), W.data(), Bi.data(), N, C);
  layernorm_backward(Dx.data(), Dw.data(), Db.data(), Dy.data(), X.data(), W.data(), Mean.data(), Rstd.data(), N, C);
  expect_close(Out.host(), out, 1e-5, 1e-5, "layernorm out");
  expect_close(Mean.host(), mean, 1e-5, 1e-6, "layernorm mean");
  expect_close(Rstd.host(), rstd, 1e-5, 1e-6, "layernorm rstd");
  expect_close(Dx.host(), dx, 1e-4, 1e-5, "layernorm dinp");
  expect_close(Dw.host(), dw, 1e-4, 1e-3, "layernorm dweight");  // sums of 8192 rows
  expect_close(Db.host(), db, 1e-4, 1e-3, "layernorm dbias");
}

// GPT-2's tanh GELU over the MLP's 8·1024 × 3072 activations, and its derivative.
TEST(GpuKernels, GeluForwardAndBackwardMatchTheHost) {
  const Index n = 8 * kT * 4 * kC;
  const std::vector<float> x = normal(n, 2.0f, 5), dy = normal(n, 1.0f, 6);
  std::vector<double> out(n), dx(n);
  const double k = std::sqrt(2.0 / M_PI);
  for (Index i = 0; i < n; ++i) {
    const double u = k * (x[i] + 0.044715 * x[i] * x[i] * x[i]), t = std::tanh(u);
    out[i] = 0.5 * x[i] * (1 + t);
    dx[i] = (0.5 * (1 + t) + 0.5 * x[i] * (1 - t * t) * k * (1 + 3 * 0.044715 * x[i] * x[i])) * dy[i];
  }
  ModelArray<float> X(x), Dy(dy), Out(n), Dx(n);
  gelu_forward(Out.data(), X.data(), n);
  gelu_backward(Dx.data(), X.data(), Dy.data(), n);
  expect_close(Out.host(), out, 1e-5, 1e-6, "gelu out");
  expect_close(Dx.host(), dx, 1e-4, 1e-5, "gelu dinp");
}

// The classifier's loss over the 50,257-word vocabulary: 1024 rows, Vp apart: unpadded, and
// padded to 50,304 (model.make_vocab_size_divisible_by 128, the GPU build's default), whose
// padding columns hold logits the loss must ignore and get a zero gradient.
TEST(GpuKernels, CrossEntropyForwardAndBackwardMatchTheHostOverGpt2sVocabulary) {
  const Index N = 1024, V = kV;
  for (const Index Vp : {kV, Index{50304}}) {
    const std::vector<float> z = normal(N * Vp, 3.0f, 7);
    const std::vector<int32_t> t = tokens(N, static_cast<int32_t>(V), 8);
    const float dloss = 1.0f / N;
    std::vector<double> loss(N), dz(N * Vp, 0.0);
    for (Index i = 0; i < N; ++i) {
      const float* zi = z.data() + i * Vp;
      double mx = zi[0];
      for (Index v = 1; v < V; ++v) mx = std::max<double>(mx, zi[v]);
      double sum = 0;
      for (Index v = 0; v < V; ++v) sum += std::exp(zi[v] - mx);
      const double lse = mx + std::log(sum);
      loss[i] = lse - zi[t[i]];
      for (Index v = 0; v < V; ++v) dz[i * Vp + v] = std::exp(zi[v] - lse) * dloss;
      dz[i * Vp + t[i]] -= dloss;
    }
    const std::string at = " (rows " + std::to_string(Vp) + " apart)";
    ModelArray<float> Z(z), Loss(N), Lse(N);
    ModelArray<int32_t> Tg(t);
    crossentropy_forward(Loss.data(), Lse.data(), Z.data(), Tg.data(), N, V, Vp);
    expect_close(Loss.host(), loss, 1e-5, 1e-5, ("crossentropy losses" + at).c_str());
    // the fused classifier's bf16 gradient (logits only read): rounding to bf16 moves a value by
    // half a step, up to 2⁻⁸ of it (at the bottom of a binade)
    ModelArray<bf16> D(N * Vp);
    crossentropy_backward_bf16(D.data(), Z.data(), Lse.data(), Tg.data(), dloss, N, V, Vp);
    const std::vector<bf16> d16 = D.host();
    std::vector<float> d32(d16.size());
    for (size_t j = 0; j < d16.size(); ++j) d32[j] = to_float(d16[j]);
    expect_close(d32, dz, std::ldexp(1.0, -8) + 1e-4, 1e-10, ("crossentropy dlogits in bf16" + at).c_str());
    crossentropy_backward(Z.data(), Lse.data(), Tg.data(), dloss, N, V, Vp);
    expect_close(Z.host(), dz, 1e-4, 1e-10, ("crossentropy dlogits" + at).c_str());
  }
}

// A GPU's bf16 step keeps bf16 logits (model/bf16_activations.hpp logits_bf16): the loss of them,
// and their gradient written over them, against double loops on their widened values.
TEST(GpuKernels, CrossEntropyOfBf16LogitsAndItsGradientInPlaceMatchTheHost) {
  const Index N = 1024, V = kV, Vp = 50304;
  std::vector<bf16> z16(static_cast<size_t>(N * Vp));
  const std::vector<float> z32 = normal(N * Vp, 3.0f, 13);
  for (size_t j = 0; j < z16.size(); ++j) z16[j] = to_bf16(z32[j]);
  const std::vector<int32_t> t = tokens(N, static_cast<int32_t>(V), 14);
  const float dloss = 1.0f / N;
  std::vector<double> loss(N), dz(N * Vp, 0.0);
  for (Index i = 0; i < N; ++i) {
    const bf16* zi = z16.data() + i * Vp;
    double mx = to_float(zi[0]);
    for (Index v = 1; v < V; ++v) mx = std::max<double>(mx, to_float(zi[v]));
    double sum = 0;
    for (Index v = 0; v < V; ++v) sum += std::exp(to_float(zi[v]) - mx);
    const double lse = mx + std::log(sum);
    loss[i] = lse - to_float(zi[t[i]]);
    for (Index v = 0; v < V; ++v) dz[i * Vp + v] = std::exp(to_float(zi[v]) - lse) * dloss;
    dz[i * Vp + t[i]] -= dloss;
  }
  ModelArray<bf16> Z(z16);
  ModelArray<float> Loss(N), Lse(N);
  ModelArray<int32_t> Tg(t);
  crossentropy_forward(Loss.data(), Lse.data(), static_cast<const bf16*>(Z.data()), Tg.data(), N, V, Vp);
  expect_close(Loss.host(), loss, 1e-5, 1e-5, "crossentropy losses of bf16 logits");
  crossentropy_backward_bf16(Z.data(), static_cast<const bf16*>(Z.data()), Lse.data(), Tg.data(), dloss, N, V, Vp);
  const std::vector<bf16> d16 = Z.host();
  std::vector<float> d32(d16.size());
  for (size_t j = 0; j < d16.size(); ++j) d32[j] = to_float(d16[j]);
  expect_close(d32, dz, std::ldexp(1.0, -8) + 1e-4, 1e-10, "crossentropy dlogits written over bf16 logits");
}

// Token and position embeddings; the backward adds every row of a repeated token (a 64-word
// vocabulary over 8192 positions repeats each ~128 times) in a fixed order: two runs, same bits.
TEST(GpuKernels, EncoderForwardAndBackwardMatchTheHostAndRepeatBitForBit) {
  const Index B = 8, T = kT, C = kC, V = 64;
  const std::vector<float> wte = normal(V * C, 0.02f, 9), wpe = normal(T * C, 0.01f, 10), dy = normal(B * T * C, 1.0f, 11);
  const std::vector<int32_t> tok = tokens(B * T, static_cast<int32_t>(V), 12);
  std::vector<double> out(B * T * C), dwte(V * C), dwpe(T * C);
  for (Index bt = 0; bt < B * T; ++bt)
    for (Index c = 0; c < C; ++c) {
      out[bt * C + c] = double(wte[tok[bt] * C + c]) + wpe[(bt % T) * C + c];
      dwte[tok[bt] * C + c] += dy[bt * C + c];
      dwpe[(bt % T) * C + c] += dy[bt * C + c];
    }
  ModelArray<float> Wte(wte), Wpe(wpe), Dy(dy), Out(B * T * C);
  ModelArray<int32_t> Tok(tok);
  encoder_forward(Out.data(), Tok.data(), Wte.data(), Wpe.data(), B, T, C);
  expect_close(Out.host(), out, 1e-6, 1e-7, "encoder out");
  std::vector<float> first;
  for (int run = 0; run < 2; ++run) {
    ModelArray<float> Dwte(std::vector<float>(V * C, 0.0f)), Dwpe(std::vector<float>(T * C, 0.0f));
    encoder_backward(Dwte.data(), Dwpe.data(), Dy.data(), Tok.data(), B, T, C);
    const std::vector<float> got = Dwte.host();
    expect_close(got, dwte, 1e-4, 1e-4, "encoder dwte");
    expect_close(Dwpe.host(), dwpe, 1e-5, 1e-5, "encoder dwpe");
    if (run == 0) first = got;
    else EXPECT_TRUE(got == first) << "encoder_backward's sums differ between two runs";
  }
}

// AdamW over 16 M parameters (weight decay 0.01, step 3). The reference takes the coefficients
// as the kernel holds them (fp32 β and 1 − β): m's two terms nearly cancel where g opposes m, so
// each element's tolerance is a few fp32 roundings of its terms, not of the result.
TEST(GpuKernels, AdamWUpdateMatchesTheHost) {
  const Index n = Index(1) << 24;
  const std::vector<float> p = normal(n, 0.02f, 13), g = normal(n, 1e-3f, 14), m = normal(n, 1e-4f, 15);
  std::vector<float> v = normal(n, 1e-6f, 16);
  for (float& x : v) x = std::fabs(x);
  const double lr = 1e-3, eps = 1e-8, wd = 0.01;
  const float b1 = 0.9f, b2 = 0.999f, omb1 = 1.0f - b1, omb2 = 1.0f - b2;
  const int step = 3;
  const double bc1 = 1 - std::pow(double(b1), step), bc2 = 1 - std::pow(double(b2), step);
  ModelArray<float> P(p), G(g), M(m), Vs(v);
  adam_update(P.data(), G.data(), M.data(), Vs.data(), n, make_adam_step(lr, b1, b2, eps, wd, step, true, true));
  const std::vector<float> p_got = P.host(), m_got = M.host(), v_got = Vs.host();
  constexpr double kRounding = 4 * 6e-8;  // a few fp32 roundings, relative to the terms
  for (Index i = 0; i < n; ++i) {
    const double m2 = double(b1) * m[i] + double(omb1) * g[i], v2 = double(b2) * v[i] + double(omb2) * g[i] * g[i];
    const double p2 = p[i] - lr * (m2 / bc1 / (std::sqrt(v2 / bc2) + eps) + wd * p[i]);
    ASSERT_LE(std::fabs(m_got[i] - m2), kRounding * (b1 * std::fabs(m[i]) + omb1 * std::fabs(g[i]))) << "m[" << i << "]";
    ASSERT_LE(std::fabs(v_got[i] - v2), kRounding * (b2 * v[i] + omb2 * g[i] * g[i])) << "v[" << i << "]";
    ASSERT_LE(std::fabs(p_got[i] - p2), kRounding * (std::fabs(p[i]) + lr * (1e3 + wd))) << "params[" << i << "]";
  }
}

// The copy stream ZeRO-Offload's gradients take beside the CPU optimizer: a copy queued right after
// kernels (64 Mi floats, still running when it is queued) reads what they wrote, since it waits
// on the compute stream's work and not on the host; the copy back to the device lands before the
// next kernel that reads it once wait() has returned. Page-locked host memory, both directions.
TEST(GpuCopyStream, CopiesFollowTheComputeStreamsWorkInBothDirections) {
  const Index n = Index(1) << 26;
  const std::vector<float> x = normal(n, 1.0f, 51);
  ModelArray<float> X(x), Y(n);
  HostBuffer pinned("test_copy_stream", static_cast<size_t>(n) * sizeof(float), /*pinned=*/true);
  CopyStream copies;
  for (int round = 0; round < 3; ++round) add_into(Y.data(), X.data(), n);  // Y = 3·X, queued
  copies.to_host(pinned.data(), Y.data(), static_cast<size_t>(n) * sizeof(float));
  copies.wait();
  const float* got = reinterpret_cast<const float*>(pinned.data());
  for (Index i = 0; i < n; ++i) ASSERT_EQ(got[i], x[i] + x[i] + x[i]) << "element " << i << " copied before it was summed";
  float* host = reinterpret_cast<float*>(pinned.data());
  for (Index i = 0; i < n; ++i) host[i] = -x[i];
  copies.to_device(Y.data(), pinned.data(), static_cast<size_t>(n) * sizeof(float));
  copies.wait();
  add_into(Y.data(), X.data(), n);  // -X + X
  const std::vector<float> zero = Y.host();
  for (Index i = 0; i < n; ++i) ASSERT_EQ(zero[i], 0.0f) << "element " << i;
}

// The gradient norm's Σ g² over GPT-2 124M's 124,439,808 parameters, accumulated in double.
TEST(GpuKernels, SumOfSquaresOverGpt2sParametersMatchesTheHostInDouble) {
  const Index n = 124439808;
  const std::vector<float> g = normal(n, 1e-2f, 17);
  double want = 0;
  for (float x : g) want += double(x) * x;
  ModelArray<float> G(g);
  const double got = sum_of_squares(G.data(), n);
  EXPECT_NEAR(got, want, 1e-10 * want);
  EXPECT_EQ(sum_of_squares(G.data(), n), got) << "two reductions of the same data differ";
}

// c_attn's product at GPT-2 shapes, fp32 and bf16, with the bias in the epilogue: 64 sampled
// rows of C[8192, 2304] = X[8192, 768] · W[768, 2304] + b against the host (bf16: on the
// operands and the fp32 bias rounded as the product rounds them).
TEST(GpuProducts, ForwardProductWithBiasMatchesTheHostInFp32AndBf16) {
  const Index M = 8 * kT, K = kC, N = 3 * kC;
  const std::vector<float> x = normal(M * K, 1.0f, 18), w = normal(K * N, 0.02f, 19), b = normal(N, 0.1f, 20);
  const auto round_bf16 = [](float f) {  // round to nearest even, as the conversions do
    uint32_t u;
    std::memcpy(&u, &f, 4);
    u = (u + 0x7fff + ((u >> 16) & 1)) & 0xffff0000u;
    std::memcpy(&f, &u, 4);
    return f;
  };
  ModelArray<float> X(x), W(w), Bi(b), Out(M * N);
  for (DType compute : {DType::F32, DType::BF16}) {
    gemm(M, N, K, GemmOperand{X.data(), DType::F32, false, K}, GemmOperand{W.data(), DType::F32, false, N}, Out.data(),
         N, false, compute, Bi.data(), DType::F32);
    const std::vector<float> got = Out.host();
    for (Index r = 0; r < M; r += M / 64) {
      std::vector<float> row(got.begin() + r * N, got.begin() + (r + 1) * N);
      std::vector<double> want(N);
      for (Index j = 0; j < N; ++j) {
        double acc = compute == DType::BF16 ? round_bf16(b[j]) : b[j];  // gemm.hpp: an fp32 bias joins in the product's dtype
        for (Index k = 0; k < K; ++k)
          acc += compute == DType::BF16 ? double(round_bf16(x[r * K + k])) * round_bf16(w[k * N + j])
                                        : double(x[r * K + k]) * w[k * N + j];
        want[j] = acc;
      }
      // TF32 is never allowed for fp32 (cuBLASLt's compute type is 32F); bf16 products sum in fp32.
      expect_close(row, want, compute == DType::BF16 ? 1e-3 : 1e-5, 1e-4,
                   compute == DType::BF16 ? "bf16 product" : "fp32 product");
    }
  }
}

// softmax(q·kᵀ/√hs)·v over causal rows, and its gradient, in double: out [B][T][C] and dqkv
// [B][T][3C] from qkv [B][T][3C] and dY [B][T][C].
void host_attention(const std::vector<float>& qkv, const std::vector<float>& dy, Index B, Index T, Index C, Index H,
                    std::vector<double>& out, std::vector<double>& dqkv) {
  const Index hs = C / H, C3 = 3 * C;
  const double scale = 1.0 / std::sqrt(double(hs));
  out.assign(B * T * C, 0.0);
  dqkv.assign(B * T * C3, 0.0);
  std::vector<double> p(T * T), dp(T);
  for (Index b = 0; b < B; ++b)
    for (Index h = 0; h < H; ++h) {
      const float* x = qkv.data() + b * T * C3;
      const float* g = dy.data() + b * T * C;
      double* o = out.data() + b * T * C;
      double* dx = dqkv.data() + b * T * C3;
      const auto q = [&](Index t, Index d) { return double(x[t * C3 + h * hs + d]); };
      const auto k = [&](Index t, Index d) { return double(x[t * C3 + C + h * hs + d]); };
      const auto v = [&](Index t, Index d) { return double(x[t * C3 + 2 * C + h * hs + d]); };
      for (Index i = 0; i < T; ++i) {
        double mx = -1e300;
        for (Index j = 0; j <= i; ++j) {
          double s = 0;
          for (Index d = 0; d < hs; ++d) s += q(i, d) * k(j, d);
          p[i * T + j] = s * scale;
          mx = std::max(mx, p[i * T + j]);
        }
        double sum = 0;
        for (Index j = 0; j <= i; ++j) sum += (p[i * T + j] = std::exp(p[i * T + j] - mx));
        for (Index j = 0; j <= i; ++j) p[i * T + j] /= sum;
        for (Index d = 0; d < hs; ++d) {
          double acc = 0;
          for (Index j = 0; j <= i; ++j) acc += p[i * T + j] * v(j, d);
          o[i * C + h * hs + d] = acc;
        }
        // dP = dY·Vᵀ; dS = P ∘ (dP − Σ P·dP); dQ = scale·dS·K; dK += scale·dSᵀ·Q; dV += Pᵀ·dY
        double dot = 0;
        for (Index j = 0; j <= i; ++j) {
          dp[j] = 0;
          for (Index d = 0; d < hs; ++d) dp[j] += g[i * C + h * hs + d] * v(j, d);
          dot += p[i * T + j] * dp[j];
        }
        for (Index j = 0; j <= i; ++j) {
          const double ds = p[i * T + j] * (dp[j] - dot) * scale;
          for (Index d = 0; d < hs; ++d) {
            dx[i * C3 + h * hs + d] += ds * k(j, d);
            dx[j * C3 + C + h * hs + d] += ds * q(i, d);
            dx[j * C3 + 2 * C + h * hs + d] += p[i * T + j] * g[i * C + h * hs + d];
          }
        }
      }
    }
}

// Causal attention in fp32, B 1, T 1024, C 768, H 12: the output, the probabilities the
// backward reads, and dqkv against a host reference of softmax(q·kᵀ/√hs)·v and its gradient.
TEST(GpuAttention, Fp32ForwardAndBackwardMatchTheHostAtGpt2Shapes) {
  const Index B = 1, T = kT, C = kC, H = kH, C3 = 3 * C;
  const std::vector<float> qkv = normal(B * T * C3, 1.0f, 21), dy = normal(B * T * C, 1.0f, 22);
  std::vector<double> out, dqkv;
  host_attention(qkv, dy, B, T, C, H, out, dqkv);
  ModelArray<float> Qkv(qkv), Dy(dy), Out(B * T * C), Att(B * H * T * T), Dqkv(B * T * C3), Scratch(64 * T);
  attention_forward(Out.data(), Att.data(), Qkv.data(), B, T, C, H);
  expect_close(Out.host(), out, 1e-4, 1e-5, "attention out");
  attention_backward(Dqkv.data(), Scratch.data(), Dy.data(), Qkv.data(), Att.data(), B, T, C, H);
  expect_close(Dqkv.host(), dqkv, 1e-3, 1e-4, "attention dqkv");
}

// Causal attention with bf16 products, as the build chooses it (the CPU's fused AVX512-BF16 or
// tiled kernel; on a GPU one tile of T in causal query blocks, or the fused CUDA kernel under
// ZERO3D_ATTENTION_KERNEL=flash, which benchmarks/gpu_check.sh runs too): at GPT-2's head size 64
// (B 2, T 1024) and 128 with a T that is no multiple of 64, against the host reference on the
// bf16-rounded q, k, v and dY. What remains is the bf16 rounding of P and dS (2⁻⁹ relative),
// summed over up to T keys. Two runs give the same bits (no atomics).
TEST(GpuAttention, Bf16ForwardAndBackwardMatchTheHostAndRepeatTheirBits) {
  struct Shape {
    Index B, T, C, H;
  };
  const auto round_bf16 = [](float f) { return to_float(from_float<bf16>(f)); };
  for (const Shape& s : {Shape{2, kT, kC, kH}, Shape{1, 1000, 512, 4}}) {
    const Index B = s.B, T = s.T, C = s.C, H = s.H, C3 = 3 * C;
    std::vector<float> qkv = normal(B * T * C3, 1.0f, 23), dy = normal(B * T * C, 1.0f, 24);
    for (float& x : qkv) x = round_bf16(x);
    for (float& x : dy) x = round_bf16(x);
    std::vector<double> out, dqkv;
    host_attention(qkv, dy, B, T, C, H, out, dqkv);
    ModelArray<float> Qkv(qkv), Dy(dy), Out(B * T * C), Att(B * H * T * T), Dqkv(B * T * C3), Again(B * T * C3);
    attention_forward(Out.data(), Att.data(), Qkv.data(), B, T, C, H, DType::BF16);
    expect_close(Out.host(), out, 1e-2, 1e-2, "bf16 attention out");
    attention_backward(Dqkv.data(), nullptr, Dy.data(), Qkv.data(), Att.data(), B, T, C, H, DType::BF16);
    expect_close(Dqkv.host(), dqkv, 3e-2, 3e-2, "bf16 attention dqkv");
    attention_backward(Again.data(), nullptr, Dy.data(), Qkv.data(), Att.data(), B, T, C, H, DType::BF16);
    EXPECT_TRUE(Dqkv.host() == Again.host()) << "T " << T << ": a second backward changed bits";
  }
}

}  // namespace
