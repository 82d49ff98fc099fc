"""A GAN: the discriminator step sees fake.detach(); each network has its own optimizer and zero_grad."""
import torch
from torch import nn

from ._common import maybe_guard


def train(use_guard=True, **guard_options):
    torch.manual_seed(0)
    G = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 2))
    D = nn.Sequential(nn.Linear(2, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1))
    opt_g = torch.optim.Adam(G.parameters(), lr=2e-4, betas=(0.5, 0.999))
    opt_d = torch.optim.Adam(D.parameters(), lr=2e-4, betas=(0.5, 0.999))
    bce = nn.BCEWithLogitsLoss()
    with maybe_guard(use_guard, [G, D], [opt_g, opt_d], **guard_options) as g:
        for _ in range(6):
            real = torch.randn(16, 2) + 3
            fake = G(torch.randn(16, 4))
            opt_d.zero_grad()
            d_loss = bce(D(real), torch.ones(16, 1)) + bce(D(fake.detach()), torch.zeros(16, 1))
            d_loss.backward()
            opt_d.step()
            opt_g.zero_grad()
            g_loss = bce(D(fake), torch.ones(16, 1))
            g_loss.backward()
            opt_g.step()
    return g, nn.ModuleList([G, D])
