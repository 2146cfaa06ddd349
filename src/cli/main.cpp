// main.cpp — the command line (CLI11): parses it, runs one subcommand (commands.hpp), and is the
// one place that catches errors and sets the exit code.
//
// Exit codes: 0 success, 2 bad input (one message, from rank 0), 1 system/internal failure
// (message names the failing rank; the job is aborted so that no rank hangs).
#include <mpi.h>

#include <CLI/CLI.hpp>
#include <Kokkos_Core.hpp>
#include <chrono>
#include <cstdio>
#include <new>
#include <string>
#include <thread>

#include "base/errors.hpp"
#include "base/failure.hpp"
#include "base/input_file.hpp"
#include "cli/commands.hpp"
#include "io/h5.hpp"
#include "kernels/device.hpp"
#include "train/job_control.hpp"

using namespace zero3d;
using namespace zero3d::cli;

namespace {

// A failure's message for the user: allocation failures (std::bad_alloc, Kokkos's "Allocation
// of size … failed" over several lines) say so plainly in one line.
std::string failure_text(const std::string& what) {
  const bool kokkos = what.find("Allocation of size") != std::string::npos;
  if (!kokkos && what != std::bad_alloc().what() && what != std::bad_array_new_length().what()) return what;
  std::string line;
  for (char c : what) line += (c == '\n' || c == '\t') ? ' ' : c;
  return "out of memory: an allocation failed (" + echo(line, 240) + "); `zero3d estimate --config` shows what "
         "the run needs per rank";
}

}  // namespace

int main(int argc, char** argv) {
  // job_control.hpp: a scheduler's SIGTERM/SIGUSR1 during start-up is held, never fatal or lost.
  hold_preemption_signals();
  supervise_rank(argv);  // failure.hpp: names this rank if it is killed; before MPI_Init
  fault_pause_point("launch");  // failure.hpp: ZERO3D_FAULT=startup_pause, for the start-up signal tests
  // The watchdog thread may call MPI_Abort while the main thread waits in a collective.
  int thread_level = MPI_THREAD_SINGLE;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &thread_level);
  int rank = 0, world = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &world);
  install_mpi_error_handler(MPI_COMM_WORLD);  // failure.hpp: an MPI error is one line, exit 1
  h5::quiet_errors();
  fault_pause_point("mpi");
  accept_preemption_signals();  // MPI_Init may have replaced the handler; a held signal counts now

  CLI::App app{"zero3d — DeepSpeed-style ZeRO training of GPT models, without Python", "zero3d"};
  app.set_version_flag("--version", std::string("zero3d ") + ZERO3D_VERSION + " (commit " + ZERO3D_COMMIT + "; " +
                                        kernels::backend_name() + ")");
  app.require_subcommand(1);

  ConfigArgs train_args, validate_args;
  std::string output_dir;
  int64_t world_size = world;
  auto* train = app.add_subcommand("train", "Train a model described by a DeepSpeed-style JSON config");
  train->add_option("config", train_args.path, "config file (default: the built-in quick-start)");
  train->add_option("--set", train_args.overrides, "override a key: --set optimizer.params.lr=1e-3")->take_all();
  const std::string strategy_help = "a Lightning DeepSpeed strategy preset beneath the config's keys (deepspeed, "
                                    "deepspeed_stage_1, _2, _2_offload, _3, _3_offload, _3_offload_nvme)";
  train->add_option("--strategy", train_args.strategy, strategy_help);
  train->add_option("--output", output_dir, "output directory (default: training.output_dir or output/<config name>)");
  ConfigArgs tune_args;
  int64_t tune_world = world;
  std::string tune_memory;
  auto* tune = app.add_subcommand("autotune", "DeepSpeed's autotuner on this job's ranks: writes results_dir, exps_dir "
                                              "and ds_config_optimal.json");
  tune->add_option("config", tune_args.path, "config file (its autotuning section)")->required();
  tune->add_option("--world-size", tune_world, "ranks in all: must be the job's (experiments run on them)")
      ->check(CLI::Range(int64_t(1), kMaxRanks));
  tune->add_option("--set", tune_args.overrides, "override a key")->take_all();
  tune->add_option("--strategy", tune_args.strategy, "a Lightning DeepSpeed strategy preset beneath the config's keys");
  tune->add_option("--memory-per-rank", tune_memory, "memory each rank may use (e.g. 4GiB; default: available memory "
                                                     "÷ ranks on the node): the planner prunes what does not fit");
  auto* validate = app.add_subcommand("validate", "Check a config without training; exit 0 or 2");
  validate->add_option("config", validate_args.path, "config file")->required();
  validate->add_option("--world-size", world_size, "ranks in all (pipeline stages x data-parallel x tensor-parallel) to check the config against")
      ->check(CLI::Range(int64_t(1), kMaxRanks));
  validate->add_option("--set", validate_args.overrides, "override a key")->take_all();
  validate->add_option("--strategy", validate_args.strategy, strategy_help);
  std::string validate_output;  // checked as train's --output would be
  validate->add_option("--output", validate_output, "the output directory train would use (default: training.output_dir or "
                                                    "output/<config name>)");
  std::string validate_device;
  auto* validate_device_option = validate->add_option(
      "--device", validate_device, "check for a cpu or gpu build (default: this build's); a CPU build checks a GPU run with gpu");
  int64_t pp = 1, dp = 1, tp = 1;
  bool as_json = false;
  auto* topology = app.add_subcommand("topology", "Print each rank's coordinates and process groups");
  topology->add_option("--pp", pp, "pipeline-parallel size")->check(CLI::Range(int64_t(1), kMaxRanks));
  topology->add_option("--dp", dp, "data-parallel size")->check(CLI::Range(int64_t(1), kMaxRanks));
  topology->add_option("--tp", tp, "tensor-parallel size")->check(CLI::Range(int64_t(1), kMaxRanks));
  topology->add_flag("--json", as_json, "machine-readable output");

  std::string ck_dir, ck_tag, ck_tensor, ck_out, ck_format, ck_dtype = "fp32", ck_shard;
  bool ck_json = false;
  auto* inspect = app.add_subcommand("inspect", "Show a checkpoint's tags, metadata and tensors; verify checksums");
  inspect->add_option("dir", ck_dir, "checkpoint directory (save_dir or one tag)")->required();
  inspect->add_option("--tag", ck_tag, "tag to inspect (default: latest)");
  inspect->add_option("--tensor", ck_tensor, "only this tensor (Hugging Face name)");
  inspect->add_flag("--json", ck_json, "machine-readable output");
  EvalArgs ev;
  auto* eval = app.add_subcommand("eval", "Validation loss and perplexity of a checkpoint (data.validation, or a "
                                          "text file)");
  eval->add_option("config", ev.config.path, "config file (its data.validation is evaluated)")->required();
  eval->add_option("--checkpoint", ev.checkpoint, "save directory (its latest tag) or tag directory; default: "
                                                 "the config's initial weights");
  eval->add_option("--tag", ev.tag, "tag in --checkpoint (default: latest)");
  eval->add_option("--text", ev.text, "a text file (one document) through the tokenizer, in place of data.validation");
  eval->add_option("--tokenizer", ev.tokenizer, "the tokenizer of --text (default: data.tokenizer)");
  eval->add_option("--set", ev.config.overrides, "override a key")->take_all();
  eval->add_flag("--json", ev.json, "end with one JSON line: step, eval_loss, eval_ppl, samples, tokens");
  GenerateArgs gen;
  auto* generate = app.add_subcommand("generate", "Generate tokens from a checkpoint: prompts as token ids, a KV "
                                                  "cache, sampling as Hugging Face's generate");
  generate->add_option("config", gen.config.path, "config file (its model)")->required();
  generate->add_option("--checkpoint", gen.checkpoint, "save directory (its latest tag) or tag directory; default: "
                                                       "the config's initial weights");
  generate->add_option("--tag", gen.tag, "tag in --checkpoint (default: latest)");
  generate->add_option("--prompt-ids", gen.prompt_ids, "one prompt: token ids, \"464,2068,...\"");
  generate->add_option("--prompt-ids-file", gen.prompt_ids_file, "prompts, one a line (token ids)");
  generate->add_option("--prompt", gen.prompt, "one prompt as text (through the tokenizer)");
  generate->add_option("--prompt-file", gen.prompt_file, "prompts as text, one a line");
  generate->add_option("--tokenizer", gen.tokenizer, "tokenizer.json, a SentencePiece .model, or a directory with one "
                                                     "(default: data.tokenizer, else model.hf_config's directory)");
  generate->add_option("--batch-size", gen.batch_size, "prompts generated together, left-padded (default 8)");
  generate->add_option("--micro-batches", gen.micro_batches,
                       "with pipeline stages: groups each batch is cut into, one behind another through the stages "
                       "(default 1)");
  generate->add_option("--max-new-tokens", gen.max_new_tokens, "new tokens per prompt at most (default 32)");
  generate->add_option("--min-new-tokens", gen.min_new_tokens, "no EOS before this many new tokens (default 0)");
  generate->add_option("--temperature", gen.temperature, "divides the logits (> 0; default 1)");
  generate->add_option("--top-k", gen.top_k, "keep the k most likely tokens (0: all; default 50)");
  generate->add_option("--top-p", gen.top_p, "keep the smallest set with this probability (0 < p <= 1; default 1)");
  generate->add_option("--seed", gen.seed, "sampling seed (default 0)");
  generate->add_flag("--greedy", gen.greedy, "the most likely token at every step (argmax)");
  generate->add_option("--eos-id", gen.eos_id, "the id that ends a sequence (-1: none; default: the model's)");
  generate->add_option("--inference-config", gen.inference_config,
                       "DeepSpeed's init_inference JSON (dtype, tensor_parallel, max_out_tokens, ...): the config's "
                       "`inference` section");
  generate->add_option("--stop", gen.stop, "end a sequence where its text holds this (repeatable; \\n, \\t, \\\\ "
                                           "are a newline, a tab, a backslash; needs a tokenizer)")
      ->allow_extra_args(false)
      ->take_all();
  generate->add_option("--set", gen.config.overrides, "override a key")->take_all();
  generate->add_flag("--json", gen.json, "end with one JSON line: outputs, speeds");
  auto* convert = app.add_subcommand("convert", "Consolidate a checkpoint into Hugging Face-named weights");
  convert->add_option("dir", ck_dir, "checkpoint directory (save_dir or one tag)")->required();
  convert->add_option("out", ck_out, "output file: .safetensors, .h5 or .hdf5 (config.json goes beside it)")->required();
  convert->add_option("--tag", ck_tag, "tag to convert (default: latest)");
  convert->add_option("--format", ck_format, "hdf5 or safetensors (default: from the output file's extension)")
      ->check(CLI::IsMember({"hdf5", "safetensors"}));
  convert->add_option("--dtype", ck_dtype, "fp32, bf16 or fp16")->check(CLI::IsMember({"fp32", "bf16", "fp16"}));
  convert->add_option("--max-shard-size", ck_shard, "split into files of at most this size (e.g. 5GB)");

  TokenizeArgs tk;
  auto* tokenize = app.add_subcommand("tokenize", "Text files to llm.c token shards (uint16 or uint32 by vocabulary)");
  tokenize->add_option("files", tk.files, "plain text files (one document each) or .jsonl files (one per line)")
      ->required();
  tokenize->add_option("--tokenizer", tk.tokenizer, "tokenizer.json, a SentencePiece .model, or a directory holding "
                                                    "one (or GPT-2's encoder.json + vocab.bpe)")->required();
  tokenize->add_option("--out", tk.out, "directory for the shards (created)")->required();
  tokenize->add_option("--name", tk.name, "shard file prefix: <name>_val_000000.bin, <name>_train_000001.bin, ... "
                                          "(default: the --out directory's name)");
  tokenize->add_option("--shard-size", tk.shard_size, "tokens per shard at most (default 100000000, llm.c's)");
  tokenize->add_option("--val-fraction", tk.val_fraction, "the first round(F x all tokens) tokens are the validation "
                                                          "split, shard 0 (default 0.1; 0 <= F < 1)");
  tokenize->add_option("--field", tk.field, "the text field of each JSON Lines record (default: text)");

  EstimateArgs est;
  est.world_size = world;
  auto* estimate = app.add_subcommand("estimate", "Memory per rank: DeepSpeed's tables (zero2/zero3) or a full budget");
  estimate->add_option("kind", est.kind, "zero2 or zero3 for DeepSpeed's model-state tables");
  estimate->add_option("--params", est.params, "total parameters (cold estimate)");
  estimate->add_option("--largest-layer-params", est.largest_layer, "parameters of the largest layer (zero3)");
  estimate->add_option("--gpus-per-node", est.gpus_per_node, "GPUs per node")->check(CLI::Range(1, int(kMaxRanks)));
  estimate->add_option("--nodes", est.nodes, "nodes")->check(CLI::Range(1, int(kMaxRanks)));
  estimate->add_option("--additional-buffer-factor", est.buffer_factor, "DeepSpeed's buffer factor (1.5)");
  estimate->add_option("--model", est.model, "take the counts from this config's model (live estimate)");
  estimate->add_option("--config", est.config.path, "the full per-rank budget of this configuration");
  estimate->add_option("--set", est.config.overrides, "override a key of --config (or of --model)")->take_all();
  estimate->add_option("--strategy", est.config.strategy, strategy_help);
  estimate->add_option("--world-size", est.world_size, "ranks in all (pipeline stages x data-parallel x tensor-parallel)")
      ->check(CLI::Range(int64_t(1), kMaxRanks));
  estimate->add_option("--memory-per-rank", est.memory_per_rank,
                       "find the largest micro-batch that fits (e.g. 16GiB; a GPU's memory per rank on a GPU build "
                       "or with --device gpu)");
  estimate->add_option("--report", est.report, "write the budget to this HDF5 file");
  estimate->add_option("--ranks-per-node", est.ranks_per_node,
                       "ranks per node for the bytes per step by link and qgZ's staging (default: every rank on one node)")
      ->check(CLI::Range(int64_t(1), int64_t(kMaxRanks)));
  estimate->add_option("--step", est.step, "the optimizer step whose bytes are reported (a 1-bit optimizer's phases; "
                                          "default 1)")
      ->check(CLI::Range(int64_t(1), kMaxEstimateSteps));
  estimate->add_option("--step-range", est.step_range,
                       "FIRST-LAST: the steps whose bytes are averaged, by phase (default 1 to training.steps)");
  estimate->add_flag("--json", est.json, "machine-readable output");
  estimate->add_option("--device", est.device,
                       "plan for a cpu or gpu build (default: this build's); a CPU build plans a GPU run with gpu");

  int code = kExitOk;
  bool kokkos_started = false;
  try {
    app.parse(argc, argv);
    if (!train->parsed()) default_preemption_signals();  // only train stops at a step boundary
    for (const CLI::Option* o : estimate->get_options())
      if (o->count() > 0 && !o->get_name().empty() && o->get_name()[0] == '-') est.given.insert(o->get_name());
    // The kernels' backend starts once the command line is known (--help and --version need
    // none): a GPU build without a visible GPU stops here, exit 2, one message, except for the
    // commands that only plan (validate, estimate, topology) or prepare data (tokenize), which
    // run on a login node without Kokkos: sizing a job or its data needs no GPU.
    const bool plans_only = validate->parsed() || estimate->parsed() || topology->parsed() || tokenize->parsed();
    const bool device_missing = kernels::kGpuBuild && !kernels::device_problem().empty();
    if (!(plans_only && device_missing)) {
      run_collectively(MPI_COMM_WORLD, [] {
        const std::string why = kernels::device_problem();
        if (!why.empty()) throw InputError(why);
      });
      kernels::initialize_backend(local_rank(MPI_COMM_WORLD), argv);
      kokkos_started = true;
    }
    if (train->parsed()) code = cmd_train(train_args, output_dir, MPI_COMM_WORLD);
    else if (validate->parsed()) code = cmd_validate(validate_args, world_size, validate_output,
                                                 validate_device_option->count() > 0 ? &validate_device : nullptr,
                                                 MPI_COMM_WORLD);
    else if (tune->parsed())
      code = cmd_autotune(tune_args, tune_world, tune->count("--world-size") > 0,
                          tune->count("--memory-per-rank") > 0 ? &tune_memory : nullptr, MPI_COMM_WORLD);
    else if (topology->parsed()) {
      // Under `mpirun -np N` the data-parallel size defaults to what the job's ranks leave.
      if (topology->count("--dp") == 0 && world > 1)
        run_collectively(MPI_COMM_WORLD, [&] {  // one message, from rank 0
          if (world % (pp * tp) != 0)
            throw InputError("topology: " + std::to_string(world) + " ranks do not divide into --pp " +
                             std::to_string(pp) + " x --tp " + std::to_string(tp));
          dp = world / (pp * tp);
        });
      code = cmd_topology(pp, dp, tp, as_json, rank);
    }
    else if (estimate->parsed()) code = cmd_estimate(est, rank);
    else if (inspect->parsed()) code = cmd_inspect(ck_dir, ck_tag, ck_tensor, ck_json, rank);
    else if (eval->parsed()) code = cmd_eval(ev, MPI_COMM_WORLD);
    else if (tokenize->parsed()) code = cmd_tokenize(tk, rank);
    else if (generate->parsed()) {
      gen.eos_given = generate->count("--eos-id") > 0;
      code = cmd_generate(gen, MPI_COMM_WORLD);
    }
    else if (convert->parsed())
      code = cmd_convert(ck_dir, ck_out, ck_tag, ck_format, ck_dtype, ck_shard, rank);
  } catch (const CLI::ParseError& e) {
    default_preemption_signals();
    // --help and --version are "errors" with exit code 0 in CLI11.
    if (rank == 0) {
      // CLI11 echoes the offending argument raw: escape and cap it like every other message.
      // A mistyped command reaches CLI11 as a stray positional: name it and the commands.
      const bool unknown_command = argc > 1 && argv[1][0] != '-' && app.get_subcommands().empty();
      if (e.get_exit_code() == 0) app.exit(e);
      else if (unknown_command) {
        std::string names;
        for (const CLI::App* sub : app.get_subcommands({})) names += (names.empty() ? "" : ", ") + sub->get_name();
        std::fprintf(stderr, "zero3d: error: unknown command `%s` (commands: %s; see --help)\n",
                     echo(argv[1], 80).c_str(), names.c_str());
      } else std::fprintf(stderr, "zero3d: error: %s (see --help)\n", echo(e.what(), 300).c_str());
    }
    code = e.get_exit_code() == 0 ? kExitOk : kExitBadInput;
  } catch (const AgreedFailure& e) {
    // Every rank knows; one reports. (Bad config: all ranks fail alike and rank 0 reports.)
    if (e.report()) {
      const char* kind = e.code() == kExitBadInput ? "error" : "fatal";
      const std::string what = failure_text(e.what());
      if (e.failed_rank() == 0) std::fprintf(stderr, "zero3d: %s: %s\n", kind, what.c_str());
      else std::fprintf(stderr, "zero3d: rank %d: %s: %s\n", e.failed_rank(), kind, what.c_str());
    }
    code = e.code();
  } catch (const std::exception& e) {
    // Not agreed: the other ranks may be waiting for this one, so take the job down.
    const bool bad_input = dynamic_cast<const InputError*>(&e) != nullptr;
    code = bad_input ? kExitBadInput : kExitSystem;
    // "zero3d: error:" as everywhere; a rank is named only where there are several to tell apart.
    const std::string who = world > 1 ? "rank " + std::to_string(rank) + ": " : "";
    std::fprintf(stderr, "zero3d: %s%s: %s\n", who.c_str(), bad_input ? "error" : "fatal", failure_text(e.what()).c_str());
    std::fflush(stderr);
    note_exit(code);  // failure.hpp: the message is out; the supervisor adds none
    if (world > 1) {
      // Give the launcher a moment to forward the message before it tears the job down.
      std::this_thread::sleep_for(std::chrono::milliseconds(300));
      abort_job(code);  // failure.hpp: without MPICH's own abort line after ours
    }
  }
  std::fflush(stdout);
  if (kokkos_started) Kokkos::finalize();
  MPI_Finalize();
  note_exit(code);
  return code;
}
