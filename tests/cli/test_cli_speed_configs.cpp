// test_cli_speed_configs.cpp — the shipped speed configs stay what benchmarks/bf16_speed.sh
// measures (issue 17): GPT-2 small's real shape, valid at two ranks. Validation only: training
// the 124M model is a benchmark, not a test.
#include <fstream>

#include "support/cli_helpers.hpp"

using json = nlohmann::json;
using namespace cli;

TEST(SpeedConfigs, Gpt2SmallIsTheRealGpt2ShapeAndValidatesAtTwoRanks) {
  const std::string path = kSource + "/input/gpt2-124m.json";
  std::ifstream in(path);
  ASSERT_TRUE(in) << path;
  const json model = json::parse(in)["model"];
  EXPECT_EQ(model["vocab_size"], 50257);
  EXPECT_EQ(model["n_positions"], 1024);
  EXPECT_EQ(model["n_layer"], 12);
  EXPECT_EQ(model["n_head"], 12);
  EXPECT_EQ(model["n_embd"], 768);
  const Result r = run("validate " + path + " --world-size 2");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("valid for 2 ranks"), std::string::npos) << r.out;
}
