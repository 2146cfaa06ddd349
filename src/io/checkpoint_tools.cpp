// checkpoint_tools.cpp — `zero3d inspect` and `zero3d convert`: whole-checkpoint readers for
// people and other tools. Both stream: one tensor (or one chunk of a shard) in memory at a time.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <optional>
#include <set>

#include "base/errors.hpp"
#include "base/input_file.hpp"
#include "config/config.hpp"
#include "config/model_shape.hpp"
#include "io/checkpoint.hpp"
#include "io/h5.hpp"
#include "kernels/half.hpp"
#include "model/model.hpp"

namespace fs = std::filesystem;

namespace zero3d {

namespace {

// Reports a long read or write on stderr (stdout carries the result): nothing during the first
// ZERO3D_PROGRESS_SECONDS (default 1), then a line at most that often with the rate, and a
// summary at the end; operations shorter than that stay silent.
class Progress {
 public:
  Progress(std::string what, int64_t total_bytes) : what_(std::move(what)), total_(total_bytes) {
    if (const char* s = std::getenv("ZERO3D_PROGRESS_SECONDS")) {
      char* end = nullptr;
      const double v = std::strtod(s, &end);
      if (end != s && *end == '\0' && std::isfinite(v) && v >= 0) interval_ = v;
    }
  }
  void advance(int64_t bytes, const std::string& item) {
    done_ += bytes;
    const double now = seconds();
    if (now < interval_ || now - last_ < interval_) return;
    last_ = now;
    printed_ = true;
    std::fprintf(stderr, "%s: %.1f of %.1f MB (%.0f%%), %.1f MB/s: %s\n", what_.c_str(), done_ / 1e6, total_ / 1e6,
                 total_ > 0 ? 100.0 * double(done_) / double(total_) : 100.0, rate(now), item.c_str());
    std::fflush(stderr);
  }
  void finish() const {
    const double now = seconds();
    if (!printed_ && now < interval_) return;
    std::fprintf(stderr, "%s: %.1f MB in %.1f s (%.1f MB/s)\n", what_.c_str(), done_ / 1e6, now, rate(now));
    std::fflush(stderr);
  }

 private:
  double seconds() const { return std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count(); }
  double rate(double now) const { return now > 0 ? done_ / 1e6 / now : 0.0; }
  std::string what_;
  int64_t total_, done_ = 0;
  double interval_ = 1.0, last_ = 0.0;
  bool printed_ = false;
  std::chrono::steady_clock::time_point start_ = std::chrono::steady_clock::now();
};

// A tag directory from `path` (a tag directory, or a save directory plus optional tag).
std::string resolve_tag_dir(const std::string& path, const std::string& tag) {
  if (fs::exists(fs::path(path) / "index.h5")) return path;
  if (!fs::is_directory(path)) throw InputError(path + ": no such checkpoint directory");
  if (!tag.empty()) {
    const fs::path dir = fs::path(path) / tag;
    std::error_code ec;
    if (fs::exists(dir / "index.h5", ec) || fs::exists(fs::path(dir.string() + ".old.tmp") / "index.h5", ec))
      return dir.string();
    std::string tags;
    for (const std::string& t : list_checkpoint_tags(path)) tags += (tags.empty() ? "" : ", ") + t;
    throw InputError("--tag " + echo(tag, 200) + ": " + path + " holds no such tag (" +
                     (tags.empty() ? std::string("it holds none") : "it holds " + echo(tags, 400)) + ")");
  }
  if (fs::exists(fs::path(path) / "latest")) return path;  // CheckpointReader follows `latest`
  throw InputError(path + ": neither a checkpoint tag directory nor a directory with `latest`");
}

ParamLayout layout_of(const CheckpointMeta& m) {
  ParamLayout layout;
  for (const auto& t : m.tensors) layout.add(t.at("name"), t.at("shape").get<std::vector<int64_t>>());
  return layout;
}

}  // namespace

// One parser for every size option: a finite, non-negative number with a known unit whose
// value fits int64 (larger values would be undefined when converted).
int64_t parse_byte_size(const std::string& text, const std::string& option) {
  // An empty text shows as "" (`--memory-per-rank ""`), not as nothing after the option.
  const std::string where = option.empty() || text.empty()
                                ? (option.empty() ? "size" : option) + " \"" + echo(text, 40) + "\""
                                : option + " " + echo(text, 40);
  size_t pos = 0;
  double value = 0.0;
  try {
    value = std::stod(text, &pos);
  } catch (...) {
    throw InputError(where + ": expected a number with an optional unit (5GB, 500MB, 2GiB)");
  }
  if (!std::isfinite(value)) throw InputError(where + ": expected a finite size");
  if (value < 0 || text.find('-') == 0) throw InputError(where + ": a size cannot be negative");
  std::string unit = text.substr(pos);
  for (auto& c : unit) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  const std::pair<const char*, double> units[] = {{"", 1},       {"B", 1},         {"KB", 1e3},     {"MB", 1e6},
                                                  {"GB", 1e9},   {"TB", 1e12},     {"KIB", 1024.0}, {"MIB", 1048576.0},
                                                  {"GIB", 1073741824.0}, {"TIB", 1099511627776.0}};
  for (const auto& [name, factor] : units)
    if (unit == name) {
      if (value * factor > 9.0e18) throw InputError(where + ": too large (at most 8 EiB)");
      return static_cast<int64_t>(value * factor);
    }
  throw InputError(where + ": unknown unit \"" + echo(text.substr(pos), 20) + "\" (B, KB, MB, GB, TB, KiB, MiB, GiB, TiB)");
}

nlohmann::json inspect_checkpoint(const std::string& path, const std::string& tag, const std::string& tensor) {
  const std::string tag_dir = resolve_tag_dir(path, tag);
  CheckpointReader reader = CheckpointReader::open(tag_dir, "");
  const CheckpointMeta& m = reader.meta();
  nlohmann::json report = {{"dir", reader.dir()},
                           {"step", m.step},
                           {"global_samples", m.global_samples},
                           {"zero_stage", m.zero_stage},
                           {"topology", {{"pipe", m.pipe_size}, {"data", m.dp_world_size}, {"model", m.tensor_size}}},
                           {"dtypes", {{"master", m.dtype}, {"optimizer_states", "fp32"}}},
                           // the update rule (AdamW vs Adam) where the checkpoint records it
                           {"optimizer", m.update_rule.empty() ? m.optimizer_type : m.update_rule},
                           {"states", m.states},
                           {"shards", m.ranges.size()}};
  const fs::path parent = fs::path(reader.dir()).parent_path();
  std::error_code ec;
  if (fs::is_regular_file(parent / "latest", ec) && fs::file_size(parent / "latest", ec) <= 4096) {
    report["tags"] = list_checkpoint_tags(parent.string());
    std::ifstream latest(parent / "latest");
    std::string name;
    std::getline(latest, name);
    report["latest"] = name;
  }
  // The verification resume runs happened in open(); on top: every file's digest, every shard
  // checksum (read every element of every segment, chunk by chunk), and every tensor read
  // through index.h5's virtual datasets equal to what the shards hold.
  // Progress counts the bytes of the three passes: the shards, index.h5 and the statistics.
  const ParamLayout layout = layout_of(m);
  const int64_t state_bytes = 4 * layout.total();
  Progress progress("inspect", state_bytes * (2 * int64_t(m.states.size()) + 1));
  reader.verify_files();
  constexpr int64_t kChunk = int64_t(1) << 22;
  std::vector<float> buf, via_index;
  // The segments tile the buffers: reading them whole, a few MiB at a time, reads every segment
  // of every shard (one read per segment would reopen a shard thousands of times under tensor
  // parallelism, whose shards hold a segment per matrix row).
  for (const std::string& state : m.states)
    for (int64_t lo = 0; lo < layout.total(); lo += kChunk) {
      const int64_t hi = std::min(layout.total(), lo + kChunk);
      buf.resize(static_cast<size_t>(hi - lo));
      reader.read_range(state, lo, hi, buf.data());
      progress.advance(4 * (hi - lo), "checksums of " + state);
    }
  const std::string index_path = (fs::path(reader.dir()) / "index.h5").string();
  h5::File index = h5::File::open_read(index_path);
  for (const std::string& state : m.states)
    for (const TensorSpec& t : layout.tensors()) {
      const std::string name = (state == "params" ? "/" : "/" + state + "/") + t.name;
      buf.resize(static_cast<size_t>(t.numel));
      reader.read_range(state, t.offset, t.offset + t.numel, buf.data());
      try {
        via_index = index.read_floats(name);
      } catch (const InputError&) {
        throw InputError(index_path + ": virtual dataset " + name + " cannot be read (index.h5 damaged)");
      }
      if (via_index.size() != buf.size() || std::memcmp(via_index.data(), buf.data(), buf.size() * sizeof(float)) != 0)
        throw InputError(index_path + ": virtual dataset " + name + " differs from the shards (index.h5 from another save?)");
      progress.advance(4 * t.numel, "index.h5 " + name);
    }
  report["verified"] = true;
  report["tag_id"] = m.tag_id;
  report["digests"] = reader.has_manifest() ? "xxh64 manifest" : "none (format 1)";
  nlohmann::json tensors = nlohmann::json::array();
  for (const TensorSpec& t : layout.tensors()) {
    if (!tensor.empty() && t.name != tensor) continue;
    buf.resize(static_cast<size_t>(t.numel));
    reader.read_range("params", t.offset, t.offset + t.numel, buf.data());
    double lo = std::numeric_limits<double>::infinity(), hi = -lo, sum = 0.0, sq = 0.0;
    for (float x : buf) {
      lo = std::min(lo, double(x));
      hi = std::max(hi, double(x));
      sum += x;
      sq += double(x) * x;
    }
    tensors.push_back({{"name", t.name}, {"shape", t.shape}, {"dtype", m.dtype}, {"min", lo}, {"max", hi},
                       {"mean", sum / double(t.numel)}, {"l2_norm", std::sqrt(sq)}});
    progress.advance(4 * t.numel, "statistics of " + t.name);
  }
  progress.finish();
  if (!tensor.empty() && tensors.empty()) throw InputError(reader.dir() + ": no tensor named `" + tensor + "`");
  report["tensors"] = tensors;
  return report;
}

namespace {

// The element type written by convert: fp32 as stored, or rounded to nearest even (NaN stays
// NaN, beyond the range becomes inf), bit for bit as torch's .to(torch.bfloat16 / .half()).
struct OutputDType {
  std::string name;         // fp32 | bf16 | fp16 (the --dtype spelling)
  std::string safetensors;  // F32 | BF16 | F16
  std::string torch;        // float32 | bfloat16 | float16 (config.json's torch_dtype)
  int64_t width;
};

OutputDType output_dtype(const std::string& dtype) {
  if (dtype == "fp32") return {"fp32", "F32", "float32", 4};
  if (dtype == "bf16") return {"bf16", "BF16", "bfloat16", 2};
  if (dtype == "fp16") return {"fp16", "F16", "float16", 2};
  throw InputError("--dtype \"" + echo(dtype, 20) + "\": expected fp32, bf16 or fp16");
}

// The bytes of `src` in `dtype`, into `bytes` (reused across tensors).
const char* encode(const std::vector<float>& src, const OutputDType& dtype, std::vector<uint16_t>& bytes) {
  if (dtype.width == 4) return reinterpret_cast<const char*>(src.data());
  bytes.resize(src.size());
  if (dtype.name == "bf16")
    std::transform(src.begin(), src.end(), bytes.begin(), [](float x) { return kernels::to_bf16(x).bits; });
  else
    std::transform(src.begin(), src.end(), bytes.begin(), [](float x) { return kernels::to_fp16(x).bits; });
  return reinterpret_cast<const char*>(bytes.data());
}

// IEEE binary16 for HDF5 (sign bit 15, exponent bits 10..14, mantissa bits 0..9): h5py and
// h5dump read it as float16.
h5::Handle fp16_type() {
  h5::Handle t(H5Tcopy(H5T_IEEE_F32LE), H5Tclose);
  const bool ok = t.valid() && H5Tset_fields(t.get(), 15, 10, 5, 0, 10) >= 0 && H5Tset_offset(t.get(), 0) >= 0 &&
                  H5Tset_precision(t.get(), 16) >= 0 && H5Tset_size(t.get(), 2) >= 0 && H5Tset_ebias(t.get(), 15) >= 0;
  if (!ok) throw SystemError("cannot build the HDF5 fp16 type");
  return t;
}

// The model a checkpoint holds, as Hugging Face's GPT2Config names it; for the Llama family
// (Llama, Mistral, Qwen2), the model its saved section describes.
struct ModelShape {
  int64_t vocab_size = 0, n_positions = 0, n_embd = 0, n_layer = 0, n_head = 0;
  nlohmann::json moe;  // the saved model.moe section (null for a dense model)
  DropoutRates dropout;  // GPT-2's embd_pdrop, attn_pdrop, resid_pdrop as trained
  std::optional<ModelConfig> family;  // the Llama family's model (absent: GPT-2)
};

// A Llama-family checkpoint: its saved model section read back as read_config reads a config
// (without hf_config: the resolved section holds every knob it was read for), and the model it
// describes checked against the checkpoint's tensors, name for name and shape for shape.
ModelShape llama_family_shape_of(const CheckpointReader& reader, const ParamLayout& layout) {
  const std::string where = reader.dir() + "/index.h5";
  const nlohmann::json& config = reader.meta().config;
  nlohmann::json model = config.is_object() ? config.value("model", nlohmann::json()) : nlohmann::json();
  if (!model.is_object() || !model.contains("architecture"))
    throw InputError(where + ": a Llama-family checkpoint (model.embed_tokens.weight) whose metadata has no "
                             "model.architecture, which config.json needs");
  // The resolved section records every knob, also those read from model.hf_config (checkpoints
  // saved before rope_scaling was recorded there need the file: it is read when it is still
  // there, the section's keys winning as in the run).
  std::error_code ec;
  const std::string hf_config = model.value("hf_config", nlohmann::json("")).is_string() ? model.value("hf_config", "") : "";
  if (hf_config.empty() || !fs::exists(hf_config, ec)) model.erase("hf_config");
  model.erase("init_from");  // where the first run's weights came from, not the model
  const ModelConfig m = read_model_section(model, where + " (saved model section)");
  const ParamLayout expected = gpt_layout(gpt_shape_of(m));  // Mixtral's experts included
  for (const TensorSpec& t : expected.tensors()) {
    const TensorSpec* saved = layout.find(t.name);
    if (!saved || saved->shape != t.shape)
      throw InputError(where + ": tensor `" + t.name + "` " +
                       (saved ? "has shape " + nlohmann::json(saved->shape).dump() : std::string("is absent")) +
                       " but the saved model section describes " + nlohmann::json(t.shape).dump());
  }
  if (expected.tensors().size() != layout.tensors().size())
    throw InputError(where + ": the checkpoint holds " + std::to_string(layout.tensors().size()) +
                     " tensors, its saved model section describes " + std::to_string(expected.tensors().size()));
  ModelShape out;
  out.vocab_size = m.vocab_size;
  out.n_positions = m.n_positions;
  out.n_embd = m.n_embd;
  out.n_layer = m.n_layer;
  out.n_head = m.n_head;
  out.family = m;
  return out;
}

// Sizes from the tensors themselves; n_head, which no shape shows, from the saved model section.
ModelShape model_shape_of(const CheckpointReader& reader, const ParamLayout& layout) {
  const std::string where = reader.dir() + "/index.h5";
  if (layout.find("model.embed_tokens.weight")) return llama_family_shape_of(reader, layout);
  const TensorSpec* wte = layout.find("wte.weight");
  const TensorSpec* wpe = layout.find("wpe.weight");
  if (!wte || !wpe || wte->shape.size() != 2 || wpe->shape.size() != 2)
    throw InputError(where + ": no wte.weight and wpe.weight matrices: not a GPT-2 checkpoint");
  ModelShape s;
  s.vocab_size = wte->shape[0];
  s.n_embd = wte->shape[1];
  s.n_positions = wpe->shape[0];
  while (layout.find("h." + std::to_string(s.n_layer) + ".ln_1.weight")) ++s.n_layer;
  const nlohmann::json& config = reader.meta().config;
  const nlohmann::json model = config.is_object() ? config.value("model", nlohmann::json()) : nlohmann::json();
  if (!model.is_object() || !model.contains("n_head") || !model["n_head"].is_number_integer())
    throw InputError(where + ": the checkpoint metadata has no model.n_head, which config.json needs");
  s.n_head = model["n_head"].get<int64_t>();
  if (model.contains("moe") && model["moe"].is_object()) s.moe = model["moe"];
  s.dropout.embd = model.value("embd_pdrop", 0.0);
  s.dropout.attn = model.value("attn_pdrop", 0.0);
  s.dropout.resid = model.value("resid_pdrop", 0.0);
  if (s.n_head <= 0 || s.n_embd % s.n_head != 0)
    throw InputError(where + ": model.n_head " + std::to_string(s.n_head) + " does not divide n_embd " +
                     std::to_string(s.n_embd));
  return s;
}

// Hugging Face's GPT2Config for the checkpoint's model, as save_pretrained writes it, with the
// dropout probabilities it trained with (0 unless the config set them); special tokens exist only
// with GPT-2's own tokenizer (50257 tokens and more).
nlohmann::json hugging_face_config(const ModelShape& s, const OutputDType& dtype) {
  const nlohmann::json eos = s.vocab_size > 50256 ? nlohmann::json(50256) : nlohmann::json();
  nlohmann::json out = {{"activation_function", "gelu_new"},  // GELU, tanh approximation
          {"architectures", {"GPT2LMHeadModel"}},
          {"attn_pdrop", s.dropout.attn},
          {"bos_token_id", eos},
          {"embd_pdrop", s.dropout.embd},
          {"eos_token_id", eos},
          {"initializer_range", 0.02},
          {"layer_norm_epsilon", 1e-5},
          {"model_type", "gpt2"},
          {"n_ctx", s.n_positions},
          {"n_embd", s.n_embd},
          {"n_head", s.n_head},
          {"n_inner", nullptr},  // 4 · n_embd
          {"n_layer", s.n_layer},
          {"n_positions", s.n_positions},
          {"reorder_and_upcast_attn", false},
          {"resid_pdrop", s.dropout.resid},
          {"scale_attn_by_inverse_layer_idx", false},
          {"scale_attn_weights", true},
          {"summary_activation", nullptr},
          {"summary_first_dropout", 0.1},
          {"summary_proj_to_labels", true},
          {"summary_type", "cls_index"},
          {"summary_use_proj", true},
          {"tie_word_embeddings", true},
          {"torch_dtype", dtype.torch},
          {"use_cache", true},
          {"vocab_size", s.vocab_size}};
  // GPT2Config has no experts: an MoE model's config.json names its MoE blocks (zero3d's
  // model.moe, DeepSpeed's MoE arguments) beside it, and its weights hold every expert as
  // h.{l}.mlp.experts.{e}.*; GPT2LMHeadModel alone cannot run it.
  if (!s.moe.is_null()) out["moe"] = s.moe;
  return out;
}

// A RopeConfig as config.json's rope_scaling (legacy Hub form, which transformers v4 and v5 and
// zero3d's reader all take): null for the default type, else rope_type and the keys that type
// reads (modeling_rope_utils.py), optional ones only when they are not Hugging Face's default.
nlohmann::json rope_scaling_json(const kernels::RopeConfig& r) {
  using kernels::RopeType;
  switch (r.type) {
    case RopeType::Default: return nullptr;
    case RopeType::Linear: return {{"rope_type", "linear"}, {"factor", r.factor}};
    case RopeType::Dynamic: return {{"rope_type", "dynamic"}, {"factor", r.factor}};
    case RopeType::Yarn: {
      nlohmann::json y = {{"rope_type", "yarn"}, {"factor", r.factor}, {"beta_fast", r.beta_fast}, {"beta_slow", r.beta_slow}};
      if (r.attention_factor != 0.0) y["attention_factor"] = r.attention_factor;
      if (r.mscale != 0.0) y["mscale"] = r.mscale;
      if (r.mscale_all_dim != 0.0) y["mscale_all_dim"] = r.mscale_all_dim;
      if (!r.truncate) y["truncate"] = false;
      if (r.original_max_position_embeddings != 0) y["original_max_position_embeddings"] = r.original_max_position_embeddings;
      return y;
    }
    case RopeType::Llama3:
      return {{"rope_type", "llama3"},
              {"factor", r.factor},
              {"low_freq_factor", r.low_freq_factor},
              {"high_freq_factor", r.high_freq_factor},
              {"original_max_position_embeddings", r.original_max_position_embeddings}};
  }
  return nullptr;
}

// A token id list as config.json holds it: null, one id, or the list.
nlohmann::json token_ids_json(const std::vector<int64_t>& ids) {
  if (ids.empty()) return nullptr;
  if (ids.size() == 1) return ids.front();
  return ids;
}

// The class transformers' AutoModelForCausalLM builds for each family.
const char* causal_lm_class(Architecture a) {
  switch (a) {
    case Architecture::Mistral: return "MistralForCausalLM";
    case Architecture::Qwen2: return "Qwen2ForCausalLM";
    case Architecture::Mixtral: return "MixtralForCausalLM";
    default: return "LlamaForCausalLM";
  }
}

// LlamaConfig, MistralConfig or Qwen2Config for the model, every field of the model under its
// configuration class's name (configuration_llama.py, configuration_mistral.py,
// configuration_qwen2.py): what save_pretrained writes, and what model.hf_config reads back to
// the same model. Each family writes only its own class's keys (attention_bias and mlp_bias are
// Llama's; the sliding-window keys Mistral's and Qwen2's).
nlohmann::json llama_family_config(const ModelConfig& m, const OutputDType& dtype) {
  const DecoderFamily& f = m.family;
  nlohmann::json out = {{"architectures", {causal_lm_class(f.arch)}},
                        {"attention_dropout", m.dropout.attn},
                        {"bos_token_id", token_ids_json(f.bos_token_id)},
                        {"eos_token_id", token_ids_json(f.eos_token_id)},
                        {"head_dim", f.head_dim},
                        {"hidden_act", "silu"},
                        {"hidden_size", m.n_embd},
                        {"initializer_range", f.initializer_range},
                        {"intermediate_size", f.intermediate_size},
                        {"max_position_embeddings", f.rope.max_position_embeddings},
                        {"model_type", architecture_name(f.arch)},
                        {"num_attention_heads", m.n_head},
                        {"num_hidden_layers", m.n_layer},
                        {"num_key_value_heads", f.num_key_value_heads},
                        {"rms_norm_eps", f.rms_norm_eps},
                        {"rope_scaling", rope_scaling_json(f.rope)},
                        {"rope_theta", f.rope.theta},
                        {"tie_word_embeddings", f.tie_word_embeddings},
                        {"torch_dtype", dtype.torch},
                        {"use_cache", true},
                        {"vocab_size", m.vocab_size}};
  if (f.arch == Architecture::Llama) {
    out["attention_bias"] = f.qkv_bias;  // q/k/v and o_proj biases together (zero3d reads them so)
    out["mlp_bias"] = f.mlp_bias;
    out["pretraining_tp"] = 1;
  } else if (f.arch == Architecture::Mistral || f.arch == Architecture::Mixtral) {  // one window on every layer, or none
    const int64_t w = f.window_of(0);
    out["sliding_window"] = w > 0 ? nlohmann::json(w) : nlohmann::json();
    if (f.arch == Architecture::Mixtral) {  // MixtralConfig's router
      out["num_local_experts"] = m.moe.num_experts;
      out["num_experts_per_tok"] = m.moe.k;
      out["router_aux_loss_coef"] = f.router_aux_loss_coef;
      out["router_jitter_noise"] = m.moe.router_jitter_noise;
      out["output_router_logits"] = f.output_router_logits;
    }
  } else {  // Qwen2: the window on the layers layer_types names (max_window_layers: the first of them)
    int64_t w = 0, first = m.n_layer;
    nlohmann::json types = nlohmann::json::array();
    for (int64_t l = 0; l < m.n_layer; ++l) {
      const int64_t wl = f.window_of(l);
      if (wl > 0) w = wl, first = std::min(first, l);
      types.push_back(wl > 0 ? "sliding_attention" : "full_attention");
    }
    out["use_sliding_window"] = w > 0;
    out["sliding_window"] = w > 0 ? nlohmann::json(w) : nlohmann::json();  // Qwen2Config: None without use_sliding_window
    out["max_window_layers"] = first;
    out["layer_types"] = types;
  }
  return out;
}

constexpr const char* kConvertSource = "zero3d convert";  // "source" in every output: what marks ours

// What every output file records about its model (safetensors __metadata__, HDF5 attributes).
std::vector<std::pair<std::string, std::string>> file_metadata(const ModelShape& s, const OutputDType& dtype,
                                                               int64_t step) {
  if (s.family) {  // the Llama family: its sizes under Hugging Face's config.json names
    const DecoderFamily& f = s.family->family;
    return {{"source", kConvertSource},
            {"model_type", architecture_name(f.arch)},
            {"vocab_size", std::to_string(s.vocab_size)},
            {"hidden_size", std::to_string(s.n_embd)},
            {"intermediate_size", std::to_string(f.intermediate_size)},
            {"num_hidden_layers", std::to_string(s.n_layer)},
            {"num_attention_heads", std::to_string(s.n_head)},
            {"num_key_value_heads", std::to_string(f.num_key_value_heads)},
            {"head_dim", std::to_string(f.head_dim)},
            {"dtype", dtype.name},
            {"step", std::to_string(step)}};
  }
  return {{"source", kConvertSource},
          {"model_type", "gpt2"},
          {"vocab_size", std::to_string(s.vocab_size)},
          {"n_positions", std::to_string(s.n_positions)},
          {"n_embd", std::to_string(s.n_embd)},
          {"n_layer", std::to_string(s.n_layer)},
          {"n_head", std::to_string(s.n_head)},
          {"dtype", dtype.name},
          {"step", std::to_string(step)}};
}

struct OutputFile {
  std::string path;  // where it ends up; written to path + ".tmp" first
  std::vector<const TensorSpec*> tensors;
  int64_t bytes = 0;
};

void write_safetensors(const std::string& path, const OutputFile& out, const CheckpointReader& reader,
                       const OutputDType& dtype, const std::vector<std::pair<std::string, std::string>>& metadata,
                       Progress& progress) {
  nlohmann::json header = nlohmann::json::object();
  int64_t offset = 0;
  for (const TensorSpec* t : out.tensors) {
    header[t->name] = {{"dtype", dtype.safetensors}, {"shape", t->shape}, {"data_offsets", {offset, offset + dtype.width * t->numel}}};
    offset += dtype.width * t->numel;
  }
  header["__metadata__"] = {{"format", "pt"}};  // string to string, as the format requires
  for (const auto& [key, value] : metadata) header["__metadata__"][key] = value;
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');  // data starts 8-byte aligned
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  const uint64_t len = text.size();
  f.write(reinterpret_cast<const char*>(&len), 8);
  f << text;
  std::vector<float> buf;
  std::vector<uint16_t> half;
  const std::string file = fs::path(out.path).filename().string();
  for (const TensorSpec* t : out.tensors) {
    buf.resize(static_cast<size_t>(t->numel));
    reader.read_range("params", t->offset, t->offset + t->numel, buf.data());
    f.write(encode(buf, dtype, half), static_cast<std::streamsize>(dtype.width * t->numel));
    progress.advance(dtype.width * t->numel, t->name + " -> " + file);
  }
  f.close();
  if (!f) throw SystemError(path + ": write failed");
}

void write_hdf5(const std::string& path, const OutputFile& out, const CheckpointReader& reader,
                const OutputDType& dtype, const std::vector<std::pair<std::string, std::string>>& metadata,
                Progress& progress) {
  h5::File f = h5::File::create(path);
  for (const auto& [key, value] : metadata) {
    const bool number = !value.empty() && std::all_of(value.begin(), value.end(), ::isdigit);
    if (number) h5::write_attribute(f.id(), key, static_cast<int64_t>(std::stoll(value)));
    else h5::write_attribute(f.id(), key, value);
  }
  // 16-bit values are rounded here and written as they are (HDF5's own conversion rounds differently).
  const h5::Handle half_t = dtype.name == "bf16" ? h5::bf16_type() : dtype.name == "fp16" ? fp16_type() : h5::Handle();
  const hid_t type = dtype.width == 2 ? half_t.get() : H5T_IEEE_F32LE;
  const hid_t memory_type = dtype.width == 2 ? half_t.get() : H5T_NATIVE_FLOAT;
  std::vector<float> buf;
  std::vector<uint16_t> half;
  const std::string file = fs::path(out.path).filename().string();
  for (const TensorSpec* t : out.tensors) {
    buf.resize(static_cast<size_t>(t->numel));
    reader.read_range("params", t->offset, t->offset + t->numel, buf.data());
    std::vector<hsize_t> dims(t->shape.begin(), t->shape.end());
    h5::Handle space(H5Screate_simple(static_cast<int>(dims.size()), dims.data(), nullptr), H5Sclose);
    h5::Handle ds(H5Dcreate2(f.id(), t->name.c_str(), type, space.get(), H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT),
                  h5::close_dataset);
    const herr_t rc = ds.valid() ? H5Dwrite(ds.get(), memory_type, H5S_ALL, H5S_ALL, H5P_DEFAULT, encode(buf, dtype, half)) : -1;
    if (rc < 0 || !ds.close()) throw SystemError(path + ": cannot write " + t->name);
    progress.advance(dtype.width * t->numel, t->name + " -> " + file);
  }
  f.close();
}

// The output format: --format when given (it wins over the extension), else the extension.
std::string output_format(const fs::path& out, const std::string& format) {
  if (!format.empty()) {
    if (format != "hdf5" && format != "safetensors")
      throw InputError("--format \"" + echo(format, 20) + "\": expected hdf5 or safetensors");
    return format;
  }
  std::string ext = out.extension().string();
  for (auto& c : ext) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  if (ext == ".safetensors") return "safetensors";
  if (ext == ".h5" || ext == ".hdf5") return "hdf5";
  throw InputError("convert " + echo(out.string(), 200) + ": cannot tell the format from the extension" +
                   (ext.empty() ? std::string(" (there is none)") : " \"" + echo(ext, 20) + "\"") +
                   ": name a .safetensors, .h5 or .hdf5 file, or give --format hdf5|safetensors");
}

// Whether `path` records that `zero3d convert` wrote it (file_metadata's "source"): the
// safetensors header's __metadata__, the HDF5 file's attribute, the shard index's metadata.
bool written_by_convert(const fs::path& path) {
  try {
    const std::string ext = path.extension().string();
    if (ext == ".json") {
      const nlohmann::json j = nlohmann::json::parse(read_regular_file(path.string(), "index", int64_t(64) << 20));
      return j.is_object() && j.contains("metadata") && j["metadata"].value("source", "") == kConvertSource;
    }
    if (ext == ".safetensors") {
      std::ifstream f(path, std::ios::binary);
      uint64_t len = 0;
      if (!f.read(reinterpret_cast<char*>(&len), 8) || len > (uint64_t(100) << 20)) return false;
      std::string header(static_cast<size_t>(len), '\0');
      if (!f.read(header.data(), static_cast<std::streamsize>(len))) return false;
      const nlohmann::json j = nlohmann::json::parse(header);
      return j.contains("__metadata__") && j["__metadata__"].value("source", "") == kConvertSource;
    }
    h5::quiet_errors();
    const hid_t id = H5Fopen(path.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT);
    if (id < 0) return false;
    h5::Handle file(id, H5Fclose);
    std::string source;
    return h5::read_attribute(id, "source", source) && source == kConvertSource;
  } catch (const std::exception&) {
    return false;
  }
}

// Files an earlier convert to the same name left that this one does not write: shards
// <stem>-NNNNN-of-MMMMM<ext> of another count, the index when this output is one file, the
// single file when it is sharded — each only when it records that convert wrote it. Nothing
// else in the directory is touched.
std::vector<fs::path> stale_outputs(const fs::path& dir, const std::string& stem, const std::string& ext,
                                    const std::string& single, const std::string& index,
                                    const std::set<std::string>& written) {
  std::vector<fs::path> stale;
  std::error_code ec;
  const fs::path listed = dir.empty() ? fs::path(".") : dir;
  for (fs::directory_iterator it(listed, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    if (written.count(name) || !it->is_regular_file(ec)) continue;
    bool shard = name.size() > stem.size() + ext.size() && name.compare(0, stem.size(), stem) == 0 &&
                 name.compare(name.size() - ext.size(), ext.size(), ext) == 0;
    if (shard) {  // the middle must be -<digits>-of-<digits>, five digits or more each
      const std::string mid = name.substr(stem.size(), name.size() - stem.size() - ext.size());
      const size_t of = mid.find("-of-");
      auto digits = [](const std::string& s) {
        return s.size() >= 5 && std::all_of(s.begin(), s.end(), [](char c) { return c >= '0' && c <= '9'; });
      };
      shard = mid.size() > 1 && mid[0] == '-' && of != std::string::npos && digits(mid.substr(1, of - 1)) &&
              digits(mid.substr(of + 4));
    }
    if ((shard || name == single || name == index) && written_by_convert(it->path())) stale.push_back(dir / name);
  }
  return stale;
}

}  // namespace

ConvertResult convert_checkpoint(const std::string& path, const std::string& tag, const std::string& out,
                                 const std::string& format_option, const std::string& dtype_option,
                                 int64_t max_shard_bytes) {
  const fs::path out_path(out);
  const std::string filename = out_path.filename().string();
  if (filename.empty() || filename == "." || filename == "..")
    throw InputError("convert " + echo(out, 200) + ": name the output file, e.g. out/model.safetensors");
  const std::string format = output_format(out_path, format_option);
  const OutputDType dtype = output_dtype(dtype_option);
  const fs::path dir = out_path.parent_path();
  // config.json goes beside the weights; one that is not a Hugging Face config (a zero3d run's
  // resolved configuration, say) is the user's, and is not overwritten.
  const fs::path config_path = dir / "config.json";
  std::error_code ec;
  if (fs::exists(config_path, ec)) {
    nlohmann::json existing;
    try {
      existing = nlohmann::json::parse(read_regular_file(config_path.string(), "config.json", int64_t(1) << 20));
    } catch (const nlohmann::json::exception&) {
    }
    if (!existing.is_object() || !existing.contains("model_type"))
      throw InputError(echo(config_path.string(), 200) + ": exists and is not a Hugging Face config (no \"model_type\"); "
                       "convert writes config.json beside the weights: choose another directory");
  }
  CheckpointReader reader = CheckpointReader::open(resolve_tag_dir(path, tag), "");
  const ParamLayout layout = layout_of(reader.meta());
  const ModelShape shape = model_shape_of(reader, layout);
  // Greedy shards in layout order, as Hugging Face's save_pretrained cuts them.
  std::vector<OutputFile> files(1);
  int64_t total = 0;
  for (const TensorSpec& t : layout.tensors()) {
    const int64_t bytes = dtype.width * t.numel;
    if (max_shard_bytes > 0 && files.back().bytes > 0 && files.back().bytes + bytes > max_shard_bytes) files.emplace_back();
    files.back().tensors.push_back(&t);
    files.back().bytes += bytes;
    total += bytes;
  }
  // Hugging Face's names: model.safetensors, or model-00001-of-00003.safetensors ... with
  // model.safetensors.index.json; the same pattern for any name and extension.
  const std::string ext = out_path.extension().string();
  const std::string stem = filename.substr(0, filename.size() - ext.size());
  const std::string index_name = filename + ".index.json";
  ec.clear();
  if (!dir.empty()) fs::create_directories(dir, ec);
  if (ec) throw InputError(echo(dir.string(), 200) + ": cannot create the output directory (" + ec.message() + ")");
  for (size_t k = 0; k < files.size(); ++k) {
    char name[64];
    std::snprintf(name, sizeof(name), "-%05zu-of-%05zu", k + 1, files.size());
    files[k].path = (dir / (files.size() == 1 ? filename : stem + name + ext)).string();
  }
  // Every file is written beside its final name and renamed only when all are complete, so a
  // failed convert leaves an earlier one as it was.
  const auto metadata = file_metadata(shape, dtype, reader.meta().step);
  std::vector<std::pair<std::string, std::string>> renames;  // tmp -> final
  auto remove_temporaries = [&] {
    for (const auto& [tmp, final_path] : renames) fs::remove(tmp, ec);
  };
  Progress progress("convert", total);
  try {
    nlohmann::json weight_map = nlohmann::json::object();
    for (const OutputFile& file : files) {
      renames.emplace_back(file.path + ".tmp", file.path);
      if (format == "safetensors") write_safetensors(renames.back().first, file, reader, dtype, metadata, progress);
      else write_hdf5(renames.back().first, file, reader, dtype, metadata, progress);
      for (const TensorSpec* t : file.tensors) weight_map[t->name] = fs::path(file.path).filename().string();
    }
    auto write_json = [&](const fs::path& final_path, const nlohmann::json& j) {
      renames.emplace_back(final_path.string() + ".tmp", final_path.string());
      std::ofstream f(renames.back().first, std::ios::trunc);
      f << j.dump(2) << '\n';
      f.close();
      if (!f) throw SystemError(renames.back().first + ": write failed");
    };
    if (files.size() > 1) {
      nlohmann::json index_metadata = {{"total_size", total}, {"format", format}};
      for (const auto& [key, value] : metadata) index_metadata[key] = value;
      write_json(dir / index_name, {{"metadata", index_metadata}, {"weight_map", weight_map}});
    }
    write_json(config_path, shape.family ? llama_family_config(*shape.family, dtype) : hugging_face_config(shape, dtype));
    for (const auto& [tmp, final_path] : renames) {
      fs::rename(tmp, final_path, ec);
      if (ec) throw SystemError(final_path + ": cannot rename " + tmp + " to it (" + ec.message() + ")");
    }
  } catch (...) {
    remove_temporaries();
    throw;
  }
  progress.finish();
  ConvertResult result;
  std::set<std::string> written;
  for (const auto& [tmp, final_path] : renames) {
    result.written.push_back(final_path);
    written.insert(fs::path(final_path).filename().string());
  }
  for (const fs::path& p : stale_outputs(dir, stem, ext, filename, index_name, written)) {
    if (!fs::remove(p, ec) || ec) throw SystemError(p.string() + ": cannot remove this stale output of an earlier convert (" + ec.message() + ")");
    result.removed.push_back(p.string());
  }
  return result;
}

}  // namespace zero3d
