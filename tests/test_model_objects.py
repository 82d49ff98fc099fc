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
                owner = getattr(getattr(h, "__wrapped__", h), "__self__", None)  # hooks wrapped by hooks._eager_only
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


# ----------------------------------------------------------------------------- guard.wrap is transparent

_HOOKED: list = []


def _hook(tag):
    def h(*args, **kwargs):
        _HOOKED.append(tag)
    return h


def _init_constant(m):
    for p in m.parameters(recurse=False):
        with torch.no_grad():
            p.fill_(0.5)


def _x():
    return torch.ones(4, 3)


def _unwrapped(o):
    return o.__dict__.get("_guard_model", o)


def _backward(o):
    o.train()
    o(_x()).sum().backward()


# Every public nn.Module method: how to call it on the model or on its wrapper (same call, both sides).
API = {
    "add_module": lambda o: o.add_module("extra", nn.Linear(1, 1)),
    "apply": lambda o: o.apply(_init_constant),
    "bfloat16": lambda o: o.bfloat16(),
    "buffers": lambda o: list(o.buffers()),
    "children": lambda o: list(o.children()),
    # compiled where it is called (the wrapper compiles its own call, never the model's: no recursion)
    "compile": lambda o: (o.compile(backend="eager"), o.__dict__.get("_compiled_call_impl") is not None,
                          _unwrapped(o).__dict__.get("_compiled_call_impl") is None or o is _unwrapped(o)),
    "cpu": lambda o: o.cpu(),
    "cuda": lambda o: o.cuda(),
    "double": lambda o: o.double(),
    "eval": lambda o: o.eval(),
    "extra_repr": lambda o: o.extra_repr(),
    "float": lambda o: o.half().float(),
    "forward": lambda o: o.forward(_x()),
    "get_buffer": lambda o: o.get_buffer("mean"),
    "get_extra_state": lambda o: o.get_extra_state(),
    "get_parameter": lambda o: (o.get_parameter("scale"), o.get_parameter("lin.weight")),
    "get_submodule": lambda o: (o.get_submodule("lin"), o.get_submodule("")),
    "half": lambda o: o.half(),
    "ipu": lambda o: o.ipu(),
    "load_state_dict": lambda o: o.load_state_dict({k: v + 1 for k, v in o.state_dict().items()}),
    "modules": lambda o: list(o.modules()),
    "mtia": lambda o: o.mtia(),
    "named_buffers": lambda o: list(o.named_buffers()),
    "named_children": lambda o: list(o.named_children()),
    "named_modules": lambda o: list(o.named_modules()),
    "named_parameters": lambda o: list(o.named_parameters()),
    "parameters": lambda o: list(o.parameters()),
    "register_backward_hook": lambda o: (o.register_backward_hook(_hook("bw")), _backward(o)),
    "register_buffer": lambda o: (o.register_buffer("extra", torch.ones(2)), o.get_buffer("extra")),
    "register_forward_hook": lambda o: (o.register_forward_hook(_hook("fw")), o(_x())),
    "register_forward_pre_hook": lambda o: (o.register_forward_pre_hook(_hook("pre")), o(_x())),
    "register_full_backward_hook": lambda o: (o.register_full_backward_hook(_hook("fbw")), _backward(o)),
    "register_full_backward_pre_hook": lambda o: (o.register_full_backward_pre_hook(_hook("fbwpre")), _backward(o)),
    "register_load_state_dict_post_hook": lambda o: (o.register_load_state_dict_post_hook(_hook("lpost")),
                                                     o.load_state_dict(o.state_dict())),
    "register_load_state_dict_pre_hook": lambda o: (o.register_load_state_dict_pre_hook(_hook("lpre")),
                                                    o.load_state_dict(o.state_dict())),
    "register_module": lambda o: o.register_module("extra", nn.ReLU()),
    "register_parameter": lambda o: (o.register_parameter("extra", nn.Parameter(torch.ones(2))),
                                     o.get_parameter("extra")),
    "register_state_dict_post_hook": lambda o: (o.register_state_dict_post_hook(_hook("spost")), o.state_dict()),
    "register_state_dict_pre_hook": lambda o: (o.register_state_dict_pre_hook(_hook("spre")), o.state_dict()),
    "requires_grad_": lambda o: o.requires_grad_(False),
    "set_extra_state": lambda o: o.set_extra_state({}),
    "set_submodule": lambda o: o.set_submodule("out", nn.Linear(4, 2)),
    "share_memory": lambda o: o.share_memory(),
    "state_dict": lambda o: o.state_dict(),
    "to": lambda o: o.to(torch.float64),
    "to_empty": lambda o: o.to_empty(device="meta"),
    "train": lambda o: o.train(False),
    "type": lambda o: o.type(torch.float64),
    "xpu": lambda o: o.xpu(),
    "zero_grad": lambda o: (_backward(o), o.zero_grad()),
}
_NOT_METHODS = {"T_destination", "dump_patches", "call_super_init"}


def _norm(value, obj, names, top=True):
    """A comparable form of a call's result: the object itself, module paths, tensor contents.

    The wrapper returns itself where the model returns itself (``w.half() is w``); in what it lists
    (``modules()``, ``get_submodule("")``) the model is the root, as in the model's own listing.
    """
    if value is obj and top:
        return "self"
    if value is obj or (isinstance(value, nn.Module) and names.get(id(value)) == ""):
        return "root"
    if isinstance(value, nn.Module):
        return ("module", names.get(id(value), type(value).__name__))
    if isinstance(value, torch.Tensor):
        return ("tensor", value.dtype, value.device.type, tuple(value.shape),
                None if value.is_meta else value.detach().float().tolist())
    if isinstance(value, (list, tuple)):
        return type(value).__name__, [_norm(v, obj, names, False) for v in value]
    if isinstance(value, dict):
        return {k: _norm(v, obj, names, False) for k, v in value.items()}
    if type(value).__name__ == "_IncompatibleKeys":
        return ("keys", list(value.missing_keys), list(value.unexpected_keys))
    return repr(value) if not hasattr(value, "__dict__") else type(value).__name__


def _outcome(name, obj, model):
    """What the user sees after calling `name` on `obj` (the model or its wrapper) of `model`."""
    names = {id(m): p for p, m in model.named_modules()}
    del _HOOKED[:]
    torch.manual_seed(1)  # modules created by the call start alike
    try:
        result = ("returned", _norm(API[name](obj), obj, names))
    except Exception as exc:  # e.g. .cuda() without a GPU: the same error both ways
        result = ("raised", type(exc).__name__)
    state = {k: _norm(v, None, names) for k, v in model.state_dict(keep_vars=True).items()}
    params = [(n, p.dtype, p.requires_grad, p.grad is None, p.is_shared())
              for n, p in model.named_parameters()]
    buffers = [(n, b.dtype, b.is_shared()) for n, b in model.named_buffers()]
    modules = [(p, type(m).__name__, m.training) for p, m in model.named_modules()]
    return result, state, params, buffers, modules, list(_HOOKED)


def test_api_table_covers_every_public_module_method():
    public = {n for n in dir(nn.Module) if not n.startswith("_")} - _NOT_METHODS
    assert public == set(API), "nn.Module's public API changed: add the new methods to API"


@pytest.mark.parametrize("name", sorted(API))
def test_wrapper_behaves_as_the_model_in_every_module_method(name):
    torch.manual_seed(0)
    plain = Root()
    model = copy.deepcopy(plain)
    w = guard_pkg.wrap(model, live=False)
    try:
        expected = _outcome(name, plain, plain)
        got = _outcome(name, w, model)
    finally:
        w.guard.close()
    assert got == expected
    assert not w.guard.internal_errors


# ----------------------------------------------------------------------------- interrupted forwards

class _Abort(BaseException):
    """Not an Exception: torch runs no always-called hooks for it (as for KeyboardInterrupt)."""


class Interrupted(nn.Module):
    def __init__(self, exc):
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.inner = nn.Sequential(nn.Linear(3, 3), nn.ReLU())
        self.exc = exc

    def forward(self, x):
        x = self.inner(self.lin(x))
        if self.exc is not None:
            exc, self.exc = self.exc, None
            raise exc  # deep inside the call: root and children are in flight
        return x


@pytest.mark.parametrize("exc", [KeyboardInterrupt, _Abort, SystemExit])
@pytest.mark.parametrize("scope", ["global", "model"])
def test_ctrl_c_inside_a_forward_does_not_blind_the_guard(exc, scope):
    model = Interrupted(exc)
    g = guard(model if scope == "model" else None, live=False).start()
    try:
        with pytest.raises(exc):
            model(torch.ones(2, 3))  # Ctrl-C in a notebook cell, mid-forward
        model(torch.full((2, 3), float("inf")))
        g.flush()
        assert [(f.kind, f.where) for f in g.findings] == [("nonfinite-input", "input")]
    finally:
        g.close()


def test_interrupted_child_call_leaves_its_enclosing_call_nested():
    """A BaseException caught inside a forward: later calls of that forward are still nested, the next
    outer call is a root again."""
    class Catches(nn.Module):
        def __init__(self):
            super().__init__()
            self.child = Interrupted(_Abort)

        def forward(self, x):
            try:
                self.child(x)
            except _Abort:
                pass
            return self.child.lin(x)

    model = Catches()
    with guard(live=False) as g:
        model(torch.ones(2, 3))
        model(torch.full((2, 3), float("nan")))
        g.flush()
        assert [(f.kind, f.where) for f in g.findings] == [("nonfinite-input", "input")]


# ----------------------------------------------------------------------------- deep models

class Nest(nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(x)


def _nested(levels):
    m = nn.Linear(2, 2)
    for _ in range(levels):
        m = Nest(m)
    return m


def _deepest(scope):
    """The deepest nesting whose forward runs (binary search), plain or under a guard."""
    lo, hi = 50, 700
    errors = []
    while lo < hi:
        mid = (lo + hi + 1) // 2
        model = _nested(mid)
        g = None if scope == "plain" else guard(model if scope == "model" else None, live=False).start()
        try:
            model(torch.ones(1, 2))
            ok = True
        except RecursionError:
            ok = False
        finally:
            if g is not None:
                g.close()
                errors += g.internal_errors
        lo, hi = (mid, hi) if ok else (lo, mid - 1)
    return lo, errors


@pytest.mark.parametrize("scope", ["model", "global"])
def test_model_nested_as_deep_as_plain_pytorch_runs_guarded(scope):
    limit = sys.getrecursionlimit()
    plain, _ = _deepest("plain")
    guarded, errors = _deepest(scope)
    assert plain - 2 <= guarded <= plain + 8, (plain, guarded)  # torch's hooked calls nest one frame deeper
    assert errors == []
    assert sys.getrecursionlimit() == limit  # put back on close


# --------------------------------------------------------------------------- models never called whole

class Parts(nn.Module):
    """A wrapper whose forward the loop never calls: it calls the parts itself."""

    def __init__(self):
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(8, 16), nn.Tanh())
        self.head = nn.Linear(16, 8)


def _parts(kind):
    torch.manual_seed(0)
    if kind == "moduledict":
        m = nn.ModuleDict({"encoder": nn.Sequential(nn.Linear(8, 16), nn.Tanh()), "head": nn.Linear(16, 8)})
    else:
        m = Parts()
    return m, (lambda x: m["head"](m["encoder"](x))) if kind == "moduledict" else (lambda x: m.head(m.encoder(x)))


@pytest.mark.parametrize("kind", ["moduledict", "wrapper"])
@pytest.mark.parametrize("bug, expected", [
    ("no-zero-grad", ("missing-zero-grad", "SGD", 1)),
    ("zero-grad-before-step", ("zero-grad-before-step", "SGD", 0)),
    ("disconnected", ("loss-disconnected", "loss", 0)),
    ("total", ("loss-graph-retained", "total", 0)),
    ("nan-input", ("nonfinite-input", "input", 3)),
    (None, None),
])
def test_a_model_whose_parts_the_loop_calls_is_watched_as_if_called(kind, bug, expected):
    m, forward = _parts(kind)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    total = 0
    with guard(m, opt, live=False) as g:
        for step in range(6):
            x = torch.randn(16, 8)
            if bug == "nan-input" and step == 3:
                x[2, 1] = float("nan")
            loss = nn.functional.mse_loss(forward(x), x)
            if bug == "disconnected":
                loss = torch.tensor(loss.item(), requires_grad=True)
            if bug == "total":
                total += loss
            if bug != "no-zero-grad":
                opt.zero_grad()
            loss.backward()
            if bug == "zero-grad-before-step":
                opt.zero_grad()
            opt.step()
    got = [(f.kind, f.where, f.step) for f in g.findings if f.severity != "info"]
    assert got == ([expected] if expected else []) and g.internal_errors == []


def test_a_part_called_alone_before_the_model_is_no_model_call_inside_it():
    """`model.encoder(dummy)` to infer a shape, then `model(x)`: the encoder's later calls are nested in the
    model's, so a NaN input is reported once, at its step, as the model's input."""

    class Net(Parts):
        def forward(self, x):
            return self.head(self.encoder(x))

    torch.manual_seed(0)
    m = Net()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    with guard(m, opt, live=False) as g:
        with torch.no_grad():
            m.encoder(torch.zeros(1, 8))
        for step in range(5):
            x = torch.randn(16, 8)
            if step == 3:
                x[0, 0] = float("inf")
            loss = nn.functional.mse_loss(m(x), x)
            opt.zero_grad()
            loss.backward()
            opt.step()
    [f] = [f for f in g.findings if f.kind.startswith("nonfinite")]
    assert (f.kind, f.where, f.step, f.count) == ("nonfinite-input", "input", 3, 1)
    assert g.report()["steps"] == 5
