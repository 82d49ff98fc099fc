"""Fuzzing: generated module trees and output structures run under guard(checks="all") with no internal
error, no finding, and the same numbers as without guard."""
import collections
import dataclasses
import warnings

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from guard import GuardInternalWarning, guard
from guard import hooks as guard_hooks

WIDTH = 4
Pair = collections.namedtuple("Pair", "a b")


@dataclasses.dataclass
class Out:
    main: torch.Tensor
    extra: object = None


# ---------------------------------------------------------------- module trees

def leaf(kind, shared):
    if kind == "linear":
        return nn.Linear(WIDTH, WIDTH)
    if kind == "relu":
        return nn.ReLU()
    if kind == "tanh":
        return nn.Tanh()
    if kind == "identity":
        return nn.Identity()
    if kind == "layernorm":
        return nn.LayerNorm(WIDTH)
    if kind == "dropout":
        return nn.Dropout(0.1)
    if kind == "batchnorm":
        return nn.BatchNorm1d(WIDTH)
    if kind == "shared":
        return shared  # the same module object used again: called twice per forward
    raise AssertionError(kind)


LEAVES = st.sampled_from(["linear", "relu", "tanh", "identity", "layernorm", "dropout", "batchnorm", "shared"])
TREES = st.recursive(
    LEAVES,
    lambda kids: st.one_of(
        st.tuples(st.just("seq"), st.lists(kids, min_size=0, max_size=3)),
        st.tuples(st.just("list"), st.lists(kids, min_size=1, max_size=3)),
        st.tuples(st.just("dict"), st.lists(kids, min_size=1, max_size=3)),
    ),
    max_leaves=8,
)


class ListBlock(nn.Module):
    def __init__(self, mods):
        super().__init__()
        self.items = nn.ModuleList(mods)

    def forward(self, x):
        for m in self.items:
            x = m(x)
        return x


class DictBlock(nn.Module):
    def __init__(self, mods):
        super().__init__()
        self.items = nn.ModuleDict({f"m{i}": m for i, m in enumerate(mods)})

    def forward(self, x):
        return sum(m(x) for m in self.items.values()) / len(self.items)


def build(spec, shared):
    if isinstance(spec, str):
        return leaf(spec, shared)
    kind, kids = spec
    mods = [build(k, shared) for k in kids]
    if kind == "seq":
        return nn.Sequential(*mods)
    return ListBlock(mods) if kind == "list" else DictBlock(mods)


OUTPUTS = st.sampled_from(["tensor", "tuple", "list", "dict", "namedtuple", "dataclass", "none-extra", "int-extra",
                           "nested"])


class Net(nn.Module):
    """The generated body, a shared submodule, a parameter shared with the head, and a chosen output shape."""

    def __init__(self, spec, out_kind, tie):
        super().__init__()
        self.shared = nn.Linear(WIDTH, WIDTH)
        self.body = build(spec, self.shared)
        self.head = nn.Linear(WIDTH, WIDTH)
        if tie:
            self.head.weight = self.shared.weight  # parameters shared between modules
        self.out_kind = out_kind

    def forward(self, x):
        h = self.head(self.body(self.shared(x)))
        k = self.out_kind
        if k == "tensor":
            return h
        if k == "tuple":
            return h, h.detach().sum()
        if k == "list":
            return [h, h * 2]
        if k == "dict":
            return {"out": h, "aux": [h.mean(), None]}
        if k == "namedtuple":
            return Pair(h, 3)
        if k == "dataclass":
            return Out(h, extra={"n": 1})
        if k == "none-extra":
            return (h, None)
        if k == "int-extra":
            return {"out": h, "count": 7, "name": "x"}
        return {"a": [(h, {"b": Out(h * 0.5, extra=Pair(None, h.sum()))})]}


def main_tensor(out):
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, Out):
        return out.main
    if isinstance(out, Pair):
        return out.a
    if isinstance(out, dict):
        return main_tensor(out.get("out", out.get("a")))
    return main_tensor(out[0])


def run(spec, out_kind, tie, use_guard, scope):
    torch.manual_seed(0)
    net = Net(spec, out_kind, tie)
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    g = guard(*((net, opt) if scope == "model" else ()), checks="all", live=False) if use_guard else None
    if g is not None:
        g.start()
    try:
        for _ in range(2):
            loss = main_tensor(net(torch.randn(6, WIDTH))).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
        net.eval()
        with torch.no_grad():
            net(torch.randn(3, WIDTH))
        net.train()
    finally:
        if g is not None:
            g.close()
    return g, [p.detach().clone() for p in net.parameters()], torch.get_rng_state()


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spec=TREES, out_kind=OUTPUTS, tie=st.booleans(), scope=st.sampled_from(["model", "global"]))
def test_generated_models_and_outputs(spec, out_kind, tie, scope):
    _, plain, rng0 = run(spec, out_kind, tie, False, scope)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        g, guarded, rng1 = run(spec, out_kind, tie, True, scope)
    assert g.internal_errors == [], g.internal_errors
    assert not [w for w in caught if issubclass(w.category, GuardInternalWarning)]
    assert [(f.kind, f.where, f.message) for f in g.findings] == []
    assert g.step == 2
    assert all(torch.equal(a, b) for a, b in zip(plain, guarded)) and torch.equal(rng0, rng1)
    assert guard_hooks.active_patches() == []


# ---------------------------------------------------------------- arbitrary output structures

LEAF_VALUES = st.sampled_from(["t", "none", "int", "str", "float", "t0", "empty"])
STRUCTS = st.recursive(
    LEAF_VALUES,
    lambda kids: st.one_of(
        st.lists(kids, max_size=3),
        st.lists(kids, max_size=3).map(tuple),
        st.dictionaries(st.sampled_from(["a", "b", "c"]), kids, max_size=3),
        st.tuples(kids, kids).map(lambda ab: Pair(*ab)),
        st.tuples(kids, kids).map(lambda ab: Out(*ab)),
    ),
    max_leaves=10,
)


def materialize(spec, h):
    if spec == "t":
        return h
    if spec == "t0":
        return h.sum()
    if spec == "empty":
        return h[:0]
    if spec == "none":
        return None
    if spec == "int":
        return 5
    if spec == "str":
        return "label"
    if spec == "float":
        return 0.5
    if isinstance(spec, Pair):
        return Pair(materialize(spec.a, h), materialize(spec.b, h))
    if isinstance(spec, Out):
        return Out(materialize(spec.main, h), materialize(spec.extra, h))
    if isinstance(spec, dict):
        return {k: materialize(v, h) for k, v in spec.items()}
    if isinstance(spec, tuple):
        return tuple(materialize(v, h) for v in spec)
    return [materialize(v, h) for v in spec]


class Structured(nn.Module):
    def __init__(self, spec):
        super().__init__()
        self.inner = nn.Linear(WIDTH, WIDTH)
        self.spec = spec

    def forward(self, x):
        h = self.inner(x)
        return h, materialize(self.spec, h)


class Outer(nn.Module):
    def __init__(self, spec):
        super().__init__()
        self.block = Structured(spec)

    def forward(self, x):
        h, extra = self.block(x)
        return extra, h  # the structured value also passes through the root's output


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spec=STRUCTS)
def test_any_output_structure(spec):
    torch.manual_seed(0)
    model = Outer(spec)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with guard(model, opt, checks="all", live=False) as g:
            for _ in range(2):
                _, h = model(torch.randn(5, WIDTH))
                loss = h.pow(2).mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
    assert g.internal_errors == [], g.internal_errors
    assert not [w for w in caught if issubclass(w.category, GuardInternalWarning)]
    assert [(f.kind, f.where) for f in g.findings] == []
    assert g.step == 2
