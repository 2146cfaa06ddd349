// test_cli_onebit.cpp — the 1-bit optimizers through `zero3d train` (issue 34; DEEPSPEED-FACTS-2
// §5): DeepSpeed's assertions as validation errors, the phases seen in each step's data-parallel
// bytes (a full all-reduce while warming up, 1-bit all-reduces after it, nothing on 0/1 Adam's
// local steps), fp16 with dynamic loss scaling, and checkpoints (a resume before the freeze
// continues bit for bit; one after it stays compressed with fresh error buffers).
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

// --- ZeroOneAdam and OneBitLamb ----------------------------------------------------------------

json one_bit_config(const std::string& type, json params) {
  json c = tiny_config();
  params["lr"] = 2e-3;
  params["weight_decay"] = 0.01;
  c["optimizer"] = {{"type", type}, {"params", params}};
  c["training"]["steps"] = 10;
  return c;
}

// The tiny model's parameter count Ψ, and at W = 2 the bytes of one 1-bit all-reduce of the
// whole momentum as one flat buffer (1-bit Lamb): padded to a multiple of 16.
int64_t tiny_psi() {
  int64_t psi = 0;
  for (int64_t n : tiny_tensors()) psi += n;
  return psi;
}
int64_t flat_compressed_bytes() { return 2 * ((tiny_psi() + 15) / 16 * 16 / 8 / 2) + 2 * 4; }

TEST(ZeroOneAdamAndOneBitLamb, DeepSpeedsAssertionsAreValidationErrors) {
  for (const std::string type : {"ZeroOneAdam", "OneBitLamb"}) {
    json c = one_bit_config(type, json::object());
    c["zero_optimization"] = {{"stage", 2}};
    expect_one_line_rejection(run("validate " + write_config("z2.json", c)), "not compatible with ZeRO");
    c = one_bit_config(type, {{"amsgrad", true}});
    expect_one_line_rejection(run("validate " + write_config("ams.json", c)),
                              (type == "ZeroOneAdam" ? "0/1 Adam" : "1-bit Lamb") +
                                  std::string(" does not support the AMSGrad variant"));
    c = one_bit_config(type, {{"comm_backend_name", "gloo"}});
    expect_one_line_rejection(run("validate " + write_config("gloo.json", c)), "not one of DeepSpeed's 1-bit backends");
    c = one_bit_config(type, {{"freeze_steps", 3}});
    expect_one_line_rejection(run("validate " + write_config("typo.json", c)), "freeze_steps");
    c = one_bit_config(type, json::object());
    c["optimizer"]["type"] = type == "ZeroOneAdam" ? "zerooneadam" : "ONEBITLAMB";  // any case, as DeepSpeed
    const Result ok = run("validate " + write_config("case.json", c));
    EXPECT_EQ(ok.code, 0) << ok.err;
  }
  // a local-step ceiling of 0 would divide by zero in DeepSpeed once the interval grows
  expect_one_line_rejection(
      run("validate " + write_config("clip.json", one_bit_config("ZeroOneAdam", {{"local_step_clipper", 0}}))),
      "local_step_clipper");
  // OneBitLamb, as Lamb: dynamic loss scaling only; whole tensors; ordered clamps
  json c = one_bit_config("OneBitLamb", json::object());
  c["fp16"] = {{"enabled", true}, {"loss_scale", 128}};
  expect_one_line_rejection(run("validate " + write_config("static.json", c)), "needs dynamic loss scaling");
  expect_one_line_rejection(run("validate " + write_config("tp.json", one_bit_config("OneBitLamb", json::object())) +
                                " --world-size 2 --set tensor_parallel.autotp_size=2"),
                            "over whole tensors");
  expect_one_line_rejection(
      run("validate " + write_config("fac.json", one_bit_config("OneBitLamb", {{"factor_min", 5.0}}))),
      "must not exceed factor_max");
}

// 0/1 Adam at np 2 with var_freeze_step 6, var_update_scaler 2, local_step_scaler 2,
// local_step_clipper 2: the gradients are all-reduced (4Ψ bytes) on steps 1-4 and 6 (intervals 1,
// then 2), 1-bit all-reduced per tensor on steps 5 and 7, then local steps synchronise on 8, 9
// (interval 1), 10 and 12 (interval 2): on those a 1-bit all-reduce per tensor, on the local
// step 11 nothing but the ranks' overflow flag.
TEST(ZeroOneAdam, VarianceIntervalsThenLocalStepsInTheBytesOfEachStep) {
  json c = one_bit_config("ZeroOneAdam", {{"var_freeze_step", 6}, {"var_update_scaler", 2},
                                          {"local_step_scaler", 2}, {"local_step_clipper", 2}});
  c["training"]["steps"] = 12;
  const std::string dir = temp_path("zo_bytes");
  const Result r = run("train " + write_config("zo.json", c) + " --output " + dir, 2);
  ASSERT_EQ(r.code, 0) << r.err;
  const std::vector<json> rows = read_metrics(dir);
  ASSERT_EQ(rows.size(), 12u);
  for (int s = 1; s <= 12; ++s) {
    const int64_t bytes = rows[s - 1].at("comm_bytes").get<int64_t>();
    if (s <= 4 || s == 6) EXPECT_EQ(bytes, 4 * tiny_psi()) << "step " << s;
    else if (s == 11) EXPECT_EQ(bytes, 8) << "step " << s;
    else EXPECT_EQ(bytes, compressed_step_bytes()) << "step " << s;
  }
  EXPECT_LT(rows.back().at("loss").get<double>(), rows.front().at("loss").get<double>());
}

// 1-bit Lamb at np 2, freeze_step 3, fp16 with dynamic loss scaling: a step that overflows is
// skipped by every rank (the warm-up counts optimizer steps); LAMB warms up for three, then the
// momenta travel as one flat 1-bit all-reduce.
TEST(OneBitLamb, Fp16WithDynamicLossScalingWarmsUpThenCompressesTheFlatMomentum) {
  json c = one_bit_config("OneBitLamb", {{"freeze_step", 3}});
  c["fp16"] = {{"enabled", true}, {"initial_scale_power", 16}};
  c["training"]["steps"] = 14;
  const std::string dir = temp_path("lamb_fp16");
  const Result r = run("train " + write_config("lamb16.json", c) + " --output " + dir, 2);
  ASSERT_EQ(r.code, 0) << r.err;
  const std::vector<json> rows = read_metrics(dir);
  ASSERT_EQ(rows.size(), 14u);
  int optimizer_steps = 0, compressed = 0;
  for (const json& row : rows) {
    const int64_t bytes = row.at("comm_bytes").get<int64_t>();
    const bool skipped = row.at("skipped").get<bool>();
    const bool warm = optimizer_steps < 3;  // optimizer steps 1-3 average the fp16 gradients (2Ψ bytes)
    if (skipped) EXPECT_EQ(bytes, warm ? 2 * tiny_psi() : 8) << row.dump();  // compressed: the overflow flag only
    else EXPECT_EQ(bytes, warm ? 2 * tiny_psi() : flat_compressed_bytes() + 8) << row.dump();
    if (!skipped) ++optimizer_steps, compressed += warm ? 0 : 1;
    EXPECT_TRUE(std::isfinite(row.at("loss").get<double>()));
  }
  EXPECT_GT(compressed, 5);
  EXPECT_LT(rows.back().at("loss").get<double>(), rows.front().at("loss").get<double>());
}

TEST(ZeroOneAdam, Fp16WithDynamicLossScalingTrains) {
  json c = one_bit_config("ZeroOneAdam", {{"var_freeze_step", 4}});
  c["fp16"] = {{"enabled", true}, {"initial_scale_power", 16}};
  c["training"]["steps"] = 14;
  const std::string dir = temp_path("zo_fp16");
  const Result r = run("train " + write_config("zo16.json", c) + " --output " + dir, 2);
  ASSERT_EQ(r.code, 0) << r.err;
  const std::vector<json> rows = read_metrics(dir);
  ASSERT_EQ(rows.size(), 14u);
  for (const json& row : rows) EXPECT_TRUE(std::isfinite(row.at("loss").get<double>()));
  EXPECT_LT(rows.back().at("loss").get<double>(), rows.front().at("loss").get<double>());
  EXPECT_NE(r.out.find("optim   ZeroOneAdam: step 1 initialises"), std::string::npos) << r.out;
}

// A resume at step 4 continues bit for bit where nothing compressed had an error to lose (0/1
// Adam: its first var_update_scaler variance steps; 1-bit Lamb: its warm-up, through the freeze
// to the step where the reset lamb_coeff_freeze — DeepSpeed's load during warm-up — first
// scales an update); a resume later stays in its phase with fresh errors.
TEST(ZeroOneAdamAndOneBitLamb, CheckpointsResumeInTheirPhase) {
  for (const std::string type : {"ZeroOneAdam", "OneBitLamb"}) {
    const json params = type == "ZeroOneAdam" ? json{{"var_freeze_step", 6}, {"var_update_scaler", 8}}
                                              : json{{"freeze_step", 6}};
    json c = one_bit_config(type, params);
    const std::string whole = temp_path(type + "_whole"), ckpt = temp_path(type + "_ckpt");
    ASSERT_EQ(run("train " + write_config("w.json", c) + " --output " + whole, 2).code, 0);
    c["training"]["save_interval"] = 4;
    c["training"]["save_dir"] = ckpt;
    c["training"]["steps"] = 4;
    ASSERT_EQ(run("train " + write_config("a.json", c) + " --output " + temp_path(type + "_first"), 2).code, 0);
    c["training"]["steps"] = 10;
    c["training"]["resume"] = "auto";
    const std::string resumed = temp_path(type + "_resumed");
    const Result r = run("train " + write_config("b.json", c) + " --output " + resumed, 2);
    ASSERT_EQ(r.code, 0) << r.err;
    const std::vector<json> a = read_metrics(whole), b = read_metrics(resumed);
    ASSERT_EQ(a.size(), 10u);
    ASSERT_EQ(b.size(), 6u);
    // 0/1 Adam: bit for bit through the freeze (errors are zeroed there anyway); 1-bit Lamb: the
    // losses of steps 5-7 (parameters of steps 4-6, warm-up) bit for bit, then close
    const size_t exact = type == "ZeroOneAdam" ? 6 : 3;
    for (size_t s = 0; s < b.size(); ++s) {
      if (s < exact) EXPECT_EQ(b[s].at("loss").get<double>(), a[s + 4].at("loss").get<double>()) << type << " step " << s + 5;
      else EXPECT_NEAR(b[s].at("loss").get<double>(), a[s + 4].at("loss").get<double>(), 0.05 * a[s + 4].at("loss").get<double>());
      EXPECT_EQ(b[s].at("comm_bytes"), a[s + 4].at("comm_bytes")) << type << " step " << s + 5;
    }
    // the states differ from Adam's/Lamb's or the update does: resumed only as the same optimizer
    json other = c;
    other["optimizer"] = type == "ZeroOneAdam" ? json{{"type", "OneBitAdam"}} : json{{"type", "Lamb"}};
    other["training"]["steps"] = 12;
    expect_one_line_rejection(run("train " + write_config("o.json", other) + " --output " + temp_path("o"), 2),
                              "saved with");
  }
}

}  // namespace
