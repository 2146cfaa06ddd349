// training_samples.cpp — TrainingSampler (training_samples.hpp).
#include "infer/training_samples.hpp"

#include <cstdio>

#include "infer/generate.hpp"
#include "text/unicode.hpp"

namespace zero3d::infer {

TrainingSampler::TrainingSampler(const Config& cfg, const std::string& output_dir, int64_t first_step, int rank)
    : every_(cfg.training.sample_every),
      tokens_(cfg.training.sample_tokens),
      seed_(cfg.training.seed),
      rank_(rank),
      tokenizer_(text::open_tokenizer(cfg.data.tokenizer)) {
  if (tokenizer_->document_delimiter() >= cfg.model.vocab_size)
    throw InputError(cfg.file + ": `training.sample_every`: the document delimiter of data.tokenizer (" +
                     tokenizer_->describe() + ") is id " + std::to_string(tokenizer_->document_delimiter()) +
                     ", outside model.vocab_size " + std::to_string(cfg.model.vocab_size));
  if (rank_ != 0) return;
  std::printf("sample  every %lld step%s: %lld tokens from %s (id %d), the full softmax, seed %llu%s\n",
              (long long)every_, every_ == 1 ? "" : "s", (long long)tokens_,
              nlohmann::json(tokenizer_->decode({tokenizer_->document_delimiter()})).dump().c_str(),
              tokenizer_->document_delimiter(), (unsigned long long)seed_,
              output_dir.empty() ? "" : (" -> " + output_dir + "/samples.jsonl").c_str());
  if (output_dir.empty()) return;
  const std::string path = output_dir + "/samples.jsonl";
  if (first_step > 0) drop_metrics_after(path, first_step);
  out_ = std::make_unique<MetricsWriter>(path, first_step > 0);
}

void TrainingSampler::after_step(Engine& engine, int64_t step) {
  if (every_ <= 0 || step % every_ != 0) return;
  GenerationOptions o;
  o.sampling = {false, 1.0, 0, 1.0};  // llm.c's sample_softmax: the whole distribution
  o.max_new_tokens = tokens_;
  o.seed = seed_;
  o.first_stream = step;  // the sample's draws: Rng(seed, step)
  o.vocab_limit = tokenizer_->vocab_size();
  const std::vector<int32_t> start = {tokenizer_->document_delimiter()};
  std::vector<Generated> out;
  GenerationStats stats;
  // Every data-parallel replica samples alike (no data group: each runs the same passes, so a
  // ZeRO-3 store's gathers match); pipeline stages, and each stage's interleaved chunks, pass the
  // hidden states on as zero3d generate does.
  const DecodeGroups groups{&engine.pipe_group(), nullptr, false};
  engine.with_inference_store(
      [&](ParamStore& store) { out = generate_all(engine.model(), store, {start}, 1, o, stats, nullptr, groups); });
  if (rank_ != 0) return;
  const std::string text = text::sanitize_utf8(tokenizer_->decode(out[0].tokens));
  std::printf("sample  step %lld | %s\n", (long long)step, nlohmann::json(text).dump().c_str());
  std::fflush(stdout);
  if (out_) out_->write({{"step", step}, {"tokens", out[0].tokens}, {"text", text}});
}

}  // namespace zero3d::infer
