// test_cli_offload_param_nvme.cpp — parameters swapped from NVMe with the optimizer state in
// memory (offload_param nvme, offload_optimizer none) or in host memory (cpu), as DeepSpeed
// accepts them: the offloaded optimizer reads each sub-group's parameters from their swap files,
// updates them and writes them back; the in-memory one updates the fp32 master copy and writes
// the 16-bit parameters back, or (fp32, no master copy) reads the partition for the step. Each
// trains the losses of the run without offload, bit for bit.
#include <filesystem>

#include "support/cli_helpers.hpp"

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

TEST(OffloadParamNvme, WithTheOptimizerInMemoryOrOffloadedTrainsTheLossesOfTheRunWithoutOffload) {
  for (bool bf16 : {false, true})
    for (int np : {1, 2}) {
      const std::string tag = std::string(bf16 ? "bf16" : "fp32") + "_np" + std::to_string(np);
      const std::string config = write_config("pnvme_" + tag + ".json", param_nvme_config(bf16));
      const std::string none = temp_path("pnvme_none_" + tag);
      Result r = run("train " + config + " --output " + none, np);
      ASSERT_EQ(r.code, 0) << r.err;
      const std::vector<double> want = losses_of(read_metrics(none));
      ASSERT_EQ(want.size(), 6u) << tag;
      for (const std::string optimizer : {"none", "cpu"}) {
        const std::string off = temp_path("pnvme_" + optimizer + "_" + tag), swap = temp_path("pnvme_swap_" + tag);
        r = run("train " + config + " --output " + off + params_on_nvme(swap) +
                    " --set zero_optimization.offload_optimizer.device=" + optimizer,
                np);
        ASSERT_EQ(r.code, 0) << r.err;
        EXPECT_EQ(losses_of(read_metrics(off)), want) << tag << ", optimizer " << optimizer;
        const json last = read_metrics(off).back();
        EXPECT_EQ(last["memory"]["params"], 0) << tag;  // the partition lies in its swap files
        EXPECT_GT(last["memory"]["nvme"].get<int64_t>(), 0) << tag;
        EXPECT_GT(last["swap"]["write_bytes"].get<int64_t>(), 0) << tag;  // the step writes them back
        EXPECT_NE(r.out.find("parameter partition on nvme"), std::string::npos) << r.out;
        if (optimizer == "none") {
          EXPECT_NE(r.out.find("optimizer state in device memory"), std::string::npos) << r.out;
        }
      }
    }
}

// The sglang example's config (an inference config from DeepSpeedExamples): parameters on NVMe,
// nothing else offloaded; it validates with its own nvme_path replaced by a writable one.
TEST(OffloadParamNvme, TheSglangOffloadConfigValidates) {
  const Result r = run("validate " + kSource + "/tests/configs/dsexamples__inference__sglang__ds_offload_nvme_aio.json" +
                       " --set zero_optimization.offload_param.nvme_path=" + temp_path("pnvme_sglang"));
  EXPECT_EQ(r.code, 0) << r.err;
}
