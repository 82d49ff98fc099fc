"""The CUDA paths, on a real GPU: skipped where there is none (CI, the developers' machines).

`benchmarks/gpu.sh` runs this file on a machine with a GPU. Each test checks what a user on a GPU
sees: the device-mismatch finding for a real `cuda` tensor, AMP fp16 with GradScaler on CUDA (skipped
steps are not errors, a real NaN still is), NaN localisation on CUDA, and at most one host sync per
step caused by guard.
"""
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from guard import GuardError, guard

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here"),
]


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))


def test_cuda_model_cpu_input_is_named_before_pytorch_error():
    model = mlp().cuda()
    with guard(model, mode="raise", live=False):
        with pytest.raises(GuardError) as err:
            model(torch.randn(8, 16))  # x.cuda() not assigned
    f = err.value.finding
    assert f.kind == "device-mismatch" and f.where == "0"
    assert "cuda" in f.message and "x = x.to(device)" in f.hint


def test_cuda_and_cuda0_are_the_same_device():
    model = mlp().to("cuda:0")
    opt = torch.optim.Adam(model.parameters())
    with guard(model, opt, live=False, checks="all") as g:
        for _ in range(3):
            loss = F.cross_entropy(model(torch.randn(8, 16, device="cuda")), torch.randint(0, 4, (8,), device="cuda"))
            opt.zero_grad()
            loss.backward()
            opt.step()
    assert [f.kind for f in g.findings if f.severity != "info"] == []


def test_nan_input_on_cuda_found_at_its_step():
    model = mlp().cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with guard(model, opt, live=False) as g:
        for step in range(6):
            x = torch.randn(8, 16, device="cuda")
            if step == 3:
                x[2, 5] = float("nan")
            loss = F.cross_entropy(model(x), torch.randint(0, 4, (8,), device="cuda"))
            opt.zero_grad()
            loss.backward()
            opt.step()
    f = g.findings[0]
    assert f.kind == "nonfinite-input" and f.step == 3 and f.where == "input"


def test_amp_fp16_gradscaler_skipped_steps_are_not_errors():
    model = mlp().cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cuda", init_scale=2.0 ** 40)  # overflows at first: skipped steps
    with guard(model, opt, live=False) as g:
        for _ in range(12):
            with torch.autocast("cuda", dtype=torch.float16):
                loss = F.cross_entropy(model(torch.randn(8, 16, device="cuda")),
                                       torch.randint(0, 4, (8,), device="cuda"))
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
    assert scaler.get_scale() < 2.0 ** 40  # steps were skipped
    assert [f for f in g.findings if f.severity == "error"] == []
    assert any(e.get("skipped") for e in g.report()["timeline"])


def _syncs(model, opt, steps, guarded):
    x = torch.randn(32, 16, device="cuda")
    y = torch.randint(0, 4, (32,), device="cuda")

    def step():
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()

    ctx = guard(model, opt, live=False, mode="record") if guarded else None
    if ctx:
        ctx.start()
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
    finally:
        if ctx:
            ctx.close()
    return sum("synchroniz" in str(w.message).lower() for w in caught)


def test_at_most_one_host_sync_per_step_from_guard():
    steps = 10
    model = mlp().cuda()
    opt = torch.optim.Adam(model.parameters())
    base = _syncs(model, opt, steps, guarded=False)
    guarded = _syncs(model, opt, steps, guarded=True)
    assert (guarded - base) / steps <= 1.0, (base, guarded)
