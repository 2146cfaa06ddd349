// test_sparse_attention_device_form.cpp — block-sparse attention's device form (kernels/
// attention_sparse.hpp gpu::, what a GPU build runs: the layout's index table in model memory,
// panels gathered by kernels, products batched over equal panels, softmax, mask and backward as
// Kokkos kernels) against the CPU form, on the CPU (Kokkos Serial). The two sum in different
// orders (the scale applied in the softmax instead of the product; key gradients added group by
// group instead of query block by query block), so they agree to a few fp32 roundings, not in
// every bit: within 1e-5 of max(1, |CPU form|), for every DeepSpeed mode, with and without
// attention dropout, and through a training run of the model.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>
#include <utility>
#include <vector>

#include "base/rng.hpp"
#include "kernels/attention_sparse.hpp"
#include "model/model.hpp"
#include "model/sparse_attention.hpp"
#include "optim/optimizer.hpp"
#include "support/model_memory.hpp"

using namespace zero3d;
using namespace zero3d::kernels;

using test_support::worst_error;

namespace {

constexpr double kTolerance = 1e-5;

std::vector<float> random_vector(size_t n, uint64_t stream) {
  return test_support::normal_vector(23, n, stream);
}

// A layout of each DeepSpeed mode, at T = 64 in blocks of 8 (8 blocks per row) over 3 heads.
struct Case {
  std::string name;
  SparseAttention sparse;
};

std::vector<Case> cases() {
  SparseAttention base;
  base.enabled = true;
  base.block = 8;
  std::vector<Case> out;
  SparseAttention s = base;  // per-head global patterns, windows of 3 (a short last window)
  s.mode = SparsityMode::Fixed;
  s.num_local_blocks = 3;
  s.different_layout_per_head = true;
  s.num_different_global_patterns = 3;
  out.push_back({"fixed", s});
  s = base;
  s.mode = SparsityMode::Fixed;
  s.num_local_blocks = 4;
  s.num_global_blocks = 2;
  s.unidirectional = true;
  out.push_back({"fixed_unidirectional", s});
  s = base;
  s.mode = SparsityMode::BigBird;
  s.num_random_blocks = 2;
  s.different_layout_per_head = true;
  out.push_back({"bigbird", s});
  s = base;
  s.mode = SparsityMode::BSLongformer;
  s.global_block_indices = {0, 4};
  s.global_block_end_indices = {1, 6};
  out.push_back({"bslongformer", s});
  s = base;
  s.mode = SparsityMode::Variable;
  s.num_random_blocks = 2;
  s.local_window_blocks = {1, 2};
  s.global_block_indices = {2};
  s.different_layout_per_head = true;
  s.unidirectional = true;
  out.push_back({"variable", s});
  s = base;
  s.mode = SparsityMode::Dense;
  out.push_back({"dense", s});
  return out;
}

// The probabilities each (sample, head) keeps: block² per computed block, the most of any head.
Index probs_stride(const std::vector<uint8_t>& layout, Index H, Index nb, Index block) {
  Index most = 0;
  for (Index h = 0; h < H; ++h) {
    Index on = 0;
    for (Index r = 0; r < nb; ++r)
      for (Index c = 0; c <= r; ++c) on += layout[(h * nb + r) * nb + c];
    most = std::max(most, on);
  }
  return most * block * block;
}

struct Result {
  std::vector<float> out, att, dqkv;
};

constexpr Index B = 2, T = 64, C = 60, H = 3;  // hs 20: a scale 1/√hs that is not a power of two

Result run(bool device_form, const std::vector<uint8_t>& layout, Index block, const DropoutMask& drop) {
  const Index nb = T / block, stride = probs_stride(layout, H, nb, block);
  const SparseBlockTable table(layout, H, nb, block);
  const std::vector<float> qkv = random_vector(B * T * 3 * C, 1), dout = random_vector(B * T * C, 2);
  Result r{std::vector<float>(B * T * C, -1.0f), std::vector<float>(B * H * stride + 1, -1.0f),
           std::vector<float>(B * T * 3 * C, -1.0f)};
  r.att.back() = 123.0f;  // a guard just past the last panel
  sparse_attention_device_form_on_host() = device_form;
  sparse_attention_forward(r.out.data(), r.att.data(), stride, qkv.data(), table, B, T, C, H, drop);
  sparse_attention_backward(r.dqkv.data(), dout.data(), qkv.data(), r.att.data(), stride, table, B, T, C, H, drop);
  sparse_attention_device_form_on_host() = false;
  EXPECT_EQ(r.att.back(), 123.0f) << "the panels overran their stride";
  return r;
}

void expect_forms_agree(const std::vector<uint8_t>& layout, Index block, const DropoutMask& drop,
                        const std::string& what) {
  const Result cpu = run(false, layout, block, drop), dev = run(true, layout, block, drop);
  EXPECT_LE(worst_error(dev.out, cpu.out), kTolerance) << what << ": output";
  EXPECT_LE(worst_error(dev.att, cpu.att), kTolerance) << what << ": kept probabilities";
  // every gradient: q, k and v of every token and head
  std::vector<float> dq_cpu, dq_dev, dk_cpu, dk_dev, dv_cpu, dv_dev;
  for (Index e = 0; e < B * T * 3 * C; ++e) {
    const Index part = (e % (3 * C)) / C;
    (part == 0 ? dq_cpu : part == 1 ? dk_cpu : dv_cpu).push_back(cpu.dqkv[e]);
    (part == 0 ? dq_dev : part == 1 ? dk_dev : dv_dev).push_back(dev.dqkv[e]);
  }
  std::printf("[ sparse   ] %s: output %.1e, probabilities %.1e, dq %.1e, dk %.1e, dv %.1e\n", what.c_str(),
              worst_error(dev.out, cpu.out), worst_error(dev.att, cpu.att), worst_error(dq_dev, dq_cpu),
              worst_error(dk_dev, dk_cpu), worst_error(dv_dev, dv_cpu));
  EXPECT_LE(worst_error(dq_dev, dq_cpu), kTolerance) << what << ": dq";
  EXPECT_LE(worst_error(dk_dev, dk_cpu), kTolerance) << what << ": dk";
  EXPECT_LE(worst_error(dv_dev, dv_cpu), kTolerance) << what << ": dv";
}

DropoutMask attention_dropout() {
  DropoutMask m = dropout_mask(0.3, 17, 40, 2, DropoutSite::Probabilities);
  m.first_head = 3;  // as tensor rank 1 of heads 3, 4, 5
  return m;
}

}  // namespace

TEST(SparseAttentionDeviceForm, EveryModeAgreesWithTheCpuForm) {
  for (const Case& c : cases()) {
    const std::vector<uint8_t> layout = sparse_block_layout(c.sparse, H, T, 0);
    expect_forms_agree(layout, c.sparse.block, {}, c.name);
  }
}

TEST(SparseAttentionDeviceForm, EveryModeWithAttentionDropoutAgreesWithTheCpuForm) {
  for (const Case& c : cases()) {
    const std::vector<uint8_t> layout = sparse_block_layout(c.sparse, H, T, 1);
    expect_forms_agree(layout, c.sparse.block, attention_dropout(), c.name + " with dropout");
    // and the mask changes the output, so the check above can fail
    const Result plain = run(true, layout, c.sparse.block, {});
    const Result dropped = run(true, layout, c.sparse.block, attention_dropout());
    EXPECT_GT(worst_error(dropped.out, plain.out), 1e-3) << c.name;
  }
}

// Blocks of 16 (4 per row); a row with no key block (none of DeepSpeed's patterns makes one)
// outputs zero and has zero gradient in both forms; pairs of one head computing different
// numbers of blocks fall in different product batches.
TEST(SparseAttentionDeviceForm, RowsWithoutKeysAndUnevenRowsAgreeWithTheCpuForm) {
  const Index block = 16, nb = T / block;
  std::vector<uint8_t> layout(H * nb * nb, 0);
  for (Index h = 0; h < H; ++h)
    for (Index r = 0; r < nb; ++r)
      for (Index c = 0; c <= r; ++c) layout[(h * nb + r) * nb + c] = (h + r + c) % 3 != 0 ? 1 : 0;
  layout[(1 * nb + 2) * nb + 0] = layout[(1 * nb + 2) * nb + 1] = layout[(1 * nb + 2) * nb + 2] = 0;  // head 1, row 2
  const SparseBlockTable table(layout, H, nb, block);
  ASSERT_GT(table.empty_pairs(), 0);
  ASSERT_GT(table.groups().size(), 1u);
  expect_forms_agree(layout, block, {}, "uneven");
  expect_forms_agree(layout, block, attention_dropout(), "uneven with dropout");
  const Result dev = run(true, layout, block, {});
  for (Index b = 0; b < B; ++b)
    for (Index t = 2 * block; t < 3 * block; ++t)
      for (Index x = 0; x < C / H; ++x) {
        ASSERT_EQ(dev.out[(b * T + t) * C + 1 * (C / H) + x], 0.0f);
        ASSERT_EQ(dev.dqkv[(b * T + t) * 3 * C + 1 * (C / H) + x], 0.0f);
      }
}

// The index table is the layout's: each pair's key blocks ascending, up to the diagonal, and
// every computed block in exactly one group.
TEST(SparseAttentionDeviceForm, TheIndexTableListsTheLayoutsCausalBlocks) {
  const Case c = cases().front();
  const Index nb = T / c.sparse.block;
  const std::vector<uint8_t> layout = sparse_block_layout(c.sparse, H, T, 0);
  const SparseBlockTable table(layout, H, nb, c.sparse.block);
  std::vector<Index> offsets(H * nb + 1), blocks(table.computed_blocks());
  copy_to_host(offsets.data(), table.offsets(), offsets.size() * sizeof(Index));
  copy_to_host(blocks.data(), table.key_blocks(), blocks.size() * sizeof(Index));
  Index computed = 0;
  for (Index p = 0; p < H * nb; ++p) {
    const Index h = p / nb, qb = p % nb;
    std::vector<Index> want;
    for (Index kb = 0; kb <= qb; ++kb)
      if (layout[(h * nb + qb) * nb + kb]) want.push_back(kb);
    EXPECT_EQ(std::vector<Index>(blocks.begin() + offsets[p], blocks.begin() + offsets[p + 1]), want) << p;
    computed += static_cast<Index>(want.size());
  }
  EXPECT_EQ(table.computed_blocks(), computed);
  Index grouped = 0;
  for (const SparseBlockTable::Group& g : table.groups()) grouped += g.count * g.blocks;
  EXPECT_EQ(grouped, computed);
}

TEST(SparseAttentionDeviceForm, TwoRunsGiveTheSameBits) {
  const Case c = cases()[2];  // bigbird
  const std::vector<uint8_t> layout = sparse_block_layout(c.sparse, H, T, 0);
  const Result a = run(true, layout, c.sparse.block, attention_dropout());
  const Result b = run(true, layout, c.sparse.block, attention_dropout());
  EXPECT_EQ(a.out, b.out);
  EXPECT_EQ(a.dqkv, b.dqkv);
}

namespace {

// Losses and gradient norms of AdamW steps of a GPT-2 with per-head fixed layouts (and a
// bigbird variant) and dropout everywhere, through the form the hook picks.
std::vector<double> train(const SparseAttention& sparse, bool device_form) {
  GPTShape shape{61, 64, 2, 4, 80};  // hs 20
  shape.sparse = sparse;
  shape.dropout.embd = shape.dropout.attn = shape.dropout.resid = 0.1;
  shape.dropout.seed = 9;
  const int64_t Bm = 2, Tm = shape.n_positions;
  FlatModel model(shape, Bm, Tm);
  init_gpt_params(model.params.data(), model.model.layout(), shape, 5);
  OptimizerConfig oc;
  oc.type = OptimizerType::Adam;
  oc.adam_w_mode = true;
  oc.lr = 3e-3;
  oc.weight_decay = 0.01;
  Optimizer opt(oc, model.model.layout());
  Rng rng(31, 0);
  std::vector<double> out;
  sparse_attention_device_form_on_host() = device_form;
  for (int step = 0; step < 6; ++step) {
    std::vector<int32_t> tokens(Bm * Tm + 1);
    for (auto& t : tokens) t = static_cast<int32_t>(rng.below(shape.vocab_size));
    model.model.set_samples(step * Bm, /*training=*/true);
    model.zero_grad();
    out.push_back(model.forward(tokens.data(), tokens.data() + 1));
    model.backward(1.0f);
    out.push_back(clip_grad_norm(model.grads.data(), model.model.num_params(), 1.0));
    opt.step(model.params.data(), model.grads.data(), oc.lr);
  }
  sparse_attention_device_form_on_host() = false;
  return out;
}

}  // namespace

TEST(SparseAttentionDeviceForm, TrainingThroughItGivesTheCpuFormsLosses) {
  SparseAttention fixed;
  fixed.enabled = true;
  fixed.block = 8;
  fixed.num_local_blocks = 3;
  fixed.different_layout_per_head = true;
  fixed.num_different_global_patterns = 3;
  SparseAttention bigbird = fixed;
  bigbird.mode = SparsityMode::BigBird;
  bigbird.num_random_blocks = 2;
  for (const auto& [name, sparse] : {std::pair<std::string, SparseAttention>{"fixed", fixed}, {"bigbird", bigbird}}) {
    const std::vector<double> cpu = train(sparse, false), dev = train(sparse, true);
    ASSERT_EQ(cpu.size(), dev.size());
    double worst = 0.0;
    for (size_t i = 0; i < cpu.size(); ++i) worst = std::max(worst, std::fabs(dev[i] - cpu[i]) / std::fabs(cpu[i]));
    std::printf("[ sparse   ] %s: 6 AdamW steps, losses and gradient norms within %.1e of the CPU form's\n",
                name.c_str(), worst);
    for (size_t i = 0; i < cpu.size(); ++i)
      EXPECT_NEAR(dev[i], cpu[i], kTolerance * std::fabs(cpu[i]))
          << name << " step " << i / 2 + 1 << (i % 2 ? " gradient norm" : " loss");
    EXPECT_NE(cpu.front(), cpu[cpu.size() - 2]) << name << ": the model trains";
  }
}
