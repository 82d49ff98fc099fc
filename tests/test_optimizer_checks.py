"""Optimizer pitfalls: weight decay without gradient, frozen/missing parameters, gradient explosion,
AMP GradScaler awareness and the per-step timeline."""
import copy
import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from demos import amp_skipped, diverging_lr, finetune_optimizer, grad_explosion, nan_grad, weight_decay_no_grad
from guard import guard
from guard.checks._params import module_prefixes

OPTIMIZERS = {
    "SGD": lambda ps, wd: torch.optim.SGD(ps, lr=0.01, weight_decay=wd),
    "SGD+momentum": lambda ps, wd: torch.optim.SGD(ps, lr=0.01, momentum=0.9, weight_decay=wd),
    "Adam": lambda ps, wd: torch.optim.Adam(ps, lr=0.01, weight_decay=wd),
    "AdamW": lambda ps, wd: torch.optim.AdamW(ps, lr=0.01, weight_decay=wd),
    "RMSprop": lambda ps, wd: torch.optim.RMSprop(ps, lr=0.01, weight_decay=wd),
    "Adagrad": lambda ps, wd: torch.optim.Adagrad(ps, lr=0.01, weight_decay=wd),
}


def kinds(g):
    return [f.kind for f in g.findings]


def only(g, kind):
    found = [f for f in g.findings if f.kind == kind]
    assert found, f"no {kind} in {g.findings}"
    return found[0]


# ---------------------------------------------------------------- what optimizers really do (measured)

def _moves(make, wd, grad, primed):
    p = nn.Parameter(torch.ones(4))
    opt = make([p], wd)
    if primed:  # optimizer state (momentum buffers, Adam moments) exists from an earlier step
        p.grad = torch.ones(4)
        opt.step()
    before = p.detach().clone()
    p.grad = None if grad == "none" else torch.zeros(4)
    opt.step()
    return not torch.equal(before, p.detach())


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_measured_which_optimizers_move_a_parameter_without_gradient(name):
    make = OPTIMIZERS[name]
    # A None gradient is skipped by every optimizer, with or without state or weight decay.
    assert not any(_moves(make, wd, "none", pr) for wd in (0.0, 0.1) for pr in (False, True))
    # An all-zero gradient with weight decay moves the parameter in every one of them.
    assert _moves(make, 0.1, "zero", False) and _moves(make, 0.1, "zero", True)
    # Without weight decay only momentum/Adam state keeps moving it.
    assert not _moves(make, 0.0, "zero", False)
    assert _moves(make, 0.0, "zero", True) == (name in ("SGD+momentum", "Adam", "AdamW"))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.layer1 = nn.Sequential(nn.Linear(8, 16), nn.ReLU())
        self.layer4 = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16))
        self.fc = nn.Linear(16, 2)

    def forward(self, x, deep=True):
        h = self.layer1(x)
        return self.fc(h + self.layer4(h) if deep else h)


def _phase_run(make, steps=24, warm=2, set_to_none=False, fill_zeros=False, pin=None, **opts):
    torch.manual_seed(0)
    model = Net()
    opt = make(model)
    with guard(model, opt, live=False, **opts) as g:
        if pin:
            g.meter.pin(pin)  # the budget's sampling period, fixed
        for step in range(steps):
            x, y = torch.randn(16, 8), torch.randint(0, 2, (16,))
            opt.zero_grad(set_to_none=set_to_none)
            nn.functional.cross_entropy(model(x, deep=step < warm), y).backward()
            if fill_zeros:  # what DDP does for unused parameters: zeros, not None
                for p in model.layer4.parameters():
                    if p.grad is None:
                        p.grad = torch.zeros_like(p)
            opt.step()
    return g


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("wd", [0.0, 0.1])
def test_reported_exactly_where_the_optimizer_really_moves_the_parameter(name, wd):
    g = _phase_run(lambda m: OPTIMIZERS[name](m.parameters(), wd), checks=["weight-decay-without-grad"])
    moves = wd > 0 or name in ("SGD+momentum", "Adam", "AdamW")
    assert (kinds(g) == ["weight-decay-without-grad"]) == moves, g.findings
    if moves:
        f = g.findings[0]
        assert f.where == "layer4" and f.step == 2
        assert f.details["cause"] == ("weight_decay" if wd else "momentum")


def test_layer4_with_adamw_names_the_prefix_group_decay_and_step():
    g = weight_decay_no_grad.train(live=False)
    assert kinds(g) == ["weight-decay-without-grad"]
    f = g.findings[0]
    assert f.severity == "warning" and f.where == "layer4" and f.step == 2
    # a lasting condition: the finding follows it to the last step measured
    assert f.last_step == f.details["measured_at_step"] > f.step and f.count > 1
    assert f.details["group"] == 0 and f.details["weight_decay"] == 0.05 and f.details["parameters"] == 4
    assert "param_groups[0]" in f.message and "(weight_decay=0.05, plus AdamW" in f.message
    assert "weight_decay=0" in f.hint and "set_to_none=True" in f.hint
    assert "weight_decay_no_grad.py" in f.source


def test_layer4_with_sgd_weight_decay_reports_the_shrink():
    g = _phase_run(lambda m: torch.optim.SGD(m.parameters(), lr=0.1, weight_decay=0.01), steps=24)
    f = only(g, "weight-decay-without-grad")
    assert f.where == "layer4" and f.details["cause"] == "weight_decay"
    assert f.details["norm_now"] < f.details["norm_first"] and f.details["norm_change_pct"] < 0
    assert "shrank" in f.message and "halves it every ~693 steps" in f.message
    assert len(g.findings) == 1  # one finding for the module, not one per parameter
    assert f.last_step == f.details["measured_at_step"] == 23  # counted at each step it lasts, not per parameter


def test_ddp_style_zero_filled_grads_are_caught():
    g = _phase_run(lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4),
                   set_to_none=True, fill_zeros=True, steps=6, warm=0)
    f = only(g, "weight-decay-without-grad")
    assert f.where == "layer4" and f.step == 0


def test_blocks_skipped_by_layerdrop_are_no_unused_part():
    """LayerDrop / stochastic depth (a Kaggle kernel: SGD with momentum and weight decay, zero_grad(set_to_none=False))
    skips a residual block with probability 0.5, three steps in a row now and then: the block trains again at the next
    step that keeps it. It was reported after 3 zero steps; a part that trained before must stay out for 20."""
    torch.manual_seed(0)
    blocks = nn.ModuleList([nn.Sequential(nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 16)) for _ in range(3)])
    model = nn.ModuleDict({"inp": nn.Linear(8, 16), "blocks": blocks, "out": nn.Linear(16, 3)})
    opt = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9, weight_decay=5e-4)
    run, longest = [0] * 3, [0] * 3
    with guard(model, opt, live=False) as g:
        for step in range(120):
            x, y = torch.randn(32, 8), torch.randint(0, 3, (32,))
            h = model["inp"](x)
            for i, blk in enumerate(blocks):
                if torch.rand(()) < 0.5:
                    run[i] += 1
                    longest[i] = max(longest[i], run[i])
                    continue
                run[i] = 0
                h = h + blk(h) / 0.5
            opt.zero_grad(set_to_none=False)
            nn.functional.cross_entropy(model["out"](h), y).backward()
            opt.step()
    assert min(longest) >= 3 and max(longest) < 20  # the precondition: runs that were reported before
    assert g.findings == [], g.findings


def test_one_unlucky_step_is_not_reported():
    g = _phase_run(lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2), steps=4, warm=2, checks="all")
    assert g.findings == []  # layer4 had zero grads for only 2 steps


class _TwoHeads(nn.Module):
    def __init__(self):
        super().__init__()
        self.body, self.a, self.b = nn.Linear(4, 8), nn.Linear(8, 1), nn.Linear(8, 1)

    def forward(self, x, head):
        return (self.a if head == 0 else self.b)(self.body(x))


def _sampled(opts, pin=None):
    """Heads trained in turn (zero_grad keeps zeros): `b` gets a zero gradient on every other step."""
    torch.manual_seed(0)
    model = _TwoHeads()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    with guard(model, opt, live=False, **opts) as g:
        if pin:
            g.meter.pin(pin)
        for step in range(30):
            loss = model(torch.randn(16, 4), step % 2).pow(2).mean()
            opt.zero_grad(set_to_none=False)
            loss.backward()
            opt.step()
    return g


@pytest.mark.parametrize("opts,pin", [({}, None), ({"every": 2}, None), ({"every": 4}, None),
                                      ({"budget": 0.05}, 2)], ids=["every-step", "every=2", "every=4", "budget-period-2"])
def test_a_head_trained_every_other_step_is_no_run_when_sampled(opts, pin):
    # Sampled steps 0, 2, 4, ... all see head b's zero gradient: three of them are no three steps in a row.
    g = _sampled(opts, pin)
    assert g.findings == [] and g.internal_errors == []


@pytest.mark.parametrize("opts,pin", [({"every": 2}, None), ({"budget": 0.05}, 2)], ids=["every=2", "budget-period-2"])
def test_a_module_without_gradient_is_still_caught_when_sampled(opts, pin):
    g = _phase_run(lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1), steps=24, pin=pin, **opts)
    f = only(g, "weight-decay-without-grad")
    assert f.where == "layer4" and f.step == 2 and "all-zero gradients for 20 steps" in f.message
    assert f.details["zero_grad_steps"] == 22  # the run went on to the last step, followed step by step


def test_a_head_frozen_after_the_optimizer_was_built_is_told_it_is_frozen():
    """Multi-head continual learning: the old head gets requires_grad_(False) between tasks, but stays in the
    optimizer holding zero gradients (zero_grad(set_to_none=False)): weight decay and momentum still move it."""
    torch.manual_seed(0)
    model = nn.ModuleDict({"body": nn.Linear(4, 8), "h0": nn.Linear(8, 2), "h1": nn.Linear(8, 2)})
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-3)
    with guard(model, opt, live=False) as g:
        for step in range(30):
            head = "h0" if step < 10 else "h1"
            if step == 10:
                model["h0"].requires_grad_(False)
            opt.zero_grad(set_to_none=False)
            out = model[head](torch.relu(model["body"](torch.randn(8, 4))))
            nn.functional.cross_entropy(out, torch.randint(0, 2, (8,))).backward()
            opt.step()
    f = [f for f in g.findings if f.kind == "weight-decay-without-grad"]
    assert f and f[0].where == "h0" and f[0].details["frozen"] is True
    assert "are frozen (requires_grad=False)" in f[0].message and "p.grad = None" in f[0].hint


class _TwoExperts(nn.Module):
    def __init__(self):
        super().__init__()
        self.experts = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))
        self.head = nn.Linear(8, 1)

    def forward(self, x, route):
        return self.head(sum(e(x) for i, e in enumerate(self.experts) if i in route))


def test_an_idle_expert_shrunk_by_weight_decay_names_the_routing():
    """A mixture of experts whose router stopped choosing expert 1 (zero_grad(set_to_none=False) leaves it zero
    gradients, AdamW decays it): told, and the hint names the collapsed routing as the cause to fix."""
    torch.manual_seed(0)
    model = _TwoExperts()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    with guard(model, opt, live=False) as g:
        for step in range(40):
            opt.zero_grad(set_to_none=False)
            F.mse_loss(model(torch.randn(16, 8), (0, 1) if step < 5 else (0,)), torch.randn(16, 1)).backward()
            opt.step()
    f = only(g, "weight-decay-without-grad")
    assert f.where == "experts.1" and f.details["expert"] is True and "collapsed expert" in f.hint


@pytest.mark.parametrize("given", [True, False])
def test_an_old_head_kept_registered_after_surgery_is_named_where_it_is_now(given):
    """Head surgery for a second task keeps the old head registered (`model.old_head = model.head`), then a new
    `model.head`; AdamW over model.parameters() decays the unused old head. Its parameters were named at first
    sight, when they were `head`: the finding named the new, training head."""
    torch.manual_seed(0)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = nn.Sequential(nn.Linear(12, 48), nn.ReLU())
            self.head = nn.Linear(48, 2)

        def forward(self, x):
            return self.head(self.body(x))

    x = torch.randn(400, 12)
    ya, yb = (x[:, 0] > 0).long(), (x[:, 1] > 0).long() + (x[:, 2] > 0).long()
    model = Net()
    with guard(model if given else None, live=False) as g:
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.05)
        for i in range(0, 400, 40):
            opt.zero_grad(set_to_none=False)
            F.cross_entropy(model(x[i:i + 40]), ya[i:i + 40]).backward()
            opt.step()
        model.old_head = model.head
        model.head = nn.Linear(48, 3)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.05)
        for _ in range(3):
            for i in range(0, 400, 40):
                opt.zero_grad(set_to_none=False)
                F.cross_entropy(model(x[i:i + 40]), yb[i:i + 40]).backward()
                opt.step()
    f = only(g, "weight-decay-without-grad")
    assert f.where == "old_head", f
    assert f.message.startswith("old_head: 2 parameter(s)"), f.message
    assert sorted(f.details["names"]) == ["old_head.bias", "old_head.weight"], f.details


def test_none_grads_and_weight_decay_free_group_are_clean():
    g = weight_decay_no_grad.train(fixed=True, live=False, checks="all")
    assert g.findings == [] and g.internal_errors == []
    # bias/norm parameters in their own weight_decay=0 group (plain SGD): zero grads do not move them
    g = _phase_run(lambda m: torch.optim.SGD(
        [{"params": [p for n, p in m.named_parameters() if not n.startswith("layer4")], "weight_decay": 1e-2},
         {"params": m.layer4.parameters(), "weight_decay": 0.0}], lr=0.1), checks="all")
    assert g.findings == [], g.findings


def test_two_unused_modules_give_one_finding_each():
    class Two(nn.Module):
        def __init__(self):
            super().__init__()
            self.enc = nn.Linear(4, 4)
            self.aux = nn.ModuleDict({"a": nn.Linear(4, 4), "b": nn.Linear(4, 4)})
            self.extra = nn.Linear(4, 4)

        def forward(self, x, all_=False):
            h = self.enc(x)
            return h + self.aux["a"](h) + self.aux["b"](h) + self.extra(h) if all_ else h

    torch.manual_seed(0)
    model = Two()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, weight_decay=0.01)
    with guard(model, opt, live=False) as g:
        for step in range(24):
            opt.zero_grad(set_to_none=False)
            model(torch.randn(3, 4), all_=step == 0).sum().backward()
            opt.step()
    assert sorted(f.where for f in g.findings) == ["aux", "extra"]


def test_module_prefixes():
    names = ["a.0.w", "a.0.b", "a.1.w", "b.w", "b.b", "c.w"]
    assert module_prefixes(["a.0.w", "a.0.b", "a.1.w"], names) == ["a"]
    assert module_prefixes(["a.0.w", "a.0.b", "b.w"], names) == ["a.0", "b.w"]
    assert module_prefixes(["c.w", "x"], names) == ["c", "x"]


@pytest.mark.parametrize("host_direct", [False, True], ids=["batched", "cpu-direct"])
def test_no_per_parameter_host_sync(monkeypatch, host_direct):
    """Accelerator path (batched): one read a step. CPU path: a few direct reads a step, none per parameter."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(20)])
    opt = torch.optim.SGD(model.parameters(), lr=0.1, weight_decay=0.01)
    from guard import tensors

    calls = {"item": 0, "tolist": 0, "norm": 0}
    item, tolist, norms_init = torch.Tensor.item, torch.Tensor.tolist, tensors.Norms.__init__

    def counting_norm(self, ts, *a, **k):
        calls["norm"] += bool(ts)
        return norms_init(self, ts, *a, **k)

    def counting(name, fn):
        def wrapper(self, *a, **k):
            calls[name] += 1
            return fn(self, *a, **k)
        return wrapper

    monkeypatch.setattr(tensors, "HOST_DIRECT", host_direct)
    with guard(model, opt, live=False, checks=["weight-decay-without-grad", "grad-explosion"]) as g:
        monkeypatch.setattr(torch.Tensor, "item", counting("item", item))
        monkeypatch.setattr(torch.Tensor, "tolist", counting("tolist", tolist))
        monkeypatch.setattr(tensors.Norms, "__init__", counting_norm)
        for _ in range(10):
            opt.zero_grad()
            model(torch.randn(4, 8)).sum().backward()
            opt.step()
        monkeypatch.setattr(torch.Tensor, "item", item)
        monkeypatch.setattr(torch.Tensor, "tolist", tolist)
        monkeypatch.setattr(tensors.Norms, "__init__", norms_init)
    if host_direct:  # the step's few scalars (loss, total norm) and one list of norms: not one per parameter
        assert calls["item"] + calls["tolist"] <= 5 * 10
    else:
        assert calls["item"] == 0 and calls["tolist"] <= 10  # one batched read per step, 40 parameters
    assert calls["norm"] == 10  # the shared gradient norms only (one set a step): healthy weights are not reduced
    assert g.findings == []


# ---------------------------------------------------------------- frozen / missing parameters

def test_finetune_frozen_backbone_in_optimizer_and_new_head_missing():
    g = finetune_optimizer.train(live=False)
    frozen = only(g, "frozen-param-in-optimizer")
    assert frozen.severity == "info" and frozen.where == "backbone" and frozen.step == 0
    assert frozen.details["modules"] == ["backbone"] and frozen.details["parameters"] == 4
    assert "filter(lambda p: p.requires_grad" in frozen.hint
    opt_name = frozen.details["optimizer"]
    assert f"torch.optim.{opt_name}(filter(" in frozen.hint and "torch.optim.X" not in frozen.hint
    missing = only(g, "param-not-in-optimizer")
    assert missing.severity == "warning" and missing.where == "head" and missing.step == 0
    assert missing.details["names"] == ["head.weight", "head.bias"]
    assert "add_param_group" in missing.hint


def test_a_probe_updated_by_an_optimizer_not_given_to_guard_is_not_in_no_optimizer():
    torch.manual_seed(0)
    model = nn.ModuleDict({"enc": nn.Linear(4, 8), "probe": nn.Linear(8, 2)})
    opt = torch.optim.Adam(model.enc.parameters(), lr=1e-3)
    probe_opt = torch.optim.SGD(model.probe.parameters(), lr=0.1)  # only `opt` is handed to guard
    with guard(model, opt, live=False) as g:
        for _ in range(3):
            h = model.enc(torch.randn(8, 4))
            loss = h.pow(2).mean() + nn.functional.cross_entropy(model.probe(h.detach()), torch.randint(0, 2, (8,)))
            opt.zero_grad()
            probe_opt.zero_grad()
            loss.backward()
            opt.step()
            probe_opt.step()
    assert "param-not-in-optimizer" not in kinds(g), g.findings


def _unfreeze_run(add: bool, steps: int = 40, at: int = 10, how: str = "module"):
    """Progressive unfreezing: the optimizer is built over the trainable parameters while the first layer is
    frozen; at step `at` the layer is unfrozen, and (`add`) given to the optimizer as a new group."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))
    m[0].requires_grad_(False)
    opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=3e-3)
    x, y = torch.randn(64, 6), torch.randint(0, 3, (64,))
    with guard(m, opt, live=False) as g:
        for step in range(steps):
            if step == at:
                if how == "module":
                    m[0].requires_grad_(True)
                else:
                    for p in m[0].parameters():
                        p.requires_grad = True
                if add:
                    opt.add_param_group({"params": m[0].parameters(), "lr": 1e-4})
            opt.zero_grad()
            nn.functional.cross_entropy(m(x), y).backward()
            opt.step()
    return g


@pytest.mark.parametrize("how", ["module", "attribute"])
def test_a_layer_unfrozen_mid_run_but_never_added_to_the_optimizer_is_found(how):
    """`m[0].requires_grad_(True)` at step 10 is seen (a patch of Module.requires_grad_): told from that step and line
    (since stop 40); `p.requires_grad = True` is not seen, and is told from the look that finds it, "or a little
    earlier"."""
    g = _unfreeze_run(add=False, how=how)
    f = only(g, "param-not-in-optimizer")
    assert f.severity == "warning" and f.where == "0" and f.details["names"] == ["0.weight", "0.bias"]
    assert f.details["appeared_mid_run"] is True and "pile up" in f.message and "add_param_group" in f.hint
    if how == "module":
        assert f.step == 10 and f.details["unfrozen"] is True and "made trainable at step 10" in f.message
        assert f.source == f.details["unfrozen_at"] and "requires_grad_(True)" in f.message
    else:
        assert 10 <= f.step <= 10 + 16 and "unfrozen or replaced mid-run" in f.message
    assert _unfreeze_run(add=True, how=how).findings == []


def test_a_head_replaced_mid_run_and_left_out_of_the_optimizer_is_found():
    """A new head assigned at step 20 (after the first look): built after the guard started, it is listed at
    the next look, and its parameters, in no optimizer, are reported."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))
    opt = torch.optim.AdamW(m.parameters(), lr=3e-3)
    x, y = torch.randn(64, 6), torch.randint(0, 3, (64,))
    with guard(m, opt, live=False) as g:
        for step in range(60):
            if step == 20:
                m[2] = nn.Linear(16, 3)  # the bug: not handed to the optimizer
            opt.zero_grad()
            nn.functional.cross_entropy(m(x), y).backward()
            opt.step()
    f = only(g, "param-not-in-optimizer")
    assert f.where == "2" and 20 <= f.step <= 20 + 16 and f.details["names"] == ["2.weight", "2.bias"]


def test_a_group_of_frozen_parameters_added_mid_run_is_told():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))
    m[2].requires_grad_(False)
    opt = torch.optim.AdamW(m[0].parameters(), lr=3e-3)
    x, y = torch.randn(64, 6), torch.randint(0, 3, (64,))

    def run(unfreeze):
        with guard(m, opt, live=False) as g:
            for step in range(20):
                if step == 10:
                    opt.add_param_group({"params": m[2].parameters(), "weight_decay": 0.05})
                    if unfreeze:
                        m[2].requires_grad_(True)
                opt.zero_grad()
                nn.functional.cross_entropy(m(x), y).backward()
                opt.step()
        return g

    f = only(run(unfreeze=False), "frozen-param-in-optimizer")
    assert f.severity == "info" and f.where == "2" and f.step == 10 and f.details["added_group"] is True
    assert "add_param_group" in f.message and "requires_grad_(True)" in f.hint
    m[2].requires_grad_(False)
    opt.param_groups.pop()
    assert run(unfreeze=True).findings == []


@pytest.mark.parametrize("unfreeze", [True, False])
def test_gradual_unfreezing_is_not_told_and_a_backbone_frozen_all_run_is_told_from_the_first_step(unfreeze):
    """ULMFiT-style gradual unfreezing: the optimizer holds every layer group from the start, frozen ones included,
    and one group is unfrozen per epoch. That is the method, yet `frozen-param-in-optimizer` was told at the first
    step (stop 45: told at the end, and only when none of them was unfrozen meanwhile, still with the first step)."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 3))
    m[0].requires_grad_(False)
    m[2].requires_grad_(False)
    opt = torch.optim.AdamW(m.parameters(), lr=3e-3, weight_decay=0.0)
    x, y = torch.randn(64, 6), torch.randint(0, 3, (64,))
    with guard(m, opt, live=False) as g:
        for epoch in range(3):
            if unfreeze and epoch >= 1:
                m[4 - 2 * epoch].requires_grad_(True)  # epoch 1: the middle layer, epoch 2: the first
            for _ in range(5):
                opt.zero_grad()
                nn.functional.cross_entropy(m(x), y).backward()
                opt.step()
    if unfreeze:
        assert g.findings == []
    else:
        f = only(g, "frozen-param-in-optimizer")
        assert (f.severity, f.step, f.details["parameters"]) == ("info", 0, 4), f
        assert f.source and f.source.startswith("tests/test_optimizer_checks.py")


def test_pretrained_vectors_frozen_by_from_pretrained_get_the_freeze_false_hint():
    """`nn.Embedding.from_pretrained(vectors)` freezes by default; fine-tuning them was meant, and the optimizer over
    model.parameters() holds them. The hint said only to leave them out of the optimizer (stop 45: freeze=False)."""
    torch.manual_seed(0)
    emb = nn.Embedding.from_pretrained(torch.randn(20, 4))
    head = nn.Linear(4, 2)
    model = nn.Sequential(emb, head)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with guard(model, opt, live=False) as g:
        for _ in range(3):
            opt.zero_grad()
            F.cross_entropy(model(torch.randint(0, 20, (8,))), torch.randint(0, 2, (8,))).backward()
            opt.step()
    f = only(g, "frozen-param-in-optimizer")
    assert "freeze=False" in f.hint and "filter(lambda p: p.requires_grad" in f.hint


def test_frozen_backbone_done_right_is_clean():
    g = finetune_optimizer.train(fixed=True, live=False, checks="all")
    assert g.findings == [] and g.internal_errors == []


def test_gan_with_two_optimizers_under_a_global_guard_is_clean():
    torch.manual_seed(0)
    gen, disc = nn.Linear(4, 4), nn.Linear(4, 1)
    opt_g, opt_d = torch.optim.Adam(gen.parameters(), 1e-3), torch.optim.Adam(disc.parameters(), 1e-3)
    with guard(live=False, checks=["optimizer-params"]) as g:
        for _ in range(4):
            fake = gen(torch.randn(8, 4))
            opt_d.zero_grad()
            disc(fake).mean().backward()  # reaches the generator's params too (no detach)
            opt_d.step()
            opt_g.zero_grad()
            (-disc(gen(torch.randn(8, 4)))).mean().backward()
            opt_g.step()
    assert g.findings == [], g.findings


def test_global_guard_reports_a_parameter_in_no_optimizer():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    opt = torch.optim.SGD(model[0].parameters(), lr=0.1)
    with guard(live=False, checks=["optimizer-params"]) as g:
        for _ in range(3):
            opt.zero_grad()
            model(torch.randn(2, 4)).sum().backward()
            opt.step()
    f = only(g, "param-not-in-optimizer")
    assert f.where == "1" and f.details["names"] == ["1.weight", "1.bias"]


# ---------------------------------------------------------------- gradient explosion

def test_gradient_spike_names_the_largest_parameters():
    g = grad_explosion.train(live=False)
    assert kinds(g) == ["grad-explosion"]
    f = g.findings[0]
    assert f.severity == "warning" and f.step == 25 and f.where == "0.weight"
    assert f.details["ratio"] > 10 and f.details["largest"][0]["name"] == "0.weight"
    assert "clip_grad_norm_" in f.hint and "learning rate" in f.hint
    assert "grad_explosion.py" in f.source


def test_clipped_twin_is_clean():
    g = grad_explosion.train(fixed=True, live=False, checks="all")
    assert g.findings == [] and g.internal_errors == []


def test_a_steady_divergence_is_found_before_it_overflows():
    """No step jumps 2x above the window's largest norm, yet the norms climb 1000x: a learning rate too high."""
    g = diverging_lr.train(live=False)
    assert kinds(g) == ["grad-explosion"]  # 60 steps: found while everything is still finite
    f = g.findings[0]
    assert f.details["diverging"] is True and f.details["ratio"] >= 1000 and 20 <= f.step <= 40
    assert "diverging" in f.message and "learning rate is too high" in f.hint
    steps = [e["step"] for e in g.record.timeline if e.get("grad_norm", 0) > 1e10]
    assert steps and steps[0] > f.step  # told long before the norms reach 1e10


def test_the_divergence_twin_at_a_lower_rate_is_clean():
    g = diverging_lr.train(fixed=True, steps=180, live=False, checks="all")
    assert g.findings == [] and g.internal_errors == []


def _healthy(model, opt, batch, loss_fn, steps):
    with guard(model, opt, live=False, checks="all") as g:
        for i in range(steps):
            x, y = batch()
            opt.zero_grad()
            loss_fn(model(x), y).backward()
            opt.step()
    return g


class _LSTM(nn.Module):
    def __init__(self):
        super().__init__()
        self.rnn, self.out = nn.LSTM(4, 16, batch_first=True), nn.Linear(16, 1)

    def forward(self, x):
        return self.out(self.rnn(x)[0][:, -1])


class _Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(20, 16)
        self.enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 2, 32, dropout=0.1, batch_first=True), 2)
        self.out = nn.Linear(16, 20)

    def forward(self, x):
        return self.out(self.enc(self.emb(x))).flatten(0, 1)


def _case(name):
    w, centers = torch.randn(8, 1), torch.randn(4, 8) * 3
    if name == "mlp-sgd":
        m = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))

        def batch():
            x = torch.randn(16, 8)
            return x, x @ w + 0.1 * torch.randn(16, 1)
        return m, torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9), batch, nn.MSELoss(), 300
    if name == "separable-adam":  # converges to a near-zero loss: tiny norms with relative noise
        m = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 4))

        def batch():
            y = torch.randint(0, 4, (16,))
            return centers[y] + 0.3 * torch.randn(16, 8), y
        return m, torch.optim.Adam(m.parameters(), lr=1e-2), batch, nn.CrossEntropyLoss(), 400
    if name == "cnn-bn-adam":
        m = nn.Sequential(nn.Conv2d(1, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                          nn.Linear(8, 3))
        return (m, torch.optim.Adam(m.parameters(), lr=3e-3),
                lambda: (torch.randn(8, 1, 10, 10), torch.randint(0, 3, (8,))), nn.CrossEntropyLoss(), 300)
    if name == "lstm-adam":
        m = _LSTM()

        def batch():
            x = torch.randn(8, 12, 4)
            return x, 3 * x.mean(dim=(1, 2)).unsqueeze(1)
        return m, torch.optim.Adam(m.parameters(), lr=1e-2), batch, nn.MSELoss(), 300
    m = _Tiny()

    def batch():
        x = torch.randint(0, 20, (8, 6))
        return x, x.flip(1).flatten()
    return m, torch.optim.AdamW(m.parameters(), lr=3e-3, weight_decay=0.01), batch, nn.CrossEntropyLoss(), 200


@pytest.mark.parametrize("name", ["mlp-sgd", "separable-adam", "cnn-bn-adam", "lstm-adam", "transformer-adamw"])
def test_healthy_runs_of_a_few_hundred_steps_are_clean(name):
    model, opt, batch, loss_fn, steps = _case(name)
    g = _healthy(model, opt, batch, loss_fn, steps)
    assert g.findings == [] and g.internal_errors == []
    assert len(g.timeline) == steps


def test_all_zero_gradients_for_the_whole_model_mean_training_stopped():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with guard(model, opt, live=False) as g:
        for _ in range(8):
            x, y = torch.randn(16, 4), torch.randint(0, 3, (16, 1)).float()
            opt.zero_grad()
            nn.functional.mse_loss(model(x).round(), y).backward()  # round() has zero gradient everywhere
            opt.step()
    f = only(g, "grads-all-zero")  # its own kind since issue 19 item 5 (was grad-explosion info)
    assert f.severity == "warning" and f.where == "loss" and f.step == 0
    assert f.details["steps"] == 5 and f.details["cause"] is None
    assert "training has stopped" in f.message
    assert kinds(g) == ["grads-all-zero"]


def _round_every_other_step(every):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with guard(model, opt, live=False, every=every) as g:
        for step in range(24):
            x, y = torch.randn(16, 4), torch.randint(0, 3, (16, 1)).float()
            out = model(x)
            opt.zero_grad()
            nn.functional.mse_loss(out.round() if step % 2 == 0 else out, y).backward()
            opt.step()
    return g


@pytest.mark.parametrize("every", [1, 2])
def test_all_zero_gradients_on_every_other_step_are_no_run_when_sampled(every):
    g = _round_every_other_step(every)
    assert "grads-all-zero" not in kinds(g), g.findings


def test_all_zero_gradients_for_the_whole_model_are_still_caught_under_every_2():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with guard(model, opt, live=False, every=2) as g:
        for _ in range(8):
            x, y = torch.randn(16, 4), torch.randint(0, 3, (16, 1)).float()
            opt.zero_grad()
            nn.functional.mse_loss(model(x).round(), y).backward()
            opt.step()
    f = only(g, "grads-all-zero")
    assert f.step == 0 and f.details["steps"] == 5


# ---------------------------------------------------------------- AMP GradScaler

def _amp_nan_once(fused, steps=6, every=1):
    """nan_grad's bug on one step (step 3), under a CPU GradScaler: the scaler skips that step."""
    torch.manual_seed(0)
    m = nan_grad.Embed()
    opt = torch.optim.AdamW(m.parameters(), lr=0.01, fused=fused)
    scaler = torch.amp.GradScaler("cpu")
    with guard(m, opt, live=False, checks="all", every=every) as g:
        for step in range(steps):
            a = torch.randint(0, 10, (16,))
            b = a.clone() if step == 3 else (a + torch.randint(1, 10, (16,))) % 10
            with torch.autocast("cpu", dtype=torch.bfloat16):
                u, v = m(a, b)
            loss = nan_grad.distance(u.float(), v.float(), False).mean()
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    return g, scaler


@pytest.mark.parametrize("fused", [False, True])
def test_a_step_the_scaler_skips_is_no_error_and_is_marked_in_the_timeline(fused):
    g, scaler = _amp_nan_once(fused)
    assert g.findings == [] and g.internal_errors == []
    assert g.step == 6  # the skipped step still counts
    assert [e["skipped"] for e in g.timeline] == [False, False, False, True, False, False]
    assert scaler.get_scale() == 32768.0
    ok = [e for e in g.timeline if not e["skipped"]]
    # unscaled: the scale (65536) shows neither in the loss nor in the gradient norm
    assert all(e["grad_norm"] < 10 and e["loss"] < 10 for e in ok)
    assert all(e["loss_scale"] in (65536.0, 32768.0) for e in g.timeline)


def test_scaler_step_really_does_not_call_optimizer_step_when_it_skips():
    p = nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([p], lr=0.1)
    calls = []
    opt.register_step_pre_hook(lambda *a: calls.append(1))
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(p.sum()).backward()
    p.grad[0] = float("inf")
    scaler.step(opt)
    assert calls == []  # so the guard learns of a skipped step from the scaler, not from step hooks
    scaler.update()
    opt.zero_grad()
    scaler.scale(p.sum()).backward()
    scaler.step(opt)
    assert calls == [1]



def test_collapsing_scale_is_an_error_the_model_is_not_training():
    """The vocabulary's severity (error): `--fail-on error` and raise mode stop a run that trains nothing."""
    g = amp_skipped.train(live=False)
    assert kinds(g) == ["nonfinite-grad"]
    f = g.findings[0]
    assert f.severity == "error" and f.where == "emb.weight" and f.step == 0
    assert f.details["amp_skipped"] == 17 and f.details["scale"] < 1 and f.last_step >= 16
    assert "not training" in f.message and "detect_anomaly" in f.hint
    assert all(e["skipped"] for e in g.timeline)
    from guard import GuardError

    with pytest.raises(GuardError) as info:
        amp_skipped.train(live=False, mode="raise")
    assert info.value.finding.kind == "nonfinite-grad" and info.value.finding.details["amp_skipped"] >= 16


def test_amp_twin_is_clean():
    g = amp_skipped.train(fixed=True, live=False, checks="all")
    assert g.findings == [] and g.internal_errors == []
    assert not any(e["skipped"] for e in g.timeline)


def test_gradient_norms_taken_before_unscale_are_not_reused():
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu")
    with guard(model, opt, live=False) as g:
        for _ in range(3):
            opt.zero_grad()
            scaler.scale(model(torch.randn(8, 4)).pow(2).mean()).backward()
            g.grad_norms(opt)  # as a check looking at gradients at backward time would
            scaler.step(opt)
            scaler.update()
    assert all(e["grad_norm"] < 100 for e in g.timeline), g.timeline  # not x65536


def test_amp_does_not_trigger_grad_explosion_from_the_scale():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 4, growth_interval=5)  # grows x2 every 5 steps
    with guard(model, opt, live=False, checks="all") as g:
        for _ in range(60):
            x = torch.randn(16, 8)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = nn.functional.mse_loss(model(x).float(), x.sum(1, keepdim=True))
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    assert scaler.get_scale() > 2.0 ** 12  # the scale grew 256-fold during the run
    assert g.findings == [], g.findings


# ---------------------------------------------------------------- timeline and dump

def test_timeline_has_loss_grad_norm_lr_and_skipped_in_the_dump(tmp_path):
    path = tmp_path / "r.json"
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    scaler = torch.amp.GradScaler("cpu")
    with guard(model, opt, live=False, report=str(path)):
        for _ in range(4):
            opt.zero_grad()
            scaler.scale(model(torch.randn(8, 4)).pow(2).mean()).backward()
            scaler.step(opt)
            scaler.update()
            sched.step()
    tl = json.loads(path.read_text())["timeline"]
    assert [e["step"] for e in tl] == [0, 1, 2, 3]
    assert [e["lr"] for e in tl] == [0.1, 0.1, 0.05, 0.05]
    assert all(e["skipped"] is False and e["loss"] > 0 and e["grad_norm"] > 0 for e in tl)


def test_skipped_steps_keep_the_sampling_period():
    g, _ = _amp_nan_once(False, steps=8, every=2)
    # sampled steps, plus the skipped one (a skip is always recorded)
    assert [(e["step"], e["skipped"]) for e in g.timeline] == [(0, False), (2, False), (3, True), (4, False),
                                                                (6, False)]
    assert g.findings == []


def test_freezing_mid_run_with_zero_grads_kept_is_caught_by_a_global_guard():
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, weight_decay=1e-3)
    with guard(live=False) as g:  # no model given: every module call and optimizer is watched
        for step in range(7):
            if step == 2:
                for p in model.layer1.parameters():
                    p.requires_grad = False  # freeze; their old grads stay as zero tensors
            opt.zero_grad(set_to_none=False)
            nn.functional.cross_entropy(model(torch.randn(16, 8)), torch.randint(0, 2, (16,))).backward()
            opt.step()
    f = only(g, "weight-decay-without-grad")
    assert f.where == "layer1" and f.step == 2 and f.details["norm_change_pct"] < 0
    assert kinds(g) == ["weight-decay-without-grad"]


def test_exact_zero_gradient_by_cancellation_is_not_reported():
    """L1 loss: the output bias's gradient is exactly 0 whenever residual signs balance; it is in the graph."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, weight_decay=1e-4)
    zero, longest = 0, 0
    with guard(model, opt, live=False, checks="all") as g:
        for _ in range(200):
            x, y = torch.randn(16, 4), torch.randn(16, 1)
            opt.zero_grad()
            nn.functional.l1_loss(model(x), y).backward()
            zero = zero + 1 if model[2].bias.grad.abs().sum() == 0 else 0
            longest = max(longest, zero)
            opt.step()
    assert longest >= 3  # the precondition: exact zeros for several steps in a row
    assert g.findings == [], g.findings


def test_one_backward_two_optimizers_both_checked():
    torch.manual_seed(0)
    model = Net()
    opt_a = torch.optim.SGD(model.layer1.parameters(), lr=0.1)
    opt_b = torch.optim.SGD(list(model.layer4.parameters()) + list(model.fc.parameters()), lr=0.1,
                            weight_decay=0.01)
    with guard(model, [opt_a, opt_b], live=False) as g:
        for step in range(24):
            opt_a.zero_grad(set_to_none=False)
            opt_b.zero_grad(set_to_none=False)
            out = model(torch.randn(16, 8), deep=step < 1)
            nn.functional.cross_entropy(out, torch.randint(0, 2, (16,))).backward()
            opt_a.step()
            opt_b.step()  # steps after the main optimizer ended the step
    f = only(g, "weight-decay-without-grad")
    # a second optimizer stepping right after the main one updates from that step's gradients: its step
    # is the loop's iteration (1), not the next one the main optimizer's step already counted
    assert f.where == "layer4" and f.details["optimizer"] == "SGD" and f.step == 1


def test_a_trailing_optimizer_without_zero_grad_is_told_at_the_loops_step():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 8), nn.Tanh(), nn.Linear(8, 16))
    enc = torch.optim.Adam(model[0].parameters(), 1e-3)
    dec = torch.optim.Adam(model[2].parameters(), 1e-3)
    with guard(model, [enc, dec], live=False) as g:
        for step in range(6):
            x = torch.randn(16, 16)
            enc.zero_grad()  # dec is never zeroed
            nn.functional.mse_loss(model(x), x).backward()
            enc.step()
            dec.step()
    f = only(g, "missing-zero-grad")
    assert (f.where, f.step, f.last_step, f.count) == ("Adam[1]", 1, 5, 5)
    assert "no zero_grad() after step 0" in f.message
    assert g.report()["steps"] == 6


@pytest.mark.parametrize("spike", [False, True])
def test_a_warm_up_of_one_table_then_the_whole_model_is_no_explosion(spike):
    """A new item table trained alone for 20 steps (`loss.backward(inputs=[model.items.weight])`), then the whole
    model: the MLP's gradients join the total at step 20, which was told as a 74x explosion with a clip-to-0.02 fix
    (stop 45). The window starts again when more parameters have gradients than ever before; a real spike later
    is still told."""
    torch.manual_seed(0)

    class Rec(nn.Module):
        def __init__(self):
            super().__init__()
            self.items = nn.Embedding(50, 8)
            nn.init.normal_(self.items.weight, std=0.01)
            self.mlp = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))

        def forward(self, i):
            return self.mlp(self.items(i)).squeeze(-1)

    model = Rec()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with guard(model, opt, live=False) as g:
        for step in range(60):
            i = torch.randint(0, 50, (64,))
            y = torch.randn(64) * (300.0 if spike and step == 45 else 1.0)
            loss = F.mse_loss(model(i), y)
            opt.zero_grad()
            if step < 20:
                loss.backward(inputs=[model.items.weight])
            else:
                loss.backward()
            opt.step()
    found = [(f.kind, f.step) for f in g.findings]
    assert found == ([("grad-explosion", 45)] if spike else []), g.findings


def test_grad_explosion_is_reported_once_per_burst_and_follows_the_runs_spread():
    """Five exploding steps in a row are one report (count 1); a second burst later counts again.
    The bar follows the run: its ratio to the median is in the details and the message."""
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # lr 0: the norms stay where the data puts them
    with guard(model, opt, live=False, checks=["grad-explosion"]) as g:
        for step in range(60):
            scale = 1000.0 if 20 <= step < 25 or step == 50 else 1.0
            x = torch.randn(32, 4)
            loss = (model(x) * scale).pow(2).mean() / scale
            opt.zero_grad()
            loss.backward()
            opt.step()
    f = only(g, "grad-explosion")
    assert f.step == 20 and f.count == 2 and f.last_step == 50  # two bursts, not six steps
    assert f.details["threshold_ratio"] >= 10 and f.details["ratio"] > f.details["threshold_ratio"]
    assert "vary up to about" in f.message


class Lookahead(torch.optim.Optimizer):
    """Like timm's Lookahead: Optimizer.__init__ is never called, the real optimizer is `_base_optimizer`."""

    def __init__(self, base):
        self._base_optimizer = base
        self.param_groups, self.defaults, self.state = base.param_groups, base.defaults, base.state

    def zero_grad(self, set_to_none=True):
        self._base_optimizer.zero_grad(set_to_none)

    def step(self, closure=None):
        return self._base_optimizer.step(closure)


class Handmade(torch.optim.Optimizer):
    """An optimizer of its own that skips Optimizer.__init__ and wraps none: it cannot be hooked."""

    def __init__(self, params, lr):
        self.param_groups = [{"params": list(params), "lr": lr}]

    @torch.no_grad()
    def step(self, closure=None):
        for p in self.param_groups[0]["params"]:
            p -= self.param_groups[0]["lr"] * p.grad


@pytest.mark.parametrize("wrap", ["lookahead", "handmade"])
def test_optimizers_without_the_step_hook_machinery_do_not_break_guard(wrap):
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = Lookahead(torch.optim.SGD(model.parameters(), lr=0.1)) if wrap == "lookahead" else Handmade(model.parameters(), 0.1)
    with guard(model, opt, live=False) as g:
        for _ in range(4):  # zero_grad() missing: found through the optimizer inside the wrapper
            nn.functional.mse_loss(model(torch.randn(8, 4)), torch.randn(8, 1)).backward()
            opt.step()
    assert g.internal_errors == []
    if wrap == "lookahead":
        assert [(f.kind, f.where, f.step) for f in g.findings] == [("missing-zero-grad", "SGD", 1)]
        assert g.notices == []
    else:
        assert any("Handmade has none of Optimizer's step hooks" in n for n in g.notices)


def test_a_learned_learning_rate_tensor_makes_no_warning_of_guards():
    """Hypergradient code: SGD(lr=log_lr.exp(), differentiable=True) under a global guard, warnings as errors."""
    import warnings

    torch.manual_seed(0)
    log_lr = torch.tensor(-3.0, requires_grad=True)
    w0 = torch.randn(4, requires_grad=True)
    outer = torch.optim.Adam([w0, log_lr], lr=1e-2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with guard(live=False, checks="all") as g:
            for _ in range(3):
                w = w0.clone()
                w.grad = 2 * w.detach()
                torch.optim.SGD([w], lr=log_lr.exp(), differentiable=True).step()
                outer.zero_grad()
                (w ** 2).sum().backward()
                outer.step()
    assert g.internal_errors == [] and [f for f in g.findings if f.severity != "info"] == []


@pytest.mark.parametrize("given", ["none", "head-only"])
def test_an_optimizer_stepping_every_other_batch_is_seen_before_parameters_are_called_missing(given):
    """The encoder's own SGD steps every 2nd batch, the head's Adam every batch: every parameter is in an
    optimizer, though at the first steps only Adam has stepped; a layer truly left out is still reported."""
    torch.manual_seed(0)
    model = nn.ModuleDict({"enc": nn.Linear(10, 16), "head": nn.Linear(16, 3), "extra": nn.Linear(16, 3)})
    oe = torch.optim.SGD(model["enc"].parameters(), 0.05)
    oh = torch.optim.Adam(model["head"].parameters(), 1e-2)
    with guard(model, None if given == "none" else oh, live=False) as g:
        for i in range(12):
            h = torch.relu(model["enc"](torch.randn(8, 10)))
            loss = nn.functional.cross_entropy(model["head"](h) + model["extra"](h), torch.randint(0, 3, (8,)))
            loss.backward()
            oh.step()
            oh.zero_grad()
            if i % 2 == 1:
                oe.step()
                oe.zero_grad()
            model["extra"].zero_grad()
    (f,) = [f for f in g.findings if f.kind == "param-not-in-optimizer"]
    assert f.where == "extra" and f.step == 0 and f.details["names"] == ["extra.weight", "extra.bias"]


class PlainLookahead:
    """A Lookahead that is no Optimizer at all (the common copy-pasted form): the real one is `.optimizer`."""

    def __init__(self, optimizer, k=2, alpha=0.5):
        self.optimizer, self.k, self.alpha, self.n = optimizer, k, alpha, 0
        self.slow = [p.detach().clone() for g in optimizer.param_groups for p in g["params"]]

    def zero_grad(self):
        self.optimizer.zero_grad()

    def step(self):
        self.optimizer.step()
        self.n += 1
        if self.n % self.k == 0:
            with torch.no_grad():
                for s, p in zip(self.slow, (p for g in self.optimizer.param_groups for p in g["params"])):
                    s += self.alpha * (p - s)
                    p.copy_(s)


class MultipleOptimizer:
    """Two optimizers stepped together (sparse embeddings with SparseAdam, the rest with AdamW)."""

    def __init__(self, *optimizers):
        self.optimizers = list(optimizers)

    def zero_grad(self):
        for o in self.optimizers:
            o.zero_grad()

    def step(self):
        for o in self.optimizers:
            o.step()


class LARC:
    """apex.parallel.LARC, trimmed: a plain class keeping the optimizer in `.optim` (SwAV, VISSL)."""

    def __init__(self, optimizer, trust_coefficient=0.02):
        self.optim, self.trust_coefficient = optimizer, trust_coefficient

    @property
    def param_groups(self):
        return self.optim.param_groups

    def zero_grad(self):
        self.optim.zero_grad()

    def step(self):
        self.optim.step()


@pytest.mark.parametrize("holder", ["lookahead", "multiple", "larc"])
def test_an_optimizer_holder_that_is_no_optimizer_is_watched_through_what_it_holds(holder):
    """guard(model, holder) takes a holder's optimizers (`.optimizer`, `.optimizers`) instead of refusing it:
    the healthy loop is silent, the same loop without zero_grad() is reported at the inner optimizer."""
    def run(zero):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
        if holder == "lookahead":
            opt = PlainLookahead(torch.optim.SGD(model.parameters(), lr=0.05))
        elif holder == "larc":
            opt = LARC(torch.optim.SGD(model.parameters(), lr=0.05))
        else:
            opt = MultipleOptimizer(torch.optim.SGD(model[0].parameters(), lr=0.05),
                                    torch.optim.AdamW(model[2].parameters(), lr=1e-3))
        x, y = torch.randn(16, 4), torch.randn(16, 1)
        with guard(model, opt, live=False, checks="all") as g:
            for _ in range(6):
                if zero:
                    opt.zero_grad()
                nn.functional.mse_loss(model(x), y).backward()
                opt.step()
        return g

    healthy = run(zero=True)
    assert healthy.findings == [] and healthy.internal_errors == [] and healthy.notices == []
    assert "missing-zero-grad" in kinds(run(zero=False))


def test_a_target_network_given_gradients_is_told_to_compute_under_no_grad():
    """DQN with the TD target computed outside no_grad and the target synced every 20 steps, both networks given to
    guard: one param-not-in-optimizer about the target (not "the optimizer was built over another copy")."""
    import copy

    torch.manual_seed(0)
    q = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 2))
    target = copy.deepcopy(q)
    opt = torch.optim.Adam(q.parameters(), lr=1e-3)
    with guard([q, target], opt, live=False) as g:
        for step in range(60):
            o, a, r, o2 = torch.randn(8, 4), torch.randint(0, 2, (8,)), torch.randn(8), torch.randn(8, 4)
            y = r + 0.99 * target(o2).max(1).values  # the bug: no torch.no_grad()
            loss = nn.functional.smooth_l1_loss(q(o).gather(1, a[:, None]).squeeze(1), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            if step % 20 == 0:
                target.load_state_dict(q.state_dict())
    assert kinds(g) == ["param-not-in-optimizer"]
    f = g.findings[0]
    assert f.where == "target" and f.step == 0 and f.details["synced_copy"] is True
    assert "torch.no_grad()" in f.hint and "requires_grad_(False)" in f.hint


@pytest.mark.parametrize("fixed", [False, True])
def test_a_target_network_guard_does_not_watch_given_gradients_is_found(fixed):
    """guard(q, opt), the usual call: the DQN target made by deepcopy is not given, yet the TD target computed
    outside no_grad gives its parameters gradients every step."""
    import contextlib
    import copy

    torch.manual_seed(0)
    q = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 2))
    target = copy.deepcopy(q)
    opt = torch.optim.Adam(q.parameters(), lr=1e-3)
    with guard(q, opt, live=False, checks="all") as g:
        for step in range(30):
            o, a, r, o2 = torch.randn(8, 4), torch.randint(0, 2, (8,)), torch.randn(8), torch.randn(8, 4)
            with (torch.no_grad() if fixed else contextlib.nullcontext()):
                y = r + 0.99 * target(o2).max(1).values
            loss = nn.functional.smooth_l1_loss(q(o).gather(1, a[:, None]).squeeze(1), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
    if fixed:
        assert g.findings == [] and g.internal_errors == []
        return
    assert kinds(g) == ["param-not-in-optimizer"]
    f = g.findings[0]
    assert f.where == "target" and f.details["outside_watched_models"] is True and f.details["owner"] == "target"
    assert f.step == 1 and "torch.no_grad()" in f.hint and "which guard does not watch" in f.message


@pytest.mark.parametrize("in_optimizer", [False, True])
def test_a_temperature_left_out_of_every_optimizer_is_found_with_two_backwards_per_step(in_optimizer):
    """SAC's `log_alpha = nn.Parameter(...)`, its loss added to the actor's, then the critic's own backward: the
    walk for parameters outside the watched models looks at every backward of its step (the critic's alone does
    not reach it). Under TORCH_GUARD=1; held by an optimizer of its own, nothing is told."""
    torch.manual_seed(0)
    actor, critic = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 2)), nn.Linear(6, 1)
    log_alpha = nn.Parameter(torch.zeros(1))
    a_opt, c_opt = torch.optim.Adam(actor.parameters(), 1e-3), torch.optim.Adam(critic.parameters(), 1e-3)
    al_opt = torch.optim.Adam([log_alpha], 1e-3) if in_optimizer else None
    with guard(live=False) as g:
        for _ in range(14):
            s = torch.randn(16, 4)
            a = actor(s)
            logp = -a.pow(2).sum(-1)
            alpha_loss = -(log_alpha * (logp - 2.0).detach()).mean()
            actor_loss = (log_alpha.exp().detach() * logp - critic(torch.cat([s, a], -1)).squeeze(-1)).mean()
            a_opt.zero_grad()
            if al_opt is not None:
                al_opt.zero_grad()
            (actor_loss + alpha_loss).backward()
            a_opt.step()
            if al_opt is not None:
                al_opt.step()
            c_loss = (critic(torch.cat([s, a.detach()], -1)).squeeze(-1) - 1).pow(2).mean()
            c_opt.zero_grad()
            c_loss.backward()
            c_opt.step()
    if in_optimizer:
        assert g.findings == [] and g.internal_errors == []
        return
    (f,) = g.findings
    assert (f.kind, f.where, f.step) == ("param-not-in-optimizer", "log_alpha", 1)
    assert f.details["outside_watched_models"] is True and "add_param_group" in f.hint

def test_a_learnable_loss_weight_left_out_of_the_optimizer_is_named():
    """Uncertainty weighting: `log_vars` is an nn.Parameter of no module, and the optimizer is built over the
    model's parameters only: the task weights never learn."""
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    log_vars = nn.Parameter(torch.zeros(2))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    with guard(model, opt, live=False) as g:
        for _ in range(12):
            out, y = model(torch.randn(8, 4)), torch.randn(8, 2)
            per_task = ((out - y) ** 2).mean(0)
            loss = (torch.exp(-log_vars) * per_task + log_vars).sum()
            opt.zero_grad()
            loss.backward()
            opt.step()
    f = [f for f in g.findings if f.kind == "param-not-in-optimizer"]
    assert f and f[0].where == "log_vars" and f[0].details["names"] == ["log_vars"]
    assert f[0].hint.startswith("Add them to the optimizer: optimizer.add_param_group({'params': [log_vars]})")


def test_an_object_that_holds_no_optimizer_is_still_refused():
    from guard import ConfigError

    class Junk:
        def step(self):
            pass

    with pytest.raises(ConfigError, match="optimizer=Junk object is not a torch.optim.Optimizer"):
        guard(nn.Linear(2, 2), Junk())


def test_a_loop_that_trains_a_deep_copy_is_told_where_the_copy_was_made():
    """The optimizer is built over the model; a Trainer deep-copies the model and trains the copy: nothing the
    optimizer holds ever gets a gradient. The notice names the copy's line (not torch.compile)."""
    import copy

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    x, y = torch.randn(16, 8), torch.randint(0, 3, (16,))
    with guard(model, opt, live=False) as g:
        trained = copy.deepcopy(model)  # the bug: train `model`, or build the optimizer over `trained`
        for _ in range(3):
            opt.zero_grad()
            nn.functional.cross_entropy(trained(x), y).backward()
            opt.step()
    (note,) = [n for n in g.notices if "no call of the watched model" in n]
    assert "copied at tests/test_optimizer_checks.py:" in note and "copy.deepcopy" in note
    assert "torch.compile" not in note
    with guard(model, opt, live=False) as g:  # the original trained: no notice
        copy.deepcopy(model)  # a snapshot kept for comparison
        for _ in range(3):
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
    assert g.notices == [] and g.findings == []
    with guard(model, opt, live=False) as g:  # master weights: the copy computes, its gradients go to the original
        half = copy.deepcopy(model)
        for _ in range(3):
            half.zero_grad()
            nn.functional.cross_entropy(half(x), y).backward()
            for pm, ph in zip(model.parameters(), half.parameters()):
                pm.grad = ph.grad.clone()
            opt.step()
            with torch.no_grad():
                for pm, ph in zip(model.parameters(), half.parameters()):
                    ph.copy_(pm)
    assert not any("copied at" in n for n in g.notices)


@pytest.mark.parametrize("steps", [10, 30])
def test_models_of_earlier_rounds_kept_alive_are_not_parameters_in_no_optimizer(steps):
    """A fresh model and optimizer per round (active learning, restarts) under a global guard, the earlier models
    kept in a list: their gradients are what their last step left, not gradients still coming."""
    torch.manual_seed(0)
    x, y = torch.randn(64, 8), torch.randint(0, 3, (64,))
    kept = []
    with guard(live=False) as g:
        for _ in range(3):
            m = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
            opt = torch.optim.Adam(m.parameters(), 1e-2)
            for _ in range(steps):
                loss = F.cross_entropy(m(x), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
            kept.append(m)
    assert g.findings == [] and g.internal_errors == []


def test_a_weight_rebound_to_a_new_parameter_every_step_is_in_no_optimizer():
    """`emb.weight = nn.Parameter(F.normalize(...))` each batch (renormalize by re-binding): the optimizer holds the
    first weight, the live one gets gradients nothing applies (the parameter list was cached and went stale)."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Embedding(20, 8), nn.Linear(8, 1))
    opt = torch.optim.SGD(m.parameters(), 0.1)
    with guard(m, opt, live=False) as g:
        for _ in range(40):
            m[0].weight = nn.Parameter(F.normalize(m[0].weight.detach(), dim=1))
            loss = m(torch.randint(0, 20, (16,))).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    f = [f for f in g.findings if f.kind == "param-not-in-optimizer"]
    assert len(f) == 1 and f[0].where == "0" and f[0].details["names"] == ["0.weight"]


def test_an_lr_range_test_diverging_on_purpose_is_no_gradient_explosion():
    """torch-lr-finder/fastai: the learning rate grows by one factor each step until the loss diverges, then the
    model and optimizer are restored. While the rate grows geometrically, no gradient spike is an explosion."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=1.3)
    x, y = torch.randn(64, 8), torch.randn(64, 1)
    start = ({k: v.clone() for k, v in model.state_dict().items()}, opt.state_dict())
    with guard(model, opt, live=False) as g:
        norms = []
        for _ in range(45):
            loss = F.mse_loss(model(x), y)
            if not torch.isfinite(loss) or loss.item() > 1e6:
                break
            opt.zero_grad()
            loss.backward()
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf"))))
            opt.step()
            sched.step()
        model.load_state_dict(start[0])
        opt.load_state_dict(start[1])
    assert max(norms) > 50 * norms[0]  # it did diverge
    assert "grad-explosion" not in kinds(g), g.findings


def test_a_branch_whose_parts_have_no_gradient_beside_a_learning_norm_bias_is_one_finding():
    """A RetinaNet box branch with no positive anchor all run (its loss 0): its convs and its GroupNorm weights get
    exact-zero gradients, while the GroupNorm biases learn (a small regulariser reaches them). The zero parts are
    several module prefixes inside one branch: one finding at the branch, not one per part (5 warnings before)."""
    torch.manual_seed(0)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = nn.Linear(8, 16)
            self.cls = nn.Linear(16, 3)
            self.reg = nn.Sequential(nn.Linear(16, 16), nn.LayerNorm(16), nn.ReLU(), nn.Linear(16, 4))

    net = Net()
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2, weight_decay=0.1)
    with guard(net, opt, live=False) as g:
        for _ in range(60):
            h = torch.relu(net.body(torch.randn(32, 8)))
            box = net.reg(h)
            loss = F.cross_entropy(net.cls(h), torch.randint(0, 3, (32,))) + 0.0 * box.abs().sum() \
                + 1e-3 * net.reg[1].bias.pow(2).sum()
            opt.zero_grad()
            loss.backward()
            opt.step()
    f = [f for f in g.findings if f.kind == "weight-decay-without-grad"]
    assert [x.where for x in f] == ["reg"], g.findings
    assert "5 parameter(s)" in f[0].message


@pytest.mark.parametrize("in_optimizer", [True, False])
def test_a_head_whose_loss_term_is_weighted_by_zero(in_optimizer):
    """Multi-task loss with w_b = 0.0: head b's gradients are computed as exactly 0 every step. In an AdamW group
    with weight decay it shrinks without signal (found); left out of the optimizer on purpose, it misses nothing."""
    torch.manual_seed(0)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = nn.Linear(8, 16)
            self.a, self.b = nn.Linear(16, 1), nn.Linear(16, 1)

    net = Net()
    params = net.parameters() if in_optimizer else [p for n, p in net.named_parameters() if not n.startswith("b.")]
    opt = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
    with guard(net, opt, live=False) as g:
        for _ in range(60):
            h = torch.relu(net.body(torch.randn(32, 8)))
            loss = net.a(h).pow(2).mean() + 0.0 * net.b(h).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    if in_optimizer:
        f = [f for f in g.findings if f.kind == "weight-decay-without-grad"]
        assert len(f) == 1 and f[0].where == "b" and "computed as exactly 0" in f[0].message
        assert "weighted by 0" in f[0].hint and "rare batches" in f[0].hint
        assert "nothing to learn from in these batches" in f[0].message
    else:
        assert g.findings == [], g.findings
    assert g.internal_errors == []


def test_a_detection_box_head_without_positives_for_a_while_is_training():
    """Background-only batches give the box branch exactly-zero gradients (a sum over no positive anchor): for the
    first 12 steps, then in 1 batch of 5. Weight decay runs meanwhile; that is training, not a head without signal."""
    torch.manual_seed(0)

    class Head(nn.Module):
        def __init__(self):
            super().__init__()
            self.body, self.cls, self.box = nn.Linear(8, 16), nn.Linear(16, 3), nn.Linear(16, 4)

    m = Head()
    opt = torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9, weight_decay=1e-4)
    with guard(m, opt, live=False) as g:
        for step in range(80):
            f = torch.relu(m.body(torch.randn(16, 8)))
            y, target = torch.randint(0, 3, (16,)), torch.randn(16, 4)
            pos = (y > 0) & torch.tensor(not (step < 12 or step % 5 == 0))
            box = m.box(f)
            loss = F.cross_entropy(m.cls(f), y) + F.smooth_l1_loss(box[pos], target[pos], reduction="sum") / max(1, int(pos.sum()))
            opt.zero_grad()
            loss.backward()
            opt.step()
    assert "weight-decay-without-grad" not in [f.kind for f in g.findings], g.findings


def test_a_block_added_mid_run_and_left_out_of_the_optimizer_is_named_whole():
    """Progressive growing without a new optimizer: the block's zero-initialised last layer gets gradients first;
    the rest of the block (no gradient signal yet) is named with it."""
    torch.manual_seed(0)

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2 = nn.Linear(8, 8), nn.Linear(8, 8)
            nn.init.zeros_(self.fc2.weight)
            nn.init.zeros_(self.fc2.bias)

        def forward(self, x):
            return x + self.fc2(torch.relu(self.fc1(x)))

    model = nn.Sequential(nn.Linear(4, 8), nn.ModuleList([Block()]), nn.Linear(8, 2))
    model.forward = lambda x: model[2](model[1][-1](model[0](x)) if len(model[1]) == 1
                                       else model[1][1](model[1][0](model[0](x))))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with guard(model, opt, live=False) as g:
        for step in range(40):
            if step == 8:
                model[1].append(Block())  # the bug: the optimizer is not re-created
            loss = F.cross_entropy(model(torch.randn(8, 4)), torch.randint(0, 2, (8,)))
            opt.zero_grad()
            loss.backward()
            opt.step()
    f = [f for f in g.findings if f.kind == "param-not-in-optimizer"][0]
    assert f.where == "1.1.fc2"
    assert "(the rest of 1.1, 2 parameter(s) with no gradient signal yet, is in no optimizer either)" in f.message
    assert f.details["rest_of_module"] == ["1.1.fc1.weight", "1.1.fc1.bias"]


def test_parameters_taken_out_of_the_optimizer_but_still_trainable_are_told_as_removed():
    """Freezing a backbone by popping its param group (requires_grad left True): the warning says they were taken
    out of the optimizer and the fix is requires_grad_(False), not "unfrozen mid-run, add them back"."""
    torch.manual_seed(0)
    backbone, head = nn.Sequential(nn.Linear(10, 32), nn.ReLU()), nn.Linear(32, 3)
    model = nn.Sequential(backbone, head)
    opt = torch.optim.SGD([{"params": backbone.parameters()}, {"params": head.parameters()}], lr=0.05)
    with guard(model, opt, live=False) as g:
        for step in range(60):
            if step == 20:
                opt.param_groups.pop(0)
            loss = F.cross_entropy(model(torch.randn(16, 10)), torch.randint(0, 3, (16,)))
            opt.zero_grad()
            loss.backward()
            opt.step()
    (f,) = g.findings
    assert (f.kind, f.where) == ("param-not-in-optimizer", "0")
    assert "were taken out of the optimizer (SGD) after step 16" in f.message and "requires_grad_(False)" in f.hint
    assert f.details["removed_from_optimizer"] is True


@pytest.mark.parametrize("taught_first", [False, True])
def test_weight_decay_message_names_momentum_only_when_it_holds_something(taught_first):
    """AdamW over a branch whose gradients are all 0: weighted by 0 from the start, its exp_avg holds nothing and
    the message does not name AdamW's momentum; taught for 3 steps, then left out of the graph with its gradients
    zeroed in place (zero_grad(set_to_none=False)), its momentum keeps moving it and the message says so."""
    torch.manual_seed(0)
    body, branch = nn.Linear(8, 8), nn.Linear(8, 8)
    opt = torch.optim.AdamW(list(body.parameters()) + list(branch.parameters()), lr=1e-2, weight_decay=0.5)
    model = nn.ModuleDict({"body": body, "branch": branch})
    with guard(model, opt, live=False) as g:
        for step in range(60):
            x = torch.randn(16, 8)
            loss = body(x).pow(2).mean()
            if not taught_first:
                loss = loss + 0.0 * branch(x).pow(2).mean()
            elif step < 3:
                loss = loss + branch(x).pow(2).mean()
            opt.zero_grad(set_to_none=False)
            loss.backward()
            opt.step()
    f = [f for f in g.findings if f.kind == "weight-decay-without-grad" and f.where == "branch"]
    assert f and (("AdamW's momentum from earlier steps" in f[0].message) == taught_first)


def _assign_load_run(steps, rebuild):
    """Train; at step 15 reload the model's own checkpoint with `load_state_dict(..., assign=True)` (new Parameter
    objects), then build a new Adam over them (the old one still referenced) or keep the old one."""
    import io

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 2))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    with guard(model, opt, live=False) as g:
        for step in range(steps):
            if step == 15:
                buf = io.BytesIO()
                torch.save(model.state_dict(), buf)
                buf.seek(0)
                model.load_state_dict(torch.load(buf, weights_only=True), assign=True)
                if rebuild:
                    old, opt = opt, torch.optim.Adam(model.parameters(), lr=1e-2)
            loss = F.cross_entropy(model(torch.randn(16, 6)), torch.randint(0, 2, (16,)))
            opt.zero_grad()
            loss.backward()
            opt.step()
    return g


def test_parameters_replaced_by_an_assign_load_are_not_told_as_an_optimizer_over_another_copy():
    """`load_state_dict(..., assign=True)` at step 15 gives the model new Parameter objects the optimizer does not
    hold: told from step 15 on (the backward reaches none of the optimizer's parameters, the new ones are in no
    optimizer), not as "the optimizer was built over another copy, nothing changed in 20 steps" at step 0."""
    g = _assign_load_run(40, rebuild=False)
    kinds = {f.kind: f.step for f in g.findings}
    assert "params-not-updating" not in kinds
    assert kinds.get("loss-disconnected") == 15 and kinds.get("param-not-in-optimizer", 0) >= 15


def test_an_optimizer_rebuilt_after_an_assign_load_takes_the_step_count_over_at_once():
    """`load_state_dict(..., assign=True)` gives every parameter a new identity, then a new Adam is built over
    them: it steps all of the model's parameters, so it succeeds the old one after 2 steps (not 16), and the
    step numbers follow the loop."""
    g = _assign_load_run(30, rebuild=True)
    assert g.findings == [] and g.step == 30
    assert any("stepped 2 times" in n and "which it replaces" in n for n in g.notices)


def _pgd(model, x, y, k=4, eps=0.1):
    delta = torch.zeros_like(x).uniform_(-eps, eps).requires_grad_(True)
    for _ in range(k):
        F.cross_entropy(model(x + delta), y).backward()  # fills delta.grad, and the parameters' .grad too
        delta.data = (delta + 0.03 * delta.grad.sign()).clamp(-eps, eps)
        delta.grad.zero_()
    return delta.detach()


@pytest.mark.parametrize("zero_grad_at", ["before the attack", "after the attack", "autograd.grad attack"])
def test_an_attacks_backward_calls_before_the_training_backward_without_zero_grad(zero_grad_at):
    """PGD adversarial training whose attack takes its input gradients with loss.backward() in eval mode: with
    zero_grad() before the attack, the attack's backward calls leave the model's gradients in .grad and the step
    applies them (missing-zero-grad). zero_grad() between the attack and the training backward, or an attack
    through torch.autograd.grad, is clean."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(16, 32), nn.ReLU(), nn.Dropout(0.1), nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    with guard(model, opt, live=False) as g:
        for _ in range(6):
            x, y = torch.rand(16, 1, 4, 4), torch.randint(0, 4, (16,))
            if zero_grad_at == "before the attack":
                opt.zero_grad()
            model.eval()
            if zero_grad_at == "autograd.grad attack":
                delta = torch.zeros_like(x).requires_grad_(True)
                for _ in range(4):
                    gd, = torch.autograd.grad(F.cross_entropy(model(x + delta), y), delta)
                    delta = (delta + 0.03 * gd.sign()).clamp(-0.1, 0.1).detach().requires_grad_(True)
                d = delta.detach()
            else:
                d = _pgd(model, x, y)
            model.train()
            if zero_grad_at != "before the attack":
                opt.zero_grad()
            F.cross_entropy(model(x + d), y).backward()
            opt.step()
    if zero_grad_at == "before the attack":
        (f,) = g.findings
        assert (f.kind, f.where, f.step) == ("missing-zero-grad", "SGD", 0)
        assert f.message.startswith("4 backward() calls for the gradient of an input")
        assert "torch.autograd.grad" in f.hint and f.details["input_backwards"] == 4
    else:
        assert g.findings == []


def test_several_losses_on_inputs_that_require_grad_in_training_mode_are_no_attack():
    """A PINN: two losses on collocation points that require grad (their derivatives through autograd.grad) and
    a boundary loss, each with its own backward() and one step: deliberate accumulation, in training mode."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(1, 16), nn.Tanh(), nn.Linear(16, 1))
    opt = torch.optim.Adam(net.parameters(), 1e-2)
    with guard(net, opt, live=False) as g:
        for _ in range(6):
            opt.zero_grad()
            for _ in range(2):
                x = torch.rand(32, 1).requires_grad_(True)
                u = net(x)
                du, = torch.autograd.grad(u.sum(), x, create_graph=True)
                (du + u).pow(2).mean().backward()
            net(torch.zeros(1, 1)).sub(1).pow(2).mean().backward()
            opt.step()
    assert g.findings == []


def test_master_weights_never_copied_back_are_named_with_the_copy_back_fix():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1)).half()
    master = [p.detach().float().clone().requires_grad_() for p in model.parameters()]
    opt = torch.optim.SGD(master, lr=1e-2)
    x, y = torch.randn(32, 8), torch.randn(32, 1)
    with guard(model, opt, live=False) as g:
        for _ in range(4):
            loss = F.mse_loss(model(x.half()).float(), y)
            model.zero_grad(set_to_none=True)
            loss.backward()
            for m, p in zip(master, model.parameters()):
                m.grad = p.grad.float()
            opt.step()  # the copy back into the half-precision model is missing
    (f,) = [f for f in g.findings if f.severity != "info"]
    assert f.kind == "param-not-in-optimizer" and f.where == "0" and f.step == 0
    assert "fp32 master weights" in f.message and "p.copy_(m)" in f.hint and f.details["master_copies"]


@pytest.mark.parametrize("as_parameter", [False, True])
def test_global_guard_counts_the_model_optimizer_not_an_inner_solve_over_plain_tensors(as_parameter):
    """CAGrad/MGDA-style: each iteration solves for task weights with a fresh SGD([w]) over a plain tensor (10
    steps) before the model's optimizer steps. The model's optimizer counts the steps, from its first step on.
    The same with `w` an `nn.Parameter` that no model holds (counted 240 steps for 24 before stop 44)."""
    def run(nan_at):
        torch.manual_seed(0)
        with guard(live=False) as g:
            model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            x, y = torch.randn(64, 4), torch.randn(64, 2)
            for it in range(24):
                xb = x.clone()
                if it == nan_at:
                    xb[0, 0] = float("nan")
                per_task = ((model(xb) - y) ** 2).mean(0)
                w = nn.Parameter(torch.zeros(2)) if as_parameter else torch.zeros(2, requires_grad=True)
                w_opt = torch.optim.SGD([w], lr=0.5)
                for _ in range(10):
                    w_opt.zero_grad()
                    (torch.softmax(w, 0) * per_task.detach()).sum().backward()
                    w_opt.step()
                loss = (torch.softmax(w.detach(), 0) * per_task).sum()
                opt.zero_grad(); loss.backward(); opt.step()
                if it == nan_at:
                    break
        return g

    g = run(None)
    assert g.findings == [] and g.record.notices == [] and g.step == 24
    g = run(5)
    assert [(f.kind, f.step) for f in g.findings] == [("nonfinite-input", 5)]


def test_parameters_in_a_plain_list_attribute_are_named_with_the_parameterlist_fix():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 8)
            self.gains = [nn.Parameter(torch.ones(8)) for _ in range(2)]  # not an nn.ParameterList

        def forward(self, x):
            h = self.fc(x)
            for g in self.gains:
                h = torch.tanh(h * g)
            return h.sum(1)

    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with guard(model, opt, live=False) as g:
        for _ in range(12):
            loss = (model(torch.randn(16, 4)) - 1).pow(2).mean()
            opt.zero_grad(); loss.backward(); opt.step()
    (f,) = [f for f in g.findings if f.kind == "param-not-in-optimizer"]
    assert f.where == "model.gains" and "plain Python list attribute (`model.gains`)" in f.message
    assert "self.gains = nn.ParameterList([...])" in f.hint
    assert sorted(f.details["names"]) == ["model.gains[0]", "model.gains[1]"]


def test_global_guard_names_a_teacher_copied_mid_run_and_left_trainable_as_a_second_model():
    """LwF/distillation: `teacher = copy.deepcopy(model)` mid-run, called outside no_grad and not frozen."""
    import copy

    torch.manual_seed(0)
    with guard(live=False) as g:
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        teacher = None
        for step in range(60):
            if step == 20:
                teacher = copy.deepcopy(model)
            x = torch.randn(16, 8)
            out = model(x)
            loss = F.cross_entropy(out, torch.randint(0, 3, (16,)))
            if teacher is not None:
                loss = loss + F.kl_div(F.log_softmax(out, 1), F.softmax(teacher(x), 1), reduction="batchmean")
            opt.zero_grad(); loss.backward(); opt.step()
    (f,) = [f for f in g.findings if f.kind == "param-not-in-optimizer"]
    assert f.where == "teacher" and "a model that appeared mid-run" in f.message
    assert "teacher or target network" in f.hint and "torch.no_grad()" in f.hint and f.details["second_model"] == ["teacher"]


def test_a_weight_rebound_to_a_new_parameter_in_every_forward_gets_the_in_place_fix():
    class SNLinear(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.randn(8, 8) / 3)

        def forward(self, x):
            with torch.no_grad():
                sigma = torch.linalg.matrix_norm(self.weight, 2)
            self.weight = nn.Parameter(self.weight / sigma)  # a new Parameter at every call
            return x @ self.weight.t()

    torch.manual_seed(0)
    model = nn.Sequential(SNLinear(), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with guard(model, opt, live=False) as g:
        for _ in range(12):
            loss = model(torch.randn(16, 8)).pow(2).mean()
            opt.zero_grad(); loss.backward(); opt.step()
    (f,) = [f for f in g.findings if f.kind == "param-not-in-optimizer"]
    assert f.where == "0" and "replaced by a new nn.Parameter again and again" in f.message
    assert "self.weight.copy_(" in f.hint and f.details["rebound_per_call"]


def test_a_hyperparameter_whose_optimizer_steps_once_per_inner_loop_is_in_an_optimizer():
    """Bilevel tuning: `log_wd` is in its own optimizer, which steps after each inner loop of 10 steps. The inner
    backward reaches it; guard, which knows an optimizer from its first step, must not call it "in no optimizer"
    before that step. A bare parameter really left out is still told."""
    for left_out in (False, True):
        torch.manual_seed(0)
        model = nn.Linear(5, 1)
        log_wd = nn.Parameter(torch.tensor(-3.0))
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        hopt = torch.optim.SGD([torch.zeros(1, requires_grad=True)] if left_out else [log_wd], lr=0.1)
        x, y = torch.randn(50, 5), torch.randn(50, 1)
        with guard(live=False) as g:
            for _ in range(3):
                for _ in range(10):
                    loss = F.mse_loss(model(x), y) + log_wd.exp() * model.weight.pow(2).sum()
                    opt.zero_grad(); loss.backward(); opt.step()
                hopt.zero_grad()
                if not left_out:
                    log_wd.grad = torch.tensor(0.1)  # a stand-in hypergradient
                hopt.step()
        found = [f for f in g.findings if f.kind == "param-not-in-optimizer"]
        assert [f.where for f in found] == (["log_wd"] if left_out else [])


class _HandSGD(torch.optim.Optimizer):
    """Momentum SGD written by hand; `how` is how step() writes a parameter."""

    def __init__(self, params, how, lr=0.05):
        super().__init__(params, dict(lr=lr))
        self.how = how

    @torch.no_grad()
    def step(self, closure=None):
        for grp in self.param_groups:
            for p in grp["params"]:
                if p.grad is None:
                    continue
                buf = self.state[p].setdefault("buf", torch.zeros_like(p))
                buf.mul_(0.9).add_(p.grad)
                if self.how == "rebind":
                    p = p - grp["lr"] * buf  # the bug: re-binds the loop variable
                elif self.how == "data":
                    p.data = p.data - grp["lr"] * buf  # old style, correct
                else:
                    p.add_(buf, alpha=-grp["lr"])


@pytest.mark.parametrize("how", ["rebind", "data", "in place"])
def test_a_hand_written_step_that_writes_nothing_is_not_updating(how):
    """A hand-written optimizer whose step() re-binds the loop variable (`p = p - lr * buf`) never changes the
    model: told after two 16-step windows without a change, from the first. Writing `.data` or in place is fine."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 2))
    opt = _HandSGD(model.parameters(), how)
    with guard(model, opt, live=False) as g:
        for _ in range(50):
            x, y = torch.randn(24, 10), torch.randint(0, 2, (24,))
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad(); loss.backward(); opt.step()
    found = [f for f in g.findings if f.kind == "params-not-updating"]
    if how != "rebind":
        assert g.findings == []
        return
    assert len(found) == 1 and (found[0].where, found[0].step) == ("0.weight", 0)
    assert found[0].details["step_writes_nothing"] and "_HandSGD.step() has not changed" in found[0].message
    assert "p.add_(d, alpha=-lr)" in found[0].hint


def test_darts_unrolled_copy_made_every_step_is_no_parameter_left_out():
    """Second-order DARTS under a global guard: a deep copy of the model (the virtual step) is made at every step,
    back-propagated, and its architecture gradient read by hand. No optimizer should hold it; the copy guard looked
    at is gone by the time it would be told."""
    import copy

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.body, self.head, self.alpha = nn.Linear(4, 8), nn.Linear(8, 2), nn.Parameter(torch.zeros(8))

        def forward(self, x):
            return self.head(torch.relu(self.body(x)) * self.alpha.sigmoid())

    torch.manual_seed(0)
    model = Net()
    weights = [p for n, p in model.named_parameters() if n != "alpha"]
    w_opt, a_opt = torch.optim.SGD(weights, lr=0.05), torch.optim.Adam([model.alpha], lr=3e-3)
    x, y = torch.randn(64, 4), torch.randint(0, 2, (64,))
    with guard(live=False) as g:
        for _ in range(20):
            a_opt.zero_grad()
            unrolled = copy.deepcopy(model)
            grads = torch.autograd.grad(F.cross_entropy(model(x[:32]), y[:32]), weights)
            with torch.no_grad():
                for p, gi in zip([q for n, q in unrolled.named_parameters() if n != "alpha"], grads):
                    p.sub_(0.05 * gi)
            F.cross_entropy(unrolled(x[32:]), y[32:]).backward()
            model.alpha.grad = unrolled.alpha.grad.clone()
            a_opt.step()
            w_opt.zero_grad(); F.cross_entropy(model(x[:32]), y[:32]).backward(); w_opt.step()
    assert [f for f in g.findings if f.severity != "info"] == []


def test_a_weight_rebound_after_every_step_is_told_from_the_step_it_began():
    """A sparse autoencoder's decoder renormalised by a new nn.Parameter after each step: the optimizer keeps
    the first one from step 1 on. Not "a layer unfrozen mid-run" (whose add_param_group fix would add a group
    per step), and at the step the re-binding began, not the look that found it."""
    class SAE(nn.Module):
        def __init__(self):
            super().__init__()
            self.enc, self.W_dec = nn.Linear(16, 32), nn.Parameter(F.normalize(torch.randn(32, 16), dim=1))

        def forward(self, x):
            return F.relu(self.enc(x)) @ self.W_dec

    torch.manual_seed(0)
    m = SAE()
    opt = torch.optim.Adam(m.parameters(), lr=1e-3)
    with guard(m, opt, live=False) as g:
        for _ in range(40):
            x = torch.randn(64, 16)
            loss = F.mse_loss(m(x), x)
            opt.zero_grad(); loss.backward(); opt.step()
            m.W_dec = nn.Parameter(F.normalize(m.W_dec.detach(), dim=1))  # the bug
    (f,) = [f for f in g.findings if f.kind == "param-not-in-optimizer"]
    assert (f.where, f.step) == ("W_dec", 1) and "again and again" in f.message and "since step 1" in f.message
    assert "self.weight.copy_(" in f.hint and f.details["rebound_per_call"] and not f.details["appeared_mid_run"]


@pytest.mark.parametrize("lr", [1e-5, 0.5])
def test_half_precision_weights_stepped_directly_whose_updates_round_away(lr):
    """model.half() stepped by SGD: lr x gradient below half an fp16 step of weights of order 1 rounds away."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.sign(p) * (1 + p.abs()))  # "pretrained" weights of order 1
    model = model.half()
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    x, y = torch.randn(64, 8), torch.randn(64, 1)
    with guard(model, opt, live=False) as g:
        for _ in range(52):
            loss = F.mse_loss(model(x.half()).float(), y)
            opt.zero_grad(); loss.backward(); opt.step()
    found = [f for f in g.findings if f.kind == "params-not-updating"]
    if lr == 0.5:
        assert found == []
        return
    (f,) = found
    assert f.where == "0.weight" and f.step == 0 and f.details["rounded_away"] and "torch.autocast" in f.hint
    assert "float16 weights the optimizer steps directly" in f.message


def test_half_precision_matrices_that_round_away_are_told_while_zero_started_biases_move():
    """model.bfloat16() with biases starting at 0 (as nn.TransformerEncoderLayer's do): near 0 bfloat16 numbers are
    dense, so the biases move while every weight matrix's update rounds away. The sample looks at the matrices."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 1))
    with torch.no_grad():
        for m in model:
            if isinstance(m, nn.Linear):
                m.weight.copy_(torch.sign(m.weight) * (1 + m.weight.abs()))
                m.bias.zero_()
    model = model.bfloat16()
    opt = torch.optim.SGD(model.parameters(), lr=1e-5)
    x, y = torch.randn(64, 8), torch.randn(64, 1)
    with guard(model, opt, live=False) as g:
        for _ in range(52):
            loss = F.mse_loss(model(x.bfloat16()).float(), y)
            opt.zero_grad(); loss.backward(); opt.step()
    assert not torch.equal(model[0].bias, torch.zeros_like(model[0].bias))  # the biases did move
    (f,) = [f for f in g.findings if f.kind == "params-not-updating"]
    assert f.where == "0.weight" and f.details["parameters"] == ["0.weight", "2.weight", "4.weight"]
    assert "bfloat16 weights the optimizer steps directly" in f.message


@pytest.mark.parametrize("copied_back", [False, True])
def test_master_weights_never_copied_back_are_told(copied_back):
    """Hand-rolled mixed precision: a bfloat16 model, float32 master copies in the optimizer, gradients moved over
    each step. Without the copy back, the model that computes the loss never changes (silent until stop 40)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1)).bfloat16()
    params = list(model.parameters())
    master = [p.detach().float().clone().requires_grad_(True) for p in params]
    opt = torch.optim.AdamW(master, lr=1e-3)
    x, y = torch.randn(32, 8), torch.randn(32, 1)
    with guard(live=False) as g:
        for _ in range(24):
            loss = F.mse_loss(model(x.bfloat16()).float(), y)
            loss.backward()
            for m, p in zip(master, params):
                m.grad, p.grad = p.grad.float(), None
            opt.step()
            opt.zero_grad()
            if copied_back:
                with torch.no_grad():
                    for p, m in zip(params, master):
                        p.copy_(m)
    found = [f for f in g.findings if f.kind == "params-not-updating"]
    if copied_back:
        assert found == []
        return
    (f,) = found
    assert f.where == "Sequential" and f.step == 0 and f.details["master_weights"] is True
    assert "float32 copies of the 4 bfloat16 parameters" in f.message and "p.copy_(m)" in f.hint


def test_a_hand_written_optimizer_used_again_on_a_same_shaped_model_keeps_the_check_on():
    """A hand-written optimizer class over one model, then a new instance over a fresh model of the same shapes (a
    resume): the stuck-update look compared the two models' samples as lists, element-wise, and raised; the check
    switched itself off (an internal error until stop 40). Now silent, and still on."""

    class SGDh(torch.optim.Optimizer):
        def __init__(self, params, lr=0.01):
            super().__init__(params, dict(lr=lr))

        @torch.no_grad()
        def step(self):
            for grp in self.param_groups:
                for p in grp["params"]:
                    if p.grad is not None:
                        p.add_(p.grad, alpha=-grp["lr"])

    torch.manual_seed(0)
    kept = []  # the first model stays alive (a script's global)
    with guard(live=False) as g:
        for _ in range(2):
            m = nn.Linear(3, 2)
            kept.append(m)
            o = SGDh(m.parameters())
            for _ in range(40):
                o.zero_grad()
                m(torch.randn(4, 3)).pow(2).mean().backward()
                o.step()
    assert g.internal_errors == [] and g.findings == []
    assert any(c.name == "params-not-updating" for c in g.checks)


def test_weight_decay_stays_quiet_about_zero_gradients_that_follow_a_nan():
    """Auto-decoder codes at zero with a `sqrt(sum z^2)` regulariser: NaN gradients at step 0 make the codes NaN,
    and the decoder fed NaN then gets all-zero gradients (l1's backward of NaN). The NaN is the one finding; the
    zero gradients after it are its consequence, not a frozen phase for weight decay."""
    torch.manual_seed(0)

    class AutoDec(nn.Module):
        def __init__(self):
            super().__init__()
            self.codes = nn.Embedding(40, 8, sparse=True)
            nn.init.zeros_(self.codes.weight)
            self.dec = nn.Sequential(nn.Linear(11, 64), nn.ReLU(), nn.Linear(64, 1))

        def forward(self, sid, xyz):
            z = self.codes(sid)
            return self.dec(torch.cat([z[:, None].expand(-1, xyz.size(1), -1), xyz], -1)).squeeze(-1), z

    model = AutoDec()
    sopt = torch.optim.SparseAdam(list(model.codes.parameters()), lr=1e-2)
    dopt = torch.optim.Adam(model.dec.parameters(), lr=1e-3)
    with guard(model, [sopt, dopt], live=False) as g:
        for _ in range(10):
            sid, xyz = torch.randint(0, 40, (6,)), torch.rand(6, 64, 3) * 2 - 1
            pred, z = model(sid, xyz)
            loss = F.l1_loss(pred, xyz.norm(dim=-1).clamp(-0.1, 0.1)) + 1e-3 * z.pow(2).sum(-1).sqrt().mean()
            sopt.zero_grad(); dopt.zero_grad(); loss.backward(); sopt.step(); dopt.step()
    assert [(f.kind, f.where, f.step) for f in g.findings] == [("nonfinite-grad", "codes.weight", 0)]


def _length_buckets(make_opt, cliff=False):
    """A loss summed over frames (reduction='sum' / batch size) with a rare long bucket: that batch's loss and
    gradient are both ~15x the usual ones. With `cliff`, one step's gradient alone is scaled (the loss not)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 4))
    opt = make_opt(model.parameters())
    with guard(model, opt, live=False, checks=["grad-explosion"]) as g:
        for step in range(40):
            frames = 2000 if step in (15, 30) and not cliff else 20
            x = torch.randn(4, frames, 6)
            y = torch.randint(0, 4, (4, frames))
            loss = F.cross_entropy(model(x).reshape(-1, 4), y.reshape(-1), reduction="sum") / 4
            opt.zero_grad()
            loss.backward()
            if cliff and step == 15:
                for p in model.parameters():
                    p.grad.mul_(50.0)  # an exploding gradient the loss does not show (an RNN's cliff)
            opt.step()
    return g


@pytest.mark.parametrize("name", ["Adam", "SGD"])
def test_a_heavier_batch_summed_over_more_frames_is_no_explosion_for_adam(name):
    """Adam normalises its update per element: the long bucket's 15x gradient, with a 15x loss, moves nothing
    far. SGD's update grows with it: told, as the heavier batch it is, with the normalise-the-loss fix."""
    make = (lambda ps: torch.optim.Adam(ps, lr=1e-3)) if name == "Adam" else (lambda ps: torch.optim.SGD(ps, lr=1e-4))
    g = _length_buckets(make)
    if name == "Adam":
        assert g.findings == [] and g.internal_errors == []
    else:
        f = only(g, "grad-explosion")
        assert f.step == 15 and f.details["heavier_batch"] is True and f.details["loss_ratio"] > 5
        assert "heavier batch" in f.message and "Normalise the loss" in f.hint


def test_an_adam_gradient_spike_the_loss_does_not_show_is_still_an_explosion():
    """Told, with a hint for a normalised step: Adam's update grows a few times at most, not "far" (stop 40)."""
    g = _length_buckets(lambda ps: torch.optim.Adam(ps, lr=1e-3), cliff=True)
    f = only(g, "grad-explosion")
    assert f.step == 15 and "heavier_batch" not in f.details
    assert "Adam normalises its step" in f.hint and "about to jump far" not in f.hint


@pytest.mark.parametrize("glob", [False, True])
def test_a_learnable_tensor_kept_as_a_plain_attribute_is_told_with_the_nn_parameter_fix(glob):
    """`self.trans = torch.zeros(3, 3, requires_grad=True)` (a CRF's transition matrix) is no nn.Parameter:
    model.parameters() and so the optimizer miss it, and its gradients pile up."""

    class Tagger(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 3)
            self.trans = torch.zeros(3, requires_grad=True)  # the bug

        def forward(self, x):
            return self.lin(x) + self.trans

    torch.manual_seed(0)
    m = Tagger()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    with guard(None if glob else m, opt, live=False) as g:
        for _ in range(12):
            loss = F.cross_entropy(m(torch.randn(8, 4)), torch.randint(0, 3, (8,)))
            opt.zero_grad()
            loss.backward()
            opt.step()
    f = only(g, "param-not-in-optimizer")
    assert f.where == "trans" and f.details["plain_tensor_attribute"] is True and f.step == 1
    assert "self.trans = nn.Parameter(torch.zeros(3))" in f.hint


def test_an_optimizer_over_a_model_built_again_is_told_as_training_a_copy():
    """`opt = SGD(model.parameters())`, then `model = Net()` (or a deep copy) and the loop trains the new one: the
    loss reaches only tensors shaped one-for-one like the optimizer's. The finding says the optimizer trains a copy,
    with the rebuild-the-optimizer fix; a new head left out of the optimizer keeps the left-out wording."""
    def net():
        return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))

    torch.manual_seed(0)
    x, y = torch.randn(32, 8), torch.randint(0, 2, (32,))
    model = net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model = net()  # the bug: built again after the optimizer
    with guard(model, opt, live=False) as g:
        for _ in range(4):
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
    (f,) = [f for f in g.findings if f.kind == "loss-disconnected"]
    assert f.step == 0 and f.details.get("model_copy") is True and "rebound_input" not in f.details
    assert "SGD trains a copy of the model" in f.message
    assert "optimizer = torch.optim.SGD(model.parameters(), ...)" in f.hint
    body = net()
    head = nn.Linear(16, 2)  # a head that alone computes the loss, never handed to the optimizer
    opt = torch.optim.SGD(body.parameters(), lr=0.1)
    with guard(head, opt, live=False) as g:
        for _ in range(4):
            opt.zero_grad()
            nn.functional.cross_entropy(head(torch.randn(32, 16)), y).backward()
            opt.step()
    (f,) = [f for f in g.findings if f.kind == "loss-disconnected"]
    assert "model_copy" not in f.details and "left out when the optimizer was built" in f.message


def test_a_branch_weighted_by_zero_for_a_warm_up_then_trained_is_not_told():
    """BBN's cumulative learning: the re-balancing branch's term is weighted by 0 for the whole first epoch, then
    trained. Its gradients are computed as exactly 0 meanwhile and SGD's weight decay shrinks it a little: a warm-up
    by design, judged when the run ends (a term weighted by 0 to the end is still told, see above)."""
    torch.manual_seed(0)
    x, y = torch.randn(256, 10), torch.randn(256, 10)[:, :3].argmax(1)
    shared, conv_b, rebal_b, fc = nn.Linear(10, 32), nn.Linear(32, 16), nn.Linear(32, 16), nn.Linear(32, 3)
    model = nn.ModuleList([shared, conv_b, rebal_b, fc])
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=2e-4)
    with guard(model, opt, live=False) as g:
        for epoch in range(3):
            alpha = 1 - (epoch / 3) ** 2  # 1.0 for the whole first epoch
            for _ in range(35):
                i1, i2 = torch.randint(0, 256, (32,)), torch.randint(0, 256, (32,))
                h1, h2 = F.relu(shared(x[i1])), F.relu(shared(x[i2]))
                out = fc(torch.cat([alpha * F.relu(conv_b(h1)), (1 - alpha) * F.relu(rebal_b(h2))], 1))
                loss = alpha * F.cross_entropy(out, y[i1]) + (1 - alpha) * F.cross_entropy(out, y[i2])
                opt.zero_grad()
                loss.backward()
                opt.step()
    assert g.findings == [], g.findings


def _masked_depth(empty_until):
    """Depth regression with a validity mask; the mask selects nothing for the first `empty_until` steps."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 8, 3, 1, 1), nn.ReLU(), nn.Conv2d(8, 1, 3, 1, 1), nn.Softplus())
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    with guard(net, opt, live=False) as g:
        for step in range(24):
            img = torch.randn(2, 3, 8, 8)
            gt = (img[:, :1].abs() * 3).clamp(0.1, 9.9)
            valid = (gt > 10.0).float() if step < empty_until else (gt < 10.0).float()
            loss = ((net(img) - gt).abs() * valid).sum() / valid.sum().clamp_min(1)
            opt.zero_grad()
            loss.backward()
            opt.step()
    return g


def test_a_loss_that_is_zero_at_every_step_of_the_run_is_told_at_its_end():
    """A validity mask with its comparison reversed selects nothing: the loss is exactly 0 and every gradient 0 at
    each of the run's steps. A step of 0 is nothing to learn (no reward, a met margin), so it is judged at the end:
    all of the run is told; a mask empty only for the first steps is not."""
    g = _masked_depth(empty_until=24)
    (f,) = g.findings
    assert (f.kind, f.where, f.step) == ("grads-all-zero", "loss", 0) and f.details["loss_always_zero"] is True
    assert "exactly 0 at every one of the run's 24 training steps" in f.message and "mask.sum()" in f.hint
    assert _masked_depth(empty_until=6).findings == []


def _triplet_run(margin, steps=60, wd=0.0, sep=3.0):
    """A batch-hard triplet hinge on two well-separated classes: with a small margin it converges to exactly 0 after
    some training; with a margin of -1 the untrained embeddings meet it from the second step on."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 4))
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2, weight_decay=wd)
    centers = torch.randn(2, 6) * sep
    with guard(net, opt, live=False) as g:
        for step in range(steps):
            y = torch.arange(16) % 2
            x = centers[y] + 0.1 * torch.randn(16, 6)
            e = net(x)
            d = torch.cdist(e, e)
            same = y[:, None] == y[None, :]
            d_ap = (d * same).amax(1)
            d_an = (d + 1e3 * same).amin(1)
            loss = F.relu(d_ap - d_an + (0.5 if step == 0 and margin < 0 else margin)).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    return g, loss.item()


def test_a_triplet_hinge_that_converged_to_zero_is_no_parameter_left_without_gradient():
    """Batch-all plus batch-hard triplet losses on well-separated identities: after some training every margin is met,
    the loss and every gradient are exactly 0 for the rest of the run, and Adam's momentum still moves the weights a
    little. `weight-decay-without-grad` told each layer as left without a gradient while momentum moves it (stop 45);
    nothing is left out there, and a converged hinge is no stopped run."""
    torch.manual_seed(51)
    x = torch.randn(12, 20).repeat_interleave(6, 0) * 1.5 + torch.randn(72, 20)
    y = torch.arange(12).repeat_interleave(6)
    emb = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 16))
    opt = torch.optim.Adam(emb.parameters(), lr=1e-3)

    def batch_all(e, t, margin=0.5):
        d = torch.cdist(e, e)
        same = t[:, None] == t[None, :]
        valid = (same & ~torch.eye(len(t), dtype=torch.bool)).unsqueeze(2) & (~same).unsqueeze(1)
        trip = F.relu(d.unsqueeze(2) - d.unsqueeze(1) + margin) * valid
        return trip.sum() / (trip > 1e-16).sum().clamp_min(1)

    zero = 0
    with guard(emb, opt, live=False) as g:
        for _ in range(200):
            idx = torch.cat([torch.nonzero(y == c).squeeze(1) for c in torch.randperm(12)[:6]])
            loss = batch_all(emb(x[idx]), y[idx])
            zero += loss.item() == 0.0
            opt.zero_grad()
            loss.backward()
            opt.step()
    assert zero >= 40
    assert g.findings == [], g.findings


def test_a_margin_met_from_the_second_step_is_a_run_that_trains_nothing():
    """A margin the untrained embeddings meet from the second step on (here -1): one step trained, then the loss is
    exactly 0. It was told by `weight-decay-without-grad` as gradients zeroed in place after backward (stop 45:
    `grads-all-zero`, a loss of 0 at every step, judged at the run's end as for a run that never trained)."""
    g, last = _triplet_run(margin=-1.0, wd=0.01)
    assert last == 0.0
    (f,) = g.findings
    assert (f.kind, f.where) == ("grads-all-zero", "loss") and f.details["loss_always_zero"] is True
    assert "hinge or margin that every sample meets" in f.hint


@pytest.mark.parametrize("scale", [80.0, 1.0])
def test_a_run_that_diverges_within_its_first_steps_is_told(scale):
    """Depth regressed in raw metres (0-80) with SGD at lr 0.01 and momentum: the norm goes 127 -> 1e6 by step 2 and
    the loss with it, before the 10 steps that set the explosion's window. Told from the start, with the normalise-
    the-target fix. The same net on targets in [0, 1] is silent."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 8, 3, 1, 1), nn.ReLU(), nn.Conv2d(8, 8, 3, 1, 1), nn.ReLU(), nn.Conv2d(8, 1, 3, 1, 1))
    opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
    with guard(net, opt, live=False) as g:
        for _ in range(12):
            img = torch.rand(4, 3, 8, 8)
            loss = F.mse_loss(net(img), scale * img.mean(1, keepdim=True))
            opt.zero_grad()
            loss.backward()
            opt.step()
    found = [f for f in g.findings if f.kind == "grad-explosion"]
    if scale == 1.0:
        assert found == [] and [f for f in g.findings if f.severity != "info"] == []
        return
    (f,) = found
    assert f.step <= 4 and f.details["from_start"] is True and "diverges from the start" in f.message
    assert "normalise the target" in f.hint


def test_a_loss_up_a_hundred_thousandfold_with_its_gradient_is_no_heavier_batch():
    """An L1 loss whose input blows up 1e5x at one step (an unstable rollout): loss and gradient grow together, as
    a heavier batch's do, but no batch is that much heavier. Told as an explosion, not as a heavier batch."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with guard(model, opt, live=False) as g:
        for step in range(30):
            x = torch.randn(16, 4)
            y = torch.randn(16, 1)
            loss = F.l1_loss(model(x), y) * (1e5 if step == 25 else 1.0)
            opt.zero_grad()
            loss.backward()
            opt.step()
    (f,) = [f for f in g.findings if f.kind == "grad-explosion"]
    assert f.step == 25 and "heavier_batch" not in f.details and "heavier batch" not in f.message


@pytest.mark.parametrize("how", ["bare", "inputs", "autograd_grad", "zero_grad_between"])
def test_forces_taken_with_a_bare_backward_pollute_the_parameters_grad(how):
    """A force field: `E.sum().backward(create_graph=True); F = -pos.grad` also writes dE/dθ into the parameters'
    .grad, and the loss's backward adds onto it: the step applies both. Told at the optimizer, with the
    autograd.grad fix. `backward(inputs=[pos])`, torch.autograd.grad, or a zero_grad() between are silent."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 16), nn.Tanh(), nn.Linear(16, 1))
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    with guard(net, opt, live=False) as g:
        for _ in range(4):
            x = torch.randn(8, 4, 3)
            opt.zero_grad()
            pos = x.clone().requires_grad_(True)
            e = net(pos).sum((1, 2))
            if how == "autograd_grad":
                force = -torch.autograd.grad(e.sum(), pos, create_graph=True)[0]
            else:
                e.sum().backward(inputs=[pos] if how == "inputs" else None, create_graph=True)
                force = -pos.grad
                if how == "zero_grad_between":
                    opt.zero_grad()
            loss = (e - (x ** 2).sum((1, 2))).pow(2).mean() * 0.01 + (force + 2 * x).pow(2).mean()
            loss.backward()
            opt.step()
            pos.grad = None
    found = [f for f in g.findings if f.kind == "missing-zero-grad"]
    if how != "bare":
        assert found == [], found
        return
    (f,) = found
    assert (f.where, f.step) == ("Adam", 0) and f.details["create_graph"] is True
    assert "backward(create_graph=True) for the gradient of an input" in f.message
    assert "torch.autograd.grad(E.sum(), pos, create_graph=True)" in f.hint


def test_a_second_network_trained_after_the_primary_steps_is_missing_from_the_start():
    """Co-teaching with the second optimizer built over the first network by a typo: net2 is called and
    back-propagated from step 0, after the primary's step (so the first look saw no gradient on it). Told as left out
    from step 0, not as a model that appeared mid-run."""
    torch.manual_seed(0)

    def mk():
        return nn.Sequential(nn.Linear(10, 16), nn.ReLU(), nn.Linear(16, 4))

    net1, net2 = mk(), mk()
    opt1 = torch.optim.Adam(net1.parameters(), lr=1e-3)
    opt2 = torch.optim.Adam(net1.parameters(), lr=1e-3)  # the bug: net2.parameters()
    with guard([net1, net2], [opt1, opt2], live=False) as g:
        for _ in range(30):
            x, t = torch.randn(32, 10), torch.randint(0, 4, (32,))
            loss1 = F.cross_entropy(net1(x), t)
            loss2 = F.cross_entropy(net2(x), t)
            opt1.zero_grad(); loss1.backward(); opt1.step()
            opt2.zero_grad(); loss2.backward(); opt2.step()
    f = [f for f in g.findings if f.kind == "param-not-in-optimizer"]
    assert len(f) == 1 and f[0].where == "net2" and f[0].step == 0, f
    assert "appeared mid-run" not in f[0].message and "second_model" not in f[0].details


def test_follow_on_findings_of_gradients_piling_up_or_wiped_are_not_told():
    """Two causes with consequences that other rules would see: gradients piling up without zero_grad() blow up
    within the first steps (not an early divergence to lower the learning rate for), and gradients wiped by a
    zero_grad() between backward and step leave the first layers with none (not a cut in the graph)."""
    torch.manual_seed(0)
    feat = nn.Sequential(nn.Linear(8, 16), nn.PReLU(), nn.Linear(16, 4))
    centers = nn.Parameter(torch.randn(3, 4))
    opt, opt_c = torch.optim.SGD(feat.parameters(), lr=0.01), torch.optim.SGD([centers], lr=0.5)
    with guard(feat, [opt, opt_c], live=False) as g:
        for _ in range(6):
            x, y = torch.randn(32, 8), torch.randint(0, 3, (32,))
            f = feat(x)
            loss = (f - centers[y]).pow(2).sum(1).mean()
            opt.zero_grad()  # the bug: opt_c.zero_grad() missing
            loss.backward()
            opt.step()
            opt_c.step()
    assert "missing-zero-grad" in [f.kind for f in g.findings] and "grad-explosion" not in [f.kind for f in g.findings]
    torch.manual_seed(0)
    pi = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 2))
    v = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1))
    model = nn.ModuleDict({"pi": pi, "v": v})
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with guard(model, opt, live=False) as g:
        for _ in range(30):
            s = torch.randn(16, 4)
            pi(s).logsumexp(-1).mean().backward()
            opt.zero_grad()  # the bug: wipes the policy's gradients
            v(s).pow(2).mean().backward()
            opt.step()
    kinds_ = [f.kind for f in g.findings]
    assert "zero-grad-before-step" in kinds_ and "vanishing-gradients" not in kinds_


def _iql_value_step(scope, steps_v):
    """IQL's value net with its own optimizer: `v_opt.zero_grad(); v_loss.backward()` every iteration, and
    `v_opt.step()` only when `steps_v` (dropped: the bug)."""
    torch.manual_seed(0)
    q, v = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 1)), nn.Sequential(nn.Linear(4, 16), nn.ReLU(),
                                                                                      nn.Linear(16, 1))
    q_opt, v_opt = torch.optim.Adam(q.parameters(), 1e-3), torch.optim.Adam(v.parameters(), 1e-3)
    models, opts = ([q, v], [q_opt, v_opt]) if scope == "models" else (None, None)
    with guard(models, opts, live=False) as g:
        for _ in range(16):
            s, a, r = torch.randn(32, 4), torch.randn(32, 2), torch.randn(32, 1)
            with torch.no_grad():
                tq = q(torch.cat([s, a], 1))
            diff = tq - v(s)
            v_opt.zero_grad()
            (torch.where(diff > 0, 0.7, 0.3) * diff.pow(2)).mean().backward()
            if steps_v:
                v_opt.step()
            with torch.no_grad():
                y = r + 0.99 * v(s)
            q_opt.zero_grad()
            nn.functional.mse_loss(q(torch.cat([s, a], 1)), y).backward()
            q_opt.step()
    return g


@pytest.mark.parametrize("scope", ["models", "global"])
def test_an_optimizer_whose_step_was_dropped_is_named_at_the_end(scope):
    """Its zero_grad() and the backward run every iteration, its step() never: the value net never changes.
    Told at the end of the run, naming the optimizer's variable and the network it holds; with the step, silent."""
    g = _iql_value_step(scope, steps_v=False)
    (f,) = g.findings
    assert (f.kind, f.step) == ("params-not-updating", 0) and f.where in ("v", "1")
    assert f.details["never_stepped"] is True and f.details["variable"] == "v_opt"
    assert "v_opt.step()" in f.hint
    assert _iql_value_step(scope, steps_v=True).findings == []


@pytest.mark.parametrize("scope", ["models", "global"])
@pytest.mark.parametrize("fixed", [False, True])
def test_polyak_targets_run_with_grad_are_found(scope, fixed):
    """TD3's targets, deep-copied and Polyak-updated in place at every step, evaluated outside no_grad for the TD
    target: their gradients pile up and nothing uses them. Changed in place, they used to pass for parameters
    trained some other way."""
    import contextlib
    import copy

    torch.manual_seed(0)
    actor = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 2), nn.Tanh())
    critic = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 1))
    actor_t, critic_t = copy.deepcopy(actor), copy.deepcopy(critic)
    a_opt, c_opt = torch.optim.Adam(actor.parameters(), 1e-3), torch.optim.Adam(critic.parameters(), 1e-3)
    models, opts = ([actor, critic], [c_opt, a_opt]) if scope == "models" else (None, None)
    with guard(models, opts, live=False) as g:
        for _ in range(14):
            s, a, r, s2 = torch.randn(16, 4), torch.rand(16, 2) * 2 - 1, torch.randn(16, 1), torch.randn(16, 4)
            with (torch.no_grad() if fixed else contextlib.nullcontext()):
                y = r + 0.99 * critic_t(torch.cat([s2, actor_t(s2)], -1))
            c_opt.zero_grad()
            nn.functional.mse_loss(critic(torch.cat([s, a], -1)), y).backward()
            c_opt.step()
            a_opt.zero_grad()
            (-critic(torch.cat([s, actor(s)], -1)).mean()).backward()
            a_opt.step()
            with torch.no_grad():
                for net, tgt in ((actor, actor_t), (critic, critic_t)):
                    for p, pt in zip(net.parameters(), tgt.parameters()):
                        pt.lerp_(p, 0.005)
    if fixed:
        assert g.findings == [] and g.internal_errors == []
        return
    (f,) = g.findings
    assert f.kind == "param-not-in-optimizer" and f.where in ("actor_t", "critic_t") and f.step <= 1
    assert f.details["polyak_target"] is True and "torch.no_grad()" in f.hint
    assert "actor_t" in f.message and "critic_t" in f.message


def _resampled_decoder(rebind, renorm=True, scope="model"):
    """A sparse autoencoder whose decoder is renormalised in place after each step and re-initialised once at
    step 20 (dead latents resampled): by re-binding a new nn.Parameter (the bug: Adam keeps the old one), or by
    writing into the one Adam holds."""
    torch.manual_seed(0)

    class SAE(nn.Module):
        def __init__(self):
            super().__init__()
            self.enc = nn.Linear(16, 64)
            self.W_dec = nn.Parameter(nn.functional.normalize(torch.randn(64, 16), dim=-1))

        def forward(self, x):
            f = torch.relu(self.enc(x))
            return f @ self.W_dec, f

    sae = SAE()
    opt = torch.optim.Adam(sae.parameters(), 1e-3)
    with guard(sae if scope == "model" else None, opt if scope == "model" else None, live=False) as g:
        for step in range(40):
            x = torch.randn(32, 16)
            recon, f = sae(x)
            loss = (recon - x).pow(2).sum(-1).mean() + 1e-3 * f.sum(-1).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            if renorm:
                with torch.no_grad():
                    sae.W_dec.div_(sae.W_dec.norm(dim=-1, keepdim=True))
            if step == 20:
                new = nn.functional.normalize(torch.randn(64, 16), dim=-1)
                if rebind:
                    sae.W_dec = nn.Parameter(new)
                else:
                    with torch.no_grad():
                        sae.W_dec.copy_(new)
    return g


@pytest.mark.parametrize("scope", ["model", "global"])
@pytest.mark.parametrize("renorm", [True, False])
def test_a_parameter_replaced_once_while_the_optimizer_keeps_the_old_one_is_no_polyak_target(renorm, scope):
    """Renormalised in place after each step, the new decoder moved while its gradients piled up: it was told as a
    Polyak target, whose fix (no_grad or freezing) would stop it training for good."""
    g = _resampled_decoder(rebind=True, renorm=renorm, scope=scope)
    (f,) = g.findings
    assert (f.kind, f.step) == ("param-not-in-optimizer", 21) and f.where.endswith("W_dec")
    assert f.details["replaced"] is True and "Polyak" not in f.message and "still holds the old one" in f.message
    assert "copy_(" in f.hint and "requires_grad_(False)" not in f.hint
    assert _resampled_decoder(rebind=False, renorm=renorm, scope=scope).findings == []


@pytest.mark.parametrize("scope", ["model", "global"])
def test_center_loss_centers_updated_by_hand_from_their_gradient_are_no_polyak_target(scope):
    """Center loss: `centers` is an nn.Parameter in no optimizer, updated by hand from its `.grad` after each
    backward, then `centers.grad.zero_()`. It moves in place and its .grad is the same tensor, but the code uses and
    clears it: no gradient piles up (the .grad was written more often than backward() accumulated into it). Told as
    a Polyak target run with grad since stop 36's rule."""
    torch.manual_seed(0)
    net, fc = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 4)), nn.Linear(4, 3)
    centers = nn.Parameter(torch.zeros(3, 4))
    opt = torch.optim.SGD([*net.parameters(), *fc.parameters()], lr=0.05, momentum=0.9)
    model = nn.ModuleDict({"net": net, "fc": fc})
    with guard(model, opt, live=False) if scope == "model" else guard(live=False) as g:
        for _ in range(24):
            y = torch.randint(0, 3, (16,))
            f = net(torch.randn(16, 6) + y[:, None])
            loss = F.cross_entropy(fc(f), y) + 0.005 * (f - centers[y]).pow(2).sum(1).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            with torch.no_grad():
                centers -= 0.5 * centers.grad / 0.01
                centers.grad.zero_()
    assert not [f for f in g.findings if f.details.get("polyak_target")], g.findings
    assert g.internal_errors == []


@pytest.mark.parametrize("attack", ["gradient-matching", "plain"])
def test_a_fixed_model_whose_gradients_an_attack_matches_is_not_left_out_of_the_optimizer(attack):
    """Deep Leakage from Gradients: LBFGS optimises a dummy input and label so that the fixed victim's gradients
    (torch.autograd.grad over `net.parameters()`, a generator, with create_graph=True) match the ones observed. The
    victim's own .grad is a by-product, and requires_grad=False (the old hint) would break the attack. Optimising an
    input through an unfrozen model without gradient matching is still told."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(12, 24), nn.Sigmoid(), nn.Linear(24, 5))
    x_true, y_true = torch.rand(1, 12), torch.tensor([3])
    true_grads = [g.detach() for g in torch.autograd.grad(F.cross_entropy(net(x_true), y_true), net.parameters())]
    dummy_x, dummy_y = torch.rand(1, 12, requires_grad=True), torch.randn(1, 5, requires_grad=True)
    opt = torch.optim.LBFGS([dummy_x, dummy_y], lr=0.5, max_iter=5)

    def closure():
        opt.zero_grad()
        pred = net(dummy_x)
        if attack == "plain":
            loss = F.cross_entropy(pred, y_true)
        else:
            dl = torch.sum(-F.softmax(dummy_y, -1) * F.log_softmax(pred, -1))
            dg = torch.autograd.grad(dl, net.parameters(), create_graph=True)
            loss = sum(((a - b) ** 2).sum() for a, b in zip(dg, true_grads))
        loss.backward()
        return loss

    with guard(live=False) as g:
        for _ in range(15):
            opt.step(closure)
    assert g.internal_errors == [] and len(g.timeline) == 15
    if attack == "gradient-matching":
        assert g.findings == [], g.findings
        return
    # (on some CPUs LBFGS then drives the plain attack's input into the sigmoids' saturation, where its gradient,
    # ~1e-37, squares to 0: that stall is told too, as an underflow)
    assert [f.kind for f in g.findings][:1] == ["param-not-in-optimizer"], g.findings
    assert all(f.kind == "grads-all-zero" and f.details.get("underflow") for f in g.findings[1:]), g.findings


@pytest.mark.parametrize("pre", [0, 12])
def test_a_probe_optimizer_built_over_the_base_names_the_probe_missing_since_its_first_step(pre):
    """`opt = SGD(base.parameters())` for a probe on a frozen base: loss-disconnected names the probe's parameters as
    the only ones reached, and param-not-in-optimizer the probe (as for a fine-tuning head left out), from the same
    step; it used to say 'a layer unfrozen or replaced mid-run?' a few steps later."""
    torch.manual_seed(0)
    x = torch.randn(256, 16)
    base = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 2))
    with guard(live=False) as g:
        o = torch.optim.Adam(base.parameters(), 1e-2)
        for _ in range(pre):
            loss = nn.functional.cross_entropy(base(x), (x[:, 1] > 0).long())
            o.zero_grad()
            loss.backward()
            o.step()
        del o
        base.eval().requires_grad_(False)
        probe = nn.Linear(32, 2)
        opt = torch.optim.SGD(base.parameters(), lr=0.1)  # the bug: probe.parameters()
        for _ in range(40):
            with torch.no_grad():
                h = base[:2](x)
            loss = nn.functional.cross_entropy(probe(h), (x[:, 0] > 0).long())
            opt.zero_grad()
            loss.backward()
            opt.step()
    told = [f for f in g.findings if f.severity != "info"]
    assert [(f.kind, f.step) for f in told] == [("loss-disconnected", pre), ("param-not-in-optimizer", pre)]
    assert "mid-run" not in told[1].message and "no optimizer" in told[1].message


def test_a_layer_appended_after_the_per_layer_optimizers_is_missing_from_the_start():
    """Forward-forward under a global guard: each layer is called on its own (a root of its own), with one optimizer
    per layer built before the last layer was appended. The last layer is called from the first iteration on, after
    the first look within that step: it was told as 'a model that appeared mid-run' with a teacher's fix."""
    torch.manual_seed(0)
    x, y = torch.randn(64, 12), torch.randint(0, 4, (64,))
    layers = nn.ModuleList([nn.Linear(12, 16), nn.Linear(16, 16)])
    opts = [torch.optim.Adam(layer.parameters(), lr=0.03) for layer in layers]
    layers.append(nn.Linear(16, 16))  # the bug: after the optimizers were built
    with guard(live=False) as g:
        for _ in range(24):
            h = x
            for k, layer in enumerate(layers):
                loss = F.softplus(2.0 - F.relu(layer(h)).pow(2).mean(1)).mean()
                if k < len(opts):
                    opts[k].zero_grad()
                loss.backward()
                if k < len(opts):
                    opts[k].step()
                with torch.no_grad():
                    h = F.relu(layer(h))
    (f,) = [f for f in g.findings if f.kind == "param-not-in-optimizer"]
    assert f.step == 0 and "mid-run" not in f.message and "teacher" not in f.hint


# Total gradient norms of second-order MAML over random 3-way tasks (a helper sweep's healthy script, steps 0-89):
# heavy-tailed by nature (a task whose classes lie close is hard), 17x the median at step 80 while the window's
# largest is 7x.
MAML_NORMS = [0.48, 0.75, 0.71, 0.6, 0.43, 0.65, 0.61, 0.63, 0.55, 0.56, 0.75, 0.53, 0.62, 0.69, 0.44, 0.5, 0.48, 0.52,
              0.53, 0.42, 0.64, 0.52, 1.33, 0.43, 0.53, 1.16, 1.79, 0.48, 0.71, 2.03, 0.55, 0.5, 0.46, 0.5, 0.47, 0.43,
              0.8, 0.62, 0.55, 0.62, 0.91, 1.86, 0.39, 0.56, 0.41, 0.51, 0.75, 0.62, 0.78, 3.5, 0.53, 0.41, 0.36, 0.39,
              0.43, 0.51, 0.44, 0.44, 0.94, 2.63, 0.41, 0.44, 0.74, 0.41, 0.35, 0.44, 0.38, 1.73, 3.07, 1.64, 2.06,
              1.99, 0.65, 0.48, 0.3, 0.31, 0.5, 0.48, 0.81, 2.5, 8.62, 6.25, 0.5, 0.58, 0.46, 8.45, 0.66, 0.34, 0.37, 0.44]


@pytest.mark.parametrize("jump", [None, 100.0])
def test_a_heavy_tailed_run_s_next_largest_norm_is_no_explosion_but_a_jump_far_above_its_tail_is(jump):
    """A window whose largest norm is already 5x its median has a heavy tail: a new largest 2.5x that is its nature,
    not an explosion (it was told at step 80 until stop 41); 100x the median is still told."""
    model = nn.Linear(4, 1, bias=False)
    with torch.no_grad():
        model.weight.fill_(1.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # the norms are the script's: |grad| = scale * |x|
    x = torch.ones(1, 4) / 2  # |grad of model(x).sum()| = 1
    norms = list(MAML_NORMS)
    if jump is not None:
        norms[84] = jump * 0.51
    with guard(model, opt, live=False, checks=["grad-explosion"]) as g:
        for n in norms:
            opt.zero_grad()
            (model(x).sum() * n).backward()
            opt.step()
    found = [f for f in g.findings if f.kind == "grad-explosion"]
    if jump is None:
        assert found == []
    else:
        [f] = found
        assert f.step == 84 and f.details["ratio"] > 50


def _quant(w, bits=4):
    s = w.detach().abs().max() / (2 ** (bits - 1) - 1)
    return torch.round(w / s) * s


class _QLinear(nn.Linear):
    """A fake-quantised Linear: its straight-through estimator right (`w + (q(w) - w).detach()`) or wrong."""

    wrong = False

    def forward(self, x):
        w = self.weight
        wq = w.detach() + (_quant(w) - w.detach()) if self.wrong else w + (_quant(w) - w).detach()
        return F.linear(x, wq, self.bias)


@pytest.mark.parametrize("wrong", [True, False])
def test_weight_matrices_cut_by_a_straight_through_estimator_detached_on_the_wrong_term_are_told(wrong):
    """Every weight matrix gets an exactly-zero gradient while its bias learns: no cancellation does that step
    after step; AdamW's decay shrinks the weights (silent until stop 41: a lone zero in a layer was exempt)."""
    torch.manual_seed(0)
    layers = [_QLinear(16, 32), nn.ReLU(), _QLinear(32, 32), nn.ReLU(), _QLinear(32, 3)]
    for m in layers[::2]:
        m.wrong = wrong
    model = nn.Sequential(*layers)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.05)
    x = torch.randn(256, 16)
    y = x[:, :3].argmax(1)
    with guard(model, opt, live=False) as g:
        for i in range(40):
            idx = slice(i % 4 * 64, i % 4 * 64 + 64)
            opt.zero_grad()
            F.cross_entropy(model(x[idx]), y[idx]).backward()
            opt.step()
    found = [f for f in g.findings if f.kind == "weight-decay-without-grad"]
    if not wrong:
        assert g.findings == []
        return
    [f] = found
    assert f.where == "0.weight" and f.step == 0 and f.details["parameters"] == 3
    assert f.details["names"] == ["0.weight", "2.weight", "4.weight"] and f.details["zero_beside_learning_bias"]
    assert "0.weight, 2.weight, 4.weight" in f.message and "biases learn" in f.message
    assert "w + (quant(w) - w).detach()" in f.hint


def test_gradients_zeroed_by_hand_after_backward_are_told_as_zeroed_not_computed_as_zero():
    """`emb.weight.grad.zero_()` after backward to "freeze" the embedding under AdamW: the decay shrinks it. It was
    told as gradients "computed as exactly 0" (a loss term weighted by 0) until stop 41."""
    torch.manual_seed(0)
    emb = nn.Embedding(50, 16)
    head = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 2))
    model = nn.ModuleDict({"emb": emb, "head": head})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    with guard(model, opt, live=False) as g:
        for _ in range(40):
            x = torch.randint(0, 50, (16, 8))
            loss = F.cross_entropy(head(emb(x).mean(1)), (x[:, 0] > 25).long())
            opt.zero_grad()
            loss.backward()
            emb.weight.grad.zero_()
            opt.step()
    [f] = [f for f in g.findings if f.kind == "weight-decay-without-grad"]
    assert f.where == "emb" and f.details["zeroed_after_backward"] is True
    assert "zeroed in place after backward" in f.message and "weighted by 0" not in f.message
    assert "p.grad = None" in f.hint and "requires_grad_(False)" in f.hint


def test_a_tied_weight_untied_once_after_the_optimizer_was_built_is_one_replacement_not_a_rebinding_at_every_call():
    """`head.weight = emb.weight` (a tie) then, once the optimizer exists, `head.weight = nn.Parameter(...)`: the tie
    re-uses a registered parameter and is no re-binding; the untie is one replacement, whose fix is to rebuild the
    optimizer (it was told as "replaced again and again" with the spectral-norm fix until stop 41)."""
    torch.manual_seed(0)
    with guard(live=False) as g:  # a global guard sees the tie as the model is built
        emb = nn.Embedding(50, 16)
        head = nn.Linear(16, 50, bias=False)
        head.weight = emb.weight
        model = nn.Sequential(emb, head)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        head.weight = nn.Parameter(emb.weight.detach().clone())  # untied once, after the optimizer was built
        for _ in range(20):
            x = torch.randint(0, 50, (8, 10))
            loss = F.cross_entropy(model(x).view(-1, 50), x.view(-1))
            opt.zero_grad()
            loss.backward()
            opt.step()
    (f,) = [f for f in g.findings if f.kind == "param-not-in-optimizer"]
    assert f.details.get("replaced") is True and "rebound_per_call" not in f.details
    assert "again and again" not in f.message and "rebuild the optimizer over the new parameters" in f.hint


@pytest.mark.parametrize("zeroed", [False, True])
def test_langevin_backwards_on_a_model_left_in_train_mode_are_input_gradient_passes(zeroed):
    """An energy model with no Dropout or BatchNorm is rarely put in eval mode for its sampler: the same input
    leaf changed in place between the model's calls (`x -= a * x.grad` under no_grad) marks the sampler's
    backwards, which also fill the parameters' .grad (silent until stop 41: only eval-mode passes counted)."""
    torch.manual_seed(0)
    energy = nn.Sequential(nn.Linear(2, 32), nn.SiLU(), nn.Linear(32, 1))
    opt = torch.optim.Adam(energy.parameters(), lr=1e-4)
    with guard(energy, opt, live=False) as g:
        for _ in range(6):
            opt.zero_grad()
            x = torch.randn(64, 2).requires_grad_(True)
            for _ in range(5):
                energy(x).sum().backward()
                with torch.no_grad():
                    x -= 0.05 * x.grad
                x.grad = None
            if zeroed:
                opt.zero_grad()
            loss = energy(torch.randn(64, 2) + 2).mean() - energy(x.detach()).mean()
            loss.backward()
            opt.step()
    found = [f for f in g.findings if f.kind == "missing-zero-grad"]
    if zeroed:
        assert g.findings == []
    else:
        [f] = found
        assert f.step == 0 and f.details["input_backwards"] == 4 and "sampler" in f.message


def test_a_tower_accumulating_the_shared_loss_over_four_of_the_other_towers_steps_is_no_leak():
    """Two-tower retrieval, one in-batch loss: the user tower steps every batch, the item tower accumulates the same
    loss over 4 batches (its own optimizer, `iopt.step(); iopt.zero_grad()` every 4). Every backward is a joint one,
    followed by the user tower's step, yet it was told as the user loss's gradients leaking into the item tower
    (stop 45). A backward of D's own after the generator's is still told (the test below)."""
    torch.manual_seed(0)
    user, item = nn.Sequential(nn.Embedding(40, 8), nn.Linear(8, 8)), nn.Sequential(nn.Embedding(90, 8), nn.Linear(8, 8))
    uopt, iopt = torch.optim.Adam(user.parameters(), 2e-3), torch.optim.Adam(item.parameters(), 2e-3)
    with guard(live=False) as g:
        iopt.zero_grad()
        for k in range(24):
            u, i = torch.randint(0, 40, (16,)), torch.randint(0, 90, (16,))
            q, v = F.normalize(user(u), dim=-1), F.normalize(item(i), dim=-1)
            uopt.zero_grad()
            F.cross_entropy(q @ v.T / 0.1, torch.arange(16)).backward()
            uopt.step()
            if (k + 1) % 4 == 0:
                iopt.step()
                iopt.zero_grad()
    assert g.findings == [], g.findings


@pytest.mark.parametrize("order", ["leak", "leak-module-zero", "standard", "zero-before-own"])
def test_a_generator_loss_left_in_the_discriminator_after_its_zero_grad_is_told(order):
    """`opt_d.zero_grad()` at the top, then the generator's backward (through D) and its step, then D's own
    backward and step: D's step applies the generator loss's gradients too (what toggle_optimizer prevents; silent
    until stop 41). The standard order, or D's zero_grad() right before its own backward, is clean."""
    torch.manual_seed(0)
    G, D = nn.Linear(4, 2), nn.Linear(2, 1)
    opt_g = torch.optim.Adam(G.parameters(), 1e-3)
    opt_d = torch.optim.Adam(D.parameters(), 1e-3)
    with guard(live=False) as g:  # G and D called one by one: each is a model of its own
        for _ in range(4):
            real = torch.randn(8, 2) + 2
            fake = G(torch.randn(8, 4))
            if order == "standard":
                opt_d.zero_grad()
                (F.softplus(-D(real)).mean() + F.softplus(D(fake.detach())).mean()).backward()
                opt_d.step()
                opt_g.zero_grad()
                F.softplus(-D(fake)).mean().backward()
                opt_g.step()
                continue
            if order == "leak-module-zero":
                D.zero_grad()
            elif order == "leak":
                opt_d.zero_grad()
            opt_g.zero_grad()
            F.softplus(-D(fake)).mean().backward()
            opt_g.step()
            if order == "zero-before-own":
                opt_d.zero_grad()
            (F.softplus(-D(real)).mean() + F.softplus(D(fake.detach())).mean()).backward()
            opt_d.step()
    found = [f for f in g.findings if f.kind == "missing-zero-grad"]
    if order in ("standard", "zero-before-own"):
        assert g.findings == []
    else:
        [f] = found
        # (a global guard knows opt_d from its first step: the leak is seen at the second iteration, whose D step
        # comes after opt_g's, the step counter's, second step)
        assert f.where == "Adam[1]" and f.details["leaked_from"].startswith("Adam") and f.step in (1, 2)
        assert "toggle_optimizer" in f.hint and "opt_d.zero_grad(); d_loss.backward()" in f.hint


@pytest.mark.parametrize("cleared", [False, True])
def test_a_hand_written_update_with_an_input_that_requires_grad_still_finds_uncleared_gradients(cleared):
    """A PINN/HNN-style loop with no optimizer: each step's input requires grad (for d/dx), and the update by hand
    never clears .grad. The previous step's input, gone by the next backward, blocked the finding until stop 41."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(2, 16), nn.Tanh(), nn.Linear(16, 1))
    x = torch.randn(256, 2)
    y = x.sum(1, keepdim=True)
    with guard(net, live=False) as g:
        for _ in range(6):
            xb = x.clone().requires_grad_(True)
            loss = (net(xb) - y).pow(2).mean()
            loss.backward()
            with torch.no_grad():
                for p in net.parameters():
                    p -= 1e-2 * p.grad
                    if cleared:
                        p.grad = None
    found = [f for f in g.findings if f.kind == "missing-zero-grad"]
    if cleared:
        assert g.findings == []
    else:
        [f] = found
        assert f.where == "parameters (no optimizer)" and f.step == 1


@pytest.mark.parametrize("lr,told", [(1e-5, True), (1e-3, False)])
def test_bf16_weights_whose_adam_updates_mostly_round_away_are_told(lr, told):
    """Pure-bf16 weights under AdamW: at lr 1e-5 only a few percent of the elements with a gradient move (the rest of
    the updates round away; told since stop 41, the bar was 1% of all sampled elements); at 1e-3 they move. Rows an
    embedding does not look up have no gradient and are not counted."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(100, 32), nn.Flatten(), nn.Linear(32 * 8, 64), nn.ReLU(),
                          nn.Linear(64, 4)).to(torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    with guard(model, opt, live=False) as g:
        for _ in range(70):
            x = torch.randint(0, 100, (16, 8))
            loss = F.cross_entropy(model(x).float(), x[:, 0] % 4)
            opt.zero_grad()
            loss.backward()
            opt.step()
    found = [f for f in g.findings if f.kind == "params-not-updating"]
    if told:
        [f] = found
        assert f.details["rounded_away"] is True and "10%" in f.message
    else:
        assert g.findings == []


@pytest.mark.parametrize("bug", [None, "delta_grad_kept"])
def test_pgd_through_backward_with_zero_grad_before_the_training_backward_is_clean(bug):
    """PGD adversarial training whose attack takes the input gradient with loss.backward() (filling the weights'
    .grad, cleared by opt.zero_grad() right before the training backward), under a global guard that knows the
    optimizer only from its first step: the attack's changed delta beside unchanged weights was told as a SAM
    perturbation until stop 41. A delta whose own .grad is never cleared is told at `delta`."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 16), nn.ReLU(), nn.Linear(16, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with guard(live=False) as g:
        for _ in range(6):
            x, y = torch.rand(32, 10), torch.randint(0, 3, (32,))
            delta = torch.zeros_like(x, requires_grad=True)
            for _ in range(2):
                F.cross_entropy(model(x + delta), y).backward()
                with torch.no_grad():
                    delta += 0.03 * delta.grad.sign()
                if bug is None:
                    delta.grad.zero_()
            opt.zero_grad()
            F.cross_entropy(model((x + delta).detach()), y).backward()
            opt.step()
    if bug is None:
        assert g.findings == []
    else:
        [f] = g.findings
        assert (f.kind, f.where) == ("missing-zero-grad", "delta") and "delta.grad = None" in f.hint


def test_the_first_batch_of_a_new_task_after_a_task_learned_to_zero_loss_is_no_explosion():
    """Class-incremental learning: task 0 learned down to a loss near 0, then task 1's classes. The first batch's
    norm is 5x the run's first norms (over the 2x bar) but its loss is back near the run's first loss and far above
    the recent ones: a model meeting data it has not learned (told as an explosion until stop 41)."""
    torch.manual_seed(0)
    means = torch.randn(4, 20) * 2

    def task(cls):
        y = torch.tensor(cls)[torch.randint(2, (300,))]
        return means[y] + torch.randn(300, 20), y

    model = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    with guard(model, opt, live=False) as g:
        for x, y in [task([0, 1]), task([2, 3])]:
            for _ in range(10):
                for i in range(0, 300, 32):
                    loss = F.cross_entropy(model(x[i:i + 32]), y[i:i + 32])
                    opt.zero_grad()
                    loss.backward()
                    opt.step()
    assert [f for f in g.findings if f.kind == "grad-explosion"] == []


def test_a_parameter_created_in_forward_is_told_to_be_created_once_in_init():
    """`self.pos_embed = nn.Parameter(...)` in forward: no optimizer ever held one. It was told as a weight
    re-bound to renormalise it, whose first version the optimizer holds, with the spectral-norm fix, until stop 41."""
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 3)

        def forward(self, x):
            self.pos_embed = nn.Parameter(torch.randn(1, 4, 8) * 0.02)
            return self.fc((x + self.pos_embed).mean(1))

    torch.manual_seed(0)
    model = M()
    opt = torch.optim.AdamW(model.parameters(), 1e-3)
    with guard(model, opt, live=False) as g:
        for _ in range(12):
            loss = F.cross_entropy(model(torch.randn(16, 4, 8)), torch.randint(0, 3, (16,)))
            opt.zero_grad()
            loss.backward()
            opt.step()
    (f,) = [f for f in g.findings if f.kind == "param-not-in-optimizer"]
    assert f.where == "pos_embed" and f.details["created_in_forward"] is True and "in __init__" in f.hint


def test_a_second_optimizers_steps_between_counted_steps_get_their_own_gradient_norms():
    """Optimizer A trains `a`, then B trains `b` (A no longer steps; B takes over the count after 16 steps). B's
    first gradient is tiny (its loss scaled by 1e-3 at its first step). Between two counted steps each of B's steps
    read the gradient norms cached at its first one, so the window held 16 copies of that tiny norm and B's next
    ordinary step was told as a 600x explosion (ENAS's controller, a hypernetwork trained after its base)."""
    torch.manual_seed(0)
    a, b = nn.Linear(4, 1), nn.Linear(4, 1)
    oa, ob = torch.optim.SGD(a.parameters(), lr=0.01), torch.optim.Adam(b.parameters(), lr=1e-3)
    with guard(live=False) as g:
        for _ in range(40):
            x = torch.randn(16, 4)
            loss = F.mse_loss(a(x).squeeze(1), x.sum(1))
            oa.zero_grad()
            loss.backward()
            oa.step()
        for s in range(60):
            x = torch.randn(16, 4)
            with torch.no_grad():
                a(x)  # the first model is still called, as a frozen base is
            loss = (1e-3 if s == 0 else 1.0) * F.mse_loss(b(x).squeeze(1), x.sum(1))
            ob.zero_grad()
            loss.backward()
            ob.step()
    assert "grad-explosion" not in kinds(g), g.findings
    assert g.step == 100 and g.internal_errors == []


@pytest.mark.parametrize("bug", ["lr-int-zero", "step-without-parentheses", "healthy", "warm-up-from-0"])
def test_federated_clients_with_an_optimizer_made_each_round_are_still_judged(bug):
    """FedAvg makes each client's optimizer anew every round, and each lives a few local steps: `lr=int(0.05)` (0 in
    every client optimizer) and `opt.step` without parentheses were never judged, each optimizer's count starting
    over (20 steps at lr=0 were needed from one object; the never-stepped one noted was gone at the end). The
    counts now go on from the optimizer made at the same line; a healthy run is silent."""
    torch.manual_seed(0)
    glob = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    local = copy.deepcopy(glob)
    x = torch.randn(64, 4)
    with guard(live=False) as g:
        for rnd in range(6):
            states = []
            for c in range(2):
                local.load_state_dict(glob.state_dict())
                lr = {"lr-int-zero": int(0.05), "warm-up-from-0": 0.05 * min(1.0, max(0, rnd - 1) / 3)}.get(bug, 0.05)
                opt = torch.optim.SGD(local.parameters(), lr=lr)
                for _ in range(5):
                    xb = x[c * 32:(c + 1) * 32]
                    loss = F.mse_loss(local(xb), xb.sum(1, keepdim=True))
                    opt.zero_grad()
                    loss.backward()
                    if bug == "step-without-parentheses":
                        opt.step  # noqa: B018
                    else:
                        opt.step()
                states.append(copy.deepcopy(local.state_dict()))
            glob.load_state_dict({k: torch.stack([s[k] for s in states]).mean(0) for k in states[0]})
    if bug in ("healthy", "warm-up-from-0"):
        assert g.findings == [] and g.internal_errors == []
        return
    found = [f for f in g.findings if f.kind == "params-not-updating"]
    assert len(found) == 1, g.findings
    if bug == "lr-int-zero":  # (told at the end: a warm-up from 0 over the first rounds would be no bug)
        assert "made with lr=0 at every round" in found[0].message and "`int(...)`" in found[0].hint
    else:
        assert found[0].details["never_stepped"] is True and "`opt.step` without parentheses" in found[0].hint


def test_a_net_drawn_anew_at_each_outer_step_of_dataset_distillation_is_no_polyak_target():
    """Dataset distillation: each outer step draws the net's weights anew (`net.reset_parameters()`), unrolls an inner
    loop from them with torch.autograd.grad(create_graph=True), and the outer Adam holds only the synthetic data. The
    net's own .grad piles up unused while its weights change in place: that was told as a Polyak target network run
    with gradient, whose fixes (no_grad, requires_grad_(False)) break the unroll. A re-initialised net moves all the
    way between steps, a Polyak target a little: silent."""
    from torch.func import functional_call

    torch.manual_seed(0)
    net = nn.Linear(4, 2)
    syn = nn.Parameter(torch.randn(6, 4))
    sy = torch.tensor([0, 1] * 3)
    opt = torch.optim.Adam([syn], lr=0.01)
    x = torch.randn(64, 4)
    y = (x[:, 0] > 0).long()
    with guard(live=False) as g:
        for _ in range(20):
            net.reset_parameters()
            p = dict(net.named_parameters())
            grads = torch.autograd.grad(F.cross_entropy(functional_call(net, p, (syn,)), sy), list(p.values()),
                                        create_graph=True)
            p = {k: v - 0.1 * gi for (k, v), gi in zip(p.items(), grads)}
            loss = F.cross_entropy(functional_call(net, p, (x,)), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
    assert g.findings == [] and g.internal_errors == []


def test_label_logits_updated_by_hand_without_clearing_their_gradient_are_told_as_such():
    """PENCIL learns soft labels as a tensor outside the optimizer, `label_logits -= lr * label_logits.grad` under
    no_grad, and never clears that gradient: each update applies the sum of all earlier ones. It was told as a
    Polyak target network run with gradient, whose fixes (no_grad, requires_grad_(False)) stop the labels learning;
    its moves follow its own gradient, so it is told as an update by hand whose gradient piles up."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    x, y = torch.randn(64, 8), torch.randint(0, 3, (64,))
    label_logits = nn.Parameter(F.one_hot(y, 3).float() * 10)
    with guard(live=False) as g:
        for _ in range(120):
            out = model(x)
            loss = F.cross_entropy(out, F.softmax(label_logits, 1)) + 0.1 * F.cross_entropy(label_logits, y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            with torch.no_grad():
                label_logits -= 10.0 * label_logits.grad
    f = next(f for f in g.findings if f.kind == "param-not-in-optimizer")
    assert f.where == "label_logits" and f.details["updated_by_hand"] is True and "polyak_target" not in f.details
    assert "label_logits.grad = None" in f.hint


def test_a_mean_teacher_run_with_gradient_is_told_as_an_ema_target_not_an_update_by_hand():
    """A mean teacher (deepcopy of the student, EMA-updated) run with gradient, its consistency target not detached:
    the loss pulls it toward the student, so its EMA moves follow its piled-up gradient too. It was told as updated
    by hand along its own gradient, with a clear-the-gradient fix; it moves toward the student's parameters, so it
    is an EMA target computed with gradient, fixed with no_grad or requires_grad_(False) (stop 43)."""
    torch.manual_seed(0)
    student = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    teacher = copy.deepcopy(student)
    opt = torch.optim.SGD(student.parameters(), lr=0.05)
    with guard(student, opt, live=False) as g:
        for _ in range(40):
            x, y, u = torch.randn(16, 8), torch.randint(3, (16,)), torch.randn(32, 8)
            p_t = teacher(u + 0.1 * torch.randn_like(u)).softmax(1)
            loss = F.cross_entropy(student(x), y) + F.mse_loss(student(u).softmax(1), p_t)
            opt.zero_grad()
            loss.backward()
            opt.step()
            with torch.no_grad():
                for tp, sp in zip(teacher.parameters(), student.parameters()):
                    tp.mul_(0.99).add_(sp, alpha=0.01)
    f = next(f for f in g.findings if f.kind == "param-not-in-optimizer")
    assert f.details.get("polyak_target") is True and "updated_by_hand" not in f.details, f
    assert "mean teacher" in f.message and "requires_grad_(False)" in f.hint


class _Grids(nn.Module):
    """A multi-resolution feature grid whose levels are elements of one nn.ParameterList, each level's features
    weighted by a coarse-to-fine schedule `weights`."""

    def __init__(self):
        super().__init__()
        self.grids = nn.ParameterList([nn.Parameter(torch.randn(4, 4 * 2 ** k) * 0.1) for k in range(4)])
        self.head = nn.Linear(4, 1)

    def forward(self, x, weights):
        return self.head(sum(w * x[:, :4] * g.mean(1) for w, g in zip(weights, self.grids)))


@pytest.mark.parametrize("annealed", [False, True])
def test_levels_of_a_parameter_list_weighted_by_zero_all_run_are_told_under_weight_decay(annealed):
    """A coarse-to-fine schedule that never reaches the fine levels (`progress = it / (10 * total)`): two of four
    levels of an nn.ParameterList get gradients of exactly 0 all run while AdamW decays them. The list's elements were
    one layer with the two that learn, so nothing was told until stop 43; each element is a layer of its own now. A
    schedule that reaches them (annealed) is silent."""
    torch.manual_seed(0)
    model = _Grids()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.05)
    total = 60
    with guard(model, opt, live=False) as g:
        for it in range(total):
            progress = it / total if annealed else it / (10 * total)
            weights = [1.0, 1.0] + [float(min(1.0, max(0.0, 4 * progress - k))) for k in (1, 2)]
            x = torch.randn(16, 8)
            loss = F.mse_loss(model(x, weights), x[:, :1])
            opt.zero_grad()
            loss.backward()
            opt.step()
    told = [f for f in g.findings if f.kind == "weight-decay-without-grad"]
    if annealed:
        assert told == [], told
    else:
        [f] = told
        assert f.where == "grids" and f.step == 0 and "2 parameter(s)" in f.message, f


def test_a_head_zeroed_by_hand_after_it_trained_under_one_optimizer_is_told_during_the_run():
    """Continual learning with one SGD (momentum, weight decay) built once: task 0's head trains for 60 steps, then
    is "frozen" with `p.grad.zero_()` after each backward while task 1 trains. Gradients zeroed by hand were taken as
    computed as 0 and judged only at the end of a run that began at the optimizer's first step: silent until stop
    43. Told after 20 steps of it now, with the zeroed-in-place message."""
    torch.manual_seed(0)
    trunk = nn.Sequential(nn.Linear(10, 32), nn.ReLU())
    heads = nn.ModuleList(nn.Linear(32, 2) for _ in range(2))
    model = nn.ModuleDict({"trunk": trunk, "heads": heads})
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-3)
    with guard(model, opt, live=False) as g:
        for task in range(2):
            for _ in range(60):
                x = torch.randn(32, 10)
                f = trunk(x)
                loss = F.cross_entropy(heads[task](f), (x[:, task] > 0).long())
                if task:
                    loss = loss + 0.1 * heads[0](f).pow(2).mean()  # the old head stays in the graph
                opt.zero_grad()
                loss.backward()
                for old in range(task):
                    for p in heads[old].parameters():
                        p.grad.zero_()
                opt.step()
    [f] = [f for f in g.findings if f.kind == "weight-decay-without-grad"]
    assert (f.where, f.step) == ("heads.0", 60) and f.details["zeroed_after_backward"] is True, f
    assert "zeroed in place after backward" in f.message and "p.grad = None" in f.hint


def test_an_averaged_copy_forwarded_instead_of_the_model_is_told_once_as_disconnected():
    """SWA: after swa_start the loop forwards the AveragedModel (a copy the optimizer does not hold) and keeps
    averaging it toward the model. loss-disconnected says the optimizer trains nothing; param-not-in-optimizer's "a
    target network updated by averaging" with a no_grad fix (told as well until stop 44) would break training."""
    from torch.optim.swa_utils import AveragedModel
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    swa = AveragedModel(model)
    x, y = torch.randn(120, 6), torch.randint(0, 3, (120,))
    with guard(live=False) as g:
        for epoch in range(6):
            net = swa if epoch >= 2 else model  # the bug: always `model`
            for i in range(0, 120, 20):
                opt.zero_grad()
                F.cross_entropy(net(x[i:i + 20]), y[i:i + 20]).backward()
                opt.step()
            if epoch >= 2:
                swa.update_parameters(model)
    assert [f.kind for f in g.findings if f.severity != "info"] == ["loss-disconnected"]


def test_a_parameter_left_out_of_hand_listed_groups_is_named_with_the_add_param_group_fix():
    """Deep kernel learning with hand-listed parameter groups that leave the likelihood's `log_noise` out: the
    finding names that parameter (not only its module `m`), says the module's other parameters train, and gives
    add_param_group first, not the target-network advice."""

    class DKL(nn.Module):
        def __init__(self):
            super().__init__()
            self.features = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 2))
            self.log_ls = nn.Parameter(torch.zeros(()))
            self.log_noise = nn.Parameter(torch.tensor(0.0))

        def nmll(self, x, y):  # the loss is a method: `m` itself is never called
            f = self.features(x)
            k = torch.exp(-0.5 * torch.cdist(f, f).pow(2) / self.log_ls.exp() ** 2)
            k = k + (self.log_noise.exp() + 1e-5) * torch.eye(len(x))
            chol = torch.linalg.cholesky(k)
            return (0.5 * y @ torch.cholesky_solve(y[:, None], chol)[:, 0] + chol.diagonal().log().sum()) / len(x)

    torch.manual_seed(0)
    x, y = torch.randn(200, 4), torch.randn(200)
    m = DKL()
    opt = torch.optim.Adam([{"params": m.features.parameters(), "lr": 3e-3}, {"params": [m.log_ls], "lr": 3e-2}])
    with guard(live=False) as g:
        for _ in range(12):
            idx = torch.randperm(200)[:32]
            loss = m.nmll(x[idx], y[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
    (f,) = [f for f in g.findings if f.kind == "param-not-in-optimizer"]
    assert f.where == "m.log_noise" and "of m, whose other parameters train" in f.message
    assert f.hint.startswith("Add them to the optimizer: optimizer.add_param_group({'params': [m.log_noise]})")


def test_an_ensemble_whose_optimizers_were_all_built_over_one_member_is_told_so():
    """Deep ensemble, `opts = [Adam(model.parameters()) for m in members]`: the comprehension reads the last loop's
    `model`, so all five optimizers hold the last member and the first member's loss reaches no optimizer. The
    message says the optimizers share one model's parameters (not that a copy was made after the optimizer), and
    the fix builds each over its own member."""
    torch.manual_seed(0)
    x, y = torch.randn(64, 3), torch.randn(64, 1)
    members = []
    for _ in range(5):
        model = nn.Sequential(nn.Linear(3, 8), nn.ReLU(), nn.Linear(8, 1))
        members.append(model)
    opts = [torch.optim.Adam(model.parameters(), lr=1e-3) for m in members]  # the bug
    with guard(live=False) as g:
        for _ in range(3):
            for m, opt in zip(members, opts):
                loss = F.mse_loss(m(x), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
    (f,) = [f for f in g.findings if f.kind == "loss-disconnected"]
    assert f.step == 0 and "5 optimizers hold the same parameters, one model's" in f.message
    assert "for m in members" in f.hint and "deep-copied" not in f.message


def test_an_optimizer_over_a_copy_is_told_as_such_beside_collocation_points_that_require_grad():
    """A PINN whose L-BFGS was built over `copy.deepcopy(model)` while the closure evaluates `model`: the loss also
    reaches the collocation points (a leaf with requires_grad=True, for autograd.grad). They used to make it "tensors
    that are not parameters ... the graph was cut by .detach()"; it is the optimizer training a copy."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1, 16), nn.Tanh(), nn.Linear(16, 1))
    x = torch.linspace(0, 1, 50).unsqueeze(1).requires_grad_(True)
    init = copy.deepcopy(model)
    lbfgs = torch.optim.LBFGS(init.parameters(), max_iter=5)  # the bug: over the copy

    def closure():
        lbfgs.zero_grad()
        u = model(x)
        ux = torch.autograd.grad(u, x, torch.ones_like(u), create_graph=True)[0]
        loss = (ux - torch.cos(x)).pow(2).mean() + model(torch.zeros(1, 1)).pow(2).sum()
        loss.backward()
        return loss

    with guard(live=False) as g:
        for _ in range(3):
            lbfgs.step(closure)
    (f,) = [f for f in g.findings if f.kind == "loss-disconnected"]
    assert "parameter(s) that no optimizer holds" in f.message and "trains a copy of the model" in f.message
    assert "a tensor" not in f.message and ".detach()" not in f.message.split("reaches only")[1]


def _fomaml(copy_back):
    """First-order MAML with a deep-copied learner: the query loss is back-propagated into the copy; without
    `copy_back` its gradients never reach the meta-model, whose optimizer steps over parameters with no gradient."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1, 16), nn.ReLU(), nn.Linear(16, 1))
    meta_opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with guard(live=False) as g:
        for _ in range(24):
            meta_opt.zero_grad()
            x = torch.rand(20, 1) * 10 - 5
            y = torch.rand(1) * torch.sin(x + torch.rand(1))
            learner = copy.deepcopy(model)
            inner = torch.optim.SGD(learner.parameters(), lr=0.01)
            for _ in range(2):
                inner.zero_grad()
                F.mse_loss(learner(x[:10]), y[:10]).backward()
                inner.step()
            inner.zero_grad()
            F.mse_loss(learner(x[10:]), y[10:]).backward()
            if copy_back:
                for p, q in zip(model.parameters(), learner.parameters()):
                    p.grad = q.grad.clone()
            meta_opt.step()
    return g


def test_an_optimizer_over_parameters_that_never_get_a_gradient_beside_a_trained_copy_is_told():
    """A global guard: the meta-optimizer stepped 24 times and its parameters never had a gradient, while backward
    ran through copies of the same shapes. Told at the end of the run, naming both; copied back, silent."""
    g = _fomaml(copy_back=False)
    (f,) = [f for f in g.findings if f.kind == "params-not-updating"]
    assert f.where == "model" and f.details["over_copy"] is True and f.details["steps"] == 24
    assert f.details["variable"] == "meta_opt" and f.details["trained"] == "learner"
    assert "`learner`" in f.message and "ever had a gradient" in f.message and "q.grad.clone()" in f.hint
    assert _fomaml(copy_back=True).findings == []


@pytest.mark.parametrize("over_copy", [True, False])
def test_a_fine_tuning_phase_whose_optimizer_holds_a_deepcopy_is_told(over_copy):
    """Phase 2's optimizer is built over `best = copy.deepcopy(model)` while the loss still calls `model`: 30 steps
    that change nothing. Built over `model` (the fix), or the loss computed with the copy, silent."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1))
    x, y = torch.randn(64, 4), torch.randn(64, 1)
    with guard(live=False) as g:
        adam = torch.optim.Adam(model.parameters(), lr=1e-3)
        for _ in range(10):
            adam.zero_grad(); F.mse_loss(model(x), y).backward(); adam.step()
        best = copy.deepcopy(model)
        adam2 = torch.optim.Adam(best.parameters() if over_copy else model.parameters(), lr=1e-4)
        for _ in range(30):
            adam2.zero_grad(); F.mse_loss(model(x), y).backward(); adam2.step()
    found = [f for f in g.findings if f.kind == "params-not-updating"]
    if not over_copy:
        assert g.findings == []
        return
    (f,) = found
    assert (f.where, f.step) == ("best", 10) and f.details["trained"] == "model" and f.details["steps"] == 30
    assert "`adam2` (Adam) stepped 30 times" in f.message


def test_an_optimizer_stepped_before_its_parameters_train_is_not_told():
    """An auxiliary head whose optimizer steps from the start while its loss joins only after a warm-up of 25 steps
    (its gradients None until then): it had gradients in the run, silent. A model guard's optimizer over a model never
    called is the copy notice's, not this rule's."""
    torch.manual_seed(0)
    body, head = nn.Linear(4, 4), nn.Linear(4, 4)
    x = torch.randn(16, 4)
    with guard(live=False) as g:
        opt, opt_head = torch.optim.SGD(body.parameters(), lr=0.01), torch.optim.SGD(head.parameters(), lr=0.01)
        for i in range(40):
            opt.zero_grad(); opt_head.zero_grad()
            h = body(x)
            loss = h.pow(2).mean() + (head(h).pow(2).mean() if i >= 25 else 0)
            loss.backward()
            opt.step(); opt_head.step()
    assert [f for f in g.findings if f.kind == "params-not-updating"] == []


def _adaround(exact_start, steps=90, gate=30):
    """AdaRound's loop on one layer: rounding variables V learned by Adam to reconstruct the layer's output, with a
    rounding regulariser that joins after `gate` steps. From V's exact start the loss sits at ~0 (gradients ~1e-6 of V)
    until the regulariser joins."""
    torch.manual_seed(0)
    W, x = torch.randn(32, 64), torch.randn(256, 64)
    s = W.abs().amax(1, keepdim=True) / 7
    Wf = torch.floor(W / s)
    rest = (W / s - Wf).clamp(1e-4, 1 - 1e-4)
    h = lambda v: torch.clamp(torch.sigmoid(v) * 1.2 - 0.1, 0, 1)  # noqa: E731
    V = nn.Parameter(-torch.log(1.2 / (rest + 0.1) - 1) if exact_start else torch.randn(32, 64))
    target = x @ W.t()
    opt = torch.optim.Adam([V], lr=1e-2)
    with guard(live=False) as g:
        for it in range(steps):
            out = x @ ((Wf + h(V)) * s).t()
            reg = (1 - (2 * h(V) - 1).abs().pow(10)).sum()
            loss = F.mse_loss(out, target) + (0.01 * reg if it >= gate else 0.0)
            opt.zero_grad(); loss.backward(); opt.step()
    return g


def test_a_loss_term_joining_a_model_at_its_optimum_is_no_gradient_explosion():
    """From the exact start the gradients are ~1e-6 of V and the loss ~1e-7; the regulariser joining multiplies the
    norm by thousands. Not an explosion (the clip it would suggest would cancel the term); the window starts again at
    the new level. A spike after the same start with a term 1e4 times larger once the new level is set is told."""
    assert [f for f in _adaround(exact_start=True).findings if f.kind == "grad-explosion"] == []

    torch.manual_seed(0)
    model = nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x, y = torch.randn(64, 8), torch.randn(64, 1)
    with guard(live=False) as g:
        for it in range(40):
            loss = F.mse_loss(model(x), y) * (1e4 if it == 30 else 1.0)
            opt.zero_grad(); loss.backward(); opt.step()
    (f,) = [f for f in g.findings if f.kind == "grad-explosion"]
    assert f.step == 30


def _round_cut(wd):
    """Activations quantised by a plain torch.round (no straight-through estimator) after each of four blocks: nothing
    reaches the layers before the last one."""
    torch.manual_seed(0)

    class Q(nn.Module):
        def forward(self, x):
            return torch.round(torch.clamp(x, 0, 1) * 15) / 15

    def block(i, o):
        return nn.Sequential(nn.Linear(i, o, bias=False), nn.BatchNorm1d(o), Q())

    model = nn.Sequential(block(8, 16), block(16, 16), block(16, 16), nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=wd)
    x, y = torch.randn(32, 8), torch.randint(0, 4, (32,))
    with guard(model, opt, live=False) as g:
        for _ in range(70):
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad(); loss.backward(); opt.step()
    return g


def test_weight_decay_on_the_layers_before_a_cut_is_one_finding_naming_the_cut():
    """vanishing-gradients names the cut (round without STE); the six parameters before it, computed as exactly 0 and
    decayed, are one weight-decay-without-grad finding that points at it, not one finding per layer."""
    g = _round_cut(wd=5e-4)
    cut = [f for f in g.findings if f.kind == "vanishing-gradients"]
    assert cut and cut[0].details["cut"] is True
    (f,) = [f for f in g.findings if f.kind == "weight-decay-without-grad"]
    assert f.details["after_cut"] == cut[0].where and f.details["parameters"] == 6
    assert "before the cut that vanishing-gradients reported" in f.message and "straight-through" in f.hint
    assert [f.kind for f in _round_cut(wd=0.0).findings] == ["vanishing-gradients"]


@pytest.mark.parametrize("inverted", [True, False])
def test_an_inverted_key_padding_mask_is_named_when_the_attention_layer_gets_no_gradient(inverted):
    """`src_key_padding_mask = tok != PAD` masks the real tokens: the encoder attends to padding only, and its first
    attention layer's gradients are ~1e-20 of the head's. The message says an attention layer does not shrink like
    that, and the hint starts with the mask (`tok == PAD`); with the right mask, no finding."""
    torch.manual_seed(0)
    V, PAD = 30, 0

    class Enc(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(V, 32, padding_idx=PAD)
            layer = nn.TransformerEncoderLayer(32, 4, 64, 0.0, batch_first=True)
            self.enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
            self.out = nn.Linear(32, 2)

        def forward(self, tok):
            mask = (tok != PAD) if inverted else (tok == PAD)
            h = self.enc(self.emb(tok), src_key_padding_mask=mask)
            keep = (tok != PAD).unsqueeze(-1).float()
            return self.out((h.nan_to_num() * keep).sum(1) / keep.sum(1))

    model = Enc()
    opt = torch.optim.Adam(model.parameters(), 1e-3)
    lens = torch.randint(3, 9, (64,))
    tok = torch.randint(1, V, (64, 10)) * (torch.arange(10) < lens.unsqueeze(1))
    tok[:, 9] = PAD  # every row has padding: rows are never all masked, so no NaN
    y = (tok[:, 0] % 2)
    with guard(model, opt, live=False) as g:
        for _ in range(25):
            loss = F.cross_entropy(model(tok), y)
            opt.zero_grad(); loss.backward(); opt.step()
    found = [f for f in g.findings if f.kind == "vanishing-gradients"]
    if not inverted:
        assert found == []
        return
    (f,) = found
    assert "self_attn" in f.where and "key padding mask is inverted" in f.message
    assert f.hint.startswith("Check the attention mask first") and "tok == PAD" in f.hint


def test_parameters_attached_mid_run_are_told_with_the_steps_between_two_looks():
    """LSQ step sizes attached to the layers at step 20, after the optimizer was built: found at the look of step 32,
    told as getting gradients since a step between 17 and 32 (the look at 16 found none), not "since step 32"."""
    torch.manual_seed(0)

    class Scaled(nn.Linear):
        def __init__(self, *a):
            super().__init__(*a)
            self.scale = None

        def forward(self, x):
            w = self.weight if self.scale is None else self.weight * self.scale
            return F.linear(x, w, self.bias)

    model = nn.Sequential(Scaled(8, 16), nn.ReLU(), Scaled(16, 2))
    opt = torch.optim.Adam(model.parameters(), 1e-3)
    x, y = torch.randn(32, 8), torch.randint(0, 2, (32,))
    with guard(model, opt, live=False) as g:
        for step in range(40):
            if step == 20:
                for m in model:
                    if isinstance(m, Scaled):
                        m.scale = nn.Parameter(torch.ones(()))
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad(); loss.backward(); opt.step()
    (f,) = [f for f in g.findings if f.kind == "param-not-in-optimizer"]
    assert f.step == 32 and "since a step between 17 and 32 (the look at step 16 found none)" in f.message
