#!/usr/bin/env bash
# Instructions per call of one snippet's `f` under callgrind (only its loop is counted), minus an empty
# call's: what one handler, one tensor operation or one helper costs, deterministically.
#   bash benchmarks/instructions_call.sh benchmarks/calls/nonfinite_root_call.py [more snippets]   [N=2000]
set -euo pipefail
cd "$(dirname "$0")/.."
n=${N:-2000}
py=${PYTHON:-.venv/bin/python}
dir=$(mktemp -d)
count() {
    local prefix="$dir/$(printf %s "$1" | md5sum | cut -c1-12)"
    valgrind --tool=callgrind --instr-atstart=no --callgrind-out-file="$prefix.out" \
        "$py" benchmarks/instructions_call.py "$1" "$n" "$prefix" >"$prefix.log" 2>&1 &
    local pid=$!
    until [ -f "$prefix.ready" ]; do sleep 0.3; kill -0 $pid 2>/dev/null || { cat "$prefix.log" >&2; exit 1; }; done
    callgrind_control -i on $pid >/dev/null 2>&1
    touch "$prefix.go"
    until [ -f "$prefix.done" ]; do sleep 0.3; done
    callgrind_control -d $pid >/dev/null 2>&1
    callgrind_control -i off $pid >/dev/null 2>&1
    touch "$prefix.stop"
    wait $pid
    local total
    total=$(grep -h -m1 -E "^(summary|totals):" "$prefix".out.* | awk '{print $2}')
    echo $((total / n))
}
empty=$(count benchmarks/calls/empty.py)
for snippet in "$@"; do
    echo "$snippet: $(( $(count "$snippet") - empty )) instructions per call (an empty call's $empty subtracted)"
done
rm -rf "$dir"
