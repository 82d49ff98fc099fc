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
one() {
    conf=$1; prefix="$dir/$(echo "$conf" | tr ' +' '__')"
    valgrind --tool=callgrind --instr-atstart=no --callgrind-out-file="$prefix.out" \
        "$py" benchmarks/checks_b.py --steps "$steps" --cue "$conf" "$prefix" >"$prefix.log" 2>&1 &
    pid=$!
    until [ -f "$prefix.ready" ]; do sleep 0.5; kill -0 $pid 2>/dev/null || { cat "$prefix.log"; return 1; }; done
    callgrind_control -i on $pid >/dev/null 2>&1
    touch "$prefix.go"
    until [ -f "$prefix.done" ]; do sleep 0.5; done
    callgrind_control -d $pid >/dev/null 2>&1
    callgrind_control -i off $pid >/dev/null 2>&1
    touch "$prefix.stop"
    wait $pid
    total=$(grep -h -m1 -E "^(summary|totals):" "$prefix".out.* | awk '{print $2}')
    echo "$conf: $((total / steps)) instructions per step ($steps steps)"
}
for conf in "$@"; do
    one "$conf" &
    while [ "$(jobs -rp | wc -l)" -ge "$jobs" ]; do sleep 1; done
done
wait
rm -rf "$dir"
