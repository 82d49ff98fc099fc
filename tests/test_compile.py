"""torch.compile under guard: same numbers, no graph break or recompile in guard's code, checks at the boundary."""
import warnings

import pytest
import torch
from torch import nn

import guard

dynamo = pytest.importorskip("torch._dynamo")
from torch._dynamo.utils import counters  # noqa: E402


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.d1, self.b = nn.Linear(8, 32), nn.Dropout(0.3), nn.Linear(32, 32)
        self.d2, self.c = nn.Dropout(0.2), nn.Linear(32, 1)

    def forward(self, x):
        return self.c(self.d2(torch.relu(self.b(self.d1(torch.relu(self.a(x)))))))


def _train(guarded, mode, when, style, kind, backend, nan_at=None, steps=5):
    dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = Net() if kind == "net" else nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = None
    caught_cm = warnings.catch_warnings(record=True)  # like `python -W always`, set before guard starts
    caught = caught_cm.__enter__()
    warnings.simplefilter("always")

    def start(m):
        return (guard.guard(m, opt, live=False) if mode == "model" else guard.guard(live=False)).start()

    if guarded and when == "before":
        g = start(model)
    if style == "torch":
        cm = torch.compile(model, backend=backend)
    else:
        model.compile(backend=backend)
        cm = model
    if guarded and when == "after":
        g = start(cm)
    losses = []
    try:
        for i in range(steps):
            x, y = torch.randn(16, 8), torch.randn(16, 1)
            if i == nan_at:
                x[3, 2] = float("nan")
            loss = nn.functional.mse_loss(cm(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach().clone())
        if g is not None:
            g.close()
    finally:
        caught_cm.__exit__(None, None, None)
    seen = {k: dict(v) for k, v in counters.items() if k in ("graph_break", "recompiles", "stats") and v}
    return torch.stack(losses), seen, [str(w.message)[:120] for w in caught], g


CASES = [("model", "before", "torch", "net", "aot_eager"), ("model", "after", "torch", "seq", "eager"),
         ("model", "before", "module", "seq", "eager"), ("model", "after", "module", "net", "eager"),
         ("global", "before", "torch", "net", "eager"), ("global", "before", "module", "seq", "aot_eager"),
         ("global", "after", "torch", "seq", "eager")]


@pytest.mark.parametrize("mode,when,style,kind,backend", CASES)
def test_compiled_training_with_dropout_is_bit_identical_and_guard_adds_no_graph_break(mode, when, style, kind, backend):
    plain, plain_counts, plain_warn, _ = _train(False, mode, when, style, kind, backend)
    guarded, counts, warns, g = _train(True, mode, when, style, kind, backend)
    assert torch.equal(plain, guarded)  # dropout's random numbers drawn the same way
    assert counts == plain_counts  # graph breaks, recompiles, graphs: as without guard
    assert warns == plain_warn  # no "global hooks ... fire an extra time", no sys._getframe from dynamo
    assert g.findings == []
    assert any("torch.compile" in n for n in g.notices)


@pytest.mark.parametrize("mode,when,style", [("model", "before", "torch"), ("model", "after", "module"),
                                             ("global", "before", "module"), ("global", "after", "torch")])
def test_nan_input_of_compiled_model_is_named_at_its_boundary(mode, when, style):
    _, counts, _, g = _train(True, mode, when, style, "net", "eager", nan_at=3)
    kinds = {(f.kind, f.where, f.step) for f in g.findings}
    assert ("nonfinite-input", "input", 3) in kinds, g.findings
    f = next(f for f in g.findings if f.kind == "nonfinite-input")
    assert "Net" in f.message and "args[0]" in f.message
    assert f.source and f.source.startswith("tests/test_compile.py")
    assert "graph_break" not in counts and "recompiles" not in counts


def test_global_guard_leaves_no_global_hook_behind():
    from torch.nn.modules import module as M

    before = (len(M._global_forward_hooks), len(M._global_forward_hooks_with_kwargs))
    with guard.guard(live=False):
        nn.Linear(2, 2)(torch.randn(1, 2))
    # torch leaves the with_kwargs entry: alone it makes every torch.compile'd call warn about global hooks
    assert (len(M._global_forward_hooks), len(M._global_forward_hooks_with_kwargs)) == before


def test_compiled_model_parameters_and_eval_mode_are_named_as_in_the_users_model():
    dynamo.reset()
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    cm = torch.compile(model, backend="eager")
    with guard.guard(cm, opt, live=False) as g:
        for _ in range(3):
            loss = cm(torch.randn(8, 8)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
        with torch.no_grad():
            cm(torch.randn(8, 8))  # evaluation with Dropout still in training mode
            model.c.weight[0, 0] = float("inf")
        loss = cm(torch.randn(8, 8)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    found = {f.kind: f for f in g.findings}
    assert found["nonfinite-param"].where == "c.weight"  # not _orig_mod.c.weight
    assert found["eval-in-train-mode"].where == "Net"
    dynamo.reset()


def _compiled_step_run(guarded, mode, nan_at=None, steps=10):
    """The compiled-optimizer recipe: `@torch.compile def step_fn(): opt.step()`, the model eager."""
    dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
    opt = torch.optim.Adam(model.parameters(), lr=torch.tensor(1e-3))  # a tensor lr: no recompile as it changes
    g = (guard.guard(model, opt, live=False) if mode == "model" else guard.guard(live=False)).start() if guarded else None

    @torch.compile(backend="eager")
    def step_fn():
        opt.step()

    x, y = torch.randn(32, 16), torch.randn(32, 1)
    try:
        for i in range(steps):
            out = model(x)
            loss = nn.functional.mse_loss(out, y)
            if i == nan_at:  # finite, with an infinite derivative: NaN gradients, a finite loss
                loss = loss + torch.sqrt((out - out.detach()).pow(2).sum())
            opt.zero_grad()
            loss.backward()
            step_fn()
    finally:
        if g is not None:
            g.close()
    breaks = sum(counters["graph_break"].values())
    return model, g, breaks, counters["stats"].get("unique_graphs"), dict(counters.get("recompiles", {}))


@pytest.mark.parametrize("mode", ["model", "global"])
def test_a_compiled_optimizer_step_runs_guards_step_hooks_eagerly_without_tracing_them(mode):
    """Dynamo traced guard's step hooks inside a compiled `opt.step()`: some twenty graph breaks in guard's code
    (sys._getframe, thread ids, .item()) and a graph per step (recompiles on guard's state). The hooks now run
    eagerly at one break around the step's graph: the graphs are the unguarded run's, nothing recompiles, and the
    NaN gradients of step 6 are told at step 6, before the compiled update."""
    plain, _, plain_breaks, plain_graphs, _ = _compiled_step_run(False, mode)
    model, g, breaks, graphs, recompiles = _compiled_step_run(True, mode, nan_at=6)
    assert graphs == plain_graphs and not recompiles, (graphs, plain_graphs, recompiles)
    assert breaks <= max(plain_breaks, 1), breaks
    assert g.step == 10
    assert [(f.kind, f.step) for f in g.findings] == [("nonfinite-grad", 6)], g.findings
    assert g.findings[0].where == "0.weight"


def test_a_compiled_train_step_function_is_told_and_its_nan_gradients_still_found():
    # A torch.compile'd function that calls the model and backward(): the module hooks are compiled away, so the
    # notice says what to do for a compiled function (not only for a compiled module), and the gradients are
    # still screened before the update.
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    @torch.compile(backend="eager")
    def train_step(x, y):
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        return loss

    with guard.guard(model, opt, live=False) as g:
        for i in range(6):
            x, y = torch.randn(4, 8), torch.randn(4, 1)
            if i == 4:
                y[0, 0] = float("nan")
            opt.zero_grad()
            train_step(x, y)
            opt.step()
    (note,) = [n for n in g.notices if "no call of the watched model" in n]
    assert "a compiled function that calls the model, call the model outside it" in note
    assert "not the inputs, outputs or loss" in note
    assert [(f.kind, f.step) for f in g.findings] == [("nonfinite-grad", 4)]
    # the NaN came from the unscreened batch: the hint does not say the forward was finite
    hint = g.findings[0].hint
    assert hint.startswith("No call of the watched model was seen at this step") and "finite" not in hint.split(":")[0]
    torch._dynamo.reset()
