// model_shape.hpp — the model a config's model section describes, as the model layer's
// GPTShape: what the engine builds, the planner counts, AutoTP matches its rules against and a
// checkpoint's tensors are checked against.
#pragma once

#include "config/config.hpp"
#include "model/model.hpp"

namespace zero3d {

GPTShape gpt_shape_of(const ModelConfig& model);

}  // namespace zero3d
