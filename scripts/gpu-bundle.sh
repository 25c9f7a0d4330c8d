#!/usr/bin/env bash
# Builds, on this machine, the GPU programs that need the whole repository's Debian packages
# (test_cuda_engine, test_cuda_assembler, test_device_kv_tier + device_tier_probe, bench_prefill,
# bench_keep: the engine, its GGUF/HF loaders, nlohmann-json, utf8proc, Boost.Interprocess; and the
# kernels' GPU tests) and
# packs them with the shared libraries a bare CUDA machine lacks into .gpu-bundle/, which
# scripts/gpu-check.sh runs when it finds it. For GPU machines that cannot install our packages
# (no network): carry .gpu-bundle with the call. Usage: scripts/gpu-bundle.sh [build-dir]; on the
# GPU machine, scripts/gpu-bundle.sh --unpack (gpu-check.sh runs it) ungzips the programs.
# BUNDLE_SERVICES=1 also packs keep-manager, keep-worker and keepctl, and pyzmq/pycapnp wheels
# for CPython 3.12, the GPU machines' (BUNDLE_PY="3.10 3.11 3.12" for more: each adds ~7 MB, and a
# call carries at most 64 MiB -- with all three the bundle was 67 MB) in .gpu-bundle/wheels (the
# GPU machine has no network): there, --unpack makes .venv from them with the Python client on its
# path, for the quality benchmarks (benchmarks/quality/run.py) and the two-worker device tier test
# (tests/gpu/tier_e2e.py).
# BUNDLE_BASE=REV also builds bench_prefill and bench_keep at revision REV (a git worktree at
# build-bundle-src, built in build-gpu-bundle-base) as bin/bench_prefill_base and
# bin/bench_keep_base (same build type), for `scripts/gpu-ab.sh bench` and same-call A/B runs of
# bench_keep.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
out="$root/.gpu-bundle"
if [[ "${1:-}" == "--unpack" ]]; then  # on the GPU machine: the programs back to runnable files
  for gz in "$out"/bin/*.gz "$out"/lib/*.gz; do
    [[ -e "$gz" ]] || continue
    gzip -dc "$gz" >"${gz%.gz}"
    [[ "$gz" == */bin/* ]] && chmod +x "${gz%.gz}"
    rm -f "$gz"
  done
  # With the services' wheels: the Python client in .venv (offline; a .pth file stands in for the
  # editable install, whose setuptools a bare venv may lack; --no-deps: pycapnp wants jinja2 only
  # to compile schemas).
  if [[ -d "$out/wheels" && ! -x "$root/.venv/bin/python" ]]; then
    python3 -m venv --system-site-packages "$root/.venv" &&  # a system matplotlib, for the plots
      "$root/.venv/bin/pip" install -q --no-index --no-deps -f "$out/wheels" pyzmq pycapnp &&
      "$root/.venv/bin/python" -c 'import site, sys; open(site.getsitepackages()[0] + "/keep_client.pth", "w").write(sys.argv[1] + "\n")' \
        "$root/clients/python" ||
      echo "gpu-bundle: no Python client (.venv): $(python3 --version 2>&1)"
  fi
  exit 0
fi
build="${1:-$root/build-gpu-bundle}"
export PATH=/usr/local/cuda/bin:$PATH
generator=()
command -v ninja >/dev/null && generator=(-G Ninja)
# BUNDLE_BUILD_TYPE: RelWithDebInfo packs an existing development build (build/) without
# rebuilding it for Release (the device code is compiled the same; only host code differs).
cmake -S "$root" -B "$build" "${generator[@]}" -DCMAKE_BUILD_TYPE="${BUNDLE_BUILD_TYPE:-Release}" \
  -DKEEP_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90a -DKEEP_BENCHMARKS=ON -DKEEP_TESTS=ON >/dev/null
services=()
[[ "${BUNDLE_SERVICES:-0}" == 1 ]] && services=(keep-manager keep-worker keepctl)
# The kernels' GPU tests too, so that a call can run them without building on the GPU machine.
kernel_tests=(test_kernels test_attention test_attention_decode test_logits test_gemm)
cmake --build "$build" --target test_cuda_engine test_cuda_assembler test_device_kv_tier \
  device_tier_probe bench_prefill bench_keep "${kernel_tests[@]}" "${services[@]}" -j "$(nproc)"
rm -rf "$out"
mkdir -p "$out/bin" "$out/lib"
for t in test_cuda_engine test_cuda_assembler test_device_kv_tier device_tier_probe \
  "${kernel_tests[@]}"; do
  cp "$(find "$build" -type f -name "$t" -perm -u+x | head -1)" "$out/bin/"
done
cp "$build/bin/bench_prefill" "$build/bin/bench_keep" "$out/bin/"
for t in "${services[@]}"; do cp "$build/bin/$t" "$out/bin/"; done
if ((${#services[@]})); then
  for py in ${BUNDLE_PY:-3.12}; do
    pip download -q --only-binary=:all: --no-deps --python-version "$py" \
      --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 \
      -d "$out/wheels" pyzmq pycapnp
  done
fi
if [[ -n "${BUNDLE_BASE:-}" ]]; then
  wt="$root/build-bundle-src"
  rev="$("$root/scripts/worktree-at.sh" "$wt" "$BUNDLE_BASE")"
  # The worktree has no models/ (ignored): the base build needs none.
  cmake -S "$wt" -B "$root/build-gpu-bundle-base" "${generator[@]}" \
    -DCMAKE_BUILD_TYPE="${BUNDLE_BUILD_TYPE:-Release}" \
    -DKEEP_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90a -DKEEP_BENCHMARKS=ON -DKEEP_TESTS=OFF >/dev/null
  cmake --build "$root/build-gpu-bundle-base" --target bench_prefill bench_keep -j "$(nproc)"
  cp "$root/build-gpu-bundle-base/bin/bench_prefill" "$out/bin/bench_prefill_base"
  cp "$root/build-gpu-bundle-base/bin/bench_keep" "$out/bin/bench_keep_base"
  echo "$rev" >"$out/BASE_REVISION"
fi
strip "$out"/bin/*  # the carry to a GPU machine is size-limited
# Shared libraries outside glibc, libstdc++ and CUDA (which the GPU machine has; libcuda* covers
# libcudart).
for b in "$out"/bin/*; do
  ldd "$b" | awk '/=> \//{print $3}' | while read -r lib; do
    case "$(basename "$lib")" in
      libc.so* | libm.so* | libstdc++* | libgcc_s* | ld-linux* | libcuda* | libcublas* | \
        libdl.so* | libpthread* | librt.so*) ;;
      *) cp -uL "$lib" "$out/lib/" ;;
    esac
  done
done
# The programs travel gzip-compressed (13 MB -> 5 MB: the carry to a GPU machine is size-limited);
# scripts/gpu-check.sh, or scripts/gpu-bundle.sh --unpack on the GPU machine, restores them.
gzip -9 "$out"/bin/*
# The libraries too: OpenBLAS alone is 36 MB (keep-manager and keep-worker need it).
find "$out/lib" -type f -size +1M -exec gzip -9 {} +
du -sh "$out"
ls "$out/bin" "$out/lib"
