// Hopper asynchronous copies for the kernels of this folder (not a public header): mbarriers, the
// tensor memory accelerator (TMA) and thread-block clusters.
//
// Like wgmma.cuh, the instructions are compiled only into an sm_90a build (KEEP_WGMMA_ASM) and to a
// trap elsewhere; a kernel using them is launched only where wgmma_available() holds.
//
// An mbarrier phase completes when its pending arrivals reach zero and the bytes it was told to
// expect (expect_tx) have all landed (complete_tx, signalled by TMA). Waits name the parity of the
// phase they wait for: 0 for the first use of a barrier, then alternating.
#pragma once

#include <cstdint>

#include "services/worker/kernels/wgmma.cuh"

namespace keep::kernels::detail {

#ifdef KEEP_WGMMA_ASM
__device__ __forceinline__ void mbar_init(uint64_t* bar, uint32_t arrivals) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_u32(bar)), "r"(arrivals));
}
// Makes the initialized barriers visible to the cluster (and to the async proxy) before use.
__device__ __forceinline__ void mbar_init_fence() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
// One arrival that also expects `bytes` more to land in this phase.
__device__ __forceinline__ void mbar_arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_u32(bar)),
               "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(smem_u32(bar)) : "memory");
}
// Arrives on the barrier at `bar`'s offset in CTA `cta` of this cluster (this CTA included).
__device__ __forceinline__ void mbar_arrive_cluster(uint64_t* bar, uint32_t cta) {
  asm volatile(
      "{\n.reg .b32 remote;\nmapa.shared::cluster.u32 remote, %0, %1;\n"
      "mbarrier.arrive.shared::cluster.b64 _, [remote];\n}\n" ::"r"(smem_u32(bar)),
      "r"(cta)
      : "memory");
}
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
  asm volatile(
      "{\n.reg .pred done;\nkeep_mbar_wait:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra keep_mbar_wait;\n}\n" ::"r"(smem_u32(bar)),
      "r"(parity)
      : "memory");
}

// A 2-D box of the tensor `map` at element coordinates (x: inner, y: outer) into shared memory at
// `dst`, laid out as the map says (our maps: 128-byte rows, 128-byte swizzle); `bar` learns the
// bytes. Rows past the tensor's end arrive as zeros (and still count).
__device__ __forceinline__ void tma_load_2d(void* dst, const void* map, uint64_t* bar, int32_t x,
                                            int32_t y) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%2, %3}], [%4];\n" ::"r"(smem_u32(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(x), "r"(y), "r"(smem_u32(bar))
      : "memory");
}
// The same box to `dst`'s offset in every CTA of the cluster named by `cta_mask`, each CTA's
// barrier at `bar`'s offset told of the bytes.
__device__ __forceinline__ void tma_load_2d_multicast(void* dst, const void* map, uint64_t* bar,
                                                      int32_t x, int32_t y, uint16_t cta_mask) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
      ".multicast::cluster [%0], [%1, {%2, %3}], [%4], %5;\n" ::"r"(smem_u32(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(x), "r"(y), "r"(smem_u32(bar)), "h"(cta_mask)
      : "memory");
}
// Shared memory at `src` to the box at (x, y) of `map`; the part past the tensor's end is dropped.
// Tracked by bulk groups: commit, then wait for the reads (buffer reusable) or the writes.
__device__ __forceinline__ void tma_store_2d(const void* map, const void* src, int32_t x,
                                             int32_t y) {
  asm volatile(
      "cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%1, %2}], [%3];\n" ::"l"(
          reinterpret_cast<uint64_t>(map)),
      "r"(x), "r"(y), "r"(smem_u32(src))
      : "memory");
}
__device__ __forceinline__ void bulk_commit() {
  asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
}
// At most N committed store groups still read their shared memory.
template <int N>
__device__ __forceinline__ void bulk_wait_read() {
  asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(N) : "memory");
}
// At most N committed store groups unfinished.
template <int N>
__device__ __forceinline__ void bulk_wait() {
  asm volatile("cp.async.bulk.wait_group %0;\n" ::"n"(N) : "memory");
}

// All threads of all CTAs of the cluster (every thread of each CTA must take part).
__device__ __forceinline__ void cluster_sync() {
  asm volatile(
      "barrier.cluster.arrive.release.aligned;\n"
      "barrier.cluster.wait.acquire.aligned;\n" ::
          : "memory");
}
__device__ __forceinline__ uint32_t cluster_rank() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
  return r;
}
// A named barrier for `threads` threads (a multiple of 32); 0 is __syncthreads'.
__device__ __forceinline__ void named_barrier(uint32_t id, uint32_t threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
// Hands registers between the warpgroups of a warp-specialized kernel (all warps of a warpgroup).
template <int N>
__device__ __forceinline__ void setmaxnreg_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N));
}
template <int N>
__device__ __forceinline__ void setmaxnreg_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N));
}
#else
__device__ __forceinline__ void mbar_init(uint64_t*, uint32_t) { __trap(); }
__device__ __forceinline__ void mbar_init_fence() { __trap(); }
__device__ __forceinline__ void mbar_arrive_expect_tx(uint64_t*, uint32_t) { __trap(); }
__device__ __forceinline__ void mbar_arrive(uint64_t*) { __trap(); }
__device__ __forceinline__ void mbar_arrive_cluster(uint64_t*, uint32_t) { __trap(); }
__device__ __forceinline__ void mbar_wait(uint64_t*, uint32_t) { __trap(); }
__device__ __forceinline__ void tma_load_2d(void*, const void*, uint64_t*, int32_t, int32_t) {
  __trap();
}
__device__ __forceinline__ void tma_load_2d_multicast(void*, const void*, uint64_t*, int32_t,
                                                      int32_t, uint16_t) {
  __trap();
}
__device__ __forceinline__ void tma_store_2d(const void*, const void*, int32_t, int32_t) {
  __trap();
}
__device__ __forceinline__ void bulk_commit() { __trap(); }
template <int N>
__device__ __forceinline__ void bulk_wait_read() {
  __trap();
}
template <int N>
__device__ __forceinline__ void bulk_wait() {
  __trap();
}
__device__ __forceinline__ void cluster_sync() { __trap(); }
__device__ __forceinline__ uint32_t cluster_rank() {
  __trap();
  return 0;
}
__device__ __forceinline__ void named_barrier(uint32_t, uint32_t) { __trap(); }
template <int N>
__device__ __forceinline__ void setmaxnreg_dec() {
  __trap();
}
template <int N>
__device__ __forceinline__ void setmaxnreg_inc() {
  __trap();
}
#endif

}  // namespace keep::kernels::detail
