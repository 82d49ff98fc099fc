"""Mixed precision with a GradScaler, gradients clipped before `scaler.unscale_`: the clip acts on scaled grads."""
import torch
from torch import nn
import torch.nn.functional as F

from guard import guard


def train(fixed: bool = False, steps: int = 6, **guard_options):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu")
    with guard(model, optimizer, **guard_options) as g:
        for _ in range(steps):
            x, y = torch.randn(16, 8), torch.randint(0, 3, (16,))
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad()
            scaler.scale(loss).backward()
            if fixed:
                scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
            scaler.step(optimizer)
            scaler.update()
    return g


if __name__ == "__main__":
    import sys

    train(fixed="--fixed" in sys.argv, live=True)
