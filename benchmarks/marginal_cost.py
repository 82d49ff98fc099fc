"""Marginal cost of single checks inside the default guard: ``checks="default"`` vs ``["default", "-X"]``.

All configurations train their own copy of one small model in one process, interleaved step by step
(order rotated every round), under guards kept for the whole run; each cell is the median over
repetitions of the median step time. On the CPU the clock is the thread's CPU time by default
(``--clock cpu``): other processes on a shared machine do not inflate it as they do wall-clock time. The difference "default" - "default -X" is what check X adds.

    python benchmarks/marginal_cost.py                          # the issue-16 (part A) checks
    python benchmarks/marginal_cost.py --checks loss-disconnected,init-loss-high --steps 300 --reps 5
    bash benchmarks/marginal_instructions.sh            # the same as callgrind instruction counts (deterministic)
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import os
import statistics
import sys
import time
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from guard import guard  # noqa: E402

CHECKS = ["module-not-registered", "train-in-eval-mode", "loss-shape-broadcast", "zero-grad-before-step",
          "loss-disconnected", "init-loss-high"]


def small_model():
    """A small classifier with dropout and BatchNorm (so that every check has something to look at)."""
    return nn.Sequential(nn.Linear(32, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Dropout(0.1),
                         nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))


def step_fn(model, opt, device="cpu"):
    x, y, t = torch.randn(32, 32), torch.randint(0, 10, (32,)), torch.randn(32, 1)
    x, y, t = x.to(device), y.to(device), t.to(device)

    def step():
        out = model(x)
        loss = F.cross_entropy(out, y) + 0.1 * F.mse_loss(out.mean(dim=1, keepdim=True), t)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return step


def cue(conf: str, steps: int, prefix: str) -> None:
    """One configuration run on cue for callgrind (see marginal_instructions.sh): only the steps are counted.

    `conf`: ``unguarded``, ``default``, ``minus-<check>`` (default without it) or ``only-<check>``.
    """
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = small_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    step = step_fn(model, opt)
    spec = (None if conf == "unguarded" else ["default"] if conf == "default" else
            ["default", "-" + conf[len("minus-"):]] if conf.startswith("minus-") else [conf[len("only-"):]])
    ctx = contextlib.nullcontext() if spec is None else guard(model, opt, checks=spec, live=False, mode="record")

    def wait(suffix):
        while not os.path.exists(prefix + suffix):
            time.sleep(0.05)

    with ctx, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(5):
            step()
        open(prefix + ".ready", "w").close()
        wait(".go")
        for _ in range(steps):
            step()
        open(prefix + ".done", "w").close()
        wait(".stop")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checks", default=",".join(CHECKS))
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--clock", choices=("cpu", "wall"), default="cpu",
                    help="cpu: this thread's CPU time (insensitive to other processes on a shared machine)")
    ap.add_argument("--cue", nargs=2, metavar=("CONF", "PREFIX"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.cue:
        return cue(args.cue[0], args.steps, args.cue[1])
    torch.set_num_threads(1)
    names = [c.strip() for c in args.checks.split(",") if c.strip()]
    configs = {"unguarded": None, "default": ["default"]}
    configs.update({f"default -{c}": ["default", f"-{c}"] for c in names})
    configs.update({f"only {c}": [c] for c in names})
    torch.manual_seed(0)
    model0 = small_model()
    runs = {}
    for cname in configs:
        model = copy.deepcopy(model0).to(args.device)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        runs[cname] = (model, opt, step_fn(model, opt, args.device))
    clock = time.thread_time if args.clock == "cpu" and args.device == "cpu" else time.perf_counter
    order = list(configs)
    med = {c: [] for c in configs}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for r in range(args.reps):
            with contextlib.ExitStack() as stack:
                for cname, spec in configs.items():
                    model, opt, _ = runs[cname]
                    if spec is not None:
                        stack.enter_context(guard(model, opt, checks=spec, live=False, mode="record"))
                per = {c: [] for c in configs}
                for i in range(args.steps + 5):
                    k = (r + i) % len(order)
                    for cname in order[k:] + order[:k]:
                        t0 = clock()
                        runs[cname][2]()
                        if args.device != "cpu":
                            torch.cuda.synchronize()
                        if i >= 5:
                            per[cname].append(clock() - t0)
            for c in configs:
                med[c].append(statistics.median(per[c]))
    us = {c: statistics.median(v) * 1e6 for c, v in med.items()}
    base, dflt = us["unguarded"], us["default"]
    print(f"{args.reps} reps x {args.steps} steps, interleaved; median step {args.clock} time (us) on {args.device}; "
          f"torch {torch.__version__}")
    print(f"unguarded {base:8.1f}   default {dflt:8.1f} ({dflt / base:.3f}x)")
    print(f"{'check':24s} {'default - X':>12s} {'X adds':>9s} {'% of default':>12s} {'only X':>9s} {'only X / unguarded':>18s}")
    for c in names:
        without, alone = us[f"default -{c}"], us[f"only {c}"]
        print(f"{c:24s} {without:12.1f} {dflt - without:9.1f} {100 * (dflt - without) / dflt:11.1f}% "
              f"{alone:9.1f} {alone / base:18.3f}x")


if __name__ == "__main__":
    main()
