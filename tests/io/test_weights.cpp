// test_weights.cpp — model.init_from: safetensors (F32/F16/BF16) and HDF5, by Hugging Face names.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <fstream>
#include <nlohmann/json.hpp>

#include "base/errors.hpp"
#include "io/h5.hpp"
#include "io/weights.hpp"
#include "model/model.hpp"

using namespace zero3d;

namespace {

const GPTShape kShape{8, 4, 1, 2, 4};

// Writes every tensor of `layout` from `params` as a safetensors file; `dtype_of` picks each dtype.
std::string write_safetensors(const std::string& name, const ParamLayout& layout, const std::vector<float>& params,
                              const std::function<std::string(const std::string&)>& dtype_of,
                              const std::string& prefix = "") {
  nlohmann::json header = nlohmann::json::object();
  std::string data;
  for (const TensorSpec& t : layout.tensors()) {
    const std::string dtype = dtype_of(t.name);
    const size_t begin = data.size();
    for (int64_t i = 0; i < t.numel; ++i) {
      float f = params[t.offset + i];
      uint32_t bits;
      std::memcpy(&bits, &f, 4);
      if (dtype == "F32") {
        data.append(reinterpret_cast<const char*>(&f), 4);
      } else if (dtype == "BF16") {
        const uint16_t h = static_cast<uint16_t>(bits >> 16);  // values below are exact in bf16
        data.append(reinterpret_cast<const char*>(&h), 2);
      } else {  // F16: values below are small multiples of 1/8, exact in half precision
        const uint32_t exp = (bits >> 23) & 0xff, mant = bits & 0x7fffff, sign = (bits >> 16) & 0x8000;
        const uint16_t h = f == 0.0f ? 0 : static_cast<uint16_t>(sign | ((exp - 127 + 15) << 10) | (mant >> 13));
        data.append(reinterpret_cast<const char*>(&h), 2);
      }
    }
    header[prefix + t.name] = {{"dtype", dtype}, {"shape", t.shape}, {"data_offsets", {begin, data.size()}}};
  }
  const std::string text = header.dump();
  const uint64_t len = text.size();
  const std::string path = ::testing::TempDir() + name;
  std::ofstream out(path, std::ios::binary);
  out.write(reinterpret_cast<const char*>(&len), 8);
  out << text << data;
  return path;
}

std::vector<float> pattern(int64_t n) {
  std::vector<float> v(n);
  for (int64_t i = 0; i < n; ++i) v[i] = static_cast<float>((i % 17) - 8) / 8.0f;
  return v;
}

TEST(InitFrom, SafetensorsWithMixedDtypesLoadsEveryTensor) {
  const ParamLayout layout = gpt_layout(kShape);
  const std::vector<float> ref = pattern(layout.total());
  const std::string path = write_safetensors("mixed.safetensors", layout, ref, [](const std::string& n) {
    return n.find("bias") != std::string::npos ? "F16" : n.find("ln_") != std::string::npos ? "BF16" : "F32";
  });
  std::vector<float> loaded(layout.total(), -99.0f);
  load_weights(path, layout, loaded.data());
  EXPECT_EQ(loaded, ref);
}

TEST(InitFrom, SafetensorsAcceptsTheTransformerPrefix) {
  const ParamLayout layout = gpt_layout(kShape);
  const std::vector<float> ref = pattern(layout.total());
  const std::string path =
      write_safetensors("prefixed.safetensors", layout, ref, [](const std::string&) { return "F32"; }, "transformer.");
  std::vector<float> loaded(layout.total());
  load_weights(path, layout, loaded.data());
  EXPECT_EQ(loaded, ref);
}

TEST(InitFrom, Hdf5RoundTripsEveryTensorByName) {
  const ParamLayout layout = gpt_layout(kShape);
  const std::vector<float> ref = pattern(layout.total());
  const std::string path = ::testing::TempDir() + "weights.h5";
  save_weights_hdf5(path, layout, ref.data());
  std::vector<float> loaded(layout.total());
  load_weights(path, layout, loaded.data());
  EXPECT_EQ(loaded, ref);
}

TEST(InitFrom, MissingTensorIsNamed) {
  ParamLayout small = gpt_layout(kShape);
  const std::vector<float> ref = pattern(small.total());
  const std::string path = ::testing::TempDir() + "one_layer.h5";
  save_weights_hdf5(path, small, ref.data());
  GPTShape two_layers = kShape;
  two_layers.n_layer = 2;
  const ParamLayout bigger = gpt_layout(two_layers);
  std::vector<float> loaded(bigger.total());
  try {
    load_weights(path, bigger, loaded.data());
    FAIL() << "loaded a file without h.1";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("h.1.ln_1.weight"), std::string::npos) << e.what();
  }
}

TEST(Initialisation, IsDeterministicPerSeedAndTensorName) {
  const ParamLayout layout = gpt_layout(kShape);
  std::vector<float> a(layout.total()), b(layout.total()), c(layout.total());
  init_gpt_params(a.data(), layout, kShape, 1);
  init_gpt_params(b.data(), layout, kShape, 1);
  init_gpt_params(c.data(), layout, kShape, 2);
  EXPECT_EQ(a, b);
  EXPECT_NE(a, c);
}

TEST(Initialisation, BiasesZeroLayerNormOnesResidualProjectionsScaled) {
  GPTShape shape{64, 16, 8, 2, 64};
  const ParamLayout layout = gpt_layout(shape);
  std::vector<float> p(layout.total());
  init_gpt_params(p.data(), layout, shape, 3);
  auto stddev = [&](const std::string& name) {
    const TensorSpec& t = *layout.find(name);
    double s = 0.0;
    for (int64_t i = 0; i < t.numel; ++i) s += static_cast<double>(p[t.offset + i]) * p[t.offset + i];
    return std::sqrt(s / t.numel);
  };
  EXPECT_EQ(p[layout.find("h.0.attn.c_attn.bias")->offset], 0.0f);
  EXPECT_EQ(p[layout.find("h.3.ln_2.weight")->offset], 1.0f);
  EXPECT_NEAR(stddev("h.0.mlp.c_fc.weight"), 0.02, 0.001);
  EXPECT_NEAR(stddev("h.0.mlp.c_proj.weight"), 0.02 / std::sqrt(16.0), 0.0005);  // 1/sqrt(2L), L = 8
}

}  // namespace
