# Sourced by the instruction-count scripts: run one Python command under callgrind and count only the
# instructions between its cues. The command writes PREFIX.ready when set up, waits for PREFIX.go,
# runs what is measured, writes PREFIX.done and waits for PREFIX.stop (see instructions_step.py).
#   total=$(callgrind_total "$prefix" .venv/bin/python benchmarks/instructions_step.py ... "$prefix")
callgrind_total() {
    local prefix=$1; shift
    valgrind --tool=callgrind --instr-atstart=no --callgrind-out-file="$prefix.out" "$@" >"$prefix.log" 2>&1 &
    local pid=$!
    until [ -f "$prefix.ready" ]; do sleep 0.3; kill -0 $pid 2>/dev/null || { cat "$prefix.log" >&2; return 1; }; done
    callgrind_control -i on $pid >/dev/null 2>&1
    touch "$prefix.go"
    until [ -f "$prefix.done" ]; do sleep 0.3; kill -0 $pid 2>/dev/null || { cat "$prefix.log" >&2; return 1; }; done
    callgrind_control -d $pid >/dev/null 2>&1
    callgrind_control -i off $pid >/dev/null 2>&1
    touch "$prefix.stop"
    wait $pid
    grep -h -m1 -E "^(summary|totals):" "$prefix".out.* | awk '{print $2}'
}
