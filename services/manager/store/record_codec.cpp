#include "services/manager/store/record_codec.h"

#include <bit>
#include <cstring>
#include <type_traits>

namespace keep::manager {
namespace {

class ByteWriter {
 public:
  explicit ByteWriter(std::string* out) : out_(out) {}
  void u8(uint8_t v) { out_->push_back(static_cast<char>(v)); }
  void u16(uint16_t v) { put_le(v, 2); }
  void u32(uint32_t v) { put_le(v, 4); }
  void u64(uint64_t v) { put_le(v, 8); }
  void f32(float v) { u32(std::bit_cast<uint32_t>(v)); }
  void str(std::string_view s) {
    u32(static_cast<uint32_t>(s.size()));
    out_->append(s.data(), s.size());
  }
  void floats(const std::vector<float>& v) {
    u32(static_cast<uint32_t>(v.size()));
    for (float f : v) f32(f);
  }

 private:
  void put_le(uint64_t v, int bytes) {
    char buf[8];
    for (int i = 0; i < bytes; ++i) buf[i] = static_cast<char>((v >> (8 * i)) & 0xff);
    out_->append(buf, static_cast<size_t>(bytes));
  }
  std::string* out_;
};

// Bounds-checked reader: every getter returns false (and sets failed) past the end.
class ByteReader {
 public:
  explicit ByteReader(std::string_view in) : in_(in) {}
  size_t remaining() const { return in_.size() - pos_; }
  bool u8(uint8_t* v) {
    uint64_t x;
    if (!get_le(&x, 1)) return false;
    *v = static_cast<uint8_t>(x);
    return true;
  }
  bool u16(uint16_t* v) {
    uint64_t x;
    if (!get_le(&x, 2)) return false;
    *v = static_cast<uint16_t>(x);
    return true;
  }
  bool u32(uint32_t* v) {
    uint64_t x;
    if (!get_le(&x, 4)) return false;
    *v = static_cast<uint32_t>(x);
    return true;
  }
  bool u64(uint64_t* v) { return get_le(v, 8); }
  bool f32(float* v) {
    uint32_t x;
    if (!u32(&x)) return false;
    *v = std::bit_cast<float>(x);
    return true;
  }
  bool boolean(bool* v) {
    uint8_t x;
    if (!u8(&x) || x > 1) return false;
    *v = x != 0;
    return true;
  }
  bool str(std::string* s) {
    uint32_t n;
    if (!u32(&n) || n > remaining()) return false;
    s->assign(in_.data() + pos_, n);
    pos_ += n;
    return true;
  }
  // Reads a u32 count and checks that count * min_item_bytes fits in what is left.
  bool count(uint32_t* n, size_t min_item_bytes) {
    if (!u32(n)) return false;
    return min_item_bytes == 0 || *n <= remaining() / min_item_bytes;
  }
  bool floats(std::vector<float>* v) {
    uint32_t n;
    if (!count(&n, 4)) return false;
    v->resize(n);
    for (uint32_t i = 0; i < n; ++i) f32(&(*v)[i]);
    return true;
  }

 private:
  bool get_le(uint64_t* v, int bytes) {
    if (remaining() < static_cast<size_t>(bytes)) return false;
    uint64_t x = 0;
    for (int i = 0; i < bytes; ++i) {
      x |= static_cast<uint64_t>(static_cast<uint8_t>(in_[pos_ + static_cast<size_t>(i)]))
           << (8 * i);
    }
    pos_ += static_cast<size_t>(bytes);
    *v = x;
    return true;
  }
  std::string_view in_;
  size_t pos_ = 0;
};

Status corrupt(std::string_view what) {
  return Status(Code::kCorrupt, "store record: " + std::string(what));
}

}  // namespace

std::string encode_record(const Record& record) {
  std::string out;
  ByteWriter w(&out);
  w.u8(kRecordFormatVersion);
  std::visit(
      [&](const auto& r) {
        using T = std::decay_t<decltype(r)>;
        if constexpr (std::is_same_v<T, WriteRecord>) {
          w.u8(static_cast<uint8_t>(RecordType::kWrite));
          w.str(r.agent);
          w.u64(r.id);
          w.u8(r.kind);
          w.u64(r.step);
          w.u32(r.tokens);
          w.str(r.text);
        } else if constexpr (std::is_same_v<T, UpdateRecord>) {
          w.u8(static_cast<uint8_t>(RecordType::kUpdate));
          w.str(r.agent);
          w.u64(r.id);
          w.u8(r.kind);
          w.u64(r.step);
          w.u32(r.tokens);
          w.str(r.text);
        } else if constexpr (std::is_same_v<T, RemoveRecord>) {
          w.u8(static_cast<uint8_t>(RecordType::kRemove));
          w.str(r.agent);
          w.u64(r.id);
        } else if constexpr (std::is_same_v<T, AdvanceStepRecord>) {
          w.u8(static_cast<uint8_t>(RecordType::kAdvanceStep));
          w.str(r.agent);
          w.u64(r.by);
        } else if constexpr (std::is_same_v<T, LoggedRecord>) {
          w.u8(static_cast<uint8_t>(RecordType::kLogged));
          w.str(r.agent);
          w.u64(r.seq);
          w.u64(r.epoch);
          w.str(r.inner);
        } else if constexpr (std::is_same_v<T, DropAgentRecord>) {
          w.u8(static_cast<uint8_t>(RecordType::kDropAgent));
          w.str(r.agent);
        } else if constexpr (std::is_same_v<T, AgentStateRecord>) {
          w.u8(static_cast<uint8_t>(RecordType::kAgentState));
          w.str(r.agent);
          w.str(r.snapshot);
        } else if constexpr (std::is_same_v<T, RequestedRecord>) {
          w.u8(static_cast<uint8_t>(RecordType::kRequested));
          w.str(r.agent);
          w.u64(r.client);
          w.u64(r.seq);
          w.u64(r.id);
          w.u64(r.version);
          w.u64(r.step);
          w.str(r.inner);
        } else {
          static_assert(std::is_same_v<T, EmbeddingsRecord>);
          w.u8(static_cast<uint8_t>(RecordType::kEmbeddings));
          w.u32(r.dim);
          w.u32(static_cast<uint32_t>(r.entries.size()));
          for (const EmbeddingEntry& e : r.entries) {
            w.str(e.agent);
            w.u64(e.id);
            w.u64(e.version);
            for (float f : e.embedding) w.f32(f);
          }
        }
      },
      record);
  return out;
}

Result<Record> decode_record(std::string_view bytes) {
  ByteReader r(bytes);
  uint8_t version = 0, type = 0;
  if (!r.u8(&version) || !r.u8(&type)) return corrupt("shorter than its header");
  if (version != kRecordFormatVersion) {
    return Status(Code::kVersionMismatch, "store record: format version " +
                                              std::to_string(version) + ", expected " +
                                              std::to_string(kRecordFormatVersion));
  }
  Record out;
  bool ok = false;
  switch (static_cast<RecordType>(type)) {
    case RecordType::kWrite: {
      WriteRecord w;
      ok = r.str(&w.agent) && r.u64(&w.id) && r.u8(&w.kind) && r.u64(&w.step) && r.u32(&w.tokens) &&
           r.str(&w.text);
      out = std::move(w);
      break;
    }
    case RecordType::kUpdate: {
      UpdateRecord u;
      ok = r.str(&u.agent) && r.u64(&u.id) && r.u8(&u.kind) && r.u64(&u.step) && r.u32(&u.tokens) &&
           r.str(&u.text);
      out = std::move(u);
      break;
    }
    case RecordType::kRemove: {
      RemoveRecord m;
      ok = r.str(&m.agent) && r.u64(&m.id);
      out = std::move(m);
      break;
    }
    case RecordType::kAdvanceStep: {
      AdvanceStepRecord a;
      ok = r.str(&a.agent) && r.u64(&a.by);
      out = std::move(a);
      break;
    }
    case RecordType::kEmbeddings: {
      EmbeddingsRecord e;
      uint32_t n = 0;
      if (!r.u32(&e.dim) || e.dim == 0) return corrupt("embeddings record: bad dimension");
      // Each entry takes at least 4 (agent length) + 16 (id, version) + 4 * dim bytes.
      const size_t min_entry = 20 + 4 * static_cast<size_t>(e.dim);
      if (!r.count(&n, min_entry)) return corrupt("embeddings record: count past the end");
      e.entries.resize(n);
      ok = true;
      for (uint32_t i = 0; ok && i < n; ++i) {
        EmbeddingEntry& en = e.entries[i];
        ok = r.str(&en.agent) && r.u64(&en.id) && r.u64(&en.version) && r.remaining() / 4 >= e.dim;
        if (!ok) break;
        en.embedding.resize(e.dim);
        for (uint32_t j = 0; j < e.dim; ++j) r.f32(&en.embedding[j]);
      }
      out = std::move(e);
      break;
    }
    case RecordType::kLogged: {
      LoggedRecord l;
      ok = r.str(&l.agent) && r.u64(&l.seq) && r.u64(&l.epoch) && r.str(&l.inner);
      out = std::move(l);
      break;
    }
    case RecordType::kDropAgent: {
      DropAgentRecord d;
      ok = r.str(&d.agent);
      out = std::move(d);
      break;
    }
    case RecordType::kRequested: {
      RequestedRecord q;
      ok = r.str(&q.agent) && r.u64(&q.client) && r.u64(&q.seq) && r.u64(&q.id) &&
           r.u64(&q.version) && r.u64(&q.step) && r.str(&q.inner) && q.client != 0;
      out = std::move(q);
      break;
    }
    case RecordType::kAgentState: {
      AgentStateRecord a;
      ok = r.str(&a.agent) && r.str(&a.snapshot);
      out = std::move(a);
      break;
    }
    default:
      return corrupt("unknown record type " + std::to_string(type));
  }
  if (!ok) return corrupt("truncated or inconsistent body (type " + std::to_string(type) + ")");
  if (r.remaining() != 0) return corrupt(std::to_string(r.remaining()) + " trailing bytes");
  return out;
}

std::string encode_snapshot(const StoreSnapshot& s) {
  std::string out;
  ByteWriter w(&out);
  w.u32(kSnapshotMagic);
  w.u16(kSnapshotFormatVersion);
  w.u32(s.dim);
  w.u64(s.next_seq);
  w.u32(static_cast<uint32_t>(s.agents.size()));
  for (const AgentSnapshot& a : s.agents) {
    w.str(a.name);
    w.u64(a.step);
    w.u64(a.next_id);
    w.u64(a.next_group_id);
    w.u64(a.log_seq);
    w.u64(a.log_epoch);
    w.u32(static_cast<uint32_t>(a.requests.size()));
    for (const RequestSnapshot& q : a.requests) {
      w.u64(q.client);
      w.u64(q.seq);
      w.u8(q.op);
      w.u64(q.id);
      w.u64(q.version);
      w.u64(q.step);
    }
    w.u32(static_cast<uint32_t>(a.groups.size()));
    for (const GroupSnapshot& g : a.groups) {
      w.u64(g.id);
      w.u8(g.state);
      w.u64(g.version);
      w.u64(g.last_change_step);
    }
    w.u32(static_cast<uint32_t>(a.segments.size()));
    for (const SegmentSnapshot& seg : a.segments) {
      w.u64(seg.id);
      w.u8(seg.kind);
      w.u64(seg.version);
      w.u64(seg.updated_step);
      w.u32(seg.tokens);
      w.u64(seg.seq);
      w.u64(seg.group);
      w.u8(seg.awaiting ? 1 : 0);
      w.str(seg.text);
      w.floats(seg.embedding);
    }
  }
  return out;
}

Result<StoreSnapshot> decode_snapshot(std::string_view bytes) {
  ByteReader r(bytes);
  uint32_t magic = 0;
  uint16_t version = 0;
  if (!r.u32(&magic) || magic != kSnapshotMagic) return corrupt("snapshot: bad magic");
  if (!r.u16(&version)) return corrupt("snapshot: truncated header");
  if (version < 1 || version > kSnapshotFormatVersion) {
    return Status(Code::kVersionMismatch, "store snapshot: format version " +
                                              std::to_string(version) + ", expected " +
                                              std::to_string(kSnapshotFormatVersion));
  }
  const bool has_log = version >= 2;       // version 1: no log positions
  const bool has_requests = version >= 3;  // versions 1, 2: no request ids
  StoreSnapshot s;
  uint32_t n_agents = 0;
  if (!r.u32(&s.dim) || !r.u64(&s.next_seq) ||
      !r.count(&n_agents, 4 + 24 + (has_log ? 16 : 0) + (has_requests ? 4 : 0) + 8)) {
    return corrupt("snapshot: truncated header");
  }
  s.agents.resize(n_agents);
  for (AgentSnapshot& a : s.agents) {
    uint32_t n_groups = 0, n_segs = 0;
    if (!r.str(&a.name) || !r.u64(&a.step) || !r.u64(&a.next_id) || !r.u64(&a.next_group_id) ||
        (has_log && (!r.u64(&a.log_seq) || !r.u64(&a.log_epoch)))) {
      return corrupt("snapshot: truncated agent");
    }
    uint32_t n_requests = 0;
    if (has_requests && !r.count(&n_requests, 41)) {
      return corrupt("snapshot: request count past the end");
    }
    a.requests.resize(n_requests);
    for (RequestSnapshot& q : a.requests) {
      if (!r.u64(&q.client) || !r.u64(&q.seq) || !r.u8(&q.op) || !r.u64(&q.id) ||
          !r.u64(&q.version) || !r.u64(&q.step) || q.client == 0 ||
          q.op < static_cast<uint8_t>(RecordType::kWrite) ||
          q.op > static_cast<uint8_t>(RecordType::kAdvanceStep)) {
        return corrupt("snapshot: bad request id of agent '" + a.name + "'");
      }
    }
    if (!r.count(&n_groups, 25)) return corrupt("snapshot: truncated agent");
    a.groups.resize(n_groups);
    for (GroupSnapshot& g : a.groups) {
      if (!r.u64(&g.id) || !r.u8(&g.state) || !r.u64(&g.version) || !r.u64(&g.last_change_step) ||
          g.state > 1) {
        return corrupt("snapshot: bad group of agent '" + a.name + "'");
      }
    }
    if (!r.count(&n_segs, 54)) return corrupt("snapshot: segment count past the end");
    a.segments.resize(n_segs);
    for (SegmentSnapshot& seg : a.segments) {
      if (!r.u64(&seg.id) || !r.u8(&seg.kind) || !r.u64(&seg.version) ||
          !r.u64(&seg.updated_step) || !r.u32(&seg.tokens) || !r.u64(&seg.seq) ||
          !r.u64(&seg.group) || !r.boolean(&seg.awaiting) || !r.str(&seg.text) ||
          !r.floats(&seg.embedding)) {
        return corrupt("snapshot: truncated segment of agent '" + a.name + "'");
      }
      if (seg.kind > 2) return corrupt("snapshot: bad segment kind");
      if (!seg.embedding.empty() && seg.embedding.size() != s.dim) {
        return corrupt("snapshot: embedding of segment " + std::to_string(seg.id) +
                       " has the wrong dimension");
      }
    }
  }
  if (r.remaining() != 0) return corrupt("snapshot: trailing bytes");
  return s;
}

}  // namespace keep::manager
