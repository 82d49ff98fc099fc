"""`torch.tensor(loss.item(), requires_grad=True)`: backward() runs, the optimizer steps, nothing learns."""
import torch
from torch import nn

from guard import guard


def train(fixed: bool = False, steps: int = 6, **guard_options):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    criterion = nn.CrossEntropyLoss()
    data = [(torch.randn(32, 10), torch.randint(0, 3, (32,))) for _ in range(3)]
    with guard(model, optimizer, **guard_options) as g:
        for step in range(steps):
            x, y = data[step % len(data)]
            optimizer.zero_grad()
            loss = criterion(model(x), y)
            if not fixed:
                loss = torch.tensor(loss.item(), requires_grad=True)  # cut off from the model
            loss.backward()
            optimizer.step()
    return g


if __name__ == "__main__":
    import sys

    train(fixed="--fixed" in sys.argv, live=True)
