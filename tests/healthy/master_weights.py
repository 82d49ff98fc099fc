"""fp32 master weights by hand (the apex / fairseq FP16_Optimizer loop): the optimizer holds float32 copies of a
half-precision model's weights (plain tensors, or a deepcopy of the model), gets the model's gradients copied
over, steps, and the copies are written back into the model."""
import copy

import torch
from torch import nn
import torch.nn.functional as F

from ._common import maybe_guard


def train(use_guard=True, **guard_options):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1)).bfloat16()
    master_model = copy.deepcopy(model).float()
    master = list(master_model.parameters())
    opt = torch.optim.SGD(master, lr=1e-2, momentum=0.9)
    x = torch.randn(64, 8)
    y = x.sum(1, keepdim=True)
    with maybe_guard(use_guard, model, opt, **guard_options) as g:
        for _ in range(24):
            loss = F.mse_loss(model(x.bfloat16()).float(), y)
            model.zero_grad(set_to_none=True)
            loss.backward()
            for m, p in zip(master, model.parameters()):
                m.grad = p.grad.float()
            opt.step()
            with torch.no_grad():
                for m, p in zip(master, model.parameters()):
                    p.copy_(m)
    return g, model
