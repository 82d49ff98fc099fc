"""Device check for the issue-16 (part A) checks on CUDA: host-device syncs per step and the findings.

Counts the synchronising calls per training step (``torch.cuda.set_sync_debug_mode("warn")``) under the
default guard with and without the six checks, and runs each bug once on the GPU to see it reported.

    python benchmarks/sync_check_a.py          # needs a CUDA device
"""
from __future__ import annotations

import os
import sys
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from guard import guard  # noqa: E402

MINE = ["module-not-registered", "train-in-eval-mode", "loss-shape-broadcast", "zero-grad-before-step",
        "loss-disconnected", "init-loss-high"]
DEV = os.environ.get("GUARD_BENCH_DEVICE", "cuda")


def model():
    return nn.Sequential(nn.Linear(32, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Dropout(0.1),
                         nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10)).to(DEV)


def syncs_per_step(checks, steps=20):
    m = model()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-4)
    x, y, t = torch.randn(32, 32, device=DEV), torch.randint(0, 10, (32,), device=DEV), torch.randn(32, 1, device=DEV)
    counts = []
    with guard(m, opt, checks=checks, live=False, mode="record") as g:
        for i in range(steps):
            with warnings.catch_warnings(record=True) as w:
                warnings.simplefilter("always")
                if DEV == "cuda":
                    torch.cuda.set_sync_debug_mode("warn")
                out = m(x)
                loss = F.cross_entropy(out, y) + 0.1 * F.mse_loss(out.mean(dim=1, keepdim=True), t)
                opt.zero_grad()
                loss.backward()
                opt.step()
                if DEV == "cuda":
                    torch.cuda.set_sync_debug_mode("default")
            counts.append(sum("synchroniz" in str(x.message) for x in w))
    return counts, g


def bugs():
    out = {}
    # zero-grad-before-step, with set_to_none=False (the staged device norm path)
    m = model(); opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    with guard(m, opt, live=False) as g:
        for _ in range(3):
            F.cross_entropy(m(torch.randn(8, 32, device=DEV)), torch.randint(0, 10, (8,), device=DEV)).backward()
            opt.zero_grad(set_to_none=False)
            opt.step()
    out["zero-grad-before-step"] = [f.kind for f in g.findings]
    # loss-shape-broadcast
    m = model(); opt = torch.optim.SGD(m.parameters(), lr=0.1)
    with guard(m, opt, live=False) as g, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(3):
            opt.zero_grad()
            F.mse_loss(m(torch.randn(8, 32, device=DEV))[:, :1], torch.randn(8, device=DEV)).backward()
            opt.step()
    out["loss-shape-broadcast"] = [f.kind for f in g.findings]
    # loss-disconnected
    m = model(); opt = torch.optim.SGD(m.parameters(), lr=0.1)
    with guard(m, opt, live=False) as g:
        for _ in range(3):
            opt.zero_grad()
            loss = F.cross_entropy(m(torch.randn(8, 32, device=DEV)), torch.randint(0, 10, (8,), device=DEV))
            torch.tensor(loss.item(), requires_grad=True, device=DEV).backward()
            opt.step()
    out["loss-disconnected"] = [f.kind for f in g.findings]
    # init-loss-high
    m = model(); nn.init.normal_(m[6].weight, std=5.0); opt = torch.optim.SGD(m.parameters(), lr=0.001)
    with guard(m, opt, live=False) as g:
        for _ in range(4):
            opt.zero_grad()
            F.cross_entropy(m(torch.randn(64, 32, device=DEV)), torch.randint(0, 10, (64,), device=DEV)).backward()
            opt.step()
    out["init-loss-high"] = [f.kind for f in g.findings]
    # train-in-eval-mode
    m = model(); opt = torch.optim.SGD(m.parameters(), lr=0.1)
    with guard(m, opt, live=False) as g:
        for i in range(4):
            opt.zero_grad()
            F.cross_entropy(m(torch.randn(8, 32, device=DEV)), torch.randint(0, 10, (8,), device=DEV)).backward()
            opt.step()
            if i == 1:
                m.eval()
    out["train-in-eval-mode"] = [f.kind for f in g.findings]
    return out


def main():
    print(torch.__version__, torch.cuda.get_device_name() if DEV == "cuda" else DEV)
    for name, checks in (("default", ["default"]), ("default without the six", ["default"] + [f"-{c}" for c in MINE]),
                         ("only the six", MINE)):
        counts, g = syncs_per_step(checks)
        print(f"syncs per step, {name}: first {counts[:4]}, later {sorted(set(counts[4:]))}; findings "
              f"{[f.kind for f in g.findings]}; internal {g.internal_errors}")
    for k, v in bugs().items():
        print(f"bug {k}: found {v}")


if __name__ == "__main__":
    main()
