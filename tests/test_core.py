"""The Guard API: lifecycle, modes, selection, de-duplication, source lines, bad configuration."""
import io
import os
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import guard as guard_pkg
from guard import Finding, Guard, GuardError, guard
from guard.checks import registry
from guard.config import ConfigError


def mlp():
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def nan_step(model, opt, step, bad_step):
    x = torch.randn(8, 4)
    if step == bad_step:
        x[0, 0] = float("nan")
    loss = model(x).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()


def test_context_manager_reports_and_counts_steps():
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with guard(model, opt, live=False) as g:
        assert g.active
        for s in range(5):
            nan_step(model, opt, s, bad_step=2)
    assert not g.active
    assert g.step == 5
    kinds = [f.kind for f in g.findings]
    assert kinds[0] == "nonfinite-input"
    f = g.findings[0]
    assert f.where == "input" and f.step == 2 and f.severity == "error"
    assert f.source and f.source.startswith("tests" + os.sep + "test_core.py:")


def test_start_close_idempotent_and_restart():
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    g = guard(model, opt, live=False)
    assert g.start() is g
    assert g.start() is g  # second start does nothing
    nan_step(model, opt, 0, bad_step=0)
    g.close()
    g.close()
    assert [f.kind for f in g.findings][:1] == ["nonfinite-input"]
    nan_step(model, opt, 0, bad_step=-1)  # closed: nothing recorded
    assert g.step == 1
    g.start()  # a restart begins a new run
    assert g.findings == [] and g.step == 0
    g.close()


def test_decorator_runs_function_under_guard():
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    g = guard(model, opt, live=False)

    @g
    def train(n):
        for s in range(n):
            nan_step(model, opt, s, bad_step=1)
        return "done"

    assert train(3) == "done"
    assert not g.active
    assert g.findings[0].kind == "nonfinite-input" and g.findings[0].step == 1


def test_bare_decorator_uses_a_global_guard():
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    @guard
    def train():
        for s in range(3):
            nan_step(model, opt, s, bad_step=1)

    train()
    assert train.guard.findings[0].kind == "nonfinite-input"


def test_mode_raise_raises_at_user_call_site_with_finding():
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with pytest.raises(GuardError) as info:
        with guard(model, opt, mode="raise", live=False):
            for s in range(4):
                nan_step(model, opt, s, bad_step=2)
    f = info.value.finding
    assert isinstance(f, Finding) and f.kind == "nonfinite-input" and f.step == 2
    assert "nonfinite-input" in str(info.value) and f.hint in str(info.value)
    # raised before the bad update: the weights are still finite
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_record_mode_is_silent_but_collects(capsys):
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with guard(model, opt, mode="record", live=False) as g:
        for s in range(3):
            nan_step(model, opt, s, bad_step=0)
    assert g.findings
    assert capsys.readouterr().err == ""


def test_repeats_are_counted_not_reprinted():
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # weights stay finite; the data is dirty every step
    stream = io.StringIO()
    g = guard(model, opt, live=True)
    g.console().live = True
    g.console()._stream = stream
    with g:
        for s in range(4):
            nan_step(model, opt, s, bad_step=s)
    f = [f for f in g.findings if f.kind == "nonfinite-input"][0]
    assert f.count == 4 and f.step == 0 and f.last_step == 3
    assert stream.getvalue().count("nonfinite-input at input") == 1
    assert "\x1b[" not in stream.getvalue()  # no ANSI codes off a TTY


def test_checks_selection_removes_kinds_and_checks():
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with guard(model, opt, checks=["default", "-nonfinite-input"], live=False) as g:
        for s in range(3):
            nan_step(model, opt, s, bad_step=1)
    assert "nonfinite-input" not in [f.kind for f in g.findings]
    with guard(model, opt, checks=["-nonfinite"], live=False) as g2:
        nan_step(model, opt, 0, bad_step=0)
    assert g2.findings == [] and not any(c.name == "nonfinite" for c in g2.checks)
    assert guard(checks="all").config.kinds >= guard().config.kinds


@pytest.mark.parametrize("kwargs, needle", [
    ({"checks": ["no-such-check"]}, "unknown check 'no-such-check'"),
    ({"checks": 5}, "not a checks selection"),
    ({"mode": "loud"}, "mode='loud' is not a mode; allowed: warn, raise, record"),
    ({"every": 0}, "every=0"),
    ({"every": "x"}, "every='x'"),
    ({"live": "maybe"}, "live='maybe'"),
    ({"report": ""}, "report=''"),
])
def test_bad_arguments_give_one_clear_line(kwargs, needle):
    with pytest.raises(ConfigError) as info:
        guard(**kwargs)
    msg = str(info.value)
    assert needle in msg and "\n" not in msg and "allowed" in msg


def test_non_module_and_non_optimizer_are_refused():
    with pytest.raises(ConfigError, match="model=str object is not an nn.Module"):
        guard("resnet")
    with pytest.raises(ConfigError, match="optimizer=Linear object is not a torch.optim.Optimizer"):
        guard(mlp(), nn.Linear(1, 1))
    with pytest.raises(ConfigError, match="not an nn.Module"):
        guard_pkg.wrap(42)


def test_lists_of_models_and_optimizers():
    a, b = mlp(), mlp()
    oa, ob = torch.optim.SGD(a.parameters(), lr=0.01), torch.optim.SGD(b.parameters(), lr=0.01)
    with guard([a, b], [oa, ob], live=False) as g:
        for s in range(3):
            nan_step(a, oa, s, bad_step=-1)
            nan_step(b, ob, s, bad_step=1)
    assert g.step == 3  # the first optimizer's steps are the unit
    assert [f.kind for f in g.findings][:1] == ["nonfinite-input"]


def test_nan_weights_after_an_unscreened_step_do_not_claim_finite_gradients():
    # every=2: a NaN input at step 1 (not screened) makes NaN gradients and NaN weights; at step 2 only the
    # weights are seen. The finding must not say the gradients were finite: they were not looked at.
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with guard(model, opt, every=2, live=False) as g:
        for s in range(4):
            nan_step(model, opt, s, bad_step=1)
    f = g.findings[0]
    assert f.kind == "nonfinite-param" and f.step == 1 and f.details["grads_screened"] is False
    assert "step 1 was not screened: every=2" in f.message and "although the gradients were finite" not in f.hint


def test_an_optimizer_replaced_mid_run_takes_over_the_step_count():
    # Adam for 20 steps, then SGD; the old Adam stays referenced (a list of past optimizers): its steps
    # were the unit, so guard's step stood still at 20 and a NaN at step 40 was reported at step 20.
    torch.manual_seed(0)
    model = mlp()
    history = []
    with guard(model, live=False) as g:
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        for step in range(60):
            if step == 20:
                history.append(opt)
                opt = torch.optim.SGD(model.parameters(), lr=0.01)
            nan_step(model, opt, step, bad_step=40)
    assert g.step == 60
    assert [(f.kind, f.step) for f in g.findings] == [("nonfinite-input", 40)]
    # SGD steps every parameter Adam stepped: its successor, counted after two steps without Adam
    assert any("SGD has stepped 2 times" in n and "which it replaces" in n for n in g.notices), g.notices


def test_a_search_of_many_trials_tells_the_first_hand_overs_and_keeps_the_rest_in_the_dump(capsys):
    """A successive-halving search (a new model and optimizer per trial, under one global guard): each trial's
    optimizer takes the step count over; thirteen lines of it were noise. The first two are told, then one line
    says the rest are in the report's notices."""
    torch.manual_seed(0)
    trials = []  # every trial's model and optimizer kept, to pick the best at the end
    with guard(live=True) as g:
        for trial in range(6):
            model = mlp()
            opt = torch.optim.Adam(model.parameters(), lr=1e-3)
            trials.append((model, opt))
            for step in range(10):
                nan_step(model, opt, step, bad_step=-1)
    err = capsys.readouterr().err
    handed = [n for n in g.notices if "has stepped" in n and "count from now on" in n]
    assert len(handed) == 5, g.notices
    assert err.count("count from now on") == 2, err
    assert err.count("listed in the report's notices, not here") == 1, err
    assert g.findings == []


@pytest.mark.parametrize("keep_old", [True, False])
def test_an_optimizer_recreated_over_the_same_model_is_followed_under_a_model_guard(keep_old):
    """guard(model, opt), then a new optimizer over the same model (resume: state loaded; or a new round): its steps
    are the steps (guard hooked the given optimizer only, so they went unseen and the count stood still)."""
    torch.manual_seed(0)
    model = mlp()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    old = []
    with guard(model, opt, live=False) as g:
        for step in range(4):
            nan_step(model, opt, step, bad_step=-1)
        opt2 = torch.optim.Adam(model.parameters(), lr=1e-3)
        opt2.load_state_dict(opt.state_dict())
        if keep_old:
            old.append(opt)
        del opt
        for step in range(4, 16):
            nan_step(model, opt2, step, bad_step=10)
    assert g.step == 16
    assert [(f.kind, f.step) for f in g.findings] == [("nonfinite-input", 10)]


def test_the_optimizer_that_counted_before_takes_the_count_back_when_it_steps_again():
    """A linear probe trained mid-run with its own optimizer on the model's features (a global guard): after 16 of
    its steps it counts the steps; when training resumes, the model's optimizer counts again at once."""
    torch.manual_seed(0)
    model = mlp()
    probe = nn.Linear(model(torch.randn(1, 4)).shape[1], 2)
    with guard(live=False) as g:
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        popt = torch.optim.SGD(probe.parameters(), lr=0.01)
        for step in range(10):
            nan_step(model, opt, step, bad_step=-1)
        for _ in range(20):
            with torch.no_grad():
                feats = model(torch.randn(8, 4))
            loss = probe(feats).pow(2).mean()
            popt.zero_grad()
            loss.backward()
            popt.step()
        before = g.step
        for step in range(10):
            nan_step(model, opt, step, bad_step=-1)
    assert any("SGD has stepped 16 times" in n for n in g.notices), g.notices
    assert any("steps again: its steps count again" in n for n in g.notices), g.notices
    assert g.step - before == 10 and g.findings == []


def test_a_critic_stepping_five_times_per_generator_step_does_not_take_over():
    torch.manual_seed(0)
    G, D = mlp(), mlp()
    og, od = torch.optim.SGD(G.parameters(), lr=0.01), torch.optim.SGD(D.parameters(), lr=0.01)
    with guard([G, D], [og, od], live=False) as g:
        for _ in range(6):
            for _ in range(5):
                nan_step(D, od, 0, bad_step=-1)
            nan_step(G, og, 0, bad_step=-1)
    assert g.step == 6 and g.notices == []



def test_models_trained_one_after_another_under_a_global_guard_count_every_step():
    """k-fold style: each model is kept (a list of the fold's models), evaluated once, then the next trains."""
    torch.manual_seed(0)
    kept = []
    with guard(live=False) as g:
        for fold in range(3):
            model = mlp()
            opt = torch.optim.SGD(model.parameters(), lr=0.01)
            kept.append((model, opt))
            for step in range(12):
                nan_step(model, opt, step, bad_step=11 if fold == 2 else -1)
            with torch.no_grad():
                model(torch.randn(8, 4))
    assert g.step == 36
    assert [(f.kind, f.step) for f in g.findings] == [("nonfinite-input", 35)]
    assert len(g.notices) == 2 and all("no longer called (training moved on: the next model" in n for n in g.notices)


def test_several_optimizers_stepping_one_set_of_parameters_at_every_step_take_no_turns():
    """A deep ensemble whose four optimizers were all built over member 0 (the bug): each steps at every
    iteration. None is the primary's successor, so steps are iterations, not four per iteration."""
    torch.manual_seed(0)
    members = [mlp() for _ in range(4)]
    opts = [torch.optim.AdamW(members[0].parameters(), lr=1e-3) for _ in members]  # the bug: members[i]
    with guard(live=False) as g:
        for _ in range(20):
            x, y = torch.randn(8, 4), torch.randint(0, 2, (8,))
            for m, opt in zip(members, opts):
                loss = F.cross_entropy(m(x), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
    assert g.step == 20 and g.notices == []
    assert "param-not-in-optimizer" in [f.kind for f in g.findings]


class _Net(nn.Module):
    """A GAN's networks often share their inner names (DCGAN: both have `main`)."""

    def __init__(self, n_in, n_out):
        super().__init__()
        self.main = nn.Sequential(nn.Linear(n_in, 8), nn.ReLU(), nn.Linear(8, n_out))

    def forward(self, x):
        return self.main(x)


class Gen(_Net):
    pass


class Disc(_Net):
    pass


def _gan(make_guard, bad_at=1):
    """Steps of a GAN where D's output bias turns NaN at step `bad_at`; the guard from make_guard(G, D, og, od)."""
    torch.manual_seed(0)
    netG, netD = Gen(4, 6), Disc(6, 1)
    og, od = torch.optim.Adam(netG.parameters()), torch.optim.Adam(netD.parameters())
    with make_guard(netG, netD, og, od) as g:
        for step in range(3):
            fake = netG(torch.randn(8, 4))
            if step == bad_at:
                with torch.no_grad():
                    netD.main[2].bias.fill_(float("nan"))
            od.zero_grad()
            netD(torch.randn(8, 6)).mean().backward()
            od.step()
            og.zero_grad()
            netD(fake).mean().backward()
            og.step()
    return g


def test_several_models_are_told_apart_by_their_variable_names():
    g = _gan(lambda netG, netD, og, od: guard([netG, netD], [od, og], live=False))
    f = g.findings[0]
    assert (f.kind, f.where, f.step) == ("nonfinite-param", "netD.main.2.bias", 1)
    paths = [m["path"] for m in g.record.modules]
    assert {"netG.main.0", "netD.main.0", "netG", "netD"} <= set(paths)  # both models in the module table


def test_several_models_without_one_name_each_get_their_class_names():
    def two_names(G, D, og, od):
        netG, netD = G, D  # two names for each model: which one the user thinks of is unknown
        return guard([netG, netD], [od, og], live=False)

    assert _gan(two_names).findings[0].where == "Disc.main.2.bias"
    assert _gan(lambda *a: guard([a[0], a[1]], [a[3], a[2]], live=False)).findings[0].where == "Disc.main.2.bias"
    models = [mlp(), mlp()]
    with guard([models[0], models[1]], live=False) as g:
        pass
    assert g.watched.labels == ["Sequential[0]", "Sequential[1]"]  # one class: numbered


def test_a_global_guard_labels_a_second_model_whose_paths_are_taken():
    g = _gan(lambda *a: guard(live=False))
    assert g.findings[0].where == "Disc.main.2.bias"  # the first model keeps its plain names
    paths = {m["path"] for m in g.record.modules}
    assert {"main.0", "Gen", "Disc.main.0", "Disc"} <= paths


def test_contained_check_failure_is_reported_once_and_training_continues():
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    g = guard(model, opt, live=False)
    with g:
        check = next(c for c in g.checks if c.name == "nonfinite")

        def boom(*a, **k):
            raise RuntimeError("check bug")

        check.on_forward = boom
        g.router.rebuild()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for s in range(3):
                nan_step(model, opt, s, bad_step=-1)
    assert g.step == 3
    assert len(g.internal_errors) == 1 and g.internal_errors[0]["check"] == "nonfinite"
    assert "check bug" in g.internal_errors[0]["error"]
    msgs = [str(w.message) for w in caught if issubclass(w.category, guard_pkg.GuardInternalWarning)]
    assert len(msgs) == 1 and "switched off" in msgs[0]
    assert g.findings == []


def test_wrap_passes_attributes_and_state_dict_through():
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    wrapped = guard.wrap(model, opt, live=False)
    try:
        assert wrapped[0] is model[0]  # attribute/indexing passes through
        assert list(wrapped.state_dict()) == list(model.state_dict())  # no "module." prefix
        assert not any(k.startswith("module.") for k in wrapped.state_dict())
        wrapped.load_state_dict(mlp().state_dict())
        assert len(list(wrapped.parameters())) == 4
        x = torch.randn(8, 4)
        x[1, 1] = float("inf")
        loss = wrapped(x).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
        wrapped.eval()
        assert not model.training
        assert wrapped.guard.active
    finally:
        wrapped.guard.close()
    assert wrapped.guard.findings[0].kind == "nonfinite-input"


def test_every_samples_device_checks():
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with guard(model, opt, every=3, live=False) as g:
        for s in range(7):
            if s in (1, 4):  # dirty batches only on steps that are not sampled
                with torch.no_grad():
                    model(torch.full((2, 4), float("nan")))
            nan_step(model, opt, s, bad_step=-1)
    assert g.findings == []
    with guard(model, opt, every=3, live=False) as g:
        for s in range(7):
            nan_step(model, opt, s, bad_step=3)
    assert g.findings[0].step == 3
    assert [e["step"] for e in g.timeline] == [0, 3, 6]


def test_registry_kinds_are_in_the_vocabulary():
    from guard.findings import KINDS

    for name, cls in registry().items():
        assert cls.kinds, name
        for kind in cls.kinds:
            assert kind in KINDS, (name, kind)


def test_global_guard_with_accumulation_before_the_first_step_counts_optimizer_steps():
    model = nn.Linear(3, 1)
    with guard(live=False) as g:  # the optimizer is created after the guard started: unknown until it steps
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for s in range(4):
            for micro in range(2):
                x = torch.randn(2, 3)
                if s == 0 and micro == 1:
                    x[0, 0] = float("nan")
                model(x).sum().backward()
            opt.step()
            opt.zero_grad()
            with torch.no_grad():
                model.weight.nan_to_num_(0.0)
                model.bias.nan_to_num_(0.0)
    assert g.step == 4
    assert [e["step"] for e in g.timeline] == [0, 1, 2, 3]
    assert g.findings[0].kind == "nonfinite-input" and g.findings[0].step == 0


def _inf_grad_run(checks):
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # the weights stay as they are
    with torch.no_grad():
        model.weight.zero_()
    with guard(model, opt, checks=checks, live=False) as g:
        for _ in range(2):
            loss = torch.sqrt(model.weight.abs()).sum() + model(torch.ones(2, 3)).sum()  # d sqrt(|w|)/dw at 0: inf
            opt.zero_grad()
            loss.backward()
            opt.step()
    return g


def test_selection_by_check_name_turns_off_only_that_check():
    g = _inf_grad_run(["default", "-amp-scaler"])
    assert "amp-scaler" not in [c.name for c in g.checks] and "nonfinite" in [c.name for c in g.checks]
    assert [f.kind for f in g.findings] == ["nonfinite-grad"]  # nonfinite still reports the kind amp-scaler shares
    assert g.findings[0].where == "weight"


def test_a_kind_can_be_turned_off_on_its_own():
    g = _inf_grad_run(["default", "-nonfinite-grad"])
    assert "nonfinite" in [c.name for c in g.checks] and "nonfinite-grad" not in g.config.kinds
    assert [f.kind for f in g.findings] == []
    assert "nonfinite-input" in g.config.kinds  # the check's other kinds stay on


class _LitLike(nn.Module):
    """A LightningModule's shape: training_step calls its submodule; the module itself is never called."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))

    def training_step(self, x):
        return self.net(x).pow(2).mean()


def test_a_global_guard_names_a_submodule_called_from_its_owners_method_by_its_attribute_path():
    torch.manual_seed(0)
    lit = _LitLike()
    opt = torch.optim.SGD(lit.parameters(), lr=0.1)
    with guard(live=False) as g:
        for step in range(4):
            x = torch.randn(8, 4)
            if step == 2:
                x[0, 0] = float("inf")  # overflows nothing: Linear passes it on; the input is named
            loss = lit.training_step(x)
            opt.zero_grad()
            loss.backward()
            opt.step()
    f = [f for f in g.findings if f.kind == "nonfinite-input"][0]
    assert f.step == 2 and "the input to net contains" in f.message
    assert g.param_name(lit.net[0].weight) == "net.0.weight"
