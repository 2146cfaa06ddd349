// estimate.cpp — `zero3d estimate`: DeepSpeed's model-state tables, or the full per-rank budget
// of a config and what fits in a given memory.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <optional>
#include <set>
#include <string>

#include "base/errors.hpp"
#include "base/input_file.hpp"
#include "cli/commands.hpp"
#include "config/config.hpp"
#include "kernels/device.hpp"
#include "train/comm_volume.hpp"
#include "train/estimator.hpp"

namespace zero3d::cli {

namespace {

// Each mode reads its own options; one given to the other mode would be ignored, so it is an error.
void check_estimate_mode(const EstimateArgs& a) {
  const bool table = a.kind == "zero2" || a.kind == "zero3";
  const std::set<std::string> table_only = {"--params", "--largest-layer-params", "--gpus-per-node", "--nodes",
                                            "--additional-buffer-factor", "--model"};
  const std::set<std::string> budget_only = {"--config", "--world-size", "--memory-per-rank", "--report", "--json",
                                             "--ranks-per-node", "--step", "--step-range", "--device"};
  for (const std::string& o : a.given) {
    if (table && budget_only.count(o))
      throw InputError("estimate " + a.kind + " " + o + ": DeepSpeed's " + a.kind +
                       " table does not use it; it belongs to `zero3d estimate --config CONFIG`");
    if (!table && a.kind.empty() && table_only.count(o))
      throw InputError("estimate " + o + ": used by DeepSpeed's tables (`zero3d estimate zero2|zero3`), not by the "
                       "budget of --config");
  }
  if (table && a.has("--params") && a.has("--model"))
    throw InputError("estimate " + a.kind + ": give --params (a cold estimate) or --model CONFIG (counts from its "
                     "model), not both");
  if (a.kind == "zero2" && a.has("--largest-layer-params"))
    throw InputError("estimate zero2 --largest-layer-params: only zero3's table uses the largest layer");
}

// Options of DeepSpeed's cold estimators: finite, in range, and GPU counts whose product fits.
void check_estimate_options(const EstimateArgs& a) {
  auto number = [](const char* option, double v, double lo, double hi) {
    if (!(std::isfinite(v) && v >= lo && v <= hi)) {
      char buf[160];
      std::snprintf(buf, sizeof(buf), "estimate %s %g: expected a finite number in [%g, %g]", option, v, lo, hi);
      throw InputError(buf);
    }
  };
  if (a.has("--params")) number("--params", a.params, 1, 1e15);
  if (a.has("--largest-layer-params")) number("--largest-layer-params", a.largest_layer, 0, 1e15);
  if (a.has("--params") && a.has("--largest-layer-params") && a.largest_layer > a.params) {
    char buf[200];
    std::snprintf(buf, sizeof(buf), "estimate --largest-layer-params %g: more than the whole model (--params %g)",
                  a.largest_layer, a.params);
    throw InputError(buf);
  }
  number("--additional-buffer-factor", a.buffer_factor, 1, 100);
  if (int64_t(a.gpus_per_node) * a.nodes > kMaxRanks)
    throw InputError("estimate --gpus-per-node " + std::to_string(a.gpus_per_node) + " --nodes " +
                     std::to_string(a.nodes) + ": more than " + std::to_string(kMaxRanks) + " GPUs in all");
}

std::string mib(int64_t bytes) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%10.1f MiB", bytes / 1048576.0);
  return buf;
}

// Rank 0's groups' bytes per step, by link and by group, one column per ZeRO stage.
void print_comm_volumes(const std::vector<CommVolume>& volumes, int64_t per_node, int64_t world,
                        const std::optional<CommVolume>& compressed) {
  const auto row = [](const char* label, const std::vector<int64_t>& bytes) {
    std::printf("%-25s", label);
    for (int64_t b : bytes) std::printf(" %s", mib(b).c_str());
    std::printf("\n");
  };
  std::printf("bytes per step, rank 0's groups (bus bytes; %s)\n",
              per_node >= world ? "every rank on one node"
                                : ("nodes of " + std::to_string(per_node) + " ranks").c_str());
  std::printf("%-25s %14s %14s %14s %14s\n", "", "stage 0", "stage 1", "stage 2", "stage 3");
  std::vector<int64_t> intra, inter;
  for (const CommVolume& v : volumes) intra.push_back(v.intra_node()), inter.push_back(v.inter_node());
  row("  intra-node", intra);
  row("  inter-node", inter);
  std::vector<std::string> axes;  // every group that moves bytes at some stage, in first-seen order
  for (const CommVolume& v : volumes)
    for (const GroupBytes& g : v.groups)
      if (g.bytes > 0 && std::find(axes.begin(), axes.end(), g.axis) == axes.end()) axes.push_back(g.axis);
  for (const std::string& axis : axes) {
    std::vector<int64_t> bytes;
    for (const CommVolume& v : volumes) {
      int64_t b = 0;
      for (const GroupBytes& g : v.groups) b += g.axis == axis ? g.bytes : 0;
      bytes.push_back(b);
    }
    row(("  " + axis).c_str(), bytes);
  }
  if (!volumes.front().activations_not_predicted.empty())
    std::printf("(the tensor axis counts the exchanges the data cannot change only: %s)\n",
                volumes.front().activations_not_predicted.c_str());
  if (!volumes.front().expert_not_predicted.empty())
    std::printf("(%s; at most %.1f MiB per step)\n", volumes.front().expert_not_predicted.c_str(),
                volumes.front().expert_bound / 1048576.0);
  if (compressed)
    std::printf("1-bit optimizer past its freeze (stage 0): intra-node %s, inter-node %s per step\n",
                mib(compressed->intra_node()).c_str(), mib(compressed->inter_node()).c_str());
}

// --step-range FIRST-LAST (default: the run's steps, 1 to training.steps).
std::pair<int64_t, int64_t> step_range_of(const EstimateArgs& a, const Config& cfg) {
  if (!a.has("--step-range")) return {1, std::max<int64_t>(1, cfg.training.steps)};
  long long first = 0, last = 0;
  char tail = 0;
  if (std::sscanf(a.step_range.c_str(), "%lld-%lld%c", &first, &last, &tail) != 2 || first < 1 || last < first ||
      last > kMaxEstimateSteps)
    throw InputError("estimate --step-range " + echo(a.step_range) + ": expected FIRST-LAST with 1 <= FIRST <= LAST <= " +
                     std::to_string(kMaxEstimateSteps));
  return {first, last};
}

// The optimizer's phases over the step range (a 1-bit optimizer's bytes change with its phase),
// in bytes: a local step's few bytes would vanish in MiB.
void print_step_range(const StepRangeVolume& r, const std::string& optimizer) {
  std::printf("%s, step %lld (%s): intra-node %lld, inter-node %lld bytes\n", optimizer.c_str(), (long long)r.step,
              r.step_phase.c_str(), (long long)r.step_volume.intra_node(), (long long)r.step_volume.inter_node());
  const double steps = static_cast<double>(r.last - r.first + 1);
  std::printf("steps %lld-%lld: average per step intra-node %.0f, inter-node %.0f bytes\n", (long long)r.first,
              (long long)r.last, double(r.total_intra_node()) / steps, double(r.total_inter_node()) / steps);
  for (const StepRangeVolume::Phase& p : r.phases)
    std::printf("  %-25s %9lld steps, each intra-node %lld, inter-node %lld bytes\n", p.traffic.phase.c_str(),
                (long long)p.steps, (long long)p.volume.intra_node(), (long long)p.volume.inter_node());
}

}  // namespace

int cmd_estimate(EstimateArgs a, int rank) {
  if (rank != 0) return kExitOk;
  check_estimate_mode(a);
  check_estimate_options(a);
  if (a.kind == "zero2" || a.kind == "zero3") {
    // Cold (--params) or live (--model CONFIG, with --set applied: counts from the model definition).
    if (!a.config.overrides.empty() && a.model.empty())
      throw InputError("estimate " + a.kind + ": --set changes a config; give it with --model CONFIG");
    if (!a.model.empty()) {
      std::string model_name;
      const Config c = resolve_config(load_with_overrides({a.model, a.config.overrides, a.config.strategy}, model_name),
                                   model_name, 1, set_keys(a.config));
      const ModelCounts counts = count_model(c.model);
      a.params = double(counts.params);
      a.largest_layer = double(counts.largest_layer);
    }
    if (a.params <= 0) throw InputError("estimate " + a.kind + ": give --params P or --model CONFIG");
    if (a.kind == "zero3" && a.largest_layer < 0)
      throw InputError("estimate zero3: give --largest-layer-params L or --model CONFIG");
    const auto rows = a.kind == "zero2"
                          ? deepspeed_zero2_rows(a.params, a.gpus_per_node, a.nodes, a.buffer_factor)
                          : deepspeed_zero3_rows(a.params, a.largest_layer, a.gpus_per_node, a.nodes, a.buffer_factor);
    std::printf("%s", deepspeed_table(rows, a.params, a.kind == "zero3" ? a.largest_layer : -1, a.gpus_per_node,
                                      a.nodes).c_str());
    return kExitOk;
  }
  if (!a.kind.empty()) throw InputError("estimate: unknown kind \"" + a.kind + "\" (zero2, zero3, or --config)");
  if (a.config.path.empty()) throw InputError("estimate: give zero2/zero3 with --params, or --config CONFIG");
  std::string name;
  // Nodes of --ranks-per-node ranks (default: every rank on one node): the bytes by link, qgZ's
  // staging in every budget, the "auto" micro-batch and what fits --memory-per-rank.
  const int64_t per_node = a.ranks_per_node > 0 ? a.ranks_per_node : a.world_size;
  const kernels::Backend backend = device_option("estimate", a.has("--device") ? &a.device : nullptr);
  int64_t limit = 0;  // --memory-per-rank: the memory a rank has, which an "auto" micro-batch is fitted to
  if (a.has("--memory-per-rank")) {  // given empty is a bad size, not an absent option
    limit = size_option("--memory-per-rank", a.memory_per_rank);
    if (limit <= 0) throw InputError("estimate --memory-per-rank " + echo(a.memory_per_rank) + ": expected a size above 0");
  }
  const Config cfg = resolve_config(load_with_overrides(a.config, name), name, a.world_size, set_keys(a.config),
                                    per_node, backend, limit);
  std::vector<MemoryBudget> budgets;
  for (int stage = 0; stage <= 3; ++stage) budgets.push_back(estimate_budget(cfg, a.world_size, stage, per_node));
  std::vector<FitAnswer> fits;  // --memory-per-rank: what fits at each ZeRO stage
  if (limit > 0)
    for (int stage = 0; stage <= 3; ++stage) fits.push_back(what_fits(cfg, a.world_size, stage, limit, per_node));
  if (!a.report.empty()) write_budget_report(a.report, cfg, a.world_size, budgets, fits, limit);
  const ModelCounts counts = count_model(cfg.model);
  const bool gpu = backend == kernels::Backend::Gpu;
  nlohmann::json doc = {{"config", name}, {"device", gpu ? "gpu" : "cpu"},
                        {"world_size", a.world_size}, {"world_size_given", a.has("--world-size")},
                        {"configured_stage", cfg.zero.stage},
                        {"parameters", counts.params},
                        {"active_parameters", counts.active_params},
                        {"dtypes", {{"params", dtype_name(cfg.precision.param)},
                                    {"grad_accum", dtype_name(cfg.precision.grad_accum)},
                                    {"communication", dtype_name(cfg.precision.comm)}}},
                        {"budgets", nlohmann::json::array()}};
  for (const auto& b : budgets) doc["budgets"].push_back(b.to_json());
  // Bytes per step by link (comm_volume.hpp): every ZeRO stage, and a 1-bit optimizer's compressed phase.
  const bool onebit = cfg.optimizer.type == OptimizerType::OneBitAdam || cfg.optimizer.type == OptimizerType::OneBitLamb;
  const auto [first_step, last_step] = step_range_of(a, cfg);
  const StepRangeVolume by_step = estimate_step_range(cfg, a.world_size, per_node, a.step, first_step, last_step);
  doc["optimizer_communication"] = by_step.to_json();
  std::vector<CommVolume> volumes;
  for (int stage = 0; stage <= 3; ++stage) volumes.push_back(estimate_comm_volume(cfg, a.world_size, stage, per_node));
  doc["ranks_per_node"] = per_node;
  doc["communication"] = nlohmann::json::array();
  for (const CommVolume& v : volumes) doc["communication"].push_back(v.to_json());
  if (onebit)
    doc["communication_compressed"] =
        estimate_comm_volume(cfg, a.world_size, 0, per_node, compressed_traffic(cfg.optimizer)).to_json();
  const RankLayout layout = rank_layout(cfg, a.world_size);
  doc["pipeline_stages"] = layout.stages;
  doc["tensor_parallel_size"] = layout.tensor;
  doc["data_parallel_size"] = layout.data;
  doc["ranks"] = nlohmann::json::array();  // every pipeline stage's budgets (tensor rank 0 stands for its group)
  for (int stage = 0; stage <= 3; ++stage) {
    const std::vector<MemoryBudget> per_rank = estimate_rank_budgets(cfg, a.world_size, stage, per_node);
    for (size_t s = 0; s < per_rank.size(); ++s) {
      if (stage == 0) doc["ranks"].push_back({{"pipe_stage", per_rank[s].pipe_stage},
                                              {"tensor_rank", per_rank[s].tensor_rank},
                                              {"budgets", nlohmann::json::array()}});
      doc["ranks"][s]["budgets"].push_back(per_rank[s].to_json());
    }
  }
  if (limit > 0) {
    doc["memory_per_rank"] = limit;
    for (const FitAnswer& f : fits) {
      doc["largest_micro_batch"].push_back(f.configured);
      doc["fits"].push_back(f.to_json());
    }
  }
  if (a.json) {
    std::printf("%s\n", doc.dump(2).c_str());
    return kExitOk;
  }
  // MoE: every expert is stored, a token meets k of each block's E
  const MoeConfig& moe = cfg.model.moe;
  const std::string active = !moe.enabled() ? "" : " (" + std::to_string(counts.active_params) + " active: " +
                                                       std::to_string(moe.k) + " of " + std::to_string(moe.num_experts) +
                                                       " experts per token)";
  std::printf("%s: %lld parameters%s, micro-batch %lld, %s (configured stage %lld), %s parameters, %s gradients, %s "
              "communication\n",
              name.c_str(), (long long)counts.params, active.c_str(), (long long)cfg.batch.micro_batch,
              layout_text(layout, a.world_size).c_str(), (long long)cfg.zero.stage,
              dtype_name(cfg.precision.param).c_str(), dtype_name(cfg.precision.grad_accum).c_str(),
              dtype_name(cfg.precision.comm).c_str());
  if (backend != kernels::kBuildBackend)  // (only a CPU build's plan of a GPU run)
    std::printf("(--device gpu: the plan of a GPU build's run, made on this CPU build: the GPU's attention kernels, "
                "bf16 logits and tensor-parallel saves, a vocabulary padded as a GPU's, device memory)\n");
  if (!a.has("--world-size"))  // without --world-size the budget is for one rank, and says so
    std::printf("(--world-size not given: the budget is for %lld rank(s); give --world-size N for N ranks in all)\n",
                (long long)a.world_size);
  std::printf("bytes per rank (the largest: pipeline stage, tensor rank)");
  for (const auto& b : budgets) std::printf("  stage %d: (%d, %d)", b.stage, b.pipe_stage, b.tensor_rank);
  std::printf("\n");
  std::printf("bytes per rank            %14s %14s %14s %14s\n", "stage 0", "stage 1", "stage 2", "stage 3");
  const char* rows[] = {"params", "grads", "master", "optimizer_states", "comm_reduce", "comm_gather", "comm_prefetch",
                        "live_params", "activations", "workspace", "runtime", "total"};
  for (const char* row : rows) {
    std::printf("%-25s", row);
    for (const auto& b : budgets) std::printf(" %s", mib(b.to_json()[row].get<int64_t>()).c_str());
    std::printf("\n");
  }
  // Offload (and cpu_checkpointing): where the bytes live, as the start-up plan line says.
  bool tiers = false;
  for (const auto& b : budgets) tiers = tiers || b.host_total() > 0 || b.offload_nvme > 0;
  if (tiers) {
    std::printf("%-25s", "  in device memory");
    for (const auto& b : budgets) std::printf(" %s", mib(b.device_total()).c_str());
    std::printf("\n%-25s", "  in host memory");
    for (const auto& b : budgets) std::printf(" %s", mib(b.host_total()).c_str());
    std::printf("\n%-25s", "(in NVMe swap files)");
    for (const auto& b : budgets) std::printf(" %s", mib(b.offload_nvme).c_str());
    if (gpu)
      std::printf("\n(offload: `total` is device plus host memory; `in device memory` is what the GPU holds; swap "
                  "files are on disk and not in the total)\n");
    else
      std::printf("\n(offload: `total` is device plus host memory, the same memory on this CPU-only build; `in "
                  "device memory` is what a GPU would hold; swap files are on disk and not in the total)\n");
  }
  const std::pair<const char*, int64_t MemoryBudget::*> alternatives[] = {
      {"(activations in host mem)", &MemoryBudget::activations_host},
      {"(activations, none)", &MemoryBudget::activations_none},
      {"(activations, selective)", &MemoryBudget::activations_selective},
      {"(activations, full)", &MemoryBudget::activations_checkpointed}};
  for (const auto& [label, field] : alternatives) {
    std::printf("%-25s", label);
    for (const auto& b : budgets) std::printf(" %s", mib(b.*field).c_str());
    std::printf("\n");
  }
  if (limit > 0) {
    std::printf("largest micro-batch within %s per rank:", a.memory_per_rank.c_str());
    for (int stage = 0; stage <= 3; ++stage) {
      const int64_t mb = doc["largest_micro_batch"][stage];
      if (mb > 0) {
        std::printf("  stage %d: %lld", stage, (long long)mb);
      } else {
        Config one = cfg;
        one.batch.micro_batch = 1;
        const MemoryBudget b = estimate_budget(one, a.world_size, stage, per_node);
        std::printf("  stage %d: none (model states alone %.1f MiB, %s at micro-batch 1 %.1f MiB)", stage,
                    b.model_states() / 1048576.0, gpu ? "device memory" : "total", b.device_need() / 1048576.0);
      }
    }
    std::printf("\n");
    const long long mb = cfg.batch.micro_batch;
    for (const FitAnswer& f : fits) {
      const char* verdict = mb <= f.none        ? "fits without checkpointing"
                            : mb <= f.selective ? "needs checkpointing: selective recompute is enough"
                            : mb <= f.full      ? "needs checkpointing: full recompute"
                                                : "does not fit even with full recompute";
      std::printf("  stage %d: largest micro-batch without checkpointing %lld, selective %lld, full (interval 1) %lld; "
                  "micro-batch %lld %s\n",
                  f.stage, (long long)f.none, (long long)f.selective, (long long)f.full, mb, verdict);
    }
  }
  print_comm_volumes(volumes, per_node, a.world_size,
                     onebit ? std::optional<CommVolume>(estimate_comm_volume(cfg, a.world_size, 0, per_node,
                                                                             compressed_traffic(cfg.optimizer)))
                            : std::nullopt);
  if (cfg.optimizer.one_bit() || a.has("--step") || a.has("--step-range"))
    print_step_range(by_step, cfg.optimizer.type_name);
  if (!a.report.empty()) std::printf("report  %s\n", a.report.c_str());
  return kExitOk;
}

}  // namespace zero3d::cli
