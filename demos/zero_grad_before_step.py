"""`zero_grad()` between `backward()` and `step()`: every update applies no gradient and nothing learns."""
import torch
from torch import nn

from guard import guard


def train(fixed: bool = False, steps: int = 6, **guard_options):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 3))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    criterion = nn.CrossEntropyLoss()
    data = [(torch.randn(32, 10), torch.randint(0, 3, (32,))) for _ in range(3)]
    with guard(model, optimizer, **guard_options) as g:
        for step in range(steps):
            x, y = data[step % len(data)]
            if fixed:
                optimizer.zero_grad()
            loss = criterion(model(x), y)
            loss.backward()
            if not fixed:
                optimizer.zero_grad()  # wipes the gradients just computed
            optimizer.step()
    return g


if __name__ == "__main__":
    import sys

    train(fixed="--fixed" in sys.argv, live=True)
