// main.cpp — CLI11 subcommands; the one place that catches errors and sets the exit code.
//
// Exit codes: 0 success, 2 bad input (one message, from rank 0), 1 system/internal failure
// (message names the failing rank; the job is aborted so that no rank hangs).
#include <mpi.h>

#include <CLI/CLI.hpp>
#include <Kokkos_Core.hpp>
#include <chrono>
#include <cstdio>
#include <string>
#include <thread>
#include <vector>

#include "base.hpp"
#include "checkpoint.hpp"
#include "config.hpp"
#include "engine.hpp"
#include "estimator.hpp"
#include "failure.hpp"
#include "h5.hpp"
#include "topology.hpp"

using namespace zero3d;

namespace {

struct ConfigArgs {
  std::string path;  // empty = the built-in quick-start
  std::vector<std::string> overrides;
};

// Loads the JSON (file or built-in quick-start) and applies --set overrides in order.
nlohmann::json load_with_overrides(const ConfigArgs& a, std::string& name) {
  nlohmann::json root = a.path.empty() ? quickstart_json() : load_json_file(a.path);
  name = a.path.empty() ? "<built-in quickstart>" : a.path;
  for (const auto& o : a.overrides) apply_override(root, o);
  return root;
}

std::string run_name(const std::string& path) {
  if (path.empty()) return "quickstart";
  std::string base = path.substr(path.find_last_of('/') + 1);
  return base.substr(0, base.find_last_of('.'));
}

int cmd_validate(const ConfigArgs& a, int64_t world_size, MPI_Comm world) {
  std::string name;
  Config cfg;
  run_collectively(world, [&] { cfg = read_config(load_with_overrides(a, name), name, world_size); });
  int rank = 0;
  MPI_Comm_rank(world, &rank);
  if (rank == 0) {
    std::printf("%s: valid for data-parallel world size %lld\n", name.c_str(), (long long)world_size);
    std::printf("batch   %s\n", cfg.batch.derivation.c_str());
  }
  return kExitOk;
}

int cmd_train(const ConfigArgs& a, const std::string& output_override, MPI_Comm world) {
  int size = 1, rank = 0;
  MPI_Comm_size(world, &size);
  MPI_Comm_rank(world, &rank);
  std::string name, out;
  Config cfg;
  run_collectively(world, [&] {
    cfg = read_config(load_with_overrides(a, name), name, size);
    out = !output_override.empty()           ? output_override
          : !cfg.training.output_dir.empty() ? cfg.training.output_dir
                                             : "output/" + run_name(a.path);
    cfg.resolved["training"]["output_dir"] = out;
    if (cfg.training.save_dir.empty()) cfg.training.save_dir = out + "/checkpoints";
    cfg.resolved["training"]["save_dir"] = cfg.training.save_dir;
  });
  // Pure data parallelism for now: every rank is one data-parallel replica.
  ProcessGroups groups(ProcessTopology::pipe_data_model(1, size, 1), world);
  Watchdog watchdog(cfg.training.comms_timeout, rank);
  Engine engine(cfg, groups, out, &watchdog);
  engine.train();
  return kExitOk;
}

// Prints each rank's coordinates and groups for a pipe x data x model job.
int cmd_topology(int pp, int dp, int tp, bool as_json, int rank) {
  if (rank != 0) return kExitOk;
  const ProcessTopology topo = ProcessTopology::pipe_data_model(pp, dp, tp);
  nlohmann::json doc = {{"axes", topo.get_axis_names()}, {"dims", topo.dims()}, {"ranks", nlohmann::json::array()}};
  for (int r = 0; r < topo.world_size(); ++r) {
    nlohmann::json entry = {{"rank", r}, {"coord", nlohmann::json::object()}, {"groups", nlohmann::json::object()}};
    for (const auto& axis : topo.get_axis_names()) {
      entry["coord"][axis] = topo.get_coord(r).at(axis);
      for (const auto& group : topo.get_axis_comm_lists(axis))
        if (std::find(group.begin(), group.end(), r) != group.end()) entry["groups"][axis] = group;
    }
    doc["ranks"].push_back(entry);
  }
  if (as_json) {
    std::printf("%s\n", doc.dump().c_str());
    return kExitOk;
  }
  std::printf("%d ranks = pipe %d x data %d x model %d (row-major, model fastest)\n", topo.world_size(), pp, dp, tp);
  auto list = [](const nlohmann::json& g) {
    std::string s;
    for (const auto& r : g) s += (s.empty() ? "" : ",") + std::to_string(r.get<int>());
    return "[" + s + "]";
  };
  for (const auto& e : doc["ranks"])
    std::printf("rank %3d  pipe %d data %d model %d  | data group %s  tensor group %s  pipe group %s\n",
                e["rank"].get<int>(), e["coord"]["pipe"].get<int>(), e["coord"]["data"].get<int>(),
                e["coord"]["model"].get<int>(), list(e["groups"]["data"]).c_str(), list(e["groups"]["model"]).c_str(),
                list(e["groups"]["pipe"]).c_str());
  return kExitOk;
}

int cmd_inspect(const std::string& dir, const std::string& tag, const std::string& tensor, bool as_json, int rank) {
  if (rank != 0) return kExitOk;
  const nlohmann::json r = inspect_checkpoint(dir, tag, tensor);
  if (as_json) {
    std::printf("%s\n", r.dump(2).c_str());
    return kExitOk;
  }
  std::printf("checkpoint %s\n", r["dir"].get<std::string>().c_str());
  if (r.contains("tags")) {
    std::string tags;
    for (const auto& t : r["tags"]) tags += (tags.empty() ? "" : ", ") + t.get<std::string>();
    std::printf("tags       %s (latest: %s)\n", tags.c_str(), r["latest"].get<std::string>().c_str());
  }
  std::printf("step %lld | samples %lld | ZeRO stage %lld | topology pipe 1 x data %lld x model 1 | %zu shards | "
              "master %s | optimizer %s | checksums verified\n",
              r["step"].get<long long>(), r["global_samples"].get<long long>(), r["zero_stage"].get<long long>(),
              r["topology"]["data"].get<long long>(), r["shards"].get<size_t>(),
              r["dtypes"]["master"].get<std::string>().c_str(), r["optimizer"].get<std::string>().c_str());
  std::printf("%-28s %-14s %-5s %12s %12s %12s %12s\n", "tensor", "shape", "dtype", "min", "max", "mean", "l2_norm");
  for (const auto& t : r["tensors"])
    std::printf("%-28s %-14s %-5s %12.5g %12.5g %12.5g %12.5g\n", t["name"].get<std::string>().c_str(),
                t["shape"].dump().c_str(), t["dtype"].get<std::string>().c_str(), t["min"].get<double>(),
                t["max"].get<double>(), t["mean"].get<double>(), t["l2_norm"].get<double>());
  return kExitOk;
}

int cmd_convert(const std::string& dir, const std::string& out, const std::string& tag, const std::string& format,
                const std::string& dtype, const std::string& max_shard, int rank) {
  if (rank != 0) return kExitOk;
  const int64_t shard = max_shard.empty() ? 0 : parse_byte_size(max_shard);
  for (const auto& f : convert_checkpoint(dir, tag, out, format, dtype, shard)) std::printf("wrote %s\n", f.c_str());
  return kExitOk;
}

struct EstimateArgs {
  std::string kind;  // zero2 | zero3 | empty (the complete budget of --config)
  double params = 0, largest_layer = -1, buffer_factor = 1.5;
  int gpus_per_node = 1, nodes = 1;
  std::string model, report, memory_per_rank;
  ConfigArgs config;
  int64_t world_size = 1;
  bool json = false;
};

std::string mib(int64_t bytes) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%10.1f MiB", bytes / 1048576.0);
  return buf;
}

int cmd_estimate(EstimateArgs a, int rank) {
  if (rank != 0) return kExitOk;
  if (a.kind == "zero2" || a.kind == "zero3") {
    // Cold (--params) or live (--model CONFIG: counts from the model definition).
    if (!a.model.empty()) {
      const Config c = read_config(load_json_file(a.model), a.model, 1);
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
  const Config cfg = read_config(load_with_overrides(a.config, name), name, a.world_size);
  std::vector<MemoryBudget> budgets;
  for (int stage = 0; stage <= 3; ++stage) budgets.push_back(estimate_budget(cfg, a.world_size, stage));
  if (!a.report.empty()) write_budget_report(a.report, cfg, a.world_size, budgets);
  nlohmann::json doc = {{"config", name}, {"world_size", a.world_size}, {"configured_stage", cfg.zero.stage},
                        {"parameters", count_model(cfg.model).params},
                        {"dtypes", {{"params", dtype_name(cfg.precision.param)},
                                    {"grad_accum", dtype_name(cfg.precision.grad_accum)},
                                    {"communication", dtype_name(cfg.precision.comm)}}},
                        {"budgets", nlohmann::json::array()}};
  for (const auto& b : budgets) doc["budgets"].push_back(b.to_json());
  int64_t limit = 0;
  if (!a.memory_per_rank.empty()) {
    limit = parse_byte_size(a.memory_per_rank);
    doc["memory_per_rank"] = limit;
    for (int stage = 0; stage <= 3; ++stage)
      doc["largest_micro_batch"].push_back(largest_fitting_micro_batch(cfg, a.world_size, stage, limit));
  }
  if (a.json) {
    std::printf("%s\n", doc.dump(2).c_str());
    return kExitOk;
  }
  std::printf("%s: %lld parameters, micro-batch %lld, %lld data-parallel ranks (configured stage %lld), %s "
              "parameters, %s gradients, %s communication\n",
              name.c_str(), (long long)doc["parameters"].get<int64_t>(), (long long)cfg.batch.micro_batch,
              (long long)a.world_size, (long long)cfg.zero.stage, dtype_name(cfg.precision.param).c_str(),
              dtype_name(cfg.precision.grad_accum).c_str(), dtype_name(cfg.precision.comm).c_str());
  std::printf("bytes per rank            %14s %14s %14s %14s\n", "stage 0", "stage 1", "stage 2", "stage 3");
  const char* rows[] = {"params", "grads", "master", "optimizer_states", "comm_reduce", "comm_gather", "comm_prefetch",
                        "live_params", "activations", "workspace", "runtime", "total"};
  for (const char* row : rows) {
    std::printf("%-25s", row);
    for (const auto& b : budgets) std::printf(" %s", mib(b.to_json()[row].get<int64_t>()).c_str());
    std::printf("\n");
  }
  std::printf("%-25s", "(activations, checkpointed)");
  for (const auto& b : budgets) std::printf(" %s", mib(b.activations_checkpointed).c_str());
  std::printf("\n");
  if (limit > 0) {
    std::printf("largest micro-batch within %s per rank:", a.memory_per_rank.c_str());
    for (int stage = 0; stage <= 3; ++stage) {
      const int64_t mb = doc["largest_micro_batch"][stage];
      if (mb > 0) {
        std::printf("  stage %d: %lld", stage, (long long)mb);
      } else {
        Config one = cfg;
        one.batch.micro_batch = 1;
        const MemoryBudget b = estimate_budget(one, a.world_size, stage);
        std::printf("  stage %d: none (model states alone %.1f MiB, total at micro-batch 1 %.1f MiB)", stage,
                    b.model_states() / 1048576.0, b.total() / 1048576.0);
      }
    }
    std::printf("\n");
  }
  if (!a.report.empty()) std::printf("report  %s\n", a.report.c_str());
  return kExitOk;
}

}  // namespace

int main(int argc, char** argv) {
  // The watchdog thread may call MPI_Abort while the main thread waits in a collective.
  int thread_level = MPI_THREAD_SINGLE;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &thread_level);
  int rank = 0, world = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &world);
  Kokkos::initialize(argc, argv);
  h5::quiet_errors();

  CLI::App app{"zero3d — DeepSpeed-style ZeRO training of GPT models, without Python", "zero3d"};
  app.set_version_flag("--version", std::string("zero3d ") + ZERO3D_VERSION);
  app.require_subcommand(1);

  ConfigArgs train_args, validate_args;
  std::string output_dir;
  int64_t world_size = world;
  auto* train = app.add_subcommand("train", "Train a model described by a DeepSpeed-style JSON config");
  train->add_option("config", train_args.path, "config file (default: the built-in quick-start)");
  train->add_option("--set", train_args.overrides, "override a key: --set optimizer.params.lr=1e-3")->take_all();
  train->add_option("--output", output_dir, "output directory (default: training.output_dir or output/<config name>)");
  auto* validate = app.add_subcommand("validate", "Check a config without training; exit 0 or 2");
  validate->add_option("config", validate_args.path, "config file")->required();
  validate->add_option("--world-size", world_size, "data-parallel world size to check the batch triad against")
      ->check(CLI::PositiveNumber);
  validate->add_option("--set", validate_args.overrides, "override a key")->take_all();
  int pp = 1, dp = 1, tp = 1;
  bool as_json = false;
  auto* topology = app.add_subcommand("topology", "Print each rank's coordinates and process groups");
  topology->add_option("--pp", pp, "pipeline-parallel size")->check(CLI::PositiveNumber);
  topology->add_option("--dp", dp, "data-parallel size")->check(CLI::PositiveNumber);
  topology->add_option("--tp", tp, "tensor-parallel size")->check(CLI::PositiveNumber);
  topology->add_flag("--json", as_json, "machine-readable output");

  std::string ck_dir, ck_tag, ck_tensor, ck_out, ck_format = "hdf5", ck_dtype = "fp32", ck_shard;
  bool ck_json = false;
  auto* inspect = app.add_subcommand("inspect", "Show a checkpoint's tags, metadata and tensors; verify checksums");
  inspect->add_option("dir", ck_dir, "checkpoint directory (save_dir or one tag)")->required();
  inspect->add_option("--tag", ck_tag, "tag to inspect (default: latest)");
  inspect->add_option("--tensor", ck_tensor, "only this tensor (Hugging Face name)");
  inspect->add_flag("--json", ck_json, "machine-readable output");
  auto* convert = app.add_subcommand("convert", "Consolidate a checkpoint into Hugging Face-named weights");
  convert->add_option("dir", ck_dir, "checkpoint directory (save_dir or one tag)")->required();
  convert->add_option("out", ck_out, "output file, e.g. out/model.safetensors")->required();
  convert->add_option("--tag", ck_tag, "tag to convert (default: latest)");
  convert->add_option("--format", ck_format, "hdf5 or safetensors")->check(CLI::IsMember({"hdf5", "safetensors"}));
  convert->add_option("--dtype", ck_dtype, "fp32 or bf16")->check(CLI::IsMember({"fp32", "bf16"}));
  convert->add_option("--max-shard-size", ck_shard, "split into files of at most this size (e.g. 5GB)");

  EstimateArgs est;
  est.world_size = world;
  auto* estimate = app.add_subcommand("estimate", "Memory per rank: DeepSpeed's tables (zero2/zero3) or a full budget");
  estimate->add_option("kind", est.kind, "zero2 or zero3 for DeepSpeed's model-state tables");
  estimate->add_option("--params", est.params, "total parameters (cold estimate)");
  estimate->add_option("--largest-layer-params", est.largest_layer, "parameters of the largest layer (zero3)");
  estimate->add_option("--gpus-per-node", est.gpus_per_node, "GPUs per node")->check(CLI::PositiveNumber);
  estimate->add_option("--nodes", est.nodes, "nodes")->check(CLI::PositiveNumber);
  estimate->add_option("--additional-buffer-factor", est.buffer_factor, "DeepSpeed's buffer factor (1.5)");
  estimate->add_option("--model", est.model, "take the counts from this config's model (live estimate)");
  estimate->add_option("--config", est.config.path, "the full per-rank budget of this configuration");
  estimate->add_option("--set", est.config.overrides, "override a key of --config")->take_all();
  estimate->add_option("--world-size", est.world_size, "data-parallel ranks")->check(CLI::PositiveNumber);
  estimate->add_option("--memory-per-rank", est.memory_per_rank, "find the largest micro-batch that fits (e.g. 16GiB)");
  estimate->add_option("--report", est.report, "write the budget to this HDF5 file");
  estimate->add_flag("--json", est.json, "machine-readable output");

  int code = kExitOk;
  try {
    app.parse(argc, argv);
    if (train->parsed()) code = cmd_train(train_args, output_dir, MPI_COMM_WORLD);
    else if (validate->parsed()) code = cmd_validate(validate_args, world_size, MPI_COMM_WORLD);
    else if (topology->parsed()) code = cmd_topology(pp, dp, tp, as_json, rank);
    else if (estimate->parsed()) code = cmd_estimate(est, rank);
    else if (inspect->parsed()) code = cmd_inspect(ck_dir, ck_tag, ck_tensor, ck_json, rank);
    else if (convert->parsed())
      code = cmd_convert(ck_dir, ck_out, ck_tag, ck_format, ck_dtype, ck_shard, rank);
  } catch (const CLI::ParseError& e) {
    // --help and --version are "errors" with exit code 0 in CLI11.
    if (rank == 0) app.exit(e);
    code = e.get_exit_code() == 0 ? kExitOk : kExitBadInput;
  } catch (const AgreedFailure& e) {
    // Every rank knows; one reports. (Bad config: all ranks fail alike and rank 0 reports.)
    if (e.report()) {
      const char* kind = e.code() == kExitBadInput ? "error" : "fatal";
      if (e.failed_rank() == 0) std::fprintf(stderr, "zero3d: %s: %s\n", kind, e.what());
      else std::fprintf(stderr, "zero3d: rank %d: %s: %s\n", e.failed_rank(), kind, e.what());
    }
    code = e.code();
  } catch (const std::exception& e) {
    // Not agreed: the other ranks may be waiting for this one, so take the job down.
    const bool bad_input = dynamic_cast<const InputError*>(&e) != nullptr;
    code = bad_input ? kExitBadInput : kExitSystem;
    std::fprintf(stderr, "zero3d: rank %d: %s: %s\n", rank, bad_input ? "error" : "fatal", e.what());
    std::fflush(stderr);
    if (world > 1) {
      // Give the launcher a moment to forward the message before it tears the job down.
      std::this_thread::sleep_for(std::chrono::milliseconds(300));
      MPI_Abort(MPI_COMM_WORLD, code);
    }
  }
  std::fflush(stdout);
  Kokkos::finalize();
  MPI_Finalize();
  return code;
}
