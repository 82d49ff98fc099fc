"""Dropout done right: nn.Dropout, F.dropout(training=self.training), and Monte Carlo dropout on purpose at
evaluation (model.eval(), then only the dropout modules switched back to train mode)."""
import torch
from torch import nn
import torch.nn.functional as F

from ._common import maybe_guard


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(6, 32), nn.Linear(32, 32), nn.Linear(32, 3)
        self.drop = nn.Dropout(0.2)

    def forward(self, x):
        h = F.dropout(F.relu(self.fc1(x)), 0.2, training=self.training)
        h = F.dropout(F.relu(self.fc2(h)), 0.1, self.training)
        return self.fc3(self.drop(h))


def train(use_guard=True, **guard_options):
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with maybe_guard(use_guard, model, opt, **guard_options) as g:
        for _ in range(6):
            model.train()
            x, y = torch.randn(16, 6), torch.randint(0, 3, (16,))
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
        model.eval()
        model.drop.train()  # Monte Carlo dropout: sample predictions with the dropout module on
        with torch.no_grad():
            torch.stack([model(torch.randn(4, 6)) for _ in range(3)]).std(0)
    return g, model
