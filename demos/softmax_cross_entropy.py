"""The classifier ends with a softmax and CrossEntropyLoss applies another one: gradients vanish."""
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from guard import guard


def train(fixed: bool = False, steps: int = 8, **guard_options):
    torch.manual_seed(0)
    x = torch.randn(128, 20)
    y = x[:, :5].argmax(dim=1)
    loader = DataLoader(TensorDataset(x, y), batch_size=16, shuffle=True)
    layers = [nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 5)]
    if not fixed:
        layers.append(nn.Softmax(dim=1))  # BUG: CrossEntropyLoss wants raw logits
    model = nn.Sequential(*layers)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    loss_fn = nn.CrossEntropyLoss()
    with guard(model, optimizer, **guard_options) as g:
        for step, (xb, yb) in zip(range(steps), loader):
            loss = loss_fn(model(xb), yb)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    return g


if __name__ == "__main__":
    import sys

    train(fixed="--fixed" in sys.argv, live=True)
