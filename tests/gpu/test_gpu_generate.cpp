// test_gpu_generate.cpp — the `gpu` label's generation checks, through the executable as users
// run it: a model trained on the GPU generates, greedily from its checkpoint, the ids the CPU
// build generates from the same checkpoint (GPT-2 and the Llama family; prefill, the KV cache
// and the cached attention on the device), a left-padded batch gives each prompt's unbatched ids
// there, and two ranks sharing the GPU as two pipeline stages or two tensor ranks give one rank's.
#include <gtest/gtest.h>

#include <cstdlib>
#include <fstream>
#include <string>
#include <vector>

#include "support/cli_helpers.hpp"

namespace {

using namespace cli;

// Prompts of three lengths (a batch of them is left-padded), ids below every test model's vocabulary.
const std::vector<std::string> kPrompts = {"5,17,3,44,9,28,61,2", "11,7", "40,2,19,33,8"};

// The ids each prompt generated, from `generate --json`'s outputs.
std::vector<std::vector<int64_t>> generated(const std::string& out) {
  const size_t at = out.rfind("\n{");
  const json doc = json::parse(at == std::string::npos ? out : out.substr(at + 1));
  std::vector<std::vector<int64_t>> ids;
  for (const json& o : doc.at("outputs")) ids.push_back(o.at("tokens").get<std::vector<int64_t>>());
  return ids;
}

std::string prompts_file() {
  const std::string path = temp_path("prompts.txt");
  std::ofstream f(path);
  for (const std::string& p : kPrompts) f << p << "\n";
  return path;
}

// A checkpoint of `model` after 10 steps on the GPU (one rank), in a directory of `test`'s own.
std::string train_on_gpu(const std::string& model, const std::string& test) {
  const std::string dir = temp_path(model + "_" + test);
  const Result r = run("train " + kSource + "/input/" + model + ".json --output " + dir +
                           " --set training.steps=10 --set training.save_interval=10",
                       1);
  EXPECT_EQ(r.code, 0) << r.err;
  return dir + "/checkpoints";
}

std::string generate_args(const std::string& model, const std::string& checkpoint, const std::string& prompts,
                          int batch) {
  return "generate " + kSource + "/input/" + model + ".json --checkpoint " + checkpoint + " --prompt-ids-file " +
         prompts + " --batch-size " + std::to_string(batch) + " --max-new-tokens 24 --greedy --json";
}

TEST(GpuGenerate, GreedyIdsFromAGpuCheckpointEqualTheCpuBuilds) {
  const char* cpu_exe = std::getenv("ZERO3D_CPU_EXE");
  if (cpu_exe == nullptr) GTEST_SKIP() << "ZERO3D_CPU_EXE (the CPU build's zero3d) is not set";
  const std::string prompts = prompts_file();
  for (const std::string model : {"quickstart", "llama-tiny"}) {
    const std::string checkpoint = train_on_gpu(model, "vs_cpu");
    const Result gpu = run(generate_args(model, checkpoint, prompts, 3), 1);
    ASSERT_EQ(gpu.code, 0) << gpu.err;
    const std::string out = temp_path("cpu_generate.txt");
    const int status = std::system((std::string(cpu_exe) + " " + generate_args(model, checkpoint, prompts, 3) + " >" +
                                    out + " 2>&1")
                                       .c_str());
    ASSERT_EQ(status, 0) << slurp(out);
    const auto on_gpu = generated(gpu.out), on_cpu = generated(slurp(out));
    ASSERT_EQ(on_gpu.size(), kPrompts.size()) << model;
    EXPECT_EQ(on_gpu, on_cpu) << model << ": the GPU's greedy ids differ from the CPU build's";
  }
}

TEST(GpuGenerate, ALeftPaddedBatchGivesEachPromptsUnbatchedIds) {
  const std::string prompts = prompts_file();
  for (const std::string model : {"quickstart", "llama-tiny"}) {
    const std::string checkpoint = train_on_gpu(model, "batched");
    const Result batched = run(generate_args(model, checkpoint, prompts, 3), 1);
    const Result alone = run(generate_args(model, checkpoint, prompts, 1), 1);
    ASSERT_EQ(batched.code, 0) << batched.err;
    ASSERT_EQ(alone.code, 0) << alone.err;
    EXPECT_EQ(generated(batched.out), generated(alone.out)) << model;
  }
}

// Decode over stages on the device: each stage's KV cache and cached attention in its own rank's
// model memory, the hidden states crossing between stages through the host-staged
// communicator; and over two tensor ranks, each with its heads' cache. One rank's ids all the same.
TEST(GpuGenerate, TwoStagesOrTwoTensorRanksSharingTheGpuGiveOneRanksIds) {
  const std::string prompts = prompts_file();
  for (const std::string model : {"quickstart", "llama-tiny"}) {
    const std::string checkpoint = train_on_gpu(model, "layouts");
    const Result one = run(generate_args(model, checkpoint, prompts, 1), 1);
    ASSERT_EQ(one.code, 0) << one.err;
    ASSERT_EQ(generated(one.out).size(), kPrompts.size()) << model;
    for (const std::string layout : {"pipeline.stages=2", "tensor_parallel.autotp_size=2"}) {
      const Result two = run(generate_args(model, checkpoint, prompts, 1) + " --set " + layout, 2);
      ASSERT_EQ(two.code, 0) << model << " " << layout << ": " << two.err;
      EXPECT_EQ(generated(two.out), generated(one.out)) << model << " " << layout;
    }
  }
}

}  // namespace
