#!/usr/bin/env bash
# Builds the libFuzzer targets with clang in build-fuzz/ and runs every fuzz_* binary for N seconds
# each (default 60). Not part of CI. Exit status is non-zero when any fuzzer found a failure; the
# crashing inputs are kept under build-fuzz/fuzz-artifacts/.
#
#   scripts/run-fuzzers.sh [SECONDS]
#
# Every library is compiled with -fsanitize=fuzzer-no-link (coverage feedback) and ASan + UBSan, so
# a parser linked as a library is checked like the fuzz target's own code; the fuzz binaries add
# -fsanitize=fuzzer (tests/fuzz/CMakeLists.txt).
# Environment: KEEP_FUZZ_BUILD_DIR (default <repo>/build-fuzz), KEEP_FUZZ_JOBS (build -j, default 2),
# KEEP_FUZZ_SOURCE_DIR (the CMake source dir to configure, default the repository root).
# Seeds come from tests/fuzz/corpus/<target>/ when it exists; the growing corpus is kept in
# build-fuzz/fuzz-corpus/<target>/ between runs.
set -euo pipefail

seconds="${1:-60}"
if ! [[ "$seconds" =~ ^[0-9]+$ ]] || [[ "$seconds" -eq 0 ]]; then
  echo "usage: $0 [SECONDS>0]" >&2
  exit 2
fi
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${KEEP_FUZZ_BUILD_DIR:-$root/build-fuzz}"
source_dir="${KEEP_FUZZ_SOURCE_DIR:-$root}"
jobs="${KEEP_FUZZ_JOBS:-2}"

command -v clang++ >/dev/null || { echo "run-fuzzers: clang++ not found" >&2; exit 2; }
generator=()
command -v ninja >/dev/null && generator=(-G Ninja)

san="-fsanitize=fuzzer-no-link,address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer"
cmake -S "$source_dir" -B "$build" "${generator[@]}" \
  -DCMAKE_C_COMPILER=clang -DCMAKE_CXX_COMPILER=clang++ -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DKEEP_FUZZ=ON -DKEEP_CUDA=OFF -DKEEP_TESTS=ON -DKEEP_BENCHMARKS=OFF \
  "-DCMAKE_C_FLAGS=$san" "-DCMAKE_CXX_FLAGS=$san" "-DCMAKE_EXE_LINKER_FLAGS=-fsanitize=address,undefined" \
  >/dev/null

# Every fuzz_* target the build knows about.
mapfile -t targets < <(cmake --build "$build" --target help | grep -oE '(^|[[:space:]])fuzz_[A-Za-z0-9_]+' \
                         | tr -d ' \t' | sort -u)
if [[ ${#targets[@]} -eq 0 ]]; then
  echo "run-fuzzers: no fuzz_* targets configured" >&2
  exit 1
fi
cmake --build "$build" -j "$jobs" --target "${targets[@]}"

mkdir -p "$build/fuzz-artifacts" "$build/fuzz-corpus"
failed=()
ran=0
for bin in "$build"/fuzz/fuzz_*; do
  [[ -f "$bin" && -x "$bin" ]] || continue
  name="$(basename "$bin")"
  corpus="$build/fuzz-corpus/$name"
  mkdir -p "$corpus"
  seeds=()
  [[ -d "$root/tests/fuzz/corpus/$name" ]] && seeds=("$root/tests/fuzz/corpus/$name")
  echo "=== $name: ${seconds}s"
  ran=$((ran + 1))
  if ! "$bin" -max_total_time="$seconds" -rss_limit_mb=2048 -timeout=10 -print_final_stats=1 \
        -artifact_prefix="$build/fuzz-artifacts/$name-" "$corpus" "${seeds[@]}"; then
    failed+=("$name")
  fi
done

echo "=== ran $ran fuzzer(s), ${#failed[@]} failed${failed:+: ${failed[*]}}"
[[ ${#failed[@]} -eq 0 ]]
