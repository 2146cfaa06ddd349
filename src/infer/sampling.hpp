// sampling.hpp — choosing the next token from the last position's logits, as Hugging Face's
// GenerationMixin does (generation/utils.py _sample, generation/logits_process.py):
//
//   1. MinNewTokensLengthLogitsProcessor: while fewer than min_new_tokens are generated, every
//      EOS id's logit is −inf;
//   2. greedy: the first id of the largest logit (torch.argmax);
//   3. else the warpers in their order: TemperatureLogitsWarper (scores / temperature),
//      TopKLogitsWarper (scores below the k-th largest → −inf; ties with it kept), TopPLogitsWarper
//      (sort ascending, remove the tokens whose cumulative softmax is <= 1 − top_p, always keeping
//      the most probable one: the smallest set whose probability reaches top_p), then softmax;
//   4. a draw: torch.multinomial's stream is torch's own, so the draw here is the inverse CDF of
//      one uniform u from the seeded stream: the first id, in vocabulary order, whose cumulative
//      probability exceeds u. Given the same u and distribution it is reproducible anywhere
//      (tests/golden/make_generate_goldens.py draws the same way).
//
// Defaults are GenerationConfig's: temperature 1.0, top_k 50, top_p 1.0 (top_k 0 and top_p 1.0
// switch their warper off).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace zero3d::infer {

struct SamplingOptions {
  bool greedy = false;
  double temperature = 1.0;  // > 0
  int64_t top_k = 50;        // >= 0; 0: off
  double top_p = 1.0;        // in (0, 1]; 1: off
};

// An InputError naming the first option out of range (--temperature, --top-k, --top-p).
void check_sampling_options(const SamplingOptions& o);

// The distribution sampling draws from (step 3), in probs[0, V); `banned` ids are −inf first (step 1).
void next_token_distribution(const float* logits, int64_t V, const SamplingOptions& o,
                             const std::vector<int32_t>& banned, std::vector<double>& probs);

// Step 4: the first id whose cumulative probability exceeds u · (the total), u in [0, 1).
int32_t draw(const std::vector<double>& probs, double u);

// Step 2: the first id of the largest logit, `banned` ids excluded (all banned: the first id).
int32_t argmax(const float* logits, int64_t V, const std::vector<int32_t>& banned);

// The next token of one row: greedy, or drawn with u.
int32_t next_token(const float* logits, int64_t V, const SamplingOptions& o, const std::vector<int32_t>& banned,
                   double u, std::vector<double>& scratch);

}  // namespace zero3d::infer
