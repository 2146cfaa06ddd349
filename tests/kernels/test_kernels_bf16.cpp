// test_kernels_bf16.cpp — the bf16 compute path's kernels against the plain fp32 kernels:
// fused passes (rounding with column sums, transposed rounding, the bias in the product's
// epilogue, LayerNorm writing bf16) give exactly what the separate steps give, and the tiled
// bf16 attention matches the fp32 attention on the same bf16-rounded inputs to bf16 accuracy.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "base/rng.hpp"
#include "kernels/attention.hpp"
#include "kernels/gemm.hpp"
#include "kernels/half.hpp"
#include "kernels/layernorm.hpp"
#include "kernels/matmul.hpp"

using namespace zero3d;
using namespace zero3d::kernels;

namespace {

std::vector<float> random_vector(size_t n, uint64_t stream, float scale = 1.0f) {
  Rng rng(11, stream);
  std::vector<float> v(n);
  for (auto& x : v) x = static_cast<float>(scale * rng.normal());
  return v;
}

std::vector<float> rounded_to_bf16(std::vector<float> v) {
  for (float& x : v) x = to_float(to_bf16(x));
  return v;
}

float max_abs(const std::vector<float>& v) {
  float m = 0.0f;
  for (float x : v) m = std::max(m, std::fabs(x));
  return m;
}

// |a - b| <= tol · max|b| elementwise: bf16 keeps 8 significant bits, so errors scale with the
// largest magnitude the sums carry rather than with each element.
void expect_close_to_scale(const char* what, const std::vector<float>& a, const std::vector<float>& b, float tol) {
  ASSERT_EQ(a.size(), b.size()) << what;
  const float scale = max_abs(b);
  for (size_t i = 0; i < a.size(); ++i) EXPECT_NEAR(a[i], b[i], tol * scale) << what << " element " << i;
}

TEST(Bf16Conversions, RoundingWithColumnSumsEqualsRoundingAndSummingSeparately) {
  const Index N = 37, OC = 150;  // 150 columns: two full blocks of 64 and a ragged one
  const auto x = random_vector(N * OC, 1);
  std::vector<bf16> fused(N * OC), plain(N * OC);
  std::vector<float> sums(OC, 0.5f), reference(OC, 0.5f);  // accumulates onto what is there
  convert_summing_columns(fused.data(), sums.data(), x.data(), N, OC);
  convert(plain.data(), x.data(), N * OC);
  accumulate_column_sums(reference.data(), x.data(), N, OC);
  for (Index i = 0; i < N * OC; ++i) ASSERT_EQ(fused[i].bits, plain[i].bits) << i;
  EXPECT_EQ(sums, reference);
}

TEST(Bf16Conversions, TransposedRoundingEqualsRoundingThenTransposing) {
  const Index rows = 45, cols = 70, ld = 72;  // ragged blocks and a row stride wider than the row
  auto x = random_vector(rows * ld, 2);
  // the values rounding must get right, inside a full 16×16 block and on a ragged edge
  const float special[] = {NAN, INFINITY, -INFINITY, -0.0f, 1e-40f, 1.00390625f /* a tie: to even */, 1.01171875f};
  for (int k = 0; k < 7; ++k) x[(3 + k) * ld + 5 + k] = x[(40 + k % 5) * ld + 66 + k % 4] = special[k];
  std::vector<bf16> t(cols * rows);
  convert_transposed(t.data(), x.data(), rows, cols, ld);
  for (Index r = 0; r < rows; ++r)
    for (Index c = 0; c < cols; ++c) ASSERT_EQ(t[c * rows + r].bits, to_bf16(x[r * ld + c]).bits) << r << "," << c;
}

TEST(Bf16Gemm, TheBiasInTheEpilogueEqualsAddingItAfterTheProduct) {
  const Index M = 33, N = 48, K = 40;
  const auto a = random_vector(M * K, 3), w = random_vector(K * N, 4), b = random_vector(N, 5), c0 = random_vector(M * N, 6);
  std::vector<bf16> w16(K * N), b16(N);
  convert(w16.data(), w.data(), K * N);
  convert(b16.data(), b.data(), N);
  for (bool accumulate : {false, true}) {
    std::vector<float> fused = c0, separate = c0;
    gemm(M, N, K, {a.data(), DType::F32, false, K}, {w16.data(), DType::BF16, false, N}, fused.data(), N, accumulate,
         DType::BF16, b16.data(), DType::BF16);
    gemm(M, N, K, {a.data(), DType::F32, false, K}, {w16.data(), DType::BF16, false, N}, separate.data(), N, accumulate,
         DType::BF16);
    add_bias_rows(separate.data(), b16.data(), M, N);
    // the same products; only where the bias joins the fp32 sum differs
    for (Index i = 0; i < M * N; ++i) EXPECT_NEAR(fused[i], separate[i], 1e-5f * (1.0f + std::fabs(separate[i]))) << i;
  }
}

// A block's residual add in the projection's epilogue gives the bits of copying the residual
// into the output and accumulating the product (with its bias) onto it.
TEST(Bf16Gemm, TheResidualInTheEpilogueEqualsCopyingItAndAccumulating) {
  const Index M = 37, N = 48, K = 72;
  const auto a = random_vector(M * K, 20), w = random_vector(K * N, 21), b = random_vector(N, 22);
  const auto residual = random_vector(M * N, 23, 3.0f);
  std::vector<bf16> a16(M * K), w16(K * N), b16(N);
  convert(a16.data(), a.data(), M * K);
  convert(w16.data(), w.data(), K * N);
  convert(b16.data(), b.data(), N);
  for (const bf16* bias : {static_cast<const bf16*>(nullptr), static_cast<const bf16*>(b16.data())}) {
    std::vector<float> fused(M * N, 7.0f), copied = residual;  // fused's old contents must not count
    matmul_forward_adding(fused.data(), residual.data(), a16.data(), w16.data(), bias, M, K, N);
    matmul_forward(copied.data(), a16.data(), w16.data(), bias, M, K, N, /*accumulate=*/true);
    EXPECT_EQ(fused, copied) << (bias ? "with" : "without") << " a bias";
  }
}

TEST(Bf16Gemm, AnFp32OperandReadTransposedGivesThePlainProduct) {
  const Index M = 30, N = 20, K = 50;
  const auto at = random_vector(K * M, 7), b = random_vector(K * N, 8);  // A stored transposed: [K, M]
  std::vector<float> a(M * K);
  for (Index k = 0; k < K; ++k)
    for (Index m = 0; m < M; ++m) a[m * K + k] = at[k * M + m];
  std::vector<float> from_transposed(M * N), from_plain(M * N);
  gemm(M, N, K, {at.data(), DType::F32, true, M}, {b.data(), DType::F32, false, N}, from_transposed.data(), N, false,
       DType::BF16);
  gemm(M, N, K, {a.data(), DType::F32, false, K}, {b.data(), DType::F32, false, N}, from_plain.data(), N, false,
       DType::BF16);
  EXPECT_EQ(from_transposed, from_plain);
}

TEST(Bf16Gemm, BatchedProductsEqualOneProductPerProblem) {
  const Index batch = 3, M = 16, N = 24, K = 32;
  for (bool ta : {false, true})
    for (bool tb : {false, true}) {
      const auto a32 = random_vector(batch * M * K, 9), b32 = random_vector(batch * K * N, 10);
      std::vector<bf16> a(a32.size()), b(b32.size());
      convert(a.data(), a32.data(), static_cast<Index>(a.size()));
      convert(b.data(), b32.data(), static_cast<Index>(b.size()));
      std::vector<float> batched = random_vector(batch * M * N, 11), single = batched;
      gemm_batched_bf16(batch, M, N, K, a.data(), ta, b.data(), tb, batched.data(), true);
      for (Index i = 0; i < batch; ++i)
        gemm(M, N, K, {a.data() + i * M * K, DType::BF16, ta, ta ? M : K}, {b.data() + i * K * N, DType::BF16, tb, tb ? K : N},
             single.data() + i * M * N, N, true, DType::BF16);
      for (Index i = 0; i < batch * M * N; ++i)
        EXPECT_NEAR(batched[i], single[i], 1e-5f * (1.0f + std::fabs(single[i]))) << "ta " << ta << " tb " << tb << " " << i;
    }
}

// gemm_batched_blocks: problem b multiplies blocks of the b-th of larger row-major matrices (A at
// row 3, column 5 of 40×50 ones; B at row 2, column 4 of 45×40 ones; C at row 1, column 2 of
// 20×30 ones), each read as stored or transposed, against a double-precision sum over the same
// (bf16: already rounded) values. C's elements outside the blocks keep their old values.
TEST(BlockProducts, EachProblemMultipliesItsBlocksOfTheLargerMatrices) {
  const Index batch = 3, M = 12, N = 9, K = 17;
  const Index a_rows = 40, a_cols = 50, b_rows = 45, b_cols = 40, c_rows = 20, c_cols = 30;
  const Index a_at = 3 * a_cols + 5, b_at = 2 * b_cols + 4, c_at = 1 * c_cols + 2;
  for (const DType type : {DType::F32, DType::BF16})
    for (const bool ta : {false, true})
      for (const bool tb : {false, true})
        for (const bool accumulate : {false, true}) {
          auto a32 = random_vector(batch * a_rows * a_cols, 15), b32 = random_vector(batch * b_rows * b_cols, 16);
          std::vector<bf16> a16(a32.size()), b16(b32.size());
          for (size_t i = 0; i < a32.size(); ++i) a16[i] = to_bf16(a32[i]), a32[i] = to_float(a16[i]);
          for (size_t i = 0; i < b32.size(); ++i) b16[i] = to_bf16(b32[i]), b32[i] = to_float(b16[i]);
          const bool wide = type == DType::F32;
          const void* a = wide ? static_cast<const void*>(a32.data() + a_at) : a16.data() + a_at;
          const void* b = wide ? static_cast<const void*>(b32.data() + b_at) : b16.data() + b_at;
          const std::vector<float> before = random_vector(batch * c_rows * c_cols, 17);
          std::vector<float> c = before;
          gemm_batched_blocks(batch, M, N, K, {{a, type, ta, a_cols}, a_rows * a_cols},
                              {{b, type, tb, b_cols}, b_rows * b_cols}, c.data() + c_at, c_cols, c_rows * c_cols,
                              accumulate);
          const std::string at = std::string(wide ? "fp32" : "bf16") + " ta " + std::to_string(ta) + " tb " +
                                 std::to_string(tb) + " accumulate " + std::to_string(accumulate);
          for (Index p = 0; p < batch; ++p)
            for (Index i = 0; i < c_rows; ++i)
              for (Index j = 0; j < c_cols; ++j) {
                const Index e = p * c_rows * c_cols + i * c_cols + j;
                const Index m = i - 1, n = j - 2;
                if (m < 0 || m >= M || n < 0 || n >= N) {
                  ASSERT_EQ(c[e], before[e]) << at << ": outside the block, problem " << p << " (" << i << ", " << j << ")";
                  continue;
                }
                double want = accumulate ? before[e] : 0.0;
                for (Index k = 0; k < K; ++k) {
                  const float x = a32[p * a_rows * a_cols + a_at + (ta ? k * a_cols + m : m * a_cols + k)];
                  const float y = b32[p * b_rows * b_cols + b_at + (tb ? n * b_cols + k : k * b_cols + n)];
                  want += static_cast<double>(x) * y;
                }
                ASSERT_NEAR(c[e], want, 1e-5 * (1.0 + std::fabs(want))) << at << ": problem " << p << " (" << m << ", " << n << ")";
              }
        }
}

TEST(Bf16LayerNorm, ABf16OutputIsTheFp32OutputRounded) {
  const Index N = 9, C = 100;
  const auto x = random_vector(N * C, 12, 3.0f), w = random_vector(C, 13), b = random_vector(C, 14);
  std::vector<float> out(N * C), mean(N), rstd(N), mean16(N), rstd16(N);
  std::vector<bf16> out16(N * C);
  layernorm_forward(out.data(), mean.data(), rstd.data(), x.data(), w.data(), b.data(), N, C);
  layernorm_forward(out16.data(), mean16.data(), rstd16.data(), x.data(), w.data(), b.data(), N, C);
  for (Index i = 0; i < N * C; ++i) ASSERT_EQ(out16[i].bits, to_bf16(out[i]).bits) << i;
  EXPECT_EQ(mean16, mean);
  EXPECT_EQ(rstd16, rstd);
}

// Shapes: several tiles (T = 150: 3 tiles of 50), a padded last tile (T = 130: 3 tiles of 44,
// two zero rows), one tile (T = 20), the long-sequence tiling (T = 600: 5 tiles of 120); B·H = 10
// spans two head groups.
struct AttentionShape {
  Index B, T, C, H;
};
class Bf16Attention : public ::testing::TestWithParam<AttentionShape> {};

TEST_P(Bf16Attention, MatchesTheFp32KernelOnTheSameRoundedInputs) {
  const auto [B, T, C, H] = GetParam();
  const auto qkv = rounded_to_bf16(random_vector(B * T * 3 * C, 20));
  const auto dout = random_vector(B * T * C, 21);
  std::vector<float> out(B * T * C), ref_out(B * T * C), att(B * H * T * T), ref_att(B * H * T * T);
  std::vector<float> dqkv(B * T * 3 * C, NAN), ref_dqkv(B * T * 3 * C), scratch(kRowBlock * T);
  attention_forward(out.data(), att.data(), qkv.data(), B, T, C, H, DType::BF16);
  attention_forward(ref_out.data(), ref_att.data(), qkv.data(), B, T, C, H);
  // outputs are probability-weighted means of v: bf16 probabilities (8 bits) bound the error
  expect_close_to_scale("out", out, ref_out, 1e-2f);
  attention_backward(dqkv.data(), nullptr, dout.data(), qkv.data(), att.data(), B, T, C, H, DType::BF16);
  attention_backward(ref_dqkv.data(), scratch.data(), dout.data(), qkv.data(), ref_att.data(), B, T, C, H);
  for (float g : dqkv) ASSERT_TRUE(std::isfinite(g)) << "dqkv is written everywhere";
  expect_close_to_scale("dqkv", dqkv, ref_dqkv, 2e-2f);
}

TEST_P(Bf16Attention, IsCausal) {
  const auto [B, T, C, H] = GetParam();
  auto qkv = random_vector(B * T * 3 * C, 22);
  std::vector<float> out1(B * T * C), out2(B * T * C), att(B * H * T * T);
  attention_forward(out1.data(), att.data(), qkv.data(), B, T, C, H, DType::BF16);
  for (Index b = 0; b < B; ++b)  // change only the last token of each sequence
    for (Index c = 0; c < 3 * C; ++c) qkv[(b * T + T - 1) * 3 * C + c] += 1.0f;
  attention_forward(out2.data(), att.data(), qkv.data(), B, T, C, H, DType::BF16);
  for (Index b = 0; b < B; ++b)
    for (Index i = 0; i < (T - 1) * C; ++i) ASSERT_EQ(out1[b * T * C + i], out2[b * T * C + i]) << "saw the future";
}

INSTANTIATE_TEST_SUITE_P(Shapes, Bf16Attention,
                         ::testing::Values(AttentionShape{2, 150, 40, 5}, AttentionShape{1, 130, 24, 3},
                                           AttentionShape{2, 20, 16, 2}, AttentionShape{1, 600, 16, 2}));

}  // namespace
