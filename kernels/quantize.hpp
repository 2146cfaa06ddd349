// quantize.hpp — ZeRO++'s qwZ quantiser (Wang et al. 2023 §4.1): symmetric int8 quantisation of a
// buffer in groups, one fp32 scale a group, as DeepSpeed's CUDAQuantizer does for the stage-3
// parameter all-gather (runtime/zero/partition_parameters.py CUDAQuantizer; the kernels in
// csrc/includes/quantization_utils.h, Params<Symmetric, 8>).
//
// A buffer of n values is padded with zeros to n8 = a multiple of 8 (DeepSpeed asserts that n is
// one; zeros leave every group's maximum as it is) and cut into quant_groups(n) equal groups.
// Group g with m = max|x|: s = 2^8 / (2m) (1 when m = 0), q = clamp(rint(x·s), −128, 127) with ties
// to even (__float2int_rn; std::nearbyint in the default rounding mode), and the scale stored and
// sent is 1/s; a value comes back as q·(1/s). Error: at most (1/s)/2 = m/256 for every value
// except +m itself, which clamps from 128 to 127 (error m/128).
// Reference: tests/golden/make_quantize_goldens.py.
#pragma once

#include <cmath>
#include <cstdint>

#include "kernels/common.hpp"

namespace zero3d::kernels {

constexpr Index kQuantTargetGroup = 8000;  // CUDAQuantizer.target_group_size
inline Index quant_padded(Index n) { return (n + 7) / 8 * 8; }

// CUDAQuantizer.quantize's group count for n8 elements: ceil(n8 / 8000), raised until the groups
// split n8 into whole multiples of 8. (Its second loop, doubling the groups while a group holds
// over 8000 elements, never applies after the first: the groups already hold at most 8000.)
inline Index quant_groups(Index n) {
  const Index n8 = quant_padded(n);
  if (n8 == 0) return 0;
  Index groups = (n8 + kQuantTargetGroup - 1) / kQuantTargetGroup;
  while (n8 % (8 * groups) != 0) ++groups;
  return groups;
}

// The bytes of n quantised values: n8 int8 values, then one fp32 scale a group.
inline int64_t quantized_bytes(Index n) { return quant_padded(n) + 4 * quant_groups(n); }

namespace gpu {

// A team per group and Kokkos' max reduction over its elements. phase: x[0] sits at that position
// of its group (qgZ's blocks, kernels/quantize_int4.hpp), so group g is [g·group − phase, +group).
ZERO3D_KERNEL void group_absmax(const float* x, Index n, Index groups, Index group, float* m, Index phase = 0) {
  Kokkos::parallel_for(
      "quant_group_absmax", Kokkos::TeamPolicy<ExecSpace>(static_cast<int>(groups), Kokkos::AUTO),
      KOKKOS_LAMBDA(const Kokkos::TeamPolicy<ExecSpace>::member_type& team) {
        const Index start = team.league_rank() * group - phase, lo = start > 0 ? start : Index(0);
        const Index hi = start + group < n ? start + group : n;
        float best = 0.0f;
        Kokkos::parallel_reduce(
            Kokkos::TeamThreadRange(team, lo < hi ? hi - lo : Index(0)),
            [&](Index i, float& acc) {
              const float a = std::fabs(x[lo + i]);
              acc = a > acc ? a : acc;
            },
            Kokkos::Max<float>(best));
        Kokkos::single(Kokkos::PerTeam(team), [&]() { m[team.league_rank()] = best; });
      });
}

}  // namespace gpu

// m[g] = max |x| over group g (groups of `group` values; x[0] at position `phase` of the first).
ZERO3D_KERNEL void group_absmax(const float* x, Index n, Index groups, Index group, float* m, Index phase = 0) {
#ifdef ZERO3D_DEVICE
  gpu::group_absmax(x, n, groups, group, m, phase);
#else
  Kokkos::parallel_for(
      "quant_group_absmax", range(groups), KOKKOS_LAMBDA(Index g) {
        const Index start = g * group - phase, hi = start + group < n ? start + group : n;
        float best = 0.0f;
        for (Index i = start > 0 ? start : 0; i < hi; ++i) best = std::fabs(x[i]) > best ? std::fabs(x[i]) : best;
        m[g] = best;
      });
#endif
}

// Groups of `group` values with x[0] at position `phase` of the first (qgZ's blocks,
// kernels/quantize_int4.hpp): how many a run of n values touches.
inline Index phased_groups(Index n, Index phase, Index group) { return n == 0 ? 0 : (phase + n + group - 1) / group; }

// The int8 code of x in a group of maximum m: clamp(rint(x·s), −128, 127), s = 2^8 / (2m).
KOKKOS_INLINE_FUNCTION int8_t int8_code(float x, float m) {
  const float s = m == 0.0f ? 1.0f : 256.0f / (2.0f * m);
  float v = std::nearbyint(x * s);
  v = v > 127.0f ? 127.0f : v < -128.0f ? -128.0f : v;
  return static_cast<int8_t>(v);
}

// x (n fp32, x[0] at `phase` of its group) -> q (n int8) and scales (phased_groups(n, phase,
// group) fp32, 1/s): the same quantiser over groups cut as qgZ cuts its blocks (LoCo keeps its
// error buffers so: kernels/loco.hpp).
ZERO3D_KERNEL void quantize_int8_groups(const float* x, Index n, Index phase, Index group, int8_t* q, float* scales) {
  const Index groups = phased_groups(n, phase, group);
  if (groups == 0) return;
  group_absmax(x, n, groups, group, scales, phase);
  // The group maxima become the stored scales 1/s once every value of their group is quantised.
  Kokkos::parallel_for(
      "quantize_int8", range(n), KOKKOS_LAMBDA(Index i) { q[i] = int8_code(x[i], scales[(phase + i) / group]); });
  Kokkos::parallel_for(
      "quant_scales", range(groups), KOKKOS_LAMBDA(Index g) {
        const float m = scales[g];
        scales[g] = m == 0.0f ? 1.0f : 1.0f / (256.0f / (2.0f * m));
      });
}

// x[i] = q[i]·scale of its group (as quantize_int8_groups wrote them).
ZERO3D_KERNEL void dequantize_int8_groups(const int8_t* q, const float* scales, Index n, Index phase, Index group,
                                          float* x) {
  Kokkos::parallel_for(
      "dequantize_int8", range(n),
      KOKKOS_LAMBDA(Index i) { x[i] = static_cast<float>(q[i]) * scales[(phase + i) / group]; });
}

// x (n fp32) -> q (quant_padded(n) int8, the padding 0) and scales (quant_groups(n) fp32, 1/s).
ZERO3D_KERNEL void quantize_int8(const float* x, Index n, int8_t* q, float* scales) {
  const Index groups = quant_groups(n);
  if (groups == 0) return;
  // group >= 8 and n > n8 - 8: n's values touch exactly `groups` groups
  quantize_int8_groups(x, n, 0, quant_padded(n) / groups, q, scales);
  Kokkos::parallel_for(
      "quantize_int8_pad", range(quant_padded(n) - n), KOKKOS_LAMBDA(Index i) { q[n + i] = 0; });
}

// q (n of them) and scales (1/s a group, as quantize_int8 wrote them) -> x (n fp32).
ZERO3D_KERNEL void dequantize_int8(const int8_t* q, const float* scales, Index n, float* x) {
  const Index groups = quant_groups(n);
  if (groups == 0) return;
  dequantize_int8_groups(q, scales, n, 0, quant_padded(n) / groups, x);
}

}  // namespace zero3d::kernels
