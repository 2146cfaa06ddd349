// config.cpp — the only JSON reader. See config.hpp for the contract.


#include "base/errors.hpp"
#include "base/input_file.hpp"
#include "config/config.hpp"
#include "config/section.hpp"
#include "kernels/device.hpp"
#include "parallel/pipe_schedule.hpp"
#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <cmath>
#include <fstream>
#include <functional>
#include <limits>
#include <optional>
#include <sstream>
#include <sys/stat.h>

namespace zero3d {

using json = nlohmann::json;

namespace {
using namespace config_detail;

// Default training.comms_timeout in seconds: NCCL's and DeepSpeed's default of 30 minutes.
constexpr double kDefaultCommsTimeout = 1800.0;

// a * b, or nullopt when the product leaves int64 (the batch triad multiplies user values).
std::optional<int64_t> checked_mul(int64_t a, int64_t b) {
  int64_t out = 0;
  if (__builtin_mul_overflow(a, b, &out)) return std::nullopt;
  return out;
}

// --- batch triad (DEEPSPEED-FACTS §1.2: config.py _set_batch_related_parameters) -----------

// auto_micro: set when train_micro_batch_size_per_gpu is "auto" and nothing derives it; the
// micro-batch is then HF's default until the memory planner chooses it (train/estimator.hpp
// resolve_config).
// autotuning: the config is the autotuner's input (autotuning.enabled), which may leave the
// batch to it; absent batch keys are then checked at micro-batch 1, the autotuner's first size.
BatchConfig derive_batch(Section& top, int64_t world_size, bool& auto_micro, bool autotuning) {
  if (world_size < 1) top.fail("train_batch_size", "world size " + std::to_string(world_size) + " is not positive");
  // "auto" (Hugging Face style) means: derive this one from the others.
  std::vector<std::string> autos;
  auto read = [&](const char* key) -> std::optional<int64_t> {
    if (top.is_auto(key)) {
      top.mark_known(key);
      autos.push_back(key);
      return std::nullopt;
    }
    const json* v = top.raw(key);
    if (!v) return std::nullopt;
    if (!v->is_number_integer()) top.fail_key(key, "expected an integer, got " + show(*v));
    // Bounded so that micro * gas * world and every buffer sized from them stay in int64.
    if (v->is_number_unsigned() ? v->get<uint64_t>() > uint64_t(kMaxInt) : v->get<int64_t>() > kMaxInt)
      top.fail_key(key, "value " + show(*v) + " is out of range (at most " + std::to_string(kMaxInt) + ")");
    // Checked before the derivation divides by it.
    if (v->get<int64_t>() <= 0) top.fail_key(key, "must be greater than 0, got " + show(*v));
    return v->get<int64_t>();
  };
  for (const char* key : {"train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"})
    top.mark_known(key);  // a problem with one must not make the others look unknown
  std::optional<int64_t> T = read("train_batch_size");
  std::optional<int64_t> M = read("train_micro_batch_size_per_gpu");
  std::optional<int64_t> G = read("gradient_accumulation_steps");
  const int64_t W = world_size;
  const bool m_auto = std::find(autos.begin(), autos.end(), "train_micro_batch_size_per_gpu") != autos.end();
  const bool t_auto = std::find(autos.begin(), autos.end(), "train_batch_size") != autos.end();
  std::ostringstream how;
  if (!T && !M && !G && !m_auto && !t_auto && autotuning) {
    M = 1;
    top.note("auto    train_micro_batch_size_per_gpu = 1 (autotuning.enabled: the autotuner chooses the micro-batch; "
             "checked at its first size)");
  }
  if (!T && !M && (m_auto || t_auto)) {
    // Nothing fixes the micro-batch: HF would take per_device_train_batch_size (default 8);
    // zero3d takes at most that, as much as the memory planner says fits (resolved at the end).
    M = kHfPerDeviceBatch;
    auto_micro = true;
  }
  if (T && M && G) {
    how << "all three given";
  } else if (T && M) {
    G = (*T / *M) / W;
    how << "gradient_accumulation_steps = (" << *T << " // " << *M << ") // " << W << " = " << *G;
  } else if (T && G) {
    M = (*T / W) / *G;
    how << "train_micro_batch_size_per_gpu = (" << *T << " // " << W << ") // " << *G << " = " << *M;
  } else if (M && G) {
    const auto mg = checked_mul(*M, *G);
    const auto mgw = mg ? checked_mul(*mg, W) : std::nullopt;
    if (!mgw || *mgw > kMaxInt)
      top.fail("train_batch_size", "train_micro_batch_size_per_gpu * gradient_accumulation_steps * world size = " +
                                       std::to_string(*M) + " * " + std::to_string(*G) + " * " + std::to_string(W) +
                                       " exceeds " + std::to_string(kMaxInt));
    T = *mgw;
    how << "train_batch_size = " << *M << " * " << *G << " * " << W << " = " << *T;
  } else if (T) {
    G = 1;
    M = *T / W;
    how << "gradient_accumulation_steps = 1, train_micro_batch_size_per_gpu = " << *T << " // " << W << " = " << *M;
  } else if (M) {
    G = 1;
    const auto mw = checked_mul(*M, W);
    if (!mw || *mw > kMaxInt)
      top.fail("train_batch_size", "train_micro_batch_size_per_gpu * world size = " + std::to_string(*M) + " * " +
                                       std::to_string(W) + " exceeds " + std::to_string(kMaxInt));
    T = *mw;
    how << "gradient_accumulation_steps = 1, train_batch_size = " << *M << " * " << W << " = " << *T;
  } else {
    top.fail("train_batch_size", "either train_batch_size or train_micro_batch_size_per_gpu needs to be provided");
  }
  auto positive = [&](const char* key, int64_t v) {
    if (v <= 0)
      top.fail(key, "must be greater than 0, got " + std::to_string(v) + " (" + how.str() + ", world size " +
                        std::to_string(W) + ")");
  };
  positive("train_batch_size", *T);
  positive("train_micro_batch_size_per_gpu", *M);
  positive("gradient_accumulation_steps", *G);
  const auto mg = checked_mul(*M, *G);
  const auto product = mg ? checked_mul(*mg, W) : std::nullopt;
  if (!product || *T != *product)
    top.fail("train_batch_size",
             "train_batch_size is not equal to micro_batch_per_gpu * gradient_acc_step * world_size: " +
                 std::to_string(*T) + " != " + std::to_string(*M) + " * " + std::to_string(*G) + " * " +
                 std::to_string(W));
  BatchConfig b;
  b.train_batch_size = *T;
  b.micro_batch = *M;
  b.gradient_accumulation_steps = *G;
  b.world_size = W;
  std::ostringstream out;
  out << "train_batch_size " << *T << " = micro_batch " << *M << " x gradient_accumulation_steps " << *G
      << " x data-parallel size " << W << " (" << how.str() << ")";
  b.derivation = out.str();
  for (const std::string& key : autos) {
    if (auto_micro) break;  // noted when the planner has chosen the micro-batch
    const int64_t v = key == "train_batch_size" ? *T : key == "gradient_accumulation_steps" ? *G : *M;
    top.note("auto    " + key + " = " + std::to_string(v) + " (derived from the other batch keys: " + how.str() + ")");
  }
  return b;
}

// "(vocab_size 256, n_positions 256, n_layer 2, n_head 2, n_embd 64)": a model's shape for a note.
std::string default_model_text(const ModelConfig& m) {
  return "(vocab_size " + std::to_string(m.vocab_size) + ", n_positions " + std::to_string(m.n_positions) +
         ", n_layer " + std::to_string(m.n_layer) + ", n_head " + std::to_string(m.n_head) + ", n_embd " +
         std::to_string(m.n_embd) + ")";
}

// The pipeline's layer list of the model (DeepSpeed's "parameters" partition weighs its layers).
std::vector<PipeLayer> pipe_layers_of(const ModelConfig& m) {
  if (!m.family.llama()) return gpt_pipe_layers(m.vocab_size, m.n_positions, m.n_layer, m.n_embd);
  const DecoderFamily& f = m.family;
  const int64_t C = m.n_embd, V = m.vocab_size, A = m.n_head * f.head_dim, QKV = A + 2 * f.num_key_value_heads * f.head_dim,
                I = f.intermediate_size;
  // two RMSNorms, q/k/v, o_proj, gate/up/down (model_layout.cpp llama_block_tensors)
  // (Mixtral: the router and its experts in place of the MLP)
  const int64_t mlp = f.mixtral() ? m.moe.num_experts * C + m.moe.num_experts * 3 * I * C : 3 * I * C;
  const int64_t block = 2 * C + QKV * C + (f.qkv_bias ? QKV : 0) + C * A + (f.o_bias ? C : 0) + mlp +
                        (f.mlp_bias ? 2 * I + C : 0);
  return decoder_pipe_layers(V * C, block, m.n_layer, C + V * C);
}

// The Llama family's keys, which GPT-2's section does not take.
const std::vector<std::string> kLlamaFamilyKeys = {
    "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
    "head_dim", "rms_norm_eps", "rope_theta", "rope_scaling", "rope_parameters", "max_position_embeddings",
    "tie_word_embeddings", "attention_bias", "mlp_bias", "sliding_window", "use_sliding_window",
    "max_window_layers", "seq_length", "hidden_act", "initializer_range", "attention_dropout", "num_local_experts",
    "num_experts_per_tok", "router_aux_loss_coef", "router_jitter_noise", "output_router_logits"};

ModelConfig read_model(Section& top, kernels::Backend backend) {
  ModelConfig m;
  Section sec = top.child("model");
  // hf_config first: its model_type is the architecture unless the section names one
  m.hf_config = sec.path("hf_config", "");
  json hf;
  std::string hf_file;
  if (!m.hf_config.empty()) {
    try {
      hf = read_hf_config_file(sec, m.hf_config, &hf_file);
    } catch (const KeyProblem&) {
    } catch (const InputError& e) {
      sec.report_key("hf_config", e.what());
    }
  }
  const json* model_type = hf.is_object() && hf.contains("model_type") ? &hf["model_type"] : nullptr;
  const std::vector<std::string> families = {"gpt2", "llama", "mistral", "qwen2", "mixtral"};
  std::string arch = sec.choice("architecture", "gpt2", families);
  if (!sec.has("architecture") && model_type) {
    arch = model_type->is_string() ? model_type->get<std::string>() : show(*model_type);
    if (std::find(families.begin(), families.end(), arch) == families.end() || arch == "gpt2") {
      sec.report_key("hf_config", hf_file + ": model_type " + show(*model_type) +
                                      " is not a family zero3d reads from a Hugging Face config (llama, mistral, qwen2, "
                                      "mixtral)");
      return m;
    }
    sec.record("architecture", arch);
  } else if (model_type && *model_type != arch) {
    sec.report_key("architecture", "value " + show(json(arch)) + " differs from model_type " + show(*model_type) +
                                       " in " + hf_file);
    return m;  // the one problem to report: the file's keys are another family's
  }
  // Megatron's _vocab_size_with_padding: a GPU's products want tile-sized shapes (128 as Megatron's
  // default, llm.c's 50,304 for GPT-2); a CPU build keeps the vocabulary as it is (its bits).
  m.make_vocab_size_divisible_by =
      sec.integer("make_vocab_size_divisible_by", backend == kernels::Backend::Gpu ? 128 : 1, 1, 1 << 16);
  if (arch != "gpt2") {
    const Architecture a = arch == "llama"     ? Architecture::Llama
                           : arch == "mistral" ? Architecture::Mistral
                           : arch == "qwen2"   ? Architecture::Qwen2
                                               : Architecture::Mixtral;
    read_llama_family(sec, m, a, hf.is_object() ? &hf : nullptr, hf_file);
    m.init_from = sec.path("init_from", "");
    if (a == Architecture::Mixtral) {
      read_mixtral_moe(sec, m.moe);
    } else {
      m.moe = read_moe(sec);
      if (m.moe.enabled())
        sec.report("model.moe.num_experts", "zero3d's MoE layers replace GPT-2 MLPs; a " + arch +
                                                " block has a dense MLP (model.architecture mixtral has sparse MoE blocks)");
    }
    read_frozen_parameters(sec, m);
    sec.finish();
    return m;
  }
  // today's GPT-2 section resolves as it always did: no architecture or hf_config keys unless given
  if (!sec.has("architecture")) sec.forget("architecture");
  if (!sec.has("hf_config")) sec.forget("hf_config");
  if (!m.hf_config.empty())
    sec.report_key("hf_config", "reads a Llama-family config.json (llama, mistral, qwen2, mixtral); model.architecture gpt2 "
                                "takes its sizes from n_embd, n_layer, n_head and n_positions");
  for (const std::string& key : kLlamaFamilyKeys) {
    sec.mark_known(key);
    if (sec.has(key))
      sec.report_key(key, "a key of the Llama family; set model.architecture to llama, mistral, qwen2 or mixtral (GPT-2 "
                          "takes n_embd, n_layer, n_head and n_positions)");
  }
  m.vocab_size = sec.integer("vocab_size", 256, 2, 1 << 24);
  m.n_positions = sec.integer("n_positions", 256, 1, 1 << 20);
  m.n_layer = sec.integer("n_layer", 2, 1, 4096);
  m.n_head = sec.integer("n_head", 2, 1, 4096);
  m.n_embd = sec.integer("n_embd", 64, 1, 1 << 20);
  if (m.n_embd % m.n_head != 0)
    sec.report_key("n_embd", "value " + std::to_string(m.n_embd) + " is not divisible by n_head (" +
                               std::to_string(m.n_head) + ")");
  m.init_from = sec.path("init_from", "");
  m.moe = read_moe(sec);
  // Hugging Face GPT2Config's dropouts (its default is 0.1 each; zero3d's 0, no dropout)
  m.dropout.embd = read_dropout_probability(sec, "embd_pdrop");
  m.dropout.attn = read_dropout_probability(sec, "attn_pdrop");
  m.dropout.resid = read_dropout_probability(sec, "resid_pdrop");
  read_frozen_parameters(sec, m);
  sec.finish({"n_ctx", "activation_function", "layer_norm_epsilon", "n_inner", "scale_attn_weights", "use_cache"});
  return m;
}

// The keys of one data source (data, data.validation); `source_default` when none is given.
DataSourceConfig read_data_source(Section& top, Section& sec, const ModelConfig& model, const std::string& source_default) {
  DataSourceConfig d;
  std::string src = sec.choice("source", source_default, {"synthetic", "text", "tokens"});
  d.source = src == "text" ? DataSource::Text : src == "tokens" ? DataSource::Tokens : DataSource::Synthetic;
  d.path = sec.path("path", "");
  d.shuffle = sec.boolean("shuffle", false);
  if (d.source != DataSource::Synthetic && d.path.empty())
    sec.report_key("path", "is required when " + sec.key_path("source") + " is \"" + src + "\"");
  if (d.source == DataSource::Synthetic && !d.path.empty())  // never read: training on it would be a silent substitute
    sec.report_key("path", "value " + show(json(d.path)) + " is not read: " + sec.key_path("source") +
                               " is \"synthetic\"" + (sec.has("source") ? "" : " (the default)") +
                               "; set it to \"text\" (bytes) or \"tokens\" (llm.c .bin shards)");
  if (d.source == DataSource::Text && model.vocab_size < 256)
    top.report("model.vocab_size", "byte-level text needs vocab_size >= 256, got " + std::to_string(model.vocab_size));
  return d;
}

DataConfig read_data(Section& top, const ModelConfig& model) {
  DataConfig d;
  Section sec = top.child("data");
  static_cast<DataSourceConfig&>(d) = read_data_source(top, sec, model, "synthetic");
  // Only its existence is checked here: opening a tokenizer (megabytes of JSON) is left to the
  // commands that turn text into ids or back.
  d.tokenizer = sec.path("tokenizer", "");
  if (!d.tokenizer.empty()) {
    struct stat st{};
    if (::stat(d.tokenizer.c_str(), &st) != 0)
      sec.report_key("tokenizer", "path " + show(json(d.tokenizer)) + " does not exist (a tokenizer.json, a "
                                  "SentencePiece .model, or a directory holding one or GPT-2's encoder.json + vocab.bpe)");
    else if (!S_ISREG(st.st_mode) && !S_ISDIR(st.st_mode))
      sec.report_key("tokenizer", "path " + show(json(d.tokenizer)) + " is neither a file nor a directory");
  }
  // data.validation: the same kinds of source, of the training data's kind unless it says otherwise.
  if (sec.has("validation")) {
    Section val = sec.child("validation");
    const std::string kind = d.source == DataSource::Text ? "text" : d.source == DataSource::Tokens ? "tokens" : "synthetic";
    d.validation = read_data_source(top, val, model, kind);
    d.validation->role = DataRole::Validation;
    val.finish();
  }
  sec.finish();
  return d;
}

TrainingConfig read_training(Section& top, const DataConfig& data) {
  TrainingConfig t;
  Section sec = top.child("training");
  t.steps = sec.integer("steps", 100, 0, kMaxInt * 1000LL);
  t.seed = static_cast<uint64_t>(sec.integer("seed", 1234, 0, std::numeric_limits<int64_t>::max()));
  t.output_dir = sec.path("output_dir", "");
  t.peak_gflops = sec.number("peak_gflops", 0.0, 0.0, 1e12);
  t.comms_timeout = sec.number("comms_timeout", kDefaultCommsTimeout, 0.0, 1e9);
  t.save_interval = sec.integer("save_interval", 0, 0, kMaxInt * 1000LL);
  t.save_dir = sec.path("save_dir", "");
  t.keep_last = sec.integer("keep_last", 0, 0, kMaxInt);
  // "auto": the save_dir's latest checkpoint when there is one, else a fresh start (a requeued
  // batch job runs the same command every time).
  if (sec.is_auto("resume")) {
    sec.mark_known("resume");
    sec.record("resume", "auto");
    t.resume = "auto";
  } else {
    t.resume = sec.path("resume", "");
  }
  t.eval_interval = sec.integer("eval_interval", 0, 0, kMaxInt * 1000LL);
  t.eval_steps = sec.integer("eval_steps", 10, 1, kMaxInt);
  if (t.eval_interval > 0 && !data.validation)
    sec.report_key("eval_interval", "value " + std::to_string(t.eval_interval) +
                                      " evaluates on validation data, but `data.validation` is not given");
  t.sample_every = sec.integer("sample_every", 0, 0, kMaxInt * 1000LL);
  t.sample_tokens = sec.integer("sample_tokens", 64, 1, 1 << 20);
  sec.finish();
  return t;
}

// training.sample_every (llm.c's samples while training) runs generation's decoder on the model
// being trained: the layouts generation cannot run are refused here, with generation's reason.
void check_training_samples(Section& top, const Config& c) {
  const TrainingConfig& t = c.training;
  if (t.sample_every <= 0) return;
  const std::string every = "value " + std::to_string(t.sample_every) + ": ";
  const std::string why = generation_refusal(c);
  if (!why.empty())
    top.report("training.sample_every", every + "samples are generated as zero3d generate generates, and " + why);
  if (c.data.tokenizer.empty())
    top.report("training.sample_every", every + "samples start from the tokenizer's document delimiter and are "
                                                "logged as text: give data.tokenizer");
  if (t.sample_tokens + 1 > c.model.n_positions)
    top.report("training.sample_tokens", "value " + std::to_string(t.sample_tokens) +
                                             ": the start token and the samples' tokens exceed model.n_positions (" +
                                             std::to_string(c.model.n_positions) + "), the length the model trains on");
}

// The `pipeline` section (DEEPSPEED-FACTS-2 §2.1): DeepSpeed's keys with its defaults, plus
// zero3d's schedule and virtual_stages.
PipelineConfig read_pipeline(Section& top, std::optional<int>& checkpoint_interval) {
  Section sec = top.child("pipeline");
  PipelineConfig p;
  p.stages = static_cast<int>(sec.integer_or_auto("stages", 1, 1, 1, 1 << 16));
  const std::string part = sec.string("partition", "parameters");
  const std::string low = lower(part);
  if (low == "parameters" || low == "best") {
    p.partition = PartitionMethod::Parameters;
    p.partition_name = "parameters";
  } else if (low == "uniform") {
    p.partition = PartitionMethod::Uniform;
    p.partition_name = "uniform";
  } else if (low.rfind("type:", 0) == 0) {
    p.partition = PartitionMethod::Type;
    p.type_regex = part.substr(5);
    p.partition_name = part;
  } else {
    sec.report_key("partition", "value " + show(json(part)) +
                                  " is not one of: parameters (\"best\"), uniform, type:<regex> (\"profile\" is "
                                  "not implemented by DeepSpeed either)");
  }
  sec.record("partition", p.partition_name);
  const std::string sched = sec.choice("schedule", "1f1b", {"1f1b", "interleaved", "zb-h1"});
  p.schedule_name = sched;
  p.schedule = sched == "1f1b" ? pipe::ScheduleKind::OneFOneB
               : sched == "interleaved" ? pipe::ScheduleKind::Interleaved : pipe::ScheduleKind::ZeroBubbleH1;
  p.virtual_stages = static_cast<int>(sec.integer("virtual_stages", 1, 1, 1 << 16));
  if (p.virtual_stages > 1 && p.schedule != pipe::ScheduleKind::Interleaved)
    sec.report_key("virtual_stages", "virtual_stages " + std::to_string(p.virtual_stages) +
                                       " needs \"schedule\": \"interleaved\" (the schedule is " + sched + ")");
  if (p.schedule == pipe::ScheduleKind::Interleaved && p.virtual_stages < 2)  // v = 1 would run plain 1F1B
    sec.report_key("virtual_stages", std::string(sec.has("virtual_stages") ? "value 1" : "absent (1)") +
                                       ": \"schedule\": \"interleaved\" needs virtual_stages >= 2 chunks per stage; "
                                       "with one chunk it is \"1f1b\"");
  // seed_layers: parameters are drawn from (seed, tensor name) whatever the layout, which is
  // what seed_layers buys in DeepSpeed; both values give the same model here.
  sec.boolean("seed_layers", false);
  // Partitioned p2p activations/gradients only differ from whole ones with tensor parallelism.
  sec.boolean("pipe_partitioned", true);
  sec.boolean("grad_partitioned", true);
  // DeepSpeed's meaning (FACTS §9.1): blocks per checkpoint, 0 = off; zero3d applies it with or
  // without pipelines (read with the activation_checkpointing section).
  // Absent (not 0): read_activation_checkpointing may derive it from the section's options.
  const bool interval_given = sec.has("activation_checkpoint_interval");
  const int interval = static_cast<int>(sec.integer("activation_checkpoint_interval", 0, 0, 1 << 20));
  if (interval_given) checkpoint_interval = interval;
  sec.accept_default_only("use_reentrant", true);
  sec.finish();
  return p;
}

// The `tensor_parallel` section: DeepSpeed's AutoTP keys (FACTS-2 §1.11) with Megatron's GPT-2
// split (column-parallel c_attn/c_fc, row-parallel c_proj, vocab-parallel wte).
TensorParallelConfig read_tensor_parallel(Section& top, const ModelConfig& m) {
  Section sec = top.child("tensor_parallel");
  TensorParallelConfig t;
  const int64_t size = sec.integer("autotp_size", 0, 0, 1 << 16);
  t.size = size <= 1 ? 1 : static_cast<int>(size);
  t.overlap_comm = sec.boolean("tp_overlap_comm", false);
  t.sequence_parallel = sec.boolean("sequence_parallel", false);
  {  // DeepSpeed's nested form: tensor_parallel.tp.tp_size must agree with autotp_size
    Section tp = sec.child("tp");
    const int64_t tp_size = tp.integer("tp_size", 1, 1, 1 << 16);
    if (tp_size != 1 && tp_size != t.size)
      tp.report_key("tp_size", "value " + std::to_string(tp_size) + " differs from tensor_parallel.autotp_size (" +
                                 std::to_string(t.size) + ")");
    tp.accept_default_only("tp_grain_size", 1);
    tp.finish();
  }
  try {  // DeepSpeed's AutoTP rules: checked against zero3d's split (config/autotp.cpp)
    read_autotp_rules(sec, m, t);
  } catch (const KeyProblem&) {
  }
  sec.accept_default_only("keep_module_on_host", false);
  sec.accept_default_only("replace_with_kernel_inject", false);
  sec.finish();
  if (t.size > 1 && m.family.llama()) {  // each rank: whole K/V-head groups, I/t of the MLP
    const std::string ts = "autotp_size " + std::to_string(t.size) + " does not divide model.";
    const DecoderFamily& f = m.family;
    if (f.num_key_value_heads % t.size != 0)
      sec.report_key("autotp_size", ts + "num_key_value_heads (" + std::to_string(f.num_key_value_heads) +
                                        "): each rank must hold whole K/V heads with their groups of query heads");
    if (f.intermediate_size % t.size != 0)
      sec.report_key("autotp_size", ts + "intermediate_size (" + std::to_string(f.intermediate_size) + ")");
    if (m.n_embd % t.size != 0)
      sec.report_key("autotp_size", ts + "hidden_size (" + std::to_string(m.n_embd) + ")");
  } else if (t.size > 1) {
    if (m.n_head % t.size != 0)
      sec.report_key("autotp_size", "autotp_size " + std::to_string(t.size) + " does not divide model.n_head (" +
                                      std::to_string(m.n_head) + "): each rank must hold whole heads");
    if (m.n_embd % t.size != 0)
      sec.report_key("autotp_size", "autotp_size " + std::to_string(t.size) + " does not divide model.n_embd (" +
                                      std::to_string(m.n_embd) + ")");
  }
  // Megatron disables sequence parallelism without tensor parallelism (with a warning); a
  // silently ignored key is what zero3d never does, so it is an error here.
  if (t.sequence_parallel && t.size == 1)
    sec.report_key("sequence_parallel", "sequence parallelism splits tokens over the tensor-parallel group: it needs "
                                      "tensor_parallel.autotp_size > 1");
  return t;
}

// autotuning (DEEPSPEED-FACTS §10): DeepSpeed's keys and defaults; the search is autotune.cpp's.
AutotuningConfig read_autotuning(Section& top) {
  Section sec = top.child("autotuning");
  AutotuningConfig a;
  a.enabled = sec.boolean("enabled", false);
  a.fast = sec.boolean("fast", true);
  a.results_dir = sec.path("results_dir", a.results_dir);
  a.exps_dir = sec.path("exps_dir", a.exps_dir);
  if (a.results_dir.empty()) sec.report_key("results_dir", "must name a directory, got \"\"");
  if (a.exps_dir.empty()) sec.report_key("exps_dir", "must name a directory, got \"\"");
  a.overwrite = sec.boolean("overwrite", true);
  a.start_profile_step = sec.integer("start_profile_step", 3, 1, 1000000);
  a.end_profile_step = sec.integer("end_profile_step", 5, 1, 1000000);
  if (a.end_profile_step < a.start_profile_step)
    sec.report_key("end_profile_step", "value " + std::to_string(a.end_profile_step) +
                                           " is before start_profile_step (" + std::to_string(a.start_profile_step) + ")");
  a.metric = sec.choice("metric", "throughput", {"throughput", "latency", "flops"});
  a.tuner_type = sec.choice("tuner_type", "gridsearch", {"gridsearch", "random", "model_based"});
  a.tuner_early_stopping = sec.integer("tuner_early_stopping", 5, 1, kMaxInt);
  a.tuner_num_trials = sec.integer("tuner_num_trials", 50, 1, kMaxInt);
  const json* max_tbs = sec.raw("max_train_batch_size");
  if (max_tbs && !max_tbs->is_null()) a.max_train_batch_size = sec.integer("max_train_batch_size", 0, 1, INT64_MAX);
  else sec.record("max_train_batch_size", nullptr);
  a.min_train_batch_size = sec.integer("min_train_batch_size", 1, 1, INT64_MAX);
  a.max_train_micro_batch_size_per_gpu = sec.integer("max_train_micro_batch_size_per_gpu", 1024, 1, kMaxInt);
  a.min_train_micro_batch_size_per_gpu = sec.integer("min_train_micro_batch_size_per_gpu", 1, 1, kMaxInt);
  if (a.min_train_micro_batch_size_per_gpu > a.max_train_micro_batch_size_per_gpu)
    sec.report_key("min_train_micro_batch_size_per_gpu",
                   "value " + std::to_string(a.min_train_micro_batch_size_per_gpu) +
                       " is above max_train_micro_batch_size_per_gpu (" +
                       std::to_string(a.max_train_micro_batch_size_per_gpu) + ")");
  a.num_tuning_micro_batch_sizes = sec.integer("num_tuning_micro_batch_sizes", 3, 1, 1024);
  // DeepSpeed's hooks into a user's launch script and its model-info run: zero3d has neither.
  sec.no_effect("metric_path", "each experiment's metrics go to results_dir/<experiment>/metrics.json");
  sec.no_effect("arg_mappings", "experiments run in-process, with no training script to pass arguments to");
  sec.no_effect("model_info", "zero3d counts the model's parameters and activations from the model section");
  sec.no_effect("model_info_path", "zero3d counts the model's parameters and activations from the model section");
  sec.no_effect("mp_size", "the tensor-parallel size is tensor_parallel.autotp_size (explored when fast is false)");
  sec.finish();
  return a;
}

// DeepSpeed's other top-level keys, each of one of three kinds: implemented elsewhere in this
// reader; meaningful only on hardware this build does not drive (accepted and noted); or a
// feature zero3d does not have (an error naming it and what to use instead).
void read_unsupported_top_level(Section& top) {
  // Sections enabled by an "enabled" key (DeepSpeed reads each as a dict; FACTS §1.3).
  const std::vector<std::pair<const char*, const char*>> missing_sections = {
      {"amp", "NVIDIA Apex AMP: use \"bf16\": {\"enabled\": true} or \"fp16\": {\"enabled\": true}"},
      {"hybrid_engine", "the RLHF hybrid inference engine"},
      {"eigenvalue", "eigenvalue computation"},
      {"curriculum_learning", "curriculum learning: sequences are n_positions long throughout"},
      {"data_efficiency", "data efficiency sampling/routing: data.shuffle picks windows at random"},
      {"weight_quantization", "weight quantization"},
      {"nebula", "Nebula checkpointing: use training.save_interval (HDF5 checkpoints)"},
  };
  for (const auto& [key, what] : missing_sections) {
    top.mark_known(key);
    if (!top.has(key)) continue;
    const json& v = *top.raw(key);
    const bool enabled = v.is_object() ? (v.contains("enabled") && v["enabled"] != false) : v != false && !v.is_null();
    if (enabled) top.report_key(key, std::string("zero3d does not have ") + what + "; remove the section or set "
                                     "\"enabled\": false");
    else top.record(key, v);
  }
  // torch.compile compiles PyTorch modules for the GPU; zero3d's kernels are compiled C++.
  top.no_effect("compile", "torch.compile has no PyTorch graph to compile here; zero3d's kernels are compiled C++");
  // Sections without an "enabled" key: their presence turns the feature on in DeepSpeed.
  top.feature_missing("compression_training", nullptr, "compression training (quantization/pruning while training)",
                      "remove the section");
  top.feature_missing("quantize_training", nullptr, "quantization-aware training", "remove the section");
  top.feature_missing("moe", nullptr, "mixture of experts (issue 15)", "remove the section");
  top.feature_missing("gradient_allreduce_op", "mean", "a gradient all-reduce other than the mean", "use \"mean\"");
  top.feature_missing("sparse_gradients", false, "sparse embedding gradients", "set it to false");
  top.feature_missing("dump_state", false, "engine state dumps", "set it to false");
  // DeepSpeed reads disable_allgather into its config and nothing uses it (runtime/config.py
  // get_disable_allgather is its only reader): accepted with that meaning.
  top.boolean("disable_allgather", false);
  top.feature_missing("managed_gradient_accumulation", true, "unmanaged gradient accumulation", "set it to true");
  top.feature_missing("zero_force_ds_cpu_optimizer", true, "a client optimizer with offload",
                      "offload runs DeepSpeedCPUAdam: set it to true");
  // DeepSpeed's loader drops an epoch's last partial batch when true; zero3d's windows wrap
  // after the last whole one (data.cpp), so no batch is ever partial: true is what it does.
  top.boolean("dataloader_drop_last", false);
  top.feature_missing("sequence_parallel_size", 1, "Ulysses sequence parallelism",
                      "use tensor_parallel.sequence_parallel with autotp_size > 1");
  // PyTorch-side keys DeepSpeed itself ignores at top level (FACTS §1.3) but configs carry.
  top.no_effect("comms_config", "a DeepSpeed-Inference communication block; DeepSpeed's training engine ignores it too");
  top.no_effect("monitor_config", "an old monitor block that DeepSpeed's training engine ignores too");
}

const std::vector<std::string> kDeepSpeedOnlyTopLevel = {
    "seq_parallel_communication_data_type", "zenflow", "train_data", "data_sampling"};

Config read_config_unguarded(const json& given, const std::string& file, int64_t world_size,
                             const std::vector<std::string>& set_keys, kernels::Backend backend) {
  Config c;
  c.file = file;
  c.backend = backend;
  c.resolved = json::object();
  ReadContext ctx;
  ctx.set_keys = set_keys;
  const json root = with_strategy_preset(given, file, ctx);
  Section top(&root, "", file, &c.resolved, &ctx);
  // The autotuner's input (autotune.cpp autotuning_enabled): its search space and batch may be open.
  const bool tuning = root.is_object() && root.contains("autotuning") && root["autotuning"].is_object() &&
                      root["autotuning"].value("enabled", json(false)) == true;
  auto step = [&](auto&& f) { attempt(ctx, file, f); };
  step([&] { c.model = read_model(top, backend); });
  step([&] { c.data = read_data(top, c.model); });
  // DeepSpeed's configs describe no model or data: one of them here would train zero3d's
  // defaults, which the start-up says rather than doing it silently.
  if (root.is_object() && !root.contains("model"))
    top.note("default no `model` section in " + file + ": the default GPT " + default_model_text(c.model));
  if (root.is_object() && !root.contains("data"))
    top.note("default no `data` section in " + file + ": the built-in synthetic data (data.source \"synthetic\")");
  step([&] { c.training = read_training(top, c.data); });
  std::optional<int> checkpoint_interval;
  step([&] { c.pipeline = read_pipeline(top, checkpoint_interval); });
  step([&] { c.tensor = read_tensor_parallel(top, c.model); });
  const int64_t model_ranks = static_cast<int64_t>(c.pipeline.stages) * c.tensor.size;
  bool layout_ok = world_size % model_ranks == 0;
  if (!layout_ok)
    top.report(c.tensor.size > 1 ? "tensor_parallel.autotp_size" : "pipeline.stages",
             (c.tensor.size > 1 ? "pipeline.stages (" + std::to_string(c.pipeline.stages) + ") x tensor_parallel.autotp_size (" +
                                      std::to_string(c.tensor.size) + ") = " + std::to_string(model_ranks)
                                : "pipeline.stages (" + std::to_string(c.pipeline.stages) + ")") +
                 " does not divide the number of ranks (" + std::to_string(world_size) + ")");
  step([&] {
    try {
      c.pipe_bounds = partition_pipe_layers(pipe_layers_of(c.model), c.pipeline);
    } catch (const std::invalid_argument& e) {
      throw InputError(file + ": " + e.what());
    }
  });
  const int64_t dp = layout_ok ? world_size / model_ranks : std::max<int64_t>(1, world_size);
  bool auto_micro = false;
  bool batch_ok = false;
  std::optional<ElasticBatch> elastic;
  step([&] { elastic = read_elasticity(top, dp); });
  if (elastic) {
    // DeepSpeed's config with elasticity: GAS = batch // (micro x world), then the triad's check.
    for (const char* key : {"train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"})
      top.mark_known(key);
    const int64_t T = elastic->train_batch_size, M = elastic->micro_batch, G = T / (M * dp);
    if (G < 1 || M * G * dp != T)
      top.report("elasticity", "train_batch_size " + std::to_string(T) + " is not micro-batch " + std::to_string(M) +
                                   " x gradient_accumulation_steps x " + std::to_string(dp) + " ranks");
    c.batch = BatchConfig{T, M, std::max<int64_t>(1, G), dp,
                          "train_batch_size " + std::to_string(T) + " = micro_batch " + std::to_string(M) +
                              " x gradient_accumulation_steps " + std::to_string(G) + " x data-parallel size " +
                              std::to_string(dp) + " (elasticity)"};
    batch_ok = true;
    // The resolved config names this batch; it is the solver's, so reading it back ignores it.
    c.resolved["elasticity"]["ignore_non_elastic_batch_info"] = true;
  } else if (!layout_ok) {
    // No data-parallel size to check the triad against: the layout problem above is the one to fix.
    for (const char* key : {"train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"})
      top.mark_known(key);
  } else {
    step([&] {
      c.batch = derive_batch(top, dp, auto_micro, tuning);
      batch_ok = true;
    });
  }
  if (!batch_ok) c.batch = BatchConfig{dp, 1, 1, dp, ""};  // a stand-in, so later checks see a plausible batch
  step([&] {
    if (c.tensor.sequence_parallel && (c.batch.micro_batch * c.model.n_positions) % c.tensor.size != 0)
      top.fail("tensor_parallel.sequence_parallel",
               "the micro-batch's tokens (" + std::to_string(c.batch.micro_batch) + " x " +
                   std::to_string(c.model.n_positions) + ") do not split evenly over tensor_parallel.autotp_size (" +
                   std::to_string(c.tensor.size) + ")");
  });
  step([&] {
    pipe::ScheduleSpec spec{c.pipeline.schedule, c.pipeline.stages,
                            static_cast<int>(std::min<int64_t>(c.batch.gradient_accumulation_steps, kMaxInt)),
                            c.pipeline.virtual_stages};
    // virtual_stages without interleaving was reported where it was read: one problem, one line.
    const bool reported = c.pipeline.virtual_stages > 1 && c.pipeline.schedule != pipe::ScheduleKind::Interleaved;
    const std::string why = pipe::check_schedule_spec(spec);
    if (!why.empty() && !reported) top.fail("pipeline.schedule", why);
  });
  step([&] { c.activation_checkpointing = read_activation_checkpointing(top, c, checkpoint_interval); });
  step([&] { c.optimizer = read_optimizer(top); });
  step([&] { c.scheduler = read_scheduler(top, c.optimizer, c.training.steps); });
  step([&] { c.gradient_clipping = read_gradient_clipping(top); });
  c.steps_per_print = top.integer("steps_per_print", 10, 1, kMaxInt);
  c.wall_clock_breakdown = top.boolean("wall_clock_breakdown", false);
  c.memory_breakdown = top.boolean("memory_breakdown", false);  // memory_breakdown.hpp
  step([&] { read_zero(top, c, tuning); });
  c.zero_allow_untested_optimizer = top.boolean("zero_allow_untested_optimizer", false);
  step([&] { check_zero_optimizer(top, c); });
  step([&] { c.precision = read_precision(top, c); });
  c.zero.master_weights = c.precision.master_weights;  // what the ZeRO optimizer applies
  c.zero.optimizer_states = c.precision.optimizer_states;
  step([&] { read_gradient_averaging(top, c); });
  step([&] { check_shard_groups(top, c); });
  // engine.py _configure_basic_optimizer warns when a 1-bit optimizer runs without fp16.
  if (c.optimizer.one_bit() && c.precision.param != DType::F16)
    top.note("warning optimizer " + c.optimizer.type_name + " without fp16: DeepSpeed warns that its convergence is "
             "only verified under FP16 (it runs, as here)");
  // OneBitLamb's trust ratio, momentum scales and scaling factor are norms and maxima over whole
  // tensors; a tensor-parallel rank holds a shard of each.
  if (c.optimizer.type == OptimizerType::OneBitLamb && c.tensor.size > 1)
    top.report("tensor_parallel.autotp_size", "value " + std::to_string(c.tensor.size) + ": " + c.optimizer.type_name +
                                                  " computes its trust ratio and scaling factors over whole tensors, "
                                                  "which tensor parallelism shards; use autotp_size 1 (or OneBitAdam, "
                                                  "ZeroOneAdam)");
  step([&] { check_offload(top, c); });
  step([&] { check_frozen_parameters(top, c); });
  step([&] { c.observability = read_observability(top); });
  step([&] { c.autotuning = read_autotuning(top); });
  step([&] { read_unsupported_top_level(top); });
  step([&] { c.model.sparse_attention = read_sparse_attention(top, c); });
  step([&] { c.checkpoint = read_checkpoint_section(top, c); });
  step([&] { c.pld = read_progressive_layer_drop(top, c); });
  if (c.model.family.llama()) {  // GPT-2 features the Llama family's block does not have (yet)
    const std::string family = "model.architecture " + std::string(architecture_name(c.model.family.arch));
    if (c.model.sparse_attention.enabled)
      top.report("sparse_attention", "block-sparse attention is GPT-2's; " + family +
                                         " has causal grouped-query attention with its sliding window");
    if (c.pld.enabled)
      top.report("progressive_layer_drop.enabled", "progressive layer drop is not implemented for " + family);
  }
  if (layout_ok) step([&] { check_moe(top, c, dp); });
  step([&] { c.inference = read_inference(top); });
  step([&] { check_training_samples(top, c); });
  if (root.contains("strategy")) top.record("strategy", root["strategy"]);
  top.mark_known("strategy");  // expanded above (with_strategy_preset)
  top.finish(kDeepSpeedOnlyTopLevel);
  if (auto_micro) {
    // Left to the memory planner (train/estimator.hpp resolve_config), which sits above config.
    c.batch.micro_batch_from_memory = true;
    c.batch.accumulation_auto = root.value("gradient_accumulation_steps", json()) == "auto";
    c.batch.train_batch_auto = root.value("train_batch_size", json()) == "auto";
  }
  c.resolved["train_batch_size"] = c.batch.train_batch_size;
  c.resolved["train_micro_batch_size_per_gpu"] = c.batch.micro_batch;
  c.resolved["gradient_accumulation_steps"] = c.batch.gradient_accumulation_steps;
  if (ctx.problems.size() == 1) throw InputError(file + ": " + ctx.problems.front());
  if (!ctx.problems.empty()) {
    // One pass: every problem with its key, then how many (a single problem stays one line).
    std::string all = std::to_string(ctx.problems.size()) + " problems in " + file + ":";
    for (const std::string& p : ctx.problems) all += "\n  " + p;
    throw InputError(all);
  }
  c.notes = std::move(ctx.notes);
  return c;
}
}  // namespace

namespace config_detail {

double read_dropout_probability(Section& sec, const std::string& key) {
  const double p = sec.number(key, 0.0, std::numeric_limits<double>::lowest(), std::numeric_limits<double>::max());
  if (p < 0.0 || p >= 1.0)
    sec.report_key(key, "value " + show(json(p)) + " is outside [0, 1): a dropout probability" +
                            (p >= 1.0 ? " of 1 or more would drop every element" : " is not negative"));
  else if (p > 0.0 && p < kDropoutResolution)
    sec.report_key(key, "value " + show(json(p)) + " is below 2^-24, the resolution of zero3d's dropout masks (it "
                        "would drop nothing); use 0 for no dropout");
  return p;
}

}  // namespace config_detail

ModelConfig read_model_section(const json& model, const std::string& file) {
  ModelConfig m;
  ReadContext ctx;
  json resolved = json::object();
  const json root = {{"model", model}};
  Section top(&root, "", file, &resolved, &ctx);
  try {
    attempt(ctx, file, [&] { m = read_model(top, kernels::kBuildBackend); });
  } catch (const json::exception& e) {
    throw InputError(file + ": " + json_detail(e));
  }
  if (ctx.problems.size() == 1) throw InputError(file + ": " + ctx.problems.front());
  if (!ctx.problems.empty()) {
    std::string all = std::to_string(ctx.problems.size()) + " problems in " + file + ":";
    for (const std::string& p : ctx.problems) all += "\n  " + p;
    throw InputError(all);
  }
  return m;
}

Config read_config(const json& root, const std::string& file, int64_t world_size,
                   const std::vector<std::string>& set_keys, kernels::Backend backend) {
  try {
    return read_config_unguarded(root, file, world_size, set_keys, backend);
  } catch (const json::exception& e) {
    // A value of a type a reader did not expect: bad input, never an internal error.
    throw InputError(file + ": " + json_detail(e));
  }
}

}  // namespace zero3d
