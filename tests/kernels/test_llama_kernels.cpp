// test_llama_kernels.cpp — the Llama-family kernels (kernels/rmsnorm.hpp, kernels/rope.hpp,
// kernels/swiglu.hpp) against the PyTorch references in tests/golden/llama_kernels.h5
// (tests/golden/make_llama_kernels_golden.py: LlamaRMSNorm, apply_rotary_pos_emb with each rope
// type's cos/sin, silu(gate)·up, float64 autograd), within the per-tensor max |diff| of 1e-4 that
// the GPT-2 goldens use (tests/model/test_golden.cpp); then RMSNorm's device form (namespace gpu)
// against the CPU form, as tests/kernels/test_kernels_device_forms.cpp does for LayerNorm.
// RoPE and SwiGLU's forward are element-wise, one form on every build (SwiGLU's bf16 forward has an
// AVX-512 form, checked against its definition); SwiGLU's bf16 backward sums columns, and its device
// form is compared with the CPU form.
// Grouped-query attention with a sliding window (kernels/attention_gqa.hpp) against its definition
// computed in double here, its device form against its CPU form, and GPT-2's attention where the
// two coincide (one K/V head per query head, no window); its bf16 form (the fused AVX512-BF16
// kernel where built, else the portable one) against the same definition on the bf16 inputs.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "base/rng.hpp"
#include "io/h5.hpp"
#include "kernels/attention.hpp"
#include "kernels/attention_gqa.hpp"
#include "kernels/half.hpp"
#include "kernels/rmsnorm.hpp"
#include "kernels/rope.hpp"
#include "kernels/swiglu.hpp"
#include "support/model_memory.hpp"

using namespace zero3d;
using namespace zero3d::kernels;

namespace {

constexpr float kGoldenTolerance = 1e-4f;  // the GPT-2 goldens' per-tensor max |diff|

using test_support::Buffer;
using test_support::ShiftedPointer;
using test_support::expect_close;
using test_support::expect_same_bits;
using test_support::value;

std::string golden_path() { return std::string(ZERO3D_GOLDEN_DIR) + "/llama_kernels.h5"; }

// The shapes, read once; tensors are read per use, the file open only while it is read (no HDF5
// handle may outlive the test main's MPI_Finalize).
struct Golden {
  int64_t B = 0, T = 0, C = 0, I = 0, H = 0, Hkv = 0, head_dim = 0;
  std::vector<float> floats(const std::string& name) const { return h5::File::open_read(golden_path()).read_floats(name); }
};

const Golden& golden() {
  static const Golden g = [] {
    Golden r;
    const h5::File f = h5::File::open_read(golden_path());
    for (auto [name, v] : {std::pair<const char*, int64_t*>{"B", &r.B}, {"T", &r.T}, {"C", &r.C}, {"I", &r.I},
                           {"H", &r.H}, {"Hkv", &r.Hkv}, {"head_dim", &r.head_dim}})
      if (!h5::read_attribute(f.id(), name, *v)) ADD_FAILURE() << "llama_kernels.h5 lacks attribute " << name;
    return r;
  }();
  return g;
}

// max |got - want| over a tensor, checked against the goldens' tolerance and printed (the
// figures the closing note quotes). NaN counts as a failure.
void expect_matches(const std::string& what, const std::vector<float>& got, const std::vector<float>& want,
                    float tolerance = kGoldenTolerance) {
  ASSERT_EQ(got.size(), want.size()) << what;
  double worst = 0.0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double d = std::fabs(static_cast<double>(got[i]) - want[i]);
    if (!(d <= worst)) worst = std::isnan(d) ? INFINITY : d;
  }
  std::printf("[ golden   ] %-34s max |diff| %.3g\n", what.c_str(), worst);
  EXPECT_LE(worst, tolerance) << what;
}

std::vector<bf16> rounded(const std::vector<float>& x) {
  std::vector<bf16> out(x.size());
  for (size_t i = 0; i < x.size(); ++i) out[i] = to_bf16(x[i]);
  return out;
}

std::vector<float> widened(const std::vector<bf16>& x) {
  std::vector<float> out(x.size());
  for (size_t i = 0; i < x.size(); ++i) out[i] = to_float(x[i]);
  return out;
}

std::vector<float> random_vector(size_t n, uint64_t stream, float scale = 1.0f, float shift = 0.0f) {
  return test_support::normal_vector(32, n, stream, scale, shift);
}

// ---- RMSNorm -----------------------------------------------------------------------------------

constexpr float kRmsEps = 1e-6f;  // make_llama_kernels_golden.py's RMS_EPS (Llama's rms_norm_eps)

TEST(LlamaRmsNorm, MatchesPyTorch) {
  const Golden& g = golden();
  const Index N = g.B * g.T, C = g.C;
  ASSERT_EQ(g.floats("rmsnorm/eps")[0], kRmsEps);
  Buffer<float> x(g.floats("rmsnorm/x")), w(g.floats("rmsnorm/weight")), dout(g.floats("rmsnorm/d_out"));
  Buffer<float> out(N * C), rstd(N), dx(N * C), dw(C);
  rmsnorm_forward(out.data(), rstd.data(), x.data(), w.data(), N, C, kRmsEps);
  expect_matches("rmsnorm out", out.host(), g.floats("rmsnorm/out"));
  expect_matches("rmsnorm rstd", rstd.host(), g.floats("rmsnorm/rstd"));
  rmsnorm_backward(dx.data(), dw.data(), dout.data(), x.data(), w.data(), rstd.data(), N, C);
  expect_matches("rmsnorm grads/x", dx.host(), g.floats("rmsnorm/grads/x"));
  expect_matches("rmsnorm grads/weight", dw.host(), g.floats("rmsnorm/grads/weight"));
}

// Both gradients accumulate (+=): a second backward doubles them; null pointers skip a part.
TEST(LlamaRmsNorm, BackwardAccumulatesAndSkipsNullParts) {
  const Golden& g = golden();
  const Index N = g.B * g.T, C = g.C;
  Buffer<float> x(g.floats("rmsnorm/x")), w(g.floats("rmsnorm/weight")), dout(g.floats("rmsnorm/d_out"));
  Buffer<float> out(N * C), rstd(N), dx(N * C), dw(C), dx_only(N * C), dw_only(C);
  rmsnorm_forward(out.data(), rstd.data(), x.data(), w.data(), N, C, kRmsEps);
  for (int k = 0; k < 2; ++k) rmsnorm_backward(dx.data(), dw.data(), dout.data(), x.data(), w.data(), rstd.data(), N, C);
  rmsnorm_backward(dx_only.data(), static_cast<float*>(nullptr), dout.data(), x.data(), w.data(), rstd.data(), N, C);
  rmsnorm_backward(static_cast<float*>(nullptr), dw_only.data(), dout.data(), x.data(), w.data(), rstd.data(), N, C);
  auto twice = [](std::vector<float> v) {
    for (float& e : v) e *= 2.0f;
    return v;
  };
  expect_same_bits("dinp after two backwards", dx.host(), twice(dx_only.host()));
  expect_same_bits("dweight after two backwards", dw.host(), twice(dw_only.host()));
}

// bf16 weights widen exactly: the same bits as fp32 weights holding the rounded values; a bf16
// output is the fp32 output rounded once.
TEST(LlamaRmsNorm, Bf16WeightAndOutputAreTheFp32FormRounded) {
  const Golden& g = golden();
  const Index N = g.B * g.T, C = g.C;
  const std::vector<bf16> w16 = rounded(g.floats("rmsnorm/weight"));
  Buffer<float> x(g.floats("rmsnorm/x")), w32(widened(w16));
  Buffer<bf16> w(w16);
  Buffer<float> out32(N * C), rstd32(N), out(N * C), rstd(N);
  Buffer<bf16> out16(N * C);
  rmsnorm_forward(out32.data(), rstd32.data(), x.data(), w32.data(), N, C, kRmsEps);
  rmsnorm_forward(out.data(), rstd.data(), x.data(), w.data(), N, C, kRmsEps);
  expect_same_bits("out, bf16 weight", out.host(), out32.host());
  rmsnorm_forward(out16.data(), rstd.data(), x.data(), w.data(), N, C, kRmsEps);
  expect_same_bits("bf16 out", out16.host(), rounded(out32.host()));
}

// `shifted`: the one pointer off a 16-byte boundary (0 out, 1 inp, 2 weight, 3 dinp, 4 dweight,
// 5 dout; -1 none).
template <typename P, typename O>
void check_rmsnorm_device_form(Index N, Index C, int shifted = -1) {
  const ShiftedPointer shift{shifted};
  const std::string at = " [" + std::to_string(N) + " x " + std::to_string(C) + "]" + shift.label();
  const auto x = random_vector(N * C, 1, 1.0f, 0.3f), w32 = random_vector(C, 2, 0.2f, 1.0f);
  std::vector<P> w(C);
  for (Index c = 0; c < C; ++c) w[c] = from_float<P>(w32[c]);
  Buffer<float> in(x, shift(1));
  Buffer<P> weight(w, shift(2));
  auto forward = [&](bool device) {
    Buffer<O> out(N * C, shift(0));
    Buffer<float> rstd(N);
    if (device) gpu::rmsnorm_forward(out.data(), rstd.data(), in.data(), weight.data(), N, C, kRmsEps);
    else rmsnorm_forward(out.data(), rstd.data(), in.data(), weight.data(), N, C, kRmsEps);
    return std::make_pair(out.host(), rstd.host());
  };
  const auto [out, rstd] = forward(true);
  const auto [cpu_out, cpu_rstd] = forward(false);
  // The sum of squares is added in another order (one at a time here, SIMD pieces in the CPU
  // form): rstd moves by a few ulp of itself, the output by those, and a bf16 rounding may flip.
  expect_close("rstd" + at, rstd, cpu_rstd, 0.0, 2e-6);
  expect_close("out" + at, out, cpu_out, 2e-5, std::is_same_v<O, bf16> ? 1.0 / 128 : 0.0);
  const auto [again_out, again_rstd] = forward(true);
  expect_same_bits("out, second run" + at, again_out, out);
  expect_same_bits("rstd, second run" + at, again_rstd, rstd);

  const auto dy = random_vector(N * C, 3), dx0 = random_vector(N * C, 4), dw0 = random_vector(C, 5);
  Buffer<float> dout(dy, shift(5)), saved_rstd(cpu_rstd);
  auto backward = [&](bool device) {
    Buffer<float> dx(dx0, shift(3)), dw(dw0, shift(4));
    if (device)
      gpu::rmsnorm_backward(dx.data(), dw.data(), dout.data(), in.data(), weight.data(), saved_rstd.data(), N, C);
    else rmsnorm_backward(dx.data(), dw.data(), dout.data(), in.data(), weight.data(), saved_rstd.data(), N, C);
    return std::make_pair(dx.host(), dw.host());
  };
  const auto [dx, dw] = backward(true);
  const auto [cpu_dx, cpu_dw] = backward(false);
  // The row's mean is added in another order: a few ulp of Σ|dnorm·norm|/C. The weight's column
  // sums: one chunk adds the rows in the CPU form's order (but for a product fused into its add
  // in one form and not the other); more chunks add 64-row sums in order: a few ulp of Σ|dy·norm|.
  expect_close("dinp" + at, dx, cpu_dx, 2e-5, 2e-6);
  expect_close("dweight" + at, dw, cpu_dw, 2e-6 * N, 0.0);
  const auto [again_dx, again_dw] = backward(true);
  expect_same_bits("dinp, second run" + at, again_dx, dx);
  expect_same_bits("dweight, second run" + at, again_dw, dw);
}

// One chunk of rows and several (130 = two full chunks and a ragged one); C a multiple of the
// CPU form's 64-column block and not.
TEST(LlamaRmsNorm, DeviceFormMatchesCpuForm) {
  for (const auto& [N, C] : {std::pair<Index, Index>{16, 64}, {130, 100}, {64, 384}}) {
    check_rmsnorm_device_form<float, float>(N, C);
    check_rmsnorm_device_form<bf16, float>(N, C);
    check_rmsnorm_device_form<bf16, bf16>(N, C);
  }
}

// Rows 384 wide take whole vectors; with any one pointer off a 16-byte boundary, elements.
TEST(LlamaRmsNorm, DeviceFormTakesElementsWhereAnyPointerIsOffAVector) {
  for (int shifted = 0; shifted < 6; ++shifted) {
    check_rmsnorm_device_form<float, float>(70, 384, shifted);
    check_rmsnorm_device_form<bf16, bf16>(70, 384, shifted);
  }
}

// ---- SwiGLU ------------------------------------------------------------------------------------

TEST(LlamaSwiGlu, MatchesPyTorch) {
  const Golden& g = golden();
  const Index N = g.B * g.T, I = g.I;
  Buffer<float> gate(g.floats("swiglu/gate")), up(g.floats("swiglu/up")), dout(g.floats("swiglu/d_out"));
  Buffer<float> out(N * I), dgate(N * I), dup(N * I);
  swiglu_forward(out.data(), gate.data(), up.data(), N, I, I);
  expect_matches("swiglu out", out.host(), g.floats("swiglu/out"));
  swiglu_backward(dgate.data(), dup.data(), dout.data(), gate.data(), up.data(), N, I, I);
  expect_matches("swiglu grads/gate", dgate.host(), g.floats("swiglu/grads/gate"));
  expect_matches("swiglu grads/up", dup.host(), g.floats("swiglu/grads/up"));
}

// A fused [gate | up] row (stride 2I) gives the separate buffers' bits, its gradients at the same
// layout; a bf16 output is the fp32 one rounded once; bf16 inputs read as their widened values.
TEST(LlamaSwiGlu, FusedLayoutAndBf16MatchTheFp32Form) {
  const Golden& g = golden();
  const Index N = g.B * g.T, I = g.I;
  const auto gate = g.floats("swiglu/gate"), up = g.floats("swiglu/up");
  std::vector<float> fused(N * 2 * I);
  for (Index i = 0; i < N; ++i)
    for (Index c = 0; c < I; ++c) fused[i * 2 * I + c] = gate[i * I + c], fused[i * 2 * I + I + c] = up[i * I + c];
  Buffer<float> gb(gate), ub(up), fb(fused), dout(g.floats("swiglu/d_out"));
  Buffer<float> out(N * I), fused_out(N * I), dgate(N * I), dup(N * I), dfused(N * 2 * I);
  Buffer<bf16> out16(N * I);
  swiglu_forward(out.data(), gb.data(), ub.data(), N, I, I);
  swiglu_forward(fused_out.data(), fb.data(), fb.data() + I, N, I, 2 * I);
  expect_same_bits("out, fused layout", fused_out.host(), out.host());
  swiglu_forward(out16.data(), gb.data(), ub.data(), N, I, I);
  expect_same_bits("bf16 out", out16.host(), rounded(out.host()));
  swiglu_backward(dgate.data(), dup.data(), dout.data(), gb.data(), ub.data(), N, I, I);
  swiglu_backward(dfused.data(), dfused.data() + I, dout.data(), fb.data(), fb.data() + I, N, I, 2 * I);
  const auto df = dfused.host(), dg = dgate.host(), du = dup.host();
  std::vector<float> dg_fused(N * I), du_fused(N * I);
  for (Index i = 0; i < N; ++i)
    for (Index c = 0; c < I; ++c) dg_fused[i * I + c] = df[i * 2 * I + c], du_fused[i * I + c] = df[i * 2 * I + I + c];
  expect_same_bits("dgate, fused layout", dg_fused, dg);
  expect_same_bits("dup, fused layout", du_fused, du);

  const std::vector<bf16> gate16 = rounded(gate), up16 = rounded(up);
  Buffer<bf16> g16(gate16), u16(up16);
  Buffer<float> gw(widened(gate16)), uw(widened(up16)), out_w(N * I), out_in16(N * I);
  swiglu_forward(out_w.data(), gw.data(), uw.data(), N, I, I);
  swiglu_forward(out_in16.data(), g16.data(), u16.data(), N, I, I);
  expect_same_bits("out from bf16 inputs", out_in16.host(), out_w.host());
}

// The bf16 MLP's SwiGLU (gate_up_proj wrote a fused bf16 [gate | up]; its output goes to the bf16
// down product): against silu(g)·u in double on the bf16 inputs. The output is the reference
// rounded to bf16; the fast exponential may move a value across a rounding boundary, so one bf16
// step (2⁻⁸ relative) is allowed. 67 columns: four full vectors and a 3-lane tail per row.
TEST(LlamaSwiGlu, Bf16ForwardIsSiluTimesUpRounded) {
  const Index N = 5, I = 67;
  const std::vector<bf16> fused = rounded(random_vector(N * 2 * I, 41, 4.0f));
  Buffer<bf16> in(fused), out(N * I);
  swiglu_forward(out.data(), in.data(), in.data() + I, N, I, 2 * I);
  const std::vector<bf16> y = out.host();
  for (Index i = 0; i < N; ++i)
    for (Index c = 0; c < I; ++c) {
      const double g = to_float(fused[i * 2 * I + c]), u = to_float(fused[i * 2 * I + I + c]);
      const double want = g / (1.0 + std::exp(-g)) * u;
      EXPECT_NEAR(to_float(y[i * I + c]), want, 1e-6 + std::fabs(want) / 256) << i << " " << c;
    }
}

// Its backward writes [dgate | dup] in bf16 straight into the gate/up product's operand and adds
// the unrounded values' column sums into the biases' gradient (mlp_bias; null: none, the same
// gradient): against silu's derivative in double, each value within one bf16 step, the sums
// within fp32 rounding of N terms.
TEST(LlamaSwiGlu, Bf16BackwardSummingColumnsMatchesSilusDerivative) {
  const Index N = 5, I = 67;
  const std::vector<bf16> fused = rounded(random_vector(N * 2 * I, 42, 4.0f));
  const auto dy = random_vector(N * I, 43);
  Buffer<bf16> in(fused), d(N * 2 * I), d_no_sums(N * 2 * I);
  Buffer<float> dout(dy), sums(std::vector<float>(2 * I, 0.5f));
  swiglu_backward_summing_columns(d.data(), sums.data(), dout.data(), in.data(), N, I);
  swiglu_backward_summing_columns(d_no_sums.data(), static_cast<float*>(nullptr), dout.data(), in.data(), N, I);
  expect_same_bits("gradient without sums", d_no_sums.host(), d.host());
  const std::vector<bf16> got = d.host();
  const std::vector<float> got_sums = sums.host();
  std::vector<double> want_sums(2 * I, 0.5);
  for (Index i = 0; i < N; ++i)
    for (Index c = 0; c < I; ++c) {
      const double g = to_float(fused[i * 2 * I + c]), u = to_float(fused[i * 2 * I + I + c]), y = dy[i * I + c];
      const double s = 1.0 / (1.0 + std::exp(-g));
      const double dgate = y * u * s * (1.0 + g * (1.0 - s)), dup = y * g * s;
      EXPECT_NEAR(to_float(got[i * 2 * I + c]), dgate, 1e-6 + std::fabs(dgate) / 256) << i << " " << c;
      EXPECT_NEAR(to_float(got[i * 2 * I + I + c]), dup, 1e-6 + std::fabs(dup) / 256) << i << " " << c;
      want_sums[c] += dgate;
      want_sums[I + c] += dup;
    }
  for (Index o = 0; o < 2 * I; ++o) EXPECT_NEAR(got_sums[o], want_sums[o], 1e-5) << o;
}

// The device form (namespace gpu) against the CPU form: one chunk of rows and several, I a
// multiple of 16 and not, with and without the bias sums; at I 256 also with each pointer in turn
// one element off a 16-byte boundary (0 d, 1 dout, 2 [gate | up]).
TEST(LlamaSwiGlu, Bf16BackwardDeviceFormMatchesCpuForm) {
  for (const auto& [N, I, shifted] : {std::tuple<Index, Index, int>{5, 37, -1}, {64, 256, -1}, {130, 100, -1},
                                      {70, 256, 0}, {70, 256, 1}, {70, 256, 2}}) {
    const std::string at = " [" + std::to_string(N) + " x " + std::to_string(I) + ", pointer " +
                           std::to_string(shifted) + " shifted]";
    const ShiftedPointer shift{shifted};
    Buffer<bf16> in(rounded(random_vector(N * 2 * I, 44, 2.0f)), shift(2));
    Buffer<float> dout(random_vector(N * I, 45), shift(1));
    const auto sums0 = random_vector(2 * I, 46);
    auto run = [&](bool device, bool with_sums) {
      Buffer<float> s(sums0);
      Buffer<bf16> d(N * 2 * I, shift(0));
      float* sums = with_sums ? s.data() : nullptr;
      if (device) gpu::swiglu_backward_summing_columns(d.data(), sums, dout.data(), in.data(), N, I);
      else swiglu_backward_summing_columns(d.data(), sums, dout.data(), in.data(), N, I);
      return std::make_pair(d.host(), s.host());
    };
    const auto [d, sums] = run(true, true);
    const auto [cpu_d, cpu_sums] = run(false, true);
    // The CPU form's AVX-512 lanes take σ through a 2^x polynomial (relative error 2⁻²²), the
    // device form through fast_exp: the gradients differ by a few ulp of fp32 and a bf16
    // rounding may flip (one bf16 ulp, 2⁻⁷ relative); the column sums add those over N rows, in
    // chunks past 64 rows.
    expect_close("d[gate | up]" + at, d, cpu_d, 1e-6, 1.0 / 128);
    expect_close("column sums" + at, sums, cpu_sums, 2e-6 * N, 0.0);
    expect_same_bits("d without sums" + at, run(true, false).first, d);
    expect_same_bits("sums untouched without sums" + at, run(true, false).second, sums0);
    const auto [again_d, again_sums] = run(true, true);
    expect_same_bits("d, second run" + at, again_d, d);
    expect_same_bits("column sums, second run" + at, again_sums, sums);
  }
}

// The device form's forward (namespace gpu): whole vectors where I, ld and the pointers allow
// (I 256, two buffers and the fused [gate | up]), one element a thread otherwise (I 37, or one
// pointer in turn one element off a 16-byte boundary: 0 out, 1 gate, 2 up).
TEST(LlamaSwiGlu, ForwardDeviceFormMatchesCpuForm) {
  for (const auto& [N, I] : {std::pair<Index, Index>{5, 37}, {6, 256}})
    for (const Index ld : {I, 2 * I})
      for (int shifted = -1; shifted < 3; ++shifted) {
        const std::string at = " [" + std::to_string(N) + " x " + std::to_string(I) + ", ld " + std::to_string(ld) +
                               ", pointer " + std::to_string(shifted) + " shifted]";
        const auto x = random_vector(N * 2 * I + 1, 47, 2.0f);
        // where gate and up start: the first buffer and the second, or gate's left and right half
        const Index gate = shifted == 1 ? 1 : 0, up = (ld == I ? N * I : I) + (shifted == 2 ? 1 : 0);
        const size_t out_shift = shifted == 0 ? 1 : 0;
        Buffer<float> in32(x);
        Buffer<bf16> in16(rounded(x));
        auto run32 = [&](bool device) {
          Buffer<float> out(N * I, out_shift);
          if (device) gpu::swiglu_forward(out.data(), in32.data() + gate, in32.data() + up, N, I, ld);
          else swiglu_forward(out.data(), in32.data() + gate, in32.data() + up, N, I, ld);
          return out.host();
        };
        expect_same_bits("fp32" + at, run32(true), run32(false));  // the same arithmetic per element
        auto run16 = [&](bool device) {
          Buffer<bf16> out(N * I, out_shift);
          if (device) gpu::swiglu_forward(out.data(), in16.data() + gate, in16.data() + up, N, I, ld);
          else swiglu_forward(out.data(), in16.data() + gate, in16.data() + up, N, I, ld);
          return out.host();
        };
        // the CPU form's AVX-512 lanes take σ through a 2^x polynomial: a bf16 rounding may flip
        expect_close("bf16" + at, run16(true), run16(false), 1e-6, 1.0 / 128);
      }
}

// ---- RoPE --------------------------------------------------------------------------------------

// /rope/<case>/params in make_llama_kernels_golden.py's ROPE_PARAMS order.
RopeConfig rope_config(const std::string& name, const std::vector<float>& p) {
  RopeConfig c;
  c.type = name == "default" ? RopeType::Default
           : name == "linear" ? RopeType::Linear
           : name == "dynamic" ? RopeType::Dynamic
           : name.rfind("yarn", 0) == 0 ? RopeType::Yarn
                                        : RopeType::Llama3;
  c.theta = p[0];
  c.factor = p[1];
  c.max_position_embeddings = static_cast<int64_t>(p[2]);
  c.original_max_position_embeddings = static_cast<int64_t>(p[3]);
  c.low_freq_factor = p[4];
  c.high_freq_factor = p[5];
  c.beta_fast = p[6];
  c.beta_slow = p[7];
  c.attention_factor = p[8];
  c.mscale = p[9];
  c.mscale_all_dim = p[10];
  return c;
}

class LlamaRope : public ::testing::TestWithParam<std::string> {};

TEST_P(LlamaRope, MatchesPyTorch) {
  const Golden& g = golden();
  const std::string at = "rope/" + GetParam() + "/";
  const std::vector<float> params = g.floats(at + "params");
  ASSERT_EQ(params.size(), 12u);
  const RopeConfig cfg = rope_config(GetParam(), params);
  const Index T = g.T, hd = g.head_dim, seq_len = static_cast<Index>(params[11]);
  ASSERT_EQ(seq_len, T);

  // The host's frequencies and attention factor: both computed in double, stored as float.
  const std::vector<double> inv_freq = rope_inv_freq(cfg, hd, seq_len);
  const std::vector<float> want_inv_freq = g.floats(at + "inv_freq");
  ASSERT_EQ(inv_freq.size(), want_inv_freq.size());
  for (size_t i = 0; i < inv_freq.size(); ++i)
    EXPECT_NEAR(inv_freq[i], want_inv_freq[i], 1e-6 * want_inv_freq[i]) << at << "inv_freq[" << i << "]";
  EXPECT_NEAR(rope_attention_factor(cfg), g.floats(at + "attention_factor")[0], 1e-6) << at;

  std::vector<float> cos, sin;
  rope_tables(cos, sin, cfg, hd, T);
  Buffer<float> cb(cos), sb(sin), qkv(g.floats(at + "qkv")), dqkv(g.floats(at + "d_out"));
  rope_forward(qkv.data(), cb.data(), sb.data(), g.B, T, g.H, g.Hkv, hd);
  expect_matches(at + "out", qkv.host(), g.floats(at + "out"));
  rope_backward(dqkv.data(), cb.data(), sb.data(), g.B, T, g.H, g.Hkv, hd);
  expect_matches(at + "grads/qkv", dqkv.host(), g.floats(at + "grads/qkv"));
}

INSTANTIATE_TEST_SUITE_P(RopeTypes, LlamaRope,
                         ::testing::Values("default", "linear", "dynamic", "yarn", "yarn_mscale", "llama3"));

// Dynamic NTK leaves the base alone while the batch fits max_position_embeddings (Hugging Face
// recomputes only past it); yarn without original_max_position_embeddings falls back to the
// model's max_position_embeddings; an explicit attention_factor wins.
TEST(LlamaRopeConfig, DynamicWithinMaxPositionsIsDefaultAndYarnFallsBack) {
  RopeConfig plain, dynamic;
  dynamic.type = RopeType::Dynamic;
  dynamic.factor = 4.0;
  dynamic.max_position_embeddings = 64;
  EXPECT_EQ(rope_inv_freq(dynamic, 16, 64), rope_inv_freq(plain, 16, 64));
  EXPECT_NE(rope_inv_freq(dynamic, 16, 65), rope_inv_freq(plain, 16, 65));
  RopeConfig yarn, yarn_orig;
  yarn.type = yarn_orig.type = RopeType::Yarn;
  yarn.factor = yarn_orig.factor = 4.0;
  yarn.max_position_embeddings = 512;  // the ramp over dimensions 0..4 (2048 gives 2..6)
  yarn_orig.max_position_embeddings = 8192;
  yarn_orig.original_max_position_embeddings = 512;
  EXPECT_NE(rope_inv_freq(yarn, 16, 8), rope_inv_freq(plain, 16, 8));
  EXPECT_EQ(rope_inv_freq(yarn, 16, 8), rope_inv_freq(yarn_orig, 16, 8));
  EXPECT_DOUBLE_EQ(rope_attention_factor(yarn), 0.1 * std::log(4.0) + 1.0);
  yarn.attention_factor = 0.5;
  EXPECT_EQ(rope_attention_factor(yarn), 0.5);
}

// RoFormer's property, which the layout must keep: q·k after the rotation depends on the
// positions only through their difference (attention factor 1: default).
TEST(LlamaRopeConfig, RotatedDotProductDependsOnRelativePosition) {
  const Index T = 12, hd = 16, H = 2, Hkv = 1, width = (H + 2 * Hkv) * hd;
  std::vector<float> cos, sin;
  rope_tables(cos, sin, RopeConfig{}, hd, T);
  const auto q = random_vector(hd, 6), k = random_vector(hd, 7);
  std::vector<float> rows(T * width, 0.0f);
  for (Index t = 0; t < T; ++t)
    for (Index d = 0; d < hd; ++d) rows[t * width + d] = q[d], rows[t * width + H * hd + d] = k[d];
  Buffer<float> qkv(rows), cb(cos), sb(sin);
  rope_forward(qkv.data(), cb.data(), sb.data(), 1, T, H, Hkv, hd);
  const auto r = qkv.host();
  auto dot = [&](Index tq, Index tk) {
    double s = 0.0;
    for (Index d = 0; d < hd; ++d) s += static_cast<double>(r[tq * width + d]) * r[tk * width + H * hd + d];
    return s;
  };
  for (Index delta = 0; delta < 4; ++delta)
    for (Index t = delta; t < T; ++t) EXPECT_NEAR(dot(t, t - delta), dot(delta, 0), 1e-4) << "t " << t << " delta " << delta;
}

// ---- Grouped-query attention -------------------------------------------------------------------

// The definition in double, one (batch, query head, query) at a time: key j is visible to query i
// when j <= i and (window 0, or i − j < window); p_ij = softmax over the visible j of q_i·k_j/√d,
// k and v from K/V head h / (H/Hkv); out_i = Σ_j p_ij v_j. The gradients for loss Σ out ⊙ dout:
// dv_j += p_ij dout_i, ds_ij = p_ij (dout_i·v_j − Σ_k p_ik dout_i·v_k), dq_i = Σ_j ds_ij k_j/√d,
// dk_j += ds_ij q_i/√d (summed over the query heads sharing the K/V head).
struct GqaReference {
  std::vector<double> out, att, dqkv;
};
GqaReference gqa_reference(const std::vector<float>& qkv, const std::vector<float>& dout, Index B, Index T, Index H,
                           Index Hkv, Index d, Index window) {
  const Index W = (H + 2 * Hkv) * d, A = H * d;
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  GqaReference r{std::vector<double>(B * T * A), std::vector<double>(B * H * T * T), std::vector<double>(B * T * W)};
  for (Index b = 0; b < B; ++b)
    for (Index h = 0; h < H; ++h) {
      const Index g = h / (H / Hkv);
      auto q = [&](Index t, Index x) { return static_cast<double>(qkv[(b * T + t) * W + h * d + x]); };
      auto k = [&](Index t, Index x) { return static_cast<double>(qkv[(b * T + t) * W + (H + g) * d + x]); };
      auto v = [&](Index t, Index x) { return static_cast<double>(qkv[(b * T + t) * W + (H + Hkv + g) * d + x]); };
      for (Index i = 0; i < T; ++i) {
        const Index j0 = window > 0 ? std::max<Index>(0, i - window + 1) : 0;
        double* p = &r.att[((b * H + h) * T + i) * T];
        double mx = -INFINITY, sum = 0.0;
        for (Index j = j0; j <= i; ++j) {
          double s = 0.0;
          for (Index x = 0; x < d; ++x) s += q(i, x) * k(j, x);
          p[j] = s * scale;
          mx = std::max(mx, p[j]);
        }
        for (Index j = j0; j <= i; ++j) sum += p[j] = std::exp(p[j] - mx);
        for (Index j = j0; j <= i; ++j) p[j] /= sum;
        const float* dy = &dout[(b * T + i) * A + h * d];
        std::vector<double> dp(T, 0.0);
        double dot = 0.0;
        for (Index j = j0; j <= i; ++j) {
          for (Index x = 0; x < d; ++x) {
            r.out[(b * T + i) * A + h * d + x] += p[j] * v(j, x);
            r.dqkv[(b * T + j) * W + (H + Hkv + g) * d + x] += p[j] * dy[x];
            dp[j] += dy[x] * v(j, x);
          }
          dot += p[j] * dp[j];
        }
        for (Index j = j0; j <= i; ++j) {
          const double ds = p[j] * (dp[j] - dot) * scale;
          for (Index x = 0; x < d; ++x) {
            r.dqkv[(b * T + i) * W + h * d + x] += ds * k(j, x);
            r.dqkv[(b * T + j) * W + (H + g) * d + x] += ds * q(i, x);
          }
        }
      }
    }
  return r;
}

std::vector<float> as_floats(const std::vector<double>& x) { return std::vector<float>(x.begin(), x.end()); }

struct GqaCase {
  Index B, T, H, Hkv, d, window;
};
std::string describe(const GqaCase& c) {
  return " [B " + std::to_string(c.B) + ", T " + std::to_string(c.T) + ", H " + std::to_string(c.H) + ", Hkv " +
         std::to_string(c.Hkv) + ", d " + std::to_string(c.d) + ", window " + std::to_string(c.window) + "]";
}

// Causal and windowed; windows that end inside a query row block, cross the 64-row block
// boundary (T 130: three blocks) or exceed T; grouped (2 query heads a K/V head), multi-query
// (Hkv 1) and plain multi-head (Hkv = H); T 300, window 30: five of the device form's causal blocks.
const GqaCase kGqaCases[] = {{2, 80, 4, 2, 8, 0}, {2, 80, 4, 2, 8, 20}, {1, 130, 4, 1, 8, 70},
                             {2, 16, 2, 2, 16, 100}, {1, 40, 6, 3, 4, 1}, {1, 300, 4, 2, 8, 30}};

// One case's random inputs (qkv from `seed`, dy from seed + 1) and the CPU form's forward and
// backward on them.
struct GqaRun {
  std::vector<float> qkv, dy;
  Buffer<float> in, dout, out, att, dqkv, scratch;
  GqaRun(const GqaCase& c, unsigned seed)
      : qkv(random_vector(c.B * c.T * (c.H + 2 * c.Hkv) * c.d, seed, 0.8f)),
        dy(random_vector(c.B * c.T * c.H * c.d, seed + 1)),
        in(qkv), dout(dy), out(c.B * c.T * c.H * c.d), att(c.B * c.H * c.T * c.T),
        dqkv(c.B * c.T * (c.H + 2 * c.Hkv) * c.d), scratch(kRowBlock * c.T) {
    gqa_attention_forward(out.data(), att.data(), in.data(), c.B, c.T, c.H, c.Hkv, c.d, c.window);
    gqa_attention_backward(dqkv.data(), scratch.data(), dout.data(), in.data(), att.data(), c.B, c.T, c.H, c.Hkv, c.d,
                           c.window);
  }
};

TEST(LlamaGqaAttention, MatchesTheDefinition) {
  for (const GqaCase& c : kGqaCases) {
    const std::string at = describe(c);
    const GqaRun cpu(c, 11);
    const GqaReference ref = gqa_reference(cpu.qkv, cpu.dy, c.B, c.T, c.H, c.Hkv, c.d, c.window);
    expect_close("out" + at, cpu.out.host(), as_floats(ref.out), 2e-6, 1e-5);
    expect_close("probabilities (zero where a key is not visible)" + at, cpu.att.host(), as_floats(ref.att), 1e-6,
                 1e-5);
    expect_close("dqkv" + at, cpu.dqkv.host(), as_floats(ref.dqkv), 1e-5, 1e-4);
  }
}

// The device form (dense heads, products batched over the B·Hkv groups) against the CPU form.
TEST(LlamaGqaAttention, DeviceFormMatchesCpuForm) {
  for (const GqaCase& c : kGqaCases) {
    const std::string at = describe(c);
    const GqaRun cpu(c, 13);
    Buffer<float> gout(c.B * c.T * c.H * c.d), gatt(c.B * c.H * c.T * c.T), gdqkv(c.B * c.T * (c.H + 2 * c.Hkv) * c.d);
    gpu::gqa_attention_forward(gout.data(), gatt.data(), cpu.in.data(), c.B, c.T, c.H, c.Hkv, c.d, c.window);
    gpu::gqa_attention_backward(gdqkv.data(), cpu.dout.data(), cpu.in.data(), gatt.data(), c.B, c.T, c.H, c.Hkv, c.d,
                                c.window);
    expect_close("out" + at, gout.host(), cpu.out.host(), 1e-6, 1e-5);
    expect_close("probabilities" + at, gatt.host(), cpu.att.host(), 1e-7, 1e-5);
    expect_close("dqkv" + at, gdqkv.host(), cpu.dqkv.host(), 1e-6, 1e-4);
  }
}

// Attention dropout (first_head: a tensor rank's global heads): the device form draws the CPU
// form's mask, and dropping changes the output.
TEST(LlamaGqaAttention, DeviceFormMatchesCpuFormWithDropout) {
  for (const GqaCase& c : kGqaCases) {
    const std::string at = describe(c);
    DropoutMask drop = dropout_mask(0.25, 9, 12, 1, DropoutSite::Probabilities);
    drop.first_head = 2;
    const GqaRun plain(c, 17);
    Buffer<float> out(c.B * c.T * c.H * c.d), att(c.B * c.H * c.T * c.T), dqkv(c.B * c.T * (c.H + 2 * c.Hkv) * c.d),
        scratch(kRowBlock * c.T);
    gqa_attention_forward(out.data(), att.data(), plain.in.data(), c.B, c.T, c.H, c.Hkv, c.d, c.window, drop);
    gqa_attention_backward(dqkv.data(), scratch.data(), plain.dout.data(), plain.in.data(), att.data(), c.B, c.T, c.H,
                           c.Hkv, c.d, c.window, drop);
    expect_same_bits("kept probabilities are the undropped ones" + at, att.host(), plain.att.host());
    EXPECT_NE(out.host(), plain.out.host()) << at;
    Buffer<float> gout(c.B * c.T * c.H * c.d), gatt(c.B * c.H * c.T * c.T), gdqkv(c.B * c.T * (c.H + 2 * c.Hkv) * c.d);
    gpu::gqa_attention_forward(gout.data(), gatt.data(), plain.in.data(), c.B, c.T, c.H, c.Hkv, c.d, c.window, drop);
    gpu::gqa_attention_backward(gdqkv.data(), plain.dout.data(), plain.in.data(), gatt.data(), c.B, c.T, c.H, c.Hkv,
                                c.d, c.window, drop);
    expect_close("out" + at, gout.host(), out.host(), 1e-6, 1e-5);
    expect_close("dqkv" + at, gdqkv.host(), dqkv.host(), 1e-6, 1e-4);
  }
}

// With one K/V head per query head and no window, grouped-query attention is GPT-2's causal
// attention (attention.hpp) on the same [q | k | v] rows, bit for bit.
TEST(LlamaGqaAttention, MultiHeadWithoutWindowIsGpt2AttentionBitForBit) {
  const Index B = 2, T = 80, H = 4, d = 8, C = H * d;
  const auto qkv = random_vector(B * T * 3 * C, 15, 0.8f), dy = random_vector(B * T * C, 16);
  Buffer<float> in(qkv), dout(dy), out(B * T * C), att(B * H * T * T), dqkv(B * T * 3 * C), scratch(kRowBlock * T);
  Buffer<float> gpt_out(B * T * C), gpt_att(B * H * T * T), gpt_dqkv(B * T * 3 * C);
  gqa_attention_forward(out.data(), att.data(), in.data(), B, T, H, H, d, 0);
  gqa_attention_backward(dqkv.data(), scratch.data(), dout.data(), in.data(), att.data(), B, T, H, H, d, 0);
  attention_forward(gpt_out.data(), gpt_att.data(), in.data(), B, T, C, H);
  attention_backward(gpt_dqkv.data(), scratch.data(), dout.data(), in.data(), gpt_att.data(), B, T, C, H);
  expect_same_bits("out", out.host(), gpt_out.host());
  expect_same_bits("dqkv", dqkv.host(), gpt_dqkv.host());
}

// ---- bf16 compute: the fused grouped-query kernel and the portable form -----------------------

// Largest |got − want| over elements [first, first + width) of each row of `stride`, relative to
// the largest |want| there (one of q, k or v's gradient, or the output); absolute where every
// |want| is 0 (window 1: each query sees itself only, so dq and dk are 0).
template <typename T>
double worst_relative(const std::vector<T>& got, const std::vector<double>& want, Index stride, Index first,
                      Index width) {
  double scale = 0.0, worst = 0.0;
  for (size_t r = 0; r < want.size() / stride; ++r)
    for (Index c = first; c < first + width; ++c) {
      scale = std::max(scale, std::fabs(want[r * stride + c]));
      const double e = std::fabs(value(got[r * stride + c]) - want[r * stride + c]);
      worst = std::isnan(e) ? INFINITY : std::max(worst, e);
    }
  return scale > 0.0 ? worst / scale : worst;
}

struct Bf16Run {
  std::vector<bf16> qkv;
  std::vector<float> dy;
  Buffer<bf16> in, out;
  Buffer<float> dout, att, dqkv, scratch;
  Bf16Run(const GqaCase& c, unsigned seed, DropoutMask drop = {})
      : qkv(rounded(random_vector(c.B * c.T * (c.H + 2 * c.Hkv) * c.d, seed, 0.8f))),
        dy(random_vector(c.B * c.T * c.H * c.d, seed + 1)), in(qkv), out(c.B * c.T * c.H * c.d), dout(dy),
        att(c.B * c.H * c.T * c.T), dqkv(c.B * c.T * (c.H + 2 * c.Hkv) * c.d), scratch(kRowBlock * c.T) {
    gqa_attention_forward(out.data(), att.data(), in.data(), c.B, c.T, c.H, c.Hkv, c.d, c.window, drop);
    gqa_attention_backward(dqkv.data(), scratch.data(), dout.data(), in.data(), att.data(), c.B, c.T, c.H, c.Hkv, c.d,
                           c.window, drop);
  }
};

// Groups of 1 (H = Hkv), 2 and 4 query heads a K/V head; head sizes 64 and 128 (and 16, the
// tiny models'); T past the 256-key online-softmax block and ragged against the 16-key groups;
// windows inside one forward query block, across key blocks (the forward then starts past key 0)
// and of 1 (a query sees itself only).
const GqaCase kBf16Cases[] = {{2, 80, 4, 4, 64, 0},   {1, 130, 4, 2, 64, 50}, {1, 300, 4, 1, 64, 0},
                              {1, 300, 8, 2, 64, 100}, {2, 77, 4, 2, 128, 0}, {1, 160, 2, 1, 128, 33},
                              {2, 64, 4, 2, 16, 24},  {1, 40, 6, 3, 16, 1}};

// bf16 P and dS in the products, fp32 sums: the fused GPT-2 kernel's bounds (test_attention_flash.cpp)
// against the definition, the output also rounded to bf16 (2^-9 of itself more).
void expect_within_the_fused_bounds(const std::vector<bf16>& out, const std::vector<float>& dqkv,
                                    const GqaReference& ref, const GqaCase& c) {
  const std::string at = describe(c);
  const Index W = (c.H + 2 * c.Hkv) * c.d;
  EXPECT_LT(worst_relative(out, ref.out, c.H * c.d, 0, c.H * c.d), 6e-3) << "out" << at;
  EXPECT_LT(worst_relative(dqkv, ref.dqkv, W, 0, c.H * c.d), 1e-2) << "dq" << at;
  EXPECT_LT(worst_relative(dqkv, ref.dqkv, W, c.H * c.d, c.Hkv * c.d), 1e-2) << "dk, summed over the group" << at;
  EXPECT_LT(worst_relative(dqkv, ref.dqkv, W, (c.H + c.Hkv) * c.d, c.Hkv * c.d), 1e-2) << "dv, summed over the group"
                                                                                        << at;
}

// The bf16 grouped-query attention (the fused AVX512-BF16 kernel where built) against the
// double-precision definition on the same bf16 q, k, v, within the fused bounds.
TEST(LlamaGqaAttentionBf16, MatchesTheDefinitionOnTheSameBf16Inputs) {
  for (const GqaCase& c : kBf16Cases) {
    const std::string at = describe(c);
#ifdef ZERO3D_FLASH_ATTENTION
    EXPECT_TRUE(gqa_attention_flash_chosen(c.B * c.H, c.T, c.d)) << "the fused kernel runs" << at;
#endif
    const Bf16Run run(c, 21);
    const GqaReference ref = gqa_reference(widened(run.qkv), run.dy, c.B, c.T, c.H, c.Hkv, c.d, c.window);
    const std::vector<float> dqkv = run.dqkv.host();
    for (float x : dqkv) ASSERT_TRUE(std::isfinite(x)) << "dqkv written everywhere" << at;
    expect_within_the_fused_bounds(run.out.host(), dqkv, ref, c);
  }
}

// The GPU's bf16 form (where the fused CUDA kernel does not run, without attention dropout): bf16
// products in causal query blocks, bf16 probabilities and dS, held on the CPU to the fused bounds
// against the definition on the same bf16 inputs; a second run gives the same bits.
TEST(LlamaGqaAttentionBf16, GpuFormMatchesTheDefinitionOnTheSameBf16Inputs) {
  for (const GqaCase& c : kBf16Cases) {
    const std::string at = describe(c);
    const Index W = (c.H + 2 * c.Hkv) * c.d;
    const std::vector<bf16> qkv = rounded(random_vector(c.B * c.T * W, 31, 0.8f));
    const std::vector<float> dy = random_vector(c.B * c.T * c.H * c.d, 32);
    auto run = [&] {
      Buffer<bf16> in(qkv), out(c.B * c.T * c.H * c.d);
      Buffer<float> dout(dy), att(c.B * c.H * c.T * c.T), dqkv(c.B * c.T * W);
      gpu::gqa_attention_forward_bf16(out.data(), att.data(), in.data(), c.B, c.T, c.H, c.Hkv, c.d, c.window);
      gpu::gqa_attention_backward_bf16(dqkv.data(), dout.data(), in.data(), att.data(), c.B, c.T, c.H, c.Hkv, c.d,
                                       c.window);
      return std::make_pair(out.host(), dqkv.host());
    };
    const auto [out, dqkv] = run();
    const GqaReference ref = gqa_reference(widened(qkv), dy, c.B, c.T, c.H, c.Hkv, c.d, c.window);
    expect_within_the_fused_bounds(out, dqkv, ref, c);  // (a value not finite counts as infinitely far)
    const auto [again_out, again_dqkv] = run();
    expect_same_bits("out, second run" + at, again_out, out);
    expect_same_bits("dqkv, second run" + at, again_dqkv, dqkv);
  }
}

// The group's dK and dV are summed in a fixed order: a second run gives the same bits.
TEST(LlamaGqaAttentionBf16, RepeatsItsBits) {
  for (const GqaCase& c : {GqaCase{1, 300, 8, 2, 64, 100}, GqaCase{2, 77, 4, 1, 128, 0}}) {
    const Bf16Run a(c, 23), b(c, 23);
    expect_same_bits("out" + describe(c), a.out.host(), b.out.host());
    expect_same_bits("att" + describe(c), a.att.host(), b.att.host());
    expect_same_bits("dqkv" + describe(c), a.dqkv.host(), b.dqkv.host());
  }
}

// One K/V head per query head and no window: GPT-2's fused bf16 attention on the same rows, bit
// for bit (one kernel serves both).
TEST(LlamaGqaAttentionBf16, MultiHeadWithoutWindowIsGpt2FusedAttentionBitForBit) {
#ifndef ZERO3D_FLASH_ATTENTION
  GTEST_SKIP() << "built without the fused kernel (AVX512-BF16)";
#endif
  const GqaCase c{2, 80, 4, 4, 64, 0};
  const Index C = c.H * c.d;
  const Bf16Run gqa(c, 25);
  Buffer<bf16> out(c.B * c.T * C);
  Buffer<float> att(c.B * c.H * c.T * c.T), dqkv(c.B * c.T * 3 * C);
  attention_forward(out.data(), att.data(), gqa.in.data(), c.B, c.T, C, c.H, DType::BF16);
  attention_backward(dqkv.data(), nullptr, gqa.dout.data(), gqa.in.data(), att.data(), c.B, c.T, C, c.H, DType::BF16);
  expect_same_bits("out", gqa.out.host(), out.host());
  expect_same_bits("dqkv", gqa.dqkv.host(), dqkv.host());
}

// The portable form (no room in att for the fused kernel's saves, or a build without the fused
// kernel) is the fp32 kernel on the widened bf16 q, k, v, its output rounded: the same bits, the
// dropout mask included. (The fused kernel draws the same mask: test_llama_attention_bf16.cpp.)
TEST(LlamaGqaAttentionBf16, PortableFormIsTheFp32KernelOnTheWidenedInputs) {
  DropoutMask drop = dropout_mask(0.25, 9, 12, 1, DropoutSite::Probabilities);
  for (const auto& [c, mask] : {std::pair{GqaCase{2, 8, 4, 2, 64, 0}, DropoutMask{}},  // T far below d: no room
                                std::pair{GqaCase{1, 20, 4, 2, 64, 7}, drop}}) {
    const std::string at = describe(c) + (mask.on() ? " with dropout" : "");
    EXPECT_FALSE(gqa_attention_flash_chosen(c.B * c.H, c.T, c.d)) << at;
    EXPECT_EQ(gqa_attention_bf16_saved_floats(c.B * c.H, c.T, c.d), c.B * c.H * c.T * c.T) << at;
    const Bf16Run run(c, 27, mask);
    Buffer<float> in(widened(run.qkv)), out(c.B * c.T * c.H * c.d), att(c.B * c.H * c.T * c.T),
        dqkv(c.B * c.T * (c.H + 2 * c.Hkv) * c.d), scratch(kRowBlock * c.T);
    gqa_attention_forward(out.data(), att.data(), in.data(), c.B, c.T, c.H, c.Hkv, c.d, c.window, mask);
    gqa_attention_backward(dqkv.data(), scratch.data(), run.dout.data(), in.data(), att.data(), c.B, c.T, c.H, c.Hkv,
                           c.d, c.window, mask);
    expect_same_bits("out" + at, run.out.host(), rounded(out.host()));
    expect_same_bits("att" + at, run.att.host(), att.host());
    expect_same_bits("dqkv" + at, run.dqkv.host(), dqkv.host());
  }
}

// rope on the bf16 qkv rotates the widened values in fp32 and rounds each result once.
TEST(LlamaRopeBf16, IsTheFp32RotationOfTheWidenedValuesRounded) {
  const Index B = 2, T = 24, H = 4, Hkv = 2, d = 16, half = d / 2;
  std::vector<float> cos(T * half), sin(T * half);
  for (Index t = 0; t < T; ++t)
    for (Index i = 0; i < half; ++i) {
      cos[t * half + i] = static_cast<float>(std::cos(t * std::pow(1e4, -2.0 * i / d)));
      sin[t * half + i] = static_cast<float>(std::sin(t * std::pow(1e4, -2.0 * i / d)));
    }
  const std::vector<bf16> qkv = rounded(random_vector(B * T * (H + 2 * Hkv) * d, 29));
  Buffer<float> cb(cos), sb(sin), wide(widened(qkv));
  Buffer<bf16> narrow(qkv);
  rope_forward(wide.data(), cb.data(), sb.data(), B, T, H, Hkv, d);
  rope_forward(narrow.data(), cb.data(), sb.data(), B, T, H, Hkv, d);
  expect_same_bits("rotated qkv", narrow.host(), rounded(wide.host()));
}

}  // namespace
