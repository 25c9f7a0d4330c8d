// Host side of tma.cuh: TMA tensor maps of row-major bf16 matrices, as this folder's kernels read
// and write them (boxes of 64 elements = 128-byte rows, 128-byte swizzle). Not a public header.
#pragma once

#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace keep::kernels::detail {

// cuTensorMapEncodeTiled from the driver, through the runtime (no link against libcuda); null
// where the driver lacks it.
inline PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  static const PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult q{};
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault,
                                         &q) != cudaSuccess ||
        q != cudaDriverEntryPointSuccess) {
      return static_cast<PFN_cuTensorMapEncodeTiled_v12000>(nullptr);
    }
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(p);
  }();
  return fn;
}

// A (rows, cols) bf16 matrix with row stride `ld` elements (ld * 2 a multiple of 16, p 16-byte
// aligned), in boxes of `box_cols` columns x `box_rows` rows: 64 columns (128-byte rows) with the
// 128-byte swizzle, or 32 (64-byte rows) with the 64-byte swizzle; rows and columns past the ends
// read as zeros and are dropped on stores. False where the driver refuses (or lacks) it.
inline bool encode_bf16_map(CUtensorMap* map, const __nv_bfloat16* p, int64_t rows, int64_t cols,
                            int64_t ld, uint32_t box_rows, uint32_t box_cols = 64) {
  const auto encode = tensor_map_encoder();
  if (encode == nullptr) return false;
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(cols), static_cast<cuuint64_t>(rows)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(ld) * 2};
  if (box_cols != 64 && box_cols != 32) return false;
  const cuuint32_t box[2] = {box_cols, box_rows};
  const cuuint32_t elem_strides[2] = {1, 1};
  return encode(map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, const_cast<__nv_bfloat16*>(p), dims,
                strides, box, elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
                box_cols == 64 ? CU_TENSOR_MAP_SWIZZLE_128B : CU_TENSOR_MAP_SWIZZLE_64B,
                CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

}  // namespace keep::kernels::detail
