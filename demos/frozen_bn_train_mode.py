"""A perceptual loss whose frozen feature network keeps BatchNorm in training mode: `model.train()` switches it back.

The feature network is frozen (`requires_grad_(False)`, in no optimizer) and put in `eval()` once. Every epoch's
`model.train()` puts its BatchNorm back in training mode: each step overwrites its pretrained running statistics
with the generator's outputs, and the loss it defines drifts. `--fixed` keeps it in eval mode by overriding train().
"""
import torch
import torch.nn.functional as F
from torch import nn

from guard import guard


class Restorer(nn.Module):
    def __init__(self, keep_features_eval: bool):
        super().__init__()
        self.gen = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 3, 3, padding=1))
        self.features = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                                      nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8))  # stands in for a VGG
        self.features.requires_grad_(False)
        self.features.eval()
        self.keep_features_eval = keep_features_eval

    def train(self, mode: bool = True):
        super().train(mode)
        if self.keep_features_eval:
            self.features.eval()  # the fix: a frozen network stays in eval mode
        return self

    def forward(self, x):
        return x + self.gen(x)

    def loss(self, out, target):
        return F.l1_loss(out, target) + 0.1 * F.mse_loss(self.features(out), self.features(target))


def train(fixed: bool = False, epochs: int = 2, **guard_options):
    torch.manual_seed(0)
    model = Restorer(keep_features_eval=fixed)
    optimizer = torch.optim.Adam(model.gen.parameters(), lr=1e-3)
    data = [(torch.randn(4, 3, 16, 16), torch.randn(4, 3, 16, 16)) for _ in range(3)]
    with guard(model, optimizer, **guard_options) as g:
        for epoch in range(epochs):
            model.train()
            for noisy, clean in data:
                loss = model.loss(model(noisy), clean)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
    return g


if __name__ == "__main__":
    import sys

    train(fixed="--fixed" in sys.argv, live=True)
