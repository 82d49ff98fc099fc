"""Instructions of one call, in isolation: the harness behind `benchmarks/instructions_call.sh`.

A snippet file defines ``setup()``, which builds what the call needs (a guarded model stepped a few
times, say) and returns ``f``, the call to count; ``f`` is run N times between the markers that
`instructions_call.sh` waits for (callgrind counts only that loop). Run directly with ``--direct`` it
times ``f`` instead (µs per call, wall clock), which is how the tests exercise a snippet.

    bash benchmarks/instructions_call.sh benchmarks/calls/nonfinite_root_call.py
    python benchmarks/instructions_call.py benchmarks/calls/nonfinite_root_call.py --direct 200
"""
from __future__ import annotations

import os
import runpy
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)


def load(snippet: str):
    """The snippet's ``f`` (its ``setup()`` run), warmed up."""
    f = runpy.run_path(snippet)["setup"]()
    for _ in range(50):
        f()
    return f


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    snippet, rest = argv[0], argv[1:]
    f = load(snippet)
    if rest[:1] == ["--direct"]:
        n = int(rest[1]) if len(rest) > 1 else 1000
        t0 = time.perf_counter()
        for _ in range(n):
            f()
        print(f"{snippet}: {(time.perf_counter() - t0) / n * 1e6:.2f} µs per call (wall clock)")
        return
    n, prefix = int(rest[0]), rest[1]

    def wait(suffix: str) -> None:
        while not os.path.exists(prefix + suffix):
            time.sleep(0.05)

    open(prefix + ".ready", "w").close()
    wait(".go")
    for _ in range(n):
        f()
    open(prefix + ".done", "w").close()
    wait(".stop")


if __name__ == "__main__":
    main()
