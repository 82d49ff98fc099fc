"""The two ways staged values are read give the same findings and timeline.

On the CPU guard reads each staged value directly (`guard.tensors.HOST_DIRECT`); on accelerators it
stacks them and reads once per device. CPU tests exercise the accelerator path by turning the switch off.
"""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from guard import guard, tensors


def run(bad_step=None):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    with guard(model, opt, live=False, mode="record") as g:
        for step in range(8):
            x, y = torch.randn(6, 4), torch.randint(0, 3, (6,))
            if step == bad_step:
                x[2, 1] = float("nan")
            opt.zero_grad()
            out = model(x)
            F.cross_entropy(out, y).backward()
            opt.step()
    return g


@pytest.mark.parametrize("bad_step", [None, 5])
def test_direct_and_batched_reads_agree(monkeypatch, bad_step):
    monkeypatch.setattr(tensors, "HOST_DIRECT", True)
    direct = run(bad_step)
    monkeypatch.setattr(tensors, "HOST_DIRECT", False)
    batched = run(bad_step)
    key = lambda g: [(f.kind, f.where, f.step) for f in g.findings]  # noqa: E731
    assert key(direct) == key(batched)
    if bad_step is not None:
        assert key(direct)[0] == ("nonfinite-input", "input", bad_step)
    else:
        assert key(direct) == []
    tl_d, tl_b = direct.record.timeline, batched.record.timeline
    assert [e["step"] for e in tl_d] == [e["step"] for e in tl_b] and len(tl_d) == 8
    for a, b in zip(tl_d, tl_b):
        assert set(a) == set(b)
        for k in ("loss", "grad_norm"):
            if k in a:  # float32 on both paths: the same value
                assert a[k] == pytest.approx(b[k], rel=1e-6, nan_ok=True)
