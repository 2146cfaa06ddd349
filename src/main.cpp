// main.cpp — CLI11 subcommands; the one place that catches errors and sets the exit code.
//
// Exit codes: 0 success, 2 bad input (one message, from rank 0), 1 system/internal failure
// (message names the failing rank; the job is aborted so that no rank hangs).
#include <mpi.h>

#include <CLI/CLI.hpp>
#include <Kokkos_Core.hpp>
#include <cstdio>
#include <string>
#include <vector>

#include "base.hpp"
#include "config.hpp"
#include "engine.hpp"
#include "h5.hpp"

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

int cmd_validate(const ConfigArgs& a, int64_t world_size, int rank) {
  std::string name;
  Config cfg = read_config(load_with_overrides(a, name), name, world_size);
  if (rank == 0) {
    std::printf("%s: valid for data-parallel world size %lld\n", name.c_str(), (long long)world_size);
    std::printf("batch   %s\n", cfg.batch.derivation.c_str());
  }
  return kExitOk;
}

int cmd_train(const ConfigArgs& a, const std::string& output_override, MPI_Comm comm) {
  int world = 1;
  MPI_Comm_size(comm, &world);
  std::string name;
  Config cfg = read_config(load_with_overrides(a, name), name, world);
  std::string out = !output_override.empty() ? output_override
                    : !cfg.training.output_dir.empty() ? cfg.training.output_dir
                                                       : "output/" + run_name(a.path);
  cfg.resolved["training"]["output_dir"] = out;
  Engine engine(cfg, comm, out);
  engine.train();
  return kExitOk;
}

}  // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
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

  int code = kExitOk;
  try {
    app.parse(argc, argv);
    if (train->parsed()) code = cmd_train(train_args, output_dir, MPI_COMM_WORLD);
    else if (validate->parsed()) code = cmd_validate(validate_args, world_size, rank);
  } catch (const CLI::ParseError& e) {
    // --help and --version are "errors" with exit code 0 in CLI11.
    if (rank == 0) app.exit(e);
    code = e.get_exit_code() == 0 ? kExitOk : kExitBadInput;
  } catch (const InputError& e) {
    // Every rank reads the same input, so every rank fails alike: rank 0 speaks for all.
    if (rank == 0) std::fprintf(stderr, "zero3d: error: %s\n", e.what());
    code = kExitBadInput;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "zero3d: rank %d: fatal: %s\n", rank, e.what());
    std::fflush(stderr);
    if (world > 1) MPI_Abort(MPI_COMM_WORLD, kExitSystem);
    code = kExitSystem;
  }
  std::fflush(stdout);
  Kokkos::finalize();
  MPI_Finalize();
  return code;
}
