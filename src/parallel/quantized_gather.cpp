// quantized_gather.cpp — qwZ's quantised all-gather (see quantized_gather.hpp) over the
// Communicator interface, so its bytes are counted and logged as every other collective's.
#include "parallel/quantized_gather.hpp"

#include <utility>

#include "kernels/quantize.hpp"

namespace zero3d {

QuantizedGatherPlan::QuantizedGatherPlan(std::vector<int64_t> slice_counts) : counts(std::move(slice_counts)) {
  for (const int64_t n : counts) {
    at.push_back(total);
    bytes.push_back(kernels::quantized_bytes(n));
    total += bytes.back();
  }
}

std::unique_ptr<CommRequest> start_quantized_all_gather(Communicator& group, const QuantizedGatherPlan& plan,
                                                        const float* own, char* packed) {
  const int r = group.rank();
  const int64_t n = plan.counts[static_cast<size_t>(r)];
  char* mine = packed + plan.at[static_cast<size_t>(r)];
  kernels::quantize_int8(own, n, reinterpret_cast<int8_t*>(mine),
                         reinterpret_cast<float*>(mine + kernels::quant_padded(n)));
  return group.all_gather_v_async(packed, plan.bytes, plan.at, DType::U8);
}

void dequantize_gathered_slice(const QuantizedGatherPlan& plan, const char* packed, int r, float* out) {
  const int64_t n = plan.counts[static_cast<size_t>(r)];
  const char* slice = packed + plan.at[static_cast<size_t>(r)];
  kernels::dequantize_int8(reinterpret_cast<const int8_t*>(slice),
                           reinterpret_cast<const float*>(slice + kernels::quant_padded(n)), n, out);
}

}  // namespace zero3d
