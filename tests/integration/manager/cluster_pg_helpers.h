// Helpers of the tests of keep-manager in cluster mode with its log in PostgreSQL
// (test_manager_pg_failover, _pg_fence, _pg_standby, test_manager_client_failover): the cluster
// flags, metrics by label, a client per endpoint, polling, the shards' split between two nodes,
// which agents a node owns, a writer, every memory's count, and (tcp_proxy.h) a loopback TCP proxy
// that can cut a process off from etcd.
#pragma once

#include <doctest/doctest.h>

#include <atomic>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "shared/client/manager_client.h"
#include "shared/cluster/placement.h"
#include "tests/integration/etcd_cluster.h"
#include "tests/integration/manager/manager_process.h"
#include "tests/integration/pg_server.h"
#include "tests/integration/tcp_proxy.h"

namespace keep::itest {

// keep-manager's flags for node `node` of a cluster of `shards` shards on `etcd_urls` (comma-
// separated), its log in the database of `conninfo`, with a 2 s lease.
inline std::vector<std::string> pg_cluster_flags(const std::string& etcd_urls,
                                                 const std::string& node, uint32_t shards,
                                                 const std::string& conninfo) {
  return {"--etcd",         etcd_urls, "--node-id", node,    "--shards", std::to_string(shards),
          "--etcd-lease-s", "2",       "--pg",      conninfo};
}
inline std::vector<std::string> pg_cluster_flags(const std::string& etcd_urls,
                                                 const std::string& node, uint32_t shards,
                                                 const PgServer& pg) {
  return pg_cluster_flags(etcd_urls, node, shards, pg.conninfo());
}

inline std::string join_urls(const std::vector<std::string>& urls) {
  std::string out;
  for (const auto& u : urls) out += (out.empty() ? "" : ",") + u;
  return out;
}

// The value of series `series` (a name, with its labels if any: `x{reason="stale"}`) in the
// process's /metrics; -1 when absent or unreachable.
inline double metric(const DaemonProcess& m, const std::string& series) {
  auto text = http_get(m.metrics(), "/metrics");
  if (!text) return -1;
  std::stringstream ss(*text);
  for (std::string l; std::getline(ss, l);) {
    if (l.rfind(series + " ", 0) == 0) return std::stod(l.substr(series.size() + 1));
  }
  return -1;
}

inline std::unique_ptr<client::ManagerClient> manager_client(const std::string& endpoint,
                                                             std::chrono::milliseconds timeout,
                                                             bool follow = false) {
  client::ClientOptions o;
  o.endpoint = endpoint;
  o.timeout = timeout;
  o.follow_moved = follow;
  auto c = client::ManagerClient::connect(o);
  REQUIRE(c.is_ok());
  return std::move(c).value();
}

// Polls `pred` every 50 ms for up to `limit`.
template <typename F>
bool eventually(F pred, std::chrono::milliseconds limit) {
  const auto deadline = std::chrono::steady_clock::now() + limit;
  while (std::chrono::steady_clock::now() < deadline) {
    if (pred()) return true;
    std::this_thread::sleep_for(50ms);
  }
  return pred();
}

// Whether a write's answer says it was not applied: moved, "no owner yet", "being taken over"
// (also a fenced node's refusal): routed away or refused before anything was applied.
inline bool not_applied(const Status& st) {
  return st.code() == Code::kMoved ||
         (st.code() == Code::kUnavailable &&
          (st.message().find("no owner yet") != std::string::npos ||
           st.message().find("being taken over") != std::string::npos));
}

// Requires that nodes a and b each serve half of the `shards` shards within 20 s (their stderr
// otherwise).
inline void require_split(const DaemonProcess& a, const DaemonProcess& b, uint32_t shards) {
  REQUIRE_MESSAGE(eventually(
                      [&] {
                        return metric(a, "keep_manager_cluster_shards_ready") == shards / 2 &&
                               metric(b, "keep_manager_cluster_shards_ready") == shards / 2;
                      },
                      20s),
                  a.err() << b.err());
}

// Every memory text of `agent`, all pages (what list_memories answers).
inline Result<std::vector<std::string>> all_texts(client::ManagerClient& c,
                                                  const std::string& agent) {
  std::vector<std::string> out;
  uint64_t after = 0;
  for (;;) {
    KEEP_ASSIGN_OR_RETURN(client::MemoryPage page, c.list_memories(agent, after, 1000));
    for (const auto& m : page.memories) {
      out.push_back(m.text);
      after = m.id;
    }
    if (!page.more) return out;
  }
}

// One writer of the failover tests, writer `w`: through `c`, a memory for each agent of `agents`
// in turn, round after round, until `stop` -- "<agent> memory <round> of writer <w>", unique --
// handing each answer to on_answer(agent, text, status, marked), `marked` saying whether `mark`
// (e.g. "the node was killed") was set before the write was sent; `pause` after each write.
template <typename F>
void write_rounds(client::ManagerClient& c, int w, const std::vector<std::string>& agents,
                  const std::atomic<bool>& stop, const std::atomic<bool>& mark,
                  std::chrono::milliseconds pause, F on_answer) {
  for (int n = 0; !stop.load(); ++n) {
    for (const auto& agent : agents) {
      if (stop.load()) return;
      client::WriteArgs args;
      args.agent = agent;
      args.text = agent + " memory " + std::to_string(n) + " of writer " + std::to_string(w);
      const bool marked = mark.load();
      on_answer(agent, args.text, c.write(args).status(), marked);
      if (pause.count() > 0) std::this_thread::sleep_for(pause);
    }
  }
}

// How many times `needle` occurs in `hay` (overlaps counted).
inline size_t occurrences(const std::string& hay, const std::string& needle) {
  size_t n = 0;
  for (size_t at = hay.find(needle); at != std::string::npos; at = hay.find(needle, at + 1)) ++n;
  return n;
}

// The agents among `agents` whose shard (of `shards`) `node` owns, as etcd says now.
inline std::set<std::string> agents_of(EtcdCluster& etcd, const std::string& node,
                                       const std::vector<std::string>& agents, uint32_t shards) {
  auto ec = etcd.client();
  cluster::Placement view(ec.get(), "test");
  std::set<std::string> out;
  for (const auto& agent : agents) {
    auto o = view.owner(cluster::shard_of(agent, shards));
    REQUIRE(o.is_ok());
    REQUIRE(o->has_value());
    if ((*o)->node == node) out.insert(agent);
  }
  return out;
}

// How many times each memory text is there, over every agent of `agents` (all pages).
inline std::map<std::string, int> memory_counts(client::ManagerClient& c,
                                                const std::vector<std::string>& agents) {
  std::map<std::string, int> seen;
  for (const auto& agent : agents) {
    auto texts = all_texts(c, agent);
    REQUIRE_MESSAGE(texts.is_ok(), agent << ": " << texts.status().to_string());
    for (const auto& t : *texts) seen[t] += 1;
  }
  return seen;
}

}  // namespace keep::itest
