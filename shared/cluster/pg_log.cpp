#include "shared/cluster/pg_log.h"

#include <libpq-fe.h>

#include <charconv>
#include <cstdlib>

namespace keep::cluster {

namespace {

struct ResultDeleter {
  void operator()(PGresult* r) const { PQclear(r); }
};
using PgResult = std::unique_ptr<PGresult, ResultDeleter>;

constexpr char kSchema[] =
    "CREATE TABLE IF NOT EXISTS keep_fence (shard integer PRIMARY KEY, epoch bigint NOT NULL);"
    "CREATE TABLE IF NOT EXISTS keep_log (agent text NOT NULL, seq bigint NOT NULL, "
    "epoch bigint NOT NULL, record bytea NOT NULL, PRIMARY KEY (agent, seq));";

uint64_t to_u64(const char* s) {
  uint64_t v = 0;
  std::from_chars(s, s + std::char_traits<char>::length(s), v);
  return v;
}

}  // namespace

struct PgLog::Impl {
  PGconn* conn = nullptr;
  ~Impl() {
    if (conn != nullptr) PQfinish(conn);
  }

  Status error(const std::string& what, PGresult* r = nullptr) const {
    const char* state = r != nullptr ? PQresultErrorField(r, PG_DIAG_SQLSTATE) : nullptr;
    const std::string msg = what + ": " + PQerrorMessage(conn);
    if (PQstatus(conn) != CONNECTION_OK) return Status(Code::kUnavailable, msg);
    if (state != nullptr && std::string(state) == "23505") return Status(Code::kAlreadyExists, msg);
    return Status(Code::kInternal, msg);
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

  // BEGIN, then the fence raised to `epoch`: the transaction stays open on success; rolled back
  // and kStale when the shard is fenced above `epoch`.
  Status begin_fenced(uint32_t shard, uint64_t epoch) {
    KEEP_RETURN_IF_ERROR(exec("BEGIN"));
    auto raised = raise_fence(shard, epoch);
    if (raised.is_ok() && *raised) return Status::ok();
    rollback();
    if (!raised.is_ok()) return raised.status();
    return Status(Code::kStale, "shard " + std::to_string(shard) +
                                    " has a newer owner than epoch " + std::to_string(epoch) +
                                    ": nothing written");
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
  KEEP_RETURN_IF_ERROR(impl->exec(kSchema));
  return std::unique_ptr<PgLog>(new PgLog(std::move(impl)));
}

Status PgLog::fence(uint32_t shard, uint64_t epoch) {
  KEEP_RETURN_IF_ERROR(impl_->begin_fenced(shard, epoch));
  return impl_->exec("COMMIT");
}

Status PgLog::append(uint32_t shard, uint64_t epoch, const std::vector<LogRecord>& records) {
  Impl& m = *impl_;
  KEEP_RETURN_IF_ERROR(m.begin_fenced(shard, epoch));
  const std::string e = std::to_string(epoch);
  for (const LogRecord& rec : records) {
    const std::string seq = std::to_string(rec.seq);
    const char* params[] = {rec.agent.c_str(), seq.c_str(), e.c_str(), rec.record.data()};
    const int lengths[] = {0, 0, 0, static_cast<int>(rec.record.size())};
    const int formats[] = {0, 0, 0, 1};  // the record as binary bytea
    PgResult r(PQexecParams(m.conn,
                            "INSERT INTO keep_log (agent, seq, epoch, record) "
                            "VALUES ($1, $2, $3, $4)",
                            4, nullptr, params, lengths, formats, 0));
    if (PQresultStatus(r.get()) != PGRES_COMMAND_OK) {
      Status st = m.error("appending " + rec.agent + " #" + seq, r.get());
      m.rollback();
      return st;
    }
  }
  return m.exec("COMMIT");
}

Result<std::vector<LogRecord>> PgLog::read(const std::string& agent, uint64_t after_seq) {
  Impl& m = *impl_;
  const std::string after = std::to_string(after_seq);
  const char* params[] = {agent.c_str(), after.c_str()};
  PgResult r(PQexecParams(m.conn,
                          "SELECT seq, epoch, record FROM keep_log WHERE agent = $1 AND seq > $2 "
                          "ORDER BY seq",
                          2, nullptr, params, nullptr, nullptr, 1 /* binary results */));
  if (PQresultStatus(r.get()) != PGRES_TUPLES_OK) return m.error("reading " + agent, r.get());
  std::vector<LogRecord> out;
  const auto be64 = [&](int row, int col) {
    const auto* p = reinterpret_cast<const unsigned char*>(PQgetvalue(r.get(), row, col));
    uint64_t v = 0;
    for (int i = 0; i < 8; ++i) v = (v << 8) | p[i];
    return v;
  };
  for (int i = 0; i < PQntuples(r.get()); ++i) {
    LogRecord rec;
    rec.agent = agent;
    rec.seq = be64(i, 0);
    rec.epoch = be64(i, 1);
    rec.record.assign(PQgetvalue(r.get(), i, 2), static_cast<size_t>(PQgetlength(r.get(), i, 2)));
    out.push_back(std::move(rec));
  }
  return out;
}

Result<uint64_t> PgLog::last_seq(const std::string& agent) {
  Impl& m = *impl_;
  const char* params[] = {agent.c_str()};
  PgResult r(PQexecParams(m.conn, "SELECT coalesce(max(seq), 0) FROM keep_log WHERE agent = $1", 1,
                          nullptr, params, nullptr, nullptr, 0));
  if (PQresultStatus(r.get()) != PGRES_TUPLES_OK) return m.error("last seq of " + agent, r.get());
  return to_u64(PQgetvalue(r.get(), 0, 0));
}

}  // namespace keep::cluster
