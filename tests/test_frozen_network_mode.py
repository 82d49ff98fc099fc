"""eval-in-train-mode for a frozen network on the gradient path whose BatchNorm runs in training mode.

A perceptual loss's feature network is frozen and put in eval() once; model.train() switches it back, and every
step overwrites its pretrained running statistics. Frozen backbones before a trained head (the feature-extraction
recipe), a GAN's discriminator frozen for the generator's step, and BatchNorm with only its affine frozen stay
silent."""
import copy

import pytest
import torch
import torch.utils.checkpoint
import torch.nn.functional as F
from torch import nn

from demos import frozen_bn_train_mode
from guard import guard


def test_demo_names_the_frozen_network_its_batchnorms_and_the_train_override():
    g = frozen_bn_train_mode.train(live=False)
    [f] = g.findings
    assert (f.kind, f.severity, f.where, f.step) == ("eval-in-train-mode", "warning", "features", 0)
    assert "frozen (every parameter requires_grad=False, in no optimizer)" in f.message
    assert "features.1 (BatchNorm2d), features.4 (BatchNorm2d)" in f.message
    assert "self.features.eval()" in f.hint and f.details["context"] == "frozen network"
    assert f.source.startswith("demos/frozen_bn_train_mode.py:")  # the line calling the frozen network


def test_fixed_twin_is_silent_and_training_is_unchanged():
    g = frozen_bn_train_mode.train(fixed=True, checks="all", live=False)
    assert g.findings == [] and g.internal_errors == []


def test_the_buggy_run_trains_the_same_numbers_as_without_guard():
    torch.manual_seed(0)
    model = frozen_bn_train_mode.Restorer(keep_features_eval=False)
    twin = copy.deepcopy(model)
    x, y = torch.randn(4, 3, 16, 16), torch.randn(4, 3, 16, 16)
    for m, guarded in ((model, True), (twin, False)):
        opt = torch.optim.Adam(m.gen.parameters(), lr=1e-3)
        with (guard(m, opt, live=False) if guarded else torch.enable_grad()):
            for _ in range(3):
                m.train()
                loss = m.loss(m(x), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
    for a, b in zip(model.state_dict().values(), twin.state_dict().values()):
        assert torch.equal(a, b)


def test_a_frozen_network_given_to_guard_as_its_own_model():
    torch.manual_seed(0)
    gen = nn.Conv2d(3, 3, 3, padding=1)
    feats = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)).requires_grad_(False)  # no .eval()
    opt = torch.optim.SGD(gen.parameters(), lr=0.01)
    with guard([gen, feats], opt, live=False) as g:
        for _ in range(3):
            x = torch.randn(8, 3, 8, 8)
            loss = F.mse_loss(feats(gen(x)), feats(x))
            opt.zero_grad()
            loss.backward()
            opt.step()
    [f] = g.findings
    assert (f.kind, f.where) == ("eval-in-train-mode", "feats")
    assert "Put it in eval mode once" in f.hint and "model.train() switches" not in f.message


def test_feature_extraction_with_a_frozen_backbone_in_training_mode_is_silent():
    """The PyTorch fine-tuning tutorial's feature extraction: the frozen backbone sees images (no gradient)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten())
    model.requires_grad_(False)
    model.append(nn.Linear(8, 2))
    opt = torch.optim.SGD(model[-1].parameters(), lr=0.1)
    with guard(model, opt, checks="all", live=False) as g:
        for _ in range(4):
            model.train()
            loss = F.cross_entropy(model(torch.randn(4, 3, 8, 8)), torch.randint(0, 2, (4,)))
            opt.zero_grad()
            loss.backward()
            opt.step()
    assert [f for f in g.findings if f.kind == "eval-in-train-mode"] == []


def test_a_discriminator_frozen_for_the_generator_step_is_silent():
    torch.manual_seed(0)
    G = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 6))
    D = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.LeakyReLU(0.2), nn.Linear(8, 1))
    opt_g, opt_d = torch.optim.Adam(G.parameters(), 1e-3), torch.optim.Adam(D.parameters(), 1e-3)
    with guard([G, D], [opt_g, opt_d], live=False) as g:
        for _ in range(4):
            real, z = torch.randn(8, 6), torch.randn(8, 4)
            D.requires_grad_(True)
            d_loss = F.softplus(-D(real)).mean() + F.softplus(D(G(z).detach())).mean()
            opt_d.zero_grad()
            d_loss.backward()
            opt_d.step()
            D.requires_grad_(False)  # CycleGAN's set_requires_grad(netD, False) for the generator's step
            g_loss = F.softplus(-D(G(z))).mean()
            opt_g.zero_grad()
            g_loss.backward()
            opt_g.step()
    assert [f for f in g.findings if f.kind == "eval-in-train-mode"] == []


def test_batchnorm_with_only_its_affine_frozen_adapts_its_statistics_silently():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 1))
    model[1].requires_grad_(False)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    with guard(model, opt, live=False) as g:
        for _ in range(3):
            loss = model(torch.randn(8, 4)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    assert g.findings == []


def test_a_backbone_unfrozen_for_fine_tuning_after_linear_probing_is_no_frozen_network():
    """LP-FT: the backbone is frozen (and its BatchNorm in eval mode) while the head is probed, then unfrozen,
    added to the optimizer and trained with its BatchNorm back in train mode: right for full fine-tuning."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU()), nn.Linear(16, 3))
    model[0].requires_grad_(False)
    opt = torch.optim.SGD(model[1].parameters(), lr=0.1)
    x, y = torch.randn(32, 8), torch.randint(0, 3, (32,))
    with guard(model, opt, live=False) as g:
        for step in range(20):
            if step == 10:
                model[0].requires_grad_(True)
                opt.add_param_group({"params": model[0].parameters(), "lr": 0.01})
            model.train()
            if step < 10:
                model[0].eval()
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
    assert g.findings == [] and g.internal_errors == []


def test_the_train_override_in_the_hint_is_python_for_a_numbered_submodule():
    torch.manual_seed(0)
    frozen = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU()).requires_grad_(False)
    model = nn.Sequential(nn.Linear(8, 8), frozen, nn.Linear(16, 1))
    opt = torch.optim.SGD([*model[0].parameters(), *model[2].parameters()], lr=0.1)
    with guard(model, opt, live=False) as g:
        for _ in range(3):
            opt.zero_grad()
            model(torch.randn(8, 8)).sum().backward()
            opt.step()
    [f] = g.findings
    assert f.where == "1" and "self[1].eval()" in f.hint, f.hint


def test_under_a_global_guard_the_frozen_part_called_alone_gets_the_train_override_too():
    """TORCH_GUARD=1 sees `self.features(out)` in the model's `loss` method as a model call of its own: the frozen
    network is still the trained model's part, which `model.train()` switches back, so the fix is the override in
    that model (not "never call train() on it": the script never does)."""
    torch.manual_seed(0)
    model = frozen_bn_train_mode.Restorer(keep_features_eval=False)
    opt = torch.optim.Adam(model.gen.parameters(), lr=1e-3)
    with guard(live=False) as g:
        for _ in range(3):
            model.train()
            x, y = torch.randn(4, 3, 16, 16), torch.randn(4, 3, 16, 16)
            loss = model.loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
    [f] = g.findings
    assert (f.kind, f.where, f.step) == ("eval-in-train-mode", "features", 0)
    assert "self.features.eval()" in f.hint and "never call train()" not in f.hint
    assert "model.train() switches" in f.message


class _FeatNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.f = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())

    def forward(self, x):
        return self.f(x)


def test_under_a_global_guard_a_frozen_root_is_told_once_not_also_its_part():
    """A perceptual net frozen as a whole (its own model, no .eval()): a global guard sees its `self.f(x)` as a call
    too, named `f`. One finding, at the outermost frozen network, with its fix (not `f`'s train() override)."""
    torch.manual_seed(0)
    gen = nn.Conv2d(3, 3, 3, padding=1)
    feat = _FeatNet().requires_grad_(False)
    opt = torch.optim.Adam(gen.parameters(), lr=1e-3)
    with guard(live=False) as g:
        for _ in range(3):
            x = torch.randn(4, 3, 8, 8)
            with torch.no_grad():
                target = feat(x)
            loss = F.mse_loss(feat(gen(x)), target)
            opt.zero_grad()
            loss.backward()
            opt.step()
    [f] = g.findings
    assert (f.kind, f.where, f.step) == ("eval-in-train-mode", "_FeatNet", 0)
    assert "Put it in eval mode once" in f.hint and "override train()" not in f.hint
    assert f.details["modules"] == ["_FeatNet.f.1"]


# --------------------------------------------------------------------------- frozen, under no_grad (stop 39)

def _probe_on_frozen_base(fix=None, steps=40, scope="models"):
    """A linear probe on a frozen base's features, computed under no_grad at every step; the base never put in
    eval mode (`fix="eval"`: it is; `fix="ema"`: it is a mean teacher, moved by an EMA written through `.data`)."""
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 32))
    base.requires_grad_(False)
    if fix == "eval":
        base.eval()
    probe = nn.Linear(32, 2)
    opt = torch.optim.Adam(probe.parameters(), 1e-2)
    x, y = torch.randn(256, 16), torch.randint(0, 2, (256,))
    with guard(*(([base, probe], opt) if scope == "models" else ()), live=False) as g:
        for _ in range(steps):
            i = torch.randint(0, 256, (32,))
            with torch.no_grad():
                h = base(x[i])
            loss = F.cross_entropy(probe(h), y[i])
            opt.zero_grad()
            loss.backward()
            opt.step()
            if fix == "ema":
                for t in base.parameters():
                    t.data.mul_(0.99).add_(0.01 * torch.randn_like(t))
    return g


@pytest.mark.parametrize("scope", ["models", "global"])
def test_a_frozen_base_run_under_no_grad_in_train_mode_at_every_step_is_told(scope):
    g = _probe_on_frozen_base(scope=scope)
    [f] = g.findings
    assert (f.kind, f.step) == ("eval-in-train-mode", 0) and f.details["frozen"] is True
    assert f.where == ("base" if scope == "models" else "Sequential")
    assert "1 (BatchNorm1d), 3 (Dropout)" in f.message and "requires_grad_(False) does not switch modes" in f.message
    assert ".eval()" in f.hint


@pytest.mark.parametrize("wrap", [False, True])
def test_a_frozen_layer_in_a_reentrant_checkpoint_is_no_evaluation(wrap):
    """Prompt tuning through frozen layers run with checkpoint(..., use_reentrant=True): the first pass runs under
    no_grad (CheckpointFunction.forward), the layer is recomputed with grad in backward and the prompt's gradient flows
    through it. Dropout on in a frozen base is model.train()'s normal behaviour: silent, also when a function of the
    user's calls the layer inside the checkpoint."""
    torch.manual_seed(0)
    layer = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.1)).requires_grad_(False)
    prompt = nn.Parameter(torch.randn(4, 8))
    opt = torch.optim.SGD([prompt], lr=0.1)
    fn = (lambda h: layer(h)) if wrap else layer
    with guard(live=False) as g:
        for _ in range(40):
            h = torch.utils.checkpoint.checkpoint(fn, prompt, use_reentrant=True)
            loss = h.pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    assert [f for f in g.findings if f.severity != "info"] == []
    assert prompt.grad is not None


@pytest.mark.parametrize("fix", ["eval", "ema"])
def test_a_frozen_base_in_eval_mode_and_a_mean_teacher_moved_through_data_are_silent(fix):
    assert _probe_on_frozen_base(fix=fix).findings == []


def test_a_network_trained_first_then_frozen_without_eval_on_the_gradient_path_is_told():
    """Two stages under one global guard: B trains, then B is frozen (no .eval()) and a stitch layer trains
    through it; B's first calls decided it was no frozen network, the second stage looks again."""
    torch.manual_seed(0)
    x, y = torch.randn(256, 16), torch.randint(0, 4, (256,))
    b = nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 4))
    with guard(live=False) as g:
        o = torch.optim.SGD(b.parameters(), lr=0.1)
        for _ in range(10):
            loss = F.cross_entropy(b(x[:64]), y[:64])
            o.zero_grad()
            loss.backward()
            o.step()
        del o
        b.requires_grad_(False)
        stitch = nn.Linear(16, 16)
        opt = torch.optim.Adam(stitch.parameters(), lr=1e-3)
        for _ in range(20):
            loss = F.cross_entropy(b(stitch(x[:64])), y[:64])
            opt.zero_grad()
            loss.backward()
            opt.step()
    [f] = g.findings
    assert f.kind == "eval-in-train-mode" and f.details["context"] == "frozen network" and 10 <= f.step <= 12
