// A CUPTI injection library: every kernel and copy the process runs, with its GPU start and end
// (ns), to the CSV file named by KEEP_TRACE_OUT. Loaded by the CUDA driver through
// CUDA_INJECTION64_PATH, so the traced program needs no change:
//   CUDA_INJECTION64_PATH=$PWD/libkernel_trace.so KEEP_TRACE_OUT=trace.csv bench_prefill ...
// benchmarks/prefill/trace.sh builds it (where the toolkit has CUPTI) and summarises a trace.
// KREC, MREC: the toolkit's newest kernel and memcpy activity records (CUpti_ActivityKernelN,
// CUpti_ActivityMemcpyN), chosen by trace.sh.
#include <cupti.h>

#include <cstdio>
#include <cstdlib>
#include <mutex>

namespace {

FILE* g_out = nullptr;
std::mutex g_mu;

void CUPTIAPI buffer_requested(uint8_t** buffer, size_t* size, size_t* max_records) {
  *size = size_t{16} << 20;
  *buffer = static_cast<uint8_t*>(std::aligned_alloc(8, *size));
  *max_records = 0;
}

void CUPTIAPI buffer_completed(CUcontext, uint32_t, uint8_t* buffer, size_t, size_t valid) {
  std::lock_guard<std::mutex> lock(g_mu);
  CUpti_Activity* rec = nullptr;
  while (cuptiActivityGetNextRecord(buffer, valid, &rec) == CUPTI_SUCCESS) {
    if (rec->kind == CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL) {
      const auto* k = reinterpret_cast<const KREC*>(rec);
      std::fprintf(g_out, "kernel,%llu,%llu,%u,%d,%s\n", (unsigned long long)k->start,
                   (unsigned long long)k->end, k->streamId, k->gridX * k->gridY * k->gridZ,
                   k->name);
    } else if (rec->kind == CUPTI_ACTIVITY_KIND_MEMCPY) {
      const auto* m = reinterpret_cast<const MREC*>(rec);
      std::fprintf(g_out, "memcpy,%llu,%llu,%u,%llu,kind%d\n", (unsigned long long)m->start,
                   (unsigned long long)m->end, m->streamId, (unsigned long long)m->bytes,
                   (int)m->copyKind);
    }
  }
  std::free(buffer);
}

void finish() {
  cuptiActivityFlushAll(1);
  std::lock_guard<std::mutex> lock(g_mu);
  if (g_out != nullptr) std::fclose(g_out);
  g_out = nullptr;
}

}  // namespace

extern "C" int InitializeInjection() {
  const char* path = std::getenv("KEEP_TRACE_OUT");
  g_out = std::fopen(path != nullptr ? path : "kernel-trace.csv", "w");
  if (g_out == nullptr) return 0;
  std::fprintf(g_out, "what,start_ns,end_ns,stream,blocks_or_bytes,name\n");
  cuptiActivityRegisterCallbacks(buffer_requested, buffer_completed);
  cuptiActivityEnable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL);
  cuptiActivityEnable(CUPTI_ACTIVITY_KIND_MEMCPY);
  std::atexit(finish);
  return 1;
}
