"""Two backward passes through one graph (retain_graph=True), and a gradient penalty (create_graph=True)."""
import torch
from torch import nn

from ._common import maybe_guard


def train(use_guard=True, **guard_options):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with maybe_guard(use_guard, model, opt, **guard_options) as g:
        for _ in range(6):
            x = torch.randn(8, 4, requires_grad=True)
            out = model(x)
            opt.zero_grad()
            out[:, 0].pow(2).mean().backward(retain_graph=True)
            out[:, 1].abs().mean().backward()
            (gx,) = torch.autograd.grad(model(x).sum(), x, create_graph=True)
            penalty = 0.1 * (gx.norm(2, dim=1) - 1).pow(2).mean()
            penalty.backward()
            opt.step()
    return g, model
