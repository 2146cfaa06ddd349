// frozen_model.hpp — the frozen-parameter tests' model (tests/cli/test_cli_frozen.cpp,
// test_cli_quantized_frozen.cpp): tests/golden/make_frozen_goldens.py's tiny GPT-2, its frozen
// patterns, and what the tests do with a run of it (train, convert, name its tensors).
#pragma once

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <regex>
#include <string>
#include <vector>

#include "support/cli_helpers.hpp"

namespace cli {

inline const std::string kFrozenGoldenDir = kSource + "/tests/golden";
// The reference's patterns (make_frozen_goldens.py FROZEN): block 0, wpe and one bias of block 1.
inline const std::vector<std::string> kFrozen = {R"(^h\.0\.)", R"(wpe\.weight)", R"(h\.1\.mlp\.c_fc\.bias)"};
// The tiny GPT-2's 28,032 parameters, of which block 0 (12,704), wpe (512) and h.1.mlp.c_fc.bias
// (128) are frozen.
constexpr int64_t kPsi = 28032, kFrozenNumel = 12704 + 512 + 128;

// The tiny GPT-2 from `init` with the reference's tensors frozen.
inline json frozen_model_section(const std::string& init) {
  json m = tiny_model(init);
  m["frozen_parameters"] = kFrozen;
  return m;
}

// The reference's run: its initial weights and tokens, AdamW with weight decay, clipping 0.5,
// six steps saved every three, at ZeRO `stage` and `micro_batch` of 8 samples a step.
inline json frozen_golden_config(int stage, int64_t micro_batch,
                                 const std::string& init = kFrozenGoldenDir + "/frozen_init.h5") {
  return json{{"train_batch_size", 8},
              {"train_micro_batch_size_per_gpu", micro_batch},
              {"gradient_clipping", 0.5},
              {"optimizer",
               {{"type", "AdamW"},
                {"params", {{"lr", 1e-2}, {"betas", {0.9, 0.999}}, {"eps", 1e-8}, {"weight_decay", 0.1}}}}},
              {"model", frozen_model_section(init)},
              {"data", {{"source", "tokens"}, {"path", kFrozenGoldenDir + "/frozen_tokens.bin"}}},
              {"zero_optimization", {{"stage", stage}}},
              {"training", {{"steps", 6}, {"seed", 7}, {"peak_gflops", 50}, {"save_interval", 3}}}};
}

// Trains config c into a fresh folder named `name` at np ranks; the folder.
inline std::string train_frozen(const json& c, const std::string& name, int np, const std::string& args = "",
                                const std::string& prefix = "") {
  const std::string dir = temp_path(name);
  std::system(("rm -rf " + dir).c_str());
  const Result r = run("train " + write_config(name + ".json", c) + " --output " + dir + " " + args, np, prefix);
  EXPECT_EQ(r.code, 0) << r.out << r.err;
  return dir;
}

// The run's weights at a checkpoint tag, converted to Hugging Face names (fp32).
inline std::string converted(const std::string& dir, const std::string& tag = "global_step6") {
  const std::string out = dir + "/hf/weights.h5";  // beside its own config.json, not the run's
  const Result r = run("convert " + dir + "/checkpoints --tag " + tag + " " + out);
  EXPECT_EQ(r.code, 0) << r.err;
  return out;
}

inline bool is_frozen(const std::string& name) {
  for (const std::string& p : kFrozen)
    if (std::regex_search(name, std::regex(p))) return true;
  return false;
}

// fp32 rounded to bf16, nearest-even (the data holds no NaN).
inline float bf16_rounded(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  u = (u + 0x7FFFu + ((u >> 16) & 1u)) & 0xFFFF0000u;
  std::memcpy(&x, &u, 4);
  return x;
}

// The layout's tensors in order (model_layout.cpp: wte, wpe, the blocks, ln_f).
inline std::vector<std::string> tensor_names() {
  std::vector<std::string> out = {"wte.weight", "wpe.weight"};
  for (int l = 0; l < 2; ++l)
    for (const char* t : {"ln_1.weight", "ln_1.bias", "attn.c_attn.weight", "attn.c_attn.bias", "attn.c_proj.weight",
                          "attn.c_proj.bias", "ln_2.weight", "ln_2.bias", "mlp.c_fc.weight", "mlp.c_fc.bias",
                          "mlp.c_proj.weight", "mlp.c_proj.bias"})
      out.push_back("h." + std::to_string(l) + "." + t);
  out.push_back("ln_f.weight");
  out.push_back("ln_f.bias");
  return out;
}

}  // namespace cli
