// The memory plan on several nodes, black-box (issue 34): every planner sizes the node-placed
// groups (ZeRO++'s qgZ and hpZ, MiCS) by the nodes the run has. estimate --config with
// --ranks-per-node is byte for byte the plan a run on emulated nodes prints and measures, and the
// autotuner prices its experiments on the job's nodes. (check_memory_fits against the same run:
// tests/train/test_mpi_memory_fits_nodes.cpp; what fits: tests/train/test_estimator_nodes.cpp.)
#include <string>
#include <vector>

#include "support/cli_helpers.hpp"

using namespace cli;

namespace {

int64_t estimate_total(const std::string& config, int np, const std::string& nodes_args, const char* key = "total") {
  const Result e = run("estimate --config " + config + " --world-size " + std::to_string(np) + nodes_args + " --json");
  EXPECT_EQ(e.code, 0) << e.err;
  return e.code == 0 ? json::parse(e.out)["budgets"][3][key].get<int64_t>() : -1;
}

// hpZ and MiCS on 2 emulated nodes (np 2, one rank a node; np 4, two): the plan estimate prints
// for those nodes is the run's (qgZ's own: MemoryPlan.QgzStagingBuffersAreThoseThePlanCounts).
TEST(MemoryPlanNodes, HpzAndMicsArePlannedAsTheRunOnItsNodes) {
  json j = tiny_config();
  j["train_micro_batch_size_per_gpu"] = 2;
  j.erase("train_batch_size");
  j["training"]["steps"] = 2;
  const std::vector<std::pair<std::string, json>> layouts = {
      {"hpz", {{"stage", 3}, {"zero_hpz_partition_size", 2}}},
      {"mics", {{"stage", 3}, {"mics_shard_size", 2}}},
      {"mics_hier", {{"stage", 3}, {"mics_shard_size", 2}, {"mics_hierarchical_params_gather", true}}}};
  for (const auto& [name, zero] : layouts) {
    j["zero_optimization"] = zero;
    const std::string config = write_config(name + "_nodes.json", j);
    for (const int np : {2, 4}) {
      if (name == "mics_hier" && np == 4) continue;  // a shard of 2 on one node: DeepSpeed refuses it
      const std::string k = std::to_string(np / 2), tag = name + " np " + std::to_string(np),
                        dir = temp_path(name + "_nodes" + std::to_string(np));
      const Result r = run("train " + config + " --output " + dir, np, "OPENBLAS_NUM_THREADS=1 ZERO3D_RANKS_PER_NODE=" + k);
      ASSERT_EQ(r.code, 0) << tag << r.out << r.err;
      const json row = read_metrics(dir).back();
      EXPECT_EQ(estimate_total(config, np, " --ranks-per-node " + k),
                row.at("memory_plan").at("predicted_peak_bytes").get<int64_t>())
          << tag;
      EXPECT_EQ(estimate_total(config, np, " --ranks-per-node " + k, "comm_reduce"),
                row.at("memory").at("comm_buffers").get<int64_t>())
          << tag;
    }
  }
}

// qgZ on 2 emulated nodes of one rank: every experiment's planned bytes are estimate's for those
// nodes (qgZ's staging included), not the one-node figure, and exp.json names the 2 nodes.
TEST(AutotuneNodes, QgzExperimentsArePricedOnTheJobsNodes) {
  const std::string dir = temp_path("tune_qgz");
  json c = tiny_config();
  c.erase("train_batch_size");
  c["train_micro_batch_size_per_gpu"] = 1;
  c["zero_optimization"] = {{"stage", 3}, {"param_persistence_threshold", 0}, {"zero_quantized_gradients", true}};
  c["training"]["steps"] = 2;
  c["autotuning"] = {{"enabled", false},
                     {"results_dir", dir + "/results"},
                     {"exps_dir", dir + "/exps"},
                     {"start_profile_step", 2},
                     {"end_profile_step", 3},
                     {"max_train_micro_batch_size_per_gpu", 4},
                     {"num_tuning_micro_batch_sizes", 2},
                     {"tuner_num_trials", 1}};
  const Result r = run("autotune " + write_config("tune_qgz.json", c), 2, "OPENBLAS_NUM_THREADS=1 ZERO3D_RANKS_PER_NODE=1");
  ASSERT_EQ(r.code, 0) << r.out << r.err;
  int experiments = 0;
  for (const std::string& name : subdirectories(dir + "/results")) {
    const json exp = json::parse(slurp(dir + "/results/" + name + "/exp.json"));
    const std::string ds = dir + "/results/" + name + "/ds_config.json";
    const int64_t two_nodes = estimate_total(ds, 2, " --ranks-per-node 1");
    EXPECT_EQ(exp["planned_bytes_per_rank"].get<int64_t>(), two_nodes) << name;
    EXPECT_NE(estimate_total(ds, 2, ""), two_nodes) << name << ": on one node qgZ has no staging";
    EXPECT_EQ(exp["num_nodes"], 2) << name;
    ++experiments;
  }
  EXPECT_GE(experiments, 2);
}

}  // namespace
