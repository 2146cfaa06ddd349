// test_sparse_attention.cpp — DeepSpeed's `sparse_attention` section: the layouts each mode
// builds, block for block, and the block-sparse causal attention's forward and backward,
// against tests/golden/sparse_attention.h5 (tests/golden/make_sparse_attention_goldens.py:
// the layout rules rebuilt in NumPy, dense masked attention in PyTorch float64); what the
// section's reader accepts and rejects; and what the model does with it.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "base/failure.hpp"
#include "config/config.hpp"
#include "io/h5.hpp"
#include "kernels/attention.hpp"
#include "kernels/attention_sparse.hpp"
#include "model/model.hpp"
#include "model/sparse_attention.hpp"

using namespace zero3d;
using json = nlohmann::json;

namespace {

const std::string kGolden = std::string(ZERO3D_GOLDEN_DIR) + "/sparse_attention.h5";

// The section as a user writes it, read through the config reader (a model with `heads` heads
// and `seq_len` tokens).
Config read_with(const json& section, int64_t heads, int64_t seq_len) {
  json j = {{"train_batch_size", 1},
            {"model", {{"vocab_size", 64}, {"n_positions", seq_len}, {"n_layer", 2}, {"n_head", heads},
                       {"n_embd", 8 * heads}}},
            {"sparse_attention", section}};
  return read_config(j, "cfg.json", 1);
}

std::string attr_string(const h5::File& f, const std::string& group, const char* key) {
  h5::Handle g(H5Gopen2(f.id(), group.c_str(), H5P_DEFAULT), H5Gclose);
  std::string v;
  EXPECT_TRUE(h5::read_attribute(g.get(), key, v)) << group << ": " << key;
  return v;
}
int64_t attr_int(const h5::File& f, const std::string& group, const char* key) {
  h5::Handle g(H5Gopen2(f.id(), group.c_str(), H5P_DEFAULT), H5Gclose);
  int64_t v = 0;
  EXPECT_TRUE(h5::read_attribute(g.get(), key, v)) << group << ": " << key;
  return v;
}

std::vector<std::string> cases(const h5::File& f, const std::string& group) {
  std::vector<std::string> names;
  h5::Handle g(H5Gopen2(f.id(), group.c_str(), H5P_DEFAULT), H5Gclose);
  H5Literate(
      g.get(), H5_INDEX_NAME, H5_ITER_INC, nullptr,
      [](hid_t, const char* name, const H5L_info_t*, void* out) -> herr_t {
        static_cast<std::vector<std::string>*>(out)->push_back(name);
        return 0;
      },
      &names);
  return names;
}

}  // namespace

TEST(SparseAttentionLayout, EveryModeBuildsDeepSpeedsBlocks) {
  const h5::File f = h5::File::open_read(kGolden);
  const std::vector<std::string> names = cases(f, "layouts");
  ASSERT_GE(names.size(), 10u);
  for (const std::string& name : names) {
    const std::string g = "layouts/" + name;
    const int64_t heads = attr_int(f, g, "heads"), seq_len = attr_int(f, g, "seq_len");
    const Config c = read_with(json::parse(attr_string(f, g, "config")), heads, seq_len);
    ASSERT_TRUE(c.model.sparse_attention.enabled) << name;
    const std::vector<int32_t> want = f.read_ints(g + "/layout");
    const std::vector<uint8_t> got = sparse_block_layout(c.model.sparse_attention, heads, seq_len, 0);
    ASSERT_EQ(got.size(), want.size()) << name;
    int64_t wrong = 0;
    for (size_t i = 0; i < got.size(); ++i) wrong += got[i] != want[i];
    EXPECT_EQ(wrong, 0) << name << ": " << wrong << " blocks differ";
  }
}

TEST(SparseAttentionLayout, RandomBlocksAreDistinctPerRowAndTheSameOnEveryCall) {
  SparseAttention s;
  s.enabled = true;
  s.mode = SparsityMode::Variable;
  s.block = 4;
  s.num_random_blocks = 3;
  s.local_window_blocks = {1};
  s.global_block_indices = {100};  // beyond the sequence: no global block
  const int64_t nb = 16;
  const std::vector<uint8_t> a = sparse_block_layout(s, 1, nb * s.block, 0);
  for (int64_t r = 0; r < nb; ++r) {
    int64_t on = 0;
    for (int64_t c = 0; c < nb; ++c) on += a[r * nb + c];
    // the window puts the diagonal; the random three may include it
    EXPECT_TRUE(on == 3 || on == 4) << "row " << r << " has " << on;
    EXPECT_EQ(a[r * nb + r], 1);
  }
  EXPECT_EQ(a, sparse_block_layout(s, 1, nb * s.block, 0));   // every rank builds the same
  EXPECT_NE(a, sparse_block_layout(s, 1, nb * s.block, 1));   // another block draws again
  s.seed += 1;
  EXPECT_NE(a, sparse_block_layout(s, 1, nb * s.block, 0));   // and another seed
}

TEST(SparseAttentionKernel, ForwardAndBackwardMatchDenseMaskedAttention) {
  const h5::File f = h5::File::open_read(kGolden);
  const std::vector<std::string> names = cases(f, "attention");
  ASSERT_GE(names.size(), 4u);
  for (const std::string& name : names) {
    const std::string g = "attention/" + name;
    const int64_t B = attr_int(f, g, "B"), T = attr_int(f, g, "T"), C = attr_int(f, g, "C"), H = attr_int(f, g, "H");
    const json cfg = json::parse(attr_string(f, g, "config"));
    const std::vector<int32_t> want_layout = f.read_ints(g + "/layout");
    const std::vector<uint8_t> layout(want_layout.begin(), want_layout.end());
    const int64_t block = cfg.value("block", 16);
    std::vector<float> qkv = f.read_floats(g + "/qkv"), d_out = f.read_floats(g + "/d_out");
    const std::vector<float> want_out = f.read_floats(g + "/out"), want_dqkv = f.read_floats(g + "/d_qkv");
    // the kept probabilities: block² per computed block, the most any head computes
    const int64_t nb = T / block;
    int64_t most = 0;
    for (int64_t h = 0; h < H; ++h) {
      int64_t on = 0;
      for (int64_t r = 0; r < nb; ++r)
        for (int64_t c = 0; c <= r; ++c) on += layout[(h * nb + r) * nb + c];
      most = std::max(most, on);
    }
    const int64_t stride = most * block * block;
    std::vector<float> out(B * T * C, 0.0f), att(B * H * stride + 1, 0.0f), dqkv(B * T * 3 * C, 7.0f);
    att.back() = 123.0f;  // a guard just past the last panel
    kernels::sparse_attention_forward(out.data(), att.data(), stride, qkv.data(), layout.data(), block, B, T, C, H);
    EXPECT_EQ(att.back(), 123.0f) << name << ": the panels overran their stride";
    kernels::sparse_attention_backward(dqkv.data(), d_out.data(), qkv.data(), att.data(), stride, layout.data(), block,
                                       B, T, C, H);
    double worst_out = 0, worst_grad = 0;
    for (size_t i = 0; i < out.size(); ++i) worst_out = std::max(worst_out, double(std::fabs(out[i] - want_out[i])));
    for (size_t i = 0; i < dqkv.size(); ++i)
      worst_grad = std::max(worst_grad, double(std::fabs(dqkv[i] - want_dqkv[i])));
    EXPECT_LT(worst_out, 2e-6) << name;
    EXPECT_LT(worst_grad, 1e-5) << name;
  }
}

TEST(SparseAttentionKernel, ADenseLayoutIsCausalAttention) {
  const int64_t B = 2, T = 64, C = 32, H = 4, block = 16, nb = T / block;
  std::vector<float> qkv(B * T * 3 * C), d_out(B * T * C);
  for (size_t i = 0; i < qkv.size(); ++i) qkv[i] = std::sin(0.37f * float(i));
  for (size_t i = 0; i < d_out.size(); ++i) d_out[i] = std::cos(0.11f * float(i));
  const std::vector<uint8_t> layout(H * nb * nb, 1);
  std::vector<float> out(B * T * C), att(B * H * T * T), dqkv(B * T * 3 * C);
  std::vector<float> ref_out(B * T * C), ref_att(B * H * T * T), ref_dqkv(B * T * 3 * C),
      scratch(kernels::kRowBlock * T);
  kernels::sparse_attention_forward(out.data(), att.data(), T * T, qkv.data(), layout.data(), block, B, T, C, H);
  kernels::sparse_attention_backward(dqkv.data(), d_out.data(), qkv.data(), att.data(), T * T, layout.data(), block, B,
                                     T, C, H);
  kernels::attention_forward(ref_out.data(), ref_att.data(), qkv.data(), B, T, C, H);
  kernels::attention_backward(ref_dqkv.data(), scratch.data(), d_out.data(), qkv.data(), ref_att.data(), B, T, C, H);
  for (size_t i = 0; i < out.size(); ++i) ASSERT_NEAR(out[i], ref_out[i], 1e-5) << i;
  for (size_t i = 0; i < dqkv.size(); ++i) ASSERT_NEAR(dqkv[i], ref_dqkv[i], 1e-5) << i;
}

TEST(SparseAttentionConfig, DeepSpeedsDefaultsPerMode) {
  const SparseAttention f = read_with({{"mode", "fixed"}}, 2, 64).model.sparse_attention;
  EXPECT_EQ(f.block, 16);
  EXPECT_EQ(f.num_local_blocks, 4);
  EXPECT_EQ(f.num_global_blocks, 1);
  EXPECT_FALSE(f.unidirectional);
  EXPECT_EQ(f.num_different_global_patterns, 1);
  const SparseAttention b = read_with({{"mode", "bigbird"}}, 2, 64).model.sparse_attention;
  EXPECT_EQ(b.num_random_blocks, 0);  // the config's default (the Python class's is 1)
  EXPECT_EQ(b.num_sliding_window_blocks, 3);
  const SparseAttention v = read_with(json::object(), 2, 64).model.sparse_attention;  // mode defaults to fixed
  EXPECT_EQ(v.mode, SparsityMode::Fixed);
  EXPECT_FALSE(read_with(json::object(), 2, 64).model.sparse_attention.different_layout_per_head);
}

TEST(SparseAttentionConfig, DeepSpeedsErrorsAreValidationErrorsNamingTheKey) {
  const auto message = [](const json& section, int64_t seq_len = 64) {
    try {
      read_with(section, 2, seq_len);
    } catch (const InputError& e) {
      return std::string(e.what());
    }
    return std::string("accepted");
  };
  EXPECT_NE(message({{"block", 16}}, 72).find("`sparse_attention.block`"), std::string::npos);
  EXPECT_NE(message({{"num_local_blocks", 4}, {"num_global_blocks", 3}}).find("num_global_blocks"), std::string::npos);
  EXPECT_NE(message({{"attention", "unidirectional"}, {"horizontal_global_attention", true}})
                .find("horizontal_global_attention"),
            std::string::npos);
  EXPECT_NE(message({{"num_different_global_patterns", 2}}).find("different_layout_per_head"), std::string::npos);
  EXPECT_NE(message({{"mode", "variable"}, {"num_random_blocks", 5}}).find("num_random_blocks"), std::string::npos);
  EXPECT_NE(message({{"mode", "variable"}, {"global_block_indices", {1, 2}}, {"global_block_end_indices", {3}}})
                .find("global_block_end_indices"),
            std::string::npos);
  EXPECT_NE(message({{"mode", "bslongformer"}, {"global_block_indices", {3}}, {"global_block_end_indices", {2}}})
                .find("global_block_end_indices"),
            std::string::npos);
  EXPECT_NE(message({{"mode", "butterfly"}}).find("`sparse_attention.mode`"), std::string::npos);
  // DeepSpeed's bigbird reads no `attention` key: zero3d says so instead of ignoring it
  EXPECT_NE(message({{"mode", "bigbird"}, {"attention", "unidirectional"}}).find("attention"), std::string::npos);
  EXPECT_EQ(message({{"mode", "fixed"}, {"block", 16}}), "accepted");
}

TEST(SparseAttentionModel, KeptProbabilitiesShrinkWithTheLayout) {
  GPTShape shape{64, 256, 2, 4, 32};
  EXPECT_EQ(attention_probs_size(shape, 2, 4, 256), 2 * 4 * 256 * 256);
  shape.sparse.enabled = true;
  shape.sparse.block = 16;
  shape.sparse.num_local_blocks = 4;
  shape.sparse.unidirectional = true;
  // 16 blocks per row in windows of 4: 4·10 local blocks; the global column g = 3 + 4k reaches
  // rows g+1 … 15 (unidirectional), 12 − 4k of them outside its own window, for k = 0 … 3
  const int64_t blocks = 40 + 12 + 8 + 4 + 0;
  EXPECT_EQ(sparse_probs_per_head(shape.sparse, 4, 256, 2), blocks * 16 * 16);
  EXPECT_EQ(attention_probs_size(shape, 2, 4, 256), 2 * 4 * blocks * 16 * 16);
}

TEST(SparseAttentionModel, FlopsCountTheComputedShareOfTheAttentionTerm) {
  GPTShape dense{64, 128, 2, 2, 32};
  GPTShape sparse = dense;
  sparse.sparse.enabled = true;
  sparse.sparse.mode = SparsityMode::Dense;
  sparse.sparse.block = 16;
  EXPECT_DOUBLE_EQ(gpt_flops_per_token(sparse, 1000), gpt_flops_per_token(dense, 1000));
  sparse.sparse.mode = SparsityMode::Fixed;  // 8 blocks, windows of 4: 10 + 10 local, plus globals below them
  sparse.sparse.unidirectional = true;
  const std::vector<uint8_t> lay = sparse_block_layout(sparse.sparse, 2, 128, 0);
  const double share = causal_block_share(lay, 2, 8);
  EXPECT_LT(share, 1.0);
  const double attention_term = 12.0 * 2 * 128 * 32;
  EXPECT_DOUBLE_EQ(gpt_flops_per_token(sparse, 1000), 6.0 * 1000 + attention_term * share);
}
