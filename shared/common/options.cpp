#include "shared/common/options.h"

#include <cerrno>
#include <cstdlib>
#include <fstream>
#include <sstream>

namespace keep {
namespace {

std::string trim(const std::string& s) {
  size_t b = s.find_first_not_of(" \t\r\n");
  if (b == std::string::npos) return "";
  size_t e = s.find_last_not_of(" \t\r\n");
  return s.substr(b, e - b + 1);
}

}  // namespace

Options::Options(std::string program, std::string summary)
    : program_(std::move(program)), summary_(std::move(summary)) {
  add("config", "", "config file of `name = value` lines, read before the flags");
}

void Options::add(const std::string& name, const std::string& default_value,
                  const std::string& help) {
  KEEP_CHECK_MSG(
      !name.empty() &&
          name.find_first_not_of("abcdefghijklmnopqrstuvwxyz0123456789-_") == std::string::npos,
      name.c_str());
  KEEP_CHECK_MSG(entries_.count(name) == 0, name.c_str());
  order_.push_back(name);
  entries_[name] = Entry{default_value, default_value, help};
}

Status Options::set(const std::string& name, const std::string& value) {
  auto it = entries_.find(name);
  if (it == entries_.end()) {
    return Status(Code::kInvalidArgument, "unknown option '" + name + "' (see --help)");
  }
  it->second.value = value;
  return Status::ok();
}

Status Options::load_file(const std::string& path) {
  std::ifstream in(path);
  if (!in) return Status(Code::kIoError, "cannot open config file '" + path + "'");
  std::string line;
  int lineno = 0;
  while (std::getline(in, line)) {
    ++lineno;
    size_t hash = line.find('#');
    if (hash != std::string::npos) line.resize(hash);
    line = trim(line);
    if (line.empty()) continue;
    size_t eq = line.find('=');
    if (eq == std::string::npos) {
      return Status(Code::kInvalidArgument,
                    path + ":" + std::to_string(lineno) + ": expected `name = value`");
    }
    std::string name = trim(line.substr(0, eq));
    if (name == "config") {
      return Status(Code::kInvalidArgument,
                    path + ":" + std::to_string(lineno) + ": 'config' cannot be set in a file");
    }
    Status st = set(name, trim(line.substr(eq + 1)));
    if (!st.is_ok()) return st.with_context(path + ":" + std::to_string(lineno));
  }
  return Status::ok();
}

Status Options::parse(int argc, char** argv) {
  // Pass 1: --help and --config, so the file is applied before the flags that override it.
  std::vector<std::pair<std::string, std::string>> flags;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--help" || a == "-h") {
      help_ = true;
      return Status::ok();
    }
    if (a.rfind("--", 0) != 0 || a.size() == 2) {
      positional_.push_back(a);
      continue;
    }
    std::string body = a.substr(2);
    std::string name, value;
    size_t eq = body.find('=');
    if (eq != std::string::npos) {
      name = body.substr(0, eq);
      value = body.substr(eq + 1);
    } else {
      name = body;
      auto it = entries_.find(name);
      bool is_bool = it != entries_.end() &&
                     (it->second.default_value == "true" || it->second.default_value == "false");
      if (is_bool &&
          (i + 1 >= argc || std::string(argv[i + 1]).rfind("--", 0) == 0 ||
           !(std::string(argv[i + 1]) == "true" || std::string(argv[i + 1]) == "false"))) {
        value = "true";  // a bare boolean flag
      } else if (i + 1 < argc && std::string(argv[i + 1]).rfind("--", 0) != 0) {
        value = argv[++i];
      } else {
        return Status(Code::kInvalidArgument, "option --" + name + " needs a value");
      }
    }
    if (entries_.count(name) == 0) {
      return Status(Code::kInvalidArgument, "unknown option --" + name + " (see --help)");
    }
    flags.emplace_back(name, value);
  }
  for (const auto& [n, v] : flags) {
    if (n == "config" && !v.empty()) KEEP_RETURN_IF_ERROR(load_file(v));
  }
  for (const auto& [n, v] : flags) KEEP_RETURN_IF_ERROR(set(n, v));
  return Status::ok();
}

std::string Options::help_text() const {
  std::ostringstream o;
  o << program_ << ": " << summary_
    << "\n\nOptions (a config file takes the same names as `name = value`):\n";
  for (const auto& name : order_) {
    const Entry& e = entries_.at(name);
    o << "  --" << name << "\n      " << e.help
      << "\n      default: " << (e.default_value.empty() ? "(empty)" : e.default_value) << "\n";
  }
  o << "  --help\n      print this text and exit\n";
  return o.str();
}

const std::string& Options::str(const std::string& name) const {
  auto it = entries_.find(name);
  KEEP_CHECK_MSG(it != entries_.end(), name.c_str());
  return it->second.value;
}

Result<int64_t> Options::int64(const std::string& name) const {
  const std::string& v = str(name);
  errno = 0;
  char* end = nullptr;
  long long x = std::strtoll(v.c_str(), &end, 10);
  if (v.empty() || *end != '\0' || errno != 0) {
    return Status(Code::kInvalidArgument, "--" + name + ": not an integer: '" + v + "'");
  }
  return static_cast<int64_t>(x);
}

Result<uint64_t> Options::uint64(const std::string& name) const {
  const std::string& v = str(name);
  if (v.empty() || v[0] == '-') {
    return Status(Code::kInvalidArgument,
                  "--" + name + ": not a non-negative integer: '" + v + "'");
  }
  errno = 0;
  char* end = nullptr;
  unsigned long long x = std::strtoull(v.c_str(), &end, 10);
  if (*end != '\0' || errno != 0) {
    return Status(Code::kInvalidArgument,
                  "--" + name + ": not a non-negative integer: '" + v + "'");
  }
  return static_cast<uint64_t>(x);
}

Result<double> Options::number(const std::string& name) const {
  const std::string& v = str(name);
  errno = 0;
  char* end = nullptr;
  double x = std::strtod(v.c_str(), &end);
  if (v.empty() || *end != '\0' || errno != 0) {
    return Status(Code::kInvalidArgument, "--" + name + ": not a number: '" + v + "'");
  }
  return x;
}

Result<bool> Options::boolean(const std::string& name) const {
  const std::string& v = str(name);
  if (v == "true" || v == "1" || v == "yes" || v == "on") return true;
  if (v == "false" || v == "0" || v == "no" || v == "off") return false;
  return Status(Code::kInvalidArgument, "--" + name + ": not a boolean: '" + v + "'");
}

std::vector<std::string> Options::list(const std::string& name) const {
  std::vector<std::string> out;
  std::stringstream items(str(name));
  for (std::string item; std::getline(items, item, ',');) {
    if (!item.empty()) out.push_back(item);
  }
  return out;
}

Result<uint64_t> Options::bytes(const std::string& name) const {
  const std::string& v = str(name);
  static constexpr std::pair<const char*, uint64_t> kUnits[] = {
      {"KiB", 1ull << 10}, {"MiB", 1ull << 20}, {"GiB", 1ull << 30}, {"TiB", 1ull << 40}};
  uint64_t mult = 1;
  std::string num = v;
  for (const auto& [suffix, m] : kUnits) {
    std::string s(suffix);
    if (v.size() > s.size() && v.compare(v.size() - s.size(), s.size(), s) == 0) {
      mult = m;
      num = v.substr(0, v.size() - s.size());
      break;
    }
  }
  if (num.empty() || num.find_first_not_of("0123456789") != std::string::npos) {
    return Status(Code::kInvalidArgument,
                  "--" + name + ": not a size (e.g. 4096, 64KiB, 2MiB, 1GiB): '" + v + "'");
  }
  errno = 0;
  unsigned long long x = std::strtoull(num.c_str(), nullptr, 10);
  if (errno != 0 || (mult > 1 && x > UINT64_MAX / mult)) {
    return Status(Code::kInvalidArgument, "--" + name + ": size out of range: '" + v + "'");
  }
  return static_cast<uint64_t>(x) * mult;
}

}  // namespace keep
