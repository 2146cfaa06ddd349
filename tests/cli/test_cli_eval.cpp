// Evaluation, black-box: the validation loss is the mean token cross-entropy PyTorch computes
// (tests/golden/make_goldens.py write_eval), in every layout, during training and from
// `zero3d eval`; evaluating changes nothing in training; bad settings stop before any work.
#include <gtest/gtest.h>

#include <hdf5.h>

#include <cmath>
#include <string>
#include <vector>

#include "support/cli_helpers.hpp"

using namespace cli;

namespace {

const std::string kGoldenDir = kSource + "/tests/golden";
const double kNone = std::nan("");  // json::value's default: a double, so the value is read as one

// The golden model (V=64, T=16, L=2, H=2, C=32) from its weights; validation: the golden's 32
// samples, evaluated as 4 rounds of the global batch of 8 (micro-batches of 4). lr 0 keeps the
// weights as loaded, so every evaluation of the run sees the golden model.
json golden_config() {
  return json{{"train_batch_size", 8},
              {"train_micro_batch_size_per_gpu", 4},
              {"optimizer", {{"type", "AdamW"}, {"params", {{"lr", 0.0}}}}},
              {"model", tiny_model(kGoldenDir + "/gpt_eval.h5")},
              {"data", {{"source", "synthetic"}, {"validation", {{"source", "tokens"}, {"path", kGoldenDir + "/gpt_eval_val.bin"}}}}},
              {"training", {{"steps", 2}, {"seed", 7}, {"peak_gflops", 50}, {"eval_interval", 1}, {"eval_steps", 4}}},
              {"steps_per_print", 100}};
}

double golden_eval_loss() {
  double loss = kNone;
  const hid_t f = H5Fopen((kGoldenDir + "/gpt_eval.h5").c_str(), H5F_ACC_RDONLY, H5P_DEFAULT);
  const hid_t ds = H5Dopen2(f, "golden/eval_loss", H5P_DEFAULT);
  H5Dread(ds, H5T_NATIVE_DOUBLE, H5S_ALL, H5S_ALL, H5P_DEFAULT, &loss);
  H5Dclose(ds);
  H5Fclose(f);
  return loss;
}

// A model that learns: the synthetic task, its validation stream of its own.
json training_config() {
  json c = tiny_config();
  c["optimizer"]["params"]["lr"] = 3e-3;
  c["data"] = {{"source", "synthetic"}, {"validation", {{"source", "synthetic"}}}};
  c["training"]["steps"] = 6;
  c["training"]["eval_steps"] = 2;
  c["steps_per_print"] = 100;
  return c;
}

// `zero3d eval ... --json` on np ranks: its last line.
json eval_json(const std::string& args, int np) {
  const Result r = run("eval " + args + " --json", np);
  EXPECT_EQ(r.code, 0) << r.out << r.err;
  const size_t end = r.out.find_last_not_of('\n');
  if (r.code != 0 || end == std::string::npos) return json();
  const size_t begin = r.out.rfind('\n', end);
  return json::parse(r.out.substr(begin == std::string::npos ? 0 : begin + 1, end + 1 - (begin == std::string::npos ? 0 : begin + 1)));
}

std::vector<json> train_rows(const std::string& config, int np, const std::string& name, const std::string& args) {
  const std::string dir = temp_path(name);
  std::system(("rm -rf " + dir).c_str());
  const Result r = run("train " + config + " --output " + dir + " " + args, np);
  EXPECT_EQ(r.code, 0) << r.out << r.err;
  return read_metrics(dir);
}

struct Layout {
  int np;
  std::string args, name;
  bool same_products;  // the same matrix products as one rank (data parallel): the same bits
};

const std::vector<Layout> kLayouts = {
    {1, "", "np1", true},
    {2, "--set zero_optimization.stage=3", "np2_zero3", true},
    {2, "--set zero_optimization.stage=1", "np2_zero1", true},
    {2, "--set tensor_parallel.autotp_size=2", "np2_tp2", false},
    {2, "--set pipeline.stages=2", "np2_pp2", true},
};

void PrintTo(const Layout& l, std::ostream* os) { *os << l.name; }

class EvalLayout : public ::testing::TestWithParam<Layout> {};

// zero3d eval of the initial weights, and the evaluations after each (lr 0) training step.
TEST_P(EvalLayout, EqualsThePyTorchForwardOnTheValidationBatch) {
  const Layout& l = GetParam();
  const double want = golden_eval_loss();
  ASSERT_TRUE(std::isfinite(want));
  const std::string config = write_config("golden_" + l.name + ".json", golden_config());
  const json e = eval_json(config + " " + l.args, l.np);
  ASSERT_TRUE(e.is_object());
  EXPECT_NEAR(e.at("eval_loss").get<double>(), want, 2e-6 * want) << l.name;
  EXPECT_DOUBLE_EQ(e.at("eval_ppl").get<double>(), std::exp(e.at("eval_loss").get<double>()));
  EXPECT_EQ(e.at("tokens").get<int64_t>(), 32 * 16);
  const std::vector<json> rows = train_rows(config, l.np, "golden_" + l.name, l.args);
  ASSERT_EQ(rows.size(), 2u);
  for (const json& row : rows) {
    // The executor's forward-only pass in training and in zero3d eval: one computation.
    EXPECT_EQ(row.at("eval_loss").get<double>(), e.at("eval_loss").get<double>()) << l.name;
    EXPECT_DOUBLE_EQ(row.at("eval_ppl").get<double>(), std::exp(row.at("eval_loss").get<double>()));
  }
}

// Data-parallel layouts (ZeRO 1, 3, pipelines) compute the same token losses as one rank and
// add them in the same order: the same bits. Tensor parallelism splits the products: rounding.
TEST(EvalLayouts, AgreeWithOneRankBitForBitWhereTheProductsAreTheSame) {
  const std::string config = write_config("golden_all.json", golden_config());
  const double one = eval_json(config, 1).value("eval_loss", kNone);
  for (const Layout& l : kLayouts) {
    const double got = eval_json(config + " " + l.args, l.np).value("eval_loss", kNone);
    if (l.same_products) EXPECT_EQ(got, one) << l.name;
    else EXPECT_NEAR(got, one, 1e-6 * one) << l.name;
  }
}

INSTANTIATE_TEST_SUITE_P(EveryLayout, EvalLayout, ::testing::ValuesIn(kLayouts),
                         [](const ::testing::TestParamInfo<Layout>& info) { return info.param.name; });

// Evaluating leaves every training figure bit-identical, in each layout; also where the
// inference schedule needs a buffer more than training (zb-h1 with one micro-batch) and with
// interleaved chunks.
TEST(EvalDuringTraining, ChangesNoTrainingLoss) {
  const std::string config = write_config("train.json", training_config());
  std::vector<Layout> layouts = kLayouts;
  layouts.push_back({2, "--set pipeline.stages=2 --set pipeline.schedule=zb-h1 --set train_micro_batch_size_per_gpu=8",
                     "np2_pp2_zbh1_one_micro_batch", true});
  layouts.push_back({2, "--set pipeline.stages=2 --set pipeline.schedule=interleaved --set pipeline.virtual_stages=2 "
                        "--set zero_optimization.stage=3", "np2_pp2_interleaved_zero3", true});
  for (const Layout& l : layouts) {
    const std::vector<json> plain = train_rows(config, l.np, "plain_" + l.name, l.args);
    const std::vector<json> evaluated =
        train_rows(config, l.np, "eval_" + l.name, l.args + " --set training.eval_interval=4");
    ASSERT_EQ(plain.size(), 6u) << l.name;
    ASSERT_EQ(evaluated.size(), 6u) << l.name;
    for (size_t i = 0; i < plain.size(); ++i) {
      EXPECT_EQ(evaluated[i].at("loss").get<double>(), plain[i].at("loss").get<double>()) << l.name << " step " << i + 1;
      EXPECT_EQ(evaluated[i].at("grad_norm").get<double>(), plain[i].at("grad_norm").get<double>()) << l.name;
      EXPECT_FALSE(plain[i].contains("eval_loss"));
      // Every eval_interval steps and after the last: steps 4 and 6.
      EXPECT_EQ(evaluated[i].contains("eval_loss"), i + 1 == 4 || i + 1 == 6) << l.name << " step " << i + 1;
    }
    // The model learns the task, and the validation stream is the same task.
    EXPECT_LT(evaluated[5].at("eval_loss").get<double>(), evaluated[3].at("eval_loss").get<double>()) << l.name;
  }
}

// Across layouts the trained models differ only by the gradient sums' rounding.
TEST(EvalDuringTraining, AgreesAcrossLayoutsAsTheTrainingLossesDo) {
  const std::string config = write_config("layouts.json", training_config());
  const std::vector<json> one = train_rows(config, 1, "layout_np1", "--set training.eval_interval=3");
  ASSERT_EQ(one.size(), 6u);
  for (const Layout& l : kLayouts) {
    const std::vector<json> rows = train_rows(config, l.np, "layout_" + l.name, l.args + " --set training.eval_interval=3");
    ASSERT_EQ(rows.size(), 6u) << l.name;
    for (size_t i : {2u, 5u})
      EXPECT_NEAR(rows[i].at("eval_loss").get<double>(), one[i].at("eval_loss").get<double>(),
                  1e-5 * one[i].at("eval_loss").get<double>())
          << l.name << " step " << i + 1;
  }
}

// zero3d eval of the tag saved at step 3 gives the evaluation that ran at step 3, in the
// saving layout bit for bit, and in the others to rounding.
TEST(EvalCommand, OnASavedCheckpointEqualsTheInTrainingEvaluation) {
  const std::string config = write_config("saved.json", training_config());
  const std::string dir = temp_path("saved");
  const std::vector<json> rows = train_rows(config, 2, "saved",
                                            "--set zero_optimization.stage=3 --set training.eval_interval=3 "
                                            "--set training.save_interval=3");
  ASSERT_EQ(rows.size(), 6u);
  const double at3 = rows[2].at("eval_loss").get<double>(), at6 = rows[5].at("eval_loss").get<double>();
  const std::string ck = dir + "/checkpoints";
  const json same = eval_json(config + " --checkpoint " + ck + " --tag global_step3 --set zero_optimization.stage=3", 2);
  EXPECT_EQ(same.value("eval_loss", kNone), at3);
  EXPECT_EQ(same.value("step", -1), 3);
  EXPECT_EQ(eval_json(config + " --checkpoint " + ck + " --set zero_optimization.stage=3", 2).value("eval_loss", kNone),
            at6);  // latest
  for (const Layout& l : kLayouts) {
    const double got = eval_json(config + " --checkpoint " + ck + "/global_step3 " + l.args, l.np).value("eval_loss", kNone);
    EXPECT_NEAR(got, at3, 1e-6 * at3) << l.name;
  }
  const Result text = run("eval " + config + " --checkpoint " + ck + " --tag global_step3", 1);
  EXPECT_EQ(text.code, 0) << text.err;
  EXPECT_NE(text.out.find("eval    step 3 | eval_loss "), std::string::npos) << text.out;
}

TEST(EvalCommand, PrintsTheEvaluationInTheStepLine) {
  const std::string config = write_config("line.json", training_config());
  const Result r = run("train " + config + " --output " + temp_path("line") + " --set training.eval_interval=5", 1);
  EXPECT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(count(r.out, " | eval_loss "), 2u) << r.out;  // steps 5 and 6
  EXPECT_NE(r.out.find("step      5/6 | loss"), std::string::npos) << r.out;  // printed although steps_per_print is 100
  EXPECT_NE(r.out.find("eval    every 5 steps and after the last: 2 rounds x 8 samples"), std::string::npos) << r.out;
}

TEST(EvalSettings, AreRejectedBeforeAnyWorkNamingTheKey) {
  const auto train = [](const std::string& config, const std::string& args) {
    return run("train " + config + " --output " + temp_path("rejected") + " " + args);
  };
  json no_validation = training_config();
  no_validation["data"].erase("validation");
  const std::string plain = write_config("no_validation.json", no_validation);
  expect_one_line_rejection(train(plain, "--set training.eval_interval=2"),
                            "`training.eval_interval`: value 2 evaluates on validation data, but `data.validation` "
                            "is not given");
  expect_one_line_rejection(run("eval " + plain), "`data.validation` is not given");
  const std::string golden = write_config("golden_bad.json", golden_config());
  // 32 validation samples hold 4 rounds of 8.
  expect_one_line_rejection(train(golden, "--set training.eval_steps=5"),
                            "`training.eval_steps`: 5 rounds of train_batch_size 8 need 40 samples, but "
                            "data.validation holds 32 (at most 4 rounds)");
  expect_one_line_rejection(run("validate " + golden + " --set training.eval_steps=5"), "data.validation holds 32");
  expect_one_line_rejection(train(golden, "--set data.validation.path=/nonexistent/val.bin"),
                            "data.validation.path: no token shard matches");
  expect_one_line_rejection(train(golden, "--set data.validation.pth=x"),
                            "`data.validation.pth`: unknown key (did you mean `data.validation.path`?)");
  // one pass: the missing path and the vocabulary too small for byte-level text, both reported
  const Result text = train(golden, "--set data.validation.source=text --set data.validation.path=");
  EXPECT_EQ(text.code, 2) << text.err;
  EXPECT_NE(text.err.find("2 problems in "), std::string::npos) << text.err;
  EXPECT_NE(text.err.find("`data.validation.path`: is required when data.validation.source is \"text\""),
            std::string::npos)
      << text.err;
  expect_one_line_rejection(train(golden, "--set training.eval_steps=0"), "`training.eval_steps`: value 0");
  expect_one_line_rejection(run("eval " + golden + " --tag global_step3"), "eval --tag global_step3: needs --checkpoint");
  expect_one_line_rejection(run("eval " + golden + " --checkpoint " + temp_path("nowhere")), "--checkpoint ");
  expect_one_line_rejection(run("eval " + golden + " --checkpoint " + kGoldenDir), "neither a checkpoint tag directory");
}

}  // namespace
