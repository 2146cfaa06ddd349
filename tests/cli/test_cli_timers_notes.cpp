// Timers and start-up notes that said something else than what happened (issue 35): ZeRO-3's
// all-gather time leaves the in-training evaluation to eval_ms; the oversubscription note names
// its real cause.
#include <gtest/gtest.h>

#include <string>
#include <thread>

#include "support/cli_helpers.hpp"

using namespace cli;

namespace {

// ZeRO-3's all-gather time is what the step blocked in its own gathers: a long evaluation at the
// step's end (100 rounds, each gathering every unit) belongs to eval_ms. The step's blocked time
// lies inside its elapsed time, so it can never exceed it; the evaluation's gathers, counted in,
// made it exceed it many times over.
TEST(Timers, Zero3AllgatherTimeLeavesTheEvaluationOut) {
  json j = tiny_config();
  j["wall_clock_breakdown"] = true;
  j["zero_optimization"] = {{"stage", 3}, {"max_reuse_distance", 0}};  // each round gathers every unit again
  j["data"] = {{"source", "synthetic"}, {"validation", {{"source", "synthetic"}}}};
  j["training"]["steps"] = 4;
  j["training"]["eval_interval"] = 2;
  j["training"]["eval_steps"] = 100;
  const std::string dir = temp_path("eval_gather");
  ASSERT_EQ(run("train " + write_config("eval_gather.json", j) + " --output " + dir, 2).code, 0);
  int evaluated = 0;
  for (const json& row : read_metrics(dir)) {
    const double gather = row.at("time_ms").at("allgather").get<double>(), elapsed = row.at("elapsed_ms").get<double>();
    EXPECT_GT(gather, 0.0) << "step " << row["step"];
    EXPECT_LE(gather, elapsed) << "step " << row["step"] << (row.contains("eval_ms") ? " (evaluated)" : "");
    evaluated += row.contains("eval_ms") ? 1 : 0;
  }
  EXPECT_EQ(evaluated, 2);
}

// More ranks than cores with one BLAS thread each: the note names that cause and what to do
// about it, not the OPENBLAS_NUM_THREADS setting that is already 1.
TEST(StartupNotes, OversubscriptionByRanksNamesTheRanks) {
  const int cores = static_cast<int>(std::thread::hardware_concurrency());
  if (cores < 1 || cores > 3) GTEST_SKIP() << cores << " cores: oversubscribing them takes too many ranks here";
  json j = tiny_config();
  j["training"]["steps"] = 1;
  j["train_batch_size"] = 4 * (cores + 1);
  const Result r = run("train " + write_config("busy.json", j) + " --output " + temp_path("busy"), cores + 1,
                       "OPENBLAS_NUM_THREADS=1");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find(std::to_string(cores + 1) + " ranks on this node > " + std::to_string(cores) + " cores"),
            std::string::npos)
      << r.out;
  EXPECT_NE(r.out.find("run at most " + std::to_string(cores) + " ranks per node"), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("OPENBLAS_NUM_THREADS"), std::string::npos) << r.out;
}

}  // namespace
