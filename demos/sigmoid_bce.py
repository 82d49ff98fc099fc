"""A binary classifier applies sigmoid and then BCELoss: unstable where BCEWithLogitsLoss is not."""
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from guard import guard


def train(fixed: bool = False, steps: int = 8, **guard_options):
    torch.manual_seed(0)
    x = torch.randn(128, 10)
    y = (x[:, 0] + x[:, 1] > 0).float().unsqueeze(1)
    loader = DataLoader(TensorDataset(x, y), batch_size=16, shuffle=True)
    model = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 1))
    if fixed:
        loss_fn = nn.BCEWithLogitsLoss()
    else:
        model.append(nn.Sigmoid())  # BUG: probabilities into BCELoss
        loss_fn = nn.BCELoss()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with guard(model, optimizer, **guard_options) as g:
        for step, (xb, yb) in zip(range(steps), loader):
            loss = loss_fn(model(xb), yb)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    return g


if __name__ == "__main__":
    import sys

    train(fixed="--fixed" in sys.argv, live=True)
