// rope_config.hpp — the settings of rotary position embeddings (rope.hpp) and their host-side
// frequency tables, apart from the kernels: plain C++ without Kokkos, so the configuration
// reader (src/config) holds a RopeConfig and the model builds its tables from it.
//
// The frequencies of each rope type follow transformers' src/transformers/modeling_rope_utils.py
// (ROPE_INIT_FUNCTIONS: default, linear, dynamic, yarn, llama3), computed in double.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace zero3d::kernels {

enum class RopeType { Default, Linear, Dynamic, Yarn, Llama3 };

// The rope_parameters (rope_scaling) of a Hugging Face config, with Hugging Face's defaults; a
// field a type does not read is ignored. 0 stands for a key that is absent (Python's None).
struct RopeConfig {
  RopeType type = RopeType::Default;
  double theta = 10000.0;                    // rope_theta
  double factor = 1.0;                       // linear, dynamic, yarn, llama3
  int64_t max_position_embeddings = 2048;    // the model's; dynamic's threshold, yarn's fallback
  int64_t original_max_position_embeddings = 0;  // yarn (absent: max_position_embeddings), llama3
  double low_freq_factor = 1.0;              // llama3
  double high_freq_factor = 4.0;             // llama3
  double beta_fast = 32.0;                   // yarn
  double beta_slow = 1.0;                    // yarn
  double attention_factor = 0.0;             // yarn (absent: from factor and mscale)
  double mscale = 0.0, mscale_all_dim = 0.0; // yarn (DeepSeek's pair)
  bool truncate = true;                      // yarn: floor/ceil the ramp's ends
};

// inv_freq[i] for i < head_dim/2, for a batch whose longest sequence is seq_len (only dynamic
// reads it: Hugging Face recomputes the base when positions pass max_position_embeddings).
inline std::vector<double> rope_inv_freq(const RopeConfig& cfg, int64_t head_dim, int64_t seq_len) {
  const int64_t half = head_dim / 2;
  const double dim = static_cast<double>(head_dim);
  auto plain = [&](double base) {  // 1 / base^(2i/dim), RoFormer's θ_i
    std::vector<double> f(static_cast<size_t>(half));
    for (int64_t i = 0; i < half; ++i) f[i] = 1.0 / std::pow(base, static_cast<double>(2 * i) / dim);
    return f;
  };
  std::vector<double> f;
  switch (cfg.type) {
    case RopeType::Default:
      return plain(cfg.theta);
    case RopeType::Linear:  // position interpolation (Chen et al. 2023): positions / factor
      f = plain(cfg.theta);
      for (double& x : f) x /= cfg.factor;
      return f;
    case RopeType::Dynamic: {  // NTK-aware base growth past max_position_embeddings
      const double max_pos = static_cast<double>(cfg.max_position_embeddings);
      const double len = std::max(static_cast<double>(seq_len), max_pos);
      return plain(cfg.theta * std::pow(cfg.factor * len / max_pos - (cfg.factor - 1.0), dim / (dim - 2.0)));
    }
    case RopeType::Yarn: {  // Peng et al. 2023: a ramp between interpolated and extrapolated frequencies
      const double orig = static_cast<double>(cfg.original_max_position_embeddings ? cfg.original_max_position_embeddings
                                                                                    : cfg.max_position_embeddings);
      const double pi = 3.14159265358979323846;
      // the dimension at which a frequency turns `rotations` times over orig positions
      auto correction_dim = [&](double rotations) {
        return dim * std::log(orig / (rotations * 2.0 * pi)) / (2.0 * std::log(cfg.theta));
      };
      double low = correction_dim(cfg.beta_fast), high = correction_dim(cfg.beta_slow);
      if (cfg.truncate) low = std::floor(low), high = std::ceil(high);
      low = std::max(low, 0.0);
      high = std::min(high, dim - 1.0);
      if (low == high) high += 0.001;  // Hugging Face's guard against a zero-width ramp
      f.resize(static_cast<size_t>(half));
      for (int64_t i = 0; i < half; ++i) {
        const double pos_freq = std::pow(cfg.theta, static_cast<double>(2 * i) / dim);
        const double ramp = std::clamp((static_cast<double>(i) - low) / (high - low), 0.0, 1.0);
        const double extrapolation = 1.0 - ramp;  // 1: keep the frequency, 0: divide it by factor
        f[i] = 1.0 / (cfg.factor * pos_freq) * (1.0 - extrapolation) + 1.0 / pos_freq * extrapolation;
      }
      return f;
    }
    case RopeType::Llama3: {  // Llama 3.1: long wavelengths / factor, short kept, a blend between
      f = plain(cfg.theta);
      const double old = static_cast<double>(cfg.original_max_position_embeddings);
      const double low_wavelen = old / cfg.low_freq_factor, high_wavelen = old / cfg.high_freq_factor;
      const double two_pi = 2.0 * 3.14159265358979323846;
      for (double& x : f) {
        const double wavelen = two_pi / x;
        if (wavelen > low_wavelen) {
          x /= cfg.factor;
        } else if (!(wavelen < high_wavelen)) {
          const double smooth = (old / wavelen - cfg.low_freq_factor) / (cfg.high_freq_factor - cfg.low_freq_factor);
          x = (1.0 - smooth) * x / cfg.factor + smooth * x;
        }
      }
      return f;
    }
  }
  return plain(cfg.theta);
}

// The factor Hugging Face multiplies cos and sin by: yarn's attention temperature
// (0.1·m·ln(factor) + 1, Peng et al. 2023 §3.4; DeepSeek's mscale ratio where both are given),
// 1 for the other types.
inline double rope_attention_factor(const RopeConfig& cfg) {
  if (cfg.type != RopeType::Yarn) return 1.0;
  if (cfg.attention_factor != 0.0) return cfg.attention_factor;
  auto get_mscale = [](double scale, double m) { return scale <= 1.0 ? 1.0 : 0.1 * m * std::log(scale) + 1.0; };
  if (cfg.mscale != 0.0 && cfg.mscale_all_dim != 0.0)
    return get_mscale(cfg.factor, cfg.mscale) / get_mscale(cfg.factor, cfg.mscale_all_dim);
  return get_mscale(cfg.factor, 1.0);
}

// Host tables cos[t·d/2 + i] and sin[…] of angle t·inv_freq[i], times the attention factor, for
// positions 0..T-1 (in double: an fp32 angle at position 4096 is off by ~2e-4 rad). A caller
// whose tokens start at position p0 (a sequence-parallel shard) passes the tables from row p0.
inline void rope_tables(std::vector<float>& cos, std::vector<float>& sin, const RopeConfig& cfg, int64_t head_dim, int64_t T) {
  const int64_t half = head_dim / 2;
  const std::vector<double> inv_freq = rope_inv_freq(cfg, head_dim, T);
  const double scale = rope_attention_factor(cfg);
  cos.assign(static_cast<size_t>(T * half), 0.0f);
  sin.assign(static_cast<size_t>(T * half), 0.0f);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t i = 0; i < half; ++i) {
      const double angle = static_cast<double>(t) * inv_freq[i];
      cos[t * half + i] = static_cast<float>(std::cos(angle) * scale);
      sin[t * half + i] = static_cast<float>(std::sin(angle) * scale);
    }
}

}  // namespace zero3d::kernels
