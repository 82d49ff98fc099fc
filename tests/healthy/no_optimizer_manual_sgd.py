"""No optimizer object: a manual SGD update under no_grad, gradients zeroed by hand."""
import torch
from torch import nn

from ._common import maybe_guard


def train(use_guard=True, **guard_options):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 8), nn.Sigmoid(), nn.Linear(8, 1))
    with maybe_guard(use_guard, model, **guard_options) as g:
        for _ in range(8):
            x, y = torch.randn(16, 3), torch.randn(16, 1)
            loss = ((model(x) - y) ** 2).mean()
            model.zero_grad()
            loss.backward()
            with torch.no_grad():
                for p in model.parameters():
                    p -= 0.1 * p.grad
    return g, model
