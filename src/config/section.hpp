// config/section.hpp — internal to the config reader (config*.cpp): the Section class that
// reads one JSON object, tracks consumed keys and records the resolved values.
#pragma once

#include <algorithm>
#include <cctype>
#include <cmath>
#include <limits>
#include <optional>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "base/errors.hpp"
#include "base/input_file.hpp"
#include "config/config.hpp"

namespace zero3d::config_detail {

using json = nlohmann::json;

// The upper bound of the readers' int-valued keys.
inline constexpr int64_t kMaxInt = std::numeric_limits<int32_t>::max();

inline std::string lower(std::string s) {
  for (auto& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

inline size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diag = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      size_t up = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diag + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diag = up;
    }
  }
  return row[b.size()];
}

inline std::string nearest(const std::string& key, const std::vector<std::string>& candidates) {
  if (key.size() > 64) return "";  // no key is that long; and edit distance is quadratic
  std::string best;
  size_t best_d = std::numeric_limits<size_t>::max();
  for (const auto& c : candidates) {
    size_t d = edit_distance(lower(key), lower(c));
    if (d < best_d) best_d = d, best = c;
  }
  // Suggest only plausible neighbours: at most a third of the key's letters differ.
  if (best.empty() || best_d > std::max<size_t>(2, key.size() / 3)) return "";
  return best;
}

// A JSON value for a message: escaped, and capped at 60 bytes with its full length.
inline std::string show(const json& v) {
  return echo(v.dump(-1, ' ', false, json::error_handler_t::replace), 60);
}

// What one read of a config has found so far, shared by all its Sections: every problem (the
// read goes on with defaults so that one pass reports them all) and the start-up notes.
struct ReadContext {
  std::vector<std::string> problems;  // "`key.path`: why", in the order found
  std::vector<std::string> notes;     // start-up lines: "auto" resolutions, keys with no effect here
  std::vector<std::string> set_keys;  // key paths the command line's --set gave (not the file)
  std::vector<std::string> known_paths;  // every key path a reader knows, for "did you mean" across sections
  // One problem per key: a second one about the same key is a consequence of the first (a
  // default stood in for the bad value), not news. A key --set gave (or lies on the path of)
  // is named as the command line's, since the file does not hold it.
  void problem(const std::string& line) {
    const std::string key = line.rfind("`", 0) == 0 ? line.substr(0, line.find('`', 1) + 1) : line;
    for (const std::string& p : problems)
      if (p.rfind(key, 0) == 0) return;
    const std::string path = key.size() > 2 && key[0] == '`' ? key.substr(1, key.size() - 2) : "";
    for (const std::string& s : set_keys)
      if (!path.empty() && (s == path || s.rfind(path + ".", 0) == 0)) {
        problems.push_back(line + " (given by --set " + s + ")");
        return;
      }
    problems.push_back(line);
  }
};

// Thrown after a problem is recorded: unwinds to the nearest reader that goes on with defaults.
struct KeyProblem {};

// Reads one JSON object, remembering which keys were consumed, and writes every value
// (given or default) into the resolved config at the same path. A bad value is recorded in
// the ReadContext and the default is used instead, so that the next keys are still checked.
class Section {
 public:
  Section(const json* obj, std::string path, std::string file, json* resolved, ReadContext* ctx)
      : obj_(obj), path_(std::move(path)), file_(std::move(file)), resolved_(resolved), ctx_(ctx) {
    if (obj_ && !obj_->is_object()) {
      report(path_, "expected an object, got " + show(*obj_));
      obj_ = nullptr;  // read as absent: its keys take their defaults
    }
  }

  bool has(const std::string& key) const { return obj_ && obj_->contains(key); }
  bool is_auto(const std::string& key) const {
    return has(key) && !substitutes_.contains(key) && (*obj_)[key].is_string() && (*obj_)[key] == "auto";
  }
  std::string key_path(const std::string& key) const {
    return path_.empty() ? key : path_ + "." + key;
  }

  // Records a problem and goes on.
  void report(const std::string& key_path, const std::string& why) const {
    ctx_->problem("`" + key_path + "`: " + why);
  }
  void report_key(const std::string& key, const std::string& why) const { report(key_path(key), why); }
  // Records a problem and abandons the reading in progress (its keys keep their defaults).
  [[noreturn]] void fail(const std::string& key_path, const std::string& why) const {
    report(key_path, why);
    throw KeyProblem{};
  }
  [[noreturn]] void fail_key(const std::string& key, const std::string& why) const {
    fail(key_path(key), why);
  }

  void mark_known(const std::string& key) { know(key); }
  ReadContext& context() const { return *ctx_; }
  const std::string& file() const { return file_; }
  // A start-up line (an "auto" resolution, a key with no effect on this build).
  void note(const std::string& line) const { ctx_->notes.push_back(line); }
  // DeepSpeed's pydantic sections drop an "auto" value before validation, so "auto" means the
  // default there (DEEPSPEED-FACTS §1.3); set for those sections, with `why` naming the rule.
  void auto_is_default(const std::string& why) { auto_default_ = why; }
  // Drops a key from the resolved config: a deprecated name whose value lives under its new one.
  void forget(const std::string& key) { resolved_->erase(key); }
  // Writes a value read by hand (after raw()) into the resolved config.
  void record(const std::string& key, const json& value) { (*resolved_)[key] = value; }

  // A key zero3d reads: returns its raw JSON (or null when absent) and marks it known.
  // Reads `value` where the config says "auto" for `key` (a value derived by the caller).
  void substitute(const std::string& key, const json& value) { substitutes_[key] = value; }

  const json* raw(const std::string& key) {
    know(key);
    if (substitutes_.contains(key)) return &substitutes_[key];
    if (!has(key)) return nullptr;
    const json* v = &(*obj_)[key];
    if (v->is_string() && *v == "auto") {
      if (!auto_default_.empty()) {
        auto_notes_.push_back(key);
        return nullptr;  // the reader fills the default, then resolved() shows it
      }
      fail_key(key, "\"auto\" cannot be derived for this key; give a value");
    }
    return v;
  }

  bool boolean(const std::string& key, bool def) {
    try {
      return boolean_or_throw(key, def);
    } catch (const KeyProblem&) {
      (*resolved_)[key] = def;
      return def;
    }
  }
  bool boolean_or_throw(const std::string& key, bool def) {
    const json* v = raw(key);
    bool out = def;
    if (v) {
      if (!v->is_boolean()) fail_key(key, "expected true or false, got " + show(*v));
      out = v->get<bool>();
    }
    (*resolved_)[key] = out;
    return out;
  }

  int64_t integer(const std::string& key, int64_t def, int64_t lo, int64_t hi) {
    try {
      return integer_or_throw(key, def, lo, hi);
    } catch (const KeyProblem&) {
      (*resolved_)[key] = def;
      return def;
    }
  }
  int64_t integer_or_throw(const std::string& key, int64_t def, int64_t lo, int64_t hi) {
    const json* v = raw(key);
    int64_t out = def;
    if (v) out = as_integer(key, *v);
    if (out < lo || out > hi)
      fail_key(key, "value " + std::to_string(out) + " is out of range [" + std::to_string(lo) + ", " +
                        std::to_string(hi) + "]");
    (*resolved_)[key] = out;
    return out;
  }

  // lo_open: the lower bound itself is not allowed (e.g. lr > 0 vs eps >= 0).
  double number(const std::string& key, double def, double lo, double hi, bool lo_open = false) {
    try {
      return number_or_throw(key, def, lo, hi, lo_open);
    } catch (const KeyProblem&) {
      (*resolved_)[key] = def;
      return def;
    }
  }
  double number_or_throw(const std::string& key, double def, double lo, double hi, bool lo_open = false) {
    const json* v = raw(key);
    double out = def;
    if (v) {
      if (!v->is_number()) fail_key(key, "expected a number, got " + show(*v));
      out = v->get<double>();
    }
    check_range(key, out, lo, hi, lo_open);
    (*resolved_)[key] = out;
    return out;
  }

  std::string string(const std::string& key, const std::string& def) {
    try {
      return string_or_throw(key, def);
    } catch (const KeyProblem&) {
      (*resolved_)[key] = def;
      return def;
    }
  }
  std::string string_or_throw(const std::string& key, const std::string& def) {
    const json* v = raw(key);
    std::string out = def;
    if (v) {
      if (!v->is_string()) fail_key(key, "expected a string, got " + show(*v));
      out = v->get<std::string>();
    }
    (*resolved_)[key] = out;
    return out;
  }

  // A file or directory name: a control byte (a NUL above all) would name another path than
  // the one validated, or none at all.
  std::string path(const std::string& key, const std::string& def) {
    try {
      return path_or_throw(key, def);
    } catch (const KeyProblem&) {
      (*resolved_)[key] = def;
      return def;
    }
  }
  std::string path_or_throw(const std::string& key, const std::string& def) {
    std::string out = string_or_throw(key, def);
    if (out.size() > 4096) fail_key(key, "path " + show(json(out)) + " is longer than PATH_MAX (4096 bytes)");
    const size_t bad = find_control_byte(out);
    if (bad != std::string::npos)
      fail_key(key, "path " + show(json(out)) + " contains a control byte (" + echo(out.substr(bad, 1)) +
                        " at offset " + std::to_string(bad) + ")");
    return out;
  }

  // A string from a fixed set, matched case-insensitively; returns the canonical spelling.
  std::string choice(const std::string& key, const std::string& def, const std::vector<std::string>& options) {
    try {
      return choice_or_throw(key, def, options);
    } catch (const KeyProblem&) {
      (*resolved_)[key] = def;
      return def;
    }
  }
  std::string choice_or_throw(const std::string& key, const std::string& def, const std::vector<std::string>& options) {
    std::string s = string_or_throw(key, def);
    for (const auto& o : options)
      if (lower(o) == lower(s)) {
        (*resolved_)[key] = o;
        return o;
      }
    std::string list;
    for (const auto& o : options) list += (list.empty() ? "" : ", ") + o;
    fail_key(key, "value " + show(json(s)) + " is not one of: " + list);
  }

  // A pair of numbers such as Adam's betas, each in [0, 1).
  std::pair<double, double> pair(const std::string& key, std::pair<double, double> def) {
    try {
      return pair_or_throw(key, def);
    } catch (const KeyProblem&) {
      (*resolved_)[key] = {def.first, def.second};
      return def;
    }
  }
  std::pair<double, double> pair_or_throw(const std::string& key, std::pair<double, double> def) {
    const json* v = raw(key);
    auto out = def;
    if (v) {
      if (!v->is_array() || v->size() != 2 || !(*v)[0].is_number() || !(*v)[1].is_number())
        fail_key(key, "expected a list of two numbers, got " + show(*v));
      out = {(*v)[0].get<double>(), (*v)[1].get<double>()};
    }
    for (double b : {out.first, out.second})
      if (!(b >= 0.0 && b < 1.0)) fail_key(key, "each value must be in [0, 1), got " + show(*v));
    (*resolved_)[key] = {out.first, out.second};
    return out;
  }

  // A value that may be "auto", resolved by the caller from what it can derive.
  double number_or_auto(const std::string& key, double def, double auto_value, double lo, double hi,
                        bool lo_open = false) {
    if (is_auto(key)) {
      mark_known(key);
      try {
        check_range(key, auto_value, lo, hi, lo_open);
      } catch (const KeyProblem&) {
        (*resolved_)[key] = def;
        return def;
      }
      (*resolved_)[key] = auto_value;
      return auto_value;
    }
    return number(key, def, lo, hi, lo_open);
  }
  int64_t integer_or_auto(const std::string& key, int64_t def, int64_t auto_value, int64_t lo, int64_t hi) {
    if (is_auto(key)) {
      mark_known(key);
      (*resolved_)[key] = auto_value;
      return auto_value;
    }
    return integer(key, def, lo, hi);
  }

  Section child(const std::string& key) {
    know(key);
    const json* v = has(key) ? &(*obj_)[key] : nullptr;
    if (!resolved_->contains(key) || !(*resolved_)[key].is_object()) (*resolved_)[key] = json::object();
    Section s(v, key_path(key), file_, &(*resolved_)[key], ctx_);
    s.auto_default_ = auto_default_;
    return s;
  }

  // A key whose meaning needs hardware this build does not drive: accepted with any value of
  // its type, recorded, and listed once at start-up with `why` (never silently ignored).
  void no_effect(const std::string& key, const std::string& why) {
    know(key);
    if (!has(key)) return;
    const json& v = (*obj_)[key];
    (*resolved_)[key] = v;
    note("no effect on this build: `" + key_path(key) + "` = " + show(v) + " (" + why + ")");
  }

  // As no_effect, but only a value other than `implemented` (what zero3d always does) is noted.
  void hardware_only(const std::string& key, const json& implemented, const std::string& why) {
    if (has(key) && (*obj_)[key] == implemented) {
      know(key);
      (*resolved_)[key] = implemented;
      return;
    }
    no_effect(key, why);
  }

  // A DeepSpeed feature zero3d does not have: any value but `off` is an error naming the
  // feature and what to use instead.
  void feature_missing(const std::string& key, const json& off, const std::string& feature,
                       const std::string& instead) {
    know(key);
    if (!has(key)) return;
    const json& v = (*obj_)[key];
    if (v == "auto" && !auto_default_.empty()) {  // "auto" = DeepSpeed's default, which is off
      (*resolved_)[key] = off;
      auto_notes_.push_back(key);
      return;
    }
    if (v == off || (v.is_number() && off.is_number() && v.get<double>() == off.get<double>())) {
      (*resolved_)[key] = v;
      return;
    }
    report_key(key, "value " + show(v) + ": zero3d does not have " + feature + "; " + instead);
  }

  // Keys DeepSpeed defines that zero3d accepts only at their DeepSpeed default (the
  // feature is off); any other value is rejected as unsupported rather than misspelt.
  void accept_default_only(const std::string& key, const json& deepspeed_default) {
    know(key);
    if (!has(key)) return;
    const json& v = (*obj_)[key];
    if (v == deepspeed_default || (v.is_number() && deepspeed_default.is_number() &&
                                   v.get<double>() == deepspeed_default.get<double>())) {
      (*resolved_)[key] = v;
      return;
    }
    report_key(key, "DeepSpeed feature `" + key_path(key) + "` (value " + show(v) +
                        ") is not supported by zero3d; remove it or set it to " + deepspeed_default.dump());
  }

  // A DeepSpeed section zero3d does not implement: accepted only while it is disabled.
  void accept_disabled_section(const std::string& key) {
    know(key);
    if (!has(key)) return;
    const json& v = (*obj_)[key];
    bool enabled = true;
    if (v.is_object()) {
      auto it = v.find("enabled");
      enabled = it != v.end() && !(it->is_boolean() && !it->get<bool>());
    } else if (v.is_boolean()) {
      enabled = v.get<bool>();
    }
    if (enabled) {
      report_key(key, "DeepSpeed feature `" + key_path(key) + "` is not supported by zero3d" +
                          (v.is_object() ? "; remove the section or set \"enabled\": false" : ""));
      return;
    }
    (*resolved_)[key] = v;
  }

  // Every key not read above is an error: a DeepSpeed key zero3d lacks is named as such,
  // anything else as unknown with the nearest known key. Keys starting with `_` are comments.
  void finish(const std::vector<std::string>& deepspeed_only = {}) {
    for (const std::string& key : auto_notes_)
      note("auto    " + key_path(key) + " = " + (resolved_->contains(key) ? (*resolved_)[key].dump() : "null") +
           " (" + auto_default_ + ")");
    auto_notes_.clear();
    if (!obj_) return;
    for (auto it = obj_->begin(); it != obj_->end(); ++it) {
      const std::string& key = it.key();
      if (!key.empty() && key[0] == '_') continue;
      if (std::find(known_.begin(), known_.end(), key) != known_.end()) continue;
      if (std::find(deepspeed_only.begin(), deepspeed_only.end(), key) != deepspeed_only.end()) {
        report_key(key, "DeepSpeed feature `" + key_path(key) + "` is not supported by zero3d");
        continue;
      }
      std::string hint = nearest(key, known_);
      if (!hint.empty()) hint = key_path(hint);
      else hint = nearest_elsewhere(key);  // a key of another section given here (top-level n_positions)
      report_key(echo(key, 60), "unknown key" + (hint.empty() ? std::string() : " (did you mean `" + hint + "`?)"));
    }
  }

 private:
  void know(const std::string& key) {
    known_.push_back(key);
    ctx_->known_paths.push_back(key_path(key));
  }
  // The known key path in another section whose last name is nearest to `key` (as nearest()).
  std::string nearest_elsewhere(const std::string& key) const {
    std::vector<std::string> names;
    std::vector<const std::string*> paths;
    const std::string mine = path_.empty() ? "" : path_ + ".";
    for (const std::string& p : ctx_->known_paths) {
      const size_t dot = p.find_last_of('.');
      const std::string parent = dot == std::string::npos ? "" : p.substr(0, dot + 1);
      if (parent == mine) continue;  // this section's own keys: nearest() has looked at them
      names.push_back(dot == std::string::npos ? p : p.substr(dot + 1));
      paths.push_back(&p);
    }
    const std::string best = nearest(key, names);
    if (best.empty()) return "";
    for (size_t i = 0; i < names.size(); ++i)
      if (names[i] == best) return *paths[i];
    return "";
  }
  int64_t as_integer(const std::string& key, const json& v) const {
    // An unsigned beyond int64 would wrap to a negative value and be reported as that.
    if (v.is_number_unsigned() && v.get<uint64_t>() > uint64_t(std::numeric_limits<int64_t>::max()))
      fail_key(key, "value " + show(v) + " is too large");
    if (v.is_number_integer()) return v.get<int64_t>();
    // DeepSpeed configs often write sizes as 5e8: accept a float with an integral value.
    if (v.is_number_float()) {
      double d = v.get<double>();
      if (std::isfinite(d) && std::floor(d) == d && std::fabs(d) < 9.2e18) return static_cast<int64_t>(d);
    }
    fail_key(key, "expected an integer, got " + show(v));
  }
  void check_range(const std::string& key, double x, double lo, double hi, bool lo_open) const {
    bool ok = std::isfinite(x) && (lo_open ? x > lo : x >= lo) && x <= hi;
    if (!ok) {
      std::ostringstream os;
      os << "value " << x << " is out of range " << (lo_open ? "(" : "[") << lo << ", " << hi << "]";
      fail_key(key, os.str());
    }
  }

  const json* obj_;
  std::string path_, file_;
  json* resolved_;
  ReadContext* ctx_;
  std::vector<std::string> known_;
  std::string auto_default_;            // non-empty: "auto" means the default, for this reason
  std::vector<std::string> auto_notes_;  // keys given as "auto" that took their default
  json substitutes_ = json::object();    // values derived for keys given as "auto"
};

// Runs one reader; a KeyProblem (already recorded) or an InputError (recorded here) leaves
// what it was filling at its defaults and the read goes on.
template <class F>
void attempt(ReadContext& ctx, const std::string& file, F&& f) {
  try {
    f();
  } catch (const KeyProblem&) {
  } catch (const InputError& e) {
    std::string what = e.what();
    if (what.rfind(file + ": ", 0) == 0) what = what.substr(file.size() + 2);
    ctx.problem(what);
  }
}

// The batch DeepSpeed's elastic solver computes, and the data-parallel sizes it is valid for.
struct ElasticBatch {
  int64_t train_batch_size = 0, micro_batch = 0;
  std::vector<int64_t> valid_world_sizes;
};
// Reads `elasticity` (config/elasticity.cpp); enabled: the batch for `dp_world` data-parallel ranks.
std::optional<ElasticBatch> read_elasticity(Section& top, int64_t dp_world);

// Reads the fp16 / bf16 / communication_data_type / data_types keys (config/precision.cpp).
PrecisionConfig read_precision(Section& top, const Config& c);
// Reads flops_profiler, csv_monitor, tensorboard, wandb, comet, comms_logger, trace (config/observability.cpp).
ObservabilityConfig read_observability(Section& top);
// Reads `activation_checkpointing` (config/activation_checkpointing.cpp); `interval` is
// pipeline.activation_checkpoint_interval, absent when the config does not give it.
ActivationCheckpointing read_activation_checkpointing(Section& top, const Config& c, std::optional<int> interval);
// Reads `progressive_layer_drop` (config/pld.cpp).
PldConfig read_progressive_layer_drop(Section& top, const Config& c);
// Reads the `checkpoint` section (config/checkpoint.cpp).
CheckpointOptions read_checkpoint_section(Section& top, const Config& c);
// config/inference.cpp: the `inference` section (DeepSpeed's init_inference keys).
InferenceConfig read_inference(Section& top);

// config/zero.cpp: zero_optimization with offload and `aio` (tuning: the config is the
// autotuner's input, whose stage may be a search space); the optimizer checks under ZeRO and
// offload; prescale_gradients and gradient_predivide_factor.
void read_zero(Section& top, Config& c, bool tuning);
void check_zero_optimizer(Section& top, const Config& c);
void check_shard_groups(Section& top, const Config& c);
void check_offload(Section& top, const Config& c);
void read_gradient_averaging(Section& top, Config& c);
// config/model_family.cpp: a Hugging Face config.json (model.hf_config: the file, or a directory
// holding config.json; *file names the file read), and the Llama family's keys of the `model`
// section over that file's (hf: null without hf_config) into m.
json read_hf_config_file(Section& model, const std::string& path, std::string* file);
void read_llama_family(Section& sec, ModelConfig& m, Architecture arch, const json* hf, const std::string& hf_file);
// A dropout probability (config.cpp): a number in [0, 1), 0 when absent; 1 (everything dropped)
// and values below the masks' 24-bit resolution (which would drop nothing) are errors naming the key.
double read_dropout_probability(Section& sec, const std::string& key);
// tensor_parallel.preset_model and partition_config (config/autotp.cpp): DeepSpeed's AutoTP
// rules, checked against the split zero3d makes of the model; the preset's name into t.
void read_autotp_rules(Section& tp, const ModelConfig& m, TensorParallelConfig& t);
// model.frozen_parameters (config/frozen.cpp): the patterns, each checked to be a regular
// expression matching at least one parameter of m's layout, and not all of them.
void read_frozen_parameters(Section& model, ModelConfig& m);
// The frozen parameters against the rest of the run (pipeline, tensor parallel, MoE, offload,
// optimizers that need whole buffers).
void check_frozen_parameters(Section& top, const Config& c);
// model.moe (config/moe.cpp): the section, then its checks against the layout and the rest of the run.
MoeConfig read_moe(Section& model);
// model.moe of a Mixtral: ep_size only (the routing is the model's, from its Hugging Face keys).
void read_mixtral_moe(Section& model, MoeConfig& m);
void check_moe(Section& top, const Config& c, int64_t data_parallel_size);
// sparse_attention (config/sparse_attention.cpp): the layout's keys for its mode and DeepSpeed's checks.
SparseAttention read_sparse_attention(Section& top, const Config& c);
// The `optimizer` and `scheduler` sections and gradient_clipping (config/optimizer.cpp).
OptimizerConfig read_optimizer(Section& top);
SchedulerConfig read_scheduler(Section& top, const OptimizerConfig& opt, int64_t total_steps);
double read_gradient_clipping(Section& top);

// config/files.cpp: the nlohmann message without its "[json.exception.xxx.nnn] " prefix,
// escaped and capped; and the config with its `strategy` preset expanded beneath it (the
// config's keys win; an unknown name is a problem recorded in ctx).
std::string json_detail(const json::exception& e);
json with_strategy_preset(const json& given, const std::string& file, ReadContext& ctx);

}  // namespace zero3d::config_detail
