"""Loss functions bound to the user's own names before the guard starts (`from torch.nn.functional import
cross_entropy`, `LOSS = partial(F.mse_loss, ...)`, a table of losses) are checked like `F.cross_entropy(...)`,
and the names are put back when the guard closes."""
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.functional import cross_entropy, mse_loss

from guard import guard

MSE = partial(F.mse_loss, reduction="mean")
LOSSES = {"mse": F.mse_loss, "ce": F.cross_entropy}
ORIGINAL = (cross_entropy, mse_loss, MSE.func, LOSSES["mse"], LOSSES["ce"])


def _fit(loss, steps=3):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(16, 8), torch.randn(16)
    with guard(model, opt, live=False) as g:
        for _ in range(steps):
            opt.zero_grad()
            loss(model(x), y).backward()  # [16, 1] against [16]: broadcast to [16, 16]
            opt.step()
    return g


def test_a_loss_bound_before_the_guard_started_is_checked():
    for name, loss in [("from-import", lambda o, y: mse_loss(o, y)), ("partial", lambda o, y: MSE(o, y)),
                       ("table", lambda o, y: LOSSES["mse"](o, y))]:
        g = _fit(loss)
        assert [(f.kind, f.step) for f in g.findings] == [("loss-shape-broadcast", 0)], name


def test_softmax_into_a_from_imported_cross_entropy_is_found():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 4), nn.Softmax(dim=1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with guard(model, opt, live=False) as g:
        for _ in range(3):
            opt.zero_grad()
            cross_entropy(model(torch.randn(16, 8)), torch.randint(0, 4, (16,))).backward()
            opt.step()
    assert [f.kind for f in g.findings] == ["softmax-before-cross-entropy"]


def test_the_users_names_are_put_back_when_the_guard_closes():
    g = guard(nn.Linear(2, 2), live=False).start()
    try:
        assert cross_entropy is F.cross_entropy and getattr(cross_entropy, "_guard_patch", False)
        assert MSE.func is F.mse_loss and LOSSES["ce"] is F.cross_entropy
        assert MSE.keywords == {"reduction": "mean"}
    finally:
        g.close()
    assert (cross_entropy, mse_loss, MSE.func, LOSSES["mse"], LOSSES["ce"]) == ORIGINAL
    assert not getattr(cross_entropy, "_guard_patch", False) and MSE.keywords == {"reduction": "mean"}


def test_healthy_losses_through_the_same_names_are_silent():
    torch.manual_seed(0)
    model = nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(16, 8), torch.randn(16, 1)
    with guard(model, opt, live=False, checks="all") as g:
        for _ in range(4):
            opt.zero_grad()
            (MSE(model(x), y) + mse_loss(model(x), y) + LOSSES["mse"](model(x), y)).backward()
            opt.step()
    assert g.findings == [] and g.internal_errors == []


def test_a_name_bound_while_an_earlier_guard_ran_is_checked_by_the_next_one():
    import types

    with guard(nn.Linear(2, 2), live=False):
        late = types.ModuleType("late_user_module")  # imported while patched: it binds that guard's wrapper
        late.__file__ = __file__
        exec("from torch.nn.functional import mse_loss", late.__dict__)
    import sys

    sys.modules["late_user_module"] = late
    try:
        stale = late.mse_loss
        assert getattr(stale, "_guard_patch", False)
        g = _fit(lambda o, y: late.mse_loss(o, y))
        assert [(f.kind, f.step) for f in g.findings] == [("loss-shape-broadcast", 0)]
        assert late.mse_loss is stale  # put back as it was
    finally:
        del sys.modules["late_user_module"]


class _WithLoss(nn.Module):
    """A model holding its loss function as an attribute (a LightningModule's `self.loss_fn = F.mse_loss`)."""

    def __init__(self):
        super().__init__()
        self.net = nn.Linear(8, 1)
        self.loss_fn = F.mse_loss
        self.smooth = partial(F.smooth_l1_loss, beta=0.5)

    def step(self, x, y, which):
        out = self.net(x)
        return self.loss_fn(out, y) if which == "attr" else self.smooth(out, y)


def test_a_loss_held_as_an_attribute_of_the_watched_model_is_checked():
    for which in ("attr", "partial"):
        torch.manual_seed(0)
        model = _WithLoss()
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        with guard(model, opt, live=False) as g:
            for _ in range(3):
                opt.zero_grad()
                model.step(torch.randn(16, 8), torch.randn(16), which).backward()  # [16, 1] vs [16]
                opt.step()
        assert [(f.kind, f.step) for f in g.findings] == [("loss-shape-broadcast", 0)], which
        assert model.loss_fn is F.mse_loss and not getattr(model.loss_fn, "_guard_patch", False)
        assert model.smooth.func is F.smooth_l1_loss
