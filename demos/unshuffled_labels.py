"""A dataset stored class by class, loaded with shuffle=False: every training batch holds a single class."""
import torch
from torch import nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from guard import guard


def train(fixed: bool = False, epochs: int = 1, **guard_options):
    torch.manual_seed(0)
    centers = torch.randn(5, 12) * 2
    labels = torch.arange(5).repeat_interleave(64)  # 64 samples of class 0, then 64 of class 1, ...
    features = centers[labels] + torch.randn(len(labels), 12)
    train_loader = DataLoader(TensorDataset(features, labels), batch_size=16, shuffle=fixed)
    model = nn.Sequential(nn.Linear(12, 32), nn.ReLU(), nn.Linear(32, 5))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    with guard(model, optimizer, **guard_options) as g:
        for _ in range(epochs):
            for x, y in train_loader:
                loss = F.cross_entropy(model(x), y)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
    return g


if __name__ == "__main__":
    import sys

    train(fixed="--fixed" in sys.argv, live=True)
