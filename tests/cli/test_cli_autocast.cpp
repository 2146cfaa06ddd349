// torch_autocast (seed API docs, "PyTorch Automatic Mixed Precision"; issue 35), black-box:
// fp32 parameters and optimizer, the matrix products in the autocast dtype, the listed modules'
// gradients reduced (and at ZeRO-3 their parameters gathered) in it, torch's GradScaler with
// fp16; never together with the bf16 or fp16 sections.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "support/cli_helpers.hpp"

using namespace cli;

namespace {

json autocast_config(const json& autocast) {
  json j = tiny_config();
  j["torch_autocast"] = autocast;
  return j;
}

// Linear parameters of the tiny model (C 32, L 2): per block c_attn 3C²+3C, attn.c_proj C²+C,
// c_fc 4C²+4C, mlp.c_proj 4C²+C.
constexpr int64_t kC = 32, kLinear = 2 * (12 * kC * kC + 9 * kC);

TEST(TorchAutocast, CannotBeCombinedWithTheBf16OrFp16Section) {
  for (const char* section : {"bf16", "fp16"}) {
    json j = autocast_config({{"enabled", true}});
    j[section] = {{"enabled", true}};
    const Result r = run("validate " + write_config("autocast_mixed.json", j));
    expect_one_line_rejection(r, "`torch_autocast.enabled`: cannot be combined with " + std::string(section) +
                                     ".enabled");
    EXPECT_NE(r.err.find("Cannot enable both torch autocast"), std::string::npos) << r.err;
  }
}

TEST(TorchAutocast, RefusesWhatItCannotMap) {
  expect_one_line_rejection(
      run("validate " + write_config("autocast_dtype.json", autocast_config({{"enabled", true}, {"dtype", "int8"}}))),
      "`torch_autocast.dtype`");
  expect_one_line_rejection(
      run("validate " + write_config("autocast_mod.json",
                                     autocast_config({{"enabled", true},
                                                      {"lower_precision_safe_modules", {"my.pkg.FancyLinear"}}}))),
      "`torch_autocast.lower_precision_safe_modules`");
}

// The communicated bytes show the 16-bit reduction: at ZeRO 0 on 2 ranks (an all-reduce moves
// its message once per rank, bus factor 2(W−1)/W = 1) a step moves exactly 2 bytes less per
// linear parameter than fp32, the default list [torch.nn.Linear, ...] being this model's
// projections; an empty list moves what fp32 moves; the parameters stay fp32 (4 bytes each).
TEST(TorchAutocast, LinearGradientsAreReducedInTheAutocastDtype) {
  const std::string fp32 = write_config("ac_fp32.json", tiny_config());
  const json base = last_metrics(fp32, 2, temp_path("ac_fp32"), "");
  const json linear = last_metrics(write_config("ac_bf16.json", autocast_config({{"enabled", true}, {"dtype", "bfloat16"}})),
                                   2, temp_path("ac_bf16"), "");
  const json none = last_metrics(
      write_config("ac_none.json", autocast_config({{"enabled", true}, {"lower_precision_safe_modules", json::array()}})),
      2, temp_path("ac_none"), "");
  const auto data = [](const json& m) { return m.at("comm_bytes_by_axis").at("data").get<int64_t>(); };
  EXPECT_EQ(data(base) - data(linear), 2 * kLinear);
  EXPECT_EQ(data(none), data(base));
  EXPECT_EQ(linear.at("memory").at("params"), base.at("memory").at("params"));
  EXPECT_EQ(linear.at("memory").at("master"), 0);
  // the products ran in bf16: the losses are near fp32's, not equal
  EXPECT_NE(linear.at("loss").get<double>(), base.at("loss").get<double>());
  EXPECT_NEAR(linear.at("loss").get<double>(), base.at("loss").get<double>(), 2e-2 * base.at("loss").get<double>());
}

// At ZeRO-3 the listed modules' parameters are gathered in bf16 as well: on 2 ranks each
// element's gradient is reduce-scattered (bus factor 1/2) and its parameter gathered once a step
// (1/2, units kept within the step by default), so the step moves 2 bytes less per linear
// parameter than fp32 at ZeRO-3 (1 byte if only the gradients were 16-bit); the losses are
// autocast's at stage 0 (the products round the weights to bf16 either way).
TEST(TorchAutocast, Zero3GathersTheLinearParametersInTheAutocastDtype) {
  const json ac = {{"enabled", true}};
  json j = autocast_config(ac);
  const std::string config = write_config("ac_z.json", j);
  const std::string fp32 = write_config("ac_z_fp32.json", tiny_config());
  const json base3 = last_metrics(fp32, 2, temp_path("ac_z3_fp32"), "--set zero_optimization.stage=3");
  const std::string dir0 = temp_path("ac_z0"), dir3 = temp_path("ac_z3");
  last_metrics(config, 2, dir0, "--set zero_optimization.stage=0");
  const json last3 = last_metrics(config, 2, dir3, "--set zero_optimization.stage=3");
  EXPECT_EQ(base3.at("comm_bytes_by_axis").at("data").get<int64_t>() - last3.at("comm_bytes_by_axis").at("data").get<int64_t>(),
            2 * kLinear);
  expect_losses_close(losses_of(read_metrics(dir3)), losses_of(read_metrics(dir0)), 1e-5, "autocast stage 3 vs 0");
}

// Where autocast and the bf16 path compute the same thing they agree: from weights that bf16
// holds exactly (a checkpoint converted to bf16), with every module listed (all gradients
// reduced in bf16) against bf16 with fp32 gradient accumulation, step 1's loss is equal bit for
// bit, its gradient norm to rounding (LayerNorm's backward sums its fp32 weights in another
// vector order than the bf16 ones: 2e-7 relative on one rank, 7e-6 once the bf16 reduction
// rounds the gradients), and at ZeRO 0 the bytes reduced are the same. (From step 2 on the bf16 path also rounds the updated LayerNorm weights and
// embeddings, which autocast keeps in fp32; at ZeRO 1-2 it gathers 16-bit parameters after the
// step, autocast its fp32 ones.)
TEST(TorchAutocast, EqualsTheBf16PathWhereTheyCoincide) {
  json j = tiny_config();
  j["training"]["save_interval"] = 1;
  j["training"]["steps"] = 1;
  const std::string seed_dir = temp_path("ac_seed");
  ASSERT_EQ(run("train " + write_config("ac_seed.json", j) + " --output " + seed_dir).code, 0);
  const std::string weights = temp_path("ac_seed_bf16.safetensors");
  const Result c = run("convert " + seed_dir + "/checkpoints " + weights + " --dtype bf16");
  ASSERT_EQ(c.code, 0) << c.err;
  json start = tiny_config();
  start["model"]["init_from"] = weights;
  start["training"]["steps"] = 2;
  json autocast = start;
  autocast["torch_autocast"] = {{"enabled", true},
                                {"dtype", "bf16"},
                                {"lower_precision_safe_modules",
                                 {"torch.nn.Linear", "torch.nn.Embedding", "torch.nn.LayerNorm"}}};
  json bf16 = start;
  bf16["bf16"] = {{"enabled", true}};
  bf16["data_types"] = {{"grad_accum_dtype", "fp32"}};
  for (int stage : {0, 2}) {
    const std::string s = "--set zero_optimization.stage=" + std::to_string(stage);
    const std::string da = temp_path("ac_eq_autocast" + std::to_string(stage)), db = temp_path("ac_eq_bf16" + std::to_string(stage));
    last_metrics(write_config("ac_eq_a.json", autocast), 2, da, s);
    last_metrics(write_config("ac_eq_b.json", bf16), 2, db, s);
    const std::vector<json> a = read_metrics(da), b = read_metrics(db);
    ASSERT_EQ(a.size(), 2u);
    ASSERT_EQ(b.size(), 2u);
    EXPECT_EQ(a[0]["loss"].get<double>(), b[0]["loss"].get<double>()) << "stage " << stage;
    EXPECT_NEAR(a[0]["grad_norm"].get<double>(), b[0]["grad_norm"].get<double>(), 2e-5 * b[0]["grad_norm"].get<double>())
        << "stage " << stage;
    if (stage == 0) {
      EXPECT_EQ(a[0]["comm_bytes_by_axis"]["data"], b[0]["comm_bytes_by_axis"]["data"]);
    }
  }
}

// fp16: torch's GradScaler (DeepSpeed's engine creates one): the loss is scaled by 2^16 from the
// start, and the products run on fp16-rounded operands.
TEST(TorchAutocast, Fp16ScalesTheLossWithGradScaler) {
  const std::string dir = temp_path("ac_fp16");
  const json last = last_metrics(write_config("ac_fp16.json", autocast_config({{"enabled", true}, {"dtype", "float16"}})),
                                 1, dir, "");
  const std::vector<json> rows = read_metrics(dir);
  ASSERT_FALSE(rows.empty());
  EXPECT_EQ(rows.front().at("loss_scale").get<double>(), 65536.0);
  const json fp32 = last_metrics(write_config("ac_fp16_base.json", tiny_config()), 1, temp_path("ac_fp16_base"), "");
  EXPECT_NE(last.at("loss").get<double>(), fp32.at("loss").get<double>());
  EXPECT_NEAR(last.at("loss").get<double>(), fp32.at("loss").get<double>(), 1e-2 * fp32.at("loss").get<double>());
}

}  // namespace
