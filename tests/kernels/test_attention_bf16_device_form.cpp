// test_attention_bf16_device_form.cpp — the bf16 tiled attention's device forms (kernels/
// attention_bf16.hpp gpu::, what a GPU build runs: the packs, and a warp per softmax row) against
// the CPU forms, on the CPU, in both of their paths: whole vectors of eight (rows a multiple of
// eight wide) and single elements (rows that are not). A GPU takes one tile of all T positions;
// two and three tiles check the key tiles before the diagonal one as well.
#include <gtest/gtest.h>

#include <string>
#include <tuple>
#include <vector>

#include "kernels/attention_bf16.hpp"
#include "support/model_memory.hpp"

using namespace zero3d;
using namespace zero3d::kernels;

using test_support::Buffer;
using test_support::ShiftedPointer;
using test_support::expect_close;
using test_support::expect_same_bits;

namespace {

std::vector<float> random_vector(size_t n, uint64_t stream, float scale = 1.0f) {
  return test_support::normal_vector(41, n, stream, scale, 0.0f);
}

std::vector<bf16> rounded(const std::vector<float>& x) {
  std::vector<bf16> out(x.size());
  for (size_t i = 0; i < x.size(); ++i) out[i] = to_bf16(x[i]);
  return out;
}

// Packing q (or any part) of qkv into tiles and unpacking tiles back: conversions only, the same
// bits, with rows past T zero in the tiles and left alone in the destination. Head sizes of 8 and
// 16 take whole vectors, also with each pointer in turn one element off a 16-byte boundary
// (`shifted`: 0 the pack's tiles, 1 its qkv, 2 the unpack's rows, 3 its tiles), which then takes
// elements.
TEST(AttentionBf16DeviceForm, PackAndUnpackMatchTheCpuForms) {
  for (const auto& [T, hs, shifted] : {std::tuple<Index, Index, int>{10, 8, -1}, {130, 16, -1}, {37, 12, -1},
                                       {130, 16, 0}, {130, 16, 1}, {130, 16, 2}, {130, 16, 3}}) {
    const Index B = 2, H = 3, C = H * hs, C3 = 3 * C;
    const std::string at = " [T " + std::to_string(T) + ", hs " + std::to_string(hs) + ", pointer " +
                           std::to_string(shifted) + " shifted]";
    const ShiftedPointer shift{shifted};
    const AttentionTiles t(T);
    const Index n = t.n * B * H * t.TB * hs;
    const auto qkv = random_vector(B * T * C3, 1);
    Buffer<float> src(qkv, shift(1));
    Buffer<bf16> src16(rounded(qkv), shift(1));
    auto pack = [&](bool device, auto* from) {
      Buffer<bf16> dst(rounded(random_vector(n, 2)), shift(0));  // garbage where nothing is written
      if (device) gpu::attention_pack(dst.data(), from + C, C3, 0, B * H, T, H, hs, t);
      else attention_pack(dst.data(), from + C, C3, 0, B * H, T, H, hs, t);
      return dst.host();
    };
    expect_same_bits("pack fp32" + at, pack(true, src.data()), pack(false, src.data()));
    expect_same_bits("pack bf16" + at, pack(true, src16.data()), pack(false, src16.data()));
    Buffer<float> tiles(random_vector(n, 3), shift(3));
    auto unpack = [&](bool device) {
      Buffer<float> dst(random_vector(B * T * C3, 4), shift(2));
      if (device) gpu::attention_unpack(dst.data() + 2 * C, C3, tiles.data(), 0, B * H, T, H, hs, t);
      else attention_unpack(dst.data() + 2 * C, C3, tiles.data(), 0, B * H, T, H, hs, t);
      return dst.host();
    };
    expect_same_bits("unpack" + at, unpack(true), unpack(false));
  }
}

// The softmax rows of row tile i over key tiles 0..i (S [j][G][TB][TB], P at p_stride apart),
// and their backward from those P and a dP: each element's arithmetic is the CPU form's, the
// row's sums added in another order (here one at a time; in the CPU form's AVX-512 lanes, which
// also take exp through their own polynomial): P and dS agree within a bf16 rounding flip. Tiles
// of 64 and 16 take whole vectors, also with each pointer in turn one element off a 16-byte
// boundary (`shifted`: 0 P, 1 S, 2 dS, 3 the backward's P, 4 dP), which then takes elements.
TEST(AttentionBf16DeviceForm, SoftmaxRowsAndTheirBackwardMatchTheCpuForms) {
  for (const auto& [TB, tiles, shifted] :
       {std::tuple<Index, Index, int>{64, 1, -1}, {36, 2, -1}, {16, 3, -1}, {16, 3, 0}, {16, 3, 1}, {16, 3, 2},
        {16, 3, 3}, {16, 3, 4}}) {
    const Index G = 3, sg = G * TB * TB, i = tiles - 1;
    const float scale = 0.125f;
    const std::string at = " [TB " + std::to_string(TB) + ", row tile " + std::to_string(i) + ", pointer " +
                           std::to_string(shifted) + " shifted]";
    const ShiftedPointer shift{shifted};
    const auto scores = random_vector(tiles * sg, 5, 4.0f);
    auto forward = [&](bool device) {
      Buffer<float> s(scores, shift(1));
      Buffer<bf16> p(rounded(random_vector(tiles * sg, 6)), shift(0));  // every element is written
      if (device) gpu::attention_softmax_rows(p.data(), sg, s.data(), i, G, TB, scale);
      else attention_softmax_rows(p.data(), sg, s.data(), i, G, TB, scale);
      return p.host();
    };
    const auto p = forward(true), cpu_p = forward(false);
    expect_close("P" + at, p, cpu_p, 1e-7, 1.0 / 128);
    for (Index bh = 0; bh < G; ++bh)  // the diagonal tile's future keys are zeros
      for (Index r = 0; r < TB; ++r)
        for (Index c = r + 1; c < TB; ++c)
          ASSERT_EQ(to_float(p[i * sg + (bh * TB + r) * TB + c]), 0.0f) << at << " " << bh << " " << r << " " << c;
    expect_same_bits("P, second run" + at, forward(true), p);

    Buffer<bf16> probabilities(cpu_p, shift(3));
    Buffer<float> dp(random_vector(tiles * sg, 7), shift(4));
    auto backward = [&](bool device) {
      Buffer<bf16> ds(rounded(random_vector(tiles * sg, 8)), shift(2));
      if (device) gpu::attention_softmax_backward_rows(ds.data(), probabilities.data(), sg, dp.data(), i, G, TB, scale);
      else attention_softmax_backward_rows(ds.data(), probabilities.data(), sg, dp.data(), i, G, TB, scale);
      return ds.host();
    };
    const auto ds = backward(true);
    expect_close("dS" + at, ds, backward(false), 1e-6, 1.0 / 128);
    expect_same_bits("dS, second run" + at, backward(true), ds);
  }
}

// A GPU's products (AttentionProducts::CausalBlocks: one tile of all T positions, the products in
// causal query blocks) against a CPU's (a product per tile pair), without and with dropout. Both
// multiply the same bf16 values with fp32 sums, in another order: a probability may round to the
// other side (one bf16 step, up to 2⁻⁷ of it), and the output and the gradients move by a few
// such. T 70: query blocks of 64 and 6 against two tiles of 35; T 300: four blocks of 64 and one
// of 44 against five tiles of 60.
TEST(AttentionBf16DeviceForm, CausalBlockProductsAgreeWithTileProducts) {
  const Index B = 2, H = 3, C = 48, BH = B * H;
  for (const Index T : {Index{70}, Index{300}})
    for (const bool drop : {false, true}) {
      const DropoutMask mask = drop ? dropout_mask(0.3, 17, 40, 2, DropoutSite::Probabilities) : DropoutMask{};
      const std::string at = " [T " + std::to_string(T) + (drop ? ", dropout]" : "]");
      const auto qkv = random_vector(B * T * 3 * C, 9), dout = random_vector(B * T * C, 10);
      struct Pass {
        std::vector<float> out, dqkv, p;  // p: the causal probabilities, [bh][r][c ≤ r]
      };
      auto run = [&](AttentionProducts how) {
        const AttentionTiles t(T, how);
        std::vector<float> att(((AttentionTiles::pair(t.n - 1, t.n - 1) + 1) * BH * t.TB * t.TB + 1) / 2, -1.0f);
        Pass pass{std::vector<float>(B * T * C), std::vector<float>(B * T * 3 * C, -1.0f), {}};
        attention_forward_tiled_bf16(pass.out.data(), att.data(), qkv.data(), B, T, C, H, mask, how);
        attention_backward_tiled_bf16(pass.dqkv.data(), dout.data(), qkv.data(), att.data(), B, T, C, H, mask, how);
        const bf16* p = reinterpret_cast<const bf16*>(att.data());
        for (Index bh = 0; bh < BH; ++bh)
          for (Index r = 0; r < T; ++r)
            for (Index c = 0; c <= r; ++c) {
              const Index i = r / t.TB, j = c / t.TB;
              pass.p.push_back(to_float(p[AttentionTiles::pair(i, j) * BH * t.TB * t.TB + (bh * t.TB + r % t.TB) * t.TB +
                                          c % t.TB]));
            }
        return pass;
      };
      const Pass blocks = run(AttentionProducts::CausalBlocks), tiles = run(AttentionProducts::Tiles);
      expect_close("P" + at, blocks.p, tiles.p, 1e-7, 1.0 / 128);
      // a probability rounded the other way moves an output by p·2⁻⁷·|v|: ~3e-4 at p 0.012, |v| 3
      expect_close("out" + at, blocks.out, tiles.out, 2e-3, 1e-2);
      expect_close("dqkv" + at, blocks.dqkv, tiles.dqkv, 2e-3, 1e-2);
      expect_same_bits("dqkv, second run" + at, run(AttentionProducts::CausalBlocks).dqkv, blocks.dqkv);
    }
}

}  // namespace
