"""An in-place `+=` on a tensor a layer saved for backward: "modified by an inplace operation", but which layer?"""
import torch
from torch import nn

from guard import guard


class Block(nn.Module):
    def __init__(self, fixed: bool):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.gate = nn.Sigmoid()  # saves its output for backward
        self.fixed = fixed

    def forward(self, x):
        h = self.gate(self.fc(x))
        if self.fixed:
            h = h + x
        else:
            h += x  # BUG: changes the tensor Sigmoid saved
        return h


def train(fixed: bool = False, steps: int = 3, **guard_options):
    torch.manual_seed(0)
    model = nn.Sequential(Block(fixed), nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    x, y = torch.randn(16, 8), torch.randn(16, 1)
    try:
        with guard(model, optimizer, **guard_options) as g:
            for _ in range(steps):
                loss = nn.functional.mse_loss(model(x), y)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
    except RuntimeError as exc:
        print(f"training crashed: {str(exc).splitlines()[0][:100]}...")
        for note in getattr(exc, "__notes__", []):
            print(note)
    return g


if __name__ == "__main__":
    import sys

    train(fixed="--fixed" in sys.argv, live=True)
