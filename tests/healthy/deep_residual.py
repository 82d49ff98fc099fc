"""Deep nets whose gradients reach the first layers: a 24-block residual MLP with LayerNorm and tanh, after a
pretrained embedding with tiny gradients and a frozen first projection."""
import torch
from torch import nn
import torch.nn.functional as F

from ._common import maybe_guard


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.norm, self.fc = nn.LayerNorm(d), nn.Linear(d, d)

    def forward(self, x):
        return x + torch.tanh(self.fc(self.norm(x)))


class Net(nn.Module):
    def __init__(self, d=24, depth=24):
        super().__init__()
        self.emb = nn.Embedding(50, d)
        self.proj = nn.Linear(d, d)
        self.blocks = nn.Sequential(*[Block(d) for _ in range(depth)])
        self.head = nn.Linear(d, 4)

    def forward(self, idx):
        e = self.emb(idx).mean(1)
        e = e.detach() + (e - e.detach()) * 1e-7  # pretrained: nudged by a 1e-7 gradient multiplier only
        return self.head(self.blocks(self.proj(e)))


def train(use_guard=True, **guard_options):
    torch.manual_seed(0)
    model = Net()
    model.proj.requires_grad_(False)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.05, momentum=0.9)
    with maybe_guard(use_guard, model, opt, **guard_options) as g:
        for _ in range(25):
            idx, y = torch.randint(0, 50, (16, 5)), torch.randint(0, 4, (16,))
            loss = F.cross_entropy(model(idx), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
    return g, model
