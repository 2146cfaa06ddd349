// config/files.cpp — the config's JSON before it is read: files parsed (duplicate keys refused,
// size and depth bounded), `--set` overrides, Lightning's strategy presets and their expansion,
// the built-in quick-start configuration.
#include <cctype>
#include <cmath>
#include <cstdlib>
#include <set>
#include <string>
#include <vector>

#include "config/section.hpp"

namespace zero3d {

using json = nlohmann::json;

namespace {
using namespace config_detail;

// Config files are kilobytes; a bound keeps a wrong path (a log, an image) from filling memory.
constexpr int64_t kMaxConfigBytes = int64_t(64) << 20;
// JSON nesting deeper than any config needs is refused before the recursive dump/compare code sees it.
constexpr int kMaxJsonDepth = 64;

[[noreturn]] void too_deep(const std::string& file) {
  throw InputError(file + ": JSON nested deeper than " + std::to_string(kMaxJsonDepth) + " levels");
}

// The first number literal of a JSON text that a double cannot hold (1e400), with its 1-based
// line and column and the key path it is the value of (`a.b[2]`); token empty when none.
struct NumberOverflow {
  std::string token, key;
  size_t line = 0, column = 0;
};

NumberOverflow find_number_overflow(const std::string& text) {
  struct Frame {
    bool object;
    std::string key;  // the member being read (objects)
    size_t index;     // the element being read (arrays)
  };
  std::vector<Frame> stack;
  bool expect_key = false;
  auto key_path = [&] {
    std::string out;
    for (const Frame& f : stack) {
      if (f.object) out += (out.empty() ? "" : ".") + f.key;
      else out += "[" + std::to_string(f.index) + "]";
    }
    return out;
  };
  size_t line = 1, line_start = 0;
  for (size_t i = 0; i < text.size();) {
    const char c = text[i];
    if (c == '\n') {
      ++line, line_start = ++i;
    } else if (c == '/' && i + 1 < text.size() && (text[i + 1] == '/' || text[i + 1] == '*')) {  // comments (allowed)
      const bool block = text[i + 1] == '*';
      const size_t end = block ? text.find("*/", i + 2) : text.find('\n', i);
      const size_t stop = end == std::string::npos ? text.size() : end + (block ? 2 : 0);
      for (size_t k = i; k < stop; ++k)
        if (text[k] == '\n') ++line, line_start = k + 1;
      i = stop;
    } else if (c == '"') {
      size_t k = i + 1;
      while (k < text.size() && text[k] != '"') k += text[k] == '\\' ? 2 : 1;
      if (expect_key && !stack.empty()) stack.back().key = text.substr(i + 1, k - i - 1);
      i = k + 1;
    } else if (c == '{' || c == '[') {
      stack.push_back({c == '{', "", 0});
      expect_key = c == '{';
      ++i;
    } else if (c == '}' || c == ']') {
      if (!stack.empty()) stack.pop_back();
      ++i;
    } else if (c == ':') {
      expect_key = false;
      ++i;
    } else if (c == ',') {
      if (!stack.empty() && !stack.back().object) ++stack.back().index;
      expect_key = !stack.empty() && stack.back().object;
      ++i;
    } else if (c == '-' || (c >= '0' && c <= '9')) {
      size_t k = i + 1;
      while (k < text.size() && (std::isdigit(static_cast<unsigned char>(text[k])) || text[k] == '.' || text[k] == 'e' ||
                                 text[k] == 'E' || text[k] == '+' || text[k] == '-'))
        ++k;
      const std::string token = text.substr(i, k - i);
      if (std::isinf(std::strtod(token.c_str(), nullptr))) return {token, key_path(), line, i - line_start + 1};
      i = k;
    } else {
      ++i;
    }
  }
  return {};
}

// Keys of `over` replace those of `base`; objects merge key by key.
void merge_over(json& base, const json& over) {
  for (auto it = over.begin(); it != over.end(); ++it) {
    if (it->is_object() && base.contains(it.key()) && base[it.key()].is_object()) merge_over(base[it.key()], *it);
    else base[it.key()] = *it;
  }
}
}  // namespace

namespace config_detail {
// The nlohmann message without its "[json.exception.xxx.nnn] " prefix, escaped and capped.
std::string json_detail(const json::exception& e) {
  std::string what = e.what();
  const auto cut = what.find("] ");
  if (what.rfind("[json.exception.", 0) == 0 && cut != std::string::npos) what = what.substr(cut + 2);
  return echo(what, 160);
}

// The config with its `strategy` preset expanded beneath it (the config's keys win).
json with_strategy_preset(const json& given, const std::string& file, ReadContext& ctx) {
  if (!given.is_object() || !given.contains("strategy")) return given;
  const json& v = given["strategy"];
  const json preset = v.is_string() ? strategy_preset(v.get<std::string>()) : json();
  if (preset.is_null()) {
    std::string list;
    for (const auto& n : strategy_names()) list += (list.empty() ? "" : ", ") + n;
    const std::string hint = v.is_string() ? nearest(v.get<std::string>(), strategy_names()) : "";
    ctx.problem("`strategy`: " + show(v) + " is not a Lightning DeepSpeed strategy (" + list + ")" +
                (hint.empty() ? "" : "; did you mean \"" + hint + "\"?"));
    json out = given;
    out.erase("strategy");
    return out;
  }
  json out = preset;
  merge_over(out, given);
  ctx.notes.push_back("strategy " + v.get<std::string>() + ": Lightning DeepSpeedStrategy's defaults under " + file +
                      "'s own keys");
  return out;
}
}  // namespace config_detail

json parse_json_text(const std::string& text, const std::string& file) {
  // Track keys per open object to reject duplicates, as DeepSpeed does.
  std::vector<std::set<std::string>> open_objects;
  std::vector<std::string> path;
  std::string pending_key;
  auto callback = [&](int depth, json::parse_event_t event, json& parsed) {
    switch (event) {
      case json::parse_event_t::array_start:
        if (depth >= kMaxJsonDepth) too_deep(file);
        break;
      case json::parse_event_t::object_start:
        if (depth >= kMaxJsonDepth) too_deep(file);
        open_objects.emplace_back();
        if (depth > 0 || !pending_key.empty()) path.push_back(pending_key);
        pending_key.clear();
        break;
      case json::parse_event_t::object_end:
        open_objects.pop_back();
        if (!path.empty()) path.pop_back();
        break;
      case json::parse_event_t::key: {
        std::string key = parsed.get<std::string>();
        if (!open_objects.back().insert(key).second) {
          std::string where;
          for (const auto& p : path) where += (p.empty() ? "" : p + ".");
          throw InputError(file + ": duplicate key `" + echo(where + key) + "`");
        }
        pending_key = key;
        break;
      }
      default:
        break;
    }
    return true;
  };
  try {
    return json::parse(text, callback, /*allow_exceptions=*/true, /*ignore_comments=*/true);
  } catch (const json::parse_error& e) {
    size_t pos = e.byte == 0 ? 0 : e.byte - 1;
    size_t line = 1, col = 1;
    for (size_t i = 0; i < pos && i < text.size(); ++i) {
      if (text[i] == '\n') ++line, col = 1;
      else ++col;
    }
    std::string what = e.what();
    const std::string lead = "syntax error while ";  // nlohmann's words before "parsing <what> - <why>"
    auto cut = what.find(lead + "parsing ");
    std::string detail = cut == std::string::npos ? what : what.substr(cut + lead.size());
    throw InputError(file + ":" + std::to_string(line) + ":" + std::to_string(col) +
                     ": JSON syntax error: " + echo(detail, 160));
  } catch (const json::exception& e) {
    // out_of_range.406 carries no position: find the number the way a syntax error is named.
    if (const NumberOverflow n = find_number_overflow(text); !n.token.empty())
      throw InputError(file + ":" + std::to_string(n.line) + ":" + std::to_string(n.column) + ": " +
                       (n.key.empty() ? std::string("the number ") : "`" + echo(n.key) + "`: ") + echo(n.token, 40) +
                       " is beyond the range of a double (about 1.8e308)");
    throw InputError(file + ": " + json_detail(e));
  }
}

json load_json_file(const std::string& path) {
  return parse_json_text(read_regular_file(path, "config file", kMaxConfigBytes), path);
}

void apply_override(json& root, const std::string& assignment) {
  // JSON strings are UTF-8: a raw byte such as 0xff could not even be printed back (dump throws).
  if (!is_valid_utf8(assignment)) throw InputError("--set " + echo(assignment) + ": not valid UTF-8");
  auto eq = assignment.find('=');
  if (eq == std::string::npos || eq == 0)
    throw InputError("--set " + echo(assignment) + ": expected key.path=value");
  std::string path = assignment.substr(0, eq), value_text = assignment.substr(eq + 1);
  const std::string where = "--set " + echo(assignment);
  json value;
  try {
    value = json::parse(value_text, [&](int depth, json::parse_event_t event, json&) {
      if ((event == json::parse_event_t::object_start || event == json::parse_event_t::array_start) &&
          depth >= kMaxJsonDepth)
        too_deep(where);
      return true;
    });
  } catch (const json::parse_error&) {
    value = value_text;  // bare words are strings: --set scheduler.type=WarmupLR
  } catch (const json::exception& e) {
    throw InputError(where + ": " + json_detail(e));
  }
  json* node = &root;
  size_t start = 0;
  while (true) {
    size_t dot = path.find('.', start);
    std::string key = path.substr(start, dot == std::string::npos ? std::string::npos : dot - start);
    if (key.empty()) throw InputError(where + ": empty key in `" + echo(path) + "`");
    if (!node->is_object())
      throw InputError(where + ": `" + echo(path.substr(0, start - 1)) + "` is not an object");
    if (dot == std::string::npos) {
      // null removes the key: it then reads as absent (its default), so a section the file
      // turns on can be switched off from the command line.
      if (value.is_null()) node->erase(key);
      else (*node)[key] = value;
      return;
    }
    if (value.is_null() && !node->contains(key)) return;  // nothing there to remove
    node = &(*node)[key];
    if (node->is_null()) *node = json::object();
    start = dot + 1;
  }
}

json strategy_preset(const std::string& name) {
  // Lightning's strategy registry (lightning/pytorch/strategies/deepspeed.py register_strategies)
  // with DeepSpeedStrategy's defaults as _create_default_config writes them.
  struct Preset {
    const char* name;
    int stage;
    bool offload_optimizer, offload_parameters;
    const char* device;
  };
  static const Preset presets[] = {
      {"deepspeed", 2, false, false, "cpu"},          {"deepspeed_stage_1", 1, false, false, "cpu"},
      {"deepspeed_stage_2", 2, false, false, "cpu"},  {"deepspeed_stage_2_offload", 2, true, false, "cpu"},
      {"deepspeed_stage_3", 3, false, false, "cpu"},  {"deepspeed_stage_3_offload", 3, true, true, "cpu"},
      {"deepspeed_stage_3_offload_nvme", 3, true, true, "nvme"}};
  for (const Preset& p : presets) {
    if (name != p.name) continue;
    json zero = {{"stage", p.stage},
                 {"contiguous_gradients", true},
                 {"overlap_comm", true},
                 {"allgather_partitions", true},
                 {"reduce_scatter", true},
                 {"allgather_bucket_size", 200000000},
                 {"reduce_bucket_size", 200000000},
                 {"sub_group_size", 1000000000000LL}};
    const bool nvme = std::string(p.device) == "nvme";
    // Lightning always writes nvme_path ("/local_nvme"); zero3d refuses a path it would not use,
    // so it comes only with the nvme device.
    if (p.offload_optimizer) {
      zero["offload_optimizer"] = {{"device", p.device}, {"buffer_count", 4}, {"pin_memory", false}};
      if (nvme) zero["offload_optimizer"]["nvme_path"] = "/local_nvme";
    }
    if (p.offload_parameters) {
      zero["offload_param"] = {{"device", p.device},         {"buffer_count", 5},     {"buffer_size", 100000000},
                               {"max_in_cpu", 1000000000}, {"pin_memory", false}};
      if (nvme) zero["offload_param"]["nvme_path"] = "/local_nvme";
    }
    return json{{"zero_allow_untested_optimizer", true},
                {"zero_optimization", zero},
                {"aio", {{"block_size", 1048576}, {"queue_depth", 8}, {"single_submit", false},
                         {"overlap_events", true}, {"thread_count", 1}}},
                {"activation_checkpointing", {{"partition_activations", false}, {"cpu_checkpointing", false},
                                              {"contiguous_memory_optimization", false},
                                              {"synchronize_checkpoint_boundary", false}}},
                {"fp16", {{"loss_scale", 0}, {"initial_scale_power", 16}, {"loss_scale_window", 1000},
                          {"hysteresis", 2}, {"min_loss_scale", 1}}}};
  }
  return nullptr;
}

const std::vector<std::string>& strategy_names() {
  static const std::vector<std::string> names = {"deepspeed",         "deepspeed_stage_1",
                                                 "deepspeed_stage_2", "deepspeed_stage_2_offload",
                                                 "deepspeed_stage_3", "deepspeed_stage_3_offload",
                                                 "deepspeed_stage_3_offload_nvme"};
  return names;
}

json quickstart_json() {
  // A small GPT on the built-in synthetic task: learns in well under two minutes on 2 cores.
  return json::parse(R"({
    "_comment": "zero3d quick-start: a small GPT-2 on the built-in synthetic task",
    "train_batch_size": 16,
    "train_micro_batch_size_per_gpu": 8,
    "steps_per_print": 10,
    "gradient_clipping": 1.0,
    "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.01}},
    "scheduler": {"type": "WarmupDecayLR",
                  "params": {"warmup_min_lr": 0, "warmup_max_lr": 3e-3, "warmup_num_steps": 20,
                             "warmup_type": "linear", "total_num_steps": "auto"}},
    "model": {"vocab_size": 256, "n_positions": 128, "n_layer": 4, "n_head": 4, "n_embd": 128},
    "data": {"source": "synthetic"},
    "training": {"steps": 300, "seed": 1234}
  })");
}

}  // namespace zero3d
