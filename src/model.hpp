// model.hpp — GPT-2 (pre-LayerNorm, tied LM head) as a visible list of forward and backward
// kernel calls over three flat buffers: parameters, gradients, activations.
//
// Parameter order is layer-major (wte, wpe, then every tensor of h.0, h.1, ..., then ln_f),
// so each block's parameters are one contiguous range: what ZeRO partitions and gathers.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "buffer.hpp"

namespace zero3d {

struct GPTShape {
  int64_t vocab_size = 256;   // V
  int64_t n_positions = 256;  // T
  int64_t n_layer = 2;        // L
  int64_t n_head = 2;         // H
  int64_t n_embd = 64;        // C
};

// The parameter tensors of one transformer block, as pointers into a flat buffer.
struct BlockTensors {
  float *ln_1_w, *ln_1_b, *c_attn_w, *c_attn_b, *attn_proj_w, *attn_proj_b;
  float *ln_2_w, *ln_2_b, *c_fc_w, *c_fc_b, *mlp_proj_w, *mlp_proj_b;
};

// Builds the Hugging Face GPT-2 parameter layout for `shape`.
ParamLayout gpt_layout(const GPTShape& shape);

// Model FLOPs per trained token: 6N + 12·L·T·C (forward + backward, attention included).
double gpt_flops_per_token(const GPTShape& shape, int64_t num_params);

// Fills params with the deterministic initialisation: normal(0, 0.02) weights drawn from
// (seed, tensor name), c_proj weights scaled by 1/sqrt(2L), zero biases, unit LN weights.
void init_gpt_params(float* params, const ParamLayout& layout, const GPTShape& shape, uint64_t seed);

// What backward() tells its caller while it runs, so gradient communication can overlap it.
// The model knows nothing of ZeRO or MPI; whoever passes hooks decides what to do.
class BackwardHooks {
 public:
  virtual ~BackwardHooks() = default;
  // Gradients in [offset, num_params) are final for this backward pass.
  virtual void grads_ready(int64_t offset) = 0;
  // Called between kernels: a chance to advance communication already in flight.
  virtual void progress() = 0;
};

class GPT {
 public:
  // B, T: micro-batch shape the activation buffers are sized for (T <= n_positions).
  GPT(const GPTShape& shape, int64_t B, int64_t T);

  const GPTShape& shape() const { return shape_; }
  const ParamLayout& layout() const { return layout_; }
  int64_t num_params() const { return layout_.total(); }
  FlatBuffer& params() { return params_; }
  FlatBuffer& grads() { return grads_; }

  // tokens/targets: device arrays of B*T ids. Returns the mean cross-entropy.
  float forward(const int32_t* tokens, const int32_t* targets);
  // Accumulates d(grad_scale · mean loss)/dθ into grads(); call after forward() on the same batch.
  // Blocks run last to first, so the ready region grows from the end of the buffer down to 0.
  void backward(float grad_scale, BackwardHooks* hooks = nullptr);
  void zero_grad();

  // Logits [B,T,V] of the last forward (overwritten by backward()).
  const float* logits() const { return logits_; }
  int64_t batch() const { return B_; }
  int64_t seq_len() const { return T_; }

 private:
  struct BlockActivations {
    float *ln_1, *ln_1_mean, *ln_1_rstd, *qkv, *att, *atty, *res_2;
    float *ln_2, *ln_2_mean, *ln_2_rstd, *fch, *fch_gelu, *res_3;
  };
  BlockTensors block(float* base, int64_t l) const;

  GPTShape shape_;
  int64_t B_, T_;
  ParamLayout layout_;
  FlatBuffer params_, grads_, acts_, scratch_;
  std::vector<BlockActivations> blocks_;
  float *encoded_, *ln_f_, *ln_f_mean_, *ln_f_rstd_, *logits_, *losses_, *lse_;
  // backward scratch, reused by every block
  float *dres_, *dln_, *dqkv_, *datty_, *dfch_, *datt_scratch_;
  const int32_t* tokens_ = nullptr;
  const int32_t* targets_ = nullptr;
  std::vector<int64_t> block_offsets_;  // offset of h.l.ln_1.weight for each block
};

}  // namespace zero3d
