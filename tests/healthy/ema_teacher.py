"""A mean-teacher / EMA setup: AveragedModel updated after each step, teacher run under no_grad."""
import copy

import torch
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

from ._common import maybe_guard


def train(use_guard=True, **guard_options):
    torch.manual_seed(0)
    student = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    teacher = copy.deepcopy(student).requires_grad_(False)
    ema = AveragedModel(student, multi_avg_fn=get_ema_multi_avg_fn(0.9))
    opt = torch.optim.Adam(student.parameters(), lr=1e-2)
    with maybe_guard(use_guard, student, opt, **guard_options) as g:
        for _ in range(8):
            x = torch.randn(16, 8)
            with torch.no_grad():
                soft = torch.softmax(teacher(x) / 2.0, dim=-1)
            logp = torch.log_softmax(student(x) / 2.0, dim=-1)
            loss = nn.functional.kl_div(logp, soft, reduction="batchmean")
            opt.zero_grad()
            loss.backward()
            opt.step()
            ema.update_parameters(student)
            with torch.no_grad():
                for pt, ps in zip(teacher.parameters(), student.parameters()):
                    pt.mul_(0.9).add_(ps, alpha=0.1)
        ema.eval()
        with torch.no_grad():
            ema(torch.randn(4, 8))
    return g, student
