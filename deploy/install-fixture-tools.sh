#!/usr/bin/env bash
# The Python reference tools that regenerate the committed test fixtures (not needed to build,
# test or run KEEP; CI does not run this). Installs into a virtual environment:
#   deploy/install-fixture-tools.sh [VENV]      default VENV: .venv
# then e.g.  HF_HUB_OFFLINE=1 .venv/bin/python scripts/make_encoder_fixture.py
# torch comes from PyPI (its CUDA build; ~3 GB), since that is the registry reachable here.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
venv=${1:-$root/.venv}
python3 -m venv "$venv"
"$venv/bin/pip" install --quiet --disable-pip-version-check \
  sentence-transformers transformers torch tokenizers gguf jinja2 numpy
echo "fixture tools in $venv"
