// test_cli.cpp — the zero3d executable as users run it: exit codes, one message for bad
// input (also under mpiexec -np 2), files of a run, and multi-rank training behaviour.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <cmath>
#include <cstdlib>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

using json = nlohmann::json;

namespace {

const std::string kExe = ZERO3D_EXE;
const std::string kMpiexec = ZERO3D_MPIEXEC;
const std::string kSource = ZERO3D_SOURCE_DIR;

struct Result {
  int code;
  std::string out, err;
};

std::string slurp(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::string temp_path(const std::string& name) {
  const std::string dir = ::testing::TempDir() + "zero3d_cli";
  std::system(("mkdir -p " + dir).c_str());
  return dir + "/" + name;
}

// Runs `zero3d ARGS` on `np` ranks (np 0: without mpiexec). `prefix` goes before the launch:
// environment assignments (VAR=value) or a wrapper such as `timeout 60`.
Result run(const std::string& args, int np = 0, const std::string& prefix = "") {
  const std::string out = temp_path("stdout.txt"), err = temp_path("stderr.txt");
  std::string cmd = prefix + (prefix.empty() ? "" : " ") + (np > 0 ? kMpiexec + " -np " + std::to_string(np) + " " : "") +
                    kExe + " " + args;
  int status = std::system((cmd + " >" + out + " 2>" + err).c_str());
  return Result{WIFEXITED(status) ? WEXITSTATUS(status) : -1, slurp(out), slurp(err)};
}

std::string write_config(const std::string& name, const json& j) {
  const std::string path = temp_path(name);
  std::ofstream(path) << j.dump(2);
  return path;
}

json tiny_config() {
  return json{{"train_batch_size", 8},
              {"train_micro_batch_size_per_gpu", 4},
              {"optimizer", {{"type", "AdamW"}, {"params", {{"lr", 1e-3}}}}},
              {"model", {{"vocab_size", 64}, {"n_positions", 16}, {"n_layer", 2}, {"n_head", 2}, {"n_embd", 32}}},
              {"training", {{"steps", 5}, {"seed", 7}, {"peak_gflops", 50}}}};
}

std::vector<json> read_metrics(const std::string& dir) {
  std::vector<json> rows;
  std::ifstream in(dir + "/metrics.jsonl");
  for (std::string line; std::getline(in, line);) rows.push_back(json::parse(line));
  return rows;
}

size_t count(const std::string& haystack, const std::string& needle) {
  size_t n = 0;
  for (size_t p = haystack.find(needle); p != std::string::npos; p = haystack.find(needle, p + 1)) ++n;
  return n;
}

TEST(Cli, VersionFlagPrintsTheVersion) {
  Result r = run("--version");
  EXPECT_EQ(r.code, 0);
  EXPECT_NE(r.out.find("zero3d "), std::string::npos);
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

}  // namespace
