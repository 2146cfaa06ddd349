// Block-sparse attention's model memory in the memory plan: each block's index table
// (kernels/attention_sparse_table.hpp) and, where the device form runs (a GPU build; here the CPU
// build's hook), its panel workspace (sparse_attention_panels). What a model allocates is read
// from Kokkos' own allocation events, by label, while it trains a step through the kernels; the
// plan (sparse_attention_model_bytes, which the planner adds to the workspace) must equal it byte
// for byte, and the budget's workspace must grow by exactly the panels when the device form runs.
#include <gtest/gtest.h>

#include <Kokkos_Core.hpp>
#include <cstring>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "base/rng.hpp"
#include "config/config.hpp"
#include "kernels/attention_sparse.hpp"
#include "model/model.hpp"
#include "model/sparse_attention.hpp"
#include "train/estimator.hpp"

using namespace zero3d;

namespace {

// Live model memory by label prefix, from Kokkos' allocation callbacks, and the most the panel
// workspace ever held.
struct Allocations {
  std::map<const void*, std::pair<std::string, int64_t>> live;
  int64_t panels_peak = 0;
  int64_t live_bytes(const char* prefix) const {
    int64_t n = 0;
    for (const auto& [ptr, a] : live)
      if (a.first.rfind(prefix, 0) == 0) n += a.second;
    return n;
  }
};
Allocations* g_log = nullptr;

void on_allocate(Kokkos_Profiling_SpaceHandle, const char* label, const void* ptr, uint64_t size) {
  if (!g_log) return;
  g_log->live[ptr] = {label, static_cast<int64_t>(size)};
  g_log->panels_peak = std::max(g_log->panels_peak, g_log->live_bytes("sparse_attention_panels"));
}
void on_deallocate(Kokkos_Profiling_SpaceHandle, const char*, const void* ptr, uint64_t) {
  if (g_log) g_log->live.erase(ptr);
}

// A GPU build (where the device form always runs) counts its device memory with its own hooks
// (kernels/cuda/device.cpp): the tests that set theirs run on the CPU build, through the hook.
constexpr const char* kDeviceBuildHooks = "the GPU build's allocation hooks are its device-memory count";

// Records the allocations of its scope.
struct Recording {
  Allocations log;
  Recording() {
    kernels::gpu::sparse_panel_scratch().release();  // each case grows its own workspace from nothing
    g_log = &log;
    Kokkos::Tools::Experimental::set_allocate_data_callback(on_allocate);
    Kokkos::Tools::Experimental::set_deallocate_data_callback(on_deallocate);
  }
  ~Recording() {
    Kokkos::Tools::Experimental::set_allocate_data_callback(nullptr);
    Kokkos::Tools::Experimental::set_deallocate_data_callback(nullptr);
    g_log = nullptr;
  }
};

SparseAttention fixed_per_head() {
  SparseAttention s;
  s.enabled = true;
  s.block = 8;
  s.num_local_blocks = 3;
  s.different_layout_per_head = true;
  s.num_different_global_patterns = 3;
  return s;
}

SparseAttention bigbird() {
  SparseAttention s = fixed_per_head();
  s.mode = SparsityMode::BigBird;
  s.num_random_blocks = 2;
  return s;
}

constexpr int64_t kB = 2;

// A GPT-2 (C 80, H 4: hs 20; T 64, 8 blocks per row; 2 blocks) trains one step through the form
// the hook picks; the model's and the kernels' sparse-attention allocations, and the plan.
struct Measured {
  int64_t tables = 0, panels = 0;
  SparseAttentionBytes plan;
};
Measured train_step(const SparseAttention& sparse, bool device_form) {
  GPTShape shape{61, 64, 2, 4, 80};
  shape.sparse = sparse;
  Measured out;
  Recording rec;
  kernels::sparse_attention_device_form_on_host() = device_form;
  {
    FlatModel model(shape, kB, shape.n_positions);
    init_gpt_params(model.params.data(), model.model.layout(), shape, 5);
    Rng rng(31, 0);
    std::vector<int32_t> tokens(kB * shape.n_positions + 1);
    for (auto& t : tokens) t = static_cast<int32_t>(rng.below(shape.vocab_size));
    model.zero_grad();
    model.forward(tokens.data(), tokens.data() + 1);
    model.backward(1.0f);
    out.tables = rec.log.live_bytes("sparse_table_");
    out.panels = rec.log.panels_peak;
  }
  out.plan = sparse_attention_model_bytes(shape.sparse, shape.n_head, shape.n_positions, {0, 1}, 0, shape.n_head, kB,
                                          shape.n_embd / shape.n_head, sparse_attention_device_form());
  kernels::sparse_attention_device_form_on_host() = false;
  return out;
}

}  // namespace

TEST(SparseAttentionMemoryPlan, ThePlanIsWhatTheModelAndTheDeviceFormAllocate) {
  if (sparse_attention_device_form()) GTEST_SKIP() << kDeviceBuildHooks;
  for (const auto& [name, sparse] : {std::pair<std::string, SparseAttention>{"fixed", fixed_per_head()}, {"bigbird", bigbird()}}) {
    for (const bool device_form : {true, false}) {
      const std::string tag = name + (device_form ? " device form" : " CPU form");
      const Measured m = train_step(sparse, device_form);
      EXPECT_GT(m.tables, 0) << tag;
      EXPECT_EQ(m.plan.tables, m.tables) << tag;
      EXPECT_EQ(m.plan.panels, m.panels) << tag;
      if (device_form) EXPECT_GT(m.panels, 0) << tag;
      else EXPECT_EQ(m.panels, 0) << tag;
      std::printf("[ sparse   ] %s: index tables %lld bytes, panels %lld bytes, planned = allocated\n", tag.c_str(),
                  static_cast<long long>(m.tables), static_cast<long long>(m.panels));
    }
  }
}

// A tensor rank's heads: the plan slices the layout at the rank's first head, as GPT does.
TEST(SparseAttentionMemoryPlan, ATensorRanksTablesAreItsHeads) {
  if (sparse_attention_device_form()) GTEST_SKIP() << kDeviceBuildHooks;
  const SparseAttention s = bigbird();
  const int64_t H = 4, T = 64, nb = T / s.block;
  for (int64_t head0 : {0, 2}) {
    int64_t allocated = 0;
    {
      Recording rec;
      std::vector<kernels::SparseBlockTable> tables;
      for (int64_t l : {0, 1}) {
        const std::vector<uint8_t> all = sparse_block_layout(s, H, T, l);
        tables.emplace_back(std::vector<uint8_t>(all.begin() + head0 * nb * nb, all.begin() + (head0 + 2) * nb * nb),
                            2, nb, s.block);
      }
      allocated = rec.log.live_bytes("sparse_table_");
      int64_t reported = 0;
      for (const kernels::SparseBlockTable& t : tables) reported += t.model_bytes();
      EXPECT_EQ(reported, allocated);
    }
    EXPECT_EQ(sparse_attention_model_bytes(s, H, T, {0, 1}, head0, 2, kB, 20, false).tables, allocated) << head0;
  }
}

// The memory plan's workspace holds the tables always and the panels when the device form runs.
TEST(SparseAttentionMemoryPlan, TheBudgetCountsThePanelsWhenTheDeviceFormRuns) {
  const nlohmann::json j = {{"train_micro_batch_size_per_gpu", kB},
                            {"gradient_accumulation_steps", 1},
                            {"optimizer", {{"type", "AdamW"}, {"params", {{"lr", 1e-3}}}}},
                            {"model", {{"vocab_size", 61}, {"n_positions", 64}, {"n_layer", 2}, {"n_head", 4}, {"n_embd", 80}}},
                            {"sparse_attention", {{"mode", "bigbird"}, {"block", 8}, {"num_random_blocks", 2},
                                                  {"different_layout_per_head", true}}},
                            {"training", {{"steps", 1}, {"seed", 7}, {"peak_gflops", 50}}}};
  const Config cfg = read_config(j, "sparse.json", 1);
  const GPTShape shape = gpt_shape_of(cfg.model);
  const auto workspace = [&](bool device_form) {
    kernels::sparse_attention_device_form_on_host() = device_form;
    const int64_t w = estimate_budget(cfg, 1, 0).workspace;
    kernels::sparse_attention_device_form_on_host() = false;
    return w;
  };
  const SparseAttentionBytes with_panels =
      sparse_attention_model_bytes(shape.sparse, 4, 64, {0, 1}, 0, 4, kB, 20, /*device_form=*/true);
  EXPECT_GT(with_panels.panels, 0);
#ifdef ZERO3D_DEVICE
  EXPECT_EQ(workspace(false), workspace(true));  // a GPU build always runs the device form
#else
  EXPECT_EQ(workspace(true) - workspace(false), with_panels.panels);
#endif
  // and without sparse attention neither is planned, but the dense kernels' scratch is (none on a
  // CPU build's fp32; a GPU build's split heads and dS)
  nlohmann::json dense = j;
  dense.erase("sparse_attention");
  const Config dense_cfg = read_config(dense, "dense.json", 1);
  const GPTShape dense_shape = gpt_shape_of(dense_cfg.model);
  const int64_t dense_scratch = attention_scratch_bytes(
      dense_shape, gpt_model_part(dense_shape, {0, int(dense_shape.n_layer) + 2}, 1, 0), kB, 64, DType::F32);
  EXPECT_EQ(estimate_budget(cfg, 1, 0).workspace - (estimate_budget(dense_cfg, 1, 0).workspace - dense_scratch),
            sparse_attention_model_bytes(shape.sparse, 4, 64, {0, 1}, 0, 4, kB, 20, sparse_attention_device_form()).tables);
}
