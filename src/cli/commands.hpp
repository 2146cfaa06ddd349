// commands.hpp — zero3d's subcommands, one function each, and the arguments they share.
// main.cpp parses the command line, calls one, and is the one place that turns what it throws
// into an exit code and a message.
#pragma once

#include <mpi.h>

#include <cstdint>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <vector>

#include "kernels/device.hpp"  // Backend

namespace zero3d::text {
class Tokenizer;
}

namespace zero3d::cli {

// The most ranks a size given on the command line may describe: far above any job, and low
// enough that per-rank tables (topology, estimates) stay small and every product fits an int.
constexpr int64_t kMaxRanks = int64_t(1) << 20;
// estimate --step/--step-range replay the optimizer's schedule step by step: up to 10^8 steps.
constexpr int64_t kMaxEstimateSteps = 100'000'000;

struct ConfigArgs {
  std::string path;  // empty = the built-in quick-start
  std::vector<std::string> overrides;
  std::string strategy;  // --strategy: a Lightning DeepSpeed preset beneath the config's keys
};

struct EstimateArgs {
  std::string kind;  // zero2 | zero3 | empty (the complete budget of --config)
  double params = 0, largest_layer = -1, buffer_factor = 1.5;
  int gpus_per_node = 1, nodes = 1;
  std::string model, report, memory_per_rank;
  ConfigArgs config;
  int64_t world_size = 1;
  int64_t ranks_per_node = 0;  // --config: nodes of this many ranks for the bytes by link and qgZ (0: one node)
  int64_t step = 1;            // --config: the optimizer step whose bytes are reported (its phase's)
  std::string step_range;      // --config: FIRST-LAST, the steps averaged (default 1 to training.steps)
  std::string device;          // --config: "cpu" or "gpu", the build planned for (empty: this one)
  bool json = false;
  std::set<std::string> given;  // the options on the command line
  bool has(const char* option) const { return given.count(option) > 0; }
};

// `zero3d tokenize` (tokenize.cpp): text files to llm.c token shards.
struct TokenizeArgs {
  std::string tokenizer;               // a path open_tokenizer takes
  std::string out;                     // the shards' directory
  std::string name;                    // the shards' file-name prefix (default: the directory's name)
  std::string field = "text";          // the document's field in JSON Lines inputs
  int64_t shard_size = 100'000'000;    // tokens per shard at most (llm.c's default)
  double val_fraction = 0.1;           // the leading fraction of all tokens that is the validation split
  std::vector<std::string> files;      // plain text (one document each) or .jsonl (one per line)
};

// The key paths of the --set overrides ("a.b=1" gives "a.b"), for read_config's messages.
std::vector<std::string> set_keys(const ConfigArgs& a);
// Loads the JSON (file or built-in quick-start) and applies --set overrides in order; `name`
// becomes the name every message gives the config.
nlohmann::json load_with_overrides(const ConfigArgs& a, std::string& name);
// Ranks sharing this machine's memory (MPI_COMM_TYPE_SHARED), and this rank's place among them.
int ranks_on_this_node(MPI_Comm world);
int local_rank(MPI_Comm world);
// A byte size option such as 16GiB (parse_byte_size says what is wrong; the option is named).
int64_t size_option(const std::string& option, const std::string& text);
// `COMMAND --device cpu|gpu` (null: not given, this build's): the build a plan is for. A CPU build
// plans a GPU run with the sizes a GPU build's kernels take; a GPU build cannot plan a CPU run,
// whose attention depends on the CPU its build was compiled for.
kernels::Backend device_option(const std::string& command, const std::string* device);

// Commands that read a config and run the engine (train.cpp). device: validate --device's text,
// null when not given.
int cmd_validate(const ConfigArgs& a, int64_t world_size, const std::string& output_override,
                 const std::string* device, MPI_Comm world);
int cmd_train(const ConfigArgs& a, const std::string& output_override, MPI_Comm world);
// memory_per_rank: --memory-per-rank's text, null when the option is not given.
int cmd_autotune(const ConfigArgs& a, int64_t world_size, bool world_size_given, const std::string* memory_per_rank,
                 MPI_Comm world);
// zero3d eval (train.cpp): the validation loss of a checkpoint, or of a text file's tokens.
struct EvalArgs {
  ConfigArgs config;
  std::string checkpoint, tag;
  std::string text;       // --text: a text file (one document) through the tokenizer, in place of data.validation
  std::string tokenizer;  // --tokenizer; default: data.tokenizer
  bool json = false;
};
int cmd_eval(const EvalArgs& a, MPI_Comm world);
// zero3d generate (generate.cpp): prompts as token ids, generated ids out.
struct GenerateArgs {
  ConfigArgs config;
  std::string checkpoint, tag;
  std::string prompt_ids, prompt_ids_file;  // one prompt ("464,2068,..."), or a file of one per line
  std::string prompt, prompt_file;          // the same as text, through the tokenizer
  std::string tokenizer;                    // --tokenizer; default: data.tokenizer, else model.hf_config's directory
  int64_t batch_size = 8, max_new_tokens = 32, min_new_tokens = 0;
  int64_t micro_batches = 1;  // --micro-batches: groups a batch is cut into over pipeline stages
  double temperature = 1.0, top_p = 1.0;  // Hugging Face GenerationConfig's defaults
  int64_t top_k = 50;
  uint64_t seed = 0;
  bool greedy = false, json = false;
  int64_t eos_id = -1;  // with eos_given: -1 none, else this id; without: the model's (from its config)
  bool eos_given = false;
  std::string inference_config;   // --inference-config: DeepSpeed's init_inference JSON (the `inference` section)
  std::vector<std::string> stop;  // --stop, repeatable: stop strings (escapes \n, \t, \\ as written)
};
int cmd_generate(const GenerateArgs& a, MPI_Comm world);
// Sizing before a run (estimate.cpp).
int cmd_estimate(EstimateArgs a, int rank);
// Layouts and checkpoints, one process (tools.cpp).
int cmd_topology(int64_t pp, int64_t dp, int64_t tp, bool as_json, int rank);
int cmd_inspect(const std::string& dir, const std::string& tag, const std::string& tensor, bool as_json, int rank);
// Text to shards, one process (tokenize.cpp).
int cmd_tokenize(const TokenizeArgs& a, int rank);
// A text file as one document of token ids, as tokenize writes it: the tokenizer's document
// delimiter, then the text's tokens. InputError naming the file and the byte offset of invalid
// UTF-8 (`what` names the option).
std::vector<int32_t> text_file_document(const text::Tokenizer& tok, const std::string& path, const std::string& what);
int cmd_convert(const std::string& dir, const std::string& out, const std::string& tag, const std::string& format,
                const std::string& dtype, const std::string& max_shard, int rank);

}  // namespace zero3d::cli
