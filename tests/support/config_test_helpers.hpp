// config_test_helpers.hpp — reading a config in-process for the config unit tests.
#pragma once

#include <nlohmann/json.hpp>
#include <string>

#include "base/errors.hpp"
#include "config/config.hpp"

namespace config_test {

// The smallest config that reads: the batch triad at 2 data-parallel ranks.
inline nlohmann::json minimal() {
  return nlohmann::json{{"train_batch_size", 32}, {"train_micro_batch_size_per_gpu", 16}};
}

// The message of the InputError that reading `j` raises ("" if it is accepted).
inline std::string error_of(const nlohmann::json& j, int64_t world = 2) {
  try {
    zero3d::read_config(j, "cfg.json", world);
  } catch (const zero3d::InputError& e) {
    return e.what();
  }
  return "";
}

}  // namespace config_test
