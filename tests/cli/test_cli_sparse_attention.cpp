// Sparse attention, black-box: a run with DeepSpeed's `sparse_attention` section trains, every
// parallel layout of the same global batch gives the single-rank losses (the layout is built the
// same on every rank, with each tensor rank computing its own heads' layouts), a pattern that
// leaves out blocks trains differently from dense attention, a dense layout trains as dense
// attention does, and the start-up line says what is computed.
#include <gtest/gtest.h>

#include <cstdlib>
#include <map>
#include <ostream>
#include <string>
#include <vector>

#include "support/cli_helpers.hpp"

using namespace cli;

namespace {

// T = 32 in blocks of 4: 8 blocks per row. Per-head fixed layouts with three global patterns over
// four heads (so the two tensor ranks' heads have different layouts) and a short last window,
// and per-head random blocks (variable) in another variant.
json sparse_config() {
  return json{{"train_batch_size", 8},
              {"train_micro_batch_size_per_gpu", 2},
              {"optimizer", {{"type", "AdamW"}, {"params", {{"lr", 3e-3}, {"weight_decay", 0.01}}}}},
              {"model", {{"vocab_size", 61}, {"n_positions", 32}, {"n_layer", 2}, {"n_head", 4}, {"n_embd", 32}}},
              {"sparse_attention",
               {{"mode", "fixed"},
                {"block", 4},
                {"different_layout_per_head", true},
                {"num_local_blocks", 3},
                {"num_different_global_patterns", 3}}},
              {"training", {{"steps", 8}, {"seed", 5}, {"peak_gflops", 50}}},
              {"steps_per_print", 100}};
}

Result train(int np, const std::string& name, const std::string& args, const json& config = sparse_config()) {
  const std::string path = write_config("sparse_" + name + ".json", config);
  const std::string dir = temp_path("sparse_" + name);
  std::system(("rm -rf " + dir).c_str());
  Result r = run("train " + path + " --output " + dir + " " + args, np);
  EXPECT_EQ(r.code, 0) << r.out << r.err;
  r.out += "\n@dir " + dir;
  return r;
}

std::vector<double> losses(const Result& r) {
  return losses_of(read_metrics(r.out.substr(r.out.rfind("@dir ") + 5)));
}

// Random blocks: two per row and head, drawn from zero3d's stream on every rank alike.
const std::string kVariable =
    "--set 'sparse_attention={\"mode\": \"variable\", \"block\": 4, \"num_random_blocks\": 2, "
    "\"different_layout_per_head\": true, "
    "\"local_window_blocks\": [2], \"global_block_indices\": [1], \"attention\": \"unidirectional\"}'";

// Two experts (top-1) in every block: the reference holds both on one rank.
const std::string kMoe = "--set 'model.moe={\"num_experts\": 2}'";

}  // namespace

TEST(SparseAttention, TheStartUpLineSaysWhatIsComputed) {
  const Result r = train(1, "startup", "");
  EXPECT_NE(r.out.find("sparse  fixed, block 4 (8x8 blocks per head), a layout per head | "), std::string::npos)
      << r.out;
  EXPECT_NE(r.out.find("of the causal blocks computed; the model is causal"), std::string::npos) << r.out;
}

namespace {
struct SparseRun {
  int np;
  std::string args, variant, name;
};
void PrintTo(const SparseRun& r, std::ostream* os) { *os << r.name; }
}  // namespace

class SparseLayout : public ::testing::TestWithParam<SparseRun> {};

TEST_P(SparseLayout, GivesTheLossesOfOneRank) {
  const SparseRun& l = GetParam();
  static std::map<std::string, std::vector<double>> reference;
  if (!reference.count(l.variant)) reference[l.variant] = losses(train(1, "ref" + std::to_string(reference.size()), l.variant));
  expect_losses_close(losses(train(l.np, l.name, l.args + " " + l.variant)), reference[l.variant], 1e-5, l.name);
}

INSTANTIATE_TEST_SUITE_P(
    ParallelLayouts, SparseLayout,
    ::testing::Values(SparseRun{2, "--set zero_optimization.stage=2", "", "np2_data_z2"},
                      SparseRun{2, "--set tensor_parallel.autotp_size=2", "", "np2_tensor"},
                      SparseRun{2, "--set pipeline.stages=2", "", "np2_pipe"},
                      SparseRun{2, "--set tensor_parallel.autotp_size=2", kVariable, "np2_tensor_variable_random"},
                      SparseRun{2, "--set zero_optimization.stage=3", kVariable, "np2_data_z3_variable_random"},
                      SparseRun{2, "--set model.moe.ep_size=2", kMoe, "np2_moe_ep2"}),
    [](const auto& info) { return info.param.name; });

TEST(SparseAttention, LeavingOutBlocksChangesTrainingAndADenseLayoutDoesNot) {
  json dense_attention = sparse_config();
  dense_attention.erase("sparse_attention");
  const std::vector<double> plain = losses(train(1, "plain", "", dense_attention));
  const std::vector<double> sparse = losses(train(1, "fixed", ""));
  json dense_layout = sparse_config();
  dense_layout["sparse_attention"] = {{"mode", "dense"}, {"block", 4}};
  const std::vector<double> dense = losses(train(1, "dense", "", dense_layout));
  expect_losses_close(dense, plain, 1e-5, "dense layout");
  ASSERT_EQ(sparse.size(), plain.size());
  EXPECT_GT(std::fabs(sparse.back() - plain.back()), 1e-4);  // the layout left blocks out
}

TEST(SparseAttention, Bf16AndSelectiveRecomputeRunTheSparseKernels) {
  const std::vector<double> fp32 = losses(train(1, "fp32", ""));
  // selective recompute recomputes the probabilities with the same sparse kernel
  const std::vector<double> selective = losses(train(
      1, "selective",
      "--set pipeline.activation_checkpoint_interval=1 --set activation_checkpointing.recompute_granularity=selective"));
  expect_losses_close(selective, fp32, 1e-6, "selective recompute");
  const std::vector<double> bf16 = losses(train(1, "bf16", "--set bf16.enabled=true"));
  expect_losses_close(bf16, fp32, 3e-2, "bf16");
}

TEST(SparseAttention, ASequenceNotInWholeBlocksIsRejectedAtValidation) {
  json j = sparse_config();
  j["model"]["n_positions"] = 30;
  const Result r = run("validate " + write_config("sparse_ragged.json", j));
  expect_one_line_rejection(r, "`sparse_attention.block`");
  EXPECT_NE(r.err.find("30"), std::string::npos) << r.err;
}
