// libFuzzer target: arbitrary bytes through keep-worker's request path — size limit, capnp
// decoding, protocol version, then WorkerService::handle_batch (the checks of a completion's
// fields, the queue and its bound). Must never crash, hang or read out of bounds; every input gets
// an answer that decodes as a worker Response. No engine runs: queued completions stay queued, so
// the queue fills and its refusal is exercised too.
#include <cstddef>
#include <cstdint>
#include <string>

#include "services/worker/server/worker_service.h"
#include "shared/client/protocols.h"
#include "shared/rpc/rpc_server.h"
#include "shared/rpc/wire_codec.h"

namespace {

struct World {
  keep::worker::PlanService plans{nullptr, nullptr, nullptr, nullptr, nullptr, {}};
  keep::worker::WorkerService service{&plans, nullptr, {}, nullptr};
};

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static World* world = new World();
  keep::wire::WireLimits limits;
  limits.max_message_bytes = 64 * 1024;
  const std::string answer = keep::wire::dispatch_frame<keep::client::WorkerProtocol>(
      {reinterpret_cast<const std::byte*>(data), size}, limits, world->service);
  auto decoded = keep::wire::decode_message(keep::wire::as_bytes(answer), {});
  if (!decoded.is_ok()) __builtin_trap();
  auto response = (*decoded)->root<keep::client::WorkerProtocol::Response>();
  if (response.getProtocolVersion() != keep::client::WorkerProtocol::kVersion) __builtin_trap();
  return 0;
}
