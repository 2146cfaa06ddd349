// Stage 3's gather staging in the memory plan, black-box: the byte buffers ZeroOptimizer's packed
// gathers take from their pool besides the units they land in — qwZ's int8 groups and scales
// (with bf16 parameters, each slice widened to fp32 for the quantiser and narrowed from it after),
// torch_autocast's units packed with the listed tensors in bf16, MiCS's hierarchical gather (the
// slices across nodes, then the unit by position), qwZ's gathers inside hpZ's group and the MoE
// experts' own gathers — are planned
// byte for byte: estimate's comm_gather + comm_prefetch + live_params is the run's
// memory.gathered (the gather buffers and the pool's peak, spares kept for reuse included) plus
// its hpz_secondary, on the run's emulated nodes (data rank 0's), and the start-up plan is the
// estimate's. (check_memory_fits against the same runs: tests/train/test_mpi_memory_fits_nodes.cpp.)
#include <string>
#include <vector>

#include "support/cli_helpers.hpp"

using namespace cli;

namespace {

struct StagedGather {
  std::string name;
  int np;
  json zero;
  json sections;        // further config sections (bf16, torch_autocast)
  std::string without;  // --set arguments: the same run without the packed gathers
};

TEST(MemoryPlanStaging, PackedGathersStageWhatThePlanCounts) {
  json j = tiny_config();
  j["train_micro_batch_size_per_gpu"] = 2;
  j.erase("train_batch_size");
  j["training"]["steps"] = 3;
  const json bf16 = {{"bf16", {{"enabled", true}}}};
  const json qwz = {{"stage", 3}, {"param_persistence_threshold", 0}, {"zero_quantized_weights", true}};
  json qwz_prefetch = qwz;  // units gathered ahead hold their packed bytes until their fetch
  qwz_prefetch["max_reuse_distance"] = 0;
  qwz_prefetch["prefetch_bucket_size"] = 13000;
  json moe = bf16;  // two experts a block, each rank holding both (ep_size 1)
  moe["model"] = j["model"];
  moe["model"]["moe"] = {{"num_experts", 2}, {"k", 1}};
  json qwz_hpz = qwz;
  qwz_hpz["zero_hpz_partition_size"] = 2;
  const std::vector<StagedGather> cases = {
      {"qwz", 2, qwz, json::object(), "--set zero_optimization.zero_quantized_weights=false"},
      {"qwz_bf16", 2, qwz, bf16, "--set zero_optimization.zero_quantized_weights=false"},
      {"qwz_bf16_prefetch", 2, qwz_prefetch, bf16, "--set zero_optimization.zero_quantized_weights=false"},
      {"autocast", 2, {{"stage", 3}, {"param_persistence_threshold", 0}},
       {{"torch_autocast", {{"enabled", true}, {"dtype", "bfloat16"}}}}, "--set torch_autocast.enabled=false"},
      {"mics_hier", 4, {{"stage", 3}, {"mics_shard_size", 4}, {"mics_hierarchical_params_gather", true}},
       json::object(), "--set zero_optimization.mics_hierarchical_params_gather=false"},
      {"qwz_hpz_bf16", 4, qwz_hpz, bf16, "--set zero_optimization.zero_quantized_weights=false"},
      // the experts' own ZeroOptimizer gathers its units with qwZ too, from a pool of its own
      {"qwz_bf16_moe", 2, qwz, moe, "--set zero_optimization.zero_quantized_weights=false"}};
  for (const StagedGather& c : cases) {
    json cfg = j;
    cfg["zero_optimization"] = c.zero;
    cfg.update(c.sections);
    const std::string config = write_config("staging_" + c.name + ".json", cfg), np = std::to_string(c.np),
                      k = std::to_string(c.np / 2), dir = temp_path("staging_" + c.name);
    const Result r = run("train " + config + " --output " + dir, c.np,
                         "OPENBLAS_NUM_THREADS=1 ZERO3D_RANKS_PER_NODE=" + k);
    ASSERT_EQ(r.code, 0) << c.name << r.out << r.err;
    const json row = read_metrics(dir).back(), m = row.at("memory");
    const auto estimate = [&](const std::string& settings) {
      const Result e = run("estimate --config " + config + " --world-size " + np + " --ranks-per-node " + k +
                           " --json " + settings);
      EXPECT_EQ(e.code, 0) << c.name << e.err;
      return e.code == 0 ? json::parse(e.out)["budgets"][3] : json::object();
    };
    const json b = estimate("");
    const auto gathered = [](const json& p) {
      return p["comm_gather"].get<int64_t>() + p["comm_prefetch"].get<int64_t>() + p["live_params"].get<int64_t>();
    };
    const int64_t secondary = m.contains("hpz_secondary") ? m.at("hpz_secondary").get<int64_t>() : 0;
    EXPECT_EQ(gathered(b), m.at("gathered").get<int64_t>() + secondary) << c.name;
    EXPECT_EQ(b["total"].get<int64_t>(), row.at("memory_plan").at("predicted_peak_bytes").get<int64_t>()) << c.name;
    // The packed gathers staged something the plain gathers do not.
    EXPECT_GT(gathered(b), gathered(estimate(c.without))) << c.name;
    std::printf("[ staging  ] %s np %d: planned = measured gather bytes %lld\n", c.name.c_str(), c.np,
                static_cast<long long>(gathered(b)));
  }
}

}  // namespace
