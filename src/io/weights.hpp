// weights.hpp — loading initial weights (model.init_from) by Hugging Face GPT-2 names.
#pragma once

#include <string>

#include "model/buffer.hpp"

namespace zero3d {

// Checks, without reading tensor data, that an HDF5 (.h5/.hdf5) or safetensors (.safetensors)
// file, or a Hugging Face index (.index.json) with its shards, holds exactly the tensors of
// `layout`: each under its name (a "transformer." prefix is accepted) with the same shape and
// a float dtype, and no tensor the model does not have. "lm_head.weight" (tied to wte) and the
// attention-mask buffers of Hugging Face's GPT-2 ("h.N.attn.bias", "h.N.attn.masked_bias") are
// not weights and are ignored. InputError naming the file and the tensors (the first few
// missing or extra names and their count).
void check_weights(const std::string& path, const ParamLayout& layout);

// check_weights, then fills params (layout.total() floats) from the file.
void load_weights(const std::string& path, const ParamLayout& layout, float* params);

// Writes every tensor of `layout` from params to an HDF5 file under its name.
void save_weights_hdf5(const std::string& path, const ParamLayout& layout, const float* params);

}  // namespace zero3d
