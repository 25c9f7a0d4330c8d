// libFuzzer target: arbitrary bytes as a safetensors file (SafetensorsFile::parse, what open()
// runs on the mapping), then every tensor view and the fp32 conversion of the small ones.
// Checks: each view lies inside the input and holds numel * dtype size bytes.
// Seeds: tests/fuzz/corpus/fuzz_safetensors_reader/ (README.md there says how they were made).
#include <string>
#include <vector>

#include "shared/common/log.h"
#include "shared/safetensors/safetensors_reader.h"
#include "tests/fuzz/fuzz_common.h"

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  keep::log::set_level(keep::log::Level::kOff);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  namespace st = keep::safetensors;
  auto parsed = st::SafetensorsFile::parse(data, size, "fuzz.safetensors");
  if (!parsed.is_ok()) return 0;
  const st::SafetensorsFile& f = **parsed;
  KEEP_FUZZ_ASSERT(f.file_size() == size);
  for (const std::string& name : f.names()) {
    auto view = f.tensor(name);
    KEEP_FUZZ_ASSERT(view.is_ok());
    const st::TensorView& v = *view;
    KEEP_FUZZ_ASSERT(v.data >= data && v.bytes <= size &&
                     v.data - data <= static_cast<std::ptrdiff_t>(size - v.bytes));
    const int64_t n = v.numel();
    KEEP_FUZZ_ASSERT(n >= 0 && static_cast<uint64_t>(n) * st::dtype_size(v.dtype) == v.bytes);
    (void)v.shape_string();
    (void)f.tensor(name, {1});
    if (n <= (1 << 16)) {
      std::vector<float> out(static_cast<size_t>(n));
      (void)st::to_fp32(v, out.data(), out.size());
    }
  }
  return 0;
}
