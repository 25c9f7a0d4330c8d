// The message of a `moved` answer (wire code 16, docs/cluster.md), written by the node answering
// and read by the clients that follow it:
//
//   agent 'A' (shard S) is served by NODE at ENDPOINT               keep-manager
//   agent 'A' (shard S) is served by NODE (worker W) at ENDPOINT    keep-manager, NODE named its
//                                                                   keep-worker
//                                                                   (--advertise-worker)
//   agent 'A' (shard S) is served by NODE at W                      keep-worker: NODE's worker
//
// The word after the last " at " is where the call goes: a manager's endpoint for manager calls,
// a worker's for worker calls. NODE, W and ENDPOINT hold no spaces (node names and endpoints
// never do), so the message is read from its end and an agent name cannot forge a target.
// A worker that does not know the owner's worker answers `moved` without " at ... ": nothing to
// follow. Header-only: keep_cluster writes these messages without linking keep_client.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace keep::client {

struct MovedTarget {
  std::string head;  // the message up to and including NODE
  std::string node;
  std::string worker;    // empty: not named
  std::string endpoint;  // where to send the call
};

inline std::string moved_message(std::string_view agent, uint32_t shard, std::string_view node,
                                 std::string_view endpoint, std::string_view worker = {}) {
  std::string m = "agent '" + std::string(agent) + "' (shard " + std::to_string(shard) +
                  ") is served by " + std::string(node);
  if (!worker.empty()) m += " (worker " + std::string(worker) + ")";
  return m + " at " + std::string(endpoint);
}

// nullopt: not a message of the forms above (nothing to follow).
inline std::optional<MovedTarget> parse_moved(std::string_view m) {
  // Takes the last word off `s`.
  const auto last_word = [](std::string_view* s) -> std::optional<std::string_view> {
    const size_t sp = s->rfind(' ');
    if (sp == std::string_view::npos) return std::nullopt;
    std::string_view w = s->substr(sp + 1);
    *s = s->substr(0, sp);
    return w;
  };
  std::string_view s = m;
  const auto endpoint = last_word(&s);
  const auto at = last_word(&s);
  if (!endpoint || endpoint->empty() || !at || *at != "at") return std::nullopt;
  MovedTarget t;
  t.endpoint = std::string(*endpoint);
  std::string_view rest = s;
  if (const auto w = last_word(&rest); w && w->size() > 1 && w->back() == ')') {
    if (const auto tag = last_word(&rest); tag && *tag == "(worker") {
      t.worker = std::string(w->substr(0, w->size() - 1));
      s = rest;
    }
  }
  t.head = std::string(s);
  const auto node = last_word(&s);
  const auto by = last_word(&s);
  if (!node || node->empty() || !by || *by != "by") return std::nullopt;
  t.node = std::string(*node);
  return t;
}

}  // namespace keep::client
