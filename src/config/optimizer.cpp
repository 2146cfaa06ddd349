// config/optimizer.cpp — the `optimizer` and `scheduler` sections and gradient_clipping, with
// Hugging Face's "auto" values for them.
#include <algorithm>
#include <limits>
#include <string>
#include <tuple>
#include <vector>

#include "config/section.hpp"

namespace zero3d::config_detail {

namespace {
// Hugging Face's TrainingArguments defaults, which its DeepSpeed integration writes where a
// config says "auto" (transformers integrations/deepspeed.py trainer_config_process).
constexpr double kHfLearningRate = 5e-5;        // learning_rate
constexpr double kHfMaxGradNorm = 1.0;          // max_grad_norm
constexpr double kHfAdamBeta1 = 0.9, kHfAdamBeta2 = 0.999, kHfAdamEpsilon = 1e-8, kHfWeightDecay = 0.0;

// --- optimizer (DEEPSPEED-FACTS §1.5) ---------------------------------------------------------
// "auto" optimizer params as Hugging Face fills them from TrainingArguments (learning_rate,
// adam_beta1/2, adam_epsilon, weight_decay at their defaults): resolved, recorded and noted;
// the readers after this see the numbers in the resolved config.
void read_hf_auto_params(Section& p) {
  auto take = [&](const char* key, const json& value, const char* hf_name) {
    if (!p.is_auto(key)) return;
    p.substitute(key, value);
    p.note(std::string("auto    ") + p.key_path(key) + " = " + value.dump() + " (Hugging Face's " + hf_name +
           " default)");
  };
  take("lr", kHfLearningRate, "learning_rate");
  take("betas", json::array({kHfAdamBeta1, kHfAdamBeta2}), "adam_beta1/adam_beta2");
  take("eps", kHfAdamEpsilon, "adam_epsilon");
  take("weight_decay", kHfWeightDecay, "weight_decay");
}
// The constructor arguments of DeepSpeed's 1-bit optimizers (runtime/fp16/onebit/{adam,zoadam,
// lamb}.py; DEEPSPEED-FACTS-2 §5.1) with DeepSpeed's defaults. bias_correction, eps_inside_sqrt
// and max_grad_norm are arguments all three store and never use (their updates have no bias
// correction; clipping is the engine's gradient_clipping): accepted, and said so when set.
void read_one_bit_params(Section& p, OptimizerConfig& o) {
  const double inf = std::numeric_limits<double>::infinity();
  const int64_t big = std::numeric_limits<int64_t>::max() / 2;
  const std::string name = o.type == OptimizerType::OneBitAdam    ? "1-bit Adam"
                           : o.type == OptimizerType::ZeroOneAdam ? "0/1 Adam"
                                                                  : "1-bit Lamb";
  read_hf_auto_params(p);
  o.lr = p.number("lr", 1e-3, 0.0, inf);
  std::tie(o.beta1, o.beta2) = p.pair("betas", {0.9, 0.999});
  o.eps = p.number("eps", 1e-8, 0.0, inf);
  o.weight_decay = p.number("weight_decay", 0.0, 0.0, inf);
  if (o.type == OptimizerType::ZeroOneAdam) {
    o.var_freeze_step = p.integer("var_freeze_step", 100000, 0, big);
    // var_counter counts from 1, so 0 never doubles the interval (as in DeepSpeed)
    o.var_update_scaler = p.integer("var_update_scaler", 16, 0, big);
    o.local_step_scaler = p.integer("local_step_scaler", 32678, 0, big);
    // zoadam.py takes step % local_step_interval with interval = min(clipper, 2·interval): a
    // clipper of 0 divides by zero there once local_step_scaler steps have passed
    o.local_step_clipper = p.integer("local_step_clipper", 16, 1, big);
  } else {
    o.freeze_step = p.integer("freeze_step", 100000, 0, big);
  }
  if (o.type == OptimizerType::OneBitLamb) {
    o.max_coeff = p.number("max_coeff", 10.0, 0.0, inf, true);
    o.min_coeff = p.number("min_coeff", 0.01, 0.0, inf);
    if (o.min_coeff > o.max_coeff)
      p.report_key("min_coeff", "must not exceed max_coeff (" + std::to_string(o.max_coeff) + ")");
    o.coeff_beta = p.number("coeff_beta", 0.9, 0.0, 1.0);
    o.factor_max = p.number("factor_max", 4.0, 0.0, inf, true);
    o.factor_min = p.number("factor_min", 0.5, 0.0, inf);
    if (o.factor_min > o.factor_max)
      p.report_key("factor_min", "must not exceed factor_max (" + std::to_string(o.factor_max) + ")");
    o.factor_threshold = p.number("factor_threshold", 0.1, 0.0, inf);
  }
  for (const char* unused : {"bias_correction", "eps_inside_sqrt"})
    if (p.has(unused)) {
      p.boolean(unused, std::string(unused) == "bias_correction");
      p.note("note    " + p.key_path(unused) + " is accepted and unused, as in DeepSpeed's " + o.type_name +
             " (its update m/(sqrt(v)+eps) has no bias correction)");
    }
  if (p.has("max_grad_norm")) {
    p.number("max_grad_norm", 0.0, 0.0, inf);
    p.note("note    " + p.key_path("max_grad_norm") + " is accepted and unused, as in DeepSpeed's " + o.type_name +
           "; clipping is the top-level `gradient_clipping`");
  }
  // __init__: raise RuntimeError('1-bit Adam does not support the AMSGrad variant.') (and 0/1 Adam's, 1-bit Lamb's)
  if (p.boolean("amsgrad", false))
    p.report_key("amsgrad", name + " does not support the AMSGrad variant (DeepSpeed raises RuntimeError)");
  o.cuda_aware = p.boolean("cuda_aware", false);
  if (o.cuda_aware)
    p.note("note    " + p.key_path("cuda_aware") + " = true has no effect: it lets DeepSpeed's MPI backend pass "
           "device buffers to MPI; zero3d's communicator already moves the packed signs where they lie");
  o.comm_backend_name = p.string("comm_backend_name", "nccl");
  const std::vector<std::string> backends = {"nccl", "mpi", "hccl", "compressed"};
  if (std::find(backends.begin(), backends.end(), o.comm_backend_name) == backends.end())
    p.fail_key("comm_backend_name", show(json(o.comm_backend_name)) + " is not one of DeepSpeed's 1-bit backends "
                                    "(nccl, mpi, hccl, compressed)");
  p.finish();
}
}  // namespace

double read_gradient_clipping(Section& top) {
  const double v = top.number_or_auto("gradient_clipping", 1.0, kHfMaxGradNorm, 0.0, 1e30);
  if (top.is_auto("gradient_clipping"))
    top.note("auto    gradient_clipping = 1 (Hugging Face's max_grad_norm default)");
  return v;
}

OptimizerConfig read_optimizer(Section& top) {
  OptimizerConfig o;
  Section sec = top.child("optimizer");
  std::string type = sec.string("type", "AdamW");
  const std::string t = lower(type);
  const std::vector<std::string> deepspeed_unsupported = {"muadam", "muadamw", "musgd", "muon"};
  // DeepSpeed's implementation names of the same update (ops/adam, ops/lamb): fused CUDA
  // kernels and the CPU kernel compute what Adam and Lamb compute.
  const bool adam_alias = t == "fusedadam" || t == "cpuadam" || t == "deepspeedcpuadam";
  if (t == "adam" || t == "adamw" || adam_alias) {
    o.type = OptimizerType::Adam;
  } else if (t == "lion" || t == "fusedlion" || t == "cpulion" || t == "deepspeedcpulion") {
    o.type = OptimizerType::Lion;  // DeepSpeed's "lion": FusedLion, DeepSpeedCPULion under offload
  } else if (t == "adagrad" || t == "cpuadagrad" || t == "deepspeedcpuadagrad") {
    o.type = OptimizerType::Adagrad;  // DeepSpeed's "adagrad": torch.optim.Adagrad without offload
  } else if (t == "lamb" || t == "fusedlamb") {
    o.type = OptimizerType::Lamb;
  } else if (t == "onebitadam") {  // DeepSpeed matches the 1-bit names case-insensitively (FACTS-2 §5.1)
    o.type = OptimizerType::OneBitAdam;
  } else if (t == "zerooneadam") {
    o.type = OptimizerType::ZeroOneAdam;
  } else if (t == "onebitlamb") {
    o.type = OptimizerType::OneBitLamb;
  } else if (type == "SGD") {  // a torch.optim name: case-sensitive, as DeepSpeed looks it up
    o.type = OptimizerType::SGD;
  } else if (std::find(deepspeed_unsupported.begin(), deepspeed_unsupported.end(), t) !=
                 deepspeed_unsupported.end() ||
             type == "RMSprop" || type == "Adadelta" || type == "Adamax" ||
             type == "NAdam" || type == "RAdam" || type == "ASGD" || type == "Rprop" || type == "LBFGS") {
    sec.fail_key("type", "DeepSpeed optimizer " + show(json(type)) + " is not supported by zero3d (supported: Adam, "
                         "AdamW, Lamb, SGD, Lion, Adagrad, OneBitAdam, ZeroOneAdam, OneBitLamb and their Fused/CPU "
                         "names)");
  } else {
    std::string hint = nearest(type, {"Adam", "AdamW", "Lamb", "SGD", "Lion", "Adagrad"});
    sec.fail_key("type", show(json(type)) + " is not a supported optimizer (Adam, AdamW, Lamb, SGD, Lion, Adagrad)" +
                             (hint.empty() ? "" : "; did you mean \"" + hint + "\"?"));
  }
  o.type_name = type;
  Section p = sec.child("params");
  if (!o.one_bit() && p.has("max_grad_norm"))  // the 1-bit optimizers take it (unused, read_one_bit_params)
    p.report_key("max_grad_norm", "is not allowed in optimizer params; use the top-level `gradient_clipping`");
  if (!o.one_bit()) p.mark_known("max_grad_norm");
  const double inf = std::numeric_limits<double>::infinity();
  switch (o.type) {
    case OptimizerType::Adam: {
      read_hf_auto_params(p);
      o.lr = p.number("lr", 1e-3, 0.0, inf);
      std::tie(o.beta1, o.beta2) = p.pair("betas", {0.9, 0.999});
      o.eps = p.number("eps", 1e-8, 0.0, inf);
      o.weight_decay = p.number("weight_decay", 0.0, 0.0, inf);
      o.bias_correction = p.boolean("bias_correction", true);
      // DeepSpeed: effective AdamW = (type == "adamw") or adam_w_mode (default true).
      bool mode = p.boolean("adam_w_mode", true);
      o.adam_w_mode = (t == "adamw") || mode;
      p.boolean("torch_adam", false);  // torch's and DeepSpeed's Adam compute the same update
      if (p.boolean("amsgrad", false)) p.report_key("amsgrad", "amsgrad is not supported (DeepSpeed FusedAdam rejects it)");
      p.finish();
      break;
    }
    case OptimizerType::Lamb: {
      read_hf_auto_params(p);
      o.lr = p.number("lr", 1e-3, 0.0, inf);
      std::tie(o.beta1, o.beta2) = p.pair("betas", {0.9, 0.999});
      o.eps = p.number("eps", 1e-8, 0.0, inf);
      o.eps_inside_sqrt = p.boolean("eps_inside_sqrt", false);
      o.weight_decay = p.number("weight_decay", 0.0, 0.0, inf);
      o.bias_correction = p.boolean("bias_correction", true);
      o.max_coeff = p.number("max_coeff", 10.0, 0.0, inf, true);
      o.min_coeff = p.number("min_coeff", 0.01, 0.0, inf);
      if (o.min_coeff > o.max_coeff)
        p.report_key("min_coeff", "must not exceed max_coeff (" + std::to_string(o.max_coeff) + ")");
      p.finish();
      break;
    }
    case OptimizerType::Lion: {  // FusedLion(lr=1e-3, betas=(0.9, 0.999), weight_decay=0)
      read_hf_auto_params(p);
      o.lr = p.number("lr", 1e-3, 0.0, inf);
      std::tie(o.beta1, o.beta2) = p.pair("betas", {0.9, 0.999});
      o.weight_decay = p.number("weight_decay", 0.0, 0.0, inf);
      p.finish();
      break;
    }
    case OptimizerType::Adagrad: {  // torch.optim.Adagrad(lr=1e-2, lr_decay=0, weight_decay=0, eps=1e-10)
      read_hf_auto_params(p);
      o.lr = p.number("lr", 1e-2, 0.0, inf);
      o.eps = p.number("eps", 1e-10, 0.0, inf);
      o.weight_decay = p.number("weight_decay", 0.0, 0.0, inf);
      o.lr_decay = p.number("lr_decay", 0.0, 0.0, inf);
      o.initial_accumulator_value = p.number("initial_accumulator_value", 0.0, 0.0, inf);
      p.accept_default_only("maximize", false);
      p.accept_default_only("foreach", nullptr);
      p.accept_default_only("differentiable", false);
      p.finish();
      break;
    }
    case OptimizerType::OneBitAdam:
    case OptimizerType::ZeroOneAdam:
    case OptimizerType::OneBitLamb:
      read_one_bit_params(p, o);
      break;
    case OptimizerType::SGD: {
      o.lr = p.number("lr", 1e-3, 0.0, inf);
      o.momentum = p.number("momentum", 0.0, 0.0, inf);
      o.dampening = p.number("dampening", 0.0, -inf, inf);
      o.weight_decay = p.number("weight_decay", 0.0, 0.0, inf);
      o.nesterov = p.boolean("nesterov", false);
      if (o.nesterov && (o.momentum <= 0.0 || o.dampening != 0.0))
        p.report_key("nesterov", "Nesterov momentum requires a momentum > 0 and zero dampening (as torch.optim.SGD)");
      p.accept_default_only("maximize", false);
      p.accept_default_only("foreach", nullptr);
      p.accept_default_only("differentiable", false);
      p.finish();
      break;
    }
  }
  sec.finish();
  return o;
}

// --- LR schedulers (DEEPSPEED-FACTS §4) ------------------------------------------------------
SchedulerConfig read_scheduler(Section& top, const OptimizerConfig& opt, int64_t total_steps) {
  SchedulerConfig s;
  if (!top.has("scheduler")) {
    top.raw("scheduler");
    return s;
  }
  Section sec = top.child("scheduler");
  const std::vector<std::string> names = {"WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle", "LRRangeTest"};
  const json* tv = sec.raw("type");
  if (!tv) sec.fail_key("type", "is required (one of WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle, LRRangeTest)");
  if (!tv->is_string()) sec.fail_key("type", "expected a string, got " + show(*tv));
  std::string type = tv->get<std::string>();
  auto it = std::find(names.begin(), names.end(), type);
  if (it == names.end()) {
    std::string hint = nearest(type, names);
    sec.fail_key("type", show(json(type)) + " is not a zero3d scheduler (WarmupLR, WarmupDecayLR, WarmupCosineLR, "
                         "OneCycle, LRRangeTest)" + (hint.empty() ? "" : "; did you mean \"" + hint + "\"?"));
  }
  s.type_name = type;
  sec.record("type", type);  // the resolved config must name its scheduler to be a config itself
  s.type = static_cast<SchedulerType>(1 + (it - names.begin()));
  Section p = sec.child("params");
  const double inf = std::numeric_limits<double>::infinity();
  // "auto" as Hugging Face fills the scheduler (integrations/deepspeed.py): warmup_min_lr 0,
  // warmup_max_lr the optimizer's lr, warmup_num_steps TrainingArguments.get_warmup_steps (0 at
  // its defaults; DeepSpeed then warms up over max(2, 0) steps), total_num_steps the run's steps.
  auto fill = [&](const char* key, const json& value, const std::string& from) {
    if (!p.is_auto(key)) return;
    p.substitute(key, value);
    p.note("auto    " + p.key_path(key) + " = " + value.dump() + " (" + from + ")");
  };
  fill("warmup_min_lr", 0.0, "Hugging Face's value");
  fill("warmup_max_lr", opt.lr, "the optimizer's lr, as Hugging Face fills it");
  fill("warmup_num_steps", 0, "Hugging Face's warmup_steps/warmup_ratio default 0");
  // "auto" from training.steps: a bad value is training.steps's, so the message names that key.
  const bool total_from_steps = p.is_auto("total_num_steps") || !p.has("total_num_steps");
  fill("total_num_steps", total_steps, "training.steps");
  fill("cycle_max_lr", opt.lr, "the optimizer's lr");
  // WarmupLR, WarmupDecayLR and LRRangeTest take their lr keys as one value or a list of one
  // per parameter group (OneCycle takes none); zero3d trains one group: a list of one is its value.
  auto one_group = [&](const char* key) {
    const json* v = p.raw(key);
    if (!v || !v->is_array()) return;
    if (v->size() != 1)
      p.fail_key(key, "expected a number or a list of one, got " + show(*v) + " (DeepSpeed takes one value per "
                      "parameter group; zero3d trains one group)");
    p.substitute(key, (*v)[0]);
  };
  // DeepSpeed warms up over max(2, warmup_num_steps) steps: 0 and 1 are 2 (lr_schedules.py).
  auto warmup_steps = [&]() {
    const int64_t n = p.integer("warmup_num_steps", 1000, 0, kMaxInt * 1000LL);
    if (n < 2)
      p.note("note    " + p.key_path("warmup_num_steps") + " = " + std::to_string(n) +
             ": the warm-up takes max(2, " + std::to_string(n) + ") = 2 steps, as in DeepSpeed");
    return n;
  };
  // DeepSpeed's WarmupLR (and WarmupDecayLR) warns on a warmup_type other than "log" or
  // "linear" (matched exactly) and warms up by "log"; WarmupCosineLR keeps the value and fails
  // with UnboundLocalError at its first step, which zero3d reports now instead.
  auto warmup_type = [&](bool cosine) {
    const std::string t = p.string("warmup_type", "log");
    if (t == "log" || t == "linear") return t == "log";
    if (cosine)
      p.fail_key("warmup_type", "value " + show(json(t)) + " is not \"log\" or \"linear\": DeepSpeed's WarmupCosineLR "
                                "accepts it and then fails at its first step (UnboundLocalError)");
    p.record("warmup_type", "log");
    p.note("warning " + p.key_path("warmup_type") + " = " + show(json(t)) +
           " is not \"log\" or \"linear\": the warm-up is \"log\", as DeepSpeed's " + type + " does (it warns likewise)");
    return true;
  };
  auto warmup = [&](double default_max) {
    one_group("warmup_min_lr");
    one_group("warmup_max_lr");
    s.warmup_min_lr = p.number("warmup_min_lr", 0.0, 0.0, inf);
    s.warmup_max_lr = p.number("warmup_max_lr", default_max, 0.0, inf);
    s.warmup_num_steps = warmup_steps();
    s.warmup_log = warmup_type(false);
  };
  auto total = [&]() {
    if (total_from_steps && total_steps < 1) {
      p.mark_known("total_num_steps");
      p.report("training.steps", "value " + std::to_string(total_steps) + " leaves " + p.key_path("total_num_steps") +
                                     " (taken from it) without a step; " + type + " needs at least 1");
      return;
    }
    if (!p.has("total_num_steps"))  // DeepSpeed requires it; zero3d takes the run's length, and says so
      p.note("default " + p.key_path("total_num_steps") + " = " + std::to_string(total_steps) +
             " (training.steps; DeepSpeed's " + type + " requires the key)");
    s.total_num_steps = p.integer("total_num_steps", total_steps, 1, kMaxInt * 1000LL);
  };
  // DeepSpeed's WarmupDecayLR/WarmupCosineLR only warn when warmup outlasts the schedule.
  auto warn_long_warmup = [&]() {
    if (s.total_num_steps < s.warmup_num_steps)
      p.note("warning " + p.key_path("total_num_steps") + " = " + std::to_string(s.total_num_steps) +
             " is less than warmup_num_steps = " + std::to_string(s.warmup_num_steps) +
             ": the schedule ends inside its warm-up (DeepSpeed warns likewise)");
  };
  switch (s.type) {
    case SchedulerType::WarmupLR:
      warmup(opt.lr);  // DeepSpeed: warmup_max_lr None -> the optimizer's lr
      break;
    case SchedulerType::WarmupDecayLR:
      warmup(0.001);
      total();
      warn_long_warmup();
      break;
    case SchedulerType::WarmupCosineLR:
      total();
      s.warmup_min_ratio = p.number("warmup_min_ratio", 0.0, 0.0, 1.0);
      s.warmup_num_steps = warmup_steps();
      s.cos_min_ratio = p.number("cos_min_ratio", 1e-4, 0.0, 1.0);
      s.warmup_log = warmup_type(true);
      warn_long_warmup();
      break;
    case SchedulerType::OneCycle: {
      if (!p.has("cycle_min_lr") || !p.has("cycle_max_lr"))
        p.fail_key(p.has("cycle_min_lr") ? "cycle_max_lr" : "cycle_min_lr", "is required by OneCycle");
      s.cycle_min_lr = p.number("cycle_min_lr", 0.0, 0.0, inf);
      s.cycle_max_lr = p.number("cycle_max_lr", opt.lr, 0.0, inf);
      s.decay_lr_rate = p.number("decay_lr_rate", 0.0, 0.0, inf);
      s.cycle_first_step_size = p.integer("cycle_first_step_size", 2000, 1, kMaxInt * 1000LL);
      s.cycle_second_step_size = p.integer("cycle_second_step_size", s.cycle_first_step_size, 0, kMaxInt * 1000LL);
      s.cycle_first_stair_count = p.integer("cycle_first_stair_count", 0, 0, kMaxInt);
      s.cycle_second_stair_count = p.integer("cycle_second_stair_count", s.cycle_first_stair_count, 0, kMaxInt);
      s.decay_step_size = p.integer("decay_step_size", 0, 0, kMaxInt * 1000LL);
      s.cycle_momentum = p.boolean("cycle_momentum", true);
      s.cycle_min_mom = p.number("cycle_min_mom", 0.8, 0.0, 1.0);
      s.cycle_max_mom = p.number("cycle_max_mom", 0.9, 0.0, 1.0);
      s.decay_mom_rate = p.number("decay_mom_rate", 0.0, 0.0, inf);
      break;
    }
    case SchedulerType::LRRangeTest:
      one_group("lr_range_test_min_lr");
      s.lr_range_test_min_lr = p.number("lr_range_test_min_lr", 1e-3, 0.0, inf);
      s.lr_range_test_step_size = p.integer("lr_range_test_step_size", 2000, 1, kMaxInt * 1000LL);
      s.lr_range_test_step_rate = p.number("lr_range_test_step_rate", 1.0, 0.0, inf);
      s.lr_range_test_staircase = p.boolean("lr_range_test_staircase", false);
      break;
    case SchedulerType::None:
      break;
  }
  p.integer("last_batch_iteration", -1, -1, -1);  // resuming a schedule belongs to checkpoints
  p.finish();
  sec.finish();
  return s;
}

}  // namespace zero3d::config_detail
