// test_estimator.cpp — DeepSpeed's tables digit for digit (FACTS §6), hand-computed cases,
// live counts, the HDF5 report and the fit search.
#include <gtest/gtest.h>

#include "config/config.hpp"
#include "io/h5.hpp"
#include "model/model.hpp"
#include "train/estimator.hpp"

using namespace zero3d;

namespace {

TEST(DeepSpeedEstimator, Zero2TableFor2851MParamsOn8Gpus) {
  const auto rows = deepspeed_zero2_rows(2851e6, 8, 1);
  EXPECT_EQ(deepspeed_table(rows, 2851e6, -1, 8, 1),
            "Estimated memory needed for params, optim states and gradients for a:\n"
            "HW: Setup with 1 node, 8 GPUs per node.\n"
            "SW: Model with 2851M total params.\n"
            "  per CPU  |  per GPU |   Options\n"
            "  127.45GB |   5.31GB | offload_optimizer=cpu \n"
            "  127.45GB |  11.28GB | offload_optimizer=none\n");
}

TEST(DeepSpeedEstimator, Zero3TableFor2851MParamsAnd32MLargestLayer) {
  const auto rows = deepspeed_zero3_rows(2851e6, 32e6, 8, 1);
  EXPECT_EQ(deepspeed_table(rows, 2851e6, 32e6, 8, 1),
            "Estimated memory needed for params, optim states and gradients for a:\n"
            "HW: Setup with 1 node, 8 GPUs per node.\n"
            "SW: Model with 2851M total params, 32M largest layer params.\n"
            "  per CPU  |  per GPU |   Options\n"
            "   71.69GB |   0.12GB | offload_param=cpu , offload_optimizer=cpu , zero_init=1\n"
            "  127.45GB |   0.12GB | offload_param=cpu , offload_optimizer=cpu , zero_init=0\n"
            "   63.72GB |   0.78GB | offload_param=none, offload_optimizer=cpu , zero_init=1\n"
            "  127.45GB |   0.78GB | offload_param=none, offload_optimizer=cpu , zero_init=0\n"
            "    1.43GB |   6.09GB | offload_param=none, offload_optimizer=none, zero_init=1\n"
            "  127.45GB |   6.09GB | offload_param=none, offload_optimizer=none, zero_init=0\n");
}

TEST(DeepSpeedEstimator, Zero2For7BOnFourNodesOfEightComputedByHand) {
  // total 32 GPUs: offload gpu 2P = 14e9 B; cpu P·max(4·32, 16)·1.5 = 1.344e12 B;
  // none gpu 2P + 18P/32 = 17.9375e9 B; cpu P·4·8·1.5 = 336e9 B (GiB = 2^30).
  const std::string t = deepspeed_table(deepspeed_zero2_rows(7e9, 8, 4), 7e9, -1, 8, 4);
  EXPECT_NE(t.find("HW: Setup with 4 nodes, 8 GPUs per node."), std::string::npos) << t;
  EXPECT_NE(t.find(" 1251.70GB |  13.04GB | offload_optimizer=cpu "), std::string::npos) << t;
  EXPECT_NE(t.find("  312.92GB |  16.71GB | offload_optimizer=none"), std::string::npos) << t;
}

TEST(DeepSpeedEstimator, SingularNounsForOneNodeAndOneGpu) {
  const std::string t = deepspeed_table(deepspeed_zero2_rows(1e9, 1, 1), 1e9, -1, 1, 1);
  EXPECT_NE(t.find("HW: Setup with 1 node, 1 GPU per node."), std::string::npos) << t;
}

TEST(LiveCounts, QuickstartCountsEqualTheModelsParameters) {
  const Config c = read_config(quickstart_json(), "quickstart", 2);
  const ModelCounts counts = count_model(c.model);
  const GPTShape s{c.model.vocab_size, c.model.n_positions, c.model.n_layer, c.model.n_head, c.model.n_embd};
  EXPECT_EQ(counts.params, gpt_layout(s).total());
  // Largest module: mlp.c_fc (4C^2 + 4C) of C = 128, bigger than wte (256·128).
  EXPECT_EQ(counts.largest_layer, 4 * 128 * 128 + 4 * 128);
  EXPECT_EQ(counts.largest_layer_name, "h.0.mlp.c_fc");
}

Config small_config(int stage) {
  nlohmann::json j = quickstart_json();
  j["zero_optimization"] = {{"stage", stage}};
  return read_config(j, "quickstart", 2);
}

TEST(Budget, ModelStatesFollowTheZeroFormulas) {
  const int64_t psi = count_model(small_config(0).model).params;
  const int64_t padded = (psi + 3) / 4 * 4, part = padded / 2;
  EXPECT_EQ(estimate_budget(small_config(0), 2).model_states(), 16 * psi);
  EXPECT_EQ(estimate_budget(small_config(1), 2).model_states(), 8 * padded + 8 * part);
  EXPECT_EQ(estimate_budget(small_config(2), 2).model_states(), 4 * padded + 12 * part);
  EXPECT_EQ(estimate_budget(small_config(3), 2).model_states(), 16 * part);
}

// MiCS partitions over its shard group: on 4 ranks with shard groups of 2, ZeRO-3's states of 2 ranks.
TEST(Budget, MicsModelStatesArePartitionedOverTheShardGroup) {
  Config c = small_config(3);
  const int64_t psi = count_model(c.model).params;
  const int64_t padded = (psi + 3) / 4 * 4, part = padded / 2;
  c.zero.mics_shard_size = 2;
  EXPECT_EQ(estimate_budget(c, 4).model_states(), 16 * part);
  c.zero.mics_shard_size = 0;
  EXPECT_LT(estimate_budget(c, 4).model_states(), 16 * part);
}

TEST(Budget, LargestFittingMicroBatchFitsAndOneMoreDoesNot) {
  Config c = small_config(2);
  const int64_t limit = 200 * 1000 * 1000;
  const int64_t mb = largest_fitting_micro_batch(c, 2, 2, limit, 0);
  ASSERT_GT(mb, 0);
  c.batch.micro_batch = mb;
  EXPECT_LE(estimate_budget(c, 2, 2).total(), limit);
  c.batch.micro_batch = mb + 1;
  EXPECT_GT(estimate_budget(c, 2, 2).total(), limit);
  EXPECT_EQ(largest_fitting_micro_batch(c, 2, 2, 1000, 0), 0);
}

TEST(Budget, ReportRoundTripsThroughHdf5) {
  const Config c = small_config(1);
  std::vector<MemoryBudget> budgets;
  for (int s = 0; s <= 3; ++s) budgets.push_back(estimate_budget(c, 2, s));
  const std::string path = ::testing::TempDir() + "budget.h5";
  write_budget_report(path, c, 2, budgets);
  h5::File f = h5::File::open_read(path);
  int64_t world = 0;
  ASSERT_TRUE(h5::read_attribute(f.id(), "world_size", world));
  EXPECT_EQ(world, 2);
  for (const char* category : {"params", "optimizer_states", "activations", "total"}) {
    const auto values = f.read_floats(category);  // int64 bytes, read back as numbers
    ASSERT_EQ(values.size(), 4u) << category;
    for (int s = 0; s <= 3; ++s)
      EXPECT_FLOAT_EQ(values[s], float(budgets[s].to_json()[category].get<int64_t>())) << category << " stage " << s;
  }
}

// A 2.05B-parameter GPT (L 26, C 2560) in bf16 at ZeRO-3 on 2 ranks, optimizer and parameters on
// NVMe, reduce_bucket_size 5e7 (issue 35). overlap_comm (stage 3's default) double-buffers the
// bucket as DeepSpeed does: the reduction holds two buckets' staging beside the fp32 gradient
// windows, not a buffer of the whole gradient partition (2,855 MiB here before).
Config big_config() {
  nlohmann::json j = {
      {"train_micro_batch_size_per_gpu", 1},
      {"gradient_accumulation_steps", 1},
      {"optimizer", {{"type", "AdamW"}, {"params", {{"lr", 3e-5}}}}},
      {"bf16", {{"enabled", true}}},
      {"model", {{"vocab_size", 256}, {"n_positions", 32}, {"n_layer", 26}, {"n_head", 20}, {"n_embd", 2560}}},
      {"zero_optimization",
       {{"stage", 3}, {"reduce_bucket_size", 50000000}, {"prefetch_bucket_size", 20000000},
        {"max_live_parameters", 100000000}, {"max_reuse_distance", 0}, {"sub_group_size", 20000000},
        {"offload_optimizer", {{"device", "nvme"}, {"nvme_path", "/tmp"}, {"buffer_count", 6}, {"pipeline_read", true}}},
        {"offload_param", {{"device", "nvme"}, {"nvme_path", "/tmp"}, {"max_in_cpu", 100000000}}}}}};
  return read_config(j, "big.json", 2);
}

TEST(Budget, OverlapCommHoldsTwoBucketsNotTheGradientPartition) {
  const Config c = big_config();
  ASSERT_TRUE(c.zero.overlap_comm);
  const MemoryBudget b = estimate_budget(c, 2);
  const int64_t C = 2560, block = 12 * C * C + 13 * C, bucket = 50000000;
  const int64_t windows = 4 * (256 * C + 32 * C + 2 * C + 2 * block);  // embeddings and ln_f, two block windows
  // each of the two slots: a bucket converted to bf16, and at most all of it received
  EXPECT_LE(b.comm_reduce, windows + 2 * (2 * bucket + 2 * bucket));
  EXPECT_GT(b.comm_reduce, windows);
  EXPECT_LT(double(b.total()), 4.0 * 1073741824.0);  // it trains in at most 4 GiB per rank
}

// A save reads the offloaded state back into fp32 staging that lives until the next step
// (ZeroOptimizer::checkpoint_arrays): counted when the run saves.
TEST(Budget, SavesWithNvmeOffloadCountTheirStaging) {
  Config c = big_config();
  c.precision = PrecisionConfig{};  // fp32: parameters and both moments are read back
  c.zero.master_weights = DType::F32;
  const int64_t part = Partition(count_model(c.model).params, 2).part;
  const MemoryBudget none = estimate_budget(c, 2);
  c.training.save_interval = 10;
  const MemoryBudget saving = estimate_budget(c, 2);
  EXPECT_EQ(saving.workspace - none.workspace, 3 * 4 * part + 18 * 1000 * 1000);  // and HDF5's write buffers
}

// The plan counts the offloaded optimizer's page-locked stages with the optimizer's own function
// (offload::host_stage_bytes) and ZeroOptimizer's placement: on a GPU build two stages of the
// largest host sub-group's gradients, two of its parameters where they are updated on a host copy
// (no fp32 master, not swapped), a resident sub-group's master copy where one is read back; none
// where the host is the device (this CPU build's budgets stay as they were).
Config offload_config(int stage, bool bf16, const nlohmann::json& offload_param = {{"device", "none"}}) {
  nlohmann::json j = quickstart_json();
  j["zero_optimization"] = {{"stage", stage},
                            {"sub_group_size", 3000},
                            {"offload_optimizer", {{"device", "cpu"}, {"ratio", 0.5}}},
                            {"offload_param", offload_param}};
  if (bf16) j["bf16"] = {{"enabled", true}};
  return read_config(j, "quickstart", 2);
}

TEST(Budget, OffloadStagesAreTheLargestHostSubGroupsOnAGpuBuildAndNoneOnACpuBuild) {
  // 10000 state elements in sub-groups of 3000, ratio 0.5: [6000, 9000) and [9000, 10000) on the host
  EXPECT_EQ(offload_stage_bytes(offload_config(2, false), 2, 10000, /*host_is_device=*/false), 2 * 3000 * 4 + 2 * 3000 * 4);
  // bf16 with its fp32 master copy: bf16 gradients, the master of a resident sub-group read back
  EXPECT_EQ(offload_stage_bytes(offload_config(2, true), 2, 10000, false), 2 * 3000 * 2 + 3000 * 4);
  // stage 3 with the parameters in swap files: the step reads them into host memory itself
  const nlohmann::json nvme = {{"device", "nvme"}, {"nvme_path", "/tmp"}};
  EXPECT_EQ(offload_stage_bytes(offload_config(3, false, nvme), 3, 10000, false), 2 * 3000 * 4);
  // ... and in page-locked host memory (offload_param cpu), which the CPU optimizer updates in place
  EXPECT_EQ(offload_stage_bytes(offload_config(3, false, {{"device", "cpu"}}), 3, 10000, false), 2 * 3000 * 4);
  EXPECT_EQ(offload_stage_bytes(offload_config(3, false), 3, 10000, false), 2 * 3000 * 4 + 2 * 3000 * 4);
  // the same figure as the optimizer's
  EXPECT_EQ(offload_stage_bytes(offload_config(2, true), 2, 12345, false),
            offload::host_stage_bytes(12345, 3000, 0.5, DType::BF16, DType::BF16, true, true, false).total());
  EXPECT_EQ(offload_stage_bytes(offload_config(2, true), 2, 10000, /*host_is_device=*/true), 0);
  EXPECT_EQ(offload_stage_bytes(small_config(2), 2, 10000, false), 0);  // no offload
  EXPECT_EQ(offload_stage_bytes(offload_config(2, false), 0, 10000, false), 0);  // stage 0 keeps the optimizer in memory
}

// Where the plan's bytes must fit: one memory on a CPU build (the total, for the host check and
// the device check alike); on a GPU build the device holds what offload and cpu_checkpointing do
// not put in host memory, and the host those tiers and the process's runtime.
TEST(Budget, ACpuBuildNeedsTheTotalInOneMemoryAndAGpuBuildSplitsItBetweenDeviceAndHost) {
  MemoryBudget b = estimate_budget(offload_config(3, true, {{"device", "cpu"}}), 2);
  ASSERT_GT(b.host_total(), b.params);  // the partition and the optimizer's offloaded sub-groups
  EXPECT_EQ(b.backend, kernels::kBuildBackend);  // a config read without --device plans this build
  EXPECT_EQ(b.device_need() + (kernels::kGpuBuild ? b.host_total() : 0), b.total());
  b.backend = kernels::Backend::Cpu;
  EXPECT_EQ(b.device_need(), b.total());
  EXPECT_EQ(b.host_need(), b.total());
  b.backend = kernels::Backend::Gpu;
  EXPECT_EQ(b.device_need(), b.total() - b.host_total());
  EXPECT_EQ(b.host_need(), b.host_total() + b.runtime);
}

// A GPU build's "auto" micro-batch fits the device's memory over the ranks its busiest device
// serves: 8 ranks of a node on 8 devices have one each, 8 on 2 share four to a device, 3 on 2 put
// two on device 0.
TEST(Budget, AGpuBuildsAutoMicroBatchSharesTheDeviceAmongItsRanks) {
  const int64_t gb = 1000 * 1000 * 1000;
  EXPECT_EQ(device_bytes_per_rank(80 * gb, 8, 8), 80 * gb);
  EXPECT_EQ(device_bytes_per_rank(80 * gb, 2, 8), 20 * gb);
  EXPECT_EQ(device_bytes_per_rank(80 * gb, 2, 3), 40 * gb);
  EXPECT_EQ(device_bytes_per_rank(80 * gb, 1, 1), 80 * gb);
  EXPECT_EQ(device_bytes_per_rank(80 * gb, 0, 0), 80 * gb);  // nothing reported: one device, one rank
}

// A GPU build stops before allocating when the ranks sharing a device need more than it has free,
// and says by how much and what lowers the plan.
TEST(Budget, DeviceShortfallCountsTheRanksSharingTheDevice) {
  const int64_t mb = 1000 * 1000;
  EXPECT_EQ(device_memory_shortfall(40 * mb, 2, 80 * mb, "H100 (device 0)"), "");
  const std::string one = device_memory_shortfall(90 * mb, 1, 80 * mb, "H100 (device 0)");
  EXPECT_NE(one.find("90.0 MB per rank, but H100 (device 0) has 80.0 MB free (10.0 MB short)"), std::string::npos) << one;
  EXPECT_NE(one.find("train_micro_batch_size_per_gpu"), std::string::npos) << one;
  const std::string shared = device_memory_shortfall(50 * mb, 2, 80 * mb, "H100 (device 0)");
  EXPECT_NE(shared.find("50.0 MB per rank x 2 ranks sharing the device"), std::string::npos) << shared;
  EXPECT_NE(shared.find("(20.0 MB short)"), std::string::npos) << shared;
}

}  // namespace

