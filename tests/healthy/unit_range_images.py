"""Images scaled to [0, 1] (ToTensor) with a BatchNorm stem, trained with a final batch larger than one."""
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from ._common import maybe_guard


def train(use_guard=True, **guard_options):
    torch.manual_seed(0)
    images = torch.randint(0, 256, (22, 3, 8, 8)).float() / 255.0
    labels = torch.randint(0, 2, (22,))
    loader = DataLoader(TensorDataset(images, labels), batch_size=8)  # batches of 8, 8, 6
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                          nn.Linear(4, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with maybe_guard(use_guard, model, opt, **guard_options) as g:
        for _ in range(2):
            for x, y in loader:
                loss = nn.functional.cross_entropy(model(x), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
    return g, model
