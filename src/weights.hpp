// weights.hpp — loading initial weights (model.init_from) by Hugging Face GPT-2 names.
#pragma once

#include <string>

#include "buffer.hpp"

namespace zero3d {

// Fills params from an HDF5 (.h5/.hdf5) or safetensors (.safetensors) file. Each tensor of
// `layout` must be present under its name (a "transformer." prefix is accepted) with the
// same shape; "lm_head.weight" is ignored (tied to wte). Errors name the file and tensor.
void load_weights(const std::string& path, const ParamLayout& layout, float* params);

// Writes every tensor of `layout` from params to an HDF5 file under its name.
void save_weights_hdf5(const std::string& path, const ParamLayout& layout, const float* params);

}  // namespace zero3d
