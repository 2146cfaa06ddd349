// pipe_plan.cpp — see pipe_plan.hpp.
#include "parallel/pipe_plan.hpp"

#include <regex>
#include <stdexcept>

#include "base/input_file.hpp"
#include "parallel/pipe_schedule.hpp"

namespace zero3d {

std::vector<PipeLayer> gpt_pipe_layers(int64_t V, int64_t T, int64_t L, int64_t C) {
  std::vector<PipeLayer> layers;
  layers.push_back({"embedding", -1, V * C + T * C});
  // per block: 2 LayerNorms (4C), qkv (3C² + 3C), attention proj (C² + C), fc (4C² + 4C), proj (4C² + C)
  for (int64_t l = 0; l < L; ++l) layers.push_back({"block", static_cast<int>(l), 12 * C * C + 13 * C});
  layers.push_back({"final", -1, 2 * C + V * C});
  return layers;
}

std::vector<PipeLayer> decoder_pipe_layers(int64_t embedding, int64_t block, int64_t L, int64_t final) {
  std::vector<PipeLayer> layers;
  layers.push_back({"embedding", -1, embedding});
  for (int64_t l = 0; l < L; ++l) layers.push_back({"block", static_cast<int>(l), block});
  layers.push_back({"final", -1, final});
  return layers;
}

std::vector<int> partition_pipe_layers(const std::vector<PipeLayer>& layers, const PipelineConfig& pc) {
  const int parts = pc.stages * pc.virtual_stages;
  const int n = static_cast<int>(layers.size());
  const std::string who = pc.virtual_stages > 1
                              ? "pipeline.stages (" + std::to_string(pc.stages) + ") x pipeline.virtual_stages (" +
                                    std::to_string(pc.virtual_stages) + ") = " + std::to_string(parts) + " parts"
                              : "pipeline.stages (" + std::to_string(pc.stages) + ")";
  if (parts > n)
    throw std::invalid_argument(who + " exceeds the model's " + std::to_string(n) + " pipeline layers (embedding, " +
                                std::to_string(n - 2) + " blocks, final): a stage would be empty");
  std::vector<int> bounds;
  if (pc.partition == PartitionMethod::Uniform) {
    bounds = pipe::partition_uniform(n, parts);
  } else {
    std::vector<double> w;
    if (pc.partition == PartitionMethod::Parameters) {
      for (const PipeLayer& l : layers) w.push_back(static_cast<double>(l.params));
    } else {
      std::regex re;
      try {
        re = std::regex(pc.type_regex, std::regex::icase | std::regex::ECMAScript);
      } catch (const std::regex_error& e) {
        throw std::invalid_argument("pipeline.partition \"type:" + echo(pc.type_regex) +
                                    "\": invalid regular expression (" + e.what() + ")");
      }
      int matched = 0;
      for (const PipeLayer& l : layers) {
        const bool m = std::regex_search(l.kind, re);  // DeepSpeed: re.search over the layer's class name
        matched += m;
        w.push_back(m ? 1.0 : 0.0);
      }
      if (matched == 0)
        throw std::invalid_argument("pipeline.partition \"type:" + echo(pc.type_regex) +
                                    "\" matches no layer kind (embedding, block, final)");
    }
    bounds = pipe::partition_balanced(w, parts);
  }
  for (int k = 0; k < parts; ++k)
    if (bounds[k + 1] <= bounds[k])
      throw std::invalid_argument("pipeline.partition \"" + echo(pc.partition_name) + "\" leaves part " + std::to_string(k) +
                                  " of " + std::to_string(parts) + " empty over " + std::to_string(n) + " layers");
  return bounds;
}

}  // namespace zero3d
