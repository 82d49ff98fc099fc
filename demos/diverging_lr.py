"""A learning rate too high for the model: no single spike, the loss and the gradients climb ~1.5x a step
until they overflow. The clean twin trains the same model at a hundredth of the rate."""
import torch
from torch import nn

from guard import guard


def train(fixed: bool = False, steps: int = 60, **guard_options):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 64), nn.ReLU(), nn.Linear(64, 5))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.02 if fixed else 2.0, momentum=0.9)
    w = torch.randn(10, 5)
    with guard(model, optimizer, **guard_options) as g:
        for step in range(steps):
            x = torch.randn(64, 10) * 3
            y = (x @ w + 2 * torch.randn(64, 5)).argmax(1)  # noisy labels: the loss never reaches 0
            loss = nn.functional.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    return g


if __name__ == "__main__":
    import sys

    train(fixed="--fixed" in sys.argv, live=True)
