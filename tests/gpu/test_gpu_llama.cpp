// test_gpu_llama.cpp — the `gpu` label's checks of the Llama family's kernels, as the build
// selects them (their device forms on a GPU build), at a Llama-3.2-1B-like layer (C 2048,
// head_dim 64, intermediate 8192, T 1024) with grouped-query attention and Mistral's sliding
// window, against plain double-precision loops on the host written here, independent of
// kernels/. On a CPU build they run only under ZERO3D_GPU_TESTS_ON_HOST=1 (gpu_test_main.cpp).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "gpu/gpu_test_support.hpp"
#include "kernels/attention.hpp"
#include "kernels/attention_gqa.hpp"
#include "kernels/device.hpp"
#include "kernels/encoder.hpp"
#include "kernels/rmsnorm.hpp"
#include "kernels/rope.hpp"
#include "kernels/swiglu.hpp"

namespace {

using namespace zero3d::kernels;
using namespace zero3d::gpu_test;

// A Llama-3.2-1B-like layer: hidden 2048, head_dim 64, intermediate 8192, 1024 positions.
constexpr Index kC = 2048, kT = 1024, kHeadDim = 64, kIntermediate = 8192;

// RMSNorm (eps 1e-5, Llama's): y = x / sqrt(mean(x²) + eps) · w, over 8 × 1024 rows of 2048;
// the backward adds into dinp (the residual stream's gradient, here starting at 1).
TEST(GpuLlamaKernels, RmsNormForwardAndBackwardMatchTheHost) {
  const Index N = 8 * kT, C = kC;
  const float eps = 1e-5f;
  const std::vector<float> x = normal(N * C, 1.0f, 31), w = normal(C, 0.3f, 32), dy = normal(N * C, 1.0f, 33);
  std::vector<double> out(N * C), dx(N * C), dw(C), rstd(N);
  for (Index i = 0; i < N; ++i) {
    double ss = 0;
    for (Index c = 0; c < C; ++c) ss += double(x[i * C + c]) * x[i * C + c];
    const double s = 1.0 / std::sqrt(ss / C + eps);
    rstd[i] = s;
    double dot = 0;  // Σ w·dy·x, for d/dx of x·s
    for (Index c = 0; c < C; ++c) {
      out[i * C + c] = x[i * C + c] * s * w[c];
      dw[c] += dy[i * C + c] * x[i * C + c] * s;
      dot += double(w[c]) * dy[i * C + c] * x[i * C + c];
    }
    for (Index c = 0; c < C; ++c)
      dx[i * C + c] = 1.0 + s * w[c] * dy[i * C + c] - s * s * s * x[i * C + c] * dot / C;
  }
  ModelArray<float> X(x), W(w), Dy(dy), Out(N * C), Rstd(N);
  ModelArray<float> Dx(std::vector<float>(N * C, 1.0f)), Dw(std::vector<float>(C, 0.0f));
  rmsnorm_forward(Out.data(), Rstd.data(), X.data(), W.data(), N, C, eps);
  rmsnorm_backward(Dx.data(), Dw.data(), Dy.data(), X.data(), W.data(), Rstd.data(), N, C);
  expect_close(Out.host(), out, 1e-5, 1e-6, "rmsnorm out");
  expect_close(Rstd.host(), rstd, 1e-5, 1e-7, "rmsnorm rstd");
  expect_close(Dx.host(), dx, 1e-4, 1e-5, "rmsnorm dinp");
  expect_close(Dw.host(), dw, 1e-4, 1e-3, "rmsnorm dweight");  // sums of 8192 rows
}

// Rotary embeddings in Hugging Face's rotate_half layout on a fused [q | k | v] row of 32 query
// and 8 K/V heads: q and k rotated by position·θ^(−2i/d) (θ 500000, Llama 3's), v untouched; the
// backward is the transposed rotation.
TEST(GpuLlamaKernels, RopeForwardAndBackwardMatchTheHost) {
  const Index B = 2, T = kT, H = 32, Hkv = 8, d = kHeadDim, half = d / 2, W = (H + 2 * Hkv) * d;
  std::vector<float> cos(T * half), sin(T * half);
  for (Index t = 0; t < T; ++t)
    for (Index i = 0; i < half; ++i) {
      const double angle = double(t) * std::pow(500000.0, -2.0 * double(i) / double(d));
      cos[t * half + i] = static_cast<float>(std::cos(angle));
      sin[t * half + i] = static_cast<float>(std::sin(angle));
    }
  const std::vector<float> qkv = normal(B * T * W, 1.0f, 34), dy = normal(B * T * W, 1.0f, 35);
  std::vector<double> out(qkv.begin(), qkv.end()), dx(dy.begin(), dy.end());
  for (Index bt = 0; bt < B * T; ++bt)
    for (Index h = 0; h < H + Hkv; ++h)  // q's heads, then k's; v's follow and stay
      for (Index i = 0; i < half; ++i) {
        const Index a = bt * W + h * d + i, b = a + half, t = bt % T;
        const double c = cos[t * half + i], s = sin[t * half + i];
        out[a] = qkv[a] * c - qkv[b] * s;
        out[b] = qkv[b] * c + qkv[a] * s;
        dx[a] = dy[a] * c + dy[b] * s;
        dx[b] = dy[b] * c - dy[a] * s;
      }
  ModelArray<float> Qkv(qkv), Dqkv(dy), Cos(cos), Sin(sin);
  rope_forward(Qkv.data(), Cos.data(), Sin.data(), B, T, H, Hkv, d);
  rope_backward(Dqkv.data(), Cos.data(), Sin.data(), B, T, H, Hkv, d);
  expect_close(Qkv.host(), out, 1e-6, 1e-6, "rope out");
  expect_close(Dqkv.host(), dx, 1e-6, 1e-6, "rope dqkv");
}

// SwiGLU on the fused [gate | up] rows of 2 × 8192: silu(gate)·up and its two gradients.
TEST(GpuLlamaKernels, SwigluForwardAndBackwardMatchTheHost) {
  const Index N = 2 * kT, I = kIntermediate, ld = 2 * I;
  const std::vector<float> gu = normal(N * ld, 2.0f, 36), dy = normal(N * I, 1.0f, 37);
  std::vector<double> out(N * I), dgu(N * ld);
  for (Index i = 0; i < N; ++i)
    for (Index c = 0; c < I; ++c) {
      const double g = gu[i * ld + c], u = gu[i * ld + I + c], s = 1.0 / (1.0 + std::exp(-g));
      out[i * I + c] = g * s * u;
      dgu[i * ld + c] = dy[i * I + c] * u * (s + g * s * (1 - s));
      dgu[i * ld + I + c] = dy[i * I + c] * g * s;
    }
  ModelArray<float> Gu(gu), Dy(dy), Out(N * I), Dgu(N * ld);
  swiglu_forward(Out.data(), Gu.data(), Gu.data() + I, N, I, ld);
  swiglu_backward(Dgu.data(), Dgu.data() + I, Dy.data(), Gu.data(), Gu.data() + I, N, I, ld);
  expect_close(Out.host(), out, 1e-5, 1e-6, "swiglu out");
  expect_close(Dgu.host(), dgu, 1e-5, 1e-6, "swiglu dgate, dup");
}

// Grouped-query causal attention on the host in double, written here from the definition (query
// head h reads K/V head h / (H/Hkv); key j visible to query i when j <= i and i − j < window):
// the output, the probabilities (zero where a key is not visible) and dqkv, K/V's gradients
// summed over each group's query heads. One batch row.
void host_gqa(const std::vector<float>& qkv, const std::vector<float>& dy, Index T, Index H, Index Hkv, Index d,
              Index window, std::vector<double>& out, std::vector<double>& att, std::vector<double>& dqkv) {
  const Index G = H / Hkv, W = (H + 2 * Hkv) * d, A = H * d;
  const double scale = 1.0 / std::sqrt(double(d));
  out.assign(T * A, 0.0), att.assign(H * T * T, 0.0), dqkv.assign(T * W, 0.0);
  std::vector<double> dp(T);
  for (Index h = 0; h < H; ++h) {
    const Index qo = h * d, ko = (H + h / G) * d, vo = (H + Hkv + h / G) * d;
    for (Index i = 0; i < T; ++i) {
      const Index j0 = window > 0 && i + 1 > window ? i + 1 - window : 0;
      double* p = att.data() + (h * T + i) * T;
      double mx = -1e300;
      for (Index j = j0; j <= i; ++j) {
        double s = 0;
        for (Index c = 0; c < d; ++c) s += double(qkv[i * W + qo + c]) * qkv[j * W + ko + c];
        mx = std::max(mx, p[j] = s * scale);
      }
      double sum = 0;
      for (Index j = j0; j <= i; ++j) sum += (p[j] = std::exp(p[j] - mx));
      for (Index j = j0; j <= i; ++j) p[j] /= sum;
      double dot = 0;
      for (Index j = j0; j <= i; ++j) {
        dp[j] = 0;
        for (Index c = 0; c < d; ++c) {
          out[i * A + qo + c] += p[j] * qkv[j * W + vo + c];
          dp[j] += double(dy[i * A + qo + c]) * qkv[j * W + vo + c];
        }
        dot += p[j] * dp[j];
      }
      for (Index j = j0; j <= i; ++j) {
        const double ds = p[j] * (dp[j] - dot) * scale;
        for (Index c = 0; c < d; ++c) {
          dqkv[i * W + qo + c] += ds * qkv[j * W + ko + c];
          dqkv[j * W + ko + c] += ds * qkv[i * W + qo + c];
          dqkv[j * W + vo + c] += p[j] * dy[i * A + qo + c];
        }
      }
    }
  }
}

// Grouped-query causal attention (8 query heads over 2 K/V heads, d 64, T 1024), without a
// window and with Mistral's sliding window of 300 keys: the output, the probabilities the
// backward reads and dqkv, against host_gqa.
TEST(GpuLlamaKernels, GroupedQueryAttentionWithAndWithoutAWindowMatchesTheHost) {
  const Index B = 1, T = kT, H = 8, Hkv = 2, d = kHeadDim, W = (H + 2 * Hkv) * d, A = H * d;
  const std::vector<float> qkv = normal(B * T * W, 1.0f, 38), dy = normal(B * T * A, 1.0f, 39);
  for (const Index window : {Index(0), Index(300)}) {
    std::vector<double> out, att, dqkv;
    host_gqa(qkv, dy, T, H, Hkv, d, window, out, att, dqkv);
    ModelArray<float> Qkv(qkv), Dy(dy), Out(T * A), Att(H * T * T), Dqkv(T * W), Scratch(kRowBlock * T);
    gqa_attention_forward(Out.data(), Att.data(), Qkv.data(), B, T, H, Hkv, d, window);
    gqa_attention_backward(Dqkv.data(), Scratch.data(), Dy.data(), Qkv.data(), Att.data(), B, T, H, Hkv, d, window);
    SCOPED_TRACE(window ? "sliding window 300" : "causal");
    expect_close(Out.host(), out, 1e-4, 1e-5, "gqa out");
    expect_close(Att.host(), att, 1e-4, 1e-6, "gqa probabilities");
    expect_close(Dqkv.host(), dqkv, 1e-3, 1e-4, "gqa dqkv");
  }
}

// The Llama family's bf16 attention as the build chooses it (bf16 products in causal query blocks;
// under ZERO3D_ATTENTION_KERNEL=flash the fused CUDA kernel with its groups and window, which
// benchmarks/gpu_check.sh runs with that filter): 8 query heads over 2 (Llama 3), over 8 (no
// groups) and over 1 (multi-query), head sizes 64 and 128, T 1000 (no multiple of the kernel's 64-row blocks), without a
// window and with windows of 300 and 40 (a query block whose first key block it does not see),
// against host_gqa on the bf16-rounded q, k, v and dY. What remains is the bf16 rounding of P and
// dS, as in GPT-2's bf16 check. Two backwards give the same bits (no atomics).
TEST(GpuAttention, Bf16GroupedQueryWithAWindowMatchesTheHostAndRepeatsItsBits) {
  struct Shape {
    Index H, Hkv, d, window;
  };
  const auto round_bf16 = [](float f) { return to_float(from_float<bf16>(f)); };
  const Index B = 1, T = 1000;
  for (const Shape& s : {Shape{8, 2, 64, 0}, Shape{8, 2, 64, 300}, Shape{8, 8, 128, 40}, Shape{8, 1, 128, 0}}) {
    const Index H = s.H, Hkv = s.Hkv, d = s.d, W = (H + 2 * Hkv) * d, A = H * d;
    std::vector<float> qkv = normal(T * W, 1.0f, 41), dy = normal(T * A, 1.0f, 42);
    for (float& x : qkv) x = round_bf16(x);
    for (float& x : dy) x = round_bf16(x);
    std::vector<double> out, att, dqkv;
    host_gqa(qkv, dy, T, H, Hkv, d, s.window, out, att, dqkv);
    std::vector<bf16> qkv16(qkv.size());
    for (size_t i = 0; i < qkv.size(); ++i) qkv16[i] = from_float<bf16>(qkv[i]);
    ModelArray<bf16> Qkv(qkv16);
    ModelArray<float> Dy(dy), Out(T * A), Att(gqa_attention_bf16_saved_floats(B * H, T, d)), Dqkv(T * W),
        Again(T * W), Scratch(kRowBlock * T);
    SCOPED_TRACE("H " + std::to_string(H) + " Hkv " + std::to_string(Hkv) + " d " + std::to_string(d) + " window " +
                 std::to_string(s.window) + (gqa_attention_flash_chosen(B * H, T, d) ? " (fused)" : " (portable)"));
    gqa_attention_forward(Out.data(), Att.data(), Qkv.data(), B, T, H, Hkv, d, s.window);
    expect_close(Out.host(), out, 1e-2, 1e-2, "bf16 gqa out");
    gqa_attention_backward(Dqkv.data(), Scratch.data(), Dy.data(), Qkv.data(), Att.data(), B, T, H, Hkv, d, s.window);
    expect_close(Dqkv.host(), dqkv, 3e-2, 3e-2, "bf16 gqa dqkv");
    gqa_attention_backward(Again.data(), Scratch.data(), Dy.data(), Qkv.data(), Att.data(), B, T, H, Hkv, d, s.window);
    EXPECT_TRUE(Dqkv.host() == Again.host()) << "a second backward changed bits";
  }
}

// The untied input embedding over a 128-word vocabulary (each row repeated ~64 times among
// 8192 positions): rows gathered, and the backward's sums in a fixed order (two runs, same bits).
TEST(GpuLlamaKernels, TokenEmbeddingForwardAndBackwardMatchTheHostAndRepeatBitForBit) {
  const Index N = 8 * kT, C = kC, V = 128;
  const std::vector<float> w = normal(V * C, 0.02f, 40), dy = normal(N * C, 1.0f, 41);
  std::vector<int32_t> tok(N);
  std::mt19937 rng(42);
  for (int32_t& t : tok) t = static_cast<int32_t>(rng() % V);
  std::vector<double> out(N * C), dw(V * C);
  for (Index i = 0; i < N; ++i)
    for (Index c = 0; c < C; ++c) {
      out[i * C + c] = w[tok[i] * C + c];
      dw[tok[i] * C + c] += dy[i * C + c];
    }
  ModelArray<float> Wt(w), Dy(dy), Out(N * C);
  ModelArray<int32_t> Tok(tok);
  token_embedding_forward(Out.data(), Tok.data(), Wt.data(), N, C);
  expect_close(Out.host(), out, 0, 0, "embedding rows");
  std::vector<float> first;
  for (int run = 0; run < 2; ++run) {
    ModelArray<float> Dw(std::vector<float>(V * C, 0.0f));
    token_embedding_backward(Dw.data(), Dy.data(), Tok.data(), 0, V, N, C);
    const std::vector<float> got = Dw.host();
    expect_close(got, dw, 1e-4, 1e-4, "embedding dweight");
    if (run == 0) first = got;
    else EXPECT_TRUE(got == first) << "token_embedding_backward's sums differ between two runs";
  }
}

}  // namespace
