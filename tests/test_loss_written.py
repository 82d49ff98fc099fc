"""loss-shape-broadcast in hand-written losses: found in the loss's autograd graph at backward().

``((pred - y) ** 2).mean()`` with ``pred`` [N, 1] and ``y`` [N] gives [N, N] without any warning from
PyTorch. Deliberate pairwise terms and shapes that fit must stay silent."""
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from demos import loss_shape_broadcast
from guard import guard


def mlp(out=1):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, out))


def run(loss_fn, steps=3, n=12, out=1, **options):
    """Train an MLP under a guard with `loss_fn(pred, x, y)`; the guard, the model and the unguarded twin's weights."""
    model = mlp(out)
    twin = copy.deepcopy(model)
    opts = [torch.optim.SGD(m.parameters(), lr=0.01) for m in (model, twin)]
    gen = torch.Generator().manual_seed(1)
    data = [(torch.randn(n, 8, generator=gen), torch.randn(n, generator=gen)) for _ in range(steps)]
    with guard(model, opts[0], live=False, **options) as g:
        for x, y in data:
            opts[0].zero_grad()
            loss_fn(model(x), x, y).backward()
            opts[0].step()
    for x, y in data:
        opts[1].zero_grad()
        loss_fn(twin(x), x, y).backward()
        opts[1].step()
    same = all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), twin.state_dict().values()))
    return g, same


BUGGY = {
    "squared error": lambda p, x, y: ((p - y) ** 2).mean(),
    "target first": lambda p, x, y: (y - p).abs().mean(),
    "hand-written Huber": lambda p, x, y: torch.where((p - y).abs() < 1, 0.5 * (p - y) ** 2, (p - y).abs() - 0.5).mean(),
    "1-d prediction, [N, 1] target": lambda p, x, y: ((p.squeeze(-1) - y.unsqueeze(1)) ** 2).sum(),
    "inside a sum of terms": lambda p, x, y: 0.5 * ((p - y) ** 2).mean() + 1e-3 * p.pow(2).mean(),
    "pinball (quantile) loss": lambda p, x, y: (lambda e: torch.maximum(0.9 * e, (0.9 - 1) * e))(y - p).mean(),
}


@pytest.mark.parametrize("name", list(BUGGY))
def test_prediction_minus_target_broadcast_is_reported(name):
    g, same = run(BUGGY[name])
    assert [(f.kind, f.severity, f.where, f.step) for f in g.findings] == [("loss-shape-broadcast", "error", "loss", 0)]
    f = g.findings[0]
    assert f.details["loss"] == "hand-written" and f.details["op"] == "-"
    assert f.details["broadcast_shape"] == [12, 12]
    assert "every prediction is compared with every target" in f.message and "without a warning" in f.message
    assert "squeeze(-1)" in f.hint and "view_as" in f.hint
    assert f.source and f.source.startswith("tests/test_loss_written.py:")  # the backward() line
    assert same and g.internal_errors == []


def test_message_names_the_target_shape_that_broadcasts():
    g, _ = run(BUGGY["squared error"])
    assert "prediction of shape [12, 1], and the result has shape [12, 12]: a target of shape [12]" in g.findings[0].message
    assert g.findings[0].hint == "Make the shapes equal before `-`: pred.squeeze(-1) - y, or pred - y.view_as(pred)."
    g, _ = run(BUGGY["1-d prediction, [N, 1] target"])
    assert "prediction of shape [12], and the result has shape [12, 12]: a target of shape [12, 1]" in g.findings[0].message
    assert "pred - y.squeeze(-1)" in g.findings[0].hint


def test_sample_weights_of_shape_n_1_times_per_sample_loss():
    w = torch.rand(12, 1)
    g, same = run(lambda p, x, y: (w * F.mse_loss(p.squeeze(-1), y, reduction="none")).mean())
    [f] = g.findings
    assert (f.kind, f.where, f.step) == ("loss-shape-broadcast", "loss", 0)
    assert f.details["op"] == "*" and f.details["input_shape"] == [12] and f.details["target_shape"] == [12, 1]
    assert "each sample's term meets every sample's w (a weight or a mask), not only its own" in f.message
    assert "w.view_as(x)" in f.hint and same


def test_weights_broadcast_in_a_per_image_loop_behind_a_long_classification_term_are_found():
    """A detection loss written per image (FCOS): a focal classification term and a centerness-weighted box term
    `(per * w).sum() / w.sum()` with `w` [P, 1] against `per` [P], summed over 16 images, `lr / N + lc / N`. The
    classification terms' nodes come first in the walk; the broadcast behind them was past the walk's 48 nodes."""
    torch.manual_seed(0)
    net = nn.Linear(4, 7)
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    with guard(net, opt, live=False) as g:
        for _ in range(3):
            out = net(torch.randn(16, 8, 4))
            lc = lr = 0.0
            for b in range(16):
                per = ((out[b, :, :4] - 1.0) ** 2).sum(1)
                w = torch.rand(8).unsqueeze(1)
                p = out[b, :, 4:].sigmoid()
                lc = lc + (-(1 - p) ** 2 * torch.log(1 - p + 1e-6)).sum()
                lr = lr + (per * w).sum() / w.sum()
            loss = lr / 16 + lc / 16
            opt.zero_grad()
            loss.backward()
            opt.step()
    [f] = g.findings
    assert (f.kind, f.where, f.step) == ("loss-shape-broadcast", "loss", 0)
    assert f.details["op"] == "*" and f.details["target_shape"] == [8, 1]


def test_a_dice_product_of_a_channel_kept_prediction_and_a_mask_names_the_channel_to_squeeze():
    """Binary dice with `sigmoid(logits)` [B, 1, H, W] times a mask [B, H, W]: [B, B, H, W]. The fix squeezes dim 1
    (x.squeeze(-1) would change nothing: the last dimension is W)."""
    torch.manual_seed(0)
    conv = nn.Conv2d(3, 1, 3, padding=1)
    opt = torch.optim.SGD(conv.parameters(), lr=0.1)
    x, mask = torch.randn(4, 3, 8, 8), (torch.rand(4, 8, 8) > 0.5).float()
    with guard(conv, opt, live=False) as g:
        p = torch.sigmoid(conv(x))
        loss = 1 - (2 * (p * mask).sum() + 1) / (p.sum() + mask.sum() + 1)
        opt.zero_grad()
        loss.backward()
        opt.step()
    [f] = g.findings
    assert f.kind == "loss-shape-broadcast" and "x.squeeze(1)" in f.hint and "[4, 4, 8, 8]" in f.message


def test_dqn_gathered_q_values_against_1d_targets():
    def td(q, x, y):
        chosen = q.gather(1, torch.zeros(len(q), 1, dtype=torch.long))  # [N, 1]
        target = y + 0.99 * q.detach().max(1).values  # [N]
        return (chosen - target).pow(2).mean()
    g, _ = run(td, out=3)
    assert [(f.kind, f.details["broadcast_shape"]) for f in g.findings] == [("loss-shape-broadcast", [12, 12])]


def _labels(n=12):
    """Deep SAD's semi-supervised labels as a dataset stored them: [N, 1] (0 unlabeled, -1 a known anomaly)."""
    return torch.cat([torch.zeros(n - 3), -torch.ones(3)]).unsqueeze(1)


@pytest.mark.parametrize("op", ["**", "where"])
def test_a_label_column_as_exponent_or_condition_of_a_1d_distance(op):
    """Deep SAD: distances [N] raised to labels [N, 1] (or chosen by them in torch.where) give [N, N]: every
    sample's distance meets every sample's label. Both ops were missed (only -, +, *, / were judged)."""
    s = _labels()

    def deep_sad(p, x, y):
        dist = (p.squeeze(-1) - 0.5) ** 2  # [N]
        if op == "**":
            return torch.where(s == 0, dist, (dist + 1e-6) ** s).mean()
        return torch.where(s == 0, dist, 0.0).mean() + 1e-3 * dist.mean()
    g, same = run(deep_sad)
    [f] = g.findings
    assert (f.kind, f.severity, f.where, f.step) == ("loss-shape-broadcast", "error", "loss", 0)
    assert f.details["op"] == op and f.details["input_shape"] == [12] and f.details["target_shape"] == [12, 1]
    assert f.details["broadcast_shape"] == [12, 12]
    what = "exponent" if op == "**" else "condition"
    assert f"each sample's term meets every sample's {what}" in f.message
    assert f.hint == (f"Make the shapes equal before `{'**' if op == '**' else 'torch.where'}`: "
                      f"{'e' if op == '**' else 'c'}.view_as(x) (or {'e' if op == '**' else 'c'}.squeeze(-1)) so the "
                      f"shapes are equal.")
    assert same


def test_bpr_with_a_positive_score_kept_n_1_against_a_squeezed_negative():
    """BPR: `s_pos` [N, 1] as a Linear scorer returns it, `s_neg` [N] squeezed, both with gradient: logsigmoid(s_pos -
    s_neg) is over [N, N], every positive against every negative. Missed (both operands carry gradient, and the walk
    stopped at logsigmoid)."""
    g, same = run(lambda p, x, y: -F.logsigmoid(p - p.flip(0).squeeze(-1)).mean())
    [f] = g.findings
    assert (f.kind, f.where, f.step) == ("loss-shape-broadcast", "loss", 0)
    assert f.details["op"] == "-" and f.details["both_with_gradient"] is True
    assert f.details["input_shape"] == [12] and f.details["target_shape"] == [12, 1]
    assert "both carrying gradient" in f.message and "s.squeeze(-1)" in f.hint and same


CLEAN = {
    "squeezed": lambda p, x, y: ((p.squeeze(-1) - y) ** 2).mean(),
    "view_as": lambda p, x, y: ((p - y.view_as(p)) ** 2).mean(),
    "pairwise between predictions": lambda p, x, y: torch.relu(p.view(-1, 1) - p.view(1, -1) + 0.1).mean(),
    "pairwise by unsqueeze": lambda p, x, y: torch.relu(p.squeeze(-1)[:, None] - y[None, :]).mean(),
    "per-sample weights [N]": lambda p, x, y: (torch.linspace(0, 1, 12) * (p.squeeze(-1) - y) ** 2).mean(),
    "one prediction per sample over a [N, K] target": lambda p, x, y: ((p - x[:, :3]) ** 2).mean(),
    "quantiles [N, Q] against [N, 1]": lambda p, x, y: torch.max(
        torch.tensor([0.1, 0.5, 0.9]) * (y[:, None] - p), (torch.tensor([0.1, 0.5, 0.9]) - 1) * (y[:, None] - p)).mean(),
    "full [N, N] mask times a pairwise term": lambda p, x, y: (torch.eye(12) * (p.view(-1, 1) - p.view(1, -1))).pow(2).sum(),
    "batch of one": lambda p, x, y: ((p - y) ** 2).mean(),
    "ranking against a queue of detached scores as long as the batch": lambda p, x, y: F.softplus(
        -(p - y.detach())).mean(),
    "hinge ranking against targets reshaped to [1, N]": lambda p, x, y: torch.relu(0.1 - (p - y.view(1, -1))).mean(),
    "soft histogram, bins as many as samples": lambda p, x, y: (
        torch.exp(-(p - torch.linspace(-3, 3, 12)) ** 2).sum(0) / 12 - torch.full((12,), 1 / 12)).pow(2).sum(),
    "Deep SAD with labels [N]": lambda p, x, y: (lambda d, s: torch.where(s == 0, d, (d + 1e-6) ** s).mean())(
        (p.squeeze(-1) - 0.5) ** 2, _labels().squeeze(1)),
    "a [N, N] mask choosing among pairwise distances": lambda p, x, y: torch.where(
        torch.eye(12, dtype=torch.bool), 0.0, (p.view(-1, 1) - p.view(1, -1)).abs()).mean(),
    "a row of distances chosen by a full [N, N] mask": lambda p, x, y: torch.where(
        torch.eye(12, dtype=torch.bool), (p.squeeze(-1) - y) ** 2, 0.0).sum(),
    "BPR over [N] scores": lambda p, x, y: -F.logsigmoid(p.squeeze(-1) - p.flip(0).squeeze(-1)).mean(),
    "BPR over every in-batch pair, made explicit": lambda p, x, y: -F.logsigmoid(
        p.view(-1)[:, None] - p.flip(0).view(-1)[None, :]).mean(),
    "polynomial features, exponents as a column": lambda p, x, y: (
        (p.squeeze(-1).abs() + 1) ** torch.arange(1.0, 4.0).unsqueeze(1) - y).pow(2).mean(),
}


@pytest.mark.parametrize("name", list(CLEAN))
def test_fitting_shapes_and_deliberate_pairwise_terms_stay_silent(name):
    out = 3 if "quantiles" in name else 1
    g, same = run(CLEAN[name], out=out, n=1 if name == "batch of one" else 12, checks="all")
    assert [f for f in g.findings if f.severity != "info"] == [] and g.internal_errors == []
    assert same


def test_contrastive_and_vae_style_losses_stay_silent():
    torch.manual_seed(0)
    enc = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
    opt = torch.optim.Adam(enc.parameters(), 1e-3)
    with guard(enc, opt, live=False) as g:
        for _ in range(4):
            x = torch.randn(10, 8)
            z1, z2 = F.normalize(enc(x), dim=1), F.normalize(enc(x + 0.1 * torch.randn_like(x)), dim=1)
            logits = z1 @ z2.T / 0.1
            nce = F.cross_entropy(logits, torch.arange(10))
            mu, logvar = z1[:, :4], z1[:, 4:]
            kl = -0.5 * torch.sum(1 + logvar - mu.pow(2) - logvar.exp(), dim=1).mean()
            dist = (z1.unsqueeze(1) - z2.unsqueeze(0)).pow(2).sum(-1)  # [10, 10] on purpose
            opt.zero_grad()
            (nce + 0.1 * kl + 1e-3 * dist.mean()).backward()
            opt.step()
    assert g.findings == [] and g.internal_errors == []


def test_a_term_switched_on_later_is_found_at_the_next_power_of_two_step():
    def later(p, x, y, calls=[0]):
        calls[0] += 1
        fit = ((p.squeeze(-1) - y) ** 2).mean()
        return fit + (((p - y) ** 2).mean() if calls[0] > 5 else 0)  # from step 5 on
    g, _ = run(later, steps=10)
    assert [(f.kind, f.step) for f in g.findings] == [("loss-shape-broadcast", 8)]


def test_a_probe_trained_after_the_model_is_looked_at_on_its_first_step():
    """One guard over a whole script: a probe whose hand-written loss broadcasts starts at step 11, between the
    powers of two; it is found at its first step, not at step 16."""
    base = mlp(2)
    probe = nn.Linear(16, 1)
    opt, popt = torch.optim.Adam(base.parameters(), 1e-2), torch.optim.Adam(probe.parameters(), 1e-2)
    x, y = torch.randn(32, 8), torch.randint(0, 2, (32,))
    with guard(live=False) as g:  # watches every model and optimizer, as TORCH_GUARD=1 does
        for _ in range(11):
            opt.zero_grad()
            F.cross_entropy(base(x), y).backward()
            opt.step()
        with torch.no_grad():
            h = base[:2](x)
        target = x[:, 0] * x[:, 1]
        for _ in range(8):
            popt.zero_grad()
            ((probe(h) - target) ** 2).mean().backward()  # [32, 1] - [32] -> [32, 32]
            popt.step()
    assert [(f.kind, f.step) for f in g.findings] == [("loss-shape-broadcast", 11)]


def test_written_demo_and_its_fixed_twin():
    g = loss_shape_broadcast.train(written=True, live=False)
    assert [(f.kind, f.where, f.step) for f in g.findings] == [("loss-shape-broadcast", "loss", 0)]
    assert "[64, 64]" in g.findings[0].message
    g = loss_shape_broadcast.train(written=True, fixed=True, checks="all", live=False)
    assert g.findings == [] and g.internal_errors == []


def test_check_can_be_turned_off():
    g, _ = run(BUGGY["squared error"], checks=["default", "-loss-shape-broadcast"])
    assert g.findings == []


def test_gaussian_nll_loss_written_in_python_is_counted_once_per_call():
    var = torch.ones(12, 1)
    g, _ = run(lambda p, x, y: F.gaussian_nll_loss(p, y, var), steps=10)
    [f] = g.findings
    assert f.kind == "loss-shape-broadcast" and f.details["loss"] == "gaussian_nll_loss" and f.count == 10


def test_the_source_is_the_loss_line_when_one_line_assigns_the_loss():
    torch.manual_seed(0)
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with guard(model, opt, live=False) as g:
        for _ in range(2):
            pred, y = model(torch.randn(12, 8)), torch.randn(12)
            loss = ((pred - y) ** 2).mean()  # the loss line
            opt.zero_grad()
            loss.backward()
            opt.step()
    [f] = g.findings
    lines = open(__file__).read().splitlines()
    assert "# the loss line" in lines[int(f.source.rsplit(":", 1)[1]) - 1]


@pytest.mark.parametrize("kept", [True, False])
def test_a_batch_hard_triplet_hinge_with_the_negative_kept_2d_is_reported(kept):
    """d_ap [N] minus the hardest negative's distance kept [N, 1] (max(1, keepdim=True)): both carry gradient, the
    hinge is [N, N], every anchor's positive against every anchor's negative. Reduced to [N], it is the loss."""
    torch.manual_seed(0)
    net = nn.Linear(8, 4)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    labels = torch.arange(4).repeat(4)
    with guard(net, opt, live=False) as g:
        for _ in range(3):
            e = F.normalize(net(torch.randn(16, 8)), dim=1)
            d = torch.cdist(e, e)
            same = labels[:, None] == labels[None, :]
            d_ap = (d * same).max(1).values
            d_an = (d + 10 * same).min(1, keepdim=kept).values
            loss = torch.clamp(d_ap - d_an + 0.3, min=0).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    if kept:
        [f] = g.findings
        assert (f.kind, f.where, f.step) == ("loss-shape-broadcast", "loss", 0)
        assert f.details["keepdim"] is True and f.details["broadcast_shape"] == [16, 16] and "keepdim" in f.hint
    else:
        assert g.findings == []


@pytest.mark.parametrize("kept", [True, False])
def test_a_gaussian_nll_whose_log_variance_column_is_kept_2d(kept):
    """A heteroscedastic regression written by hand: `mu, logvar = out[:, 0], out[:, 1:]` leaves logvar [N, 1]
    against the [N] residual, and `exp(-logvar) * (y - mu) ** 2` is [N, N]. Both sides carry gradient; the column
    kept 2-d by the slice is the accident. `out[:, 1]` is silent."""
    def nll(out, x, y):
        mu, logvar = out[:, 0], (out[:, 1:] if kept else out[:, 1])
        return (0.5 * torch.exp(-logvar) * (y - mu) ** 2 + 0.5 * logvar).mean()

    g, same = run(nll, out=2)
    assert same
    if not kept:
        assert g.findings == []
        return
    (f,) = g.findings
    assert (f.kind, f.where, f.step) == ("loss-shape-broadcast", "loss", 0) and f.details["column"] is True
    assert f.details["broadcast_shape"] == [12, 12] and "out[:, 1], not out[:, 1:]" in f.hint


def test_a_squeezed_prediction_against_a_4d_target_names_no_made_up_target_shape():
    """`net(img).squeeze()` is [N, H, W] against an [N, 1, H, W] depth map: the difference is [N, N, H, W]. The target
    carries no gradient, so its shape is unknown to autograd: no shape is claimed for it, and the fix reshapes the
    prediction to the target's."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 4, 3, 1, 1), nn.ReLU(), nn.Conv2d(4, 1, 3, 1, 1))
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    with guard(net, opt, live=False) as g:
        img, gt = torch.randn(4, 3, 8, 8), torch.rand(4, 1, 8, 8)
        loss = (net(img).squeeze() - gt).abs().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    (f,) = g.findings
    assert f.kind == "loss-shape-broadcast" and f.details["broadcast_shape"] == [4, 4, 8, 8]
    assert "a target of shape" not in f.message and "pred.view_as(y) - y" in f.hint


@pytest.mark.parametrize("weights", ["linear-column", "squeezed", "pairs-on-purpose"])
def test_learned_per_sample_weights_kept_as_a_column_against_a_per_sample_term(weights):
    """Robust registration with a weight net: `w = sigmoid(wnet(x))` is [N, 1] as its Linear leaves it, the residual
    [N]: `w * res` is [N, N] and both carry gradient. Squeezed weights, or pairs written on purpose, are fine."""
    torch.manual_seed(0)
    x, y = torch.randn(64, 3), torch.randn(64, 3)
    f, wnet = nn.Linear(3, 3), nn.Linear(3, 1)
    opt = torch.optim.Adam(list(f.parameters()) + list(wnet.parameters()), lr=1e-2)
    with guard(live=False) as g:
        for _ in range(4):
            res = ((f(x) - y) ** 2).sum(-1)
            w = torch.sigmoid(wnet(x))
            if weights == "squeezed":
                w = w.squeeze(-1)
            term = w.view(-1)[:, None] * res[None, :] if weights == "pairs-on-purpose" else w * res
            loss = term.mean() - 0.1 * torch.log(w).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    if weights == "linear-column":
        assert [(x.kind, x.step) for x in g.findings] == [("loss-shape-broadcast", 0)]
        d = g.findings[0].details
        assert d["op"] == "*" and d["both_with_gradient"] is True and d["broadcast_shape"] == [64, 64]
        assert "weight or scale" in g.findings[0].message and "s.squeeze(-1)" in g.findings[0].hint
    else:
        assert g.findings == []


def test_a_distributions_log_prob_of_a_value_of_another_shape_names_log_prob():
    """`-Normal(mu, sigma).log_prob(y).mean()` with mu, sigma [N, 1] from the head and y [N]: the `value - loc` that
    broadcasts to [N, N] is torch.distributions' own. The message says log_prob, not a `prediction - target` the
    user never wrote, and the fix gives the value the parameters' shape."""
    from torch.distributions import Normal

    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    with guard(model, opt, live=False) as g:
        for _ in range(3):
            x = torch.randn(16, 4)
            out = model(x)
            mu, sigma = out[:, :1], F.softplus(out[:, 1:]) + 1e-3
            loss = -Normal(mu, sigma).log_prob(x.sum(1)).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    [f] = g.findings
    assert (f.kind, f.step) == ("loss-shape-broadcast", 0) and f.details["broadcast_shape"] == [16, 16]
    assert f.message.startswith("`log_prob(y)` of a distribution") and "y.view_as(mu)" in f.hint
