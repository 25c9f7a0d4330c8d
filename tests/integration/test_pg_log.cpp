// PgLog against a real PostgreSQL server (issue 31, point 2): initdb in a temp dir, the server on
// a free loopback port (as the postgres user when the test runs as root: PostgreSQL refuses root),
// then the log's order, epoch fencing, duplicate refusal and durability across kill -9.
#include <doctest/doctest.h>

#include <atomic>
#include <thread>

#include "shared/cluster/pg_log.h"
#include "tests/integration/pg_server.h"

using namespace keep;
using namespace keep::cluster;
using namespace std::chrono_literals;
namespace it = keep::itest;

namespace {

LogRecord rec(const std::string& agent, uint64_t seq, const std::string& bytes) {
  LogRecord r;
  r.agent = agent;
  r.seq = seq;
  r.record = bytes;
  return r;
}

}  // namespace

TEST_CASE("the memory log: order, fencing by epoch, duplicates, durability across kill -9" *
          doctest::skip(it::pg_bin().empty())) {
  it::PgServer pg;
  auto log = pg.log();
  const std::string bin("\0\x01\xff record", 10);  // any bytes
  REQUIRE(log->append(3, 1, {rec("robot", 1, bin), rec("robot", 2, "b"), rec("other", 1, "o")})
              .is_ok());
  auto rows = log->read("robot");
  REQUIRE(rows.is_ok());
  REQUIRE(rows->size() == 2);
  CHECK((*rows)[0].record == bin);
  CHECK((*rows)[0].epoch == 1);
  CHECK((*rows)[1].seq == 2);
  CHECK(log->read("robot", 1)->size() == 1);
  CHECK(*log->last_seq("robot") == 2);
  CHECK(*log->last_seq("nobody") == 0);

  // A new owner at epoch 2 fences the shard: the old owner's batch is refused whole.
  REQUIRE(log->fence(3, 2).is_ok());
  Status stale = log->append(3, 1, {rec("robot", 3, "late")});
  CHECK(stale.code() == Code::kStale);
  CHECK(*log->last_seq("robot") == 2);
  CHECK(log->fence(3, 1).code() == Code::kStale);  // fences never go down
  REQUIRE(log->append(3, 2, {rec("robot", 3, "c")}).is_ok());
  CHECK(log->append(4, 1, {rec("elsewhere", 1, "x")}).is_ok());  // another shard: its own fence

  // A taken (agent, seq) refuses the batch, nothing of it written.
  CHECK(log->append(3, 2, {rec("robot", 4, "d"), rec("robot", 3, "again")}).code() ==
        Code::kAlreadyExists);
  CHECK(*log->last_seq("robot") == 3);

  // What was acknowledged survives the server's kill -9.
  pg.kill9();
  CHECK(log->append(3, 2, {rec("robot", 4, "d")}).code() == Code::kUnavailable);
  pg.start();
  auto again = pg.log();
  rows = again->read("robot");
  REQUIRE(rows.is_ok());
  REQUIRE(rows->size() == 3);
  CHECK((*rows)[2].record == "c");
  CHECK((*rows)[2].epoch == 2);
  CHECK(again->append(3, 1, {rec("robot", 4, "late")}).code() == Code::kStale);
  // The first connection broke with the server: it is reset at its next call.
  rows = log->read("robot");
  REQUIRE(rows.is_ok());
  CHECK(rows->size() == 3);
}

TEST_CASE("group commit of several shards: a fenced shard is refused whole, the others written" *
          doctest::skip(it::pg_bin().empty())) {
  it::PgServer pg;
  auto log = pg.log();
  REQUIRE(log->fence(2, 5).is_ok());  // shard 2 has a newer owner than epoch 4
  auto st = log->append_shards({ShardAppend{3, 1, {rec("c1", 1, "a"), rec("c1", 2, "b")}},
                                ShardAppend{2, 4, {rec("b1", 1, "refused")}},
                                ShardAppend{1, 7, {rec("a1", 1, "x"), rec("a2", 1, "y")}}});
  REQUIRE(st.is_ok());
  REQUIRE(st->size() == 3);
  CHECK((*st)[0].is_ok());
  CHECK((*st)[1].code() == Code::kStale);
  CHECK((*st)[2].is_ok());
  CHECK(*log->last_seq("c1") == 2);
  CHECK(*log->last_seq("b1") == 0);
  CHECK(*log->last_seq("a2") == 1);
  // Every shard fenced: nothing written, no error for the call.
  st = log->append_shards({ShardAppend{2, 3, {rec("b1", 1, "refused")}}});
  REQUIRE(st.is_ok());
  CHECK((*st)[0].code() == Code::kStale);
  // A taken (agent, seq) refuses the whole transaction, the other shards' records too.
  CHECK(log->append_shards(
               {ShardAppend{3, 1, {rec("c1", 3, "c")}}, ShardAppend{1, 7, {rec("a1", 1, "again")}}})
            .status()
            .code() == Code::kAlreadyExists);
  CHECK(*log->last_seq("c1") == 2);

  // A new owner's replay of shard 1: a2 held up to seq 1 (its row at 1 comes back to compare),
  // a1 not held (all of it), and more than one insert statement's worth of rows.
  std::vector<LogRecord> many;
  for (uint64_t i = 2; i <= 2500; ++i) many.push_back(rec("a1", i, "r" + std::to_string(i)));
  many.push_back(rec("a2", 2, "y2"));
  REQUIRE(log->append(1, 7, many).is_ok());
  REQUIRE(log->append(3, 1, {rec("c1", 3, "c")}).is_ok());  // another shard: not read
  auto rows = log->read_shard(1, {{"a2", 1}, {"weird \"name\"", 4}});
  REQUIRE(rows.is_ok());
  REQUIRE(rows->size() == 2500 + 2);
  CHECK((*rows)[0].agent == "a1");
  CHECK((*rows)[0].seq == 1);
  CHECK((*rows)[0].record == "x");
  CHECK((*rows)[2499].seq == 2500);
  CHECK((*rows)[2499].record == "r2500");
  CHECK((*rows)[2500].agent == "a2");
  CHECK((*rows)[2500].seq == 1);
  CHECK((*rows)[2500].epoch == 7);
  CHECK((*rows)[2501].record == "y2");
  rows = log->read_shard(1, {{"a1", 2501}, {"a2", 3}});
  REQUIRE(rows.is_ok());
  CHECK(rows->empty());
  rows = log->read_shard(9, {});
  REQUIRE(rows.is_ok());
  CHECK(rows->empty());
}

TEST_CASE("compaction: a checkpoint replaces the entries it covers, fenced like a batch" *
          doctest::skip(it::pg_bin().empty())) {
  it::PgServer pg;
  auto log = pg.log();
  REQUIRE(log->append(5, 1, {rec("r", 1, "a"), rec("r", 2, "b"), rec("r", 3, "c")}).is_ok());
  REQUIRE(log->append(5, 2, {rec("r", 4, "d"), rec("r", 5, "e"), rec("q", 1, "q")}).is_ok());
  const std::string state("\0state of r at 4", 16);
  // Its state must be the log's prefix: entry 4 is epoch 2's, not 1's.
  CHECK(log->checkpoint(5, 2, Checkpoint{"r", 4, 1, 0, state}).code() == Code::kCorrupt);
  CHECK(log->read("r")->size() == 5);
  REQUIRE(log->checkpoint(5, 2, Checkpoint{"r", 4, 2, 0, state}).is_ok());
  // The log holds only the entries after it; last_seq still counts the checkpoint's.
  auto rows = log->read("r");
  REQUIRE(rows->size() == 1);
  CHECK((*rows)[0].seq == 5);
  CHECK(log->read_shard(5, {})->size() == 2);  // r 5, q 1
  CHECK(*log->last_seq("r") == 5);
  auto cps = log->read_checkpoints(5);
  REQUIRE(cps.is_ok());
  REQUIRE(cps->size() == 1);
  CHECK((*cps)[0].agent == "r");
  CHECK((*cps)[0].seq == 4);
  CHECK((*cps)[0].epoch == 2);
  CHECK((*cps)[0].owner_epoch == 2);
  CHECK((*cps)[0].state == state);
  CHECK(log->read_checkpoints(4)->empty());
  // An older checkpoint does not replace a newer one (nor fail: its entries are gone already).
  CHECK(log->checkpoint(5, 2, Checkpoint{"r", 2, 1, 0, "older"}).is_ok());
  CHECK((*log->read_checkpoints(5))[0].seq == 4);
  // A stale owner (the shard fenced at 3 since) is refused: nothing written, nothing deleted.
  REQUIRE(log->fence(5, 3).is_ok());
  CHECK(log->checkpoint(5, 2, Checkpoint{"r", 5, 2, 0, "stale"}).code() == Code::kStale);
  CHECK(log->read("r")->size() == 1);
  CHECK((*log->read_checkpoints(5))[0].seq == 4);
  CHECK((*log->read_checkpoints(5))[0].state == state);
  // The owner at 3: entry 5 goes; a last_seq past every entry.
  REQUIRE(log->checkpoint(5, 3, Checkpoint{"r", 5, 2, 0, "at 5"}).is_ok());
  CHECK(log->read("r")->empty());
  CHECK(*log->last_seq("r") == 5);
  CHECK((*log->read_checkpoints(5))[0].owner_epoch == 3);
}

TEST_CASE(
    "a manager connecting while another commits is not refused: the tables are only looked up" *
    doctest::skip(it::pg_bin().empty())) {
  // A node restarting while the others write. Creating the tables again (CREATE INDEX IF NOT
  // EXISTS locks the table before it looks) deadlocked with a running checkpoint, and PostgreSQL
  // failed one of them: the starting node's connect, or the running node's commit.
  it::PgServer pg;
  auto writer = pg.log();
  std::atomic<bool> stop{false};
  std::atomic<int> commits{0};
  std::string commit_error;  // the writer's first failure (read after join)
  std::thread busy([&] {
    for (uint64_t seq = 1; !stop.load() && commit_error.empty(); seq += 2) {
      // Appends and checkpoints: transactions on keep_log, and on keep_checkpoint then keep_log.
      Status st = writer->append(1, 1, {rec("r", seq, "a"), rec("r", seq + 1, "b")});
      if (st.is_ok()) st = writer->checkpoint(1, 1, Checkpoint{"r", seq + 1, 1, 0, "state"});
      if (!st.is_ok()) commit_error = st.to_string();
      commits += 2;
    }
  });
  int connected = 0;
  std::string refused;
  for (int i = 0; i < 40; ++i) {
    auto l = PgLog::connect(pg.conninfo());
    if (l.is_ok()) {
      ++connected;
    } else if (refused.empty()) {
      refused = l.status().to_string();
    }
  }
  stop.store(true);
  busy.join();
  MESSAGE(connected << " of 40 connects beside " << commits.load() << " commits");
  CHECK_MESSAGE(connected == 40, refused);
  CHECK_MESSAGE(commit_error.empty(), commit_error);  // nor was the running one's commit
  CHECK(commits.load() > 0);
}
