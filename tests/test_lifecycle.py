"""Everything installed is removed; objects are released; dumps are written on every exit path."""
import gc
import json
import os
import signal
import subprocess
import sys
import textwrap
import weakref

import pytest
import torch
from torch import nn
from torch.nn.modules import module as module_mod
from torch.optim import optimizer as optim_mod

from guard import guard
from guard import hooks as guard_hooks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def global_state():
    return {
        "fwd_pre": dict(module_mod._global_forward_pre_hooks),
        "fwd": dict(module_mod._global_forward_hooks),
        "fwd_always": dict(module_mod._global_forward_hooks_always_called),
        "bwd": dict(module_mod._global_backward_hooks),
        "registration": dict(getattr(module_mod, "_global_module_registration_hooks", {})),
        "opt_pre": dict(optim_mod._global_optimizer_pre_hooks),
        "opt_post": dict(optim_mod._global_optimizer_post_hooks),
        "autograd.backward": torch.autograd.backward,
        "Tensor.backward": torch.Tensor.backward,
        "DataLoader.__iter__": torch.utils.data.DataLoader.__dict__.get("__iter__"),
        "load_state_dict": nn.Module.__dict__.get("load_state_dict"),
        "Module.zero_grad": nn.Module.__dict__.get("zero_grad"),
        "Optimizer.zero_grad": torch.optim.Optimizer.__dict__.get("zero_grad"),
        "F": {k: v for k, v in vars(nn.functional).items() if callable(v)},
        "torch.load": torch.load,
    }


def module_hook_counts(model):
    return [(len(m._forward_pre_hooks), len(m._forward_hooks)) for m in model.modules()]


def train_briefly(model, opt):
    for _ in range(2):
        loss = model(torch.randn(4, 4)).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()


@pytest.mark.parametrize("scope", ["model", "global"])
@pytest.mark.parametrize("checks", ["default", "all"])
def test_exit_restores_every_hook_and_patch(scope, checks):
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before, hooks_before = global_state(), module_hook_counts(model)
    args = (model, opt) if scope == "model" else ()
    with guard(*args, checks=checks, live=False):
        train_briefly(model, opt)
        assert torch.autograd.backward is not before["autograd.backward"]
        model.append(nn.Identity())  # a layer added mid-run is hooked too (model mode): and unhooked at exit
        train_briefly(model, opt)
    hooks_before.append((0, 0))
    assert global_state() == before
    assert module_hook_counts(model) == hooks_before
    assert opt._optimizer_step_pre_hooks == {} and opt._optimizer_step_post_hooks == {}
    assert guard_hooks.active_patches() == []


def test_model_optimizer_and_guard_are_garbage_collected():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with guard(model, opt, checks="all", live=False) as g:
        train_briefly(model, opt)
    refs = [weakref.ref(model), weakref.ref(opt)]
    del model, opt
    gc.collect()
    assert [r() for r in refs] == [None, None]
    gref = weakref.ref(g)
    del g
    gc.collect()
    assert gref() is None


def test_nested_guards_both_see_events_and_unwind_in_any_order():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    before = global_state()
    outer = guard(live=False).start()
    inner = guard(model, opt, live=False).start()
    x = torch.randn(2, 4)
    x[0, 0] = float("nan")
    model(x).sum().backward()
    opt.step()
    outer.close()  # closing out of order must not break the inner guard
    model(x).sum().backward()
    opt.step()
    inner.close()
    assert global_state() == before
    assert outer.findings[0].kind == "nonfinite-input"
    f = inner.findings[0]
    assert f.kind == "nonfinite-input" and f.count == 2


def test_two_guards_on_two_models_keep_their_findings_apart():
    a = nn.Sequential(nn.Linear(4, 1))
    b = nn.Sequential(nn.Linear(4, 1))
    oa, ob = torch.optim.SGD(a.parameters(), lr=0.1), torch.optim.SGD(b.parameters(), lr=0.1)
    with guard(a, oa, live=False) as ga, guard(b, ob, live=False) as gb:
        x = torch.randn(2, 4)
        bad = x.clone()
        bad[0, 0] = float("inf")
        a(x).sum().backward()
        oa.step()
        b(bad).sum().backward()
    assert ga.findings == []
    assert gb.findings[0].kind == "nonfinite-input"


def test_reentering_many_times_leaks_no_hooks():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = global_state()
    for _ in range(200):
        with guard(model, opt, live=False):
            model(torch.randn(2, 4)).sum().backward()
            opt.step()
    assert global_state() == before
    assert module_hook_counts(model) == [(0, 0)] * 3


# ---------------------------------------------------------------- dumps on every exit path

SCRIPT = textwrap.dedent("""
    import os, signal, sys, time
    import torch
    from torch import nn
    from guard import guard
    how = sys.argv[1]
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    def step(s):
        x = torch.randn(2, 4)
        if s == 1:
            x[0, 0] = float("nan")
        model(x).sum().backward(); opt.step(); opt.zero_grad()
    if how == "atexit":
        g = guard(model, opt, report=sys.argv[2], live=False).start()
        for s in range(3): step(s)
        sys.exit(0)
    with guard(model, opt, report=sys.argv[2], live=False):
        for s in range(3): step(s)
        if how == "exception": raise ValueError("user bug")
        if how == "interrupt": raise KeyboardInterrupt
        if how == "sigterm":
            print("ready", flush=True); time.sleep(30)
        if how == "exit": sys.exit(3)
""")


@pytest.mark.parametrize("how, code", [("normal", 0), ("exception", 1), ("interrupt", -signal.SIGINT), ("exit", 3),
                                       ("atexit", 0), ("sigterm", -signal.SIGTERM)])
def test_dump_is_written_on_every_exit(tmp_path, how, code):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    report = tmp_path / "report.json"
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    env.pop("TORCH_GUARD", None)
    proc = subprocess.Popen([sys.executable, str(script), how, str(report)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if how == "sigterm":
        assert proc.stdout.readline().strip() == "ready"
        proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == code, err
    data = json.loads(report.read_text())
    assert data["schema"] == "guard-report/1"
    assert data["steps"] == 3
    assert data["findings"][0]["kind"] == "nonfinite-input" and data["findings"][0]["step"] == 1
    assert not list(tmp_path.glob(".report.json.*.tmp"))  # atomic: no temp file left


def test_report_contents_follow_the_schema(tmp_path):
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    path = tmp_path / "r.json"
    with guard(model, opt, report=path, live=False) as g:
        train_briefly(model, opt)
    data = json.loads(path.read_text())
    assert set(data) >= {"schema", "created", "environment", "config", "steps", "findings", "timeline", "modules"}
    env = data["environment"]
    assert env["torch"] == torch.__version__ and "python" in env and "platform" in env and "cpu" in env["devices"]
    assert data["config"]["mode"] == "warn" and data["steps"] == 2
    assert [e["step"] for e in data["timeline"]] == [0, 1]
    assert all(isinstance(e["loss"], float) and isinstance(e["grad_norm"], float) for e in data["timeline"])
    mods = {m["path"]: m for m in data["modules"]}
    assert mods["0"] == {"path": "0", "type": "Linear", "output_shape": [4, 4], "dtype": "torch.float32",
                         "device": "cpu", "params": 20}
    assert mods["Sequential"]["params"] == 25
    assert g.report_path == str(path)


def test_unwritable_report_path_is_one_message_and_training_goes_on(tmp_path, capsys):
    # A missing folder is refused at start (issue 15); one that disappears during the run: one message at exit.
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    folder = tmp_path / "out"
    folder.mkdir()
    with guard(model, opt, report=folder / "r.json", live=False) as g:
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
        folder.rmdir()
    assert g.report_error and "could not write the report" in capsys.readouterr().err
    assert g.step == 1


def test_html_suffix_writes_html(tmp_path):
    model = nn.Linear(4, 1)
    path = tmp_path / "r.html"
    with guard(model, report=path, live=False):
        x = torch.randn(2, 4)
        x[0, 0] = float("nan")
        model(x).sum().backward()
    text = path.read_text()
    assert text.startswith("<!doctype html>") and "nonfinite-input" in text


def test_a_guard_entered_again_inside_its_own_with_block_keeps_watching_until_the_outer_block_ends():
    """`with g:` inside `with g:` (or a decorated function that calls itself): the inner end does not close it."""
    import torch.nn.functional as F

    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = guard(model, opt, live=False)

    def nan_step():
        opt.zero_grad()
        F.mse_loss(model(torch.full((2, 4), float("nan"))), torch.zeros(2, 1)).backward()
        opt.step()

    with g:
        with g:
            nan_step()
        assert g.active
        nan_step()  # still seen: the same finding, counted again
    assert not g.active
    (f,) = [f for f in g.findings if f.kind == "nonfinite-input"]
    assert f.count == 2 and f.last_step == 1

    @guard(model, opt, live=False)
    def fit(n):
        if n:
            fit(n - 1)
        nan_step()

    fit(2)
    assert not fit.guard.active and [f.count for f in fit.guard.findings if f.kind == "nonfinite-input"] == [3]


def test_a_guard_starting_while_an_optimizer_runs_its_step_hooks_breaks_no_step():
    """Another thread's guard starting or ending while this thread's optimizer is inside torch's loop over the
    global step hooks must not change the dict under it ("OrderedDict mutated during iteration" in the user's
    step). Here the other guard starts and ends from inside that loop, in one thread, which makes it certain."""
    model, other = nn.Linear(4, 1), nn.Linear(4, 1)
    opt, other_opt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(other.parameters(), lr=0.1)
    guards = []

    def start_another(optimizer, args, kwargs):
        if optimizer is opt and not guards:
            guards.append(guard(other, other_opt, live=False).start())
            guards[0].close()

    handle = optim_mod.register_optimizer_step_pre_hook(start_another)
    try:
        with guard(model, opt, live=False) as g:
            model(torch.randn(2, 4)).sum().backward()
            opt.step()  # raised "OrderedDict mutated during iteration" when each guard had its own global hooks
        assert g.step == 1 and guards and g.internal_errors == []
    finally:
        handle.remove()


def test_a_guard_starting_while_torch_runs_its_module_registration_hooks_breaks_no_assignment():
    """The same for the module-registration hook (which names layers added mid-run): torch loops over its
    table while a submodule is assigned; another guard starting and ending then must not change that table."""
    model, other = nn.Sequential(nn.Linear(4, 4)), nn.Linear(4, 1)
    guards = []

    def start_another(parent, name, module):
        if parent is model and not guards:
            guards.append(guard(other, live=False).start())
            guards[0].close()

    handle = module_mod.register_module_module_registration_hook(start_another)
    try:
        with guard(model, live=False) as g:
            model(torch.randn(2, 4))
            model.append(nn.Linear(4, 2))  # raised "OrderedDict mutated during iteration" with one hook per guard
            model(torch.randn(2, 4))
        assert guards and g.internal_errors == [] and g.watched.known_path(model[1]) == "1"
    finally:
        handle.remove()


def test_a_global_guard_starting_while_torch_runs_its_global_forward_hooks_breaks_no_module_call():
    """The same for a global guard's forward hooks (``guard()`` with no model, as under ``TORCH_GUARD=1``). torch
    copies its global hook tables before a module call, but loops over the live one to run the always-called hooks
    after a forward that raised; another global guard starting and ending there must not change it under the loop
    (the user would see "OrderedDict mutated during iteration" instead of their own error)."""

    class Fails(nn.Module):
        def forward(self, x):
            raise ValueError("the user's own error")

    model = Fails()
    guards = []

    def start_another(module, args, result):
        if module is model and not guards:
            guards.append(guard(live=False).start())
            guards[0].close()

    handle = module_mod.register_module_forward_hook(start_another, always_call=True)
    try:
        with guard(live=False) as g:
            with pytest.raises(ValueError, match="the user's own error"):
                model(torch.randn(2, 4))
        assert guards and g.internal_errors == []
    finally:
        handle.remove()
    assert not module_mod._global_forward_hooks and not getattr(module_mod, "_global_forward_hooks_with_kwargs", {})
