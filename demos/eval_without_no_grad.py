"""Validation outside `torch.no_grad()`: every evaluation batch builds a graph nobody back-propagates."""
import torch
from torch import nn

from guard import guard


def train(fixed: bool = False, epochs: int = 3, **guard_options):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 5))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    criterion = nn.CrossEntropyLoss()
    train_data = [(torch.randn(32, 20), torch.randint(0, 5, (32,))) for _ in range(4)]
    val_data = [(torch.randn(64, 20), torch.randint(0, 5, (64,))) for _ in range(3)]

    def evaluate():
        model.eval()
        correct = 0
        for x, y in val_data:
            correct += (model(x).argmax(1) == y).sum().item()
        model.train()
        return correct / sum(len(y) for _, y in val_data)

    with guard(model, optimizer, **guard_options) as g:
        for epoch in range(epochs):
            for x, y in train_data:
                optimizer.zero_grad()
                loss = criterion(model(x), y)
                loss.backward()
                optimizer.step()
            if fixed:
                with torch.no_grad():
                    acc = evaluate()
            else:
                acc = evaluate()  # the bug: the forwards record graphs for a backward that never comes
    return g


if __name__ == "__main__":
    import sys

    train(fixed="--fixed" in sys.argv, live=True)
