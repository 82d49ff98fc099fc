"""Logging the running loss correctly: loss.item() / loss.detach() accumulated, metrics computed from outputs."""
import torch
from torch import nn

from ._common import maybe_guard


def train(use_guard=True, **guard_options):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    history = []
    with maybe_guard(use_guard, model, opt, **guard_options) as g:
        running, running_t, correct = 0.0, torch.zeros(()), 0
        for _ in range(12):
            x, y = torch.randn(16, 6), torch.randint(0, 3, (16,))
            logits = model(x)
            loss = nn.functional.cross_entropy(logits, y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            running += loss.item()
            running_t += loss.detach()
            correct += (logits.argmax(1) == y).sum().item()
            history.append(loss.detach())
    return g, model
