"""A dataset of 161 samples in batches of 32 ends each epoch with a batch of 1: BatchNorm crashes there."""
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from guard import guard


def train(fixed: bool = False, epochs: int = 2, **guard_options):
    torch.manual_seed(0)
    x = torch.randn(161, 12)
    y = (x[:, 0] > 0).long()
    loader = DataLoader(TensorDataset(x, y), batch_size=32, shuffle=True, drop_last=fixed)
    model = nn.Sequential(nn.Linear(12, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loss_fn = nn.CrossEntropyLoss()
    try:
        with guard(model, optimizer, **guard_options) as g:
            for epoch in range(epochs):
                model.train()
                for xb, yb in loader:
                    loss = loss_fn(model(xb), yb)
                    optimizer.zero_grad()
                    loss.backward()
                    optimizer.step()
    except ValueError as exc:  # the crash guard predicted at step 0
        print(f"training crashed: {exc}")
    return g


if __name__ == "__main__":
    import sys

    train(fixed="--fixed" in sys.argv, live=True)
