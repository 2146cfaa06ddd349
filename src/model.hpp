// model.hpp — GPT-2 (pre-LayerNorm, tied LM head) as a visible list of forward and backward
// kernel calls over three flat buffers: parameters, gradients, activations.
//
// Parameter order is layer-major (wte, wpe, then every tensor of h.0, h.1, ..., then ln_f),
// so each block's parameters are one contiguous range (a unit): what ZeRO gathers.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "buffer.hpp"
#include "dtype.hpp"

namespace zero3d {

struct GPTShape {
  int64_t vocab_size = 256;   // V
  int64_t n_positions = 256;  // T
  int64_t n_layer = 2;        // L
  int64_t n_head = 2;         // H
  int64_t n_embd = 64;        // C
};

// The tensors of one transformer block, as pointers into a flat buffer of T (parameters in
// their stored type, or fp32 gradients).
template <typename T>
struct BlockTensors {
  T *ln_1_w, *ln_1_b, *c_attn_w, *c_attn_b, *attn_proj_w, *attn_proj_b;
  T *ln_2_w, *ln_2_b, *c_fc_w, *c_fc_b, *mlp_proj_w, *mlp_proj_b;
};

// Builds the Hugging Face GPT-2 parameter layout for `shape`.
ParamLayout gpt_layout(const GPTShape& shape);

// Model FLOPs per trained token: 6N + 12·L·T·C (forward + backward, attention included).
double gpt_flops_per_token(const GPTShape& shape, int64_t num_params);

// Fills params with the deterministic initialisation: normal(0, 0.02) weights drawn from
// (seed, tensor name), c_proj weights scaled by 1/sqrt(2L), zero biases, unit LN weights.
void init_gpt_params(float* params, const ParamLayout& layout, const GPTShape& shape, uint64_t seed);
// The same values for elements [begin, end) of the flat buffer only, written to out[0, end-begin):
// what a rank holding one partition needs, without materialising the rest.
void init_gpt_params_range(float* out, const ParamLayout& layout, const GPTShape& shape, uint64_t seed, int64_t begin,
                           int64_t end);

// A unit is the range of parameters one step of the layer loop needs: the embeddings
// (wte, wpe: unit 0), each transformer block (units 1..L) and the final LayerNorm (L+1).
// Units are contiguous and in layout order, so "unit u" is one range of every flat buffer.
struct ParamUnit {
  int64_t offset = 0, numel = 0;
};
std::vector<ParamUnit> gpt_units(const ParamLayout& layout, int64_t n_layer);

// Where the model finds parameters and puts gradients, one unit at a time. The model knows
// nothing of ZeRO or MPI: whoever implements this decides whether a unit is gathered,
// which buffer gradients land in, and when communication starts (DESIGN.md: LayerHooks).
class ParamStore {
 public:
  virtual ~ParamStore() = default;
  // Full parameters of unit u in the model's parameter dtype, valid until release(u).
  virtual const void* fetch(int u) = 0;
  virtual void release(int u) = 0;
  // Gradients of unit u accumulate here (+=, always fp32) during backward, until grads_done(u).
  virtual float* grad_target(int u) = 0;
  // Unit u's gradients are final for this backward pass (units finish in the order
  // L+1, L, ..., 1, 0: the buffer completes from its end down to 0).
  virtual void grads_done(int u) = 0;
  // Called between kernels: a chance to advance communication already in flight.
  virtual void progress() = 0;
};

// Whole parameters and gradients in two flat buffers, nothing to gather or communicate
// (single-process use: tests and tools; training goes through ZeroOptimizer).
class FlatParamStore : public ParamStore {
 public:
  FlatParamStore(std::vector<ParamUnit> units, float* params, float* grads)
      : units_(std::move(units)), params_(params), grads_(grads) {}
  const void* fetch(int u) override { return params_ + units_[u].offset; }
  void release(int) override {}
  float* grad_target(int u) override { return grads_ + units_[u].offset; }
  void grads_done(int) override {}
  void progress() override {}

 private:
  std::vector<ParamUnit> units_;
  float* params_;
  float* grads_;
};

// The GPT-2 layer loop over activation buffers it owns; parameters and gradients come from
// a ParamStore, unit by unit.
class GPT {
 public:
  // B, T: micro-batch shape the activation buffers are sized for (T <= n_positions).
  // param_type: how the store holds parameters (F32, BF16 or F16). Matrix products run in
  // bf16 for bf16 parameters and in fp32 otherwise; everything else computes in fp32.
  GPT(const GPTShape& shape, int64_t B, int64_t T, DType param_type = DType::F32);

  const GPTShape& shape() const { return shape_; }
  const ParamLayout& layout() const { return layout_; }
  const std::vector<ParamUnit>& units() const { return units_; }
  int64_t num_params() const { return layout_.total(); }
  DType param_type() const { return param_type_; }
  DType compute_type() const { return param_type_ == DType::BF16 ? DType::BF16 : DType::F32; }

  // tokens/targets: device arrays of B*T ids. Returns the mean cross-entropy.
  float forward(const int32_t* tokens, const int32_t* targets, ParamStore& store);
  // Accumulates d(grad_scale · mean loss)/dθ into the store's gradient targets; call after
  // forward() on the same batch.
  void backward(float grad_scale, ParamStore& store);

  // Logits [B,T,V] of the last forward (overwritten by backward()).
  const float* logits() const { return logits_; }
  int64_t batch() const { return B_; }
  int64_t seq_len() const { return T_; }
  int64_t activation_bytes() const { return static_cast<int64_t>((acts_.extent(0) + scratch_.extent(0)) * 4); }

 private:
  struct BlockActivations {
    float *ln_1, *ln_1_mean, *ln_1_rstd, *qkv, *att, *atty, *res_2;
    float *ln_2, *ln_2_mean, *ln_2_rstd, *fch, *fch_gelu, *res_3;
  };
  // Tensor pointers of a block whose unit starts at `unit` (parameters or gradients).
  template <typename T>
  BlockTensors<T> block(T* unit) const;
  template <typename P>
  float forward_impl(const int32_t* tokens, const int32_t* targets, ParamStore& store);
  template <typename P>
  void backward_impl(float grad_scale, ParamStore& store);

  GPTShape shape_;
  DType param_type_ = DType::F32;
  int64_t B_, T_;
  ParamLayout layout_;
  std::vector<ParamUnit> units_;
  FlatBuffer acts_, scratch_;
  std::vector<BlockActivations> blocks_;
  float *encoded_, *ln_f_, *ln_f_mean_, *ln_f_rstd_, *logits_, *losses_, *lse_;
  // backward scratch, reused by every block
  float *dres_, *dln_, *dqkv_, *datty_, *dfch_, *datt_scratch_;
  const int32_t* tokens_ = nullptr;
  const int32_t* targets_ = nullptr;
};

// Convenience for callers without ZeRO (tests, tools): a model with its own flat buffers.
struct FlatModel {
  GPT model;
  FlatBuffer params, grads;
  FlatParamStore store;
  FlatModel(const GPTShape& shape, int64_t B, int64_t T)
      : model(shape, B, T),
        params(make_flat_buffer("params", model.num_params())),
        grads(make_flat_buffer("grads", model.num_params())),
        store(model.units(), params.data(), grads.data()) {}
  float forward(const int32_t* tokens, const int32_t* targets) { return model.forward(tokens, targets, store); }
  void backward(float grad_scale) { model.backward(grad_scale, store); }
  void zero_grad() { Kokkos::deep_copy(grads, 0.0f); }
};

}  // namespace zero3d
