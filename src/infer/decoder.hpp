// decoder.hpp — the model's forward pass for generation: a prefill over the prompts that fills a
// KV cache, then decode steps of one token per row that attend over it; logits of each row's last
// position only.
//
// The passes run the training forward's kernels on the same parameters (fetched unit by unit from
// the same ParamStore, so ZeRO-3 gathers them as evaluation does) and in the same dtypes (products
// in the model's compute dtype, everything else fp32); only attention differs: the new tokens'
// queries attend over the cache (kernels/attention_cached.hpp), and positions are each token's
// own. With tensor parallelism each rank runs its heads and its part of the MLP (Megatron's
// split, as training runs it), its cache holds its K/V heads, and the vocabulary-parallel logits
// are gathered over the tensor group, so every rank holds the whole last-position logits.
//
// On a pipeline stage a decoder runs one chunk of the stage's layers alone (start, input, run,
// output): the model's first part embeds the tokens, a later one starts from the hidden states the
// part before it computed (the caller moves them, generate.cpp), its KV cache holds the chunk's own
// layers, and the last part alone runs the head. With interleaved virtual stages a stage holds
// several chunks (part c·p + stage is its chunk c, model.hpp) and runs one decoder per chunk.
//
// Rows are left-padded to the longest prompt: row b's first real token is at slot start[b], its
// positions (learned embeddings, RoPE) count from there, and no query attends to a padding slot,
// so each row computes what it would compute alone.
#pragma once

#include <cstdint>
#include <vector>

#include "model/model.hpp"

namespace zero3d::infer {

// Per layer, this rank's keys and values: [B, Hkv_local, Tmax, d] each (Hugging Face's
// past_key_values layout), in model memory.
class KVCache {
 public:
  KVCache() = default;
  KVCache(int64_t layers, int64_t batch, int64_t heads, int64_t max_tokens, int64_t head_dim);
  float* keys(int64_t layer) const { return storage_.data() + (2 * layer) * per_tensor_; }
  float* values(int64_t layer) const { return storage_.data() + (2 * layer + 1) * per_tensor_; }
  int64_t batch() const { return batch_; }
  int64_t heads() const { return heads_; }
  int64_t max_tokens() const { return max_tokens_; }
  int64_t bytes() const { return static_cast<int64_t>(storage_.extent(0)) * 4; }

 private:
  FlatBuffer storage_;
  int64_t batch_ = 0, heads_ = 0, max_tokens_ = 0, per_tensor_ = 0;
};

// The longest sequence (prompt and generated tokens) the model can take: GPT-2's learned
// positions (n_positions); the Llama family's max_position_embeddings, or its trained length if
// longer.
int64_t max_sequence_length(const GPTShape& shape);

// A pass whose tokens another data-parallel replica computes: the units of the stage's chunk
// `chunk` fetched and released in a pass's order, nothing computed (ZeRO-3's gathers are
// collective over the data group: HF generate's synced_gpus).
void fetch_pass(const GPT& model, ParamStore& store, int chunk);

class Decoder {
 public:
  // model: one pipeline stage (the whole model, or a stage's chunks of it), any tensor-parallel
  // rank; the decoder runs its chunk `chunk`, whose parameters come from `store`. batch: the most rows a prefill
  // takes; max_tokens: the most slots a row fills (the longest prompt plus new tokens), at most
  // max_sequence_length. Collective over the tensor group (and over the data group where the
  // store gathers) in every pass.
  Decoder(const GPT& model, ParamStore& store, int64_t batch, int64_t max_tokens, int chunk = 0);

  // The whole model on one stage: starts the rows (1..batch of them, each prompt non-empty and
  // shorter than max_tokens) and runs the prefill. Returns the last position's logits, [rows][V] (host memory).
  const std::vector<float>& prefill(const std::vector<std::vector<int32_t>>& prompts);
  // Appends one token to every row (a finished row's too: it is computed and not read) and
  // returns the logits after it. At most max_tokens − slots() times after a prefill.
  const std::vector<float>& decode(const std::vector<int32_t>& tokens);

  // The same passes a stage at a time (prefill = start, then run of its tokens; decode = run of
  // one token per row). start: the rows as prefill takes them; returns the prefill's tokens per
  // row (the longest prompt), and its ids, left-padded, are prompt_tokens().
  int64_t start(const std::vector<std::vector<int32_t>>& prompts);
  const std::vector<int32_t>& prompt_tokens() const { return prompt_tokens_; }
  // Where a part after the first takes the next pass's hidden states, [rows·n, C] fp32 in model
  // memory (the previous part's output()).
  float* input(int64_t n);
  // The chunk's layers on n tokens a row (tokens: what the first part embeds; other parts ignore
  // them); the last part's logits are logits() afterwards.
  void run(const std::vector<int32_t>& tokens, int64_t n);
  // After run on a part before the last: the hidden states for the next part, [rows·n, C].
  const float* output() const { return x_; }
  const std::vector<float>& logits() const { return logits_; }
  bool first_part() const { return chunk().embedding; }
  bool last_part() const { return chunk().final; }

  int64_t vocab_size() const { return shape_.vocab_size; }
  int64_t rows() const { return rows_; }
  int64_t slots() const { return slots_; }  // slots filled in every row (the padded prompt length, then +1 a step)
  int64_t max_tokens() const { return max_tokens_; }
  const KVCache& cache() const { return cache_; }

 private:
  template <typename P>
  void forward(const std::vector<int32_t>& tokens, int64_t n);
  template <typename P>
  void embed(const std::vector<int32_t>& tokens, int64_t N);
  template <typename P>
  void block(int layer, int64_t N, int64_t n);  // layer: the stage's own block index
  template <typename P>
  void head(int64_t n);
  void reserve(int64_t tokens);
  const ModelChunk& chunk() const { return model_.part().chunks[static_cast<size_t>(chunk_)]; }

  const GPT& model_;
  ParamStore& store_;
  int chunk_;
  GPTShape shape_;
  int64_t batch_, max_tokens_;
  int64_t heads_, kv_heads_, head_dim_;  // this rank's query and K/V heads
  KVCache cache_;                        // the chunk's layers, local block order
  FlatBuffer rope_;                      // Llama family: cos then sin, [max_tokens, d/2] each
  int64_t rows_ = 0, slots_ = 0;
  std::vector<int32_t> start_;           // per row: its first real slot
  std::vector<int32_t> prompt_tokens_;   // the prefill's ids, [rows, n] left-padded
  Kokkos::View<int32_t*> start_dev_, ids_dev_, pos_dev_;
  FlatBuffer work_;                      // activations of one pass, sized for its tokens
  int64_t work_tokens_ = 0;
  float *x_ = nullptr, *ln_ = nullptr, *mean_ = nullptr, *rstd_ = nullptr, *qkv_ = nullptr, *atty_ = nullptr,
        *fch_ = nullptr, *act_ = nullptr, *row_out_ = nullptr;
  kernels::bf16* qkv_bf16_ = nullptr;    // the Llama family's q/k/v product as bf16 compute rounds it
  FlatBuffer scores_buf_;                // attention scores, B·H·n·(slots + n) floats
  FlatBuffer head_;                      // the last positions' ln_f and this rank's logits
  std::vector<float> gathered_, logits_; // all tensor ranks' logits, then [rows][V]
};

}  // namespace zero3d::infer
