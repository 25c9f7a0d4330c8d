#!/usr/bin/env bash
# Files larger than one device call may carry (64 MiB) go to the GPU machine in parts: this packs
# them into one tar stream cut into parts of PART_MIB (56) MiB: with the working tree a call carries under 64 MiB, one per folder .gpu-carry-1/, .gpu-carry-2/, ...
# (ignored by git), and prints the calls. Carry one folder per call, the calls within 30 s of each
# other (the machine stays warm), each copying its part to /tmp/carry on the GPU machine; the last
# call runs the join.sh it carries (the files back under their paths) before its own command.
# Ignored paths carried by an earlier call stay there (carry .gpu-bundle in the first call, not
# again).
#   scripts/gpu-carry.sh models/SmolLM2-135M-Instruct.Q4_1.gguf $(find models/all-MiniLM-L6-v2 -type f)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
(($#)) || { echo "usage: scripts/gpu-carry.sh FILE..." >&2; exit 2; }
for f in "$@"; do
  [[ -f "$f" ]] || { echo "gpu-carry: no file $f" >&2; exit 1; }
done
rm -rf .gpu-carry-*
tmp="$(mktemp -d)"
# One stream, so that small files fill the room the large ones leave (fewer calls).
tar cf - -- "$@" | split -b "${PART_MIB:-56}m" -d -a 3 - "$tmp/carry.tar."
n=0
for part in "$tmp"/carry.tar.*; do
  n=$((n + 1))
  mkdir -p ".gpu-carry-$n"
  mv "$part" ".gpu-carry-$n/"
done
rm -rf "$tmp"
# The last folder carries the script that joins the parts back under their paths.
cat >".gpu-carry-$n/join.sh" <<'JOIN'
#!/usr/bin/env bash
# Written by scripts/gpu-carry.sh: the parts in /tmp/carry back into the files, under their paths.
set -euo pipefail
cat /tmp/carry/carry.tar.* | tar xf -
JOIN
echo "gpu-carry: $# files in $n folders"
for ((i = 1; i <= n; i++)); do
  cmd="mkdir -p /tmp/carry && cp .gpu-carry-$i/carry.tar.* /tmp/carry/"
  ((i == n)) && cmd+=" && bash .gpu-carry-$i/join.sh && <your command>"
  echo "  call $i: carry [\".gpu-carry-$i\"]: $cmd"
done
