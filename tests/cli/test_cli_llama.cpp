// The Llama family, black-box: `zero3d train` on a Hugging Face config directory and
// Hugging Face-named weights follows PyTorch's losses and gradient norms step by step
// (tests/golden/make_llama_goldens.py), and every data-parallel, pipeline and tensor-parallel
// layout, ZeRO stage and activation-checkpointing setting gives the losses of one rank; its
// checkpoints resume across layouts, its evaluation is PyTorch's loss, its 16-bit runs track
// fp32; combinations the family does not have stop at validation with one line naming the key.
// Mixtral (tests/golden/make_mixtral_goldens.py): the same, with its sparse MoE blocks over expert,
// data, tensor and ZeRO-3 layouts, with and without the router's jitter noise.
#include <gtest/gtest.h>

#include <hdf5.h>

#include <cmath>
#include <cstdint>
#include <fstream>
#include <map>
#include <ostream>
#include <string>
#include <vector>

#include "io/h5.hpp"
#include "support/cli_helpers.hpp"

using namespace cli;

namespace {

const std::string kGoldenDir = kSource + "/tests/golden";

std::vector<double> read_doubles(const zero3d::h5::File& f, const std::string& name) {
  const hid_t ds = H5Dopen2(f.id(), name.c_str(), H5P_DEFAULT);
  const hid_t space = H5Dget_space(ds);
  std::vector<double> out(static_cast<size_t>(H5Sget_simple_extent_npoints(space)));
  H5Dread(ds, H5T_NATIVE_DOUBLE, H5S_ALL, H5S_ALL, H5P_DEFAULT, out.data());
  H5Sclose(space);
  H5Dclose(ds);
  return out;
}

// One golden as a user would bring it: a Hugging Face directory (config.json), the weights by
// their Hugging Face names (the golden file itself), and its batch as an llm.c token shard of
// exactly B·T + 1 tokens, so that every step of every layout trains on that one batch.
struct Golden {
  std::string name, hf_dir, weights, shard;
  int64_t B = 0, T = 0;
  std::vector<double> losses, grad_norms, hparams;
};

const Golden& golden(const std::string& name) {
  static std::map<std::string, Golden> cache;
  auto it = cache.find(name);
  if (it != cache.end()) return it->second;
  Golden g;
  g.name = name;
  g.weights = kGoldenDir + "/" + name + ".h5";
  const zero3d::h5::File f = zero3d::h5::File::open_read(g.weights);
  std::string config;
  EXPECT_TRUE(zero3d::h5::read_attribute(f.id(), "hf_config", config));
  EXPECT_TRUE(zero3d::h5::read_attribute(f.id(), "batch", g.B));
  g.hf_dir = temp_path(name + "_hf");
  std::system(("mkdir -p " + g.hf_dir).c_str());
  std::ofstream(g.hf_dir + "/config.json") << config;
  const std::vector<int32_t> stream = f.read_ints("golden/stream");
  g.T = (static_cast<int64_t>(stream.size()) - 1) / g.B;
  g.shard = temp_path(name + ".bin");
  std::vector<int32_t> header(256, 0);
  header[0] = 20240520;  // llm.c's magic, version 1, token count; then uint16 tokens
  header[1] = 1;
  header[2] = static_cast<int32_t>(stream.size());
  std::ofstream out(g.shard, std::ios::binary);
  out.write(reinterpret_cast<const char*>(header.data()), 1024);
  for (int32_t t : stream) {
    const uint16_t u = static_cast<uint16_t>(t);
    out.write(reinterpret_cast<const char*>(&u), 2);
  }
  out.close();
  g.losses = read_doubles(f, "golden/adamw_losses");
  g.grad_norms = read_doubles(f, "golden/grad_norms");
  g.hparams = read_doubles(f, "golden/hparams");
  return cache.emplace(name, g).first->second;
}

// PyTorch's run: AdamW with the golden's settings, constant lr, its gradient clipping.
json golden_run(const Golden& g) {
  const std::vector<double>& hp = g.hparams;
  return json{{"train_batch_size", g.B},
              {"gradient_clipping", hp[5]},
              {"optimizer",
               {{"type", "AdamW"},
                {"params", {{"lr", hp[0]}, {"betas", {hp[1], hp[2]}}, {"eps", hp[3]}, {"weight_decay", hp[4]}}}}},
              {"model", {{"hf_config", g.hf_dir}, {"seq_length", g.T}, {"init_from", g.weights}}},
              {"data", {{"source", "tokens"}, {"path", g.shard}}},
              {"training", {{"steps", static_cast<int64_t>(g.losses.size())}, {"seed", 5}, {"peak_gflops", 50}}},
              {"steps_per_print", 100}};
}

std::vector<json> train(const Golden& g, int np, const std::string& tag, const std::string& args) {
  const std::string config = write_config(g.name + "_" + tag + ".json", golden_run(g));
  const std::string dir = temp_path(g.name + "_" + tag);
  std::system(("rm -rf " + dir).c_str());
  const Result r = run("train " + config + " --output " + dir + " " + args, np);
  EXPECT_EQ(r.code, 0) << r.out << r.err;
  return read_metrics(dir);
}

class LlamaFamily : public ::testing::TestWithParam<std::string> {};

// One rank, ZeRO off: PyTorch's losses and gradient norms (before clipping), step by step, within
// 1e-5 relative. The start-up line names the family and its shape.
TEST_P(LlamaFamily, TrainsAsPyTorchDoesFromAHuggingFaceDirectory) {
  const Golden& g = golden(GetParam());
  const std::vector<json> rows = train(g, 1, "np1", "");
  ASSERT_EQ(rows.size(), g.losses.size());
  expect_losses_close(losses_of(rows), g.losses, 1e-5, g.name + " loss");
  for (size_t i = 0; i < rows.size(); ++i)
    EXPECT_NEAR(rows[i].at("grad_norm").get<double>(), g.grad_norms[i], 1e-5 * g.grad_norms[i])
        << g.name << " grad_norm step " << i + 1;
}

INSTANTIATE_TEST_SUITE_P(Goldens, LlamaFamily,
                         ::testing::Values("llama_gqa", "llama_biases", "qwen2_bias", "mistral_window", "mixtral_moe",
                                           "mixtral_jitter"));

struct Layout {
  std::string golden;
  int np;
  std::string args, name;
};

void PrintTo(const Layout& l, std::ostream* os) { *os << l.golden << " " << l.name; }

class LlamaLayout : public ::testing::TestWithParam<Layout> {};

// The losses of one rank (ZeRO off) within 1e-5 relative over the golden's 8 steps.
TEST_P(LlamaLayout, GivesTheLossesOfOneRank) {
  const Layout& l = GetParam();
  const Golden& g = golden(l.golden);
  static std::map<std::string, std::vector<double>> reference;
  if (!reference.count(l.golden)) reference[l.golden] = losses_of(train(g, 1, "ref", ""));
  const std::vector<json> rows = train(g, l.np, l.name, l.args);
  expect_losses_close(losses_of(rows), reference[l.golden], 1e-5, l.golden + " " + l.name);
}

const std::string kMicro1 = "--set train_micro_batch_size_per_gpu=1 ";
const std::string kPipe2 = kMicro1 + "--set pipeline.stages=2 ";

INSTANTIATE_TEST_SUITE_P(
    DataPipelineZeroCheckpointing, LlamaLayout,
    ::testing::Values(
        // data parallel, every ZeRO stage (llama_gqa: untied head; qwen2_bias: tied)
        Layout{"llama_gqa", 2, "--set zero_optimization.stage=0", "np2_z0"},
        Layout{"llama_gqa", 2, "--set zero_optimization.stage=1", "np2_z1"},
        Layout{"llama_gqa", 2, "--set zero_optimization.stage=2 --set zero_optimization.reduce_bucket_size=700", "np2_z2"},
        Layout{"llama_gqa", 2, "--set zero_optimization.stage=3 --set zero_optimization.stage3_prefetch_bucket_size=900",
               "np2_z3"},
        Layout{"qwen2_bias", 2, "--set zero_optimization.stage=3", "np2_z3"},
        Layout{"mistral_window", 2, "--set zero_optimization.stage=2", "np2_z2"},
        // gradient accumulation on one rank
        Layout{"llama_gqa", 1, kMicro1, "np1_gas4"},
        // pipeline: the untied head on the last stage; the tied head's embed_tokens copy
        Layout{"llama_gqa", 2, kPipe2 + "--set pipeline.schedule=1f1b", "np2_p2_1f1b"},
        Layout{"llama_gqa", 2, kPipe2 + "--set pipeline.schedule=zb-h1 --set zero_optimization.stage=1", "np2_p2_zbh1"},
        Layout{"llama_gqa", 2, kPipe2 + "--set pipeline.schedule=interleaved --set pipeline.virtual_stages=2",
               "np2_p2_int2"},
        Layout{"qwen2_bias", 2, kPipe2 + "--set pipeline.schedule=1f1b --set zero_optimization.stage=2", "np2_p2_1f1b"},
        Layout{"qwen2_bias", 2, kPipe2 + "--set pipeline.schedule=zb-h1", "np2_p2_zbh1"},
        // tensor parallelism (q/k/v by whole K/V-head groups, vocab-parallel embedding and head), with
        // sequence parallelism, overlapped all-reduces, beside data and pipeline parallelism
        Layout{"llama_gqa", 2, "--set tensor_parallel.autotp_size=2", "np2_t2"},
        Layout{"llama_gqa", 2, "--set tensor_parallel.autotp_size=2 --set tensor_parallel.sequence_parallel=true",
               "np2_t2_sp"},
        Layout{"llama_gqa", 2, "--set tensor_parallel.autotp_size=2 --set tensor_parallel.tp_overlap_comm=true",
               "np2_t2_overlap"},
        Layout{"qwen2_bias", 2, "--set tensor_parallel.autotp_size=2 --set zero_optimization.stage=3", "np2_t2_z3"},
        Layout{"mistral_window", 2, "--set tensor_parallel.autotp_size=2 --set tensor_parallel.sequence_parallel=true",
               "np2_t2_sp"},
        Layout{"llama_gqa", 4, kMicro1 + "--set tensor_parallel.autotp_size=2 --set pipeline.stages=2", "np4_t2_p2"},
        Layout{"llama_gqa", 4,
               kMicro1 + "--set tensor_parallel.autotp_size=2 --set tensor_parallel.sequence_parallel=true "
                         "--set pipeline.stages=2 --set pipeline.schedule=zb-h1",
               "np4_t2_sp_p2_zbh1"},
        Layout{"qwen2_bias", 4,
               "--set tensor_parallel.autotp_size=2 --set zero_optimization.stage=2 "
               "--set tensor_parallel.sequence_parallel=true",
               "np4_t2_d2_sp"},
        // Mixtral at t 2 (one data rank: the same micro-batch as one rank): attention split as the
        // llama preset's, every expert's w1/w3 column- and w2 row-parallel, the router whole
        Layout{"mixtral_moe", 2, "--set tensor_parallel.autotp_size=2", "np2_t2"},
        Layout{"mixtral_moe", 2, "--set tensor_parallel.autotp_size=2 --set tensor_parallel.preset_model=mixtral",
               "np2_t2_preset"},
        Layout{"mixtral_moe", 2, "--set tensor_parallel.autotp_size=2 --set zero_optimization.stage=3", "np2_t2_z3"},
        Layout{"llama_gqa", 2,
               "--set tensor_parallel.autotp_size=2 --set pipeline.activation_checkpoint_interval=1 "
               "--set activation_checkpointing.partition_activations=true",
               "np2_t2_full_ac_partitioned"},
        // activation checkpointing: every block, selective (attention recomputed), checkpoints in host memory
        Layout{"llama_gqa", 1, "--set pipeline.activation_checkpoint_interval=1", "np1_full_ac"},
        Layout{"mistral_window", 2,
               "--set pipeline.activation_checkpoint_interval=1 --set zero_optimization.stage=3 "
               "--set activation_checkpointing.cpu_checkpointing=true",
               "np2_full_ac_z3"},
        Layout{"qwen2_bias", 1,
               "--set pipeline.activation_checkpoint_interval=1 --set activation_checkpointing.recompute_granularity=selective",
               "np1_selective_ac"}),
    [](const ::testing::TestParamInfo<Layout>& info) { return info.param.golden + "_" + info.param.name; });

// Mixtral's load-balancing loss is taken per micro-batch (over its tokens and every layer, as
// transformers' load_balancing_loss_func over one forward), so a layout with several data ranks
// gives the losses of one rank running the same micro-batches: one sample each here. Expert
// parallelism moves each token to the rank holding its experts and back; the experts' ZeRO runs
// over the expert-data group. The router's jitter multiplies each token by factors drawn for that
// global token, so every rank holding it (data, expert, tensor) draws the same.
struct MixtralLayout {
  int np;
  std::string args, name;
  bool aux = true;  // output_router_logits (the golden's true): the load-balancing loss in the gradient
  std::string golden = "mixtral_moe";  // or mixtral_jitter: router_jitter_noise 0.2
};

void PrintTo(const MixtralLayout& l, std::ostream* os) { *os << l.name; }

class MixtralLayouts : public ::testing::TestWithParam<MixtralLayout> {};

TEST_P(MixtralLayouts, GiveTheLossesOfOneRankOverTheSameMicroBatches) {
  const MixtralLayout& l = GetParam();
  const Golden& g = golden(l.golden);
  const std::string aux = l.aux ? "" : "--set model.output_router_logits=false ";
  static std::map<std::string, std::vector<double>> reference;
  if (!reference.count(l.golden + aux))
    reference[l.golden + aux] = losses_of(train(g, 1, l.aux ? "ref_micro1" : "ref_micro1_noaux", kMicro1 + aux));
  const std::vector<json> rows = train(g, l.np, l.name, kMicro1 + aux + l.args);
  expect_losses_close(losses_of(rows), reference[l.golden + aux], 1e-5, l.golden + " " + l.name);
}

INSTANTIATE_TEST_SUITE_P(
    ExpertDataZeroTensorPipeline, MixtralLayouts,
    ::testing::Values(MixtralLayout{2, "--set model.moe.ep_size=2", "np2_ep2"},
                      MixtralLayout{2, "--set model.moe.ep_size=2 --set zero_optimization.stage=2", "np2_ep2_z2"},
                      MixtralLayout{2, "--set model.moe.ep_size=2 --set zero_optimization.stage=3", "np2_ep2_z3"},
                      MixtralLayout{2, "--set zero_optimization.stage=3", "np2_ep1_z3"},
                      MixtralLayout{4, "--set model.moe.ep_size=2 --set tensor_parallel.autotp_size=2", "np4_ep2_t2"},
                      // the loss couples all layers: the stages exchange its sums and fractions
                      MixtralLayout{2, "--set pipeline.stages=2", "np2_p2"},
                      MixtralLayout{4, "--set pipeline.stages=2 --set model.moe.ep_size=2", "np4_p2_ep2"},
                      MixtralLayout{2, "--set pipeline.stages=2 --set pipeline.schedule=interleaved "
                                       "--set pipeline.virtual_stages=2", "np2_p2_interleaved"},
                      MixtralLayout{2, "--set pipeline.stages=2", "np2_p2_noaux", false},
                      MixtralLayout{2, "--set model.moe.ep_size=2", "jitter_np2_ep2", true, "mixtral_jitter"},
                      MixtralLayout{2, "--set tensor_parallel.autotp_size=2", "jitter_np2_t2", true, "mixtral_jitter"},
                      MixtralLayout{2, "--set zero_optimization.stage=3", "jitter_np2_z3", true, "mixtral_jitter"},
                      MixtralLayout{2, "--set pipeline.stages=2", "jitter_np2_p2", true, "mixtral_jitter"}),
    [](const ::testing::TestParamInfo<MixtralLayout>& info) { return info.param.name; });

// A Mixtral checkpoint saved at ep 2 holds whole experts under Hugging Face's names and resumes on
// one rank to the uninterrupted run's last four losses within 1e-6.
TEST(MixtralCheckpoint, SavedAtExpertParallelTwoResumesOnOneRank) {
  const Golden& g = golden("mixtral_moe");
  const std::string config = write_config("mixtral_ckpt.json", golden_run(g));
  const std::string saved = temp_path("mixtral_saved");
  std::system(("rm -rf " + saved).c_str());
  Result r = run("train " + config + " --output " + saved + " " + kMicro1 +
                     "--set model.moe.ep_size=2 --set zero_optimization.stage=2 --set training.save_interval=4",
                 2);
  ASSERT_EQ(r.code, 0) << r.err;
  const std::vector<double> whole = losses_of(read_metrics(saved));
  ASSERT_EQ(whole.size(), 8u);
  const std::string dir = temp_path("mixtral_resumed");
  std::system(("rm -rf " + dir).c_str());
  r = run("train " + config + " --output " + dir + " " + kMicro1 + "--set training.resume=" + saved +
              "/checkpoints/global_step4",
          1);
  ASSERT_EQ(r.code, 0) << r.err;
  expect_losses_close(losses_of(read_metrics(dir)), std::vector<double>(whole.begin() + 4, whole.end()), 1e-6,
                      "resumed at np 1");
  r = run("inspect " + saved + "/checkpoints --tag global_step8 --json");
  ASSERT_EQ(r.code, 0) << r.err;
  const json report = json::parse(r.out);
  std::map<std::string, json> shapes;
  for (const json& t : report.at("tensors")) shapes[t.at("name").get<std::string>()] = t.at("shape");
  EXPECT_EQ(shapes.size(), 1u + 2 * (7 + 4 * 3) + 2);  // embed_tokens, per layer 7 + 4 experts × 3, norm, lm_head
  EXPECT_EQ(shapes["model.layers.1.block_sparse_moe.gate.weight"], json::array({4, 64}));
  EXPECT_EQ(shapes["model.layers.1.block_sparse_moe.experts.3.w1.weight"], json::array({32, 64}));
  EXPECT_EQ(shapes["model.layers.0.block_sparse_moe.experts.2.w2.weight"], json::array({64, 32}));
}

// `zero3d estimate --config` on a Mixtral: the parameters are Hugging Face's count (every expert
// stored) and the start-up line's, the active ones k of each layer's E experts; the model states
// and activations of each rank are, byte for byte, what training allocates at every ZeRO stage
// with the experts whole (ep 1) and split (ep 2), and the predicted peak lands within ±10% of the
// measured one.
TEST(MixtralEstimate, PlansWhatTrainingAllocates) {
  const Golden& g = golden("mixtral_moe");
  const int64_t V = 64, C = 64, I = 32, L = 2, H = 4, KV = 2, d = 16, E = 4, k = 2;
  const int64_t hf = 2 * V * C + L * (2 * C + 2 * H * d * C + 2 * KV * d * C + E * C + E * 3 * I * C) + C;
  json j = golden_run(g);
  j["training"]["steps"] = 1;
  for (int ep : {1, 2}) {
    j["model"]["moe"] = {{"ep_size", ep}};
    const std::string name = "mixtral_est_ep" + std::to_string(ep);
    const std::string cfg = write_config(name + ".json", j);
    const Result r = run("estimate --config " + cfg + " --world-size 2 " + kMicro1 + "--json");
    ASSERT_EQ(r.code, 0) << r.err;
    const json est = json::parse(r.out);
    EXPECT_EQ(est["parameters"].get<int64_t>(), hf);
    EXPECT_EQ(est["active_parameters"].get<int64_t>(), hf - L * (E - k) * 3 * I * C);
    for (int stage = 0; stage <= 3; ++stage) {
      if (ep == 1 && (stage == 1 || stage == 2)) continue;  // the expert-data group at ep 1 is the data group
      const std::string dir = temp_path(name + "_s" + std::to_string(stage));
      std::system(("rm -rf " + dir).c_str());
      const Result train =
          run("train " + cfg + " --output " + dir + " " + kMicro1 + "--set zero_optimization.stage=" + std::to_string(stage), 2);
      ASSERT_EQ(train.code, 0) << train.err;
      const std::string counts = std::to_string(est["active_parameters"].get<int64_t>()) + " of " +
                                 std::to_string(hf) + " parameters active per token";
      EXPECT_NE(train.out.find(counts), std::string::npos) << train.out;
      const json last = read_metrics(dir).back();
      const json& rank0 = est["ranks"][0]["budgets"][stage];
      for (const char* category : {"params", "grads", "master", "optimizer_states", "activations"})
        EXPECT_EQ(rank0[category], last["memory"][category]) << "ep " << ep << " stage " << stage << " " << category;
      EXPECT_NEAR(last["memory_plan"]["ratio"].get<double>(), 1.0, 0.10) << "ep " << ep << " stage " << stage;
    }
  }
}

// Bad Mixtral input: exit 2 at validation, one line naming the key and the reason.
TEST(MixtralValidation, UnsupportedOrInconsistentRoutingStopsWithOneLine) {
  const Golden& g = golden("mixtral_moe");
  const std::string config = write_config("mixtral_bad.json", golden_run(g));
  expect_one_line_rejection(run("validate " + config + " --set model.num_experts_per_tok=5", 0),
                            "`model.num_experts_per_tok`: value 5 is more than num_local_experts (4)");
  expect_one_line_rejection(run("validate " + config + " --set model.router_jitter_noise=1.5", 0),
                            "`model.router_jitter_noise`");
  expect_one_line_rejection(run("validate " + config + " --set model.moe.k=1", 0),
                            "`model.moe.k`: model.architecture mixtral routes as Hugging Face's MixtralSparseMoeBlock");
  expect_one_line_rejection(run("validate " + config + " --world-size 3 --set train_batch_size=6 --set model.moe.ep_size=3", 0),
                            "`model.moe.ep_size`: num_local_experts (4) is not divisible by ep_size (3)");
  expect_one_line_rejection(run("validate " + config + " --set tensor_parallel.sequence_parallel=true "
                                "--world-size 2 --set tensor_parallel.autotp_size=2", 0),
                            "`tensor_parallel.sequence_parallel`: an MoE layer routes the micro-batch's tokens together");
  json hostile = json::parse(slurp(g.hf_dir + "/config.json"));
  hostile["num_experts_per_tok"] = 6;
  const std::string hf = temp_path("mixtral_hostile_hf");
  std::system(("mkdir -p " + hf).c_str());
  std::ofstream(hf + "/config.json") << hostile.dump(2);
  expect_one_line_rejection(run("validate " + config + " --set model.hf_config=" + hf, 0),
                            "`model.hf_config.num_experts_per_tok`: value 6 is more than num_local_experts (4)");
  const Result ok = run("validate " + config + " --world-size 2 --set tensor_parallel.autotp_size=2 "
                        "--set tensor_parallel.preset_model=mixtral", 0);
  EXPECT_EQ(ok.code, 0) << ok.err;
  EXPECT_NE(ok.out.find("the rules agree with zero3d's split of this mixtral model"), std::string::npos) << ok.out;
}

// A checkpoint is one logical model under Hugging Face's names, whole tensors: saved by a
// two-stage pipeline at step 4, it resumes on one rank and at np 2 with ZeRO-3 to the
// uninterrupted run's last four losses within 1e-6.
TEST(LlamaFamilyCheckpoint, ResumesAtAnotherLayoutAndHoldsWholeHuggingFaceTensors) {
  const Golden& g = golden("llama_gqa");
  const std::string config = write_config("llama_ckpt.json", golden_run(g));
  const std::string saved = temp_path("llama_saved");
  std::system(("rm -rf " + saved).c_str());
  Result r = run("train " + config + " --output " + saved + " " + kPipe2 + "--set training.save_interval=4", 2);
  ASSERT_EQ(r.code, 0) << r.err;
  const std::vector<double> whole = losses_of(read_metrics(saved));
  ASSERT_EQ(whole.size(), 8u);
  const std::vector<double> tail(whole.begin() + 4, whole.end());
  for (const auto& [np, args] : std::vector<std::pair<int, std::string>>{
           {1, "--set zero_optimization.stage=0"}, {2, "--set zero_optimization.stage=3"}}) {
    const std::string dir = temp_path("llama_resumed");
    std::system(("rm -rf " + dir).c_str());
    r = run("train " + config + " --output " + dir + " --set training.resume=" + saved + "/checkpoints/global_step4 " + args,
            np);
    ASSERT_EQ(r.code, 0) << r.err;
    expect_losses_close(losses_of(read_metrics(dir)), tail, 1e-6, "resumed at np " + std::to_string(np) + " " + args);
  }
  r = run("inspect " + saved + "/checkpoints --tag global_step8 --json");
  ASSERT_EQ(r.code, 0) << r.err;
  const json report = json::parse(r.out);
  std::map<std::string, json> shapes;
  for (const json& t : report.at("tensors")) shapes[t.at("name").get<std::string>()] = t.at("shape");
  EXPECT_EQ(shapes.size(), 21u);  // embed_tokens, 2 × 9 block tensors, model.norm, lm_head
  EXPECT_EQ(shapes["lm_head.weight"], json::array({64, 32}));
  EXPECT_EQ(shapes["model.layers.1.self_attn.q_proj.weight"], json::array({64, 32}));  // H·d = 4·16 rows
  EXPECT_EQ(shapes["model.layers.1.self_attn.k_proj.weight"], json::array({32, 32}));  // Hkv·d = 2·16
  EXPECT_EQ(shapes["model.layers.0.mlp.down_proj.weight"], json::array({32, 48}));
}

// Evaluation is the same forward: on the golden's batch, at the golden weights, PyTorch's loss.
TEST(LlamaFamilyEval, EvaluatesToPyTorchsLossInEveryLayout) {
  const Golden& g = golden("mistral_window");
  json c = golden_run(g);
  c["data"]["validation"] = {{"source", "tokens"}, {"path", g.shard}};
  c["training"]["eval_steps"] = 1;
  const std::string config = write_config("mistral_eval.json", c);
  const zero3d::h5::File f = zero3d::h5::File::open_read(g.weights);
  const double want = f.read_floats("golden/loss")[0];
  for (const auto& [np, args] : std::vector<std::pair<int, std::string>>{
           {1, ""}, {2, "--set zero_optimization.stage=3"}, {2, kPipe2}}) {
    const Result r = run("eval " + config + " --json " + args, np);
    ASSERT_EQ(r.code, 0) << r.err;
    const size_t end = r.out.find_last_not_of('\n'), begin = r.out.rfind('\n', end);
    const json e = json::parse(r.out.substr(begin == std::string::npos ? 0 : begin + 1));
    EXPECT_NEAR(e.at("eval_loss").get<double>(), want, 1e-6 * want) << np << " " << args;
  }
}

// 16-bit runs: bf16 and fp16 parameters and torch_autocast run the products in 16 bits (bf16
// keeps the RMSNorms' outputs, the attention half's products' inputs, attention and the MLP's
// activations in bf16; fp16 keeps fp32 activations) and follow PyTorch's fp32 losses within the
// rounding of their products; a bf16 run at np 2 with ZeRO-2 stays within bf16 reduction-order
// noise of one rank's.
TEST(LlamaFamilyPrecision, SixteenBitRunsTrackPyTorchsFp32Losses) {
  const Golden& g = golden("llama_gqa");
  const std::vector<double> bf16 = losses_of(train(g, 1, "bf16", "--set bf16.enabled=true"));
  expect_losses_close(bf16, g.losses, 2e-3, "bf16 against PyTorch fp32");
  expect_losses_close(losses_of(train(g, 1, "fp16", "--set fp16.enabled=true")), g.losses, 5e-4,
                      "fp16 against PyTorch fp32");
  expect_losses_close(losses_of(train(g, 1, "autocast", "--set torch_autocast.enabled=true")), g.losses, 1e-3,
                      "torch_autocast bf16 against PyTorch fp32");
  expect_losses_close(losses_of(train(g, 2, "bf16_np2_z2",
                                      "--set bf16.enabled=true --set zero_optimization.stage=2 "
                                      "--set train_micro_batch_size_per_gpu=2")),
                      bf16, 1e-3, "bf16 np 2 ZeRO-2 against bf16 np 1");
}

// bf16 compute keeps the products' inputs in bf16 where they are made (llama_block.cpp), and
// every layout still computes one rank's bf16 run. With fp32 gradient accumulation and fp32
// reductions: pipeline stages under 1F1B, and full activation checkpointing (the recompute makes
// the forward's bits), give one rank's losses over the same micro-batches within 1e-5; ZB-H1's
// split backward (its input pass keeps SwiGLU's gradient in fp32, which its weight pass rounds and
// sums as the whole backward does in one pass: tests/kernels/test_split_backward.cpp) 1F1B's, bit
// for bit, as GPT-2's (test_cli_pipeline.cpp);
// ZeRO-3 at np 2 splits each product's rows over the ranks, whose fp32 sums round apart from one
// rank's (by 1.2e-7 relative at most over the 8 steps on Zen 4; pipelines and recompute: exactly).
// llama_biases has mlp_bias: the gate/up biases' gradients summed beside SwiGLU's bf16 gradient.
TEST(LlamaFamilyPrecision, Bf16LayoutsGiveTheLossesOfOneRank) {
  const std::string bf16 =
      "--set bf16.enabled=true --set data_types.grad_accum_dtype=fp32 --set communication_data_type=fp32 ";
  for (const char* name : {"llama_gqa", "llama_biases"}) {
    const Golden& g = golden(name);
    const std::vector<double> one = losses_of(train(g, 1, "bf16_fp32acc", bf16)),
                              one_micro1 = losses_of(train(g, 1, "bf16_fp32acc_gas", bf16 + kMicro1));
    expect_losses_close(one, g.losses, 2e-3, std::string(name) + " bf16 against PyTorch fp32");
    const std::vector<double> one_f_one_b =
        losses_of(train(g, 2, "bf16_p2_1f1b", bf16 + kPipe2 + "--set pipeline.schedule=1f1b"));
    expect_losses_close(one_f_one_b, one_micro1, 1e-5, std::string(name) + " bf16 p2 1f1b");
    EXPECT_EQ(losses_of(train(g, 2, "bf16_p2_zbh1", bf16 + kPipe2 + "--set pipeline.schedule=zb-h1")), one_f_one_b)
        << name << " bf16 p2 zb-h1: 1F1B's losses, bit for bit";
    expect_losses_close(losses_of(train(g, 1, "bf16_full_ac", bf16 + "--set pipeline.activation_checkpoint_interval=1")),
                        one, 1e-5, std::string(name) + " bf16 full activation checkpointing");
    expect_losses_close(losses_of(train(g, 2, "bf16_np2_z3", bf16 + "--set zero_optimization.stage=3")), one, 1e-5,
                        std::string(name) + " bf16 np 2 ZeRO-3");
  }
}

// bf16 compute keeps the attention half's q, k, v and output in bf16 and runs the fused
// grouped-query kernel (kernels/attention_gqa.hpp), here with Mistral's sliding window: within
// bf16's rounding of PyTorch's fp32 losses, and ZeRO-3 at np 2 and two pipeline stages within
// bf16 reduction-order noise of one rank's.
TEST(LlamaFamilyPrecision, Bf16WindowedAttentionTracksPyTorchAndOneRankAcrossLayouts) {
  const Golden& g = golden("mistral_window");
  const std::vector<double> bf16 = losses_of(train(g, 1, "bf16", "--set bf16.enabled=true"));
  expect_losses_close(bf16, g.losses, 2e-3, "mistral bf16 against PyTorch fp32");
  expect_losses_close(losses_of(train(g, 2, "bf16_np2_z3",
                                      "--set bf16.enabled=true --set zero_optimization.stage=3 "
                                      "--set train_micro_batch_size_per_gpu=1")),
                      bf16, 1e-3, "bf16 np 2 ZeRO-3 against bf16 np 1");
  expect_losses_close(losses_of(train(g, 2, "bf16_p2", "--set bf16.enabled=true " + kPipe2)), bf16, 1e-3,
                      "bf16 two pipeline stages against bf16 np 1");
}

// A vocabulary that does not split evenly: the tensor ranks pad embed_tokens and the untied
// lm_head to a multiple of t (Megatron's padding); padded rows are never looked up and their
// logits are masked, so the losses are one rank's.
TEST(LlamaFamilyTensorParallel, PaddedVocabularyGivesTheLossesOfOneRank) {
  const std::string example = kSource + "/input/llama-tiny.json";
  const std::string args = " --set model.vocab_size=251 --set training.steps=6";
  const std::string one = temp_path("llama_vocab_t1"), two = temp_path("llama_vocab_t2");
  std::system(("rm -rf " + one + " " + two).c_str());
  Result r = run("train " + example + " --output " + one + args, 1);
  ASSERT_EQ(r.code, 0) << r.err;
  r = run("train " + example + " --output " + two + args + " --set tensor_parallel.autotp_size=2", 2);
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("vocabulary padded 251 -> 252"), std::string::npos) << r.out;
  expect_losses_close(losses_of(read_metrics(two)), losses_of(read_metrics(one)), 1e-5, "t 2, vocabulary 251");
}

// A model given in the section itself (no Hugging Face file) trains with Hugging Face's
// initialisation and the input/llama-tiny.json example runs.
TEST(LlamaFamilyExample, LlamaTinyTrainsAndLearns) {
  const std::string dir = temp_path("llama_tiny");
  const Result r = run("train " + kSource + "/input/llama-tiny.json --output " + dir, 1);
  ASSERT_EQ(r.code, 0) << r.out << r.err;
  EXPECT_NE(r.out.find("model   llama V=256"), std::string::npos) << r.out;
  const std::vector<double> losses = losses_of(read_metrics(dir));
  ASSERT_GE(losses.size(), 2u);
  EXPECT_NEAR(losses.front(), std::log(256.0), 0.1);  // initializer_range 0.02: near-uniform logits at first
  EXPECT_LT(losses.back(), losses.front() - 0.5);
}

// Bad input: exit 2 at validation, one line naming the key (and the file for a Hugging Face config).
TEST(LlamaFamilyValidation, UnsupportedCombinationsStopWithOneLine) {
  const Golden& g = golden("llama_gqa");
  const std::string config = write_config("llama_bad.json", golden_run(g));
  expect_one_line_rejection(run("validate " + config + " --world-size 2 --set tensor_parallel.autotp_size=2 "
                                "--set model.num_key_value_heads=1", 0),
                            "`tensor_parallel.autotp_size`: autotp_size 2 does not divide model.num_key_value_heads (1)");
  expect_one_line_rejection(run("validate " + config + " --set model.num_key_value_heads=3", 0),
                            "`model.num_key_value_heads`: value 3 does not divide num_attention_heads (4)");
  expect_one_line_rejection(run("validate " + config + " --set model.architecture=mixtral", 0),
                            "`model.architecture`: value \"mixtral\" differs from model_type \"llama\"");
  expect_one_line_rejection(run("validate " + config + " --set model.n_embd=64", 0),
                            "`model.n_embd`: GPT-2's key; model.architecture llama takes hidden_size");
  json hostile = json::parse(slurp(g.hf_dir + "/config.json"));
  hostile["num_local_experts"] = 8;
  const std::string hf = temp_path("llama_hostile_hf");
  std::system(("mkdir -p " + hf).c_str());
  std::ofstream(hf + "/config.json") << hostile.dump(2);
  expect_one_line_rejection(run("validate " + config + " --set model.hf_config=" + hf, 0),
                            "`model.hf_config.num_local_experts`: not a key of Hugging Face's LlamaConfig that zero3d "
                            "reads");
}

}  // namespace
