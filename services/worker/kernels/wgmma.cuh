// Hopper warpgroup matrix multiply (wgmma) for the kernels of this folder (not a public header).
//
// wgmma runs on sm_90a only: the wrappers compile to their instruction where the architecture-
// specific features are (__CUDA_ARCH_FEAT_SM90_ALL, an sm_90a build) and to a trap elsewhere, so
// a kernel using them must be launched only where kWgmmaBuilt holds and the device is compute 9.0
// (wgmma_available()).
//
// Shared-memory operands are described by 64-bit descriptors: start address, leading and stride
// byte offsets, swizzle mode. A core matrix is 8 rows of 16 bytes. With the 128-byte swizzle
// (the layout our kernels use), an operand is made of 128-byte rows of 64 bf16, 8-row groups
// 1024 bytes apart (the stride byte offset; 1024-byte aligned), the 16-byte chunk c of row r
// stored as chunk c ^ (r % 8). K-major (the 64 elements of a row are k): a k16 step starts 32
// bytes further into the rows, the next 64 k are another such block. N-major (the transposed B:
// a row holds 64 n of one k): the leading byte offset is the distance to the next 64 n, and a k16
// step is two 8-row groups further.
// Register accumulators of m64nNk16: warp w of the warpgroup holds rows [16w, 16w + 16), in the
// C layout of mma.sync m16n8k16 repeated over the N / 8 column blocks: d[j][0..1] = row lane / 4,
// columns 8j + 2 (lane % 4) + {0, 1}; d[j][2..3] the same columns of row lane / 4 + 8. A from
// registers is the mma.sync A fragment of the warp's 16 rows.
#pragma once

#include <cstdint>

namespace keep::kernels::detail {

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define KEEP_WGMMA_ASM 1
#endif

__device__ __forceinline__ uint32_t smem_u32(const void* smem) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(smem));
}
// Shared-memory matrix descriptor with the 128-byte swizzle (address < 256 KiB, offsets multiples
// of 16).
__device__ __forceinline__ uint64_t wgmma_desc_sw128(const void* smem, uint32_t leading_bytes,
                                                     uint32_t stride_bytes) {
  return static_cast<uint64_t>((smem_u32(smem) & 0x3ffffu) >> 4) |
         (static_cast<uint64_t>(leading_bytes >> 4) << 16) |
         (static_cast<uint64_t>(stride_bytes >> 4) << 32) | (1ull << 62);
}
// A descriptor moved by `bytes` (a multiple of 16) in shared memory.
__device__ __forceinline__ uint64_t wgmma_desc_add(uint64_t desc, uint32_t bytes) {
  return desc + (bytes >> 4);
}

// Orders this thread's register writes before the next wgmma reading them (accumulators, A).
__device__ __forceinline__ void wgmma_fence() {
#ifdef KEEP_WGMMA_ASM
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#else
  __trap();
#endif
}
__device__ __forceinline__ void wgmma_commit() {
#ifdef KEEP_WGMMA_ASM
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
#endif
}
// Waits until at most N committed groups are pending.
template <int N>
__device__ __forceinline__ void wgmma_wait() {
#ifdef KEEP_WGMMA_ASM
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
#endif
}
// Makes this thread's generic-proxy shared-memory writes (st.shared, cp.async once waited for)
// visible to the async proxy wgmma reads through; then a barrier publishes them to the warpgroup.
__device__ __forceinline__ void fence_proxy_async_shared() {
#ifdef KEEP_WGMMA_ASM
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
}
// After a wait: the compiler must not use the accumulators before it (they are written behind its
// back by the asynchronous instruction).
template <int N>
__device__ __forceinline__ void wgmma_fence_operands(float (&d)[N][4]) {
#pragma unroll
  for (int j = 0; j < N; ++j) {
#pragma unroll
    for (int e = 0; e < 4; ++e) asm volatile("" : "+f"(d[j][e])::"memory");
  }
}

#ifdef KEEP_WGMMA_ASM
// The asm operands of an accumulator: float d[N][4], 8 blocks (32 registers) at a time, and their
// numbers in the instruction's register list (%0 .. %31, %32 .. %63, ...).
#define KEEP_WGMMA_D4(j) "+f"(d[j][0]), "+f"(d[j][1]), "+f"(d[j][2]), "+f"(d[j][3])
#define KEEP_WGMMA_D16(j) \
  KEEP_WGMMA_D4(j), KEEP_WGMMA_D4(j + 1), KEEP_WGMMA_D4(j + 2), KEEP_WGMMA_D4(j + 3)
#define KEEP_WGMMA_D32(j)                                                             \
  KEEP_WGMMA_D4(j), KEEP_WGMMA_D4(j + 1), KEEP_WGMMA_D4(j + 2), KEEP_WGMMA_D4(j + 3), \
      KEEP_WGMMA_D4(j + 4), KEEP_WGMMA_D4(j + 5), KEEP_WGMMA_D4(j + 6), KEEP_WGMMA_D4(j + 7)
// clang-format off
#define KEEP_WGMMA_R0 \
  "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
#define KEEP_WGMMA_R32 \
  "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
  "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
#define KEEP_WGMMA_R64 \
  "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, " \
  "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95"
#define KEEP_WGMMA_R64H \
  "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79"
#define KEEP_WGMMA_R96H \
  "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111"
#define KEEP_WGMMA_R96 \
  "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, " \
  "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"
// clang-format on

// d (64 x 64) = A (64 x 16) B^T (B: 64 x 16), + d when `accumulate`; A and B in shared memory,
// both K-major (the 16 k of a row contiguous within each core matrix).
__device__ __forceinline__ void wgmma_m64n64k16_ss(float (&d)[8][4], uint64_t a, uint64_t b,
                                                   int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {" KEEP_WGMMA_R0
      "}, %32, %33, p, 1, 1, 0, 0;\n}\n"
      : KEEP_WGMMA_D32(0)
      : "l"(a), "l"(b), "r"(accumulate));
}

// d (64 x 64) += A (64 x 16, registers: the mma.sync A fragment of each warp's 16 rows) B
// (16 x 64, shared memory, N-major: the transposed form).
__device__ __forceinline__ void wgmma_m64n64k16_rs(float (&d)[8][4], const uint32_t (&a)[4],
                                                   uint64_t b) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {" KEEP_WGMMA_R0
      "}, {%32, %33, %34, %35}, %36, p, 1, 1, 1;\n}\n"
      : KEEP_WGMMA_D32(0)
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));
}

// d (64 x 128) (+)= A (64 x 16) B^T (B: 128 x 16), both K-major in shared memory.
__device__ __forceinline__ void wgmma_m64n128k16_ss(float (&d)[16][4], uint64_t a, uint64_t b,
                                                    int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {" KEEP_WGMMA_R0 ", " KEEP_WGMMA_R32
      "}, %64, %65, p, 1, 1, 0, 0;\n}\n"
      : KEEP_WGMMA_D32(0), KEEP_WGMMA_D32(8)
      : "l"(a), "l"(b), "r"(accumulate));
}

// d (64 x 128) += A (64 x 16, registers: the mma.sync A fragment of each warp's 16 rows) B
// (16 x 128, shared memory, N-major: the transposed form).
__device__ __forceinline__ void wgmma_m64n128k16_rs(float (&d)[16][4], const uint32_t (&a)[4],
                                                    uint64_t b) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {" KEEP_WGMMA_R0 ", " KEEP_WGMMA_R32
      "}, {%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n"
      : KEEP_WGMMA_D32(0), KEEP_WGMMA_D32(8)
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));
}

// d (64 x 256) (+)= A (64 x 16) B^T (B: 256 x 16), both K-major in shared memory.
__device__ __forceinline__ void wgmma_m64n256k16_ss(float (&d)[32][4], uint64_t a, uint64_t b,
                                                    int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {" KEEP_WGMMA_R0 ", " KEEP_WGMMA_R32
      ", " KEEP_WGMMA_R64 ", " KEEP_WGMMA_R96 "}, %128, %129, p, 1, 1, 0, 0;\n}\n"
      : KEEP_WGMMA_D32(0), KEEP_WGMMA_D32(8), KEEP_WGMMA_D32(16), KEEP_WGMMA_D32(24)
      : "l"(a), "l"(b), "r"(accumulate));
}

// d (64 x N) (+)= A (64 x 16) B^T (B: N x 16), both K-major in shared memory, for the widths
// between 128 and 256 that divide Qwen2.5's hidden sizes into whole waves of tiles (gemm_wgmma.cu):
// 160 (5120 = 32 x 160), 192, 224 (7168 = 32 x 224, 3584 = 16 x 224).
// (Blocks J .. J + 19 of a wider accumulator: two make m64n320.)
template <int J = 0, int M = 20>
__device__ __forceinline__ void wgmma_m64n160k16_ss(float (&d)[M][4], uint64_t a, uint64_t b,
                                                    int accumulate) {
  static_assert(J + 20 <= M, "accumulator blocks");
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %82, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n160k16.f32.bf16.bf16 {" KEEP_WGMMA_R0 ", " KEEP_WGMMA_R32
      ", " KEEP_WGMMA_R64H "}, %80, %81, p, 1, 1, 0, 0;\n}\n"
      : KEEP_WGMMA_D32(J), KEEP_WGMMA_D32(J + 8), KEEP_WGMMA_D16(J + 16)
      : "l"(a), "l"(b), "r"(accumulate));
}
// The other widths' wrappers, one definition each: NAME(d, a, b, accumulate) for m64n<N>k16 with
// BLOCKS accumulator blocks; REGS is their register list, A, B and P the operand numbers of the two
// descriptors and the accumulate flag, the rest the accumulator operands.
#define KEEP_WGMMA_SS(NAME, N, BLOCKS, REGS, A, B, P, ...)                                        \
  __device__ __forceinline__ void NAME(float(&d)[BLOCKS][4], uint64_t a, uint64_t b,              \
                                       int accumulate) {                                          \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, " P                                            \
                 ", 0;\n"                                                                         \
                 "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32.bf16.bf16 {" REGS "}, " A ", " B \
                 ", p, 1, 1, 0, 0;\n}\n"                                                          \
                 : __VA_ARGS__                                                                    \
                 : "l"(a), "l"(b), "r"(accumulate));                                              \
  }
KEEP_WGMMA_SS(wgmma_m64n192k16_ss, 192, 24, KEEP_WGMMA_R0 ", " KEEP_WGMMA_R32 ", " KEEP_WGMMA_R64,
              "%96", "%97", "%98", KEEP_WGMMA_D32(0), KEEP_WGMMA_D32(8), KEEP_WGMMA_D32(16))
KEEP_WGMMA_SS(wgmma_m64n224k16_ss, 224, 28,
              KEEP_WGMMA_R0 ", " KEEP_WGMMA_R32 ", " KEEP_WGMMA_R64 ", " KEEP_WGMMA_R96H, "%112",
              "%113", "%114", KEEP_WGMMA_D32(0), KEEP_WGMMA_D32(8), KEEP_WGMMA_D32(16),
              KEEP_WGMMA_D16(24))
#undef KEEP_WGMMA_SS
#undef KEEP_WGMMA_D4
#undef KEEP_WGMMA_D16
#undef KEEP_WGMMA_D32
#undef KEEP_WGMMA_R0
#undef KEEP_WGMMA_R32
#undef KEEP_WGMMA_R64
#undef KEEP_WGMMA_R96
#undef KEEP_WGMMA_R64H
#undef KEEP_WGMMA_R96H
#else
__device__ __forceinline__ void wgmma_m64n64k16_ss(float (&)[8][4], uint64_t, uint64_t, int) {
  __trap();
}
__device__ __forceinline__ void wgmma_m64n64k16_rs(float (&)[8][4], const uint32_t (&)[4],
                                                   uint64_t) {
  __trap();
}
__device__ __forceinline__ void wgmma_m64n128k16_rs(float (&)[16][4], const uint32_t (&)[4],
                                                    uint64_t) {
  __trap();
}
__device__ __forceinline__ void wgmma_m64n128k16_ss(float (&)[16][4], uint64_t, uint64_t, int) {
  __trap();
}
__device__ __forceinline__ void wgmma_m64n256k16_ss(float (&)[32][4], uint64_t, uint64_t, int) {
  __trap();
}
template <int J = 0, int M = 20>
__device__ __forceinline__ void wgmma_m64n160k16_ss(float (&)[M][4], uint64_t, uint64_t, int) {
  __trap();
}
__device__ __forceinline__ void wgmma_m64n192k16_ss(float (&)[24][4], uint64_t, uint64_t, int) {
  __trap();
}
__device__ __forceinline__ void wgmma_m64n224k16_ss(float (&)[28][4], uint64_t, uint64_t, int) {
  __trap();
}
#endif

// m64nNk16 with both operands in shared memory, N one of 128, 160, 192, 224, 256, or 320 (two
// m64n160k16 over B's first and last 160 rows, 8-row groups 1024 bytes apart throughout).
template <int N>
__device__ __forceinline__ void wgmma_ss(float (&d)[N / 8][4], uint64_t a, uint64_t b,
                                         int accumulate) {
  static_assert(N == 128 || N == 160 || N == 192 || N == 224 || N == 256 || N == 320,
                "no such width here");
  if constexpr (N == 320) {
    wgmma_m64n160k16_ss<0, 40>(d, a, b, accumulate);
    wgmma_m64n160k16_ss<20, 40>(d, a, wgmma_desc_add(b, 160 * 128), accumulate);
  } else if constexpr (N == 128) {
    wgmma_m64n128k16_ss(d, a, b, accumulate);
  } else if constexpr (N == 160) {
    wgmma_m64n160k16_ss(d, a, b, accumulate);
  } else if constexpr (N == 192) {
    wgmma_m64n192k16_ss(d, a, b, accumulate);
  } else if constexpr (N == 224) {
    wgmma_m64n224k16_ss(d, a, b, accumulate);
  } else {
    wgmma_m64n256k16_ss(d, a, b, accumulate);
  }
}

}  // namespace keep::kernels::detail
