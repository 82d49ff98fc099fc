"""F.dropout in forward without `training=`: validation predictions stay random after model.eval()."""
import torch
from torch import nn
import torch.nn.functional as F

from guard import guard


class Net(nn.Module):
    def __init__(self, fixed: bool):
        super().__init__()
        self.fixed = fixed
        self.fc1, self.fc2 = nn.Linear(10, 64), nn.Linear(64, 3)

    def forward(self, x):
        h = F.relu(self.fc1(x))
        if self.fixed:
            h = F.dropout(h, p=0.3, training=self.training)
        else:
            h = F.dropout(h, p=0.3)  # training defaults to True: on in eval too
        return self.fc2(h)


def train(fixed: bool = False, steps: int = 6, **guard_options):
    torch.manual_seed(0)
    model = Net(fixed)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    x_val = torch.randn(64, 10)
    with guard(model, optimizer, **guard_options) as g:
        for _ in range(steps):
            model.train()
            x, y = torch.randn(32, 10), torch.randint(0, 3, (32,))
            loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            model.eval()
            with torch.no_grad():
                model(x_val)  # validation: should be deterministic
    return g


if __name__ == "__main__":
    import sys

    train(fixed="--fixed" in sys.argv, live=True)
