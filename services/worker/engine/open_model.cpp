#include "services/worker/engine/open_model.h"

#include <filesystem>

#include "services/worker/engine/cpu/cpu_backend.h"
#include "shared/common/log.h"
#include "shared/model/hf_loader.h"
#include "shared/model/model_weights.h"
#ifdef KEEP_HAVE_CUDA
#include "services/worker/engine/cuda/cuda_backend.h"
#endif

namespace keep::engine {

namespace {
constexpr const char* kLog = "engine";
}  // namespace

Result<OpenedModel> open_model(const std::string& path, const OpenOptions& options) {
  const std::string& device = options.device;
  if (device != "auto" && device != "cuda" && device != "cpu") {
    return Status(Code::kInvalidArgument, "device '" + device + "': expected auto, cuda or cpu");
  }
  std::error_code ec;
  const bool dir = std::filesystem::is_directory(path, ec);
  if (dir && !std::filesystem::exists(std::filesystem::path(path) / "config.json", ec)) {
    return Status(
        Code::kInvalidArgument,
        path + " is a directory without config.json (not a Hugging Face model directory)");
  }
  OpenedModel out;
#ifdef KEEP_HAVE_CUDA
  if (device != "cpu" && dir) {
    // As stored, straight to the device.
    CudaBackendOptions co;
    auto cuda = CudaBackend::create_from_hf(path, co);
    if (cuda.is_ok()) {
      out.backend = std::move(cuda).value();
      out.format = "hf";
      out.streamed = true;
      KEEP_RETURN_IF_ERROR(read_hf_tokenizer(path, &out.tokenizer, &out.chat_template));
      return out;
    }
    if (device == "cuda") return cuda.status().with_context("--device cuda");
    if (cuda.status().code() != Code::kUnavailable) {
      KEEP_LOG_INFO(kLog, "running on the CPU: %s", cuda.status().message().c_str());
    }
  }
#else
  if (device == "cuda") {
    return Status(Code::kInvalidArgument, "--device cuda: this build has no CUDA backend");
  }
#endif
  LoadOptions lo;
  lo.threads = options.threads;
  KEEP_ASSIGN_OR_RETURN(LoadedModel model, load_model(path, lo));
  out.tokenizer = std::move(model.tokenizer);
  out.chat_template = std::move(model.chat_template);
  out.format = model.format;
  auto weights = std::make_shared<const ModelWeights>(std::move(model.weights));
#ifdef KEEP_HAVE_CUDA
  if (device != "cpu" && !dir) {  // GGUF: dequantised on the host, then uploaded
    auto cuda = CudaBackend::create(*weights);
    if (cuda.is_ok()) {
      out.backend = std::move(cuda).value();
      return out;
    }
    if (device == "cuda") return cuda.status().with_context("--device cuda");
    if (cuda.status().code() != Code::kUnavailable) {
      KEEP_LOG_INFO(kLog, "running on the CPU: %s", cuda.status().message().c_str());
    }
  }
#endif
  CpuBackendOptions bo;
  bo.attention_threads = options.threads;
  bo.blas_threads = options.threads;
  KEEP_ASSIGN_OR_RETURN(out.backend, CpuBackend::create(weights, bo));
  return out;
}

}  // namespace keep::engine
