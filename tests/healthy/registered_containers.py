"""Module containers done right: ModuleList aliased by a plain list, lists of functions and tensors, a module shared
by two registered parents, a frozen teacher hidden in a plain list on purpose; frozen BatchNorm on purpose."""
import torch
import torch.nn.functional as F
from torch import nn

from ._common import maybe_guard


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 8)])
        self.order = list(self.layers)  # the same modules, registered through self.layers
        self.acts = [torch.relu, F.gelu]  # plain functions
        self.scales = [torch.ones(8), torch.full((8,), 0.5)]  # plain tensors
        shared = nn.Linear(8, 8)
        self.enc = nn.Sequential(shared, nn.BatchNorm1d(8), nn.ReLU())
        self.dec = nn.Sequential(shared, nn.Dropout(0.1))  # shared on purpose
        self._teacher = [nn.Linear(8, 8).requires_grad_(False)]  # kept out of state_dict() on purpose
        self.out = nn.Linear(8, 1)

    def forward(self, x):
        for layer, act, s in zip(self.order, self.acts, self.scales):
            x = act(layer(x)) * s
        with torch.no_grad():
            hint = self._teacher[0](x)
        return self.out(self.dec(self.enc(x)) + 0.1 * hint)


def train(use_guard=True, **guard_options):
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with maybe_guard(use_guard, model, opt, **guard_options) as g:
        model.train()
        model.enc[1].eval()  # frozen BatchNorm: only the BN layer in eval mode while the rest trains
        for _ in range(6):
            x, y = torch.randn(16, 8), torch.randn(16, 1)
            opt.zero_grad()
            loss = F.mse_loss(model(x), y)
            loss.backward()
            opt.step()
    return g, model
