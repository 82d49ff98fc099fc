"""Checkpointing: save model+optimizer, resume (strict load), and load a backbone into a new head (strict=False)."""
import io

import torch
from torch import nn

from ._common import maybe_guard


def make(classes):
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, classes))


def train(use_guard=True, **guard_options):
    torch.manual_seed(0)
    model = make(3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with maybe_guard(use_guard, model, opt, **guard_options) as g:
        for step in range(8):
            x, y = torch.randn(8, 6), torch.randint(0, 3, (8,))
            loss = nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            if step == 3:
                buf = io.BytesIO()
                torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step}, buf)
                buf.seek(0)
                ckpt = torch.load(buf, weights_only=True)
                model.load_state_dict(ckpt["model"])
                opt.load_state_dict(ckpt["opt"])
        # transfer: same backbone, a new 5-class head; the head keys are left out on purpose
        new = make(5)
        backbone = {k: v for k, v in model.state_dict().items() if not k.startswith("2.")}
        result = new.load_state_dict(backbone, strict=False)
        assert sorted(result.missing_keys) == ["2.bias", "2.weight"] and not result.unexpected_keys
    return g, model
