// config/zero.cpp — the zero_optimization section (DEEPSPEED-FACTS §5.1, FACTS-2 §3.1), the
// offload keys and `aio`, and what the ZeRO optimizer reads from elsewhere in the config: the
// optimizer checks under ZeRO and offload, and the gradient averaging keys.
#include <limits>
#include <set>
#include <sstream>

#include "config/section.hpp"
#include "kernels/device.hpp"
#include "parallel/grad_reducer.hpp"

namespace zero3d::config_detail {

namespace {

// zero_optimization keys of DEEPSPEED-FACTS §5.1 whose features zero3d does not have (or
// always has, like contiguous buffers): accepted at DeepSpeed's default, rejected otherwise.
const std::vector<std::pair<const char*, nlohmann::json>> kZeroDefaultOnlyKeys = {
    {"reduce_scatter", true},
    {"allgather_partitions", true}, {"load_from_fp32_weights", true}, {"elastic_checkpoint", false},
    {"module_granularity_threshold", 0},
    {"stage3_module_granularity_threshold", 0}, {"use_all_reduce_for_fetch_params", false},
    {"stage3_use_all_reduce_for_fetch_params", false}, {"allgather_sequential", false},
    {"stage3_allgather_sequential", false}, {"ignore_unused_parameters", true},
    {"memory_efficient_linear", true},
    {"pipeline_loading_checkpoint", false}, {"override_module_apply", true}, {"log_trace_cache_warnings", false},
    {"enable_sanity_checks", false}, {"save_muon_momentum_buffer_in_memory", false}, {"zenflow", nullptr},
    {"leaf_module", nullptr}};

OffloadDevice offload_device(Section& sec) {
  const std::string d = sec.choice("device", "none", {"none", "cpu", "nvme"});
  return d == "cpu" ? OffloadDevice::Cpu : d == "nvme" ? OffloadDevice::Nvme : OffloadDevice::None;
}

// nvme_path: required with device nvme, meaningless (and so rejected) with any other device.
std::string offload_nvme_path(Section& sec, OffloadDevice device) {
  const std::string path = sec.path("nvme_path", "");
  if (device == OffloadDevice::Nvme && path.empty())
    sec.report_key("nvme_path", "device \"nvme\" needs an nvme_path (a directory on the drive that holds the swap files)");
  if (device != OffloadDevice::Nvme && !path.empty())
    sec.report_key("nvme_path", "is only used with \"device\": \"nvme\" (device is " +
                                  std::string(device == OffloadDevice::Cpu ? "cpu" : "none") + ")");
  return path;
}

// Page-locked host memory only speeds copies between host and GPU memory.
void read_aio(Section& top, AioConfig& a);

std::string pin_memory_note(const Section& off, bool pin) {
  return "no effect on this build: `" + off.key_path("pin_memory") + "` = " + (pin ? "true" : "false") +
         " (page-locked host memory speeds host-GPU copies; offloaded state here is used where it lies, in host "
         "memory)";
}

// zero_optimization.offload_optimizer / offload_param, their deprecated boolean forms,
// sub_group_size and the top-level `aio` section (DEEPSPEED-FACTS-2 §3.1).
void read_offload(Section& top, Section& sec, ZeroConfig& z) {
  const int64_t kMax = std::numeric_limits<int64_t>::max();
  // Deprecated: cpu_offload -> offload_optimizer.device cpu, cpu_offload_param -> offload_param,
  // cpu_offload_use_pin_memory -> pin_memory of both.
  const bool old_opt = sec.boolean("cpu_offload", false), old_param = sec.boolean("cpu_offload_param", false);
  const bool old_pin = sec.boolean("cpu_offload_use_pin_memory", false);
  // The resolved config names the new keys only (offload_*.device, pin_memory): it must read back.
  for (const char* old : {"cpu_offload", "cpu_offload_param", "cpu_offload_use_pin_memory"}) sec.forget(old);
  for (const auto& [old, key] : {std::pair<const char*, const char*>{"cpu_offload", "offload_optimizer"},
                                 {"cpu_offload_param", "offload_param"}})
    if (sec.has(old) && sec.has(key))
      sec.report_key(old, "cannot be given together with `zero_optimization." + std::string(key) + "` (deprecated alias)");
  {
    Section off = sec.child("offload_optimizer");
    OffloadOptimizerConfig& o = z.offload_optimizer;
    o.device = old_opt ? OffloadDevice::Cpu : offload_device(off);
    o.nvme_path = offload_nvme_path(off, o.device);
    o.buffer_count = off.integer("buffer_count", 4, 1, 1 << 20);
    o.pin_memory = off.boolean("pin_memory", old_opt ? old_pin : true);
    // (a GPU build page-locks the host tier and its staging when it is true)
    if (off.has("pin_memory") && !kernels::kGpuBuild) off.note(pin_memory_note(off, o.pin_memory));
    o.pipeline_read = off.boolean("pipeline_read", false);
    o.pipeline_write = off.boolean("pipeline_write", false);
    o.fast_init = off.boolean("fast_init", false);
    if (o.fast_init)  // DeepSpeed skips writing initial swap files with it; results are the same either way
      off.note("no effect on this build: `" + off.key_path("fast_init") +
               "` = true (zero3d reserves each swap file once with fallocate, which is as fast)");
    o.ratio = off.number("ratio", 1.0, 0.0, 1.0);
    off.accept_default_only("super_offload", false);
    if (off.has("cpuadam_cores_perc")) {  // validated, then listed: one Adam thread per rank here
      const double perc = off.number("cpuadam_cores_perc", 0.8, 0.0, 1.0, /*lo_open=*/true);
      off.note("no effect on this build: `" + off.key_path("cpuadam_cores_perc") + "` = " + show(json(perc)) +
               " (DeepSpeed's CPU Adam thread share; zero3d runs the offloaded step on each rank's own thread)");
    }
    off.finish();
    if (old_opt) off.record("device", "cpu");
  }
  {
    Section off = sec.child("offload_param");
    OffloadParamConfig& p = z.offload_param;
    p.device = old_param ? OffloadDevice::Cpu : offload_device(off);
    p.nvme_path = offload_nvme_path(off, p.device);
    p.buffer_count = off.integer("buffer_count", 5, 1, 1 << 20);
    p.buffer_size = off.integer("buffer_size", 100000000, 1, kMax);
    p.max_in_cpu = off.integer("max_in_cpu", 1000000000, 0, kMax);
    p.pin_memory = off.boolean("pin_memory", old_param ? old_pin : true);
    if (off.has("pin_memory") && !kernels::kGpuBuild) off.note(pin_memory_note(off, p.pin_memory));
    if (kernels::kGpuBuild && p.device == OffloadDevice::Cpu && !p.pin_memory)
      off.note("`" + off.key_path("pin_memory") + "` = false: the parameter partition is page-locked all the same, "
               "because the device's kernels read it in place (pageable memory they cannot reach)");
    off.finish();
    if (old_param) off.record("device", "cpu");
  }
  z.sub_group_size = sec.integer("sub_group_size", 1000000000, 1, kMax);
  if (z.offload_optimizer.device != OffloadDevice::None && z.stage == 0)
    sec.report_key("offload_optimizer", "offloads the optimizer partition, which needs zero_optimization.stage 1, 2 or 3 "
                                      "(stage is 0)");
  if (z.offload_param.device != OffloadDevice::None && z.stage != 3)
    sec.report_key("offload_param", "offloads the parameter partition, which only stage 3 has (stage is " +
                                      std::to_string(z.stage) + ")");
  read_aio(top, z.aio);
}

// The top-level `aio` section: how swap files are read and written.
void read_aio(Section& top, AioConfig& a) {
  Section aio = top.child("aio");
  a.block_size = aio.integer("block_size", 1048576, 4096, int64_t(1) << 30);
  if (a.block_size % 4096 != 0)
    aio.report_key("block_size", "value " + std::to_string(a.block_size) +
                                   " is not a multiple of 4096 (direct I/O moves whole 4 KiB pages)");
  a.queue_depth = aio.integer("queue_depth", 8, 1, 4096);
  if (aio.has("intra_op_parallelism") && aio.has("thread_count"))
    aio.report_key("thread_count", "cannot be given together with `aio.intra_op_parallelism` (its new name)");
  a.intra_op_parallelism = static_cast<int>(aio.has("thread_count") ? aio.integer("thread_count", 1, 1, 64)
                                                                      : aio.integer("intra_op_parallelism", 1, 1, 64));
  a.single_submit = aio.boolean("single_submit", false);
  a.overlap_events = aio.boolean("overlap_events", true);
  aio.hardware_only("use_gds", false, "GPUDirect Storage moves NVMe data straight to GPU memory through cuFile; "
                                      "this build reads swap files into host memory");
  aio.finish();
}

// zero_optimization.stage as a list of stages or "all": DeepSpeed's autotuner reads it as its
// search space (autotuning/autotuner.py tune_space: "all" or the stages listed). Only a config
// the autotuner reads may hold one (autotuning.enabled: `zero3d train` tunes over it first, as
// `zero3d autotune` does); the rest of the config is checked at the smallest stage, the
// autotuner's first (autotune.cpp). Returns that stage; nullopt for a plain stage (`space`
// false) or a search space that is refused (`space` true, the problem recorded).
std::optional<int> read_stage_search_space(Section& sec, bool tuning, bool& space) {
  if (!sec.has("stage") || sec.is_auto("stage")) return std::nullopt;
  const json& v = *sec.raw("stage");
  const bool all = v.is_string() && v == "all";
  if (!all && !v.is_array()) return std::nullopt;
  space = true;
  sec.record("stage", v);
  if (!tuning)
    sec.fail_key("stage", "value " + show(v) + " is DeepSpeed's autotuner's search space: set autotuning.enabled "
                          "true (zero3d train then tunes over it first; zero3d autotune reads it too), or give one "
                          "stage 0-3");
  std::set<int> stages;
  for (const json& s : all ? json::array({0, 1, 2, 3}) : v) {
    if (!s.is_number_integer() || s.get<int64_t>() < 0 || s.get<int64_t>() > 3)
      sec.fail_key("stage", "with autotuning, expected 0-3, a list of them or \"all\", got " + show(v));
    stages.insert(s.get<int>());
  }
  if (stages.empty()) sec.fail_key("stage", "with autotuning, expected 0-3, a list of them or \"all\", got []");
  sec.note("note    `zero_optimization.stage` = " + show(v) + ": the autotuner's search space (autotuning.enabled); "
           "the config is checked at stage " + std::to_string(*stages.begin()) + ", its first");
  return *stages.begin();
}

// MiCS and ZeRO++ (FACTS-2 §3.6; zero/shard_groups.hpp). DeepSpeed builds MiCS_Optimizer and
// hpZ's secondary partition only at stage 3 and ignores the keys below it: zero3d refuses them
// there rather than run something else than asked.
void read_shard_groups(Section& sec, Config& c) {
  ZeroConfig& z = c.zero;
  const int64_t dp = c.batch.world_size;
  const int64_t mics = sec.integer("mics_shard_size", -1, -1, std::numeric_limits<int>::max());
  z.mics_shard_size = mics > 0 ? static_cast<int>(mics) : 0;  // DeepSpeed: MiCS when > 0
  z.mics_hierarchical_params_gather = sec.boolean("mics_hierarchical_params_gather", false);
  z.hpz_partition_size = static_cast<int>(sec.integer("zero_hpz_partition_size", 1, 1, std::numeric_limits<int>::max()));
  const auto divides = [&](const char* key, int64_t n) {
    if (dp % n != 0)
      sec.report_key(key, "value " + std::to_string(n) + " does not divide the data-parallel size (" + std::to_string(dp) +
                              " ranks): the groups are cut from each data-parallel group");
  };
  const auto stage3 = [&](const char* key, const std::string& what) {
    if (z.stage != 3)
      sec.report_key(key, what + " is ZeRO-3's (DeepSpeed builds it at stage 3 only and ignores the key at stage " +
                              std::to_string(z.stage) + "); set zero_optimization.stage 3 or remove it");
  };
  if (z.mics_shard_size > 0) {
    stage3("mics_shard_size", "MiCS (model states sharded inside groups of mics_shard_size ranks)");
    divides("mics_shard_size", z.mics_shard_size);
  }
  if (z.mics_hierarchical_params_gather && z.mics_shard_size == 0)
    sec.report_key("mics_hierarchical_params_gather", "is MiCS's gather and needs mics_shard_size > 0");
  if (z.hpz_partition_size > 1) {
    stage3("zero_hpz_partition_size", "ZeRO++'s hpZ (a secondary partition of the parameters)");
    divides("zero_hpz_partition_size", z.hpz_partition_size);
    if (z.mics_shard_size > 0)
      sec.report_key("zero_hpz_partition_size", "cannot be combined with mics_shard_size here: both re-cut stage 3's "
                                                "partition into groups, and zero3d runs one of them at a time");
  }
  if (z.mics_shard_size == 0 && z.hpz_partition_size == 1) return;
  const char* key = z.mics_shard_size > 0 ? "mics_shard_size" : "zero_hpz_partition_size";
  if (c.pipeline.stages > 1)
    sec.report_key(key, "is not run with pipeline.stages " + std::to_string(c.pipeline.stages) +
                            " (DeepSpeed's PipelineEngine refuses ZeRO-3 altogether; zero3d cuts these groups from "
                            "one-stage data-parallel groups only)");
  if (c.model.moe.enabled())
    sec.report_key(key, "is not run with MoE (the experts' ZeRO optimizer partitions over the expert-data group, "
                        "which these groups do not cut)");
}

// zeropp_loco_param (LoCo-ZeRO++; parallel/quantized_reduce_scatter.hpp): an object with err_beta
// and reset_T, DeepSpeed's documented defaults 0.8 and 1024 (zero/config.py); null is off.
// DeepSpeed reads it only inside qgZ (stage3.py picks all_to_all_loco_quant_reduce over
// all_to_all_quant_reduce), so without zero_quantized_gradients it would do nothing.
void read_loco(Section& sec, Config& c) {
  const json* v = sec.raw("zeropp_loco_param");
  if (!v || v->is_null()) {
    sec.record("zeropp_loco_param", nullptr);
    return;
  }
  if (!c.zero.quantized_gradients) {
    sec.report_key("zeropp_loco_param", "is LoCo's error feedback for qgZ's quantised gradients (DeepSpeed reads it "
                                        "only with zero_quantized_gradients and ignores it otherwise); set "
                                        "zero_quantized_gradients true or remove it");
    return;
  }
  Section loco = sec.child("zeropp_loco_param");
  LocoConfig& l = c.zero.loco;
  l.enabled = true;
  // err_beta weighs the kept error against the new one; reset_T counts reductions between clears
  l.err_beta = loco.number("err_beta", 0.8, 0.0, 1.0);
  l.reset_T = loco.integer("reset_T", 1024, 1, std::numeric_limits<int32_t>::max());
  loco.finish();
}

// ZeRO++'s quantized weights (qwZ; parallel/quantized_gather.hpp) and gradients (qgZ;
// parallel/quantized_reduce_scatter.hpp). DeepSpeed reads both only at stage 3 (zero_quantized_
// weights in partition_parameters.py, zero_quantized_gradients as the all-to-all group stage3.py
// receives); its MiCS optimizer (mics.py, with a coalescing manager) is built without either.
void read_quantized_collectives(Section& sec, Config& c) {
  ZeroConfig& z = c.zero;
  z.quantized_weights = sec.boolean("zero_quantized_weights", false);
  if (z.quantized_weights && z.stage != 3)
    sec.report_key("zero_quantized_weights", "ZeRO++'s qwZ quantises stage 3's parameter gathers (DeepSpeed applies it "
                                             "at stage 3 only and ignores the key at stage " + std::to_string(z.stage) +
                                             "); set zero_optimization.stage 3 or remove it");
  if (z.quantized_weights && z.mics_shard_size > 0)
    sec.report_key("zero_quantized_weights", "cannot be combined with mics_shard_size: DeepSpeed's MiCS gathers "
                                             "(zero/mics.py) move the parameters unquantised and ignore the key");
  z.quantized_nontrainable_weights = sec.boolean("zero_quantized_nontrainable_weights", false);
  if (z.quantized_nontrainable_weights) {
    // DeepSpeed quantises the frozen parameters' ds_tensor partitions (partition_parameters.py
    // quantized_nontrainable_weights), which exist at stage 3 only, and only for requires_grad=False ones.
    if (z.stage != 3)
      sec.report_key("zero_quantized_nontrainable_weights",
                     "stores stage 3's partitions of frozen parameters as int8 groups (DeepSpeed's "
                     "partition_parameters.py); at stage " + std::to_string(z.stage) +
                         " parameters are not partitioned; set zero_optimization.stage 3 or remove it");
    else if (c.model.frozen_parameters.empty())
      sec.report_key("zero_quantized_nontrainable_weights",
                     "quantises the frozen (requires_grad false) parameters, and model.frozen_parameters names none; "
                     "name them there or remove the key");
    // the layouts it cannot serve: config/frozen.cpp check_frozen_parameters (read after every section)
  }
  z.quantized_gradients = sec.boolean("zero_quantized_gradients", false);
  read_loco(sec, c);
  if (!z.quantized_gradients) return;
  if (z.stage != 3)
    sec.report_key("zero_quantized_gradients", "ZeRO++'s qgZ replaces stage 3's gradient reduce-scatter (DeepSpeed "
                                               "applies it at stage 3 only and ignores the key at stage " +
                                                   std::to_string(z.stage) + "); set zero_optimization.stage 3 or remove it");
  if (z.mics_shard_size > 0)
    sec.report_key("zero_quantized_gradients", "cannot be combined with mics_shard_size: DeepSpeed's MiCS optimizer "
                                               "(zero/mics.py) is built without qgZ's all-to-all groups and "
                                               "reduce-scatters its gradients unquantised");
  // DeepSpeed's all_to_all_quant_reduce cuts every tensor over the whole job (dist.get_world_size(),
  // its nodes from device_count()), so its data group must be the job: no model-parallel axes.
  if (c.pipeline.stages > 1 || c.tensor.size > 1)
    sec.report_key("zero_quantized_gradients", "needs a purely data-parallel job: DeepSpeed's qgZ all-to-alls cut "
                                               "gradients over every rank of the job (" +
                                                   std::string(c.pipeline.stages > 1 ? "pipeline.stages " : "tensor "
                                                                                       "parallel size ") +
                                                   std::to_string(c.pipeline.stages > 1 ? c.pipeline.stages : c.tensor.size) +
                                                   " makes the data group smaller)");
}

}  // namespace

void read_zero(Section& top, Config& c, bool tuning) {
  if (top.has("zero_optimization") && top.raw("zero_optimization")->is_boolean()) {
    c.zero.stage = top.raw("zero_optimization")->get<bool>() ? 1 : 0;  // deprecated bool form: true = stage 1
    c.zero.overlap_comm = false;
    read_aio(top, c.zero.aio);
    return;
  }
  Section sec = top.child("zero_optimization");
  const int64_t kMax = std::numeric_limits<int64_t>::max();
  // "auto": the three sizes Hugging Face derives from the hidden size C (integrations/deepspeed.py
  // trainer_config_finalize); any other key takes DeepSpeed's default, as its pydantic model does.
  const int64_t C = c.model.n_embd;
  auto from_hidden = [&](const std::vector<std::string>& keys, int64_t value, const std::string& rule) {
    for (const std::string& key : keys)
      if (sec.is_auto(key)) {
        sec.substitute(key, value);
        sec.note("auto    " + sec.key_path(key) + " = " + std::to_string(value) + " (" + rule + ", hidden size " +
                 std::to_string(C) + ")");
      }
  };
  from_hidden({"reduce_bucket_size"}, C * C, "C*C");
  from_hidden({"stage3_prefetch_bucket_size", "prefetch_bucket_size"}, static_cast<int64_t>(0.9 * C * C), "0.9*C*C");
  from_hidden({"stage3_param_persistence_threshold", "param_persistence_threshold"}, 10 * C, "10*C");
  sec.auto_is_default("DeepSpeed's default: its config model drops \"auto\"");
  std::optional<int> searched;
  bool space = false;
  attempt(sec.context(), sec.file(), [&] { searched = read_stage_search_space(sec, tuning, space); });
  if (searched) c.zero.stage = *searched;
  else if (!space) c.zero.stage = static_cast<int>(sec.integer("stage", 0, 0, 3));
  // DeepSpeed allows 0 (ge=0) and flushes a bucket once it would exceed the size: 0 and 1 both
  // mean one gradient per reduction.
  c.zero.reduce_bucket_size = std::max<int64_t>(1, sec.integer("reduce_bucket_size", 500000000, 0, kMax));
  c.zero.allgather_bucket_size = sec.integer("allgather_bucket_size", 500000000, 2, kMax);
  if (c.zero.allgather_bucket_size % 2 != 0)
    sec.report_key("allgather_bucket_size", "must be a multiple of 2, got " + std::to_string(c.zero.allgather_bucket_size));
  c.zero.overlap_comm = sec.boolean("overlap_comm", c.zero.stage == 3);  // DeepSpeed: None -> (stage == 3)
  // Stage-3 knobs, each also accepted under its deprecated stage3_ name (not both).
  auto aliased = [&](const std::string& key, int64_t def, int64_t lo) {
    const std::string old = "stage3_" + key;
    if (sec.has(key) && sec.has(old)) {
      sec.report_key(old, "cannot be given together with `zero_optimization." + key + "` (deprecated alias)");
      sec.mark_known(key);
    }
    return sec.has(old) ? sec.integer(old, def, lo, kMax) : sec.integer(key, def, lo, kMax);
  };
  c.zero.prefetch_bucket_size = aliased("prefetch_bucket_size", 50000000, 0);
  c.zero.param_persistence_threshold = aliased("param_persistence_threshold", 100000, 0);
  c.zero.model_persistence_threshold = aliased("model_persistence_threshold", kMax, 0);
  c.zero.max_live_parameters = aliased("max_live_parameters", 1000000000, 0);
  c.zero.max_reuse_distance = aliased("max_reuse_distance", 1000000000, 0);
  read_offload(top, sec, c.zero);
  if (sec.boolean("legacy_stage1", false))
    sec.report_key("legacy_stage1", "legacy_stage1 was removed from DeepSpeed; remove the key");
  // Keys whose only effect is on GPU memory or GPU-to-host copies: results are the same.
  sec.hardware_only("contiguous_gradients", true,
                    "copies gradients into a contiguous GPU buffer against allocator fragmentation; zero3d's "
                    "gradients always live in one flat buffer");
  sec.hardware_only("round_robin_gradients", false,
                    "spreads the GPU-to-CPU gradient copies of offload over ranks; this build's gradients are "
                    "in host memory already");
  sec.hardware_only("use_multi_rank_bucket_allreduce", true, "an NCCL bucketing choice; same sums");
  // One setting under three names (DeepSpeed's current, stage3_ and old fp16 spellings).
  for (const char* key : {"stage3_gather_fp16_weights_on_model_save", "stage3_gather_16bit_weights_on_model_save",
                          "gather_16bit_weights_on_model_save"})
    if (sec.boolean(key, false)) c.zero.gather_16bit_weights_on_model_save = true;
  for (const auto& [key, deepspeed_default] : kZeroDefaultOnlyKeys) sec.accept_default_only(key, deepspeed_default);
  read_shard_groups(sec, c);
  read_quantized_collectives(sec, c);
  sec.finish();
}

// DeepSpeed lets ZeRO run only its tested optimizers unless zero_allow_untested_optimizer;
// Lamb's per-tensor trust ratio cannot be computed on flat partitions, so it stays stage 0.
void check_zero_optimizer(Section& top, const Config& c) {
  if (c.zero.stage == 0) return;
  // engine.py _configure_basic_optimizer: assert not self.zero_optimization(), "1bit-Adam is not
  // compatible with ZeRO" (the compressed all-reduce needs every rank's whole momentum).
  if (c.optimizer.one_bit())
    top.fail("zero_optimization.stage", "value " + std::to_string(c.zero.stage) + ": " + c.optimizer.type_name +
                                            " is not compatible with ZeRO (DeepSpeed asserts ZeRO off for the 1-bit "
                                            "optimizers: they all-reduce each rank's whole momentum); use stage 0");
  if (c.optimizer.type == OptimizerType::Lamb)
    top.fail("optimizer.type", "Lamb needs whole tensors for its trust ratio; use zero_optimization.stage 0 with "
                               "Lamb, or Adam/AdamW with ZeRO stage " + std::to_string(c.zero.stage));
  if (c.optimizer.type == OptimizerType::SGD && !c.zero_allow_untested_optimizer)
    top.fail("optimizer.type", "SGD is not a ZeRO-tested optimizer in DeepSpeed; set "
                               "\"zero_allow_untested_optimizer\": true to use it with ZeRO stage " +
                               std::to_string(c.zero.stage));
}

// MiCS's hierarchical gather moves the parameters in their own dtype, qwZ's in int8:
// torch_autocast's gathers in the autocast dtype for the listed modules are not combined with them.
void check_shard_groups(Section& top, const Config& c) {
  if (c.zero.quantized_weights && c.precision.autocast.dtype != DType::F32)
    top.fail("zero_optimization.zero_quantized_weights",
             "is not combined with torch_autocast here (qwZ's gathers move every parameter as int8 groups, "
             "torch_autocast gathers its modules' parameters in the autocast dtype)");
  if (c.zero.mics_hierarchical_params_gather && c.precision.autocast.dtype != DType::F32)
    top.fail("zero_optimization.mics_hierarchical_params_gather",
             "is not combined with torch_autocast here (the hierarchical gather moves parameters in their own dtype, "
             "torch_autocast gathers its modules' parameters in the autocast dtype)");
}

// Offload runs DeepSpeed's CPU optimizers (DeepSpeedCPUAdam, DeepSpeedCPULion,
// DeepSpeedCPUAdagrad; others only without zero_force_ds_cpu_optimizer, which zero3d keeps on),
// and NVMe sub-groups need one buffer per state in flight.
void check_offload(Section& top, const Config& c) {
  const OffloadOptimizerConfig& o = c.zero.offload_optimizer;
  if (o.device == OffloadDevice::None) return;
  const OptimizerConfig& opt = c.optimizer;
  if (opt.type != OptimizerType::Adam && opt.type != OptimizerType::Lion && opt.type != OptimizerType::Adagrad)
    top.fail("zero_optimization.offload_optimizer.device",
             "offloaded optimizer state is updated by DeepSpeed's CPU optimizers (DeepSpeedCPUAdam, DeepSpeedCPULion, "
             "DeepSpeedCPUAdagrad), which need optimizer Adam, AdamW, Lion or Adagrad (got " + opt.type_name + ")");
  if (opt.type == OptimizerType::Adagrad) {
    // DeepSpeedCPUAdagrad(lr, eps, weight_decay): torch's lr_decay and initial_accumulator_value
    // are not among its parameters (DeepSpeed fails on them), and its decay differs (optimizers.hpp).
    for (const auto& [key, value] : {std::pair<const char*, double>{"lr_decay", opt.lr_decay},
                                     {"initial_accumulator_value", opt.initial_accumulator_value}})
      if (value != 0.0)
        top.report(std::string("optimizer.params.") + key,
                   "with offload_optimizer DeepSpeed runs DeepSpeedCPUAdagrad, which takes lr, eps and weight_decay "
                   "only: remove " + std::string(key) + " or the offload");
    if (opt.weight_decay > 0.0)
      top.note("note    `optimizer.params.weight_decay` with offload_optimizer: DeepSpeedCPUAdagrad adds the decay to "
               "the accumulated squares only and steps with the raw gradient (cpu_adagrad.cpp), unlike "
               "torch.optim.Adagrad without offload");
  }
  if (o.device != OffloadDevice::Nvme) return;
  // The states each sub-group swaps: the fp32 master copy (16-bit parameters with fp32 master
  // weights), then the optimizer's.
  const int64_t moments = opt.type == OptimizerType::Adam ? 2 : 1;
  const bool master = c.precision.param != DType::F32 && c.precision.master_weights == DType::F32;
  const int64_t states = moments + (master ? 1 : 0);
  const int64_t groups = 1 + (o.pipeline_read ? 1 : 0) + (o.pipeline_write ? 1 : 0);
  if (o.buffer_count < states * groups)
    top.fail("zero_optimization.offload_optimizer.buffer_count",
             "value " + std::to_string(o.buffer_count) + " is too small: each sub-group in flight needs " +
                 std::to_string(states) + " buffers (" + (master ? "fp32 master, " : "") +
                 (opt.type == OptimizerType::Adam ? "exp_avg, exp_avg_sq" : opt.type == OptimizerType::Lion ? "exp_avg" : "exp_avg_sq") +
                 ") and " +
                 std::to_string(groups) + " sub-group" + (groups > 1 ? "s are" : " is") +
                 " in flight (pipeline_read " + (o.pipeline_read ? "on" : "off") + ", pipeline_write " +
                 (o.pipeline_write ? "on" : "off") + "): at least " + std::to_string(states * groups));
}

// prescale_gradients and gradient_predivide_factor (DEEPSPEED-FACTS §5.6): where the mean of the
// data-parallel gradient sum divides (grad_reducer.hpp reduce_scaling). DeepSpeed applies them
// in its non-ZeRO all-reduce and in ZeRO-1/2's all-reduce path; its ZeRO-2/3 reduce-scatter
// asserts them off and its ZeRO-1 reduce-scatter always divides first. zero3d's reduce-scatter
// is the all-reduce restricted to each rank's part, so it applies them at every stage (without
// them, stages 1-3 divide first as DeepSpeed's reduce-scatter does).
void read_gradient_averaging(Section& top, Config& c) {
  const double inf = std::numeric_limits<double>::infinity();
  c.zero.prescale_gradients = top.boolean("prescale_gradients", false);
  c.zero.gradient_predivide_factor = top.number("gradient_predivide_factor", 1.0, 0.0, inf, /*lo_open=*/true);
  if (!c.zero.prescale_gradients && c.zero.gradient_predivide_factor == 1.0) return;
  const int64_t W = c.batch.world_size;
  const ReduceScaling r = reduce_scaling(c.zero.prescale_gradients, c.zero.gradient_predivide_factor, static_cast<int>(W),
                                         c.zero.stage >= 1);
  std::ostringstream os;
  os << "note    gradient averaging over " << W << " data-parallel rank" << (W == 1 ? "" : "s") << ": x" << r.pre
     << " before the sum, x" << r.post << " after ("
     << (c.zero.prescale_gradients ? std::string("prescale_gradients")
                                   : "gradient_predivide_factor " + show(json(c.zero.gradient_predivide_factor)))
     << (c.zero.prescale_gradients && c.zero.gradient_predivide_factor != 1.0
             ? "; gradient_predivide_factor applies only without prescale_gradients, as in DeepSpeed"
             : "")
     << ")";
  top.note(os.str());
}

}  // namespace zero3d::config_detail
