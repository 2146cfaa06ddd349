// generate.cpp — the generation loop (generate.hpp).
#include "infer/generate.hpp"

#include <algorithm>
#include <chrono>
#include <ctime>
#include <memory>
#include <utility>

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

namespace {

// One group's sequences: their sampling streams, their tokens so far and which have ended. The
// last stage chooses each step's tokens from the logits; every stage records them, so that all
// of them agree on when a sequence ends (EOS, the sink's stop strings, max_new_tokens).
class Sequences {
 public:
  Sequences(const std::vector<int64_t>& index, const GenerationOptions& o, int64_t vocab)
      : index_(index), o_(o), vocab_(vocab), out_(index.size()), done_(index.size(), false), next_(index.size(), 0) {
    for (const int64_t k : index) streams_.emplace_back(o.seed, static_cast<uint64_t>(o.first_stream + k));
  }

  // The next token of every running row from its logits ([rows][vocab]); an ended row keeps its
  // last token (fed again, computed with the others, never read).
  const std::vector<int32_t>& choose(const std::vector<float>& logits) {
    const int64_t choosable = o_.vocab_limit > 0 ? std::min(vocab_, o_.vocab_limit) : vocab_;  // a row's first ids
    const std::vector<int32_t>& banned = step_ < o_.min_new_tokens ? o_.eos : none_;
    for (size_t b = 0; b < index_.size(); ++b) {
      if (done_[b]) continue;
      // one uniform per new token, drawn whether or not it is used: greedy and sampled runs keep
      // the same stream position per token
      const double u = streams_[b].uniform();
      next_[b] = next_token(logits.data() + static_cast<int64_t>(b) * vocab_, choosable, o_.sampling, banned, u, scratch_);
    }
    return next_;
  }

  // Records a step's tokens (choose's, here or sent from the last stage); true while another
  // decode step is due.
  bool record(const std::vector<int32_t>& ids, TokenSink* sink) {
    running_ = 0;
    for (size_t b = 0; b < index_.size(); ++b) {
      if (done_[b]) continue;
      const int32_t id = ids[b];
      next_[b] = id;
      out_[b].tokens.push_back(id);
      if (std::find(o_.eos.begin(), o_.eos.end(), id) != o_.eos.end()) out_[b].finish = Finish::Eos;
      else if (sink && sink->token(index_[b], id)) out_[b].finish = Finish::Stop;
      done_[b] = out_[b].finish != Finish::Length;
      if (done_[b] && sink) sink->finished(index_[b], out_[b]);
      running_ += !done_[b];
    }
    ++step_;
    return running_ > 0 && step_ < o_.max_new_tokens;
  }

  int64_t running() const { return running_; }  // rows a decode step computes
  const std::vector<int32_t>& next() const { return next_; }  // the tokens the next decode step appends
  const std::vector<int64_t>& index() const { return index_; }

  // The sequences, the sink told of those that ran to max_new_tokens.
  std::vector<Generated> finish(TokenSink* sink) {
    if (sink)
      for (size_t b = 0; b < index_.size(); ++b)
        if (!done_[b]) sink->finished(index_[b], out_[b]);
    return std::move(out_);
  }

 private:
  std::vector<int64_t> index_;
  const GenerationOptions& o_;
  int64_t vocab_;
  std::vector<Rng> streams_;
  std::vector<Generated> out_;
  std::vector<bool> done_;
  std::vector<int32_t> next_;
  int64_t step_ = 0, running_ = 0;
  std::vector<double> scratch_;
  const std::vector<int32_t> none_;
};

}  // namespace

std::vector<Generated> generate_batch(Decoder& decoder, const std::vector<std::vector<int32_t>>& prompts,
                                      const std::vector<int64_t>& index, const GenerationOptions& o,
                                      GenerationStats& stats, TokenSink* sink) {
  Sequences seq(index, o, decoder.vocab_size());
  const Span prefill;
  const std::vector<float>* logits = &decoder.prefill(prompts);  // the host copy of the logits ends the pass
  prefill.add_to(stats.prefill_ms, stats.prefill_cpu_ms);
  for (const auto& p : prompts) stats.prefill_tokens += static_cast<int64_t>(p.size());
  while (seq.record(seq.choose(*logits), sink)) {
    const Span step_time;
    logits = &decoder.decode(seq.next());
    step_time.add_to(stats.decode_ms, stats.decode_cpu_ms);
    stats.decode_tokens += seq.running();
  }
  return seq.finish(sink);
}

std::pair<int64_t, int64_t> replica_prompts(int64_t prompts, int replicas, int replica) {
  const int64_t base = prompts / replicas, extra = prompts % replicas;
  const int64_t first = replica * base + std::min<int64_t>(replica, extra);
  return {first, first + base + (replica < extra ? 1 : 0)};
}

namespace {

// Tags of generation's pipeline messages (apart from training's, 2·virtual stage + kind).
constexpr int kHiddenTag = 1 << 14, kTokensTag = (1 << 14) + 1;

// One group of prompts in flight on this rank: its decoders (one per chunk of the stage, each
// with the chunk's KV cache), its sequences, and the messages it has in flight.
struct Slot {
  std::vector<std::unique_ptr<Decoder>> decoders;
  std::unique_ptr<Sequences> seq;
  std::vector<std::vector<int32_t>> prompts;
  bool fresh = false;        // started, its prefill not run yet
  bool pass = false;         // this round runs its passes here
  bool anywhere = false;     // some lockstep replica runs this round's passes of the slot
  std::vector<int32_t> ids;  // the tokens of its last pass (chosen on the last stage)
  std::vector<std::unique_ptr<CommRequest>> hidden_sends;  // per chunk, out of its decoder's output()
  std::vector<std::unique_ptr<CommRequest>> ids_sends;
  void wait_hidden(size_t chunk) {
    if (chunk < hidden_sends.size() && hidden_sends[chunk]) hidden_sends[chunk]->wait();
    if (chunk < hidden_sends.size()) hidden_sends[chunk].reset();
  }
  void wait_ids() {
    for (auto& r : ids_sends) r->wait();
    ids_sends.clear();
  }
  void wait_sends() {
    for (size_t c = 0; c < hidden_sends.size(); ++c) wait_hidden(c);
    wait_ids();
  }
};

// [finish, count, tokens…] per prompt of [first, last).
std::vector<int32_t> pack(const std::vector<Generated>& out, int64_t first, int64_t last) {
  std::vector<int32_t> v;
  for (int64_t k = first; k < last; ++k) {
    const Generated& g = out[static_cast<size_t>(k)];
    v.push_back(static_cast<int32_t>(g.finish));
    v.push_back(static_cast<int32_t>(g.tokens.size()));
    v.insert(v.end(), g.tokens.begin(), g.tokens.end());
  }
  return v;
}

// Every replica's block of outputs to every rank (the counts first, then the packed blocks).
void exchange_outputs(Communicator& data, std::vector<Generated>& out) {
  const int replicas = data.size(), replica = data.rank();
  const auto block = replica_prompts(static_cast<int64_t>(out.size()), replicas, replica);
  const std::vector<int32_t> mine = pack(out, block.first, block.second);
  std::vector<int64_t> counts(static_cast<size_t>(replicas)), displs(static_cast<size_t>(replicas), 0);
  const int64_t count = static_cast<int64_t>(mine.size());
  data.all_gather(&count, counts.data(), 1, DType::I64);
  for (size_t r = 1; r < counts.size(); ++r) displs[r] = displs[r - 1] + counts[r - 1];
  std::vector<int32_t> all(static_cast<size_t>(displs.back() + counts.back()));
  std::copy(mine.begin(), mine.end(), all.begin() + displs[static_cast<size_t>(replica)]);
  data.all_gather_v_async(all.data(), counts, displs, DType::I32)->wait();
  size_t at = 0;
  for (Generated& g : out) {
    const size_t n = static_cast<size_t>(all[at + 1]);
    g.finish = static_cast<Finish>(all[at]);
    g.tokens.assign(all.begin() + static_cast<std::ptrdiff_t>(at + 2), all.begin() + static_cast<std::ptrdiff_t>(at + 2 + n));
    at += 2 + n;
  }
}

}  // namespace

// The decode schedule, the same sequence of visits on every stage: rounds over the chunks of a
// stage and, within a chunk, over the slots (up to p groups in flight); a slot's first visit of a
// round records its last tokens (sent by the last stage after its pass), starts the next group if
// the slot's has ended; each visit runs the slot's pass of one chunk: receive the hidden states
// (every part but the model's first, from the stage before it: stage − 1, or for chunk c > 0 of
// stage 0 the last stage's chunk c − 1), the chunk's layers, send them on, or on the model's last
// part choose the tokens and send them to every other stage. A visit waits only on visits earlier
// in the order (round, chunk, slot) or on the same visit of an earlier part, so the schedule
// cannot deadlock; with p slots stage 0 starts slot k's chunk c as the last stage ends slot k's
// chunk c − 1 (or its previous round), and no stage waits for another once the pipeline is full
// (DeepSpeed's InferenceSchedule with its outputs fed back; Megatron's interleaved order for
// virtual stages, arXiv:2104.04473 §2.2). Sends are nonblocking, waited on before the chunk's
// next pass of the slot reuses their buffers.
//
// Micro-batches: each group is a batch of at most `batch` prompts, or a micro_batches-th of one,
// so that a single batch can overlap over the stages (a prompt's tokens do not depend on its
// group: left padding, its own sampling stream).
std::vector<Generated> generate_all(const GPT& model, ParamStore& store, const std::vector<std::vector<int32_t>>& prompts,
                                    int64_t batch, const GenerationOptions& o, GenerationStats& total, TokenSink* sink,
                                    const DecodeGroups& groups) {
  const Span whole;
  GenerationStats stats;  // this call's, added to `total` at the end
  const int stages = groups.pipe ? groups.pipe->size() : 1, stage = groups.pipe ? groups.pipe->rank() : 0;
  const int replicas = groups.data ? groups.data->size() : 1, replica = groups.data ? groups.data->rank() : 0;
  const int chunks = model.num_chunks();
  const bool last_stage = stage == stages - 1;
  const int before = (stage + stages - 1) % stages, after = (stage + 1) % stages;
  const int64_t P = static_cast<int64_t>(prompts.size()), C = model.shape().n_embd;
  size_t longest = 0;
  for (const auto& p : prompts) longest = std::max(longest, p.size());
  const std::pair<int64_t, int64_t> mine = replica_prompts(P, replicas, replica);
  // Groups of the block: as many slots as stages, or as the largest block has groups (the same
  // count on every replica: lockstep replicas visit alike).
  const int64_t largest = replica_prompts(P, replicas, 0).second;
  const int64_t cut = std::max<int64_t>(1, std::min(o.micro_batches, largest));
  const int64_t rows = std::max<int64_t>(1, (std::min(batch, largest) + cut - 1) / cut);
  const int num_slots = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(stages, (largest + rows - 1) / rows)));
  const int64_t max_tokens = static_cast<int64_t>(longest) + o.max_new_tokens - 1;
  stats.group_rows = rows;
  stats.groups_in_flight = num_slots;

  std::vector<Generated> out(static_cast<size_t>(P));
  std::vector<Slot> slots(static_cast<size_t>(num_slots));
  double wait_ms = 0.0, cpu_unused = 0.0;
  int64_t next_prompt = mine.first;
  const auto start_group = [&](Slot& slot) {
    if (next_prompt >= mine.second) return;
    const int64_t end = std::min(mine.second, next_prompt + rows);
    slot.prompts.assign(prompts.begin() + next_prompt, prompts.begin() + end);
    std::vector<int64_t> index;
    for (int64_t k = next_prompt; k < end; ++k) index.push_back(k);
    next_prompt = end;
    if (slot.decoders.empty())
      for (int c = 0; c < chunks; ++c) slot.decoders.push_back(std::make_unique<Decoder>(model, store, rows, max_tokens, c));
    slot.hidden_sends.resize(static_cast<size_t>(chunks));
    slot.seq = std::make_unique<Sequences>(index, o, model.shape().vocab_size);
    slot.ids.assign(index.size(), 0);
    slot.fresh = true;
  };
  for (Slot& slot : slots) start_group(slot);

  for (bool passes = true; passes;) {
    passes = false;
    for (int c = 0; c < chunks; ++c) {
      for (Slot& slot : slots) {
        const Span visit;
        if (c == 0) {
          if (slot.seq && !slot.fresh) {
            if (!last_stage) {
              const Span waited;
              groups.pipe->recv(slot.ids.data(), static_cast<int64_t>(slot.ids.size()), DType::I32, stages - 1, kTokensTag);
              waited.add_to(wait_ms, cpu_unused);
            }
            if (!slot.seq->record(slot.ids, sink)) {
              const std::vector<int64_t> index = slot.seq->index();
              std::vector<Generated> done = slot.seq->finish(sink);
              for (size_t b = 0; b < index.size(); ++b) out[static_cast<size_t>(index[b])] = std::move(done[b]);
              slot.seq.reset();
              slot.wait_sends();  // the last stage's tokens may still be going out of slot.ids
              start_group(slot);
            }
          }
          slot.pass = slot.seq != nullptr;
          int32_t anywhere = slot.pass ? 1 : 0;
          if (groups.lockstep && replicas > 1) groups.data->all_reduce(&anywhere, 1, DType::I32, ReduceOp::Max);
          slot.anywhere = anywhere != 0;
          passes = passes || slot.anywhere;
        }
        if (!slot.pass) {
          if (slot.anywhere) fetch_pass(model, store, c);
          continue;
        }
        slot.wait_hidden(static_cast<size_t>(c));
        Decoder& dec = *slot.decoders[static_cast<size_t>(c)];
        const bool prefill = slot.fresh;
        const int64_t n = prefill ? dec.start(slot.prompts) : 1;
        if (!dec.first_part()) {
          float* hidden = dec.input(n);
          const Span waited;
          groups.pipe->recv(hidden, dec.rows() * n * C, DType::F32, before, kHiddenTag);
          waited.add_to(wait_ms, cpu_unused);
        }
        dec.run(prefill ? dec.prompt_tokens() : slot.ids, n);
        if (!dec.last_part()) {
          slot.hidden_sends[static_cast<size_t>(c)] =
              groups.pipe->isend(dec.output(), dec.rows() * n * C, DType::F32, after, kHiddenTag);
        } else {
          slot.wait_ids();  // the previous step's tokens may still be going out of slot.ids
          slot.ids = slot.seq->choose(dec.logits());
          for (int s = 0; s + 1 < stages; ++s)
            slot.ids_sends.push_back(
                groups.pipe->isend(slot.ids.data(), static_cast<int64_t>(slot.ids.size()), DType::I32, s, kTokensTag));
        }
        const bool round_done = c == chunks - 1;
        if (prefill) {
          visit.add_to(stats.prefill_ms, stats.prefill_cpu_ms);
          if (round_done)
            for (const auto& p : slot.prompts) stats.prefill_tokens += static_cast<int64_t>(p.size());
        } else {
          visit.add_to(stats.decode_ms, stats.decode_cpu_ms);
          if (round_done) stats.decode_tokens += slot.seq->running();
        }
        if (round_done) slot.fresh = false;
      }
    }
  }
  for (Slot& slot : slots) slot.wait_sends();
  stats.stage_wait_ms.assign(static_cast<size_t>(stages), wait_ms);
  if (stages > 1) groups.pipe->all_gather(&wait_ms, stats.stage_wait_ms.data(), 1, DType::F64);

  if (replicas > 1) {
    exchange_outputs(*groups.data, out);
    // Another replica's prompts reach this rank's sink now, in prompt order: their tokens as that
    // replica's sink saw them (an ending EOS is no token for a sink), then their end.
    if (sink)
      for (int64_t k = 0; k < P; ++k) {
        if (k >= mine.first && k < mine.second) continue;
        const Generated& g = out[static_cast<size_t>(k)];
        const size_t shown = g.tokens.size() - (g.finish == Finish::Eos ? 1 : 0);
        for (size_t i = 0; i < shown; ++i) sink->token(k, g.tokens[i]);
        sink->finished(k, g);
      }
    double tokens[2] = {static_cast<double>(stats.prefill_tokens), static_cast<double>(stats.decode_tokens)};
    double spans[2] = {stats.prefill_ms, stats.decode_ms};
    groups.data->all_reduce(tokens, 2, DType::F64, ReduceOp::Sum);
    groups.data->all_reduce(spans, 2, DType::F64, ReduceOp::Max);
    stats.prefill_tokens = static_cast<int64_t>(tokens[0]);
    stats.decode_tokens = static_cast<int64_t>(tokens[1]);
    stats.prefill_ms = spans[0];
    stats.decode_ms = spans[1];
  }
  stats.prompts = P;
  for (const Generated& g : out) stats.new_tokens += static_cast<int64_t>(g.tokens.size());
  double cpu = 0.0;
  whole.add_to(stats.wall_ms, cpu);
  if (replicas > 1) groups.data->all_reduce(&stats.wall_ms, 1, DType::F64, ReduceOp::Max);
  total.prefill_tokens += stats.prefill_tokens, total.decode_tokens += stats.decode_tokens;
  total.prefill_ms += stats.prefill_ms, total.decode_ms += stats.decode_ms;
  total.prefill_cpu_ms += stats.prefill_cpu_ms, total.decode_cpu_ms += stats.decode_cpu_ms;
  total.prompts += stats.prompts, total.new_tokens += stats.new_tokens, total.wall_ms += stats.wall_ms;
  total.group_rows = std::max(total.group_rows, stats.group_rows);
  total.groups_in_flight = std::max(total.groups_in_flight, stats.groups_in_flight);
  total.stage_wait_ms.resize(stats.stage_wait_ms.size(), 0.0);
  for (size_t s = 0; s < stats.stage_wait_ms.size(); ++s) total.stage_wait_ms[s] += stats.stage_wait_ms[s];
  return out;
}

}  // namespace zero3d::infer
