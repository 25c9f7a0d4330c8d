// open_model: a model file or directory onto the backend a worker asked for, with its tokenizer
// and chat template: what keep-worker and keep-generate start with.
//
// A Hugging Face directory goes to the GPU as stored (CudaBackend::create_from_hf: one shard on
// the host at a time, no fp32 copy); GGUF files, and any model for the CPU backend, load to fp32
// first (load_model: the CPU backend computes from those).
#pragma once

#include <memory>
#include <optional>
#include <string>

#include "services/worker/engine/core/backend.h"
#include "shared/common/status.h"
#include "shared/tokenizer/bpe_tokenizer.h"

namespace keep::engine {

struct OpenOptions {
  // "cuda": the CUDA backend or an error; "cpu": the CPU backend; "auto": the GPU where this build
  // and machine have a usable one, else the CPU (the reason logged).
  std::string device = "auto";
  int threads = 0;  // CPU backend threads and loader threads; 0 = hardware concurrency
};

struct OpenedModel {
  std::unique_ptr<Backend> backend;
  std::optional<tok::BpeTokenizer> tokenizer;  // empty when the source has none
  std::string chat_template;                   // Jinja source, empty when none
  std::string format;                          // "hf" or "gguf"
  bool streamed = false;                       // weights went to the device as stored
};

// Errors: kInvalidArgument for a directory without config.json, for device "cuda" in a build
// without CUDA, or for an unknown device; the GPU's refusal under "cuda" (context "--device
// cuda"); the loaders' errors naming the file and the tensor.
Result<OpenedModel> open_model(const std::string& path, const OpenOptions& options);

}  // namespace keep::engine
