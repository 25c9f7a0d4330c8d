#include "benchmarks/manager/bench_support.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <kj/exception.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>
#include <zmq.hpp>

#include "shared/client/protocols.h"
#include "shared/rpc/wire_codec.h"

namespace keep::bench {
namespace {

Result<int> free_tcp_port() {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return Status(Code::kIoError, std::string("socket: ") + std::strerror(errno));
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = 0;
  socklen_t len = sizeof a;
  if (::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0 ||
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) != 0) {
    ::close(fd);
    return Status(Code::kIoError, std::string("bind: ") + std::strerror(errno));
  }
  int port = ntohs(a.sin_port);
  ::close(fd);
  return port;
}

double ticks_to_seconds(unsigned long long ticks) {
  static const double hz = static_cast<double>(::sysconf(_SC_CLK_TCK));
  return static_cast<double>(ticks) / hz;
}

// utime + stime from a /proc/.../stat file (fields 14 and 15, after the parenthesised comm).
double stat_cpu_seconds(const std::string& path) {
  std::ifstream in(path);
  std::string line;
  if (!std::getline(in, line)) return 0;
  size_t close = line.rfind(')');
  if (close == std::string::npos) return 0;
  std::istringstream rest(line.substr(close + 2));
  std::string field;
  unsigned long long utime = 0, stime = 0;
  for (int i = 3; i <= 15 && rest >> field; ++i) {
    if (i == 14) utime = std::strtoull(field.c_str(), nullptr, 10);
    if (i == 15) stime = std::strtoull(field.c_str(), nullptr, 10);
  }
  return ticks_to_seconds(utime + stime);
}

std::atomic<pid_t> g_child{-1};
void on_fatal_signal(int sig) {
  pid_t p = g_child.load();
  if (p > 0) ::kill(p, SIGTERM);
  ::signal(sig, SIG_DFL);
  ::raise(sig);
}

}  // namespace

// ---- ManagerProcess --------------------------------------------------------------------------

std::string find_manager_binary(const std::string& flag) {
  if (!flag.empty()) return flag;
  if (const char* dir = std::getenv("KEEP_BIN_DIR"); dir != nullptr && *dir != '\0') {
    return std::string(dir) + "/keep-manager";
  }
  std::error_code ec;
  auto self = std::filesystem::read_symlink("/proc/self/exe", ec);
  if (!ec) {
    auto candidate = self.parent_path() / "keep-manager";
    if (std::filesystem::exists(candidate, ec)) return candidate.string();
  }
  return "build/bin/keep-manager";
}

Result<std::unique_ptr<ManagerProcess>> ManagerProcess::start(
    const ManagerProcessOptions& options) {
  if (::access(options.binary.c_str(), X_OK) != 0) {
    return Status(Code::kNotFound, "keep-manager not found or not executable: '" + options.binary +
                                       "' (use --manager-bin or KEEP_BIN_DIR)");
  }
  std::unique_ptr<ManagerProcess> m(new ManagerProcess());
  std::string templ = options.data_parent + "/keep-bench-XXXXXX";
  std::vector<char> buf(templ.begin(), templ.end());
  buf.push_back('\0');
  if (::mkdtemp(buf.data()) == nullptr) {
    return Status(Code::kIoError, "mkdtemp " + templ + ": " + std::strerror(errno));
  }
  m->data_dir_ = buf.data();
  m->log_path_ = m->data_dir_ + ".log";
  static std::atomic<int> seq{0};
  m->shm_name_ = "keep-bench-" + std::to_string(::getpid()) + "-" + std::to_string(seq++);
  if (options.prepare) {
    KEEP_RETURN_IF_ERROR(
        options.prepare(m->data_dir_ + "/data").with_context("preparing the data dir"));
  }
  KEEP_ASSIGN_OR_RETURN(int port, free_tcp_port());
  KEEP_ASSIGN_OR_RETURN(m->metrics_port_, free_tcp_port());
  m->endpoint_ = "tcp://127.0.0.1:" + std::to_string(port);

  std::vector<std::string> args = {
      options.binary,
      "--data-dir",
      m->data_dir_ + "/data",
      "--endpoint",
      m->endpoint_,
      "--metrics-listen",
      "127.0.0.1:" + std::to_string(m->metrics_port_),
      "--shm-name",
      m->shm_name_,
      "--shm-bytes",
      "64MiB",
      "--fsync",
      options.fsync ? "true" : "false",
      "--encoder",
      options.models_dir + "/all-MiniLM-L6-v2",
      "--model",
      options.models_dir + "/SmolLM2-135M-Instruct.Q4_1.gguf",
      "--log-level",
      "warn",
  };
  for (const auto& a : options.extra_args) args.push_back(a);
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);

  std::vector<std::string> env_strings;
  for (char** e = environ; *e != nullptr; ++e) {
    if (!options.openblas_threads.empty() && std::strncmp(*e, "OPENBLAS_NUM_THREADS=", 21) == 0) {
      continue;
    }
    env_strings.emplace_back(*e);
  }
  if (!options.openblas_threads.empty()) {
    env_strings.push_back("OPENBLAS_NUM_THREADS=" + options.openblas_threads);
  }
  std::vector<char*> envp;
  for (auto& e : env_strings) envp.push_back(e.data());
  envp.push_back(nullptr);

  int log_fd = ::open(m->log_path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (log_fd < 0)
    return Status(Code::kIoError, "open " + m->log_path_ + ": " + std::strerror(errno));
  const pid_t parent = ::getpid();
  pid_t pid = ::fork();
  if (pid < 0) {
    ::close(log_fd);
    return Status(Code::kIoError, std::string("fork: ") + std::strerror(errno));
  }
  if (pid == 0) {
    ::prctl(PR_SET_PDEATHSIG, SIGTERM);  // never outlive the benchmark
    if (::getppid() != parent) ::_exit(127);
    ::dup2(log_fd, STDOUT_FILENO);
    ::dup2(log_fd, STDERR_FILENO);
    ::execve(argv[0], argv.data(), envp.data());
    ::_exit(127);
  }
  ::close(log_fd);
  m->pid_ = pid;
  g_child.store(pid);
  ::signal(SIGINT, on_fatal_signal);
  ::signal(SIGTERM, on_fatal_signal);

  client::ClientOptions co;
  co.endpoint = m->endpoint_;
  co.timeout = std::chrono::milliseconds(500);
  KEEP_ASSIGN_OR_RETURN(auto c, client::ManagerClient::connect(co));
  const auto deadline = Clock::now() + options.ready_timeout;
  for (;;) {
    int wstatus = 0;
    if (::waitpid(pid, &wstatus, WNOHANG) == pid) {
      m->pid_ = -1;
      std::ifstream log(m->log_path_);
      std::stringstream ss;
      ss << log.rdbuf();
      return Status(Code::kUnavailable, "keep-manager exited during start-up: " + ss.str());
    }
    if (c->ping().is_ok()) break;
    if (Clock::now() > deadline) {
      return Status(Code::kTimeout, "keep-manager did not answer ping within " +
                                        std::to_string(options.ready_timeout.count()) + " s");
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  return m;
}

ManagerProcess::~ManagerProcess() {
  if (pid_ > 0) {
    ::kill(pid_, SIGTERM);
    int wstatus = 0;
    bool gone = false;
    for (int i = 0; i < 6000 && !gone; ++i) {
      if (::waitpid(pid_, &wstatus, WNOHANG) == pid_) {
        gone = true;
      } else {
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
      }
    }
    if (!gone) {
      ::kill(pid_, SIGKILL);
      ::waitpid(pid_, &wstatus, 0);
    }
    g_child.store(-1);
  }
  if (!shm_name_.empty()) ::shm_unlink(("/" + shm_name_).c_str());
  std::error_code ec;
  if (!data_dir_.empty()) std::filesystem::remove_all(data_dir_, ec);
  if (!log_path_.empty() && std::getenv("KEEP_BENCH_KEEP_LOG") == nullptr) {
    std::filesystem::remove(log_path_, ec);
  }
}

double ManagerProcess::cpu_seconds() const {
  return stat_cpu_seconds("/proc/" + std::to_string(pid_) + "/stat");
}

std::vector<ThreadCpu> ManagerProcess::thread_cpu() const {
  std::vector<ThreadCpu> out;
  std::error_code ec;
  const std::string dir = "/proc/" + std::to_string(pid_) + "/task";
  for (const auto& e : std::filesystem::directory_iterator(dir, ec)) {
    ThreadCpu t;
    t.tid = std::atoi(e.path().filename().c_str());
    std::ifstream comm(e.path() / "comm");
    std::getline(comm, t.name);
    t.seconds = stat_cpu_seconds((e.path() / "stat").string());
    std::ifstream sched(e.path() / "schedstat");
    unsigned long long run_ns = 0, wait_ns = 0;
    if (sched >> run_ns >> wait_ns) t.wait_seconds = 1e-9 * static_cast<double>(wait_ns);
    out.push_back(t);
  }
  std::sort(out.begin(), out.end(),
            [](const ThreadCpu& a, const ThreadCpu& b) { return a.tid < b.tid; });
  return out;
}

Result<std::string> ManagerProcess::scrape_metrics() const {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return Status(Code::kIoError, std::string("socket: ") + std::strerror(errno));
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = htons(static_cast<uint16_t>(metrics_port_));
  if (::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) {
    ::close(fd);
    return Status(Code::kUnavailable, std::string("connect /metrics: ") + std::strerror(errno));
  }
  const std::string req = "GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n";
  if (::send(fd, req.data(), req.size(), MSG_NOSIGNAL) != static_cast<ssize_t>(req.size())) {
    ::close(fd);
    return Status(Code::kIoError, "send /metrics request failed");
  }
  std::string resp;
  char chunk[65536];
  for (;;) {
    ssize_t n = ::recv(fd, chunk, sizeof chunk, 0);
    if (n <= 0) break;
    resp.append(chunk, static_cast<size_t>(n));
  }
  ::close(fd);
  size_t body = resp.find("\r\n\r\n");
  if (body == std::string::npos) return Status(Code::kMalformed, "no HTTP body from /metrics");
  return resp.substr(body + 4);
}

double metric_with_label(const std::string& text, const std::string& name,
                         const std::string& label) {
  double sum = 0;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) {
    if (line.empty() || line[0] == '#') continue;
    size_t end = line.find_first_of("{ ");
    if (end == std::string::npos || line.compare(0, end, name) != 0 || end != name.size()) continue;
    size_t sp = line.rfind(' ');
    if (!label.empty()) {
      size_t brace = line.find('}');
      if (line[end] != '{' || brace == std::string::npos ||
          line.substr(end, brace - end).find(label) == std::string::npos) {
        continue;
      }
    }
    sum += std::strtod(line.c_str() + sp + 1, nullptr);
  }
  return sum;
}

double metric_sum(const std::string& text, const std::string& name) {
  return metric_with_label(text, name, "");
}

double self_cpu_seconds() {
  rusage ru{};
  ::getrusage(RUSAGE_SELF, &ru);
  return static_cast<double>(ru.ru_utime.tv_sec + ru.ru_stime.tv_sec) +
         1e-6 * static_cast<double>(ru.ru_utime.tv_usec + ru.ru_stime.tv_usec);
}

// ---- TextGenerator ---------------------------------------------------------------------------

namespace {
constexpr const char* kObjects[] = {
    "red cup",     "blue plate", "apple",         "bath towel",     "remote control",
    "laptop",      "sponge",     "bread knife",   "cookbook",       "milk bottle",
    "desk lamp",   "pillow",     "wine glass",    "frying pan",     "toothbrush",
    "soap bar",    "keys",       "wallet",        "cereal box",     "salt shaker",
    "tomato",      "potato",     "dish soap",     "laundry basket", "watering can",
    "alarm clock", "coffee mug", "cutting board", "spatula",        "vase"};
constexpr const char* kRooms[] = {"kitchen", "living room", "bedroom", "bathroom",
                                  "hallway", "dining room", "office",  "laundry room",
                                  "garage",  "kids room"};
constexpr const char* kPlaces[] = {
    "counter",         "fridge",  "sink", "sofa",       "dining table", "shelf", "drawer",
    "dishwasher",      "cabinet", "desk", "nightstand", "windowsill",   "floor", "coffee table",
    "washing machine", "bin"};
constexpr const char* kStates[] = {"clean", "dirty",  "open",   "closed", "full",
                                   "empty", "broken", "wet",    "hot",    "cold",
                                   "on",    "off",    "sliced", "washed", "half full"};
constexpr const char* kVerbs[] = {"moved",  "picked up", "washed", "put away", "heated",
                                  "sliced", "opened",    "closed", "filled",   "threw away"};
constexpr const char* kQueries[] = {
    "Put the %s from the %s into the %s.",
    "Where is the %s? I last saw it near the %s in the %s.",
    "Make breakfast: find the %s, the %s and something from the %s.",
    "Clean up the %s: wash the %s and put it on the %s.",
};
template <size_t N>
const char* pick(const char* const (&arr)[N], uint64_t r) {
  return arr[r % N];
}
}  // namespace

uint64_t TextGenerator::rnd() {
  // xorshift64*
  state_ ^= state_ >> 12;
  state_ ^= state_ << 25;
  state_ ^= state_ >> 27;
  return state_ * 2685821657736338717ull;
}

std::string TextGenerator::next(client::SegmentKind* kind) {
  char buf[512];
  const uint64_t n = ++counter_;
  const char* obj = pick(kObjects, rnd());
  const char* room = pick(kRooms, rnd());
  const char* place = pick(kPlaces, rnd());
  const uint64_t id = rnd() % 1000;
  switch (rnd() % 4) {
    case 0:
      *kind = client::SegmentKind::kObjectState;
      std::snprintf(buf, sizeof buf, "The %s #%llu is %s, on the %s in the %s.", obj,
                    static_cast<unsigned long long>(id), pick(kStates, rnd()), place, room);
      break;
    case 1:
      *kind = client::SegmentKind::kObjectState;
      std::snprintf(buf, sizeof buf,
                    "%s (%s): %s #%llu is %s; next to it: %s. Last checked at step %llu.", room,
                    place, obj, static_cast<unsigned long long>(id), pick(kStates, rnd()),
                    pick(kObjects, rnd()), static_cast<unsigned long long>(n));
      break;
    case 2:
      *kind = client::SegmentKind::kTaskRecord;
      std::snprintf(buf, sizeof buf,
                    "Step %llu: %s the %s #%llu from the %s to the %s in the %s. Result: success.",
                    static_cast<unsigned long long>(n), pick(kVerbs, rnd()), obj,
                    static_cast<unsigned long long>(id), place, pick(kPlaces, rnd()), room);
      break;
    default:
      *kind = client::SegmentKind::kTaskRecord;
      std::snprintf(buf, sizeof buf,
                    "Task %llu failed: could not %s the %s in the %s because the %s was %s.",
                    static_cast<unsigned long long>(n), pick(kVerbs, rnd()), obj, room, place,
                    pick(kStates, rnd()));
      break;
  }
  return buf;
}

std::string TextGenerator::query() {
  char buf[512];
  const uint64_t n = ++counter_;
  int len = std::snprintf(buf, sizeof buf, pick(kQueries, rnd()), pick(kObjects, rnd()),
                          pick(kPlaces, rnd()), pick(kRooms, rnd()));
  std::snprintf(buf + len, sizeof buf - static_cast<size_t>(len), " (request %llu)",
                static_cast<unsigned long long>(n));
  return buf;
}

// ---- latency -----------------------------------------------------------------------------------

LatencySummary summarize(std::vector<double> us) {
  LatencySummary s;
  s.n = us.size();
  if (us.empty()) return s;
  std::sort(us.begin(), us.end());
  double sum = 0;
  for (double v : us) sum += v;
  s.mean_us = sum / static_cast<double>(us.size());
  auto pct = [&](double p) {
    size_t i = static_cast<size_t>(std::ceil(p * static_cast<double>(us.size()))) - 1;
    return us[std::min(i, us.size() - 1)];
  };
  s.p50_us = pct(0.50);
  s.p90_us = pct(0.90);
  s.p99_us = pct(0.99);
  s.max_us = us.back();
  return s;
}

// ---- PipelinedWriter -------------------------------------------------------------------------

std::shared_ptr<void> make_zmq_context(int io_threads) {
  auto* ctx = new zmq::context_t(io_threads);
  return std::shared_ptr<void>(ctx, [](void* p) { delete static_cast<zmq::context_t*>(p); });
}

struct PipelinedWriter::Impl {
  std::unique_ptr<zmq::socket_t> socket;
  uint64_t next_id = 1;
};

PipelinedWriter::~PipelinedWriter() = default;

Result<std::unique_ptr<PipelinedWriter>> PipelinedWriter::connect(void* context,
                                                                  const std::string& endpoint) {
  std::unique_ptr<PipelinedWriter> w(new PipelinedWriter());
  w->impl_ = std::make_unique<Impl>();
  try {
    auto* ctx = static_cast<zmq::context_t*>(context);
    w->impl_->socket = std::make_unique<zmq::socket_t>(*ctx, zmq::socket_type::dealer);
    w->impl_->socket->set(zmq::sockopt::linger, 0);
    w->impl_->socket->connect(endpoint);
  } catch (const zmq::error_t& e) {
    return Status(Code::kUnavailable, "connect " + endpoint + ": " + e.what());
  }
  return w;
}

Result<uint64_t> PipelinedWriter::send_write(const std::string& agent, const std::string& text,
                                             client::SegmentKind kind) {
  capnp::MallocMessageBuilder message;
  auto req = message.initRoot<proto::Request>();
  const uint64_t id = impl_->next_id++;
  req.setProtocolVersion(keep::client::ManagerProtocol::kVersion);
  req.setRequestId(id);
  auto w = req.initWriteMemory();
  w.setAgent(agent);
  w.setText(text);
  w.setKind(kind == client::SegmentKind::kTaskRecord    ? proto::SegmentKind::TASK_RECORD
            : kind == client::SegmentKind::kExamplePlan ? proto::SegmentKind::EXAMPLE_PLAN
                                                        : proto::SegmentKind::OBJECT_STATE);
  const std::string payload = wire::encode(message);
  try {
    impl_->socket->send(zmq::message_t(), zmq::send_flags::sndmore);
    impl_->socket->send(zmq::message_t(payload.data(), payload.size()), zmq::send_flags::none);
  } catch (const zmq::error_t& e) {
    return Status(Code::kUnavailable, std::string("zmq send: ") + e.what());
  }
  return id;
}

Status PipelinedWriter::receive(std::chrono::milliseconds timeout, uint64_t* request_id,
                                Status* call_status) {
  auto& socket = *impl_->socket;
  try {
    zmq::message_t empty;
    if (!socket.recv(empty, zmq::recv_flags::dontwait)) {
      zmq::pollitem_t item{static_cast<void*>(socket), 0, ZMQ_POLLIN, 0};
      zmq::poll(&item, 1, timeout);
      if (!(item.revents & ZMQ_POLLIN)) return Status(Code::kTimeout, "no answer");
      if (!socket.recv(empty, zmq::recv_flags::dontwait)) {
        return Status(Code::kTimeout, "no answer");
      }
    }
    if (!empty.more() || empty.size() != 0) return Status(Code::kMalformed, "bad framing");
    zmq::message_t payload;
    if (!socket.recv(payload, zmq::recv_flags::none)) return Status(Code::kMalformed, "no payload");
    auto decoded = wire::decode_message(
        {static_cast<const std::byte*>(payload.data()), payload.size()}, wire::WireLimits{});
    if (!decoded.is_ok()) return decoded.status();
    auto resp = (*decoded)->root<proto::Response>();
    *request_id = resp.getRequestId();
    if (resp.which() == proto::Response::ERROR) {
      *call_status = wire::status_from_error(resp.getError());
    } else if (resp.which() != proto::Response::WRITE_MEMORY) {
      *call_status = Status(Code::kMalformed, "unexpected answer type");
    } else {
      *call_status = Status::ok();
    }
  } catch (const zmq::error_t& e) {
    return Status(Code::kUnavailable, std::string("zmq recv: ") + e.what());
  } catch (const kj::Exception& e) {
    return Status(Code::kMalformed, std::string("decode: ") + e.getDescription().cStr());
  }
  return Status::ok();
}

Result<std::vector<uint64_t>> parse_list(const std::string& s, const std::string& flag) {
  std::vector<uint64_t> out;
  std::stringstream ss(s);
  for (std::string item; std::getline(ss, item, ',');) {
    char* end = nullptr;
    unsigned long long v = std::strtoull(item.c_str(), &end, 10);
    if (item.empty() || *end != '\0' || v == 0) {
      return Status(Code::kInvalidArgument,
                    "--" + flag + ": not a positive integer: '" + item + "'");
    }
    out.push_back(v);
  }
  if (out.empty()) return Status(Code::kInvalidArgument, "--" + flag + ": empty list");
  return out;
}

void add_manager_options(Options* o) {
  o->add("fsync", "true", "keep-manager --fsync (fdatasync per batch before acknowledging)");
  o->add("manager-bin", "",
         "keep-manager path (default: $KEEP_BIN_DIR, this binary's dir, build/bin)");
  o->add("models-dir", KEEP_SOURCE_DIR "/models",
         "directory with all-MiniLM-L6-v2/ and qwen2.5-tokenizer/");
  o->add("data-parent", "/tmp", "the manager's data dir is created (and removed) under it");
  o->add("manager-openblas-threads", "1", "OPENBLAS_NUM_THREADS of the manager (empty: inherit)");
  o->add("manager-args", "", "extra keep-manager flags, space-separated");
}

Result<ManagerProcessOptions> manager_options_from(const Options& o) {
  ManagerProcessOptions mo;
  KEEP_ASSIGN_OR_RETURN(mo.fsync, o.boolean("fsync"));
  mo.binary = find_manager_binary(o.str("manager-bin"));
  mo.models_dir = o.str("models-dir");
  mo.data_parent = o.str("data-parent");
  mo.openblas_threads = o.str("manager-openblas-threads");
  std::stringstream ss(o.str("manager-args"));
  for (std::string a; ss >> a;) mo.extra_args.push_back(a);
  return mo;
}

}  // namespace keep::bench
