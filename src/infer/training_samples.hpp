// training_samples.hpp — llm.c's samples while training (training.sample_every): every N steps
// the model being trained generates training.sample_tokens tokens from the tokenizer's document
// delimiter (the token every document in llm.c's shards starts with), every rank its part, and
// rank 0 prints the text and appends {"step", "tokens", "text"} to <output>/samples.jsonl.
//
// Sampling is the full softmax (temperature 1, no top-k or top-p), llm.c's sample_softmax, with
// draws from Rng(training.seed, step): a stream of its own, so a sample is the same in every run
// and layout and the training's random streams are never touched. The forward passes are
// generation's (generate.hpp: over the pipeline stages and their interleaved chunks as the model
// is laid out for training) over the engine's parameters (Engine::with_inference_store), with
// buffers of their own: the training losses are the same bits with and without samples.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "config/config.hpp"
#include "observe/monitor.hpp"
#include "text/tokenizer.hpp"
#include "train/engine.hpp"

namespace zero3d::infer {

class TrainingSampler {
 public:
  // output_dir empty: no samples.jsonl. first_step: the step training starts after (a resumed
  // run's samples past it are dropped from samples.jsonl, as metrics.jsonl's are).
  TrainingSampler(const Config& cfg, const std::string& output_dir, int64_t first_step, int rank);
  // After step `step`: a sample when it is due. Collective over the engine's ranks.
  void after_step(Engine& engine, int64_t step);

 private:
  int64_t every_, tokens_;
  uint64_t seed_;
  int rank_;
  std::unique_ptr<text::Tokenizer> tokenizer_;
  std::unique_ptr<MetricsWriter> out_;
};

}  // namespace zero3d::infer
