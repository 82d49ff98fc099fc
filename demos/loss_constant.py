"""A binary classifier with one output unit trained with cross_entropy: over one class the loss is always 0."""
import torch
from torch import nn
import torch.nn.functional as F

from guard import guard


def train(fixed: bool = False, steps: int = 8, **guard_options):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 1))  # one logit: "is it positive?"
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    w = torch.randn(6)
    with guard(model, optimizer, **guard_options) as g:
        for _ in range(steps):
            x = torch.randn(32, 6)
            y = (x @ w > 0).float().unsqueeze(1)  # [32, 1] of 0/1
            out = model(x)
            if fixed:
                loss = F.binary_cross_entropy_with_logits(out, y)
            else:
                loss = F.cross_entropy(out, y)  # soft targets over C = 1 class: identically 0
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    return g


if __name__ == "__main__":
    import sys

    train(fixed="--fixed" in sys.argv, live=True)
