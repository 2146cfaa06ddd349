// test_cli.cpp — the zero3d executable as users run it: exit codes, one message for bad
// input (also under mpiexec -np 2), files of a run, and multi-rank training behaviour.
#include <gtest/gtest.h>
#include <hdf5.h>
#include <sys/wait.h>

#include <cmath>
#include <cstdlib>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "kernels/device.hpp"
#include "support/cli_helpers.hpp"

using json = nlohmann::json;
using namespace cli;

namespace {

TEST(Cli, VersionFlagPrintsTheVersionAndTheBackend) {
  Result r = run("--version");
  EXPECT_EQ(r.code, 0);
  EXPECT_NE(r.out.find("zero3d "), std::string::npos);
  EXPECT_NE(r.out.find(zero3d::kernels::backend_name()), std::string::npos) << r.out;  // "CPU: Kokkos Serial, ..." here
}

TEST(Cli, ValidateAcceptsTheQuickstartAtWorldSizeTwo) {
  Result r = run("validate " + kSource + "/input/quickstart.json --world-size 2");
  EXPECT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("gradient_accumulation_steps"), std::string::npos);
}

TEST(Cli, ValidateRejectsABatchThatDoesNotFitTheWorldSize) {
  Result r = run("validate " + kSource + "/input/quickstart.json --world-size 3");
  EXPECT_EQ(r.code, 2);
  // (16 // 8) // 3 = 0 accumulation steps, as DeepSpeed derives it
  EXPECT_NE(r.err.find("gradient_accumulation_steps"), std::string::npos) << r.err;
}

TEST(Cli, UnknownKeyExitsTwoWithOneLineNamingFileAndKey) {
  json j = tiny_config();
  j["gradient_clipin"] = 1.0;
  const std::string path = write_config("unknown_key.json", j);
  Result r = run("validate " + path);
  EXPECT_EQ(r.code, 2);
  EXPECT_EQ(count(r.err, "\n"), 1u) << r.err;
  EXPECT_NE(r.err.find(path), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("did you mean `gradient_clipping`"), std::string::npos) << r.err;
}

// A key the file does not hold is named as the command line's: `--set foo.bar=1` is not a
// problem the user can find in the file.
TEST(Cli, AProblemWithAKeyGivenBySetNamesTheSet) {
  const std::string path = write_config("set_key.json", tiny_config());
  const Result r = run("validate " + path + " --set foo.bar=1");
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.err.find("`foo`: unknown key"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("(given by --set foo.bar)"), std::string::npos) << r.err;
  const Result value = run("validate " + path + " --set optimizer.params.lr=-1");
  EXPECT_NE(value.err.find("`optimizer.params.lr`: value -1"), std::string::npos) << value.err;
  EXPECT_NE(value.err.find("(given by --set optimizer.params.lr)"), std::string::npos) << value.err;
  json j = tiny_config();
  j["gradient_clipin"] = 1.0;  // a problem in the file itself is not attributed to an unrelated --set
  const Result file = run("validate " + write_config("set_key2.json", j) + " --set training.steps=3");
  EXPECT_EQ(file.err.find("given by --set"), std::string::npos) << file.err;
}

TEST(Cli, BadConfigOnTwoRanksIsReportedOnce) {
  json j = tiny_config();
  j["optimizer"]["params"]["lr"] = "fast";
  const std::string path = write_config("bad_type.json", j);
  Result r = run("train " + path + " --output " + temp_path("never"), 2);
  EXPECT_EQ(r.code, 2);
  EXPECT_EQ(count(r.err, "optimizer.params.lr"), 1u) << r.err;
  EXPECT_EQ(r.err.find("terminate"), std::string::npos) << r.err;
}

TEST(Cli, SyntaxErrorReportsLineAndColumn) {
  const std::string path = temp_path("syntax.json");
  std::ofstream(path) << "{\n  \"train_batch_size\": 8,\n  \"optimizer\": {\"type\": }\n}\n";
  Result r = run("validate " + path);
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.err.find(path + ":3:"), std::string::npos) << r.err;
}

TEST(Cli, MissingConfigFileExitsTwoNamingIt) {
  Result r = run("validate /nonexistent/zero3d.json");
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.err.find("/nonexistent/zero3d.json"), std::string::npos);
}

TEST(Cli, UnknownOptionExitsTwo) { EXPECT_EQ(run("train --no-such-flag").code, 2); }

TEST(Cli, SetOverridesAKeyOnTheCommandLine) {
  // Both overrides apply: 12 != 5 * 2 * 1.
  Result r = run("validate " + write_config("set.json", tiny_config()) +
                 " --set train_batch_size=12 --set train_micro_batch_size_per_gpu=5 --world-size 1 "
                 "--set gradient_accumulation_steps=2");
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.err.find("12 != 5 * 2 * 1"), std::string::npos) << r.err;
}

TEST(Cli, TrainWritesOneMetricsRecordPerStepAndTheResolvedConfig) {
  json j = tiny_config();
  j["wall_clock_breakdown"] = true;
  const std::string dir = temp_path("run_metrics");
  Result r = run("train " + write_config("metrics.json", j) + " --output " + dir, 2);
  ASSERT_EQ(r.code, 0) << r.err;
  const auto rows = read_metrics(dir);
  ASSERT_EQ(rows.size(), 5u);
  for (const char* key : {"step", "loss", "lr", "grad_norm", "tokens_per_s", "mfu", "elapsed_ms", "time_ms"})
    EXPECT_TRUE(rows[0].contains(key)) << key;
  for (const char* key : {"forward", "backward", "backward_inner", "backward_allreduce", "step"})
    EXPECT_TRUE(rows[0]["time_ms"].contains(key)) << key;
  EXPECT_EQ(rows[4]["step"], 5);
  const json resolved = json::parse(slurp(dir + "/config.json"));
  EXPECT_EQ(resolved["gradient_accumulation_steps"], 1);
  EXPECT_EQ(resolved["optimizer"]["params"]["eps"], 1e-8);
  EXPECT_EQ(resolved["training"]["output_dir"], dir);
}

TEST(Cli, TwoDataParallelRanksMatchOneRankAccumulatingTwoMicroBatches) {
  const std::string one = temp_path("dp_one"), two = temp_path("dp_two");
  json j = tiny_config();
  const std::string path = write_config("dp.json", j);
  ASSERT_EQ(run("train " + path + " --output " + two, 2).code, 0);
  ASSERT_EQ(run("train " + path + " --set gradient_accumulation_steps=2 --output " + one, 1).code, 0);
  const auto a = read_metrics(one), b = read_metrics(two);
  ASSERT_EQ(a.size(), 5u);
  ASSERT_EQ(b.size(), 5u);
  for (size_t i = 0; i < a.size(); ++i) {
    const double la = a[i]["loss"], lb = b[i]["loss"];
    EXPECT_NEAR(la, lb, 1e-5 * std::fabs(la)) << "step " << i + 1;
  }
}

TEST(Cli, QuickstartOnTwoRanksLearnsWellBelowLnV) {
  const std::string dir = temp_path("quickstart");
  Result r = run("train " + kSource + "/input/quickstart.json --set training.steps=80 --output " + dir, 2);
  ASSERT_EQ(r.code, 0) << r.err;
  const auto rows = read_metrics(dir);
  ASSERT_EQ(rows.size(), 80u);
  const double first = rows.front()["loss"], last = rows.back()["loss"];
  EXPECT_GT(first, 0.9 * std::log(256.0));
  EXPECT_LT(last, 0.5 * std::log(256.0)) << "loss did not fall: " << first << " -> " << last;
}

TEST(Cli, TextFileTrainsByteLevel) {
  const std::string text = temp_path("corpus.txt");
  {
    std::ofstream out(text);
    for (int i = 0; i < 200; ++i) out << "the quick brown fox jumps over the lazy dog. ";
  }
  json j = tiny_config();
  j["model"]["vocab_size"] = 256;
  j["data"] = {{"source", "text"}, {"path", text}};
  Result r = run("train " + write_config("text.json", j) + " --output " + temp_path("text_run"), 1);
  EXPECT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("byte-level text"), std::string::npos);
}

TEST(Cli, InitFromMissingFileExitsTwoNamingIt) {
  json j = tiny_config();
  j["model"]["init_from"] = "/nonexistent/weights.h5";
  Result r = run("train " + write_config("init_missing.json", j) + " --output " + temp_path("init_missing"), 1);
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.err.find("/nonexistent/weights.h5"), std::string::npos) << r.err;
}

TEST(Cli, InitFromWithWrongShapesNamesTheTensor) {
  json j = tiny_config();
  j["model"]["n_embd"] = 48;  // the golden file has n_embd 32
  j["model"]["n_head"] = 2;
  j["model"]["init_from"] = kSource + "/tests/golden/gpt_tiny.h5";
  Result r = run("train " + write_config("init_shape.json", j) + " --output " + temp_path("init_shape"), 1);
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.err.find("wte.weight"), std::string::npos) << r.err;
}

// --- data parallelism (issue 3) --------------------------------------------------------------

std::vector<double> losses_of(const std::string& dir) {
  std::vector<double> out;
  for (const auto& row : read_metrics(dir)) out.push_back(row["loss"].get<double>());
  return out;
}

struct Layout {
  int np, gas;
  bool overlap;
  int64_t bucket;
};
void PrintTo(const Layout& l, std::ostream* os) {
  *os << "np " << l.np << " x GAS " << l.gas << (l.overlap ? ", overlap_comm" : "") << ", bucket " << l.bucket;
}

class SameGlobalBatch : public ::testing::TestWithParam<Layout> {};

// Global batch 8 = micro-batch 2 x GAS x np: every layout sees the same samples per step.
TEST_P(SameGlobalBatch, GivesTheLossesOfOneRankAccumulatingFourMicroBatches) {
  const Layout l = GetParam();
  json j = tiny_config();
  j["train_batch_size"] = 8;
  j["train_micro_batch_size_per_gpu"] = 2;
  j["training"]["steps"] = 10;
  const std::string path = write_config("equiv.json", j);
  static std::vector<double> reference;
  if (reference.empty()) {
    ASSERT_EQ(run("train " + path + " --output " + temp_path("equiv_ref"), 1).code, 0);
    reference = losses_of(temp_path("equiv_ref"));
  }
  const std::string dir = temp_path("equiv_np" + std::to_string(l.np));
  Result r = run("train " + path + " --output " + dir + " --set gradient_accumulation_steps=" + std::to_string(l.gas) +
                     " --set zero_optimization.overlap_comm=" +
                     (l.overlap ? "true" : "false") + " --set zero_optimization.reduce_bucket_size=" +
                     std::to_string(l.bucket),
                 l.np);
  ASSERT_EQ(r.code, 0) << r.err;
  const auto losses = losses_of(dir);
  ASSERT_EQ(losses.size(), reference.size());
  for (size_t i = 0; i < losses.size(); ++i)
    EXPECT_NEAR(losses[i], reference[i], 1e-5 * std::fabs(reference[i])) << "step " << i + 1;
}

// 1000 elements is smaller than one block (12·32² + 13·32 = 12,704 parameters).
INSTANTIATE_TEST_SUITE_P(DataParallel, SameGlobalBatch,
                         ::testing::Values(Layout{2, 2, false, 500000000}, Layout{2, 2, true, 1000},
                                           Layout{4, 1, false, 1000}, Layout{4, 1, true, 500000000},
                                           Layout{4, 1, true, 1000}),
                         [](const auto& info) {
                           return "np" + std::to_string(info.param.np) + (info.param.overlap ? "_overlap" : "") +
                                  (info.param.bucket < 100000 ? "_small_buckets" : "");
                         });

TEST(Failure, BadInputOnOneRankIsReportedOnceByThatRank) {
  Result r = run("train " + write_config("fault.json", tiny_config()) + " --output " + temp_path("fault_input"), 2,
                 "ZERO3D_FAULT=input:1");
  EXPECT_EQ(r.code, 2);
  EXPECT_EQ(count(r.err, "injected bad input"), 1u) << r.err;
  EXPECT_NE(r.err.find("rank 1: error"), std::string::npos) << r.err;
}

TEST(Failure, ExceptionDuringTrainingEndsTheJobNamingTheRank) {
  Result r = run("train " + write_config("fault.json", tiny_config()) + " --output " + temp_path("fault_throw"), 2,
                 "ZERO3D_FAULT=throw:1:2");
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.err.find("rank 1: fatal: injected failure at step 2"), std::string::npos) << r.err;
}

TEST(Failure, WatchdogAbortsWhenAPeerStallsInsteadOfHanging) {
  json j = tiny_config();
  j["training"]["comms_timeout"] = 2;
  Result r = run("train " + write_config("stall.json", j) + " --output " + temp_path("fault_stall"), 2,
                 "ZERO3D_FAULT=stall:1:2 timeout 60");
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.code, 124) << "the job hung until the test's own timeout";
  EXPECT_NE(r.err.find("rank 0 waits in all_reduce"), std::string::npos) << r.err;
}

TEST(Topology, JsonListsEveryRanksCoordinatesAndGroups) {
  Result r = run("topology --pp 2 --dp 2 --tp 2 --json");
  ASSERT_EQ(r.code, 0);
  const json t = json::parse(r.out);
  EXPECT_EQ(t["axes"], json({"pipe", "data", "model"}));
  EXPECT_EQ(t["dims"], json({2, 2, 2}));
  ASSERT_EQ(t["ranks"].size(), 8u);
  const json& r5 = t["ranks"][5];
  EXPECT_EQ(r5["coord"], json({{"pipe", 1}, {"data", 0}, {"model", 1}}));
  EXPECT_EQ(r5["groups"]["pipe"], json({1, 5}));
  EXPECT_EQ(r5["groups"]["data"], json({5, 7}));
  EXPECT_EQ(r5["groups"]["model"], json({4, 5}));
}

TEST(Topology, TextShowsOneLinePerRank) {
  Result r = run("topology --pp 2 --dp 2 --tp 2");
  ASSERT_EQ(r.code, 0);
  EXPECT_NE(r.out.find("rank   7  pipe 1 data 1 model 1  | data group [5,7]  tensor group [6,7]  pipe group [3,7]"),
            std::string::npos)
      << r.out;
}

// --- ZeRO stages (issue 4) -------------------------------------------------------------------

// 61·32 + 16·32 + 2·12,704 + 64 = 27,936 parameters; vocab 61 keeps it from dividing evenly
// once padded per rank; buckets of 1000 are smaller than one block; clipping at 0.3 is active.
json zero_config(int np) {
  json j = tiny_config();
  j["model"]["vocab_size"] = 61;
  j["train_micro_batch_size_per_gpu"] = 2;
  j["gradient_accumulation_steps"] = 2;
  j["train_batch_size"] = 4 * np;
  j["gradient_clipping"] = 0.3;
  j["optimizer"]["params"]["weight_decay"] = 0.1;
  j["zero_optimization"] = {{"reduce_bucket_size", 1000}, {"allgather_bucket_size", 1000}};
  j["training"]["steps"] = 20;
  return j;
}

struct StageRun {
  int np, stage;
};
void PrintTo(const StageRun& r, std::ostream* os) { *os << "np " << r.np << ", stage " << r.stage; }

class ZeroStage : public ::testing::TestWithParam<StageRun> {};

TEST_P(ZeroStage, GivesTheLossesOfStageZero) {
  const StageRun p = GetParam();
  const std::string path = write_config("zero_np" + std::to_string(p.np) + ".json", zero_config(p.np));
  const std::string ref_dir = temp_path("zero_ref_np" + std::to_string(p.np));
  static std::map<int, std::vector<double>> reference;
  if (!reference.count(p.np)) {
    ASSERT_EQ(run("train " + path + " --output " + ref_dir + " --set zero_optimization.stage=0", p.np).code, 0);
    reference[p.np] = losses_of(ref_dir);
  }
  const std::string dir = temp_path("zero_np" + std::to_string(p.np) + "_s" + std::to_string(p.stage));
  Result r = run("train " + path + " --output " + dir + " --set zero_optimization.stage=" + std::to_string(p.stage),
                 p.np);
  ASSERT_EQ(r.code, 0) << r.err;
  const auto losses = losses_of(dir);
  const auto& ref = reference[p.np];
  ASSERT_EQ(losses.size(), 20u);
  for (size_t i = 0; i < losses.size(); ++i)
    EXPECT_NEAR(losses[i], ref[i], 1e-5 * std::fabs(ref[i])) << "step " << i + 1;
}

INSTANTIATE_TEST_SUITE_P(AllStages, ZeroStage,
                         ::testing::Values(StageRun{1, 1}, StageRun{1, 2}, StageRun{1, 3}, StageRun{2, 1},
                                           StageRun{2, 2}, StageRun{2, 3}, StageRun{4, 1}, StageRun{4, 2},
                                           StageRun{4, 3}),
                         [](const auto& info) {
                           return "np" + std::to_string(info.param.np) + "_stage" + std::to_string(info.param.stage);
                         });

class ZeroBytes : public ::testing::TestWithParam<int> {};

// fp32 Adam, Ψ parameters, N ranks (ZeRO paper): 16Ψ | 4Ψ+4Ψ+8Ψ/N | 4Ψ+12Ψ/N | 16Ψ/N, with Ψ
// padded to a multiple of 2N for the partitioned stages.
TEST_P(ZeroBytes, ModelStateCountersEqualTheZeroFormulas) {
  const int np = GetParam();
  const auto [padded, part] = zero_split(kZeroPsi, np);
  const struct {
    int stage;
    int64_t params, grads, states;
  } expected[] = {{0, 4 * kZeroPsi, 4 * kZeroPsi, 8 * kZeroPsi},
                  {1, 4 * padded, 4 * padded, 8 * part},
                  {2, 4 * padded, 4 * part, 8 * part},
                  {3, 4 * part, 4 * part, 8 * part}};
  json j = zero_config(np);
  j["training"]["steps"] = 1;
  const std::string path = write_config("bytes.json", j);
  for (const auto& e : expected) {
    const std::string dir = temp_path("bytes_np" + std::to_string(np) + "_s" + std::to_string(e.stage));
    const json m = last_metrics(path, np, dir, "--set zero_optimization.stage=" + std::to_string(e.stage))["memory"];
    EXPECT_EQ(m["params"], e.params) << "stage " << e.stage;
    EXPECT_EQ(m["grads"], e.grads) << "stage " << e.stage;
    EXPECT_EQ(m["optimizer_states"], e.states) << "stage " << e.stage;
    EXPECT_EQ(m["master"], 0) << "stage " << e.stage;
  }
}

INSTANTIATE_TEST_SUITE_P(Ranks, ZeroBytes, ::testing::Values(2, 4));

TEST(ZeroStage3, CommunicatesAboutThreePsiAndStagesZeroToTwoAboutTwoPsi) {
  // Bus bytes per step at np 2, GAS 1: (W-1)/W · Ψ · 4 bytes per pass over the parameters.
  json j = zero_config(2);
  j["gradient_accumulation_steps"] = 1;
  j["train_batch_size"] = 4;
  j["training"]["steps"] = 1;
  j["zero_optimization"]["max_reuse_distance"] = 0;  // stage 3 re-gathers for backward
  j["zero_optimization"]["param_persistence_threshold"] = 0;
  const std::string path = write_config("comm.json", j);
  const double pass = 0.5 * kZeroPsi * 4;
  for (int stage : {0, 1, 2, 3}) {
    const std::string dir = temp_path("comm_s" + std::to_string(stage));
    ASSERT_EQ(run("train " + path + " --output " + dir + " --set zero_optimization.stage=" + std::to_string(stage), 2)
                  .code,
              0);
    const double bytes = read_metrics(dir).back()["comm_bytes"].get<double>();
    // Stage 3: gather for forward (the tied embeddings twice: encoder and head), gather for
    // backward (all but the embeddings, still held from the head), reduce-scatter = 3 passes.
    const double passes = stage == 3 ? 3.0 : 2.0;
    EXPECT_NEAR(bytes / pass, passes, 0.01) << "stage " << stage << ": " << bytes << " bytes";
  }
}

TEST(ZeroStage3, NeverHoldsMoreThanMaxLiveParametersPlusOneUnit) {
  json j = zero_config(2);
  j["training"]["steps"] = 3;
  j["zero_optimization"]["stage"] = 3;
  j["zero_optimization"]["max_live_parameters"] = 14000;  // about one block (12,704)
  j["zero_optimization"]["max_reuse_distance"] = 0;
  j["zero_optimization"]["param_persistence_threshold"] = 0;
  const std::string dir = temp_path("live");
  ASSERT_EQ(run("train " + write_config("live.json", j) + " --output " + dir, 2).code, 0);
  const int64_t live = read_metrics(dir).back()["memory"]["live_params_peak"];
  EXPECT_LE(live, 4 * (14000 + 12704));
  EXPECT_GT(live, 0);
  EXPECT_LT(live, 4 * kZeroPsi) << "everything was gathered at once";
}

TEST(ZeroStages, PeakResidentMemoryFallsAsTheStageRises) {
  // ~57M parameters (8 blocks of 7.1M) at np 2: model states dominate the process.
  json j = tiny_config();
  j["model"] = {{"vocab_size", 256}, {"n_positions", 16}, {"n_layer", 8}, {"n_head", 4}, {"n_embd", 768}};
  j["train_batch_size"] = 2;
  j["train_micro_batch_size_per_gpu"] = 1;
  j["training"]["steps"] = 2;
  j["zero_optimization"] = {{"reduce_bucket_size", 2000000}, {"allgather_bucket_size", 2000000},
                            {"max_live_parameters", 8000000}, {"max_reuse_distance", 0},
                            {"overlap_comm", false}};
  const std::string path = write_config("rss.json", j);
  std::vector<double> rss;
  for (int stage : {0, 1, 2, 3}) {
    const std::string dir = temp_path("rss_s" + std::to_string(stage));
    Result r = run("train " + path + " --output " + dir + " --set zero_optimization.stage=" + std::to_string(stage), 2);
    ASSERT_EQ(r.code, 0) << r.err;
    rss.push_back(read_metrics(dir).back()["peak_rss_bytes"].get<double>());
  }
  for (int s = 1; s < 4; ++s)
    EXPECT_LT(rss[s], rss[s - 1]) << "stage " << s << ": " << rss[s] / 1e6 << " MB vs " << rss[s - 1] / 1e6 << " MB";
}

// --- checkpoints (issue 6) --------------------------------------------------------------------

json checkpoint_config() {
  json j = zero_config(2);
  j["gradient_accumulation_steps"] = 1;
  j["train_batch_size"] = 4;
  j["scheduler"] = {{"type", "WarmupDecayLR"},
                    {"params", {{"warmup_num_steps", 5}, {"warmup_max_lr", 3e-3}, {"total_num_steps", 20}}}};
  j["training"]["save_interval"] = 10;
  return j;
}

// Trains 20 steps with checkpoints at 10 and 20 (cached per stage and np), returns its dir.
std::string reference_run(int np, int stage) {
  static std::map<std::pair<int, int>, std::string> done;
  const auto key = std::make_pair(np, stage);
  if (!done.count(key)) {
    const std::string dir = temp_path("ck_np" + std::to_string(np) + "_s" + std::to_string(stage));
    std::system(("rm -rf " + dir).c_str());
    Result r = run("train " + write_config("ck.json", checkpoint_config()) + " --output " + dir +
                       " --set zero_optimization.stage=" + std::to_string(stage),
                   np);
    EXPECT_EQ(r.code, 0) << r.err;
    done[key] = dir;
  }
  return done[key];
}

class BitExactResume : public ::testing::TestWithParam<int> {};

TEST_P(BitExactResume, TenStepsResumedForTenMoreEqualTwentyInEveryBit) {
  const int stage = GetParam();
  const std::string ref = reference_run(2, stage), dir = temp_path("resume_s" + std::to_string(stage));
  std::system(("rm -rf " + dir).c_str());
  Result r = run("train " + write_config("ck.json", checkpoint_config()) + " --output " + dir +
                     " --set zero_optimization.stage=" + std::to_string(stage) + " --set training.resume=" + ref +
                     "/checkpoints/global_step10",
                 2);
  ASSERT_EQ(r.code, 0) << r.err;
  const auto full = losses_of(ref), resumed = losses_of(dir);
  ASSERT_EQ(resumed.size(), 10u);
  for (size_t i = 0; i < 10; ++i) EXPECT_EQ(resumed[i], full[10 + i]) << "step " << 11 + i;
}

INSTANTIATE_TEST_SUITE_P(Stages, BitExactResume, ::testing::Values(0, 1, 2, 3));

struct Reshard {
  int np, stage;
};
void PrintTo(const Reshard& r, std::ostream* os) { *os << "np 2 stage 2 -> np " << r.np << " stage " << r.stage; }
class ReshardedResume : public ::testing::TestWithParam<Reshard> {};

TEST_P(ReshardedResume, ContinuesTheUninterruptedRun) {
  const Reshard p = GetParam();
  const std::string ref = reference_run(2, 2);
  const std::string dir = temp_path("reshard_np" + std::to_string(p.np) + "_s" + std::to_string(p.stage));
  std::system(("rm -rf " + dir).c_str());
  // Same global batch of 4 samples, split as the new world size allows.
  json j = checkpoint_config();
  j["train_batch_size"] = 4;
  j.erase("gradient_accumulation_steps");
  j.erase("train_micro_batch_size_per_gpu");
  j["gradient_accumulation_steps"] = p.np == 1 ? 2 : 1;
  Result r = run("train " + write_config("reshard.json", j) + " --output " + dir + " --set zero_optimization.stage=" +
                     std::to_string(p.stage) + " --set training.resume=" + ref + "/checkpoints/global_step10",
                 p.np);
  ASSERT_EQ(r.code, 0) << r.err;
  const auto full = losses_of(ref), resumed = losses_of(dir);
  ASSERT_EQ(resumed.size(), 10u);
  for (size_t i = 0; i < 10; ++i) EXPECT_NEAR(resumed[i], full[10 + i], 1e-5 * full[10 + i]) << "step " << 11 + i;
}

INSTANTIATE_TEST_SUITE_P(Layouts, ReshardedResume,
                         ::testing::Values(Reshard{1, 0}, Reshard{4, 3}, Reshard{2, 3}, Reshard{4, 1}));

TEST(Checkpoint, IndexPresentsWholeTensorsUnderHuggingFaceNamesToH5dump) {
  const std::string tag = reference_run(2, 3) + "/checkpoints/global_step10";
  const std::string out = temp_path("h5dump.txt");
  ASSERT_EQ(std::system(("cd / && h5dump -d /h.1.attn.c_attn.weight " + tag + "/index.h5 > " + out).c_str()), 0);
  EXPECT_NE(slurp(out).find("SIMPLE { ( 32, 96 ) / ( 32, 96 ) }"), std::string::npos) << slurp(out).substr(0, 400);
  EXPECT_EQ(slurp(out).find("(31,95): 0,"), std::string::npos) << "the last element is a fill value, not data";
}

TEST(Checkpoint, LatestNamesTheNewestTagAndEveryTagHasItsShards) {
  const std::string ck = reference_run(2, 1) + "/checkpoints";
  EXPECT_EQ(slurp(ck + "/latest"), "global_step20\n");
  for (const char* tag : {"global_step10", "global_step20"})
    for (const char* f : {"index.h5", "rank_00000.h5", "rank_00001.h5"})
      EXPECT_TRUE(std::ifstream(ck + "/" + tag + "/" + f).good()) << tag << "/" << f;
}

TEST(Checkpoint, KeepLastRotatesOldTags) {
  json j = checkpoint_config();
  j["training"]["save_interval"] = 5;
  j["training"]["keep_last"] = 2;
  const std::string dir = temp_path("keep_last");
  std::system(("rm -rf " + dir).c_str());
  ASSERT_EQ(run("train " + write_config("keep.json", j) + " --output " + dir, 2).code, 0);
  EXPECT_FALSE(std::ifstream(dir + "/checkpoints/global_step10/index.h5").good());
  EXPECT_TRUE(std::ifstream(dir + "/checkpoints/global_step15/index.h5").good());
  EXPECT_TRUE(std::ifstream(dir + "/checkpoints/global_step20/index.h5").good());
}

TEST(Checkpoint, SaveKilledMidwayLeavesThePreviousCheckpointAndLatest) {
  const std::string dir = temp_path("killed");
  std::system(("rm -rf " + dir).c_str());
  const std::string cfg = write_config("killed.json", checkpoint_config());
  Result r = run("train " + cfg + " --output " + dir, 2, "ZERO3D_FAULT=save_crash:1:20");
  EXPECT_NE(r.code, 0);
  const std::string ck = dir + "/checkpoints";
  EXPECT_EQ(slurp(ck + "/latest"), "global_step10\n");
  EXPECT_FALSE(std::ifstream(ck + "/global_step20/index.h5").good());
  // (rank 1, the one that dies mid-shard, has surely opened its file; rank 0 may be killed
  // before it opens its own when the machine is loaded)
  EXPECT_TRUE(std::ifstream(ck + "/global_step20.tmp/rank_00001.h5").good()) << "the save did not start";
  EXPECT_EQ(run("inspect " + ck).code, 0) << "the previous checkpoint is damaged";
  // The next run resumes from it, and its own save removes the stale .tmp.
  Result again = run("train " + cfg + " --output " + dir + " --set training.resume=latest", 2);
  ASSERT_EQ(again.code, 0) << again.err;
  EXPECT_EQ(slurp(ck + "/latest"), "global_step20\n");
  EXPECT_FALSE(std::ifstream(ck + "/global_step20.tmp/rank_00001.h5").good());
}

// A copy of a good checkpoint tag to damage.
std::string copy_of_tag(const std::string& name) {
  const std::string dst = temp_path(name);
  std::system(("rm -rf " + dst + " && cp -r " + reference_run(2, 2) + "/checkpoints/global_step10 " + dst).c_str());
  return dst;
}

Result resume_from(const std::string& tag_dir, const std::string& extra = "") {
  return run("train " + write_config("ck.json", checkpoint_config()) + " --output " + temp_path("damaged_run") +
                 " --set zero_optimization.stage=2 --set training.resume=" + tag_dir + extra,
             2);
}

TEST(CheckpointDefects, TruncatedShardIsReportedNamingTheFile) {
  const std::string tag = copy_of_tag("truncated");
  std::system(("truncate -s 5000 " + tag + "/rank_00001.h5").c_str());
  Result r = resume_from(tag);
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.err.find("rank_00001.h5"), std::string::npos) << r.err;
  EXPECT_EQ(count(r.err, "rank_00001.h5"), 1u) << r.err;
}

TEST(CheckpointDefects, FlippedBytesFailTheChecksum) {
  const std::string tag = copy_of_tag("flipped");
  const std::string shard = tag + "/rank_00000.h5";
  haddr_t offset = 0;
  {  // where does the first chunk of exp_avg live in the file?
    hid_t f = H5Fopen(shard.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT);
    hid_t ds = H5Dopen2(f, "exp_avg", H5P_DEFAULT);
    hsize_t coord[1];
    unsigned mask = 0;
    hsize_t size = 0;
    hid_t space = H5Dget_space(ds);
    ASSERT_GE(H5Dget_chunk_info(ds, space, 0, coord, &mask, &offset, &size), 0);
    H5Sclose(space);
    H5Dclose(ds);
    H5Fclose(f);
  }
  {
    std::fstream f(shard, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(static_cast<std::streamoff>(offset + 128));
    const char junk[4] = {'\x13', '\x37', '\x42', '\x42'};
    f.write(junk, 4);
  }
  Result r = resume_from(tag);
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.err.find("rank_00000.h5"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("checksum"), std::string::npos) << r.err;
  Result inspect = run("inspect " + tag);
  EXPECT_EQ(inspect.code, 2);
  EXPECT_NE(inspect.err.find("checksum"), std::string::npos) << inspect.err;
}

TEST(CheckpointDefects, MissingShardIsReported) {
  const std::string tag = copy_of_tag("missing");
  std::system(("rm " + tag + "/rank_00001.h5").c_str());
  Result r = resume_from(tag);
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.err.find("rank_00001.h5: missing shard"), std::string::npos) << r.err;
}

TEST(CheckpointDefects, ModelThatDoesNotMatchIsReported) {
  Result r = resume_from(reference_run(2, 2) + "/checkpoints/global_step10", " --set model.n_embd=48");
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.err.find("wte.weight"), std::string::npos) << r.err;
}

TEST(Inspect, JsonListsEveryTensorWithStatistics) {
  Result r = run("inspect " + reference_run(2, 1) + "/checkpoints --json");
  ASSERT_EQ(r.code, 0) << r.err;
  const json j = json::parse(r.out);
  EXPECT_EQ(j["step"], 20);
  EXPECT_EQ(j["verified"], true);
  EXPECT_EQ(j["tensors"].size(), 2u + 2 * 12 + 2);
  EXPECT_GT(j["tensors"][0]["l2_norm"].get<double>(), 0.0);
}

TEST(Inspect, UnknownTensorExitsTwo) {
  EXPECT_EQ(run("inspect " + reference_run(2, 1) + "/checkpoints --tensor h.9.nope").code, 2);
}

// Text whose period divides B·T: every micro-batch is the same window, so a run started from
// converted weights sees the batch the checkpointed run saw next.
std::string periodic_text_config(const std::string& name) {
  const std::string text = temp_path("periodic.txt");
  {
    std::ofstream out(text);
    for (int i = 0; i < 400; ++i) out << "zero3d trains GPT models, fast!\n";  // 32 bytes
  }
  json j = checkpoint_config();
  j["model"]["vocab_size"] = 256;
  j["data"] = {{"source", "text"}, {"path", text}};
  j["train_batch_size"] = 2;  // B·T = 2·16 = 32
  j["gradient_accumulation_steps"] = 1;
  j["train_micro_batch_size_per_gpu"] = 2;
  j["training"]["steps"] = 11;
  return write_config(name, j);
}

class ConvertRoundTrip : public ::testing::TestWithParam<std::string> {};

TEST_P(ConvertRoundTrip, ConvertedWeightsReloadedGiveTheSameLoss) {
  const std::string format = GetParam();
  const std::string cfg = periodic_text_config("periodic.json"), dir = temp_path("convert_src");
  std::system(("rm -rf " + dir).c_str());
  ASSERT_EQ(run("train " + cfg + " --output " + dir, 1).code, 0);
  const std::string out = temp_path("converted/model." + std::string(format == "hdf5" ? "h5" : "safetensors"));
  Result c = run("convert " + dir + "/checkpoints --tag global_step10 " + out + " --format " + format);
  ASSERT_EQ(c.code, 0) << c.err;
  const std::string fresh = temp_path("convert_dst");
  Result r = run("train " + cfg + " --output " + fresh + " --set training.steps=1 --set training.save_interval=0" +
                     " --set model.init_from=" + out,
                 1);
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(losses_of(fresh)[0], losses_of(dir)[10]);  // same weights, same batch: same bits
}

INSTANTIATE_TEST_SUITE_P(Formats, ConvertRoundTrip, ::testing::Values("hdf5", "safetensors"));

TEST(Convert, Bf16ShardedSafetensorsReloadThroughTheIndex) {
  const std::string cfg = periodic_text_config("periodic.json"), dir = temp_path("convert_src16");
  std::system(("rm -rf " + dir).c_str());
  ASSERT_EQ(run("train " + cfg + " --output " + dir, 1).code, 0);
  const std::string out = temp_path("sharded/model.safetensors");
  Result c = run("convert " + dir + "/checkpoints --tag global_step10 " + out +
                 " --format safetensors --dtype bf16 --max-shard-size 30KB");
  ASSERT_EQ(c.code, 0) << c.err;
  EXPECT_NE(c.out.find("model.safetensors.index.json"), std::string::npos) << c.out;
  const std::string fresh = temp_path("convert_dst16");
  Result r = run("train " + cfg + " --output " + fresh + " --set training.steps=1 --set training.save_interval=0" +
                     " --set model.init_from=" + temp_path("sharded/model.safetensors.index.json"),
                 1);
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NEAR(losses_of(fresh)[0], losses_of(dir)[10], 2e-2 * losses_of(dir)[10]);  // bf16 rounding
}

// --- estimator against the engine (issue 7) ---------------------------------------------------

json estimate_of(const std::string& cfg, int np) {
  Result r = run("estimate --config " + cfg + " --world-size " + std::to_string(np) + " --json");
  EXPECT_EQ(r.code, 0) << r.err;
  return json::parse(r.out);
}

class EstimateVsEngine : public ::testing::TestWithParam<std::string> {};

TEST_P(EstimateVsEngine, ModelStateCategoriesEqualTheEngineCountsByteForByte) {
  json j = zero_config(2);
  j["training"]["steps"] = 1;
  if (GetParam() != "fp32") j[GetParam()] = {{"enabled", true}};
  const std::string cfg = write_config("est_bytes.json", j);
  const json est = estimate_of(cfg, 2);
  for (int stage = 0; stage <= 3; ++stage) {
    const std::string dir = temp_path("est_bytes_s" + std::to_string(stage) + GetParam());
    ASSERT_EQ(run("train " + cfg + " --output " + dir + " --set zero_optimization.stage=" + std::to_string(stage), 2).code,
              0);
    const json m = read_metrics(dir).back()["memory"];
    for (const char* category : {"params", "grads", "master", "optimizer_states"})
      EXPECT_EQ(est["budgets"][stage][category], m[category]) << "stage " << stage << " " << category;
  }
}

INSTANTIATE_TEST_SUITE_P(Dtypes, EstimateVsEngine, ::testing::Values("fp32", "bf16", "fp16"));

struct MeasuredRun {
  int np, stage;
  std::string dtype = "fp32";
};
void PrintTo(const MeasuredRun& r, std::ostream* os) { *os << "np " << r.np << " stage " << r.stage << " " << r.dtype; }
class EstimateVsMeasured : public ::testing::TestWithParam<MeasuredRun> {};

// A 57M-parameter model, so that what the estimate models dominates the process.
TEST_P(EstimateVsMeasured, TotalIsWithinTenPercentOfPeakResidentMemory) {
#ifdef ZERO3D_SANITIZE_BUILD
  GTEST_SKIP() << "AddressSanitizer's shadow memory inflates the resident size this test measures";
#endif
  const MeasuredRun p = GetParam();
  json j = tiny_config();
  j["model"] = {{"vocab_size", 256}, {"n_positions", 16}, {"n_layer", 8}, {"n_head", 4}, {"n_embd", 768}};
  j.erase("train_batch_size");
  j["train_micro_batch_size_per_gpu"] = 1;
  j["gradient_accumulation_steps"] = 1;
  j["training"]["steps"] = 2;
  j["zero_optimization"] = {{"stage", p.stage}, {"reduce_bucket_size", 2000000}, {"allgather_bucket_size", 2000000},
                            {"max_live_parameters", 8000000}, {"max_reuse_distance", 0}, {"overlap_comm", false}};
  if (p.dtype != "fp32") j[p.dtype] = {{"enabled", true}};
  const std::string cfg = write_config("est_rss.json", j);
  const std::string dir =
      temp_path("est_rss_np" + std::to_string(p.np) + "_s" + std::to_string(p.stage) + "_" + p.dtype);
  ASSERT_EQ(run("train " + cfg + " --output " + dir, p.np).code, 0);
  const double measured = read_metrics(dir).back()["peak_rss_bytes"].get<double>();
  const double estimated = estimate_of(cfg, p.np)["budgets"][p.stage]["total"].get<double>();
  EXPECT_NEAR(estimated / measured, 1.0, 0.10) << "estimate " << estimated / 1e6 << " MB, measured " << measured / 1e6
                                               << " MB";
}

// (np 4 at stage 3 with this model takes minutes: four ranks busy-polling two cores through
// stage 3's many collectives; benchmarks/estimate_vs_measured.sh covers it.)
INSTANTIATE_TEST_SUITE_P(Configurations, EstimateVsMeasured,
                         ::testing::Values(MeasuredRun{1, 0}, MeasuredRun{2, 1}, MeasuredRun{2, 2}, MeasuredRun{2, 3},
                                           MeasuredRun{4, 2}, MeasuredRun{1, 3}, MeasuredRun{1, 0, "bf16"},
                                           MeasuredRun{2, 1, "bf16"}, MeasuredRun{2, 3, "bf16"},
                                           MeasuredRun{2, 2, "fp16"}));

TEST(Estimate, CliPrintsDeepSpeedsTableForTheLiveQuickstartModel) {
  Result r = run("estimate zero3 --model " + kSource + "/input/quickstart.json --gpus-per-node 8 --nodes 1");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("SW: Model with 0M total params, 0M largest layer params."), std::string::npos) << r.out;
  EXPECT_EQ(count(r.out, "zero_init="), 6u);
}

TEST(Estimate, MemoryPerRankSaysWhatFits) {
  Result r = run("estimate --config " + kSource + "/input/gpt-small-cpu.json --world-size 2 --memory-per-rank 1GiB");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("largest micro-batch within 1GiB per rank:"), std::string::npos) << r.out;
  Result none = run("estimate --config " + kSource + "/input/gpt-small-cpu.json --memory-per-rank 10MB");
  EXPECT_NE(none.out.find("none (model states alone"), std::string::npos) << none.out;
}

// Each mode reads its own options: one the chosen mode would ignore is an error naming it, as
// are values it would take as "not given" (--params 0, --memory-per-rank 0) or that contradict.
TEST(Estimate, OptionsTheChosenModeWouldIgnoreAreRejectedByName) {
  const std::string cfg = kSource + "/input/quickstart.json";
  for (const auto& [args, named] : std::vector<std::pair<std::string, std::string>>{
           {"zero2 --params 1e9 --world-size 4", "--world-size"},
           {"zero3 --params 1e9 --largest-layer-params 1e6 --report r.h5", "--report"},
           {"zero2 --params 1e9 --json", "--json"},
           {"zero2 --params 1e9 --model " + cfg, "not both"},
           {"zero2 --params 1e9 --largest-layer-params 1e6", "--largest-layer-params"},
           {"--config " + cfg + " --nodes 2", "--nodes"},
           {"--config " + cfg + " --params 1e9", "--params"},
           {"--config " + cfg + " --memory-per-rank 0", "--memory-per-rank 0"},
           {"zero2 --params 0", "--params 0"},
           {"zero3 --params 1e9 --largest-layer-params 2e9", "more than the whole model"}}) {
    const Result r = run("estimate " + args);
    EXPECT_EQ(r.code, 2) << args << ": " << r.out << r.err;
    EXPECT_NE(r.err.find(named), std::string::npos) << args << ": " << r.err;
    EXPECT_EQ(count(r.err, "\n"), 1u) << r.err;
  }
}

TEST(Cli, MistypedCommandIsNamedWithTheCommands) {
  const Result r = run("trian " + kSource + "/input/quickstart.json");
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.err.find("unknown command `trian` (commands: train,"), std::string::npos) << r.err;
}

}  // namespace
