#!/usr/bin/env bash
# The test command of the README: installs what is missing, fetches the models, builds and runs
# every CPU test (unit + integration). GPU tests are run on a GPU machine by scripts/gpu-check.sh.
#   scripts/test.sh [ctest args...]      e.g. scripts/test.sh -L unit
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
bash deploy/install-deps.sh
bash deploy/fetch-models.sh
build=${KEEP_BUILD_DIR:-build}
jobs=${KEEP_JOBS:-$(nproc)}
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DKEEP_WERROR=ON ${KEEP_CMAKE_ARGS:-}
cmake --build "$build" -j "$jobs"
cd "$build"
ctest --output-on-failure -j "$jobs" -LE gpu "$@"
