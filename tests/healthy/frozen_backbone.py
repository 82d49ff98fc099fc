"""Fine-tuning with a frozen backbone: requires_grad_(False), backbone in eval, only the head optimized."""
import torch
from torch import nn

from ._common import maybe_guard


def train(use_guard=True, **guard_options):
    torch.manual_seed(0)
    backbone = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                             nn.AdaptiveAvgPool2d(1), nn.Flatten())
    head = nn.Linear(8, 4)
    model = nn.Sequential(backbone, head)
    backbone.requires_grad_(False)
    backbone.eval()  # frozen BatchNorm keeps its running statistics
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    with maybe_guard(use_guard, model, opt, **guard_options) as g:
        for _ in range(6):
            x = torch.randn(8, 3, 8, 8)
            y = torch.randint(0, 4, (8,))
            loss = nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
    return g, model
