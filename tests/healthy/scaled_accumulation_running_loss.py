"""Accumulation as HF Trainer and Lightning do it: (loss / accum).backward(), a running loss kept as a number."""
import torch
from torch import nn

from ._common import maybe_guard


def train(use_guard=True, **guard_options):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    accum, running = 2, 0.0
    with maybe_guard(use_guard, model, opt, **guard_options) as g:
        for i in range(24):
            x, y = torch.randn(8, 8), torch.randn(8, 1)
            out = model(x)
            loss = nn.functional.mse_loss(out, y)
            running += loss.detach()  # a tensor without graph: fine
            (loss / accum).backward()
            if i % accum == accum - 1:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                opt.zero_grad()
    return g, model
