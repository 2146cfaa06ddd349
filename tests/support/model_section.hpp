// model_section.hpp — the shape a run builds from a config's "model" section (Hugging Face's
// config.json names: the config reader, then gpt_shape_of), for tests that build a GPT directly.
#pragma once

#include <nlohmann/json.hpp>

#include "config/config.hpp"
#include "config/model_shape.hpp"

namespace zero3d::test_support {

inline GPTShape shape_of_model_section(const nlohmann::json& model) {
  return gpt_shape_of(read_config(nlohmann::json{{"train_batch_size", 1}, {"model", model}}, "model.json", 1).model);
}

}  // namespace zero3d::test_support
