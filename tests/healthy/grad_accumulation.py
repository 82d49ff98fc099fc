"""Gradient accumulation: loss / N over N micro-batches, one step and one zero_grad per N."""
import torch
from torch import nn

from ._common import maybe_guard


def train(use_guard=True, **guard_options):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    accum = 4
    with maybe_guard(use_guard, model, opt, **guard_options) as g:
        opt.zero_grad()
        for i in range(16):
            x, y = torch.randn(8, 8), torch.randn(8, 1)
            loss = nn.functional.mse_loss(model(x), y) / accum
            loss.backward()
            if (i + 1) % accum == 0:
                opt.step()
                opt.zero_grad()
    return g, model
