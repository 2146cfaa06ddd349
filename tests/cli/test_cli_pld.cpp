// Progressive layer drop (DeepSpeed's `progressive_layer_drop`), black-box: θ̄ = 1 changes
// nothing in any bit; the drop decisions are the same on every rank, so data, pipeline and
// tensor layouts give the one-rank losses with blocks dropped; a resumed run drops as the
// uninterrupted one did; evaluation runs every block; metrics.jsonl shows the schedule.
#include <gtest/gtest.h>
#include <hdf5.h>

#include <cmath>
#include <map>
#include <string>
#include <vector>

#include "support/cli_helpers.hpp"

using namespace cli;

namespace {

// L=4 (three blocks that can drop), θ̄ 0 and γ 0.5: θ falls from 1 to ~0.1 within the run, so
// most steps drop some block and scale the others. Two micro-batches per step at every layout:
// the decisions are per micro-batch slot (pld.hpp), the same on every data rank.
json pld_config() {
  return json{{"train_batch_size", 16},
              {"train_micro_batch_size_per_gpu", 8},
              {"gradient_accumulation_steps", 2},
              {"gradient_clipping", 1.0},
              {"optimizer", {{"type", "AdamW"}, {"params", {{"lr", 3e-3}}}}},
              {"model", {{"vocab_size", 64}, {"n_positions", 16}, {"n_layer", 4}, {"n_head", 2}, {"n_embd", 32}}},
              {"training", {{"steps", 8}, {"seed", 5}, {"peak_gflops", 50}}},
              {"progressive_layer_drop", {{"enabled", true}, {"theta", 0.0}, {"gamma", 0.5}}},
              {"steps_per_print", 100}};
}

struct TrainRun {
  int code;
  std::string out;
  std::vector<json> rows;
};

TrainRun train(int np, const std::string& name, const json& config, const std::string& args = "") {
  const std::string path = write_config("pld_" + name + ".json", config);
  const std::string dir = temp_path("pld_" + name);
  std::system(("rm -rf " + dir).c_str());
  const Result r = run("train " + path + " --output " + dir + " " + args, np);
  return {r.code, r.out + r.err, read_metrics(dir)};
}

// The one-rank run with `args` (cached per args).
const TrainRun& one_rank(const std::string& args = "") {
  static std::map<std::string, TrainRun> cache;
  auto it = cache.find(args);
  if (it == cache.end())
    it = cache.emplace(args, train(1, "ref" + std::to_string(cache.size()), pld_config(), args)).first;
  return it->second;
}

TEST(ProgressiveLayerDrop, ThetaBarOneGivesTheLossesOfNoLayerDropInEveryBit) {
  json on = pld_config();
  on["progressive_layer_drop"]["theta"] = 1.0;
  json off = pld_config();
  off.erase("progressive_layer_drop");
  const TrainRun a = train(1, "theta1", on), b = train(1, "off", off);
  ASSERT_EQ(a.code, 0) << a.out;
  ASSERT_EQ(b.code, 0) << b.out;
  ASSERT_EQ(a.rows.size(), 8u);
  for (size_t i = 0; i < a.rows.size(); ++i) {
    EXPECT_EQ(a.rows[i].at("loss").get<double>(), b.rows[i].at("loss").get<double>()) << "step " << i + 1;
    EXPECT_EQ(a.rows[i].at("pld").at("blocks_run"), 8) << "step " << i + 1;
  }
}

TEST(ProgressiveLayerDrop, DropsBlocksAndReportsTheScheduleInMetrics) {
  const TrainRun& r = one_rank();
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("pld     progressive layer drop: theta(t) = (1 - 0)"), std::string::npos) << r.out;
  ASSERT_EQ(r.rows.size(), 8u);
  int64_t run = 0, blocks = 0;
  for (size_t i = 0; i < r.rows.size(); ++i) {
    const json& p = r.rows[i].at("pld");
    // step i + 1 runs with DeepSpeed's θ after step i: 1 for the first, then exp(−0.5·(i − 1)) (θ̄ = 0)
    const double theta = i == 0 ? 1.0 : std::exp(-0.5 * static_cast<double>(i - 1));
    EXPECT_NEAR(p.at("theta").get<double>(), theta, 1e-15) << "step " << i + 1;
    ASSERT_EQ(p.at("keep_prob").size(), 4u);
    for (int l = 0; l < 4; ++l)
      EXPECT_NEAR(p.at("keep_prob")[l].get<double>(), 1.0 - l * (1.0 - theta) / 4.0, 1e-15) << "step " << i + 1;
    EXPECT_EQ(p.at("blocks"), 8);
    run += p.at("blocks_run").get<int64_t>();
    blocks += p.at("blocks").get<int64_t>();
  }
  EXPECT_LT(run, blocks);      // some blocks were dropped
  EXPECT_GT(run, blocks / 2);  // and the first block of every micro-batch ran
}

// MFU counts the FLOPs done: 6N + 12·L·T·C with N's transformer blocks (and the attention term)
// scaled by the share of blocks run. V=64, T=16, L=4, C=32: outside the blocks wte + wpe + ln_f
// = 2048 + 512 + 64 parameters; each block 12·C² + 13·C = 12,704, plus 12·T·C = 6,144 attention.
TEST(ProgressiveLayerDrop, MfuCountsOnlyTheBlocksRun) {
  const TrainRun& r = one_rank();
  ASSERT_EQ(r.code, 0) << r.out;
  const double outside = 6.0 * (2048 + 512 + 64), blocks = 4 * (6.0 * 12704 + 6144);
  bool some_dropped = false;
  for (const json& row : r.rows) {
    const json& p = row.at("pld");
    const double share = p.at("blocks_run").get<double>() / p.at("blocks").get<double>();
    some_dropped = some_dropped || share < 1.0;
    const double flops = row.at("mfu").get<double>() * 50e9 / row.at("tokens_per_s").get<double>();
    EXPECT_NEAR(flops, outside + blocks * share, 1e-6 * (outside + blocks)) << "step " << row.at("step");
  }
  EXPECT_TRUE(some_dropped);
}

// ZeRO-3 with nothing kept gathered between uses: each block is all-gathered for its forward
// and again for its backward, unless dropped. Per dropped block and micro-batch the data axis
// moves two gathers of its 12·C² + 13·C = 12,704 fp32 parameters less ((np−1)/np of 50,816
// bytes each at np 2); its gradient's reduce-scatter still runs, with zeros, on every rank.
TEST(ProgressiveLayerDrop, AtZeroStage3ADroppedBlockIsNeverGathered) {
  const std::string z3 =
      "--set train_micro_batch_size_per_gpu=4 --set zero_optimization.stage=3 "
      "--set zero_optimization.stage3_param_persistence_threshold=0 "
      "--set zero_optimization.stage3_max_reuse_distance=0 --set zero_optimization.stage3_prefetch_bucket_size=0";
  const TrainRun pld = train(2, "z3_gathers", pld_config(), z3);
  const TrainRun all = train(2, "z3_gathers_all", pld_config(), z3 + " --set progressive_layer_drop.theta=1.0");
  ASSERT_EQ(pld.code, 0) << pld.out;
  ASSERT_EQ(all.code, 0) << all.out;
  ASSERT_EQ(pld.rows.size(), all.rows.size());
  int64_t dropped_total = 0;
  for (size_t i = 0; i < pld.rows.size(); ++i) {
    const int64_t dropped =
        pld.rows[i].at("pld").at("blocks").get<int64_t>() - pld.rows[i].at("pld").at("blocks_run").get<int64_t>();
    const int64_t saved = all.rows[i].at("comm_bytes_by_axis").at("data").get<int64_t>() -
                          pld.rows[i].at("comm_bytes_by_axis").at("data").get<int64_t>();
    EXPECT_EQ(saved, dropped * 2 * 12704 * 4 / 2) << "step " << i + 1;
    dropped_total += dropped;
  }
  EXPECT_GT(dropped_total, 0);
}

// bf16 products round differently, but the kept blocks' 1/p scaling and the dropped blocks are
// the same on the bf16 path: the losses stay within bf16 rounding of fp32's (dropping blocks
// moves them by ~1e-2 here).
TEST(ProgressiveLayerDrop, Bf16FollowsFp32WithinBf16Rounding) {
  json c = pld_config();
  c["bf16"] = {{"enabled", true}};
  const TrainRun r = train(1, "bf16", c);
  ASSERT_EQ(r.code, 0) << r.out;
  ASSERT_EQ(one_rank().code, 0) << one_rank().out;
  expect_losses_close(losses_of(r.rows), losses_of(one_rank().rows), 1e-3, "bf16");
}

struct Layout {
  int np;
  std::string args, name, ref;  // ref: the one-rank run's arguments
};
class PldLayout : public ::testing::TestWithParam<Layout> {};
const std::string kMoe =
    "--set model.moe.num_experts=4 --set model.moe.k=2 --set model.moe.drop_tokens=false "
    "--set model.moe.aux_loss_coef=0 --set model.moe.top2_2nd_expert_sampling=false";

// Every rank draws the same decisions (seed, step, micro-batch slot, block): at np 2 the data
// ranks' micro-batches of 4 are the one rank's micro-batches of 8, split.
TEST_P(PldLayout, GivesTheLossesOfOneRankWithBlocksDropped) {
  const Layout& l = GetParam();
  std::string args = l.args;  // {dir}: a folder of this test's own (swap files)
  for (size_t at; (at = args.find("{dir}")) != std::string::npos;) args.replace(at, 5, temp_path("swap_" + l.name));
  const TrainRun r = train(l.np, l.name, pld_config(), l.ref + " " + args);
  ASSERT_EQ(r.code, 0) << r.out;
  const TrainRun& ref = one_rank(l.ref);
  ASSERT_EQ(ref.code, 0) << ref.out;
  expect_losses_close(losses_of(r.rows), losses_of(ref.rows), 1e-5, l.name);
}

INSTANTIATE_TEST_SUITE_P(
    PipeDataTensor, PldLayout,
    ::testing::Values(
        Layout{2, "--set train_micro_batch_size_per_gpu=4", "d2_z0", ""},
        Layout{2, "--set train_micro_batch_size_per_gpu=4 --set zero_optimization.stage=3", "d2_z3", ""},
        Layout{2, "--set pipeline.stages=2", "p2", ""},
        Layout{2, "--set pipeline.stages=2 --set pipeline.schedule=zb-h1", "p2_zbh1", ""},
        Layout{2, "--set tensor_parallel.autotp_size=2", "t2", ""},
        Layout{2, "--set tensor_parallel.autotp_size=2 --set tensor_parallel.sequence_parallel=true", "t2_sp", ""},
        Layout{2, "--set pipeline.stages=2 --set pipeline.schedule=interleaved --set pipeline.virtual_stages=2",
               "p2_interleaved", ""},
        // ZeRO-Infinity: parameters read from swap files ahead of use skip the dropped blocks
        Layout{2,
               "--set train_micro_batch_size_per_gpu=4 --set zero_optimization.stage=3 "
               "--set zero_optimization.offload_param.device=nvme "
               "--set zero_optimization.offload_param.nvme_path={dir} "
               "--set zero_optimization.offload_optimizer.device=nvme "
               "--set zero_optimization.offload_optimizer.nvme_path={dir}",
               "d2_z3_nvme", ""},
        Layout{1, "--set pipeline.activation_checkpoint_interval=2", "full_recompute", ""},
        // MoE blocks dropped alike on every rank of the expert group (no all-to-all for
        // them); without capacity drops, l_aux and the second expert's Gumbel noise the
        // routing is the same per token at any micro-batch split, so ep 2 over two data
        // ranks gives one rank's losses
        Layout{2, "--set pipeline.stages=2", "moe_p2", kMoe},
        Layout{2, "--set tensor_parallel.autotp_size=2", "moe_t2", kMoe},
        Layout{2, "--set train_micro_batch_size_per_gpu=4 --set model.moe.ep_size=2", "moe_d2_ep2", kMoe}),
    [](const ::testing::TestParamInfo<Layout>& info) { return info.param.name; });

// θ is a function of the step and the decisions of (seed, step, micro-batch, block): resuming
// at step 4 continues the uninterrupted run's losses in every bit.
TEST(ProgressiveLayerDrop, ResumedRunDropsAsTheUninterruptedOne) {
  json c = pld_config();
  c["training"]["save_interval"] = 4;
  const TrainRun full = train(1, "full", c);
  ASSERT_EQ(full.code, 0) << full.out;
  const TrainRun resumed =
      train(1, "resumed", c, "--set training.resume=" + temp_path("pld_full") + "/checkpoints/global_step4");
  ASSERT_EQ(resumed.code, 0) << resumed.out;
  ASSERT_EQ(full.rows.size(), 8u);
  ASSERT_EQ(resumed.rows.size(), 4u);
  for (size_t i = 0; i < 4; ++i) {
    EXPECT_EQ(resumed.rows[i].at("loss").get<double>(), full.rows[4 + i].at("loss").get<double>()) << "step " << 5 + i;
    EXPECT_EQ(resumed.rows[i].at("pld"), full.rows[4 + i].at("pld")) << "step " << 5 + i;
  }
}

// lr 0 keeps the golden evaluation model (tests/golden/gpt_eval.h5); with θ falling to 0 at
// once, training drops blocks, yet every evaluation gives the golden loss: it runs every block.
TEST(ProgressiveLayerDrop, EvaluationRunsEveryBlock) {
  const std::string golden = kSource + "/tests/golden";
  json c = {{"train_batch_size", 8},
            {"train_micro_batch_size_per_gpu", 4},
            {"optimizer", {{"type", "AdamW"}, {"params", {{"lr", 0.0}}}}},
            {"model", tiny_model(golden + "/gpt_eval.h5")},
            {"data",
             {{"source", "synthetic"}, {"validation", {{"source", "tokens"}, {"path", golden + "/gpt_eval_val.bin"}}}}},
            {"training", {{"steps", 6}, {"seed", 7}, {"peak_gflops", 50}, {"eval_interval", 1}, {"eval_steps", 4}}},
            {"progressive_layer_drop", {{"enabled", true}, {"theta", 0.0}, {"gamma", 1e9}}},
            {"steps_per_print", 100}};
  const TrainRun r = train(1, "eval", c);
  ASSERT_EQ(r.code, 0) << r.out;
  ASSERT_EQ(r.rows.size(), 6u);
  int64_t run = 0;
  for (const json& row : r.rows) run += row.at("pld").at("blocks_run").get<int64_t>();
  EXPECT_LT(run, 6 * 2 * 2);  // training dropped blocks
  for (const json& row : r.rows) EXPECT_EQ(row.at("eval_loss"), r.rows.front().at("eval_loss"));
  // the first step trains with θ = 1 (every block): its evaluation matches the others as well
  double golden_loss = 0.0;
  {
    const hid_t f = H5Fopen((golden + "/gpt_eval.h5").c_str(), H5F_ACC_RDONLY, H5P_DEFAULT);
    const hid_t ds = H5Dopen2(f, "golden/eval_loss", H5P_DEFAULT);
    H5Dread(ds, H5T_NATIVE_DOUBLE, H5S_ALL, H5S_ALL, H5P_DEFAULT, &golden_loss);
    H5Dclose(ds);
    H5Fclose(f);
  }
  EXPECT_NEAR(r.rows.back().at("eval_loss").get<double>(), golden_loss, 2e-6 * golden_loss);
}

TEST(ProgressiveLayerDrop, ThetaOutsideZeroOneAndNegativeGammaStopAtValidation) {
  json c = pld_config();
  c["progressive_layer_drop"]["theta"] = 1.5;
  expect_one_line_rejection(run("validate " + write_config("pld_bad.json", c)), "`progressive_layer_drop.theta`");
  c = pld_config();
  c["progressive_layer_drop"]["gamma"] = -0.1;
  expect_one_line_rejection(run("validate " + write_config("pld_bad.json", c)), "`progressive_layer_drop.gamma`");
}

}  // namespace
