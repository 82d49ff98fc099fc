"""Resuming from a checkpoint saved by a DataParallel model: every key has a `module.` prefix (seed note 9)."""
import io

import torch
from torch import nn

from guard import guard


def _net():
    return nn.Sequential(nn.Linear(10, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 2))


def train(fixed: bool = False, steps: int = 3, **guard_options):
    torch.manual_seed(0)
    buf = io.BytesIO()
    torch.save(nn.DataParallel(_net()).state_dict(), buf)  # what a multi-GPU run saved
    buf.seek(0)
    model = _net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(32, 10), torch.randint(0, 2, (32,))
    try:
        with guard(model, optimizer, **guard_options) as g:
            state = torch.load(buf)
            if fixed:
                state = {k.removeprefix("module."): v for k, v in state.items()}
            model.load_state_dict(state)  # BUG unless fixed: keys are module.0.weight, ...
            for _ in range(steps):
                loss = nn.functional.cross_entropy(model(x), y)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
    except RuntimeError as exc:
        print(f"training crashed: {str(exc).splitlines()[0]}")
        for note in getattr(exc, "__notes__", []):
            print(note)
    return g


if __name__ == "__main__":
    import sys

    train(fixed="--fixed" in sys.argv, live=True)
