#!/usr/bin/env bash
# A/B timing of the GPU kernel tests between a base revision and the working tree, both builds run
# in alternation in one device call (a GPU's clocks and an instance's speed move between calls by
# as much as a kernel change; within one call they hold).
#
#   scripts/gpu-ab.sh build BASE [test...]   where nvcc is (here): builds the tests (default
#                                           test_attention test_gemm test_kernels) for sm_90a at
#                                           BASE (a git worktree) and in this checkout, stripped into
#                                           .gpu-ab/base and .gpu-ab/head
#   scripts/gpu-ab.sh run [rounds]           on the GPU machine, carrying .gpu-ab: runs each test
#                                           base, head, base, head ... (default 2 rounds), logs to
#                                           $OUT (or /tmp/gpu-ab), and prints the figures of every
#                                           line timing something (in ms or us; AB_PATTERN: another
#                                           awk regex) side by side, plus each run's last line (the
#                                           check counts)
#   scripts/gpu-ab.sh bench [rounds] [args]  on the GPU machine, carrying a .gpu-bundle built with
#                                           BUNDLE_BASE=REV (scripts/gpu-bundle.sh): bench_prefill
#                                           at REV and at the bundle's build, alternated (default 2
#                                           rounds) with the same args (e.g. --shape qwen2.5-14b
#                                           --tokens 1024 --reps 15 --decode 0 --gap-ms 200
#                                           --profile), logs to $OUT, prints their timing and profile
#                                           lines
#
# Only services/worker/kernels is built (it needs nothing but CUDA), in build-ab-base and
# build-ab-head; BASE's sources are a git worktree at build-ab-src.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
out_dir="$root/.gpu-ab"
export PATH=/usr/local/cuda/bin:$PATH
export LD_LIBRARY_PATH="/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"

usage() {
  sed -n '2,25p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'
  exit 2
}

build_tests() {  # source-root build-dir dest tests...
  local src="$1" build="$2" dest="$3"
  shift 3
  local generator=()
  command -v ninja >/dev/null && generator=(-G Ninja)
  cmake -S "$src/services/worker/kernels" -B "$build" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release \
    -DCMAKE_CUDA_ARCHITECTURES=90a >/dev/null
  cmake --build "$build" --target "$@" -j "$(nproc)"
  mkdir -p "$dest"
  for t in "$@"; do
    cp "$build/tests/$t" "$dest/"
    strip "$dest/$t"
  done
}

cmd="${1:-}"
case "$cmd" in
  build)
    [ $# -ge 2 ] || usage
    base="$2"
    shift 2
    tests=("$@")
    [ ${#tests[@]} -gt 0 ] || tests=(test_attention test_gemm test_kernels)
    # BASE's sources: a worktree kept at one path, so that its build folder's cache stays valid.
    wt="$root/build-ab-src"
    rev="$("$root/scripts/worktree-at.sh" "$wt" "$base")"
    rm -rf "$out_dir"
    build_tests "$wt" "$root/build-ab-base" "$out_dir/base" "${tests[@]}"
    build_tests "$root" "$root/build-ab-head" "$out_dir/head" "${tests[@]}"
    echo "$rev" >"$out_dir/base/REVISION"
    git -C "$root" describe --always --dirty >"$out_dir/head/REVISION"
    du -sh "$out_dir"
    ;;
  run)
    rounds="${2:-2}"
    if [ ! -d "$out_dir/base" ] || [ ! -d "$out_dir/head" ]; then
      echo "gpu-ab: no $out_dir/{base,head}: run 'scripts/gpu-ab.sh build BASE' first"
      exit 2
    fi
    logs="${OUT:-/tmp/gpu-ab}"
    mkdir -p "$logs"
    echo "base $(cat "$out_dir/base/REVISION"), head $(cat "$out_dir/head/REVISION")"
    status=0
    for path in "$out_dir"/head/*; do
      [ -x "$path" ] || continue
      t="$(basename "$path")"
      for r in $(seq 1 "$rounds"); do
        for side in base head; do
          log="$logs/ab-$t-$side-$r.log"
          rc=0
          "$out_dir/$side/$t" >"$log" 2>&1 || rc=$?
          if [ "$rc" -ne 0 ]; then
            echo "gpu-ab: $side $t round $r failed (exit $rc)"
            status=1
          fi
          echo "$side $t round $r: $(tail -1 "$log")"
        done
      done
      # Lines with a time in ms or us: the text up to the last ': ' names a case (the k-th line
      # of a run with the same text is case "#k"), the rest is its figures, one column a run.
      awk -v pat="${AB_PATTERN:- (ms|us)( |,|$)}" '
        FNR == 1 { delete count; side = FILENAME ~ /-base-/ ? "base" : "head" }
        $0 ~ pat {
          key = $0; sub(/: [^:]*$/, "", key); val = $0; sub(/^.*: /, "", val)
          key = key " #" (++count[key])
          if (!(key in known)) { known[key] = 1; order[++n] = key }
          figs[side, key] = figs[side, key] " | " val
        }
        END {
          for (i = 1; i <= n; ++i) {
            k = order[i]
            printf "%s\n    base%s\n    head%s\n", k, figs["base", k], figs["head", k]
          }
        }' "$logs"/ab-"$t"-base-*.log "$logs"/ab-"$t"-head-*.log
    done
    exit "$status"
    ;;
  bench)
    rounds=2
    if [[ $# -ge 2 && "$2" =~ ^[0-9]+$ ]]; then
      rounds="$2"
      shift
    fi
    shift
    bundle="$root/.gpu-bundle"
    "$root/scripts/gpu-bundle.sh" --unpack
    if [[ ! -x "$bundle/bin/bench_prefill_base" || ! -x "$bundle/bin/bench_prefill" ]]; then
      echo "gpu-ab: no $bundle/bin/bench_prefill{,_base}: build with BUNDLE_BASE=REV scripts/gpu-bundle.sh"
      exit 2
    fi
    export LD_LIBRARY_PATH="$bundle/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    logs="${OUT:-/tmp/gpu-ab}"
    mkdir -p "$logs"
    echo "base $(cat "$bundle/BASE_REVISION" 2>/dev/null || echo '?'), head: the bundle's build"
    status=0
    for r in $(seq 1 "$rounds"); do
      for side in base head; do
        prog="$bundle/bin/bench_prefill"
        [[ "$side" == base ]] && prog="${prog}_base"
        log="$logs/ab-bench-$side-$r.log"
        rc=0
        "$prog" "$@" >"$log" 2>&1 || rc=$?
        [[ "$rc" -eq 0 ]] || { echo "gpu-ab: $side bench round $r failed (exit $rc)"; status=1; }
        echo "== $side round $r"
        grep -E '^[^ #]+ +keep|^  [a-z_]+ +[0-9.]+ ms' "$log" || true
      done
    done
    exit "$status"
    ;;
  *)
    usage
    ;;
esac
