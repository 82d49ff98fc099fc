#!/usr/bin/env bash
# guard on a GPU, in one command (under 4 minutes on one GPU): the CUDA tests, then the overhead
# table (CNN, transformer, tiny MLP: unguarded, guard default, detect_anomaly) and the host syncs
# per step caused by guard, and the new checks' syncs and findings on the GPU (sync_check_a.py). Without a GPU it says so in one line and exits 0.
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}"
if ! "$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    echo "gpu.sh: no CUDA device here (torch.cuda.is_available() is False); nothing to run."
    exit 0
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
status=0
"$PY" -m pytest -q -p no:cacheprovider tests/test_cuda.py || status=$?
"$PY" benchmarks/gpu.py || status=$?
"$PY" benchmarks/sync_check_a.py || status=$?
exit $status
