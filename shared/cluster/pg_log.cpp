#include "shared/cluster/pg_log.h"

#include <libpq-fe.h>

#include <algorithm>
#include <charconv>
#include <cstdlib>
#include <string_view>
#include <thread>

namespace keep::cluster {

namespace {

struct ResultDeleter {
  void operator()(PGresult* r) const { PQclear(r); }
};
using PgResult = std::unique_ptr<PGresult, ResultDeleter>;

// Whether every table and index of kSchema exists. to_regclass reads the catalog and takes no
// lock on the tables: CREATE INDEX IF NOT EXISTS takes its ShareLock on the table before it looks
// for the index, which deadlocks with a running manager's commit (a checkpoint holds
// keep_checkpoint and then wants keep_log) -- a node restarting while others write.
constexpr char kSchemaExists[] =
    "SELECT to_regclass('keep_fence') IS NOT NULL AND to_regclass('keep_log') IS NOT NULL AND "
    "to_regclass('keep_log_by_shard') IS NOT NULL AND to_regclass('keep_checkpoint') IS NOT NULL "
    "AND to_regclass('keep_checkpoint_by_shard') IS NOT NULL";

// Two processes creating the tables at once would race in the catalog (a unique violation on
// pg_type): one transaction-scoped advisory lock orders them.
constexpr char kSchema[] =
    "BEGIN;"
    "SELECT pg_advisory_xact_lock(7601031);"
    "CREATE TABLE IF NOT EXISTS keep_fence (shard integer PRIMARY KEY, epoch bigint NOT NULL);"
    "CREATE TABLE IF NOT EXISTS keep_log (shard integer NOT NULL, agent text NOT NULL, "
    "seq bigint NOT NULL, epoch bigint NOT NULL, record bytea NOT NULL, "
    "PRIMARY KEY (agent, seq));"
    "CREATE INDEX IF NOT EXISTS keep_log_by_shard ON keep_log (shard, agent, seq);"
    "CREATE TABLE IF NOT EXISTS keep_checkpoint (shard integer NOT NULL, agent text PRIMARY KEY, "
    "seq bigint NOT NULL, epoch bigint NOT NULL, owner_epoch bigint NOT NULL, "
    "state bytea NOT NULL);"
    "CREATE INDEX IF NOT EXISTS keep_checkpoint_by_shard ON keep_checkpoint (shard, agent);"
    "COMMIT;";

// Tries at creating the tables when they collide with another process's transaction.
constexpr int kSchemaAttempts = 5;

// Rows of one multi-row INSERT (5 parameters each; PostgreSQL takes at most 65535).
constexpr size_t kRowsPerInsert = 1000;

uint64_t to_u64(const char* s) {
  uint64_t v = 0;
  std::from_chars(s, s + std::char_traits<char>::length(s), v);
  return v;
}

// A PostgreSQL array literal of text elements: {"a","b\"c"}.
std::string text_array(const std::map<std::string, uint64_t>& from) {
  std::string out = "{";
  for (const auto& [agent, seq] : from) {
    if (out.size() > 1) out += ',';
    out += '"';
    for (char c : agent) {
      if (c == '"' || c == '\\') out += '\\';
      out += c;
    }
    out += '"';
  }
  return out + "}";
}

std::string int_array(const std::map<std::string, uint64_t>& from) {
  std::string out = "{";
  for (const auto& [agent, seq] : from) {
    if (out.size() > 1) out += ',';
    out += std::to_string(seq);
  }
  return out + "}";
}

}  // namespace

struct PgLog::Impl {
  PGconn* conn = nullptr;
  ~Impl() {
    if (conn != nullptr) PQfinish(conn);
  }

  Status error(const std::string& what, PGresult* r = nullptr) const {
    const char* state = r != nullptr ? PQresultErrorField(r, PG_DIAG_SQLSTATE) : nullptr;
    const std::string msg = "postgresql: " + what + ": " + PQerrorMessage(conn);
    if (PQstatus(conn) != CONNECTION_OK) return Status(Code::kUnavailable, msg);
    if (state != nullptr && std::string(state) == "23505") return Status(Code::kAlreadyExists, msg);
    // Serialization failure, deadlock, shutdown in progress: a retry may succeed.
    if (state != nullptr && (std::string(state, 2) == "40" || std::string(state, 2) == "57")) {
      return Status(Code::kUnavailable, msg);
    }
    return Status(Code::kInternal, msg);
  }

  // A connection that broke (the server restarted) is reset once before a call.
  Status ready() {
    if (PQstatus(conn) == CONNECTION_OK) return Status::ok();
    PQreset(conn);
    if (PQstatus(conn) == CONNECTION_OK) return Status::ok();
    return Status(Code::kUnavailable, std::string("postgresql: ") + PQerrorMessage(conn));
  }

  // A statement without parameters; ok or the error.
  Status exec(const char* sql) {
    PgResult r(PQexec(conn, sql));
    const auto st = PQresultStatus(r.get());
    if (st != PGRES_COMMAND_OK && st != PGRES_TUPLES_OK) return error(sql, r.get());
    return Status::ok();
  }

  // Raises the fence inside the open transaction: true when `epoch` >= the shard's fence.
  Result<bool> raise_fence(uint32_t shard, uint64_t epoch) {
    const std::string s = std::to_string(shard), e = std::to_string(epoch);
    const char* params[] = {s.c_str(), e.c_str()};
    PgResult r(PQexecParams(conn,
                            "INSERT INTO keep_fence (shard, epoch) VALUES ($1, $2) "
                            "ON CONFLICT (shard) DO UPDATE SET epoch = EXCLUDED.epoch "
                            "WHERE keep_fence.epoch <= EXCLUDED.epoch RETURNING epoch",
                            2, nullptr, params, nullptr, nullptr, 0));
    if (PQresultStatus(r.get()) != PGRES_TUPLES_OK) return error("raising the fence", r.get());
    return PQntuples(r.get()) == 1;
  }

  void rollback() { PgResult r(PQexec(conn, "ROLLBACK")); }

  // Inserts `rows` (of `shard`, at `epoch`) inside the open transaction.
  Status insert(uint32_t shard, uint64_t epoch, const std::vector<LogRecord>& rows) {
    const std::string s = std::to_string(shard), e = std::to_string(epoch);
    for (size_t at = 0; at < rows.size(); at += kRowsPerInsert) {
      const size_t n = std::min(kRowsPerInsert, rows.size() - at);
      std::string sql = "INSERT INTO keep_log (shard, agent, seq, epoch, record) VALUES ";
      std::vector<std::string> seqs(n);
      std::vector<const char*> params;
      std::vector<int> lengths, formats;
      for (size_t i = 0; i < n; ++i) {
        const LogRecord& rec = rows[at + i];
        const size_t p = 5 * i;
        sql += (i ? ",($" : "($") + std::to_string(p + 1) + ",$" + std::to_string(p + 2) + ",$" +
               std::to_string(p + 3) + ",$" + std::to_string(p + 4) + ",$" + std::to_string(p + 5) +
               ")";
        seqs[i] = std::to_string(rec.seq);
        params.insert(params.end(), {s.c_str(), rec.agent.c_str(), seqs[i].c_str(), e.c_str(),
                                     rec.record.data()});
        lengths.insert(lengths.end(), {0, 0, 0, 0, static_cast<int>(rec.record.size())});
        formats.insert(formats.end(), {0, 0, 0, 0, 1});  // the record as binary bytea
      }
      PgResult r(PQexecParams(conn, sql.c_str(), static_cast<int>(params.size()), nullptr,
                              params.data(), lengths.data(), formats.data(), 0));
      if (PQresultStatus(r.get()) != PGRES_COMMAND_OK) {
        return error("appending " + std::to_string(n) + " records of shard " + s + " (" +
                         rows[at].agent + " #" + std::to_string(rows[at].seq) + "...)",
                     r.get());
      }
    }
    return Status::ok();
  }

  Status stale(uint32_t shard, uint64_t epoch) const {
    return Status(Code::kStale, "shard " + std::to_string(shard) +
                                    " has a newer owner than epoch " + std::to_string(epoch) +
                                    ": nothing written");
  }

  // Rows of a binary result (agent, seq, epoch, record) as records.
  static std::vector<LogRecord> rows(PGresult* r) {
    const auto be64 = [&](int row, int col) {
      const auto* p = reinterpret_cast<const unsigned char*>(PQgetvalue(r, row, col));
      uint64_t v = 0;
      for (int i = 0; i < 8; ++i) v = (v << 8) | p[i];
      return v;
    };
    std::vector<LogRecord> out;
    out.reserve(static_cast<size_t>(PQntuples(r)));
    for (int i = 0; i < PQntuples(r); ++i) {
      LogRecord rec;
      rec.agent.assign(PQgetvalue(r, i, 0), static_cast<size_t>(PQgetlength(r, i, 0)));
      rec.seq = be64(i, 1);
      rec.epoch = be64(i, 2);
      rec.record.assign(PQgetvalue(r, i, 3), static_cast<size_t>(PQgetlength(r, i, 3)));
      out.push_back(std::move(rec));
    }
    return out;
  }
};

PgLog::PgLog(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
PgLog::~PgLog() = default;

Result<std::unique_ptr<PgLog>> PgLog::connect(const std::string& conninfo) {
  auto impl = std::make_unique<Impl>();
  impl->conn = PQconnectdb(conninfo.c_str());
  if (PQstatus(impl->conn) != CONNECTION_OK) {
    return Status(Code::kUnavailable, std::string("postgresql: ") + PQerrorMessage(impl->conn));
  }
  PQsetNoticeProcessor(
      impl->conn, [](void*, const char*) {}, nullptr);  // "already exists"
  // Created by the first manager to start; the others only look. A deadlock with another
  // process's transaction (the first start, while others already write) is tried again.
  for (int attempt = 1;; ++attempt) {
    PgResult exists(PQexec(impl->conn, kSchemaExists));
    if (PQresultStatus(exists.get()) != PGRES_TUPLES_OK) {
      return impl->error("reading the catalog", exists.get());
    }
    if (std::string_view(PQgetvalue(exists.get(), 0, 0)) == "t") break;
    PgResult r(PQexec(impl->conn, kSchema));
    const auto rs = PQresultStatus(r.get());
    if (rs == PGRES_COMMAND_OK || rs == PGRES_TUPLES_OK) break;
    const Status st = impl->error("creating the tables", r.get());
    impl->rollback();
    if (st.code() != Code::kUnavailable || PQstatus(impl->conn) != CONNECTION_OK ||
        attempt == kSchemaAttempts) {
      return st;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50 * attempt));
  }
  return std::unique_ptr<PgLog>(new PgLog(std::move(impl)));
}

Status PgLog::fence(uint32_t shard, uint64_t epoch) {
  Impl& m = *impl_;
  KEEP_RETURN_IF_ERROR(m.ready());
  KEEP_RETURN_IF_ERROR(m.exec("BEGIN"));
  auto raised = m.raise_fence(shard, epoch);
  if (!raised.is_ok() || !*raised) {
    m.rollback();
    return raised.is_ok() ? m.stale(shard, epoch) : raised.status();
  }
  return m.exec("COMMIT");
}

Status PgLog::append(uint32_t shard, uint64_t epoch, const std::vector<LogRecord>& records) {
  KEEP_ASSIGN_OR_RETURN(std::vector<Status> st,
                        append_shards({ShardAppend{shard, epoch, records}}));
  return st.at(0);
}

Result<std::vector<Status>> PgLog::append_shards(const std::vector<ShardAppend>& batches) {
  Impl& m = *impl_;
  std::vector<Status> out(batches.size());
  std::vector<size_t> order(batches.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::sort(order.begin(), order.end(),
            [&](size_t a, size_t b) { return batches[a].shard < batches[b].shard; });
  KEEP_RETURN_IF_ERROR(m.ready());
  KEEP_RETURN_IF_ERROR(m.exec("BEGIN"));
  const auto fail = [&m](Status st) {
    m.rollback();
    return st;
  };
  bool any = false;
  for (size_t i : order) {
    auto raised = m.raise_fence(batches[i].shard, batches[i].epoch);
    if (!raised.is_ok()) return fail(raised.status());
    if (!*raised) {
      out[i] = m.stale(batches[i].shard, batches[i].epoch);
    } else {
      any = true;
    }
  }
  for (size_t i : order) {
    if (!out[i].is_ok()) continue;
    if (Status st = m.insert(batches[i].shard, batches[i].epoch, batches[i].records); !st.is_ok()) {
      return fail(st);
    }
  }
  if (!any) {
    m.rollback();
    return out;
  }
  KEEP_RETURN_IF_ERROR(m.exec("COMMIT"));
  return out;
}

Result<std::vector<LogRecord>> PgLog::read(const std::string& agent, uint64_t after_seq) {
  Impl& m = *impl_;
  KEEP_RETURN_IF_ERROR(m.ready());
  const std::string after = std::to_string(after_seq);
  const char* params[] = {agent.c_str(), after.c_str()};
  PgResult r(PQexecParams(m.conn,
                          "SELECT agent, seq, epoch, record FROM keep_log "
                          "WHERE agent = $1 AND seq > $2 ORDER BY seq",
                          2, nullptr, params, nullptr, nullptr, 1 /* binary results */));
  if (PQresultStatus(r.get()) != PGRES_TUPLES_OK) return m.error("reading " + agent, r.get());
  return Impl::rows(r.get());
}

Result<std::vector<LogRecord>> PgLog::read_shard(uint32_t shard,
                                                 const std::map<std::string, uint64_t>& from) {
  Impl& m = *impl_;
  KEEP_RETURN_IF_ERROR(m.ready());
  const std::string s = std::to_string(shard), agents = text_array(from), seqs = int_array(from);
  const char* params[] = {s.c_str(), agents.c_str(), seqs.c_str()};
  PgResult r(PQexecParams(m.conn,
                          "SELECT l.agent, l.seq, l.epoch, l.record FROM keep_log l "
                          "LEFT JOIN unnest($2::text[], $3::bigint[]) AS h(agent, seq) "
                          "ON h.agent = l.agent "
                          "WHERE l.shard = $1 AND l.seq >= coalesce(h.seq, 0) "
                          "ORDER BY l.agent, l.seq",
                          3, nullptr, params, nullptr, nullptr, 1 /* binary results */));
  if (PQresultStatus(r.get()) != PGRES_TUPLES_OK) {
    return m.error("reading shard " + s, r.get());
  }
  return Impl::rows(r.get());
}

Result<uint64_t> PgLog::last_seq(const std::string& agent) {
  Impl& m = *impl_;
  KEEP_RETURN_IF_ERROR(m.ready());
  const char* params[] = {agent.c_str()};
  PgResult r(PQexecParams(m.conn,
                          "SELECT greatest((SELECT max(seq) FROM keep_log WHERE agent = $1), "
                          "(SELECT seq FROM keep_checkpoint WHERE agent = $1), 0)",
                          1, nullptr, params, nullptr, nullptr, 0));
  if (PQresultStatus(r.get()) != PGRES_TUPLES_OK) return m.error("last seq of " + agent, r.get());
  return to_u64(PQgetvalue(r.get(), 0, 0));
}

Status PgLog::checkpoint(uint32_t shard, uint64_t owner_epoch, const Checkpoint& cp) {
  Impl& m = *impl_;
  KEEP_RETURN_IF_ERROR(m.ready());
  KEEP_RETURN_IF_ERROR(m.exec("BEGIN"));
  const auto fail = [&m](Status st) {
    m.rollback();
    return st;
  };
  auto raised = m.raise_fence(shard, owner_epoch);
  if (!raised.is_ok()) return fail(raised.status());
  if (!*raised) return fail(m.stale(shard, owner_epoch));
  const std::string s = std::to_string(shard), seq = std::to_string(cp.seq),
                    e = std::to_string(cp.epoch), oe = std::to_string(owner_epoch);
  {  // The state must be the log's prefix: its last entry is in the log, or already compacted.
    const char* params[] = {cp.agent.c_str(), seq.c_str(), e.c_str()};
    PgResult r(PQexecParams(m.conn,
                            "SELECT EXISTS (SELECT 1 FROM keep_log WHERE agent = $1 AND seq = $2 "
                            "AND epoch = $3) OR EXISTS (SELECT 1 FROM keep_checkpoint "
                            "WHERE agent = $1 AND seq >= $2)",
                            3, nullptr, params, nullptr, nullptr, 0));
    if (PQresultStatus(r.get()) != PGRES_TUPLES_OK) {
      return fail(m.error("checking the log of " + cp.agent, r.get()));
    }
    if (std::string(PQgetvalue(r.get(), 0, 0)) != "t") {
      return fail(Status(Code::kCorrupt, "checkpoint of agent '" + cp.agent + "' at entry " + seq +
                                             " (epoch " + e +
                                             "): the log has no such entry: nothing written"));
    }
  }
  {
    const char* params[] = {s.c_str(), cp.agent.c_str(), seq.c_str(),
                            e.c_str(), oe.c_str(),       cp.state.data()};
    const int lengths[] = {0, 0, 0, 0, 0, static_cast<int>(cp.state.size())};
    const int formats[] = {0, 0, 0, 0, 0, 1};
    PgResult r(PQexecParams(m.conn,
                            "INSERT INTO keep_checkpoint (shard, agent, seq, epoch, owner_epoch, "
                            "state) VALUES ($1, $2, $3, $4, $5, $6) ON CONFLICT (agent) DO UPDATE "
                            "SET shard = EXCLUDED.shard, seq = EXCLUDED.seq, epoch = "
                            "EXCLUDED.epoch, owner_epoch = EXCLUDED.owner_epoch, state = "
                            "EXCLUDED.state WHERE keep_checkpoint.seq < EXCLUDED.seq",
                            6, nullptr, params, lengths, formats, 0));
    if (PQresultStatus(r.get()) != PGRES_COMMAND_OK) {
      return fail(m.error("writing the checkpoint of " + cp.agent, r.get()));
    }
  }
  {
    const char* params[] = {cp.agent.c_str(), seq.c_str()};
    PgResult r(PQexecParams(m.conn, "DELETE FROM keep_log WHERE agent = $1 AND seq <= $2", 2,
                            nullptr, params, nullptr, nullptr, 0));
    if (PQresultStatus(r.get()) != PGRES_COMMAND_OK) {
      return fail(m.error("compacting the log of " + cp.agent, r.get()));
    }
  }
  return m.exec("COMMIT");
}

Result<std::vector<Checkpoint>> PgLog::read_checkpoints(uint32_t shard) {
  Impl& m = *impl_;
  KEEP_RETURN_IF_ERROR(m.ready());
  const std::string s = std::to_string(shard);
  const char* params[] = {s.c_str()};
  PgResult r(PQexecParams(m.conn,
                          "SELECT agent, seq, epoch, owner_epoch, state FROM keep_checkpoint "
                          "WHERE shard = $1 ORDER BY agent",
                          1, nullptr, params, nullptr, nullptr, 1 /* binary results */));
  if (PQresultStatus(r.get()) != PGRES_TUPLES_OK) {
    return m.error("reading the checkpoints of shard " + s, r.get());
  }
  const auto be64 = [&](int row, int col) {
    const auto* p = reinterpret_cast<const unsigned char*>(PQgetvalue(r.get(), row, col));
    uint64_t v = 0;
    for (int i = 0; i < 8; ++i) v = (v << 8) | p[i];
    return v;
  };
  std::vector<Checkpoint> out;
  for (int i = 0; i < PQntuples(r.get()); ++i) {
    Checkpoint cp;
    cp.agent.assign(PQgetvalue(r.get(), i, 0), static_cast<size_t>(PQgetlength(r.get(), i, 0)));
    cp.seq = be64(i, 1);
    cp.epoch = be64(i, 2);
    cp.owner_epoch = be64(i, 3);
    cp.state.assign(PQgetvalue(r.get(), i, 4), static_cast<size_t>(PQgetlength(r.get(), i, 4)));
    out.push_back(std::move(cp));
  }
  return out;
}

}  // namespace keep::cluster
