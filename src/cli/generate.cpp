// generate.cpp — zero3d generate: a checkpoint's (or the config's initial) parameters, prompts as
// token ids, the generated ids out. The token-id input and output live here, so that a tokenizer
// can put text on either side without touching generation (src/infer).
//
// The model is built and loaded as `zero3d eval` builds it (the engine, any pipeline, tensor-
// parallel and data-parallel layout, ZeRO stage 0-3), then infer::generate_all runs prefill and
// decode steps over its parameters: pipeline stages pass hidden states on, and each
// data-parallel replica generates its block of the prompts (with ZeRO-3 the replicas run their
// passes in lockstep, as its gathers need every rank of the data group). Every rank ends with
// every prompt's output; rank 0 prints.
//
// With a tokenizer the text streams to stdout as tokens are chosen (TextOutput): whole UTF-8
// characters only, and never text that a stop string (--stop) could still claim, so what is
// printed is the final text: the new tokens' decoding (an EOS that ends them has no text) cut
// before the first stop string.
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
#include "text/stop_strings.hpp"
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

// --stop's text with \n, \t and \\ read as a newline, a tab and a backslash (a newline is the
// usual stop string, and awkward to pass through a shell); another backslash stays as written.
std::string unescape_stop(const std::string& s) {
  std::string out;
  for (size_t i = 0; i < s.size(); ++i) {
    const char next = i + 1 < s.size() ? s[i + 1] : '\0';
    if (s[i] == '\\' && (next == 'n' || next == 't' || next == '\\')) {
      out += next == 'n' ? '\n' : next == 't' ? '\t' : '\\';
      ++i;
    } else {
      out += s[i];
    }
  }
  return out;
}

// The text side of generation, on every rank alike (a stop string ends a prompt on every rank):
// each prompt's StopStringStream, its final text, and on rank 0 without --json the output in
// prompt order as it becomes final. The first unfinished prompt prints as its tokens arrive;
// a later one waits in a buffer until the prompts before it have ended, then catches up.
class TextOutput : public infer::TokenSink {
 public:
  TextOutput(const text::Tokenizer* tok, const std::vector<std::string>& stops, const std::vector<Prompt>& prompts,
             bool print)
      : tok_(tok), prompts_(prompts), print_(print), rows_(prompts.size()) {
    if (tok_)
      for (Row& r : rows_) r.stream = std::make_unique<text::StopStringStream>(*tok_, stops);
    show(0);
  }

  bool token(int64_t prompt, int32_t id) override {
    Row& r = rows_[static_cast<size_t>(prompt)];
    if (!r.stream) return false;
    add(prompt, r.stream->push(id));
    return r.stream->stopped();
  }

  void finished(int64_t prompt, const infer::Generated& g) override {
    Row& r = rows_[static_cast<size_t>(prompt)];
    if (r.stream) add(prompt, r.stream->finish());
    const std::vector<int32_t>& ids = prompts_[static_cast<size_t>(prompt)].ids;
    r.ending = (r.stream ? "\n" : "") + ("[" + std::to_string(prompt) + "] " + join(ids) + " -> " + join(g.tokens) +
                                         (g.finish == infer::Finish::Length ? "" : std::string(" (") +
                                                                                       infer::finish_name(g.finish) + ")") +
                                         "\n");
    r.done = true;
    // The prompts in order: each one that has ended hands the output to the next.
    while (next_ < rows_.size() && rows_[next_].done) {
      emit(rows_[next_].ending);
      show(++next_);
    }
  }

  // The text generated for a prompt, cut before its stop string (empty without a tokenizer).
  const std::string& new_text(size_t prompt) const { return rows_[prompt].produced; }
  const std::string& stop_string(size_t prompt) const {
    static const std::string none;
    return rows_[prompt].stream ? rows_[prompt].stream->stopped_by() : none;
  }

 private:
  struct Row {
    std::unique_ptr<text::StopStringStream> stream;
    std::string produced;  // all of it so far
    size_t shown = 0;      // of it, the bytes printed
    std::string ending;    // the ids line, printed once the text is out
    bool started = false;  // its "[k] text: PROMPT" is printed
    bool done = false;
  };

  void add(int64_t prompt, const std::string& part) {
    Row& r = rows_[static_cast<size_t>(prompt)];
    r.produced += part;
    if (static_cast<size_t>(prompt) == next_) show(next_);
  }
  // Prints what prompt k has that is not printed yet (its first line's start the first time).
  void show(size_t k) {
    if (k >= rows_.size() || !rows_[k].stream) return;
    Row& r = rows_[k];
    if (!r.started) {
      r.started = true;
      emit("[" + std::to_string(k) + "] text: " + tok_->decode(prompts_[k].ids));
    }
    emit(r.produced.substr(r.shown));
    r.shown = r.produced.size();
  }
  void emit(const std::string& s) const {
    if (!print_ || s.empty()) return;
    std::fwrite(s.data(), 1, s.size(), stdout);
    std::fflush(stdout);
  }

  const text::Tokenizer* tok_;
  const std::vector<Prompt>& prompts_;
  bool print_;
  std::vector<Row> rows_;
  size_t next_ = 0;  // the prompt whose text is printing
};

// The config generate runs: the file with --set, DeepSpeed's init_inference JSON from
// --inference-config as its `inference` section, and that section's layout (dtype, tensor ranks,
// ZeRO stage) in the keys the engine reads. What generation cannot run is refused with the reason.
Config generation_config(const GenerateArgs& a, int size, std::string& name) {
  nlohmann::json root = load_with_overrides(a.config, name);
  if (!a.inference_config.empty()) root["inference"] = load_json_file(a.inference_config);
  Config cfg = resolve_config(root, name, size, set_keys(a.config));
  const InferenceConfig& inf = cfg.inference;
  if (inf.tp_size > 0 && size % inf.tp_size != 0)
    throw InputError(name + ": `inference.tensor_parallel.tp_size` " + std::to_string(inf.tp_size) +
                     " does not divide the number of ranks (" + std::to_string(size) + ")");
  if (inf.dtype || inf.tp_size > 0 || inf.zero_stage >= 0)
    cfg = resolve_config(with_inference_layout(root, inf), name, size, set_keys(a.config));
  const std::string why = generation_refusal(cfg);
  if (!why.empty()) throw InputError(name + ": " + why);
  return cfg;
}

// DeepSpeed's max_out_tokens (the tokens a sequence may hold, the prompt's included) and
// min_out_tokens (the new tokens every prompt must have room for: an error up front, rather than
// a sequence cut short), against the model's positions and --max-new-tokens.
void check_sequence_room(const std::vector<Prompt>& prompts, const GenerateArgs& a, const Config& cfg) {
  const int64_t positions = infer::max_sequence_length(gpt_shape_of(cfg.model));
  const std::string positions_key = cfg.model.family.llama() ? "max_position_embeddings" : "n_positions";
  const InferenceConfig& inf = cfg.inference;
  const bool capped = inf.max_out_tokens > 0 && inf.max_out_tokens < positions;
  const int64_t room = capped ? inf.max_out_tokens : positions;
  const std::string limit = capped ? "`inference.max_out_tokens` " + std::to_string(room)
                                   : "the model's " + std::to_string(positions) + " positions (" + positions_key + ")";
  for (const Prompt& p : prompts) {
    const int64_t n = static_cast<int64_t>(p.ids.size());
    if (inf.min_out_tokens > 0 && n + inf.min_out_tokens > room)
      throw InputError(p.where + ": " + std::to_string(n) + " prompt tokens leave room for " +
                       std::to_string(std::max<int64_t>(0, room - n)) + " new tokens within " + limit +
                       ", fewer than `inference.min_out_tokens` " + std::to_string(inf.min_out_tokens));
    if (n + a.max_new_tokens > room)
      throw InputError(p.where + ": " + std::to_string(n) + " prompt tokens + --max-new-tokens " +
                       std::to_string(a.max_new_tokens) + " exceed " + limit);
  }
}

}  // namespace

int cmd_generate(const GenerateArgs& a, MPI_Comm world) {
  int size = 1, rank = 0;
  MPI_Comm_size(world, &size);
  MPI_Comm_rank(world, &rank);
  const int ranks_here = ranks_on_this_node(world);
  const int per_node = planned_ranks_per_node(world);  // the engine's plan sizes qgZ by the nodes
  const AvailableMemory avail = available_memory();
  std::string name;
  Config cfg;
  std::vector<Prompt> prompts;
  std::unique_ptr<text::Tokenizer> tokenizer;
  infer::GenerationOptions options;
  std::vector<std::string> stops;
  std::string checkpoint;
  run_collectively(world, [&] {
    check_launch(size);
    options.sampling = {a.greedy, a.temperature, a.top_k, a.top_p};
    infer::check_sampling_options(options.sampling);
    if (a.max_new_tokens < 1)
      throw InputError("--max-new-tokens " + std::to_string(a.max_new_tokens) + ": must be at least 1");
    if (a.min_new_tokens < 0 || a.min_new_tokens > a.max_new_tokens)
      throw InputError("--min-new-tokens " + std::to_string(a.min_new_tokens) + ": must be in [0, --max-new-tokens " +
                       std::to_string(a.max_new_tokens) + "]");
    if (a.batch_size < 1) throw InputError("--batch-size " + std::to_string(a.batch_size) + ": must be at least 1");
    if (a.micro_batches < 1)
      throw InputError("--micro-batches " + std::to_string(a.micro_batches) + ": must be at least 1");
    if (a.eos_given && a.eos_id < -1)
      throw InputError("--eos-id " + std::to_string(a.eos_id) + ": an id, or -1 for none");
    cfg = generation_config(a, size, name);
    // --checkpoint, else the inference section's `checkpoint` (init_inference names it there).
    checkpoint = a.checkpoint.empty() ? cfg.inference.checkpoint : a.checkpoint;
    if (!a.tag.empty() && checkpoint.empty())
      throw InputError("generate --tag " + echo(a.tag, 100) + ": needs --checkpoint (or inference.checkpoint)");
    tokenizer = open_generation_tokenizer(a, cfg);
    prompts = read_prompts(a, cfg.model.vocab_size, tokenizer.get());
    if (tokenizer)  // the text of every prompt is printed, and new tokens are chosen among the tokenizer's
      for (const Prompt& p : prompts)
        for (const int32_t id : p.ids)
          if (id >= tokenizer->vocab_size())
            throw InputError(p.where + ": token id " + std::to_string(id) + " has no text in the tokenizer (" +
                             tokenizer->describe() + ")");
    if (!a.stop.empty() && !tokenizer)
      throw InputError("--stop: stop strings are text, and no tokenizer is named (give --tokenizer PATH, "
                       "or data.tokenizer in the config)");
    for (const std::string& s : a.stop) {
      stops.push_back(unescape_stop(s));
      if (stops.back().empty()) throw InputError("--stop \"\": an empty stop string would end every sequence at once");
    }
    if (tokenizer) {
      const text::StopStringStream checked(*tokenizer, stops);  // its checks (valid UTF-8), before any work
    }
    check_sequence_room(prompts, a, cfg);
    options.max_new_tokens = a.max_new_tokens;
    options.min_new_tokens = a.min_new_tokens;
    options.seed = a.seed;
    options.micro_batches = a.micro_batches;
    options.eos = eos_ids(a, cfg);
    options.vocab_limit = tokenizer ? tokenizer->vocab_size() : 0;
    check_memory_fits(cfg, ranks_here, avail, per_node);
    without_resume_or_saves(cfg);  // the parameters come from --checkpoint (or the config's initial weights)
  });
  agree_on_configuration(world, cfg);
  if (rank == 0)
    for (const std::string& line : cfg.inference.no_effect) std::printf("no effect on this build: %s\n", line.c_str());
  CheckpointModel loaded(cfg, world, rank, checkpoint, a.tag);
  Engine& engine = loaded.engine;
  const int64_t step = loaded.step;
  note_phase("generation");
  std::vector<std::vector<int32_t>> ids;
  for (const Prompt& p : prompts) ids.push_back(p.ids);
  const infer::SamplingOptions& s = options.sampling;
  if (rank == 0 && !a.json) {
    const std::string how = s.greedy ? "greedy" : "sampling: temperature " + std::to_string(s.temperature) + ", top_k " +
                                                      std::to_string(s.top_k) + ", top_p " + std::to_string(s.top_p) +
                                                      ", seed " + std::to_string(options.seed);
    std::printf("generate %s | %zu prompt%s, batch %lld | %s | eos %s%s\n",
                checkpoint.empty() ? "initial weights" : ("step " + std::to_string(step)).c_str(), prompts.size(),
                prompts.size() == 1 ? "" : "s", (long long)a.batch_size, how.c_str(),
                options.eos.empty() ? "none" : join(options.eos).c_str(),
                stops.empty() ? "" : (" | stop " + nlohmann::json(stops).dump()).c_str());
    std::fflush(stdout);
  }
  TextOutput text_out(tokenizer.get(), stops, prompts, rank == 0 && !a.json);
  infer::GenerationStats stats;
  const infer::DecodeGroups groups{&engine.pipe_group(), &engine.data_group(), cfg.zero.stage == 3};
  const std::vector<infer::Generated> out = infer::generate_all(engine.model(), engine.inference_store(), ids,
                                                                a.batch_size, options, stats, &text_out, groups);
  if (rank != 0) return kExitOk;

  if (a.json) {
    nlohmann::json outputs = nlohmann::json::array();
    for (size_t k = 0; k < out.size(); ++k) {
      outputs.push_back({{"prompt", ids[k]}, {"tokens", out[k].tokens}, {"finish_reason", infer::finish_name(out[k].finish)}});
      if (tokenizer) outputs.back()["text"] = text_out.new_text(k);
      if (out[k].finish == infer::Finish::Stop) outputs.back()["stop_string"] = text_out.stop_string(k);
    }
    const nlohmann::json doc = {
        {"checkpoint", checkpoint.empty() ? nlohmann::json() : nlohmann::json(checkpoint)},
        {"step", step},
        {"outputs", outputs},
        {"sampling", s.greedy ? nlohmann::json{{"greedy", true}}
                              : nlohmann::json{{"temperature", s.temperature}, {"top_k", s.top_k}, {"top_p", s.top_p},
                                               {"seed", options.seed}}},
        {"eos", options.eos},
        {"stop", stops},
        {"dtype", dtype_name(cfg.precision.param)},
        {"batch_size", a.batch_size},
        {"prefill_tokens", stats.prefill_tokens},
        {"prefill_ms", stats.prefill_ms},
        {"prefill_tokens_per_s", stats.prefill_tokens_per_s()},
        {"decode_tokens", stats.decode_tokens},
        {"decode_ms", stats.decode_ms},
        {"decode_tokens_per_s", stats.decode_tokens_per_s()},
        {"prefill_cpu_ms", stats.prefill_cpu_ms},
        {"decode_cpu_ms", stats.decode_cpu_ms},
        {"pipeline_stages", cfg.pipeline.stages},
        {"data_parallel", cfg.batch.world_size},
        {"prompts_per_s", stats.prompts_per_s()},
        {"new_tokens", stats.new_tokens},
        {"tokens_per_s", stats.tokens_per_s()},
        {"wall_ms", stats.wall_ms},
        {"stage_wait_ms", stats.stage_wait_ms},
        {"groups_in_flight", stats.groups_in_flight},
        {"group_rows", stats.group_rows}};
    std::printf("%s\n", doc.dump().c_str());
    return kExitOk;
  }
  std::printf("speed   prefill %lld tokens in %.1f ms (%.1f tokens/s) | decode %lld tokens in %.1f ms (%.1f tokens/s)\n",
              (long long)stats.prefill_tokens, stats.prefill_ms, stats.prefill_tokens_per_s(),
              (long long)stats.decode_tokens, stats.decode_ms, stats.decode_tokens_per_s());
  std::printf("total   %lld prompts, %lld new tokens in %.1f ms (%.2f prompts/s, %.1f tokens/s) | %d stage%s x %lld "
              "data-parallel replica%s\n",
              (long long)stats.prompts, (long long)stats.new_tokens, stats.wall_ms, stats.prompts_per_s(),
              stats.tokens_per_s(), cfg.pipeline.stages, cfg.pipeline.stages == 1 ? "" : "s", (long long)cfg.batch.world_size,
              cfg.batch.world_size == 1 ? "" : "s");
  if (cfg.pipeline.stages > 1) {
    std::string waits;
    for (const double w : stats.stage_wait_ms) waits += (waits.empty() ? "" : ", ") + std::to_string(static_cast<int64_t>(w));
    std::printf("pipe    %lld group%s of up to %lld prompt%s in flight | waited on other stages (ms per stage): %s of "
                "%.1f ms\n",
                (long long)stats.groups_in_flight, stats.groups_in_flight == 1 ? "" : "s", (long long)stats.group_rows,
                stats.group_rows == 1 ? "" : "s", waits.c_str(), stats.wall_ms);
  }
  return kExitOk;
}

}  // namespace zero3d::cli
