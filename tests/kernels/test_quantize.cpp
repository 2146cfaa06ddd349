// test_quantize.cpp — qwZ's int8 quantiser (kernels/quantize.hpp) against the NumPy reference of
// tests/golden/make_quantize_goldens.py (quantize.h5, DeepSpeed's CUDAQuantizer group count and
// symmetric 8-bit kernel): the group count, the stored scales, the int8 values (ties to even,
// clamped to [−128, 127]) and the dequantised values bit for bit, within DeepSpeed's error bound.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "io/h5.hpp"
#include "kernels/quantize.hpp"

using namespace zero3d;

namespace {

const std::string kGolden = std::string(ZERO3D_GOLDEN_DIR) + "/quantize.h5";

TEST(QuantizeInt8, MatchesDeepSpeedsQuantiserInTheNumPyReferenceBitForBit) {
  for (const char* group : {"n800", "n16", "n16800", "n3", "n2049", "n8072"}) {
    std::vector<float> x, want_scales, want_hat;
    std::vector<int32_t> want_q;
    {
      const h5::File f = h5::File::open_read(kGolden);
      x = f.read_floats(std::string(group) + "/x");
      want_scales = f.read_floats(std::string(group) + "/scales");
      want_q = f.read_ints(std::string(group) + "/q");
      want_hat = f.read_floats(std::string(group) + "/x_hat");
    }
    const auto n = static_cast<int64_t>(x.size());
    ASSERT_EQ(kernels::quant_groups(n), static_cast<int64_t>(want_scales.size())) << group;
    ASSERT_EQ(kernels::quant_padded(n), static_cast<int64_t>(want_q.size())) << group;
    EXPECT_EQ(kernels::quantized_bytes(n), kernels::quant_padded(n) + 4 * kernels::quant_groups(n));
    std::vector<int8_t> q(want_q.size(), 99);  // the padding must be written as 0 too
    std::vector<float> scales(want_scales.size()), hat(x.size());
    kernels::quantize_int8(x.data(), n, q.data(), scales.data());
    kernels::dequantize_int8(q.data(), scales.data(), n, hat.data());
    EXPECT_EQ(scales, want_scales) << group;
    int64_t mismatched = 0;
    for (size_t i = 0; i < q.size(); ++i) mismatched += q[i] != want_q[i];
    for (size_t i = 0; i < hat.size(); ++i) mismatched += hat[i] != want_hat[i];
    EXPECT_EQ(mismatched, 0) << group;
    // DeepSpeed's bound: half a step (scale/2) for every value but the group's +max, clamped by one
    // step; up to fp32 rounding (a few ulps of the value)
    const int64_t per_group = kernels::quant_padded(n) / kernels::quant_groups(n);
    for (int64_t i = 0; i < n; ++i)
      ASSERT_LE(std::fabs(x[i] - hat[i]), scales[i / per_group] * (q[i] == 127 ? 1.0f : 0.5f) + 1e-6f * std::fabs(x[i]))
          << group << " element " << i;
  }
}

TEST(QuantizeInt8, GroupCountFollowsDeepSpeedsAdaptiveGrouping) {
  EXPECT_EQ(kernels::quant_groups(0), 0);
  EXPECT_EQ(kernels::quant_groups(3), 1);        // padded to 8
  EXPECT_EQ(kernels::quant_groups(8000), 1);     // the target group
  EXPECT_EQ(kernels::quant_groups(8008), 7);     // 2..6 leave remainders of 8·groups; 7·1144
  EXPECT_EQ(kernels::quant_groups(12704), 2);    // a tiny-model block: 2 groups of 6352
  EXPECT_EQ(kernels::quantized_bytes(5), 8 + 4);  // 5 values padded to 8, one scale
}

// The device form of the group maxima (a team per group) against the CPU form's result, on
// Kokkos Serial: the scales it leads to are the golden's.
TEST(QuantizeInt8, DeviceFormOfTheGroupMaximaAgrees) {
  std::vector<float> x(16800);
  for (size_t i = 0; i < x.size(); ++i) x[i] = std::sin(0.37f * static_cast<float>(i)) * (1.0f + float(i % 97));
  x[9000] = -500.0f;  // the second group's maximum is a negative value
  const int64_t n = static_cast<int64_t>(x.size()), groups = kernels::quant_groups(n);
  const int64_t per_group = kernels::quant_padded(n) / groups;
  std::vector<float> m(static_cast<size_t>(groups));
  kernels::gpu::group_absmax(x.data(), n, groups, per_group, m.data());
  for (int64_t g = 0; g < groups; ++g) {
    float want = 0.0f;
    for (int64_t i = g * per_group; i < std::min(n, (g + 1) * per_group); ++i) want = std::max(want, std::fabs(x[i]));
    EXPECT_EQ(m[static_cast<size_t>(g)], want) << "group " << g;
  }
  EXPECT_EQ(m[1], 500.0f);
}

}  // namespace
