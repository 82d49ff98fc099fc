"""Guarded models stay ordinary model objects: they copy, pickle and save; `guard.wrap` output behaves as
the model in every nn.Module method; an interrupted forward or a deep model does not blind the guard."""
import copy
import io
import os
import pickle
import pickletools
import subprocess
import sys

import pytest
import torch
from torch import nn

import guard as guard_pkg
from guard import guard

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_HOOK_DICTS = ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks",
               "_forward_hooks_with_kwargs", "_forward_hooks_always_called")


class Root(nn.Module):
    """Root-level parameter and buffers (what a wrapper is most likely to miss), plus children."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(3))
        self.register_buffer("mean", torch.zeros(3))
        self.register_buffer("tmp", torch.zeros(1), persistent=False)
        self.lin = nn.Linear(3, 4)
        self.bn = nn.BatchNorm1d(4)
        self.out = nn.Linear(4, 1)

    def forward(self, x):
        return self.out(self.bn(self.lin((x - self.mean) * self.scale)))


def _train(model, opt, steps=2):
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(6, 3)).sum().backward()
        opt.step()


def _guard_hooks(module):
    """Hooks on `module` and its children that are bound to a guard."""
    found = []
    for m in module.modules():
        for name in ("_forward_pre_hooks", "_forward_hooks"):
            for h in getattr(m, name).values():
                owner = getattr(h, "__self__", None)
                if type(owner).__module__.startswith("guard"):
                    found.append((type(m).__name__, name))
    return found


def _copies(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return {
        "deepcopy": copy.deepcopy(obj),
        "pickle": pickle.loads(pickle.dumps(obj)),
        "torch.save": torch.load(buf, weights_only=False),
        "AveragedModel": torch.optim.swa_utils.AveragedModel(obj).module,
    }


# ----------------------------------------------------------------------------- copy, pickle, save

def _start(scope, model, opt):
    """(guard, the object the user holds) for each way of guarding."""
    if scope == "wrap":
        w = guard_pkg.wrap(model, opt, checks="all", live=False)
        return w.guard, w
    if scope == "global":
        return guard(checks="all", live=False).start(), model
    return guard(model, opt, checks="all", snoop=True, live=False).start(), model


@pytest.mark.parametrize("scope", ["model", "global", "wrap"])
@pytest.mark.parametrize("when", ["before the first step", "after steps"])
def test_guarded_model_copies_pickles_and_saves_as_a_plain_module(scope, when):
    model = Root()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, weight_decay=1e-4)
    g, held = _start(scope, model, opt)
    try:
        if when == "after steps":
            _train(held, opt)
        for how, c in _copies(held).items():
            assert type(c) is Root, how
            assert c is not model, how
            assert _guard_hooks(c) == [], how  # a copy made under guard is a plain, unwatched module
            assert set(c.state_dict()) == set(model.state_dict()), how
            for n, p in model.state_dict().items():
                assert torch.equal(p, c.state_dict()[n]), (how, n)
            with torch.no_grad():
                assert c(torch.randn(6, 3)).shape == (6, 1)  # and it runs
        _train(held, opt)  # the guarded model still trains and is still watched
        if scope != "global":
            assert _guard_hooks(model)
        held(torch.full((6, 3), float("nan")))
        g.flush()
        assert [f.kind for f in g.findings] == ["nonfinite-input"]
        assert not g.internal_errors
    finally:
        g.close()


def test_best_model_snapshot_and_ema_teacher_inside_the_loop_are_not_watched():
    model = Root()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with guard(model, opt, live=False) as g:
        best = copy.deepcopy(model)
        ema = torch.optim.swa_utils.AveragedModel(model)
        _train(model, opt)
        ema.update_parameters(model)
        best(torch.full((2, 3), float("nan")))  # not the guarded model: guard stays silent about it
        ema(torch.randn(2, 3))
        g.flush()
        assert g.findings == []
        model(torch.full((2, 3), float("nan")))
        g.flush()
        assert [f.kind for f in g.findings] == ["nonfinite-input"]


def test_saved_wrapped_model_loads_where_guard_is_not_installed(tmp_path):
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 1))
    w = guard_pkg.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1), live=False)
    try:
        w(torch.randn(2, 3)).sum().backward()
        path = tmp_path / "model.pt"
        torch.save(w, path)
        assert "guard" not in " ".join(str(op) for op in pickletools.genops(pickle.dumps(w)))
    finally:
        w.guard.close()
    # A fresh interpreter in which `import guard` fails loads it as the plain model.
    code = ("import sys; sys.modules['guard'] = None\n"
            "import torch\n"
            f"m = torch.load({str(path)!r}, weights_only=False)\n"
            "print(type(m).__name__, [type(c).__name__ for c in m], m(torch.ones(1, 3)).shape)\n")
    env = dict(os.environ, PYTHONPATH=ROOT)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "Sequential ['Linear', 'ReLU', 'Linear'] torch.Size([1, 1])"


def test_wrapper_pickled_with_its_model_stays_one_object():
    model = Root()
    w = guard_pkg.wrap(model, live=False)
    try:
        a, b = pickle.loads(pickle.dumps([w, model]))
        assert a is b and type(a) is Root
        memo_copy = copy.deepcopy({"w": w, "m": model})
        assert memo_copy["w"] is memo_copy["m"]
        assert type(copy.copy(w)) is Root
    finally:
        w.guard.close()
