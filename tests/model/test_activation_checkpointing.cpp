// test_activation_checkpointing.cpp — activation checkpointing in the model, as specifications:
// recomputation changes no bit of the loss or of any gradient, and the activations a buffer and
// the shared workspaces hold follow the formula of each granularity and interval, exactly.
#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <vector>

#include "kernels/attention.hpp"  // ZERO3D_FLASH_ATTENTION: whether the fused bf16 kernel is built
#include "kernels/half.hpp"
#include "model/model.hpp"
#include "support/typed_param_store.hpp"

using namespace zero3d;

namespace {

// L = 5 blocks, so intervals 2, 3 and 4 leave a shorter last checkpoint.
const GPTShape kShape{64, 16, 5, 2, 32};
constexpr int64_t kB = 2, kT = 16;

struct Pass {
  float loss;
  std::vector<float> grads, d_input;
};

// Two micro-batches through one buffer (forward, backward, forward, backward), gradients
// accumulated: what a step of gradient accumulation does.
Pass train_pass(DType type, const ActivationCheckpointing& ac) {
  GPT model(kShape, kB, kT, type, gpt_model_part(kShape, {0, int(kShape.n_layer) + 2}, 1, 0), {}, ac);
  TypedParamStore store(model, type, 7);
  ActivationBuffer buf = model.make_buffer(false);
  Pass out{0.0f, {}, {}};
  for (int mb = 0; mb < 2; ++mb) {
    for (int64_t i = 0; i < kB * kT; ++i) {
      buf.token_ids(i) = static_cast<int32_t>((i * 7 + mb * 13) % kShape.vocab_size);
      buf.target_ids(i) = static_cast<int32_t>((i * 5 + mb * 3 + 1) % kShape.vocab_size);
    }
    out.loss += model.forward(0, buf, store);
    model.backward(0, buf, 0.5f, store);
  }
  out.grads = store.grads();
  out.d_input.assign(buf.d_input, buf.d_input + kB * kT * kShape.n_embd);
  return out;
}

void expect_bit_identical(const Pass& got, const Pass& want, const std::string& what) {
  EXPECT_EQ(std::memcmp(&got.loss, &want.loss, sizeof(float)), 0) << what << ": loss " << got.loss << " vs " << want.loss;
  ASSERT_EQ(got.grads.size(), want.grads.size());
  size_t differ = 0;
  for (size_t i = 0; i < want.grads.size(); ++i)
    differ += std::memcmp(&got.grads[i], &want.grads[i], sizeof(float)) != 0;
  EXPECT_EQ(differ, 0u) << what << ": gradient elements that differ";
  EXPECT_EQ(std::memcmp(got.d_input.data(), want.d_input.data(), want.d_input.size() * sizeof(float)), 0)
      << what << ": the input gradient differs";
}

ActivationCheckpointing full(int interval) {
  ActivationCheckpointing ac;
  ac.interval = interval;
  return ac;
}

ActivationCheckpointing selective() {
  ActivationCheckpointing ac;
  ac.interval = 1;
  ac.granularity = RecomputeGranularity::Selective;
  return ac;
}

}  // namespace

TEST(ActivationCheckpointing, EveryIntervalGivesTheLossAndEveryGradientBitForBit) {
  for (DType type : {DType::F32, DType::BF16}) {
    const Pass want = train_pass(type, {});
    for (int interval = 1; interval <= kShape.n_layer + 1; ++interval)
      expect_bit_identical(train_pass(type, full(interval)), want,
                           dtype_name(type) + " full, interval " + std::to_string(interval));
    expect_bit_identical(train_pass(type, selective()), want, dtype_name(type) + " selective");
  }
}

TEST(ActivationCheckpointing, HostMemoryContiguousBuffersAndFencesChangeNoBit) {
  const Pass want = train_pass(DType::F32, {});
  ActivationCheckpointing cpu = full(2);
  cpu.cpu_checkpointing = true;
  expect_bit_identical(train_pass(DType::F32, cpu), want, "cpu_checkpointing");
  ActivationCheckpointing contiguous = full(1);
  contiguous.partition_activations = true;  // one tensor rank: the partition is the whole input
  contiguous.contiguous_memory_optimization = true;
  contiguous.number_checkpoints = 7;
  contiguous.cpu_checkpointing = true;
  contiguous.synchronize_checkpoint_boundary = true;
  contiguous.profile = true;
  expect_bit_identical(train_pass(DType::F32, contiguous), want, "contiguous, partitioned, in host memory, fenced");
}

TEST(ActivationCheckpointing, RecomputationReallyRunsFromTheSavedInput) {
  // Spoil the saved inputs between forward and backward: a model that recomputed from them
  // must produce other gradients (a model that silently kept its activations would not).
  GPT model(kShape, kB, kT, DType::F32, gpt_model_part(kShape, {0, int(kShape.n_layer) + 2}, 1, 0), {}, full(2));
  TypedParamStore clean(model, DType::F32, 7), spoiled(model, DType::F32, 7);
  ActivationBuffer buf = model.make_buffer(false);
  for (int64_t i = 0; i < kB * kT; ++i) buf.token_ids(i) = buf.target_ids(i) = static_cast<int32_t>(i % 64);
  model.forward(0, buf, clean);
  model.backward(0, buf, 1.0f, clean);
  model.forward(0, buf, spoiled);
  ASSERT_EQ(buf.checkpoints.size(), 3u);  // ceil(5 / 2)
  buf.checkpoints[1][0] += 1.0f;
  model.backward(0, buf, 1.0f, spoiled);
  EXPECT_NE(std::memcmp(clean.grads().data(), spoiled.grads().data(), clean.grads().size() * sizeof(float)), 0);
}

TEST(ActivationCheckpointing, ProfileTimesEveryCheckpoint) {
  ActivationCheckpointing ac = full(2);
  ac.profile = true;
  GPT model(kShape, kB, kT, DType::F32, gpt_model_part(kShape, {0, int(kShape.n_layer) + 2}, 1, 0), {}, ac);
  TypedParamStore store(model, DType::F32, 7);
  ActivationBuffer buf = model.make_buffer(false);
  for (int64_t i = 0; i < kB * kT; ++i) buf.token_ids(i) = buf.target_ids(i) = static_cast<int32_t>(i % 64);
  model.forward(0, buf, store);
  model.backward(0, buf, 1.0f, store);
  const auto& times = model.checkpoint_times();
  ASSERT_EQ(times.size(), 3u);
  for (size_t g = 0; g < times.size(); ++g) {
    EXPECT_EQ(times[g].first_block, 2 * int(g));
    EXPECT_EQ(times[g].num_blocks, g < 2 ? 2 : 1);
    EXPECT_GT(times[g].forward_ms, 0.0);
    EXPECT_GT(times[g].recompute_ms, 0.0);
  }
}

// The formula, written out per granularity for one stage holding every block (B·T tokens,
// width C, H heads, vocabulary V; 4 bytes per float, 8 per token for ids and targets):
//   a block keeps        16·BTC + 4·BT + B·H·T²   (ln_1, res_2, ln_2, res_3: 4·BTC; qkv 3, atty 1,
//                                                   fc and GELU 4 + 4: 12·BTC; 4 LayerNorm stats; probabilities)
//   the stream           input and d_input: 2·BTC (one stage receives no output gradient)
//   the head             ln_f BTC, its stats 2·BT, logits BTV, losses and lse 2·BT
//   none                 buffer = stream + L·block + head;                shared = scratch
//   selective            buffer = stream + L·(block − BHT²) + head;       shared = scratch + BHT²
//   full, interval N     buffer = stream + BTC (output) + head + G·BTC    (G = ⌈L/N⌉ saved inputs)
//                        shared = scratch + BTC (restored input) + N·block
//   scratch              BTC + 8·BTC + 64·T (backward scratch)
TEST(ActivationCheckpointing, BuffersAndWorkspacesFollowTheFormulaOfEachGranularityAndInterval) {
  const int64_t B = kB, T = kT, C = kShape.n_embd, H = kShape.n_head, V = kShape.vocab_size, L = kShape.n_layer,
                BT = B * T;
  const int64_t block = 16 * BT * C + 4 * BT + B * H * T * T, stream = 2 * BT * C,
                head = BT * C + 2 * BT + BT * V + 2 * BT, scratch = BT * C + 8 * BT * C + 64 * T, ids = 8 * BT;
  struct Case {
    ActivationCheckpointing ac;
    int64_t buffer, shared;
    std::string what;
  };
  std::vector<Case> cases = {
      {{}, 4 * (stream + L * block + head) + ids, 4 * scratch, "none"},
      {selective(), 4 * (stream + L * (block - B * H * T * T) + head) + ids, 4 * (scratch + B * H * T * T),
       "selective"}};
  for (int N = 1; N <= L; ++N) {
    const int64_t G = (L + N - 1) / N;
    cases.push_back({full(N), 4 * (stream + BT * C + head + G * BT * C) + ids, 4 * (scratch + BT * C + N * block),
                     "full, interval " + std::to_string(N)});
  }
  ActivationCheckpointing contiguous = full(2);
  contiguous.partition_activations = contiguous.contiguous_memory_optimization = true;
  contiguous.number_checkpoints = 8;  // 8 slots, of which a micro-batch uses 3
  cases.push_back({contiguous, 4 * (stream + BT * C + head + 8 * BT * C) + ids, 4 * (scratch + BT * C + 2 * block),
                   "contiguous, 8 slots"});
  ActivationCheckpointing cpu = full(3);
  cpu.cpu_checkpointing = true;
  cases.push_back({cpu, 4 * (stream + BT * C + head + 2 * BT * C) + ids, 4 * (scratch + BT * C + 3 * block),
                   "cpu_checkpointing, interval 3"});
  const ModelPart part = gpt_model_part(kShape, {0, int(L) + 2}, 1, 0);
  for (const Case& c : cases) {
    GPT model(kShape, B, T, DType::F32, part, {}, c.ac);
    const ActivationBuffer buf = model.make_buffer(false);
    EXPECT_EQ(buf.bytes(), c.buffer) << c.what;
    EXPECT_EQ(model.scratch_bytes(), c.shared) << c.what;
    EXPECT_EQ(buf.host_bytes(), c.ac.cpu_checkpointing ? 4 * 2 * BT * C : 0) << c.what;
    // the planner's figure is the allocator's
    const GPTActivationBytes plan = gpt_activation_bytes(kShape, part, B, T, false, false, c.ac);
    EXPECT_EQ(plan.buffer, c.buffer) << c.what;
    EXPECT_EQ(plan.scratch, c.shared) << c.what;
  }
}

// bf16 keeps ln_1, qkv, the attention output, ln_2, fc and its GELU in bf16 where the forward
// makes them (model/bf16_activations.hpp), so a buffer allocates half the floats for them, and
// for attention what its kernel keeps: the tiled kernel's bf16 probability tiles (T = 16 with
// head size 32, where the fused kernel's saves would not be smaller), the fused kernel's
// log-sum-exp and bf16 output at T = 64 (no B·H·T² probabilities at all).
TEST(ActivationCheckpointing, Bf16BuffersHoldTheBf16SavesInHalfTheFloats) {
  struct Case {
    GPTShape shape;
    int64_t att;  // floats the attention keeps per block
  };
  const int64_t B = 2;
#ifdef ZERO3D_FLASH_ATTENTION
  const int64_t fused = 4 * 64 + 4 * 64 * 16 / 2;  // L [B·H·T] fp32, then O [B·H·T·hs] in bf16
#else
  const int64_t fused = 4 * 64 * 64 / 2;  // one 64×64 bf16 tile per head
#endif
  const Case cases[] = {{GPTShape{64, 16, 3, 2, 64}, 4 * 16 * 16 / 2}, {GPTShape{64, 64, 3, 2, 32}, fused}};
  for (const Case& c : cases) {
    const int64_t T = c.shape.n_positions, C = c.shape.n_embd, V = c.shape.vocab_size, L = c.shape.n_layer, BT = B * T;
    // halves: ln_1, qkv, atty, ln_2, fch, fch_gelu = (1 + 3 + 1 + 1 + 4 + 4)/2 BTC; fp32: res_2, res_3, the statistics
    const int64_t block = 7 * BT * C + 2 * BT * C + 4 * BT + c.att;
    const int64_t buffer = 4 * (2 * BT * C + L * block + BT * C + 2 * BT + BT * V + 2 * BT) + 8 * BT;
    const ModelPart part = gpt_model_part(c.shape, {0, int(L) + 2}, 1, 0);
    GPT model(c.shape, B, T, DType::BF16, part);
    EXPECT_EQ(model.make_buffer(false).bytes(), buffer) << "T " << T;
    EXPECT_EQ(gpt_activation_bytes(c.shape, part, B, T, false, false, {}, {}, DType::BF16).buffer, buffer) << "T " << T;
    // selective recompute shares one block's attention saves, at the same size
    EXPECT_EQ(gpt_activation_bytes(c.shape, part, B, T, false, false, selective(), {}, DType::BF16).scratch -
                  gpt_activation_bytes(c.shape, part, B, T, false, false, {}, {}, DType::BF16).scratch,
              4 * c.att)
        << "T " << T;
  }
}

TEST(ActivationCheckpointing, PartitionedInputsKeepOneTensorRanksShare) {
  // At t = 2 a saved input keeps BTC/2 (the other half is all-gathered before recompute).
  const int64_t BT = kB * kT, C = kShape.n_embd;
  ActivationCheckpointing ac = full(1);
  ac.partition_activations = true;
  const ModelPart part = gpt_model_part(kShape, {0, int(kShape.n_layer) + 2}, 1, 0, 2, 1);
  const ActivationPlan split = gpt_activation_plan(kShape, part, kB, kT, false, false, ac);
  EXPECT_EQ(split.checkpoint_slot, BT * C / 2);
  EXPECT_EQ(split.checkpoint_slots, kShape.n_layer);
  ac.partition_activations = false;
  EXPECT_EQ(gpt_activation_plan(kShape, part, kB, kT, false, false, ac).checkpoint_slot, BT * C);
}

TEST(ActivationCheckpointing, FullRecomputeRefusesToKeepOperandsForALaterWeightPass) {
  GPT model(kShape, kB, kT, DType::F32, gpt_model_part(kShape, {0, int(kShape.n_layer) + 2}, 1, 0), {}, full(1));
  EXPECT_THROW(model.make_buffer(true), std::invalid_argument);
  // a contiguous buffer with fewer slots than a forward's checkpoints (5 at interval 1)
  ActivationCheckpointing few = full(1);
  few.partition_activations = few.contiguous_memory_optimization = true;
  few.number_checkpoints = 4;
  EXPECT_THROW(GPT(kShape, kB, kT, DType::F32, gpt_model_part(kShape, {0, int(kShape.n_layer) + 2}, 1, 0), {}, few),
               std::invalid_argument);
}
