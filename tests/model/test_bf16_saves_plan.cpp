// test_bf16_saves_plan.cpp — the plan of a block's saves under bf16 compute
// (model_layout.cpp gpt_block_save_sizes, after model/bf16_activations.hpp). As specifications: a
// GPU build keeps a tensor rank's saves in bf16 as one rank's are kept (half the floats for the
// norms' outputs, sequence-parallel shards among them, q/k/v, the attention output, the MLP's
// hidden rows and activation), while a CPU build keeps its tensor-parallel saves fp32; on one
// rank both builds keep the same saves.
#include <gtest/gtest.h>

#include <string>

#include "kernels/device.hpp"
#include "model/model.hpp"
#include "support/model_section.hpp"

using namespace zero3d;

namespace {

constexpr int64_t kB = 2, kT = 32;

GPTShape llama_shape() {
  return test_support::shape_of_model_section({{"architecture", "llama"}, {"vocab_size", 64},
                                               {"max_position_embeddings", kT}, {"hidden_size", 64},
                                               {"intermediate_size", 96}, {"num_hidden_layers", 2},
                                               {"num_attention_heads", 4}, {"num_key_value_heads", 2}});
}

int64_t half(int64_t floats) { return (floats + 1) / 2; }

BlockSaveSizes sizes(const GPTShape& shape, int t, bool sp, kernels::Backend backend) {
  const ModelPart part = gpt_model_part(shape, {0, static_cast<int>(shape.n_layer) + 2}, 1, 0, t, 0);
  return gpt_block_save_sizes(shape, part, kB, kT, sp, DType::BF16, backend);
}

}  // namespace

TEST(Bf16SavesPlan, AGpuKeepsATensorRanksSavesInBf16AndACpuKeepsThemFp32) {
  for (const bool llama : {false, true})
    for (const bool sp : {false, true}) {
      const GPTShape shape = llama ? llama_shape() : GPTShape{64, kT, 2, 4, 64};
      const std::string what = std::string(llama ? "llama" : "gpt2") + (sp ? " sequence-parallel" : "");
      const BlockSaveSizes cpu = sizes(shape, 2, sp, kernels::Backend::Cpu),
                           gpu = sizes(shape, 2, sp, kernels::Backend::Gpu);
      EXPECT_EQ(gpu.qkv, half(cpu.qkv)) << what;
      EXPECT_EQ(gpu.atty, half(cpu.atty)) << what;
      EXPECT_EQ(gpu.fch, half(cpu.fch)) << what;
      EXPECT_EQ(gpu.act, half(cpu.act)) << what;
      // the norms' outputs too: a sequence-parallel shard is gathered in bf16
      EXPECT_EQ(gpu.ln_1, half(cpu.ln_1)) << what;
      EXPECT_EQ(gpu.ln_2, half(cpu.ln_2)) << what;
      EXPECT_EQ(cpu.ln_1, kB * kT * shape.n_embd / (sp ? 2 : 1)) << what;
      EXPECT_EQ(gpu.res, cpu.res) << what;
      EXPECT_EQ(gpu.stats, cpu.stats) << what;
      // the CPU build's tensor rank keeps fp32 saves: the unsplit width's over t, as floats
      const BlockWidths w = block_widths(shape, 2);
      EXPECT_EQ(cpu.qkv, kB * kT * (llama ? w.qkv : 3 * shape.n_embd / 2)) << what;
    }
}

TEST(Bf16SavesPlan, OneRankKeepsTheSameSavesOnEitherBuild) {
  for (const bool llama : {false, true}) {
    const GPTShape shape = llama ? llama_shape() : GPTShape{64, kT, 2, 4, 64};
    const BlockSaveSizes cpu = sizes(shape, 1, false, kernels::Backend::Cpu),
                         gpu = sizes(shape, 1, false, kernels::Backend::Gpu);
    const int64_t BT = kB * kT, C = shape.n_embd;
    EXPECT_EQ(cpu.ln_1, half(BT * C));
    EXPECT_EQ(gpu.ln_1, cpu.ln_1);
    EXPECT_EQ(gpu.qkv, cpu.qkv);
    EXPECT_EQ(gpu.atty, cpu.atty);
    EXPECT_EQ(gpu.ln_2, cpu.ln_2);
    EXPECT_EQ(gpu.fch, cpu.fch);
    EXPECT_EQ(gpu.act, cpu.act);
  }
}
