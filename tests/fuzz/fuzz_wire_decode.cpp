// libFuzzer target: arbitrary bytes through the keep-manager's request path — size limit,
// capnp decoding with ReaderOptions limits, protocol version, then ManagerService over a real
// MemoryStore. Must never crash, hang or read out of bounds; every input gets an answer that
// decodes as a Response.
//
// Build (clang): -fsanitize=fuzzer,address; link keep_manager_server keep_client keep_store.
#include <cstddef>
#include <cstdint>
#include <string>

#include "services/manager/server/manager_service.h"
#include "shared/client/protocols.h"
#include "shared/rpc/rpc_server.h"
#include "shared/rpc/wire_codec.h"
#include "tests/fuzz/fuzz_store.h"

namespace {

struct World {
  keep::fuzz::FuzzEmbedder embedder;
  keep::fuzz::FuzzCounter counter;
  keep::manager::MemoryStore store{keep::manager::StoreOptions{}, &embedder, &counter};
  keep::manager::ManagerService service{&store, nullptr, nullptr};
};

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static World* world = new World();  // state carries over between inputs, like the daemon's
  keep::wire::WireLimits limits;
  limits.max_message_bytes = 64 * 1024;
  const std::string answer = keep::wire::dispatch_frame<keep::client::ManagerProtocol>(
      {reinterpret_cast<const std::byte*>(data), size}, limits, world->service);
  auto decoded = keep::wire::decode_message(keep::wire::as_bytes(answer), {});
  if (!decoded.is_ok()) __builtin_trap();  // the server must always answer decodable bytes
  return 0;
}
