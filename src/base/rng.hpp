// rng.hpp — a portable, seedable random stream (SplitMix64) so that every rank, build and
// platform draws identical numbers: weights from (seed, tensor name), data from (seed, index).
#pragma once

#include <cmath>
#include <cstdint>
#include <string>

namespace zero3d {

// FNV-1a: turns a tensor name into a 64-bit stream id.
inline uint64_t hash_name(const std::string& s) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : s) h = (h ^ c) * 1099511628211ull;
  return h;
}

class Rng {
 public:
  explicit Rng(uint64_t seed, uint64_t stream = 0) : state_(seed * 0x9E3779B97F4A7C15ull ^ mix(stream + 1)) {}

  uint64_t next_u64() {
    state_ += 0x9E3779B97F4A7C15ull;
    return mix(state_);
  }
  // Uniform in [0, 1) with 53 random bits.
  double uniform() { return static_cast<double>(next_u64() >> 11) * (1.0 / 9007199254740992.0); }
  // Uniform integer in [0, n).
  uint64_t below(uint64_t n) { return static_cast<uint64_t>(uniform() * static_cast<double>(n)) % n; }
  // Standard normal (Box-Muller; the second value of each pair is discarded for simplicity of state).
  double normal() {
    double u1 = uniform();
    while (u1 <= 0.0) u1 = uniform();
    const double u2 = uniform();
    return std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
  }

 private:
  static uint64_t mix(uint64_t z) {
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  uint64_t state_;
};

}  // namespace zero3d
