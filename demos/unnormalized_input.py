"""uint8 images cast to float without scaling or normalizing: a conv net gets pixels in 0..255 (seed notes: Normalize(mean, std))."""
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from guard import guard

MEAN = torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1)
STD = torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1)


def train(fixed: bool = False, steps: int = 4, **guard_options):
    torch.manual_seed(0)
    base = torch.rand(1, 3, 1, 1) * 0.5 + 0.25
    pixels = ((base + 0.2 * torch.randn(64, 3, 16, 16)).clamp(0, 1) * 255).to(torch.uint8)  # as decoded from JPEG
    labels = torch.randint(0, 4, (64,))
    loader = DataLoader(TensorDataset(pixels, labels), batch_size=16, shuffle=True)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                          nn.Linear(8, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    loss_fn = nn.CrossEntropyLoss()
    with guard(model, optimizer, **guard_options) as g:
        for step, (xb, yb) in zip(range(steps), loader):
            if fixed:
                xb = (xb.float() / 255 - MEAN) / STD  # ToTensor() + Normalize(mean, std)
            else:
                xb = xb.float()  # BUG: 0..255
            loss = loss_fn(model(xb), yb)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    return g


if __name__ == "__main__":
    import sys

    train(fixed="--fixed" in sys.argv, live=True)
