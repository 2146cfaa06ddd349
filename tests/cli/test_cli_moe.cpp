// Mixture of Experts with expert parallelism, black-box (issue 15): every expert layout of the
// same global batch trains to the losses of one rank — with tokens dropped at capacity — at ZeRO
// stages 0-3, with residual MoE, pipelines and tensor parallelism; expert gradients travel only
// in their expert-data group; checkpoints name whole experts and resume at another ep_size;
// metrics report each MoE layer's routing; misconfigurations stop at validation with the numbers.
#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <numeric>
#include <string>
#include <vector>

#include "support/cli_helpers.hpp"

using namespace cli;

namespace {

// 4 experts of top-2 in both blocks, capacity factor 0.5: each expert keeps at most
// ceil(32/4 · 0.5 · 2) = 8 of a micro-batch's 64 choices, so about half are dropped on every step.
// 16 samples of 2 = 8 micro-batches on one data rank; clipping at 0.05 acts on every step.
json moe_config() {
  return json{{"train_batch_size", 16},
              {"train_micro_batch_size_per_gpu", 2},
              {"gradient_clipping", 0.05},
              {"optimizer", {{"type", "AdamW"}, {"params", {{"lr", 3e-3}, {"weight_decay", 0.01}}}}},
              {"model",
               {{"vocab_size", 61},
                {"n_positions", 16},
                {"n_layer", 2},
                {"n_head", 2},
                {"n_embd", 16},
                {"moe", {{"num_experts", 4}, {"k", 2}, {"capacity_factor", 0.5}, {"min_capacity", 2}}}}},
              {"training", {{"steps", 10}, {"seed", 11}, {"peak_gflops", 50}}},
              {"steps_per_print", 100}};
}

std::string train(int np, const std::string& name, const std::string& args, const json& config = moe_config()) {
  const std::string path = write_config("moe_" + name + ".json", config);
  const std::string dir = temp_path("moe_" + name);
  std::system(("rm -rf " + dir).c_str());
  const Result r = run("train " + path + " --output " + dir + " " + args, np);
  EXPECT_EQ(r.code, 0) << r.out << r.err;
  return dir;
}

std::vector<double> train_losses(int np, const std::string& name, const std::string& args) {
  return losses_of(read_metrics(train(np, name, args)));
}

// One single-rank reference per routing variant.
const std::vector<double>& reference(const std::string& variant) {
  static std::map<std::string, std::vector<double>> cache;
  auto it = cache.find(variant);
  if (it == cache.end()) {
    const std::string dir = train(1, "ref", variant);
    const std::vector<json> rows = read_metrics(dir);
    // the references drop tokens, so capacity is exercised (no-drop variants: none, by definition)
    const bool drops = variant.find("drop_tokens=false") == std::string::npos;
    for (const json& row : rows)
      for (const json& layer : row.at("moe"))
        if (drops) EXPECT_GT(layer.at("dropped_fraction").get<double>(), 0.2);
        else EXPECT_EQ(layer.at("dropped_fraction").get<double>(), 0.0);
    it = cache.emplace(variant, losses_of(rows)).first;
  }
  return it->second;
}

struct Layout {
  int np, ep;
  std::string args, variant, name;
};

class MoeLayout : public ::testing::TestWithParam<Layout> {};

TEST_P(MoeLayout, GivesTheLossesOfOneRankOverTenStepsWhileDroppingTokens) {
  const Layout& l = GetParam();
  const std::vector<double> got =
      train_losses(l.np, l.name, "--set model.moe.ep_size=" + std::to_string(l.ep) + " " + l.args + " " + l.variant);
  expect_losses_close(got, reference(l.variant), 1e-5, l.name);
}

const std::string kResidual = "--set model.moe.use_residual=true --set model.moe.k=1 --set model.moe.noisy_gate_policy=Jitter";
const std::string kTop1Rts = "--set model.moe.k=1 --set model.moe.capacity_factor=0.7";
const std::string kNoDrop = "--set model.moe.k=1 --set model.moe.drop_tokens=false --set model.moe.noisy_gate_policy=RSample";

INSTANTIATE_TEST_SUITE_P(
    ExpertLayouts, MoeLayout,
    ::testing::Values(Layout{2, 1, "", "", "np2_ep1_z0"}, Layout{2, 2, "", "", "np2_ep2_z0"},
                      Layout{4, 4, "--set zero_optimization.stage=1", "", "np4_ep4_z1"},
                      Layout{4, 2, "--set zero_optimization.stage=2", "", "np4_ep2_z2"},
                      Layout{4, 4, "--set zero_optimization.stage=3", "", "np4_ep4_z3"},
                      Layout{4, 2, "--set zero_optimization.stage=2", kResidual, "np4_ep2_z2_residual"},
                      Layout{4, 4, "--set zero_optimization.stage=1", kTop1Rts, "np4_ep4_z1_top1_rts"},
                      Layout{4, 4, "", kNoDrop, "np4_ep4_z0_nodrop_rsample"},
                      Layout{4, 2, "--set pipeline.stages=2 --set zero_optimization.stage=1", "", "np4_p2_ep2_z1"},
                      Layout{4, 2, "--set pipeline.stages=2", kResidual, "np4_p2_ep2_z0_residual"},
                      Layout{4, 2, "--set tensor_parallel.autotp_size=2", "", "np4_t2_ep2_z0"},
                      Layout{4, 2,
                             "--set tensor_parallel.autotp_size=2 --set model.moe.enable_expert_tensor_parallelism=true "
                             "--set zero_optimization.stage=2",
                             kResidual, "np4_t2_ep2_z2_expert_tp_residual"}),
    [](const auto& info) { return info.param.name; });

// Without drop_tokens the capacity is the largest load, agreed over the expert group (all-reduce
// MAX): across expert ranks no choice is dropped either.
TEST(Moe, WithoutDropTokensNoChoiceIsDroppedAcrossExpertRanks) {
  const std::string dir = train(2, "nodrop", "--set model.moe.ep_size=2 " + kNoDrop);
  for (const json& row : read_metrics(dir))
    for (const json& layer : row.at("moe")) EXPECT_EQ(layer.at("dropped_fraction").get<double>(), 0.0);
}

// Expert gradients are reduced over the expert-data group only (DeepSpeed _reduce_expert_gradients),
// dense ones over the data group: at np 2, ep 1 all-reduces the experts over both ranks (stage 0:
// 2·(W-1)/W · 4 bytes per element = 4 bytes per expert parameter); ep 2 leaves one rank per
// expert-data group and moves no expert gradient, but all-to-alls the tokens instead.
TEST(Moe, ExpertGradientsTravelOnlyInTheirExpertDataGroup) {
  const int64_t C = 16, experts = 2 * 4, per_expert = 8 * C * C + 5 * C;
  const std::vector<json> ep1 = read_metrics(train(2, "bytes_ep1", "--set model.moe.ep_size=1"));
  const std::vector<json> ep2 = read_metrics(train(2, "bytes_ep2", "--set model.moe.ep_size=2"));
  ASSERT_EQ(ep1.size(), 10u);
  ASSERT_EQ(ep2.size(), 10u);
  for (size_t i = 0; i < ep1.size(); ++i) {
    const json& a = ep1[i].at("comm_bytes_by_axis");
    const json& b = ep2[i].at("comm_bytes_by_axis");
    EXPECT_EQ(a.at("expert_data").get<int64_t>(), 4 * experts * per_expert) << "step " << i + 1;
    EXPECT_EQ(b.at("expert_data").get<int64_t>(), 0) << "step " << i + 1;
    EXPECT_EQ(a.at("expert").get<int64_t>(), 0) << "no all-to-all within one rank";
    EXPECT_GT(b.at("expert").get<int64_t>(), 0);
    EXPECT_EQ(a.at("data").get<int64_t>(), b.at("data").get<int64_t>()) << "the dense gradients are the same traffic";
    EXPECT_EQ(ep2[i].at("comm_bytes").get<int64_t>(),
              b.at("data").get<int64_t>() + b.at("tensor").get<int64_t>() + b.at("pipe").get<int64_t>() +
                  b.at("expert").get<int64_t>() + b.at("expert_data").get<int64_t>());
  }
}

// metrics.jsonl: per MoE layer the choices routed to each expert before drops (DeepSpeed's
// exp_counts: all 16 samples × 16 tokens × k=2 of the step), the dropped share and l_aux; the
// step line shows the dropped share of the whole step.
TEST(Moe, MetricsReportEachLayersRoutingAndTheStepLineItsDroppedShare) {
  const std::string path = write_config("moe_metrics.json", moe_config());
  const std::string dir = temp_path("moe_metrics");
  const Result r = run("train " + path + " --output " + dir + " --set model.moe.ep_size=2 --set steps_per_print=1", 2);
  ASSERT_EQ(r.code, 0) << r.out << r.err;
  const std::vector<json> rows = read_metrics(dir);
  ASSERT_EQ(rows.size(), 10u);
  for (const json& row : rows) {
    ASSERT_EQ(row.at("moe").size(), 2u);
    double dropped = 0.0;
    for (int l = 0; l < 2; ++l) {
      const json& layer = row.at("moe")[l];
      EXPECT_EQ(layer.at("layer").get<int>(), l);
      const std::vector<int64_t> tokens = layer.at("tokens_per_expert").get<std::vector<int64_t>>();
      ASSERT_EQ(tokens.size(), 4u);
      EXPECT_EQ(std::accumulate(tokens.begin(), tokens.end(), int64_t(0)), 16 * 16 * 2);
      const double f = layer.at("dropped_fraction").get<double>();
      EXPECT_GT(f, 0.0);
      EXPECT_LT(f, 1.0);
      dropped += f / 2;
      // l_aux = E·Σ_e mean(gates_e)·mean(mask_e) ≥ 1 (Cauchy–Schwarz at uniform routing), ≤ E
      EXPECT_GE(layer.at("l_aux").get<double>(), 0.99);
      EXPECT_LE(layer.at("l_aux").get<double>(), 4.0);
    }
    char want[64];
    std::snprintf(want, sizeof want, "| dropped %.1f%%", 100.0 * dropped);
    EXPECT_NE(r.out.find(want), std::string::npos) << want << "\n" << r.out;
  }
}

// Checkpoints hold whole experts under their global names, whatever ep_size saved them, and a
// run saved at np 2, ep 2 resumes at np 4, ep 4 (and at np 1) with the uninterrupted losses.
TEST(Moe, ResumesAtAnotherExpertParallelSizeWithTheUninterruptedLosses) {
  const std::string save = temp_path("moe_ckpt");
  std::system(("rm -rf " + save).c_str());
  const std::string whole = train(2, "whole", "--set model.moe.ep_size=2");
  const std::string saved = train(2, "saved", "--set model.moe.ep_size=2 --set training.steps=5 --set training.save_dir=" +
                                                   save + " --set training.save_interval=5");
  const Result inspected = run("inspect " + save + " --tensor h.1.mlp.experts.3.c_proj.weight");
  EXPECT_EQ(inspected.code, 0) << inspected.out << inspected.err;
  EXPECT_NE(inspected.out.find("h.1.mlp.experts.3.c_proj.weight"), std::string::npos) << inspected.out;
  const std::vector<double> all = losses_of(read_metrics(whole));
  const std::vector<double> tail(all.begin() + 5, all.end());
  for (const auto& [np, ep] : std::vector<std::pair<int, int>>{{4, 4}, {1, 1}}) {
    const std::string dir = train(np, "resumed_ep" + std::to_string(ep),
                                  "--set model.moe.ep_size=" + std::to_string(ep) + " --set training.save_dir=" + save +
                                      " --set training.resume=latest");
    expect_losses_close(losses_of(read_metrics(dir)), tail, 1e-6, "resumed at ep " + std::to_string(ep));
  }
}

// The memory planner counts each rank's E/ep experts per MoE block in the expert-data group's
// ZeRO partition: `zero3d estimate` gives what training reports, byte for byte, at every stage.
TEST(Moe, EstimateCountsEachRanksExpertStatesAsTrainingAllocatesThem) {
  for (int ep : {1, 2}) {
    json j = moe_config();
    j["model"]["moe"]["ep_size"] = ep;
    j["training"]["steps"] = 1;
    const std::string cfg = write_config("moe_est_ep" + std::to_string(ep) + ".json", j);
    const Result r = run("estimate --config " + cfg + " --world-size 2 --json");
    ASSERT_EQ(r.code, 0) << r.err;
    const json est = json::parse(r.out);
    for (int stage = 0; stage <= 3; ++stage) {
      const std::string dir = temp_path("moe_est_ep" + std::to_string(ep) + "_s" + std::to_string(stage));
      const Result train = run("train " + cfg + " --output " + dir + " --set zero_optimization.stage=" + std::to_string(stage), 2);
      ASSERT_EQ(train.code, 0) << train.err;
      const json m = read_metrics(dir).back()["memory"];
      const json& rank0 = est["ranks"][0]["budgets"][stage];
      for (const char* category : {"params", "grads", "master", "optimizer_states", "activations"})
        EXPECT_EQ(rank0[category], m[category]) << "ep " << ep << " stage " << stage << " " << category;
    }
  }
}

// FLOPs count the parameters a token meets: the dense ones and k of each MoE block's E experts
// (6N + 12·L·T·C with N active), so MFU · peak / tokens_per_s recovers that count.
TEST(Moe, MfuCountsTheActiveParameters) {
  const std::string dir = train(2, "mfu", "--set model.moe.ep_size=2");
  const int64_t V = 61, T = 16, L = 2, C = 16, E = 4, k = 2;
  const int64_t dense_block = 4 * C * C + 8 * C + C * E, expert = 8 * C * C + 5 * C;
  const int64_t active = V * C + T * C + L * dense_block + 2 * C + L * k * expert;
  for (const json& row : read_metrics(dir)) {
    const double flops_per_token = row.at("mfu").get<double>() * 2 * 50e9 / row.at("tokens_per_s").get<double>();
    EXPECT_NEAR(flops_per_token, 6.0 * active + 12.0 * L * T * C, 1e-6 * flops_per_token);
  }
}

// zero3d convert writes every expert under its name, and config.json carries the MoE section
// (GPT2Config has no experts).
TEST(Moe, ConvertWritesEveryExpertAndTheMoeSection) {
  const std::string save = temp_path("moe_convert_ckpt");
  std::system(("rm -rf " + save).c_str());
  train(2, "convert", "--set model.moe.ep_size=2 --set training.steps=2 --set training.save_dir=" + save +
                          " --set training.save_interval=2");
  const std::string out = temp_path("moe_converted/model.h5");
  const Result r = run("convert " + save + " " + out);
  ASSERT_EQ(r.code, 0) << r.out << r.err;
  const json config = json::parse(slurp(temp_path("moe_converted/config.json")));
  EXPECT_EQ(config.at("moe").at("num_experts"), 4);
  const Result listed = run("inspect " + save + " --tensor h.0.mlp.experts.2.c_fc.weight");
  EXPECT_EQ(listed.code, 0) << listed.err;
  EXPECT_NE(listed.out.find("[16,64]"), std::string::npos) << listed.out;
}

struct Misconfig {
  std::string name, args, message;
};
class MoeMisconfig : public ::testing::TestWithParam<Misconfig> {};

TEST_P(MoeMisconfig, ExitsTwoWithOneMessageHoldingTheNumbers) {
  const std::string path = write_config("moe_bad.json", moe_config());
  const Result r = run("validate " + path + " " + GetParam().args);
  EXPECT_EQ(r.code, 2) << r.out << r.err;
  EXPECT_NE(r.err.find(GetParam().message), std::string::npos) << r.err;
}

INSTANTIATE_TEST_SUITE_P(
    Validation, MoeMisconfig,
    ::testing::Values(
        Misconfig{"ExpertsNotDivisibleByEpSize", "--world-size 3 --set model.moe.ep_size=3 --set train_batch_size=18",
                  "num_experts (4) is not divisible by ep_size (3)"},
        Misconfig{"EpSizeNotDividingTheDataGroup", "--world-size 6 --set model.moe.ep_size=4 --set train_batch_size=24",
                  "ep_size 4 does not divide the data-parallel size (6 ranks)"},
        Misconfig{"MoreChoicesThanExperts", "--set model.moe.k=5", "k 5 is more than num_experts (4)"},
        Misconfig{"TopOneWithFewerTokensThanMinCapacity", "--set model.moe.k=1 --set model.moe.min_capacity=64",
                  "min_capacity 64 exceeds the tokens a rank routes per micro-batch (micro-batch 2 x n_positions 16 = 32)"},
        Misconfig{"UnknownNoisePolicy", "--set model.moe.noisy_gate_policy=Gaussian",
                  "is not one of null, \"None\", \"Jitter\", \"RSample\""},
        Misconfig{"SequenceParallel",
                  "--world-size 2 --set tensor_parallel.autotp_size=2 --set tensor_parallel.sequence_parallel=true "
                  "--set train_batch_size=2",
                  "sequence parallelism gives each tensor rank a different shard"},
        Misconfig{"ZeroBubble", "--world-size 2 --set pipeline.stages=2 --set pipeline.schedule=zb-h1",
                  "use \"1f1b\" or \"interleaved\" with model.moe"}),
    [](const auto& info) { return info.param.name; });

}  // namespace
