// llama_tensors.hpp — where a Llama-family block's tensors lie inside its unit, for the block's
// forward and backward (llama_block.cpp) and for generation's passes (src/infer), which read the
// same parameters.
#pragma once

#include <cstdint>

#include "model/model.hpp"

namespace zero3d {

// One block's tensors inside its unit (a flat buffer of T: parameters, or fp32 gradients), in
// llama_block_tensors' order at this rank's widths w; absent biases are null. Mixtral's block has
// its router (block_sparse_moe.gate.weight [E, C], replicated) in place of the MLP (null).
template <typename T>
struct LlamaTensors {
  T *input_norm, *qkv_w, *qkv_b, *o_w, *o_b, *post_norm, *gate_up_w, *gate_up_b, *down_w, *down_b;
  T* router_w;
};

template <typename T>
LlamaTensors<T> llama_tensors(T* p, const GPTShape& s, const BlockWidths& w) {
  const DecoderFamily& f = s.family;
  const int64_t C = s.n_embd;
  LlamaTensors<T> t{};
  const auto take = [&p](int64_t n) {
    T* out = p;
    p += n;
    return out;
  };
  t.input_norm = take(C);
  t.qkv_w = take(w.qkv * C);
  if (f.qkv_bias) t.qkv_b = take(w.qkv);
  t.o_w = take(C * w.attn);
  if (f.o_bias) t.o_b = take(C);
  t.post_norm = take(C);
  if (f.mixtral()) {
    t.router_w = take(s.moe.num_experts * C);
    return t;
  }
  t.gate_up_w = take(w.fc * C);
  if (f.mlp_bias) t.gate_up_b = take(w.fc);
  t.down_w = take(C * w.act);
  if (f.mlp_bias) t.down_b = take(C);
  return t;
}

}  // namespace zero3d
