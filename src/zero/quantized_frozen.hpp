// quantized_frozen.hpp — ZeRO++'s zero_quantized_nontrainable_weights (DeepSpeed
// runtime/zero/partition_parameters.py: a requires_grad=False parameter's ds_tensor is quantised
// with Init.quantizer_module when it is partitioned, kept with its ds_quant_scale, all-gathered as
// int8 values and scales, and dequantised on arrival). At stage 3 each rank stores its partition
// of the frozen tensors (model.frozen_parameters) as int8 codes and fp32 scales only; the trainable
// elements stay in the model dtype, packed as the optimizer's states are.
//
// The quantiser is qwZ's (kernels/quantize.hpp, DeepSpeed's CUDAQuantizer: symmetric int8, one
// scale 1/s a group). Its groups: DeepSpeed cuts each parameter's partition (ds_tensor) into
// CUDAQuantizer's groups, so its values depend on the world size. zero3d cuts each frozen TENSOR
// whole as CUDAQuantizer cuts a buffer of its numel (quant_groups(numel) groups of
// quant_padded(numel)/groups values: DeepSpeed's grouping at world size 1), and a rank keeps the
// codes of its elements and the scales of every group they touch (a group split between two ranks
// has its scale on both, computed over the whole group). The weights a run computes with are then
// the same at every world size, and a checkpoint's are loadable at any. (DeepSpeed's
// _partition_param quantises the freshly allocated ds_tensor before its values are copy_'d into
// the int8 result; zero3d quantises the values themselves.)
#pragma once

#include <cstdint>
#include <vector>

#include "model/model.hpp"
#include "parallel/partition.hpp"

namespace zero3d {

struct StateTypes;

// One frozen tensor's elements [begin, begin + count) held by one rank, with the groups they touch.
struct FrozenPiece {
  int64_t begin = 0, count = 0;
  int64_t tensor_begin = 0, tensor_end = 0;  // the frozen tensor, global
  int64_t group = 0;                         // its group size (kernels/quantize.hpp over its numel)
  int64_t first_group = 0, groups = 0;       // the groups touched: their index in the tensor, how many
  int64_t phase() const { return begin - tensor_begin - first_group * group; }
  // The values whose maxima give the scales: the touched groups whole, within the tensor.
  int64_t span_begin() const { return tensor_begin + first_group * group; }
  int64_t span_end() const;
  // Stored and sent as the scales (fp32), then the codes (int8) padded to 8.
  int64_t bytes() const { return 4 * groups + (count + 7) / 8 * 8; }
};

// The frozen tensors' pieces inside global [lo, hi), in order.
std::vector<FrozenPiece> frozen_pieces(const ParamLayout& layout, const StateTypes& types, int64_t lo, int64_t hi);

// Bytes of rank r's stage-3 parameter partition with quantised frozen pieces: its trainable
// elements in the model dtype (param_size bytes each) and each frozen piece's bytes().
int64_t quantized_frozen_partition_bytes(const ParamLayout& layout, const StateTypes& types, const Partition& part,
                                         int r, int64_t param_size);

// One stage-3 gather of a unit: rank r's slice is its trainable values (model dtype, or qwZ's
// int8 groups with zero_quantized_weights) padded to 8 bytes, then each frozen piece's bytes();
// the slices are gathered as bytes in one all_gather_v (DeepSpeed gathers the quantised and the
// unquantised parameters in two collectives: the same bytes up to the padding).
struct FrozenGatherPlan {
  std::vector<int64_t> bytes, at;  // rank r's slice bytes and offset (multiples of 8)
  int64_t total = 0;
  std::vector<std::vector<std::pair<int64_t, int64_t>>> trainable;  // rank r's trainable ranges, global
  std::vector<int64_t> trainable_count;
  std::vector<std::vector<FrozenPiece>> frozen;
  int64_t widest = 0;  // the most elements of one rank's trainable run or one frozen piece (fp32 on arrival)
};
FrozenGatherPlan frozen_gather_plan(const ParamLayout& layout, const StateTypes& types, const Partition& part,
                                    const ParamUnit& unit, bool quantize_trainable);

}  // namespace zero3d
