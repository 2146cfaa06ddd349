// generate.cpp — zero3d generate: a checkpoint's (or the config's initial) parameters, prompts as
// token ids, the generated ids out. The token-id input and output live here, so that a tokenizer
// can put text on either side without touching generation (src/infer).
//
// The model is built and loaded as `zero3d eval` builds it (the engine, any tensor-parallel and
// data-parallel layout, ZeRO stage 0-3), then infer::generate_all runs prefill and decode steps
// over its parameters. Every data-parallel rank generates every prompt (ZeRO-3's gathers need
// every rank of the data group in each pass), so their outputs are the same; rank 0 prints.
#include <cctype>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "base/errors.hpp"
#include "base/failure.hpp"
#include "base/input_file.hpp"
#include "base/watchdog.hpp"
#include "cli/agreement.hpp"
#include "cli/checkpoint_model.hpp"
#include "cli/commands.hpp"
#include "config/config.hpp"
#include "infer/generate.hpp"
#include "parallel/topology.hpp"
#include "text/tokenizer.hpp"
#include "train/engine.hpp"
#include "train/estimator.hpp"
#include "train/job_control.hpp"

namespace zero3d::cli {

namespace {

// "464,2068, 11" or "464 2068 11": token ids; `what` names the option or file line in messages.
std::vector<int32_t> parse_ids(const std::string& text, const std::string& what, int64_t vocab) {
  std::vector<int32_t> ids;
  size_t i = 0;
  while (i < text.size()) {
    const unsigned char ch = static_cast<unsigned char>(text[i]);
    if (ch == ',' || std::isspace(ch)) {
      ++i;
      continue;
    }
    size_t end = i;
    while (end < text.size() && (std::isdigit(static_cast<unsigned char>(text[end])) || (end == i && text[end] == '-')))
      ++end;
    const std::string word = text.substr(i, end - i);
    const bool digits = end > i && (end == text.size() || text[end] == ',' ||
                                    std::isspace(static_cast<unsigned char>(text[end])));
    if (!digits || word == "-")
      throw InputError(what + ": " + echo(text.substr(i, 20), 20) + " is not a token id (ids are integers separated by "
                       "commas or spaces)");
    const long long id = word.size() > 12 ? -1 : std::stoll(word);
    if (id < 0 || id >= vocab)
      throw InputError(what + ": token id " + echo(word, 20) + " is outside the vocabulary [0, " +
                       std::to_string(vocab) + ")");
    ids.push_back(static_cast<int32_t>(id));
    i = end;
  }
  if (ids.empty()) throw InputError(what + ": an empty prompt (give at least one token id)");
  return ids;
}

struct Prompt {
  std::vector<int32_t> ids;
  std::string where;  // "--prompt-ids", or "prompts.txt line 3"
};

// Text prompts through the tokenizer: every id must be one of the model's.
Prompt encode_prompt(const text::Tokenizer& tok, const std::string& text, const std::string& where, int64_t vocab) {
  Prompt p{tok.encode(text), where};
  if (p.ids.empty()) throw InputError(where + ": an empty prompt (the tokenizer gives no token for it)");
  for (const int32_t id : p.ids)
    if (id < 0 || id >= vocab)
      throw InputError(where + ": the tokenizer gives id " + std::to_string(id) + ", outside the model's vocabulary [0, " +
                       std::to_string(vocab) + ") (" + tok.describe() + "; is it this model's tokenizer?)");
  return p;
}

std::vector<Prompt> read_prompts(const GenerateArgs& a, int64_t vocab, const text::Tokenizer* tok) {
  const int given = !a.prompt_ids.empty() + !a.prompt_ids_file.empty() + !a.prompt.empty() + !a.prompt_file.empty();
  if (given > 1) throw InputError("generate: give one of --prompt, --prompt-file, --prompt-ids and --prompt-ids-file");
  if (given == 0)
    throw InputError("generate: no prompt (give --prompt TEXT, --prompt-file F, --prompt-ids \"464,2068,...\" or "
                     "--prompt-ids-file F, one prompt a line)");
  if (!a.prompt.empty()) return {encode_prompt(*tok, a.prompt, "--prompt", vocab)};
  if (!a.prompt_file.empty()) {
    const std::string text = read_regular_file(a.prompt_file, "--prompt-file", int64_t(1) << 30);
    std::vector<Prompt> prompts;
    std::istringstream in(text);
    std::string line;
    for (int64_t n = 1; std::getline(in, line); ++n)
      prompts.push_back(encode_prompt(*tok, line, echo(a.prompt_file, 120) + " line " + std::to_string(n), vocab));
    if (prompts.empty()) throw InputError("--prompt-file " + echo(a.prompt_file, 120) + ": holds no prompt");
    return prompts;
  }
  if (!a.prompt_ids.empty()) return {{parse_ids(a.prompt_ids, "--prompt-ids", vocab), "--prompt-ids"}};
  const std::string text = read_regular_file(a.prompt_ids_file, "--prompt-ids-file", int64_t(1) << 30);
  std::vector<Prompt> prompts;
  std::istringstream in(text);
  std::string line;
  for (int64_t n = 1; std::getline(in, line); ++n) {
    const std::string where = echo(a.prompt_ids_file, 120) + " line " + std::to_string(n);
    prompts.push_back({parse_ids(line, where, vocab), where});
  }
  if (prompts.empty()) throw InputError("--prompt-ids-file " + echo(a.prompt_ids_file, 120) + ": holds no prompt");
  return prompts;
}

// The ids that end a sequence: --eos-id, else the Hugging Face config's eos_token_id (an id or a
// list), else GPT-2's <|endoftext|> (50256) when the vocabulary is GPT-2's; else none.
std::vector<int32_t> eos_ids(const GenerateArgs& a, const Config& cfg) {
  const int64_t V = cfg.model.vocab_size;
  if (a.eos_given) {
    if (a.eos_id == -1) return {};
    if (a.eos_id >= V)
      throw InputError("--eos-id " + std::to_string(a.eos_id) + ": outside the vocabulary [0, " + std::to_string(V) + ")");
    return {static_cast<int32_t>(a.eos_id)};
  }
  if (!cfg.model.hf_config.empty()) {
    const nlohmann::json hf = load_json_file(cfg.model.hf_config);
    const auto it = hf.find("eos_token_id");
    std::vector<int32_t> ids;
    if (it != hf.end())
      for (const nlohmann::json& v : it->is_array() ? *it : nlohmann::json::array({*it}))
        if (v.is_number_integer() && v.get<int64_t>() >= 0 && v.get<int64_t>() < V) ids.push_back(v.get<int32_t>());
    if (!ids.empty()) return ids;
  }
  if (cfg.model.family.arch == Architecture::GPT2 && V == 50257) return {50256};
  return {};
}

std::string join(const std::vector<int32_t>& ids) {
  std::string s;
  for (size_t i = 0; i < ids.size(); ++i) s += (i ? "," : "") + std::to_string(ids[i]);
  return s;
}

// The tokenizer text prompts and text output go through: --tokenizer, else data.tokenizer, else the
// Hugging Face directory model.hf_config names (where its tokenizer.json or .model sits); null
// when none is named and the prompts are ids (the output is then ids only).
std::unique_ptr<text::Tokenizer> open_generation_tokenizer(const GenerateArgs& a, const Config& cfg) {
  const bool text_prompts = !a.prompt.empty() || !a.prompt_file.empty();
  if (!a.tokenizer.empty()) return text::open_tokenizer(a.tokenizer);
  if (!cfg.data.tokenizer.empty()) return text::open_tokenizer(cfg.data.tokenizer);
  if (!cfg.model.hf_config.empty()) {
    const std::filesystem::path hf(cfg.model.hf_config);
    const std::filesystem::path dir = std::filesystem::is_directory(hf) ? hf : hf.parent_path();
    for (const char* f : {"tokenizer.json", "tokenizer.model"})
      if (std::filesystem::exists(dir / f)) return text::open_tokenizer((dir / f).string());
  }
  if (text_prompts)
    throw InputError("generate --prompt/--prompt-file: no tokenizer (give --tokenizer PATH, or data.tokenizer in the "
                     "config)");
  return nullptr;
}

// What generation cannot run, with the reason, before anything is built.
void check_layout(const Config& cfg, const std::string& name) {
  if (cfg.pipeline.stages > 1)
    throw InputError(name + ": `pipeline.stages` " + std::to_string(cfg.pipeline.stages) +
                     ": zero3d generate runs every layer on each rank (a decode step is one token per sequence, so "
                     "all stages but one would wait); use tensor parallelism (tensor_parallel.autotp_size) or "
                     "--set pipeline.stages=1, which loads the same checkpoint");
  if (cfg.model.moe.num_experts > 0)
    throw InputError(name + ": `moe`: zero3d generate's decoder runs dense blocks; this model routes tokens to experts");
  if (cfg.model.sparse_attention.enabled)
    throw InputError(name + ": `sparse_attention`: zero3d generate's KV-cache attention is dense; this model was "
                     "trained with block-sparse attention layouts");
}

}  // namespace

int cmd_generate(const GenerateArgs& a, MPI_Comm world) {
  int size = 1, rank = 0;
  MPI_Comm_size(world, &size);
  MPI_Comm_rank(world, &rank);
  const int ranks_here = ranks_on_this_node(world);
  const AvailableMemory avail = available_memory();
  std::string name;
  Config cfg;
  std::vector<Prompt> prompts;
  std::unique_ptr<text::Tokenizer> tokenizer;
  infer::GenerationOptions options;
  run_collectively(world, [&] {
    check_launch(size);
    if (!a.tag.empty() && a.checkpoint.empty())
      throw InputError("generate --tag " + echo(a.tag, 100) + ": needs --checkpoint");
    options.sampling = {a.greedy, a.temperature, a.top_k, a.top_p};
    infer::check_sampling_options(options.sampling);
    if (a.max_new_tokens < 1)
      throw InputError("--max-new-tokens " + std::to_string(a.max_new_tokens) + ": must be at least 1");
    if (a.min_new_tokens < 0 || a.min_new_tokens > a.max_new_tokens)
      throw InputError("--min-new-tokens " + std::to_string(a.min_new_tokens) + ": must be in [0, --max-new-tokens " +
                       std::to_string(a.max_new_tokens) + "]");
    if (a.batch_size < 1) throw InputError("--batch-size " + std::to_string(a.batch_size) + ": must be at least 1");
    if (a.eos_given && a.eos_id < -1)
      throw InputError("--eos-id " + std::to_string(a.eos_id) + ": an id, or -1 for none");
    cfg = resolve_config(load_with_overrides(a.config, name), name, size, set_keys(a.config));
    check_layout(cfg, name);
    tokenizer = open_generation_tokenizer(a, cfg);
    prompts = read_prompts(a, cfg.model.vocab_size, tokenizer.get());
    const int64_t positions = infer::max_sequence_length(gpt_shape_of(cfg.model));
    for (const Prompt& p : prompts)
      if (static_cast<int64_t>(p.ids.size()) + a.max_new_tokens > positions)
        throw InputError(p.where + ": " + std::to_string(p.ids.size()) + " prompt tokens + --max-new-tokens " +
                         std::to_string(a.max_new_tokens) + " exceed the model's " + std::to_string(positions) +
                         " positions (" + (cfg.model.family.llama() ? "max_position_embeddings" : "n_positions") + ")");
    options.max_new_tokens = a.max_new_tokens;
    options.min_new_tokens = a.min_new_tokens;
    options.seed = a.seed;
    options.eos = eos_ids(a, cfg);
    check_memory_fits(cfg, ranks_here, avail);
    without_resume_or_saves(cfg);  // the parameters come from --checkpoint (or the config's initial weights)
  });
  agree_on_configuration(world, cfg);
  CheckpointModel loaded(cfg, world, rank, a.checkpoint, a.tag);
  Engine& engine = loaded.engine;
  const int64_t step = loaded.step;
  note_phase("generation");
  std::vector<std::vector<int32_t>> ids;
  for (const Prompt& p : prompts) ids.push_back(p.ids);
  infer::GenerationStats stats;
  const std::vector<infer::Generated> out =
      infer::generate_all(engine.model(), engine.inference_store(), ids, a.batch_size, options, stats);
  if (rank != 0) return kExitOk;

  const infer::SamplingOptions& s = options.sampling;
  if (a.json) {
    nlohmann::json outputs = nlohmann::json::array();
    for (size_t k = 0; k < out.size(); ++k) {
      outputs.push_back({{"prompt", ids[k]},
                         {"tokens", out[k].tokens},
                         {"finish_reason", out[k].stopped_at_eos ? "eos" : "length"}});
      if (tokenizer) outputs.back()["text"] = tokenizer->decode(out[k].tokens);
    }
    const nlohmann::json doc = {
        {"checkpoint", a.checkpoint.empty() ? nlohmann::json() : nlohmann::json(a.checkpoint)},
        {"step", step},
        {"outputs", outputs},
        {"sampling", s.greedy ? nlohmann::json{{"greedy", true}}
                              : nlohmann::json{{"temperature", s.temperature}, {"top_k", s.top_k}, {"top_p", s.top_p},
                                               {"seed", options.seed}}},
        {"eos", options.eos},
        {"batch_size", a.batch_size},
        {"prefill_tokens", stats.prefill_tokens},
        {"prefill_ms", stats.prefill_ms},
        {"prefill_tokens_per_s", stats.prefill_tokens_per_s()},
        {"decode_tokens", stats.decode_tokens},
        {"decode_ms", stats.decode_ms},
        {"decode_tokens_per_s", stats.decode_tokens_per_s()},
        {"prefill_cpu_ms", stats.prefill_cpu_ms},
        {"decode_cpu_ms", stats.decode_cpu_ms}};
    std::printf("%s\n", doc.dump().c_str());
    return kExitOk;
  }
  std::string how = s.greedy ? "greedy" : "sampling: temperature " + std::to_string(s.temperature) + ", top_k " +
                                              std::to_string(s.top_k) + ", top_p " + std::to_string(s.top_p) +
                                              ", seed " + std::to_string(options.seed);
  std::printf("generate %s | %zu prompt%s, batch %lld | %s | eos %s\n",
              a.checkpoint.empty() ? "initial weights" : ("step " + std::to_string(step)).c_str(), out.size(),
              out.size() == 1 ? "" : "s", (long long)a.batch_size, how.c_str(),
              options.eos.empty() ? "none" : join(options.eos).c_str());
  for (size_t k = 0; k < out.size(); ++k) {
    std::printf("[%zu] %s -> %s%s\n", k, join(ids[k]).c_str(), join(out[k].tokens).c_str(),
                out[k].stopped_at_eos ? " (eos)" : "");
    if (tokenizer)
      std::printf("[%zu] text: %s%s\n", k, tokenizer->decode(ids[k]).c_str(), tokenizer->decode(out[k].tokens).c_str());
  }
  std::printf("speed   prefill %lld tokens in %.1f ms (%.1f tokens/s) | decode %lld tokens in %.1f ms (%.1f tokens/s)\n",
              (long long)stats.prefill_tokens, stats.prefill_ms, stats.prefill_tokens_per_s(),
              (long long)stats.decode_tokens, stats.decode_ms, stats.decode_tokens_per_s());
  return kExitOk;
}

}  // namespace zero3d::cli
