// sampling.cpp — Hugging Face's logits processors and warpers (sampling.hpp), on the host.
#include "infer/sampling.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <sstream>

#include "base/errors.hpp"

namespace zero3d::infer {

namespace {
std::string number(double x) {
  std::ostringstream s;
  s << x;
  return s.str();
}
bool is_banned(const std::vector<int32_t>& banned, int64_t id) {
  return std::find(banned.begin(), banned.end(), static_cast<int32_t>(id)) != banned.end();
}
}  // namespace

// HF's warpers refuse the same values (TemperatureLogitsWarper: strictly positive; TopKLogitsWarper:
// a positive integer, 0 being GenerationConfig's "off"); top_p 0 would keep one token whatever the
// logits, which --greedy says plainly, so (0, 1] is asked for.
void check_sampling_options(const SamplingOptions& o) {
  if (!(o.temperature > 0.0) || !std::isfinite(o.temperature))
    throw InputError("--temperature " + number(o.temperature) + ": must be a number above 0 (use --greedy for argmax)");
  if (o.top_k < 0) throw InputError("--top-k " + std::to_string(o.top_k) + ": must be 0 (off) or a positive count");
  if (!(o.top_p > 0.0 && o.top_p <= 1.0))
    throw InputError("--top-p " + number(o.top_p) + ": must be in (0, 1] (1: off; use --greedy for argmax)");
}

void next_token_distribution(const float* logits, int64_t V, const SamplingOptions& o,
                             const std::vector<int32_t>& banned, std::vector<double>& probs) {
  const float neg_inf = -std::numeric_limits<float>::infinity();
  // scores in float32, as GenerationMixin keeps them; temperature divides by the float32 value
  // (torch casts a Python scalar to the tensor's dtype)
  std::vector<float> scores(logits, logits + V);
  for (int32_t id : banned)
    if (id >= 0 && id < V) scores[static_cast<size_t>(id)] = neg_inf;
  if (o.temperature != 1.0) {
    const float t = static_cast<float>(o.temperature);
    for (float& s : scores) s = s / t;
  }
  if (o.top_k > 0) {  // keep scores >= the k-th largest
    const int64_t k = std::min<int64_t>(o.top_k, V);
    std::vector<float> sorted(scores);
    std::nth_element(sorted.begin(), sorted.begin() + (k - 1), sorted.end(), std::greater<float>());
    const float kth = sorted[static_cast<size_t>(k - 1)];
    for (float& s : scores)
      if (s < kth) s = neg_inf;
  }
  if (o.top_p < 1.0) {
    // ascending order (ties by id), the softmax's running sum from the least probable up
    std::vector<int64_t> order(static_cast<size_t>(V));
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(),
                     [&](int64_t a, int64_t b) { return scores[static_cast<size_t>(a)] < scores[static_cast<size_t>(b)]; });
    const float top = scores[static_cast<size_t>(order.back())];
    double total = 0.0;
    for (float s : scores) total += s == neg_inf ? 0.0 : std::exp(static_cast<double>(s) - top);
    const double threshold = 1.0 - o.top_p;
    double cumulative = 0.0;
    for (size_t r = 0; r + 1 < order.size(); ++r) {  // the most probable (last) is always kept
      float& s = scores[static_cast<size_t>(order[r])];
      cumulative += s == neg_inf ? 0.0 : std::exp(static_cast<double>(s) - top) / total;
      if (cumulative <= threshold) s = neg_inf;
    }
  }
  // softmax over what is left
  const float top = *std::max_element(scores.begin(), scores.end());
  probs.assign(static_cast<size_t>(V), 0.0);
  double total = 0.0;
  for (int64_t i = 0; i < V; ++i) {
    const float s = scores[static_cast<size_t>(i)];
    if (s == neg_inf) continue;
    probs[static_cast<size_t>(i)] = std::exp(static_cast<double>(s) - top);
    total += probs[static_cast<size_t>(i)];
  }
  for (double& p : probs) p /= total;
}

int32_t draw(const std::vector<double>& probs, double u) {
  double total = 0.0;
  for (double p : probs) total += p;
  const double target = u * total;
  double cumulative = 0.0;
  int32_t last = 0;  // the last id with probability: where rounding leaves the sum short of target
  for (size_t i = 0; i < probs.size(); ++i) {
    if (probs[i] <= 0.0) continue;
    cumulative += probs[i];
    last = static_cast<int32_t>(i);
    if (cumulative > target) return last;
  }
  return last;
}

int32_t argmax(const float* logits, int64_t V, const std::vector<int32_t>& banned) {
  int64_t best = -1;
  for (int64_t i = 0; i < V; ++i) {
    if (is_banned(banned, i)) continue;
    if (best < 0 || logits[i] > logits[best]) best = i;
  }
  return static_cast<int32_t>(best < 0 ? 0 : best);
}

int32_t next_token(const float* logits, int64_t V, const SamplingOptions& o, const std::vector<int32_t>& banned,
                   double u, std::vector<double>& scratch) {
  if (o.greedy) return argmax(logits, V, banned);
  next_token_distribution(logits, V, o, banned, scratch);
  return draw(scratch, u);
}

}  // namespace zero3d::infer
