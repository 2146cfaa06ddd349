// test_split_backward.cpp — a zero-bubble schedule splits each backward into an input pass and a
// weight pass (DeepSpeed's / Qi et al.'s ZB-H1). Where a whole bf16 backward makes the MLP's
// gradient in bf16 and sums its bias gradient in one kernel (…_summing_columns), the split keeps
// the gradient in fp32 (gelu_backward, swiglu_backward on bf16 inputs) and its weight pass rounds
// it and sums its columns as every product operand is made (convert_summing_columns, gemm_operand).
// The two must give the same bits, or ZB-H1's bf16 losses leave 1F1B's
// (tests/cli/test_cli_pipeline.cpp, test_cli_llama.cpp hold the runs to that).
#include <gtest/gtest.h>

#include <vector>

#include "kernels/gelu.hpp"
#include "kernels/half.hpp"
#include "kernels/swiglu.hpp"
#include "support/model_memory.hpp"

using namespace zero3d;
using namespace zero3d::kernels;
using namespace test_support;

namespace {

constexpr uint64_t kSeed = 0x5b1175;

// What the weight pass makes of the kept fp32 gradient: the bf16 operand, and the column sums added
// into `sums` (a bias gradient already holding an earlier micro-batch's).
void weight_pass(const std::vector<float>& grad, Index N, Index OC, std::vector<bf16>& operand, std::vector<float>& sums) {
  Buffer<float> g(grad), s(sums);
  Buffer<bf16> d(N * OC);
  convert_summing_columns(d.data(), s.data(), g.data(), N, OC);
  operand = d.host();
  sums = s.host();
}

// 67 columns: four 16-lane vectors and a 3-lane tail per row, as a row of the bf16 MLP may have.
TEST(SplitBackward, GeluKeptInFp32IsWhatTheWholeBackwardRoundsAndSums) {
  const Index N = 9, OC = 67;
  const std::vector<bf16> inp = bf16_rounded(normal_vector(kSeed, N * OC, 1, 2.0f));
  const std::vector<float> dout = normal_vector(kSeed, N * OC, 2), earlier = normal_vector(kSeed, OC, 3);
  Buffer<bf16> x(inp), whole(N * OC);
  Buffer<float> dy(dout), whole_sums(earlier), kept(N * OC);
  gelu_backward_summing_columns(whole.data(), whole_sums.data(), x.data(), dy.data(), N, OC);
  gelu_backward(kept.data(), x.data(), dy.data(), N, OC);
  std::vector<bf16> operand;
  std::vector<float> sums = earlier;
  weight_pass(kept.host(), N, OC, operand, sums);
  expect_same_bits("c_fc's gradient operand", operand, whole.host());
  expect_same_bits("c_fc's bias gradient", sums, whole_sums.host());
  // in place, as the model runs it (the gradient written over dout)
  Buffer<float> in_place(dout);
  gelu_backward(in_place.data(), x.data(), in_place.data(), N, OC);
  expect_same_bits("in place", in_place.host(), kept.host());
}

TEST(SplitBackward, SwiGluKeptInFp32IsWhatTheWholeBackwardRoundsAndSums) {
  const Index N = 9, I = 67, ld = 2 * I;
  const std::vector<bf16> gate_up = bf16_rounded(normal_vector(kSeed, N * ld, 4, 2.0f));
  const std::vector<float> dout = normal_vector(kSeed, N * I, 5), earlier = normal_vector(kSeed, ld, 6);
  Buffer<bf16> gu(gate_up), whole(N * ld);
  Buffer<float> dy(dout), whole_sums(earlier), kept(N * ld);
  swiglu_backward_summing_columns(whole.data(), whole_sums.data(), dy.data(), gu.data(), N, I);
  swiglu_backward(kept.data(), kept.data() + I, dy.data(), gu.data(), gu.data() + I, N, I, ld);
  std::vector<bf16> operand;
  std::vector<float> sums = earlier;
  weight_pass(kept.host(), N, ld, operand, sums);
  expect_same_bits("gate/up's gradient operand", operand, whole.host());
  expect_same_bits("gate/up's bias gradient", sums, whole_sums.host());
}

}  // namespace
