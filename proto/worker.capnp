# keep-worker protocol: planners ask for a completion (or candidate scores) for one planning step.
# One Request in, one Response out, over ZeroMQ ROUTER/DEALER, framed and limited exactly as the
# manager's protocol (docs/protocol.md); errors use the same ErrorCode enum.
#
# Evolution rules as manager.capnp: fields only added; protocolVersion @0 and requestId @1 fixed;
# every enum has `unknown @0`. Optional numbers come with a has-flag where 0 is a meaningful value.
@0xc6a1f0e8d35b9a41;

using Cxx = import "/capnp/c++.capnp";
$Cxx.namespace("keep::proto::worker");

using Common = import "common.capnp";

const protocolVersion :UInt16 = 1;

# How the memory's KV is obtained (docs/recompute.md). unknown: the worker's default (--method).
enum Method {
  unknown @0;
  full @1;        # prefill every token: no reuse
  prefix @2;      # reuse the longest exact token prefix of the last prompt (vLLM prefix caching)
  fullReuse @3;   # load every segment's KV; compute only the query (and segments without KV)
  cacheblend @4;  # layer 0-1 full, then the top share of memory tokens by K deviation
  epic @5;        # the first k tokens of each segment at every layer
  keep @6;        # multi-hop importance on a decaying schedule
}

# Per-request overrides of the worker's defaults; a has-flag false keeps the default.
struct Knobs {
  hasDecay @0 :Bool;
  decay @1 :Float64;             # keep: d in [0, 1]
  hasQueryRows @2 :Bool;
  queryRows @3 :UInt32;          # keep: q >= 1
  hasMaxHops @4 :Bool;
  maxHops @5 :UInt32;            # keep: hop cap
  hasCacheblendRatio @6 :Bool;
  cacheblendRatio @7 :Float64;   # cacheblend: share in [0, 1]
  hasEpicTokens @8 :Bool;
  epicTokens @9 :UInt32;         # epic: k
  hasAnchorTokens @10 :Bool;
  anchorTokens @11 :UInt32;      # keep: leading tokens of every segment computed at every layer
}

struct CompleteRequest {
  agent @0 :Text;                # whose memory (keep-manager's agent namespace)
  instruction @1 :Text;          # the task
  history @2 :List(Text);        # steps done in this episode, oldest first
  k @3 :UInt32;                  # segments to retrieve (0: the worker's default)
  method @4 :Method;
  knobs @5 :Knobs;
  maxTokens @6 :UInt32;          # generation: new tokens at most (0: the worker's default)
  candidates @7 :List(Text);     # non-empty: score these continuations instead of generating
  temperature @8 :Float32;       # <= 0: greedy
  seed @9 :UInt64;               # sampling seed
}

# What a request cost and what it reused.
struct Stats {
  ttftSeconds @0 :Float64;           # arrival to first token (or scores)
  retrieveSeconds @1 :Float64;       # the manager's retrieve
  prefillSeconds @2 :Float64;        # the assembled prefill
  promptTokens @3 :UInt32;
  memoryTokens @4 :UInt32;
  cachedPrefixTokens @5 :UInt32;     # slots reused from the device
  recomputedPerLayer @6 :List(UInt32);  # memory tokens computed at each layer
  recomputeRatio @7 :Float64;        # their mean share of the memory tokens
  bytesLoaded @8 :UInt64;            # KV bytes read from the shared region
  entriesHit @9 :UInt32;             # segments whose KV was reused
  entriesMissing @10 :UInt32;        # segments without KV (never computed yet)
  entriesStale @11 :UInt32;          # KV announced but changed or gone when read
  checkLayers @12 :List(UInt32);
  hops @13 :List(UInt32);            # keep: importance hops at each check layer
  segments @14 :List(UInt64);        # the retrieved segments' ids, in prompt order
  method @15 :Method;                # the method that ran
  entriesDevice @16 :UInt32;         # of the hits, read from a device KV tier (GPU memory)
}

struct CandidateScore {
  logProb @0 :Float64;               # Σ log p(token | prompt, earlier tokens)
  tokens @1 :UInt32;
}

struct CompleteResponse {
  text @0 :Text;                     # generation: the new text
  tokens @1 :List(Int32);            # generation: the new token ids
  scores @2 :List(CandidateScore);   # scoring: one per candidate, in request order
  best @3 :UInt32;                   # scoring: the index of the highest log-prob
  stats @4 :Stats;
}

struct PingResponse {
  serverVersion @0 :Text;
  model @1 :Text;                    # the model's fingerprint, as the region records it
}

struct Request {
  protocolVersion @0 :UInt16;
  requestId @1 :UInt64;
  union {
    none @2 :Void;                   # unset: refused with invalidArgument
    complete @3 :CompleteRequest;
    ping @4 :Void;
  }
  # How long the caller waits for the answer, in ms from the worker's receipt (0: not said). A
  # request still queued when it has passed is answered timeout without being run.
  timeoutMs @5 :UInt32;
}

struct Response {
  protocolVersion @0 :UInt16;
  requestId @1 :UInt64;              # echoes the request's (0 when it could not be read)
  union {
    error @2 :Common.Error;
    complete @3 :CompleteResponse;
    ping @4 :PingResponse;
  }
}
