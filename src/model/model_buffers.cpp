// model_buffers.cpp — what a GPT allocates: its construction (the backward scratch, the
// recompute workspace, sparse attention's layouts), the activation buffers of the pipeline's
// in-flight micro-batches carved to gpt_activation_plan's sizes, and the order it fetches units.
#include <algorithm>
#include <stdexcept>

#include "kernels/attention.hpp"
#include "kernels/memory.hpp"
#include "kernels/rope_config.hpp"
#include "model/bf16_activations.hpp"
#include "model/model.hpp"
#include "model/sparse_attention.hpp"

namespace zero3d {

using namespace kernels;

namespace {

// A bump allocator over one flat allocation.
struct Carver {
  float* p;
  float* operator()(int64_t n) {
    float* out = p;
    p += n;
    return out;
  }
};

// One block's saves carved in a fixed order at gpt_block_save_sizes' sizes (what
// gpt_activation_plan counts as a block); a non-null shared_att points the attention's saves at
// the model's shared workspace.
template <typename Take>
BlockActivations carve_block(Take& take, const BlockSaveSizes& z, float* shared_att) {
  BlockActivations a;
  a.ln_1 = take(z.ln_1);
  a.ln_1_mean = z.mean > 0 ? take(z.mean) : nullptr;
  a.ln_1_rstd = take(z.stats);
  a.qkv = take(z.qkv);
  a.att = shared_att ? shared_att : take(z.att);
  a.atty = take(z.atty);
  a.res_2 = take(z.res);
  a.ln_2 = take(z.ln_2);
  a.ln_2_mean = z.mean > 0 ? take(z.mean) : nullptr;
  a.ln_2_rstd = take(z.stats);
  a.fch = take(z.fch);
  a.fch_gelu = take(z.act);
  a.res_3 = take(z.res);
  return a;
}

}  // namespace

GPT::GPT(const GPTShape& shape, int64_t B, int64_t T, DType param_type)
    : GPT(shape, B, T, param_type, gpt_model_part(shape, {0, static_cast<int>(shape.n_layer) + 2}, 1, 0)) {}

GPT::GPT(const GPTShape& shape, int64_t B, int64_t T, DType param_type, ModelPart part, TensorGroup tensor,
         ActivationCheckpointing checkpointing, MoeRouting moe, DType autocast)
    : shape_(shape), param_type_(param_type), autocast_(param_type == DType::F32 ? autocast : DType::F32), B_(B), T_(T),
      part_(std::move(part)), tp_(tensor), ac_(checkpointing), moe_(moe) {
  const int64_t C = shape.n_embd, BT = B * T, t = part_.tp_size;
  Cl_ = C / t;
  Hl_ = shape.n_head / t;
  widths_ = block_widths(shape, t);
  if (shape.sparse.enabled) {  // this rank's heads of each of its blocks' layouts
    sparse_layouts_.resize(static_cast<size_t>(shape.n_layer));
    sparse_att_stride_ = sparse_probs_per_head(shape.sparse, shape.n_head, T, shape.n_layer);
    const int64_t nb = T / shape.sparse.block, per_head = nb * nb;
    for (const ModelChunk& c : part_.chunks)
      for (int l = c.first_block; l < c.first_block + c.num_blocks; ++l) {
        const std::vector<uint8_t> all = sparse_block_layout(shape.sparse, shape.n_head, T, l);
        const auto first = all.begin() + part_.tp_rank * Hl_ * per_head;
        sparse_layouts_[l] = kernels::SparseBlockTable(std::vector<uint8_t>(first, first + Hl_ * per_head), Hl_, nb,
                                                       shape.sparse.block);
      }
  }
  Vl_ = part_.vocab_local;
  for (const ModelChunk& c : part_.chunks) {
    max_blocks_ = std::max(max_blocks_, c.num_blocks);
    any_final_ = any_final_ || c.final;
  }
  // Tokens this rank carries outside the tensor-parallel regions (a shard with sequence
  // parallelism, which only exists with more than one tensor rank).
  tp_.sequence_parallel = tp_.sequence_parallel && t > 1;
  Ns_ = tp_.sequence_parallel ? BT / t : BT;
  // Backward scratch and the recompute workspace, shared by all blocks and micro-batches.
  const ActivationPlan plan =
      gpt_activation_plan(shape, part_, B, T, tp_.sequence_parallel, false, ac_, moe_, compute_type());
  const BlockSaveSizes sizes = gpt_block_save_sizes(shape, part_, B, T, tp_.sequence_parallel, compute_type());
  for (const ModelChunk& c : part_.chunks)  // config validation says so first, with the numbers
    if (ac_.full() && (c.num_blocks + ac_.interval - 1) / ac_.interval > plan.checkpoint_slots)
      throw std::invalid_argument("number_checkpoints is less than the checkpoints of one forward");
  scratch_ = make_scratch_buffer("backward_scratch", plan.scratch);
  recompute_ = make_scratch_buffer("recompute_workspace", plan.recompute);
  ckpt_slot_ = plan.checkpoint_slot;
  Carver ws{recompute_.data()};
  if (ac_.full() && max_blocks_ > 0) {
    ckpt_input_ = ws(Ns_ * C);
    if (ac_.cpu_checkpointing && ac_.partition_activations && t > 1) ckpt_staging_ = ws(ckpt_slot_);
    for (int i = 0; i < std::min(ac_.interval, max_blocks_); ++i)
      recompute_blocks_.push_back(carve_block(ws, sizes, nullptr));
  } else if (ac_.selective() && max_blocks_ > 0) {
    shared_att_ = ws(sizes.att);
  }
  if (ws.p != recompute_.data() + plan.recompute) throw std::logic_error("recompute workspace differs from its plan");
  float* p = scratch_.data();
  auto take = [&p](int64_t n) {
    float* out = p;
    p += n;
    return out;
  };
  dln_ = take(BT * C);
  datty_ = take(BT * widths_.attn);
  dqkv_ = take(BT * widths_.qkv);
  dfch_ = take(BT * widths_.fc);
  datt_scratch_ = take(kRowBlock * T);
  if (shape.llama()) {
    dact_ = take(BT * widths_.act);
    // RoPE's tables for positions 0..T-1, once (rope_config.hpp: each rope type's frequencies, in double)
    const int64_t half = shape.family.head_dim / 2;
    std::vector<float> cos, sin;
    kernels::rope_tables(cos, sin, shape.family.rope, shape.family.head_dim, T);
    rope_cos_ = take(T * half);
    rope_sin_ = take(T * half);
    copy_to_device(rope_cos_, cos.data(), cos.size() * sizeof(float));
    copy_to_device(rope_sin_, sin.data(), sin.size() * sizeof(float));
  }
  if (shape.moe.enabled()) {  // the MoE workspace (gpt_activation_plan counts it)
    const int64_t S = BT, k = moe_.k, E = shape.moe.num_experts;
    moe_rows_ = moe_rows_bound(shape.moe, moe_, S, part_.ep_size);
    moe_send_ = take(S * k * C);
    moe_recv_ = take(moe_rows_ * C);
    moe_rows_c_ = take(moe_rows_ * C);
    expert_widths_ = moe_expert_widths(shape, t);
    moe_rows_4c_ = take(expert_widths_.fch * moe_rows_);
    if (shape.family.mixtral()) moe_rows_act_ = take(expert_widths_.act * moe_rows_);
    moe_logits_ = take(S * E);
    moe_dlogits_ = take(S * E);
    moe_dweight_ = take(S * k);
    moe_tokens_c_ = take(S * C);
    if (shape.moe.use_residual) {
      moe_dmoe_ = take(S * C);
      moe_dcoef_ = take(2 * S);
    }
    for (int b = 0; b < shape.n_layer; ++b)
      if (b < static_cast<int>(part_.expert_unit.size()) && part_.expert_unit[static_cast<size_t>(b)] >= 0)
        moe_stats_.push_back({b, std::vector<int64_t>(static_cast<size_t>(E), 0), 0, 0, 0, 0.0});
  }
  if (t > 1) {
    row_out_ = take(BT * C);
    ce_max_ = take(BT);
    ce_sum_ = take(BT);
    ce_target_ = take(BT);
    if (tp_.sequence_parallel) {
      gathered_ = take(BT * C);
      shard_ = take(Ns_ * C);
    }
  }
}

ActivationBuffer GPT::make_buffer(bool split_backward) const {
  if (split_backward && ac_.full())
    throw std::invalid_argument("full recompute cannot keep a block's activations for a later weight-gradient pass");
  const int64_t C = shape_.n_embd, B = B_, T = T_, BT = B * T, Ns = Ns_;
  const ActivationPlan plan =
      gpt_activation_plan(shape_, part_, B, T, tp_.sequence_parallel, split_backward, ac_, moe_, compute_type());
  const BlockSaveSizes sizes = gpt_block_save_sizes(shape_, part_, B, T, tp_.sequence_parallel, compute_type());
  const bool receives_grad = [&] {
    for (const ModelChunk& c : part_.chunks)
      if (!c.final) return true;
    return false;
  }();
  ActivationBuffer buf;
  buf.storage = make_scratch_buffer("activations", plan.storage());
  buf.token_ids = Kokkos::View<int32_t*>("tokens", BT);
  buf.target_ids = Kokkos::View<int32_t*>("targets", BT);
  buf.tokens = buf.token_ids.data();
  buf.targets = buf.target_ids.data();
  Carver take{buf.storage.data()};
  buf.input = take(Ns * C);
  // ln_1, res_2, ln_2, res_3 over this rank's tokens (Ns: all, or a shard with sequence
  // parallelism); this rank's qkv, attention output, fc and its GELU over all tokens
  for (int l = 0; l < plan.blocks; ++l)
    buf.blocks.push_back(carve_block(take, sizes, ac_.selective() ? shared_att_ : nullptr));
  for (int64_t j = 0; j < plan.moe_blocks; ++j) {
    const int64_t S = BT, R = moe_rows_;
    MoeActivations m;
    if (moe_.keeps_noise()) m.gate_noise = take(S * C);
    m.expert_in = take(R * C);
    m.expert_fch = take(expert_widths_.fch * R);
    m.expert_fch_gelu = take(expert_widths_.act * R);
    m.returned = take(S * moe_.k * C);
    if (shape_.moe.use_residual) {
      m.moe_out = take(S * C);
      m.mlp_out = take(S * C);
      m.coef = take(2 * S);
    }
    buf.moe.push_back(std::move(m));
  }
  if (ac_.full() && max_blocks_ > 0) buf.output = take(Ns * C);
  if (any_final_) {
    buf.ln_f = take(BT * C);  // all tokens: the head's input (gathered with sequence parallelism)
    buf.ln_f_mean = take(Ns);
    buf.ln_f_rstd = take(Ns);
    // bf16 logits (logits_bf16) in half the floats
    buf.logits = take(logits_bf16(compute_type()) ? (BT * Vl_ + 1) / 2 : BT * Vl_);
    buf.losses = take(BT);
    buf.lse = take(BT);
  }
  buf.d_input = take(Ns * C);
  if (receives_grad) buf.d_output = take(Ns * C);
  if (split_backward) {
    for (int l = 0; l < max_blocks_; ++l) {
      BlockGradOperands g;
      g.d_res_3 = take(BT * C);  // all tokens: a row-parallel product's output gradient
      g.d_fch = take(BT * widths_.fc);
      g.d_ln_2 = take(Ns * C);
      g.d_res_2 = take(BT * C);
      g.d_qkv = take(BT * widths_.qkv);
      g.d_ln_1 = take(Ns * C);
      buf.grad_operands.push_back(g);
    }
    if (any_final_) buf.d_ln_f = take(Ns * C);
  }
  if (take.p != buf.storage.data() + plan.storage()) throw std::logic_error("activation buffer differs from its plan");
  // Saved checkpoint inputs: one allocation per slot, or one contiguous buffer of all slots
  // (contiguous_memory_optimization), in host memory with cpu_checkpointing.
  const int64_t per_allocation = plan.checkpoint_allocations > 0 ? plan.checkpoint_slots / plan.checkpoint_allocations : 0;
  for (int64_t k = 0; k < plan.checkpoint_allocations; ++k) {
    const int64_t n = per_allocation * plan.checkpoint_slot;
    float* base = nullptr;
    if (plan.checkpoints_on_host) {
      buf.checkpoint_host.emplace_back(Kokkos::view_alloc(Kokkos::WithoutInitializing, "checkpoints_host"), n);
      base = buf.checkpoint_host.back().data();
    } else {
      buf.checkpoint_storage.push_back(make_scratch_buffer("checkpoints", n));
      base = buf.checkpoint_storage.back().data();
    }
    for (int64_t j = 0; j < per_allocation; ++j) buf.checkpoints.push_back(base + j * plan.checkpoint_slot);
  }
  return buf;
}

float* GPT::chunk_output(const ModelChunk& c, const ActivationBuffer& buf) const {
  if (c.num_blocks == 0) return buf.input;
  return ac_.full() ? buf.output : buf.blocks[c.num_blocks - 1].res_3;
}

float* GPT::output(int chunk, const ActivationBuffer& buf) const { return chunk_output(part_.chunks[chunk], buf); }

std::vector<int> GPT::fetch_order(int chunk, bool forward, BackwardPart part) const {
  return gpt_fetch_order(shape_, part_, ac_, chunk, forward, part);
}

std::vector<int> gpt_fetch_order(const GPTShape& shape, const ModelPart& mp, const ActivationCheckpointing& ac,
                                 int chunk, bool forward, BackwardPart part) {
  const ModelChunk& c = mp.chunks[chunk];
  std::vector<int> order;
  // an MoE block fetches its experts' unit after its own (moe_forward, moe_backward)
  const auto block_units = [&](int l) {
    order.push_back(c.first_block_unit + l);
    if (shape.moe.is_moe_block(c.first_block + l)) order.push_back(mp.expert_unit[static_cast<size_t>(c.first_block + l)]);
  };
  if (forward) {
    if (c.embedding) order.push_back(c.embed_unit);
    for (int l = 0; l < c.num_blocks; ++l) block_units(l);
    if (c.final) order.push_back(c.final_unit), order.push_back(c.head_unit);
    return order;
  }
  if (part == BackwardPart::Weight) return order;  // weight gradients need activations only
  if (c.final) order.push_back(c.head_unit), order.push_back(c.final_unit);
  if (!ac.full()) {
    for (int l = c.num_blocks - 1; l >= 0; --l) block_units(l);
    return order;
  }
  // full recompute: each checkpoint, last first, runs its blocks forward again, then backward
  const int N = ac.interval;
  for (int g0 = (c.num_blocks - 1) / N * N; g0 >= 0; g0 -= N) {
    const int n = std::min(N, c.num_blocks - g0);
    for (int i = 0; i < n; ++i) order.push_back(c.first_block_unit + g0 + i);
    for (int i = n - 1; i >= 0; --i) order.push_back(c.first_block_unit + g0 + i);
  }
  return order;
}

MoeActivations* GPT::moe_saves(const ModelChunk& c, int l, ActivationBuffer& buf) const {
  int j = 0;
  for (int i = 0; i < l; ++i) j += shape_.moe.is_moe_block(c.first_block + i) ? 1 : 0;
  return &buf.moe[static_cast<size_t>(j)];
}

std::vector<GPT::MoeLayerStats> GPT::take_moe_stats() {
  std::vector<MoeLayerStats> out = moe_stats_;
  for (MoeLayerStats& s : moe_stats_) {
    std::fill(s.tokens_per_expert.begin(), s.tokens_per_expert.end(), 0);
    s.routed = s.dropped = s.forwards = 0;
    s.l_aux = 0.0;
  }
  return out;
}

}  // namespace zero3d
