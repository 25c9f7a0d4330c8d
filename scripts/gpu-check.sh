#!/usr/bin/env bash
# One call on a GPU machine: build the CUDA kernels and their GPU test for sm_90, run the gpu-labelled
# tests, then run the GPU test under compute-sanitizer memcheck and racecheck. Exits non-zero on any
# failure. Usage (from anywhere): scripts/gpu-check.sh [build-dir]   (default: build-gpu)
#
# The whole repository is configured when its Debian dependencies are there (boost, zmq, capnp,
# doctest, ...); otherwise -- GPU machines usually lack them and cannot install from the network --
# services/worker/kernels is configured on its own: that builds the kernels, their references and
# the GPU test with nothing but CUDA.
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${1:-$root/build-gpu}"
export PATH=/usr/local/cuda/bin:$PATH
fail=0
step() { echo "=== $*"; }

step "devices"
nvidia-smi -L || { echo "gpu-check: nvidia-smi failed"; exit 1; }
nvcc --version | tail -1

generator=()
command -v ninja >/dev/null && generator=(-G Ninja)
jobs="$(nproc 2>/dev/null || echo 4)"

step "configure (whole repository, KEEP_CUDA=ON)"
targets=(keep_kernels keep_kernels_ref test_kernels)
if cmake -S "$root" -B "$build" "${generator[@]}" -DKEEP_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 \
    -DKEEP_BENCHMARKS=OFF >"$build.configure.log" 2>&1; then
  targets+=(test_kernels_ref)
  echo "configured the whole repository"
else
  echo "whole-repository configure failed (missing packages?):"
  grep -m3 -E 'Could not|not found|Error' "$build.configure.log" || tail -3 "$build.configure.log"
  step "configure (services/worker/kernels on its own)"
  rm -rf "$build"
  cmake -S "$root/services/worker/kernels" -B "$build" "${generator[@]}" \
    -DCMAKE_CUDA_ARCHITECTURES=90 || { echo "gpu-check: configure failed"; exit 1; }
fi

step "build ${targets[*]}"
cmake --build "$build" --target "${targets[@]}" -j "$jobs" || { echo "gpu-check: build failed"; exit 1; }

step "ctest -L gpu"
(cd "$build" && ctest -L gpu --output-on-failure) || fail=1
if [[ " ${targets[*]} " == *" test_kernels_ref "* ]]; then
  (cd "$build" && ctest -R '^test_kernels_ref$' --output-on-failure) || fail=1
fi

bin="$(find "$build" -type f -name test_kernels -perm -u+x | head -1)"
if [[ -z "$bin" ]]; then
  echo "gpu-check: test_kernels binary not found"
  exit 1
fi
for tool in memcheck racecheck; do
  step "compute-sanitizer --tool $tool"
  extra=()
  [[ $tool == memcheck ]] && extra=(--leak-check full)
  (cd "$root" && compute-sanitizer --tool "$tool" "${extra[@]}" --error-exitcode 3 "$bin") || fail=1
done

if ((fail)); then
  echo "gpu-check: FAILED"
  exit 1
fi
echo "gpu-check: all passed"
