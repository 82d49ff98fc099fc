"""Learning rates that touch 0 on purpose: a warm-up from lr=0 at step 0, a cosine schedule that ends at 0, a
frozen layer, a group parked at lr=0 that gets no gradients, and GradScaler steps it skips."""
import math

import torch
from torch import nn
import torch.nn.functional as F

from ._common import maybe_guard


def train(use_guard=True, **guard_options):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 3))
    model[0].requires_grad_(False)
    later_head = nn.Linear(16, 5)  # trained in a later phase: parked at lr=0, unused (no gradients) for now
    steps, warm = 30, 5
    opt = torch.optim.AdamW([{"params": list(model[2].parameters()) + list(model[4].parameters())},
                             {"params": later_head.parameters(), "lr": 0.0}], lr=1e-3)
    shape = lambda s: s / warm if s < warm else 0.5 * (1 + math.cos(math.pi * (s - warm) / (steps - 1 - warm)))  # noqa
    sched = torch.optim.lr_scheduler.LambdaLR(opt, shape)
    scaler = torch.amp.GradScaler("cpu")
    with maybe_guard(use_guard, model, opt, **guard_options) as g:
        for i in range(steps):
            x, y = torch.randn(16, 6), torch.randint(0, 3, (16,))
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            scaler.scale(loss).backward()
            if i in (7, 19):  # an overflow now and then: the scaler skips those steps
                model[4].weight.grad[0, 0] = float("inf")
            scaler.unscale_(opt)
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
            sched.step()
    return g, model
