// test_cli_onebit.cpp — OneBitAdam through `zero3d train` (issue 34; DEEPSPEED-FACTS-2 §5):
// DeepSpeed's assertions as validation errors, the freeze seen in each step's data-parallel
// bytes (a full all-reduce while warming up, one 1-bit all-reduce per tensor after it), and
// checkpoints (a resume before the freeze continues bit for bit; one after it stays
// compressed with fresh error buffers).
#include <gtest/gtest.h>

#include "support/cli_helpers.hpp"

using namespace cli;

namespace {

json onebit_config(int64_t freeze_step) {
  json c = tiny_config();
  c["optimizer"] = {{"type", "OneBitAdam"},
                    {"params", {{"lr", 2e-3}, {"freeze_step", freeze_step}, {"weight_decay", 0.01},
                                {"comm_backend_name", "mpi"}}}};
  c["training"]["steps"] = 8;
  return c;
}

// The tiny model's tensors (V 64, T 16, L 2, C 32), in layout order.
std::vector<int64_t> tiny_tensors() {
  std::vector<int64_t> t = {64 * 32, 16 * 32};
  for (int l = 0; l < 2; ++l)
    for (int64_t n : {32, 32, 32 * 96, 96, 32 * 32, 32, 32, 32, 32 * 128, 128, 128 * 32, 32}) t.push_back(n);
  t.push_back(32);
  t.push_back(32);
  return t;
}

// W = 2: a 1-bit all-reduce of an n-element tensor moves half of padded/8 bytes in its
// all-to-all and half in its all-gather, and half of the 2·4·W scale bytes; padded = n rounded
// up to 16. The overflow flag the ranks agree on adds 8 bytes (an all-reduce of one int64).
int64_t compressed_step_bytes() {
  int64_t b = 0;
  for (int64_t n : tiny_tensors()) b += 2 * ((n + 15) / 16 * 16 / 8 / 2) + 2 * 4;
  return b + 8;
}

TEST(OneBitAdam, ZeroStagesAmsgradAndUnknownBackendsAreRejected) {
  json c = onebit_config(3);
  c["zero_optimization"] = {{"stage", 1}};
  expect_one_line_rejection(run("validate " + write_config("z1.json", c)), "not compatible with ZeRO");
  c = onebit_config(3);
  c["optimizer"]["params"]["amsgrad"] = true;
  expect_one_line_rejection(run("validate " + write_config("ams.json", c)), "does not support the AMSGrad variant");
  c = onebit_config(3);
  c["optimizer"]["params"]["comm_backend_name"] = "gloo";
  expect_one_line_rejection(run("validate " + write_config("gloo.json", c)), "not one of DeepSpeed's 1-bit backends");
  c = onebit_config(3);
  c["optimizer"]["params"]["freeze_steps"] = 3;  // a misspelt key is not silently ignored
  expect_one_line_rejection(run("validate " + write_config("typo.json", c)), "freeze_steps");
  c = onebit_config(3);
  c["optimizer"]["type"] = "onebitadam";  // DeepSpeed matches the name case-insensitively
  const Result ok = run("validate " + write_config("lower.json", c));
  EXPECT_EQ(ok.code, 0) << ok.err;
}

TEST(OneBitAdam, TheFreezeTurnsTheGradientAllReduceIntoOneBitMomentum) {
  const std::string dir = temp_path("onebit_bytes");
  const Result r = run("train " + write_config("ob.json", onebit_config(3)) + " --output " + dir, 2);
  ASSERT_EQ(r.code, 0) << r.err;
  const std::vector<json> rows = read_metrics(dir);
  ASSERT_EQ(rows.size(), 8u);
  int64_t psi = 0;
  for (int64_t n : tiny_tensors()) psi += n;
  // steps 1-3: the gradients' fp32 all-reduce, 2(W-1)/W·4Ψ = 4Ψ bytes at W 2; from step 4 the
  // momentum's 1-bit all-reduce per tensor
  for (size_t s = 0; s < rows.size(); ++s) {
    const int64_t bytes = rows[s].at("comm_bytes").get<int64_t>();
    if (s < 3) EXPECT_EQ(bytes, 4 * psi) << "step " << s + 1;
    else EXPECT_EQ(bytes, compressed_step_bytes()) << "step " << s + 1;
    EXPECT_TRUE(std::isfinite(rows[s].at("loss").get<double>()));
  }
  EXPECT_GT(4 * psi, 16 * compressed_step_bytes());
  EXPECT_LT(rows.back().at("loss").get<double>(), rows.front().at("loss").get<double>());
}

TEST(OneBitAdam, CheckpointsResumeWithTheFreezeRederivedFromTheStep) {
  const std::string whole = temp_path("ob_whole"), first = temp_path("ob_first"), ckpt = temp_path("ob_ckpt");
  json c = onebit_config(4);
  const std::string cfg = write_config("ob_ck.json", c);
  ASSERT_EQ(run("train " + cfg + " --output " + whole, 2).code, 0);
  // stop after step 2 (warm-up): resuming there continues bit for bit, the freeze at 4 included
  c["training"]["save_interval"] = 2;
  c["training"]["save_dir"] = ckpt;
  c["training"]["steps"] = 2;
  ASSERT_EQ(run("train " + write_config("ob_a.json", c) + " --output " + first, 2).code, 0);
  c["training"]["steps"] = 8;
  c["training"]["resume"] = "auto";
  const std::string resumed = temp_path("ob_resumed");
  const Result r = run("train " + write_config("ob_b.json", c) + " --output " + resumed, 2);
  ASSERT_EQ(r.code, 0) << r.err;
  const std::vector<json> a = read_metrics(whole), b = read_metrics(resumed);
  ASSERT_EQ(a.size(), 8u);
  ASSERT_EQ(b.size(), 6u);
  for (size_t s = 0; s < b.size(); ++s) {
    EXPECT_EQ(b[s].at("loss").get<double>(), a[s + 2].at("loss").get<double>()) << "step " << s + 3;
    EXPECT_EQ(b[s].at("comm_bytes"), a[s + 2].at("comm_bytes")) << "step " << s + 3;
  }
  // resuming at step 6 (compressed since step 5): step 7 is compressed again, from zero errors
  json late_cfg = onebit_config(4);
  late_cfg["training"]["steps"] = 6;
  late_cfg["training"]["save_interval"] = 6;
  late_cfg["training"]["save_dir"] = temp_path("ob_ckpt2");
  ASSERT_EQ(run("train " + write_config("ob_c.json", late_cfg) + " --output " + temp_path("ob_six"), 2).code, 0);
  late_cfg["training"]["steps"] = 8;
  late_cfg["training"]["resume"] = "auto";
  c = late_cfg;
  const std::string late = temp_path("ob_late");
  ASSERT_EQ(run("train " + write_config("ob_d.json", c) + " --output " + late, 2).code, 0);
  const std::vector<json> d = read_metrics(late);
  ASSERT_EQ(d.size(), 2u);
  EXPECT_EQ(d[0].at("comm_bytes").get<int64_t>(), compressed_step_bytes());
  // the reset errors change the update a little, not the training
  EXPECT_NEAR(d[1].at("loss").get<double>(), a[7].at("loss").get<double>(), 0.05 * a[7].at("loss").get<double>());
  // the same states as Adam's, another update: AdamW does not continue a OneBitAdam run
  json adamw = late_cfg;
  adamw["optimizer"] = tiny_config()["optimizer"];
  adamw["training"]["steps"] = 10;
  expect_one_line_rejection(run("train " + write_config("ob_e.json", adamw) + " --output " + temp_path("ob_adamw"), 2),
                            "saved with the OneBitAdam update rule");
}

}  // namespace
