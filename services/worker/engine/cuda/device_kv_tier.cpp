#include "services/worker/engine/cuda/device_kv_tier.h"

#include <cuda_runtime.h>

#include <cstring>

namespace keep::engine {

namespace {
Status cuda(cudaError_t err, const std::string& what) {
  if (err == cudaSuccess) return Status::ok();
  cudaGetLastError();
  return Status(Code::kUnavailable, "device KV tier: " + what + ": " + cudaGetErrorString(err));
}
}  // namespace

Result<std::unique_ptr<DeviceKvTier>> DeviceKvTier::create(const DeviceKvTierOptions& options) {
  if (options.slot_bytes == 0 || options.budget_bytes < options.slot_bytes) {
    return Status(Code::kInvalidArgument, "device KV tier '" + options.name + "': a budget of " +
                                              std::to_string(options.budget_bytes) +
                                              " bytes holds no slot of " +
                                              std::to_string(options.slot_bytes));
  }
  auto t = std::unique_ptr<DeviceKvTier>(new DeviceKvTier());
  KEEP_RETURN_IF_ERROR(cuda(cudaSetDevice(options.device), "cudaSetDevice"));
  const uint64_t slots = options.budget_bytes / options.slot_bytes;
  t->pool_bytes_ = slots * options.slot_bytes;
  void* pool = nullptr;
  KEEP_RETURN_IF_ERROR(cuda(cudaMalloc(&pool, t->pool_bytes_),
                            "allocating " + std::to_string(t->pool_bytes_ >> 20) + " MiB"));
  t->pool_ = static_cast<std::byte*>(pool);
  cudaIpcMemHandle_t handle;
  KEEP_RETURN_IF_ERROR(cuda(cudaIpcGetMemHandle(&handle, pool), "cudaIpcGetMemHandle"));
  cudaStream_t stream = nullptr;
  KEEP_RETURN_IF_ERROR(
      cuda(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate"));
  t->stream_ = stream;
  kv::TierGeometry g;
  g.slots = static_cast<uint32_t>(slots);
  g.slot_bytes = options.slot_bytes;
  g.device = options.device;
  static_assert(sizeof(handle) == kv::kTierIpcHandleBytes);
  std::memcpy(g.ipc_handle, &handle, sizeof(handle));
  KEEP_ASSIGN_OR_RETURN(t->dir_, kv::KvTierDirectory::create(options.name, g));
  return t;
}

Result<std::unique_ptr<DeviceKvTier>> DeviceKvTier::attach(const std::string& name) {
  auto t = std::unique_ptr<DeviceKvTier>(new DeviceKvTier());
  KEEP_ASSIGN_OR_RETURN(t->dir_, kv::KvTierDirectory::open(name));
  const kv::TierGeometry& g = t->dir_->geometry();
  KEEP_RETURN_IF_ERROR(cuda(cudaSetDevice(g.device), "cudaSetDevice"));
  cudaIpcMemHandle_t handle;
  std::memcpy(&handle, g.ipc_handle, sizeof(handle));
  void* pool = nullptr;
  KEEP_RETURN_IF_ERROR(cuda(cudaIpcOpenMemHandle(&pool, handle, cudaIpcMemLazyEnablePeerAccess),
                            "opening the pool of '" + name + "'"));
  t->pool_ = static_cast<std::byte*>(pool);
  t->pool_bytes_ = static_cast<uint64_t>(g.slots) * g.slot_bytes;
  return t;
}

DeviceKvTier::~DeviceKvTier() {
  const bool own = dir_ && dir_->owner();
  dir_.reset();  // no process finds the pool's slots any more
  if (stream_ != nullptr) cudaStreamDestroy(static_cast<cudaStream_t>(stream_));
  if (pool_ != nullptr) {
    if (own) {
      cudaFree(pool_);
    } else {
      cudaIpcCloseMemHandle(pool_);
    }
  }
}

std::optional<DeviceKvTier::Hit> DeviceKvTier::find(const kv::EntryKey& key) const {
  const auto hit = dir_->find(key);
  if (!hit) return std::nullopt;
  return Hit{pool_ + static_cast<uint64_t>(hit->slot) * dir_->geometry().slot_bytes, hit->bytes,
             *hit};
}

Status DeviceKvTier::admit(const kv::EntryKey& key, std::span<const std::byte> entry) {
  KEEP_ASSIGN_OR_RETURN(uint32_t slot, dir_->begin_admit(key, entry.size()));
  std::byte* dst = pool_ + static_cast<uint64_t>(slot) * dir_->geometry().slot_bytes;
  auto stream = static_cast<cudaStream_t>(stream_);
  Status st = cuda(cudaMemcpyAsync(dst, entry.data(), entry.size(), cudaMemcpyDefault, stream),
                   "admission copy");
  if (st.is_ok()) st = cuda(cudaStreamSynchronize(stream), "admission copy");
  if (!st.is_ok()) {
    dir_->abort(slot);
    return st;
  }
  dir_->commit(slot);
  return Status::ok();
}

}  // namespace keep::engine
