"""AdamW with parameter groups: decay for weights, none for biases and norm parameters."""
import torch
from torch import nn

from ._common import maybe_guard


def train(use_guard=True, **guard_options):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.ReLU(), nn.Linear(16, 4))
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.05},
                             {"params": no_decay, "weight_decay": 0.0}], lr=1e-2)
    with maybe_guard(use_guard, model, opt, **guard_options) as g:
        for _ in range(8):
            x, y = torch.randn(16, 8), torch.randint(0, 4, (16,))
            loss = nn.functional.cross_entropy(model(x), y, label_smoothing=0.1)
            opt.zero_grad()
            loss.backward()
            opt.step()
    return g, model
