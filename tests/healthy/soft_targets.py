"""Cross-entropy with probability targets (mixup) and label smoothing; ignore_index=-100 padding in a tagger."""
import torch
from torch import nn

from ._common import maybe_guard


def train(use_guard=True, **guard_options):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with maybe_guard(use_guard, model, opt, **guard_options) as g:
        for step in range(10):
            x, y = torch.randn(16, 6), torch.randint(0, 4, (16,))
            if step % 2 == 0:  # mixup: soft (probability) targets are legal for cross_entropy
                lam = 0.7
                perm = torch.randperm(16)
                x = lam * x + (1 - lam) * x[perm]
                target = lam * nn.functional.one_hot(y, 4).float() + (1 - lam) * nn.functional.one_hot(y[perm], 4).float()
                loss = nn.functional.cross_entropy(model(x), target)
            else:  # token tagging with padding marked -100 (the default ignore_index)
                y[-4:] = -100
                loss = nn.CrossEntropyLoss(label_smoothing=0.1)(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
    return g, model
