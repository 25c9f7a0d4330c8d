// The model shapes the benchmarks time on random weights (values don't change speed):
// bench_prefill (CUDA) and bench_engine's --random-smollm2 (CPU). Each is the model's config.json
// from the Hugging Face hub, kept in benchmarks/model_shapes.json -- which hf_prefill.py reads
// too, so both engines of a comparison get the same shape -- and compiled in by
// benchmarks/CMakeLists.txt (model_shapes_json.h).
#pragma once

#include <nlohmann/json.hpp>

#include <string>
#include <vector>

#include "benchmarks/model_shapes_json.h"
#include "shared/model/model_config.h"

namespace keep::bench {

// The shape `name` as the engine's config.json parser reads it; kNotFound for an unknown name.
inline Result<engine::ModelConfig> model_shape(const std::string& name) {
  const nlohmann::json all = nlohmann::json::parse(kModelShapesJson);
  const auto it = all.find(name);
  if (it == all.end()) return Status(Code::kNotFound, "unknown model shape " + name);
  return engine::parse_hf_config(it->dump(), "benchmarks/model_shapes.json: " + name);
}

inline std::vector<std::string> model_shape_names() {
  const nlohmann::json all = nlohmann::json::parse(kModelShapesJson);
  std::vector<std::string> names;
  for (auto it = all.begin(); it != all.end(); ++it) names.push_back(it.key());
  return names;
}

}  // namespace keep::bench
