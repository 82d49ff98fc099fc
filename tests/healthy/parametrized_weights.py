"""Parametrized weights (torch.nn.utils.parametrize): orthogonal, spectral_norm and weight_norm layers, and the
orthogonality error logged by reading the parametrized weight outside the model's call (a parameter read that
computes the parametrization, not an evaluation forward)."""
import torch
from torch import nn
import torch.nn.functional as F
from torch.nn.utils.parametrizations import orthogonal, spectral_norm, weight_norm

from ._common import maybe_guard


def train(use_guard=True, **guard_options):
    torch.manual_seed(0)
    # built here, so that a global guard already running sees the registrations call the parametrizations
    model = nn.Sequential(weight_norm(nn.Linear(6, 16)), nn.Tanh(), orthogonal(nn.Linear(16, 16)), nn.Tanh(),
                          spectral_norm(nn.Linear(16, 3)))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    errors = []
    with maybe_guard(use_guard, model, opt, **guard_options) as g:
        for step in range(8):
            x, y = torch.randn(16, 6), torch.randint(0, 3, (16,))
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            w = model[2].weight  # the parametrization runs here, outside the model's call, with grad on
            errors.append((w @ w.T - torch.eye(16)).abs().max().item())
    return g, model
