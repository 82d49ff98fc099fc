"""Mixed precision on CPU: torch.autocast (bfloat16, and float16 where supported) with torch.amp.GradScaler."""
import torch
from torch import nn

from ._common import maybe_guard


def _fp16_autocast_ok():
    try:
        with torch.autocast("cpu", dtype=torch.float16):
            torch.mm(torch.randn(2, 2), torch.randn(2, 2))
        return True
    except Exception:
        return False


def train(use_guard=True, **guard_options):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.LayerNorm(32), nn.Linear(32, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu")
    dtypes = [torch.bfloat16] + ([torch.float16] if _fp16_autocast_ok() else [])
    with maybe_guard(use_guard, model, opt, **guard_options) as g:
        for i in range(8):
            x, y = torch.randn(16, 8), torch.randint(0, 3, (16,))
            with torch.autocast("cpu", dtype=dtypes[i % len(dtypes)]):
                loss = nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
    return g, model
