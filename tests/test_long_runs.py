"""Long runs and many sessions: guard's memory stays flat, the timeline is downsampled (not dropped), and
re-entering a guard 1,000 times leaks neither hooks nor memory.

``GUARD_LONG_STEPS=100000`` runs the long test at full length (default 20,000 to keep this file near 20 s).
"""
import gc
import os
import time
import tracemalloc

import torch
from torch import nn

from guard import guard
from guard import hooks as guard_hooks
from tests.test_lifecycle import global_state, module_hook_counts
from tests.test_reliability import patch_targets_state, saved_tensor_hooks


def test_reentering_1000_times_leaks_neither_hooks_nor_memory():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    before, targets = global_state(), patch_targets_state()
    x = torch.randn(2, 4)

    def enter(n):
        for _ in range(n):
            with guard(model, opt, checks="all", live=False):
                model(x).sum().backward()
                opt.step()
                opt.zero_grad()

    t0 = time.process_time()  # this process's CPU time: other work on the machine does not count
    enter(100)  # warm caches (registry, imports, torch kernels)
    gc.collect()
    tracemalloc.start()
    try:
        enter(100)
        gc.collect()
        base = tracemalloc.get_traced_memory()[0]
        enter(800)
        gc.collect()
        grown = tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()
    assert global_state() == before and patch_targets_state() == targets
    assert module_hook_counts(model) == [(0, 0)] * 3
    assert guard_hooks.active_patches() == [] and not guard_hooks._orphans
    assert len(guard_hooks._exit_callbacks) == 0
    assert grown < 256 * 1024, f"{grown} bytes retained over 800 guard sessions"
    assert time.process_time() - t0 < 60  # 29 checks built and 30-odd patches placed per session: ~10 ms, tracemalloc on
    assert saved_tensor_hooks() is None


LONG_STEPS = int(os.environ.get("GUARD_LONG_STEPS", "20000"))


def test_very_long_run_memory_is_flat_and_timeline_downsampled():
    from guard.session import MAX_TIMELINE

    torch.manual_seed(0)
    model = nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x, y = torch.randn(4, 2), torch.randn(4, 1)

    def steps(n):
        for _ in range(n):
            loss = nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()

    def sizes(g):
        out = {"timeline": len(g.timeline), "findings": len(g.record.findings), **g.staging.pending(),
               "modules": len(g.modules)}
        for c in g.checks:
            for k, v in vars(c).items():
                if isinstance(v, (list, dict, set)):
                    out[f"{c.name}.{k}"] = len(v)
        return out

    window = 1500  # traced steps (tracemalloc triples the cost of a step)
    with guard(model, opt, checks="all", live=False) as g:
        warm = MAX_TIMELINE * 2  # past the first downsampling
        steps(warm)
        s1 = sizes(g)
        gc.collect()
        tracemalloc.start()
        try:
            steps(200)
            base = tracemalloc.get_traced_memory()[0]
            steps(window)
            gc.collect()
            grown = tracemalloc.get_traced_memory()[0] - base
        finally:
            tracemalloc.stop()
        steps(LONG_STEPS - warm - window - 200)
        s2 = sizes(g)
    assert g.step == LONG_STEPS and g.findings == [] and g.internal_errors == []
    stride = g.record.timeline_stride
    assert stride > 1 and MAX_TIMELINE // 2 <= len(g.timeline) <= MAX_TIMELINE
    got = [e["step"] for e in g.timeline]
    assert got[0] == 0 and got == sorted(got) and all(b - a == stride for a, b in zip(got, got[1:]))
    assert got[-1] >= LONG_STEPS - 2 * stride  # recent history kept, evenly thinned
    assert all("loss" in e for e in g.timeline)
    grew = {k: (s1.get(k), v) for k, v in s2.items() if k != "timeline" and v > max(64, 2 * (s1.get(k) or 0))}
    assert grew == {}, grew
    # the timeline may fill up again (<= MAX_TIMELINE / 2 entries of ~0.5 KB) inside the window; nothing else grows
    assert grown < 1024 * 1024, f"{grown} bytes grown over {window} steps"
