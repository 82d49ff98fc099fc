"""A learning-rate scheduler that reaches 0 long before training ends: the model stops changing."""
import torch
from torch import nn
import torch.nn.functional as F

from guard import guard


def train(fixed: bool = False, steps: int = 40, **guard_options):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    decay_steps = steps if fixed else 10  # bug: the decay length taken from another config (epochs, not steps)
    sched = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: max(0.0, 1 - s / decay_steps))
    with guard(model, optimizer, **guard_options) as g:
        for _ in range(steps):
            x, y = torch.randn(32, 10), torch.randint(0, 3, (32,))
            loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            sched.step()
    return g


if __name__ == "__main__":
    import sys

    train(fixed="--fixed" in sys.argv, live=True)
