// model_layout.cpp — what a GPT is made of, apart from running it: the Hugging Face parameter
// layout (MoE experts included; the Llama family's LlamaForCausalLM names), each rank's part of it
// over pipeline, tensor and expert ranks, the deterministic initialisation, FLOPs, and the
// activation plan that both the model's allocations and the memory planner read.
#include <algorithm>
#include <cmath>
#include <stdexcept>

#include "base/rng.hpp"
#include "kernels/attention.hpp"  // kRowBlock: the attention backward's row block (its scratch)
#include "kernels/attention_gqa.hpp"
#include "model/bf16_activations.hpp"
#include "model/model.hpp"

namespace zero3d {

namespace {
const char* kBlockTensorNames[] = {"ln_1.weight",       "ln_1.bias",       "attn.c_attn.weight", "attn.c_attn.bias",
                                   "attn.c_proj.weight", "attn.c_proj.bias", "ln_2.weight",        "ln_2.bias",
                                   "mlp.c_fc.weight",    "mlp.c_fc.bias",    "mlp.c_proj.weight",  "mlp.c_proj.bias"};
}  // namespace

const char* const kExpertTensorNames[4] = {"c_fc.weight", "c_fc.bias", "c_proj.weight", "c_proj.bias"};

namespace {
// One block's tensors in layout order, with their global shapes. An MoE block (FACTS-2 §4.5)
// keeps the dense MLP only as PR-MoE's residual branch, adds its coefficient Linear(C, 2) then,
// and the gate Linear(C, E, bias=False) (stored input-major like every Conv1D weight here).
// The Llama family's block (LlamaDecoderLayer's parameters, nn.Linear weights [out, in]). q, k
// and v follow one another, so together they are one [(H + 2·Hkv)·d, C] matrix (one product
// makes rope.hpp's fused qkv rows), their biases likewise; gate_proj and up_proj make one
// [2I, C] matrix whose product is SwiGLU's fused [gate | up] row (swiglu.hpp).
std::vector<std::pair<std::string, std::vector<int64_t>>> llama_block_tensors(const GPTShape& s) {
  const DecoderFamily& f = s.family;
  const int64_t C = s.n_embd, A = s.n_head * f.head_dim, KV = f.num_key_value_heads * f.head_dim,
                I = f.intermediate_size;
  std::vector<std::pair<std::string, std::vector<int64_t>>> out = {{"input_layernorm.weight", {C}},
                                                                   {"self_attn.q_proj.weight", {A, C}},
                                                                   {"self_attn.k_proj.weight", {KV, C}},
                                                                   {"self_attn.v_proj.weight", {KV, C}}};
  if (f.qkv_bias) {
    out.push_back({"self_attn.q_proj.bias", {A}});
    out.push_back({"self_attn.k_proj.bias", {KV}});
    out.push_back({"self_attn.v_proj.bias", {KV}});
  }
  out.push_back({"self_attn.o_proj.weight", {C, A}});
  if (f.o_bias) out.push_back({"self_attn.o_proj.bias", {C}});
  out.push_back({"post_attention_layernorm.weight", {C}});
  if (f.mixtral()) {  // MixtralSparseMoeBlock's router, nn.Linear(C, E, bias=False); its experts follow lm_head
    out.push_back({"block_sparse_moe.gate.weight", {s.moe.num_experts, C}});
    return out;
  }
  out.push_back({"mlp.gate_proj.weight", {I, C}});
  out.push_back({"mlp.up_proj.weight", {I, C}});
  if (f.mlp_bias) {
    out.push_back({"mlp.gate_proj.bias", {I}});
    out.push_back({"mlp.up_proj.bias", {I}});
  }
  out.push_back({"mlp.down_proj.weight", {C, I}});
  if (f.mlp_bias) out.push_back({"mlp.down_proj.bias", {C}});
  return out;
}

std::string block_prefix(const GPTShape& s, int64_t l) {
  return (s.llama() ? "model.layers." : "h.") + std::to_string(l) + ".";
}

std::vector<std::pair<std::string, std::vector<int64_t>>> block_tensors(const GPTShape& s, int64_t l) {
  if (s.llama()) return llama_block_tensors(s);
  const int64_t C = s.n_embd;
  const std::vector<std::vector<int64_t>> shapes = {{C}, {C}, {C, 3 * C}, {3 * C}, {C, C},     {C},
                                                    {C}, {C}, {C, 4 * C}, {4 * C}, {4 * C, C}, {C}};
  std::vector<std::pair<std::string, std::vector<int64_t>>> out;
  const bool moe = s.moe.is_moe_block(l), dense_mlp = !moe || s.moe.use_residual;
  for (size_t k = 0; k < shapes.size(); ++k)
    if (k < 8 || dense_mlp) out.emplace_back(kBlockTensorNames[k], shapes[k]);
  if (moe && s.moe.use_residual) {
    out.emplace_back("mlp.coefficient.weight", std::vector<int64_t>{C, 2});
    out.emplace_back("mlp.coefficient.bias", std::vector<int64_t>{2});
  }
  if (moe) out.emplace_back("mlp.gate.weight", std::vector<int64_t>{C, s.moe.num_experts});
  return out;
}
// One expert's tensors in layout order (global shapes): GPT-2's MLP (c_fc, c_proj with biases),
// or Mixtral's SwiGLU MLP w1 (gate), w3 (up), w2 (down), nn.Linear weights [out, in] without
// biases. w1 and w3 follow one another, so together they are one [2I, C] matrix whose product is
// SwiGLU's fused [gate | up] row, as the dense Llama MLP's gate_proj and up_proj.
std::vector<std::pair<std::string, std::vector<int64_t>>> expert_tensors(const GPTShape& s) {
  const int64_t C = s.n_embd, I = s.family.intermediate_size;
  if (s.family.mixtral()) return {{"w1.weight", {I, C}}, {"w3.weight", {I, C}}, {"w2.weight", {C, I}}};
  return {{kExpertTensorNames[0], {C, 4 * C}},
          {kExpertTensorNames[1], {4 * C}},
          {kExpertTensorNames[2], {4 * C, C}},
          {kExpertTensorNames[3], {C}}};
}
std::string expert_prefix(const GPTShape& s, int64_t l, int64_t e) {
  if (s.family.mixtral())
    return "model.layers." + std::to_string(l) + ".block_sparse_moe.experts." + std::to_string(e) + ".";
  return "h." + std::to_string(l) + ".mlp.experts." + std::to_string(e) + ".";
}
// Every MoE block's experts, after the dense tensors.
void add_experts(ParamLayout& layout, const GPTShape& s) {
  for (int64_t l = 0; l < s.n_layer; ++l)
    if (s.moe.is_moe_block(l))
      for (int64_t e = 0; e < s.moe.num_experts; ++e)
        for (const auto& [name, shape] : expert_tensors(s)) layout.add(expert_prefix(s, l, e) + name, shape);
}
}  // namespace

ExpertWidths moe_expert_widths(const GPTShape& s, int64_t t) {
  const int64_t parts = s.moe.expert_tensor_parallel && t > 1 ? t : 1;
  if (s.family.mixtral()) return {2 * s.family.intermediate_size / parts, s.family.intermediate_size / parts};
  return {4 * s.n_embd / parts, 4 * s.n_embd / parts};
}

BlockWidths block_widths(const GPTShape& s, int64_t t) {
  if (!s.llama()) return {3 * s.n_embd / t, s.n_embd / t, 4 * s.n_embd / t, 4 * s.n_embd / t};
  const DecoderFamily& f = s.family;  // whole K/V-head groups and I/t of the MLP per tensor rank
  const int64_t I = f.mixtral() ? 0 : f.intermediate_size;  // Mixtral has no dense MLP (its experts' rows: ExpertWidths)
  return {(s.n_head + 2 * f.num_key_value_heads) * f.head_dim / t, s.n_head * f.head_dim / t, 2 * I / t, I / t};
}

std::string embedding_tensor_name(const GPTShape& s) { return s.llama() ? "model.embed_tokens.weight" : "wte.weight"; }
std::string block_first_tensor_name(const GPTShape& s, int64_t l) {
  return block_prefix(s, l) + (s.llama() ? "input_layernorm.weight" : "ln_1.weight");
}
std::string final_first_tensor_name(const GPTShape& s) { return s.llama() ? "model.norm.weight" : "ln_f.weight"; }

ParamLayout gpt_layout(const GPTShape& s) {
  const int64_t V = s.vocab_size, T = s.n_positions, C = s.n_embd;
  ParamLayout layout;
  if (s.llama()) {  // LlamaForCausalLM: model.embed_tokens, model.layers.N, model.norm, lm_head
    layout.add("model.embed_tokens.weight", {V, C});
    for (int64_t l = 0; l < s.n_layer; ++l)
      for (const auto& [name, shape] : block_tensors(s, l)) layout.add(block_prefix(s, l) + name, shape);
    layout.add("model.norm.weight", {C});
    if (!s.tied_head()) layout.add("lm_head.weight", {V, C});
    add_experts(layout, s);
    return layout;
  }
  layout.add("wte.weight", {V, C});
  layout.add("wpe.weight", {T, C});
  for (int64_t l = 0; l < s.n_layer; ++l) {
    const std::string p = "h." + std::to_string(l) + ".";
    for (const auto& [name, shape] : block_tensors(s, l)) layout.add(p + name, shape);
  }
  layout.add("ln_f.weight", {C});
  layout.add("ln_f.bias", {C});
  add_experts(layout, s);
  return layout;
}

int64_t gpt_active_params(const GPTShape& s, int64_t k) {
  const ParamLayout layout = gpt_layout(s);
  if (!s.moe.enabled()) return layout.total();
  int64_t expert = 0;
  for (const auto& [name, shape] : expert_tensors(s)) {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    expert += n;
  }
  int64_t moe_blocks = 0;
  for (int64_t l = 0; l < s.n_layer; ++l) moe_blocks += s.moe.is_moe_block(l) ? 1 : 0;
  // every expert is stored; a token meets k of them per MoE block
  return layout.total() - moe_blocks * (s.moe.num_experts - k) * expert;
}

std::vector<ParamUnit> gpt_units(const ParamLayout& layout, int64_t n_layer) {
  // The layout's names say which family it is (the Llama family's final unit ends the layout).
  GPTShape s;
  if (layout.find("model.embed_tokens.weight")) s.family.arch = Architecture::Llama;
  std::vector<int64_t> starts = {0};
  for (int64_t l = 0; l < n_layer; ++l) starts.push_back(layout.find(block_first_tensor_name(s, l))->offset);
  starts.push_back(layout.find(final_first_tensor_name(s))->offset);
  if (s.llama()) {  // model.norm, then lm_head unless tied; experts follow (their own units)
    const TensorSpec* last = layout.find("lm_head.weight") ? layout.find("lm_head.weight") : layout.find("model.norm.weight");
    starts.push_back(last->offset + last->numel);
  } else starts.push_back(layout.find("ln_f.bias")->offset + layout.find("ln_f.bias")->numel);  // experts follow (their own units)
  std::vector<ParamUnit> units;
  for (size_t u = 0; u + 1 < starts.size(); ++u) {
    const UnitKind kind = u == 0 ? UnitKind::Embedding : u + 2 == starts.size() ? UnitKind::FinalNorm : UnitKind::Block;
    units.push_back({starts[u], starts[u + 1] - starts[u], kind, kind == UnitKind::Block ? static_cast<int>(u) - 1 : -1});
  }
  return units;
}

std::vector<LayoutSegment> ModelPart::global_runs(int64_t begin, int64_t end, bool saving) const {
  std::vector<LayoutSegment> out;
  auto it = std::lower_bound(runs.begin(), runs.end(), begin,
                             [](const LayoutSegment& r, int64_t x) { return r.local_end <= x; });
  for (; it != runs.end() && it->local_begin < end; ++it) {
    if (saving && !it->saved) continue;
    const int64_t lo = std::max(begin, it->local_begin), hi = std::min(end, it->local_end);
    if (lo < hi) out.push_back({lo, hi, it->global_begin + (lo - it->local_begin), it->saved});
  }
  return out;
}

std::vector<std::pair<int64_t, int64_t>> ModelPart::replicated_ranges() const {
  std::vector<std::pair<int64_t, int64_t>> out;
  if (tp_size == 1) return out;
  for (size_t k = 0; k < splits.size(); ++k)
    if (splits[k].replicated()) {
      const TensorSpec& t = layout.tensors()[k];
      if (!out.empty() && out.back().second == t.offset) out.back().second += t.numel;
      else out.emplace_back(t.offset, t.offset + t.numel);
    }
  return out;
}

ModelPart gpt_model_part(const GPTShape& s, const std::vector<int>& bounds, int stages, int stage, int tp_size,
                         int tp_rank, int ep_size, int ep_rank) {
  const int64_t t = tp_size;
  const ParamLayout global = gpt_layout(s);
  const std::string embedding = embedding_tensor_name(s);
  const int parts = static_cast<int>(bounds.size()) - 1;
  const int layers = static_cast<int>(s.n_layer) + 2;  // embedding, blocks, final
  ModelPart part;
  part.tp_size = tp_size;
  part.tp_rank = tp_rank;
  // Megatron pads the vocabulary to a multiple of make_vocab_size_divisible_by × t
  // (_vocab_size_with_padding); padded rows hold zeros, are never looked up, and their logits
  // are masked, so they change no loss.
  const int64_t multiple = s.make_vocab_size_divisible_by * t;
  part.vocab_padded = (s.vocab_size + multiple - 1) / multiple * multiple;
  part.vocab_local = part.vocab_padded / t;
  part.vocab_begin = tp_rank * part.vocab_local;
  part.vocab_real = std::max<int64_t>(0, std::min(part.vocab_local, s.vocab_size - part.vocab_begin));
  ParamLayout& layout = part.layout;
  auto add_unit = [&](UnitKind kind, int block, int64_t begin) {
    part.units.push_back({begin, layout.total() - begin, kind, block});
    return static_cast<int>(part.units.size()) - 1;
  };
  // Adds `name` cut by `split` and the runs of its local elements in the global layout.
  auto add = [&](const std::string& name, TensorSplit split, bool saved) {
    const TensorSpec* g = global.find(name);
    std::vector<int64_t> shape = g->shape;
    const bool vocab = name == embedding || name == "lm_head.weight";  // the vocab-parallel head too
    if (vocab) shape[0] = part.vocab_padded;
    const int64_t full = shape[split.dim];
    shape[split.dim] = full / split.parts;
    const int64_t local = layout.total();
    layout.add(name, shape);
    part.global_shapes.push_back(g->shape);
    part.splits.push_back(split);
    saved = saved && (!split.replicated() || tp_rank == 0);
    auto run = [&](int64_t lb, int64_t n, int64_t gb) {
      LayoutSegment& last = part.runs.empty() ? part.runs.emplace_back(LayoutSegment{lb, lb, gb, saved}) : part.runs.back();
      if (last.local_end == lb && last.saved == saved && last.global_begin + (lb - last.local_begin) == gb)
        last.local_end += n;
      else
        part.runs.push_back({lb, lb + n, gb, saved});
    };
    if (split.replicated()) {
      run(local, g->numel, g->offset);
    } else if (split.dim == 0) {  // whole rows: one run per stride chunk (vocab rows past V are padding)
      const int64_t row = g->numel / g->shape[0], chunk = full / (split.stride * split.parts);
      for (int j = 0; j < split.stride; ++j) {
        const int64_t first = j * (full / split.stride) + split.index * chunk;
        const int64_t rows = std::max<int64_t>(0, std::min(chunk, g->shape[0] - first));
        if (rows > 0) run(local + j * chunk * row, rows * row, g->offset + first * row);
      }
    } else {  // columns of a [rows, cols] matrix: stride runs per row
      const int64_t rows = g->shape[0], cols = g->shape[1], chunk = cols / (split.stride * split.parts);
      for (int64_t i = 0; i < rows; ++i)
        for (int j = 0; j < split.stride; ++j)
          run(local + i * (cols / split.parts) + j * chunk, chunk,
              g->offset + i * cols + j * (cols / split.stride) + split.index * chunk);
    }
  };
  const TensorSplit replicated{}, rows{0, 1, tp_size, tp_rank}, cols{1, 1, tp_size, tp_rank},
      qkv_cols{1, 3, tp_size, tp_rank}, qkv_bias{0, 3, tp_size, tp_rank};
  const bool holds_embedding = stage == 0, holds_final = stage == (parts - 1) % stages;
  if (holds_final && !holds_embedding && s.tied_head()) {  // the LM head's wte: DeepSpeed's TiedLayerSpec on the last stage
    add(embedding, rows, /*saved=*/false);
    part.tied_unit = add_unit(UnitKind::TiedHead, -1, 0);
  }
  for (int k = stage; k < parts; k += stages) {
    ModelChunk c;
    for (int layer = bounds[k]; layer < bounds[k + 1]; ++layer) {
      const int64_t begin = layout.total();
      if (layer == 0) {
        add(embedding, rows, true);  // vocab-parallel (Megatron VocabParallelEmbedding)
        if (!s.llama()) add("wpe.weight", replicated, true);
        c.embedding = true;
        c.embed_unit = add_unit(UnitKind::Embedding, -1, begin);
      } else if (layer == layers - 1) {
        if (s.llama()) {  // model.norm and the untied head: one unit, the chunk's last
          add("model.norm.weight", replicated, true);
          if (!s.tied_head()) add("lm_head.weight", rows, true);  // vocab-parallel (Megatron's parallel LM head)
        } else {
          add("ln_f.weight", replicated, true);
          add("ln_f.bias", replicated, true);
        }
        c.final = true;
        c.final_unit = add_unit(UnitKind::FinalNorm, -1, begin);
      } else {
        const int l = layer - 1;
        const std::string p = block_prefix(s, l);
        // Megatron's block: c_attn and c_fc column-parallel, the two c_proj row-parallel with
        // their biases replicated (added once, after the all-reduce); LayerNorms replicated.
        // MoE additions (gate, coefficient) are replicated: every tensor rank routes the same tokens.
        const TensorSplit how[] = {replicated, replicated, qkv_cols, qkv_bias, rows, replicated,
                                   replicated, replicated, cols,     rows,     rows, replicated};
        // The Llama family (AutoTP's llama preset): q/k/v and gate/up_proj split by output rows
        // (whole heads, K/V heads by whole groups), o_proj and down_proj by input columns, their
        // biases replicated; RMSNorms replicated.
        const auto llama_split = [&](const std::string& name) {
          const bool column_parallel = name.rfind("self_attn.q_proj.", 0) == 0 || name.rfind("self_attn.k_proj.", 0) == 0 ||
                                       name.rfind("self_attn.v_proj.", 0) == 0 || name.rfind("mlp.gate_proj.", 0) == 0 ||
                                       name.rfind("mlp.up_proj.", 0) == 0;
          if (column_parallel) return rows;
          if (name == "self_attn.o_proj.weight" || name == "mlp.down_proj.weight") return cols;
          return replicated;
        };
        const auto tensors = block_tensors(s, l);
        for (const auto& [name, shape] : tensors) {
          TensorSplit split = replicated;
          if (s.llama()) split = llama_split(name);
          for (int j = 0; j < 12 && !s.llama(); ++j)
            if (name == kBlockTensorNames[j]) split = how[j];
          add(p + name, split, true);
        }
        if (c.num_blocks == 0) {
          c.first_block = l;
          c.first_block_unit = static_cast<int>(part.units.size());
        }
        ++c.num_blocks;
        add_unit(UnitKind::Block, l, begin);
      }
    }
    if (c.final) c.head_unit = !s.tied_head() ? c.final_unit : c.embedding || part.tied_unit < 0 ? 0 : part.tied_unit;
    part.chunks.push_back(c);
  }
  // the head of a one-stage model reads the embedding unit's wte
  for (ModelChunk& c : part.chunks)
    if (c.final && part.tied_unit < 0 && s.tied_head()) c.head_unit = part.chunks.front().embed_unit;
  // MoE: this rank's experts of each MoE block it holds, after every dense tensor: experts
  // ep_rank·E/ep ... (DeepSpeed's global expert id), replicated over the tensor group.
  part.ep_size = ep_size;
  part.ep_rank = ep_rank;
  part.expert_begin = layout.total();
  part.expert_unit.assign(static_cast<size_t>(s.n_layer), -1);
  const int64_t local_experts = s.moe.enabled() ? s.moe.num_experts / ep_size : 0;
  std::vector<int> held;
  for (const ModelChunk& c : part.chunks)
    for (int b = c.first_block; b < c.first_block + c.num_blocks; ++b)
      if (s.moe.is_moe_block(b)) held.push_back(b);
  std::sort(held.begin(), held.end());
  // Expert tensor parallelism: c_fc column-parallel, c_proj row-parallel with its bias replicated;
  // Mixtral's (AutoTP's mixtral preset) w1 and w3 column-parallel (rows), w2 row-parallel (columns).
  const bool split_experts = s.moe.expert_tensor_parallel && tp_size > 1;
  const std::vector<TensorSplit> expert_how =
      !split_experts     ? std::vector<TensorSplit>(4, replicated)
      : s.family.mixtral() ? std::vector<TensorSplit>{rows, rows, cols}
                           : std::vector<TensorSplit>{cols, rows, rows, replicated};
  const auto expert_names = expert_tensors(s);
  for (int b : held) {
    const int64_t begin = layout.total();
    for (int64_t i = 0; i < local_experts; ++i)
      for (size_t k = 0; k < expert_names.size(); ++k)
        add(expert_prefix(s, b, ep_rank * local_experts + i) + expert_names[k].first, expert_how[k], true);
    if (part.first_expert_unit < 0) part.first_expert_unit = static_cast<int>(part.units.size());
    part.expert_unit[static_cast<size_t>(b)] = add_unit(UnitKind::Experts, b, begin);
  }
  for (const TensorSpec& ts : layout.tensors())
    (ts.offset < part.expert_begin ? part.dense_layout : part.expert_layout).add(ts.name, ts.shape);
  for (ParamUnit u : part.units) {
    if (u.kind != UnitKind::Experts) {
      part.dense_units.push_back(u);
      continue;
    }
    u.offset -= part.expert_begin;
    part.expert_units.push_back(u);
  }
  return part;
}

int64_t moe_rows_bound(const MoeShape& shape, const MoeRouting& r, int64_t S, int ep) {
  if (!shape.enabled()) return 0;
  if (r.mixtral) return ep * S * std::min<int64_t>(r.k, shape.num_experts / ep);
  const double E = static_cast<double>(shape.num_experts);
  // DeepSpeed's _capacity: ceil(S/E · cf · k) raised to min_capacity (FACTS-2 §4.2); no-drop: up to S
  const auto capacity = [&](double cf) {
    return std::max<int64_t>(static_cast<int64_t>(std::ceil(static_cast<double>(S) / E * cf * r.k)), r.min_capacity);
  };
  const int64_t cap = r.drop_tokens ? std::max(capacity(r.capacity_factor), capacity(r.eval_capacity_factor)) : S;
  return shape.num_experts * std::min(cap, S);
}

double gpt_flops_per_token(const GPTShape& s, int64_t num_params) {
  if (s.llama()) {  // an untied embedding is a lookup, no product; attention is H·d wide
    const double products = static_cast<double>(num_params - (s.tied_head() ? 0 : s.vocab_size * s.n_embd));
    return 6.0 * products + 12.0 * static_cast<double>(s.n_layer) * static_cast<double>(s.n_positions) *
                                static_cast<double>(s.n_head * s.family.head_dim);
  }
  double attention_share = 1.0;
  if (s.sparse.enabled) {
    const int64_t nb = s.n_positions / s.sparse.block;
    attention_share = 0.0;
    for (int64_t l = 0; l < s.n_layer; ++l)
      attention_share += causal_block_share(sparse_block_layout(s.sparse, s.n_head, s.n_positions, l), s.n_head, nb);
    attention_share /= static_cast<double>(s.n_layer);
  }
  return 6.0 * static_cast<double>(num_params) + 12.0 * static_cast<double>(s.n_layer) *
                                                     static_cast<double>(s.n_positions) *
                                                     static_cast<double>(s.n_embd) * attention_share;
}

int64_t gpt_params_outside_blocks(const GPTShape& s) {
  if (s.llama()) return (s.tied_head() ? 1 : 2) * s.vocab_size * s.n_embd + s.n_embd;
  return s.vocab_size * s.n_embd + s.n_positions * s.n_embd + 2 * s.n_embd;
}

int64_t attention_probs_size(const GPTShape& s, int64_t B, int64_t H, int64_t T) {
  if (!s.sparse.enabled) return B * H * T * T;
  return B * H * sparse_probs_per_head(s.sparse, s.n_head, T, s.n_layer);
}

void init_gpt_params_range(float* out, const ParamLayout& layout, const GPTShape& shape, uint64_t seed, int64_t begin,
                           int64_t end) {
  const double proj_scale = 1.0 / std::sqrt(2.0 * static_cast<double>(shape.n_layer));
  const bool llama = shape.llama();
  for (const TensorSpec& t : layout.tensors()) {
    const int64_t lo = std::max(begin, t.offset), hi = std::min(end, t.offset + t.numel);
    if (lo >= hi) continue;
    float* p = out + (lo - begin);
    const auto ends_with = [&](const char* suffix) {
      const std::string s(suffix);
      return t.name.size() >= s.size() && t.name.compare(t.name.size() - s.size(), s.size(), s) == 0;
    };
    const bool is_layernorm = llama ? t.name.find("layernorm.") != std::string::npos || t.name == "model.norm.weight"
                                    : t.name.find("ln_") != std::string::npos;
    if (ends_with(".bias") || is_layernorm) {
      const float value = ends_with(".bias") ? 0.0f : 1.0f;
      for (int64_t i = lo; i < hi; ++i) p[i - lo] = value;
    } else {
      // GPT-2 scales the residual projections by 1/sqrt(2L) (Radford et al. 2019, §2.3); the Llama
      // family draws every weight at initializer_range (LlamaPreTrainedModel._init_weights).
      const double std = llama ? shape.family.initializer_range : 0.02 * (ends_with("c_proj.weight") ? proj_scale : 1.0);
      Rng rng(seed, hash_name(t.name));
      for (int64_t i = t.offset; i < lo; ++i) rng.normal();  // the draws of elements before the range
      for (int64_t i = lo; i < hi; ++i) p[i - lo] = static_cast<float>(std * rng.normal());
    }
  }
}

void init_gpt_params(float* params, const ParamLayout& layout, const GPTShape& shape, uint64_t seed) {
  init_gpt_params_range(params, layout, shape, seed, 0, layout.total());
}

bool low_precision_tensor(const std::string& name, const LowPrecisionModules& modules) {
  const auto has = [&](const char* part) { return name.find(part) != std::string::npos; };
  if (name.rfind("model.", 0) == 0 || name == "lm_head.weight") {  // the Llama family (lm_head: a Linear)
    if (has("layernorm.") || name == "model.norm.weight") return modules.layer_norm;
    if (name == "model.embed_tokens.weight") return modules.embedding;
    return modules.linear;
  }
  if (has("ln_")) return modules.layer_norm;          // ln_1, ln_2, ln_f
  if (name == "wte.weight" || name == "wpe.weight") return modules.embedding;
  return modules.linear;  // c_attn, attn.c_proj, c_fc, mlp.c_proj, an MoE block's gate, coefficient and experts
}

BlockSaveSizes gpt_block_save_sizes(const GPTShape& shape, const ModelPart& part, int64_t B, int64_t T,
                                    bool sequence_parallel, DType compute, kernels::Backend backend) {
  const int64_t t = part.tp_size, C = shape.n_embd, Cl = C / t, H = shape.n_head / t, BT = B * T,
                Ns = sequence_parallel && t > 1 ? BT / t : BT;
  const bool bf16 = compute == DType::BF16;
  const auto half = [](int64_t n) { return (n + 1) / 2; };  // n bf16 values in floats
  if (shape.llama()) {  // rstd only; the halves llama_block.cpp keeps in bf16 (bf16_activations.hpp)
    const BlockWidths w = block_widths(shape, t);
    // att: what the bf16 grouped-query attention keeps (kernels/attention_gqa.hpp)
    const bool attn16 = activations_bf16(compute, t > 1, shape.family.mixtral(), false, backend),
               mlp16 = activations_bf16(compute, t > 1, shape.family.mixtral(), true, backend);
    BlockSaveSizes z;
    z.res = Ns * C;
    z.ln_1 = attn16 ? half(Ns * C) : Ns * C;
    z.ln_2 = mlp16 ? half(Ns * C) : Ns * C;
    z.stats = Ns;
    z.qkv = attn16 ? half(BT * w.qkv) : BT * w.qkv;
    z.att = attn16 ? kernels::gqa_attention_bf16_saved_floats(B * H, T, shape.family.head_dim,
                                                              shape.dropout.attn > 0.0, backend)
                   : B * H * T * T;
    z.atty = attn16 ? half(BT * w.attn) : BT * w.attn;
    z.fch = mlp16 ? half(BT * w.fc) : BT * w.fc;
    z.act = mlp16 ? half(BT * w.act) : BT * w.act;
    return z;
  }
  // The halves kept in bf16 (bf16_activations.hpp, decided per block in model.cpp; here for every
  // block of the model): for the attention half no sparse attention (its kernel is fp32), for the
  // MLP half no MoE block anywhere (their MLP half keeps fp32).
  const bool attn16 = !shape.sparse.enabled && activations_bf16(compute, t > 1, false, false, backend),
             mlp16 = activations_bf16(compute, t > 1, shape.moe.enabled(), true, backend);
  BlockSaveSizes z;
  z.ln_1 = attn16 ? half(Ns * C) : Ns * C;
  z.stats = z.mean = Ns;
  z.qkv = attn16 ? half(3 * BT * Cl) : 3 * BT * Cl;
  z.att = shape.sparse.enabled ? attention_probs_size(shape, B, H, T)
          : bf16               ? kernels::attention_bf16_saved_floats(B * H, T, Cl / H, shape.dropout.attn > 0.0, backend)
                               : B * H * T * T;
  z.atty = attn16 ? half(BT * Cl) : BT * Cl;
  z.res = Ns * C;
  z.ln_2 = mlp16 ? half(Ns * C) : Ns * C;
  z.fch = z.act = mlp16 ? half(4 * BT * Cl) : 4 * BT * Cl;
  return z;
}

ActivationPlan gpt_activation_plan(const GPTShape& shape, const ModelPart& part, int64_t B, int64_t T,
                                   bool sequence_parallel, bool split_backward, const ActivationCheckpointing& ac,
                                   const MoeRouting& moe, DType compute, kernels::Backend backend) {
  const int64_t t = part.tp_size, C = shape.n_embd, V = part.vocab_local,
                BT = B * T, Ns = sequence_parallel && t > 1 ? BT / t : BT;
  const bool sp = sequence_parallel && t > 1;
  int64_t max_blocks = 0, max_checkpoints = 0;
  bool any_final = false, receives_grad = false;
  for (const ModelChunk& c : part.chunks) {
    max_blocks = std::max<int64_t>(max_blocks, c.num_blocks);
    if (ac.full()) max_checkpoints = std::max<int64_t>(max_checkpoints, (c.num_blocks + ac.interval - 1) / ac.interval);
    any_final = any_final || c.final;
    receives_grad = receives_grad || !c.final;
  }
  // ln_1, res_2, ln_2, res_3 and the LayerNorm statistics over this rank's tokens; qkv, the
  // attention output, fc and its GELU over all tokens at this rank's width; what attention keeps
  const BlockSaveSizes sizes = gpt_block_save_sizes(shape, part, B, T, sequence_parallel, compute, backend);
  const int64_t att = sizes.att, block = sizes.total();
  const bool full = ac.full() && max_blocks > 0;
  ActivationPlan p;
  p.tokens = BT;
  p.stream = Ns * C + (full ? Ns * C : 0) + Ns * C + (receives_grad ? Ns * C : 0);
  p.per_block = ac.selective() ? block - att : block;
  p.blocks = ac.full() ? 0 : max_blocks;
  const int64_t logits = logits_bf16(compute, backend) ? (BT * V + 1) / 2 : BT * V;  // (in floats)
  p.head = any_final ? BT * C + 2 * Ns + logits + 2 * BT + (split_backward ? Ns * C : 0) : 0;
  const BlockWidths w = block_widths(shape, t);
  // d(res_3), d(fch), d(ln_2), d(res_2), d(qkv), d(ln_1) (BlockGradOperands)
  p.grad_operands = split_backward ? max_blocks * (2 * BT * C + 2 * Ns * C + BT * (w.fc + w.qkv)) : 0;
  if (full) {
    const bool split = ac.partition_activations && t > 1;
    p.checkpoint_slot = split ? Ns * C / t : Ns * C;
    p.checkpoint_slots = ac.contiguous_memory_optimization ? ac.number_checkpoints : max_checkpoints;
    p.checkpoint_allocations = ac.contiguous_memory_optimization ? 1 : p.checkpoint_slots;
    p.checkpoints_on_host = ac.cpu_checkpointing;
    p.recompute = Ns * C + (split && ac.cpu_checkpointing ? p.checkpoint_slot : 0) +
                  std::min<int64_t>(ac.interval, max_blocks) * block;
  } else if (ac.selective() && max_blocks > 0) {
    p.recompute = att;
  }
  const int64_t tp_extra = t > 1 ? BT * C + 3 * BT + (sp ? BT * C + Ns * C : 0) : 0;
  // d(ln), d(atty), d(qkv), d(fch) and a row block of attention scores; the Llama family also
  // d(SwiGLU output) and RoPE's cos and sin tables (T·d/2 each)
  p.scratch = BT * C + BT * (w.attn + w.qkv + w.fc) + kernels::kRowBlock * T + tp_extra;
  if (shape.llama()) p.scratch += BT * w.act + T * shape.family.head_dim;
  if (shape.moe.enabled()) {
    // MoE saves per block (S = B·T tokens, R rows received, k choices each): the experts' input,
    // fc and GELU rows, the returned outputs, Jitter's factors; residual MoE its two branches and
    // coefficients. The shared workspace: dispatch and return rows, gate logits and gradients.
    const int64_t S = BT, R = moe_rows_bound(shape.moe, moe, S, part.ep_size), k = moe.k, E = shape.moe.num_experts;
    for (const ModelChunk& c : part.chunks) {
      int64_t n = 0;
      for (int b = c.first_block; b < c.first_block + c.num_blocks; ++b) n += shape.moe.is_moe_block(b) ? 1 : 0;
      p.moe_blocks = std::max(p.moe_blocks, n);
    }
    const ExpertWidths F = moe_expert_widths(shape, t);  // an expert's row widths here
    p.per_moe_block = (moe.keeps_noise() ? S * C : 0) + R * C + R * (F.fch + F.act) +
                      S * k * C + (shape.moe.use_residual ? 2 * S * C + 2 * S : 0);
    p.scratch += S * k * C + 2 * R * C + R * F.fch + (shape.family.mixtral() ? R * F.act : 0) + 2 * S * E + S * k +
                 S * C + (shape.moe.use_residual ? S * C + 2 * S : 0);
  }
  return p;
}

int64_t attention_scratch_bytes(const GPTShape& shape, const ModelPart& part, int64_t B, int64_t T, DType compute,
                                kernels::Backend backend) {
  const bool has_blocks =
      std::any_of(part.chunks.begin(), part.chunks.end(), [](const ModelChunk& c) { return c.num_blocks > 0; });
  if (!has_blocks || shape.sparse.enabled) return 0;
  const int64_t t = std::max(1, part.tp_size), H = shape.n_head / t;
  const bool dropout = shape.dropout.attn > 0.0;
  if (shape.llama()) {  // the bf16 overloads where the attention half keeps bf16 (llama_block.cpp), else fp32's
    const bool bf16_half = activations_bf16(compute, t > 1, false, false, backend);
    return kernels::gqa_attention_workspace_bytes(B, T, H, shape.family.num_key_value_heads / t, shape.family.head_dim,
                                                  bf16_half ? DType::BF16 : DType::F32, bf16_half, dropout, backend);
  }
  return kernels::attention_workspace_bytes(B, T, shape.n_embd / t, H, compute, dropout, backend);
}

GPTActivationBytes gpt_activation_bytes(const GPTShape& shape, const ModelPart& part, int64_t B, int64_t T,
                                        bool sequence_parallel, bool split_backward, const ActivationCheckpointing& ac,
                                        const MoeRouting& moe, DType compute, kernels::Backend backend) {
  const ActivationPlan p =
      gpt_activation_plan(shape, part, B, T, sequence_parallel, split_backward, ac, moe, compute, backend);
  GPTActivationBytes out;
  out.buffer = p.buffer_bytes();  // ActivationBuffer::bytes()
  out.scratch = p.shared_bytes();
  out.host = p.checkpoints_on_host ? p.checkpoint_bytes() : 0;
  return out;
}

bool sequence_parallel_partial(const std::string& name) {
  return name.rfind("ln_f.", 0) == 0 || name.find(".ln_") != std::string::npos ||
         name.find("layernorm.") != std::string::npos || name == "model.norm.weight";  // the Llama family's RMSNorms
}

}  // namespace zero3d
