"""`total_loss += loss` keeps every step's autograd graph alive: memory grows each step."""
import torch
from torch import nn

from guard import guard


def train(fixed: bool = False, steps: int = 12, **guard_options):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    data = [(torch.randn(16, 8), torch.randn(16, 1)) for _ in range(4)]
    with guard(model, optimizer, **guard_options) as g:
        total_loss = 0.0
        for step in range(steps):
            x, y = data[step % len(data)]
            loss = nn.functional.mse_loss(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            if fixed:
                total_loss += loss.item()
            else:
                total_loss += loss  # the bug: a tensor, with this step's graph attached
    return g


if __name__ == "__main__":
    import sys

    train(fixed="--fixed" in sys.argv, live=True)
