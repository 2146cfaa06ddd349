// config/precision.cpp — the mixed-precision keys (DEEPSPEED-FACTS §1.4 and §2; DeepSpeed's
// precision_config.py and config.py get_communication_data_type).
#include <cstdlib>

#include "config/section.hpp"

namespace zero3d::config_detail {

namespace {

// fp16.loss_scale as DeepSpeed's validator takes it: a number or a numeric string, finite
// and >= 0 (0 = dynamic); booleans, lists and objects are rejected.
double read_loss_scale(Section& fp16) {
  const json* v = fp16.raw("loss_scale");
  double out = 0.0;
  if (v) {
    if (v->is_boolean()) fp16.fail_key("loss_scale", "must be a number (0 = dynamic scaling), got " + show(*v));
    if (v->is_number()) {
      out = v->get<double>();
    } else if (v->is_string()) {
      const std::string text = v->get<std::string>();
      char* end = nullptr;
      out = std::strtod(text.c_str(), &end);
      if (text.empty() || *end != '\0') fp16.fail_key("loss_scale", "must be a number, got " + show(*v));
    } else {
      fp16.fail_key("loss_scale", "must be a number, got " + show(*v));
    }
    if (!std::isfinite(out) || out < 0.0)
      fp16.fail_key("loss_scale", "must be a finite number >= 0 (0 = dynamic scaling), got " + show(*v));
  }
  fp16.record("loss_scale", out);
  return out;
}

// "fp32" / "fp16" / "bf16" (case-insensitive) or null = `fallback`.
DType read_dtype(Section& s, const std::string& key, DType fallback) {
  const json* v = s.raw(key);
  if (!v || v->is_null()) {
    s.record(key, nullptr);
    return fallback;
  }
  const std::string name = v->is_string() ? lower(v->get<std::string>()) : "";
  DType out;
  if (name == "fp32" || name == "float32" || name == "float") out = DType::F32;
  else if (name == "fp16" || name == "float16" || name == "half") out = DType::F16;
  else if (name == "bf16" || name == "bfloat16") out = DType::BF16;
  else s.fail_key(key, "expected one of \"fp32\", \"fp16\", \"bf16\", got " + show(*v));
  s.record(key, dtype_name(out));
  return out;
}

// "enabled": "auto" as Hugging Face resolves it: from TrainingArguments.fp16 / .bf16, which are
// false unless given on its command line; zero3d has no such flag, so "auto" trains in the
// precision the other section asks for, else fp32 (--set bf16.enabled=true chooses bf16).
// The section's other keys take DeepSpeed's defaults for "auto", as its pydantic model does.
void resolve_auto_enabled(Section& s) {
  s.auto_is_default("DeepSpeed's default: its config model drops \"auto\"");
  if (!s.is_auto("enabled")) return;
  s.substitute("enabled", false);
  s.note("auto    " + s.key_path("enabled") + " = false (Hugging Face's TrainingArguments." +
         (s.key_path("enabled").rfind("fp16", 0) == 0 ? "fp16" : "bf16") +
         " default; --set " + s.key_path("enabled") + "=true to train in it)");
}

// torch_autocast.dtype as DeepSpeed's DtypeEnum spells the two lower precisions; absent or null:
// bf16, torch.autocast's default on the CPU, this build's device.
DType read_autocast_dtype(Section& s) {
  const json* v = s.raw("dtype");
  if (!v || v->is_null()) {
    s.record("dtype", nullptr);
    return DType::BF16;
  }
  const std::string name = v->is_string() ? lower(v->get<std::string>()) : "";
  DType out = DType::F32;
  for (const char* n : {"bf16", "bfloat16", "bfloat", "torch.bfloat16"})
    if (name == n) out = DType::BF16;
  for (const char* n : {"fp16", "float16", "half", "torch.float16"})
    if (name == n) out = DType::F16;
  if (out == DType::F32)
    s.fail_key("dtype", "expected the lower precision torch.autocast runs the products in, \"bfloat16\" or "
                        "\"float16\" (also \"bf16\", \"fp16\", \"torch.bfloat16\", ...), got " + show(*v));
  s.record("dtype", dtype_name(out));
  return out;
}

// lower_precision_safe_modules: module classes as DeepSpeed imports them (package.Class), mapped
// to this model's kinds (autocast.hpp). Classes this model does not have (convolutions) match
// nothing, as in DeepSpeed; a name that is none of these is refused, where DeepSpeed's import
// would fail or silently match nothing.
LowPrecisionModules read_autocast_modules(Section& s) {
  LowPrecisionModules m;
  const json* v = s.raw("lower_precision_safe_modules");
  if (!v || v->is_null()) {  // DeepSpeed's default: [Linear, Conv1d, Conv2d, Conv3d]
    s.record("lower_precision_safe_modules", nullptr);
    return m;
  }
  if (!v->is_array()) s.fail_key("lower_precision_safe_modules", "expected a list of module class names, got " + show(*v));
  m.linear = false;
  const std::vector<std::pair<std::vector<std::string>, bool LowPrecisionModules::*>> kinds = {
      {{"torch.nn.Linear", "torch.nn.modules.linear.Linear", "transformers.pytorch_utils.Conv1D"},
       &LowPrecisionModules::linear},
      {{"torch.nn.Embedding", "torch.nn.modules.sparse.Embedding"}, &LowPrecisionModules::embedding},
      {{"torch.nn.LayerNorm", "torch.nn.modules.normalization.LayerNorm"}, &LowPrecisionModules::layer_norm},
      {{"torch.nn.Conv1d", "torch.nn.Conv2d", "torch.nn.Conv3d", "torch.nn.modules.conv.Conv1d",
        "torch.nn.modules.conv.Conv2d", "torch.nn.modules.conv.Conv3d"},
       nullptr}};
  for (const json& e : *v) {
    bool known = false;
    for (const auto& [names, flag] : kinds)
      for (const std::string& n : names)
        if (e.is_string() && e.get<std::string>() == n) {
          known = true;
          if (flag) m.*flag = true;
        }
    if (!known)
      s.fail_key("lower_precision_safe_modules",
                 "no module class " + show(e) + " in this model; it has torch.nn.Linear (the blocks' projections, "
                 "also named transformers.pytorch_utils.Conv1D), torch.nn.Embedding (wte, wpe) and torch.nn.LayerNorm");
  }
  s.record("lower_precision_safe_modules", *v);
  return m;
}

}  // namespace

PrecisionConfig read_precision(Section& top, const Config& c) {
  PrecisionConfig p;
  Section fp16 = top.child("fp16");
  resolve_auto_enabled(fp16);
  const bool fp16_on = fp16.boolean("enabled", false);
  // auto_cast: DeepSpeed's forward casts the floating-point tensors among the model's inputs to
  // fp16 (engine.py _cast_inputs_half: `inputs.half()` where `inputs.is_floating_point()`).
  // zero3d's model takes integer token ids, which that cast leaves as they are: the keys's
  // meaning here is to change nothing, and the start-up line says so.
  if (fp16.boolean("auto_cast", false))
    fp16.note("note    `fp16.auto_cast` = true: DeepSpeed casts a model's floating-point inputs to fp16; "
              "zero3d's inputs are integer token ids, which it leaves unchanged (engine.py _cast_inputs_half)");
  attempt(fp16.context(), fp16.file(), [&] { p.loss_scale = read_loss_scale(fp16); });
  p.initial_scale_power = static_cast<int>(fp16.integer("initial_scale_power", 16, 0, 1000));
  p.loss_scale_window = fp16.integer("loss_scale_window", 1000, 1, std::numeric_limits<int64_t>::max());
  p.hysteresis = static_cast<int>(fp16.integer("hysteresis", 2, 1, std::numeric_limits<int32_t>::max()));
  p.consecutive_hysteresis = fp16.boolean("consecutive_hysteresis", false);
  p.min_loss_scale = fp16.number("min_loss_scale", 1.0, 0.0, 1e300, /*lo_open=*/true);
  fp16.accept_default_only("fp16_master_weights_and_grads", false);
  fp16.finish();

  // "bfloat16" is DeepSpeed's alias, read only when "bf16" is absent.
  const bool use_alias = !top.has("bf16") && top.has("bfloat16");
  if (!use_alias) top.mark_known("bfloat16");
  Section bf16 = top.child(use_alias ? "bfloat16" : "bf16");
  resolve_auto_enabled(bf16);
  const bool bf16_on = bf16.boolean("enabled", false);
  bf16.boolean("immediate_grad_update", false);  // when gradients are accumulated, not what: same results
  p.check_grad_overflow = bf16.boolean("check_grad_overflow", true);
  // DeepSpeed's ZeRO options for 16-bit master weights (runtime/base_optimizer.py
  // _configure_master_weights): the bf16 parameter partition is the master (no fp32 copy), and
  // with bf16_optimizer_states the moments are bf16 too.
  const bool master16 = bf16.boolean("bf16_master_weights_and_grads", false);
  const bool states16 = bf16.boolean("bf16_optimizer_states", false);
  bf16.finish();
  const std::string where = use_alias ? "bfloat16" : "bf16";
  if (master16 && !bf16_on)
    top.report(where + ".bf16_master_weights_and_grads",
               "keeps the master weights in bf16, which needs " + where + ".enabled true (the model trains in " +
                   (fp16_on ? "fp16" : "fp32") + ")");
  else if (master16 && c.zero.stage == 0)
    top.report(where + ".bf16_master_weights_and_grads",
               "is only supported with ZeRO stage 1, 2 or 3 (as DeepSpeed asserts): set zero_optimization.stage");
  if (states16 && !master16)
    top.report(where + ".bf16_optimizer_states",
               "requires bf16_master_weights_and_grads true (as DeepSpeed asserts): bf16 moments beside fp32 master "
               "weights are not a DeepSpeed mode");
  if (master16 && bf16_on) p.master_weights = DType::BF16;
  if (states16 && master16 && bf16_on) p.optimizer_states = DType::BF16;

  if (fp16_on && bf16_on)
    top.report("bf16.enabled", "fp16 and bf16 are both enabled; enable one of them (DeepSpeed refuses this too)");

  // torch_autocast (seed API docs, "PyTorch Automatic Mixed Precision"): fp32 parameters and
  // optimizer, products in `dtype`, the listed modules' gradients reduced (and at ZeRO-3 their
  // parameters gathered) in it; fp16 adds torch's GradScaler.
  Section autocast = top.child("torch_autocast");
  const bool autocast_on = autocast.boolean("enabled", false);
  DType autocast_dtype = DType::BF16;
  LowPrecisionModules autocast_modules;
  attempt(autocast.context(), autocast.file(), [&] { autocast_dtype = read_autocast_dtype(autocast); });
  attempt(autocast.context(), autocast.file(), [&] { autocast_modules = read_autocast_modules(autocast); });
  autocast.finish();
  if (autocast_on && (fp16_on || bf16_on))
    top.report("torch_autocast.enabled",
               std::string("cannot be combined with ") + (fp16_on ? "fp16" : where) +
                   ".enabled: torch_autocast keeps fp32 parameters and runs the products in its dtype, the " +
                   (fp16_on ? "fp16" : "bf16") + " section makes the parameters 16-bit (DeepSpeed asserts \"Cannot "
                   "enable both torch autocast and " + (fp16_on ? "fp16" : "bfloat16") + "\"); enable one of them");
  else if (autocast_on)
    p.autocast = AutocastConfig{autocast_dtype, autocast_modules};
  p.param = fp16_on ? DType::F16 : bf16_on ? DType::BF16 : DType::F32;
  // engine.py: assert self.dynamic_loss_scale(), "DeepSpeed {} optimizer requires dynamic loss scaling" (Lamb, OneBitLamb)
  if (fp16_on && p.loss_scale > 0.0 &&
      (c.optimizer.type == OptimizerType::Lamb || c.optimizer.type == OptimizerType::OneBitLamb))
    top.report("fp16.loss_scale", c.optimizer.type_name +
                                      " needs dynamic loss scaling in DeepSpeed; set it to 0 or remove it");

  p.comm = p.param;
  attempt(top.context(), top.file(), [&] { p.comm = read_dtype(top, "communication_data_type", p.param); });
  Section types = top.child("data_types");
  p.grad_accum = p.param;
  attempt(top.context(), top.file(), [&] { p.grad_accum = read_dtype(types, "grad_accum_dtype", p.param); });
  if (p.grad_accum != DType::F32 && p.grad_accum != p.param)
    types.report_key("grad_accum_dtype", "gradients accumulate in fp32 or in the model dtype (" + dtype_name(p.param) +
                                           "), not in " + dtype_name(p.grad_accum));
  else if (p.grad_accum == DType::F32 && p.master_weights == DType::BF16)
    types.report_key("grad_accum_dtype", "fp32 gradients contradict " + where +
                                           ".bf16_master_weights_and_grads (bf16 master gradients): remove one");
  types.accept_default_only("param_dtype", nullptr);
  types.accept_default_only("buffer_dtype", nullptr);
  types.finish();
  return p;
}

}  // namespace zero3d::config_detail
