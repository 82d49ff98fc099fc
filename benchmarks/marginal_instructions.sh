#!/usr/bin/env bash
# Instructions per step (callgrind) of the small model of marginal_cost.py: unguarded, the default guard, and the
# default guard without each check named (what that check adds). Deterministic on a shared machine.
#   bash benchmarks/marginal_instructions.sh [check ...]      [STEPS=20]
set -euo pipefail
cd "$(dirname "$0")/.."
steps=${STEPS:-20}
py=${PYTHON:-.venv/bin/python}
checks=("$@")
[ ${#checks[@]} -eq 0 ] && checks=(module-not-registered train-in-eval-mode loss-shape-broadcast zero-grad-before-step loss-disconnected init-loss-high)
confs=(unguarded default)
for c in "${checks[@]}"; do confs+=("minus-$c"); done
dir=$(mktemp -d)
for conf in "${confs[@]}"; do
    prefix="$dir/$conf"
    valgrind --tool=callgrind --instr-atstart=no --callgrind-out-file="$prefix.out" \
        "$py" benchmarks/marginal_cost.py --steps "$steps" --cue "$conf" "$prefix" >"$prefix.log" 2>&1 &
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
    echo "$conf: $((total / steps)) instructions per step ($steps steps)"
done
rm -rf "$dir"
