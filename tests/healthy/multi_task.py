"""Multi-task learning: a shared trunk, a classification and a regression head, a weighted sum of losses."""
import torch
from torch import nn

from ._common import maybe_guard


class MultiTask(nn.Module):
    def __init__(self):
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(8, 32), nn.ReLU())
        self.cls = nn.Linear(32, 5)
        self.reg = nn.Linear(32, 1)

    def forward(self, x):
        h = self.trunk(x)
        return {"logits": self.cls(h), "value": self.reg(h).squeeze(-1)}


def train(use_guard=True, **guard_options):
    torch.manual_seed(0)
    model = MultiTask()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    with maybe_guard(use_guard, model, opt, **guard_options) as g:
        for _ in range(8):
            x = torch.randn(16, 8)
            y_cls, y_reg = torch.randint(0, 5, (16,)), torch.randn(16)
            out = model(x)
            loss = nn.functional.cross_entropy(out["logits"], y_cls) + 0.5 * nn.functional.mse_loss(out["value"], y_reg)
            opt.zero_grad()
            loss.backward()
            opt.step()
    return g, model
