#!/usr/bin/env bash
# Instructions per step of benchmarks/checks_b.py's step under callgrind, per configuration (deterministic,
# unlike time on this shared machine); configurations run in parallel, JOBS at a time.
#   bash benchmarks/checks_b_instructions.sh base "base + dropout-in-eval" default   [STEPS=20 JOBS=3]
set -uo pipefail
cd "$(dirname "$0")/.."
steps=${STEPS:-20}
jobs=${JOBS:-3}
py=${PYTHON:-.venv/bin/python}
dir=$(mktemp -d)
source benchmarks/callgrind.sh
one() {
    local conf=$1 prefix="$dir/$(echo "$1" | tr ' +' '__')" total
    total=$(callgrind_total "$prefix" "$py" benchmarks/checks_b.py --steps "$steps" --cue "$conf" "$prefix") || return 1
    echo "$conf: $((total / steps)) instructions per step ($steps steps)"
}
for conf in "$@"; do
    one "$conf" &
    while [ "$(jobs -rp | wc -l)" -ge "$jobs" ]; do sleep 1; done
done
wait
rm -rf "$dir"
