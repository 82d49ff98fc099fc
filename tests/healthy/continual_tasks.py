"""Continual learning, plain fine-tuning from task to task: each task is learned until its gradients are tiny,
then the next task's first batches have the gradients of an untrained model again (no explosion)."""
import torch
from torch import nn
import torch.nn.functional as F

from ._common import maybe_guard


def _task(t, n=256, d=20):
    g = torch.Generator().manual_seed(100 + t)
    centers = torch.randn(2, d, generator=g) * 2
    y = torch.randint(0, 2, (n,), generator=g)
    return centers[y] + torch.randn(n, d, generator=g), y


def train(use_guard=True, **guard_options):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    with maybe_guard(use_guard, model, opt, **guard_options) as g:
        for t in range(3):
            x, y = _task(t)
            for _ in range(60):
                idx = torch.randint(0, len(x), (32,))
                loss = F.cross_entropy(model(x[idx]), y[idx])
                opt.zero_grad()
                loss.backward()
                opt.step()
    return g, model
