// gpu_test_support.hpp — what the `gpu` label's kernel checks share: model memory filled from
// and read into host vectors, seeded random inputs, and the comparison against a host
// reference computed in double.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "kernels/common.hpp"
#include "support/model_memory.hpp"

namespace zero3d::gpu_test {

using kernels::Index;

template <typename T>
using ModelArray = test_support::Buffer<T>;  // model memory, filled from and read into host vectors

inline std::vector<float> normal(Index n, float sd, unsigned seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.0f, sd);
  std::vector<float> x(static_cast<size_t>(n));
  for (float& v : x) v = d(rng);
  return x;
}

inline std::vector<int32_t> tokens(Index n, int32_t V, unsigned seed) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int32_t> d(0, V - 1);
  std::vector<int32_t> t(static_cast<size_t>(n));
  for (int32_t& v : t) v = d(rng);
  return t;
}

// Every element within atol + rtol·|want|; names the first that is not.
inline void expect_close(const std::vector<float>& got, const std::vector<double>& want, double rtol, double atol,
                         const char* what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t i = 0; i < want.size(); ++i)
    if (!(std::fabs(got[i] - want[i]) <= atol + rtol * std::fabs(want[i])))
      FAIL() << what << "[" << i << "] = " << got[i] << ", the host reference gives " << want[i];
}

}  // namespace zero3d::gpu_test
