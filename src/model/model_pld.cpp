// model_pld.cpp — progressive layer drop in the layer loop (pld.hpp; DEEPSPEED-FACTS-2 §7.2).
//
// DeepSpeedExamples' PLD model (training/bing_bert/nvidia/modelingpreln_layerdrop.py, BertLayer
// and BertEncoder.forward) drops a whole block per micro-batch (attention and MLP together: the
// layer returns its input) and scales each kept branch's output by 1/p before its residual add:
//   x ← x + attn(ln_1(x))/p ;  x ← x + mlp(ln_2(x))/p.
// A dropped block runs no kernel and fetches no parameter; in backward its gradient passes
// through unchanged and its parameters get none. Every rank decides alike (pld.hpp), so the
// communication it skips (a tensor-parallel all-reduce, an MoE all-to-all, a ZeRO-3 gather)
// is skipped by every rank of the group at once.
#include "kernels/elementwise.hpp"
#include "model/model.hpp"
#include "parallel/comm.hpp"

namespace zero3d {

using namespace kernels;

float GPT::block_scale(const ActivationBuffer& buf, const ModelChunk& c, int l) const {
  if (!buf.training || buf.block_scale.empty()) return 1.0f;
  return buf.block_scale[static_cast<size_t>(c.first_block + l)];
}

void GPT::dropped_block_forward(BlockActivations& a, const float* residual) const {
  // The identity: the next block (or the chunk's output) reads res_3.
  copy(a.res_3, residual, Ns_ * shape_.n_embd, "pld_identity");
}

void GPT::dropped_block_backward(const ModelChunk& c, int l, ParamStore& store, BackwardPart part) const {
  // d(input) = d(output) (dres is left as it is). The units' gradient windows still open and
  // complete, with nothing added: at ZeRO 2-3 their reductions run on every data rank alike.
  if (part == BackwardPart::Input) return;
  const int global_block = c.first_block + l;
  const int u = c.first_block_unit + l;
  store.grad_target(u);
  store.grads_done(u);
  if (shape_.moe.is_moe_block(global_block)) {
    const int eu = part_.expert_unit[static_cast<size_t>(global_block)];
    store.grad_target(eu);
    store.grads_done(eu);
  }
}

void GPT::scaled_branch_backward_begin(float* dres, float s) {
  const int64_t n = Ns_ * shape_.n_embd;
  if (pld_grad_.extent(0) < static_cast<size_t>(n)) pld_grad_ = make_scratch_buffer("pld_grad", n);
  keep_and_scale(pld_grad_.data(), dres, s, n, "pld_scale_grad");
}

void GPT::scaled_branch_backward_end(float* dres, float s) const {
  add_scaled_into(dres, pld_grad_.data(), 1.0f - s, Ns_ * shape_.n_embd, "pld_unscale_residual");
}

// out = in + s·(out − in): the branch out − in that block_forward added, scaled by s.
void scale_residual_branch(float* out, const float* in, float s, int64_t n) {
  scale_towards(out, in, s, n, "pld_scale_branch");
}

}  // namespace zero3d
