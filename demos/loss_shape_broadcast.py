"""A regression with predictions [N, 1] and targets [N]: mse_loss broadcasts to [N, N] and the model learns the mean.

`--written` makes the same mistake in a hand-written loss, ``((pred - y) ** 2).mean()``, where PyTorch says nothing.
"""
import warnings

import torch
from torch import nn

from guard import guard


def train(fixed: bool = False, steps: int = 6, written: bool = False, **guard_options):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    x = torch.randn(64, 4)
    y = x @ torch.tensor([1.0, -2.0, 0.5, 3.0])  # shape [64]
    with guard(model, optimizer, **guard_options) as g, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # PyTorch's own UserWarning about the sizes, the one that gets missed
        for step in range(steps):
            pred = model(x)  # shape [64, 1]
            target = y.view_as(pred) if fixed else y
            if written:
                loss = ((pred - target) ** 2).mean()
            else:
                loss = nn.functional.mse_loss(pred, target)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    return g


if __name__ == "__main__":
    import sys

    train(fixed="--fixed" in sys.argv, written="--written" in sys.argv, live=True)
