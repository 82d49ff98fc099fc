"""Reliability: guard never changes the training it watches, contains its own faults, leaves nothing behind,
works across threads and odd models, stays bounded on long runs, and refuses bad configuration in one line."""
import contextlib
import gc
import importlib
import os
import pkgutil
import threading
import warnings
import weakref

import pytest
import torch
from torch import nn

import demos
import guard as guard_pkg
from guard import GuardInternalWarning, guard
from guard import hooks as guard_hooks
from guard.checks import registry
from guard.config import ConfigError, env_options
from tests import healthy
from tests.test_lifecycle import global_state, module_hook_counts

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMOS = sorted(m.name for m in pkgutil.iter_modules(demos.__path__) if m.name not in ("tour",) and not m.name.startswith("_"))


def fingerprint(model, opt=None):
    """Everything guard must leave as it was: parameters and buffers (bit-for-bit), requires_grad, modes, RNG."""
    return {
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
        "buffers": {n: b.detach().clone() for n, b in model.named_buffers()},
        "requires_grad": {n: p.requires_grad for n, p in model.named_parameters()},
        "training": [m.training for m in model.modules()],
        "rng": torch.get_rng_state(),
        "opt_state": None if opt is None else [
            {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in s.items()} for s in opt.state.values()],
    }


def assert_same(a, b):
    assert a.keys() == b.keys()
    for key in ("params", "buffers"):
        assert a[key].keys() == b[key].keys()
        for n in a[key]:
            ta, tb = a[key][n], b[key][n]
            if ta.is_meta or tb.is_meta:  # no values to compare on the meta device
                assert (ta.shape, ta.dtype, ta.device) == (tb.shape, tb.dtype, tb.device), f"{key} {n} differs"
            else:
                assert torch.equal(ta, tb), f"{key} {n} differs"
    assert a["requires_grad"] == b["requires_grad"] and a["training"] == b["training"]
    assert torch.equal(a["rng"], b["rng"])
    if a["opt_state"] is not None:
        for sa, sb in zip(a["opt_state"], b["opt_state"]):
            assert sa.keys() == sb.keys()
            for k in sa:
                va, vb = sa[k], sb[k]
                assert torch.equal(va, vb) if isinstance(va, torch.Tensor) else va == vb


# ---------------------------------------------------------------- numerics unchanged

def run_demo(name, use_guard, monkeypatch):
    """Run a clean demo (fixed=True) with the real guard or with none; return its model/optimizer fingerprint."""
    mod = importlib.import_module(f"demos.{name}")
    seen = {}
    real = guard  # the real one (mod.guard may still be a previous run's stand-in)

    def recording_guard(model=None, optimizer=None, **opts):
        seen["model"], seen["opt"] = model, optimizer
        return real(model, optimizer, **opts) if use_guard else contextlib.nullcontext(None)

    monkeypatch.setattr(mod, "guard", recording_guard)
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", GuardInternalWarning)
        g = mod.train(fixed=True, live=False, checks="all")
    if "model" not in seen:
        pytest.skip(f"demo {name} does not call guard(model, optimizer)")
    model = seen["model"] if isinstance(seen["model"], nn.Module) else nn.ModuleList(seen["model"])
    opt = seen["opt"] if isinstance(seen["opt"], torch.optim.Optimizer) else None
    return g, fingerprint(model, opt)


@pytest.mark.parametrize("name", DEMOS)
def test_clean_demo_numerics_unchanged_by_guard(name, monkeypatch):
    _, plain = run_demo(name, False, monkeypatch)
    g, guarded = run_demo(name, True, monkeypatch)
    assert_same(plain, guarded)
    assert g.findings == [] and g.internal_errors == []


@pytest.mark.parametrize("name", healthy.NAMES)
def test_healthy_script_numerics_unchanged_by_guard(name):
    torch.manual_seed(0)
    _, m0 = healthy.load(name).train(use_guard=False)
    plain = fingerprint(m0)
    torch.manual_seed(0)
    g, m1 = healthy.load(name).train(checks="all", live=False)
    assert_same(plain, fingerprint(m1))
    assert g.internal_errors == []


def graph_signature(t):
    """The autograd graph below `t`, as node type names (breadth first)."""
    out, todo, seen = [], [t.grad_fn], set()
    while todo:
        fn = todo.pop(0)
        if fn is None or id(fn) in seen:
            continue
        seen.add(id(fn))
        out.append(type(fn).__name__)
        todo.extend(f for f, _ in fn.next_functions)
    return out


def test_autograd_graph_is_unchanged_by_guard():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 2))
    x = torch.randn(2, 3, 8, 8)
    plain = graph_signature(nn.functional.cross_entropy(model(x), torch.tensor([0, 1])))
    with guard(model, checks="all", live=False):
        guarded = graph_signature(nn.functional.cross_entropy(model(x), torch.tensor([0, 1])))
    assert guarded == plain


# ---------------------------------------------------------------- containment

class Tagged(torch.Tensor):
    """A plain tensor subclass."""


class Logged(torch.Tensor):
    """A __torch_function__ subclass."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        return super().__torch_function__(func, types, args, kwargs or {})


class SparseMM(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 3))

    def forward(self, x):
        return torch.sparse.mm(x, self.w) if x.layout is torch.sparse_coo else x @ self.w


class Dequant(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 3)

    def forward(self, x):
        return self.lin(x.dequantize())


class Scale(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Parameter(torch.tensor(0.5))

    def forward(self, x):
        return self.a * x


WEIRD = {
    "tensor-subclass": (lambda: nn.Linear(4, 3), lambda: torch.randn(8, 4).as_subclass(Tagged)),
    "torch-function-subclass": (lambda: nn.Linear(4, 3), lambda: torch.randn(8, 4).as_subclass(Logged)),
    "sparse-coo-input": (SparseMM, lambda: torch.randn(8, 4).relu().to_sparse()),
    "sparse-csr-input": (SparseMM, lambda: torch.randn(8, 4).relu().to_sparse_csr()),
    "quantized-input": (Dequant, lambda: torch.quantize_per_tensor(torch.randn(8, 4), 0.1, 0, torch.qint8)),
    "complex": (lambda: nn.Linear(4, 3, dtype=torch.cfloat), lambda: torch.randn(8, 4, dtype=torch.cfloat)),
    "zero-dim": (Scale, lambda: torch.tensor(2.0)),
    "empty-batch": (lambda: nn.Sequential(nn.Linear(4, 3), nn.ReLU()), lambda: torch.randn(0, 4)),
    "float64": (lambda: nn.Linear(4, 3).double(), lambda: torch.randn(8, 4, dtype=torch.float64)),
    "float16": (lambda: nn.Linear(4, 3).half(), lambda: torch.randn(8, 4).half()),
    "int-input": (lambda: nn.Embedding(10, 3), lambda: torch.randint(0, 10, (8,))),
    "sparse-grad": (lambda: nn.Embedding(10, 3, sparse=True), lambda: torch.randint(0, 10, (8,))),
    "nested-tensor": (lambda: nn.Linear(4, 3),
                      lambda: torch.nested.nested_tensor([torch.randn(2, 4), torch.randn(3, 4)])),
}


def weird_run(case, use_guard):
    make_model, make_input = WEIRD[case]
    torch.manual_seed(0)
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ctx = guard(model, opt, checks="all", live=False) if use_guard else contextlib.nullcontext()
    with ctx as g:
        for _ in range(3):
            out = model(make_input())
            if out.is_nested:
                loss = sum(t.sum() for t in out.unbind())
            else:
                loss = out.abs().sum() if out.is_complex() else out.sum()
            opt.zero_grad()
            loss.backward()
            opt.step()
    return g, fingerprint(model)


@pytest.mark.parametrize("case", sorted(WEIRD))
def test_weird_tensors_are_handled_without_internal_errors(case):
    _, plain = weird_run(case, False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        g, guarded = weird_run(case, True)
    assert g.internal_errors == [], g.internal_errors
    assert not [w for w in caught if issubclass(w.category, GuardInternalWarning)]
    assert [(f.kind, f.where) for f in g.findings] == []
    assert g.step == 3
    assert_same(plain, guarded)


def test_a_check_crashing_on_every_event_is_contained_once_and_changes_nothing(capsys):
    """Every handler of every active check raises: each check is switched off and named once; training as unguarded."""
    def make():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))

    def loop(model, opt):
        loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(24, 4), torch.randint(0, 3, (24,))),
                                             batch_size=8)
        for x, y in loader:
            loss = nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()

    m0 = make()
    o0 = torch.optim.Adam(m0.parameters(), lr=0.01)
    loop(m0, o0)
    m1 = make()
    o1 = torch.optim.Adam(m1.parameters(), lr=0.01)
    g = guard(m1, o1, checks="all", live=False)
    original_build = g._build_checks

    built = []

    def sabotage():
        original_build()
        built.extend(g.checks)
        for check in g.checks:
            for ev in check.events():
                if ev != "start":
                    setattr(check, "on_" + ev, lambda *a, _n=check.name, **k: (_ for _ in ()).throw(RuntimeError(f"bug in {_n}")))
        g.router.rebuild()

    g._build_checks = sabotage
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with g:
            loop(m1, o1)
    assert_same(fingerprint(m0, o0), fingerprint(m1, o1))
    names = [e["check"] for e in g.internal_errors]
    assert len(names) == len(set(names)) and len(names) >= 3
    assert all(f"bug in {e['check']}" in e["error"] for e in g.internal_errors)
    msgs = [str(w.message) for w in caught if issubclass(w.category, GuardInternalWarning)]
    assert len(msgs) == len(names) and all("\n" not in m and "switched off" in m for m in msgs)
    assert len(names) + len(g.checks) == len(built) and g.step == 3


# ---------------------------------------------------------------- clean-up

def saved_tensor_hooks():
    """The innermost autograd saved-tensor hooks pair of this thread (None when there are none)."""
    return torch._C._autograd._top_saved_tensors_default_hooks(False)


def patch_targets_state():
    """The current value of every shared function any check declares as a patch target."""
    out = {}
    for cls in registry().values():
        for target in cls.patches.values():
            owner, attr = guard_hooks._resolve_target(target)
            out[target] = (owner.__dict__.get(attr, "<absent>") if hasattr(owner, "__dict__") else None,
                           getattr(owner, attr, None))
    return out


@pytest.mark.parametrize("scope", ["model", "global"])
def test_all_checks_leave_no_hook_or_patch_behind(scope):
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, weight_decay=1e-4)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(16, 4), torch.randint(0, 3, (16,))),
                                         batch_size=8)
    before, targets, hooks_before = global_state(), patch_targets_state(), module_hook_counts(model)
    grad_hooks = [(dict(p._backward_hooks or {}), getattr(p, "_post_accumulate_grad_hooks", None)) for p in model.parameters()]
    with guard(*((model, opt) if scope == "model" else ()), checks="all", live=False):
        for x, y in loader:
            loss = nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
        model.load_state_dict(model.state_dict())
        assert guard_hooks.active_patches()
    assert global_state() == before
    assert patch_targets_state() == targets
    assert module_hook_counts(model) == hooks_before
    assert [(dict(p._backward_hooks or {}), getattr(p, "_post_accumulate_grad_hooks", None))
            for p in model.parameters()] == grad_hooks
    assert opt._optimizer_step_pre_hooks == {} and opt._optimizer_step_post_hooks == {}
    assert guard_hooks.active_patches() == []
    assert not any(getattr(v, "_guard_patch", False) for v in vars(nn.functional).values())
    assert saved_tensor_hooks() is None


def test_model_optimizer_and_dataloader_are_garbage_collected_after_all_checks():
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 3))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(16, 4), torch.randint(0, 3, (16,))),
                                         batch_size=8)
    with guard(model, opt, checks="all", live=False) as g:
        for x, y in loader:
            loss = nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
    refs = [weakref.ref(model), weakref.ref(opt), weakref.ref(loader)]
    del model, opt, loader, x, y, loss
    gc.collect()
    assert [r() for r in refs] == [None, None, None]
    assert g.step == 2  # the guard itself stays usable for reading


# ---------------------------------------------------------------- threads

def test_closing_from_another_thread_leaves_nothing_behind():
    """e.g. a guard started in the main thread and closed by a watchdog or atexit-like thread."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = global_state()
    g = guard(model, opt, checks="all", live=False).start()
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    t = threading.Thread(target=g.close)
    t.start()
    t.join(30)
    assert not g.active and global_state() == before and guard_hooks.active_patches() == []
    assert module_hook_counts(model) == [(0, 0)] * 4
    leftover = saved_tensor_hooks()
    if leftover is not None and "explain" in str(leftover).lower():
        torch._C._autograd._pop_saved_tensors_default_hooks()  # clean up for the tests that follow
        pytest.xfail("explain check's saved_tensors_hooks stay on the starting thread when closed from another "
                     "thread (thread-local stack); torch.func.grad then raises in that thread (issue 6)")
    assert leftover is None



def test_dataloader_workers_under_guard():
    """Worker processes inherit guard's patches by fork; training and the main guard are unaffected."""
    ds = torch.utils.data.TensorDataset(torch.randn(32, 4), torch.randint(0, 3, (32,)))
    loader = torch.utils.data.DataLoader(ds, batch_size=8, num_workers=2, shuffle=False)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with guard(model, opt, checks="all", live=False) as g:
        for x, y in loader:
            loss = nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
    assert g.step == 4 and g.findings == [] and g.internal_errors == []


def test_guards_in_two_threads_keep_their_findings_apart():
    results, errors = {}, []
    barrier = threading.Barrier(2)

    def worker(name, poison):
        try:
            torch.manual_seed(1)
            model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
            opt = torch.optim.SGD(model.parameters(), lr=0.01)
            with guard(model, opt, checks="all", live=False) as g:
                barrier.wait()
                for s in range(20):
                    x = torch.randn(4, 4)
                    if poison and s == 5:
                        x[0, 0] = float("nan")
                    loss = model(x).pow(2).mean()
                    opt.zero_grad()
                    loss.backward()
                    opt.step()
            results[name] = g
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(n, n == "dirty")) for n in ("clean", "dirty")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert errors == []
    clean, dirty = results["clean"], results["dirty"]
    assert clean.findings == [] and clean.internal_errors == [] and clean.step == 20
    assert [(f.kind, f.step) for f in dirty.findings][:1] == [("nonfinite-input", 5)]
    assert dirty.internal_errors == [] and dirty.step == 20
    assert guard_hooks.active_patches() == []



def _thread_loop(model, opt, seed, steps, barrier=None, poison_at=None, meet_at=None):
    gen = torch.Generator().manual_seed(seed)
    if barrier is not None:
        barrier.wait()
    for s in range(steps):
        if s == meet_at:  # both threads still train here, however the OS schedules them
            barrier.wait()
        x = torch.randn(16, 8, generator=gen)
        if s == poison_at:
            x[0, 0] = float("nan")
        loss = nn.functional.cross_entropy(model(x), torch.randint(0, 3, (16,), generator=gen))
        opt.zero_grad()
        loss.backward()
        opt.step()


@pytest.mark.parametrize("scope", ["models", "global"])
def test_one_guard_over_two_threads_training_at_once_follows_one(scope):
    """A threaded hyper-parameter search under TORCH_GUARD=1 (or one guard given both models): the guard
    follows the first thread that trains and leaves the other alone (a notice says so) instead of mixing their
    steps and reading one thread's gradients while the other's backward writes them (a crash, before)."""
    for attempt in range(3):  # the interleaving differs from run to run
        torch.manual_seed(attempt)
        models = [nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3)) for _ in range(2)]
        opts = [torch.optim.SGD(m.parameters(), lr=0.05) for m in models]
        barrier = threading.Barrier(2)
        g = guard(models if scope == "models" else None, opts if scope == "models" else None, live=False)
        with g:
            threads = [threading.Thread(target=_thread_loop, args=(m, o, i, 60, barrier), kwargs={"meet_at": 30})
                       for i, (m, o) in enumerate(zip(models, opts))]
            for t in threads:
                t.start()
            for t in threads:
                t.join(60)
        assert g.findings == [] and g.internal_errors == []
        assert any("this guard follows" in n for n in g.notices)
        # one thread's 60 steps (mixed threads would count up to 120); which thread is followed is decided
        # as both start, and the steps of that moment may go to the other one (a few, on a loaded machine)
        assert 50 <= g.step <= 60


def test_a_thread_left_alone_stays_left_alone_when_the_followed_one_ends_first():
    """Two trials of a threaded search at once: the slower one, left alone while the first trained, is not
    picked up halfway when the first ends (its steps would count on from the first's, its checks start mid-run)."""
    torch.manual_seed(0)
    models = [nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3)) for _ in range(2)]
    opts = [torch.optim.SGD(m.parameters(), lr=0.05) for m in models]
    first_stepped, slow_ran, first_done = threading.Event(), threading.Event(), threading.Event()

    def fast():
        _thread_loop(models[0], opts[0], 0, 1)
        first_stepped.set()
        slow_ran.wait(30)  # (on a loaded machine the first could end before the second starts)
        _thread_loop(models[0], opts[0], 1, 9)

    def slow():
        first_stepped.wait(30)
        _thread_loop(models[1], opts[1], 2, 1)  # while the first trains: left alone
        slow_ran.set()
        first_done.wait(30)
        _thread_loop(models[1], opts[1], 3, 20)  # after it ended

    with guard(models, opts, live=False) as g:
        a, b = threading.Thread(target=fast), threading.Thread(target=slow)
        a.start(), b.start()
        a.join(30)
        first_done.set()
        b.join(30)
    assert g.findings == [] and g.internal_errors == []
    assert g.step == 10
    assert any("this guard follows" in n for n in g.notices)
    assert not any("stepped" in n for n in g.notices)


def test_training_in_a_thread_started_by_the_guarding_thread_is_watched():
    """The guard in the main thread, the loop in a worker (the main thread only waits, then evaluates)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with guard(model, opt, live=False) as g:
        with torch.no_grad():
            model(torch.zeros(2, 8))  # a shape check in the main thread first
        t = threading.Thread(target=_thread_loop, args=(model, opt, 0, 8, None, 4))
        t.start()
        t.join(60)
        model.eval()
        with torch.no_grad():
            model(torch.randn(4, 8))
    assert [(f.kind, f.step) for f in g.findings] == [("nonfinite-input", 4)]
    assert g.step == 8 and g.notices == []


# ---------------------------------------------------------------- odd models

def _train(model, params_of=None, steps=3, x_shape=(4, 4), nan_at=None):
    opt = torch.optim.SGD((params_of or model).parameters(), lr=0.05)
    for s in range(steps):
        x = torch.randn(*x_shape)
        if s == nan_at:
            x[0, 0] = float("nan")
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return opt


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))


@pytest.mark.parametrize("scope", ["model", "global"])
def test_dataparallel_on_cpu(scope):
    inner = mlp()
    dp = nn.DataParallel(inner)
    with guard(*((dp,) if scope == "model" else ()), checks="all", live=False) as g:
        _train(dp, nan_at=1)
    assert [(f.kind, f.where, f.step) for f in g.findings][:1] == [("nonfinite-input", "input", 1)]
    assert g.internal_errors == []
    assert "module." not in " ".join(g.modules)  # paths are the inner model's


def test_torchscript_module():
    scripted = torch.jit.script(mlp())
    with guard(scripted, checks="all", live=False) as g:
        _train(scripted, nan_at=1)
    assert g.internal_errors == []
    kinds = [f.kind for f in g.findings]
    assert kinds and kinds[0].startswith("nonfinite-")  # a ScriptModule runs no Python hooks; the loss still shows it
    assert len(g.notices) == 1 and "TorchScript" in g.notices[0]
    scripted = torch.jit.script(mlp())  # the first one's weights are NaN now
    with guard(scripted, checks="all", live=False) as g2:
        _train(scripted)
    assert g2.findings == [] and g2.internal_errors == []


@pytest.mark.parametrize("global_guard", [False, True])
def test_torchscript_compiles_modules_and_functions_while_a_guard_is_active(global_guard):
    """guard's patched F.dropout and loss functions hand TorchScript the originals to compile (it compiled the
    wrappers' source and failed: 'undefined value has_torch_function_unary')."""
    import torch.nn.functional as F

    model = mlp()
    with guard(None if global_guard else model, live=False) as g:
        block = torch.jit.script(nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.1)))
        losses = [torch.jit.script(m) for m in (nn.MSELoss(), nn.CrossEntropyLoss(), nn.BCEWithLogitsLoss())]

        def fused(x: torch.Tensor, y: torch.Tensor, p: float, training: bool) -> torch.Tensor:
            return F.mse_loss(F.dropout(x, p, training), y) + F.cross_entropy(x, y.argmax(1))

        fn = torch.jit.script(fused)
        x = torch.randn(3, 4)
        out = block(x)
        value = fn(out, torch.randn(3, 4), 0.1, True) + losses[0](out, x)
        _train(model)
    assert out.shape == (3, 4) and value.dim() == 0
    assert torch.equal(torch.jit.script(fused)(x, x, 0.0, False), F.mse_loss(x, x) + F.cross_entropy(x, x.argmax(1)))
    assert g.internal_errors == [] and g.findings == []


def test_a_torchscript_block_inside_an_eager_model_is_named_in_a_notice():
    model = nn.Sequential(nn.Linear(4, 4), torch.jit.script(nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.1))),
                          nn.Linear(4, 1))
    with guard(model, live=False) as g:
        _train(model)
    assert g.findings == [] and g.internal_errors == []
    assert len(g.notices) == 1 and g.notices[0].startswith("guard: 1 is a TorchScript module inside the model")


def test_model_with_its_own_forward_hooks_keeps_them_and_their_effect():
    model = mlp()
    calls = []
    h1 = model[0].register_forward_hook(lambda m, a, out: out * 2)  # a hook that changes the output
    h2 = model.register_forward_pre_hook(lambda m, a: calls.append(1))
    before = module_hook_counts(model)
    with guard(model, checks="all", live=False) as g:
        out = model(torch.ones(1, 4))
    h1.remove()
    expect = model[2](model[1](model[0](torch.ones(1, 4)) * 2))
    assert torch.equal(out, expect) and len(calls) == 1
    assert g.findings == [] and g.internal_errors == []
    model[0].register_forward_hook(lambda m, a, out: out * 2)
    assert module_hook_counts(model) == before
    h2.remove()


def test_torch_func_vmap_and_functional_call():
    model = mlp()
    params = {k: v.detach() for k, v in model.named_parameters()}
    x = torch.randn(5, 3, 4)
    want = torch.func.vmap(model)(x)
    with guard(model, checks="all", live=False) as g:
        out = torch.func.vmap(model)(x)
        per_sample = torch.func.vmap(lambda xi: torch.func.functional_call(model, params, (xi,)))(x)
        loss = torch.func.functional_call(model, params, (x[0],)).sum()
        _train(model)
    assert torch.equal(out, want) and per_sample.shape == (5, 3, 1) and torch.isfinite(loss)
    assert g.findings == [] and g.internal_errors == []


@pytest.mark.parametrize("checks", [["nonfinite", "device-mismatch", "loss-fn", "batchnorm"], "all"])
def test_torch_func_grad_runs_under_guard(checks):
    model = mlp()
    params = {k: v.detach() for k, v in model.named_parameters()}
    x = torch.randn(3, 4)
    f = lambda p: torch.func.functional_call(model, p, (x,)).pow(2).sum()  # noqa: E731
    want = torch.func.grad(f)(params)
    with guard(model, checks=checks, live=False) as g:
        try:
            got = torch.func.grad(f)(params)
        except RuntimeError as exc:
            if "saved tensor hooks" in str(exc) and checks == "all":
                pytest.xfail("explain check's saved_tensors_hooks make torch.func.grad/vjp/jacrev raise (issue 6)")
            raise
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert g.findings == [] and g.internal_errors == []


@pytest.mark.parametrize("whole", [False, True], ids=["inside-forward", "whole-model"])
@pytest.mark.parametrize("scope", ["model", "global"])
@pytest.mark.parametrize("reentrant", [False, True])
def test_activation_checkpointing(reentrant, scope, whole):
    # The recomputation runs inside backward(): under a global guard it once looked like an outermost
    # call (guard's saved-tensor hooks went above checkpoint's: CheckpointError), and a reentrant
    # checkpoint of the whole model hid its parameters from the loss-disconnected walk (a false alarm).
    from torch.utils.checkpoint import checkpoint

    class Ckpt(nn.Module):
        def __init__(self):
            super().__init__()
            self.block = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 4))
            self.head = nn.Linear(4, 1)

        def forward(self, x):
            return self.head(checkpoint(self.block, x, use_reentrant=reentrant))

    def run(use_guard, nan_at=None):
        torch.manual_seed(0)
        model = Ckpt()
        watched = model if scope == "model" else None
        ctx = guard(watched, checks="all", live=False) if use_guard else contextlib.nullcontext()
        with ctx as g:
            x_shape = (4, 4)
            opt = torch.optim.SGD(model.parameters(), lr=0.05)
            for s in range(3):
                x = torch.randn(*x_shape, requires_grad=reentrant)
                if s == nan_at:
                    with torch.no_grad():
                        x[0, 0] = float("nan")
                out = checkpoint(model, x, use_reentrant=reentrant) if whole else model(x)
                loss = out.pow(2).mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
        return g, fingerprint(model)

    _, plain = run(False)
    g, guarded = run(True)
    assert_same(plain, guarded)
    assert g.findings == [] and g.internal_errors == []
    g2, _ = run(True, nan_at=1)
    assert [(f.kind, f.step) for f in g2.findings][:1] == [("nonfinite-input", 1)] and g2.internal_errors == []


def test_torch_compile_is_checked_at_the_boundary_and_says_once_what_it_cannot_see(capsys):
    """torch 2.13: hooks added after a compiled model's first call never run inside it; guard says so, once."""
    torch._dynamo.reset()
    model = mlp()
    compiled = torch.compile(model, backend="eager")  # no C compiler needed; same hook semantics as inductor
    _train(compiled)  # compiled before guard starts
    with guard(compiled, checks="all", live=False) as g:
        _train(compiled, steps=4, nan_at=1)
    err = capsys.readouterr().err
    assert [(f.kind, f.where, f.step) for f in g.findings][:1] == [("nonfinite-input", "input", 1)]
    assert g.internal_errors == []
    assert len(g.notices) == 1 and "torch.compile" in g.notices[0] and "for full checks" in g.notices[0].lower()
    assert err.count("runs under torch.compile") == 1
    assert g.report()["notices"] == g.notices
    # guarding the original module while the compiled wrapper runs: guard cannot see the calls, and says so
    with guard(model, checks="all", live=False) as g2:
        _train(compiled, steps=2)
    assert g2.internal_errors == [] and len(g2.notices) == 1 and "no call of the watched model" in g2.notices[0]
    torch._dynamo.reset()


def test_uncompiled_models_get_no_notice():
    with guard(mlp(), checks="all", live=False) as g:
        pass
    model = mlp()
    with guard(model, checks="all", live=False) as g:
        _train(model)
    assert g.notices == []


# ---------------------------------------------------------------- bad configuration

def one_line(exc_info, *needles):
    msg = str(exc_info.value)
    assert "\n" not in msg and "allowed" in msg, msg
    for n in needles:
        assert n in msg, (n, msg)


@pytest.mark.parametrize("kwargs, needles", [
    ({"checks": ["nonfinite", "-nosuch"]}, ["'nosuch'", "nonfinite"]),
    ({"checks": ["default", 3]}, ["3", "default"]),
    ({"checks": None}, ["None", "'default', 'all'"]),
    ({"mode": None}, ["mode=None", "warn, raise, record"]),
    ({"mode": 1}, ["mode=1", "warn, raise, record"]),
    ({"every": -2}, ["every=-2", "integer >= 1"]),
    ({"every": 1.5}, ["every=1.5", "integer >= 1"]),
    ({"every": True}, ["every=True", "integer >= 1"]),
    ({"every": None}, ["every=None", "integer >= 1"]),
    ({"live": 2}, ["live=2", "True, False"]),
    ({"report": 7}, ["report=7", "file path"]),
    ({"snoop": "perhaps"}, ["snoop='perhaps'", "0, 1"]),
    ({"chekcs": "all"}, ["unknown option chekcs='all'", "did you mean checks?", "mode, report"]),
    ({"verbose": True}, ["unknown option verbose=True", "checks, mode"]),
])
def test_more_bad_guard_arguments_give_one_clear_line(kwargs, needles):
    with pytest.raises(ConfigError) as info:
        guard(**kwargs)
    one_line(info, *needles)


@pytest.mark.parametrize("model, optimizer, needles", [
    (lambda: [nn.Linear(1, 1), "x"], lambda m: None, ["model=str", "nn.Module"]),
    (lambda: nn.Linear(1, 1), lambda m: [torch.optim.SGD(m.parameters(), lr=0.1), 3], ["optimizer=int", "Optimizer"]),
    (lambda: nn.Linear(1, 1), lambda m: m.parameters(), ["optimizer=generator", "Optimizer"]),
    (lambda: nn.Linear(1, 1).state_dict(), lambda m: None, ["model=", "nn.Module"]),
])
def test_non_modules_and_non_optimizers_name_the_type(model, optimizer, needles):
    m = model()
    with pytest.raises(ConfigError) as info:
        guard(m, optimizer(m) if isinstance(m, nn.Module) else None)
    one_line(info, *needles)


@pytest.mark.parametrize("args, kwargs, needles", [
    (("model",), {}, ["model=str", "nn.Module"]),
    ((None,), {}, ["model=NoneType", "nn.Module"]),
    ((nn.Linear(1, 1), "sgd"), {}, ["optimizer=str", "Optimizer"]),
    ((nn.Linear(1, 1),), {"mode": "loud"}, ["mode='loud'", "warn, raise, record"]),
    ((nn.Linear(1, 1),), {"checks": ["nope"]}, ["'nope'"]),
    ((nn.Linear(1, 1),), {"every": 0}, ["every=0"]),
    ((nn.Linear(1, 1),), {"moed": "raise"}, ["unknown option moed='raise'", "did you mean mode?"]),
])
def test_bad_wrap_arguments_give_one_clear_line(args, kwargs, needles):
    before = global_state()
    with pytest.raises(ConfigError) as info:
        guard_pkg.wrap(*args, **kwargs)
    one_line(info, *needles)
    assert global_state() == before and guard_hooks.active_patches() == []  # nothing half-installed


@pytest.mark.parametrize("env, needles", [
    ({"TORCH_GUARD": "maybe"}, ["TORCH_GUARD='maybe'", "1 (also true, on, yes), warn, raise, record"]),
    ({"TORCH_GUARD": "1", "TORCH_GUARD_CHECKS": "nonfinite,bogus"}, ["TORCH_GUARD_CHECKS", "'bogus'"]),
    ({"TORCH_GUARD": "1", "TORCH_GUARD_CHECKS": "-"}, ["TORCH_GUARD_CHECKS"]),
    ({"TORCH_GUARD": "1", "TORCH_GUARD_LIVE": "sometimes"}, ["TORCH_GUARD_LIVE='sometimes'", "0, 1, all"]),
    ({"TORCH_GUARD": "1", "TORCH_GUARD_EVERY": "0"}, ["TORCH_GUARD_EVERY='0'", "integer >= 1"]),
    ({"TORCH_GUARD": "1", "TORCH_GUARD_EVERY": "ten"}, ["TORCH_GUARD_EVERY='ten'", "integer >= 1"]),
    ({"TORCH_GUARD": "1", "TORCH_GUARD_EVERY": "2.5"}, ["TORCH_GUARD_EVERY='2.5'", "integer >= 1"]),
    ({"TORCH_GUARD": "1", "TORCH_GUARD_REPORT": "  "}, ["TORCH_GUARD_REPORT", "file path"]),
    ({"TORCH_GUARD": "1", "TORCH_GUARD_SNOOP": "maybe"}, ["TORCH_GUARD_SNOOP='maybe'", "0, 1"]),
])
def test_bad_environment_values_name_variable_value_and_allowed(env, needles):
    with pytest.raises(ConfigError) as info:
        opts = env_options(env)
        guard(**opts)  # values checked only when the guard is built must name the variable too
    one_line(info, *needles)


def test_good_environment_values_parse():
    opts = env_options({"TORCH_GUARD": "raise", "TORCH_GUARD_CHECKS": "default,-input-stats", "TORCH_GUARD_LIVE": "0",
                        "TORCH_GUARD_EVERY": " 4 ", "TORCH_GUARD_REPORT": "r.json"})
    g = guard(**opts)
    assert g.config.mode == "raise" and g.config.every == 4 and g.config.live is False
    # the report path is resolved at start (a later os.chdir does not move it)
    assert "input-not-normalized" not in g.config.kinds and g.config.report == os.path.abspath("r.json")
    assert env_options({}) is None and env_options({"TORCH_GUARD": "0"}) is None


# ---------------------------------------------------------------- wrap and nesting

@pytest.mark.parametrize("name", ["grad_accumulation", "eval_no_grad", "multi_task"])
def test_nested_global_and_model_guards_on_healthy_scripts(name):
    before = global_state()
    with guard(checks="all", live=False) as outer:
        inner, _ = healthy.load(name).train(checks="all", live=False)
    assert outer.findings == [] and inner.findings == []
    assert outer.internal_errors == [] and inner.internal_errors == []
    # A global guard started before any optimizer exists counts backward() calls as steps until it sees
    # one step (so with gradient accumulation its step numbers run ahead of the model guard's).
    assert outer.step >= inner.step > 0
    assert global_state() == before and guard_hooks.active_patches() == [] and saved_tensor_hooks() is None


def test_wrap_keeps_numerics_and_cleans_up():
    def run(use_wrap):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 1))
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
        net = guard_pkg.wrap(model, opt, checks="all", live=False) if use_wrap else model
        for _ in range(4):
            loss = net(torch.randn(8, 4)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
        if use_wrap:
            assert net.state_dict().keys() == model.state_dict().keys()
            net.guard.close()
            return net.guard, fingerprint(model, opt), model
        return None, fingerprint(model, opt), model

    before = global_state()
    _, plain, _ = run(False)
    g, wrapped, model = run(True)
    assert_same(plain, wrapped)
    assert g.findings == [] and g.internal_errors == [] and g.step == 4
    assert global_state() == before and module_hook_counts(model) == [(0, 0)] * 5


def test_model_with_full_backward_hooks_and_input_rewriting_pre_hooks():
    def run(use_guard):
        torch.manual_seed(0)
        model = mlp()
        grads_seen = []
        model[0].register_full_backward_hook(lambda m, gin, gout: grads_seen.append(gout[0].norm()))
        model[2].register_forward_pre_hook(lambda m, args, kwargs: ((args[0] * 0.5,), kwargs), with_kwargs=True)
        model.register_full_backward_pre_hook(lambda m, gout: (gout[0] * 2,))
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        ctx = guard(model, opt, checks="all", live=False) if use_guard else contextlib.nullcontext()
        with ctx as g:
            for _ in range(3):
                loss = model(torch.randn(4, 4)).pow(2).mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
        return g, fingerprint(model), torch.stack(grads_seen)

    _, plain, seen0 = run(False)
    g, guarded, seen1 = run(True)
    assert_same(plain, guarded)
    assert torch.equal(seen0, seen1)  # the user's backward hooks saw the same gradients
    assert g.findings == [] and g.internal_errors == []


@pytest.mark.parametrize("scope", ["model", "global"])
def test_guard_started_before_the_first_compiled_call(scope):
    """Hooks present at compile time are traced into the graph: training must still run, same numbers."""
    def run(use_guard):
        torch._dynamo.reset()
        model = mlp()
        compiled = torch.compile(model, backend="eager")
        ctx = guard(*((compiled,) if scope == "model" else ()), checks="all", live=False) if use_guard \
            else contextlib.nullcontext()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # torch's own "global hooks fire an extra time" warning
            with ctx as g:
                _train(compiled, params_of=model, steps=3, nan_at=None)
        return g, fingerprint(model)

    _, plain = run(False)
    g, guarded = run(True)
    torch._dynamo.reset()
    assert_same(plain, guarded)
    assert g.findings == [] and g.internal_errors == [] and g.step == 3
    assert len(g.notices) == 1
    if scope == "model":  # hooked at the compiled call's boundary only (layers inside are compiled code)
        assert set(g.modules) == {"Sequential"} and not any("_orig_mod" in p for p in g.modules)


class AnyArgs(nn.Module):
    """Accepts whatever it is called with (no args, kwargs only, strings, None, lists of tensors, masks)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.z = nn.Parameter(torch.randn(4))

    def forward(self, *args, **kwargs):
        x = kwargs.get("x")
        if x is None:
            x = next((a for a in args if isinstance(a, (torch.Tensor, list))), None)
        if x is None:
            x = self.z.unsqueeze(0)
        if isinstance(x, list):
            x = torch.stack(x)
        return self.lin(x)


@pytest.mark.parametrize("scope", ["model", "global"])
def test_models_called_with_any_arguments(scope):
    model = AnyArgs()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    calls = [((), {}), (("mode", 3, None), {}), ((), {"x": torch.randn(2, 4), "flag": True}),
             (([torch.randn(4), torch.randn(4)],), {}), ((torch.randn(2, 4), "s", {"k": torch.randn(1)}), {}),
             ((torch.randn(2, 4),), {"mask": torch.ones(2, dtype=torch.bool), "lengths": [2, 1]})]
    with guard(*((model, opt) if scope == "model" else ()), checks="all", live=False) as g:
        for args, kwargs in calls:
            loss = model(*args, **kwargs).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    assert g.findings == [] and g.internal_errors == [] and g.step == len(calls)


def _per_sample_grads_step(model, opt, x, y, nan_at_step=None, step=0):
    """DP-SGD style: per-sample gradients of cross_entropy with vmap(grad(functional_call)), assigned by hand."""
    from torch.func import functional_call, grad, vmap

    def loss_fn(params, xi, yi):
        return nn.functional.cross_entropy(functional_call(model, params, (xi.unsqueeze(0),)), yi.unsqueeze(0))

    params = {n: p.detach() for n, p in model.named_parameters()}
    per_sample = vmap(grad(loss_fn), in_dims=(None, 0, 0))(params, x, y)
    for n, p in model.named_parameters():
        p.grad = per_sample[n].mean(0)
        if step == nan_at_step and n == "weight":
            p.grad[0, 0] = float("nan")
    opt.step()


def test_losses_inside_vmap_and_grad_are_left_to_the_transform():
    # Guard's loss handlers would keep functorch's wrapped tensors, which cannot be read after the transform:
    # the read failed every step (internal error) and, at exit, raised out of the with block.
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(8, 4), torch.randint(0, 2, (8,))
    with guard(model, opt, live=False, checks="all") as g:
        for step in range(8):
            _per_sample_grads_step(model, opt, x, y, nan_at_step=5, step=step)
    assert g.internal_errors == []
    assert [(f.kind, f.where, f.step) for f in g.findings] == [("nonfinite-grad", "weight", 5)]


def test_a_staged_value_that_cannot_be_read_costs_only_itself():
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    seen = []
    with guard(model, opt, live=False) as g:
        for step in range(3):
            g.stage(torch.zeros((), device="meta"), seen.append)  # no value on the host
            g.stage(torch.tensor(float(step)), seen.append)
            opt.zero_grad()
            model(torch.randn(2, 4)).sum().backward()
            opt.step()
    assert seen == [0.0, 1.0, 2.0]  # the readable values of every step were read
    assert len(g.internal_errors) == 1 and g.active is False
    assert [e["step"] for e in g.timeline] == [0, 1, 2] and all("loss" in e for e in g.timeline)


@pytest.mark.parametrize("scope", ["model", "global"])
def test_lazy_modules_are_watched_from_their_dry_run_on(scope):
    # nn.LazyLinear has no size before its first call: guard read numel() of it and failed at start
    # (model guard) or inside the user's first forward (global guard).
    torch.manual_seed(0)
    model = nn.Sequential(nn.LazyLinear(8), nn.ReLU(), nn.LazyLinear(2))
    with guard(model if scope == "model" else None, checks="all", live=False) as g:
        model(torch.randn(2, 3))  # the dry run that makes the parameters
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(3):
            opt.zero_grad()
            nn.functional.cross_entropy(model(torch.randn(4, 3)), torch.randint(0, 2, (4,))).backward()
            opt.step()
    assert g.findings == [] and g.internal_errors == []
    root = next(m for m in g.record.modules if m["type"] == "Sequential")
    assert root["params"] == 3 * 8 + 8 + 8 * 2 + 2


def test_jit_trace_of_a_guarded_model_records_nothing_of_guard():
    # torch.jit.trace runs the model with its hooks: guard's tests of the tensors were recorded into the
    # trace (TracerWarnings) and the tracing pass was taken for an evaluation outside no_grad.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 2))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    with guard(model, opt, live=False) as g, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            opt.zero_grad()
            model(torch.randn(8, 6)).pow(2).mean().backward()
            opt.step()
        model.eval()
        traced = torch.jit.trace(model, torch.randn(2, 6))
    assert [w for w in caught if issubclass(w.category, torch.jit.TracerWarning)] == []
    assert g.findings == [] and g.internal_errors == []
    x = torch.randn(3, 6)
    assert torch.equal(traced(x), model(x))


def test_complex_parameters_make_guard_print_no_warning_of_its_own():
    """A complex-valued network (Fourier-domain weights): guard's norms of complex gradients take the imaginary
    part too, and never cast them to real (torch warns on stderr, an error under -W error)."""
    class CTanh(nn.Module):
        def forward(self, z):
            return torch.complex(torch.tanh(z.real), torch.tanh(z.imag))

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16, dtype=torch.cfloat), CTanh(), nn.Linear(16, 16, dtype=torch.cfloat),
                          CTanh(), nn.Linear(16, 16, dtype=torch.cfloat), CTanh(), nn.Linear(16, 1, dtype=torch.cfloat))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with guard(model, opt, checks="all", live=False) as g:
            for _ in range(12):
                x = torch.randn(8, 4, dtype=torch.cfloat)
                loss = (model(x) - 1).abs().pow(2).mean()
                opt.zero_grad(); loss.backward(); opt.step()
    assert g.internal_errors == [] and g.findings == []


def test_quantization_aware_training_prepared_after_guard_started():
    """prepare_qat swaps nn.Linear for qat.Linear and registers the old module's hooks on the new one, without
    with_kwargs: guard's hooks take that call form, and close removes those copies too."""
    import torch.ao.quantization as tq

    def train(use_guard):
        torch.manual_seed(0)
        model = nn.Sequential(tq.QuantStub(), nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2), tq.DeQuantStub())
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        x, y = torch.randn(16, 4), torch.randint(0, 2, (16,))
        with (guard(model, opt, live=False) if use_guard else contextlib.nullcontext()) as g, \
                warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # torch.ao's deprecation warnings
            model.qconfig = tq.get_default_qat_qconfig("fbgemm")
            tq.prepare_qat(model, inplace=True)
            for _ in range(3):
                loss = torch.nn.functional.cross_entropy(model(x), y)
                opt.zero_grad(); loss.backward(); opt.step()
        return g, model

    g, model = train(True)
    _, plain = train(False)
    assert g.findings == [] and g.internal_errors == [] and g.step == 3
    assert type(model[1]).__module__.startswith("torch.ao.nn.qat")
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), plain.parameters()))
    hooks = [(len(m._forward_pre_hooks), len(m._forward_hooks)) for m in model.modules()]
    assert hooks == [(len(m._forward_pre_hooks), len(m._forward_hooks)) for m in plain.modules()]  # no copy left


def test_a_parameter_at_a_dead_parameters_address_gets_its_own_name():
    """Under a global guard models come and go: a new parameter that CPython places at a dead one's address
    is named after its own model, not the dead one (a stale name once made a healthy embedding look like the
    first Linear layer of a model trained earlier, and vanishing-gradients fired on it)."""

    def train(model, steps=2):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(steps):
            opt.zero_grad()
            model(torch.randn(3, 24)).sum().backward()
            opt.step()

    with guard(checks="all", live=False) as g:
        old = nn.Sequential(nn.Linear(24, 4))
        train(old)
        assert g.param_name(old[0].weight) == "0.weight"
        dead = {id(p) for p in old.parameters()}
        del old
        gc.collect()
        keep, reused = [], None
        for _ in range(100_000):  # allocate until one lands on a dead parameter's address (a few tries)
            p = nn.Parameter(torch.randn(4, 24))
            if id(p) in dead:
                reused = p
                break
            keep.append(p)
        assert reused is not None
        new = nn.Sequential(nn.Identity(), nn.Linear(24, 4))
        new[1].weight = reused
        train(new)
        assert g.param_name(reused) == "1.weight"


def test_global_guard_reads_a_layers_type_from_the_live_model_not_an_earlier_one_at_the_same_path():
    """A model trained earlier under the same global guard had a Linear at `emb`; the model trained now has its
    Embedding there (tiny gradients by design): it stays exempt from the vanishing-gradients comparison."""
    from tests.healthy import deep_residual
    import torch.nn.functional as F

    class Earlier(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.head = nn.Linear(5, 24), nn.Linear(24, 4)

        def forward(self, x):
            return self.head(torch.tanh(self.emb(x)))

    with guard(checks="all", live=False) as g:
        earlier = Earlier()
        opt = torch.optim.SGD(earlier.parameters(), lr=0.1)
        for _ in range(3):
            opt.zero_grad()
            earlier(torch.randn(8, 5)).sum().backward()
            opt.step()
        del earlier, opt
        gc.collect()
        torch.manual_seed(0)
        model = deep_residual.Net()
        model.proj.requires_grad_(False)
        opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.05, momentum=0.9)
        for _ in range(100):  # the check looks for layers again 50 steps after the earlier model's
            idx, y = torch.randint(0, 50, (16, 5)), torch.randint(0, 4, (16,))
            loss = F.cross_entropy(model(idx), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
    assert [(f.kind, f.where) for f in g.findings] == []
    assert g.internal_errors == []


def test_a_report_path_never_replaces_a_file_guard_did_not_write(tmp_path):
    """A typo or report=__file__ must not turn a script or a config into a report; guard's own reports are replaced."""
    script = tmp_path / "train.py"
    script.write_text("print('mine')\n")
    with pytest.raises(ConfigError) as info:
        guard(nn.Linear(2, 2), report=str(script))
    one_line(info, "report=", "a file that is not a guard report is there", "a new file, or a report guard wrote")
    assert script.read_text() == "print('mine')\n"
    with pytest.raises(ConfigError) as info:
        guard(nn.Linear(2, 2), report=str(tmp_path / "missing") + os.sep)
    one_line(info, "ends with a separator")
    for name in ("r.json", "r.html"):
        for _ in range(2):  # written, then replaced by the next run's report
            with guard(nn.Linear(2, 2), report=str(tmp_path / name), live=False):
                pass
        assert (tmp_path / name).stat().st_size > 0


@pytest.mark.parametrize("make, needles", [
    (lambda: guard(every=float("inf")), ["every=inf", "an integer >= 1"]),
    (lambda: guard(checks=["-default"]), ["leaves no check on", "'default,-input-stats'"]),
    (lambda: guard(checks="all,-all"), ["leaves no check on"]),
    (lambda: guard(nn.Linear(2, 2).forward), ["Linear.forward is a method of a module", "guard(model)"]),
])
def test_surface_mistakes_get_one_clear_line(make, needles):
    with pytest.raises(ConfigError) as info:
        make()
    one_line(info, *needles)


def test_generator_and_async_functions_are_not_decorated_and_generators_of_names_are_read_once():
    def gen():
        yield 1

    async def coro():
        pass

    for fn in (gen, coro):
        with pytest.raises(ConfigError) as info:
            guard(nn.Linear(2, 2))(fn)
        one_line(info, repr(fn.__name__), "with guard(...):")
    g = guard(checks=(c for c in ["nonfinite"]))
    assert "nonfinite" in g.config.checks and g.config.checks_spec == ("nonfinite",)
    assert len(guard(checks="DEFAULT").config.checks) == len(guard().config.checks)
    assert env_options({"TORCH_GUARD": "true"})["mode"] == "warn"
    from guard.config import unknown_env

    assert "did you mean TORCH_GUARD_EVERY?" in unknown_env({"TORCH_GUARD_every": "2"})[0]


@pytest.mark.parametrize("mode", ["model", "global"])
def test_a_producer_thread_iterating_a_dataloader_is_no_training_thread(mode):
    """A thread that only fills a queue from a DataLoader (patched: guard watches its iteration) while the main
    thread trains: no notice that it "runs the model or an optimizer", no finding."""
    import queue
    import threading

    from torch.utils.data import DataLoader, TensorDataset

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    loader = DataLoader(TensorDataset(torch.randn(64, 8), torch.randint(0, 3, (64,))), batch_size=8, shuffle=True)
    q: "queue.Queue" = queue.Queue(maxsize=4)

    def produce():
        for _ in range(3):
            for batch in loader:
                q.put(batch)
        q.put(None)

    with guard(*([model, opt] if mode == "model" else []), live=False) as g:
        first = next(iter(loader))  # the main thread iterates a loader too, and trains, before the producer
        opt.zero_grad()
        nn.functional.cross_entropy(model(first[0]), first[1]).backward()
        opt.step()
        t = threading.Thread(target=produce, name="producer")
        t.start()
        while (batch := q.get()) is not None:
            opt.zero_grad()
            nn.functional.cross_entropy(model(batch[0]), batch[1]).backward()
            opt.step()
        t.join()
    assert g.notices == [] and g.findings == [] and g.internal_errors == []


def test_a_finding_named_from_the_loop_s_variables_keeps_none_of_them_alive():
    """Naming the loader of `unshuffled-labels` reads the training function's variables; before Python 3.13 that
    left a snapshot of them on its frame: each task's replaced optimizer stayed alive, and the next one never
    took the step count over (45 steps counted of 60)."""
    from torch import nn

    torch.manual_seed(0)
    x, y = torch.randn(80, 8), torch.arange(2).repeat_interleave(40)  # sorted by label
    model = nn.ModuleList([nn.Linear(8, 2) for _ in range(4)])
    first = torch.optim.SGD(model[0].parameters(), lr=0.05)
    refs = []

    def train(opt):
        for t in range(4):
            if t:
                opt = torch.optim.SGD(model[t].parameters(), lr=0.05)
            refs.append(weakref.ref(opt))
            loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=16)
            for _ in range(3):
                for xb, yb in loader:
                    loss = torch.nn.functional.cross_entropy(model[t](xb), yb)
                    opt.zero_grad()
                    loss.backward()
                    opt.step()
            gc.collect()
            if t >= 2:
                assert refs[t - 1]() is None, f"task {t - 1}'s optimizer is still alive during task {t}"

    with guard(model, first, live=False) as g:
        train(first)
    assert [f.kind for f in g.findings] == ["unshuffled-labels"] and g.step == 60


def test_reading_a_frame_s_variables_leaves_the_function_s_own_locals_dict_alone():
    import sys

    from guard._frames import frame_locals

    def held():
        a = 1
        mine = locals()  # the function keeps its own locals() dict (the frame's snapshot before 3.13)
        seen = frame_locals(sys._getframe())
        return seen["a"], mine.get("a")

    def free():
        b = 2
        return frame_locals(sys._getframe())["b"], b

    assert held() == (1, 1) and free() == (2, 2)


@pytest.mark.parametrize("scope", ["model", "global"])
def test_per_sample_gradients_of_a_conv_net_by_vmap_are_not_checked_inside_the_transform(scope):
    # DP-SGD's per-sample gradients: vmap(grad(functional_call(model, ...))) on 4-D images. The model's hooks ran
    # inside the transform, and input-stats staged a flag made of functorch's wrapped tensors: the step's read
    # failed (internal error in 'guard', the run's reads switched off).
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.Tanh(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                          nn.Linear(4, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.rand(16, 3, 8, 8), torch.randint(0, 2, (16,))

    def loss(params, xi, yi):
        return nn.functional.cross_entropy(torch.func.functional_call(model, params, (xi[None],)), yi[None])

    per_sample = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0, 0))
    with (guard(model, opt, live=False) if scope == "model" else guard(live=False)) as g:
        for step in range(6):
            grads = per_sample({n: p.detach() for n, p in model.named_parameters()}, x, y)
            for n, p in model.named_parameters():
                p.grad = grads[n].mean(0) if step != 4 else grads[n].mean(0) * float("nan")
            opt.step()
            opt.zero_grad()
    assert g.internal_errors == []
    assert [(f.kind, f.step) for f in g.findings] == [("nonfinite-grad", 4)]  # the checks outside it still run


@pytest.mark.parametrize("scope", ["model", "global"])
def test_per_sample_gradients_by_expanded_weights_leave_guard_working(scope):
    # torch's call_for_per_sample_grads swaps ExpandedWeight wrappers in for the parameters during the call; most
    # tensor methods raise on them (numel, requires_grad): guard's module table and optimizer-params' walk failed.
    from torch.nn.utils._per_sample_grad import call_for_per_sample_grads

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 32), nn.Tanh(), nn.Linear(32, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    x, y = torch.randn(32, 10), torch.randint(0, 3, (32,))
    with (guard(model, opt, live=False, checks="all") if scope == "model" else guard(live=False)) as g:
        for step in range(20):  # optimizer-params walks the backwards of step 1 for parameters outside the models
            out = call_for_per_sample_grads(model, loss_reduction="sum")(x)
            nn.functional.cross_entropy(out, y, reduction="sum").backward()
            for p in model.parameters():
                norms = p.grad_sample.flatten(1).norm(dim=1, keepdim=True).clamp_min(1.0)
                p.grad = (p.grad_sample.flatten(1) / norms).sum(0).view_as(p) / 32
                p.grad_sample = None
            opt.step()
            opt.zero_grad()
    assert g.internal_errors == [] and g.findings == []
    assert len(g.timeline) == 20


class _SeparableConv(nn.Module):
    def __init__(self, c, o):
        super().__init__()
        self.dw = nn.Conv2d(c, c, 3, padding=1, groups=c)
        self.pw = nn.Conv2d(c, o, 1)

    def forward(self, x):
        return self.pw(torch.nn.functional.relu6(self.dw(x)))


def test_fx_symbolic_trace_under_a_global_guard_leaves_the_checks_on():
    """torch.fx.symbolic_trace calls a custom submodule with Proxy objects: the NaN check's look at them raised and
    switched the check off (an internal error, and a later NaN input went unreported) until stop 41."""
    torch.manual_seed(0)
    net = nn.Sequential(_SeparableConv(3, 8), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 2))
    with guard(live=False) as g:
        gm = torch.fx.symbolic_trace(net)
        opt = torch.optim.SGD(gm.parameters(), 0.1)
        for step in range(4):
            x = torch.randn(4, 3, 8, 8)
            if step == 2:
                x[0, 0, 0, 0] = float("nan")
            loss = torch.nn.functional.cross_entropy(gm(x), torch.randint(0, 2, (4,)))
            opt.zero_grad()
            loss.backward()
            opt.step()
    assert g.internal_errors == []
    assert [(f.kind, f.step) for f in g.findings] == [("nonfinite-input", 2)]
