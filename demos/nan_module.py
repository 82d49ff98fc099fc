"""A layer that makes NaN from finite inputs: guard names the module of origin, not the loss."""
import torch
from torch import nn

from guard import guard


class LogScale(nn.Module):
    """A hand-written feature scaling: log of the activations (undefined for values <= 0)."""

    def __init__(self, fixed: bool):
        super().__init__()
        self.fixed = fixed

    def forward(self, x):
        if self.fixed:
            return torch.log1p(x.clamp_min(0))
        return torch.log(x)  # NaN for negative inputs


class Net(nn.Module):
    def __init__(self, fixed: bool):
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32))
        self.scale = LogScale(fixed)
        self.head = nn.Linear(32, 4)

    def forward(self, x):
        return self.head(self.scale(self.encoder(x)))


def train(fixed: bool = False, steps: int = 8, **guard_options):
    torch.manual_seed(0)
    model = Net(fixed)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    with guard(model, optimizer, **guard_options) as g:
        for step in range(steps):
            x, y = torch.randn(32, 16), torch.randint(0, 4, (32,))
            loss = nn.functional.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    return g


if __name__ == "__main__":
    import sys

    train(fixed="--fixed" in sys.argv, live=True)
