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
#include "config.hpp"
#include "engine.hpp"
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

  int code = kExitOk;
  try {
    app.parse(argc, argv);
    if (train->parsed()) code = cmd_train(train_args, output_dir, MPI_COMM_WORLD);
    else if (validate->parsed()) code = cmd_validate(validate_args, world_size, MPI_COMM_WORLD);
    else if (topology->parsed()) code = cmd_topology(pp, dp, tp, as_json, rank);
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
