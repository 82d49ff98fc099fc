"""A deep stack of sigmoid layers: each one shrinks the gradient, the first layers stop learning."""
import torch
from torch import nn
import torch.nn.functional as F

from guard import guard


class Block(nn.Module):
    """Linear + activation; the healthy twin adds LayerNorm, ReLU and a residual connection."""

    def __init__(self, width: int, fixed: bool):
        super().__init__()
        self.fixed = fixed
        self.fc = nn.Linear(width, width)
        self.norm = nn.LayerNorm(width) if fixed else nn.Identity()

    def forward(self, x):
        if self.fixed:
            return x + F.relu(self.fc(self.norm(x)))
        return torch.sigmoid(self.fc(x))


def train(fixed: bool = False, steps: int = 20, depth: int = 16, **guard_options):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), *[Block(32, fixed) for _ in range(depth)], nn.Linear(32, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with guard(model, optimizer, **guard_options) as g:
        for _ in range(steps):
            x, y = torch.randn(64, 8), torch.randint(0, 4, (64,))
            loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    return g


if __name__ == "__main__":
    import sys

    train(fixed="--fixed" in sys.argv, live=True)
