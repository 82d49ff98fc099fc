"""A classifier whose last layer starts with huge weights: the first losses are far above log(C)."""
import torch
from torch import nn

from guard import guard


def train(fixed: bool = False, steps: int = 6, **guard_options):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 10))
    if not fixed:
        nn.init.normal_(model[2].weight, std=3.0)  # a badly scaled last layer
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    criterion = nn.CrossEntropyLoss()
    data = [(torch.randn(64, 20), torch.randint(0, 10, (64,))) for _ in range(3)]
    with guard(model, optimizer, **guard_options) as g:
        for step in range(steps):
            x, y = data[step % len(data)]
            optimizer.zero_grad()
            loss = criterion(model(x), y)
            loss.backward()
            optimizer.step()
    return g


if __name__ == "__main__":
    import sys

    train(fixed="--fixed" in sys.argv, live=True)
