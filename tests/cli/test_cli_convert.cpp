// test_cli_convert.cpp — `zero3d convert` as Hugging Face users need it (issue 19): the format
// follows the extension, shards and index carry Hugging Face's names, config.json and the model
// shape travel with the weights, fp16 rounds as torch's .half(), stale shards of an earlier
// convert go, long conversions report progress; and model.init_from takes exactly the model's
// tensors.
#include <gtest/gtest.h>
#include <hdf5.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <vector>

#include "io/h5.hpp"
#include "support/cli_helpers.hpp"
#include "support/file_bytes.hpp"

using json = nlohmann::json;
using namespace cli;
using namespace zero3d::test;  // read_bytes, read_safetensors
namespace fs = std::filesystem;

namespace {

// A tiny GPT (V 256, T 16, L 2, H 2, C 32) trained on a text whose period divides B·T: every
// micro-batch is the same window, so a run started from converted weights sees the batch the
// checkpointed run saw next. Saved at step 10 of 11.
struct Trained {
  std::string config, dir;
  std::string checkpoints() const { return dir + "/checkpoints --tag global_step10"; }
  double loss_after_step10() const { return losses_of(read_metrics(dir))[10]; }
};

json periodic_config() {
  const std::string text = temp_path("periodic.txt");
  {
    std::ofstream out(text);
    for (int i = 0; i < 400; ++i) out << "zero3d trains GPT models, fast!\n";  // 32 bytes = B·T
  }
  return json{{"train_batch_size", 2},
              {"train_micro_batch_size_per_gpu", 2},
              {"optimizer", {{"type", "AdamW"}, {"params", {{"lr", 3e-3}}}}},
              {"model", {{"vocab_size", 256}, {"n_positions", 16}, {"n_layer", 2}, {"n_head", 2}, {"n_embd", 32}}},
              {"data", {{"source", "text"}, {"path", text}}},
              {"training", {{"steps", 11}, {"seed", 7}, {"peak_gflops", 50}, {"save_interval", 10}}}};
}

const Trained& trained() {
  static const Trained t = [] {
    Trained r{write_config("periodic.json", periodic_config()), temp_path("trained")};
    const Result run_result = run("train " + r.config + " --output " + r.dir, 1);
    EXPECT_EQ(run_result.code, 0) << run_result.err;
    return r;
  }();
  return t;
}

// The first loss of one step from `weights` with the trained run's config and `sets`.
Result train_from(const std::string& weights, const std::string& out, const std::string& sets = "") {
  std::system(("rm -rf " + out).c_str());
  return run("train " + trained().config + " --output " + out +
                 " --set training.steps=1 --set training.save_interval=0 --set model.init_from=" + weights + " " + sets,
             1);
}

double first_loss(const std::string& out) { return losses_of(read_metrics(out)).at(0); }


bool is_hdf5(const std::string& path) { return read_bytes(path).compare(0, 8, "\x89HDF\r\n\x1a\n") == 0; }


std::vector<uint16_t> halves_of(const Safetensors& s, const std::string& name) {
  const auto offsets = s.header.at(name).at("data_offsets").get<std::vector<size_t>>();
  std::vector<uint16_t> out((offsets[1] - offsets[0]) / 2);
  std::memcpy(out.data(), s.data.data() + offsets[0], out.size() * 2);
  return out;
}

std::vector<float> floats_of(const Safetensors& s, const std::string& name) {
  const auto offsets = s.header.at(name).at("data_offsets").get<std::vector<size_t>>();
  std::vector<float> out((offsets[1] - offsets[0]) / 4);
  std::memcpy(out.data(), s.data.data() + offsets[0], out.size() * 4);
  return out;
}

// torch's .half(): round to nearest even, beyond the range to inf (F16C / _Float16).
uint16_t half_bits(float x) {
  const _Float16 h = static_cast<_Float16>(x);
  uint16_t bits;
  std::memcpy(&bits, &h, 2);
  return bits;
}

std::set<std::string> files_in(const std::string& dir) {
  std::set<std::string> names;
  for (const auto& e : fs::directory_iterator(dir)) names.insert(e.path().filename().string());
  return names;
}

// --- the format follows the extension ---------------------------------------------------------

class ConvertByExtension : public ::testing::TestWithParam<std::string> {};

TEST_P(ConvertByExtension, WritesThatFormatUnderThatNameAndReloadsToTheSameLoss) {
  const std::string ext = GetParam(), dir = temp_path("by_ext" + ext), out = dir + "/model" + ext;
  const Result c = run("convert " + trained().checkpoints() + " " + out);
  ASSERT_EQ(c.code, 0) << c.err;
  EXPECT_EQ(files_in(dir), (std::set<std::string>{"model" + ext, "config.json"}));
  if (ext == ".safetensors") {
    EXPECT_FALSE(is_hdf5(out));
    EXPECT_EQ(read_safetensors(out).header.at("wte.weight").at("dtype"), "F32");
  } else {
    EXPECT_TRUE(is_hdf5(out));
  }
  ASSERT_EQ(train_from(out, temp_path("by_ext_run")).code, 0);
  EXPECT_EQ(first_loss(temp_path("by_ext_run")), trained().loss_after_step10());  // same weights and batch: same bits
}

INSTANTIATE_TEST_SUITE_P(Extensions, ConvertByExtension, ::testing::Values(".safetensors", ".h5", ".hdf5"),
                         [](const auto& info) { return info.param.substr(1); });

TEST(Convert, FormatOptionWinsOverTheExtensionAndTheFileStillLoads) {
  const std::string out = temp_path("format_wins/model.h5");
  const Result c = run("convert " + trained().checkpoints() + " " + out + " --format safetensors");
  ASSERT_EQ(c.code, 0) << c.err;
  EXPECT_FALSE(is_hdf5(out));
  EXPECT_EQ(read_safetensors(out).header.at("wpe.weight").at("shape"), json({16, 32}));
  ASSERT_EQ(train_from(out, temp_path("format_wins_run")).code, 0);
  EXPECT_EQ(first_loss(temp_path("format_wins_run")), trained().loss_after_step10());
}

TEST(Convert, UnknownExtensionWithoutFormatExitsTwoNamingTheFile) {
  const std::string out = temp_path("unknown_ext/model.bin");
  const Result r = run("convert " + trained().checkpoints() + " " + out);
  expect_one_line_rejection(r, out);
  EXPECT_NE(r.err.find("--format"), std::string::npos) << r.err;
  EXPECT_FALSE(fs::exists(temp_path("unknown_ext"))) << "nothing is written";
}

// --- Hugging Face's names, config.json and the model shape -----------------------------------

TEST(Convert, ShardsAndIndexCarryHuggingFaceNames) {
  const std::string dir = temp_path("hf_shards");
  const Result c = run("convert " + trained().checkpoints() + " " + dir + "/model.safetensors --max-shard-size 60KB");
  ASSERT_EQ(c.code, 0) << c.err;
  EXPECT_EQ(files_in(dir), (std::set<std::string>{"model-00001-of-00003.safetensors", "model-00002-of-00003.safetensors",
                                                  "model-00003-of-00003.safetensors", "model.safetensors.index.json",
                                                  "config.json"}));
  const json index = json::parse(slurp(dir + "/model.safetensors.index.json"));
  EXPECT_EQ(index["weight_map"]["wte.weight"], "model-00001-of-00003.safetensors");
  EXPECT_EQ(index["weight_map"]["ln_f.bias"], "model-00003-of-00003.safetensors");
  EXPECT_EQ(index["metadata"]["total_size"], 4 * (256 * 32 + 16 * 32 + 2 * 12704 + 64));
  ASSERT_EQ(train_from(dir + "/model.safetensors.index.json", temp_path("hf_shards_run")).code, 0);
  EXPECT_EQ(first_loss(temp_path("hf_shards_run")), trained().loss_after_step10());
}

TEST(Convert, ConfigJsonIsHuggingFacesGpt2ConfigOfTheModel) {
  const std::string dir = temp_path("hf_config");
  ASSERT_EQ(run("convert " + trained().checkpoints() + " " + dir + "/model.safetensors --dtype bf16").code, 0);
  const json c = json::parse(slurp(dir + "/config.json"));
  EXPECT_EQ(c["model_type"], "gpt2");
  EXPECT_EQ(c["architectures"], json({"GPT2LMHeadModel"}));
  EXPECT_EQ(c["vocab_size"], 256);
  EXPECT_EQ(c["n_positions"], 16);
  EXPECT_EQ(c["n_ctx"], 16);
  EXPECT_EQ(c["n_embd"], 32);
  EXPECT_EQ(c["n_layer"], 2);
  EXPECT_EQ(c["n_head"], 2);
  EXPECT_TRUE(c.contains("n_inner") && c["n_inner"].is_null());
  EXPECT_EQ(c["activation_function"], "gelu_new");
  EXPECT_EQ(c["layer_norm_epsilon"], 1e-5);
  EXPECT_EQ(c["tie_word_embeddings"], true);
  EXPECT_EQ(c["torch_dtype"], "bfloat16");
  EXPECT_EQ(c["attn_pdrop"], 0.0) << "a config without attn_pdrop trains without attention dropout";
}

TEST(Convert, WeightFilesRecordTheModelShape) {
  const std::string dir = temp_path("shape_meta");
  ASSERT_EQ(run("convert " + trained().checkpoints() + " " + dir + "/model.safetensors").code, 0);
  const json meta = read_safetensors(dir + "/model.safetensors").header.at("__metadata__");
  EXPECT_EQ(meta["format"], "pt");
  EXPECT_EQ(meta["model_type"], "gpt2");
  EXPECT_EQ(meta["vocab_size"], "256");  // safetensors metadata holds strings
  EXPECT_EQ(meta["n_positions"], "16");
  EXPECT_EQ(meta["n_embd"], "32");
  EXPECT_EQ(meta["n_layer"], "2");
  EXPECT_EQ(meta["n_head"], "2");
  EXPECT_EQ(meta["step"], "10");

  ASSERT_EQ(run("convert " + trained().checkpoints() + " " + dir + "/model.h5").code, 0);
  zero3d::h5::File f = zero3d::h5::File::open_read(dir + "/model.h5");
  int64_t value = 0;
  std::string text;
  ASSERT_TRUE(zero3d::h5::read_attribute(f.id(), "n_layer", value));
  EXPECT_EQ(value, 2);
  ASSERT_TRUE(zero3d::h5::read_attribute(f.id(), "n_head", value));
  EXPECT_EQ(value, 2);
  ASSERT_TRUE(zero3d::h5::read_attribute(f.id(), "vocab_size", value));
  EXPECT_EQ(value, 256);
  ASSERT_TRUE(zero3d::h5::read_attribute(f.id(), "model_type", text));
  EXPECT_EQ(text, "gpt2");
}

TEST(Convert, RefusesToOverwriteAConfigJsonThatIsNotHuggingFaces) {
  // The training output directory holds zero3d's resolved config.json.
  const std::string run_config = trained().dir + "/config.json", before = slurp(run_config);
  const Result r = run("convert " + trained().checkpoints() + " " + trained().dir + "/model.safetensors");
  expect_one_line_rejection(r, run_config);
  EXPECT_EQ(slurp(run_config), before);
  EXPECT_FALSE(fs::exists(trained().dir + "/model.safetensors"));
}

// --- fp16 ---------------------------------------------------------------------------------------

TEST(Convert, Fp16IsFp32RoundedToNearestEvenLikeTorchHalf) {
  const std::string dir = temp_path("fp16");
  ASSERT_EQ(run("convert " + trained().checkpoints() + " " + dir + "/fp32.safetensors").code, 0);
  const Result c = run("convert " + trained().checkpoints() + " " + dir + "/half/model.safetensors --dtype fp16");
  ASSERT_EQ(c.code, 0) << c.err;
  const Safetensors full = read_safetensors(dir + "/fp32.safetensors"), half = read_safetensors(dir + "/half/model.safetensors");
  size_t checked = 0;
  for (const auto& [name, entry] : full.header.items()) {
    if (name == "__metadata__") continue;
    EXPECT_EQ(half.header.at(name).at("dtype"), "F16") << name;
    const std::vector<float> want = floats_of(full, name);
    const std::vector<uint16_t> got = halves_of(half, name);
    ASSERT_EQ(got.size(), want.size()) << name;
    for (size_t i = 0; i < want.size(); ++i, ++checked)
      ASSERT_EQ(got[i], half_bits(want[i])) << name << "[" << i << "] = " << want[i];
  }
  EXPECT_EQ(checked, size_t(256 * 32 + 16 * 32 + 2 * 12704 + 64));
  EXPECT_EQ(json::parse(slurp(dir + "/half/config.json"))["torch_dtype"], "float16");

  // The HDF5 fp16 type holds the same values (HDF5 widens them back to float exactly).
  ASSERT_EQ(run("convert " + trained().checkpoints() + " " + dir + "/half.h5 --dtype fp16").code, 0);
  zero3d::h5::File f = zero3d::h5::File::open_read(dir + "/half.h5");
  const std::vector<float> wte = f.read_floats("h.1.mlp.c_fc.weight"), want = floats_of(full, "h.1.mlp.c_fc.weight");
  ASSERT_EQ(wte.size(), want.size());
  for (size_t i = 0; i < want.size(); ++i) ASSERT_EQ(half_bits(wte[i]), half_bits(want[i])) << i;
  EXPECT_EQ(wte[0], static_cast<float>(static_cast<_Float16>(want[0])));

  // fp16 weights load back: the loss moves only by the rounding.
  ASSERT_EQ(train_from(dir + "/half/model.safetensors", temp_path("fp16_run")).code, 0);
  EXPECT_NEAR(first_loss(temp_path("fp16_run")), trained().loss_after_step10(), 1e-2 * trained().loss_after_step10());
}

TEST(Convert, Fp16OverflowsToInfinityWithTheSign) {
  // Weights with a row of wte beyond fp16's range (token 0 never appears in the text), trained
  // one step (Adam moves each weight by about lr) and saved.
  const std::string dir = temp_path("overflow");
  ASSERT_EQ(run("convert " + trained().checkpoints() + " " + dir + "/start.h5").code, 0);
  {
    hid_t file = H5Fopen((dir + "/start.h5").c_str(), H5F_ACC_RDWR, H5P_DEFAULT);
    ASSERT_GE(file, 0);
    hid_t ds = H5Dopen2(file, "wte.weight", H5P_DEFAULT);
    std::vector<float> wte(256 * 32);
    ASSERT_GE(H5Dread(ds, H5T_NATIVE_FLOAT, H5S_ALL, H5S_ALL, H5P_DEFAULT, wte.data()), 0);
    for (int c = 0; c < 32; ++c) wte[c] = c % 2 ? -70000.0f : 70000.0f;  // fp16's largest finite is 65504
    ASSERT_GE(H5Dwrite(ds, H5T_NATIVE_FLOAT, H5S_ALL, H5S_ALL, H5P_DEFAULT, wte.data()), 0);
    H5Dclose(ds);
    H5Fclose(file);
  }
  const std::string run_dir = temp_path("overflow_run");
  ASSERT_EQ(train_from(dir + "/start.h5", run_dir, "--set training.save_interval=1").code, 0);
  const Result c = run("convert " + run_dir + "/checkpoints " + dir + "/half/model.safetensors --dtype fp16");
  ASSERT_EQ(c.code, 0) << c.err;
  const std::vector<uint16_t> wte = halves_of(read_safetensors(dir + "/half/model.safetensors"), "wte.weight");
  for (int c = 0; c < 32; ++c) EXPECT_EQ(wte[c], c % 2 ? 0xFC00 : 0x7C00) << "wte[0][" << c << "] is not ±inf";
  for (size_t i = 32; i < wte.size(); ++i) ASSERT_NE(wte[i] & 0x7C00, 0x7C00) << "wte element " << i << " is not finite";
}

// --- stale shards ---------------------------------------------------------------------------------

TEST(Convert, StaleOutputsOfAnEarlierConvertToTheSameNameAreRemovedAndNothingElse) {
  const std::string dir = temp_path("stale"), out = dir + "/model.safetensors";
  const std::vector<std::string> others = {"notes.txt", "model-00001-of-00003.safetensors.bak",
                                           "other-00003-of-00003.safetensors", "model-1-of-3.safetensors"};
  fs::create_directories(dir);
  for (const std::string& name : others) std::ofstream(dir + "/" + name) << "not ours";
  auto ours = [&] {
    std::set<std::string> names = files_in(dir);
    for (const std::string& name : others) EXPECT_EQ(names.erase(name), 1u) << name << " was touched";
    return names;
  };

  ASSERT_EQ(run("convert " + trained().checkpoints() + " " + out + " --max-shard-size 60KB").code, 0);
  EXPECT_EQ(ours().count("model-00003-of-00003.safetensors"), 1u);

  const Result two = run("convert " + trained().checkpoints() + " " + out + " --max-shard-size 80KB");
  ASSERT_EQ(two.code, 0) << two.err;
  EXPECT_EQ(ours(), (std::set<std::string>{"model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
                                           "model.safetensors.index.json", "config.json"}));
  EXPECT_NE(two.out.find("removed " + dir + "/model-00003-of-00003.safetensors"), std::string::npos) << two.out;

  // One file now: the shards and the index (which a loader would still find) go.
  ASSERT_EQ(run("convert " + trained().checkpoints() + " " + out).code, 0);
  EXPECT_EQ(ours(), (std::set<std::string>{"model.safetensors", "config.json"}));

  // Sharded again: the single file (which Hugging Face would load first) goes.
  ASSERT_EQ(run("convert " + trained().checkpoints() + " " + out + " --max-shard-size 80KB").code, 0);
  EXPECT_EQ(ours(), (std::set<std::string>{"model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
                                           "model.safetensors.index.json", "config.json"}));

  // A file with an output's name stays unless it records that convert wrote it ("source").
  std::ofstream(dir + "/model.safetensors.index.json") << "{\"weight_map\": {}}\n";
  std::ofstream(dir + "/model-00004-of-00005.safetensors") << "keep";
  const Result one = run("convert " + trained().checkpoints() + " " + out);
  ASSERT_EQ(one.code, 0) << one.err;
  EXPECT_EQ(ours(), (std::set<std::string>{"model.safetensors", "config.json", "model.safetensors.index.json",
                                           "model-00004-of-00005.safetensors"}));
  EXPECT_EQ(slurp(dir + "/model-00004-of-00005.safetensors"), "keep");
  EXPECT_EQ(count(one.out, "removed "), 2u) << one.out;
}

// --- progress -----------------------------------------------------------------------------------

TEST(Convert, TinyConversionsAreQuietAndLongOnesReportProgressWithTheRate) {
  const std::string dir = temp_path("progress");
  const Result quiet = run("convert " + trained().checkpoints() + " " + dir + "/quiet.safetensors");
  ASSERT_EQ(quiet.code, 0) << quiet.err;
  EXPECT_EQ(quiet.err, "");
  EXPECT_EQ(count(quiet.out, "\n"), count(quiet.out, "wrote ")) << quiet.out;

  // ZERO3D_PROGRESS_SECONDS=0 treats every conversion as long: a line per tensor and a summary.
  const Result loud = run("convert " + trained().checkpoints() + " " + dir + "/loud.safetensors", 0,
                          "ZERO3D_PROGRESS_SECONDS=0");
  ASSERT_EQ(loud.code, 0) << loud.err;
  EXPECT_NE(loud.err.find("convert: "), std::string::npos) << loud.err;
  EXPECT_NE(loud.err.find("MB/s: h.1.mlp.c_proj.weight -> loud.safetensors"), std::string::npos) << loud.err;
  EXPECT_EQ(count(loud.err, "MB/s"), 2u + 2 * 12 + 2 + 1) << loud.err;  // every tensor, then the summary

  const Result inspect = run("inspect " + trained().checkpoints() + " --json", 0, "ZERO3D_PROGRESS_SECONDS=0");
  ASSERT_EQ(inspect.code, 0) << inspect.err;
  EXPECT_NE(inspect.err.find("inspect: "), std::string::npos) << inspect.err;
  EXPECT_NE(inspect.err.find("MB/s"), std::string::npos) << inspect.err;
  EXPECT_NO_THROW(json::parse(inspect.out)) << "progress stays off stdout";
  const Result quiet_inspect = run("inspect " + trained().checkpoints() + " --json");
  EXPECT_EQ(quiet_inspect.err, "");
}

// --- model.init_from takes exactly the model's tensors ------------------------------------------

TEST(InitFrom, TensorsTheModelDoesNotHaveExitTwoNamingThem) {
  const std::string weights = temp_path("extra/model.safetensors");
  ASSERT_EQ(run("convert " + trained().checkpoints() + " " + weights).code, 0);
  // Two layers of weights into a one-layer model: h.1's 12 tensors are left over.
  const Result r = train_from(weights, temp_path("extra_run"), "--set model.n_layer=1");
  expect_one_line_rejection(r, weights);
  EXPECT_NE(r.err.find("12 tensors that the model does not have: h.1.ln_1.weight, h.1.ln_1.bias, "
                       "h.1.attn.c_attn.weight, h.1.attn.c_attn.bias, h.1.attn.c_proj.weight and 7 more"),
            std::string::npos)
      << r.err;
  EXPECT_NE(r.err.find("the file has 2 layers, the model n_layer 1"), std::string::npos) << r.err;
}

TEST(InitFrom, MissingTensorsExitTwoNamingTheFirstAndCountingAll) {
  const std::string weights = temp_path("missing/model.h5");
  ASSERT_EQ(run("convert " + trained().checkpoints() + " " + weights).code, 0);
  const Result r = train_from(weights, temp_path("missing_run"), "--set model.n_layer=3");
  expect_one_line_rejection(r, weights);
  EXPECT_NE(r.err.find("12 of the model's tensors are missing: h.2.ln_1.weight, h.2.ln_1.bias, "
                       "h.2.attn.c_attn.weight, h.2.attn.c_attn.bias, h.2.attn.c_proj.weight and 7 more"),
            std::string::npos)
      << r.err;
}

TEST(InitFrom, HuggingFaceBuffersAndPrefixAreNotExtraTensors) {
  // Hugging Face's GPT-2 files add the tied lm_head and each block's causal-mask buffers and may
  // prefix names with "transformer.": none of them is a tensor the model lacks.
  const std::string plain = temp_path("hf_style/plain.safetensors");
  ASSERT_EQ(run("convert " + trained().checkpoints() + " " + plain).code, 0);
  Safetensors s = read_safetensors(plain);
  json header = json::object();
  for (const auto& [name, entry] : s.header.items())
    header[name == "__metadata__" ? name : "transformer." + name] = entry;
  header["lm_head.weight"] = s.header["wte.weight"];
  const std::string mask(16 * 16 * 4, '\0');
  for (const char* buffer : {"h.0.attn.bias", "h.1.attn.bias", "h.0.attn.masked_bias", "h.1.attn.masked_bias"}) {
    const size_t begin = s.data.size();
    s.data += mask;
    header[std::string("transformer.") + buffer] = {{"dtype", "F32"}, {"shape", {1, 1, 16, 16}}, {"data_offsets", {begin, s.data.size()}}};
  }
  const std::string text = header.dump();
  const uint64_t n = text.size();
  const std::string hf = temp_path("hf_style/model.safetensors");
  std::ofstream(hf, std::ios::binary) << std::string(reinterpret_cast<const char*>(&n), 8) << text << s.data;
  const Result r = train_from(hf, temp_path("hf_style_run"));
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(first_loss(temp_path("hf_style_run")), trained().loss_after_step10());
}

}  // namespace
