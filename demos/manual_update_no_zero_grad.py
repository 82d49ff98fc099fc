"""A hand-written update (`p -= lr * p.grad`, no optimizer) that never clears the gradients: every
backward() adds onto gradients that were already applied, so each update sums all earlier steps'."""
import torch
from torch import nn

from guard import guard


def train(fixed: bool = False, steps: int = 8, **guard_options):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 32), nn.Tanh(), nn.Linear(32, 1))
    data = [(torch.randn(32, 10), torch.randn(32, 1)) for _ in range(4)]
    lr = 0.05
    with guard(model, **guard_options) as g:
        for step in range(steps):
            x, y = data[step % len(data)]
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            with torch.no_grad():
                for p in model.parameters():
                    p -= lr * p.grad
                    if fixed:
                        p.grad = None
    return g


if __name__ == "__main__":
    import sys

    train(fixed="--fixed" in sys.argv, live=True)
