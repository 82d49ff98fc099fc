#!/usr/bin/env bash
# Instructions per training step under valgrind's callgrind: unlike wall-clock time, the count is the
# same on every run, whatever else the machine is doing (this project's CPU machine is shared and its
# step times drift by 10-20%). Only the measured steps are counted (import and setup run uninstrumented).
#   bash benchmarks/instructions.sh deep-mlp unguarded default every10 all   [STEPS=20]
#   bash benchmarks/instructions.sh lightning unguarded default             (also hf-trainer: a whole fit's steps)
set -euo pipefail
cd "$(dirname "$0")/.."
model=$1; shift
steps=${STEPS:-20}
py=${PYTHON:-.venv/bin/python}
dir=$(mktemp -d)
for conf in "$@"; do
    prefix="$dir/$(printf %s "$conf" | md5sum | cut -c1-12)"  # a checks=... list can be long
    valgrind --tool=callgrind --instr-atstart=no --callgrind-out-file="$prefix.out" \
        "$py" benchmarks/instructions_step.py "$model" "$conf" "$steps" "$prefix" >"$prefix.log" 2>&1 &
    pid=$!
    until [ -f "$prefix.ready" ]; do sleep 0.5; kill -0 $pid 2>/dev/null || { cat "$prefix.log"; exit 1; }; done
    callgrind_control -i on $pid >/dev/null 2>&1
    touch "$prefix.go"
    until [ -f "$prefix.done" ]; do sleep 0.5; done
    callgrind_control -d $pid >/dev/null 2>&1
    callgrind_control -i off $pid >/dev/null 2>&1
    touch "$prefix.stop"
    wait $pid
    total=$(grep -h -m1 -E "^(summary|totals):" "$prefix".out.* | awk '{print $2}')
    echo "$model $conf: $((total / steps)) instructions per step ($steps steps)"
done
rm -rf "$dir"
