"""`model.eval()` for validation and no `model.train()` after it: later epochs train without dropout/BatchNorm."""
import torch
from torch import nn

from guard import guard


def train(fixed: bool = False, epochs: int = 3, **guard_options):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(12, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    criterion = nn.CrossEntropyLoss()
    train_data = [(torch.randn(16, 12), torch.randint(0, 2, (16,))) for _ in range(4)]
    val_data = [(torch.randn(16, 12), torch.randint(0, 2, (16,))) for _ in range(2)]
    with guard(model, optimizer, **guard_options) as g:
        model.train()  # only once, before the loop
        for epoch in range(epochs):
            if fixed:
                model.train()  # at the start of every epoch
            for x, y in train_data:
                optimizer.zero_grad()
                criterion(model(x), y).backward()
                optimizer.step()
            model.eval()  # validation
            with torch.no_grad():
                val_loss = sum(criterion(model(x), y).item() for x, y in val_data) / len(val_data)
    return g


if __name__ == "__main__":
    import sys

    train(fixed="--fixed" in sys.argv, live=True)
