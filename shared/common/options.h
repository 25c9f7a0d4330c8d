// Options: one table of named settings per binary, read from a config file and then from flags.
//
//   keep::Options opts("keep-manager", "the KEEP memory daemon");
//   opts.add("endpoint", "tcp://127.0.0.1:5555", "ZeroMQ ROUTER endpoint for agents and workers");
//   Status st = opts.parse(argc, argv);   // --config FILE, --name=value, --name value, --help
//
// The config file holds `name = value` lines; '#' starts a comment. Flags override the file. Every
// option has a default, and --help prints all of them. Unknown names are errors, not ignored.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "shared/common/status.h"

namespace keep {

class Options {
 public:
  Options(std::string program, std::string summary);

  // Declares an option; `name` without leading dashes, [a-z0-9-_]+.
  void add(const std::string& name, const std::string& default_value, const std::string& help);

  // Parses argv. Returns kOk; or kInvalidArgument with one line of text for a bad flag/file.
  // When --help is given, help_requested() is true and nothing else is validated.
  Status parse(int argc, char** argv);
  // Parses `name = value` lines from a file into the current values.
  Status load_file(const std::string& path);
  Status set(const std::string& name, const std::string& value);

  bool help_requested() const { return help_; }
  std::string help_text() const;
  // Positional arguments left after the options (for CLIs with subcommands).
  const std::vector<std::string>& positional() const { return positional_; }

  const std::string& str(const std::string& name) const;
  // Typed getters: errors name the option and the bad value.
  Result<int64_t> int64(const std::string& name) const;
  Result<uint64_t> uint64(const std::string& name) const;
  Result<double> number(const std::string& name) const;
  Result<bool> boolean(const std::string& name) const;  // true/false/1/0/yes/no/on/off
  // "a,b,,c" -> {"a", "b", "c"} (empty items dropped).
  std::vector<std::string> list(const std::string& name) const;
  // "64KiB", "2MiB", "1GiB", "4096" -> bytes.
  Result<uint64_t> bytes(const std::string& name) const;

 private:
  struct Entry {
    std::string value;
    std::string default_value;
    std::string help;
  };
  std::string program_;
  std::string summary_;
  std::vector<std::string> order_;
  std::map<std::string, Entry> entries_;
  std::vector<std::string> positional_;
  bool help_ = false;
};

}  // namespace keep
