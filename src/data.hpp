// data.hpp — deterministic micro-batches: micro-batch number k is a pure function of
// (seed, k), so any rank can produce its share without coordination.
//
// The engine numbers micro-batches k = (step·GAS + micro_step)·W + dp_rank. With llm.c token
// shards and shuffle off, micro-batch k is the window of B·T+1 consecutive tokens starting at
// token k·B·T (inputs: the first B·T, targets: shifted by one), exactly llm.c's DataLoader
// with process_rank = dp_rank and num_processes = W.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "config.hpp"

namespace zero3d {

class DataLoader {
 public:
  DataLoader(const DataConfig& cfg, int64_t vocab_size, int64_t B, int64_t T, uint64_t seed);

  // Writes B*T input ids and B*T target ids (host memory) for micro-batch k.
  void micro_batch(int64_t k, int32_t* inputs, int32_t* targets) const;

  std::string describe() const;
  int64_t num_tokens() const { return static_cast<int64_t>(tokens_.size()); }

 private:
  void synthetic_batch(int64_t k, int32_t* inputs, int32_t* targets) const;

  DataConfig cfg_;
  int64_t V_, B_, T_;
  uint64_t seed_;
  std::vector<int32_t> tokens_;        // text bytes or shard tokens, concatenated
  std::vector<int64_t> window_starts_; // sequential windows (llm.c order), across shards
  std::vector<int32_t> successor_;     // synthetic task: the likely next token of each token
  std::string description_;
};

// Reads one llm.c token shard (header: 256 int32, magic 20240520, version 1, count; then uint16).
std::vector<int32_t> read_token_shard(const std::string& path);

}  // namespace zero3d
