// Prometheus metrics for KEEP services: a Registry of Counter, Gauge and Histogram families,
// rendered in the Prometheus text exposition format 0.0.4 (see exposition.h and
// MetricsHttpServer in http_server.h). prometheus-cpp is not used; this is the whole client.
//
// Naming guidance for services (Prometheus conventions, ARCHITECTURE.md §6):
//   - every name starts with `keep_` and then the service: `keep_manager_...`, `keep_worker_...`;
//   - base units only, spelled as a suffix: `_seconds`, `_bytes`, `_ratio` (0..1), never ms or MiB;
//   - counters end in `_total` (ENFORCED: registering a counter without it is a KEEP_CHECK
//   failure);
//     a counter of seconds or bytes is `..._seconds_total` / `..._bytes_total`;
//   - gauges are current values (`keep_manager_memories`, `keep_manager_arena_used_bytes`);
//   - latencies are histograms in seconds (`keep_worker_time_to_first_token_seconds`,
//     `keep_manager_wal_fsync_seconds`) with default_latency_buckets() unless there is a reason;
//   - labels have a small, bounded set of values (a status code, an operation, a kind). Never put
//     unbounded values (segment ids, texts, request ids) in a label: every value is a new series.
//
// Usage:
//   Registry reg;
//   auto& writes = reg.counter("keep_manager_writes_total", "Memory writes.", {"kind"});
//   Counter& object_writes = writes.labels({"object_state"});  // cache this reference
//   object_writes.inc();                                        // hot path: one atomic
//   auto& fsync = reg.histogram("keep_manager_wal_fsync_seconds", "WAL fsync latency.");
//   fsync.get().observe(0.0021);
//   reg.add_collect_hook([&] { memories.get().set(store.size()); });  // refreshed at scrape time
//   std::string text = reg.render();
//
// Invalid names, label-count mismatches and conflicting re-registrations are programmer errors
// and abort through KEEP_CHECK. Label VALUES are free-form (they may come from requests): they are
// escaped at render time and invalid UTF-8 is replaced by U+FFFD, so no value can break a scrape.
//
// Threading: everything here is thread-safe. Updates of a child (Counter::inc, Gauge::set,
// Histogram::observe) are lock-free relaxed atomics; doubles are std::atomic<double> updated by
// compare-and-swap (C++20 fetch_add), so no precision is lost to fixed point. Looking a child up by
// label values takes the family's mutex; the returned reference stays valid for the lifetime of the
// Registry, so hot paths look it up once and keep it.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <initializer_list>
#include <map>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace keep::metrics {

enum class MetricType { kCounter, kGauge, kHistogram };
const char* metric_type_name(MetricType type);  // "counter", "gauge", "histogram"

// [a-zA-Z_:][a-zA-Z0-9_:]*
bool is_valid_metric_name(std::string_view name);
// [a-zA-Z_][a-zA-Z0-9_]* and not starting with "__" (reserved by Prometheus).
bool is_valid_label_name(std::string_view name);

// Histogram bucket upper bounds (the +Inf bucket is always implicit).
// 100 µs .. 10 s: 0.0001 0.00025 0.0005 0.001 0.0025 0.005 0.01 0.025 0.05 0.1 0.25 0.5 1 2.5 5 10.
std::vector<double> default_latency_buckets();
// start, start*factor, ... (count bounds); start > 0, factor > 1, count >= 1.
std::vector<double> exponential_buckets(double start, double factor, int count);
// start, start+width, ... (count bounds); width > 0, count >= 1.
std::vector<double> linear_buckets(double start, double width, int count);

// A monotonically increasing value. Exposed as `<name> <value>`.
class Counter {
 public:
  Counter() = default;
  Counter(const Counter&) = delete;
  Counter& operator=(const Counter&) = delete;

  // v must be >= 0 (a negative or NaN increment is a programmer error: KEEP_CHECK).
  void inc(double v = 1.0);
  double value() const { return value_.load(std::memory_order_relaxed); }

 private:
  std::atomic<double> value_{0.0};
};

// A value that goes up and down.
class Gauge {
 public:
  Gauge() = default;
  Gauge(const Gauge&) = delete;
  Gauge& operator=(const Gauge&) = delete;

  void set(double v) { value_.store(v, std::memory_order_relaxed); }
  void inc(double v = 1.0) { value_.fetch_add(v, std::memory_order_relaxed); }
  void dec(double v = 1.0) { value_.fetch_sub(v, std::memory_order_relaxed); }
  double value() const { return value_.load(std::memory_order_relaxed); }

 private:
  std::atomic<double> value_{0.0};
};

// Counts observations into buckets. Exposed as cumulative `<name>_bucket{le="..."}` series (the
// last one le="+Inf"), `<name>_sum` and `<name>_count`.
//
// observe() is lock-free: one relaxed increment of the bucket's counter and a CAS add to the sum.
// `_count` is rendered as the sum of the bucket counters, so `_count` always equals the +Inf
// bucket;
// `_sum` read concurrently with an observe() may lack that last observation (harmless for rates).
// NaN observations are dropped (they would poison `_sum` forever).
class Histogram {
 public:
  // `bounds` are strictly increasing finite upper bounds, owned by the family (must outlive this).
  explicit Histogram(const std::vector<double>* bounds);
  Histogram(const Histogram&) = delete;
  Histogram& operator=(const Histogram&) = delete;

  void observe(double v);

  struct Snapshot {
    std::vector<uint64_t> cumulative;  // bounds().size() + 1 entries; the last is +Inf (== count)
    double sum = 0.0;
    uint64_t count = 0;
  };
  Snapshot snapshot() const;
  const std::vector<double>& bounds() const { return *bounds_; }

 private:
  const std::vector<double>* bounds_;
  std::unique_ptr<std::atomic<uint64_t>[]> counts_;  // per bucket, not cumulative; +Inf last
  std::atomic<double> sum_{0.0};
};

// Observes the seconds between construction and destruction into a histogram.
class ScopedTimer {
 public:
  explicit ScopedTimer(Histogram& histogram)
      : histogram_(histogram), start_(std::chrono::steady_clock::now()) {}
  ~ScopedTimer() {
    histogram_.observe(
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count());
  }
  ScopedTimer(const ScopedTimer&) = delete;
  ScopedTimer& operator=(const ScopedTimer&) = delete;

 private:
  Histogram& histogram_;
  std::chrono::steady_clock::time_point start_;
};

// What every family has; the Registry renders through this.
class FamilyBase {
 public:
  virtual ~FamilyBase() = default;
  const std::string& name() const { return name_; }
  const std::string& help() const { return help_; }
  MetricType type() const { return type_; }
  const std::vector<std::string>& label_names() const { return label_names_; }

  // Appends `# HELP`, `# TYPE` and every child's samples (children sorted by label values).
  // Appends nothing when the family has no child yet.
  virtual void render(std::string* out) const = 0;

 protected:
  FamilyBase(std::string name, std::string help, MetricType type,
             std::vector<std::string> label_names);

 private:
  std::string name_;
  std::string help_;
  MetricType type_;
  std::vector<std::string> label_names_;
};

namespace detail {
// Orders label-value tuples; transparent so lookups need no allocation.
struct LabelValuesLess {
  using is_transparent = void;
  template <typename A, typename B>
  bool operator()(const A& a, const B& b) const {
    return std::lexicographical_compare(
        a.begin(), a.end(), b.begin(), b.end(),
        [](std::string_view x, std::string_view y) { return x < y; });
  }
};
}  // namespace detail

// A metric family: one name, one help, one set of label names; children by label values.
// T is Counter, Gauge or Histogram. Families are created by the Registry only.
template <typename T>
class Family final : public FamilyBase {
 public:
  // The child for these label values (as many as label_names(); else KEEP_CHECK), created on first
  // use. The reference stays valid as long as the Registry lives.
  T& labels(std::initializer_list<std::string_view> values);
  T& labels(std::span<const std::string_view> values);
  T& labels(const std::vector<std::string>& values);
  // The only child of a family without labels (KEEP_CHECK when it has labels).
  T& get();
  size_t size() const;

  void render(std::string* out) const override;

  // Internal: use Registry::counter/gauge/histogram.
  Family(std::string name, std::string help, MetricType type, std::vector<std::string> label_names,
         std::vector<double> bounds);
  const std::vector<double>& bounds() const { return bounds_; }

 private:
  std::unique_ptr<T> make_child() const;

  std::vector<double> bounds_;   // histograms only
  std::vector<std::string> le_;  // histograms: bounds_ formatted, then "+Inf"
  mutable std::mutex mu_;
  std::map<std::vector<std::string>, std::unique_ptr<T>, detail::LabelValuesLess> children_;
};

using CounterFamily = Family<Counter>;
using GaugeFamily = Family<Gauge>;
using HistogramFamily = Family<Histogram>;

class Registry {
 public:
  Registry() = default;
  Registry(const Registry&) = delete;
  Registry& operator=(const Registry&) = delete;

  // Registers a family, or returns the existing one when name, type, help, label names (and
  // buckets) are all the same. A different re-registration, an invalid name or label name, a
  // duplicate label name, a counter name without `_total`, a histogram label `le`, or a name whose
  // samples collide with another family's (`x_sum` vs histogram `x`) is a KEEP_CHECK failure.
  // A family without labels has its single child created at once (so it renders 0 from the start).
  CounterFamily& counter(std::string_view name, std::string_view help,
                         std::vector<std::string> label_names = {});
  GaugeFamily& gauge(std::string_view name, std::string_view help,
                     std::vector<std::string> label_names = {});
  // `buckets`: strictly increasing finite upper bounds (a trailing +Inf is accepted and dropped).
  HistogramFamily& histogram(std::string_view name, std::string_view help,
                             std::vector<std::string> label_names = {},
                             std::vector<double> buckets = default_latency_buckets());

  // Called (in registration order, on the rendering thread) at the start of every render(), to
  // refresh gauges from their sources. A hook must not call render(); an exception from a hook is
  // logged and the render goes on.
  void add_collect_hook(std::function<void()> hook);

  // Runs the collect hooks, then renders every family in text format 0.0.4, families sorted by
  // name. Concurrent calls are serialised (so hooks never run concurrently).
  std::string render() const;

 private:
  template <typename T>
  Family<T>& add(std::string_view name, std::string_view help, MetricType type,
                 std::vector<std::string> label_names, std::vector<double> bounds);

  mutable std::mutex render_mu_;  // serialises render() (and the hooks)
  mutable std::mutex mu_;         // families_, sample_names_, hooks_
  std::map<std::string, std::unique_ptr<FamilyBase>, std::less<>> families_;
  std::map<std::string, std::string, std::less<>> sample_names_;  // sample name -> family name
  std::vector<std::function<void()>> hooks_;
};

}  // namespace keep::metrics
