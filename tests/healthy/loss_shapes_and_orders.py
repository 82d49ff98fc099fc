"""Regression/BCE losses with equal shapes, a scalar weight, a deliberate expand and a scalar target; zero_grad
after step; validation in eval mode followed by model.train(); a cross-entropy head with label smoothing."""
import warnings

import torch
import torch.nn.functional as F
from torch import nn

from ._common import maybe_guard


class TwoHeads(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(6, 32), nn.ReLU(), nn.Dropout(0.1))
        self.reg = nn.Linear(32, 1)
        self.cls = nn.Linear(32, 4)

    def forward(self, x):
        h = self.body(x)
        return self.reg(h), self.cls(h)


def train(use_guard=True, **guard_options):
    torch.manual_seed(0)
    model = TwoHeads()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with maybe_guard(use_guard, model, opt, **guard_options) as g:
        for epoch in range(2):
            model.train()
            for _ in range(4):
                x = torch.randn(16, 6)
                y = x.sum(dim=1, keepdim=True)  # [16, 1], same shape as the prediction
                c = torch.randint(0, 4, (16,))
                reg, logits = model(x)
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", UserWarning)  # PyTorch's size warning for the scalar target
                    to_zero = F.l1_loss(reg, torch.tensor(0.0))
                loss = (F.mse_loss(reg, y)
                        + F.smooth_l1_loss(reg, y.mean().expand_as(reg))  # a deliberate expand
                        + 0.01 * to_zero  # a scalar target
                        + F.binary_cross_entropy_with_logits(reg, (y > 0).float(), weight=torch.tensor(0.5))
                        + F.cross_entropy(logits, c, label_smoothing=0.1))
                loss.backward()
                opt.step()
                opt.zero_grad()  # after the step
            model.eval()
            with torch.no_grad():
                x = torch.randn(16, 6)
                val = F.mse_loss(model(x)[0], x.sum(dim=1, keepdim=True)).item()
    return g, model
