// model.hpp — GPT-2 (pre-LayerNorm, tied LM head) and the Llama family (Llama, Mistral, Qwen2:
// RMSNorm, RoPE, grouped-query attention, SwiGLU; model/family.hpp) as a visible list of forward
// and backward kernel calls over three flat buffers: parameters, gradients, activations.
//
// Parameter order is layer-major (wte, wpe, then every tensor of h.0, h.1, ..., then ln_f; the
// Llama family: model.embed_tokens, model.layers.N.*, then model.norm and lm_head), so each
// block's parameters are one contiguous range (a unit): what ZeRO gathers.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "base/dtype.hpp"
#include "kernels/attention_sparse_table.hpp"
#include "kernels/device.hpp"  // Backend: the build a plan is for
#include "kernels/dropout.hpp"
#include "kernels/memory.hpp"
#include "kernels/moe.hpp"  // the gate's settings and routing (MPI-free kernels)
#include "model/activation_checkpointing.hpp"
#include "model/autocast.hpp"
#include "model/buffer.hpp"
#include "model/family.hpp"
#include "model/sparse_attention.hpp"
#include "parallel/tensor_parallel.hpp"

namespace zero3d {

// Which blocks route their MLP through experts (DEEPSPEED-FACTS-2 §4; GShard/Switch: every n-th
// block), and what that puts in the layout. num_experts 0: a dense GPT-2.
struct MoeShape {
  int64_t num_experts = 0;  // E
  int64_t every = 1;        // blocks every-1, 2·every-1, ... (0-based) are MoE blocks
  bool use_residual = false;  // PR-MoE: the dense MLP stays beside the experts, mixed by a learned coefficient
  // enable_expert_tensor_parallelism: with t > 1 tensor ranks each expert is split Megatron's way
  // (c_fc column-, c_proj row-parallel); otherwise every tensor rank holds whole experts.
  bool expert_tensor_parallel = false;
  bool enabled() const { return num_experts > 0; }
  bool is_moe_block(int64_t l) const { return enabled() && (l + 1) % every == 0; }
};

struct GPTShape {
  int64_t vocab_size = 256;   // V
  int64_t n_positions = 256;  // T
  int64_t n_layer = 2;        // L
  int64_t n_head = 2;         // H
  int64_t n_embd = 64;        // C
  MoeShape moe = {};  // (= {}: aggregate initialisers of the dense fields stay warning-free)
  SparseAttention sparse = {};  // block-sparse attention layouts (disabled: dense causal attention)
  // GPT-2, or a Llama-family decoder (n_embd = hidden_size, n_layer = num_hidden_layers,
  // n_head = num_attention_heads; n_positions is the sequence length trained on).
  DecoderFamily family = {};
  DropoutRates dropout = {};  // training's dropout probabilities (0: none)
  // The embedding and LM head hold the vocabulary padded to a multiple of this × t (Megatron's
  // make_vocab_size_divisible_by); the global layout, checkpoints and files keep V rows.
  int64_t make_vocab_size_divisible_by = 1;
  bool llama() const { return family.llama(); }
  // Whether the LM head reads the embedding's matrix: GPT-2 always, the Llama family with
  // tie_word_embeddings (else the final unit holds lm_head.weight).
  bool tied_head() const { return !family.llama() || family.tie_word_embeddings; }
};

// The widths of one block's activations on a rank holding `t` of its tensor-parallel parts:
// GPT-2: qkv 3C/t, attention output C/t, c_fc output and GELU 4C/t. The Llama family (t = 1):
// qkv (H + 2·Hkv)·d, attention output H·d, the fused [gate | up] output 2I, SwiGLU's I (Mixtral:
// 0 and 0, its MLP half being the experts').
struct BlockWidths {
  int64_t qkv = 0, attn = 0, fc = 0, act = 0;
};
BlockWidths block_widths(const GPTShape& shape, int64_t t);

// The layout's names of the tensors outside the blocks: the embedding matrix ("wte.weight", or
// "model.embed_tokens.weight") and the first tensor of block l and of the final unit.
std::string embedding_tensor_name(const GPTShape& shape);
std::string block_first_tensor_name(const GPTShape& shape, int64_t l);
std::string final_first_tensor_name(const GPTShape& shape);

// The tensors of one transformer block, as pointers into a flat buffer of T (parameters in
// their stored type, or fp32 gradients).
// An MoE block has no dense c_fc/c_proj unless use_residual (null), and adds the gate
// (mlp.gate.weight [C, E]) and, with use_residual, the coefficient (mlp.coefficient [C, 2] + [2]).
template <typename T>
struct BlockTensors {
  T *ln_1_w, *ln_1_b, *c_attn_w, *c_attn_b, *attn_proj_w, *attn_proj_b;
  T *ln_2_w, *ln_2_b, *c_fc_w, *c_fc_b, *mlp_proj_w, *mlp_proj_b;
  T *gate_w = nullptr, *coef_w = nullptr, *coef_b = nullptr;
};

// Builds the Hugging Face GPT-2 parameter layout for `shape`; with MoE, every expert's tensors
// follow ln_f, named h.{l}.mlp.experts.{e}.c_fc.weight etc. (whole tensors, any expert layout);
// Mixtral's follow lm_head as model.layers.{l}.block_sparse_moe.experts.{e}.w1/w3/w2.weight.
ParamLayout gpt_layout(const GPTShape& shape);
// The tensor names of one expert's MLP, in layout order.
extern const char* const kExpertTensorNames[4];

// The widths of an expert's saved rows on a rank holding `t` tensor parts: its first product's
// output (GPT-2: c_fc, F = 4C; Mixtral: the fused [w1 | w3], 2I) and its activation (GELU, F;
// SwiGLU, I), each divided by t under expert tensor parallelism.
struct ExpertWidths {
  int64_t fch = 0, act = 0;
};
ExpertWidths moe_expert_widths(const GPTShape& shape, int64_t t);

// Model FLOPs per trained token: 6N + 12·L·T·C (forward + backward, attention included); the
// Llama family: 6N without the embedding lookup's V·C when the head is untied, and 12·L·T·H·d. With
// MoE, N counts the parameters a token meets: the dense ones and k of each layer's E experts
// (gpt_active_params). With sparse attention the attention term is scaled by the layouts'
// share of the causal blocks (causal_block_share, averaged over the blocks).
double gpt_flops_per_token(const GPTShape& shape, int64_t num_params);
// One block's kept attention probabilities for B samples and H heads: B·H·T² (dense), or the
// block-sparse kernel's panels (sparse_probs_per_head) with sparse attention.
int64_t attention_probs_size(const GPTShape& shape, int64_t B, int64_t H, int64_t T);
int64_t gpt_active_params(const GPTShape& shape, int64_t k);
// Parameters outside the transformer blocks (wte, wpe, ln_f; the Llama family's embed_tokens,
// model.norm and lm_head): what a dropped block leaves of 6N.
int64_t gpt_params_outside_blocks(const GPTShape& shape);

// Fills params with the deterministic initialisation: normal(0, 0.02) weights drawn from
// (seed, tensor name), c_proj weights scaled by 1/sqrt(2L), zero biases, unit LN weights. The
// Llama family as Hugging Face's LlamaPreTrainedModel._init_weights: every Linear and Embedding
// weight normal(0, initializer_range), zero biases, unit RMSNorm weights.
void init_gpt_params(float* params, const ParamLayout& layout, const GPTShape& shape, uint64_t seed);
// The same values for elements [begin, end) of the flat buffer only, written to out[0, end-begin):
// what a rank holding one partition needs, without materialising the rest.
void init_gpt_params_range(float* out, const ParamLayout& layout, const GPTShape& shape, uint64_t seed, int64_t begin,
                           int64_t end);

// A unit is the range of parameters one step of the layer loop needs: the embeddings (wte,
// wpe), each transformer block, the final LayerNorm, and on a last pipeline stage that is not
// also the first the tied copy of wte its LM head uses. Units are contiguous and in layout
// order, so "unit u" is one range of every flat buffer.
// With MoE, each MoE block's local experts form one more unit (Experts), after every dense unit:
// their state lives with the expert-data-parallel ZeRO optimizer, not the data-parallel one.
enum class UnitKind { Embedding, Block, FinalNorm, TiedHead, Experts };
struct ParamUnit {
  int64_t offset = 0, numel = 0;
  UnitKind kind = UnitKind::Block;
  int block = -1;  // global block index for kind Block
};
// The units of the whole model: embeddings (0), blocks (1..L), ln_f (L+1).
std::vector<ParamUnit> gpt_units(const ParamLayout& layout, int64_t n_layer);

// One contiguous run of pipeline layers on this rank: its stage, or one chunk of an
// interleaved stage. Unit indices are local (into ModelPart::units).
struct ModelChunk {
  bool embedding = false, final = false;
  int first_block = 0, num_blocks = 0;
  int embed_unit = -1, first_block_unit = -1, final_unit = -1;
  int head_unit = -1;  // the wte the LM head reads: embed_unit on one stage, the tied copy otherwise
};

// A run of local layout elements and the global flat offsets they hold. `saved`: this rank
// writes the run to checkpoints (each global element is saved by exactly one rank: tensor-
// replicated ones by tensor rank 0, the tied wte copy by the first stage); loads read every run.
struct LayoutSegment {
  int64_t local_begin = 0, local_end = 0, global_begin = 0;
  bool saved = true;
};

// How a local tensor is cut from its global tensor over the tensor-parallel group (Megatron's
// set_tensor_model_parallel_attributes): split along `dim` into parts × stride chunks, this
// rank keeping chunks index, index + parts, ... (stride 3 cuts q, k and v of c_attn separately,
// so each rank holds whole heads). parts = 1: replicated on every tensor rank.
struct TensorSplit {
  int dim = 0, stride = 1, parts = 1, index = 0;
  bool replicated() const { return parts == 1; }
};

// What one (pipeline, tensor) rank holds of the model: a rank-local layout whose tensors keep
// their global names and local shapes (global shapes in `global_shapes`), its units and chunks,
// and the runs mapping its elements to the global layout (gpt_layout), which checkpoints and
// initialisation use. The tied wte copy of a last stage mirrors the first stage's wte (same
// init, summed gradients, same update): its runs are loaded, never saved.
struct ModelPart {
  ParamLayout layout;
  std::vector<std::vector<int64_t>> global_shapes;  // per local tensor
  std::vector<TensorSplit> splits;                  // per local tensor
  std::vector<ParamUnit> units;
  std::vector<ModelChunk> chunks;
  std::vector<LayoutSegment> runs;  // sorted by local_begin
  int tied_unit = -1;
  int tp_size = 1, tp_rank = 0;
  // MoE: the local experts of every MoE block this rank holds (E/ep of them, experts
  // ep_rank·E/ep ...) sit in [expert_begin, layout.total()), one unit each from first_expert_unit.
  int ep_size = 1, ep_rank = 0;
  int64_t expert_begin = 0;
  int first_expert_unit = -1;
  std::vector<int> expert_unit;  // per global block: its Experts unit, or -1 (dense block, or not here)
  // The two state groups as their ZeRO optimizers see them: the dense tensors [0, expert_begin)
  // with units [0, first_expert_unit), and the experts rebased to 0 with their units.
  ParamLayout dense_layout, expert_layout;
  std::vector<ParamUnit> dense_units, expert_units;
  int num_dense_units() const { return first_expert_unit < 0 ? static_cast<int>(units.size()) : first_expert_unit; }
  int64_t vocab_padded = 0;  // V rounded up to a multiple of make_vocab_size_divisible_by × tp_size
  int64_t vocab_local = 0;   // wte rows this rank holds: vocab_padded / tp_size
  int64_t vocab_begin = 0;   // first global id of them
  int64_t vocab_real = 0;    // of them, ids < V (the rest is padding, never looked up)
  // The runs inside [begin, end), cut to it; saving: only the runs this rank saves.
  std::vector<LayoutSegment> global_runs(int64_t begin, int64_t end, bool saving) const;
  // Local ranges of tensors replicated over the tensor group (counted once in the norm).
  std::vector<std::pair<int64_t, int64_t>> replicated_ranges() const;
};

// Whether sequence parallelism leaves a tensor's gradient partial on each tensor rank: the
// LayerNorms and RMSNorms, which see only the rank's token shard. Their gradients are summed over
// the tensor group once per step (Megatron _allreduce_non_tensor_model_parallel_grads).
bool sequence_parallel_partial(const std::string& name);

// The part of pipeline rank `stage` of `stages` and tensor rank `tp_rank` of `tp_size`:
// bounds are the p·v + 1 boundaries into the layer list [embedding, block × L, final]
// (pipe_plan.hpp); chunk c is part c·p + stage. The whole model: stages = 1, bounds {0, L + 2}.
ModelPart gpt_model_part(const GPTShape& shape, const std::vector<int>& bounds, int stages, int stage,
                         int tp_size = 1, int tp_rank = 0, int ep_size = 1, int ep_rank = 0);

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
  // Whether grad_target(u) hands zeros, filled afresh for this backward (a gradient window):
  // a weight whose gradient is one product may then be written rather than added to.
  virtual bool grads_start_at_zero(int) { return false; }
  // Unit u's gradients are final for this backward pass. Within one chunk's backward units
  // finish from the chunk's last down to its first; the embedding or tied-head unit (the
  // layout's unit 0 on the first and last stage) finishes last.
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


// How MoE blocks route tokens at run time (model.moe; DeepSpeed's TopKGate, FACTS-2 §4.2-4.4)
// and the expert-parallel group their tokens move in.
struct MoeRouting {
  int k = 1;
  double capacity_factor = 1.0, eval_capacity_factor = 1.0;
  int64_t min_capacity = 4;
  bool drop_tokens = true, use_rts = true, top2_2nd_expert_sampling = true;
  kernels::moe::NoisyGate noise = kernels::moe::NoisyGate::None;
  double aux_loss_coef = 0.01;
  // Mixtral (MixtralSparseMoeBlock): top-k of the softmax with renormalised weights, no
  // capacity, and transformers' load_balancing_loss_func over every layer (GPT::mixtral_router_loss);
  // in training its input (the router's and the experts') times U(1-j, 1+j) noise, j =
  // router_jitter_noise, drawn per global token and channel (GPT::moe_forward).
  bool mixtral = false;
  double router_jitter_noise = 0.0;
  // Whether a block keeps [S, C] noise factors of its input: DeepSpeed's Jitter, Mixtral's jitter.
  bool keeps_noise() const { return noise == kernels::moe::NoisyGate::Jitter || router_jitter_noise > 0.0; }
  uint64_t seed = 0;               // with ActivationBuffer::draw_key, every random draw of the gate
  Communicator* expert = nullptr;  // ep ranks: dispatch/combine all-to-all, the no-drop capacity's max
};
// Rows one rank's experts can receive per MoE block: each of E experts takes at most
// min(capacity, S) tokens from each of the tokens' ranks... of its group, i.e. E/ep experts ×
// ep sources × min(capacity, S) — the size of DeepSpeed's dispatched [E, C, h] tensor. Mixtral
// has no capacity tensor (MixtralSparseMoeBlock indexes the tokens that chose each expert): a
// token sends one row to each of its k distinct experts, so a rank receives at most
// min(k, E/ep) rows per token of each of its ep sources.
int64_t moe_rows_bound(const MoeShape& shape, const MoeRouting& routing, int64_t S, int ep);

// The saves of one MoE block's forward in one micro-batch: what its backward reads.
struct MoeActivations {
  float* gate_noise = nullptr;  // [S, C] noise factors of the gate's input (MoeRouting::keeps_noise; else null)
  float* expert_in = nullptr;   // [R, C] rows this rank's experts received, expert-major
  float *expert_fch = nullptr, *expert_fch_gelu = nullptr;  // [R, fch], [R, act] (moe_expert_widths)
  float* returned = nullptr;    // [S·k, C] expert outputs of this rank's routed tokens, in dispatch order
  float *moe_out = nullptr, *mlp_out = nullptr, *coef = nullptr;  // residual MoE: [S, C], [S, C], [S, 2]
  std::shared_ptr<kernels::moe::Routing> routing;
  std::vector<int64_t> send_rows;    // per expert rank: rows dispatched to it
  std::vector<int64_t> recv_counts;  // per (source rank, local expert): rows received
};

// The saved tensors of one block's forward pass. The Llama family keeps no LayerNorm means (null),
// RMSNorm outputs and rstd in ln_1/ln_2 and their _rstd, q and k after RoPE in qkv, the fused
// [gate | up] product in fch and silu(gate)·up in fch_gelu.
struct BlockActivations {
  float *ln_1, *ln_1_mean, *ln_1_rstd, *qkv, *att, *atty, *res_2;
  float *ln_2, *ln_2_mean, *ln_2_rstd, *fch, *fch_gelu, *res_3;
};
// The output gradients a block's weight-gradient pass reads (zero-bubble "W"), kept by the
// input-gradient pass ("B"): d(res_3), d(fch), d(ln_2), d(res_2), d(qkv), d(ln_1).
struct BlockGradOperands {
  float *d_res_3, *d_fch, *d_ln_2, *d_res_2, *d_qkv, *d_ln_1;
};

// One in-flight micro-batch on this rank (DESIGN-3D: activations live with the executor, not
// the model): token ids, the chunk's input stream, every block's saves, the head's saves and
// the two boundary gradients. Sized for the rank's largest chunk; any chunk may use it.
// Under full recompute `blocks` is empty: the buffer keeps each checkpoint's input (in
// `checkpoints`, one slot per checkpoint) and the chunk's output; under selective recompute every
// block's `att` points into the model's shared workspace.
struct ActivationBuffer {
  FlatBuffer storage;
  // Saved checkpoint inputs: one allocation per slot, or one for all (contiguous), on the
  // device or in host memory (cpu_checkpointing: page-locked on a GPU build, so the copies run
  // at the link's rate); `checkpoints[g]` is checkpoint g's slot.
  std::vector<FlatBuffer> checkpoint_storage;
  std::vector<Kokkos::View<float*, kernels::PinnedHostSpace>> checkpoint_host;
  std::vector<float*> checkpoints;
  float* output = nullptr;  // [B,T,C] the chunk's output under full recompute (else the last block's res_3)
  Kokkos::View<int32_t*> token_ids, target_ids;  // device copies the executor loads
  const int32_t* tokens = nullptr;
  const int32_t* targets = nullptr;
  float* input = nullptr;     // [B,T,C] the chunk's input stream (received, or the embedding's output)
  float* d_output = nullptr;  // [B,T,C] gradient of the chunk's output (received)
  float* d_input = nullptr;   // [B,T,C] the residual stream's gradient; at the end of backward d(input)
  std::vector<BlockActivations> blocks;
  std::vector<BlockGradOperands> grad_operands;  // empty unless built for split backward
  std::vector<MoeActivations> moe;  // one per MoE block of the largest chunk, in block order
  // MoE: the key of this micro-batch's random draws (its first global sample: the same on any
  // layout), whether the forward trains (noise, capacity_factor) or evaluates, and the sum of
  // its MoE blocks' l_aux (what aux_loss_coef weighs into the loss; Mixtral: the one
  // load-balancing loss over all its layers).
  uint64_t draw_key = 0;
  bool training = true;
  // The micro-batch's first global sample: the key of its dropout masks and of Mixtral's router
  // jitter with the sample index (kernels/dropout.hpp), the same on every layout; both run only
  // when `training`.
  int64_t first_sample = 0;
  double aux_loss = 0.0;
  // Mixtral's load-balancing loss over every layer of the micro-batch, whichever stages hold
  // them (GPT::mixtral_router_loss): per expert the choices and then the summed probabilities of
  // the layers run so far (a later stage receives them with the activations), and each expert's
  // share of all choices, f, every layer's gate backward reads (sent back with the gradients).
  std::vector<double> router_sums;
  std::vector<float> router_fraction;
  // Progressive layer drop (pld.hpp): per global block, 0 = dropped in this training micro-batch,
  // else the factor its residual branches are scaled by. Empty: every block runs unscaled.
  std::vector<float> block_scale;
  float *ln_f = nullptr, *ln_f_mean = nullptr, *ln_f_rstd = nullptr, *logits = nullptr, *losses = nullptr,
        *lse = nullptr, *d_ln_f = nullptr;
  // Everything the buffer holds, host-resident checkpoints included.
  int64_t bytes() const {
    int64_t n = static_cast<int64_t>(storage.extent(0) * 4 + token_ids.extent(0) * 8);
    for (const FlatBuffer& v : checkpoint_storage) n += static_cast<int64_t>(v.extent(0) * 4);
    return n + host_bytes();
  }
  // Of them, in the host memory space (cpu_checkpointing).
  int64_t host_bytes() const {
    int64_t n = 0;
    for (const auto& v : checkpoint_host) n += static_cast<int64_t>(v.extent(0) * 4);
    return n;
  }
};

// Which part of a backward pass to run (Qi et al. 2023: B = input gradients, W = weight gradients).
enum class BackwardPart { Full, Input, Weight };

// The GPT-2 layer loop over this rank's chunks; parameters and gradients come from a
// ParamStore unit by unit, activations from the caller's ActivationBuffer.
class GPT {
 public:
  // B, T: micro-batch shape buffers are sized for (T <= n_positions). param_type: how the
  // store holds parameters (F32, BF16 or F16). Matrix products run in bf16 for bf16
  // parameters and in fp32 otherwise; everything else computes in fp32.
  // tensor: the tensor-parallel group when part.tp_size > 1.
  // checkpointing: which blocks keep their activations and which recompute them in backward.
  // moe: how MoE blocks route (shape.moe says which blocks are MoE blocks).
  // autocast: torch_autocast's dtype (BF16 or F16) for fp32 parameters: the matrix products run
  // in it, as in the bf16 path for BF16 (the same saves in bf16); F32: off.
  GPT(const GPTShape& shape, int64_t B, int64_t T, DType param_type, ModelPart part, TensorGroup tensor = {},
      ActivationCheckpointing checkpointing = {}, MoeRouting moe = {}, DType autocast = DType::F32);
  // The whole model on one rank.
  GPT(const GPTShape& shape, int64_t B, int64_t T, DType param_type = DType::F32);

  const GPTShape& shape() const { return shape_; }
  const ModelPart& part() const { return part_; }
  const ParamLayout& layout() const { return part_.layout; }
  const std::vector<ParamUnit>& units() const { return part_.units; }
  int num_chunks() const { return static_cast<int>(part_.chunks.size()); }
  const ModelChunk& chunk(int c) const { return part_.chunks[c]; }
  int64_t num_params() const { return part_.layout.total(); }
  DType param_type() const { return param_type_; }
  // The products' dtype: bf16 for bf16 parameters, torch_autocast's dtype, else fp32 (fp16
  // parameters are widened for sgemm).
  DType compute_type() const { return param_type_ == DType::BF16 ? DType::BF16 : autocast_; }
  int64_t batch() const { return B_; }
  int64_t stream_elements() const { return Ns_ * shape_.n_embd; }  // what one pipeline message carries
  // Mixtral: E, the experts whose router sums (2E doubles) cross a stage boundary with the
  // activations and whose fractions (E floats) with the gradients (ActivationBuffer); else 0.
  int64_t router_experts() const { return shape_.family.mixtral() ? shape_.moe.num_experts : 0; }
  int64_t seq_len() const { return T_; }
  // What generation (src/infer) needs to run its own passes over the same parameters: the
  // tensor group, this rank's block widths, and a block's tensors inside its fetched unit.
  const TensorGroup& tensor_group() const { return tp_; }
  const BlockWidths& widths() const { return widths_; }
  template <typename T>
  BlockTensors<T> block_tensors(T* unit, int global_block) const {
    return block(unit, global_block);
  }

  // split_backward: also keep the weight-gradient operands (BackwardPart::Input/Weight).
  ActivationBuffer make_buffer(bool split_backward) const;
  // The chunk's output stream (what goes to the next stage).
  float* output(int chunk, const ActivationBuffer& buf) const;
  // Units one pass fetches, in order (ZeRO stage 3 prefetches along this trace).
  std::vector<int> fetch_order(int chunk, bool forward, BackwardPart part = BackwardPart::Full) const;

  // Forward of one chunk over buf; returns the micro-batch's mean cross-entropy when the
  // chunk ends with the head, else 0.
  float forward(int chunk, ActivationBuffer& buf, ParamStore& store);
  // Backward of one chunk: d(grad_scale · mean loss) when the chunk ends with the head, else
  // from buf.d_output; leaves d(input) in buf.d_input and accumulates weight gradients
  // into the store (Full, Weight).
  void backward(int chunk, ActivationBuffer& buf, float grad_scale, ParamStore& store,
                BackwardPart part = BackwardPart::Full);

  // One-stage convenience (tests, tools): device arrays of B*T ids, an internal buffer.
  float forward(const int32_t* tokens, const int32_t* targets, ParamStore& store);
  void backward(float grad_scale, ParamStore& store);
  const float* logits() const { return own_.logits; }  // of the last one-stage forward
  // The one-stage buffer's progressive-layer-drop scales (ActivationBuffer::block_scale).
  void set_block_scales(std::vector<float> scale) { own_.block_scale = std::move(scale); }
  // The one-stage buffer's first global sample (ActivationBuffer::first_sample) and whether its
  // passes train (dropout) or evaluate.
  void set_samples(int64_t first_sample, bool training) {
    own_.first_sample = first_sample;
    own_.training = training;
  }
  // The workspaces every buffer shares: backward scratch and the recompute workspace.
  int64_t scratch_bytes() const { return static_cast<int64_t>((scratch_.extent(0) + recompute_.extent(0)) * 4); }
  const ActivationCheckpointing& checkpointing() const { return ac_; }

  // MoE routing figures per MoE block this rank runs, summed over the training forwards since the
  // last take (then reset): tokens routed to each expert before capacity drops (DeepSpeed's
  // exp_counts), choices routed and dropped, and the summed l_aux over `forwards`.
  struct MoeLayerStats {
    int block = 0;
    std::vector<int64_t> tokens_per_expert;
    int64_t routed = 0, dropped = 0, forwards = 0;
    double l_aux = 0.0;
  };
  std::vector<MoeLayerStats> take_moe_stats();
  const MoeRouting& moe_routing() const { return moe_; }

  // profile: time per checkpoint (full: per group of `interval` blocks; selective: per block's
  // attention), summed over the micro-batches since the last reset. Synchronised when timing.
  struct CheckpointTime {
    int first_block = 0, num_blocks = 0;  // global block indices first_block .. first_block + num_blocks - 1
    double forward_ms = 0.0, recompute_ms = 0.0;
  };
  const std::vector<CheckpointTime>& checkpoint_times() const { return times_; }
  void reset_checkpoint_times();

 private:
  template <typename T>
  BlockTensors<T> block(T* unit, int global_block) const;
  // MoE blocks (moe_layer.cpp): route, dispatch, experts, combine; res_3 = res_2 + the mix.
  template <typename P>
  void moe_forward(int block, BlockActivations& a, MoeActivations& m, const BlockTensors<const P>& w,
                   ActivationBuffer& buf, ParamStore& store);
  // Residual MoE's mix, backward: d(moe_out) and d(mlp_out) from d(res_3); the coefficient's logits
  // gradient is kept for moe_backward.
  void moe_mix_backward(const MoeActivations& m, const float* d_res_3, float* d_mlp_out);
  // The experts', the gate's and the coefficient's input gradients into d_ln_2 (added to the dense
  // branch's with use_residual, else written: d_res_3 may share d_ln_2's buffer, read first) and
  // their weight gradients into dw and the block's Experts unit.
  template <typename P>
  void moe_backward(int block, const BlockActivations& a, const MoeActivations& m, const BlockTensors<const P>& w,
                    const BlockTensors<float>& dw, const float* d_res_3, float* d_ln_2, float grad_scale,
                    ParamStore& store);
  MoeActivations* moe_saves(const ModelChunk& c, int l, ActivationBuffer& buf) const;
  // Mixtral's load-balancing loss (transformers load_balancing_loss_func) once the chunk's layers
  // have routed: their sums into buf.router_sums and, on the last chunk, the loss into
  // buf.aux_loss and f into buf.router_fraction; mixtral_router_fractions gives each of the
  // chunk's layers f for its backward.
  void mixtral_router_loss(const ModelChunk& c, ActivationBuffer& buf) const;
  void mixtral_router_fractions(const ModelChunk& c, ActivationBuffer& buf) const;
  // Tensor parallelism's backward regions around a block's products (Megatron's mappings,
  // tp_regions.hpp), shared by both families' blocks. row_output_grad: a row-parallel product's
  // output gradient over all tokens — this rank's tokens' gradient all-gathered with sequence
  // parallelism (into `full`), else the same array, all-reduced.
  const float* row_output_grad(const float* d_shard, float* full);
  // A residual branch's output gradient under resid_pdrop: d(res) ∘ the site's mask, in dln_
  // (d_res itself without dropout).
  const float* dropped_gradient(const float* d_res, int64_t layer, kernels::DropoutSite site);
  // The input of a column-parallel product (forward): this rank's tokens, or all of them gathered
  // into gathered_ with sequence parallelism (a bf16 norm output gathered in bf16).
  const float* column_parallel_input(const float* x);
  const kernels::bf16* column_parallel_input(const kernels::bf16* x);
  // A column-parallel product's backward: product(dinp, dweight, dbias, inp) runs the layer's two
  // products (a null output skips one); dinp (all tokens, partial over the group) is then summed,
  // all-reduced or reduce-scattered into dinp_shard with sequence parallelism; the weight product
  // reads the input over all tokens (x's shard re-gathered). With tp_overlap_comm the all-reduce
  // runs under the weight product (Megatron's async dgrad). In: x's type, float or bf16 (a norm's
  // output kept in bf16: bf16_activations.hpp), which a shard is re-gathered in.
  template <typename In, typename Product>
  void column_parallel_backward(float* dinp_shard, float* dweight, float* dbias, const In* x, int64_t IC,
                                ParamStore& store, const Product& product);
  // The Llama family's block (llama_block.cpp): the same contract as block_forward and as the
  // block backward of backward_impl (dres: d(res_3) on entry, d(residual) on exit; a split
  // backward's operands in buf.grad_operands[l]).
  // Mixtral's MLP half is its sparse MoE block (moe_forward/moe_backward with buf's saves).
  template <typename P>
  void llama_block_forward(const ModelChunk& c, int l, BlockActivations& a, const float* residual, ParamStore& store,
                           double* attention_ms, ActivationBuffer* buf);
  template <typename P>
  void llama_block_backward(const ModelChunk& c, int l, const BlockActivations& a, const float* residual,
                            ActivationBuffer& buf, float* dres, ParamStore& store, BackwardPart part, float grad_scale);
  template <typename P>
  float forward_impl(const ModelChunk& c, ActivationBuffer& buf, ParamStore& store);
  template <typename P>
  void backward_impl(const ModelChunk& c, ActivationBuffer& buf, float grad_scale, ParamStore& store, BackwardPart part);
  // One block's forward (local block l of chunk c) from `residual` into the saves `a`: the
  // forward pass and full recompute run this same code, so recomputed saves are bit-identical.
  template <typename P>
  // buf: the micro-batch's buffer (MoE blocks keep their saves there; null under full recompute,
  // which model.moe excludes).
  // scale: progressive layer drop's 1/p on both residual branches (block_scale).
  void block_forward(const ModelChunk& c, int l, BlockActivations& a, const float* residual, ParamStore& store,
                     double* attention_ms, ActivationBuffer* buf = nullptr, float scale = 1.0f);
  // Progressive layer drop (model_pld.cpp): block l's scale in this pass (1 outside training),
  // a dropped block's forward (its output is its input) and backward (no gradient, but its
  // units still complete so that every rank's reductions line up).
  float block_scale(const ActivationBuffer& buf, const ModelChunk& c, int l) const;
  void dropped_block_forward(BlockActivations& a, const float* residual) const;
  void dropped_block_backward(const ModelChunk& c, int l, ParamStore& store, BackwardPart part) const;
  // Scaled branches' backward: before a half, keep d(out) and scale it by s (what the branch
  // reads); after, add (1−s)·d(out) back so the residual path carries d(out) unscaled.
  void scaled_branch_backward_begin(float* dres, float s);
  void scaled_branch_backward_end(float* dres, float s) const;
  void save_checkpoint(ActivationBuffer& buf, int g, const float* input) const;
  const float* restore_checkpoint(ActivationBuffer& buf, int g);
  void checkpoint_boundary() const;
  CheckpointTime& time_of(int first_block, int num_blocks);
  // Where the LM head's matrix starts in its unit: 0 (wte, embed_tokens), or after model.norm.weight.
  int64_t head_offset() const { return shape_.tied_head() ? 0 : shape_.n_embd; }
  float* chunk_output(const ModelChunk& c, const ActivationBuffer& buf) const;
  // Dropout (kernels/dropout.hpp): begin_pass takes the buffer's sample and mode for the pass
  // that follows (forward, or backward with its recompute); dropout_mask is then the mask of
  // probability p at one site of global block `layer` (off with p 0 or outside training).
  void begin_pass(const ActivationBuffer& buf);
  kernels::DropoutMask dropout_mask(double p, int64_t layer, kernels::DropoutSite site) const;
  // The first global token row of this rank's Ns: its shard's with sequence parallelism.
  int64_t first_row() const { return tp_.sequence_parallel ? tp_.rank * Ns_ : 0; }

  GPTShape shape_;
  DType param_type_ = DType::F32;
  DType autocast_ = DType::F32;
  int64_t B_, T_;
  ModelPart part_;
  TensorGroup tp_;
  // This rank's widths: attention features C/t (heads H/t), MLP 4C/t, vocabulary rows Vp/t.
  int64_t Cl_, Hl_, Vl_;
  int64_t Ns_;  // tokens per micro-batch outside tensor-parallel regions: B·T, or B·T/t with sequence parallelism
  int max_blocks_ = 0;
  bool any_final_ = false;
  FlatBuffer scratch_;
  // backward scratch, reused by every block (Full and Input passes); with tensor parallelism
  // also the row-parallel partial product and the vocab-parallel cross-entropy's row sums
  float *dln_, *dqkv_, *datty_, *dfch_, *datt_scratch_;
  // The Llama family: d(SwiGLU output) [B·T, I], and RoPE's cos and sin tables [T, d/2] each
  float *dact_ = nullptr, *rope_cos_ = nullptr, *rope_sin_ = nullptr;
  BlockWidths widths_;
  float *row_out_ = nullptr, *ce_max_ = nullptr, *ce_sum_ = nullptr, *ce_target_ = nullptr;
  float *gathered_ = nullptr, *shard_ = nullptr;  // sequence parallelism: all tokens [B·T, C], one shard [Ns, C]
  ActivationCheckpointing ac_;
  // Recompute workspace, shared by every buffer: full: a checkpoint's restored input, a staging
  // slot for host-resident partitions, and the saves of `interval` blocks; selective: one
  // block's attention probabilities.
  FlatBuffer recompute_;
  FlatBuffer pld_grad_;  // a scaled branch's unscaled output gradient (allocated at the first scaled backward)
  float *ckpt_input_ = nullptr, *ckpt_staging_ = nullptr, *shared_att_ = nullptr;
  std::vector<BlockActivations> recompute_blocks_;
  int64_t ckpt_slot_ = 0;  // elements of one saved input: Ns·C, or Ns·C/t partitioned
  std::vector<CheckpointTime> times_;
  // MoE: routing settings, the workspace every MoE block shares (dispatch and return rows, the
  // experts' backward, gate gradients), and the figures take_moe_stats() hands out.
  MoeRouting moe_;
  // Sparse attention: this rank's heads' [Hl, nb, nb] layout of each global block it holds.
  std::vector<kernels::SparseBlockTable> sparse_layouts_;  // this rank's heads' layout of each block
  int64_t sparse_att_stride_ = 0;  // kept probabilities per (sample, head): sparse_probs_per_head
  int64_t moe_rows_ = 0;  // R: rows this rank's experts can receive per block
  FlatBuffer moe_ws_;
  ExpertWidths expert_widths_;  // this rank's expert row widths
  // d(expert rows' first product) [R, fch]; Mixtral also d(SwiGLU output) [R, act]
  float *moe_send_ = nullptr, *moe_recv_ = nullptr, *moe_rows_c_ = nullptr, *moe_rows_4c_ = nullptr,
        *moe_rows_act_ = nullptr;
  float *moe_logits_ = nullptr, *moe_dlogits_ = nullptr, *moe_dweight_ = nullptr, *moe_tokens_c_ = nullptr;
  float *moe_dmoe_ = nullptr, *moe_dcoef_ = nullptr;
  std::vector<MoeLayerStats> moe_stats_;
  ActivationBuffer own_;  // the one-stage convenience API's buffer (allocated on first use)
  bool pass_trains_ = false;       // begin_pass: the pass drops (training, some p > 0)
  int64_t pass_first_sample_ = 0;  // begin_pass: the micro-batch's first global sample
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

// One block's saves in floats, as GPT carves them (carve_block) and the plan counts them. bf16
// compute keeps the inputs and outputs of its products in bf16 where the forward makes them that
// way (bf16_activations.hpp: ln_1, qkv, the attention output, ln_2, fc and its GELU), so
// those take half the floats; `att` is what the chosen attention kernel keeps: fp32 B·H·T²
// probabilities, the tiled bf16 kernel's bf16 tiles, or the fused kernel's log-sum-exp and bf16
// output, never probabilities (kernels::attention_bf16_saved_floats).
// The Llama family keeps two rstd and no means, act (SwiGLU's output) half of fch ([gate | up]);
// its bf16 halves are GPT-2's (ln_2, fch and act but for Mixtral). backend: the build planned for.
struct BlockSaveSizes {
  int64_t ln_1 = 0, stats = 0, mean = 0, qkv = 0, att = 0, atty = 0, res = 0, ln_2 = 0, fch = 0, act = 0;
  // ln_1, two rstd and two means, qkv, att, atty, res_2 and res_3, ln_2, fch and fch_gelu
  int64_t total() const { return ln_1 + 2 * stats + 2 * mean + qkv + att + atty + 2 * res + ln_2 + fch + act; }
};
// compute: the products' dtype (GPT::compute_type()). backend: the build whose kernels keep them
// (the model's own; a plan may ask for the other: kernels/device.hpp Backend).
BlockSaveSizes gpt_block_save_sizes(const GPTShape& shape, const ModelPart& part, int64_t B, int64_t T,
                                    bool sequence_parallel, DType compute,
                                    kernels::Backend backend = kernels::kBuildBackend);

// The units one pass over `chunk` fetches, in order (GPT::fetch_order; the memory planner
// simulates stage 3's gathers along them).
std::vector<int> gpt_fetch_order(const GPTShape& shape, const ModelPart& part, const ActivationCheckpointing& ac,
                                 int chunk, bool forward, BackwardPart pass = BackwardPart::Full);

// The element counts GPT carves its activations from: GPT::make_buffer and the constructor
// allocate exactly these (and check it), and the memory planner sums them, so the plan cannot
// drift from the allocation. Per buffer unless marked shared.
struct ActivationPlan {
  int64_t stream = 0;         // the chunk's input, output (full recompute), d_input and d_output
  int64_t per_block = 0;      // one block's saves as a buffer keeps them (selective: no att)
  int64_t blocks = 0;         // blocks whose saves a buffer keeps (0 under full recompute)
  int64_t head = 0;           // ln_f, logits, losses (+ d_ln_f for a split backward)
  int64_t grad_operands = 0;  // zero-bubble W-pass operands
  int64_t checkpoint_slot = 0, checkpoint_slots = 0;  // saved inputs: elements per slot, slots per buffer
  int64_t checkpoint_allocations = 0;                 // 1 when contiguous, else one per slot
  bool checkpoints_on_host = false;
  int64_t tokens = 0;         // token and target ids: B·T each
  int64_t moe_blocks = 0, per_moe_block = 0;  // MoE saves: blocks of the largest chunk, elements each
  int64_t scratch = 0;        // shared: backward scratch (the MoE workspace included)
  int64_t recompute = 0;      // shared: recompute workspace
  int64_t storage() const { return stream + blocks * per_block + moe_blocks * per_moe_block + head + grad_operands; }
  int64_t checkpoint_bytes() const { return 4 * checkpoint_slot * checkpoint_slots; }
  int64_t buffer_bytes() const { return 4 * storage() + checkpoint_bytes() + 8 * tokens; }
  int64_t shared_bytes() const { return 4 * (scratch + recompute); }
};
// moe: the routing MoE blocks use (their saves depend on k, capacity and noise). compute: the
// products' dtype (bf16 keeps some saves in bf16, BlockSaveSizes). backend: as BlockSaveSizes'.
ActivationPlan gpt_activation_plan(const GPTShape& shape, const ModelPart& part, int64_t B, int64_t T,
                                   bool sequence_parallel, bool split_backward, const ActivationCheckpointing& ac = {},
                                   const MoeRouting& moe = {}, DType compute = DType::F32,
                                   kernels::Backend backend = kernels::kBuildBackend);

// The attention kernels' scratch a training step of this rank grows beyond its activation
// buffers (kernels/attention.hpp, attention_gqa.hpp: one for all its blocks, at its heads); none
// where attention is block-sparse (its panels are sparse_attention_model_bytes'), or on a rank
// with no block.
int64_t attention_scratch_bytes(const GPTShape& shape, const ModelPart& part, int64_t B, int64_t T, DType compute,
                                kernels::Backend backend = kernels::kBuildBackend);

// What GPT(shape, B, T, …, part, TensorGroup{…, sequence_parallel}, ac) allocates for
// activations, from gpt_activation_plan without allocating: `buffer` = one
// make_buffer(split_backward).bytes(), of which `host` in host memory; `scratch` = scratch_bytes().
struct GPTActivationBytes {
  int64_t buffer = 0, scratch = 0, host = 0;
};
GPTActivationBytes gpt_activation_bytes(const GPTShape& shape, const ModelPart& part, int64_t B, int64_t T,
                                        bool sequence_parallel, bool split_backward,
                                        const ActivationCheckpointing& ac = {}, const MoeRouting& moe = {},
                                        DType compute = DType::F32, kernels::Backend backend = kernels::kBuildBackend);

}  // namespace zero3d
