#!/usr/bin/env bash
# Installs every Debian and PyPI package that KEEP's build, tests and demo need. Idempotent: a
# package already present is left alone. Run as root (or with sudo available) on Debian 12.
set -euo pipefail

APT_PACKAGES=(
  build-essential cmake ninja-build pkg-config git ca-certificates unzip python3 python3-pip
  python3-venv                 # the Python client's virtual environment (below)
  libboost-dev                 # Boost.Interprocess (header-only)
  libzmq3-dev cppzmq-dev       # ZeroMQ + cppzmq
  capnproto libcapnp-dev       # Cap'n Proto compiler and runtime
  doctest-dev                  # tests
  libopenblas-dev              # CPU matrix products (encoder, CPU engine)
  libutf8proc-dev              # Unicode categories and NFC for the tokenizers
  nlohmann-json3-dev           # JSON (configs, safetensors headers, --json output)
  libmicrohttpd-dev            # HTTP for /metrics
  prometheus                   # the real Prometheus server + promtool, for the metrics tests
  etcd-server                  # cluster mode: placement (shard owners, leases, epochs); tests
  libcurl4-openssl-dev         # HTTP client: etcd's v3 JSON gateway
  postgresql libpq-dev         # cluster mode: the memory log (system of record); tests
  libhiredis-dev               # cluster mode: the shared KV tier's Redis Cluster client
  redis-server redis-tools     # cluster mode: Redis Cluster for the shared KV tier's tests
  clang-format
  curl                         # scripts talk to /metrics
  docker-compose               # validates docker-compose.yml in the tests (no engine needed)
)

SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi

missing=()
for p in "${APT_PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "install-deps: installing ${missing[*]}"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
else
  echo "install-deps: Debian packages present"
fi

# The Python client (clients/python) with its PyPI dependencies (pyzmq, pycapnp), editable, in a
# virtual environment in the checkout: Debian's own Python is externally managed (PEP 668).
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${KEEP_VENV:-$root/.venv}"
if ! "$venv/bin/python" -c "import keep_client, zmq, capnp" 2>/dev/null; then
  echo "install-deps: the Python client into $venv"
  [ -x "$venv/bin/python" ] || python3 -m venv "$venv"
  "$venv/bin/pip" install -q --disable-pip-version-check -e "$root/clients/python"
else
  echo "install-deps: the Python client present in $venv"
fi

# The Prometheus package starts a system service on install where systemd runs; our tests start
# their own server on a free port, so that service is not needed.

# CUDA is optional: on a machine with /usr/local/cuda the build enables the CUDA backend.
if [ -x /usr/local/cuda/bin/nvcc ] && ! command -v nvcc >/dev/null; then
  echo "install-deps: note: add /usr/local/cuda/bin to PATH to build the CUDA backend"
fi
