"""Dirty data: a few NaN values in the dataset poison training (seed note 10, cause 3)."""
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from guard import guard


def train(fixed: bool = False, steps: int = 12, **guard_options):
    torch.manual_seed(0)
    x = torch.randn(192, 8)
    y = x.sum(dim=1, keepdim=True)
    x[150, 3] = float("nan")  # one corrupt sample, as in a CSV with an empty cell
    if fixed:
        keep = torch.isfinite(x).all(dim=1)
        x, y = x[keep], y[keep]
    loader = DataLoader(TensorDataset(x, y), batch_size=16)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    with guard(model, optimizer, **guard_options) as g:
        for step, (xb, yb) in zip(range(steps), loader):
            loss = nn.functional.mse_loss(model(xb), yb)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    return g


if __name__ == "__main__":
    import sys

    train(fixed="--fixed" in sys.argv, live=True)
