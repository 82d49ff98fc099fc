#!/usr/bin/env bash
# Instructions per call of one snippet's `f` under callgrind (only its loop is counted), minus an empty
# call's: what one handler, one tensor operation or one helper costs, deterministically.
#   bash benchmarks/instructions_call.sh benchmarks/calls/nonfinite_root_call.py [more snippets]   [N=2000]
set -euo pipefail
cd "$(dirname "$0")/.."
n=${N:-2000}
py=${PYTHON:-.venv/bin/python}
dir=$(mktemp -d)
source benchmarks/callgrind.sh
count() {
    local prefix="$dir/$(printf %s "$1" | md5sum | cut -c1-12)"
    echo $(( $(callgrind_total "$prefix" "$py" benchmarks/instructions_call.py "$1" "$n" "$prefix") / n ))
}
empty=$(count benchmarks/calls/empty.py)
for snippet in "$@"; do
    echo "$snippet: $(( $(count "$snippet") - empty )) instructions per call (an empty call's $empty subtracted)"
done
rm -rf "$dir"
