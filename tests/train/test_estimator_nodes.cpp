// test_estimator_nodes.cpp — the planners that answer before a run plan on its nodes (issue 34):
// estimate's "what fits" with ZeRO++'s qgZ on 2 nodes needs exactly qgZ's staging more than on
// one node, the staging computed here from the reducer's buckets and qgz_staging.
#include <gtest/gtest.h>

#include "config/config.hpp"
#include "parallel/quantized_reduce_scatter.hpp"
#include "train/estimator.hpp"
#include "train/rank_plan.hpp"
#include "zero/zero.hpp"

using namespace zero3d;

namespace {

// What 2 nodes of 2 ranks add to data rank 0's plan over one node of 4 for `cfg` (stage 3, qgZ):
// the reducer's slots cut at qgZ's quantised tensors, qgZ's staging buffers at their largest over
// the step's buckets, and with LoCo each bucket's kept errors.
int64_t qgz_staging_difference(const Config& cfg) {
  const RankPlan plan = plan_ranks(cfg).front();
  const ParamLayout& layout = plan.part.dense_layout;
  const Partition part(plan.partition_numel, 4);
  const StateTypes types = state_types_of(cfg, layout);
  const ReduceWork one = reduce_work(3, cfg.zero, types, layout, plan.part.dense_units, part, 0);
  const ReduceWork two = reduce_work(3, cfg.zero, types, layout, plan.part.dense_units, part, 4);
  const bool loco = cfg.zero.loco.enabled;
  QgzStaging peak;
  int64_t kept = 0;
  for (const ReduceBucket& b : two.buckets)
    if (b.quant_group > 0) {
      const std::vector<int64_t> counts = part.counts(b.begin, b.end);
      peak.grow(qgz_staging(qgz_blocks(counts, b.quant_group), 2, 2, 0, loco));
      if (loco) kept += loco_kept_bytes(counts, b.quant_group, 2, 2, 0);
    }
  EXPECT_GT(peak.total(), 0) << "no bucket quantised: the test would show nothing";
  return two.staging_bytes - one.staging_bytes + peak.total() + kept;
}

// For limits at which micro-batch m just fits on one node, 2 nodes give every answer (configured
// checkpointing, none, selective, full) the same at the limit plus qgZ's staging, and the
// configured one falls to m - 1 a byte below it.
TEST(WhatFits, QgzOnTwoNodesNeedsExactlyItsStagingMore) {
  for (const bool loco : {false, true}) {
    nlohmann::json j = quickstart_json();
    j["train_batch_size"] = 32;  // micro-batch 8 on 4 ranks
    j["zero_optimization"] = {{"stage", 3}, {"zero_quantized_gradients", true}};
    if (loco) j["zero_optimization"]["zeropp_loco_param"] = {{"err_beta", 0.8}, {"reset_T", 1024}};
    const Config cfg = read_config(j, "qgz.json", 4);
    const int64_t staging = qgz_staging_difference(cfg);
    for (const int64_t m : {1, 2, 5}) {
      Config at_m = cfg;
      at_m.batch.micro_batch = m;
      const int64_t limit = estimate_budget(at_m, 4, 3, 0).total();
      const FitAnswer one_node = what_fits(cfg, 4, 3, limit, 0);
      ASSERT_EQ(one_node.configured, m) << "loco " << loco;
      EXPECT_EQ(what_fits(cfg, 4, 3, limit, 4).to_json(), one_node.to_json()) << "4 ranks a node: one node";
      EXPECT_EQ(what_fits(cfg, 4, 3, limit + staging, 2).to_json(), one_node.to_json()) << "loco " << loco << " m " << m;
      EXPECT_EQ(what_fits(cfg, 4, 3, limit + staging - 1, 2).configured, m - 1) << "loco " << loco << " m " << m;
      // The plan itself: the same difference, whatever the micro-batch.
      EXPECT_EQ(estimate_budget(at_m, 4, 3, 2).total() - estimate_budget(at_m, 4, 3, 0).total(), staging);
    }
  }
}

}  // namespace
