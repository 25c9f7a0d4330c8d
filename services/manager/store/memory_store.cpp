#include "services/manager/store/memory_store.h"

#include <algorithm>
#include <cmath>
#include <deque>
#include <functional>
#include <list>
#include <map>
#include <set>
#include <unordered_map>
#include <utility>

#include "services/manager/store/embedding_index.h"
#include "services/manager/store/group_tracker.h"
#include "services/manager/store/kv_jobs.h"
#include "services/manager/store/record_codec.h"
#include "shared/common/utf8.h"

namespace keep::manager {

const char* segment_kind_name(SegmentKind kind) {
  switch (kind) {
    case SegmentKind::kObjectState:
      return "object_state";
    case SegmentKind::kTaskRecord:
      return "task_record";
    case SegmentKind::kExamplePlan:
      return "example_plan";
  }
  return "unknown";
}

const char* group_state_name(GroupState state) {
  return state == GroupState::kStatic ? "static" : "dynamic";
}

const char* mutation_op_name(MutationOp op) {
  switch (op) {
    case MutationOp::kWrite:
      return "write";
    case MutationOp::kUpdate:
      return "update";
    case MutationOp::kRemove:
      return "delete";
    case MutationOp::kAdvanceStep:
      return "advance_step";
  }
  return "unknown";
}

namespace {

constexpr uint64_t kMaxId = (uint64_t{1} << 63) - 1;
// Steps a client may set or reach. Far beyond any agent's life, and far enough below 2^64 that the
// group tracker's step + t arithmetic cannot wrap (a step of 2^64-1 once made every later advance
// of its agent fail).
constexpr uint64_t kMaxStep = (uint64_t{1} << 62);

struct OwnKv {
  uint32_t index = 0;
  uint64_t generation = 0;
  uint32_t tokens = 0;
  uint64_t segment_version = 0;
  uint64_t last_used = 0;  // Impl::use_clock at attach or last retrieve (LRU eviction)
};

struct JointKv {
  uint32_t index = 0;
  uint64_t generation = 0;
  uint64_t group_version = 0;
  std::vector<uint32_t> offsets;  // aligned with the group's members at group_version
  std::vector<uint32_t> tokens;
  uint64_t last_used = 0;
};

struct Segment {
  uint64_t id = 0;
  std::string text;
  SegmentKind kind = SegmentKind::kObjectState;
  uint32_t tokens = 0;
  uint64_t version = 0;
  uint64_t updated_step = 0;
  uint64_t seq = 0;       // write order of the latest write/update
  uint64_t group = 0;     // 0: none yet
  bool awaiting = false;  // waiting for placement (in Agent::awaiting)
  int64_t row = -1;       // row in Agent::index when embedded
  std::optional<OwnKv> own_kv;
  uint64_t seg_job = 0;     // latest segment job (queued or running), 0: none
  bool kv_evicted = false;  // its KV was evicted: produced again when next retrieved
};

struct Agent {
  explicit Agent(int dim) : index(dim) {}

  std::string name;
  uint64_t step = 0;
  uint64_t next_id = 1;
  uint64_t next_group_id = 1;
  std::map<uint64_t, Segment> segments;  // by id: list_memories and snapshots walk it in order
  std::set<uint64_t> example_plans;
  std::map<uint64_t, uint64_t> awaiting;  // seq -> segment id, write order
  EmbeddingIndex index;                   // normalised embeddings, keyed by segment id
  std::unique_ptr<GroupTracker> groups;
  std::unordered_map<uint64_t, JointKv> joint;       // group id -> its joint KV (valid only)
  std::unordered_map<uint64_t, uint64_t> group_job;  // group id -> latest group job
  std::set<uint64_t> evicted_groups;  // joint KV evicted: produced again when next retrieved
  LogPosition log;                    // cluster mode: the last entry of its log applied here
  // The request ids of its last mutations that carried one, oldest first (at most
  // StoreOptions::request_window): a resend of one is answered from here.
  std::deque<std::pair<RequestId, AppliedRequest>> requests;

  Segment* find(uint64_t id) {
    auto it = segments.find(id);
    return it == segments.end() ? nullptr : &it->second;
  }
};

Status invalid(std::string msg) { return Status(Code::kInvalidArgument, std::move(msg)); }

bool valid_name_char(char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' ||
         c == '.' || c == ':' || c == '@' || c == '/' || c == '-';
}

}  // namespace

struct MemoryStore::Impl {
  StoreOptions opt;
  Embedder* embedder;
  const TokenCounter* counter;
  int dim;

  std::map<std::string, std::unique_ptr<Agent>, std::less<>> agents;
  std::map<uint64_t, std::pair<Agent*, uint64_t>> to_embed;  // seq -> (agent, id), no embedding
  uint64_t next_seq = 1;
  KvJobQueue jobs;
  std::vector<KvEntry> released;
  StoreStats counters;
  uint64_t use_clock = 0;  // ticks at each retrieve and attach: the entries' LRU order

  // Query embedding LRU: most recent at the front.
  std::list<std::pair<std::string, std::vector<float>>> lru;
  std::unordered_map<std::string_view, decltype(lru)::iterator> lru_index;

  // Retrieval scratch (kept to avoid allocations per call).
  TopKScratch topk_scratch;
  std::vector<ScoredRow> top;
  std::vector<float> query_vec;

  Impl(const StoreOptions& o, Embedder* e, const TokenCounter* c)
      : opt(o), embedder(e), counter(c), dim(e->dim()) {
    KEEP_CHECK(dim > 0);
    KEEP_CHECK(opt.static_after_steps >= 1);
    KEEP_CHECK(opt.tau >= -1.0f && opt.tau <= 1.0f);
    KEEP_CHECK(opt.max_list_limit >= 1);
  }

  // ---- validation ------------------------------------------------------------------------------

  Status check_agent_name(std::string_view name) const {
    if (name.empty()) return invalid("agent name is empty");
    if (name.size() > opt.max_agent_bytes) {
      return invalid("agent name is " + std::to_string(name.size()) + " bytes, limit " +
                     std::to_string(opt.max_agent_bytes));
    }
    for (char c : name) {
      if (!valid_name_char(c)) {
        return invalid("agent name '" + printable(name) +
                       "' has a character outside [A-Za-z0-9_.:@/-]");
      }
    }
    return Status::ok();
  }

  Status check_text(std::string_view text, const char* what) const {
    if (text.empty()) return invalid(std::string(what) + " is empty");
    if (text.size() > opt.max_text_bytes) {
      return Status(Code::kTooLarge, std::string(what) + " is " + std::to_string(text.size()) +
                                         " bytes, limit " + std::to_string(opt.max_text_bytes));
    }
    return check_encoding(text, what);
  }

  // Stored text is echoed to every client (Cap'n Proto Text, keepctl's JSON): refuse what they
  // cannot decode at the door. NUL is valid UTF-8 but ends C strings, so it is refused too.
  static Status check_encoding(std::string_view text, const char* what) {
    const size_t bad = utf8_invalid_offset(text);
    if (bad < text.size()) {
      return invalid(std::string(what) + " is not valid UTF-8 (byte " + std::to_string(bad) + ": " +
                     printable(text.substr(bad, 1)) + ")");
    }
    if (text.find('\0') != std::string_view::npos) {
      return invalid(std::string(what) + " contains a NUL byte (at " +
                     std::to_string(text.find('\0')) + ")");
    }
    return Status::ok();
  }

  static Status check_step(uint64_t step) {
    if (step > kMaxStep) {
      return invalid("step " + std::to_string(step) + " is beyond the largest step " +
                     std::to_string(kMaxStep));
    }
    return Status::ok();
  }

  static Status not_found_agent(std::string_view name) {
    return Status(Code::kNotFound, "unknown agent '" + std::string(name) + "'");
  }
  static Status not_found_segment(std::string_view name, uint64_t id) {
    return Status(Code::kNotFound,
                  "segment " + std::to_string(id) + " of agent '" + std::string(name) + "'");
  }

  Agent* find_agent(std::string_view name) const {
    auto it = agents.find(name);
    return it == agents.end() ? nullptr : it->second.get();
  }

  Result<Agent*> get_or_create(std::string_view name) {
    if (Agent* a = find_agent(name)) return a;
    if (agents.size() >= opt.max_agents) {
      return Status(Code::kResourceExhausted,
                    "agent limit reached (" + std::to_string(opt.max_agents) + ")");
    }
    auto agent = std::make_unique<Agent>(dim);
    Agent* a = agent.get();
    a->name = std::string(name);
    a->groups = std::make_unique<GroupTracker>(
        dim, opt.tau, opt.group_token_budget, opt.static_after_steps,
        [this, a](uint64_t sid) -> const float* {
          const Segment* s = a->find(sid);
          if (s == nullptr || s->row < 0) return nullptr;
          return a->index.row(static_cast<size_t>(s->row));
        },
        [a](uint64_t sid) -> uint32_t {
          const Segment* s = a->find(sid);
          return s == nullptr ? 0 : s->tokens;
        });
    agents.emplace(a->name, std::move(agent));
    return a;
  }

  // ---- embeddings matrix -----------------------------------------------------------------------

  const float* row_ptr(const Agent& a, const Segment& s) const {
    return a.index.row(static_cast<size_t>(s.row));
  }

  // A segment's kind cannot change while it has a row (update removes the row first), so whether
  // top-k may return it (example plans are returned apart) is fixed at insertion.
  void add_row(Agent& a, Segment& s, const float* e) {
    s.row = static_cast<int64_t>(a.index.append(s.id, e, s.kind != SegmentKind::kExamplePlan));
  }

  void remove_row(Agent& a, Segment& s) {
    if (s.row < 0) return;
    const size_t row = static_cast<size_t>(s.row);
    if (auto moved = a.index.swap_remove(row)) {
      a.segments.at(*moved).row = static_cast<int64_t>(row);  // the last row moved into the hole
    }
    s.row = -1;
  }

  // ---- KV bookkeeping --------------------------------------------------------------------------

  void release_own(Segment& s) {
    if (s.own_kv) {
      released.push_back(KvEntry{s.own_kv->index, s.own_kv->generation, s.own_kv->tokens});
      s.own_kv.reset();
    }
  }

  void release_joint(Agent& a, uint64_t gid) {
    auto it = a.joint.find(gid);
    if (it == a.joint.end()) return;
    uint32_t total = 0;
    for (uint32_t t : it->second.tokens) total += t;
    released.push_back(KvEntry{it->second.index, it->second.generation, total});
    a.joint.erase(it);
  }

  void cancel_segment_job(Segment& s) {
    if (s.seg_job != 0) jobs.cancel(s.seg_job);
    s.seg_job = 0;
  }

  void cancel_group_job(Agent& a, uint64_t gid) {
    auto it = a.group_job.find(gid);
    if (it == a.group_job.end()) return;
    jobs.cancel(it->second);
    a.group_job.erase(it);
  }

  void queue_segment_job(Agent& a, Segment& s) {
    if (s.own_kv && s.own_kv->segment_version == s.version) return;
    if (s.seg_job != 0) {
      const KvJobQueue::Entry* e = jobs.find(s.seg_job);
      if (e != nullptr && e->job.segments[0].version == s.version) return;  // already asked
      if (e != nullptr && !e->running) jobs.cancel(s.seg_job);
    }
    KvJob job;
    job.kind = KvJobKind::kSegment;
    job.agent = a.name;
    job.group_id = s.group;
    job.segments.push_back(KvJobSegment{s.id, s.version, s.text, s.tokens, s.kind});
    job.total_tokens = s.tokens;
    s.seg_job = jobs.enqueue(std::move(job));
  }

  void queue_group_job(Agent& a, uint64_t gid) {
    const Group* g = a.groups->find(gid);
    KEEP_CHECK(g != nullptr);
    cancel_group_job(a, gid);
    KvJob job;
    job.kind = KvJobKind::kGroup;
    job.agent = a.name;
    job.group_id = gid;
    job.group_version = g->version;
    uint64_t total = 0;
    for (uint64_t sid : g->members) {
      const Segment& s = a.segments.at(sid);
      job.segments.push_back(KvJobSegment{s.id, s.version, s.text, s.tokens, s.kind});
      total += s.tokens;
    }
    job.total_tokens = static_cast<uint32_t>(std::min<uint64_t>(total, UINT32_MAX));
    a.group_job[gid] = jobs.enqueue(std::move(job));
  }

  // After any membership/content change of a group that still exists.
  void on_group_changed(Agent& a, uint64_t gid, bool was_static) {
    if (was_static) counters.transitions_to_dynamic += 1;
    release_joint(a, gid);
    cancel_group_job(a, gid);
    const Group* g = a.groups->find(gid);
    KEEP_CHECK(g != nullptr);
    for (uint64_t sid : g->members) queue_segment_job(a, a.segments.at(sid));
  }

  void advance_to(Agent& a, uint64_t step) {
    a.step = step;
    for (uint64_t gid : a.groups->advance(step)) {
      counters.transitions_to_static += 1;
      queue_group_job(a, gid);
    }
  }

  // ---- placement -------------------------------------------------------------------------------

  void place(Agent& a, Segment& s) {
    const float* e = row_ptr(a, s);
    uint64_t exclude = 0;
    if (s.group != 0) {
      // Re-embedded after an update: stay or leave (docs/memory-model.md).
      const Group* g = a.groups->find(s.group);
      KEEP_CHECK(g != nullptr);
      bool has_other = false;
      const float cos = a.groups->cosine_without(s.group, s.id, e, &has_other);
      const bool stays = !has_other || (cos >= opt.tau && g->tokens <= a.groups->token_budget());
      if (stays) {
        a.groups->refresh_centroid(s.group);
        return;
      }
      exclude = s.group;
      const bool was_static = a.groups->remove_member(s.group, s.id, a.step);
      on_group_changed(a, s.group, was_static);
      s.group = 0;
    }
    uint64_t gid = a.groups->find_group(e, s.tokens, exclude);
    if (gid == 0) {
      gid = a.next_group_id++;
      a.groups->create_group(gid, a.step);
    }
    const bool was_static = a.groups->add_member(gid, s.id, a.step);
    s.group = gid;
    on_group_changed(a, gid, was_static);
  }

  // Places awaiting segments in write order up to the first without an embedding.
  void place_ready(Agent& a) {
    while (!a.awaiting.empty()) {
      auto it = a.awaiting.begin();
      Segment& s = a.segments.at(it->second);
      if (s.row < 0) break;
      a.awaiting.erase(it);
      s.awaiting = false;
      place(a, s);
    }
  }

  void enqueue_awaiting(Agent& a, Segment& s) {
    s.seq = next_seq++;
    s.awaiting = true;
    a.awaiting[s.seq] = s.id;
    to_embed[s.seq] = {&a, s.id};
  }

  void dequeue_awaiting(Agent& a, Segment& s) {
    if (!s.awaiting) return;
    a.awaiting.erase(s.seq);
    to_embed.erase(s.seq);
    s.awaiting = false;
  }

  // Back-pressure of the API's writes and updates (never of replay): one more segment without an
  // embedding would exceed max_pending_embeddings.
  Status check_backlog() const {
    if (opt.max_pending_embeddings == 0 || to_embed.size() < opt.max_pending_embeddings) {
      return Status::ok();
    }
    return Status(Code::kResourceExhausted,
                  "embedding backlog is full (" + std::to_string(to_embed.size()) +
                      " segments wait for their embedding, limit " +
                      std::to_string(opt.max_pending_embeddings) + "): retry later");
  }

  // ---- mutations (shared by the API and replay) -------------------------------------------------

  Status apply_write(const WriteRecord& r) {
    KEEP_RETURN_IF_ERROR(check_agent_name(r.agent));
    if (r.text.empty()) return invalid("text is empty");
    if (r.id == 0 || r.id > kMaxId) return invalid("segment id " + std::to_string(r.id));
    if (r.kind >= kSegmentKindCount) return invalid("segment kind " + std::to_string(r.kind));
    Agent* existing = find_agent(r.agent);
    if (existing != nullptr) {
      if (existing->segments.count(r.id) != 0) {
        return Status(Code::kAlreadyExists, "segment " + std::to_string(r.id) + " of agent '" +
                                                r.agent + "' already exists");
      }
      if (existing->segments.size() >= opt.max_segments_per_agent) {
        return Status(Code::kResourceExhausted,
                      "agent '" + r.agent + "' holds the maximum number of segments (" +
                          std::to_string(opt.max_segments_per_agent) + ")");
      }
      if (r.step < existing->step) {
        return invalid("step " + std::to_string(r.step) + " is before agent '" + r.agent +
                       "''s current step " + std::to_string(existing->step));
      }
    }
    KEEP_ASSIGN_OR_RETURN(Agent * a, get_or_create(r.agent));
    if (r.step > a->step) advance_to(*a, r.step);
    Segment& s = a->segments[r.id];
    s.id = r.id;
    s.text = r.text;
    s.kind = static_cast<SegmentKind>(r.kind);
    s.tokens = r.tokens;
    s.version = 1;
    s.updated_step = r.step;
    if (s.kind == SegmentKind::kExamplePlan) a->example_plans.insert(s.id);
    a->next_id = std::max(a->next_id, r.id + 1);
    enqueue_awaiting(*a, s);
    return Status::ok();
  }

  // The agent named `agent`: kInvalidArgument for a bad name, kNotFound for none.
  Result<Agent*> existing_agent(std::string_view agent) const {
    KEEP_RETURN_IF_ERROR(check_agent_name(agent));
    Agent* a = find_agent(agent);
    if (a == nullptr) return not_found_agent(agent);
    return a;
  }

  Status lookup(std::string_view agent, uint64_t id, Agent** a, Segment** s) const {
    KEEP_ASSIGN_OR_RETURN(*a, existing_agent(agent));
    *s = (*a)->find(id);
    if (*s == nullptr) return not_found_segment(agent, id);
    return Status::ok();
  }

  Status apply_update(const UpdateRecord& r) {
    Agent* a = nullptr;
    Segment* s = nullptr;
    KEEP_RETURN_IF_ERROR(lookup(r.agent, r.id, &a, &s));
    if (r.text.empty()) return invalid("text is empty");
    if (r.kind >= kSegmentKindCount) return invalid("segment kind " + std::to_string(r.kind));
    if (r.step < a->step) {
      return invalid("step " + std::to_string(r.step) + " is before agent '" + r.agent +
                     "''s current step " + std::to_string(a->step));
    }
    if (r.step > a->step) advance_to(*a, r.step);
    s->version += 1;
    s->text = r.text;
    if (s->kind == SegmentKind::kExamplePlan) a->example_plans.erase(s->id);
    s->kind = static_cast<SegmentKind>(r.kind);
    if (s->kind == SegmentKind::kExamplePlan) a->example_plans.insert(s->id);
    s->tokens = r.tokens;
    s->updated_step = r.step;
    release_own(*s);
    cancel_segment_job(*s);
    remove_row(*a, *s);
    dequeue_awaiting(*a, *s);
    enqueue_awaiting(*a, *s);
    if (s->group != 0) {
      const bool was_static = a->groups->touch(s->group, a->step);
      on_group_changed(*a, s->group, was_static);
    }
    // It may have blocked later segments at the head of the write order.
    place_ready(*a);
    return Status::ok();
  }

  Status apply_remove(const RemoveRecord& r) {
    Agent* a = nullptr;
    Segment* s = nullptr;
    KEEP_RETURN_IF_ERROR(lookup(r.agent, r.id, &a, &s));
    release_own(*s);
    cancel_segment_job(*s);
    remove_row(*a, *s);
    dequeue_awaiting(*a, *s);
    const uint64_t gid = s->group;
    if (gid != 0) {
      const bool was_static = a->groups->remove_member(gid, s->id, a->step);
      if (a->groups->find(gid)->members.empty()) {
        release_joint(*a, gid);
        cancel_group_job(*a, gid);
        a->groups->drop(gid);
      } else {
        on_group_changed(*a, gid, was_static);
      }
    }
    a->example_plans.erase(s->id);
    a->segments.erase(r.id);
    // A gap in the write order may unblock placement of later segments.
    place_ready(*a);
    return Status::ok();
  }

  Status apply_advance(const AdvanceStepRecord& r, uint64_t* new_step) {
    KEEP_RETURN_IF_ERROR(check_agent_name(r.agent));
    if (r.by == 0) return invalid("advance_step by 0 (must be >= 1)");
    Agent* existing = find_agent(r.agent);
    const uint64_t cur = existing == nullptr ? 0 : existing->step;
    if (r.by > UINT64_MAX - cur) return invalid("step overflow");
    KEEP_ASSIGN_OR_RETURN(Agent * a, get_or_create(r.agent));
    advance_to(*a, cur + r.by);
    if (new_step != nullptr) *new_step = a->step;
    return Status::ok();
  }

  // Installs already-validated embeddings; `normalise` false on replay (records hold normalised
  // vectors). Fills `installed` with what was installed (normalised).
  void install_embeddings(const std::vector<EmbeddingEntry>& in, bool normalise,
                          std::vector<EmbeddingEntry>* installed) {
    std::vector<Agent*> touched;
    std::vector<float> buf(static_cast<size_t>(dim));
    for (const EmbeddingEntry& e : in) {
      Agent* a = find_agent(e.agent);
      if (a == nullptr) continue;
      Segment* s = a->find(e.id);
      if (s == nullptr || s->version != e.version || s->row >= 0) continue;
      std::copy(e.embedding.begin(), e.embedding.end(), buf.begin());
      if (normalise) {
        double n = 0.0;
        for (float v : buf) n += static_cast<double>(v) * v;
        n = std::sqrt(n);
        if (n > 0.0) {
          for (float& v : buf) v = static_cast<float>(v / n);
        }
      }
      add_row(*a, *s, buf.data());
      to_embed.erase(s->seq);
      if (installed != nullptr) installed->push_back(EmbeddingEntry{e.agent, e.id, e.version, buf});
      if (std::find(touched.begin(), touched.end(), a) == touched.end()) touched.push_back(a);
    }
    for (Agent* a : touched) place_ready(*a);
  }

  Status check_embeddings(const std::vector<EmbeddingEntry>& in) const {
    for (const EmbeddingEntry& e : in) {
      if (e.embedding.size() != static_cast<size_t>(dim)) {
        return invalid("embedding of segment " + std::to_string(e.id) + " has " +
                       std::to_string(e.embedding.size()) + " floats, expected " +
                       std::to_string(dim));
      }
      for (float v : e.embedding) {
        if (!std::isfinite(v)) {
          return invalid("embedding of segment " + std::to_string(e.id) + " is not finite");
        }
      }
    }
    return Status::ok();
  }

  Result<size_t> apply_embedding_entries(const std::vector<EmbeddingEntry>& in,
                                         std::string* wal_record) {
    if (wal_record != nullptr) wal_record->clear();
    KEEP_RETURN_IF_ERROR(check_embeddings(in));
    EmbeddingsRecord rec;
    rec.dim = static_cast<uint32_t>(dim);
    install_embeddings(in, /*normalise=*/true, &rec.entries);
    const size_t n = rec.entries.size();
    if (n > 0 && wal_record != nullptr) *wal_record = encode_record(rec);
    return n;
  }

  // A retrieved segment's entry is used now; a segment whose KV was evicted gets its job again
  // (lazily: an evicted entry comes back only when something asks for it).
  void touch_kv(Agent& a, Segment& s, uint64_t now) {
    const Group* g = s.group == 0 ? nullptr : a.groups->find(s.group);
    if (g != nullptr && a.evicted_groups.erase(g->id) > 0 && g->state == GroupState::kStatic &&
        !a.joint.count(g->id) && !a.group_job.count(g->id)) {
      queue_group_job(a, g->id);
    }
    if (s.kv_evicted) {
      s.kv_evicted = false;
      if (!kv_ref(a, s)) queue_segment_job(a, s);
    }
    if (auto jt = g == nullptr ? a.joint.end() : a.joint.find(g->id); jt != a.joint.end()) {
      jt->second.last_used = now;
    }
    if (s.own_kv) s.own_kv->last_used = now;
  }

  // Releases the least recently used entries, oldest first, until `tokens` tokens are freed or
  // none is left; returns the tokens freed.
  uint64_t evict_lru(uint64_t tokens) {
    struct Victim {
      uint64_t last_used;
      Agent* agent;
      uint64_t id;  // segment id (own) or group id (joint)
      bool joint;
    };
    std::vector<Victim> v;
    for (auto& [name, a] : agents) {
      for (auto& [id, s] : a->segments) {
        if (s.own_kv) v.push_back({s.own_kv->last_used, a.get(), id, false});
      }
      for (auto& [gid, jk] : a->joint) v.push_back({jk.last_used, a.get(), gid, true});
    }
    std::sort(v.begin(), v.end(),
              [](const Victim& x, const Victim& y) { return x.last_used < y.last_used; });
    uint64_t freed = 0;
    for (const Victim& x : v) {
      if (freed >= tokens) break;
      const size_t before = released.size();
      if (x.joint) {
        release_joint(*x.agent, x.id);
        x.agent->evicted_groups.insert(x.id);
      } else {
        Segment& s = x.agent->segments.at(x.id);
        release_own(s);
        s.kv_evicted = true;
      }
      for (size_t i = before; i < released.size(); ++i) freed += released[i].tokens;
      counters.kv_evictions += 1;
    }
    return freed;
  }

  // ---- KV refs
  // -----------------------------------------------------------------------------------

  std::optional<KvRef> kv_ref(const Agent& a, const Segment& s) const {
    if (s.group != 0) {
      const Group* g = a.groups->find(s.group);
      auto jt = a.joint.find(s.group);
      if (g != nullptr && g->state == GroupState::kStatic && jt != a.joint.end() &&
          jt->second.group_version == g->version) {
        auto it = std::lower_bound(g->members.begin(), g->members.end(), s.id);
        const size_t i = static_cast<size_t>(it - g->members.begin());
        if (it != g->members.end() && *it == s.id && i < jt->second.offsets.size()) {
          return KvRef{jt->second.index,
                       jt->second.generation,
                       jt->second.offsets[i],
                       jt->second.tokens[i],
                       true,
                       s.version,
                       g->version};
        }
      }
    }
    if (s.own_kv && s.own_kv->segment_version == s.version) {
      return KvRef{s.own_kv->index, s.own_kv->generation, 0, s.own_kv->tokens, false, s.version, 0};
    }
    return std::nullopt;
  }

  SegmentInfo segment_info(const Agent& a, const Segment& s) const {
    SegmentInfo info;
    info.id = s.id;
    info.text = s.text;
    info.kind = s.kind;
    info.tokens = s.tokens;
    info.version = s.version;
    info.updated_step = s.updated_step;
    info.group_id = s.group;
    info.embedded = s.row >= 0;
    info.kv = kv_ref(a, s);
    return info;
  }

  // ---- query cache
  // -------------------------------------------------------------------------------

  // The cached embedding of `query` into query_vec (a hit, most recently used now); false on a
  // miss or with the cache off.
  bool cached_query(std::string_view query) {
    if (opt.query_cache_entries == 0) return false;
    auto it = lru_index.find(query);
    if (it == lru_index.end()) return false;
    lru.splice(lru.begin(), lru, it->second);
    query_vec = it->second->second;
    counters.query_cache_hits += 1;
    return true;
  }

  // An embedder's vector for `query`, normalised into query_vec and cached (a miss).
  Status set_query_embedding(std::string_view query, std::vector<float> v) {
    if (v.size() != static_cast<size_t>(dim)) {
      return Status(Code::kInternal, "embedder returned the wrong shape for the query");
    }
    counters.query_cache_misses += 1;
    double n = 0.0;
    for (float x : v) n += static_cast<double>(x) * x;
    n = std::sqrt(n);
    if (n > 0.0) {
      for (float& x : v) x = static_cast<float>(x / n);
    }
    query_vec = v;
    if (opt.query_cache_entries > 0) {
      lru.emplace_front(std::string(query), std::move(v));
      lru_index[std::string_view(lru.front().first)] = lru.begin();
      while (lru.size() > opt.query_cache_entries) {
        lru_index.erase(std::string_view(lru.back().first));
        lru.pop_back();
      }
    }
    return Status::ok();
  }

  Status query_embedding(std::string_view query) {
    if (cached_query(query)) return Status::ok();
    auto r = embedder->embed({std::string(query)});
    if (!r.is_ok()) return r.status().with_context("embedding the query");
    if (r->size() != 1) {
      return Status(Code::kInternal, "embedder returned the wrong shape for the query");
    }
    return set_query_embedding(query, std::move((*r)[0]));
  }

  // retrieve()'s checks; k clamped to max_retrieve_k.
  Result<Agent*> check_retrieve(std::string_view agent, std::string_view query, uint32_t* k) {
    KEEP_ASSIGN_OR_RETURN(Agent * a, existing_agent(agent));
    if (query.size() > opt.max_text_bytes) {
      return Status(Code::kTooLarge, "query is " + std::to_string(query.size()) + " bytes, limit " +
                                         std::to_string(opt.max_text_bytes));
    }
    if (query.empty() && *k > 0) return Status(Code::kInvalidArgument, "query is empty");
    KEEP_RETURN_IF_ERROR(check_encoding(query, "query"));
    *k = std::min(*k, opt.max_retrieve_k);
    return a;
  }

  // The agent's segments whose current version waits for an embedding, in write order.
  std::vector<PendingEmbedding> pending_of(const Agent& a) const {
    std::vector<PendingEmbedding> out;
    for (const auto& [seq, id] : a.awaiting) {
      const Segment& s = a.segments.at(id);
      if (s.row < 0) out.push_back(PendingEmbedding{a.name, id, s.version, s.text, s.seq});
    }
    return out;
  }

  // The answer of a retrieve for query_vec (k > 0) among a's embedded segments.
  std::vector<RetrievedSegment> retrieve_rows(Agent* a, uint32_t k);

  // Forgets agent `name` and everything it holds (drop_agent, replay of a drop record).
  void drop(std::string_view name) {
    auto it = agents.find(name);
    if (it == agents.end()) return;
    Agent& a = *it->second;
    for (auto& [id, s] : a.segments) {
      release_own(s);
      to_embed.erase(s.seq);  // its entries point at the agent
    }
    std::vector<uint64_t> joint;
    for (const auto& [gid, jk] : a.joint) joint.push_back(gid);
    for (uint64_t gid : joint) release_joint(a, gid);
    jobs.forget_agent(a.name);
    agents.erase(it);
  }

  void reset() {
    agents.clear();
    to_embed.clear();
    next_seq = 1;
    jobs.clear();
  }

  // Creates agent `as.name` (absent) from its snapshot, each segment's write order mapped
  // through `seq_of` (checked by the caller: unique, below next_seq once it is set). kCorrupt on
  // any inconsistency; the caller then forgets what was created.
  template <typename SeqOf>
  Status restore_agent(const AgentSnapshot& as, SeqOf seq_of);

  // KV is not persisted: asks again for every static group's and dynamic member's entry.
  void queue_agent_jobs(Agent& a) {
    for (const auto& [gid, g] : a.groups->groups()) {
      if (g.state == GroupState::kStatic) {
        queue_group_job(a, gid);
      } else {
        for (uint64_t sid : g.members) queue_segment_job(a, a.segments.at(sid));
      }
    }
  }
};

// ---- public API
// ----------------------------------------------------------------------------------

MemoryStore::MemoryStore(const StoreOptions& options, Embedder* embedder,
                         const TokenCounter* counter)
    : impl_(std::make_unique<Impl>(options, embedder, counter)) {}

MemoryStore::~MemoryStore() = default;

const StoreOptions& MemoryStore::options() const { return impl_->opt; }
int MemoryStore::dim() const { return impl_->dim; }

Result<WriteResult> MemoryStore::write(const WriteRequest& req, std::string* wal_record) {
  Impl& m = *impl_;
  if (wal_record != nullptr) wal_record->clear();
  KEEP_RETURN_IF_ERROR(m.check_agent_name(req.agent));
  KEEP_RETURN_IF_ERROR(m.check_text(req.text, "text"));
  if (req.step) KEEP_RETURN_IF_ERROR(m.check_step(*req.step));
  if (static_cast<uint8_t>(req.kind) >= kSegmentKindCount) {
    return invalid("segment kind " + std::to_string(static_cast<int>(req.kind)));
  }
  const Agent* a = m.find_agent(req.agent);
  WriteRecord rec;
  rec.agent = req.agent;
  if (req.id) {
    if (*req.id == 0 || *req.id > kMaxId) {
      return invalid("segment id " + std::to_string(*req.id) + " (ids are 1 .. 2^63-1)");
    }
    rec.id = *req.id;
  } else {
    rec.id = a == nullptr ? 1 : a->next_id;
    if (rec.id > kMaxId) return Status(Code::kResourceExhausted, "segment ids exhausted");
  }
  rec.kind = static_cast<uint8_t>(req.kind);
  rec.step = req.step.value_or(a == nullptr ? 0 : a->step);
  rec.tokens = m.counter->count_tokens(req.text);
  rec.text = req.text;
  KEEP_RETURN_IF_ERROR(m.check_backlog());
  KEEP_RETURN_IF_ERROR(m.apply_write(rec));
  if (wal_record != nullptr) *wal_record = encode_record(rec);
  return WriteResult{rec.id, 1, rec.step};
}

Result<WriteResult> MemoryStore::update(const UpdateRequest& req, std::string* wal_record) {
  Impl& m = *impl_;
  if (wal_record != nullptr) wal_record->clear();
  Agent* a = nullptr;
  Segment* s = nullptr;
  KEEP_RETURN_IF_ERROR(m.lookup(req.agent, req.id, &a, &s));
  KEEP_RETURN_IF_ERROR(m.check_text(req.text, "text"));
  if (req.step) KEEP_RETURN_IF_ERROR(m.check_step(*req.step));
  if (req.kind && static_cast<uint8_t>(*req.kind) >= kSegmentKindCount) {
    return invalid("segment kind " + std::to_string(static_cast<int>(*req.kind)));
  }
  const SegmentKind kind = req.kind.value_or(s->kind);
  if (req.step && *req.step < a->step) {
    return invalid("step " + std::to_string(*req.step) + " is before agent '" + req.agent +
                   "''s current step " + std::to_string(a->step));
  }
  if (kind == s->kind && req.text == s->text) {
    return WriteResult{s->id, s->version, s->updated_step};  // no change, no record
  }
  UpdateRecord rec;
  rec.agent = req.agent;
  rec.id = req.id;
  rec.kind = static_cast<uint8_t>(kind);
  rec.step = req.step.value_or(a->step);
  rec.tokens = m.counter->count_tokens(req.text);
  rec.text = req.text;
  // An update replaces the embedding: one more pending unless the old version was still pending.
  if (m.to_embed.count(s->seq) == 0) KEEP_RETURN_IF_ERROR(m.check_backlog());
  KEEP_RETURN_IF_ERROR(m.apply_update(rec));
  if (wal_record != nullptr) *wal_record = encode_record(rec);
  return WriteResult{s->id, s->version, s->updated_step};
}

Status MemoryStore::remove(std::string_view agent, uint64_t id, std::string* wal_record) {
  if (wal_record != nullptr) wal_record->clear();
  RemoveRecord rec{std::string(agent), id};
  KEEP_RETURN_IF_ERROR(impl_->apply_remove(rec));
  if (wal_record != nullptr) *wal_record = encode_record(rec);
  return Status::ok();
}

Result<uint64_t> MemoryStore::advance_step(std::string_view agent, uint64_t by,
                                           std::string* wal_record) {
  if (wal_record != nullptr) wal_record->clear();
  AdvanceStepRecord rec{std::string(agent), by};
  // At the door only: a log written before the bound existed must still replay.
  const Agent* a = impl_->find_agent(agent);
  const uint64_t cur = a == nullptr ? 0 : a->step;
  KEEP_RETURN_IF_ERROR(Impl::check_step(by > UINT64_MAX - cur ? UINT64_MAX : cur + by));
  uint64_t step = 0;
  KEEP_RETURN_IF_ERROR(impl_->apply_advance(rec, &step));
  if (wal_record != nullptr) *wal_record = encode_record(rec);
  return step;
}

std::vector<PendingEmbedding> MemoryStore::pending_embeddings(size_t max) const {
  std::vector<PendingEmbedding> out;
  for (const auto& [seq, ref] : impl_->to_embed) {
    if (out.size() >= max) break;
    const Segment& s = ref.first->segments.at(ref.second);
    out.push_back(PendingEmbedding{ref.first->name, s.id, s.version, s.text, s.seq});
  }
  return out;
}

Result<size_t> MemoryStore::apply_embeddings(const std::vector<SegmentEmbedding>& embeddings,
                                             std::string* wal_record) {
  std::vector<EmbeddingEntry> in;
  in.reserve(embeddings.size());
  for (const SegmentEmbedding& e : embeddings) {
    if (e.seq != 0) {  // computed for one write of the segment: not for a later incarnation
      Agent* a = impl_->find_agent(e.agent);
      const Segment* s = a == nullptr ? nullptr : a->find(e.id);
      if (s == nullptr || s->seq != e.seq) continue;
    }
    in.push_back(EmbeddingEntry{e.agent, e.id, e.version, e.embedding});
  }
  return impl_->apply_embedding_entries(in, wal_record);
}

LogPosition MemoryStore::log_position(std::string_view agent) const {
  const Agent* a = impl_->find_agent(agent);
  return a == nullptr ? LogPosition{} : a->log;
}

Status MemoryStore::set_log_position(std::string_view agent, LogPosition pos, std::string* record) {
  Agent* a = impl_->find_agent(agent);
  if (a == nullptr) return Impl::not_found_agent(agent);
  if (record == nullptr || record->empty()) {
    return invalid("set_log_position: no record to log for agent '" + std::string(agent) + "'");
  }
  a->log = pos;
  *record = encode_record(LoggedRecord{a->name, pos.seq, pos.epoch, std::move(*record)});
  return Status::ok();
}

Status MemoryStore::drop_agent(std::string_view agent, std::string* wal_record) {
  if (wal_record != nullptr) wal_record->clear();
  if (impl_->find_agent(agent) == nullptr) return Status::ok();
  impl_->drop(agent);
  if (wal_record != nullptr) *wal_record = encode_record(DropAgentRecord{std::string(agent)});
  return Status::ok();
}

namespace {

// The agent a mutation record is about and its op; nullptr for any other record.
const std::string* mutation_of(const Record& rec, MutationOp* op) {
  if (auto* w = std::get_if<WriteRecord>(&rec)) return *op = MutationOp::kWrite, &w->agent;
  if (auto* u = std::get_if<UpdateRecord>(&rec)) return *op = MutationOp::kUpdate, &u->agent;
  if (auto* r = std::get_if<RemoveRecord>(&rec)) return *op = MutationOp::kRemove, &r->agent;
  if (auto* a = std::get_if<AdvanceStepRecord>(&rec)) {
    return *op = MutationOp::kAdvanceStep, &a->agent;
  }
  return nullptr;
}

// Keeps `id` as the agent's newest request id, within `window`.
void keep_request(Agent* a, RequestId id, AppliedRequest applied, size_t window) {
  if (window == 0) return;
  a->requests.emplace_back(id, applied);
  while (a->requests.size() > window) a->requests.pop_front();
}

}  // namespace

std::optional<AppliedRequest> MemoryStore::find_request(std::string_view agent,
                                                        RequestId id) const {
  const Agent* a = impl_->find_agent(agent);
  if (a == nullptr || id.client == 0) return std::nullopt;
  for (auto it = a->requests.rbegin(); it != a->requests.rend(); ++it) {
    if (it->first == id) return it->second;
  }
  return std::nullopt;
}

Status MemoryStore::set_request(std::string_view agent, RequestId id, const WriteResult& result,
                                std::string* record) {
  Agent* a = impl_->find_agent(agent);
  if (a == nullptr) return Impl::not_found_agent(agent);
  if (id.client == 0) return invalid("set_request: request id of client 0");
  if (record == nullptr || record->empty()) {
    return invalid("set_request: no record for agent '" + std::string(agent) + "'");
  }
  if (impl_->opt.request_window == 0) return Status::ok();
  KEEP_ASSIGN_OR_RETURN(Record rec, decode_record(*record));
  MutationOp op{};
  const std::string* of = mutation_of(rec, &op);
  if (of == nullptr || *of != agent) {
    return invalid("set_request: the record is not a mutation of agent '" + std::string(agent) +
                   "'");
  }
  keep_request(a, id, AppliedRequest{op, result}, impl_->opt.request_window);
  *record = encode_record(RequestedRecord{a->name, id.client, id.seq, result.id, result.version,
                                          result.step, std::move(*record)});
  return Status::ok();
}

Status MemoryStore::apply_record(std::string_view bytes) {
  Impl& m = *impl_;
  KEEP_ASSIGN_OR_RETURN(Record rec, decode_record(bytes));
  if (auto* q = std::get_if<RequestedRecord>(&rec)) {
    KEEP_ASSIGN_OR_RETURN(Record inner, decode_record(q->inner));
    MutationOp op{};
    const std::string* of = mutation_of(inner, &op);
    if (of == nullptr || *of != q->agent) {
      return Status(Code::kCorrupt, "requested record of agent '" + q->agent +
                                        "' does not hold one of its mutations");
    }
    KEEP_RETURN_IF_ERROR(apply_record(q->inner));
    Agent* a = m.find_agent(q->agent);
    KEEP_CHECK(a != nullptr);  // a mutation leaves its agent in place
    keep_request(a, RequestId{q->client, q->seq},
                 AppliedRequest{op, WriteResult{q->id, q->version, q->step}}, m.opt.request_window);
    return Status::ok();
  }
  if (auto* l = std::get_if<LoggedRecord>(&rec)) {
    KEEP_ASSIGN_OR_RETURN(Record inner, decode_record(l->inner));
    MutationOp op{};
    const std::string* of = mutation_of(inner, &op);
    if (auto* q = std::get_if<RequestedRecord>(&inner)) of = &q->agent;
    if (of == nullptr || *of != l->agent) {
      return Status(Code::kCorrupt,
                    "logged record of agent '" + l->agent + "' does not hold one of its mutations");
    }
    KEEP_RETURN_IF_ERROR(apply_record(l->inner));
    Agent* a = m.find_agent(l->agent);
    KEEP_CHECK(a != nullptr);  // a mutation leaves its agent in place
    a->log = LogPosition{l->seq, l->epoch};
    return Status::ok();
  }
  if (auto* d = std::get_if<DropAgentRecord>(&rec)) {
    m.drop(d->agent);
    return Status::ok();
  }
  if (auto* st = std::get_if<AgentStateRecord>(&rec)) {
    KEEP_ASSIGN_OR_RETURN(StoreSnapshot snap, decode_snapshot(st->snapshot));
    if (snap.agents.size() != 1 || snap.agents[0].name != st->agent) {
      return Status(Code::kCorrupt,
                    "agent-state record of '" + st->agent + "' does not hold that agent alone");
    }
    return load_agent(st->snapshot, nullptr);
  }
  if (auto* w = std::get_if<WriteRecord>(&rec)) return m.apply_write(*w);
  if (auto* u = std::get_if<UpdateRecord>(&rec)) return m.apply_update(*u);
  if (auto* r = std::get_if<RemoveRecord>(&rec)) return m.apply_remove(*r);
  if (auto* a = std::get_if<AdvanceStepRecord>(&rec)) return m.apply_advance(*a, nullptr);
  auto& e = std::get<EmbeddingsRecord>(rec);
  if (e.dim != static_cast<uint32_t>(m.dim)) {
    return Status(Code::kVersionMismatch, "embeddings record of dimension " +
                                              std::to_string(e.dim) + ", the encoder has " +
                                              std::to_string(m.dim));
  }
  KEEP_RETURN_IF_ERROR(m.check_embeddings(e.entries).with_context("replaying embeddings"));
  m.install_embeddings(e.entries, /*normalise=*/false, nullptr);
  return Status::ok();
}

std::string MemoryStore::serialize() const { return encode_snapshot(capture()); }

StoreSnapshot MemoryStore::capture() const { return capture_of({}); }

StoreSnapshot MemoryStore::capture_of(std::optional<std::string_view> only) const {
  const Impl& m = *impl_;
  StoreSnapshot snap;
  snap.dim = static_cast<uint32_t>(m.dim);
  snap.next_seq = m.next_seq;
  for (const auto& [name, ap] : m.agents) {
    if (only.has_value() && name != *only) continue;
    const Agent& a = *ap;
    AgentSnapshot as;
    as.name = name;
    as.step = a.step;
    as.next_id = a.next_id;
    as.next_group_id = a.next_group_id;
    as.log_seq = a.log.seq;
    as.log_epoch = a.log.epoch;
    for (const auto& [id, applied] : a.requests) {
      as.requests.push_back(RequestSnapshot{id.client, id.seq, static_cast<uint8_t>(applied.op),
                                            applied.result.id, applied.result.version,
                                            applied.result.step});
    }
    for (const auto& [gid, g] : a.groups->groups()) {
      as.groups.push_back(
          GroupSnapshot{gid, static_cast<uint8_t>(g.state), g.version, g.last_change_step});
    }
    as.segments.reserve(a.segments.size());
    for (const auto& [id, s] : a.segments) {  // ascending id
      SegmentSnapshot ss;
      ss.id = id;
      ss.kind = static_cast<uint8_t>(s.kind);
      ss.version = s.version;
      ss.updated_step = s.updated_step;
      ss.tokens = s.tokens;
      ss.seq = s.seq;
      ss.group = s.group;
      ss.awaiting = s.awaiting;
      ss.text = s.text;
      if (s.row >= 0) {
        const float* e = m.row_ptr(a, s);
        ss.embedding.assign(e, e + m.dim);
      }
      as.segments.push_back(std::move(ss));
    }
    snap.agents.push_back(std::move(as));
  }
  return snap;
}

template <typename SeqOf>
Status MemoryStore::Impl::restore_agent(const AgentSnapshot& as, SeqOf seq_of) {
  Impl& m = *this;
  auto fail = [](std::string msg) { return Status(Code::kCorrupt, "store snapshot: " + msg); };
  if (!m.check_agent_name(as.name).is_ok()) return fail("bad agent name");
  if (as.next_id == 0 || as.next_group_id == 0) return fail("bad id counters");
  KEEP_ASSIGN_OR_RETURN(Agent * created, m.get_or_create(as.name));
  Agent& a = *created;
  a.step = as.step;
  a.next_id = as.next_id;
  a.next_group_id = as.next_group_id;
  a.log = LogPosition{as.log_seq, as.log_epoch};
  for (const RequestSnapshot& q : as.requests) {  // oldest first; the window may be smaller now
    keep_request(
        &a, RequestId{q.client, q.seq},
        AppliedRequest{static_cast<MutationOp>(q.op), WriteResult{q.id, q.version, q.step}},
        m.opt.request_window);
  }
  uint64_t prev = 0;
  for (const GroupSnapshot& g : as.groups) {
    if (g.id <= prev || g.id >= as.next_group_id) return fail("bad group id");
    if (g.version == 0) return fail("bad group version");
    prev = g.id;
    a.groups->restore_group(g.id, static_cast<GroupState>(g.state), g.version, g.last_change_step);
  }
  prev = 0;
  for (const SegmentSnapshot& ss : as.segments) {
    if (ss.id <= prev || ss.id >= as.next_id) return fail("bad segment id");
    prev = ss.id;
    if (ss.text.empty() || ss.version == 0) return fail("bad segment " + std::to_string(ss.id));
    if (ss.group != 0 && a.groups->find(ss.group) == nullptr) {
      return fail("segment " + std::to_string(ss.id) + " in an unknown group");
    }
    if (ss.group == 0 && !ss.awaiting) return fail("segment without group nor placement");
    if (ss.embedding.empty() && !ss.awaiting) return fail("unembedded segment not awaiting");
    for (float v : ss.embedding) {
      if (!std::isfinite(v)) return fail("non-finite embedding");
    }
    Segment& s = a.segments[ss.id];
    s.id = ss.id;
    s.text = ss.text;
    s.kind = static_cast<SegmentKind>(ss.kind);
    s.tokens = ss.tokens;
    s.version = ss.version;
    s.updated_step = ss.updated_step;
    s.seq = seq_of(ss.seq);
    s.group = ss.group;
    s.awaiting = ss.awaiting;
    if (s.kind == SegmentKind::kExamplePlan) a.example_plans.insert(s.id);
    if (!ss.embedding.empty()) m.add_row(a, s, ss.embedding.data());
    if (s.awaiting) {
      a.awaiting[s.seq] = s.id;
      if (s.row < 0) m.to_embed[s.seq] = {&a, s.id};
    }
    if (s.group != 0) a.groups->restore_member(s.group, s.id);
  }
  for (const auto& [gid, g] : a.groups->groups()) {
    if (g.members.empty()) return fail("empty group " + std::to_string(gid));
  }
  a.groups->finish_restore();
  return Status::ok();
}

Status MemoryStore::deserialize(std::string_view bytes) {
  Impl& m = *impl_;
  if (!m.agents.empty()) {
    return Status(Code::kInvalidArgument, "deserialize into a store that already holds agents");
  }
  KEEP_ASSIGN_OR_RETURN(StoreSnapshot snap, decode_snapshot(bytes));
  if (snap.dim != static_cast<uint32_t>(m.dim)) {
    return Status(Code::kVersionMismatch, "snapshot embeddings have dimension " +
                                              std::to_string(snap.dim) + ", the encoder has " +
                                              std::to_string(m.dim));
  }
  auto fail = [&m](std::string msg) {
    m.reset();
    return Status(Code::kCorrupt, "store snapshot: " + msg);
  };
  std::set<uint64_t> seqs;
  const std::string* prev_name = nullptr;
  for (const AgentSnapshot& as : snap.agents) {
    if (prev_name != nullptr && !(*prev_name < as.name)) return fail("agents not ascending");
    prev_name = &as.name;
    for (const SegmentSnapshot& ss : as.segments) {
      if (ss.seq == 0 || ss.seq >= snap.next_seq || !seqs.insert(ss.seq).second) {
        return fail("bad write sequence of segment " + std::to_string(ss.id));
      }
    }
    if (Status st = m.restore_agent(as, [](uint64_t seq) { return seq; }); !st.is_ok()) {
      m.reset();
      return st;
    }
  }
  m.next_seq = snap.next_seq;
  // KV is not persisted: ask for it again.
  for (auto& [name, ap] : m.agents) m.queue_agent_jobs(*ap);
  return Status::ok();
}

std::string MemoryStore::capture_agent(std::string_view agent) const {
  StoreSnapshot all = capture_of(agent);
  return all.agents.empty() ? std::string() : encode_snapshot(all);
}

Status MemoryStore::load_agent(std::string_view bytes, std::string* wal_record) {
  Impl& m = *impl_;
  if (wal_record != nullptr) wal_record->clear();
  KEEP_ASSIGN_OR_RETURN(StoreSnapshot snap, decode_snapshot(bytes));
  if (snap.dim != static_cast<uint32_t>(m.dim)) {
    return Status(Code::kVersionMismatch, "agent state: embeddings of dimension " +
                                              std::to_string(snap.dim) + ", the encoder has " +
                                              std::to_string(m.dim));
  }
  if (snap.agents.size() != 1) {
    return Status(Code::kCorrupt,
                  "agent state: " + std::to_string(snap.agents.size()) + " agents, expected one");
  }
  const AgentSnapshot& as = snap.agents[0];
  // The segments' write order is the other store's: renumbered after this store's, in order.
  std::map<uint64_t, uint64_t> order;
  for (const SegmentSnapshot& ss : as.segments) {
    if (ss.seq == 0 || !order.emplace(ss.seq, 0).second) {
      return Status(Code::kCorrupt,
                    "agent state: bad write sequence of segment " + std::to_string(ss.id));
    }
  }
  m.drop(as.name);
  for (auto& [from, to] : order) to = m.next_seq++;
  if (Status st = m.restore_agent(as, [&order](uint64_t seq) { return order.at(seq); });
      !st.is_ok()) {
    m.drop(as.name);
    return st;
  }
  m.queue_agent_jobs(*m.find_agent(as.name));
  if (wal_record != nullptr) {
    *wal_record = encode_record(AgentStateRecord{as.name, std::string(bytes)});
  }
  return Status::ok();
}

Result<std::vector<RetrievedSegment>> MemoryStore::retrieve(std::string_view agent,
                                                            std::string_view query, uint32_t k,
                                                            std::string* wal_record) {
  Impl& m = *impl_;
  if (wal_record != nullptr) wal_record->clear();
  KEEP_ASSIGN_OR_RETURN(Agent * a, m.check_retrieve(agent, query, &k));

  // The query first: nothing may fail after the pending embeddings below are applied (their
  // record must reach the WAL whenever the state changed).
  if (k > 0) KEEP_RETURN_IF_ERROR(m.query_embedding(query));

  // Read-your-writes: embed this agent's pending segments now.
  if (std::vector<PendingEmbedding> pending = m.pending_of(*a); !pending.empty()) {
    std::vector<std::string> texts;
    std::vector<EmbeddingEntry> entries;
    for (auto& p : pending) {
      texts.push_back(std::move(p.text));
      entries.push_back(EmbeddingEntry{std::move(p.agent), p.id, p.version, {}});
    }
    auto r = m.embedder->embed(texts);
    if (!r.is_ok()) return r.status().with_context("embedding pending segments");
    if (r->size() != texts.size()) {
      return Status(Code::kInternal, "embedder returned " + std::to_string(r->size()) +
                                         " vectors for " + std::to_string(texts.size()));
    }
    for (size_t i = 0; i < entries.size(); ++i) entries[i].embedding = std::move((*r)[i]);
    auto applied = m.apply_embedding_entries(entries, wal_record);
    if (!applied.is_ok()) return applied.status().with_context("embedding pending segments");
  }

  return m.retrieve_rows(a, k);
}

std::vector<RetrievedSegment> MemoryStore::Impl::retrieve_rows(Agent* a, uint32_t k) {
  Impl& m = *this;
  // Exact top-k among the non-plan segments (int8 scan + fp32 rescoring, embedding_index.h).
  m.top.clear();
  if (k > 0) a->index.top_k(m.query_vec.data(), k, &m.topk_scratch, &m.top);

  // Prompt order: static groups, then dynamic, by group id, then member id; ungrouped last.
  const auto order_key = [&](const ScoredRow& r) {
    const Segment& s = a->segments.at(a->index.key(r.row));
    const Group* g = s.group == 0 ? nullptr : a->groups->find(s.group);
    const int cls = g == nullptr ? 2 : (g->state == GroupState::kStatic ? 0 : 1);
    return std::tuple<int, uint64_t, uint64_t>(cls, s.group, s.id);
  };
  std::sort(m.top.begin(), m.top.end(),
            [&](const ScoredRow& x, const ScoredRow& y) { return order_key(x) < order_key(y); });

  std::vector<RetrievedSegment> out;
  out.reserve(a->example_plans.size() + m.top.size());
  const uint64_t now = ++m.use_clock;
  const auto emit = [&](const Segment& s, float score) {
    m.touch_kv(*a, a->segments.at(s.id), now);
    RetrievedSegment r;
    static_cast<SegmentInfo&>(r) = m.segment_info(*a, s);
    if (const Group* g = s.group == 0 ? nullptr : a->groups->find(s.group)) {
      r.group_state = g->state;
      r.group_version = g->version;
    }
    r.score = score;
    out.push_back(std::move(r));
  };
  for (uint64_t id : a->example_plans) {
    const Segment& s = a->segments.at(id);
    emit(s, s.row >= 0 && k > 0 ? a->index.score(static_cast<size_t>(s.row), m.query_vec.data())
                                : 0.0f);
  }
  for (const ScoredRow& r : m.top) emit(a->segments.at(a->index.key(r.row)), r.score);
  return out;
}

Result<MemoryStore::RetrieveNeeds> MemoryStore::retrieve_needs(std::string_view agent,
                                                               std::string_view query, uint32_t k) {
  Impl& m = *impl_;
  KEEP_ASSIGN_OR_RETURN(Agent * a, m.check_retrieve(agent, query, &k));
  RetrieveNeeds needs;
  needs.k = k;
  if (k > 0) {
    if (m.cached_query(query)) {
      needs.query_embedding = m.query_vec;
    } else {
      needs.embed_query = true;
    }
  }
  needs.segments = m.pending_of(*a);
  return needs;
}

Result<std::vector<float>> MemoryStore::add_query_embedding(std::string_view query,
                                                            std::vector<float> embedding) {
  KEEP_RETURN_IF_ERROR(impl_->set_query_embedding(query, std::move(embedding)));
  return impl_->query_vec;
}

Result<std::vector<RetrievedSegment>> MemoryStore::retrieve_embedded(
    std::string_view agent, std::span<const float> query_embedding, uint32_t k) {
  Impl& m = *impl_;
  KEEP_ASSIGN_OR_RETURN(Agent * a, m.existing_agent(agent));
  k = std::min(k, m.opt.max_retrieve_k);
  if (k > 0) {
    if (query_embedding.size() != static_cast<size_t>(m.dim)) {
      return invalid("query embedding of " + std::to_string(query_embedding.size()) +
                     " floats, the store's are " + std::to_string(m.dim));
    }
    m.query_vec.assign(query_embedding.begin(), query_embedding.end());
  }
  return m.retrieve_rows(a, k);
}

Embedder* MemoryStore::embedder() const { return impl_->embedder; }

bool MemoryStore::embedding_pending(std::string_view agent, uint64_t id, uint64_t version) const {
  const Agent* a = impl_->find_agent(agent);
  if (a == nullptr) return false;
  auto it = a->segments.find(id);
  return it != a->segments.end() && it->second.version == version && it->second.row < 0;
}

Result<SegmentInfo> MemoryStore::get(std::string_view agent, uint64_t id) const {
  Agent* a = nullptr;
  Segment* s = nullptr;
  KEEP_RETURN_IF_ERROR(impl_->lookup(agent, id, &a, &s));
  return impl_->segment_info(*a, *s);
}

Result<MemoryPage> MemoryStore::list_memories(std::string_view agent, uint64_t after_id,
                                              uint32_t limit) const {
  KEEP_ASSIGN_OR_RETURN(const Agent* a, impl_->existing_agent(agent));
  if (limit == 0) limit = kDefaultListLimit;
  limit = std::min(limit, impl_->opt.max_list_limit);
  MemoryPage page;
  size_t text_bytes = 0;
  auto it = a->segments.upper_bound(after_id);
  for (; it != a->segments.end() && page.memories.size() < limit; ++it) {
    if (!page.memories.empty() && text_bytes + it->second.text.size() > impl_->opt.max_list_bytes) {
      break;  // the page's answer stays well under a client's response limit
    }
    text_bytes += it->second.text.size();
    page.memories.push_back(impl_->segment_info(*a, it->second));
  }
  page.more = it != a->segments.end();
  return page;
}

Result<std::vector<GroupInfo>> MemoryStore::list_groups(std::string_view agent) const {
  KEEP_ASSIGN_OR_RETURN(const Agent* a, impl_->existing_agent(agent));
  std::vector<GroupInfo> out;
  for (const auto& [gid, g] : a->groups->groups()) {
    out.push_back(GroupInfo{gid, g.state, g.version, g.members, g.tokens, g.last_change_step,
                            a->joint.count(gid) != 0});
  }
  return out;
}

Result<uint64_t> MemoryStore::current_step(std::string_view agent) const {
  KEEP_ASSIGN_OR_RETURN(const Agent* a, impl_->existing_agent(agent));
  return a->step;
}

std::vector<std::string> MemoryStore::list_agents() const {
  std::vector<std::string> out;
  for (const auto& [name, a] : impl_->agents) out.push_back(name);
  return out;
}

StoreStats MemoryStore::stats() const {
  const Impl& m = *impl_;
  StoreStats st = m.counters;
  st.agents = m.agents.size();
  st.memories = 0;
  st.groups_static = 0;
  st.groups_dynamic = 0;
  for (const auto& [name, a] : m.agents) {
    st.memories += a->segments.size();
    for (const auto& [gid, g] : a->groups->groups()) {
      (g.state == GroupState::kStatic ? st.groups_static : st.groups_dynamic) += 1;
    }
  }
  st.pending_embeddings = m.to_embed.size();
  st.jobs_queued = m.jobs.queued();
  st.jobs_running = m.jobs.running();
  st.released_pending = m.released.size();
  return st;
}

std::vector<KvJob> MemoryStore::take_jobs(size_t max) { return impl_->jobs.take(max); }

Status MemoryStore::complete_job(uint64_t job_id, const KvEntry& entry,
                                 const std::vector<uint32_t>& slice_tokens) {
  Impl& m = *impl_;
  KvJobQueue::Entry* e = m.jobs.find(job_id);
  if (e == nullptr || !e->running) {
    return Status(Code::kNotFound, "no running KV job " + std::to_string(job_id));
  }
  KvJob job = std::move(e->job);
  m.jobs.erase(job_id);
  const auto stale = [&](const std::string& why) {
    m.released.push_back(entry);
    m.counters.jobs_stale += 1;
    return Status(Code::kStale, "KV job " + std::to_string(job_id) + ": " + why);
  };
  Agent* a = m.find_agent(job.agent);
  if (a == nullptr) return stale("agent is gone");
  if (job.kind == KvJobKind::kSegment) {
    const KvJobSegment& js = job.segments.at(0);
    Segment* s = a->find(js.id);
    if (s == nullptr) return stale("segment " + std::to_string(js.id) + " was deleted");
    if (s->seg_job == job_id) s->seg_job = 0;
    if (s->version != js.version) {
      return stale("segment " + std::to_string(js.id) + " is at version " +
                   std::to_string(s->version) + ", the KV is for " + std::to_string(js.version));
    }
    if (auto ref = m.kv_ref(*a, *s); ref && ref->joint) {
      return stale("superseded by the joint KV of group " + std::to_string(s->group));
    }
    m.release_own(*s);
    s->own_kv = OwnKv{entry.index, entry.generation, entry.tokens, s->version, ++m.use_clock};
    m.counters.jobs_completed += 1;
    return Status::ok();
  }
  // Group job.
  auto gj = a->group_job.find(job.group_id);
  if (gj != a->group_job.end() && gj->second == job_id) a->group_job.erase(gj);
  const Group* g = a->groups->find(job.group_id);
  if (g == nullptr) return stale("group " + std::to_string(job.group_id) + " is gone");
  if (g->version != job.group_version || g->state != GroupState::kStatic) {
    return stale("group " + std::to_string(job.group_id) + " changed since (version " +
                 std::to_string(g->version) + ", the KV is for " +
                 std::to_string(job.group_version) + ")");
  }
  JointKv jk;
  jk.index = entry.index;
  jk.generation = entry.generation;
  jk.group_version = g->version;
  if (!slice_tokens.empty()) {
    if (slice_tokens.size() != g->members.size()) {
      m.released.push_back(entry);
      return invalid("KV job " + std::to_string(job_id) + ": " +
                     std::to_string(slice_tokens.size()) + " slices for " +
                     std::to_string(g->members.size()) + " members");
    }
    jk.tokens = slice_tokens;
  } else {
    for (const KvJobSegment& js : job.segments) jk.tokens.push_back(js.tokens);
  }
  uint64_t off = 0;
  for (uint32_t t : jk.tokens) {
    jk.offsets.push_back(static_cast<uint32_t>(off));
    off += t;
  }
  if (off != entry.tokens) {
    m.released.push_back(entry);
    return invalid("KV job " + std::to_string(job_id) + ": slices sum to " + std::to_string(off) +
                   " tokens, the entry holds " + std::to_string(entry.tokens));
  }
  m.release_joint(*a, g->id);
  jk.last_used = ++m.use_clock;
  a->joint[g->id] = std::move(jk);
  for (uint64_t sid : g->members) {
    Segment& s = a->segments.at(sid);
    m.release_own(s);
    m.cancel_segment_job(s);
  }
  m.counters.jobs_completed += 1;
  return Status::ok();
}

Status MemoryStore::fail_job(uint64_t job_id) {
  Impl& m = *impl_;
  KvJobQueue::Entry* e = m.jobs.find(job_id);
  if (e == nullptr || !e->running) {
    return Status(Code::kNotFound, "no running KV job " + std::to_string(job_id));
  }
  m.counters.jobs_failed += 1;
  const KvJob& job = e->job;
  Agent* a = m.find_agent(job.agent);
  bool relevant = a != nullptr;
  Segment* s = nullptr;
  if (relevant && job.kind == KvJobKind::kSegment) {
    s = a->find(job.segments.at(0).id);
    relevant = s != nullptr && s->version == job.segments[0].version && s->seg_job == job_id;
  } else if (relevant) {
    const Group* g = a->groups->find(job.group_id);
    auto gj = a->group_job.find(job.group_id);
    relevant = g != nullptr && g->version == job.group_version && g->state == GroupState::kStatic &&
               gj != a->group_job.end() && gj->second == job_id;
  }
  if (relevant && job.attempt + 1 < m.opt.max_job_attempts) {
    m.jobs.requeue(job_id);
    return Status::ok();
  }
  if (relevant) {
    if (s != nullptr) {
      s->seg_job = 0;
    } else {
      a->group_job.erase(job.group_id);
    }
  }
  m.jobs.erase(job_id);
  return Status::ok();
}

uint64_t MemoryStore::evict_lru(uint64_t tokens) { return impl_->evict_lru(tokens); }

std::vector<KvEntry> MemoryStore::take_released_entries() {
  std::vector<KvEntry> out;
  out.swap(impl_->released);
  return out;
}

}  // namespace keep::manager
