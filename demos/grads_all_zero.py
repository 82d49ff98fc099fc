"""Rounding the prediction inside the loss: round() has a zero gradient everywhere, so nothing trains."""
import torch
from torch import nn
import torch.nn.functional as F

from guard import guard


def train(fixed: bool = False, steps: int = 8, **guard_options):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 1))  # predicts a count
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    with guard(model, optimizer, **guard_options) as g:
        for _ in range(steps):
            x = torch.randn(32, 4)
            y = x.abs().sum(1, keepdim=True).round()
            pred = model(x)
            if not fixed:
                pred = pred.round()  # "counts are integers": but round() passes no gradient
            loss = F.mse_loss(pred, y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    return g


if __name__ == "__main__":
    import sys

    train(fixed="--fixed" in sys.argv, live=True)
