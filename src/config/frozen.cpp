// config/frozen.cpp — model.frozen_parameters: parameters with requires_grad=False.
//
// A fine-tuning user freezes parameters in PyTorch (`p.requires_grad_(False)`) before
// deepspeed.initialize, which then builds its optimizer groups from the trainable parameters
// only (runtime/engine.py _configure_optimizer; stage_1_and_2.py / stage3.py partition the
// groups' parameters alone). zero3d has no Python model to mark, so the `model` section names
// them: a list of regular expressions over the Hugging Face parameter names, each matched with
// std::regex_search (Python's re.search: anywhere in the name), as the names are given to
// AutoTP's layer_specs patterns (config/autotp.cpp) and listed by model_layout.cpp.
#include <algorithm>
#include <regex>

#include "config/model_shape.hpp"
#include "config/section.hpp"

namespace zero3d {

std::vector<bool> frozen_parameters_among(const std::vector<std::string>& names, const std::vector<std::string>& patterns) {
  std::vector<bool> frozen(names.size(), false);
  for (const std::string& p : patterns) {
    const std::regex re(p, std::regex::ECMAScript);
    for (size_t i = 0; i < names.size(); ++i)
      if (!frozen[i] && std::regex_search(names[i], re)) frozen[i] = true;
  }
  return frozen;
}

namespace config_detail {

void read_frozen_parameters(Section& sec, ModelConfig& m) {
  const json* given = sec.raw("frozen_parameters");
  if (!given) {
    sec.mark_known("frozen_parameters");
    return;
  }
  sec.record("frozen_parameters", *given);
  if (!given->is_array() || given->empty()) {
    sec.report_key("frozen_parameters", "expected a non-empty list of regular expressions over Hugging Face parameter "
                                        "names, got " + show(*given));
    return;
  }
  const ParamLayout layout = gpt_layout(gpt_shape_of(m));
  std::vector<bool> frozen(layout.tensors().size(), false);
  bool ok = true;
  for (const json& p : *given) {
    if (!p.is_string()) {
      sec.report_key("frozen_parameters", "expected strings, got " + show(p));
      ok = false;
      continue;
    }
    std::regex re;
    try {
      re = std::regex(p.get<std::string>(), std::regex::ECMAScript);
    } catch (const std::regex_error& e) {
      sec.report_key("frozen_parameters", show(p) + " is not a regular expression zero3d can read (" + e.what() + ")");
      ok = false;
      continue;
    }
    bool any = false;
    for (size_t i = 0; i < frozen.size(); ++i)
      if (std::regex_search(layout.tensors()[i].name, re)) frozen[i] = any = true;
    if (!any) {
      // a typo would otherwise train what the user meant to freeze
      sec.report_key("frozen_parameters", show(p) + " matches no parameter of the model (names as Hugging Face's, e.g. " +
                                              layout.tensors().front().name + ", " + layout.tensors()[1].name + ")");
      ok = false;
      continue;
    }
    m.frozen_parameters.push_back(p.get<std::string>());
  }
  if (ok && std::find(frozen.begin(), frozen.end(), false) == frozen.end())
    sec.report_key("frozen_parameters", "freezes every parameter of the model: nothing would train (DeepSpeed's "
                                        "optimizer would get no parameters)");
  if (!ok) m.frozen_parameters.clear();
}

// zero_quantized_nontrainable_weights (zero/quantized_frozen.hpp): the int8 store lives in
// ZeroOptimizer's stage-3 partition and is gathered over the whole data group; the layouts that
// move or keep that partition some other way are refused. (offload_param nvme and the optimizer
// offload are refused with frozen parameters already.)
void check_quantized_frozen(Section& top, const Config& c) {
  const std::string key = "zero_optimization.zero_quantized_nontrainable_weights";
  const ZeroConfig& z = c.zero;
  if (z.offload_param.device == OffloadDevice::Cpu)
    top.report(key, "cannot be combined with offload_param cpu: zero3d's parameter offload keeps the partition in the "
                    "model dtype (DeepSpeed pins the quantised ds_tensor in host memory; that tier is not built)");
  if (z.mics_shard_size > 0)
    top.report(key, "cannot be combined with mics_shard_size: DeepSpeed's MiCS gathers (zero/mics.py) move "
                    "ds_tensor without its ds_quant_scale, and zero3d's hierarchical gather moves the model dtype");
  if (z.hpz_partition_size > 1)
    top.report(key, "cannot be combined with zero_hpz_partition_size " + std::to_string(z.hpz_partition_size) +
                        ": zero3d keeps hpZ's secondary partition in the model dtype (DeepSpeed quantises its "
                        "ds_secondary_tensor too; that copy is not built)");
  if (c.precision.autocast.enabled())
    top.report(key, "cannot be combined with torch_autocast: its stage-3 gathers pack tensors by autocast dtype, "
                    "which the int8 frozen pieces are not packed with");
}

void check_frozen_parameters(Section& top, const Config& c) {
  if (c.model.frozen_parameters.empty()) return;
  const std::string key = "model.frozen_parameters";
  // Each refusal names the part of zero3d that works over the whole flat buffer of a stage.
  if (c.pipeline.stages > 1)
    top.report(key, "cannot be combined with pipeline.stages " + std::to_string(c.pipeline.stages) +
                        ": zero3d's pipeline stages cut the layout by layers and share the tied embedding's gradient "
                        "between the first and last stage, which the frozen ranges are not mapped through");
  if (c.tensor.size > 1)
    top.report(key, "cannot be combined with tensor_parallel.autotp_size " + std::to_string(c.tensor.size) +
                        ": the tensor-parallel shards rename and split the layout's tensors, which the frozen "
                        "ranges are not mapped through");
  if (c.model.moe.enabled())
    top.report(key, "cannot be combined with MoE: the experts have their own ZeRO optimizer over the expert layout, "
                    "which the frozen ranges are not mapped through");
  if (c.zero.offload_optimizer.device != OffloadDevice::None && c.zero.stage >= 1)
    top.report(key, "cannot be combined with zero_optimization.offload_optimizer: the offloaded optimizer's "
                    "sub-groups cover the whole partition and would keep state for frozen elements");
  if (c.optimizer.one_bit() || c.optimizer.type == OptimizerType::Lamb)
    top.report(key, "cannot be combined with optimizer " + c.optimizer.type_name +
                        ": its step works on whole tensors or the whole flat buffer (trust ratios, compressed "
                        "all-reduce), not on the trainable ranges alone");
  if (c.zero.offload_param.device == OffloadDevice::Nvme)
    top.report(key, "cannot be combined with offload_param nvme: the step reads the whole swapped partition");
  if (c.zero.quantized_nontrainable_weights && c.zero.stage == 3) check_quantized_frozen(top, c);
}

}  // namespace config_detail
}  // namespace zero3d
