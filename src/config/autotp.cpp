// config/autotp.cpp — DeepSpeed's AutoTP rules, `tensor_parallel.preset_model` and
// `tensor_parallel.partition_config`, checked against the split zero3d makes.
//
// DeepSpeed's meaning (deepspeed/runtime/tensor_parallel/config.py TPTrainingConfig
// .get_partition_config_object, deepspeed/module_inject/autotp_config.py, auto_tp.py):
// - preset_model names AutoTPPresets.get_preset(name.lower()): llama, bloom, chatglm, mixtral,
//   deepseek_v2, qwen2, phi3 (an unknown name gives None there, i.e. no rules at all; zero3d
//   names it instead). llama's and qwen2's rules are the same four specs:
//   `.*\.self_attn\.o_proj\.weight$` row, `.*\.self_attn\.[qkv]_proj\.weight$` column,
//   `.*\.mlp\.down_proj\.weight$` row, `.*\.mlp\.(up|gate)_proj\.weight$` column.
//   DeepSpeed has no mistral preset; zero3d's "mistral" is the llama rules on a Mistral.
//   mixtral (MODEL-FAMILIES.md §1): q/k/v_proj and block_sparse_moe.experts.N.w1/w3 column,
//   o_proj and experts.N.w2 row, block_sparse_moe.gate skip.
// - partition_config is AutoTPConfig.from_dict: layer_specs (each TPLayerSpec: patterns,
//   partition_type "column" (default) | "row" | "skip", lower-cased; shape; partition_dim;
//   model_types; gather_output; grad_allreduce), use_default_specs (true), strict_mode (false),
//   embedding_partition_dim (1), lm_head_patterns, tp_size (replaced by autotp_size). With a
//   preset and use_default_specs the specs are merge_autotp_configs(preset, custom): the custom
//   specs first, then the preset's; otherwise the custom specs alone.
// - A parameter's rule is the first spec that matches it (find_matching_spec): model_types, when
//   given, must hold the model's model_type (lower-cased), and one of the patterns must match
//   the name from its start (Python's re.match; `$` anchors the end). Specs are matched against
//   `<module>.weight` of every Linear (a 2-D weight) and every nn.Embedding.
// - A Linear with no rule is left whole (strict_mode: an error); "skip" leaves it whole; "column"
//   splits the output rows (LinearLayer), "row" the input columns (LinearAllreduce); with a
//   `shape` the weight is viewed as that logical shape (one -1 inferred, the last dim the
//   input) and split along partition_dim (default 0 for column, 1 for row), each sub-parameter
//   (an integer n there: n equal ones; a list: their sizes) split over the ranks separately,
//   a rank's pieces concatenated (layers.py _infer_subparam_logical_shapes,
//   _partition_logical_tensor). An embedding with a non-skip rule is split along its hidden
//   dimension (auto_tp.py _slice_embedding, dim 1 whatever the spec says).
//
// zero3d's split is fixed by the architecture (model_layout.cpp): q/k/v_proj and gate/up_proj
// column-parallel in contiguous row blocks (whole K/V-head groups), o_proj and down_proj
// row-parallel in contiguous column blocks, embed_tokens and lm_head vocab-parallel. A rule
// set is accepted when it asks for exactly that split of every projection; the embedding and
// the head take no rule, "skip" or (the head) a plain column split, since zero3d's
// vocab-parallel pair computes what a replicated one computes. Anything else is an error naming
// the spec and the parameter.
#include <algorithm>
#include <cctype>
#include <optional>
#include <regex>

#include "config/model_shape.hpp"
#include "config/section.hpp"

namespace zero3d::config_detail {

namespace {

enum class Split { Column, Row, Skip };
const char* split_name(Split s) { return s == Split::Column ? "column" : s == Split::Row ? "row" : "skip"; }

// One dimension of a TPLayerSpec shape: a size (-1: inferred), or at partition_dim a list of
// unequal sub-parameter sizes.
struct ShapeDim {
  bool nested = false;
  std::vector<int64_t> sizes;  // one value unless nested
};

struct LayerSpec {
  std::string where;  // its key path, for messages
  std::vector<std::string> patterns;
  std::vector<std::regex> regexes;
  Split split = Split::Column;
  std::vector<ShapeDim> shape;  // empty: none
  std::optional<int64_t> partition_dim;
  std::vector<std::string> model_types;  // empty: every model
  bool gather_output = false;
  bool from_preset = false;

  int64_t dim() const { return partition_dim ? *partition_dim : split == Split::Column ? 0 : 1; }
  bool applies_to(const std::string& model_type) const {
    if (model_types.empty()) return true;
    for (const std::string& t : model_types) {
      std::string lower = t;
      for (char& c : lower) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
      if (lower == model_type) return true;
    }
    return false;
  }
  bool matches(const std::string& name) const {
    for (const std::regex& r : regexes)
      if (std::regex_search(name, r, std::regex_constants::match_continuous)) return true;
    return false;
  }
  std::string label() const {
    std::string p;
    for (const std::string& s : patterns) p += (p.empty() ? "" : ", ") + show(json(s));
    return "`" + where + "` (patterns " + p + ")";
  }
};

// AutoTPPresets.llama() / qwen2() (autotp_config.py): the same four specs; mixtral() its five.
std::vector<LayerSpec> llama_preset(const std::string& name) {
  const std::vector<std::pair<std::string, Split>> rules =
      name == "mixtral"
          ? std::vector<std::pair<std::string, Split>>{{R"(.*\.self_attn\.o_proj\.weight$)", Split::Row},
                                                       {R"(.*\.self_attn\.[qkv]_proj\.weight$)", Split::Column},
                                                       {R"(.*\.block_sparse_moe\.experts\.\d+\.w2\.weight$)", Split::Row},
                                                       {R"(.*\.block_sparse_moe\.experts\.\d+\.w[13]\.weight$)", Split::Column},
                                                       {R"(.*\.block_sparse_moe\.gate\.weight$)", Split::Skip}}
          : std::vector<std::pair<std::string, Split>>{{R"(.*\.self_attn\.o_proj\.weight$)", Split::Row},
                                                       {R"(.*\.self_attn\.[qkv]_proj\.weight$)", Split::Column},
                                                       {R"(.*\.mlp\.down_proj\.weight$)", Split::Row},
                                                       {R"(.*\.mlp\.(up|gate)_proj\.weight$)", Split::Column}};
  std::vector<LayerSpec> out;
  for (size_t i = 0; i < rules.size(); ++i) {
    LayerSpec s;
    s.where = "tensor_parallel.preset_model " + name + " rule " + std::to_string(i);
    s.patterns = {rules[i].first};
    s.regexes = {std::regex(rules[i].first, std::regex::ECMAScript)};
    s.split = rules[i].second;
    s.from_preset = true;
    out.push_back(std::move(s));
  }
  return out;
}

// A parameter AutoTP would see: a Linear's or the embedding's weight, and zero3d's split of it.
struct Candidate {
  std::string name;
  int64_t rows = 0, cols = 0;  // [out, in]
  enum Kind { Embedding, Head, Projection } kind = Projection;
  Split zero3d = Split::Column;  // projections: column (q/k/v, gate/up) or row (o, down); skip: Mixtral's router
};

std::vector<Candidate> candidates_of(const ModelConfig& m) {
  const GPTShape s = gpt_shape_of(m);  // Mixtral's router and experts included
  std::vector<Candidate> out;
  out.push_back({"model.embed_tokens.weight", m.vocab_size, m.n_embd, Candidate::Embedding, Split::Column});
  const ParamLayout layout = gpt_layout(s);
  const auto has = [](const std::string& name, const char* part) { return name.find(part) != std::string::npos; };
  for (const TensorSpec& t : layout.tensors()) {
    if (t.shape.size() != 2 || t.name.rfind("model.layers.", 0) != 0) continue;
    const bool row = has(t.name, "o_proj.weight") || has(t.name, "down_proj.weight") || has(t.name, ".w2.weight");
    // every tensor rank routes the same tokens: the router stays whole
    const Split split = has(t.name, "block_sparse_moe.gate.") ? Split::Skip : row ? Split::Row : Split::Column;
    out.push_back({t.name, t.shape[0], t.shape[1], Candidate::Projection, split});
  }
  // LlamaForCausalLM always has its lm_head Linear; tied, its weight is the embedding's matrix
  out.push_back({"lm_head.weight", m.vocab_size, m.n_embd, Candidate::Head, Split::Column});
  return out;
}

// Reads layer_specs[i] (TPLayerSpec, DeepSpeed's from_dict and __post_init__ checks).
std::optional<LayerSpec> read_spec(Section& spec, const std::string& where) {
  LayerSpec s;
  s.where = where;
  const json* patterns = spec.raw("patterns");
  if (!patterns || !patterns->is_array() || patterns->empty()) {
    spec.report_key("patterns", "expected a non-empty list of regular expressions over Hugging Face parameter names, got " +
                                    (patterns ? show(*patterns) : std::string("none")));
    spec.finish();
    return std::nullopt;
  }
  bool ok = true;
  for (const json& p : *patterns) {
    if (!p.is_string()) {
      spec.report_key("patterns", "expected strings, got " + show(p));
      ok = false;
      continue;
    }
    try {
      s.regexes.emplace_back(p.get<std::string>(), std::regex::ECMAScript);
      s.patterns.push_back(p.get<std::string>());
    } catch (const std::regex_error& e) {
      spec.report_key("patterns", show(p) + " is not a regular expression zero3d can read (" + e.what() + ")");
      ok = false;
    }
  }
  spec.record("patterns", *patterns);
  // PartitionType(partition_type.lower())
  const json* type = spec.raw("partition_type");
  std::string t = "column";
  if (type) {
    if (!type->is_string()) {
      spec.report_key("partition_type", "expected \"column\", \"row\" or \"skip\", got " + show(*type));
      ok = false;
    } else {
      t = type->get<std::string>();
      for (char& c : t) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
      if (t != "column" && t != "row" && t != "skip") {
        spec.report_key("partition_type", "value " + show(*type) + ": expected \"column\", \"row\" or \"skip\"");
        ok = false;
      }
    }
  }
  spec.record("partition_type", t);
  s.split = t == "row" ? Split::Row : t == "skip" ? Split::Skip : Split::Column;
  if (spec.has("partition_dim") && !spec.raw("partition_dim")->is_null())
    s.partition_dim = spec.integer("partition_dim", 0, 0, 16);
  else
    spec.mark_known("partition_dim");
  if (const json* shape = spec.raw("shape"); shape && !shape->is_null()) {
    spec.record("shape", *shape);
    const int64_t dim = s.dim();
    bool good = shape->is_array() && !shape->empty() && dim < static_cast<int64_t>(shape->size());
    for (size_t i = 0; good && i < shape->size(); ++i) {
      const json& d = (*shape)[i];
      ShapeDim sd;
      if (d.is_array()) {  // unequal sub-parameters: only at partition_dim, positive sizes
        sd.nested = true;
        good = static_cast<int64_t>(i) == dim && !d.empty();
        for (const json& v : d) {
          good = good && v.is_number_integer() && v.get<int64_t>() > 0;
          if (good) sd.sizes.push_back(v.get<int64_t>());
        }
      } else {
        good = d.is_number_integer() && (d.get<int64_t>() > 0 || d.get<int64_t>() == -1);
        if (good) sd.sizes.push_back(d.get<int64_t>());
      }
      s.shape.push_back(sd);
    }
    if (!good) {
      spec.report_key("shape", "value " + show(*shape) + ": expected a list of positive sizes or -1 (inferred), with "
                               "at most a list of sub-parameter sizes at partition_dim " + std::to_string(dim) +
                               " (DeepSpeed's TPLayerSpec._validate_shape_format)");
      ok = false;
      s.shape.clear();
    }
  } else if (s.partition_dim && *s.partition_dim != (s.split == Split::Column ? 0 : 1)) {
    // LinearLayer and LinearAllreduce ignore partition_dim: only a shape reads it
    spec.report_key("partition_dim", "value " + std::to_string(*s.partition_dim) + " without a shape: DeepSpeed splits a " +
                                         split_name(s.split) + " layer along dim " +
                                         (s.split == Split::Column ? "0" : "1") + " and reads partition_dim only with `shape`");
    ok = false;
  }
  if (const json* types = spec.raw("model_types"); types && !types->is_null()) {
    bool good = types->is_array();
    for (const json& v : good ? *types : json::array()) {
      good = good && v.is_string();
      if (good) s.model_types.push_back(v.get<std::string>());
    }
    if (!good) {
      spec.report_key("model_types", "expected a list of Hugging Face model_type names, got " + show(*types));
      ok = false;
    }
    spec.record("model_types", *types);
  }
  s.gather_output = spec.boolean("gather_output", false);
  if (spec.boolean("grad_allreduce", false)) {
    spec.report_key("grad_allreduce", "sums a replicated parameter's gradients over the tensor-parallel group (for "
                                      "parameters applied to split activations, as Qwen3's q_norm); zero3d's Llama "
                                      "family has none, its replicated RMSNorm weights already get the whole gradient");
    ok = false;
  }
  spec.finish();
  if (!ok) return std::nullopt;
  return s;
}

// Which rank holds each row (axis 0) or column (axis 1) of a [rows, cols] weight under `s` with
// t ranks, as DeepSpeed splits it; an empty result and *why when it cannot split it evenly.
// `axis` receives which axis the split runs along.
std::vector<int64_t> deepspeed_owners(const LayerSpec& s, int64_t rows, int64_t cols, int64_t t, int* axis,
                                      std::string* why) {
  if (s.shape.empty()) {  // LinearLayer splits the output rows, LinearAllreduce the input columns
    *axis = s.split == Split::Column ? 0 : 1;
    const int64_t n = *axis == 0 ? rows : cols;
    if (n % t != 0) {
      *why = std::to_string(n) + " " + (*axis == 0 ? "rows" : "columns") + " do not split evenly over " + std::to_string(t) + " ranks";
      return {};
    }
    std::vector<int64_t> owner(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) owner[static_cast<size_t>(i)] = i / (n / t);
    return owner;
  }
  // _infer_subparam_logical_shapes: the logical shape, its one -1 inferred
  const int64_t p = s.dim(), k = static_cast<int64_t>(s.shape.size());
  std::vector<int64_t> dims(static_cast<size_t>(k), -1);
  int64_t known = 1, unknown = -1;
  for (int64_t i = 0; i < k; ++i) {
    const ShapeDim& d = s.shape[static_cast<size_t>(i)];
    int64_t v = d.nested ? 0 : d.sizes[0];
    if (d.nested)
      for (int64_t x : d.sizes) v += x;
    if (i == p && !d.nested) v = -1;  // an integer there counts sub-parameters, not the size
    if (v == -1) {
      if (unknown >= 0) {
        if (k != 2) {
          *why = "its shape has more than one inferred dimension";
          return {};
        }
        dims[0] = rows, dims[1] = cols;  // the weight's own dims fill both
        known = rows * cols;
        unknown = -2;
        break;
      }
      unknown = i;
    } else {
      dims[static_cast<size_t>(i)] = v;
      known *= v;
    }
  }
  if (unknown >= 0) {
    if (known <= 0 || (rows * cols) % known != 0) {
      *why = "its shape does not divide the weight's " + std::to_string(rows * cols) + " elements";
      return {};
    }
    dims[static_cast<size_t>(unknown)] = rows * cols / known;
  }
  int64_t out = 1, all = 1;
  for (int64_t i = 0; i < k; ++i) all *= dims[static_cast<size_t>(i)];
  for (int64_t i = 0; i + 1 < k; ++i) out *= dims[static_cast<size_t>(i)];
  if (k < 2 || all != rows * cols || dims.back() != cols || out != rows) {
    *why = "its shape " + json(dims).dump() + " is not the weight's [" + std::to_string(rows) + ", " + std::to_string(cols) +
           "] (the last dimension must be the input)";
    return {};
  }
  // the sub-parameters along p, each split over the ranks
  const ShapeDim& d = s.shape[static_cast<size_t>(p)];
  const int64_t along = dims[static_cast<size_t>(p)];
  std::vector<int64_t> subs = d.nested ? d.sizes : std::vector<int64_t>();
  if (!d.nested) {
    const int64_t n = d.sizes[0] > 0 ? d.sizes[0] : 1;
    if (along % n != 0) {
      *why = "dimension " + std::to_string(p) + " (" + std::to_string(along) + ") does not split into " + std::to_string(n) +
             " sub-parameters";
      return {};
    }
    subs.assign(static_cast<size_t>(n), along / n);
  }
  std::vector<int64_t> owner_along;
  for (int64_t sub : subs) {
    if (sub % t != 0) {
      *why = "a sub-parameter of " + std::to_string(sub) + " does not split evenly over " + std::to_string(t) + " ranks";
      return {};
    }
    for (int64_t i = 0; i < sub; ++i) owner_along.push_back(i / (sub / t));
  }
  if (p == k - 1) {  // along the input: owner by column
    *axis = 1;
    return owner_along;
  }
  *axis = 0;  // along an output dimension: owner by row (rows unravel row-major over the output dims)
  int64_t inner = 1;
  for (int64_t i = p + 1; i + 1 < k; ++i) inner *= dims[static_cast<size_t>(i)];
  std::vector<int64_t> owner(static_cast<size_t>(rows));
  for (int64_t r = 0; r < rows; ++r) owner[static_cast<size_t>(r)] = owner_along[static_cast<size_t>((r / inner) % along)];
  return owner;
}

// Why `spec` splits `c` other than zero3d does at t ranks ("" when it agrees).
std::string disagreement(const LayerSpec& spec, const Candidate& c, int64_t t) {
  const std::string ours =
      c.kind == Candidate::Embedding ? "zero3d's embedding is vocab-parallel (rows over the ranks)"
      : c.kind == Candidate::Head    ? "zero3d's head is vocab-parallel (column-parallel: rows over the ranks)"
      : c.zero3d == Split::Column    ? "zero3d splits it column-parallel (output rows in contiguous blocks: whole K/V-head groups)"
      : c.zero3d == Split::Row       ? "zero3d splits it row-parallel (input columns in contiguous blocks)"
                                     : "zero3d keeps the router whole on every rank (each tensor rank routes every token)";
  if ((c.kind != Candidate::Projection || c.zero3d == Split::Skip) && spec.split == Split::Skip) return "";  // left whole: computes the same
  if (c.zero3d == Split::Skip) return "partition_type \"" + std::string(split_name(spec.split)) + "\"; " + ours;
  if (c.kind == Candidate::Embedding)
    return "DeepSpeed splits an embedding along its hidden dimension (auto_tp.py _slice_embedding, dim 1); " + ours;
  if (spec.split == Split::Skip) return "\"skip\" keeps it whole on every rank; " + ours;
  if (spec.split != c.zero3d) return "partition_type \"" + std::string(split_name(spec.split)) + "\"; " + ours;
  if (spec.gather_output) return "gather_output gives every rank the whole output; " + ours + ", output split";
  if (c.kind == Candidate::Head && spec.shape.empty()) return "";  // vocab rows in order (zero3d pads a remainder)
  const int64_t ranks = std::max<int64_t>(t, 1);
  // a size t does not divide is autotp_size's own problem (read_tensor_parallel names it)
  if (c.kind == Candidate::Projection && (c.zero3d == Split::Column ? c.rows : c.cols) % ranks != 0) return "";
  int axis = 0;
  std::string why;
  const std::vector<int64_t> theirs = deepspeed_owners(spec, c.rows, c.cols, ranks, &axis, &why);
  if (theirs.empty()) return why + "; " + ours;
  const int want_axis = c.zero3d == Split::Column ? 0 : 1;
  if (axis != want_axis) return std::string("its shape splits the ") + (axis == 0 ? "output rows" : "input columns") + "; " + ours;
  const int64_t n = want_axis == 0 ? c.rows : c.cols;
  const int64_t padded = (n + ranks - 1) / ranks * ranks;  // the head's vocabulary, padded to t
  for (int64_t i = 0; i < n; ++i)
    if (theirs[static_cast<size_t>(i)] != i / (padded / ranks))
      return "its shape gives " + std::string(want_axis == 0 ? "row " : "column ") + std::to_string(i) + " to rank " +
             std::to_string(theirs[static_cast<size_t>(i)]) + ", zero3d to rank " + std::to_string(i / (padded / ranks)) + "; " + ours;
  return "";
}

}  // namespace

void read_autotp_rules(Section& tp, const ModelConfig& m, TensorParallelConfig& t) {
  const std::vector<std::string> deepspeed_presets = {"llama", "bloom", "chatglm", "mixtral", "deepseek_v2", "qwen2", "phi3"};
  const std::string arch = architecture_name(m.family.arch);
  tp.mark_known("preset_model");  // a problem with one must not make the other "unknown"
  tp.mark_known("partition_config");
  std::vector<LayerSpec> preset;
  if (const json* v = tp.raw("preset_model"); v && !v->is_null()) {
    tp.record("preset_model", *v);
    if (!v->is_string()) tp.fail_key("preset_model", "expected a preset name (llama, mistral, qwen2, mixtral), got " + show(*v));
    std::string name = v->get<std::string>();
    for (char& c : name) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));  // get_preset lower-cases
    const bool deepspeed = std::find(deepspeed_presets.begin(), deepspeed_presets.end(), name) != deepspeed_presets.end();
    if (name != "llama" && name != "mistral" && name != "qwen2" && name != "mixtral")
      tp.fail_key("preset_model", "value " + show(*v) +
                                      (deepspeed ? ": DeepSpeed's AutoTP preset for a family zero3d does not train"
                                                 : ": not an AutoTP preset (DeepSpeed's are llama, bloom, chatglm, mixtral, "
                                                   "deepseek_v2, qwen2, phi3)") +
                                      "; zero3d trains llama, mistral, qwen2 and mixtral (mistral: the llama rules)");
    if (!m.family.llama())
      tp.fail_key("preset_model", "value " + show(*v) + ": model.architecture is gpt2, which AutoTP does not support "
                                                          "(DeepSpeed's AutoTP tutorial lists gpt2 as unsupported); zero3d "
                                                          "splits GPT-2 Megatron's way and takes no preset");
    if (name != arch)
      tp.fail_key("preset_model", "value " + show(*v) + " does not match model.architecture " + show(json(arch)) +
                                      "; use preset_model " + show(json(arch)));
    t.preset_model = name;
    preset = llama_preset(name);
  } else {
    tp.mark_known("preset_model");
  }
  const json* given = tp.raw("partition_config");
  if (!given || given->is_null()) {
    if (preset.empty()) return;
  } else if (!m.family.llama()) {
    tp.fail_key("partition_config", "AutoTP rules over Hugging Face parameter names apply to the Llama family "
                                    "(model.architecture llama, mistral, qwen2, mixtral); model.architecture is gpt2, which zero3d "
                                    "splits Megatron's way (DeepSpeed's AutoTP does not support gpt2)");
  }
  std::vector<LayerSpec> custom;
  bool use_default_specs = true, strict_mode = false, specs_ok = true;
  if (given && !given->is_null()) {
    Section pc = tp.child("partition_config");
    if (!given->is_object()) throw KeyProblem{};  // reported by the Section
    use_default_specs = pc.boolean("use_default_specs", true);
    strict_mode = pc.boolean("strict_mode", false);
    pc.accept_default_only("embedding_partition_dim", 1);
    pc.accept_default_only("lm_head_patterns", json::array({"lm_head", "embed_out"}));
    const int64_t tp_size = pc.integer("tp_size", 1, 0, 1 << 16);  // get_partition_config_object sets autotp_size
    if (tp_size > 1 && tp_size != t.size)
      pc.report_key("tp_size", "value " + std::to_string(tp_size) + " differs from tensor_parallel.autotp_size (" +
                                   std::to_string(t.size) + ")");
    const json* specs = pc.raw("layer_specs");
    if (specs && !specs->is_array()) {
      pc.report_key("layer_specs", "expected a list of layer specs, got " + show(*specs));
      specs_ok = false;
    }
    json resolved_specs = json::array();
    for (size_t i = 0; specs && specs->is_array() && i < specs->size(); ++i) {
      json resolved = json::object();
      const std::string where = pc.key_path("layer_specs") + "[" + std::to_string(i) + "]";
      Section spec(&(*specs)[i], where, tp.file(), &resolved, &tp.context());
      std::optional<LayerSpec> s = (*specs)[i].is_object() ? read_spec(spec, where) : std::nullopt;
      if (s) custom.push_back(std::move(*s));
      else specs_ok = false;
      resolved_specs.push_back(resolved);
    }
    pc.record("layer_specs", resolved_specs);
    pc.finish();
    if (!specs_ok) return;  // each problem is reported; matching half a rule set would only add noise
  }
  // merge_autotp_configs: the custom specs first, then the preset's
  std::vector<LayerSpec> rules = custom;
  if (given && !given->is_null() && !(use_default_specs && !preset.empty())) preset.clear();
  rules.insert(rules.end(), preset.begin(), preset.end());
  const std::vector<Candidate> weights = candidates_of(m);
  const std::string key = given && !given->is_null() ? "partition_config" : "preset_model";
  std::vector<std::string> unruled;
  for (const LayerSpec& spec : rules) {
    if (!spec.applies_to(arch)) {
      tp.note("autotp  " + spec.label() + " applies to model_types " + json(spec.model_types).dump() + ", not " + arch +
              ": not used");
      continue;
    }
    bool any = false;
    for (const Candidate& c : weights) any = any || spec.matches(c.name);
    if (!any)
      tp.report(spec.where, "patterns " + json(spec.patterns).dump() + " match no parameter AutoTP splits in this " + arch +
                                " model (its Linear weights and embedding, e.g. " + weights[1].name + ")");
  }
  for (const Candidate& c : weights) {
    const LayerSpec* rule = nullptr;
    for (const LayerSpec& spec : rules)
      if (spec.applies_to(arch) && spec.matches(c.name)) {
        rule = &spec;
        break;
      }
    if (!rule) {  // AutoTP leaves it whole; zero3d splits every projection, and the pair computes the same
      if (c.kind == Candidate::Projection && c.zero3d != Split::Skip) unruled.push_back(c.name);
      if (c.kind == Candidate::Head && strict_mode)
        tp.report_key(key, "lm_head.weight matches no layer spec and strict_mode is true (DeepSpeed: \"No matching spec\")");
      continue;
    }
    const std::string why = disagreement(*rule, c, t.size);
    if (!why.empty()) {
      tp.report(rule->where, "asks for a split of " + c.name + " zero3d cannot make: " + why);
      return;  // the same spec would say so for every layer
    }
  }
  if (!unruled.empty()) {
    std::string names;
    for (size_t i = 0; i < unruled.size() && i < 3; ++i) names += (i ? ", " : "") + unruled[i];
    tp.report_key(key, std::to_string(unruled.size()) + " weight" + (unruled.size() > 1 ? "s have" : " has") +
                           " no rule (" + names + (unruled.size() > 3 ? ", ..." : "") + ")" +
                           (given && !given->is_null() && !use_default_specs && !t.preset_model.empty()
                                ? " with use_default_specs false"
                                : "") +
                           ": AutoTP would leave them whole, zero3d splits every projection (q/k/v, gate/up "
                           "column-parallel, o/down row-parallel); add layer specs for them");
    return;
  }
  const std::string mlp = m.family.mixtral() ? "each expert's w1/w3 column-parallel, o_proj and w2 row-parallel, the router whole"
                                              : "gate/up_proj column-parallel, o_proj and down_proj row-parallel";
  tp.note("autotp  tensor_parallel." + key + ": the rules agree with zero3d's split of this " + arch +
          " model (q/k/v_proj by whole K/V-head groups and " + mlp + ", embed_tokens and lm_head vocab-parallel)" +
          (t.size <= 1 ? std::string("; autotp_size is ") + std::to_string(t.size) + ", so nothing is split" : std::string()));
}

}  // namespace zero3d::config_detail
