// test_cli_deepspeed_keys.cpp — the DeepSpeed keys issue 18 left for last, end to end:
// prescale_gradients / gradient_predivide_factor, fp16.auto_cast, bf16_master_weights_and_grads /
// bf16_optimizer_states, and zero_optimization.stage as the autotuner's search space.
#include <cmath>

#include "support/cli_helpers.hpp"

using namespace cli;

namespace {

std::vector<double> train_losses(const json& j, const std::string& name, int np, const std::string& args = "") {
  const std::string config = write_config(name + ".json", j), dir = temp_path(name);
  const Result r = run("train " + config + " --output " + dir + args, np);
  EXPECT_EQ(r.code, 0) << name << "\n" << r.err;
  return losses_of(read_metrics(dir));
}

// --- prescale_gradients, gradient_predivide_factor ------------------------------------------------

// Where the mean divides does not change it: by a power of two the placements agree bit for bit
// (scaling by 2^k is exact), by 3 within fp32 rounding. The reducer's own test shows the factors
// are applied (tests/parallel/test_mpi_grad_scaling.cpp: fp16 sums that overflow without them).
TEST(GradientAveragingCli, PrescaleAndPredivideTrainTheSameLossesAtTwoRanks) {
  for (int stage : {0, 2}) {
    json j = tiny_config();
    j["training"]["steps"] = 6;
    j["zero_optimization"] = {{"stage", stage}};
    const std::string s = "_s" + std::to_string(stage);
    const std::vector<double> mean = train_losses(j, "mean" + s, 2);
    ASSERT_EQ(mean.size(), 6u);
    j["prescale_gradients"] = true;
    EXPECT_EQ(train_losses(j, "prescale" + s, 2), mean) << "stage " << stage;
    j.erase("prescale_gradients");
    j["gradient_predivide_factor"] = 8.0;
    EXPECT_EQ(train_losses(j, "predivide8" + s, 2), mean) << "stage " << stage;
    j["gradient_predivide_factor"] = 3.0;
    expect_losses_close(train_losses(j, "predivide3" + s, 2), mean, 1e-5, "predivide 3, stage " + std::to_string(stage));
  }
}

TEST(GradientAveragingCli, ValidateSaysWhereTheMeanDivides) {
  json j = tiny_config();
  j["gradient_predivide_factor"] = 8;
  Result r = run("validate " + write_config("pd.json", j) + " --world-size 2");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("gradient averaging over 2 data-parallel ranks: x0.125 before the sum, x4 after"), std::string::npos)
      << r.out;
  j["prescale_gradients"] = true;
  r = run("validate " + write_config("pd.json", j) + " --world-size 2");
  EXPECT_NE(r.out.find("x0.5 before the sum, x1 after (prescale_gradients; gradient_predivide_factor applies only "
                       "without prescale_gradients"),
            std::string::npos)
      << r.out;
  j["gradient_predivide_factor"] = 0;
  expect_one_line_rejection(run("validate " + write_config("pd.json", j)), "`gradient_predivide_factor`: value 0 is out of range");
}

// --- fp16.auto_cast -----------------------------------------------------------------------------

// DeepSpeed casts the floating-point tensors among a model's inputs to fp16; zero3d's inputs are
// token ids, which that cast leaves as they are: the same run, and a start-up line saying why.
TEST(AutoCastCli, TokenInputsAreLeftAsTheyAreSoTheRunIsTheSame) {
  json j = tiny_config();
  j["fp16"] = {{"enabled", true}, {"initial_scale_power", 8}};
  const std::vector<double> plain = train_losses(j, "fp16_plain", 1);
  j["fp16"]["auto_cast"] = true;
  const std::string config = write_config("fp16_cast.json", j), dir = temp_path("fp16_cast");
  const Result r = run("train " + config + " --output " + dir, 1);
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(losses_of(read_metrics(dir)), plain);
  EXPECT_NE(r.out.find("`fp16.auto_cast` = true: DeepSpeed casts a model's floating-point inputs to fp16; zero3d's "
                       "inputs are integer token ids, which it leaves unchanged"),
            std::string::npos)
      << r.out;
}

// --- bf16_master_weights_and_grads, bf16_optimizer_states -----------------------------------------

json bf16_zero_config(int stage) {
  json j = tiny_config();
  j["model"]["vocab_size"] = 61;  // kZeroPsi parameters, which no rank count divides evenly
  j["bf16"] = {{"enabled", true}};
  j["zero_optimization"] = {{"stage", stage}};
  j["training"]["steps"] = 8;
  return j;
}

// Memory per rank drops by the fp32 master (4 bytes per owned element) and, with bf16 states, by
// half of Adam's 8; the planner predicts exactly what the engine holds.
TEST(Bf16MasterWeightsCli, MemoryDropsByTheMasterAndHalfTheMomentsAsPlanned) {
  const auto [padded, part] = zero_split(kZeroPsi, 2);
  for (int stage : {1, 2, 3}) {
    for (bool states : {false, true}) {
      json j = bf16_zero_config(stage);
      j["training"]["steps"] = 1;
      j["bf16"]["bf16_master_weights_and_grads"] = true;
      j["bf16"]["bf16_optimizer_states"] = states;
      const std::string tag = "b16m_s" + std::to_string(stage) + (states ? "_st" : "");
      const std::string config = write_config(tag + ".json", j), dir = temp_path(tag);
      ASSERT_EQ(run("train " + config + " --output " + dir, 2).code, 0) << tag;
      const json m = read_metrics(dir).back()["memory"];
      EXPECT_EQ(m["master"], 0) << tag;
      EXPECT_EQ(m["optimizer_states"], (states ? 4 : 8) * part) << tag;
      EXPECT_EQ(m["params"], 2 * (stage == 3 ? part : padded)) << tag;
      const Result est = run("estimate --config " + config + " --world-size 2 --json");
      ASSERT_EQ(est.code, 0) << est.err;
      const json b = json::parse(est.out)["budgets"][stage];
      for (const char* category : {"params", "grads", "master", "optimizer_states"})
        EXPECT_EQ(b[category], m[category]) << tag << " " << category;
    }
  }
}

// The precision cost: each step rounds every master weight to bf16 once more than the
// fp32-master run does, a relative perturbation of at most 2^-9 per weight and step. The bound
// allows the loss that much relative drift per step: k·2^-9 after k steps (measured at step 8:
// about 3e-4 relative, a fiftieth of the bound's 1.6e-2). Updates below half a bf16 unit are
// lost outright (test_optimizers_bf16.cpp), which is why the drift is not zero.
TEST(Bf16MasterWeightsCli, LossesStayWithinTheRoundingBoundOfTheFp32MasterRun) {
  for (int stage : {2, 3}) {
    const json base = bf16_zero_config(stage);
    const std::vector<double> fp32_master = train_losses(base, "b16_fp32m_s" + std::to_string(stage), 2);
    ASSERT_EQ(fp32_master.size(), 8u);
    for (bool states : {false, true}) {
      json j = base;
      j["bf16"]["bf16_master_weights_and_grads"] = true;
      j["bf16"]["bf16_optimizer_states"] = states;
      const std::string tag = "b16_loss_s" + std::to_string(stage) + (states ? "_st" : "");
      const std::vector<double> got = train_losses(j, tag, 2);
      ASSERT_EQ(got.size(), 8u) << tag;
      EXPECT_EQ(got[0], fp32_master[0]) << tag;  // the same bf16 weights before the first update
      bool differs = false;
      for (size_t k = 1; k < got.size(); ++k) {
        EXPECT_LE(std::fabs(got[k] - fp32_master[k]), (k + 1) * std::ldexp(1.0, -9) * fp32_master[k]) << tag << " step " << k + 1;
        differs = differs || got[k] != fp32_master[k];
      }
      EXPECT_TRUE(differs) << tag << ": no master weight was ever rounded differently";
    }
  }
}

// Checkpoints hold fp32 values; bf16 weights and moments are exact in them, so a resumed run
// continues bit for bit.
TEST(Bf16MasterWeightsCli, SaveAndResumeContinueBitForBit) {
  json j = bf16_zero_config(3);
  j["bf16"]["bf16_master_weights_and_grads"] = true;
  j["bf16"]["bf16_optimizer_states"] = true;
  j["training"]["save_interval"] = 4;
  const std::string config = write_config("b16_ckpt.json", j), full = temp_path("b16_ckpt_full");
  ASSERT_EQ(run("train " + config + " --output " + full, 2).code, 0);
  const std::vector<double> all = losses_of(read_metrics(full));
  ASSERT_EQ(all.size(), 8u);
  const std::string resumed = temp_path("b16_ckpt_resumed");
  const Result r = run("train " + config + " --output " + resumed + " --set training.resume=" + full +
                           "/checkpoints/global_step4",
                       2);
  ASSERT_EQ(r.code, 0) << r.err;
  const std::vector<double> tail = losses_of(read_metrics(resumed));
  EXPECT_EQ(tail, std::vector<double>(all.begin() + 4, all.end()));
}

TEST(Bf16MasterWeightsCli, RequirementsAreDeepSpeeds) {
  json j = bf16_zero_config(0);
  j["bf16"]["bf16_master_weights_and_grads"] = true;
  expect_one_line_rejection(run("validate " + write_config("b16_z0.json", j)),
                            "`bf16.bf16_master_weights_and_grads`: is only supported with ZeRO stage 1, 2 or 3");
  j["zero_optimization"]["stage"] = 1;
  j["bf16"]["enabled"] = false;
  expect_one_line_rejection(run("validate " + write_config("b16_off.json", j)),
                            "`bf16.bf16_master_weights_and_grads`: keeps the master weights in bf16, which needs "
                            "bf16.enabled true");
  j = bf16_zero_config(2);
  j["bf16"]["bf16_optimizer_states"] = true;
  expect_one_line_rejection(run("validate " + write_config("b16_st.json", j)),
                            "`bf16.bf16_optimizer_states`: requires bf16_master_weights_and_grads true");
}

// --- zero_optimization.stage as the autotuner's search space -----------------------------------

TEST(StageSearchSpaceCli, AListOrAllIsValidForTheAutotunerOnly) {
  json j = tiny_config();
  j["zero_optimization"] = {{"stage", {1, 3}}};
  const std::string plain = write_config("space.json", j);
  expect_one_line_rejection(run("validate " + plain),
                            "`zero_optimization.stage`: value [1,3] is DeepSpeed's autotuner's search space: set "
                            "autotuning.enabled true");
  j["autotuning"] = {{"enabled", true}};
  Result r = run("validate " + write_config("space_on.json", j) + " --world-size 2");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("`zero_optimization.stage` = [1,3]: the autotuner's search space (autotuning.enabled); the "
                       "config is checked at stage 1"),
            std::string::npos)
      << r.out;
  j["zero_optimization"]["stage"] = "all";
  j.erase("train_batch_size");
  j.erase("train_micro_batch_size_per_gpu");  // the autotuner chooses the batch too
  r = run("validate " + write_config("space_all.json", j));
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("checked at stage 0"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("auto    train_micro_batch_size_per_gpu = 1 (autotuning.enabled"), std::string::npos) << r.out;
  j["zero_optimization"]["stage"] = {2, 5};
  expect_one_line_rejection(run("validate " + write_config("space_bad.json", j)),
                            "`zero_optimization.stage`: with autotuning, expected 0-3, a list of them or \"all\"");
}

}  // namespace
