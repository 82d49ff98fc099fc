"""`x.to(device)` without assignment: the model is on the accelerator, the batch stays on the CPU (seed notes: Tensor.cuda() returns a copy)."""
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from guard import guard

# On a CPU-only machine the "meta" device stands in for the GPU: a meta model cannot compute with CPU tensors either.
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "meta")


def train(fixed: bool = False, steps: int = 4, device=DEVICE, **guard_options):
    torch.manual_seed(0)
    x = torch.randn(64, 10)
    y = torch.randint(0, 3, (64,))
    loader = DataLoader(TensorDataset(x, y), batch_size=16, shuffle=True)
    model = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 3))
    model.to(device)  # nn.Module.to moves the model in place
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loss_fn = nn.CrossEntropyLoss()
    try:
        with guard(model, optimizer, **guard_options) as g:
            for step, (xb, yb) in zip(range(steps), loader):
                if fixed:
                    xb, yb = xb.to(device), yb.to(device)
                else:
                    xb.to(device)  # BUG: Tensor.to returns a copy, xb is still on the CPU
                    yb.to(device)
                loss = loss_fn(model(xb), yb)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
    except RuntimeError as exc:
        print(f"training crashed: {exc}")
    return g


if __name__ == "__main__":
    import sys

    train(fixed="--fixed" in sys.argv, live=True)
