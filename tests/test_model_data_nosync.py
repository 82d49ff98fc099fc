"""Contract: the model/data checks do no host-device sync per module call or per loss call."""
import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from guard import guard

MINE = ["device-mismatch", "batchnorm", "loss-fn", "input-stats"]
SYNCING = {"__bool__", "item", "tolist", "cpu", "__float__", "__int__", "nonzero", "any", "all"}


class Record(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.names.append(getattr(func, "__name__", str(func)))
        return func(*args, **(kwargs or {}))


def test_forward_and_losses_do_not_sync():
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                          nn.Flatten(), nn.Linear(4, 3))
    x, y = torch.randn(8, 3, 8, 8), torch.randint(0, 3, (8,))
    with guard(model, checks=MINE, live=False) as g:
        with Record() as rec:
            out = model(x)
            F.cross_entropy(out, y)
            F.nll_loss(out.log_softmax(1), y)
            F.binary_cross_entropy(torch.sigmoid(out), torch.rand(8, 3))
            F.mse_loss(out, torch.zeros(8, 3))
    user = {"log_softmax", "sigmoid", "rand", "zeros", "cross_entropy", "nll_loss", "binary_cross_entropy",
            "mse_loss"}
    assert not (set(rec.names) - user) & SYNCING, sorted(set(rec.names) & SYNCING)
    assert [f.kind for f in g.findings] == ["sigmoid-before-bce"]  # the host-side check still worked


def test_every_skips_the_device_work_on_unsampled_steps():
    model = nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with guard(model, opt, every=2, live=False) as g:
        for step in range(3):
            out = model(torch.randn(8, 4))
            if step == 1:  # an unsampled step
                out = out.softmax(1)
            loss = F.cross_entropy(out, torch.randint(0, 3, (8,)))
            opt.zero_grad()
            loss.backward()
            opt.step()
    assert g.findings == []
