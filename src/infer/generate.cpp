// generate.cpp — the generation loop (generate.hpp).
#include "infer/generate.hpp"

#include <algorithm>
#include <chrono>
#include <ctime>

#include "base/rng.hpp"

namespace zero3d::infer {

namespace {
// Wall-clock and process CPU time since a start, in ms.
struct Span {
  std::chrono::steady_clock::time_point wall = std::chrono::steady_clock::now();
  double cpu = cpu_ms();
  static double cpu_ms() {
    timespec t{};
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
    return static_cast<double>(t.tv_sec) * 1e3 + static_cast<double>(t.tv_nsec) / 1e6;
  }
  void add_to(double& wall_ms, double& cpu_total_ms) const {
    wall_ms += std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - wall).count();
    cpu_total_ms += cpu_ms() - cpu;
  }
};
}  // namespace

const char* finish_name(Finish f) {
  switch (f) {
    case Finish::Eos: return "eos";
    case Finish::Stop: return "stop";
    case Finish::Length: break;
  }
  return "length";
}

std::vector<Generated> generate_batch(Decoder& decoder, const std::vector<std::vector<int32_t>>& prompts,
                                      const std::vector<int64_t>& index, const GenerationOptions& o,
                                      GenerationStats& stats, TokenSink* sink) {
  const size_t rows = prompts.size();
  const int64_t V = decoder.vocab_size();
  const int64_t choosable = o.vocab_limit > 0 ? std::min(V, o.vocab_limit) : V;  // a row's first ids
  std::vector<Generated> out(rows);
  std::vector<Rng> streams;
  for (size_t b = 0; b < rows; ++b) streams.emplace_back(o.seed, static_cast<uint64_t>(index[b]));
  std::vector<bool> done(rows, false);
  std::vector<int32_t> next(rows, 0);
  std::vector<double> scratch;
  const std::vector<int32_t> none;

  const Span prefill;
  const std::vector<float>* logits = &decoder.prefill(prompts);  // the host copy of the logits ends the pass
  prefill.add_to(stats.prefill_ms, stats.prefill_cpu_ms);
  for (const auto& p : prompts) stats.prefill_tokens += static_cast<int64_t>(p.size());

  for (int64_t step = 0; step < o.max_new_tokens; ++step) {
    const std::vector<int32_t>& banned = step < o.min_new_tokens ? o.eos : none;
    size_t running = 0;
    for (size_t b = 0; b < rows; ++b) {
      if (done[b]) continue;
      // one uniform per new token, drawn whether or not it is used: greedy and sampled runs keep
      // the same stream position per token
      const double u = streams[b].uniform();
      const int32_t id = next_token(logits->data() + b * V, choosable, o.sampling, banned, u, scratch);
      out[b].tokens.push_back(id);
      next[b] = id;
      if (std::find(o.eos.begin(), o.eos.end(), id) != o.eos.end()) out[b].finish = Finish::Eos;
      else if (sink && sink->token(index[b], id)) out[b].finish = Finish::Stop;
      done[b] = out[b].finish != Finish::Length;
      if (done[b] && sink) sink->finished(index[b], out[b]);
      running += !done[b];
    }
    if (running == 0 || step + 1 == o.max_new_tokens) break;
    // A finished row is fed its last token again: computed with the others, never read.
    const Span step_time;
    logits = &decoder.decode(next);
    step_time.add_to(stats.decode_ms, stats.decode_cpu_ms);
    stats.decode_tokens += static_cast<int64_t>(running);
  }
  if (sink)
    for (size_t b = 0; b < rows; ++b)
      if (!done[b]) sink->finished(index[b], out[b]);
  return out;
}

std::vector<Generated> generate_all(const GPT& model, ParamStore& store, const std::vector<std::vector<int32_t>>& prompts,
                                    int64_t batch, const GenerationOptions& o, GenerationStats& stats,
                                    TokenSink* sink) {
  size_t longest = 0;
  for (const auto& p : prompts) longest = std::max(longest, p.size());
  const int64_t rows = std::min<int64_t>(batch, static_cast<int64_t>(prompts.size()));
  Decoder decoder(model, store, rows, static_cast<int64_t>(longest) + o.max_new_tokens - 1);
  std::vector<Generated> out;
  for (size_t first = 0; first < prompts.size(); first += static_cast<size_t>(rows)) {
    const size_t last = std::min(prompts.size(), first + static_cast<size_t>(rows));
    const std::vector<std::vector<int32_t>> group(prompts.begin() + static_cast<std::ptrdiff_t>(first),
                                                  prompts.begin() + static_cast<std::ptrdiff_t>(last));
    std::vector<int64_t> index;
    for (size_t k = first; k < last; ++k) index.push_back(static_cast<int64_t>(k));
    for (Generated& g : generate_batch(decoder, group, index, o, stats, sink)) out.push_back(std::move(g));
  }
  return out;
}

}  // namespace zero3d::infer
