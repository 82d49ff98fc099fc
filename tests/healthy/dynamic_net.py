"""pytorch/tutorials' dynamic_net: each forward adds the x^4 (and x^5) terms a random number of times,
so the gradient norm jumps ~10x from step to step by design (control flow and weight sharing)."""
import math
import random

import torch
from torch import nn

from ._common import maybe_guard


class DynamicNet(nn.Module):
    def __init__(self):
        super().__init__()
        # where the tutorial's 30000 steps end up (its printout): late training, when the random extra
        # terms dominate the residual and the gradient norm jumps by 10x and more from step to step
        init = (-0.0114, 0.8536, 0.0020, -0.0928, 0.0001)
        self.a, self.b, self.c, self.d, self.e = (nn.Parameter(torch.tensor(v)) for v in init)

    def forward(self, x):
        y = self.a + self.b * x + self.c * x ** 2 + self.d * x ** 3
        for exp in range(4, random.randint(4, 6)):
            y = y + self.e * x ** exp
        return y


def train(use_guard=True, steps=220, **guard_options):
    torch.manual_seed(0)
    random.seed(0)
    x = torch.linspace(-math.pi, math.pi, 2000)
    y = torch.sin(x)
    model = DynamicNet()
    opt = torch.optim.SGD(model.parameters(), lr=1e-8, momentum=0.9)
    with maybe_guard(use_guard, model, opt, **guard_options) as g:
        for _ in range(steps):
            loss = (model(x) - y).pow(2).sum()
            opt.zero_grad()
            loss.backward()
            opt.step()
    return g, model
