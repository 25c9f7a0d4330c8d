// keepctl: the command-line client of keep-manager (one command per protocol call) and of
// keep-worker (complete, score, worker-ping).
// Exit status: 0 ok, 1 the call failed ("keepctl: <code>: <message>" on stderr), 2 usage error.
#include <charconv>
#include <cstdio>
#include <iostream>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "shared/client/manager_client.h"
#include "shared/client/worker_client.h"
#include "shared/cluster/etcd_directory.h"
#include "shared/cluster/placement.h"

namespace {

using keep::Code;
using keep::Status;
using nlohmann::json;
namespace kc = keep::client;
// One JSON document as text. Memories stored before the server refused invalid UTF-8 may still
// hold it: print U+FFFD rather than let json::dump throw.
std::string dump(const json& j) { return j.dump(-1, ' ', false, json::error_handler_t::replace); }

constexpr int kExitOk = 0;
constexpr int kExitFailed = 1;
constexpr int kExitUsage = 2;

const char* kHelp =
    R"(usage: keepctl [--endpoint E | --etcd URLS [--shards N]] [--worker-endpoint W] [--json]
               [--timeout-ms N] <command> [args]

Client of keep-manager (one command per protocol call, docs/protocol.md) and of keep-worker
(complete, score, worker-ping).

options:
  --endpoint E         manager endpoint, tcp://host:port or ipc://path (default: %s)
  --etcd URLS          cluster mode: etcd client URLs, comma-separated (http://host:2379,...);
                       an agent's command goes to the node serving it, read from etcd as the
                       managers place it (moved answers followed when etcd was stale); other
                       manager commands go to --endpoint, else to a live node from etcd
  --shards N           cluster mode: the managers' --shards (default: 64)
  --worker-endpoint W  worker endpoint (default: %s)
  --json               print the answer as one JSON document, with the worker's stats
                       (default: human-readable text)
  --timeout-ms N       per-request timeout in milliseconds (default: 5000 for the manager,
                       120000 for the worker)
  --help               print this help

worker commands:
  complete <agent> <instruction> [--history "a|b"] [--method M] [--k N] [--max-tokens N]
           [--decay D] [--query-rows Q] [--max-hops H] [--cacheblend-ratio R]
           [--epic-tokens K] [--anchor-tokens A] [--temperature T] [--seed S]
                                              the planner's next step: the worker retrieves
                                              the agent's memories and generates (M: full,
                                              prefix, full_reuse, cacheblend, epic, keep;
                                              default: the worker's --method)
  score <agent> <instruction> --candidates "a|b|c" [same options]
                                              log-probability of each candidate continuation
  worker-ping                                 check the worker is up; its version and model

commands:
  ping                                        check the manager is up; prints its version
  write <agent> <text> [--kind K] [--id N] [--step N]
                                              add a memory (K: object_state (default),
                                              task_record, example_plan; id: manager-assigned
                                              by default; step: the agent's current step)
  update <agent> <id> <text> [--kind K] [--step N]
                                              replace a memory's text (and kind)
  delete <agent> <id>                         delete a memory
  step <agent> [--by N]                       advance the agent's step (default by 1)
  retrieve <agent> <query> [--k N]            memories for a prompt, in prompt order (k: 8)
  groups <agent>                              the agent's semantic groups
  list <agent> [--after ID] [--limit N] [--all]
                                              the agent's memories by ascending id, one page
                                              (ids above ID; N: 100, at most 1000) or --all
                                              pages
  stats                                       manager counters
  jobs --worker W [--max N]                   take KV jobs for worker W (max: 1)
  reserve --worker W --job J --tokens T       reserve a region entry for a job
  commit --worker W --job J --index I --generation G [--slices T1,T2,...]
                                              commit a written entry (slices: member tokens of
                                              a group job)
  revoke --worker W --job J --index I --generation G
                                              give a reserved entry back (the job is requeued)
  renew --worker W --job J --index I --generation G
                                              extend a reservation's lease

exit status: 0 ok, 1 the call failed (stderr: "keepctl: <code>: <message>"), 2 usage error.
)";

struct UsageError {
  std::string message;
};

struct Args {
  std::vector<std::string> positional;
  std::map<std::string, std::string> options;
  bool json = false;
  bool help = false;
  bool all = false;
};

const std::set<std::string> kValueOptions = {"--endpoint",
                                             "--etcd",
                                             "--shards",
                                             "--timeout-ms",
                                             "--kind",
                                             "--id",
                                             "--step",
                                             "--by",
                                             "--k",
                                             "--worker",
                                             "--max",
                                             "--job",
                                             "--tokens",
                                             "--index",
                                             "--generation",
                                             "--slices",
                                             "--after",
                                             "--limit",
                                             "--worker-endpoint",
                                             "--history",
                                             "--method",
                                             "--max-tokens",
                                             "--decay",
                                             "--query-rows",
                                             "--max-hops",
                                             "--cacheblend-ratio",
                                             "--epic-tokens",
                                             "--anchor-tokens",
                                             "--temperature",
                                             "--seed",
                                             "--candidates"};

Args parse_args(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    std::string s = argv[i];
    if (s == "--json") {
      a.json = true;
    } else if (s == "--all") {
      a.all = true;
    } else if (s == "--help" || s == "-h") {
      a.help = true;
    } else if (s == "--") {
      for (++i; i < argc; ++i) a.positional.emplace_back(argv[i]);
    } else if (s.rfind("--", 0) == 0) {
      std::string name = s, value;
      const auto eq = s.find('=');
      if (eq != std::string::npos) {
        name = s.substr(0, eq);
        value = s.substr(eq + 1);
      } else if (kValueOptions.count(name) && i + 1 < argc) {
        value = argv[++i];
      } else if (kValueOptions.count(name)) {
        throw UsageError{name + " needs a value"};
      }
      if (!kValueOptions.count(name)) throw UsageError{"unknown option " + name};
      a.options[name] = value;
    } else {
      a.positional.push_back(s);
    }
  }
  return a;
}

uint64_t parse_u64(const std::string& what, const std::string& s) {
  uint64_t v = 0;
  auto [p, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  if (ec != std::errc() || p != s.data() + s.size() || s.empty()) {
    throw UsageError{what + " must be a non-negative integer, got '" + s + "'"};
  }
  return v;
}

uint32_t parse_u32(const std::string& what, const std::string& s) {
  const uint64_t v = parse_u64(what, s);
  if (v > UINT32_MAX) throw UsageError{what + " is too large: " + s};
  return static_cast<uint32_t>(v);
}

const std::string* opt(const Args& a, const std::string& name) {
  auto it = a.options.find(name);
  return it == a.options.end() ? nullptr : &it->second;
}

uint64_t need_u64(const Args& a, const std::string& name) {
  const std::string* v = opt(a, name);
  if (!v) throw UsageError{"missing " + name};
  return parse_u64(name, *v);
}

void need_positional(const Args& a, size_t n, const char* usage) {
  if (a.positional.size() != n + 1) throw UsageError{std::string("keepctl ") + usage};
}

kc::SegmentKind kind_opt(const std::string& s) {
  auto k = kc::parse_kind(s);
  if (!k) throw UsageError{"unknown kind '" + s + "' (object_state, task_record, example_plan)"};
  return *k;
}

json entry_json(const kc::EntryDescriptor& e) {
  return {{"index", e.index},
          {"generation", e.generation},
          {"offset", e.offset},
          {"bytes", e.bytes},
          {"tokens", e.tokens}};
}

struct Failure {
  Status status;
};

template <typename T>
T take(keep::Result<T> r) {
  if (!r.is_ok()) throw Failure{r.status()};
  return std::move(r).value();
}
void take(const Status& st) {
  if (!st.is_ok()) throw Failure{st};
}

void print_write(const kc::WriteResult& w, bool as_json) {
  if (as_json) {
    std::cout << dump(json{{"id", w.id}, {"version", w.version}, {"step", w.step}}) << "\n";
  } else {
    std::cout << "id " << w.id << " version " << w.version << " step " << w.step << "\n";
  }
}

void print_ok(bool as_json) { std::cout << (as_json ? "{\"ok\":true}" : "ok") << "\n"; }

double parse_double(const std::string& what, const std::string& s) {
  char* end = nullptr;
  const double v = std::strtod(s.c_str(), &end);
  if (s.empty() || *end != '\0') throw UsageError{what + " must be a number, got '" + s + "'"};
  return v;
}

// "a|b|c" -> {"a", "b", "c"}.
std::vector<std::string> split_bars(const std::string& s) {
  std::vector<std::string> out;
  size_t start = 0;
  for (;;) {
    const size_t bar = s.find('|', start);
    out.push_back(s.substr(start, bar == std::string::npos ? std::string::npos : bar - start));
    if (bar == std::string::npos) return out;
    start = bar + 1;
  }
}

json stats_json(const kc::PlanStats& s) {
  return {{"method", kc::plan_method_name(s.method)},
          {"ttft_s", s.ttft_seconds},
          {"retrieve_s", s.retrieve_seconds},
          {"prefill_s", s.prefill_seconds},
          {"prompt_tokens", s.prompt_tokens},
          {"memory_tokens", s.memory_tokens},
          {"cached_prefix_tokens", s.cached_prefix_tokens},
          {"recomputed_per_layer", s.recomputed_per_layer},
          {"recompute_ratio", s.recompute_ratio},
          {"bytes_loaded", s.bytes_loaded},
          {"entries_hit", s.entries_hit},
          {"entries_missing", s.entries_missing},
          {"entries_stale", s.entries_stale},
          {"check_layers", s.check_layers},
          {"hops", s.hops},
          {"segments", s.segments}};
}

// complete, score, worker-ping: keep-worker's commands.
int run_worker(const Args& a, const std::string& cmd) {
  kc::WorkerClientOptions options;
  if (auto* e = opt(a, "--worker-endpoint")) options.endpoint = *e;
  if (auto* t = opt(a, "--timeout-ms")) {
    options.timeout = std::chrono::milliseconds(parse_u32("--timeout-ms", *t));
  }
  auto client = take(kc::WorkerClient::connect(options));
  const bool js = a.json;
  if (cmd == "worker-ping") {
    need_positional(a, 0, "worker-ping");
    auto p = take(client->ping());
    if (js) {
      std::cout << dump(json{{"server", p.server_version}, {"model", p.model}}) << "\n";
    } else {
      std::cout << p.server_version << "\n" << p.model << "\n";
    }
    return kExitOk;
  }
  const bool scoring = cmd == "score";
  need_positional(a, 2,
                  scoring ? "score <agent> <instruction> --candidates \"a|b|c\" [options]"
                          : "complete <agent> <instruction> [options]");
  kc::CompleteArgs c;
  c.agent = a.positional[1];
  c.instruction = a.positional[2];
  if (auto* h = opt(a, "--history")) c.history = split_bars(*h);
  if (auto* m = opt(a, "--method")) {
    auto method = kc::parse_plan_method(*m);
    if (!method) {
      throw UsageError{"unknown method '" + *m +
                       "' (full, prefix, full_reuse, cacheblend, epic, keep)"};
    }
    c.method = *method;
  }
  if (auto* k = opt(a, "--k")) c.k = parse_u32("--k", *k);
  if (auto* t = opt(a, "--max-tokens")) c.max_tokens = parse_u32("--max-tokens", *t);
  if (auto* d = opt(a, "--decay")) c.knobs.decay = parse_double("--decay", *d);
  if (auto* q = opt(a, "--query-rows")) c.knobs.query_rows = parse_u32("--query-rows", *q);
  if (auto* h = opt(a, "--max-hops")) c.knobs.max_hops = parse_u32("--max-hops", *h);
  if (auto* r = opt(a, "--cacheblend-ratio")) {
    c.knobs.cacheblend_ratio = parse_double("--cacheblend-ratio", *r);
  }
  if (auto* e = opt(a, "--epic-tokens")) c.knobs.epic_tokens = parse_u32("--epic-tokens", *e);
  if (auto* e = opt(a, "--anchor-tokens")) c.knobs.anchor_tokens = parse_u32("--anchor-tokens", *e);
  if (auto* t = opt(a, "--temperature")) {
    c.temperature = static_cast<float>(parse_double("--temperature", *t));
  }
  if (auto* s = opt(a, "--seed")) c.seed = parse_u64("--seed", *s);
  const std::string* cands = opt(a, "--candidates");
  if (scoring != (cands != nullptr)) {
    throw UsageError{scoring ? "score needs --candidates \"a|b|c\""
                             : "--candidates belongs to score, not complete"};
  }
  if (cands) c.candidates = split_bars(*cands);
  auto r = take(client->complete(c));
  const kc::PlanStats& st = r.stats;
  if (js) {
    json out = {{"stats", stats_json(st)}};
    if (scoring) {
      json scores = json::array();
      for (size_t i = 0; i < r.scores.size(); ++i) {
        scores.push_back({{"candidate", c.candidates[i]},
                          {"log_prob", r.scores[i].log_prob},
                          {"tokens", r.scores[i].tokens}});
      }
      out["scores"] = scores;
      out["best"] = r.best;
    } else {
      out["text"] = r.text;
      out["tokens"] = r.tokens;
    }
    std::cout << dump(out) << "\n";
    return kExitOk;
  }
  if (scoring) {
    for (size_t i = 0; i < r.scores.size(); ++i) {
      std::printf("%s %10.4f  %s\n", i == r.best ? "*" : " ", r.scores[i].log_prob,
                  c.candidates[i].c_str());
    }
  } else {
    std::cout << r.text << "\n";
  }
  std::fprintf(stderr,
               "method %s  ttft %.3f s  prompt %u tok (memory %u)  recompute %.2f  loaded %llu "
               "B  entries hit %u missing %u stale %u\n",
               kc::plan_method_name(st.method), st.ttft_seconds, st.prompt_tokens, st.memory_tokens,
               st.recompute_ratio, static_cast<unsigned long long>(st.bytes_loaded), st.entries_hit,
               st.entries_missing, st.entries_stale);
  return kExitOk;
}

// --etcd's URLs, checked: http(s)://host:port, comma-separated.
std::vector<std::string> etcd_urls(const std::string& list) {
  std::vector<std::string> urls;
  size_t start = 0;
  for (;;) {
    const size_t comma = std::min(list.find(',', start), list.size());
    const std::string url = list.substr(start, comma - start);
    const size_t scheme = url.rfind("http://", 0) == 0 ? 7 : url.rfind("https://", 0) == 0 ? 8 : 0;
    if (scheme == 0 || url.size() == scheme) {
      throw UsageError{"--etcd: '" + url +
                       "' is not an etcd client URL (http://host:port, comma-separated)"};
    }
    urls.push_back(url);
    if (comma == list.size()) return urls;
    start = comma + 1;
  }
}

// --etcd and --shards, checked; nullopt without --etcd.
struct EtcdRoute {
  std::vector<std::string> urls;
  uint32_t shards = 64;  // keep-manager's default --shards
};
std::optional<EtcdRoute> etcd_route(const Args& a) {
  const std::string* list = opt(a, "--etcd");
  const std::string* shards = opt(a, "--shards");
  if (list == nullptr) {
    if (shards != nullptr) throw UsageError{"--shards needs --etcd"};
    return std::nullopt;
  }
  EtcdRoute r{etcd_urls(*list)};
  if (shards != nullptr) {
    const uint64_t n = parse_u64("--shards", *shards);
    if (n == 0 || n > 65536) throw UsageError{"--shards must be 1..65536, got " + *shards};
    r.shards = static_cast<uint32_t>(n);
  }
  return r;
}

// Cluster mode (--etcd): the client asks etcd where each agent lives; node-wide commands go to
// --endpoint, else to the first live node etcd lists.
void route_through_etcd(const Args& a, const EtcdRoute& route, kc::ClientOptions* options) {
  const std::string joined = *opt(a, "--etcd");
  options->directory = take(
      keep::cluster::EtcdDirectory::create(route.urls, route.shards, "/keep", options->timeout));
  if (opt(a, "--endpoint") != nullptr) return;
  auto etcd = take(keep::cluster::EtcdClient::create({route.urls, options->timeout}));
  keep::cluster::Placement view(etcd.get(), "keepctl");
  auto nodes = view.nodes();
  if (!nodes.is_ok()) {
    throw Failure{Status(nodes.status().code(), "reading the cluster's nodes from etcd (" + joined +
                                                    "): " + nodes.status().message())};
  }
  if (nodes->empty()) {
    throw Failure{
        Status(Code::kUnavailable, "no keep-manager node is registered in etcd (" + joined + ")")};
  }
  options->endpoint = nodes->front().second;
}

int run(const Args& a) {
  kc::ClientOptions options;
  if (auto* e = opt(a, "--endpoint")) options.endpoint = *e;
  if (auto* t = opt(a, "--timeout-ms")) {
    options.timeout = std::chrono::milliseconds(parse_u32("--timeout-ms", *t));
  }
  const std::optional<EtcdRoute> etcd = etcd_route(a);
  if (a.positional.empty()) throw UsageError{"no command (see keepctl --help)"};
  const std::string& cmd = a.positional[0];
  if (cmd == "complete" || cmd == "score" || cmd == "worker-ping") {
    if (etcd) {
      throw UsageError{"--etcd and --shards route manager commands; " + cmd +
                       " goes to --worker-endpoint"};
    }
    return run_worker(a, cmd);
  }
  static const std::set<std::string> kCommands = {"ping",     "write",  "update", "delete", "step",
                                                  "retrieve", "groups", "list",   "stats",  "jobs",
                                                  "reserve",  "commit", "revoke", "renew"};
  if (!kCommands.count(cmd)) throw UsageError{"unknown command '" + cmd + "'"};
  if (etcd) route_through_etcd(a, *etcd, &options);
  auto client = take(kc::ManagerClient::connect(options));
  const bool js = a.json;
  const auto& p = a.positional;

  if (cmd == "ping") {
    need_positional(a, 0, "ping");
    auto v = take(client->ping());
    std::cout << (js ? dump(json{{"server", v}}) : v) << "\n";
  } else if (cmd == "write") {
    need_positional(a, 2, "write <agent> <text> [--kind K] [--id N] [--step N]");
    kc::WriteArgs w;
    w.agent = p[1];
    w.text = p[2];
    if (auto* k = opt(a, "--kind")) w.kind = kind_opt(*k);
    if (auto* id = opt(a, "--id")) w.id = parse_u64("--id", *id);
    if (auto* s = opt(a, "--step")) w.step = parse_u64("--step", *s);
    print_write(take(client->write(w)), js);
  } else if (cmd == "update") {
    need_positional(a, 3, "update <agent> <id> <text> [--kind K] [--step N]");
    std::optional<kc::SegmentKind> kind;
    if (auto* k = opt(a, "--kind")) kind = kind_opt(*k);
    std::optional<uint64_t> step;
    if (auto* s = opt(a, "--step")) step = parse_u64("--step", *s);
    print_write(take(client->update(p[1], parse_u64("id", p[2]), p[3], kind, step)), js);
  } else if (cmd == "delete") {
    need_positional(a, 2, "delete <agent> <id>");
    take(client->remove(p[1], parse_u64("id", p[2])));
    print_ok(js);
  } else if (cmd == "step") {
    need_positional(a, 1, "step <agent> [--by N]");
    uint64_t by = 1;
    if (auto* b = opt(a, "--by")) by = parse_u64("--by", *b);
    auto s = take(client->advance_step(p[1], by));
    std::cout << (js ? dump(json{{"step", s}}) : "step " + std::to_string(s)) << "\n";
  } else if (cmd == "retrieve") {
    need_positional(a, 2, "retrieve <agent> <query> [--k N]");
    uint32_t k = 8;
    if (auto* kk = opt(a, "--k")) k = parse_u32("--k", *kk);
    auto segs = take(client->retrieve(p[1], p[2], k));
    if (js) {
      json out = json::array();
      for (const auto& s : segs) {
        json j = {{"id", s.id},
                  {"text", s.text},
                  {"kind", kc::kind_name(s.kind)},
                  {"tokens", s.tokens},
                  {"version", s.version},
                  {"updated_step", s.updated_step},
                  {"group_id", s.group_id},
                  {"group_state", kc::state_name(s.group_state)},
                  {"group_version", s.group_version},
                  {"score", s.score},
                  {"kv", nullptr}};
        if (s.kv) {
          j["kv"] = {{"entry", entry_json(s.kv->entry)},
                     {"token_offset", s.kv->token_offset},
                     {"tokens", s.kv->tokens},
                     {"joint", s.kv->joint}};
        }
        out.push_back(std::move(j));
      }
      std::cout << dump(json{{"segments", out}}) << "\n";
    } else {
      for (const auto& s : segs) {
        std::printf("%-6llu %-12s score %.3f  group %llu (%s v%llu)  v%llu  %u tok  kv %s\n  %s\n",
                    static_cast<unsigned long long>(s.id), kc::kind_name(s.kind), s.score,
                    static_cast<unsigned long long>(s.group_id), kc::state_name(s.group_state),
                    static_cast<unsigned long long>(s.group_version),
                    static_cast<unsigned long long>(s.version), s.tokens,
                    s.kv ? (s.kv->joint ? "joint" : "own") : "none", s.text.c_str());
      }
      if (segs.empty()) std::printf("(no memories)\n");
    }
  } else if (cmd == "groups") {
    need_positional(a, 1, "groups <agent>");
    auto groups = take(client->list_groups(p[1]));
    if (js) {
      json out = json::array();
      for (const auto& g : groups) {
        out.push_back({{"id", g.id},
                       {"state", kc::state_name(g.state)},
                       {"version", g.version},
                       {"segment_ids", g.segment_ids},
                       {"tokens", g.tokens},
                       {"last_change_step", g.last_change_step}});
      }
      std::cout << dump(json{{"groups", out}}) << "\n";
    } else {
      for (const auto& g : groups) {
        std::string ids;
        for (auto id : g.segment_ids) ids += (ids.empty() ? "" : ",") + std::to_string(id);
        std::printf("group %llu %-7s v%llu  %u tok  changed at step %llu  segments %s\n",
                    static_cast<unsigned long long>(g.id), kc::state_name(g.state),
                    static_cast<unsigned long long>(g.version), g.tokens,
                    static_cast<unsigned long long>(g.last_change_step), ids.c_str());
      }
      if (groups.empty()) std::printf("(no groups)\n");
    }
  } else if (cmd == "list") {
    need_positional(a, 1, "list <agent> [--after ID] [--limit N] [--all]");
    uint64_t after = 0;
    if (auto* v = opt(a, "--after")) after = parse_u64("--after", *v);
    uint32_t limit = 0;  // the server's default page
    if (auto* v = opt(a, "--limit")) limit = parse_u32("--limit", *v);
    kc::MemoryPage all;
    for (;;) {  // one page, or with --all every page after `after`
      auto page = take(client->list_memories(p[1], after, limit));
      all.more = page.more;
      for (auto& m : page.memories) all.memories.push_back(std::move(m));
      if (!a.all || !page.more || page.memories.empty()) break;
      after = all.memories.back().id;
    }
    if (js) {
      json out = json::array();
      for (const auto& m : all.memories) {
        out.push_back({{"id", m.id},
                       {"text", m.text},
                       {"kind", kc::kind_name(m.kind)},
                       {"tokens", m.tokens},
                       {"version", m.version},
                       {"updated_step", m.updated_step},
                       {"group_id", m.group_id},
                       {"embedded", m.embedded},
                       {"has_kv", m.has_kv}});
      }
      std::cout << dump(json{{"memories", out}, {"more", all.more}}) << "\n";
    } else {
      for (const auto& m : all.memories) {
        std::printf("%-6llu %-12s v%llu  step %llu  group %llu  %u tok  embedded %s  kv %s\n  %s\n",
                    static_cast<unsigned long long>(m.id), kc::kind_name(m.kind),
                    static_cast<unsigned long long>(m.version),
                    static_cast<unsigned long long>(m.updated_step),
                    static_cast<unsigned long long>(m.group_id), m.tokens,
                    m.embedded ? "yes" : "no", m.has_kv ? "yes" : "no", m.text.c_str());
      }
      if (all.memories.empty()) std::printf("(no memories)\n");
      if (all.more) {
        std::printf("(more: keepctl list %s --after %llu)\n", p[1].c_str(),
                    static_cast<unsigned long long>(all.memories.back().id));
      }
    }
  } else if (cmd == "stats") {
    need_positional(a, 0, "stats");
    auto s = take(client->stats());
    std::vector<std::pair<std::string, uint64_t>> all = {{"agents", s.agents},
                                                         {"memories", s.memories},
                                                         {"groups_static", s.groups_static},
                                                         {"groups_dynamic", s.groups_dynamic},
                                                         {"jobs_pending", s.jobs_pending}};
    all.insert(all.end(), s.counters.begin(), s.counters.end());
    if (js) {
      json out = json::object();
      for (const auto& [k, v] : all) out[k] = v;
      std::cout << dump(out) << "\n";
    } else {
      for (const auto& [k, v] : all) {
        std::printf("%-24s %llu\n", k.c_str(), static_cast<unsigned long long>(v));
      }
    }
  } else if (cmd == "jobs") {
    need_positional(a, 0, "jobs --worker W [--max N]");
    uint32_t max = 1;
    if (auto* m = opt(a, "--max")) max = parse_u32("--max", *m);
    auto jobs = take(client->fetch_jobs(need_u64(a, "--worker"), max));
    if (js) {
      json out = json::array();
      for (const auto& j : jobs) {
        json segs = json::array();
        for (const auto& s : j.segments) {
          segs.push_back(
              {{"id", s.id}, {"version", s.version}, {"text", s.text}, {"tokens", s.tokens}});
        }
        out.push_back({{"job_id", j.job_id},
                       {"kind", kc::job_kind_name(j.kind)},
                       {"agent", j.agent},
                       {"group_id", j.group_id},
                       {"group_version", j.group_version},
                       {"segments", segs}});
      }
      std::cout << dump(json{{"jobs", out}}) << "\n";
    } else {
      for (const auto& j : jobs) {
        uint64_t tokens = 0;
        for (const auto& s : j.segments) tokens += s.tokens;
        std::printf("job %llu %-7s agent %s group %llu v%llu  %zu segment(s), %llu tok\n",
                    static_cast<unsigned long long>(j.job_id), kc::job_kind_name(j.kind),
                    j.agent.c_str(), static_cast<unsigned long long>(j.group_id),
                    static_cast<unsigned long long>(j.group_version), j.segments.size(),
                    static_cast<unsigned long long>(tokens));
      }
      if (jobs.empty()) std::printf("(no jobs)\n");
    }
  } else if (cmd == "reserve") {
    need_positional(a, 0, "reserve --worker W --job J --tokens T");
    const uint64_t tokens = need_u64(a, "--tokens");
    if (tokens > UINT32_MAX) throw UsageError{"--tokens is too large"};
    auto r = take(client->reserve_entry(need_u64(a, "--worker"), need_u64(a, "--job"),
                                        static_cast<uint32_t>(tokens)));
    if (js) {
      std::cout << dump(json{{"entry", entry_json(r.entry)}, {"lease_ms", r.lease_ms}}) << "\n";
    } else {
      std::printf("entry %u generation %llu offset %llu bytes %llu tokens %u lease %u ms\n",
                  r.entry.index, static_cast<unsigned long long>(r.entry.generation),
                  static_cast<unsigned long long>(r.entry.offset),
                  static_cast<unsigned long long>(r.entry.bytes), r.entry.tokens, r.lease_ms);
    }
  } else {  // commit, revoke, renew
    need_positional(a, 0, "commit|revoke|renew --worker W --job J --index I --generation G");
    const uint64_t worker = need_u64(a, "--worker"), job = need_u64(a, "--job");
    const uint64_t index = need_u64(a, "--index"), gen = need_u64(a, "--generation");
    if (index > UINT32_MAX) throw UsageError{"--index is too large"};
    const auto idx = static_cast<uint32_t>(index);
    if (cmd == "commit") {
      std::vector<uint32_t> slices;
      if (auto* sl = opt(a, "--slices")) {
        size_t start = 0;
        while (start <= sl->size()) {
          const size_t comma = std::min(sl->find(',', start), sl->size());
          slices.push_back(parse_u32("--slices", sl->substr(start, comma - start)));
          start = comma + 1;
        }
      }
      take(client->commit_entry(worker, job, idx, gen, slices));
      print_ok(js);
    } else if (cmd == "revoke") {
      take(client->revoke_entry(worker, job, idx, gen));
      print_ok(js);
    } else {
      auto ms = take(client->renew_lease(worker, job, idx, gen));
      std::cout << (js ? dump(json{{"lease_ms", ms}}) : "lease " + std::to_string(ms) + " ms")
                << "\n";
    }
  }
  return kExitOk;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    Args a = parse_args(argc, argv);
    if (a.help) {
      std::printf(kHelp, kc::kDefaultEndpoint, kc::kDefaultWorkerEndpoint);
      return kExitOk;
    }
    return run(a);
  } catch (const UsageError& e) {
    std::fprintf(stderr, "keepctl: usage: %s\n", e.message.c_str());
    return kExitUsage;
  } catch (const Failure& f) {
    std::fprintf(stderr, "keepctl: %s: %s\n", keep::code_name(f.status.code()),
                 f.status.message().c_str());
    return kExitFailed;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "keepctl: internal: %s\n", e.what());
    return kExitFailed;
  }
}
