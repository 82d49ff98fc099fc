"""Marginal cost of single checks inside the default guard: ``checks="default"`` vs ``["default", "-X"]``.

All configurations train their own copy of one small model in one process, interleaved step by step
(order rotated every round), under guards kept for the whole run; each cell is the median over
repetitions of the median step time. The difference "default" - "default -X" is what check X adds.

    python benchmarks/marginal_cost.py                          # the issue-16 (part A) checks
    python benchmarks/marginal_cost.py --checks loss-disconnected,init-loss-high --steps 300 --reps 5
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


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checks", default=",".join(CHECKS))
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args(argv)
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
                        t0 = time.perf_counter()
                        runs[cname][2]()
                        if args.device != "cpu":
                            torch.cuda.synchronize()
                        if i >= 5:
                            per[cname].append(time.perf_counter() - t0)
            for c in configs:
                med[c].append(statistics.median(per[c]))
    us = {c: statistics.median(v) * 1e6 for c, v in med.items()}
    base, dflt = us["unguarded"], us["default"]
    print(f"{args.reps} reps x {args.steps} steps, interleaved; median step time (us) on {args.device}; "
          f"torch {torch.__version__}")
    print(f"unguarded {base:8.1f}   default {dflt:8.1f} ({dflt / base:.3f}x)")
    print(f"{'check':24s} {'default - X':>12s} {'X adds':>9s} {'% of default':>12s} {'only X':>9s} {'only X / unguarded':>18s}")
    for c in names:
        without, alone = us[f"default -{c}"], us[f"only {c}"]
        print(f"{c:24s} {without:12.1f} {dflt - without:9.1f} {100 * (dflt - without) / dflt:11.1f}% "
              f"{alone:9.1f} {alone / base:18.3f}x")


if __name__ == "__main__":
    main()
