#!/usr/bin/env bash
# A git worktree of this repository at PATH, detached at revision REV: added the first time, moved
# to REV after, so that it stays at one path (ignored, like the build folders) and a build folder
# of it stays valid and rebuilds incrementally. Prints REV's commit. Used by gpu-ab.sh (the base
# of the kernel tests) and gpu-bundle.sh (BUNDLE_BASE).
#   scripts/worktree-at.sh PATH REV
set -euo pipefail
[[ $# -eq 2 ]] || { echo "usage: scripts/worktree-at.sh PATH REV" >&2; exit 2; }
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
wt="$1"
rev="$(git -C "$root" rev-parse --verify "$2^{commit}")"
if [[ -e "$wt/.git" ]]; then
  git -C "$wt" checkout -q --detach "$rev"
else
  git -C "$root" worktree add --detach "$wt" "$rev" >/dev/null
fi
echo "$rev"
