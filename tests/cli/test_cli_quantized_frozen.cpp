// test_cli_quantized_frozen.cpp — zero_optimization.zero_quantized_nontrainable_weights (ZeRO++,
// issue 34; zero/quantized_frozen.hpp): at stage 3 the frozen parameters' partitions are int8
// groups with one fp32 scale a group. The run computes with the quantise-dequantise of the initial
// frozen weights (an independent reimplementation of the documented block formula below), trains
// close to the unquantised frozen run, computes the same at one, two and four ranks, holds and
// plans exactly the int8 bytes, gathers exactly the estimated bytes, resumes bit for bit, and
// refuses the layouts it cannot serve.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <regex>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "io/h5.hpp"
#include "support/cli_helpers.hpp"
#include "support/frozen_model.hpp"

using namespace cli;

namespace {

const std::string kGoldenDir = kFrozenGoldenDir;

json config(const std::string& init = kGoldenDir + "/frozen_init.h5", bool quantized = true) {
  json c = frozen_golden_config(3, 2, init);
  c["zero_optimization"]["zero_quantized_nontrainable_weights"] = quantized;
  return c;
}

std::string train(const json& c, const std::string& name, int np, const std::string& args = "",
                  const std::string& prefix = "") {
  return train_frozen(c, name, np, args, prefix);
}

// The documented block formula (kernels/quantize.hpp; DeepSpeed's CUDAQuantizer, symmetric int8)
// over one whole tensor of n values: n8 = n rounded up to 8, G = ceil(n8 / 8000) raised until
// 8·G divides n8, groups of n8/G values; in a group of maximum m, s = 256/(2m) (1 when m = 0),
// q = clamp(round-half-even(x·s), −128, 127), and x comes back as q·(1/s).
int64_t groups_of(int64_t n) {
  const int64_t n8 = (n + 7) / 8 * 8;
  int64_t g = (n8 + 7999) / 8000;
  while (n8 % (8 * g) != 0) ++g;
  return g;
}

std::vector<float> quantise_dequantise(const std::vector<float>& x) {
  const auto n = static_cast<int64_t>(x.size());
  const int64_t size = (n + 7) / 8 * 8 / groups_of(n);
  std::vector<float> out(x.size());
  for (int64_t a = 0; a < n; a += size) {
    const int64_t b = std::min(n, a + size);
    float m = 0.0f;
    for (int64_t i = a; i < b; ++i) m = std::max(m, std::fabs(x[static_cast<size_t>(i)]));
    const float s = m == 0.0f ? 1.0f : 256.0f / (2.0f * m), inverse = m == 0.0f ? 1.0f : 1.0f / s;
    for (int64_t i = a; i < b; ++i) {
      const float q = std::min(127.0f, std::max(-128.0f, std::nearbyint(x[static_cast<size_t>(i)] * s)));
      out[static_cast<size_t>(i)] = q * inverse;
    }
  }
  return out;
}

// The initial weights with every frozen tensor replaced by its quantise-dequantise (after the
// rounding to bf16 a bf16 run applies first), written as an init_from file.
std::string quantised_init(bool bf16) {
  const std::string path = temp_path(bf16 ? "qinit_bf16.h5" : "qinit.h5");
  const zero3d::h5::File init = zero3d::h5::File::open_read(kGoldenDir + "/frozen_init.h5");
  zero3d::h5::File out = zero3d::h5::File::create(path);
  for (const char* attr : {"n_embd", "n_head", "n_layer", "n_positions", "vocab_size"}) {
    int64_t v = 0;
    zero3d::h5::read_attribute(init.id(), attr, v);
    zero3d::h5::write_attribute(out.id(), attr, v);
  }
  for (const std::string& name : tensor_names()) {
    std::vector<float> x = init.read_floats(name);
    if (is_frozen(name)) {
      if (bf16)
        for (float& v : x) v = bf16_rounded(v);
      x = quantise_dequantise(x);
    }
    out.write_floats(name, x.data(), init.shape(name));
  }
  out.close();
  return path;
}

// The run computes with the quantise-dequantise of the initial frozen weights: its checkpoint's
// frozen tensors are those values in every bit (fp32 and bf16, whose partition is quantised from
// the bf16 values), and the unquantised frozen run started from those values has the same losses
// in every bit (the same forward and backward, the same trainable updates).
TEST(QuantizedFrozen, RunsWithTheQuantiseDequantiseOfTheInitialFrozenWeights) {
  for (const bool bf16 : {false, true}) {
    const std::string tag = bf16 ? "bf16" : "fp32";
    json q = config(), ref = config(quantised_init(bf16), false);
    if (bf16) q["bf16"] = ref["bf16"] = {{"enabled", true}};
    const std::string dir = train(q, "qf_exact_" + tag, 1);
    const std::string want = train(ref, "qf_exact_ref_" + tag, 1);
    const std::vector<double> a = losses_of(read_metrics(dir)), b = losses_of(read_metrics(want));
    ASSERT_EQ(a.size(), 6u) << tag;
    ASSERT_EQ(b.size(), 6u) << tag;
    for (size_t i = 0; i < a.size(); ++i) EXPECT_EQ(a[i], b[i]) << tag << " step " << i + 1;
    const zero3d::h5::File init = zero3d::h5::File::open_read(kGoldenDir + "/frozen_init.h5");
    const zero3d::h5::File out = zero3d::h5::File::open_read(converted(dir));
    int frozen = 0, exact = 0;
    for (const std::string& name : tensor_names()) {
      if (!is_frozen(name)) continue;
      ++frozen;
      std::vector<float> x = init.read_floats(name);
      if (bf16)
        for (float& v : x) v = bf16_rounded(v);
      const std::vector<float> expect = quantise_dequantise(x), got = out.read_floats(name);
      ASSERT_EQ(got.size(), expect.size()) << name;
      for (size_t k = 0; k < got.size(); ++k) ASSERT_EQ(got[k], expect[k]) << tag << " " << name << "[" << k << "]";
      for (size_t k = 0; k < got.size(); ++k) exact += got[k] == x[k] ? 1 : 0;
    }
    EXPECT_EQ(frozen, 14);
    EXPECT_LT(exact, kFrozenNumel / 2) << tag << ": the frozen weights were not quantised";
  }
}

// Against the unquantised frozen run: the losses within 2e-3 (relative) and the trainable weights
// within 2.5e-2 (relative L2) after six steps at one, two and four ranks (two emulated nodes); and the layouts
// compute alike: the int8 groups are cut per tensor, not per partition, so np 2 and np 4 give
// np 1's losses within 1e-5.
TEST(QuantizedFrozen, TrainsCloseToTheUnquantisedRunAndAlikeAtEveryWorldSize) {
  const std::vector<double> plain = losses_of(read_metrics(train(config(kGoldenDir + "/frozen_init.h5", false), "qf_plain", 1)));
  const zero3d::h5::File plain_w = zero3d::h5::File::open_read(converted(temp_path("qf_plain")));
  std::vector<double> one;
  for (const int np : {1, 2, 4}) {
    const std::string tag = "np " + std::to_string(np);
    const std::string dir = train(config(), "qf_np" + std::to_string(np), np, "", np == 4 ? "ZERO3D_RANKS_PER_NODE=2" : "");
    const std::vector<double> got = losses_of(read_metrics(dir));
    expect_losses_close(got, plain, 2e-3, tag + " vs unquantised");
    if (np == 1) one = got;
    else expect_losses_close(got, one, 1e-5, tag + " vs np 1");
    const zero3d::h5::File w = zero3d::h5::File::open_read(converted(dir));
    // Adam moves an element with a near-zero gradient by up to lr a step either way, so the
    // trainable weights are compared as a whole: ||a − b|| / ||b||.
    double diff = 0.0, norm = 0.0;
    for (const std::string& name : tensor_names()) {
      if (is_frozen(name)) continue;
      const std::vector<float> a = w.read_floats(name), b = plain_w.read_floats(name);
      for (size_t k = 0; k < a.size(); ++k) {
        diff += double(a[k] - b[k]) * double(a[k] - b[k]);
        norm += double(b[k]) * double(b[k]);
      }
    }
    const double rel = std::sqrt(diff / norm);
    EXPECT_LT(rel, 2.5e-2) << tag;  // measured 1.2e-2
    std::printf("[ measured ] %s: trainable weights %.3g (relative L2) from the unquantised run's; last loss %.9f vs "
                "%.9f\n", tag.c_str(), rel, got.back(), plain.back());
  }
}

// The int8 partition's bytes: the trainable elements in the model dtype and, per frozen piece
// (a frozen tensor's part of the rank's partition), 4 bytes a touched group and its codes padded
// to 8 — computed here from the tensor sizes and ZeRO's split.
int64_t partition_bytes(int np, int rank, int64_t param_size) {
  const zero3d::h5::File init = zero3d::h5::File::open_read(kGoldenDir + "/frozen_init.h5");
  const ZeroSplit split = zero_split(kPsi, np);
  const int64_t lo = rank * split.part, hi = std::min(kPsi, lo + split.part);
  int64_t offset = 0, bytes = 0;
  for (const std::string& name : tensor_names()) {
    int64_t n = 1;
    for (const int64_t d : init.shape(name)) n *= d;
    const int64_t a = std::max(lo, offset), b = std::min(hi, offset + n);
    if (a < b) {
      if (!is_frozen(name)) {
        bytes += param_size * (b - a);
      } else {
        const int64_t group = (n + 7) / 8 * 8 / groups_of(n);
        bytes += 4 * ((b - 1 - offset) / group - (a - offset) / group + 1) + (b - a + 7) / 8 * 8;
      }
    }
    offset += n;
  }
  EXPECT_EQ(offset, kPsi);
  return bytes;
}

// The parameter bytes held are the int8 partition's, as the plan counts them, and smaller than
// the model-dtype partition by the formula; the gathers move exactly the estimated bytes.
TEST(QuantizedFrozen, HoldsAndPlansTheInt8PartitionAndGathersTheEstimatedBytes) {
  for (const bool bf16 : {false, true}) {
    for (const int np : {1, 2}) {
      const std::string tag = std::string(bf16 ? "bf16" : "fp32") + " np " + std::to_string(np);
      const int64_t ps = bf16 ? 2 : 4;
      json c = config();
      if (bf16) c["bf16"] = {{"enabled", true}};
      const std::string path = write_config("qf_plan.json", c);
      const std::string dir = train(c, "qf_plan_" + std::to_string(np) + (bf16 ? "b" : "f"), np);
      const json row = read_metrics(dir).back();
      const int64_t held = row.at("memory").at("params").get<int64_t>();  // rank 0's
      EXPECT_EQ(held, partition_bytes(np, 0, ps)) << tag;
      const int64_t unquantised = ps * zero_split(kPsi, np).part;
      EXPECT_LT(held, unquantised) << tag;
      std::printf("[ measured ] %s: params %lld bytes on rank 0 (model dtype: %lld)\n", tag.c_str(), (long long)held,
                  (long long)unquantised);
      const Result e = run("estimate --config " + path + " --world-size " + std::to_string(np) + " --json");
      ASSERT_EQ(e.code, 0) << e.err;
      const json est = json::parse(e.out);
      int64_t most = 0;
      for (int r = 0; r < np; ++r) most = std::max(most, partition_bytes(np, r, ps));
      EXPECT_EQ(est["budgets"][3]["params"].get<int64_t>(), most) << tag;
      // the gather buffers and the staging the int8 gathers take, planned byte for byte
      const json& b = est["budgets"][3];
      EXPECT_EQ(b["comm_gather"].get<int64_t>() + b["comm_prefetch"].get<int64_t>() + b["live_params"].get<int64_t>(),
                row.at("memory").at("gathered").get<int64_t>()) << tag;
      const json predicted = est.at("communication").at(3);
      for (const auto& [axis, bytes] : row.at("comm_bytes_by_axis").items())
        EXPECT_EQ(predicted.at("comm_bytes_by_axis").value(axis, int64_t(0)), bytes.get<int64_t>()) << tag << " " << axis;
    }
  }
  // np 1, fp32: 4·(Ψ − frozen) plus each frozen tensor's codes and scales, against 4·Ψ.
  EXPECT_LT(partition_bytes(1, 0, 4), 4 * (kPsi - kFrozenNumel) + kFrozenNumel + 4 * 14 + 8 * 14 + 1);
}

// With fp16, bf16 master weights, qwZ (the trainable slices quantised too) and qwZ with qgZ on
// four ranks of two emulated nodes: losses within 5e-3 of the unquantised fp32 frozen run, and the
// bytes moved equal to the estimate's.
TEST(QuantizedFrozen, CombinesWithFp16Bf16MasterWeightsQwzAndQgz) {
  const std::vector<double> plain = losses_of(read_metrics(train(config(kGoldenDir + "/frozen_init.h5", false), "qf_plain32", 1)));
  struct Case {
    json patch;
    int np;
    std::string what;
  };
  const std::vector<Case> cases = {
      {{{"fp16", {{"enabled", true}}}}, 2, "fp16"},
      {{{"bf16", {{"enabled", true}, {"bf16_master_weights_and_grads", true}}}}, 2, "bf16 master weights"},
      {{{"zero_optimization", {{"zero_quantized_weights", true}}}}, 2, "qwZ"},
      {{{"zero_optimization", {{"zero_quantized_weights", true}, {"zero_quantized_gradients", true}}}}, 4, "qwZ qgZ"}};
  for (const Case& k : cases) {
    json c = config();
    c.merge_patch(k.patch);
    const std::string path = write_config("qf_combo.json", c);
    const std::string env = k.np == 4 ? "ZERO3D_RANKS_PER_NODE=2" : "";
    const std::string dir = train(c, "qf_combo", k.np, "", env);
    const std::vector<json> rows = read_metrics(dir);
    expect_losses_close(losses_of(rows), plain, 5e-3, k.what);
    const Result e = run("estimate --config " + path + " --world-size " + std::to_string(k.np) +
                         (k.np == 4 ? " --ranks-per-node 2" : "") + " --json");
    ASSERT_EQ(e.code, 0) << e.err;
    const json est = json::parse(e.out), predicted = est.at("communication").at(3), &b = est["budgets"][3];
    for (const auto& [axis, bytes] : rows.back().at("comm_bytes_by_axis").items())
      EXPECT_EQ(predicted.at("comm_bytes_by_axis").value(axis, int64_t(0)), bytes.get<int64_t>()) << k.what << " " << axis;
    EXPECT_EQ(b["comm_gather"].get<int64_t>() + b["comm_prefetch"].get<int64_t>() + b["live_params"].get<int64_t>(),
              rows.back().at("memory").at("gathered").get<int64_t>()) << k.what;  // rank 0's, planned byte for byte
  }
}

// Three steps, saved, resumed for three more at the same world size: the uninterrupted run's
// losses in every bit (the int8 codes and scales saved as each rank holds them). At another world
// size the saved scales (the tensors' groups) and the saved dequantised values give the same
// codes, so the np 1 run goes on as the np 2 one. (Quantising the dequantised values afresh would
// not: a group whose maximum was positive comes back at 127/128 of it; step 4's loss moved by 4e-4.)
TEST(QuantizedFrozen, ResumesBitForBit) {
  for (const bool bf16 : {false, true}) {
    const std::string tag = bf16 ? "bf16" : "fp32";
    json c = config();
    if (bf16) c["bf16"] = {{"enabled", true}};
    const std::string full = train(c, "qf_full_" + tag, 2);
    const std::string resumed = train(c, "qf_resumed_" + tag, 2, "--set training.resume=" + full + "/checkpoints/global_step3");
    const auto a = losses_of(read_metrics(full)), b = losses_of(read_metrics(resumed));
    ASSERT_EQ(a.size(), 6u) << tag;
    ASSERT_EQ(b.size(), 3u) << tag;
    for (size_t i = 0; i < 3; ++i) EXPECT_EQ(b[i], a[3 + i]) << tag << " step " << 4 + i;
    const std::string other = train(c, "qf_other_" + tag, 1, "--set training.resume=" + full + "/checkpoints/global_step3");
    const auto o = losses_of(read_metrics(other));
    // step 4's loss comes from the loaded weights before any update: equal up to the order its
    // micro-batch losses are summed in; after it, fp32 ZeRO-3 at np 1 and np 2 agree within 1e-5
    // and bf16 within 1e-3 (its gradients rounded in another order: measured 1.7e-4 unquantised)
    ASSERT_EQ(o.size(), 3u) << tag;
    EXPECT_NEAR(o[0], a[3], 1e-6 * a[3]) << tag << " resumed at np 1";
    expect_losses_close(o, {a.begin() + 3, a.end()}, bf16 ? 1e-3 : 1e-5, tag + " resumed at np 1");
  }
}

TEST(QuantizedFrozen, LayoutsItCannotServeExitTwoNamingTheKey) {
  const auto with = [](const json& patch) {
    json c = config();
    c.merge_patch(patch);
    return c;
  };
  const std::string key = "`zero_optimization.zero_quantized_nontrainable_weights`: cannot be combined with ";
  const std::vector<std::tuple<json, int, std::string>> cases = {
      {with({{"zero_optimization", {{"offload_param", {{"device", "cpu"}}}}}}), 1, key + "offload_param cpu"},
      {with({{"zero_optimization", {{"mics_shard_size", 1}}}}), 2, key + "mics_shard_size"},
      {with({{"zero_optimization", {{"zero_hpz_partition_size", 2}}}}), 2, key + "zero_hpz_partition_size 2"},
      {with({{"torch_autocast", {{"enabled", true}, {"dtype", "bfloat16"}}}}), 1, key + "torch_autocast"}};
  for (const auto& [c, np, message] : cases) {
    SCOPED_TRACE(message);
    expect_one_line_rejection(run("validate " + write_config("qf_bad.json", c), np), message);
  }
}

}  // namespace
