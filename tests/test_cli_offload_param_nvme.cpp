// test_cli_offload_param_nvme.cpp — parameters swapped from NVMe with the optimizer state in
// host memory (offload_param nvme, offload_optimizer cpu), as DeepSpeed accepts them: the
// offloaded optimizer reads each sub-group's parameters from their swap files, updates them and
// writes them back, so the run trains the losses of the run without offload, bit for bit.
#include <filesystem>

#include "cli_helpers.hpp"

using namespace cli;
namespace fs = std::filesystem;

namespace {

json param_nvme_config(bool bf16) {
  json j = tiny_config();
  j["model"]["vocab_size"] = 61;  // partitions that do not divide evenly
  j["optimizer"]["params"]["weight_decay"] = 0.01;
  j["training"]["steps"] = 6;
  j["zero_optimization"] = {{"stage", 3}};
  if (bf16) j["bf16"] = {{"enabled", true}};
  return j;
}

std::string params_on_nvme(const std::string& swap) {
  return " --set zero_optimization.offload_param.device=nvme --set zero_optimization.offload_param.nvme_path=" + swap;
}

}  // namespace

TEST(OffloadParamNvme, WithTheOptimizerInHostMemoryTrainsTheLossesOfTheRunWithoutOffload) {
  for (bool bf16 : {false, true})
    for (int np : {1, 2}) {
      const std::string tag = std::string(bf16 ? "bf16" : "fp32") + "_np" + std::to_string(np);
      const std::string config = write_config("pnvme_" + tag + ".json", param_nvme_config(bf16));
      const std::string none = temp_path("pnvme_none_" + tag), off = temp_path("pnvme_cpu_" + tag);
      const std::string swap = temp_path("pnvme_swap_" + tag);
      Result r = run("train " + config + " --output " + none, np);
      ASSERT_EQ(r.code, 0) << r.err;
      r = run("train " + config + " --output " + off + params_on_nvme(swap) +
                  " --set zero_optimization.offload_optimizer.device=cpu",
              np);
      ASSERT_EQ(r.code, 0) << r.err;
      const std::vector<double> want = losses_of(read_metrics(none)), got = losses_of(read_metrics(off));
      ASSERT_EQ(want.size(), 6u) << tag;
      EXPECT_EQ(got, want) << tag;
      const json m = read_metrics(off).back()["memory"];
      EXPECT_EQ(m["params"], 0) << tag;  // the partition lies in its swap files
      EXPECT_GT(m["nvme"].get<int64_t>(), 0) << tag;
      EXPECT_GT(read_metrics(off).back()["swap"]["write_bytes"].get<int64_t>(), 0) << tag;  // the step writes them back
      EXPECT_NE(r.out.find("parameter partition on nvme"), std::string::npos) << r.out;
    }
}

TEST(OffloadParamNvme, WithTheOptimizerInDeviceMemoryIsRejectedNamingTheWayOut) {
  const std::string config = write_config("pnvme_reject.json", param_nvme_config(false));
  expect_one_line_rejection(run("validate " + config + params_on_nvme(temp_path("pnvme_swap_reject"))),
                            "`zero_optimization.offload_param`: device \"nvme\" needs offload_optimizer.device \"cpu\" "
                            "or \"nvme\"");
}
