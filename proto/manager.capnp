# keep-manager protocol: one Request in, one Response out, over ZeroMQ ROUTER/DEALER.
# See docs/protocol.md for framing, limits and error codes.
#
# Evolution rules: fields are only ever added (new ordinals), never renumbered or retyped.
# protocolVersion and requestId keep ordinals @0/@1 in every version so a server can always answer
# a peer of another version with versionMismatch and the right requestId.
# Every enum has `unknown @0`: an unset or unknown value is refused with invalidArgument.
@0x9d1f3f20fb117c6a;

using Cxx = import "/capnp/c++.capnp";
$Cxx.namespace("keep::proto");

using Common = import "common.capnp";

const protocolVersion :UInt16 = 1;

enum SegmentKind {
  unknown @0;
  objectState @1;
  taskRecord @2;
  examplePlan @3;
}

enum GroupState {
  unknown @0;
  dynamic @1;
  static @2;
}

enum JobKind {
  unknown @0;
  segment @1;   # KV of one segment of a dynamic group
  group @2;     # joint KV of a static group's members, in order
}

# Where one KV entry lives in the shared region (the only thing about KV that crosses processes).
struct EntryDescriptor {
  index @0 :UInt32;
  generation @1 :UInt64;
  offset @2 :UInt64;     # byte offset of the entry in the region mapping
  bytes @3 :UInt64;      # byte length of the entry
  tokens @4 :UInt32;     # tokens the entry holds
}

# ---- requests --------------------------------------------------------------------------------

struct WriteMemoryRequest {
  agent @0 :Text;
  hasId @1 :Bool;        # false: the manager assigns the id
  id @2 :UInt64;
  text @3 :Text;
  kind @4 :SegmentKind;
  hasStep @5 :Bool;      # false: the agent's current step
  step @6 :UInt64;
}

struct UpdateMemoryRequest {
  agent @0 :Text;
  id @1 :UInt64;
  text @2 :Text;
  hasKind @3 :Bool;      # false: keep the segment's kind
  kind @4 :SegmentKind;
  hasStep @5 :Bool;      # false: the agent's current step
  step @6 :UInt64;
}

struct DeleteMemoryRequest {
  agent @0 :Text;
  id @1 :UInt64;
}

struct AdvanceStepRequest {
  agent @0 :Text;
  by @1 :UInt64;
}

struct RetrieveRequest {
  agent @0 :Text;
  query @1 :Text;
  k @2 :UInt32;
}

struct ListGroupsRequest {
  agent @0 :Text;
}

# One page of an agent's memories in ascending id order: those with id > afterId, at most limit
# of them (0: 100; larger than the manager's maximum, 1000 by default: clamped); a page also ends
# once its texts reach the manager's max message size, 1 MiB by default (it always carries at
# least one memory).
struct ListMemoriesRequest {
  agent @0 :Text;
  afterId @1 :UInt64;
  limit @2 :UInt32;
}

struct StatsRequest {}

struct PingRequest {}

struct FetchJobsRequest {
  workerId @0 :UInt64;
  max @1 :UInt32;
}

struct ReserveEntryRequest {
  workerId @0 :UInt64;
  jobId @1 :UInt64;
  tokens @2 :UInt32;
}

# commit / revoke / renew name the entry the reservation returned.
struct EntryRef {
  workerId @0 :UInt64;
  jobId @1 :UInt64;
  index @2 :UInt32;
  generation @3 :UInt64;
  sliceTokens @4 :List(UInt32);  # commit of a group job, optional: tokens of each member in job
                                 # order (sums to the entry's tokens); empty: the job's counts
}

struct Request {
  protocolVersion @0 :UInt16;
  requestId @1 :UInt64;
  union {
    none @2 :Void;               # unset: refused with invalidArgument
    writeMemory @3 :WriteMemoryRequest;
    updateMemory @4 :UpdateMemoryRequest;
    deleteMemory @5 :DeleteMemoryRequest;
    advanceStep @6 :AdvanceStepRequest;
    retrieve @7 :RetrieveRequest;
    listGroups @8 :ListGroupsRequest;
    stats @9 :StatsRequest;
    fetchJobs @10 :FetchJobsRequest;
    reserveEntry @11 :ReserveEntryRequest;
    commitEntry @12 :EntryRef;
    revokeEntry @13 :EntryRef;
    renewLease @14 :EntryRef;
    ping @15 :PingRequest;
    listMemories @16 :ListMemoriesRequest;
  }
  # How long the caller waits for the answer, in ms from the server's receipt (0: not said). A
  # retrieve still waiting for a retrieve thread when it has passed is answered timeout without
  # being run. Relative, since the clocks of two hosts differ; older servers ignore it.
  timeoutMs @17 :UInt32;
  # A mutation's (writeMemory, updateMemory, deleteMemory, advanceStep) idempotency key, chosen by
  # the client: clientId a random non-zero 64-bit number the client draws once, clientSeq its
  # count of mutations. clientId 0: no key (older clients; ignored on the other calls). The
  # manager keeps the keys of each agent's last mutations with their answers, durably with the
  # mutations (docs/protocol.md, "Resending a mutation"): a mutation whose key it already applied
  # is answered as the first time and not applied again -- also by a node that took the agent's
  # shard over. Unlike requestId, the key stays the same when a client sends the call again.
  clientId @18 :UInt64;
  clientSeq @19 :UInt64;
}

# ---- responses -------------------------------------------------------------------------------

struct WriteMemoryResponse {
  id @0 :UInt64;
  version @1 :UInt64;
  step @2 :UInt64;
}

struct DeleteMemoryResponse {}

struct AdvanceStepResponse {
  step @0 :UInt64;       # the agent's new step
}

# The KV of one retrieved segment: a token range of a region entry.
struct KvSlice {
  entry @0 :EntryDescriptor;
  tokenOffset @1 :UInt32;  # first token of the segment inside the entry
  tokens @2 :UInt32;       # tokens of the segment
  joint @3 :Bool;          # a slice of a static group's joint KV (else the segment's own KV)
}

struct RetrievedSegment {
  id @0 :UInt64;
  text @1 :Text;
  kind @2 :SegmentKind;
  tokens @3 :UInt32;
  version @4 :UInt64;
  updatedStep @5 :UInt64;
  groupId @6 :UInt64;
  groupState @7 :GroupState;
  groupVersion @8 :UInt64;
  score @9 :Float32;
  hasKv @10 :Bool;         # false: no KV yet (or stale): the worker recomputes the segment
  kv @11 :KvSlice;
}

struct RetrieveResponse {
  segments @0 :List(RetrievedSegment);   # in prompt order (docs/protocol.md)
}

struct GroupInfo {
  id @0 :UInt64;
  state @1 :GroupState;
  version @2 :UInt64;
  segmentIds @3 :List(UInt64);
  tokens @4 :UInt32;
  lastChangeStep @5 :UInt64;
}

struct ListGroupsResponse {
  groups @0 :List(GroupInfo);
}

struct MemoryInfo {
  id @0 :UInt64;
  text @1 :Text;
  kind @2 :SegmentKind;
  tokens @3 :UInt32;
  version @4 :UInt64;
  updatedStep @5 :UInt64;
  groupId @6 :UInt64;      # 0: not placed in a group yet (no embedding)
  embedded @7 :Bool;       # the current version's embedding is installed
  hasKv @8 :Bool;          # valid KV is stored (the segment's own or its static group's)
}

struct ListMemoriesResponse {
  memories @0 :List(MemoryInfo);   # ascending id
  more @1 :Bool;                   # more remain: ask again with afterId = the last id here
}

# A named counter or gauge (the names are documented in docs/protocol.md).
struct Counter {
  name @0 :Text;
  value @1 :UInt64;
}

struct StatsResponse {
  agents @0 :UInt64;
  memories @1 :UInt64;
  groupsStatic @2 :UInt64;
  groupsDynamic @3 :UInt64;
  jobsPending @4 :UInt64;
  counters @5 :List(Counter);            # everything else the manager reports
}

struct PingResponse {
  serverVersion @0 :Text;
}

struct JobSegment {
  id @0 :UInt64;
  version @1 :UInt64;
  text @2 :Text;
  tokens @3 :UInt32;
  kind @4 :SegmentKind;  # unknown from a manager older than the shared KV tier
}

struct KvJob {
  jobId @0 :UInt64;
  kind @1 :JobKind;
  agent @2 :Text;
  groupId @3 :UInt64;
  groupVersion @4 :UInt64;
  segments @5 :List(JobSegment);         # in prompt order
}

struct FetchJobsResponse {
  jobs @0 :List(KvJob);
}

struct ReserveEntryResponse {
  entry @0 :EntryDescriptor;
  leaseMs @1 :UInt32;
}

struct CommitEntryResponse {}

struct RevokeEntryResponse {}

struct RenewLeaseResponse {
  leaseMs @0 :UInt32;
}

struct Response {
  protocolVersion @0 :UInt16;
  requestId @1 :UInt64;      # echoes the request's (0 when the request could not be read)
  union {
    error @2 :Common.Error;
    writeMemory @3 :WriteMemoryResponse;
    updateMemory @4 :WriteMemoryResponse;
    deleteMemory @5 :DeleteMemoryResponse;
    advanceStep @6 :AdvanceStepResponse;
    retrieve @7 :RetrieveResponse;
    listGroups @8 :ListGroupsResponse;
    stats @9 :StatsResponse;
    fetchJobs @10 :FetchJobsResponse;
    reserveEntry @11 :ReserveEntryResponse;
    commitEntry @12 :CommitEntryResponse;
    revokeEntry @13 :RevokeEntryResponse;
    renewLease @14 :RenewLeaseResponse;
    ping @15 :PingResponse;
    listMemories @16 :ListMemoriesResponse;
  }
}
