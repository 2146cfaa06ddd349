// The attention kernels' scratch in the memory plan: what a training pass leaves allocated in
// the kernels' own workspaces (the bf16 tiled kernel's tiles, the fp32 forms' heads and scores,
// the grouped-query kernels' widened q, k, v, the kept probabilities under dropout), read from
// Kokkos' allocation events by label, is attention_scratch_bytes, byte for byte, which the
// planner adds to the workspace row. A GPU build takes every head in one T × T tile: the H200
// measured that scratch (1.5 GB at GPT-2 124M, micro-batch 16) as the plan's shortfall.
#include <gtest/gtest.h>

#include <Kokkos_Core.hpp>
#include <cstdio>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "config/config.hpp"
#include "kernels/attention.hpp"
#include "kernels/attention_gqa.hpp"
#include "kernels/device.hpp"
#include "model/model.hpp"
#include "support/model_section.hpp"
#include "support/typed_param_store.hpp"
#include "train/estimator.hpp"

using namespace zero3d;

namespace {

// The attention kernels' workspaces, by their labels (kernels/attention*.hpp).
const std::set<std::string> kScratchLabels = {"attention_bf16", "attention_heads", "attention_dscores",
                                              "attention_dropped", "attention_gqa_widened"};

std::map<const void*, int64_t>* g_live = nullptr;

void on_allocate(Kokkos_Profiling_SpaceHandle, const char* label, const void* ptr, uint64_t size) {
  if (g_live && kScratchLabels.count(label)) (*g_live)[ptr] = static_cast<int64_t>(size);
}
void on_deallocate(Kokkos_Profiling_SpaceHandle, const char*, const void* ptr, uint64_t) {
  if (g_live) g_live->erase(ptr);
}

// Every workspace emptied, so that a pass grows its own from nothing.
void release_scratch() {
  kernels::attention_workspace() = kernels::AttentionWorkspace{};
  kernels::gpu::head_scratch().release();
  kernels::gpu::score_scratch().release();
  kernels::dropped_scratch().release();
  kernels::gqa_widened_scratch().release();
}

constexpr int64_t kB = 2, kT = 64;

// The bytes a forward and a backward leave in the attention workspaces.
int64_t scratch_after_a_pass(const GPTShape& shape, DType type) {
  release_scratch();
  std::map<const void*, int64_t> live;
  g_live = &live;
  Kokkos::Tools::Experimental::set_allocate_data_callback(on_allocate);
  Kokkos::Tools::Experimental::set_deallocate_data_callback(on_deallocate);
  {
    GPT model(shape, kB, kT, type, gpt_model_part(shape, {0, int(shape.n_layer) + 2}, 1, 0));
    TypedParamStore store(model, type, 3);
    ActivationBuffer buf = model.make_buffer(false);
    for (int64_t i = 0; i < kB * kT; ++i) {
      buf.token_ids(i) = static_cast<int32_t>((i * 7) % shape.vocab_size);
      buf.target_ids(i) = static_cast<int32_t>((i * 5 + 1) % shape.vocab_size);
    }
    model.forward(0, buf, store);
    model.backward(0, buf, 1.0f, store);
  }
  Kokkos::Tools::Experimental::set_allocate_data_callback(nullptr);
  Kokkos::Tools::Experimental::set_deallocate_data_callback(nullptr);
  g_live = nullptr;
  int64_t bytes = 0;
  for (const auto& [ptr, size] : live) bytes += size;
  release_scratch();
  return bytes;
}

GPTShape llama_shape() {
  return test_support::shape_of_model_section({{"architecture", "llama"}, {"vocab_size", 64},
                                               {"max_position_embeddings", kT}, {"hidden_size", 256},
                                               {"intermediate_size", 96}, {"num_hidden_layers", 2},
                                               {"num_attention_heads", 4}, {"num_key_value_heads", 2}});
}

}  // namespace

// GPT-2 (head size 64, which the fused kernels serve) and a Llama (4 query heads over 2 K/V
// heads of 64), fp32 and bf16, with and without attention dropout: whichever kernel the build
// and the pass choose (the fused bf16 kernel leaves nothing, a training pass under dropout runs
// the tiled one), the plan is what stays allocated.
TEST(AttentionScratchPlan, ThePlanIsWhatTheAttentionKernelsKeep) {
  if (kernels::kGpuBuild) GTEST_SKIP() << "the GPU build's allocation hooks are its device-memory count";
  for (const bool llama : {false, true}) {
    GPTShape shape = llama ? llama_shape() : GPTShape{64, kT, 2, 2, 128};
    for (const double p : {0.0, 0.1}) {
      shape.dropout.attn = p;
      for (const DType type : {DType::F32, DType::BF16}) {
        const std::string what = std::string(llama ? "llama " : "gpt2 ") + (type == DType::BF16 ? "bf16" : "fp32") +
                                 (p > 0.0 ? " with attention dropout" : "");
        const ModelPart part = gpt_model_part(shape, {0, int(shape.n_layer) + 2}, 1, 0);
        const int64_t kept = scratch_after_a_pass(shape, type);
        EXPECT_EQ(attention_scratch_bytes(shape, part, kB, kT, type), kept) << what;
        if (p > 0.0 && type == DType::F32) {
          EXPECT_EQ(kept, 4 * kernels::kRowBlock * kT) << what;  // one row block's kept probabilities
        }
        if (p > 0.0 && type == DType::BF16 && !llama) {
          EXPECT_GT(kept, 0) << what;  // the tiled kernel's tiles
        }
        std::printf("[ scratch  ] %s: %lld bytes kept, planned = kept\n", what.c_str(), static_cast<long long>(kept));
      }
    }
  }
}

// The planner's workspace row holds that scratch: attention dropout on a bf16 GPT-2 (the tiled
// kernel's tiles) adds exactly it.
TEST(AttentionScratchPlan, TheWorkspaceRowCountsIt) {
  nlohmann::json j = {{"train_micro_batch_size_per_gpu", kB},
                      {"bf16", {{"enabled", true}}},
                      {"optimizer", {{"type", "AdamW"}, {"params", {{"lr", 1e-3}}}}},
                      {"model", {{"vocab_size", 64}, {"n_positions", kT}, {"n_layer", 2}, {"n_head", 2}, {"n_embd", 128}}},
                      {"training", {{"steps", 1}, {"peak_gflops", 50}}}};
  const Config plain = read_config(j, "plain.json", 1);
  j["model"]["attn_pdrop"] = 0.1;
  const Config dropped = read_config(j, "dropout.json", 1);
  const GPTShape shape = gpt_shape_of(dropped.model), plain_shape = gpt_shape_of(plain.model);
  const ModelPart part = gpt_model_part(shape, {0, int(shape.n_layer) + 2}, 1, 0);
  const int64_t with = attention_scratch_bytes(shape, part, kB, kT, DType::BF16),
                without = attention_scratch_bytes(plain_shape, part, kB, kT, DType::BF16);
  EXPECT_GT(with, without);
  EXPECT_EQ(estimate_budget(dropped, 1, 0).workspace - estimate_budget(plain, 1, 0).workspace, with - without);
}
