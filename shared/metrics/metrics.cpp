#include "shared/metrics/metrics.h"

#include <charconv>
#include <cmath>
#include <exception>

#include "shared/common/log.h"
#include "shared/common/status.h"
#include "shared/metrics/exposition.h"

namespace keep::metrics {
namespace {

bool is_name_char(char c, bool allow_colon, bool allow_digit) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_' ||
         (allow_colon && c == ':') || (allow_digit && c >= '0' && c <= '9');
}

bool ends_with(std::string_view s, std::string_view suffix) {
  return s.size() >= suffix.size() && s.substr(s.size() - suffix.size()) == suffix;
}

void append_uint(std::string* out, uint64_t v) {
  char buf[24];
  auto [end, ec] = std::to_chars(buf, buf + sizeof(buf), v);
  out->append(buf, end);
}

[[noreturn]] void fail(const std::string& message) {
  check_failed(__FILE__, __LINE__, "metrics registration", message.c_str());
}

}  // namespace

const char* metric_type_name(MetricType type) {
  switch (type) {
    case MetricType::kCounter:
      return "counter";
    case MetricType::kGauge:
      return "gauge";
    case MetricType::kHistogram:
      return "histogram";
  }
  return "untyped";
}

bool is_valid_metric_name(std::string_view name) {
  if (name.empty() || !is_name_char(name[0], true, false)) return false;
  for (char c : name.substr(1)) {
    if (!is_name_char(c, true, true)) return false;
  }
  return true;
}

bool is_valid_label_name(std::string_view name) {
  if (name.empty() || !is_name_char(name[0], false, false)) return false;
  if (name.size() >= 2 && name[0] == '_' && name[1] == '_') return false;
  for (char c : name.substr(1)) {
    if (!is_name_char(c, false, true)) return false;
  }
  return true;
}

std::vector<double> default_latency_buckets() {
  return {0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025,
          0.05,   0.1,     0.25,   0.5,   1,      2.5,   5,    10};
}

std::vector<double> exponential_buckets(double start, double factor, int count) {
  KEEP_CHECK_MSG(start > 0 && factor > 1 && count >= 1, "exponential_buckets: bad arguments");
  std::vector<double> b;
  b.reserve(static_cast<size_t>(count));
  double v = start;
  for (int i = 0; i < count; ++i, v *= factor) b.push_back(v);
  return b;
}

std::vector<double> linear_buckets(double start, double width, int count) {
  KEEP_CHECK_MSG(width > 0 && count >= 1, "linear_buckets: bad arguments");
  std::vector<double> b;
  b.reserve(static_cast<size_t>(count));
  for (int i = 0; i < count; ++i) b.push_back(start + width * i);
  return b;
}

// ---- children
// ------------------------------------------------------------------------------------

void Counter::inc(double v) {
  KEEP_CHECK_MSG(v >= 0, "Counter::inc: a counter only goes up (negative or NaN increment)");
  value_.fetch_add(v, std::memory_order_relaxed);
}

Histogram::Histogram(const std::vector<double>* bounds)
    : bounds_(bounds), counts_(new std::atomic<uint64_t>[bounds->size() + 1]) {
  for (size_t i = 0; i <= bounds_->size(); ++i) counts_[i].store(0, std::memory_order_relaxed);
}

void Histogram::observe(double v) {
  if (std::isnan(v)) return;
  // Bucket i holds bounds[i-1] < v <= bounds[i]; the last one is +Inf.
  const auto& b = *bounds_;
  const size_t i = static_cast<size_t>(std::lower_bound(b.begin(), b.end(), v) - b.begin());
  counts_[i].fetch_add(1, std::memory_order_relaxed);
  sum_.fetch_add(v, std::memory_order_relaxed);
}

Histogram::Snapshot Histogram::snapshot() const {
  Snapshot s;
  s.cumulative.resize(bounds_->size() + 1);
  uint64_t acc = 0;
  for (size_t i = 0; i <= bounds_->size(); ++i) {
    acc += counts_[i].load(std::memory_order_relaxed);
    s.cumulative[i] = acc;
  }
  s.count = acc;
  s.sum = sum_.load(std::memory_order_relaxed);
  return s;
}

// ---- families
// ------------------------------------------------------------------------------------

FamilyBase::FamilyBase(std::string name, std::string help, MetricType type,
                       std::vector<std::string> label_names)
    : name_(std::move(name)),
      help_(std::move(help)),
      type_(type),
      label_names_(std::move(label_names)) {}

template <typename T>
Family<T>::Family(std::string name, std::string help, MetricType type,
                  std::vector<std::string> label_names, std::vector<double> bounds)
    : FamilyBase(std::move(name), std::move(help), type, std::move(label_names)),
      bounds_(std::move(bounds)) {
  if (type == MetricType::kHistogram) {
    for (double b : bounds_) le_.push_back(format_value(b));
    le_.push_back("+Inf");
  }
}

template <typename T>
std::unique_ptr<T> Family<T>::make_child() const {
  if constexpr (std::is_same_v<T, Histogram>) {
    return std::make_unique<Histogram>(&bounds_);
  } else {
    return std::make_unique<T>();
  }
}

template <typename T>
T& Family<T>::labels(std::span<const std::string_view> values) {
  if (values.size() != label_names().size()) {
    fail("metric " + name() + " has " + std::to_string(label_names().size()) +
         " label(s) but was given " + std::to_string(values.size()) + " value(s)");
  }
  std::lock_guard<std::mutex> lock(mu_);
  auto it = children_.find(values);
  if (it != children_.end()) return *it->second;
  std::vector<std::string> key(values.begin(), values.end());
  auto [pos, inserted] = children_.emplace(std::move(key), make_child());
  return *pos->second;
}

template <typename T>
T& Family<T>::labels(std::initializer_list<std::string_view> values) {
  return labels(std::span<const std::string_view>(values.begin(), values.size()));
}

template <typename T>
T& Family<T>::labels(const std::vector<std::string>& values) {
  std::vector<std::string_view> views(values.begin(), values.end());
  return labels(std::span<const std::string_view>(views));
}

template <typename T>
T& Family<T>::get() {
  return labels(std::span<const std::string_view>());
}

template <typename T>
size_t Family<T>::size() const {
  std::lock_guard<std::mutex> lock(mu_);
  return children_.size();
}

template <typename T>
void Family<T>::render(std::string* out) const {
  std::lock_guard<std::mutex> lock(mu_);
  if (children_.empty()) return;
  out->append("# HELP ");
  out->append(name());
  out->push_back(' ');
  append_escaped_help(out, help());
  out->append("\n# TYPE ");
  out->append(name());
  out->push_back(' ');
  out->append(metric_type_name(type()));
  out->push_back('\n');
  for (const auto& [values, child] : children_) {
    if constexpr (std::is_same_v<T, Histogram>) {
      const Histogram::Snapshot s = child->snapshot();
      for (size_t i = 0; i < s.cumulative.size(); ++i) {
        out->append(name());
        out->append("_bucket");
        append_labels(out, label_names(), values, "le", le_[i]);
        out->push_back(' ');
        append_uint(out, s.cumulative[i]);
        out->push_back('\n');
      }
      out->append(name());
      out->append("_sum");
      append_labels(out, label_names(), values);
      out->push_back(' ');
      append_value(out, s.sum);
      out->push_back('\n');
      out->append(name());
      out->append("_count");
      append_labels(out, label_names(), values);
      out->push_back(' ');
      append_uint(out, s.count);
      out->push_back('\n');
    } else {
      out->append(name());
      append_labels(out, label_names(), values);
      out->push_back(' ');
      append_value(out, child->value());
      out->push_back('\n');
    }
  }
}

template class Family<Counter>;
template class Family<Gauge>;
template class Family<Histogram>;

// ---- registry
// ------------------------------------------------------------------------------------

template <typename T>
Family<T>& Registry::add(std::string_view name, std::string_view help, MetricType type,
                         std::vector<std::string> label_names, std::vector<double> bounds) {
  const std::string n(name);
  if (!is_valid_metric_name(name)) fail("invalid metric name '" + n + "'");
  if (type == MetricType::kCounter && !ends_with(name, "_total")) {
    fail("counter name '" + n + "' must end in _total");
  }
  for (size_t i = 0; i < label_names.size(); ++i) {
    if (!is_valid_label_name(label_names[i])) {
      fail("metric " + n + ": invalid label name '" + label_names[i] + "'");
    }
    if (type == MetricType::kHistogram && label_names[i] == "le") {
      fail("histogram " + n + ": label name 'le' is reserved");
    }
    for (size_t j = 0; j < i; ++j) {
      if (label_names[j] == label_names[i]) {
        fail("metric " + n + ": duplicate label name '" + label_names[i] + "'");
      }
    }
  }
  if (type == MetricType::kHistogram) {
    if (!bounds.empty() && std::isinf(bounds.back()) && bounds.back() > 0) bounds.pop_back();
    for (size_t i = 0; i < bounds.size(); ++i) {
      if (!std::isfinite(bounds[i]) || (i > 0 && !(bounds[i - 1] < bounds[i]))) {
        fail("histogram " + n + ": buckets must be finite and strictly increasing");
      }
    }
  }

  std::vector<std::string> samples;
  if (type == MetricType::kHistogram) {
    samples = {n + "_bucket", n + "_sum", n + "_count"};
  } else {
    samples = {n};
  }

  Family<T>* family = nullptr;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = families_.find(name);
    if (it != families_.end()) {
      FamilyBase* existing = it->second.get();
      auto* same = dynamic_cast<Family<T>*>(existing);
      if (same == nullptr || existing->type() != type || existing->help() != help ||
          existing->label_names() != label_names || same->bounds() != bounds) {
        fail("metric " + n + " registered twice with a different type, help, labels or buckets");
      }
      return *same;
    }
    for (const auto& s : samples) {
      auto sit = sample_names_.find(s);
      if (sit != sample_names_.end()) {
        fail("metric " + n + ": sample name " + s + " collides with metric " + sit->second);
      }
    }
    auto owned = std::make_unique<Family<T>>(n, std::string(help), type, std::move(label_names),
                                             std::move(bounds));
    family = owned.get();
    families_.emplace(n, std::move(owned));
    for (auto& s : samples) sample_names_.emplace(std::move(s), n);
  }
  if (family->label_names().empty()) family->get();  // renders 0 from the start
  return *family;
}

CounterFamily& Registry::counter(std::string_view name, std::string_view help,
                                 std::vector<std::string> label_names) {
  return add<Counter>(name, help, MetricType::kCounter, std::move(label_names), {});
}

GaugeFamily& Registry::gauge(std::string_view name, std::string_view help,
                             std::vector<std::string> label_names) {
  return add<Gauge>(name, help, MetricType::kGauge, std::move(label_names), {});
}

HistogramFamily& Registry::histogram(std::string_view name, std::string_view help,
                                     std::vector<std::string> label_names,
                                     std::vector<double> buckets) {
  return add<Histogram>(name, help, MetricType::kHistogram, std::move(label_names),
                        std::move(buckets));
}

void Registry::add_collect_hook(std::function<void()> hook) {
  KEEP_CHECK(hook != nullptr);
  std::lock_guard<std::mutex> lock(mu_);
  hooks_.push_back(std::move(hook));
}

std::string Registry::render() const {
  std::lock_guard<std::mutex> render_lock(render_mu_);
  std::vector<std::function<void()>> hooks;
  {
    std::lock_guard<std::mutex> lock(mu_);
    hooks = hooks_;
  }
  for (const auto& hook : hooks) {
    try {
      hook();
    } catch (const std::exception& e) {
      KEEP_LOG_WARN("metrics", "collect hook failed: %s", e.what());
    } catch (...) {
      KEEP_LOG_WARN("metrics", "collect hook failed with a non-standard exception");
    }
  }
  std::vector<const FamilyBase*> families;
  {
    std::lock_guard<std::mutex> lock(mu_);
    families.reserve(families_.size());
    for (const auto& [name, family] : families_) families.push_back(family.get());
  }
  std::string out;
  for (const FamilyBase* family : families) family->render(&out);
  return out;
}

}  // namespace keep::metrics
