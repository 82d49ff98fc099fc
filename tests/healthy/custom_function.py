"""A custom torch.autograd.Function (straight-through clamp) inside the model."""
import torch
from torch import nn

from ._common import maybe_guard


class StraightThroughClamp(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x.clamp(-1, 1)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return grad * (x.abs() < 2).to(grad.dtype)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 16)
        self.b = nn.Linear(16, 1)

    def forward(self, x):
        return self.b(StraightThroughClamp.apply(self.a(x)))


def train(use_guard=True, **guard_options):
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    with maybe_guard(use_guard, model, opt, **guard_options) as g:
        for _ in range(8):
            x, y = torch.randn(16, 4), torch.randn(16, 1)
            loss = nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
    return g, model
