// model.make_vocab_size_divisible_by (Megatron's key), black-box: a padded vocabulary trains to
// the unpadded losses (GPT-2's tied head, a Llama's untied one; t = 1 and t = 2), a checkpoint
// saved at one padding resumes at another and at another layout, `zero3d convert` writes the
// same bytes, generation picks the same tokens, the memory plan counts the padding rows, and a
// value that is not a positive integer is refused naming the key.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "support/cli_helpers.hpp"
#include "support/file_bytes.hpp"

using namespace cli;

namespace {

// V = 61: padded to 128 (multiple 128), 64 (multiple 64 × t 1), 128 (multiple 64 × t 2). AdamW
// with weight decay: decay would move any padding row that were not zero.
json gpt2_config() {
  return json{{"train_batch_size", 8},
              {"train_micro_batch_size_per_gpu", 4},
              {"optimizer", {{"type", "AdamW"}, {"params", {{"lr", 1e-2}, {"weight_decay", 0.1}}}}},
              {"model", {{"vocab_size", 61}, {"n_positions", 16}, {"n_layer", 2}, {"n_head", 4}, {"n_embd", 32}}},
              {"training", {{"steps", 6}, {"seed", 5}, {"peak_gflops", 50}}},
              {"steps_per_print", 100}};
}

json llama_config() {
  json c = gpt2_config();
  c["model"] = {{"architecture", "llama"}, {"vocab_size", 61}, {"hidden_size", 32}, {"intermediate_size", 48},
                {"num_hidden_layers", 2}, {"num_attention_heads", 4}, {"num_key_value_heads", 2},
                {"seq_length", 16}, {"max_position_embeddings", 64}, {"tie_word_embeddings", false}};
  return c;
}

json config_of(const std::string& family) { return family == "llama" ? llama_config() : gpt2_config(); }

std::string padding(int64_t multiple) {
  return " --set model.make_vocab_size_divisible_by=" + std::to_string(multiple);
}

struct TrainRun {
  int code;
  std::string out;
  std::vector<double> losses;
};

TrainRun train(const std::string& family, int np, const std::string& name, const std::string& args) {
  const std::string config = write_config(family + "_pad.json", config_of(family));
  const std::string dir = temp_path("pad_" + name);
  std::system(("rm -rf " + dir).c_str());
  const Result r = run("train " + config + " --output " + dir + " " + args, np);
  return {r.code, r.out + r.err, losses_of(read_metrics(dir))};
}

struct Case {
  std::string family;
  int np, t;
  std::string layout;
  int64_t multiple;
  std::string name;
};
void PrintTo(const Case& c, std::ostream* os) { *os << c.name; }

class PaddedVocabulary : public ::testing::TestWithParam<Case> {};

TEST_P(PaddedVocabulary, TrainsToTheUnpaddedLossesWithinOneInAMillion) {
  const Case& c = GetParam();
  const TrainRun plain = train(c.family, c.np, c.name + "_plain", c.layout + padding(1));
  const TrainRun padded = train(c.family, c.np, c.name, c.layout + padding(c.multiple));
  ASSERT_EQ(plain.code, 0) << plain.out;
  ASSERT_EQ(padded.code, 0) << padded.out;
  ASSERT_EQ(padded.losses.size(), 6u);
  expect_losses_close(padded.losses, plain.losses, 1e-6, c.name);
  const int64_t unit = c.multiple * c.t, vp = (61 + unit - 1) / unit * unit;
  const std::string said = c.t == 1 ? "vocab   padded 61 -> " + std::to_string(vp) : "vocabulary padded 61 -> " + std::to_string(vp);
  EXPECT_NE(padded.out.find(said), std::string::npos) << padded.out;
  EXPECT_EQ(plain.out.find("vocab   padded"), std::string::npos) << plain.out;  // nothing to say unpadded
}

INSTANTIATE_TEST_SUITE_P(
    FamiliesAndLayouts, PaddedVocabulary,
    ::testing::Values(Case{"gpt2", 1, 1, "", 128, "gpt2_t1_128"},
                      Case{"gpt2", 2, 2, "--set tensor_parallel.autotp_size=2", 64, "gpt2_t2_64"},
                      // the last stage's tied wte copy (DeepSpeed's TiedLayerSpec) padded as the first's
                      Case{"gpt2", 2, 1, "--set pipeline.stages=2 --set zero_optimization.stage=1", 128, "gpt2_p2_128"},
                      Case{"llama", 1, 1, "", 128, "llama_t1_128"},
                      Case{"llama", 2, 2, "--set tensor_parallel.autotp_size=2", 64, "llama_t2_64"}),
    [](const ::testing::TestParamInfo<Case>& info) { return info.param.name; });

// Checkpoints hold the real V rows: a save at one padding (and layout) resumes at another and
// continues the saving run's losses.
TEST(PaddedVocabulary, CheckpointsResumeAcrossPaddingsAndLayouts) {
  const TrainRun saved = train("gpt2", 1, "saved128", padding(128) + " --set training.save_interval=3");
  ASSERT_EQ(saved.code, 0) << saved.out;
  ASSERT_EQ(saved.losses.size(), 6u);
  const std::vector<double> tail(saved.losses.begin() + 3, saved.losses.end());
  const std::string tag = temp_path("pad_saved128") + "/checkpoints/global_step3";
  for (const auto& [np, args] : std::vector<std::pair<int, std::string>>{
           {1, padding(1)}, {2, padding(64) + " --set tensor_parallel.autotp_size=2"}}) {
    const TrainRun r = train("gpt2", np, "resumed", "--set training.resume=" + tag + args);
    ASSERT_EQ(r.code, 0) << r.out;
    expect_losses_close(r.losses, tail, 1e-6, "resumed at np " + std::to_string(np) + args);
  }
  // and the other way round: unpadded at t = 2, resumed padded at t = 1
  const TrainRun plain = train("llama", 2, "saved1", padding(1) + " --set tensor_parallel.autotp_size=2 "
                                                                   "--set training.save_interval=3");
  ASSERT_EQ(plain.code, 0) << plain.out;
  ASSERT_EQ(plain.losses.size(), 6u);
  const TrainRun r = train("llama", 1, "resumed_llama",
                           "--set training.resume=" + temp_path("pad_saved1") + "/checkpoints/global_step3" + padding(128));
  ASSERT_EQ(r.code, 0) << r.out;
  expect_losses_close(r.losses, std::vector<double>(plain.losses.begin() + 3, plain.losses.end()), 1e-6,
                      "llama resumed padded");
  const Result inspect = run("inspect " + temp_path("pad_saved128") + "/checkpoints --tag global_step6 --json");
  ASSERT_EQ(inspect.code, 0) << inspect.err;
  const json report = json::parse(inspect.out);
  for (const json& ts : report.at("tensors"))
    if (ts.at("name") == "wte.weight") {
      EXPECT_EQ(ts.at("shape"), json::array({61, 32}));
    }
}

// The converted weights hold the real V rows and nothing else: from the same parameters (one
// step at lr 0 keeps the initial ones exactly), the same bytes at every padding.
TEST(PaddedVocabulary, ConvertWritesTheSameBytes) {
  std::vector<std::string> files;
  for (const std::string& family : {std::string("gpt2"), std::string("llama")})
    for (int64_t multiple : {1, 128}) {
      const std::string name = family + "_convert" + std::to_string(multiple);
      const TrainRun r = train(family, 1, name, padding(multiple) + " --set training.steps=1 --set optimizer.params.lr=0 "
                                                                    "--set training.save_interval=1");
      ASSERT_EQ(r.code, 0) << r.out;
      const std::string out = temp_path(name + "_hf");  // weights and Hugging Face's config.json
      const Result c = run("convert " + temp_path("pad_" + name) + "/checkpoints " + out + "/model.safetensors");
      ASSERT_EQ(c.code, 0) << c.err;
      files.push_back(zero3d::test::read_bytes(out + "/model.safetensors") + zero3d::test::read_bytes(out + "/config.json"));
    }
  ASSERT_EQ(files.size(), 4u);
  EXPECT_FALSE(files[0].empty());
  EXPECT_TRUE(files[0] == files[1]) << "gpt2: the padded run's files differ";
  EXPECT_TRUE(files[2] == files[3]) << "llama: the padded run's files differ";
  const zero3d::test::Safetensors st = zero3d::test::read_safetensors(temp_path("llama_convert128_hf") + "/model.safetensors");
  EXPECT_EQ(st.header.at("model.embed_tokens.weight").at("shape"), json::array({61, 32}));
  EXPECT_EQ(st.header.at("lm_head.weight").at("shape"), json::array({61, 32}));
}

// Generation reads the padded head's real columns only: from a trained checkpoint, greedy and
// sampled tokens are the unpadded model's, every one a real id.
TEST(PaddedVocabulary, GenerationPicksTheUnpaddedTokens) {
  for (const std::string& family : {std::string("gpt2"), std::string("llama")}) {
    const std::string config = write_config(family + "_gen_pad.json", config_of(family));
    const TrainRun trained = train(family, 1, family + "_gen", "--set optimizer.params.lr=3e-2 --set training.steps=12 "
                                                               "--set training.save_interval=12");
    ASSERT_EQ(trained.code, 0) << trained.out;
    const std::string checkpoint = " --checkpoint " + temp_path("pad_" + family + "_gen") + "/checkpoints";
    std::vector<json> outputs;
    for (const std::string& how : {std::string("--greedy"), std::string("--temperature 1.5 --seed 3")})
      for (int64_t multiple : {1, 128}) {
        const Result r = run("generate " + config + checkpoint + " --prompt-ids 1,60,7 --max-new-tokens 12 --eos-id -1 " +
                             how + padding(multiple) + " --json");
        ASSERT_EQ(r.code, 0) << r.out << r.err;
        const std::string out = r.out.substr(0, r.out.find_last_not_of('\n') + 1);
        outputs.push_back(json::parse(out.substr(out.find_last_of('\n') + 1)).at("outputs").at(0).at("tokens"));
      }
    EXPECT_EQ(outputs[1], outputs[0]) << family << " greedy";
    EXPECT_EQ(outputs[3], outputs[2]) << family << " sampled";
    for (const json& tokens : outputs) {
      EXPECT_EQ(tokens.size(), 12u) << family;
      for (const json& id : tokens) EXPECT_LT(id.get<int>(), 61) << family;
    }
  }
}

// The plan counts what the run allocates: (Vp − V)·C more parameters, gradients and AdamW
// states (fp32, ZeRO 0), and B·T·(Vp − V) more logits.
TEST(PaddedVocabulary, MemoryPlanCountsThePaddingRows) {
  const std::string config = write_config("gpt2_plan_pad.json", gpt2_config());
  std::vector<json> plans;
  for (int64_t multiple : {1, 128}) {
    const Result r = run("estimate --config " + config + " --world-size 1 --json" + padding(multiple));
    ASSERT_EQ(r.code, 0) << r.err;
    plans.push_back(json::parse(r.out));
  }
  const json& plain = plans[0].at("budgets").at(0);  // ZeRO stage 0
  const json& padded = plans[1].at("budgets").at(0);
  const int64_t rows = (128 - 61) * 32;
  EXPECT_EQ(padded.at("params").get<int64_t>() - plain.at("params").get<int64_t>(), 4 * rows);
  EXPECT_EQ(padded.at("grads").get<int64_t>() - plain.at("grads").get<int64_t>(), 4 * rows);
  EXPECT_EQ(padded.at("optimizer_states").get<int64_t>() - plain.at("optimizer_states").get<int64_t>(), 2 * 4 * rows);
  EXPECT_EQ(padded.at("activations").get<int64_t>() - plain.at("activations").get<int64_t>(), 4 * 4 * 16 * (128 - 61));
}

// Only a positive integer is a multiple: anything else exits 2 with one line naming the key.
TEST(PaddedVocabulary, AValueThatIsNotAPositiveIntegerIsRefusedNamingTheKey) {
  const std::string config = write_config("gpt2_bad_pad.json", gpt2_config());
  for (const char* bad : {"0", "-128", "1.5", "'\"128\"'", "true"}) {
    const Result r = run("validate " + config + " --set model.make_vocab_size_divisible_by=" + bad);
    expect_one_line_rejection(r, "model.make_vocab_size_divisible_by");
  }
}

}  // namespace
