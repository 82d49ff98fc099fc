"""The cheap steady state: layers keep hooks only while a check needs them, and what moved off the
per-call path (weights, in-place tags, the failing module, gradient norms) is still found."""
import pytest
import torch
from torch import nn

from guard import guard
from guard.tensors import Norms


class Log(nn.Module):  # a custom layer: it can make NaN, so it stays screened
    shift = 0.0

    def forward(self, x):
        return torch.log(x + 1.0 - self.shift)


def _hooked(m: nn.Module) -> bool:
    return bool(m._forward_hooks or m._forward_pre_hooks)


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), Log(), nn.Linear(8, 2))


def test_layers_lose_their_hooks_after_the_first_call_and_nan_is_still_found_later():
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with guard(model, opt, live=False) as g:
        for step in range(6):
            x = torch.rand(3, 4)
            model[2].shift = 100.0 if step == 4 else 0.0  # log of a negative number: NaN, at step 4 only
            opt.zero_grad()
            model(x).sum().backward()
            if step == 1:
                # after the first call: fp32 Linear and ReLU cannot make NaN and nothing else watches them
                assert not _hooked(model[0]) and not _hooked(model[1]) and not _hooked(model[3])
                assert _hooked(model[2]) and _hooked(model)  # the custom layer and the root stay
            if step < 4:
                opt.step()
    f = next(f for f in g.findings if f.kind == "nonfinite-output")
    assert (f.where, f.step) == ("2", 4) and "log(0)" in f.hint and g.internal_errors == []
    assert not any(_hooked(m) for m in model.modules())  # close removed the rest
    assert {m["path"] for m in g.report()["modules"]} >= {"0", "1", "2", "3"}  # each layer's first call is in the table


def test_half_precision_standard_layers_stay_screened_after_their_first_call():
    class Scale(nn.Module):
        def forward(self, x):
            return x * 1000.0

    model = nn.Sequential(nn.Linear(8, 8), Scale(), nn.Linear(8, 8)).to(torch.bfloat16)
    x = torch.ones(2, 8, dtype=torch.bfloat16)
    with guard(model, live=False) as g:
        with torch.no_grad():
            for step in range(3):
                if step == 2:
                    model[2].weight.fill_(3e36)  # finite bf16 weights; the product overflows in the layer
                model(x)
                g.flush()
                assert _hooked(model[2])
    f = next(f for f in g.findings if f.kind == "nonfinite-output")
    assert f.where == "2"


def test_global_guard_settles_per_layer_handlers_too():
    model = _net()
    with guard(live=False) as g:
        for step in range(4):
            model[2].shift = 100.0 if step == 3 else 0.0
            model(torch.rand(3, 4)).sum().backward()
    f = next(f for f in g.findings if f.kind == "nonfinite-output")
    assert f.where == "2" and f.step == 3


def test_weights_broken_by_the_last_update_are_reported_at_exit():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with guard(model, opt, live=False) as g:
        for step in range(2):
            opt.zero_grad()
            (model(torch.randn(8, 4)) ** 2).mean().backward()
            if step == 1:
                opt.param_groups[0]["lr"] = float("inf")  # finite gradients, an update that overflows
            opt.step()  # the last one: no forward sees the broken weights
    assert [(f.kind, f.step) for f in g.findings] == [("nonfinite-param", 1)]
    # (the rate itself is infinite: named as the cause, not an overflow of the update)
    assert "learning rate of their optimizer is inf" in g.findings[0].message
    assert "The learning rate itself became NaN/Inf" in g.findings[0].hint


def test_inplace_error_after_the_tagged_steps_is_still_explained():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)
            self.act = nn.Sigmoid()

        def forward(self, x, bad=False):
            h = self.act(self.fc(x))
            if bad:
                h += 1  # modifies the output Sigmoid saved for backward
            return h.sum()

    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation") as ei:
        with guard(model, opt, live=False) as g:
            for step in range(5):
                opt.zero_grad()
                model(torch.randn(2, 4), bad=step == 4).backward()
                opt.step()
    f = next(f for f in g.findings if f.kind == "explained-error")
    assert f.step == 4 and f.where == "backward" and ".clone()" in f.hint
    assert "guard" in "\n".join(getattr(ei.value, "__notes__", []))


def test_failing_layer_is_named_from_the_traceback_after_hooks_are_gone():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    with pytest.raises(RuntimeError) as ei:
        with guard(model, live=False) as g:
            for step in range(3):
                x = torch.randn(2, 4)
                model(x.to("meta") if step == 2 else x)  # the weights stay on the CPU
    assert not _hooked(model[0])
    f = next(f for f in g.findings if f.kind == "explained-error")
    assert f.where == "0"  # (no backward ran: still step 0)
    assert "`0` (Linear)" in "\n".join(ei.value.__notes__)


@pytest.mark.parametrize("key", [None, "params"])
def test_norms_match_foreach_norm(key):
    torch.manual_seed(0)
    ts = [torch.randn(16, 16) for _ in range(12)] + [torch.randn(16) for _ in range(11)] + [torch.randn(300, 300)]
    ts += [torch.randn(3, dtype=torch.float64)]
    ref = torch.stack([torch.linalg.vector_norm(t).float() for t in ts])
    for _ in range(2):  # the second call uses the cached grouping
        n = Norms(ts, key=key)
        assert torch.allclose(torch.stack([v.float() for v in n.norms]), ref)
        (st, ids), = n.stacked.values()
        assert torch.allclose(st[torch.argsort(torch.tensor(ids))], ref)
        assert torch.allclose(n.totals[torch.device("cpu")], torch.linalg.vector_norm(ref))
    # a key reused for other shapes (ids of freed tensors) still gives the right norms
    other = [torch.randn(7, 2) for _ in range(len(ts))]
    n = Norms(other, key=key)
    assert torch.allclose(torch.stack(n.norms), torch.stack([torch.linalg.vector_norm(t) for t in other]))


def test_norms_on_two_devices_total_per_device():
    ts = [torch.randn(4, 4), torch.randn(4, 4, device="meta"), torch.randn(3)]
    n = Norms(ts)
    assert set(n.totals) == {torch.device("cpu"), torch.device("meta")}
    assert torch.allclose(n.norms[2], torch.linalg.vector_norm(ts[2]))
