// Pipeline parallelism, black-box: every layout of the same global batch trains the same model
// to the same losses as one rank, checkpoints stay one logical model across pipeline sizes, and
// misconfigurations stop at validation with the numbers.
#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <string>
#include <vector>

#include "support/cli_helpers.hpp"

using namespace cli;

namespace {

// V=61 (no even split anywhere), L=6: 8 pipeline layers [embedding, h.0..h.5, final], which
// "parameters" splits unevenly (the embedding and final layers carry wte). Clipping at 0.05 is
// active on every step; 16 samples of 2 = 8 micro-batches on one data-parallel rank.
json pipe_config() {
  return json{{"train_batch_size", 16},
              {"train_micro_batch_size_per_gpu", 2},
              {"gradient_clipping", 0.05},
              {"optimizer", {{"type", "AdamW"}, {"params", {{"lr", 3e-3}, {"weight_decay", 0.01}}}}},
              {"model", {{"vocab_size", 61}, {"n_positions", 16}, {"n_layer", 6}, {"n_head", 2}, {"n_embd", 32}}},
              {"training", {{"steps", 10}, {"seed", 11}, {"peak_gflops", 50}}},
              {"steps_per_print", 100}};
}

std::vector<double> losses_of(const std::string& dir) { return cli::losses_of(read_metrics(dir)); }

std::vector<double> train_losses(int np, const std::string& name, const std::string& args) {
  const std::string config = write_config("pipe.json", pipe_config());
  const std::string dir = temp_path("pipe_" + name);
  std::system(("rm -rf " + dir).c_str());
  const Result r = run("train " + config + " --output " + dir + " " + args, np);
  EXPECT_EQ(r.code, 0) << r.out << r.err;
  return losses_of(dir);
}

// One reference per precision setting, trained once on one rank.
const std::vector<double>& reference(const std::string& precision) {
  static std::map<std::string, std::vector<double>> cache;
  auto it = cache.find(precision);
  if (it == cache.end()) it = cache.emplace(precision, train_losses(1, "ref", precision)).first;
  return it->second;
}

struct Layout {
  int np, stages;
  std::string schedule;
  int virtual_stages, zero_stage;
  std::string name;
};

class PipelineLayout : public ::testing::TestWithParam<Layout> {};

TEST_P(PipelineLayout, GivesTheLossesOfOneRankOverTenSteps) {
  const Layout& l = GetParam();
  const std::string args = "--set pipeline.stages=" + std::to_string(l.stages) + " --set pipeline.schedule=" +
                           l.schedule + " --set pipeline.virtual_stages=" + std::to_string(l.virtual_stages) +
                           " --set zero_optimization.stage=" + std::to_string(l.zero_stage) +
                           " --set zero_optimization.reduce_bucket_size=700 --set zero_optimization.overlap_comm=true";
  const std::vector<double>& want = reference("--set zero_optimization.stage=0");
  expect_losses_close(train_losses(l.np, l.name, args), want, 1e-5, l.name);
}

INSTANTIATE_TEST_SUITE_P(
    EverySchedule, PipelineLayout,
    ::testing::Values(Layout{2, 2, "1f1b", 1, 0, "np2_p2_1f1b_z0"}, Layout{2, 2, "1f1b", 1, 1, "np2_p2_1f1b_z1"},
                      Layout{2, 2, "1f1b", 1, 2, "np2_p2_1f1b_z2"}, Layout{2, 2, "1f1b", 1, 3, "np2_p2_1f1b_z3"},
                      Layout{2, 2, "zb-h1", 1, 0, "np2_p2_zbh1_z0"}, Layout{2, 2, "zb-h1", 1, 2, "np2_p2_zbh1_z2"},
                      Layout{2, 2, "interleaved", 2, 1, "np2_p2_int2_z1"},
                      Layout{2, 2, "interleaved", 3, 3, "np2_p2_int3_z3"},
                      Layout{3, 3, "1f1b", 1, 0, "np3_p3_1f1b_z0"},  // 8 layers over 3 stages: uneven
                      Layout{4, 4, "1f1b", 1, 1, "np4_p4_1f1b_z1"}, Layout{4, 4, "zb-h1", 1, 3, "np4_p4_zbh1_z3"},
                      Layout{4, 4, "interleaved", 2, 0, "np4_p4_int2_z0"},
                      Layout{4, 2, "1f1b", 1, 2, "np4_p2dp2_1f1b_z2"}, Layout{4, 2, "zb-h1", 1, 1, "np4_p2dp2_zbh1_z1"},
                      Layout{4, 2, "interleaved", 2, 3, "np4_p2dp2_int2_z3"}),
    [](const ::testing::TestParamInfo<Layout>& info) { return info.param.name; });

// bf16 with fp32 gradient accumulation computes exactly what one rank does. With 16-bit
// gradients the two halves of the tied wte gradient (embedding on the first stage, LM head on
// the last) are each rounded to bf16 before they are summed, where one rank rounds their sum
// once: over ten steps that moves the loss by ~1e-4 relative (bf16 keeps 8 bits), bounded at 5e-4.
TEST(PipelineBf16, Fp32AccumulationGivesTheLossesOfOneRank) {
  const std::string bf16 = "--set bf16.enabled=true --set data_types.grad_accum_dtype=fp32";
  expect_losses_close(train_losses(2, "bf16_p2_z0", bf16 + " --set pipeline.stages=2"), reference(bf16), 1e-5, "np2 p2 z0");
  // stages 1-3 reduce in the communication dtype (bf16 by default) even on one data-parallel
  // rank, which would round each half of the tied gradient again
  const std::string z1 = bf16 + " --set zero_optimization.stage=1 --set communication_data_type=fp32";
  const std::vector<double> one_f_one_b = train_losses(4, "bf16_p4_z1", z1 + " --set pipeline.stages=4");
  expect_losses_close(one_f_one_b, reference(z1), 1e-5, "np4 p4 z1");
  // ZB-H1 splits each backward into its input (B) and weight (W) passes: B keeps GELU's gradient
  // in fp32, W rounds it and sums c_fc's bias gradient, with the values and in the order the
  // whole backward rounds and sums them in one pass (tests/kernels/test_split_backward.cpp), so
  // its losses are 1F1B's, bit for bit.
  const std::vector<double> zero_bubble =
      train_losses(4, "bf16_p4_zb_z1", z1 + " --set pipeline.stages=4 --set pipeline.schedule=zb-h1");
  ASSERT_EQ(zero_bubble.size(), one_f_one_b.size());
  for (size_t i = 0; i < zero_bubble.size(); ++i) EXPECT_EQ(zero_bubble[i], one_f_one_b[i]) << "zb-h1 step " << i + 1;
}

TEST(PipelineBf16, SixteenBitGradientsStayWithinTheTiedRoundingOfOneRank) {
  const std::string bf16 = "--set bf16.enabled=true";
  for (int z : {0, 2, 3})
    expect_losses_close(train_losses(2, "bf16_16_z" + std::to_string(z),
                              bf16 + " --set pipeline.stages=2 --set zero_optimization.stage=" + std::to_string(z)),
                 reference(bf16 + " --set zero_optimization.stage=" + std::to_string(z)), 5e-4,
                 "bf16 stage " + std::to_string(z));
}

TEST(Pipeline, ResumesAtAnotherPipelineAndDataParallelSizeWithinOneInAMillion) {
  const std::string config = write_config("pipe.json", pipe_config());
  const std::string saved = temp_path("pipe_saved");
  std::system(("rm -rf " + saved).c_str());
  Result r = run("train " + config + " --output " + saved +
                     " --set pipeline.stages=2 --set zero_optimization.stage=1 --set training.save_interval=5",
                 2);
  ASSERT_EQ(r.code, 0) << r.err;
  const std::vector<double> whole = losses_of(saved);
  ASSERT_EQ(whole.size(), 10u);
  const std::vector<double> tail(whole.begin() + 5, whole.end());
  const std::string tag = saved + "/checkpoints/global_step5";
  for (const auto& [np, args] : std::vector<std::pair<int, std::string>>{
           {1, "--set zero_optimization.stage=0"},
           {4, "--set pipeline.stages=4 --set zero_optimization.stage=3 --set pipeline.schedule=zb-h1"},
           {4, "--set pipeline.stages=2 --set zero_optimization.stage=2"}}) {
    const std::string dir = temp_path("pipe_resumed");
    std::system(("rm -rf " + dir).c_str());
    r = run("train " + config + " --output " + dir + " --set training.resume=" + tag + " " + args, np);
    ASSERT_EQ(r.code, 0) << r.err;
    expect_losses_close(losses_of(dir), tail, 1e-6, "resumed at np " + std::to_string(np) + " " + args);
  }
  // One logical model: inspect sees the tied wte once, whole.
  r = run("inspect " + saved + "/checkpoints --tag global_step10 --tensor wte.weight --json");
  ASSERT_EQ(r.code, 0) << r.err;
  const json report = json::parse(r.out);
  ASSERT_EQ(report.at("tensors").size(), 1u);
  EXPECT_EQ(report.at("tensors")[0].at("shape"), json::array({61, 32}));
}

TEST(Pipeline, StartupListsEachStagesLayersAndParameters) {
  const std::string config = write_config("pipe.json", pipe_config());
  const std::string dir = temp_path("pipe_startup");
  std::system(("rm -rf " + dir).c_str());
  const Result r = run("train " + config + " --output " + dir + " --set training.steps=1 --set pipeline.stages=2", 2);
  ASSERT_EQ(r.code, 0) << r.err;
  // [embedding 61·32+16·32 = 2464, 6 blocks of 12,704, final 61·32+64 = 2016]: DeepSpeed's
  // partition_balanced puts the embedding and three blocks on stage 0.
  EXPECT_NE(r.out.find("stage 0: embedding..h.2 | 40576 parameters"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("stage 1: h.3..final | 40128 parameters (incl. the tied wte copy)"), std::string::npos)
      << r.out;
  EXPECT_EQ(count(r.out, "stage 0:"), 1u) << "printed by one rank";
}

TEST(Pipeline, MetricsReportTheScheduleAndItsBubbleNextToTheMeasuredOne) {
  const std::string config = write_config("pipe.json", pipe_config());
  const std::string dir = temp_path("pipe_metrics");
  std::system(("rm -rf " + dir).c_str());
  const Result r = run("train " + config + " --output " + dir + " --set training.steps=2 --set pipeline.stages=2", 2);
  ASSERT_EQ(r.code, 0) << r.err;
  const json p = read_metrics(dir).back().at("pipeline");
  EXPECT_EQ(p.at("stages"), 2);
  EXPECT_EQ(p.at("schedule"), "1f1b");
  EXPECT_NEAR(p.at("bubble_fraction").at("formula").get<double>(), 1.0 / 9.0, 1e-12);  // (p-1)/(m+p-1), m = 8
  ASSERT_EQ(p.at("bubble_fraction").at("measured").size(), 2u);
  for (const json& f : p.at("bubble_fraction").at("measured")) {
    EXPECT_GE(f.get<double>(), 0.0);
    EXPECT_LT(f.get<double>(), 1.0);
  }
}

struct Misconfig {
  std::string name, args, message;
};
class PipelineMisconfig : public ::testing::TestWithParam<Misconfig> {};

TEST_P(PipelineMisconfig, ExitsTwoWithOneMessageHoldingTheNumbers) {
  const std::string config = write_config("pipe.json", pipe_config());
  expect_one_line_rejection(run("validate " + config + " " + GetParam().args), GetParam().message);
}

INSTANTIATE_TEST_SUITE_P(
    Validation, PipelineMisconfig,
    ::testing::Values(
        Misconfig{"StagesNotDividingTheWorld", "--world-size 3 --set pipeline.stages=2",
                  "pipeline.stages (2) does not divide the number of ranks (3)"},
        Misconfig{"MoreStagesThanLayers", "--world-size 9 --set pipeline.stages=9 --set train_batch_size=18",
                  "pipeline.stages (9) exceeds the model's 8 pipeline layers"},
        Misconfig{"VirtualStagesBeyondTheLayers",
                  "--world-size 4 --set pipeline.stages=4 --set pipeline.schedule=interleaved "
                  "--set pipeline.virtual_stages=3 --set train_batch_size=16",
                  "pipeline.stages (4) x pipeline.virtual_stages (3) = 12 parts exceeds the model's 8 pipeline layers"},
        Misconfig{"VirtualStagesWithoutInterleaving", "--world-size 2 --set pipeline.stages=2 --set pipeline.virtual_stages=2",
                  "virtual_stages 2 needs \"schedule\": \"interleaved\""},
        Misconfig{"InterleavedMicroBatchesNotAMultipleOfStages",
                  "--world-size 4 --set pipeline.stages=4 --set pipeline.schedule=interleaved --set "
                  "pipeline.virtual_stages=2 --set train_batch_size=12",
                  "(6)"},
        Misconfig{"TypePartitionMatchingNothing", "--world-size 2 --set pipeline.stages=2 --set pipeline.partition=type:mlp",
                  "matches no layer kind"},
        Misconfig{"UnknownSchedule", "--world-size 2 --set pipeline.stages=2 --set pipeline.schedule=gpipe",
                  "is not one of: 1f1b, interleaved, zb-h1"}),
    [](const ::testing::TestParamInfo<Misconfig>& info) { return info.param.name; });

TEST(Pipeline, TypePartitionBalancesTheBlocks) {
  const std::string config = write_config("pipe.json", pipe_config());
  const std::string dir = temp_path("pipe_type");
  std::system(("rm -rf " + dir).c_str());
  // weights [0,1,1,1,1,1,1,0] over 2 parts: three blocks each (ties toward the later split)
  const Result r = run("train " + config + " --output " + dir +
                           " --set training.steps=1 --set pipeline.stages=2 --set pipeline.partition=type:block",
                       2);
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("stage 0: embedding..h.2"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("stage 1: h.3..final"), std::string::npos) << r.out;
}

}  // namespace
