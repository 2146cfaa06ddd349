// checkpoint.hpp — sharded HDF5 checkpoints (DESIGN.md §1 "Checkpoint").
//
// <save_dir>/latest                  text: the newest complete tag
// <save_dir>/zero3d.family           text: this save directory's run-family id (first save makes it)
// <save_dir>/global_step<N>/
//     zero3d.tag                     JSON marker: a zero3d tag of run family F, tag id I. Cleanup
//                                    and rotation only ever touch directories that carry the
//                                    marker of their own family: nothing else in save_dir.
//     rank_00000.h5 ...              one shard per rank: its segments (global ranges [b, e) of the
//                                    flat state buffers, any number, possibly none) of each flat
//                                    buffer ("params" = fp32 master, "exp_avg", ...), concatenated
//                                    in one 1-D dataset per buffer; chunked, Fletcher32-checksummed
//     index.h5                       metadata JSON + one HDF5 virtual dataset per tensor, named as in
//                                    Hugging Face GPT-2 ("/h.0.attn.c_attn.weight"), stitched from
//                                    every segment covering it; optimizer moments under /exp_avg/, ...
//     manifest.json                  binds the tag's files together: tag id, run family, size and
//                                    XXH64 digest of every file, digest of the metadata JSON, and
//                                    its own digest. Written last: a tag without it is incomplete.
//
// Format 2 (segments, manifest) loads format 1 too (one range per shard, no manifest).
//
// Saving writes into <tag>.tmp/, checks every write and close, fsyncs every file, then rank 0
// publishes: an existing <tag> is renamed to <tag>.old.tmp, <tag>.tmp to <tag>, `latest` is
// replaced by write-fsync-rename, and only then is <tag>.old.tmp removed and `keep_last`
// applied. A save killed at any moment leaves `latest` naming a loadable tag: a reader whose
// tag is missing falls back to a complete <tag>.old.tmp, and the next save restores it.
// Loading verifies the manifest (and, lazily, the digest of every file a rank reads) and reads,
// on each rank, only the ranges it needs, so a checkpoint loads at any data-parallel size and
// ZeRO stage.
#pragma once

#include <mpi.h>

#include <cstdint>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "base/xxh64.hpp"
#include "model/buffer.hpp"

namespace zero3d {

constexpr int kCheckpointFormatVersion = 2;

using SegmentList = std::vector<std::pair<int64_t, int64_t>>;  // global [begin, end) ranges

struct CheckpointMeta {
  int64_t step = 0;            // optimizer steps taken
  int64_t global_samples = 0;
  int64_t zero_stage = 0;
  int64_t dp_world_size = 1;
  int64_t pipe_size = 1, tensor_size = 1;  // the saving run's pipeline stages and tensor-parallel size
  int64_t optimizer_step = 0;  // Adam's bias-correction counter
  int64_t lr_last_batch_iteration = -1;
  int64_t micro_batch = 0, gradient_accumulation_steps = 0;
  int64_t data_position = 0;   // samples consumed (the next sample number)
  uint64_t seed = 0;
  std::string optimizer_type;  // the state family: "Adam" (Adam and AdamW), "Lamb", "SGD"
  // The update rule: "AdamW" (decoupled weight decay) or "Adam" (L2 decay in the gradient) for
  // the Adam family, else the family; empty in checkpoints written before it was recorded.
  std::string update_rule;
  std::string optimizer_name;  // optimizer.type as the config wrote it
  std::string dtype = "fp32";        // of the saved parameters (the master copy): always fp32
  std::string model_dtype = "fp32";  // what the run trained in: fp32, bf16 or fp16
  int64_t skipped_steps = 0;         // overflow-skipped optimizer steps so far
  nlohmann::json loss_scaler = {{"dynamic", false}, {"cur_scale", 1.0}};  // LossScalerState fields
  nlohmann::json config;       // the resolved configuration of the run that saved
  nlohmann::json tensors;      // [{"name", "shape", "offset"}] of the layout
  int64_t total_params = 0;
  // Per shard: its segments. save_checkpoint gathers them from the ranks' ShardSlices itself.
  std::vector<SegmentList> ranges;
  std::vector<std::string> states;  // flat buffers saved: "params", "exp_avg", ...
  std::string tag_id;               // random per save (format 2); filled by save and load
};

// One global range [begin, end) of the flat buffers and where this rank holds it.
struct ShardSegment {
  int64_t begin = 0, end = 0;
  // name -> first element of [begin, end), in model memory (device memory on a GPU build)
  std::vector<std::pair<std::string, const float*>> arrays;
};

// State only one rank holds (no range of the flat buffers): LoCo's kept errors (parallel/
// quantized_reduce_scatter.hpp LocoState). In the rank's shard: text <name> (its meta) and the
// datasets <name>_codes (int8) and <name>_scales (fp32). Read back by the same rank only.
struct RankState {
  std::string name, meta;
  std::vector<int8_t> codes;
  std::vector<float> scales;
};

// One rank's part of a save: any number of segments (none is allowed). Every segment names the
// same buffers (meta.states); the segments of all ranks must tile [0, total_params).
struct ShardSlice {
  std::vector<ShardSegment> segments;
  std::vector<RankState> rank_state;
};

// Collective over `world`. Writes <save_dir>/<tag> atomically, then rotates to `keep_last`
// complete tags of this run family (0 keeps all). Errors are agreed on all ranks (exit 1, one
// message naming the file) and leave the old checkpoint and `latest` as they were.
// node_local (checkpoint.use_node_local_storage): save_dir is each node's own storage; the first
// rank of every node creates and publishes the tag there (index.h5 and the manifest name every
// rank's shard; the node's directory holds its own ranks' shards).
void save_checkpoint(const std::string& save_dir, const std::string& tag, const CheckpointMeta& meta,
                     const ShardSlice& mine, const ParamLayout& layout, MPI_Comm world, int64_t keep_last,
                     bool node_local = false);

// An opened, verified checkpoint tag. open() runs the one verification shared by resume and
// `inspect`: manifest and its digest, index.h5's digest and structure (one virtual dataset of
// the right shape per tensor and state, mapped from the shards), the metadata's digest and
// consistency (segments tile the buffers, optimizer type and states agree, tensor offsets),
// every shard present with its recorded size. Shard contents are verified against their
// digests when first read (read_range) or all at once (verify_files). InputError naming the file.
class CheckpointReader {
 public:
  // spec: "latest" (the tag named by <save_dir>/latest), a tag in save_dir, or a path to a tag
  // directory or to a save directory holding `latest`.
  // node_local: shards the manifest lists but this node's directory lacks were written on another
  // node (checkpoint.use_node_local_storage); read_range fails naming them only if it needs one.
  static CheckpointReader open(const std::string& spec, const std::string& save_dir, bool node_local = false);

  const CheckpointMeta& meta() const { return meta_; }
  const std::string& dir() const { return dir_; }
  // Elements [begin, end) of flat buffer `state`, from the shards whose segments cover them.
  void read_range(const std::string& state, int64_t begin, int64_t end, float* out) const;
  // Shard `rank`'s RankState `name`; nullopt when that shard holds none.
  std::optional<RankState> read_rank_state(int64_t rank, const std::string& name) const;
  // InputError unless the checkpoint's tensors are exactly `layout`'s (names, shapes, order).
  void check_layout(const ParamLayout& layout) const;
  // InputError unless the saved model section agrees with `model_section` (n_head, ... — what
  // tensor shapes do not show); init_from is not compared.
  void check_model(const nlohmann::json& model_section) const;
  // Digest of every file the manifest lists (format 2); InputError naming the first that differs.
  void verify_files() const;
  bool has_manifest() const { return !manifest_.is_null(); }

 private:
  void verify_file(const std::string& name) const;
  std::string dir_;
  CheckpointMeta meta_;
  nlohmann::json manifest_;                          // null for format 1
  std::vector<std::vector<int64_t>> local_offsets_;  // per shard, per segment: offset in its datasets
  mutable std::set<std::string> verified_;           // files whose digest was checked
  std::set<std::string> absent_;                     // node-local storage: shards on other nodes
};

// Whether this rank is the first (by rank) of the ranks sharing its node's memory
// (MPI_COMM_TYPE_SHARED): the one that publishes a node-local checkpoint. Collective over world.
bool is_first_rank_of_node(MPI_Comm world);

// Names of complete tags in save_dir, oldest first (by step).
std::vector<std::string> list_checkpoint_tags(const std::string& save_dir);

// N of a tag named global_step<N> (what saves are named); -1 for any other name.
int64_t tag_step(const std::string& tag);

// Before a run writes anything (train and validate call it): InputError when its saves would
// replace what is not theirs to replace. resumed_step: the step of the tag the run resumes from,
// or -1 for a run that starts fresh; last_step: training.steps. Rejected: a global_step<N> the
// run will save (N past resumed_step, up to last_step) that carries no zero3d.tag marker of
// save_dir's run family (found now, not at step N's save); for a fresh run, an earlier run's
// checkpoints (`latest`, its tags), which its saves would overwrite.
void check_save_dir_before_run(const std::string& save_dir, int64_t resumed_step, int64_t last_step);

// Rank 0 at start-up: a re-save killed between moving its tag aside and publishing leaves
// `latest` naming a missing directory (zero3d reads the copy aside; other tools do not): the
// complete copy of this save_dir's run family goes back in place. Nothing else is touched.
void restore_interrupted_resave(const std::string& save_dir);

// Whether save_dir holds a `latest` (what training.resume "auto" resumes from).
bool checkpoint_exists(const std::string& save_dir);

// `zero3d inspect`: a report of tags, metadata and per-tensor statistics; verifies the tag as
// resume does, every file's digest, every shard checksum, and that index.h5's virtual datasets
// return what the shards hold. Returns the report; InputError on any defect.
nlohmann::json inspect_checkpoint(const std::string& path, const std::string& tag, const std::string& tensor);

// `zero3d convert`: consolidated weights with Hugging Face names, streamed one tensor at a time,
// and a Hugging Face config.json beside them (GPT2Config; LlamaConfig, MistralConfig or
// Qwen2Config for the Llama family, read back from the checkpoint's saved model section); every
// weights file records the model shape (safetensors __metadata__, HDF5 attributes). format "hdf5" | "safetensors" | "" (from
// the extension of `out`: .safetensors, .h5, .hdf5); dtype "fp32" | "bf16" | "fp16";
// max_shard_bytes 0 = one file, else shards named as Hugging Face names them
// (model-00001-of-00003.safetensors + model.safetensors.index.json). Files are written under a
// temporary name and renamed when all are complete; then files of an earlier convert to the
// same name that this one did not write (shards of another count, the index or the single file)
// are removed. A config.json that is not a Hugging Face config is never overwritten (InputError).
struct ConvertResult {
  std::vector<std::string> written;  // weights, then the index (when sharded), then config.json
  std::vector<std::string> removed;  // stale outputs of an earlier convert
};
ConvertResult convert_checkpoint(const std::string& path, const std::string& tag, const std::string& out,
                                 const std::string& format, const std::string& dtype, int64_t max_shard_bytes);

// "5GB" = 5e9, "500MB", "2GiB" = 2·2^30, "1000" bytes. InputError on anything else.
// option: the command-line option named in messages (default: `size "TEXT"`).
int64_t parse_byte_size(const std::string& text, const std::string& option = "");


}  // namespace zero3d
