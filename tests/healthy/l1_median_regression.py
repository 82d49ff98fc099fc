"""L1 (median) regression with Adam: the output bias's gradient is often exactly 0 (as many residuals above as below)."""
import torch
from torch import nn

from ._common import maybe_guard


def train(use_guard=True, **guard_options):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    with maybe_guard(use_guard, model, opt, **guard_options) as g:
        for _ in range(30):
            x, y = torch.randn(16, 4), torch.randn(16, 1)
            loss = nn.functional.l1_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
    return g, model
