"""An image classifier: normalized inputs through a DataLoader (drop_last), Conv/BatchNorm, CrossEntropy."""
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from ._common import maybe_guard


def train(use_guard=True, **guard_options):
    torch.manual_seed(0)
    images = torch.rand(50, 3, 8, 8)
    images = (images - 0.5) / 0.25  # normalized
    labels = torch.randint(0, 3, (50,))
    loader = DataLoader(TensorDataset(images, labels), batch_size=8, shuffle=True, drop_last=True)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2),
                          nn.Flatten(), nn.Linear(8 * 4 * 4, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4)
    with maybe_guard(use_guard, model, opt, **guard_options) as g:
        for _ in range(2):
            for x, y in loader:
                loss = nn.functional.cross_entropy(model(x), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
    return g, model
