// Activation checkpointing and the memory plan, black-box: every checkpointing setting trains
// the same model to the same losses and gradient norms, bit for bit, in every layout; the
// activation counter follows the formula; a run's predicted peak memory lands within ±10% of
// the measured one; `estimate` answers what fits; settings that cannot work stop at validation.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "io/h5.hpp"
#include "support/cli_helpers.hpp"

using namespace cli;

namespace {

// L = 4 blocks (intervals 1-4 give 4, 2, 2 and 1 checkpoints); 8 samples of 2 per step.
json ckpt_config() {
  return json{{"train_batch_size", 8},
              {"train_micro_batch_size_per_gpu", 2},
              {"optimizer", {{"type", "AdamW"}, {"params", {{"lr", 3e-3}, {"weight_decay", 0.01}}}}},
              {"model", {{"vocab_size", 64}, {"n_positions", 16}, {"n_layer", 4}, {"n_head", 2}, {"n_embd", 32}}},
              {"training", {{"steps", 3}, {"seed", 5}, {"peak_gflops", 50}}},
              {"steps_per_print", 100}};
}

// Loss and gradient norm of every step: the gradient norm is a sum of every gradient's square,
// so a single changed gradient bit shows there.
struct Trajectory {
  std::vector<double> loss, grad_norm;
  bool ok = false;
};

Trajectory train(int np, const std::string& name, const std::string& args) {
  const std::string config = write_config("ckpt.json", ckpt_config());
  const std::string dir = temp_path("ckpt_" + name);
  std::system(("rm -rf " + dir).c_str());
  const Result r = run("train " + config + " --output " + dir + " " + args, np);
  EXPECT_EQ(r.code, 0) << name << "\n" << r.out << r.err;
  Trajectory t;
  for (const json& row : read_metrics(dir)) {
    t.loss.push_back(row.at("loss").get<double>());
    t.grad_norm.push_back(row.at("grad_norm").get<double>());
  }
  t.ok = r.code == 0 && t.loss.size() == 3;
  return t;
}

const std::string kInterval = "--set pipeline.activation_checkpoint_interval=";
const std::string kSelective = "--set activation_checkpointing.recompute_granularity=selective ";
const std::string kPartition = "--set activation_checkpointing.partition_activations=true ";
const std::string kCpu = "--set activation_checkpointing.cpu_checkpointing=true ";
const std::string kContiguous =
    "--set activation_checkpointing.contiguous_memory_optimization=true --set activation_checkpointing.number_checkpoints=4 ";

struct Variant {
  std::string name, args;
};

struct Layout {
  int np;
  std::string name, args;
  std::vector<Variant> variants;
};

class CheckpointingLayout : public ::testing::TestWithParam<Layout> {};

TEST_P(CheckpointingLayout, EveryVariantGivesTheLossesAndGradientNormsBitForBit) {
  const Layout& l = GetParam();
  const Trajectory want = train(l.np, l.name + "_off", l.args);
  ASSERT_TRUE(want.ok);
  for (const Variant& v : l.variants) {
    const Trajectory got = train(l.np, l.name + "_" + v.name, l.args + " " + v.args);
    ASSERT_TRUE(got.ok) << v.name;
    for (size_t i = 0; i < want.loss.size(); ++i) {
      EXPECT_EQ(got.loss[i], want.loss[i]) << l.name << " " << v.name << " step " << i + 1;
      EXPECT_EQ(got.grad_norm[i], want.grad_norm[i]) << l.name << " " << v.name << " step " << i + 1;
    }
  }
}

const std::string kBf16 = "--set bf16.enabled=true ";

INSTANTIATE_TEST_SUITE_P(
    Layouts, CheckpointingLayout,
    ::testing::Values(
        // one rank, fp32: every interval, selective, host memory, contiguous, fenced and profiled
        Layout{1, "np1_z0", "--set zero_optimization.stage=0",
               {{"full1", kInterval + "1"},
                {"full2", kInterval + "2"},
                {"full3", kInterval + "3"},
                {"full4", kInterval + "4"},
                {"selective", kSelective + kInterval + "1"},
                {"cpu", kCpu + kInterval + "2"},
                {"contiguous", kPartition + kContiguous + kInterval + "1"},
                {"fenced_profiled",
                 "--set activation_checkpointing.synchronize_checkpoint_boundary=true "
                 "--set activation_checkpointing.profile=true " + kInterval + "3"}}},
        // two data-parallel ranks at every ZeRO stage, fp32 and bf16
        Layout{2, "np2_z1_bf16", kBf16 + "--set zero_optimization.stage=1",
               {{"full1", kInterval + "1"}, {"selective", kSelective + kInterval + "1"}}},
        Layout{2, "np2_z2", "--set zero_optimization.stage=2 --set zero_optimization.overlap_comm=true",
               {{"full2_cpu", kCpu + kInterval + "2"}}},
        Layout{2, "np2_z3", "--set zero_optimization.stage=3 --set zero_optimization.reduce_bucket_size=700",
               {{"full1_contiguous", kPartition + kContiguous + kInterval + "1"}, {"selective", kSelective + kInterval + "2"}}},
        Layout{2, "np2_z3_bf16", kBf16 + "--set zero_optimization.stage=3", {{"full2", kInterval + "2"}}},
        // two tensor ranks: inputs partitioned over them and all-gathered before recompute
        Layout{2, "np2_t2", "--set tensor_parallel.autotp_size=2",
               {{"full1_partitioned", kPartition + kInterval + "1"},
                {"full2_partitioned_cpu_contiguous", kPartition + kCpu + kContiguous + kInterval + "2"}}},
        // a two-stage pipeline (1F1B: two buffers in flight on stage 0; zero-bubble with selective)
        Layout{2, "np2_p2_z1", "--set pipeline.stages=2 --set zero_optimization.stage=1",
               {{"full1", kInterval + "1"}, {"selective", kSelective + kInterval + "1"}}},
        Layout{2, "np2_p2_zbh1_bf16", kBf16 + "--set pipeline.stages=2 --set pipeline.schedule=zb-h1",
               {{"selective", kSelective + kInterval + "1"}}}),
    [](const ::testing::TestParamInfo<Layout>& info) { return info.param.name; });

// The counter metrics.jsonl reports (memory.activations: every in-flight buffer plus the shared
// workspaces) for one stage of L blocks, B·T tokens (formula of test_activation_checkpointing.cpp):
//   none: 4·(2·BTC + L·block + head + scratch) + 8·BT; selective saves L·BHT² but shares one;
//   full, interval N: 4·(3·BTC + head + ⌈L/N⌉·BTC + scratch + BTC + N·block) + 8·BT.
TEST(CheckpointingCounter, MetricsReportTheFormulaForEachGranularity) {
  const int64_t B = 2, T = 16, C = 32, H = 2, V = 64, L = 4, BT = B * T;
  const int64_t block = 16 * BT * C + 4 * BT + B * H * T * T, head = BT * C + 4 * BT + BT * V,
                scratch = BT * C + 8 * BT * C + 64 * T;
  struct Case {
    std::string name, args;
    int64_t bytes, host = -1;  // host: memory.activations_host (absent without cpu_checkpointing)
  };
  const Case cases[] = {
      {"none", "", 4 * (2 * BT * C + L * block + head + scratch) + 8 * BT},
      {"selective", kSelective + kInterval + "1",
       4 * (2 * BT * C + L * (block - B * H * T * T) + head + scratch + B * H * T * T) + 8 * BT},
      {"full1", kInterval + "1", 4 * (3 * BT * C + head + 4 * BT * C + scratch + BT * C + block) + 8 * BT},
      {"full3", kInterval + "3", 4 * (3 * BT * C + head + 2 * BT * C + scratch + BT * C + 3 * block) + 8 * BT},
      {"full2_cpu", kCpu + kInterval + "2", 4 * (3 * BT * C + head + 2 * BT * C + scratch + BT * C + 2 * block) + 8 * BT,
       4 * 2 * BT * C}};
  for (const Case& c : cases) {
    const std::string dir = temp_path("counter_" + c.name);
    const json last = last_metrics(write_config("ckpt.json", ckpt_config()), 1, dir,
                                   "--set training.steps=1 " + c.args);
    EXPECT_EQ(last["memory"]["activations"].get<int64_t>(), c.bytes) << c.name;
    if (c.host >= 0) EXPECT_EQ(last["memory"]["activations_host"].get<int64_t>(), c.host) << c.name;
    else EXPECT_FALSE(last["memory"].contains("activations_host")) << c.name;
  }
}

// T = 512: the attention probabilities (B·H·T² per block) dominate the process; the plan
// printed at start-up must land within ±10% of the peak resident memory, with and without
// checkpointing, and say so at the end.
TEST(MemoryPlan, PredictedPeakIsWithinTenPercentOfTheMeasuredPeak) {
  json cfg = ckpt_config();
  cfg["train_batch_size"] = 8;
  cfg["train_micro_batch_size_per_gpu"] = 8;
  cfg["model"] = {{"vocab_size", 256}, {"n_positions", 512}, {"n_layer", 2}, {"n_head", 4}, {"n_embd", 64}};
  cfg["training"]["steps"] = 2;
  const std::string config = write_config("plan.json", cfg);
  for (const std::string& args : {std::string(), kInterval + "1", kSelective + kInterval + "1"}) {
    const std::string dir = temp_path("plan");
    std::system(("rm -rf " + dir).c_str());
    const Result r = run("train " + config + " --output " + dir + " " + args, 1);
    ASSERT_EQ(r.code, 0) << r.err;
    const json plan = read_metrics(dir).back().at("memory_plan");
    const double predicted = plan.at("predicted_peak_bytes").get<double>(),
                 measured = plan.at("measured_peak_bytes").get<double>();
    EXPECT_NEAR(predicted / measured, 1.0, 0.10) << args << ": predicted " << predicted / 1e6 << " MB, measured "
                                                 << measured / 1e6 << " MB";
    EXPECT_EQ(count(r.out, "memory plan: predicted peak"), 1u) << r.out;
    EXPECT_EQ(count(r.out, "plan    per rank"), 1u) << r.out;
  }
}

TEST(MemoryPlan, CheckpointingShrinksWhatTheRunHolds) {
  // the same T = 512 model: full recompute keeps one block's activations instead of two
  json cfg = ckpt_config();
  cfg["train_micro_batch_size_per_gpu"] = 8;
  cfg["model"] = {{"vocab_size", 256}, {"n_positions", 512}, {"n_layer", 2}, {"n_head", 4}, {"n_embd", 64}};
  const std::string config = write_config("plan.json", cfg);
  const json off = last_metrics(config, 1, temp_path("shrink_off"), "--set training.steps=1");
  const json full = last_metrics(config, 1, temp_path("shrink_full"), "--set training.steps=1 " + kInterval + "1");
  EXPECT_LT(full["memory"]["activations"].get<double>(), 0.7 * off["memory"]["activations"].get<double>());
  EXPECT_LT(full["memory_plan"]["measured_peak_bytes"].get<double>(),
            off["memory_plan"]["measured_peak_bytes"].get<double>() - 30e6);
}

TEST(Checkpointing, ProfileReportsEveryCheckpointInMetricsAndTheStepLine) {
  const std::string dir = temp_path("profile");
  const Result r = run("train " + write_config("ckpt.json", ckpt_config()) + " --output " + dir + " " + kInterval +
                           "3 --set activation_checkpointing.profile=true --set steps_per_print=1",
                       1);
  ASSERT_EQ(r.code, 0) << r.err;
  const json profile = read_metrics(dir).back().at("activation_checkpointing").at("profile");
  ASSERT_EQ(profile.size(), 2u);  // h.0-2 and h.3
  EXPECT_EQ(profile[0]["blocks"], "h.0-2");
  EXPECT_EQ(profile[1]["blocks"], "h.3");
  for (const json& p : profile) {
    EXPECT_GT(p["forward_ms"].get<double>(), 0.0);
    EXPECT_GT(p["recompute_ms"].get<double>(), 0.0);
  }
  EXPECT_EQ(count(r.out, "checkpoints (ms) | h.0-2: forward"), 3u) << r.out;
  EXPECT_NE(r.out.find("checkpointing full: 3 block(s) per checkpoint"), std::string::npos) << r.out;
}

// Megatron-DeepSpeed's configs set partition_activations and contiguous_memory_optimization and
// checkpoint with --checkpoint-activations (every block, --checkpoint-num-layers 1), passing
// num_checkpoints = num_layers: with the interval absent zero3d does the same, and says so.
TEST(Checkpointing, OptionsWithoutAnIntervalCheckpointEveryBlockAsMegatronDoes) {
  const std::string config = write_config("ckpt.json", ckpt_config());
  const std::string megatron = kPartition + "--set activation_checkpointing.contiguous_memory_optimization=true ";
  Result r = run("validate " + config + " " + megatron);
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("auto    pipeline.activation_checkpoint_interval = 1 (absent, and "
                       "activation_checkpointing.partition_activations acts only on checkpointed blocks"),
            std::string::npos)
      << r.out;
  EXPECT_NE(r.out.find("auto    activation_checkpointing.number_checkpoints = 4 (absent"), std::string::npos) << r.out;
  // an interval given is kept, and the buffer is sized for it (4 blocks in 2 checkpoints)
  r = run("validate " + config + " " + megatron + kInterval + "2");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(r.out.find("auto    pipeline.activation_checkpoint_interval"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("auto    activation_checkpointing.number_checkpoints = 2 ("), std::string::npos) << r.out;
  // two stages: the largest stage's blocks
  r = run("validate " + config + " --world-size 2 --set pipeline.stages=2 " + megatron);
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("auto    activation_checkpointing.number_checkpoints = 2 ("), std::string::npos) << r.out;
  // nothing set: nothing derived
  r = run("validate " + config);
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(r.out.find("activation_checkpoint_interval = "), std::string::npos) << r.out;
  // the diagnostics (profile, synchronize_checkpoint_boundary) time and fence checkpoints: they
  // turn nothing on, so alone they are still an error
  r = run("validate " + config + " --set activation_checkpointing.profile=true");
  expect_one_line_rejection(r, "this diagnostic does not turn checkpointing on");
  // zb-h1 cannot take the implied full recompute: the message says where the interval came from
  r = run("validate " + config + " --world-size 2 --set pipeline.stages=2 --set pipeline.schedule=zb-h1 " + kPartition);
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_NE(r.err.find("(1, implied by activation_checkpointing.partition_activations) full recompute cannot serve"),
            std::string::npos)
      << r.err;

  // The run holds what the explicit settings hold, and its resolved config names them.
  const std::string dir = temp_path("megatron_derived");
  const json derived = last_metrics(config, 1, dir, "--set training.steps=1 " + megatron);
  const json explicit_ = last_metrics(config, 1, temp_path("megatron_explicit"),
                                      "--set training.steps=1 " + kInterval + "1 " + kPartition + kContiguous);
  const json off = last_metrics(config, 1, temp_path("megatron_off"), "--set training.steps=1");
  EXPECT_EQ(derived["memory"]["activations"], explicit_["memory"]["activations"]);
  EXPECT_NE(derived["memory"]["activations"], off["memory"]["activations"]);
  const json resolved = json::parse(slurp(dir + "/config.json"));
  EXPECT_EQ(resolved["pipeline"]["activation_checkpoint_interval"], 1);
  EXPECT_EQ(resolved["activation_checkpointing"]["number_checkpoints"], 4);
  r = run("validate " + dir + "/config.json");
  EXPECT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(r.out.find("auto    pipeline.activation_checkpoint_interval"), std::string::npos) << r.out;
}

TEST(Checkpointing, SettingsThatCannotWorkAreRejectedAtValidation) {
  struct Case {
    std::string args, message;
    int world = 1;
  };
  const Case cases[] = {
      {kInterval + "0 " + kPartition,
       "`activation_checkpointing.partition_activations`: no block is checkpointed: set "
       "`pipeline.activation_checkpoint_interval`"},
      {kInterval + "0 --set activation_checkpointing.profile=true", "`activation_checkpointing.profile`: no block"},
      {kSelective + kPartition, "selective recompute saves no checkpoint inputs"},  // interval 1 derived, then this
      {kInterval + "1 --set activation_checkpointing.contiguous_memory_optimization=true "
                   "--set activation_checkpointing.number_checkpoints=4",
       "it needs partition_activations true"},
      {kInterval + "1 " + kPartition + kContiguous + "--set activation_checkpointing.number_checkpoints=3",
       "value 3 is less than the 4 checkpoints one micro-batch's forward takes"},
      {kInterval + "1 --set activation_checkpointing.number_checkpoints=4", "it needs contiguous_memory_optimization"},
      {kInterval + "1 " + kSelective + kCpu, "selective recompute saves no checkpoint inputs"},
      {kInterval + "1 --set activation_checkpointing.recompute_granularity=some",
       "`activation_checkpointing.recompute_granularity`: value \"some\" is not one of: full, selective"},
      {kInterval + "1 --set pipeline.stages=2 --set pipeline.schedule=zb-h1", "full recompute cannot serve the zb-h1",
       2},
      {kInterval + "1 " + kPartition + "--set tensor_parallel.autotp_size=2 --set tensor_parallel.sequence_parallel=true",
       "already holds only its own tokens", 2},
      {"--set activation_checkpointing.bogus=1", "`activation_checkpointing.bogus`: unknown key"}};
  const std::string config = write_config("ckpt.json", ckpt_config());
  for (const Case& c : cases)
    expect_one_line_rejection(run("validate " + config + " --world-size " + std::to_string(c.world) + " " + c.args),
                              c.message);
}

// estimate --memory-per-rank: the largest micro-batch per ZeRO stage with and without
// checkpointing, in the text, the JSON and the HDF5 report alike.
TEST(EstimateWhatFits, AnswersWithAndWithoutCheckpointingInTextJsonAndReport) {
  json cfg = ckpt_config();
  cfg["model"] = {{"vocab_size", 256}, {"n_positions", 512}, {"n_layer", 4}, {"n_head", 4}, {"n_embd", 64}};
  cfg["train_batch_size"] = 32;
  cfg["train_micro_batch_size_per_gpu"] = 16;
  const std::string config = write_config("fit.json", cfg), report = temp_path("fit.h5");
  const std::string args = "estimate --config " + config + " --world-size 2 --memory-per-rank 300MiB";
  const Result j = run(args + " --json");
  ASSERT_EQ(j.code, 0) << j.err;
  const json doc = json::parse(j.out);
  ASSERT_EQ(doc["fits"].size(), 4u);
  for (const json& f : doc["fits"]) {
    // recomputing frees memory, so more fits with it; micro-batch 16 needs it
    EXPECT_GT(f["with_full_recompute"].get<int64_t>(), f["without_checkpointing"].get<int64_t>());
    EXPECT_GE(f["with_full_recompute"].get<int64_t>(), f["with_selective_recompute"].get<int64_t>());
    EXPECT_GT(f["with_selective_recompute"].get<int64_t>(), f["without_checkpointing"].get<int64_t>());
    EXPECT_LT(f["without_checkpointing"].get<int64_t>(), 16);
    EXPECT_TRUE(f["needs_checkpointing"].get<bool>());
    EXPECT_EQ(f["largest_micro_batch"], f["without_checkpointing"]);  // the config checkpoints nothing
  }
  // stage 3 gathers units: the budget names what is being gathered and prefetched
  EXPECT_GT(doc["budgets"][3]["comm_gather"].get<int64_t>(), 0);
  EXPECT_GT(doc["budgets"][3]["comm_prefetch"].get<int64_t>(), 0);
  EXPECT_TRUE(doc["world_size_given"].get<bool>());
  const Result text = run(args + " --report " + report);
  ASSERT_EQ(text.code, 0) << text.err;
  EXPECT_NE(text.out.find("micro-batch 16 needs checkpointing"), std::string::npos) << text.out;
  zero3d::h5::File f = zero3d::h5::File::open_read(report);
  for (const char* name : {"largest_micro_batch", "without_checkpointing", "with_selective_recompute",
                           "with_full_recompute", "needs_checkpointing", "activations_checkpointed"}) {
    EXPECT_GT(H5Lexists(f.id(), name, H5P_DEFAULT), 0) << name;
  }
  int64_t largest[4] = {};
  zero3d::h5::Handle ds(H5Dopen2(f.id(), "largest_micro_batch", H5P_DEFAULT), H5Dclose);
  ASSERT_GE(H5Dread(ds.get(), H5T_NATIVE_INT64, H5S_ALL, H5S_ALL, H5P_DEFAULT, largest), 0);
  for (int s = 0; s < 4; ++s) EXPECT_EQ(largest[s], doc["fits"][s]["largest_micro_batch"].get<int64_t>()) << s;
  // without --world-size the budget says whom it is for
  const Result one = run("estimate --config " + config);
  EXPECT_NE(one.out.find("--world-size not given: the budget is for 1 rank(s)"), std::string::npos) << one.out;
}

}  // namespace
