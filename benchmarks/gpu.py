"""Guard on a GPU: overhead per step (CNN, transformer, tiny MLP) and host syncs caused by guard.

    python benchmarks/gpu.py            # what benchmarks/gpu.sh runs after the CUDA tests

Configurations run interleaved step by step in one process, each on its own copy of the model
(unguarded, guard default, detect_anomaly); a step's time ends with `torch.cuda.synchronize()`.
Host synchronisations are counted twice: warnings from `torch.cuda.set_sync_debug_mode("warn")`
and the profiler's device-to-host copies and synchronize events, guarded minus unguarded, per step.
"""
from __future__ import annotations

import contextlib
import copy
import os
import statistics
import sys
import time
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import torch  # noqa: E402
from torch import nn  # noqa: E402

from guard import guard  # noqa: E402


def tiny_mlp():
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 2))
    return model, lambda: (torch.randn(32, 8), torch.randint(0, 2, (32,)))


def models():
    import overhead

    return {"cnn": overhead.cnn, "transformer": overhead.transformer, "tiny-mlp": tiny_mlp}


def make(name):
    torch.manual_seed(0)
    model, batch = models()[name]()
    model = model.cuda()
    fixed = [t.cuda() for t in batch()]  # one batch on the device: data loading is not measured
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step():
        x, y = fixed
        out = model(x)
        loss = nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return model, opt, step


CONFIGS = ("unguarded", "guard default", "detect_anomaly")


def overhead(name, reps=5, steps=20, warmup=10):
    runs = {}
    for c in CONFIGS:
        model, opt, step = make(name)
        runs[c] = (model, opt, step)
    times = {c: [] for c in CONFIGS}
    with warnings.catch_warnings(), contextlib.ExitStack() as stack:
        warnings.simplefilter("ignore")
        stack.enter_context(guard(runs["guard default"][0], runs["guard default"][1], live=False, mode="record"))
        for c in CONFIGS:
            for _ in range(warmup):
                with (torch.autograd.detect_anomaly() if c == "detect_anomaly" else contextlib.nullcontext()):
                    runs[c][2]()
        torch.cuda.synchronize()
        for r in range(reps):
            per = {c: [] for c in CONFIGS}
            for i in range(steps):
                k = (r + i) % len(CONFIGS)
                for c in CONFIGS[k:] + CONFIGS[:k]:
                    ctx = torch.autograd.detect_anomaly() if c == "detect_anomaly" else contextlib.nullcontext()
                    with ctx:
                        t0 = time.perf_counter()
                        runs[c][2]()
                        torch.cuda.synchronize()
                        per[c].append(time.perf_counter() - t0)
            for c in CONFIGS:
                times[c].append(statistics.median(per[c]))
    return {c: statistics.median(t) for c, t in times.items()}


def syncs(name, steps=10):
    """(sync-debug warnings, profiler D2H copies + synchronize events) per step caused by guard."""
    out = []
    for guarded in (False, True):
        model, opt, step = make(name)
        g = guard(model, opt, live=False, mode="record").start() if guarded else None
        try:
            for _ in range(3):
                step()
            torch.cuda.synchronize()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    for _ in range(steps):
                        step()
                finally:
                    torch.cuda.set_sync_debug_mode("default")
            warn_n = sum("synchroniz" in str(w.message).lower() for w in caught)
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(steps):
                    step()
                torch.cuda.synchronize()
            names = [e.name for e in prof.events()]
            # Runtime calls seen on the host: each device-to-host read is one copy call that waits.
            d2h = sum(n.startswith("cudaMemcpy") for n in names)
            sync = sum(n in ("cudaStreamSynchronize", "cudaDeviceSynchronize") for n in names) - 1  # ours
            out.append((warn_n, d2h + max(sync, 0)))
        finally:
            if g is not None:
                g.close()
    (wu, pu), (wg, pg) = out
    return (wg - wu) / steps, (pg - pu) / steps


def main():
    if not torch.cuda.is_available():
        print("gpu benchmark: no CUDA device here; nothing to measure.")
        return 0
    print(f"GPU: {torch.cuda.get_device_name(0)}, torch {torch.__version__}")
    print("| model | unguarded ms/step | guard default | detect_anomaly | guard host syncs/step (sync-debug, profiler) |")
    print("|---|---|---|---|---|")
    for name in models():
        t = overhead(name)
        s = syncs(name)
        base = t["unguarded"]
        print(f"| {name} | {base * 1e3:.3f} | {t['guard default'] * 1e3:.3f} ({t['guard default'] / base:.3f}×) | "
              f"{t['detect_anomaly'] * 1e3:.3f} ({t['detect_anomaly'] / base:.3f}×) | {s[0]:.1f}, {s[1]:.1f} |",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
