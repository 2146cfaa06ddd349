// generate.hpp — generation with a KV cache, token ids in and out (the CLI and, later, a
// tokenizer turn text into ids and back): prompts in batches, a prefill, then one decode step
// per new token, sampling as Hugging Face's generate does (sampling.hpp), stopping at an EOS id
// or after max_new_tokens, or where the caller's TokenSink says so (a stop string).
//
// Sampling draws come from a stream per prompt, Rng(seed, first_stream + prompt index), one uniform per new
// token: a prompt's output depends on its index, the seed and the model alone, never on the
// batch it runs in or on which rank runs it.
//
// Layouts (DecodeGroups): data-parallel replicas each generate a contiguous block of the prompts
// and exchange the results at the end; pipeline stages pass each pass's hidden states stage to
// stage (with interleaved virtual stages, chunk to chunk: stage 0's chunk 0, stage 1's chunk 0,
// …, stage 0's chunk 1, …), the last stage chooses the tokens and sends them to every other stage
// (the first embeds them, all of them keep the same account of which sequences have ended), and
// up to p groups of prompts are in flight at once so that the stages work on different groups: a
// batch is one group, or GenerationOptions::micro_batches of them.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "infer/decoder.hpp"
#include "infer/sampling.hpp"
#include "parallel/comm.hpp"

namespace zero3d::infer {

struct GenerationOptions {
  SamplingOptions sampling;
  int64_t max_new_tokens = 32;
  int64_t min_new_tokens = 0;   // EOS ids are banned until this many are generated
  std::vector<int32_t> eos;     // the ids that end a sequence (empty: none; it runs max_new_tokens)
  // Ids from here on are never chosen (0: none barred): a vocabulary padded past the tokenizer's
  // has rows with no text (llm.c samples from vocab_size, not padded_vocab_size).
  int64_t vocab_limit = 0;
  uint64_t seed = 0;
  int64_t first_stream = 0;  // prompt number k draws from Rng(seed, first_stream + k)
  // With pipeline stages: each batch is cut into this many groups, which follow one another
  // through the stages. More groups keep the stages busier, but every group reads the weights
  // again, so a stage much slower than the others (GPT-2's vocabulary head) loses by it.
  int64_t micro_batches = 1;
};

// Why a sequence ended (Hugging Face's and vLLM's finish_reason words).
enum class Finish { Length, Eos, Stop };
const char* finish_name(Finish f);  // "length", "eos", "stop"

struct Generated {
  std::vector<int32_t> tokens;  // the new tokens, the EOS that ended them included (as Hugging Face returns it)
  Finish finish = Finish::Length;
};

// Sees each prompt's tokens as they are chosen, on every rank alike (so that a stop decided here
// is the same everywhere): the CLI streams their text and looks for stop strings.
class TokenSink {
 public:
  virtual ~TokenSink() = default;
  // The next token of prompt number `prompt`, one that is not an EOS that ends it; true ends the
  // prompt after it (Finish::Stop).
  virtual bool token(int64_t prompt, int32_t id) = 0;
  // The prompt has ended; its tokens are complete.
  virtual void finished(int64_t prompt, const Generated& g) = 0;
};

// Time and tokens, summed over batches: prefill tokens are the prompts' real tokens; decode
// tokens are the new tokens that decode steps computed (a sequence's first comes from the prefill).
// The *_cpu_ms are this process's CPU time over the same spans: on a machine whose cores other
// jobs share, tokens per CPU second measure the code where wall-clock rates measure the load.
// With pipeline stages prefill and decode passes of different groups overlap: each pass is timed
// on this stage from the moment it may start (its inputs awaited) to its end. With data-parallel
// replicas the tokens are every replica's and the times the slowest replica's.
// prompts, new_tokens and wall_ms: the whole generation over every replica (prompts/s, tokens/s).
struct GenerationStats {
  int64_t prefill_tokens = 0, decode_tokens = 0;
  double prefill_ms = 0.0, decode_ms = 0.0;
  double prefill_cpu_ms = 0.0, decode_cpu_ms = 0.0;
  int64_t prompts = 0, new_tokens = 0;
  double wall_ms = 0.0;
  // Per pipeline stage (one entry on one stage): the time it waited on the others, for hidden
  // states or for tokens: what the decode schedule leaves idle (rank 0's data-parallel replica).
  std::vector<double> stage_wait_ms;
  // The groups in flight at once (up to one per stage) and the most prompts a group takes.
  int64_t groups_in_flight = 0, group_rows = 0;
  double prefill_tokens_per_s() const { return prefill_ms > 0 ? prefill_tokens / (prefill_ms / 1e3) : 0.0; }
  double decode_tokens_per_s() const { return decode_ms > 0 ? decode_tokens / (decode_ms / 1e3) : 0.0; }
  double prompts_per_s() const { return wall_ms > 0 ? prompts / (wall_ms / 1e3) : 0.0; }
  double tokens_per_s() const { return wall_ms > 0 ? new_tokens / (wall_ms / 1e3) : 0.0; }
};

// Where this rank generates: its pipeline group (its stage is its rank there) and its
// data-parallel group (its replica is its rank there); null for one stage or one replica. The
// communicators take buffers in model memory (hidden states) and on the host (token ids).
// lockstep: the store gathers parameters over the data group (ZeRO-3), so every replica runs a
// pass whenever one does (a replica without work fetches and discards: HF generate's
// synced_gpus).
struct DecodeGroups {
  Communicator* pipe = nullptr;
  Communicator* data = nullptr;
  bool lockstep = false;
};

// One batch: prompts[k] is prompt number index[k] (its sampling stream). The decoder must take
// prompts.size() rows and the longest prompt plus max_new_tokens − 1 slots.
std::vector<Generated> generate_batch(Decoder& decoder, const std::vector<std::vector<int32_t>>& prompts,
                                      const std::vector<int64_t>& index, const GenerationOptions& o,
                                      GenerationStats& stats, TokenSink* sink = nullptr);

// Every prompt, `batch` at a time in order (with data-parallel replicas: each replica its block
// of them, `batch` at a time; with p stages at most a p-th of the block at a time), through
// decoders sized for them; collective over the groups. Every
// rank returns every prompt's output, and its sink sees every prompt (another replica's once they
// are exchanged).
std::vector<Generated> generate_all(const GPT& model, ParamStore& store, const std::vector<std::vector<int32_t>>& prompts,
                                    int64_t batch, const GenerationOptions& o, GenerationStats& stats,
                                    TokenSink* sink = nullptr, const DecodeGroups& groups = {});

// Replica `replica` of `replicas`: its block [first, last) of `prompts` prompts, contiguous,
// the first prompts % replicas blocks one longer.
std::pair<int64_t, int64_t> replica_prompts(int64_t prompts, int replicas, int replica);

}  // namespace zero3d::infer
