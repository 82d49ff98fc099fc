"""NaN/Inf detection: each kind with the right where and step, and no alarm on healthy models."""
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from demos import nan_grad, nan_input, nan_loss, nan_module, nan_param
from guard import guard


def only(g, kind):
    found = [f for f in g.findings if f.kind == kind]
    assert found, f"no {kind} in {g.findings}"
    return found[0]


def test_dirty_input_names_the_batch_step_and_counts():
    g = nan_input.train(live=False)
    f = only(g, "nonfinite-input")
    assert f.where == "input"
    assert f.step == 150 // 16  # the batch holding sample 150
    assert f.details["counts"]["args[0]"]["nan"] == 1
    assert "nan_input.py" in f.source
    assert [x.kind for x in g.findings] == ["nonfinite-input"]  # downstream NaN is not reported again


def test_module_of_origin_not_the_modules_that_propagate():
    g = nan_module.train(live=False)
    f = only(g, "nonfinite-output")
    assert f.where == "scale" and f.step == 0
    assert f.details["module"] == "LogScale"
    # the NaN update broke the encoder's weights before the next call: counts from it would say nothing of step 0
    assert "counts_unavailable" in f.details and "output" not in f.details["counts"]
    assert "head" not in [x.where for x in g.findings]
    assert not [x for x in g.findings if x.kind in ("nonfinite-loss", "nonfinite-grad")]


def test_nan_from_a_functional_op_is_blamed_on_the_parent_forward():
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x):
            return self.b(torch.sqrt(self.a(x) - 10))  # the NaN is made between two children

    model = nn.Sequential(nn.Linear(4, 4), Block())
    with guard(model, live=False) as g:
        model(torch.randn(3, 4)).sum().backward()
    f = only(g, "nonfinite-output")
    assert f.where == "1" and f.details["module"] == "Block"


def test_nonfinite_loss_from_the_loss_code():
    g = nan_loss.train(live=False)
    f = only(g, "nonfinite-loss")
    assert f.where == "loss" and f.step >= 0
    assert "log" in f.hint
    assert not [x for x in g.findings if x.kind == "nonfinite-output"]


def _zeroth_order_after_training(blow_up_at=12):
    """Adam trains for 5 steps, then a zeroth-order phase updates the weights by hand through `.data` (MeZO's style:
    no version counter moves), forward passes only, and at iteration `blow_up_at` makes them Inf."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x, y = torch.randn(64, 4), torch.randn(64, 1)
    with guard(model, opt, live=False) as g:
        for _ in range(5):
            loss = F.mse_loss(model(x), y)
            opt.zero_grad(); loss.backward(); opt.step()
        for it in range(20):
            with torch.no_grad():
                loss = F.mse_loss(model(x), y)
                for p in model.parameters():
                    p.data.add_(torch.randn_like(p) * 1e-3 * loss)
                    if it == blow_up_at:
                        p.data.mul_(float("inf"))
    return g


def test_weights_broken_through_data_after_the_last_update_are_not_blamed_on_the_optimizer():
    f = only(_zeroth_order_after_training(), "nonfinite-param")
    assert f.step == 4 and "changed outside the optimizer" in f.message
    assert "The update itself overflowed" not in f.hint and "p.data" in f.hint
    assert f.details["changed_after_update"] == f.details["parameters"]


def test_a_gan_generator_broken_by_its_update_is_still_blamed_on_it_after_a_finite_discriminator_call():
    """The generator's update makes its weights Inf (a huge learning rate step); the next window's first model call
    is the discriminator's, finite: that is no evidence about the generator's weights."""
    torch.manual_seed(0)
    gen, disc = nn.Linear(4, 6), nn.Linear(6, 1)
    g_opt, d_opt = torch.optim.SGD(gen.parameters(), lr=0.01), torch.optim.SGD(disc.parameters(), lr=0.01)
    with guard([disc, gen], [d_opt, g_opt], live=False) as g:
        for it in range(6):
            real = torch.randn(16, 6)
            d_loss = F.softplus(-disc(real)).mean() + F.softplus(disc(gen(torch.randn(16, 4)).detach())).mean()
            d_opt.zero_grad(); d_loss.backward(); d_opt.step()
            g_loss = F.softplus(-disc(gen(torch.randn(16, 4)))).mean() * (1e6 if it == 3 else 1.0)
            g_opt.zero_grad(); g_loss.backward()
            if it == 3:
                g_opt.param_groups[0]["lr"] = 3e38  # the update overflows to inf
            g_opt.step()
            g_opt.param_groups[0]["lr"] = 0.01
    assert g.findings and not any("changed outside the optimizer" in f.message for f in g.findings)


def test_nonfinite_grad_names_the_parameter_and_step():
    g = nan_grad.train(live=False)
    f = only(g, "nonfinite-grad")
    assert f.where == "emb.weight" and f.step == 3
    assert f.details["parameters"] == ["emb.weight"]
    assert "clip_grad_norm_" in f.hint


def test_nonfinite_param_after_step_with_finite_grads():
    g = nan_param.train(live=False)
    f = only(g, "nonfinite-param")
    assert f.where == "0.weight" and f.step == 0
    assert "nonfinite-grad" not in [x.kind for x in g.findings]


def test_nonfinite_param_from_the_update_has_the_overflow_fix_and_one_changed_after_it_says_so():
    """The demo's NaN comes from the update itself (the weights are not touched after it). A SAM-style perturbation
    by hand, `p.add_(rho * g / grad_norm)` at a zero norm (0/0), makes them NaN after the update returned: the
    message says they were changed in place since, and the hint looks there first."""
    f = only(nan_param.train(live=False), "nonfinite-param")
    assert "changed in place" not in f.message and "changed_after_update" not in f.details
    assert f.hint.startswith("The update itself overflowed")

    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with guard(model, opt, live=False) as g:
        for it in range(8):
            x = torch.randn(20, 4)
            if it == 5:
                with torch.no_grad():
                    for p in model.parameters():
                        p.add_(0.05 * torch.zeros_like(p) / torch.tensor(0.0))  # rho * g / grad_norm with g = 0
            loss = F.mse_loss(model(x), x.sum(1, keepdim=True))
            opt.zero_grad(); loss.backward(); opt.step()
    f = only(g, "nonfinite-param")
    assert f.details["changed_after_update"] == ["weight", "bias"]
    assert "changed in place after that update" in f.message and "before step 5's forward" in f.message
    assert "rho / (grad_norm + 1e-12)" in f.hint


def test_nonfinite_param_from_a_nan_learning_rate_says_so():
    """A Polyak step size `loss / ||g||^2` set as the learning rate: 0/0 on a batch the model fits exactly makes the
    rate NaN, and the update NaN. Not an overflow: the message names the rate, the hint the eps."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 1), nn.ReLU())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with torch.no_grad():
        model[0].weight.fill_(0.1); model[0].bias.fill_(0.0)
    with guard(model, opt, live=False) as g:
        for i in range(6):
            x = torch.randn(20, 8) if i != 3 else torch.full((20, 8), -5.0)  # all ReLUs off: loss 0, gradient 0
            y = torch.relu(x.sum(1, keepdim=True)) if i != 3 else torch.zeros(20, 1)
            loss = F.mse_loss(model(x), y)
            opt.zero_grad(); loss.backward()
            gsq = sum(p.grad.pow(2).sum() for p in model.parameters())
            opt.param_groups[0]["lr"] = (loss / gsq).item()  # the bug: no eps
            opt.step()
    f = only(g, "nonfinite-param")
    assert f.step == 3 and "the learning rate of their optimizer is nan" in f.message
    assert "loss / (gsq + 1e-8)" in f.hint


@pytest.mark.parametrize("demo", [nan_input, nan_module, nan_loss, nan_grad, nan_param])
def test_clean_twins_have_no_findings(demo):
    g = demo.train(fixed=True, live=False, checks="all")
    assert g.findings == [], g.findings
    assert g.internal_errors == []


# ---------------------------------------------------------------- healthy models, no false alarm

class TinyTransformer(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(50, 32)
        layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.1, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2)
        self.head = nn.Linear(32, 50)

    def forward(self, tokens):
        return self.head(self.encoder(self.emb(tokens)))


class LSTMLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(40, 16)
        self.lstm = nn.LSTM(16, 32, batch_first=True)
        self.head = nn.Linear(32, 40)

    def forward(self, tokens):
        out, _ = self.lstm(self.emb(tokens))
        return self.head(out)


def _cnn():
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(inplace=True), nn.MaxPool2d(2),
        nn.Conv2d(8, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(inplace=True),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10))


CASES = {
    "mlp": (lambda: nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Dropout(0.1), nn.Linear(32, 3)),
            lambda: (torch.randn(16, 10), torch.randint(0, 3, (16,)))),
    "cnn-bn": (_cnn, lambda: (torch.randn(8, 3, 16, 16), torch.randint(0, 10, (8,)))),
    "transformer": (TinyTransformer, lambda: (torch.randint(0, 50, (4, 12)), torch.randint(0, 50, (4, 12)))),
    "lstm": (LSTMLM, lambda: (torch.randint(0, 40, (4, 10)), torch.randint(0, 40, (4, 10)))),
}


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("scope", ["model", "global"])
def test_healthy_models_have_no_findings(name, scope):
    make, batch = CASES[name]
    model = make()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    args = (model, opt) if scope == "model" else ()
    with guard(*args, live=False, checks="all") as g:
        for _ in range(4):
            x, y = batch()
            out = model(x)
            loss = nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))
            opt.zero_grad()
            loss.backward()
            opt.step()
        model.eval()
        with torch.no_grad():
            model(batch()[0])
    assert g.findings == [], g.findings
    assert g.internal_errors == []
    assert g.step == 4
    assert len(g.timeline) == 4 and all("loss" in e and "grad_norm" in e for e in g.timeline)
    assert g.modules  # the module table was filled


def test_global_guard_without_model_finds_origin_and_counts_backwards():
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1))
    with guard(live=False) as g:
        for s in range(3):
            x = torch.ones(2, 3)
            if s == 2:
                x[0, 0] = float("inf")
            model(x).mean().backward()
    f = only(g, "nonfinite-input")
    assert f.step == 2
    assert g.step == 3  # without an optimizer, backward() calls are the steps


def test_dataparallel_paths_have_no_module_prefix():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = nn.Linear(4, 4)

        def forward(self, x):
            return torch.log(self.body(x) - 50)

    dp = nn.DataParallel(Net())
    with guard(dp, live=False) as g:
        dp(torch.randn(2, 4)).sum().backward()
    f = only(g, "nonfinite-output")
    assert f.where == "Net" and not f.where.startswith("module")


def test_half_precision_sums_do_not_false_alarm():
    model = nn.Linear(64, 64).to(torch.bfloat16)
    with guard(model, live=False) as g:
        with torch.no_grad():
            model(torch.full((512, 64), 30.0, dtype=torch.bfloat16))  # outputs sum beyond bf16's exact range
    assert g.findings == []


def test_expanded_views_are_screened_by_their_distinct_values():
    class Head(nn.Module):
        def forward(self, x):
            return x[:4] * 2

    x = torch.tensor([1.0, float("nan"), 3.0]).expand(2 ** 40, 3)  # 3e12 elements, 3 distinct values
    model = Head()
    with guard(model, live=False) as g:
        model(x)
    f = only(g, "nonfinite-input")
    assert f.details["counts"]["args[0]"]["nan"] == 1 and g.internal_errors == []


def test_nan_weights_loaded_into_a_standard_layer_are_named():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    with torch.no_grad():
        model[2].weight[0, 0] = float("nan")  # a bad checkpoint: no optimizer step made it
    with guard(model, live=False) as g:
        model(torch.randn(3, 4)).sum().backward()
    f = only(g, "nonfinite-output")
    assert "2.weight" in f.details["nonfinite_params"] and "2.weight" in f.message


def test_half_precision_standard_layers_are_screened_themselves():
    class Scale(nn.Module):
        def forward(self, x):
            return x * 1000.0

    model = nn.Sequential(nn.Linear(8, 8), Scale(), nn.Linear(8, 8)).to(torch.bfloat16)
    with torch.no_grad():
        model[2].weight.fill_(3e36)  # finite bf16 weights; the product overflows inside the layer
    x = torch.ones(2, 8, dtype=torch.bfloat16)
    with guard(model, live=False) as g:
        with torch.no_grad():
            model(x)
    assert only(g, "nonfinite-output").where == "2"


def test_weights_poisoned_by_an_earlier_nan_do_not_blame_later_layers():
    class Act(nn.Module):  # a custom layer after a standard one
        def forward(self, x):
            return torch.tanh(x) * 2

    model = nn.Sequential(nn.Linear(4, 4), Act(), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with guard(model, opt, live=False) as g:
        for s in range(4):
            x = torch.randn(2, 4)
            if s == 1:
                x[0, 0] = float("nan")  # NaN grads -> NaN weights after this step
            loss = model(x).sum()
            opt.zero_grad()
            loss.backward()
            opt.step()
    assert [(f.kind, f.step) for f in g.findings] == [("nonfinite-input", 1)]


# --------------------------------------------------------------------------- -inf as a mask

class _CausalLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(20, 16)
        self.enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 2, 32, batch_first=True), 2)
        self.out = nn.Linear(16, 20)

    def forward(self, x, src_mask=None):
        return self.out(self.enc(self.emb(x), mask=src_mask, is_causal=src_mask is not None))


class _MaskedLogits(nn.Module):
    """SimCLR-style: similarities with the diagonal (a sample with itself) masked out by -inf."""

    def __init__(self, whole_row_at=None):
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.whole_row_at, self.calls = whole_row_at, 0

    def forward(self, x):
        z = nn.functional.normalize(self.proj(x), dim=1)
        mask = torch.eye(len(x), dtype=torch.bool)
        if self.calls == self.whole_row_at:
            mask[0] = True  # the bug: a row with nothing left to predict
        self.calls += 1
        return (z @ z.T / 0.5).masked_fill(mask, float("-inf"))


@pytest.fixture(params=[True, False], ids=["host-direct", "batched-read"])
def read_path(request, monkeypatch):
    from guard import tensors

    monkeypatch.setattr(tensors, "HOST_DIRECT", request.param)  # False: the path accelerators take


def test_a_causal_float_mask_passed_to_the_model_is_no_dirty_input(read_path):
    # nn.Transformer.generate_square_subsequent_mask: 0 on and below the diagonal, -inf above it.
    torch.manual_seed(0)
    model = _CausalLM()
    opt = torch.optim.Adam(model.parameters(), 1e-3)
    mask = nn.Transformer.generate_square_subsequent_mask(8)
    with guard(model, opt, checks="all", live=False) as g:
        for _ in range(3):
            x = torch.randint(0, 20, (4, 8))
            loss = nn.functional.cross_entropy(model(x, src_mask=mask).reshape(-1, 20), x.reshape(-1))
            opt.zero_grad()
            loss.backward()
            opt.step()
    assert g.findings == [] and g.internal_errors == []


def test_logits_masked_with_minus_inf_are_fine_until_a_row_is_masked_whole(read_path):
    def run(whole_row_at):
        torch.manual_seed(0)
        model = _MaskedLogits(whole_row_at)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with guard(model, opt, checks="all", live=False) as g:
            for _ in range(3):
                logits = model(torch.randn(6, 8))
                loss = nn.functional.cross_entropy(logits, torch.arange(6).roll(1))
                opt.zero_grad()
                loss.backward()
                opt.step()
        return g

    assert run(None).findings == []
    f = run(2).findings[0]  # the mask was seen healthy at steps 0 and 1: the loss is where it went wrong
    assert (f.kind, f.where, f.step) == ("nonfinite-loss", "loss", 2)
    assert "held -inf (a mask) but no NaN" in f.message and "masked whole" in f.hint
    f = run(0).findings[0]  # -inf never seen healthy: the module that made it is the origin
    assert (f.kind, f.where, f.step) == ("nonfinite-output", "_MaskedLogits", 0)
    assert f.details["counts"]["output"]["neginf"] > 0 and f.details["counts"]["output"]["nan"] == 0


class _MaskedPolicy(nn.Module):
    """An RL policy with -inf action masks (correct); the bug is in the entropy bonus the loop computes."""

    def __init__(self):
        super().__init__()
        self.l = nn.Linear(4, 5)

    def forward(self, x, mask):
        return self.l(x).masked_fill(~mask, float("-inf"))


def _entropy_run(form, start, steps=6):
    torch.manual_seed(0)
    model = _MaskedPolicy()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with guard(model, opt, live=False) as g:
        for i in range(steps):
            x, mask = torch.randn(8, 4), torch.rand(8, 5) > 0.3
            mask[:, 0] = True
            logp = nn.functional.log_softmax(model(x, mask), -1)
            loss = -logp[:, 0].mean()
            if i >= start:
                if form == "product":  # 0 * -inf: NaN loss
                    ent = -(logp.exp() * logp).sum(-1).mean()
                elif form == "where":  # finite loss, NaN gradients from the masked branch
                    ent = -torch.where(mask, logp.exp() * logp, torch.zeros(())).sum(-1).mean()
                else:  # fixed
                    ent = torch.distributions.Categorical(logits=logp).entropy().mean()
                loss = loss - 0.01 * ent
            opt.zero_grad()
            loss.backward()
            opt.step()
            if not all(torch.isfinite(p).all() for p in model.parameters()):
                break
    return g


@pytest.mark.parametrize("form", ["product", "where"])
def test_nan_made_from_a_minus_inf_mask_by_the_loops_own_arithmetic_is_explained(form, read_path):
    """-inf action masks are correct; an entropy written as sum(p * log p) over them makes NaN (0 * -inf), in the
    loss or, through torch.where, only in the gradients. The report says the module made -inf only (a mask) and
    names the arithmetic, not an overflow; once the mask was seen on healthy steps, the loss or gradients are
    reported with the same explanation."""
    f = _entropy_run(form, start=0).findings[0]
    assert (f.kind, f.where, f.step) == ("nonfinite-output", "_MaskedPolicy", 0)
    assert "produced -inf (and no NaN or +inf)" in f.message and f.details["only_neg_inf"] is True
    assert "0 * -inf" in f.hint and "Categorical(logits=...).entropy()" in f.hint and "xlogy" in f.hint
    assert "log(0)" in f.hint and "torch.log(x + 1e-6)" in f.hint  # an -inf that is no mask: a log of zero
    f = _entropy_run(form, start=3).findings[0]
    if form == "product":
        assert (f.kind, f.step) == ("nonfinite-loss", 3) and "0 * -inf" in f.hint
    else:
        assert (f.kind, f.where, f.step) == ("nonfinite-grad", "l.weight", 3)
        assert "loss was finite" in f.message and f.details["masked_outputs"] is True
        assert "torch.where(mask, f(x), 0)" in f.hint
    assert _entropy_run("fixed", start=0).findings == []


def test_plus_inf_and_nan_inputs_are_still_dirty_data(read_path):
    for bad in (float("inf"), float("nan")):
        model = nn.Sequential(nn.Linear(4, 2))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with guard(model, opt, live=False) as g:
            x = torch.randn(3, 4)
            x[1, 2] = bad
            opt.zero_grad()
            model(x).sum().backward()
            opt.step()
        assert g.findings[0].kind == "nonfinite-input", bad


class _Imputer(nn.Module):
    """A tabular model that takes NaN for "missing": it imputes 0 and adds a missing-indicator column."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 1)

    def forward(self, x, labels=None):
        missing = torch.isnan(x)
        out = self.fc(torch.cat([torch.where(missing, 0.0, x), missing.float()], dim=1))
        if labels is None:
            return out
        known = ~torch.isnan(labels)  # NaN labels: no target for that row
        return nn.functional.mse_loss(out[known], labels[known])


@pytest.mark.parametrize("where", ["features", "labels"])
def test_nan_the_model_takes_for_missing_is_no_dirty_data(where, read_path):
    torch.manual_seed(0)
    model = _Imputer()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with guard(model, opt, checks="all", live=False) as g:
        for _ in range(3):
            x, y = torch.randn(16, 4), torch.randn(16, 1)
            (x if where == "features" else y)[::3, 0] = float("nan")
            opt.zero_grad()
            model(x, labels=y).backward()
            opt.step()
    assert g.findings == [] and g.internal_errors == []


def test_nan_input_that_reaches_the_output_is_still_the_origin(read_path):
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with guard(model, opt, live=False) as g:
        x = torch.randn(8, 4)
        x[3, 1] = float("nan")
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()
    assert [(f.kind, f.where) for f in g.findings][:1] == [("nonfinite-input", "input")]


class Gated(nn.Module):
    """A gate logit that is -inf by design: softmax gives the second branch weight 0 and gradient 0."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 1), nn.Linear(4, 1)
        self.gate = nn.Parameter(torch.tensor([0.0, float("-inf")]))

    def forward(self, x):
        w = self.gate.softmax(0)
        return w[0] * self.a(x) + w[1] * self.b(x)


def _train_gated(model, opt, steps=10, blow_up_at=None):
    for step in range(steps):
        if step == blow_up_at:
            for grp in opt.param_groups:
                grp["lr"] = 3e38
        x = torch.randn(8, 4)
        loss = nn.functional.mse_loss(model(x), x.sum(1, keepdim=True))
        opt.zero_grad()
        loss.backward()
        opt.step()


@pytest.mark.parametrize("scope", ["model", "global"])
def test_a_parameter_minus_inf_by_design_is_no_nonfinite_param(scope):
    torch.manual_seed(0)
    m = Gated()
    opt = torch.optim.Adam(m.parameters(), lr=1e-2)
    with guard(m if scope == "model" else None, opt if scope == "model" else None, checks="all", live=False) as g:
        _train_gated(m, opt)
    assert torch.isinf(m.gate).any() and g.findings == [] and g.internal_errors == []


def test_a_carlini_wagner_variable_born_at_plus_inf_is_told():
    """Carlini-Wagner's change of variables, w = atanh(2x - 1), of an image with pixels at exactly 0 or 1: those
    entries of the optimised w are +-inf before the first update, tanh(inf) = 1 hides them, their gradient is 0 and
    Adam never moves them. A -inf logit can be an off switch by design (above); +inf is none: told at step 0."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(12, 3)).requires_grad_(False)
    x = torch.rand(4, 3, 2, 2)
    x[x > 0.9], x[x < 0.1] = 1.0, 0.0
    y = model(x).argmax(1)
    w = nn.Parameter(torch.atanh(2 * x - 1))
    opt = torch.optim.Adam([w], lr=0.01)
    with guard(live=False) as g:
        for _ in range(5):
            x_adv = 0.5 * (torch.tanh(w) + 1)
            logits = model(x_adv)
            loss = ((x_adv - x) ** 2).sum() - F.cross_entropy(logits, y)
            opt.zero_grad()
            loss.backward()
            opt.step()
    f = next(f for f in g.findings if f.kind == "nonfinite-param")
    assert (f.where, f.step) == ("w", 0) and f.details["before_any_update"] is True
    assert f.details["inf_counts"] == [int(torch.isinf(w).sum())] and "clamp x to [1e-6, 1 - 1e-6]" in f.hint


def test_weights_broken_by_an_update_are_told_apart_from_a_minus_inf_by_design():
    torch.manual_seed(0)
    m = Gated()
    opt = torch.optim.SGD(m.parameters(), lr=1e-2)
    with guard(m, opt, live=False) as g:
        _train_gated(m, opt, blow_up_at=9)
    [f] = g.findings
    assert (f.kind, f.step) == ("nonfinite-param", 9)
    assert "gate" not in f.details["parameters"] and set(f.details["parameters"]) <= {"a.weight", "a.bias"}


def test_the_last_update_is_checked_when_main_drops_the_model_before_guard_exits():
    """`if __name__ == "__main__": main()` under TORCH_GUARD=1: the model and optimizer are locals of main(),
    gone before the environment's guard closes; their weights are looked at as the optimizer dies."""
    def main():
        torch.manual_seed(0)
        m = nn.Linear(4, 1)
        opt = torch.optim.SGD(m.parameters(), lr=1e-2)
        _train_gated(m, opt, blow_up_at=9)
        assert not torch.isfinite(m.weight).all()

    g = guard(live=False).start()
    try:
        main()
        [f] = g.findings
        assert (f.kind, f.where, f.step) == ("nonfinite-param", "weight", 9)
    finally:
        g.close()


def test_nan_weights_loaded_into_a_trained_layer_are_named_once():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    with torch.no_grad():
        model[2].weight[0, 0] = float("nan")  # a bad checkpoint, then training starts
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with guard(model, opt, live=False) as g:
        for _ in range(3):
            opt.zero_grad()
            model(torch.randn(3, 4)).sum().backward()
            opt.step()
    assert [f.kind for f in g.findings if f.kind == "nonfinite-param"] == []
    f = only(g, "nonfinite-output")
    assert f.step == 0 and "2.weight" in f.details["nonfinite_params"]


@pytest.mark.parametrize("blown", [["a"], ["a", "head"]])
def test_an_overflow_inside_standard_layers_names_the_huge_weights(blown):
    """Standard fp32 layers are not screened one by one: weights blown up to ~1e37 say which overflowed."""
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.head = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 3)

        def forward(self, x):
            return self.head(self.b(self.a(x)))

    torch.manual_seed(0)
    m = M()
    with torch.no_grad():
        for name in blown:
            getattr(m, name).weight.fill_(1e38)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    with guard(m, opt, live=False) as g:
        loss = nn.functional.cross_entropy(m(torch.ones(2, 4)), torch.tensor([0, 1]))
        opt.zero_grad()
        loss.backward()
        opt.step()
    f = only(g, "nonfinite-output")
    assert f.step == 0 and "are huge" in f.message and "overflowed float32" in f.message and "learning rate" in f.hint
    assert sorted(f.details["huge_weights"]) == sorted(f"{n}.weight" for n in blown)
    assert f.where == (blown[0] if len(blown) == 1 else "M")


class MaskedMSE(nn.Module):
    """Targets marked NaN are missing: left out of the mean (a batch with none left divides 0 by 0)."""

    def forward(self, pred, target):
        keep = ~torch.isnan(target)
        return ((pred - torch.nan_to_num(target)) ** 2 * keep).sum() / keep.sum()


def test_a_tables_nan_input_names_its_feature_columns():
    """A tabular batch whose column 2 is NaN (a constant feature z-scored by a zero std): the finding names the
    columns when the batch is still alive at the step's read, and the hint names the normalisation as a cause."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(32, 5)
    x[:, 2] = (x[:, 2] * 0 - 0) / torch.tensor(0.0)  # 0 / 0: the z-score of a constant column
    with guard(model, opt, live=False) as g:
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()
    f = next(f for f in g.findings if f.kind == "nonfinite-input")
    assert f.details["columns"] == {"args[0]": [2]} and "(args[0]), in columns [2] of args[0]" in f.message
    assert "zero std" in f.hint


@pytest.mark.parametrize("form", ["log(sigmoid)", "logsigmoid", "log(1 - sigmoid)"])
def test_a_log_of_a_sigmoid_that_underflows_gets_the_logsigmoid_fix(form):
    """A negative-sampling loss written `-torch.log(torch.sigmoid(-s))`: a confident negative's sigmoid underflows to 0
    and the log is -inf. Told as the log of a sigmoid with F.logsigmoid as the fix; F.logsigmoid itself is fine."""
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    with torch.no_grad():
        model.weight.fill_(40.0)
    opt = torch.optim.SGD(model.parameters(), lr=1e-6)
    with guard(model, opt, live=False) as g:
        for _ in range(2):
            s = model(torch.ones(8, 4)).squeeze(1)
            loss = -(torch.log(torch.sigmoid(-s)) if form == "log(sigmoid)" else
                     torch.log(1 - torch.sigmoid(s)) if form == "log(1 - sigmoid)" else F.logsigmoid(-s)).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    if form == "logsigmoid":
        assert g.findings == []
        return
    f = next(f for f in g.findings if f.kind == "nonfinite-loss")
    if form == "log(1 - sigmoid)":  # an L0 gate's penalty, a hand-written BCE's negative term
        assert f.details["log_of"] == "1 - sigmoid" and "F.logsigmoid(-x)" in f.hint and f.step == 0
        return
    assert f.details["log_of"] == "sigmoid" and "F.logsigmoid(x)" in f.hint and f.step == 0


def test_a_focal_loss_taking_the_log_of_a_gathered_softmax_gets_the_log_softmax_fix():
    """The usual hand-written focal loss, p = F.softmax(logits, 1).gather(1, y[:, None]).squeeze(1), then log(p): on a
    confidently wrong sample p underflows to 0. The gather and squeeze between the log and the softmax hid the
    softmax, so the hint was the generic one for a log (a positive parameterisation, an epsilon)."""
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    with torch.no_grad():
        model.weight.mul_(100.0)
    opt = torch.optim.SGD(model.parameters(), lr=1e-6)
    with guard(model, opt, live=False) as g:
        for _ in range(2):
            logits = model(torch.randn(32, 4) * 10)
            y = logits.argmin(1)  # the least likely class: p underflows
            p = F.softmax(logits, dim=1).gather(1, y[:, None]).squeeze(1)
            loss = (-(1 - p) ** 2 * torch.log(p)).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    f = next(f for f in g.findings if f.kind == "nonfinite-loss")
    assert f.details["log_of"] == "softmax" and "F.log_softmax(x, dim)" in f.hint and f.step == 0


def test_a_mixture_likelihood_in_linear_space_that_underflows_gets_the_logsumexp_fix():
    """A mixture density network's -log(sum(pi * N(y))) with narrow components far from y: every density underflows
    to 0 and the log is -inf. Told as the log of a sum of exponentials, with torch.logsumexp as the fix."""
    torch.manual_seed(0)
    head = nn.Linear(3, 6)
    opt = torch.optim.SGD(head.parameters(), lr=1e-6)
    with guard(head, opt, live=False) as g:
        out = head(torch.randn(16, 3))
        pi, mu = out[:, :3].softmax(-1), out[:, 3:]
        dens = torch.exp(-0.5 * ((50.0 - mu) / 0.1) ** 2)  # y = 50, sigma = 0.1: exp(-125000) = 0
        loss = -torch.log((pi * dens).sum(-1)).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    f = next(f for f in g.findings if f.kind == "nonfinite-loss")
    assert f.details["log_of"].startswith("sum of exponentials") and "torch.logsumexp" in f.hint


def test_a_cox_partial_likelihood_through_log_cumsum_exp_gets_the_logcumsumexp_fix():
    """A Cox model's risk sets written as `log(cumsum(exp(eta)))` (samples sorted by descending time): exp overflows
    for a risk score above 88. It was told as a log outside its domain with an epsilon fix (stop 45: the cumulative
    sum of exponentials, with torch.logcumsumexp)."""
    torch.manual_seed(0)
    model = nn.Linear(5, 1)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x, event = torch.randn(32, 5) * 40, (torch.rand(32) < 0.7).float()
    with guard(model, opt, live=False) as g:
        eta = model(x).squeeze(-1) * 10
        risk = torch.log(torch.cumsum(torch.exp(eta), 0))
        loss = -((eta - risk) * event).sum() / event.sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
    f = next(f for f in g.findings if f.kind == "nonfinite-loss")
    assert f.details["log_of"].startswith("cumulative sum of exponentials") and "torch.logcumsumexp" in f.hint


class _RowSoftmax(nn.Module):
    def forward(self, s):
        return s.softmax(-1)


class _DropsMaskedRow(nn.Module):
    """Row 0 of the scores masked whole with -inf, softmaxed (NaN there), then dropped: the loss is finite."""

    def __init__(self, keep_finite):
        super().__init__()
        self.lin, self.attn, self.keep_finite = nn.Linear(4, 4), _RowSoftmax(), keep_finite

    def forward(self, x):
        mask = torch.zeros(x.size(0), 4)
        mask[0] = float("-inf") if not self.keep_finite else torch.tensor([0.0, *[float("-inf")] * 3])
        return self.attn(self.lin(x) + mask)[1:]


@pytest.mark.parametrize("keep_finite", [False, True])
def test_nan_from_a_row_masked_whole_and_dropped_later_is_told_at_the_softmax(keep_finite):
    """The NaN row is discarded after the softmax, so the output and the loss are finite, but its backward makes NaN
    gradients (0 * NaN). The origin is the call that made NaN from a -inf mask, not "a finite forward" at the first
    parameter. A row with one entry left unmasked is fine."""
    torch.manual_seed(0)
    model = _DropsMaskedRow(keep_finite)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with guard(model, opt, live=False) as g:
        for _ in range(3):
            opt.zero_grad()
            model(torch.randn(8, 4)).pow(2).mean().backward()
            opt.step()
    if keep_finite:
        assert g.findings == []
        return
    f = next(f for f in g.findings if f.severity == "error")
    assert (f.kind, f.where, f.step) == ("nonfinite-output", "attn", 0)
    assert "only -inf (args[0]: a mask)" in f.message and "0 * NaN" in f.hint


def test_nan_a_loss_module_takes_on_purpose_is_not_blamed_when_its_batch_is_masked_whole():
    torch.manual_seed(0)
    model, crit = nn.Linear(4, 1), MaskedMSE()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with guard(live=False) as g:  # the global guard: the loss module is a model call of its own
        for step in range(5):
            y = torch.randn(8, 1)
            y[:2] = float("nan")  # some targets missing at every step
            if step == 3:
                y[:] = float("nan")  # ... and all of them once
            loss = crit(model(torch.randn(8, 4)), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            if step == 3:
                break
    [f] = [f for f in g.findings if f.kind.startswith("nonfinite")]
    assert (f.kind, f.where, f.step) == ("nonfinite-output", "MaskedMSE", 3)
    assert "takes on purpose (args[1]" in f.message


def test_a_loss_over_an_empty_selection_is_told_it_is_a_mean_over_zero_elements():
    """FixMatch-style: cross_entropy over the rows passing a confidence mask, and no row passes."""
    import torch.nn.functional as F

    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with guard(model, opt, live=False) as g:
        for _ in range(2):
            logits = model(torch.randn(8, 4))
            mask = logits.softmax(1).amax(1) > 0.99
            loss = F.cross_entropy(logits[mask], logits.argmax(1)[mask])
            opt.zero_grad()
            loss.backward()
            opt.step()
    f = only(g, "nonfinite-loss")
    assert f.step == 0 and "mask.any()" in f.hint and "zero elements" in f.hint


class _Pointer(nn.Module):
    """A pointer layer: candidates masked whole on some rows give NaN rows (softmax over all -inf)."""

    def __init__(self):
        super().__init__()
        self.q = nn.Linear(4, 4)

    def forward(self, x, valid):
        scores = self.q(x) @ x.transpose(0, 1)
        return scores.masked_fill(~valid, float("-inf")).softmax(-1)


def _pointer_batch(step):
    x = torch.randn(6, 4)
    valid = torch.rand(6, 6) > 0.3
    valid[step % 6] = False  # one row has no candidate: a NaN row
    return x, valid


@pytest.mark.parametrize("scope", ["model", "global"])
def test_nan_rows_of_the_output_handled_before_the_loss_are_no_finding(scope):
    torch.manual_seed(0)
    model = _Pointer()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with guard(*((model, opt) if scope == "model" else ()), live=False) as g:
        for step in range(6):
            x, valid = _pointer_batch(step)
            p = torch.nan_to_num(model(x, valid), nan=0.0)
            loss = -(p.diagonal() + 1e-6).log().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    assert g.findings == [] and g.internal_errors == []


def test_an_output_handled_before_is_still_the_origin_when_its_nan_reaches_the_loss():
    torch.manual_seed(0)
    model = _Pointer()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with guard(model, opt, live=False) as g:
        for step in range(4):
            x, valid = _pointer_batch(step)
            p = model(x, valid)
            if step < 3:
                p = torch.nan_to_num(p, nan=0.0)  # ... and at step 3 the NaN rows go on to the loss
            loss = -(p.diagonal() + 1e-6).log().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    f = only(g, "nonfinite-output")
    assert (f.where, f.step) == ("_Pointer", 3)
    assert "made NaN/Inf on earlier steps too, which were handled after it" in f.message


def test_minus_inf_seen_in_an_evaluation_is_not_learnt_as_a_mask():
    """log(softmax(z)) underflows to -inf on a wide evaluation batch (no loss): a later training step whose
    -inf makes the loss NaN names the model's output, not "-inf masks" and NaN gradients."""
    class LogSoftmaxByHand(nn.Module):
        def __init__(self):
            super().__init__()
            self.f = nn.Linear(10, 5)

        def forward(self, x):
            return torch.log(torch.softmax(self.f(x), -1))

    torch.manual_seed(0)
    model = LogSoftmaxByHand()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with guard(model, opt, live=False) as g:
        for step in range(3):
            with torch.no_grad():
                model(torch.randn(8, 10) * 1e4)  # -inf in the output, nothing else
            x = torch.randn(8, 10) * (1e4 if step == 2 else 1.0)
            loss = nn.functional.nll_loss(model(x), torch.randint(0, 5, (8,)))
            opt.zero_grad()
            loss.backward()
            opt.step()
    f = g.findings[0]
    assert (f.kind, f.where, f.step) == ("nonfinite-output", "LogSoftmaxByHand", 2)


class _WhereLoss(nn.Module):
    """Imputes NaN features itself; the loss masks NaN targets with a single torch.where (the trap)."""

    def __init__(self):
        super().__init__()
        self.f = nn.Linear(4, 1)

    def forward(self, x):
        return self.f(torch.nan_to_num(x))


@pytest.mark.parametrize("nan_features", [True, False])
def test_nan_gradients_through_a_where_over_nan_targets_are_explained(nan_features):
    torch.manual_seed(0)
    model = _WhereLoss()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with guard(model, opt, live=False) as g:
        x, y = torch.randn(8, 4), torch.randn(8, 1)
        if nan_features:
            x[2, 1] = float("nan")
        y[5] = float("nan")  # a missing target
        valid = ~torch.isnan(y)
        loss = torch.where(valid, (model(x) - y) ** 2, torch.zeros_like(y)).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert [f.kind for f in g.findings] == ["nonfinite-grad"]  # not the handled input: no nonfinite-input
    f = g.findings[0]
    assert f.where == "f.weight" and "torch.where(mask, f(x), 0)" in f.hint
    assert "overflowed" not in f.hint
    if nan_features:
        assert f.details["taken_input"] == ["args[0]"] and "kept out of its outputs" in f.message


def test_nan_gradients_of_a_step_whose_output_was_reported_are_not_reported_again():
    """Under a global guard the first step's forward is read at its backward's end (no optimizer known yet) and
    its gradients at the step: two reads of one step. The NaN output is the root cause; its NaN gradients are not
    a second finding (whose hint would say the forward was finite)."""
    class SqrtOfNegative(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            return torch.sqrt(self.fc(x) - 100.0)  # NaN from finite inputs, and NaN gradients behind it

    torch.manual_seed(0)
    model = SqrtOfNegative()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with guard(live=False) as g:
        for _ in range(2):
            opt.zero_grad()
            model(torch.randn(8, 4)).sum().backward()
            opt.step()
    assert [(f.kind, f.where, f.step) for f in g.findings] == [("nonfinite-output", "SqrtOfNegative", 0)]


class _LossInside(nn.Module):
    """A model that computes its loss in forward from `labels` (the Hugging Face convention)."""

    def __init__(self):
        super().__init__()
        self.emb, self.head = nn.Embedding(20, 8), nn.Linear(8, 20)

    def forward(self, ids, labels=None):
        logits = self.head(self.emb(ids))
        out = {"logits": logits}
        if labels is not None:
            out["loss"] = F.cross_entropy(logits.view(-1, 20), labels.view(-1), ignore_index=-100)
        return out


def test_a_loss_computed_inside_the_model_over_labels_all_minus_100_is_a_nonfinite_loss():
    torch.manual_seed(0)
    model = _LossInside()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with guard(model, opt, live=False) as g:
        for step in range(4):
            ids = torch.randint(0, 20, (2, 6))
            labels = ids.clone()
            labels[:, :3] = -100
            if step == 2:
                labels[:] = -100  # the answer was truncated away: nothing to learn from
            out = model(ids, labels=labels)
            opt.zero_grad()
            out["loss"].backward()
            opt.step()
    assert [(f.kind, f.where, f.step) for f in g.findings if f.severity == "error"] == [("nonfinite-loss", "loss", 2)]
    f = g.findings[0]
    assert "_LossInside computed inside its forward (output['loss'])" in f.message and "all -100" in f.message
    assert "(labels != -100).any()" in f.hint and "lower the learning rate" not in f.hint
    assert f.details["inside_model"] is True


def test_hf_causal_lm_with_every_label_masked():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=100, n_positions=16, n_embd=16, n_layer=1, n_head=2,
                                     bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(config)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with guard(model, opt, live=False) as g:
        for step in range(3):
            ids = torch.randint(0, 100, (2, 8))
            labels = ids.clone()
            labels[:, :4] = -100
            if step == 1:
                labels[:] = -100
            out = model(input_ids=ids, labels=labels)
            opt.zero_grad()
            out.loss.backward()
            opt.step()
    assert [(f.kind, f.where, f.step) for f in g.findings if f.severity == "error"] == [("nonfinite-loss", "loss", 1)]


class _Block(nn.Module):
    def __init__(self, scale):
        super().__init__()
        self.fc, self.scale = nn.Linear(8, 8), scale

    def forward(self, x):
        return torch.exp(self.fc(x) * self.scale)  # overflows when scale is large


class _Stack(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp, self.blocks, self.out = nn.Linear(4, 8), nn.ModuleList(), nn.Linear(8, 2)

    def forward(self, x):
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.out(x)


@pytest.mark.parametrize("scope", ["model", "global"])
def test_a_block_appended_mid_run_is_named_by_its_path(scope):
    """Progressive growing: blocks appended after guard started are named `blocks.1`, not the model or `Block`."""
    torch.manual_seed(0)
    model = _Stack()
    x, y = torch.randn(16, 4), torch.randint(0, 2, (16,))
    with guard(*((model,) if scope == "model" else ()), live=False) as g:
        for step in range(5):
            if step in (1, 2):
                model.blocks.append(_Block(1.0 if step == 1 else 1000.0))
            if step <= 2:
                opt = torch.optim.SGD(model.parameters(), lr=0.01)  # re-created over the grown model
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
    assert [(f.kind, f.where, f.step) for f in g.findings] == [("nonfinite-output", "blocks.1", 2)]
    assert g.internal_errors == []


def test_a_head_replaced_mid_run_is_named_and_its_modules_listed():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    with guard(model, live=False) as g:
        model(torch.randn(2, 4))
        model[2] = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3))  # a new head
        model(torch.randn(2, 4))
    assert g.watched.known_path(model[2]) == "2" and g.watched.known_path(model[2][2]) == "2.2"
    assert {"2.0", "2.2"} <= {m["path"] for m in g.record.modules}


class _LeftPadded(nn.Module):
    """A SASRec-style block: causal self-attention over left-padded sequences, then a scoring head."""

    def __init__(self, broken=False):
        super().__init__()
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True)
        self.out = nn.Linear(8, 1)
        self.broken = broken

    def forward(self, x, pad):
        causal = torch.triu(torch.ones(5, 5, dtype=torch.bool), 1)
        a, _ = self.attn(x, x, x, key_padding_mask=pad, attn_mask=causal, need_weights=False)
        if self.broken and not self.training:
            a = a.clone()
            a[:, -1] = a[:, -1].log()  # a real NaN at the last (never padded) position, in evaluation only
        return self.out(a).squeeze(-1)


@pytest.mark.parametrize("when", ["after training", "mid-run"])
def test_nan_of_the_attention_fast_path_in_fully_masked_rows_is_no_origin(when):
    """torch's MultiheadAttention fast path (eval, no_grad) returns NaN for a query whose keys are all masked (a
    left pad under a causal mask): padding the evaluation discards. An evaluation
    after the last training step was reported as a nonfinite-output error (one mid-run was judged with the next
    step's finite loss); a NaN at a position that is not padding still is."""

    def run(broken):
        torch.manual_seed(0)
        m = _LeftPadded(broken)
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        x, y = torch.randn(6, 5, 8), torch.randn(6, 5)
        pad = torch.zeros(6, 5, dtype=torch.bool)
        pad[:, :2] = True
        scores = []

        def evaluate():
            m.eval()
            with torch.no_grad():
                scores.append(m(x, pad)[:, -1].pow(2).mean().item())  # the last position: never padding
            m.train()

        with guard(m, opt, live=False) as g:
            for step in range(12):
                loss = ((m(x, pad) - y) ** 2 * (~pad)).mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
                if when == "mid-run" and step == 5:
                    evaluate()
            if when == "after training":
                evaluate()
        return g, scores

    g, scores = run(broken=False)
    assert math.isfinite(scores[0]) and g.findings == []
    g, scores = run(broken=True)
    assert math.isnan(scores[0]) and [f.kind for f in g.findings] == ["nonfinite-output"]


def test_padding_nan_that_a_later_attention_spreads_to_real_positions_is_reported_at_its_origin():
    """Two attention layers: the second takes the first one's NaN padding rows as (masked) keys and values, and
    0 * NaN makes every position of a padded sequence NaN in evaluation (a hit rate computed from NaN scores)."""
    torch.manual_seed(0)

    class TwoLayers(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList([nn.MultiheadAttention(8, 2, batch_first=True) for _ in range(2)])

        def forward(self, x, pad):
            causal = torch.triu(torch.ones(5, 5, dtype=torch.bool), 1)
            for attn in self.blocks:
                x = x + attn(x, x, x, key_padding_mask=pad, attn_mask=causal, need_weights=False)[0]
            return x * (~pad).unsqueeze(-1)  # NaN * 0 stays NaN

    m = TwoLayers()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    x, pad = torch.randn(6, 5, 8), torch.zeros(6, 5, dtype=torch.bool)
    pad[:3, :2] = True
    with guard(m, opt, live=False) as g:
        for _ in range(3):
            loss = m(x, pad).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
        m.eval()
        with torch.no_grad():
            last = m(x, pad)[:, -1]
    assert torch.isnan(last[:3]).all() and not torch.isnan(last[3:]).any()
    (f,) = g.findings
    assert (f.kind, f.where, f.step) == ("nonfinite-output", "blocks.0", 3)
    assert f.details["padding_rows_only"] and f.details["spread_by"] == "blocks.1"
    assert "masked_fill(pad.unsqueeze(-1), 0)" in f.hint
    # (torch 2.13's training path gives NaN there too: the message must not say it gives 0)
    assert "softmax over no key" in f.message and "gives 0" not in f.message


@pytest.mark.parametrize("layout", ["jagged", "sparse_coo", "sparse_csr"])
def test_nan_in_a_sparse_or_nested_batch_is_dirty_data(layout):
    """The input screen reads a sparse or jagged nested batch's stored values: NaN there is `nonfinite-input`,
    not a module that 'produced NaN from finite inputs' (which sent the user after overflow)."""
    torch.manual_seed(0)
    if layout == "jagged":
        parts = [torch.randn(2, 3), torch.randn(4, 3)]
        parts[1][0, 0] = float("nan")
        x = torch.nested.nested_tensor(parts, layout=torch.jagged)

        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                self.l = nn.Linear(3, 2)

            def forward(self, nt):
                return self.l(nt).amax(dim=1)
    else:
        x = torch.sparse_coo_tensor(torch.tensor([[0, 1], [2, 4]]), torch.tensor([1.0, float("nan")]), (2, 5))
        if layout == "sparse_csr":
            x = x.to_sparse_csr()

        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                self.W = nn.Parameter(torch.randn(5, 2))

            def forward(self, sp):
                return torch.sparse.mm(sp, self.W) if sp.layout is torch.sparse_coo else sp @ self.W

    m = Net()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    with guard(m, opt, live=False) as g:
        loss = m(x).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert [(f.kind, f.where, f.step) for f in g.findings][:1] == [("nonfinite-input", "input", 0)]
    assert g.internal_errors == []


def test_global_guard_names_a_parametrization_registered_after_it_started_by_its_path():
    """register_parametrization calls the parametrization outside any model: a weight read, not a model call.
    Its NaN (spectral norm of a zero weight) is reported at the first model call, at the module's path."""
    from torch.nn.utils.parametrizations import spectral_norm

    with guard(live=False) as g:
        last = nn.Linear(8, 1)
        nn.init.zeros_(last.weight)  # sigma = 0: the normalised weight is 0 / 0
        model = nn.Sequential(spectral_norm(nn.Linear(4, 8)), nn.ReLU(), spectral_norm(last))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(2):
            loss = F.mse_loss(model(torch.randn(16, 4)), torch.randn(16, 1))
            opt.zero_grad(); loss.backward(); opt.step()
    f = next(f for f in g.findings if f.kind == "nonfinite-output")
    assert f.where == "2.parametrizations.weight.0" and f.step == 0
    assert f.source.startswith("tests/test_nonfinite.py:")


def test_parametrization_whose_right_inverse_made_nan_gets_its_own_fix():
    import torch.nn.utils.parametrize as parametrize

    class Exp(nn.Module):
        def forward(self, X):
            return torch.exp(X)

        def right_inverse(self, W):
            return torch.log(W)  # NaN for the negative half of a default-initialised weight

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1, 16), nn.Tanh(), nn.Linear(16, 1))
    parametrize.register_parametrization(model[0], "weight", Exp())
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    with guard(model, opt, live=False) as g:
        loss = F.mse_loss(model(torch.randn(8, 1)), torch.randn(8, 1))
        opt.zero_grad(); loss.backward(); opt.step()
    f = next(f for f in g.findings if f.kind == "nonfinite-output")
    assert f.where == "0.parametrizations.weight" and "its parameters original are non-finite" in f.message
    assert "right_inverse" in f.hint and "log(W.abs() + eps)" in f.hint


def test_loss_scaling_by_hand_that_skips_overflowing_steps_before_the_first_update():
    """apex/fairseq-style dynamic loss scaling: a high first scale overflows the fp16 gradients, the loop skips
    those steps itself and halves the scale. Before the first optimizer step a global guard judges each
    backward's gradients at once: not those of a loss scaled by hand."""
    torch.manual_seed(0)
    with guard(live=False) as g:
        model = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 1)).half()
        params = list(model.parameters())
        master = [p.detach().float().clone().requires_grad_() for p in params]
        opt = torch.optim.SGD(master, lr=1e-3)
        scale, skipped, x, y = 2.0 ** 24, 0, torch.randn(32, 8), torch.randn(32, 1)
        for _ in range(20):
            loss = F.mse_loss(model(x.half()).float(), y)
            for p in params:
                p.grad = None
            (loss * scale).backward()
            if any(not torch.isfinite(p.grad).all() for p in params):
                scale, skipped = scale / 2, skipped + 1
                continue
            for m, p in zip(master, params):
                m.grad = p.grad.float() / scale
            opt.step()
            with torch.no_grad():
                for p, m in zip(params, master):
                    p.copy_(m)
    assert skipped >= 3 and g.findings == []

    with guard(live=False) as g:  # the same overflow, unscaled and not skipped: reported
        lin = nn.Linear(3, 1)
        (lin(torch.ones(2, 3)) * 0).pow(2).sum().sqrt().backward()  # sqrt's derivative at 0 is inf
    assert [f.kind for f in g.findings] == ["nonfinite-grad"]


def test_a_standard_layer_subclass_with_its_own_forward_is_the_origin():
    """A fake-quant nn.Linear subclass computes something else than nn.Linear: its NaN is its own (the per-tensor
    scale of a zero-initialised weight is 0 / 0), not the parent's."""
    class QLinear(nn.Linear):
        def forward(self, x):
            s = self.weight.abs().max() / 7
            wq = torch.round(self.weight / s).clamp(-8, 7) * s
            return F.linear(x, self.weight + (wq - self.weight).detach(), self.bias)

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), QLinear(16, 16), nn.ReLU(), nn.Linear(16, 1))
    nn.init.zeros_(model[2].weight)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with guard(model, opt, live=False) as g:
        for _ in range(2):
            loss = F.mse_loss(model(torch.randn(8, 4)), torch.randn(8, 1))
            opt.zero_grad(); loss.backward(); opt.step()
    f = next(f for f in g.findings if f.kind == "nonfinite-output")
    assert f.where == "2" and "2 (QLinear) produced NaN/Inf; its inputs were finite" in f.message


def test_nan_in_a_sparse_gradient_is_a_nonfinite_grad_not_a_nonfinite_param():
    """nn.Embedding(sparse=True): the norm of a zero latent code at its sqrt makes its sparse gradient NaN."""
    codes = nn.Embedding(10, 4, sparse=True)
    nn.init.zeros_(codes.weight)
    dec = nn.Linear(4, 1)
    opt = torch.optim.SparseAdam(codes.parameters(), lr=1e-2)
    opt2 = torch.optim.Adam(dec.parameters(), lr=1e-2)
    with guard(live=False) as g:
        z = codes(torch.tensor([1, 2, 3]))
        loss = F.mse_loss(dec(z), torch.ones(3, 1)) + 1e-3 * z.pow(2).sum(1).sqrt().mean()  # sqrt at 0
        opt.zero_grad(); opt2.zero_grad(); loss.backward(); opt.step(); opt2.step()
    assert [(f.kind, f.where) for f in g.findings] == [("nonfinite-grad", "weight")]
    assert g.timeline[0]["grad_norm"] != g.timeline[0]["grad_norm"]  # NaN: the sparse gradient is counted


def test_an_infinite_ctc_loss_gets_the_alignment_fix():
    """An utterance shorter than its transcript has no CTC alignment: its loss is inf without zero_infinity."""
    torch.manual_seed(0)
    model = nn.Linear(4, 6)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    targets, tgt_len = torch.randint(1, 6, (2, 5)), torch.tensor([5, 5])
    with guard(model, opt, live=False) as g:
        for in_len in ([10, 10], [10, 3]):  # the second batch holds a 3-frame input for 5 labels
            logp = model(torch.randn(10, 2, 4)).log_softmax(-1)
            loss = nn.CTCLoss()(logp, targets, torch.tensor(in_len), tgt_len)
            opt.zero_grad(); loss.backward(); opt.step()
    (f,) = g.findings
    assert f.kind == "nonfinite-loss" and f.step == 1 and "zero_infinity=True" in f.hint and f.details["ctc"]


def test_counts_are_not_taken_from_a_next_call_whose_weights_or_inputs_broke_meanwhile():
    """A pooling that divides by a zero count for one cloud of 8: the NaN update makes the next call's input NaN
    everywhere, so its counts (every output NaN) would hide that one sample was the origin's."""
    class MeanPool(nn.Module):
        def forward(self, h, mask):
            m = mask.unsqueeze(-1).float()
            return (h * m).sum(1) / m.sum(1)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.mlp, self.pool, self.head = nn.Sequential(nn.Linear(3, 16), nn.ReLU()), MeanPool(), nn.Linear(16, 1)

        def forward(self, p, mask):
            return self.head(self.pool(self.mlp(p), mask)).squeeze(1)

    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with guard(model, opt, live=False) as g:
        for step in range(4):
            p, mask = torch.randn(8, 32, 3), torch.ones(8, 32, dtype=torch.bool)
            if step == 2:
                mask[3] = False
            loss = F.mse_loss(model(p, mask), p.norm(dim=-1).mean(1))
            opt.zero_grad(); loss.backward(); opt.step()
    f = next(f for f in g.findings if f.kind == "nonfinite-output")
    assert (f.where, f.step) == ("pool", 2) and "counts_unavailable" in f.details and f.details["counts"] == {}


def test_an_optimised_input_made_nan_by_its_update_is_not_dirty_data():
    """DeepDream-style ascent normalising the gradient by hand, g / g.norm(): at a zero gradient Adam writes NaN
    into the image it optimises, and the next forward's input is NaN. No dataset is involved."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 1)).requires_grad_(False)
    img = torch.rand(1, 16, requires_grad=True)
    opt = torch.optim.SGD([img], lr=0.1)
    with guard(net, opt, live=False) as g:
        for it in range(4):
            loss = -net(img).sum() * (0.0 if it == 1 else 1.0)
            opt.zero_grad()
            loss.backward()
            img.grad /= img.grad.norm()  # 0 / 0 at step 1
            opt.step()
    f = only(g, "nonfinite-input")
    assert f.step == 2 and f.details["optimised_input"] is True
    assert "SGD optimises" in f.message and "dirty" not in f.message and "clamp_min" in f.hint


@pytest.mark.parametrize("kept_as", ["buffer", "parameter"])
def test_a_module_whose_own_buffer_holds_minus_inf_is_named_with_that_buffer(kept_as):
    """A CRF with hard constraints as a -inf buffer: a gold path that takes a forbidden transition scores -inf, and
    the normaliser minus it is NaN. The module's inputs are finite; its buffer is the cause. The same constraint
    written into the transitions parameter at init is named so too (the generic overflow hint until stop 44)."""

    class CRF(nn.Module):
        def __init__(self):
            super().__init__()
            c = torch.zeros(3, 3)
            c[0, 2] = float("-inf")  # tag 0 may not be followed by tag 2
            if kept_as == "buffer":
                self.trans = nn.Parameter(torch.zeros(3, 3))
                self.register_buffer("constraint", c)
            else:
                self.trans = nn.Parameter(c)
                self.constraint = 0.0

        def forward(self, emissions, tags):
            t = self.trans + self.constraint
            gold = (emissions.gather(1, tags[:, None]).sum() + t[tags[:-1], tags[1:]].sum())
            alpha = emissions[0]
            for e in emissions[1:]:
                alpha = torch.logsumexp(alpha[:, None] + t, 0) + e
            return torch.logsumexp(alpha, 0) - gold

    torch.manual_seed(0)
    enc, crf = nn.Linear(4, 3), CRF()
    opt = torch.optim.SGD([*enc.parameters(), *crf.parameters()], lr=0.1)
    model = nn.ModuleDict({"enc": enc, "crf": crf})
    with guard(model, opt, live=False) as g:
        tags = torch.tensor([0, 2, 1, 1])  # noisy gold: 0 -> 2 is forbidden
        loss = model["crf"](model["enc"](torch.randn(4, 4)), tags)
        opt.zero_grad()
        loss.backward()
        opt.step()
    f = only(g, "nonfinite-output")
    assert f.where == "crf" and "-1e4" in f.hint
    if kept_as == "buffer":
        assert f.details["nonfinite_buffers"] == ["constraint"] and "buffer `constraint` holds -inf/inf" in f.message
    else:
        assert f.details["constraint_params"] == ["trans"] and "parameter `trans` holds -inf/inf" in f.message


class _Distances(nn.Module):
    """Pairwise distances with +inf on the diagonal (self-pairs excluded by design)."""

    def forward(self, pos):
        eye = torch.eye(pos.shape[1], dtype=torch.bool)
        r2 = ((pos[:, :, None] - pos[:, None]) ** 2).sum(-1).masked_fill(eye, 1.0)
        return r2.sqrt().masked_fill(eye, float("inf"))


class _PairEnergy(nn.Module):
    def __init__(self):
        super().__init__()
        self.dist = _Distances()
        self.register_buffer("mu", torch.linspace(0, 4, 8))
        self.pair = nn.Sequential(nn.Linear(8, 16), nn.SiLU(), nn.Linear(16, 1))

    def forward(self, pos):
        rbf = torch.exp(-(self.dist(pos)[..., None] - self.mu) ** 2)  # exp(-inf) = 0: the self-pairs drop out
        return self.pair(rbf).squeeze(-1).sum((1, 2))


@pytest.mark.parametrize("nan_in_eval", [False, True])
def test_an_evaluation_whose_model_output_is_finite_handled_its_layers_inf(nan_in_eval):
    """A layer that returns +inf by design, turned into zeros downstream: silent on training steps, and now in the
    evaluations between epochs and after the last step too (the model's outputs are finite). An evaluation fed NaN
    is still told."""
    torch.manual_seed(0)
    pos, model = torch.randn(32, 5, 3), _PairEnergy()
    energy = (pos ** 2).sum((1, 2))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)

    def evaluate():
        model.eval()
        with torch.no_grad():
            p = pos[:8].clone()
            if nan_in_eval:
                p[0, 0, 0] = float("nan")  # dirty evaluation data: this evaluation's output is NaN
            F.mse_loss(model(p), energy[:8]).item()
        model.train()

    with guard(model, opt, live=False) as g:
        for epoch in range(2):
            for idx in torch.arange(32).split(8):
                loss = F.mse_loss(model(pos[idx]), energy[idx])
                opt.zero_grad()
                loss.backward()
                opt.step()
            evaluate() if not nan_in_eval or epoch == 1 else None
    if not nan_in_eval:
        assert g.findings == []
    else:
        assert [(f.kind, f.step) for f in g.findings] == [("nonfinite-input", 8)]


@pytest.mark.parametrize("eps", [0.0, 1e-9])
def test_a_nan_force_from_autograd_grad_is_named_as_the_losss_cause(eps):
    """Forces as -dE/dpos with pairwise distances `sqrt(r2)`: the derivative of sqrt at r = 0 (the diagonal) is
    infinite, so torch.autograd.grad returns NaN while the energies are finite, and the loss on the forces is NaN.
    The finding names that autograd.grad line and the sqrt(r2 + eps) fix. With eps the run is clean."""
    torch.manual_seed(0)

    class Pair(nn.Module):
        def __init__(self):
            super().__init__()
            self.phi = nn.Sequential(nn.Linear(4, 8), nn.SiLU(), nn.Linear(8, 1))
            self.register_buffer("mu", torch.linspace(0.5, 3, 4))

        def forward(self, pos):
            r = (((pos[:, :, None] - pos[:, None]) ** 2).sum(-1) + eps).sqrt()
            mask = 1 - torch.eye(pos.shape[1])
            return (self.phi(torch.exp(-(r[..., None] - self.mu) ** 2)).squeeze(-1) * mask).sum((1, 2))

    model = Pair()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x = torch.randn(8, 4, 3)
    with guard(model, opt, live=False) as g:
        for _ in range(2):
            pos = x.clone().requires_grad_(True)
            e = model(pos)
            force = -torch.autograd.grad(e.sum(), pos, create_graph=True)[0]  # the derivative
            loss = (e - x.pow(2).sum((1, 2))).pow(2).mean() + (force + 2 * x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    if eps:
        assert [f for f in g.findings if f.severity != "info"] == []
        return
    f = next(f for f in g.findings if f.kind == "nonfinite-loss")
    assert f.step == 0 and "torch.autograd.grad took at" in f.message and "sqrt(r2 + eps)" in f.hint
    assert f.details["derivative_source"].startswith("tests/test_nonfinite.py:")


class _Fusion(nn.Module):
    """Text queries attend to audio frames (key_padding_mask True at padding)."""

    def __init__(self):
        super().__init__()
        self.cross = nn.MultiheadAttention(16, 2, batch_first=True)
        self.head = nn.Linear(16, 3)

    def forward(self, q, kv, pad):
        fused, _ = self.cross(q, kv, kv, key_padding_mask=pad)
        return self.head(fused.mean(1))


@pytest.mark.parametrize("cause", ["empty-stream", "inverted-mask"])
def test_nan_from_an_attention_row_with_every_key_masked_says_so(cause):
    """A sample whose audio is missing (its padding mask all True), or a Hugging Face mask (1 = keep) passed as
    torch's (True = ignore) to a sample with no padding: the training path's softmax over all -inf is NaN. The
    finding names the attention and the masked rows, with the mask fix (not the overflow/epsilon one)."""
    torch.manual_seed(0)
    model = _Fusion()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with guard(model, opt, live=False) as g:
        for step in range(3):
            lengths = torch.tensor([7, 5, 7, 3])
            if cause == "empty-stream" and step == 1:
                lengths[1] = 0
            keep = torch.arange(7)[None] < lengths[:, None]
            pad = keep if cause == "inverted-mask" else ~keep  # inverted: True at the real frames
            loss = F.cross_entropy(model(torch.randn(4, 5, 16), torch.randn(4, 7, 16), pad),
                                   torch.tensor([0, 1, 2, 0]))
            opt.zero_grad()
            loss.backward()
            opt.step()
    f = g.findings[0]
    assert (f.kind, f.where, f.step) == ("nonfinite-output", "cross", 1 if cause == "empty-stream" else 0)
    assert f.details["fully_masked_rows"] == (5 if cause == "empty-stream" else 10)
    assert "every key masked" in f.message and "~attention_mask.bool()" in f.hint
    assert "overflow" not in f.hint


def test_nan_of_an_overflowing_attention_beside_masked_rows_keeps_the_overflow_fix():
    """NaN in rows that are not masked (inputs of 1e20 overflow q·k) is not the mask's doing."""
    attn = nn.MultiheadAttention(16, 2, batch_first=True)
    pad = torch.zeros(2, 4, dtype=torch.bool)
    pad[1] = True
    with guard(attn, live=False) as g:
        q, kv = torch.full((2, 3, 16), 1e20), torch.full((2, 4, 16), 1e20)
        out, _ = attn(q, kv, kv, key_padding_mask=pad)
        out.sum().backward()
    f = g.findings[0]
    assert (f.kind, f.where) == ("nonfinite-output", "MultiheadAttention")
    assert "fully_masked_rows" not in f.details and "overflow" in f.hint


class _SquashedActor(nn.Module):
    def __init__(self):
        super().__init__()
        self.l = nn.Linear(4, 2)

    def forward(self, s):
        a = torch.tanh(self.l(s) * 20)  # saturated: tanh(u) == 1 in float32
        return a, -torch.log(1 - a.pow(2)).sum(-1)  # the tanh-squash correction without its epsilon: log(0)


@pytest.mark.parametrize("scope", ["models", "global"])
def test_inf_made_before_the_update_that_broke_the_weights_is_not_blamed_on_them(scope):
    """TD3/SAC order: the critic steps first (its step ends guard's steps), then the actor's forward makes +inf
    from finite weights, and the actor's own update (NaN gradients) breaks them before the window is read. The
    finding says its inputs were finite, with the epsilon fix, not "its parameters are non-finite"."""
    torch.manual_seed(0)
    actor, critic = _SquashedActor(), nn.Linear(6, 1)
    a_opt, c_opt = torch.optim.SGD(actor.parameters(), 0.01), torch.optim.SGD(critic.parameters(), 0.01)
    models, opts = ([critic, actor], [c_opt, a_opt]) if scope == "models" else (None, None)
    with guard(models, opts, live=False) as g:
        for _ in range(3):
            c_opt.zero_grad()
            critic(torch.randn(16, 6)).pow(2).mean().backward()
            c_opt.step()
            a, logp = actor(torch.randn(16, 4))
            a_opt.zero_grad()
            (logp.mean() + a.pow(2).mean()).backward()
            a_opt.step()
    f = g.findings[0]
    assert (f.kind, f.where) == ("nonfinite-output", "_SquashedActor" if scope == "global" else "actor")
    assert f.details["nonfinite_params"] == [] and "its inputs were finite" in f.message
    assert "epsilon" in f.hint and "reload good weights" not in f.hint


def test_normalisation_buffers_computed_from_data_with_nan_are_named_with_the_clean_data_fix():
    """Observation statistics taken over a dataset with a few NaN readings hold NaN: every output is NaN although
    the batches fed are clean. Named at the buffer with the nanmean fix, not as a CRF's hard constraint."""
    torch.manual_seed(0)
    obs = torch.randn(256, 6)
    obs[::97, 2] = float("nan")

    class Policy(nn.Module):
        def __init__(self, mean, std):
            super().__init__()
            self.register_buffer("o_mean", mean)
            self.register_buffer("o_std", std)
            self.net = nn.Linear(6, 2)

        def forward(self, o):
            return self.net((o - self.o_mean) / self.o_std)

    pi = Policy(obs.mean(0), obs.std(0) + 1e-6)
    opt = torch.optim.Adam(pi.parameters(), 1e-3)
    clean = obs[~obs.isnan().any(1)]
    with guard(pi, opt, live=False) as g:
        for _ in range(3):
            loss = F.mse_loss(pi(clean[:32]), torch.zeros(32, 2))
            opt.zero_grad()
            loss.backward()
            opt.step()
    f = g.findings[0]
    assert (f.kind, f.where, f.step) == ("nonfinite-output", "Policy", 0)
    assert f.details["nonfinite_buffers"] == ["o_mean", "o_std"] and "holds NaN" in f.message
    assert "nanmean" in f.hint and "CRF" not in f.message


@pytest.mark.parametrize("loss_of", ["acos", "sqrt"])
def test_nan_gradients_of_a_finite_loss_name_the_op_with_an_infinite_derivative(loss_of):
    """A geodesic rotation loss acos((tr - 1) / 2) at a perfect match (acos' = -inf at 1), a Chamfer-style distance
    sqrt(d2) between identical points (sqrt' = inf at 0): the forward is finite, the gradients NaN. The hint names the
    op found in the loss graph and its clamp or eps (until stop 44 it led with torch.where and never said acos)."""
    torch.manual_seed(0)
    model = nn.Linear(3, 3)
    with torch.no_grad():
        model.weight.zero_()
        model.bias.zero_()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(8, 3)
    with guard(model, opt, live=False) as g:
        out = model(x)
        if loss_of == "acos":
            cos = 1 - out.pow(2).sum(-1) / 2  # exactly 1 at the identity's zero offset
            loss = torch.acos(cos).mean()
        else:
            loss = torch.sqrt(out.pow(2).sum(-1)).mean()  # the predicted offsets match: distance 0
        opt.zero_grad()
        loss.backward()
        opt.step()
    [f] = g.findings
    assert (f.kind, f.step) == ("nonfinite-grad", 0)
    assert f.hint.startswith(f"{loss_of} (in the loss graph) has an infinite derivative")
    assert ("1 - 1e-7" if loss_of == "acos" else "d2 + 1e-12") in f.hint


@pytest.mark.parametrize("bug", ["filtered", "masked"])
def test_nan_gradients_through_ctc_name_zero_infinity_or_the_minus_inf_mask(bug):
    """CTC: utterances too short for their transcripts filtered out by hand (`loss[torch.isfinite(loss)].mean()`),
    or a language's classes masked with -inf before log_softmax. The loss is finite, ctc_loss's backward makes NaN.
    The hint led with torch.where and never said zero_infinity (stop 45)."""
    torch.manual_seed(0)
    model = nn.Linear(8, 6)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(12, 4, 8)  # (T, N, features)
    targets = torch.randint(1, 6, (4, 5))
    in_lens = torch.tensor([12, 12, 3, 12]) if bug == "filtered" else torch.full((4,), 12)
    with guard(model, opt, live=False) as g:
        logits = model(x)
        if bug == "masked":
            logits = logits.masked_fill(torch.tensor([False] * 5 + [True]), float("-inf"))
            targets = targets.clamp(max=4)
        lp = logits.log_softmax(-1)
        loss = F.ctc_loss(lp, targets, in_lens, torch.full((4,), 5), reduction="none")
        loss = loss[torch.isfinite(loss)].mean()
        assert torch.isfinite(loss)
        opt.zero_grad()
        loss.backward()
        opt.step()
    [f] = g.findings
    assert (f.kind, f.step) == ("nonfinite-grad", 0)
    assert f.hint.startswith("ctc_loss (in the loss graph) gives NaN gradients")
    assert "zero_infinity=True" in f.hint and "torch.finfo(x.dtype).min" in f.hint


def test_batchnorm_statistics_made_nan_by_the_same_call_are_not_blamed():
    """PointNet++ feature propagation, `1.0 / dists` with no epsilon at a distance of 0, then a BatchNorm in training
    mode inside the same module: the NaN also lands in the BatchNorm's running statistics during that call. They are
    its effect, not its cause (blamed, with a nanmean fix, until stop 44): the generic x/0 hint, no buffer named."""
    class FP(nn.Module):
        def __init__(self):
            super().__init__()
            self.mlp = nn.Sequential(nn.Conv1d(4, 8, 1), nn.BatchNorm1d(8), nn.ReLU())

        def forward(self, xyz1, xyz2, feats2):
            d = torch.cdist(xyz1, xyz2)
            w = 1.0 / d  # 0 where a dense point is also a sampled one
            w = w / w.sum(-1, keepdim=True)
            return self.mlp((w @ feats2).transpose(1, 2))

    torch.manual_seed(0)
    fp, head = FP(), nn.Conv1d(8, 2, 1)
    opt = torch.optim.Adam([*fp.parameters(), *head.parameters()], 1e-3)
    xyz1 = torch.randn(8, 16, 3)
    with guard([fp, head], opt, live=False) as g:
        out = head(fp(xyz1, xyz1[:, :4], torch.randn(8, 4, 4)))
        loss = out.mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    [f] = [f for f in g.findings if f.kind == "nonfinite-output"]
    assert (f.where, f.step) == ("fp", 0)
    assert not f.details.get("nonfinite_buffers") and "buffer" not in f.message and "nanmean" not in f.hint
    assert "x/0" in f.hint


def test_a_per_image_box_loss_whose_sixth_image_has_an_infinite_target_names_the_target():
    """A detection box loss written per image: `smooth_l1_loss(pred[b], encode(gt[b]))` for 8 images, the sixth with
    a box clipped to zero width, whose log(gw / aw) encoding is -inf. Targets were kept for the first 4 loss calls
    only, so the finding named a division instead of the target (stop 42: 32 kept)."""
    torch.manual_seed(0)
    head = nn.Linear(6, 4)
    opt = torch.optim.SGD(head.parameters(), lr=0.01)
    with guard(head, opt, live=False) as g:
        for _ in range(2):
            pred = head(torch.randn(8, 5, 6))
            gw = torch.rand(8, 5) + 0.5
            gw[5, 2] = 0.0  # a degenerate box
            loss = 0.0
            for b in range(8):
                target = torch.stack([torch.zeros(5), torch.zeros(5), torch.log(gw[b] / 0.7), torch.zeros(5)], 1)
                loss = loss + F.smooth_l1_loss(pred[b], target) / 8
            opt.zero_grad()
            loss.backward()
            opt.step()
    f = g.findings[0]
    assert (f.kind, f.step) == ("nonfinite-loss", 0) and "target given to smooth_l1_loss" in f.message
    assert "log(gw / aw)" in f.hint


@pytest.mark.parametrize("loss_fn", [lambda p, y: F.mse_loss(p, y), nn.SmoothL1Loss()], ids=["F.mse_loss", "SmoothL1Loss"])
def test_a_nan_loss_from_a_nan_target_names_the_target(loss_fn):
    """Behaviour cloning with z-scored actions: one action dimension is constant, its std 0, its targets 0/0.
    The model's outputs are finite; the finding names the loss function's target, not the loss computation."""
    torch.manual_seed(0)
    obs, act = torch.randn(64, 5), torch.randn(64, 3)
    act[:, 2] = 1.0
    act_n = (act - act.mean(0)) / act.std(0)
    pi = nn.Sequential(nn.Linear(5, 16), nn.ReLU(), nn.Linear(16, 3))
    opt = torch.optim.Adam(pi.parameters(), 1e-3)
    with guard(pi, opt, live=False) as g:
        for it in range(3):
            idx = torch.arange(16) + 16 * it
            loss = loss_fn(pi(obs[idx]), act_n[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
    f = g.findings[0]
    assert (f.kind, f.where, f.step) == ("nonfinite-loss", "loss", 0)
    assert "target given to" in f.message and "16 NaN" in f.message
    assert f.details["target_of"] in ("mse_loss", "smooth_l1_loss") and "std.clamp_min" in f.hint


class _GraphBatch:
    """A PyG `Data`-style batch: a plain object of the user's code holding the tensors as attributes."""

    def __init__(self, z, pos, batch):
        self.z, self.pos, self.batch = z, pos, batch


class _PosNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.out = nn.Embedding(10, 8), nn.Linear(9, 1)

    def forward(self, data):
        r = data.pos.pow(2).sum(-1, keepdim=True).add(1e-8).sqrt()
        return self.out(torch.cat([self.emb(data.z), r], -1)).squeeze(-1)


@pytest.mark.parametrize("broken", [True, False])
def test_nan_in_a_plain_batch_object_is_dirty_data_not_the_models_overflow(broken):
    """A failed conformer leaves NaN in `data.pos` of a plain batch class: it was reported as the model making NaN
    from finite inputs ("its computation overflowed"); a dict or dataclass batch was already named as dirty data."""
    torch.manual_seed(0)
    model = _PosNet()
    opt = torch.optim.Adam(model.parameters(), 1e-3)
    with guard(model, opt, live=False) as g:
        for step in range(6):
            pos = torch.randn(12, 3)
            if broken and step == 3:
                pos[5] = float("nan")
            data = _GraphBatch(torch.randint(0, 10, (12,)), pos, torch.arange(12) // 4)
            loss = F.mse_loss(model(data), torch.randn(12))
            opt.zero_grad()
            loss.backward()
            opt.step()
    if not broken:
        assert g.findings == [] and g.internal_errors == []
        return
    [f] = g.findings
    assert (f.kind, f.where, f.step) == ("nonfinite-input", "input", 3)
    assert "(args[0].pos)" in f.message and "the data is dirty" in f.message
    assert f.details["counts"]["args[0].pos"]["nan"] == 3


def test_tensors_of_plain_objects_are_walked_but_not_a_modules_weights():
    from guard.tensors import iter_named_tensors

    data = _GraphBatch(torch.zeros(2), torch.ones(2, 3), None)
    names = [n for n, _ in iter_named_tensors((data, nn.Linear(2, 2), len), "args")]
    assert names == ["args[0].z", "args[0].pos"]


def _gan_generator_nan(how, use_guard):
    """A GAN whose discriminator steps first (the optimizer guard counts steps by); at iteration 10 the generator's
    loss (`how="loss"`) or only its gradients (`how="grad"`: 0 * sqrt at 0) turn NaN, its update makes the
    generator NaN, and the next iteration's fakes, the discriminator's input, are NaN."""
    torch.manual_seed(0)
    G = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 2))
    D = nn.Sequential(nn.Linear(2, 16), nn.ReLU(), nn.Linear(16, 1))
    oG, oD = torch.optim.Adam(G.parameters(), 1e-3), torch.optim.Adam(D.parameters(), 1e-3)
    bce = nn.BCEWithLogitsLoss()
    gan = nn.ModuleDict({"G": G, "D": D})
    with use_guard(gan, [oD, oG]) as g:
        for it in range(16):
            real, z = torch.randn(16, 2) + 3, torch.randn(16, 4)
            oD.zero_grad()
            fake = G(z)
            ld = bce(D(real), torch.ones(16, 1)) + bce(D(fake.detach()), torch.zeros(16, 1))
            ld.backward()
            oD.step()
            oG.zero_grad()
            lg = bce(D(fake), torch.ones(16, 1))
            if it == 10:
                lg = lg * float("nan") if how == "loss" else lg + 0.0 * torch.sqrt((fake - fake.detach()).pow(2).sum())
            lg.backward()  # the generator's backward: line GEN_BACKWARD
            oG.step()
    return g


GEN_BACKWARD = "lg.backward()  # the generator's backward: line GEN_BACKWARD"


@pytest.mark.parametrize("global_guard", [False, True])
def test_a_generator_stepping_after_the_counted_discriminator_is_the_origin_of_its_nan_loss(global_guard):
    """The window read at the discriminator's step holds the generator's whole step: its NaN loss, the update it
    broke the generator with, and the NaN fakes the discriminator then took. The loss is the origin, not "the data
    is dirty" at the discriminator's input."""
    use = (lambda m, o: guard(live=False)) if global_guard else (lambda m, o: guard(m, o, live=False))
    g = _gan_generator_nan("loss", use)
    assert [(f.kind, f.where) for f in g.findings] == [("nonfinite-loss", "loss")]
    f = g.findings[0]
    # one late: the generator's step 10 comes after the discriminator's, which guard counts
    assert f.step == 11
    line = open(__file__).read().split("\n").index("            " + GEN_BACKWARD) + 1
    assert f.source.endswith(f"test_nonfinite.py:{line}")
    assert "outputs were finite" in f.message


def test_a_generator_stepping_after_the_counted_discriminator_is_the_origin_of_its_nan_gradients():
    g = _gan_generator_nan("grad", lambda m, o: guard(m, o, live=False))
    assert [(f.kind, f.where) for f in g.findings] == [("nonfinite-grad", "G.0.weight")]
    assert g.findings[0].step == 11
    assert set(g.findings[0].details["parameters"]) >= {"G.0.weight", "G.2.bias"}


@pytest.mark.parametrize("value", [float("-inf"), float("nan")])
def test_a_mixture_component_pruned_with_its_logit_at_minus_inf_is_no_broken_update(value):
    """A Gaussian mixture whose component 0 is pruned at step 5 (its logit set to -inf under no_grad: weight exactly
    0, kept there by log_softmax's zero gradient and Adam) was reported at the end as an update that overflowed.
    A NaN written there is still a broken weight."""
    torch.manual_seed(0)
    logits, mu = nn.Parameter(torch.zeros(4)), nn.Parameter(torch.randn(4))
    opt = torch.optim.Adam([logits, mu], lr=0.05)
    x = torch.randn(64)
    with guard(live=False) as g:
        for step in range(20):
            lp = -0.5 * (x[:, None] - mu) ** 2 + F.log_softmax(logits, 0)
            loss = -torch.logsumexp(lp, 1).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            if step == (5 if value < 0 else 19):
                with torch.no_grad():
                    logits[0] = value
    assert torch.isfinite(mu).all()
    if value < 0:
        assert g.findings == [] and math.isfinite(loss.item())
    else:
        assert [f.kind for f in g.findings] == ["nonfinite-param"]


def test_finite_gradients_whose_norm_overflows_float32_are_not_called_nan():
    """Gradients of about 1e20 are finite, but their float32 sum of squares overflows: the norm is inf. They were
    reported as "NaN/Inf gradients" with the sqrt-at-0 hint; now as exploding, with their largest element."""
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    x = torch.randn(8, 4)
    with guard(model, opt, live=False) as g:
        for _ in range(3):
            loss = model(x).mean() * 1e20
            opt.zero_grad()
            loss.backward()
            assert all(torch.isfinite(p.grad).all() for p in model.parameters())
            opt.step()
    f = only(g, "nonfinite-grad")
    assert (f.where, f.step) == ("weight", 0)
    assert "overflow float32" in f.message and "NaN/Inf:" not in f.message
    assert f.details["finite_elements"] is True and 1e19 < f.details["largest_abs"] < 1e21
    assert "explode" in f.hint


def test_a_parameter_broken_by_nan_gradients_makes_no_second_finding_at_the_next_loss():
    """A mesh's heights optimised directly (no model call): acos at exactly 1 gives NaN gradients at step 0, Adam
    writes NaN into the parameter, and step 1's loss is NaN. That loss is the gradients' effect, not a new
    "NaN loss from finite outputs"."""
    torch.manual_seed(0)
    z = nn.Parameter(torch.zeros(16))
    opt = torch.optim.Adam([z], lr=1e-2)
    target = torch.randn(16) * 0.1
    with guard(live=False) as g:
        for _ in range(6):
            n = F.normalize(torch.stack([z, torch.ones(16)], -1), dim=-1)  # all equal at z = 0: dot products of 1
            angle = torch.acos((n[:-1] * n[1:]).sum(-1).clamp(max=1.0))
            loss = F.mse_loss(z, target) + 0.01 * angle.mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    assert not torch.isfinite(z).all()
    assert [(f.kind, f.where, f.step) for f in g.findings] == [("nonfinite-grad", "z", 0)]


class _PlainGMM(nn.Module):
    """A mixture's log-likelihood computed in linear space: log(sum(pi * exp(logp))) underflows to log(0)."""

    def __init__(self):
        super().__init__()
        self.mu, self.logits = nn.Parameter(torch.randn(3) * 0.1), nn.Parameter(torch.zeros(3))

    def forward(self, x):
        logp = -0.5 * (x[:, None] - self.mu) ** 2 * 50
        return torch.log((F.softmax(self.logits, 0) * logp.exp()).sum(1))


class _MaskedGMM(_PlainGMM):
    """The same, with its third component switched off by a mask (-inf on purpose)."""

    def forward(self, x):
        logp = (-0.5 * (x[:, None] - self.mu) ** 2 * 50).masked_fill(torch.tensor([False, False, True]), float("-inf"))
        return torch.log((F.softmax(self.logits, 0) * logp.exp()).sum(1))


@pytest.mark.parametrize("masked", [False, True])
def test_minus_inf_from_a_forward_that_masks_nothing_is_told_as_log_of_zero(masked):
    """Without a mask in the module's forward, the -inf is an underflow to log(0): the message no longer leads with
    "if the -inf is a mask", and the hint gives log space before the epsilon. A forward that writes a mask keeps the
    mask message."""
    torch.manual_seed(0)
    gmm = _MaskedGMM() if masked else _PlainGMM()
    opt = torch.optim.Adam(gmm.parameters(), lr=1e-2)
    x = torch.cat([torch.randn(32) * 0.1, torch.tensor([8.0])])  # one point far from every component
    with guard(gmm, opt, live=False) as g:
        for _ in range(3):
            loss = -gmm(x).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    f = only(g, "nonfinite-output")
    assert f.step == 0
    assert f.details["only_neg_inf"] is True
    if masked:
        assert "if the -inf is a mask" in f.message and "no_mask_in_forward" not in f.details
    else:
        assert "masks nothing" in f.message and f.details["no_mask_in_forward"] is True
        assert "logsumexp" in f.hint


def test_weights_made_nan_by_an_lbfgs_line_search_are_told_as_its_own_steps_not_a_change_after_the_update():
    """LBFGS moves the weights in place between its closure's evaluations inside one step(closure): weights NaN at
    such an evaluation were made by that update, not by something that changed them after it (a SAM perturbation)."""
    torch.manual_seed(0)
    x = torch.linspace(-2, 2, 200).unsqueeze(1)
    y = torch.sin(3 * x)
    model = nn.Sequential(nn.Linear(1, 32), nn.Tanh(), nn.Linear(32, 1))
    opt = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=20)

    def closure():  # no zero_grad(): the gradients pile up and the steps diverge
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        return loss

    with guard(model, opt, live=False) as g:
        for _ in range(6):
            opt.step(closure)
    params = [f for f in g.findings if f.kind == "nonfinite-param"]
    if not params and any(f.kind == "nonfinite-loss" for f in g.findings):
        # how this divergence goes depends on the CPU's kernels: on some, the squared error overflows to inf (finite
        # outputs) before any weight is NaN, which is told as such and leaves no weights NaN inside a step to tell
        pytest.skip("on this CPU the run diverges through an overflowing loss first")
    [f] = params
    assert "inside optimizer.step()" in f.message and "changed_after_update" not in f.details
    assert "SAM" not in f.hint and "line_search_fn='strong_wolfe'" in f.hint and "zero_grad()" in f.hint
    assert any(f.kind == "missing-zero-grad" for f in g.findings)


@pytest.mark.parametrize("case", ["acos", "log_std"])
def test_a_nan_loss_from_finite_outputs_names_the_restricted_domain_op_between_them(case):
    """The loss's graph between the model's outputs and the loss is walked (a few dozen nodes) for ops with a
    restricted domain: acos of a cosine rounded above 1, log of a standard deviation predicted without a positive
    parameterisation. Until stop 41 the hint was the generic log(0)/sqrt(<0)/x/0 with a clamp fix."""
    torch.manual_seed(0)
    if case == "acos":
        model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))
        x = torch.randn(4, 16) * 3
        with torch.no_grad():
            w = nn.Parameter(model(x).clone())  # class centres at the embeddings: cosines of 1, rounded above it
        opt = torch.optim.SGD([*model.parameters(), w], lr=0.1)
        y = torch.arange(4)

        def loss_fn():
            # (whether the rounding lands above 1 depends on the CPU's kernels: a nudge of 2 ulps makes it so on all)
            cos = (F.normalize(model(x)) @ F.normalize(w).T) * (1 + 2.4e-7)
            return F.cross_entropy(30 * torch.cos(torch.acos(cos) + 0.2 * F.one_hot(y, 4)), y)
    else:
        model = nn.Sequential(nn.Linear(4, 32), nn.ReLU(), nn.Linear(32, 2))
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        x = torch.randn(64, 4)

        def loss_fn():
            mu, std = model(x).chunk(2, 1)  # no softplus: about half the stds are negative
            return (torch.log(std) + 0.5 * ((x[:, :1] - mu) / std) ** 2).mean()
    with guard(model, opt, live=False) as g:
        for _ in range(2):
            loss = loss_fn()
            opt.zero_grad()
            loss.backward()
            opt.step()
    f = only(g, "nonfinite-loss")
    assert f.step == 0
    if case == "acos":
        assert f.details["ops"] == ["acos"] and "cos.clamp(-1 + 1e-7, 1 - 1e-7)" in f.hint
        assert "F.normalize(W)" in f.hint  # a value far above 1 is an unnormalised side, which no clamp fixes
    else:
        assert f.details["ops"] == ["log"] and "F.softplus(raw) + 1e-6" in f.hint


def test_nan_from_a_temperature_annealed_to_zero_names_the_zero_argument_not_the_learning_rate():
    """`F.gumbel_softmax(logits, tau=tau)` with tau annealed to 0 inside the forward: the module made NaN from finite
    inputs and finite weights; the number argument at 0 is named, with a floor for the schedule (the hint said to
    lower the learning rate or clip gradients until stop 41)."""
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(4, 6), nn.Linear(6, 4)

        def forward(self, x, tau):
            return self.b(F.gumbel_softmax(self.a(x), tau=tau))

    torch.manual_seed(0)
    model = M()
    opt = torch.optim.Adam(model.parameters())
    with guard(model, opt, live=False) as g:
        for it in range(3):
            loss = model(torch.randn(8, 4), 1.0 - it / 2).pow(2).mean()  # tau reaches 0 at the third step
            opt.zero_grad()
            loss.backward()
            opt.step()
    f = only(g, "nonfinite-output")
    assert f.step == 2 and f.details["zero_arguments"] == ["tau"] and f.details["nonfinite_params"] == []
    assert "max(tau, 0.1)" in f.hint and "called with tau equal to 0" in f.message


def test_a_time_argument_at_zero_is_no_temperature():
    """An ODE function called at t = 0.0 that makes NaN for another reason (a log of a negative state): the 0 is a
    time, not a divisor; the temperature hint would mislead."""
    class F_(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(2, 2)

        def forward(self, t, y):
            return torch.log(self.lin(y) - 100.0) * (1 + t)

    torch.manual_seed(0)
    model = F_()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with guard(model, opt, live=False) as g:
        loss = model(0.0, torch.randn(4, 2)).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
    f = only(g, "nonfinite-output")
    assert "zero_arguments" not in f.details and "tau" not in f.hint


def test_frozen_pretrained_vectors_with_nan_rows_are_named_at_the_embedding_with_the_repair_fix():
    """`Embedding.from_pretrained(vec, freeze=True)` where vec has unfilled (NaN) rows: the root was named, with "an
    earlier overflow: lower the learning rate" (until stop 41). The embedding is named, as NaN before any update."""
    vec = torch.randn(10, 4)
    vec[3] = float("nan")

    class Clf(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding.from_pretrained(vec, freeze=True)
            self.fc = nn.Linear(4, 2)

        def forward(self, x):
            return self.fc(self.emb(x).mean(1))

    model = Clf()
    opt = torch.optim.Adam(model.fc.parameters(), lr=1e-3)
    with guard(model, opt, live=False) as g:
        for _ in range(2):
            loss = F.cross_entropy(model(torch.tensor([[1, 3], [2, 4]])), torch.tensor([0, 1]))
            opt.zero_grad()
            loss.backward()
            opt.step()
    f = only(g, "nonfinite-output")
    assert (f.where, f.step) == ("emb", 0) and f.details["before_any_update"] is True
    assert "before any optimizer update" in f.message and "from_pretrained" in f.hint and "learning rate is not" in f.hint
    # weights the code writes outside any optimizer are named too (a federated server's average dividing by 0)
    assert "outside any optimizer" in f.hint and "divides by 0" in f.hint


def test_a_nan_loss_through_a_parameter_holding_minus_inf_names_the_parameter():
    """A CRF-like transition matrix with a forbidden column at -inf (on the wrong axis: every gold path goes
    through it): the gold score is -inf and the loss -inf - (-inf) = NaN. It was the generic clamp hint until stop 41."""
    class CRFish(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 3)
            self.trans = nn.Parameter(torch.zeros(3, 3))
            with torch.no_grad():
                self.trans[:, 0] = float("-inf")

        def forward(self, x):
            return self.fc(x)

    torch.manual_seed(0)
    model = CRFish()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    with guard(model, opt, live=False) as g:
        em = model(torch.randn(8, 4))
        tags = torch.zeros(8, dtype=torch.long)
        log_z = torch.logsumexp(em.unsqueeze(1) + model.trans, dim=(1, 2))
        loss = (log_z - (em[:, 0] + model.trans[tags, tags])).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    f = only(g, "nonfinite-loss")
    assert f.step == 0 and f.details["inf_parameters"] == ["trans"] and "-1e4" in f.hint


def test_nan_from_a_forward_that_fills_minus_inf_itself_gets_the_fully_masked_row_fix():
    """Attention pooling written by hand, `masked_fill(x == PAD, float('-inf'))` then softmax: a document of padding
    only is a row masked whole, NaN. The hint said to lower the learning rate or clip gradients until stop 41."""
    class AttnPool(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(10, 8, padding_idx=0)
            self.score = nn.Linear(8, 1)
            self.fc = nn.Linear(8, 2)

        def forward(self, x):
            e = self.emb(x)
            s = self.score(e).squeeze(-1).masked_fill(x == 0, float("-inf"))
            return self.fc((F.softmax(s, dim=1).unsqueeze(-1) * e).sum(1))

    torch.manual_seed(0)
    model = AttnPool()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    x = torch.randint(1, 10, (4, 5))
    x[2] = 0  # an empty document
    with guard(model, opt, live=False) as g:
        loss = F.cross_entropy(model(x), torch.tensor([0, 1, 0, 1]))
        opt.zero_grad()
        loss.backward()
        opt.step()
    f = only(g, "nonfinite-output")
    assert f.where == "AttnPool" and f.step == 0 and "masked whole" in f.message
    assert "torch.finfo(x.dtype).min" in f.hint and "learning rate" not in f.hint


def test_nan_from_a_kldivloss_given_log_probabilities_as_its_target_names_the_argument_order():
    """TRADES with the arguments swapped, `crit(softmax(adv), log_softmax(clean))`: the target holds negative values
    and target * log(target) is NaN. The hint said to lower the learning rate until stop 41."""
    torch.manual_seed(0)
    model = nn.Linear(8, 4)
    crit = nn.KLDivLoss(reduction="batchmean")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with guard(live=False) as g:
        x = torch.randn(16, 8)
        loss = crit(F.softmax(model(x + 0.01), 1), F.log_softmax(model(x), 1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    f = only(g, "nonfinite-output")
    assert f.details["module"] == "KLDivLoss" and "log_target=True" in f.hint and "learning rate" not in f.hint


def test_left_padded_histories_under_a_causal_mask_get_the_right_padding_fix_not_dropping_samples():
    """SASRec-style: left-padded item histories, a causal attn_mask and a key_padding_mask. No sample is empty, but the
    leading pad queries see only pad keys. The fix was to drop empty samples until stop 41."""
    torch.manual_seed(0)
    seq = 6
    att = nn.MultiheadAttention(8, 2, batch_first=True)
    emb = nn.Embedding(20, 8, padding_idx=0)
    model = nn.ModuleDict({"att": att, "emb": emb})
    opt = torch.optim.Adam(model.parameters())
    x = torch.tensor([[0, 0, 3, 4, 5, 6], [0, 7, 8, 9, 1, 2]])
    with guard(live=False) as g:
        h = emb(x)
        causal = torch.triu(torch.ones(seq, seq, dtype=torch.bool), 1)
        a, _ = att(h, h, h, attn_mask=causal, key_padding_mask=(x == 0))
        loss = (a * (x != 0).unsqueeze(-1)).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
    f = only(g, "nonfinite-output")
    assert f.where == "MultiheadAttention" and "left-padded" in f.message and "Pad on the right" in f.hint


class _NaiveLogSoftmax(nn.Module):
    def __init__(self):
        super().__init__()
        self.f = nn.Linear(20, 5)

    def forward(self, x):
        z = self.f(x)
        return z - torch.log(torch.exp(z).sum(-1, keepdim=True))


class _OnePassNorm(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.g = nn.Parameter(torch.ones(d))

    def forward(self, x):
        mu = x.mean(0)
        var = (x * x).mean(0) - mu * mu
        return (x - mu) / torch.sqrt(var + 1e-5) * self.g


class _UnscaledAttention(nn.Module):
    def __init__(self, d=64):
        super().__init__()
        self.q, self.k = nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x):
        return (self.q(x) @ self.k(x).transpose(-2, -1)).softmax(-1) @ x


@pytest.mark.parametrize("case", ["exp_overflow", "one_pass_variance", "fp16_overflow", "grad_rescaled_by_zero"])
def test_numerical_hints_name_what_overflowed_and_a_fix_that_works(case):
    """A numerics sweep's cases, each told with the generic clamp/epsilon/lower-the-learning-rate hint until stop 41:
    exp overflow inside a log by hand, a one-pass variance that cancels below 0, float16 attention scores above
    65504, and gradients rescaled by hand by a norm that is 0."""
    torch.manual_seed(0)
    if case == "exp_overflow":
        model = _NaiveLogSoftmax()
        batch = lambda: torch.randn(64, 20) * 300  # noqa: E731
        loss_of = lambda out: -out[:, 0].mean()  # noqa: E731
    elif case == "one_pass_variance":
        model = nn.Sequential(_OnePassNorm(2), nn.Linear(2, 1))
        batch = lambda: torch.cat([1.7e9 + torch.rand(64, 1) * 3600, torch.randn(64, 1)], 1)  # noqa: E731
        loss_of = lambda out: out.pow(2).mean()  # noqa: E731
    elif case == "fp16_overflow":
        model = nn.Sequential(nn.Linear(8, 64), _UnscaledAttention(), nn.Linear(64, 1))
        batch = lambda: torch.randn(16, 10, 8) * 200  # noqa: E731
        loss_of = lambda out: out.float().pow(2).mean()  # noqa: E731
    else:
        model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
        batch = lambda: torch.randn(16, 4)  # noqa: E731
        loss_of = lambda out: torch.relu(out - 1e6).mean()  # noqa: E731  (0: every gradient exactly 0)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with guard(model, opt, live=False) as g:
        for _ in range(2):
            if case == "fp16_overflow":
                with torch.autocast("cpu", dtype=torch.float16):
                    out = model(batch())
            else:
                out = model(batch())
            loss = loss_of(out)
            opt.zero_grad()
            loss.backward()
            if case == "grad_rescaled_by_zero":
                total = torch.sqrt(sum((p.grad ** 2).sum() for p in model.parameters()))
                for p in model.parameters():
                    p.grad.mul_(1.0 / total)
            opt.step()
    if case == "grad_rescaled_by_zero":
        f = only(g, "nonfinite-grad")
        assert "changed in place after backward()" in f.hint and "clamp_min(1e-6)" in f.hint
        return
    f = only(g, "nonfinite-output")
    assert f.step == 0 and "learning rate" not in f.hint.split(";")[0]
    if case == "exp_overflow":
        assert "torch.logsumexp" in f.hint.split(";")[0] and "overflowed" in f.message
    elif case == "one_pass_variance":
        assert "two passes" in f.hint and "sqrt" in f.message
    else:
        assert "65504" in f.hint and "1/sqrt(d)" in f.hint


def test_a_log_of_a_clamped_input_is_not_named_and_the_division_by_zero_is():
    """CenterNet's focal loss divided by `num_pos` = 0: the log's input comes from a clamp and cannot be 0, so the
    division is named (the log was, alone, until stop 41)."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 1, 1))
    opt = torch.optim.Adam(net.parameters(), 1e-3)
    with guard(net, opt, live=False) as g:
        x = torch.randn(2, 1, 8, 8)
        gt = torch.rand(2, 1, 8, 8) * 0.9
        p = net(x).sigmoid().clamp(1e-4, 1 - 1e-4)
        pos = gt.eq(1).float()
        loss = -(torch.log(1 - p) * p ** 2 * (1 - pos)).sum() / pos.sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
    f = only(g, "nonfinite-loss")
    assert f.details["ops"] == ["division"] and "add an eps to the denominator" in f.hint


def test_an_entropy_of_a_softmax_over_masked_logits_gets_the_xlogy_fix_not_log_softmax():
    """Invalid actions masked with -inf, entropy written as -(p * p.log()).sum(): 0 * -inf = NaN. The log_softmax fix
    given until stop 41 leaves it NaN; Categorical(logits).entropy() or xlogy does not."""
    torch.manual_seed(0)
    net = nn.Linear(4, 3)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    mask = torch.tensor([True, True, False])
    with guard(net, opt, live=False) as g:
        logits = net(torch.randn(8, 4)).masked_fill(~mask, float("-inf"))
        p = logits.softmax(-1)
        loss = (p * p.log()).sum(-1).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    f = only(g, "nonfinite-loss")
    assert f.details["masked"] is True and "Categorical(logits=logits)" in f.hint and "xlogy" in f.hint


def test_nan_gradients_of_a_layer_applied_twice_are_one_finding_without_the_edited_grad_hint():
    """PU-Net's shared output head applied to two branches, NaN gradients from sqrt(0) on a pairwise distance's
    diagonal, under a global guard over two loose modules. Autograd accumulates the shared head's gradient in place
    (its version counter moves, the stem's does not): no code edited .grad, so the hint does not lead with that. The
    one NaN was also told twice (at backward() and again at step(), its names in another order)."""
    torch.manual_seed(0)
    head, stem = nn.Conv1d(8, 3, 1), nn.Conv1d(3, 8, 1)
    opt = torch.optim.SGD(list(stem.parameters()) + list(head.parameters()), lr=0.1)
    with guard(live=False) as g:
        for _ in range(3):
            f = stem(torch.randn(2, 3, 16))
            y = torch.cat([head(f), head(f * 2)], 2).transpose(1, 2)
            d = (y[:, :, None] - y[:, None]).pow(2).sum(-1).sqrt()  # sqrt(0) on the diagonal
            loss = d.topk(2, dim=-1, largest=False).values[..., 1].mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    found = [f for f in g.findings if f.kind == "nonfinite-grad"]
    assert len(found) == 1 and found[0].step == 0, g.findings
    assert not found[0].hint.startswith("Their gradients were changed in place") and "add an eps" in found[0].hint


def test_a_nan_loss_from_one_over_a_zero_distance_names_the_division_not_the_sqrt():
    """FedProx with an adaptive weight mu = 1.0 / ||w - w_g||, at 0 on the first local step (the client starts at the
    global weights): inf * 0 is NaN. The sqrt of a sum of squares cannot be NaN in the forward, so it is not named;
    `1.0 / dist` is a reciprocal, named as the division it is (it was named as sqrt's E[x^2] - E[x]^2 cancellation)."""
    torch.manual_seed(0)
    local = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    ref = [p.detach().clone() for p in local.parameters()]
    opt = torch.optim.SGD(local.parameters(), lr=0.05)
    with guard(local, opt, live=False) as g:
        for _ in range(2):
            ce = F.cross_entropy(local(torch.randn(16, 8)), torch.randint(0, 3, (16,)))
            dist = torch.sqrt(sum(((p - r) ** 2).sum() for p, r in zip(local.parameters(), ref)))
            loss = ce + 0.01 * (1.0 / dist) * dist ** 2
            opt.zero_grad()
            loss.backward()
            opt.step()
    f = g.findings[0]
    assert (f.kind, f.step) == ("nonfinite-loss", 0) and f.details["ops"] == ["division"], f
    assert "add an eps to the denominator" in f.hint and "E[x^2]" not in f.hint


def test_a_kl_div_target_of_log_softmax_written_as_log_of_softmax_is_named():
    """Distillation with the teacher's log-probabilities as torch.log(F.softmax(t * 100)) under no_grad: -inf where
    the sharp softmax underflows, and kl_div(log_target=True) gives NaN there. The target is named, with
    F.log_softmax as the fix (the division in batchmean was named before)."""
    torch.manual_seed(0)
    student, teacher = nn.Linear(8, 5), nn.Linear(8, 5)
    opt = torch.optim.SGD(student.parameters(), lr=0.1)
    with guard(student, opt, live=False) as g:
        for _ in range(2):
            x = torch.randn(16, 8) * 3
            with torch.no_grad():
                t = torch.log(F.softmax(teacher(x) * 100, -1))
            loss = F.kl_div(F.log_softmax(student(x), -1), t, reduction="batchmean", log_target=True)
            opt.zero_grad()
            loss.backward()
            opt.step()
    f = g.findings[0]
    assert (f.kind, f.step) == ("nonfinite-loss", 0) and f.details["target_of"] == "kl_div"
    assert "F.log_softmax(t, -1)" in f.hint


def _task_masked_run(mask_task, smoothing=0.0):
    """Task-incremental training: 3 tasks of 2 classes, logits outside the task masked with -inf before
    cross_entropy; `mask_task(t)` is the task whose classes the mask keeps."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 6))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with guard(model, opt, live=False) as g:
        for t in range(3):
            for _ in range(4):
                y = torch.randint(2 * t, 2 * t + 2, (16,))
                x = torch.randn(16, 10)
                m = torch.full((16, 6), float("-inf"))
                m[:, 2 * mask_task(t):2 * mask_task(t) + 2] = 0
                loss = F.cross_entropy(model(x) + m, y, label_smoothing=smoothing)
                opt.zero_grad()
                loss.backward()
                opt.step()
    return g


def test_an_inf_cross_entropy_from_a_mask_hiding_the_target_class_names_the_mask_not_log_of_zero():
    """A task mask built for the previous task (off by one): every row's target logit is -inf and cross_entropy is
    +inf from task 1 on. The message names the masked target; the generic 'clamp log(0)' hint was given before."""
    g = _task_masked_run(lambda t: max(t - 1, 0))
    f = g.findings[0]
    assert (f.kind, f.where, f.step) == ("nonfinite-loss", "loss", 4), f
    assert f.details["masked_target"] and not f.details["label_smoothing"], f.details
    assert "target class" in f.message and "mask and the targets agree" in f.hint
    assert len([x for x in g.findings if x.severity != "info"]) == 1, g.findings


def test_an_inf_cross_entropy_from_label_smoothing_over_masked_classes_gets_the_finite_mask_fix():
    g = _task_masked_run(lambda t: t, smoothing=0.1)
    f = g.findings[0]
    assert (f.kind, f.step) == ("nonfinite-loss", 0) and f.details["label_smoothing"] is True, f
    assert "label_smoothing" in f.message and "torch.finfo(logits.dtype).min" in f.hint


def test_a_task_mask_that_keeps_the_target_classes_is_silent():
    g = _task_masked_run(lambda t: t)
    assert [f for f in g.findings if f.severity != "info"] == []


@pytest.mark.parametrize("all_unlabelled", [True, False])
def test_nan_from_a_cross_entropy_module_over_a_batch_of_ignored_targets_names_the_empty_mean(all_unlabelled):
    """Unlabelled samples marked -1 for `nn.CrossEntropyLoss(ignore_index=-1)`: a batch of unlabelled samples only
    makes its mean 0 / 0. Told at the loss module with the skip fix; the hint said to lower the learning rate until
    stop 43."""
    torch.manual_seed(0)
    model = nn.Linear(8, 3)
    crit = nn.CrossEntropyLoss(ignore_index=-1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with guard(live=False) as g:
        for step in range(3):
            x, y = torch.randn(16, 8), torch.randint(3, (16,))
            if all_unlabelled and step == 1:
                y[:] = -1
            else:
                y[8:] = -1
            loss = crit(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
    if not all_unlabelled:
        assert g.findings == [], g.findings
        return
    f = only(g, "nonfinite-output")
    assert (f.where, f.step, f.details["module"], f.details["all_ignored"]) == ("CrossEntropyLoss", 1, "CrossEntropyLoss", -1), f
    assert "ignore_index (-1)" in f.message and "(y != -1).any()" in f.hint and "lower the learning rate" not in f.hint


def test_a_nan_depth_from_a_division_by_a_zero_opacity_names_the_division_beside_the_exp():
    """NeRF's expected depth `(w * t).sum(-1) / acc` where a ray's opacity `acc` is 0 (0 / 0), its alphas made with
    exp(-sigma * delta): only the exp was named until stop 43 (division and exp were both dropped as too common, and
    the exp stayed when it was alone); both are named now, the division first."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 16), nn.ReLU(), nn.Linear(16, 1), nn.ReLU())
    with torch.no_grad():
        model[2].bias.fill_(-100.0)  # sigma 0 everywhere: every ray's opacity is 0
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    t = torch.linspace(2, 6, 8)
    with guard(model, opt, live=False) as g:
        sigma = model(torch.randn(4, 8, 3)).squeeze(-1)
        alpha = 1 - torch.exp(-sigma * 0.5)
        w = alpha * torch.cumprod(torch.cat([torch.ones(4, 1), 1 - alpha[:, :-1]], -1), -1)
        acc = w.sum(-1)
        depth = (w * t).sum(-1) / acc
        loss = (depth - 4.0).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    f = only(g, "nonfinite-loss")
    assert f.details["ops"] == ["division", "exp"], f.details
    assert f.hint.startswith("Look at those ops' inputs: a division by 0")


def test_nan_gradients_of_a_grid_used_twice_in_the_graph_do_not_blame_code_that_edits_grad():
    """An isotropic total-variation term `sqrt(dx ** 2 + dy ** 2)` over a zero-initialised grid: its derivative at 0
    is inf, and the grid appears several times in the graph (two slices per axis), so autograd sums its gradient in
    place and the version counter moves. The hint opened with code that edits .grad until stop 43; the uses in the
    graph account for the moves now."""
    torch.manual_seed(0)
    grid = nn.Parameter(torch.zeros(8, 8))
    opt = torch.optim.Adam([grid], lr=1e-2)
    with guard(live=False) as g:
        for _ in range(2):
            dx = grid[1:, :-1] - grid[:-1, :-1]
            dy = grid[:-1, 1:] - grid[:-1, :-1]
            loss = (grid.mean() - 1.0) ** 2 + 0.1 * torch.sqrt(dx ** 2 + dy ** 2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    f = only(g, "nonfinite-grad")
    assert not f.hint.startswith("Their gradients were changed in place"), f.hint
    assert "sqrt or a norm at exactly 0" in f.hint


@pytest.mark.parametrize("raw", [True, False])
def test_gradients_overflowing_from_raw_input_columns_name_the_input_scale(raw):
    """Incomes around 6e4 fed unstandardised to an MLP under SGD: the gradients overflow float32's norm at step 1.
    The hint opens with standardising the inputs (their mean |value| from the screened sum, `details.input_scale`) and
    speaks of SGD only. Standardised (the fix), the same run trains without a finding."""
    torch.manual_seed(133)
    income, age = torch.exp(torch.randn(1000) * 0.5 + 11), torch.rand(1000) * 50 + 20
    X = torch.stack([income, age], 1)
    y = 1e-5 * income + 0.02 * age + torch.randn(1000) * 0.1
    if not raw:
        X = (X - X.mean(0)) / X.std(0)
    model = nn.Sequential(nn.Linear(2, 16), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with guard(model, opt, live=False) as g:
        for b in torch.randperm(1000).split(50)[:10]:
            loss = F.mse_loss(model(X[b]).squeeze(1), y[b])
            opt.zero_grad(); loss.backward(); opt.step()
    if not raw:
        assert g.findings == []
        return
    f = next(f for f in g.findings if f.kind == "nonfinite-grad")
    assert f.step == 1 and f.details["finite_elements"] is True and "Adam" not in f.hint
    assert f.details["input_scale"] > 1e4 and f.hint.startswith("The model's input averages")


class _AffineCoupling(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(2, 16), nn.ReLU(), nn.Linear(16, 4))

    def forward(self, x):
        a, b = x[:, :2], x[:, 2:]
        s, t = self.net(a).chunk(2, 1)
        return torch.cat([a, b * torch.exp(torch.tanh(s)) + t], 1)


class _LogitFlow(nn.Module):
    """A flow on pixels in [0, 1] whose logit pre-processing has no alpha squeeze: a pixel at exactly 0 gives -inf."""
    def __init__(self):
        super().__init__()
        self.c = nn.ModuleList([_AffineCoupling()])

    def forward(self, x):
        z = torch.log(x) - torch.log1p(-x)
        for layer in self.c:
            z = layer(z)
        return (-0.5 * z ** 2).sum(1)


def test_minus_inf_made_by_a_logarithm_before_a_layer_is_no_mask():
    """The coupling gets -inf in the data it transforms (logit of a pixel at 0) and makes NaN from it: told as a
    logarithm of 0 made before it, with the clamp / alpha-squeeze fix, not as an attention mask's fully masked row."""
    torch.manual_seed(0)
    model = _LogitFlow()
    opt = torch.optim.Adam(model.parameters(), 1e-3)
    x = torch.rand(64, 4)
    x[3, 0] = 0.0  # (in the half the coupling's net reads: -inf through a Linear is NaN)
    with guard(model, opt, live=False) as g:
        loss = -model(x).mean()
        opt.zero_grad(); loss.backward(); opt.step()
    f = next(f for f in g.findings if f.kind == "nonfinite-output")
    assert f.where == "c.0" and "logarithm of an exact 0" in f.message and "alpha" in f.hint
    assert "masked_fill" not in f.hint
