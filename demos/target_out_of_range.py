"""Labels 1..10 (1-based, from a CSV) into a 10-class CrossEntropyLoss: class 10 does not exist."""
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from guard import guard


def train(fixed: bool = False, steps: int = 8, **guard_options):
    torch.manual_seed(0)
    x = torch.randn(128, 16)
    labels = x[:, :10].argmax(dim=1) + 1  # the file stores classes as 1..10
    if fixed:
        labels = labels - 1
    loader = DataLoader(TensorDataset(x, labels), batch_size=16, shuffle=True)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loss_fn = nn.CrossEntropyLoss()
    try:
        with guard(model, optimizer, **guard_options) as g:
            for step, (xb, yb) in zip(range(steps), loader):
                loss = loss_fn(model(xb), yb)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
    except IndexError as exc:  # on a GPU: "device-side assert triggered"
        print(f"training crashed: {exc}")
    return g


if __name__ == "__main__":
    import sys

    train(fixed="--fixed" in sys.argv, live=True)
