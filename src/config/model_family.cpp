// config/model_family.cpp — the `model` section of a Llama-family decoder (model.architecture
// llama, mistral, qwen2 or mixtral): Hugging Face's config.json keys and defaults
// (configuration_llama.py, configuration_mistral.py, configuration_qwen2.py,
// configuration_mixtral.py; MODEL-FAMILIES.md §4-5), given in the section
// or read from a Hugging Face config.json (`hf_config`, the section's own keys winning).
//
// A key of such a file that zero3d does not read is an error naming it, unless it is one of the
// keys that describe no computation (token ids, dtype, versions): a key that changes the
// architecture is never silently ignored.
#include <sys/stat.h>

#include <algorithm>
#include <set>

#include "base/errors.hpp"
#include "base/input_file.hpp"
#include "config/model_shape.hpp"
#include "config/section.hpp"

namespace zero3d::config_detail {

namespace {

// Keys of Hugging Face config.json files that describe no computation zero3d runs.
const std::set<std::string> kInformationalKeys = {
    "architectures", "transformers_version", "torch_dtype", "dtype",         "use_cache",
    "bos_token_id",  "eos_token_id",         "pad_token_id", "output_attentions", "output_hidden_states",
    "return_dict",   "id2label",             "label2id",     "tokenizer_class"};

// HF's defaults for each family (the configuration classes' __init__ arguments).
struct FamilyDefaults {
  int64_t vocab_size, hidden_size, intermediate_size, num_key_value_heads;  // num_key_value_heads 0: None
  int64_t max_position_embeddings;
  int64_t sliding_window;  // 0: None (Llama has no such key)
  double rms_norm_eps, rope_theta;
};
FamilyDefaults defaults_of(Architecture a) {
  switch (a) {
    case Architecture::Mistral: return {32000, 4096, 14336, 8, 4096 * 32, 4096, 1e-6, 10000.0};
    case Architecture::Qwen2: return {151936, 4096, 22016, 32, 32768, 4096, 1e-6, 10000.0};
    case Architecture::Mixtral: return {32000, 4096, 14336, 8, 4096 * 32, 0, 1e-5, 1e6};
    default: return {32000, 4096, 11008, 0, 2048, 0, 1e-6, 10000.0};
  }
}

// The class whose keys a message names.
std::string config_class(Architecture a) {
  switch (a) {
    case Architecture::Mistral: return "MistralConfig";
    case Architecture::Qwen2: return "Qwen2Config";
    case Architecture::Mixtral: return "MixtralConfig";
    default: return "LlamaConfig";
  }
}

// Knobs come from the model section when it gives them, else from the Hugging Face file.
struct Knobs {
  Section& sec;
  Section* file;  // null without hf_config
  Section& from(const std::string& key) { return !sec.has(key) && file && file->has(key) ? *file : sec; }
  // A key whose value may be JSON null (Python's None): nullopt then, or when absent.
  bool is_null(const std::string& key) {
    Section& s = from(key);
    if (!s.has(key)) return true;
    const json* v = s.raw(key);
    if (v && !v->is_null()) return false;
    sec.record(key, nullptr);
    return true;
  }
  int64_t integer(const std::string& key, int64_t def, int64_t lo, int64_t hi) {
    const int64_t v = from(key).integer(key, def, lo, hi);
    sec.record(key, v);
    return v;
  }
  std::optional<int64_t> nullable_integer(const std::string& key, std::optional<int64_t> def, int64_t lo, int64_t hi) {
    Section& s = from(key);
    if (!s.has(key)) {
      sec.mark_known(key);
      sec.record(key, def ? json(*def) : json(nullptr));
      return def;
    }
    if (is_null(key)) return std::nullopt;
    const size_t problems = sec.context().problems.size();
    const int64_t v = s.integer(key, lo, lo, hi);
    sec.record(key, v);
    return sec.context().problems.size() == problems ? std::optional<int64_t>(v) : std::nullopt;
  }
  double number(const std::string& key, double def, double lo, double hi, bool lo_open = false) {
    const double v = from(key).number(key, def, lo, hi, lo_open);
    sec.record(key, v);
    return v;
  }
  bool boolean(const std::string& key, bool def) {
    const bool v = from(key).boolean(key, def);
    sec.record(key, v);
    return v;
  }
  // A token id, a list of them (Llama 3's eos_token_id) or null: informational, kept for convert.
  std::vector<int64_t> token_ids(const std::string& key) {
    Section& s = from(key);
    sec.mark_known(key);
    const json* v = s.raw(key);
    if (!v || v->is_null()) return {};
    std::vector<int64_t> ids;
    const auto id = [&](const json& x) {
      if (!x.is_number_integer() || x.get<int64_t>() < 0) return false;
      ids.push_back(x.get<int64_t>());
      return true;
    };
    bool ok = v->is_array() ? !v->empty() : id(*v);
    if (v->is_array())
      for (const json& x : *v) ok = ok && id(x);
    if (!ok) {
      s.report_key(key, "value " + show(*v) + ": expected a token id (an integer >= 0), a list of them, or null");
      return {};
    }
    sec.record(key, *v);
    return ids;
  }
  // A key zero3d implements at one value only: any other is an error naming what it would change.
  void only(const std::string& key, const json& implemented, const std::string& why) {
    Section& s = from(key);
    const json* v = s.raw(key);
    sec.mark_known(key);
    if (!v) return;
    const bool same = *v == implemented || (v->is_number() && implemented.is_number() &&
                                            v->get<double>() == implemented.get<double>());
    if (!same) s.report_key(key, "value " + show(*v) + ": " + why);
    else sec.record(key, *v);
  }
};

// RoPE: rope_theta and rope_scaling (legacy Hub files; "type" an alias of "rope_type"), or
// transformers v5's rope_parameters holding both (modeling_rope_utils.py). Each type's
// required keys as Hugging Face's _validate_*_rope_parameters lists them.
kernels::RopeConfig read_rope(Knobs& k, int64_t max_position_embeddings, double theta) {
  kernels::RopeConfig r;
  r.max_position_embeddings = max_position_embeddings;
  const bool legacy = !k.is_null("rope_scaling"), v5 = !k.is_null("rope_parameters");
  if (legacy && v5)
    k.from("rope_parameters").report_key("rope_parameters", "give either rope_parameters (transformers v5) or rope_scaling, not both");
  r.theta = k.number("rope_theta", theta, 0.0, 1e12, /*lo_open=*/true);
  if (!legacy && !v5) return r;
  const std::string key = v5 ? "rope_parameters" : "rope_scaling";
  // Read from the Hugging Face file, the section's resolved form keeps it too, so that the
  // saved model section alone (a checkpoint's, which `zero3d convert` reads) describes the model.
  if (&k.from(key) != &k.sec) k.sec.record(key, *k.from(key).raw(key));
  Section rs = k.from(key).child(key);
  if (v5 && rs.has("rope_theta")) r.theta = rs.number("rope_theta", r.theta, 0.0, 1e12, true);
  std::string type = rs.has("rope_type") ? rs.string("rope_type", "default") : rs.string("type", "default");
  if (rs.has("rope_type") && rs.has("type") && rs.string("type", type) != type)
    rs.report_key("type", "differs from rope_type " + show(json(type)));
  const std::vector<std::string> types = {"default", "linear", "dynamic", "yarn", "llama3"};
  if (std::find(types.begin(), types.end(), type) == types.end()) {
    rs.report_key(rs.has("rope_type") ? "rope_type" : "type",
                  "rope type " + show(json(type)) +
                      (type == "longrope" ? " (Phi-3's LongRoPE) is not implemented" : " is not a rope type zero3d implements") +
                      "; zero3d has default, linear, dynamic, yarn and llama3");
    rs.finish();
    return r;
  }
  const auto required = [&](const char* name, double lo) {
    if (!rs.has(name)) rs.report_key(name, "rope type " + type + " needs it (Hugging Face's _validate_" + type +
                                               "_rope_parameters)");
    return rs.number(name, 1.0, lo, 1e12, true);
  };
  if (type == "linear") r.type = kernels::RopeType::Linear, r.factor = required("factor", 0.0);
  if (type == "dynamic") r.type = kernels::RopeType::Dynamic, r.factor = required("factor", 0.0);
  if (type == "yarn") {
    r.type = kernels::RopeType::Yarn;
    r.factor = required("factor", 0.0);
    r.attention_factor = rs.number("attention_factor", 0.0, 0.0, 1e12);
    r.beta_fast = rs.number("beta_fast", 32.0, 0.0, 1e12, true);
    r.beta_slow = rs.number("beta_slow", 1.0, 0.0, 1e12, true);
    r.mscale = rs.number("mscale", 0.0, 0.0, 1e12);
    r.mscale_all_dim = rs.number("mscale_all_dim", 0.0, 0.0, 1e12);
    r.truncate = rs.boolean("truncate", true);
    r.original_max_position_embeddings = rs.integer("original_max_position_embeddings", 0, 0, 1 << 30);
  }
  if (type == "llama3") {
    r.type = kernels::RopeType::Llama3;
    r.factor = required("factor", 0.0);
    r.low_freq_factor = required("low_freq_factor", 0.0);
    r.high_freq_factor = required("high_freq_factor", 0.0);
    if (!rs.has("original_max_position_embeddings"))
      rs.report_key("original_max_position_embeddings", "rope type llama3 needs it (Hugging Face's _validate_llama3_rope_parameters)");
    r.original_max_position_embeddings = rs.integer("original_max_position_embeddings", 8192, 1, 1 << 30);
    if (r.low_freq_factor >= r.high_freq_factor)
      rs.report_key("high_freq_factor", "must exceed low_freq_factor (" + show(json(r.low_freq_factor)) +
                                            "): the blend between them divides by their difference");
  }
  rs.finish();
  return r;
}

// Mixtral's sparse MoE block (configuration_mixtral.py, modeling_mixtral.py
// MixtralSparseMoeBlock) as zero3d's MoE layer: every layer routes, top-num_experts_per_tok of
// an fp32 softmax over all experts with the chosen weights renormalised, no capacity (no token
// is dropped), SwiGLU experts; model.moe holds ep_size only (config.cpp).
void read_mixtral_router(Knobs& k, ModelConfig& m) {
  DecoderFamily& f = m.family;
  MoeConfig& moe = m.moe;
  moe.num_experts = k.integer("num_local_experts", 8, 1, 1 << 16);
  moe.k = k.integer("num_experts_per_tok", 2, 1, 1 << 16);
  if (moe.k > moe.num_experts)
    k.from("num_experts_per_tok")
        .report_key("num_experts_per_tok", "value " + std::to_string(moe.k) + " is more than num_local_experts (" +
                                               std::to_string(moe.num_experts) + "): a token picks distinct experts");
  f.router_aux_loss_coef = k.number("router_aux_loss_coef", 0.001, 0.0, 1e6);
  f.output_router_logits = k.boolean("output_router_logits", false);
  // torch's uniform_(1 - j, 1 + j): j above 1 would flip signs; HF asserts nothing, 1 is the sane edge
  moe.router_jitter_noise = k.number("router_jitter_noise", 0.0, 0.0, 1.0);
  moe.every = 1;
  moe.drop_tokens = false;
  moe.use_rts = false;
  moe.top2_2nd_expert_sampling = false;
  moe.min_capacity = 0;
  moe.mixtral_routing = true;
  // AutoTP's mixtral preset splits each expert as a SwiGLU MLP (w1, w3 column-, w2 row-parallel).
  moe.enable_expert_tensor_parallelism = true;
  moe.aux_loss_coef = f.output_router_logits ? f.router_aux_loss_coef : 0.0;
}

}  // namespace

json read_hf_config_file(Section& model, const std::string& path, std::string* file) {
  struct stat st{};
  const bool dir = ::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
  *file = dir ? path + "/config.json" : path;
  const json hf = parse_json_text(read_regular_file(*file, "model.hf_config", 16 << 20), *file);
  if (!hf.is_object()) model.fail_key("hf_config", *file + " holds " + show(hf) + ", not a JSON object");
  return hf;
}

void read_llama_family(Section& sec, ModelConfig& m, Architecture arch, const json* hf, const std::string& hf_file) {
  json hf_resolved = json::object();
  std::optional<Section> file;
  if (hf) file.emplace(hf, "model.hf_config", hf_file, &hf_resolved, &sec.context());
  Knobs k{sec, file ? &*file : nullptr};
  DecoderFamily& f = m.family;
  f.arch = arch;
  const FamilyDefaults d = defaults_of(arch);
  const std::string cls = config_class(arch);
  // GPT-2's names have Hugging Face names here
  for (const auto& [gpt2, hf_name] : std::vector<std::pair<std::string, std::string>>{
           {"n_embd", "hidden_size"}, {"n_layer", "num_hidden_layers"}, {"n_head", "num_attention_heads"},
           {"n_positions", "seq_length (the sequence length trained on)"}, {"n_inner", "intermediate_size"}}) {
    sec.mark_known(gpt2);
    if (sec.has(gpt2))
      sec.report_key(gpt2, "GPT-2's key; model.architecture " + std::string(architecture_name(arch)) + " takes " +
                               hf_name);
  }
  m.vocab_size = k.integer("vocab_size", d.vocab_size, 2, 1 << 24);
  m.n_embd = k.integer("hidden_size", d.hidden_size, 1, 1 << 20);
  f.intermediate_size = k.integer("intermediate_size", d.intermediate_size, 1, 1 << 22);
  m.n_layer = k.integer("num_hidden_layers", 32, 1, 4096);
  m.n_head = k.integer("num_attention_heads", 32, 1, 4096);
  const std::optional<int64_t> kv =
      k.nullable_integer("num_key_value_heads", d.num_key_value_heads ? std::optional<int64_t>(d.num_key_value_heads)
                                                                      : std::nullopt, 1, 4096);
  f.num_key_value_heads = kv.value_or(m.n_head);
  const std::optional<int64_t> head_dim = k.nullable_integer("head_dim", std::nullopt, 1, 1 << 16);
  if (!head_dim && m.n_embd % m.n_head != 0)
    k.from("hidden_size").report_key("hidden_size", "value " + std::to_string(m.n_embd) +
                                                        " is not divisible by num_attention_heads (" +
                                                        std::to_string(m.n_head) + ") and head_dim is not given");
  f.head_dim = head_dim.value_or(m.n_embd / m.n_head);
  if (f.head_dim % 2 != 0)
    k.from("head_dim").report_key(head_dim ? "head_dim" : "hidden_size",
                                  "head_dim " + std::to_string(f.head_dim) +
                                      " is odd: RoPE rotates the halves of each head (rotate_half)");
  if (m.n_head % f.num_key_value_heads != 0)
    k.from("num_key_value_heads")
        .report_key("num_key_value_heads", "value " + std::to_string(f.num_key_value_heads) +
                                               " does not divide num_attention_heads (" + std::to_string(m.n_head) +
                                               "): each K/V head serves a whole group of query heads");
  f.rms_norm_eps = k.number("rms_norm_eps", d.rms_norm_eps, 0.0, 1.0, /*lo_open=*/true);
  const int64_t max_pos = k.integer("max_position_embeddings", d.max_position_embeddings, 1, int64_t(1) << 30);
  f.rope = read_rope(k, max_pos, d.rope_theta);
  f.tie_word_embeddings = k.boolean("tie_word_embeddings", false);
  f.initializer_range = k.number("initializer_range", 0.02, 0.0, 1.0, /*lo_open=*/true);
  f.bos_token_id = k.token_ids("bos_token_id");
  f.eos_token_id = k.token_ids("eos_token_id");
  k.only("hidden_act", "silu", "zero3d's MLP is SwiGLU with silu (" + cls + "'s default); another activation is not implemented");
  // LlamaAttention drops the attention probabilities in training (0.0, Hugging Face's default: none)
  m.dropout.attn = read_dropout_probability(k.from("attention_dropout"), "attention_dropout");
  sec.record("attention_dropout", m.dropout.attn);
  // zero3d's own: the sequence length trained on (T)
  m.n_positions = sec.integer("seq_length", 256, 1, 1 << 20);
  f.window.assign(static_cast<size_t>(m.n_layer), 0);
  if (arch == Architecture::Llama) {
    const bool attention_bias = k.boolean("attention_bias", false);
    f.qkv_bias = f.o_bias = attention_bias;
    f.mlp_bias = k.boolean("mlp_bias", false);
    k.only("pretraining_tp", 1, "Hugging Face's slice-wise products for tensor-parallel pretraining are not implemented");
  } else if (arch == Architecture::Mistral || arch == Architecture::Mixtral) {  // every layer slides when sliding_window is set
    const std::optional<int64_t> w = k.nullable_integer("sliding_window", d.sliding_window ? std::optional<int64_t>(d.sliding_window) : std::nullopt, 1, 1 << 30);
    std::fill(f.window.begin(), f.window.end(), w.value_or(0));
    if (arch == Architecture::Mixtral) read_mixtral_router(k, m);
  } else {  // Qwen2: q/k/v biases; a window on the layers layer_types names (default: those >= max_window_layers)
    f.qkv_bias = true;
    const bool use = k.boolean("use_sliding_window", false);
    const std::optional<int64_t> w = k.nullable_integer("sliding_window", d.sliding_window, 1, 1 << 30);
    const int64_t max_window_layers = k.integer("max_window_layers", 28, 0, 1 << 20);
    std::vector<bool> slides(static_cast<size_t>(m.n_layer));
    for (int64_t l = 0; l < m.n_layer; ++l) slides[static_cast<size_t>(l)] = l >= max_window_layers;
    Section& ls = k.from("layer_types");
    const json* types = ls.raw("layer_types");
    sec.mark_known("layer_types");
    if (types && !types->is_null()) {
      bool ok = types->is_array() && static_cast<int64_t>(types->size()) == m.n_layer;
      for (size_t l = 0; ok && l < types->size(); ++l) {
        const json& t = (*types)[l];
        ok = t == "full_attention" || t == "sliding_attention";
        if (ok) slides[l] = t == "sliding_attention";
      }
      if (!ok)
        ls.report_key("layer_types", "expected a list of num_hidden_layers (" + std::to_string(m.n_layer) +
                                         ") values \"full_attention\" or \"sliding_attention\", got " + show(*types));
      else
        sec.record("layer_types", *types);
    }
    // Qwen2Config keeps sliding_window only with use_sliding_window (else None: no layer slides)
    for (int64_t l = 0; l < m.n_layer; ++l)
      f.window[static_cast<size_t>(l)] = use && w && slides[static_cast<size_t>(l)] ? *w : 0;
  }
  // the rest of a Hugging Face file: informational keys pass, anything else is an error naming it
  if (file) {
    for (auto it = hf->begin(); it != hf->end(); ++it) {
      const std::string& key = it.key();
      if (key == "model_type" || (!key.empty() && key[0] == '_') || kInformationalKeys.count(key)) continue;
      const std::vector<std::string>& read = sec.context().known_paths;  // keys read from the file
      if (sec.has(key) || std::find(read.begin(), read.end(), "model.hf_config." + key) != read.end()) continue;
      file->report_key(echo(key, 60), "not a key of Hugging Face's " + cls +
                                          " that zero3d reads; it may change the architecture, so it is not ignored");
    }
  }
}

}  // namespace zero3d::config_detail

namespace zero3d {

GPTShape gpt_shape_of(const ModelConfig& m) {
  GPTShape s{m.vocab_size, m.n_positions, m.n_layer, m.n_head, m.n_embd};
  s.moe = MoeShape{m.moe.num_experts, m.moe.every, m.moe.use_residual, m.moe.enable_expert_tensor_parallelism};
  s.sparse = m.sparse_attention;
  s.family = m.family;
  s.dropout = m.dropout;
  s.make_vocab_size_divisible_by = m.make_vocab_size_divisible_by;
  return s;
}

}  // namespace zero3d
