// TempDir: a fresh directory under the system temp dir (mkdtemp), removed with everything in it
// when the test is done. Shared by the tests so each does not carry its own copy.
#pragma once

#include <stdlib.h>

#include <filesystem>
#include <string>
#include <string_view>

#include "shared/common/status.h"

namespace keep::test {

struct TempDir {
  std::string path;

  // `tag` names the directory: <tmp>/keep-test-<tag>-XXXXXX.
  explicit TempDir(std::string_view tag) {
    std::string tmpl =
        (std::filesystem::temp_directory_path() / ("keep-test-" + std::string(tag) + "-XXXXXX"))
            .string();
    KEEP_CHECK(::mkdtemp(tmpl.data()) != nullptr);
    path = tmpl;
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;

  std::string sub(std::string_view name) const { return path + "/" + std::string(name); }
};

}  // namespace keep::test
