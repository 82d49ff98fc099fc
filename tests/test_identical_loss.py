"""loss-constant for a loss whose value stays bit-identical while the gradients are not zero.

DPO with the reference model being the policy object itself (no deepcopy): the log-ratios cancel, the loss is
log 2 at every step, and the objective has lost its anchor. A reference deep-copied, a converged L-BFGS fit and a
loss sitting on a round value stay silent."""
import copy

import pytest

import torch
import torch.nn.functional as F
from torch import nn

from guard import guard


def dpo(copy_reference, steps=12):
    torch.manual_seed(0)
    policy = nn.Sequential(nn.Embedding(20, 16), nn.Linear(16, 20))
    reference = copy.deepcopy(policy) if copy_reference else policy  # the bug: ref = policy
    opt = torch.optim.AdamW(policy.parameters(), lr=1e-2)

    def logp(model, ids):
        return torch.log_softmax(model(ids[:, :-1]), -1).gather(-1, ids[:, 1:, None]).squeeze(-1).sum(-1)

    with guard(policy, opt, live=False) as g:
        for _ in range(steps):
            chosen, rejected = torch.randint(0, 20, (4, 6)), torch.randint(0, 20, (4, 6))
            with torch.no_grad():
                ref_c, ref_r = logp(reference, chosen), logp(reference, rejected)
            margin = (logp(policy, chosen) - ref_c) - (logp(policy, rejected) - ref_r)
            loss = -F.logsigmoid(0.1 * margin).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    return g


def test_dpo_with_the_policy_as_its_own_reference_is_a_constant_loss():
    g = dpo(copy_reference=False)
    [f] = g.findings
    assert (f.kind, f.severity, f.where, f.step) == ("loss-constant", "error", "loss", 0)
    assert "exactly 0.6931471" in f.message and "log 2" in f.message and "8 steps" in f.message
    assert "copy.deepcopy(policy)" in f.hint and f.details["why"] == "identical loss value"


def test_dpo_with_a_deep_copied_reference_is_silent():
    g = dpo(copy_reference=True)
    assert g.findings == [] and g.internal_errors == []


def test_a_converged_lbfgs_fit_is_silent():
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    x = torch.randn(32, 3)
    y = x @ torch.tensor([[1.0], [-2.0], [0.5]]) + 0.1 * torch.randn(32, 1)
    opt = torch.optim.LBFGS(model.parameters(), lr=1.0, max_iter=20)
    with guard(model, opt, live=False) as g:
        for _ in range(15):
            def closure():
                opt.zero_grad()
                loss = F.mse_loss(model(x), y)
                loss.backward()
                return loss
            opt.step(closure)
    assert g.findings == []


def test_a_loss_sitting_on_a_round_value_is_not_this_finding():
    """A value that a bf16 or fp16 loss can take exactly (1.0 here, with gradients) is one any precision repeats."""
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with guard(model, opt, live=False) as g:
        for _ in range(12):
            out = model(torch.randn(8, 4))
            loss = 1.0 + (out - out.detach()).mean()  # exactly 1.0, with a gradient
            opt.zero_grad()
            loss.backward()
            opt.step()
    assert g.findings == []
    assert g.timeline[-1]["loss"] == 1.0 and g.timeline[-1]["grad_norm"] > 0


def test_a_converged_full_batch_adam_fit_is_silent():
    """A full-batch Poisson GLM under Adam: converged, its float32 loss stops changing in the last bit while Adam's
    tiny oscillating steps leave gradients at about 1e-4 of the first ones (above the absolute floor). Converged,
    not constant."""
    torch.manual_seed(0)
    x = torch.randn(800, 3)
    y = torch.poisson((x @ torch.tensor([1.0, -0.5, 0.3])).exp())
    model = nn.Linear(3, 1)
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    with guard(model, opt, live=False) as g:
        for _ in range(400):
            loss = F.poisson_nll_loss(model(x).squeeze(-1), y)
            opt.zero_grad(); loss.backward(); opt.step()
    assert g.findings == []  # (before the relative floor: loss-constant at step 165, gradient norm ~2e-4)


def _regress(target, module_loss=False, steps=6):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x, y = torch.randn(32, 8), torch.randn(32, 1)
    crit = nn.SmoothL1Loss()
    with guard(model, opt, live=False) as g:
        for _ in range(steps):
            opt.zero_grad()
            pred = model(x)
            (crit if module_loss else F.mse_loss)(pred, target(pred, y)).backward()
            opt.step()
    return g


def test_a_distance_between_the_prediction_and_itself_is_a_constant_loss():
    """`mse_loss(pred, pred)` (the target argument mistyped) or `pred.detach()` as the target: identically 0, every
    gradient 0. Told at the loss line, at step 0, with the pass-the-target fix; grads-all-zero names it as its cause."""
    g = _regress(lambda pred, y: pred)
    f = next(f for f in g.findings if f.kind == "loss-constant")
    assert (f.severity, f.where, f.step) == ("error", "loss", 0)
    assert "mse_loss(input, target) was given the same tensor" in f.message and "F.mse_loss(pred, y)" in f.hint
    assert f.source.startswith("tests/test_identical_loss.py:")
    g = _regress(lambda pred, y: pred.detach(), module_loss=True)
    f = next(f for f in g.findings if f.kind == "loss-constant")
    assert f.details["loss"] == "smooth_l1_loss" and "a view of the same data" in f.message
    # it may be one term of a sum whose other terms train (a feature-distillation hint against the student's own
    # features beside the cross-entropy): no "the model cannot learn"
    assert "this loss (or this term of a sum) teaches the model nothing" in f.message and "cannot learn" not in f.message
    assert "teacher_feat.detach()" in f.hint
    # the real target, a detached copy of another output, a shifted prediction: silent
    for target in (lambda pred, y: y, lambda pred, y: (pred * 0.9).detach(), lambda pred, y: pred.detach()[1:].repeat(2, 1)[:32]):
        assert _regress(target).findings == []


def _fedprox(reference):
    torch.manual_seed(0)
    server = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))
    x, y = torch.randn(32, 6), torch.randint(0, 3, (32,))
    with guard(live=False) as g:
        for _ in range(2):
            model = copy.deepcopy(server)
            ref = reference(model, server)
            opt = torch.optim.SGD(model.parameters(), lr=0.05)
            for _ in range(3):
                opt.zero_grad()
                prox = sum(F.mse_loss(w, r, reduction="sum") for w, r in zip(model.parameters(), ref))
                (F.cross_entropy(model(x), y) + 0.5 * prox).backward()
                opt.step()
            server.load_state_dict(model.state_dict())
    return g


def test_a_reference_that_aliases_the_parameters_is_told_as_a_term_that_does_nothing():
    """FedProx with the anchor taken from the local copy (`list(model.parameters())`): the proximal term compares each
    parameter with itself. Only that term is 0 (cross-entropy still trains): not "the model cannot learn", and the fix
    is a detached clone of the server's weights."""
    g = _fedprox(lambda model, server: list(model.parameters()))
    [f] = [f for f in g.findings if f.kind == "loss-constant"]
    assert (f.severity, f.where, f.step) == ("error", "loss", 0) and f.details["anchor"] is True
    assert "compared with itself, so this term is identically 0" in f.message and "cannot learn" not in f.message
    assert "p.detach().clone() for p in global_model.parameters()" in f.hint
    assert not [f for f in g.findings if f.severity != "info" and f.kind != "loss-constant"], g.findings
    # the anchor as a detached clone of the server's weights: silent
    g = _fedprox(lambda model, server: [p.detach().clone() for p in server.parameters()])
    assert [f for f in g.findings if f.severity != "info"] == []


def test_a_loss_frozen_by_gradients_piling_up_is_told_as_the_missing_zero_grad_only():
    """No zero_grad(): the piled-up gradients drive a rate parameter's log to -inf, the loss freezes at a value while
    the (stale) gradient norm stays large. The cause is the missing zero_grad(), told once; no loss-constant hint
    about a reference model that is the policy."""
    torch.manual_seed(0)
    u0 = torch.sin(torch.pi * torch.linspace(0, 1, 16))

    def heat(u, kappa):
        for _ in range(20):
            lap = torch.zeros_like(u)
            lap[1:-1] = (u[2:] - 2 * u[1:-1] + u[:-2]) * 16 ** 2
            u = u + 2e-4 * kappa * lap
        return u

    with torch.no_grad():
        target = heat(u0, torch.tensor(0.7))

    class Phys(nn.Module):
        def __init__(self):
            super().__init__()
            self.log_kappa = nn.Parameter(torch.tensor(0.0))

        def forward(self, u):
            return heat(u, self.log_kappa.exp())

    model = Phys()
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.5)
    with guard(model, opt, live=False) as g:
        for _ in range(40):
            loss = ((model(u0) - target) ** 2).mean() * 1e4
            loss.backward()  # the bug: no opt.zero_grad()
            opt.step()
    assert [f.kind for f in g.findings] == ["missing-zero-grad"], g.findings


def test_two_empty_selections_are_no_tensor_compared_with_itself():
    """Per-arm losses on boolean-indexed subsets: a batch with no treated unit gives two empty tensors, which share a
    data pointer. That is a mean over nothing (NaN, nonfinite's), not a loss that compares a tensor with itself."""
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with guard(model, opt, live=False) as g:
        for t in (torch.tensor([True, False, True, False]), torch.zeros(4, dtype=torch.bool)):
            out, y = model(torch.randn(4, 4)).squeeze(1), torch.randn(4)
            loss = F.mse_loss(out[t], y[t]) if t.any() else F.mse_loss(out[t], out[t].detach()) * 0 + out.sum() * 0
            opt.zero_grad()
            loss.backward()
            opt.step()
    assert not [f for f in g.findings if f.kind == "loss-constant"], g.findings


class _Spike(torch.autograd.Function):
    """A spike (v > 0) with a fast-sigmoid surrogate gradient."""

    @staticmethod
    def forward(ctx, v):
        ctx.save_for_backward(v)
        return (v > 0).float()

    @staticmethod
    def backward(ctx, grad):
        (v,) = ctx.saved_tensors
        return grad / (1 + 2 * v.abs()) ** 2


class _SNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(12, 32), nn.Linear(32, 4)

    def forward(self, x):
        m1, m2, cnt = torch.zeros(len(x), 32), torch.zeros(len(x), 4), 0
        for _ in range(6):
            m1 = 0.9 * m1 + self.fc1((torch.rand_like(x) < x).float())
            s1 = _Spike.apply(m1 - 1)
            m1 = m1 - s1.detach()
            m2 = 0.9 * m2 + self.fc2(s1)
            s2 = _Spike.apply(m2 - 1)
            m2 = m2 - s2.detach()
            cnt = cnt + s2
        return cnt


def _snn(steps, out_scale, bias, lr):
    """A spiking classifier on spike counts whose output neurons start silent (all-zero counts: the loss is exactly
    log 4 whatever the batch); the surrogate gradient raises their potentials until they fire."""
    torch.manual_seed(0)
    model = _SNN()
    with torch.no_grad():
        model.fc2.weight.mul_(out_scale)
        model.fc2.bias.fill_(bias)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    x_all = torch.rand(256, 12)
    y_all = x_all[:, :4].argmax(1)
    losses = []
    with guard(model, opt, live=False) as g:
        for step in range(steps):
            idx = torch.randint(0, 256, (32,))
            loss = F.cross_entropy(model(x_all[idx]), y_all[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
    return g, losses


def test_spiking_outputs_silent_at_first_are_no_constant_loss():
    """The loss is exactly log 4 for the first steps (no output spike, whatever the batch) while the surrogate
    gradient trains; it was an error "its value does not follow what the model learns" with the DPO hint. The
    outputs stood still with it, so it is a plateau of a piecewise-constant forward, and training leaves it."""
    g, losses = _snn(60, 0.1, -0.5, 1e-2)
    assert losses[:8] == [losses[0]] * 8 and losses[-1] < losses[0]  # the precondition: a plateau, then learning
    assert g.findings == [], g.findings


def test_output_neurons_that_never_fire_are_a_plateau_told_at_the_end_of_its_patience():
    g, losses = _snn(110, 0.0, -3.0, 1e-3)
    assert len(set(losses)) == 1  # never a spike out
    [f] = [f for f in g.findings if f.kind == "loss-constant"]
    assert (f.severity, f.where, f.step) == ("error", "loss", 0)
    assert "and so have the model's outputs" in f.message and "threshold" in f.hint
    assert f.details["why"] == "identical loss and outputs" and f.details["steps"] == 100


class _BinaryNet(nn.Module):
    """BinaryConnect: sign weights and activations with a straight-through estimator, BatchNorm without affine."""

    def __init__(self):
        super().__init__()
        self.w1, self.w2 = nn.Parameter(torch.randn(16, 10) * 0.3), nn.Parameter(torch.randn(3, 16) * 0.3)
        self.bn = nn.BatchNorm1d(16, affine=False)

    @staticmethod
    def sign(w):
        return w + (torch.where(w >= 0, 1.0, -1.0) - w).detach()

    def forward(self, x):
        return self.sign(self.bn(x @ self.sign(self.w1).t())) @ self.sign(self.w2).t() / 4


def test_a_full_batch_binary_network_on_a_plateau_is_no_constant_loss():
    """Trained full-batch, the forward changes only when a latent weight crosses 0: the loss repeats exactly for a
    while, then moves on."""
    torch.manual_seed(0)
    model = _BinaryNet()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    x = torch.randn(128, 10)
    y = x[:, :3].argmax(1)
    losses = []
    with guard(model, opt, live=False) as g:
        for _ in range(60):
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            with torch.no_grad():
                model.w1.clamp_(-1, 1)
                model.w2.clamp_(-1, 1)
            losses.append(loss.item())
    runs = [1]
    for a, b in zip(losses, losses[1:]):
        runs.append(runs[-1] + 1 if a == b else 1)
    assert max(runs) >= 8 and losses[-1] < losses[0]  # the precondition: a plateau of 8 steps or more, then learning
    assert not [f for f in g.findings if f.kind == "loss-constant"], g.findings


@pytest.mark.parametrize("cloned", [False, True])
def test_an_ewc_penalty_written_by_hand_against_an_anchor_aliasing_the_parameters_is_told(cloned):
    """`anchor = {n: p for n, p in model.named_parameters()}` (no .detach().clone()) makes a hand-written EWC
    penalty `(F * (p - anchor[n]) ** 2).sum()` identically 0: silent until stop 41 (only F.mse_loss(p, anchor) was
    seen)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    fisher = {n: torch.rand_like(p) for n, p in model.named_parameters()}
    anchor = {n: (p.detach().clone() if cloned else p) for n, p in model.named_parameters()}
    with guard(model, opt, live=False) as g:
        for _ in range(5):
            x, y = torch.randn(32, 20), torch.randint(4, (32,))
            pen = sum((fisher[n] * (p - anchor[n]) ** 2).sum() for n, p in model.named_parameters())
            loss = F.cross_entropy(model(x), y) + pen
            opt.zero_grad()
            loss.backward()
            opt.step()
    if cloned:
        assert g.findings == []
    else:
        [f] = g.findings
        assert f.kind == "loss-constant" and f.details["anchor"] is True and f.step == 0
        assert "p.detach().clone()" in f.hint


def test_a_loss_frozen_by_a_learning_rate_schedule_run_to_zero_is_told_once_as_lr_zero():
    """A LambdaLR that reaches 0 at step 50 of 200 (a resumed run outliving its schedule): params-not-updating names
    lr=0; the identical loss from then on was a second ERROR with a `step()` re-binding hint until stop 41."""
    torch.manual_seed(0)
    x = torch.randn(64, 8)
    y = x.sum(1, keepdim=True)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.02)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: max(0.0, 1 - k / 50))
    with guard(model, opt, live=False) as g:
        for _ in range(200):
            loss = F.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
    assert [(f.kind, f.step) for f in g.findings] == [("params-not-updating", 50)]


def test_a_distance_between_two_copies_of_one_selection_is_a_tensor_compared_with_itself():
    """`F.l1_loss(po[mask], po[mask])` (a typo for the offsets' target): two indexing results with equal data in
    different storage, identically 0; silent until stop 41."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 2, 1))
    opt = torch.optim.Adam(net.parameters(), 1e-3)
    with guard(net, opt, live=False) as g:
        for _ in range(3):
            x = torch.randn(4, 1, 8, 8)
            mask = torch.rand(4, 8, 8) > 0.9
            po = net(x).permute(0, 2, 3, 1)
            loss = F.l1_loss(po[mask], po[mask])
            opt.zero_grad()
            loss.backward()
            opt.step()
    [f] = g.findings
    assert f.kind == "loss-constant" and f.step == 0 and "the same selection of one tensor twice" in f.message
    assert "indexed alike on both sides" in f.message  # (it quoted `po[mask]` whatever the code said until stop 43)


@pytest.mark.parametrize("cloned", [False, True])
def test_an_ewc_anchor_taken_after_a_first_task_of_100_steps_is_told_within_the_second_task(cloned):
    """EWC's anchor is taken after the first task: with tasks of 100 steps the aliased penalty first exists at step
    100, past the steps 0-64 the graph was looked at until stop 43 (silent). Powers of two are looked at all run
    long: step 128 is in the second task."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 3))
    fisher = anchor = None
    with guard(model, live=False) as g:
        for _ in range(2):
            opt = torch.optim.SGD(model.parameters(), lr=0.05)
            for _ in range(100):
                x, y = torch.randn(32, 10), torch.randint(3, (32,))
                loss = F.cross_entropy(model(x), y)
                if fisher is not None:
                    loss = loss + 100 * sum((fisher[n] * (p - anchor[n]) ** 2).sum() for n, p in model.named_parameters())
                opt.zero_grad()
                loss.backward()
                opt.step()
            fisher = {n: torch.rand_like(p) for n, p in model.named_parameters()}
            anchor = {n: (p.detach().clone() if cloned else p) for n, p in model.named_parameters()}
    told = [f for f in g.findings if f.kind == "loss-constant"]
    if cloned:
        assert told == [], g.findings
    else:
        [f] = told
        assert f.details["anchor"] is True and f.step == 128, f
