"""Train / evaluate alternation: evaluation under torch.no_grad() (and inference_mode) with model.eval()."""
import torch
from torch import nn

from ._common import maybe_guard


def train(use_guard=True, **guard_options):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with maybe_guard(use_guard, model, opt, **guard_options) as g:
        for epoch in range(3):
            model.train()
            for _ in range(3):
                x, y = torch.randn(16, 8), torch.randint(0, 3, (16,))
                loss = nn.functional.cross_entropy(model(x), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
            model.eval()
            ctx = torch.no_grad() if epoch % 2 == 0 else torch.inference_mode()
            with ctx:
                for _ in range(2):
                    x, y = torch.randn(32, 8), torch.randint(0, 3, (32,))
                    acc = (model(x).argmax(1) == y).float().mean()
        model.train()
    return g, model
