// A real etcd cluster for tests: three etcd-server members on loopback (free ports, a temp data
// dir each), killed with the object. kEtcd is Debian's binary; tests skip where it is missing.
#pragma once

#include <doctest/doctest.h>

#include <csignal>
#include <thread>

#include "shared/cluster/etcd_client.h"
#include "tests/integration/manager/manager_process.h"

namespace keep::itest {

using namespace std::chrono_literals;

inline const char* const kEtcd = "/usr/bin/etcd";

// Three etcd members, each its own process and data dir, client and peer URLs on free ports.
struct EtcdCluster {
  TempDir dir{"etcd"};
  std::vector<pid_t> pids;
  std::vector<std::string> clients;

  EtcdCluster() {
    std::vector<std::string> peers;
    std::string initial;
    for (int i = 0; i < 3; ++i) {
      clients.push_back("http://127.0.0.1:" + std::to_string(free_port()));
      peers.push_back("http://127.0.0.1:" + std::to_string(free_port()));
      initial += (i ? "," : "") + ("m" + std::to_string(i)) + "=" + peers.back();
    }
    for (int i = 0; i < 3; ++i) {
      const std::string name = "m" + std::to_string(i);
      const std::string d = (dir.path() / name).string();
      pids.push_back(spawn({kEtcd,      "--name",
                            name,       "--data-dir",
                            d,          "--listen-client-urls",
                            clients[i], "--advertise-client-urls",
                            clients[i], "--listen-peer-urls",
                            peers[i],   "--initial-advertise-peer-urls",
                            peers[i],   "--initial-cluster",
                            initial,    "--initial-cluster-state",
                            "new",      "--heartbeat-interval",
                            "50",       "--election-timeout",
                            "500"},
                           d + ".out", d + ".err"));
    }
  }
  ~EtcdCluster() {
    for (pid_t p : pids) {
      if (p > 0) {
        ::kill(p, SIGKILL);
        wait_for(p, 5s);
      }
    }
  }
  void kill(int i) {
    ::kill(pids[static_cast<size_t>(i)], SIGKILL);
    wait_for(pids[static_cast<size_t>(i)], 5s);
    pids[static_cast<size_t>(i)] = -1;
  }
  std::unique_ptr<cluster::EtcdClient> client(std::vector<std::string> endpoints = {}) {
    cluster::EtcdOptions o;
    o.endpoints = endpoints.empty() ? clients : std::move(endpoints);
    o.timeout = 1000ms;
    auto c = cluster::EtcdClient::create(o);
    REQUIRE(c.is_ok());
    return std::move(c).value();
  }
  // Until the cluster has a leader and takes writes.
  void wait_ready() {
    auto c = client();
    for (int i = 0; i < 200; ++i) {
      if (c->put("/ready", "1").is_ok()) return;
      std::this_thread::sleep_for(50ms);
    }
    FAIL("etcd cluster did not start: " << read_text(dir.path() / "m0.err"));
  }
};

inline bool have_etcd() { return ::access(kEtcd, X_OK) == 0; }

}  // namespace keep::itest
