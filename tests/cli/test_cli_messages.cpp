// test_cli_messages.cpp — messages and words that disagreed with the program (issue 35): one
// error prefix, one watchdog line for one stalled rank, options that were silently ignored, the
// defaults a config leaves to zero3d, the layout and offload tiers as estimate prints them,
// --set key=null, "did you mean" across sections, --version's commit, 1e400's position and the
// scheduler keys where DeepSpeed's behaviour is followed.
#include <gtest/gtest.h>

#include <regex>
#include <string>

#include "support/background_job.hpp"
#include "support/cli_helpers.hpp"

using namespace cli;

namespace {

std::string tiny_path() { return write_config("messages_tiny.json", tiny_config()); }

std::string write_text(const std::string& name, const std::string& text) {
  const std::string path = temp_path(name);
  std::ofstream(path, std::ios::binary) << text;
  return path;
}

// ---- Messages -----------------------------------------------------------------------------

// A one-process command names no rank: "zero3d: error:", as validate and train do.
TEST(Messages, OneProcessCommandsUseTheOneErrorPrefix) {
  const std::string missing = temp_path("messages_no_such_checkpoint");
  for (const std::string& args :
       {"inspect " + missing, "convert " + missing + " " + temp_path("m.safetensors"),
        "estimate --config " + temp_path("messages_missing.json"), std::string("topology --pp 1024 --dp 1024 --tp 2"),
        "validate " + temp_path("messages_missing.json")}) {
    SCOPED_TRACE(args);
    const Result r = run(args);
    EXPECT_EQ(r.code, 2) << r.err;
    EXPECT_EQ(r.err.rfind("zero3d: error: ", 0), 0u) << r.err;
    EXPECT_EQ(r.err.find("rank 0"), std::string::npos) << r.err;
  }
}

// One stalled rank of four: the three that wait for it time out together, and one line says so
// (no MPICH abort line after it).
TEST(Messages, TheWatchdogAtFourRanksPrintsOneLineForOneStalledRank) {
  json j = tiny_config();
  j["train_batch_size"] = 16;
  j["training"]["steps"] = 5;
  j["training"]["comms_timeout"] = 3;
  BackgroundJob job("messages_watchdog", j, "ZERO3D_FAULT=stall:1:2", 4);
  const int rc = job.wait(110);
  const std::string err = read_file(job.err_file);
  EXPECT_EQ(rc, 1) << err;
  EXPECT_EQ(count(err, "(training.comms_timeout 3.0 s)"), 1u) << err;
  EXPECT_EQ(count(err, "\n"), 1u) << err;
  EXPECT_EQ(err.find("MPI_Abort"), std::string::npos) << err;
}

// An empty size is a bad size, not an absent option.
TEST(Messages, AnEmptyMemoryPerRankIsRefused) {
  for (const std::string& cmd : {"estimate --config " + tiny_path() + " --memory-per-rank ''",
                                 "autotune " + tiny_path() + " --memory-per-rank ''"}) {
    SCOPED_TRACE(cmd);
    expect_one_line_rejection(run(cmd), "--memory-per-rank \"\"");
  }
}

// ---- Words that disagree with the program ---------------------------------------------------

// A config with no model or data section trains zero3d's defaults, and says so at start-up; the
// README gives the same default model (and no longer calls input/quickstart.json the default).
TEST(Words, AConfigWithoutModelOrDataSaysItTrainsTheDefaults) {
  json j = tiny_config();
  j.erase("model");
  const std::string cfg = write_config("messages_no_model.json", j);
  const Result r = run("validate " + cfg);
  ASSERT_EQ(r.code, 0) << r.err;
  const std::string model = "(vocab_size 256, n_positions 256, n_layer 2, n_head 2, n_embd 64)";
  EXPECT_NE(r.out.find("no `model` section in " + cfg + ": the default GPT " + model), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("no `data` section in " + cfg + ": the built-in synthetic data"), std::string::npos) << r.out;
  const std::string readme = slurp(kSource + "/README.md");
  EXPECT_NE(readme.find(model), std::string::npos) << "README does not give the default model";
  // A config that has both sections says neither.
  const Result full = run("validate " + kSource + "/input/quickstart.json");
  ASSERT_EQ(full.code, 0) << full.err;
  EXPECT_EQ(full.out.find("section in"), std::string::npos) << full.out;
}

// The built-in quick-start (train with no config) is input/quickstart.json, key for key.
TEST(Words, TheBuiltInQuickStartIsInputQuickstartJson) {
  const std::string a = temp_path("messages_builtin"), b = temp_path("messages_file");
  ASSERT_EQ(run("train --output " + a + " --set training.steps=1").code, 0);
  ASSERT_EQ(run("train " + kSource + "/input/quickstart.json --output " + b + " --set training.steps=1").code, 0);
  json ca = json::parse(slurp(a + "/config.json")), cb = json::parse(slurp(b + "/config.json"));
  for (json* c : {&ca, &cb}) (*c)["training"].erase("output_dir"), (*c)["training"].erase("save_dir");
  EXPECT_EQ(ca, cb);
}

// estimate --config with offload: device, host and NVMe rows and the device-only total.
TEST(Words, EstimateWithOffloadShowsWhereTheBytesLive) {
  json j = tiny_config();
  j["zero_optimization"] = {{"stage", 2}, {"offload_optimizer", {{"device", "cpu"}}}};
  const Result r = run("estimate --config " + write_config("messages_offload.json", j) + " --world-size 2");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("  in device memory"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("  in host memory"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("(in NVMe swap files)"), std::string::npos) << r.out;
  const Result js = run("estimate --config " + write_config("messages_offload.json", j) + " --world-size 2 --json");
  ASSERT_EQ(js.code, 0) << js.err;
  const json b = json::parse(js.out)["budgets"][2];
  EXPECT_GT(b["host"].get<int64_t>(), 0);
  EXPECT_EQ(b["device_total"].get<int64_t>(), b["total"].get<int64_t>() - b["host"].get<int64_t>());
  // Without offload nothing changes.
  const Result plain = run("estimate --config " + tiny_path() + " --world-size 2");
  EXPECT_EQ(plain.out.find("in host memory"), std::string::npos) << plain.out;
}

// validate names the whole layout, as estimate does.
TEST(Words, ValidatePrintsTheWholeLayout) {
  json j = tiny_config();
  j["pipeline"] = {{"stages", 2}};
  j["tensor_parallel"] = {{"autotp_size", 2}};
  j["train_batch_size"] = 4;
  j["train_micro_batch_size_per_gpu"] = 2;
  const Result r = run("validate " + write_config("messages_3d.json", j) + " --world-size 4");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("valid for 4 ranks = 2 pipeline stages x 1 data-parallel x 2 tensor-parallel"),
            std::string::npos) << r.out;
  const Result one = run("validate " + tiny_path());
  EXPECT_NE(one.out.find("valid for 1 rank = 1 pipeline stage x 1 data-parallel x 1 tensor-parallel"),
            std::string::npos) << one.out;
}

// --set key=null takes the key out of the config: a section switches off from the command line.
TEST(Words, SetNullSwitchesASectionOff) {
  json j = tiny_config();
  j["fp16"] = {{"enabled", true}};
  j["scheduler"] = {{"type", "NoSuchScheduler"}};
  const std::string cfg = write_config("messages_null.json", j);
  EXPECT_EQ(run("validate " + cfg).code, 2);
  const std::string dir = temp_path("messages_null_run");
  const Result r = run("train " + cfg + " --output " + dir + " --set scheduler=null --set fp16=null --set training.steps=1 "
                       "--set optimizer.params.lr=null --set no_such_section.key=null");
  ASSERT_EQ(r.code, 0) << r.err;
  const json resolved = json::parse(slurp(dir + "/config.json"));
  EXPECT_FALSE(resolved.contains("scheduler") && resolved["scheduler"].contains("type")) << resolved.dump();
  EXPECT_EQ(resolved["fp16"]["enabled"], false);
  EXPECT_EQ(resolved.contains("no_such_section"), false);
}

// A key of another section given at the top level is pointed to its section.
TEST(Words, TopLevelNPositionsSuggestsModelNPositions) {
  json j = tiny_config();
  j["n_positions"] = 64;
  const Result r = run("validate " + write_config("messages_top.json", j));
  expect_one_line_rejection(r, "`n_positions`: unknown key (did you mean `model.n_positions`?)");
}

// validate takes --output and checks it as train would.
TEST(Words, ValidateTakesOutput) {
  const std::string foreign = temp_path("messages_foreign_out");
  std::system(("mkdir -p " + foreign).c_str());
  std::ofstream(foreign + "/metrics.jsonl") << "{}\n";
  expect_one_line_rejection(run("validate " + tiny_path() + " --output " + foreign), foreign);
  const Result ok = run("validate " + tiny_path() + " --output " + temp_path("messages_fresh_out"));
  EXPECT_EQ(ok.code, 0) << ok.err;
}

// --version names the commit the build was configured from (or "unknown" without git), then the backend.
TEST(Words, VersionNamesTheCommit) {
  const Result r = run("--version");
  ASSERT_EQ(r.code, 0) << r.err;
  std::smatch m;
  ASSERT_TRUE(std::regex_search(r.out, m, std::regex(R"(^zero3d \d+\.\d+\.\d+ \(commit ([0-9a-f]{7,40}|unknown); .+\)\n$)")))
      << r.out;
  if (m[1] != "unknown" && std::system(("git -C " + kSource + " rev-parse >/dev/null 2>&1").c_str()) == 0) {
    EXPECT_EQ(std::system(("git -C " + kSource + " cat-file -e " + std::string(m[1]) + "^{commit}").c_str()), 0)
        << m[1] << " is no commit of this repository";
  }
}

// 1e400 is named by line:column and key, as a syntax error is.
TEST(Words, ANumberBeyondDoubleNamesLineColumnAndKey) {
  const std::string f = write_text("messages_1e400.json", "{\n  \"train_batch_size\": 1e400\n}\n");
  expect_one_line_rejection(run("validate " + f), f + ":2:23: `train_batch_size`: 1e400 is beyond the range of a double");
  const std::string g = write_text("messages_betas.json", "{\"train_batch_size\": 8,\n \"optimizer\": {\"params\": "
                                                          "{\"betas\": [0.9, -1e999]}}}");
  expect_one_line_rejection(run("validate " + g), g + ":2:42: `optimizer.params.betas[1]`: -1e999 is beyond");
}

// ---- Scheduler keys: DeepSpeed's behaviour, said at start-up -------------------------------

std::vector<double> lrs(const std::string& config, const std::string& name, const std::string& sets) {
  const std::string dir = temp_path(name);
  const Result r = run("train " + config + " --output " + dir + " --set training.steps=4 " + sets);
  EXPECT_EQ(r.code, 0) << r.err;
  std::vector<double> out;
  for (const json& row : read_metrics(dir)) out.push_back(row.at("lr").get<double>());
  return out;
}

json warmup_config(const char* type) {
  json j = tiny_config();
  j["scheduler"] = {{"type", type},
                    {"params", {{"warmup_min_lr", 0.0}, {"warmup_max_lr", 1e-3}, {"warmup_num_steps", 3},
                                {"total_num_steps", 4}}}};
  return j;
}

// warmup_num_steps 0 warms up over max(2, 0) steps as DeepSpeed does, and the start-up says so.
TEST(Scheduler, WarmupOfZeroStepsIsDeepSpeedsTwoAndSaidSo) {
  const Result r = run("validate " + write_config("messages_w0.json", warmup_config("WarmupDecayLR")) +
                       " --set scheduler.params.warmup_num_steps=0");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("scheduler.params.warmup_num_steps = 0: the warm-up takes max(2, 0) = 2 steps, as in DeepSpeed"),
            std::string::npos) << r.out;
}

// A one-element list is DeepSpeed's one value per parameter group: zero3d's one group.
TEST(Scheduler, AOneElementLrListIsTheValueOfTheOneParameterGroup) {
  const std::string cfg = write_config("messages_list.json", warmup_config("WarmupDecayLR"));
  const std::vector<double> scalar = lrs(cfg, "messages_lr_scalar", "");
  const std::vector<double> list = lrs(cfg, "messages_lr_list", "--set scheduler.params.warmup_max_lr=[1e-3] "
                                                                "--set scheduler.params.warmup_min_lr=[0]");
  ASSERT_EQ(scalar.size(), 4u);
  EXPECT_EQ(list, scalar);
  expect_one_line_rejection(run("validate " + cfg + " --set scheduler.params.warmup_max_lr=[1e-3,2e-3]"),
                            "`scheduler.params.warmup_max_lr`: expected a number or a list of one");
}

// An unknown warmup_type: WarmupLR/WarmupDecayLR warm up by "log" with a warning, as DeepSpeed;
// WarmupCosineLR would fail at DeepSpeed's first step, so it is refused at start-up saying why.
TEST(Scheduler, AnUnknownWarmupTypeFollowsDeepSpeed) {
  const std::string cfg = write_config("messages_wt.json", warmup_config("WarmupDecayLR"));
  const std::vector<double> log = lrs(cfg, "messages_wt_log", "--set scheduler.params.warmup_type=log");
  const std::string dir = temp_path("messages_wt_unknown");
  const Result r =
      run("train " + cfg + " --output " + dir + " --set training.steps=4 --set scheduler.params.warmup_type=Linear");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("scheduler.params.warmup_type = \"Linear\" is not \"log\" or \"linear\": the warm-up is \"log\""),
            std::string::npos) << r.out;
  std::vector<double> unknown;
  for (const json& row : read_metrics(dir)) unknown.push_back(row.at("lr").get<double>());
  EXPECT_EQ(unknown, log);
  json cosine = tiny_config();
  cosine["scheduler"] = {{"type", "WarmupCosineLR"}, {"params", {{"warmup_type", "Linear"}}}};
  expect_one_line_rejection(run("validate " + write_config("messages_wt_cos.json", cosine)),
                            "`scheduler.params.warmup_type`: value \"Linear\" is not \"log\" or \"linear\": DeepSpeed's "
                            "WarmupCosineLR accepts it and then fails at its first step (UnboundLocalError)");
}

}  // namespace
