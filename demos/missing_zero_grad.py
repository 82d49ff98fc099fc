"""No `optimizer.zero_grad()` in the loop: every step applies the sum of all earlier gradients."""
import torch
from torch import nn

from guard import guard


def train(fixed: bool = False, steps: int = 8, **guard_options):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 32), nn.Tanh(), nn.Linear(32, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    criterion = nn.CrossEntropyLoss()
    data = [(torch.randn(32, 10), torch.randint(0, 3, (32,))) for _ in range(4)]
    with guard(model, optimizer, **guard_options) as g:
        for step in range(steps):
            x, y = data[step % len(data)]
            if fixed:
                optimizer.zero_grad()
            loss = criterion(model(x), y)
            loss.backward()
            optimizer.step()
    return g


if __name__ == "__main__":
    import sys

    train(fixed="--fixed" in sys.argv, live=True)
