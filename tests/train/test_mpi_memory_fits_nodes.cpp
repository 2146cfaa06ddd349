// test_mpi_memory_fits_nodes.cpp — the start-up memory check plans on the run's nodes (issue 34):
// on 2 emulated nodes (np 2: one rank a node; np 4: two), with ZeRO++'s qgZ, qgZ with LoCo, hpZ,
// MiCS and the gathers that stage packed bytes (qwZ, qwZ in hpZ's group, torch_autocast, MiCS's
// hierarchical gather), the bytes check_memory_fits plans, with the ranks per node planned_ranks_per_node
// finds before any group exists, are byte for byte the plan the engine prints and checks at the
// end (memory_plan.predicted_peak_bytes) and the buffers the run measures (metrics.jsonl memory,
// rank 0's). The check passes at exactly those bytes available and fails one byte short.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "base/errors.hpp"
#include "config/config.hpp"
#include "parallel/nodes.hpp"
#include "parallel/topology.hpp"
#include "train/engine.hpp"
#include "train/estimator.hpp"
#include "zero/shard_groups.hpp"

using namespace zero3d;

namespace {

// ZERO3D_RANKS_PER_NODE for the scope of one test (set on every rank before any collective).
struct EmulatedNodes {
  explicit EmulatedNodes(int k) { setenv("ZERO3D_RANKS_PER_NODE", std::to_string(k).c_str(), 1); }
  ~EmulatedNodes() { unsetenv("ZERO3D_RANKS_PER_NODE"); }
};

// One directory for every rank (rank 0's process id), removed when the test ends.
struct SharedDir {
  std::string path;
  explicit SharedDir(const std::string& name) {
    int rank = 0, pid = static_cast<int>(::getpid());
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Bcast(&pid, 1, MPI_INT, 0, MPI_COMM_WORLD);
    path = ::testing::TempDir() + "zero3d_mpi_" + name + "_" + std::to_string(pid);
    if (rank == 0) std::filesystem::create_directories(path);
    MPI_Barrier(MPI_COMM_WORLD);
  }
  ~SharedDir() {
    MPI_Barrier(MPI_COMM_WORLD);
    int rank = 0;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    if (rank == 0) std::filesystem::remove_all(path);
  }
};

// The engine's start-up and step lines, away from the test's report while it trains.
struct QuietStdout {
  int saved = -1;
  QuietStdout() {
    std::fflush(stdout);
    saved = ::dup(1);
    const int null = ::open("/dev/null", O_WRONLY);
    ::dup2(null, 1);
    ::close(null);
  }
  ~QuietStdout() {
    std::fflush(stdout);
    ::dup2(saved, 1);
    ::close(saved);
  }
};

nlohmann::json last_metrics(const std::string& dir) {
  std::ifstream in(dir + "/metrics.jsonl");
  std::string line, last;
  while (std::getline(in, line))
    if (!line.empty()) last = line;
  return nlohmann::json::parse(last);
}

struct Layout {
  std::string name;
  nlohmann::json zero;
  nlohmann::json sections = nlohmann::json::object();  // further config sections (bf16, torch_autocast)
};

// The node-placed layouts on n ranks in 2 nodes: qgZ's all-to-alls cross them; hpZ's secondary
// group is 2 ranks (one node at np 4, both at np 2); MiCS shards over 2 ranks, and at np 4 also
// over both nodes with the hierarchical gather. And the gathers that stage bytes besides the unit
// (zero.hpp simulate_gather_staging): qwZ (with bf16 parameters, widened and narrowed around the
// quantiser; inside hpZ's group too), torch_autocast's bf16-packed units, the hierarchical gather.
std::vector<Layout> node_placed_layouts(int n) {
  const nlohmann::json qgz = {{"stage", 3}, {"param_persistence_threshold", 0}, {"zero_quantized_gradients", true}};
  nlohmann::json loco = qgz;
  loco["zeropp_loco_param"] = {{"err_beta", 0.8}, {"reset_T", 1024}};
  const nlohmann::json qwz = {{"stage", 3}, {"param_persistence_threshold", 0}, {"zero_quantized_weights", true}};
  nlohmann::json qwz_hpz = qwz;
  qwz_hpz["zero_hpz_partition_size"] = 2;
  const nlohmann::json bf16 = {{"bf16", {{"enabled", true}}}};
  std::vector<Layout> out = {{"qgz", qgz},
                             {"qgz+loco", loco},
                             {"hpz", {{"stage", 3}, {"zero_hpz_partition_size", 2}}},
                             {"mics", {{"stage", 3}, {"mics_shard_size", 2}}},
                             {"qwz", qwz},
                             {"qwz bf16", qwz, bf16},
                             {"qwz+hpz bf16", qwz_hpz, bf16},
                             {"autocast bf16 gathers",
                              {{"stage", 3}, {"param_persistence_threshold", 0}},
                              {{"torch_autocast", {{"enabled", true}, {"dtype", "bfloat16"}}}}}};
  if (n == 4)
    out.push_back({"mics hierarchical", {{"stage", 3}, {"mics_shard_size", 4}, {"mics_hierarchical_params_gather", true}}});
  return out;
}

TEST(MemoryFits, PlansTheRunsNodesAsTheEngineDoes) {
  int n = 1, rank = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  if (n != 2 && n != 4) GTEST_SKIP() << "2 emulated nodes of np/2 ranks: np 2 or 4";
  const EmulatedNodes two_nodes(n / 2);
  const int per_node = planned_ranks_per_node(MPI_COMM_WORLD);
  EXPECT_EQ(per_node, n / 2);
  for (const Layout& l : node_placed_layouts(n)) {
    nlohmann::json j = {{"train_micro_batch_size_per_gpu", 2},
                              {"gradient_accumulation_steps", 1},
                              {"optimizer", {{"type", "AdamW"}, {"params", {{"lr", 1e-3}}}}},
                              {"model", {{"vocab_size", 64}, {"n_positions", 16}, {"n_layer", 2}, {"n_head", 2}, {"n_embd", 32}}},
                              {"training", {{"steps", 2}, {"seed", 7}, {"peak_gflops", 50}}},
                              {"zero_optimization", l.zero}};
    j.update(l.sections);
    const std::string tag = l.name + " np " + std::to_string(n);
    const Config cfg = read_config(j, "plan.json", n);
    const MemoryBudget planned = check_memory_fits(cfg, 1, AvailableMemory{}, per_node);
    // The check compares exactly these bytes with what is available.
    EXPECT_NO_THROW(check_memory_fits(cfg, 1, AvailableMemory{planned.total(), "test"}, per_node)) << tag;
    EXPECT_THROW(check_memory_fits(cfg, 1, AvailableMemory{planned.total() - 1, "test"}, per_node), InputError) << tag;
    const SharedDir dir("memory_fits");
    {
      const QuietStdout quiet;
      ProcessGroups groups(ProcessTopology::pipe_data_model(1, n, 1), MPI_COMM_WORLD, 1, data_shards(cfg.zero));
      Engine engine(cfg, groups, dir.path);
      engine.train();
    }
    MPI_Barrier(MPI_COMM_WORLD);
    if (rank != 0) continue;  // rank 0 writes the metrics; the plan is data rank 0's
    const nlohmann::json row = last_metrics(dir.path), m = row.at("memory");
    EXPECT_EQ(planned.total(), row.at("memory_plan").at("predicted_peak_bytes").get<int64_t>()) << tag;
    EXPECT_EQ(planned.params, m.at("params").get<int64_t>()) << tag;
    EXPECT_EQ(planned.grads, m.at("grads").get<int64_t>()) << tag;
    EXPECT_EQ(planned.master, m.at("master").get<int64_t>()) << tag;
    EXPECT_EQ(planned.optimizer_states, m.at("optimizer_states").get<int64_t>()) << tag;
    EXPECT_EQ(planned.comm_reduce, m.at("comm_buffers").get<int64_t>()) << tag;
    EXPECT_EQ(planned.activations, m.at("activations").get<int64_t>()) << tag;
    const int64_t secondary = m.contains("hpz_secondary") ? m.at("hpz_secondary").get<int64_t>() : 0;
    EXPECT_EQ(planned.comm_gather + planned.comm_prefetch + planned.live_params, m.at("gathered").get<int64_t>() + secondary)
        << tag;
  }
}

}  // namespace
