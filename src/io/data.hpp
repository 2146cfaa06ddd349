// data.hpp — deterministic data: sample number s (one row of T tokens plus its next-token
// targets) is a pure function of (seed, s), so any rank produces its share without
// coordination and the data order does not depend on the world size.
//
// The engine gives the micro-batch of (step, micro_step, dp_rank) the B samples starting at
// s = step·train_batch_size + (micro_step·W + dp_rank)·B: the same global batch whatever
// the split into ranks and accumulation steps. Sample s never depends on B. With llm.c token
// shards and shuffle off, B consecutive samples starting at a multiple of B inside a shard are
// the window of B·T+1 consecutive tokens llm.c's DataLoader reads (process_rank = dp_rank,
// num_processes = W); at a shard's end zero3d reads every whole sample where llm.c skips the
// tail shorter than a window.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "config/config.hpp"

namespace zero3d {

class DataLoader {
 public:
  DataLoader(const DataSourceConfig& cfg, int64_t vocab_size, int64_t B, int64_t T, uint64_t seed);
  // Validation samples over tokens already in memory, read as a token shard's (zero3d eval
  // --text: a text file through the tokenizer); `name` stands for the file in messages.
  DataLoader(const std::vector<int32_t>& tokens, const std::string& name, int64_t vocab_size, int64_t B, int64_t T);

  // Writes B*T input ids and B*T target ids (host memory): samples first_sample .. +B-1.
  void micro_batch(int64_t first_sample, int32_t* inputs, int32_t* targets) const;

  std::string describe() const;
  int64_t num_tokens() const { return static_cast<int64_t>(tokens_.size()); }
  // Distinct samples before the order repeats (sequential samples); 0 when unbounded
  // (synthetic, or shuffled offsets).
  int64_t samples_per_epoch() const;
  // Where the source comes from in the config: "data" or "data.validation".
  const char* key() const { return cfg_.role == DataRole::Validation ? "data.validation" : "data"; }

 private:
  void synthetic_sample(int64_t s, int32_t* inputs, int32_t* targets) const;
  // One file's tokens: checked against the vocabulary (check_vocab) and the sample length, then
  // its sequential samples.
  void add_tokens(const std::string& name, const std::vector<int32_t>& toks, bool check_vocab);

  DataSourceConfig cfg_;
  int64_t V_, B_, T_;
  uint64_t seed_;
  uint64_t stream_ = 0;                // xor-ed into every sample's random stream: 0 for training data
  std::vector<int32_t> tokens_;        // text bytes or shard tokens, concatenated
  std::vector<int64_t> sample_starts_; // sequential samples (T+1 tokens, T apart), file by file
  std::vector<int32_t> successor_;     // synthetic task: the likely next token of each token
  std::string description_;
};

// Reads one llm.c token shard (header: 256 int32, magic 20240520, version 1, count; then uint16
// tokens; or magic 20240801, version 7, with uint32 tokens, for vocabularies beyond 65,536).
// key: the config key named in messages.
std::vector<int32_t> read_token_shard(const std::string& path, const std::string& key = "data.path");

}  // namespace zero3d
