"""One batch with targets in the wrong units (x1000) makes the gradient explode and wrecks the weights."""
import torch
from torch import nn

from guard import guard


def train(fixed: bool = False, steps: int = 40, **guard_options):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    w = torch.randn(8, 1)
    with guard(model, optimizer, **guard_options) as g:
        for step in range(steps):
            x = torch.randn(16, 8)
            y = x @ w + 0.1 * torch.randn(16, 1)
            if step == 25:
                y[3] *= 1000  # a sample recorded in millimetres instead of metres
            optimizer.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            if fixed:
                torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=5.0)
            optimizer.step()
    return g


if __name__ == "__main__":
    import sys

    train(fixed="--fixed" in sys.argv, live=True)
