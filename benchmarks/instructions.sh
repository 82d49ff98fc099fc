#!/usr/bin/env bash
# Instructions per training step under valgrind's callgrind: unlike wall-clock time, the count is the
# same on every run, whatever else the machine is doing (this project's CPU machine is shared and its
# step times drift by 10-20%). Only the measured steps are counted (import and setup run uninstrumented).
#   bash benchmarks/instructions.sh deep-mlp unguarded default every10 all   [STEPS=20]
#   bash benchmarks/instructions.sh lightning unguarded default             (also hf-trainer: a whole fit's steps)
#   WARM=2100 STEPS=200 bash benchmarks/instructions.sh tiny-mlp unguarded default   (the steady state: the count
#   starts after WARM steps, 4 by default, so that a run's first steps and their looks are left out)
#   bash benchmarks/instructions.sh tiny-mlp default checks=default,-loss-graph    (a check's marginal cost)
set -euo pipefail
cd "$(dirname "$0")/.."
model=$1; shift
steps=${STEPS:-20}
py=${PYTHON:-.venv/bin/python}
dir=$(mktemp -d)
source benchmarks/callgrind.sh
for conf in "$@"; do
    prefix="$dir/$(printf %s "$conf" | md5sum | cut -c1-12)"  # a checks=... list can be long
    total=$(callgrind_total "$prefix" "$py" benchmarks/instructions_step.py "$model" "$conf" "$steps" "$prefix")
    echo "$model $conf: $((total / steps)) instructions per step ($steps steps)"
done
rm -rf "$dir"
