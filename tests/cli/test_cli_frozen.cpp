// test_cli_frozen.cpp — model.frozen_parameters (issue 34): parameters with requires_grad=False,
// as a DeepSpeed fine-tuning user freezes them. Every ZeRO stage at one and two ranks trains the
// PyTorch reference of tests/golden/make_frozen_goldens.py (the frozen parameters outside
// AdamW's group, clipping over the trainable ones); the frozen tensors come out of the run bit
// for bit as they went in; the optimizer state, the plan and the gradient reduction leave them
// out; a resumed run is the uninterrupted one in every bit; bad patterns exit 2 naming them.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <regex>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "io/h5.hpp"
#include "support/cli_helpers.hpp"
#include "support/frozen_model.hpp"
#include "support/golden_file.hpp"

using namespace cli;

namespace {

const std::string kGoldenDir = kFrozenGoldenDir;

json golden_config(int stage) { return frozen_golden_config(stage, 4); }

std::string train(const json& c, const std::string& name, int np, const std::string& args = "") {
  return train_frozen(c, name, np, args);
}

struct Layout {
  int stage, np;
};

class FrozenGolden : public ::testing::TestWithParam<Layout> {};

// Six AdamW steps with clipping: the losses and gradient norms are PyTorch's within the fp32
// goldens' 1e-4 (tests/model/test_golden.cpp), the trainable tensors end where PyTorch's do, and
// every frozen tensor is the initial one in every bit (no update, no weight decay).
TEST_P(FrozenGolden, TrainsWhatPyTorchTrainsWithRequiresGradFalseAndLeavesFrozenBitsAlone) {
  const auto [stage, np] = GetParam();
  const std::string tag = "stage " + std::to_string(stage) + " np " + std::to_string(np);
  const std::string dir = train(golden_config(stage), "frozen_s" + std::to_string(stage) + "_np" + std::to_string(np), np);
  const zero3d::h5::File golden = zero3d::h5::File::open_read(kGoldenDir + "/frozen.h5");
  const std::vector<double> ref = zero3d::test::read_doubles(golden, "losses");
  const std::vector<double> norms = zero3d::test::read_doubles(golden, "grad_norms");
  const std::vector<json> rows = read_metrics(dir);
  ASSERT_EQ(rows.size(), ref.size()) << tag;
  for (size_t i = 0; i < ref.size(); ++i) {
    EXPECT_NEAR(rows[i].at("loss").get<double>(), ref[i], 1e-4 * ref[i]) << tag << " step " << i + 1;
    EXPECT_NEAR(rows[i].at("grad_norm").get<double>(), norms[i], 1e-4 * norms[i]) << tag << " step " << i + 1;
  }
  const zero3d::h5::File init = zero3d::h5::File::open_read(kGoldenDir + "/frozen_init.h5");
  const zero3d::h5::File out = zero3d::h5::File::open_read(converted(dir));
  int frozen = 0;
  for (const std::string& name : tensor_names()) {
    const std::vector<float> got = out.read_floats(name);
    if (is_frozen(name)) {
      ++frozen;
      const std::vector<float> start = init.read_floats(name);
      ASSERT_EQ(got.size(), start.size()) << name;
      for (size_t k = 0; k < got.size(); ++k)
        ASSERT_EQ(got[k], start[k]) << tag << " " << name << "[" << k << "] changed";
      continue;
    }
    const std::vector<double> want = zero3d::test::read_doubles(golden, "final/" + name);
    ASSERT_EQ(got.size(), want.size()) << name;
    // The key bias (c_attn.bias[C, 2C)) has no gradient in exact arithmetic (softmax ignores a
    // constant added to every key's score), so AdamW turns rounding noise into lr-sized steps
    // of either sign: it is left out, as it would be of any comparison of two implementations.
    const bool key_bias = name.find("attn.c_attn.bias") != std::string::npos;
    for (size_t k = 0; k < got.size(); ++k) {
      if (key_bias && k >= 32 && k < 64) continue;
      ASSERT_NEAR(got[k], want[k], 1e-4 + 1e-4 * std::fabs(want[k])) << tag << " " << name << "[" << k << "]";
    }
  }
  EXPECT_EQ(frozen, 14);
}

INSTANTIATE_TEST_SUITE_P(Stages, FrozenGolden,
                         ::testing::Values(Layout{0, 1}, Layout{1, 1}, Layout{2, 1}, Layout{3, 1}, Layout{0, 2},
                                           Layout{1, 2}, Layout{2, 2}, Layout{3, 2}),
                         [](const auto& info) {
                           return "stage" + std::to_string(info.param.stage) + "_np" + std::to_string(info.param.np);
                         });

// ZeRO-3 over two ranks computes the single rank's losses (the same global batch).
TEST(Frozen, TwoRankZero3LossesAreOneRanksWithin1e5) {
  const auto one = losses_of(read_metrics(train(golden_config(3), "frozen_z3_np1", 1)));
  const auto two = losses_of(read_metrics(train(golden_config(3), "frozen_z3_np2", 2)));
  expect_losses_close(two, one, 1e-5, "np 2 vs np 1");
}

// ZeRO-3's layouts over 4 ranks on 2 emulated nodes: MiCS (shard groups of 2, the replicas'
// all-reduce) and hpZ (the secondary partition) train the reference's losses within 1e-4; qwZ
// and qgZ quantise, and stay within 0.5% of them.
TEST(Frozen, Zero3LayoutsOnFourRanksTrainTheReference) {
  const zero3d::h5::File golden = zero3d::h5::File::open_read(kGoldenDir + "/frozen.h5");
  const std::vector<double> ref = zero3d::test::read_doubles(golden, "losses");
  const std::vector<std::pair<json, double>> layouts = {{{{"mics_shard_size", 2}}, 1e-4},
                                                        {{{"zero_hpz_partition_size", 2}}, 1e-4},
                                                        {{{"zero_quantized_weights", true}}, 5e-3},
                                                        {{{"zero_quantized_gradients", true}}, 5e-3}};
  for (const auto& [keys, rel] : layouts) {
    json c = golden_config(3);
    c["train_micro_batch_size_per_gpu"] = 2;
    c["zero_optimization"].merge_patch(keys);
    const std::string dir = temp_path("frozen_np4");
    std::system(("rm -rf " + dir).c_str());
    const Result r = run("train " + write_config("frozen_np4.json", c) + " --output " + dir, 4, "ZERO3D_RANKS_PER_NODE=2");
    ASSERT_EQ(r.code, 0) << keys.dump() << r.err;
    expect_losses_close(losses_of(read_metrics(dir)), ref, rel, keys.dump());
  }
}

// bf16 with fp32 master weights, gradient accumulation over two micro-batches: the frozen
// tensors have no master copy; they are the bf16 parameters the initial values were rounded to,
// in every bit, and the checkpoint holds those (as DeepSpeed saves frozen parameters from the
// bf16 module).
TEST(Frozen, Bf16WithAccumulationLeavesFrozenBitsAlone) {
  json c = golden_config(2);
  c["bf16"] = {{"enabled", true}};
  c["train_micro_batch_size_per_gpu"] = 2;
  const std::string dir = train(c, "frozen_bf16", 2);
  const zero3d::h5::File init = zero3d::h5::File::open_read(kGoldenDir + "/frozen_init.h5");
  const zero3d::h5::File out = zero3d::h5::File::open_read(converted(dir));
  for (const std::string& name : tensor_names()) {
    const std::vector<float> got = out.read_floats(name), start = init.read_floats(name);
    ASSERT_EQ(got.size(), start.size()) << name;
    size_t same = 0;
    for (size_t k = 0; k < got.size(); ++k) {
      if (is_frozen(name)) {
        ASSERT_EQ(got[k], bf16_rounded(start[k])) << name << "[" << k << "]";
      }
      same += got[k] == bf16_rounded(start[k]) ? 1 : 0;
    }
    if (!is_frozen(name)) {
      EXPECT_LT(same, got.size()) << name << " did not train";
    }
  }
}

// The optimizer holds m and v (fp32, 8 bytes) for the trainable elements only, as DeepSpeed's
// groups hold trainable parameters only; the estimate counts exactly that, and the gradient
// reduction moves no frozen bytes (the estimate's communication equals the run's).
TEST(Frozen, OptimizerStateAndPlanExcludeFrozenParameters) {
  for (const int stage : {0, 1, 2, 3}) {
    const std::string tag = "stage " + std::to_string(stage);
    const json c = golden_config(stage);
    const std::string config = write_config("frozen_plan.json", c);
    const std::string dir = train(c, "frozen_plan_s" + std::to_string(stage), 1);
    const json m = read_metrics(dir).back().at("memory");
    EXPECT_EQ(m.at("optimizer_states").get<int64_t>(), 8 * (kPsi - kFrozenNumel)) << tag;
    const Result e = run("estimate --config " + config + " --world-size 1 --json");
    ASSERT_EQ(e.code, 0) << e.err;
    const json b = json::parse(e.out)["budgets"][stage];
    for (const char* category : {"params", "grads", "master", "optimizer_states"})
      EXPECT_EQ(b[category], m[category]) << tag << " " << category;
  }
  // Two ranks: each rank's partition (14,016 elements) holds its own share of the trainable
  // elements: rank 0 [0, 14016) wte's 2,048 (wpe and most of block 0 are frozen), rank 1 the
  // remaining 14,016 − 1,248 (block 0's tail) − 128 (the frozen bias) = 12,640. metrics.jsonl
  // reports rank 0's; the plan counts the larger share, the memory the busiest rank needs.
  for (const int stage : {2, 3}) {
    const std::string tag = "np 2 stage " + std::to_string(stage);
    const json c = golden_config(stage);
    const std::string config = write_config("frozen_plan2.json", c);
    const std::string dir = train(c, "frozen_plan2_s" + std::to_string(stage), 2);
    const json row = read_metrics(dir).back();
    const Result e = run("estimate --config " + config + " --world-size 2 --json");
    ASSERT_EQ(e.code, 0) << e.err;
    const json est = json::parse(e.out);
    const int64_t planned = est["budgets"][stage]["optimizer_states"].get<int64_t>();
    EXPECT_EQ(row.at("memory").at("optimizer_states").get<int64_t>(), 8 * 2048) << tag;
    EXPECT_EQ(planned, 8 * 12640) << tag;
    const json predicted = est.at("communication").at(stage);
    for (const auto& [axis, bytes] : row.at("comm_bytes_by_axis").items())
      EXPECT_EQ(predicted.at("comm_bytes_by_axis").value(axis, int64_t(0)), bytes.get<int64_t>()) << tag << " " << axis;
  }
}

// The gradient reduction leaves frozen tensors out: fewer data-parallel bytes than the same run
// with every parameter trainable.
TEST(Frozen, GradientReductionMovesNoFrozenBytes) {
  json frozen = golden_config(2), all = golden_config(2);
  all["model"].erase("frozen_parameters");
  const auto bytes = [](const std::string& dir) {
    return read_metrics(dir).back().at("comm_bytes_by_axis").at("data").get<int64_t>();
  };
  const int64_t with = bytes(train(frozen, "frozen_comm", 2)), without = bytes(train(all, "frozen_comm_all", 2));
  EXPECT_LT(with, without);
}

// Three steps, saved, resumed for three more: the same losses in every bit as six uninterrupted
// ones, at each stage on two ranks (the packed optimizer state saved with zeros for frozen elements).
TEST(Frozen, ResumeIsBitForBit) {
  for (const int stage : {0, 1, 3}) {
    const std::string tag = "stage " + std::to_string(stage);
    const std::string full = train(golden_config(stage), "frozen_full_s" + std::to_string(stage), 2);
    const std::string resumed = train(golden_config(stage), "frozen_resumed_s" + std::to_string(stage), 2,
                                      "--set training.resume=" + full + "/checkpoints/global_step3");
    const auto a = losses_of(read_metrics(full)), b = losses_of(read_metrics(resumed));
    ASSERT_EQ(a.size(), 6u) << tag;
    ASSERT_EQ(b.size(), 3u) << tag;
    for (size_t i = 0; i < 3; ++i) EXPECT_EQ(b[i], a[3 + i]) << tag << " step " << 4 + i;
  }
}

TEST(Frozen, BadPatternsAndCombinationsExitTwoNamingTheKey) {
  const auto with = [](const json& patch) {
    json c = golden_config(3);
    c.merge_patch(patch);
    return c;
  };
  const auto frozen = [&](const json& patterns) { return with({{"model", {{"frozen_parameters", patterns}}}}); };
  const std::vector<std::tuple<json, int, std::string>> cases = {
      {frozen({"h\\.(0"}), 1, "`model.frozen_parameters`: \"h\\\\.(0\" is not a regular expression"},
      {frozen({"^h\\.0\\.", "lm_head"}), 1, "`model.frozen_parameters`: \"lm_head\" matches no parameter of the model"},
      {frozen({".*"}), 1, "freezes every parameter of the model"},
      {frozen({"wte", "wpe", "^h\\.", "ln_f"}), 1, "freezes every parameter of the model"},
      {frozen(json::array()), 1, "expected a non-empty list of regular expressions"},
      {frozen("wte"), 1, "expected a non-empty list of regular expressions"},
      {frozen({3}), 1, "expected strings, got 3"},
      {with({{"pipeline", {{"stages", 2}}}, {"zero_optimization", {{"stage", 1}}}}), 2, "cannot be combined with pipeline.stages 2"},
      {with({{"tensor_parallel", {{"autotp_size", 2}}}, {"zero_optimization", {{"stage", 1}}}}), 2, "cannot be combined with tensor_parallel.autotp_size 2"},
      {with({{"optimizer", {{"type", "Lamb"}}}, {"zero_optimization", {{"stage", 0}}}}), 1, "cannot be combined with optimizer Lamb"},
      {with({{"zero_optimization", {{"offload_optimizer", {{"device", "cpu"}}}}}}), 1,
       "cannot be combined with zero_optimization.offload_optimizer"},
      {with({{"zero_optimization", {{"stage", 2}, {"zero_quantized_nontrainable_weights", true}}}}), 1,
       "at stage 2 parameters are not partitioned"},
      {with({{"zero_optimization", {{"zero_quantized_nontrainable_weights", true}}}, {"model", {{"frozen_parameters", nullptr}}}}),
       1, "and model.frozen_parameters names none"}};
  for (const auto& [c, np, message] : cases) {
    SCOPED_TRACE(message);
    expect_one_line_rejection(run("validate " + write_config("frozen_bad.json", c), np), message);
  }
}

}  // namespace
