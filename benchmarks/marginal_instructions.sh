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
source benchmarks/callgrind.sh
for conf in "${confs[@]}"; do
    prefix="$dir/$conf"
    total=$(callgrind_total "$prefix" "$py" benchmarks/marginal_cost.py --steps "$steps" --cue "$conf" "$prefix")
    echo "$conf: $((total / steps)) instructions per step ($steps steps)"
done
rm -rf "$dir"
