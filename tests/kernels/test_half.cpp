// test_half.cpp — fp32 -> bf16/fp16 rounding against PyTorch's conversions
// (tests/golden/half_conversions.h5, written by tests/golden/make_goldens.py).
#include <gtest/gtest.h>
#include <hdf5.h>

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "io/h5.hpp"
#include "kernels/half.hpp"

using namespace zero3d;
using namespace zero3d::kernels;

namespace {

template <typename T>
std::vector<T> read_dataset(const h5::File& f, const char* name, hid_t type) {
  h5::Handle ds(H5Dopen2(f.id(), name, H5P_DEFAULT), H5Dclose);
  h5::Handle space(H5Dget_space(ds.get()), H5Sclose);
  std::vector<T> out(static_cast<size_t>(H5Sget_simple_extent_npoints(space.get())));
  H5Dread(ds.get(), type, H5S_ALL, H5S_ALL, H5P_DEFAULT, out.data());
  return out;
}

struct Conversions {
  std::vector<float> x;
  std::vector<uint16_t> bf16_bits, fp16_bits;
};

const Conversions& golden() {
  static const Conversions c = [] {
    h5::File f = h5::File::open_read(std::string(ZERO3D_GOLDEN_DIR) + "/half_conversions.h5");
    return Conversions{read_dataset<float>(f, "fp32", H5T_NATIVE_FLOAT),
                       read_dataset<uint16_t>(f, "bf16_bits", H5T_NATIVE_UINT16),
                       read_dataset<uint16_t>(f, "fp16_bits", H5T_NATIVE_UINT16)};
  }();
  return c;
}

}  // namespace

TEST(HalfConversion, Bf16RoundsToNearestEvenLikeTorch) {
  const Conversions& g = golden();
  ASSERT_GT(g.x.size(), 2000u);
  for (size_t i = 0; i < g.x.size(); ++i) {
    const bf16 b = to_bf16(g.x[i]);
    if (std::isnan(g.x[i])) {
      EXPECT_TRUE(std::isnan(to_float(b)));
      continue;
    }
    EXPECT_EQ(b.bits, g.bf16_bits[i]) << "x = " << g.x[i];
    EXPECT_EQ(to_float(b), to_float(bf16{g.bf16_bits[i]}));  // widening is exact
  }
}

TEST(HalfConversion, Fp16RoundsToNearestEvenWithSubnormalsAndOverflowToInfLikeTorch) {
  const Conversions& g = golden();
  for (size_t i = 0; i < g.x.size(); ++i) {
    const fp16 h = to_fp16(g.x[i]);
    if (std::isnan(g.x[i])) {
      EXPECT_TRUE(std::isnan(to_float(h)));
      continue;
    }
    EXPECT_EQ(h.bits, g.fp16_bits[i]) << "x = " << g.x[i];
  }
  EXPECT_TRUE(std::isinf(to_float(to_fp16(70000.0f)))) << "overflow must become inf for the loss scaler to see it";
}

TEST(HalfConversion, ConvertKernelAccumulatesInFp32AndRoundsOnce) {
  // 256 + 1 is not representable in bf16 (8 bits of mantissa): 256 + 1 -> 256 (tie to even),
  // but adding 1.5 rounds up to 258.
  std::vector<bf16> acc = {to_bf16(256.0f), to_bf16(256.0f)};
  const std::vector<float> add = {1.0f, 1.5f};
  convert(acc.data(), add.data(), 2, 1.0f, /*accumulate=*/true);
  EXPECT_EQ(to_float(acc[0]), 256.0f);
  EXPECT_EQ(to_float(acc[1]), 258.0f);
}

// The integer fp16 conversions (which vectorise) give the bits of the hardware's own conversion
// (F16C vcvtph2ps / vcvtps2ph, through the compiler's _Float16): every half widened, every
// non-NaN half round-tripped, and a spread of 2^22 float bit patterns (every 1021st, so all
// exponents, signs, the subnormal range and the rounding ties are met) rounded. NaN stays NaN.
TEST(HalfConversion, Fp16ConversionsGiveTheHardwareConversionsBits) {
  for (uint32_t bits = 0; bits < 65536; ++bits) {
    const uint16_t b = static_cast<uint16_t>(bits);
    _Float16 h;
    std::memcpy(&h, &b, 2);
    const float hw = static_cast<float>(h), ours = to_float(fp16{b});
    if (std::isnan(hw)) {
      EXPECT_TRUE(std::isnan(ours)) << std::hex << bits;
      continue;
    }
    uint32_t a, c;
    std::memcpy(&a, &hw, 4);
    std::memcpy(&c, &ours, 4);
    ASSERT_EQ(c, a) << "widening half 0x" << std::hex << bits;
    ASSERT_EQ(to_fp16(ours).bits, b) << "round trip of half 0x" << std::hex << bits;
  }
  for (uint64_t u = 0; u <= 0xFFFFFFFFull; u += 1021) {
    const uint32_t v = static_cast<uint32_t>(u);
    float x;
    std::memcpy(&x, &v, 4);
    const fp16 ours = to_fp16(x);
    if (std::isnan(x)) {
      EXPECT_TRUE(std::isnan(to_float(ours))) << std::hex << v;
      continue;
    }
    const _Float16 hw = static_cast<_Float16>(x);
    uint16_t hb;
    std::memcpy(&hb, &hw, 2);
    ASSERT_EQ(ours.bits, hb) << "rounding float 0x" << std::hex << v;
  }
}

// The convert kernel's fp16 paths (hardware conversions where built with AVX-512) give, element
// by element, the bits of the scalar to_float / to_fp16, also when accumulating; NaN stays NaN.
// Lengths are odd so the 16-lane loops' tails are met.
TEST(HalfConversion, ConvertKernelFp16PathsGiveTheScalarConversionsBits) {
  std::vector<fp16> halves(65536 + 7);
  for (size_t i = 0; i < halves.size(); ++i) halves[i].bits = static_cast<uint16_t>(i * 40503u);  // every half (odd stride)
  std::vector<float> wide(halves.size());
  convert(wide.data(), halves.data(), static_cast<Index>(halves.size()));
  for (size_t i = 0; i < halves.size(); ++i) {
    const float want = to_float(halves[i]);
    if (std::isnan(want)) {
      EXPECT_TRUE(std::isnan(wide[i])) << i;
      continue;
    }
    uint32_t a, b;
    std::memcpy(&a, &want, 4);
    std::memcpy(&b, &wide[i], 4);
    ASSERT_EQ(b, a) << "widening half 0x" << std::hex << halves[i].bits;
  }
  std::vector<float> floats;
  for (uint64_t u = 0; u <= 0xFFFFFFFFull; u += 4099) {
    const uint32_t v = static_cast<uint32_t>(u);
    float x;
    std::memcpy(&x, &v, 4);
    floats.push_back(x);
  }
  std::vector<fp16> narrow(floats.size()), acc(floats.size());
  convert(narrow.data(), floats.data(), static_cast<Index>(floats.size()));
  for (size_t i = 0; i < floats.size(); ++i) acc[i] = to_fp16(float(i % 97) - 48.0f);
  std::vector<fp16> acc_want = acc;
  convert(acc.data(), floats.data(), static_cast<Index>(floats.size()), 1.0f, /*accumulate=*/true);
  for (size_t i = 0; i < floats.size(); ++i) {
    acc_want[i] = to_fp16(to_float(acc_want[i]) + floats[i]);
    if (std::isnan(floats[i])) {
      EXPECT_TRUE(std::isnan(to_float(narrow[i])) && std::isnan(to_float(acc[i]))) << i;
      continue;
    }
    ASSERT_EQ(narrow[i].bits, to_fp16(floats[i]).bits) << "rounding float " << floats[i];
    if (!std::isnan(to_float(acc_want[i]))) {
      ASSERT_EQ(acc[i].bits, acc_want[i].bits) << "accumulating " << floats[i];
    }
  }
}
