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


def test_step_gradient_norm_is_exact_when_the_parameters_with_a_gradient_change():
    """The timeline's grad_norm is the joint norm of the gradients the optimizer applies, step after step,
    while a branch used on odd steps only leaves its gradients None on even ones (the kept parameter list
    and the filtered one alternate), and after a gradient is replaced by a sparse one by hand (counted by its stored values)."""
    torch.manual_seed(0)

    class Branchy(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x, use_b):
            return self.b(self.a(x)) if use_b else self.a(x)

    m = Branchy()
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    x = torch.randn(8, 4)
    expected = []
    with guard(m, opt, live=False) as g:
        for i in range(8):
            opt.zero_grad(set_to_none=True)
            m(x, use_b=i % 2 == 1).pow(2).mean().backward()
            if i == 5:
                m.b.bias.grad = m.b.bias.grad.to_sparse()  # not strided: its stored values count
            grads = [p.grad if p.grad.layout is torch.strided else p.grad._values()
                     for p in m.parameters() if p.grad is not None]
            expected.append(float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(t) for t in grads]))))
            opt.step()
    got = [e["grad_norm"] for e in g.timeline]
    assert got == pytest.approx(expected, rel=1e-5)
    assert not g.findings and not g.report()["internal_errors"]
