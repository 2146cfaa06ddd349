// checkpoint_format.hpp — internal to the checkpoint module: what saving and loading must agree
// on byte for byte (file names, metadata JSON, digests, the index's hyperslab mapping).
#pragma once

#include <hdf5.h>

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <vector>

#include "io/checkpoint.hpp"

namespace zero3d::ckpt {

inline constexpr const char* kMarker = "zero3d.tag";
inline constexpr const char* kManifest = "manifest.json";

// rank_00007.h5: the shard file written by rank 7.
std::string shard_name(int64_t rank);
std::string errstr(int e);
// A regular file of at most `max_bytes`, whole; InputError naming it otherwise.
std::string read_small_file(const std::string& path, size_t max_bytes);
// Size and XXH64 of a whole file. Load-side failures are bad input, save-side ones system errors.
std::pair<int64_t, uint64_t> file_digest(const std::string& path, bool saving);

nlohmann::json meta_to_json(const CheckpointMeta& m);
CheckpointMeta meta_from_json(const nlohmann::json& j, const std::string& where);
// "" when `ranges` tile [0, total) exactly without overlap, else what is wrong.
std::string tiling_problem(const std::vector<SegmentList>& ranges, int64_t total);
nlohmann::json segments_json(const SegmentList& segs);
// The manifest's own digest: over its JSON without the "xxh64" member.
std::string manifest_digest(nlohmann::json man);

// Elements per chunk of a shard's datasets (4 MiB of fp32), each chunk Fletcher32-checksummed.
constexpr hsize_t kShardChunk = hsize_t(1) << 20;

// One hyperslab of a virtual dataset: [start, start + count) of the tensor, from a shard's 1-D
// dataset: row i of the block (a matrix's) from source elements [src + i·row_stride,
// src + i·row_stride + count[1]); row_stride 0 means rows packed one after the other.
struct Piece {
  std::vector<hsize_t> start, count;
  int64_t src;
  int64_t row_stride = 0;
};

// The source elements of a piece as a (possibly strided) 1-D hyperslab: start, stride, count, block.
struct SourceSlab {
  hsize_t start, stride, count, block;
};
SourceSlab source_slab(const Piece& p);

struct Mapping {
  int64_t shard;
  Piece piece;
  int64_t src_len;
};

// Every piece of tensor t, in shard and segment order: what index.h5 maps and what open() expects.
// coalesce: the rows of one column block of a shard make one piece (a tensor-parallel shard holds
// a column block as one segment per row); without it, one piece per row, as earlier saves mapped.
std::vector<Mapping> mappings_of(const CheckpointMeta& m, const std::vector<std::vector<int64_t>>& offsets,
                                 const std::vector<int64_t>& shape, int64_t off, int64_t numel, bool coalesce = true);
// Per shard, per segment: where the segment starts in the shard's concatenated datasets.
std::vector<std::vector<int64_t>> local_offsets(const std::vector<SegmentList>& ranges);

}  // namespace zero3d::ckpt
