"""Gradient clipping by norm and by value before the step (a large learning problem kept stable)."""
import torch
from torch import nn

from ._common import maybe_guard


def train(use_guard=True, **guard_options):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 32), nn.ReLU(), nn.Linear(32, 1))
    opt = torch.optim.RMSprop(model.parameters(), lr=1e-3)
    with maybe_guard(use_guard, model, opt, **guard_options) as g:
        for i in range(10):
            x = torch.randn(16, 4)
            y = (x ** 3).sum(1, keepdim=True)
            loss = nn.functional.smooth_l1_loss(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            if i % 2:
                nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
            else:
                nn.utils.clip_grad_value_(model.parameters(), clip_value=0.5)
            opt.step()
    return g, model
