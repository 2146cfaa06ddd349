// decoder.cpp — generation's forward passes (decoder.hpp): the training forward's layer loop
// (model.cpp forward_impl, block_forward; llama_block.cpp) on the new tokens of every row, with
// attention over the KV cache and the head on each row's last position.
#include "infer/decoder.hpp"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>

#include "kernels/attention_cached.hpp"
#include "kernels/elementwise.hpp"
#include "kernels/encoder.hpp"
#include "kernels/gelu.hpp"
#include "kernels/layernorm.hpp"
#include "kernels/matmul.hpp"
#include "kernels/memory.hpp"
#include "kernels/rmsnorm.hpp"
#include "kernels/rope_config.hpp"
#include "kernels/swiglu.hpp"
#include "kernels/vocab_parallel.hpp"
#include "model/bf16_activations.hpp"
#include "model/llama_tensors.hpp"
#include "parallel/tensor_parallel.hpp"

namespace zero3d::infer {

using namespace kernels;

KVCache::KVCache(int64_t layers, int64_t batch, int64_t heads, int64_t max_tokens, int64_t head_dim)
    : storage_(make_flat_buffer("kv_cache", 2 * layers * batch * heads * max_tokens * head_dim)),
      batch_(batch),
      heads_(heads),
      max_tokens_(max_tokens),
      per_tensor_(batch * heads * max_tokens * head_dim) {}

int64_t max_sequence_length(const GPTShape& shape) {
  if (!shape.llama()) return shape.n_positions;
  return std::max(shape.n_positions, shape.family.rope.max_position_embeddings);
}

Decoder::Decoder(const GPT& model, ParamStore& store, int64_t batch, int64_t max_tokens, int chunk)
    : model_(model), store_(store), chunk_(chunk), shape_(model.shape()), batch_(batch), max_tokens_(max_tokens) {
  const ModelPart& part = model.part();
  if (chunk < 0 || chunk >= model.num_chunks())
    throw std::invalid_argument("generation: chunk " + std::to_string(chunk) + " of a stage with " +
                                std::to_string(model.num_chunks()));
  if (shape_.moe.enabled() || shape_.sparse.enabled)
    throw std::invalid_argument("generation runs dense models with dense attention");
  if (batch < 1 || max_tokens < 1 || max_tokens > max_sequence_length(shape_))
    throw std::invalid_argument("generation: batch " + std::to_string(batch) + ", max_tokens " +
                                std::to_string(max_tokens) + " outside the model's " +
                                std::to_string(max_sequence_length(shape_)) + " positions");
  const int64_t t = part.tp_size;
  heads_ = shape_.n_head / t;
  kv_heads_ = shape_.llama() ? shape_.family.num_key_value_heads / t : heads_;
  head_dim_ = shape_.llama() ? shape_.family.head_dim : shape_.n_embd / shape_.n_head;
  cache_ = KVCache(this->chunk().num_blocks, batch, kv_heads_, max_tokens, head_dim_);
  if (shape_.llama()) {
    // RoPE's cos and sin for positions 0 .. max_tokens − 1: rope_tables' values, the frequencies
    // those of the length the model runs at (only dynamic RoPE reads it: modeling_rope_utils.py).
    const int64_t half = head_dim_ / 2;
    const std::vector<double> inv_freq = rope_inv_freq(shape_.family.rope, head_dim_, model.seq_len());
    const double scale = rope_attention_factor(shape_.family.rope);
    std::vector<float> table(static_cast<size_t>(2 * max_tokens * half));
    for (int64_t p = 0; p < max_tokens; ++p)
      for (int64_t i = 0; i < half; ++i) {
        const double angle = static_cast<double>(p) * inv_freq[static_cast<size_t>(i)];
        table[static_cast<size_t>(p * half + i)] = static_cast<float>(std::cos(angle) * scale);
        table[static_cast<size_t>((max_tokens + p) * half + i)] = static_cast<float>(std::sin(angle) * scale);
      }
    rope_ = make_scratch_buffer("rope_tables", static_cast<int64_t>(table.size()));
    copy_to_device(rope_.data(), table.data(), table.size() * sizeof(float));
  }
  start_dev_ = Kokkos::View<int32_t*>("generation_starts", batch);
  const int64_t C = shape_.n_embd, Vl = part.vocab_local;
  // ln_f [B, C], its mean and rstd [B] each, this rank's logits [B, Vl], every rank's [t, B, Vl]
  head_ = make_scratch_buffer("generation_head", batch * (C + 2 + Vl + t * Vl));
  gathered_.resize(static_cast<size_t>(t * batch * Vl));
}

void Decoder::reserve(int64_t tokens) {
  if (tokens <= work_tokens_) return;
  const BlockWidths& w = model_.widths();
  const int64_t C = shape_.n_embd;
  // x, ln, row_out [C]; mean, rstd; qkv, attention output, fc output and activation: this rank's
  // widths; then the Llama family's bf16 q/k/v product output (bf16 compute), half a float each
  const int64_t qkv_bf16 = (w.qkv + 1) / 2;
  const int64_t per_token = 3 * C + 2 + w.qkv + w.attn + w.fc + w.act + qkv_bf16;
  work_ = make_scratch_buffer("generation_activations", tokens * per_token);
  float* p = work_.data();
  const auto take = [&](int64_t n) {
    float* out = p;
    p += tokens * n;
    return out;
  };
  x_ = take(C), ln_ = take(C), row_out_ = take(C), mean_ = take(1), rstd_ = take(1);
  qkv_ = take(w.qkv), atty_ = take(w.attn), fch_ = take(w.fc), act_ = take(w.act);
  qkv_bf16_ = as_bf16(take(qkv_bf16));
  ids_dev_ = Kokkos::View<int32_t*>("generation_ids", tokens);
  pos_dev_ = Kokkos::View<int32_t*>("generation_positions", tokens);
  work_tokens_ = tokens;
}

int64_t Decoder::start(const std::vector<std::vector<int32_t>>& prompts) {
  const int64_t rows = static_cast<int64_t>(prompts.size());
  if (rows < 1 || rows > batch_) throw std::invalid_argument("prefill: " + std::to_string(rows) + " prompts");
  size_t longest = 0;
  for (const auto& p : prompts) {
    if (p.empty()) throw std::invalid_argument("prefill: an empty prompt");
    longest = std::max(longest, p.size());
  }
  const int64_t n = static_cast<int64_t>(longest);
  if (n >= max_tokens_ + 1) throw std::invalid_argument("prefill: a prompt longer than the cache");
  rows_ = rows;
  slots_ = 0;
  start_.assign(static_cast<size_t>(rows), 0);
  // Left padding: row b's prompt ends at slot n − 1. Padding slots take id 0, which no query reads.
  prompt_tokens_.assign(static_cast<size_t>(rows * n), 0);
  for (int64_t b = 0; b < rows; ++b) {
    const auto& p = prompts[static_cast<size_t>(b)];
    start_[static_cast<size_t>(b)] = static_cast<int32_t>(n - static_cast<int64_t>(p.size()));
    std::copy(p.begin(), p.end(), prompt_tokens_.begin() + b * n + start_[static_cast<size_t>(b)]);
  }
  copy_to_device(start_dev_.data(), start_.data(), start_.size() * sizeof(int32_t));
  return n;
}

float* Decoder::input(int64_t n) {
  reserve(rows_ * n);
  return x_;
}

void Decoder::run(const std::vector<int32_t>& tokens, int64_t n) {
  if (rows_ == 0) throw std::invalid_argument("decode: no rows started");
  if (first_part() && static_cast<int64_t>(tokens.size()) != rows_ * n)
    throw std::invalid_argument("decode: " + std::to_string(tokens.size()) + " tokens for " + std::to_string(rows_) +
                                " rows of " + std::to_string(n));
  if (slots_ + n > max_tokens_) throw std::invalid_argument("decode: the cache is full");
  switch (model_.param_type()) {
    case DType::BF16: forward<bf16>(tokens, n); break;
    case DType::F16: forward<fp16>(tokens, n); break;
    default: forward<float>(tokens, n); break;
  }
  slots_ += n;
}

const std::vector<float>& Decoder::prefill(const std::vector<std::vector<int32_t>>& prompts) {
  const int64_t n = start(prompts);
  run(prompt_tokens_, n);
  return logits_;
}

const std::vector<float>& Decoder::decode(const std::vector<int32_t>& tokens) {
  run(tokens, 1);
  return logits_;
}

void fetch_pass(const GPT& model, ParamStore& store, int chunk) {
  for (const int u : model.fetch_order(chunk, /*forward=*/true)) {
    store.fetch(u);
    store.release(u);
  }
  store.progress();
}

// n new tokens of every row at slots slots_ .. slots_ + n − 1, in the layer order of forward_impl
// (embedding, blocks, final norm, head: those of them in this chunk), each unit fetched and
// released as it fetches them.
template <typename P>
void Decoder::forward(const std::vector<int32_t>& tokens, int64_t n) {
  const ModelChunk& c = chunk();
  const int64_t B = rows_, N = B * n;
  reserve(N);
  std::vector<int32_t> pos(static_cast<size_t>(N));
  for (int64_t b = 0; b < B; ++b)
    for (int64_t i = 0; i < n; ++i)  // a padding slot's position is never read by a real token
      pos[static_cast<size_t>(b * n + i)] = static_cast<int32_t>(std::max<int64_t>(0, slots_ + i - start_[static_cast<size_t>(b)]));
  copy_to_device(pos_dev_.data(), pos.data(), static_cast<size_t>(N) * sizeof(int32_t));
  if (c.embedding) embed<P>(tokens, N);  // a later part's x_ holds the previous part's output
  for (int l = 0; l < c.num_blocks; ++l) block<P>(l, N, n);
  if (c.final) head<P>(n);
}

// Embedding: token rows (vocabulary-parallel: each rank its own ids, summed over the group),
// plus GPT-2's learned position of each token.
template <typename P>
void Decoder::embed(const std::vector<int32_t>& tokens, int64_t N) {
  const ModelPart& part = model_.part();
  const ModelChunk& c = chunk();
  const TensorGroup& tp = model_.tensor_group();
  const bool tensor_parallel = part.tp_size > 1;
  const int64_t C = shape_.n_embd, Vl = part.vocab_local;
  copy_to_device(ids_dev_.data(), tokens.data(), static_cast<size_t>(N) * sizeof(int32_t));
  const P* E = static_cast<const P*>(store_.fetch(c.embed_unit));  // wte [V(/t), C], then wpe [T, C] (GPT-2)
  if (!tensor_parallel) {
    token_embedding_forward(x_, ids_dev_.data(), E, N, C);
  } else {
    vocab_embedding_forward(x_, ids_dev_.data(), E, part.vocab_begin, Vl, N, C);
    tp.all_reduce_sum(x_, N * C);
  }
  if (!shape_.llama()) add_position_embedding_at(x_, E + Vl * C, pos_dev_.data(), N, C);
  store_.release(c.embed_unit);
}

// The head on each row's last token: final norm, then logits = ln_f · Eᵀ over this rank's rows.
template <typename P>
void Decoder::head(int64_t n) {
  const ModelPart& part = model_.part();
  const ModelChunk& c = chunk();
  const TensorGroup& tp = model_.tensor_group();
  const bool tensor_parallel = part.tp_size > 1;
  const int64_t B = rows_, C = shape_.n_embd, Vl = part.vocab_local;
  const DType cmp = model_.compute_type();
  float* lnf = head_.data();
  float* mean = lnf + B * C;
  float* rstd = mean + B;
  float* logits = rstd + B;
  float* all = logits + B * Vl;
  const float* last = x_;
  if (n > 1) {
    last_positions(row_out_, x_, B, n, C);
    last = row_out_;
  }
  const P* F = static_cast<const P*>(store_.fetch(c.final_unit));  // weight [C] then bias [C] (model.norm: weight)
  if (shape_.llama()) rmsnorm_forward(lnf, rstd, last, F, B, C, static_cast<float>(shape_.family.rms_norm_eps));
  else layernorm_forward(lnf, mean, rstd, last, F, F + C, B, C);
  store_.release(c.final_unit);
  // an untied head's lm_head.weight [V, C] follows model.norm.weight in the final unit
  const P* W = static_cast<const P*>(store_.fetch(c.head_unit)) + (shape_.tied_head() ? 0 : C);
  gemm(B, Vl, C, {lnf, DType::F32, false, C}, {W, dtype_of<P>(), true, C}, logits, Vl, false, cmp);
  store_.release(c.head_unit);
  store_.progress();

  // [rows][V] on the host: this rank's rows, or every tensor rank's gathered in rank order (the
  // vocabulary padding past V dropped).
  const int64_t t = part.tp_size, V = shape_.vocab_size;
  if (tensor_parallel) tp.all_gather_tokens(logits, all, B * Vl);
  copy_to_host(gathered_.data(), tensor_parallel ? all : logits, static_cast<size_t>(t * B * Vl) * sizeof(float));
  logits_.resize(static_cast<size_t>(B * V));
  for (int64_t r = 0; r < t; ++r)
    for (int64_t b = 0; b < B; ++b)
      for (int64_t v = 0; v < Vl && r * Vl + v < V; ++v)
        logits_[static_cast<size_t>(b * V + r * Vl + v)] = gathered_[static_cast<size_t>((r * B + b) * Vl + v)];
}

// Block l of the chunk on N = B·n tokens: x += attention(norm(x)); x += mlp(norm(x)), the
// products, norms and activations the forward's (block_forward, llama_block_forward), the
// row-parallel products' partial sums all-reduced over the tensor group before their bias.
template <typename P>
void Decoder::block(int l, int64_t N, int64_t n) {
  const ModelPart& part = model_.part();
  const ModelChunk& c = chunk();
  const TensorGroup& tp = model_.tensor_group();
  const bool tensor_parallel = part.tp_size > 1;
  const BlockWidths& w = model_.widths();
  const int64_t B = rows_, C = shape_.n_embd, H = heads_, Hkv = kv_heads_, d = head_dim_;
  const int global = c.first_block + l, u = c.first_block_unit + l;
  const DType cmp = model_.compute_type();
  const P* unit = static_cast<const P*>(store_.fetch(u));
  // res += inp · W (+ bias): one product, or a row-parallel one's partial sums summed first.
  // linear: nn.Linear's weight [OC, IC] (the Llama family), else Conv1D's [IC, OC].
  const auto residual_product = [&](const float* inp, const P* weight, const P* bias, int64_t IC, bool linear) {
    if (!tensor_parallel) {
      if (linear) linear_forward(x_, inp, weight, bias, N, IC, C, /*accumulate=*/true, cmp);
      else matmul_forward(x_, inp, weight, bias, N, IC, C, /*accumulate=*/true, cmp);
      return;
    }
    if (linear) linear_forward(row_out_, inp, weight, static_cast<const P*>(nullptr), N, IC, C, false, cmp);
    else matmul_forward(row_out_, inp, weight, static_cast<const P*>(nullptr), N, IC, C, false, cmp);
    tp.all_reduce_sum(row_out_, N * C);
    if (bias) add_residual_and_bias(x_, x_, row_out_, bias, N, C);
    else add(x_, x_, row_out_, N * C);
  };
  // The new tokens' k and v into the cache, then their queries over it.
  const auto attend = [&](int64_t window, bool round_bf16) {
    const int64_t S = slots_ + n;
    // sized once for the prefill or for the longest decode step, whichever is larger
    if (static_cast<int64_t>(scores_buf_.extent(0)) < B * H * n * S)
      scores_buf_ = make_scratch_buffer("generation_scores", B * H * std::max(n * S, max_tokens_));
    kv_cache_write(cache_.keys(l), cache_.values(l), qkv_, B, n, slots_, H, Hkv, d, max_tokens_, round_bf16);
    cached_attention(atty_, scores_buf_.data(), qkv_, cache_.keys(l), cache_.values(l), start_dev_.data(), B,
                     n, slots_, H, Hkv, d, max_tokens_, window, round_bf16);
  };

  if (shape_.llama()) {
    const DecoderFamily& f = shape_.family;
    const float eps = static_cast<float>(f.rms_norm_eps);
    const LlamaTensors<const P> p = llama_tensors(unit, shape_, w);
    const int64_t I = w.act;
    // as llama_block_forward on one tensor rank: bf16 compute keeps the products' inputs in bf16
    // (no MoE block reaches the decoder; tensor-parallel decoding keeps fp32 on either build)
    const bool lp = !tensor_parallel && activations_bf16(cmp, false, false, true);
    if (lp) {  // q/k/v_proj rounds its own output, its bias in the product's epilogue, as the block's
      rmsnorm_forward(as_bf16(ln_), rstd_, x_, p.input_norm, N, C, eps);
      linear_forward(qkv_bf16_, as_bf16(ln_), p.qkv_w, p.qkv_b, N, C, w.qkv);
      convert(qkv_, qkv_bf16_, N * w.qkv);
    } else {
      rmsnorm_forward(ln_, rstd_, x_, p.input_norm, N, C, eps);
      linear_forward(qkv_, ln_, p.qkv_w, p.qkv_b, N, C, w.qkv, false, cmp);
    }
    // bf16 attention as llama_block_forward's: rope on the bf16 q and k, attention on bf16 q, k, v
    rope_at_positions(qkv_, rope_.data(), rope_.data() + max_tokens_ * (d / 2), pos_dev_.data(), N, H, Hkv, d, lp);
    attend(f.window_of(global), lp);
    residual_product(atty_, p.o_w, p.o_b, w.attn, true);
    if (lp) {  // gate_up_proj writes bf16, SwiGLU reads and writes bf16
      rmsnorm_forward(as_bf16(ln_), rstd_, x_, p.post_norm, N, C, eps);
      linear_forward(as_bf16(fch_), as_bf16(ln_), p.gate_up_w, p.gate_up_b, N, C, w.fc);  // rows [gate | up]
      swiglu_forward(as_bf16(act_), as_bf16(fch_), as_bf16(fch_) + I, N, I, w.fc);
      linear_forward(x_, as_bf16(act_), p.down_w, p.down_b, N, I, C, /*accumulate=*/true, cmp);
    } else {
      rmsnorm_forward(ln_, rstd_, x_, p.post_norm, N, C, eps);
      linear_forward(fch_, ln_, p.gate_up_w, p.gate_up_b, N, C, w.fc, false, cmp);  // rows [gate | up]
      swiglu_forward(act_, fch_, fch_ + I, N, I, w.fc);
      residual_product(act_, p.down_w, p.down_b, I, true);
    }
  } else {
    const BlockTensors<const P> p = model_.block_tensors(unit, global);
    const int64_t Cl = w.attn;
    layernorm_forward(ln_, mean_, rstd_, x_, p.ln_1_w, p.ln_1_b, N, C);
    matmul_forward(qkv_, ln_, p.c_attn_w, p.c_attn_b, N, C, 3 * Cl, false, cmp);
    attend(0, cmp == DType::BF16);  // bf16 attention reads q, k and v in bf16 (attention_bf16.hpp)
    residual_product(atty_, p.attn_proj_w, p.attn_proj_b, Cl, false);
    if (cmp == DType::BF16 && !tensor_parallel) {
      // As block_forward's bf16 MLP: c_fc rounds its own output, GELU reads and writes bf16.
      layernorm_forward(as_bf16(ln_), mean_, rstd_, x_, p.ln_2_w, p.ln_2_b, N, C);
      matmul_forward(as_bf16(fch_), as_bf16(ln_), p.c_fc_w, p.c_fc_b, N, C, 4 * Cl);
      gelu_forward(as_bf16(act_), as_bf16(fch_), N * 4 * Cl);
      matmul_forward(x_, as_bf16(act_), p.mlp_proj_w, p.mlp_proj_b, N, 4 * C, C, /*accumulate=*/true, cmp);
    } else {
      layernorm_forward(ln_, mean_, rstd_, x_, p.ln_2_w, p.ln_2_b, N, C);
      matmul_forward(fch_, ln_, p.c_fc_w, p.c_fc_b, N, C, 4 * Cl, false, cmp);
      gelu_forward(act_, fch_, N * 4 * Cl);
      residual_product(act_, p.mlp_proj_w, p.mlp_proj_b, 4 * Cl, false);
    }
  }
  store_.release(u);
  store_.progress();
}

}  // namespace zero3d::infer
