"""Binary classification on logits with BCEWithLogitsLoss; probabilities only for metrics, under no_grad."""
import torch
from torch import nn

from ._common import maybe_guard


def train(use_guard=True, **guard_options):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 16), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.Adagrad(model.parameters(), lr=0.05)
    loss_fn = nn.BCEWithLogitsLoss(pos_weight=torch.tensor([2.0]))
    with maybe_guard(use_guard, model, opt, **guard_options) as g:
        for _ in range(8):
            x = torch.randn(16, 5)
            y = (x[:, :1] > 0).float()
            logits = model(x)
            loss = loss_fn(logits, y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            with torch.no_grad():
                acc = ((torch.sigmoid(logits) > 0.5).float() == y).float().mean()
    return g, model
