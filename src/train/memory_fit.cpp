// memory_fit.cpp — estimator.hpp's start-up side: the memory this machine makes available (the
// cgroup's limit, else MemAvailable), whether a rank's plan fits it (check_memory_fits), the
// "auto" micro-batch the planner fits into it, and a GPU's shortfall against cudaMemGetInfo.
#include <algorithm>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "base/errors.hpp"
#include "base/input_file.hpp"
#include "train/estimator.hpp"

namespace zero3d {

namespace {
// The first number on the line of `file` that starts with `key` (meminfo: kB), or -1.
int64_t read_number(const std::string& file, const std::string& key) {
  std::ifstream in(file);
  for (std::string line; std::getline(in, line);) {
    if (line.compare(0, key.size(), key) != 0) continue;
    try {
      return std::stoll(line.substr(key.size()));
    } catch (const std::exception&) {
      return -1;  // "max" (no limit) and anything unreadable
    }
  }
  return -1;
}
}  // namespace

AvailableMemory available_memory() {
  AvailableMemory a;
  const int64_t kb = read_number("/proc/meminfo", "MemAvailable:");
  if (kb >= 0) a = {kb * 1024, "MemAvailable"};
  // cgroup v2, then v1: the limit minus what the group already uses.
  const std::pair<const char*, const char*> groups[] = {
      {"/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"},
      {"/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"}};
  for (const auto& [limit_file, usage_file] : groups) {
    const int64_t limit = read_number(limit_file, ""), usage = read_number(usage_file, "");
    if (limit <= 0 || usage < 0 || limit >= (int64_t(1) << 60)) continue;
    const int64_t left = std::max<int64_t>(0, limit - usage);
    if (a.bytes < 0 || left < a.bytes) a = {left, "cgroup memory limit"};
  }
  return a;
}

MemoryBudget check_memory_fits(const Config& cfg, int ranks_here, const AvailableMemory& avail,
                               int64_t ranks_per_node) {
  const int64_t ranks = cfg.batch.world_size * std::max(1, cfg.pipeline.stages) * std::max(1, cfg.tensor.size);
  // The run's node layout, as the engine's own plan takes it (qgZ's staging is sized by its nodes).
  const MemoryBudget b = estimate_budget(cfg, ranks, cfg.zero.stage, ranks_per_node);
  if (avail.bytes < 0) return b;
  const double need = double(b.host_need()) * std::max(1, ranks_here);  // host memory: a GPU build's device is checked apart
  if (need <= double(avail.bytes)) return b;
  // Name the two largest categories with the keys that size them.
  const ModelConfig& m = cfg.model;
  const std::string model_keys = "model.vocab_size " + std::to_string(m.vocab_size) + ", model.n_embd " +
                                 std::to_string(m.n_embd) + ", model.n_layer " + std::to_string(m.n_layer);
  struct Part {
    double bytes;
    std::string text;
  };
  std::vector<Part> parts = {
      {double(b.model_states()), "model states " + human_bytes(double(b.model_states())) + " (" +
                                     std::to_string(count_model(m).params) + " parameters: " + model_keys +
                                     "; zero_optimization.stage " + std::to_string(b.stage) + ")"},
      {double(b.activations), "activations " + human_bytes(double(b.activations)) +
                                  " (train_micro_batch_size_per_gpu " + std::to_string(cfg.batch.micro_batch) +
                                  ", model.n_positions " + std::to_string(m.n_positions) + ", " + model_keys +
                                  ", model.n_head " + std::to_string(m.n_head) + ")"},
      {double(b.comm_reduce + b.comm_gather + b.comm_prefetch + b.live_params),
       "communication buffers " + human_bytes(double(b.comm_reduce + b.comm_gather + b.comm_prefetch + b.live_params)) +
           " (zero_optimization.reduce_bucket_size, max_live_parameters)"},
      {double(b.workspace), "workspace " + human_bytes(double(b.workspace)) + " (data.path, model.init_from)"}};
  std::sort(parts.begin(), parts.end(), [](const Part& x, const Part& y) { return x.bytes > y.bytes; });
  throw InputError(cfg.file + ": the run needs " + human_bytes(double(b.host_need())) + " per rank" +
                   (ranks_here > 1 ? " x " + std::to_string(ranks_here) + " ranks on this machine" : "") +
                   " but " + human_bytes(double(avail.bytes)) + " is available (" + avail.source + "), short by " +
                   human_bytes(need - double(avail.bytes)) + "; largest: " + parts[0].text + ", " + parts[1].text);
}

namespace {

// "auto" micro-batch with nothing to derive it from: the largest that the memory planner says
// fits the memory a rank has (memory_per_rank where given; else the started device's, or this
// machine's available memory shared by `world_size` ranks, on nodes of `ranks_per_node`), at
// most HF's default of 8.
void plan_auto_micro_batch(Config& c, int64_t world_size, int64_t ranks_per_node, int64_t memory_per_rank) {
  AvailableMemory avail = available_memory();
  int64_t sharing = world_size;  // the ranks avail.bytes is divided among
  std::string shared = " / " + std::to_string(world_size) + " ranks";
  std::string unknown = "available memory unknown";
  const bool device_started = kernels::kGpuBuild && kernels::backend_started();
  if (memory_per_rank > 0) {  // the memory the planner was told each rank has
    avail = {memory_per_rank, "--memory-per-rank"};
    sharing = 1;
    shared.clear();
  } else if (c.backend == kernels::Backend::Gpu && !device_started) {
    // a GPU run planned where no device has started (estimate --device gpu on a CPU build, a GPU
    // build's planning commands on a login node): this machine's memory is not the device's
    avail = {};
    unknown = "no GPU has started here to give its memory";
  } else if (device_started) {
    // The device's total memory, not its free memory: the same on every rank of identical
    // devices, so every rank resolves the same micro-batch (the start-up device check then
    // compares the plan with what is free).
    const kernels::DeviceInfo d = kernels::device_info();
    const int64_t here = ranks_per_node > 0 ? std::min(ranks_per_node, world_size) : world_size;
    avail = {device_bytes_per_rank(d.total_bytes, d.visible, here), d.name + " memory per rank on it"};
    sharing = 1;
    shared.clear();
  }
  int64_t micro = kHfPerDeviceBatch;
  std::string why = "Hugging Face's per_device_train_batch_size default; " + unknown;
  if (avail.bytes > 0) {
    const int64_t per_rank = avail.bytes / std::max<int64_t>(1, sharing);
    const int64_t fits = largest_fitting_micro_batch(c, world_size, c.zero.stage, per_rank, ranks_per_node);
    micro = std::max<int64_t>(1, std::min(kHfPerDeviceBatch, fits));
    why = "the memory planner fits " + std::to_string(fits) + " per rank in " + human_bytes(double(per_rank)) +
          " (" + avail.source + shared + "); at most Hugging Face's "
          "per_device_train_batch_size default of " + std::to_string(kHfPerDeviceBatch);
  }
  BatchConfig& b = c.batch;
  b.micro_batch = micro;
  b.train_batch_size = micro * b.gradient_accumulation_steps * b.world_size;
  std::ostringstream out;
  out << "train_batch_size " << b.train_batch_size << " = micro_batch " << micro << " x gradient_accumulation_steps "
      << b.gradient_accumulation_steps << " x data-parallel size " << b.world_size << " (micro-batch \"auto\")";
  b.derivation = out.str();
  c.notes.push_back("auto    train_micro_batch_size_per_gpu = " + std::to_string(micro) + " (" + why + ")");
  if (b.accumulation_auto)
    c.notes.push_back("auto    gradient_accumulation_steps = 1 (Hugging Face's gradient_accumulation_steps default)");
  if (b.train_batch_auto)
    c.notes.push_back("auto    train_batch_size = " + std::to_string(b.train_batch_size) +
                        " (micro-batch x gradient_accumulation_steps x data-parallel size, as Hugging Face fills it)");
}

}  // namespace

Config resolve_config(const nlohmann::json& root, const std::string& file, int64_t world_size,
                      const std::vector<std::string>& set_keys, int64_t ranks_per_node, kernels::Backend backend,
                      int64_t memory_per_rank) {
  Config c = read_config(root, file, world_size, set_keys, backend);
  if (!c.batch.micro_batch_from_memory) return c;
  try {
    plan_auto_micro_batch(c, world_size, ranks_per_node, memory_per_rank);
  } catch (const InputError& e) {
    const std::string what = e.what();
    throw InputError(what.rfind(file + ": ", 0) == 0 ? what : file + ": " + what);
  }
  c.batch.micro_batch_from_memory = false;
  c.resolved["train_batch_size"] = c.batch.train_batch_size;
  c.resolved["train_micro_batch_size_per_gpu"] = c.batch.micro_batch;
  c.resolved["gradient_accumulation_steps"] = c.batch.gradient_accumulation_steps;
  return c;
}

int64_t device_bytes_per_rank(int64_t device_total, int visible, int64_t ranks_here) {
  const int64_t devices = std::max(1, visible), ranks = std::max<int64_t>(1, ranks_here);
  return device_total / ((ranks + devices - 1) / devices);  // the busiest device's ranks
}

std::string device_memory_shortfall(int64_t plan_bytes, int ranks_on_device, int64_t free_bytes,
                                    const std::string& device) {
  const int64_t need = plan_bytes * ranks_on_device;
  if (need <= free_bytes) return "";
  char text[512];
  std::snprintf(text, sizeof text,
                "device memory: the plan needs %.1f MB per rank%s%s, but %s has %.1f MB free (%.1f MB short); "
                "lower train_micro_batch_size_per_gpu, raise zero_optimization.stage, enable "
                "activation_checkpointing, or run fewer ranks per GPU (`zero3d estimate` shows each choice)",
                plan_bytes / 1e6, ranks_on_device > 1 ? " x " : "",
                ranks_on_device > 1 ? (std::to_string(ranks_on_device) + " ranks sharing the device").c_str() : "",
                device.c_str(), free_bytes / 1e6, (need - free_bytes) / 1e6);
  return text;
}

}  // namespace zero3d
