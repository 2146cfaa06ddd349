// The memory plan and the figures a run reports, black-box (issue 35): bf16 allocates what its
// path writes and the plan counts it; one rank's start-up is planned; ZeRO-3's gather buffers are
// the plan's; a bucket holds whole gradients. Memory is judged by the figures the program
// reports (memory_plan, memory), never by timing.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "support/cli_helpers.hpp"

using namespace cli;

namespace {

// T = 512, micro-batch 8, C 64, H 4: the attention's B·H·T² probabilities (the fp32 path keeps
// them, 33.5 MB a block) dominate the activations, which dominate the process.
json t512_config() {
  json j = tiny_config();
  j["train_batch_size"] = 8;
  j["train_micro_batch_size_per_gpu"] = 8;
  j["model"] = {{"vocab_size", 256}, {"n_positions", 512}, {"n_layer", 2}, {"n_head", 4}, {"n_embd", 64}};
  j["training"]["steps"] = 2;
  return j;
}

// The bf16 path keeps half its saves in bf16 and its fused attention writes no probabilities:
// the buffers hold that (not fp32-sized ones it half fills), and the plan printed at start-up
// lands within ±10% of the measured peak (it was 1.86× over before).
TEST(MemoryPlan, Bf16AllocatesWhatItsPathWritesAndPlansIt) {
  const std::string config = write_config("plan512.json", t512_config());
  const json fp32 = last_metrics(config, 1, temp_path("plan512_fp32"), "");
  const std::string dir = temp_path("plan512_bf16");
  const Result r = run("train " + config + " --output " + dir + " --set bf16.enabled=true", 1);
  ASSERT_EQ(r.code, 0) << r.err;
  const json bf16 = read_metrics(dir).back();
  EXPECT_LT(bf16["memory"]["activations"].get<double>(), 0.5 * fp32["memory"]["activations"].get<double>());
  const json plan = bf16.at("memory_plan");
  const double predicted = plan.at("predicted_peak_bytes").get<double>(),
               measured = plan.at("measured_peak_bytes").get<double>();
  EXPECT_NEAR(predicted / measured, 1.0, 0.10) << "predicted " << predicted / 1e6 << " MB, measured "
                                               << measured / 1e6 << " MB";
  // estimate --config says the same as the start-up line
  const Result e = run("estimate --config " + config + " --set bf16.enabled=true --json");
  ASSERT_EQ(e.code, 0) << e.err;
  EXPECT_EQ(json::parse(e.out)["budgets"][0]["total"].get<double>(), predicted);
}

// One rank maps 6 MB more of its libraries at start-up than each of several does: the plan of a
// small model, where that shows, lands within ±5% at np 1 (it was 11% short).
TEST(MemoryPlan, OneRankPlansItsLibrariesStartUp) {
  json j = tiny_config();
  j["model"] = {{"vocab_size", 256}, {"n_positions", 64}, {"n_layer", 2}, {"n_head", 2}, {"n_embd", 64}};
  j["train_batch_size"] = 4;
  j["training"]["steps"] = 2;
  const json plan = last_metrics(write_config("np1.json", j), 1, temp_path("np1"), "").at("memory_plan");
  EXPECT_NEAR(plan.at("ratio").get<double>(), 1.0, 0.05) << plan.dump();
}

// ZeRO-3's gather buffers: the plan follows ZeroOptimizer's fetch, prefetch and release
// decisions along the step's trace, and counts byte for byte the buffers the run holds
// (metrics.jsonl memory.gathered), whatever max_live_parameters, max_reuse_distance and
// prefetch_bucket_size allow (units here: embeddings 2,560, blocks 12,704, ln_f 64).
TEST(MemoryPlan, Zero3GatherBuffersAreThoseThePlanSimulates) {
  json j = tiny_config();
  j["training"]["steps"] = 2;
  j["zero_optimization"] = {{"stage", 3}};
  const std::string config = write_config("gathers.json", j);
  const std::vector<std::string> settings = {
      "",  // DeepSpeed's defaults: everything kept within the step
      "--set zero_optimization.max_reuse_distance=0 --set zero_optimization.prefetch_bucket_size=0",
      "--set zero_optimization.max_reuse_distance=0 --set zero_optimization.prefetch_bucket_size=13000",
      "--set zero_optimization.max_live_parameters=16000 --set zero_optimization.max_reuse_distance=30000",
      "--set zero_optimization.param_persistence_threshold=3000 --set zero_optimization.max_reuse_distance=0 "
      "--set pipeline.activation_checkpoint_interval=1",
      // blocks neither persistent, kept nor prefetched: one block's buffer serves both blocks
      "--set zero_optimization.param_persistence_threshold=3000 --set zero_optimization.max_reuse_distance=0 "
      "--set zero_optimization.prefetch_bucket_size=0"};
  for (const std::string& args : settings) {
    const json m = last_metrics(config, 2, temp_path("gathers"), args).at("memory");
    const Result e = run("estimate --config " + config + " --world-size 2 --json " + args);
    ASSERT_EQ(e.code, 0) << e.err;
    const json b = json::parse(e.out)["budgets"][3];
    EXPECT_EQ(b["comm_gather"].get<int64_t>() + b["comm_prefetch"].get<int64_t>() + b["live_params"].get<int64_t>(),
              m.at("gathered").get<int64_t>())
        << args;
    std::system(("rm -rf " + temp_path("gathers")).c_str());
  }
}

// ZeRO++'s qgZ on 2 emulated nodes (np 2, one rank a node; np 4, two): its staging buffers (int4
// blocks and scales sent and received, the fp32 sums) grow to each one's largest over a step's
// buckets, and the plan counts them with the reducer's slots and windows byte for byte
// (memory.comm_buffers, data rank 0's); the start-up plan is the estimate's. On one node qgZ
// falls back to the reduce-scatter and the plan has no such buffers.
TEST(MemoryPlan, QgzStagingBuffersAreThoseThePlanCounts) {
  json j = tiny_config();
  j["train_micro_batch_size_per_gpu"] = 2;
  j["training"]["steps"] = 2;
  j["zero_optimization"] = {{"stage", 3}, {"param_persistence_threshold", 0}, {"zero_quantized_gradients", true}};
  for (const bool loco : {false, true}) {  // LoCo adds each bucket's kept errors and its fp32 error blocks
    if (loco) j["zero_optimization"]["zeropp_loco_param"] = {{"err_beta", 0.8}, {"reset_T", 1024}};
    const std::string config = write_config(loco ? "loco_plan.json" : "qgz_plan.json", j);
    for (const int np : {2, 4}) {
      const std::string k = std::to_string(np / 2), tag = (loco ? "loco " : "qgz ") + std::string("np ") + std::to_string(np),
                        dir = temp_path((loco ? "loco_plan" : "qgz_plan") + std::to_string(np));
      const Result r = run("train " + config + " --output " + dir, np, "ZERO3D_RANKS_PER_NODE=" + k);
      ASSERT_EQ(r.code, 0) << r.out << r.err;
      const json row = read_metrics(dir).back();
      const Result e = run("estimate --config " + config + " --world-size " + std::to_string(np) +
                           " --ranks-per-node " + k + " --json");
      ASSERT_EQ(e.code, 0) << e.err;
      const json b = json::parse(e.out)["budgets"][3];
      EXPECT_EQ(b["comm_reduce"].get<int64_t>(), row.at("memory").at("comm_buffers").get<int64_t>()) << tag;
      EXPECT_EQ(b["total"].get<int64_t>(), row.at("memory_plan").at("predicted_peak_bytes").get<int64_t>()) << tag;
      if (loco) continue;
      const Result one = run("estimate --config " + config + " --world-size " + std::to_string(np) + " --json");
      ASSERT_EQ(one.code, 0) << one.err;
      EXPECT_NE(json::parse(one.out)["budgets"][3]["comm_reduce"].get<int64_t>(), b["comm_reduce"].get<int64_t>());
    }
  }
}

// reduce_bucket_size 1 (or 0): one gradient per bucket, as DeepSpeed reads it, not one element:
// a step's data-parallel all-reduces number the model's tensors (28) plus the loss and norm, not
// its 28,032 parameters. The comms logger prints every operation.
TEST(ReduceBuckets, SizeOneMeansOneGradientPerBucket) {
  json j = tiny_config();
  j["training"]["steps"] = 1;
  j["comms_logger"] = {{"enabled", true}, {"verbose", true}, {"prof_all", true}};
  for (int size : {1, 0}) {
    const std::string dir = temp_path("bucket" + std::to_string(size));
    const Result r = run("train " + write_config("bucket.json", j) + " --output " + dir +
                             " --set zero_optimization.reduce_bucket_size=" + std::to_string(size),
                         2);
    ASSERT_EQ(r.code, 0) << r.err;
    const size_t reductions = count(r.out, "comm op: all_reduce");
    EXPECT_GE(reductions, 28u) << "reduce_bucket_size " << size;
    EXPECT_LE(reductions, 40u) << "reduce_bucket_size " << size;
  }
}

}  // namespace
