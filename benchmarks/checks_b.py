"""Cost of each of the issue-16/19 checks alone on a small model, interleaved block by block.

    python benchmarks/checks_b.py [--reps 15] [--steps 20]

A small MLP with dropout (nn.Dropout and F.dropout(training=...)), a DataLoader with shuffle=False over
random labels (the worst case for unshuffled-labels: every batch is looked at), a CPU GradScaler (fp32: CPU autocast
would dominate the step) with unscale_ and clip_grad_norm_ (clip-before-unscale's patches at work), cross_entropy. Configurations: the
default guard without these seven checks ("base"), base plus each check alone, and the default guard.
Each repetition runs every configuration for one block of `steps` steps (in rotated order, a guard
entered per block; the first 3 steps of a block are not timed), so no two guards share torch's patched
functions. Cells: median per-step thread CPU time (CLOCK_THREAD_CPUTIME_ID: what another process does on
this shared machine does not count) over all timed steps, and the difference to base.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from torch import nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from guard import guard  # noqa: E402

MINE = ["dropout-in-eval", "unshuffled-labels", "clip-before-unscale", "params-not-updating",
        "vanishing-gradients", "grads-all-zero", "loss-constant"]


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(64, 64) for _ in range(6))
        self.inp, self.out, self.drop = nn.Linear(32, 64), nn.Linear(64, 10), nn.Dropout(0.1)

    def forward(self, x):
        h = F.relu(self.inp(x))
        for i, layer in enumerate(self.layers):
            h = F.relu(layer(h))
            h = self.drop(h) if i % 2 else F.dropout(h, 0.1, training=self.training)
        return self.out(h)


BASE = ["default"] + [f"-{c}" for c in MINE]
CONFIGS = {"unguarded": None, "base": BASE}
CONFIGS.update({f"base + {c}": BASE + [c] for c in MINE})
CONFIGS["default"] = ["default"]


def setup():
    torch.set_num_threads(1)
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(4096, 32), torch.randint(0, 10, (4096,)))
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    scaler = torch.amp.GradScaler("cpu")
    loader = DataLoader(data, batch_size=32, shuffle=False)

    def one(it):
        x, y = next(it)
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()

    def ctx(checks):
        return guard(model, opt, checks=checks, live=False, mode="record") if checks is not None else _null()

    return loader, one, ctx


def cue(conf: str, steps: int, prefix: str) -> None:
    """For checks_b_instructions.sh: warm up, then run `steps` steps between the .go and .done files."""
    loader, one, ctx = setup()

    def wait(suffix):
        while not os.path.exists(prefix + suffix):
            time.sleep(0.05)

    with ctx(CONFIGS[conf]):
        it = iter(loader)
        for _ in range(4):
            one(it)
        open(prefix + ".ready", "w").close()
        wait(".go")
        for _ in range(steps):
            one(it)
        open(prefix + ".done", "w").close()
        wait(".stop")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--cue", nargs=2, metavar=("CONFIG", "PREFIX"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.cue:
        return cue(args.cue[0], args.steps, args.cue[1])
    configs = CONFIGS
    names = list(configs)
    times = {n: [] for n in names}
    loader, one, ctx = setup()

    def block(n_steps, checks):
        out = []
        with ctx(checks):
            it = iter(loader)
            for i in range(n_steps):
                t0 = time.thread_time_ns()
                one(it)
                dt = time.thread_time_ns() - t0
                if i >= 3:
                    out.append(dt / 1e3)
        return out

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        block(20, None)
        for r in range(args.reps):
            k = r % len(names)
            for n in names[k:] + names[:k]:
                times[n].extend(block(args.steps + 3, configs[n]))
    med = {n: statistics.median(times[n]) for n in names}
    print(f"torch {torch.__version__}, 1 thread; {args.reps} blocks x {args.steps} timed steps per configuration; "
          f"median thread CPU time per step")
    print(f"| configuration | µs/step | vs base |\n|---|---|---|")
    for n in names:
        print(f"| {n} | {med[n]:.0f} | {med[n] - med['base']:+.0f} µs ({med[n] / med['base']:.3f}x) |")


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *a):
        return False


if __name__ == "__main__":
    main()
