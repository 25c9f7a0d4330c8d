// libFuzzer target: arbitrary bytes through the keep-manager's request path — size limit,
// capnp decoding with ReaderOptions limits, protocol version, then ManagerService over a real
// MemoryStore. Must never crash, hang or read out of bounds; every input gets an answer that
// decodes as a Response.
//
// Build (clang): -fsanitize=fuzzer,address; link keep_manager_server keep_client keep_store.
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "services/manager/server/manager_service.h"
#include "services/manager/server/rpc_server.h"
#include "shared/client/wire_codec.h"

namespace {

class FuzzEmbedder : public keep::manager::Embedder {
 public:
  int dim() const override { return 8; }
  keep::Result<std::vector<std::vector<float>>> embed(
      const std::vector<std::string>& texts) override {
    std::vector<std::vector<float>> out;
    for (const auto& t : texts) {
      std::vector<float> v(8, 0.0f);
      v[t.empty() ? 0 : static_cast<unsigned char>(t[0]) % 8] = 1.0f;
      out.push_back(std::move(v));
    }
    return out;
  }
};

class FuzzCounter : public keep::manager::TokenCounter {
 public:
  uint32_t count_tokens(std::string_view text) const override {
    return static_cast<uint32_t>(text.size() / 4 + 1);
  }
};

struct World {
  FuzzEmbedder embedder;
  FuzzCounter counter;
  keep::manager::MemoryStore store{keep::manager::StoreOptions{}, &embedder, &counter};
  keep::manager::ManagerService service{&store, nullptr, nullptr};
};

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static World* world = new World();  // state carries over between inputs, like the daemon's
  keep::wire::WireLimits limits;
  limits.max_message_bytes = 64 * 1024;
  const std::string answer = keep::wire::dispatch_frame(
      {reinterpret_cast<const std::byte*>(data), size}, limits, world->service);
  auto decoded = keep::wire::decode_message(keep::wire::as_bytes(answer), {});
  if (!decoded.is_ok()) __builtin_trap();  // the server must always answer decodable bytes
  return 0;
}
