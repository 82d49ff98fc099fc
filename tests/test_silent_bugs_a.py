"""Issue 16 (part A): module-not-registered, train-in-eval-mode, loss-shape-broadcast, zero-grad-before-step,
loss-disconnected, init-loss-high. Each: the demo's bug, its --fixed twin, and the healthy patterns the issue lists."""
import copy
import inspect
import linecache
import math
import os
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from demos import (init_loss_high, loss_disconnected, loss_shape_broadcast, module_not_registered,
                   train_in_eval_mode, zero_grad_before_step)
from guard import GuardError, guard

def kinds(g):
    return [f.kind for f in g.findings]


def only(g, kind):
    return [f for f in g.findings if f.kind == kind]


def line_of(obj, needle):
    """``file:line`` of the first source line of `obj` (module, class or function) containing `needle`."""
    lines, start = inspect.getsourcelines(obj)
    if inspect.ismodule(obj):
        start = 1
    for i, text in enumerate(lines):
        if needle in text:
            return f"{os.path.relpath(inspect.getsourcefile(obj))}:{start + i}"
    raise AssertionError(needle)


def mlp(out=1):
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, out))


@pytest.mark.parametrize("demo", [module_not_registered, train_in_eval_mode, loss_shape_broadcast,
                                  zero_grad_before_step, loss_disconnected, init_loss_high])
def test_fixed_twins_are_silent_under_all_checks(demo):
    g = demo.train(fixed=True, checks="all", live=False)
    assert g.findings == [] and g.internal_errors == []


# --------------------------------------------------------------------------- module-not-registered

def test_module_list_demo_names_attribute_container_and_fix():
    g = module_not_registered.train(live=False)
    assert kinds(g) == ["module-not-registered"]
    f = g.findings[0]
    assert f.severity == "error" and f.where == "hidden" and f.step == 0
    assert f.source == line_of(module_not_registered.MLP, "self.hidden = layers")
    assert "plain Python list holding 3 module(s) (Linear; 3,168 parameters)" in f.message
    assert "state_dict()" in f.message and "never updated" in f.message
    assert "nn.ModuleList" in f.hint and "self.hidden" in f.hint
    assert f.details["container"] == "list" and f.details["modules"] == 3 and f.details["untrained_tensors"] == 6


class DictHeads(nn.Module):
    def __init__(self, container):
        super().__init__()
        self.body = nn.Linear(8, 16)
        heads = {"a": nn.Linear(16, 1), "b": nn.Linear(16, 1)}
        self.heads = heads if container == "dict" else tuple(heads.values())

    def forward(self, x):
        h = self.body(x)
        heads = self.heads.values() if isinstance(self.heads, dict) else self.heads
        return sum(head(h) for head in heads)


def train_steps(model, steps=3, g_opts=None, use_model=True, opt=None):
    opt = opt or torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.01)
    with guard(model if use_model else None, opt if use_model else None, live=False,
               **(g_opts or {})) as g:
        for _ in range(steps):
            opt.zero_grad()
            loss = model(torch.randn(4, 8)).float().pow(2).mean()
            loss.backward()
            opt.step()
    return g


@pytest.mark.parametrize("container,fix", [("dict", "nn.ModuleDict"), ("tuple", "nn.ModuleList")])
def test_module_dict_and_tuple_are_found(container, fix):
    g = train_steps(DictHeads(container))
    [f] = only(g, "module-not-registered")
    assert f.where == "heads" and f.details["container"] == container and f.details["modules"] == 2
    assert fix in f.hint and f"plain Python {container}" in f.message


class Encoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = [nn.Linear(8, 8), nn.Linear(8, 8)]

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


def test_nested_attribute_in_global_mode():
    model = nn.Sequential(Encoder(), nn.Linear(8, 1))
    g = train_steps(model, use_model=False, g_opts={"checks": ["module-not-registered"]})
    [f] = g.findings
    assert f.where == "0.blocks" and f.details["model"] == "Sequential"
    assert f.source == line_of(Encoder, "self.blocks =")


def test_raise_mode_stops_at_the_first_step():
    model = module_not_registered.MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(GuardError) as ei:
        with guard(model, opt, mode="raise", live=False):
            F.mse_loss(model(torch.randn(4, 10)), torch.randn(4, 1)).backward()
            opt.step()
    assert ei.value.finding.kind == "module-not-registered"
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))  # stopped before the update


class HealthyContainers(nn.Module):
    """Registered lists aliased by plain lists, lists of functions and tensors, a shared module, a frozen teacher."""

    def __init__(self, shared):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 8)])
        self.order = list(self.layers)  # the same modules, also registered
        self.by_name = {"first": self.layers[0]}
        self.acts = [torch.relu, F.gelu]  # plain functions
        self.scales = [torch.ones(8), torch.full((8,), 0.5)]  # plain tensors
        self.enc = nn.Sequential(shared, nn.ReLU())
        self.dec = nn.Sequential(shared, nn.ReLU())  # shared on purpose between two registered parents
        teacher = nn.Linear(8, 8).requires_grad_(False)
        self._teacher = [teacher]  # hidden on purpose from parameters()/state_dict(); never trained
        self.out = nn.Linear(8, 1)

    def forward(self, x):
        for layer, act, s in zip(self.order, self.acts, self.scales):
            x = act(layer(x)) * s
        with torch.no_grad():
            t = self._teacher[0](x)
        return self.out(self.dec(self.enc(x)) + 0 * t)


def test_healthy_module_containers_are_silent_in_model_and_global_mode():
    model = HealthyContainers(nn.Linear(8, 8))
    assert train_steps(model, g_opts={"checks": "all"}).findings == []
    assert train_steps(model, use_model=False, g_opts={"checks": "all"}).findings == []


def test_unregistered_modules_wired_into_the_optimizer_by_hand_are_left_alone():
    model = module_not_registered.MLP()
    params = list(model.parameters()) + [p for m in model.hidden for p in m.parameters()]
    opt = torch.optim.SGD(params, lr=0.01)
    with guard(model, opt, live=False, checks=["module-not-registered"]) as g:
        for _ in range(3):
            opt.zero_grad()
            F.mse_loss(model(torch.randn(4, 10)), torch.randn(4, 1)).backward()
            opt.step()
    assert g.findings == []


# --------------------------------------------------------------------------- train-in-eval-mode

def test_train_in_eval_mode_demo_names_step_and_eval_line():
    g = train_in_eval_mode.train(live=False)
    assert kinds(g) == ["train-in-eval-mode"]
    f = g.findings[0]
    assert f.severity == "warning" and f.where == "Sequential" and f.step == 4  # 4 steps per epoch
    assert f.last_step == 11 and f.count == 8  # trained in eval mode until the run's last step
    src = line_of(train_in_eval_mode, "model.eval()  # validation")
    assert f.source == src and f.details["eval_source"] == src and f.details["eval_step"] == 4
    assert f"Sequential.eval() was called at {src}" in f.message and "1 (BatchNorm1d), 3 (Dropout)" in f.message
    assert "model.train()" in f.hint and "requires_grad_(False)" not in f.hint  # a validation's eval(): no freeze


def test_eval_called_before_training_on_a_trained_model_is_told_it_does_not_freeze():
    """`encoder.eval()  # freeze` before the first step, the encoder's parameters all in the optimizer: eval() only
    switches Dropout/BatchNorm, so the hint adds how to freeze."""
    torch.manual_seed(0)
    encoder = nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.2), nn.ReLU())
    head = nn.Linear(16, 2)
    with guard(live=False, checks=["train-in-eval-mode"]) as g:
        encoder.eval()  # meant as a freeze
        opt = torch.optim.AdamW([*encoder.parameters(), *head.parameters()], lr=1e-3)
        for _ in range(4):
            loss = F.cross_entropy(head(encoder(torch.randn(8, 8))), torch.randint(0, 2, (8,)))
            opt.zero_grad()
            loss.backward()
            opt.step()
    [f] = g.findings
    assert (f.kind, f.step, f.details["eval_step"]) == ("train-in-eval-mode", 0, 0)
    assert "eval() only switches Dropout and BatchNorm" in f.hint and "requires_grad_(False)" in f.hint


def test_model_in_eval_mode_from_the_start_is_reported_at_step_0():
    model = nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.2), nn.Linear(16, 1))
    model.eval()  # e.g. a pretrained model loaded in eval mode, fine-tuned without model.train()
    g = train_steps(model, g_opts={"checks": ["train-in-eval-mode"]})
    [f] = g.findings
    assert f.step == 0 and "already in eval mode when guard started" in f.message and "2 (Dropout)" not in f.message
    assert f.details["modules"] == ["1"]


def test_copy_of_a_model_in_eval_mode_is_told_as_a_copy():
    # FedAvg: each round's clients train copy.deepcopy(server) after the server's evaluation put it in eval mode; the
    # copies never get .train(): not "in eval mode when guard started" (they did not exist), but a copy's mode
    torch.manual_seed(0)
    server = nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.Dropout(0.3), nn.Linear(16, 2))
    x, y = torch.randn(32, 6), torch.randint(0, 2, (32,))
    with guard(checks=["train-in-eval-mode"], live=False) as g:
        for rnd in range(3):
            states = []
            for _ in range(2):
                client = copy.deepcopy(server)
                opt = torch.optim.SGD(client.parameters(), lr=0.05)
                for _ in range(3):
                    opt.zero_grad()
                    F.cross_entropy(client(x), y).backward()
                    opt.step()
                states.append(client.state_dict())
            server.load_state_dict({k: torch.stack([s[k].float() for s in states]).mean(0).to(states[0][k].dtype)
                                    for k in states[0]})
            server.eval()  # the server's evaluation
            with torch.no_grad():
                server(x)
    [f] = g.findings
    assert f.kind == "train-in-eval-mode" and f.step == 6  # the first copy made after server.eval()
    assert "in eval mode from its first call (step 6)" in f.message and "when guard started" not in f.message
    src = line_of(test_copy_of_a_model_in_eval_mode_is_told_as_a_copy, "server.eval()  # the server's")
    assert f.details["copied_from"]["eval_source"].endswith(src.rpartition(":")[2]) and src in f.message
    assert "copy.deepcopy(global_model); model.train()" in f.hint


def test_train_in_eval_mode_in_global_mode():
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with guard(live=False, checks=["train-in-eval-mode"]) as g:
        for step in range(4):
            opt.zero_grad()
            model(torch.randn(4, 8)).pow(2).mean().backward()
            opt.step()
            if step == 1:
                model.eval()
    [f] = g.findings
    assert f.step == 2 and f.details["eval_step"] == 2 and f.details["types"] == ["BatchNorm1d"]


class _Seq(nn.Module):
    """A SMILES generator whose only dropout is the LSTM's own (between its 2 layers), or an encoder whose only
    dropout is nn.MultiheadAttention's."""

    def __init__(self, kind, layers=2):
        super().__init__()
        self.kind, self.emb = kind, nn.Embedding(12, 16)
        if kind == "lstm":
            self.core = nn.LSTM(16, 16, num_layers=layers, dropout=0.3, batch_first=True)
        else:
            self.core = nn.MultiheadAttention(16, 2, dropout=0.2, batch_first=True)
        self.head = nn.Linear(16, 12)

    def forward(self, x):
        h = self.emb(x)
        h = self.core(h)[0] if self.kind == "lstm" else self.core(h, h, h, need_weights=False)[0]
        return self.head(h)


def _seq_run(kind, bug, layers=2):
    torch.manual_seed(0)
    model = _Seq(kind, layers)
    opt = torch.optim.Adam(model.parameters(), 1e-3)
    with guard(model, opt, live=False) as g:
        for step in range(14):
            x = torch.randint(0, 12, (4, 6))
            loss = F.cross_entropy(model(x[:, :-1]).reshape(-1, 12), x[:, 1:].reshape(-1))
            opt.zero_grad()
            loss.backward()
            opt.step()
            if step == 9:
                if bug == "eval left on":
                    model.eval()  # sampling in eval mode, and no model.train() after it
                    with torch.no_grad():
                        model(torch.zeros(1, 1, dtype=torch.long))
                elif bug == "sampling in train mode":
                    with torch.no_grad():
                        model(torch.zeros(1, 1, dtype=torch.long))
    return g


@pytest.mark.parametrize("kind", ["lstm", "attention"])
@pytest.mark.parametrize("bug", ["eval left on", "sampling in train mode"])
def test_dropout_built_into_lstm_and_attention_counts_for_the_mode_checks(kind, bug):
    """nn.LSTM(dropout=...) and nn.MultiheadAttention(dropout=...) act differently in train and eval mode, like
    nn.Dropout: a model whose only dropout is theirs was silent for both mode checks."""
    g = _seq_run(kind, bug)
    want = "train-in-eval-mode" if bug == "eval left on" else "eval-in-train-mode"
    [f] = g.findings
    assert (f.kind, f.where, f.step) == (want, "_Seq", 10)
    assert ("core (LSTM)" if kind == "lstm" else "core (MultiheadAttention)") in f.message


def test_a_one_layer_lstm_has_no_dropout_to_switch():
    """dropout= of a one-layer LSTM is never applied (it acts between layers): its mode changes nothing."""
    assert _seq_run("lstm", "eval left on", layers=1).findings == []
    assert _seq_run("lstm", "sampling in train mode", layers=1).findings == []


def test_frozen_batchnorm_models_without_dropout_and_eval_then_train_are_silent():
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Dropout(0.1), nn.Linear(16, 1))
    model.train()
    model[1].eval()  # frozen BatchNorm on purpose
    assert train_steps(model, g_opts={"checks": "all"}).findings == []
    plain = mlp().eval()  # no dropout/BatchNorm: eval mode changes nothing
    assert train_steps(plain, g_opts={"checks": "all"}).findings == []
    optout = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5), nn.Linear(8, 1)).eval()
    optout.guard_eval_mode_ok = True
    assert train_steps(optout, g_opts={"checks": ["train-in-eval-mode"]}).findings == []


def test_a_linear_probe_on_a_backbone_kept_in_eval_mode_is_silent():
    # model.eval(); model.head.train(): the backbone's BatchNorm statistics frozen on purpose, the head trains.
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 2))
    model.requires_grad_(False)
    model[3].requires_grad_(True)
    opt = torch.optim.SGD(model[3].parameters(), lr=0.1)
    model.eval()
    model[3].train()
    with guard(model, opt, checks="all", live=False) as g:
        for _ in range(3):
            opt.zero_grad()
            F.cross_entropy(model(torch.randn(8, 8)), torch.randint(0, 2, (8,))).backward()
            opt.step()
    assert g.findings == []
    # a head with its own Dropout left in eval mode: the classic missing model.train() again (a Linear head left in
    # eval mode acts as in training: nothing to tell, see test_loop_checks's last-layer retraining)
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(),
                          nn.Sequential(nn.Dropout(0.5), nn.Linear(16, 2)))
    model.requires_grad_(False)
    model[3].requires_grad_(True)
    opt = torch.optim.SGD(model[3].parameters(), lr=0.1)
    model.eval()
    with guard(model, opt, checks=["train-in-eval-mode"], live=False) as g:
        for _ in range(2):
            opt.zero_grad()
            F.cross_entropy(model(torch.randn(8, 8)), torch.randint(0, 2, (8,))).backward()
            opt.step()
    assert kinds(g) == ["train-in-eval-mode"]


# --------------------------------------------------------------------------- loss-shape-broadcast

def test_loss_shape_demo_names_both_shapes_and_the_fix():
    g = loss_shape_broadcast.train(live=False)
    assert kinds(g) == ["loss-shape-broadcast"]
    f = g.findings[0]
    assert f.severity == "error" and f.where == "loss" and f.step == 0 and f.count == 6
    assert "input [64, 1] and target [64]: they broadcast to [64, 64]" in f.message
    assert "target.view_as(input)" in f.hint and "squeeze(-1)" in f.hint
    assert f.source == line_of(loss_shape_broadcast, "loss = nn.functional.mse_loss")


@pytest.mark.parametrize("loss", [nn.MSELoss(), nn.L1Loss(), nn.SmoothL1Loss(), nn.HuberLoss(),
                                  "mse_loss", "l1_loss", "smooth_l1_loss", "huber_loss"])
def test_regression_losses_target_with_extra_dim(loss):
    model = mlp()
    if isinstance(loss, str):
        loss = lambda x, y, name=loss: getattr(F, name)(x, y)  # looked up at call time, as user code does
    with guard(model, checks=["loss-shape-broadcast"], live=False) as g, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loss(model(torch.randn(5, 8)).squeeze(-1), torch.randn(5, 1)).backward()
    [f] = g.findings
    assert f.details["input_shape"] == [5] and f.details["target_shape"] == [5, 1]
    assert f.details["broadcast_shape"] == [5, 5] and "target.squeeze(-1)" in f.hint


@pytest.mark.parametrize("loss", [nn.BCEWithLogitsLoss(), nn.BCELoss()])
def test_bce_mismatch_is_named_before_pytorchs_value_error(loss):
    model = nn.Sequential(mlp(), nn.Sigmoid())
    with guard(model, checks=["loss-shape-broadcast"], live=False) as g:
        with pytest.raises(ValueError):
            loss(model(torch.randn(6, 8)), torch.rand(6))
    [f] = g.findings
    assert f.details["broadcast_shape"] == [6, 6] and "raises a ValueError" in f.message


def test_healthy_loss_shapes_are_silent():
    model = mlp()
    with guard(model, checks="all", live=False) as g, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = model(torch.randn(6, 8))
        y = torch.randn(6, 1)
        losses = [
            F.mse_loss(out, y),  # equal shapes
            F.binary_cross_entropy_with_logits(out, y.sigmoid(), weight=torch.tensor(2.0)),  # a scalar weight
            F.mse_loss(out, torch.randn(1, 1).expand_as(out)),  # a deliberate expand to the same shape
            F.l1_loss(out, torch.tensor(0.0)),  # a scalar target: one value for every prediction
            F.binary_cross_entropy_with_logits(out, y.sigmoid(), pos_weight=torch.tensor([3.0])),
        ]
        sum(losses).backward()
    assert g.findings == []



@pytest.mark.parametrize("fn", ["gaussian", "poisson"])
def test_gaussian_and_poisson_nll_broadcast_without_a_warning_are_found(fn):
    """F.gaussian_nll_loss(mu[N, 1], y[N], var) and F.poisson_nll_loss broadcast to [N, N] with no warning at all."""
    torch.manual_seed(0)
    model = mlp(2)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def loss_of(out, y, fixed):
        mu, raw = out[:, :1], out[:, 1:]
        target = y.unsqueeze(1) if fixed else y
        if fn == "gaussian":
            return F.gaussian_nll_loss(mu, target, F.softplus(raw) + 1e-3)
        return F.poisson_nll_loss(mu, target.abs().round())

    for fixed in (False, True):
        with guard(model, opt, live=False) as g, warnings.catch_warnings():
            warnings.simplefilter("error")  # PyTorch itself says nothing
            for _ in range(3):
                opt.zero_grad()
                loss_of(model(torch.randn(16, 8)), torch.randn(16), fixed).backward()
                opt.step()
        if fixed:
            assert g.findings == []
        else:
            (f,) = g.findings
            assert (f.kind, f.step) == ("loss-shape-broadcast", 0)
            assert f.details["broadcast_shape"] == [16, 16] and "without a word" in f.message
            assert "target.view_as(input)" in f.hint or "squeeze" in f.hint


def _classify_with_mse(target_of, batch, classes=4, steps=3):
    torch.manual_seed(0)
    model = mlp(classes)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with guard(model, opt, live=False) as g, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(steps):
            x, y = torch.randn(batch, 8), torch.randint(0, classes, (batch,))
            loss = F.mse_loss(model(x), target_of(y))  # the labelled line
            opt.zero_grad()
            loss.backward()
            opt.step()
    return g


@pytest.mark.parametrize("target_of, batch, shape", [
    (lambda y: y.float().unsqueeze(1), 16, [16, 1]),  # one label per sample, broadcast over the 4 outputs
    (lambda y: y.float(), 4, [4]),  # batch size == classes: broadcast along the columns, PyTorch only warns
])
def test_mse_on_class_indices_that_broadcast_silently_asks_for_one_hot(target_of, batch, shape):
    g = _classify_with_mse(target_of, batch)
    [f] = g.findings
    assert f.kind == "loss-shape-broadcast" and f.severity == "error" and f.where == "loss" and f.step == 0
    assert f"target {shape} holding class indices (whole numbers in [0, 4))" in f.message
    assert "F.one_hot(target.long().view(-1), 4).float()" in f.hint and "F.cross_entropy" in f.hint
    assert f.source == line_of(_classify_with_mse, "# the labelled line")
    assert f.details["class_indices"] is True


@pytest.mark.parametrize("target_of, batch", [
    (lambda y: F.one_hot(y, 4).float(), 16),  # the fix
    (lambda y: torch.randn(16, 1), 16),  # four heads fitted to one real-valued target (an ensemble)
    (lambda y: torch.tensor([0.0, 1.0, 2.0, 3.0]), 16),  # one constant target per output column
    (lambda y: torch.randn(4), 4),  # real-valued, even with batch == classes
])
def test_targets_broadcast_into_the_outputs_without_class_indices_are_silent(target_of, batch):
    g = _classify_with_mse(target_of, batch)
    assert g.findings == [] and g.internal_errors == []


# --------------------------------------------------------------------------- zero-grad-before-step

def test_zero_grad_demo_names_the_three_lines():
    g = zero_grad_before_step.train(live=False)
    assert kinds(g) == ["zero-grad-before-step"]
    f = g.findings[0]
    assert f.severity == "error" and f.where == "Adam" and f.step == 0 and f.count == 6
    zero = line_of(zero_grad_before_step, "optimizer.zero_grad()  # wipes")
    back = line_of(zero_grad_before_step, "loss.backward()")
    assert f.source == line_of(zero_grad_before_step, "optimizer.step()")
    assert f"zero_grad() ({zero}), which came after backward() ({back})" in f.message
    assert "every gradient is None" in f.message and f.details["grads"] == "None"
    assert "zero_grad(); loss.backward(); optimizer.step()" in f.hint


@pytest.mark.parametrize("how", ["set_to_none=False", "model.zero_grad()"])
def test_zero_grad_with_zeros_and_through_the_module(how):
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-2)
    with guard(model, opt, checks="all", live=False) as g:
        for _ in range(3):
            model(torch.randn(4, 8)).pow(2).mean().backward()
            if how == "model.zero_grad()":
                model.zero_grad()
            else:
                opt.zero_grad(set_to_none=False)
            opt.step()
    f = only(g, "zero-grad-before-step")[0]
    assert f.step == 0 and f.where == "SGD"
    assert f.details["grads"] == ("zero" if how == "set_to_none=False" else "None")


def test_zero_grad_raise_mode_stops_at_the_step():
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(GuardError) as ei:
        with guard(model, opt, mode="raise", live=False):
            model(torch.randn(4, 8)).pow(2).mean().backward()
            opt.zero_grad()
            opt.step()
    assert ei.value.finding.kind == "zero-grad-before-step"


def test_healthy_zero_grad_orders_are_silent():
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def before(i, x):  # zero_grad before backward
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()

    def after(i, x):  # zero_grad after step
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()

    def accumulate(i, x):  # accumulation over 2 micro-batches, zeroing after its step
        (model(x).pow(2).mean() / 2).backward()
        if i % 2:
            opt.step()
            opt.zero_grad()

    for pattern in (before, after, accumulate):
        opt.zero_grad()
        with guard(model, opt, checks="all", live=False) as g:
            for i in range(6):
                pattern(i, torch.randn(4, 8))
        assert g.findings == [], pattern.__name__


@pytest.mark.parametrize("scope", ["models", "global"])
@pytest.mark.parametrize("where", ["top of each micro-batch", "before the loop", "surgery"])
def test_zero_grad_at_the_top_of_each_micro_batch_keeps_only_the_last_one(scope, where):
    """Gradient accumulation over 4 micro-batches with opt.zero_grad() inside the loop: each micro-batch wipes the
    ones before it, so the step applies one micro-batch. Told at the third step in a row (silent until stop 40).
    Zeroing before the loop is the recipe; keeping each pass's gradients aside and assigning their mean to p.grad
    (gradient surgery, DP-SGD by hand) zeroes between the passes on purpose."""
    torch.manual_seed(0)
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with guard(*((model, opt) if scope == "models" else ()), live=False) as g:
        for _ in range(5):
            if where == "before the loop":
                opt.zero_grad()
            kept = []
            for mb in torch.randn(4, 4, 8):
                if where != "before the loop":
                    opt.zero_grad()
                (model(mb).pow(2).mean() / 4).backward()
                if where == "surgery":
                    kept.append([p.grad.clone() for p in model.parameters()])
            if where == "surgery":
                for p, *gs in zip(model.parameters(), *kept):
                    p.grad = torch.stack(gs).mean(0)
            opt.step()
    if where != "top of each micro-batch":
        assert g.findings == []
        return
    (f,) = g.findings
    assert (f.kind, f.where, f.step) == ("zero-grad-before-step", "SGD", 0) and f.details["micro_batches"] is True
    assert "sees one micro-batch, not the accumulated batch" in f.message and "once per step" in f.hint


@pytest.mark.parametrize("scope", ["models", "global"])
@pytest.mark.parametrize("bug", [True, False])
def test_a_modules_zero_grad_between_its_backward_and_its_step_with_another_backward_between(scope, bug):
    """Dreamer's order: `wm_loss.backward(); wm.zero_grad(); cr_loss.backward(); cr_opt.step(); wm_opt.step()`.
    The critic's backward reaches none of the world model's parameters: its step applies nothing. Found although a
    backward sits between the zero_grad() and the step; the DCGAN order (`netG.zero_grad()` after D's backward,
    then G's own backward) stays silent."""
    torch.manual_seed(0)
    wm, critic = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 4)), nn.Linear(4, 1)
    wm_opt, cr_opt = torch.optim.Adam(wm.parameters(), 1e-3), torch.optim.Adam(critic.parameters(), 1e-3)
    models, opts = ([wm, critic], [wm_opt, cr_opt]) if scope == "models" else (None, None)
    with guard(models, opts, live=False) as g:
        for _ in range(6):
            x = torch.randn(32, 4)
            wm_opt.zero_grad()
            cr_opt.zero_grad()
            wm_loss = (wm(x) - x.roll(1, 1)).pow(2).mean()
            if bug:
                wm_loss.backward()
            with torch.no_grad():
                feats = wm(x)
            wm.zero_grad()  # the bug: meant to clear before the critic's pass
            critic(feats).pow(2).mean().backward()
            if not bug:
                wm_loss.backward()  # the wm's own backward after the zero_grad: fine
            cr_opt.step()
            wm_opt.step()
    if not bug:
        assert g.findings == []
        return
    f = only(g, "zero-grad-before-step")[0]
    assert f.where in ("Adam[0]", "Adam[1]")  # (wm_opt: the first built, the second seen stepping)
    assert f.step <= 1 and "reached none of" in f.message and f.details["grads"] == "None"

def test_partial_zero_grad_and_gradient_surgery_are_silent():
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with guard(model, opt, checks=["zero-grad-before-step"], live=False) as g:
        for _ in range(3):
            opt.zero_grad()
            model(torch.randn(4, 8)).pow(2).mean().backward()
            model[0].zero_grad()  # drop one layer's update on purpose
            opt.step()
        for _ in range(3):  # gradient surgery: per-task gradients merged by hand after zero_grad()
            grads = []
            for task in range(2):
                opt.zero_grad()
                model(torch.randn(4, 8)).pow(2).mean().backward()
                grads.append([p.grad.clone() for p in model.parameters()])
            opt.zero_grad()
            for p, g0, g1 in zip(model.parameters(), *grads):
                p.grad = (g0 + g1) / 2
            opt.step()
    assert g.findings == []


@pytest.mark.parametrize("set_to_none", [True, False])
def test_zero_grad_between_two_backwards_loses_the_first_losss_gradients(set_to_none):
    """A policy and a value head on one optimizer, zero_grad() between their backwards: the policy's gradients are
    wiped before the step every time and it never trains. Told at the third step in a row, from step 0, naming the
    lost parameters; a one-off diagnostic backward before the real one (all parameters recomputed) is silent."""
    torch.manual_seed(0)
    model = nn.ModuleDict({"pi": nn.Linear(8, 4), "v": nn.Linear(8, 1)})
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with guard(model, opt, live=False) as g:
        for step in range(6):
            s = torch.randn(32, 8)
            if step == 0:  # a diagnostic backward: every gradient is recomputed by the real one
                opt.zero_grad()
                (model["pi"](s).sum() + model["v"](s).sum()).backward()
            loss_pi = F.cross_entropy(model["pi"](s), s[:, :4].argmax(-1))
            loss_v = F.mse_loss(model["v"](s).squeeze(-1), s[:, 0])
            opt.zero_grad(set_to_none=set_to_none)
            loss_pi.backward()
            opt.zero_grad(set_to_none=set_to_none)  # the bug
            loss_v.backward()
            opt.step()
    f = only(g, "zero-grad-before-step")[0]
    assert f.where == "SGD" and f.step == 0 and f.details["lost"] == ["pi.weight", "pi.bias"]
    path, _, no = f.details["zero_grad_source"].rpartition(":")
    assert linecache.getline(os.path.abspath(path), int(no)).strip().startswith("opt.zero_grad(set_to_none=set_to_none)  # the bug")
    assert "only the gradients of the backward() after zero_grad()" in f.message
    assert "loss_b.backward(); opt.step()" in f.hint


def test_alternating_architecture_and_weight_steps_drop_leftover_gradients_silently():
    """GDAS/DARTS: the architecture step's backward also fills the weights' gradients; the weights' zero_grad()
    drops them, and the next batch samples other ops, whose weights get no gradient. The architecture optimizer
    stepped after that backward: leftovers, not lost work."""
    torch.manual_seed(0)
    ops = nn.ModuleList([nn.Linear(8, 8) for _ in range(3)])
    alpha = nn.Parameter(torch.zeros(3))
    w_opt, a_opt = torch.optim.SGD(ops.parameters(), lr=0.05), torch.optim.Adam([alpha], lr=1e-2)

    def forward(x):
        k = int(torch.randint(0, 3, ()))  # one sampled op per forward
        return ops[k](x) * torch.softmax(alpha, 0)[k]

    with guard(ops, [w_opt, a_opt], live=False) as g:
        for _ in range(8):
            a_opt.zero_grad(); forward(torch.randn(4, 8)).pow(2).mean().backward(); a_opt.step()
            w_opt.zero_grad(); forward(torch.randn(4, 8)).pow(2).mean().backward(); w_opt.step()
    assert "zero-grad-before-step" not in [f.kind for f in g.findings]


def test_zero_grad_by_a_wrapper_sharing_the_base_optimizers_groups_is_found():
    """SAM's second_step with its zero_grad() before base_optimizer.step() (lines swapped): the wrapper, which never
    steps itself, zeroes the base optimizer's gradients. Found from step 0; the right order (and first_step's
    zero_grad between the two passes) is silent."""

    class SAM(torch.optim.Optimizer):
        def __init__(self, params, base, swapped, **kw):
            super().__init__(params, dict(rho=0.05, **kw))
            self.base_optimizer = base(self.param_groups, **kw)
            self.param_groups, self.swapped = self.base_optimizer.param_groups, swapped

        @torch.no_grad()
        def first_step(self):
            for grp in self.param_groups:
                for p in grp["params"]:
                    self.state[p]["e"] = e = p.grad * 0.05 / (p.grad.norm() + 1e-12)
                    p.add_(e)
            self.zero_grad()

        @torch.no_grad()
        def second_step(self):
            for grp in self.param_groups:
                for p in grp["params"]:
                    p.sub_(self.state[p]["e"])
            if self.swapped:
                self.zero_grad()  # the bug: after the base step
            self.base_optimizer.step()
            if not self.swapped:
                self.zero_grad()

    for swapped in (True, False):
        torch.manual_seed(0)
        model = mlp()
        opt = SAM(model.parameters(), torch.optim.SGD, swapped, lr=0.1)
        with guard(live=False) as g:
            for _ in range(5):
                x = torch.randn(16, 8)
                model(x).pow(2).mean().backward(); opt.first_step()
                model(x).pow(2).mean().backward(); opt.second_step()
        if swapped:
            f = only(g, "zero-grad-before-step")[0]
            assert (f.where, f.step, f.details["grads"]) == ("SGD", 0, "None")
        else:
            assert g.findings == []


def test_gradient_surgery_on_sparse_gradients_is_silent_and_a_wiped_sparse_step_is_not():
    emb = nn.Embedding(20, 4, sparse=True)
    opt = torch.optim.SparseAdam(emb.parameters(), lr=1e-2)
    with guard(emb, opt, checks=["zero-grad-before-step"], live=False) as g:
        for _ in range(3):  # per-task sparse gradients merged by hand after zero_grad()
            z = emb(torch.randint(0, 20, (8,)))
            grads = []
            for loss in (z.pow(2).mean(), (z - 1).abs().mean()):
                opt.zero_grad()
                loss.backward(retain_graph=True)
                grads.append(emb.weight.grad.to_dense())
            opt.zero_grad()
            emb.weight.grad = (grads[0] + grads[1]).to_sparse()
            opt.step()
    assert g.findings == []
    emb.weight.grad = None
    with guard(emb, opt, checks=["zero-grad-before-step"], live=False) as g:
        for _ in range(2):
            emb(torch.randint(0, 20, (8,))).pow(2).mean().backward()
            opt.zero_grad()  # the bug: the sparse gradient is dropped before the step
            opt.step()
    assert [(f.kind, f.details["grads"]) for f in g.findings] == [("zero-grad-before-step", "None")]


def test_zero_grad_of_an_optimizer_over_an_untrained_original_is_no_wiped_step():
    """FedAvg with each client's optimizer built over the global model while the deep copy trains: its zero_grad()
    finds no gradient to wipe. The copy is the bug (the notice says so), not the order of the calls."""
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    x, y = torch.randn(16, 4), torch.randn(16, 1)
    with guard(model, live=False) as g:
        for _ in range(3):
            for _ in range(4):
                client = copy.deepcopy(model)
                opt = torch.optim.SGD(model.parameters(), lr=0.1)  # the bug: client.parameters()
                for _ in range(8):
                    opt.zero_grad()
                    F.mse_loss(client(x), y).backward()
                    opt.step()
            model.load_state_dict(client.state_dict())
            with torch.no_grad():
                F.mse_loss(model(x), y).item()
    assert "zero-grad-before-step" not in kinds(g)
    assert any("model was copied" in n and "Build the optimizer over the copy's parameters" in n for n in g.notices)


# --------------------------------------------------------------------------- loss-disconnected

def test_loss_disconnected_demo():
    g = loss_disconnected.train(live=False)
    f = only(g, "loss-disconnected")[0]
    assert f.severity == "error" and f.where == "loss" and f.step == 0
    assert kinds(g) == ["loss-disconnected"]  # the graphs it cut off are its consequence, not an evaluation
    assert f.source == line_of(loss_disconnected, "loss.backward()")
    assert "reaches no parameter of SGD" in f.message and "only itself" in f.message
    assert "torch.tensor(loss.item(), requires_grad=True)" in f.message and ".item()" in f.hint


def test_a_loss_cut_by_numpy_leaves_no_evaluation_finding_for_the_last_forward_still_held():
    """pred.detach().numpy() -> ... -> loss.requires_grad_(): the last step's `pred` keeps its graph to the end
    of the run; that graph is the disconnected loss's consequence, not an evaluation outside no_grad."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 16), nn.ReLU(), nn.Linear(16, 3))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with guard(model, opt, live=False) as g:
        for _ in range(10):
            x = torch.randn(8, 3)
            pred = model(x)
            loss = torch.from_numpy(((pred.detach().numpy() - x.numpy()) ** 2).mean(keepdims=True)).requires_grad_()
            opt.zero_grad(); loss.sum().backward(); opt.step()
    assert kinds(g) == ["loss-disconnected"]


@pytest.mark.parametrize("mode", ["warn", "raise"])
def test_an_attack_with_its_own_optimizer_over_its_delta_is_no_disconnected_loss(mode):
    """PGD with Adam([delta]) while the model is frozen: that backward reaches only delta, which an optimizer the
    model guard does not watch updates in place before the model's step (it was an error, and raise stopped training)."""
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(8, 4), torch.randint(0, 2, (8,))
    with guard(model, opt, live=False, mode=mode) as g:
        for _ in range(3):
            delta = torch.zeros_like(x, requires_grad=True)
            dopt = torch.optim.Adam([delta], lr=0.1)
            model.requires_grad_(False)
            for _ in range(3):
                dopt.zero_grad()
                (-F.cross_entropy(model(x + delta), y)).backward()
                dopt.step()
            model.requires_grad_(True)
            opt.zero_grad()
            F.cross_entropy(model(x + delta.detach()), y).backward()
            opt.step()
    assert g.findings == [] and g.internal_errors == []


def test_a_functional_call_over_copies_of_the_parameters_is_told_so():
    torch.manual_seed(0)
    model = mlp()
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    params = {k: v.detach().clone().requires_grad_() for k, v in model.named_parameters()}
    with guard(model, opt, live=False) as g:
        for _ in range(2):
            x = torch.randn(8, 8)
            loss = torch.func.functional_call(model, params, (x,)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    f = only(g, "loss-disconnected")[0]
    assert "shaped like Adam's parameters" in f.message and "functional_call" in f.message
    assert "params.values()" in f.hint


def test_a_prompt_parameter_left_out_of_an_optimizer_over_a_frozen_backbone_is_disconnected():
    """The loss reaches only a bare nn.Parameter (a soft prompt) that no optimizer holds: nothing trains."""
    torch.manual_seed(0)
    backbone = nn.Linear(4, 2).requires_grad_(False)
    prompt = nn.Parameter(torch.zeros(4))

    def fit(opt):
        with guard(backbone, opt, live=False) as g:
            for _ in range(3):
                loss = F.cross_entropy(backbone(torch.randn(8, 4) + prompt), torch.randint(0, 2, (8,)))
                opt.zero_grad()
                loss.backward()
                opt.step()
        return g

    g = fit(torch.optim.SGD(backbone.parameters(), lr=0.1))
    f = only(g, "loss-disconnected")[0]
    assert f.step == 0 and "parameter(s) that no optimizer holds" in f.message and "[4]" in f.message
    assert "add_param_group" in f.hint
    g = fit(torch.optim.SGD([prompt], lr=0.1))  # the healthy twin: the prompt in the optimizer
    assert g.findings == [] and g.internal_errors == []


@pytest.mark.parametrize("analysis", ["temperature-scaling", "saliency", "saliency-kept"])
def test_analysis_backwards_between_epochs_are_no_disconnected_loss(analysis):
    """Temperature scaling (log T fitted by its own Adam in a helper) and input saliency with the model frozen:
    their backwards reach a plain tensor only, on purpose (it was an error at the next training step)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    x, y = torch.randn(64, 16), torch.randint(0, 4, (64,))
    kept = []

    def temperature():
        with torch.no_grad():
            logits = model(x)
        log_t = torch.zeros(1, requires_grad=True)
        t_opt = torch.optim.Adam([log_t], lr=0.05)
        for _ in range(5):
            loss = F.cross_entropy(logits / log_t.exp(), y)
            t_opt.zero_grad()
            loss.backward()
            t_opt.step()

    def saliency():
        model.requires_grad_(False)
        xs = x[:4].clone().requires_grad_(True)
        model(xs).gather(1, y[:4, None]).sum().backward()
        model.requires_grad_(True)
        if analysis == "saliency-kept":
            kept.append(xs)  # still alive at the next training step
        return xs.grad.abs()

    with guard(model, opt, live=False) as g:
        for _ in range(2):
            for i in range(0, 64, 16):
                loss = F.cross_entropy(model(x[i:i + 16]), y[i:i + 16])
                opt.zero_grad()
                loss.backward()
                opt.step()
            temperature() if analysis == "temperature-scaling" else saliency()
    assert g.findings == [] and g.internal_errors == []


def test_numpy_round_trip_names_the_tensor_it_reaches_in_global_mode():
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with guard(checks=["loss-disconnected"], live=False) as g:
        for _ in range(2):
            opt.zero_grad()
            pred = torch.tensor(model(torch.randn(5, 8)).detach().numpy(), requires_grad=True)
            F.mse_loss(pred, torch.randn(5, 1)).backward()
            opt.step()
    [f] = g.findings
    assert "only 1 tensor(s) that are not parameters: a tensor [5, 1] (a leaf made with requires_grad=True)" \
        in f.message
    assert f.details["reaches"] == ["a tensor [5, 1] (a leaf made with requires_grad=True)"]


@pytest.mark.parametrize("scope", ["global", "model"])
def test_a_model_rebuilt_after_its_optimizer_is_disconnected_from_step_0(scope):
    """`opt = SGD(model.parameters()); model = Net()` (a fold loop re-creating the model): every step trains
    nothing, from step 0. Under a global guard it was told at step 1 (the first backward ran before guard knew
    the optimizer, when any parameter counted as held); its loss is now walked again at that step's update."""
    torch.manual_seed(0)
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model = mlp()
    with guard(live=False) if scope == "global" else guard(model, opt, live=False) as g:
        for _ in range(4):
            loss = F.mse_loss(model(torch.randn(5, 8)), torch.randn(5, 1))
            opt.zero_grad()
            loss.backward()
            opt.step()
    f = next(f for f in g.findings if f.kind == "loss-disconnected")
    assert (f.where, f.step) == ("loss", 0) and "held by no optimizer" in f.message


def test_loss_cut_off_after_healthy_steps_is_found_at_its_step():
    """Healthy steps teach the check the path from the loss to a parameter; a loss cut off later is still walked."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scale = torch.ones(1, requires_grad=True)  # a plain tensor no optimizer holds
    with guard(model, opt, checks=["loss-disconnected"], live=False) as g:
        for step in range(6):
            opt.zero_grad()
            out = model(torch.randn(5, 8))
            if step >= 4:
                out = out.detach() * scale  # the same loss function, now fed a cut-off graph
            F.mse_loss(out, torch.randn(5, 1)).backward()
            opt.step()
    [f] = g.findings
    assert f.kind == "loss-disconnected" and f.step == 4
    assert f.details["reaches"] == ["a tensor [1] (a leaf made with requires_grad=True)"]


def test_head_only_loss_gan_style_transfer_and_manual_sgd_are_silent():
    from tests.healthy import gan_detach

    g, _ = gan_detach.train(checks=["loss-disconnected"], live=False)
    assert g.findings == []
    body, head = mlp(16), nn.Linear(16, 3)
    opt = torch.optim.Adam(list(body.parameters()) + list(head.parameters()), lr=1e-3)
    with guard([body, head], opt, checks="all", live=False) as g:
        for _ in range(3):
            opt.zero_grad()
            feats = body(torch.randn(8, 8))
            F.cross_entropy(head(feats.detach()), torch.randint(0, 3, (8,))).backward()  # trains only the head
            feats.pow(2).mean().backward()
            opt.step()
    assert g.findings == []
    frozen = mlp().requires_grad_(False)
    image = torch.randn(4, 8, requires_grad=True)
    opt = torch.optim.SGD([image], lr=0.1)  # optimizing a plain tensor: style transfer, adversarial inputs
    with guard(checks=["loss-disconnected"], live=False) as g:
        for _ in range(3):
            opt.zero_grad()
            frozen(image).pow(2).mean().backward()
            opt.step()
    assert g.findings == []
    from tests.healthy import no_optimizer_manual_sgd

    g, _ = no_optimizer_manual_sgd.train(checks=["loss-disconnected"], live=False)
    assert g.findings == []


# --------------------------------------------------------------------------- init-loss-high

def test_init_loss_demo_compares_with_log_c():
    g = init_loss_high.train(live=False)
    assert kinds(g) == ["init-loss-high"]
    f = g.findings[0]
    assert f.severity == "info" and f.where == "loss" and f.step == 0
    assert f.details["classes"] == 10 and f.details["calls"] == 3
    assert f.details["log_c"] == pytest.approx(math.log(10)) and f.details["ratio"] > 3
    assert f"log(C) = {math.log(10):.3g} for C=10 classes" in f.message and "Verify the loss at init" in f.hint
    assert f.source == line_of(init_loss_high, "loss = criterion(model(x), y)")


def test_init_loss_silent_for_label_smoothing_class_weights_and_a_trained_model():
    torch.manual_seed(0)
    model = mlp(5)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    x, y = torch.randn(64, 8), torch.randint(0, 5, (64,))
    for _ in range(200):  # a trained model, resumed under guard: loss below log(C)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    with guard(model, opt, checks="all", live=False) as g:
        for _ in range(4):
            opt.zero_grad()
            F.cross_entropy(model(x), y, label_smoothing=0.1, weight=torch.rand(5) + 0.5).backward()
            opt.step()
    assert g.findings == []


def test_init_loss_judged_at_exit_when_fewer_steps_ran():
    g = init_loss_high.train(steps=1, live=False)
    [f] = g.findings
    assert f.details["calls"] == 1 and f.step == 0


class _Inner(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = [nn.Linear(8, 8) for _ in range(2)]  # the bug is here, in _Inner

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


class _Outer(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = _Inner()
        self.head = nn.Linear(8, 1)

    def forward(self, x):
        return self.head(self.inner(x))


def test_an_unregistered_list_in_a_submodule_names_the_class_that_holds_it():
    torch.manual_seed(0)
    model = _Outer()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with guard(model, opt, live=False) as g:
        for _ in range(2):
            opt.zero_grad()
            model(torch.randn(4, 8)).pow(2).mean().backward()
            opt.step()
    (f,) = only(g, "module-not-registered")
    assert f.where == "inner.blocks"
    assert "that _Inner (_Outer.inner) does not register" in f.message and "_Inner.__init__" in f.hint


def test_a_loss_computed_under_no_grad_then_given_requires_grad_is_told_so():
    torch.manual_seed(0)
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    @torch.no_grad()
    def compute_loss(x, y):
        return F.mse_loss(model(x), y)

    with guard(model, opt, live=False) as g:
        for _ in range(2):
            opt.zero_grad()
            loss = compute_loss(torch.randn(8, 8), torch.randn(8, 1))
            loss.requires_grad_()  # silences "does not require grad": the model gets no gradient
            loss.backward()
            opt.step()
    f = only(g, "loss-disconnected")[0]
    assert "computed under torch.no_grad() and then given requires_grad_()" in f.message
    assert "@torch.no_grad()" in f.hint


class _Gate(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, h):
        return torch.sigmoid(self.lin(h))


class _PerCall(nn.Module):
    """`how`: "linear"/"gate" build a layer inside forward at every call (the bug); "lazy" builds it once and
    registers it; "lossfn" builds a parameter-free module per call; "fixed" builds it in __init__."""

    def __init__(self, how):
        super().__init__()
        self.how = how
        self.enc = nn.Linear(8, 16)
        self.proj = _Gate() if how == "fixed" else None

    def forward(self, x):
        h = torch.tanh(self.enc(x))
        if self.how == "linear":
            gate = nn.Linear(16, 16)  # a fresh random layer at every call
            h = h * torch.sigmoid(gate(h))
        elif self.how == "gate":
            h = h * _Gate()(h)
        elif self.how in ("lazy", "fixed"):
            if self.proj is None:
                self.proj = _Gate()
            h = h * self.proj(h)
        elif self.how == "lossfn":
            h = nn.Tanh()(h) + nn.functional.softplus(h) * 0
        return h[:, :3]


@pytest.mark.parametrize("how", ["linear", "gate", "lazy", "lossfn", "fixed"])
@pytest.mark.parametrize("mode", ["model", "global"])
def test_a_layer_constructed_inside_forward_at_every_call_is_found(how, mode):
    torch.manual_seed(0)
    model = _PerCall(how)
    x, y = torch.randn(16, 8), torch.randint(0, 3, (16,))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with guard(*([model, opt] if mode == "model" else []), live=False, checks="all") as g:
        for step in range(4):
            if how == "lazy" and step == 1:
                opt.add_param_group({"params": model.proj.parameters()})
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
    if how not in ("linear", "gate"):
        assert g.findings == [], g.findings
        return
    (f,) = g.findings
    assert (f.kind, f.where, f.step) == ("module-not-registered", "_PerCall", 0)
    kind = "Linear" if how == "linear" else "_Gate"
    assert f.message.startswith(f"a {kind} (272 parameters) is constructed inside _PerCall's forward")
    assert f.details["constructed"] == kind and "__init__" in f.hint
    assert f.source == line_of(_PerCall, "gate = nn.Linear(16, 16)" if how == "linear" else "h = h * _Gate()(h)")


def test_loss_reaching_only_a_watched_models_parameters_outside_the_optimizers_names_them():
    """Two optimizers, the discriminator's built over the generator by copy-paste: the D loss reaches netD's
    parameters, which no optimizer holds. They are named, and the message does not claim no gradient is computed."""
    torch.manual_seed(0)
    netG, netD = nn.Sequential(nn.Linear(4, 8), nn.Tanh()), nn.Sequential(nn.Linear(8, 1))
    optG, optD = torch.optim.Adam(netG.parameters(), 1e-3), torch.optim.Adam(netG.parameters(), 1e-3)  # the bug
    with guard([netG, netD], [optG, optD], live=False) as g:
        for _ in range(3):
            fake = netG(torch.randn(4, 4))
            optD.zero_grad()
            (F.softplus(-netD(torch.randn(4, 8))).mean() + F.softplus(netD(fake.detach())).mean()).backward()
            optD.step()
            optG.zero_grad()
            F.softplus(-netD(fake)).mean().backward()
            optG.step()
    f = only(g, "loss-disconnected")[0]
    assert "a parameter netD.0.bias [1]" in f.message and "a parameter netD.0.weight [1, 8]" in f.message
    assert "computes no gradient for the model" not in f.message and "does not update them" in f.message
    assert "Build the optimizer after the model is final" in f.hint


@pytest.mark.parametrize("fix", [None, "rebuild the optimizer", "load into the same model"])
def test_a_model_recreated_from_a_checkpoint_while_the_optimizer_keeps_the_old_parameters(fix):
    """A "restart from the best checkpoint" that builds a new instance (`model = Net(); model.load_state_dict(...)`)
    without a new optimizer: the watched model is not called any more, backward() runs over the new one, and the
    optimizer steps parameters that never get a gradient. Found 4 steps later; the two fixes are silent."""
    import io

    def net():
        return nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 3))

    torch.manual_seed(0)
    model = net()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    with guard(model, opt, live=False) as g:
        for i in range(40):
            x, y = torch.randn(32, 10), torch.randint(0, 3, (32,))
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            if i == 15:
                buf = io.BytesIO()
                torch.save(model.state_dict(), buf)
                buf.seek(0)
                if fix == "load into the same model":
                    model.load_state_dict(torch.load(buf))
                else:
                    model = net()
                    model.load_state_dict(torch.load(buf))
                    if fix == "rebuild the optimizer":
                        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    found = [(f.kind, f.step) for f in g.findings if f.severity != "info"]
    if fix:
        assert found == []
    else:
        assert found == [("loss-disconnected", 16)]
        f = g.findings[0]
        assert "the watched model is not called any more" in f.message and "model.load_state_dict(...)" in f.message
        assert f.details["model_not_called"] is True and "optimizer = torch.optim.Adam(model.parameters()" in f.hint


def test_an_optimizer_over_the_members_of_a_stacked_ensemble_names_the_stacked_copies():
    from torch.func import functional_call, stack_module_state

    torch.manual_seed(0)
    members = [nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 1)) for _ in range(3)]
    params, buffers = stack_module_state(members)
    opt = torch.optim.Adam([p for m in members for p in m.parameters()], lr=1e-3)  # the bug: params.values()
    base = copy.deepcopy(members[0]).to("meta")
    x, y = torch.randn(3, 16, 3), torch.randn(3, 16, 1)
    with guard(live=False) as g:
        for _ in range(3):
            pred = torch.vmap(lambda p, b, xb: functional_call(base, (p, b), (xb,)))(params, buffers, x)
            loss = F.mse_loss(pred, y)
            opt.zero_grad(); loss.backward(); opt.step()
    f = only(g, "loss-disconnected")[0]
    assert f.step == 0 and "stack_module_state" in f.message and f.details["stacked_copies"]
    assert "params.values()" in f.hint


def _image_steps(image_as_param: bool, rebind: bool, steps: int = 12, glob: bool = False):
    """Input optimisation through a frozen network (DeepDream/style transfer): the image is the only thing the
    optimizer holds. With `rebind`, each octave (every 4 steps) makes a new image tensor the optimizer never sees."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 8), nn.Tanh()).requires_grad_(False)
    make = (lambda t: nn.Parameter(t)) if image_as_param else (lambda t: t.requires_grad_(True))
    img = make(torch.rand(1, 16))
    opt = torch.optim.Adam([img], lr=0.02)
    with guard(None if glob else net, opt, live=False) as g:
        for i in range(steps):
            if rebind and i and i % 4 == 0:
                img = make(img.detach() * 1.0)
            loss = -net(img).norm()
            opt.zero_grad()
            loss.backward()
            opt.step()
    return g


@pytest.mark.parametrize("image_as_param", [False, True])
def test_an_optimised_image_rebound_to_a_new_tensor_is_a_disconnected_loss(image_as_param):
    assert _image_steps(image_as_param, rebind=False).findings == []
    g = _image_steps(image_as_param, rebind=True)
    [f] = only(g, "loss-disconnected")
    assert f.step == 4
    if not image_as_param:  # a plain tensor: named as the optimised input re-bound, with the in-place fix
        assert f.details["rebound_input"] is True and "re-bound" in f.message and "clamp_" in f.hint


@pytest.mark.parametrize("glob", [False, True])
def test_a_soft_prompt_left_out_of_an_optimizer_over_the_frozen_model_is_a_disconnected_loss(glob):
    """The optimizer holds only the frozen backbone's weights; the prompt (a plain tensor, or an nn.Parameter
    under a global guard) gets the gradients and nothing updates it."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2)).requires_grad_(False)
    prompt = nn.Parameter(torch.zeros(8)) if glob else torch.zeros(8, requires_grad=True)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    x, y = torch.randn(32, 8), torch.randint(0, 2, (32,))
    with guard(None if glob else model, opt, live=False) as g:
        for _ in range(6):
            loss = F.cross_entropy(model(x + prompt), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
    [f] = only(g, "loss-disconnected")
    assert f.step <= 1 and f.severity == "error"


def test_a_placeholder_zero_loss_for_a_batch_with_nothing_to_learn_is_not_disconnected():
    """Batch-hard triplet mining: a batch without a valid triplet returns torch.tensor(0.0, requires_grad=True), on
    purpose (that step trains nothing). A loss re-wrapped with its value (torch.tensor(loss.item(), ...)) is the bug."""
    for placeholder in (True, False):
        torch.manual_seed(0)
        model = nn.Linear(8, 4)
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        with guard(model, opt, live=False) as g:
            for step in range(8):
                emb = model(torch.randn(16, 8))
                if step in (3, 5):
                    loss = (torch.tensor(0.0, requires_grad=True) if placeholder
                            else torch.tensor(emb.pow(2).mean().item(), requires_grad=True))
                else:
                    loss = emb.pow(2).mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
        assert kinds(g) == ([] if placeholder else ["loss-disconnected"]), g.findings


@pytest.mark.parametrize("as_param", [False, True])
@pytest.mark.parametrize("cleared", [False, True])
def test_an_input_optimised_by_hand_whose_grad_is_never_cleared(as_param, cleared):
    """Gradient ascent on a perturbation written by hand (DeepDream, a universal perturbation), no optimizer: without
    `delta.grad = None` each update follows the sum of every gradient so far."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8)).requires_grad_(False)
    x = torch.rand(4, 16)
    delta = nn.Parameter(torch.zeros(1, 16)) if as_param else torch.zeros(1, 16, requires_grad=True)
    with guard(live=False) as g:
        for _ in range(8):
            loss = net(x + delta).pow(2).mean()
            loss.backward()
            with torch.no_grad():
                delta += 0.01 * delta.grad / (delta.grad.norm() + 1e-8)
                if cleared:
                    delta.grad = None
    if cleared:
        assert g.findings == []
    else:
        [f] = only(g, "missing-zero-grad")
        assert f.where == "delta" and f.details["input"] is True and "delta.grad = None" in f.hint


@pytest.mark.parametrize("head", ["cosface", "frozen-features", "linear"])
def test_init_loss_high_is_by_design_for_a_margin_softmax_head(head):
    """CosFace: logits s * (cos - m) over L2-normalised features and class weights start far above log(C) by
    design (s = 30), also when the features come from a frozen encoder run under no_grad (only the class weights'
    normalisation is in the graph); a plain Linear head scaled up 30x is the badly scaled last layer."""
    torch.manual_seed(0)
    emb = nn.Linear(16, 8)
    w = nn.Parameter(torch.randn(10, 8) * 0.01)
    opt = torch.optim.SGD([*emb.parameters(), w], lr=0.1)
    with guard(emb, opt, live=False, checks=["init-loss-high"]) as g:
        for _ in range(3):
            x, y = torch.randn(32, 16), torch.randint(0, 10, (32,))
            if head == "cosface":
                cos = F.linear(F.normalize(emb(x)), F.normalize(w))
                logits = 30.0 * (cos - 0.35 * F.one_hot(y, 10))
            elif head == "frozen-features":
                with torch.no_grad():
                    f = F.normalize(emb(x))
                logits = 30.0 * (F.linear(f, F.normalize(w)) - 0.35 * F.one_hot(y, 10))
            else:
                logits = 30.0 * F.linear(emb(x), w * 100)
            loss = F.cross_entropy(logits, y)
            opt.zero_grad()
            loss.backward()
            opt.step()
    assert kinds(g) == (["init-loss-high"] if head == "linear" else []), g.findings
