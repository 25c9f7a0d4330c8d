#include "services/worker/engine/cuda/host_registration.h"

#include <cuda_runtime.h>

#include <string>

namespace keep::engine {

Result<std::unique_ptr<HostRegistration>> HostRegistration::register_memory(void* base,
                                                                            size_t bytes) {
  if (base == nullptr || bytes == 0) {
    return Status(Code::kInvalidArgument, "host registration of an empty range");
  }
  // Portable: every context may use it; Mapped: device code may read it in place.
  cudaError_t e = cudaHostRegister(base, bytes, cudaHostRegisterPortable | cudaHostRegisterMapped);
  if (e != cudaSuccess) {
    cudaGetLastError();
    return Status(Code::kUnavailable, "cudaHostRegister of " + std::to_string(bytes) +
                                          " bytes: " + cudaGetErrorString(e));
  }
  void* device = nullptr;
  e = cudaHostGetDevicePointer(&device, base, 0);
  if (e != cudaSuccess) {
    cudaGetLastError();
    cudaHostUnregister(base);
    return Status(Code::kUnavailable,
                  std::string("cudaHostGetDevicePointer: ") + cudaGetErrorString(e));
  }
  return std::unique_ptr<HostRegistration>(new HostRegistration(base, bytes, device));
}

HostRegistration::~HostRegistration() {
  if (cudaHostUnregister(base_) != cudaSuccess) cudaGetLastError();
}

}  // namespace keep::engine
