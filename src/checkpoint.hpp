// checkpoint.hpp — sharded HDF5 checkpoints (DESIGN.md §1 "Checkpoint").
//
// <save_dir>/latest                  text: the newest complete tag
// <save_dir>/global_step<N>/
//     rank_00000.h5 ...              one shard per rank: its slice [begin, end) of each flat
//                                    state buffer ("params" = fp32 master, "exp_avg", ...),
//                                    chunked, Fletcher32-checksummed, metadata as attributes
//     index.h5                       metadata + one HDF5 virtual dataset per tensor, named as in
//                                    Hugging Face GPT-2 ("/h.0.attn.c_attn.weight"), stitched
//                                    from the shards; optimizer moments under /exp_avg/, ...
//
// Saving writes into <tag>.tmp/, closes and fsyncs every file, then rank 0 renames the
// directory and replaces `latest` by write-then-rename: a save that dies at any moment leaves
// the previous checkpoint and `latest` as they were (a stale .tmp is removed by the next save).
// Loading reads, on each rank, only the byte ranges of the flat buffers that rank needs, so a
// checkpoint loads at any data-parallel size and ZeRO stage.
#pragma once

#include <mpi.h>

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "buffer.hpp"

namespace zero3d {

constexpr int kCheckpointFormatVersion = 1;

struct CheckpointMeta {
  int64_t step = 0;            // optimizer steps taken
  int64_t global_samples = 0;
  int64_t zero_stage = 0;
  int64_t dp_world_size = 1;
  int64_t optimizer_step = 0;  // Adam's bias-correction counter
  int64_t lr_last_batch_iteration = -1;
  int64_t micro_batch = 0, gradient_accumulation_steps = 0;
  int64_t data_position = 0;   // samples consumed (the next sample number)
  uint64_t seed = 0;
  std::string optimizer_type;  // "Adam", "Lamb", "SGD"
  std::string dtype = "fp32";        // of the saved parameters (the master copy): always fp32
  std::string model_dtype = "fp32";  // what the run trained in: fp32, bf16 or fp16
  int64_t skipped_steps = 0;         // overflow-skipped optimizer steps so far
  nlohmann::json loss_scaler = {{"dynamic", false}, {"cur_scale", 1.0}};  // LossScalerState fields
  nlohmann::json config;       // the resolved configuration of the run that saved
  nlohmann::json tensors;      // [{"name", "shape", "offset"}] of the layout
  int64_t total_params = 0;
  std::vector<std::pair<int64_t, int64_t>> ranges;  // per shard: [begin, end) of the flat buffers
  std::vector<std::string> states;                  // flat buffers saved: "params", "exp_avg", ...
};

// One rank's part of a save: the slice [begin, end) of each named flat buffer.
struct ShardSlice {
  int64_t begin = 0, end = 0;
  std::vector<std::pair<std::string, const float*>> arrays;  // name -> first element of the slice
};

// Collective over `world`. Writes <save_dir>/<tag> atomically, then rotates to `keep_last`
// complete tags (0 keeps all). Errors are agreed on all ranks and leave the old checkpoint.
void save_checkpoint(const std::string& save_dir, const std::string& tag, const CheckpointMeta& meta,
                     const ShardSlice& mine, const ParamLayout& layout, MPI_Comm world, int64_t keep_last);

// An opened, validated checkpoint tag.
class CheckpointReader {
 public:
  // spec: "latest" (the tag named by <save_dir>/latest), a tag in save_dir, or a path to a tag
  // directory or to a save directory holding `latest`. InputError naming what is wrong.
  static CheckpointReader open(const std::string& spec, const std::string& save_dir);

  const CheckpointMeta& meta() const { return meta_; }
  const std::string& dir() const { return dir_; }
  // Elements [begin, end) of flat buffer `state`, from the shards that hold them only.
  void read_range(const std::string& state, int64_t begin, int64_t end, float* out) const;
  // InputError unless the checkpoint's tensors are exactly `layout`'s (names, shapes, order).
  void check_layout(const ParamLayout& layout) const;

 private:
  std::string dir_;
  CheckpointMeta meta_;
};

// Names of complete tags in save_dir, oldest first (by step).
std::vector<std::string> list_checkpoint_tags(const std::string& save_dir);

// `zero3d inspect`: a report of tags, metadata and per-tensor statistics; verifies that every
// shard is present and every checksum holds. Returns the report; InputError on any defect.
nlohmann::json inspect_checkpoint(const std::string& path, const std::string& tag, const std::string& tensor);

// `zero3d convert`: consolidated weights with Hugging Face names, streamed one tensor at a time.
// format "hdf5" | "safetensors"; dtype "fp32" | "bf16"; max_shard_bytes 0 = one file. Returns
// the files written (the index JSON last when sharded).
std::vector<std::string> convert_checkpoint(const std::string& path, const std::string& tag, const std::string& out,
                                            const std::string& format, const std::string& dtype,
                                            int64_t max_shard_bytes);

// "5GB" = 5e9, "500MB", "2GiB" = 2·2^30, "1000" bytes. InputError on anything else.
int64_t parse_byte_size(const std::string& text);

}  // namespace zero3d
