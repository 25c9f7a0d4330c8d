// Binary encoding of the store's WAL records and snapshots (docs/memory-model.md, "Byte formats").
//
// All integers little-endian; floats as their IEEE-754 bits (u32 LE); strings and arrays are
// u32-length-prefixed. A WAL record is:
//   u8 format version (kRecordFormatVersion) | u8 type (RecordType) | type-specific body
// and must be consumed exactly (trailing bytes -> kCorrupt). A snapshot is:
//   u32 magic kSnapshotMagic | u16 format version | body (see record_codec.cpp, encode_snapshot).
// Decoding is bounds-checked everywhere and returns kCorrupt on any inconsistency (short
// buffer, length past the end, unknown type or enum value, trailing bytes), kVersionMismatch for
// another format version. Never reads past the buffer; allocations are bounded by the input size.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "shared/common/status.h"

namespace keep::manager {

inline constexpr uint8_t kRecordFormatVersion = 1;
inline constexpr uint32_t kSnapshotMagic = 0x4b50534bu;  // "KSPK" read as LE bytes "KSPK"
// 2 adds each agent's log position (cluster mode), 3 each agent's window of request ids; versions
// 1 and 2 still decode (position 0, no request ids).
inline constexpr uint16_t kSnapshotFormatVersion = 3;

enum class RecordType : uint8_t {
  kWrite = 1,
  kUpdate = 2,
  kRemove = 3,
  kAdvanceStep = 4,
  kEmbeddings = 5,
  kLogged = 6,      // cluster mode: a mutation record and its position in the agent's log
  kDropAgent = 7,   // cluster mode: the agent's state is forgotten (replayed from the log later)
  kRequested = 8,   // a mutation record with the client's request id and the answer it got
  kAgentState = 9,  // cluster mode: the agent's whole state, from a checkpoint of its log
};

// Records carry resolved values (id, step, token count) so replay never consults the tokenizer
// or the id allocator.
struct WriteRecord {
  std::string agent;
  uint64_t id = 0;
  uint8_t kind = 0;
  uint64_t step = 0;
  uint32_t tokens = 0;
  std::string text;
};
struct UpdateRecord {
  std::string agent;
  uint64_t id = 0;
  uint8_t kind = 0;  // the kind after the update
  uint64_t step = 0;
  uint32_t tokens = 0;
  std::string text;
};
struct RemoveRecord {
  std::string agent;
  uint64_t id = 0;
};
struct AdvanceStepRecord {
  std::string agent;
  uint64_t by = 0;
};
struct EmbeddingEntry {
  std::string agent;
  uint64_t id = 0;
  uint64_t version = 0;
  std::vector<float> embedding;
};
struct EmbeddingsRecord {
  uint32_t dim = 0;  // every entry has exactly dim floats
  std::vector<EmbeddingEntry> entries;
};

// Cluster mode: `inner` (an encoded write, update, remove or advance_step record of `agent`) is
// entry `seq` of the agent's log in PostgreSQL, written at `epoch`. The local WAL keeps the two
// together so a torn tail never leaves a mutation without its position or the reverse.
struct LoggedRecord {
  std::string agent;
  uint64_t seq = 0;
  uint64_t epoch = 0;
  std::string inner;
};
struct DropAgentRecord {
  std::string agent;
};
// Cluster mode: the agent's state is replaced by `snapshot` (an encoded snapshot holding this
// agent alone, MemoryStore::capture_agent): a checkpoint of its log loaded by a node taking it
// over (docs/cluster.md, "Compaction").
struct AgentStateRecord {
  std::string agent;
  std::string snapshot;
};
// A mutation sent with a client's request id (proto Request.clientId/clientSeq): `inner` (an
// encoded write, update, remove or advance_step record of `agent`) and what it was answered, so
// that replaying it puts the id back in the agent's window (MemoryStore::find_request) and a
// resend of the same id is answered the same without being applied again. In cluster mode it is
// the inner record of a logged one, and the record the log of record holds.
struct RequestedRecord {
  std::string agent;
  uint64_t client = 0;  // never 0
  uint64_t seq = 0;
  uint64_t id = 0;       // the answer: the memory's id (write, update, remove; 0: advance_step)
  uint64_t version = 0;  // its version after the mutation (write, update)
  uint64_t step = 0;     // write, update: the step it was recorded at; advance_step: the new step
  std::string inner;
};

using Record =
    std::variant<WriteRecord, UpdateRecord, RemoveRecord, AdvanceStepRecord, EmbeddingsRecord,
                 LoggedRecord, DropAgentRecord, RequestedRecord, AgentStateRecord>;

std::string encode_record(const Record& record);
Result<Record> decode_record(std::string_view bytes);

// ---- snapshots -----------------------------------------------------------------------------

struct SegmentSnapshot {
  uint64_t id = 0;
  uint8_t kind = 0;
  uint64_t version = 0;
  uint64_t updated_step = 0;
  uint32_t tokens = 0;
  uint64_t seq = 0;       // write order of its latest write/update
  uint64_t group = 0;     // 0: none
  bool awaiting = false;  // waiting for placement (new or updated, in seq order)
  std::string text;
  std::vector<float> embedding;  // empty: none for the current version, else dim floats
};
struct GroupSnapshot {
  uint64_t id = 0;
  uint8_t state = 0;
  uint64_t version = 0;
  uint64_t last_change_step = 0;
};
// One entry of an agent's window of request ids (RequestedRecord without the mutation).
struct RequestSnapshot {
  uint64_t client = 0;
  uint64_t seq = 0;
  uint8_t op = 0;  // the RecordType of the mutation: 1 write .. 4 advance_step
  uint64_t id = 0;
  uint64_t version = 0;
  uint64_t step = 0;
};
struct AgentSnapshot {
  std::string name;
  uint64_t step = 0;
  uint64_t next_id = 1;
  uint64_t next_group_id = 1;
  std::vector<SegmentSnapshot> segments;  // ascending id
  std::vector<GroupSnapshot> groups;      // ascending id
  uint64_t log_seq = 0;                   // cluster mode: LogPosition (0: never logged)
  uint64_t log_epoch = 0;
  std::vector<RequestSnapshot> requests;  // the window of request ids, oldest first (version 3)
};
struct StoreSnapshot {
  uint32_t dim = 0;
  uint64_t next_seq = 1;
  std::vector<AgentSnapshot> agents;  // ascending name
};

std::string encode_snapshot(const StoreSnapshot& snapshot);
// Structural decoding only (bounds, enums, lengths, dims); the store checks the semantics
// (ids ascending and unique, group references, seq order).
Result<StoreSnapshot> decode_snapshot(std::string_view bytes);

}  // namespace keep::manager
