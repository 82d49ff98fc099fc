"""Hidden layers kept in a plain Python list: they run and get gradients, but the optimizer never sees them."""
import torch
from torch import nn

from guard import guard


class MLP(nn.Module):
    def __init__(self, fixed: bool = False):
        super().__init__()
        self.inp = nn.Linear(10, 32)
        layers = [nn.Linear(32, 32) for _ in range(3)]
        if fixed:
            self.hidden = nn.ModuleList(layers)
        else:
            self.hidden = layers  # a plain list: not registered
        self.out = nn.Linear(32, 1)

    def forward(self, x):
        x = torch.relu(self.inp(x))
        for layer in self.hidden:
            x = torch.relu(layer(x))
        return self.out(x)


def train(fixed: bool = False, steps: int = 6, **guard_options):
    torch.manual_seed(0)
    model = MLP(fixed)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    data = [(torch.randn(32, 10), torch.randn(32, 1)) for _ in range(3)]
    with guard(model, optimizer, **guard_options) as g:
        for step in range(steps):
            x, y = data[step % len(data)]
            optimizer.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            optimizer.step()
    return g


if __name__ == "__main__":
    import sys

    train(fixed="--fixed" in sys.argv, live=True)
