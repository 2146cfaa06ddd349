// pld.cpp — progressive layer drop's schedule and drop decisions (pld.hpp).
#include "model/pld.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>

#include "base/rng.hpp"

namespace zero3d {

double pld_theta(const PldConfig& pld, int64_t t) {
  // _prob(x, gamma, p) = (1. - p) * np.exp(-gamma * x) + p
  return (1.0 - pld.theta) * std::exp(-pld.gamma * static_cast<double>(t)) + pld.theta;
}

double pld_theta_in_step(const PldConfig& pld, int64_t steps_done) {
  return steps_done == 0 ? 1.0 : pld_theta(pld, steps_done - 1);  // current_theta = 1.0 until the first step()
}

double pld_keep_probability(double theta, int64_t l, int64_t L) {
  return 1.0 - static_cast<double>(l) * (1.0 - theta) / static_cast<double>(L);
}

bool pld_keeps(uint64_t seed, int64_t steps_done, int64_t micro, int64_t l, double keep_probability) {
  if (keep_probability >= 1.0) return true;
  Rng rng(seed, hash_name("pld/" + std::to_string(steps_done) + "/" + std::to_string(micro) + "/" + std::to_string(l)));
  return rng.uniform() < keep_probability;
}

std::vector<float> pld_block_scales(const PldConfig& pld, uint64_t seed, int64_t steps_done, int64_t micro,
                                    int64_t n_layer) {
  const double theta = pld_theta_in_step(pld, steps_done);
  std::vector<float> scale(static_cast<size_t>(n_layer));
  for (int64_t l = 0; l < n_layer; ++l) {
    const double p = pld_keep_probability(theta, l, n_layer);
    scale[static_cast<size_t>(l)] = pld_keeps(seed, steps_done, micro, l, p) ? static_cast<float>(1.0 / p) : 0.0f;
  }
  return scale;
}

namespace {
// Blocks run over the step's gas micro-batches.
int64_t blocks_run(const PldConfig& pld, uint64_t seed, int64_t steps_done, int64_t gas, int64_t n_layer) {
  int64_t run = 0;
  for (int64_t m = 0; m < gas; ++m)
    for (float s : pld_block_scales(pld, seed, steps_done, m, n_layer)) run += s != 0.0f ? 1 : 0;
  return run;
}
}  // namespace

nlohmann::json pld_metrics(const PldConfig& pld, uint64_t seed, int64_t steps_done, int64_t gas, int64_t n_layer) {
  const double theta = pld_theta_in_step(pld, steps_done);
  std::vector<double> keep;
  for (int64_t l = 0; l < n_layer; ++l) keep.push_back(pld_keep_probability(theta, l, n_layer));
  return {{"theta", theta},
          {"keep_prob", keep},
          {"blocks_run", blocks_run(pld, seed, steps_done, gas, n_layer)},
          {"blocks", gas * n_layer}};
}

double pld_blocks_run_fraction(const PldConfig& pld, uint64_t seed, int64_t steps_done, int64_t gas, int64_t n_layer) {
  return static_cast<double>(blocks_run(pld, seed, steps_done, gas, n_layer)) /
         static_cast<double>(std::max<int64_t>(1, gas * n_layer));
}

std::string pld_describe(const PldConfig& pld, int64_t n_layer) {
  char buf[320];
  std::snprintf(buf, sizeof buf,
                "progressive layer drop: theta(t) = (1 - %g)·exp(-%g·t) + %g; block l of %lld kept with "
                "p = 1 - l·(1 - theta)/%lld (block 0 always; the last block's p tends to %.3g), kept branches "
                "scaled by 1/p; evaluation runs every block",
                pld.theta, pld.gamma, pld.theta, (long long)n_layer, (long long)n_layer,
                pld_keep_probability(pld.theta, n_layer - 1, n_layer));
  return buf;
}

}  // namespace zero3d
