"""BYOL/MoCo: a target network (a deep copy with BatchNorm) updated as an EMA of the online one and run under
no_grad in training mode at every step, on purpose (its BatchNorm uses batch statistics, as the papers do);
then the EMA copy is evaluated in eval mode."""
import copy

import torch
import torch.nn.functional as F
from torch import nn

from ._common import maybe_guard


def train(use_guard=True, **guard_options):
    torch.manual_seed(0)
    online = nn.Sequential(nn.Linear(8, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 16))
    predictor = nn.Linear(16, 16)
    target = copy.deepcopy(online).requires_grad_(False)
    opt = torch.optim.Adam([*online.parameters(), *predictor.parameters()], lr=1e-3)
    with maybe_guard(use_guard, None, None, **guard_options) as g:
        for _ in range(12):
            x = torch.randn(32, 8)
            v1, v2 = x + 0.1 * torch.randn_like(x), x + 0.1 * torch.randn_like(x)
            with torch.no_grad():
                z = target(v2)  # train mode on purpose
            loss = 2 - 2 * F.cosine_similarity(predictor(online(v1)), z, dim=-1).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            with torch.no_grad():
                for pt, po in zip(target.parameters(), online.parameters()):
                    pt.lerp_(po, 0.01)
        target.eval()
        with torch.no_grad():
            target(torch.randn(4, 8))
    return g, online
