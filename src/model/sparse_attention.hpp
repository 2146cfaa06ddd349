// sparse_attention.hpp — DeepSpeed's block-sparse attention layouts (the `sparse_attention`
// section, DEEPSPEED-FACTS-2 §8): which (query block, key block) pairs of each head attend.
//
// The layout is DeepSpeed's, block for block, including the blocks above the diagonal that a
// bidirectional pattern sets. zero3d's GPT is causal, so its kernels compute only the layout's
// blocks on or below the diagonal (and the causal triangle inside the diagonal block).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "kernels/device.hpp"  // Backend

namespace zero3d {

enum class SparsityMode { Dense, Fixed, Variable, BigBird, BSLongformer };

// One field per key DeepSpeed reads (runtime/config.py get_sparse_*_config), with its defaults;
// a mode ignores the fields it does not read, as DeepSpeed does.
struct SparseAttention {
  bool enabled = false;
  SparsityMode mode = SparsityMode::Fixed;
  int64_t block = 16;
  bool different_layout_per_head = false;
  bool unidirectional = false;  // `attention`: "unidirectional" or "bidirectional" (fixed, variable)
  bool horizontal_global_attention = false;
  int64_t num_local_blocks = 4, num_global_blocks = 1, num_different_global_patterns = 1;  // fixed (+ bigbird's global)
  int64_t num_random_blocks = 0;                                                          // variable, bigbird
  std::vector<int64_t> local_window_blocks{4};                                            // variable
  std::vector<int64_t> global_block_indices{0}, global_block_end_indices;                 // variable, bslongformer
  int64_t num_sliding_window_blocks = 3;                                                  // bigbird, bslongformer
  uint64_t seed = 1234;  // random blocks (variable, bigbird): zero3d's stream, not Python's `random`
};

const char* sparsity_mode_name(SparsityMode m);

// DeepSpeed's constructor and make_layout errors for `heads` heads and `seq_len` tokens, one
// message per problem (empty: the layout can be built). Key names are the section's.
std::vector<std::pair<std::string, std::string>> sparse_attention_problems(const SparseAttention& s, int64_t heads,
                                                                           int64_t seq_len);

// The [heads, nb, nb] 0/1 layout of block `layer` (nb = seq_len / block). Random blocks come
// from (seed, layer, head, row), so every rank builds the same layout without communication.
std::vector<uint8_t> sparse_block_layout(const SparseAttention& s, int64_t heads, int64_t seq_len, int64_t layer);

// Blocks a causal model computes (on or below the diagonal) over those of dense causal
// attention, nb(nb+1)/2 per head: the share of the attention term of the FLOPs formula.
double causal_block_share(const std::vector<uint8_t>& layout, int64_t heads, int64_t nb);

// Probabilities the block-sparse kernel keeps for one (sample, head): block² per computed block,
// the most over `layers` blocks and all heads (every (sample, head) gets that stride).
int64_t sparse_probs_per_head(const SparseAttention& s, int64_t heads, int64_t seq_len, int64_t layers);

// Block-sparse attention's model memory besides the activations, on a rank computing heads
// [head0, head0 + local_heads) of the blocks `layers`, micro-batch B, head size hs: each block's
// index table (kernels/attention_sparse_table.hpp, built with the model in either form) and, when
// the device form runs (device_form: a GPU build, or the CPU build's test hook), the one panel
// workspace all blocks share, sized for the largest group's backward (sparse_attention_panels).
// The memory planner counts both; they are what the model and the kernels allocate.
struct SparseAttentionBytes {
  int64_t tables = 0, panels = 0;
};
SparseAttentionBytes sparse_attention_model_bytes(const SparseAttention& s, int64_t heads, int64_t seq_len,
                                                  const std::vector<int64_t>& layers, int64_t head0,
                                                  int64_t local_heads, int64_t B, int64_t hs, bool device_form);
// Whether sparse attention runs its device form: always on a GPU (backend: the build asked about,
// a plan's); on a CPU when the tests turn it on (kernels/attention_sparse.hpp
// sparse_attention_device_form_on_host).
bool sparse_attention_device_form(kernels::Backend backend = kernels::kBuildBackend);

// The start-up line's text: mode, block, the keys that shape it, and the share of causal blocks
// computed over the model's `layers` blocks.
std::string sparse_attention_summary(const SparseAttention& s, int64_t heads, int64_t seq_len, int64_t layers);

}  // namespace zero3d
