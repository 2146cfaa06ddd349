// test_optimizer_frozen.cpp — the optimizer over trainable ranges (model.frozen_parameters): the
// frozen elements are neither read nor written (no update, no weight decay), the states hold the
// trainable elements only, packed, and each trainable element is updated exactly as by an
// optimizer over the trainable elements alone (PyTorch's param group without the frozen ones).
// The gradient buckets skip frozen tensors (a gap in the segments closes a bucket).
#include <gtest/gtest.h>

#include <cstring>
#include <vector>

#include "optim/optimizer.hpp"
#include "parallel/grad_reducer.hpp"

using namespace zero3d;

namespace {

OptimizerConfig adamw() {
  OptimizerConfig c;
  c.type = OptimizerType::Adam;
  c.lr = 0.01;
  c.weight_decay = 0.1;
  return c;
}

// 10 elements: [0, 3) and [6, 8) trainable, the rest frozen.
const Optimizer::Ranges kTrainable = {{0, 3}, {6, 8}};

std::vector<float> values(int n, float base) {
  std::vector<float> v(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) v[static_cast<size_t>(i)] = base + 0.1f * static_cast<float>(i) * (i % 2 ? -1.0f : 1.0f);
  return v;
}

TEST(FrozenOptimizer, UpdatesTrainableRangesAsAnOptimizerOverThemAloneAndLeavesFrozenBits) {
  for (const OptimizerType type : {OptimizerType::Adam, OptimizerType::Lion, OptimizerType::SGD}) {
    OptimizerConfig c = adamw();
    c.type = type;
    c.momentum = 0.9;
    ParamLayout full;
    full.add("w", {10});
    Optimizer frozen(c, full, DType::F32, nullptr, kTrainable);
    EXPECT_EQ(frozen.state_elems(), 5);
    ParamLayout five;
    five.add("w", {5});
    Optimizer alone(c, five);  // the same elements as one group
    std::vector<float> p = values(10, 0.5f), q = {p[0], p[1], p[2], p[6], p[7]};
    const std::vector<float> start = p;
    for (int step = 0; step < 3; ++step) {
      const std::vector<float> g = values(10, 0.05f * static_cast<float>(step + 1));
      const std::vector<float> h = {g[0], g[1], g[2], g[6], g[7]};
      frozen.step(p.data(), g.data(), c.lr);
      alone.step(q.data(), h.data(), c.lr);
    }
    const std::vector<int> trained = {0, 1, 2, 6, 7};
    for (size_t k = 0; k < trained.size(); ++k) {
      EXPECT_EQ(p[static_cast<size_t>(trained[k])], q[k]) << static_cast<int>(c.type) << " element " << trained[k];
      EXPECT_NE(p[static_cast<size_t>(trained[k])], start[static_cast<size_t>(trained[k])]);
    }
    for (const int i : {3, 4, 5, 8, 9}) EXPECT_EQ(p[static_cast<size_t>(i)], start[static_cast<size_t>(i)]) << "frozen " << i;
    EXPECT_EQ(frozen.state_bytes(), alone.state_bytes());
  }
}

// An fp32 master copy packed as the states (set_params_packed): the 16-bit copy of each trained
// element is cast in the same pass, and the frozen elements of that copy are left alone.
TEST(FrozenOptimizer, PackedMasterCastsTrainedElementsIntoTheViewOnly) {
  ParamLayout full;
  full.add("w", {10});
  Optimizer opt(adamw(), full, DType::F32, nullptr, kTrainable);
  opt.set_params_packed(true);
  std::vector<float> master = {0.5f, -0.25f, 0.75f, 1.0f, -1.0f};
  std::vector<uint16_t> model(10, 0x1234);  // bf16 bits; frozen ones must keep this pattern
  const std::vector<float> g = values(10, 0.1f);
  opt.step(TypedSpan{master.data(), DType::F32}, g.data(), DType::F32, 1.0f, 0.01, std::nullopt,
           TypedSpan{model.data(), DType::BF16}, 10);
  for (const int i : {3, 4, 5, 8, 9}) EXPECT_EQ(model[static_cast<size_t>(i)], 0x1234) << "frozen " << i;
  const std::vector<int> trained = {0, 1, 2, 6, 7};
  for (size_t k = 0; k < trained.size(); ++k) {
    uint32_t bits;
    std::memcpy(&bits, &master[k], 4);
    const uint16_t rounded = static_cast<uint16_t>((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
    EXPECT_EQ(model[static_cast<size_t>(trained[k])], rounded) << "element " << trained[k];
  }
}

TEST(FrozenOptimizer, LambAndOneBitRefuseRanges) {
  ParamLayout full;
  full.add("w", {10});
  OptimizerConfig c = adamw();
  c.type = OptimizerType::Lamb;
  EXPECT_THROW(Optimizer(c, full, DType::F32, nullptr, kTrainable), std::logic_error);
}

TEST(FrozenGradientBuckets, AGapInTheSegmentsClosesTheBucketAndIsNotReduced) {
  // Tensors [0, 4), [4, 10) frozen (left out), [10, 12), [12, 20): one bucket may hold all.
  const std::vector<CommSegment> segments = {{0, 4, DType::F32}, {10, 12, DType::F32}, {12, 20, DType::F32}};
  const std::vector<ReduceBucket> b = cut_buckets(segments, 0, 20, 100, DType::F32);
  ASSERT_EQ(b.size(), 2u);
  EXPECT_EQ(b[0].begin, 10);
  EXPECT_EQ(b[0].end, 20);
  EXPECT_EQ(b[1].begin, 0);
  EXPECT_EQ(b[1].end, 4);
}

}  // namespace
