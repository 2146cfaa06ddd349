// sparse_attention.cpp — layouts of DeepSpeed's SparsityConfig classes (DEEPSPEED-FACTS-2 §8.2),
// written from their rules: dense, fixed (Child et al. 2019, "Generating Long Sequences with
// Sparse Transformers"), variable, BigBird (Zaheer et al. 2020) and block-sparse Longformer
// (Beltagy et al. 2020).
#include "model/sparse_attention.hpp"

#include <algorithm>
#include <cstdio>
#include <numeric>

#include "base/rng.hpp"
#include "kernels/attention_sparse.hpp"

namespace zero3d {

namespace {

using Problems = std::vector<std::pair<std::string, std::string>>;

struct Layout {
  std::vector<uint8_t>& v;
  int64_t nb, h;
  uint8_t& at(int64_t r, int64_t c) { return v[(h * nb + r) * nb + c]; }
  void rows(int64_t r0, int64_t r1, int64_t c0, int64_t c1) {  // set rows [r0, r1) × cols [c0, c1)
    for (int64_t r = std::max<int64_t>(r0, 0); r < std::min(r1, nb); ++r)
      for (int64_t c = std::max<int64_t>(c0, 0); c < std::min(c1, nb); ++c) at(r, c) = 1;
  }
  // Inside a window [w0, w1): row r attends cols [w0, r] (unidirectional) or [w0, w1).
  void window(int64_t w0, int64_t w1, bool uni) {
    for (int64_t r = w0; r < w1; ++r) rows(r, r + 1, w0, uni ? r + 1 : w1);
  }
  void lower_triangle_only() {
    for (int64_t r = 0; r < nb; ++r)
      for (int64_t c = r + 1; c < nb; ++c) at(r, c) = 0;
  }
};

// `count` distinct columns drawn uniformly from [0, range) (partial Fisher-Yates).
std::vector<int64_t> distinct_columns(Rng& rng, int64_t range, int64_t count) {
  count = std::min(count, range);  // validation keeps count <= range; a row shorter than that takes all
  std::vector<int64_t> pool(static_cast<size_t>(range));
  std::iota(pool.begin(), pool.end(), 0);
  for (int64_t i = 0; i < count; ++i) std::swap(pool[i], pool[i + static_cast<int64_t>(rng.below(range - i))]);
  pool.resize(static_cast<size_t>(count));
  return pool;
}

void random_blocks(Layout& L, const SparseAttention& s, int64_t layer, bool row_causal) {
  for (int64_t r = 0; r < L.nb; ++r) {
    Rng rng(s.seed, hash_name("sparse_attention.random." + std::to_string(layer) + "." + std::to_string(L.h) + "." +
                              std::to_string(r)));
    for (int64_t c : distinct_columns(rng, row_causal ? r + 1 : L.nb, s.num_random_blocks)) L.at(r, c) = 1;
  }
}

// Global columns (and rows when horizontal) [g0, g1): rows from 0 (bidirectional) or from g0.
void global_blocks(Layout& L, int64_t g0, int64_t g1, bool uni, bool horizontal) {
  if (horizontal) L.rows(g0, g1, 0, L.nb);
  L.rows(uni ? g0 : 0, L.nb, g0, g1);
}

void fixed(Layout& L, const SparseAttention& s) {
  const int64_t nb = L.nb, W = s.num_local_blocks, G = s.num_global_blocks;
  for (int64_t i = 0; i < nb; i += W) L.window(i, std::min(i + W, nb), s.unidirectional);
  // Global representatives from the window's end backwards: head h uses pattern h mod patterns.
  const int64_t first = W - (1 + L.h % s.num_different_global_patterns) * G;
  const int64_t end = nb - nb % W;
  for (int64_t i = first; i < end; i += W) global_blocks(L, i, i + G, s.unidirectional, s.horizontal_global_attention);
  if (end < nb) {  // a short last window still gets its representative
    const int64_t start = std::min(end + first, nb - G);
    global_blocks(L, start, start + G, s.unidirectional, s.horizontal_global_attention);
  }
}

void variable(Layout& L, const SparseAttention& s, int64_t layer) {
  const int64_t nb = L.nb;
  random_blocks(L, s, layer, false);
  int64_t start = 0, size = 0;
  for (int64_t w : s.local_window_blocks) {  // the listed windows, then the last size repeated
    size = w;
    L.window(start, std::min(start + w, nb), s.unidirectional);
    start += w;
  }
  for (int64_t i = start; i < nb; i += size) L.window(i, std::min(i + size, nb), s.unidirectional);
  for (size_t k = 0; k < s.global_block_indices.size(); ++k) {
    const int64_t g0 = s.global_block_indices[k];
    if (g0 >= nb) continue;
    const int64_t g1 = s.global_block_end_indices.empty() ? g0 + 1 : std::min(s.global_block_end_indices[k], nb);
    global_blocks(L, g0, g1, s.unidirectional, s.horizontal_global_attention);
  }
}

void sliding_window(Layout& L, int64_t blocks) {
  const int64_t w = blocks / 2;
  for (int64_t r = 0; r < L.nb; ++r) L.rows(r, r + 1, r - w, r + w + 1);
}

void bigbird(Layout& L, const SparseAttention& s, int64_t layer) {
  random_blocks(L, s, layer, s.unidirectional);
  sliding_window(L, s.num_sliding_window_blocks);
  L.rows(0, s.num_global_blocks, 0, L.nb);
  L.rows(0, L.nb, 0, s.num_global_blocks);
  if (s.unidirectional) L.lower_triangle_only();
}

void bslongformer(Layout& L, const SparseAttention& s) {
  sliding_window(L, s.num_sliding_window_blocks);
  for (size_t k = 0; k < s.global_block_indices.size(); ++k) {
    const int64_t g0 = s.global_block_indices[k];
    if (g0 >= L.nb) continue;
    const int64_t g1 = s.global_block_end_indices.empty() ? g0 + 1 : std::min(s.global_block_end_indices[k], L.nb);
    L.rows(g0, g1, 0, L.nb);
    L.rows(0, L.nb, g0, g1);
  }
  if (s.unidirectional) L.lower_triangle_only();
}

// Blocks head h computes: those set on or below the diagonal.
int64_t causal_blocks(const std::vector<uint8_t>& layout, int64_t h, int64_t nb) {
  int64_t on = 0;
  for (int64_t r = 0; r < nb; ++r)
    for (int64_t c = 0; c <= r; ++c) on += layout[(h * nb + r) * nb + c];
  return on;
}

}  // namespace

const char* sparsity_mode_name(SparsityMode m) {
  switch (m) {
    case SparsityMode::Dense: return "dense";
    case SparsityMode::Fixed: return "fixed";
    case SparsityMode::Variable: return "variable";
    case SparsityMode::BigBird: return "bigbird";
    case SparsityMode::BSLongformer: return "bslongformer";
  }
  return "?";
}

Problems sparse_attention_problems(const SparseAttention& s, int64_t heads, int64_t seq_len) {
  Problems out;
  const auto add = [&out](const char* key, std::string msg) { out.emplace_back(key, std::move(msg)); };
  const std::string T = std::to_string(seq_len), blk = std::to_string(s.block);
  if (seq_len % s.block != 0) {
    add("block", "the sequence length " + T + " (model.n_positions) is not a multiple of the block " + blk);
    return out;
  }
  const int64_t nb = seq_len / s.block;
  const bool ranges = !s.global_block_end_indices.empty();
  const auto check_ranges = [&] {
    if (!ranges) return;
    if (s.global_block_end_indices.size() != s.global_block_indices.size())
      add("global_block_end_indices", std::to_string(s.global_block_end_indices.size()) +
                                          " end indices for " + std::to_string(s.global_block_indices.size()) +
                                          " start indices: one each");
    else
      for (size_t k = 0; k < s.global_block_indices.size(); ++k)
        if (s.global_block_indices[k] >= s.global_block_end_indices[k])
          add("global_block_end_indices", "global block " + std::to_string(k) + " starts at " +
                                              std::to_string(s.global_block_indices[k]) + ", not before its end " +
                                              std::to_string(s.global_block_end_indices[k]));
  };
  switch (s.mode) {
    case SparsityMode::Dense: break;
    case SparsityMode::Fixed:
      if (s.num_local_blocks % s.num_global_blocks != 0)
        add("num_global_blocks", "num_local_blocks " + std::to_string(s.num_local_blocks) +
                                     " is not a multiple of num_global_blocks " + std::to_string(s.num_global_blocks));
      if (s.horizontal_global_attention && s.unidirectional)
        add("horizontal_global_attention", "only bidirectional attention has horizontal global blocks");
      if (s.num_different_global_patterns > 1 && !s.different_layout_per_head)
        add("num_different_global_patterns", std::to_string(s.num_different_global_patterns) +
                                                 " patterns need different_layout_per_head true (one layout serves all heads)");
      if (s.num_global_blocks > 0 && s.num_different_global_patterns > s.num_local_blocks / s.num_global_blocks)
        add("num_different_global_patterns",
            std::to_string(s.num_different_global_patterns) + " exceeds num_local_blocks / num_global_blocks = " +
                std::to_string(s.num_local_blocks / s.num_global_blocks));
      break;
    case SparsityMode::Variable:
      check_ranges();
      if (s.horizontal_global_attention && s.unidirectional)
        add("horizontal_global_attention", "only bidirectional attention has horizontal global blocks");
      if (s.num_random_blocks > nb)
        add("num_random_blocks", std::to_string(s.num_random_blocks) + " random blocks exceed the " +
                                     std::to_string(nb) + " blocks of a row (" + T + " tokens / block " + blk + ")");
      break;
    case SparsityMode::BigBird:
      for (const auto& [key, n] : {std::pair<const char*, int64_t>{"num_random_blocks", s.num_random_blocks},
                                   {"num_sliding_window_blocks", s.num_sliding_window_blocks},
                                   {"num_global_blocks", s.num_global_blocks}})
        if (n > nb)
          add(key, std::to_string(n) + " exceeds the " + std::to_string(nb) + " blocks of a row (" + T +
                       " tokens / block " + blk + ")");
      break;
    case SparsityMode::BSLongformer:
      check_ranges();
      if (s.num_sliding_window_blocks > nb)
        add("num_sliding_window_blocks", std::to_string(s.num_sliding_window_blocks) + " exceeds the " +
                                             std::to_string(nb) + " blocks of a row (" + T + " tokens / block " + blk +
                                             ")");
      break;
  }
  (void)heads;
  return out;
}

std::vector<uint8_t> sparse_block_layout(const SparseAttention& s, int64_t heads, int64_t seq_len, int64_t layer) {
  const int64_t nb = seq_len / s.block;
  std::vector<uint8_t> v(static_cast<size_t>(heads * nb * nb), 0);
  // DeepSpeed builds head 0 only and copies it unless each head has its own layout.
  const int64_t built = s.different_layout_per_head ? heads : 1;
  for (int64_t h = 0; h < built; ++h) {
    Layout L{v, nb, h};
    switch (s.mode) {
      case SparsityMode::Dense: L.rows(0, nb, 0, nb); break;
      case SparsityMode::Fixed: fixed(L, s); break;
      case SparsityMode::Variable: variable(L, s, layer); break;
      case SparsityMode::BigBird: bigbird(L, s, layer); break;
      case SparsityMode::BSLongformer: bslongformer(L, s); break;
    }
  }
  for (int64_t h = built; h < heads; ++h) std::copy_n(v.begin(), nb * nb, v.begin() + h * nb * nb);
  return v;
}

double causal_block_share(const std::vector<uint8_t>& layout, int64_t heads, int64_t nb) {
  int64_t on = 0;
  for (int64_t h = 0; h < heads; ++h) on += causal_blocks(layout, h, nb);
  return static_cast<double>(on) / static_cast<double>(heads * nb * (nb + 1) / 2);
}

int64_t sparse_probs_per_head(const SparseAttention& s, int64_t heads, int64_t seq_len, int64_t layers) {
  const int64_t nb = seq_len / s.block;
  int64_t most = 0;
  for (int64_t l = 0; l < std::max<int64_t>(layers, 1); ++l) {
    const std::vector<uint8_t> lay = sparse_block_layout(s, heads, seq_len, l);
    for (int64_t h = 0; h < heads; ++h) most = std::max(most, causal_blocks(lay, h, nb));
  }
  return most * s.block * s.block;
}

SparseAttentionBytes sparse_attention_model_bytes(const SparseAttention& s, int64_t heads, int64_t seq_len,
                                                  const std::vector<int64_t>& layers, int64_t head0,
                                                  int64_t local_heads, int64_t B, int64_t hs, bool device_form) {
  SparseAttentionBytes out;
  const int64_t nb = seq_len / s.block, per_head = nb * nb;
  int64_t panel_floats = 0;
  for (int64_t l : layers) {  // GPT's constructor: this rank's heads of block l's layout
    const std::vector<uint8_t> all = sparse_block_layout(s, heads, seq_len, l);
    const std::vector<uint8_t> mine(all.begin() + head0 * per_head, all.begin() + (head0 + local_heads) * per_head);
    out.tables += kernels::SparseBlockTable::model_bytes_of(mine, local_heads, nb);
    if (device_form)
      panel_floats = std::max(panel_floats, kernels::gpu::sparse_panel_floats(
                                                kernels::SparseBlockTable::groups_of(mine, local_heads, nb), s.block, B, hs));
  }
  out.panels = panel_floats * static_cast<int64_t>(sizeof(float));
  return out;
}

bool sparse_attention_device_form(kernels::Backend backend) {
  return backend == kernels::Backend::Gpu || kernels::sparse_attention_device_form_on_host();
}

std::string sparse_attention_summary(const SparseAttention& s, int64_t heads, int64_t seq_len, int64_t layers) {
  const int64_t nb = seq_len / s.block;
  double share = 0.0;
  for (int64_t l = 0; l < layers; ++l) share += causal_block_share(sparse_block_layout(s, heads, seq_len, l), heads, nb);
  share /= static_cast<double>(std::max<int64_t>(layers, 1));
  std::string out = std::string(sparsity_mode_name(s.mode)) + ", block " + std::to_string(s.block) + " (" +
                    std::to_string(nb) + "x" + std::to_string(nb) + " blocks per head)";
  if (s.different_layout_per_head) out += ", a layout per head";
  char pct[64];
  std::snprintf(pct, sizeof(pct), " | %.1f%% of the causal blocks computed", 100.0 * share);
  out += pct;
  const bool bidirectional = s.mode == SparsityMode::BigBird || s.mode == SparsityMode::BSLongformer ||
                             (s.mode != SparsityMode::Dense && !s.unidirectional);
  if (bidirectional) out += "; the model is causal: the layout's blocks above the diagonal are not computed";
  return out;
}

}  // namespace zero3d
