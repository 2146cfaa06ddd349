// test_kernels_device_forms.cpp — each row or column kernel's device form (namespace gpu, what a
// GPU build runs) against the CPU form on the same inputs, here on Kokkos Serial, and two runs of
// each device form that adds across threads (rows, columns, sorted runs, the norm) against each
// other bit for bit (no atomics: runs are deterministic). Element-wise forms, one value a thread,
// have no order to vary.
//
// Where the forms add in the same order (element-wise work, the embedding gradients, plain column sums
// of at most one chunk of rows) they must agree bit for bit; where the device form adds in another
// order (a row's reduction in lane-strided pieces, column sums in chunks) each tolerance says why.
// On a GPU build the plain names are the device forms themselves, so there only the run-to-run
// checks say something; the CPU comparison is this build's.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "base/rng.hpp"
#include "kernels/crossentropy.hpp"
#include "kernels/encoder.hpp"
#include "kernels/gelu.hpp"
#include "kernels/half.hpp"
#include "kernels/layernorm.hpp"
#include "kernels/matmul.hpp"
#include "kernels/reduce.hpp"
#include "kernels/vocab_parallel.hpp"
#include "support/model_memory.hpp"

using namespace zero3d;
using namespace zero3d::kernels;

namespace {

using test_support::Buffer;
using test_support::ShiftedPointer;
using test_support::expect_close;
using test_support::expect_same_bits;
using test_support::value;

std::vector<float> random_vector(size_t n, uint64_t stream, float scale = 1.0f, float shift = 0.0f) {
  return test_support::normal_vector(31, n, stream, scale, shift);
}

std::vector<bf16> rounded(const std::vector<float>& x) {
  std::vector<bf16> out(x.size());
  for (size_t i = 0; i < x.size(); ++i) out[i] = to_bf16(x[i]);
  return out;
}

std::string shape(Index rows, Index cols) { return " [" + std::to_string(rows) + " x " + std::to_string(cols) + "]"; }

// LayerNorm rows of a non-zero mean (as a residual stream has), parameters P, output O; `shifted`
// names the one pointer that starts off a 16-byte boundary (0 out, 1 inp, 2 weight, 3 bias; -1 none).
template <typename P, typename O>
void check_layernorm_forward(Index N, Index C, int shifted = -1) {
  const ShiftedPointer shift{shifted};
  const std::string at = shape(N, C) + shift.label();
  const auto x = random_vector(N * C, 1, 1.0f, 0.5f), w32 = random_vector(C, 2, 0.2f, 1.0f);
  const auto b32 = random_vector(C, 3, 0.1f);
  std::vector<P> w(C), b(C);
  for (Index c = 0; c < C; ++c) w[c] = from_float<P>(w32[c]), b[c] = from_float<P>(b32[c]);
  Buffer<float> in(x, shift(1));
  Buffer<P> weight(w, shift(2)), bias(b, shift(3));
  auto run = [&](bool device) {
    Buffer<O> out(N * C, shift(0));
    Buffer<float> mean(N), rstd(N);
    if (device) gpu::layernorm_forward(out.data(), mean.data(), rstd.data(), in.data(), weight.data(), bias.data(), N, C);
    else layernorm_forward(out.data(), mean.data(), rstd.data(), in.data(), weight.data(), bias.data(), N, C);
    return std::make_tuple(out.host(), mean.host(), rstd.host());
  };
  const auto [out, mean, rstd] = run(true);
  const auto [cpu_out, cpu_mean, cpu_rstd] = run(false);
  // A row's C terms are added in another order (here one at a time, the host's single lane; the
  // CPU form in SIMD pieces): the mean moves by a few ulp of Σ|x|/C (~1.2), rstd by a few ulp of
  // itself, the output by those through (x - m)·s, and a bf16 rounding may flip (one bf16 ulp).
  expect_close("mean" + at, mean, cpu_mean, 2e-6, 0.0);
  expect_close("rstd" + at, rstd, cpu_rstd, 0.0, 2e-6);
  const double out_rel = std::is_same_v<O, bf16> ? 1.0 / 128 : 0.0;  // a bf16 ulp is at most 2⁻⁷ relative
  expect_close("out" + at, out, cpu_out, 2e-5, out_rel);
  const auto [again_out, again_mean, again_rstd] = run(true);
  expect_same_bits("out, second run" + at, again_out, out);
  expect_same_bits("mean, second run" + at, again_mean, mean);
  expect_same_bits("rstd, second run" + at, again_rstd, rstd);
}

// `shifted`: the one pointer off a 16-byte boundary (0 dinp, 1 dweight, 2 dbias, 3 dout, 4 inp,
// 5 weight; -1 none).
template <typename P>
void check_layernorm_backward(Index N, Index C, int shifted = -1) {
  const ShiftedPointer shift{shifted};
  const std::string at = shape(N, C) + shift.label();
  const auto x = random_vector(N * C, 4, 1.0f, 0.5f), dy = random_vector(N * C, 5), w32 = random_vector(C, 6, 0.2f, 1.0f);
  std::vector<P> w(C);
  for (Index c = 0; c < C; ++c) w[c] = from_float<P>(w32[c]);
  const auto dx0 = random_vector(N * C, 7), dw0 = random_vector(C, 8), db0 = random_vector(C, 9);
  Buffer<float> in(x, shift(4)), dout(dy, shift(3)), mean(N), rstd(N);
  Buffer<P> weight(w, shift(5));
  Buffer<float> normed(N * C);  // the forward's statistics (the weight serves as bias)
  layernorm_forward(normed.data(), mean.data(), rstd.data(), in.data(), weight.data(), weight.data(), N, C);
  auto run = [&](bool device) {
    Buffer<float> dx(dx0, shift(0)), dw(dw0, shift(1)), db(db0, shift(2));
    if (device)
      gpu::layernorm_backward(dx.data(), dw.data(), db.data(), dout.data(), in.data(), weight.data(), mean.data(),
                              rstd.data(), N, C);
    else
      layernorm_backward(dx.data(), dw.data(), db.data(), dout.data(), in.data(), weight.data(), mean.data(),
                         rstd.data(), N, C);
    return std::make_tuple(dx.host(), dw.host(), db.host());
  };
  const auto [dx, dw, db] = run(true);
  const auto [cpu_dx, cpu_dw, cpu_db] = run(false);
  // The row's two means are added in another order (as the forward's): a few ulp of Σ|dnorm|/C.
  expect_close("dinp" + at, dx, cpu_dx, 2e-5, 2e-6);
  // One chunk of rows adds them in the CPU form's order: dbias's pure sums agree bit for bit, and
  // dweight's but for the compiler fusing a term's product into its add in one form and not the
  // other (one rounding a term). More chunks add 64-row sums in order: a few ulp of the N-term
  // Σ|dy| or Σ|dy·norm| (~0.8 N).
  expect_close("dweight" + at, dw, cpu_dw, 2e-6 * N, 0.0);
  if (N <= gpu::kColumnChunkRows) expect_same_bits("dbias" + at, db, cpu_db);
  else expect_close("dbias" + at, db, cpu_db, 2e-6 * N, 0.0);
  const auto [again_dx, again_dw, again_db] = run(true);
  expect_same_bits("dinp, second run" + at, again_dx, dx);
  expect_same_bits("dweight, second run" + at, again_dw, dw);
  expect_same_bits("dbias, second run" + at, again_db, db);
}

// Token ids with repeats: ids below `distinct`, and one frequent id at every third position.
std::vector<int32_t> repeating_tokens(Index n, Index distinct, uint64_t stream) {
  Rng rng(31, stream);
  std::vector<int32_t> t(n);
  for (Index i = 0; i < n; ++i) t[i] = i % 3 == 0 ? 3 : static_cast<int32_t>(rng.below(distinct));
  return t;
}

void check_encoder(Index B, Index T, Index C, Index V, Index distinct) {
  const std::string at = " [B " + std::to_string(B) + ", T " + std::to_string(T) + ", C " + std::to_string(C) + "]";
  Buffer<int32_t> tokens(repeating_tokens(B * T, distinct, 10));
  Buffer<float> wte(random_vector(V * C, 11)), wpe(random_vector(T * C, 12)), dout(random_vector(B * T * C, 13));
  Buffer<float> out(B * T * C), cpu_out(B * T * C);
  gpu::encoder_forward(out.data(), tokens.data(), wte.data(), wpe.data(), B, T, C);
  encoder_forward(cpu_out.data(), tokens.data(), wte.data(), wpe.data(), B, T, C);
  expect_same_bits("encoder_forward" + at, out.host(), cpu_out.host());  // one sum per element
  const auto dwte0 = random_vector(V * C, 14), dwpe0 = random_vector(T * C, 15);
  auto run = [&](bool device) {
    Buffer<float> dwte(dwte0), dwpe(dwpe0);
    if (device) gpu::encoder_backward(dwte.data(), dwpe.data(), dout.data(), tokens.data(), B, T, C);
    else encoder_backward(dwte.data(), dwpe.data(), dout.data(), tokens.data(), B, T, C);
    return std::make_pair(dwte.host(), dwpe.host());
  };
  const auto [dwte, dwpe] = run(true);
  const auto [cpu_dwte, cpu_dwpe] = run(false);
  // Each token's positions, and each position's batch, are added in position order, as the CPU form adds them.
  expect_same_bits("dwte" + at, dwte, cpu_dwte);
  expect_same_bits("dwpe" + at, dwpe, cpu_dwpe);
  const auto [again_dwte, again_dwpe] = run(true);
  expect_same_bits("dwte, second run" + at, again_dwte, dwte);
  expect_same_bits("dwpe, second run" + at, again_dwpe, dwpe);
}

}  // namespace

TEST(KernelDeviceForms, LayerNormForwardMatchesTheCpuForm) {
  for (const auto& size : {std::pair<Index, Index>{5, 37}, {64, 768}, {257, 768}}) {
    const Index N = size.first, C = size.second;
    check_layernorm_forward<float, float>(N, C);
    check_layernorm_forward<bf16, bf16>(N, C);
  }
}

// Rows 768 wide take whole vectors; with any one pointer off a 16-byte boundary, elements.
TEST(KernelDeviceForms, LayerNormTakesElementsWhereAnyPointerIsOffAVector) {
  for (int shifted = 0; shifted < 4; ++shifted) {
    check_layernorm_forward<float, float>(70, 768, shifted);
    check_layernorm_forward<bf16, bf16>(70, 768, shifted);
  }
  for (int shifted = 0; shifted < 6; ++shifted) {
    check_layernorm_backward<float>(70, 768, shifted);
    check_layernorm_backward<bf16>(70, 768, shifted);
  }
}

TEST(KernelDeviceForms, LayerNormBackwardMatchesTheCpuForm) {
  for (const auto& size : {std::pair<Index, Index>{5, 37}, {64, 768}, {257, 768}}) {
    const Index N = size.first, C = size.second;
    check_layernorm_backward<float>(N, C);
    check_layernorm_backward<bf16>(N, C);
  }
}

TEST(KernelDeviceForms, EncoderMatchesTheCpuFormBitForBitWithRepeatedTokens) {
  check_encoder(2, 3, 5, 7, 7);        // 6 positions, 3 distinct ids at most
  check_encoder(4, 64, 768, 1000, 50);  // GPT-2's width; token 3 at a third of the positions
  check_encoder(1, 16, 9, 4, 1);        // ids 0 and 3 only: two long runs
}

TEST(KernelDeviceForms, EncoderBackwardGivesATokenEveryRepeatOfIt) {
  // Every position the same token: its row gets the whole sum, every other row stays zero.
  const Index B = 2, T = 4, C = 3, V = 5;
  Buffer<int32_t> tokens(std::vector<int32_t>(B * T, 2));
  std::vector<float> d(B * T * C);
  for (Index i = 0; i < B * T * C; ++i) d[i] = static_cast<float>(i % C + 1);
  Buffer<float> dout(d), dwte(V * C), dwpe(T * C);
  gpu::encoder_backward(dwte.data(), dwpe.data(), dout.data(), tokens.data(), B, T, C);
  std::vector<float> want(V * C, 0.0f);
  for (Index c = 0; c < C; ++c) want[2 * C + c] = static_cast<float>(B * T * (c + 1));
  expect_same_bits("dwte", dwte.host(), want);
}

TEST(KernelDeviceForms, VocabParallelEmbeddingMatchesTheCpuForm) {
  const Index B = 4, T = 64, C = 768, v0 = 0, Vl = 20;  // this rank owns ids 0..19 of the 50 in use
  Buffer<int32_t> tokens(repeating_tokens(B * T, 50, 16));
  Buffer<float> wte(random_vector(Vl * C, 17)), wpe(random_vector(T * C, 18)), dout(random_vector(B * T * C, 19));
  Buffer<float> out(B * T * C), cpu_out(B * T * C);
  gpu::vocab_embedding_forward(out.data(), tokens.data(), wte.data(), v0, Vl, B * T, C);
  vocab_embedding_forward(cpu_out.data(), tokens.data(), wte.data(), v0, Vl, B * T, C);
  gpu::add_position_embedding(out.data(), wpe.data(), 5, B * T, T, C);
  add_position_embedding(cpu_out.data(), wpe.data(), 5, B * T, T, C);
  expect_same_bits("embedding forward", out.host(), cpu_out.host());
  const auto dwte0 = random_vector(Vl * C, 20), dwpe0 = random_vector(T * C, 21);
  for (const Index first : {Index{0}, Index{10}}) {  // a shard starting at id 0, and one owning ids 10..29
    auto run = [&](bool device) {
      Buffer<float> dwte(dwte0), dwpe(dwpe0);
      if (device) gpu::vocab_embedding_backward(dwte.data(), dwpe.data(), dout.data(), tokens.data(), first, Vl, B, T, C);
      else vocab_embedding_backward(dwte.data(), dwpe.data(), dout.data(), tokens.data(), first, Vl, B, T, C);
      return std::make_pair(dwte.host(), dwpe.host());
    };
    const auto [dwte, dwpe] = run(true);
    const auto [cpu_dwte, cpu_dwpe] = run(false);
    const std::string at = " (ids from " + std::to_string(first) + ")";
    expect_same_bits("dwte_local" + at, dwte, cpu_dwte);  // the CPU form's order (see check_encoder)
    expect_same_bits("dwpe" + at, dwpe, cpu_dwpe);
    expect_same_bits("dwte_local, second run" + at, run(true).first, dwte);
  }
}

TEST(KernelDeviceForms, CrossEntropyMatchesTheCpuForm) {
  // (N, V, Vp, shift): unpadded rows, and GPT-2's vocabulary padded to 50,304
  // (make_vocab_size_divisible_by 128), whose rows take whole vectors where the logits start on a
  // 16-byte boundary, and elements where they start one float past it
  for (const auto& size : {std::tuple<Index, Index, Index, size_t>{3, 17, 17, 0}, {64, 1000, 1000, 0},
                           {4, 50257, 50257, 0}, {8, 61, 64, 0}, {4, 50257, 50304, 0}, {4, 50257, 50304, 1}}) {
    const Index N = std::get<0>(size), V = std::get<1>(size), Vp = std::get<2>(size);
    const size_t shift = std::get<3>(size);
    const std::string at = shape(N, Vp) + " V " + std::to_string(V) + " shift " + std::to_string(shift);
    const auto z = random_vector(N * Vp, 22, 3.0f);
    std::vector<int32_t> t(N);
    for (Index i = 0; i < N; ++i) t[i] = static_cast<int32_t>((i * 7919) % V);
    Buffer<float> logits(z, shift);
    Buffer<int32_t> targets(t);
    auto forward = [&](bool device) {
      Buffer<float> losses(N), lse(N);
      if (device) gpu::crossentropy_forward(losses.data(), lse.data(), logits.data(), targets.data(), N, V, Vp);
      else crossentropy_forward(losses.data(), lse.data(), logits.data(), targets.data(), N, V, Vp);
      return std::make_pair(losses.host(), lse.host());
    };
    const auto [losses, lse] = forward(true);
    const auto [cpu_losses, cpu_lse] = forward(false);
    // The max is exact; the sum of V positive exponentials is added in another order (here one
    // term at a time, the host's single lane; the CPU form in 16-lane pieces), its rounding errors
    // growing like √V ulp of the sum (V ulp at the very worst), and lse = max + log(sum) moves
    // by that relative error, absolutely: 16·√V·2⁻²⁴ allows for it.
    const double lse_tolerance = 16.0 * std::sqrt(static_cast<double>(V)) * std::ldexp(1.0, -24);
    expect_close("lse" + at, lse, cpu_lse, lse_tolerance, 0.0);
    expect_close("losses" + at, losses, cpu_losses, lse_tolerance, 0.0);
    expect_same_bits("losses, second run" + at, forward(true).first, losses);
    // The backward from the same lse: each logit's arithmetic is the CPU form's.
    Buffer<float> lse_in(cpu_lse);
    auto backward = [&](bool device) {
      Buffer<float> grad(z, shift);
      if (device) gpu::crossentropy_backward(grad.data(), lse_in.data(), targets.data(), 0.125f, N, V, Vp);
      else crossentropy_backward(grad.data(), lse_in.data(), targets.data(), 0.125f, N, V, Vp);
      return grad.host();
    };
    expect_same_bits("crossentropy_backward" + at, backward(true), backward(false));
    // The fused classifier's bf16 gradient, the logits (0) or the gradient (1) off a 16-byte
    // boundary in turn: the CPU form's bits, with the logits only read.
    for (const int shifted : {-1, 0, 1}) {
      const ShiftedPointer moved{shifted};
      Buffer<float> kept(z, shift + moved(0));
      auto backward_bf16 = [&](bool device) {
        Buffer<bf16> grad(N * Vp, moved(1));
        if (device)
          gpu::crossentropy_backward_bf16(grad.data(), kept.data(), lse_in.data(), targets.data(), 0.125f, N, V, Vp);
        else crossentropy_backward_bf16(grad.data(), kept.data(), lse_in.data(), targets.data(), 0.125f, N, V, Vp);
        return grad.host();
      };
      expect_same_bits("crossentropy_backward_bf16" + at + moved.label(), backward_bf16(true), backward_bf16(false));
      expect_same_bits("logits after crossentropy_backward_bf16" + at + moved.label(), kept.host(), z);
    }
  }
}

// The device form reads a row once, a lane's sum rescaled whenever a vector raises its max: rows
// whose logits rise along the row rescale at every vector, rows that fall never. Each rescale
// rounds once more, so the sum may drift by about √(rescales) ulp more than the tolerance above.
TEST(KernelDeviceForms, CrossEntropyOnlineNormalizerHoldsOnRisingAndFallingRows) {
  const Index N = 4, V = 50257, Vp = 50304;
  std::vector<float> z(static_cast<size_t>(N * Vp), 0.0f);
  for (Index i = 0; i < N; ++i)
    for (Index v = 0; v < V; ++v) {
      const float ramp = 12.0f * static_cast<float>(v) / static_cast<float>(V);
      z[i * Vp + v] = i % 2 == 0 ? ramp : -ramp;  // rising rows, falling rows
    }
  std::vector<int32_t> t = {0, 1, V - 1, V / 2};
  Buffer<float> logits(z);
  Buffer<int32_t> targets(t);
  Buffer<float> losses(N), lse(N), cpu_losses(N), cpu_lse(N);
  gpu::crossentropy_forward(losses.data(), lse.data(), logits.data(), targets.data(), N, V, Vp);
  crossentropy_forward(cpu_losses.data(), cpu_lse.data(), logits.data(), targets.data(), N, V, Vp);
  // in double: lse of a ramp, the reference both forms are held to
  std::vector<float> want(N);
  for (Index i = 0; i < N; ++i) {
    double m = -1e300, s = 0.0;
    for (Index v = 0; v < V; ++v) m = std::max(m, static_cast<double>(z[i * Vp + v]));
    for (Index v = 0; v < V; ++v) s += std::exp(static_cast<double>(z[i * Vp + v]) - m);
    want[i] = static_cast<float>(m + std::log(s));
  }
  const double tolerance = 32.0 * std::sqrt(static_cast<double>(V)) * std::ldexp(1.0, -24);
  expect_close("lse, online (device form)", lse.host(), want, tolerance, 0.0);
  expect_close("lse, two passes (CPU form)", cpu_lse.host(), want, tolerance, 0.0);
}

// bf16 logits (a GPU's bf16 step: model/bf16_activations.hpp logits_bf16): the device form gives,
// from them, the bits it gives from their fp32 widening (the CPU form, which runs them only in
// tests, vectorises its sum another way: within the reordering's bound), and the bf16 backward
// writes the gradient over them with the bits it writes elsewhere. Rows whole vectors (Vp 64,
// 16-byte aligned) or not (Vp 61; 64 one element off).
TEST(KernelDeviceForms, CrossEntropyOfBf16LogitsIsTheCrossEntropyOfTheirWidening) {
  for (const auto& size : {std::tuple<Index, Index, Index, size_t>{8, 61, 64, 0}, {8, 61, 64, 1}, {5, 61, 61, 0}}) {
    const Index N = std::get<0>(size), V = std::get<1>(size), Vp = std::get<2>(size);
    const size_t shift = std::get<3>(size);
    const std::string at = shape(N, Vp) + " V " + std::to_string(V) + " shift " + std::to_string(shift);
    const std::vector<bf16> z16 = rounded(random_vector(N * Vp, 24, 3.0f));
    std::vector<float> widened(z16.size());
    for (size_t i = 0; i < z16.size(); ++i) widened[i] = to_float(z16[i]);
    std::vector<int32_t> t(N);
    for (Index i = 0; i < N; ++i) t[i] = static_cast<int32_t>((i * 7919) % V);
    Buffer<int32_t> targets(t);
    for (const bool device : {true, false}) {
      const std::string form = (device ? " (device form)" : " (CPU form)") + at;
      Buffer<bf16> logits16(z16, shift);
      Buffer<float> logits32(widened, shift);
      Buffer<float> losses16(N), lse16(N), losses32(N), lse32(N);
      if (device) {
        gpu::crossentropy_forward(losses16.data(), lse16.data(), logits16.data(), targets.data(), N, V, Vp);
        gpu::crossentropy_forward(losses32.data(), lse32.data(), logits32.data(), targets.data(), N, V, Vp);
      } else {
        crossentropy_forward(losses16.data(), lse16.data(), logits16.data(), targets.data(), N, V, Vp);
        crossentropy_forward(losses32.data(), lse32.data(), logits32.data(), targets.data(), N, V, Vp);
      }
      if (device) {
        expect_same_bits("losses" + form, losses16.host(), losses32.host());
        expect_same_bits("lse" + form, lse16.host(), lse32.host());
      } else {  // as CrossEntropyMatchesTheCpuForm's bound for a sum in another order
        const double tolerance = 16.0 * std::sqrt(static_cast<double>(V)) * std::ldexp(1.0, -24);
        expect_close("losses" + form, losses16.host(), losses32.host(), tolerance, 0.0);
        expect_close("lse" + form, lse16.host(), lse32.host(), tolerance, 0.0);
      }
      // the gradient over the bf16 logits themselves, and into its own buffer from the widening
      Buffer<bf16> separate(N * Vp, shift);
      if (device) {
        gpu::crossentropy_backward_bf16(logits16.data(), logits16.data(), lse32.data(), targets.data(), 0.125f, N, V, Vp);
        gpu::crossentropy_backward_bf16(separate.data(), logits32.data(), lse32.data(), targets.data(), 0.125f, N, V, Vp);
      } else {
        crossentropy_backward_bf16(logits16.data(), logits16.data(), lse32.data(), targets.data(), 0.125f, N, V, Vp);
        crossentropy_backward_bf16(separate.data(), logits32.data(), lse32.data(), targets.data(), 0.125f, N, V, Vp);
      }
      expect_same_bits("gradient in place" + form, logits16.host(), separate.host());
    }
  }
}

TEST(KernelDeviceForms, VocabParallelCrossEntropyMatchesTheCpuForm) {
  const Index N = 64, Vl = 1000, real = 990, v0 = 500;  // the last shard: 10 padding columns
  const auto z = random_vector(N * Vl, 23, 3.0f);
  std::vector<int32_t> t(N);
  for (Index i = 0; i < N; ++i) t[i] = static_cast<int32_t>(450 + (i * 37) % 1050);  // some ids on other ranks
  // the shard's edges: its first and last real ids, the id before it and its first padding column
  t[0] = static_cast<int32_t>(v0), t[1] = static_cast<int32_t>(v0 + real - 1);
  t[2] = static_cast<int32_t>(v0 - 1), t[3] = static_cast<int32_t>(v0 + real);
  Buffer<float> logits(z);
  Buffer<int32_t> targets(t);
  auto forward = [&](bool device, Index real_cols) {
    Buffer<float> mx(N), sum(N), target(N);
    if (device) {
      gpu::vocab_ce_local_max(mx.data(), logits.data(), N, Vl, real_cols);
      gpu::vocab_ce_local_sums(sum.data(), target.data(), logits.data(), mx.data(), targets.data(), v0, N, Vl, real_cols);
    } else {
      vocab_ce_local_max(mx.data(), logits.data(), N, Vl, real_cols);
      vocab_ce_local_sums(sum.data(), target.data(), logits.data(), mx.data(), targets.data(), v0, N, Vl, real_cols);
    }
    return std::make_tuple(mx.host(), sum.host(), target.host());
  };
  for (const Index real_cols : {real, Index{0}}) {  // and a shard that is all padding (max -inf, sum 0)
    const std::string at = " (" + std::to_string(real_cols) + " real columns)";
    const auto [mx, sum, target] = forward(true, real_cols);
    const auto [cpu_mx, cpu_sum, cpu_target] = forward(false, real_cols);
    expect_same_bits("row max" + at, mx, cpu_mx);
    expect_close("sum of exp" + at, sum, cpu_sum, 0.0, 1e-5);  // ~1000 positive terms in another order
    expect_same_bits("target logit" + at, target, cpu_target);
    expect_same_bits("sum of exp, second run" + at, std::get<1>(forward(true, real_cols)), sum);
  }
  Buffer<float> lse(random_vector(N, 24, 1.0f, 8.0f));
  auto backward = [&](bool device) {
    Buffer<float> grad(z);
    if (device) gpu::vocab_ce_backward(grad.data(), lse.data(), targets.data(), 0.5f, v0, N, Vl, real);
    else vocab_ce_backward(grad.data(), lse.data(), targets.data(), 0.5f, v0, N, Vl, real);
    return grad.host();
  };
  expect_same_bits("vocab_ce_backward", backward(true), backward(false));
}

// bf16 logits on a tensor rank (a GPU's bf16 step: model/bf16_activations.hpp logits_bf16): each
// form's row statistics from them are its statistics from their fp32 widening, bit for bit, and
// the bf16 backward writes over them the fp32 backward's gradient of that widening, rounded once.
TEST(KernelDeviceForms, VocabParallelCrossEntropyOfBf16LogitsIsThatOfTheirWidening) {
  const Index N = 16, Vl = 200, real = 190, v0 = 100;
  const std::vector<bf16> z16 = rounded(random_vector(N * Vl, 25, 3.0f));
  std::vector<float> widened(z16.size());
  for (size_t i = 0; i < z16.size(); ++i) widened[i] = to_float(z16[i]);
  std::vector<int32_t> t(N);
  for (Index i = 0; i < N; ++i) t[i] = static_cast<int32_t>(80 + (i * 37) % 230);  // some ids on other ranks
  t[0] = static_cast<int32_t>(v0), t[1] = static_cast<int32_t>(v0 + real - 1);
  Buffer<int32_t> targets(t);
  Buffer<float> lse(random_vector(N, 26, 1.0f, 8.0f));
  std::vector<bf16> grads[2];
  for (const bool device : {true, false}) {
    const std::string form = device ? " (device form)" : " (CPU form)";
    Buffer<bf16> logits16(z16);
    Buffer<float> logits32(widened);
    Buffer<float> mx16(N), sum16(N), target16(N), mx32(N), sum32(N), target32(N);
    if (device) {
      gpu::vocab_ce_local_max(mx16.data(), logits16.data(), N, Vl, real);
      gpu::vocab_ce_local_max(mx32.data(), logits32.data(), N, Vl, real);
      gpu::vocab_ce_local_sums(sum16.data(), target16.data(), logits16.data(), mx16.data(), targets.data(), v0, N, Vl, real);
      gpu::vocab_ce_local_sums(sum32.data(), target32.data(), logits32.data(), mx32.data(), targets.data(), v0, N, Vl, real);
      gpu::vocab_ce_backward_bf16(logits16.data(), lse.data(), targets.data(), 0.25f, v0, N, Vl, real);
      gpu::vocab_ce_backward(logits32.data(), lse.data(), targets.data(), 0.25f, v0, N, Vl, real);
    } else {
      vocab_ce_local_max(mx16.data(), logits16.data(), N, Vl, real);
      vocab_ce_local_max(mx32.data(), logits32.data(), N, Vl, real);
      vocab_ce_local_sums(sum16.data(), target16.data(), logits16.data(), mx16.data(), targets.data(), v0, N, Vl, real);
      vocab_ce_local_sums(sum32.data(), target32.data(), logits32.data(), mx32.data(), targets.data(), v0, N, Vl, real);
      vocab_ce_backward_bf16(logits16.data(), lse.data(), targets.data(), 0.25f, v0, N, Vl, real);
      vocab_ce_backward(logits32.data(), lse.data(), targets.data(), 0.25f, v0, N, Vl, real);
    }
    expect_same_bits("row max" + form, mx16.host(), mx32.host());
    expect_same_bits("sum of exp" + form, sum16.host(), sum32.host());
    expect_same_bits("target logit" + form, target16.host(), target32.host());
    expect_same_bits("gradient" + form, logits16.host(), rounded(logits32.host()));
    grads[device ? 0 : 1] = logits16.host();
  }
  expect_same_bits("gradient, device form against CPU form", grads[0], grads[1]);
}

namespace {

// `shifted`: the one pointer off a 16-byte boundary (0 out, 1 bias, 2 src, 3 the bf16 dst; -1 none).
void check_bias_and_column_sums(Index N, Index OC, int shifted = -1) {
  const ShiftedPointer shift{shifted};
  const std::string at = shape(N, OC) + shift.label();
  const auto x = random_vector(N * OC, 25), b32 = random_vector(OC, 26), sums0 = random_vector(OC, 27);
  Buffer<float> src(x, shift(2)), bias(b32, shift(1));
  Buffer<bf16> bias16(rounded(b32), shift(1));
  // add_bias_rows: one sum per element, fp32 and bf16 biases (widened exactly either way)
  Buffer<float> out(x, shift(0)), cpu_out(x, shift(0));
  gpu::add_bias_rows(out.data(), bias.data(), N, OC);
  gpu::add_bias_rows(out.data(), bias16.data(), N, OC);
  add_bias_rows(cpu_out.data(), bias.data(), N, OC);
  add_bias_rows(cpu_out.data(), bias16.data(), N, OC);
  expect_same_bits("add_bias_rows" + at, out.host(), cpu_out.host());

  // One chunk of rows adds them in the CPU form's order; more chunks add 64-row sums in order:
  // a few ulp of the N-term Σ|x| (~0.8 N).
  auto expect_sums = [&](const std::string& what, const std::vector<float>& got, const std::vector<float>& want) {
    if (N <= gpu::kColumnChunkRows) expect_same_bits(what, got, want);
    else expect_close(what, got, want, 2e-6 * N, 0.0);
  };
  auto column_sums = [&](bool device) {
    Buffer<float> sums(sums0);
    if (device) gpu::accumulate_column_sums(sums.data(), src.data(), N, OC);
    else accumulate_column_sums(sums.data(), src.data(), N, OC);
    return sums.host();
  };
  const auto sums = column_sums(true);
  expect_sums("accumulate_column_sums" + at, sums, column_sums(false));
  expect_same_bits("accumulate_column_sums, second run" + at, column_sums(true), sums);

  auto converted = [&](bool device) {
    Buffer<float> s(sums0);
    Buffer<bf16> dst(N * OC, shift(3));
    if (device) gpu::convert_summing_columns(dst.data(), s.data(), src.data(), N, OC);
    else convert_summing_columns(dst.data(), s.data(), src.data(), N, OC);
    return std::make_pair(dst.host(), s.host());
  };
  const auto [dst, csums] = converted(true);
  const auto [cpu_dst, cpu_csums] = converted(false);
  expect_same_bits("convert_summing_columns, bf16" + at, dst, cpu_dst);
  expect_sums("convert_summing_columns, sums" + at, csums, cpu_csums);
  expect_same_bits("convert_summing_columns sums, second run" + at, converted(true).second, csums);
}
}  // namespace

TEST(KernelDeviceForms, BiasAndColumnSumsMatchTheCpuForm) {
  for (const auto& size : {std::pair<Index, Index>{5, 37}, {64, 768}, {257, 3072}})
    check_bias_and_column_sums(size.first, size.second);
}

// Rows 768 wide take whole vectors; with any one pointer off a 16-byte boundary, elements.
TEST(KernelDeviceForms, BiasAndColumnSumsTakeElementsWhereAnyPointerIsOffAVector) {
  for (int shifted = 0; shifted < 4; ++shifted) check_bias_and_column_sums(70, 768, shifted);
}

namespace {

// `shifted`: the one pointer off a 16-byte boundary (0 dinp, 1 inp, 2 dout; -1 none).
void check_gelu_backward_summing_columns(Index N, Index OC, int shifted = -1) {
  const ShiftedPointer shift{shifted};
  const std::string at = shape(N, OC) + shift.label();
  Buffer<bf16> inp(rounded(random_vector(N * OC, 28, 1.5f)), shift(1));
  Buffer<float> dout(random_vector(N * OC, 29), shift(2));
  const auto sums0 = random_vector(OC, 30);
  auto run = [&](bool device) {
    Buffer<float> s(sums0);
    Buffer<bf16> dinp(N * OC, shift(0));
    if (device) gpu::gelu_backward_summing_columns(dinp.data(), s.data(), inp.data(), dout.data(), N, OC);
    else gelu_backward_summing_columns(dinp.data(), s.data(), inp.data(), dout.data(), N, OC);
    return std::make_pair(dinp.host(), s.host());
  };
  const auto [dinp, sums] = run(true);
  const auto [cpu_dinp, cpu_sums] = run(false);
  // The CPU form's AVX-512 lanes take gelu' through σ(2u) and a 2^x polynomial (relative error
  // 2⁻²²), the device form through fast_tanh (absolute error ~1e-7): gelu' differs by up to
  // ~1e-6, times |dout| (≤ ~5), and a bf16 rounding may flip (one bf16 ulp, 2⁻⁷ relative). The
  // column sums add those over N rows, in chunks past 64 rows.
  expect_close("dinp" + at, dinp, cpu_dinp, 1e-5, 1.0 / 128);
  expect_close("column sums" + at, sums, cpu_sums, 2e-6 * N, 0.0);
  const auto [again_dinp, again_sums] = run(true);
  expect_same_bits("dinp, second run" + at, again_dinp, dinp);
  expect_same_bits("column sums, second run" + at, again_sums, sums);
}
}  // namespace

TEST(KernelDeviceForms, GeluBackwardSummingColumnsMatchesTheCpuForm) {
  for (const auto& size : {std::pair<Index, Index>{5, 37}, {64, 3072}, {257, 768}})
    check_gelu_backward_summing_columns(size.first, size.second);
  for (int shifted = 0; shifted < 3; ++shifted) check_gelu_backward_summing_columns(70, 768, shifted);
}

TEST(KernelDeviceForms, SumOfSquaresMatchesTheCpuForm) {
  const Index n = 64 * 768 + 5;  // a ragged last chunk of the CPU form's 4096
  const auto x = random_vector(n, 31);
  Buffer<float> x32(x);
  Buffer<bf16> x16(rounded(x));
  // n positive squares summed in double in another order: n·2⁻⁵³ relative at worst.
  const double s32 = gpu::sum_of_squares(x32.data(), n), s16 = gpu::sum_of_squares(x16.data(), n);
  const double rel = static_cast<double>(n) * std::ldexp(1.0, -53);
  EXPECT_NEAR(s32, sum_of_squares(x32.data(), n), rel * s32);
  EXPECT_NEAR(s16, sum_of_squares(x16.data(), n), rel * s16);
  EXPECT_EQ(gpu::sum_of_squares(x32.data(), n), s32);  // bit for bit on a second run
  std::vector<float> with_nan = x;
  with_nan[n / 2] = NAN;  // the overflow check needs a non-finite norm
  Buffer<float> nan_buffer(with_nan);
  EXPECT_TRUE(std::isnan(gpu::sum_of_squares(nan_buffer.data(), n)));
}

// The element-wise GELU: whole vectors of kVec where every pointer is 16-byte aligned, one element
// at a time in the tail and wherever one pointer is not (here one element past an aligned buffer,
// each pointer on its own: a form that checked one pointer only would make a misaligned vector
// access, which stops the process on the host as on a GPU).
TEST(KernelDeviceForms, GeluMatchesTheCpuFormByVectorsAndByElements) {
  for (const Index n : {Index{37}, Index{5 * 3072 + 3}}) {
    for (int mask = 0; mask < 8; ++mask) {
      const Index o_out = mask & 1, o_in = mask >> 1 & 1, o_dout = mask >> 2 & 1;  // output, input, gradient
      const std::string at = " [n " + std::to_string(n) + ", offsets " + std::to_string(o_out) +
                             std::to_string(o_in) + std::to_string(o_dout) + "]";
      const auto x = random_vector(n + 1, 32, 1.5f), dy = random_vector(n + 1, 33);
      Buffer<float> x32(x), dout(dy);
      Buffer<bf16> x16(rounded(x));
      auto forward32 = [&](bool device) {
        Buffer<float> out(n + 1);
        if (device) gpu::gelu_forward(out.data() + o_out, x32.data() + o_in, n);
        else gelu_forward(out.data() + o_out, x32.data() + o_in, n);
        return out.host();
      };
      // each element's arithmetic is the portable form's: the same bits
      expect_same_bits("gelu_forward fp32" + at, forward32(true), forward32(false));
      auto forward16 = [&](bool device) {
        Buffer<bf16> out(n + 1);
        if (device) gpu::gelu_forward(out.data() + o_out, x16.data() + o_in, n);
        else gelu_forward(out.data() + o_out, x16.data() + o_in, n);
        return out.host();
      };
      // the CPU form's AVX-512 lanes take σ(2u) through a 2^x polynomial: a bf16 rounding may flip
      expect_close("gelu_forward bf16" + at, forward16(true), forward16(false), 1e-6, 1.0 / 128);
      auto backward = [&](bool device, auto* inp) {
        Buffer<float> dx(n + 1);
        if (device) gpu::gelu_backward(dx.data() + o_out, inp + o_in, dout.data() + o_dout, n);
        else gelu_backward(dx.data() + o_out, inp + o_in, dout.data() + o_dout, n);
        return dx.host();
      };
      expect_same_bits("gelu_backward fp32" + at, backward(true, x32.data()), backward(false, x32.data()));
      expect_same_bits("gelu_backward bf16 input" + at, backward(true, x16.data()), backward(false, x16.data()));
    }
  }
}

// convert's device form: whole vectors where both pointers are 16-byte aligned, one element at a
// time in the tail and where either is not (each pointer offset on its own); each element's
// arithmetic is the portable form's.
TEST(KernelDeviceForms, ConvertMatchesTheCpuFormByVectorsAndByElements) {
  for (const Index n : {Index{37}, Index{4 * 768 + 5}}) {
    for (int mask = 0; mask < 4; ++mask) {
      const Index o_dst = mask & 1, o_src = mask >> 1;
      const std::string at = " [n " + std::to_string(n) + ", offsets " + std::to_string(o_dst) + std::to_string(o_src) + "]";
      const auto x = random_vector(n + 1, 34, 3.0f), y = random_vector(n + 1, 35);
      Buffer<float> x32(x);
      Buffer<bf16> x16(rounded(x));
      auto to16 = [&](bool device, float scale, bool accumulate) {
        Buffer<bf16> out(rounded(y));
        if (device) gpu::convert(out.data() + o_dst, x32.data() + o_src, n, scale, accumulate);
        else convert(out.data() + o_dst, x32.data() + o_src, n, scale, accumulate);
        return out.host();
      };
      auto to32 = [&](bool device, float scale, bool accumulate) {
        Buffer<float> out(y);
        if (device) gpu::convert(out.data() + o_dst, x16.data() + o_src, n, scale, accumulate);
        else convert(out.data() + o_dst, x16.data() + o_src, n, scale, accumulate);
        return out.host();
      };
      for (const auto& [scale, accumulate] : {std::pair<float, bool>{1.0f, false}, {0.25f, false}, {0.5f, true}}) {
        const std::string how = " (scale " + std::to_string(scale) + (accumulate ? ", accumulating)" : ")");
        expect_same_bits("fp32 to bf16" + at + how, to16(true, scale, accumulate), to16(false, scale, accumulate));
        expect_same_bits("bf16 to fp32" + at + how, to32(true, scale, accumulate), to32(false, scale, accumulate));
      }
    }
  }
}
