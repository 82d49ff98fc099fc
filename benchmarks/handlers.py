"""Where a guarded step's time goes, per check and event: each handler timed inside real training steps.

    python benchmarks/handlers.py                     # tiny MLP, default checks
    python benchmarks/handlers.py mlp-depth-16 --checks all --steps 2000

Every handler in the router's tables is wrapped with a timer; the wrapper's own cost (timed on a no-op)
is subtracted. Handlers run with the caches as a training step leaves them, which is what they cost in
practice (two to three times what a loop over one handler alone shows). The time of guard's hooks and
patches themselves, and of the hooks torch calls during backward, is not in any handler: the rest of
the overhead (`benchmarks/instructions_sweep.py` for the whole) is that machinery.
"""
from __future__ import annotations

import argparse
import collections
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", default="tiny-mlp")
    ap.add_argument("--checks", default="default")
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--top", type=int, default=30)
    args = ap.parse_args(argv)

    import torch

    import overhead
    import sweep  # noqa: F401  (registers the sweep's models)
    from guard import guard

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model, batch = overhead.MODELS[args.model]()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    step = overhead.step_fn(model, opt, batch)
    spent, calls = collections.Counter(), collections.Counter()
    clock = time.perf_counter

    def timed(key, fn):
        def wrapper(*a):
            t0 = clock()
            try:
                return fn(*a)
            finally:
                spent[key] += clock() - t0
                calls[key] += 1
        return wrapper

    noop = timed(("-", "-"), lambda *a: None)
    t0 = clock()
    for _ in range(100_000):
        noop(1, 2)
    own = (clock() - t0) / 100_000

    g = guard(model, opt, live=False, mode="record", checks=args.checks.split(","))
    with g:
        router = g.router
        for table in router._tables:
            for ev, hs in table.items():
                table[ev] = [(c, timed((ev, c.name), fn)) for c, fn in hs]
        router.all_forward_pre = router._tables[0].get("forward_pre", [])
        router.all_forward = router._tables[0].get("forward", [])
        router._use()
        for _ in range(20):
            step()
        spent.clear()
        calls.clear()
        for _ in range(args.steps):
            step()
    rows = sorted((((spent[k] - calls[k] * own) / args.steps * 1e6, k) for k in spent), reverse=True)
    print(f"{args.model}, checks={args.checks}: µs per step per handler ({args.steps} steps; timer cost "
          f"{own * 1e6:.2f} µs per call subtracted)")
    for us, (ev, name) in rows[:args.top]:
        print(f"{us:8.2f}  {ev:28s} {name}")
    total = sum(us for us, _ in rows)
    print(f"{total:8.2f}  all handlers, {sum(calls.values()) / args.steps:.0f} calls per step")


if __name__ == "__main__":
    main()
