# Shared by benchmarks/carry/*-wheels.sh (source it): download cp312 manylinux wheels of the
# requirements the GPU machine lacks, and pack them into folders that each fit one device call.
#
#   carry_wheels NAME HAVE_FILE REQ...
#
# HAVE_FILE lists the machine's packages ("pip list" or "pip freeze" output; "" = none known): a
# requirement that a listed version satisfies is skipped. The wheels are packed, largest first,
# into .whl-NAME-1, .whl-NAME-2, ... (each under CARRY_BUDGET_MIB, default 64 MiB less the
# working tree and 2 MiB of margin), all ignored through git's info/exclude; a single wheel larger
# than the budget is cut into .partNN pieces, one folder each, joined with `cat` on the machine
# and checked against the .sha256 file written beside its first piece.
set -euo pipefail

_norm() { tr 'A-Z_.' 'a-z--' <<<"$1"; }

carry_wheels() {
  local name=$1 have=$2; shift 2
  local root; root=$(git rev-parse --show-toplevel)
  cd "$root"
  local exclude; exclude=$(git rev-parse --git-path info/exclude)
  mkdir -p "$(dirname "$exclude")"
  local tree; tree=$(git ls-files -z | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1)
  local budget=$(( ${CARRY_BUDGET_MIB:-$(( 62 - tree / 1048576 ))} * 1048576 ))
  local stage=".whl-$name-all"
  rm -rf "$stage" .whl-"$name"-[0-9]*
  mkdir -p "$stage"
  grep -qxF "/.whl-$name-*/" "$exclude" 2>/dev/null || echo "/.whl-$name-*/" >> "$exclude"
  grep -qxF "/.site-$name/" "$exclude" 2>/dev/null || echo "/.site-$name/" >> "$exclude"

  # requirements the machine does not already satisfy
  local need=()
  mapfile -t need < <(python3 - "$have" "$@" <<'EOF'
import re, sys
from pip._vendor.packaging.requirements import Requirement
from pip._vendor.packaging.utils import canonicalize_name
have = {}
if sys.argv[1]:
    for line in open(sys.argv[1]):
        parts = re.split(r"\s+|==", line.strip())
        if len(parts) >= 2 and re.match(r"^\d", parts[1]):
            have[canonicalize_name(parts[0])] = parts[1]
for spec in sys.argv[2:]:
    req = Requirement(spec)
    v = have.get(canonicalize_name(req.name))
    if v is not None and req.specifier.contains(v, prereleases=True):
        print(f"have {req.name} {v}", file=sys.stderr)
        continue
    print(spec)
EOF
)
  if [ ${#need[@]} -eq 0 ]; then echo "nothing to carry: the machine has every requirement"; return 0; fi
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --abi cp312 --abi abi3 --abi none --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform any -d "$stage" "${need[@]}"

  # pack: largest first into the first folder with room; a wheel over the budget is split
  local n=0 f size i
  declare -A used=()
  while read -r size f; do
    if (( size > budget )); then
      split -b "$budget" -d -a 2 "$f" "$f.part"
      local first=$((n + 1))
      for p in "$f".part*; do
        n=$((n + 1)); mkdir -p ".whl-$name-$n"; mv "$p" ".whl-$name-$n/"; used[$n]=$(stat -c %s ".whl-$name-$n/$(basename "$p")")
      done
      # the joined wheel's digest, checked on the machine (`sha256sum -c` where it is joined)
      (cd "$(dirname "$f")" && sha256sum "$(basename "$f")") > ".whl-$name-$first/$(basename "$f").sha256"
      rm "$f"
      continue
    fi
    for ((i = 1; i <= n + 1; i++)); do
      if (( ${used[$i]:-0} + size <= budget )); then
        mkdir -p ".whl-$name-$i"; mv "$f" ".whl-$name-$i/"; used[$i]=$(( ${used[$i]:-0} + size ))
        (( i > n )) && n=$i
        break
      fi
    done
  done < <(find "$stage" -name '*.whl' -printf '%s %p\n' | sort -rn)
  rmdir "$stage"
  echo "working tree $((tree / 1048576)) MiB; budget per call $((budget / 1048576)) MiB"
  for ((i = 1; i <= n; i++)); do
    echo "call $i: carry .whl-$name-$i ($(du -sb ".whl-$name-$i" | cut -f1) bytes):"
    ls -la ".whl-$name-$i" | tail -n +4 | awk '{print "   ", $5, $9}'
  done
}
