// bench_kernels.cpp — Google Benchmark of each kernel at the gpt-small-cpu shapes
// (B=8, T=256, C=384, H=6, V=256). Reports GFLOP/s for compute-bound kernels and GB/s or
// parameters/s for memory-bound ones. Run with OPENBLAS_NUM_THREADS=1 (make bench does).
#include <benchmark/benchmark.h>
#include <mpi.h>

#include <Kokkos_Core.hpp>
#include <vector>

#include "base/rng.hpp"
#include "kernels/attention.hpp"
#include "kernels/crossentropy.hpp"
#include "kernels/gelu.hpp"
#include "kernels/gemm.hpp"
#include "kernels/half.hpp"
#include "kernels/layernorm.hpp"
#include "kernels/matmul.hpp"
#include "kernels/optimizers.hpp"

using namespace zero3d;
using namespace zero3d::kernels;

namespace {

constexpr Index B = 8, T = 256, C = 384, H = 6, V = 256, BT = B * T;

std::vector<float> randn(size_t n, uint64_t stream, float scale = 1.0f) {
  Rng rng(1, stream);
  std::vector<float> v(n);
  for (auto& x : v) x = static_cast<float>(scale * rng.normal());
  return v;
}

// Matmul at the four GPT linear shapes: args = (IC, OC).
void BM_MatmulForward(benchmark::State& state) {
  const Index IC = state.range(0), OC = state.range(1);
  auto inp = randn(BT * IC, 1), w = randn(IC * OC, 2), b = randn(OC, 3);
  std::vector<float> out(BT * OC);
  for (auto _ : state) {
    matmul_forward(out.data(), inp.data(), w.data(), b.data(), BT, IC, OC);
    benchmark::ClobberMemory();
  }
  state.counters["GFLOP/s"] = benchmark::Counter(2.0 * BT * IC * OC, benchmark::Counter::kIsIterationInvariantRate,
                                                 benchmark::Counter::kIs1000);
}
BENCHMARK(BM_MatmulForward)->Args({C, 3 * C})->Args({C, C})->Args({C, 4 * C})->Args({4 * C, C})->Unit(benchmark::kMillisecond);

void BM_MatmulBackward(benchmark::State& state) {
  const Index IC = state.range(0), OC = state.range(1);
  auto inp = randn(BT * IC, 1), w = randn(IC * OC, 2), dout = randn(BT * OC, 3);
  std::vector<float> dinp(BT * IC), dw(IC * OC), db(OC);
  for (auto _ : state) {
    matmul_backward(dinp.data(), dw.data(), db.data(), dout.data(), inp.data(), w.data(), BT, IC, OC);
    benchmark::ClobberMemory();
  }
  state.counters["GFLOP/s"] = benchmark::Counter(4.0 * BT * IC * OC, benchmark::Counter::kIsIterationInvariantRate,
                                                 benchmark::Counter::kIs1000);
}
BENCHMARK(BM_MatmulBackward)->Args({C, 3 * C})->Args({C, C})->Args({C, 4 * C})->Args({4 * C, C})->Unit(benchmark::kMillisecond);

// One linear layer's training products (forward, then backward's two products) with the
// weight stored as fp32 (sgemm), bf16 (the bf16 path, oneDNN when built with it) or fp16
// (sgemm on the widened weight, as fp16 mixed precision runs them), as the model runs them,
// operand conversions included: args = (IC, OC, weight dtype: 0 fp32, 1 bf16, 2 fp16).
void BM_LinearTrainingProducts(benchmark::State& state) {
  const Index IC = state.range(0), OC = state.range(1);
  const int64_t kind = state.range(2);
  auto inp = randn(BT * IC, 1), w = randn(IC * OC, 2), b = randn(OC, 3), dout = randn(BT * OC, 4);
  std::vector<bf16> w16(w.size()), b16(b.size());
  std::vector<fp16> wh(w.size()), bh(b.size());
  convert(w16.data(), w.data(), static_cast<Index>(w.size()));
  convert(b16.data(), b.data(), static_cast<Index>(b.size()));
  convert(wh.data(), w.data(), static_cast<Index>(w.size()));
  convert(bh.data(), b.data(), static_cast<Index>(b.size()));
  const DType compute = kind == 1 ? DType::BF16 : DType::F32;
  std::vector<float> out(BT * OC), dinp(BT * IC), dw(IC * OC), db(OC);
  for (auto _ : state) {
    if (kind == 1) {
      matmul_forward(out.data(), inp.data(), w16.data(), b16.data(), BT, IC, OC, false, compute);
      matmul_backward(dinp.data(), dw.data(), db.data(), dout.data(), inp.data(), w16.data(), BT, IC, OC, compute);
    } else if (kind == 2) {
      matmul_forward(out.data(), inp.data(), wh.data(), bh.data(), BT, IC, OC);
      matmul_backward(dinp.data(), dw.data(), db.data(), dout.data(), inp.data(), wh.data(), BT, IC, OC);
    } else {
      matmul_forward(out.data(), inp.data(), w.data(), b.data(), BT, IC, OC);
      matmul_backward(dinp.data(), dw.data(), db.data(), dout.data(), inp.data(), w.data(), BT, IC, OC);
    }
    benchmark::ClobberMemory();
  }
  state.SetLabel(kind == 2 ? "fp16 weights, sgemm" : gemm_path(compute));
  state.counters["GFLOP/s"] = benchmark::Counter(6.0 * BT * IC * OC, benchmark::Counter::kIsIterationInvariantRate,
                                                 benchmark::Counter::kIs1000);
}
BENCHMARK(BM_LinearTrainingProducts)
    ->ArgsProduct({{C}, {3 * C, 4 * C}, {0, 1, 2}})
    ->Args({4 * C, C, 0})
    ->Args({4 * C, C, 1})
    ->Args({4 * C, C, 2})
    ->Unit(benchmark::kMillisecond);

// The bf16 products alone, operands already bf16 (what the model's linear layers run once
// conversions are gone): args = (M, N, K, A transposed, B transposed). The forward product,
// the input gradient (B = weightᵀ) and the weight gradient (A = inputᵀ) of each GPT linear
// layer at B·T = 2048 rows, and the 512³ product the engine measures its MFU peak with.
void BM_GemmBf16(benchmark::State& state) {
  const Index M = state.range(0), N = state.range(1), K = state.range(2);
  const bool ta = state.range(3) != 0, tb = state.range(4) != 0;
  auto a32 = randn(M * K, 1), b32 = randn(K * N, 2);
  std::vector<bf16> a(a32.size()), b(b32.size());
  convert(a.data(), a32.data(), static_cast<Index>(a.size()));
  convert(b.data(), b32.data(), static_cast<Index>(b.size()));
  std::vector<float> c(M * N);
  const GemmOperand A{a.data(), DType::BF16, ta, ta ? M : K}, Bm{b.data(), DType::BF16, tb, tb ? K : N};
  for (auto _ : state) {
    gemm(M, N, K, A, Bm, c.data(), N, false, DType::BF16);
    benchmark::ClobberMemory();
  }
  state.SetLabel(gemm_path(DType::BF16));
  state.counters["GFLOP/s"] = benchmark::Counter(2.0 * M * N * K, benchmark::Counter::kIsIterationInvariantRate,
                                                 benchmark::Counter::kIs1000);
}
BENCHMARK(BM_GemmBf16)
    ->Args({512, 512, 512, 0, 0})
    ->Args({BT, 3 * C, C, 0, 0})
    ->Args({BT, C, 3 * C, 0, 1})
    ->Args({C, 3 * C, BT, 1, 0})
    ->Args({BT, C, C, 0, 0})
    ->Args({BT, C, C, 0, 1})
    ->Args({C, C, BT, 1, 0})
    ->Args({BT, 4 * C, C, 0, 0})
    ->Args({BT, C, 4 * C, 0, 1})
    ->Args({C, 4 * C, BT, 1, 0})
    ->Args({BT, C, 4 * C, 0, 0})
    ->Args({BT, 4 * C, C, 0, 1})
    ->Args({4 * C, C, BT, 1, 0})
    ->Args({C, 3 * C, BT, 0, 0})
    ->Args({3 * C, C, BT, 1, 0})
    ->Args({3 * C, C, BT, 0, 0})
    ->Args({C, 4 * C, BT, 0, 0})
    ->Args({4 * C, C, BT, 0, 0})
    ->Unit(benchmark::kMicrosecond);

// fp32 -> bf16 rounding (RNE) of an activation: what every bf16 product's operand costs.
// A linear layer's forward product with its bias, written fp32 or rounded to bf16 in the
// epilogue (gemm_bf16_output): args = (OC, bf16 output). Input and weight already bf16.
void BM_LinearForwardOutput(benchmark::State& state) {
  const Index OC = state.range(0);
  const bool out16 = state.range(1) != 0;
  auto x32 = randn(BT * C, 1), w32 = randn(C * OC, 2), b32 = randn(OC, 3);
  std::vector<bf16> x(x32.size()), w(w32.size()), b(b32.size()), y16(BT * OC);
  convert(x.data(), x32.data(), static_cast<Index>(x.size()));
  convert(w.data(), w32.data(), static_cast<Index>(w.size()));
  convert(b.data(), b32.data(), static_cast<Index>(b.size()));
  std::vector<float> y(BT * OC);
  for (auto _ : state) {
    if (out16) matmul_forward(y16.data(), x.data(), w.data(), b.data(), BT, C, OC);
    else matmul_forward(y.data(), x.data(), w.data(), b.data(), BT, C, OC);
    benchmark::ClobberMemory();
  }
  state.counters["GFLOP/s"] = benchmark::Counter(2.0 * BT * C * OC, benchmark::Counter::kIsIterationInvariantRate,
                                                 benchmark::Counter::kIs1000);
}
BENCHMARK(BM_LinearForwardOutput)->ArgsProduct({{3 * C, 4 * C}, {0, 1}})->Unit(benchmark::kMicrosecond);

void BM_ConvertToBf16(benchmark::State& state) {
  const Index n = BT * 4 * C;
  auto x = randn(n, 15);
  std::vector<bf16> y(n);
  for (auto _ : state) {
    convert(y.data(), x.data(), n);
    benchmark::ClobberMemory();
  }
  state.counters["GB/s"] = benchmark::Counter(6.0 * n, benchmark::Counter::kIsIterationInvariantRate, benchmark::Counter::kIs1000);
}
BENCHMARK(BM_ConvertToBf16)->Unit(benchmark::kMicrosecond);

// The same rounding into the transposed layout (a weight gradient's input operand).
void BM_ConvertTransposedToBf16(benchmark::State& state) {
  const Index rows = BT, cols = 4 * C;
  auto x = randn(rows * cols, 15);
  std::vector<bf16> y(rows * cols);
  for (auto _ : state) {
    convert_transposed(y.data(), x.data(), rows, cols, cols);
    benchmark::ClobberMemory();
  }
  state.counters["GB/s"] = benchmark::Counter(6.0 * rows * cols, benchmark::Counter::kIsIterationInvariantRate,
                                              benchmark::Counter::kIs1000);
}
BENCHMARK(BM_ConvertTransposedToBf16)->Unit(benchmark::kMicrosecond);

// A linear layer's output gradient rounded with its bias gradient's column sums in one pass.
void BM_ConvertSummingColumns(benchmark::State& state) {
  const Index rows = BT, cols = 4 * C;
  auto x = randn(rows * cols, 15);
  std::vector<bf16> y(rows * cols);
  std::vector<float> sums(cols);
  for (auto _ : state) {
    convert_summing_columns(y.data(), sums.data(), x.data(), rows, cols);
    benchmark::ClobberMemory();
  }
  state.counters["GB/s"] = benchmark::Counter(6.0 * rows * cols, benchmark::Counter::kIsIterationInvariantRate,
                                              benchmark::Counter::kIs1000);
}
BENCHMARK(BM_ConvertSummingColumns)->Unit(benchmark::kMicrosecond);

// A plain copy of the same bytes: the memory system's limit for these streaming kernels.
void BM_CopyStream(benchmark::State& state) {
  const Index n = BT * 4 * C;
  auto x = randn(n, 15);
  std::vector<float> y(n);
  for (auto _ : state) {
    std::copy(x.begin(), x.end(), y.begin());
    benchmark::ClobberMemory();
  }
  state.counters["GB/s"] = benchmark::Counter(8.0 * n, benchmark::Counter::kIsIterationInvariantRate, benchmark::Counter::kIs1000);
}
BENCHMARK(BM_CopyStream)->Unit(benchmark::kMicrosecond);

void BM_LayerNormForward(benchmark::State& state) {
  auto inp = randn(BT * C, 4), w = randn(C, 5), b = randn(C, 6);
  std::vector<float> out(BT * C), mean(BT), rstd(BT);
  for (auto _ : state) {
    layernorm_forward(out.data(), mean.data(), rstd.data(), inp.data(), w.data(), b.data(), BT, C);
    benchmark::ClobberMemory();
  }
  state.counters["GB/s"] = benchmark::Counter(2.0 * BT * C * 4, benchmark::Counter::kIsIterationInvariantRate,
                                              benchmark::Counter::kIs1000);
}
BENCHMARK(BM_LayerNormForward)->Unit(benchmark::kMicrosecond);

void BM_LayerNormBackward(benchmark::State& state) {
  auto inp = randn(BT * C, 4), w = randn(C, 5), b = randn(C, 6), dout = randn(BT * C, 7);
  std::vector<float> out(BT * C), mean(BT), rstd(BT), dinp(BT * C), dw(C), db(C);
  layernorm_forward(out.data(), mean.data(), rstd.data(), inp.data(), w.data(), b.data(), BT, C);
  for (auto _ : state) {
    layernorm_backward(dinp.data(), dw.data(), db.data(), dout.data(), inp.data(), w.data(), mean.data(), rstd.data(),
                       BT, C);
    benchmark::ClobberMemory();
  }
  state.counters["GB/s"] = benchmark::Counter(3.0 * BT * C * 4, benchmark::Counter::kIsIterationInvariantRate,
                                              benchmark::Counter::kIs1000);
}
BENCHMARK(BM_LayerNormBackward)->Unit(benchmark::kMicrosecond);

// Causal attention FLOPs counted as the full T×T products (4·B·T²·C forward), as the MFU formula does.
// arg: 0 = fp32, 1 = the bf16 compute path as the model runs it (the fused kernel where it is
// built and fits, else tiled), 2 = the tiled bf16 kernel (oneDNN batched products) for comparison.
// args = (bf16, gpt2): gpt2 = 1 is GPT-2 124M's attention (B=1, T=1024, H=12, C=768) instead
// of gpt-small-cpu's.
struct AttentionShape {
  Index B, T, C, H;
};
AttentionShape attention_shape(const benchmark::State& state) {
  return state.range(1) ? AttentionShape{1, 1024, 768, 12} : AttentionShape{B, T, C, H};
}

void BM_AttentionForward(benchmark::State& state) {
  const DType compute = state.range(0) ? DType::BF16 : DType::F32;
  const auto [b, t, c, h] = attention_shape(state);
  auto qkv = randn(b * t * 3 * c, 8);
  std::vector<float> out(b * t * c), att(b * h * t * t);
  for (auto _ : state) {
    if (state.range(0) == 2) attention_forward_tiled_bf16(out.data(), att.data(), qkv.data(), b, t, c, h);
    else attention_forward(out.data(), att.data(), qkv.data(), b, t, c, h, compute);
    benchmark::ClobberMemory();
  }
  state.SetLabel(state.range(0) == 2 ? "bf16 tiled" : state.range(0) == 0 ? "fp32"
                 : attention_flash_fits(b * h, t, c / h) ? "bf16 fused (flash)" : "bf16 tiled");
  state.counters["GFLOP/s"] = benchmark::Counter(4.0 * b * t * t * c, benchmark::Counter::kIsIterationInvariantRate,
                                                 benchmark::Counter::kIs1000);
}
BENCHMARK(BM_AttentionForward)->ArgsProduct({{0, 1, 2}, {0, 1}})->Unit(benchmark::kMillisecond);

void BM_AttentionBackward(benchmark::State& state) {
  const DType compute = state.range(0) ? DType::BF16 : DType::F32;
  const auto [b, t, c, h] = attention_shape(state);
  auto qkv = randn(b * t * 3 * c, 8), dout = randn(b * t * c, 9);
  std::vector<float> out(b * t * c), att(b * h * t * t), dqkv(b * t * 3 * c), scratch(kRowBlock * t);
  const bool tiled = state.range(0) == 2;
  if (tiled) attention_forward_tiled_bf16(out.data(), att.data(), qkv.data(), b, t, c, h);
  else attention_forward(out.data(), att.data(), qkv.data(), b, t, c, h, compute);
  for (auto _ : state) {
    if (tiled) attention_backward_tiled_bf16(dqkv.data(), dout.data(), qkv.data(), att.data(), b, t, c, h);
    else attention_backward(dqkv.data(), scratch.data(), dout.data(), qkv.data(), att.data(), b, t, c, h, compute);
    benchmark::ClobberMemory();
  }
  state.SetLabel(tiled ? "bf16 tiled" : state.range(0) == 0 ? "fp32"
                 : attention_flash_fits(b * h, t, c / h) ? "bf16 fused (flash)" : "bf16 tiled");
  state.counters["GFLOP/s"] = benchmark::Counter(8.0 * b * t * t * c, benchmark::Counter::kIsIterationInvariantRate,
                                                 benchmark::Counter::kIs1000);
}
BENCHMARK(BM_AttentionBackward)->ArgsProduct({{0, 1, 2}, {0, 1}})->Unit(benchmark::kMillisecond);

// The fused bf16 kernels reading a qkv already in bf16 (c_attn rounded its own output) against
// the same values in fp32: args = (bf16 qkv, shape as above).
void BM_AttentionQkvType(benchmark::State& state) {
  const auto [b, t, c, h] = attention_shape(state);
  auto qkv = randn(b * t * 3 * c, 8), dout = randn(b * t * c, 9);
  std::vector<bf16> qkv16(qkv.size());
  convert(qkv16.data(), qkv.data(), static_cast<Index>(qkv.size()));
  convert(qkv.data(), qkv16.data(), static_cast<Index>(qkv.size()));
  std::vector<float> out(b * t * c), att(b * h * t * t), dqkv(b * t * 3 * c);
  const bool half = state.range(0) != 0;
  for (auto _ : state) {
    if (half) {
      attention_forward(out.data(), att.data(), qkv16.data(), b, t, c, h, DType::BF16);
      attention_backward(dqkv.data(), nullptr, dout.data(), qkv16.data(), att.data(), b, t, c, h, DType::BF16);
    } else {
      attention_forward(out.data(), att.data(), qkv.data(), b, t, c, h, DType::BF16);
      attention_backward(dqkv.data(), nullptr, dout.data(), qkv.data(), att.data(), b, t, c, h, DType::BF16);
    }
    benchmark::ClobberMemory();
  }
}
BENCHMARK(BM_AttentionQkvType)->ArgsProduct({{0, 1}, {0, 1}})->Unit(benchmark::kMillisecond);

void BM_GeluForward(benchmark::State& state) {
  const Index n = BT * 4 * C;
  auto inp = randn(n, 10);
  std::vector<float> out(n);
  for (auto _ : state) {
    gelu_forward(out.data(), inp.data(), n);
    benchmark::ClobberMemory();
  }
  state.counters["GB/s"] = benchmark::Counter(8.0 * n, benchmark::Counter::kIsIterationInvariantRate, benchmark::Counter::kIs1000);
}
BENCHMARK(BM_GeluForward)->Unit(benchmark::kMillisecond);

void BM_GeluBackward(benchmark::State& state) {
  const Index n = BT * 4 * C;
  auto inp = randn(n, 10), dout = randn(n, 11);
  std::vector<float> dinp(n);
  for (auto _ : state) {
    gelu_backward(dinp.data(), inp.data(), dout.data(), n);
    benchmark::ClobberMemory();
  }
  state.counters["GB/s"] = benchmark::Counter(12.0 * n, benchmark::Counter::kIsIterationInvariantRate, benchmark::Counter::kIs1000);
}
BENCHMARK(BM_GeluBackward)->Unit(benchmark::kMillisecond);

// The bf16 MLP's GELU: bf16 in and out forward; backward to bf16 with c_fc's bias gradient.
void BM_GeluForwardBf16(benchmark::State& state) {
  const Index n = BT * 4 * C;
  const auto x32 = randn(n, 10);
  std::vector<bf16> inp(n), out(n);
  for (Index i = 0; i < n; ++i) inp[i] = to_bf16(x32[i]);
  for (auto _ : state) {
    gelu_forward(out.data(), inp.data(), n);
    benchmark::ClobberMemory();
  }
  state.counters["GB/s"] = benchmark::Counter(4.0 * n, benchmark::Counter::kIsIterationInvariantRate, benchmark::Counter::kIs1000);
}
BENCHMARK(BM_GeluForwardBf16)->Unit(benchmark::kMillisecond);

void BM_GeluBackwardBf16SummingColumns(benchmark::State& state) {
  const Index n = BT * 4 * C;
  const auto x32 = randn(n, 10), dout = randn(n, 11);
  std::vector<bf16> inp(n), dinp(n);
  for (Index i = 0; i < n; ++i) inp[i] = to_bf16(x32[i]);
  std::vector<float> sums(4 * C);
  for (auto _ : state) {
    gelu_backward_summing_columns(dinp.data(), sums.data(), inp.data(), dout.data(), BT, 4 * C);
    benchmark::ClobberMemory();
  }
  state.counters["GB/s"] = benchmark::Counter(8.0 * n, benchmark::Counter::kIsIterationInvariantRate, benchmark::Counter::kIs1000);
}
BENCHMARK(BM_GeluBackwardBf16SummingColumns)->Unit(benchmark::kMillisecond);

void BM_SoftmaxCrossEntropy(benchmark::State& state) {
  auto logits = randn(BT * V, 12);
  std::vector<int32_t> targets(BT);
  for (Index i = 0; i < BT; ++i) targets[i] = static_cast<int32_t>(i % V);
  std::vector<float> losses(BT), lse(BT), work(BT * V);
  for (auto _ : state) {
    std::copy(logits.begin(), logits.end(), work.begin());
    crossentropy_forward(losses.data(), lse.data(), work.data(), targets.data(), BT, V, V);
    crossentropy_backward(work.data(), lse.data(), targets.data(), 1.0f / BT, BT, V, V);
    benchmark::ClobberMemory();
  }
  state.counters["GB/s"] = benchmark::Counter(4.0 * BT * V * 4, benchmark::Counter::kIsIterationInvariantRate,
                                              benchmark::Counter::kIs1000);
}
BENCHMARK(BM_SoftmaxCrossEntropy)->Unit(benchmark::kMicrosecond);

// One AdamW step over a flat buffer; args = number of parameters.
void BM_AdamWStep(benchmark::State& state) {
  const Index n = state.range(0);
  std::vector<float> p = randn(n, 13), g = randn(n, 14), m(n, 0.0f), v(n, 0.0f);
  int64_t step = 0;
  for (auto _ : state) {
    const auto s = make_adam_step(1e-3, 0.9, 0.999, 1e-8, 0.01, ++step, true, true);
    adam_update(p.data(), g.data(), m.data(), v.data(), n, s);
    benchmark::ClobberMemory();
  }
  state.counters["params/s"] = benchmark::Counter(static_cast<double>(n), benchmark::Counter::kIsIterationInvariantRate);
  state.counters["GB/s"] = benchmark::Counter(28.0 * n, benchmark::Counter::kIsIterationInvariantRate, benchmark::Counter::kIs1000);
}
BENCHMARK(BM_AdamWStep)->Arg(10'800'000)->Arg(1 << 24)->Unit(benchmark::kMillisecond);

}  // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  Kokkos::initialize(argc, argv);
  benchmark::Initialize(&argc, argv);
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  Kokkos::finalize();
  MPI_Finalize();
  return 0;
}
