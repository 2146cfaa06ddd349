// config.hpp — plain option structs, and the one reader that fills them from JSON.
//
// Every module below the engine receives these structs, never JSON. The reader
// (config.cpp) is the only place that knows key names: it tracks which keys were read,
// rejects unknown ones with the nearest known key, fills defaults, derives the batch
// triad exactly as DeepSpeed does (DEEPSPEED-FACTS §1.2), and records the resolved
// configuration that a run writes to output/<run>/config.json.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "base/dtype.hpp"
#include "kernels/device.hpp"  // Backend
#include "model/activation_checkpointing.hpp"
#include "model/autocast.hpp"
#include "model/family.hpp"
#include "model/pld.hpp"
#include "model/sparse_attention.hpp"
#include "observe/observability_config.hpp"
#include "parallel/pipe_plan.hpp"

namespace zero3d {

// model.moe: Mixture of Experts (zero3d's key; DeepSpeed takes these as deepspeed.moe.layer.MoE
// arguments in Python, with these defaults: DEEPSPEED-FACTS-2 §4.1).
struct MoeConfig {
  int64_t num_experts = 0;  // 0: a dense model
  int64_t every = 1;        // an MoE MLP replaces the dense MLP in blocks every-1, 2·every-1, ... (0-based)
  int64_t ep_size = 1;      // experts split over this many data-parallel ranks
  int64_t k = 1;            // experts per token (top-1 or top-2 gating)
  double capacity_factor = 1.0, eval_capacity_factor = 1.0;
  int64_t min_capacity = 4;
  bool use_residual = false;            // PR-MoE: a dense MLP beside the experts, mixed by a learned coefficient
  std::string noisy_gate_policy;        // "" (None), "Jitter" or "RSample"
  bool drop_tokens = true, use_rts = true, top2_2nd_expert_sampling = true;
  bool enable_expert_tensor_parallelism = false;
  double aux_loss_coef = 0.01;  // weight of l_aux in the loss (Switch Transformer's alpha, Fedus et al. 2021)
  // Mixtral's router (model.architecture mixtral; the fields above then come from its keys):
  // Hugging Face's top-k with renormalised weights and load_balancing_loss_func, and
  // router_jitter_noise, MixtralSparseMoeBlock's multiplicative U(1-j, 1+j) noise on its input.
  bool mixtral_routing = false;
  double router_jitter_noise = 0.0;
  bool enabled() const { return num_experts > 0; }
  bool is_moe_block(int64_t l) const { return enabled() && (l + 1) % every == 0; }
};

// model: GPT-2 under its GPT2Config names (n_embd, n_layer, n_head, n_positions), or with
// `architecture` llama, mistral or qwen2 a Llama-family decoder under Hugging Face's config.json
// names (hidden_size, num_hidden_layers, num_attention_heads, seq_length for T; the rest in
// `family`), given in the section or read from a Hugging Face config.json (`hf_config`).
struct ModelConfig {
  int64_t vocab_size = 256;
  int64_t n_positions = 256;  // T: the sequence length trained on (the Llama family's seq_length)
  int64_t n_layer = 2;
  int64_t n_head = 2;
  int64_t n_embd = 64;
  // Megatron's make_vocab_size_divisible_by: the embedding and LM head hold the vocabulary
  // padded to a multiple of this × t (rows of zeros masked out of the loss, never saved), so
  // the head's products have tile-sized shapes. The reader's default: 1 on a CPU build, 128 on a GPU build.
  int64_t make_vocab_size_divisible_by = 1;
  std::string init_from;  // HDF5 or safetensors file with Hugging Face names; empty = init from seed
  std::string hf_config;  // the Hugging Face config.json the Llama family's knobs were read from (empty: none)
  DecoderFamily family;   // architecture (GPT2 by default) and the Llama family's knobs
  DropoutRates dropout;   // embd_pdrop, attn_pdrop, resid_pdrop (GPT-2), attention_dropout (the Llama family)
  MoeConfig moe;
  SparseAttention sparse_attention;  // the top-level `sparse_attention` section (a model property here)
  // model.frozen_parameters: regular expressions over the Hugging Face parameter names
  // (std::regex_search, as Python's re.search); a matching parameter is requires_grad=False
  // (config/frozen.cpp). Empty: every parameter trains.
  std::vector<std::string> frozen_parameters;
};

// Per parameter name (Hugging Face's), whether `patterns` (model.frozen_parameters) freeze it;
// each pattern is compiled once.
std::vector<bool> frozen_parameters_among(const std::vector<std::string>& names, const std::vector<std::string>& patterns);

enum class DataSource { Synthetic, Text, Tokens };

// Validation samples (synthetic ones, shuffled offsets) come from a random stream of their own:
// the same task as training, other samples. Messages name the role's key (data, data.validation).
enum class DataRole { Training, Validation };

// One source of samples: the training data, or the validation data.
struct DataSourceConfig {
  DataSource source = DataSource::Synthetic;
  std::string path;      // text file, or llm.c token shard(s) (a glob pattern is allowed)
  bool shuffle = false;  // false: llm.c's sequential windows; true: windows at seeded random offsets
  DataRole role = DataRole::Training;
};

struct DataConfig : DataSourceConfig {
  std::optional<DataSourceConfig> validation;  // data.validation; absent: nothing to evaluate
  // data.tokenizer: the text <-> ids mapping of the token data (text/tokenizer.hpp open_tokenizer);
  // empty: none named. Checked to exist when the config is read; opened by what needs text.
  std::string tokenizer;
};

struct TrainingConfig {
  int64_t steps = 100;
  uint64_t seed = 1234;
  std::string output_dir;    // where metrics.jsonl and config.json go
  double peak_gflops = 0.0;  // per-rank peak used for MFU; 0 = measure a short sgemm at start-up
  double comms_timeout = 1800.0;  // seconds a collective may wait before the job is aborted (NCCL's 30 min); 0 = off
  int64_t save_interval = 0;   // save a checkpoint every N steps (and at the end); 0 = never
  std::string save_dir;        // default <output_dir>/checkpoints
  int64_t keep_last = 0;       // keep the newest N checkpoints; 0 = all
  std::string resume;          // "latest", a tag, or a path; empty = start fresh
  int64_t eval_interval = 0;   // evaluate every N optimizer steps and after the last; 0 = never in training
  int64_t eval_steps = 10;     // evaluation rounds of train_batch_size validation samples (Megatron's eval-iters)
  // llm.c's samples while training: every sample_every steps (0: never), sample_tokens tokens
  // generated from the tokenizer's document delimiter, logged and written to samples.jsonl.
  int64_t sample_every = 0;
  int64_t sample_tokens = 64;
};

enum class OptimizerType { Adam, Lamb, SGD, Lion, Adagrad, OneBitAdam, ZeroOneAdam, OneBitLamb };

// One struct for all optimizers: each type reads the fields it owns (see config.cpp).
struct OptimizerConfig {
  OptimizerType type = OptimizerType::Adam;
  std::string type_name = "AdamW";
  double lr = 1e-3;
  double beta1 = 0.9, beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.0;
  bool bias_correction = true;
  bool adam_w_mode = true;       // Adam/AdamW: decoupled weight decay (DeepSpeed FusedAdam mode 1)
  bool eps_inside_sqrt = false;  // Lamb
  double max_coeff = 10.0, min_coeff = 0.01;  // Lamb and OneBitLamb trust-ratio clamp
  double momentum = 0.0, dampening = 0.0;     // SGD
  bool nesterov = false;                      // SGD
  double lr_decay = 0.0, initial_accumulator_value = 0.0;  // Adagrad (torch.optim.Adagrad)
  // 1-bit optimizers (DEEPSPEED-FACTS-2 §5.1): steps of uncompressed warm-up before the
  // variance freezes and the momentum is communicated through the 1-bit all-reduce; the
  // transport DeepSpeed names (nccl, mpi, hccl, compressed: the same algorithm, which zero3d
  // runs over its data-parallel communicator) and cuda_aware (MPI's device buffers; no effect).
  int64_t freeze_step = 100000;  // OneBitAdam, OneBitLamb
  std::string comm_backend_name = "nccl";
  bool cuda_aware = false;
  // ZeroOneAdam (onebit/zoadam.py): the last step that may update the variance, the variance
  // updates after which its interval doubles (the paper's kappa), the local steps after which
  // the local-step interval doubles, and that interval's ceiling (the paper's H).
  int64_t var_freeze_step = 100000, var_update_scaler = 16, local_step_scaler = 32678, local_step_clipper = 16;
  // OneBitLamb (onebit/lamb.py): the EMA rate of the frozen trust ratio and the clamps of the
  // compressed stage's scaling factor (absolute, and relative to the previous step's).
  double coeff_beta = 0.9, factor_max = 4.0, factor_min = 0.5, factor_threshold = 0.1;
  bool one_bit() const {
    return type == OptimizerType::OneBitAdam || type == OptimizerType::ZeroOneAdam || type == OptimizerType::OneBitLamb;
  }
};

enum class SchedulerType { None, WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle, LRRangeTest };

struct SchedulerConfig {
  SchedulerType type = SchedulerType::None;
  std::string type_name;
  // WarmupLR / WarmupDecayLR / WarmupCosineLR
  double warmup_min_lr = 0.0, warmup_max_lr = 1e-3;
  int64_t warmup_num_steps = 1000;
  bool warmup_log = true;  // warmup_type "log" (true) or "linear"
  int64_t total_num_steps = 0;
  double warmup_min_ratio = 0.0, cos_min_ratio = 1e-4;
  // OneCycle
  double cycle_min_lr = 0.0, cycle_max_lr = 0.0, decay_lr_rate = 0.0;
  int64_t cycle_first_step_size = 2000, cycle_second_step_size = 2000;
  int64_t cycle_first_stair_count = 0, cycle_second_stair_count = 0, decay_step_size = 0;
  bool cycle_momentum = true;
  double cycle_min_mom = 0.8, cycle_max_mom = 0.9, decay_mom_rate = 0.0;
  // LRRangeTest
  double lr_range_test_min_lr = 1e-3, lr_range_test_step_rate = 1.0;
  int64_t lr_range_test_step_size = 2000;
  bool lr_range_test_staircase = false;
};

// Where ZeRO-Offload / ZeRO-Infinity keep state (DEEPSPEED-FACTS-2 §3.1): in the device's
// memory (none), in host memory (cpu) or in files under nvme_path (nvme).
enum class OffloadDevice { None, Cpu, Nvme };

// zero_optimization.offload_optimizer: the optimizer partition (fp32 master and moments).
struct OffloadOptimizerConfig {
  OffloadDevice device = OffloadDevice::None;
  std::string nvme_path;
  int64_t buffer_count = 4;     // swap buffers, each one state of one sub-group
  bool pin_memory = true;       // page-locked host memory: no effect without a GPU
  bool pipeline_read = false;   // read sub-group k+1 while k is updated
  bool pipeline_write = false;  // write sub-group k back while k+1 is updated
  bool fast_init = false;       // DeepSpeed's shortcut when building swap files: results identical
  double ratio = 1.0;           // share of the sub-groups offloaded; the first (1-ratio) stay resident
};

// zero_optimization.offload_param (stage 3): this rank's parameter partition.
struct OffloadParamConfig {
  OffloadDevice device = OffloadDevice::None;
  std::string nvme_path;
  int64_t buffer_count = 5;          // swap buffers for units being read
  int64_t buffer_size = 100000000;   // elements per buffer: one unit's partition must fit
  int64_t max_in_cpu = 1000000000;   // parameter elements kept cached in memory
  bool pin_memory = true;
};

// The `aio` section: how swap files are read and written (asynchronous direct I/O).
struct AioConfig {
  int64_t block_size = 1048576;   // bytes per I/O request
  int64_t queue_depth = 8;        // requests in flight per I/O thread
  int intra_op_parallelism = 1;   // I/O threads a transfer is split over (old name thread_count)
  bool single_submit = false;     // submit requests one by one instead of in batches
  bool overlap_events = true;     // refill the queue as requests complete instead of batch by batch
};

// zero_optimization (DEEPSPEED-FACTS §5.1), what the ZeRO optimizer reads.
// zero_optimization.zeropp_loco_param (LoCo, Xie et al. 2024; DeepSpeed's
// all_to_all_loco_quant_reduce): each quantisation adds the error it kept and keeps
// err_beta·kept + (1 − err_beta)·its new error; a tensor's errors restart at zero after reset_T
// reductions (parallel/quantized_reduce_scatter.hpp counts them as DeepSpeed does).
struct LocoConfig {
  bool enabled = false;
  double err_beta = 0.8;
  int64_t reset_T = 1024;
};

struct ZeroConfig {
  int stage = 0;
  int64_t reduce_bucket_size = 500000000;     // elements per gradient reduction bucket
  int64_t allgather_bucket_size = 500000000;  // elements per parameter all-gather bucket (stages 1-2)
  bool overlap_comm = false;                  // launch bucket reductions during backward
  // stage 3
  int64_t prefetch_bucket_size = 50000000;
  int64_t param_persistence_threshold = 100000;
  int64_t model_persistence_threshold = INT64_MAX;
  int64_t max_live_parameters = 1000000000;
  int64_t max_reuse_distance = 1000000000;
  // offload
  OffloadOptimizerConfig offload_optimizer;
  OffloadParamConfig offload_param;
  int64_t sub_group_size = 1000000000;  // optimizer elements updated (and swapped) together
  AioConfig aio;
  // stage3_gather_16bit_weights_on_model_save: each save also writes the consolidated weights
  // (Hugging Face layout, the model's dtype) as DeepSpeed's save_16bit_model does.
  bool gather_16bit_weights_on_model_save = false;
  // bf16.bf16_master_weights_and_grads / bf16_optimizer_states, which DeepSpeed hands to its ZeRO
  // optimizer: the master weights' type (F32: an fp32 copy beside 16-bit parameters; BF16: the
  // bf16 parameters are the master) and the optimizer states' type.
  DType master_weights = DType::F32, optimizer_states = DType::F32;
  // prescale_gradients / gradient_predivide_factor: the factors around the gradient sum
  // (grad_reducer.hpp reduce_scaling).
  bool prescale_gradients = false;
  double gradient_predivide_factor = 1.0;
  // MiCS and ZeRO++'s hpZ (stage 3; zero/shard_groups.hpp): mics_shard_size (0: off; DeepSpeed's
  // -1), mics_hierarchical_params_gather, zero_hpz_partition_size (1: off).
  int mics_shard_size = 0;
  bool mics_hierarchical_params_gather = false;
  int hpz_partition_size = 1;
  // zero_quantized_weights: ZeRO++'s qwZ, stage 3's parameter gathers in int8 groups
  // (parallel/quantized_gather.hpp).
  bool quantized_weights = false;
  // zero_quantized_nontrainable_weights: ZeRO++'s int8 storage of frozen parameters' stage-3 shards
  // (DeepSpeed partition_parameters.py quantized_nontrainable_weights).
  bool quantized_nontrainable_weights = false;
  // zero_quantized_gradients: ZeRO++'s qgZ, stage 3's gradient reduce-scatter as int4 all-to-alls
  // inside then across nodes (parallel/quantized_reduce_scatter.hpp).
  bool quantized_gradients = false;
  // zeropp_loco_param: LoCo-ZeRO++'s error feedback for qgZ's two quantisations.
  LocoConfig loco;
};

// fp16 / bf16 / communication_data_type / data_types (DEEPSPEED-FACTS §1.4, §2).
struct PrecisionConfig {
  DType param = DType::F32;       // model dtype: fp16.enabled -> F16, bf16.enabled -> BF16
  DType grad_accum = DType::F32;  // data_types.grad_accum_dtype (default: the model dtype)
  DType comm = DType::F32;        // communication_data_type (default: the model dtype)
  // fp16 loss scaling
  double loss_scale = 0.0;        // 0 = dynamic, else a static scale
  int initial_scale_power = 16;
  int64_t loss_scale_window = 1000;
  int hysteresis = 2;
  bool consecutive_hysteresis = false;
  double min_loss_scale = 1.0;
  // bf16: skip steps whose gradients hold inf/NaN
  bool check_grad_overflow = true;
  // bf16.bf16_master_weights_and_grads (BF16: no fp32 master copy) and bf16_optimizer_states
  // (BF16 moments); the reader copies both into ZeroConfig, whose optimizer applies them.
  DType master_weights = DType::F32, optimizer_states = DType::F32;
  // torch_autocast: fp32 parameters (param F32), products in autocast.dtype, the listed modules'
  // parameters communicated in it; the fp16 loss scaler is torch's GradScaler.
  AutocastConfig autocast;
  // The dtype the model's matrix products run in (GPT::compute_type): bf16 for bf16 parameters,
  // torch_autocast's dtype, else fp32 (fp16 widens its weights for sgemm).
  DType products() const { return param == DType::BF16 ? DType::BF16 : param == DType::F32 ? autocast.dtype : DType::F32; }
};

// tensor_parallel (DeepSpeed's AutoTP keys, DEEPSPEED-FACTS-2 §1.11; Megatron's layer splits).
struct TensorParallelConfig {
  int size = 1;                    // autotp_size; 0 and 1 mean off
  bool overlap_comm = false;       // tp_overlap_comm: the input-gradient all-reduce runs under the weight product
  bool sequence_parallel = false;  // zero3d's key (Megatron sequence parallelism)
  // DeepSpeed's AutoTP rules (preset_model, partition_config): zero3d's split is fixed by the
  // architecture, so they are checked against it at validation (config/autotp.cpp) and change
  // nothing else. The preset's name, "" when none.
  std::string preset_model;
};

// The batch triad after derivation: train_batch_size == micro_batch * gas * world_size.
// Hugging Face's TrainingArguments default per_device_train_batch_size, which its DeepSpeed
// integration writes where a config says "auto" (transformers integrations/deepspeed.py
// trainer_config_process).
constexpr int64_t kHfPerDeviceBatch = 8;

struct BatchConfig {
  int64_t train_batch_size = 0;
  int64_t micro_batch = 0;  // train_micro_batch_size_per_gpu
  int64_t gradient_accumulation_steps = 0;
  int64_t world_size = 1;   // data-parallel size used for the derivation (ranks ÷ pipeline stages)
  std::string derivation;   // human-readable account printed at start-up
  // train_micro_batch_size_per_gpu "auto" with nothing to derive it from: Hugging Face's default
  // (8) stands in until the memory planner, which sits above config, chooses the largest that
  // fits (train/estimator.hpp resolve_config); the two flags say which other keys were "auto".
  bool micro_batch_from_memory = false;
  bool accumulation_auto = false, train_batch_auto = false;
};

// autotuning (DEEPSPEED-FACTS §10; autotune.hpp): DeepSpeed's keys and defaults.
struct AutotuningConfig {
  bool enabled = false;  // on `train`: autotune first, then train with ds_config_optimal.json
  bool fast = true;      // true: ZeRO stage x micro-batch only; false: also layouts and checkpointing
  std::string results_dir = "autotuning_results", exps_dir = "autotuning_exps";
  bool overwrite = true;  // remove both directories first
  int64_t start_profile_step = 3, end_profile_step = 5;
  std::string metric = "throughput";      // throughput (samples/s), latency (step ms) or flops (per rank)
  std::string tuner_type = "gridsearch";  // gridsearch, random or model_based
  int64_t tuner_early_stopping = 5, tuner_num_trials = 50;
  int64_t max_train_batch_size = 0;  // 0: none given
  int64_t min_train_batch_size = 1;
  int64_t max_train_micro_batch_size_per_gpu = 1024, min_train_micro_batch_size_per_gpu = 1;
  int64_t num_tuning_micro_batch_sizes = 3;
};

// The `checkpoint` section (DEEPSPEED-FACTS §1.4, §7; config/checkpoint.cpp reads it,
// checkpoint_options.hpp applies it).
struct CheckpointOptions {
  std::string tag_validation = "Warn";  // Ignore, Warn or Fail: zero3d's tags agree by construction
  // Resume from DeepSpeed's tag file for universal checkpoints, `latest_universal`, when the
  // save_dir has one; every zero3d tag is universal (loads at any layout) either way.
  bool load_universal = false;
  // training.save_dir is storage of each node's own: the first rank of every node publishes the
  // tag there (index, manifest, `latest`) beside its node's shards, and each rank resumes from
  // the shards on its node.
  bool use_node_local_storage = false;
  // DeepSpeed: the data-parallel ranks of a pipeline stage share writing its layers. zero3d's
  // ranks always write their own slices, whatever the value.
  bool parallel_write_pipeline_stage = false;
};

// The `inference` section: DeepSpeed's init_inference keys (DeepSpeedInferenceConfig,
// deepspeed/inference/config.py) as zero3d generate reads them (config/inference.cpp); train
// reads and checks them and leaves them alone.
struct InferenceConfig {
  bool given = false;                 // the section is there
  std::optional<DType> dtype;         // `dtype`: the model dtype generation runs in (else the training config's)
  int64_t tp_size = 0;                // `tensor_parallel.tp_size`, `mp_size`: tensor ranks (0: not given)
  int64_t max_out_tokens = 0;         // prompt and new tokens per sequence at most (0: the model's positions)
  int64_t min_out_tokens = 0;         // new tokens every prompt must have room for (0: not given)
  std::string checkpoint;             // `checkpoint` (under `base_dir`): what --checkpoint names when not given
  int zero_stage = -1;                // `zero.stage`: ZeRO-Inference's stage 3 partitions the weights (-1: not given)
  std::vector<std::string> no_effect; // "key: why", for keys that change nothing on this build
};

struct Config {
  std::string file;  // where it came from, for messages
  ModelConfig model;
  DataConfig data;
  TrainingConfig training;
  OptimizerConfig optimizer;
  SchedulerConfig scheduler;
  BatchConfig batch;
  double gradient_clipping = 1.0;  // DeepSpeed 0.19.6 default; 0 disables
  int64_t steps_per_print = 10;
  bool wall_clock_breakdown = false;
  bool memory_breakdown = false;  // a memory line at each report point (DeepSpeed's see_memory_usage)
  ZeroConfig zero;
  PrecisionConfig precision;
  PipelineConfig pipeline;
  TensorParallelConfig tensor;
  ActivationCheckpointing activation_checkpointing;  // `activation_checkpointing` + pipeline.activation_checkpoint_interval
  std::vector<int> pipe_bounds;  // p·v + 1 boundaries into gpt_pipe_layers() (pipe_plan.hpp)
  bool zero_allow_untested_optimizer = false;
  ObservabilityConfig observability;  // flops_profiler, csv_monitor, tensorboard, comms_logger, trace
  AutotuningConfig autotuning;
  CheckpointOptions checkpoint;
  PldConfig pld;  // `progressive_layer_drop` (config/pld.cpp)
  InferenceConfig inference;  // `inference` (config/inference.cpp)
  // The build the config is read and planned for: this binary's, except for `zero3d estimate
  // --device`, which plans another's (a GPU run's defaults, kernels and memory from a CPU build).
  kernels::Backend backend = kernels::kBuildBackend;
  nlohmann::json resolved;  // every key with its value after defaults and derivation
  // Start-up lines: each "auto" value with where it came from, keys with no effect on this
  // build with the reason, warnings DeepSpeed gives too. Printed once by validate and train.
  std::vector<std::string> notes;
};

// Why zero3d generate (and training.sample_every) cannot run this config's model or layout: the
// key, its value and the reason; empty when it can (config/inference.cpp).
std::string generation_refusal(const Config& c);

// The config with the `inference` section's layout in the keys training reads: `dtype` as
// bf16/fp16 `enabled`, `tensor_parallel.tp_size` as tensor_parallel.autotp_size. `inference` is
// the section as a first read of `root` found it.
nlohmann::json with_inference_layout(const nlohmann::json& root, const InferenceConfig& inference);

// Parses JSON text; syntax errors name file:line:column. Duplicate keys are rejected.
nlohmann::json parse_json_text(const std::string& text, const std::string& file);

// Reads a file and parses it (parse_json_text). Unreadable file -> InputError naming it.
nlohmann::json load_json_file(const std::string& path);

// Applies one `--set key.path=value` override; value is parsed as JSON, else taken as a string.
void apply_override(nlohmann::json& root, const std::string& assignment);

// Validates and resolves a whole config for a job of `world_size` ranks (pipeline stages ×
// data-parallel ranks × tensor ranks; the batch triad is derived over the data-parallel size).
// Reads the whole config in one pass: throws InputError naming the file, key and value of each
// problem (one line for one problem; "N problems in FILE:" and one line each for several).
// set_keys: the key paths command-line --set overrides gave, so that a problem with one names
// --set rather than the file. backend: the build the config is read and planned for (Config::backend).
Config read_config(const nlohmann::json& root, const std::string& file, int64_t world_size,
                   const std::vector<std::string>& set_keys = {}, kernels::Backend backend = kernels::kBuildBackend);

// The `model` section alone, as read_config reads it (every key checked, defaults filled in):
// for a checkpoint's saved, resolved model section, which `zero3d convert` turns back into the
// model it describes. `file` names the source in messages. InputError on any problem.
ModelConfig read_model_section(const nlohmann::json& model, const std::string& file);

// Lightning's DeepSpeed strategy names (deepspeed, deepspeed_stage_1 … deepspeed_stage_3_offload_nvme)
// and the config each expands to: DeepSpeedStrategy's defaults. A config's `strategy` key (or
// --strategy) puts the preset beneath the config's own keys. null for an unknown name.
nlohmann::json strategy_preset(const std::string& name);
const std::vector<std::string>& strategy_names();

// The built-in quick-start configuration (also shipped as input/quickstart.json).
nlohmann::json quickstart_json();

}  // namespace zero3d
