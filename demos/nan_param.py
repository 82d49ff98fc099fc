"""Finite gradients, NaN weights: Adam with eps=0 divides 0 by 0 for a parameter whose gradient is zero."""
import torch
from torch import nn

from guard import guard


def train(fixed: bool = False, steps: int = 5, **guard_options):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 12), nn.ReLU(), nn.Linear(12, 2))
    with torch.no_grad():
        model[0].weight[:, 5] = 0.0
    # Feature 5 is always 0 in this dataset, so its weights get a zero gradient every step.
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2, eps=1e-8 if fixed else 0.0)
    with guard(model, optimizer, **guard_options) as g:
        for step in range(steps):
            x = torch.randn(32, 6)
            x[:, 5] = 0.0
            loss = model(x).pow(2).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    return g


if __name__ == "__main__":
    import sys

    train(fixed="--fixed" in sys.argv, live=True)
