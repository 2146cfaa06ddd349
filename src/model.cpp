// model.cpp — GPT-2 forward and backward: the layer loop, read top-down then bottom-up.
#include "model.hpp"

#include <algorithm>
#include <cmath>

#include "attention.hpp"
#include "crossentropy.hpp"
#include "encoder.hpp"
#include "gelu.hpp"
#include "layernorm.hpp"
#include "matmul.hpp"
#include "rng.hpp"

namespace zero3d {

using namespace kernels;

namespace {
const char* kBlockTensorNames[] = {"ln_1.weight",       "ln_1.bias",       "attn.c_attn.weight", "attn.c_attn.bias",
                                   "attn.c_proj.weight", "attn.c_proj.bias", "ln_2.weight",        "ln_2.bias",
                                   "mlp.c_fc.weight",    "mlp.c_fc.bias",    "mlp.c_proj.weight",  "mlp.c_proj.bias"};

void copy(float* dst, const float* src, int64_t n) {
  Kokkos::parallel_for("copy", range(n), KOKKOS_LAMBDA(Index i) { dst[i] = src[i]; });
}

}  // namespace

ParamLayout gpt_layout(const GPTShape& s) {
  const int64_t V = s.vocab_size, T = s.n_positions, C = s.n_embd;
  ParamLayout layout;
  layout.add("wte.weight", {V, C});
  layout.add("wpe.weight", {T, C});
  for (int64_t l = 0; l < s.n_layer; ++l) {
    const std::string p = "h." + std::to_string(l) + ".";
    const std::vector<std::vector<int64_t>> shapes = {{C}, {C}, {C, 3 * C}, {3 * C}, {C, C},     {C},
                                                      {C}, {C}, {C, 4 * C}, {4 * C}, {4 * C, C}, {C}};
    for (size_t k = 0; k < shapes.size(); ++k) layout.add(p + kBlockTensorNames[k], shapes[k]);
  }
  layout.add("ln_f.weight", {C});
  layout.add("ln_f.bias", {C});
  return layout;
}

std::vector<ParamUnit> gpt_units(const ParamLayout& layout, int64_t n_layer) {
  std::vector<int64_t> starts = {0};
  for (int64_t l = 0; l < n_layer; ++l) starts.push_back(layout.find("h." + std::to_string(l) + ".ln_1.weight")->offset);
  starts.push_back(layout.find("ln_f.weight")->offset);
  starts.push_back(layout.total());
  std::vector<ParamUnit> units;
  for (size_t u = 0; u + 1 < starts.size(); ++u) units.push_back({starts[u], starts[u + 1] - starts[u]});
  return units;
}

double gpt_flops_per_token(const GPTShape& s, int64_t num_params) {
  return 6.0 * static_cast<double>(num_params) +
         12.0 * static_cast<double>(s.n_layer) * static_cast<double>(s.n_positions) * static_cast<double>(s.n_embd);
}

void init_gpt_params_range(float* out, const ParamLayout& layout, const GPTShape& shape, uint64_t seed, int64_t begin,
                           int64_t end) {
  const double proj_scale = 1.0 / std::sqrt(2.0 * static_cast<double>(shape.n_layer));
  for (const TensorSpec& t : layout.tensors()) {
    const int64_t lo = std::max(begin, t.offset), hi = std::min(end, t.offset + t.numel);
    if (lo >= hi) continue;
    float* p = out + (lo - begin);
    const auto ends_with = [&](const char* suffix) {
      const std::string s(suffix);
      return t.name.size() >= s.size() && t.name.compare(t.name.size() - s.size(), s.size(), s) == 0;
    };
    const bool is_layernorm = t.name.find("ln_") != std::string::npos;
    if (ends_with(".bias") || is_layernorm) {
      const float value = ends_with(".bias") ? 0.0f : 1.0f;
      for (int64_t i = lo; i < hi; ++i) p[i - lo] = value;
    } else {
      // GPT-2 scales the residual projections by 1/sqrt(2L) (Radford et al. 2019, §2.3).
      const double std = 0.02 * (ends_with("c_proj.weight") ? proj_scale : 1.0);
      Rng rng(seed, hash_name(t.name));
      for (int64_t i = t.offset; i < lo; ++i) rng.normal();  // the draws of elements before the range
      for (int64_t i = lo; i < hi; ++i) p[i - lo] = static_cast<float>(std * rng.normal());
    }
  }
}

void init_gpt_params(float* params, const ParamLayout& layout, const GPTShape& shape, uint64_t seed) {
  init_gpt_params_range(params, layout, shape, seed, 0, layout.total());
}

GPT::GPT(const GPTShape& shape, int64_t B, int64_t T, DType param_type)
    : shape_(shape), param_type_(param_type), B_(B), T_(T), layout_(gpt_layout(shape)), units_(gpt_units(layout_, shape.n_layer)) {
  const int64_t L = shape.n_layer, C = shape.n_embd, V = shape.vocab_size, H = shape.n_head, BT = B * T;

  // Activations: one allocation, carved into named arrays in forward order.
  const int64_t per_block = 16 * BT * C + 4 * BT + B * H * T * T;
  const int64_t total = BT * C + L * per_block + BT * C + 2 * BT + BT * V + 2 * BT;
  acts_ = make_scratch_buffer("activations", total);
  float* p = acts_.data();
  auto take = [&p](int64_t n) {
    float* out = p;
    p += n;
    return out;
  };
  encoded_ = take(BT * C);
  for (int64_t l = 0; l < L; ++l) {
    BlockActivations a;
    a.ln_1 = take(BT * C);
    a.ln_1_mean = take(BT);
    a.ln_1_rstd = take(BT);
    a.qkv = take(3 * BT * C);
    a.att = take(B * H * T * T);
    a.atty = take(BT * C);
    a.res_2 = take(BT * C);
    a.ln_2 = take(BT * C);
    a.ln_2_mean = take(BT);
    a.ln_2_rstd = take(BT);
    a.fch = take(4 * BT * C);
    a.fch_gelu = take(4 * BT * C);
    a.res_3 = take(BT * C);
    blocks_.push_back(a);
  }
  ln_f_ = take(BT * C);
  ln_f_mean_ = take(BT);
  ln_f_rstd_ = take(BT);
  logits_ = take(BT * V);
  losses_ = take(BT);
  lse_ = take(BT);

  // Backward scratch, shared by all blocks.
  scratch_ = make_scratch_buffer("backward_scratch", BT * C * 3 + 3 * BT * C + 4 * BT * C + kRowBlock * T);
  p = scratch_.data();
  dres_ = take(BT * C);
  dln_ = take(BT * C);
  datty_ = take(BT * C);
  dqkv_ = take(3 * BT * C);
  dfch_ = take(4 * BT * C);
  datt_scratch_ = take(kRowBlock * T);
}

template <typename T>
BlockTensors<T> GPT::block(T* unit) const {
  const int64_t C = shape_.n_embd;
  T* p = unit;
  BlockTensors<T> b;
  T** fields[] = {&b.ln_1_w, &b.ln_1_b, &b.c_attn_w, &b.c_attn_b, &b.attn_proj_w, &b.attn_proj_b,
                      &b.ln_2_w, &b.ln_2_b, &b.c_fc_w,   &b.c_fc_b,   &b.mlp_proj_w,  &b.mlp_proj_b};
  const int64_t sizes[] = {C, C, 3 * C * C, 3 * C, C * C, C, C, C, 4 * C * C, 4 * C, 4 * C * C, C};
  for (int k = 0; k < 12; ++k) {
    *fields[k] = p;
    p += sizes[k];
  }
  return b;
}

namespace {
constexpr int kEmbed = 0;  // unit of wte and wpe
}

float GPT::forward(const int32_t* tokens, const int32_t* targets, ParamStore& store) {
  switch (param_type_) {
    case DType::BF16: return forward_impl<bf16>(tokens, targets, store);
    case DType::F16: return forward_impl<fp16>(tokens, targets, store);
    default: return forward_impl<float>(tokens, targets, store);
  }
}

void GPT::backward(float grad_scale, ParamStore& store) {
  switch (param_type_) {
    case DType::BF16: return backward_impl<bf16>(grad_scale, store);
    case DType::F16: return backward_impl<fp16>(grad_scale, store);
    default: return backward_impl<float>(grad_scale, store);
  }
}

template <typename P>
float GPT::forward_impl(const int32_t* tokens, const int32_t* targets, ParamStore& store) {
  const int64_t B = B_, T = T_, C = shape_.n_embd, H = shape_.n_head, V = shape_.vocab_size, BT = B * T;
  const int ln_f = static_cast<int>(shape_.n_layer) + 1;
  tokens_ = tokens;
  targets_ = targets;

  const DType cmp = compute_type();
  const P* E = static_cast<const P*>(store.fetch(kEmbed));  // wte [V,C] then wpe [T,C]
  encoder_forward(encoded_, tokens, E, E + V * C, B, T, C);
  store.release(kEmbed);
  for (int64_t l = 0; l < shape_.n_layer; ++l) {
    const BlockTensors<const P> w = block(static_cast<const P*>(store.fetch(static_cast<int>(l) + 1)));
    BlockActivations& a = blocks_[l];
    const float* residual = l == 0 ? encoded_ : blocks_[l - 1].res_3;
    // x + attn(ln_1(x))
    layernorm_forward(a.ln_1, a.ln_1_mean, a.ln_1_rstd, residual, w.ln_1_w, w.ln_1_b, BT, C);
    matmul_forward(a.qkv, a.ln_1, w.c_attn_w, w.c_attn_b, BT, C, 3 * C, /*accumulate=*/false, cmp);
    attention_forward(a.atty, a.att, a.qkv, B, T, C, H);
    copy(a.res_2, residual, BT * C);
    matmul_forward(a.res_2, a.atty, w.attn_proj_w, w.attn_proj_b, BT, C, C, /*accumulate=*/true, cmp);
    // x + mlp(ln_2(x))
    layernorm_forward(a.ln_2, a.ln_2_mean, a.ln_2_rstd, a.res_2, w.ln_2_w, w.ln_2_b, BT, C);
    matmul_forward(a.fch, a.ln_2, w.c_fc_w, w.c_fc_b, BT, C, 4 * C, /*accumulate=*/false, cmp);
    gelu_forward(a.fch_gelu, a.fch, BT * 4 * C);
    copy(a.res_3, a.res_2, BT * C);
    matmul_forward(a.res_3, a.fch_gelu, w.mlp_proj_w, w.mlp_proj_b, BT, 4 * C, C, /*accumulate=*/true, cmp);
    store.release(static_cast<int>(l) + 1);
  }
  const P* F = static_cast<const P*>(store.fetch(ln_f));  // weight [C] then bias [C]
  layernorm_forward(ln_f_, ln_f_mean_, ln_f_rstd_, blocks_.back().res_3, F, F + C, BT, C);
  store.release(ln_f);
  // LM head tied to wte: logits = ln_f · wteᵀ
  E = static_cast<const P*>(store.fetch(kEmbed));
  gemm(BT, V, C, {ln_f_, DType::F32, false, C}, {E, dtype_of<P>(), true, C}, logits_, V, false, cmp);
  store.release(kEmbed);
  crossentropy_forward(losses_, lse_, logits_, targets, BT, V);
  float sum = 0.0f;
  const float* losses = losses_;
  Kokkos::parallel_reduce("mean_loss", range(BT), KOKKOS_LAMBDA(Index i, float& acc) { acc += losses[i]; }, sum);
  return sum / static_cast<float>(BT);
}

template <typename P>
void GPT::backward_impl(float grad_scale, ParamStore& store) {
  const int64_t B = B_, T = T_, C = shape_.n_embd, H = shape_.n_head, V = shape_.vocab_size, BT = B * T;
  const int ln_f = static_cast<int>(shape_.n_layer) + 1;

  // loss = mean over BT tokens, so each token's loss carries weight grad_scale / BT.
  crossentropy_backward(logits_, lse_, targets_, grad_scale / static_cast<float>(BT), BT, V);
  float* dlogits = logits_;
  // tied head: dln_f = dlogits · wte ; dwte += dlogitsᵀ · ln_f (dE stays open until the encoder)
  const DType cmp = compute_type();
  const P* E = static_cast<const P*>(store.fetch(kEmbed));
  float* dE = store.grad_target(kEmbed);
  const GemmOperand d = gemm_operand({dlogits, DType::F32, false, V}, BT * V, cmp);  // converted once for both
  gemm(BT, C, V, d, {E, dtype_of<P>(), false, C}, dln_, C, false, cmp);
  gemm(V, C, BT, {d.data, d.type, true, V}, {ln_f_, DType::F32, false, C}, dE, C, true, cmp);
  store.release(kEmbed);
  Kokkos::deep_copy(Kokkos::View<float*, Kokkos::MemoryUnmanaged>(dres_, BT * C), 0.0f);
  const P* F = static_cast<const P*>(store.fetch(ln_f));
  float* dF = store.grad_target(ln_f);
  layernorm_backward(dres_, dF, dF + C, dln_, blocks_.back().res_3, F, ln_f_mean_, ln_f_rstd_, BT, C);
  store.release(ln_f);
  store.grads_done(ln_f);

  for (int64_t l = shape_.n_layer - 1; l >= 0; --l) {
    const int u = static_cast<int>(l) + 1;
    const BlockTensors<const P> w = block(static_cast<const P*>(store.fetch(u)));
    const BlockTensors<float> dw = block(store.grad_target(u));
    const BlockActivations& a = blocks_[l];
    const float* residual = l == 0 ? encoded_ : blocks_[l - 1].res_3;
    // MLP half: dres holds d(res_3)
    matmul_backward(dfch_, dw.mlp_proj_w, dw.mlp_proj_b, dres_, a.fch_gelu, w.mlp_proj_w, BT, 4 * C, C, cmp);
    store.progress();
    gelu_backward(dfch_, a.fch, dfch_, BT * 4 * C);
    matmul_backward(dln_, dw.c_fc_w, dw.c_fc_b, dfch_, a.ln_2, w.c_fc_w, BT, C, 4 * C, cmp);
    store.progress();
    layernorm_backward(dres_, dw.ln_2_w, dw.ln_2_b, dln_, a.res_2, w.ln_2_w, a.ln_2_mean, a.ln_2_rstd, BT, C);
    // attention half: dres now holds d(res_2)
    matmul_backward(datty_, dw.attn_proj_w, dw.attn_proj_b, dres_, a.atty, w.attn_proj_w, BT, C, C, cmp);
    store.progress();
    attention_backward(dqkv_, datt_scratch_, datty_, a.qkv, a.att, B, T, C, H);
    store.progress();
    matmul_backward(dln_, dw.c_attn_w, dw.c_attn_b, dqkv_, a.ln_1, w.c_attn_w, BT, C, 3 * C, cmp);
    layernorm_backward(dres_, dw.ln_1_w, dw.ln_1_b, dln_, residual, w.ln_1_w, a.ln_1_mean, a.ln_1_rstd, BT, C);
    store.release(u);
    store.grads_done(u);
  }
  encoder_backward(dE, dE + V * C, dres_, tokens_, B, T, C);  // no parameters needed
  store.grads_done(kEmbed);
}

}  // namespace zero3d
