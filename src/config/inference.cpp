// config/inference.cpp — the `inference` section: DeepSpeed's init_inference keys
// (DeepSpeedInferenceConfig, deepspeed/inference/config.py; its aliases too), read with their
// meaning where zero3d generate has one and listed as "no effect on this build" where it has
// none; a wrong type or value is a problem naming the key. Also what generation cannot run
// (generation_refusal), which generate and training.sample_every share.
#include <filesystem>

#include "config/section.hpp"

namespace zero3d {

namespace config_detail {

namespace {

// DeepSpeed's DtypeEnum spellings (its from_str matches them exactly); int8 is MoQ's.
const std::vector<std::pair<std::string, DType>> kDtypeNames = {
    {"fp16", DType::F16},      {"float16", DType::F16},  {"half", DType::F16},   {"torch.float16", DType::F16},
    {"fp32", DType::F32},      {"float32", DType::F32},  {"float", DType::F32},  {"torch.float32", DType::F32},
    {"bf16", DType::BF16},     {"bfloat16", DType::BF16}, {"bfloat", DType::BF16}, {"torch.bfloat16", DType::BF16}};

// The key DeepSpeed's model reads under either name (pydantic's alias): the one given; a
// problem when both are.
std::string given_name(Section& sec, const std::string& name, const std::string& alias) {
  if (sec.has(name) && sec.has(alias))
    sec.report_key(alias, "`" + sec.key_path(name) + "` is given too (two names of one DeepSpeed field); give one");
  return sec.has(alias) && !sec.has(name) ? alias : name;
}

// What a no-effect key's value must be, as DeepSpeed's pydantic model types it.
enum class Kind { Boolean, Integer, String, Object, ObjectOrBoolean, Any };

bool of_kind(const json& v, Kind k) {
  switch (k) {
    case Kind::Boolean: return v.is_boolean();
    case Kind::Integer: return v.is_number_integer();
    case Kind::String: return v.is_string() || v.is_null();
    case Kind::Object: return v.is_object() || v.is_null();
    case Kind::ObjectOrBoolean: return v.is_object() || v.is_boolean();
    case Kind::Any: return true;
  }
  return true;
}

const char* kind_text(Kind k) {
  switch (k) {
    case Kind::Boolean: return "true or false";
    case Kind::Integer: return "an integer";
    case Kind::String: return "a string";
    case Kind::Object: return "an object";
    case Kind::ObjectOrBoolean: return "an object or true/false";
    case Kind::Any: break;
  }
  return "a value";
}

// A key that changes nothing here: its type checked, its value recorded, and unless it is
// `same` (what zero3d does anyway, DeepSpeed's default mostly) "key = value (why)" kept for
// generate's start-up lines (training reads none of this section).
void no_effect(Section& sec, InferenceConfig& inf, const std::string& key, Kind kind, const std::string& why,
               const json& same = json(json::value_t::discarded)) {
  json v;
  if (sec.is_auto(key)) {  // replace_method's default: the generic reader takes "auto" for a derived value
    sec.mark_known(key);
    v = "auto";
  } else if (const json* given = sec.raw(key)) {
    v = *given;
  } else {
    return;
  }
  if (!of_kind(v, kind)) sec.fail_key(key, std::string("expected ") + kind_text(kind) + ", got " + show(v));
  sec.record(key, v);
  if (v != same) inf.no_effect.push_back("`" + sec.key_path(key) + "` = " + show(v) + " (" + why + ")");
}

void read_checkpoint_keys(Section& sec, InferenceConfig& inf) {
  const json* ck = sec.raw("checkpoint");
  std::string base = sec.path("base_dir", "");
  Section cc = sec.child(given_name(sec, "checkpoint_config", "ckpt_config"));
  std::string dir = cc.path("checkpoint_dir", "");
  if (base.empty()) base = cc.path("base_dir", "");
  else cc.mark_known("base_dir");
  no_effect(cc, inf, "save_mp_checkpoint_path", Kind::String,
            "zero3d's checkpoints load at any tensor-parallel size: there is no resharded copy to save", nullptr);
  cc.finish();
  if (ck && !ck->is_null()) {
    if (ck->is_object())
      sec.fail_key("checkpoint", "a checkpoint description (DeepSpeed's load policy for Megatron or BLOOM shards): "
                                 "zero3d generate loads zero3d checkpoints; give a save or tag directory");
    if (!ck->is_string()) sec.fail_key("checkpoint", "expected a path (a save or tag directory), got " + show(*ck));
    dir = ck->get<std::string>();
    if (find_control_byte(dir) != std::string::npos)
      sec.fail_key("checkpoint", "path " + show(*ck) + " contains a control byte");
    sec.record("checkpoint", dir);
  }
  // base_dir: the root the checkpoint's relative path starts from (InferenceEngine's base_dir).
  if (!dir.empty()) inf.checkpoint = base.empty() || dir[0] == '/' ? dir : (std::filesystem::path(base) / dir).string();
}

}  // namespace

InferenceConfig read_inference(Section& top) {
  InferenceConfig inf;
  if (!top.has("inference")) return inf;  // nothing of it in the resolved config either
  inf.given = true;
  Section sec = top.child("inference");

  if (const json* v = sec.raw("dtype")) {
    const std::string name = v->is_string() ? v->get<std::string>() : "";
    if (name == "int8" || name == "torch.int8")
      sec.fail_key("dtype", "value " + show(*v) + ": int8 is DeepSpeed's quantized inference (MoQ); zero3d has no int8 "
                            "kernels; give \"fp32\", \"fp16\" or \"bf16\"");
    for (const auto& [n, t] : kDtypeNames)
      if (n == name) inf.dtype = t;
    if (!inf.dtype)
      sec.fail_key("dtype", "expected one of \"fp32\", \"fp16\", \"bf16\" (or DeepSpeed's other names: \"float\", "
                            "\"half\", \"bfloat16\", \"torch.float16\", ...), got " + show(*v));
    sec.record("dtype", dtype_name(*inf.dtype));
  }

  // Tensor ranks: tensor_parallel.tp_size, or mp_size (deprecated in DeepSpeed for it).
  {
    Section tp = sec.child(given_name(sec, "tensor_parallel", "tp"));
    const bool enabled = tp.boolean("enabled", true);
    const int64_t size = tp.integer("tp_size", 1, 1, 1 << 16);
    no_effect(tp, inf, "mpu", Kind::Any, "a Python object of DeepSpeed's; zero3d builds its tensor groups itself");
    no_effect(tp, inf, "tp_group", Kind::Any, "a Python object of DeepSpeed's; zero3d builds its tensor groups itself");
    tp.finish();
    if (sec.has("tensor_parallel") || sec.has("tp")) inf.tp_size = enabled ? size : 1;
    if (sec.has("mp_size")) {
      const int64_t mp = sec.integer("mp_size", 1, 1, 1 << 16);
      if (inf.tp_size > 0 && mp != inf.tp_size)
        sec.report_key("mp_size", "value " + std::to_string(mp) + " differs from `inference.tensor_parallel.tp_size` (" +
                                      std::to_string(inf.tp_size) + "); mp_size is its deprecated name: give one");
      inf.tp_size = mp;
    }
  }

  const std::string max_key = given_name(sec, "max_out_tokens", "max_tokens");
  if (sec.has(max_key)) inf.max_out_tokens = sec.integer(max_key, 1024, 1, int64_t(1) << 30);
  const std::string min_key = given_name(sec, "min_out_tokens", "min_tokens");
  if (sec.has(min_key)) inf.min_out_tokens = sec.integer(min_key, 1, 1, int64_t(1) << 30);
  if (inf.max_out_tokens > 0 && inf.min_out_tokens > inf.max_out_tokens)
    sec.report_key(min_key, "value " + std::to_string(inf.min_out_tokens) + " exceeds `inference." + max_key + "` (" +
                                std::to_string(inf.max_out_tokens) + "), which counts the prompt's tokens too");

  read_checkpoint_keys(sec, inf);

  if (sec.has("zero")) {  // ZeRO-Inference: stage 3 partitions the weights (gathered per layer, as evaluation)
    Section z = sec.child("zero");
    inf.zero_stage = static_cast<int>(z.integer("stage", 0, 0, 3));
    z.finish();
  }

  const std::string tm = given_name(sec, "triangular_masking", "tm");
  if (!sec.boolean(tm, true))
    sec.report_key(tm, "false: zero3d's models are causal language models; generation needs the triangular mask");

  const std::string kernels = "zero3d runs its own kernels; there are no DeepSpeed inference kernels to inject";
  no_effect(sec, inf, given_name(sec, "replace_with_kernel_inject", "kernel_inject"), Kind::Boolean, kernels, false);
  no_effect(sec, inf, "replace_method", Kind::String, "deprecated in DeepSpeed; " + kernels, "auto");
  no_effect(sec, inf, given_name(sec, "injection_policy", "injection_dict"), Kind::Object,
            "zero3d splits every block over the tensor group as Megatron does (tensor_parallel)", nullptr);
  no_effect(sec, inf, "injection_policy_tuple", Kind::Any, "zero3d splits every block as Megatron does", nullptr);
  no_effect(sec, inf, "enable_cuda_graph", Kind::Boolean, "a decode step launches its kernels each step", false);
  no_effect(sec, inf, "use_triton", Kind::Boolean, "zero3d's kernels are Kokkos ones, not Triton", false);
  no_effect(sec, inf, "triton_autotune", Kind::Boolean, "zero3d's kernels are Kokkos ones, not Triton", false);
  no_effect(sec, inf, "quant", Kind::Object, "quantization applies to dtype int8, which zero3d does not run");
  no_effect(sec, inf, "moe", Kind::ObjectOrBoolean, "the model config says which blocks are MoE (model.moe)");
  for (const char* key : {"ep_size", "moe_experts", "moe_type"})
    no_effect(sec, inf, key, Kind::Any, "the model config says which blocks are MoE (model.moe)");
  for (const char* key : {"mpu", "ep_group", "expert_group", "ep_mp_group", "expert_mp_group"})
    no_effect(sec, inf, key, Kind::Any, "a Python object of DeepSpeed's; zero3d builds its groups itself");
  no_effect(sec, inf, "training_mp_size", Kind::Integer, "a zero3d checkpoint loads at any tensor-parallel size", 1);
  no_effect(sec, inf, "return_tuple", Kind::Boolean, "what DeepSpeed's injected layers return to PyTorch", true);
  no_effect(sec, inf, "set_empty_params", Kind::Boolean, "how DeepSpeed builds the PyTorch module", false);
  no_effect(sec, inf, "transposed_mode", Kind::Boolean, "a layout of DeepSpeed's injected kernels", false);
  no_effect(sec, inf, "tp_grain_size", Kind::Integer, "zero3d splits heads and the MLP evenly");
  no_effect(sec, inf, "save_mp_checkpoint_path", Kind::String,
            "zero3d's checkpoints load at any tensor-parallel size: there is no resharded copy to save", nullptr);
  no_effect(sec, inf, given_name(sec, "config", "args"), Kind::Object, "the model comes from this config's `model`");
  sec.finish();
  return inf;
}

}  // namespace config_detail

std::string generation_refusal(const Config& c) {
  if (c.model.moe.num_experts > 0)
    return "`moe`: zero3d generate's decoder runs dense blocks; this model routes tokens to experts";
  if (c.model.sparse_attention.enabled)
    return "`sparse_attention`: zero3d generate's KV-cache attention is dense; this model was trained with "
           "block-sparse attention layouts";
  return "";
}

nlohmann::json with_inference_layout(const nlohmann::json& root, const InferenceConfig& inf) {
  nlohmann::json out = root;
  if (inf.dtype) {
    out["bf16"]["enabled"] = *inf.dtype == DType::BF16;
    out["fp16"]["enabled"] = *inf.dtype == DType::F16;
  }
  if (inf.tp_size > 0) {
    out["tensor_parallel"]["autotp_size"] = inf.tp_size;
    if (out["tensor_parallel"].contains("tp")) out["tensor_parallel"].erase("tp");  // the training degree's other name
  }
  if (inf.zero_stage >= 0) out["zero_optimization"]["stage"] = inf.zero_stage;
  return out;
}

}  // namespace zero3d
