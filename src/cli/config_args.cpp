// config_args.cpp — what the subcommands share: a config with its --set overrides, the ranks of
// this node, byte-size options.
#include <string>
#include <vector>

#include "base/errors.hpp"
#include "base/input_file.hpp"
#include "cli/commands.hpp"
#include "config/config.hpp"
#include "io/checkpoint.hpp"

namespace zero3d::cli {

std::vector<std::string> set_keys(const ConfigArgs& a) {
  std::vector<std::string> keys;
  for (const std::string& o : a.overrides) keys.push_back(o.substr(0, o.find('=')));
  return keys;
}

nlohmann::json load_with_overrides(const ConfigArgs& a, std::string& name) {
  nlohmann::json root = a.path.empty() ? quickstart_json() : load_json_file(a.path);
  name = a.path.empty() ? "<built-in quickstart>" : echo(a.path, 200);  // names the file in every message
  for (const auto& o : a.overrides) apply_override(root, o);
  if (!a.strategy.empty() && root.is_object()) root["strategy"] = a.strategy;  // as the config key
  return root;
}

int ranks_on_this_node(MPI_Comm world) {
  int rank = 0, ranks_here = 1;
  MPI_Comm_rank(world, &rank);
  MPI_Comm node = MPI_COMM_NULL;
  if (MPI_Comm_split_type(world, MPI_COMM_TYPE_SHARED, rank, MPI_INFO_NULL, &node) == MPI_SUCCESS) {
    MPI_Comm_size(node, &ranks_here);
    MPI_Comm_free(&node);
  }
  return ranks_here;
}

int local_rank(MPI_Comm world) {
  int rank = 0, here = 0;
  MPI_Comm_rank(world, &rank);
  MPI_Comm node = MPI_COMM_NULL;
  if (MPI_Comm_split_type(world, MPI_COMM_TYPE_SHARED, rank, MPI_INFO_NULL, &node) == MPI_SUCCESS) {
    MPI_Comm_rank(node, &here);
    MPI_Comm_free(&node);
  }
  return here;
}

int64_t size_option(const std::string& option, const std::string& text) { return parse_byte_size(text, option); }

kernels::Backend device_option(const std::string& command, const std::string* device) {
  if (!device) return kernels::kBuildBackend;
  if (*device != "cpu" && *device != "gpu")
    throw InputError(command + " --device " + echo(*device) + ": expected cpu or gpu");
  if (*device == "cpu" && kernels::kGpuBuild)
    throw InputError(command + " --device cpu: this is a GPU build, and a CPU run's plan depends on the CPU build's "
                     "own attention kernels (AVX512-BF16's fused kernel where it was compiled for one); run it from "
                     "the CPU build");
  return *device == "gpu" ? kernels::Backend::Gpu : kernels::Backend::Cpu;
}

}  // namespace zero3d::cli
