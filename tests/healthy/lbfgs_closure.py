"""L-BFGS with a closure: forward, zero_grad and backward run several times inside optimizer.step()."""
import torch
from torch import nn

from ._common import maybe_guard


def train(use_guard=True, **guard_options):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=4)
    x = torch.randn(32, 3)
    y = x.sum(1, keepdim=True).sin()
    with maybe_guard(use_guard, model, opt, **guard_options) as g:
        for _ in range(4):
            def closure():
                opt.zero_grad()
                loss = nn.functional.mse_loss(model(x), y)
                loss.backward()
                return loss
            opt.step(closure)
    return g, model
