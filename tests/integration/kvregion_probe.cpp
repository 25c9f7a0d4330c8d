// kvregion_probe: a separate process for test_kv_region_processes (a worker stand-in).
//
//   kvregion_probe attach --name N --fp HEX
//       attaches; prints "attached" (exit 0) or the status (exit 3 for version_mismatch, 4 else)
//   kvregion_probe read --name N --fp HEX --duration-ms D [--no-validate]
//       reads every committed entry over and over for D ms, verifying each copy against the
//       pattern of its (key, generation); prints "validated=V invalid=I corrupt=C" and exits 0,
//       or 1 when a copy that passed read_validate (or any copy with --no-validate) was corrupt
//   kvregion_probe write --name N --fp HEX --index I --gen G --offset O --bytes B --tokens T
//                        --object ID [--stall]
//       fills the reserved entry with its pattern; with --stall prints "half" after the first half
//       and then waits to be killed; otherwise prints "done". Exit 5 when the entry is not
//       writable (stale / lease expired), printing the status.
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <string>
#include <vector>

#include "shared/common/log.h"
#include "shared/kvregion/kv_region.h"
#include "tests/integration/kvregion_test_util.h"

using namespace keep::kv;

namespace {

struct Args {
  std::map<std::string, std::string> kv;
  bool has(const std::string& k) const { return kv.count(k) > 0; }
  std::string get(const std::string& k) const {
    auto it = kv.find(k);
    return it == kv.end() ? std::string() : it->second;
  }
  uint64_t num(const std::string& k) const { return std::strtoull(get(k).c_str(), nullptr, 10); }
};

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 2; i < argc; ++i) {
    std::string k = argv[i];
    if (k.rfind("--", 0) != 0) continue;
    k = k.substr(2);
    if (i + 1 < argc && std::strncmp(argv[i + 1], "--", 2) != 0) {
      a.kv[k] = argv[++i];
    } else {
      a.kv[k] = "1";
    }
  }
  return a;
}

int cmd_attach(const Args& a, const ModelFingerprint& fp) {
  auto view = KvRegionView::attach(a.get("name"), fp);
  if (!view.is_ok()) {
    std::printf("%s\n", view.status().to_string().c_str());
    return view.status().code() == keep::Code::kVersionMismatch ? 3 : 4;
  }
  std::printf("attached size=%zu\n", (*view)->size());
  return 0;
}

int cmd_read(const Args& a, const ModelFingerprint& fp) {
  auto view = KvRegionView::attach(a.get("name"), fp);
  if (!view.is_ok()) {
    std::printf("%s\n", view.status().to_string().c_str());
    return 4;
  }
  KvRegionView& v = **view;
  const bool validate = !a.has("no-validate");
  const auto deadline =
      std::chrono::steady_clock::now() + std::chrono::milliseconds(a.num("duration-ms"));
  uint64_t validated = 0, invalid = 0, corrupt = 0, passes = 0;
  std::vector<unsigned char> copy;
  while (std::chrono::steady_clock::now() < deadline) {
    ++passes;
    for (uint32_t i = 0; i < v.max_entries(); ++i) {
      auto info = v.entry_info(i);
      if (!info.is_ok() || info->state != EntryState::kCommitted) continue;
      EntryDescriptor d{i, info->generation, info->offset, info->bytes, info->tokens};
      auto seq = v.read_begin(d.index, d.generation);
      if (!seq) {
        ++invalid;
        continue;
      }
      auto span = v.entry_data(d);
      if (!span.is_ok()) {
        ++invalid;
        continue;
      }
      copy.resize(span->size());
      std::memcpy(copy.data(), span->data(), span->size());
      if (validate && !v.read_validate(d.index, *seq)) {
        ++invalid;
        continue;
      }
      const int64_t bad =
          testutil::first_mismatch(copy.data(), copy.size() / 8, info->key.object_id, d.generation);
      if (bad >= 0) {
        ++corrupt;
        if (corrupt <= 3) {
          std::fprintf(stderr, "corrupt: entry %u gen %llu word %lld\n", i,
                       static_cast<unsigned long long>(d.generation), static_cast<long long>(bad));
        }
        if (!validate) break;  // the negative control only needs one
      } else {
        ++validated;
      }
    }
    if (!validate && corrupt > 0) break;
  }
  std::printf("validated=%llu invalid=%llu corrupt=%llu passes=%llu\n",
              static_cast<unsigned long long>(validated), static_cast<unsigned long long>(invalid),
              static_cast<unsigned long long>(corrupt), static_cast<unsigned long long>(passes));
  return corrupt == 0 ? 0 : 1;
}

int cmd_write(const Args& a, const ModelFingerprint& fp) {
  auto view = KvRegionView::attach(a.get("name"), fp);
  if (!view.is_ok()) {
    std::printf("%s\n", view.status().to_string().c_str());
    return 4;
  }
  KvRegionView& v = **view;
  EntryDescriptor d;
  d.index = static_cast<uint32_t>(a.num("index"));
  d.generation = a.num("gen");
  d.offset = a.num("offset");
  d.bytes = a.num("bytes");
  d.tokens = static_cast<uint32_t>(a.num("tokens"));
  keep::Status st = v.check_writable(d, monotonic_now_ns());
  if (!st.is_ok()) {
    std::printf("%s\n", st.to_string().c_str());
    return 5;
  }
  auto span = v.entry_data(d);
  if (!span.is_ok()) {
    std::printf("%s\n", span.status().to_string().c_str());
    return 5;
  }
  auto* data = reinterpret_cast<unsigned char*>(span->data());
  const uint64_t words = span->size() / 8;
  const uint64_t object = a.num("object");
  testutil::fill_pattern(data, 0, words / 2, object, d.generation);
  if (a.has("stall")) {
    std::printf("half\n");
    std::fflush(stdout);
    for (;;) pause();  // SIGKILLed by the test
  }
  testutil::fill_pattern(data, words / 2, words, object, d.generation);
  std::printf("done\n");
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  keep::log::set_level(keep::log::Level::kWarn);
  if (argc < 2) {
    std::fprintf(stderr, "usage: kvregion_probe attach|read|write --name N --fp HEX ...\n");
    return 2;
  }
  const std::string cmd = argv[1];
  Args a = parse(argc, argv);
  auto fp = testutil::from_hex(a.get("fp"));
  if (!fp || !a.has("name")) {
    std::fprintf(stderr, "kvregion_probe: --name and a valid --fp are required\n");
    return 2;
  }
  if (cmd == "attach") return cmd_attach(a, *fp);
  if (cmd == "read") return cmd_read(a, *fp);
  if (cmd == "write") return cmd_write(a, *fp);
  std::fprintf(stderr, "kvregion_probe: unknown command '%s'\n", cmd.c_str());
  return 2;
}
