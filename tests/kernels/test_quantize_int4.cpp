// test_quantize_int4.cpp — qgZ's int4 quantiser (kernels/quantize_int4.hpp) against the NumPy
// reference of tests/golden/make_quantize_int4_goldens.py (quantize_int4.h5, DeepSpeed's
// symmetric 4-bit kernel and PackedInt4 layout): the packed bytes, the stored scales and the
// dequantised values bit for bit, within DeepSpeed's error bound, for blocks that start inside a
// group (phase) and end in a partial one.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "io/h5.hpp"
#include "kernels/quantize_int4.hpp"

using namespace zero3d;

namespace {

const std::string kGolden = std::string(ZERO3D_GOLDEN_DIR) + "/quantize_int4.h5";

TEST(QuantizeInt4, MatchesDeepSpeedsQuantiserInTheNumPyReferenceBitForBit) {
  const h5::File f = h5::File::open_read(kGolden);
  for (int c = 0; c < 5; ++c) {
    const std::string g = "kernel_" + std::to_string(c);
    const std::vector<float> x = f.read_floats(g + "/x"), want_scales = f.read_floats(g + "/scales"),
                             want_hat = f.read_floats(g + "/x_hat");
    const std::vector<int32_t> want_packed = f.read_ints(g + "/packed");
    const int64_t n = static_cast<int64_t>(x.size()), phase = f.read_ints(g + "/phase")[0],
                  group = f.read_ints(g + "/group")[0];
    ASSERT_EQ(kernels::int4_groups(n, phase, group), static_cast<int64_t>(want_scales.size())) << g;
    ASSERT_EQ(kernels::int4_packed_bytes(n), static_cast<int64_t>(want_packed.size())) << g;
    std::vector<uint8_t> packed(want_packed.size(), 0xAB);  // an odd block's spare nibble must be written as 0
    std::vector<float> scales(want_scales.size()), hat(x.size(), 123.0f);
    kernels::quantize_int4(x.data(), n, phase, group, packed.data(), scales.data());
    kernels::dequantize_int4(packed.data(), scales.data(), n, phase, group, hat.data());
    EXPECT_EQ(scales, want_scales) << g;
    int64_t mismatched = 0;
    for (size_t j = 0; j < packed.size(); ++j) mismatched += packed[j] != static_cast<uint8_t>(want_packed[j]);
    for (size_t i = 0; i < hat.size(); ++i) mismatched += hat[i] != want_hat[i];
    EXPECT_EQ(mismatched, 0) << g;
    // DeepSpeed's bound: half a step (scale/2) for every value but a group's +max, which clamps
    // from 8 to 7 (one step); up to fp32 rounding
    for (int64_t i = 0; i < n; ++i) {
      const float step = scales[static_cast<size_t>((phase + i) / group)];
      ASSERT_LE(std::fabs(x[i] - hat[i]), step + 1e-6f * std::fabs(x[i])) << g << " element " << i;
      if (hat[i] != 7.0f * step) {
        ASSERT_LE(std::fabs(x[i] - hat[i]), 0.5f * step * (1 + 1e-6f)) << g << " element " << i;
      }
    }
  }
}

TEST(QuantizeInt4, TiesRoundToEvenAndTheMaximumClampsToSeven) {
  // max 8: scale 2^4 / 16 = 1, so the values are their own quantised values before rounding
  const std::vector<float> x = {8.0f, -7.5f, 2.5f, 3.5f, -0.5f, 0.5f, 1.5f, -2.5f};
  std::vector<uint8_t> packed(4);
  float scale = 0.0f;
  kernels::quantize_int4(x.data(), 8, 0, 8, packed.data(), &scale);
  EXPECT_EQ(scale, 1.0f);
  // (7, −8) (2, 4) (0, 0) (2, −2): the even value in the high nibble
  EXPECT_EQ(packed, (std::vector<uint8_t>{0x78, 0x24, 0x00, 0x2E}));
}

TEST(QuantizeInt4, GroupsOfABlockCountItsPartialGroups) {
  EXPECT_EQ(kernels::int4_groups(0, 3, 8), 0);
  EXPECT_EQ(kernels::int4_groups(8, 0, 8), 1);
  EXPECT_EQ(kernels::int4_groups(8, 3, 8), 2);    // 5 values finish a group, 3 start the next
  EXPECT_EQ(kernels::int4_groups(37, 5, 16), 3);  // 11 + 16 + 10
  EXPECT_EQ(kernels::int4_block_bytes(37, 5, 16), 19 + 3 * 4);
}

// Each value comes back as its nibble times its group's stored scale.
TEST(QuantizeInt4, DequantiseMultipliesEachNibbleByItsGroupsScale) {
  const std::vector<float> x = {1.0f, -2.0f, 4.0f, 0.25f};  // groups of 2 from phase 1: {1}, {-2, 4}, {0.25}
  std::vector<uint8_t> packed(2);
  std::vector<float> scales(3), hat(4, 99.0f);
  kernels::quantize_int4(x.data(), 4, 1, 2, packed.data(), scales.data());
  EXPECT_EQ(scales, (std::vector<float>{1.0f / 8.0f, 0.5f, 0.25f / 8.0f}));  // max/8: 8/max is the scale
  kernels::dequantize_int4(packed.data(), scales.data(), 4, 1, 2, hat.data());
  // 1 and 0.25 are their group's +max: 8 steps clamp to 7; −2·2 = −4 steps; 4 clamps to 7 of 0.5
  EXPECT_EQ(hat, (std::vector<float>{7.0f / 8.0f, -2.0f, 3.5f, 7.0f * (0.25f / 8.0f)}));
}

// The device form of the group maxima (a team per group) on blocks that start inside a group,
// against the CPU form, on Kokkos Serial.
TEST(QuantizeInt4, DeviceFormOfThePhasedGroupMaximaAgrees) {
  std::vector<float> x(101);
  for (size_t i = 0; i < x.size(); ++i) x[i] = std::sin(0.71f * static_cast<float>(i)) * (1.0f + float(i % 13));
  for (const int64_t phase : {0, 5, 31}) {
    const int64_t n = static_cast<int64_t>(x.size()), groups = kernels::int4_groups(n, phase, 32);
    std::vector<float> team(static_cast<size_t>(groups)), loop(static_cast<size_t>(groups));
    kernels::gpu::group_absmax(x.data(), n, groups, 32, team.data(), phase);
    kernels::group_absmax(x.data(), n, groups, 32, loop.data(), phase);
    EXPECT_EQ(team, loop) << "phase " << phase;
    float first = 0.0f;  // the first group holds 32 − phase values
    for (int64_t i = 0; i < 32 - phase; ++i) first = std::max(first, std::fabs(x[static_cast<size_t>(i)]));
    EXPECT_EQ(team[0], first) << "phase " << phase;
  }
}

}  // namespace
