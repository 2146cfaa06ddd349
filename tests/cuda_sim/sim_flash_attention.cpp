// The fused CUDA attention's kernels (kernels/cuda/attention_flash_bf16_kernels.hpp) run on the
// CPU: every CUDA thread a fiber, every warp instruction computed from the PTX ISA's fragment
// layouts (warp_simulation.hpp), every shared-memory access checked for races, uninitialised reads
// and alignment. Against double-precision loops written here, on bf16-rounded q, k, v and dY: what
// remains is the kernels' bf16 rounding of P and dS, the GPU tests' tolerance (tests/gpu). So a
// change to the kernels' indexing, masks, tiles, fragments or barriers is checked where no GPU is;
// their speed, and the hardware's agreement with the ISA, only a GPU checks.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "kernels/cuda/attention_flash_bf16_kernels.hpp"

namespace {
using namespace zero3d::kernels::cuda_flash::device;
using zero3d::cuda_sim::launch;

float round_bf16(float x) { return __bfloat162float(__float2bfloat16_rn(x)); }

struct Case {
  int B, T, H, Hkv, window;
  bool vector_loads;  // the tiles' 16-byte loads, or element by element
};

// Causal attention of H query heads over Hkv K/V heads (head h reads K/V head h / (H/Hkv)); key j
// visible to query i when j ≤ i and, with a window, i − j < window. out [B][T][H·hs], dqkv like qkv.
void reference(const std::vector<float>& qkv, const std::vector<float>& dy, const Case& c, int hs,
               std::vector<double>& out, std::vector<double>& dqkv) {
  const int T = c.T, H = c.H, Hkv = c.Hkv, W = (H + 2 * Hkv) * hs, C = H * hs;
  out.assign(size_t(c.B) * T * C, 0.0), dqkv.assign(size_t(c.B) * T * W, 0.0);
  const double scale = 1.0 / std::sqrt(double(hs));
  for (int b = 0; b < c.B; ++b)
    for (int h = 0; h < H; ++h) {
      const int g = h / (H / Hkv);
      const auto at = [&](int t, int col) { return size_t(b * T + t) * W + col; };
      const int qc = h * hs, kc = (H + g) * hs, vc = (H + Hkv + g) * hs;
      for (int i = 0; i < T; ++i) {
        const int j0 = c.window > 0 ? std::max(0, i + 1 - c.window) : 0;
        std::vector<double> p(T), dp(T);
        double mx = -INFINITY, sum = 0, D = 0;
        for (int j = j0; j <= i; ++j) {
          double s = 0;
          for (int d = 0; d < hs; ++d) s += double(qkv[at(i, qc + d)]) * qkv[at(j, kc + d)];
          mx = std::max(mx, p[j] = s * scale);
        }
        for (int j = j0; j <= i; ++j) sum += p[j] = std::exp(p[j] - mx);
        const float* dO = &dy[size_t(b * T + i) * C + h * hs];
        for (int j = j0; j <= i; ++j) {
          p[j] /= sum;
          for (int d = 0; d < hs; ++d) {
            out[size_t(b * T + i) * C + h * hs + d] += p[j] * qkv[at(j, vc + d)];
            dp[j] += double(dO[d]) * qkv[at(j, vc + d)];
          }
          D += p[j] * dp[j];
        }
        for (int j = j0; j <= i; ++j) {
          const double ds = p[j] * (dp[j] - D) * scale;
          for (int d = 0; d < hs; ++d) {
            dqkv[at(i, qc + d)] += ds * qkv[at(j, kc + d)];
            dqkv[at(j, kc + d)] += ds * qkv[at(i, qc + d)];
            dqkv[at(j, vc + d)] += p[j] * dO[d];
          }
        }
      }
    }
}

void expect_close(const std::vector<float>& got, const std::vector<double>& want, double tol, const std::string& what) {
  ASSERT_EQ(got.size(), want.size());
  size_t bad = 0, first = 0;
  for (size_t i = 0; i < got.size(); ++i)
    if (!(std::abs(got[i] - want[i]) <= tol * (1.0 + std::abs(want[i]))) && bad++ == 0) first = i;
  EXPECT_EQ(bad, 0u) << what << ": " << bad << " of " << got.size() << " beyond " << tol << ", the first at " << first
                     << ": " << got[first] << " against " << want[first];
}

// The forward, D = rowsum(dO ∘ O), dK/dV and dQ, launched as attention_flash_bf16.cpp launches them.
template <int HS, typename Q>
void run_kernels(const Case& c) {
  const int T = c.T, W = (c.H + 2 * c.Hkv) * HS, C = c.H * HS;
  std::mt19937 rng(7 + T + c.H + c.window);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> qkv(size_t(c.B) * T * W), dy(size_t(c.B) * T * C);
  for (float& x : qkv) x = round_bf16(normal(rng));
  for (float& x : dy) x = round_bf16(normal(rng));
  std::vector<double> out_ref, dqkv_ref;
  reference(qkv, dy, c, HS, out_ref, dqkv_ref);

  zero3d::cuda_sim::bank_census.reset();
  zero3d::cuda_sim::shared_census.reset();
  const std::vector<Q> q_in(qkv.begin(), qkv.end());
  const size_t rows = size_t(c.B) * c.H * T;
  std::vector<float> out(size_t(c.B) * T * C, NAN), lse(rows, NAN), dd(rows, NAN), dqkv(qkv.size(), NAN);
  std::vector<bfloat> osave(rows * HS);
  const std::vector<bfloat> dy16(dy.begin(), dy.end());  // the launcher rounds dO to bf16 first
  const Layout lay{T, c.H, c.Hkv, c.window};
  const float scale = 1.0f / std::sqrt(float(HS));
  const unsigned blocks = (T + kRows - 1) / kRows, threads = kThreads;
  const bool vec = c.vector_loads;
  launch(blocks, c.B * c.H, threads, forward_smem<HS>(),
         [&] { forward_kernel<HS, float, Q>(out.data(), lse.data(), osave.data(), q_in.data(), lay, scale, vec); });
  const int64_t forward_copies = zero3d::cuda_sim::shared_census.async_copies;
  launch((rows + kWarps - 1) / kWarps, 1, threads, 0,
         [&] { row_dot_kernel<HS>(dd.data(), dy16.data(), osave.data(), T, c.H, int64_t(rows)); });
  launch(blocks, c.B * c.Hkv, threads, dkdv_smem<HS>(), [&] {
    dkdv_kernel<HS, Q>(dqkv.data(), dy16.data(), q_in.data(), lse.data(), dd.data(), lay, scale, vec, vec);
  });
  launch(blocks, c.B * c.H, threads, dq_smem<HS>(), [&] {
    dq_kernel<HS, Q>(dqkv.data(), dy16.data(), q_in.data(), lse.data(), dd.data(), lay, scale, vec, vec);
  });
  expect_close(out, out_ref, 1e-2, "out");
  expect_close(dqkv, dqkv_ref, 3e-2, "dqkv");
  // the padded rows' purpose: every fragment load from shared memory in one pass
  const zero3d::cuda_sim::BankCensus& banks = zero3d::cuda_sim::bank_census;
  EXPECT_GT(banks.matrices, 0);
  EXPECT_EQ(banks.worst_matrix, 1) << "an ldmatrix matrix meets a bank conflict";
  // racecheck's and memcheck's findings on a GPU: the warps' order there is any order
  const zero3d::cuda_sim::SharedCensus& shared = zero3d::cuda_sim::shared_census;
  EXPECT_GT(shared.accesses, banks.matrices);
  // bf16 rows that start 16-byte aligned come by cp.async, others through registers: q, k and v
  // when qkv is bf16, and in the backward dO, which the launcher rounds to bf16, always
  EXPECT_EQ(forward_copies > 0, (std::is_same<Q, bfloat>::value && c.vector_loads));
  EXPECT_EQ(shared.async_copies > forward_copies, c.vector_loads);
  EXPECT_EQ(shared.hazards, 0) << shared.first;
  EXPECT_EQ(shared.uninitialized, 0) << shared.first;
  EXPECT_EQ(shared.misaligned, 0) << shared.first;
  EXPECT_EQ(shared.unwaited, 0) << shared.first;
}

TEST(SimulatedFlashAttention, CausalHeadSize64FromFp32RowsMatchesTheReference) {
  run_kernels<64, float>({1, 130, 2, 2, 0, true});  // T past two 64-row blocks
}

TEST(SimulatedFlashAttention, Gpt2SequenceLengthFromBf16RowsMatchesTheReference) {
  run_kernels<64, bfloat>({1, 1024, 1, 1, 0, true});  // GPT-2 124M's T: 16 query blocks, 136 block pairs
}

TEST(SimulatedFlashAttention, GroupedQueryHeadsFromBf16RowsMatchTheReference) {
  run_kernels<64, bfloat>({2, 100, 2, 1, 0, false});  // multi-query, two sequences, element loads
}

TEST(SimulatedFlashAttention, SlidingWindowSkipsTheKeyBlocksItDoesNotSee) {
  run_kernels<64, float>({1, 200, 4, 2, 70, true});  // query block 192 starts at key block 64
}

TEST(SimulatedFlashAttention, ShortSequencesAndAOneKeyWindowMatchTheReference) {
  for (const int T : {1, 64, 65}) {  // one row; one block exactly; one row past it
    SCOPED_TRACE("T " + std::to_string(T));
    run_kernels<64, bfloat>({2, T, 2, 1, 0, true});
    run_kernels<128, float>({1, T, 2, 2, 1, false});  // each query sees itself alone
  }
}

TEST(SimulatedFlashAttention, HeadSize128MatchesTheReference) {
  run_kernels<128, bfloat>({1, 150, 2, 2, 0, true});  // dK/dV in 32-query blocks
}

TEST(SimulatedFlashAttention, HeadSize128WithAWindowShorterThanABlockMatchesTheReference) {
  run_kernels<128, float>({1, 200, 2, 1, 40, false});
}

}  // namespace
