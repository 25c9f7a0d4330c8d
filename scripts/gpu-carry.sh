#!/usr/bin/env bash
# Files larger than one device call may carry (64 MiB) go to the GPU machine in parts: this splits
# them into .gpu-carry-1/, .gpu-carry-2/, ... (48 MiB each, ignored by git) and prints the calls.
# Carry one folder per call, the calls within 30 s of each other (the machine stays warm), each
# copying its parts to /tmp/carry on the GPU machine; the last call runs the join.sh it carries
# (the files back under their paths) before its own command. Ignored paths carried by an earlier
# call stay there (carry .gpu-bundle in the first call, not again), so the folders may fill a call.
#   scripts/gpu-carry.sh models/SmolLM2-135M-Instruct.Q4_1.gguf $(find models/all-MiniLM-L6-v2 -type f)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
(($#)) || { echo "usage: scripts/gpu-carry.sh FILE..." >&2; exit 2; }
rm -rf .gpu-carry-*
tmp="$(mktemp -d)"
manifest=()
for f in "$@"; do
  [[ -f "$f" ]] || { echo "gpu-carry: no file $f" >&2; exit 1; }
  key="$(echo "$f" | tr '/' '%')"
  split -b 48m -d -a 3 "$f" "$tmp/$key."
  manifest+=("$f")
done
# Parts packed into folders of at most 60 MiB, in order (small files share a folder).
n=1
used=0
limit=$((60 << 20))
mkdir -p ".gpu-carry-$n"
for part in "$tmp"/*; do
  size=$(stat -c %s "$part")
  if ((used > 0 && used + size > limit)); then
    n=$((n + 1))
    used=0
    mkdir -p ".gpu-carry-$n"
  fi
  mv "$part" ".gpu-carry-$n/"
  used=$((used + size))
done
rm -rf "$tmp"
# The last folder carries the script that joins the parts back under their paths.
{
  echo "#!/usr/bin/env bash"
  echo "# Written by scripts/gpu-carry.sh: joins the parts in /tmp/carry back into the files."
  echo "set -euo pipefail"
  for f in "${manifest[@]}"; do
    key="$(echo "$f" | tr '/' '%')"
    printf 'mkdir -p %q && cat /tmp/carry/%q.* > %q\n' "$(dirname "$f")" "$key" "$f"
  done
} >".gpu-carry-$n/join.sh"
echo "gpu-carry: $# files in $n folders"
for ((i = 1; i <= n; i++)); do
  cmd="mkdir -p /tmp/carry && cp .gpu-carry-$i/*.[0-9][0-9][0-9] /tmp/carry/"
  ((i == n)) && cmd+=" && bash .gpu-carry-$i/join.sh && <your command>"
  echo "  call $i: carry [\".gpu-carry-$i\"]: $cmd"
done
