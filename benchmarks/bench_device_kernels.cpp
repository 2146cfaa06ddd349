// bench_device_kernels.cpp — the per-kernel table of the GPU issue: each kernel as the build
// selects it, on model memory, at GPT-2 124M shapes (C 768, H 12, T 1024, V 50257; micro-batch
// 16 on a GPU build, 2 on the CPU). Memory-bound kernels report bytes/s (what each must move once)
// beside BM_DeviceCopy's, the device's own copy rate; products report FLOP/s. Every timed
// iteration ends with a device fence (launches return before kernels run).
// Run: zero3d_device_bench --benchmark_counters_tabular=true (benchmarks/gpu_check.sh does).
#include <benchmark/benchmark.h>

#include <Kokkos_Core.hpp>
#include <cstdio>
#include <vector>

#include "kernels/attention.hpp"
#include "kernels/crossentropy.hpp"
#include "kernels/device.hpp"
#include "kernels/encoder.hpp"
#include "kernels/gelu.hpp"
#include "kernels/gemm.hpp"
#include "kernels/layernorm.hpp"
#include "kernels/memory.hpp"
#include "kernels/optimizers.hpp"
#include "kernels/reduce.hpp"
#include "kernels/rmsnorm.hpp"
#include "kernels/swiglu.hpp"

using namespace zero3d;
using namespace zero3d::kernels;

namespace {

constexpr Index B = kGpuBuild ? 16 : 2, T = 1024, C = 768, H = 12, V = 50257, BT = B * T;
constexpr Index kGpt2Params = 124439808;

// Roughly N(0, scale²) values (a sum of four hashed uniforms) drawn on the device: the host's
// generator takes tens of seconds over the 823 M logits.
void fill_normal(float* x, Index n, uint64_t stream, float scale) {
  const uint64_t seed = 0x9E3779B97F4A7C15ull * (stream + 7);
  Kokkos::parallel_for("bench_fill", Kokkos::RangePolicy<ExecSpace>(0, n), KOKKOS_LAMBDA(Index i) {
    uint64_t h = seed ^ (static_cast<uint64_t>(i) * 0xD1B54A32D192ED03ull);
    float sum = 0;
    for (int k = 0; k < 4; ++k) {  // splitmix64 steps, 24 bits each
      h += 0x9E3779B97F4A7C15ull;
      uint64_t z = (h ^ (h >> 30)) * 0xBF58476D1CE4E5B9ull;
      z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
      sum += static_cast<float>((z ^ (z >> 31)) >> 40) * (1.0f / 16777216.0f);
    }
    x[i] = scale * (sum - 2.0f) * 1.7320508f;  // the variance of a sum of four uniforms is 1/3
  });
  fence();
}

// n floats of model memory holding fill_normal's values.
struct Floats {
  DeviceBuffer bytes;
  explicit Floats(Index n, uint64_t stream = 1, float scale = 1.0f) : bytes(static_cast<size_t>(n) * sizeof(float)) {
    fill_normal(get(), n, stream, scale);
  }
  float* get() const { return reinterpret_cast<float*>(bytes.data()); }
};

// n bf16 of model memory holding fill_normal's values, rounded.
struct Bf16s {
  DeviceBuffer bytes;
  explicit Bf16s(Index n, uint64_t stream = 1, float scale = 1.0f) : bytes(static_cast<size_t>(n) * sizeof(bf16)) {
    Floats x(n, stream, scale);
    convert(get(), x.get(), n);
    fence();
  }
  bf16* get() const { return reinterpret_cast<bf16*>(bytes.data()); }
};

struct Tokens {
  DeviceBuffer bytes;
  explicit Tokens(Index n) : bytes(static_cast<size_t>(n) * sizeof(int32_t)) {
    std::vector<int32_t> host(static_cast<size_t>(n));
    for (Index i = 0; i < n; ++i) host[i] = static_cast<int32_t>((i * 7919) % V);
    copy_to_device(bytes.data(), host.data(), host.size() * sizeof(int32_t));
  }
  int32_t* get() const { return reinterpret_cast<int32_t*>(bytes.data()); }
};

void rate(benchmark::State& state, double bytes, double flops = 0) {
  // printed with SI prefixes: "2.1T/s" bytes is 2.1 TB/s, "480T/s" FLOP is 480 TFLOP/s
  if (bytes > 0) state.counters["bytes/s"] = benchmark::Counter(bytes, benchmark::Counter::kIsIterationInvariantRate,
                                                                benchmark::Counter::kIs1000);
  if (flops > 0) state.counters["FLOP/s"] = benchmark::Counter(flops, benchmark::Counter::kIsIterationInvariantRate,
                                                               benchmark::Counter::kIs1000);
}

void BM_DeviceCopy(benchmark::State& state) {
  const Index n = BT * 4 * C;
  Floats a(n), b(n);
  for (auto _ : state) {
    copy_on_device(b.get(), a.get(), n * sizeof(float));
    fence();
  }
  rate(state, 2.0 * n * sizeof(float));
}
BENCHMARK(BM_DeviceCopy)->UseRealTime()->Unit(benchmark::kMicrosecond);

void BM_LayerNormForward(benchmark::State& state) {
  Floats x(BT * C), w(C, 2), b(C, 3), out(BT * C), mean(BT), rstd(BT);
  for (auto _ : state) {
    layernorm_forward(out.get(), mean.get(), rstd.get(), x.get(), w.get(), b.get(), BT, C);
    fence();
  }
  rate(state, 2.0 * BT * C * sizeof(float));
}
BENCHMARK(BM_LayerNormForward)->UseRealTime()->Unit(benchmark::kMicrosecond);

void BM_LayerNormBackward(benchmark::State& state) {
  Floats x(BT * C), w(C, 2), dy(BT * C, 3), dx(BT * C), dw(C), db(C), mean(BT, 4, 0.1f), rstd(BT, 5, 0.1f);
  for (auto _ : state) {
    layernorm_backward(dx.get(), dw.get(), db.get(), dy.get(), x.get(), w.get(), mean.get(), rstd.get(), BT, C);
    fence();
  }
  rate(state, 4.0 * BT * C * sizeof(float));  // x, dy read; dx read and written
}
BENCHMARK(BM_LayerNormBackward)->UseRealTime()->Unit(benchmark::kMicrosecond);

void BM_EncoderBackward(benchmark::State& state) {
  Floats dwte(V * C), dwpe(T * C), dy(BT * C);
  Tokens tok(BT);
  for (auto _ : state) {
    encoder_backward(dwte.get(), dwpe.get(), dy.get(), tok.get(), B, T, C);
    fence();
  }
  rate(state, 3.0 * BT * C * sizeof(float));  // dout read twice (wte, wpe), rows of dwte read and written
}
BENCHMARK(BM_EncoderBackward)->UseRealTime()->Unit(benchmark::kMicrosecond);

void BM_GeluForward(benchmark::State& state) {
  const Index n = BT * 4 * C;
  Floats x(n), out(n);
  for (auto _ : state) {
    gelu_forward(out.get(), x.get(), n);
    fence();
  }
  rate(state, 2.0 * n * sizeof(float));
}
BENCHMARK(BM_GeluForward)->UseRealTime()->Unit(benchmark::kMicrosecond);

void BM_GeluBackward(benchmark::State& state) {
  const Index n = BT * 4 * C;
  Floats x(n), dy(n, 2), dx(n);
  for (auto _ : state) {
    gelu_backward(dx.get(), x.get(), dy.get(), n);
    fence();
  }
  rate(state, 3.0 * n * sizeof(float));
}
BENCHMARK(BM_GeluBackward)->UseRealTime()->Unit(benchmark::kMicrosecond);

// The bf16 step's own forms (bf16.enabled): LayerNorm writing the bf16 input of c_attn / c_fc,
// GELU between two bf16 products, the output gradients rounded for their products with the
// bias gradient's column sums in the same pass, and the Llama family's RMSNorm and SwiGLU.
void BM_LayerNormForwardBf16(benchmark::State& state) {
  Floats x(BT * C), w(C, 2), b(C, 3), mean(BT), rstd(BT);
  Bf16s out(BT * C);
  for (auto _ : state) {
    layernorm_forward(out.get(), mean.get(), rstd.get(), x.get(), w.get(), b.get(), BT, C);
    fence();
  }
  rate(state, (4.0 + 2.0) * BT * C);
}
BENCHMARK(BM_LayerNormForwardBf16)->UseRealTime()->Unit(benchmark::kMicrosecond);

void BM_GeluForwardBf16(benchmark::State& state) {
  const Index n = BT * 4 * C;
  Bf16s x(n), out(n);
  for (auto _ : state) {
    gelu_forward(out.get(), x.get(), n);
    fence();
  }
  rate(state, 2.0 * n * sizeof(bf16));
}
BENCHMARK(BM_GeluForwardBf16)->UseRealTime()->Unit(benchmark::kMicrosecond);

void BM_GeluBackwardSummingColumns(benchmark::State& state) {
  const Index n = BT * 4 * C;
  Bf16s x(n), dx(n);
  Floats dy(n, 2), sums(4 * C);
  for (auto _ : state) {
    gelu_backward_summing_columns(dx.get(), sums.get(), x.get(), dy.get(), BT, 4 * C);
    fence();
  }
  rate(state, (2.0 + 4.0 + 2.0) * n);  // bf16 input and fp32 gradient read, bf16 gradient written
}
BENCHMARK(BM_GeluBackwardSummingColumns)->UseRealTime()->Unit(benchmark::kMicrosecond);

void BM_ConvertSummingColumns(benchmark::State& state) {
  Floats dy(BT * C, 2), sums(C);
  Bf16s out(BT * C);
  for (auto _ : state) {
    convert_summing_columns(out.get(), sums.get(), dy.get(), BT, C);
    fence();
  }
  rate(state, (4.0 + 2.0) * BT * C);
}
BENCHMARK(BM_ConvertSummingColumns)->UseRealTime()->Unit(benchmark::kMicrosecond);

constexpr Index kLlamaIntermediate = 2048;  // input/llama-125m.json

void BM_RmsNormForwardBf16(benchmark::State& state) {
  Floats x(BT * C), w(C, 2), rstd(BT);
  Bf16s out(BT * C);
  for (auto _ : state) {
    rmsnorm_forward(out.get(), rstd.get(), x.get(), w.get(), BT, C, 1e-6f);
    fence();
  }
  rate(state, (4.0 + 2.0) * BT * C);
}
BENCHMARK(BM_RmsNormForwardBf16)->UseRealTime()->Unit(benchmark::kMicrosecond);

void BM_RmsNormBackward(benchmark::State& state) {
  Floats x(BT * C), w(C, 2), dy(BT * C, 3), dx(BT * C), dw(C), rstd(BT, 5, 0.1f);
  for (auto _ : state) {
    rmsnorm_backward(dx.get(), dw.get(), dy.get(), x.get(), w.get(), rstd.get(), BT, C);
    fence();
  }
  rate(state, 4.0 * BT * C * sizeof(float));  // x, dy read; dx read and written
}
BENCHMARK(BM_RmsNormBackward)->UseRealTime()->Unit(benchmark::kMicrosecond);

// The fused [gate | up] product's bf16 output into SwiGLU, and its backward without biases.
void BM_SwiGluForwardBf16(benchmark::State& state) {
  const Index I = kLlamaIntermediate;
  Bf16s gate_up(BT * 2 * I), out(BT * I);
  for (auto _ : state) {
    swiglu_forward(out.get(), gate_up.get(), gate_up.get() + I, BT, I, 2 * I);
    fence();
  }
  rate(state, 3.0 * BT * I * sizeof(bf16));
}
BENCHMARK(BM_SwiGluForwardBf16)->UseRealTime()->Unit(benchmark::kMicrosecond);

void BM_SwiGluBackwardBf16(benchmark::State& state) {
  const Index I = kLlamaIntermediate;
  Bf16s gate_up(BT * 2 * I), d(BT * 2 * I);
  Floats dy(BT * I, 2);
  for (auto _ : state) {
    swiglu_backward_summing_columns(d.get(), nullptr, dy.get(), gate_up.get(), BT, I);
    fence();
  }
  rate(state, (4.0 + 4.0 + 4.0) * BT * I);  // gate and up read, dout read, dgate and dup written
}
BENCHMARK(BM_SwiGluBackwardBf16)->UseRealTime()->Unit(benchmark::kMicrosecond);

void BM_CrossEntropyForwardBackward(benchmark::State& state) {
  Floats logits(BT * V, 1, 2.0f), losses(BT), lse(BT);
  Tokens targets(BT);
  for (auto _ : state) {
    crossentropy_forward(losses.get(), lse.get(), logits.get(), targets.get(), BT, V, V);
    crossentropy_backward(logits.get(), lse.get(), targets.get(), 1.0f / BT, BT, V, V);
    fence();
  }
  rate(state, 3.0 * BT * V * sizeof(float));  // logits read by the forward (once), read and written by the backward
}
BENCHMARK(BM_CrossEntropyForwardBackward)->UseRealTime()->Unit(benchmark::kMillisecond);

// The bf16 step's classifier as a GPU runs it (model/bf16_activations.hpp logits_bf16): the forward
// over bf16 logits, then the gradient written over them in bf16 for the head's products, at V padded
// to 50,304 as the GPU build pads it. (After the first iteration the logits hold gradients: the
// kernels' work does not depend on the values.)
void BM_CrossEntropyForwardBackwardBf16(benchmark::State& state) {
  const Index Vp = 50304;
  Bf16s logits(BT * Vp, 1, 2.0f);
  Floats losses(BT), lse(BT);
  Tokens targets(BT);
  for (auto _ : state) {
    crossentropy_forward(losses.get(), lse.get(), static_cast<const bf16*>(logits.get()), targets.get(), BT, V, Vp);
    crossentropy_backward_bf16(logits.get(), static_cast<const bf16*>(logits.get()), lse.get(), targets.get(), 1.0f / BT,
                               BT, V, Vp);
    fence();
  }
  rate(state, (2.0 + 2.0 + 2.0) * BT * Vp);  // logits read by the forward and the backward, the gradient written over them
}
BENCHMARK(BM_CrossEntropyForwardBackwardBf16)->UseRealTime()->Unit(benchmark::kMillisecond);

void BM_AdamW(benchmark::State& state) {
  const Index n = kGpt2Params;
  Floats p(n, 1, 0.02f), g(n, 2, 1e-3f), m(n, 3, 0.0f), v(n, 4, 0.0f);
  const AdamStep s = make_adam_step(6e-4, 0.9, 0.95, 1e-8, 0.1, 1, true, true);
  for (auto _ : state) {
    adam_update(p.get(), g.get(), m.get(), v.get(), n, s);
    fence();
  }
  rate(state, 7.0 * n * sizeof(float));  // p, g, m, v read; p, m, v written
}
BENCHMARK(BM_AdamW)->UseRealTime()->Unit(benchmark::kMillisecond);

void BM_GradNormSumOfSquares(benchmark::State& state) {
  const Index n = kGpt2Params;
  Floats g(n, 2, 1e-3f);
  for (auto _ : state) benchmark::DoNotOptimize(sum_of_squares(g.get(), n));
  rate(state, 1.0 * n * sizeof(float));
}
BENCHMARK(BM_GradNormSumOfSquares)->UseRealTime()->Unit(benchmark::kMillisecond);

// The four linear shapes of a GPT-2 block and the classifier (args: K, N, compute 0 fp32 / 1 bf16).
void BM_ForwardProduct(benchmark::State& state) {
  const Index K = state.range(0), N = state.range(1);
  const DType compute = state.range(2) ? DType::BF16 : DType::F32;
  Floats a(BT * K), w(K * N, 2, 0.02f), bias(N, 3), out(BT * N);
  for (auto _ : state) {
    gemm(BT, N, K, GemmOperand{a.get(), DType::F32, false, K}, GemmOperand{w.get(), DType::F32, false, N}, out.get(), N,
         false, compute, bias.get(), DType::F32);
    fence();
  }
  rate(state, 0, 2.0 * BT * K * N);
  state.SetLabel(gemm_path(compute));
}
BENCHMARK(BM_ForwardProduct)
    ->ArgsProduct({{C}, {3 * C, C, 4 * C}, {0, 1}})
    ->Args({4 * C, C, 0})
    ->Args({4 * C, C, 1})
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);

// The same shapes with both operands already bf16 and no bias (args: K, N, output 0 fp32 / 1
// bf16): cuBLASLt's own rate, without the fp32 operand's conversion that BM_ForwardProduct's
// bf16 rows include; what keeping activations in bf16 end to end would leave.
void BM_Bf16OperandProduct(benchmark::State& state) {
  const Index K = state.range(0), N = state.range(1);
  const bool bf16_out = state.range(2) != 0;
  Bf16s a(BT * K), w(K * N, 2, 0.02f), out16(bf16_out ? BT * N : 1);
  Floats out(bf16_out ? 1 : BT * N);
  const GemmOperand A{a.get(), DType::BF16, false, K}, W{w.get(), DType::BF16, false, N};
  for (auto _ : state) {
    if (bf16_out) gemm_bf16_output(BT, N, K, A, W, out16.get());
    else gemm(BT, N, K, A, W, out.get(), N, false, DType::BF16);
    fence();
  }
  rate(state, 0, 2.0 * BT * K * N);
  state.SetLabel(bf16_out ? "bf16 operands, bf16 output" : "bf16 operands, fp32 output");
}
BENCHMARK(BM_Bf16OperandProduct)
    ->ArgsProduct({{C}, {3 * C, C, 4 * C}, {0, 1}})
    ->Args({4 * C, C, 0})
    ->Args({4 * C, C, 1})
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);

// The tied LM head's forward as the model runs it (logits = ln_f · wteᵀ, then the loss over the
// real V columns) at GPT-2's V and at V padded to 50,304 (model.make_vocab_size_divisible_by 128,
// the GPU build's default; llm.c's padded_vocab_size). Args: the padded V, compute 0 fp32 / 1 bf16
// (fp32 logits) / 2 bf16 with bf16 logits, rounded in the product's epilogue (what a GPU's bf16
// step runs: logits_bf16).
void BM_HeadAndLoss(benchmark::State& state) {
  const Index Vp = state.range(0);
  const DType compute = state.range(1) ? DType::BF16 : DType::F32;
  const bool logits16 = state.range(1) == 2;
  Floats x(BT * C), wte(Vp * C, 2, 0.02f), logits(logits16 ? 1 : BT * Vp), losses(BT), lse(BT);
  Bf16s x16(logits16 ? BT * C : 1), wte16(logits16 ? Vp * C : 1, 2, 0.02f), logits16s(logits16 ? BT * Vp : 1);
  Tokens targets(BT);
  for (auto _ : state) {
    if (logits16) {
      gemm_bf16_output(BT, Vp, C, GemmOperand{x16.get(), DType::BF16, false, C},
                       GemmOperand{wte16.get(), DType::BF16, true, C}, logits16s.get());
      crossentropy_forward(losses.get(), lse.get(), static_cast<const bf16*>(logits16s.get()), targets.get(), BT, V, Vp);
    } else {
      gemm(BT, Vp, C, GemmOperand{x.get(), DType::F32, false, C}, GemmOperand{wte.get(), DType::F32, true, C},
           logits.get(), Vp, false, compute);
      crossentropy_forward(losses.get(), lse.get(), logits.get(), targets.get(), BT, V, Vp);
    }
    fence();
  }
  rate(state, 0, 2.0 * BT * C * V);  // the useful products: the padding columns' are overhead
  state.SetLabel(logits16 ? gemm_path(compute) + ", bf16 logits" : gemm_path(compute));
}
BENCHMARK(BM_HeadAndLoss)
    ->ArgsProduct({{V, 50304}, {0, 1}})
    ->Args({50304, 2})
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);

// Causal attention at T 1024 (arg: compute 0 fp32 / 1 bf16): forward and backward.
void BM_Attention(benchmark::State& state) {
  const DType compute = state.range(0) ? DType::BF16 : DType::F32;
  Floats qkv(BT * 3 * C), out(BT * C), att(B * H * T * T), dout(BT * C, 2), dqkv(BT * 3 * C), scratch(64 * T);
  for (auto _ : state) {
    attention_forward(out.get(), att.get(), qkv.get(), B, T, C, H, compute);
    attention_backward(dqkv.get(), scratch.get(), dout.get(), qkv.get(), att.get(), B, T, C, H, compute);
    fence();
  }
  // the square's FLOPs, forward 2·B·T²·C and backward twice that, as earlier figures counted them
  // (the causal query blocks compute 56% of them at T 1024)
  rate(state, 0, 3.0 * 2.0 * B * T * T * C);
}
BENCHMARK(BM_Attention)->Arg(0)->Arg(1)->UseRealTime()->Unit(benchmark::kMillisecond);

}  // namespace

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  if (kGpuBuild && !device_problem().empty()) {
    std::fprintf(stderr, "zero3d_device_bench: %s\n", device_problem().c_str());
    return 2;
  }
  initialize_backend(0, argv);
  const DeviceInfo d = device_info();
  benchmark::AddCustomContext("zero3d backend", d.backend);
  if (!d.name.empty()) benchmark::AddCustomContext("device", d.name);
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  Kokkos::finalize();
  return 0;
}
