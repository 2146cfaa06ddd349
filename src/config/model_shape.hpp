// model_shape.hpp — the model a `model` section describes, as the model code takes it: what the
// engine builds, the planner counts, AutoTP's rules are checked against and `zero3d convert`
// checks a checkpoint's tensors against.
#pragma once

#include "config/config.hpp"
#include "model/model.hpp"

namespace zero3d {

GPTShape gpt_shape_of(const ModelConfig& model);

}  // namespace zero3d
