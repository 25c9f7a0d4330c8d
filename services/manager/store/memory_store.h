// MemoryStore: the keep-manager's in-memory model of every agent's memories — segments, their
// embeddings, the semantic groups, the static/dynamic state machine, retrieval, and the
// bookkeeping of the KV jobs the worker runs. docs/memory-model.md describes the rules in prose.
//
// Pure logic: no I/O, no threads, NOT thread-safe (the server holds one mutex around it).
//
// Durability contract. Every mutation (write, update, remove, advance_step, apply_embeddings, and
// retrieve when it embeds pending segments) validates its input, applies the change in memory and
// sets *wal_record to ONE encoded record (services/manager/store/record_codec.h). The server
// appends non-empty records to the WAL (group commit) before it replies. A failed mutation leaves
// the state unchanged and the record empty; a successful no-op (an update with identical text and
// kind, an embedding batch that installs nothing) also leaves it empty. apply_record() re-applies
// a record during recovery; a fresh store fed the same records reaches the identical state
// (serialize() byte-equal). serialize()/deserialize() hold the durable state plus the derived
// state that is expensive to recompute (embeddings, group assignment) for snapshots. KV refs, KV
// jobs, released entries, the query cache and counters are NOT persisted: after recovery (the shm
// region is recreated) deserialize() and apply_record() queue jobs again for every static group
// (group job) and every member of a dynamic group (segment job).
//
// KV ownership contract. The store never touches the region. It hands out jobs (take_jobs); the
// server reserves/commits entries and reports them (complete_job). From then on the store owns
// the entry: either it attaches it to segments, or it reports it through take_released_entries()
// (stale, superseded, invalid, or later invalidated by a change), and the server releases it in
// the region. retrieve() never returns a KvRef whose versions differ from the current ones.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "services/manager/store/embedder.h"
#include "services/manager/store/record_codec.h"
#include "shared/common/status.h"

namespace keep::manager {

enum class SegmentKind : uint8_t { kObjectState = 0, kTaskRecord = 1, kExamplePlan = 2 };
inline constexpr uint8_t kSegmentKindCount = 3;
// "object_state", "task_record", "example_plan"; "unknown" for an out-of-range value.
const char* segment_kind_name(SegmentKind kind);

enum class GroupState : uint8_t { kDynamic = 0, kStatic = 1 };
const char* group_state_name(GroupState state);  // "dynamic", "static"

struct StoreOptions {
  float tau = 0.55f;                          // cosine threshold to join a group
  uint32_t group_token_budget = 512;          // a join must keep the group's tokens <= this
  uint64_t static_after_steps = 10;           // t: unchanged for t steps -> static (must be >= 1)
  size_t max_text_bytes = 4096;               // longer text -> kTooLarge (query text too)
  size_t max_agent_bytes = 128;               // agent names: 1..max bytes of [A-Za-z0-9_.:@/-]
  size_t max_segments_per_agent = 1'000'000;  // more -> kResourceExhausted
  size_t max_agents = 100'000;                // more -> kResourceExhausted
  uint32_t max_retrieve_k = 1024;             // larger k is clamped
  uint32_t max_list_limit = 1000;             // list_memories: a larger page is clamped
  size_t max_list_bytes = size_t{4} << 20;    // list_memories: a page's texts, at least one
  // Segments waiting for an embedding: a write or update that would add one beyond this is
  // refused with kResourceExhausted until the embedder catches up (0: no limit).
  size_t max_pending_embeddings = 1'000'000;
  size_t query_cache_entries = 1024;  // LRU of query embeddings by exact text; 0 = off
  uint32_t max_job_attempts = 3;      // fail_job drops a job after this many failures
  // Per agent, the request ids of its last `request_window` mutations that carried one are kept
  // with their answers (find_request); an older one is forgotten, and a resend of it is applied
  // as a new mutation. About 48 bytes per id. 0: none kept (set_request logs no id).
  size_t request_window = 128;
};

// Where a segment's KV lives in the shared region, as retrieve() returns it. Only valid
// (current-version) refs are ever returned.
struct KvRef {
  uint32_t entry_index = 0;
  uint64_t entry_generation = 0;
  uint32_t token_offset = 0;     // first token of this segment inside the entry (0 unless joint)
  uint32_t tokens = 0;           // tokens of this segment
  bool joint = false;            // a slice of a static group's joint KV (else the segment's own)
  uint64_t segment_version = 0;  // versions the KV was computed at
  uint64_t group_version = 0;    // 0 for a segment's own KV
};

// A region entry, as the server reports a completed job and as the store hands entries back.
struct KvEntry {
  uint32_t index = 0;
  uint64_t generation = 0;
  uint32_t tokens = 0;  // tokens the entry holds
};

struct WriteRequest {
  std::string agent;
  std::optional<uint64_t> id;  // explicit id (1 .. 2^63-1); absent: the agent's next free id
  std::string text;
  SegmentKind kind = SegmentKind::kObjectState;
  // The agent's step this write happens at. Absent: the current step. A step in the past is
  // rejected (kInvalidArgument); a future step first advances the agent to it (as advance_step).
  std::optional<uint64_t> step;
};

struct UpdateRequest {
  std::string agent;
  uint64_t id = 0;
  std::string text;
  std::optional<SegmentKind> kind;  // absent: unchanged
  std::optional<uint64_t> step;     // as WriteRequest::step
};

struct WriteResult {
  uint64_t id = 0;
  uint64_t version = 0;  // 1 after a write; +1 per effective update
  uint64_t step = 0;     // the step the change was recorded at
};

struct SegmentInfo {
  uint64_t id = 0;
  std::string text;
  SegmentKind kind = SegmentKind::kObjectState;
  uint32_t tokens = 0;
  uint64_t version = 0;
  uint64_t updated_step = 0;
  uint64_t group_id = 0;    // 0 while awaiting its first embedding
  bool embedded = false;    // an embedding for the current version is installed
  std::optional<KvRef> kv;  // absent: no valid KV yet (a worker recomputes it)
};

// What retrieve returns of a segment: its SegmentInfo (group_id is never 0 and embedded always
// true there, retrieve embeds first) and its group's state, with the score.
struct RetrievedSegment : SegmentInfo {
  GroupState group_state = GroupState::kDynamic;
  uint64_t group_version = 0;
  float score = 0.0f;  // cosine to the query
};

// One page of list_memories: ascending id; `more` when the agent holds larger ids.
struct MemoryPage {
  std::vector<SegmentInfo> memories;
  bool more = false;
};
inline constexpr uint32_t kDefaultListLimit = 100;  // list_memories' page for a limit of 0

struct GroupInfo {
  uint64_t id = 0;
  GroupState state = GroupState::kDynamic;
  uint64_t version = 0;
  std::vector<uint64_t> segment_ids;  // ascending
  uint32_t tokens = 0;
  uint64_t last_change_step = 0;
  bool has_joint_kv = false;
};

struct StoreStats {
  uint64_t agents = 0;
  uint64_t memories = 0;
  uint64_t groups_static = 0;
  uint64_t groups_dynamic = 0;
  uint64_t pending_embeddings = 0;  // segments whose current version has no embedding yet
  uint64_t jobs_queued = 0;
  uint64_t jobs_running = 0;
  uint64_t released_pending = 0;  // entries waiting in take_released_entries()
  // Counters since construction (not persisted).
  uint64_t transitions_to_static = 0;
  uint64_t transitions_to_dynamic = 0;
  uint64_t jobs_completed = 0;
  uint64_t jobs_stale = 0;
  uint64_t jobs_failed = 0;
  uint64_t kv_evictions = 0;  // entries released by evict_lru
  uint64_t query_cache_hits = 0;
  uint64_t query_cache_misses = 0;
};

// A segment whose current version needs an embedding.
struct PendingEmbedding {
  std::string agent;
  uint64_t id = 0;
  uint64_t version = 0;
  std::string text;
  uint64_t seq = 0;  // the store's write order of this version (unique, even across drop_agent)
};

// An embedding computed for PendingEmbedding{agent, id, version}.
struct SegmentEmbedding {
  std::string agent;
  uint64_t id = 0;
  uint64_t version = 0;
  std::vector<float> embedding;  // dim() floats
  // PendingEmbedding::seq when known: the embedding is ignored unless the segment is still that
  // write (an agent dropped and replayed meanwhile has the same ids and versions, other texts).
  // 0: not checked.
  uint64_t seq = 0;
};

// Cluster mode (docs/cluster.md): where an agent's state stands in its log of record.
struct LogPosition {
  uint64_t seq = 0;    // the last entry of the agent's log applied here (0: none)
  uint64_t epoch = 0;  // the epoch that entry was written at
};

// A mutation's idempotency key, chosen by the client (proto Request.clientId/clientSeq): a random
// client id (never 0) and that client's count of mutations.
struct RequestId {
  uint64_t client = 0;
  uint64_t seq = 0;
  bool operator==(const RequestId&) const = default;
};

// The mutations a request id can name (their RecordType).
enum class MutationOp : uint8_t { kWrite = 1, kUpdate = 2, kRemove = 3, kAdvanceStep = 4 };
const char* mutation_op_name(MutationOp op);  // "write", "update", "delete", "advance_step"

// What a mutation with a request id was answered: write and update {id, version, step}, remove
// {id}, advance_step {step: the new step}.
struct AppliedRequest {
  MutationOp op = MutationOp::kWrite;
  WriteResult result;
};

enum class KvJobKind : uint8_t { kSegment = 0, kGroup = 1 };

struct KvJobSegment {
  uint64_t id = 0;
  uint64_t version = 0;
  std::string text;
  uint32_t tokens = 0;
  SegmentKind kind = SegmentKind::kObjectState;  // the worker shares example plans' KV
};

// "Compute the KV of these segments". A segment job has one segment (its own KV, computed alone
// after the system prefix). A group job has the group's members in order (ascending id); the
// joint KV is the concatenation of each member's tokens (each text tokenised on its own), so
// member i's slice starts at the sum of the tokens of members 0..i-1.
struct KvJob {
  uint64_t job_id = 0;
  KvJobKind kind = KvJobKind::kSegment;
  std::string agent;
  uint64_t group_id = 0;       // the segment's group for a segment job (informative)
  uint64_t group_version = 0;  // the version a group job is for
  std::vector<KvJobSegment> segments;
  uint32_t total_tokens = 0;
  uint32_t attempt = 0;  // 0 the first time a job is handed out
};

class MemoryStore {
 public:
  // `embedder` and `counter` must outlive the store. options.static_after_steps must be >= 1 and
  // tau in [-1, 1] (KEEP_CHECK: configuration is validated by the caller).
  MemoryStore(const StoreOptions& options, Embedder* embedder, const TokenCounter* counter);
  ~MemoryStore();
  MemoryStore(const MemoryStore&) = delete;
  MemoryStore& operator=(const MemoryStore&) = delete;

  const StoreOptions& options() const;
  int dim() const;  // the embedder's dimension

  // ---- mutations (each sets *wal_record; wal_record may be null when the caller does not log) --

  // Creates the agent on first use. Errors: kInvalidArgument (agent name, empty text, id 0 or
  // >= 2^63, step in the past, bad kind), kTooLarge (text), kAlreadyExists (explicit id taken),
  // kResourceExhausted (limits). The segment starts un-embedded and group-less; it is queued for
  // embedding (pending_embeddings) and joins a group when its embedding is applied.
  Result<WriteResult> write(const WriteRequest& req, std::string* wal_record);

  // Replaces a segment's text (and optionally kind). The version increments, the old KV is
  // released, the segment's group (if any) turns dynamic at once, and the segment goes back
  // through the embedding path; when its new embedding arrives it stays in its group if the
  // cosine to the group's centroid WITHOUT it is >= tau and the group is within budget (a sole
  // member always stays), else it leaves and is placed like a new segment. Identical text and
  // kind: no change, the version is returned unchanged and no record is produced.
  // Errors: as write, plus kNotFound (agent or segment).
  Result<WriteResult> update(const UpdateRequest& req, std::string* wal_record);

  // Deletes a segment; its group turns dynamic (a group left empty is dropped); its KV is
  // released. Errors: kInvalidArgument (agent name), kNotFound.
  Status remove(std::string_view agent, uint64_t id, std::string* wal_record);

  // Advances the agent's step by `by` (>= 1) and returns the new step. Every dynamic group
  // unchanged since step s with new_step >= s + t (and all members embedded) turns static and a
  // group job is queued. Creates the agent on first use. Errors: kInvalidArgument (by == 0,
  // overflow, agent name), kResourceExhausted (agent limit).
  Result<uint64_t> advance_step(std::string_view agent, uint64_t by, std::string* wal_record);

  // Segments whose current version has no embedding, in write order (oldest first), at most
  // `max`. Does not mark them: calling again before apply_embeddings returns the same ones.
  std::vector<PendingEmbedding> pending_embeddings(size_t max) const;

  // Installs embeddings. Entries whose agent/segment is gone, whose version moved on or that are
  // already embedded are ignored. Then, per agent, segments awaiting placement are placed (new
  // group / join / stay / move) strictly IN WRITE ORDER, stopping at the first one still without
  // an embedding. Returns the number installed. Errors: kInvalidArgument (a vector of the wrong
  // size or with a non-finite value; nothing is applied then).
  Result<size_t> apply_embeddings(const std::vector<SegmentEmbedding>& embeddings,
                                  std::string* wal_record);

  // ---- cluster mode: the agent's log of record (docs/cluster.md) -------------------------------

  // The agent's position in its log (zeros for an unknown agent or one never logged).
  LogPosition log_position(std::string_view agent) const;
  // The mutation that just produced *record (a write, update, remove or advance_step of `agent`)
  // is entry `pos` of the agent's log: sets the agent's position and wraps *record into a logged
  // record carrying it, so the local WAL replays the mutation and its position as one record.
  // kNotFound: unknown agent; kInvalidArgument: an empty record.
  Status set_log_position(std::string_view agent, LogPosition pos, std::string* record);
  // Forgets the agent: memories, groups, KV entries (reported through take_released_entries) and
  // KV jobs, queued or running (a worker's completion of one is then kNotFound). *wal_record gets
  // a drop record (empty when the agent is unknown: nothing to forget).
  Status drop_agent(std::string_view agent, std::string* wal_record);

  // ---- request ids: a mutation resent after its answer was lost (docs/protocol.md) -----------

  // The answer of the agent's mutation that carried `id`, when it is among the agent's last
  // request_window ones that carried one (nullopt otherwise, and for an unknown agent).
  std::optional<AppliedRequest> find_request(std::string_view agent, RequestId id) const;
  // The mutation that just produced *record (a write, update, remove or advance_step of `agent`)
  // carried `id` and is answered `result`: keeps the id in the agent's window (the oldest goes
  // beyond request_window) and wraps *record into a requested record carrying both, so that a
  // replay -- of the local WAL, or of the log of record by a node taking the agent over -- keeps
  // it too. Call before set_log_position. A window of 0: nothing kept, *record unchanged.
  // kNotFound: unknown agent; kInvalidArgument: client 0, or *record is not one of the agent's
  // mutations.
  Status set_request(std::string_view agent, RequestId id, const WriteResult& result,
                     std::string* record);

  // ---- recovery and snapshots ----------------------------------------------------------------

  // Re-applies a record produced by a mutation. kCorrupt when the bytes do not decode; the
  // mutation's own error when it does not apply (e.g. kAlreadyExists: the WAL does not follow
  // this state). Produces no record.
  Status apply_record(std::string_view record);

  // Everything durable plus embeddings and groups. Deterministic: equal states give equal bytes.
  // serialize() is encode_snapshot(capture()): a caller that holds a lock around the store need
  // hold it only for capture(), a copy, and encode outside it (keep-manager's snapshots do).
  std::string serialize() const;
  StoreSnapshot capture() const;
  // Replaces the whole state (the store must hold no agents). kCorrupt on any inconsistency,
  // kVersionMismatch for another format version or embedding dimension. Queues KV jobs for every
  // static group and every member of a dynamic group.
  Status deserialize(std::string_view bytes);

  // ---- one agent's state: cluster mode's checkpoints (docs/cluster.md, "Compaction") ----------

  // The agent's state alone, as a snapshot holding one agent (encode_snapshot: its memories,
  // groups, embeddings, log position and window of request ids); empty for an unknown agent.
  std::string capture_agent(std::string_view agent) const;
  // Replaces the agent's state (whatever the store holds of it is forgotten first, as by
  // drop_agent) with capture_agent()'s bytes, possibly another store's: its segments' write
  // order is renumbered after this store's. Queues its KV jobs. *wal_record (may be null) gets an
  // agent-state record replaying it. kCorrupt (nothing of the agent kept then),
  // kVersionMismatch (another embedding dimension or format version; the store unchanged).
  Status load_agent(std::string_view bytes, std::string* wal_record);

  // ---- reads ---------------------------------------------------------------------------------

  // First embeds this agent's pending segments synchronously through the Embedder and places
  // them (read-your-writes; *wal_record gets their embedding record, empty if none; it is set
  // only when retrieve succeeds, and then it must be logged like any mutation's), then
  // returns the agent's example plans (always, whatever k) plus the top-k other segments by
  // cosine to the query (ties: lower id first; k clamped to max_retrieve_k; exact scores from
  // EmbeddingIndex::score, found through its int8 scan — embedding_index.h), ordered for the
  // prompt:
  //   1. example plans, by id;
  //   2. segments of STATIC groups, groups by ascending group id, members contiguous by id;
  //   3. segments of DYNAMIC groups, same order.
  // Each carries its valid KvRef if any (a static group's joint slice once it landed, else the
  // segment's own KV). Errors: kNotFound (agent), kInvalidArgument (empty query with k > 0,
  // agent name), kTooLarge (query), the Embedder's error.
  Result<std::vector<RetrievedSegment>> retrieve(std::string_view agent, std::string_view query,
                                                 uint32_t k, std::string* wal_record);

  // retrieve() in steps, so that the embedding runs without the store's lock (the service does
  // it on a thread of its own, not the server's I/O thread):
  //   1. retrieve_needs(): what retrieve() would embed (same errors as retrieve());
  //   2. without the lock: embedder()->embed() of the query (unless it came from the cache) and of
  //      the segments' texts;
  //   3. with the lock: add_query_embedding(), apply_embeddings() of the segments (log its record
  //      like the embedding thread's), then retrieve_embedded(), which embeds nothing: a segment
  //      still pending then (written or updated meanwhile) is not among the candidates.
  struct RetrieveNeeds {
    uint32_t k = 0;                          // clamped to max_retrieve_k
    bool embed_query = false;                // k > 0 and the query cache does not hold it
    std::vector<float> query_embedding;      // k > 0 and cached: the normalised vector
    std::vector<PendingEmbedding> segments;  // this agent's pending segments, by write order
  };
  Result<RetrieveNeeds> retrieve_needs(std::string_view agent, std::string_view query, uint32_t k);
  // Normalises an embedder's vector for `query`, caches it (query cache on) and returns it.
  // kInternal on a vector of another dimension.
  Result<std::vector<float>> add_query_embedding(std::string_view query,
                                                 std::vector<float> embedding);
  // retrieve()'s answer for a normalised query embedding (empty when k == 0), without embedding
  // anything. Errors: kNotFound (agent), kInvalidArgument (agent name, a vector of another
  // dimension with k > 0).
  Result<std::vector<RetrievedSegment>> retrieve_embedded(std::string_view agent,
                                                          std::span<const float> query_embedding,
                                                          uint32_t k);
  // The embedder the store was given (thread-safe: see embedder.h).
  Embedder* embedder() const;
  // Whether the agent's segment `id` is at `version` and still waits for its embedding (false for
  // an unknown agent or segment, another version, or one embedded meanwhile).
  bool embedding_pending(std::string_view agent, uint64_t id, uint64_t version) const;

  Result<SegmentInfo> get(std::string_view agent, uint64_t id) const;
  // The agent's memories with id > after_id, ascending, at most `limit` (0: kDefaultListLimit;
  // clamped to max_list_limit) and, past the first, no more than max_list_bytes of text. Pages
  // walk the id order, so a listing stays consistent across writes between pages: a memory is
  // seen once, with the state of the page that carries it.
  // Errors: kNotFound (agent), kInvalidArgument (agent name).
  Result<MemoryPage> list_memories(std::string_view agent, uint64_t after_id, uint32_t limit) const;
  Result<std::vector<GroupInfo>> list_groups(std::string_view agent) const;  // by group id
  Result<uint64_t> current_step(std::string_view agent) const;
  std::vector<std::string> list_agents() const;  // sorted
  StoreStats stats() const;

  // ---- KV jobs -------------------------------------------------------------------------------

  // Hands out up to `max` queued jobs, oldest first, and marks them running.
  std::vector<KvJob> take_jobs(size_t max);

  // The worker committed `entry` for a running job. The store takes ownership of the entry:
  // it attaches it when the versions still match (segment job: the segment's own KV; group job:
  // every member gets its slice, members' own KV is released), else it reports it for release
  // and returns kStale (segment or group changed, gone, or a segment job superseded by its
  // group's joint KV). `slice_tokens` (group jobs, optional): tokens of each member in job
  // order, summing to entry.tokens; absent, the job's token counts are used and must sum to
  // entry.tokens. kInvalidArgument (entry released too) when they do not.
  // kNotFound: unknown or not-running job id; the entry then stays the caller's.
  Status complete_job(uint64_t job_id, const KvEntry& entry,
                      const std::vector<uint32_t>& slice_tokens = {});

  // The job failed (no entry committed). Requeued while still relevant and attempts remain,
  // else dropped (the KV is queued again on the next change). kNotFound: unknown/not running.
  Status fail_job(uint64_t job_id);

  // The region is full: releases the least recently used entries (attach or retrieve order),
  // oldest first, until `tokens` tokens are freed or none is left, and returns the tokens freed
  // (through take_released_entries). An evicted entry's segment or static group is queued for
  // KV again when it is next retrieved.
  uint64_t evict_lru(uint64_t tokens);

  // Entries the store no longer uses; the server frees them in the region. Each entry is
  // reported once.
  std::vector<KvEntry> take_released_entries();

 private:
  struct Impl;
  StoreSnapshot capture_of(std::optional<std::string_view> only) const;  // nullopt: every agent
  std::unique_ptr<Impl> impl_;
};

}  // namespace keep::manager
