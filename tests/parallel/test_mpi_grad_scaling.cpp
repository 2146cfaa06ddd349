// test_mpi_grad_scaling.cpp — prescale_gradients and gradient_predivide_factor in the gradient
// reducer (DEEPSPEED-FACTS §5.6), run under mpiexec at np 1, 2 and 4 (tests/CMakeLists.txt).
// Their purpose is range: W fp16 gradients near 65504 overflow when summed before they are
// divided. Each test fails if the factors were ignored (the sum would be inf).
#include <gtest/gtest.h>

#include <sys/resource.h>

#include <cmath>
#include <vector>

#include "kernels/typed.hpp"
#include "parallel/comm.hpp"
#include "parallel/grad_reducer.hpp"

using namespace zero3d;

namespace {

struct World {
  MpiCommunicator comm{MPI_COMM_WORLD};
  int r = comm.rank(), n = comm.size();
};

TEST(ReduceScaling, DeepSpeedsFactorsAroundTheSum) {
  // engine.py allreduce_bucket: prescale divides by W first; otherwise 1/f first and f/W after.
  const ReduceScaling mean = reduce_scaling(false, 1.0, 4), pre = reduce_scaling(true, 8.0, 4),
                      f8 = reduce_scaling(false, 8.0, 4), fw = reduce_scaling(false, 4.0, 4);
  EXPECT_EQ(mean.pre, 1.0);
  EXPECT_EQ(mean.post, 0.25);
  EXPECT_EQ(pre.pre, 0.25);  // the predivide factor is unused with prescale
  EXPECT_EQ(pre.post, 1.0);
  EXPECT_EQ(f8.pre, 0.125);
  EXPECT_EQ(f8.post, 2.0);
  EXPECT_EQ(fw.pre, 0.25);
  EXPECT_EQ(fw.post, 1.0);  // f == W: nothing after
  // ZeRO 1-3 with neither key: DeepSpeed's reduce-scatter divides every bucket by W first
  // (stage_1_and_2.py, stage3.py); stage 0 keeps the all-reduce's sum-then-divide above.
  const ReduceScaling zero = reduce_scaling(false, 1.0, 4, /*zero_partitioned=*/true);
  EXPECT_EQ(zero.pre, 0.25);
  EXPECT_EQ(zero.post, 1.0);
  const ReduceScaling zero_f8 = reduce_scaling(false, 8.0, 4, true);  // a factor given is applied as given
  EXPECT_EQ(zero_f8.pre, 0.125);
  EXPECT_EQ(zero_f8.post, 2.0);
}

// Every rank holds 49152 (= 1536·32, exact in fp16) per element and the reduction runs in fp16:
// the sum over 2 or more ranks exceeds fp16's largest value, 65504, unless it is divided first.
std::vector<uint16_t> large_fp16_grads(int64_t n, float value) {
  std::vector<float> g(static_cast<size_t>(n), value);
  std::vector<uint16_t> h(static_cast<size_t>(n));
  convert_any(h.data(), DType::F16, g.data(), DType::F32, n);
  return h;
}

float first_as_float(const std::vector<uint16_t>& h) {
  float x = 0.0f;
  convert_any(&x, DType::F32, h.data(), DType::F16, 1);
  return x;
}

TEST(GradientScaling, AllReduceDividingFirstKeepsFp16SumsInRange) {
  World w;
  const int64_t n = 1000;
  const float value = 49152.0f;
  for (const auto& [prescale, factor] : {std::pair<bool, double>{true, 1.0}, {false, double(w.n)}, {false, 8.0}}) {
    std::vector<uint16_t> g = large_fp16_grads(n, value);
    GradientReducer reducer(w.comm, g.data(), DType::F16, n, 300, /*overlap=*/false, DType::F16);
    reducer.set_scaling(reduce_scaling(prescale, factor, w.n));
    reducer.begin();
    reducer.finish();
    EXPECT_EQ(first_as_float(g), value) << "prescale " << prescale << ", predivide " << factor;
    for (int64_t i = 0; i < n; ++i) ASSERT_EQ(g[i], g[0]) << i;
  }
  if (w.n == 1) return;
  // The default (sum, then divide) overflows: what the factors are for.
  std::vector<uint16_t> g = large_fp16_grads(n, value);
  GradientReducer reducer(w.comm, g.data(), DType::F16, n, 300, false, DType::F16);
  reducer.begin();
  reducer.finish();
  EXPECT_TRUE(std::isinf(first_as_float(g)));
}

TEST(GradientScaling, ReduceScatterAppliesTheFactorsToEachRanksPart) {
  World w;
  const Partition part(1003, w.n);
  const float value = 49152.0f;
  std::vector<uint16_t> g = large_fp16_grads(part.padded, value);
  std::vector<float> mine(static_cast<size_t>(part.part), 0.0f);
  GradientReducer reducer(w.comm, part, mine.data(), DType::F32, /*accumulate=*/false, 256, /*overlap=*/true,
                          DType::F16, DType::F16);
  reducer.set_scaling(reduce_scaling(false, 4.0, w.n));
  reducer.begin(g.data());
  reducer.grads_ready(0);
  reducer.finish();
  for (int64_t i = 0; i < part.part; ++i) ASSERT_EQ(mine[i], value) << i;  // (Σ g/4)·4/W = g
}

// fp32 sums of exact values: dividing by a power of two before or after the sum is exact, so
// every placement of the factor gives the mean bit for bit.
TEST(GradientScaling, PowerOfTwoFactorsGiveTheMeanExactlyInFp32) {
  World w;
  const int64_t n = 777;
  std::vector<float> want;
  for (const auto& [prescale, factor] : {std::pair<bool, double>{false, 1.0}, {true, 1.0}, {false, 8.0}}) {
    std::vector<float> g(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) g[i] = 0.001f * float(i + 1) * float(w.r + 1);
    GradientReducer reducer(w.comm, g.data(), DType::F32, n, 100, /*overlap=*/true, DType::F32);
    reducer.set_scaling(reduce_scaling(prescale, factor, w.n));
    reducer.begin();
    reducer.grads_ready(0);
    reducer.finish();
    if (want.empty()) {
      want = g;
    } else if ((w.n & (w.n - 1)) == 0) {
      EXPECT_EQ(g, want) << "prescale " << prescale << ", predivide " << factor;
    }
  }
}

// Stage 2-3 backward reduces one unit's fp32 window per call, converted to the communication
// type: a fresh send and receive buffer per unit cost a zero fill and page faults of megabytes on
// every unit of every step (10,000 faults a step on gpt-small at stage 3). Once the first step
// has sized them, the buffers are reused: later steps touch no fresh page and hold no more.
// (Blocking buckets: each finishes inside its launch, so which buffers are in use is the same in
// every step on every rank, whatever the timing.)
TEST(GradientReducer, ReusesItsStagingSoLaterStepsFaultInNoFreshPages) {
  World w;
  const int64_t unit = int64_t(1) << 21, units = 3;  // 8 MiB fp32 windows, bf16 buckets of 4 MiB
  const Partition part(unit * units, w.n);
  std::vector<float> window(static_cast<size_t>(unit), 1.0f);
  std::vector<uint16_t> mine(static_cast<size_t>(part.part), 0);
  GradientReducer reducer(w.comm, part, mine.data(), DType::BF16, /*accumulate=*/true, unit, /*overlap=*/false,
                          DType::BF16, DType::F32);
  auto step = [&] {
    for (int64_t u = units - 1; u >= 0; --u) reducer.reduce_range(window.data(), u * unit, (u + 1) * unit, 0);
    reducer.wait_all();
  };
  auto minor_faults = [] {
    rusage u{};
    getrusage(RUSAGE_SELF, &u);
    return static_cast<int64_t>(u.ru_minflt);
  };
  step();
  const int64_t held = reducer.staging_peak_bytes(), before = minor_faults();
  for (int s = 0; s < 4; ++s) step();
  const int64_t faults = minor_faults() - before;
  // One fresh send buffer is 1024 pages of 4 KiB; four steps of three units would fault 12,000+.
  EXPECT_LT(faults, 256) << "minor page faults in 4 steps after the first";
  EXPECT_EQ(reducer.staging_peak_bytes(), held) << "staging grew after the first step";
  EXPECT_GT(held, 0);
}

// overlap_comm double-buffers the bucket, as DeepSpeed does: a backward of many units reduced
// with overlap holds two buckets' staging (a converted send buffer and a received part each),
// never the whole gradient partition's worth in flight at once. 16 fp32 windows of 4096
// elements, bf16 buckets of 1024: one slot is 2 KiB to send and at most 2 KiB to receive.
TEST(GradientReducer, OverlapHoldsTwoBucketsOfStagingNotThePartition) {
  World w;
  const int64_t unit = 4096, units = 16, bucket = 1024;
  const Partition part(unit * units, w.n);
  std::vector<float> window(static_cast<size_t>(unit));
  std::vector<float> mine(static_cast<size_t>(part.part), 0.0f);
  GradientReducer reducer(w.comm, part, mine.data(), DType::F32, /*accumulate=*/true, bucket, /*overlap=*/true,
                          DType::BF16, DType::F32);
  for (int64_t u = units - 1; u >= 0; --u) {
    for (int64_t i = 0; i < unit; ++i) window[i] = float((u * unit + i) % 16) * float(w.r + 1);  // sums exact in bf16
    reducer.reduce_range(window.data(), u * unit, (u + 1) * unit, 0);
    reducer.wait_tag(0);  // the window is reused for the next unit, as ZeroOptimizer's windows are
  }
  reducer.wait_all();
  EXPECT_LE(reducer.staging_peak_bytes(), 2 * (2 * bucket + 2 * bucket));
  const float ranks = float(w.n * (w.n + 1) / 2) / float(w.n);  // mean of 1..W
  for (int64_t i = 0; i < part.part; ++i) {
    const int64_t g = part.begin(w.r) + i;
    ASSERT_EQ(mine[i], float(g % 16) * ranks) << i;
  }
}

// Given the gradients' boundaries, buckets hold whole gradients (DeepSpeed's IPG bucket, FACTS
// §5.3): they fill until the next would overflow reduce_bucket_size, a larger one goes alone,
// so 0 or 1 means one bucket per gradient, not one per element; no bucket mixes dtypes.
TEST(GradientReducer, BucketsHoldWholeGradientsAndOneDtype) {
  const std::vector<CommSegment> tensors = {{0, 10, DType::F32}, {10, 13, DType::F32}, {13, 40, DType::F32},
                                            {40, 44, DType::BF16}, {44, 50, DType::BF16}};
  const auto ranges = [](const std::vector<ReduceBucket>& b) {
    std::vector<std::pair<int64_t, int64_t>> out;
    for (const ReduceBucket& x : b) out.emplace_back(x.begin, x.end);
    return out;
  };
  using R = std::vector<std::pair<int64_t, int64_t>>;
  for (int64_t size : {0, 1})
    EXPECT_EQ(ranges(cut_buckets(tensors, 0, 50, size, DType::F32)), (R{{44, 50}, {40, 44}, {13, 40}, {10, 13}, {0, 10}}))
        << "reduce_bucket_size " << size;
  EXPECT_EQ(ranges(cut_buckets(tensors, 0, 50, 20, DType::F32)), (R{{40, 50}, {13, 40}, {0, 13}}));
  EXPECT_EQ(ranges(cut_buckets(tensors, 0, 50, 1000, DType::F32)), (R{{40, 50}, {0, 40}}));  // split at the dtype
  EXPECT_EQ(cut_buckets(tensors, 0, 50, 1000, DType::F32)[0].type, DType::BF16);
  EXPECT_EQ(ranges(cut_buckets(tensors, 12, 42, 1000, DType::F32)), (R{{40, 42}, {12, 40}}));  // a unit's range
  EXPECT_EQ(ranges(cut_buckets({}, 0, 10, 4, DType::F32)), (R{{6, 10}, {2, 6}, {0, 2}}));  // no gradients given
  // A reduction with one element per bucket at most: one collective per gradient.
  World w;
  std::vector<float> g(50);
  for (int i = 0; i < 50; ++i) g[i] = float(i * (w.r + 1));
  std::vector<CommSegment> fp32 = tensors;
  for (CommSegment& t : fp32) t.type = DType::F32;
  GradientReducer reducer(w.comm, g.data(), DType::F32, 50, 1, /*overlap=*/true, DType::F32, fp32);
  reducer.begin();
  reducer.grads_ready(0);
  EXPECT_EQ(reducer.finish(), 5);
  for (int i = 0; i < 50; ++i) ASSERT_FLOAT_EQ(g[i], float(i) * float(w.n + 1) / 2.0f) << i;
}

}  // namespace
