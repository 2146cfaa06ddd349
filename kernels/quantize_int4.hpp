// quantize_int4.hpp — ZeRO++'s qgZ quantiser (Wang et al. 2023 §4.2): symmetric int4 quantisation
// of gradient blocks in groups, one fp32 scale a group, two values a byte, as DeepSpeed's
// quantizer ops do for all_to_all_quant_reduce (runtime/comm/coalesced_collectives.py; kernels
// csrc/quantization/swizzled_quantize.cu, quant_reduce.cu, csrc/includes/quantization_utils.h).
//
// Facts relied on (DeepSpeed csrc/includes/quantization_utils.h, Params<Symmetric, 4>,
// GroupStats<Symmetric>; conversion_utils.h; quantization.h PackedInt4):
//  * per group m = max|x|; scale s = 2^4 / (2m) (1 when m = 0); q = clamp(__float2int_rn(x·s),
//    −8, 7): round half to even (std::nearbyint in the default rounding mode); the stored scale
//    is 1/s and a value comes back as q·(1/s). Error: at most (1/s)/2 = m/16 for every value
//    except +m itself, which clamps from 8 to 7 (error m/8).
//  * packing: values 2j and 2j+1 share byte j, PackedInt4{high: q[2j+1], low: q[2j]} with the
//    first bit-field in the low bits, i.e. byte = (q[2j] << 4) | (q[2j+1] & 0xF); both nibbles
//    read back sign-extended. An odd block's last byte has a zero low nibble here (DeepSpeed's
//    blocks are always even: it asserts numel % (2·world) == 0).
//  * the reduction (quant_reduce.cu dequant_reduce): the k received copies are dequantised and
//    added in copy order from zero (0 + the first is the first), then requantised with groups of
//    the same size.
// DeepSpeed's kernels read and add __half values; zero3d quantises its fp32 gradient windows and
// adds in fp32 (every other formula is the same).
//
// Groups: a block of n values is cut at multiples of `group` counted from `phase` before its first
// value (qgZ cuts a tensor's groups where partitions end; parallel/quantized_reduce_scatter.hpp),
// so value i lies in group (phase + i) / group, and the block has int4_groups(n, phase, group).
// Reference: tests/golden/make_quantize_int4_goldens.py.
#pragma once

#include <cmath>
#include <cstdint>

#include "kernels/common.hpp"
#include "kernels/quantize.hpp"

namespace zero3d::kernels {

inline Index int4_groups(Index n, Index phase, Index group) { return phased_groups(n, phase, group); }
inline Index int4_packed_bytes(Index n) { return (n + 1) / 2; }
// The bytes a block moves: its packed values and one fp32 scale a group.
inline int64_t int4_block_bytes(Index n, Index phase, Index group) {
  return int4_packed_bytes(n) + 4 * int4_groups(n, phase, group);
}

// x (n fp32, x[0] at `phase` of its group) -> packed (int4_packed_bytes(n)) and scales
// (int4_groups(n, phase, group) fp32, the stored 1/s).
ZERO3D_KERNEL void quantize_int4(const float* x, Index n, Index phase, Index group, uint8_t* packed, float* scales) {
  const Index groups = int4_groups(n, phase, group);
  if (groups == 0) return;
  group_absmax(x, n, groups, group, scales, phase);
  // The group maxima become the stored scales 1/s once every value of their group is packed.
  Kokkos::parallel_for(
      "quantize_int4", range(int4_packed_bytes(n)), KOKKOS_LAMBDA(Index j) {
        int nibble[2] = {0, 0};
        for (int h = 0; h < 2; ++h) {
          const Index i = 2 * j + h;
          if (i >= n) break;
          const float m = scales[(phase + i) / group], s = m == 0.0f ? 1.0f : 16.0f / (2.0f * m);
          float v = std::nearbyint(x[i] * s);
          v = v > 7.0f ? 7.0f : v < -8.0f ? -8.0f : v;
          nibble[h] = static_cast<int>(v);
        }
        packed[j] = static_cast<uint8_t>(((nibble[0] & 0xF) << 4) | (nibble[1] & 0xF));
      });
  Kokkos::parallel_for(
      "quant_int4_scales", range(groups), KOKKOS_LAMBDA(Index g) {
        const float m = scales[g];
        scales[g] = m == 0.0f ? 1.0f : 1.0f / (16.0f / (2.0f * m));
      });
}

// x[i] = q[i]·scale of its group: a block (as quantize_int4 wrote it) dequantised. A reduction
// adds the copies with elementwise.hpp's add_into: the product is rounded to fp32 before the sum,
// as DeepSpeed's dequantise-then-add (never one fused multiply-add).
ZERO3D_KERNEL void dequantize_int4(const uint8_t* packed, const float* scales, Index n, Index phase, Index group,
                                   float* x) {
  Kokkos::parallel_for(
      "dequantize_int4", range(n), KOKKOS_LAMBDA(Index i) {
        const auto byte = static_cast<int8_t>(packed[i / 2]);
        // the high nibble holds the even value; shifting left then right sign-extends either one
        const int q = (i % 2 == 0) ? (byte >> 4) : (static_cast<int8_t>(static_cast<uint8_t>(byte) << 4) >> 4);
        x[i] = static_cast<float>(q) * scales[(phase + i) / group];
      });
}

}  // namespace zero3d::kernels
