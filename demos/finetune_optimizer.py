"""Fine-tuning with the optimizer built too early: frozen backbone handed to it, the new head left out."""
import torch
from torch import nn

from guard import guard


class Net(nn.Module):
    def __init__(self, classes=10):
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU())
        self.head = nn.Linear(32, classes)

    def forward(self, x):
        return self.head(self.backbone(x))


def train(fixed: bool = False, steps: int = 5, **guard_options):
    torch.manual_seed(0)
    model = Net()  # "pretrained" on 10 classes
    if not fixed:
        # Bug: the optimizer is built before the model is final.
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for p in model.backbone.parameters():
        p.requires_grad = False  # freeze the backbone
    model.head = nn.Linear(32, 3)  # new task with 3 classes
    if fixed:
        optimizer = torch.optim.SGD(filter(lambda p: p.requires_grad, model.parameters()), lr=0.05, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    with guard(model, optimizer, **guard_options) as g:
        for _ in range(steps):
            x, y = torch.randn(32, 16), torch.randint(0, 3, (32,))
            optimizer.zero_grad()
            loss_fn(model(x), y).backward()
            optimizer.step()
    return g


if __name__ == "__main__":
    import sys

    train(fixed="--fixed" in sys.argv, live=True)
