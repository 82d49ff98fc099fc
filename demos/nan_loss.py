"""A hand-written loss that takes log(0): the model is fine, the loss is NaN/Inf."""
import torch
from torch import nn

from guard import guard


def my_bce(prob, target, fixed):
    if fixed:
        prob = prob.clamp(1e-7, 1 - 1e-7)
    return -(target * torch.log(prob) + (1 - target) * torch.log(1 - prob)).mean()


def train(fixed: bool = False, steps: int = 10, **guard_options):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 1), nn.Sigmoid())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    with guard(model, optimizer, **guard_options) as g:
        for step in range(steps):
            x = torch.randn(64, 4) * 40  # large, unscaled features saturate the sigmoid to exactly 0/1
            y = (x[:, :1] > 0).float()
            loss = my_bce(model(x), y, fixed)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    return g


if __name__ == "__main__":
    import sys

    train(fixed="--fixed" in sys.argv, live=True)
