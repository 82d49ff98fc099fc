"""Regression tests for issue 13: closures, scaled losses, AMP orders, global mode, source lines, crashes."""
import inspect
import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from guard import GuardError, guard

HERE = os.path.relpath(__file__)


def mlp(out=1):
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, out))


def line(needle, fn):
    lines, start = inspect.getsourcelines(fn)
    return f"{HERE}:{start + next(i for i, t in enumerate(lines) if needle in t)}"


# --------------------------------------------------------------------------- closures

def closure_run(opt_cls, mode="warn", steps=10, bad=7, **opt_kw):
    model = mlp()
    opt = opt_cls(model.parameters(), **opt_kw)
    before = None
    g = guard(model, opt, live=False, mode=mode)
    try:
        with g:
            for step in range(steps):
                x, y = torch.randn(8, 4), torch.randn(8, 1)
                if step == bad:
                    x[0, 0] = float("nan")
                    before = [p.detach().clone() for p in model.parameters()]

                def closure():
                    opt.zero_grad()
                    loss = F.mse_loss(model(x), y)  # the closure's forward
                    loss.backward()
                    return loss
                opt.step(closure)
    except GuardError:
        pass
    return g, model, before


@pytest.mark.parametrize("opt_cls,kw", [(torch.optim.SGD, {"lr": 0.1}), (torch.optim.LBFGS, {"lr": 0.1, "max_iter": 4})])
def test_closure_nan_input_is_the_input_at_its_step(opt_cls, kw):
    g, _, _ = closure_run(opt_cls, **kw)
    f = g.findings[0]
    assert (f.kind, f.where, f.step) == ("nonfinite-input", "input", 7)
    assert f.source == line("the closure's forward", closure_run)
    assert "nonfinite-param" not in [x.kind for x in g.findings]


def test_closure_raise_mode_stops_before_the_update():
    g, model, before = closure_run(torch.optim.SGD, mode="raise", lr=0.1)
    assert [f.kind for f in g.findings] == ["nonfinite-input"]
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))  # no NaN update applied
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_closure_healthy_lbfgs_is_silent_and_identical():
    def run(use):
        torch.manual_seed(0)
        model = mlp()
        opt = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=5)
        x, y = torch.randn(32, 4), torch.randn(32, 1)
        losses = []
        g = guard(model, opt, live=False) if use else None
        if g:
            g.start()
        for _ in range(4):
            def closure():
                opt.zero_grad()
                loss = F.mse_loss(model(x), y)
                loss.backward()
                return loss
            losses.append(opt.step(closure).item())
        if g:
            g.close()
        return g, losses
    g, guarded = run(True)
    _, plain = run(False)
    assert g.findings == [] and guarded == plain


# --------------------------------------------------------------------------- scaled losses

def scaled_accumulation(keep, global_mode, steps=24):
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with (guard(live=False) if global_mode else guard(model, opt, live=False)) as g:
        total = 0
        for i in range(steps):
            x, y = torch.randn(8, 4), torch.randn(8, 1)
            out = model(x)
            loss = F.mse_loss(out, y)
            kept = loss if keep == "loss" else out.mean() if keep == "output" else loss.item()
            total = total + kept  # holder
            (loss / 2).backward()
            if i % 2:
                opt.step()
                opt.zero_grad()
    return g


@pytest.mark.parametrize("global_mode", [False, True])
@pytest.mark.parametrize("keep", ["loss", "output"])
def test_scaled_loss_retained_graph_is_found(keep, global_mode):
    g = scaled_accumulation(keep, global_mode)
    f = [f for f in g.findings if f.kind == "loss-graph-retained"]
    assert len(f) == 1 and f[0].where == "total"
    assert f[0].source == line("# holder", scaled_accumulation)


def test_scaled_loss_detached_is_silent():
    assert scaled_accumulation("detached", False).findings == []


class Caching(nn.Module):
    """Keeps every hidden activation (an intermediate of each step's graph) in a list."""

    def __init__(self):
        super().__init__()
        self.enc, self.head, self.cache = nn.Linear(4, 8), nn.Linear(8, 1), []

    def forward(self, x):
        h = torch.tanh(self.enc(x))
        self.cache.append(h)
        return self.head(h)


def test_intermediate_kept_across_steps_is_found():
    model = Caching()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with guard(model, opt, live=False) as g:
        for _ in range(24):
            loss = model(torch.randn(8, 4)).pow(2).mean()
            opt.zero_grad()
            (loss * 0.5).backward()
            opt.step()
    assert [(f.kind, f.where) for f in g.findings] == [("loss-graph-retained", "model.cache")]


# --------------------------------------------------------------------------- AMP orders

def amp_run(order, global_mode, steps=6):
    model, model2 = mlp(), mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    opt2 = torch.optim.SGD(model2.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 20)  # fp16 overflows at first: skipped steps
    # (two losses: model2's own optimizer steps too, or its loss would train nothing: loss-disconnected)
    opts = [opt, opt2] if order in ("two-optimizers", "two-losses") else [opt]
    with (guard(live=False) if global_mode else guard([model, model2], opts, live=False)) as g:
        for _ in range(steps):
            x, y = torch.randn(8, 4), torch.randn(8, 1)
            for o in opts:
                o.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = F.mse_loss(model(x).float(), y)
                loss2 = F.mse_loss(model2(x).float(), y)
            if order == "two-losses":
                scaler.scale(loss).backward(retain_graph=True)
                scaler.scale(loss2).backward()
            elif order == "two-optimizers":
                scaler.scale(loss + loss2).backward()
            else:
                scaler.scale(loss).backward()
            if order in ("unscale-clip", "two-optimizers", "two-losses"):
                for o in opts:
                    scaler.unscale_(o)
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            for o in opts:
                scaler.step(o)
            scaler.update()
    return g


@pytest.mark.parametrize("global_mode", [False, True])
@pytest.mark.parametrize("order", ["plain", "unscale-clip", "two-optimizers", "two-losses"])
def test_gradscaler_skipped_steps_are_never_errors(order, global_mode):
    g = amp_run(order, global_mode)
    assert [f for f in g.findings if f.severity == "error"] == []
    assert any(e.get("skipped") for e in g.timeline)


# --------------------------------------------------------------------------- global mode origin

class Standardize(nn.Module):
    def forward(self, x):
        return (x - x.mean(0)) / x.std(0)  # a constant column: 0/0


def standardize_run(global_mode, crit_kind):
    torch.manual_seed(0)
    model = nn.Sequential(Standardize(), nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    crit = nn.MSELoss() if crit_kind == "mse" else nn.CrossEntropyLoss()
    with (guard(live=False) if global_mode else guard(model, opt, live=False)) as g:
        for step in range(4):
            x = torch.randn(8, 4)
            if step == 2:
                x[:, 1] = 3.0
            out = model(x)
            target = torch.randn(8, 3) if crit_kind == "mse" else torch.randint(0, 3, (8,))
            loss = crit(out.view(-1, 3), target)
            opt.zero_grad()
            loss.backward()
            opt.step()
    return g


@pytest.mark.parametrize("crit_kind", ["mse", "ce"])
def test_global_mode_names_the_module_of_origin_not_the_loss(crit_kind):
    model_mode = standardize_run(False, crit_kind).findings[0]
    global_mode = standardize_run(True, crit_kind).findings[0]
    assert (global_mode.kind, global_mode.where, global_mode.step) == ("nonfinite-output", "0", 2)
    assert (model_mode.kind, model_mode.where, model_mode.source) == (global_mode.kind, global_mode.where,
                                                                      global_mode.source)


def test_global_mode_nan_target_is_still_dirty_data():
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with guard(live=False) as g:
        for step in range(3):
            y = torch.randn(8, 1)
            if step == 1:
                y[0] = float("nan")
            loss = nn.MSELoss()(model(torch.randn(8, 4)), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
    assert (g.findings[0].kind, g.findings[0].step) == ("nonfinite-input", 1)
    assert "MSELoss" in g.findings[0].message


# --------------------------------------------------------------------------- source lines

def test_frames_of_libraries_are_not_the_users():
    from guard import _frames
    import json

    assert _frames._skipped(json.__file__)  # the standard library
    assert _frames._skipped(os.path.join(os.sep, "x", "site-packages", "lightning", "pytorch", "loops", "fit.py"))
    assert not _frames._skipped(__file__)


# --------------------------------------------------------------------------- crashes

def test_a_crashed_training_step_is_not_an_evaluation():
    model = mlp(out=3)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    g = guard(model, opt, live=False)
    with pytest.raises((IndexError, RuntimeError)):
        with g:
            for step in range(4):
                y = torch.randint(0, 3, (8,))
                if step == 2:
                    y[0] = 5
                loss = F.cross_entropy(model(torch.randn(8, 4)), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
    assert [f.kind for f in g.findings] == ["target-out-of-range"]
