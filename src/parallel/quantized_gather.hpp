// quantized_gather.hpp — ZeRO++'s qwZ all-gather (Wang et al. 2023 §4.1; DeepSpeed
// runtime/zero/partition_parameters.py all_gather_coalesced with quantize=True): every rank
// quantises its slice of a parameter unit to int8 in groups with one fp32 scale a group
// (kernels/quantize.hpp, DeepSpeed's CUDAQuantizer), the ranks gather each other's bytes, and
// each dequantises every slice, its own included, so all ranks compute with the same weights.
//
// DeepSpeed gathers the int8 values and the scales in two all_gathers; here each rank's bytes are
// its values (padded to 8) then its scales, in one all_gather_v of bytes: the same bytes, one
// collective. A rank's slice of n values moves quantized_bytes(n) = pad8(n) + 4·groups(n)
// bytes instead of 4n (fp32) or 2n (16-bit).
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "parallel/comm.hpp"

namespace zero3d {

// Where each rank's quantised slice lies in the gathered bytes.
struct QuantizedGatherPlan {
  std::vector<int64_t> counts;     // values in rank r's slice
  std::vector<int64_t> bytes, at;  // its quantised bytes and their offset (a multiple of 8)
  int64_t total = 0;               // the gathered bytes
  explicit QuantizedGatherPlan(std::vector<int64_t> slice_counts);
};

// Quantises this rank's slice (counts[rank] fp32 values) into its place in `packed` (plan.total
// bytes) and starts gathering every rank's bytes over `group`. Both buffers in model memory.
std::unique_ptr<CommRequest> start_quantized_all_gather(Communicator& group, const QuantizedGatherPlan& plan,
                                                        const float* own, char* packed);

// After the gather: rank r's slice dequantised into counts[r] fp32 values at out.
void dequantize_gathered_slice(const QuantizedGatherPlan& plan, const char* packed, int r, float* out);

}  // namespace zero3d
